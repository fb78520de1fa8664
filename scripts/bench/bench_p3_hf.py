#!/usr/bin/env python3
"""Time HF transformers' DeepSeek-V3 MLA attention (eager) on one GGUF layer: the "P3" baseline.

Why
---
mla-diff's reference and engine paths are timed on real DeepSeek-V3 dims; this script gives the
number to compare them with: how long transformers' own `DeepseekV3Attention` (the module a
HF user runs, eager attention, expanded "MHA" path: kv_b_proj up-projects the latent to 128
full K/V heads) takes for one prefill forward of T tokens on the same weights, on this CPU.
Run it on a real GGUF or on the sparse full-geometry fixture written by
scripts/fixtures/make_sparse_gguf.py (whose attention layers hold real, finite quantized data).

Usage
-----
    /work/venv/fx/bin/python scripts/bench/bench_p3_hf.py GGUF --layer 3 --tokens 128 \
        [--threads N] [--dtype f32|f64] [--runs 5] [--seed 0]

Prints progress on stderr and ONE JSON line on stdout:
    {"t_median_s": ..., "threads": ..., "dtype": ..., "T": ..., "layer": ..., "runs": [...], ...}
`threads` is torch.get_num_threads() after --threads is applied (default: torch's own choice).

What is timed: `attn(hidden_states, position_embeddings=(cos, sin), attention_mask=mask)` of
one DeepseekV3Attention, under torch.inference_mode(), median of --runs runs after 1 warmup.
Not timed: loading/dequantizing the GGUF, building the rotary table (HF computes it once per
model forward in DeepseekV3Model, outside the attention module) and the causal mask.
Inputs: hidden states ~ N(0, 1) [1, T, H] from torch.Generator(seed), position_ids 0..T-1,
an additive causal mask [1, 1, T, T] (0 on and below the diagonal, finfo.min above).

Weights (gguf-py GGUFReader + gguf.quants.dequantize, then cast to --dtype):
  q_a_proj      <- blk.N.attn_q_a.weight       ne {H, Lq}      -> [Lq, H]
  q_a_layernorm <- blk.N.attn_q_a_norm.weight  [Lq]
  q_b_proj      <- blk.N.attn_q_b.weight       ne {Lq, N*(P+R)} -> [N*(P+R), Lq]
  kv_a_proj_with_mqa <- blk.N.attn_kv_a_mqa.weight ne {H, L+R} -> [L+R, H]
  kv_a_layernorm <- blk.N.attn_kv_a_norm.weight [L]
  kv_b_proj     <- rebuilt per head as [k rows | v rows]: attn_k_b (torch [N, L, P], the
                   converter's transposed k_b) transposed back to [N, P, L], concatenated with
                   attn_v_b ([N, V, L]) on dim 1 -> [N, P+V, L] -> [N*(P+V), L]; this inverts
                   convert_hf_to_gguf.py DeepseekV2Model.modify_tensors' kv_b split.
  o_proj        <- blk.N.attn_output.weight    ne {N*V, H}     -> [H, N*V]
A legacy file's single attn_kv_b ([N*(P+V), L]) is used as is.
No rope permutation is needed: llama.cpp keeps DeepSeek's interleaved rope layout (ROPE_TYPE_NORM
for deepseek2) and HF undoes it with rope_interleave=True.

Config (DeepseekV3Config, read from the GGUF metadata that convert_hf_to_gguf.py writes):
hidden = deepseek2.embedding_length (V3: 7168), heads = attention.head_count (128),
q_lora_rank (1536), kv_lora_rank (512), rope.dimension_count = qk_rope_head_dim (64),
key_length_mla - rope = qk_nope_head_dim (128), value_length_mla = v_head_dim (128) (legacy files:
key_length/value_length), layer_norm_rms_epsilon (1e-6), rope.freq_base (10000); YaRN
(rope_parameters rope_type "yarn"): rope.scaling.factor (40), original_context_length (4096),
yarn_beta_fast/slow (32/1, defaults when absent), mscale = mscale_all_dim =
yarn_log_multiplier / 0.1 (the converter writes 0.1*mscale_all_dim: V3 1.0), so HF's softmax
scale is 192^-0.5 * (0.1*ln(40)+1)^2 and its cos/sin attention factor is 1. DeepSeek-V3's
config.json has the same values (rope_scaling: factor 40, original_max_position_embeddings 4096,
beta_fast 32, beta_slow 1, mscale 1.0, mscale_all_dim 1.0).

dtype f64 note: HF's DeepseekV3RMSNorm computes in float32 and casts back, and the rotary
table is built in float32; everything else (projections, attention) runs in float64.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import gguf
import numpy as np
import torch


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def meta(r: gguf.GGUFReader, key: str, default=None):
    f = r.fields.get(key)
    if f is None:
        if default is None:
            sys.exit(f"error: metadata key {key!r} missing")
        return default
    return f.contents()


def load_weights(r: gguf.GGUFReader, layer: int) -> dict[str, np.ndarray]:
    by_name = {t.name: t for t in r.tensors}
    out = {}
    for base in ("attn_q", "attn_q_a", "attn_q_a_norm", "attn_q_b", "attn_kv_a_mqa", "attn_kv_a_norm",
                 "attn_k_b", "attn_v_b", "attn_kv_b", "attn_output"):
        name = f"blk.{layer}.{base}.weight"
        t = by_name.get(name)
        if t is None:
            continue
        vals = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        shape = tuple(int(x) for x in reversed(t.shape))  # numpy order = reversed ggml ne
        out[base] = vals.reshape(shape)
        log(f"  {name:28s} {t.tensor_type.name:5s} {list(shape)} std={vals.std():.4f}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf")
    ap.add_argument("--layer", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", choices=["f32", "f64"], default="f32")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    if a.threads is not None:
        torch.set_num_threads(a.threads)
    threads = torch.get_num_threads()
    dtype = {"f32": torch.float32, "f64": torch.float64}[a.dtype]

    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention,
        DeepseekV3RotaryEmbedding,
    )

    t0 = time.time()
    r = gguf.GGUFReader(a.gguf)
    arch = meta(r, "general.architecture")
    k = lambda s: f"{arch}.{s}"  # noqa: E731
    n_layer = int(meta(r, k("block_count")))
    if not 0 <= a.layer < n_layer:
        sys.exit(f"error: --layer {a.layer} outside 0..{n_layer - 1}")
    hidden = int(meta(r, k("embedding_length")))
    n_head = int(meta(r, k("attention.head_count")))
    q_lora = int(meta(r, k("attention.q_lora_rank"), 0)) or None
    kv_lora = int(meta(r, k("attention.kv_lora_rank")))
    rope = int(meta(r, k("rope.dimension_count")))
    if k("attention.key_length_mla") in r.fields:
        key_len = int(meta(r, k("attention.key_length_mla")))
        v_head = int(meta(r, k("attention.value_length_mla")))
    else:
        key_len = int(meta(r, k("attention.key_length")))
        v_head = int(meta(r, k("attention.value_length")))
    nope = key_len - rope
    eps = float(meta(r, k("attention.layer_norm_rms_epsilon")))
    theta = float(meta(r, k("rope.freq_base"), 10000.0))
    rope_params: dict = {"rope_type": "default", "rope_theta": theta}
    if meta(r, k("rope.scaling.type"), "none") == "yarn":
        # stored as f32 (0.1 -> 0.10000000149): round away the f32 noise
        mscale_all_dim = round(float(meta(r, k("rope.scaling.yarn_log_multiplier"), 0.0)) / 0.1, 6)
        rope_params = {
            "rope_type": "yarn",
            "rope_theta": theta,
            "factor": float(meta(r, k("rope.scaling.factor"))),
            "original_max_position_embeddings": int(meta(r, k("rope.scaling.original_context_length"))),
            "beta_fast": float(meta(r, k("rope.scaling.yarn_beta_fast"), 32.0)),
            "beta_slow": float(meta(r, k("rope.scaling.yarn_beta_slow"), 1.0)),
            "mscale": mscale_all_dim,
            "mscale_all_dim": mscale_all_dim,
        }
    log(f"{a.gguf}: arch {arch}, {n_layer} layers; N={n_head} H={hidden} Lq={q_lora} L={kv_lora} "
        f"P={nope} R={rope} V={v_head}; rope {rope_params}")

    cfg = DeepseekV3Config(
        vocab_size=int(meta(r, k("vocab_size"), 129280)),
        hidden_size=hidden,
        num_hidden_layers=n_layer,
        num_attention_heads=n_head,
        num_key_value_heads=n_head,
        q_lora_rank=q_lora,
        kv_lora_rank=kv_lora,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=v_head,
        head_dim=rope,
        rms_norm_eps=eps,
        max_position_embeddings=int(meta(r, k("context_length"), 163840)),
        rope_parameters=rope_params,
        rope_interleave=True,
        attention_bias=False,
    )
    cfg._attn_implementation = "eager"

    log(f"loading layer {a.layer}:")
    w = load_weights(r, a.layer)
    if "attn_kv_b" in w:
        kv_b = w["attn_kv_b"]  # legacy: already [N*(P+V), L]
    else:
        k_b = w["attn_k_b"]  # [N, L, P]
        v_b = w["attn_v_b"]  # [N, V, L]
        assert k_b.shape == (n_head, kv_lora, nope), k_b.shape
        assert v_b.shape == (n_head, v_head, kv_lora), v_b.shape
        kv_b = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(n_head * (nope + v_head), kv_lora)

    attn = DeepseekV3Attention(cfg, layer_idx=a.layer)
    sd = {
        "kv_a_proj_with_mqa.weight": w["attn_kv_a_mqa"],
        "kv_a_layernorm.weight": w["attn_kv_a_norm"],
        "kv_b_proj.weight": kv_b,
        "o_proj.weight": w["attn_output"],
    }
    if q_lora:
        sd["q_a_proj.weight"] = w["attn_q_a"]
        sd["q_a_layernorm.weight"] = w["attn_q_a_norm"]
        sd["q_b_proj.weight"] = w["attn_q_b"]
    else:
        sd["q_proj.weight"] = w["attn_q"]
    attn.load_state_dict({n: torch.from_numpy(np.array(v, copy=True)) for n, v in sd.items()}, strict=True)
    attn = attn.to(dtype).eval()
    del w, sd, kv_b
    rotary = DeepseekV3RotaryEmbedding(cfg)
    t_load = time.time() - t0
    log(f"loaded in {t_load:.1f}s; softmax scale {attn.scaling:.6f}; torch threads {threads}")

    T = a.tokens
    g = torch.Generator().manual_seed(a.seed)
    x = torch.randn(1, T, hidden, generator=g, dtype=torch.float64).to(dtype)
    pos = torch.arange(T).unsqueeze(0)
    with torch.inference_mode():
        cos, sin = rotary(x, pos)
        mask = torch.full((T, T), torch.finfo(dtype).min, dtype=dtype).triu(1)[None, None]

        def run() -> torch.Tensor:
            out, _ = attn(x, position_embeddings=(cos, sin), attention_mask=mask)
            return out

        out = run()  # warmup
        if not torch.isfinite(out).all():
            sys.exit("error: non-finite attention output")
        times = []
        for i in range(a.runs):
            t = time.perf_counter()
            out = run()
            times.append(time.perf_counter() - t)
            log(f"  run {i}: {times[-1]:.3f}s")
    res = {
        "t_median_s": round(statistics.median(times), 4),
        "threads": threads,
        "dtype": a.dtype,
        "T": T,
        "layer": a.layer,
        "runs": [round(t, 4) for t in times],
        "out_std": round(float(out.double().std()), 6),
        "torch": torch.__version__,
        "load_s": round(t_load, 1),
    }
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
