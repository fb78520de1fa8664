#!/usr/bin/env python3
"""Dump the MLA intermediates of a HF transformers DeepSeek-V3 forward pass for `mla-diff compare`.

Why this exists: `mla-diff compare --model M.gguf --dump D.safetensors` judges what an engine
really computed against mla-diff's float64 reference on the same GGUF. This script is the
transformers engine's side of that: it loads a HF `DeepseekV3ForCausalLM` checkpoint (eager
attention) in the requested dtype, runs ONE forward pass over the given token ids (one sequence,
positions 0..T-1, no cache) and writes every MLA site it can see in the dump format of
docs/dump-format.md. It also makes deliberately broken dumps (`--break`), so mla-diff's dump path
and detectors can be tested on real engine output.

What is written (docs/dump-format.md, version 1):
  * `L{n}.{stage}` for every layer n and every stage mla_diff_hooks/hf_hooks.py captures: hidden_in,
    attn_in, q_c, q_c_normed (only with q_lora_rank), q, kv_a, kv_c_normed, k_pe, q_pe_roped,
    k_pe_roped, k_nope, v, lse, attn_out, o_proj, hidden_out, and in MoE layers
    moe_router_logits, moe_topk (the selected expert ids, as numbers), moe_out and shared_out;
    with `--with-weights` also the
    weight sites w.fused_qkv_a (only with q_lora_rank), w.kv_b, w.W_UK_T, w.W_UV. Token-major
    shapes ([T, H], [T, N, X], lse [T, N]) as in docs/design.md's site table.
  * `tokens` and `positions` (int64, [T]).
  * metadata: format="mla-diff dump 1", engine="transformers <version>", dtype=<run dtype>,
    rope_order="hf", model=<checkpoint folder name>, and break=<name> when --break is used.
  Values are what HF computed in the run dtype, stored as float32 (bf16/f16 values are exact in f32;
  an f64 run is rounded to f32 on output). The logits are not dumped (not a site).

Raw values. This is an engine dump, not a golden: for f32, bf16 and f16 runs hf_hooks' float64
patches are NOT applied (`capture(exact_f64=False)`), so HF's own f32 spots (RMSNorm upcast,
f32 rotary table, f32 softmax) stay as they are. For `--dtype f64` they are applied (as for the
goldens), so an f64 run is HF's formula in f64 throughout. The rope order is raw as well:
q_pe_roped and k_pe_roped are written as HF's `apply_rotary_pos_emb_interleave` returns them,
[rotated even elements | rotated odd elements], and the metadata says rope_order="hf" so that
mla-diff converts them back to DeepSeek's interleaved pairs.

`lse` is not a tensor HF materialises: eager attention returns softmax probabilities, not a
log-sum-exp. It is RECOMPUTED by hf_hooks' wrapper of `eager_attention_forward` from HF's own
query, key, scaling and mask as they are passed to the attention function (natural log, [T, N]),
in the run dtype.

Hook points relied on (transformers 5.x, models/deepseek_v3/modeling_deepseek_v3.py), all through
mla_diff_hooks/hf_hooks.py's `capture()`:
  * forward pre/post hooks on each decoder layer (hidden_in, hidden_out), and forward hooks on
    input_layernorm, q_a_proj, q_a_layernorm, q_b_proj / q_proj, kv_a_proj_with_mqa,
    kv_a_layernorm, kv_b_proj and o_proj (pre-hook: attn_out);
  * the module globals `apply_rotary_pos_emb_interleave` (q_pe_roped, k_pe_roped) and
    `eager_attention_forward` (lse), replaced by wrappers for the duration of the forward pass.
    DeepseekV3Attention.forward looks both up in the module at call time (the attention function
    through ALL_ATTENTION_FUNCTIONS.get_interface("eager", eager_attention_forward)).
  The model config must have rope_interleave=True (DeepSeek checkpoints do).

Breaks (`--break NAME`), each a patch that lasts for the forward pass only. Each is installed
BEFORE capture() wraps the module globals, so capture() wraps the broken function and records its
outputs (lse is always recorded from the real logits):
  * neox: `apply_rotary_pos_emb_interleave` is replaced by HF's NeoX-style `apply_rotary_pos_emb`
    (rotate-half on the natural element order, no de-interleave): the real bug "NeoX rope where
    DeepSeek rotates adjacent pairs". The dump still says rope_order="hf" (it is what the broken
    engine returned from the function whose output is in HF order).
  * no-mscale: every attention module's `scaling` is set to qk_head_dim**-0.5, dropping YaRN's
    mscale² factor (refused on a model whose scale has no such factor).
  * zero-attn-out: `eager_attention_forward` runs, then its output is replaced by zeros of the
    same shape (the caller reads a zero buffer); the probabilities are returned unchanged.

Usage (`python -m mla_diff_hooks.hf`, or scripts/dump_hf.py in a checkout):
    dump_hf.py HF_MODEL_DIR OUT.safetensors [--tokens 1,2,3 | --n-tokens T --seed S]
               [--dtype f32|bf16|f16|f64] [--with-weights] [--break neox|no-mscale|zero-attn-out]
               [--threads N] [--force]
  Without --tokens, T ids are drawn uniformly from [3, vocab) with torch.Generator(seed)
  (defaults: T = 6, S = 0). Nothing is overwritten without --force.

Committed dumps (golden/dumps/, 6 tokens = the first 6 ids of golden/hf/<fixture>.safetensors,
checkpoints made by scripts/make_fixtures.py), made from the repository root with:
    PY=/work/venv/fx/bin/python; HF=/work/fixtures-tmp/hf
    $PY scripts/dump_hf.py $HF/tiny-v3 golden/dumps/tiny-v3-f32.hf.safetensors \\
        --tokens 235,74,241,141,43,185 --threads 1
    $PY scripts/dump_hf.py $HF/yarn-v3 golden/dumps/yarn-v3-f32.hf.safetensors \\
        --tokens 7,194,164,83,207,250 --threads 1
    $PY scripts/dump_hf.py $HF/tiny-v3 golden/dumps/tiny-v3-f32.hf-neox.safetensors \\
        --tokens 235,74,241,141,43,185 --threads 1 --break neox
    $PY scripts/dump_hf.py $HF/yarn-v3 golden/dumps/yarn-v3-f32.hf-no-mscale.safetensors \\
        --tokens 7,194,164,83,207,250 --threads 1 --break no-mscale
    $PY scripts/dump_hf.py $HF/tiny-v3 golden/dumps/tiny-v3-f32.hf-zero-attn-out.safetensors \\
        --tokens 235,74,241,141,43,185 --threads 1 --break zero-attn-out
    $PY scripts/dump_hf.py $HF/tiny-v3 golden/dumps/tiny-v3-f32.hf-bf16.safetensors \\
        --tokens 235,74,241,141,43,185 --threads 1 --dtype bf16
The engine-bf16 / engine-f16 rows of src/judge/tolerance.rs were measured with this script:
`--dtype bf16|f16 --with-weights --threads 1` and `--n-tokens 16 --seed 0..4` on tiny-v3, lite-v2,
yarn-v3 and legacy-kvb, plus `--n-tokens 64 --seed 10,11` on tiny-v3, lite-v2 and yarn-v3, each
compared with `mla-diff compare --model golden/models/<fixture>-f32.gguf` (docs/dump-format.md,
"Tolerances").
No network access is needed (HF_HUB_OFFLINE is set).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
from pathlib import Path

from . import st_io
from ._deps import optional

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
        model_dir, dtype=torch_dtype(dtype), attn_implementation="eager", experts_implementation="eager",
        local_files_only=True)
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
    """Install break `name` (see module docstring) for the duration of the block; None: no-op."""
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
            raise SystemExit("--break no-mscale: the attention scale is already qk_head_dim**-0.5 "
                             "(not a YaRN model with mscale_all_dim), the break would change nothing")
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
        cap = hf_hooks.capture(model, ids, exact_f64=(dtype == "f64"), raw_rope=True,
                               with_weights=with_weights)
    t = cap.tensors
    names = [k for k in hf_hooks.ordered_names(t)
             if k.startswith("L") and (with_weights or ".w." not in k)]
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
    ap.add_argument("--break", dest="brk", choices=BREAKS, default=None,
                    help="deliberately break attention (for tests), see above")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: torch's choice; 1 for reproducible bytes)")
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
        "format": "mla-diff dump 1",
        "engine": f"transformers {transformers.__version__}",
        "dtype": args.dtype,
        "rope_order": "hf",
        "model": args.model_dir.resolve().name,
    }
    if args.brk:
        meta["break"] = args.brk
    st_io.save(tensors, args.out, metadata=meta)
    n_sites = sum(1 for k in tensors if k.startswith("L"))
    print(f"{args.out}: {n_sites} sites, T = {len(ids)}, dtype {args.dtype}"
          f"{', break ' + args.brk if args.brk else ''}, {args.out.stat().st_size} bytes")


if __name__ == "__main__":
    main()
