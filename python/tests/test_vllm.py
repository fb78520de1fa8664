"""mla_diff_hooks.vllm: its torch-free helpers, and its hooks attached to a plain-torch mock of
vLLM 0.26.0's DeepSeek MLA module tree (vllm_mock.py: vLLM's module names and call signatures).

Why this exists: the vLLM hook runs inside vLLM's process, which CI does not install. The
torch-free tests (numpy, safetensors) always run; the mock tests need torch and skip without it.
"""

from __future__ import annotations

import importlib.util
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


def test_merge_rank_dumps(tmp_path):
    """TP=2 rank files: head-sharded sites concatenated in rank order, replicated ones from rank 0
    (a disagreement noted), tokens last."""
    pytest.importorskip("safetensors", reason="merging reads rank files with safetensors")
    st_io = dump_vllm.st_io
    rng = np.random.default_rng(0)
    q = rng.standard_normal((3, 4, 6)).astype(np.float32)  # [T, N, P+R], N = 4
    hid = rng.standard_normal((3, 8)).astype(np.float32)
    tok = np.array([5, 6, 7], np.int64)
    for r in (0, 1):
        h = hid if r == 0 else hid + np.float32(1e-3)
        st_io.save(
            {"tokens": tok, "L0.q": q[:, 2 * r : 2 * r + 2], "L0.hidden_in": h},
            tmp_path / f"d.rank{r}.safetensors",
            metadata={"format": dump_vllm.dump_format.FORMAT1, "tp_rank": str(r), "tp_size": "2"},
        )
    out = dump_vllm.merge_rank_dumps(
        [tmp_path / "d.rank1.safetensors", tmp_path / "d.rank0.safetensors"], tmp_path / "d.safetensors"
    )
    t, meta = dump_vllm._read(out)
    assert list(t) == ["L0.hidden_in", "L0.q", "tokens"]
    assert np.array_equal(t["L0.q"], q) and np.array_equal(t["L0.hidden_in"], hid)
    assert "L0.hidden_in: rank 1 differs from rank 0" in meta["notes"] and "tp_rank" not in meta
    assert meta["merged_from"] == "d.rank1.safetensors,d.rank0.safetensors"
    with pytest.raises(ValueError, match=r"need 0\.\.1"):
        dump_vllm.merge_rank_dumps([tmp_path / "d.rank1.safetensors"], tmp_path / "x.safetensors")


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
