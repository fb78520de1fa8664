#!/usr/bin/env bash
# What mla_diff_hooks.kernels needs on a GPU machine without network, in one file small enough
# to carry to it (about 30 MB), and its installation there.
#
#   scripts/gpu-host/kernel_bundle.sh make VLLM_WHEEL FLASHINFER_WHEEL TVM_FFI_WHEEL OUT.tar
#       OUT.tar holds, unmodified: the files of the vLLM wheel that the kernels are
#       (vllm/_flashmla_C.abi3.so, vllm/third_party/flashmla/*.py, the Triton decode and merge
#       files under vllm/v1/attention/ops/, FA3's vllm/vllm_flash_attn/ interface and its
#       153 MB extension stored xz-compressed (11 MB), and the wheel's METADATA for its
#       version), and the flashinfer-python and apache-tvm-ffi wheels (about 30 MB in all;
#       `split -b 16M` it to carry it in pieces and `cat` the pieces back).
#   scripts/gpu-host/kernel_bundle.sh install OUT.tar DIR
#       unpacks the vLLM files into DIR/vllm-root (mla_diff_hooks.kernels --vllm-root DIR/vllm-root),
#       decompresses the FA3 extension and pip-installs the wheels into DIR/site (add it to
#       PYTHONPATH); no network, no deps.
#
# vLLM 0.26.0 pins flashinfer-python 0.6.14 and apache-tvm-ffi 0.1.10; FlashInfer's other
# requirements (ninja, einops, numpy, tabulate, requests, click, nvidia-ml-py) are on the GPU image.
set -euo pipefail

usage() {
  sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

[ $# -ge 1 ] || usage
cmd=$1
shift
case "$cmd" in
make)
  [ $# -eq 4 ] || usage
  vllm_whl=$1 fi_whl=$2 tvm_whl=$3 out=$4
  for f in "$vllm_whl" "$fi_whl" "$tvm_whl"; do
    [ -f "$f" ] || { echo "kernel_bundle: $f: no such file" >&2; exit 2; }
  done
  [ ! -e "$out" ] || { echo "kernel_bundle: $out exists" >&2; exit 2; }
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  mkdir -p "$work/vllm-root" "$work/wheels"
  members=$(python3 - "$vllm_whl" <<'EOF'
import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
want = ("vllm/_flashmla_C.abi3.so", "vllm/third_party/flashmla/",
        "vllm/v1/attention/ops/triton_decode_attention.py",
        "vllm/v1/attention/ops/triton_merge_attn_states.py",
        "vllm/vllm_flash_attn/__init__.py", "vllm/vllm_flash_attn/flash_attn_interface.py",
        "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so")
for n in z.namelist():
    if n.startswith(want) or (n.endswith(".dist-info/METADATA") and n.startswith("vllm-")):
        print(n)
EOF
)
  (cd "$work/vllm-root" && python3 -c 'import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); [z.extract(n) for n in sys.argv[2:]]' "$vllm_whl" $members)
  fa3="$work/vllm-root/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"
  [ ! -f "$fa3" ] || xz -T0 -6 "$fa3"
  cp "$fi_whl" "$tvm_whl" "$work/wheels/"
  tar -C "$work" -cf "$out" vllm-root wheels
  echo "kernel_bundle: wrote $out ($(du -h "$out" | cut -f1)): $(echo "$members" | wc -l) vLLM files, 2 wheels"
  ;;
install)
  [ $# -eq 2 ] || usage
  tarball=$1 dir=$2
  [ -f "$tarball" ] || { echo "kernel_bundle: $tarball: no such file" >&2; exit 2; }
  mkdir -p "$dir"
  tar -C "$dir" -xf "$tarball"
  # Python's lzma, so that the machine needs no xz binary.
  python3 - "$dir/vllm-root" <<'EOF'
import glob, lzma, os, shutil, sys
for packed in glob.glob(os.path.join(sys.argv[1], "vllm", "**", "*.so.xz"), recursive=True):
    with lzma.open(packed) as src, open(packed[:-3], "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(packed)
EOF
  python3 -m pip install -q --no-index --no-deps --target "$dir/site" "$dir"/wheels/*.whl
  echo "kernel_bundle: installed into $dir (--vllm-root $dir/vllm-root, PYTHONPATH=$dir/site)"
  ;;
*) usage ;;
esac
