//! The canary detectors: outputs never written (`phantom-output`), token rows never written
//! (`unwritten-rows`), and NaN/Inf where the reference is finite (`nonfinite`).
//!
//! Every path's output buffers start filled with the NaN canary (`core::canary`), so memory a
//! kernel never wrote is recognisable bit for bit, and still as a quieted NaN once arithmetic
//! has read it. These detectors come first among the activation classes: a buffer that was
//! never written explains every other symptom at its site, and no numeric hypothesis should be
//! fitted to it.

use super::{Detection, SiteCtx, list};
use crate::core::sci::sci;
use crate::core::trace::{Site, Stage, TraceTensor};
use crate::judge::metrics::{self, is_canary_like};

/// `phantom-output`: every element still holds the canary (the buffer was never written), or
/// every element is 0 while the reference is not (a zeroed buffer returned unwritten).
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
    if all_zero && m.norm_ref > 0.0 {
        return Some(Detection::new(
            format!("all {} elements are 0 while ‖ref‖ = {}", m.numel, sci(m.norm_ref, 2)),
            "an output buffer allocated with zeros was returned unwritten (the op's result went elsewhere)".into(),
        ));
    }
    None
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
