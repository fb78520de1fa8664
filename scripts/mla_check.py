"""Independent numpy float64 checks of captured MLA goldens, written from docs/mla.md.

Why this exists: a golden is only useful if it is internally consistent. These checks recompute,
from the captured tensors alone, what the HF run should have produced, using the formulas of
docs/mla.md rather than HF's code:
  * RoPE: the interleaved (GPT-J) rotation of the un-rotated `k_pe` / `q[..., P:]` with HF's
    cos/sin must equal the stored (order-converted) `k_pe_roped` / `q_pe_roped`;
  * expanded attention (docs/mla.md step 5) with scale (P+R)^-0.5 * m^2 must reproduce `attn_out`
    and `lse`;
  * absorbed attention (step 6) through `w.W_UK_T` / `w.W_UV` and `kv_c_normed` must agree too;
  * kv_b split (step 5) must reproduce `k_nope` / `v` from `kv_c_normed` and `w.kv_b`.
All errors are max |difference|, returned as a dict so callers can print and record them.
"""

from __future__ import annotations

import math

import numpy as np


def softmax_scale(P: int, R: int, yarn: dict | None) -> float:
    """(P+R)^-0.5 * m^2, m = 0.1 * mscale_all_dim * ln(factor) + 1 with YaRN (factor > 1), else 1."""
    m = 1.0
    if yarn is not None and yarn["factor"] > 1 and yarn.get("mscale_all_dim"):
        m = 0.1 * yarn["mscale_all_dim"] * math.log(yarn["factor"]) + 1.0
    return (P + R) ** -0.5 * m * m


def _logsumexp(x: np.ndarray, axis: int) -> np.ndarray:
    mx = np.max(x, axis=axis, keepdims=True)
    return (mx + np.log(np.sum(np.exp(x - mx), axis=axis, keepdims=True))).squeeze(axis)


def check_layer(t: dict[str, np.ndarray], layer: int, dims: dict, scale: float,
                cos: np.ndarray, sin: np.ndarray, rope: str = "interleaved",
                allowed: np.ndarray | None = None) -> dict[str, float]:
    """Return max-abs errors of the recomputations for one layer.

    dims: N, P, R, V, L. cos/sin: HF's tables [T, R] (= cat(per-pair, per-pair)).
    rope: "interleaved" (DeepSeek pairs; stored sites in interleaved order) or "neox" (MiniCPM3:
    halves rotated, stored as HF gives them). allowed: [T, T] bool mask of the keys each query
    may attend (causal and, in DSA layers, selected by the indexer); default causal.
    """
    N, P, R, V, L = (dims[k] for k in ("N", "P", "R", "V", "L"))
    g = lambda s: t[f"L{layer}.{s}"]  # noqa: E731
    q, k_pe, kvc = g("q"), g("k_pe"), g("kv_c_normed")
    T = q.shape[0]
    ch, sh = cos[:, : R // 2], sin[:, : R // 2]

    res: dict[str, float] = {}
    # --- RoPE (interleaved pairs) -------------------------------------------------------------
    right, wrong = (_rope, _rope_neox) if rope == "interleaved" else (_rope_neox, _rope)
    k_rot = right(k_pe, ch, sh)
    q_rot = right(q[:, :, P:], ch[:, None, :], sh[:, None, :])
    res["rope_k_max_err"] = float(np.abs(k_rot - g("k_pe_roped")).max())
    res["rope_q_max_err"] = float(np.abs(q_rot - g("q_pe_roped")).max())
    # the other pairing must NOT match: proves the check can fail (key kept for the old name)
    res["rope_k_neox_max_diff"] = float(np.abs(wrong(k_pe, ch, sh) - g("k_pe_roped")).max())
    res["rope_k_other_order_max_diff"] = res["rope_k_neox_max_diff"]

    # --- kv_b expansion, per-head [k_nope | v] --------------------------------------------------
    kv = (kvc @ g("w.kv_b").T).reshape(T, N, P + V)
    res["kv_b_k_nope_max_err"] = float(np.abs(kv[:, :, :P] - g("k_nope")).max())
    res["kv_b_v_max_err"] = float(np.abs(kv[:, :, P:] - g("v")).max())

    # --- expanded attention (step 5) -------------------------------------------------------------
    q_nope, q_pe = q[:, :, :P], g("q_pe_roped")
    k_nope, v, k_pe_r = g("k_nope"), g("v"), g("k_pe_roped")
    Q = np.concatenate([q_nope, q_pe], axis=-1)                                   # [T, N, P+R]
    K = np.concatenate([k_nope, np.broadcast_to(k_pe_r[:, None, :], (T, N, R))], axis=-1)
    logits = np.einsum("tnd,snd->nts", Q, K) * scale                              # [N, T, S]
    causal = np.tril(np.ones((T, T), dtype=bool)) if allowed is None else allowed
    logits = np.where(causal[None], logits, -np.inf)
    lse = _logsumexp(logits, axis=-1)                                             # [N, T]
    probs = np.exp(logits - lse[..., None])
    out = np.einsum("nts,snv->tnv", probs, v)
    res["attn_out_max_err"] = float(np.abs(out - g("attn_out")).max())
    res["attn_out_max_abs"] = float(np.abs(g("attn_out")).max())
    res["lse_max_err"] = float(np.abs(lse.T - g("lse")).max())

    # --- absorbed attention (step 6) -------------------------------------------------------------
    ql_nope = np.einsum("tnp,npl->tnl", q_nope, g("w.W_UK_T"))                    # [T, N, L]
    logits_a = (np.einsum("tnl,sl->nts", ql_nope, kvc)
                + np.einsum("tnr,sr->nts", q_pe, k_pe_r)) * scale
    logits_a = np.where(causal[None], logits_a, -np.inf)
    lse_a = _logsumexp(logits_a, axis=-1)
    latent = np.einsum("nts,sl->tnl", np.exp(logits_a - lse_a[..., None]), kvc)   # [T, N, L]
    out_a = np.einsum("tnl,nlv->tnv", latent, g("w.W_UV"))
    res["absorbed_attn_out_max_err"] = float(np.abs(out_a - g("attn_out")).max())
    res["absorbed_lse_max_err"] = float(np.abs(lse_a.T - g("lse")).max())
    return res


def _rope_neox(x: np.ndarray, cos_half: np.ndarray, sin_half: np.ndarray) -> np.ndarray:
    """NeoX / rotate_half: rotate (x[i], x[i + R/2])."""
    h = x.shape[-1] // 2
    return np.concatenate([x[..., :h] * cos_half - x[..., h:] * sin_half,
                           x[..., h:] * cos_half + x[..., :h] * sin_half], axis=-1)


def _rope(x: np.ndarray, cos_half: np.ndarray, sin_half: np.ndarray) -> np.ndarray:
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * cos_half - x1 * sin_half
    out[..., 1::2] = x1 * cos_half + x0 * sin_half
    return out


# --------------------------------------------------------------------------------------------
# MoE FFN (DeepSeek-V3 routing), from the F32 GGUF's own tensors and metadata
# --------------------------------------------------------------------------------------------

def _top(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values, largest first, ties to the lower index (stable)."""
    return np.argsort(-values, kind="stable")[:k]


def moe_select(choice: np.ndarray, k: int, n_group: int, n_group_used: int) -> np.ndarray:
    """Group-limited top-k of one token's choice scores [E] (llama.cpp build_moe_ffn, HF
    DeepseekV3TopkRouter): group score = sum of the group's two largest choice scores; keep the
    n_group_used best groups; top-k over their experts. Returns the k expert ids."""
    return moe_allowed(choice, k, n_group, n_group_used)[0]


def moe_allowed(choice: np.ndarray, k: int, n_group: int, n_group_used: int) -> tuple[np.ndarray, np.ndarray]:
    """(selected ids, choice scores with the experts of dropped groups set to -inf)."""
    e = choice.shape[0]
    allowed = np.ones(e, dtype=bool)
    if n_group > 1:
        per = e // n_group
        groups = choice.reshape(n_group, per)
        gscore = np.sort(groups, axis=1)[:, ::-1][:, :2].sum(axis=1)
        keep = _top(gscore, n_group_used)
        allowed[:] = False
        for g in keep:
            allowed[g * per:(g + 1) * per] = True
    masked = np.where(allowed, choice, -np.inf)
    return _top(masked, k), masked


def check_moe_layer(t: dict[str, np.ndarray], layer: int, w: dict[str, np.ndarray], moe: dict,
                    eps: float) -> dict[str, float]:
    """Recompute one MoE layer's sites from the captured `hidden_in` and `o_proj`, the GGUF's
    tensors `w` (PyTorch order: ffn_gate_exps [E, F, H], ffn_down_exps [E, H, F]) and the GGUF's
    MoE metadata `moe` (E, K, G, G_used, gating 1 softmax / 2 sigmoid, norm, scale).

    Returns max-abs errors, the count of tokens whose selected set differs from the capture, and
    how many token selections the score-correction bias and the group limit change (a fixture
    whose bias or groups change nothing would not test them), plus the smallest gap between the
    k-th and (k+1)-th allowed choice score (a near tie would make f32 engines flip experts)."""
    g = lambda s: t[f"L{layer}.{s}"]  # noqa: E731
    b = lambda s: w[f"blk.{layer}.{s}"]  # noqa: E731
    h1 = g("hidden_in") + g("o_proj")
    xn = h1 / np.sqrt(np.mean(h1 * h1, axis=-1, keepdims=True) + eps) * b("ffn_norm.weight")
    logits = xn @ b("ffn_gate_inp.weight").T.astype(np.float64)                # [T, E]
    res: dict[str, float] = {"router_logits_max_err": float(np.abs(logits - g("moe_router_logits")).max())}
    if moe["gating"] == 2:
        probs = 1.0 / (1.0 + np.exp(-logits))
    else:
        ex = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs = ex / ex.sum(axis=-1, keepdims=True)
    bias = w.get(f"blk.{layer}.exp_probs_b.bias")
    choice = probs + (bias if bias is not None else 0.0)
    K, G, Gu = moe["K"], moe["G"], moe["G_used"]
    T, H = h1.shape
    moe_out = np.zeros((T, H))
    mismatch = bias_changes = group_changes = 0
    min_gap = np.inf
    gate_e, up_e, down_e = (b("ffn_gate_exps.weight"), b("ffn_up_exps.weight"), b("ffn_down_exps.weight"))
    for ti in range(T):
        sel, masked = moe_allowed(choice[ti], K, G, Gu)
        if set(sel.tolist()) != set(g("moe_topk")[ti].tolist()):
            mismatch += 1
        if set(moe_select(probs[ti], K, G, Gu).tolist()) != set(sel.tolist()):
            bias_changes += 1
        if set(moe_select(choice[ti], K, 1, 1).tolist()) != set(sel.tolist()):
            group_changes += 1
        # gap at the cut, among the allowed experts (those of dropped groups are -inf)
        ordered = np.sort(masked)[::-1]
        if np.isfinite(ordered[K]):
            min_gap = min(min_gap, float(ordered[K - 1] - ordered[K]))
        wts = probs[ti, sel]
        if moe["norm"]:
            wts = wts / (wts.sum() + 1e-20)
        wts = wts * moe["scale"]
        x = xn[ti]
        for e, wt in zip(sel, wts):
            gate = gate_e[e] @ x
            up = up_e[e] @ x
            moe_out[ti] += wt * (down_e[e] @ (gate / (1.0 + np.exp(-gate)) * up))
    gs, us, ds = b("ffn_gate_shexp.weight"), b("ffn_up_shexp.weight"), b("ffn_down_shexp.weight")
    sg, su = xn @ gs.T, xn @ us.T
    shared = (sg / (1.0 + np.exp(-sg)) * su) @ ds.T
    res["moe_out_max_err"] = float(np.abs(moe_out - g("moe_out")).max())
    res["shared_out_max_err"] = float(np.abs(shared - g("shared_out")).max())
    res["hidden_out_max_err"] = float(np.abs(h1 + moe_out + shared - g("hidden_out")).max())
    res["topk_set_mismatches"] = mismatch
    res["tokens_bias_changes_selection"] = bias_changes
    res["tokens_group_limit_changes_selection"] = group_changes
    res["min_choice_gap_at_cut"] = min_gap
    return res


# --------------------------------------------------------------------------------------------
# DSA lightning indexer (DeepSeek-V3.2, GLM-MoE-DSA), from the F32 GGUF's own tensors
# --------------------------------------------------------------------------------------------

def topk_mask(topk: np.ndarray, T: int) -> np.ndarray:
    """[T, K] selected keys (-1 = none) -> [T, T] bool mask (causal part only)."""
    m = np.zeros((T, T), dtype=bool)
    for i in range(T):
        for j in topk[i]:
            if j >= 0:
                m[i, j] = True
    return m & np.tril(np.ones((T, T), dtype=bool))


def check_indexer(t: dict[str, np.ndarray], layer: int, w: dict[str, np.ndarray], idx: dict,
                  R: int, cos: np.ndarray, sin: np.ndarray, rope: str) -> dict:
    """Recompute one DSA layer's indexer in numpy f64 and compare with the capture.

    From the captured `attn_in` (the indexer's hidden input) and `q_c_normed` (its q input) and
    the GGUF tensors `indexer.attn_q_b`, `indexer.attn_k`, `indexer.k_norm` (weight, bias; a
    LayerNorm, eps 1e-6) and `indexer.proj`: idx_q, idx_k, idx_weights; then, from the captured
    idx_q / idx_k / idx_weights, the rope on each head's first R dims (`rope`: "neox" for
    DeepSeek-V3.2, "interleaved" for GLM) and the scores
    s[i, j] = sum_h w[i, h] N^-1/2 ReLU(D^-1/2 q_h[i] . k[j]) (j <= i), compared with HF's
    `idx_scores` (HF computes them in float32: relative error about 1e-7 expected); the top-k
    of the f64 scores compared, as sets, with `idx_topk`; and the gap at the cut: for every row
    with more than K causal keys, (K-th - (K+1)-th largest score) / the row's largest |score|
    (scores can be negative, the head weights are signed), and whether an exact zero (all heads'
    ReLU zero) sits on either side of the cut.
    """
    g = lambda s: t[f"L{layer}.{s}"]  # noqa: E731
    b = lambda s: w[f"blk.{layer}.indexer.{s}"].astype(np.float64)  # noqa: E731
    nI, D, K = idx["index_n_heads"], idx["index_head_dim"], idx["index_topk"]
    x, qc = g("attn_in"), g("q_c_normed")
    T = x.shape[0]
    res: dict = {}
    q = (qc @ b("attn_q_b.weight").T).reshape(T, nI, D)
    kl = x @ b("attn_k.weight").T
    mu = kl.mean(-1, keepdims=True)
    var = ((kl - mu) ** 2).mean(-1, keepdims=True)
    k = (kl - mu) / np.sqrt(var + 1e-6) * b("k_norm.weight") + b("k_norm.bias")
    wts = x @ b("proj.weight").T
    res["idx_q_max_rel_err"] = float(np.abs(q - g("idx_q")).max() / np.abs(g("idx_q")).max())
    res["idx_k_max_rel_err"] = float(np.abs(k - g("idx_k")).max() / np.abs(g("idx_k")).max())
    res["idx_weights_max_rel_err"] = float(np.abs(wts - g("idx_weights")).max() / np.abs(g("idx_weights")).max())

    # scores from the captured projections
    q, k, wts = g("idx_q"), g("idx_k"), g("idx_weights")
    ch, sh = cos[:, : R // 2], sin[:, : R // 2]
    rot = _rope_neox if rope == "neox" else _rope
    qr = np.concatenate([rot(q[..., :R], ch[:, None, :], sh[:, None, :]), q[..., R:]], axis=-1)
    kr = np.concatenate([rot(k[..., :R], ch, sh), k[..., R:]], axis=-1)
    dots = np.einsum("ihd,jd->ihj", qr, kr) * D ** -0.5                   # [T, nI, T]
    scores = np.einsum("ih,ihj->ij", wts * nI ** -0.5, np.maximum(dots, 0.0))
    causal = np.tril(np.ones((T, T), dtype=bool))
    scores = np.where(causal, scores, 0.0)
    hf = g("idx_scores")
    res["idx_scores_max_rel_err"] = float(np.abs(scores - hf).max() / np.abs(hf).max())
    # the other rope pairing must not match (control)
    wrong = _rope if rope == "neox" else _rope_neox
    qw = np.concatenate([wrong(q[..., :R], ch[:, None, :], sh[:, None, :]), q[..., R:]], axis=-1)
    kw = np.concatenate([wrong(k[..., :R], ch, sh), k[..., R:]], axis=-1)
    sw = np.einsum("ih,ihj->ij", wts * nI ** -0.5,
                   np.maximum(np.einsum("ihd,jd->ihj", qw, kw) * D ** -0.5, 0.0))
    res["idx_scores_other_rope_max_rel_diff"] = float(np.abs(np.where(causal, sw, 0) - hf).max() / np.abs(hf).max())

    # top-k of the f64 scores, and the gap at the cut (rows with more than K causal keys)
    mism = 0
    gaps = []
    zero_at_cut = 0
    for i in range(T):
        row = scores[i, : i + 1]
        order = np.argsort(-row, kind="stable")
        sel = set(order[:K].tolist())
        if sel != set(int(j) for j in g("idx_topk")[i] if j >= 0):
            mism += 1
        if i + 1 > K:
            srt = row[order]
            # relative to the row's largest |score| (scores can be negative: the head weights are)
            gaps.append(float((srt[K - 1] - srt[K]) / np.abs(row).max()))
            if srt[K - 1] == 0.0 or srt[K] == 0.0:
                zero_at_cut += 1
    res["topk_set_mismatches"] = mism
    res["rows_with_cut"] = len(gaps)
    res["min_rel_gap_at_cut"] = min(gaps) if gaps else float("inf")
    res["zero_score_at_cut_rows"] = zero_at_cut
    res["exact_zero_scores"] = int(np.sum((scores == 0.0) & causal))
    res["hf_exact_zero_scores"] = int(np.sum((hf == 0.0) & causal))
    return res


def check_minicpm3(t: dict[str, np.ndarray], w: dict[str, np.ndarray], n_layers: int, mc: dict,
                   eps: float) -> dict:
    """MiniCPM3's scalings, from the GGUF's tensors: L0.hidden_in = scale_emb * token_embd[tokens];
    per layer h1 = hidden_in + s * o_proj, hidden_out = h1 + s * FFN(RMSNorm(h1)) with
    s = scale_depth / sqrt(n_layers); logits = (RMSNorm(last hidden_out) / (H / dim_model_base))
    . output^T."""
    res: dict = {}
    emb = w["token_embd.weight"].astype(np.float64)
    H = emb.shape[1]
    h0 = emb[t["tokens"]] * mc["scale_emb"]
    res["embed_max_err"] = float(np.abs(h0 - t["L0.hidden_in"]).max())
    s = mc["scale_depth"] / math.sqrt(n_layers)
    rms = lambda x, wt: x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * wt  # noqa: E731
    worst = 0.0
    for n in range(n_layers):
        b = lambda k: w[f"blk.{n}.{k}"].astype(np.float64)  # noqa: E731
        h1 = t[f"L{n}.hidden_in"] + s * t[f"L{n}.o_proj"]
        x = rms(h1, b("ffn_norm.weight"))
        gt, up = x @ b("ffn_gate.weight").T, x @ b("ffn_up.weight").T
        ffn = (gt / (1 + np.exp(-gt)) * up) @ b("ffn_down.weight").T
        out = h1 + s * ffn
        worst = max(worst, float(np.abs(out - t[f"L{n}.hidden_out"]).max()))
        if n + 1 < n_layers:
            worst = max(worst, float(np.abs(out - t[f"L{n + 1}.hidden_in"]).max()))
        # and without the residual scaling, to show that it matters
        res.setdefault("hidden_out_unscaled_max_diff", 0.0)
        res["hidden_out_unscaled_max_diff"] = max(
            res["hidden_out_unscaled_max_diff"],
            float(np.abs(t[f"L{n}.hidden_in"] + t[f"L{n}.o_proj"] - h1).max()))
    res["hidden_out_max_err"] = worst
    last = t[f"L{n_layers - 1}.hidden_out"]
    logits = (rms(last, w["output_norm.weight"].astype(np.float64)) / (H / mc["dim_model_base"])) \
        @ w["output.weight"].astype(np.float64).T
    res["logits_max_err"] = float(np.abs(logits - t["logits"]).max())
    return res
