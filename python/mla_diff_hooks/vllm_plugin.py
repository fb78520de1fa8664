"""vLLM general plugin: arms the mla_diff_hooks capture in every vLLM process that loads a model.

Why this exists: `vllm serve` and `LLM` run the model in processes the user's code never
reaches (the engine core, one worker per TP rank); `LLM.apply_model` ships a pickled callable
to them, which `vllm serve` has no way to do. vLLM calls every `vllm.general_plugins` entry point
in each of its processes (`vllm.plugins.load_general_plugins`); this package's entry point
(`mla_diff_hooks = "mla_diff_hooks.vllm_plugin:register"`, pyproject.toml) does nothing unless
`MLA_DIFF_VLLM_DUMP` names a folder. Then it wraps every model loader's `load_model` (vLLM's
`BaseModelLoader` and each subclass, those defined later included, e.g. vllm-gguf-plugin's), so
the model a loader returns is armed with `mla_diff_hooks.vllm.arm`, and the process writes its
format-2 dump (`DIR/dump.safetensors`, `dump.rank<r>.safetensors` under TP) once it has recorded
the steps asked for, or at a normal exit with what it recorded (`vllm serve` kills its engine
process at shutdown: there nothing is written before the steps asked for have run). Reference
(the variables, the commands):
docs/engines.md, "Debugging a vLLM deployment".

Environment: MLA_DIFF_VLLM_DUMP (the dump folder; unset: the plugin is off),
MLA_DIFF_VLLM_STEPS (`N`: the first N forwards; `A:N`: N forwards after skipping A; default 1),
MLA_DIFF_VLLM_LAYERS (comma-separated decoder layers; default all), MLA_DIFF_VLLM_SITES
(comma-separated stages every step keeps; default all), MLA_DIFF_VLLM_HEADS (`a:b`: only
heads a..b of the per-head sites, TP 1), MLA_DIFF_VLLM_WEIGHTS (`0`: no `weights.*` in the
dump), MLA_DIFF_VLLM_WRITE (`0`: arm only; the caller writes, as the CPU harness does).
On a GPU worker the runner's dummy forwards (profiling, warm-up) are not counted: forward A is
the A-th that served requests; a recording that starts inside a request has the positions
before it rebuilt by mla-diff from the request's token ids (`unrecorded`).
"""

from __future__ import annotations

import atexit
import functools
import os
import sys
from pathlib import Path

ENV_DUMP = "MLA_DIFF_VLLM_DUMP"
ENV_STEPS = "MLA_DIFF_VLLM_STEPS"
ENV_LAYERS = "MLA_DIFF_VLLM_LAYERS"
ENV_SITES = "MLA_DIFF_VLLM_SITES"
ENV_WEIGHTS = "MLA_DIFF_VLLM_WEIGHTS"
ENV_WRITE = "MLA_DIFF_VLLM_WRITE"
ENV_HEADS = "MLA_DIFF_VLLM_HEADS"
ENTRY_POINT = "mla_diff_hooks = mla_diff_hooks.vllm_plugin:register"

_STATE: dict = {"registered": False, "armed": None, "written": False, "model_path": None}


def settings(env=None) -> dict | None:
    """The plugin's settings from the environment, None when MLA_DIFF_VLLM_DUMP is unset.
    Errors: ValueError naming the variable for a malformed MLA_DIFF_VLLM_STEPS or _LAYERS."""
    env = os.environ if env is None else env
    folder = env.get(ENV_DUMP, "").strip()
    if not folder:
        return None
    steps_text = env.get(ENV_STEPS, "1").strip() or "1"
    try:
        skip, _, count = steps_text.rpartition(":")
        skip_n, count_n = int(skip or 0), int(count)
    except ValueError:
        raise ValueError(f"{ENV_STEPS}={steps_text!r}: N or A:N (skip A forwards, record N)") from None
    if skip_n < 0 or count_n < 1:
        raise ValueError(f"{ENV_STEPS}={steps_text!r}: A >= 0 forwards skipped, N >= 1 recorded")
    layers = None
    if env.get(ENV_LAYERS, "").strip():
        try:
            layers = [int(x) for x in env[ENV_LAYERS].split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"{ENV_LAYERS}={env[ENV_LAYERS]!r}: comma-separated layer numbers") from None
    sites = [x.strip() for x in env.get(ENV_SITES, "").split(",") if x.strip()] or None
    heads = None
    if env.get(ENV_HEADS, "").strip():
        try:
            a, b = (int(x) for x in env[ENV_HEADS].split(":"))
        except ValueError:
            raise ValueError(f"{ENV_HEADS}={env[ENV_HEADS]!r}: a:b (heads a..b)") from None
        if not 0 <= a < b:
            raise ValueError(f"{ENV_HEADS}={env[ENV_HEADS]!r}: expected 0 <= a < b")
        heads = (a, b)
    return {
        "folder": Path(folder),
        "skip": skip_n,
        "steps": count_n,
        "layers": layers,
        "sites": sites,
        "heads": heads,
        "weights": env.get(ENV_WEIGHTS, "1").strip() != "0",
        "write": env.get(ENV_WRITE, "1").strip() != "0",
    }


def register() -> None:
    """The `vllm.general_plugins` entry point: with MLA_DIFF_VLLM_DUMP set, wrap the model
    loaders so the loaded model is armed (idempotent: vLLM may call it several times)."""
    cfg = settings()
    if cfg is None or _STATE["registered"]:
        return
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    _STATE["registered"] = True
    _STATE["cfg"] = cfg
    _wrap_loader(BaseModelLoader)
    pending = list(BaseModelLoader.__subclasses__())
    while pending:
        cls = pending.pop()
        _wrap_loader(cls)
        pending += cls.__subclasses__()
    previous = BaseModelLoader.__dict__.get("__init_subclass__")

    def __init_subclass__(cls, **kwargs):
        if previous is not None:
            previous.__func__(cls, **kwargs)
        else:
            super(BaseModelLoader, cls).__init_subclass__(**kwargs)
        _wrap_loader(cls)

    BaseModelLoader.__init_subclass__ = classmethod(__init_subclass__)
    if cfg["write"]:
        atexit.register(_write)


def _wrap_loader(cls) -> None:
    """Arm the model cls.load_model returns (its own load_model only; once per class)."""
    fn = cls.__dict__.get("load_model")
    if fn is None or getattr(fn, "_mla_diff_armed", False):
        return

    @functools.wraps(fn)
    def load_model(self, *args, **kwargs):
        model = fn(self, *args, **kwargs)
        model_config = kwargs.get("model_config", args[1] if len(args) > 1 else None)
        # vllm-gguf-plugin keeps the GGUF file in model_weights when `model` names the folder of
        # the HF config (`--hf-config-path`): the dump is then format 2, tied to that file
        _arm(model, getattr(model_config, "model_weights", None) or getattr(model_config, "model", None))
        return model

    load_model._mla_diff_armed = True
    cls.load_model = load_model


def _arm(model, model_path) -> None:
    """Arm `model` (once: a subclass's load_model calling its base's returns the same model)."""
    if _STATE["armed"] is model:
        return
    from . import vllm as dump_vllm

    cfg = _STATE["cfg"]
    print(
        "mla_diff_hooks.vllm_plugin: "
        + dump_vllm.arm(
            model,
            forward_index=cfg["skip"],
            steps=cfg["steps"],
            layers=cfg["layers"],
            sites=cfg["sites"],
            heads=cfg.get("heads"),
        ),
        file=sys.stderr,
    )
    # a GPU worker: plan each forward from the runner's scheduler output (vllm.live_plan)
    dump_vllm.watch_runner()
    _STATE["armed"] = model
    _STATE["model_path"] = model_path
    _STATE["written"] = False
    if cfg["write"]:
        cap = dump_vllm._ACTIVE
        end_step = cap._end_step

        def _end_step_then_write():
            end_step()
            if len(cap.steps) >= cfg["steps"]:
                _write()

        cap._end_step = _end_step_then_write


def _write() -> str | None:
    """Write this process's dump once (format 2 for a GGUF model, else format 1); None when
    nothing was recorded or it was written already."""
    from . import vllm as dump_vllm

    cap = dump_vllm._ACTIVE
    if _STATE["written"] or cap is None or not cap.steps or _STATE.get("armed") is None:
        return None
    _STATE["written"] = True
    cfg = _STATE["cfg"]
    cfg["folder"].mkdir(parents=True, exist_ok=True)
    model_path = _STATE["model_path"]
    gguf = (
        model_path
        if model_path and str(model_path).endswith(".gguf") and Path(model_path).is_file()
        else None
    )
    res = dump_vllm.finish(
        dump_path=str(cfg["folder"] / "dump.safetensors"),
        model_path=gguf,
        weights=cfg["weights"],
        extra_meta={"hook_loader": "mla_diff_hooks.vllm_plugin (vllm.general_plugins)"},
    )
    print(f"mla_diff_hooks.vllm_plugin: wrote {res['dump']}", file=sys.stderr)
    return res["dump"]


def write_dist_info(folder: Path) -> Path:
    """A `.dist-info` folder in `folder` whose entry_points.txt declares this plugin, so that
    vLLM's load_general_plugins finds it when `folder` is on sys.path and the package is not
    installed (the CPU harness's checkout). Returns its path."""
    d = Path(folder) / "mla_diff_hooks_plugin-0.dist-info"
    d.mkdir(parents=True, exist_ok=True)
    (d / "METADATA").write_text("Metadata-Version: 2.1\nName: mla-diff-hooks-plugin\nVersion: 0\n")
    (d / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{ENTRY_POINT}\n")
    return d


def main(argv=None) -> int:
    """`python -m mla_diff_hooks.vllm_plugin DIR`: registers the plugin for a checkout that is not
    pip-installed (a GPU machine without cargo or network): writes DIR's `.dist-info` and prints
    the PYTHONPATH that makes vLLM load the hooks from this checkout. Exit 0, or 2 for a usage
    error or a folder that cannot be written."""
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m mla_diff_hooks.vllm_plugin",
        description="Register the mla_diff_hooks vLLM plugin without installing the package: write "
        "DIR/mla_diff_hooks_plugin-0.dist-info and print the PYTHONPATH to export.",
    )
    ap.add_argument("dir", type=Path, help="a folder for the entry point's .dist-info (created)")
    args = ap.parse_args(argv)
    try:
        write_dist_info(args.dir)
    except OSError as e:
        print(f"mla_diff_hooks.vllm_plugin: error: cannot write {args.dir}: {e.strerror}", file=sys.stderr)
        return 2
    package_parent = Path(__file__).resolve().parent.parent
    print(f"export PYTHONPATH={args.dir.resolve()}:{package_parent}${{PYTHONPATH:+:$PYTHONPATH}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
