//! The attention detectors: a wrong softmax scale (`softmax-scale`) and a wrong merge of
//! partial attention states (`lse-merge`, base-2 LSEs merged as natural logs included).
//!
//! Both leave every input of attention right and bend only its output, so they can only be told
//! apart by recomputing attention from the reference's inputs under each hypothesis
//! ([`AttnRecompute`]): with the logits scaled by a fitted factor, or with each row's context
//! cut into partials merged by a wrong rule (the split-KV decode replay of `split.rs`, then
//! two partials whose LSEs are in base 2). The recomputation runs on a sample of (token, head)
//! rows, which keeps the detectors cheaper than the paths they judge at any T.

use std::collections::BTreeSet;

use rayon::prelude::*;

use super::blocks::rel_l2;
use super::fallback::true_cosine;
use super::{Detection, SiteCtx, explain_threshold, list};
use crate::compute::indexer;
use crate::core::sci::sci;
use crate::core::trace::{Site, Stage, TraceTensor};
use crate::judge::tolerance::tolerance;

/// (token, head) rows the softmax-scale hypothesis is tested on, at most: the recomputation
/// costs rows × keys × width per trial scale, and about 70 trial scales run, so a bound on the
/// rows keeps the detector below the cost of the paths it judges at any T (a wrong scale moves
/// every row, so a spread sample shows it as clearly as the whole tensor).
const SCALE_SAMPLE_ROWS: usize = 96;

/// Reference attention recomputed with the logit scale multiplied by `c`, for the stage asked
/// (`lse` \[T,N], `attn_latent` \[T,N,L] or `attn_out` \[T,N,V]), on a spread sample of at most
/// [`SCALE_SAMPLE_ROWS`] (token, head) rows, or on rows the caller names. `None` if an input is
/// missing.
///
/// The keys are those the row's token attended to: its sequence's positions up to its own (or
/// the DSA selection), read from the reference of the whole step when the token is a decode
/// step's row of a dump whose earlier steps cached context ([`super::DumpScope`]), else from
/// the reference of the judged rows.
pub(super) struct AttnRecompute {
    /// Per sampled row: its flat (token·N + head) index, the raw logits `q·k` (unscaled) over
    /// its visible keys, and the key rows (rows of [`AttnRecompute::values`]' source).
    pub(super) sampled_rows: Vec<(usize, Vec<f64>, Vec<usize>)>,
    /// Rows that are averaged: kv_c_normed [Tk, L] (latent) or v [Tk, N, V], Tk the key rows.
    pub(super) values: Vec<f64>,
    pub(super) width: usize,
    pub(super) per_head_values: bool,
    pub(super) n: usize,
    pub(super) scale: f64,
}

/// Where the keys of the judged rows are: the trace that holds them and, per judged token, the
/// row of its sequence's position 0 in that trace and its own position.
struct KeyRows<'a> {
    trace: &'a crate::core::trace::Trace,
    first: Vec<usize>,
    pos: Vec<usize>,
}

impl<'a> KeyRows<'a> {
    /// The reference of the whole step when the dump says the judged rows attended to cached
    /// context ([`super::DumpScope::full_reference`]), else the judged reference.
    fn of(x: &SiteCtx<'a>) -> Self {
        let batch = x.input.batch;
        let full = x.input.dump.and_then(|d| {
            let ctx = d.context;
            (ctx.len() == batch.seqs.len() && ctx.iter().any(|&c| c > 0))
                .then_some(())
                .and(d.full_reference)
                .map(|t| (t, ctx))
        });
        let (mut first, mut pos) = (Vec::new(), Vec::new());
        match full {
            Some((trace, ctx)) => {
                let mut start = 0;
                for (sq, &c) in batch.seqs.iter().zip(ctx) {
                    for i in 0..sq.len {
                        first.push(start);
                        pos.push(c + i);
                    }
                    start += c + sq.len;
                }
                KeyRows { trace, first, pos }
            }
            None => {
                for (sq, off) in batch.seqs.iter().zip(batch.offsets()) {
                    for i in 0..sq.len {
                        first.push(off);
                        pos.push(i);
                    }
                }
                KeyRows {
                    trace: x.input.reference,
                    first,
                    pos,
                }
            }
        }
    }

    fn site(&self, x: &SiteCtx<'_>, stage: Stage) -> Option<&'a TraceTensor> {
        self.trace.get(&Site::new(x.site.layer, stage))
    }
}

/// `count` (token, head) rows spread over `tokens` tokens of `n` heads each: tokens evenly
/// spread, heads stepped by a stride coprime with most head counts, so the sample does not sit
/// on one head when tokens/count is a multiple of N; every row when there are no more than
/// `count`.
pub(super) fn spread_rows(tokens: usize, n: usize, count: usize) -> Vec<usize> {
    let rows = tokens * n;
    if rows <= count {
        return (0..rows).collect();
    }
    (0..count)
        .map(|k| {
            let ti = (k * tokens + tokens / 2) / count;
            ti * n + (k * 37 + 11) % n
        })
        .collect()
}

impl AttnRecompute {
    fn build(x: &SiteCtx<'_>) -> Option<Self> {
        Self::build_for(x, x.site.stage)
    }

    /// [`AttnRecompute::build`] for `stage` (of the same layer) instead of the failing site's.
    fn build_for(x: &SiteCtx<'_>, stage: Stage) -> Option<Self> {
        let t = x.input.batch.n_tokens();
        Self::build_rows(x, stage, spread_rows(t, x.input.cfg.n_head, SCALE_SAMPLE_ROWS))
    }

    /// [`AttnRecompute::build_for`] on the (token·N + head) rows `sample`.
    pub(super) fn build_rows(x: &SiteCtx<'_>, stage: Stage, sample: Vec<usize>) -> Option<Self> {
        let cfg = x.input.cfg;
        let [n, l, p, r, v] = cfg.dims().nlprv();
        let keys = KeyRows::of(x);
        let q = x.ref_site(Stage::Q)?;
        let qpe = x.ref_site(Stage::QPeRoped)?;
        let kn = keys.site(x, Stage::KNope)?;
        let kpe = keys.site(x, Stage::KPeRoped)?;
        let (values, width, per_head_values) = match stage {
            Stage::AttnLatent => (keys.site(x, Stage::KvCNormed)?.to_f64(), l, false),
            Stage::AttnOut => (keys.site(x, Stage::V)?.to_f64(), v, true),
            Stage::Lse => (Vec::new(), 0, false),
            _ => return None,
        };
        // DSA models attend over the indexer's selection (positions in the sequence), which the
        // reference recorded.
        let sel = x.ref_site(Stage::IdxTopk).map(|t| {
            let k = t.shape.last().copied().unwrap_or(0);
            indexer::topk_sets(&t.to_f64(), k)
        });
        let t = keys.first.len();
        let key_rows = kpe.len() / r.max(1);
        if sample.iter().any(|&row| row / n.max(1) >= t) {
            return None;
        }
        let sampled_rows = sample
            .par_iter()
            .map(|&row| {
                let (ti, h) = (row / n, row % n);
                let (first, pos) = (keys.first[ti], keys.pos[ti]);
                let mut kr: Vec<usize> = match &sel {
                    Some(sel) => sel
                        .get(ti)
                        .map_or(Vec::new(), |v| v.iter().map(|&j| first + j).collect()),
                    None => (first..=first + pos).collect(),
                };
                kr.retain(|&k| k < key_rows);
                let z = kr
                    .iter()
                    .map(|&tj| {
                        let a: f64 = (0..p)
                            .map(|d| q.get((ti * n + h) * (p + r) + d) * kn.get((tj * n + h) * p + d))
                            .sum();
                        let b: f64 = (0..r)
                            .map(|d| qpe.get((ti * n + h) * r + d) * kpe.get(tj * r + d))
                            .sum();
                        a + b
                    })
                    .collect();
                (row, z, kr)
            })
            .collect();
        Some(AttnRecompute {
            sampled_rows,
            values,
            width,
            per_head_values,
            n,
            scale: cfg.softmax_scale,
        })
    }

    /// The value row of key row `tj` for head `h`.
    pub(super) fn value(&self, tj: usize, h: usize) -> &[f64] {
        let base = if self.per_head_values {
            (tj * self.n + h) * self.width
        } else {
            tj * self.width
        };
        &self.values[base..base + self.width]
    }

    /// The sampled rows of `t` (a [T, N, width] or [T, N] tensor), in sample order.
    pub(super) fn sampled(&self, t: &TraceTensor) -> Vec<f64> {
        let w = self.width.max(1);
        self.sampled_rows
            .iter()
            .flat_map(|(row, _, _)| (row * w..(row + 1) * w).map(|i| t.get(i)))
            .collect()
    }

    /// The sampled rows recomputed with the logit scale times `c`.
    fn eval(&self, c: f64) -> Vec<f64> {
        let per_row: Vec<Vec<f64>> = self
            .sampled_rows
            .par_iter()
            .map(|(row, z, keys)| {
                let h = row % self.n;
                let s: Vec<f64> = z.iter().map(|v| v * self.scale * c).collect();
                let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
                let sum: f64 = e.iter().sum();
                if self.width == 0 {
                    return vec![m + sum.ln()];
                }
                let mut o = vec![0f64; self.width];
                for (ej, &tj) in e.iter().zip(keys) {
                    let base = if self.per_head_values {
                        (tj * self.n + h) * self.width
                    } else {
                        tj * self.width
                    };
                    for d in 0..self.width {
                        o[d] += ej / sum * self.values[base + d];
                    }
                }
                o
            })
            .collect();
        per_row.concat()
    }
}

/// What a logit scale `c` says of the fp8 decode query the path declares: a kernel that takes an
/// fp8 query descales its logits by q_scale, so a query that reached it unscaled reads
/// ×q_scale, one divided twice ×1/q_scale. Within 2 % (the fp8 query's rounding differs
/// between the two sides); `None` without a declared q_scale other than 1, or for another `c`.
pub(super) fn query_scale_cause(x: &SiteCtx<'_>, c: f64) -> Option<String> {
    let q = x
        .path
        .paged
        .and_then(|p| p.cache_quant)
        .and_then(|q| q.query)
        .filter(|&q| q != 1.0)?;
    if (c / q - 1.0).abs() < 2e-2 {
        Some(format!(
            "×q_scale = {q}: the fp8 decode query reached the kernel unscaled (cast to fp8 without the division by \
             q_scale, or not quantized) while the kernel multiplies by q_scale"
        ))
    } else if (c * q - 1.0).abs() < 2e-2 {
        Some(format!(
            "×1/q_scale (q_scale {q}): the fp8 decode query divided by q_scale and not descaled by the kernel, or \
             divided twice"
        ))
    } else {
        None
    }
}

/// The logit scale `c` (from ×0.1 to ×10: a coarse log grid, then golden-section refinement)
/// whose recomputation is nearest the candidate on `recompute`'s rows, with its rel_l2, when it
/// explains them (within `x.explain`, below the error as is, `c` ≠ 1).
fn fitted_scale(x: &SiteCtx<'_>, recompute: &AttnRecompute) -> Option<(f64, f64)> {
    let cand = recompute.sampled(x.cand);
    // The error as is, on the same rows the hypothesis is tested on.
    let as_is = rel_l2(&cand, &recompute.sampled(x.refr));
    let err = |c: f64| rel_l2(&cand, &recompute.eval(c));
    let grid: Vec<f64> = (0..=40)
        .map(|i| (0.1f64.ln() + i as f64 * (100f64.ln() / 40.0)).exp())
        .collect();
    let (mut best_c, mut best_e) = (1.0, err(1.0));
    for &c in &grid {
        let e = err(c);
        if e < best_e {
            best_c = c;
            best_e = e;
        }
    }
    let (mut a, mut b) = (best_c / 1.13, best_c * 1.13);
    let inv_phi = (5f64.sqrt() - 1.0) / 2.0;
    for _ in 0..30 {
        let c1 = b - inv_phi * (b - a);
        let c2 = a + inv_phi * (b - a);
        if err(c1) < err(c2) {
            b = c2;
        } else {
            a = c1;
        }
    }
    let c = (a + b) / 2.0;
    let e = err(c);
    (e <= x.explain && e < as_is && (c - 1.0).abs() > 1e-3).then_some((c, e))
}

/// `softmax-scale` at `lse`, `attn_latent`, `attn_out`: reference attention recomputed with the
/// logits times a fitted factor c explains the candidate; names c when it is a known mistake
/// (the YaRN m² missing, doubled or halved, the absorbed width's (L+R)^-0.5).
pub(super) fn softmax_scale(x: &SiteCtx<'_>) -> Option<Detection> {
    if !matches!(x.site.stage, Stage::Lse | Stage::AttnLatent | Stage::AttnOut) {
        return None;
    }
    let m = x.diff.metrics.as_ref()?;
    if m.nonfinite_mismatch > 0 {
        return None;
    }
    if x.cand.len() != x.refr.len() {
        return None;
    }
    let recompute = AttnRecompute::build(x)?;
    let (c, e) = fitted_scale(x, &recompute)?;
    let cfg = x.input.cfg;
    let msq = cfg.mscale() * cfg.mscale();
    let named = [
        (
            1.0 / msq,
            format!("the YaRN m² = {msq:.4} factor is missing from the softmax scale"),
        ),
        (msq, format!("the YaRN m² = {msq:.4} factor is applied twice")),
        (
            1.0 / cfg.mscale(),
            format!("only one m = {:.4} of the YaRN m² factor is applied", cfg.mscale()),
        ),
        (
            (cfg.qk_head_dim() as f64 / (cfg.kv_lora_rank + cfg.qk_rope_head_dim) as f64).sqrt(),
            format!(
                "the scale uses (L+R)^-0.5 = {}^-0.5 (the absorbed width) instead of (P+R)^-0.5",
                cfg.kv_lora_rank + cfg.qk_rope_head_dim
            ),
        ),
    ];
    let query_cause = query_scale_cause(x, c);
    let cause = named
        .iter()
        .filter(|(f, _)| (c / f - 1.0).abs() < 5e-3 && (f - 1.0).abs() > 1e-3)
        .map(|(_, s)| s.clone())
        .next()
        .or(query_cause)
        .unwrap_or_else(|| format!("the logits are scaled by ×{c:.4} relative to (P+R)^-0.5 · m²"));
    Some(Detection::new(
        format!(
            "a logit scale of ×{c:.4} explains {} ({})",
            x.site.stage.name(),
            x.vs_as_is(e)
        ),
        match cfg.yarn {
            Some(_) => format!(
                "{cause}; the right scale is (P+R)^-0.5 · m² = {:.6}, m = 0.1·mscale_all_dim·ln(factor) + 1 (DeepSeek-V2 \
                 with YaRN)",
                cfg.softmax_scale
            ),
            None => format!(
                "{cause}; the right scale is (P+R)^-0.5 = {:.6} (no YaRN: m = 1)",
                cfg.softmax_scale
            ),
        },
    ))
}

/// Token rows (dim 0) whose relative L2 error exceeds ten times the site's rel_l2 tolerance,
/// or that hold a non-finite value where the reference is finite: rows that are clearly wrong,
/// not merely noisy at the path's precision.
fn failing_rows(x: &SiteCtx<'_>) -> Vec<usize> {
    let (tol, _) = tolerance(x.site.stage, x.input.precision);
    let rows = x.refr.shape.first().copied().unwrap_or(1).max(1);
    let per = x.refr.len() / rows;
    let (r, c) = (x.refr.to_f64(), x.cand.to_f64());
    // A row's error is measured against its own norm, but never against less than the norm of a
    // typical row: rows near zero (an LSE over few keys, as in DSA's sparse attention) would
    // otherwise fail on rounding alone.
    let finite: Vec<f64> = r.iter().copied().filter(|v| v.is_finite()).collect();
    let rms = (finite.iter().map(|v| v * v).sum::<f64>() / finite.len().max(1) as f64).sqrt();
    let floor = rms * (per as f64).sqrt();
    (0..rows)
        .filter(|&i| {
            let (rr, cc) = (&r[i * per..(i + 1) * per], &c[i * per..(i + 1) * per]);
            let d = rr.iter().zip(cc).map(|(a, b)| (a - b) * (a - b)).sum::<f64>().sqrt();
            let n = rr.iter().map(|a| a * a).sum::<f64>().sqrt();
            rr.iter().zip(cc).any(|(a, b)| a.is_finite() != b.is_finite())
                || d / n.max(floor).max(f64::MIN_POSITIVE) > (10.0 * tol.rel_l2).max(1e-6)
        })
        .collect()
}

/// `lse-merge` at `lse`, `attn_latent`, `attn_out`: the wrong rows are exactly those that merged
/// an empty partial, or the LSE is in the wrong log base, or partials with base-2 LSEs were
/// merged as natural logs ([`base2_merge`]).
pub(super) fn lse_merge(x: &SiteCtx<'_>) -> Option<Detection> {
    if !matches!(x.site.stage, Stage::Lse | Stage::AttnLatent | Stage::AttnOut) {
        return None;
    }
    let hint_sentinel = "an empty partial (a split or context chunk with no keys) must carry LSE = −inf and \
                         contribute nothing to the merge; +inf (or a base-2 LSE) poisons it";
    if !(x.site.stage == Stage::AttnOut && x.path.trace.get(&Site::new(x.site.layer, Stage::AttnLatent)).is_some())
        && let Some(d) = super::split::split_merge(x)
    {
        return Some(d);
    }
    let bad = failing_rows(x);
    let empty: BTreeSet<usize> = x.path.empty_partial_rows.iter().copied().collect();
    if !bad.is_empty() && !empty.is_empty() && bad.iter().all(|r| empty.contains(r)) {
        return Some(Detection::new(
            format!(
                "the {} wrong token rows {} all merged an empty partial (an empty split or context chunk); the other {} rows pass",
                bad.len(),
                list(&bad),
                x.refr.shape[0] - bad.len()
            ),
            hint_sentinel.into(),
        ));
    }
    if x.site.stage == Stage::Lse {
        let m = x.diff.metrics.as_ref()?;
        // A scale moves cos_diff (1 − 2Σab/Σ(a²+b²) is not scale-blind): the direction is judged
        // by the true cosine, as right as the rows' precision allows.
        let (tol, _) = tolerance(x.site.stage, x.input.precision);
        let direction_right = 1.0 - true_cosine(x) <= (tol.rel_l2 * tol.rel_l2).max(1e-10);
        for (f, what) in [
            (1.0 / std::f64::consts::LN_2, "log2 (base-2 LSE)"),
            (std::f64::consts::LN_2, "a base-2 LSE read as natural log"),
        ] {
            if (m.norm_ratio / f - 1.0).abs() < 2e-3 && direction_right {
                return Some(Detection::new(
                    format!("LSE is the reference times {f:.4}: {what}"),
                    "merge states in one log base: natural log everywhere, or convert with ln 2".into(),
                ));
            }
        }
    }
    if x.site.stage == Stage::AttnOut && x.path.trace.get(&Site::new(x.site.layer, Stage::AttnLatent)).is_some() {
        // The merge happened on the latent; its output site judges it.
        return None;
    }
    base2_merge(x)
}

/// Natural log of `e^a + e^b`, exact for infinities.
fn log_add_exp(a: f64, b: f64) -> f64 {
    let m = a.max(b);
    if m == f64::NEG_INFINITY {
        return m;
    }
    m + ((a - m).exp() + (b - m).exp()).ln()
}

impl AttnRecompute {
    /// The sampled rows under "each row's context in one or two partials whose LSEs are in base
    /// 2, merged by the natural-log rule" (`M = ln(e^a + e^b)`, outputs weighted `e^(a−M)`,
    /// `e^(b−M)`, with `a`, `b` the partials' natural LSEs divided by ln 2): the split point of
    /// each row is the one whose merged LSE is nearest the candidate's LSE `cand_lse` [T, N]
    /// (no split: one partial, LSE/ln 2). Returns the merged outputs of the sampled rows (the
    /// LSEs when the recompute is for `lse`), their merged LSEs, and how many rows were split.
    fn base2_merge(&self, cand_lse: &TraceTensor) -> (Vec<f64>, Vec<f64>, usize) {
        let ln2 = std::f64::consts::LN_2;
        let per_row: Vec<(Vec<f64>, f64, bool)> = self
            .sampled_rows
            .par_iter()
            .map(|(row, z, keys)| {
                let h = row % self.n;
                let s: Vec<f64> = z.iter().map(|v| v * self.scale).collect();
                let nk = s.len();
                // pre[c] = LSE of keys [0, c), suf[c] = LSE of keys [c, nk).
                let mut pre = vec![f64::NEG_INFINITY; nk + 1];
                let mut suf = vec![f64::NEG_INFINITY; nk + 1];
                for c in 0..nk {
                    pre[c + 1] = log_add_exp(pre[c], s[c]);
                    suf[nk - 1 - c] = log_add_exp(suf[nk - c], s[nk - 1 - c]);
                }
                let want = cand_lse.get(*row);
                let merged = |c: usize| -> f64 {
                    if c == 0 || c == nk {
                        pre[nk] / ln2
                    } else {
                        log_add_exp(pre[c] / ln2, suf[c] / ln2)
                    }
                };
                let c = (0..nk.max(1))
                    .min_by(|&a, &b| (merged(a) - want).abs().total_cmp(&(merged(b) - want).abs()))
                    .unwrap_or(0);
                let lse = merged(c);
                if self.width == 0 {
                    return (vec![lse], lse, c > 0);
                }
                // Each partial's softmax over its own keys, weighted by e^(a−M) and e^(b−M).
                let mut o = vec![0f64; self.width];
                let parts: Vec<(std::ops::Range<usize>, f64, f64)> = if c == 0 {
                    vec![(0..nk, pre[nk], 1.0)]
                } else {
                    let (a, b) = (pre[c], suf[c]);
                    vec![(0..c, a, (a / ln2 - lse).exp()), (c..nk, b, (b / ln2 - lse).exp())]
                };
                for (range, part_lse, weight) in parts {
                    for j in range {
                        let pj = (s[j] - part_lse).exp() * weight;
                        let base = if self.per_head_values {
                            (keys[j] * self.n + h) * self.width
                        } else {
                            keys[j] * self.width
                        };
                        for (od, &vd) in o.iter_mut().zip(&self.values[base..base + self.width]) {
                            *od += pj * vd;
                        }
                    }
                }
                (o, lse, c > 0)
            })
            .collect();
        let split = per_row.iter().filter(|r| r.2).count();
        let lses = per_row.iter().map(|r| r.1).collect();
        (per_row.into_iter().flat_map(|r| r.0).collect(), lses, split)
    }
}

/// Partial attention states whose LSEs are in base 2 (FlashInfer's and TRT-LLM's MLA kernels by
/// default) merged by a natural-log merge (vLLM's `merge_attn_states`): the candidate's LSE picks
/// each sampled row's split point, and the merged output that split predicts, which nothing was
/// fitted to, must explain the output site (`attn_latent` or `attn_out`, the failing one or the
/// one that goes with a failing `lse`).
fn base2_merge(x: &SiteCtx<'_>) -> Option<Detection> {
    let layer = x.site.layer;
    let cand_of = |stage| x.path.trace.get(&Site::new(layer, stage));
    let out_stage = match x.site.stage {
        Stage::Lse => [Stage::AttnLatent, Stage::AttnOut]
            .into_iter()
            .find(|&st| cand_of(st).is_some() && x.ref_site(st).is_some())?,
        st => st,
    };
    let (cand_out, ref_out, cand_lse) = (cand_of(out_stage)?, x.ref_site(out_stage)?, cand_of(Stage::Lse)?);
    if cand_out.len() != ref_out.len() || cand_lse.len() != x.ref_site(Stage::Lse)?.len() {
        return None;
    }
    let recompute = AttnRecompute::build_for(x, out_stage)?;
    let (pred, pred_lse, split) = recompute.base2_merge(cand_lse);
    if split == 0 {
        return None;
    }
    let cand = recompute.sampled(cand_out);
    let as_is = rel_l2(&cand, &recompute.sampled(ref_out));
    let e = rel_l2(&cand, &pred);
    let lse_rows: Vec<f64> = recompute
        .sampled_rows
        .iter()
        .map(|(row, _, _)| cand_lse.get(*row))
        .collect();
    let e_lse = rel_l2(&lse_rows, &pred_lse);
    let explain = explain_threshold(out_stage, x.input.precision);
    let explain_lse = explain_threshold(Stage::Lse, x.input.precision);
    if e > explain || e >= as_is || e_lse > explain_lse {
        return None;
    }
    Some(Detection::new(
        format!(
            "{split} of {} sampled (token, head) rows are two partials over their context, each with a \
             base-2 LSE, merged as natural log; the rest one partial with a base-2 LSE: {} rel_l2 {} \
             (as is {}), lse {}",
            recompute.sampled_rows.len(),
            out_stage.name(),
            sci(e, 2),
            sci(as_is, 2),
            sci(e_lse, 2)
        ),
        "a kernel returned its LSE in base 2 (FlashInfer's and TRT-LLM's MLA kernels do by default) and \
         a natural-log merge combined the partials: multiply the LSE by ln 2 before the merge, or ask \
         the kernel for natural-log LSEs"
            .into(),
    ))
}
