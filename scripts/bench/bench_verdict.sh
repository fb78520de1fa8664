#!/usr/bin/env bash
# Time to verdict at real size: the P7/P7b/P8 rows of BENCHMARKS.md from one run.
#
# Makes the sparse full-geometry DeepSeek-V3 file (scripts/fixtures/make_sparse_gguf.py; needs numpy and
# gguf in $PYTHON) unless it exists, then runs `mla-diff run --layer 3` at real size and prints
# one Markdown row per run: wall time and peak RSS (from `--stats`), the exit code, the verdict,
# and the stage that took longest. Every row states the exit code it must have; a clean run that
# diverges (a false alarm), a refused run, or a clean run whose site list differs from a T=19
# run of the same layer makes the script exit 1.
# The fp8 modes time the same layer read from a Hugging Face checkpoint folder in DeepSeek-V3's
# FP8 format (scripts/fixtures/make_sparse_hf_fp8.py, sparse, full geometry; needs numpy and
# torch in $PYTHON): the P8 (cpu-fp8) or P7 (gpu-fp8) row on the GGUF file, then the same
# arguments with `--model` the folder (P8-fp8, P7-fp8), so both figures come from one machine.
#
# Usage: scripts/bench/bench_verdict.sh [gpu|cpu|all|gpu-fp8|cpu-fp8]
#        (default: gpu when nvidia-smi answers, else cpu)
# Environment: MLA_DIFF_BIN (default target/release/mla-diff), PYTHON (default python3),
#              WORK (default /tmp/mla-diff-verdict: the sparse file and folder, logs and JSON reports),
#              MLA_DIFF_CACHE_DIR (default $WORK/cache: the NVRTC cache the GPU rows use).
set -uo pipefail
cd "$(dirname "$0")/../.."

BIN=${MLA_DIFF_BIN:-target/release/mla-diff}
PY=${PYTHON:-python3}
WORK=${WORK:-/tmp/mla-diff-verdict}
mode=${1:-auto}
case $mode in
  gpu|cpu|all|gpu-fp8|cpu-fp8|auto) ;;
  *)
    sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'
    [ "$mode" = -h ] || [ "$mode" = --help ] && exit 0
    echo "bench_verdict: unknown mode '$mode' (gpu, cpu, all, gpu-fp8 or cpu-fp8)" >&2
    exit 2
    ;;
esac
if [ "$mode" = auto ]; then
  if nvidia-smi -L >/dev/null 2>&1; then mode=gpu; else mode=cpu; fi
fi
mkdir -p "$WORK"
# Every run compiles into (and reads) this NVRTC cache; P7-cold empties it first.
export MLA_DIFF_CACHE_DIR=${MLA_DIFF_CACHE_DIR:-$WORK/cache}
MODEL="$WORK/deepseek-v3-sparse-4L.gguf"
if [ ! -f "$MODEL" ]; then
  "$PY" scripts/fixtures/make_sparse_gguf.py "$WORK" --verify sample >"$WORK/make_sparse.log" 2>&1 \
    || { echo "bench_verdict: make_sparse_gguf.py failed (needs numpy and gguf in $PY):"; tail -5 "$WORK/make_sparse.log"; exit 2; }
fi
# The FP8 checkpoint folder: written beside it and renamed when complete, so an interrupted
# write is never taken for a made folder.
HF_MODEL="$WORK/deepseek-v3-sparse-fp8"
if [ "${mode%-fp8}" != "$mode" ] && [ ! -d "$HF_MODEL" ]; then
  rm -rf "$HF_MODEL.tmp"
  "$PY" scripts/fixtures/make_sparse_hf_fp8.py "$HF_MODEL.tmp" --verify sample >"$WORK/make_sparse_fp8.log" 2>&1 \
    && mv "$HF_MODEL.tmp" "$HF_MODEL" \
    || { echo "bench_verdict: make_sparse_hf_fp8.py failed (needs numpy and torch in $PY):"; tail -5 "$WORK/make_sparse_fp8.log"; exit 2; }
fi

failed=0
# Whether every path of report $2 has the same site list as in the T=19 report $1.
same_sites() {
  "$PY" - "$1" "$2" <<'PYEOF'
import json, sys
def by_path(f):
    out = {}
    for s in json.load(open(f))["sites"]:
        out.setdefault(s["path"], []).append(s["site"])
    return out
ref, run = by_path(sys.argv[1]), by_path(sys.argv[2])
sys.exit(0 if all(ref.get(p) == v for p, v in run.items()) else 1)
PYEOF
}

# row ID EXPECTED_EXIT DESCRIPTION ARGS...: one run, one table row, on $model (the GGUF file
# unless a caller sets it).
model=$MODEL
row() {
  local id=$1 expect=$2 desc=$3
  shift 3
  local json="$WORK/$id.json" log="$WORK/$id.log"
  "$BIN" run --model "$model" --layer 3 --stats --quiet --json "$json" --force "$@" >"$log" 2>&1
  local rc=$?
  local wall rss stage verdict
  wall=$(sed -n 's/.*stats: wall \([0-9.]*\) s.*/\1 s/p' "$log")
  rss=$(sed -n 's/.*peak RSS \([0-9.]* GiB\).*/\1/p' "$log")
  stage=$(sed -n 's/^mla-diff: stages: //p' "$log" | tr ',' '\n' | sed 's/^ //' \
    | awk '{t=$(NF-1); if ($NF ~ /×\)$/) t=$(NF-2); if (t+0 > best) {best=t+0; name=$0}} END {print name}')
  # The first divergence or error if any, else how many paths passed.
  verdict=$(grep -m1 -E "first divergence|error" "$log" | cut -c1-70)
  [ -n "$verdict" ] || verdict="$(grep -c "within tolerance" "$log") path(s) within tolerance"
  printf '| %s | %s | `%s` | %s | %s | %s (want %s) | %s | %s |\n' \
    "$id" "$desc" "$*" "${wall:-n/a}" "${rss:-n/a}" "$rc" "$expect" "${stage:-n/a}" "${verdict:-n/a}"
  if [ "$rc" != "$expect" ]; then
    failed=1
    sed 's/^/    /' "$log" | tail -5
  fi
  if [ -f "$json" ] && [ "$rc" = 0 ] && ! same_sites "$WORK/t19.json" "$json"; then
    echo "    site list differs from the T=19 run"
    failed=1
  fi
}

echo "bench_verdict: $("$BIN" --version 2>/dev/null), $(nproc) cores, $(date -u +%Y-%m-%d), mode $mode"
echo
# The T=19 run of the same layer: the site list every row must reproduce.
"$BIN" run --model "$MODEL" --layer 3 --tokens 19 --quiet --json "$WORK/t19.json" --force >/dev/null 2>&1

echo "| id | what | arguments | wall | peak RSS | exit | longest stage | verdict |"
echo "|---|---|---|---|---|---|---|---|"
if [ "$mode" = gpu ] || [ "$mode" = all ]; then
  # Cold: an empty NVRTC cache; then the same run with the kernels cached.
  rm -rf "$MLA_DIFF_CACHE_DIR"
  row P7-cold 0 "H200, T=4096, all paths, bf16, NVRTC cache empty" \
    --backend cuda --tokens 4096 --dtype bf16
  row P7 0 "H200, T=4096, all paths, bf16, kernels cached" --backend cuda --tokens 4096 --dtype bf16
  row P7-cpuref 0 "H200, T=4096, all paths, bf16, f64 reference on the CPU" \
    --backend cuda --tokens 4096 --dtype bf16 --reference-backend cpu
  row P7b-f32 0 "H200, T=4096, all paths, f32" --backend cuda --tokens 4096
  row P7b-seqs 0 "H200, 4 sequences, mqa, bf16" --backend cuda --seqs 1,4000,2000,17 --path mqa --dtype bf16
  row P7-inject 1 "H200, T=4096, mha, bf16, --inject no-mscale (softmax-scale)" \
    --backend cuda --tokens 4096 --path mha --dtype bf16 --inject no-mscale
fi
if [ "$mode" = cpu ] || [ "$mode" = all ]; then
  row P8 0 "CPU, T=512, all paths, f32" --backend cpu --tokens 512
  row P8-bf16 0 "CPU, T=512, all paths, bf16 (false-alarm check)" --backend cpu --tokens 512 --dtype bf16
fi
if [ "$mode" = gpu-fp8 ]; then
  # An untimed run first, so that both rows read the NVRTC cache the same way.
  "$BIN" run --model "$MODEL" --layer 3 --backend cuda --tokens 4096 --dtype bf16 --quiet --force >/dev/null 2>&1
  row P7 0 "H200, T=4096, all paths, bf16, GGUF Q4_K_M" --backend cuda --tokens 4096 --dtype bf16
  model=$HF_MODEL
  row P7-fp8 0 "H200, T=4096, all paths, bf16, HF FP8 folder" --backend cuda --tokens 4096 --dtype bf16
  model=$MODEL
fi
if [ "$mode" = cpu-fp8 ]; then
  row P8 0 "CPU, T=512, all paths, f32, GGUF Q4_K_M" --backend cpu --tokens 512
  model=$HF_MODEL
  row P8-fp8 0 "CPU, T=512, all paths, f32, HF FP8 folder" --backend cpu --tokens 512
  model=$MODEL
fi
exit $failed
