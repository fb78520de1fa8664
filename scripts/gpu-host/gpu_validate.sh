#!/usr/bin/env bash
# GPU validation of the CUDA backend, run from the repository root on a machine with an NVIDIA
# GPU and CUDA in /usr/local/cuda. Build on a development machine first:
#   cargo build --release && cargo test --release --no-run
#   mkdir -p .gpu && strip -o .gpu/mla-diff target/release/mla-diff
#   strip -o .gpu/cuda-tests "$(ls target/release/deps/cuda-* | grep -v '\.d$' | head -1)"
#   mkdir -p .gpu/one .gpu/wg && cp golden/models/tiny-v3-q8_0.gguf .gpu/one/
#   cp golden/models/lite-v2-q8_0.gguf golden/models/k256-q4_k_m.gguf .gpu/wg/
# then run `bash scripts/gpu-host/gpu_validate.sh STAGE...` there. Logs go to $OUT (or ./gpu-logs).
# Stages: smoke, report, tests, quick, selftest-f32, selftest-bf16, fast-quick, fast-bf16,
# fast-wgmma, memcheck, racecheck, memcheck-fast, racecheck-fast, racecheck-teams-global,
# memcheck-wgmma, racecheck-wgmma, sass.
# The *-wgmma stages force the decode's wgmma block (MLA_DIFF_DECODE_CFG, below) on every fixture
# it fits (L a multiple of 128: lite-v2 and k256; the others run the 64-head mma.sync block).
# racecheck-teams-global forces the teams block with the merge through global memory
# (TEAMS_GLOBAL, below) and checks only the decode kernel; the fixtures have 2-6 heads, so every
# other fast stage runs the default teams block (the cluster merge where the splits allow).
set -u
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
B=${MLA_DIFF_BIN:-.gpu/mla-diff}
WGMMA=64,8,1,0,2,1,0,0,0,1
TEAMS_GLOBAL=16,4,1,0,4,1,0,4,0,0,2
step() {  # step NAME TIMEOUT CMD... (MLA_DIFF_STEP_CAP, if set, caps every TIMEOUT in seconds)
  local name=$1 t=$2; shift 2
  if [[ -n ${MLA_DIFF_STEP_CAP:-} ]] && (( t > MLA_DIFF_STEP_CAP )); then t=$MLA_DIFF_STEP_CAP; fi
  echo "=== $name: $*" | tee -a "$OUT/summary.log"
  local start=$(date +%s%N)
  timeout "$t" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  local ms=$(( ($(date +%s%N) - start) / 1000000 ))
  echo "=== $name: exit $rc in $((ms / 1000)).$(( (ms % 1000) / 100 )) s" | tee -a "$OUT/summary.log"
  tail -n 25 "$OUT/$name.log"
}
for stage in "$@"; do
  case $stage in
    smoke)
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee -a "$OUT/summary.log"
      step kernels 120 "$B" kernels --compile-only --arch sm_90,sm_80
      step run 120 "$B" run --backend cuda --layer 1 --seqs 1,15,16,17,53 --tp 2 --quiet
      ;;
    report)
      # The golden gate on this machine's CPU (another CPU than the recording one), and a triage
      # report from the CUDA backend (GPU, driver, NVRTC and cuBLAS lines filled in).
      step golden-check 120 "$B" golden check --all
      step report-cuda 120 "$B" run --backend cuda --layer 1 --inject phantom-output --report "$OUT/r-cuda.md" --force --quiet
      step report-cuda-bf16 120 "$B" run --backend cuda --dtype bf16 --layer 1 --seqs 3,17 --page-size 4 --report "$OUT/r-cuda-bf16.md" --force --quiet
      ;;
    tests)
      step cuda-tests 300 env MLA_DIFF_REPO="$PWD" .gpu/cuda-tests --include-ignored --nocapture --test-threads 1
      ;;
    nccl)
      # The NCCL all-reduce with one rank on GPU 0 (libnccl.so on LD_LIBRARY_PATH: see
      # docs/gpu-validation.md), alone and as a run's o_proj all-reduce.
      step nccl-one-rank 120 env MLA_DIFF_REPO="$PWD" .gpu/cuda-tests nccl_one_rank --include-ignored --nocapture --test-threads 1
      step nccl-run 120 "$B" run --backend cuda --layer 1 --tp 1 --devices 0
      ;;
    quick)
      step selftest-quick 300 "$B" selftest --backend cuda --quick --cross-check
      ;;
    selftest-f32)
      step selftest-f32 590 "$B" selftest --backend cuda --cross-check
      ;;
    selftest-bf16)
      step selftest-bf16 590 "$B" selftest --backend cuda --dtype bf16 --cross-check
      ;;
    fast-quick)
      step selftest-fast-quick 300 "$B" selftest --backend cuda --kernels fast --dtype bf16 --quick --cross-check
      ;;
    fast-bf16)
      step selftest-fast-bf16 590 "$B" selftest --backend cuda --kernels fast --dtype bf16 --cross-check
      ;;
    fast-wgmma)
      step selftest-fast-wgmma 590 env MLA_DIFF_DECODE_CFG=$WGMMA "$B" selftest --backend cuda --kernels fast --dtype bf16 --cross-check
      ;;
    memcheck-wgmma)
      step memcheck-wgmma 590 env MLA_DIFF_DECODE_CFG=$WGMMA /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 3 "$B" selftest --backend cuda --kernels fast --dtype bf16 --quick --models .gpu/wg
      ;;
    racecheck-wgmma)
      step racecheck-wgmma 590 env MLA_DIFF_BF16_GEMM=emulate MLA_DIFF_DECODE_CFG=$WGMMA /usr/local/cuda/bin/compute-sanitizer --tool racecheck --error-exitcode 3 "$B" selftest --backend cuda --kernels fast --dtype bf16 --quick --models .gpu/wg
      ;;
    sass)
      mkdir -p "$OUT/cubin"
      step sass-compile 120 "$B" kernels --compile-only --arch sm_90 --out "$OUT/cubin"
      f="$OUT/cubin/fast_decode.cu.hm64-w8-p1-qsmem-s2-wgmma.sm_90a.cubin"
      echo "fast_decode.cu (wgmma): $(/usr/local/cuda/bin/cuobjdump --dump-sass "$f" | grep -c HGMMA) HGMMA, $(/usr/local/cuda/bin/cuobjdump --dump-sass "$f" | grep -c LDGSTS) LDGSTS (cp.async) instructions" | tee -a "$OUT/summary.log"
      for m in fast_prefill fast_decode; do
        echo "$m.cu: $(/usr/local/cuda/bin/cuobjdump --dump-sass "$OUT/cubin/$m.cu.sm_90.cubin" | grep -c HMMA) HMMA, $(/usr/local/cuda/bin/cuobjdump --dump-sass "$OUT/cubin/$m.cu.sm_90.cubin" | grep -c LDGSTS) LDGSTS (cp.async), $(/usr/local/cuda/bin/cuobjdump --dump-sass "$OUT/cubin/$m.cu.sm_90.cubin" | grep -c LDSM) LDSM (ldmatrix) instructions" | tee -a "$OUT/summary.log"
      done
      rm -rf "$OUT/cubin"
      ;;
    racecheck-fast)
      # compute-sanitizer cannot handle cuBLAS's bf16 GEMM kernels (an internal error at the first
      # cublasGemmEx): MLA_DIFF_BF16_GEMM=emulate runs the same bf16-input, f32-accumulate GEMMs
      # through cublasSgemm on bf16-rounded inputs.
      # One fixture (tiny-v3-q8_0, copied to .gpu/one/) keeps the instrumented run short.
      step racecheck-fast 590 env MLA_DIFF_BF16_GEMM=emulate /usr/local/cuda/bin/compute-sanitizer --tool racecheck --error-exitcode 3 "$B" selftest --backend cuda --kernels fast --dtype bf16 --quick --models .gpu/one
      ;;
    memcheck-fast)
      step memcheck-fast 590 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 3 "$B" selftest --backend cuda --kernels fast --dtype bf16 --quick --models .gpu/one
      ;;
    racecheck-teams-global)
      step racecheck-teams-global 590 env MLA_DIFF_BF16_GEMM=emulate MLA_DIFF_DECODE_CFG=$TEAMS_GLOBAL /usr/local/cuda/bin/compute-sanitizer --tool racecheck --error-exitcode 3 --kernel-name kns=decode_split_mma "$B" selftest --backend cuda --kernels fast --dtype bf16 --quick --models .gpu/one
      ;;
    memcheck)
      step memcheck 590 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 3 "$B" selftest --backend cuda --quick
      ;;
    racecheck)
      step racecheck 590 /usr/local/cuda/bin/compute-sanitizer --tool racecheck --error-exitcode 3 "$B" selftest --backend cuda --quick
      ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
