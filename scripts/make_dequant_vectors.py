#!/usr/bin/env python3
"""Make golden/dequant/vectors.safetensors: raw ggml blocks and their dequantized values.

Why this exists: mla-diff dequantizes GGUF tensors itself, and every weight it compares passes
through that code. This file gives one small test vector per ggml type that the fixtures use
(plus the common types around them): `<TYPE>.raw` (U8, the raw bytes of up to 8 blocks) and
`<TYPE>.expected` (F32, gguf-py's `gguf.quants.dequantize` of those bytes, flattened), with type
names spelled as ggml spells them (Q4_K, IQ4_XS, BF16, ...).

Where the bytes come from, in order of preference:
  1. a real tensor written by llama.cpp's quantizer: the committed fixtures in golden/models, then
     the extra k256 quantizations make_fixtures.py leaves in --tmp (Q2_K, Q3_K_M, Q5_K_M, IQ4_NL,
     IQ4_XS); MLA matrices are preferred over other tensors; the first blocks of the tensor are
     taken;
  2. otherwise gguf-py's own quantizer on seeded N(0, 1) data (plus a few edge values for the
     float types: signed zero, a subnormal, the largest finite value).
For the block-of-one float types (F32, F16, BF16) 256 elements are stored instead of 8.

As a side check, for every real tensor of a type gguf-py can also quantize (Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0), the F32 source tensor is re-quantized with gguf-py and compared byte for byte with
llama.cpp's output; the result is printed and stored in the metadata.

`__metadata__` holds, per type: `<TYPE>.type_id` (ggml type id), `<TYPE>.source`,
`<TYPE>.blocks`, `<TYPE>.block` ("elements/bytes"), `<TYPE>.in_fixtures` (committed files with a
tensor of that type), and for re-quantized types `<TYPE>.ggufpy_requant_identical`.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import st_io  # noqa: E402

MAX_BLOCKS = 8
FLOAT_ELEMS = 256
# always included (gguf-py can quantize these from random data if no real tensor has them)
# MXFP4 is decoded by mla-diff itself (rlx-gguf gets its nibble order wrong), so it gets a vector
# too; gguf-py quantizes it byte-identically to ggml.
BASE_TYPES = ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4"]
# included when a real tensor of the type exists (llama.cpp K-quants and IQ4 types)
REAL_ONLY_TYPES = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"]
REQUANT_TYPES = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"}
# tensor preference: MLA matrices first
PREFERRED = ["attn_kv_b", "attn_k_b", "attn_v_b", "attn_kv_a_mqa", "attn_q_b", "attn_q_a", "attn_q",
             "attn_output", "ffn_gate", "ffn_up", "ffn_down", "token_embd", "output", "attn_norm"]


def pref_key(name: str) -> tuple[int, str]:
    base = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
    return (PREFERRED.index(base) if base in PREFERRED else len(PREFERRED), name)


def f32_source_for(qfile: Path, tmp: Path) -> Path | None:
    """The F32 file a quantized fixture was made from (by naming convention)."""
    stem = qfile.stem.rsplit("-", 1)[0]                  # "tiny-v3-q4_k_m" -> "tiny-v3"
    for cand in (tmp / "models" / f"{stem}-f32-qlora0.gguf", REPO / "golden" / "models" / f"{stem}-f32.gguf",
                 tmp / "models" / f"{stem}-f32.gguf"):
        if cand.is_file():
            return cand
    return None


def rel(p: Path) -> str:
    try:
        return str(p.resolve().relative_to(REPO))
    except ValueError:
        return str(p)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tmp", type=Path, default=Path("/work/fixtures-tmp"),
                    help="make_fixtures.py's scratch folder (extra k256 quantizations)")
    ap.add_argument("--out", type=Path, default=REPO / "golden" / "dequant" / "vectors.safetensors")
    ap.add_argument("--seed", type=int, default=7, help="seed of the random data for gguf-py-made vectors")
    args = ap.parse_args()

    committed = sorted((REPO / "golden" / "models").glob("*.gguf"))
    extra = sorted((args.tmp / "models").glob("k256-*.gguf"))
    extra = [p for p in extra if not p.name.endswith("-f32.gguf")]
    readers = {p: gguf.GGUFReader(str(p)) for p in committed + extra}

    in_fixtures: dict[str, list[str]] = {}
    for p in committed:
        for t in readers[p].tensors:
            in_fixtures.setdefault(t.tensor_type.name, [])
            if p.name not in in_fixtures[t.tensor_type.name]:
                in_fixtures[t.tensor_type.name].append(p.name)

    wanted = list(dict.fromkeys(sorted(in_fixtures) + BASE_TYPES + REAL_ONLY_TYPES))
    rng = np.random.default_rng(args.seed)
    tensors: dict[str, np.ndarray] = {}
    meta: dict[str, str] = {"gguf_py": getattr(gguf, "__version__", "") or _gguf_version(),
                            "max_blocks": str(MAX_BLOCKS)}
    rows = []
    for name in sorted(wanted, key=lambda n: int(QT[n])):
        qt = QT[name]
        block_elems, block_bytes = gguf.constants.GGML_QUANT_SIZES[qt]
        n_blocks = FLOAT_ELEMS if block_elems == 1 else MAX_BLOCKS
        raw = None
        source = ""
        # 1. a real tensor: MLA matrices first, then committed files before --tmp ones
        files = committed + extra
        cands = sorted(((pref_key(t.name), i, t) for i, p in enumerate(files)
                        for t in readers[p].tensors if t.tensor_type == qt), key=lambda c: c[:2])
        for _, i, t in cands[:1]:
            p = files[i]
            data = np.asarray(t.data).view(np.uint8).reshape(-1)
            total_blocks = data.size // block_bytes
            take = min(n_blocks, total_blocks)
            raw = data[: take * block_bytes].copy()
            source = f"{rel(p)}:{t.name} blocks 0..{take - 1} of {total_blocks}"
            if name in REQUANT_TYPES:
                src = f32_source_for(p, args.tmp)
                if src is not None:
                    f32t = next(x for x in gguf.GGUFReader(str(src)).tensors if x.name == t.name)
                    arr = np.asarray(f32t.data, dtype=np.float32).reshape(tuple(int(v) for v in reversed(f32t.shape)))
                    requant = gguf.quants.quantize(arr, qt).view(np.uint8).reshape(-1)
                    same = bool(np.array_equal(requant, data))
                    meta[f"{name}.ggufpy_requant_identical"] = f"{same} ({t.name} from {rel(src)})"
                    print(f"  {name}: gguf-py re-quantization of {t.name} byte-identical to llama.cpp: {same}")
        # 2. gguf-py on seeded random data
        if raw is None:
            if name in REAL_ONLY_TYPES:
                print(f"  {name}: no real tensor found, skipped")
                continue
            x = rng.standard_normal(n_blocks * block_elems).astype(np.float32)
            if block_elems == 1:
                # edge values a decoder must get right
                edge = {"F16": [0.0, -0.0, 5.9604645e-08, -6.1035156e-05, 65504.0, -65504.0, 1.0, -2.0],
                        "BF16": [0.0, -0.0, 9.1835e-41, -1.1754944e-38, 3.3895314e38, -1.0, 1.00390625, 2.0],
                        "F32": [0.0, -0.0, 1e-45, -1.1754944e-38, 3.4028235e38, 1.0, -2.0, 0.5]}[name]
                x[: len(edge)] = np.array(edge, dtype=np.float32)
            raw = gguf.quants.quantize(x, qt).view(np.uint8).reshape(-1).copy()
            source = f"gguf-py quantize of seeded N(0,1) data (numpy default_rng({args.seed}))"
            if block_elems == 1:
                source += " with edge values first"
        expected = gguf.quants.dequantize(raw, qt).astype(np.float32).reshape(-1)
        nb = raw.size // block_bytes
        assert expected.size == nb * block_elems
        ggml_same = ggml_check(raw, qt, expected)
        if ggml_same is not None:
            meta[f"{name}.ggml_to_float_identical"] = str(ggml_same)
            if not ggml_same:
                print(f"  {name}: WARNING gguf-py dequantize differs from ggml's to_float")
        tensors[f"{name}.raw"] = raw
        tensors[f"{name}.expected"] = expected
        meta[f"{name}.type_id"] = str(int(qt))
        meta[f"{name}.source"] = source
        meta[f"{name}.blocks"] = str(nb)
        meta[f"{name}.block"] = f"{block_elems}/{block_bytes}"
        meta[f"{name}.in_fixtures"] = ",".join(in_fixtures.get(name, []))
        rows.append((name, int(qt), nb, raw.size, source))
    meta["types"] = ",".join(r[0] for r in rows)

    st_io.save(tensors, args.out, metadata=meta)
    print(f"\n{'type':8} {'id':>3} {'blocks':>6} {'bytes':>6}  source")
    for r in rows:
        print(f"{r[0]:8} {r[1]:>3} {r[2]:>6} {r[3]:>6}  {r[4]}")
    print(f"\n{rel(args.out)}: {args.out.stat().st_size} bytes")


_GGML = None


def ggml_check(raw: np.ndarray, qt: QT, expected: np.ndarray) -> bool | None:
    """Dequantize with ggml's own C to_float (llama-cpp-python's libggml-base), compare bit-exact.

    Returns None when the library (or a to_float for the type) is not available.
    """
    global _GGML
    if _GGML is None:
        try:
            import llama_cpp
            lib = Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"
            _GGML = ctypes.CDLL(str(lib))
            _GGML.ggml_get_type_traits.restype = ctypes.POINTER(_TypeTraits)
            _GGML.ggml_get_type_traits.argtypes = [ctypes.c_int]
        except (ImportError, OSError):
            _GGML = False
    if not _GGML:
        return None
    traits = _GGML.ggml_get_type_traits(int(qt)).contents
    if not traits.to_float:
        return None
    to_float = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.c_int64)(traits.to_float)
    src = np.ascontiguousarray(raw)
    out = np.empty(expected.size, dtype=np.float32)
    to_float(src.ctypes.data, out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), out.size)
    return bool(np.array_equal(out.view(np.uint32), expected.view(np.uint32)))


class _TypeTraits(ctypes.Structure):
    """struct ggml_type_traits (ggml.h of the vendored llama.cpp)."""
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                ("from_float_ref", ctypes.c_void_p)]


def _gguf_version() -> str:
    from importlib.metadata import version
    return version("gguf")


if __name__ == "__main__":
    main()
