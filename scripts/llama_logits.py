#!/usr/bin/env python3
"""Evaluate a GGUF with llama.cpp (llama-cpp-python) and compare its logits with a golden.

Why this exists: an end-to-end cross-check of the fixture pipeline. The golden logits come from
HF transformers in float64; llama.cpp reads the converter's GGUF and runs its own deepseek2 graph.
Agreement to about 1e-6 shows that the GGUF, its metadata and the golden describe the same
model. llama.cpp is set up as an oracle should be: F32 KV cache, flash attention off (its CPU
flash attention rounds K/V to F16).

Usage: python scripts/llama_logits.py MODEL.gguf GOLDEN.safetensors
Prints one JSON line: {"max_abs": ..., "rel_l2": ..., "ref_absmax": ...}; exit 1 if it cannot load.
"""

import json
import sys

import numpy as np


def main() -> int:
    if len(sys.argv) != 3 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        return 2
    import llama_cpp
    from safetensors.numpy import load_file

    model_path, golden_path = sys.argv[1:]
    g = load_file(golden_path)
    tokens = [int(x) for x in g["tokens"]]
    n = len(tokens)
    try:
        llm = llama_cpp.Llama(model_path=model_path, n_ctx=max(64, n), n_batch=max(64, n), n_ubatch=max(64, n),
                              logits_all=True, verbose=False, n_threads=2, flash_attn=False,
                              type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    except ValueError as e:
        print(json.dumps({"error": str(e)}))
        return 1
    llm.eval(tokens)
    got = np.array(llm.scores[:n], dtype=np.float64)
    ref = g["logits"]
    print(json.dumps({"max_abs": float(np.abs(got - ref).max()),
                      "rel_l2": float(np.linalg.norm(got - ref) / np.linalg.norm(ref)),
                      "ref_absmax": float(np.abs(ref).max())}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
