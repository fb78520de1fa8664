//! The result types of a run or a dump comparison: what jobs fill in and outputs render.
//!
//! A [`RunReport`] holds everything a verdict rests on: the model, what was run, every site's
//! comparison per (layer, path), the findings, and for `compare` a summary of the engine dump.
//! Keeping the types here, below the renderers and the jobs, lets both use them without either
//! depending on the other.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::compute::path::{PathKind, PathOptions};
use crate::core::batch::Batch;
use crate::core::dtype::Dtype;
use crate::judge::diagnose::Finding;
use crate::judge::label::PathLabel;
use crate::judge::metrics::{self, SiteDiff};
use crate::judge::tolerance::Precision;
use crate::model::config::MlaConfig;
use crate::model::dump::EngineDtype;
use crate::model::weights::TensorType;

/// Where the layer input comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum InputMode {
    /// Seeded standard-normal hidden states, independently per layer.
    Random,
    /// Seeded token ids → `token_embd` → reference forward of the preceding layers.
    Tokens,
}

/// Where a reported run's layer inputs came from: an [`InputMode`] of `run`, or an engine dump's
/// own inputs (`mla-diff compare`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum InputSource {
    /// [`InputMode::Random`].
    Random,
    /// [`InputMode::Tokens`].
    Tokens,
    /// An engine dump's own layer inputs.
    Dump,
}

impl InputSource {
    /// Lower-case name (`random`, `tokens`, `dump`).
    pub fn name(self) -> &'static str {
        match self {
            InputSource::Random => "random",
            InputSource::Tokens => "tokens",
            InputSource::Dump => "dump",
        }
    }

    /// The input mode that reproduces it (`None` for a dump: only `compare` reads dumps).
    pub fn mode(self) -> Option<InputMode> {
        match self {
            InputSource::Random => Some(InputMode::Random),
            InputSource::Tokens => Some(InputMode::Tokens),
            InputSource::Dump => None,
        }
    }
}

impl From<InputMode> for InputSource {
    fn from(m: InputMode) -> InputSource {
        match m {
            InputMode::Random => InputSource::Random,
            InputMode::Tokens => InputSource::Tokens,
        }
    }
}

/// What to run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunConfig {
    /// Layers to compare, ascending.
    pub layers: Vec<usize>,
    /// The batch: sequence lengths and start positions.
    pub batch: Batch,
    /// Seed of the inputs and of the block-table shuffle.
    pub seed: u64,
    /// Input mode.
    pub input: InputMode,
    /// Paths to run.
    pub paths: Vec<PathKind>,
    /// Path options (page size, splits, TP, chunking, faults).
    pub path_options: PathOptions,
    /// The backend, as reported (`cpu`, or the GPU and its versions). A label only: the compute
    /// dtype, and so the tolerance rows, come from the [`crate::backend::Backend`] the run is
    /// given, never from here.
    pub backend: String,
}

impl Default for RunConfig {
    fn default() -> Self {
        RunConfig {
            layers: vec![0],
            batch: Batch::single(19, 0),
            seed: 0,
            input: InputMode::Random,
            paths: PathKind::ALL.to_vec(),
            path_options: PathOptions::default(),
            backend: "cpu".into(),
        }
    }
}

/// What was run, as reports and golden manifests record it: the [`RunConfig`] and the compute
/// dtype of the backend that ran it (in that field order, which the JSON documents keep).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunRecord {
    /// Layers compared, ascending.
    pub layers: Vec<usize>,
    /// The batch: sequence lengths and start positions.
    pub batch: Batch,
    /// Seed of the inputs and of the block-table shuffle.
    pub seed: u64,
    /// Where the inputs came from.
    pub input: InputSource,
    /// Paths run (or the dump).
    pub paths: Vec<PathLabel>,
    /// Path options (page size, splits, TP, chunking, faults).
    pub path_options: PathOptions,
    /// Compute dtype of the paths: the backend's ([`crate::backend::Backend::dtype`]); for a dump,
    /// the closest dtype of mla-diff's own paths to the engine's.
    pub dtype: Dtype,
    /// The backend, as reported.
    pub backend: String,
}

impl RunRecord {
    /// The record of `rc` run in `dtype`.
    pub fn new(rc: &RunConfig, dtype: Dtype) -> Self {
        let rc = rc.clone();
        RunRecord {
            layers: rc.layers,
            batch: rc.batch,
            seed: rc.seed,
            input: rc.input.into(),
            paths: rc.paths.into_iter().map(PathLabel::Path).collect(),
            path_options: rc.path_options,
            dtype,
            backend: rc.backend,
        }
    }

    /// What to run to reproduce this record (the dtype goes to the backend); `None` for the
    /// record of a dump comparison, which no `run` reproduces.
    pub fn config(&self) -> Option<RunConfig> {
        Some(RunConfig {
            layers: self.layers.clone(),
            batch: self.batch.clone(),
            seed: self.seed,
            input: self.input.mode()?,
            paths: self.paths.iter().map(|p| p.path()).collect::<Option<Vec<_>>>()?,
            path_options: self.path_options.clone(),
            backend: self.backend.clone(),
        })
    }
}

/// A short description of the model for reports.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelSummary {
    /// File path as given (or the embedded fixture's name).
    pub path: String,
    /// The MLA configuration.
    pub config: MlaConfig,
    /// ggml types of the MLA tensors of the first requested layer.
    pub tensor_types: Vec<TensorType>,
}

/// The comparison of one path at one layer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PathResult {
    /// The path.
    pub path: PathLabel,
    /// Layer index.
    pub layer: usize,
    /// Per-site comparisons in data-flow order.
    pub diffs: Vec<SiteDiff>,
    /// What injected faults did.
    pub notes: Vec<String>,
    /// The engine step judged (format-2 dumps: `prefill`, `decode-1`, …); `None` otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub step: Option<String>,
}

/// Everything `run` produced.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunReport {
    /// The model.
    pub model: ModelSummary,
    /// What was run.
    pub run: RunRecord,
    /// Token ids used (token input mode only).
    pub token_ids: Option<Vec<u32>>,
    /// One entry per (layer, path), layers ascending, paths in run order.
    pub results: Vec<PathResult>,
    /// One finding per path at its first divergence (the earliest layer that diverges).
    pub findings: Vec<Finding>,
    /// The engine dump compared (`mla-diff compare`); `None` for `run`.
    pub dump: Option<DumpSummary>,
}

impl RunReport {
    /// The first failing site of each path, over all layers in order (docs/design.md, "Metrics": per path).
    pub fn first_divergence(&self) -> BTreeMap<PathLabel, Option<&SiteDiff>> {
        let mut m = BTreeMap::new();
        for &p in &self.run.paths {
            let first = self
                .results
                .iter()
                .filter(|r| r.path == p)
                .find_map(|r| metrics::first_divergence(&r.diffs));
            m.insert(p, first);
        }
        m
    }

    /// True when every site of every path passed and nothing was found.
    pub fn all_pass(&self) -> bool {
        self.findings.is_empty() && self.results.iter().all(|r| r.diffs.iter().all(|d| !d.is_failure()))
    }
}

/// A summary of the dump for reports and JSON.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DumpSummary {
    /// The dump file, as given.
    pub path: String,
    /// `engine` metadata, or `unknown`.
    pub engine: String,
    /// The map applied, if any.
    pub map: Option<String>,
    /// All metadata.
    pub metadata: BTreeMap<String, String>,
    /// Conversions applied.
    pub conversions: Vec<String>,
    /// Dump tensors that were not compared (not sites, not renamed).
    pub ignored: Vec<String>,
    /// Reference sites of the dumped layers that the dump lacks.
    pub not_dumped: Vec<String>,
    /// The dtype the engine computed in (metadata `dtype`, or `--dtype`).
    pub dtype: EngineDtype,
    /// The tolerance rows applied: `f32`, `engine-bf16` or `engine-f16` (the engine dtype's),
    /// or `bf16` / `f32` chosen by a kernel precision (format 2's `kernel_precision`,
    /// `compare --precision`).
    pub tolerance_rows: Precision,
}
