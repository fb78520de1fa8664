//! The f64 reference on the GPU (`--reference-backend cuda`).
//!
//! At real size the reference, not the paths, is what a user waits for: one DeepSeek-V3 layer at
//! T = 4096 is about 2.5 TFLOP of f64 work, minutes on a laptop's cores and seconds on an H200.
//! This module computes the same maths as [`crate::compute::reference`] (same sites, same order,
//! same f64 arithmetic up to summation order) with cuBLAS DGEMM for every product and the plain
//! f64 kernels of `kernels/reference.cu` for RMSNorm, RoPE/YaRN, the causal softmax and the FFN
//! activation. It shares with the engine paths only the device context and the dequantized
//! weights; never an attention, GEMM or norm kernel of theirs, since it judges them.
//!
//! Scope: attention layers with a dense FFN or stopping at `o_proj` (random input). A DSA
//! indexer or an MoE FFN (token input) runs on the CPU reference ([`supported`] says which).
//! The CPU reference stays the oracle: tests and `selftest --cross-check` compare the two.

use cudarc::cublas::{Gemm, GemmConfig, StridedBatchedConfig, sys as cb};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use ndarray::{Array2, Axis};

use crate::backend::cuda::compare::DeviceSite;
use crate::compute::reference::{
    RefOutput, assemble_kv_b, ffn_rank_sites, rank_partial_sites, rank_weight_sites, rope_inv_freq, split_kv_b,
};
use crate::core::batch::Batch;
use crate::core::error::{Error, Result};
use crate::core::trace::{Site, Stage, Trace, TraceTensor};
use crate::device::Module;
use crate::device::context::{Device, grid1};
use crate::model::config::{MlaConfig, RopeStyle};
use crate::model::tensors::ModelTensor;
use crate::model::weights::{LayerWeights, QWeights};

/// Threads of the one-block-per-row kernels (`REF_THREADS` in reference.cu).
const ROW_THREADS: u32 = 256;
/// Bytes of scores one attention step may hold (`[heads, len, len]` f64): heads are taken in
/// groups small enough to stay under it.
pub const SCORE_BYTES: usize = 2 << 30;

/// Whether the GPU reference computes this layer: not with a DSA indexer (its top-k selection
/// runs on the CPU reference), and not an MoE FFN (`full`: token input runs the whole layer).
pub fn supported(cfg: &MlaConfig, layer: usize, full: bool) -> bool {
    cfg.indexer.is_none() && !(full && cfg.is_moe_layer(layer))
}

/// A row-major matrix operand at an element offset of a device buffer, with its row stride:
/// element `(i, j)` at `buf[off + i·ld + j]`.
#[derive(Clone, Copy)]
struct Mat<'a> {
    buf: &'a CudaSlice<f64>,
    off: usize,
    ld: usize,
}

impl<'a> Mat<'a> {
    fn new(buf: &'a CudaSlice<f64>, off: usize, ld: usize) -> Self {
        Mat { buf, off, ld }
    }
}

/// The output operand of [`Gpu::gemm`], laid out as a [`Mat`].
struct MatMut<'a> {
    buf: &'a mut CudaSlice<f64>,
    off: usize,
    ld: usize,
}

impl<'a> MatMut<'a> {
    fn new(buf: &'a mut CudaSlice<f64>, off: usize, ld: usize) -> Self {
        MatMut { buf, off, ld }
    }
}

/// What one [`Gpu::gemm`] computes besides its operands: `C[m, n] = A[m, k] · B (+ beta·C)`
/// with `B` `[k, n]`, or `Bᵀ` with `B` `[n, k]` (`b_t`), over `batch` = (count, stride of A, of
/// B, of C) in elements.
#[derive(Clone, Copy)]
struct Product {
    b_t: bool,
    mnk: (usize, usize, usize),
    beta: f64,
    batch: Option<(usize, usize, usize, usize)>,
}

impl Product {
    /// `C = A · B`.
    fn ab(mnk: (usize, usize, usize)) -> Self {
        Product {
            b_t: false,
            mnk,
            beta: 0.0,
            batch: None,
        }
    }

    /// `C = A · Bᵀ`.
    fn abt(mnk: (usize, usize, usize)) -> Self {
        Product {
            b_t: true,
            ..Self::ab(mnk)
        }
    }

    /// The same product added to `C` (beta 1).
    fn accumulate(self) -> Self {
        Product { beta: 1.0, ..self }
    }

    /// The same product over `count` matrices at element strides `sa`, `sb`, `sc` of A, B, C.
    fn batched(self, (count, sa, sb, sc): (usize, usize, usize, usize)) -> Self {
        Product {
            batch: Some((count, sa, sb, sc)),
            ..self
        }
    }
}

/// RoPE inputs shared by every rotation of a layer ([`Gpu::rope`]).
struct RopeTables {
    /// Each token's position `[T]`, i64.
    pos: CudaSlice<i64>,
    /// The (YaRN) inverse frequencies `[R/2]`, f64.
    inv: CudaSlice<f64>,
    /// NeoX pairing (first half with second half) instead of interleaved pairs.
    neox: bool,
}

/// The GPU reference's kernels and products on one device.
struct Gpu<'d> {
    dev: &'d Device,
}

impl Gpu<'_> {
    /// An uninitialized f64 device buffer of `n` elements (at least one, so an empty tensor
    /// still has a valid pointer), on the device's stream.
    ///
    /// # Errors
    /// [`Error::Cuda`] naming the element count when the allocation fails.
    fn alloc(&self, n: usize) -> Result<CudaSlice<f64>> {
        // SAFETY: every buffer is fully written by a kernel or GEMM before it is read.
        unsafe { self.dev.stream().alloc::<f64>(n.max(1)) }
            .map_err(|e| Error::cuda(format!("cuMemAlloc of {n} f64: {e:?}")))
    }

    /// Copies the f64 host values `host` (any shape, flattened row-major) into a new device
    /// buffer of the same length (one zero element when `host` is empty, as [`Gpu::alloc`]).
    ///
    /// # Errors
    /// [`Error::Cuda`] when the allocation or the host-to-device copy fails.
    fn upload(&self, host: &[f64]) -> Result<CudaSlice<f64>> {
        self.dev
            .stream()
            .clone_htod(if host.is_empty() { &[0.0][..] } else { host })
            .map_err(|e| Error::cuda(format!("upload: {e:?}")))
    }

    /// f32 weights widened to f64 on the device (exact).
    fn widen(&self, host: &[f32]) -> Result<CudaSlice<f64>> {
        let src = self
            .dev
            .stream()
            .clone_htod(if host.is_empty() { &[0.0f32][..] } else { host })
            .map_err(|e| Error::cuda(format!("upload: {e:?}")))?;
        self.widen_device(&src, host.len())
    }

    /// The first `n` values of the f32 device buffer `src` widened to f64 (exact).
    fn widen_device(&self, src: &CudaSlice<f32>, n: usize) -> Result<CudaSlice<f64>> {
        let mut out = self.alloc(n)?;
        let f = self.dev.func(Module::Reference, "ref_widen")?;
        let nn = n as i64;
        let mut b = self.dev.stream().launch_builder(&f);
        b.arg(src).arg(&mut out).arg(&nn);
        // SAFETY: argument types match ref_widen in reference.cu.
        unsafe { b.launch(grid1(n)) }.map_err(|e| Error::cuda(format!("launch ref_widen: {e:?}")))?;
        Ok(out)
    }

    /// The first `n` f64 values of the device buffer `b`, copied to the host in stream order
    /// (after the kernels already queued).
    ///
    /// # Errors
    /// [`Error::Cuda`] when the device-to-host copy fails (including an earlier kernel's
    /// asynchronous fault surfacing here).
    fn download(&self, b: &CudaSlice<f64>, n: usize) -> Result<Vec<f64>> {
        let mut v = self
            .dev
            .stream()
            .clone_dtoh(b)
            .map_err(|e| Error::cuda(format!("download: {e:?}")))?;
        v.truncate(n);
        Ok(v)
    }

    /// Waits for the stream's queued work.
    ///
    /// # Errors
    /// [`Error::Cuda`] naming `what` (the step just queued) when a kernel faulted.
    fn sync(&self, what: &str) -> Result<()> {
        self.dev
            .stream()
            .synchronize()
            .map_err(|e| Error::cuda(format!("GPU reference: `{what}` failed: {e:?}")))
    }

    /// `dst[r, j] = src[off + r·stride + j]`, `[rows, width]`.
    fn copy_cols(
        &self,
        src: &CudaSlice<f64>,
        rows: usize,
        stride: usize,
        off: usize,
        width: usize,
    ) -> Result<CudaSlice<f64>> {
        let mut out = self.alloc(rows * width)?;
        let f = self.dev.func(Module::Reference, "ref_copy_cols")?;
        let (r, s, o, w) = (rows as i64, stride as i64, off as i64, width as i64);
        let mut b = self.dev.stream().launch_builder(&f);
        b.arg(src).arg(&r).arg(&s).arg(&o).arg(&w).arg(&mut out);
        // SAFETY: argument types match ref_copy_cols; every read index is < off + rows·stride.
        unsafe { b.launch(grid1(rows * width)) }.map_err(|e| Error::cuda(format!("launch ref_copy_cols: {e:?}")))?;
        Ok(out)
    }

    /// RMSNorm of `rows` rows of `width` read from `src` (row `r` at `src.off + r·src.ld`) with
    /// weight `g` \[width], `[rows, width]`.
    fn rms_norm(&self, src: Mat<'_>, rows: usize, width: usize, g: &[f32], eps: f64) -> Result<CudaSlice<f64>> {
        let g = self.widen(g)?;
        let mut out = self.alloc(rows * width)?;
        let f = self.dev.func(Module::Reference, "ref_rms_norm")?;
        let (r, o, s, w) = (rows as i64, src.off as i64, src.ld as i64, width as i64);
        let mut b = self.dev.stream().launch_builder(&f);
        b.arg(src.buf)
            .arg(&r)
            .arg(&o)
            .arg(&s)
            .arg(&w)
            .arg(&g)
            .arg(&eps)
            .arg(&mut out);
        let cfg = LaunchConfig {
            grid_dim: (rows.max(1) as u32, 1, 1),
            block_dim: (ROW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: argument types match ref_rms_norm; one block per row.
        unsafe { b.launch(cfg) }.map_err(|e| Error::cuda(format!("launch ref_rms_norm: {e:?}")))?;
        Ok(out)
    }

    /// RoPE in place on `rows` rows of `r` values, `heads` rows per token.
    fn rope(&self, x: &mut CudaSlice<f64>, rows: usize, heads: usize, r: usize, t: &RopeTables) -> Result<()> {
        let f = self.dev.func(Module::Reference, "ref_rope")?;
        let (ro, he, rr, nx) = (rows as i64, heads as i64, r as i64, i32::from(t.neox));
        let mut b = self.dev.stream().launch_builder(&f);
        b.arg(x).arg(&ro).arg(&he).arg(&rr).arg(&t.pos).arg(&t.inv).arg(&nx);
        // SAFETY: argument types match ref_rope; pos holds one entry per token.
        unsafe { b.launch(grid1(rows * r / 2)) }.map_err(|e| Error::cuda(format!("launch ref_rope: {e:?}")))?;
        Ok(())
    }

    fn elementwise(
        &self,
        name: &'static str,
        a: &CudaSlice<f64>,
        b2: &CudaSlice<f64>,
        scale: Option<f64>,
        n: usize,
    ) -> Result<CudaSlice<f64>> {
        let mut out = self.alloc(n)?;
        let f = self.dev.func(Module::Reference, name)?;
        let nn = n as i64;
        let mut b = self.dev.stream().launch_builder(&f);
        b.arg(a).arg(b2);
        if let Some(s) = &scale {
            b.arg(s);
        }
        b.arg(&mut out).arg(&nn);
        // SAFETY: argument types match ref_swiglu / ref_add_scaled in reference.cu.
        unsafe { b.launch(grid1(n)) }.map_err(|e| Error::cuda(format!("launch {name}: {e:?}")))?;
        Ok(out)
    }

    /// Row-major `C = A · B` or `A · Bᵀ` as `op` says ([`Product`]), in f64 (cuBLAS DGEMM).
    fn gemm(&self, c: MatMut<'_>, a: Mat<'_>, b: Mat<'_>, op: Product) -> Result<()> {
        let Product {
            b_t,
            mnk: (m, n, k),
            beta,
            batch,
        } = op;
        if m == 0 || n == 0 || k == 0 {
            return Ok(());
        }
        // Row-major C = A·op(B) is column-major Cᵀ = op(B)ᵀ·Aᵀ: cuBLAS's A is our B.
        let gemm = GemmConfig {
            transa: if b_t {
                cb::cublasOperation_t::CUBLAS_OP_T
            } else {
                cb::cublasOperation_t::CUBLAS_OP_N
            },
            transb: cb::cublasOperation_t::CUBLAS_OP_N,
            m: n as i32,
            n: m as i32,
            k: k as i32,
            alpha: 1.0f64,
            lda: b.ld as i32,
            ldb: a.ld as i32,
            beta,
            ldc: c.ld as i32,
        };
        let (bv, av) = (b.buf.slice(b.off..), a.buf.slice(a.off..));
        let mut cv = c.buf.slice_mut(c.off..);
        // SAFETY: every operand's extent (offset, leading dimension, batch strides) lies inside
        // its buffer, as laid out by the callers below.
        unsafe {
            match batch {
                None => self.dev.blas().gemm(gemm, &bv, &av, &mut cv),
                Some((count, sa, sb, sc)) => self.dev.blas().gemm_strided_batched(
                    StridedBatchedConfig {
                        gemm,
                        batch_size: count as i32,
                        stride_a: sb as i64,
                        stride_b: sa as i64,
                        stride_c: sc as i64,
                    },
                    &bv,
                    &av,
                    &mut cv,
                ),
            }
        }
        .map_err(|e| Error::cuda(format!("cublasDgemm: {e:?}")))
    }

    /// `y = x · Wᵀ` with the f32 weight `w` [o, k] (GGUF tensor `name`) widened to f64 on the
    /// device for this product and freed after it: x [t, k] → [t, o]. The weight is read from
    /// the device copy the layer's load dequantized ([`Device::with_layer_weight`]) when there
    /// is one, else uploaded from the host copy (the same values).
    fn linear_w(&self, x: &CudaSlice<f64>, t: usize, name: &str, w: &Array2<f32>) -> Result<CudaSlice<f64>> {
        let wd = match self
            .dev
            .with_layer_weight(name, w.len(), |d| self.widen_device(d, w.len()))
        {
            Some(wd) => wd?,
            None => self.widen(w.as_standard_layout().as_slice().unwrap_or(&[]))?,
        };
        self.linear(x, t, w.ncols(), &wd, w.nrows())
    }

    /// `y = x · Wᵀ` (PyTorch `F.linear`): x [t, k], W [o, k] → [t, o].
    fn linear(&self, x: &CudaSlice<f64>, t: usize, k: usize, w: &CudaSlice<f64>, o: usize) -> Result<CudaSlice<f64>> {
        let mut y = self.alloc(t * o)?;
        self.gemm(
            MatMut::new(&mut y, 0, o),
            Mat::new(x, 0, k),
            Mat::new(w, 0, k),
            Product::abt((t, o, k)),
        )?;
        Ok(y)
    }
}

/// Runs the reference on one layer on the GPU, plus its rank weight sites under TP: the same
/// trace (sites, order, shapes) as [`crate::compute::reference::reference_layer`], the dense
/// FFN's sites (`ffn_in` … `ffn_out`, and per rank under TP) included.
///
/// Shapes: `hidden` [T, H] f64; the trace holds every site in f64 on the host.
///
/// Errors: [`Error::Usage`] when the layer is not [`supported`] or `hidden` is not [T, H];
/// [`Error::Cuda`] on a failed allocation, launch or DGEMM.
pub fn reference_layer(
    dev: &Device,
    cfg: &MlaConfig,
    w: &LayerWeights,
    hidden: &Array2<f64>,
    batch: &Batch,
    tp: usize,
) -> Result<RefOutput> {
    reference_inner(dev, cfg, w, hidden, batch, tp, false).map(|(o, _)| o)
}

/// [`reference_layer`] with its sites left on the device: the returned trace holds only the
/// per-rank weight sites under TP; every other site, the whole-layer weight sites included, comes
/// back second (f64, on the device, in recording order), for [`crate::judge::device`] to judge
/// the paths against without a copy.
///
/// Errors: as [`reference_layer`].
pub fn reference_layer_split(
    dev: &Device,
    cfg: &MlaConfig,
    w: &LayerWeights,
    hidden: &Array2<f64>,
    batch: &Batch,
    tp: usize,
) -> Result<(RefOutput, Vec<DeviceSite<f64>>)> {
    reference_inner(dev, cfg, w, hidden, batch, tp, true)
}

#[allow(
    clippy::too_many_lines,
    reason = "the GPU reference is the CPU reference's linear recipe, step by step in the order of the sites it records"
)]
fn reference_inner(
    dev: &Device,
    cfg: &MlaConfig,
    w: &LayerWeights,
    hidden: &Array2<f64>,
    batch: &Batch,
    tp: usize,
    keep: bool,
) -> Result<(RefOutput, Vec<DeviceSite<f64>>)> {
    let t = batch.n_tokens();
    let dims = cfg.dims();
    let (hd, [n, l, p, r, v]) = (dims.hidden, dims.nlprv());
    if !supported(cfg, w.layer, false) {
        // `Backend::reference` sends DSA layers to the CPU reference before calling this.
        return Err(Error::internal("the GPU reference does not compute DSA indexer layers"));
    }
    if hidden.shape() != [t, hd] {
        return Err(Error::internal(format!(
            "reference: hidden_in has shape {:?}, expected [T={t}, H={hd}]",
            hidden.shape()
        )));
    }
    let g = Gpu { dev };
    let layer = w.layer;
    let name = |t: ModelTensor| t.name(layer);
    let eps = cfg.rms_eps;
    let mut tr = Trace::new();
    let kept = std::cell::RefCell::new(Vec::new());
    let record = |tr: &mut Trace, stage: Stage, shape: Vec<usize>, buf: &CudaSlice<f64>| -> Result<()> {
        let n: usize = shape.iter().product();
        let site = Site::new(layer, stage);
        if keep {
            // A copy: later steps reuse or free the buffer.
            let copy = dev
                .stream()
                .clone_dtod(&buf.slice(0..n.clamp(1, buf.len())))
                .map_err(|e| Error::cuda(format!("copy of site {site}: {e:?}")))?;
            kept.borrow_mut().push(DeviceSite { site, shape, buf: copy });
        } else {
            tr.record(site, TraceTensor::f64(shape, g.download(buf, n)?));
        }
        Ok(())
    };
    // A site built on the host (the weight sites): on the device too when the activations are.
    let record_host = |tr: &mut Trace, stage: Stage, shape: Vec<usize>, values: Vec<f64>| -> Result<()> {
        if keep {
            let buf = g.upload(&values)?;
            record(tr, stage, shape, &buf)
        } else {
            tr.record(Site::new(layer, stage), TraceTensor::f64(shape, values));
            Ok(())
        }
    };
    let hidden_std = hidden.as_standard_layout();
    let x_in = g.upload(hidden_std.as_slice().unwrap_or(&[]))?;
    record(&mut tr, Stage::HiddenIn, vec![t, hd], &x_in)?;

    // Step 1: attn_norm.
    let x = g.rms_norm(
        Mat::new(&x_in, 0, hd),
        t,
        hd,
        w.attn_norm.as_slice().unwrap_or(&[]),
        eps,
    )?;
    record(&mut tr, Stage::AttnIn, vec![t, hd], &x)?;

    // Step 2: q path.
    let q = match &w.q {
        QWeights::Lora { q_a, q_a_norm, q_b } => {
            let lq = q_a.nrows();
            let fused = ndarray::concatenate(Axis(0), &[q_a.view(), w.kv_a_mqa.view()])
                .map_err(|e| Error::Internal(e.to_string()))?;
            record_host(
                &mut tr,
                Stage::WFusedQkvA,
                vec![fused.nrows(), hd],
                fused.iter().map(|&x| f64::from(x)).collect(),
            )?;
            let q_c = g.linear_w(&x, t, &name(ModelTensor::AttnQA), q_a)?;
            record(&mut tr, Stage::QC, vec![t, lq], &q_c)?;
            let q_c_normed = g.rms_norm(Mat::new(&q_c, 0, lq), t, lq, q_a_norm.as_slice().unwrap_or(&[]), eps)?;
            record(&mut tr, Stage::QCNormed, vec![t, lq], &q_c_normed)?;
            g.linear_w(&q_c_normed, t, &name(ModelTensor::AttnQB), q_b)?
        }
        QWeights::Direct { q } => g.linear_w(&x, t, &name(ModelTensor::AttnQ), q)?,
    };
    record(&mut tr, Stage::Q, vec![t, n, p + r], &q)?;

    // Step 3: kv path; kv_c is a view of kv_a, the norm applies to kv_c only.
    let kv_a = g.linear_w(&x, t, &name(ModelTensor::AttnKvAMqa), &w.kv_a_mqa)?;
    record(&mut tr, Stage::KvA, vec![t, l + r], &kv_a)?;
    let kv_c_normed = g.rms_norm(
        Mat::new(&kv_a, 0, l + r),
        t,
        l,
        w.kv_a_norm.as_slice().unwrap_or(&[]),
        eps,
    )?;
    record(&mut tr, Stage::KvCNormed, vec![t, l], &kv_c_normed)?;
    let k_pe = g.copy_cols(&kv_a, t, l + r, l, r)?;
    record(&mut tr, Stage::KPe, vec![t, r], &k_pe)?;

    // Step 4: RoPE, positions from the batch.
    let positions: Vec<i64> = batch.positions().iter().map(|&x| x as i64).collect();
    let pos = dev
        .stream()
        .clone_htod(if positions.is_empty() {
            &[0i64][..]
        } else {
            &positions[..]
        })
        .map_err(|e| Error::cuda(format!("upload positions: {e:?}")))?;
    let tables = RopeTables {
        pos,
        inv: g.upload(&rope_inv_freq(cfg))?,
        neox: cfg.rope_style == RopeStyle::Neox,
    };
    let mut q_pe = g.copy_cols(&q, t * n, p + r, p, r)?;
    g.rope(&mut q_pe, t * n, n, r, &tables)?;
    record(&mut tr, Stage::QPeRoped, vec![t, n, r], &q_pe)?;
    let mut k_pe_roped = g.copy_cols(&k_pe, t, r, 0, r)?;
    g.rope(&mut k_pe_roped, t, 1, r, &tables)?;
    record(&mut tr, Stage::KPeRoped, vec![t, r], &k_pe_roped)?;

    // Step 5: expanded K/V through kv_b (per-head interleaved rows).
    let kv_b = assemble_kv_b(cfg, &w.kv_b);
    let kv_b_std = kv_b.as_standard_layout();
    let kv_b_d = g.upload(kv_b_std.as_slice().unwrap_or(&[]))?;
    if keep {
        record(&mut tr, Stage::WKvB, vec![n * (p + v), l], &kv_b_d)?;
    } else {
        tr.record(
            Site::new(layer, Stage::WKvB),
            TraceTensor::f64(vec![n * (p + v), l], kv_b_std.iter().copied().collect()),
        );
    }
    let kv = g.linear(&kv_c_normed, t, l, &kv_b_d, n * (p + v))?;
    drop(kv_b_d);
    let k_nope = g.copy_cols(&kv, t * n, p + v, 0, p)?;
    let vv = g.copy_cols(&kv, t * n, p + v, p, v)?;
    drop(kv);
    record(&mut tr, Stage::KNope, vec![t, n, p], &k_nope)?;
    record(&mut tr, Stage::V, vec![t, n, v], &vv)?;

    // Step 6: W_UK_T [N, P, L] and W_UV [N, L, V] from the same kv_b; ql_nope = q_nope · W_UK_T.
    let (w_uk_t, w_uv) = split_kv_b(cfg, &kv_b);
    record_host(&mut tr, Stage::WUkT, vec![n, p, l], w_uk_t.iter().copied().collect())?;
    record_host(&mut tr, Stage::WUv, vec![n, l, v], w_uv.iter().copied().collect())?;
    let w_uk_t_d = g.upload(w_uk_t.as_standard_layout().as_slice().unwrap_or(&[]))?;
    let mut ql_nope = g.alloc(t * n * l)?;
    g.gemm(
        MatMut::new(&mut ql_nope, 0, n * l),
        Mat::new(&q, 0, n * (p + r)),
        Mat::new(&w_uk_t_d, 0, l),
        Product::ab((t, l, p)).batched((n, p + r, p * l, l)),
    )?;
    drop(w_uk_t_d);
    record(&mut tr, Stage::QlNope, vec![t, n, l], &ql_nope)?;
    drop(ql_nope);

    // Step 7: attention per sequence, heads in groups: scores by two DGEMMs, causal softmax,
    // then P·v (attn_out) and P·kv_c_normed (attn_latent).
    let scale = cfg.softmax_scale;
    let mut attn_out = g.alloc(t * n * v)?;
    let mut attn_latent = g.alloc(t * n * l)?;
    let mut lse = g.alloc(t * n)?;
    let softmax = dev.func(Module::Reference, "ref_softmax_causal")?;
    for (sq, off) in batch.seqs.iter().zip(batch.offsets()) {
        let len = sq.len;
        let group = (SCORE_BYTES / (len * len * 8).max(1)).clamp(1, n);
        let mut s = g.alloc(group * len * len)?;
        for h0 in (0..n).step_by(group) {
            let hc = group.min(n - h0);
            g.gemm(
                MatMut::new(&mut s, 0, len),
                Mat::new(&q, off * n * (p + r) + h0 * (p + r), n * (p + r)),
                Mat::new(&k_nope, off * n * p + h0 * p, n * p),
                Product::abt((len, len, p)).batched((hc, p + r, p, len * len)),
            )?;
            g.gemm(
                MatMut::new(&mut s, 0, len),
                Mat::new(&q_pe, off * n * r + h0 * r, n * r),
                Mat::new(&k_pe_roped, off * r, r),
                Product::abt((len, len, r)).accumulate().batched((hc, r, 0, len * len)),
            )?;
            let (ll, hh, ls) = (len as i64, hc as i64, n as i64);
            let mut lse_v = lse.slice_mut(off * n + h0..);
            let mut b = dev.stream().launch_builder(&softmax);
            b.arg(&mut s).arg(&ll).arg(&hh).arg(&scale).arg(&mut lse_v).arg(&ls);
            let cfg_l = LaunchConfig {
                grid_dim: ((hc * len) as u32, 1, 1),
                block_dim: (ROW_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: argument types match ref_softmax_causal; s holds hc·len² scores.
            unsafe { b.launch(cfg_l) }.map_err(|e| Error::cuda(format!("launch ref_softmax_causal: {e:?}")))?;
            g.gemm(
                MatMut::new(&mut attn_out, off * n * v + h0 * v, n * v),
                Mat::new(&s, 0, len),
                Mat::new(&vv, off * n * v + h0 * v, n * v),
                Product::ab((len, v, len)).batched((hc, len * len, v, v)),
            )?;
            g.gemm(
                MatMut::new(&mut attn_latent, off * n * l + h0 * l, n * l),
                Mat::new(&s, 0, len),
                Mat::new(&kv_c_normed, off * l, l),
                Product::ab((len, l, len)).batched((hc, len * len, 0, l)),
            )?;
        }
    }
    g.sync("attention")?;
    record(&mut tr, Stage::AttnLatent, vec![t, n, l], &attn_latent)?;
    drop(attn_latent);
    record(&mut tr, Stage::Lse, vec![t, n], &lse)?;
    record(&mut tr, Stage::AttnOut, vec![t, n, v], &attn_out)?;

    // Under TP, the ranks' o_proj partials on the host (a few [T, H] GEMMs).
    let partials = if tp >= 2 {
        rank_partial_sites(cfg, w, &g.download(&attn_out, t * n * v)?, t, tp, None)?
    } else {
        Trace::new()
    };
    // Step 8: o_proj over the head-major [T, N·V] input.
    let o = g.linear_w(&attn_out, t, &name(ModelTensor::AttnOutput), &w.o_proj)?;
    record(&mut tr, Stage::OProj, vec![t, hd], &o)?;

    // Residual and dense SwiGLU FFN (each branch times the residual scale: MiniCPM3), its sites
    // in the CPU reference's recording order (`ffn_gate`, `ffn_up`, `ffn_act`, `ffn_in`,
    // `ffn_out`); under TP the MLP's per-rank sites on the host from its downloaded
    // `ffn_gate`/`ffn_up`/`ffn_act` (a few small GEMMs), as for `o_proj`.
    let rs = cfg.residual_scale;
    let mut ffn_ranks = Trace::new();
    let hidden_out = match &w.ffn {
        Some(ffn) => {
            let h1 = g.elementwise("ref_add_scaled", &x_in, &o, Some(rs), t * hd)?;
            let xn = g.rms_norm(Mat::new(&h1, 0, hd), t, hd, ffn.norm.as_slice().unwrap_or(&[]), eps)?;
            let f = ffn.gate.nrows();
            let gate = g.linear_w(&xn, t, &name(ModelTensor::FfnGate), &ffn.gate)?;
            let up = g.linear_w(&xn, t, &name(ModelTensor::FfnUp), &ffn.up)?;
            let act = g.elementwise("ref_swiglu", &gate, &up, None, t * f)?;
            record(&mut tr, Stage::FfnGate, vec![t, f], &gate)?;
            record(&mut tr, Stage::FfnUp, vec![t, f], &up)?;
            record(&mut tr, Stage::FfnAct, vec![t, f], &act)?;
            record(&mut tr, Stage::FfnIn, vec![t, hd], &xn)?;
            if tp >= 2 {
                let mut mlp = Trace::new();
                for (stage, b) in [(Stage::FfnGate, &gate), (Stage::FfnUp, &up), (Stage::FfnAct, &act)] {
                    mlp.record(
                        Site::new(layer, stage),
                        TraceTensor::f64(vec![t, f], g.download(b, t * f)?),
                    );
                }
                ffn_ranks = ffn_rank_sites(layer, &ffn.gate, &ffn.up, &ffn.down, &mlp, tp, None)?;
            }
            drop((gate, up, xn));
            let down = g.linear_w(&act, t, &name(ModelTensor::FfnDown), &ffn.down)?;
            record(&mut tr, Stage::FfnOut, vec![t, hd], &down)?;
            let out = g.elementwise("ref_add_scaled", &h1, &down, Some(rs), t * hd)?;
            record(&mut tr, Stage::HiddenOut, vec![t, hd], &out)?;
            let v = g.download(&out, t * hd)?;
            Some(Array2::from_shape_vec((t, hd), v).map_err(|e| Error::Internal(e.to_string()))?)
        }
        None => None,
    };
    g.sync("o_proj")?;
    tr.extend(rank_weight_sites(cfg, w, tp));
    tr.extend(partials);
    tr.extend(ffn_ranks);
    Ok((
        RefOutput {
            trace: tr,
            hidden_out,
            moe_nonfinite: Vec::new(),
            selection: None,
        },
        kept.into_inner(),
    ))
}
