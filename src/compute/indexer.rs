//! The DSA lightning indexer (DeepSeek-V3.2, GLM-5): which keys each query token may attend to.
//!
//! DeepSeek Sparse Attention puts a small scoring network in front of MLA: every query token
//! scores every visible key and keeps the best `K_idx`; the MLA attention of that token then sees
//! only those keys. Once a sequence is longer than `K_idx`, an indexer bug (a wrong RoPE pairing,
//! a stale selection) silently changes which tokens a layer reads, and the attention output looks
//! merely "a bit off". This module holds the indexer's arithmetic shared by the reference (f64)
//! and the engine paths (f32, with their own projections), the selection rule (ties to the lower
//! position, so it is deterministic) and the trace layout of `idx_scores` / `idx_topk`.
//!
//! Sources: DeepSeek-V3.2-Exp paper (lightning indexer); HF `models/deepseek_v32/
//! modeling_deepseek_v32.py` (`DeepseekV32Indexer`) and `models/glm_moe_dsa/` (`GlmMoeDsaIndexer`,
//! interleaved RoPE, shared layers); llama.cpp `src/models/deepseek32.cpp`, `glm-dsa.cpp`.

use rayon::prelude::*;

use crate::core::batch::Batch;
use crate::core::fp8::QkQuant;
use crate::model::config::{IndexerConfig, RopeStyle};

/// The keys each packed token keeps: for token `i`, ascending key indices within its own
/// sequence (0 = the sequence's first packed token, whatever its RoPE `start_pos`), all ≤ the
/// token's own index (`rows[i]`, one entry per packed token).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selection {
    /// Per packed token, the kept key positions (ascending).
    pub rows: Vec<Vec<usize>>,
}

impl Selection {
    /// Every visible key (dense causal attention): what a model without an indexer attends to.
    pub fn dense(batch: &Batch) -> Selection {
        Selection {
            rows: seq_index(batch).into_iter().map(|p| (0..=p).collect()).collect(),
        }
    }
}

/// Keys that some packed tokens' attention reads instead of the indexer's choice: an engine's
/// recorded selection (`idx_topk`), so that its attention is judged on the keys it attended to
/// while its selection is judged on its own.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AttendKeys {
    /// Per packed token: `Some(keys)` (positions within its sequence) to attend to instead,
    /// `None` to keep the indexer's selection. Shorter than the batch: the rest keep theirs.
    pub rows: Vec<Option<Vec<usize>>>,
}

impl AttendKeys {
    /// `sel` with the given rows replaced, each replacement ascending, deduplicated and cut to
    /// the token's causal bound (its index in its sequence, [`seq_index`]): a key the engine
    /// kept beyond it cannot be attended to here (its `idx_topk` is judged on its own). A
    /// replacement left empty keeps `sel`'s row.
    pub fn over(&self, batch: &Batch, sel: &Selection) -> Selection {
        let bound = seq_index(batch);
        let rows = sel
            .rows
            .iter()
            .enumerate()
            .map(|(i, own)| match self.rows.get(i).and_then(Option::as_ref) {
                Some(keys) => {
                    let mut k: Vec<usize> = keys.iter().copied().filter(|&p| p <= bound[i]).collect();
                    k.sort_unstable();
                    k.dedup();
                    if k.is_empty() { own.clone() } else { k }
                }
                None => own.clone(),
            })
            .collect();
        Selection { rows }
    }

    /// Whether any row is replaced.
    pub fn is_empty(&self) -> bool {
        self.rows.iter().all(Option::is_none)
    }
}

/// Applies an engine's quantization of the indexer's operands ([`QkQuant`]) in place, after
/// RoPE: `q` [T, N_idx, D_idx] per (token, head) row and `k` [T, D_idx] per token row, each row
/// in blocks of its own ([`crate::core::fp8::BlockQuant::quantize`]; a block never straddles two
/// rows). The scores of the quantized operands ([`scores`]) are then `Σ_h w·N^-½·ReLU(D^-½·q̂·k̂)`
/// with `q̂ = s_q·e4m3(q/s_q)`, `k̂ = s_k·e4m3(k/s_k)`: vLLM's DeepGEMM `fp8_mqa_logits`
/// (`Σ_h w'·ReLU(q8·k8)·s_k`, the query's scale and both `^-½` folded into `w'`), in f64.
pub fn quantize_qk(q: &mut [f64], k: &mut [f64], d: usize, quant: &QkQuant) {
    let d = d.max(1);
    q.chunks_mut(d).for_each(|row| {
        quant.q.quantize(row);
    });
    k.chunks_mut(d).for_each(|row| {
        quant.k.quantize(row);
    });
}

/// Each packed token's index within its own sequence (the causal key bound; RoPE uses
/// [`Batch::positions`], which adds `start_pos`).
pub fn seq_index(batch: &Batch) -> Vec<usize> {
    batch.seqs.iter().flat_map(|s| 0..s.len).collect()
}

/// Rotates `x` (`R` = `x.len()` values, an even count) at `pos` by the angles `pos·inv_freq[i]`
/// with the given pairing. `inv_freq` has `R/2` entries. f64.
pub fn rope_f64(x: &mut [f64], pos: usize, inv_freq: &[f64], style: RopeStyle) {
    let half = x.len() / 2;
    for (i, &f) in inv_freq.iter().enumerate().take(half) {
        let (a, b) = match style {
            RopeStyle::Interleaved => (2 * i, 2 * i + 1),
            RopeStyle::Neox => (i, i + half),
        };
        let (s, c) = (pos as f64 * f).sin_cos();
        let (x0, x1) = (x[a], x[b]);
        x[a] = x0 * c - x1 * s;
        x[b] = x0 * s + x1 * c;
    }
}

/// The indexer's RoPE, in place: the first `R = 2·inv_freq.len()` dims of every head of
/// `q` [T, N_idx, D_idx] and of `k` [T, D_idx] (each head is `[rope R | nope D_idx−R]`), token `t`
/// at `positions[t]`, with the indexer's pairing `style`. f64.
pub fn rope_indexer(
    q: &mut [f64],
    k: &mut [f64],
    ix: &IndexerConfig,
    positions: &[usize],
    inv_freq: &[f64],
    style: RopeStyle,
) {
    let (ni, d, r) = (ix.n_head, ix.head_dim, inv_freq.len() * 2);
    for (t, &pos) in positions.iter().enumerate() {
        for h in 0..ni {
            let o = (t * ni + h) * d;
            if let Some(x) = q.get_mut(o..o + r) {
                rope_f64(x, pos, inv_freq, style);
            }
        }
        if let Some(x) = k.get_mut(t * d..t * d + r) {
            rope_f64(x, pos, inv_freq, style);
        }
    }
}

/// LayerNorm of one row with gain `g` and bias `b` (population variance, `eps` inside the
/// square root), f64: HF `nn.LayerNorm`, llama.cpp `LLM_NORM`.
pub fn layer_norm(x: &[f64], g: &[f32], b: &[f32], eps: f64) -> Vec<f64> {
    let n = x.len().max(1) as f64;
    let mean = x.iter().sum::<f64>() / n;
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
    let inv = 1.0 / (var + eps).sqrt();
    x.iter()
        .zip(g.iter().zip(b))
        .map(|(v, (gi, bi))| (v - mean) * inv * f64::from(*gi) + f64::from(*bi))
        .collect()
}

/// The float type the index scores are computed in: f64 in the reference, f32 in the engine
/// paths (whose own rounding is what a path would see). Both run the one loop of [`scores`].
pub trait ScoreFloat:
    Copy + Default + Send + Sync + std::iter::Sum + std::ops::Mul<Output = Self> + std::ops::AddAssign
{
    /// `count^-½` in this type (the `N_idx^-½` and `D_idx^-½` scales).
    fn inv_sqrt(count: usize) -> Self;
    /// `max(x, 0)` with the type's own `max` (the ReLU of the score).
    fn relu(self) -> Self;
}

impl ScoreFloat for f32 {
    fn inv_sqrt(count: usize) -> f32 {
        (count as f32).powf(-0.5)
    }
    fn relu(self) -> f32 {
        self.max(0.0)
    }
}

impl ScoreFloat for f64 {
    fn inv_sqrt(count: usize) -> f64 {
        (count as f64).powf(-0.5)
    }
    fn relu(self) -> f64 {
        self.max(0.0)
    }
}

/// Index scores of every packed token against the visible keys of its sequence, in `F`
/// ([`ScoreFloat`]: f64 for the reference, f32 for the engine paths).
///
/// `q_roped` [T, N_idx, D_idx] and `k_roped` [T, D_idx] are the indexer query/key after RoPE,
/// `w` [T, N_idx] the unscaled per-head weights. Returns [T, S] (S = longest sequence), entry
/// `[i, j]` = `Σ_h w[i,h]·N_idx^-½·ReLU(D_idx^-½·q[i,h]·k[j])` for key index `j` ≤ the index of
/// token `i` in its sequence, and 0 for masked entries.
pub fn scores<F: ScoreFloat>(ix: &IndexerConfig, batch: &Batch, q_roped: &[F], k_roped: &[F], w: &[F]) -> Vec<F> {
    let (ni, d) = (ix.n_head, ix.head_dim);
    let s = batch.seqs.iter().map(|x| x.len).max().unwrap_or(0);
    let t = batch.n_tokens();
    let head_scale = F::inv_sqrt(ni);
    let dot_scale = F::inv_sqrt(d);
    // Each token's first packed row of its sequence and its index in it.
    let rows: Vec<(usize, usize)> = batch
        .offsets()
        .into_iter()
        .zip(&batch.seqs)
        .flat_map(|(off, sq)| (0..sq.len).map(move |i| (off, i)))
        .collect();
    let mut out = vec![F::default(); t * s];
    // Rows in parallel, each summed in one fixed order: the bits do not depend on the threads.
    out.par_chunks_mut(s.max(1))
        .zip(rows.par_iter())
        .enumerate()
        .for_each(|(ti, (row, &(off, i)))| {
            for (j, o) in row.iter_mut().enumerate().take(i + 1) {
                let kr = &k_roped[(off + j) * d..(off + j + 1) * d];
                let mut acc = F::default();
                for h in 0..ni {
                    let qr = &q_roped[(ti * ni + h) * d..(ti * ni + h + 1) * d];
                    let dot: F = qr.iter().zip(kr).map(|(&a, &b)| a * b).sum();
                    acc += w[ti * ni + h] * head_scale * (dot * dot_scale).relu();
                }
                *o = acc;
            }
        });
    out
}

/// The `K_idx` best visible keys of every token from `scores` [T, S] (as [`scores`] lays them
/// out), ascending; equal scores go to the lower position. A token with at most `K_idx` visible
/// keys keeps them all.
pub fn select(top_k: usize, batch: &Batch, scores: &[f64]) -> Selection {
    let s = batch.seqs.iter().map(|x| x.len).max().unwrap_or(0);
    let rows = seq_index(batch)
        .into_par_iter()
        .enumerate()
        .map(|(ti, pos)| {
            let row = &scores[ti * s..ti * s + pos + 1];
            let mut idx: Vec<usize> = (0..=pos).collect();
            if idx.len() > top_k {
                idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
                idx.truncate(top_k);
                idx.sort_unstable();
            }
            idx
        })
        .collect();
    Selection { rows }
}

/// The `idx_topk` trace layout of `sel`: [T, K] with K = min(`top_k`, S), each row ascending and
/// padded with −1. Returns (shape, values).
pub fn topk_tensor(top_k: usize, batch: &Batch, sel: &Selection) -> (Vec<usize>, Vec<f64>) {
    let s = batch.seqs.iter().map(|x| x.len).max().unwrap_or(0);
    let k = top_k.min(s);
    let mut v = vec![-1f64; sel.rows.len() * k];
    for (ti, row) in sel.rows.iter().enumerate() {
        for (c, &p) in row.iter().take(k).enumerate() {
            v[ti * k + c] = p as f64;
        }
    }
    (vec![sel.rows.len(), k], v)
}

/// Reads an `idx_topk` tensor ([T, K] values, −1 padding) back into per-token position sets,
/// dropping padding and anything that is not a valid position. Used by the detectors.
pub fn topk_sets(values: &[f64], k: usize) -> Vec<Vec<usize>> {
    if k == 0 {
        return Vec::new();
    }
    values
        .chunks(k)
        .map(|row| {
            let mut v: Vec<usize> = row
                .iter()
                .filter(|x| x.is_finite() && **x >= 0.0 && x.fract() == 0.0)
                .map(|&x| x as usize)
                .collect();
            v.sort_unstable();
            v.dedup();
            v
        })
        .collect()
}

/// When the two selections `r` (reference) and `c` of one token differ only by keys whose
/// reference scores (`row`, the token's `idx_scores` row) lie within `band · max|row|` of the
/// reference's K-th score, the largest such gap (relative to the row maximum); `None` when a
/// differing key is farther (a real difference) or a key is out of range. Equal sets give 0.
pub fn tie_gap(r: &[usize], c: &[usize], row: &[f64], band: f64) -> Option<f64> {
    if r == c {
        return Some(0.0);
    }
    let kth = r.iter().map(|&j| row.get(j).copied()).collect::<Option<Vec<f64>>>()?;
    let kth = kth.into_iter().reduce(f64::min)?;
    let visible = r.iter().chain(c).copied().max().unwrap_or(0);
    let max = row
        .get(..=visible)?
        .iter()
        .fold(0f64, |m, x| m.max(x.abs()))
        .max(f64::MIN_POSITIVE);
    let mut worst = 0f64;
    for &j in r
        .iter()
        .filter(|j| !c.contains(j))
        .chain(c.iter().filter(|j| !r.contains(j)))
    {
        let gap = (row.get(j)? - kth).abs() / max;
        if gap.is_nan() || gap > band {
            return None;
        }
        worst = worst.max(gap);
    }
    Some(worst)
}

/// Jaccard overlap |a ∩ b| / |a ∪ b| of two ascending position sets (1 for two empty sets).
pub fn jaccard(a: &[usize], b: &[usize]) -> f64 {
    let (mut i, mut j, mut inter) = (0, 0, 0usize);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => {
                inter += 1;
                i += 1;
                j += 1;
            }
        }
    }
    let union = a.len() + b.len() - inter;
    if union == 0 { 1.0 } else { inter as f64 / union as f64 }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::batch::SeqSpec;

    fn batch(lens: &[usize]) -> Batch {
        Batch {
            seqs: lens.iter().map(|&len| SeqSpec { len, start_pos: 7 }).collect(),
        }
    }

    #[test]
    fn select_keeps_the_best_and_breaks_ties_to_the_lower_position() {
        let b = batch(&[5]);
        // Row 4 (position 4) scores: keys 1 and 3 tie at 0.5, key 2 is best.
        let mut sc = vec![0f64; 25];
        sc[20..25].copy_from_slice(&[0.1, 0.5, 0.9, 0.5, 0.2]);
        let sel = select(2, &b, &sc);
        assert_eq!(sel.rows[4], vec![1, 2]);
        // Early rows see fewer than K keys and keep them all.
        assert_eq!(sel.rows[0], vec![0]);
        assert_eq!(sel.rows[1], vec![0, 1]);
        let (shape, v) = topk_tensor(2, &b, &sel);
        assert_eq!(shape, vec![5, 2]);
        assert_eq!(&v[0..2], &[0.0, -1.0]);
        assert_eq!(topk_sets(&v, 2)[0], vec![0]);
    }

    #[test]
    fn scores_follow_the_formula_and_mask_future_keys() {
        let ix = IndexerConfig {
            n_head: 2,
            head_dim: 2,
            top_k: 1,
            rope_style: RopeStyle::Neox,
            norm_eps: 1e-6,
            full: vec![true],
        };
        let b = batch(&[2]);
        let q = [1.0, 0.0, -1.0, 0.0, 0.5, 0.5, 2.0, 1.0];
        let k = [2.0, 1.0, 1.0, 3.0];
        let w = [1.5, -0.5, 1.0, 2.0];
        let s = scores(&ix, &b, &q, &k, &w);
        let (hs, ds) = (0.5f64.sqrt(), 0.5f64.sqrt());
        // token 0, key 0: head 0 dot 2 → relu 2·ds; head 1 dot −2 → 0.
        assert!((s[0] - 1.5 * hs * 2.0 * ds).abs() < 1e-12);
        assert_eq!(s[1], 0.0, "future key is masked to 0");
        // token 1, key 1: head 0 dot 2, head 1 dot 5.
        let want = hs * ds * (1.0 * 2.0 + 2.0 * 5.0);
        assert!((s[3] - want).abs() < 1e-12);
    }

    #[test]
    fn neox_and_interleaved_rope_differ_but_keep_the_norm() {
        let inv = [1.0, 0.1];
        let mut a = vec![1.0, 2.0, 3.0, 4.0];
        let mut b = a.clone();
        rope_f64(&mut a, 3, &inv, RopeStyle::Interleaved);
        rope_f64(&mut b, 3, &inv, RopeStyle::Neox);
        let n = |x: &[f64]| x.iter().map(|v| v * v).sum::<f64>();
        assert!((n(&a) - 30.0).abs() < 1e-12 && (n(&b) - 30.0).abs() < 1e-12);
        assert!(a.iter().zip(&b).any(|(x, y)| (x - y).abs() > 1e-3));
    }

    #[test]
    fn tie_gap_accepts_only_flips_at_the_kth_score() {
        // Reference keeps {0, 2}; its K-th score is 0.50. Key 1 scores 0.495 (a near tie), key 3
        // 0.1 (far below).
        let row = [0.9, 0.495, 0.50, 0.1];
        assert_eq!(tie_gap(&[0, 2], &[0, 2], &row, 1e-2), Some(0.0));
        let g = tie_gap(&[0, 2], &[0, 1], &row, 1e-2).unwrap();
        assert!((g - 0.005 / 0.9).abs() < 1e-12);
        assert_eq!(tie_gap(&[0, 2], &[0, 1], &row, 1e-3), None, "outside a tighter band");
        assert_eq!(
            tie_gap(&[0, 2], &[0, 3], &row, 1e-2),
            None,
            "a far key is a real difference"
        );
    }

    #[test]
    fn attend_keys_replace_rows_within_the_causal_bound() {
        let b = batch(&[3, 2]);
        let own = Selection::dense(&b);
        let keys = AttendKeys {
            rows: vec![None, None, Some(vec![2, 0, 0]), Some(vec![5]), Some(vec![1, 7])],
        };
        let sel = keys.over(&b, &own);
        // Row 2 (position 2): sorted, deduplicated. Row 3 (the second sequence's position 0):
        // key 5 lies past it, nothing is left, its own row stays. Row 4: key 7 dropped.
        assert_eq!(sel.rows, vec![vec![0], vec![0, 1], vec![0, 2], vec![0], vec![1]]);
        assert!(!keys.is_empty() && AttendKeys::default().is_empty());
    }

    #[test]
    fn quantized_operands_are_cut_into_blocks_per_row() {
        use crate::core::fp8::{BlockQuant, ScaleFormat};
        let side = |floor| BlockQuant {
            block: 2,
            scale: ScaleFormat::Ue8m0,
            amax_floor: floor,
            input: None,
        };
        let quant = QkQuant {
            q: side(1e-10),
            k: side(1e-4),
        };
        // D = 3: rows [1.3, 0.3, 10.0] are blocks [1.3, 0.3] and [10.0] (a block never takes the
        // next row's first value). Block 1: scale 2^-8 (1.3/448 → 2^-8): 1.3·256 = 332.8 → 320,
        // 0.3·256 = 76.8 → 80 (step 8 in [64, 128)). Block 2: 10/448 → 2^-5, 320 exact.
        let mut q = vec![1.3, 0.3, 10.0, 0.0, 0.0, 0.0];
        let mut k = vec![0.0, 0.0, 0.0];
        quantize_qk(&mut q, &mut k, 3, &quant);
        assert_eq!(q, vec![1.25, 0.3125, 10.0, 0.0, 0.0, 0.0]);
        assert_eq!(k, vec![0.0; 3]);
    }

    #[test]
    fn layer_norm_and_jaccard() {
        let y = layer_norm(&[1.0, 3.0], &[1.0, 2.0], &[0.5, 0.0], 0.0);
        assert!((y[0] - (-0.5)).abs() < 1e-12 && (y[1] - 2.0).abs() < 1e-12);
        assert_eq!(jaccard(&[1, 2, 3], &[2, 3, 4]), 0.5);
        assert_eq!(jaccard(&[], &[]), 1.0);
    }
}
