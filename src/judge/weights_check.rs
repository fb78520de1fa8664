//! The result types of `weights --check`: what the job fills in and `output` renders.
//!
//! A [`WeightsReport`] holds every tensor of an engine's weights file judged against the same
//! param rebuilt from the GGUF, and the findings that explain the failing ones. Keeping the
//! types here, below the renderers and the jobs, lets both use them without either depending on
//! the other, as [`super::report`] does for runs.

use serde::Serialize;

use crate::core::dtype::Dtype;
use crate::judge::diagnose::Finding;
use crate::judge::metrics::Metrics;

/// The check of one tensor of the weights file.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TensorCheck {
    /// Name in the weights file.
    pub name: String,
    /// Layer.
    pub layer: usize,
    /// vLLM parameter name.
    pub param: String,
    /// TP rank, for a shard.
    pub rank: Option<usize>,
    /// Shape in the file.
    pub shape: Vec<usize>,
    /// Shape expected from the GGUF.
    pub expected_shape: Vec<usize>,
    /// Pass / fail.
    pub pass: bool,
    /// Metrics against the expected tensor (absent when shapes differ).
    pub metrics: Option<Metrics>,
    /// Data type of the tensor in the weights file (safetensors dtype string, e.g. `BF16`).
    pub file_dtype: String,
    /// The GGUF tensors the expected values are rebuilt from, each with its ggml type name
    /// (`blk.1.attn_k_b.weight (Q8_0)`); empty when the model has no such param.
    pub source: Vec<String>,
}

/// Everything `weights --check` found.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WeightsReport {
    /// The GGUF.
    pub model: String,
    /// The weights file.
    pub weights: String,
    /// Its `engine` metadata.
    pub engine: String,
    /// TP size used to cut shards.
    pub tp: usize,
    /// The file's `dtype` metadata as written (`bf16`, `float16`, …), `None` when absent.
    pub metadata_dtype: Option<String>,
    /// Dtype whose weight tolerance applied (`bf16` also for f16 files).
    pub dtype: Dtype,
    /// One entry per tensor checked, by layer, param, rank.
    pub tensors: Vec<TensorCheck>,
    /// Findings, one per problem.
    pub findings: Vec<Finding>,
    /// File tensors that are not MLA params (ignored).
    pub ignored: Vec<String>,
}

impl WeightsReport {
    /// True when every tensor passed and nothing was found.
    pub fn all_pass(&self) -> bool {
        self.findings.is_empty() && self.tensors.iter().all(|t| t.pass)
    }
}
