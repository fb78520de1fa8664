//! [`CudaOps`]: the engine's kernel interface on an NVIDIA GPU.
//!
//! Buffers are `CudaSlice<f32>` on one stream. GEMMs go through cuBLAS (f32, or bf16 inputs
//! with f32 accumulation for `--dtype bf16`); every other kernel is ours, from `kernels/`. Each
//! launch is followed by a stream synchronize and an error check naming the kernel, which costs
//! speed and buys exact error attribution (this backend is for correctness; speed is the fast
//! kernels' job).
//!
//! This file holds the backend value: what it launches, in which dtype, where its sites and
//! all-reduce go. The work is cut by what changes together: `builder` turns a kernel name and
//! its arguments into a checked launch, `occupancy` asks the device what fits and picks the
//! fast kernels' launch configuration, [`fast`] launches the tensor-core kernels, `gemm` the
//! cuBLAS GEMM, and `launches` implements [`Ops`] with the simple kernels.

mod builder;
pub mod fast;
mod gemm;
mod launches;
mod occupancy;

use std::path::Path;
use std::rc::Rc;
use std::sync::{Arc, Mutex};

use cudarc::driver::CudaStream;

use crate::backend::cuda::compare::DeviceSite;
use crate::backend::cuda::nccl::NcclAllReduce;
use crate::backend::decode_cfg::DecodeCfg;
use crate::backend::prefill_cfg::PrefillCfg;
use crate::compute::ops::Ops;
use crate::compute::path::PathKind;
use crate::core::dtype::Dtype;
use crate::core::error::{Error, Result};
use crate::core::settings::{DecodeSpin, Settings};
use crate::device::ComputeCapability;
use crate::device::context::Device;
use crate::model::config::MlaConfig;
use crate::model::gguf::GgufFile;
use crate::model::weights::LayerWeights;

pub use fast::{DecodeLaunch, DecodeMerge, DecodeShape};

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
    /// `MLA_DIFF_DECODE_CFG`, parsed once when the backend is created (so a bad string is
    /// refused on every CUDA run, not only when a fast decode launches); fitted to each launch's
    /// shape and the device.
    decode_cfg: Option<DecodeCfg>,
    /// `MLA_DIFF_PREFILL_CFG`, parsed once when the backend is created, as `decode_cfg`.
    prefill_cfg: Option<PrefillCfg>,
    /// `MLA_DIFF_DECODE_SPIN` ([`CudaOps::spin_merge`]).
    decode_spin: DecodeSpin,
    /// `MLA_DIFF_BF16_GEMM=emulate` ([`CudaOps::cublas_linear`]).
    emulate_bf16_gemm: bool,
}

impl CudaOps {
    /// The device's compute capability (`sm_90`), which its kernels are compiled for.
    pub fn arch(&self) -> ComputeCapability {
        self.dev.arch
    }

    /// Opens device 0 ([`Device::open`], with `settings.device`) for a backend computing in
    /// `dtype` with the fast kernels, after parsing the kernel configurations
    /// `MLA_DIFF_DECODE_CFG` and `MLA_DIFF_PREFILL_CFG` of `settings.kernels` where set
    /// ([`DecodeCfg::parse_named`], [`PrefillCfg::parse_named`]).
    ///
    /// Errors: [`Error::Usage`] naming the variable, the string and the field when a
    /// configuration variable does not parse or breaks a rule (before any device is asked);
    /// else as [`Device::open`].
    pub fn new(dtype: Dtype, include: Option<&Path>, settings: &Settings) -> Result<Self> {
        let k = &settings.kernels;
        let decode_cfg = k
            .decode_cfg
            .as_deref()
            .map(|s| DecodeCfg::parse_named("MLA_DIFF_DECODE_CFG", s))
            .transpose()?;
        let prefill_cfg = k
            .prefill_cfg
            .as_deref()
            .map(|s| PrefillCfg::parse_named("MLA_DIFF_PREFILL_CFG", s))
            .transpose()?;
        Ok(CudaOps {
            dev: Arc::new(Device::open(include, &settings.device)?),
            dtype,
            kernels: Kernels::Fast,
            sync_each: true,
            gpu_reference: false,
            notes: Arc::new(Mutex::new(Vec::new())),
            device_sites: Arc::new(Mutex::new(None)),
            nccl: None,
            decode_cfg,
            prefill_cfg,
            decode_spin: k.decode_spin,
            emulate_bf16_gemm: k.emulate_bf16_gemm,
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
            let buf = self.dequant(t.ggml_type, &file.tensor_bytes(t), n, &t.name)?;
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
