//! The command line's own value types, mapped onto the library's.
//!
//! Library types carry no clap derives: the names a user types and the help beside each value are
//! the command line's business, and a library caller should not see `--flag` concerns in the
//! types it builds. Each enum here mirrors one library enum (the values a user may choose) and
//! converts into it; faults are parsed from the library's own list, so a new fault needs no
//! change here.

use clap::ValueEnum;
use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};

use crate::backend::cuda::ops::Kernels;
use crate::compute::faults::Fault;
use crate::core::dtype::Dtype;
use crate::judge::report::InputMode;
use crate::model::dump::EngineDtype;

/// `--dtype` of the paths ([`Dtype`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DtypeArg {
    /// f32 activations, f32 accumulation.
    F32,
    /// bf16 activations and weights, f32 accumulation.
    Bf16,
}

impl From<DtypeArg> for Dtype {
    fn from(d: DtypeArg) -> Dtype {
        match d {
            DtypeArg::F32 => Dtype::F32,
            DtypeArg::Bf16 => Dtype::Bf16,
        }
    }
}

/// `run --fp8-compute`: how the paths' fp8 GEMMs quantize their inputs
/// ([`crate::core::fp8::ActQuant`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Fp8ComputeArg {
    /// Per token in groups of 128 columns (vLLM's block-FP8 `Fp8LinearMethod`).
    TokenGroup,
    /// One dynamic scale per tensor (vLLM's `scaled_fp8_quant` without a scale, SGLang's
    /// per-tensor fp8).
    Tensor,
}

impl Fp8ComputeArg {
    /// The dtype an fp8 quantizer of paths computing in `d` reads.
    pub fn input(d: Dtype) -> crate::core::fp8::InputDtype {
        match d {
            Dtype::F32 => crate::core::fp8::InputDtype::F32,
            Dtype::Bf16 => crate::core::fp8::InputDtype::Bf16,
        }
    }

    /// The quantization, reading values of the paths' compute dtype `d` (bf16 paths quantize
    /// bf16 activations).
    pub fn act(self, d: Dtype) -> crate::core::fp8::ActQuant {
        use crate::core::fp8::ActQuant;
        let input = Self::input(d);
        match self {
            Fp8ComputeArg::TokenGroup => ActQuant::token_group(128, Some(input)),
            Fp8ComputeArg::Tensor => ActQuant::tensor(Some(input)),
        }
    }
}

/// `run --kv-cache-dtype`: what the paged latent cache stores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum KvCacheDtypeArg {
    /// The paths' compute dtype (vLLM's `auto`).
    Auto,
    /// fp8 E4M3 with one per-tensor scale (`--kv-scale`), as vLLM's `kv_cache_dtype="fp8"`.
    Fp8,
}

/// `compare --precision`: what a kernel judged alone read (its outputs are judged by the rows
/// `run --dtype` applies for that [`Dtype`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PrecisionArg {
    /// f32 inputs, f32 accumulation: `run`'s f32 rows.
    F32,
    /// bf16 inputs, f32 accumulation: the rows of `run --dtype bf16`.
    Bf16,
}

impl From<PrecisionArg> for Dtype {
    fn from(d: PrecisionArg) -> Dtype {
        match d {
            PrecisionArg::F32 => Dtype::F32,
            PrecisionArg::Bf16 => Dtype::Bf16,
        }
    }
}

/// `--reference-backend`: where the f64 reference runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ReferenceArg {
    /// On the GPU when the backend is CUDA, else on the CPU.
    Auto,
    /// On the CPU (the oracle of CI and of the golden traces).
    Cpu,
    /// On the GPU (cuBLAS DGEMM and f64 kernels of its own); needs `--backend cuda` or auto with
    /// a device. Layers it does not compute (DSA indexer, MoE FFN) run on the CPU.
    #[value(alias = "gpu")]
    Cuda,
}

/// `--kernels` of the CUDA backend ([`Kernels`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum KernelsArg {
    /// Tensor-core kernels (mma.sync) for bf16 prefill and decode; the simple ones elsewhere.
    Fast,
    /// The plain f32-FMA kernels everywhere (the cross-check).
    Simple,
}

impl From<KernelsArg> for Kernels {
    fn from(k: KernelsArg) -> Kernels {
        match k {
            KernelsArg::Fast => Kernels::Fast,
            KernelsArg::Simple => Kernels::Simple,
        }
    }
}

/// `--input` of `run` ([`InputMode`]; a dump's inputs are `compare`'s, not a choice here).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum InputArg {
    /// Seeded standard-normal hidden states, independently per layer.
    Random,
    /// Seeded token ids → `token_embd` → reference forward of the preceding layers.
    Tokens,
}

impl From<InputArg> for InputMode {
    fn from(i: InputArg) -> InputMode {
        match i {
            InputArg::Random => InputMode::Random,
            InputArg::Tokens => InputMode::Tokens,
        }
    }
}

/// `compare --dtype` ([`EngineDtype`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EngineDtypeArg {
    /// f32 (or f64): judged by the f32 rows.
    F32,
    /// bf16 throughout: judged by the `engine-bf16` rows.
    Bf16,
    /// f16 throughout: judged by the `engine-f16` rows.
    F16,
}

impl From<EngineDtypeArg> for EngineDtype {
    fn from(d: EngineDtypeArg) -> EngineDtype {
        match d {
            EngineDtypeArg::F32 => EngineDtype::F32,
            EngineDtypeArg::Bf16 => EngineDtype::Bf16,
            EngineDtypeArg::F16 => EngineDtype::F16,
        }
    }
}

/// The parser of `--inject`: every [`Fault::ALL`] by its name, with its one-line summary as help.
pub fn fault_parser() -> impl TypedValueParser<Value = Fault> {
    let values = Fault::ALL
        .iter()
        .map(|f| PossibleValue::new(f.name()).help(f.summary()));
    PossibleValuesParser::new(values).map(|s| {
        // PossibleValuesParser has already refused anything not in the list.
        Fault::ALL
            .iter()
            .copied()
            .find(|f| f.name() == s)
            .unwrap_or(Fault::ALL[0])
    })
}
