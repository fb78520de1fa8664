//! The norm detector: an RMSNorm that was not applied (`norm-skipped`).
//!
//! A skipped norm leaves its input's direction per row and changes each row's scale by a
//! different factor (and drops the norm weight's per-column gain), so no scale or rearrangement
//! explains it, and it often hides in a site the hook never dumped: an engine whose latent
//! RMSNorm (`kv_a_layernorm`) is bypassed fails first at `k_nope`, `v` or the attention output
//! when `kv_c_normed` was not written. The hypothesis is replayed from the stage's own inputs:
//! at the norm's output site it is the norm's input as it is; downstream of a `kv_c_normed`
//! that was not compared, the un-normalized latent is carried through `kv_b_proj`, or through
//! attention in its absorbed form, on a sample of rows.

use rayon::prelude::*;

use super::blocks::rel_l2;
use super::fallback::inputs;
use super::{Detection, SiteCtx};
use crate::compute::indexer;
use crate::core::sci::sci;
use crate::core::trace::{Site, Stage, TraceTensor};
use crate::model::tensors::ModelTensor;

/// Token rows (`k_nope`, `v`) or (token, head) rows (attention) the downstream replay computes at
/// most: a skipped norm moves every row, so a spread sample shows it as the whole tensor does,
/// and the replay stays far below the cost of the paths it judges at any T.
const NORM_SAMPLE_ROWS: usize = 96;

/// The RMSNorms of a layer's attention: the site each one writes, the site it reads (and the
/// columns `0..width` of it that it normalizes), vLLM's module name and its GGUF weight.
struct Norm {
    out: Stage,
    input: Stage,
    module: &'static str,
    weight: ModelTensor,
}

const NORMS: [Norm; 3] = [
    Norm {
        out: Stage::AttnIn,
        input: Stage::HiddenIn,
        module: "input_layernorm (attn_norm)",
        weight: ModelTensor::AttnNorm,
    },
    Norm {
        out: Stage::QCNormed,
        input: Stage::QC,
        module: "q_a_layernorm",
        weight: ModelTensor::AttnQANorm,
    },
    Norm {
        out: Stage::KvCNormed,
        input: Stage::KvA,
        module: "kv_a_layernorm",
        weight: ModelTensor::AttnKvANorm,
    },
];

/// The hint of a norm `n` of layer `layer` that was not applied.
fn hint(n: &Norm, layer: usize) -> String {
    format!(
        "the RMSNorm {} (weight `{}`) was not applied: check that the engine calls it on this path (a fused \
         norm kernel bypassed, a branch that skips it, or a view of its input passed on instead of its output)",
        n.module,
        n.weight.name(layer)
    )
}

/// `norm-skipped`: the failing site equals the replay with one of the attention's RMSNorms not
/// applied. At a norm's output (`attn_in`, `q_c_normed`, `kv_c_normed`): its input's normalized
/// columns as they are (the input from the candidate where it was compared, else the
/// reference's). Downstream of a `kv_c_normed` that was not compared (`k_nope`, `v`,
/// `attn_latent`, `lse`, `attn_out`): the latent `kv_a[:, :L]` without the norm, through
/// `kv_b_proj` or through attention, on sampled rows.
pub(super) fn norm_skipped(x: &SiteCtx<'_>) -> Option<Detection> {
    let m = x.diff.metrics.as_ref()?;
    if m.nonfinite_mismatch > 0 {
        return None;
    }
    if let Some(n) = NORMS.iter().find(|n| n.out == x.site.stage) {
        let input = own_or_reference(x, n.input)?;
        let (rows, width) = (*x.refr.shape.first()?, x.refr.len() / x.refr.shape.first()?.max(&1));
        let in_width = input.len() / rows.max(1);
        if in_width < width || input.len() != rows * in_width {
            return None;
        }
        let alt: Vec<f64> = (0..rows)
            .flat_map(|i| (0..width).map(move |j| (i, j)))
            .map(|(i, j)| input.get(i * in_width + j))
            .collect();
        let e = x.explained_by(&alt)?;
        return Some(Detection::new(
            format!(
                "{} equals {}{} without the norm ({})",
                x.site.stage.name(),
                n.input.name(),
                if in_width > width {
                    format!("'s first {width} columns")
                } else {
                    String::new()
                },
                x.vs_as_is(e)
            ),
            hint(n, x.site.layer),
        ));
    }
    if !latent_not_compared(x) {
        return None;
    }
    let kv_c = raw_latent(x)?;
    let (e, as_is, rows) = match x.site.stage {
        Stage::KNope | Stage::V => replay_kv_b(x, &kv_c)?,
        Stage::AttnLatent | Stage::Lse | Stage::AttnOut => replay_attention(x, &kv_c)?,
        _ => return None,
    };
    if !(e <= x.explain && e < as_is) {
        return None;
    }
    Some(Detection::new(
        format!(
            "{} equals the replay with kv_a_layernorm skipped: kv_a's first {} columns, not normalized, carried \
             through {} on {rows} sampled rows (rel_l2 {} vs {} as is); kv_c_normed was not compared, so the \
             skipped norm shows first here",
            x.site.stage.name(),
            x.input.cfg.kv_lora_rank,
            if matches!(x.site.stage, Stage::KNope | Stage::V) {
                "kv_b_proj"
            } else {
                "attention (absorbed form)"
            },
            sci(e, 2),
            sci(as_is, 2)
        ),
        hint(&NORMS[2], x.site.layer),
    ))
}

/// True when the failing site reads the latent `kv_c_normed` (directly, or through `k_nope`/`v`
/// or `attn_latent`) and `kv_c_normed` itself was not compared here.
fn latent_not_compared(x: &SiteCtx<'_>) -> bool {
    if !matches!(
        x.site.stage,
        Stage::KNope | Stage::V | Stage::AttnLatent | Stage::Lse | Stage::AttnOut
    ) {
        return false;
    }
    let latent = Site::new(x.site.layer, Stage::KvCNormed);
    let compared = x.path.diffs.iter().any(|d| d.site == latent);
    // The expanded inputs (k_nope, v) or the absorbed one (attn_latent) passed, when compared, so
    // a divergence that starts at the latent shows first where neither was compared either.
    let i = inputs(x);
    !compared && i.failed.is_empty()
}

/// `stage` of the failing site's layer from the candidate where it holds it (compared, and
/// before the first divergence: passed), else from the reference.
fn own_or_reference<'a>(x: &'a SiteCtx<'_>, stage: Stage) -> Option<&'a TraceTensor> {
    let site = Site::new(x.site.layer, stage);
    x.path.trace.get(&site).or_else(|| x.input.reference.get(&site))
}

/// The latent as the engine has it with `kv_a_layernorm` skipped: `kv_a[:, :L]` [T, L], from the
/// candidate's `kv_a` where it holds it, else the reference's.
fn raw_latent(x: &SiteCtx<'_>) -> Option<Vec<f64>> {
    let kv_a = own_or_reference(x, Stage::KvA)?;
    let t = *kv_a.shape.first()?;
    let (l, r) = (x.input.cfg.kv_lora_rank, x.input.cfg.qk_rope_head_dim);
    if kv_a.len() != t * (l + r) {
        return None;
    }
    Some(
        (0..t)
            .flat_map(|i| (0..l).map(move |j| i * (l + r) + j))
            .map(|k| kv_a.get(k))
            .collect(),
    )
}

/// Up to [`NORM_SAMPLE_ROWS`] of `0..n`, evenly spread.
fn spread(n: usize) -> Vec<usize> {
    if n <= NORM_SAMPLE_ROWS {
        return (0..n).collect();
    }
    (0..NORM_SAMPLE_ROWS)
        .map(|k| (k * n + n / 2) / NORM_SAMPLE_ROWS)
        .collect()
}

/// `k_nope` or `v` [T, N, P|V] replayed from the raw latent `kv_c` through the reference's
/// `kv_b_proj` [N·(P+V), L] on sampled tokens: (rel_l2 of the candidate against the replay,
/// against the reference, sampled tokens).
fn replay_kv_b(x: &SiteCtx<'_>, kv_c: &[f64]) -> Option<(f64, f64, usize)> {
    let [n, l, p, _, v] = x.input.cfg.dims().nlprv();
    let kvb = x.ref_site(Stage::WKvB)?.to_f64();
    let (off, w) = if x.site.stage == Stage::KNope { (0, p) } else { (p, v) };
    let t = *x.refr.shape.first()?;
    if kvb.len() != n * (p + v) * l || x.refr.len() != t * n * w || kv_c.len() != t * l || x.cand.len() != x.refr.len()
    {
        return None;
    }
    let tokens = spread(t);
    let alt: Vec<f64> = tokens
        .par_iter()
        .flat_map_iter(|&ti| {
            let row = &kv_c[ti * l..(ti + 1) * l];
            let kvb = &kvb;
            (0..n).flat_map(move |h| {
                (0..w).map(move |d| {
                    let wr = &kvb[(h * (p + v) + off + d) * l..(h * (p + v) + off + d + 1) * l];
                    wr.iter().zip(row).map(|(a, b)| a * b).sum::<f64>()
                })
            })
        })
        .collect();
    let pick = |tr: &TraceTensor| -> Vec<f64> {
        tokens
            .iter()
            .flat_map(|&ti| (ti * n * w..(ti + 1) * n * w).map(|i| tr.get(i)))
            .collect()
    };
    let cand = pick(x.cand);
    Some((rel_l2(&cand, &alt), rel_l2(&cand, &pick(x.refr)), tokens.len()))
}

/// `attn_latent` [T, N, L], `lse` [T, N] or `attn_out` [T, N, V] replayed in attention's
/// absorbed form with the raw latent `kv_c` as the keys' and values' latent: logits
/// `(ql_nope·kv_c_j + q_pe·k_pe_j)·scale` over each token's keys (its sequence's causal prefix,
/// or its DSA selection), the softmax-weighted `kv_c` rows, then `W_UV` for `attn_out`, on
/// sampled (token, head) rows. Tokens that attend to an earlier step's cached rows are not
/// among the trace's rows and are left out. Returns (rel_l2 of the candidate against the replay,
/// against the reference, sampled rows).
fn replay_attention(x: &SiteCtx<'_>, kv_c: &[f64]) -> Option<(f64, f64, usize)> {
    let cfg = x.input.cfg;
    let [n, l, _, r, v] = cfg.dims().nlprv();
    let ql = x.ref_site(Stage::QlNope)?;
    let qpe = x.ref_site(Stage::QPeRoped)?;
    let kpe = x.ref_site(Stage::KPeRoped)?;
    let w_uv = (x.site.stage == Stage::AttnOut)
        .then(|| x.ref_site(Stage::WUv).map(|t| t.to_f64()))
        .flatten();
    let width = match x.site.stage {
        Stage::AttnLatent => l,
        Stage::Lse => 1,
        _ => {
            if w_uv.as_ref().is_none_or(|w| w.len() != n * l * v) {
                return None;
            }
            v
        }
    };
    let t = kv_c.len() / l.max(1);
    if x.cand.len() != t * n * width || x.refr.len() != x.cand.len() || ql.len() != t * n * l {
        return None;
    }
    let sel = x.ref_site(Stage::IdxTopk).map(|s| {
        let k = s.shape.last().copied().unwrap_or(0);
        indexer::topk_sets(&s.to_f64(), k)
    });
    let context = x.input.dump.map(|d| d.context).unwrap_or(&[]);
    let mut seq_start = Vec::with_capacity(t);
    let mut own_rows = Vec::with_capacity(t);
    for ((si, sq), off) in x.input.batch.seqs.iter().enumerate().zip(x.input.batch.offsets()) {
        let cached = context.get(si).copied().unwrap_or(0);
        for _ in 0..sq.len {
            seq_start.push(off);
            own_rows.push(cached == 0);
        }
    }
    if seq_start.len() != t {
        return None;
    }
    let eligible: Vec<usize> = (0..t).filter(|&ti| own_rows[ti]).collect();
    // Every (token, head) row when few; else tokens spread over the eligible ones, each with a
    // head stepped by a stride coprime with most head counts, so that the sample covers every
    // head.
    let sample: Vec<usize> = if eligible.len() * n <= NORM_SAMPLE_ROWS {
        eligible
            .iter()
            .flat_map(|&ti| (0..n).map(move |h| ti * n + h))
            .collect()
    } else {
        (0..NORM_SAMPLE_ROWS)
            .map(|k| eligible[k * eligible.len() / NORM_SAMPLE_ROWS] * n + (k * 37 + 11) % n)
            .collect()
    };
    if sample.is_empty() {
        return None;
    }
    let scale = cfg.softmax_scale;
    let alt: Vec<f64> = sample
        .par_iter()
        .flat_map_iter(|&row| {
            let (ti, h) = (row / n, row % n);
            let off = seq_start[ti];
            let keys: Vec<usize> = match &sel {
                Some(sel) => sel.get(ti).map_or(Vec::new(), |s| s.iter().map(|&j| off + j).collect()),
                None => (off..=ti).collect(),
            };
            let z: Vec<f64> = keys
                .iter()
                .map(|&j| {
                    let a: f64 = (0..l).map(|d| ql.get(row * l + d) * kv_c[j * l + d]).sum();
                    let b: f64 = (0..r).map(|d| qpe.get(row * r + d) * kpe.get(j * r + d)).sum();
                    (a + b) * scale
                })
                .collect();
            let mx = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = z.iter().map(|s| (s - mx).exp()).collect();
            let sum: f64 = e.iter().sum();
            if width == 1 {
                return vec![mx + sum.ln()];
            }
            let mut lat = vec![0f64; l];
            for (ej, &j) in e.iter().zip(&keys) {
                for (o, &c) in lat.iter_mut().zip(&kv_c[j * l..(j + 1) * l]) {
                    *o += ej / sum * c;
                }
            }
            match &w_uv {
                Some(w) if width == v => (0..v)
                    .map(|d| (0..l).map(|li| lat[li] * w[(h * l + li) * v + d]).sum())
                    .collect(),
                _ => lat,
            }
        })
        .collect();
    let pick = |tr: &TraceTensor| -> Vec<f64> {
        sample
            .iter()
            .flat_map(|&row| (row * width..(row + 1) * width).map(|i| tr.get(i)))
            .collect()
    };
    let cand = pick(x.cand);
    Some((rel_l2(&cand, &alt), rel_l2(&cand, &pick(x.refr)), sample.len()))
}
