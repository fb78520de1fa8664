//! The shape of a batch (which tokens belong to which sequence, at which positions) and the
//! seeded random numbers that fill inputs.
//!
//! The reference and every path must agree on what they are computing before they can be
//! compared, so the batch description lives apart from both. Tokens are packed token-major, vLLM
//! style: all tokens of sequence 0, then sequence 1, and so on. The random generator is written
//! here (SplitMix64 plus Box–Muller) rather than taken from `rand`, because golden files record a
//! seed and must regenerate the same inputs with every future version of the tool, a
//! value-stability promise `rand`'s distributions do not make.

use serde::{Deserialize, Serialize};

/// One sequence of a batch: `len` tokens at positions `start_pos .. start_pos + len`, attending
/// causally to each other (and to nothing before `start_pos`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SeqSpec {
    /// Number of tokens.
    pub len: usize,
    /// RoPE position of the first token.
    pub start_pos: usize,
}

/// Largest RoPE position accepted (a sequence's start position plus its length): 2^31, far
/// past any released context length, and exact in the f64 angle computation.
pub const MAX_POSITION: usize = 1 << 31;

/// A batch of sequences, packed token-major.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Batch {
    /// The sequences, in packing order.
    pub seqs: Vec<SeqSpec>,
}

impl Batch {
    /// One sequence of `len` tokens starting at `start_pos`.
    pub fn single(len: usize, start_pos: usize) -> Self {
        Batch {
            seqs: vec![SeqSpec { len, start_pos }],
        }
    }

    /// `T`: total tokens.
    pub fn n_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.len).sum()
    }

    /// Packed index of each sequence's first token.
    pub fn offsets(&self) -> Vec<usize> {
        let mut o = Vec::with_capacity(self.seqs.len());
        let mut acc = 0;
        for s in &self.seqs {
            o.push(acc);
            acc += s.len;
        }
        o
    }

    /// RoPE position of every packed token, \[T].
    pub fn positions(&self) -> Vec<usize> {
        self.seqs
            .iter()
            .flat_map(|s| s.start_pos..s.start_pos + s.len)
            .collect()
    }
}

/// SplitMix64 (Steele, Lea, Flood 2014): a tiny generator whose output sequence is fixed forever.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GAMMA);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform double in (0, 1) (never exactly 0, so `ln` is finite).
    pub fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// A standard normal sample (Box–Muller, one value per call).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.uniform();
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// A uniform integer in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// Fisher–Yates shuffle.
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i + 1);
            v.swap(i, j);
        }
    }
}

/// The SplitMix64 increment: the state after `m` draws from seed `s` is `s + m·GAMMA`.
const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// Values per parallel chunk of [`normal_f32`].
const NORMAL_CHUNK: usize = 1 << 16;

/// `n` standard-normal f32 values from `seed` (seeded random layer inputs: never zeros): value
/// `i` is the `i`-th [`SplitMix64::normal`] of `SplitMix64::new(seed)`.
///
/// Each value draws two outputs, so a chunk starting at value `i` starts from the state after
/// `2·i` draws: the chunks run in parallel (a real-size input, 4096 × 7168 values, took most of a
/// second on one thread) and give the sequential values exactly.
pub fn normal_f32(seed: u64, n: usize) -> Vec<f32> {
    use rayon::prelude::*;
    let mut out = vec![0f32; n];
    out.par_chunks_mut(NORMAL_CHUNK).enumerate().for_each(|(k, chunk)| {
        let draws = 2 * (k * NORMAL_CHUNK) as u64;
        let mut r = SplitMix64::new(seed.wrapping_add(draws.wrapping_mul(GAMMA)));
        chunk.iter_mut().for_each(|x| *x = r.normal() as f32);
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_is_value_stable() {
        // First outputs of SplitMix64 seeded with 0 (published reference values).
        let mut r = SplitMix64::new(0);
        assert_eq!(r.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(r.next_u64(), 0x6E78_9E6A_A1B9_65F4);
    }

    #[test]
    fn parallel_normals_are_the_sequential_stream() {
        let n = 3 * NORMAL_CHUNK + 17;
        let mut r = SplitMix64::new(42);
        let seq: Vec<f32> = (0..n).map(|_| r.normal() as f32).collect();
        let par = normal_f32(42, n);
        assert!(seq.iter().zip(&par).all(|(a, b)| a.to_bits() == b.to_bits()));
        assert_eq!(par.len(), n);
    }

    #[test]
    fn normal_has_unit_moments() {
        let v = normal_f32(7, 200_000);
        let mean: f64 = v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64;
        let var: f64 = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / v.len() as f64;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var - 1.0).abs() < 0.01, "var {var}");
    }

    #[test]
    fn batch_positions_and_offsets() {
        let b = Batch {
            seqs: vec![SeqSpec { len: 2, start_pos: 5 }, SeqSpec { len: 3, start_pos: 0 }],
        };
        assert_eq!(b.n_tokens(), 5);
        assert_eq!(b.offsets(), vec![0, 2]);
        assert_eq!(b.positions(), vec![5, 6, 0, 1, 2]);
    }
}
