"""The shared format writer (mla_diff_hooks.st_io): byte-exact, readable by any reader, judged by
`mla-diff compare`.

Why this exists: every hook writes its dump through st_io.save, and the committed engine dumps in
golden/dumps/ were written by it; a writer that drifted (header order, padding, dtype names, data
layout) would break their hashes or what `mla-diff compare` reads. Needs numpy; the compare
tests need an mla-diff binary (support.find_mla_diff) and skip without one.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest

np = pytest.importorskip("numpy", reason="the format writer needs numpy (pip install numpy)")

from support import GOLDEN, find_mla_diff, hooks_module  # noqa: E402

st_io = hooks_module("st_io")

DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "I64": np.int64,
    "I32": np.int32,
    "U8": np.uint8,
}


def read(path: Path) -> tuple[dict, dict, dict]:
    """Independent reader (stdlib + numpy, not st_io nor the safetensors package):
    (tensors in file order, metadata, raw header)."""
    raw = Path(path).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    meta = header.get("__metadata__", {})
    base = 8 + n
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        if info["dtype"] == "BF16":  # the upper half of a float32
            bits = np.frombuffer(raw[base + a : base + b], dtype="<u2").astype(np.uint32) << 16
            tensors[name] = bits.view(np.float32).reshape(info["shape"])
            continue
        arr = np.frombuffer(raw[base + a : base + b], dtype=np.dtype(DTYPES[info["dtype"]]).newbyteorder("<"))
        tensors[name] = arr.reshape(info["shape"])
    return tensors, meta, header


# committed dumps written by st_io.save (mla_diff_hooks.hf, .llama_cpp, .vllm_cpu format 2)
COMMITTED = [
    "tiny-v3-f32.hf.safetensors",
    "tiny-v3-f32.llama-cpp.safetensors",
    "legacy-kvb-f32.vllm.safetensors",
]


@pytest.mark.parametrize("name", COMMITTED)
def test_rewrite_reproduces_committed_dump(tmp_path, name):
    src = GOLDEN / "dumps" / name
    tensors, meta, _ = read(src)
    out = tmp_path / name
    st_io.save(tensors, out, metadata=meta)
    want = hashlib.sha256(src.read_bytes()).hexdigest()
    got = hashlib.sha256(out.read_bytes()).hexdigest()
    assert got == want, f"{name}: st_io rewrite is not byte-identical ({got[:12]} != {want[:12]})"


def test_header_layout(tmp_path):
    t = {
        "b": np.arange(6, dtype=np.float32).reshape(2, 3),
        "a": np.array([1, -2], np.int64),
        "h": np.array([0.5], np.float16),
        "u": np.array([7], np.uint8),
    }
    out = tmp_path / "x.safetensors"
    st_io.save(t, out, metadata={"z": "1", "format": "f", "n": 3})
    raw = out.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert n % 8 == 0 and (8 + n) % 8 == 0  # data section 8-aligned
    tensors, meta, header = read(out)
    assert list(header) == ["__metadata__", "b", "a", "h", "u"]  # metadata first, order kept
    assert list(meta) == ["format", "n", "z"] and meta["n"] == "3"  # sorted keys, str values
    assert [header[k]["dtype"] for k in "bahu"] == ["F32", "I64", "F16", "U8"]
    assert header["b"]["data_offsets"] == [0, 24] and header["a"]["data_offsets"] == [24, 40]
    assert len(raw) == 8 + n + 24 + 16 + 2 + 1
    for k, v in t.items():
        assert tensors[k].shape == v.shape and np.array_equal(tensors[k], v)
    assert not list(tmp_path.glob("*.tmp"))  # written through a temp file


def test_non_contiguous_view(tmp_path):
    a = np.arange(12, dtype=np.float64).reshape(3, 4)[:, ::2]  # a strided view
    st_io.save({"a": a}, tmp_path / "v.safetensors")
    tensors, _, header = read(tmp_path / "v.safetensors")
    assert "__metadata__" not in header and header["a"]["dtype"] == "F64"
    assert tensors["a"].tolist() == [[0.0, 2.0], [4.0, 6.0], [8.0, 10.0]]


def test_load_reads_back_what_save_wrote(tmp_path):
    """st_io.load (numpy alone) returns every tensor, in file order, and the metadata."""
    rng = np.random.default_rng(3)
    tensors = {
        "b.f32": rng.standard_normal((2, 3)).astype(np.float32),
        "a.i64": np.arange(5, dtype=np.int64),
        "c.f16": rng.standard_normal(4).astype(np.float16),
        "d.u8": np.arange(7, dtype=np.uint8).reshape(7, 1),
    }
    path = tmp_path / "x.safetensors"
    st_io.save(tensors, path, metadata={"k": "v", "format": "f"})
    got, meta = st_io.load(path)
    assert list(got) == list(tensors) and meta == {"format": "f", "k": "v"}
    for k, a in tensors.items():
        assert got[k].dtype == a.dtype and np.array_equal(got[k], a), k
    got["b.f32"][0, 0] = 1.0  # a writable copy
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(ValueError, match="bad.safetensors: unreadable safetensors header"):
        st_io.load(tmp_path / "bad.safetensors")


def test_unsupported_dtype_names_the_tensor(tmp_path):
    with pytest.raises(TypeError, match=r"^L0\.q: unsupported dtype complex64$"):
        st_io.save({"L0.q": np.zeros(2, np.complex64)}, tmp_path / "bad.safetensors")
    assert not (tmp_path / "bad.safetensors").exists()
    with pytest.raises(TypeError, match=r"^b: unsupported dtype >f4$"):  # big-endian: refused
        st_io.save({"b": np.array([1.5], dtype=">f4")}, tmp_path / "be.safetensors")


def _compare(exe: Path, model: Path, dump: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(exe), "compare", "--model", str(model), "--dump", str(dump), "--quiet"],
        capture_output=True,
        text=True,
    )


@pytest.fixture(scope="module")
def mla_diff() -> Path:
    exe = find_mla_diff()
    if exe is None:
        pytest.skip(
            "no mla-diff binary with `compare` (pip install the wheel, or cargo build --release, "
            "or set MLA_DIFF)"
        )
    return exe


def test_written_dump_passes_compare(tmp_path, mla_diff):
    """A dump re-written by st_io (HF transformers, f32, tiny-v3) passes `mla-diff compare`."""
    tensors, meta, _ = read(GOLDEN / "dumps" / "tiny-v3-f32.hf.safetensors")
    out = tmp_path / "hf.safetensors"
    st_io.save(tensors, out, metadata=meta)
    r = _compare(mla_diff, GOLDEN / "models" / "tiny-v3-f32.gguf", out)
    assert r.returncode == 0, r.stdout + r.stderr
    n_sites = sum(1 for k in tensors if k.startswith("L"))
    assert f"dump: all {n_sites} sites within tolerance" in r.stdout


def test_written_broken_dump_fails_compare_at_the_site(tmp_path, mla_diff):
    """The same dump with one site's values changed is judged: exit 1, that site named first."""
    tensors, meta, _ = read(GOLDEN / "dumps" / "tiny-v3-f32.hf.safetensors")
    tensors = dict(tensors)
    tensors["L1.kv_c_normed"] = tensors["L1.kv_c_normed"] * np.float32(1.5)
    out = tmp_path / "hf-broken.safetensors"
    st_io.save(tensors, out, metadata=meta)
    r = _compare(mla_diff, GOLDEN / "models" / "tiny-v3-f32.gguf", out)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "first divergence at L1.kv_c_normed" in r.stdout


def test_metadata_is_what_compare_reads(tmp_path, mla_diff):
    """The metadata st_io writes is honoured: the HF dump relabelled rope_order=interleaved fails at
    the roped sites (HF's [even | odd] order is no longer converted)."""
    tensors, meta, _ = read(GOLDEN / "dumps" / "tiny-v3-f32.hf.safetensors")
    out = tmp_path / "hf-relabelled.safetensors"
    st_io.save(tensors, out, metadata={**meta, "rope_order": "interleaved"})
    r = _compare(mla_diff, GOLDEN / "models" / "tiny-v3-f32.gguf", out)
    assert r.returncode == 1 and "pe_roped" in r.stdout, r.stdout + r.stderr


def test_bf16_exact_tensors_are_stored_as_bf16_and_read_back_exactly(tmp_path):
    rng = np.random.default_rng(5)
    exact = (rng.standard_normal((3, 5)).astype(np.float32).view(np.uint32) & np.uint32(0xFFFF0000)).view(
        np.float32
    )
    inexact = exact.copy()
    inexact[1, 2] = np.nextafter(inexact[1, 2], np.float32(np.inf))  # one value bf16 cannot hold
    tensors = {"s0.L0.a": exact, "s0.L0.b": inexact, "weights.L0.w": exact, "s0.tokens": np.arange(4)}
    out = tmp_path / "d.safetensors"
    st_io.save(tensors, out, bf16_exact=lambda name: name.startswith("s0.L"))
    raw = out.read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    assert [header[k]["dtype"] for k in tensors] == ["BF16", "F32", "F32", "I64"]
    assert header["s0.L0.a"]["data_offsets"][1] - header["s0.L0.a"]["data_offsets"][0] == 15 * 2
    back, _ = st_io.load(out)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and np.array_equal(back[k], v), k
    # the upper 16 bits of each float32, little-endian: bf16's own encoding
    a, _ = header["s0.L0.a"]["data_offsets"]
    base = 8 + int.from_bytes(raw[:8], "little")
    bits = np.frombuffer(raw[base + a : base + a + 30], dtype="<u2")
    assert np.array_equal(bits, (exact.view(np.uint32) >> 16).astype(np.uint16).ravel())
