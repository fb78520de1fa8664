"""Optional imports of the hook modules, failing on first use with the extra that installs them.

Why this exists: `pip install mla-diff` installs the `mla-diff` binary and this package with no
Python dependencies; numpy, torch and the engines come with the extras (`mla-diff[hf]`,
`mla-diff[vllm]`, `mla-diff[llama-cpp]`). So every hook module imports without them (an engine
process can `import mla_diff_hooks.vllm` before anything else), and the first attribute read from
a missing package raises one line naming what to install, e.g.
    ModuleNotFoundError: mla_diff_hooks.vllm needs numpy: pip install 'mla-diff[vllm]'
The command lines (`python -m mla_diff_hooks.vllm`, …) run through `run_cli`, which turns a
missing module into one line on stderr and exit status 2 instead of a traceback, and API entry
points that need an engine (`vllm.attach`) call `require` first.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from typing import Any


class _Missing:
    """Stands in for a package that is not installed; any attribute access raises."""

    def __init__(self, name: str, user: str, extra: str | None):
        self._name, self._user, self._extra = name, user, extra

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):  # copy, pickle, inspect probes: plain AttributeError
            raise AttributeError(attr)
        hint = (
            f"pip install 'mla-diff[{self._extra}]'"
            if self._extra
            else "pip install numpy (or one of the extras: 'mla-diff[hf]', 'mla-diff[vllm]', "
            "'mla-diff[llama-cpp]')"
        )
        raise ModuleNotFoundError(f"{self._user} needs {self._name}: {hint}", name=self._name)

    def __bool__(self) -> bool:
        return False


def optional(name: str, user: str, extra: str | None = None) -> Any:
    """`import name`, or a stand-in whose first use raises ModuleNotFoundError naming the extra."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return _Missing(name, user, extra)


# The Python modules each extra installs (pyproject.toml's [project.optional-dependencies]), by
# import name: a module missing from this list is named without an extra.
EXTRA_MODULES = {
    "hf": ("numpy", "torch", "transformers"),
    "vllm": ("numpy", "safetensors", "gguf", "vllm"),
    "llama-cpp": ("numpy", "gguf", "llama_cpp"),
    "kernels": ("numpy", "torch", "safetensors"),
}

# The first words of a command line's error line, as the hooks' other refusals write them.
ERROR_PREFIX = "mla-diff-hooks: error: "


def _installed(name: str) -> bool:
    if name in sys.modules:  # imported already (or a stand-in a test put there)
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def missing_message(user: str, module: str, extra: str) -> str:
    """`USER needs MODULE, which is not installed: pip install 'mla-diff[EXTRA]'` (or, for a
    module no extra installs, `pip install MODULE`)."""
    top = module.split(".")[0]
    if top in EXTRA_MODULES.get(extra, ()):
        how = f"this needs the [{extra}] extra: pip install 'mla-diff[{extra}]'"
    else:
        how = f"pip install {top.replace('_', '-')}"
    return f"{user} needs {top}, which is not installed; {how}"


def require(user: str, extra: str, modules: tuple[str, ...] | None = None) -> None:
    """Raise ModuleNotFoundError with one line naming the extra when one of `modules` (default:
    every module of the extra) is not installed; for API entry points such as `vllm.attach`."""
    for m in EXTRA_MODULES[extra] if modules is None else modules:
        if not _installed(m):
            raise ModuleNotFoundError(missing_message(user, m, extra), name=m)


def run_cli(main: Callable[[], Any], user: str, extra: str) -> Any:
    """Run a module's command line `main`: a module that is not installed ends it with one line
    on stderr, `mla-diff-hooks: error: USER needs MODULE, which is not installed; this needs the
    [EXTRA] extra: pip install 'mla-diff[EXTRA]'`, and exit status 2, instead of a traceback.
    An import that fails for another reason (a module that is installed) keeps its traceback."""
    try:
        return main()
    except ModuleNotFoundError as e:
        top = (e.name or "").split(".")[0]
        if not top or _installed(top):
            raise
        print(ERROR_PREFIX + missing_message(user, top, extra), file=sys.stderr)
        raise SystemExit(2) from None
