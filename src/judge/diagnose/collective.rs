//! The detector of the TP all-reduce's bugs (`tp-reduce`): `o_proj` summed over the wrong ranks.
//!
//! Under TP, `o_proj` is the all-reduce of the ranks' row-parallel partials. A rank that skipped
//! the reduction (or contributed zeros) leaves `o_proj` equal to the sum of the other ranks'
//! partials; a rank that read its in-place buffer before the reduction finished holds its own
//! partial alone. Both are exact sums of the reference's per-rank partials (`o_proj.rank<r>`), so
//! each hypothesis is rebuilt from them and must explain the candidate as every detector's
//! alternative does. An all-reduce applied twice is a pure scale (× tp) and is named by
//! `scale-only`.

use super::{Detection, SiteCtx};
use crate::core::sci::sci;
use crate::core::trace::{Site, Stage};

/// `tp-reduce` at `o_proj`: the candidate equals the reference partials summed without one rank,
/// or one rank's partial alone. Names the rank; at tp = 2 the two readings coincide and the
/// evidence says so.
pub(super) fn tp_reduce(x: &SiteCtx<'_>) -> Option<Detection> {
    let tp = x.input.tp;
    if tp < 2 || x.site.stage != Stage::OProj {
        return None;
    }
    let parts: Vec<Vec<f64>> = (0..tp as u32)
        .map(|r| {
            x.input
                .reference
                .get(&Site::new(x.site.layer, Stage::OProjRank(r)))
                .map(|t| t.to_f64())
        })
        .collect::<Option<_>>()?;
    let n = parts[0].len();
    let sum_of = |ranks: &mut dyn Iterator<Item = usize>| -> Vec<f64> {
        let mut acc = vec![0f64; n];
        for r in ranks {
            acc.iter_mut().zip(&parts[r]).for_each(|(a, b)| *a += b);
        }
        acc
    };
    let mut best: Option<(f64, usize, bool)> = None;
    for r in 0..tp {
        // (rank, true): rank r missing from the sum; (rank, false): rank r's partial alone.
        for missing in [true, false] {
            if tp == 2 && !missing {
                continue; // the same values as "the other rank missing"
            }
            let alt = if missing {
                sum_of(&mut (0..tp).filter(|&s| s != r))
            } else {
                sum_of(&mut std::iter::once(r))
            };
            if let Some(e) = x.explained_by(&alt)
                && best.is_none_or(|(b, _, _)| e < b)
            {
                best = Some((e, r, missing));
            }
        }
    }
    let (e, r, missing) = best?;
    let as_is = sci(x.as_is(), 2);
    Some(if missing {
        let also = if tp == 2 {
            format!(" (at tp = 2 that is also rank {}'s partial alone)", 1 - r)
        } else {
            String::new()
        };
        Detection::new(
            format!(
                "o_proj equals the reference's o_proj partials of every rank but rank {r} (rel_l2 {} against {as_is} as is){also}: rank {r}'s partial is missing from the all-reduce",
                sci(e, 2)
            ),
            format!(
                "rank {r} skipped the o_proj all-reduce or contributed zeros (or, at tp = 2, the other rank read its buffer before the reduction finished): every rank must call the collective with its own partial on the same communicator, and read the output only after the reduction's stream is synchronized"
            ),
        )
    } else {
        Detection::new(
            format!(
                "o_proj equals rank {r}'s reference o_proj partial alone (rel_l2 {} against {as_is} as is): rank {r} read its buffer before the all-reduce finished",
                sci(e, 2)
            ),
            "an in-place all-reduce's output was read before the reduction completed (an asynchronous NCCL all-reduce on another stream without a wait): synchronize with the collective's stream before the residual add".into(),
        )
    })
}
