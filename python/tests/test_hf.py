"""mla_diff_hooks.hf on a tiny real transformers DeepseekV3ForCausalLM (random weights, 2 layers).

Why this exists: the HF hook attaches forward hooks to transformers' own DeepSeek-V3 module tree
and wraps two of its module-level functions for one forward pass; this checks that it records
every site with the right shapes, changes nothing the model computes, and leaves nothing behind.
Needs torch and transformers 5.x (the [hf] extra); skipped without them.
"""

from __future__ import annotations

import pytest

np = pytest.importorskip("numpy", reason="the HF hook needs numpy")
torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'mla-diff[hf]')")
transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install 'mla-diff[hf]')"
)

from support import hooks_module  # noqa: E402

hf = hooks_module("hf")
N, H, LQ, L, P, R, V, T = 2, 32, 16, 16, 8, 4, 8, 5


@pytest.fixture(scope="module")
def model():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=40,
        hidden_size=H,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=N,
        num_key_value_heads=N,
        q_lora_rank=LQ,
        kv_lora_rank=L,
        qk_nope_head_dim=P,
        qk_rope_head_dim=R,
        v_head_dim=V,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        moe_intermediate_size=16,
        first_k_dense_replace=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rope_interleave=True,
        attention_bias=False,
        tie_word_embeddings=False,
        num_mtp_layers=0,
        bos_token_id=0,
        eos_token_id=1,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    m = DeepseekV3ForCausalLM(cfg).to(torch.float32).eval()
    with torch.no_grad():  # HF's init leaves some weights at 0 or 1
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return m


IDS = torch.tensor([3, 17, 29, 8, 11])


def test_capture_records_every_site_and_changes_nothing(model):
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as mdl

    with torch.no_grad():
        plain = model(IDS[None]).logits[0].double().numpy()
    eager, rope = mdl.eager_attention_forward, mdl.apply_rotary_pos_emb_interleave
    cap = hf.capture(model, IDS, exact_f64=False)
    t = cap.tensors
    shapes = {
        "hidden_in": (T, H),
        "attn_in": (T, H),
        "q_c": (T, LQ),
        "q_c_normed": (T, LQ),
        "q": (T, N, P + R),
        "kv_a": (T, L + R),
        "kv_c_normed": (T, L),
        "k_pe": (T, R),
        "q_pe_roped": (T, N, R),
        "k_pe_roped": (T, R),
        "k_nope": (T, N, P),
        "v": (T, N, V),
        "lse": (T, N),
        "attn_out": (T, N, V),
        "o_proj": (T, H),
        "hidden_out": (T, H),
    }
    for n in range(2):
        for s, shape in shapes.items():
            assert t[f"L{n}.{s}"].shape == shape, (n, s)
    assert np.array_equal(t["L1.hidden_in"], t["L0.hidden_out"])
    assert t["tokens"].tolist() == IDS.tolist() and t["positions"].tolist() == list(range(T))
    assert np.array_equal(t["logits"], plain), "hooks changed the forward pass"
    # left nothing behind: no hooks, the module functions restored
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert mdl.eager_attention_forward is eager and mdl.apply_rotary_pos_emb_interleave is rope


def test_lse_is_the_log_sum_exp_of_the_causal_logits(model):
    t = hf.capture(model, IDS, exact_f64=False).tensors
    q = t["L0.q"].astype(np.float64)  # [T, N, P+R] before rope
    qn, qpe = q[..., :P], t["L0.q_pe_roped"].astype(np.float64)  # interleaved order
    kn, kpe = t["L0.k_nope"].astype(np.float64), t["L0.k_pe_roped"].astype(np.float64)
    scale = model.model.layers[0].self_attn.scaling
    logits = (np.einsum("tnp,snp->nts", qn, kn) + np.einsum("tnr,sr->nts", qpe, kpe)) * scale
    logits[:, np.triu_indices(T, 1)[0], np.triu_indices(T, 1)[1]] = -np.inf
    m = logits.max(-1, keepdims=True)
    lse = (m[..., 0] + np.log(np.exp(logits - m).sum(-1))).T  # [T, N]
    assert np.max(np.abs(lse - t["L0.lse"])) < 1e-4


def test_dump_writes_the_sites_in_float32(model, tmp_path):
    tensors = hf.dump(model, IDS, dtype="f32", with_weights=True, brk=None)
    names = [k for k in tensors if k.startswith("L")]
    assert "L0.w.kv_b" in names and "logits" not in tensors
    assert all(tensors[k].dtype == np.float32 for k in names)
    assert tensors["tokens"].dtype == np.int64
    hf.dump_format.write_format1(tmp_path / "d.safetensors", tensors, {"engine": "test"})
    assert (tmp_path / "d.safetensors").stat().st_size > sum(a.nbytes for a in tensors.values())


def test_zero_attn_out_break_is_undone(model):
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as mdl

    eager = mdl.eager_attention_forward
    broken = hf.dump(model, IDS, dtype="f32", with_weights=False, brk="zero-attn-out")
    assert not broken["L0.attn_out"].any() and broken["L0.lse"].any()
    assert mdl.eager_attention_forward is eager
