#!/usr/bin/env bash
# Runs vLLM's live offline engine (`vllm.LLM`, vLLM 0.26.0 with vllm-gguf-plugin 0.0.5) on an
# NVIDIA GPU machine that has torch and transformers but no network, on a GGUF fixture, once per
# MLA decode backend, and writes format-2 dumps that `mla-diff compare` judges.
#
# vLLM and the packages it imports beyond the machine's own come as a wheel bundle made on a
# machine with network by `scripts/gpu-host/vllm_live_bundle.sh`: a zstd tar cut into parts small enough to
# carry a few at a time. Parts accumulate in $STAGE across calls, so the transfer resumes where it
# stopped while the machine keeps $STAGE.
#
# Usage (from the repository root):
#   bash scripts/gpu-host/vllm_live_gpu.sh receive DIR   copy the parts in DIR into $STAGE, check each
#                                               against SHA256SUMS, say which are still missing
#   bash scripts/gpu-host/vllm_live_gpu.sh status        which parts $STAGE holds and which it lacks
#   bash scripts/gpu-host/vllm_live_gpu.sh install       unpack the complete bundle, pip-install it (no
#                                               index, no dependencies) into $STAGE/site (its
#                                               wheels/if-missing/ only where the machine lacks
#                                               that distribution), import vLLM, the plugin, both
#                                               decode backends and the OpenAI API server
#   bash scripts/gpu-host/vllm_live_gpu.sh install-missing DIR   the same filtered install of
#                                               DIR's wheels
#   bash scripts/gpu-host/vllm_live_gpu.sh run OUT       for each backend in $BACKENDS: one prompt and
#                                               $DECODE_STEPS decode steps through `vllm.LLM` with
#                                               the hooks of mla_diff_hooks.vllm, then
#                                               `mla-diff compare` on the dump; then the same on
#                                               $SPLIT_MODEL (split attn_k_b/attn_v_b, which the
#                                               plugin does not load) with the first backend
# Exit status: 0 when every step did what it should (run: every compare of $MODEL exits 0 and the
# split model's exits 1), 1 otherwise, 2 for a usage error.
#
# Environment: STAGE (default /tmp/vllm-live), PYTHON (default python3), MLA_DIFF_BIN (default
# .gpu/mla-diff, else target/release/mla-diff), MODEL and CONFIG_DIR (default golden/models/fa3-v3-bf16.gguf and the folder
# golden/models/fa3-v3 holding its config.json; MODEL may be an HF checkpoint folder such as
# golden/hf-v3-fp8, which needs no CONFIG_DIR, runs with VLLM_USE_DEEP_GEMM=0 when its
# quantization_config is fp8, and skips the split-model check), SPLIT_MODEL (default
# golden/models/fa3-v3-split.gguf, same config), BACKENDS (default "FLASHMLA TRITON_MLA"),
# TOKENS (comma-separated prompt ids), DECODE_STEPS (default 3), VLLM_TIMEOUT (seconds per vLLM
# run, default 600).
set -u
STAGE=${STAGE:-/tmp/vllm-live}
PY=${PYTHON:-python3}
BIN=${MLA_DIFF_BIN:-.gpu/mla-diff}
[[ -x $BIN || -n ${MLA_DIFF_BIN:-} ]] || BIN=target/release/mla-diff
MODEL=${MODEL:-golden/models/fa3-v3-bf16.gguf}
CONFIG_DIR=${CONFIG_DIR:-golden/models/fa3-v3}
SPLIT_MODEL=${SPLIT_MODEL:-golden/models/fa3-v3-split.gguf}
BACKENDS=${BACKENDS:-FLASHMLA TRITON_MLA}
TOKENS=${TOKENS:-3,17,42,5,99,23,7,64,11,80,2,31,58,9,120,44,6,73,15,27}
DECODE_STEPS=${DECODE_STEPS:-3}
mkdir -p "$STAGE/parts"

missing_parts() {  # prints the parts named in SHA256SUMS that $STAGE lacks or holds damaged
  [[ -f $STAGE/parts/SHA256SUMS ]] || { echo "SHA256SUMS"; return; }
  grep ' bundle\.tar\.zst\.[0-9]*$' "$STAGE/parts/SHA256SUMS" | while read -r sum name; do
    if [[ ! -f $STAGE/parts/$name ]] || [[ $(sha256sum "$STAGE/parts/$name" | cut -d' ' -f1) != "$sum" ]]; then
      echo "$name"
    fi
  done
}

status() {
  local have miss
  have=$(cd "$STAGE/parts" && ls bundle.tar.zst.* 2>/dev/null | tr '\n' ' ')
  miss=$(missing_parts | tr '\n' ' ')
  echo "vllm_live: $STAGE holds: ${have:-nothing}"
  echo "vllm_live: missing: ${miss:-none}"
  [[ -z $miss ]]
}

# install_missing DIR: pip-installs into $STAGE/site each wheel of DIR whose distribution the
# machine's own Python lacks (what `vllm serve` imports beyond the offline engine: the bundle
# carries them without knowing which ones the machine has, and must not shadow those it has).
install_missing() {
  local dir=$1
  [[ -d $dir ]] || return 0
  mapfile -t need < <("$PY" - "$dir" <<'EOF'
import importlib.metadata as md, pathlib, re, sys
for w in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    dist = re.sub(r"[-_.]+", "-", w.name.split("-")[0]).lower()
    try:
        md.version(dist)
    except md.PackageNotFoundError:
        print(w)
EOF
)
  echo "vllm_live: ${#need[@]} of $(ls "$dir"/*.whl | wc -l) serving wheels missing here: $(printf '%s\n' "${need[@]}" | xargs -n1 basename 2>/dev/null | cut -d- -f1 | tr '\n' ' ')"
  [[ ${#need[@]} -eq 0 ]] || "$PY" -m pip install --quiet --no-deps --no-index --disable-pip-version-check \
    --target "$STAGE/site" "${need[@]}" 2>&1 | grep -v "^WARNING: Running pip as" | tail -3
}

case ${1:-} in
  install-missing)
    install_missing "${2:-}"
    exit 0
    ;;
  receive)
    src=${2:-}
    [[ -d $src ]] || { echo "vllm_live: receive needs the folder of carried parts"; exit 2; }
    cp -f "$src"/SHA256SUMS "$STAGE/parts/" 2>/dev/null
    # A zstd binary (and its libraries) may travel with the first part, for a machine without one.
    if [[ -x $src/zstd ]]; then
      mkdir -p "$STAGE/tools" && cp -f "$src"/zstd "$src"/lib*.so* "$STAGE/tools/" 2>/dev/null
    fi
    for f in "$src"/bundle.tar.zst.*; do
      [[ -f $f ]] && cp -f "$f" "$STAGE/parts/"
    done
    status
    exit 0
    ;;
  status)
    status
    exit $?
    ;;
  install)
    status || { echo "vllm_live: the bundle is incomplete"; exit 1; }
    whole=$(grep ' bundle\.tar\.zst$' "$STAGE/parts/SHA256SUMS" | cut -d' ' -f1)
    got=$(cat "$STAGE"/parts/bundle.tar.zst.* | sha256sum | cut -d' ' -f1)
    [[ $got == "$whole" ]] || { echo "vllm_live: the joined parts do not match SHA256SUMS"; exit 1; }
    rm -rf "$STAGE/wheels" "$STAGE/site" && mkdir -p "$STAGE/wheels"
    zstd_bin=$(command -v zstd || echo "$STAGE/tools/zstd")
    cat "$STAGE"/parts/bundle.tar.zst.* | LD_LIBRARY_PATH="$STAGE/tools${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
      "$zstd_bin" -dq --long=27 | tar -x -C "$STAGE/wheels" || exit 1
    mapfile -t wheels < <(find "$STAGE/wheels" -maxdepth 2 -path '*/if-missing' -prune -o -name '*.whl' -print)
    "$PY" -m pip install --quiet --no-deps --no-index --disable-pip-version-check \
      --target "$STAGE/site" "${wheels[@]}" 2>&1 | grep -v "^WARNING: Running pip as" | tail -5
    install_missing "$(find "$STAGE/wheels" -type d -name if-missing | head -1)"
    PYTHONPATH="$STAGE/site" "$PY" - <<'EOF'
import importlib, sys
mods = ["vllm", "vllm_gguf_plugin", "vllm.model_executor.models.deepseek_v2",
        "vllm.v1.attention.backends.mla.flashmla", "vllm.v1.attention.backends.mla.triton_mla",
        "vllm.vllm_flash_attn", "vllm.entrypoints.openai.api_server"]
bad = 0
for m in mods:
    try:
        importlib.import_module(m)
        print(f"vllm_live: import {m}: ok")
    except Exception as e:  # noqa: BLE001 - every failure is reported
        bad += 1
        print(f"vllm_live: import {m}: {type(e).__name__}: {e}")
import torch, vllm
print(f"vllm_live: vllm {vllm.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
sys.exit(1 if bad else 0)
EOF
    exit $?
    ;;
  run)
    out=${2:-}
    [[ -n $out ]] || { echo "vllm_live: run needs an output folder"; exit 2; }
    [[ -x $BIN ]] || { echo "vllm_live: no mla-diff binary at $BIN (set MLA_DIFF_BIN)"; exit 2; }
    mkdir -p "$out"
    rc=0
    one() {  # one NAME MODEL BACKEND WANT [EXTRA mla_diff_hooks.vllm ARGS]
      local name=$1 model=$2 backend=$3 want=$4
      shift 4
      echo "=== vllm_live: $name: $model, attention backend $backend"
      # an HF checkpoint folder carries its config.json; a block-FP8 one runs without DeepGEMM
      local cfg=(--hf-config-path "$CONFIG_DIR") deep_gemm=${VLLM_USE_DEEP_GEMM:-1}
      if [[ -d $model ]]; then
        cfg=()
        grep -q '"quant_method": *"fp8"' "$model/config.json" && deep_gemm=0
      fi
      PYTHONPATH="$STAGE/site:$PWD/python" VLLM_ALLOW_INSECURE_SERIALIZATION=1 VLLM_USE_DEEP_GEMM=$deep_gemm \
        timeout "${VLLM_TIMEOUT:-600}" "$PY" -m mla_diff_hooks.vllm "$model" "${cfg[@]}" \
        --tokens "$TOKENS" --decode-steps "$DECODE_STEPS" --dtype bfloat16 \
        --attention-backend "$backend" --max-model-len 512 --gpu-memory-utilization 0.3 \
        --dump "$out/$name.safetensors" --force "$@" >"$out/$name.vllm.log" 2>&1
      local vrc=$?
      echo "vllm_live: $name: vLLM exit $vrc in $SECONDS s since the script started"
      if (( vrc != 0 )); then
        grep -E "Error|error|Traceback" "$out/$name.vllm.log" | tail -15
        rc=1
        return
      fi
      grep -E "attention backend|Using .*backend|FLASHMLA|TRITON_MLA|FLASH_ATTN" "$out/$name.vllm.log" | head -6
      "$BIN" compare --model "$model" --dump "$out/$name.safetensors" --json "$out/$name.json" --force \
        >"$out/$name.compare.log" 2>&1
      local crc=$?
      echo "vllm_live: $name: compare exit $crc (want $want)"
      tail -n 30 "$out/$name.compare.log"
      (( crc == want )) || rc=1
    }
    for b in $BACKENDS; do
      one "live-$(echo "$b" | tr 'A-Z_' 'a-z-')" "$MODEL" "$b" 0
    done
    first=${BACKENDS%% *}
    # vLLM stops at load on the split file (kv_b_proj never loaded); --zero-unloaded lets it run
    # with a zero kv_b_proj, which compare must name. A GGUF's check only.
    [[ -d $MODEL ]] || one "live-split-$(echo "$first" | tr 'A-Z_' 'a-z-')" "$SPLIT_MODEL" "$first" 1 --zero-unloaded
    exit $rc
    ;;
  *)
    sed -n '2,35p' "$0"
    exit 2
    ;;
esac
