//! The reference: textbook expanded MLA in f64, the judge of every other path.
//!
//! Nothing else decides what is right, so this module is written to be read against MLA.md steps
//! 1–9 line by line, and shares no code with the engine paths it judges beyond loading and
//! dequantizing weights: its own RMSNorm, RoPE (interleaved, with YaRN frequencies), kv_b
//! assembly and attention. Every product accumulates in f64 from the f32 dequantized weights, over
//! the whole sequence, causal, with no cache and no fusion. It records EVERY site of DESIGN.md's
//! table, the absorbed-only ones (`ql_nope`, `attn_latent`, `w.W_UK_T`, `w.W_UV`) included,
//! computed from its own weights and probabilities, so any path's record has a counterpart.
//!
//! Sources: DeepSeek-V2 paper (arXiv:2405.04434) §2.1; HF transformers `modeling_deepseek_v3.py`;
//! vLLM `model_executor/models/deepseek_v2.py`.

use ndarray::{Array1, Array2, Array3, ArrayView1, ArrayView2, ArrayViewMut2, Axis, CowArray, Ix2, s};
use rayon::prelude::*;

use crate::batch::Batch;
use crate::config::MlaConfig;
use crate::error::{Error, Result};
use crate::trace::{RankedWeight, Site, Stage, Trace, TraceTensor};
use crate::weights::{KvBWeights, LayerWeights, QWeights};

/// Output of one reference layer.
#[derive(Debug, Clone)]
pub struct RefLayer {
    /// Every site of the layer, f64.
    pub trace: Trace,
    /// `hidden_out` [T, H], or `None` for a layer whose FFN is not dense (MoE, not yet supported).
    pub hidden_out: Option<Array2<f64>>,
}

/// Widens an f32 matrix to f64 (exact).
pub fn f64m(a: &Array2<f32>) -> Array2<f64> {
    a.mapv(f64::from)
}

/// Rows of W (output columns) per parallel work item of [`linear`]: fixed, so the split never
/// depends on the thread count.
const OUT_BLOCK: usize = 256;

/// `y = x · Wᵀ` (PyTorch `F.linear`): x [T, K], W [O, K] → [T, O], f64.
///
/// W's rows are cut into blocks of [`OUT_BLOCK`] run in parallel with rayon, each block one
/// matrixmultiply dgemm over the whole K writing its own output columns. matrixmultiply
/// accumulates every output element over K in the same order whatever the other dims (k-blocks
/// in order, one FMA chain per block), so the result is bit-identical to `x.dot(&w.t())` for any
/// thread count (tested below, and by the golden traces).
fn linear(x: &Array2<f64>, w: &Array2<f64>) -> Array2<f64> {
    linear_blocks(x, w.nrows(), |r| CowArray::from(w.slice(s![r, ..])))
}

/// [`linear`] with f32 weights, widened to f64 (exactly) one block at a time inside each work
/// item: the same bits as `linear(x, &f64m(w))` without a whole f64 copy of W (940 MB for
/// DeepSeek-V3's `o_proj`).
fn linear32(x: &Array2<f64>, w: &Array2<f32>) -> Array2<f64> {
    linear_blocks(x, w.nrows(), |r| CowArray::from(w.slice(s![r, ..]).mapv(f64::from)))
}

/// The block loop of [`linear`]: `block(rows)` gives W's rows `rows` as f64 [rows.len(), K].
fn linear_blocks<'w, F>(x: &Array2<f64>, o: usize, block: F) -> Array2<f64>
where
    F: Fn(std::ops::Range<usize>) -> CowArray<'w, f64, Ix2> + Sync,
{
    let mut y = Array2::<f64>::zeros((x.nrows(), o));
    let blocks: Vec<(usize, ArrayViewMut2<f64>)> = y.axis_chunks_iter_mut(Axis(1), OUT_BLOCK).enumerate().collect();
    blocks.into_par_iter().for_each(|(i, mut yb)| {
        let r0 = i * OUT_BLOCK;
        let wb = block(r0..r0 + yb.ncols());
        ndarray::linalg::general_mat_mul(1.0, x, &wb.t(), 0.0, &mut yb);
    });
    y
}

/// RMSNorm over the last dim: `x / sqrt(mean(x²) + eps) · g`.
fn rms_norm(x: ArrayView2<f64>, g: ArrayView1<f32>, eps: f64) -> Array2<f64> {
    let mut out = x.to_owned();
    for mut row in out.rows_mut() {
        let ms = row.iter().map(|v| v * v).sum::<f64>() / row.len() as f64;
        let inv = 1.0 / (ms + eps).sqrt();
        for (v, &gi) in row.iter_mut().zip(g.iter()) {
            *v = *v * inv * gi as f64;
        }
    }
    out
}

/// Rotary inverse frequencies `f_i`, i < R/2, with YaRN interpolation when configured
/// (MLA.md step 9).
pub fn rope_inv_freq(cfg: &MlaConfig) -> Vec<f64> {
    let r = cfg.qk_rope_head_dim;
    let base = cfg.rope_base;
    let plain: Vec<f64> = (0..r / 2).map(|i| base.powf(-(2.0 * i as f64) / r as f64)).collect();
    let Some(y) = cfg.yarn else { return plain };
    let corr =
        |n_rot: f64| r as f64 * (y.original_context / (n_rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln());
    let lo = corr(y.beta_fast).floor().clamp(0.0, (r - 1) as f64);
    let mut hi = corr(y.beta_slow).ceil().clamp(0.0, (r - 1) as f64);
    if lo == hi {
        hi += 0.001;
    }
    plain
        .iter()
        .enumerate()
        .map(|(i, &f)| {
            let ramp = ((i as f64 - lo) / (hi - lo)).clamp(0.0, 1.0);
            f / y.factor * ramp + f * (1.0 - ramp)
        })
        .collect()
}

/// Interleaved (GPT-J) rotation of one rope vector at `pos`: pairs `(x[2i], x[2i+1])`.
fn rope_interleaved(x: &mut [f64], pos: usize, inv_freq: &[f64]) {
    for (i, &f) in inv_freq.iter().enumerate() {
        let (sin, cos) = (pos as f64 * f).sin_cos();
        let (a, b) = (x[2 * i], x[2 * i + 1]);
        x[2 * i] = a * cos - b * sin;
        x[2 * i + 1] = a * sin + b * cos;
    }
}

/// Rebuilds `kv_b_proj` [N·(P+V), L] from the file's tensors (MLA.md "Rebuilding kv_b"):
/// `W[h·(P+V) + p, l] = k_b[h, l, p]`, `W[h·(P+V) + P + v, l] = v_b[h, v, l]`.
pub fn assemble_kv_b(cfg: &MlaConfig, w: &KvBWeights) -> Array2<f64> {
    let (n, l, p, v) = (cfg.n_head, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim);
    match w {
        KvBWeights::Fused { kv_b } => f64m(kv_b),
        KvBWeights::Split { k_b, v_b } => {
            let mut out = Array2::<f64>::zeros((n * (p + v), l));
            for h in 0..n {
                for li in 0..l {
                    for pi in 0..p {
                        out[[h * (p + v) + pi, li]] = k_b[[h, li, pi]] as f64;
                    }
                    for vi in 0..v {
                        out[[h * (p + v) + p + vi, li]] = v_b[[h, vi, li]] as f64;
                    }
                }
            }
            out
        }
    }
}

fn rec2(trace: &mut Trace, layer: usize, stage: Stage, a: &Array2<f64>) {
    trace.record(
        Site::new(layer, stage),
        TraceTensor::f64(a.shape().to_vec(), a.iter().copied().collect()),
    );
}

fn rec3(trace: &mut Trace, layer: usize, stage: Stage, a: &Array3<f64>) {
    trace.record(
        Site::new(layer, stage),
        TraceTensor::f64(a.shape().to_vec(), a.iter().copied().collect()),
    );
}

/// Runs one MLA layer (attention, attention residual, dense FFN and its residual) on
/// `hidden_in` [T, H] for the sequences of `batch`, recording every site.
///
/// Errors: [`Error::Usage`] when `hidden_in` has the wrong shape for `cfg`/`batch`.
pub fn forward(cfg: &MlaConfig, w: &LayerWeights, hidden_in: &Array2<f64>, batch: &Batch) -> Result<RefLayer> {
    let t = batch.n_tokens();
    let (hd, n, l, p, r, v) = (
        cfg.hidden,
        cfg.n_head,
        cfg.kv_lora_rank,
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.v_head_dim,
    );
    if hidden_in.shape() != [t, hd] {
        return Err(Error::Usage(format!(
            "reference: hidden_in has shape {:?}, expected [T={t}, H={hd}]",
            hidden_in.shape()
        )));
    }
    let layer = w.layer;
    let eps = cfg.rms_eps;
    let mut tr = Trace::new();
    rec2(&mut tr, layer, Stage::HiddenIn, hidden_in);

    // Step 1: attn_norm.
    let x = rms_norm(hidden_in.view(), w.attn_norm.view(), eps);
    rec2(&mut tr, layer, Stage::AttnIn, &x);

    // Step 2: q path.
    let q_flat = match &w.q {
        QWeights::Lora { q_a, q_a_norm, q_b } => {
            let kv_a_w = f64m(&w.kv_a_mqa);
            let q_a = f64m(q_a);
            let fused =
                ndarray::concatenate(Axis(0), &[q_a.view(), kv_a_w.view()]).map_err(|e| Error::Usage(e.to_string()))?;
            rec2(&mut tr, layer, Stage::WFusedQkvA, &fused);
            let q_c = linear(&x, &q_a);
            rec2(&mut tr, layer, Stage::QC, &q_c);
            let q_c_normed = rms_norm(q_c.view(), q_a_norm.view(), eps);
            rec2(&mut tr, layer, Stage::QCNormed, &q_c_normed);
            linear32(&q_c_normed, q_b)
        }
        QWeights::Direct { q } => linear32(&x, q),
    };
    let q = q_flat
        .into_shape_with_order((t, n, p + r))
        .map_err(|e| Error::Usage(e.to_string()))?;
    rec3(&mut tr, layer, Stage::Q, &q);

    // Step 3: kv path. kv_c is a view of kv_a; the norm applies to kv_c only.
    let kv_a = linear32(&x, &w.kv_a_mqa);
    rec2(&mut tr, layer, Stage::KvA, &kv_a);
    let kv_c_normed = rms_norm(kv_a.slice(s![.., ..l]), w.kv_a_norm.view(), eps);
    rec2(&mut tr, layer, Stage::KvCNormed, &kv_c_normed);
    let k_pe = kv_a.slice(s![.., l..]).to_owned();
    rec2(&mut tr, layer, Stage::KPe, &k_pe);

    // Step 4: RoPE (interleaved pairs), positions from the batch.
    let inv_freq = rope_inv_freq(cfg);
    let positions = batch.positions();
    let mut q_pe_roped = q.slice(s![.., .., p..]).to_owned();
    let mut k_pe_roped = k_pe.clone();
    for ti in 0..t {
        for h in 0..n {
            let mut row: Vec<f64> = q_pe_roped.slice(s![ti, h, ..]).to_vec();
            rope_interleaved(&mut row, positions[ti], &inv_freq);
            q_pe_roped.slice_mut(s![ti, h, ..]).assign(&Array1::from(row));
        }
        let mut row: Vec<f64> = k_pe_roped.row(ti).to_vec();
        rope_interleaved(&mut row, positions[ti], &inv_freq);
        k_pe_roped.row_mut(ti).assign(&Array1::from(row));
    }
    rec3(&mut tr, layer, Stage::QPeRoped, &q_pe_roped);
    rec2(&mut tr, layer, Stage::KPeRoped, &k_pe_roped);

    // Step 5: expanded K/V through kv_b (per-head interleaved rows).
    let kv_b = assemble_kv_b(cfg, &w.kv_b);
    rec2(&mut tr, layer, Stage::WKvB, &kv_b);
    let kv = linear(&kv_c_normed, &kv_b)
        .into_shape_with_order((t, n, p + v))
        .map_err(|e| Error::Usage(e.to_string()))?;
    let k_nope = kv.slice(s![.., .., ..p]).to_owned();
    let vv = kv.slice(s![.., .., p..]).to_owned();
    rec3(&mut tr, layer, Stage::KNope, &k_nope);
    rec3(&mut tr, layer, Stage::V, &vv);

    // Step 6 weights: W_UK_T [N, P, L] and W_UV [N, L, V] from the same kv_b.
    let mut w_uk_t = Array3::<f64>::zeros((n, p, l));
    let mut w_uv = Array3::<f64>::zeros((n, l, v));
    for h in 0..n {
        for li in 0..l {
            for pi in 0..p {
                w_uk_t[[h, pi, li]] = kv_b[[h * (p + v) + pi, li]];
            }
            for vi in 0..v {
                w_uv[[h, li, vi]] = kv_b[[h * (p + v) + p + vi, li]];
            }
        }
    }
    rec3(&mut tr, layer, Stage::WUkT, &w_uk_t);
    rec3(&mut tr, layer, Stage::WUv, &w_uv);
    // ql_nope = q_nope · W_UK_T per head.
    let mut ql_nope = Array3::<f64>::zeros((t, n, l));
    for h in 0..n {
        let qn = q.slice(s![.., h, ..p]);
        let prod = qn.dot(&w_uk_t.slice(s![h, .., ..]));
        ql_nope.slice_mut(s![.., h, ..]).assign(&prod);
    }
    rec3(&mut tr, layer, Stage::QlNope, &ql_nope);

    // Attention, causal within each sequence, softmax scale of step 7. Each (token, head) row
    // is computed on its own, in a fixed order, so the result does not depend on threading.
    let scale = cfg.softmax_scale;
    let qs = q.as_standard_layout();
    let qs = qs.as_slice().unwrap_or(&[]);
    let (kn, qpe, kpe, vs, kvc) = (
        k_nope.as_standard_layout(),
        q_pe_roped.as_standard_layout(),
        k_pe_roped.as_standard_layout(),
        vv.as_standard_layout(),
        kv_c_normed.as_standard_layout(),
    );
    let (kn, qpe, kpe, vs, kvc) = (
        kn.as_slice().unwrap_or(&[]),
        qpe.as_slice().unwrap_or(&[]),
        kpe.as_slice().unwrap_or(&[]),
        vs.as_slice().unwrap_or(&[]),
        kvc.as_slice().unwrap_or(&[]),
    );
    let offsets = batch.offsets();
    let seq_of: Vec<(usize, usize)> = batch
        .seqs
        .iter()
        .zip(&offsets)
        .flat_map(|(sq, &off)| (0..sq.len).map(move |i| (off, i)))
        .collect();
    let rows: Vec<(Vec<f64>, Vec<f64>, f64)> = (0..t * n)
        .into_par_iter()
        .map(|row| {
            let (ti, h) = (row / n, row % n);
            let (off, i) = seq_of[ti];
            let qrow = &qs[(ti * n + h) * (p + r)..(ti * n + h) * (p + r) + p];
            let qpr = &qpe[(ti * n + h) * r..(ti * n + h + 1) * r];
            let logits: Vec<f64> = (off..=off + i)
                .map(|tj| {
                    let krow = &kn[(tj * n + h) * p..(tj * n + h + 1) * p];
                    let kp = &kpe[tj * r..(tj + 1) * r];
                    let nope: f64 = qrow.iter().zip(krow).map(|(a, b)| a * b).sum();
                    let pe: f64 = qpr.iter().zip(kp).map(|(a, b)| a * b).sum();
                    scale * (nope + pe)
                })
                .collect();
            let m = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = logits.iter().map(|&z| (z - m).exp()).collect();
            let sum: f64 = e.iter().sum();
            let mut out = vec![0f64; v];
            let mut lat = vec![0f64; l];
            for (j, &ej) in e.iter().enumerate() {
                let pj = ej / sum;
                let tj = off + j;
                for (o, x) in out.iter_mut().zip(&vs[(tj * n + h) * v..(tj * n + h + 1) * v]) {
                    *o += pj * x;
                }
                for (o, x) in lat.iter_mut().zip(&kvc[tj * l..(tj + 1) * l]) {
                    *o += pj * x;
                }
            }
            (out, lat, m + sum.ln())
        })
        .collect();
    let mut attn_out = Array3::<f64>::zeros((t, n, v));
    let mut attn_latent = Array3::<f64>::zeros((t, n, l));
    let mut lse = Array2::<f64>::zeros((t, n));
    for (row, (o, lat, ls)) in rows.into_iter().enumerate() {
        let (ti, h) = (row / n, row % n);
        attn_out.slice_mut(s![ti, h, ..]).assign(&Array1::from(o));
        attn_latent.slice_mut(s![ti, h, ..]).assign(&Array1::from(lat));
        lse[[ti, h]] = ls;
    }
    rec3(&mut tr, layer, Stage::AttnLatent, &attn_latent);
    rec2(&mut tr, layer, Stage::Lse, &lse);
    rec3(&mut tr, layer, Stage::AttnOut, &attn_out);

    // Step 8: o_proj over the head-major [T, N·V] input.
    let attn_flat = attn_out
        .into_shape_with_order((t, n * v))
        .map_err(|e| Error::Usage(e.to_string()))?;
    let o = linear32(&attn_flat, &w.o_proj);
    rec2(&mut tr, layer, Stage::OProj, &o);

    // Residual and dense SwiGLU FFN.
    let hidden_out = w.ffn.as_ref().map(|ffn| {
        let h1 = hidden_in + &o;
        let xn = rms_norm(h1.view(), ffn.norm.view(), eps);
        let gate = linear32(&xn, &ffn.gate);
        let up = linear32(&xn, &ffn.up);
        let act = ndarray::Zip::from(&gate)
            .and(&up)
            .map_collect(|&g, &u| g / (1.0 + (-g).exp()) * u);
        h1 + linear32(&act, &ffn.down)
    });
    if let Some(ho) = &hidden_out {
        rec2(&mut tr, layer, Stage::HiddenOut, ho);
    }
    Ok(RefLayer { trace: tr, hidden_out })
}

/// The reference's per-rank weight shards for `--tp tp` (sites `w.<weight>.rank<r>`), sliced
/// from its own assembly of the GGUF tensors: `q_b`/`q` and `kv_b` by head rows, `o_proj` by
/// head columns of its input dim.
///
/// Returns an empty trace for `tp < 2`. `tp` must divide N (checked by the caller).
pub fn rank_weight_sites(cfg: &MlaConfig, w: &LayerWeights, tp: usize) -> Trace {
    let mut tr = Trace::new();
    if tp < 2 {
        return tr;
    }
    let (n, p, r, v) = (cfg.n_head, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim);
    let nh = n / tp;
    let q = match &w.q {
        QWeights::Lora { q_b, .. } => f64m(q_b),
        QWeights::Direct { q } => f64m(q),
    };
    let kv_b = assemble_kv_b(cfg, &w.kv_b);
    let o = f64m(&w.o_proj);
    for rank in 0..tp {
        let rk = rank as u32;
        let heads = rank * nh..(rank + 1) * nh;
        let qs = q.slice(s![heads.start * (p + r)..heads.end * (p + r), ..]).to_owned();
        rec2(&mut tr, w.layer, Stage::WRank(RankedWeight::QProj, rk), &qs);
        let ks = kv_b
            .slice(s![heads.start * (p + v)..heads.end * (p + v), ..])
            .to_owned();
        rec2(&mut tr, w.layer, Stage::WRank(RankedWeight::KvB, rk), &ks);
        let os = o.slice(s![.., heads.start * v..heads.end * v]).to_owned();
        rec2(&mut tr, w.layer, Stage::WRank(RankedWeight::OProj, rk), &os);
    }
    tr
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parallel_linear_is_bit_identical_to_one_dgemm() {
        // Odd sizes: partial output blocks, partial matrixmultiply tiles and several k-blocks.
        let (t, k, o) = (37, 700, 1000);
        let xs = crate::batch::normal_f32(1, t * k);
        let ws = crate::batch::normal_f32(2, o * k);
        let x = Array2::from_shape_vec((t, k), xs.iter().map(|&v| v as f64 * 1.7).collect()).unwrap();
        let w = Array2::from_shape_vec((o, k), ws).unwrap();
        let expected = x.dot(&f64m(&w).t());
        for threads in [1, 2, 3] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let (a, b) = pool.install(|| (linear32(&x, &w), linear(&x, &f64m(&w))));
            for got in [a, b] {
                let differ = got
                    .iter()
                    .zip(&expected)
                    .filter(|(g, e)| g.to_bits() != e.to_bits())
                    .count();
                assert_eq!(differ, 0, "{threads} threads: {differ} values differ in bits");
            }
        }
    }
}
