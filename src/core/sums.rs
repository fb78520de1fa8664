//! The sums a site comparison is built from, whichever processor computed them.
//!
//! The per-site metrics of `judge::metrics` come from two passes over the element pairs
//! (reference, candidate): counts and sums of squares first, then, with the reference's RMS
//! known, the worst element and the elements within tolerance. On the CPU both passes run over
//! host slices; on the GPU (`backend::cuda::compare`) they run where the traces live, and only
//! these few numbers come back to the host. One struct for both keeps a single definition of
//! every metric above it.

/// Pass 1 over the element pairs of one site: the non-finite bookkeeping and the four sums.
///
/// Counts are over the first `min(len_ref, len_cand)` elements; the sums (f64) over the
/// elements finite on both sides.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct Pass1 {
    /// Non-finite reference elements.
    pub nf_r: usize,
    /// Non-finite candidate elements.
    pub nf_c: usize,
    /// Positions where exactly one side is non-finite.
    pub nf_mis: usize,
    /// The first such position (flat index).
    pub first_mis: Option<usize>,
    /// Candidate elements holding the canary (exact or quieted).
    pub canary: usize,
    /// Candidate elements exactly 0 where the reference is not (both finite).
    pub zeros: usize,
    /// Σ r².
    pub rr: f64,
    /// Σ c².
    pub cc: f64,
    /// Σ (c − r)².
    pub dd: f64,
    /// Σ r·c.
    pub rc: f64,
}

/// Pass 2 over the element pairs of one site, given the reference's RMS.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct Pass2 {
    /// Largest |c − r| over elements finite on both sides; `+∞` when one side alone is
    /// non-finite somewhere.
    pub max_abs: f64,
    /// Flat index of that element (the lowest on ties; 0 when every difference is 0).
    pub max_i: usize,
    /// Largest |c − r| / |r| over elements with |r| above the floor (1e-3 · rms).
    pub max_rel: f64,
    /// Elements with |c − r| ≤ atol + rtol·|r|, plus pairs non-finite in the same way.
    pub passed: usize,
}

/// Both passes of one site plus the two values at the worst element.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct ElementSums {
    /// Elements compared.
    pub n: usize,
    /// Pass 1.
    pub pass1: Pass1,
    /// Pass 2.
    pub pass2: Pass2,
    /// Reference value at `pass2.max_i` (0 when `n` is 0).
    pub r_at_max: f64,
    /// Candidate value there.
    pub c_at_max: f64,
}

impl Pass1 {
    /// The reference's RMS over all `n` compared elements (0 for `n = 0`): what pass 2's
    /// absolute tolerance and relative floor scale with.
    pub fn rms(&self, n: usize) -> f64 {
        if n > 0 { (self.rr / n as f64).sqrt() } else { 0.0 }
    }

    /// Adds `o`'s counts and sums; `o` covers later elements than `self`.
    pub fn absorb(&mut self, o: &Pass1) {
        self.nf_r += o.nf_r;
        self.nf_c += o.nf_c;
        self.nf_mis += o.nf_mis;
        self.first_mis = self.first_mis.or(o.first_mis);
        self.canary += o.canary;
        self.zeros += o.zeros;
        self.rr += o.rr;
        self.cc += o.cc;
        self.dd += o.dd;
        self.rc += o.rc;
    }
}

impl Pass2 {
    /// Adds `o`, which covers later elements than `self`: a strictly larger difference wins, so
    /// the first element keeps a tie, as one pass in element order would report.
    pub fn absorb(&mut self, o: &Pass2) {
        if o.max_abs > self.max_abs {
            self.max_abs = o.max_abs;
            self.max_i = o.max_i;
        }
        self.max_rel = self.max_rel.max(o.max_rel);
        self.passed += o.passed;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absorbing_keeps_the_first_of_equal_worst_elements() {
        let mut a = Pass2 {
            max_abs: 2.0,
            max_i: 3,
            max_rel: 0.5,
            passed: 10,
        };
        a.absorb(&Pass2 {
            max_abs: 2.0,
            max_i: 40,
            max_rel: 0.7,
            passed: 5,
        });
        assert_eq!(
            a,
            Pass2 {
                max_abs: 2.0,
                max_i: 3,
                max_rel: 0.7,
                passed: 15
            }
        );
        a.absorb(&Pass2 {
            max_abs: f64::INFINITY,
            max_i: 50,
            max_rel: 0.1,
            passed: 0,
        });
        assert_eq!((a.max_abs, a.max_i), (f64::INFINITY, 50));
    }

    #[test]
    fn pass1_sums_add_and_the_first_mismatch_stays() {
        let mut a = Pass1 {
            nf_mis: 1,
            first_mis: Some(7),
            rr: 4.0,
            ..Pass1::default()
        };
        a.absorb(&Pass1 {
            nf_mis: 2,
            first_mis: Some(90),
            rr: 5.0,
            cc: 1.0,
            ..Pass1::default()
        });
        assert_eq!((a.nf_mis, a.first_mis, a.rr, a.cc), (3, Some(7), 9.0, 1.0));
        assert_eq!(a.rms(4), 1.5);
        assert_eq!(Pass1::default().rms(0), 0.0);
    }
}
