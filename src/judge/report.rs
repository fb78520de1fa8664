//! The result types of a run or a dump comparison: what jobs fill in and outputs render.
//!
//! A [`RunReport`] holds everything a verdict rests on: the model, what was run, every site's
//! comparison per (layer, path), the findings, and for `compare` a summary of the engine dump.
//! Keeping the types here, below the renderers and the jobs, lets both use them without either
//! depending on the other.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::compute::faults::{Fault, FaultSet};
use crate::compute::path::{PathKind, PathOptions, Unservable};
use crate::core::batch::Batch;
use crate::core::dtype::Dtype;
use crate::core::trace::{Site, Stage};
use crate::judge::diagnose::Finding;
use crate::judge::label::PathLabel;
use crate::judge::metrics::{self, SiteDiff};
use crate::judge::tolerance::Precision;
use crate::judge::weights_check::{TensorCheck, WeightsReport};
use crate::model::config::MlaConfig;
use crate::model::dump::EngineDtype;
use crate::model::gguf::GgufFile;
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

impl ModelSummary {
    /// The summary of `file` (its path as given) run with `cfg`, whose first requested layer's
    /// MLA tensors have the ggml types `tensor_types`.
    pub fn new(file: &GgufFile, cfg: &MlaConfig, tensor_types: Vec<TensorType>) -> Self {
        ModelSummary {
            path: file.path().display().to_string(),
            config: cfg.clone(),
            tensor_types,
        }
    }
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
    /// Why the path did not run at this layer (`diffs` is then empty); `None` when it ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub not_run: Option<NotRun>,
}

/// Why a path did not run at a layer: a weight cut its loader could not serve.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NotRun {
    /// The weight site whose cut could not be served (e.g. `L0.w.o_proj.rank0`).
    pub site: Site,
    /// What would have been cut where, and why it was cut there.
    pub reason: String,
    /// True when an injected fault made the cut (`quant-slice-misaligned` at `w.kv_b`): the cut
    /// is then the fault found (a `quant-block-misaligned` finding), not a limit of the run.
    pub by_fault: bool,
}

impl NotRun {
    /// The record of an unservable cut under the injected `faults`.
    pub fn of(u: &Unservable, faults: &FaultSet) -> NotRun {
        NotRun {
            site: u.site,
            reason: format!(
                "{} ({}, blocks of {} along ne[0]) would be cut at element {} of ne[0], inside a block ({})",
                u.tensor, u.ggml_type, u.block_size, u.at, u.reason
            ),
            by_fault: faults.has(Fault::QuantSliceMisaligned) && u.site.stage == Stage::WKvB,
        }
    }
}

/// The verdict of a run, and its exit code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    /// Every site of every path that ran is within tolerance, nothing was found, and every
    /// injected fault acted (exit 0).
    Pass,
    /// A site failed or a finding was made (exit 1).
    Divergence,
    /// Nothing to judge: no requested path could run, or an injected fault never acted and
    /// nothing was found (exit 2; [`RunReport::inconclusive_reason`] says why).
    Inconclusive,
}

impl Verdict {
    /// `pass`, `divergence` or `inconclusive`.
    pub fn name(self) -> &'static str {
        match self {
            Verdict::Pass => "pass",
            Verdict::Divergence => "divergence",
            Verdict::Inconclusive => "inconclusive",
        }
    }

    /// The process exit code of this verdict: 0, 1 or 2.
    pub fn exit_code(self) -> u8 {
        match self {
            Verdict::Pass => 0,
            Verdict::Divergence => 1,
            Verdict::Inconclusive => 2,
        }
    }
}

/// What became of one injected fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum FaultOutcome {
    /// A finding names the fault's class: it acted and was diagnosed.
    Found,
    /// The paths it acts on diverged at or before its site, for another reason (another
    /// fault): it is downstream of that divergence and not diagnosed separately.
    Masked,
    /// It never acted: the paths it acts on did not run, or their batch gave it nothing to act on.
    NotExercised,
    /// It acted on paths that ran, but no finding names its class and nothing upstream explains
    /// that.
    Missed,
}

impl FaultOutcome {
    /// `found`, `masked`, `not-exercised` or `missed`.
    pub fn name(self) -> &'static str {
        match self {
            FaultOutcome::Found => "found",
            FaultOutcome::Masked => "masked",
            FaultOutcome::NotExercised => "not-exercised",
            FaultOutcome::Missed => "missed",
        }
    }
}

/// One injected fault, what became of it, and a sentence saying where and why.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FaultStatus {
    /// The fault.
    pub fault: Fault,
    /// What became of it.
    pub outcome: FaultOutcome,
    /// Where it was found, what masked it (site, class, path), or why it never acted.
    pub detail: String,
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
    /// The loaded weights a format-2 dump carries (`weights.*`), judged as `weights --check`
    /// judges them; their findings lead [`RunReport::findings`]. `None` for `run` and for a
    /// dump without weights. Reported (text and JSON) only when some tensor fails, so a dump
    /// whose weights all match reads as one without them.
    #[serde(skip)]
    pub loaded_weights: Option<WeightsReport>,
}

impl RunReport {
    /// The dump's first failing loaded weight (`weights.*` of a format-2 dump), in data-flow
    /// order ([`WeightsReport::failing`]); `None` when every loaded weight matches or the dump
    /// carries none. It comes before any site: an engine loads its weights before it computes.
    pub fn first_loaded_divergence(&self) -> Option<&TensorCheck> {
        self.loaded_weights.as_ref()?.failing().into_iter().next()
    }

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

    /// True when the verdict is [`Verdict::Pass`]: every site of every path that ran passed,
    /// nothing was found, something ran and every injected fault acted.
    pub fn all_pass(&self) -> bool {
        self.verdict() == Verdict::Pass
    }

    /// The (layer, path) results that did not run (no site recorded), in report order.
    pub fn not_run(&self) -> Vec<&PathResult> {
        self.results.iter().filter(|r| r.diffs.is_empty()).collect()
    }

    /// The verdict: a divergence when a site failed or something was found; else inconclusive
    /// when no requested path ran or an injected fault never acted; else a pass.
    pub fn verdict(&self) -> Verdict {
        let failed = self.results.iter().any(|r| r.diffs.iter().any(|d| d.is_failure()))
            || self.first_loaded_divergence().is_some();
        if failed || !self.findings.is_empty() {
            Verdict::Divergence
        } else if self.inconclusive_reason().is_some() {
            Verdict::Inconclusive
        } else {
            Verdict::Pass
        }
    }

    /// Why a run without divergence says nothing: no requested path could run (each reason
    /// once, with the layers and paths it stopped), or an injected fault never acted. `None`
    /// when something ran and every injected fault acted.
    pub fn inconclusive_reason(&self) -> Option<String> {
        if !self.results.is_empty() && self.results.iter().all(|r| r.diffs.is_empty()) {
            return Some(format!("no requested path could run: {}", self.not_run_summary()));
        }
        let idle: Vec<String> = self
            .fault_status()
            .into_iter()
            .filter(|f| f.outcome == FaultOutcome::NotExercised)
            .map(|f| format!("--inject {} did not act on this batch: {}", f.fault, f.detail))
            .collect();
        (!idle.is_empty()).then(|| format!("{}; the clean result says nothing", idle.join("; ")))
    }

    /// The (layer, path) results that did not run, grouped by reason with the reason's layer
    /// number written `N`: `L0–L11 mha, mqa: blk.N.attn_output.weight … (…)`. Empty when
    /// every path ran.
    pub fn not_run_summary(&self) -> String {
        summarize_not_run(&self.not_run(), true)
    }

    /// What became of each injected fault, in injection order (empty without faults).
    ///
    /// Found: a finding names its class. Not exercised: no (layer, path) it acts on ran, or
    /// each that ran says it had nothing to act on. Masked: a path it acts on diverged at or
    /// before its first site (in the same or an earlier layer) for another reason. Missed:
    /// anything else.
    pub fn fault_status(&self) -> Vec<FaultStatus> {
        let faults = &self.run.path_options.faults.0;
        let cfg = &self.model.config;
        let tp = self.run.path_options.tp;
        faults
            .iter()
            .map(|&f| {
                let found: Vec<&Finding> = self.findings.iter().filter(|x| x.class == f.expected_class()).collect();
                if let Some(x) = found.first() {
                    let paths: Vec<String> = found
                        .iter()
                        .filter(|y| y.site() == x.site())
                        .map(|y| y.path().map_or("file".into(), |p| p.to_string()))
                        .collect();
                    return FaultStatus {
                        fault: f,
                        outcome: FaultOutcome::Found,
                        detail: format!("{} at {} on {}", x.class, x.subject, paths.join(", ")),
                    };
                }
                // The (layer, path) results the fault acts on (the latent block size matters
                // only to quant-slice-misaligned, which is found whenever it acts).
                let acts_on =
                    |r: &&PathResult| r.path.path().is_none_or(|p| f.applies(p, cfg, tp, 1).is_ok());
                let mine: Vec<&PathResult> = self.results.iter().filter(acts_on).collect();
                let ran: Vec<&PathResult> = mine.iter().copied().filter(|r| !r.diffs.is_empty()).collect();
                if ran.is_empty() {
                    let why = if mine.is_empty() {
                        "no requested path is one it acts on".to_string()
                    } else {
                        format!("the paths it acts on did not run ({})", self.not_run_summary())
                    };
                    return FaultStatus {
                        fault: f,
                        outcome: FaultOutcome::NotExercised,
                        detail: why,
                    };
                }
                let idle: Vec<(String, &String)> = ran
                    .iter()
                    .filter_map(|r| {
                        r.notes
                            .iter()
                            .find(|n| n.contains("nothing to act on"))
                            .map(|n| (r.path.to_string(), n))
                    })
                    .collect();
                if idle.len() == ran.len() {
                    // One sentence per distinct note, with every path (and layer) that gave it.
                    let mut by_note: Vec<(Vec<String>, &String)> = Vec::new();
                    for (p, n) in idle {
                        match by_note.iter_mut().find(|(_, m)| *m == n) {
                            Some((ps, _)) if !ps.contains(&p) => ps.push(p),
                            Some(_) => {}
                            None => by_note.push((vec![p], n)),
                        }
                    }
                    let detail: Vec<String> = by_note
                        .iter()
                        .map(|(ps, n)| format!("{}: {n}", ps.join(", ")))
                        .collect();
                    return FaultStatus {
                        fault: f,
                        outcome: FaultOutcome::NotExercised,
                        detail: detail.join("; "),
                    };
                }
                // A path it acts on whose finding lies at or before the fault's own first site.
                let masked = ran.iter().find_map(|r| {
                    let p = r.path.path()?;
                    let own = Site::new(r.layer, *f.expected_stages(p).first()?);
                    self.findings
                        .iter()
                        .find(|x| x.path() == Some(r.path) && x.site().is_some_and(|s| s.order() <= own.order()))
                        .map(|x| (x, own))
                });
                match masked {
                    Some((x, own)) => {
                        let by: Vec<&str> = faults
                            .iter()
                            .filter(|g| **g != f && g.expected_class() == x.class)
                            .map(|g| g.name())
                            .collect();
                        let paths: Vec<String> = self
                            .findings
                            .iter()
                            .filter(|y| y.site() == x.site() && y.class == x.class)
                            .filter_map(|y| y.path())
                            .filter(|p| mine.iter().any(|r| r.path == *p))
                            .map(|p| p.to_string())
                            .collect();
                        FaultStatus {
                            fault: f,
                            outcome: FaultOutcome::Masked,
                            detail: format!(
                                "downstream of the first divergence at {} ({}{}) on {}, at or before its own site {}; not diagnosed separately",
                                x.subject,
                                x.class,
                                if by.is_empty() {
                                    String::new()
                                } else {
                                    format!(", from {}", by.join(", "))
                                },
                                paths.join(", "),
                                own
                            ),
                        }
                    }
                    None => FaultStatus {
                        fault: f,
                        outcome: FaultOutcome::Missed,
                        detail: format!(
                            "acted on {} but no finding names {}",
                            ran.iter()
                                .map(|r| format!("L{} {}", r.layer, r.path))
                                .collect::<Vec<_>>()
                                .join(", "),
                            f.expected_class()
                        ),
                    },
                }
            })
            .collect()
    }
}

/// The given not-run results grouped by reason, each reason's layer number written `N` when it
/// spans several layers: `L0–L11 mha, mqa: blk.N.attn_output.weight … (…)` (without the path
/// names unless `with_paths`), groups joined by `; `.
pub fn summarize_not_run(results: &[&PathResult], with_paths: bool) -> String {
    let mut groups: Vec<(String, Vec<usize>, Vec<String>)> = Vec::new();
    for r in results {
        let why = r.not_run.as_ref().map_or_else(
            || "no site recorded".to_string(),
            |n| n.reason.replace(&format!("blk.{}.", r.layer), "blk.N."),
        );
        let p = r.path.to_string();
        match groups.iter_mut().find(|(w, _, _)| *w == why) {
            Some((_, layers, paths)) => {
                if !layers.contains(&r.layer) {
                    layers.push(r.layer);
                }
                if !paths.contains(&p) {
                    paths.push(p);
                }
            }
            None => groups.push((why, vec![r.layer], vec![p])),
        }
    }
    groups
        .into_iter()
        .map(|(why, layers, paths)| {
            let why = if layers.len() == 1 {
                why.replace("blk.N.", &format!("blk.{}.", layers[0]))
            } else {
                why
            };
            if with_paths {
                format!("{} {}: {why}", layer_list(&layers), paths.join(", "))
            } else {
                format!("{}: {why}", layer_list(&layers))
            }
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// Layers as `L3`, `L0–L11` (consecutive) or `L1, L4`.
fn layer_list(layers: &[usize]) -> String {
    let consecutive = layers.windows(2).all(|w| w[1] == w[0] + 1);
    match layers {
        [] => String::new(),
        [l] => format!("L{l}"),
        [a, .., b] if consecutive => format!("L{a}–L{b}"),
        _ => layers.iter().map(|l| format!("L{l}")).collect::<Vec<_>>().join(", "),
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
    /// The patches the engine ran with (format 2's header `patches`, `NAME: REASON` each):
    /// provenance of the dump, changes to the engine the harness made so that it runs, not
    /// conversions of what it dumped.
    pub patches: Vec<String>,
    /// Dump tensors that were not compared (not sites, not renamed).
    pub ignored: Vec<String>,
    /// Reference sites of the dumped layers that the dump lacks.
    pub not_dumped: Vec<String>,
    /// The dtype the engine computed in (metadata `dtype`, or `--dtype`).
    pub dtype: EngineDtype,
    /// The tolerance rows applied: `f32`, `engine-bf16` or `engine-f16` (the engine dtype's),
    /// or `bf16` / `f32` chosen by a kernel precision (format 2's `kernel_precision`,
    /// `compare --precision`); `fp8` / `bf16-fp8` for a dump declaring `act_quant` or
    /// `kv_cache_quant`.
    pub tolerance_rows: Precision,
}
