"""mla_diff_hooks.llama_cpp's graph callback on hand-built ggml tensors (no llama.cpp needed).

Why this exists: the llama.cpp hook reads nodes through a ctypes mirror of `struct ggml_tensor`
inside llama.cpp's eval callback; CI has no llama-cpp-python. Here the callback (Recorder) is fed
tensors laid out like llama.cpp's own: the node names of deepseek2.cpp, byte strides of views, a
head-major {X, T, N} node, an unnamed o_proj matmul named after its weight, a non-F32 node. The
map logic is checked against the real map (src/model/maps/llama.cpp.json, shipped in the package).
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys

import pytest

np = pytest.importorskip("numpy", reason="the llama.cpp hook needs numpy (pip install numpy)")

from support import ROOT, hooks_module  # noqa: E402

lc = hooks_module("llama_cpp")


class Node:
    """A ggml_tensor over a numpy buffer (kept alive here), F32 unless `ggml_type` says otherwise."""

    def __init__(self, name: str, buf, ne, nb=None, src0: Node | None = None, ggml_type: int = 0):
        self.buf = buf
        self.t = lc.GgmlTensor()
        self.t.type = ggml_type
        ne = list(ne) + [1] * (4 - len(ne))
        if nb is None:  # contiguous: nb[0] = 4, nb[i] = nb[i-1]*ne[i-1]
            nb = [4]
            for i in range(1, 4):
                nb.append(nb[-1] * ne[i - 1])
        nb = list(nb) + [nb[-1] * ne[len(nb) - 1]] * (4 - len(nb))
        for i in range(4):
            self.t.ne[i], self.t.nb[i] = ne[i], nb[i]
        self.t.data = buf.ctypes.data if buf is not None else None
        self.t.name = name.encode()
        if src0 is not None:
            self.t.src[0] = ctypes.addressof(src0.t)

    @property
    def addr(self) -> int:
        return ctypes.addressof(self.t)


def feed(rec, node: Node) -> bool:
    """What ggml's scheduler does: ask, then (if wanted) hand over the computed node."""
    want = rec(node.addr, True, None)
    if want:
        assert rec(node.addr, False, None) is True
    return want


def test_struct_matches_ggml_0_3_36():
    assert ctypes.sizeof(lc.GgmlTensor) == 336
    assert lc.GgmlTensor.data.offset == 248 and lc.GgmlTensor.name.offset == 256


def test_recorder_keys_strides_and_head_major():
    rec = lc.Recorder(lambda key: True)
    T, N, L = 3, 2, 4
    # q-0 occurs several times: #0, #1, ... in evaluation order
    a = np.arange(T * 8, dtype=np.float32).reshape(T, 8)  # ggml ne {8, T}
    b = a + 100
    assert feed(rec, Node("q-0", a, [8, T])) and feed(rec, Node("q-0", b, [8, T]))
    # a view: k_pe = kv_cmpr_pe[:, L:] (ne {2, T}, row stride of the full [T, L+2] tensor)
    kv = np.arange(T * (L + 2), dtype=np.float32).reshape(T, L + 2)
    view = Node("k_pe-0", kv[:, L:], [2, T], nb=[4, 4 * (L + 2)])
    view.t.data = kv.ctypes.data + 4 * L
    view.buf = kv
    assert feed(rec, view)
    # head-major kqv-0: ggml ne {L, T, N} = numpy [N, T, L], stored token-major [T, N, L]
    hm = np.arange(N * T * L, dtype=np.float32).reshape(N, T, L)
    assert feed(rec, Node("kqv-0", hm, [L, T, N]))
    # an unnamed matmul whose src[0] is blk.0.attn_output.weight -> attn_output-0
    w = Node("blk.0.attn_output.weight", None, [8, 8], ggml_type=1)
    o = np.ones((T, 8), np.float32)
    assert feed(rec, Node("node_17", o, [8, T], src0=w))
    # a non-F32 node is never selected, and does not count as an occurrence of an F32 one
    assert not feed(rec, Node("q-0", np.zeros(4, np.float16), [4], ggml_type=1))
    assert rec.error is None
    assert list(rec.out) == ["q-0#0", "q-0#1", "k_pe-0#0", "kqv-0#0", "attn_output-0#0"]
    assert np.array_equal(rec.out["q-0#0"], a) and np.array_equal(rec.out["q-0#1"], b)
    assert rec.out["k_pe-0#0"].tolist() == kv[:, L:].tolist()
    assert rec.out["kqv-0#0"].shape == (T, N, L)
    assert np.array_equal(rec.out["kqv-0#0"], hm.transpose(1, 0, 2))
    assert rec.permuted == {"kqv"} and np.array_equal(rec.out["attn_output-0#0"], o)
    assert rec.counts["q-0"] == 3


def test_recorder_keeps_only_selected_keys_and_never_raises_into_c():
    rec = lc.Recorder(lambda key: key == "kv_cmpr-1#1")
    x = np.ones((2, 4), np.float32)
    assert not feed(rec, Node("kv_cmpr-1", x, [4, 2]))
    assert feed(rec, Node("kv_cmpr-1", x * 2, [4, 2]))
    assert list(rec.out) == ["kv_cmpr-1#1"] and rec.out["kv_cmpr-1#1"].tolist() == [[2.0] * 4] * 2
    bad = lc.Recorder(lambda key: 1 / 0)
    assert bad(Node("q-0", x, [4, 2]).addr, True, None) is False  # stops the graph, no unwind
    assert isinstance(bad.error, ZeroDivisionError)


def test_shipped_map_is_mla_diffs_map():
    shipped = json.loads(lc.DEFAULT_MAP.read_text())
    if (ROOT / "src" / "model" / "maps" / "llama.cpp.json").is_file():
        assert shipped == json.loads((ROOT / "src" / "model" / "maps" / "llama.cpp.json").read_text())
    assert shipped["name"] == "llama.cpp" and shipped["rope_order"] == "interleaved"


def test_map_keys_follow_the_models_facts():
    split = lc.map_keys(lc.DEFAULT_MAP, [0, 1], q_lora=True, fused_kv_b=False)
    fused = lc.map_keys(lc.DEFAULT_MAP, [0], q_lora=False, fused_kv_b=True)
    assert {"embd#0", "attn_norm-0#0", "attn_norm-1#0", "kqv_out-1#0"} <= split
    assert "q_nope_absorbed_perm-0#0" in split and "kqv-0#0" in split  # absorbed graph only
    assert not {"q_nope_absorbed_perm-0#0", "kqv-0#0", "q_pe-0#1"} & fused
    assert {"k_nope_view-0#0", "Vcur_cont-0#0"} <= fused and "k_nope_view-0#0" not in split
    assert "q-0#3" in split and "q-0#1" in fused and "q-0#3" not in fused  # q_lora / no_q_lora
    assert not any(k.endswith("-1#0") for k in fused)  # layer 1 not asked for
    with pytest.raises(ValueError, match="unknown map condition 'gpu'"):
        lc.condition_holds("gpu", True, False)


def test_map_keys_follow_the_dense_and_moe_layers():
    ffn = {"ffn_norm", "ffn_gate", "ffn_up", "ffn_swiglu"}  # the dense MLP, or the shared experts
    moe_only = {"ffn_moe_logits", "ffn_moe_out", "ffn_shexp"}
    # Every layer dense (no n_dense_lead): the dense MLP's ffn_out, nothing of the MoE FFN.
    dense = lc.map_keys(lc.DEFAULT_MAP, [0, 1], q_lora=True, fused_kv_b=False)
    assert {f"{n}-{i}#0" for n in ffn | {"ffn_out"} for i in (0, 1)} <= dense
    assert not {f"{n}-{i}#0" for n in moe_only for i in (0, 1)} & dense
    # Layer 0 dense, layers 1 and 2 MoE (moe-v3's layout): there ffn_out-N is the routed plus
    # shared experts' sum, which is no site, so it is not dumped.
    moe = lc.map_keys(lc.DEFAULT_MAP, [0, 1, 2], q_lora=True, fused_kv_b=False, n_dense_lead=1)
    assert "ffn_out-0#0" in moe and not {"ffn_out-1#0", "ffn_out-2#0"} & moe
    assert {f"{n}-{i}#0" for n in ffn for i in (0, 1, 2)} <= moe
    assert {f"{n}-{i}#0" for n in moe_only for i in (1, 2)} <= moe
    assert not {f"{n}-0#0" for n in moe_only} & moe
    # A layer condition never holds for a rule without a layer.
    assert not lc.condition_holds("dense_ffn", True, False) and not lc.condition_holds("moe_ffn", True, False)
    assert lc.condition_holds("moe_ffn", True, False, dense_ffn=False)


def test_cli_refuses_missing_inputs(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mla_diff_hooks.llama_cpp",
            str(tmp_path / "no.gguf"),
            str(tmp_path / "out.safetensors"),
        ],
        capture_output=True,
        text=True,
        env=_env(),
    )
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].endswith("no.gguf: no such file")
    assert not (tmp_path / "out.safetensors").exists()


def _env():
    """The environment for `python -m mla_diff_hooks...`: the installed package, else python/."""
    import os

    env = dict(os.environ)
    try:
        import mla_diff_hooks  # noqa: F401

        installed = "site-packages" in (mla_diff_hooks.__file__ or "")
    except ImportError:
        installed = False
    if not installed:
        env["PYTHONPATH"] = str(ROOT / "python") + (
            os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
        )
    return env
