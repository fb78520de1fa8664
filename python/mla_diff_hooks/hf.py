#!/usr/bin/env python3
"""Dump the MLA intermediates of a HF transformers DeepSeek-V3 forward pass for `mla-diff compare`.

Why this exists: `mla-diff compare` judges what an engine really computed against mla-diff's
float64 reference on the same GGUF; this is the transformers side. It runs one forward pass over
the given token ids and writes every MLA site in format 1, raw as HF computed it; `--break`
writes deliberately broken dumps, so mla-diff's dump path and detectors are tested on real
engine output. Reference (what is written, hook points, breaks, the commands that made the
committed dumps): docs/engines.md, "HF transformers".
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
from pathlib import Path

from . import dump_format
from ._deps import optional, run_cli

np = optional("numpy", "mla_diff_hooks.hf", "hf")

DTYPES = ("f32", "bf16", "f16", "f64")
BREAKS = ("neox", "no-mscale", "zero-attn-out")


def torch_dtype(name: str):
    """The torch dtype of a --dtype name."""
    import torch

    return {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "f64": torch.float64}[name]


def load_model(model_dir: Path, dtype: str):
    """Load a DeepseekV3ForCausalLM from a local folder, eager attention, in `dtype`, eval mode."""
    from transformers import AutoConfig, DeepseekV3ForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    if cfg.model_type != "deepseek_v3":
        raise SystemExit(f"{model_dir}: model_type {cfg.model_type!r}, expected 'deepseek_v3'")
    # eager experts: the per-expert loop whose router/experts/shared-experts outputs hf_hooks
    # records as moe_router_logits, moe_topk, moe_out and shared_out in MoE layers
    model = DeepseekV3ForCausalLM.from_pretrained(
        model_dir,
        dtype=torch_dtype(dtype),
        attn_implementation="eager",
        experts_implementation="eager",
        local_files_only=True,
    )
    model.eval()
    return model


def token_ids(args, vocab_size: int):
    """The token ids to run: --tokens, else --n-tokens ids drawn from [3, vocab) with --seed."""
    import torch

    if args.tokens is not None:
        ids = [int(x) for x in args.tokens.split(",") if x.strip()]
        if not ids:
            raise SystemExit("--tokens: no token ids")
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise SystemExit(f"--tokens: ids {bad} outside the vocabulary [0, {vocab_size})")
        return torch.tensor(ids, dtype=torch.long)
    if args.n_tokens < 1:
        raise SystemExit("--n-tokens must be at least 1")
    gen = torch.Generator().manual_seed(args.seed)
    # ids 0..2 are control tokens in the fixtures' synthetic vocabulary: keep to ordinary ones
    low = 3 if vocab_size > 3 else 0
    return torch.randint(low, vocab_size, (args.n_tokens,), generator=gen, dtype=torch.long)


def capture(model, input_ids, **kwargs):
    """Run one forward pass of a transformers DeepSeek-family model with every MLA site recorded:
    mla_diff_hooks.hf_hooks.capture (the hooks are attached for that pass only)."""
    from . import hf_hooks

    return hf_hooks.capture(model, input_ids, **kwargs)


@contextlib.contextmanager
def apply_break(model, name: str | None):
    """Install break `name` (docs/engines.md, "HF transformers") for the duration of the block;
    None: no-op."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as mdl

    saved: list[tuple[object, str, object]] = []

    def patch(obj, attr, value):
        saved.append((obj, attr, getattr(obj, attr)))
        setattr(obj, attr, value)

    if name == "neox":
        # same call signature (q, k, cos, sin); rotate_half pairs element i with i + R/2
        patch(mdl, "apply_rotary_pos_emb_interleave", mdl.apply_rotary_pos_emb)
    elif name == "no-mscale":
        attns = [layer.self_attn for layer in model.model.layers]
        plain = attns[0].qk_head_dim ** (-0.5)
        if all(math.isclose(a.scaling, plain, rel_tol=1e-12) for a in attns):
            raise SystemExit(
                "--break no-mscale: the attention scale is already qk_head_dim**-0.5 "
                "(not a YaRN model with mscale_all_dim), the break would change nothing"
            )
        for a in attns:
            patch(a, "scaling", a.qk_head_dim ** (-0.5))
    elif name == "zero-attn-out":
        real_eager = mdl.eager_attention_forward

        def zero_eager(*args, **kwargs):
            attn_output, attn_weights = real_eager(*args, **kwargs)
            return attn_output.new_zeros(attn_output.shape), attn_weights

        patch(mdl, "eager_attention_forward", zero_eager)
    elif name is not None:
        raise ValueError(f"unknown break {name!r}")
    try:
        yield
    finally:
        for obj, attr, value in reversed(saved):
            setattr(obj, attr, value)


def dump(model, ids, *, dtype: str, with_weights: bool, brk: str | None) -> dict[str, np.ndarray]:
    """Run one forward pass (under the break, if any) and return the dump's tensors, in order."""
    from . import hf_hooks

    with apply_break(model, brk):
        cap = hf_hooks.capture(
            model, ids, exact_f64=(dtype == "f64"), raw_rope=True, with_weights=with_weights
        )
    t = cap.tensors
    names = [k for k in hf_hooks.ordered_names(t) if k.startswith("L") and (with_weights or ".w." not in k)]
    out = {k: np.ascontiguousarray(t[k], dtype=np.float32) for k in names}
    out["tokens"] = np.ascontiguousarray(t["tokens"], dtype=np.int64)
    out["positions"] = np.ascontiguousarray(t["positions"], dtype=np.int64)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", type=Path, help="HF checkpoint folder (config.json + safetensors)")
    ap.add_argument("out", type=Path, help="dump to write (.safetensors)")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--tokens", help="comma-separated token ids (positions 0..T-1)")
    src.add_argument("--n-tokens", type=int, default=6, help="number of seeded token ids (default 6)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the token ids (default 0)")
    ap.add_argument("--dtype", choices=DTYPES, default="f32", help="compute dtype (default f32)")
    ap.add_argument("--with-weights", action="store_true", help="also dump the weight sites (w.*)")
    ap.add_argument(
        "--break",
        dest="brk",
        choices=BREAKS,
        default=None,
        help="deliberately break attention (for tests), see above",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's choice; 1 for reproducible bytes)",
    )
    ap.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    args = ap.parse_args()

    if args.out.exists() and not args.force:
        raise SystemExit(f"{args.out} exists (use --force to overwrite)")
    if not (args.model_dir / "config.json").is_file():
        raise SystemExit(f"{args.model_dir}: no config.json")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model = load_model(args.model_dir, args.dtype)
    ids = token_ids(args, model.config.vocab_size)
    tensors = dump(model, ids, dtype=args.dtype, with_weights=args.with_weights, brk=args.brk)
    meta = {
        "engine": f"transformers {transformers.__version__}",
        "dtype": args.dtype,
        "rope_order": "hf",
        "model": args.model_dir.resolve().name,
    }
    if args.brk:
        meta["break"] = args.brk
    dump_format.write_format1(args.out, tensors, meta)
    n_sites = sum(1 for k in tensors if k.startswith("L"))
    print(
        f"{args.out}: {n_sites} sites, T = {len(ids)}, dtype {args.dtype}"
        f"{', break ' + args.brk if args.brk else ''}, {args.out.stat().st_size} bytes"
    )


if __name__ == "__main__":
    run_cli(main, "python -m mla_diff_hooks.hf", "hf")
