#!/usr/bin/env bash
# The GPU benchmarks of the CUDA issue, side by side in one run: `mla-diff bench` (copy
# bandwidth, fast MQA decode memory- and compute-bound, fast MHA prefill) and torch's
# scaled_dot_product_attention on the same prefill shape. Run from the repository root on the GPU
# machine with the stripped binary in .gpu/ (see scripts/gpu_validate.sh). Writes $OUT/bench.json,
# $OUT/sdpa.json and prints the ratios.
set -eu
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
B=${MLA_DIFF_BIN:-.gpu/mla-diff}
date -u +"date: %Y-%m-%d %H:%M UTC"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
"$B" bench --json "$OUT/bench.json" --force
python3 scripts/bench_sdpa.py > "$OUT/sdpa.json"
python3 - "$OUT/bench.json" "$OUT/sdpa.json" <<'PY'
import json, sys
figs = {f["name"]: f for f in json.load(open(sys.argv[1]))}
sdpa = json.load(open(sys.argv[2]))
copy = figs["device-to-device copy"]["value"]
mem = figs["mqa decode, memory-bound"]["value"]
comp = figs["mqa decode, compute-bound"]["value"]
pre = figs["mha prefill"]["value"]
print(f"copy {copy:.0f} GB/s")
print(f"mqa decode memory-bound: {mem:.0f} GB/s = {mem / copy:.1%} of copy (goal >= 80%)")
print(f"mqa decode compute-bound: {comp:.1f} TFLOP/s (goal >= 170; vLLM Triton 84)")
print(f"mha prefill: {pre:.1f} TFLOP/s vs torch sdpa ({sdpa.get('backend')}) {sdpa.get('tflops', float('nan')):.1f} TFLOP/s = {pre / sdpa.get('tflops', float('nan')):.2f}x (goal >= 0.5x)")
print(json.dumps(sdpa))
PY
