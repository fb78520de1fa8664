"""mla_diff_hooks.fp8_cpu's arithmetic against an independent numpy computation, without vLLM.

Why this exists: the CPU harness runs vLLM's block-FP8 checkpoints through these torch stand-ins,
and a dump made with them is judged as what vLLM's GPU path computes. A scale one ulp off, a
rounding other than nearest-even, a group cut in the wrong place or a block scale applied to the
wrong block would each make the w8a8-block dumps stand for another arithmetic. The reference here
shares no code with the stand-ins: e4m3 rounding by nearest representable value from the 256
codes' table, scales and divisions in numpy float32.
"""

from __future__ import annotations

import numpy as np
import pytest

from support import GOLDEN, hooks_module

torch = pytest.importorskip("torch", reason="the stand-ins are torch code")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="the vectors are read with safetensors")

fp8_cpu = hooks_module("fp8_cpu")


# ---- the numpy reference ----------------------------------------------------------------------


def e4m3_table() -> np.ndarray:
    """The values of the 256 OCP e4m3fn codes (code 0x7f / 0xff, NaN, as nan): sign, 4 exponent
    bits with bias 7, 3 mantissa bits; exponent 0 is subnormal, m/8 · 2^-6."""
    out = np.empty(256, np.float64)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        e, m = (code >> 3) & 0xF, code & 7
        if e == 0xF and m == 7:
            out[code] = np.nan
        elif e == 0:
            out[code] = sign * m / 8 * 2.0**-6
        else:
            out[code] = sign * (1 + m / 8) * 2.0 ** (e - 7)
    return out


TABLE = e4m3_table()


def round_e4m3(x: np.ndarray) -> np.ndarray:
    """Each value rounded to the nearest finite e4m3 value, ties to the even code (its last
    mantissa bit 0); magnitudes above 448 are not expected (the quantizer clamps first)."""
    codes = np.arange(256)
    ok = ~np.isnan(TABLE) & (codes != 0x80)  # one zero (+0) is enough
    vals, cds = TABLE[ok], codes[ok]
    x64 = np.asarray(x, np.float64).reshape(-1)
    d = np.abs(x64[:, None] - vals[None, :])
    best = d.min(axis=1, keepdims=True)
    out = np.empty_like(x64)
    for i in range(x64.size):
        tied = np.flatnonzero(d[i] == best[i, 0])
        pick = tied[0] if len(tied) == 1 else next(t for t in tied if cds[t] % 2 == 0)
        out[i] = vals[pick]
    return np.where(out == 0, 0.0, out).reshape(np.shape(x))


def np_quant(x: np.ndarray, group: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's per_token_group_quant_fp8 on a GPU in numpy float32: s = max(amax, 1e-10) / 448,
    q = e4m3(clamp(x / s, -448, 448)). Returns (q as float64 values, s float32)."""
    xg = x.astype(np.float32).reshape(x.shape[0], -1, group)
    amax = np.abs(xg).max(axis=-1, keepdims=True)
    s = np.maximum(amax, np.float32(1e-10)) / np.float32(448)
    assert s.dtype == np.float32
    y = np.clip(xg / s, np.float32(-448), np.float32(448))
    assert y.dtype == np.float32
    return round_e4m3(y).reshape(x.shape), s[..., 0]


def edge_input() -> np.ndarray:
    """[5, 640] float32, seeded, five groups of 128 per row, with edge groups: an all-zero group
    (amax below the floor), values on e4m3 ties after scaling, tiny values that quantize to e4m3
    subnormals or zero, a single outlier, negative-only groups and a wide dynamic range."""
    rng = np.random.default_rng(20260412)
    x = rng.standard_normal((5, 640)).astype(np.float32)
    x[0, 0:128] = 0.0  # all zero: s = 1e-10 / 448, q = 0
    x[0, 128:256] = rng.standard_normal(128).astype(np.float32) * np.float32(1e-12)  # under the floor
    # ties: with amax 448 the scale is 1 exactly, so these land halfway between two e4m3 values
    ties = np.array([448, 1.0625, 1.1875, 17.0, 19.0, 0.0029296875, -2.125, -2.375, 108, 124], np.float32)
    x[1, 0:128] = 0.5
    x[1, 0 : len(ties)] = ties
    x[1, 256:384] = rng.standard_normal(128).astype(np.float32) * np.float32(1e-3)
    x[1, 256] = 300.0  # one outlier: the rest become e4m3 subnormals or zero
    x[2, 384:512] = -np.abs(x[2, 384:512])  # negative only
    x[3] *= np.float32(2.0) ** rng.integers(-20, 20, 640).astype(np.float32)  # wide range
    x[4, 512:640] = np.float32(1e-30) * np.sign(rng.standard_normal(128)).astype(np.float32)
    return x


# ---- tests ------------------------------------------------------------------------------------


def test_the_table_holds_the_e4m3fn_extremes():
    assert np.nanmax(TABLE) == 448 and np.nanmin(TABLE) == -448
    assert TABLE[1] == 2.0**-9 and TABLE[8] == 2.0**-6 and np.isnan(TABLE[0x7F])
    assert round_e4m3(np.array([1.0625, 1.1875, 17.0, 19.0])).tolist() == [1.0, 1.25, 16.0, 20.0]


def test_per_token_group_quant_is_bit_exact_on_edge_groups():
    x = edge_input()
    want_q, want_s = np_quant(x)
    q, s = fp8_cpu.quant_per_token_group(torch.from_numpy(x))
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert q.shape == (5, 640) and s.shape == (5, 5)
    assert np.array_equal(s.numpy().view(np.uint32), want_s.view(np.uint32))
    got = q.to(torch.float32).numpy().astype(np.float64)
    assert np.array_equal(got, want_q), np.argwhere(got != want_q)[:5]
    # the edge groups did what they are there for
    assert want_s[0, 0] == np.float32(1e-10) / np.float32(448) and not got[0, :128].any()
    assert got[1, :10].tolist() == [448, 1.0, 1.25, 16, 20, 0.00390625, -2.0, -2.5, 112, 128]
    assert want_s[1, 0] == 1.0
    sub = np.abs(got[1, 257:384])
    assert (sub < 2.0**-6).sum() > 0 and (sub == 0).sum() > 0 and got[1, 256] == 448


def test_the_scale_is_a_division_not_the_triton_fallbacks_reciprocal():
    """vLLM's Triton fallback multiplies amax by float32(1/448); the GPU kernel divides. On the
    seeded input the two differ in some scales, and the stand-in gives the division's."""
    x = edge_input()
    _, s = fp8_cpu.quant_per_token_group(torch.from_numpy(x))
    amax = np.maximum(np.abs(x.reshape(5, 5, 128)).max(-1), np.float32(1e-10))
    div, mul = amax / np.float32(448), amax * np.float32(1 / 448)
    assert (div != mul).any()
    assert np.array_equal(s.numpy(), div)


def test_quant_refuses_a_width_that_is_not_whole_groups():
    with pytest.raises(ValueError, match="the last dim 200 is not a multiple of the group 128"):
        fp8_cpu.quant_per_token_group(torch.zeros(2, 200))


def test_block_dequant_matches_the_checkpoints_reference_vectors_bit_for_bit():
    v = safetensors_torch.load_file(str(GOLDEN / "hf-v3-fp8" / "dequant_vectors.safetensors"))
    for name in ("q_a", "kv_a", "synthetic"):  # whole, edge-row, edge-column and corner blocks
        w = v[f"{name}.fp8"].view(torch.float8_e4m3fn)
        got = fp8_cpu.dequant_blocks(w, v[f"{name}.scale_inv"], (128, 128))
        want = v[f"{name}.dequant_f32"]
        assert got.dtype == torch.float32 and torch.equal(got.view(torch.int32), want.view(torch.int32)), name
    with pytest.raises(ValueError, match=r"weight \[160, 200\] in 128x128 blocks has a \[2, 2\] grid"):
        fp8_cpu.dequant_blocks(v["synthetic.fp8"].view(torch.float8_e4m3fn), torch.ones(1, 2), (128, 128))


def seeded_weight(n: int, k: int, seed: int):
    """A block-FP8 weight [n, k] (e4m3 codes of seeded values) and a seeded scale grid."""
    rng = np.random.default_rng(seed)
    w = torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32) * 40).to(torch.float8_e4m3fn)
    s = torch.from_numpy((rng.random((-(-n // 128), -(-k // 128))) * 1e-2 + 1e-3).astype(np.float32))
    return w, s


def np_dequant(w, s) -> np.ndarray:
    wf = w.to(torch.float32).numpy()
    full = np.repeat(np.repeat(s.numpy(), 128, 0), 128, 1)[: wf.shape[0], : wf.shape[1]]
    return (wf * full).astype(np.float32)


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_w8a8_block_linear_is_the_gemm_of_the_dequantized_operands():
    x = edge_input()[:, :256] * np.float32(3)
    w, s = seeded_weight(320, 256, 7)  # a 64-row edge block
    got = fp8_cpu.block_fp8_linear(torch.from_numpy(x), w, s, (128, 128), "w8a8-block")
    q, xs = np_quant(x)
    a = q * np.repeat(xs.astype(np.float64), 128, axis=1)
    want = a @ np_dequant(w, s).astype(np.float64).T
    assert got.dtype == torch.float32 and got.shape == (5, 320)
    assert rel(got.numpy(), want) < 1e-6
    # weight-only: the activations unquantized, the same weights
    wo = fp8_cpu.block_fp8_linear(torch.from_numpy(x), w, s, (128, 128), "weight-only")
    exact = x.astype(np.float64) @ np_dequant(w, s).astype(np.float64).T
    assert rel(wo.numpy(), exact) < 1e-6
    assert rel(got.numpy(), exact) > 1e-3  # quantizing the activations shows
    with pytest.raises(ValueError, match="unknown fp8 compute 'w4a4'"):
        fp8_cpu.block_fp8_linear(torch.from_numpy(x), w, s, (128, 128), "w4a4")


def test_block_moe_runs_each_tokens_experts_and_weighs_them():
    rng = np.random.default_rng(11)
    t, h, i, e = 5, 256, 128, 4
    x = torch.from_numpy(rng.standard_normal((t, h)).astype(np.float32))
    w13 = [seeded_weight(2 * i, h, 100 + k) for k in range(e)]
    w2 = [seeded_weight(h, i, 200 + k) for k in range(e)]
    ids = torch.tensor([[0, 2], [1, 3], [2, 0], [3, 1], [0, 1]], dtype=torch.int32)
    tw = torch.from_numpy(rng.random((t, 2)).astype(np.float32))
    stack = lambda ws: (torch.stack([a for a, _ in ws]), torch.stack([b for _, b in ws]))  # noqa: E731
    (a13, s13), (a2, s2) = stack(w13), stack(w2)
    for mode in fp8_cpu.MODES:
        got = fp8_cpu.block_fp8_moe(x, a13, s13, a2, s2, tw, ids, (128, 128), mode)
        want = np.zeros((t, h))
        for r in range(t):
            for j in range(2):
                k = int(ids[r, j])
                hid = fp8_cpu.block_fp8_linear(x[r : r + 1], *w13[k], (128, 128), mode)
                g, u = hid[0, :i].double(), hid[0, i:].double()
                act = (torch.nn.functional.silu(g) * u).float()[None]
                y = fp8_cpu.block_fp8_linear(act, *w2[k], (128, 128), mode)
                want[r] += float(tw[r, j]) * y[0].double().numpy()
        assert got.shape == (t, h) and rel(got.numpy(), want) < 1e-6, mode
    # experts another rank holds (expert_map -1) contribute nothing: as if their weights were 0
    emap = torch.tensor([0, 1, -1, -1], dtype=torch.int32)
    part = fp8_cpu.block_fp8_moe(x, a13, s13, a2, s2, tw, ids, (128, 128), "weight-only", expert_map=emap)
    local = tw * (emap[ids.long()] >= 0)
    want = fp8_cpu.block_fp8_moe(x, a13, s13, a2, s2, local, ids, (128, 128), "weight-only")
    full = fp8_cpu.block_fp8_moe(x, a13, s13, a2, s2, tw, ids, (128, 128), "weight-only")
    assert torch.equal(part, want) and not torch.equal(part, full)


def test_patch_entries_name_the_mode_and_what_each_stands_in_for():
    a = fp8_cpu.patch_entries("w8a8-block")
    assert [n for n, _ in a] == ["fp8-f32-activations", "fp8-block-linear", "fp8-block-moe"]
    assert "AMX" in a[1][1] and "per_token_group_quant_fp8" in a[1][1] and a[1][1].startswith("w8a8-block:")
    assert "Fp8MoeBackend.NONE" in a[2][1]
    b = fp8_cpu.patch_entries("weight-only")
    assert b[1][1].startswith("weight-only:") and "not quantized" in b[1][1]
    with pytest.raises(ValueError, match=r"unknown fp8 compute 'fp4' \(known: w8a8-block, weight-only\)"):
        fp8_cpu.patch_entries("fp4")
