//! The last detectors: a pure scale (`scale-only`), a bug one path has and another path does not
//! (`path-disagreement`), and the fallback that describes what no hypothesis explained
//! (`mismatch`).
//!
//! These name no rearrangement, so they run after every detector that does: a scale is only
//! claimed when the direction is right to the path's precision, and a disagreement between
//! paths only points at the path's own code. `mismatch` always returns a finding, with the
//! per-row errors that show, for instance, the signature of a wrong row stride.

use super::blocks::rel_l2;
use super::{Detection, SiteCtx, list};
use crate::core::sci::sci;
use crate::core::trace::Stage;
use crate::judge::metrics::Status;
use crate::judge::tolerance::tolerance;

/// The true cosine similarity of candidate and reference over the elements finite on both sides
/// (the metrics' cos_diff is not scale-blind, this is); 0 without metrics or with a zero norm.
pub(super) fn true_cosine(x: &SiteCtx<'_>) -> f64 {
    let Some(m) = x.diff.metrics.as_ref() else {
        return 0.0;
    };
    let (r, c) = (x.refr.to_f64(), x.cand.to_f64());
    let dot: f64 = r
        .iter()
        .zip(&c)
        .filter(|(a, b)| a.is_finite() && b.is_finite())
        .map(|(a, b)| a * b)
        .sum();
    if m.norm_ref > 0.0 && m.norm_cand > 0.0 {
        dot / (m.norm_ref * m.norm_cand)
    } else {
        0.0
    }
}

/// `scale-only`: the norm ratio is off while the direction is right to the path's precision;
/// names the factor when it is a known one (m, m², 1/ln 2, tp at `o_proj`, a residual-stream
/// scale at `hidden_in`/`hidden_out`).
pub(super) fn scale_only(x: &SiteCtx<'_>) -> Option<Detection> {
    let m = x.diff.metrics.as_ref()?;
    let (tol, _) = tolerance(x.site.stage, x.input.precision);
    if m.nonfinite_mismatch > 0 || (m.norm_ratio - 1.0).abs() <= tol.norm_ratio {
        return None;
    }
    let cos = true_cosine(x);
    // The direction must be as right as the path's precision allows: 1 − cos ≈ rel_l2² / 2.
    if 1.0 - cos > (tol.rel_l2 * tol.rel_l2).max(1e-10) {
        return None;
    }
    let cfg = x.input.cfg;
    let ratio = m.norm_ratio;
    // The residual stream between layers (a layer's input or output): an engine's deliberate
    // rescale that the dump does not declare, or one applied more often than intended.
    if matches!(x.site.stage, Stage::HiddenIn | Stage::HiddenOut) {
        let rsf = cfg
            .moe
            .as_ref()
            .map(|m| m.weights_scale)
            .filter(|&f| f > 0.0 && f != 1.0);
        let named = rsf
            .into_iter()
            .flat_map(|f| (1..=4).map(move |k| (f.powi(-k), k)))
            .find(|(f, _)| (ratio / f - 1.0).abs() < 2e-3)
            .map(|(f, k)| {
                let power = if k == 1 { String::new() } else { format!("^{k}") };
                format!(" (the ratio is {f:.4} = (1/routed_scaling_factor){power})")
            })
            .unwrap_or_default();
        return Some(Detection::new(
            format!(
                "cosine similarity 1 − {} (direction right) but norm ratio {ratio:.4}: the residual stream is scaled{named}",
                sci(1.0 - cos, 2)
            ),
            "a residual stream scaled on purpose (vLLM's fp16 path carries it × 1/routed_scaling_factor) must be declared as dump format 2's `conventions.residual_scale`, which compare divides out; an undeclared scale, or one applied again in every layer (vLLM #14809), is a bug between the layers".into(),
        ));
    }
    // At o_proj under TP, × tp is the o_proj all-reduce applied twice (SGLang #31699).
    let tp = x.input.tp as f64;
    let twice = (x.site.stage == Stage::OProj && x.input.tp >= 2).then_some((
        tp,
        "tp, the TP size: the o_proj all-reduce was applied twice (each rank reduced the already reduced sum again)",
    ));
    let named = twice.into_iter().chain([
        (
            cfg.mscale(),
            "the YaRN m(factor, mscale_all_dim): RoPE cos/sin must be scaled by m(factor, mscale)/m(factor, mscale_all_dim) = 1 for DeepSeek GGUFs, not by m",
        ),
        (cfg.mscale() * cfg.mscale(), "the YaRN m²"),
        (1.0 / std::f64::consts::LN_2, "1/ln 2 (a base-2 log)"),
    ]);
    let cause = named
        .into_iter()
        .find(|(f, _)| (f - 1.0).abs() > 1e-3 && (ratio / f - 1.0).abs() < 2e-3)
        .map(|(f, s)| format!("the ratio is {f:.4} = {s}"))
        .unwrap_or_else(|| "a constant factor multiplies this tensor".into());
    Some(Detection::new(
        format!(
            "cosine similarity 1 − {} (direction right) but norm ratio {ratio:.4}: a pure scale",
            sci(1.0 - cos, 2)
        ),
        cause,
    ))
}

/// `path-disagreement`: another path passes this same site, so the bug is in this path's code.
pub(super) fn path_disagreement(x: &SiteCtx<'_>) -> Option<Detection> {
    let others: Vec<String> = x
        .input
        .paths
        .iter()
        .filter(|p| p.kind != x.path.kind)
        .filter_map(|p| {
            p.diffs
                .iter()
                .find(|d| d.site == x.site)
                .filter(|d| d.status == Status::Pass)
                .map(|d| {
                    format!(
                        "{} (rel_l2 {})",
                        p.kind,
                        sci(d.metrics.as_ref().map_or(0.0, |m| m.rel_l2), 2)
                    )
                })
        })
        .collect();
    if others.is_empty() {
        return None;
    }
    Some(Detection::new(
        format!(
            "{} passes here but {} has rel_l2 {}",
            others.join(", "),
            x.path.kind,
            sci(x.as_is(), 2)
        ),
        format!(
            "the bug is specific to the {} path's code for this stage, not to the shared weights or inputs",
            x.path.kind
        ),
    ))
}

/// `mismatch`, the fallback: the error as is, the worst element, the pass fraction and which
/// rows are exact (only row 0 right is the signature of a wrong row stride).
pub(super) fn mismatch(x: &SiteCtx<'_>) -> Detection {
    let rows = x.refr.shape.first().copied().unwrap_or(1).max(1);
    let per = x.refr.len() / rows;
    let r = x.refr.to_f64();
    let c = x.cand.to_f64();
    let row_err: Vec<f64> = (0..rows)
        .map(|i| rel_l2(&c[i * per..(i + 1) * per], &r[i * per..(i + 1) * per]))
        .collect();
    let (tol, _) = tolerance(x.site.stage, x.input.precision);
    let ok: Vec<usize> = (0..rows).filter(|&i| row_err[i] <= tol.rel_l2.max(1e-6)).collect();
    let worst = x.diff.metrics.as_ref();
    let mut ev = format!("rel_l2 {}", sci(x.as_is(), 2));
    if let Some(m) = worst {
        ev.push_str(&format!(
            ", worst at {:?}: ref {} → cand {}; {:.1}% of elements within tolerance",
            m.max_abs_index,
            sci(m.max_abs_ref, 2),
            sci(m.max_abs_cand, 2),
            100.0 * m.pass_fraction
        ));
    }
    if !ok.is_empty() && ok.len() < rows {
        let bad_min = row_err
            .iter()
            .copied()
            .enumerate()
            .filter(|(i, _)| !ok.contains(i))
            .map(|(_, e)| e)
            .fold(f64::INFINITY, f64::min);
        ev.push_str(&format!(
            "; rows {} exact (rel ≤ {}), the other {} rows wrong (rel ≥ {})",
            list(&ok),
            sci(ok.iter().map(|&i| row_err[i]).fold(0.0, f64::max), 2),
            rows - ok.len(),
            sci(bad_min, 2)
        ));
    }
    let hint = if ok == [0] && rows > 1 {
        "row 0 right and later rows wrong is the signature of a wrong row stride (a strided view read as contiguous)"
            .to_string()
    } else {
        "no known bug class explains this; compare the stage's inputs, which passed, with its code".to_string()
    };
    let hint = match super::weights::mlp_blocks_without_tp(x) {
        Some(blocks) => format!("{hint}; {blocks}"),
        None => hint,
    };
    Detection::new(ev, hint)
}
