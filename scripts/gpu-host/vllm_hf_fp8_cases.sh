#!/usr/bin/env bash
# vLLM's live offline engine on a block-FP8 Hugging Face checkpoint (golden/hf-v3-fp8: DeepSeek-V3's
# float8_e4m3fn weights with 128x128 weight_scale_inv blocks): clean on each MLA decode backend with
# a bf16 and with an fp8 latent cache, and once per planted fp8 bug, each dump judged by
# `mla-diff compare` and, where the run keeps them, its loaded weights by `mla-diff weights --check`.
#
# Why: the GGUF runs never reach vLLM's FP8 paths (Fp8LinearMethod, the CUTLASS block-scaled GEMM,
# the FP8 MoE, the fp8 latent cache and FLASHMLA's fp8 decode query). Each run is one vLLM process
# of scripts/gpu-host/vllm_live_cases.py: the `single` case (a 20-token prompt prefilled in one
# step, then 3 decode steps, layer 0, every head) and, for the clean runs, the `chunked` case (two
# long prompts whose last prefill step reads its cached context in chunks, then decode steps),
# every site kept. The runner reads the quantization from config.json and sets VLLM_USE_DEEP_GEMM=0
# (CutlassFp8BlockScaledMMKernel instead of DeepGEMM's minutes of warm-up).
#
# Usage (from the repository root, vLLM 0.26.0 installed into $STAGE/site by
# `bash scripts/gpu-host/vllm_live_gpu.sh install`, an mla-diff binary that reads HF folders):
#   bash scripts/gpu-host/vllm_hf_fp8_cases.sh OUT
# runs the lines of $RUNS in order, each `NAME BACKEND KV_CACHE_DTYPE CASES [PLANT]`, and writes
#   OUT/hf-v3-fp8.<backend>[-kv-fp8].<case>.safetensors        a clean run's dumps (+ .json, .compare.log)
#   OUT/hf-v3-fp8.<backend>[-kv-fp8].plant-<plant>.safetensors  a plant's dump
# (the first three runs keep their loaded weights: a WEIGHTS file <dump>.weights.safetensors and
# its .weights-check.log beside each dump), with every process's log under OUT/logs/ and a summary
# in OUT/logs/summary.txt. Runs start while $BUDGET seconds (default 570) leave at least 60.
# Exit status: 0 when each clean run's compare (and weights check) exit 0 and each plant's exit 1;
# 1 otherwise; 2 for a usage error or a machine without vLLM.
#
# Environment: STAGE (default /tmp/vllm-live), PYTHON (default python3), MLA_DIFF_BIN (default
# .gpu/mla-diff, else target/release/mla-diff), MODEL (default golden/hf-v3-fp8), RUNS (default
# below), BUDGET (seconds, default 570).
set -u
OUT=${1:-}
[[ -n $OUT ]] || { sed -n '2,31p' "$0"; exit 2; }
STAGE=${STAGE:-/tmp/vllm-live}
PY=${PYTHON:-python3}
BIN=${MLA_DIFF_BIN:-.gpu/mla-diff}
[[ -x $BIN || -n ${MLA_DIFF_BIN:-} ]] || BIN=target/release/mla-diff
MODEL=${MODEL:-golden/hf-v3-fp8}
# The default runs: issue order first (the loaded weights, the bf16 cache), then the fp8 cache,
# then one planted bug per fp8 class.
RUNS=${RUNS:-"clean-flashmla FLASHMLA auto single,chunked
clean-triton-mla TRITON_MLA auto single,chunked
plant-fp8-scale-transposed TRITON_MLA auto single fp8-scale-transposed
fp8kv-flashmla FLASHMLA fp8 single,chunked
fp8kv-triton-mla TRITON_MLA fp8 single,chunked
plant-kv-cache-scale FLASHMLA fp8 single kv-cache-scale
plant-fp8-query-scale FLASHMLA fp8 single fp8-query-scale
plant-fp8-act-padded-rows TRITON_MLA auto single fp8-act-padded-rows
kv-scale-baseline TRITON_MLA fp8 single kv-cache-scale:mode=none
plant-kv-cache-scale-missing TRITON_MLA fp8 single kv-cache-scale:mode=missing"}
BUDGET=${BUDGET:-570}
mkdir -p "$OUT/logs"
SUMMARY=$OUT/logs/summary.txt
: >"$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }

[[ -d $MODEL && -f $MODEL/config.json ]] || { say "vllm_hf_fp8: $MODEL is not an HF checkpoint folder"; exit 2; }
[[ -x $BIN ]] || { say "vllm_hf_fp8: no mla-diff binary at $BIN (set MLA_DIFF_BIN)"; exit 2; }
export PYTHONPATH="$STAGE/site:$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import vllm, torch; print(f'vllm_hf_fp8: vllm {vllm.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name(0)}')" \
  2>"$OUT/logs/import.log" | tee -a "$SUMMARY"
[[ ${PIPESTATUS[0]} -eq 0 ]] || { say "vllm_hf_fp8: vLLM does not import (logs/import.log); run vllm_live_gpu.sh install first"; exit 2; }
say "vllm_hf_fp8: model $MODEL, $(grep -c . <<<"$RUNS") runs, mla-diff $BIN"

rc=0
n=0
# one NAME BACKEND KV CASES [PLANT]: one vLLM process, bounded by what is left of $BUDGET; the
# first three runs keep their loaded weights
one() {
  local name=$1 backend=$2 kv=$3 cases=$4 plant=${5:-} left t0=$SECONDS extra=()
  left=$((BUDGET - SECONDS))
  if ((left < 60)); then
    say "vllm_hf_fp8: $name: not run, ${left} s of the budget left"
    rc=1
    return
  fi
  n=$((n + 1))
  ((n <= 3)) && extra+=(--weights)
  [[ -n $plant ]] && extra+=(--plant "$plant")
  MLA_DIFF_BIN=$BIN timeout "$left" "$PY" scripts/gpu-host/vllm_live_cases.py "$backend" "$OUT" \
    --model "$MODEL" --cases "$cases" --sites all --workspace 256 --kv-cache-dtype "$kv" "${extra[@]}" \
    >"$OUT/logs/$name.log" 2>&1
  local vrc=$?
  say "vllm_hf_fp8: $name: exit $vrc in $((SECONDS - t0)) s ($SECONDS s since the start)"
  grep -E "model |LLM up|planted|met no layer|compare exit|weights --check exit|finding|dump:|mla-diff:|Selected|Error" \
    "$OUT/logs/$name.log" | head -20 | tee -a "$SUMMARY"
  ((vrc == 0)) || { tail -n 15 "$OUT/logs/$name.log" | tee -a "$SUMMARY"; rc=1; }
}

while read -r name backend kv cases plant; do
  [[ -n $name ]] && one "$name" "$backend" "$kv" "$cases" "$plant"
done <<<"$RUNS"
ls -l "$OUT" | tee -a "$SUMMARY"
say "vllm_hf_fp8: exit $rc after $SECONDS s"
exit $rc
