//! The CPU backend's kernels: f32 building blocks shaped like an engine's GPU kernels.
//!
//! Each function mirrors one kernel of a real MLA engine (vLLM's `rms_norm`,
//! `rotary_embedding`, `concat_and_cache_mla`, flash-attention prefill with LSE, Triton MLA decode
//! stage 1 and the attention-state merge of stage 2), with the same inputs, the same in-place
//! outputs and the same edge cases (rows with no keys, empty splits), so that their bugs can be
//! reproduced here. All arithmetic is f32 with f32 accumulation, as engines accumulate. Work is
//! parallel over independent outputs only (rows, heads), with fixed loop orders inside, so the
//! bits of every result are the same for any thread count.

use ndarray::{Array2, ArrayView2};
use rayon::prelude::*;

use crate::compute::ops::{EmptyRows, Segment};
use crate::core::canary::canary_vec;

/// Query/key tile of [`flash_attention`] (rows).
pub const TILE: usize = 16;

/// Query rows (prefill) or heads (decode) whose `q·k` dot products [`dots_lanes`] computes
/// together; equal to [`TILE`].
pub const LANES: usize = TILE;

/// `q_i·k` for [`LANES`] query vectors at once, given transposed as `qt` [D][LANES] (lanes past
/// the real ones hold anything and are dropped by the caller). Each lane sums in index order
/// with a separate multiply and add (Rust never fuses them), exactly as one row's plain loop
/// `for d { dot += q[d] * k[d] }`: the same bits. One such chain is bound by the add latency;
/// running the lanes side by side lets the compiler use vector instructions across them, which
/// is what makes the attention kernels several times faster without changing a bit.
#[inline]
pub fn dots_lanes(qt: &[f32], k: &[f32]) -> [f32; LANES] {
    let mut acc = [0f32; LANES];
    for (qd, &kd) in qt.chunks_exact(LANES).zip(k) {
        for (a, &x) in acc.iter_mut().zip(qd) {
            *a += x * kd;
        }
    }
    acc
}

/// `rows` vectors of length `d` (row `i` at `src[at(i)..][..d]`) transposed into [d][LANES],
/// lanes past `rows` zero.
fn transpose_lanes(src: &[f32], rows: usize, d: usize, at: impl Fn(usize) -> usize) -> Vec<f32> {
    let mut qt = vec![0f32; d * LANES];
    for i in 0..rows {
        for (j, &x) in src[at(i)..][..d].iter().enumerate() {
            qt[j * LANES + i] = x;
        }
    }
    qt
}

/// Rows of W (output columns) per parallel work item of [`linear`]; fixed, never thread-dependent.
pub const LINEAR_OUT_BLOCK: usize = 256;

/// `y = x · Wᵀ` in f32 (an engine GEMM): x [T, K], W [O, K] → [T, O].
///
/// The output buffer is allocated with the canary and fully overwritten (beta = 0). W's rows are
/// cut into blocks of [`LINEAR_OUT_BLOCK`] run in parallel, each one matrixmultiply sgemm over
/// the whole K into its own output columns; matrixmultiply's order of accumulation over K does
/// not depend on the other dims, so the bits equal one sgemm over the whole matrix.
pub fn linear(x: ArrayView2<f32>, w: ArrayView2<f32>) -> Array2<f32> {
    let (t, o) = (x.nrows(), w.nrows());
    let mut y = Array2::from_shape_vec((t, o), canary_vec(t * o)).expect("shape matches length");
    let blocks: Vec<_> = y
        .axis_chunks_iter_mut(ndarray::Axis(1), LINEAR_OUT_BLOCK)
        .zip(w.axis_chunks_iter(ndarray::Axis(0), LINEAR_OUT_BLOCK))
        .collect();
    blocks.into_par_iter().for_each(|(mut yb, wb)| {
        ndarray::linalg::general_mat_mul(1.0, &x, &wb.t(), 0.0, &mut yb);
    });
    y
}

/// RMSNorm over `n_rows` rows of `width` elements read from `src[off + r·row_stride ..]` (vLLM
/// `rms_norm` on a strided view: `kv_c` rows live inside `kv_a` rows of width L+R).
///
/// Returns contiguous [n_rows, width]. Accumulates `Σx²` in f32 in element order.
pub fn rms_norm_strided(
    src: &[f32],
    n_rows: usize,
    off: usize,
    row_stride: usize,
    width: usize,
    g: &[f32],
    eps: f32,
) -> Vec<f32> {
    let mut out = canary_vec(n_rows * width);
    out.par_chunks_mut(width.max(1)).enumerate().for_each(|(i, o)| {
        let start = off + i * row_stride;
        // A stride bug may read past the source; the engine kernel would read garbage, we read
        // zeros rather than crash, which still shows as wrong rows.
        let row: Vec<f32> = (0..width).map(|j| src.get(start + j).copied().unwrap_or(0.0)).collect();
        let ss: f32 = row.iter().map(|v| v * v).sum();
        let inv = 1.0 / (ss / width as f32 + eps).sqrt();
        for ((oj, &x), &gj) in o.iter_mut().zip(&row).zip(g) {
            *oj = x * inv * gj;
        }
    });
    out
}

/// Output of one (segment, head, query tile) work item: indices, rows of output, rows of LSE
/// (`None`: row left unwritten).
type TileResult = (usize, usize, usize, Vec<f32>, Vec<Option<f32>>);

/// Tiled online-softmax attention with LSE (flash-attention forward), f32.
///
/// - `q` [Tq, N, Dqk], `k` [Tk, N, Dqk], `v` [Tk, N, Dv], all packed row-major;
/// - `out` [Tq, N, Dv] and `lse` [Tq, N] are caller-allocated and written in place;
/// - `scale` multiplies `q·k`; `lse` is natural-log;
/// - a query row with no visible key is handled by `empty` (correct: `lse = −inf`, output 0);
///   rows not covered by any segment are not touched.
///
/// Queries and keys are processed in tiles of [`TILE`] rows with the running max / running sum
/// rescaling of FlashAttention-2 (Dao 2023).
#[allow(clippy::too_many_arguments)]
pub fn flash_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    n_head: usize,
    dqk: usize,
    dv: usize,
    segments: &[Segment],
    scale: f32,
    empty: EmptyRows,
    out: &mut [f32],
    lse: &mut [f32],
) {
    let tile = TILE;
    let mut items = Vec::new();
    for (si, sg) in segments.iter().enumerate() {
        for h in 0..n_head {
            for qt in (0..sg.q_len).step_by(tile) {
                items.push((si, h, qt));
            }
        }
    }
    let results: Vec<TileResult> = items
        .par_iter()
        .map(|&(si, h, qt)| {
            let sg = segments[si];
            let rows = tile.min(sg.q_len - qt);
            let shift = sg.k_len as isize - sg.q_len as isize;
            let mut m = vec![f32::NEG_INFINITY; rows];
            let mut l = vec![0f32; rows];
            let mut acc = vec![0f32; rows * dv];
            let mut s = vec![0f32; tile];
            let q_t = transpose_lanes(q, rows, dqk, |r| ((sg.q_off + qt + r) * n_head + h) * dqk);
            let mut dots = vec![[0f32; LANES]; tile];
            for kt in (0..sg.k_len).step_by(tile) {
                let cols = tile.min(sg.k_len - kt);
                for (c, dc) in dots.iter_mut().enumerate().take(cols) {
                    *dc = dots_lanes(&q_t, &k[((sg.k_off + kt + c) * n_head + h) * dqk..][..dqk]);
                }
                for r in 0..rows {
                    let i = qt + r;
                    let mut row_max = f32::NEG_INFINITY;
                    for c in 0..cols {
                        let visible = !sg.causal || ((kt + c) as isize) <= i as isize + shift;
                        s[c] = if visible { dots[c][r] * scale } else { f32::NEG_INFINITY };
                        row_max = row_max.max(s[c]);
                    }
                    if row_max == f32::NEG_INFINITY {
                        continue; // nothing visible in this key tile
                    }
                    let m_new = m[r].max(row_max);
                    let alpha = (m[r] - m_new).exp();
                    let a = &mut acc[r * dv..(r + 1) * dv];
                    for x in a.iter_mut() {
                        *x *= alpha;
                    }
                    let mut psum = 0f32;
                    for c in 0..cols {
                        if s[c] == f32::NEG_INFINITY {
                            continue;
                        }
                        let pc = (s[c] - m_new).exp();
                        psum += pc;
                        let vrow = &v[((sg.k_off + kt + c) * n_head + h) * dv..][..dv];
                        for d in 0..dv {
                            a[d] += pc * vrow[d];
                        }
                    }
                    l[r] = l[r] * alpha + psum;
                    m[r] = m_new;
                }
            }
            let mut o = vec![0f32; rows * dv];
            let mut ls = vec![Some(f32::NEG_INFINITY); rows];
            for r in 0..rows {
                if l[r] > 0.0 {
                    for d in 0..dv {
                        o[r * dv + d] = acc[r * dv + d] / l[r];
                    }
                    ls[r] = Some(m[r] + l[r].ln());
                } else {
                    ls[r] = match empty {
                        EmptyRows::ZeroMinusInf => Some(f32::NEG_INFINITY),
                        EmptyRows::ZeroPlusInf => Some(f32::INFINITY),
                        EmptyRows::Skip => None,
                    };
                }
            }
            (si, h, qt, o, ls)
        })
        .collect();
    for (si, h, qt, o, ls) in results {
        let sg = segments[si];
        for (r, lr) in ls.iter().enumerate() {
            let Some(lr) = lr else { continue };
            let row = sg.q_off + qt + r;
            out[(row * n_head + h) * dv..][..dv].copy_from_slice(&o[r * dv..(r + 1) * dv]);
            lse[row * n_head + h] = *lr;
        }
    }
}

/// The row of logical position `pos` in a paged cache `[blocks·block_size, width]` read through
/// `table`.
pub fn cache_row<'c>(cache: &'c [f32], block_size: usize, width: usize, table: &[usize], pos: usize) -> &'c [f32] {
    let slot = table[pos / block_size] * block_size + pos % block_size;
    &cache[slot * width..(slot + 1) * width]
}

/// Stage 1 of split-KV decode for one token, a group of up to [`LANES`] of its heads and one
/// split: online softmax over the keys at logical positions `keys`, read from a paged latent
/// cache `[blocks·block_size, width]` through the block table (vLLM Triton MLA decode stage 1).
///
/// `q` [heads, width] holds each head's `[ql_nope | q_pe_roped]`; the value is the first `dv`
/// (= L) columns of each cache row. Writes each head's partial output into `out` [heads, dv] and
/// returns the heads' LSEs; an empty range writes nothing and returns `empty_lse` for every head
/// (−inf is right: Triton MLA decode's empty split). The heads share every cache row, so their
/// dot products run side by side ([`dots_lanes`]); each head's arithmetic, and so every bit, is
/// that of a loop over the keys for that head alone.
#[allow(clippy::too_many_arguments)]
pub fn decode_split(
    q: &[f32],
    heads: usize,
    cache: &[f32],
    block_size: usize,
    width: usize,
    table: &[usize],
    keys: std::ops::Range<usize>,
    scale: f32,
    dv: usize,
    empty_lse: f32,
    out: &mut [f32],
) -> Vec<f32> {
    if keys.is_empty() {
        return vec![empty_lse; heads];
    }
    let q_t = transpose_lanes(q, heads, width, |h| h * width);
    let mut m = vec![f32::NEG_INFINITY; heads];
    let mut l = vec![0f32; heads];
    let mut acc = vec![0f32; heads * dv];
    for pos in keys {
        let row = &cache_row(cache, block_size, width, table, pos)[..width];
        let dots = dots_lanes(&q_t, row);
        for h in 0..heads {
            let s = dots[h] * scale;
            let m_new = m[h].max(s);
            let alpha = (m[h] - m_new).exp();
            let p = (s - m_new).exp();
            for (a, &x) in acc[h * dv..(h + 1) * dv].iter_mut().zip(&row[..dv]) {
                *a = *a * alpha + p * x;
            }
            l[h] = l[h] * alpha + p;
            m[h] = m_new;
        }
    }
    for h in 0..heads {
        for (o, &a) in out[h * dv..(h + 1) * dv].iter_mut().zip(&acc[h * dv..(h + 1) * dv]) {
            *o = a / l[h];
        }
    }
    (0..heads).map(|h| m[h] + l[h].ln()).collect()
}

/// Merges partial attention states `(o_i, lse_i)` (docs/mla.md "Attention state merge"):
/// `m = max lse_i`, `o = Σ o_i·e^(lse_i−m) / Σ e^(lse_i−m)`, `lse = m + ln Σ e^(lse_i−m)`.
///
/// A partial with `lse = −inf` contributes nothing and its output is not read (it may hold the
/// canary). Returns the merged LSE; when every partial is empty, writes 0 and returns −inf.
pub fn merge_states(parts: &[(&[f32], f32)], out: &mut [f32]) -> f32 {
    let m = parts.iter().map(|p| p.1).fold(f32::NEG_INFINITY, f32::max);
    if m == f32::NEG_INFINITY {
        out.iter_mut().for_each(|x| *x = 0.0);
        return f32::NEG_INFINITY;
    }
    let mut denom = 0f32;
    out.iter_mut().for_each(|x| *x = 0.0);
    for &(o, lse) in parts {
        if lse == f32::NEG_INFINITY {
            continue;
        }
        let w = (lse - m).exp();
        denom += w;
        for (x, &oi) in out.iter_mut().zip(o) {
            *x += w * oi;
        }
    }
    out.iter_mut().for_each(|x| *x /= denom);
    m + denom.ln()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compute::ops::{RopeStyle, rope_row};
    use crate::core::batch::normal_f32;

    #[test]
    fn parallel_linear_is_bit_identical_to_one_sgemm() {
        let (t, k, o) = (37, 700, 1000);
        let x = Array2::from_shape_vec((t, k), normal_f32(3, t * k)).unwrap();
        let w = Array2::from_shape_vec((o, k), normal_f32(4, o * k)).unwrap();
        let mut expected = Array2::<f32>::zeros((t, o));
        ndarray::linalg::general_mat_mul(1.0, &x, &w.t(), 0.0, &mut expected);
        for threads in [1, 2, 3] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let got = pool.install(|| linear(x.view(), w.view()));
            let differ = got
                .iter()
                .zip(&expected)
                .filter(|(g, e)| g.to_bits() != e.to_bits())
                .count();
            assert_eq!(differ, 0, "{threads} threads: {differ} values differ in bits");
        }
    }

    /// Naive softmax attention of one query row over visible keys, f64.
    fn naive(q: &[f32], ks: &[&[f32]], vs: &[&[f32]], scale: f64) -> (Vec<f64>, f64) {
        let s: Vec<f64> = ks
            .iter()
            .map(|k| q.iter().zip(*k).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() * scale)
            .collect();
        let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
        let sum: f64 = e.iter().sum();
        let dv = vs[0].len();
        let mut o = vec![0f64; dv];
        for (ei, v) in e.iter().zip(vs) {
            for d in 0..dv {
                o[d] += ei / sum * v[d] as f64;
            }
        }
        (o, m + sum.ln())
    }

    #[test]
    fn flash_attention_matches_naive_causal_across_tiles() {
        let (t, nh, dqk, dv) = (37, 3, 5, 4);
        let q = normal_f32(1, t * nh * dqk);
        let k = normal_f32(2, t * nh * dqk);
        let v = normal_f32(3, t * nh * dv);
        let mut out = canary_vec(t * nh * dv);
        let mut lse = canary_vec(t * nh);
        let seg = [Segment {
            q_off: 0,
            q_len: t,
            k_off: 0,
            k_len: t,
            causal: true,
        }];
        flash_attention(
            &q,
            &k,
            &v,
            nh,
            dqk,
            dv,
            &seg,
            0.7,
            EmptyRows::ZeroMinusInf,
            &mut out,
            &mut lse,
        );
        for i in 0..t {
            for h in 0..nh {
                let ks: Vec<&[f32]> = (0..=i).map(|j| &k[(j * nh + h) * dqk..][..dqk]).collect();
                let vs: Vec<&[f32]> = (0..=i).map(|j| &v[(j * nh + h) * dv..][..dv]).collect();
                let (o, l) = naive(&q[(i * nh + h) * dqk..][..dqk], &ks, &vs, 0.7);
                approx::assert_abs_diff_eq!(lse[i * nh + h] as f64, l, epsilon = 1e-5);
                for d in 0..dv {
                    approx::assert_abs_diff_eq!(out[(i * nh + h) * dv + d] as f64, o[d], epsilon = 1e-5);
                }
            }
        }
    }

    #[test]
    fn flash_attention_empty_rows_follow_the_policy() {
        // 3 queries that are the last 3 of a 2-key span: query 0 sees j ≤ −1, i.e. nothing.
        let q = normal_f32(4, 3 * 2);
        let k = normal_f32(5, 2 * 2);
        let v = normal_f32(6, 2 * 2);
        let seg = [Segment {
            q_off: 0,
            q_len: 3,
            k_off: 0,
            k_len: 2,
            causal: true,
        }];
        let mut out = canary_vec(3 * 2);
        let mut lse = canary_vec(3);
        flash_attention(
            &q,
            &k,
            &v,
            1,
            2,
            2,
            &seg,
            1.0,
            EmptyRows::ZeroMinusInf,
            &mut out,
            &mut lse,
        );
        assert_eq!(lse[0], f32::NEG_INFINITY);
        assert_eq!(&out[..2], &[0.0, 0.0]);
        assert!(lse[1].is_finite() && lse[2].is_finite());
        let mut out = canary_vec(3 * 2);
        let mut lse = canary_vec(3);
        flash_attention(&q, &k, &v, 1, 2, 2, &seg, 1.0, EmptyRows::Skip, &mut out, &mut lse);
        assert!(crate::core::canary::is_canary(lse[0]) && crate::core::canary::is_canary(out[0]));
        let mut lse = canary_vec(3);
        flash_attention(
            &q,
            &k,
            &v,
            1,
            2,
            2,
            &seg,
            1.0,
            EmptyRows::ZeroPlusInf,
            &mut out,
            &mut lse,
        );
        assert_eq!(lse[0], f32::INFINITY);
    }

    #[test]
    fn lane_dots_are_bit_identical_to_a_plain_loop_per_row() {
        for d in [1, 7, 192, 576] {
            let rows = 11; // fewer than LANES: the padding lanes must not disturb the real ones
            let q = normal_f32(21 + d as u64, rows * d);
            let k = normal_f32(22 + d as u64, d);
            let qt = transpose_lanes(&q, rows, d, |i| i * d);
            let got = dots_lanes(&qt, &k);
            for i in 0..rows {
                let mut plain = 0f32;
                for j in 0..d {
                    plain += q[i * d + j] * k[j];
                }
                assert_eq!(got[i].to_bits(), plain.to_bits(), "d={d} row {i}");
            }
        }
    }

    #[test]
    fn grouped_heads_decode_is_bit_identical_to_one_head_at_a_time() {
        let (width, dv, ctx, bs, heads) = (40, 32, 29usize, 4, 5);
        let table: Vec<usize> = (0..ctx.div_ceil(bs)).rev().collect();
        let cache = normal_f32(31, table.len() * bs * width);
        let q = normal_f32(32, heads * width);
        let mut grouped = canary_vec(heads * dv);
        let lg = decode_split(
            &q,
            heads,
            &cache,
            bs,
            width,
            &table,
            3..ctx,
            0.3,
            dv,
            f32::NEG_INFINITY,
            &mut grouped,
        );
        for h in 0..heads {
            let mut one = canary_vec(dv);
            let qh = &q[h * width..(h + 1) * width];
            let l1 = decode_split(
                qh,
                1,
                &cache,
                bs,
                width,
                &table,
                3..ctx,
                0.3,
                dv,
                f32::NEG_INFINITY,
                &mut one,
            );
            assert_eq!(lg[h].to_bits(), l1[0].to_bits(), "lse of head {h}");
            let same = one
                .iter()
                .zip(&grouped[h * dv..])
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "output of head {h}");
        }
    }

    #[test]
    fn split_decode_then_merge_equals_single_pass() {
        let (width, dv, ctx, bs) = (6, 4, 13, 4);
        let mut cache = canary_vec(5 * bs * width);
        let table = vec![3, 0, 4, 1];
        let rows = normal_f32(7, ctx * width);
        for pos in 0..ctx {
            let slot = table[pos / bs] * bs + pos % bs;
            cache[slot * width..(slot + 1) * width].copy_from_slice(&rows[pos * width..(pos + 1) * width]);
        }
        let q = normal_f32(8, width);
        let mut whole = vec![0f32; dv];
        let l_whole = decode_split(
            &q,
            1,
            &cache,
            bs,
            width,
            &table,
            0..ctx,
            0.5,
            dv,
            f32::NEG_INFINITY,
            &mut whole,
        )[0];
        let mut parts = vec![canary_vec(dv); 4];
        let mut lses = [0f32; 4];
        let split = ctx.div_ceil(4);
        for (s, p) in parts.iter_mut().enumerate() {
            let r = (s * split).min(ctx)..((s + 1) * split).min(ctx);
            lses[s] = decode_split(&q, 1, &cache, bs, width, &table, r, 0.5, dv, f32::NEG_INFINITY, p)[0];
        }
        let views: Vec<(&[f32], f32)> = parts.iter().map(|p| p.as_slice()).zip(lses.iter().copied()).collect();
        let mut merged = canary_vec(dv);
        let l = merge_states(&views, &mut merged);
        approx::assert_abs_diff_eq!(l, l_whole, epsilon = 1e-5);
        for d in 0..dv {
            approx::assert_abs_diff_eq!(merged[d], whole[d], epsilon = 1e-5);
        }
    }

    #[test]
    fn merge_ignores_empty_partials_holding_the_canary() {
        let a = [1.0f32, 2.0];
        let empty = canary_vec(2);
        let mut out = canary_vec(2);
        let l = merge_states(&[(&a, 0.3), (&empty, f32::NEG_INFINITY)], &mut out);
        assert_eq!(out, vec![1.0, 2.0]);
        approx::assert_abs_diff_eq!(l, 0.3, epsilon = 1e-7);
    }

    #[test]
    fn rope_styles_rotate_different_pairs() {
        let (c, s) = ([1f32.cos(), 0.5f32.cos()], [1f32.sin(), 0.5f32.sin()]);
        let mut a = [1.0f32, 0.0, 0.0, 0.0];
        rope_row(&mut a, &c, &s, RopeStyle::Interleaved);
        approx::assert_abs_diff_eq!(a[1], 1f32.sin(), epsilon = 1e-7);
        let mut b = [1.0f32, 0.0, 0.0, 0.0];
        rope_row(&mut b, &c, &s, RopeStyle::Neox);
        approx::assert_abs_diff_eq!(b[2], 1f32.sin(), epsilon = 1e-7);
        assert_eq!(b[1], 0.0);
    }
}
