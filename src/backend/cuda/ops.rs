//! [`CudaOps`]: the engine's kernel interface on an NVIDIA GPU.
//!
//! Buffers are `CudaSlice<f32>` on one stream. GEMMs go through cuBLAS (f32, or bf16 inputs
//! with f32 accumulation for `--dtype bf16`); every other kernel is ours, from `kernels/`. Each
//! launch is followed by a stream synchronize and an error check naming the kernel, which costs
//! speed and buys exact error attribution (this backend is for correctness; speed is the fast
//! kernels' job).

use std::ffi::c_void;
use std::path::Path;
use std::rc::Rc;
use std::sync::{Arc, Mutex};

use cudarc::cublas::{Gemm, GemmConfig, sys as cb};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use crate::backend::cuda::compare::DeviceSite;
use crate::backend::cuda::nccl::NcclAllReduce;
use crate::backend::decode_cfg::{DecodeCfg, wave_splits};
use crate::backend::prefill_cfg::PrefillCfg;
use crate::compute::collective::ReduceFault;
use crate::compute::ops::{Copy2d, DecodeArgs, Ops, PrefillArgs, RopeStyle, download_parts, host_all_reduce};
use crate::compute::path::PathKind;
use crate::core::canary::CANARY_BITS;
use crate::core::dtype::Dtype;
use crate::core::error::{Error, Result};
use crate::core::trace::Site;
use crate::device::Module;
use crate::device::context::{Device, grid1};
use crate::device::supports_wgmma;
use crate::model::config::MlaConfig;
use crate::model::gguf::{GgmlType, GgufFile, dequant};
use crate::model::weights::LayerWeights;

/// Rows of one flash-prefill block (one warp each), as `FLASH_ROWS` in attention.cu.
const FLASH_ROWS: usize = 4;
/// Keys per flash-prefill shared-memory tile, as `FLASH_BK` in attention.cu.
const FLASH_BK: usize = 16;
/// Largest per-row width the attention kernels' per-lane registers hold (32 lanes × 16).
const MAX_WIDTH: usize = 512;

/// Which attention kernels the CUDA backend launches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kernels {
    /// Tensor-core kernels (mma.sync) for bf16 prefill and decode; the simple ones elsewhere.
    Fast,
    /// The plain f32-FMA kernels everywhere (the cross-check).
    Simple,
}

/// The CUDA backend.
#[derive(Clone, Debug)]
pub struct CudaOps {
    dev: Arc<Device>,
    dtype: Dtype,
    kernels: Kernels,
    /// Synchronize and check after every launch (off only for benchmarks, which check at the end).
    sync_each: bool,
    /// Run the f64 reference on this device too ([`crate::backend::cuda::reference`]) where it
    /// computes the layer; the CPU reference otherwise.
    gpu_reference: bool,
    notes: Arc<Mutex<Vec<String>>>,
    /// While `Some`, the sites a path records are copied into device buffers here instead of
    /// downloaded ([`CudaOps::keep_sites_on_device`]).
    device_sites: Arc<Mutex<Option<Vec<DeviceSite<f32>>>>>,
    /// The NCCL communicators of `--devices`: the `o_proj` all-reduce runs through them when
    /// the path has one partial per listed device ([`CudaOps::with_nccl`]).
    nccl: Option<Rc<NcclAllReduce>>,
    /// `MLA_DIFF_DECODE_CFG`, read once when the backend is created (so a bad string is refused
    /// on every CUDA run, not only when a fast decode launches); fitted to each launch's shape
    /// and the device.
    decode_cfg: Option<DecodeCfg>,
    /// `MLA_DIFF_PREFILL_CFG`, read once when the backend is created, as `decode_cfg`.
    prefill_cfg: Option<PrefillCfg>,
}

impl CudaOps {
    /// The device's compute capability as NVRTC names it (`sm_90`).
    pub fn arch(&self) -> &str {
        &self.dev.arch
    }

    /// Opens device 0 ([`Device::open`]) for a backend computing in `dtype` with the fast
    /// kernels, after reading the kernel configurations `MLA_DIFF_DECODE_CFG` and
    /// `MLA_DIFF_PREFILL_CFG` where set ([`DecodeCfg::from_env`], [`PrefillCfg::from_env`]).
    ///
    /// Errors: [`Error::Usage`] naming the variable, the string and the field when a
    /// configuration variable does not parse or breaks a rule (before any device is asked);
    /// else as [`Device::open`].
    pub fn new(dtype: Dtype, include: Option<&Path>) -> Result<Self> {
        let decode_cfg = DecodeCfg::from_env()?;
        let prefill_cfg = PrefillCfg::from_env()?;
        Ok(CudaOps {
            dev: Arc::new(Device::open(include)?),
            dtype,
            kernels: Kernels::Fast,
            sync_each: true,
            gpu_reference: false,
            notes: Arc::new(Mutex::new(Vec::new())),
            device_sites: Arc::new(Mutex::new(None)),
            nccl: None,
            decode_cfg,
            prefill_cfg,
        })
    }

    /// The same backend, with the `o_proj` all-reduce of a path with one rank per GPU of
    /// `nccl` run through NCCL on those GPUs (the partials are copied to their ranks' GPUs and
    /// rank 0's copy of the sum back); a path with another rank count keeps the host collective.
    pub fn with_nccl(&self, nccl: Rc<NcclAllReduce>) -> Self {
        CudaOps {
            nccl: Some(nccl),
            ..self.clone()
        }
    }

    /// The GPUs of the NCCL all-reduce ([`CudaOps::with_nccl`]), if any.
    pub fn nccl_devices(&self) -> Option<&[usize]> {
        self.nccl.as_deref().map(NcclAllReduce::devices)
    }

    /// The same device and kernels, computing in another dtype.
    pub fn with_dtype(&self, dtype: Dtype) -> Self {
        CudaOps { dtype, ..self.clone() }
    }

    /// The same device, launching `kernels`.
    pub fn with_kernels(&self, kernels: Kernels) -> Self {
        CudaOps {
            kernels,
            ..self.clone()
        }
    }

    /// The same backend, with the f64 reference on the GPU (`true`) or on the CPU.
    pub fn with_gpu_reference(&self, gpu_reference: bool) -> Self {
        CudaOps {
            gpu_reference,
            ..self.clone()
        }
    }

    /// From now on (`true`) the sites a path records stay on the device, collected for
    /// [`CudaOps::take_device_sites`], instead of being downloaded into the path's trace; `false`
    /// goes back to downloading and drops what was collected. Shared by every clone of this
    /// backend.
    pub fn keep_sites_on_device(&self, on: bool) {
        if let Ok(mut g) = self.device_sites.lock() {
            *g = on.then(Vec::new);
        }
    }

    /// The sites collected on the device since the last call, in recording order (empty unless
    /// [`CudaOps::keep_sites_on_device`] is on).
    pub fn take_device_sites(&self) -> Vec<DeviceSite<f32>> {
        self.device_sites
            .lock()
            .ok()
            .and_then(|mut g| g.as_mut().map(std::mem::take))
            .unwrap_or_default()
    }

    /// Whether the f64 reference runs on this device ([`CudaOps::with_gpu_reference`]).
    pub fn gpu_reference(&self) -> bool {
        self.gpu_reference
    }

    /// The same device, synchronizing after every launch or not (benchmarks time back-to-back
    /// launches and check errors once at the end with [`CudaOps::synchronize`]).
    pub fn with_sync_each(&self, sync_each: bool) -> Self {
        CudaOps {
            sync_each,
            ..self.clone()
        }
    }

    /// Waits for every launched kernel and reports any error.
    pub fn synchronize(&self) -> Result<()> {
        self.dev
            .stream()
            .synchronize()
            .map_err(|e| Error::cuda(format!("stream synchronize: {e:?}")))
    }

    /// Which attention kernels this backend launches.
    pub fn kernels(&self) -> Kernels {
        self.kernels
    }

    /// True when the tensor-core kernels serve this dtype (they take bf16 inputs).
    pub fn uses_fast(&self) -> bool {
        self.kernels == Kernels::Fast && self.dtype == Dtype::Bf16
    }

    /// The stream (for benchmarks).
    pub fn stream(&self) -> &Arc<CudaStream> {
        self.dev.stream()
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.dev
    }

    /// Loads layer `layer`'s weights for a GPU run: the host copy from the CPU decoder
    /// ([`LayerWeights::load`]), for the weight sites, the non-finite scan, the CPU reference and
    /// the detectors; and each of those whole tensors dequantized once on the device from the
    /// raw GGUF bytes ([`CudaOps::dequant`]), kept ([`Device::keep_layer_weight`]) for the GPU
    /// reference to read and the engine paths to take over. Each memory gets its copy from its
    /// own decoder: on the H200 machine of BENCHMARKS.md's P7 the host decodes DeepSeek-V3's
    /// layer 3 (213 MB of Q4_K, 750 MB of f32) in 0.06 s on 16 threads, where downloading the
    /// device copy took 0.5 s. Call [`Device::release_layer_weights`] once the layer is judged.
    ///
    /// Errors: as [`LayerWeights::load`], and CUDA failures.
    pub fn load_layer_weights(&self, file: &GgufFile, cfg: &MlaConfig, layer: usize) -> Result<LayerWeights> {
        self.dev.release_layer_weights();
        let w = LayerWeights::load(file, cfg, layer)?;
        for tt in &w.types {
            let t = file.require_tensor(&tt.name)?;
            let n = t.n_elements() as usize;
            let buf = self.dequant(t.ggml_type, file.tensor_bytes(t), n, &t.name)?;
            self.dev.keep_layer_weight(&t.name, buf);
        }
        Ok(w)
    }

    /// Notes collected so far (types dequantized on the CPU), deduplicated.
    pub fn take_notes(&self) -> Vec<String> {
        let mut n = self
            .notes
            .lock()
            .map(|mut v| std::mem::take(&mut *v))
            .unwrap_or_default();
        n.sort();
        n.dedup();
        n
    }

    fn func(&self, module: Module, name: &'static str) -> Result<CudaFunction> {
        self.dev.func(module, name)
    }

    /// Waits for the stream and turns any asynchronous error into one naming `kernel`.
    fn sync(&self, kernel: &str) -> Result<()> {
        if !self.sync_each {
            return Ok(());
        }
        self.dev
            .stream()
            .synchronize()
            .map_err(|e| Error::cuda(format!("kernel `{kernel}` failed: {e:?}")))
    }

    pub(crate) fn alloc(&self, n: usize) -> Result<CudaSlice<f32>> {
        self.dev.alloc(n)
    }

    pub(crate) fn idx(&self, v: &[usize]) -> Result<CudaSlice<i64>> {
        self.dev.idx(v)
    }

    /// A bf16 copy of `x` (`n` elements), for kernels and GEMMs that read bf16.
    pub(crate) fn to_bf16(&self, x: &CudaSlice<f32>, n: usize) -> Result<CudaSlice<half::bf16>> {
        // SAFETY: every element is written by cast_bf16 below.
        let mut y = unsafe { self.dev.stream().alloc::<half::bf16>(n.max(1)) }
            .map_err(|e| Error::cuda(format!("alloc bf16: {e:?}")))?;
        let f = self.func(Module::Elementwise, "cast_bf16")?;
        let nn = n as i64;
        let mut b = self.dev.stream().launch_builder(&f);
        b.arg(x).arg(&mut y).arg(&nn);
        // SAFETY: argument types match the kernel signature in elementwise.cu.
        unsafe { b.launch(grid1(n)) }.map_err(|e| Error::cuda(format!("launch cast_bf16: {e:?}")))?;
        self.sync("cast_bf16")?;
        Ok(y)
    }

    /// `x` rounded to bf16 and held in f32 (`n` elements).
    fn round_bf16(&self, x: &CudaSlice<f32>, n: usize) -> Result<CudaSlice<f32>> {
        let mut y = self.alloc(n)?;
        let nn = n as i64;
        let f = self.func(Module::Elementwise, "round_bf16")?;
        let mut b = self.dev.stream().launch_builder(&f);
        b.arg(x).arg(&mut y).arg(&nn);
        // SAFETY: argument types match round_bf16 in elementwise.cu.
        unsafe { b.launch(grid1(n)) }.map_err(|e| Error::cuda(format!("launch round_bf16: {e:?}")))?;
        self.sync("round_bf16")?;
        Ok(y)
    }

    fn check_len(b: &CudaSlice<f32>, need: usize, what: &str) -> Result<()> {
        if b.len() < need {
            return Err(Error::internal(format!(
                "CUDA backend: {what} needs {need} elements, buffer has {}",
                b.len()
            )));
        }
        Ok(())
    }

    /// `out [n]` from the first `n` elements of two inputs by the elementwise kernel `kernel`
    /// (`add` or `silu_mul` in elementwise.cu, each `kernel(x, y, out, n)`); each input comes with
    /// its name for the length error.
    ///
    /// Errors: an input shorter than `n`, allocation or launch failures.
    fn binary(&self, kernel: &'static str, inputs: [(&CudaSlice<f32>, &str); 2], n: usize) -> Result<CudaSlice<f32>> {
        let [(x, x_name), (y, y_name)] = inputs;
        Self::check_len(x, n, &format!("{kernel} {x_name}"))?;
        Self::check_len(y, n, &format!("{kernel} {y_name}"))?;
        let mut out = self.alloc(n)?;
        let nn = n as i64;
        let f = self.func(Module::Elementwise, kernel)?;
        let mut b = self.dev.stream().launch_builder(&f);
        b.arg(x).arg(y).arg(&mut out).arg(&nn);
        // SAFETY: the kernel takes (x, y, out, n), and both inputs hold n elements (checked above).
        unsafe { b.launch(grid1(n)) }.map_err(|e| Error::cuda(format!("launch {kernel}: {e:?}")))?;
        self.sync(kernel)?;
        Ok(out)
    }

    /// Dequantizes on the GPU when a kernel exists for `ty` ([`Device::dequant`]).
    fn gpu_dequant(&self, ty: GgmlType, bytes: &[u8], n: usize) -> Result<Option<CudaSlice<f32>>> {
        match self.dev.dequant(ty, bytes, n)? {
            Some((y, kernel)) => {
                self.sync(kernel)?;
                Ok(Some(y))
            }
            None => Ok(None),
        }
    }
}

impl CudaOps {
    /// Block tables as one `[n, max_blocks]` array (rows padded with block 0), checked against
    /// the context lengths and the cache's size; returns it and `max_blocks`.
    fn flat_tables(
        cache: &CudaSlice<f32>,
        block_size: usize,
        width: usize,
        tables: &[Vec<usize>],
        ctx: &[usize],
    ) -> Result<(Vec<usize>, usize)> {
        let max_blocks = tables.iter().map(Vec::len).max().unwrap_or(1).max(1);
        let mut flat = vec![0usize; tables.len() * max_blocks];
        for (i, (t, &c)) in tables.iter().zip(ctx).enumerate() {
            if c.div_ceil(block_size) > t.len() {
                return Err(Error::cuda(format!(
                    "decode: context {c} exceeds row {i}'s block table"
                )));
            }
            for (j, &b) in t.iter().enumerate() {
                Self::check_len(cache, (b + 1) * block_size * width, "decode block")?;
                flat[i * max_blocks + j] = b;
            }
        }
        Ok((flat, max_blocks))
    }

    /// Number of streaming multiprocessors of the device.
    pub fn sm_count(&self) -> Result<usize> {
        self.dev
            .context()
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map(|x| x.max(1) as usize)
            .map_err(|e| Error::cuda(format!("multiprocessor count: {e:?}")))
    }

    /// Blocks of `decode_split_mma` in configuration `cfg` resident per SM, for (L+R, L): the
    /// least of the thread, register and shared-memory limits (from the compiled kernel's
    /// attributes and the device's).
    pub fn decode_blocks_per_sm(&self, width: usize, dv: usize, cfg: DecodeCfg) -> Result<usize> {
        use cudarc::driver::sys::{CUdevice_attribute as D, CUfunction_attribute as F};
        let smem = cfg.smem(width);
        let f = self
            .dev
            .fast_function(Module::FastDecode, width, dv, &cfg.defines(), smem)?;
        let fa = |a: F| {
            f.get_attribute(a)
                .map(|x| x.max(0) as usize)
                .map_err(|e| Error::cuda(format!("decode_split_mma attribute {a:?}: {e:?}")))
        };
        let da = |a: D| {
            self.dev
                .context()
                .attribute(a)
                .map(|x| x.max(0) as usize)
                .map_err(|e| Error::cuda(format!("device attribute {a:?}: {e:?}")))
        };
        let (regs, static_smem) = (
            fa(F::CU_FUNC_ATTRIBUTE_NUM_REGS)?,
            fa(F::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)?,
        );
        let sm_threads = da(D::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR)?;
        let sm_regs = da(D::CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR)?;
        let sm_smem = da(D::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)?;
        let threads = cfg.threads();
        // Registers are allocated per warp in units of 256 (8 per thread), from the SM's four
        // sub-partitions (a quarter of the register file each; a block's warps are spread over
        // all four: cuda_occupancy.h); each block reserves 1 KiB of shared memory for the system.
        let warp_regs = regs.max(1).div_ceil(8) * 8 * 32;
        let by_threads = sm_threads / threads;
        let by_regs = ((sm_regs / 4) / warp_regs * 4) / (threads / 32);
        let by_smem = sm_smem / (smem + static_smem + 1024);
        Ok(by_threads.min(by_regs).min(by_smem).clamp(1, 32))
    }

    /// Clusters of `cluster` blocks of `decode_split_mma` in configuration `cfg` (compiled with
    /// `FD_CLUSTER` = `cluster`, for (L+R, L) = (`width`, `dv`)) that the device can hold at
    /// once (`cuOccupancyMaxActiveClusters`): a launch of more clusters than this runs in more
    /// than one wave.
    ///
    /// # Errors
    /// [`Error::Cuda`] when the kernel does not compile or the driver refuses the query (e.g.
    /// below sm_90).
    pub fn decode_max_active_clusters(&self, width: usize, dv: usize, cfg: DecodeCfg, cluster: usize) -> Result<usize> {
        let smem = cfg.smem(width);
        let f = self
            .dev
            .fast_function(Module::FastDecode, width, dv, &cfg.defines_for(cluster), smem)?;
        let lc = LaunchConfig {
            grid_dim: (1, cluster.max(1) as u32, 1),
            block_dim: (cfg.threads() as u32, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        f.occupancy_max_active_clusters(lc, self.dev.stream())
            .map(|x| x as usize)
            .map_err(|e| Error::cuda(format!("decode_split_mma: max active clusters of {cluster}: {e:?}")))
    }

    /// KV splits that fill whole waves: the `s` in `1..=max_splits` minimizing
    /// `⌈rows·groups·s / slots⌉ / s` (time in units of one unsplit block), the smallest on ties,
    /// where `slots` = SMs × resident blocks per SM.
    pub fn decode_splits_for(
        &self,
        rows: usize,
        nh: usize,
        width: usize,
        dv: usize,
        cfg: DecodeCfg,
        max_splits: usize,
    ) -> Result<usize> {
        let slots = self.sm_count()? * self.decode_blocks_per_sm(width, dv, cfg)?;
        Ok(wave_splits(rows * nh.div_ceil(cfg.heads), slots, max_splits))
    }

    /// Tensor-core flash prefill ([`CudaOps::prefill_mma`]) on bf16 copies of `a`'s f32 inputs.
    fn flash_prefill_fast(
        &self,
        a: &PrefillArgs<'_, CudaSlice<f32>>,
        out: &mut CudaSlice<f32>,
        lse: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let (qb, kb, vb) = (
            self.to_bf16(a.q, a.q.len())?,
            self.to_bf16(a.k, a.k.len())?,
            self.to_bf16(a.v, a.v.len())?,
        );
        self.prefill_mma(None, &a.with_inputs(&qb, &kb, &vb), out, lse)
    }

    /// Launches `flash_prefill_mma` on bf16 inputs (`a.q [Tq, nh, dqk]`, `a.k [Tk, nh, dqk]`,
    /// `a.v [Tk, nh, dv]`), writing `out [Tq, nh, dv]` and `lse [Tq, nh]` (f32; see
    /// fast_prefill.cu), in configuration `cfg` (None: `MLA_DIFF_PREFILL_CFG` as read by
    /// [`CudaOps::new`] if set, else the default), adapted to the head widths by
    /// [`PrefillCfg::for_shape`]. The caller checks the buffer lengths
    /// ([`PrefillArgs::check_lens`]).
    ///
    /// Errors: tile offsets past 32 bits, an NVRTC compile or module load failure, or a launch
    /// failure, each naming the kernel.
    pub fn prefill_mma(
        &self,
        cfg: Option<PrefillCfg>,
        a: &PrefillArgs<'_, CudaSlice<half::bf16>>,
        out: &mut CudaSlice<f32>,
        lse: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let (nh, dqk, dv, scale) = (a.nh, a.dqk, a.dv, a.scale);
        let pc = match cfg {
            Some(c) => c,
            None => self.prefill_cfg.unwrap_or_default(),
        }
        .for_shape(dqk, dv);
        // The kernel's offsets inside one K/V tile are 32-bit.
        if pc.bk * nh * dqk.max(dv) > i32::MAX as usize {
            return Err(Error::cuda(format!(
                "flash_prefill_mma: {nh} heads of width {} overflow the kernel's 32-bit tile offsets",
                dqk.max(dv)
            )));
        }
        let mut segs = Vec::new();
        let mut tiles = Vec::new();
        for (si, sg) in a.segments.iter().enumerate() {
            segs.extend([sg.q_off, sg.q_len, sg.k_off, sg.k_len, usize::from(sg.causal)]);
            // Causal tiles further down see more keys: schedule the heaviest first.
            for q0 in (0..sg.q_len).step_by(pc.rows()).rev() {
                tiles.extend([si, q0]);
            }
        }
        if tiles.is_empty() {
            return Ok(());
        }
        let smem = pc.smem(dqk, dv);
        let f = self
            .dev
            .fast_function(Module::FastPrefill, dqk, dv, &pc.defines(), smem)?;
        let (segs_d, tiles_d) = (self.idx(&segs)?, self.idx(&tiles)?);
        let cfg = LaunchConfig {
            grid_dim: ((tiles.len() / 2) as u32, nh as u32, 1),
            block_dim: (pc.threads() as u32, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let (h, em) = (nh as i64, a.empty.code());
        let mut b = self.dev.stream().launch_builder(&f);
        b.arg(a.q)
            .arg(a.k)
            .arg(a.v)
            .arg(out)
            .arg(lse)
            .arg(&segs_d)
            .arg(&tiles_d)
            .arg(&h)
            .arg(&scale)
            .arg(&em);
        // SAFETY: arguments match flash_prefill_mma in fast_prefill.cu.
        unsafe { b.launch(cfg) }.map_err(|e| Error::cuda(format!("launch flash_prefill_mma: {e:?}")))?;
        self.sync("flash_prefill_mma")
    }

    /// Whether the tensor-core decode kernel serves rows of `width` (L+R) with value width `dv`
    /// (L) in this backend's dtype and kernels.
    fn fast_decode_serves(&self, width: usize, dv: usize) -> bool {
        self.uses_fast() && width.is_multiple_of(16) && dv.is_multiple_of(32) && dv <= width
    }

    /// The device inputs of a tensor-core decode launch for `d`: bf16 copies of the query rows
    /// and the cache, the block tables (padded to one `[n, max_blocks]` array) and context
    /// lengths as i64, and the launch configuration (`MLA_DIFF_DECODE_CFG` as read by
    /// [`CudaOps::new`] if set, else the default for the head count, fitted to the widths and the
    /// device).
    ///
    /// Errors: a block table shorter than its context or reaching
    /// past the cache, CUDA allocation or copy failures.
    fn fast_decode_inputs(&self, d: &DecodeArgs<'_, CudaSlice<f32>>) -> Result<FastDecodeInputs> {
        let (flat, max_blocks) = Self::flat_tables(d.cache, d.block_size, d.width, d.tables, d.ctx)?;
        let cfg = self
            .decode_cfg
            .unwrap_or_else(|| DecodeCfg::for_heads(d.nh))
            .fit(d.width, d.dv)
            .for_arch(&self.dev.arch);
        Ok(FastDecodeInputs {
            q: self.to_bf16(d.q, d.q.len())?,
            cache: self.to_bf16(d.cache, d.cache.len())?,
            tables: self.idx(&flat)?,
            ctx: self.idx(d.ctx)?,
            shape: DecodeShape {
                n: d.n,
                nh: d.nh,
                block_size: d.block_size,
                width: d.width,
                max_blocks,
                splits: d.splits,
                dv: d.dv,
                cfg,
                spin: None,
            },
            scale: d.scale,
            empty_lse: d.empty_lse,
        })
    }

    /// Launches `decode_split_mma` on the device inputs of `l` ([`DecodeLaunch`]), writing each
    /// split's partial output into `parts [splits, n, nh, dv]` and its LSE into
    /// `lses [splits, n, nh]` (f32). With `merge`, the kernel also merges
    /// the splits, as [`Ops::merge`] would, into `merge.out` and `merge.lse`: through a
    /// thread-block cluster of the `splits` blocks of each token and head group where
    /// [`DecodeCfg::cluster_size`] is not 0 for this device (then `parts`, `lses` and
    /// `merge.counters` are not touched), else by the last block of each token and head group
    /// to finish, through `parts` and `lses`.
    ///
    /// # Errors
    /// [`Error::Cuda`] when a merge output or the counters are too short, when `l.shape.cfg` is the
    /// wgmma block and the device is not sm_90 or the shape is outside
    /// [`DecodeCfg::wgmma_fits`], when the cluster
    /// merge's partials do not fit in a block's shared memory ([`DecodeCfg::cluster_fits`]), or
    /// on a compile or launch failure.
    pub fn decode_mma(
        &self,
        l: &DecodeLaunch<'_>,
        parts: &mut CudaSlice<f32>,
        lses: &mut CudaSlice<f32>,
        merge: Option<DecodeMerge<'_>>,
    ) -> Result<()> {
        let (sh, dc) = (l.shape, l.shape.cfg);
        if dc.wgmma && !(supports_wgmma(&self.dev.arch) && DecodeCfg::wgmma_fits(sh.width, sh.dv)) {
            return Err(Error::cuda(format!(
                "decode configuration {}: wgmma needs sm_90 (this device is {}) and L a multiple of 128 with L+R <= 576 (here L+R = {}, L = {})",
                dc.label(),
                self.dev.arch,
                sh.width,
                sh.dv
            )));
        }
        let smem = dc.smem(sh.width);
        let cluster = dc.cluster_size(&self.dev.arch, sh.splits, sh.dv, merge.is_some());
        if (cluster > 0 || dc.teams > 1) && !dc.cluster_fits(sh.width, sh.dv, cluster) {
            return Err(Error::cuda(format!(
                "decode configuration {}: the {} partial output [{}, {}] f32 does not fit in the block's {smem} bytes of shared memory (use CLUSTER 0, one team or fewer heads per block)",
                dc.label(),
                if cluster > 0 {
                    "cluster merge's"
                } else {
                    "team combine's"
                },
                dc.heads,
                sh.dv
            )));
        }
        let f = self
            .dev
            .fast_function(Module::FastDecode, sh.width, sh.dv, &dc.defines_for(cluster), smem)?;
        // With a cluster, grid.y = splits = the cluster's y size (__cluster_dims__(1, c, 1)):
        // one cluster per (token, head group).
        let cfg = LaunchConfig {
            grid_dim: ((sh.n * sh.nh.div_ceil(dc.heads)) as u32, sh.splits as u32, 1),
            block_dim: (dc.threads() as u32, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let a = [sh.n, sh.nh, sh.block_size, sh.max_blocks, sh.splits].map(|x| x as i64);
        let mut b = self.dev.stream().launch_builder(&f);
        b.arg(l.q).arg(l.cache).arg(l.tables).arg(l.ctx).arg(parts).arg(lses);
        b.arg(&a[0])
            .arg(&a[1])
            .arg(&a[2])
            .arg(&a[3])
            .arg(&a[4])
            .arg(&l.scale)
            .arg(&l.empty_lse);
        let null = 0u64;
        // Every split merges its share of the value columns once all have arrived (the kernel's
        // spin mode) when every block of the launch is resident at once. `MLA_DIFF_DECODE_SPIN`:
        // `0` keeps the last block merging everything; `force` spins even when the blocks do not
        // all fit (for testing the kernel's give-up path).
        let spin_env = std::env::var("MLA_DIFF_DECODE_SPIN").unwrap_or_default();
        let possible = merge.is_some() && cluster == 0 && (2..=255).contains(&sh.splits);
        let spin = i32::from(
            possible
                && match sh.spin {
                    Some(on) => on,
                    None if spin_env == "0" => false,
                    None if spin_env == "force" => true,
                    None => {
                        sh.n * sh.nh.div_ceil(dc.heads) * sh.splits
                            <= self.sm_count()? * self.decode_blocks_per_sm(sh.width, sh.dv, dc)?
                    }
                },
        );
        match merge {
            Some(m) => {
                let groups = sh.n * sh.nh.div_ceil(dc.heads);
                Self::check_len(m.out, sh.n * sh.nh * sh.dv, "decode merged out")?;
                Self::check_len(m.lse, sh.n * sh.nh, "decode merged lse")?;
                if m.counters.len() < groups {
                    return Err(Error::cuda(format!(
                        "decode merge counters: {} for {groups} blocks per split",
                        m.counters.len()
                    )));
                }
                b.arg(m.out).arg(m.lse).arg(m.counters);
            }
            None => {
                b.arg(&null).arg(&null).arg(&null);
            }
        }
        b.arg(&spin);
        // SAFETY: arguments match decode_split_mma in fast_decode.cu (null out: no merge).
        unsafe { b.launch(cfg) }.map_err(|e| Error::cuda(format!("launch decode_split_mma: {e:?}")))?;
        self.sync("decode_split_mma")
    }
}

/// Outputs of the merge fused into `decode_split_mma` ([`CudaOps::decode_mma`]).
pub struct DecodeMerge<'a> {
    /// Merged output `[n, nh, dv]`.
    pub out: &'a mut CudaSlice<f32>,
    /// Merged LSE `[n, nh]`.
    pub lse: &'a mut CudaSlice<f32>,
    /// One counter per (token, head group), `n·⌈nh/heads⌉` of them: zero before the launch, zero
    /// again after it.
    pub counters: &'a mut CudaSlice<i32>,
}

/// Shape of a split-KV decode launch.
#[derive(Debug, Clone, Copy)]
pub struct DecodeShape {
    /// Query rows (decode tokens).
    pub n: usize,
    /// Heads per row.
    pub nh: usize,
    /// Tokens per cache page.
    pub block_size: usize,
    /// Cache row width, L+R.
    pub width: usize,
    /// Columns of the block-table array.
    pub max_blocks: usize,
    /// KV splits per row.
    pub splits: usize,
    /// Value width, L.
    pub dv: usize,
    /// Launch configuration.
    pub cfg: DecodeCfg,
    /// How the fused merge is shared out (see fast_decode.cu's `fd_merge_tail`): `None` lets
    /// [`CudaOps::decode_mma`] choose (every split merges its share when every block of the
    /// launch is resident at once, unless `MLA_DIFF_DECODE_SPIN=0`; `force` spins regardless);
    /// `Some(false)`: the last split merges everything; `Some(true)`: every split merges its
    /// share even when the blocks do not all fit (the kernel then gives up waiting after a few ms
    /// per block and falls back to the last split merging everything: for tests).
    pub spin: Option<bool>,
}

/// One launch of `decode_split_mma` ([`CudaOps::decode_mma`]): its inputs already on the
/// device, its shape, and the scalars of the softmax.
pub struct DecodeLaunch<'a> {
    /// Query rows `[n, nh, width]`, bf16: each head's `[ql_nope | q_pe]` (roped).
    pub q: &'a CudaSlice<half::bf16>,
    /// The paged latent cache `[num_blocks·block_size, width]`, bf16, rows `[kv_c_normed | k_pe]`.
    pub cache: &'a CudaSlice<half::bf16>,
    /// Block ids of each row's pages `[n, max_blocks]`, i64, rows padded with block 0.
    pub tables: &'a CudaSlice<i64>,
    /// Context length (tokens) of each row `[n]`, i64.
    pub ctx: &'a CudaSlice<i64>,
    /// Shape and configuration.
    pub shape: DecodeShape,
    /// Softmax scale multiplying `q·k`.
    pub scale: f32,
    /// LSE an empty split reports (−inf is right).
    pub empty_lse: f32,
}

/// What [`CudaOps::fast_decode_inputs`] puts on the device for one [`DecodeArgs`].
struct FastDecodeInputs {
    q: CudaSlice<half::bf16>,
    cache: CudaSlice<half::bf16>,
    tables: CudaSlice<i64>,
    ctx: CudaSlice<i64>,
    shape: DecodeShape,
    scale: f32,
    empty_lse: f32,
}

impl FastDecodeInputs {
    /// The launch reading these inputs.
    fn launch(&self) -> DecodeLaunch<'_> {
        DecodeLaunch {
            q: &self.q,
            cache: &self.cache,
            tables: &self.tables,
            ctx: &self.ctx,
            shape: self.shape,
            scale: self.scale,
            empty_lse: self.empty_lse,
        }
    }
}

macro_rules! launch {
    ($self:ident, $module:expr, $name:literal, $cfg:expr, $($arg:expr),* $(,)?) => {{
        let f = $self.func($module, $name)?;
        let mut b = $self.dev.stream().launch_builder(&f);
        $( b.arg($arg); )*
        // SAFETY: the argument list matches the kernel's signature in kernels/*.cu, and every
        // buffer was length-checked by the caller.
        unsafe { b.launch($cfg) }.map_err(|e| Error::cuda(format!("launch {}: {e:?}", $name)))?;
        $self.sync($name)?;
    }};
}

impl Ops for CudaOps {
    type Buf = CudaSlice<f32>;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// Through NCCL when `--devices` gave one GPU per partial ([`CudaOps::with_nccl`]), else the
    /// host collective.
    fn all_reduce_sum(
        &self,
        parts: Vec<CudaSlice<f32>>,
        n: usize,
        fault: Option<ReduceFault>,
    ) -> Result<CudaSlice<f32>> {
        let Some(nccl) = self.nccl.as_ref().filter(|c| c.devices().len() == parts.len()) else {
            return host_all_reduce(self, parts, n, fault);
        };
        let host = download_parts(self, &parts, n)?;
        drop(parts);
        let mut copies = nccl.all_reduce_sum(&host, fault)?;
        self.upload(&copies.swap_remove(0))
    }

    fn upload(&self, data: &[f32]) -> Result<CudaSlice<f32>> {
        if data.is_empty() {
            return self.canary(0);
        }
        self.dev
            .stream()
            .clone_htod(data)
            .map_err(|e| Error::cuda(format!("upload: {e:?}")))
    }

    fn download(&self, b: &CudaSlice<f32>) -> Result<Vec<f32>> {
        self.dev
            .stream()
            .clone_dtoh(b)
            .map_err(|e| Error::cuda(format!("download: {e:?}")))
    }

    fn keep_site(&self, site: Site, shape: &[usize], b: &CudaSlice<f32>) -> Result<Option<Vec<f32>>> {
        let n: usize = shape.iter().product();
        let mut guard = self
            .device_sites
            .lock()
            .map_err(|_| Error::cuda("device site list poisoned"))?;
        let Some(sites) = guard.as_mut() else {
            drop(guard);
            let mut v = self.download(b)?;
            v.truncate(n);
            return Ok(Some(v));
        };
        if n > b.len() {
            return Err(Error::Internal(format!(
                "site {site}: shape {shape:?} holds {n} elements, its buffer {}",
                b.len()
            )));
        }
        // A copy: the engine reuses or frees its buffers after recording them.
        let copy = self
            .dev
            .stream()
            .clone_dtod(&b.slice(0..n.max(1).min(b.len())))
            .map_err(|e| Error::cuda(format!("copy of site {site}: {e:?}")))?;
        sites.push(DeviceSite {
            site,
            shape: shape.to_vec(),
            buf: copy,
        });
        Ok(None)
    }

    fn canary(&self, n: usize) -> Result<CudaSlice<f32>> {
        let mut x = self.alloc(n)?;
        let len = x.len();
        let (nn, bits) = (len as i64, CANARY_BITS);
        launch!(self, Module::Elementwise, "fill_bits", grid1(len), &mut x, &nn, &bits);
        Ok(x)
    }

    fn take_dequantized(&self, name: &str, n: usize) -> Option<CudaSlice<f32>> {
        self.dev.take_layer_weight(name, n)
    }

    fn dequant(&self, ty: GgmlType, bytes: &[u8], n: usize, label: &str) -> Result<CudaSlice<f32>> {
        if let Some(y) = self.gpu_dequant(ty, bytes, n)? {
            return Ok(y);
        }
        if let Ok(mut notes) = self.notes.lock() {
            notes.push(format!(
                "{ty} has no GPU dequantization kernel: dequantized on the CPU and uploaded ({label})"
            ));
        }
        let v = dequant::dequantize(ty, bytes, n).map_err(|reason| Error::Dequant {
            path: "<engine>".into(),
            tensor: label.to_string(),
            reason,
        })?;
        self.upload(&v)
    }

    fn linear(&self, x: &CudaSlice<f32>, t: usize, k: usize, w: &CudaSlice<f32>, o: usize) -> Result<CudaSlice<f32>> {
        Self::check_len(x, t * k, "linear x")?;
        Self::check_len(w, o * k, "linear w")?;
        let mut y = self.canary(t * o)?;
        if t == 0 || o == 0 || k == 0 {
            return Ok(y);
        }
        // Row-major y[t,o] = x[t,k]·w[o,k]ᵀ is column-major yᵀ = W·xᵀ: C(o×t) = Aᵀ(o×k)·B(k×t)
        // with A = w as a k×o column-major matrix and B = x as k×t.
        let sgemm = GemmConfig {
            transa: cb::cublasOperation_t::CUBLAS_OP_T,
            transb: cb::cublasOperation_t::CUBLAS_OP_N,
            m: o as i32,
            n: t as i32,
            k: k as i32,
            alpha: 1.0f32,
            lda: k as i32,
            ldb: k as i32,
            beta: 0.0f32,
            ldc: o as i32,
        };
        match self.dtype {
            Dtype::F32 => {
                // SAFETY: dims and leading dimensions match the buffers checked above.
                unsafe { self.dev.blas().gemm(sgemm, w, x, &mut y) }
                    .map_err(|e| Error::cuda(format!("cublasSgemm: {e:?}")))?;
            }
            Dtype::Bf16 if std::env::var_os("MLA_DIFF_BF16_GEMM").is_some_and(|v| v == "emulate") => {
                // bf16 inputs held exactly in f32, f32 accumulation: the same arithmetic as the
                // bf16 GEMM, through cublasSgemm. For compute-sanitizer runs, which cannot handle
                // cuBLAS's bf16 kernels.
                let (xr, wr) = (self.round_bf16(x, t * k)?, self.round_bf16(w, o * k)?);
                // SAFETY: dims and leading dimensions match the buffers checked above.
                unsafe { self.dev.blas().gemm(sgemm, &wr, &xr, &mut y) }
                    .map_err(|e| Error::cuda(format!("cublasSgemm: {e:?}")))?;
            }
            Dtype::Bf16 => {
                let (wb, xb) = (self.to_bf16(w, o * k)?, self.to_bf16(x, t * k)?);
                let (alpha, beta) = (1.0f32, 0.0f32);
                let stream = &self.dev.stream();
                let (wp, _gw) = wb.device_ptr(stream);
                let (xp, _gx) = xb.device_ptr(stream);
                let (yp, _gy) = y.device_ptr_mut(stream);
                // SAFETY: bf16 inputs, f32 output, f32 compute; dims as above.
                unsafe {
                    cudarc::cublas::result::gemm_ex(
                        *self.dev.blas().handle(),
                        cb::cublasOperation_t::CUBLAS_OP_T,
                        cb::cublasOperation_t::CUBLAS_OP_N,
                        o as i32,
                        t as i32,
                        k as i32,
                        (&alpha as *const f32).cast::<c_void>(),
                        wp as *const c_void,
                        cb::cudaDataType_t::CUDA_R_16BF,
                        k as i32,
                        xp as *const c_void,
                        cb::cudaDataType_t::CUDA_R_16BF,
                        k as i32,
                        (&beta as *const f32).cast::<c_void>(),
                        yp as *mut c_void,
                        cb::cudaDataType_t::CUDA_R_32F,
                        o as i32,
                        cb::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                        cb::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                    )
                }
                .map_err(|e| Error::cuda(format!("cublasGemmEx (bf16 in, f32 out): {e:?}")))?;
            }
        }
        self.sync("cublas gemm")?;
        Ok(y)
    }

    fn add(&self, a: &CudaSlice<f32>, b: &CudaSlice<f32>, n: usize) -> Result<CudaSlice<f32>> {
        self.binary("add", [(a, "a"), (b, "b")], n)
    }

    fn silu_mul(&self, g: &CudaSlice<f32>, u: &CudaSlice<f32>, n: usize) -> Result<CudaSlice<f32>> {
        self.binary("silu_mul", [(g, "g"), (u, "u")], n)
    }

    fn rms_norm(
        &self,
        src: &CudaSlice<f32>,
        rows: usize,
        off: usize,
        stride: usize,
        width: usize,
        g: &CudaSlice<f32>,
        eps: f32,
    ) -> Result<CudaSlice<f32>> {
        Self::check_len(g, width, "rms_norm weight")?;
        let mut out = self.canary(rows * width)?;
        if rows == 0 {
            return Ok(out);
        }
        let (r, o, s, w, len) = (rows as i64, off as i64, stride as i64, width as i64, src.len() as i64);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(
            self,
            Module::NormRope,
            "rms_norm",
            cfg,
            src,
            g,
            &mut out,
            &r,
            &o,
            &s,
            &w,
            &len,
            &eps
        );
        Ok(out)
    }

    fn copy2d(&self, src: &CudaSlice<f32>, dst: &mut CudaSlice<f32>, c: Copy2d) -> Result<()> {
        if c.rows == 0 || c.width == 0 {
            return Ok(());
        }
        let div = c.src_row_div.max(1);
        Self::check_len(
            src,
            c.src_off + ((c.rows - 1) / div) * c.src_stride + c.width,
            "copy2d source",
        )?;
        Self::check_len(
            dst,
            c.dst_off + (c.rows - 1) * c.dst_stride + c.width,
            "copy2d destination",
        )?;
        let a = [c.rows, c.width, c.src_off, c.src_stride, div, c.dst_off, c.dst_stride].map(|x| x as i64);
        launch!(
            self,
            Module::Elementwise,
            "copy2d",
            grid1(c.rows * c.width),
            src,
            dst,
            &a[0],
            &a[1],
            &a[2],
            &a[3],
            &a[4],
            &a[5],
            &a[6]
        );
        Ok(())
    }

    fn transpose(&self, src: &CudaSlice<f32>, batch: usize, rows: usize, cols: usize) -> Result<CudaSlice<f32>> {
        Self::check_len(src, batch * rows * cols, "transpose")?;
        let mut out = self.canary(batch * rows * cols)?;
        let (b, r, c) = (batch as i64, rows as i64, cols as i64);
        launch!(
            self,
            Module::Elementwise,
            "transpose",
            grid1(batch * rows * cols),
            src,
            &mut out,
            &b,
            &r,
            &c
        );
        Ok(out)
    }

    fn gather_rows(&self, src: &CudaSlice<f32>, row_len: usize, idx: &[usize]) -> Result<CudaSlice<f32>> {
        if let Some(&m) = idx.iter().max() {
            Self::check_len(src, (m + 1) * row_len, "gather_rows")?;
        }
        let mut out = self.canary(idx.len() * row_len)?;
        if idx.is_empty() {
            return Ok(out);
        }
        let d = self.idx(idx)?;
        let (n, rl) = (idx.len() as i64, row_len as i64);
        launch!(
            self,
            Module::Elementwise,
            "gather_rows",
            grid1(idx.len() * row_len),
            src,
            &d,
            &mut out,
            &n,
            &rl
        );
        Ok(out)
    }

    fn scatter_rows(
        &self,
        dst: &mut CudaSlice<f32>,
        src: &CudaSlice<f32>,
        row_len: usize,
        idx: &[usize],
    ) -> Result<()> {
        if idx.is_empty() {
            return Ok(());
        }
        Self::check_len(src, idx.len() * row_len, "scatter_rows source")?;
        if let Some(&m) = idx.iter().max() {
            Self::check_len(dst, (m + 1) * row_len, "scatter_rows destination")?;
        }
        let d = self.idx(idx)?;
        let (n, rl) = (idx.len() as i64, row_len as i64);
        launch!(
            self,
            Module::Elementwise,
            "scatter_rows",
            grid1(idx.len() * row_len),
            dst,
            src,
            &d,
            &n,
            &rl
        );
        Ok(())
    }

    fn rope(
        &self,
        x: &mut CudaSlice<f32>,
        rows: usize,
        r: usize,
        positions: &[usize],
        cos: &CudaSlice<f32>,
        sin: &CudaSlice<f32>,
        style: RopeStyle,
    ) -> Result<()> {
        Self::check_len(x, rows * r, "rope")?;
        let half = r / 2;
        if let Some(&m) = positions.iter().take(rows).max() {
            Self::check_len(cos, (m + 1) * half, "rope cos table")?;
            Self::check_len(sin, (m + 1) * half, "rope sin table")?;
        }
        if rows == 0 {
            return Ok(());
        }
        let pos = self.idx(&positions[..rows])?;
        let (rr, rl, neox) = (rows as i64, r as i64, i32::from(style == RopeStyle::Neox));
        launch!(
            self,
            Module::NormRope,
            "rope",
            grid1(rows * half),
            x,
            &pos,
            cos,
            sin,
            &rr,
            &rl,
            &neox
        );
        Ok(())
    }

    fn bmm_heads(
        &self,
        x: &CudaSlice<f32>,
        t: usize,
        nh: usize,
        a: usize,
        w: &CudaSlice<f32>,
        b: usize,
    ) -> Result<CudaSlice<f32>> {
        Self::check_len(x, t * nh * a, "bmm_heads x")?;
        Self::check_len(w, nh * a * b, "bmm_heads w")?;
        let mut out = self.canary(t * nh * b)?;
        let (tt, n, aa, bb, bf) = (
            t as i64,
            nh as i64,
            a as i64,
            b as i64,
            i32::from(self.dtype == Dtype::Bf16),
        );
        launch!(
            self,
            Module::Elementwise,
            "bmm_heads",
            grid1(t * nh * b),
            x,
            w,
            &mut out,
            &tt,
            &n,
            &aa,
            &bb,
            &bf
        );
        Ok(out)
    }

    fn flash_attention(
        &self,
        a: &PrefillArgs<'_, CudaSlice<f32>>,
        out: &mut CudaSlice<f32>,
        lse: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let (nh, dqk, dv) = (a.nh, a.dqk, a.dv);
        if dqk > MAX_WIDTH || dv > MAX_WIDTH {
            return Err(Error::cuda(format!(
                "flash_prefill supports head widths up to {MAX_WIDTH}, got P+R={dqk}, V={dv}"
            )));
        }
        a.check_lens(out, lse, Self::check_len)?;
        // The tensor-core path builds its own tile list (its block height depends on the
        // configuration) and uploads bf16 copies itself.
        if self.uses_fast() && dqk.is_multiple_of(16) && dv.is_multiple_of(16) {
            return self.flash_prefill_fast(a, out, lse);
        }
        let mut segs = Vec::new();
        let mut tiles = Vec::new();
        for (si, sg) in a.segments.iter().enumerate() {
            segs.extend([sg.q_off, sg.q_len, sg.k_off, sg.k_len, usize::from(sg.causal)]);
            for q0 in (0..sg.q_len).step_by(FLASH_ROWS) {
                tiles.extend([si, q0]);
            }
        }
        if tiles.is_empty() {
            return Ok(());
        }
        let n_tiles = tiles.len() / 2;
        let (segs_d, tiles_d) = (self.idx(&segs)?, self.idx(&tiles)?);
        let cfg = LaunchConfig {
            grid_dim: (n_tiles as u32, nh as u32, 1),
            block_dim: (32 * FLASH_ROWS as u32, 1, 1),
            shared_mem_bytes: ((FLASH_BK * (dqk + dv) + FLASH_ROWS * dqk) * 4) as u32,
        };
        let (h, qk_width, v_width, em) = (nh as i64, dqk as i64, dv as i64, a.empty.code());
        // The f32 kernel reads the inputs as they are, the bf16 one bf16 copies of them.
        let (name, bf16) = match self.dtype {
            Dtype::F32 => ("flash_prefill_f32", None),
            Dtype::Bf16 => (
                "flash_prefill_bf16",
                Some([
                    self.to_bf16(a.q, a.q.len())?,
                    self.to_bf16(a.k, a.k.len())?,
                    self.to_bf16(a.v, a.v.len())?,
                ]),
            ),
        };
        let f = self.func(Module::Attention, name)?;
        let mut b = self.dev.stream().launch_builder(&f);
        match &bf16 {
            Some([qb, kb, vb]) => b.arg(qb).arg(kb).arg(vb),
            None => b.arg(a.q).arg(a.k).arg(a.v),
        };
        b.arg(out).arg(lse).arg(&segs_d).arg(&tiles_d).arg(&h);
        b.arg(&qk_width).arg(&v_width).arg(&a.scale).arg(&em);
        // SAFETY: the arguments match the kernel's signature in attention.cu (inputs in the
        // dtype's element type), and every buffer was length-checked above.
        unsafe { b.launch(cfg) }.map_err(|e| Error::cuda(format!("launch {name}: {e:?}")))?;
        self.sync(name)
    }

    fn cache_write(
        &self,
        cache: &mut CudaSlice<f32>,
        width: usize,
        kv_c: &CudaSlice<f32>,
        k_pe: &CudaSlice<f32>,
        l: usize,
        r: usize,
        slots: &[usize],
    ) -> Result<()> {
        if slots.is_empty() {
            return Ok(());
        }
        if l + r != width {
            return Err(Error::internal(format!(
                "CUDA backend: cache_write: row width {width} != L+R = {}",
                l + r
            )));
        }
        Self::check_len(kv_c, slots.len() * l, "cache_write kv_c")?;
        Self::check_len(k_pe, slots.len() * r, "cache_write k_pe")?;
        if let Some(&m) = slots.iter().max() {
            Self::check_len(cache, (m + 1) * width, "cache_write slot")?;
        }
        let s = self.idx(slots)?;
        let (n, ll, rr) = (slots.len() as i64, l as i64, r as i64);
        launch!(
            self,
            Module::Elementwise,
            "cache_write",
            grid1(slots.len() * width),
            cache,
            kv_c,
            k_pe,
            &s,
            &n,
            &ll,
            &rr
        );
        Ok(())
    }

    fn decode_split(
        &self,
        d: &DecodeArgs<'_, CudaSlice<f32>>,
        parts: &mut CudaSlice<f32>,
        lses: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let DecodeArgs {
            q,
            n,
            nh,
            cache,
            block_size,
            width,
            tables,
            ctx,
            splits,
            dv,
            scale,
            empty_lse,
        } = *d;
        if n == 0 {
            return Ok(());
        }
        if dv > MAX_WIDTH {
            return Err(Error::cuda(format!(
                "decode_split supports value widths up to {MAX_WIDTH}, got L={dv}"
            )));
        }
        d.check_lens(parts, lses, Self::check_len)?;
        if self.fast_decode_serves(width, dv) {
            return self.decode_mma(&self.fast_decode_inputs(d)?.launch(), parts, lses, None);
        }
        let (flat, max_blocks) = Self::flat_tables(cache, block_size, width, tables, ctx)?;
        let (tables_d, ctx_d) = (self.idx(&flat)?, self.idx(ctx)?);
        let cfg = LaunchConfig {
            grid_dim: ((n * nh) as u32, splits as u32, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: (width * 4) as u32,
        };
        let a = [n, nh, width, dv, block_size, max_blocks, splits].map(|x| x as i64);
        // The f32 kernel reads q and the cache as they are, the bf16 one bf16 copies of them.
        let (name, bf16) = match self.dtype {
            Dtype::F32 => ("decode_split_f32", None),
            Dtype::Bf16 => (
                "decode_split_bf16",
                Some([self.to_bf16(q, q.len())?, self.to_bf16(cache, cache.len())?]),
            ),
        };
        let f = self.func(Module::Attention, name)?;
        let mut b = self.dev.stream().launch_builder(&f);
        match &bf16 {
            Some([qb, cb16]) => b.arg(qb).arg(cb16),
            None => b.arg(q).arg(cache),
        };
        b.arg(&tables_d).arg(&ctx_d).arg(parts).arg(lses);
        for x in &a {
            b.arg(x);
        }
        b.arg(&scale).arg(&empty_lse);
        // SAFETY: the arguments match the kernel's signature in attention.cu (q and the cache in
        // the dtype's element type), and every buffer was length-checked above.
        unsafe { b.launch(cfg) }.map_err(|e| Error::cuda(format!("launch {name}: {e:?}")))?;
        self.sync(name)
    }

    fn decode_merged(&self, d: &DecodeArgs<'_, CudaSlice<f32>>) -> Result<(CudaSlice<f32>, CudaSlice<f32>)> {
        let DecodeArgs {
            q,
            n,
            nh,
            width,
            splits,
            dv,
            ..
        } = *d;
        if !(n > 0 && dv <= MAX_WIDTH && self.fast_decode_serves(width, dv)) {
            return crate::compute::ops::decode_then_merge(self, d);
        }
        // The fast kernel with the merge fused in: same partials (canary-filled first, as the
        // unfused path; not used by the cluster merge, which keeps them on chip), same merge
        // arithmetic, one launch.
        Self::check_len(q, n * nh * width, "decode q")?;
        let inputs = self.fast_decode_inputs(d)?;
        let cfg = inputs.shape.cfg;
        let on_chip = cfg.cluster_size(&self.dev.arch, splits, dv, true) > 0;
        let mut parts = self.canary(if on_chip { 1 } else { splits * n * nh * dv })?;
        let mut lses = self.canary(if on_chip { 1 } else { splits * n * nh })?;
        let mut out = self.canary(n * nh * dv)?;
        let mut lse = self.canary(n * nh)?;
        let mut counters = self
            .dev
            .stream()
            .alloc_zeros::<i32>(n * nh.div_ceil(cfg.heads))
            .map_err(|e| Error::cuda(format!("decode merge counters: {e:?}")))?;
        let merge = DecodeMerge {
            out: &mut out,
            lse: &mut lse,
            counters: &mut counters,
        };
        self.decode_mma(&inputs.launch(), &mut parts, &mut lses, Some(merge))?;
        Ok((out, lse))
    }

    fn merge(
        &self,
        parts: &CudaSlice<f32>,
        lses: &CudaSlice<f32>,
        k: usize,
        rows: usize,
        nh: usize,
        dv: usize,
    ) -> Result<(CudaSlice<f32>, CudaSlice<f32>)> {
        Self::check_len(parts, k * rows * nh * dv, "merge parts")?;
        Self::check_len(lses, k * rows * nh, "merge lses")?;
        let mut out = self.canary(rows * nh * dv)?;
        let mut lse = self.canary(rows * nh)?;
        if rows * nh == 0 {
            return Ok((out, lse));
        }
        let a = [k, rows, nh, dv].map(|x| x as i64);
        launch!(
            self,
            Module::Attention,
            "merge_states",
            grid1(rows * nh * dv),
            parts,
            lses,
            &mut out,
            &mut lse,
            &a[0],
            &a[1],
            &a[2],
            &a[3]
        );
        Ok((out, lse))
    }
}

/// Runs path `kind` on the GPU.
pub fn run(
    ops: &CudaOps,
    kind: PathKind,
    input: &crate::compute::path::LayerInput<'_>,
    opts: &crate::compute::path::PathOptions,
) -> Result<crate::compute::path::PathRun> {
    let mut r = crate::compute::engine::run(ops, kind, input, opts)?;
    r.notes.extend(ops.take_notes());
    Ok(r)
}
