"""Capture every MLA intermediate of a HF transformers DeepSeek-family forward pass, in float64.

Why this exists: mla-diff's HF goldens and `mla_diff_hooks.hf` need the model's per-layer
intermediates under mla-diff's site names; most are a submodule's input or output (forward
hooks), the rest live inside plain functions (the rotary application, the eager attention
function), wrapped for one forward pass. With `exact_f64` the spots where HF forces float32 are
patched for that pass. Reference (precision patches, MoE and DSA sites, rope order, the API):
docs/engines.md, "The capture".
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any

from . import dump_format
from ._deps import optional
from .dump_format import site

np = optional("numpy", "mla_diff_hooks.hf_hooks", "hf")
torch = optional("torch", "mla_diff_hooks.hf_hooks", "hf")

# Stages only MoE layers (DeepseekV3MoE) have.
MOE_STAGES = dump_format.MOE_STAGES
# Stages of a layer that runs its own DSA indexer; a GLM "shared" layer has only idx_topk.
IDX_STAGES = dump_format.INDEXER_STAGES


def _hf_stages() -> tuple[str, ...]:
    """The stages an HF run provides (HF runs the expanded path over the whole prompt: no
    ql_nope / attn_latent, no context partials; the MLP's ffn_* sites are not captured), in the
    order captures are stored: data-flow order, except that the indexer sites follow the
    expanded-attention sites (w.W_UV), the order of the
    committed golden/hf files (whose bytes a rerun of scripts/fixtures/make_fixtures.py
    reproduces)."""
    skip = IDX_STAGES + dump_format.ABSORBED_STAGES + dump_format.FFN_STAGES + dump_format.CONTEXT_STAGES
    rest = [s for s in dump_format.STAGES if s not in skip]
    cut = rest.index("w.W_UV") + 1
    return (*rest[:cut], *IDX_STAGES, *rest[cut:])


HF_STAGES = _hf_stages()


def _family_classes(mdl) -> dict[str, Any]:
    """The modeling module's own classes (transformers generates one copy per model family)."""
    out = {}
    for suffix in ("RMSNorm", "RotaryEmbedding", "TopkRouter", "MoE"):
        found = [
            v
            for k, v in vars(mdl).items()
            if isinstance(v, type) and k.endswith(suffix) and v.__module__ == mdl.__name__
        ]
        out[suffix] = found[0] if len(found) == 1 else None
    return out


def topk_rows(topk: np.ndarray) -> np.ndarray:
    """HF's indexer top-k [T, K] -> per row sorted ascending, with the entries past the query
    (key > i: masked keys that topk returns when row i has fewer than K causal keys) replaced by
    -1 and moved to the end."""
    T, K = topk.shape
    out = np.full((T, K), -1, dtype=np.int64)
    for i in range(T):
        row = np.asarray(topk[i], dtype=np.int64)
        if len(set(row.tolist())) != K:
            raise RuntimeError(f"indexer top-k row {i} repeats a key: {row.tolist()}")
        keep = np.sort(row[row <= i])
        if len(keep) != min(K, i + 1):
            raise RuntimeError(f"indexer top-k row {i} selects {len(keep)} causal keys, want {min(K, i + 1)}")
        out[i, : len(keep)] = keep
    return out


def hf_rope_to_interleaved(x: np.ndarray) -> np.ndarray:
    """[even... | odd...] (HF's rotated layout) -> interleaved pairs (DeepSeek's layout), last axis."""
    r = x.shape[-1]
    assert r % 2 == 0
    out = np.empty_like(x)
    out[..., 0::2] = x[..., : r // 2]
    out[..., 1::2] = x[..., r // 2 :]
    return out


@dataclasses.dataclass
class CaptureResult:
    tensors: dict[str, np.ndarray]  # site name -> f64 (or i64) array, ready to save
    extras: dict[str, Any]  # cos/sin, HF scaling, logit stats (not saved as sites)


# --------------------------------------------------------------------------------------------
# float64 patches
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _alias_float32_to_float64():
    """Make `torch.float` and `torch.float32` mean float64 for the duration of the block.

    Used only around HF's rope-init function, so that its own formula (which names torch.float
    explicitly) produces f64 inverse frequencies.
    """
    saved = (torch.float, torch.float32)
    torch.float = torch.float64
    torch.float32 = torch.float64
    try:
        yield
    finally:
        torch.float, torch.float32 = saved


def _rope_init_f64(rotary: torch.nn.Module) -> tuple[torch.Tensor, float]:
    """Re-run the rope-init function the rotary module used, in float64."""
    cfg = rotary.config
    if rotary.rope_type == "default":
        fn = rotary.compute_default_rope_parameters
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        fn = ROPE_INIT_FUNCTIONS[rotary.rope_type]
    with _alias_float32_to_float64():
        inv_freq, attention_scaling = fn(cfg, device=torch.device("cpu"))
    assert inv_freq.dtype == torch.float64, inv_freq.dtype
    return inv_freq, float(attention_scaling)


@contextlib.contextmanager
def _float64_patches(model: torch.nn.Module, mdl):
    """Patch HF's f32-forcing spots (RMSNorm, rotary table, eager softmax) while active."""
    saved: list[tuple[Any, str, Any]] = []
    cls = _family_classes(mdl)

    def patch(obj, name, value):
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    # 1. RMSNorm: same formula as HF, computed in max(input dtype, f32).
    def rms_forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        work = torch.promote_types(input_dtype, torch.float32)
        h = hidden_states.to(work)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * h.to(input_dtype)

    patch(cls["RMSNorm"], "forward", rms_forward)

    # 2. Rotary table in f64: HF's formula (cat(freqs, freqs), cos/sin times attention_scaling).
    rotary = model.model.rotary_emb
    inv64, att_scale = _rope_init_f64(rotary)
    hf_inv32 = rotary.original_inv_freq.to(torch.float64)
    inv_rel = float(((inv64 - hf_inv32).abs() / inv64.abs()).max())
    # HF's buffer holds the same numbers rounded to f32 (rel. error <= 2^-24, plus a few ulps of
    # the f32 pow it used).
    assert inv_rel < 1e-6, f"f64 inverse frequencies disagree with HF's f32 buffer ({inv_rel})"
    assert math.isclose(att_scale, float(rotary.attention_scaling), rel_tol=1e-12)

    def rotary_forward(self, x, position_ids):
        freqs = position_ids[..., None].to(torch.float64) * inv64.to(x.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * att_scale
        sin = emb.sin() * att_scale
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)

    patch(cls["RotaryEmbedding"], "forward", rotary_forward)

    # 3. Softmax: HF's eager function asks for dtype=float32; keep f64 inputs in f64.
    orig_softmax = torch.nn.functional.softmax

    def softmax(input, dim=None, _stacklevel=3, dtype=None):
        if dtype is not None and input.dtype == torch.float64:
            dtype = torch.float64
        return orig_softmax(input, dim=dim, _stacklevel=_stacklevel, dtype=dtype)

    patch(torch.nn.functional, "softmax", softmax)

    # 4. MoE router: HF's DeepseekV3TopkRouter.forward computes the logits in float32
    #    (hidden_states.type(torch.float32), weight.type(torch.float32)). Same formula, in
    #    max(input dtype, f32).
    def router_forward(self, hidden_states):
        work = torch.promote_types(hidden_states.dtype, torch.float32)
        hidden_states = hidden_states.view(-1, self.hidden_dim)
        router_logits = torch.nn.functional.linear(hidden_states.to(work), self.weight.to(work))
        scores = router_logits.sigmoid()
        scores_for_choice = scores + self.e_score_correction_bias.to(work)
        group_scores = (
            scores_for_choice.view(-1, self.num_group, self.num_experts // self.num_group)
            .topk(2, dim=-1)[0]
            .sum(dim=-1)
        )
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = (
            group_mask.unsqueeze(-1)
            .expand(-1, self.num_group, self.num_experts // self.num_group)
            .reshape(-1, self.num_experts)
        )
        scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), float("-inf"))
        topk_indices = torch.topk(scores_for_choice, k=self.top_k, dim=-1, sorted=False)[1]
        topk_weights = scores.gather(1, topk_indices)
        if self.norm_topk_prob:
            denominator = topk_weights.sum(dim=-1, keepdim=True) + 1e-20
            topk_weights /= denominator
        topk_weights = topk_weights * self.routed_scaling_factor
        return router_logits, topk_weights, topk_indices

    if cls["TopkRouter"] is not None:
        patch(cls["TopkRouter"], "forward", router_forward)
    try:
        yield {"inv_freq_f64": inv64.numpy().copy(), "inv_freq_rel_err_vs_hf_f32": inv_rel}
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


# --------------------------------------------------------------------------------------------
# capture
# --------------------------------------------------------------------------------------------


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float64).cpu().numpy().copy()


def capture(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    exact_f64: bool = True,
    raw_rope: bool = False,
    with_weights: bool = True,
) -> CaptureResult:
    """Run one forward pass of a DeepseekV3ForCausalLM on one sequence and capture all sites.

    input_ids: [T] or [1, T] int64 token ids; positions are 0..T-1. The model must use eager
    attention and `rope_interleave=True`. With `exact_f64` (default) the f32-forcing spots of
    HF's code are patched (docs/engines.md, "The capture"); the model itself should already be float64.
    `raw_rope=True` stores q_pe_roped/k_pe_roped in HF's [even | odd] order (not converted);
    `with_weights=False` skips the weight sites (w.*).
    """
    import sys

    mdl = sys.modules[type(model).__module__]
    family = _family_classes(mdl)
    moe_cls = family["MoE"] or ()
    cfg = model.config
    # main-attention rope: DeepSeek families pair adjacent elements (HF's *_interleave function);
    # MiniCPM3 rotates halves (NeoX, HF's apply_rotary_pos_emb), stored as it is
    neox_main = cfg.model_type == "minicpm3"
    rope_fn_name = "apply_rotary_pos_emb" if neox_main else "apply_rotary_pos_emb_interleave"
    if cfg.model_type == "deepseek_v3" and not getattr(cfg, "rope_interleave", False):
        raise ValueError("capture() expects rope_interleave=True (DeepSeek-style rope)")
    if cfg.model_type not in ("deepseek_v3", "deepseek_v32", "glm_moe_dsa", "minicpm3"):
        raise ValueError(f"capture() does not know model type {cfg.model_type!r}")
    if getattr(cfg, "_attn_implementation", "eager") != "eager":
        raise ValueError(f"capture() needs eager attention, model uses {cfg._attn_implementation!r}")
    impl = getattr(cfg, "_experts_implementation", None)
    has_moe = any(isinstance(layer.mlp, moe_cls) for layer in model.model.layers)
    if has_moe and impl not in (None, "eager"):
        raise ValueError(
            f"capture() needs eager experts (config._experts_implementation), model uses {impl!r}"
        )
    ids = input_ids.reshape(1, -1).to(torch.long)
    T = ids.shape[1]
    N, P, R, V, L = (
        cfg.num_attention_heads,
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.v_head_dim,
        cfg.kv_lora_rank,
    )
    Lq = cfg.q_lora_rank

    out: dict[str, np.ndarray] = {}
    extras: dict[str, Any] = {"logit_stats": {}, "hf_scaling": {}, "idx_scores_dtype": {}}
    current = {"layer": None, "in_indexer": False}
    handles = []

    def put(layer: int, stage: str, value: np.ndarray) -> None:
        key = site(layer, stage)
        if key in out:
            raise RuntimeError(f"{key} captured twice (is the model called recursively?)")
        out[key] = value

    layers = model.model.layers[: cfg.num_hidden_layers]
    for n, layer in enumerate(layers):
        attn = layer.self_attn

        # residual stream in/out of the decoder layer
        def layer_pre(mod, args, kwargs, n=n):
            hs = args[0] if args else kwargs["hidden_states"]
            current["layer"] = n
            put(n, "hidden_in", _np(hs[0]))

        def layer_post(mod, args, kwargs, output, n=n):
            hs = output[0] if isinstance(output, tuple) else output
            put(n, "hidden_out", _np(hs[0]))
            current["layer"] = None

        handles.append(layer.register_forward_pre_hook(layer_pre, with_kwargs=True))
        handles.append(layer.register_forward_hook(layer_post, with_kwargs=True))

        def out_hook(stage, fn=lambda a: a, n=n):
            def hook(mod, args, output):
                put(n, stage, fn(_np(output[0])))

            return hook

        handles.append(layer.input_layernorm.register_forward_hook(out_hook("attn_in")))
        if Lq is not None:
            handles.append(attn.q_a_proj.register_forward_hook(out_hook("q_c")))
            handles.append(attn.q_a_layernorm.register_forward_hook(out_hook("q_c_normed")))
            q_mod = attn.q_b_proj
        else:
            q_mod = attn.q_proj
        handles.append(q_mod.register_forward_hook(out_hook("q", lambda a: a.reshape(T, N, P + R))))

        def kv_a_hook(mod, args, output, n=n):
            kv_a = _np(output[0])
            put(n, "kv_a", kv_a)
            put(n, "k_pe", kv_a[:, L:].copy())  # the rope part, before RoPE

        handles.append(attn.kv_a_proj_with_mqa.register_forward_hook(kv_a_hook))
        # kv_a_layernorm sees kv_c only: output [1, T, L]
        handles.append(attn.kv_a_layernorm.register_forward_hook(out_hook("kv_c_normed")))

        def kv_b_hook(mod, args, output, n=n):
            kv = _np(output).reshape(T, N, P + V)  # output [1, 1, T, N*(P+V)], per-head [k | v]
            put(n, "k_nope", kv[:, :, :P].copy())
            put(n, "v", kv[:, :, P:].copy())

        handles.append(attn.kv_b_proj.register_forward_hook(kv_b_hook))

        def o_pre(mod, args, n=n):
            put(n, "attn_out", _np(args[0][0]).reshape(T, N, V))

        handles.append(attn.o_proj.register_forward_pre_hook(o_pre))
        handles.append(attn.o_proj.register_forward_hook(out_hook("o_proj")))

        # DSA lightning indexer (DeepSeek-V3.2, GLM-MoE-DSA)
        indexer = getattr(attn, "indexer", None)
        if indexer is not None:
            nI, dI = indexer.n_heads, indexer.head_dim

            def idx_pre(mod, args, n=n):
                current["in_indexer"] = True

            def idx_post(mod, args, output, n=n):
                current["in_indexer"] = False
                put(n, "idx_topk", topk_rows(output[0].detach().cpu().numpy()))

            handles.append(indexer.register_forward_pre_hook(idx_pre))
            handles.append(indexer.register_forward_hook(idx_post))
            handles.append(
                indexer.wq_b.register_forward_hook(
                    out_hook("idx_q", lambda a, nI=nI, dI=dI: a.reshape(T, nI, dI))
                )
            )
            handles.append(indexer.k_norm.register_forward_hook(out_hook("idx_k")))
            handles.append(indexer.weights_proj.register_forward_hook(out_hook("idx_weights")))
        elif hasattr(attn, "skip_topk") and attn.skip_topk:
            # GLM "shared" layer: the top-k it is handed (the previous full layer's)
            def shared_pre(mod, args, kwargs, n=n):
                prev = kwargs.get("prev_topk_indices")
                if prev is None:
                    raise RuntimeError(f"shared DSA layer {n} got no prev_topk_indices")
                put(n, "idx_topk", topk_rows(prev[0].detach().cpu().numpy()))

            handles.append(attn.register_forward_pre_hook(shared_pre, with_kwargs=True))

        # MoE FFN (DeepseekV3MoE): router outputs, routed experts' sum, shared experts
        if isinstance(layer.mlp, moe_cls):
            moe = layer.mlp

            def gate_hook(mod, args, output, n=n):
                router_logits, _weights, topk_indices = output  # [T, E], [T, K], [T, K]
                put(n, "moe_router_logits", _np(router_logits))
                put(n, "moe_topk", topk_indices.detach().cpu().numpy().astype(np.int64))

            def experts_hook(mod, args, output, n=n):
                put(n, "moe_out", _np(output))  # [T, H] (tokens flattened)

            handles.append(moe.gate.register_forward_hook(gate_hook))
            handles.append(moe.experts.register_forward_hook(experts_hook))
            handles.append(moe.shared_experts.register_forward_hook(out_hook("shared_out")))

        # SwiGLU MLP (the dense FFN, or an MoE layer's shared experts): down_proj(act(gate) * up)
        norm = getattr(layer, "post_attention_layernorm", None)
        if norm is not None:
            handles.append(norm.register_forward_hook(out_hook("ffn_in")))
        ffn = swiglu_mlp(layer)
        if ffn is not None:

            def act_hook(mod, args, n=n):
                put(n, "ffn_act", _np(args[0][0]))

            handles.append(ffn.gate_proj.register_forward_hook(out_hook("ffn_gate")))
            handles.append(ffn.up_proj.register_forward_hook(out_hook("ffn_up")))
            handles.append(ffn.down_proj.register_forward_pre_hook(act_hook))
            if ffn is layer.mlp:
                handles.append(ffn.down_proj.register_forward_hook(out_hook("ffn_out")))

        # weights, as HF holds them (the f32 values, upcast)
        if not with_weights:
            continue
        if Lq is not None:
            put(
                n,
                "w.fused_qkv_a",
                np.concatenate([_np(attn.q_a_proj.weight), _np(attn.kv_a_proj_with_mqa.weight)], axis=0),
            )
        kv_b = _np(attn.kv_b_proj.weight)  # [N*(P+V), L]
        put(n, "w.kv_b", kv_b)
        per_head = kv_b.reshape(N, P + V, L)
        put(n, "w.W_UK_T", per_head[:, :P, :].copy())  # [N, P, L]
        put(n, "w.W_UV", per_head[:, P:, :].transpose(0, 2, 1).copy())  # [N, L, V]

    # ---- wrapped functions ------------------------------------------------------------------
    orig_rope = getattr(mdl, rope_fn_name)
    orig_eager = mdl.eager_attention_forward

    reorder = (lambda a: a) if (raw_rope or neox_main) else hf_rope_to_interleaved

    def rope_wrapper(q, k, cos, sin, *args, **kwargs):
        q_embed, k_embed = orig_rope(q, k, cos, sin, *args, **kwargs)
        if current["in_indexer"]:  # GLM's indexer uses the same function: not a main-attention site
            return q_embed, k_embed
        n = current["layer"]
        # q_embed [1, N, T, R], k_embed [1, 1, T, R], both in HF's [even | odd] order
        put(n, "q_pe_roped", reorder(_np(q_embed[0]).transpose(1, 0, 2)))
        put(n, "k_pe_roped", reorder(_np(k_embed[0, 0])))
        if "cos" not in extras:
            extras["cos"] = _np(cos[0])  # [T, R] = cat(per-pair cos, per-pair cos)
            extras["sin"] = _np(sin[0])
        return q_embed, k_embed

    def eager_wrapper(module, query, key, value, attention_mask, scaling, *args, **kwargs):
        n = module.layer_idx
        # HF's own q, k, scaling and mask -> scaled, masked logits -> natural-log LSE per query/head
        with torch.no_grad():
            logits = torch.matmul(query, key.transpose(2, 3)) * scaling  # [1, N, T, S]
            if attention_mask is None:
                allowed = torch.ones(logits.shape[-2:], dtype=torch.bool).tril()
                logits_m = logits.masked_fill(~allowed, float("-inf"))
            elif attention_mask.dtype == torch.bool:
                allowed = attention_mask[0, 0]
                logits_m = logits.masked_fill(~allowed, float("-inf"))
            else:
                allowed = attention_mask[0, 0] == 0
                logits_m = logits + attention_mask
            # In at least f32, as HF's eager softmax itself runs (softmax(..., dtype=float32)):
            # a bf16 model's LSE is not rounded to bf16. f32/f64 runs are unchanged.
            work = torch.promote_types(logits_m.dtype, torch.float32)
            lse = torch.logsumexp(logits_m.to(work), dim=-1)  # [1, N, T]
            put(n, "lse", _np(lse[0]).T.copy())  # [T, N]
            vals = _np(logits[0])[:, _np(allowed.to(torch.float64)) > 0]  # [N, #allowed]
            extras["logit_stats"][n] = {
                "std": float(vals.std()),
                "mean": float(vals.mean()),
                "absmax": float(np.abs(vals).max()),
                "count": int(vals.size),
            }
            extras["hf_scaling"][n] = float(scaling)
        return orig_eager(module, query, key, value, attention_mask, scaling, *args, **kwargs)

    class TopkRecorder(torch.overrides.TorchFunctionMode):
        """Records the tensor on which the indexer calls `.topk` (HF's own index scores)."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if current["in_indexer"] and func in (torch.Tensor.topk, torch.topk):
                n = current["layer"]
                scores = args[0]  # [1, T, T]
                extras["idx_scores_dtype"][n] = str(scores.dtype)
                sc = _np(scores[0])
                causal = np.tril(np.ones((T, T), dtype=bool))
                if not np.all(sc[~causal] < -1e30):
                    raise RuntimeError(f"L{n}: indexer scores past the query are not masked")
                put(n, "idx_scores", np.where(causal, sc, 0.0))
            return func(*args, **kwargs)

    setattr(mdl, rope_fn_name, rope_wrapper)
    mdl.eager_attention_forward = eager_wrapper
    try:
        ctx = _float64_patches(model, mdl) if exact_f64 else contextlib.nullcontext({})
        with ctx as patch_info, torch.no_grad(), TopkRecorder():
            extras.update(patch_info or {})
            res = model(input_ids=ids, position_ids=torch.arange(T).reshape(1, T), use_cache=False)
    finally:
        setattr(mdl, rope_fn_name, orig_rope)
        mdl.eager_attention_forward = orig_eager
        for h in handles:
            h.remove()

    out["logits"] = _np(res.logits[0])
    out["tokens"] = ids[0].cpu().numpy().astype(np.int64)
    out["positions"] = np.arange(T, dtype=np.int64)

    # every expected site must be there, once
    for n in range(len(layers)):
        is_moe = isinstance(layers[n].mlp, moe_cls)
        own_idx = getattr(layers[n].self_attn, "indexer", None) is not None
        shared_idx = bool(getattr(layers[n].self_attn, "skip_topk", False))
        ffn = swiglu_mlp(layers[n])
        for stage in HF_STAGES:
            if stage in MOE_STAGES and not is_moe:
                continue
            if stage == "ffn_in" and getattr(layers[n], "post_attention_layernorm", None) is None:
                continue
            if stage in ("ffn_gate", "ffn_up", "ffn_act") and ffn is None:
                continue
            if stage == "ffn_out" and (ffn is None or ffn is not layers[n].mlp):
                continue
            if stage in IDX_STAGES and not own_idx and not (shared_idx and stage == "idx_topk"):
                continue
            if Lq is None and stage in ("w.fused_qkv_a", "q_c", "q_c_normed"):
                continue
            if not with_weights and stage.startswith("w."):
                continue
            if site(n, stage) not in out:
                raise RuntimeError(f"site {site(n, stage)} was not captured")
    return CaptureResult(tensors=out, extras=extras)


def swiglu_mlp(layer) -> Any:
    """The decoder layer's SwiGLU MLP (`gate_proj`, `up_proj`, `down_proj`): `layer.mlp` in a
    dense layer, `layer.mlp.shared_experts` in an MoE layer, else None."""
    mlp = getattr(layer, "mlp", None)
    for cand in (mlp, getattr(mlp, "shared_experts", None)):
        if cand is not None and all(hasattr(cand, x) for x in ("gate_proj", "up_proj", "down_proj")):
            return cand
    return None


def ordered_names(tensors: dict[str, np.ndarray]) -> list[str]:
    """Site names in (layer, HF_STAGES) order, then tokens/positions/logits."""
    return sorted(tensors, key=dump_format.site_order(HF_STAGES))
