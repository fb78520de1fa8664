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

use crate::compute::ops::{EmptyRows, PrefillArgs, Segment};
use crate::core::canary::canary_vec;

/// Query/key tile of [`flash_attention`] (rows).
pub const TILE: usize = 16;

/// Query rows (prefill) or heads (decode) whose `q·k` dot products [`dots_lanes`] computes
/// together; equal to [`TILE`].
pub const LANES: usize = TILE;

/// Whether the processor runs AVX2, for the kernels that have a copy compiled for it
/// ([`decode_split`], [`bmm_heads`], [`flash_attention`]). The binary's baseline is x86-64 (SSE2,
/// 4 lanes); the AVX2 copies run the same code on 8 lanes. Every kernel here uses separate
/// multiplies and adds in a fixed order per element (Rust never fuses them into FMA, and never
/// reorders a float sum), so both copies give the same bits (tested); only the speed differs.
#[cfg(target_arch = "x86_64")]
#[inline]
fn has_avx2() -> bool {
    std::arch::is_x86_feature_detected!("avx2")
}

/// `q_i·k` for [`LANES`] query vectors at once, given transposed as `qt` [D][LANES] (lanes past
/// the real ones hold anything and are dropped by the caller). Each lane sums in index order
/// with a separate multiply and add (Rust never fuses them), exactly as one row's plain loop
/// `for d { dot += q[d] * k[d] }`: the same bits. One such chain is bound by the add latency;
/// running the lanes side by side lets the compiler use vector instructions across them, which
/// is what makes the attention kernels several times faster without changing a bit.
#[inline(always)]
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
#[inline(always)]
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

/// Fewest tokens per work item of [`bmm_heads`].
pub const BMM_TOKEN_TILE: usize = 8;

/// Most tokens per work item of [`bmm_heads`].
pub const BMM_TOKEN_TILE_MAX: usize = 128;

/// Tokens per work item of [`bmm_heads`] for `t` tokens on `threads` threads: one tile per thread,
/// between [`BMM_TOKEN_TILE`] and [`BMM_TOKEN_TILE_MAX`]. Each block of a head's W is copied
/// once per tile and then read by every token of it, so larger tiles read W fewer times (at
/// DeepSeek-V3 size all heads' W is 32 MB, far past the caches: with 8-token tiles the kernel
/// ran at a third of the speed it has with 128); the bits never depend on the tile.
pub fn bmm_token_tile(t: usize, threads: usize) -> usize {
    t.div_ceil(threads.max(1)).clamp(BMM_TOKEN_TILE, BMM_TOKEN_TILE_MAX)
}

/// Per-head batched matmul `out[t, h, :] = x[t, h, :] · w[h]` in f32: x [T, nh, A], w [nh, A, B]
/// → [T, nh, B] (the absorbed `q_nope · W_UK_T` and `attn_latent · W_UV` of the MQA paths).
///
/// Every output element starts at 0 and adds `x[t, h, a] · w[h, a, b]` for `a` ascending, a
/// separate multiply and add (Rust never fuses them): the bits of the plain triple loop over one
/// token at a time, for any tile and thread count. Work items are tiles of [`bmm_token_tile`]
/// tokens, run in parallel.
pub fn bmm_heads(x: &[f32], t: usize, nh: usize, a: usize, w: &[f32], b: usize) -> Vec<f32> {
    let mut out = canary_vec(t * nh * b);
    let tile = bmm_token_tile(t, rayon::current_num_threads());
    out.par_chunks_mut((tile * nh * b).max(1))
        .enumerate()
        .for_each(|(ci, rows)| {
            #[cfg(target_arch = "x86_64")]
            if has_avx2() {
                #[target_feature(enable = "avx2")]
                fn wide(x: &[f32], t0: usize, nh: usize, a: usize, w: &[f32], b: usize, rows: &mut [f32]) {
                    bmm_tile(x, t0, nh, a, w, b, rows);
                }
                // SAFETY: the processor has AVX2 (checked at run time).
                return unsafe { wide(x, ci * tile, nh, a, w, b, rows) };
            }
            bmm_tile(x, ci * tile, nh, a, w, b, rows);
        });
    out
}

/// Output columns accumulated in registers at once by [`bmm_heads`] (for two tokens: 8 AVX
/// registers of sums, each `w` row segment loaded once for both) and by the P·V sums of
/// [`flash_attention`]; the plain loops stored every partial sum back to memory, one store per
/// 8 multiply-adds.
const BMM_COLS: usize = 32;

/// One work item of [`bmm_heads`]: the output rows `rows` [nt, nh, B] of tokens `t0..t0+nt`.
///
/// Each output element is `0 + x[0]·w[0] + x[1]·w[1] + …` in `a` order, whatever the blocking.
#[inline(always)]
fn bmm_tile(x: &[f32], t0: usize, nh: usize, a: usize, w: &[f32], b: usize, rows: &mut [f32]) {
    let nt = rows.len() / (nh * b).max(1);
    let full = b - b % BMM_COLS;
    // One block of columns of a head's W, [A, BMM_COLS] contiguous: read in order by every token
    // of the tile (W's rows are B apart, which the loads would otherwise stride across).
    let mut wc = vec![[0f32; BMM_COLS]; a];
    for h in 0..nh {
        let wh = &w[h * a * b..(h + 1) * a * b];
        let xrow = |ti: usize| &x[((t0 + ti) * nh + h) * a..][..a];
        for b0 in (0..full).step_by(BMM_COLS) {
            for (ai, c) in wc.iter_mut().enumerate() {
                c.copy_from_slice(&wh[ai * b + b0..][..BMM_COLS]);
            }
            for ti in (0..nt).step_by(2) {
                let pair = ti + 1 < nt;
                let (x0, x1) = (xrow(ti), xrow(if pair { ti + 1 } else { ti }));
                let mut acc = [[0f32; BMM_COLS]; 2];
                for ((wr, &u0), &u1) in wc.iter().zip(x0).zip(x1) {
                    for j in 0..BMM_COLS {
                        acc[0][j] += u0 * wr[j];
                        acc[1][j] += u1 * wr[j];
                    }
                }
                rows[(ti * nh + h) * b + b0..][..BMM_COLS].copy_from_slice(&acc[0]);
                if pair {
                    rows[((ti + 1) * nh + h) * b + b0..][..BMM_COLS].copy_from_slice(&acc[1]);
                }
            }
        }
        // The columns past the last whole block, one at a time.
        for ti in 0..nt {
            let xr = xrow(ti);
            for bi in full..b {
                let mut sum = 0f32;
                for (ai, &u) in xr.iter().enumerate() {
                    sum += u * wh[ai * b + bi];
                }
                rows[(ti * nh + h) * b + bi] = sum;
            }
        }
    }
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

/// Output of one (segment, head, query tile) work item of [`flash_attention`], before it is
/// scattered into the launch's `out` and `lse`.
struct TileResult {
    /// Index of the segment in `PrefillArgs::segments`.
    segment: usize,
    /// Attention head.
    head: usize,
    /// The tile's first query row, relative to the segment's `q_off`.
    q_tile_start: usize,
    /// Output rows of the tile, [rows, Dv] f32.
    out: Vec<f32>,
    /// Natural-log LSE of each row of the tile; `None`: the row is left unwritten.
    lse: Vec<Option<f32>>,
}

/// Tiled online-softmax attention with LSE (flash-attention forward), f32.
///
/// - `a.q` [Tq, N, Dqk], `a.k` [Tk, N, Dqk], `a.v` [Tk, N, Dv], all packed row-major;
/// - `out` [Tq, N, Dv] and `lse` [Tq, N] are caller-allocated and written in place;
/// - `a.scale` multiplies `q·k`; `lse` is natural-log;
/// - a query row with no visible key is handled by `a.empty` (correct: `lse = −inf`, output 0);
///   rows not covered by any segment are not touched;
/// - with `a.key_rows`, key `j` of a segment is row `key_rows[k_off + j]` of `k` and `v`, read
///   in place (the DSA selection's indices; the values and their order are those of a gathered
///   copy, so the bits are too).
///
/// Queries and keys are processed in tiles of [`TILE`] rows with the running max / running sum
/// rescaling of FlashAttention-2 (Dao 2023). Panics when a buffer is shorter than a segment
/// reaches (the [`crate::compute::ops::Ops`] implementation checks the lengths first).
pub fn flash_attention(a: &PrefillArgs<'_, [f32]>, out: &mut [f32], lse: &mut [f32]) {
    let (n_head, dv, segments) = (a.nh, a.dv, a.segments);
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
            let args = FlashTile {
                a,
                sg: segments[si],
                h,
                qt,
            };
            #[cfg(target_arch = "x86_64")]
            if has_avx2() {
                #[target_feature(enable = "avx2")]
                fn wide(a: &FlashTile<'_>) -> (Vec<f32>, Vec<Option<f32>>) {
                    flash_tile(a)
                }
                // SAFETY: the processor has AVX2 (checked at run time).
                let (out, lse) = unsafe { wide(&args) };
                return TileResult {
                    segment: si,
                    head: h,
                    q_tile_start: qt,
                    out,
                    lse,
                };
            }
            let (out, lse) = flash_tile(&args);
            TileResult {
                segment: si,
                head: h,
                q_tile_start: qt,
                out,
                lse,
            }
        })
        .collect();
    for TileResult {
        segment: si,
        head: h,
        q_tile_start: qt,
        out: o,
        lse: ls,
    } in results
    {
        let sg = segments[si];
        for (r, lr) in ls.iter().enumerate() {
            let Some(lr) = lr else { continue };
            let row = sg.q_off + qt + r;
            out[(row * n_head + h) * dv..][..dv].copy_from_slice(&o[r * dv..(r + 1) * dv]);
            lse[row * n_head + h] = *lr;
        }
    }
}

/// `acc[d] += p[j] · v[at[j] + d]` for `j` ascending, for every `d`: each element receives the
/// plain loop's products in the same order (the same bits), while [`BMM_COLS`] of them stay in
/// registers as every row streams past (the plain loop stored each partial sum back to memory).
#[inline(always)]
fn add_weighted_rows(acc: &mut [f32], v: &[f32], p: &[f32], at: &[usize]) {
    let dv = acc.len();
    let full = dv - dv % BMM_COLS;
    for d0 in (0..full).step_by(BMM_COLS) {
        let mut sum: [f32; BMM_COLS] = acc[d0..d0 + BMM_COLS].try_into().expect("BMM_COLS wide");
        for (&pj, &o) in p.iter().zip(at) {
            let vr: &[f32; BMM_COLS] = v[o + d0..][..BMM_COLS].try_into().expect("BMM_COLS wide");
            for j in 0..BMM_COLS {
                sum[j] += pj * vr[j];
            }
        }
        acc[d0..d0 + BMM_COLS].copy_from_slice(&sum);
    }
    for (d, x) in acc.iter_mut().enumerate().skip(full) {
        for (&pj, &o) in p.iter().zip(at) {
            *x += pj * v[o + d];
        }
    }
}

/// One (segment, head, query tile) work item of [`flash_attention`]: the launch, the segment,
/// the head and the tile's first row within the segment.
struct FlashTile<'a> {
    a: &'a PrefillArgs<'a, [f32]>,
    sg: Segment,
    h: usize,
    qt: usize,
}

/// One work item of [`flash_attention`]: the tile's output rows and LSEs.
#[inline(always)]
fn flash_tile(t: &FlashTile<'_>) -> (Vec<f32>, Vec<Option<f32>>) {
    let FlashTile { a, sg, h, qt } = *t;
    let PrefillArgs {
        q,
        k,
        v,
        nh: n_head,
        dqk,
        dv,
        scale,
        empty,
        ..
    } = *a;
    let tile = TILE;
    let rows = tile.min(sg.q_len - qt);
    let shift = sg.k_len as isize - sg.q_len as isize;
    let mut m = vec![f32::NEG_INFINITY; rows];
    let mut l = vec![0f32; rows];
    let mut acc = vec![0f32; rows * dv];
    let mut s = vec![0f32; tile];
    // The visible keys of one row in a key tile: their weights and where their v rows start.
    let (mut p, mut at) = ([0f32; TILE], [0usize; TILE]);
    let q_t = transpose_lanes(q, rows, dqk, |r| ((sg.q_off + qt + r) * n_head + h) * dqk);
    let mut dots = vec![[0f32; LANES]; tile];
    for kt in (0..sg.k_len).step_by(tile) {
        let cols = tile.min(sg.k_len - kt);
        for (c, dc) in dots.iter_mut().enumerate().take(cols) {
            *dc = dots_lanes(&q_t, &k[(a.key_row(sg.k_off + kt + c) * n_head + h) * dqk..][..dqk]);
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
            let acc_r = &mut acc[r * dv..(r + 1) * dv];
            // The running max rarely moves; `x · 1` is `x`, so skipping it keeps every bit.
            if alpha != 1.0 {
                for x in acc_r.iter_mut() {
                    *x *= alpha;
                }
            }
            let mut psum = 0f32;
            let mut live = 0;
            for c in 0..cols {
                if s[c] == f32::NEG_INFINITY {
                    continue;
                }
                let pc = (s[c] - m_new).exp();
                psum += pc;
                (p[live], at[live]) = (pc, (a.key_row(sg.k_off + kt + c) * n_head + h) * dv);
                live += 1;
            }
            add_weighted_rows(acc_r, v, &p[..live], &at[..live]);
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
    (o, ls)
}

/// One sequence's view of a paged latent cache `[blocks·block_size, width]` (f32 rows
/// `[kv_c_normed | k_pe]`): logical position `pos` is row `pos % block_size` of block
/// `table[pos / block_size]`.
#[derive(Debug, Clone, Copy)]
pub struct PagedSeq<'a> {
    /// The whole cache `[blocks·block_size, width]`.
    pub cache: &'a [f32],
    /// Tokens per cache page.
    pub block_size: usize,
    /// Cache row width, L+R.
    pub width: usize,
    /// The sequence's block ids, in position order.
    pub table: &'a [usize],
}

impl<'a> PagedSeq<'a> {
    /// The row (`width` elements) of logical position `pos`. Panics when the table or the cache
    /// does not reach `pos` (the [`crate::compute::ops::Ops`] implementation checks first).
    #[inline(always)]
    pub fn row(&self, pos: usize) -> &'a [f32] {
        let slot = self.table[pos / self.block_size] * self.block_size + pos % self.block_size;
        &self.cache[slot * self.width..(slot + 1) * self.width]
    }
}

/// The inputs of one job of [`decode_split`]: one split of one decode token, for a group of up
/// to [`LANES`] of its heads.
#[derive(Debug, Clone)]
pub struct DecodeSplit<'a> {
    /// Query rows `[heads, width]`: each head's `[ql_nope | q_pe_roped]`, f32.
    pub q: &'a [f32],
    /// Heads in the group.
    pub heads: usize,
    /// The token's sequence in the paged cache.
    pub kv: PagedSeq<'a>,
    /// The logical positions of the split's keys.
    pub keys: std::ops::Range<usize>,
    /// Softmax scale multiplying `q·k`.
    pub scale: f32,
    /// Value width, L: the first `dv` columns of each cache row.
    pub dv: usize,
    /// LSE an empty split returns for every head.
    pub empty_lse: f32,
}

/// Stage 1 of split-KV decode for one token, a group of up to [`LANES`] of its heads and one
/// split (`s`, see [`DecodeSplit`]): online softmax over the keys at logical positions
/// `s.keys`, read from the paged latent cache through the block table (vLLM Triton MLA decode
/// stage 1).
///
/// The value is the first `s.dv` (= L) columns of each cache row. Writes each head's partial
/// output into `out` [heads, dv] and returns the heads' LSEs (natural-log); an empty range
/// writes nothing and returns `s.empty_lse` for every head (−inf is right: Triton MLA decode's
/// empty split). The heads share every cache row, so their dot products run side by side
/// ([`dots_lanes`]); each head's arithmetic, and so every bit, is that of a loop over the keys
/// for that head alone. Panics when a buffer is too short (the caller checks).
pub fn decode_split(s: &DecodeSplit<'_>, out: &mut [f32]) -> Vec<f32> {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        #[target_feature(enable = "avx2")]
        fn wide(s: &DecodeSplit<'_>, out: &mut [f32]) -> Vec<f32> {
            decode_split_impl(s, out)
        }
        // SAFETY: the processor has AVX2 (checked at run time).
        return unsafe { wide(s, out) };
    }
    decode_split_impl(s, out)
}

/// [`decode_split`]'s body, inlined into a baseline and an AVX2 copy.
#[inline(always)]
fn decode_split_impl(s: &DecodeSplit<'_>, out: &mut [f32]) -> Vec<f32> {
    let DecodeSplit {
        q,
        heads,
        kv,
        scale,
        dv,
        empty_lse,
        ..
    } = *s;
    let keys = s.keys.clone();
    if keys.is_empty() {
        return vec![empty_lse; heads];
    }
    let width = kv.width;
    let q_t = transpose_lanes(q, heads, width, |h| h * width);
    let mut m = vec![f32::NEG_INFINITY; heads];
    let mut l = vec![0f32; heads];
    let mut acc = vec![0f32; heads * dv];
    let positions: Vec<usize> = keys.collect();
    for block in positions.chunks(DECODE_KEY_BLOCK) {
        let rows: Vec<&[f32]> = block.iter().map(|&pos| &kv.row(pos)[..width]).collect();
        let dots = dots_lanes_keys(&q_t, &rows);
        let (mut alpha, mut p) = ([1f32; DECODE_KEY_BLOCK], [0f32; DECODE_KEY_BLOCK]);
        for h in 0..heads {
            // The softmax state moves key by key, as in a loop over single keys.
            for (k, d) in dots.iter().enumerate() {
                let s = d[h] * scale;
                let m_new = m[h].max(s);
                alpha[k] = (m[h] - m_new).exp();
                p[k] = (s - m_new).exp();
                l[h] = l[h] * alpha[k] + p[k];
                m[h] = m_new;
            }
            accumulate_keys(
                &mut acc[h * dv..(h + 1) * dv],
                &rows,
                &alpha[..rows.len()],
                &p[..rows.len()],
            );
        }
    }
    for h in 0..heads {
        for (o, &a) in out[h * dv..(h + 1) * dv].iter_mut().zip(&acc[h * dv..(h + 1) * dv]) {
            *o = a / l[h];
        }
    }
    (0..heads).map(|h| m[h] + l[h].ln()).collect()
}

/// Keys per step of [`decode_split`]: the q tile and the accumulators are read once per block of
/// keys instead of once per key (both together exceed the L1 cache at L = 512, 16 heads).
pub const DECODE_KEY_BLOCK: usize = 4;

/// [`dots_lanes`] for up to [`DECODE_KEY_BLOCK`] key rows at once: `out[k][lane]` sums
/// `q_t[d][lane] · rows[k][d]` for `d` ascending, the bits of `dots_lanes(q_t, rows[k])`.
#[inline(always)]
fn dots_lanes_keys(q_t: &[f32], rows: &[&[f32]]) -> Vec<[f32; LANES]> {
    if rows.len() != DECODE_KEY_BLOCK {
        return rows.iter().map(|r| dots_lanes(q_t, r)).collect();
    }
    let mut acc = [[0f32; LANES]; DECODE_KEY_BLOCK];
    for (d, qd) in q_t.chunks_exact(LANES).enumerate() {
        for (a, row) in acc.iter_mut().zip(rows) {
            let kd = row[d];
            for (x, &qv) in a.iter_mut().zip(qd) {
                *x += qv * kd;
            }
        }
    }
    acc.to_vec()
}

/// `acc = acc · alpha[k] + p[k] · rows[k][..dv]` for each key `k` in order, per element: the
/// online-softmax update of one head over a block of keys, with each accumulator held across the
/// block instead of stored after every key. Every element sees the operations of a loop over
/// single keys in the same order, so the bits are those of that loop.
#[inline(always)]
fn accumulate_keys(acc: &mut [f32], rows: &[&[f32]], alpha: &[f32], p: &[f32]) {
    const W: usize = 8;
    let dv = acc.len();
    let full = dv - dv % W;
    for c in (0..full).step_by(W) {
        let mut a: [f32; W] = acc[c..c + W].try_into().unwrap_or([0.0; W]);
        for ((row, &al), &pk) in rows.iter().zip(alpha).zip(p) {
            for (x, &v) in a.iter_mut().zip(&row[c..c + W]) {
                *x = *x * al + pk * v;
            }
        }
        acc[c..c + W].copy_from_slice(&a);
    }
    for (i, x) in acc.iter_mut().enumerate().skip(full) {
        for ((row, &al), &pk) in rows.iter().zip(alpha).zip(p) {
            *x = *x * al + pk * row[i];
        }
    }
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

    #[test]
    fn bmm_heads_has_the_bits_of_the_plain_loop_over_a() {
        // B = 2·BMM_COLS + 7: whole register blocks and a remainder; T odd: a token without a pair.
        let (t, nh, a, b) = (2 * BMM_TOKEN_TILE + 3, 3, 29, 2 * BMM_COLS + 7);
        let x = normal_f32(58, t * nh * a);
        let w = normal_f32(59, nh * a * b);
        let mut plain = vec![0f32; t * nh * b];
        for ti in 0..t {
            for h in 0..nh {
                for bi in 0..b {
                    let mut sum = 0f32;
                    for ai in 0..a {
                        sum += x[(ti * nh + h) * a + ai] * w[(h * a + ai) * b + bi];
                    }
                    plain[(ti * nh + h) * b + bi] = sum;
                }
            }
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        // 1, 2 and 3 threads: tiles of 19, 10 and 8 tokens.
        for threads in [1, 2, 3] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let got = pool.install(|| bmm_heads(&x, t, nh, a, &w, b));
            assert_eq!(bits(&got), bits(&plain), "{threads} threads");
        }
    }

    #[test]
    fn bmm_tiles_cover_one_per_thread_within_their_bounds() {
        assert_eq!(bmm_token_tile(512, 2), BMM_TOKEN_TILE_MAX);
        assert_eq!(bmm_token_tile(128, 2), 64);
        assert_eq!(bmm_token_tile(19, 3), 8);
        assert_eq!(bmm_token_tile(1, 16), BMM_TOKEN_TILE);
        assert_eq!(bmm_token_tile(0, 0), BMM_TOKEN_TILE);
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

    /// The kernels with an AVX2 copy give the bits of their baseline (SSE2) copy: the dispatching
    /// entry point against the `#[inline(always)]` body called from this baseline-compiled test.
    #[test]
    fn avx2_copies_of_the_kernels_give_the_baseline_bits() {
        #[cfg(target_arch = "x86_64")]
        if !has_avx2() {
            println!("skipped: this processor has no AVX2, so only the baseline copies run");
            return;
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        // Dims that are not multiples of the vector widths (4, 8) or of the tiles.
        let (width, dv, ctx, bs, heads) = (45, 37, 23usize, 4, 11);
        let table: Vec<usize> = (0..ctx.div_ceil(bs)).rev().collect();
        let cache = normal_f32(51, table.len() * bs * width);
        let q = normal_f32(52, heads * width);
        let (mut wide, mut base) = (canary_vec(heads * dv), canary_vec(heads * dv));
        let split = decode_job(&q, heads, paged(&cache, bs, width, &table), 1..ctx, 0.3, dv);
        let lw = decode_split(&split, &mut wide);
        let lb = decode_split_impl(&split, &mut base);
        assert_eq!((bits(&lw), bits(&wide)), (bits(&lb), bits(&base)), "decode_split");

        let (t, nh, a, b) = (BMM_TOKEN_TILE + 5, 3, 29, 35);
        let x = normal_f32(53, t * nh * a);
        let w = normal_f32(54, nh * a * b);
        let mut tiled = vec![0f32; t * nh * b];
        for (ci, rows) in tiled.chunks_mut(BMM_TOKEN_TILE * nh * b).enumerate() {
            bmm_tile(&x, ci * BMM_TOKEN_TILE, nh, a, &w, b, rows);
        }
        assert_eq!(bits(&bmm_heads(&x, t, nh, a, &w, b)), bits(&tiled), "bmm_heads");

        let (t, nh, dqk, dv) = (TILE * 2 + 7, 2, 29, 37);
        let (q, k, v) = (
            normal_f32(55, t * nh * dqk),
            normal_f32(56, t * nh * dqk),
            normal_f32(57, t * nh * dv),
        );
        let sg = Segment::causal_self(0, t);
        let (mut out, mut lse) = (canary_vec(t * nh * dv), canary_vec(t * nh));
        let segs = [sg];
        let args = prefill_args(&q, &k, &v, (nh, dqk, dv), &segs, 0.7, EmptyRows::ZeroMinusInf);
        flash_attention(&args, &mut out, &mut lse);
        for h in 0..nh {
            for qt in (0..t).step_by(TILE) {
                let (o, ls) = flash_tile(&FlashTile { a: &args, sg, h, qt });
                for (r, l) in ls.iter().enumerate() {
                    let row = qt + r;
                    assert_eq!(
                        l.map(f32::to_bits),
                        Some(lse[row * nh + h].to_bits()),
                        "flash lse row {row}"
                    );
                    assert_eq!(
                        bits(&o[r * dv..(r + 1) * dv]),
                        bits(&out[(row * nh + h) * dv..][..dv]),
                        "flash row {row}"
                    );
                }
            }
        }
    }

    /// A [`PagedSeq`] over `cache` through `table`.
    fn paged<'a>(cache: &'a [f32], block_size: usize, width: usize, table: &'a [usize]) -> PagedSeq<'a> {
        PagedSeq {
            cache,
            block_size,
            width,
            table,
        }
    }

    /// A [`DecodeSplit`] whose empty split reports LSE −inf.
    fn decode_job<'a>(
        q: &'a [f32],
        heads: usize,
        kv: PagedSeq<'a>,
        keys: std::ops::Range<usize>,
        scale: f32,
        dv: usize,
    ) -> DecodeSplit<'a> {
        DecodeSplit {
            q,
            heads,
            kv,
            keys,
            scale,
            dv,
            empty_lse: f32::NEG_INFINITY,
        }
    }

    /// A [`PrefillArgs`] on host slices, widths `(nh, dqk, dv)`.
    fn prefill_args<'a>(
        q: &'a [f32],
        k: &'a [f32],
        v: &'a [f32],
        (nh, dqk, dv): (usize, usize, usize),
        segments: &'a [Segment],
        scale: f32,
        empty: EmptyRows,
    ) -> PrefillArgs<'a, [f32]> {
        PrefillArgs {
            q,
            k,
            v,
            nh,
            dqk,
            dv,
            segments,
            scale,
            empty,
            key_rows: None,
        }
    }

    #[test]
    fn flash_attention_matches_naive_causal_across_tiles() {
        let (t, nh, dqk, dv) = (37, 3, 5, 4);
        let q = normal_f32(1, t * nh * dqk);
        let k = normal_f32(2, t * nh * dqk);
        let v = normal_f32(3, t * nh * dv);
        let mut out = canary_vec(t * nh * dv);
        let mut lse = canary_vec(t * nh);
        let seg = [Segment::causal_self(0, t)];
        let args = prefill_args(&q, &k, &v, (nh, dqk, dv), &seg, 0.7, EmptyRows::ZeroMinusInf);
        flash_attention(&args, &mut out, &mut lse);
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
    fn keys_read_by_index_have_the_bits_of_a_gathered_copy() {
        // 40 query rows over 50 key rows: rows 0..20 keep every key up to themselves (a causal
        // run, as DSA keeps all keys while T ≤ top-k), rows 20..36 keep 20 keys spread over
        // their prefix (more than one key tile, out of position order for two rows), rows 36..40
        // keep nothing, one key, and a repeated run.
        let (nq, nk, nh, dqk, dv) = (40, 50, 3, 40, 36);
        let q = normal_f32(31, nq * nh * dqk);
        let k = normal_f32(32, nk * nh * dqk);
        let v = normal_f32(33, nk * nh * dv);
        let mut keys: Vec<Vec<usize>> = (0..20).map(|i| (0..=i).collect()).collect();
        keys.extend((20..36).map(|i| (0..20).map(|j| (j * 7 + i) % (i + 1)).collect::<Vec<_>>()));
        keys[30].reverse();
        keys.extend([vec![], vec![49], vec![3, 4], vec![3, 4, 5]]);
        let (segs, rows) = crate::compute::ops::sparse_segments(&keys);
        // The causal run is one segment; the other rows are their own (the last pair is a run).
        assert_eq!(
            segs[0],
            Segment {
                q_off: 0,
                q_len: 20,
                k_off: 0,
                k_len: 20,
                causal: true
            }
        );
        assert_eq!(segs.len(), 1 + 16 + 3);
        assert_eq!(rows.len(), 20 + 16 * 20 + 1 + 3);
        let mut indexed = (canary_vec(nq * nh * dv), canary_vec(nq * nh));
        let mut args = prefill_args(&q, &k, &v, (nh, dqk, dv), &segs, 0.3, EmptyRows::ZeroMinusInf);
        args.key_rows = Some(&rows);
        flash_attention(&args, &mut indexed.0, &mut indexed.1);
        // The copy: each row's kept keys gathered, one segment per row.
        let (mut kg, mut vg, mut gsegs) = (Vec::new(), Vec::new(), Vec::new());
        for (i, kr) in keys.iter().enumerate() {
            gsegs.push(Segment {
                q_off: i,
                q_len: 1,
                k_off: kg.len() / (nh * dqk),
                k_len: kr.len(),
                causal: false,
            });
            for &j in kr {
                kg.extend_from_slice(&k[j * nh * dqk..(j + 1) * nh * dqk]);
                vg.extend_from_slice(&v[j * nh * dv..(j + 1) * nh * dv]);
            }
        }
        let mut copied = (canary_vec(nq * nh * dv), canary_vec(nq * nh));
        let args = prefill_args(&q, &kg, &vg, (nh, dqk, dv), &gsegs, 0.3, EmptyRows::ZeroMinusInf);
        flash_attention(&args, &mut copied.0, &mut copied.1);
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&indexed.0), bits(&copied.0));
        assert_eq!(bits(&indexed.1), bits(&copied.1));
        assert_eq!(indexed.1[36 * nh], f32::NEG_INFINITY, "the row with no key");
        assert!(indexed.1.iter().skip(nh).take(35 * nh).all(|x| x.is_finite()));
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
        let one_head = |empty| prefill_args(&q, &k, &v, (1, 2, 2), &seg, 1.0, empty);
        let mut out = canary_vec(3 * 2);
        let mut lse = canary_vec(3);
        flash_attention(&one_head(EmptyRows::ZeroMinusInf), &mut out, &mut lse);
        assert_eq!(lse[0], f32::NEG_INFINITY);
        assert_eq!(&out[..2], &[0.0, 0.0]);
        assert!(lse[1].is_finite() && lse[2].is_finite());
        let mut out = canary_vec(3 * 2);
        let mut lse = canary_vec(3);
        flash_attention(&one_head(EmptyRows::Skip), &mut out, &mut lse);
        assert!(crate::core::canary::is_canary(lse[0]) && crate::core::canary::is_canary(out[0]));
        let mut lse = canary_vec(3);
        flash_attention(&one_head(EmptyRows::ZeroPlusInf), &mut out, &mut lse);
        assert_eq!(lse[0], f32::INFINITY);
    }

    #[test]
    fn tiled_bmm_heads_is_bit_identical_to_one_token_at_a_time() {
        // T not a multiple of the tile, so the last tile is partial.
        let (t, nh, a, b) = (BMM_TOKEN_TILE * 2 + 3, 3, 37, 29);
        let x = crate::core::batch::normal_f32(11, t * nh * a);
        let w = crate::core::batch::normal_f32(12, nh * a * b);
        let got = bmm_heads(&x, t, nh, a, &w, b);
        let mut want = vec![0f32; t * nh * b];
        for ti in 0..t {
            for h in 0..nh {
                let o = &mut want[(ti * nh + h) * b..(ti * nh + h + 1) * b];
                for ai in 0..a {
                    let xv = x[(ti * nh + h) * a + ai];
                    for (bi, v) in o.iter_mut().enumerate() {
                        *v += xv * w[(h * a + ai) * b + bi];
                    }
                }
            }
        }
        assert_eq!(
            got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        assert!(got.iter().all(|v| v.is_finite()));
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
        let kv = paged(&cache, bs, width, &table);
        let mut grouped = canary_vec(heads * dv);
        let lg = decode_split(&decode_job(&q, heads, kv, 3..ctx, 0.3, dv), &mut grouped);
        for h in 0..heads {
            let mut one = canary_vec(dv);
            let qh = &q[h * width..(h + 1) * width];
            let l1 = decode_split(&decode_job(qh, 1, kv, 3..ctx, 0.3, dv), &mut one);
            assert_eq!(lg[h].to_bits(), l1[0].to_bits(), "lse of head {h}");
            let same = one
                .iter()
                .zip(&grouped[h * dv..])
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "output of head {h}");
        }
    }

    #[test]
    fn blocked_decode_is_bit_identical_to_a_loop_over_single_keys() {
        // dv not a multiple of the vector width, key count not a multiple of the block, and a
        // large score late in the range so the running max moves inside a block.
        let (width, dv, ctx, bs, heads) = (45, 37, 23usize, 4, 3);
        let table: Vec<usize> = (0..ctx.div_ceil(bs)).rev().collect();
        let mut cache = normal_f32(41, table.len() * bs * width);
        let q = normal_f32(42, heads * width);
        let boost = paged(&cache, bs, width, &table).row(18).as_ptr() as usize - cache.as_ptr() as usize;
        cache[boost / 4..boost / 4 + width].iter_mut().for_each(|x| *x *= 6.0);
        let kv = paged(&cache, bs, width, &table);
        let keys = 2..ctx;
        let mut got = canary_vec(heads * dv);
        let lse = decode_split(&decode_job(&q, heads, kv, keys.clone(), 0.3, dv), &mut got);
        for h in 0..heads {
            let qh = &q[h * width..(h + 1) * width];
            let (mut m, mut l, mut acc) = (f32::NEG_INFINITY, 0f32, vec![0f32; dv]);
            let mut moved = 0;
            for pos in keys.clone() {
                let row = kv.row(pos);
                let mut dot = 0f32;
                for d in 0..width {
                    dot += qh[d] * row[d];
                }
                let s = dot * 0.3;
                let m_new = m.max(s);
                moved += usize::from(m_new != m);
                let alpha = (m - m_new).exp();
                let p = (s - m_new).exp();
                for (a, &x) in acc.iter_mut().zip(&row[..dv]) {
                    *a = *a * alpha + p * x;
                }
                l = l * alpha + p;
                m = m_new;
            }
            assert!(moved > 1, "head {h}: the running max moved {moved} times");
            assert_eq!(lse[h].to_bits(), (m + l.ln()).to_bits(), "lse of head {h}");
            for (d, &a) in acc.iter().enumerate() {
                assert_eq!(got[h * dv + d].to_bits(), (a / l).to_bits(), "head {h}, element {d}");
            }
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
        let kv = paged(&cache, bs, width, &table);
        let l_whole = decode_split(&decode_job(&q, 1, kv, 0..ctx, 0.5, dv), &mut whole)[0];
        let mut parts = vec![canary_vec(dv); 4];
        let mut lses = [0f32; 4];
        let split = ctx.div_ceil(4);
        for (s, p) in parts.iter_mut().enumerate() {
            let r = (s * split).min(ctx)..((s + 1) * split).min(ctx);
            lses[s] = decode_split(&decode_job(&q, 1, kv, r, 0.5, dv), p)[0];
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
