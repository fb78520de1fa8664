"""Torch side of the GPU benchmarks: causal scaled_dot_product_attention on the MHA prefill shape
of `mla-diff bench` (T=4096, N=16, P+R=192, V=128, bf16), timed with CUDA events.

Prints one JSON object: backend used, median microseconds, TFLOP/s counting N·T²·(P+R+V)
(the same count as `mla-diff bench`).
"""
import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

T, N, DQK, DV = 4096, 16, 192, 128


def run(backends):
    torch.manual_seed(0)
    q = torch.randn(1, N, T, DQK, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, N, T, DQK, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, N, T, DV, device="cuda", dtype=torch.bfloat16)
    scale = DQK ** -0.5
    with sdpa_kernel(backends):
        for _ in range(3):
            F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        torch.cuda.synchronize()
        times = []
        for _ in range(10):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1000.0)
    times.sort()
    us = times[len(times) // 2]
    flops = N * T * T * (DQK + DV)
    return us, flops / (us * 1e-6) / 1e12


def main():
    out = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "shape": f"T={T} N={N} P+R={DQK} V={DV} causal bf16"}
    for name, backends in [("cudnn", [SDPBackend.CUDNN_ATTENTION]), ("default", [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])]:
        try:
            us, tf = run(backends)
            out.update({"backend": name, "micros": us, "tflops": tf})
            break
        except Exception as e:  # the backend refused this shape; try the next
            out[f"{name}_error"] = str(e).splitlines()[0][:200]
    json.dump(out, sys.stdout)
    print()


if __name__ == "__main__":
    main()
