"""scripts/fixtures/make_sparse_hf_fp8.py at its reduced geometry (--small), read back with numpy.

Why this exists: the sparse FP8 checkpoint the real-size benchmark reads is written by hand
(safetensors headers built in Python, data placed with pwrite into sparse files), so nothing but a
reader checks that it is a valid checkpoint. This parses the headers and index independently of
the script, decodes the FP8 blocks with its own e4m3fn table, and asserts what the benchmark
relies on: every tensor at its declared shape and dtype, 128x128 block scales of the right shape,
seeded finite values in the filled layer, zero holes with unit scales elsewhere, a router whose
picks are always filled experts, and the same bytes from the same seed.
Needs numpy and torch (the script quantizes with torch); skipped without them.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

np = pytest.importorskip("numpy", reason="reading the checkpoint needs numpy")
pytest.importorskip("torch", reason="the script quantizes with torch (pip install torch)")

from support import ROOT  # noqa: E402

SCRIPT = ROOT / "scripts" / "fixtures" / "make_sparse_hf_fp8.py"
BLOCK = 128
# --small: H 512, N 4, Lq 256, L 512, P 128, R 64, V 128, dense FF 512, F_e 256, E 32, vocab 256
H, N, LQ, L, P, R, V, FF, FE, E, VOCAB = 512, 4, 256, 512, 128, 64, 128, 512, 256, 32, 256


def e4m3fn(codes: np.ndarray) -> np.ndarray:
    """float32 value of float8_e4m3fn codes (bias 7, 3 mantissa bits, S.1111.111 NaN)."""
    c = codes.astype(np.int32)
    exp, man = (c >> 3) & 0xF, c & 7
    val = np.where(exp == 0, man / 8.0 * 2.0**-6, (1.0 + man / 8.0) * 2.0 ** (exp - 7.0))
    val = np.where(c & 0x80, -val, val)
    return np.where((exp == 15) & (man == 7), np.nan, val).astype(np.float32)


def make(out, *args):
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(out), "--small", *args], capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("sparse-fp8")
    r = make(out, "--verify", "none")
    assert r.returncode == 0, r.stdout + r.stderr
    return out


def read(folder):
    """{name: (dtype, shape, bytes as uint8)} of every tensor of the folder, and the index."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        raw = np.fromfile(folder / shard, dtype=np.uint8)
        n = int.from_bytes(raw[:8].tobytes(), "little")
        header = json.loads(raw[8 : 8 + n].tobytes())
        header.pop("__metadata__", None)
        end = 0
        for name, info in header.items():
            a, b = info["data_offsets"]
            out[name] = (info["dtype"], tuple(info["shape"]), raw[8 + n + a : 8 + n + b], shard)
            end = max(end, b)
        assert 8 + n + end == raw.size, shard
    return out, index


def dequant(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    m, k = codes.shape
    full = np.repeat(np.repeat(scale, BLOCK, 0), BLOCK, 1)[:m, :k]
    return e4m3fn(codes) * full


def test_index_headers_dtypes_and_scale_shapes(ckpt):
    t, index = read(ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 4 and cfg["first_k_dense_replace"] == 3
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    assert cfg["rope_parameters"]["rope_type"] == "yarn" and cfg["rope_parameters"]["factor"] == 40
    assert cfg["rope_scaling"]["original_max_position_embeddings"] == 4096
    assert {n: s for n, (*_, s) in t.items()} == index["weight_map"]
    assert index["metadata"]["total_size"] == sum(b.size for _, _, b, _ in t.values())
    fp8 = [n for n, (d, *_) in t.items() if d == "F8_E4M3"]
    # per layer 5 attention matrices; 3 dense; 3 shared + 32 x 3 routed in layer 3
    assert len(fp8) == 5 * 4 + 3 * 3 + 3 + 3 * E
    for n in fp8:
        dt, (m, k), _, _ = t[n]
        sdt, sshape, _, _ = t[n + "_scale_inv"]
        assert sdt == "F32" and sshape == (-(-m // BLOCK), -(-k // BLOCK)), n
    want = {
        "model.embed_tokens.weight": ("BF16", (VOCAB, H)),
        "lm_head.weight": ("BF16", (VOCAB, H)),
        "model.norm.weight": ("BF16", (H,)),
        "model.layers.3.mlp.gate.weight": ("BF16", (E, H)),
        "model.layers.3.mlp.gate.e_score_correction_bias": ("F32", (E,)),
        "model.layers.3.self_attn.q_b_proj.weight": ("F8_E4M3", (N * (P + R), LQ)),
        "model.layers.3.self_attn.kv_a_proj_with_mqa.weight": ("F8_E4M3", (L + R, H)),
        "model.layers.3.self_attn.kv_b_proj.weight": ("F8_E4M3", (N * (P + V), L)),
        "model.layers.3.self_attn.o_proj.weight": ("F8_E4M3", (H, N * V)),
        "model.layers.0.mlp.down_proj.weight": ("F8_E4M3", (H, FF)),
        "model.layers.3.mlp.experts.31.down_proj.weight": ("F8_E4M3", (H, FE)),
        "model.layers.3.mlp.shared_experts.gate_proj.weight": ("F8_E4M3", (FE, H)),
    }
    for n, (dt, shape) in want.items():
        assert t[n][:2] == (dt, shape), n
    # kv_a_proj's 576 rows end in a 64-row block: 5 scale rows
    assert t["model.layers.3.self_attn.kv_a_proj_with_mqa.weight_scale_inv"][1] == (5, 4)


def test_filled_layer_values_and_holes(ckpt):
    t, _ = read(ckpt)
    bias = t["model.layers.3.mlp.gate.e_score_correction_bias"][2].view("<f4")
    filled = set(np.flatnonzero(bias > 1.0).tolist())
    assert len(filled) == 16 and all(len([e for e in filled if e // 4 == g]) == 2 for g in range(8))
    n_filled = n_holes = 0
    for n, (dt, shape, b, _) in t.items():
        if dt != "F8_E4M3":
            continue
        codes = b.reshape(shape)
        scale = t[n + "_scale_inv"][2].view("<f4").reshape(t[n + "_scale_inv"][1])
        expert = int(n.split(".")[5]) if ".experts." in n else None
        if n.startswith("model.layers.3.") and (expert is None or expert in filled):
            n_filled += 1
            dq = dequant(codes, scale)
            assert np.isfinite(dq).all() and np.all(scale > 0), n
            assert 0.02 < dq.std() < 0.04 and abs(dq.mean()) < 0.005, (n, dq.std(), dq.mean())
            # 128x128 block recipe: each block's largest |code| is 448
            for i in range(scale.shape[0]):
                for j in range(scale.shape[1]):
                    blk = e4m3fn(codes[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK])
                    assert np.abs(blk).max() == 448.0, (n, i, j)
        else:
            n_holes += 1
            assert not codes.any() and np.all(scale == 1.0), n
    assert n_filled == 5 + 3 + 3 * 16 and n_holes == 5 * 3 + 3 * 3 + 3 * 16
    for n in ("input_layernorm", "post_attention_layernorm", "self_attn.q_a_layernorm"):
        w = (t[f"model.layers.3.{n}.weight"][2].view("<u2").astype(np.uint32) << 16).view(np.float32)
        assert w.min() >= 0.89 and w.max() <= 1.11, n
        assert not t[f"model.layers.2.{n}.weight"][2].any(), n
    assert not t["model.embed_tokens.weight"][2].any() and not t["lm_head.weight"][2].any()


def test_router_picks_only_filled_experts(ckpt):
    """noaux_tc on the stored router and bias (sigmoid scores, the bias added for the choice, group
    score = sum of its top 2, top 4 of 8 groups, top 8 experts): every pick is a filled expert,
    and different hidden states pick different sets."""
    t, _ = read(ckpt)
    w = (t["model.layers.3.mlp.gate.weight"][2].view("<u2").astype(np.uint32) << 16).view(np.float32)
    w = w.reshape(E, H)
    bias = t["model.layers.3.mlp.gate.e_score_correction_bias"][2].view("<f4")
    filled = set(np.flatnonzero(bias > 1.0).tolist())
    x = np.random.default_rng(7).standard_normal((64, H)).astype(np.float32)
    choice = 1.0 / (1.0 + np.exp(-(x @ w.T))) + bias
    groups = np.sort(choice.reshape(64, 8, 4), axis=-1)[..., -2:].sum(-1)
    top_groups = np.argsort(-groups, axis=-1)[:, :4]
    picks = set()
    for row, gs in zip(choice, top_groups):
        masked = np.full(E, -np.inf)
        for g in gs:
            masked[g * 4 : g * 4 + 4] = row[g * 4 : g * 4 + 4]
        top = frozenset(np.argsort(-masked)[:8].tolist())
        assert top <= filled
        picks.add(top)
    assert len(picks) > 1


def test_same_seed_same_bytes_and_bad_experts_refused(ckpt, tmp_path):
    r = make(tmp_path / "again", "--verify", "none")
    assert r.returncode == 0, r.stderr
    for f in sorted(ckpt.iterdir()):
        assert f.read_bytes() == (tmp_path / "again" / f.name).read_bytes(), f.name
    r = make(tmp_path / "bad", "--experts", "8")
    assert r.returncode != 0 and "--experts must be a multiple of n_group 8 in 16..32" in r.stderr


def test_check_only_names_a_changed_byte(ckpt, tmp_path):
    """--check-only passes on the folder as written and fails, naming the tensor, once one code
    byte of a filled matrix or of a hole is changed."""
    import shutil

    r = make(ckpt, "--check-only")
    assert r.returncode == 0 and "all checks passed" in r.stdout, r.stdout + r.stderr
    t, _ = read(ckpt)
    bias = t["model.layers.3.mlp.gate.e_score_correction_bias"][2].view("<f4")
    filled, hole = int(np.argmax(bias)), int(np.argmin(bias))
    for name in (
        f"model.layers.3.mlp.experts.{filled}.up_proj.weight",
        f"model.layers.3.mlp.experts.{hole}.down_proj.weight",
        "model.layers.1.self_attn.o_proj.weight",
    ):
        copy = tmp_path / name.replace(".", "_")
        shutil.copytree(ckpt, copy)
        shard = copy / t[name][3]
        raw = bytearray(shard.read_bytes())
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8 : 8 + n])
        at = 8 + n + header[name]["data_offsets"][0] + 5
        raw[at] ^= 0x41
        shard.write_bytes(bytes(raw))
        r = make(copy, "--check-only")
        assert r.returncode == 1 and f"FAIL: {name}" in r.stdout, (name, r.stdout)
