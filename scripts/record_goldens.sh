#!/usr/bin/env bash
# Records every committed golden case (golden/<case>/{manifest.json,trace.safetensors}).
#
# One case per fixture in golden/models/, plus the embedded default. Every case runs all four
# paths on layer 1 (layer 2 for the MoE fixture) of a small two-sequence batch (2 and 5 tokens; page size 4, so one sequence
# fits in a page and one spans two; 2 decode splits; chunks of 2 context tokens), varying one
# thing per fixture so that the goldens also pin the token path, TP, bf16 and YaRN far from
# position 0. Re-recording replaces the cases (--force); review the diff before committing.
#
# Usage: scripts/record_goldens.sh [path/to/mla-diff]   (default: cargo run --release)
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ $# -ge 1 ]]; then BIN=("$1"); else cargo build --release --quiet; BIN=(target/release/mla-diff); fi
BASE=(--seqs 2,5 --page-size 4 --splits 2 --chunk-size 2 --new-tokens 2 --backend cpu --force)
rec() { local case=$1; shift; "${BIN[@]}" golden record --case "$case" --layer 1 "${BASE[@]}" "$@"; }
# The MoE fixture's cases record layer 2: with --input tokens its input is the reference's
# output of MoE layer 1, so the case pins the MoE FFN of the token path too.
rec_layer2() { local case=$1; shift; "${BIN[@]}" golden record --case "$case" --layer 2 "${BASE[@]}" "$@"; }
M=golden/models
rec embedded-default                                          # the embedded tiny-v3 Q4_K_M
rec tiny-v3-f32      --model $M/tiny-v3-f32.gguf --input tokens
rec tiny-v3-q8_0     --model $M/tiny-v3-q8_0.gguf
rec tiny-v3-q4_k_m   --model $M/tiny-v3-q4_k_m.gguf --tp 2
rec yarn-v3-f32      --model $M/yarn-v3-f32.gguf --start-pos 40
rec lite-v2-f32      --model $M/lite-v2-f32.gguf --input tokens
rec lite-v2-q8_0     --model $M/lite-v2-q8_0.gguf
rec legacy-kvb-f32   --model $M/legacy-kvb-f32.gguf
rec k256-q4_k_m      --model $M/k256-q4_k_m.gguf --tp 2
rec_layer2 moe-v3-f32  --model $M/moe-v3-f32.gguf --input tokens
rec_layer2 moe-v3-q8_0 --model $M/moe-v3-q8_0.gguf --input tokens
# DSA (deepseek32, glm-dsa) and MiniCPM3. The DSA cases use a 12-token sequence, past the
# indexer's top-k of 8, so the sparse selection (not all keys) is pinned; the glm-dsa F32 case
# records layer 2, a shared-indexer layer, on the token path (it reuses layer 1's selection).
DSA=(--seqs 3,12 --page-size 4 --splits 2 --chunk-size 2 --new-tokens 3 --backend cpu --force)
rec_dsa() { local case=$1 layer=$2; shift 2; "${BIN[@]}" golden record --case "$case" --layer "$layer" "${DSA[@]}" "$@"; }
rec_dsa dsa-v32-f32  1 --model $M/dsa-v32-f32.gguf --input tokens --tp 2
rec_dsa dsa-v32-q8_0 1 --model $M/dsa-v32-q8_0.gguf
rec_dsa dsa-glm-f32  2 --model $M/dsa-glm-f32.gguf --input tokens
rec_dsa dsa-glm-q8_0 1 --model $M/dsa-glm-q8_0.gguf --dtype bf16
rec minicpm3-f32     --model $M/minicpm3-f32.gguf --input tokens
rec minicpm3-q8_0    --model $M/minicpm3-q8_0.gguf
# DeepSeek-V3's head dims (P, R, V, L) = (128, 64, 128, 512) in BF16: the fused file in bf16,
# the dtype vLLM runs it in on a GPU; the split copy (k_b / v_b in F32) under TP 2.
rec fa3-v3-bf16      --model $M/fa3-v3-bf16.gguf --dtype bf16
rec fa3-v3-split     --model $M/fa3-v3-split.gguf --tp 2
