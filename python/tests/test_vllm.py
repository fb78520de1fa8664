"""mla_diff_hooks.vllm: its torch-free helpers, and its hooks attached to a plain-torch mock of
vLLM 0.26.0's DeepSeek MLA module tree (vllm_mock.py: vLLM's module names and call signatures).

Why this exists: the vLLM hook runs inside vLLM's process, which CI does not install. The
torch-free tests (numpy, safetensors) always run; the mock tests need torch and skip without it.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

np = pytest.importorskip("numpy", reason="the vLLM hook needs numpy (pip install numpy)")

from support import ROOT, hooks_module  # noqa: E402

dump_vllm = hooks_module("vllm")

HAS_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(
    not HAS_TORCH,
    reason="torch is not installed (the mock vLLM tree "
    "is built from torch modules); pip install torch to run it",
)


def test_rank_path():
    assert dump_vllm.rank_path("out/d.safetensors", 0, 1).as_posix() == "out/d.safetensors"
    assert dump_vllm.rank_path("out/d.safetensors", 1, 2).as_posix() == "out/d.rank1.safetensors"
    assert dump_vllm.rank_path("d.st", 3, 4, 1, 2).as_posix() == "d.rank3.pp1.st"


def test_infer_seq_lens():
    assert dump_vllm.infer_seq_lens(np.array([0, 1, 2, 0, 1])) == [3, 2]
    assert dump_vllm.infer_seq_lens(np.array([5, 6, 0, 9])) == [2, 1, 1]
    assert dump_vllm.infer_seq_lens(np.array([], np.int64)) == []


def test_step_seq_lens_take_the_engine_split_over_the_positions():
    # two requests whose positions happen to follow each other: only query_start_loc tells them apart
    pos = np.array([4, 5])
    assert dump_vllm.step_seq_lens(np.array([0, 1, 2]), pos, 2) == [1, 1]
    assert dump_vllm.step_seq_lens(None, pos, 2) == [2]
    # a query_start_loc that does not cover the step's rows is not used
    assert dump_vllm.step_seq_lens(np.array([0, 5]), np.array([0, 1, 0]), 3) == [2, 1]
    assert dump_vllm.step_seq_lens(None, None, 7) == [7]


def test_patch_entries_keep_a_plant_s_parameters():
    assert dump_vllm.patch_entry(("cpu-platform", "why")) == {"name": "cpu-platform", "reason": "why"}
    plant = {"name": "plant:split-lost", "reason": "r", "params": {"split": "last"}}
    assert dump_vllm.patch_entry(plant) == plant
    assert dump_vllm.patch_entry(("x", "y", {"k": "1"})) == {"name": "x", "reason": "y", "params": {"k": "1"}}


def test_site_order():
    names = ["tokens", "L1.q", "L0.hidden_out", "L0.w.kv_b", "L0.q", "L0.hidden_in", "L0.lse"]
    assert sorted(names, key=dump_vllm._site_key) == [
        "L0.hidden_in",
        "L0.q",
        "L0.w.kv_b",
        "L0.hidden_out",
        "L0.lse",
        "L1.q",
        "tokens",
    ]


def _rank_dump(tmp_path, rank: int, tensors: dict, *, model="m.gguf", heads=None, notes=()):
    header = {
        "model": {"file": model, "bytes": 1, "index_sha256": "0" * 64, "layer_sha256": {}},
        "steps": [{"name": "prefill", "seqs": [{"new": 3, "context": 0}]}],
        "patches": [{"name": "p", "reason": "r"}],
        "heads": heads or [2 * rank, 2 * rank + 2],
        "tp": {"size": 2, "rank": rank},
    }
    return dump_vllm.dump_format.write_format2(
        tmp_path / f"d.rank{rank}.safetensors", tensors, header, notes=notes, extra={"harness": "h"}
    )


def test_join_rank_dumps(tmp_path):
    """TP=2 format-2 rank files: head-sharded sites joined on the head axis and the SwiGLU sites
    on their columns in rank order, per-rank sites and weights from their rank, replicated sites
    from rank 0 (a disagreement noted), the header's heads turned into tp.heads."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((3, 4, 6)).astype(np.float32)  # [T, N, P+R], N = 4
    gate = rng.standard_normal((3, 8)).astype(np.float32)  # [T, I], I = 8
    hid = rng.standard_normal((3, 5)).astype(np.float32)
    part = rng.standard_normal((2, 3, 5)).astype(np.float32)
    wgu = rng.standard_normal((2, 8, 5)).astype(np.float32)
    tok = np.array([5, 6, 7], np.int64)
    paths = []
    for r in (0, 1):
        paths.append(
            _rank_dump(
                tmp_path,
                r,
                {
                    "s0.L0.hidden_in": hid if r == 0 else hid + np.float32(1e-3),
                    "s0.L0.q": q[:, 2 * r : 2 * r + 2],
                    "s0.L0.ffn_gate": gate[:, 4 * r : 4 * r + 4],
                    f"s0.L0.ffn_down.rank{r}": part[r],
                    "s0.tokens": tok,
                    f"weights.L0.gate_up_proj.rank{r}": wgu[r],
                },
                notes=[f"note of rank {r}"],
            )
        )
    out = dump_vllm.join_rank_dumps(paths[::-1], tmp_path / "d.safetensors")
    t, meta = dump_vllm.st_io.load(out)
    assert list(t) == [
        "s0.L0.hidden_in",
        "s0.L0.q",
        "s0.L0.ffn_gate",
        "s0.L0.ffn_down.rank0",
        "s0.L0.ffn_down.rank1",
        "s0.tokens",
        "weights.L0.gate_up_proj.rank0",
        "weights.L0.gate_up_proj.rank1",
    ]
    assert np.array_equal(t["s0.L0.q"], q) and np.array_equal(t["s0.L0.ffn_gate"], gate)
    assert np.array_equal(t["s0.L0.hidden_in"], hid) and np.array_equal(t["s0.tokens"], tok)
    assert np.array_equal(t["s0.L0.ffn_down.rank1"], part[1])
    assert np.array_equal(t["weights.L0.gate_up_proj.rank1"], wgu[1])
    h = json.loads(meta["header"])
    assert h["tp"] == {"size": 2, "heads": [[0, 2], [2, 4]]} and "heads" not in h
    assert h["patches"] == [{"name": "p", "reason": "r"}] and h["model"]["file"] == "m.gguf"
    assert meta["format"] == dump_vllm.dump_format.FORMAT2 and meta["harness"] == "h"
    assert meta["joined_from"] == "d.rank1.safetensors,d.rank0.safetensors"
    notes = meta["notes"].split(" | ")
    assert notes[:2] == ["rank 1: note of rank 1", "rank 0: note of rank 0"]
    assert notes[2].startswith("s0.L0.hidden_in: rank 1 differs from rank 0 by up to 0.001")


def test_join_rank_dumps_refuses_what_is_not_one_run(tmp_path):
    a = _rank_dump(tmp_path, 0, {"s0.L0.q": np.zeros((3, 2, 6), np.float32)})
    with pytest.raises(ValueError, match=r"have TP ranks \[0\] .*need 0\.\.1"):
        dump_vllm.join_rank_dumps([a], tmp_path / "x.safetensors")
    b = _rank_dump(tmp_path, 1, {"s0.L0.q": np.ones((3, 2, 6), np.float32)}, model="other.gguf")
    with pytest.raises(ValueError, match=r"rank 1's header.model differs from rank 0's"):
        dump_vllm.join_rank_dumps([a, b], tmp_path / "x.safetensors")
    f1 = tmp_path / "f1.safetensors"
    dump_vllm.dump_format.write_format1(f1, {"L0.q": np.zeros((3, 4, 6), np.float32)}, {})
    with pytest.raises(ValueError, match="not a `mla-diff dump 2` dump"):
        dump_vllm.join_rank_dumps([f1, a], tmp_path / "x.safetensors")


def test_format1_is_one_rank_only():
    cap = object.__new__(dump_vllm.VllmCapture)
    cap.tp_size, cap.pp_size = 2, 1
    with pytest.raises(RuntimeError, match="every rank writes format 2"):
        cap._one_rank("write_dump")


def test_finish_without_arm_says_so():
    with pytest.raises(RuntimeError, match=r"^finish\(\) without arm\(\) in this process$"):
        dump_vllm.finish(dump_path="never.safetensors")


def test_command_line_help_runs_without_vllm():
    r = subprocess.run(
        [sys.executable, "-m", "mla_diff_hooks.vllm", "--help"], capture_output=True, text=True, env=_env()
    )
    assert r.returncode == 0 and "--decode-steps" in r.stdout and "tested with vLLM 0.26.0" in r.stdout


def _env():
    from test_llama_cpp import _env as env

    return env()


# ---- the mock vLLM tree (torch) ------------------------------------------------------------


@pytest.fixture(scope="module")
def mock():
    """vllm_mock, with a real vLLM (if installed) hidden: the mock's expectations are those of a
    Python without vLLM (with it, the hook dequantizes through vLLM's own helper instead)."""
    pytest.importorskip("torch", reason="torch is not installed")
    import vllm_mock

    vllm_mock.torch.set_num_threads(1)
    vllm_mock.torch.manual_seed(0)
    saved = {k: v for k, v in sys.modules.items() if k == "vllm" or k.startswith("vllm.")}
    for k in saved:
        del sys.modules[k]
    sys.modules["vllm"] = None  # `import vllm` raises ImportError
    try:
        yield vllm_mock
    finally:
        del sys.modules["vllm"]
        sys.modules.update(saved)


@pytest.fixture(scope="module")
def ck(mock):
    return mock.make_checkpoint()


@needs_torch
def test_attach_records_one_forward(mock, ck):
    """attach() on the mock tree: every site of both layers, hooks gone after remove()."""
    model = mock.build_model(ck)
    cap = dump_vllm.attach(model, engine=mock.ENGINE)
    assert cap.handles and mock.all_hooks(model) > 0
    mock.run(model)
    cap.remove()
    assert mock.all_hooks(model) == 0
    t, meta = cap.result()
    assert meta["seq_lens"] == "3,2" and meta["rope_order"] == "interleaved"
    assert t["L0.q"].shape == (5, mock.N, mock.P + mock.R) and t["L1.attn_out"].shape == (5, mock.N, mock.V)
    assert np.array_equal(t["L1.hidden_in"], t["L0.hidden_out"])
    assert t["tokens"].tolist() == mock.TOKENS and t["positions"].tolist() == mock.POSITIONS


@needs_torch
def test_mock_single_rank_and_tp2(mock, ck, tmp_path):
    pytest.importorskip("gguf", reason="format 2's model identity needs gguf-py")
    tp1 = mock.test_single_rank(tmp_path, ck)
    mock.test_tp2(tmp_path, ck, tp1)


@needs_torch
def test_mock_fp16(mock, ck, tmp_path):
    mock.test_fp16(tmp_path, ck)


@needs_torch
def test_mock_no_forward(mock, ck, tmp_path):
    mock.test_no_forward(tmp_path, ck)


@needs_torch
def test_mock_gguf_compare(mock, tmp_path):
    pytest.importorskip("gguf", reason="loading the mock from a GGUF needs gguf-py")
    if not (ROOT / "golden" / "models" / "tiny-v3-f32.gguf").is_file():
        pytest.skip("golden/models/tiny-v3-f32.gguf is not in this checkout")
    mock.test_gguf_compare(tmp_path)


@needs_torch
def test_mock_decode_steps(mock, ck, tmp_path):
    pytest.importorskip("gguf", reason="format 2's model identity needs gguf-py")
    mock.test_decode_steps(tmp_path, ck)
