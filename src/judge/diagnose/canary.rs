//! The canary detectors: outputs never written (`phantom-output`), token rows never written
//! (`unwritten-rows`), and NaN/Inf where the reference is finite (`nonfinite`).
//!
//! Every path's output buffers start filled with the NaN canary (`core::canary`), so memory a
//! kernel never wrote is recognisable bit for bit, and still as a quieted NaN once arithmetic
//! has read it. A real engine's buffer holds no canary: `torch.empty` returns whatever an
//! earlier tensor left, finite and of any size. An attention output that was never written is
//! still recognisable there, because a written one is a convex combination of its value rows and
//! cannot leave their range. These detectors come first among the activation classes: a buffer
//! that was never written explains every other symptom at its site, and no numeric hypothesis
//! should be fitted to it.

use rayon::prelude::*;

use super::{Detection, SiteCtx, list};
use crate::compute::indexer;
use crate::core::sci::sci;
use crate::core::trace::{Site, Stage, TraceTensor};
use crate::judge::metrics::{self, Status, is_canary_like};
use crate::judge::tolerance::{hull_margin, tolerance};

/// `phantom-output`: every element still holds the canary (the buffer was never written), every
/// element is 0 while the reference is not (a zeroed buffer returned unwritten), or an attention
/// output holds values no attention computes ([`outside_hull`]: stale memory).
pub(super) fn phantom_output(x: &SiteCtx<'_>) -> Option<Detection> {
    let m = x.diff.metrics.as_ref()?;
    if m.numel > 0 && m.canary == m.numel {
        return Some(Detection::new(
            format!(
                "all {} elements still hold the canary (f32 bits 0x{:08X}): the output buffer was never written",
                m.numel,
                crate::core::canary::CANARY_BITS
            ),
            "the attention op wrote its result into a tensor the caller never reads; it must write the \
             caller-allocated `output` in place (vLLM custom op with mutates_args=[\"output\"])"
                .into(),
        ));
    }
    let all_zero = (0..x.cand.len()).all(|i| x.cand.get(i) == 0.0);
    if all_zero && m.norm_ref > 0.0 && !lse_computed_wrong(x) {
        return Some(Detection::new(
            format!("all {} elements are 0 while ‖ref‖ = {}", m.numel, sci(m.norm_ref, 2)),
            "an output buffer allocated with zeros was returned unwritten (the op's result went elsewhere)".into(),
        ));
    }
    outside_hull(x)
}

/// At an attention output (`attn_out`, `attn_latent`): the path's `lse` failed with values an
/// unwritten buffer does not hold (not all zero, no canary). Then a zero output was computed, not
/// left unwritten: attention over zero value rows (a read of never-written cache slots) is 0,
/// with an lse of ln(keys).
fn lse_computed_wrong(x: &SiteCtx<'_>) -> bool {
    if !matches!(x.site.stage, Stage::AttnOut | Stage::AttnLatent) {
        return false;
    }
    let lse = Site::new(x.site.layer, Stage::Lse);
    let failed = x.path.diffs.iter().any(|d| d.site == lse && d.status != Status::Pass);
    let unwritten =
        x.path.trace.get(&lse).is_none_or(|t| {
            (0..t.len()).all(|i| t.get(i) == 0.0) || (0..t.len()).any(|i| is_canary_like(t.get(i) as f32))
        });
    failed && !unwritten
}

/// (token, head) rows of an attention output the hull test reads at most from a spread sample,
/// besides every head of each sequence's first [`HULL_FIRST_TOKENS`] tokens: per row it reads
/// keys × width values, so the bound keeps the test far below the cost of the paths it judges
/// at any T, and a buffer of stale memory puts elements outside the hull on most rows.
const HULL_SAMPLE_ROWS: usize = 256;

/// The first tokens of each sequence whose every head the hull test reads: their few keys make
/// the narrowest hulls (a first token's output is its one value row), where stale values of any
/// size stand out.
const HULL_FIRST_TOKENS: usize = 4;

/// The rows attention averages for the output site of `x`, as the hull test reads them, and
/// which of the path's sites vouch for them: `attn_out` against the `v` rows [T, N, V] (the
/// candidate's own where they were compared and passed; else the reference's when the
/// candidate's `w.W_UV` passed beside its `attn_latent` or `kv_c_normed`, or its `w.kv_b`
/// beside its `kv_c_normed`), `attn_latent` against the candidate's `kv_c_normed` [T, L]
/// (shared by every head). `None` when nothing that passed vouches for them: then an output
/// outside their range may come from wrong value rows, not from unwritten memory.
fn value_rows<'a>(x: &'a SiteCtx<'_>) -> Option<(&'a TraceTensor, bool, String)> {
    let layer = x.site.layer;
    let passed = |st: Stage| {
        x.path
            .diffs
            .iter()
            .any(|d| d.site == Site::new(layer, st) && d.status == Status::Pass)
    };
    let own = |st: Stage| passed(st).then(|| x.path.trace.get(&Site::new(layer, st))).flatten();
    match x.site.stage {
        Stage::AttnOut => {
            if let Some(v) = own(Stage::V) {
                return Some((v, true, "v rows their token attends to".into()));
            }
            let vouched = [
                (Stage::WUv, Stage::AttnLatent),
                (Stage::WUv, Stage::KvCNormed),
                (Stage::WKvB, Stage::KvCNormed),
            ]
            .into_iter()
            .find(|&(w, a)| passed(w) && passed(a))?;
            let v = x.ref_site(Stage::V)?;
            Some((
                v,
                true,
                format!(
                    "v rows their token attends to (the reference's: the path's {} and {} passed)",
                    vouched.1.name(),
                    vouched.0.name()
                ),
            ))
        }
        Stage::AttnLatent => {
            own(Stage::KvCNormed).map(|kv| (kv, false, "kv_c_normed rows their token attends to".into()))
        }
        _ => None,
    }
}

/// `phantom-output` without a canary: an attention output (`attn_out`, `attn_latent`) is, per
/// head, a convex combination of the value rows of the keys its token attends to, so each of its
/// elements lies within those rows' range; elements outside it by more than the precision's
/// rounding ([`hull_margin`]) are what no attention computes: the caller's buffer holds stale
/// memory (a `torch.empty` that was never written). The keys are the token's causal prefix in
/// its sequence, or its DSA selection (the reference's and the path's together, so that a tie
/// flip is never counted); tokens that attend to an earlier step's cached rows, which no trace
/// holds, are left out. Not claimed where the path's `lse` failed (the attention weights
/// themselves are wrong: a merge, a scale or the keys) or where the output holds a non-finite
/// value, and a row in the reference's direction at another norm (a merge that scaled it) is
/// not counted, so that another class's divergence, convex or merely rescaled, is never called
/// unwritten memory.
fn outside_hull(x: &SiteCtx<'_>) -> Option<Detection> {
    if !matches!(x.site.stage, Stage::AttnOut | Stage::AttnLatent) {
        return None;
    }
    let m = x.diff.metrics.as_ref()?;
    let lse = Site::new(x.site.layer, Stage::Lse);
    if m.nonfinite_cand > 0 || x.path.diffs.iter().any(|d| d.site == lse && d.status != Status::Pass) {
        return None;
    }
    let (values, per_head, what) = value_rows(x)?;
    let cfg = x.input.cfg;
    let n = cfg.n_head;
    let t = *x.refr.shape.first()?;
    let width = x.refr.len() / (t * n).max(1);
    let value_len = if per_head { t * n * width } else { t * width };
    if t == 0 || x.cand.len() != t * n * width || values.len() != value_len || x.refr.len() != x.cand.len() {
        return None;
    }
    // Each token's keys: packed rows of its sequence.
    let keys_of = key_rows(x, t)?;
    let rows = hull_sample(x, &keys_of, n);
    if rows.is_empty() {
        return None;
    }
    let rms_ref = (m.norm_ref * m.norm_ref / m.numel.max(1) as f64).sqrt();
    let (tol, _) = tolerance(x.site.stage, x.input.precision);
    let value = |j: usize, h: usize, d: usize| {
        if per_head {
            values.get((j * n + h) * width + d)
        } else {
            values.get(j * width + d)
        }
    };
    let per_row: Vec<HullRow> = rows
        .par_iter()
        .map(|&row| {
            let (ti, h) = (row / n, row % n);
            let keys = &keys_of[ti];
            let c: Vec<f64> = (0..width).map(|d| x.cand.get(row * width + d)).collect();
            let r: Vec<f64> = (0..width).map(|d| x.refr.get(row * width + d)).collect();
            // A row pointing the reference's way at another norm is a rescaled output (a merge
            // that weighted its partials wrong), not memory the op never wrote.
            let dot: f64 = c.iter().zip(&r).map(|(a, b)| a * b).sum();
            let (nc, nr) = (
                c.iter().map(|a| a * a).sum::<f64>(),
                r.iter().map(|a| a * a).sum::<f64>(),
            );
            if nc > 0.0
                && nr > 0.0
                && dot / (nc * nr).sqrt() >= 1.0 - HULL_DIRECTION_KEPT
                && ((nc / nr).sqrt() - 1.0).abs() > tol.norm_ratio
            {
                return HullRow {
                    row,
                    outside: 0,
                    worst: None,
                };
            }
            // The range per element, key by key (each key's row is contiguous).
            let (mut lo, mut hi) = (vec![f64::INFINITY; width], vec![f64::NEG_INFINITY; width]);
            for &j in keys {
                for d in 0..width {
                    let vj = value(j, h, d);
                    lo[d] = lo[d].min(vj);
                    hi[d] = hi[d].max(vj);
                }
            }
            let mut outside = 0;
            let mut worst: Option<Outside> = None;
            for (d, &cd) in c.iter().enumerate() {
                let (lo, hi) = (lo[d], hi[d]);
                let margin = hull_margin(x.input.precision, rms_ref, lo.abs().max(hi.abs()));
                let excess = (lo - cd).max(cd - hi);
                if excess > margin {
                    outside += 1;
                    if worst.as_ref().is_none_or(|w| excess / margin > w.ratio) {
                        worst = Some(Outside {
                            d,
                            value: cd,
                            lo,
                            hi,
                            ratio: excess / margin,
                        });
                    }
                }
            }
            HullRow { row, outside, worst }
        })
        .collect();
    let outside: usize = per_row.iter().map(|r| r.outside).sum();
    let bad_rows: Vec<usize> = per_row.iter().filter(|r| r.outside > 0).map(|r| r.row).collect();
    if outside == 0 {
        return None;
    }
    let (row, worst) = per_row
        .iter()
        .filter_map(|r| r.worst.as_ref().map(|w| (r.row, w)))
        .max_by(|a, b| a.1.ratio.total_cmp(&b.1.ratio))?;
    let Outside {
        d, value: cd, lo, hi, ..
    } = *worst;
    let mut tokens: Vec<usize> = bad_rows.iter().map(|r| r / n).collect();
    tokens.dedup();
    Some(Detection::new(
        format!(
            "{outside} of {} sampled elements ({} of {} (token, head) rows; tokens {}) lie outside the range of \
             the {what}, by more than the {} rounding; worst: token {}, head {}, \
             element {d} holds {} where the attended rows span [{}, {}]: an attention output is a convex \
             combination of its value rows, so these values were never computed by the attention",
            rows.len() * width,
            bad_rows.len(),
            rows.len(),
            list(&tokens),
            x.input.precision.name(),
            row / n,
            row % n,
            sci(cd, 3),
            sci(lo, 3),
            sci(hi, 3)
        ),
        "the caller's output buffer holds stale memory (what torch.empty returned): the attention op's \
         result never reached it; the op must write the caller-allocated `output` in place (vLLM custom op \
         with mutates_args=[\"output\"]), or the copy into it was dropped"
            .into(),
    ))
}

/// One sampled (token, head) row of the hull test: `token·N + head`, its elements outside the
/// range, and the one furthest out.
struct HullRow {
    row: usize,
    outside: usize,
    worst: Option<Outside>,
}

/// An element outside the range of its attended value rows: its index in the row, its value,
/// the range `[lo, hi]`, and how far out in units of the margin.
#[derive(Clone, Copy)]
struct Outside {
    d: usize,
    value: f64,
    lo: f64,
    hi: f64,
    ratio: f64,
}

/// The cosine above `1 − HULL_DIRECTION_KEPT` at which a row of an attention output whose norm
/// is off counts as the reference's direction rescaled (a merge that weighted its partials
/// wrong), and is left out of the hull count. Unwritten memory has no reason to point the
/// reference's way: independent values give cosines near 0.
const HULL_DIRECTION_KEPT: f64 = 1e-3;

/// Per token row of the trace (T of them), the packed rows of the keys it attends to: its
/// sequence's rows up to itself, or its DSA selection within its sequence (the reference's and the
/// path's `idx_topk` together). A token whose sequence attends to rows cached by an earlier step
/// ([`super::DumpScope::context`]) gets none. `None` when the batch does not cover the T rows.
fn key_rows(x: &SiteCtx<'_>, t: usize) -> Option<Vec<Vec<usize>>> {
    let batch = x.input.batch;
    if batch.n_tokens() != t {
        return None;
    }
    let sets = |tr: &crate::core::trace::Trace| {
        tr.get(&Site::new(x.site.layer, Stage::IdxTopk)).map(|s| {
            let k = s.shape.last().copied().unwrap_or(0);
            indexer::topk_sets(&s.to_f64(), k)
        })
    };
    let (sel_ref, sel_cand) = (sets(x.input.reference), sets(x.path.trace));
    let context = x.input.dump.map_or(&[][..], |d| d.context);
    let mut out = Vec::with_capacity(t);
    for ((si, sq), off) in batch.seqs.iter().enumerate().zip(batch.offsets()) {
        let cached = context.get(si).copied().unwrap_or(0) > 0;
        for i in 0..sq.len {
            let ti = off + i;
            if cached {
                out.push(Vec::new());
                continue;
            }
            let keys: Vec<usize> = match &sel_ref {
                Some(r) => {
                    let mut k: Vec<usize> = r.get(ti).into_iter().flatten().copied().collect();
                    if let Some(c) = sel_cand.as_ref().and_then(|c| c.get(ti)) {
                        k.extend(c.iter().copied());
                    }
                    k.sort_unstable();
                    k.dedup();
                    k.into_iter().filter(|&j| j <= i).map(|j| off + j).collect()
                }
                None => (off..=ti).collect(),
            };
            out.push(keys);
        }
    }
    Some(out)
}

/// The (token, head) rows the hull test reads, as `token·N + head`: every head of each
/// sequence's first [`HULL_FIRST_TOKENS`] tokens (at most [`HULL_SAMPLE_ROWS`]·4 rows), then up
/// to [`HULL_SAMPLE_ROWS`] rows spread over all tokens with a head stepped by a stride coprime
/// with most head counts; tokens without keys are skipped.
fn hull_sample(x: &SiteCtx<'_>, keys_of: &[Vec<usize>], n: usize) -> Vec<usize> {
    let t = keys_of.len();
    let mut rows = Vec::new();
    for (sq, off) in x.input.batch.seqs.iter().zip(x.input.batch.offsets()) {
        for ti in off..off + sq.len.min(HULL_FIRST_TOKENS) {
            if rows.len() + n > 4 * HULL_SAMPLE_ROWS {
                break;
            }
            if !keys_of[ti].is_empty() {
                rows.extend((0..n).map(|h| ti * n + h));
            }
        }
    }
    if t * n <= HULL_SAMPLE_ROWS {
        rows.extend((0..t * n).filter(|r| !keys_of[r / n].is_empty()));
    } else {
        rows.extend(
            (0..HULL_SAMPLE_ROWS)
                .map(|k| (k * t + t / 2) / HULL_SAMPLE_ROWS * n + (k * 37 + 11) % n)
                .filter(|r| !keys_of[r / n].is_empty()),
        );
    }
    rows.sort_unstable();
    rows.dedup();
    rows
}

/// Token rows (dim 0) holding at least one element that satisfies `bad`.
fn rows_where(t: &TraceTensor, bad: impl Fn(usize) -> bool) -> Vec<usize> {
    let rows = t.shape.first().copied().unwrap_or(0).max(1);
    let per = t.len() / rows;
    (0..rows).filter(|&r| (r * per..(r + 1) * per).any(&bad)).collect()
}

/// `unwritten-rows`: some, not all, elements hold the canary, exact or quieted by arithmetic;
/// names the token rows. Not claimed when only quieted canaries appear and the same rows' LSE is
/// a computed NaN: a merge consumed an unwritten partial, which is `lse-merge`.
pub(super) fn unwritten_rows(x: &SiteCtx<'_>) -> Option<Detection> {
    let m = x.diff.metrics.as_ref()?;
    let cf = x.cand.f32_data()?;
    if m.canary == 0 || m.canary == m.numel {
        return None;
    }
    let exact = cf
        .iter()
        .filter(|v| v.to_bits() == crate::core::canary::CANARY_BITS)
        .count();
    let rows = rows_where(x.cand, |i| is_canary_like(cf[i]));
    if exact == 0 && x.site.stage != Stage::Lse {
        // Only quieted canaries: unwritten memory was read by arithmetic. If the same rows'
        // LSE is a computed (non-canary) NaN, a merge used an unwritten partial because its
        // sentinel was wrong: that is an LSE-merge bug, not an unwritten output.
        if let Some(lse) = x
            .path
            .trace
            .get(&Site::new(x.site.layer, Stage::Lse))
            .and_then(|t| t.f32_data())
        {
            let per = lse.len() / x.cand.shape[0].max(1);
            let merge_nan = rows.iter().any(|&r| {
                lse[r * per..(r + 1) * per]
                    .iter()
                    .any(|v| v.is_nan() && !is_canary_like(*v))
            });
            if merge_nan {
                return None;
            }
        }
    }
    Some(Detection::new(
        format!(
            "{} of {} elements hold the canary ({} exact, {} quieted by arithmetic) in token rows {}",
            m.canary,
            m.numel,
            exact,
            m.canary - exact,
            list(&rows)
        ),
        "rows were skipped instead of written: a row with no keys in a context chunk must still get \
         output 0 and LSE −inf (or be excluded from the merge)"
            .into(),
    ))
}

/// `nonfinite`: NaN/Inf where the reference is finite, with the count and the first index.
pub(super) fn nonfinite(x: &SiteCtx<'_>) -> Option<Detection> {
    let m = x.diff.metrics.as_ref()?;
    if m.nonfinite_mismatch == 0 {
        return None;
    }
    let idx = m
        .first_nonfinite_mismatch
        .map(|i| metrics::unravel(i, &x.refr.shape))
        .unwrap_or_default();
    Some(Detection::new(
        format!(
            "{} elements are NaN/Inf where the reference is finite ({} non-finite in all); first at {:?}",
            m.nonfinite_mismatch, m.nonfinite_cand, idx
        ),
        "look for an exp without max subtraction, a division by a zero sum, or reads of uninitialised memory".into(),
    ))
}
