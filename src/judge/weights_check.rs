//! The result types of `weights --check`: what the job fills in and `output` renders.
//!
//! A [`WeightsReport`] holds every tensor of an engine's weights file judged against the same
//! param rebuilt from the GGUF, and the findings that explain the failing ones. Keeping the
//! types here, below the renderers and the jobs, lets both use them without either depending on
//! the other, as [`super::report`] does for runs.

use serde::Serialize;

use crate::core::dtype::Dtype;
use crate::core::trace::Stage;
use crate::judge::diagnose::Finding;
use crate::judge::metrics::{self, Metrics};
use crate::judge::tolerance::tolerance;

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

impl TensorCheck {
    /// The metrics out of the weight row of `dtype` (`rel_l2`, `cos_diff`, `norm_ratio`,
    /// `pass_fraction`, `nonfinite`, as a site's `failed`), or `shape` when the shapes differ;
    /// empty for a tensor that passes.
    pub fn failed(&self, dtype: Dtype) -> Vec<&'static str> {
        match &self.metrics {
            Some(m) => metrics::judge(m, &tolerance(Stage::WKvB, dtype).0),
            None => vec!["shape"],
        }
    }
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
    /// A format-2 dump's `heads = [a, b]`: the file is one TP rank's, heads `a..b`; absent
    /// otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub heads: Option<[usize; 2]>,
    /// The file's `dtype` metadata as written (`bf16`, `float16`, …), `None` when absent.
    pub metadata_dtype: Option<String>,
    /// Dtype whose weight tolerance applied (`bf16` also for f16 files).
    pub dtype: Dtype,
    /// One entry per tensor checked, by layer, param, rank.
    pub tensors: Vec<TensorCheck>,
    /// Findings, one per problem.
    pub findings: Vec<Finding>,
    /// File tensors that are not params `weights --check` rebuilds (ignored): routed experts,
    /// other modules' parameters, unknown names.
    pub ignored: Vec<String>,
}

impl WeightsReport {
    /// True when every tensor passed and nothing was found.
    pub fn all_pass(&self) -> bool {
        self.findings.is_empty() && self.tensors.iter().all(|t| t.pass)
    }

    /// The failing tensors in data-flow order: layer, then the param's place in
    /// [`crate::model::tensors::dump_param_names`] (attention before the FFN, `gate_up_proj`
    /// before `down_proj`), then rank. The first one is a dump's first divergence: an engine
    /// loads its weights before it computes anything.
    pub fn failing(&self) -> Vec<&TensorCheck> {
        let names = crate::model::tensors::dump_param_names();
        let order = |t: &TensorCheck| {
            let at = names.iter().position(|n| *n == t.param).unwrap_or(names.len());
            (t.layer, at, t.rank)
        };
        let mut v: Vec<&TensorCheck> = self.tensors.iter().filter(|t| !t.pass).collect();
        v.sort_by_key(|t| order(t));
        v
    }
}

/// True for a weights-file tensor of the routed experts (`L{n}.experts.w13_weight`,
/// `L{n}.experts.w2_weight.rank1`, …): vLLM parameters `weights --check` does not rebuild
/// (dequantizing every expert of a layer costs E dense FFNs); the report lists them apart, with
/// that reason.
pub fn is_routed_expert(name: &str) -> bool {
    name.strip_prefix('L')
        .and_then(|r| r.split_once('.'))
        .is_some_and(|(layer, param)| layer.parse::<usize>().is_ok() && param.starts_with("experts."))
}
