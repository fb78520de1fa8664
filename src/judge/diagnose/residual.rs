//! `residual-scale`: the residual stream scaled where a layer adds its branches to it.
//!
//! A layer computes `h1 = hidden_in + o_proj` and `hidden_out = h1 + FFN(RMSNorm(h1))`. An
//! engine that rescales its stream (vLLM's fp16 path carries it × 1/routed_scaling_factor) and
//! applies the rescale in the wrong place multiplies the residual alone, `h1 = α·hidden_in +
//! o_proj` (vLLM PR #14809: `residual *= 1/routed_scaling_factor` ran once per dense layer where
//! it belonged to layer 0 only), or `hidden_out = α·h1 + FFN output`. That is not a pure scale
//! of any site: the branches keep their size and the residual does not, so `scale-only` cannot
//! name it. The replay rebuilds the site from the candidate's own inputs, which passed
//! (`hidden_in`, `o_proj`, the FFN output), with α fitted: at `hidden_out` by least squares
//! (the site is linear in α), at `ffn_in` (`RMSNorm(α·hidden_in + o_proj)` with the norm's
//! weight read off the reference) by a one-dimensional search. A pure scale of the site that
//! explains it as well stays `scale-only`.

use super::blocks::rel_l2;
use super::{Detection, SiteCtx};
use crate::core::trace::{Site, Stage, TraceTensor};
use crate::judge::tolerance::{RESIDUAL_ALPHA_MARGIN, tolerance};

/// Token rows the `ffn_in` replay is fitted on, at most: each trial α renormalizes every
/// sampled row (H values), and about 90 trials run.
const FFN_IN_SAMPLE_ROWS: usize = 256;

/// Whether α is a rescale rather than noise around 1 ([`RESIDUAL_ALPHA_MARGIN`]).
fn rescaled(x: &SiteCtx<'_>, alpha: f64) -> bool {
    let tol = tolerance(x.site.stage, x.input.precision).0.rel_l2;
    (alpha - 1.0).abs() > (RESIDUAL_ALPHA_MARGIN.0 * tol).max(1e-3)
}

/// The candidate's tensor at `stage` of the failing layer where it holds one, else the
/// reference's (an input the candidate did not record is replayed from the reference's).
fn input<'a>(x: &'a SiteCtx<'_>, stage: Stage) -> Option<&'a TraceTensor> {
    let site = Site::new(x.site.layer, stage);
    x.path.trace.get(&site).or_else(|| x.input.reference.get(&site))
}

/// The FFN's output as `hidden_out` adds it: `ffn_out` times the branch scale of a dense layer,
/// or an MoE layer's `moe_out + shared_out`.
fn ffn_output(x: &SiteCtx<'_>, get: impl Fn(Stage) -> Option<Vec<f64>>) -> Option<Vec<f64>> {
    if let Some(f) = get(Stage::FfnOut) {
        let rs = x.input.cfg.residual_scale;
        return Some(f.into_iter().map(|v| v * rs).collect());
    }
    let mut m = get(Stage::MoeOut)?;
    if let Some(s) = get(Stage::SharedOut) {
        m.iter_mut().zip(s).for_each(|(a, b)| *a += b);
    }
    Some(m)
}

/// `(α, rel_l2)` of the least-squares fit `c ≈ b + α·r`.
fn fit_linear(c: &[f64], b: &[f64], r: &[f64]) -> (f64, f64) {
    let (mut num, mut den) = (0.0, 0.0);
    for ((ci, bi), ri) in c.iter().zip(b).zip(r) {
        num += (ci - bi) * ri;
        den += ri * ri;
    }
    let alpha = if den > 0.0 { num / den } else { 1.0 };
    let pred: Vec<f64> = b.iter().zip(r).map(|(bi, ri)| bi + alpha * ri).collect();
    (alpha, rel_l2(c, &pred))
}

/// What α is in the model's terms: `1/routed_scaling_factor^k` or `routed_scaling_factor^k`
/// (k = 1, 2) within 0.2%, or why none applies (the factor is the MoE configuration's
/// `expert_weights_scale`, which a model without MoE layers does not read).
fn alpha_named(x: &SiteCtx<'_>, alpha: f64) -> String {
    let Some(rsf) = x
        .input
        .cfg
        .moe
        .as_ref()
        .map(|m| m.weights_scale)
        .filter(|&f| f > 0.0 && f != 1.0)
    else {
        return "; not compared with routed_scaling_factor: the model has no MoE layer, whose configuration \
                carries it"
            .into();
    };
    let named = [
        (-1, "1/routed_scaling_factor"),
        (-2, "1/routed_scaling_factor²"),
        (1, "routed_scaling_factor"),
        (2, "routed_scaling_factor²"),
    ]
    .into_iter()
    .find(|&(k, _)| (alpha / rsf.powi(k) - 1.0).abs() < 2e-3);
    match named {
        Some((k, name)) => format!("; α = {name} = {:.4} (routed_scaling_factor {rsf})", rsf.powi(k)),
        None => format!("; α is no power of routed_scaling_factor = {rsf}"),
    }
}

/// Whether a pure scale of the reference explains the candidate as well as the residual fit
/// (`e` its error): then the site is `scale-only`'s, not this class's.
fn pure_scale_explains(x: &SiteCtx<'_>, c: &[f64], r: &[f64], e: f64) -> bool {
    let (mut num, mut den) = (0.0, 0.0);
    for (ci, ri) in c.iter().zip(r) {
        num += ci * ri;
        den += ri * ri;
    }
    let s = if den > 0.0 { num / den } else { 1.0 };
    let pred: Vec<f64> = r.iter().map(|v| v * s).collect();
    let es = rel_l2(c, &pred);
    es <= x.explain || es <= 2.0 * e
}

const HINT: &str = "the residual stream is scaled where the layer adds its branches to it (vLLM PR #14809: \
     `residual *= 1/routed_scaling_factor`, the fp16 overflow guard meant for layer 0, ran in every dense \
     layer): the residual add must be residual + branch; a stream the engine rescales on purpose is rescaled \
     as a whole (and declared in a dump as `conventions.residual_scale`)";

/// `residual-scale` at `hidden_out` (`hidden_out = α·h1 + FFN output` or `α·hidden_in + o_proj
/// + FFN output`, α by least squares) and at `ffn_in` (`RMSNorm(α·hidden_in + o_proj)`).
pub(super) fn residual_scale(x: &SiteCtx<'_>) -> Option<Detection> {
    let m = x.diff.metrics.as_ref()?;
    if m.nonfinite_mismatch > 0 || m.nonfinite_cand > 0 {
        return None;
    }
    match x.site.stage {
        Stage::HiddenOut => at_hidden_out(x),
        Stage::FfnIn => at_ffn_in(x),
        _ => None,
    }
}

fn at_hidden_out(x: &SiteCtx<'_>) -> Option<Detection> {
    let cand_of = |st| input(x, st).map(TraceTensor::to_f64);
    let ref_of = |st| x.ref_site(st).map(TraceTensor::to_f64);
    let rs = x.input.cfg.residual_scale;
    // The decomposition must rebuild the reference's own hidden_out (a layer whose output is
    // not h1 + FFN output as recorded, e.g. an MoE layer dumped without its MoE sites, is left
    // alone).
    let (hin_r, o_r, f_r, out_r) = (
        ref_of(Stage::HiddenIn)?,
        ref_of(Stage::OProj)?,
        ffn_output(x, ref_of)?,
        x.refr.to_f64(),
    );
    let rebuilt: Vec<f64> = (0..out_r.len()).map(|i| hin_r[i] + rs * o_r[i] + f_r[i]).collect();
    if out_r.len() != hin_r.len() || rel_l2(&out_r, &rebuilt) > 1e-6 {
        return None;
    }
    let (hin, o, f, c) = (
        cand_of(Stage::HiddenIn)?,
        cand_of(Stage::OProj)?,
        ffn_output(x, cand_of)?,
        x.cand.to_f64(),
    );
    if [hin.len(), o.len(), f.len()].iter().any(|&n| n != c.len()) {
        return None;
    }
    let h1: Vec<f64> = hin.iter().zip(&o).map(|(h, o)| h + rs * o).collect();
    let branches: Vec<f64> = o.iter().zip(&f).map(|(o, f)| rs * o + f).collect();
    // Where the residual is scaled: at the FFN's add (α·h1), or at attention's (α·hidden_in).
    let at_ffn = fit_linear(&c, &f, &h1);
    let at_attn = fit_linear(&c, &branches, &hin);
    let ((alpha, e), what) = if at_ffn.1 <= at_attn.1 {
        (
            at_ffn,
            "hidden_out = α·h1 + FFN output, h1 = hidden_in + o_proj (the residual at the FFN's add)",
        )
    } else {
        (
            at_attn,
            "hidden_out = α·hidden_in + o_proj + FFN output (the residual at attention's add)",
        )
    };
    if !(e <= x.explain && e < x.as_is() && rescaled(x, alpha)) || pure_scale_explains(x, &c, &out_r, e) {
        return None;
    }
    Some(Detection::new(
        format!(
            "{what}, the branches as recorded, with α = {alpha:.4} fitted by least squares over {} rows: {}{}",
            c.len() / x.input.cfg.hidden.max(1),
            x.vs_as_is(e),
            alpha_named(x, alpha)
        ),
        HINT.into(),
    ))
}

/// Per token row of `h` ([rows, H]): `h / sqrt(mean(h²) + eps)`.
fn normalized(h: &[f64], width: usize, eps: f64) -> Vec<f64> {
    h.chunks(width)
        .flat_map(|row| {
            let rms = (row.iter().map(|v| v * v).sum::<f64>() / width as f64 + eps).sqrt();
            row.iter().map(move |v| v / rms)
        })
        .collect()
}

fn at_ffn_in(x: &SiteCtx<'_>) -> Option<Detection> {
    let cfg = x.input.cfg;
    let (hd, rs, eps) = (cfg.hidden, cfg.residual_scale, cfg.rms_eps);
    let t = x.refr.len() / hd.max(1);
    if t == 0 || t * hd != x.refr.len() || x.cand.len() != x.refr.len() {
        return None;
    }
    let rows: Vec<usize> = if t <= FFN_IN_SAMPLE_ROWS {
        (0..t).collect()
    } else {
        (0..FFN_IN_SAMPLE_ROWS)
            .map(|k| (k * t + t / 2) / FFN_IN_SAMPLE_ROWS)
            .collect()
    };
    let take = |v: &TraceTensor| -> Option<Vec<f64>> {
        (v.len() == t * hd).then(|| {
            rows.iter()
                .flat_map(|&r| (0..hd).map(move |d| v.get(r * hd + d)))
                .collect()
        })
    };
    let (hin_r, o_r, ffn_in_r) = (
        take(x.ref_site(Stage::HiddenIn)?)?,
        take(x.ref_site(Stage::OProj)?)?,
        take(x.refr)?,
    );
    // The norm's weight, from the reference: ffn_in = w ⊙ u with u = h1 normalized, each w_d by
    // least squares over the rows.
    let h1_r: Vec<f64> = hin_r.iter().zip(&o_r).map(|(h, o)| h + rs * o).collect();
    let u = normalized(&h1_r, hd, eps);
    let w: Vec<f64> = (0..hd)
        .map(|d| {
            let (mut num, mut den) = (0.0, 0.0);
            for i in 0..rows.len() {
                num += ffn_in_r[i * hd + d] * u[i * hd + d];
                den += u[i * hd + d] * u[i * hd + d];
            }
            if den > 0.0 { num / den } else { 0.0 }
        })
        .collect();
    let replay = |h: &[f64], o: &[f64], alpha: f64| -> Vec<f64> {
        let h1: Vec<f64> = h.iter().zip(o).map(|(h, o)| alpha * h + rs * o).collect();
        normalized(&h1, hd, eps)
            .into_iter()
            .enumerate()
            .map(|(i, v)| v * w[i % hd])
            .collect()
    };
    // The weight must rebuild the reference's ffn_in from its own inputs.
    if rel_l2(&ffn_in_r, &replay(&hin_r, &o_r, 1.0)) > 1e-6 {
        return None;
    }
    let (hin, o, c) = (
        take(input(x, Stage::HiddenIn)?)?,
        take(input(x, Stage::OProj)?)?,
        take(x.cand)?,
    );
    let err = |alpha: f64| rel_l2(&c, &replay(&hin, &o, alpha));
    // Log grid over ×0.01 … ×100, then golden-section refinement around the best point.
    let (mut best_a, mut best_e) = (1.0, err(1.0));
    for i in 0..=60 {
        let a = (0.01f64.ln() + i as f64 * (1e4f64.ln() / 60.0)).exp();
        let e = err(a);
        if e < best_e {
            (best_a, best_e) = (a, e);
        }
    }
    let (mut lo, mut hi) = (best_a / 1.17, best_a * 1.17);
    let inv_phi = (5f64.sqrt() - 1.0) / 2.0;
    for _ in 0..40 {
        let (a1, a2) = (hi - inv_phi * (hi - lo), lo + inv_phi * (hi - lo));
        if err(a1) < err(a2) {
            hi = a2;
        } else {
            lo = a1;
        }
    }
    let alpha = (lo + hi) / 2.0;
    let e = err(alpha);
    let as_is = rel_l2(&c, &ffn_in_r);
    if !(e <= x.explain && e < as_is && rescaled(x, alpha)) || pure_scale_explains(x, &c, &ffn_in_r, e) {
        return None;
    }
    Some(Detection::new(
        format!(
            "ffn_in = RMSNorm(α·hidden_in + o_proj) (the residual at attention's add, hidden_in and o_proj as recorded), \
             with α = {alpha:.4} fitted over {} rows: rel_l2 {} vs {} as is{}",
            rows.len(),
            crate::core::sci::sci(e, 2),
            crate::core::sci::sci(as_is, 2),
            alpha_named(x, alpha)
        ),
        HINT.into(),
    ))
}
