#!/usr/bin/env bash
# Runs the tour: every command in the ```sh blocks of README.md, docs/guide.md and
# docs/engines.md, as written there, with the docs' placeholders replaced by committed files
# (golden/models, golden/dumps) and every output under a temporary folder. Each command's exit
# code is checked against the one the table below expects, and one line is printed per command:
#   pass  [exit 0] <the command as run>
#   FAIL  [exit 2, expected 0] <the command as run>   (then the end of its output)
#   skip  <the command as written>: <why>
# A command that no row of the table matches is a FAIL naming its file, so a command added to
# the docs without a row here is noticed. Commands that need a GPU, vLLM, transformers or
# llama.cpp are skipped with the reason (their outputs are committed under golden/dumps/, and
# the commands that read them run on those copies). The repository is never written: outputs go
# to a `mktemp -d` folder, `golden record` runs in a copy of the layout it needs, and a change of
# `git status` over the run is a FAIL.
#
# Usage: scripts/ci/tour.sh   (binary: $MLA_DIFF_BIN, default target/release/mla-diff; Python for
# make_sparse_gguf.py: $PYTHON, default python3, needs numpy and gguf, else that step is skipped)
# Exit: 0 every command ran as expected or was skipped with a reason, 1 otherwise, 2 no binary.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
BIN=${MLA_DIFF_BIN:-target/release/mla-diff}
[[ -x $BIN ]] || { echo "tour: no binary at $BIN (cargo build --release, or set MLA_DIFF_BIN)" >&2; exit 2; }
BIN=$(realpath "$BIN")
PY=${PYTHON:-python3}
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
G=golden/models
D=golden/dumps

# Outputs of skipped producers, from the committed dumps those producers made.
mkdir -p "$T/k/out" "$T/repo/golden/models"
cp "$D/legacy-kvb-f32.vllm.safetensors" "$T/d.safetensors"        # mla_diff_hooks.vllm (format 2, with weights)
cp "$D/legacy-kvb-f32.vllm.safetensors" "$T/vllm.safetensors"     # mla_diff_hooks.vllm_cpu run
cp "$D/legacy-kvb-f32.vllm.safetensors" "$T/loaded.safetensors"   # an engine's loaded weights
cp "$D/cpu-fp8/hf-v3-fp8.weight-only.safetensors" "$T/wo.safetensors"   # vllm_cpu run --model golden/hf-v3-fp8
cp "$D/cpu-fp8/hf-v3-fp8.weights.safetensors" "$T/w.safetensors"        # its WEIGHTS file
cp "$D/cpu-fp8/hf-v3-fp8.fp8-scale-transposed.weights.safetensors" "$T/planted.safetensors"  # the planted run's
mkdir -p "$T/mla" && cp "$D/live-gpu/fa3-v3-bf16.triton_mla.serve.safetensors" "$T/mla/dump.safetensors"  # the vLLM plugin's dump under `vllm serve`
cp "$D/fa3-v3-bf16.kernel-flashmla.safetensors" "$T/k/out/flashmla.safetensors"  # mla_diff_hooks.kernels
cp "$G/tiny-v3-q8_0.gguf" "$T/repo/golden/models/"                # golden record's repository
SPARSE="needs a Python with numpy and gguf (pip install numpy gguf; or set PYTHON)"
"$PY" -c "import numpy, gguf" 2>/dev/null && SPARSE=""

# The files whose ```sh blocks are the tour.
DOCS=(README.md docs/guide.md docs/engines.md)

# One row per command: a bash glob matched against the command as the docs write it (first
# match wins), then the expected exit code and the sed script that makes it runnable, or `skip`
# and the reason. Every row also gets: `mla-diff` → the binary, `/tmp/` → the temporary folder,
# `python ` → $PYTHON, `[optional args]` dropped.
ROWS=(
  'cargo run --release -- run --layer 1|0|s#^cargo run --release -- #mla-diff #'
  'cargo test --release*|skip|the test suite (.ci/run runs it: INSTA_UPDATE=no cargo test --release --locked)'
  'pip install *|skip|builds the wheel with maturin (.ci/run builds it and installs it into a clean venv)'
  'mla-diff run --model DeepSeek-V3-Q4_K_M.gguf *|0|s#DeepSeek-V3-Q4_K_M.gguf#'"$G"'/tiny-v3-q4_k_m.gguf#; s#--layer 3#--layer 1#'
  'mla-diff run --model m.gguf --layers *|0|s#m\.gguf#'"$G"'/tiny-v3-f32.gguf#; s#--layers 0\.\.4#--layers 0..2#'
  'mla-diff run --model m.gguf * --backend cuda *|skip|needs a GPU (--backend cuda)'
  'mla-diff run --model m.gguf *|0|s#m\.gguf#'"$G"'/tiny-v3-f32.gguf#; s#--layer 3#--layer 1#'
  'mla-diff run --layer 1 --inject *|1|'
  'python* -m mla_diff_hooks.hf *|skip|needs transformers and an HF model folder (its dumps are committed: golden/dumps/*.hf*)'
  'python* -m mla_diff_hooks.llama_cpp *|skip|needs llama-cpp-python (its dumps are committed: golden/dumps/*.llama-cpp*)'
  'python* -m mla_diff_hooks.vllm *|skip|needs vLLM and a GPU (scripts/gpu-host/vllm_live_gpu.sh; its dumps are committed: golden/dumps/*.vllm*)'
  'python* -m mla_diff_hooks.kernels *|skip|needs a GPU and the kernels'"'"' wheels (scripts/gpu-host/kernels_gpu.sh; its dumps are committed: golden/dumps/*.kernel-*)'
  'ids() {*|skip|a shell function that prints seeded token ids for the CPU harness recipe below it'
  'A=$(ids *|skip|the CPU harness recipe'"'"'s prompts (the recipe needs vLLM)'
  'python* -m mla_diff_hooks.vllm_cpu *|skip|installs vLLM (~3.6 GiB of wheels; its dumps are committed: golden/dumps/*.vllm*)'
  'export MLA_DIFF_VLLM_DUMP=*|skip|the vLLM plugin'"'"'s settings for `vllm serve` (needs vLLM and a GPU)'
  'vllm serve *|skip|needs vLLM and a GPU (the plugin'"'"'s dump is committed: golden/dumps/*.vllm*)'
  'curl *localhost:8000/v1/completions*|skip|needs the `vllm serve` above'
  'until curl *localhost:8000/health*|skip|needs the `vllm serve` above'
  'kill %1|skip|stops the `vllm serve` above'
  'mla-diff compare --model golden/models/fa3-v3-bf16.gguf --dump /tmp/mla/dump.safetensors*|0|'
  'bash scripts/gpu-host/vllm_live_bundle.sh *|skip|needs pip with network to PyPI (the wheel bundle a GPU machine without network installs)'
  'bash scripts/gpu-host/vllm_live_gpu.sh *|skip|runs on the GPU machine (receives and installs the vLLM bundle)'
  'export PYTHONPATH=*|skip|the bundle install'"'"'s site folder, on the GPU machine'
  'eval "$(cd python && python3 -m mla_diff_hooks.vllm_plugin *|0|'
  'mla-diff compare --model golden/models/legacy-kvb-f32.gguf --dump /tmp/chunked.safetensors*|0|s#/tmp/chunked\.safetensors#'"$D"'/live-cpu/legacy-kvb-f32.chunked.safetensors#'
  'python* scripts/fixtures/make_plant_dumps.py *|skip|runs vLLM'"'"'s CPU harness (its dumps are committed: golden/dumps/plants/)'
  'PY=*|skip|the setting of the HF dump recipe (transformers and make_fixtures.py'"'"'s HF checkpoints)'
  '$PY -m mla_diff_hooks.hf *|skip|needs transformers and the HF checkpoints make_fixtures.py writes (its dumps are committed: golden/dumps/*.hf*)'
  'mla-diff compare --model model.gguf --dump dump.safetensors*|0|s#model\.gguf#'"$G"'/tiny-v3-f32.gguf#; s#dump\.safetensors#'"$D"'/tiny-v3-f32.hf.safetensors#'
  'mla-diff compare --model model.gguf --dump /tmp/k/out/*|0|s#model\.gguf#'"$G"'/fa3-v3-bf16.gguf#'
  'mla-diff compare --model model.gguf --dump /tmp/d.safetensors*|0|s#model\.gguf#'"$G"'/legacy-kvb-f32.gguf#'
  'mla-diff compare --model golden/models/legacy-kvb-f32.gguf --dump /tmp/vllm.safetensors*|0|'
  'mla-diff compare --model golden/hf-v3-fp8 --dump /tmp/wo.safetensors*|0|'
  'mla-diff weights --model golden/hf-v3-fp8 --check /tmp/w.safetensors*|0|'
  'mla-diff weights --model golden/hf-v3-fp8 --check /tmp/planted.safetensors*|1|'
  'mla-diff compare --model golden/models/tiny-v3-f32.gguf --dump golden/dumps/tiny-v3-f32.hf-neox.safetensors|1|'
  'mla-diff compare --model golden/models/*.gguf --dump golden/dumps/plants/*|1|'
  'mla-diff compare --model golden/models/legacy-kvb-q8_0.gguf --dump golden/dumps/legacy-kvb-q8_0.vllm-tp?-fixed.safetensors*|0|'
  'mla-diff compare --model golden/models/legacy-kvb-q8_0.gguf --dump golden/dumps/legacy-kvb-q8_0.vllm-tp?.safetensors*|1|'
  'mla-diff weights --model golden/models/legacy-kvb-q8_0.gguf --check golden/dumps/legacy-kvb-q8_0.vllm-tp?.safetensors*|1|'
  'mla-diff weights --model golden/models/legacy-kvb-moe-q8_0.gguf --check golden/dumps/legacy-kvb-moe-q8_0.loaded-vllm-tp2.safetensors*|1|'
  'mla-diff weights --model model.gguf --check /tmp/d.safetensors*|0|s#model\.gguf#'"$G"'/legacy-kvb-f32.gguf#'
  'mla-diff weights --model model.gguf --check loaded.safetensors*|0|s#model\.gguf#'"$G"'/legacy-kvb-f32.gguf#; s#loaded\.safetensors#/tmp/loaded.safetensors#'
  'mla-diff run --model model.gguf * --export-inputs *|0|s#model\.gguf#'"$G"'/tiny-v3-f32.gguf#; s#--layer 3#--layer 1#'
  'mla-diff golden check --all*|0|'
  'mla-diff golden record *|0|s#^#cd /tmp/repo \&\& #'
  'mla-diff golden check --case *|0|'
  'mkdir -p /tmp/*|0|'
  'mla-diff selftest*|0|'
  'bash scripts/bench/bench_gpu.sh*|skip|needs a GPU'
  'mla-diff bench --dequant model.gguf*|0|s#model\.gguf#'"$G"'/tiny-v3-q4_k_m.gguf#'
  'mla-diff bench --reference model.gguf *|0|s#model\.gguf#'"$G"'/tiny-v3-q4_k_m.gguf#; s#--layer 3#--layer 1#'
  'python*scripts/bench/bench_cpu.py*|skip|needs torch, transformers 5, gguf-py and llama-cpp-python'
  'mla-diff kernels --compile-only *|skip|needs NVRTC and the CUDA headers (.ci/run compiles the kernels with NVRTC from PyPI)'
  'python*scripts/fixtures/make_sparse_gguf.py *|sparse|'
  'mla-diff run --model /tmp/v3/*|sparse|'
  'mla-diff inspect *|0|'
)

# The commands: every ```sh block of the DOCS, continuation lines joined, trailing comments
# dropped; each as "FILE<tab>COMMAND".
readarray -t CMDS < <(awk '
  FNR == 1 { inb = 0; cont = "" }
  /^```sh[[:space:]]*$/ { inb = 1; next }
  /^```/ { inb = 0; next }
  inb {
    line = $0
    if (cont != "") { sub(/^[[:space:]]+/, "", line); line = cont " " line; cont = "" }
    if (line ~ /\\[[:space:]]*$/) { sub(/[[:space:]]*\\[[:space:]]*$/, "", line); cont = line; next }
    sub(/[[:space:]]+#[[:space:]].*$/, "", line)
    if (line !~ /^[[:space:]]*$/) print FILENAME "\t" line
  }' "${DOCS[@]}")

before=$(git status --porcelain 2>/dev/null)
fails=0 passed=0 skipped=0 n=0
for entry in "${CMDS[@]}"; do
  file=${entry%%$'\t'*}; cmd=${entry#*$'\t'}
  n=$((n + 1))
  row=""
  for r in "${ROWS[@]}"; do
    # shellcheck disable=SC2053  # the row's pattern is a glob on purpose
    if [[ $cmd == ${r%%|*} ]]; then row=$r; break; fi
  done
  if [[ -z $row ]]; then
    echo "FAIL  $cmd ($file): no row in scripts/ci/tour.sh's table (add one: expected exit, substitutions)"
    fails=$((fails + 1)); continue
  fi
  rest=${row#*|}; expect=${rest%%|*}; arg=${rest#*|}
  if [[ $expect == sparse ]]; then
    if [[ -n $SPARSE ]]; then expect=skip; arg=$SPARSE; else expect=0; arg=""; fi
  fi
  if [[ $expect == skip ]]; then
    echo "skip  $cmd: $arg"; skipped=$((skipped + 1)); continue
  fi
  run=$(printf '%s\n' "$cmd" | sed -e "$arg" -e 's#\[[^]]*\]##g; s#  *# #g; s# *$##' \
    -e "s#/tmp/#$T/#g" -e "s#^mla-diff #$BIN #; s#&& mla-diff #\&\& $BIN #; s#^python #$PY #")
  log="$T/log.$n"
  (cd "$ROOT" && bash -c "$run") >"$log" 2>&1
  rc=$?
  if [[ $rc == "$expect" ]]; then
    echo "pass  [exit $rc] $run"; passed=$((passed + 1))
  else
    echo "FAIL  [exit $rc, expected $expect] $run"; tail -n 15 "$log" | sed 's/^/      /'
    fails=$((fails + 1))
  fi
done
if [[ $(git status --porcelain 2>/dev/null) != "$before" ]]; then
  echo "FAIL  the tour changed the repository:"; git status --porcelain | sed 's/^/      /'
  fails=$((fails + 1))
fi
echo "tour: ${#CMDS[@]} commands of ${DOCS[*]}: $passed passed, $skipped skipped, $fails failed"
(( n > 0 && fails == 0 ))
