//! The reference's FFN: the layer's SwiGLU MLP (the dense FFN of a dense layer, the shared
//! experts of an MoE layer), the MoE block around it (router, routing, routed experts), and the
//! MLP's per-rank sites under TP.
//!
//! The MLP is where a merged-column TP loader goes wrong (vllm-gguf-plugin#103: every rank keeps
//! rank 0's slice of `gate_up_proj`), so its intermediates are sites like attention's: `ffn_in`,
//! `ffn_gate`, `ffn_up`, `ffn_act`, `ffn_out`, and under TP each rank's `gate_up_proj` and
//! `down_proj` shards and outputs, cut as vLLM's `MergedColumnParallelLinear` and
//! `RowParallelLinear` cut them. The arithmetic is the parent module's (f64 GEMMs over the f32
//! dequantized weights, [`super::linear32`]); this file holds what the FFN adds to the layer.
//!
//! MoE layers ([`moe_ffn`]) follow HF `modeling_deepseek_v3.py` (`DeepseekV3TopkRouter`,
//! `DeepseekV3MoE`) and llama.cpp `src/llama-graph.cpp` (`build_moe_ffn`), as the GGUF's
//! `expert_*` keys describe them (see `docs/architectures.md`), with ties in every top-k broken
//! towards the lower index so that the selection is deterministic. The MLP's TP split follows
//! vLLM 0.26 `deepseek_v2.py` (`DeepseekV2MLP`: `gate_up_proj` merged column-parallel,
//! `down_proj` row-parallel and all-reduced).

use ndarray::{Array2, Axis, s};
use rayon::prelude::*;

use super::{
    RefInputs, RefLayer, forward_sel, gemm_input, linear, linear32, record_copy, record_moved, rms_norm, widen_to_f64,
};
use crate::core::batch::Batch;
use crate::core::error::{Error, Result};
use crate::core::fp8::ActQuant;
use crate::core::trace::{RankedWeight, Site, Stage, Trace, TraceTensor};
use crate::model::config::{GatingFunc, MlaConfig, MoeConfig};
use crate::model::gguf::GgufFile;
use crate::model::weights::{DenseFfn, LayerWeights, MoeWeights, NonFiniteTensor, SwiGlu, into_row_major};

#[cfg(doc)]
use super::forward;

/// `silu(g)·u` elementwise (SwiGLU's activation, `ffn_act`), f64: [T, I] from two [T, I].
fn silu_mul(gate: &Array2<f64>, up: &Array2<f64>) -> Array2<f64> {
    ndarray::Zip::from(gate)
        .and(up)
        .map_collect(|&g, &u| g / (1.0 + (-g).exp()) * u)
}

/// The layer's SwiGLU MLP on `x` [T, H] (`ffn_in`) with `gate`, `up` [I, H] and `down` [H, I]:
/// records `ffn_gate`, `ffn_up` and `ffn_act` [T, I] (moved into the trace, not copied) and
/// returns `down_proj(ffn_act)` [T, H], f64. With `fp8`, both products read their inputs
/// quantized (`down`'s in `tp` rank slices, a row-parallel projection).
fn mlp_sites(
    trace: &mut Trace,
    layer: usize,
    x: &Array2<f64>,
    [gate, up, down]: [&Array2<f32>; 3],
    fp8: Option<&ActQuant>,
    tp: usize,
) -> Array2<f64> {
    let xq = gemm_input(x, fp8, 1);
    let g = linear32(&xq, gate);
    let u = linear32(&xq, up);
    drop(xq);
    let act = silu_mul(&g, &u);
    record_moved(trace, layer, Stage::FfnGate, g);
    record_moved(trace, layer, Stage::FfnUp, u);
    let out = linear32(&gemm_input(&act, fp8, tp), down);
    record_moved(trace, layer, Stage::FfnAct, act);
    out
}

/// The dense FFN of a layer on `h1` [T, H] (the residual stream after attention): records
/// `ffn_in` = `RMSNorm(h1)·ffn_norm`, `ffn_gate`, `ffn_up`, `ffn_act` [T, F] and `ffn_out`
/// [T, H], and returns `ffn_out` (before the residual add and the residual scale), f64. `fp8`
/// and `tp` as [`mlp_sites`] takes them.
pub(super) fn dense_ffn(
    trace: &mut Trace,
    layer: usize,
    ffn: &DenseFfn,
    h1: &Array2<f64>,
    eps: f64,
    fp8: Option<&ActQuant>,
    tp: usize,
) -> Array2<f64> {
    let x = rms_norm(h1.view(), ffn.norm.view(), eps);
    let out = mlp_sites(trace, layer, &x, [&ffn.gate, &ffn.up, &ffn.down], fp8, tp);
    record_moved(trace, layer, Stage::FfnIn, x);
    record_copy(trace, layer, Stage::FfnOut, &out);
    out
}

/// The reference's per-rank sites of the layer's SwiGLU MLP for `--tp tp`, with its weights
/// `gate`, `up` [I, H] and `down` [H, I] (f32, as dequantized) and its own `ffn_gate`, `ffn_up`
/// and `ffn_act` sites of layer `layer` in `trace` ([T, I], f64). Rank r of tp holds the FFN
/// columns `c_r = r·I/tp..(r+1)·I/tp`, as vLLM cuts them:
///
/// - `w.gate_up.rank<r>` [2·I/tp, H]: `[gate rows c_r ; up rows c_r]` (`MergedColumnParallelLinear`),
///   f32;
/// - `w.down.rank<r>` [H, I/tp]: the columns `c_r` of `down` (`RowParallelLinear`), f32;
/// - `ffn_gate_up.rank<r>` [T, 2·I/tp]: `[ffn_gate cols c_r | ffn_up cols c_r]`, the rank's merged
///   output (the reference's values, sliced: exactly what the rank's rows compute);
/// - `ffn_down.rank<r>` [T, H]: `ffn_act[:, c_r] · down[:, c_r]ᵀ` in f64, the rank's partial
///   before the all-reduce; the partials sum to `down_proj(ffn_act)` (`ffn_out` in a dense layer).
///
/// Returns an empty trace for `tp < 2`, for I not a multiple of `tp` (vLLM cannot shard it; the
/// engine paths then run the MLP unsplit) and when `trace` lacks the three sites (a layer whose
/// MLP did not run).
///
/// Errors: [`Error::Internal`] for sites whose shapes disagree with the weights.
pub fn ffn_rank_sites(
    layer: usize,
    gate: &Array2<f32>,
    up: &Array2<f32>,
    down: &Array2<f32>,
    trace: &Trace,
    tp: usize,
    fp8: Option<&ActQuant>,
) -> Result<Trace> {
    let mut tr = Trace::new();
    let (i, hd) = gate.dim();
    if tp < 2 || !i.is_multiple_of(tp) {
        return Ok(tr);
    }
    let site = |stage: Stage| -> Option<Result<Array2<f64>>> {
        let t = trace.get(&Site::new(layer, stage))?;
        let rows = t.shape.first().copied().unwrap_or(0);
        Some(Array2::from_shape_vec((rows, t.len() / rows.max(1)), t.to_f64()).map_err(Error::internal))
    };
    let (Some(g), Some(u), Some(act)) = (site(Stage::FfnGate), site(Stage::FfnUp), site(Stage::FfnAct)) else {
        return Ok(tr);
    };
    let (g, u, act) = (g?, u?, act?);
    if g.ncols() != i || u.dim() != g.dim() || act.dim() != g.dim() || up.dim() != (i, hd) || down.dim() != (hd, i) {
        return Err(Error::internal(format!(
            "reference FFN ranks: ffn_gate {:?}, ffn_up {:?}, ffn_act {:?} for gate {:?}, up {:?}, down {:?}",
            g.shape(),
            u.shape(),
            act.shape(),
            gate.shape(),
            up.shape(),
            down.shape()
        )));
    }
    let ir = i / tp;
    let f32_site = |tr: &mut Trace, stage: Stage, a: Array2<f32>| {
        let shape = a.shape().to_vec();
        tr.record(Site::new(layer, stage), TraceTensor::f32(shape, into_row_major(a)));
    };
    for rank in 0..tp {
        let (rk, c) = (rank as u32, rank * ir..(rank + 1) * ir);
        let gu_w = ndarray::concatenate(Axis(0), &[gate.slice(s![c.clone(), ..]), up.slice(s![c.clone(), ..])])
            .map_err(Error::internal)?;
        f32_site(&mut tr, Stage::WRank(RankedWeight::GateUp, rk), gu_w);
        let down_r = down.slice(s![.., c.clone()]).to_owned();
        let gu = ndarray::concatenate(Axis(1), &[g.slice(s![.., c.clone()]), u.slice(s![.., c.clone()])])
            .map_err(Error::internal)?;
        record_moved(&mut tr, layer, Stage::FfnGateUpRank(rk), gu);
        let act_r = act.slice(s![.., c]).to_owned();
        let part = linear32(&gemm_input(&act_r, fp8, 1), &down_r);
        record_moved(&mut tr, layer, Stage::FfnDownRank(rk), part);
        f32_site(&mut tr, Stage::WRank(RankedWeight::Down, rk), down_r);
    }
    Ok(tr)
}

/// [`ffn_rank_sites`] of a dense layer (`w.ffn`) from the sites of its reference trace `trace`;
/// an empty trace for a layer without a dense FFN. `fp8` as [`ffn_rank_sites`] takes it.
///
/// Errors: as [`ffn_rank_sites`].
pub fn ffn_rank_sites_of(w: &LayerWeights, trace: &Trace, tp: usize, fp8: Option<&ActQuant>) -> Result<Trace> {
    match &w.ffn {
        Some(f) => ffn_rank_sites(w.layer, &f.gate, &f.up, &f.down, trace, tp, fp8),
        None => Ok(Trace::new()),
    }
}

/// [`forward`], plus the MoE FFN ([`moe_ffn`]) when `cfg` says layer `w.layer` is an MoE layer:
/// then the trace also holds `ffn_in`, `moe_router_logits`, `moe_topk`, `moe_out`, the shared
/// experts' `ffn_gate`, `ffn_up`, `ffn_act` and `shared_out`, and `hidden_out`.
///
/// Errors: as [`forward`] and [`moe_ffn`]; [`Error::NotSupported`] for a layer that holds MoE
/// tensors (`ffn_gate_inp`) in a file without the `expert_count` key.
pub fn forward_full(
    file: &GgufFile,
    cfg: &MlaConfig,
    w: &LayerWeights,
    hidden_in: &Array2<f64>,
    batch: &Batch,
) -> Result<RefLayer> {
    forward_full_sel(file, cfg, w, hidden_in, batch, &RefInputs::default())
}

/// [`forward_full`] with what a DSA layer takes from outside ([`RefInputs`]: a shared-indexer
/// layer's borrowed selection, keys to attend to, the indexer's quantization; see
/// [`forward_sel`]).
///
/// Errors: as [`forward_full`].
pub fn forward_full_sel(
    file: &GgufFile,
    cfg: &MlaConfig,
    w: &LayerWeights,
    hidden_in: &Array2<f64>,
    batch: &Batch,
    dsa: &RefInputs<'_>,
) -> Result<RefLayer> {
    forward_full_tp(file, cfg, w, hidden_in, batch, dsa, 1)
}

/// [`forward_full_sel`], and for `tp ≥ 2` the shared experts' per-rank sites ([`ffn_rank_sites`]).
///
/// Errors: as [`forward_full`].
pub(super) fn forward_full_tp(
    file: &GgufFile,
    cfg: &MlaConfig,
    w: &LayerWeights,
    hidden_in: &Array2<f64>,
    batch: &Batch,
    dsa: &RefInputs<'_>,
    tp: usize,
) -> Result<RefLayer> {
    let mut r = forward_sel(cfg, w, hidden_in, batch, dsa)?;
    if r.hidden_out.is_some() {
        return Ok(r);
    }
    if !cfg.is_moe_layer(w.layer) {
        return Err(Error::NotSupported(format!(
            "{}: layer {} has no dense FFN (it holds `{}`) but the file has no `{}.expert_count` key, so its MoE FFN cannot be run",
            file.path().display(),
            w.layer,
            crate::model::tensors::ModelTensor::FfnGateInp.name(w.layer),
            cfg.arch
        )));
    }
    let o = r
        .trace
        .get(&Site::new(w.layer, Stage::OProj))
        .ok_or_else(|| Error::Internal("reference: o_proj not recorded".into()))?;
    let h1 = hidden_in
        + &(Array2::from_shape_vec(hidden_in.raw_dim(), o.to_f64()).map_err(|e| Error::Internal(e.to_string()))?
            * cfg.residual_scale);
    let mw = MoeWeights::load(file, cfg, w.layer)?;
    let act = dsa.fp8.and_then(|f| f.act.as_ref());
    let out = moe_ffn(file, cfg, &mw, &h1, &mut r.trace, (act, tp))?;
    if let Some(sh) = &mw.shared {
        let ranks = ffn_rank_sites(w.layer, &sh.gate, &sh.up, &sh.down, &r.trace, tp, act)?;
        r.trace.extend(ranks);
    }
    r.hidden_out = Some(out.hidden_out);
    r.moe_nonfinite = out.nonfinite;
    Ok(r)
}

/// What [`moe_ffn`] computed besides its recorded sites.
#[derive(Debug, Clone)]
pub struct MoeOut {
    /// `hidden_out` = `h1 + moe_out + shared_out`, [T, H].
    pub hidden_out: Array2<f64>,
    /// The selected experts of every token, in selection order, \[T]\[K].
    pub selected: Vec<Vec<usize>>,
    /// Non-finite weights met (router, bias, shared experts, selected experts).
    pub nonfinite: Vec<NonFiniteTensor>,
}

/// The routing of one token: the `K` selected experts, best first, and their weights.
///
/// From `scores` \[E] (the gated router logits) and `choice` \[E] (`scores + exp_probs_b`, or
/// `scores` without a bias): with `G > 1`, each group's score is the sum of its two largest
/// choice values and only the `G_used` best groups stay eligible; the `K` eligible experts with
/// the largest choice values are selected; their weights are their UNBIASED `scores`, divided by
/// `(Σ weights + 1e-20)` when `weights_norm` (HF; llama.cpp divides by max(Σ, 6.1e-5), the same
/// for any real sum), then multiplied by `weights_scale`. Ties, in the group ranking and in the
/// expert ranking, go to the lower index.
pub fn route(moe: &MoeConfig, scores: &[f64], choice: &[f64]) -> (Vec<usize>, Vec<f64>) {
    let e = choice.len();
    let mut eligible = vec![true; e];
    if moe.n_group > 1 {
        let per = moe.experts_per_group();
        let group_score = |g: usize| {
            let mut v: Vec<f64> = choice[g * per..(g + 1) * per].to_vec();
            v.sort_by(|a, b| b.total_cmp(a));
            v[0] + v[1]
        };
        let gs: Vec<f64> = (0..moe.n_group).map(group_score).collect();
        let kept = top_k(&gs, moe.n_group_used);
        for (i, el) in eligible.iter_mut().enumerate() {
            *el = kept.contains(&(i / per));
        }
    }
    let masked: Vec<f64> = choice
        .iter()
        .zip(&eligible)
        .map(|(&c, &ok)| if ok { c } else { f64::NEG_INFINITY })
        .collect();
    let sel = top_k(&masked, moe.n_expert_used);
    let mut w: Vec<f64> = sel.iter().map(|&i| scores[i]).collect();
    if moe.weights_norm {
        let sum: f64 = w.iter().sum::<f64>() + 1e-20;
        w.iter_mut().for_each(|x| *x /= sum);
    }
    w.iter_mut().for_each(|x| *x *= moe.weights_scale);
    (sel, w)
}

/// Indices of the `k` largest values, largest first; ties go to the lower index (a stable sort),
/// NaN counts as smallest.
fn top_k(v: &[f64], k: usize) -> Vec<usize> {
    let key = |x: f64| if x.is_nan() { f64::NEG_INFINITY } else { x };
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&a, &b| key(v[b]).total_cmp(&key(v[a])));
    idx.truncate(k);
    idx
}

/// `silu(gate·x) ⊙ up·x` for every row of `x` [T, H] → [T, F_e], f64 accumulation: an expert's
/// activation, the input of its `down`.
fn expert_act(x: &Array2<f64>, f: &SwiGlu) -> Array2<f64> {
    let gate = linear(x, &widen_to_f64(&f.gate));
    let up = linear(x, &widen_to_f64(&f.up));
    silu_mul(&gate, &up)
}

/// The experts' `down` inputs under one per-tensor fp8 scale over every expert's rows together
/// (vLLM's fused MoE quantizes its whole intermediate cache at once). Unchanged without fp8.
fn quantize_expert_acts(acts: &mut [Array2<f64>], fp8: Option<&ActQuant>) {
    let Some(q) = fp8 else { return };
    let amax = acts
        .iter()
        .flat_map(|a| a.iter())
        .fold(0f64, |m, v| m.max(q.input.map_or(*v, |d| d.round(*v)).abs()));
    for a in acts.iter_mut() {
        let k = a.ncols();
        let mut flat = a.as_standard_layout().into_owned();
        if let Some(v) = flat.as_slice_mut() {
            q.quantize_columns(v, k, 0..k, Some(amax));
        }
        *a = flat;
    }
}

/// The MoE FFN of one layer on `h1` [T, H] (the residual stream after attention), recording
/// `ffn_in` [T, H] (`RMSNorm(h1)·ffn_norm`, the input of the router and of every expert),
/// `moe_router_logits` [T, E], `moe_topk` [T, K] (expert ids as f64, best first), `moe_out`
/// [T, H] (the weighted sum of the routed experts), the shared experts' `ffn_gate`, `ffn_up`,
/// `ffn_act` [T, n_shared·F_e] and `shared_out` [T, H] (when the layer has shared experts) and
/// `hidden_out` = `h1 + moe_out + shared_out` into `trace`.
///
/// `x = RMSNorm(h1)·ffn_norm`; router logits `x · ffn_gate_inpᵀ`; scores = softmax over E or
/// elementwise sigmoid (`expert_gating_func`); routing by [`route`] with `choice = scores +
/// exp_probs_b`; each routed expert is dequantized from its slice of the 3-D tensors only when
/// some token selected it ([`MoeWeights::expert`]), one expert at a time; a token's routed
/// outputs are summed in expert-id order.
///
/// Errors: [`Error::Internal`] for `h1` of the wrong shape or a file without MoE config (`mw`
/// exists only for an MoE layer); missing tensors and dequantization errors of the experts.
///
/// With `fp8` (an engine's fp8 GEMMs; `tp` its ranks), every expert product reads its input
/// quantized: `ffn_in` once for the router-selected experts and the shared experts (per token
/// group, or one scale over every token), each expert's activation for its `down` (per token
/// group, or one scale over every expert's rows), the shared experts' `down` per rank slice.
/// The router reads `ffn_in` unquantized (its weight stays bf16/f32 in fp8 checkpoints).
pub fn moe_ffn(
    file: &GgufFile,
    cfg: &MlaConfig,
    mw: &MoeWeights,
    h1: &Array2<f64>,
    trace: &mut Trace,
    (fp8, tp): (Option<&ActQuant>, usize),
) -> Result<MoeOut> {
    let moe = cfg
        .moe
        .as_ref()
        .ok_or_else(|| Error::internal(format!("{}: MoE weights without an MoE config", file.path().display())))?;
    let (t, hd, layer) = (h1.nrows(), cfg.hidden, mw.layer);
    if h1.ncols() != hd {
        return Err(Error::internal(format!(
            "reference: MoE input has shape {:?}, expected [T, H={hd}]",
            h1.shape()
        )));
    }
    let mut nonfinite = mw.nonfinite();
    let x = rms_norm(h1.view(), mw.norm.view(), cfg.rms_eps);
    let logits = linear(&x, &widen_to_f64(&mw.router));
    record_copy(trace, layer, Stage::MoeRouterLogits, &logits);

    let mut selected = Vec::with_capacity(t);
    let mut weights = Vec::with_capacity(t);
    for row in logits.rows() {
        let scores: Vec<f64> = match moe.gating {
            GatingFunc::Sigmoid => row.iter().map(|&z| 1.0 / (1.0 + (-z).exp())).collect(),
            GatingFunc::Softmax => {
                let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = row.iter().map(|&z| (z - m).exp()).collect();
                let sum: f64 = e.iter().sum();
                e.into_iter().map(|v| v / sum).collect()
            }
        };
        let choice: Vec<f64> = match &mw.exp_probs_b {
            Some(b) => scores.iter().zip(b.iter()).map(|(&s, &bi)| s + f64::from(bi)).collect(),
            None => scores.clone(),
        };
        let (sel, w) = route(moe, &scores, &choice);
        selected.push(sel);
        weights.push(w);
    }
    let k = moe.n_expert_used;
    let ids: Vec<f64> = selected.iter().flat_map(|s| s.iter().map(|&e| e as f64)).collect();
    trace.record(Site::new(layer, Stage::MoeTopk), TraceTensor::f64(vec![t, k], ids));

    // Routed experts: each selected expert is dequantized on its own (in parallel across
    // experts, one expert's slices per task) and run only on the tokens that selected it; the
    // weighted outputs are then summed per token in expert-id order, so the result does not
    // depend on threading.
    let users_of = |expert: usize| -> Vec<(usize, f64)> {
        selected
            .iter()
            .zip(&weights)
            .enumerate()
            .filter_map(|(ti, (sel, w))| sel.iter().position(|&e| e == expert).map(|j| (ti, w[j])))
            .collect()
    };
    let used: Vec<usize> = (0..moe.n_expert).filter(|&e| !users_of(e).is_empty()).collect();
    let xq = gemm_input(&x, fp8, 1);
    // One scale over every expert's activations needs them all before any `down`: that case
    // keeps the activations and dequantizes each `down` again; otherwise each expert runs whole.
    let per_tensor = fp8.is_some_and(|q| q.granularity == crate::core::fp8::ActGranularity::Tensor);
    type ExpertRun = (Vec<(usize, f64)>, Array2<f64>, Vec<NonFiniteTensor>);
    let runs: Vec<ExpertRun> = used
        .par_iter()
        .map(|&expert| -> Result<ExpertRun> {
            let users = users_of(expert);
            let f = mw.expert(file, expert)?;
            let bad = f.nonfinite(layer, SwiGlu::ROUTED, Some(expert));
            let xs = Array2::from_shape_fn((users.len(), hd), |(i, c)| xq[[users[i].0, c]]);
            let act = expert_act(&xs, &f);
            let y = if per_tensor {
                act
            } else {
                linear(&gemm_input(&act, fp8, 1), &widen_to_f64(&f.down))
            };
            Ok((users, y, bad))
        })
        .collect::<Result<_>>()?;
    drop(xq);
    let runs = if per_tensor {
        let mut acts: Vec<Array2<f64>> = runs.iter().map(|r| r.1.clone()).collect();
        quantize_expert_acts(&mut acts, fp8);
        let outs: Vec<Array2<f64>> = used
            .par_iter()
            .zip(&acts)
            .map(|(&expert, a)| -> Result<Array2<f64>> { Ok(linear(a, &widen_to_f64(&mw.expert(file, expert)?.down))) })
            .collect::<Result<_>>()?;
        runs.into_iter().zip(outs).map(|((u, _, b), y)| (u, y, b)).collect()
    } else {
        runs
    };
    let mut moe_out = Array2::<f64>::zeros((t, hd));
    for (users, y, bad) in runs {
        nonfinite.extend(bad);
        for (i, &(ti, wt)) in users.iter().enumerate() {
            let mut row = moe_out.row_mut(ti);
            row.scaled_add(wt, &y.row(i));
        }
    }
    record_copy(trace, layer, Stage::MoeOut, &moe_out);
    let mut hidden_out = h1 + &moe_out;
    if let Some(sh) = &mw.shared {
        let shared_out = mlp_sites(trace, layer, &x, [&sh.gate, &sh.up, &sh.down], fp8, tp);
        record_copy(trace, layer, Stage::SharedOut, &shared_out);
        hidden_out += &shared_out;
    }
    record_moved(trace, layer, Stage::FfnIn, x);
    record_copy(trace, layer, Stage::HiddenOut, &hidden_out);
    Ok(MoeOut {
        hidden_out,
        selected,
        nonfinite,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::batch::normal_f32;

    fn moe(norm: bool, n_group: usize, n_group_used: usize) -> MoeConfig {
        MoeConfig {
            n_expert: 8,
            n_expert_used: 2,
            n_expert_shared: 1,
            expert_ffn: 32,
            weights_scale: 2.5,
            weights_norm: norm,
            gating: GatingFunc::Sigmoid,
            n_group,
            n_group_used,
        }
    }

    fn sigmoid(v: &[f64]) -> Vec<f64> {
        v.iter().map(|&z| 1.0 / (1.0 + (-z).exp())).collect()
    }

    #[test]
    fn the_bias_moves_the_choice_but_never_the_weights() {
        let logits: Vec<f64> = normal_f32(3, 8).into_iter().map(f64::from).collect();
        let scores = sigmoid(&logits);
        let (plain, _) = route(&moe(true, 1, 1), &scores, &scores);
        // A bias that favours the two experts the plain choice left out with the lowest scores.
        let mut order: Vec<usize> = (0..8).collect();
        order.sort_by(|&a, &b| scores[a].total_cmp(&scores[b]));
        let (lo0, lo1) = (order[0], order[1]);
        let choice: Vec<f64> = (0..8)
            .map(|e| scores[e] + if e == lo0 || e == lo1 { 2.0 } else { 0.0 })
            .collect();
        let (sel, w) = route(&moe(true, 1, 1), &scores, &choice);
        assert_eq!(set_of(&sel), set_of(&[lo0, lo1]));
        assert_ne!(set_of(&sel), set_of(&plain));
        // Weights: the unbiased scores, normalised to 1, times 2.5.
        let sum = scores[sel[0]] + scores[sel[1]];
        for (j, &e) in sel.iter().enumerate() {
            approx::assert_relative_eq!(w[j], 2.5 * scores[e] / sum, max_relative = 1e-14);
        }
        approx::assert_relative_eq!(w.iter().sum::<f64>(), 2.5, max_relative = 1e-14);
        // Without normalisation: scale × score.
        let (sel2, w2) = route(&moe(false, 1, 1), &scores, &choice);
        for (j, &e) in sel2.iter().enumerate() {
            approx::assert_relative_eq!(w2[j], 2.5 * scores[e], max_relative = 1e-14);
        }
    }

    #[test]
    fn group_limit_drops_a_strong_expert_in_a_weak_group() {
        // 4 groups of 2: group 0 = {0.95, 0.05} (sum 1.0), group 1 = {0.6, 0.55} (1.15),
        // group 2 = {0.5, 0.52} (1.02), group 3 = {0.1, 0.2} (0.3). Keeping 2 groups keeps 1 and
        // 2: expert 0, the best single expert, is not eligible.
        let choice = [0.95, 0.05, 0.6, 0.55, 0.5, 0.52, 0.1, 0.2];
        let (sel, _) = route(&moe(true, 4, 2), &choice, &choice);
        assert_eq!(sel, vec![2, 3]);
        let (free, _) = route(&moe(true, 1, 1), &choice, &choice);
        assert_eq!(free, vec![0, 2]);
        // Keeping 3 groups brings group 0 back.
        let (sel3, _) = route(&moe(true, 4, 3), &choice, &choice);
        assert_eq!(sel3, vec![0, 2]);
    }

    #[test]
    fn ties_go_to_the_lower_index_in_groups_and_experts() {
        let choice = [0.3, 0.7, 0.7, 0.3, 0.7, 0.3, 0.3, 0.7];
        // Every group sums to 1.0: groups 0 and 1 win the tie; experts 1 and 2 win theirs.
        let (sel, _) = route(&moe(true, 4, 2), &choice, &choice);
        assert_eq!(sel, vec![1, 2]);
        let (sel, _) = route(&moe(true, 1, 1), &choice, &choice);
        assert_eq!(sel, vec![1, 2]);
        assert_eq!(top_k(&[0.5, f64::NAN, 0.5, 0.9], 3), vec![3, 0, 2]);
    }

    fn set_of(v: &[usize]) -> std::collections::BTreeSet<usize> {
        v.iter().copied().collect()
    }

    /// A seeded [rows, cols] f32 matrix.
    fn mat(seed: u64, rows: usize, cols: usize) -> Array2<f32> {
        Array2::from_shape_vec((rows, cols), normal_f32(seed, rows * cols)).unwrap()
    }

    /// A seeded dense FFN of width `i` over `h` hidden, and a seeded `h1` [t, h].
    fn dense(t: usize, h: usize, i: usize) -> (DenseFfn, Array2<f64>) {
        let ffn = DenseFfn {
            norm: ndarray::Array1::from(normal_f32(1, h)).mapv(|x| 1.0 + 0.1 * x),
            gate: mat(2, i, h),
            up: mat(3, i, h),
            down: mat(4, h, i),
        };
        (ffn, mat(5, t, h).mapv(f64::from))
    }

    fn site(tr: &Trace, stage: Stage) -> Vec<f64> {
        tr.get(&Site::new(3, stage)).unwrap().to_f64()
    }

    fn close(a: f64, b: f64, scale: f64) -> bool {
        (a - b).abs() <= 1e-12 * scale.max(1.0)
    }

    #[test]
    fn the_dense_ffn_records_norm_projections_activation_and_output() {
        let (t, h, i) = (5, 12, 8);
        let (ffn, h1) = dense(t, h, i);
        let mut tr = Trace::new();
        let out = dense_ffn(&mut tr, 3, &ffn, &h1, 1e-6, None, 1);
        let (x, g, u, act, o) = (
            site(&tr, Stage::FfnIn),
            site(&tr, Stage::FfnGate),
            site(&tr, Stage::FfnUp),
            site(&tr, Stage::FfnAct),
            site(&tr, Stage::FfnOut),
        );
        assert_eq!(tr.get(&Site::new(3, Stage::FfnAct)).unwrap().shape, vec![t, i]);
        assert_eq!(o, out.iter().copied().collect::<Vec<_>>());
        for ti in 0..t {
            let ms = (0..h).map(|c| h1[[ti, c]] * h1[[ti, c]]).sum::<f64>() / h as f64;
            for c in 0..h {
                let want = h1[[ti, c]] / (ms + 1e-6).sqrt() * f64::from(ffn.norm[c]);
                assert!(close(x[ti * h + c], want, want.abs()), "ffn_in [{ti}, {c}]");
            }
            for j in 0..i {
                let dot = |w: &Array2<f32>| (0..h).map(|c| x[ti * h + c] * f64::from(w[[j, c]])).sum::<f64>();
                assert!(close(g[ti * i + j], dot(&ffn.gate), 10.0), "ffn_gate [{ti}, {j}]");
                assert!(close(u[ti * i + j], dot(&ffn.up), 10.0), "ffn_up [{ti}, {j}]");
                // SiLU(gate)·up, elementwise, from the recorded gate and up: the same bits.
                let (gv, uv) = (g[ti * i + j], u[ti * i + j]);
                assert_eq!(act[ti * i + j].to_bits(), (gv / (1.0 + (-gv).exp()) * uv).to_bits());
            }
            for c in 0..h {
                let want = (0..i)
                    .map(|j| act[ti * i + j] * f64::from(ffn.down[[c, j]]))
                    .sum::<f64>();
                assert!(close(o[ti * h + c], want, 10.0), "ffn_out [{ti}, {c}]");
            }
        }
        assert!(act.iter().any(|&v| v < 0.0) && act.iter().any(|&v| v > 0.1));
    }

    #[test]
    fn rank_sites_cut_the_mlp_as_vllm_does_and_the_partials_sum_to_ffn_out() {
        let (t, h, i) = (5, 12, 8);
        let (ffn, h1) = dense(t, h, i);
        let mut tr = Trace::new();
        dense_ffn(&mut tr, 3, &ffn, &h1, 1e-6, None, 1);
        let (g, u, o) = (
            site(&tr, Stage::FfnGate),
            site(&tr, Stage::FfnUp),
            site(&tr, Stage::FfnOut),
        );
        for tp in [2, 4] {
            let ranks = ffn_rank_sites(3, &ffn.gate, &ffn.up, &ffn.down, &tr, tp, None).unwrap();
            let ir = i / tp;
            let mut sum = vec![0f64; t * h];
            for r in 0..tp {
                let rk = r as u32;
                let w_gu = site(&ranks, Stage::WRank(RankedWeight::GateUp, rk));
                let want: Vec<f64> = (0..2 * ir)
                    .flat_map(|row| {
                        let (w, j) = if row < ir {
                            (&ffn.gate, r * ir + row)
                        } else {
                            (&ffn.up, r * ir + row - ir)
                        };
                        (0..h).map(move |c| f64::from(w[[j, c]]))
                    })
                    .collect();
                assert_eq!(w_gu, want, "w.gate_up.rank{r} at tp {tp}");
                let w_down = site(&ranks, Stage::WRank(RankedWeight::Down, rk));
                let down = &ffn.down;
                let want: Vec<f64> = (0..h)
                    .flat_map(|c| (r * ir..(r + 1) * ir).map(move |j| f64::from(down[[c, j]])))
                    .collect();
                assert_eq!(w_down, want, "w.down.rank{r} at tp {tp}");
                let gu = ranks.get(&Site::new(3, Stage::FfnGateUpRank(rk))).unwrap();
                assert_eq!(gu.shape, vec![t, 2 * ir]);
                let want: Vec<f64> = (0..t)
                    .flat_map(|ti| {
                        let cols = r * ir..(r + 1) * ir;
                        let (g, u) = (&g, &u);
                        cols.clone()
                            .map(move |j| g[ti * i + j])
                            .chain(cols.map(move |j| u[ti * i + j]))
                    })
                    .collect();
                assert_eq!(gu.to_f64(), want, "ffn_gate_up.rank{r} at tp {tp}");
                for (s, v) in sum.iter_mut().zip(site(&ranks, Stage::FfnDownRank(rk))) {
                    *s += v;
                }
            }
            for (k, (s, want)) in sum.iter().zip(&o).enumerate() {
                assert!(close(*s, *want, 10.0), "Σ ffn_down.rank at {k}, tp {tp}: {s} vs {want}");
            }
        }
        // No split: one rank, or a width the ranks cannot share.
        for tp in [1, 3] {
            assert!(
                ffn_rank_sites(3, &ffn.gate, &ffn.up, &ffn.down, &tr, tp, None)
                    .unwrap()
                    .entries()
                    .is_empty()
            );
        }
        // A layer whose MLP did not run has nothing to cut.
        assert!(
            ffn_rank_sites(3, &ffn.gate, &ffn.up, &ffn.down, &Trace::new(), 2, None)
                .unwrap()
                .entries()
                .is_empty()
        );
    }
}
