#!/usr/bin/env bash
# The GPU benchmarks side by side in one run: `mla-diff bench` (copy bandwidth, fast MQA
# decode memory- and compute-bound, fast MHA prefill), torch's scaled_dot_product_attention on
# the same prefill shape and, when VLLM_ROOT names the vLLM files of scripts/gpu-host/kernel_bundle.sh
# (FlashInfer on PYTHONPATH), the production decode kernels FlashMLA, vLLM's Triton MLA and
# FlashInfer MLA on the same decode shapes and FA3's prefill on the prefill shape
# (scripts/bench/bench_kernels.py). Run from the repository
# root on the GPU machine with the stripped binary in .gpu/ (see scripts/gpu-host/gpu_validate.sh). Writes
# $OUT/bench.json, $OUT/sdpa.json, $OUT/kernels.jsonl and prints the ratios.
set -eu
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
B=${MLA_DIFF_BIN:-.gpu/mla-diff}
date -u +"date: %Y-%m-%d %H:%M UTC"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
"$B" bench --json "$OUT/bench.json" --force
python3 scripts/bench/bench_sdpa.py > "$OUT/sdpa.json"
if [ -n "${VLLM_ROOT:-}" ]; then
  python3 scripts/bench/bench_kernels.py --vllm-root "$VLLM_ROOT" > "$OUT/kernels.jsonl"
else
  echo "bench_gpu: VLLM_ROOT unset: production decode kernels not timed" >&2
  : > "$OUT/kernels.jsonl"
fi
python3 - "$OUT/bench.json" "$OUT/sdpa.json" "$OUT/kernels.jsonl" <<'PY'
import json, sys
figs = {f["name"]: f for f in json.load(open(sys.argv[1]))}
sdpa = json.load(open(sys.argv[2]))
kernels = [json.loads(l) for l in open(sys.argv[3]) if l.strip()]
copy = figs["device-to-device copy"]["value"]
mem = figs["mqa decode, memory-bound"]["value"]
comp = figs["mqa decode, compute-bound"]["value"]
pre = figs["mha prefill"]["value"]
print(f"copy {copy:.0f} GB/s")
print(f"mqa decode memory-bound: {mem:.0f} GB/s = {mem / copy:.1%} of copy (goal >= 80%)")
print(f"mqa decode compute-bound: {comp:.1f} TFLOP/s (goal >= 170; vLLM Triton 84)")
print(f"mha prefill: {pre:.1f} TFLOP/s vs torch sdpa ({sdpa.get('backend')}) {sdpa.get('tflops', float('nan')):.1f} TFLOP/s = {pre / sdpa.get('tflops', float('nan')):.2f}x (goal >= 0.5x)")
print(json.dumps(sdpa))
for k in kernels:
    if k.get("shape") == "prefill":
        print(f"{k['kernel']} prefill: {k['TFLOP/s']} TFLOP/s; mla-diff/{k['kernel']} = {pre / k['TFLOP/s']:.2f}x; sdpa/{k['kernel']} = {sdpa.get('tflops', float('nan')) / k['TFLOP/s']:.2f}x")
    elif k["N"] == 16:
        print(f"{k['kernel']} decode N=16: {k['GB/s']} GB/s = {k['GB/s'] / copy:.1%} of copy; mla-diff/{k['kernel']} = {mem / k['GB/s']:.2f}x")
    else:
        print(f"{k['kernel']} decode N=128: {k['TFLOP/s']} TFLOP/s; mla-diff/{k['kernel']} = {comp / k['TFLOP/s']:.2f}x")
PY
