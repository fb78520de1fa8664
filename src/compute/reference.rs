//! The reference: textbook expanded MLA in f64, the judge of every other path.
//!
//! Nothing else decides what is right, so this module is written to be read against docs/mla.md steps
//! 1–9 line by line, and shares no code with the engine paths it judges beyond loading and
//! dequantizing weights and the DSA top-k rule and trace layout of [`crate::compute::indexer`] (which HF's
//! goldens check independently: the same key sets at every indexer layer): its own RMSNorm, RoPE
//! (interleaved, NeoX for MiniCPM3, with YaRN frequencies), kv_b
//! assembly and attention. Every product accumulates in f64 from the f32 dequantized weights, over
//! the whole sequence, causal, with no cache and no fusion. It records EVERY site of docs/design.md's
//! table, the absorbed-only ones (`ql_nope`, `attn_latent`, `w.W_UK_T`, `w.W_UV`) included,
//! computed from its own weights and probabilities, so any path's record has a counterpart.
//!
//! Sources: DeepSeek-V2 paper (arXiv:2405.04434) §2.1; HF transformers `modeling_deepseek_v3.py`;
//! vLLM `model_executor/models/deepseek_v2.py`.
//!
//! The FFN after attention (the dense SwiGLU MLP, the MoE block with its shared experts, and the
//! MLP's per-rank sites under TP) lives in the submodule `ffn`.

pub mod context;
mod ffn;

use ndarray::{Array1, Array2, Array3, ArrayView1, ArrayView2, ArrayViewMut2, Axis, CowArray, Ix2, s};
use rayon::prelude::*;

use crate::compute::indexer::{self, AttendKeys, Selection};
use crate::core::batch::Batch;
use crate::core::error::{Error, Result};
use crate::core::fp8::{ActQuant, KvCacheQuant, QkQuant};
use crate::core::trace::{RankedWeight, Site, Stage, Trace, TraceTensor};
use crate::model::config::MlaConfig;
use crate::model::gguf::GgufFile;
use crate::model::weights::{KvBWeights, LayerWeights, NonFiniteTensor, QWeights, into_row_major};

pub use ffn::{MoeOut, ffn_rank_sites, ffn_rank_sites_of, forward_full, forward_full_sel, moe_ffn, route};

/// Output of one reference layer.
#[derive(Debug, Clone)]
pub struct RefLayer {
    /// Every site of the layer, f64.
    pub trace: Trace,
    /// `hidden_out` [T, H]; `None` for an MoE layer run by [`forward`] alone (its FFN is
    /// [`moe_ffn`]'s, which [`forward_full`] adds).
    pub hidden_out: Option<Array2<f64>>,
    /// Weights found non-finite while computing the layer's MoE FFN (router, bias, shared and
    /// the selected experts), as [`LayerWeights::nonfinite`] reports them.
    pub moe_nonfinite: Vec<NonFiniteTensor>,
    /// The DSA selection this layer's attention used (`deepseek32`/`glm-dsa`), for a later
    /// shared-indexer layer; `None` without an indexer.
    pub selection: Option<Selection>,
}

/// What a DSA layer's reference takes besides its input (all optional; the default is a layer
/// on its own, unquantized, attending to its own selection).
#[derive(Debug, Clone, Copy, Default)]
pub struct RefInputs<'a> {
    /// The selection a GLM "shared" layer borrows (the nearest earlier full layer's); see
    /// [`forward_sel`].
    pub shared: Option<&'a Selection>,
    /// Keys some tokens' attention reads instead of the layer's selection (an engine's recorded
    /// selection, so its attention is judged on its own keys). `idx_topk`, `idx_scores` and
    /// [`RefLayer::selection`] stay the layer's own.
    pub attend: Option<&'a AttendKeys>,
    /// The engine's quantization of the indexer's query and key before scoring
    /// ([`indexer::quantize_qk`]); `idx_scores` and the selection are then those of the
    /// quantized operands.
    pub quant: Option<&'a QkQuant>,
    /// The engine's fp8 GEMMs: the activation quantization applied at the input of every
    /// projection ([`Fp8Compute`]); `None`: projections read their inputs as they are.
    pub fp8: Option<&'a Fp8Compute<'a>>,
}

/// An engine's fp8 compute, as the reference applies it: every projection of the layer
/// (`fused_qkv_a` or `q_proj` and `kv_a`, `q_b`, `kv_b` where attention runs expanded, `o_proj`,
/// the MLP's `gate_up` and `down`, an MoE layer's experts: [`moe_ffn`]) reads its input quantized
/// by [`ActQuant`]; the weights are the
/// dequantized ones on both sides (vLLM's block GEMM applies `weight_scale_inv` per block, the
/// same products in another order of f32 rounding).
///
/// vLLM's decode does not run `kv_b_proj` as an fp8 GEMM: `process_weights_after_loading`
/// dequantizes it into `W_UK_T` and `W_UV`, and the absorbed products read the latent
/// unquantized. A token whose attention ran absorbed (a decode query, `forward_mqa`) therefore
/// scores keys whose `k_nope` and `v` come from the unquantized latent, while a prefill token
/// (`forward_mha`, the chunked context too) scores keys expanded from the quantized latent.
///
/// An fp8 latent cache (`kv_cache`) rounds what the absorbed tokens read: their keys' `kv_c_normed`
/// and `k_pe` (and so `k_nope`/`v` through `W_UK_T`/`W_UV`) and the latent their attention sums.
/// Expanded tokens attend over the step's own K/V, as `forward_mha` does.
#[derive(Debug, Clone, Copy)]
pub struct Fp8Compute<'a> {
    /// The activation quantization; `None`: projections read their inputs as they are.
    pub act: Option<ActQuant>,
    /// The latent cache's fp8 rounding; `None`: the cache holds the values as they are.
    pub kv_cache: Option<KvCacheQuant>,
    /// Ranks of the row-parallel projections (`o_proj`, the MLP's `down`): each rank quantizes
    /// its own slice of the input columns. 1 without TP.
    pub tp: usize,
    /// Per token of the batch (packed order): whether its attention ran absorbed. `None`:
    /// every token's ran expanded.
    pub absorbed: Option<&'a [bool]>,
    /// Per token: whether it is cached context of this step (computed and written to the cache
    /// by an earlier step). With an fp8 cache, the step's expanded (prefill) tokens read such
    /// keys back from the cache, rounded (vLLM's `_compute_prefill_context`), and their own new
    /// keys as computed; context tokens' own outputs are their earlier step's, over fresh keys.
    /// `None`: no token is context.
    pub context: Option<&'a [bool]>,
}

/// An attention's three outputs: `attn_out` [T, N, V], `attn_latent` [T, N, L], `lse` [T, N].
type AttnOutputs = (Array3<f64>, Array3<f64>, Array2<f64>);

/// Copies the rows `rows` (token indices below T) of `src` into `dst`.
fn take_token_rows(dst: &mut AttnOutputs, src: &AttnOutputs, rows: impl Iterator<Item = usize>) {
    for ti in rows {
        dst.0.slice_mut(s![ti, .., ..]).assign(&src.0.slice(s![ti, .., ..]));
        dst.1.slice_mut(s![ti, .., ..]).assign(&src.1.slice(s![ti, .., ..]));
        dst.2.slice_mut(s![ti, ..]).assign(&src.2.slice(s![ti, ..]));
    }
}

/// `x` [T, K] as a projection reads it: quantized as `fp8` says, its K columns in `parts` rank
/// slices quantized on their own (see [`ActQuant::quantize`]); `x` itself without fp8 compute.
pub(crate) fn gemm_input<'x>(
    x: &'x Array2<f64>,
    act: Option<&ActQuant>,
    parts: usize,
) -> std::borrow::Cow<'x, Array2<f64>> {
    match act {
        None => std::borrow::Cow::Borrowed(x),
        Some(a) => {
            let k = x.ncols();
            let mut q = x.as_standard_layout().into_owned();
            if let Some(v) = q.as_slice_mut() {
                a.quantize(v, k, parts);
            }
            std::borrow::Cow::Owned(q)
        }
    }
}

impl<'a> RefInputs<'a> {
    /// Only a shared layer's borrowed selection.
    pub fn shared(shared: Option<&'a Selection>) -> Self {
        RefInputs {
            shared,
            ..RefInputs::default()
        }
    }
}

/// Widens an f32 matrix to f64 (exact).
pub fn widen_to_f64(a: &Array2<f32>) -> Array2<f64> {
    a.mapv(f64::from)
}

/// Rows of W (output columns) per parallel work item of [`linear`]: fixed, so the split never
/// depends on the thread count.
const OUT_BLOCK: usize = 256;

/// `y = x · Wᵀ` (PyTorch `F.linear`): x [T, K], W [O, K] → [T, O], f64.
///
/// W's rows are cut into blocks of [`OUT_BLOCK`] run in parallel with rayon, each block one
/// sequential faer GEMM over the whole K into its own output columns. The block split is fixed
/// and each block's GEMM runs on one thread, so the bits do not depend on the thread count
/// (tested below); they may differ in the last place from another f64 GEMM (a different order
/// of accumulation over K), and between machines with different SIMD widths, which the
/// tolerances of the reference-agreement row cover. faer rather than ndarray's matrixmultiply
/// because the reference's largest products (`o_proj`, `q_b`) ran about 1.5× faster in it on
/// the 2-core machine of BENCHMARKS.md's P8.
fn linear(x: &Array2<f64>, w: &Array2<f64>) -> Array2<f64> {
    linear_blocks(x, w.nrows(), |r| CowArray::from(w.slice(s![r, ..])))
}

/// [`linear`] with f32 weights, widened to f64 (exactly) one block at a time inside each work
/// item: the same bits as `linear(x, &widen_to_f64(w))` without a whole f64 copy of W (940 MB for
/// DeepSeek-V3's `o_proj`).
fn linear32(x: &Array2<f64>, w: &Array2<f32>) -> Array2<f64> {
    linear_blocks(x, w.nrows(), |r| CowArray::from(w.slice(s![r, ..]).mapv(f64::from)))
}

/// The block loop of [`linear`]: `block(rows)` gives W's rows `rows` as f64 [rows.len(), K].
fn linear_blocks<'w, F>(x: &Array2<f64>, o: usize, block: F) -> Array2<f64>
where
    F: Fn(std::ops::Range<usize>) -> CowArray<'w, f64, Ix2> + Sync,
{
    let (t, k) = x.dim();
    let mut y = Array2::<f64>::zeros((t, o));
    let xs = x.as_standard_layout();
    let xs = xs.as_slice().unwrap_or(&[]);
    let lhs = faer::MatRef::from_row_major_slice(xs, t, k);
    let blocks: Vec<(usize, ArrayViewMut2<f64>)> = y.axis_chunks_iter_mut(Axis(1), OUT_BLOCK).enumerate().collect();
    blocks.into_par_iter().for_each(|(i, mut yb)| {
        let r0 = i * OUT_BLOCK;
        let cols = yb.ncols();
        let wb = block(r0..r0 + cols);
        let wb = wb.as_standard_layout();
        // W's block [cols, K] row-major is Wᵀ's [K, cols] column-major.
        let rhs = faer::MatRef::from_column_major_slice(wb.as_slice().unwrap_or(&[]), k, cols);
        let mut out = vec![0f64; t * cols];
        let dst = faer::MatMut::from_row_major_slice_mut(&mut out, t, cols);
        matmul(dst, faer::Accum::Replace, lhs, rhs);
        for (mut row, src) in yb.rows_mut().into_iter().zip(out.chunks_exact(cols.max(1))) {
            row.iter_mut().zip(src).for_each(|(d, &s)| *d = s);
        }
    });
    y
}

/// `c = a·b`, or `c += a·b` with `accumulate`, in f64: a [m, k], b [k, n],
/// c [m, n], any strides. One sequential faer GEMM: the callers are parallel over heads and
/// query blocks, and the result does not depend on the thread count.
fn gemm_view(a: ArrayView2<f64>, b: ArrayView2<f64>, mut c: ArrayViewMut2<f64>, accumulate: bool) {
    let (m, k) = a.dim();
    let n = b.ncols();
    debug_assert_eq!((b.nrows(), c.dim()), (k, (m, n)));
    let (sa, sb, sc) = (a.strides(), b.strides(), c.strides());
    let (sc0, sc1) = (sc[0], sc[1]);
    // SAFETY: each view's pointer, dims and element strides describe memory that view owns or
    // borrows for this call (ndarray's invariants); faer reads and writes only within them.
    let (lhs, rhs, dst) = unsafe {
        (
            faer::MatRef::from_raw_parts(a.as_ptr(), m, k, sa[0], sa[1]),
            faer::MatRef::from_raw_parts(b.as_ptr(), k, n, sb[0], sb[1]),
            faer::MatMut::from_raw_parts_mut(c.as_mut_ptr(), m, n, sc0, sc1),
        )
    };
    let accum = if accumulate {
        faer::Accum::Add
    } else {
        faer::Accum::Replace
    };
    matmul(dst, accum, lhs, rhs);
}

/// One sequential faer GEMM, `dst = lhs·rhs` or `dst += lhs·rhs`, followed by
/// [`clear_upper_ymm`].
fn matmul(dst: faer::MatMut<f64>, accum: faer::Accum, lhs: faer::MatRef<f64>, rhs: faer::MatRef<f64>) {
    faer::linalg::matmul::matmul(dst, accum, lhs, rhs, 1.0, faer::Par::Seq);
    clear_upper_ymm();
}

/// Zeroes the upper halves of the YMM registers (`vzeroupper`) where the processor has AVX.
///
/// faer's x86 GEMM kernels return with those halves dirty. Until something clears them, every
/// legacy-SSE instruction on that thread (this crate's baseline code, glibc's `exp`) pays the
/// AVX–SSE transition penalty: the reference's softmax ran about 10× slower per `exp` after a
/// GEMM on the machine of BENCHMARKS.md's P8 (1.2 s of its 2.3 s attention). The lower halves,
/// where SSE code keeps its values, are untouched, so no value changes.
#[inline]
fn clear_upper_ymm() {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: the processor has AVX (checked), so `vzeroupper` exists; it writes only the
        // upper 128 bits of YMM registers, which code compiled for this crate's baseline target
        // never holds a value in.
        unsafe { std::arch::asm!("vzeroupper", options(nomem, nostack, preserves_flags)) };
    }
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
/// (docs/mla.md step 9).
pub fn rope_inv_freq(cfg: &MlaConfig) -> Vec<f64> {
    let r = cfg.qk_rope_head_dim;
    let base = cfg.rope_base;
    let plain: Vec<f64> = (0..r / 2)
        .map(|i| {
            // LongRoPE (MiniCPM3): each pair's frequency divided by its factor.
            let f = cfg.rope_factors.as_ref().and_then(|v| v.get(i)).copied().unwrap_or(1.0);
            base.powf(-(2.0 * i as f64) / r as f64) / f
        })
        .collect();
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

/// Rebuilds `kv_b_proj` [N·(P+V), L] from the file's tensors (docs/mla.md "Rebuilding kv_b"):
/// `W[h·(P+V) + p, l] = k_b[h, l, p]`, `W[h·(P+V) + P + v, l] = v_b[h, v, l]`.
pub fn assemble_kv_b(cfg: &MlaConfig, w: &KvBWeights) -> Array2<f64> {
    let [n, l, p, _, v] = cfg.dims().nlprv();
    match w {
        KvBWeights::Fused { kv_b } => widen_to_f64(kv_b),
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

/// Records a copy of `a` (one memcpy when `a` is in standard layout).
fn record_copy<D: ndarray::Dimension>(trace: &mut Trace, layer: usize, stage: Stage, a: &ndarray::Array<f64, D>) {
    let data = a
        .as_slice()
        .map_or_else(|| a.iter().copied().collect(), <[f64]>::to_vec);
    trace.record(Site::new(layer, stage), TraceTensor::f64(a.shape().to_vec(), data));
}

/// Records a weight site in f32: its values are dequantized f32 weights rearranged (concatenated,
/// split per head), so f32 holds them exactly, in half the memory of f64.
fn record_weight<D: ndarray::Dimension>(trace: &mut Trace, layer: usize, stage: Stage, a: &ndarray::Array<f64, D>) {
    let data: Vec<f32> = a.iter().map(|&x| x as f32).collect();
    debug_assert!(
        a.iter()
            .zip(&data)
            .all(|(&x, &y)| x.to_bits() == f64::from(y).to_bits() || x.is_nan())
    );
    trace.record(Site::new(layer, stage), TraceTensor::f32(a.shape().to_vec(), data));
}

/// Records `a` itself, for a value nothing reads afterwards: no copy of the largest sites
/// (`ql_nope` and `attn_latent` are [T, N, L]).
fn record_moved<D: ndarray::Dimension>(trace: &mut Trace, layer: usize, stage: Stage, a: ndarray::Array<f64, D>) {
    let shape = a.shape().to_vec();
    trace.record(Site::new(layer, stage), TraceTensor::f64(shape, into_row_major(a)));
}

/// Runs one MLA layer (attention, attention residual, dense FFN and its residual) on
/// `hidden_in` [T, H] for the sequences of `batch`, recording every site: the dense FFN's
/// `ffn_in` … `ffn_out` too; an MoE layer stops after `o_proj` ([`forward_full`] adds its FFN).
///
/// Errors: [`Error::Internal`] when `hidden_in` has the wrong shape for `cfg`/`batch` (callers
/// build it, or check a dump's, to that shape).
pub fn forward(cfg: &MlaConfig, w: &LayerWeights, hidden_in: &Array2<f64>, batch: &Batch) -> Result<RefLayer> {
    forward_sel(cfg, w, hidden_in, batch, &RefInputs::default())
}

/// [`forward`] for a DSA model, where a GLM "shared" layer takes `dsa.shared` (the selection of
/// the nearest earlier full layer on the token path) instead of computing one. With no shared
/// selection a shared layer runs the borrowed indexer ([`LayerWeights::indexer`]) on its own
/// input: what single-layer runs on random inputs do, since there is no earlier layer to borrow
/// from. `dsa.quant` quantizes the indexer's query and key as the engine did before scoring.
///
/// DSA sites (full layers): `idx_q`, `idx_k`, `idx_weights` (unquantized, before RoPE),
/// `idx_scores`, `idx_topk`; shared layers record `idx_topk` only. The attention of each token
/// then runs over its selected keys, or over `dsa.attend`'s where it gives some.
///
/// Errors: as [`forward`].
#[allow(
    clippy::too_many_lines,
    reason = "the f64 reference is one linear recipe, step by step in the order of the sites it records; split, its steps would pass a dozen tensors between functions"
)]
pub fn forward_sel(
    cfg: &MlaConfig,
    w: &LayerWeights,
    hidden_in: &Array2<f64>,
    batch: &Batch,
    dsa: &RefInputs<'_>,
) -> Result<RefLayer> {
    let t = batch.n_tokens();
    let [n, l, p, r, v] = cfg.dims().nlprv();
    let hd = cfg.dims().hidden;
    if hidden_in.shape() != [t, hd] {
        return Err(Error::internal(format!(
            "reference: hidden_in has shape {:?}, expected [T={t}, H={hd}]",
            hidden_in.shape()
        )));
    }
    let layer = w.layer;
    let eps = cfg.rms_eps;
    let act = dsa.fp8.and_then(|f| f.act.as_ref());
    let mut tr = Trace::new();
    record_copy(&mut tr, layer, Stage::HiddenIn, hidden_in);

    // Step 1: attn_norm.
    let x = rms_norm(hidden_in.view(), w.attn_norm.view(), eps);
    record_copy(&mut tr, layer, Stage::AttnIn, &x);
    // The fused q_a/kv_a projection (or q_proj and kv_a) reads attn_in once, quantized once.
    let xq = gemm_input(&x, act, 1);

    // Step 2: q path.
    let mut q_c_normed_keep: Option<Array2<f64>> = None;
    let q_flat = match &w.q {
        QWeights::Lora { q_a, q_a_norm, q_b } => {
            let kv_a_w = widen_to_f64(&w.kv_a_mqa);
            let q_a = widen_to_f64(q_a);
            let fused = ndarray::concatenate(Axis(0), &[q_a.view(), kv_a_w.view()])
                .map_err(|e| Error::Internal(e.to_string()))?;
            record_weight(&mut tr, layer, Stage::WFusedQkvA, &fused);
            let q_c = linear(&xq, &q_a);
            record_copy(&mut tr, layer, Stage::QC, &q_c);
            let q_c_normed = rms_norm(q_c.view(), q_a_norm.view(), eps);
            record_copy(&mut tr, layer, Stage::QCNormed, &q_c_normed);
            let q = linear32(&gemm_input(&q_c_normed, act, 1), q_b);
            q_c_normed_keep = Some(q_c_normed);
            q
        }
        QWeights::Direct { q } => linear32(&xq, q),
    };
    let q = q_flat
        .into_shape_with_order((t, n, p + r))
        .map_err(|e| Error::Internal(e.to_string()))?;
    record_copy(&mut tr, layer, Stage::Q, &q);

    // Step 3: kv path. kv_c is a view of kv_a; the norm applies to kv_c only.
    let kv_a = linear32(&xq, &w.kv_a_mqa);
    drop(xq);
    record_copy(&mut tr, layer, Stage::KvA, &kv_a);
    let kv_c_normed = rms_norm(kv_a.slice(s![.., ..l]), w.kv_a_norm.view(), eps);
    record_copy(&mut tr, layer, Stage::KvCNormed, &kv_c_normed);
    let k_pe = kv_a.slice(s![.., l..]).to_owned();
    record_copy(&mut tr, layer, Stage::KPe, &k_pe);

    // Step 4: RoPE (interleaved pairs; NeoX for MiniCPM3), positions from the batch.
    let style = cfg.rope_style;
    let inv_freq = rope_inv_freq(cfg);
    let positions = batch.positions();
    let mut q_pe_roped = q.slice(s![.., .., p..]).to_owned();
    let mut k_pe_roped = k_pe.clone();
    for ti in 0..t {
        for h in 0..n {
            let mut row: Vec<f64> = q_pe_roped.slice(s![ti, h, ..]).to_vec();
            indexer::rope_f64(&mut row, positions[ti], &inv_freq, style);
            q_pe_roped.slice_mut(s![ti, h, ..]).assign(&Array1::from(row));
        }
        let mut row: Vec<f64> = k_pe_roped.row(ti).to_vec();
        indexer::rope_f64(&mut row, positions[ti], &inv_freq, style);
        k_pe_roped.row_mut(ti).assign(&Array1::from(row));
    }
    record_copy(&mut tr, layer, Stage::QPeRoped, &q_pe_roped);
    record_copy(&mut tr, layer, Stage::KPeRoped, &k_pe_roped);

    // DSA lightning indexer: which keys each token keeps.
    let selection = match (&cfg.indexer, &w.indexer, &q_c_normed_keep) {
        (Some(ix), Some(iw), Some(qcn)) => {
            let full = ix.full.get(layer).copied().unwrap_or(true);
            let sel = match dsa.shared {
                Some(sel) if !full => sel.clone(),
                _ => {
                    let (sel, sites) = reference_indexer(ix, iw, &x, qcn, batch, &inv_freq, dsa.quant);
                    if full {
                        for (stage, shape, v) in sites {
                            tr.record(Site::new(layer, stage), TraceTensor::f64(shape, v));
                        }
                    }
                    sel
                }
            };
            let (shape, v) = indexer::topk_tensor(ix.top_k, batch, &sel);
            tr.record(Site::new(layer, Stage::IdxTopk), TraceTensor::f64(shape, v));
            Some(sel)
        }
        _ => None,
    };

    // Step 5: expanded K/V through kv_b (per-head interleaved rows).
    let kv_b = assemble_kv_b(cfg, &w.kv_b);
    record_weight(&mut tr, layer, Stage::WKvB, &kv_b);
    let kv = linear(&gemm_input(&kv_c_normed, act, 1), &kv_b)
        .into_shape_with_order((t, n, p + v))
        .map_err(|e| Error::Internal(e.to_string()))?;
    let k_nope = kv.slice(s![.., .., ..p]).to_owned();
    let vv = kv.slice(s![.., .., p..]).to_owned();
    record_copy(&mut tr, layer, Stage::KNope, &k_nope);
    record_copy(&mut tr, layer, Stage::V, &vv);

    // Step 6 weights: W_UK_T [N, P, L] and W_UV [N, L, V] from the same kv_b.
    let (w_uk_t, w_uv) = split_kv_b(cfg, &kv_b);
    record_weight(&mut tr, layer, Stage::WUkT, &w_uk_t);
    record_weight(&mut tr, layer, Stage::WUv, &w_uv);
    // ql_nope = q_nope · W_UK_T per head.
    let mut ql_nope = Array3::<f64>::zeros((t, n, l));
    let heads: Vec<(usize, ArrayViewMut2<f64>)> = ql_nope.axis_iter_mut(Axis(1)).enumerate().collect();
    heads.into_par_iter().for_each(|(h, mut out)| {
        let qn = q.slice(s![.., h, ..p]);
        gemm_view(qn, w_uk_t.slice(s![h, .., ..]), out.view_mut(), false);
    });
    // Kept for the absorbed rows of a kernel that takes an fp8 query (below).
    let ql_keep = dsa
        .fp8
        .and_then(|f| f.kv_cache)
        .is_some_and(|c| c.query.is_some())
        .then(|| ql_nope.clone());
    record_moved(&mut tr, layer, Stage::QlNope, ql_nope);

    // Attention, causal within each sequence, softmax scale of step 7.
    let inputs = AttnInputs {
        q: &q,
        k_nope: &k_nope,
        q_pe_roped: &q_pe_roped,
        k_pe_roped: &k_pe_roped,
        v: &vv,
        kv_c_normed: &kv_c_normed,
    };
    let attended = match (&selection, dsa.attend) {
        (Some(sel), Some(keys)) => Some(keys.over(batch, sel)),
        _ => None,
    };
    let attend = |inputs: &AttnInputs<'_>| match attended.as_ref().or(selection.as_ref()) {
        None => attention_causal(cfg, batch, inputs),
        Some(sel) => attention_selected(cfg, batch, sel, inputs),
    };
    let mut outs = attend(&inputs);
    // Absorbed (decode) tokens of an fp8 engine score keys expanded from the unquantized latent
    // (W_UK_T/W_UV), read from the cache: rounded when the cache is fp8.
    let kv_cache = dsa.fp8.and_then(|f| f.kv_cache);
    if let Some(absorbed) = dsa.fp8.and_then(|f| f.absorbed)
        && (act.is_some() || kv_cache.is_some())
        && absorbed.iter().any(|&a| a)
    {
        let cached = |a: &Array2<f64>| match &kv_cache {
            Some(c) => a.mapv(|x| c.round(x)),
            None => a.clone(),
        };
        let (kv_c_k, k_pe_k) = (cached(&kv_c_normed), cached(&k_pe_roped));
        let over_cache = match (kv_cache.filter(|_| selection.is_none()), &ql_keep) {
            // A kernel that takes an fp8 query scores the rounded `ql_nope ‖ q_pe` against the
            // latent itself: only the absorbed form can say it (`ql_nope` is L wide, `q_nope` P).
            (Some(c), Some(ql)) => {
                let absorbed_q = AbsorbedQuery {
                    ql_nope: &ql.mapv(|x| c.round_query(x)),
                    q_pe_roped: &q_pe_roped.mapv(|x| c.round_query(x)),
                    kv_c: &kv_c_k,
                    k_pe: &k_pe_k,
                    w_uv: &w_uv,
                };
                attention_absorbed(cfg, batch, absorbed, &absorbed_q)
            }
            _ => {
                let kv_u = linear(&kv_c_k, &kv_b)
                    .into_shape_with_order((t, n, p + v))
                    .map_err(|e| Error::Internal(e.to_string()))?;
                let (k_u, v_u) = (
                    kv_u.slice(s![.., .., ..p]).to_owned(),
                    kv_u.slice(s![.., .., p..]).to_owned(),
                );
                attend(&AttnInputs {
                    k_nope: &k_u,
                    v: &v_u,
                    k_pe_roped: &k_pe_k,
                    kv_c_normed: &kv_c_k,
                    ..inputs
                })
            }
        };
        let rows = (0..t.min(absorbed.len())).filter(|&ti| absorbed[ti]);
        take_token_rows(&mut outs, &over_cache, rows);
    }
    // With an fp8 cache, the step's expanded tokens read context keys back from it, rounded,
    // through kv_b_proj (an fp8 GEMM when the engine's are), and their own keys as computed.
    if let (Some(c), Some(context)) = (&kv_cache, dsa.fp8.and_then(|f| f.context))
        && context.iter().any(|&x| x)
    {
        let (mut kv_c_k, mut k_pe_k) = (kv_c_normed.clone(), k_pe_roped.clone());
        for ti in (0..t.min(context.len())).filter(|&ti| context[ti]) {
            kv_c_k.row_mut(ti).mapv_inplace(|x| c.round(x));
            k_pe_k.row_mut(ti).mapv_inplace(|x| c.round(x));
        }
        let kv_x = linear(&gemm_input(&kv_c_k, act, 1), &kv_b)
            .into_shape_with_order((t, n, p + v))
            .map_err(|e| Error::Internal(e.to_string()))?;
        let (k_x, v_x) = (
            kv_x.slice(s![.., .., ..p]).to_owned(),
            kv_x.slice(s![.., .., p..]).to_owned(),
        );
        let mixed = attend(&AttnInputs {
            k_nope: &k_x,
            v: &v_x,
            k_pe_roped: &k_pe_k,
            kv_c_normed: &kv_c_k,
            ..inputs
        });
        let absorbed = dsa.fp8.and_then(|f| f.absorbed);
        let is_absorbed = |ti: usize| absorbed.is_some_and(|a| a.get(ti) == Some(&true));
        let rows = (0..t.min(context.len())).filter(|&ti| !context[ti] && !is_absorbed(ti));
        take_token_rows(&mut outs, &mixed, rows);
    }
    let (attn_out, attn_latent, lse) = outs;
    record_moved(&mut tr, layer, Stage::AttnLatent, attn_latent);
    record_copy(&mut tr, layer, Stage::Lse, &lse);
    record_copy(&mut tr, layer, Stage::AttnOut, &attn_out);

    // Step 8: o_proj over the head-major [T, N·V] input.
    let attn_flat = attn_out
        .into_shape_with_order((t, n * v))
        .map_err(|e| Error::Internal(e.to_string()))?;
    let tp = dsa.fp8.map_or(1, |f| f.tp);
    let o = linear32(&gemm_input(&attn_flat, act, tp), &w.o_proj);
    record_copy(&mut tr, layer, Stage::OProj, &o);

    // Residual and dense SwiGLU FFN (each branch times the residual scale: MiniCPM3).
    let rs = cfg.residual_scale;
    let hidden_out = w.ffn.as_ref().map(|f| {
        let h1 = hidden_in + &(&o * rs);
        let ffn_out = ffn::dense_ffn(&mut tr, layer, f, &h1, eps, act, tp);
        h1 + ffn_out * rs
    });
    if let Some(ho) = &hidden_out {
        record_copy(&mut tr, layer, Stage::HiddenOut, ho);
    }
    Ok(RefLayer {
        trace: tr,
        hidden_out,
        moe_nonfinite: Vec::new(),
        selection,
    })
}

/// `W_UK_T` [N, P, L] and `W_UV` [N, L, V] out of `kv_b_proj` [N·(P+V), L] (vLLM's
/// `process_weights_after_loading`): `W_UK_T[h, p, l] = kv_b[h·(P+V) + p, l]`,
/// `W_UV[h, l, v] = kv_b[h·(P+V) + P + v, l]`.
pub fn split_kv_b(cfg: &MlaConfig, kv_b: &Array2<f64>) -> (Array3<f64>, Array3<f64>) {
    let [n, l, p, _, v] = cfg.dims().nlprv();
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
    (w_uk_t, w_uv)
}

/// The attention inputs of one layer in f64, as [`forward_sel`] has them after RoPE and the
/// `kv_b_proj` up-projection: `q` [T, N, P+R] (only its `q_nope` part, the first P of each head,
/// is read), `k_nope` [T, N, P], `q_pe_roped` [T, N, R], `k_pe_roped` [T, R], `v` [T, N, V],
/// `kv_c_normed` [T, L].
#[derive(Clone, Copy)]
struct AttnInputs<'a> {
    q: &'a Array3<f64>,
    k_nope: &'a Array3<f64>,
    q_pe_roped: &'a Array3<f64>,
    k_pe_roped: &'a Array2<f64>,
    v: &'a Array3<f64>,
    kv_c_normed: &'a Array2<f64>,
}

/// Query rows per work item of [`attention_causal`]: fixed, so the work split (and every bit of
/// the result) never depends on the thread count; small enough that a block's scores
/// [`ATTN_Q_BLOCK`, T] stay a few MB at T = 4096.
const ATTN_Q_BLOCK: usize = 64;

/// The reference attention per (head, sequence, block of [`ATTN_Q_BLOCK`] queries), each block
/// four dgemms: scores `q_nope·k_noperᵀ + q_pe·k_peᵀ` over the keys up to its last query,
/// causal mask, softmax in f64, then `P·v` (`attn_out`) and `P·kv_c_normed` (`attn_latent`, the
/// absorbed paths' latent output).
///
/// Shapes: [`AttnInputs`] → (`attn_out` [T, N, V], `attn_latent` [T, N, L], `lse` [T, N],
/// natural log).
fn attention_causal(
    cfg: &MlaConfig,
    batch: &Batch,
    inputs: &AttnInputs<'_>,
) -> (Array3<f64>, Array3<f64>, Array2<f64>) {
    let AttnInputs {
        q,
        k_nope,
        q_pe_roped: q_pe,
        k_pe_roped: k_pe,
        v,
        kv_c_normed: kv_c,
    } = *inputs;
    let t = batch.n_tokens();
    let [n, l, p, _, dv] = cfg.dims().nlprv();
    let scale = cfg.softmax_scale;
    let mut items = Vec::new();
    for (sq, off) in batch.seqs.iter().zip(batch.offsets()) {
        for h in 0..n {
            for q0 in (0..sq.len).step_by(ATTN_Q_BLOCK) {
                items.push((h, off, q0, ATTN_Q_BLOCK.min(sq.len - q0)));
            }
        }
    }
    let blocks: Vec<(Array2<f64>, Array2<f64>, Vec<f64>)> = items
        .par_iter()
        .map(|&(h, off, q0, rows)| {
            // Keys 0..=q0+rows-1 of the sequence; query row i sees keys 0..=q0+i.
            let nk = q0 + rows;
            let (qr, kr) = (off + q0..off + q0 + rows, off..off + nk);
            let mut sc = Array2::<f64>::zeros((rows, nk));
            let qn = q.slice(s![qr.clone(), h, ..p]);
            let kn = k_nope.slice(s![kr.clone(), h, ..]);
            gemm_view(qn, kn.t(), sc.view_mut(), false);
            let qp = q_pe.slice(s![qr, h, ..]);
            let kp = k_pe.slice(s![kr.clone(), ..]);
            gemm_view(qp, kp.t(), sc.view_mut(), true);
            let lse = causal_softmax(&mut sc, q0, scale);
            let mut out = Array2::<f64>::zeros((rows, dv));
            gemm_view(sc.view(), v.slice(s![kr.clone(), h, ..]), out.view_mut(), false);
            let mut lat = Array2::<f64>::zeros((rows, l));
            gemm_view(sc.view(), kv_c.slice(s![kr, ..]), lat.view_mut(), false);
            (out, lat, lse)
        })
        .collect();
    scatter_blocks(&items, blocks, [t, n, l, dv])
}

/// Softmax in place of each row `i` of the block's raw scores `sc` [rows, keys] over its
/// visible keys `0..=q0 + i` (the rest 0), the scores times `scale`; returns each row's LSE
/// (natural log).
fn causal_softmax(sc: &mut Array2<f64>, q0: usize, scale: f64) -> Vec<f64> {
    let mut lse = Vec::with_capacity(sc.nrows());
    for (i, mut row) in sc.rows_mut().into_iter().enumerate() {
        let visible = q0 + i + 1;
        let m = row
            .iter()
            .take(visible)
            .fold(f64::NEG_INFINITY, |a, &z| a.max(z * scale));
        let mut sum = 0.0;
        for (j, x) in row.iter_mut().enumerate() {
            *x = if j < visible { (*x * scale - m).exp() } else { 0.0 };
            sum += *x;
        }
        row.mapv_inplace(|x| x / sum);
        lse.push(m + sum.ln());
    }
    lse
}

/// The per-(head, sequence, row block) results `blocks` (`attn_out` [rows, V], `attn_latent`
/// [rows, L], `lse` \[rows\]) of the work items `items` (head, sequence offset, first row, rows)
/// laid into [T, N, V], [T, N, L] and [T, N] (`dims` = [T, N, L, V]); rows no item covers stay 0.
fn scatter_blocks(
    items: &[(usize, usize, usize, usize)],
    blocks: Vec<(Array2<f64>, Array2<f64>, Vec<f64>)>,
    [t, n, l, dv]: [usize; 4],
) -> AttnOutputs {
    let mut outs: AttnOutputs = (
        Array3::<f64>::zeros((t, n, dv)),
        Array3::<f64>::zeros((t, n, l)),
        Array2::<f64>::zeros((t, n)),
    );
    for (&(h, off, q0, rows), (o, lat, ls)) in items.iter().zip(blocks) {
        let r = off + q0..off + q0 + rows;
        outs.0.slice_mut(s![r.clone(), h, ..]).assign(&o);
        outs.1.slice_mut(s![r.clone(), h, ..]).assign(&lat);
        outs.2.slice_mut(s![r, h]).assign(&Array1::from(ls));
    }
    outs
}

/// What an absorbed (decode) row's attention reads when its query is rounded: `ql_nope` [T, N, L]
/// and `q_pe_roped` [T, N, R] as the kernel takes them, the latent `kv_c` [T, L] and `k_pe`
/// [T, R] as the cache returns them, and `W_UV` [N, L, V].
struct AbsorbedQuery<'a> {
    ql_nope: &'a Array3<f64>,
    q_pe_roped: &'a Array3<f64>,
    kv_c: &'a Array2<f64>,
    k_pe: &'a Array2<f64>,
    w_uv: &'a Array3<f64>,
}

/// The reference attention of the rows `rows[ti]` in the absorbed form, causal within each
/// sequence: scores `(ql_nope·kv_cᵀ + q_pe·k_peᵀ)·scale`, softmax in f64, `attn_latent = P·kv_c`,
/// `attn_out = attn_latent·W_UV[h]`. Per (head, sequence, run of at most [`ATTN_Q_BLOCK`]
/// consecutive rows to compute), each a few dgemms, so the split never depends on the thread
/// count. Rows not asked for are left zero. Shapes as [`attention_causal`].
fn attention_absorbed(cfg: &MlaConfig, batch: &Batch, rows: &[bool], q: &AbsorbedQuery<'_>) -> AttnOutputs {
    let t = batch.n_tokens();
    let [n, l, _, _, dv] = cfg.dims().nlprv();
    let scale = cfg.softmax_scale;
    let wanted = |ti: usize| rows.get(ti) == Some(&true);
    let mut items = Vec::new();
    for (sq, off) in batch.seqs.iter().zip(batch.offsets()) {
        let mut i = 0;
        while i < sq.len {
            if !wanted(off + i) {
                i += 1;
                continue;
            }
            let mut e = i;
            while e < sq.len && e - i < ATTN_Q_BLOCK && wanted(off + e) {
                e += 1;
            }
            items.extend((0..n).map(|h| (h, off, i, e - i)));
            i = e;
        }
    }
    let blocks: Vec<(Array2<f64>, Array2<f64>, Vec<f64>)> = items
        .par_iter()
        .map(|&(h, off, q0, nr)| {
            let nk = q0 + nr;
            let (qr, kr) = (off + q0..off + q0 + nr, off..off + nk);
            let mut sc = Array2::<f64>::zeros((nr, nk));
            gemm_view(
                q.ql_nope.slice(s![qr.clone(), h, ..]),
                q.kv_c.slice(s![kr.clone(), ..]).t(),
                sc.view_mut(),
                false,
            );
            gemm_view(
                q.q_pe_roped.slice(s![qr, h, ..]),
                q.k_pe.slice(s![kr.clone(), ..]).t(),
                sc.view_mut(),
                true,
            );
            let lse = causal_softmax(&mut sc, q0, scale);
            let mut lat = Array2::<f64>::zeros((nr, l));
            gemm_view(sc.view(), q.kv_c.slice(s![kr, ..]), lat.view_mut(), false);
            let mut out = Array2::<f64>::zeros((nr, dv));
            gemm_view(lat.view(), q.w_uv.slice(s![h, .., ..]), out.view_mut(), false);
            (out, lat, lse)
        })
        .collect();
    scatter_blocks(&items, blocks, [t, n, l, dv])
}

/// The reference attention when a DSA indexer chose each token's keys: one (token, head) row at
/// a time over its selected keys, in a fixed order. Shapes as [`attention_causal`].
fn attention_selected(
    cfg: &MlaConfig,
    batch: &Batch,
    sel: &Selection,
    inputs: &AttnInputs<'_>,
) -> (Array3<f64>, Array3<f64>, Array2<f64>) {
    let AttnInputs {
        q,
        k_nope,
        q_pe_roped,
        k_pe_roped,
        v: vv,
        kv_c_normed,
    } = *inputs;
    let t = batch.n_tokens();
    let [n, l, p, r, v] = cfg.dims().nlprv();
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
    // The offset of each token's sequence (selected key indices are within the sequence).
    let seq_of: Vec<usize> = batch
        .seqs
        .iter()
        .zip(&offsets)
        .flat_map(|(sq, &off)| std::iter::repeat_n(off, sq.len))
        .collect();
    let rows: Vec<(Vec<f64>, Vec<f64>, f64)> = (0..t * n)
        .into_par_iter()
        .map(|row| {
            let (ti, h) = (row / n, row % n);
            let off = seq_of[ti];
            let qrow = &qs[(ti * n + h) * (p + r)..(ti * n + h) * (p + r) + p];
            let qpr = &qpe[(ti * n + h) * r..(ti * n + h + 1) * r];
            let keys: Vec<usize> = sel.rows[ti].iter().map(|&j| off + j).collect();
            let logits: Vec<f64> = keys
                .iter()
                .map(|&tj| {
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
            for (&ej, &tj) in e.iter().zip(&keys) {
                let pj = ej / sum;
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
    (attn_out, attn_latent, lse)
}

/// One recorded site of a layer: stage, shape, values.
type StageValues = (Stage, Vec<usize>, Vec<f64>);

/// The indexer of one layer in f64: `idx_q` = `q_b·q_c_normed` [T, N_idx, D_idx], `idx_k` =
/// `LayerNorm(k·attn_in)` [T, D_idx], `idx_weights` = `proj·attn_in` [T, N_idx]; RoPE on the first
/// R dims of each head with the indexer's own pairing; with `quant`, the engine's quantization
/// of the roped query and key ([`indexer::quantize_qk`]); scores and the top-k selection
/// ([`indexer::scores`], [`indexer::select`]). Returns the selection and the four value sites.
fn reference_indexer(
    ix: &crate::model::config::IndexerConfig,
    iw: &crate::model::weights::IndexerWeights,
    x: &Array2<f64>,
    q_c_normed: &Array2<f64>,
    batch: &Batch,
    inv_freq: &[f64],
    quant: Option<&QkQuant>,
) -> (Selection, Vec<StageValues>) {
    let t = batch.n_tokens();
    let (ni, d) = (ix.n_head, ix.head_dim);
    let q = linear32(q_c_normed, &iw.q_b);
    let k_raw = linear32(x, &iw.k);
    let wts = linear32(x, &iw.proj);
    let (g, b) = (iw.k_norm.to_vec(), iw.k_norm_b.to_vec());
    let k: Vec<f64> = k_raw
        .rows()
        .into_iter()
        .flat_map(|row| indexer::layer_norm(&row.to_vec(), &g, &b, ix.norm_eps))
        .collect();
    let qv: Vec<f64> = q.iter().copied().collect();
    let mut q_roped = qv.clone();
    let mut k_roped = k.clone();
    indexer::rope_indexer(
        &mut q_roped,
        &mut k_roped,
        ix,
        &batch.positions(),
        inv_freq,
        ix.rope_style,
    );
    if let Some(qk) = quant {
        indexer::quantize_qk(&mut q_roped, &mut k_roped, d, qk);
    }
    let wv: Vec<f64> = wts.iter().copied().collect();
    let sc = indexer::scores(ix, batch, &q_roped, &k_roped, &wv);
    let sel = indexer::select(ix.top_k, batch, &sc);
    let s = batch.seqs.iter().map(|x| x.len).max().unwrap_or(0);
    (
        sel,
        vec![
            (Stage::IdxQ, vec![t, ni, d], qv),
            (Stage::IdxK, vec![t, d], k),
            (Stage::IdxWeights, vec![t, ni], wv),
            (Stage::IdxScores, vec![t, s], sc),
        ],
    )
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
    let [n, _, p, r, v] = cfg.dims().nlprv();
    let nh = n / tp;
    let q = match &w.q {
        QWeights::Lora { q_b, .. } => widen_to_f64(q_b),
        QWeights::Direct { q } => widen_to_f64(q),
    };
    let kv_b = assemble_kv_b(cfg, &w.kv_b);
    let o = widen_to_f64(&w.o_proj);
    for rank in 0..tp {
        let rk = rank as u32;
        let heads = rank * nh..(rank + 1) * nh;
        let qs = q.slice(s![heads.start * (p + r)..heads.end * (p + r), ..]).to_owned();
        record_weight(&mut tr, w.layer, Stage::WRank(RankedWeight::QProj, rk), &qs);
        let ks = kv_b
            .slice(s![heads.start * (p + v)..heads.end * (p + v), ..])
            .to_owned();
        record_weight(&mut tr, w.layer, Stage::WRank(RankedWeight::KvB, rk), &ks);
        let os = o.slice(s![.., heads.start * v..heads.end * v]).to_owned();
        record_weight(&mut tr, w.layer, Stage::WRank(RankedWeight::OProj, rk), &os);
    }
    tr
}

/// The reference's per-rank `o_proj` partials for `--tp tp` (sites `o_proj.rank<r>`, [T, H]):
/// rank r's heads of `attn_out` (`[T, N·V]` flat, f64, head-major as the site) through the
/// matching head columns of `o_proj`'s input dim, in f64. Their sum over the ranks is `o_proj`.
///
/// Returns an empty trace for `tp < 2`. Errors: [`Error::Internal`] for `attn_out` not `T·N·V`
/// long, or `tp` not dividing N (the run checks `--tp` first).
pub fn rank_partial_sites(
    cfg: &MlaConfig,
    w: &LayerWeights,
    attn_out: &[f64],
    t: usize,
    tp: usize,
    act: Option<&ActQuant>,
) -> Result<Trace> {
    let mut tr = Trace::new();
    if tp < 2 {
        return Ok(tr);
    }
    let (n, v) = (cfg.n_head, cfg.v_head_dim);
    if !n.is_multiple_of(tp) || attn_out.len() != t * n * v {
        return Err(Error::internal(format!(
            "reference o_proj partials: attn_out holds {} values for T={t}, N={n}, V={v}, tp={tp}",
            attn_out.len()
        )));
    }
    let x = ArrayView2::from_shape((t, n * v), attn_out).map_err(Error::internal)?;
    let nh = n / tp;
    for rank in 0..tp {
        let cols = rank * nh * v..(rank + 1) * nh * v;
        let xs = x.slice(s![.., cols.clone()]).to_owned();
        let os = w.o_proj.slice(s![.., cols]).to_owned();
        let part = linear32(&gemm_input(&xs, act, 1), &os);
        record_copy(&mut tr, w.layer, Stage::OProjRank(rank as u32), &part);
    }
    Ok(tr)
}

/// [`rank_partial_sites`] from the `attn_out` site of the reference trace `trace`; an empty
/// trace when it lacks that site.
pub fn rank_partial_sites_of(
    cfg: &MlaConfig,
    w: &LayerWeights,
    trace: &Trace,
    tp: usize,
    act: Option<&ActQuant>,
) -> Result<Trace> {
    match trace.get(&Site::new(w.layer, Stage::AttnOut)) {
        Some(a) if tp >= 2 => {
            let t = a.shape.first().copied().unwrap_or(0);
            rank_partial_sites(cfg, w, &a.to_f64(), t, tp, act)
        }
        _ => Ok(Trace::new()),
    }
}

/// The reference trace of one layer, with the per-rank weight sites for `tp`.
pub struct RefOutput {
    /// Every site, f64.
    pub trace: Trace,
    /// `hidden_out`, when the layer's FFN is dense or its MoE FFN was run.
    pub hidden_out: Option<Array2<f64>>,
    /// Non-finite MoE weights met on the way (see [`RefLayer::moe_nonfinite`]).
    pub moe_nonfinite: Vec<NonFiniteTensor>,
    /// The DSA selection the layer used (see [`RefLayer::selection`]).
    pub selection: Option<Selection>,
}

/// Runs the reference on one layer (plus its rank weight sites under TP): attention and a dense
/// FFN; an MoE layer stops at `o_proj` (see [`reference_layer_full`]). `shared` is the selection
/// a GLM shared-indexer layer borrows ([`forward_sel`]).
pub fn reference_layer(
    cfg: &MlaConfig,
    w: &LayerWeights,
    hidden: &Array2<f64>,
    batch: &Batch,
    tp: usize,
    shared: Option<&Selection>,
) -> Result<RefOutput> {
    reference_layer_with(cfg, w, hidden, batch, tp, &RefInputs::shared(shared))
}

/// [`reference_layer`] with everything a DSA layer may take from outside ([`RefInputs`]).
///
/// Errors: as [`reference_layer`].
pub fn reference_layer_with(
    cfg: &MlaConfig,
    w: &LayerWeights,
    hidden: &Array2<f64>,
    batch: &Batch,
    tp: usize,
    dsa: &RefInputs<'_>,
) -> Result<RefOutput> {
    let r = forward_sel(cfg, w, hidden, batch, dsa)?;
    with_rank_sites(r, cfg, w, tp, dsa.fp8.and_then(|f| f.act.as_ref()))
}

/// A reference layer's output plus the per-rank weight sites, `o_proj` partials and (a dense
/// layer's) MLP sites for `tp`.
fn with_rank_sites(
    r: RefLayer,
    cfg: &MlaConfig,
    w: &LayerWeights,
    tp: usize,
    act: Option<&ActQuant>,
) -> Result<RefOutput> {
    let mut trace = r.trace;
    let partials = rank_partial_sites_of(cfg, w, &trace, tp, act)?;
    let ffn_ranks = ffn_rank_sites_of(w, &trace, tp, act)?;
    trace.extend(rank_weight_sites(cfg, w, tp));
    trace.extend(partials);
    trace.extend(ffn_ranks);
    Ok(RefOutput {
        trace,
        hidden_out: r.hidden_out,
        moe_nonfinite: r.moe_nonfinite,
        selection: r.selection,
    })
}

/// [`reference_layer`], and for an MoE layer also its MoE FFN ([`forward_full`]):
/// the MoE sites, the shared experts' MLP sites (per rank too under TP) and `hidden_out`.
///
/// Errors: as [`forward_full`].
pub fn reference_layer_full(
    file: &GgufFile,
    cfg: &MlaConfig,
    w: &LayerWeights,
    hidden: &Array2<f64>,
    batch: &Batch,
    tp: usize,
    shared: Option<&Selection>,
) -> Result<RefOutput> {
    reference_layer_full_with(file, cfg, w, hidden, batch, tp, &RefInputs::shared(shared))
}

/// [`reference_layer_full`] with everything a DSA layer may take from outside ([`RefInputs`]).
///
/// Errors: as [`reference_layer_full`].
pub fn reference_layer_full_with(
    file: &GgufFile,
    cfg: &MlaConfig,
    w: &LayerWeights,
    hidden: &Array2<f64>,
    batch: &Batch,
    tp: usize,
    dsa: &RefInputs<'_>,
) -> Result<RefOutput> {
    let r = ffn::forward_full_tp(file, cfg, w, hidden, batch, dsa, tp)?;
    with_rank_sites(r, cfg, w, tp, dsa.fp8.and_then(|f| f.act.as_ref()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parallel_linear_is_bit_identical_whatever_the_thread_count() {
        // Odd sizes: partial output blocks, partial GEMM tiles and several k-blocks.
        let (t, k, o) = (37, 700, 1000);
        let xs = crate::core::batch::normal_f32(1, t * k);
        let ws = crate::core::batch::normal_f32(2, o * k);
        let x = Array2::from_shape_vec((t, k), xs.iter().map(|&v| v as f64 * 1.7).collect()).unwrap();
        let w = Array2::from_shape_vec((o, k), ws).unwrap();
        let plain = x.dot(&widen_to_f64(&w).t());
        let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        let expected = one.install(|| linear(&x, &widen_to_f64(&w)));
        // Another f64 GEMM agrees to rounding: |Δ| ≤ 1e-13·‖row‖₁ bounds K = 700 roundings.
        for ((g, e), row) in expected.iter().zip(&plain).zip(0..) {
            let bound = 1e-13 * x.row(row / o).iter().map(|v| v.abs()).sum::<f64>() * 5.0;
            assert!((g - e).abs() <= bound, "element {row}: {g} vs {e}");
        }
        for threads in [1, 2, 3] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let (a, b) = pool.install(|| (linear32(&x, &w), linear(&x, &widen_to_f64(&w))));
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
