//! The collectives of tensor parallelism, performed by per-rank participants.
//!
//! Under TP an engine's ranks meet at collectives: the row-parallel `o_proj` ends in an
//! all-reduce (sum) of the ranks' partial outputs, after which every rank holds the same
//! `[T, H]` tensor. Bugs live there too (an all-reduce applied twice, a rank left out of the
//! sum, a rank reading its buffer before the reduction finished), so the engine paths run their
//! all-reduce as such a collective, not as a host loop: here each rank is a thread that
//! publishes its partial, waits at a barrier for the others, and reduces. The sum runs in rank
//! order (`acc = p₀; acc += p₁; …`) in f32, the order and precision of one `Ops::add` per rank,
//! so a result is bit-identical to the sequential sum. NCCL, one rank per GPU, is the other
//! implementation (`crate::backend::cuda::nccl`); it sums in its own ring order, identical in
//! value only up to f32 rounding for three ranks or more.

use std::sync::{Barrier, OnceLock};

use crate::core::error::{Error, Result};

/// A bug in the all-reduce, injected at the participant that has it (docs/faults.md,
/// `all-reduce-*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceFault {
    /// The reduced tensor is all-reduced a second time: every rank holds `tp ×` the sum.
    Twice,
    /// Rank `r` contributes zeros instead of its partial (it skipped the reduction).
    SkipRank(usize),
    /// Rank `r` reads its in-place buffer before the reduction finished: its copy is its own
    /// partial; the other ranks' copies are correct.
    ReadEarly(usize),
}

/// Every rank's copy of the sum of `parts` (`parts[r]` is rank r's `[n]` partial, f32), computed
/// by one thread per rank that publishes its partial, waits for the others at a barrier, then
/// sums the published partials in rank order. `fault` acts inside the participant that has it.
///
/// Errors: [`Error::Internal`] for no rank, or partials of different lengths (a caller's shape
/// bug, never the user's input).
pub fn host_all_reduce_sum(parts: &[Vec<f32>], fault: Option<ReduceFault>) -> Result<Vec<Vec<f32>>> {
    let tp = parts.len();
    let n = parts
        .first()
        .map(Vec::len)
        .ok_or_else(|| Error::internal("all-reduce over no rank"))?;
    if let Some((r, p)) = parts.iter().enumerate().find(|(_, p)| p.len() != n) {
        return Err(Error::internal(format!(
            "all-reduce: rank {r} holds {} elements, rank 0 holds {n}",
            p.len()
        )));
    }
    let zeros = vec![
        0f32;
        if matches!(fault, Some(ReduceFault::SkipRank(_))) {
            n
        } else {
            0
        }
    ];
    let barrier = Barrier::new(tp);
    // Round 1 publishes the partials; round 2 (the `Twice` fault) the reduced copies.
    let sent: Vec<OnceLock<&[f32]>> = (0..tp).map(|_| OnceLock::new()).collect();
    let again: Vec<OnceLock<Vec<f32>>> = (0..tp).map(|_| OnceLock::new()).collect();
    let reduce = |slots: &mut dyn Iterator<Item = &[f32]>| -> Vec<f32> {
        let mut acc = slots.next().map(<[f32]>::to_vec).unwrap_or_default();
        for p in slots {
            acc.iter_mut().zip(p).for_each(|(a, &b)| *a += b);
        }
        acc
    };
    let participant = |rank: usize| -> Vec<f32> {
        let mine: &[f32] = match fault {
            Some(ReduceFault::SkipRank(r)) if r == rank => &zeros,
            _ => &parts[rank],
        };
        let _ = sent[rank].set(mine);
        // A rank that reads before the reduction finished sees its own partial still in its
        // (in-place) buffer.
        let early = matches!(fault, Some(ReduceFault::ReadEarly(r)) if r == rank).then(|| parts[rank].clone());
        barrier.wait();
        let sum = reduce(&mut sent.iter().map(|s| s.get().copied().unwrap_or(&[])));
        let sum = if fault == Some(ReduceFault::Twice) {
            let _ = again[rank].set(sum);
            barrier.wait();
            reduce(&mut again.iter().map(|s| s.get().map_or(&[][..], Vec::as_slice)))
        } else {
            sum
        };
        early.unwrap_or(sum)
    };
    Ok(std::thread::scope(|s| {
        let handles: Vec<_> = (0..tp).map(|r| s.spawn(move || participant(r))).collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts() -> Vec<Vec<f32>> {
        // Values whose f32 sum depends on the order: (1e8 + 1) − 1e8 = 0 in f32, 1 in another
        // order.
        vec![vec![1e8, 0.1, -3.0], vec![1.0, 0.2, 1.5], vec![-1e8, 0.3, 2.25]]
    }

    fn rank_order(p: &[Vec<f32>]) -> Vec<f32> {
        let mut acc = p[0].clone();
        for q in &p[1..] {
            acc = acc.iter().zip(q).map(|(a, b)| a + b).collect();
        }
        acc
    }

    #[test]
    fn every_rank_holds_the_rank_order_sum_bit_for_bit() {
        let p = parts();
        let want = rank_order(&p);
        assert_eq!(want[0], 0.0, "the test values must be order-sensitive");
        let got = host_all_reduce_sum(&p, None).unwrap();
        assert_eq!(got.len(), 3);
        for copy in &got {
            let bits: Vec<u32> = copy.iter().map(|x| x.to_bits()).collect();
            let want_bits: Vec<u32> = want.iter().map(|x| x.to_bits()).collect();
            assert_eq!(bits, want_bits);
        }
    }

    #[test]
    fn faults_act_inside_the_participant_that_has_them() {
        let p = vec![vec![1.0f32, 2.0], vec![10.0, 20.0], vec![100.0, 200.0]];
        let twice = host_all_reduce_sum(&p, Some(ReduceFault::Twice)).unwrap();
        assert!(twice.iter().all(|c| c == &vec![333.0, 666.0]));
        let skip = host_all_reduce_sum(&p, Some(ReduceFault::SkipRank(1))).unwrap();
        assert!(skip.iter().all(|c| c == &vec![101.0, 202.0]));
        let early = host_all_reduce_sum(&p, Some(ReduceFault::ReadEarly(2))).unwrap();
        assert_eq!(early[2], vec![100.0, 200.0]);
        assert_eq!(early[0], vec![111.0, 222.0]);
        assert_eq!(early[1], vec![111.0, 222.0]);
    }

    #[test]
    fn one_rank_is_the_identity_and_bad_shapes_are_errors() {
        assert_eq!(
            host_all_reduce_sum(&[vec![1.5, -2.0]], None).unwrap(),
            vec![vec![1.5, -2.0]]
        );
        // Both are the caller's shape bugs: internal errors, not input errors.
        let e = host_all_reduce_sum(&[], None).unwrap_err();
        assert!(matches!(e, Error::Internal(_)), "{e:?}");
        let e = host_all_reduce_sum(&[vec![1.0], vec![1.0, 2.0]], None).unwrap_err();
        assert!(matches!(e, Error::Internal(_)), "{e:?}");
        assert_eq!(
            e.to_string(),
            "internal error: all-reduce: rank 1 holds 2 elements, rank 0 holds 1"
        );
    }
}
