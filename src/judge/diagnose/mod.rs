//! Diagnosis: naming the bug class of each path's first divergence, and of each failing tensor
//! of an engine's loaded weights, with numeric evidence.
//!
//! "Tensor X differs" sends an engineer back to printing norms by hand; "`w.fused_qkv_a` holds
//! the reference shards in order \[1,0]" points at the line to fix. For each path's first
//! divergence, the detectors each test one hypothesis against the reference trace (re-rotate
//! with the other RoPE style, re-split kv_b grouped, fit a softmax scale, match blocks to shards,
//! …). The first detector in the precedence order of docs/design.md ("Diagnosis") whose
//! hypothesis explains the candidate names the [`Class`]; evidence always compares the explained
//! error with the error as is. A clean run produces no finding: every detector only runs on a
//! site that already failed. `weights --check` asks the same questions of an engine's weights as
//! loaded ([`loaded`]) and answers with the same [`Finding`], about a loaded tensor instead of a
//! site.
//!
//! This file holds what every detector shares: the context of one failing site (`SiteCtx`),
//! the [`Finding`] and [`Detection`] types, the two precedence tables and [`diagnose`]. The
//! detectors live one family per file: `canary` (unwritten memory), `weights` (weight sites and
//! the GGUF itself), `collective` (the TP all-reduce), `rope`, `attention` (softmax scale, LSE
//! merge) with `split` (the split-KV decode replay), `merge` (the partials and merges of a
//! chunked prefill over cached context), `norm` (a skipped RMSNorm), `strided`
//! (views of fused tensors), `paged` (the paged KV cache's metadata), `moe`, `indexer` (DSA),
//! `residual` (the residual stream scaled), `scales` (a block-scaled GEMM's scales in another
//! layout, fitted from its activations), `precision` (a product computed narrower than
//! declared), `fallback` (scale, path disagreement, mismatch, and what a hint may say of a
//! site's inputs) and [`loaded`] (`weights --check`); [`blocks`] is the block-permutation
//! finder several of them use.

mod attention;
pub mod blocks;
mod canary;
mod collective;
mod fallback;
mod fp8;
mod indexer;
pub mod loaded;
mod merge;
mod moe;
mod norm;
mod paged;
mod precision;
mod residual;
mod rope;
mod scales;
mod split;
mod strided;
mod weights;

use serde::ser::{Serialize, SerializeStruct, Serializer};

use crate::compute::paged::PagedStep;
use crate::compute::path::Unservable;
use crate::compute::reference::context::ContextSeq;
use crate::core::batch::Batch;
use crate::core::class::Class;
use crate::core::sci::sci;
use crate::core::trace::{Site, Stage, Trace, TraceTensor};
use crate::judge::label::PathLabel;
use crate::judge::metrics::{self, SiteDiff, Status};
use crate::judge::tolerance::{Precision, tolerance};
use crate::model::config::MlaConfig;
use blocks::rel_l2;
pub use weights::{gguf_sources, misaligned_finding, weight_nonfinite_findings};

/// One diagnosis: what kind of wrong, about what, the numbers that show it, and where to look.
///
/// Serialized (the `findings` of every JSON report) as `{class, site, path, evidence, hint}` for
/// a site and `{class, tensor, evidence, hint, source}` for a loaded tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct Finding {
    /// The bug class.
    pub class: Class,
    /// What it was found at: a site (a path's first divergence) or a loaded tensor.
    pub subject: Subject,
    /// Numeric evidence, e.g. "cos 0.999999 vs permuted block; 0.012 as is".
    pub evidence: String,
    /// Where to look.
    pub hint: String,
}

/// What a [`Finding`] is about.
#[derive(Debug, Clone, PartialEq)]
pub enum Subject {
    /// A site of a layer's forward pass: the first divergence of a path or dump.
    Site {
        /// The site, e.g. `L1.w.fused_qkv_a`.
        site: Site,
        /// The path or dump; `None` for findings about the GGUF itself (`weight-nonfinite`).
        path: Option<PathLabel>,
    },
    /// A tensor of an engine's weights file, as `weights --check` reads it.
    Loaded(LoadedTensor),
}

/// A tensor of an engine's weights file (vLLM parameter names, PyTorch `[out, in]` layout),
/// the subject of a `weights --check` finding.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadedTensor {
    /// Its name in the file, e.g. `L0.kv_b_proj.rank1`; `L0.kv_b_proj.rank*` for a finding about
    /// how the ranks' shards fit together.
    pub tensor: String,
    /// The TP rank it is the shard of.
    pub rank: TpRank,
    /// The GGUF tensors the correct values come from, each with its ggml type name, e.g.
    /// `blk.1.attn_k_b.weight (Q8_0)` for `W_UK_T` (empty when the model has no such param).
    pub source: Vec<String>,
}

/// Which tensor-parallel shard a [`LoadedTensor`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TpRank {
    /// The whole tensor (unsharded, or a replicated param).
    Whole,
    /// Rank `r`'s shard (`….rank<r>` in the file).
    Rank(usize),
    /// Every rank's shard at once (`….rank*`).
    All,
}

impl Finding {
    /// A finding at `site` of `path` (`None`: about the GGUF itself).
    pub fn at_site(class: Class, site: Site, path: Option<PathLabel>, d: Detection) -> Self {
        Finding {
            class,
            subject: Subject::Site { site, path },
            evidence: d.evidence,
            hint: d.hint,
        }
    }

    /// A finding about the loaded tensor `tensor`.
    pub fn at_loaded(class: Class, tensor: LoadedTensor, d: Detection) -> Self {
        Finding {
            class,
            subject: Subject::Loaded(tensor),
            evidence: d.evidence,
            hint: d.hint,
        }
    }

    /// The site it was found at; `None` for a loaded tensor.
    pub fn site(&self) -> Option<Site> {
        match &self.subject {
            Subject::Site { site, .. } => Some(*site),
            Subject::Loaded(_) => None,
        }
    }

    /// The path or dump it was found on; `None` for the GGUF itself and for a loaded tensor.
    pub fn path(&self) -> Option<PathLabel> {
        match &self.subject {
            Subject::Site { path, .. } => *path,
            Subject::Loaded(_) => None,
        }
    }
}

/// A site as `L1.q_c`, a loaded tensor by its name in the weights file.
impl std::fmt::Display for Subject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Subject::Site { site, .. } => site.fmt(f),
            Subject::Loaded(t) => f.write_str(&t.tensor),
        }
    }
}

impl Serialize for Finding {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let mut st = s.serialize_struct("Finding", 5)?;
        st.serialize_field("class", &self.class)?;
        match &self.subject {
            Subject::Site { site, path } => {
                st.serialize_field("site", site)?;
                st.serialize_field("path", path)?;
                st.serialize_field("evidence", &self.evidence)?;
                st.serialize_field("hint", &self.hint)?;
            }
            Subject::Loaded(t) => {
                st.serialize_field("tensor", &t.tensor)?;
                st.serialize_field("evidence", &self.evidence)?;
                st.serialize_field("hint", &self.hint)?;
                st.serialize_field("source", &t.source)?;
            }
        }
        st.end()
    }
}

/// One path's results, as the detectors need them.
#[derive(Debug, Clone, Copy)]
pub struct PathEvidence<'a> {
    /// The path, or the dump.
    pub kind: PathLabel,
    /// Its trace.
    pub trace: &'a Trace,
    /// Its per-site comparison.
    pub diffs: &'a [SiteDiff],
    /// Packed token rows whose merge had an empty partial.
    pub empty_partial_rows: &'a [usize],
    /// Set when the configuration could not be served.
    pub unservable: Option<&'a Unservable>,
    /// What its attention read through a paged latent cache (the engine's metadata, its writes
    /// and each row's reads), for the `paged-kv` replays; `None` without one.
    pub paged: Option<&'a PagedStep>,
}

/// Everything diagnosis looks at for one layer.
#[derive(Debug, Clone)]
pub struct DiagnoseInput<'a> {
    /// Model configuration.
    pub cfg: &'a MlaConfig,
    /// The batch both sides ran.
    pub batch: &'a Batch,
    /// The reference trace (f64).
    pub reference: &'a Trace,
    /// Every path that ran on the same inputs.
    pub paths: Vec<PathEvidence<'a>>,
    /// TP ranks the paths used.
    pub tp: usize,
    /// The tolerance rows the diffs were judged by (a path's compute dtype, or a dump's engine
    /// dtype).
    pub precision: Precision,
    /// What an engine's dump holds around the judged step and layer; `None` for mla-diff's own
    /// paths, whose traces hold every site they record and whose rows attend to no earlier step.
    pub dump: Option<DumpScope<'a>>,
    /// The model both sides ran, for the detectors that re-read a stored weight (the block-scale
    /// fit at `o_proj` reads its fp8 weight and `weight_scale_inv` grid); `None` where only the
    /// traces are at hand, and those detectors stay silent.
    pub model: Option<&'a crate::model::gguf::GgufFile>,
}

/// What an engine's dump holds beyond the step and layer being diagnosed, for the hypotheses
/// and hints about sites that were never compared.
#[derive(Debug, Clone, Copy)]
pub struct DumpScope<'a> {
    /// Every stage the dump holds in any step or layer. A stage missing from the judged trace
    /// but listed here is one the hook writes elsewhere and not in this step: hints name it
    /// first among the inputs that were not compared.
    pub dumped: &'a [Stage],
    /// Per sequence of the judged batch: the tokens earlier steps cached, which the step's rows
    /// attended to but which are not among the traces' rows (0 for a one-forward dump).
    pub context: &'a [usize],
    /// The reference over every row of the judged step's sequences: each sequence's cached
    /// context (`context` rows), then its new rows, sequence after sequence, with the judged
    /// heads. Replays of attention read the keys of earlier steps here. `None` when no sequence
    /// has context (the judged reference holds every key).
    pub full_reference: Option<&'a Trace>,
    /// The split count the step's split-KV decode used (format 2's step field
    /// `num_kv_splits`); `None` when the hook did not record it, and the replays search it.
    pub num_kv_splits: Option<usize>,
    /// The sequences of the step's MHA prefill over cached context and their context chunks
    /// (rows of the context partial sites, in order; `off` indexes `full_reference`'s rows);
    /// empty when the step records no context chunks.
    pub chunks: &'a [ContextSeq],
    /// `([a, b], n)`: the dump holds heads `a..b` of the model's `n` in its per-head sites
    /// (format 2's `heads` at TP 1, a head subset); `None` when it holds every head, or one TP
    /// rank's (whose detectors read the rank's own heads).
    pub head_subset: Option<([usize; 2], usize)>,
}

/// What every detector sees for one failing site of one path.
struct SiteCtx<'a> {
    input: &'a DiagnoseInput<'a>,
    path: PathEvidence<'a>,
    site: Site,
    diff: &'a SiteDiff,
    refr: &'a TraceTensor,
    cand: &'a TraceTensor,
    /// Relative L2 under which an alternative hypothesis "explains" the candidate.
    explain: f64,
}

/// What a detector reports when its hypothesis explains a failing site; it becomes the
/// [`Finding`]'s `evidence` and `hint`, printed as the finding's paragraph in the text report,
/// the two last columns of the triage table and the `evidence`/`hint` fields of the JSON report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Detection {
    /// The numbers that show the hypothesis holds, always the explained error against the error
    /// as is, e.g. "W_UK_T equals kv_b's rows split grouped [all k | all v] (rel_l2 1.2e-7 vs
    /// 4.1e-1 as is)".
    pub evidence: String,
    /// Where to look in the engine to fix it: the rule the code broke and, where known, the
    /// engine code that broke it.
    pub hint: String,
}

impl Detection {
    fn new(evidence: String, hint: String) -> Self {
        Detection { evidence, hint }
    }
}

impl<'a> SiteCtx<'a> {
    fn as_is(&self) -> f64 {
        self.diff.metrics.as_ref().map_or(f64::NAN, |m| m.rel_l2)
    }

    /// "rel_l2 `e` vs `as is` as is": an explained error beside the error as is, as evidence
    /// states it.
    fn vs_as_is(&self, e: f64) -> String {
        format!("rel_l2 {} vs {} as is", sci(e, 2), sci(self.as_is(), 2))
    }

    /// The same path's context at `stage` of the failing layer, when that site was compared
    /// (a detector that needs a later output than the first divergence, as `attn_out` beside a
    /// failing `lse`).
    fn at_stage(&self, stage: Stage) -> Option<SiteCtx<'a>> {
        let site = Site::new(self.site.layer, stage);
        Some(SiteCtx {
            input: self.input,
            path: self.path,
            site,
            diff: self.path.diffs.iter().find(|d| d.site == site)?,
            refr: self.input.reference.get(&site)?,
            cand: self.path.trace.get(&site)?,
            explain: explain_threshold(stage, self.input.precision),
        })
    }

    fn ref_site(&self, stage: Stage) -> Option<&TraceTensor> {
        self.input.reference.get(&Site::new(self.site.layer, stage))
    }

    /// Compares the candidate with an alternative built from the reference: Some(rel) if it
    /// explains.
    fn explained_by(&self, alt: &[f64]) -> Option<f64> {
        let c = self.cand.to_f64();
        if alt.len() != c.len() {
            return None;
        }
        let e = rel_l2(&c, alt);
        (e <= self.explain && e < self.as_is()).then_some(e)
    }
}

/// Row indices as evidence quotes them: all of them up to ten, else the first ten and the count.
fn list(v: &[usize]) -> String {
    if v.len() <= 10 {
        format!("{v:?}")
    } else {
        format!("{:?}… ({} in all)", &v[..10], v.len())
    }
}

/// A detector: one hypothesis tested on one failing site.
type Detector = fn(&SiteCtx<'_>) -> Option<Detection>;

/// Every site detector with the class it names, in precedence order (earlier wins);
/// [`fallback::mismatch`] answers when none explains the site.
const DETECTORS: [(Class, Detector); 33] = [
    (Class::WeightNotLoaded, weights::weight_not_loaded),
    (Class::PhantomOutput, canary::phantom_output),
    // The chunked-context family (`merge`), each entry at its class's place: a context partial
    // never written before `unwritten-rows` (a zeroed chunk row is no canary), the merge's head
    // stride before `paged-kv`, the merge replays before the split-KV decode's.
    (Class::PhantomOutput, merge::partial_unwritten),
    (Class::UnwrittenRows, canary::unwritten_rows),
    (Class::ShardOrder, weights::shard_order),
    (Class::TpRankOrder, weights::tp_rank_order),
    (Class::TpReduce, collective::tp_reduce),
    (Class::KvBLayout, weights::kv_b_layout),
    (Class::QuantScaleLayout, scales::gemm_scale_layout),
    (Class::QuantScaleLayout, scales::rank_shard_scale_layout),
    (Class::Transposed, weights::transposed),
    (Class::NormSkipped, norm::norm_skipped),
    (Class::RopeStyle, rope::rope_style),
    // Replays of one mechanism from the stage's own inputs, after the layout classes a free
    // stride could also fit; paged-kv before the merge, whose empty-partial test also holds for
    // rows a wrong cache read moved.
    (Class::StridedView, strided::strided_view),
    (Class::StridedView, merge::merge_stride),
    (Class::PagedKv, paged::paged_kv),
    (Class::KvCacheScale, paged::kv_cache_scale),
    // Before the scale: a base-2 merge also reweights the logits, and a free scale fits part of it.
    (Class::LseMerge, merge::partial_lse),
    (Class::LseMerge, merge::merge_replay),
    (Class::LseMerge, attention::lse_merge),
    // A decode kernel's scale on a mixed batch's decode rows alone (the merge's stale-partial
    // footprint defers to it), then a scale of the whole site.
    (Class::SoftmaxScale, paged::decode_logit_scale),
    (Class::SoftmaxScale, attention::softmax_scale),
    (Class::MoeRouting, moe::moe_routing),
    (Class::IndexerRopeStyle, indexer::indexer_rope_style),
    (Class::IndexerTopkStale, indexer::indexer_topk_stale),
    (Class::IndexerSelection, indexer::indexer_selection),
    (Class::ResidualScale, residual::residual_scale),
    (Class::Fp8ActScale, fp8::act_scale),
    (Class::Fp8ActScale, fp8::act_scale_normed),
    (Class::Precision, precision::precision),
    (Class::Nonfinite, canary::nonfinite),
    (Class::ScaleOnly, fallback::scale_only),
    (Class::PathDisagreement, fallback::path_disagreement),
];

/// A loaded-tensor detector: one hypothesis tested on one failing tensor of a weights file; it
/// names its class itself (a transpose is `kv-b-layout` for `W_UK_T`/`W_UV`, `transposed`
/// elsewhere).
type LoadedDetector = fn(&loaded::Failing<'_>) -> Option<Finding>;

/// Every loaded-tensor detector, in precedence order (earlier wins); [`loaded::row_differences`]
/// answers when none explains the tensor. Findings across ranks ([`loaded::rank_findings`]) are
/// judged after every tensor.
const LOADED_DETECTORS: [LoadedDetector; 8] = [
    loaded::not_loaded,
    loaded::transposed,
    loaded::scale_layout,
    loaded::shape_mismatch,
    loaded::shard_order,
    // Before the head order: a grouped split of kv_b matches some heads by accident.
    loaded::kv_b_layout,
    loaded::heads_permuted,
    loaded::quant_block_cut,
];

/// Runs the detectors of `class` alone on the first divergence of path `path` of `input` (no
/// precedence, no other detector): whether that one hypothesis explains the divergence, and
/// with what evidence and hint.
///
/// `None` when the path has no divergence, when `class` has no site detector (`mismatch`,
/// `quant-block-misaligned`, `transposed`, `weight-nonfinite` come from elsewhere), or when the
/// hypothesis does not explain it. For tests and for callers that ask about one bug class.
pub fn detect_at(input: &DiagnoseInput<'_>, path: usize, class: Class) -> Option<Detection> {
    let ev = *input.paths.get(path)?;
    let first = metrics::first_divergence(ev.diffs)?;
    detect_at_site(input, path, first.site, class)
}

/// Runs the detectors of `class` alone (each in precedence order, the first that explains
/// answers) at `site` of path `path` of `input`, whether or not the site failed: what its
/// hypotheses say there. `None` when the path has no comparison of
/// `site`, when `class` has no site detector, or when the hypothesis does not explain it. For
/// tests that show a hypothesis stays silent on a site that passed (a margin wide enough for
/// every clean run), and for [`detect_at`].
pub fn detect_at_site(input: &DiagnoseInput<'_>, path: usize, site: Site, class: Class) -> Option<Detection> {
    let ev = *input.paths.get(path)?;
    let diff = ev.diffs.iter().find(|d| d.site == site)?;
    let x = SiteCtx {
        input,
        path: ev,
        site,
        diff,
        refr: input.reference.get(&site)?,
        cand: ev.trace.get(&site)?,
        explain: explain_threshold(site.stage, input.precision),
    };
    DETECTORS
        .iter()
        .filter(|(c, _)| *c == class)
        .find_map(|(_, det)| det(&x))
}

/// Classifies one failing site.
fn classify(x: &SiteCtx<'_>) -> Finding {
    for (class, det) in DETECTORS {
        // Id sites hold ids, not values: only the set comparisons apply to them.
        let set_class = matches!(
            class,
            Class::MoeRouting | Class::IndexerTopkStale | Class::IndexerSelection
        );
        if x.site.stage.is_id_set() != set_class {
            continue;
        }
        if let Some(d) = crate::core::timing::stage(&format!("detect {}", class.name()), || det(x)) {
            return Finding::at_site(class, x.site, Some(x.path.kind), d);
        }
    }
    let d = crate::core::timing::stage("detect mismatch", || fallback::mismatch(x));
    Finding::at_site(Class::Mismatch, x.site, Some(x.path.kind), d)
}

/// Explains one failing tensor of an engine's weights file: the first of `LOADED_DETECTORS`
/// whose hypothesis holds (never loaded, transposed, block scales in another layout, a shape no
/// transpose explains, fused shards
/// permuted, a kv_b layout, heads in another order, a TP cut inside a quant block), else where
/// the differences are.
pub fn explain_loaded(f: &loaded::Failing<'_>) -> Finding {
    LOADED_DETECTORS
        .iter()
        .find_map(|det| det(f))
        .unwrap_or_else(|| loaded::row_differences(f))
}

/// The threshold under which an alternative hypothesis explains a candidate: 5× the site's
/// rel_l2 tolerance, at least 1e-4 (f32: the explained error is ~1e-7; bf16: ~1e-2; a wrong
/// hypothesis leaves an O(1) error).
fn explain_threshold(stage: Stage, precision: Precision) -> f64 {
    (5.0 * tolerance(stage, precision).0.rel_l2).max(1e-4)
}

/// A weight site holding the reference's weight with its last two dims swapped, as `weights
/// --check` names a loaded tensor so held ([`loaded::transposed_of`]): `transposed`, or
/// `kv-b-layout` for `w.W_UK_T`/`w.W_UV`.
fn transposed_weight(
    input: &DiagnoseInput<'_>,
    site: Site,
    refr: &TraceTensor,
    cand: &TraceTensor,
) -> Option<(Class, Detection)> {
    if !site.stage.is_weight() {
        return None;
    }
    let cfg = input.cfg;
    let param = crate::model::tensors::dump_name(crate::model::tensors::site_param(cfg, site.stage)?.0);
    let src = gguf_sources(cfg, site.layer, site.stage).join(" + ");
    let fused = cfg.kv_b_layout == crate::model::config::KvBLayout::Fused;
    loaded::transposed_of(
        param,
        &cand.to_f64(),
        &cand.shape,
        &refr.to_f64(),
        &refr.shape,
        explain_threshold(site.stage, input.precision),
        &src,
        fused,
    )
}

/// Diagnoses every path of one layer: one finding per path at its first divergence (or the
/// unservable cut), none for a path that passes.
pub fn diagnose(input: &DiagnoseInput<'_>) -> Vec<Finding> {
    let mut out = Vec::new();
    for path in &input.paths {
        if let Some(u) = path.unservable {
            out.push(misaligned_finding(u, path.kind));
            continue;
        }
        let Some(first) = metrics::first_divergence(path.diffs) else {
            continue;
        };
        let at_first = |d: Detection| Finding::at_site(Class::Mismatch, first.site, Some(path.kind), d);
        let (Some(refr), Some(cand)) = (input.reference.get(&first.site), path.trace.get(&first.site)) else {
            out.push(at_first(Detection::new(
                format!(
                    "site {} has no reference counterpart or no candidate tensor",
                    first.site
                ),
                "the trace is incomplete".into(),
            )));
            continue;
        };
        if first.status == Status::ShapeMismatch {
            if let Some((class, d)) = transposed_weight(input, first.site, refr, cand) {
                out.push(Finding::at_site(class, first.site, Some(path.kind), d));
                continue;
            }
            out.push(at_first(Detection::new(
                format!(
                    "shape {:?} where the reference has {:?}",
                    first.shape_cand, first.shape_ref
                ),
                "check the view/reshape that produced this tensor".into(),
            )));
            continue;
        }
        let x = SiteCtx {
            input,
            path: *path,
            site: first.site,
            diff: first,
            refr,
            cand,
            explain: explain_threshold(first.site.stage, input.precision),
        };
        let f = classify(&x);
        out.push(match f.class {
            Class::Mismatch => upstream_cause(input, *path, first).unwrap_or(f),
            _ => f,
        });
    }
    out
}

/// Replays that may name a site before the first divergence, which passed within its rows:
/// a mechanism whose whole error fits inside loose rows (bf16 with fp8 GEMMs) and shows only
/// downstream, where no detector explains it. Each must demand an exact replay far nearer the
/// candidate than the reference, so a clean site never answers.
const UPSTREAM: [(Class, Detector); 1] = [(Class::QuantScaleLayout, scales::gemm_scale_layout)];

/// When the first divergence `first` of `path` is only a `mismatch`: the first site of the same
/// layer before it that one of [`UPSTREAM`]'s replays explains, as a finding there whose
/// evidence says the site passed.
fn upstream_cause(input: &DiagnoseInput<'_>, path: PathEvidence<'_>, first: &SiteDiff) -> Option<Finding> {
    path.diffs
        .iter()
        .take_while(|d| d.site != first.site)
        .filter(|d| d.site.layer == first.site.layer && d.status == Status::Pass)
        .find_map(|d| {
            let x = SiteCtx {
                input,
                path,
                site: d.site,
                diff: d,
                refr: input.reference.get(&d.site)?,
                cand: path.trace.get(&d.site)?,
                explain: explain_threshold(d.site.stage, input.precision),
            };
            UPSTREAM.iter().find_map(|(class, det)| {
                det(&x).map(|det| {
                    let d = Detection::new(
                        format!(
                            "{} passed within its {} rows (rel_l2 {}) and the first failing site, {}, has no other \
                             explanation: {}",
                            x.site,
                            input.precision.name(),
                            sci(x.as_is(), 2),
                            first.site,
                            det.evidence
                        ),
                        det.hint,
                    );
                    Finding::at_site(*class, x.site, Some(path.kind), d)
                })
            })
        })
}
