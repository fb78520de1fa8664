"""Small GGUF helpers for the fixture pipeline (PyPI gguf-py only; no llama.cpp code in-process).

Why this exists: several fixtures are the official converter's output with a controlled edit (a
legacy `attn_kv_b` file rebuilt from the split `attn_k_b`/`attn_v_b` pair, a copy that carries
`q_lora_rank = 0` for the quantizer, or a BF16 file whose `attn_k_b`/`attn_v_b` are stored as
F32), and every quantized file needs a per-tensor type listing for golden/README.md. llama.cpp's
quantizer is run in a child process (quantize_gguf.py) so that its C-level log can be kept and a
hard abort inside ggml cannot take the generator down.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import gguf

HERE = Path(__file__).resolve().parent


# --------------------------------------------------------------------------------------------
# reading
# --------------------------------------------------------------------------------------------

def read_kv(path: Path) -> dict[str, Any]:
    """All metadata key/values except the GGUF.* virtual fields (token lists are summarised)."""
    r = gguf.GGUFReader(str(path))
    kv: dict[str, Any] = {}
    for name, f in r.fields.items():
        if name.startswith("GGUF."):
            continue
        val = f.contents()
        if isinstance(val, list) and len(val) > 16:
            val = f"<array of {len(val)}>"
        kv[name] = val
    return kv


def tensor_types(path: Path) -> list[tuple[str, str, tuple[int, ...]]]:
    """[(tensor name, ggml type name, ne)] in file order."""
    r = gguf.GGUFReader(str(path))
    return [(t.name, t.tensor_type.name, tuple(int(x) for x in t.shape)) for t in r.tensors]


def load_f32_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a GGUF as float32 numpy (PyTorch order), dequantized if needed."""
    r = gguf.GGUFReader(str(path))
    out = {}
    for t in r.tensors:
        if t.tensor_type == gguf.GGMLQuantizationType.F32:
            a = np.array(t.data, dtype=np.float32)
        else:
            a = gguf.quants.dequantize(np.array(t.data), t.tensor_type)
        out[t.name] = a.reshape(tuple(int(x) for x in reversed(t.shape)))
    return out


# --------------------------------------------------------------------------------------------
# rewriting
# --------------------------------------------------------------------------------------------

KeyEdit = Callable[[str, Any, "gguf.GGUFValueType", "gguf.GGUFValueType | None"],
                   Iterable[tuple[str, Any, "gguf.GGUFValueType", "gguf.GGUFValueType | None"]]]
TensorEdit = Callable[[str, np.ndarray], Iterable[tuple]]

# tensor types rewrite_gguf reads and writes: their values round-trip through float32 exactly
PLAIN_TYPES = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.BF16)


def rewrite_gguf(src: Path, dst: Path, key_edit: KeyEdit | None = None,
                 tensor_edit: TensorEdit | None = None) -> None:
    """Copy a GGUF of F32 and BF16 tensors, passing every key and tensor through optional edit
    callbacks.

    key_edit(name, value, type, sub_type) yields zero or more (name, value, type, sub_type);
    tensor_edit(name, array) yields zero or more (name, array) or (name, array, ggml type), the
    array as float32 in PyTorch order; without a type a tensor keeps the source tensor's type.
    Order is preserved, so an edit can drop an item, replace it, or insert new ones at that
    position. Writing BF16 rounds to nearest even (gguf-py's quantizer); a value that is not a
    bf16 value is refused, so a rewrite never changes a weight silently.
    """
    r = gguf.GGUFReader(str(src))
    arch = r.fields[gguf.Keys.General.ARCHITECTURE].contents()
    w = gguf.GGUFWriter(str(dst), arch=arch)   # writes general.architecture itself
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == gguf.Keys.General.ARCHITECTURE:
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        items = [(name, f.contents(), vtype, sub)]
        if key_edit is not None:
            items = list(key_edit(name, f.contents(), vtype, sub))
        for k, v, t, s in items:
            w.add_key_value(k, v, t, sub_type=s)
    for t in r.tensors:
        if t.tensor_type not in PLAIN_TYPES:
            raise ValueError(f"{src}: rewrite_gguf handles F32 and BF16 tensors only, "
                             f"{t.name} is {t.tensor_type.name}")
        shape = tuple(int(x) for x in reversed(t.shape))
        if t.tensor_type == gguf.GGMLQuantizationType.F32:
            arr = np.array(t.data, dtype=np.float32).reshape(shape)
        else:
            arr = gguf.quants.dequantize(np.array(t.data), t.tensor_type).reshape(shape)
        items = [(t.name, arr)]
        if tensor_edit is not None:
            items = list(tensor_edit(t.name, arr))
        for item in items:
            n, a = item[0], np.ascontiguousarray(item[1], dtype=np.float32)
            qtype = item[2] if len(item) > 2 else t.tensor_type
            if qtype == gguf.GGMLQuantizationType.F32:
                w.add_tensor(n, a)
            elif qtype == gguf.GGMLQuantizationType.BF16:
                q = gguf.quants.quantize(a, qtype)
                if not np.array_equal(gguf.quants.dequantize(q, qtype).reshape(a.shape), a):
                    raise ValueError(f"{src}: {n} holds values that are not bf16 values")
                w.add_tensor(n, q, raw_dtype=qtype)
            else:
                raise ValueError(f"{src}: rewrite_gguf writes F32 or BF16, not {qtype!r} ({n})")
    dst.parent.mkdir(parents=True, exist_ok=True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# --------------------------------------------------------------------------------------------
# quantizing (llama.cpp, child process)
# --------------------------------------------------------------------------------------------

def quantize(src: Path, dst: Path, ftype: str, log: Path, python: str = sys.executable) -> int:
    """Quantize src -> dst with llama.cpp's quantizer (ftype like "Q4_K_M"); returns its exit code."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as fh:
        proc = subprocess.run([python, str(HERE / "quantize_gguf.py"), str(src), str(dst), ftype],
                              stdout=fh, stderr=subprocess.STDOUT)
    return proc.returncode
