"""The installed package: every module imports with nothing but the standard library, a missing
dependency fails with one line naming the extra, and the command lines start.

Why this exists: `pip install mla-diff` installs no Python dependencies (they are the extras), so
`import mla_diff_hooks.vllm` inside an engine process, and `python -m mla_diff_hooks.<engine>`,
must work before numpy or torch is ever touched.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from support import ROOT, find_mla_diff, hooks_module
from test_llama_cpp import _env

MODULES = ["vllm", "hf", "hf_hooks", "llama_cpp", "st_io", "dump_format", "kernels", "vllm_cpu", "plants"]


def _py(code: str, *args: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter where numpy, torch and the engines cannot be imported
    (a meta-path finder refuses them, as if not installed)."""
    block = (
        "import sys, importlib.abc\n"
        "class _Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in {'numpy', 'torch', 'safetensors', 'gguf', 'transformers',"
        " 'vllm', 'llama_cpp'}:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, _Block())\n"
    )
    return subprocess.run(
        [sys.executable, "-c", block + code, *args], capture_output=True, text=True, env=_env()
    )


@pytest.mark.parametrize("mod", MODULES)
def test_imports_without_dependencies(mod):
    r = _py(f"import mla_diff_hooks.{mod} as m; print(m.__name__)")
    assert r.returncode == 0 and r.stdout.strip() == f"mla_diff_hooks.{mod}", r.stderr


def test_missing_numpy_is_one_line_naming_the_extra(tmp_path):
    r = _py("from mla_diff_hooks import vllm\nvllm.infer_seq_lens(vllm.np.array([0, 1]))")
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1
    assert last == ("ModuleNotFoundError: mla_diff_hooks.vllm needs numpy: pip install 'mla-diff[vllm]'")
    r = _py("from mla_diff_hooks import st_io\nst_io.save({}, 'x.safetensors')")
    assert (
        r.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "ModuleNotFoundError: mla_diff_hooks.st_io needs numpy: pip install numpy (or one of the extras"
        )
    )
    r = _py("from mla_diff_hooks import kernels\nkernels.synth('x', 4, 2, 4, 0)")
    assert r.stderr.strip().splitlines()[-1] == (
        "ModuleNotFoundError: mla_diff_hooks.kernels needs torch: pip install 'mla-diff[kernels]'"
    )


def _extra_line(mod: str, missing: str, extra: str) -> str:
    return (
        f"mla-diff-hooks: error: python -m mla_diff_hooks.{mod} needs {missing}, which is not installed; "
        f"this needs the [{extra}] extra: pip install 'mla-diff[{extra}]'"
    )


def _run_module(mod: str, *args: str) -> subprocess.CompletedProcess:
    """`python -m mla_diff_hooks.MOD ARGS` where numpy, torch and the engines are not installed."""
    return _py(
        f"import runpy\nsys.argv = ['{mod}', *sys.argv[1:]]\n"
        f"runpy.run_module('mla_diff_hooks.{mod}', run_name='__main__', alter_sys=True)",
        *args,
    )


def test_command_lines_without_their_extra_end_in_one_line_naming_it(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    cases = [
        ("vllm", ["m.gguf", "--tokens", "1,2", "--dump", str(tmp_path / "d.safetensors")], "vllm", "vllm"),
        ("hf", [str(tmp_path / "hf"), str(tmp_path / "o.safetensors")], "torch", "hf"),
        ("llama_cpp", [str(tmp_path / "m.gguf"), str(tmp_path / "o.safetensors")], "gguf", "llama-cpp"),
    ]
    for mod, args, missing, extra in cases:
        r = _run_module(mod, *args)
        assert (r.returncode, r.stderr.strip()) == (2, _extra_line(mod, missing, extra)), (mod, r.stderr)
        assert "Traceback" not in r.stderr


def test_attach_without_the_vllm_extra_names_it():
    r = _py("from mla_diff_hooks import vllm\nvllm.attach(None)")
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == (
        "ModuleNotFoundError: mla_diff_hooks.vllm.attach needs numpy, which is not installed; "
        "this needs the [vllm] extra: pip install 'mla-diff[vllm]'"
    )


def test_a_module_outside_every_extra_is_named_with_its_own_install():
    deps = hooks_module("_deps")
    assert deps.missing_message("python -m mla_diff_hooks.vllm", "vllm_gguf_plugin.loader", "vllm") == (
        "python -m mla_diff_hooks.vllm needs vllm_gguf_plugin, which is not installed; "
        "pip install vllm-gguf-plugin"
    )


def test_optional_returns_the_module_when_present():
    deps = hooks_module("_deps")
    assert deps.optional("json", "x") is __import__("json")
    missing = deps.optional("no_such_module_mla", "mla_diff_hooks.hf", "hf")
    assert not missing
    with pytest.raises(
        ModuleNotFoundError,
        match=r"^mla_diff_hooks\.hf needs no_such_module_mla: "
        r"pip install 'mla-diff\[hf\]'$",
    ):
        missing.zeros(3)


@pytest.mark.parametrize(
    "mod,flag",
    [
        ("vllm", "--decode-steps"),
        ("hf", "--with-weights"),
        ("llama_cpp", "--exclude"),
        ("kernels", "synth"),
        ("vllm_cpu", "setup"),
    ],
)
def test_module_command_lines_start(mod, flag):
    r = subprocess.run(
        [sys.executable, "-m", f"mla_diff_hooks.{mod}", "--help"], capture_output=True, text=True, env=_env()
    )
    assert r.returncode == 0 and flag in r.stdout, r.stderr


def test_hf_refuses_a_folder_without_config(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "mla_diff_hooks.hf", str(tmp_path), str(tmp_path / "o.st")],
        capture_output=True,
        text=True,
        env=_env(),
    )
    assert r.returncode == 1 and r.stderr.strip() == f"{tmp_path}: no config.json"


@pytest.mark.skipif(
    os.environ.get("MLA_DIFF_TEST_WHEEL") != "1",
    reason="MLA_DIFF_TEST_WHEEL=1 (set by .ci/run) asks for the installed wheel",
)
def test_the_installed_wheel_is_what_is_tested():
    mod = hooks_module("vllm")
    assert Path(mod.__file__).resolve().is_relative_to(Path(sys.prefix).resolve()), mod.__file__
    assert not Path(mod.__file__).resolve().is_relative_to(ROOT / "python")
    assert find_mla_diff() == Path(sysconfig.get_path("scripts")) / "mla-diff"
