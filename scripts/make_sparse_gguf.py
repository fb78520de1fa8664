#!/usr/bin/env python3
"""Write sparse, full-geometry DeepSeek-V3 Q4_K_M GGUF files for scale-testing mla-diff.

Why
---
A real DeepSeek-V3 Q4_K_M GGUF is ~400 GB; nobody keeps one on a CI box or laptop, yet
mla-diff must open one (header, 1086-tensor index, mmap of the whole file), find one layer's
attention tensors at their real offsets and run the reference on real V3 dims (N=128,
H=7168, Lq=1536, L=512, P=128, R=64, V=128).  This script writes a file with *exactly* the
metadata and tensor index such a file has, at its full declared size, but as a sparse file:
only the attention tensors (and ffn_norm) of a few layers hold real, finite, quantized data;
every other byte (experts, dense FFN, embeddings, output) is a hole that reads as zeros and
takes no disk space.  Zero bytes are valid blocks for every type used (d = 0 -> all-zero
weights), so even a stray read of a hole decodes to finite numbers.

Usage (needs numpy and gguf: pip install numpy gguf)
-----------------------------------------------------
    python scripts/make_sparse_gguf.py OUTDIR \
        [--layers-with-data 0,1,2,3] [--seed 0] [--k-b-type Q5_0|Q8_0] [--verify full|sample]

writes OUTDIR/deepseek-v3-sparse-61L.gguf (all 61 layers) and
OUTDIR/deepseek-v3-sparse-4L.gguf (same metadata but block_count 4, tensors of layers 0..3
plus token_embd/output_norm/output; the data layers hold the SAME bytes as in the 61L file).
It prints the declared size, the bytes actually allocated (st_blocks*512), the tensor
count, the std/finiteness of every written tensor of the 61L file (re-read through gguf-py's
GGUFReader and dequantized with gguf.quants.dequantize), a byte-for-byte check of the 4L
file's data layers against the 61L file, and the time taken (~15 s on 2 cores).  OUTDIR must be on a
filesystem with sparse-file support (ext4/xfs/btrfs/tmpfs); keep it outside the repo.

Real-V3 facts used, and where they come from
--------------------------------------------
* Hyper-parameters: deepseek-ai/DeepSeek-V3 config.json -- hidden_size 7168,
  num_hidden_layers 61 (+1 MTP layer, which the converter skips), num_attention_heads 128,
  num_key_value_heads 128, q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128,
  qk_rope_head_dim 64, v_head_dim 128, vocab_size 129280, intermediate_size 18432,
  moe_intermediate_size 2048, n_routed_experts 256, num_experts_per_tok 8,
  n_shared_experts 1, first_k_dense_replace 3, n_group 8, topk_group 4,
  routed_scaling_factor 2.5, norm_topk_prob true, scoring_func "sigmoid",
  rms_norm_eps 1e-6, rope_theta 10000, max_position_embeddings 163840,
  rope_scaling {type yarn, factor 40, original_max_position_embeddings 4096, beta_fast 32,
  beta_slow 1, mscale 1.0, mscale_all_dim 1.0}.
* Metadata keys and values: llama.cpp convert_hf_to_gguf.py (conversion/base.py
  TextModel.set_gguf_parameters + conversion/deepseek.py DeepseekV2Model.set_gguf_parameters,
  vendored in llama_cpp_python 0.3.36): head_count_kv is written as 1 ("MLA converts into
  MQA"), key_length = kv_lora_rank + rope = 576, value_length = kv_lora_rank = 512,
  key_length_mla = nope + rope = 192, value_length_mla = 128, expert_gating_func 2
  (sigmoid), rope.scaling.yarn_log_multiplier = 0.1 * mscale_all_dim = 0.1, yarn_beta_fast /
  yarn_beta_slow copied from rope_scaling, expert_weights_norm written only when true.
  llama-quantize then sets general.file_type = 15 (MOSTLY_Q4_K_M) and
  general.quantization_version = 2.  No tokenizer keys are written (mla-diff reads only
  general.architecture, general.alignment and deepseek2.*).
* kv_b split: the converter views kv_b_proj [N*(P+V), L] as [N, P+V, L], splits it into
  k_b [N, P, L] -> transposed to torch [N, L, P] and v_b torch [N, V, L]; so ggml ne is
  attn_k_b {P=128, L=512, N=128} and attn_v_b {L=512, V=128, N=128}, matching
  src/models/deepseek2.cpp's create_tensor calls.  exp_probs_b is "blk.%d.exp_probs_b.bias"
  (deepseek2.cpp: tn(LLM_TENSOR_FFN_EXP_PROBS_B, "bias", i)).
* Q4_K_M type choice: src/llama-quant.cpp (llama_tensor_get_type_impl and
  tensor_type_fallback): default Q4_K; output.weight Q6_K; 1-D tensors, *_norm.weight and
  ffn_gate_inp.weight stay F32; ffn_down (dense, _exps and _shexp) is Q6_K where
  use_more_bits(layer, 61) (layer < 7, layer >= 53 or (layer-7) % 3 == 2) else Q4_K;
  attn_k_b/attn_v_b are category OTHER (so Q4_K), but attn_k_b rows are P=128 long, not a
  multiple of 256, so the fallback turns Q4_K into Q5_0.  --k-b-type Q8_0 overrides that
  (some published quants force Q8_0 there).  Every other row length is a multiple of 256.

Data written for the layers in --layers-with-data: attn_norm, attn_q_a_norm, attn_kv_a_norm,
ffn_norm as F32 ~ U(0.9, 1.1); attn_q_a, attn_q_b, attn_kv_a_mqa, attn_k_b, attn_v_b,
attn_output as valid quant blocks built field by field (random qs / sub-block scale bytes,
finite f16 d/dmin chosen so the dequantized weights have std ~0.03 and mean ~0).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

try:
    import numpy as np

    import gguf
    from gguf import GGMLQuantizationType as QT
    from gguf.constants import GGML_QUANT_SIZES
except ImportError as e:
    sys.exit(f"make_sparse_gguf.py needs numpy and gguf (gguf-py): pip install numpy gguf ({e})")

# ----------------------------------------------------------------------------------------------
# DeepSeek-V3 (deepseek-ai/DeepSeek-V3 config.json)
# ----------------------------------------------------------------------------------------------
ARCH = "deepseek2"
HIDDEN = 7168
N_LAYER = 61
N_HEAD = 128
Q_LORA = 1536
KV_LORA = 512
NOPE = 128
ROPE = 64
V_HEAD = 128
VOCAB = 129280
FF_DENSE = 18432
FF_EXP = 2048
N_EXPERT = 256
N_EXPERT_USED = 8
N_SHARED = 1
FIRST_DENSE = 3
N_GROUP = 8
TOPK_GROUP = 4
ROUTED_SCALE = 2.5
RMS_EPS = 1e-6
ROPE_THETA = 10000.0
CTX = 163840
YARN_FACTOR = 40.0
YARN_ORIG_CTX = 4096
YARN_BETA_FAST = 32.0
YARN_BETA_SLOW = 1.0
MSCALE_ALL_DIM = 1.0

FTYPE_Q4_K_M = 15  # llama_ftype LLAMA_FTYPE_MOSTLY_Q4_K_M
ALIGN = 32  # GGUF default alignment (the converter does not write general.alignment)

TARGET_STD = 0.03
ATTN_TENSORS = ("attn_norm", "attn_q_a", "attn_q_a_norm", "attn_q_b", "attn_kv_a_mqa",
                "attn_kv_a_norm", "attn_k_b", "attn_v_b", "attn_output")


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama-quant.cpp's use_more_bits (C++ integer division; i < n/8 short-circuits negatives)."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def tensor_index(n_layer: int, k_b_type: QT) -> list[tuple[str, tuple[int, ...], QT]]:
    """(name, ggml ne, type) of every tensor, in the converter's emission order.

    The order follows the HF checkpoint's alphabetical per-layer tensor names
    (input_layernorm, mlp.*, post_attention_layernorm, self_attn.*) as the converter walks
    them; merged experts come out as down, gate, up.  ffn_down types use the 61-layer
    use_more_bits pattern even in the 4-layer file so its layers match the 61L file's.
    """
    out: list[tuple[str, tuple[int, ...], QT]] = [("token_embd.weight", (HIDDEN, VOCAB), QT.Q4_K)]
    for i in range(n_layer):
        b = f"blk.{i}."
        down_t = QT.Q6_K if use_more_bits(i, N_LAYER) else QT.Q4_K
        out.append((b + "attn_norm.weight", (HIDDEN,), QT.F32))
        if i < FIRST_DENSE:
            out += [
                (b + "ffn_down.weight", (FF_DENSE, HIDDEN), down_t),
                (b + "ffn_gate.weight", (HIDDEN, FF_DENSE), QT.Q4_K),
                (b + "ffn_up.weight", (HIDDEN, FF_DENSE), QT.Q4_K),
            ]
        else:
            out += [
                (b + "ffn_down_exps.weight", (FF_EXP, HIDDEN, N_EXPERT), down_t),
                (b + "ffn_gate_exps.weight", (HIDDEN, FF_EXP, N_EXPERT), QT.Q4_K),
                (b + "ffn_up_exps.weight", (HIDDEN, FF_EXP, N_EXPERT), QT.Q4_K),
                (b + "exp_probs_b.bias", (N_EXPERT,), QT.F32),
                (b + "ffn_gate_inp.weight", (HIDDEN, N_EXPERT), QT.F32),
                (b + "ffn_down_shexp.weight", (FF_EXP * N_SHARED, HIDDEN), down_t),
                (b + "ffn_gate_shexp.weight", (HIDDEN, FF_EXP * N_SHARED), QT.Q4_K),
                (b + "ffn_up_shexp.weight", (HIDDEN, FF_EXP * N_SHARED), QT.Q4_K),
            ]
        out += [
            (b + "ffn_norm.weight", (HIDDEN,), QT.F32),
            (b + "attn_kv_a_norm.weight", (KV_LORA,), QT.F32),
            (b + "attn_kv_a_mqa.weight", (HIDDEN, KV_LORA + ROPE), QT.Q4_K),
            (b + "attn_k_b.weight", (NOPE, KV_LORA, N_HEAD), k_b_type),
            (b + "attn_v_b.weight", (KV_LORA, V_HEAD, N_HEAD), QT.Q4_K),
            (b + "attn_output.weight", (N_HEAD * V_HEAD, HIDDEN), QT.Q4_K),
            (b + "attn_q_a_norm.weight", (Q_LORA,), QT.F32),
            (b + "attn_q_a.weight", (HIDDEN, Q_LORA), QT.Q4_K),
            (b + "attn_q_b.weight", (Q_LORA, N_HEAD * (NOPE + ROPE)), QT.Q4_K),
        ]
    out += [("output.weight", (HIDDEN, VOCAB), QT.Q6_K), ("output_norm.weight", (HIDDEN,), QT.F32)]
    return out


def nbytes_of(ne: tuple[int, ...], t: QT) -> int:
    blk, size = GGML_QUANT_SIZES[t]
    assert ne[0] % blk == 0, (ne, t)
    n = 1
    for d in ne:
        n *= d
    return n // blk * size


# ----------------------------------------------------------------------------------------------
# Valid quant blocks with finite scales
# ----------------------------------------------------------------------------------------------
def _rand_bytes(rng: np.random.Generator, n_blocks: int, width: int) -> np.ndarray:
    return np.frombuffer(rng.bytes(n_blocks * width), dtype=np.uint8).reshape(n_blocks, width).copy()


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(-1, 2)


def make_blocks(t: QT, n_blocks: int, rng: np.random.Generator, d0: float) -> np.ndarray:
    """n_blocks blocks of type t: random quant/scale bytes, f16 d = d0 * U(0.8, 1.2) per block."""
    d = d0 * rng.uniform(0.8, 1.2, n_blocks)
    if t == QT.Q4_K:
        # block_q4_K: half d; half dmin; u8 scales[12] (6-bit scale/min pairs); u8 qs[128]
        # Zero mean needs dmin*E[m] = d*E[sc]*E[q] -> dmin = 7.5 d (E[sc] = E[m] = 31.5).
        return np.hstack([_f16_bytes(d), _f16_bytes(7.5 * d), _rand_bytes(rng, n_blocks, 12 + 128)])
    if t == QT.Q6_K:
        # block_q6_K: u8 ql[128]; u8 qh[64]; i8 scales[16]; half d -- value d*sc*(q-32)
        sc = rng.integers(1, 64, (n_blocks, 16), dtype=np.int8).view(np.uint8)
        return np.hstack([_rand_bytes(rng, n_blocks, 192), sc, _f16_bytes(d)])
    if t == QT.Q5_0:
        # block_q5_0: half d; u8 qh[4]; u8 qs[16] -- value d*(q-16)
        return np.hstack([_f16_bytes(d), _rand_bytes(rng, n_blocks, 4 + 16)])
    if t == QT.Q8_0:
        # block_q8_0: half d; i8 qs[32] in [-127, 127] as llama.cpp writes them
        qs = rng.integers(-127, 128, (n_blocks, 32), dtype=np.int8).view(np.uint8)
        return np.hstack([_f16_bytes(d), qs])
    raise ValueError(f"no block builder for {t.name}")


_D0: dict[QT, float] = {}


def calibrated_d0(t: QT) -> float:
    """d0 such that the dequantized weights have std ~TARGET_STD (measured on a probe)."""
    if t not in _D0:
        probe = make_blocks(t, 4096, np.random.default_rng(12345), 1.0)
        s = float(gguf.quants.dequantize(probe, t).std())
        _D0[t] = TARGET_STD / s
    return _D0[t]


def tensor_data(name: str, ne: tuple[int, ...], t: QT, seed: int, layer: int) -> bytes:
    # A per-(seed, layer, tensor) stream: the same bytes whichever file or layer set is written.
    key = [seed, layer] + list(name.split(".")[2].encode())
    rng = np.random.default_rng(key)
    n = int(np.prod(ne))
    if t == QT.F32:
        return rng.uniform(0.9, 1.1, n).astype(np.float32).tobytes()
    blk, _ = GGML_QUANT_SIZES[t]
    return make_blocks(t, n // blk, rng, calibrated_d0(t)).tobytes()


# ----------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------
def add_metadata(w: gguf.GGUFWriter, n_layer: int) -> None:
    """Keys in the order convert_hf_to_gguf.py (+ llama-quantize) produce them."""
    w.add_type("model")
    w.add_name("DeepSeek V3 (sparse fixture: attention data only)")
    w.add_size_label("256x20B")
    # TextModel.set_gguf_parameters
    w.add_block_count(n_layer)
    w.add_context_length(CTX)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FF_DENSE)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(1)  # DeepseekV2Model sets num_key_value_heads = 1 (MLA as MQA)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(YARN_FACTOR)
    w.add_rope_scaling_orig_ctx_len(YARN_ORIG_CTX)
    w.add_rope_scaling_yarn_beta_fast(YARN_BETA_FAST)
    w.add_rope_scaling_yarn_beta_slow(YARN_BETA_SLOW)
    w.add_rope_freq_base(ROPE_THETA)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_expert_count(N_EXPERT)
    w.add_expert_used_count(N_EXPERT_USED)
    w.add_expert_group_count(N_GROUP)
    w.add_expert_group_used_count(TOPK_GROUP)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_file_type(FTYPE_Q4_K_M)  # the converter writes its ftype; llama-quantize sets 15
    # DeepseekV2Model.set_gguf_parameters
    w.add_leading_dense_block_count(FIRST_DENSE)
    w.add_vocab_size(VOCAB)
    w.add_q_lora_rank(Q_LORA)
    w.add_kv_lora_rank(KV_LORA)
    w.add_key_length(KV_LORA + ROPE)
    w.add_value_length(KV_LORA)
    w.add_key_length_mla(NOPE + ROPE)
    w.add_value_length_mla(V_HEAD)
    w.add_expert_feed_forward_length(FF_EXP)
    w.add_expert_shared_count(N_SHARED)
    w.add_expert_weights_scale(ROUTED_SCALE)
    w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(ROPE)
    w.add_rope_scaling_yarn_log_mul(0.1 * MSCALE_ALL_DIM)
    # llama-quantize
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def write_file(path: Path, n_layer: int, k_b_type: QT, data: dict[str, bytes]) -> dict:
    index = tensor_index(n_layer, k_b_type)
    if path.exists():
        path.unlink()  # a fresh inode: no stale allocated blocks from an earlier run
    w = gguf.GGUFWriter(path, ARCH)
    add_metadata(w, n_layer)
    rel: dict[str, int] = {}
    off = 0
    for name, ne, t in index:
        nb = nbytes_of(ne, t)
        # add_tensor_info takes the numpy (reversed-ne) element shape when tensor_dtype is not u8
        w.add_tensor_info(name, tuple(reversed(ne)), np.dtype(np.float32), nb, raw_dtype=t)
        rel[name] = off
        off += gguf.GGUFWriter.ggml_pad(nb, ALIGN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.flush()
    header_end = w.fout[0].tell()
    w.close()
    data_start = gguf.GGUFWriter.ggml_pad(header_end, ALIGN)
    total = data_start + off
    fd = os.open(path, os.O_RDWR)
    try:
        os.ftruncate(fd, total)  # holes everywhere past the header
        for name, buf in data.items():
            if name in rel:
                os.pwrite(fd, buf, data_start + rel[name])
    finally:
        os.close(fd)
    st = os.stat(path)
    return {"path": path, "declared": total, "allocated": st.st_blocks * 512, "n_tensors": len(index),
            "data_start": data_start, "index": index}


def verify(path: Path, names: list[str], mode: str) -> None:
    """Re-read the written tensors through gguf-py's reader and dequantize them."""
    r = gguf.GGUFReader(path)
    by_name = {t.name: t for t in r.tensors}
    assert r.fields["general.architecture"].contents() == ARCH
    for name in names:
        t = by_name[name]
        raw = np.asarray(t.data)
        if mode == "sample" and raw.ndim >= 2 and raw.shape[0] > 64:
            raw = raw[:: max(1, raw.shape[0] // 64)]
        vals = gguf.quants.dequantize(raw, t.tensor_type)
        finite = bool(np.isfinite(vals).all())
        print(f"  {name:32s} {t.tensor_type.name:5s} ne={list(map(int, t.shape))} "
              f"std={vals.std():.4f} mean={vals.mean():+.4f} finite={finite}")
        if not finite:
            sys.exit(f"error: {name} has non-finite values")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--layers-with-data", default="0,1,2,3",
                    help="comma-separated layers whose attention tensors and ffn_norm hold data")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--k-b-type", default="Q5_0", choices=["Q5_0", "Q8_0"],
                    help="attn_k_b type (llama-quantize's Q4_K_M fallback for 128-long rows is Q5_0)")
    ap.add_argument("--verify", default="full", choices=["full", "sample", "none"],
                    help="dequantize all written tensors (full), every ~64th row (sample), or skip")
    a = ap.parse_args()
    t0 = time.time()
    layers = sorted({int(x) for x in a.layers_with_data.split(",") if x.strip()})
    if any(not 0 <= i < N_LAYER for i in layers):
        sys.exit(f"--layers-with-data must be in 0..{N_LAYER - 1}")
    k_b_type = QT[a.k_b_type]
    a.outdir.mkdir(parents=True, exist_ok=True)

    types = {name: t for name, _, t in tensor_index(N_LAYER, k_b_type)}
    shapes = {name: ne for name, ne, _ in tensor_index(N_LAYER, k_b_type)}
    data: dict[str, bytes] = {}
    for i in layers:
        for base in ATTN_TENSORS + ("ffn_norm",):
            name = f"blk.{i}.{base}.weight"
            data[name] = tensor_data(name, shapes[name], types[name], a.seed, i)
    t_gen = time.time() - t0

    results = []
    for fname, n_layer in (("deepseek-v3-sparse-61L.gguf", N_LAYER), ("deepseek-v3-sparse-4L.gguf", 4)):
        res = write_file(a.outdir / fname, n_layer, k_b_type, data)
        results.append(res)
    t_write = time.time() - t0 - t_gen

    print(f"k_b type {k_b_type.name}; layers with data {layers}; seed {a.seed}")
    for res in results:
        counts: dict[str, int] = {}
        for _, _, t in res["index"]:
            counts[t.name] = counts.get(t.name, 0) + 1
        print(f"{res['path']}: declared {res['declared']:,} B ({res['declared'] / 1e9:.1f} GB), "
              f"allocated on disk {res['allocated']:,} B ({res['allocated'] / 1e6:.1f} MB), "
              f"{res['n_tensors']} tensors {counts}, data starts at {res['data_start']}")
    written_bytes = sum(len(b) for b in data.values())
    print(f"data written per file: {written_bytes:,} B in {len(data)} tensors")

    if a.verify != "none":
        # Dequantize every written tensor of the 61L file; the 4L file is checked byte for byte
        # against it (same bytes -> same dequantized values), which is much cheaper.
        print(f"verify {results[0]['path'].name} ({a.verify}):")
        verify(results[0]["path"], list(data), a.verify)
        r61, r4 = (gguf.GGUFReader(res["path"]) for res in results)
        t61 = {t.name: t for t in r61.tensors}
        for t in r4.tensors:
            if t.name in data:
                assert np.array_equal(np.asarray(t.data).view(np.uint8).ravel(),
                                      np.asarray(t61[t.name].data).view(np.uint8).ravel()), t.name
        print(f"{results[1]['path'].name}: data layers are byte-identical to the 61L file's")
    print(f"time: generate {t_gen:.1f}s, write {t_write:.1f}s, total {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
