//! Engine-style MLA forward paths, the things mla-diff judges.
//!
//! Bugs live in the structure engines give MLA, not in the maths: a fused projection assembled
//! from shards, a paged latent cache written through a slot mapping and read through a block
//! table, split-KV partials merged by log-sum-exp, caller-allocated output buffers. Each path here
//! reproduces one of vLLM's MLA code paths with that structure, so that the bug classes of
//! docs/faults.md can occur (and be injected) exactly where they occur in real engines:
//!
//! - [`PathKind::Mha`]: expanded prefill (vLLM `forward_mha`);
//! - [`PathKind::Mqa`]: absorbed decode over a paged latent cache (vLLM `forward_mqa`);
//! - [`PathKind::Chunked`]: prefill whose cached context is processed in chunks, merged by LSE
//!   (vLLM `_compute_prefill_context`);
//! - [`PathKind::Mixed`]: one batch with decode tokens first and prefill tokens after, each part
//!   through its own path, written into one caller-allocated output (vLLM's MLA batch split).
//!
//! Every path can run under simulated tensor parallelism (`--tp N`): heads split across ranks,
//! shards cut from the raw quantized bytes, per-rank compute, reassembly and an all-reduce.
//! Paths compute in f32 (an engine's accumulation precision) on a backend; the CPU backend lives
//! in [`crate::backend::cpu`]. Output buffers are filled with the NaN
//! [`CANARY`](crate::core::canary::CANARY) before every step, so an output that was never written
//! is told apart from one computed wrong.

use ndarray::Array2;
use serde::{Deserialize, Serialize};

use crate::compute::faults::FaultSet;
use crate::core::batch::Batch;
use crate::core::trace::{Site, Trace};
use crate::model::config::MlaConfig;
use crate::model::gguf::{GgmlType, GgufFile};
use crate::model::weights::LayerWeights;

/// The start of a path's note when the path ran but had nothing of its own to act on (the
/// chunked path with no cached context): its verdict line then says `nothing judged` and why,
/// instead of only "within tolerance". The rest of the note is the reason.
pub const NOTHING_JUDGED: &str = "nothing judged: ";

/// Which engine path to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PathKind {
    /// Expanded MHA prefill (vLLM `forward_mha`).
    Mha,
    /// Absorbed MQA decode over a paged latent cache (vLLM `forward_mqa`).
    Mqa,
    /// Chunked-context prefill with LSE merging.
    Chunked,
    /// Mixed decode + prefill batch (decode tokens first).
    Mixed,
}

impl PathKind {
    /// Every path, in report order.
    pub const ALL: &'static [PathKind] = &[PathKind::Mha, PathKind::Mqa, PathKind::Chunked, PathKind::Mixed];

    /// Lower-case name (`mha`, `mqa`, `chunked`, `mixed`).
    pub fn name(self) -> &'static str {
        match self {
            PathKind::Mha => "mha",
            PathKind::Mqa => "mqa",
            PathKind::Chunked => "chunked",
            PathKind::Mixed => "mixed",
        }
    }
}

impl std::fmt::Display for PathKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Options shared by every path.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PathOptions {
    /// Tokens per page of the latent cache (`block_size` in vLLM), ≥ 1.
    pub page_size: usize,
    /// KV splits per decode query in `mqa` (vLLM's Triton MLA decode uses 4).
    pub num_splits: usize,
    /// Seed for the block-table shuffle.
    pub seed: u64,
    /// Simulated tensor-parallel ranks (must divide N).
    pub tp: usize,
    /// Context tokens per chunk in `chunked` (vLLM `max_context_chunk`).
    pub chunk_size: usize,
    /// New (uncached) tokens per sequence in `chunked`; the rest of each sequence is context.
    pub new_tokens: usize,
    /// Faults injected into the path.
    pub faults: FaultSet,
    /// fp8 GEMMs: every projection reads its input quantized this way (vLLM's block-FP8
    /// `Fp8LinearMethod`: per token in groups of 128; or one dynamic scale per tensor), through
    /// [`Ops::fp8_input`](crate::compute::ops::Ops::fp8_input). `None`: inputs as they are.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp8: Option<crate::core::fp8::ActQuant>,
    /// An fp8 latent cache: every row written to the paged cache is rounded as
    /// [`KvCacheQuant::round`](crate::core::fp8::KvCacheQuant::round) says, and the decode reads
    /// it back so. `None`: the cache holds the values as they are.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_cache: Option<crate::core::fp8::KvCacheQuant>,
}

impl Default for PathOptions {
    fn default() -> Self {
        PathOptions {
            page_size: 16,
            num_splits: 4,
            seed: 0,
            tp: 1,
            chunk_size: 8,
            new_tokens: 5,
            faults: FaultSet::default(),
            fp8: None,
            kv_cache: None,
        }
    }
}

/// A weight cut that an engine with quantized weights cannot serve: the TP shard boundary falls
/// inside a quant block. Reported as a `quant-block-misaligned` finding; the path does not run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Unservable {
    /// The weight site of the sliced weight.
    pub site: Site,
    /// GGUF tensor that was cut.
    pub tensor: String,
    /// Its ggml type.
    pub ggml_type: GgmlType,
    /// Elements per quant block along `ne[0]`.
    pub block_size: u64,
    /// The element offset of the offending cut along `ne[0]`.
    pub at: u64,
    /// What was being cut and why.
    pub reason: String,
}

/// Everything a path needs to run one layer.
#[derive(Debug, Clone, Copy)]
pub struct LayerInput<'a> {
    /// The GGUF file (paths assemble and, under TP, re-slice weights from it).
    pub file: &'a GgufFile,
    /// The model's MLA configuration.
    pub cfg: &'a MlaConfig,
    /// The layer's dequantized weights.
    pub weights: &'a LayerWeights,
    /// Layer input `hidden_in` [T, H], f32.
    pub hidden_in: &'a Array2<f32>,
    /// Which tokens belong to which sequence, and their positions.
    pub batch: &'a Batch,
    /// For a GLM shared-indexer layer on the token path: the selection of the nearest earlier
    /// full layer, which the layer reuses. `None` elsewhere (a shared layer then runs the
    /// borrowed indexer on its own input, as the reference does).
    pub shared_selection: Option<&'a crate::compute::indexer::Selection>,
    /// Teacher forcing for reduced-precision runs: the selection the attention uses instead of
    /// the path's own (which is still computed and recorded at `idx_*`). A near-tie flip of a
    /// bf16 indexer is judged once, at `idx_topk`, instead of cascading into every attention site.
    pub forced_selection: Option<&'a crate::compute::indexer::Selection>,
    /// Whole tensors the reference dequantized and handed on ([`LayerWeights::hand_over`]): a
    /// backend that computes on the host takes them instead of dequantizing the same bytes
    /// again. `None`: every tensor is dequantized from the raw bytes.
    pub dequantized: Option<&'a crate::model::weights::Dequantized>,
}

/// What one path produced for one layer.
#[derive(Debug, Clone)]
pub struct PathRun {
    /// The path.
    pub kind: PathKind,
    /// Every site the path recorded, f32 (empty when the configuration is unservable).
    pub trace: Trace,
    /// Token rows (packed index) whose attention merged at least one empty partial (an empty
    /// decode split or context chunk): where sentinel bugs show.
    pub empty_partial_rows: Vec<usize>,
    /// Set when the weights cannot be sharded as asked; nothing ran.
    pub unservable: Option<Unservable>,
    /// What injected faults did (or that they had nothing to act on).
    pub notes: Vec<String>,
    /// What the path's attention read through its paged latent cache (`None`: no cache, as
    /// `mha`, or a DSA layer), for the `paged-kv` replays.
    pub paged: Option<crate::compute::paged::PagedStep>,
}
