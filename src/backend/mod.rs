//! The backends the engine paths run on, each carrying its compute dtype.
//!
//! The paths in [`crate::compute`] are written once against the [`crate::compute::ops::Ops`]
//! trait; a backend supplies the kernels: [`cpu`] (Rust, rayon) everywhere, [`cuda`] (NVRTC
//! kernels and cuBLAS on top of [`crate::device`]) where a GPU answers. A [`Backend`] is built
//! with its dtype, and everything that judges its output asks the backend for it, so the rows of
//! the tolerance table can never disagree with what the kernels computed in.

pub mod cfg_fields;
pub mod cpu;
pub mod cuda;
pub mod decode_cfg;
pub mod prefill_cfg;

use crate::backend::cuda::compare::DeviceSite;
use crate::compute::path::{LayerInput, PathKind, PathOptions, PathRun};
use crate::compute::reference::{RefInputs, RefOutput, reference_layer_full_with, reference_layer_with};
use crate::core::batch::Batch;
use crate::core::dtype::Dtype;
use crate::core::error::Result;
use crate::model::config::MlaConfig;
use crate::model::gguf::GgufFile;
use crate::model::weights::LayerWeights;

/// A backend the engine paths run on.
#[derive(Debug, Clone)]
pub enum Backend {
    /// Host kernels ([`cpu::CpuOps`]).
    Cpu(cpu::CpuOps),
    /// GPU kernels ([`cuda::ops::CudaOps`]).
    Cuda(cuda::ops::CudaOps),
}

impl Backend {
    /// `cpu` or `cuda`.
    pub fn name(&self) -> &'static str {
        match self {
            Backend::Cpu(_) => "cpu",
            Backend::Cuda(_) => "cuda",
        }
    }

    /// Compute dtype.
    pub fn dtype(&self) -> Dtype {
        use crate::compute::ops::Ops;
        match self {
            Backend::Cpu(o) => o.dtype(),
            Backend::Cuda(o) => o.dtype(),
        }
    }

    /// The same backend computing in `dtype`.
    pub fn with_dtype(&self, dtype: Dtype) -> Backend {
        match self {
            Backend::Cpu(_) => Backend::Cpu(cpu::CpuOps::new(dtype)),
            Backend::Cuda(o) => Backend::Cuda(o.with_dtype(dtype)),
        }
    }

    /// One line for reports: `cpu` or the GPU, its compute capability and NVRTC version.
    pub fn describe(&self) -> String {
        match self {
            Backend::Cpu(_) => format!("cpu ({} threads)", rayon::current_num_threads()),
            Backend::Cuda(o) if o.gpu_reference() => {
                format!("cuda: {}; f64 reference on the GPU", o.device().describe())
            }
            Backend::Cuda(o) => format!("cuda: {}", o.device().describe()),
        }
    }

    /// This backend when it runs tensor-core kernels (CUDA, fast kernels, bf16), else the CPU
    /// variant (used to decide whether a fast-vs-simple cross-check applies).
    pub fn filter_fast(self) -> Backend {
        match self {
            Backend::Cuda(o) if o.uses_fast() => Backend::Cuda(o),
            other => Backend::Cpu(cpu::CpuOps::new(other.dtype())),
        }
    }

    /// Layer `layer`'s weights, each whole tensor dequantized once for the reference and every
    /// path: on the CPU for the CPU backend ([`LayerWeights::load`]); on the device from the raw
    /// GGUF bytes for the CUDA backend, which keeps the device copy for the GPU reference and
    /// the paths until [`Backend::release_layer_weights`]
    /// ([`cuda::ops::CudaOps::load_layer_weights`]).
    ///
    /// Errors: as [`LayerWeights::load`], and CUDA failures.
    pub fn load_layer_weights(&self, file: &GgufFile, cfg: &MlaConfig, layer: usize) -> Result<LayerWeights> {
        match self {
            Backend::Cpu(_) => LayerWeights::load(file, cfg, layer),
            Backend::Cuda(o) => o.load_layer_weights(file, cfg, layer),
        }
    }

    /// Frees what [`Backend::load_layer_weights`] kept on the device (nothing on the CPU).
    pub fn release_layer_weights(&self) {
        if let Backend::Cuda(o) = self {
            o.device().release_layer_weights();
        }
    }

    /// The f64 reference of one layer (plus its rank weight sites for `tp`), where this backend
    /// runs it: on the GPU for a CUDA backend with the GPU reference on
    /// ([`cuda::ops::CudaOps::with_gpu_reference`]) when it computes the layer
    /// ([`cuda::reference::supported`]), else on the CPU. `full` runs an MoE layer's FFN too
    /// (token input), with `file` for its experts; `dsa` is what a DSA layer takes from outside
    /// (a GLM shared-indexer layer's borrowed selection, keys to attend to, the indexer's
    /// quantization: [`RefInputs`]; DSA layers always run on the CPU).
    ///
    /// With `keep_on_device`, the GPU reference leaves its activation sites on the device
    /// (returned second, for [`crate::judge::device`]) and the trace holds the rest; the CPU
    /// reference returns everything in the trace and nothing second.
    ///
    /// Errors: as [`reference_layer_with`] / [`reference_layer_full_with`], and CUDA failures.
    #[allow(
        clippy::too_many_arguments,
        reason = "the union of the CPU and GPU references' inputs (file, configuration, weights, hidden, batch, TP, DSA inputs) and two switches choosing between them"
    )]
    pub fn reference(
        &self,
        file: &GgufFile,
        cfg: &MlaConfig,
        w: &LayerWeights,
        hidden: &ndarray::Array2<f64>,
        batch: &Batch,
        tp: usize,
        dsa: &RefInputs<'_>,
        full: bool,
        keep_on_device: bool,
    ) -> Result<(RefOutput, Vec<DeviceSite<f64>>)> {
        match self {
            // The GPU reference computes unquantized projections: fp8 GEMMs run on the host.
            Backend::Cuda(o)
                if o.gpu_reference() && dsa.fp8.is_none() && cuda::reference::supported(cfg, w.layer, full) =>
            {
                if keep_on_device {
                    cuda::reference::reference_layer_split(o.device(), cfg, w, hidden, batch, tp)
                } else {
                    cuda::reference::reference_layer(o.device(), cfg, w, hidden, batch, tp).map(|r| (r, Vec::new()))
                }
            }
            _ if full => reference_layer_full_with(file, cfg, w, hidden, batch, tp, dsa).map(|r| (r, Vec::new())),
            _ => reference_layer_with(cfg, w, hidden, batch, tp, dsa).map(|r| (r, Vec::new())),
        }
    }

    /// Runs path `kind` for one layer.
    pub fn run(&self, kind: PathKind, input: &LayerInput<'_>, opts: &PathOptions) -> Result<PathRun> {
        match self {
            Backend::Cpu(o) => crate::compute::engine::run(o, kind, input, opts),
            Backend::Cuda(o) => cuda::ops::run(o, kind, input, opts),
        }
    }

    /// Runs `kinds` on one layer with one weight load, handing each run to `each` as it
    /// finishes ([`crate::compute::engine::run_paths`]).
    ///
    /// Errors: as [`Backend::run`], and whatever `each` returns.
    pub fn run_paths(
        &self,
        kinds: &[PathKind],
        input: &LayerInput<'_>,
        opts: &PathOptions,
        each: &mut dyn FnMut(PathRun) -> Result<()>,
    ) -> Result<()> {
        match self {
            Backend::Cpu(o) => crate::compute::engine::run_paths(o, kinds, input, opts, each),
            Backend::Cuda(o) => crate::compute::engine::run_paths(o, kinds, input, opts, &mut |mut r| {
                r.notes.extend(o.take_notes());
                each(r)
            }),
        }
    }
}

/// Runs path `kind` on the CPU backend (f32).
///
/// Errors: only input errors (shapes inconsistent with the configuration); numerical trouble is a
/// result for the comparison, never an error.
pub fn run_cpu(kind: PathKind, input: &LayerInput<'_>, opts: &PathOptions) -> Result<PathRun> {
    crate::compute::engine::run(&cpu::CpuOps::new(Dtype::F32), kind, input, opts)
}
