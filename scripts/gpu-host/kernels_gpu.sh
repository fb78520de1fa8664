#!/usr/bin/env bash
# Production MLA kernels judged on a GPU machine: for each case, `mla-diff run --export-inputs`
# on a GGUF layer, mla_diff_hooks.kernels on the exported inputs (one dump per kernel), and
# `mla-diff compare` on each dump; prints one table row per (case, kernel, fault) with the exit
# code wanted and got and the class compare named.
#
#   scripts/gpu-host/kernels_gpu.sh WORK
#
# Environment: MLA_DIFF_BIN (default .gpu/mla-diff), VLLM_ROOT and PYTHONPATH as
# scripts/gpu-host/kernel_bundle.sh install leaves them, FIXTURE (default golden/models/fa3-v3-bf16.gguf,
# DeepSeek-V3's head dims at N = 4), V3 (a sparse DeepSeek-V3 file of scripts/fixtures/make_sparse_gguf.py;
# its cases are skipped when unset), KERNELS (default flashmla,triton-mla,flashinfer,fa3; fa3 is
# the prefill kernel, judged on attn_out and lse), ONLY (a
# regular expression: only the cases whose names match); EK_EXTRA,
# set per case below, passes arguments to mla_diff_hooks.kernels (run from this checkout's python/).
# Exit: 0 when every row got the exit code it wanted, 1 otherwise, 2 on usage errors.
set -u
[ $# -eq 1 ] || { sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
WORK=$1
BIN=${MLA_DIFF_BIN:-.gpu/mla-diff}
FIXTURE=${FIXTURE:-golden/models/fa3-v3-bf16.gguf}
KERNELS=${KERNELS:-flashmla,triton-mla,flashinfer,fa3}
[ -n "${VLLM_ROOT:-}" ] || { echo "kernels_gpu: VLLM_ROOT unset (see scripts/gpu-host/kernel_bundle.sh)" >&2; exit 2; }
mkdir -p "$WORK"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
bad=0
echo "| case | kernel | fault | compare exit (want) | class / first divergence |"
echo "|---|---|---|---|---|"

# judge CASE KERNEL FAULT WANT DUMP MODEL
judge() {
  local json="$WORK/$1.$2.${3:-clean}.json"
  "$BIN" compare --model "$6" --dump "$5" --json "$json" --force >"$json.log" 2>&1
  local rc=$?
  local what
  what=$(python3 - "$json" <<'PY' 2>/dev/null
import json, sys
d = json.load(open(sys.argv[1]))
f = d.get("findings") or []
if f:
    x = f[0]
    print(f"{x.get('class')} at {x.get('site')}")
else:
    print("within tolerance")
PY
)
  [ -n "$what" ] || what=$(tail -1 "$json.log")
  echo "| $1 | $2 | ${3:--} | $rc ($4) | $what |"
  [ "$rc" = "$4" ] || bad=1
}

# one CASE MODEL KERNELS PLANTS RUN_ARGS...   (PLANTS: comma list of fault:want, clean first)
one() {
  local name=$1 model=$2 kernels=$3 plants=$4
  shift 4
  [[ $name =~ ${ONLY:-.} ]] || return 0
  local dir="$WORK/$name"
  rm -rf "$dir"
  if ! "$BIN" run --model "$model" --quiet --path mha --export-inputs "$dir/in" "$@" >"$WORK/$name.export.log" 2>&1; then
    if ! [ -f "$dir/in/inputs.safetensors" ]; then
      echo "| $name | - | - | export failed | $(tail -1 "$WORK/$name.export.log") |"
      bad=1
      return
    fi
  fi
  local k p fault want
  for k in ${kernels//,/ }; do
    for p in ${plants//,/ }; do
      fault=${p%%:*} want=${p##*:}
      [ "$fault" = clean ] && fault=
      case "$fault:$k" in
        lse-base2:flashmla | lse-base2:triton-mla | phantom:flashmla | phantom:flashinfer) continue ;;
        block-table:fa3 | lse-base2:fa3 | phantom:fa3) continue ;;
      esac
      if ! PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" python3 -m mla_diff_hooks.kernels run \
        "$dir/in" "$dir/out" --force --kernels "$k" \
        --vllm-root "$VLLM_ROOT" ${fault:+--plant "$fault"} ${EK_EXTRA:-} >"$dir/$k.${fault:-clean}.log" 2>&1; then
        echo "| $name | $k | ${fault:--} | runner failed | $(tail -1 "$dir/$k.${fault:-clean}.log") |"
        bad=1
        continue
      fi
      judge "$name" "$k" "$fault" "$want" "$dir/out/$k${fault:+.$fault}.safetensors" "$model"
    done
  done
}

ALL="clean:0,block-table:1,no-yarn:1,lse-base2:1,phantom:1"
# The fixture has no YaRN: its softmax scale is the plain one, so no-yarn changes nothing there.
FIX="clean:0,block-table:1,lse-base2:1,phantom:1"
# The small case whose clean dumps tests/ keeps (golden/dumps/fa3-v3-bf16.kernel-*.safetensors).
one ci-fa3 "$FIXTURE" "$KERNELS" clean:0 --layer 0 --seqs 1,63,64,65 --page-size 64
# Sequence lengths around the page of 64: 1, page-1, page, page+1, several pages + remainder.
one fa3-p64 "$FIXTURE" "$KERNELS" "$FIX" --layer 0 --seqs 1,63,64,65,200 --page-size 64
one fa3-p16 "$FIXTURE" "${KERNELS/flashmla,/}" clean:0 --layer 0 --seqs 1,15,16,17,70 --page-size 16
one fa3-p1 "$FIXTURE" "${KERNELS/flashmla,/}" clean:0 --layer 0 --seqs 1,2,33 --page-size 1
# 16 Triton splits over contexts of 1-64 keys: most splits of most rows are empty.
EK_EXTRA="--splits 16" one fa3-split16 "$FIXTURE" triton-mla clean:0 --layer 0 --seqs 1,5,64 --page-size 16
if [ -n "${V3:-}" ]; then
  one v3-n128 "$V3" "$KERNELS" "$ALL" --layer 3 --seqs 1,63,64,65,300 --page-size 64
  one v3-tp8-r3 "$V3" "$KERNELS" clean:0 --layer 3 --seqs 1,63,64,65,300 --page-size 64 --tp 8 --rank 3
fi
exit $bad
