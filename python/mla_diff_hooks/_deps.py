"""Optional imports of the hook modules, failing on first use with the extra that installs them.

Why this exists: `pip install mla-diff` installs the `mla-diff` binary and this package with no
Python dependencies; numpy, torch and the engines come with the extras (`mla-diff[hf]`,
`mla-diff[vllm]`, `mla-diff[llama-cpp]`). So every hook module imports without them (an engine
process can `import mla_diff_hooks.vllm` before anything else), and the first attribute read from
a missing package raises one line naming what to install, e.g.
    ModuleNotFoundError: mla_diff_hooks.vllm needs numpy: pip install 'mla-diff[vllm]'
"""

from __future__ import annotations

import importlib
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
