"""Byte-reproducible safetensors writer.

Why this exists: the `safetensors` package stores `__metadata__` through a Rust HashMap, so the
header's key order (and therefore the file's bytes and sha256) changes from run to run. Goldens
are checked into the repository and pinned by hash, so they are written here with a fixed
header: `__metadata__` first (keys sorted), then the tensors in the order given, data laid out in
that same order. The result is an ordinary safetensors file (any reader loads it). `load` reads
such a file (or any safetensors file of these dtypes) back with numpy alone, so joining the
per-rank dumps of a tensor-parallel run needs no other package.
"""

from __future__ import annotations

import json
from pathlib import Path

from ._deps import optional

np = optional("numpy", "mla_diff_hooks.st_io")


def _dtypes() -> dict:
    """numpy dtype -> safetensors dtype name (built on first use: numpy is optional to import)."""
    return {
        np.dtype(np.float64): "F64",
        np.dtype(np.float32): "F32",
        np.dtype(np.float16): "F16",
        np.dtype(np.int64): "I64",
        np.dtype(np.int32): "I32",
        np.dtype(np.uint8): "U8",
    }


def bf16_bits(arr: np.ndarray) -> np.ndarray | None:
    """The bf16 encoding (uint16, the upper half of each float32) of `arr` when every value of
    it is a bf16 value (the lower 16 bits of each float32 zero: what a bf16 engine tensor
    copied to float32 is), else None. Storing those bits loses nothing and halves the bytes."""
    if arr.dtype != np.float32:
        return None
    bits = np.ascontiguousarray(arr).view(np.uint32)
    if np.any(bits & np.uint32(0xFFFF)):
        return None
    return (bits >> np.uint32(16)).astype("<u2")


def save(
    tensors: dict[str, np.ndarray],
    path: Path,
    metadata: dict[str, str] | None = None,
    bf16_exact=None,
) -> None:
    """Write `tensors` (insertion order kept) and string `metadata` to `path`. A float32 tensor
    whose name `bf16_exact(name)` accepts is stored as BF16 when that is exact (bf16_bits)."""
    dtypes = _dtypes()
    header: dict = {}
    if metadata:
        header["__metadata__"] = {k: str(metadata[k]) for k in sorted(metadata)}
    blobs = []
    offset = 0
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        if arr.dtype not in dtypes:
            raise TypeError(f"{name}: unsupported dtype {arr.dtype}")
        bits = bf16_bits(arr) if bf16_exact is not None and bf16_exact(name) else None
        if bits is not None:
            header[name] = {
                "dtype": "BF16",
                "shape": list(arr.shape),
                "data_offsets": [offset, offset + bits.nbytes],
            }
            blobs.append(bits.tobytes())
            offset += bits.nbytes
            continue
        data = arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {
            "dtype": dtypes[arr.dtype],
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    hjson = json.dumps(header, separators=(",", ":")).encode()
    hjson += b" " * (-len(hjson) % 8)  # pad so the data section starts 8-aligned
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(len(hjson).to_bytes(8, "little"))
        fh.write(hjson)
        for b in blobs:
            fh.write(b)
    tmp.replace(path)


def load(path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The tensors (in file order, as numpy arrays) and `__metadata__` of a safetensors file.

    Errors: ValueError naming the file for a header that is not safetensors' or a dtype outside
    F64, F32, F16, BF16 (read as float32), I64, I32, U8."""
    path = Path(path)
    data = path.read_bytes()
    if len(data) < 8:
        raise ValueError(f"{path}: not a safetensors file ({len(data)} bytes)")
    n = int.from_bytes(data[:8], "little")
    try:
        header = json.loads(data[8 : 8 + n])
    except ValueError as e:
        raise ValueError(f"{path}: unreadable safetensors header ({e})") from None
    meta = dict(header.pop("__metadata__", None) or {})
    by_name = {v: k for k, v in _dtypes().items()}
    base = 8 + n
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if info.get("dtype") == "BF16":  # stored by save's bf16_exact: back to float32, exactly
            a, b = info["data_offsets"]
            bits = np.frombuffer(data, dtype="<u2", count=(b - a) // 2, offset=base + a)
            out[name] = (bits.astype(np.uint32) << np.uint32(16)).view(np.float32).reshape(info["shape"])
            continue
        dt = by_name.get(info.get("dtype"))
        if dt is None:
            raise ValueError(f"{path}: {name} has dtype {info.get('dtype')!r}, not one of {sorted(by_name)}")
        a, b = info["data_offsets"]
        arr = np.frombuffer(data, dtype=dt.newbyteorder("<"), count=(b - a) // dt.itemsize, offset=base + a)
        out[name] = arr.astype(dt).reshape(info["shape"])
    return out, meta
