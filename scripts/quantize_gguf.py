#!/usr/bin/env python3
"""Quantize one GGUF with llama.cpp's own quantizer (llama_cpp.llama_model_quantize).

Why this exists: the quantized fixtures must carry exactly the per-tensor type choices and block
bytes that llama.cpp produces (including its silent fallbacks for short rows), so they are made by
llama.cpp itself through llama-cpp-python rather than by gguf-py. Kept as a separate process so
the caller can log llama.cpp's C-level output and survive a hard abort.

Usage: python scripts/quantize_gguf.py SRC.gguf DST.gguf FTYPE    (FTYPE: Q8_0, Q4_K_M, Q6_K, ...)
Exit code: 0 on success, otherwise llama.cpp's return code (or 2 for a usage error).
"""

import ctypes
import sys


def main() -> int:
    if len(sys.argv) != 4 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        return 2
    src, dst, ftype = sys.argv[1:]
    import llama_cpp

    name = "LLAMA_FTYPE_MOSTLY_" + ftype.upper()
    if not hasattr(llama_cpp, name):
        print(f"unknown ftype {ftype!r} (no llama_cpp.{name})", file=sys.stderr)
        return 2
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, name)
    params.nthread = 2
    sys.stdout.flush()
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    print(f"llama_model_quantize({src} -> {dst}, {ftype}) returned {rc}", flush=True)
    return int(rc)


if __name__ == "__main__":
    sys.exit(main())
