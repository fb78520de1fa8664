//! The last detectors: a pure scale (`scale-only`), a bug one path has and another path does not
//! (`path-disagreement`), and the fallback that describes what no hypothesis explained
//! (`mismatch`).
//!
//! These name no rearrangement, so they run after every detector that does: a scale is only
//! claimed when the direction is right to the path's precision, and a disagreement between
//! paths only points at the path's own code. `mismatch` always returns a finding, with the
//! per-row errors that show, for instance, the signature of a wrong row stride.

use super::blocks::rel_l2;
use super::{Detection, SiteCtx, gguf_sources, list};
use crate::core::sci::sci;
use crate::core::trace::{Site, Stage};
use crate::judge::metrics::Status;
use crate::judge::tolerance::tolerance;
use crate::model::dump::stage_inputs;

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
    let named_cause = named
        .into_iter()
        .find(|(f, _)| (f - 1.0).abs() > 1e-3 && (ratio / f - 1.0).abs() < 2e-3)
        .map(|(f, s)| format!("the ratio is {f:.4} = {s}"));
    // The decode query of a kernel that takes it in fp8 is recorded as the kernel reads it
    // (E4M3 × q_scale): a pure scale there is the quantizer's scale against the kernel's.
    let fp8_query = x
        .path
        .paged
        .and_then(|p| p.cache_quant)
        .and_then(|c| c.query)
        .filter(|_| x.site.stage == Stage::QlNope)
        .map(|q| {
            format!(
                "ql_nope as the fp8 decode kernel reads it (E4M3 × q_scale {q}): the query was quantized with {} the \
                 scale the kernel descales it by (descale_q), so every logit, the rope part too, is scaled alike: \
                 quantize and descale with the layer's one q_scale",
                if ratio < 1.0 {
                    format!("{:.4}×", 1.0 / ratio)
                } else {
                    format!("1/{ratio:.4} of")
                }
            )
        });
    let cause = named_cause
        .or(fp8_query)
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
        let stride = "row 0 right and later rows wrong is the signature of a wrong row stride (a strided view read as contiguous)";
        match unchecked(&inputs(x)) {
            Some(u) => format!("{stride}; {u}, so the stride may be theirs"),
            None => stride.to_string(),
        }
    } else {
        format!(
            "no known bug class explains this; {}{}",
            inputs_hint(x),
            head_subset_note(x)
        )
    };
    let hint = match super::weights::mlp_blocks_without_tp(x) {
        Some(blocks) => format!("{hint}; {blocks}"),
        None => hint,
    };
    Detection::new(ev, hint)
}

/// What a head subset hides from the detectors, for a per-head site of a dump that holds some
/// of the model's heads only: a view or stride across heads (a merge reading another head's
/// rows, a head interleaving) reads heads the dump leaves out, so no replay can check it.
fn head_subset_note(x: &SiteCtx<'_>) -> String {
    match x.input.dump.as_ref().and_then(|d| d.head_subset) {
        Some(([a, b], n)) if crate::model::dump::is_per_head(x.site.stage) => format!(
            "; the dump holds heads {a}..{b} of {n}: a view or stride across heads reads heads it leaves out, which no replay can check (record every head to have such a bug named)"
        ),
        _ => String::new(),
    }
}

/// The inputs of a failing site ([`stage_inputs`] that its layer's reference holds), by what
/// the comparison knows of them.
#[derive(Debug, Default)]
pub(super) struct Inputs {
    /// Compared, and within tolerance.
    pub(super) passed: Vec<Site>,
    /// Compared, and out of tolerance (an input after the first divergence cannot be one; kept
    /// so that no input is called passed without its verdict).
    pub(super) failed: Vec<Site>,
    /// Not in the judged trace, though the dump holds the stage in another step or layer: the
    /// hook writes it elsewhere and not here.
    pub(super) elsewhere: Vec<Site>,
    /// Not in the judged trace, nor anywhere in the dump.
    pub(super) absent: Vec<Site>,
}

/// True when the path computed attention in its absorbed form: its trace holds `ql_nope` or
/// `attn_latent` of the failing site's layer.
pub(super) fn absorbed(x: &SiteCtx<'_>) -> bool {
    [Stage::QlNope, Stage::AttnLatent]
        .iter()
        .any(|&st| x.path.trace.get(&Site::new(x.site.layer, st)).is_some())
}

/// The inputs of the failing site `x` and what the comparison knows of each.
pub(super) fn inputs(x: &SiteCtx<'_>) -> Inputs {
    let layer = x.site.layer;
    let mut out = Inputs::default();
    for stage in stage_inputs(x.site.stage, x.input.cfg, absorbed(x)) {
        let site = Site::new(layer, stage);
        if x.input.reference.get(&site).is_none() {
            continue;
        }
        match x.path.diffs.iter().find(|d| d.site == site) {
            Some(d) if d.status == Status::Pass => out.passed.push(site),
            Some(_) => out.failed.push(site),
            None if x.input.dump.is_some_and(|d| d.dumped.contains(&stage)) => out.elsewhere.push(site),
            None => out.absent.push(site),
        }
    }
    out
}

/// Sites as a hint names them: `` `L0.kv_a`, `L0.q` ``.
fn names<'a>(sites: impl IntoIterator<Item = &'a Site>) -> String {
    sites
        .into_iter()
        .map(|s| format!("`{s}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The inputs of `i` that were not compared, as a hint names them ("this stage's inputs `L0.x`
/// (the dump holds this stage in another step or layer, not in this one) and `L0.y` (not dumped)
/// were not compared"): those the hook writes elsewhere first. `None` when every input was
/// compared.
fn unchecked(i: &Inputs) -> Option<String> {
    let mut parts = Vec::new();
    if !i.elsewhere.is_empty() {
        parts.push(format!(
            "{} (the dump holds this stage in another step or layer, not in this one)",
            names(&i.elsewhere)
        ));
    }
    if !i.absent.is_empty() {
        parts.push(format!("{} (not dumped)", names(&i.absent)));
    }
    (!parts.is_empty()).then(|| format!("this stage's inputs {} were not compared", parts.join(" and ")))
}

/// Where to look after no hypothesis explained the failing site `x`, saying "passed" only of
/// inputs that were compared and passed: the inputs that were not compared come first (those
/// the hook writes in another step or layer but not in this one before those never dumped), as
/// the divergence may begin in them; a weight site points at its GGUF tensors, `hidden_in` at
/// the layer before.
pub(super) fn inputs_hint(x: &SiteCtx<'_>) -> String {
    let st = x.site.stage;
    let i = inputs(x);
    let mut checked = Vec::new();
    if !i.passed.is_empty() {
        checked.push(format!("{} passed", names(&i.passed)));
    }
    if !i.failed.is_empty() {
        checked.push(format!("{} failed too", names(&i.failed)));
    }
    if let Some(u) = unchecked(&i) {
        let also = if checked.is_empty() {
            String::new()
        } else {
            format!("; {}", checked.join(", "))
        };
        return format!("{u}, so the divergence may begin in them: dump them in this step{also}");
    }
    if !checked.is_empty() {
        return format!("its inputs {}: the bug is in this stage's own code", checked.join(", "));
    }
    if st.is_weight() {
        let src = gguf_sources(x.input.cfg, x.site.layer, st);
        let from = if src.is_empty() {
            "the GGUF".to_string()
        } else {
            src.iter().map(|s| format!("`{s}`")).collect::<Vec<_>>().join(" and ")
        };
        return format!("the weight is built from {from}, which both sides read: compare the engine's loader for it");
    }
    if st == Stage::HiddenIn && x.site.layer == 0 {
        return "layer 0's hidden_in is embed(tokens), before any engine code: the token ids the dump records, \
                or the embedding table (`token_embd`) the engine loaded, differ from what the reference read"
            .to_string();
    }
    if st == Stage::HiddenIn {
        return "hidden_in is the previous layer's output: dump that layer (its hidden_out) to see where the stream changed"
            .to_string();
    }
    "no input of this stage is among the compared sites: dump its inputs to tell its own code from theirs".to_string()
}
