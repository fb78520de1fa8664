#!/usr/bin/env bash
# Makes the wheel bundle that scripts/gpu-host/vllm_live_gpu.sh installs on a GPU machine without network:
# vLLM 0.26.0, vllm-gguf-plugin 0.0.5 and the packages vLLM imports on the offline-engine path
# that a machine with torch 2.11 (cu130), triton 3.6, transformers 5.x and the usual scientific
# stack lacks, as cp312 manylinux wheels, packed as a zstd tar cut into parts of 27 MiB.
#
# The vLLM wheel is slimmed before packing (it is 290 MiB): FA2's extension (305 MB unpacked; on
# sm_90 vLLM's MLA prefill uses FA3), the Rust HTTP frontend binary, an sm_100-only attention
# library and the deep_gemm builds for other Pythons are left out, its RECORD rewritten to match,
# and its members stored uncompressed so that the outer zstd compresses them.
#
# Usage: bash scripts/gpu-host/vllm_live_bundle.sh OUTDIR   (needs pip with network to PyPI, python3, zstd)
# Writes OUTDIR/wheels/*.whl, OUTDIR/bundle.tar.zst and OUTDIR/parts/{bundle.tar.zst.NN,SHA256SUMS}
# with this machine's zstd binary and its libraries beside them.
# Carry the parts with `scripts/gpu-host/vllm_live_gpu.sh receive` (one or two per call).
set -eu
out=${1:?usage: vllm_live_bundle.sh OUTDIR}
mkdir -p "$out/wheels" "$out/parts"
# Exact versions: vLLM, its GGUF plugin and gguf, flashinfer (vLLM's sampler imports it at engine
# start), xgrammar/llguidance and their tvm-ffi (vllm.v1.request imports the structured-output
# backends), openai/openai-harmony/fastapi/starlette (imported by vllm.entrypoints.llm),
# pydantic and its core, compressed-tensors and loguru (imported for every quantization method,
# GGUF included), pyzmq/msgspec/cbor2/pybase64 (engine-core messaging and hashing), the small
# pure-Python rest of that import closure, and what `vllm serve` imports on top of it.
WHEELS=(
  vllm==0.26.0 vllm-gguf-plugin==0.0.5 gguf==0.19.0 flashinfer-python==0.6.14
  apache-tvm-ffi==0.1.10 llguidance==1.7.6 xgrammar==0.2.7 openai-harmony==0.0.8 openai==2.54.0
  pydantic==2.13.4 pydantic-core==2.46.4 typing-inspection==0.4.2 annotated-types==0.8.0
  compressed-tensors==0.17.0 loguru==0.7.3 pyzmq==27.3.0 msgspec==0.23.0 cbor2==6.3.0
  pybase64==1.5.1 jiter==0.19.0 fastapi==0.136.3 starlette==1.10.0 partial-json-parser==0.2.1.1.post7
  cachetools==8.0.2 distro==1.9.0 sniffio==1.3.1
  # `vllm serve`: the ASGI server and its event loop, the HTTP parser, the metrics endpoint and
  # its middleware, aiohttp (the API server's client sessions) and its pure-Python dependencies,
  # server-sent events and form parsing.
  uvicorn==0.55.0 h11==0.16.0 httptools==0.9.0 uvloop==0.23.0 click==8.5.1 prometheus-client==0.26.0
  prometheus-fastapi-instrumentator==8.1.0 aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0
  frozenlist==1.8.0 multidict==7.2.1 propcache==0.5.4 yarl==1.25.1 sse-starlette==3.7.1
  python-multipart==0.0.34
)
# What the OpenAI API server imports on top (vllm.entrypoints.openai.api_server and the modules it
# pulls in: file watching for TLS reloads, websockets, the SageMaker-style routes, email
# validation, tracing, Mistral's request types, the guided-decoding backends, ...), at the
# versions vLLM 0.26.0's own dependency resolution picks. A GPU machine's Python may have some of
# them already: they go to wheels/if-missing/, installed only where the machine lacks them.
IF_MISSING=(
  watchfiles==1.3.0 websockets==17.4 model-hosting-container-standards==0.1.16 jmespath==1.1.0
  email-validator==2.4.0 dnspython==2.9.2 python-json-logger==4.2.0 setproctitle==1.3.8 ijson==3.6.0
  blake3==1.0.11 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2
  opentelemetry-semantic-conventions==0.66b2 opentelemetry-semantic-conventions-ai==0.5.1
  opentelemetry-exporter-otlp==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2
  opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-exporter-otlp-proto-grpc==1.45.2
  opentelemetry-proto==1.45.2 opentelemetry-exporter-http-transport==0.66b2
  opentelemetry-exporter-otlp-common==0.66b2 googleapis-common-protos==1.76.0 grpcio==1.85.3
  mistral_common==1.13.1 pydantic-extra-types==2.11.1 pycountry==26.2.16 tiktoken==0.14.0
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
  attrs==26.1.0 annotated-doc==0.0.7 anyio==4.16.0 httpx==0.29.0 httpcore==1.0.9
  lm-format-enforcer==0.11.3 outlines_core==0.2.14 lark==1.2.2 einops==0.8.2 depyf==0.20.0 dill==0.4.1
  cloudpickle==3.1.3 py-cpuinfo==9.0.0 python-dotenv==1.2.4 truststore==0.10.5 pydantic-settings==2.16.3
)
download() {
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --dest "$@"
}
download "$out/download" "${WHEELS[@]}"
cp "$out"/download/*.whl "$out/wheels/"
mkdir -p "$out/wheels/if-missing"
download "$out/wheels/if-missing" "${IF_MISSING[@]}"
whl=$(ls "$out"/download/vllm-0.26.0-*.whl)
python3 - "$whl" "$out/wheels/$(basename "$whl")" <<'EOF'
import csv, fnmatch, io, sys, zipfile
src, dst = sys.argv[1], sys.argv[2]
drop_globs = ["vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm-rs", "vllm/third_party/fmha_sm100/*",
              "vllm/third_party/deep_gemm/_C.cpython-310-*", "vllm/third_party/deep_gemm/_C.cpython-311-*",
              "vllm/third_party/deep_gemm/_C.cpython-313-*", "vllm/third_party/deep_gemm/_C.cpython-314-*"]
zin = zipfile.ZipFile(src)
drop = {n for n in zin.namelist() if any(fnmatch.fnmatchcase(n, g) for g in drop_globs)}
with zipfile.ZipFile(dst, "w", compression=zipfile.ZIP_STORED) as zout:
    for info in zin.infolist():
        if info.filename in drop:
            continue
        data = zin.read(info.filename)
        if info.filename.endswith(".dist-info/RECORD"):
            rows = [r for r in csv.reader(io.StringIO(data.decode())) if r and r[0] not in drop]
            buf = io.StringIO()
            csv.writer(buf, lineterminator="\n").writerows(rows)
            data = buf.getvalue().encode()
        zi = zipfile.ZipInfo(info.filename, date_time=info.date_time)
        zi.external_attr = info.external_attr
        zout.writestr(zi, data)
print(f"vllm_live_bundle: {dst}: {len(drop)} members left out")
EOF
tar -C "$out" -cf "$out/bundle.tar" wheels
zstd -q -f --long=27 -19 -T0 "$out/bundle.tar" -o "$out/bundle.tar.zst"
rm -f "$out"/parts/bundle.tar.zst.*
split -b 27M -d -a 2 "$out/bundle.tar.zst" "$out/parts/bundle.tar.zst."
(cd "$out/parts" && sha256sum bundle.tar.zst.* && (cd .. && sha256sum bundle.tar.zst)) > "$out/parts/SHA256SUMS.tmp"
mv "$out/parts/SHA256SUMS.tmp" "$out/parts/SHA256SUMS"
# A GPU machine may lack zstd: this machine's binary and the libraries it links (not libc's)
# travel in the parts folder; `vllm_live_gpu.sh receive` keeps them for `install`.
cp -f "$(command -v zstd)" "$out/parts/"
ldd "$(command -v zstd)" | awk '/=> \// {print $3}' | grep -v -e '/libc\.so' -e '/libm\.so' -e '/libpthread' \
  | while read -r lib; do cp -f "$lib" "$out/parts/"; done
ls -l "$out/parts"
