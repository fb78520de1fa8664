//! The bottom layer: the types every other layer speaks.
//!
//! Sites and traces, the NaN canary, batches and the seeded generator, the compute dtype, the
//! bug classes, the error type, safetensors reading, atomic file writes, stage timing, the memory limit, the one float format of reports and findings, the sums a site
//! comparison is built from and the environment settings. Nothing here knows
//! about GGUF, kernels or verdicts, so any layer above may use it.

pub mod batch;
pub mod canary;
pub mod class;
pub mod dtype;
pub mod error;
pub mod fp8;
pub mod fsio;
pub mod memory;
pub mod sci;
pub mod settings;
pub mod st;
pub mod sums;
pub mod timing;
pub mod trace;
