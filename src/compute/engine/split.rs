//! The `split-*` faults: a split-KV decode whose merge of the KV splits is wrong.
//!
//! vLLM's Triton MLA decode runs in two stages: stage 1 writes one partial state per KV split
//! (the split's softmax-weighted latent rows and its LSE) into a buffer, stage 2 merges the
//! partials by LSE. The merge bugs live between the two: partial LSEs in the wrong log base, a
//! split left out or counted twice, an empty split (a short row batched with a long one) merged
//! as if it had keys. Here stage 1 runs on the backend ([`Ops::decode_split`]), the fault edits
//! the partials where stage 2 reads them, as the buggy merge would see them, and the backend's
//! merge ([`Ops::merge`]) combines them; so the fault acts the same on every backend.

use super::*;
use crate::compute::faults::SplitFault;

/// [`Ops::decode_merged`] with the merge bug `fault`: stage 1 into canary-filled partials
/// `[splits, n, nh, L]` / `[splits, n, nh]`, the partials edited as the buggy merge reads them,
/// then [`Ops::merge`]. `seed` seeds the stale floats of [`SplitFault::EmptyStale`].
///
/// Errors: backend errors.
pub(super) fn decode_merged_faulted<O: Ops>(
    ops: &O,
    d: &DecodeArgs<'_, O::Buf>,
    fault: SplitFault,
    seed: u64,
) -> Result<(O::Buf, O::Buf)> {
    let (n, nh, splits, dv) = (d.n, d.nh, d.splits, d.dv);
    let mut parts = ops.canary(splits * n * nh * dv)?;
    let mut lses = ops.canary(splits * n * nh)?;
    ops.decode_split(d, &mut parts, &mut lses)?;
    let mut hp = ops.download(&parts)?;
    let mut hl = ops.download(&lses)?;
    // Split s of row i is empty when its ⌈ctx/splits⌉-key range starts at or past ctx.
    let empty = |s: usize, i: usize| {
        let c = d.ctx[i];
        let sl = c.div_ceil(splits);
        (s * sl).min(c) == ((s + 1) * sl).min(c)
    };
    let mut k = splits;
    match fault {
        SplitFault::LseBase2 => {
            for l in hl.iter_mut().filter(|l| l.is_finite()) {
                *l *= std::f32::consts::LOG2_E;
            }
        }
        SplitFault::DropLast => {
            // The merge reads only splits 0..splits-1.
            k = splits - 1;
            hp.truncate(k * n * nh * dv);
            hl.truncate(k * n * nh);
        }
        SplitFault::DuplicateFirst => {
            // Split 0 again as one more partial.
            hp.extend_from_within(..n * nh * dv);
            hl.extend_from_within(..n * nh);
            k = splits + 1;
        }
        SplitFault::EmptyZero | SplitFault::EmptyStale => {
            let stale = (fault == SplitFault::EmptyStale).then(|| stale_partials(&hp, &hl, seed));
            for s in 0..splits {
                for i in (0..n).filter(|&i| empty(s, i)) {
                    let rows = (s * n + i) * nh..(s * n + i + 1) * nh;
                    for r in rows {
                        let (o, l) = match &stale {
                            Some((so, sl)) => (&so[r * dv..(r + 1) * dv], sl[r]),
                            None => (&[][..], 0.0),
                        };
                        let out = &mut hp[r * dv..(r + 1) * dv];
                        if o.is_empty() {
                            out.fill(0.0);
                        } else {
                            out.copy_from_slice(o);
                        }
                        hl[r] = l;
                    }
                }
            }
        }
    }
    if k == 0 {
        // One split and it is lost: the merge of nothing (output 0, LSE −inf).
        hp = vec![0.0; n * nh * dv];
        hl = vec![f32::NEG_INFINITY; n * nh];
        k = 1;
    }
    let parts = ops.upload(&hp)?;
    let lses = ops.upload(&hl)?;
    ops.merge(&parts, &lses, k, n, nh, dv)
}

/// What a partial buffer reused from an earlier launch holds in every slot, for
/// [`SplitFault::EmptyStale`]: seeded normals with the mean and spread of this launch's finite
/// partial LSEs as LSEs, and with the RMS of its partial outputs as outputs (an earlier
/// launch's partials of similar rows, not these). `(outputs, lses)` in the layout of `parts`
/// and `lses`.
fn stale_partials(parts: &[f32], lses: &[f32], seed: u64) -> (Vec<f32>, Vec<f32>) {
    let finite: Vec<f64> = lses.iter().filter(|v| v.is_finite()).map(|&v| f64::from(v)).collect();
    let count = finite.len().max(1) as f64;
    let mean = finite.iter().sum::<f64>() / count;
    let sd = (finite.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / count)
        .sqrt()
        .max(0.5);
    let outs: Vec<f64> = parts.iter().filter(|v| v.is_finite()).map(|&v| f64::from(v)).collect();
    let rms = (outs.iter().map(|v| v * v).sum::<f64>() / outs.len().max(1) as f64).sqrt();
    let rms = if rms > 0.0 { rms } else { 1.0 };
    let l = crate::core::batch::normal_f32(seed ^ STALE_LSE_SEED, lses.len())
        .into_iter()
        .map(|v| (mean + f64::from(v) * sd) as f32)
        .collect();
    let o = crate::core::batch::normal_f32(seed ^ STALE_OUT_SEED, parts.len())
        .into_iter()
        .map(|v| (f64::from(v) * rms) as f32)
        .collect();
    (o, l)
}

/// Seeds of [`stale_partials`]: any fixed values (the fault must give the same bytes on every
/// backend and run).
const STALE_LSE_SEED: u64 = 0x5B1_7E15;
const STALE_OUT_SEED: u64 = 0x5B1_7007;
