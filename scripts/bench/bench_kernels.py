"""Production MLA decode kernels on the decode shapes of `mla-diff bench`, timed with CUDA events:
B = 64 sequences of 4096 tokens, page 64, L = 512, R = 64, bf16, N = 16 (memory-bound: latent-cache
bytes read per second) and N = 128 (compute-bound: TFLOP/s counting 2·B·N·seq·(2L+R), the count
of `mla-diff bench`). Kernels are loaded as mla_diff_hooks.kernels loads them (FlashMLA and
vLLM's Triton decode from the vLLM files under --vllm-root, FlashInfer from its package).

With `fa3` in --kernels, also FlashAttention-3's varlen prefill from vLLM's wheel (as
mla_diff_hooks.kernels loads it) on the prefill shape of `mla-diff bench`: one causal sequence of
T = 4096, N = 16, q/k 192 and v 128 columns, bf16, TFLOP/s counting N·T²·(P+R+V) as that bench does.

Prints one JSON object per line: kernel, N, median microseconds over 20 launches after 5 warm-ups,
GB/s and TFLOP/s (decode), or TFLOP/s with "shape": "prefill".
"""
import argparse
import json
import os
import sys

import torch

# mla_diff_hooks from this checkout's python/
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
from mla_diff_hooks import kernels as ek  # noqa: E402

B, SEQ, PAGE, L, R = 64, 4096, 64, 512, 64


def median_us(fn):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)
    times.sort()
    return times[len(times) // 2]


def shapes(n, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks = B * SEQ // PAGE
    q = torch.randn(B, n, L + R, device="cuda", dtype=torch.bfloat16, generator=g)
    cache = torch.randn(blocks, PAGE, L + R, device="cuda", dtype=torch.bfloat16, generator=g)
    table = torch.randperm(blocks, device="cuda", generator=g).to(torch.int32).view(B, SEQ // PAGE)
    seqlens = torch.full((B,), SEQ, dtype=torch.int32, device="cuda")
    return q, cache, table, seqlens


def flashinfer_runner(q, cache, table, seqlens, scale):
    """Plans once, as an engine does per batch, and returns the launch."""
    import flashinfer

    n = q.shape[1]
    ws = torch.empty(128 * 1024 * 1024, dtype=torch.int8, device="cuda")
    w = flashinfer.mla.BatchMLAPagedAttentionWrapper(ws, backend="auto")
    pages = SEQ // PAGE
    kv_indptr = torch.arange(B + 1, dtype=torch.int32, device="cuda") * pages
    qo_indptr = torch.arange(B + 1, dtype=torch.int32, device="cuda")
    w.plan(qo_indptr, kv_indptr, table.reshape(-1), seqlens, n, L, R, PAGE, False, scale, q.dtype, cache.dtype)
    qn, qp = q[..., :L].contiguous(), q[..., L:].contiguous()
    ckv, kpe = cache[..., :L], cache[..., L:]
    return lambda: w.run(qn, qp, ckv, kpe, return_lse=True)


def prefill_fa3(fa):
    """FA3 varlen causal prefill on `mla-diff bench`'s prefill shape."""
    t, n, dqk, dv = 4096, 16, 192, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(t, n, dqk, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(t, n, dqk, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(t, n, dv, device="cuda", dtype=torch.bfloat16, generator=g)
    cu = torch.tensor([0, t], dtype=torch.int32, device="cuda")
    us = median_us(
        lambda: fa.flash_attn_varlen_func(
            q, k, v, t, cu, t, cu_seqlens_k=cu, softmax_scale=dqk**-0.5, causal=True,
            return_softmax_lse=True, fa_version=3,
        )
    )
    tflops = n * t * t * (dqk + dv) / (us * 1e-6) / 1e12
    print(json.dumps({"kernel": "fa3", "N": n, "shape": "prefill", "micros": round(us, 1), "TFLOP/s": round(tflops, 1)}))
    sys.stdout.flush()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-root", default=os.environ.get("VLLM_ROOT", "."))
    ap.add_argument("--kernels", default="flashmla,triton-mla,flashinfer,fa3")
    args = ap.parse_args()
    mods = ek.load_mods([k for k in args.kernels.split(",") if k != "flashinfer"], args.vllm_root, None)
    if "fa3" in mods:
        prefill_fa3(mods["fa3"])
    scale = (128 + R) ** -0.5
    for n in (16, 128):
        q, cache, table, seqlens = shapes(n)
        launches = {}
        if "flashmla" in mods:
            fm = mods["flashmla"]
            sched, _ = fm.get_mla_metadata()
            q4, c4 = q.unsqueeze(1), cache.unsqueeze(2)
            launches["flashmla"] = lambda: fm.flash_mla_with_kvcache(
                q4, c4, table, seqlens, L, sched, None, softmax_scale=scale, causal=False
            )
        if "triton-mla" in mods:
            tm = mods["triton-mla"]
            splits = ek.triton_splits(seqlens)
            o = torch.empty(B, n, L, dtype=q.dtype, device="cuda")
            lse = torch.empty(B, n, dtype=q.dtype, device="cuda")
            logits = torch.empty(B, n, splits, L + 1, dtype=torch.float32, device="cuda")
            kv = cache.unsqueeze(2)
            launches["triton-mla"] = lambda: tm.decode_attention_fwd(
                q, kv, kv[..., :L], o, lse, table, seqlens, logits, splits, scale, PAGE, is_mla=True
            )
        if "flashinfer" in args.kernels:
            launches["flashinfer"] = flashinfer_runner(q, cache, table, seqlens, scale)
        for name, fn in launches.items():
            us = median_us(fn)
            gbs = B * SEQ * (L + R) * 2 / (us * 1e-6) / 1e9
            tflops = 2.0 * B * n * SEQ * (2 * L + R) / (us * 1e-6) / 1e12
            print(json.dumps({"kernel": name, "N": n, "micros": round(us, 1), "GB/s": round(gbs), "TFLOP/s": round(tflops, 1)}))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
