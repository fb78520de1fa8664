#!/usr/bin/env bash
# vLLM 0.26's sparse MLA kernels judged on DSA layers on a GPU machine: for each case,
# `mla-diff run --export-inputs` on a glm-dsa layer (the reference's top-k selection in vLLM's
# index layouts), mla_diff_hooks.kernels on the export (flashmla-sparse: FlashMLA's
# flash_mla_sparse_fwd as FLASHMLA_SPARSE calls it; fa3-sparse: FA3 with q_v as
# FLASH_ATTN_MLA_SPARSE calls it; flashmla-sparse-decode, skipped with its reason: it reads only
# the fp8 cache), and `mla-diff compare` on each dump. Prints the runner's line per kernel
# (rel_l2 against the export's f64 attention over the selection, the padding it applied) and one
# table row per (case, kernel): the exit code wanted and got and the class compare named.
#
#   scripts/gpu-host/kernels_dsa_gpu.sh WORK
#
# Environment: MLA_DIFF_BIN (default .gpu/mla-diff), VLLM_ROOT and PYTHONPATH as
# scripts/gpu-host/kernel_bundle.sh install leaves them, GLM5 (a file of
# scripts/fixtures/make_glm5_gguf.py with data in layer 3; made in WORK when unset, which needs
# numpy and gguf), ONLY (a regular expression: only the cases whose names match).
# Exit: 0 when every row got the exit code it wanted, 1 otherwise, 2 on usage errors.
set -u
[ $# -eq 1 ] || { sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
WORK=$1
BIN=${MLA_DIFF_BIN:-.gpu/mla-diff}
KERNELS=flashmla-sparse,flashmla-sparse-decode,fa3-sparse
[ -n "${VLLM_ROOT:-}" ] || { echo "kernels_dsa_gpu: VLLM_ROOT unset (see scripts/gpu-host/kernel_bundle.sh)" >&2; exit 2; }
mkdir -p "$WORK"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
bad=0
SECONDS=0
if [ -z "${GLM5:-}" ]; then
  GLM5=$WORK/glm5/glm5-shaped-4L-q8_0.gguf
  if [ ! -f "$GLM5" ]; then
    python3 scripts/fixtures/make_glm5_gguf.py "$WORK/glm5" --layers-with-data 3 --verify none \
      >"$WORK/glm5.log" 2>&1 || { echo "kernels_dsa_gpu: make_glm5_gguf.py failed: $(tail -1 "$WORK/glm5.log")" >&2; exit 2; }
    echo "[${SECONDS}s] made $GLM5"
  fi
fi
rows=()

# one CASE MODEL RUN_ARGS...
one() {
  local name=$1 model=$2
  shift 2
  [[ $name =~ ${ONLY:-.} ]] || return 0
  local dir="$WORK/$name"
  rm -rf "$dir"
  if ! "$BIN" run --model "$model" --quiet --path mha --export-inputs "$dir/in" "$@" >"$WORK/$name.export.log" 2>&1 \
    && ! [ -f "$dir/in/inputs.safetensors" ]; then
    rows+=("| $name | - | export failed | - | $(tail -1 "$WORK/$name.export.log") |")
    bad=1
    return
  fi
  echo "[${SECONDS}s] $name: $(grep 'kernel inputs: wrote' "$WORK/$name.export.log")"
  local k
  for k in ${KERNELS//,/ }; do
    # One runner per kernel: a kernel that fails to load leaves the others running.
    local log="$dir/$k.runner.log"
    PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" python3 -m mla_diff_hooks.kernels run \
      "$dir/in" "$dir/out" --force --kernels "$k" --vllm-root "$VLLM_ROOT" >"$log" 2>&1
    local rrc=$?
    sed "s/^/[${SECONDS}s] $name: /" "$log"
    local line
    line=$(grep "^kernels: $k: skipped" "$log")
    if [ -n "$line" ]; then
      rows+=("| $name | $k | skipped | - | ${line#kernels: "$k": skipped: } |")
      continue
    fi
    if [ $rrc != 0 ]; then
      rows+=("| $name | $k | runner failed | - | $(tail -1 "$log") |")
      bad=1
      continue
    fi
    local dump="$dir/out/$k.safetensors" json="$dir/$k.json"
    [ -f "$dump" ] || { rows+=("| $name | $k | no dump | - | see $log |"); bad=1; continue; }
    "$BIN" compare --model "$model" --dump "$dump" --json "$json" --force >"$json.log" 2>&1
    local rc=$?
    local what
    what=$(python3 - "$json" <<'PY' 2>/dev/null
import json, sys
d = json.load(open(sys.argv[1]))
f = d.get("findings") or []
print(f"{f[0].get('class')} at {f[0].get('site')}" if f else "within tolerance")
PY
)
    [ -n "$what" ] || what=$(tail -1 "$json.log")
    rows+=("| $name | $k | $(grep -o 'attn_latent rel_l2 [^,]*, lse rel_l2 [^ ]*' "$log") | $rc (0) | $what |")
    [ "$rc" = 0 ] || bad=1
  done
}

# The small fixture (L 64, R 16, top-k 8): FA3's limits hold (R <= 64, L <= 512), FlashMLA's
# d_qk = 576 does not; rows past 8 keys keep a strict subset.
one dsa-glm-small golden/models/dsa-glm-f32.gguf --layer 1 --seqs 1,12,20,40 --page-size 64
# GLM-5's attention (N 64, L 512, R 64, top-k 2048), every head: the selection is every causal
# key (rows of at most 300 keys), the index width vLLM's 2048 with topk_length.
one glm5-n64 "$GLM5" --layer 3 --seqs 1,63,64,65,300 --page-size 64
# One TP-8 rank's 8 heads (what each rank of a GLM-5 deployment runs: FlashMLA pads them to 64),
# a 2113-token sequence: its last 65 rows keep 2048 of more visible keys.
one glm5-tp8-r3 "$GLM5" --layer 3 --seqs 1,65,2113 --page-size 64 --tp 8 --rank 3
echo "[${SECONDS}s] done"
echo "| case | kernel | runner | compare exit (want) | class / reason |"
echo "|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
exit $bad
