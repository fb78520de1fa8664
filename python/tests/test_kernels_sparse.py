"""The kernel runner on a DSA layer's export (mla_diff_hooks.kernels): what it hands vLLM's sparse
MLA kernels, checked through torch stand-ins that implement each kernel's documented contract
(FlashMLA's `flash_mla_sparse_fwd`, FA3's paged `flash_attn_varlen_func` with `q_v`), and the
constraints it reports instead of running a kernel."""

import json
import subprocess
from types import SimpleNamespace

import pytest

from support import ROOT, find_mla_diff, hooks_module

torch = pytest.importorskip("torch", reason="the kernel runner needs torch (pip install 'mla-diff[kernels]')")
pytest.importorskip("safetensors")
kernels = hooks_module("kernels")


class FlashMLASparse:
    """`flash_mla_sparse_fwd(q [s_q, h_q, d_qk], kv [s_kv, 1, d_qk], indices [s_q, 1, topk],
    sm_scale, d_v, topk_length)` -> (out [s_q, h_q, d_v], max_logits, lse), natural-log LSE, the
    entries past `topk_length` and the −1 ones ignored; records what it was given."""

    def __init__(self):
        self.calls = []

    def flash_mla_sparse_fwd(self, q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
        call = dict(q=q.clone(), kv=kv, indices=indices.clone(), sm_scale=sm_scale, d_v=d_v)
        self.calls.append(dict(call, topk_length=topk_length))
        assert q.dtype == kv.dtype == torch.bfloat16 and indices.dtype == torch.int32
        assert q.shape[1] in (64, 128) and indices.shape[-1] % 64 == 0
        s_q, h_q, _ = q.shape
        out = torch.zeros(s_q, h_q, d_v, dtype=torch.bfloat16)
        lse = torch.empty(s_q, h_q)
        flat = kv[:, 0].float()
        for i in range(s_q):
            ids = indices[i, 0, : int(topk_length[i])]
            k = flat[ids[ids >= 0].long()]
            s = (q[i].float() @ k.T) * sm_scale
            lse[i] = torch.logsumexp(s, -1)
            out[i] = (torch.softmax(s, -1) @ k[:, :d_v]).to(torch.bfloat16)
        return out, lse.clone(), lse


class FA3Paged:
    """FA3's `flash_attn_varlen_func` in vLLM's sparse MLA call: one query per batch entry, pages
    of one token, logits `q·k + q_v·v`, the first `seqused_k[b]` pages of `block_table[b]`."""

    def __init__(self):
        self.calls = []

    def flash_attn_varlen_func(self, q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, **kw):
        self.calls.append(dict(q=q, k=k, v=v, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, **kw))
        assert kw["fa_version"] == 3 and kw["return_softmax_lse"] and max_seqlen_q == 1
        q_v, table, used = kw["q_v"], kw["block_table"], kw["seqused_k"]
        T, nh, L = q_v.shape
        out = torch.empty(T, nh, L, dtype=q.dtype)
        lse = torch.empty(nh, T)
        kk, vv = k[:, 0, 0].float(), v[:, 0, 0].float()
        for i in range(T):
            pages = table[i, : int(used[i])].long()
            s = (q[i].float() @ kk[pages].T + q_v[i].float() @ vv[pages].T) * kw["softmax_scale"]
            lse[:, i] = torch.logsumexp(s, -1)
            out[i] = (torch.softmax(s, -1) @ vv[pages]).to(q.dtype)
        return out, lse


def sparse_args(tmp_path, kernels_list, dtype="bf16"):
    return SimpleNamespace(
        inputs=str(tmp_path / "in"),
        out=str(tmp_path / "out"),
        force=True,
        kernels=kernels_list,
        dtype=dtype,
        vllm_root=str(tmp_path / "root"),
        splits=None,
        plant=None,
    )


@pytest.fixture
def export_576(tmp_path):
    """A synthetic DSA export at DeepSeek-V3.2's widths (L 512, R 64): 2 heads, top-k 40 of 70
    rows (rows past 40 keep a strict subset), pages of 16 shuffled."""
    kernels.synth(str(tmp_path / "in"), 70, 2, 16, 3, topk=40)
    (tmp_path / "root" / "vllm-0.26.0.dist-info").mkdir(parents=True)
    return tmp_path


def test_flashmla_sparse_gets_vllms_padded_query_indices_and_lengths(export_576, monkeypatch, capsys):
    """Heads 2 -> 64 (zeros), indices 40 -> 128 (−1), the cache as [slots, 1, 576], topk_length
    and the scale passed; the output sliced back to 2 heads is the export's expected attention to
    bf16 rounding, and the dump records the padding as patches."""
    stub = FlashMLASparse()
    monkeypatch.setattr(kernels, "load_mods", lambda ks, root, plant: {"flashmla-sparse": stub})
    kernels.cmd_run(sparse_args(export_576, "flashmla-sparse"))
    inp = kernels.Inputs(str(export_576 / "in"), "cpu")
    (c,) = stub.calls
    assert c["q"].shape == (70, 64, 576) and c["kv"].shape == (5 * 16, 1, 576)
    assert torch.equal(c["q"][:, :2], inp.q.to(torch.bfloat16))
    assert not c["q"][:, 2:].any(), "padded heads are zeros"
    assert c["indices"].shape == (70, 1, 128)
    assert torch.equal(c["indices"][:, 0, :40], inp.sp_idx)
    assert (c["indices"][:, 0, 40:] == -1).all()
    assert torch.equal(c["topk_length"], inp.sp_len) and c["sm_scale"] == inp.scale and c["d_v"] == 512
    assert inp.sp_len.tolist() == [min(i + 1, 40) for i in range(70)]
    out = capsys.readouterr().out
    rel = float(out.split("attn_latent rel_l2 ")[1].split(",")[0])
    assert rel < 1e-2, out
    assert "pad-heads:2->64, pad-topk:40->128" in out
    from safetensors import safe_open

    with safe_open(str(export_576 / "out" / "flashmla-sparse.safetensors"), "pt") as f:
        h = json.loads(f.metadata()["header"])
        lat = f.get_tensor(f"s0.L{inp.layer}.attn_latent")
    assert [p["name"] for p in h["patches"]] == ["pad-heads:2->64", "pad-topk:40->128"]
    assert h["engine"]["attention_backend"] == "FLASHMLA_SPARSE" and h["kernel_precision"] == "bf16"
    ref = inp.sp_lat.float()
    assert ((lat - ref).norm() / ref.norm()).item() < 1e-2


def test_fa3_sparse_reads_the_selection_as_pages_of_one_token(export_576, monkeypatch, capsys):
    """q_rope as the query, ql_nope as q_v, the cache's rope and latent parts as k and v pages of
    one token, the global indices as the block table, topk_length as seqused_k: the expected
    attention to bf16 rounding, and the LSE transposed to token-major."""
    stub = FA3Paged()
    monkeypatch.setattr(kernels, "load_mods", lambda ks, root, plant: {"fa3-sparse": stub})
    kernels.cmd_run(sparse_args(export_576, "fa3-sparse"))
    inp = kernels.Inputs(str(export_576 / "in"), "cpu")
    (c,) = stub.calls
    assert c["q"].shape == (70, 2, 64) and c["q_v"].shape == (70, 2, 512)
    assert c["k"].shape == (80, 1, 1, 64) and c["v"].shape == (80, 1, 1, 512)
    assert torch.equal(c["block_table"], inp.sp_idx) and torch.equal(c["seqused_k"], inp.sp_len)
    assert c["max_seqlen_k"] == 40 and c["causal"] and c["softmax_scale"] == inp.scale
    out = capsys.readouterr().out
    # bf16 inputs against the f64 attention of the f32 export: the rounding of q and the cache.
    rel = float(out.split("attn_latent rel_l2 ")[1].split(",")[0])
    lse_rel = float(out.split("lse rel_l2 ")[1].split(" ")[0])
    assert rel < 1e-2 and lse_rel < 2e-3, out
    assert "no padding" in out


def test_kernels_whose_constraints_the_export_does_not_meet_are_skipped(tmp_path, monkeypatch, capsys):
    """At L 256, R 16: flashmla-sparse is skipped naming d_qk 576; the sparse decode always (it
    needs the fp8 cache); a dense kernel on a DSA export; fa3-sparse runs (its limits are R <= 64,
    256 <= L <= 512). f32 is refused by both sparse kernels; L 64 by fa3-sparse."""
    kernels.synth(str(tmp_path / "in"), 20, 2, 4, 1, L=256, R=16, P=32, V=32, topk=8)
    stub = FA3Paged()
    loaded = []

    def load(ks, root, plant):
        loaded.append(list(ks))
        return {"fa3-sparse": stub}

    monkeypatch.setattr(kernels, "load_mods", load)
    kernels.cmd_run(
        sparse_args(tmp_path, "flashmla-sparse,flashmla-sparse-decode,flashmla,fa3-sparse"), check_only=True
    )
    out = capsys.readouterr().out
    assert loaded == [["fa3-sparse"]]
    assert "flashmla-sparse: skipped: flash_mla_sparse_fwd takes d_qk = 576" in out
    assert "the export has L = 256, R = 16" in out
    assert "flashmla-sparse-decode: skipped: FlashMLA's sparse decode reads only the fp8_ds_mla cache" in out
    assert "flashmla: skipped: a dense kernel on a DSA layer's export" in out
    assert "fa3-sparse: attn_latent rel_l2" in out and len(stub.calls) == 1
    inp = kernels.Inputs(str(tmp_path / "in"), "cpu")
    for k in ("flashmla-sparse", "fa3-sparse"):
        reason, _, _ = kernels.sparse_plan(k, inp, "f32", (9, 0))
        assert reason == "takes bf16 inputs only, not --dtype f32"
    reason, _, _ = kernels.sparse_plan("fa3-sparse", inp, "bf16", (10, 0))
    assert "Hopper only" in reason
    kernels.synth(str(tmp_path / "small"), 20, 2, 4, 1, L=64, R=16, P=32, V=32, topk=8)
    small = kernels.Inputs(str(tmp_path / "small"), "cpu")
    reason, _, _ = kernels.sparse_plan("fa3-sparse", small, "bf16", (9, 0))
    assert reason.startswith("FA3 with q_v takes") and "L = 64" in reason


def test_mla_diff_export_through_the_fa3_stand_in_passes_compare(tmp_path, monkeypatch):
    """`mla-diff run --export-inputs` on a glm-dsa layer, the runner's fa3-sparse through the
    stand-in, `mla-diff compare` on its dump: within the bf16 rows (exit 0)."""
    exe = find_mla_diff()
    if exe is None:
        pytest.skip("no mla-diff binary (build it or set MLA_DIFF)")
    model = ROOT / "golden" / "models" / "dsa-live-bf16.gguf"  # L 512: FA3's q_v needs L >= 256
    r = subprocess.run(
        [exe, "run", "--quiet", "--path", "mha", "--model", model, "--layer", "0", "--seqs", "2,19"]
        + ["--page-size", "4", "--export-inputs", tmp_path / "in"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    (tmp_path / "root" / "vllm-0.26.0.dist-info").mkdir(parents=True)
    monkeypatch.setattr(kernels, "load_mods", lambda ks, root, plant: {"fa3-sparse": FA3Paged()})
    kernels.cmd_run(sparse_args(tmp_path, "fa3-sparse"))
    dump = tmp_path / "out" / "fa3-sparse.safetensors"
    r = subprocess.run([exe, "compare", "--model", model, "--dump", dump], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
