#!/usr/bin/env bash
# vLLM's live offline engine on a block-FP8 Hugging Face checkpoint (golden/hf-v3-fp8: DeepSeek-V3's
# float8_e4m3fn weights with 128x128 weight_scale_inv blocks), clean on each MLA decode backend and
# once with the fp8-scale-transposed plant, each judged by `mla-diff compare` and its loaded
# weights by `mla-diff weights --check`.
#
# Why: the GGUF runs never reach vLLM's FP8 path (Fp8LinearMethod, the CUTLASS block-scaled GEMM,
# the FP8 MoE). Each run is one vLLM process of scripts/gpu-host/vllm_live_cases.py's `single`
# case (a 20-token prompt prefilled in one step, then 3 decode steps, layer 0, every site and
# head, bf16 KV cache) with `--weights`: the dump holds the loaded weights dequantized to f32 and
# a WEIGHTS file is written beside it. The runner reads the quantization from config.json and sets
# VLLM_USE_DEEP_GEMM=0 (CutlassFp8BlockScaledMMKernel instead of DeepGEMM's minutes of warm-up).
#
# Usage (from the repository root, vLLM 0.26.0 installed into $STAGE/site by
# `bash scripts/gpu-host/vllm_live_gpu.sh install`, an mla-diff binary that reads HF folders):
#   bash scripts/gpu-host/vllm_hf_fp8_cases.sh OUT
# writes, for each backend B of $BACKENDS (lower case, e.g. flashmla, triton_mla):
#   OUT/hf-v3-fp8.B.single.safetensors                 format-2 dump (+ .json, .compare.log)
#   OUT/hf-v3-fp8.B.single.weights.safetensors         the WEIGHTS file (+ .weights-check.log)
# and for the plant, on $PLANT_BACKEND:
#   OUT/hf-v3-fp8.P.plant-fp8-scale-transposed.{safetensors,weights.safetensors,...}
# with every process's log under OUT/logs/ and a summary in OUT/logs/summary.txt. The whole run
# stops at $BUDGET seconds (default 570: the three processes start well inside a 600 s call).
# Exit status: 0 when each clean run's compare and weights check exit 0 and the plant's both exit
# 1; 1 otherwise; 2 for a usage error or a machine without vLLM.
#
# Environment: STAGE (default /tmp/vllm-live), PYTHON (default python3), MLA_DIFF_BIN (default
# .gpu/mla-diff, else target/release/mla-diff), MODEL (default golden/hf-v3-fp8), BACKENDS
# (default "FLASHMLA TRITON_MLA"), PLANT (default fp8-scale-transposed, i.e. layer 0's o_proj;
# `fp8-scale-transposed:param=kv_b_proj` for kv_b), PLANT_BACKEND (default TRITON_MLA), KV_DTYPE
# (default auto: bf16, the model dtype), BUDGET (seconds, default 570).
set -u
OUT=${1:-}
[[ -n $OUT ]] || { sed -n '2,31p' "$0"; exit 2; }
STAGE=${STAGE:-/tmp/vllm-live}
PY=${PYTHON:-python3}
BIN=${MLA_DIFF_BIN:-.gpu/mla-diff}
[[ -x $BIN || -n ${MLA_DIFF_BIN:-} ]] || BIN=target/release/mla-diff
MODEL=${MODEL:-golden/hf-v3-fp8}
BACKENDS=${BACKENDS:-FLASHMLA TRITON_MLA}
PLANT=${PLANT:-fp8-scale-transposed}
PLANT_BACKEND=${PLANT_BACKEND:-TRITON_MLA}
KV_DTYPE=${KV_DTYPE:-auto}
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
say "vllm_hf_fp8: model $MODEL, backends $BACKENDS, plant $PLANT on $PLANT_BACKEND, kv $KV_DTYPE, mla-diff $BIN"

rc=0
# one NAME BACKEND [vllm_live_cases.py ARGS]: one vLLM process, bounded by what is left of $BUDGET
one() {
  local name=$1 backend=$2 left t0=$SECONDS
  shift 2
  left=$((BUDGET - SECONDS))
  if ((left < 60)); then
    say "vllm_hf_fp8: $name: not run, ${left} s of the budget left"
    rc=1
    return
  fi
  MLA_DIFF_BIN=$BIN timeout "$left" "$PY" scripts/gpu-host/vllm_live_cases.py "$backend" "$OUT" \
    --model "$MODEL" --cases single --sites all --weights --workspace 0 --kv-cache-dtype "$KV_DTYPE" "$@" \
    >"$OUT/logs/$name.log" 2>&1
  local vrc=$?
  say "vllm_hf_fp8: $name: exit $vrc in $((SECONDS - t0)) s ($SECONDS s since the start)"
  grep -E "model |LLM up|planted|met no layer|compare exit|weights --check exit|finding|dump:|mla-diff:|Selected|Error" \
    "$OUT/logs/$name.log" | head -20 | tee -a "$SUMMARY"
  ((vrc == 0)) || { tail -n 15 "$OUT/logs/$name.log" | tee -a "$SUMMARY"; rc=1; }
}

for b in $BACKENDS; do
  one "clean-$(echo "$b" | tr 'A-Z_' 'a-z-')" "$b"
done
one "plant-${PLANT%%:*}" "$PLANT_BACKEND" --plant "$PLANT"
ls -l "$OUT" | tee -a "$SUMMARY"
say "vllm_hf_fp8: exit $rc after $SECONDS s"
exit $rc
