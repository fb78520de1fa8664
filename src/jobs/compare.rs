//! `mla-diff compare`: an engine's own dump judged against the reference on the same GGUF.
//!
//! The dump reader ([`crate::model::dump`]) turns the engine's tensors into our sites and
//! layouts; this job runs the reference from the dump's own layer inputs, compares every dumped
//! site with the metrics, tolerance rows and detectors that `run` uses, and returns the same
//! [`RunReport`], so the same renderers print it.

use ndarray::Array2;

use crate::backend::Backend;
use crate::backend::cuda::compare::{DeviceSite, SplitTrace};
use crate::compute::indexer::{AttendKeys, Selection};
use crate::compute::paged::{CacheWrite, PagedQuery, PagedSeq, PagedStep};
use crate::compute::path::PathOptions;
use crate::compute::reference::Fp8Compute;
use crate::compute::reference::context::{ContextCache, ContextSeq, context_partials};
use crate::compute::reference::{RefInputs, RefOutput};
use crate::core::batch::{Batch, SeqSpec};
use crate::core::dtype::Dtype;
use crate::core::error::{Error, Result};
use crate::core::fp8::{ActQuant, KvCacheQuant, QkQuant};
use crate::core::timing;
use crate::core::trace::{Site, Stage, TensorData, Trace, TraceTensor};
use crate::device::context::Device;
use crate::judge::diagnose::Finding;
use crate::judge::diagnose::{self, DiagnoseInput, DumpScope, PathEvidence};
use crate::judge::label::PathLabel;
use crate::judge::metrics;
use crate::judge::report::{DumpSummary, InputSource, ModelSummary, PathResult, RunRecord, RunReport};
use crate::judge::tolerance::Precision;
use crate::model::config::MlaConfig;
use crate::model::dump::{Dump, EngineDtype, IndexerQuant, StepsDump};
use crate::model::gguf::GgufFile;
use crate::model::weights::{LayerWeights, embed_hidden};

/// What the next dumped layer's `hidden_in` is judged against: the output of dumped layer
/// `layer`, as the engine dumped it (`hidden_out`) and as the reference computed it, [T, H] f64
/// on the rows being judged.
struct Handover {
    layer: usize,
    dump_out: Option<Array2<f64>>,
    ref_out: Option<Array2<f64>>,
}

impl Handover {
    /// The handover of dumped layer `layer` (sites `dumped`, `rows` × `hidden` on the rows being
    /// judged): the engine's `hidden_out` if dumped, beside the reference's `ref_out`.
    ///
    /// Errors: a dumped `hidden_out` that is not `rows` × `hidden`.
    fn new(dumped: &Trace, layer: usize, rows: usize, hidden: usize, ref_out: Option<Array2<f64>>) -> Result<Self> {
        let dump_out = dumped
            .get(&Site::new(layer, Stage::HiddenOut))
            .map(|x| to_array(x, rows, hidden))
            .transpose()?;
        Ok(Handover {
            layer,
            dump_out,
            ref_out,
        })
    }
}

fn to_array(t: &TraceTensor, rows: usize, cols: usize) -> Result<Array2<f64>> {
    Array2::from_shape_vec((rows, cols), t.to_f64()).map_err(|e| Error::Internal(e.to_string()))
}

/// Compares a dump with the reference on the same GGUF: every dumped site, the same metrics,
/// detectors and table as `run`; the tolerance rows are those of the dtype the engine computed in
/// (the dump's `dtype` metadata, or `dtype` when given): [`EngineDtype::precision`], or with
/// `precision` (`compare --precision`) the rows `run --dtype` applies for that dtype.
///
/// Each dumped layer runs the reference from the dump's own `L{n}.hidden_in`; without it, from
/// the dump's `L{n-1}.hidden_out`, or (first layer only) from `tokens` through the embedding and
/// the reference forward of layers `0..n`. When `tokens` are dumped, the first layer's dumped
/// `hidden_in` is judged against the token-derived input; each later dumped `L{n}.hidden_in` is
/// judged against the dump's own `L{n-1}.hidden_out`, or, when the dump holds layer n−1 without
/// it, against the reference's output of layer n−1 (a residual stream scaled between the layers
/// is then `scale-only` there).
///
/// An MoE layer's reference runs its MoE FFN (sites `moe_*`, `shared_out`, `hidden_out`) when the
/// dump holds any of them for that layer or holds the next layer; a token-derived input runs
/// every earlier layer whole.
///
/// Errors: no input for a layer; a reference layer that cannot run (missing tensors, an MoE
/// layer in a file without `expert_count`).
pub fn compare_dump(
    file: &GgufFile,
    cfg: &MlaConfig,
    dump: &Dump,
    map_name: Option<String>,
    dtype: Option<EngineDtype>,
    precision: Option<Dtype>,
) -> Result<RunReport> {
    compare_dump_with(file, cfg, dump, map_name, dtype, precision, &CompareOptions::default())
}

/// [`compare_dump`] with the reference of each dumped layer where `opts.backend` runs it
/// ([`Backend::reference`]; the layers a token-derived input passes through run on the CPU).
///
/// Errors: as [`compare_dump`], and CUDA failures.
#[allow(
    clippy::too_many_lines,
    reason = "one pass over the dumped layers: each layer's input, its reference, the handover from the layer before, judging"
)]
pub fn compare_dump_with(
    file: &GgufFile,
    cfg: &MlaConfig,
    dump: &Dump,
    map_name: Option<String>,
    dtype: Option<EngineDtype>,
    precision: Option<Dtype>,
    opts: &CompareOptions,
) -> Result<RunReport> {
    let backend = &opts.backend;
    let dtype = dtype.unwrap_or(dump.dtype);
    let precision = precision.map_or(dtype.precision(), Precision::from);
    let t = dump.batch.n_tokens();
    let layers: Vec<usize> = dump.layers.keys().copied().collect();
    let mut results = Vec::new();
    let mut findings = Vec::new();
    let mut not_dumped = Vec::new();
    let mut tensor_types = Vec::new();
    let mut prev: Option<Handover> = None;
    // The reference selection of the latest full DSA indexer layer, for GLM's shared layers.
    let mut prev_sel: Option<Selection> = None;
    let stages_dumped = dumped_stages(dump.layers.values());
    let mut ignored = dump.ignored.clone();
    let no_context = vec![0; dump.batch.seqs.len()];
    for (i, &layer) in layers.iter().enumerate() {
        let dumped = &dump.layers[&layer];
        let w = timing::stage("dequant", || backend.load_layer_weights(file, cfg, layer))?;
        let _release = ReleaseLayerWeights(backend);
        file.release_resident_pages();
        if tensor_types.is_empty() {
            tensor_types = w.types.clone();
        }
        let own_in = dumped.get(&Site::new(layer, Stage::HiddenIn));
        // The expected input (what hidden_in is judged against), when known independently, and
        // the input to run from when the dump has no hidden_in.
        let mut expected_in: Option<Array2<f64>> = None;
        let mut fallback_in: Option<Array2<f64>> = None;
        if i == 0 {
            if let Some(tk) = &dump.tokens {
                let from_tokens = token_derived_input(file, cfg, tk, &dump.batch, layer, &mut prev_sel, None)?;
                fallback_in = Some(from_tokens.clone());
                expected_in = Some(from_tokens);
            }
        } else if let Some(handover) = &prev
            && handover.layer + 1 == layer
        {
            // The engine's own hidden_out of layer n−1 when dumped (the same tensor), else the
            // reference's output of layer n−1: the handover between layers is always judged.
            fallback_in.clone_from(&handover.dump_out);
            expected_in = handover.dump_out.clone().or_else(|| handover.ref_out.clone());
        }
        let input = match (own_in, &fallback_in) {
            (Some(x), _) => to_array(x, t, cfg.hidden)?,
            (None, Some(e)) => e.clone(),
            _ => {
                return Err(Error::input(
                    &dump.path,
                    format!("layer {layer}"),
                    format!(
                        "no input: dump L{layer}.hidden_in{}",
                        if i == 0 { " or tokens" } else { "" }
                    ),
                ));
            }
        };
        let next_dumped = dump.layers.contains_key(&(layer + 1));
        let layer_ref = timing::stage("reference", || {
            dumped_layer_reference(
                backend,
                file,
                cfg,
                &w,
                &input,
                &dump.batch,
                dumped,
                next_dumped,
                1,
                &mut prev_sel,
            )
        })?;
        let ref_out = layer_ref.hidden_out;
        let mut reference = layer_ref.trace;
        if let Some(e) = expected_in {
            let flat: Vec<f64> = e.iter().copied().collect();
            reference.record(
                Site::new(layer, Stage::HiddenIn),
                TraceTensor::f64(vec![t, cfg.hidden], flat),
            );
        }
        for s in reference.sites_in_order() {
            if dumped.get(&s).is_none() {
                not_dumped.push(s.to_string());
            }
        }
        let scope = DumpScope {
            dumped: &stages_dumped,
            context: &no_context,
            full_reference: None,
            num_kv_splits: None,
            chunks: &[],
            head_subset: None,
        };
        let (result, layer_findings, unjudged) = judge_dumped_layer(
            file,
            cfg,
            &dump.batch,
            &reference,
            dumped,
            precision,
            1,
            scope,
            layer,
            None,
            None,
        );
        if findings.is_empty() {
            findings.extend(layer_findings);
        }
        ignored.extend(unjudged);
        results.push(result);
        prev = Some(Handover::new(dumped, layer, t, cfg.hidden, ref_out)?);
    }
    wrong_model_hint(&mut findings, &results, &dump.path, file.path());
    let engine = dump.metadata.get("engine").cloned().unwrap_or_else(|| "unknown".into());
    let summary = DumpSummary {
        path: dump.path.display().to_string(),
        engine: engine.clone(),
        map: map_name.or_else(|| dump.map.clone()),
        metadata: dump.metadata.clone(),
        conversions: dump.conversions.clone(),
        patches: Vec::new(),
        ignored,
        not_dumped,
        dtype,
        tolerance_rows: precision,
    };
    Ok(RunReport {
        model: ModelSummary::new(file, cfg, tensor_types),
        run: dump_run_record(dump, layers, dtype, &engine),
        token_ids: dump.tokens.clone(),
        results,
        findings,
        dump: Some(summary),
        loaded_weights: None,
    })
}

/// The `hidden_in` of `layer` derived from the dumped token ids `tokens`: the embedding, then
/// the reference forward of layers `0..layer` whole (MoE FFNs included), keeping `prev_sel`
/// (the latest full DSA indexer layer's selection) up to date; `quant`: the DSA indexer's
/// declared quantization.
///
/// Errors: ids outside the vocabulary, a layer that cannot run; [`Error::Internal`] when a
/// reference layer returns no `hidden_out`.
fn token_derived_input(
    file: &GgufFile,
    cfg: &MlaConfig,
    tokens: &[u32],
    batch: &Batch,
    layer: usize,
    prev_sel: &mut Option<Selection>,
    quant: Option<&QkQuant>,
) -> Result<Array2<f64>> {
    let mut h = embed_hidden(file, cfg, tokens)?;
    for k in 0..layer {
        h = next_layer_input(file, cfg, &h, batch, k, prev_sel, quant, None)?;
    }
    Ok(h)
}

/// The input of layer `k + 1` [T, H] f64: the reference forward of layer `k` whole (its MoE FFN
/// included) on its input `h` (rows of `batch`), keeping `prev_sel` (the latest full DSA indexer
/// layer's selection) up to date; `quant`: the DSA indexer's declared quantization; `fp8`: the
/// engine's fp8 GEMMs (every token of `batch` a prefill token).
///
/// Errors: a layer that cannot run; [`Error::Internal`] when it returns no `hidden_out`.
#[allow(
    clippy::too_many_arguments,
    reason = "the model (file, cfg), the rows (h, batch, k) and what the engine declared (the carried selection, the indexer's and the GEMMs' quantization) have different owners"
)]
fn next_layer_input(
    file: &GgufFile,
    cfg: &MlaConfig,
    h: &Array2<f64>,
    batch: &Batch,
    k: usize,
    prev_sel: &mut Option<Selection>,
    quant: Option<&QkQuant>,
    fp8: Option<&Fp8Compute<'_>>,
) -> Result<Array2<f64>> {
    let wk = LayerWeights::load(file, cfg, k)?;
    let dsa = RefInputs {
        shared: prev_sel.as_ref(),
        attend: None,
        quant,
        fp8,
    };
    let r = crate::compute::reference::forward_full_sel(file, cfg, &wk, h, batch, &dsa)?;
    if cfg.indexer.as_ref().is_some_and(|ix| ix.full.get(k) == Some(&true)) {
        *prev_sel = r.selection;
    }
    r.hidden_out
        .ok_or_else(|| Error::Internal(format!("reference: layer {k} produced no hidden_out")))
}

/// The run record of a dump comparison: the dumped `layers` and batch, input and path `dump`,
/// the engine's compute dtype and the backend `dump: {engine}`.
fn dump_run_record(dump: &Dump, layers: Vec<usize>, dtype: EngineDtype, engine: &str) -> RunRecord {
    RunRecord {
        layers,
        batch: dump.batch.clone(),
        seed: 0,
        input: InputSource::Dump,
        paths: vec![PathLabel::Dump],
        path_options: PathOptions::default(),
        dtype: dtype.compute_dtype(),
        backend: format!("dump: {engine}"),
    }
}

/// Whether a dumped layer's reference runs its MoE FFN: on an MoE layer, when the dump holds
/// any MoE site or `hidden_out` of it (`dumped`), or when `next_dumped` (the next layer is
/// dumped, and its `hidden_in` is judged against this layer's output).
fn runs_ffn(cfg: &MlaConfig, layer: usize, dumped: &Trace, next_dumped: bool) -> bool {
    let wants_ffn = next_dumped
        || dumped
            .entries()
            .iter()
            .any(|(s, _)| s.stage.is_moe() || s.stage == Stage::HiddenOut);
    cfg.is_moe_layer(layer) && wants_ffn
}

/// The reference of one dumped layer on `input` (rows of `batch`), where `backend` runs it
/// ([`Backend::reference`]): with the layer's MoE FFN when `full` ([`runs_ffn`]); with the
/// per-rank sites (`w.*.rank<r>`, `o_proj.rank<r>`) of the engine's `tp` ranks. With `judged`
/// the GPU reference's sites stay on the device and only those of the stages `judged` come to
/// the host ([`LayerRef`]); without, every site does. Keeps `prev_sel`, the selection of the
/// latest full DSA indexer layer that GLM's shared layers borrow, up to date. `dsa`: the DSA
/// indexer's declared quantization and the engine's keys to attend to ([`DumpDsa`]).
///
/// Errors: as [`crate::compute::reference::reference_layer_full`], and CUDA failures.
#[allow(
    clippy::too_many_arguments,
    reason = "the backend, the model (file, cfg, w), the layer's input rows (input, batch), what the reference computes (full, tp), what comes to the host and the selection carried across layers"
)]
fn layer_reference(
    backend: &Backend,
    file: &GgufFile,
    cfg: &MlaConfig,
    w: &LayerWeights,
    input: &Array2<f64>,
    batch: &Batch,
    full: bool,
    tp: usize,
    judged: Option<&[Stage]>,
    prev_sel: &mut Option<Selection>,
    dsa: DumpDsa<'_>,
) -> Result<LayerRef> {
    let fp8 = (dsa.act.is_some() || dsa.kv_cache.is_some()).then(|| Fp8Compute {
        act: dsa.act.copied(),
        kv_cache: dsa.kv_cache.copied(),
        tp,
        absorbed: dsa.absorbed,
        context: dsa.context,
    });
    let inputs = RefInputs {
        shared: prev_sel.as_ref(),
        attend: dsa.attend,
        quant: dsa.quant,
        fp8: fp8.as_ref(),
    };
    let (out, device) = backend.reference(file, cfg, w, input, batch, tp, &inputs, full, judged.is_some())?;
    if cfg
        .indexer
        .as_ref()
        .is_some_and(|ix| ix.full.get(w.layer) == Some(&true))
    {
        prev_sel.clone_from(&out.selection);
    }
    LayerRef::new(backend, out, device, judged)
}

/// What a layer's reference takes from a format-2 dump besides its rows: the DSA indexer's
/// declared quantization (`header.indexer_quant`), the keys the engine's attention read (its
/// `idx_topk`), and the fp8 GEMMs' activation quantization (`header.act_quant`) with which of
/// the batch's tokens ran absorbed ([`StepSeq::runs_absorbed`](crate::model::dump::StepSeq::runs_absorbed)).
#[derive(Debug, Clone, Copy, Default)]
struct DumpDsa<'a> {
    quant: Option<&'a QkQuant>,
    attend: Option<&'a AttendKeys>,
    act: Option<&'a ActQuant>,
    absorbed: Option<&'a [bool]>,
    kv_cache: Option<&'a KvCacheQuant>,
    context: Option<&'a [bool]>,
}

/// Per row of a step's full batch ([`step_full_batch`]'s layout): whether it is cached context
/// of the step (an earlier step computed it, or a prefix hit).
fn context_rows(spec: &crate::model::dump::StepSpec, live: &[usize]) -> Vec<bool> {
    let mut m = Vec::new();
    for &i in live {
        let q = &spec.seqs[i];
        m.extend(std::iter::repeat_n(true, q.context));
        m.extend(std::iter::repeat_n(false, q.new));
    }
    m
}

/// Per row of a step's full batch (each live sequence's context rows, then its new rows, as
/// [`step_full_batch`] lays them out): whether the row ran absorbed in that step. Context rows
/// are not the step's queries: `false`.
fn absorbed_rows(spec: &crate::model::dump::StepSpec, live: &[usize]) -> Vec<bool> {
    let mut m = Vec::new();
    for &i in live {
        let q = &spec.seqs[i];
        m.extend(std::iter::repeat_n(false, q.context));
        m.extend(std::iter::repeat_n(q.runs_absorbed(), q.new));
    }
    m
}

/// A dumped layer's reference as `compare` judges it. The CPU reference is on the host whole.
/// The GPU reference leaves its sites on the device ([`SplitTrace`]); at real size they are
/// gigabytes (DeepSeek-V3 at T = 4,104: about 8.5 GB of f64, a quarter of it `ql_nope` and
/// `attn_latent` alone, which an engine rarely dumps), so only the stages judging reads come to
/// the host first ([`judged_stages`]) and the rest only when a step diverges and its diagnosis
/// reads any stage ([`LayerRef::whole`]), once per reference.
struct LayerRef {
    /// The reference; its trace holds the sites judging reads (every site of a CPU reference or
    /// of a [`ReferenceDownload::Whole`] one).
    out: RefOutput,
    /// The GPU reference's sites, when some stayed on the device.
    split: Option<SplitTrace>,
    /// Every site of `split` on the host, once a diagnosis needed them.
    whole_trace: std::cell::OnceCell<Trace>,
}

impl LayerRef {
    /// `out` and the `device` sites of [`Backend::reference`]: the sites of the stages `judged`
    /// downloaded, the others left on the device.
    ///
    /// Errors: [`Error::Cuda`] on a failed download.
    fn new(
        backend: &Backend,
        mut out: RefOutput,
        device: Vec<DeviceSite<f64>>,
        judged: Option<&[Stage]>,
    ) -> Result<LayerRef> {
        if device.is_empty() {
            return Ok(LayerRef {
                out,
                split: None,
                whole_trace: std::cell::OnceCell::new(),
            });
        }
        let split = SplitTrace {
            host: std::mem::take(&mut out.trace),
            device,
        };
        out.trace = timing::stage("download", || {
            split.to_host_where(reference_device(backend)?, |s| in_stages(judged, s))
        })?;
        Ok(LayerRef {
            out,
            split: Some(split),
            whole_trace: std::cell::OnceCell::new(),
        })
    }

    /// What judging reads: the sites on the host.
    fn judged(&self) -> &Trace {
        &self.out.trace
    }

    /// Every site on the host, downloading those left on the device the first time.
    ///
    /// Errors: [`Error::Cuda`] on a failed download.
    fn whole(&self, backend: &Backend) -> Result<&Trace> {
        let Some(split) = &self.split else {
            return Ok(&self.out.trace);
        };
        if let Some(t) = self.whole_trace.get() {
            return Ok(t);
        }
        let t = timing::stage("download", || split.to_host_where(reference_device(backend)?, |_| true))?;
        Ok(self.whole_trace.get_or_init(|| t))
    }

    /// Every site with its shape, on the host or on the device.
    fn shapes(&self) -> Vec<(Site, &[usize])> {
        match &self.split {
            Some(split) => split
                .device
                .iter()
                .map(|d| (d.site, d.shape.as_slice()))
                .chain(split.host.entries().iter().map(|(s, t)| (*s, t.shape.as_slice())))
                .collect(),
            None => self
                .out
                .trace
                .entries()
                .iter()
                .map(|(s, t)| (*s, t.shape.as_slice()))
                .collect(),
        }
    }
}

/// The device a GPU reference's sites are on.
///
/// Errors: [`Error::Internal`] for a CPU backend, whose reference keeps nothing on a device.
fn reference_device(backend: &Backend) -> Result<&Device> {
    match backend {
        Backend::Cuda(o) => Ok(o.device()),
        Backend::Cpu(_) => Err(Error::internal("a CPU reference has no device sites")),
    }
}

/// The stages the context partials are computed from ([`context_partials`]: the queries, the
/// expanded keys and values), over the step's full batch.
const CONTEXT_PARTIAL_INPUTS: [Stage; 5] = [Stage::Q, Stage::QPeRoped, Stage::KNope, Stage::KPeRoped, Stage::V];

/// The stages of `layer`'s reference that judging the steps `group` of `sd` reads while none of
/// them diverges, in data-flow order: every stage the dump holds at `layer` in any of them
/// ([`metrics::diff`] reads the reference only at the dumped sites); `idx_scores` with
/// `idx_topk` (a selection that differs only in ties is accepted on the reference's scores);
/// where a step lists context chunks (not on a DSA model), [`CONTEXT_PARTIAL_INPUTS`]. A step
/// that diverges reads every stage ([`LayerRef::whole`]).
fn judged_stages(sd: &StepsDump, group: &[usize], layer: usize, cfg: &MlaConfig) -> Vec<Stage> {
    let dumping: Vec<usize> = group
        .iter()
        .copied()
        .filter(|&k| sd.steps[k].1.layers.contains_key(&layer))
        .collect();
    let mut out = dumped_stages(dumping.iter().map(|&k| &sd.steps[k].1.layers[&layer]));
    if out.contains(&Stage::IdxTopk) {
        out.push(Stage::IdxScores);
    }
    if cfg.indexer.is_none() && dumping.iter().any(|&k| !sd.steps[k].0.context_seqs().is_empty()) {
        out.extend(CONTEXT_PARTIAL_INPUTS);
    }
    out.sort_by_key(Stage::order);
    out.dedup();
    out
}

/// The reference of one dumped layer on `input` (rows of `batch`): [`layer_reference`] with the
/// MoE FFN as [`runs_ffn`] says for the sites `dumped` and `next_dumped`.
///
/// Errors: as [`layer_reference`].
#[allow(
    clippy::too_many_arguments,
    reason = "the backend, the model (file, cfg, w), the layer's input rows (input, batch), what the dump holds of the layer (dumped, next_dumped, tp) and the selection carried across layers"
)]
fn dumped_layer_reference(
    backend: &Backend,
    file: &GgufFile,
    cfg: &MlaConfig,
    w: &LayerWeights,
    input: &Array2<f64>,
    batch: &Batch,
    dumped: &Trace,
    next_dumped: bool,
    tp: usize,
    prev_sel: &mut Option<Selection>,
) -> Result<RefOutput> {
    let full = runs_ffn(cfg, w.layer, dumped, next_dumped);
    layer_reference(
        backend,
        file,
        cfg,
        w,
        input,
        batch,
        full,
        tp,
        None,
        prev_sel,
        DumpDsa::default(),
    )
    .map(|r| r.out)
}

/// One dumped layer's sites against its reference (the tolerance rows of `precision`), as the
/// result of the path `dump` at `layer` (in format-2 step `step`), and the dump's finding there;
/// `tp` is the TP size the rank detectors read the per-rank sites with, `scope` what the dump
/// holds around this step and layer, `paged` what the step read through the engine's paged
/// cache ([`dump_paged_step`]).
#[allow(
    clippy::too_many_arguments,
    reason = "the model and batch (file, cfg, batch), both traces, how to judge them (precision, tp, scope, paged) and where the result belongs (layer, step)"
)]
fn judge_dumped_layer(
    file: &GgufFile,
    cfg: &MlaConfig,
    batch: &Batch,
    reference: &Trace,
    dumped: &Trace,
    precision: Precision,
    tp: usize,
    scope: DumpScope<'_>,
    layer: usize,
    step: Option<String>,
    paged: Option<&PagedStep>,
) -> (PathResult, Vec<Finding>, Vec<String>) {
    let mut diffs = timing::stage("judge", || metrics::diff(reference, dumped, precision));
    let unjudged = take_unjudged(&mut diffs, "");
    let findings = timing::stage("diagnose", || {
        diagnose_dumped_layer(file, cfg, batch, reference, dumped, &diffs, precision, tp, scope, paged)
    });
    let result = PathResult {
        path: PathLabel::Dump,
        layer,
        diffs,
        notes: Vec::new(),
        step,
        not_run: None,
    };
    (result, findings, unjudged)
}

/// Takes out of `diffs` the dumped sites the reference has no counterpart of
/// ([`metrics::Status::NoReference`]): a TP rank's site (`o_proj.rank1`, `w.q_b.rank0`, the
/// names `run --tp` gives its own) where the reference runs without TP, a stage the model or
/// layer does not compute (`moe_topk` in a dense layer, `idx_*` without an indexer). Such a
/// site cannot be judged, so it is no divergence: it is returned as a line of the dump's
/// ignored list, its name `prefix` + site (`s1.` for a format-2 step) and why.
fn take_unjudged(diffs: &mut Vec<metrics::SiteDiff>, prefix: &str) -> Vec<String> {
    let mut out = Vec::new();
    diffs.retain(|d| {
        if d.status != metrics::Status::NoReference {
            return true;
        }
        let why = if matches!(
            d.site.stage,
            Stage::WRank(..) | Stage::OProjRank(_) | Stage::FfnGateUpRank(_) | Stage::FfnDownRank(_)
        ) {
            "a TP rank's site: the reference records ranks only at a TP size above 1 (format 2: the header's `tp`)"
        } else {
            "the reference computes no such site for this model and layer"
        };
        out.push(format!("{prefix}{} ({why})", d.site));
        false
    });
    out
}

/// The dump's findings at one dumped layer whose sites `dumped` were judged against
/// `reference` (`diffs`), as [`judge_dumped_layer`] diagnoses them; `file` is the model, for the
/// detectors that re-read a stored weight.
#[allow(
    clippy::too_many_arguments,
    reason = "the model and batch (file, cfg, batch), both traces and their diffs, and how to diagnose them (precision, tp, scope, paged)"
)]
fn diagnose_dumped_layer(
    file: &GgufFile,
    cfg: &MlaConfig,
    batch: &Batch,
    reference: &Trace,
    dumped: &Trace,
    diffs: &[crate::judge::metrics::SiteDiff],
    precision: Precision,
    tp: usize,
    scope: DumpScope<'_>,
    paged: Option<&PagedStep>,
) -> Vec<Finding> {
    diagnose::diagnose(&DiagnoseInput {
        cfg,
        batch,
        reference,
        paths: vec![PathEvidence {
            kind: PathLabel::Dump,
            trace: dumped,
            diffs,
            empty_partial_rows: &[],
            unservable: None,
            paged,
        }],
        tp,
        precision,
        dump: Some(scope),
        model: Some(file),
    })
}

/// The reference sites one step lacks, each once, in two lists: `first` the sites whose stage
/// the dump holds in another step or layer (a hook that writes a stage somewhere but not here is
/// the likelier fault), `rest` the others.
#[derive(Default)]
struct StepMissing {
    first: Vec<Site>,
    rest: Vec<Site>,
}

impl StepMissing {
    /// Adds the sites of one dumped layer's reference, `sites` (in data-flow order), that
    /// `dumped` lacks; `elsewhere` holds every stage the dump has in any step or layer.
    fn add(&mut self, sites: &[Site], dumped: &Trace, elsewhere: &[Stage]) {
        for &s in sites {
            if dumped.get(&s).is_some() {
                continue;
            }
            let list = if elsewhere.contains(&s.stage) {
                &mut self.first
            } else {
                &mut self.rest
            };
            if !list.contains(&s) {
                list.push(s);
            }
        }
    }

    /// The sites as listed: `STEP: SITE` when `step` names the step of a dump of several steps,
    /// else `SITE`; `first` before `rest`.
    fn labeled(&self, step: Option<&str>) -> impl Iterator<Item = String> + '_ {
        let step = step.map(str::to_string);
        self.first.iter().chain(&self.rest).map(move |s| match &step {
            Some(step) => format!("{step}: {s}"),
            None => s.to_string(),
        })
    }
}

/// Every stage the traces `layers` hold (of any layer), each once, in data-flow order.
fn dumped_stages<'a>(layers: impl Iterator<Item = &'a Trace>) -> Vec<Stage> {
    let mut out: Vec<Stage> = Vec::new();
    for tr in layers {
        for (s, _) in tr.entries() {
            if !out.contains(&s.stage) {
                out.push(s.stage);
            }
        }
    }
    out.sort_by_key(Stage::order);
    out
}

/// The rows `rows` (dim 0) of `t` when its first dim is `t_full` tokens; weights and other
/// tensors that are not per token come back whole.
fn take_rows(t: &TraceTensor, rows: &[usize], t_full: usize) -> TraceTensor {
    if t.shape.first() != Some(&t_full) || t_full == 0 {
        return t.clone();
    }
    let per = t.len() / t_full;
    let all = t.to_f64();
    let mut v = Vec::with_capacity(rows.len() * per);
    for &r in rows {
        v.extend_from_slice(&all[r * per..(r + 1) * per]);
    }
    let mut shape = t.shape.clone();
    shape[0] = rows.len();
    TraceTensor::f64(shape, v)
}

/// The reference of a format-2 step: the sites of `full` (the reference over the step's full
/// batch, `t_full` rows) of the stages `stages` (all without), on the step's rows `new_rows`,
/// and with `heads = [a, b]` the per-head sites' heads `a..b` ([`take_heads`]).
fn step_reference(
    full: &Trace,
    new_rows: &[usize],
    t_full: usize,
    heads: Option<[usize; 2]>,
    cfg: &MlaConfig,
    stages: Option<&[Stage]>,
) -> Trace {
    let mut reference = Trace::new();
    for (s, t) in full.entries().iter().filter(|(s, _)| in_stages(stages, s)) {
        let rows = take_rows(t, new_rows, t_full);
        let t = match heads {
            Some(hs) => take_heads(&rows, s.stage, cfg, hs),
            None => rows,
        };
        reference.record(*s, t);
    }
    reference
}

/// The heads `a..b` of a per-head site ([`crate::model::dump::is_per_head`]) of `t`, whose
/// shape is the site's with the model's N heads; other sites (and a shape that does not fit)
/// come back whole.
fn take_heads(t: &TraceTensor, stage: Stage, cfg: &MlaConfig, [a, b]: [usize; 2]) -> TraceTensor {
    let n = cfg.n_head;
    if !crate::model::dump::is_per_head(stage) || b > n || a >= b {
        return t.clone();
    }
    // The tensor as [outer, N, inner]: the head blocks sit on axis 1 of activations, on axis 0
    // of the weights (kv_b's P+V rows per head).
    let (outer, inner, axis, per_head_rows) = match stage {
        Stage::WKvB => (1, t.len() / n.max(1), 0, cfg.qk_nope_head_dim + cfg.v_head_dim),
        Stage::WUkT | Stage::WUv => (1, t.len() / n.max(1), 0, 1),
        _ => {
            let rows = t.shape.first().copied().unwrap_or(0);
            (rows, t.len() / (rows * n).max(1), 1, 1)
        }
    };
    if outer * n * inner != t.len() || t.shape.get(axis) != Some(&(n * per_head_rows)) {
        return t.clone();
    }
    let all = t.to_f64();
    let mut v = Vec::with_capacity(outer * (b - a) * inner);
    for o in 0..outer {
        v.extend_from_slice(&all[(o * n + a) * inner..(o * n + b) * inner]);
    }
    let mut shape = t.shape.clone();
    shape[axis] = (b - a) * per_head_rows;
    TraceTensor::f64(shape, v)
}

/// How `compare` computes the reference it judges a dump against.
#[derive(Debug, Clone)]
pub struct CompareOptions {
    /// Where the f64 reference of each dumped layer runs ([`Backend::reference`]): the CPU, or
    /// for a CUDA backend with the GPU reference on, the GPU where it computes the layer (not a
    /// DSA layer, not an MoE FFN), its sites brought to the host as `download` says.
    pub backend: Backend,
    /// How a format-2 dump's steps get their reference.
    pub references: StepReferences,
    /// Which of a format-2 reference's sites come to the host before judging.
    pub download: ReferenceDownload,
}

/// Which sites of a format-2 dump's layer reference come to the host (from the GPU, or for
/// each step's rows, out of a union reference) before its steps are judged.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ReferenceDownload {
    /// The stages judging reads (the dumped ones, and the inputs of the context partials and of
    /// the selection's tie check); every stage only once a step diverges, when its diagnosis
    /// reads them, once per layer reference. The verdicts, numbers and findings are
    /// [`ReferenceDownload::Whole`]'s.
    #[default]
    Judged,
    /// Every site, before judging (the oracle of [`ReferenceDownload::Judged`] in the tests).
    Whole,
    /// A GPU reference judges where it lives: each step's rows (and a head subset's heads) of
    /// the dumped sites are gathered on the device and compared there
    /// ([`crate::judge::device`]); only the inputs of the context partials come to the host
    /// before judging, and every stage once a step diverges, as with
    /// [`ReferenceDownload::Judged`]. A layer whose reference ran on the CPU (a DSA layer, an
    /// MoE FFN, the CPU backend) is judged as [`ReferenceDownload::Judged`] judges it. The
    /// verdicts and findings are the host's; the metrics agree to f64 rounding.
    Device,
}

impl Default for CompareOptions {
    /// The CPU reference, one union reference per dumped layer where it is valid.
    fn default() -> Self {
        CompareOptions {
            backend: Backend::Cpu(crate::backend::cpu::CpuOps::new(Dtype::F32)),
            references: StepReferences::Union,
            download: ReferenceDownload::Judged,
        }
    }
}

/// How a format-2 dump's steps get their reference.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepReferences {
    /// One reference per dumped layer over the union of the steps' sequences, each step's rows
    /// selected from it, where the steps only extend their sequences (see
    /// [`compare_steps_with`]); each step its own reference where not.
    Union,
    /// Each step its own reference over its full batch (the union's oracle in the tests).
    PerStep,
}

/// How many references a format-2 comparison ran (`compare --stats`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReferenceTally {
    /// Union references (one per dumped layer and kind of reference).
    pub union: usize,
    /// The steps those union references served.
    pub union_steps: usize,
    /// References of one step each (a step the union does not serve, or
    /// [`StepReferences::PerStep`]).
    pub per_step: usize,
}

/// Frees a CUDA backend's device copy of a layer's weights when the layer is done.
struct ReleaseLayerWeights<'a>(&'a Backend);

impl Drop for ReleaseLayerWeights<'_> {
    fn drop(&mut self) {
        self.0.release_layer_weights();
    }
}

/// What one step has judged so far, layer after layer.
#[derive(Default)]
struct StepState {
    results: Vec<PathResult>,
    /// The first dumped layer's findings that are not empty.
    findings: Vec<Finding>,
    missing: StepMissing,
    /// The previous dumped layer's output in this step, on the step's rows.
    prev: Option<Handover>,
    /// The step's selection of the latest full DSA indexer layer (GLM's shared layers).
    prev_sel: Option<Selection>,
    /// The engine's selection at the latest full DSA indexer layer of the step (its layer, and
    /// per new row the kept positions), from the dump's `idx_topk` ([`engine_keys`]).
    engine_sel: Option<(usize, Vec<Vec<usize>>)>,
    /// The step's dumped sites the reference has no counterpart of, as ignored-list lines
    /// ([`take_unjudged`]).
    unjudged: Vec<String>,
}

/// One reference over the union of several steps' sequences (the steps of `group` that dump
/// one layer): each sequence from position 0 to its largest extent over those steps, its input
/// the rows the last of them gathers ([`ContextRows::gather`]). Attention is causal within a
/// sequence and every other stage acts row by row, so a step whose input rows equal the
/// union's on its positions has, on those rows, the reference it would compute alone (up to
/// the summation order of a GEMM over another number of rows).
struct UnionRef {
    /// The reference over `batch` (T_u rows).
    r: LayerRef,
    /// Its input [T_u, H].
    input: Array2<f64>,
    /// Per header sequence, its first row in the union; `None` when no step of the group gives
    /// it new tokens.
    off: Vec<Option<usize>>,
    /// Per header sequence, its rows in the union.
    extent: Vec<usize>,
    t: usize,
}

/// A step's rows in a [`UnionRef`]: each live sequence's positions `0..context+new` in the
/// step's layout ([`step_full_batch`]), and of them the step's new rows.
struct UnionRows {
    full: Vec<usize>,
    new: Vec<usize>,
}

impl UnionRef {
    /// The union reference of `layer` over the steps `group` (ascending) of `sd`; `None` where
    /// it cannot serve them: a sequence that a later step of the group holds shorter than an
    /// earlier one, an input that cannot be gathered (the steps' own references report it), a
    /// site with a per-token axis of another length. `judged`: the stages judging reads, or
    /// `None` for every stage on the host ([`LayerRef`]).
    ///
    /// Errors: the reference's own.
    #[allow(
        clippy::too_many_arguments,
        reason = "the model (file, cfg, w), the dump, its context rows and the steps (sd, rows, group, layer) and how the reference runs (backend, full, tp, judged)"
    )]
    fn build(
        backend: &Backend,
        file: &GgufFile,
        cfg: &MlaConfig,
        w: &LayerWeights,
        sd: &StepsDump,
        rows: &mut ContextRows,
        group: &[usize],
        layer: usize,
        full: bool,
        tp: usize,
        judged: Option<&[Stage]>,
    ) -> Result<Option<UnionRef>> {
        let n_seq = sd.header.steps[0].seqs.len();
        let mut off = vec![None; n_seq];
        let mut extent = vec![0; n_seq];
        let mut last = vec![0; n_seq];
        let mut t = 0;
        for i in 0..n_seq {
            let lens: Vec<(usize, usize)> = group
                .iter()
                .map(|&k| (k, &sd.steps[k].0.seqs[i]))
                .filter(|(_, q)| q.new > 0)
                .map(|(k, q)| (k, q.context + q.new))
                .collect();
            let Some(&(k_last, e)) = lens.last() else { continue };
            if lens.iter().any(|&(_, len)| len > e) {
                return Ok(None);
            }
            off[i] = Some(t);
            extent[i] = e;
            last[i] = k_last;
            t += e;
        }
        let mut input = Array2::<f64>::zeros((t, cfg.hidden));
        for i in 0..n_seq {
            let Some(o) = off[i] else { continue };
            let Ok(x) = timing::stage("input", || rows.gather(last[i], &[i], layer, extent[i])) else {
                return Ok(None);
            };
            input.slice_mut(ndarray::s![o..o + extent[i], ..]).assign(&x);
        }
        let batch = Batch {
            seqs: (0..n_seq)
                .filter(|&i| off[i].is_some())
                .map(|i| SeqSpec {
                    len: extent[i],
                    start_pos: 0,
                })
                .collect(),
        };
        // fp8 GEMMs: each union row ran absorbed or not in the step of the group that computed
        // it (a row no step of the group computed is not judged here).
        let act = sd.header.act_quant.as_ref().map(crate::model::dump::ActQuantDecl::act);
        let absorbed = act.is_some().then(|| {
            let mut m = vec![false; t];
            for (i, o) in off.iter().enumerate() {
                let Some(o) = *o else { continue };
                for &k in group {
                    let q = &sd.steps[k].0.seqs[i];
                    let rows = (o + q.context..o + q.context + q.new).filter(|&r| r < o + extent[i]);
                    rows.for_each(|r| m[r] = q.runs_absorbed());
                }
            }
            m
        });
        let dsa = DumpDsa {
            act: act.as_ref(),
            absorbed: absorbed.as_deref(),
            ..DumpDsa::default()
        };
        let r = timing::stage("reference", || {
            layer_reference(backend, file, cfg, w, &input, &batch, full, tp, judged, &mut None, dsa)
        })?;
        let per_token = r
            .shapes()
            .iter()
            .all(|(s, shape)| s.stage.is_weight() || shape.first() == Some(&t));
        Ok(per_token.then_some(UnionRef {
            r,
            input,
            off,
            extent,
            t,
        }))
    }

    /// Step `spec`'s rows here, when its live sequences `live` are all in the union and its
    /// input `full_in` (the step's full batch) equals the union's input on them, bit for bit.
    fn rows(&self, spec: &crate::model::dump::StepSpec, live: &[usize], full_in: &Array2<f64>) -> Option<UnionRows> {
        let mut rows = UnionRows {
            full: Vec::with_capacity(full_in.nrows()),
            new: Vec::new(),
        };
        for &i in live {
            let o = self.off.get(i).copied().flatten()?;
            let q = &spec.seqs[i];
            let len = q.context + q.new;
            if len > self.extent[i] {
                return None;
            }
            rows.full.extend(o..o + len);
            rows.new.extend(o + q.context..o + len);
        }
        if rows.full.len() != full_in.nrows() {
            return None;
        }
        let same = rows.full.iter().enumerate().all(|(r, &u)| {
            full_in
                .row(r)
                .iter()
                .zip(self.input.row(u))
                .all(|(a, b)| a.to_bits() == b.to_bits())
        });
        same.then_some(rows)
    }
}

/// Where a step's reference comes from: its own, or its rows of a union reference.
enum StepSource<'a> {
    Own(LayerRef),
    Union(&'a UnionRef, UnionRows),
}

impl StepSource<'_> {
    /// The layer reference the step's rows come from.
    fn layer_ref(&self) -> &LayerRef {
        match self {
            StepSource::Own(o) => o,
            StepSource::Union(u, _) => &u.r,
        }
    }

    /// The step's reference on its new rows (`new_rows` of its own full batch of `t_full`
    /// rows), from `trace` (its layer reference's, judged or whole), of the stages `stages`
    /// (all without), sliced to `heads`.
    fn new_rows(
        &self,
        trace: &Trace,
        new_rows: &[usize],
        t_full: usize,
        heads: Option<[usize; 2]>,
        cfg: &MlaConfig,
        stages: Option<&[Stage]>,
    ) -> Trace {
        match self {
            StepSource::Own(_) => step_reference(trace, new_rows, t_full, heads, cfg, stages),
            StepSource::Union(u, r) => select_rows(trace, &r.new, u.t, heads, cfg, stages),
        }
    }

    /// The step's rows of the device sites of `split` (its layer reference's) that `dumped`
    /// holds, gathered on the device: a step's new rows (`new_rows` of its own full batch of
    /// `t_full` rows, or its rows of the union), with `heads = [a, b]` a per-head site's heads
    /// `a..b` ([`take_heads`]'s layout). A weight site, or a site without the per-token axis,
    /// comes to the host whole (heads sliced there), as [`select_rows`] keeps it. Returns a
    /// [`SplitTrace`] whose host part holds those; the caller adds the rest of the step's host
    /// reference.
    ///
    /// Errors: [`Error::Cuda`] on a failed copy or launch.
    #[allow(
        clippy::too_many_arguments,
        reason = "the device and the reference's sites (dev, split), what the step holds (dumped) and its rows and heads (new_rows, t_full, heads, cfg)"
    )]
    fn device_rows(
        &self,
        dev: &Device,
        split: &SplitTrace,
        dumped: &Trace,
        new_rows: &[usize],
        t_full: usize,
        heads: Option<[usize; 2]>,
        cfg: &MlaConfig,
    ) -> Result<SplitTrace> {
        let (rows, t) = match self {
            StepSource::Own(_) => (new_rows, t_full),
            StepSource::Union(u, r) => (r.new.as_slice(), u.t),
        };
        let mut out = SplitTrace::default();
        for d in split.device.iter().filter(|d| dumped.get(&d.site).is_some()) {
            let (stage, numel) = (d.site.stage, d.numel());
            if stage.is_weight() || d.shape.first() != Some(&t) || t == 0 {
                let whole = TraceTensor::f64(
                    d.shape.clone(),
                    crate::backend::cuda::compare::download(dev, &d.buf, numel)?,
                );
                let whole = match heads {
                    Some(hs) => take_heads(&whole, stage, cfg, hs),
                    None => whole,
                };
                out.host.record(d.site, whole);
                continue;
            }
            let per = numel / t;
            let n = cfg.n_head;
            let head_slice = heads.filter(|&[a, b]| {
                crate::model::dump::is_per_head(stage)
                    && a < b
                    && b <= n
                    && d.shape.get(1) == Some(&n)
                    && per % n.max(1) == 0
            });
            let mut shape = d.shape.clone();
            shape[0] = rows.len();
            let (idx, row_len): (Vec<usize>, usize) = match head_slice {
                Some([a, b]) => {
                    shape[1] = b - a;
                    (
                        rows.iter().flat_map(|&r| (a..b).map(move |h| r * n + h)).collect(),
                        per / n,
                    )
                }
                None => (rows.to_vec(), per),
            };
            let buf = crate::backend::cuda::compare::gather_rows_f64(dev, &d.buf, &idx, row_len)?;
            out.device.push(DeviceSite {
                site: d.site,
                shape,
                buf,
            });
        }
        Ok(out)
    }

    /// The step's reference over its full batch, of the stages `stages` (all without), from
    /// `trace` (its layer reference's): its own trace is that already (`None`), a union's rows
    /// are selected.
    fn full_rows(&self, trace: &Trace, cfg: &MlaConfig, stages: Option<&[Stage]>) -> Option<Trace> {
        match self {
            StepSource::Own(_) => None,
            StepSource::Union(u, r) => Some(select_rows(trace, &r.full, u.t, None, cfg, stages)),
        }
    }

    /// The reference over the step's full batch: its own `trace`, else `rows` (its rows of the
    /// union, when selected).
    fn full_trace<'b>(&self, trace: &'b Trace, rows: &'b Option<Trace>) -> Option<&'b Trace> {
        match self {
            StepSource::Own(_) => Some(trace),
            StepSource::Union(..) => rows.as_ref(),
        }
    }

    /// The reference's `hidden_out` [t_new, hidden] on the step's new rows (`new_rows` of its
    /// own full batch), when the reference has one.
    fn hidden_out_rows(&self, new_rows: &[usize], t_new: usize, hidden: usize) -> Option<Array2<f64>> {
        let (h, rows) = match self {
            StepSource::Own(o) => (o.out.hidden_out.as_ref()?, new_rows),
            StepSource::Union(u, r) => (u.r.out.hidden_out.as_ref()?, r.new.as_slice()),
        };
        Some(Array2::from_shape_fn((t_new, hidden), |(i, j)| h[[rows[i], j]]))
    }
}

/// Whether `site` is of one of the stages `stages` (any stage without).
fn in_stages(stages: Option<&[Stage]>, site: &Site) -> bool {
    stages.is_none_or(|st| st.contains(&site.stage))
}

/// The rows `rows` (of `t` per-token rows) of every site of `trace` of the stages `stages` (all
/// without): the weight sites whole, every other site (a [`UnionRef`]'s, whose per-token axis is
/// checked) on those rows, in f64.
fn select_rows(
    trace: &Trace,
    rows: &[usize],
    t: usize,
    heads: Option<[usize; 2]>,
    cfg: &MlaConfig,
    stages: Option<&[Stage]>,
) -> Trace {
    let mut out = Trace::new();
    for (s, x) in trace.entries().iter().filter(|(s, _)| in_stages(stages, s)) {
        let picked = if s.stage.is_weight() || t == 0 {
            x.clone()
        } else {
            let per = x.len() / t;
            let mut v = Vec::with_capacity(rows.len() * per);
            match &x.data {
                TensorData::F64(d) => {
                    for &r in rows {
                        v.extend_from_slice(&d[r * per..(r + 1) * per]);
                    }
                }
                TensorData::F32(d) => {
                    for &r in rows {
                        v.extend(d[r * per..(r + 1) * per].iter().map(|&e| f64::from(e)));
                    }
                }
            }
            let mut shape = x.shape.clone();
            shape[0] = rows.len();
            TraceTensor::f64(shape, v)
        };
        let picked = match heads {
            Some(hs) => take_heads(&picked, s.stage, cfg, hs),
            None => picked,
        };
        out.record(*s, picked);
    }
    out
}

/// Compares a format-2 dump with the reference on the CPU: [`compare_steps_with`] with
/// [`CompareOptions::default`].
///
/// Errors: as [`compare_steps_with`].
pub fn compare_steps(
    file: &GgufFile,
    cfg: &MlaConfig,
    steps_dump: &StepsDump,
    map_name: Option<String>,
    dtype: Option<EngineDtype>,
    precision: Option<Dtype>,
) -> Result<RunReport> {
    compare_steps_with(
        file,
        cfg,
        steps_dump,
        map_name,
        dtype,
        precision,
        &CompareOptions::default(),
    )
    .map(|(r, _)| r)
}

/// Compares a format-2 dump with the reference: its loaded weights (`weights.*`) first, judged
/// by [`crate::jobs::weights_check::check_dump_weights`] as `weights --check` judges them (their
/// findings come first: an engine loads its weights before it computes), then every step of
/// every dumped layer, each step
/// against the reference run from position 0 over the sequences' cached context and new tokens
/// (fed with the `hidden_in` rows of the steps up to it, and for a sequence's `unrecorded`
/// positions with layer inputs rebuilt from its token ids, each (sequence, layer) once; the
/// step declaring them notes them), judging only the step's new rows; where
/// a step holds layers n−1 and n, its `L{n}.hidden_in` is judged against its own
/// `L{n-1}.hidden_out`, or without one against the reference's output of layer n−1 on the step's
/// rows (after [`crate::model::dump::read`] divided out a declared `conventions.residual_scale`).
/// The model's identity has been checked by the caller
/// ([`crate::model::dump::check_identity`]).
///
/// The reference runs once per dumped layer ([`StepReferences::Union`]) over the union of the
/// steps that dump it: each sequence at its largest extent, its input gathered at the last of
/// those steps; each step takes its rows from it. A step whose input rows differ from the
/// union's (a sequence recomputed with other inputs) gets its own reference, and so does every
/// step of a DSA model: `idx_scores` [T, S] and `idx_topk` [T, min(top_k, S)] are as wide as
/// the batch's longest sequence S, and a GLM shared-indexer layer borrows its step's selection,
/// so a union's rows are not the step's. The union's trace is held once, one step's rows at a
/// time beside it; the step's full-batch rows (what context partials and the replays of a
/// diagnosis read) only where the step has context chunks or diverges. With
/// [`ReferenceDownload::Judged`] (`opts.download`) a step's rows hold only the stages judging
/// reads (`judged_stages`), and a GPU reference brings only those to the host; a step with a
/// site out of tolerance takes every stage (the whole reference downloaded then, once per
/// layer reference) for its diagnosis.
///
/// Tolerance rows, first that applies: `precision` (`compare --precision`), then `dtype`
/// (`compare --dtype`), then the header's `kernel_precision` (the rows `run --dtype` applies for
/// that dtype), then the header's `dtype`. With the header's `heads = [a, b]` the reference's
/// per-head sites ([`crate::model::dump::is_per_head`]) are sliced to heads `a..b` and the
/// layer is judged and diagnosed as a model of `b − a` heads.
///
/// Errors: a step that lacks `L{n}.hidden_in` for a layer it dumps (exit 2, naming step and
/// layer); a reference layer that cannot run; the loaded weights' errors (`weights --check`'s:
/// a tensor with an integer dtype or the wrong number of dims, a TP size that does not fit, a
/// layer of the weights whose identity hash differs or is missing); CUDA failures.
#[allow(
    clippy::too_many_lines,
    reason = "one pass over layers and their steps: the union reference, each step's rows of it or its own, the handover between layers, judging and diagnosis"
)]
pub fn compare_steps_with(
    file: &GgufFile,
    cfg: &MlaConfig,
    steps_dump: &StepsDump,
    map_name: Option<String>,
    dtype: Option<EngineDtype>,
    precision: Option<Dtype>,
    opts: &CompareOptions,
) -> Result<(RunReport, ReferenceTally)> {
    let header = &steps_dump.header;
    let backend = &opts.backend;
    let precision = steps_precision(steps_dump, dtype, precision);
    let dtype = dtype.unwrap_or(steps_dump.steps[0].1.dtype);
    let heads_cfg = header.heads.map(|hs| crate::model::dump::heads_config(cfg, hs));
    let judge_cfg = heads_cfg.as_ref().unwrap_or(cfg);
    // The reference records every rank's per-rank sites; the rank detectors read them when the
    // dump holds every rank's heads.
    let tp = engine_tp(steps_dump, cfg)?;
    let judge_tp = if header.heads.is_some() { 1 } else { tp };
    let loaded_weights = timing::stage("loaded weights", || {
        crate::jobs::weights_check::check_dump_weights(file, cfg, &steps_dump.path)
    })?;
    let mut conversions = Vec::new();
    let mut tensor_types = Vec::new();
    let layers = steps_layers(steps_dump);
    // The weight types reported: those of the first layer the first step with layers dumps.
    let types_layer = steps_dump
        .steps
        .iter()
        .find_map(|(_, d)| d.layers.keys().next().copied());
    let n_seq = header.steps[0].seqs.len();
    let stages_dumped = dumped_stages(steps_dump.steps.iter().flat_map(|(_, d)| d.layers.values()));
    for (spec, d) in &steps_dump.steps {
        conversions.extend(d.conversions.iter().map(|c| format!("{}: {c}", spec.name)));
    }
    // A union row's cached-or-fresh status depends on the step that reads it: an fp8 cache
    // needs each step's own reference.
    let union_ok = opts.references == StepReferences::Union && cfg.indexer.is_none() && header.kv_cache_quant.is_none();
    let quant = header.indexer_quant.as_ref().map(IndexerQuant::qk);
    if let Some(q) = &header.indexer_quant {
        conversions.push(format!("indexer_quant: {}", q.describe()));
    }
    let kv_cache = header
        .kv_cache_quant
        .as_ref()
        .map(crate::model::dump::KvCacheQuantDecl::quant);
    if let Some(k) = &kv_cache {
        conversions.push(format!(
            "kv_cache_quant: {}; decode rows' keys and prefill rows' cached context keys read it rounded",
            k.describe()
        ));
    }
    let act = header.act_quant.as_ref().map(crate::model::dump::ActQuantDecl::act);
    if let Some(a) = &act {
        conversions.push(format!(
            "act_quant: {}; kv_b on absorbed (decode) rows reads the latent unquantized",
            a.describe()
        ));
    }
    // Per DSA layer whose attention ran on the engine's selection: (the selection's layer, the
    // steps).
    let mut attended: std::collections::BTreeMap<usize, (usize, Vec<String>)> = std::collections::BTreeMap::new();
    let mut rows = ContextRows::new(steps_dump, file, cfg);
    let mut tally = ReferenceTally::default();
    let mut states: Vec<StepState> = steps_dump.steps.iter().map(|_| StepState::default()).collect();
    for &layer in &layers {
        let w = timing::stage("dequant", || backend.load_layer_weights(file, cfg, layer))?;
        let _release = ReleaseLayerWeights(backend);
        file.release_resident_pages();
        if types_layer == Some(layer) {
            tensor_types = w.types.clone();
        }
        // The steps that dump the layer, by the kind of reference each needs (with the MoE FFN
        // or without): one union per kind.
        let wants = |k: usize| {
            let d = &steps_dump.steps[k].1;
            d.layers
                .get(&layer)
                .map(|dumped| runs_ffn(cfg, layer, dumped, d.layers.contains_key(&(layer + 1))))
        };
        for full in [false, true] {
            let group: Vec<usize> = (0..steps_dump.steps.len())
                .filter(|&k| wants(k) == Some(full))
                .collect();
            if group.is_empty() {
                continue;
            }
            // What comes to the host before judging: the stages the group's judging reads; when
            // the steps are judged on the device, only what the context partials read there.
            let judged =
                (opts.download != ReferenceDownload::Whole).then(|| judged_stages(steps_dump, &group, layer, cfg));
            let fetched = match opts.download {
                ReferenceDownload::Device => judged.as_ref().map(|j| {
                    j.iter()
                        .copied()
                        .filter(|st| CONTEXT_PARTIAL_INPUTS.contains(st))
                        .collect::<Vec<_>>()
                }),
                _ => judged.clone(),
            };
            let (judged, fetched) = (judged.as_deref(), fetched.as_deref());
            let union = if union_ok && group.len() > 1 {
                UnionRef::build(
                    backend, file, cfg, &w, steps_dump, &mut rows, &group, layer, full, tp, fetched,
                )?
            } else {
                None
            };
            if union.is_some() {
                tally.union += 1;
            }
            for &k in &group {
                let (spec, d) = &steps_dump.steps[k];
                let dumped = &d.layers[&layer];
                let st = &mut states[k];
                let t_new = d.batch.n_tokens();
                let (live, full_batch, new_rows) = step_full_batch(spec, n_seq);
                let t_full = full_batch.n_tokens();
                let context: Vec<usize> = live.iter().map(|&i| spec.seqs[i].context).collect();
                let full_in = timing::stage("input", || rows.gather(k, &live, layer, t_full))?;
                // A DSA layer attends to the keys the engine's indexer kept where the dump holds
                // them: its attention is judged on its own inputs, its selection on its own.
                let attend = engine_keys(cfg, layer, dumped, &mut st.engine_sel, &new_rows, t_full);
                if let Some((_, from)) = &attend {
                    attended
                        .entry(layer)
                        .or_insert((*from, Vec::new()))
                        .1
                        .push(spec.name.clone());
                }
                let src = match union
                    .as_ref()
                    .and_then(|u| u.rows(spec, &live, &full_in).map(|r| (u, r)))
                {
                    Some((u, r)) => {
                        tally.union_steps += 1;
                        StepSource::Union(u, r)
                    }
                    None => {
                        tally.per_step += 1;
                        let fp8 = act.is_some() || kv_cache.is_some();
                        let absorbed = fp8.then(|| absorbed_rows(spec, &live));
                        let context = kv_cache.is_some().then(|| context_rows(spec, &live));
                        let dsa = DumpDsa {
                            quant: quant.as_ref(),
                            attend: attend.as_ref().map(|a| &a.0),
                            act: act.as_ref(),
                            absorbed: absorbed.as_deref(),
                            kv_cache: kv_cache.as_ref(),
                            context: context.as_deref(),
                        };
                        StepSource::Own(timing::stage("reference", || {
                            layer_reference(
                                backend,
                                file,
                                cfg,
                                &w,
                                &full_in,
                                &full_batch,
                                full,
                                tp,
                                fetched,
                                &mut st.prev_sel,
                                dsa,
                            )
                        })?)
                    }
                };
                drop(full_in);
                // The step's reference on its new rows, of the stages judging reads; its
                // reference over the full batch where the context partials read it (and below,
                // every stage of both for the replays of a diagnosis).
                let needs_full = !spec.context_seqs().is_empty() && cfg.indexer.is_none();
                let judged_tr = src.layer_ref().judged();
                // On the device: the host part of the step's reference is its rows of the sites
                // the GPU reference kept on the host; the device sites are gathered below.
                let on_device = (opts.download == ReferenceDownload::Device)
                    .then(|| src.layer_ref().split.as_ref())
                    .flatten();
                let (mut reference, mut full_rows) = timing::stage("step rows", || {
                    (
                        match on_device {
                            Some(split) => src.new_rows(&split.host, &new_rows, t_full, header.heads, cfg, None),
                            None => src.new_rows(judged_tr, &new_rows, t_full, header.heads, cfg, judged),
                        },
                        needs_full.then(|| src.full_rows(judged_tr, cfg, judged)).flatten(),
                    )
                });
                let (partials, chunks) = match src.full_trace(judged_tr, &full_rows) {
                    Some(f) => {
                        let cache = kv_cache.as_ref().map(|kv| ContextCache { kv, act: act.as_ref() });
                        step_context_partials(spec, &live, layer, cfg, f, header.heads, cache)
                    }
                    None => (Trace::new(), Vec::new()),
                };
                // The handover from layer n−1: this step's hidden_in against the engine's own
                // hidden_out of layer n−1 when dumped, else the reference's output of layer n−1.
                let handover_in = st
                    .prev
                    .as_ref()
                    .filter(|h| h.layer + 1 == layer)
                    .and_then(|h| h.dump_out.as_ref().or(h.ref_out.as_ref()))
                    .map(|e| TraceTensor::f64(vec![t_new, cfg.hidden], e.iter().copied().collect()));
                // Layer 0's input is the embedding: a step that dumps its token ids has its
                // hidden_in judged against embed(tokens), as format 1 judges its first layer's.
                let handover_in = match (handover_in, &d.tokens) {
                    (None, Some(tk)) if layer == 0 && tk.len() == t_new => {
                        let e = embed_hidden(file, cfg, tk)?;
                        Some(TraceTensor::f64(vec![t_new, cfg.hidden], e.iter().copied().collect()))
                    }
                    (h, _) => h,
                };
                let complete = |reference: &mut Trace| {
                    reference.extend(partials.clone());
                    if let Some(x) = &handover_in {
                        reference.record(Site::new(layer, Stage::HiddenIn), x.clone());
                    }
                };
                complete(&mut reference);
                let ref_out = src.hidden_out_rows(&new_rows, t_new, cfg.hidden);
                st.prev = Some(Handover::new(dumped, layer, t_new, cfg.hidden, ref_out)?);
                let mut sites: Vec<Site> = src.layer_ref().shapes().into_iter().map(|(s, _)| s).collect();
                sites.extend(reference.entries().iter().map(|(s, _)| *s));
                sites.sort_by_key(Site::order);
                sites.dedup();
                st.missing.add(&sites, dumped, &stages_dumped);
                let diffs = match on_device {
                    Some(split) => {
                        let dev = reference_device(backend)?;
                        let mut step = timing::stage("step rows", || {
                            src.device_rows(dev, split, dumped, &new_rows, t_full, header.heads, cfg)
                        })?;
                        // What the host part holds replaces the reference's own site, as
                        // `record` does on the host: the handover's hidden_in, the partials;
                        // beside the sites `device_rows` brought whole (weights).
                        step.device.retain(|d| reference.get(&d.site).is_none());
                        step.host.extend(std::mem::take(&mut reference));
                        let diffs = timing::stage("judge", || {
                            crate::judge::device::diff_host_candidate(dev, &step, dumped, precision)
                        })?;
                        reference = std::mem::take(&mut step.host);
                        diffs
                    }
                    None => timing::stage("judge", || metrics::diff(&reference, dumped, precision)),
                };
                let mut diffs = diffs;
                st.unjudged.extend(take_unjudged(&mut diffs, &format!("s{k}.")));
                let mut layer_findings = Vec::new();
                if metrics::first_divergence(&diffs).is_some() {
                    // A diagnosis reads every stage: the whole reference (downloaded once per
                    // layer reference), the step's rows of it.
                    let whole = match judged {
                        Some(_) => {
                            let whole = src.layer_ref().whole(backend)?;
                            reference = timing::stage("step rows", || {
                                src.new_rows(whole, &new_rows, t_full, header.heads, cfg, None)
                            });
                            complete(&mut reference);
                            full_rows = timing::stage("step rows", || src.full_rows(whole, cfg, None));
                            whole
                        }
                        None => {
                            if full_rows.is_none() {
                                full_rows = timing::stage("step rows", || src.full_rows(judged_tr, cfg, None));
                            }
                            judged_tr
                        }
                    };
                    let full_tr = src.full_trace(whole, &full_rows).unwrap_or(&reference);
                    let mut full_heads = None;
                    let scope = DumpScope {
                        dumped: &stages_dumped,
                        context: &context,
                        full_reference: full_step_reference(full_tr, header.heads, cfg, &context, &mut full_heads),
                        num_kv_splits: spec.num_kv_splits,
                        chunks: &chunks,
                        head_subset: header
                            .heads
                            .filter(|hs| header.tp.is_none() && hs[1] - hs[0] < cfg.n_head)
                            .map(|hs| (hs, cfg.n_head)),
                    };
                    let paged = dump_paged_step(steps_dump, k, &live, layer, cfg, full_tr, kv_cache);
                    layer_findings = timing::stage("diagnose", || {
                        diagnose_dumped_layer(
                            file,
                            judge_cfg,
                            &d.batch,
                            &reference,
                            dumped,
                            &diffs,
                            precision,
                            judge_tp,
                            scope,
                            paged.as_ref(),
                        )
                    });
                }
                if st.findings.is_empty() {
                    st.findings = layer_findings;
                }
                st.results.push(PathResult {
                    path: PathLabel::Dump,
                    layer,
                    diffs,
                    notes: rebuilt_note(spec)
                        .into_iter()
                        .chain(attend.as_ref().map(|(_, from)| attend_note(layer, *from)))
                        .collect(),
                    step: Some(spec.name.clone()),
                    not_run: None,
                });
            }
        }
    }
    let mut results = Vec::new();
    let mut findings = Vec::new();
    let mut not_dumped = Vec::new();
    let mut ignored = steps_dump.ignored.clone();
    // A weight is the same in every step: one that some step dumped is not missing from the
    // others (listing it would name, in a decode step, the very site a prefill finding is at).
    let weights_dumped: Vec<Site> = steps_dump
        .steps
        .iter()
        .flat_map(|(_, d)| d.layers.values())
        .flat_map(|tr| tr.entries().iter().map(|(s, _)| *s))
        .filter(|s| s.stage.is_weight())
        .collect();
    for ((k, (spec, d)), mut st) in steps_dump.steps.iter().enumerate().zip(states) {
        // The step's tensors that are no site (a misspelled stage, an unknown name), named as
        // in the file, then the sites the reference has no counterpart of.
        ignored.extend(d.ignored.iter().map(|n| format!("s{k}.{n}")));
        ignored.extend(std::mem::take(&mut st.unjudged));
        st.missing.first.retain(|s| !weights_dumped.contains(s));
        st.missing.rest.retain(|s| !weights_dumped.contains(s));
        results.extend(st.results);
        if findings.is_empty() {
            findings = st.findings;
        }
        not_dumped.extend(
            st.missing
                .labeled((steps_dump.steps.len() > 1).then_some(spec.name.as_str())),
        );
    }
    for (layer, (from, steps)) in attended {
        conversions.push(format!("{} (steps {})", attend_note(layer, from), steps.join(", ")));
    }
    let patches: Vec<String> = header
        .patches
        .iter()
        .map(|p| format!("`{}`: {}", p.name, p.reason))
        .collect();
    let engine = format!("{} {}", header.engine.name, header.engine.version)
        .trim()
        .to_string();
    let metadata = steps_metadata(header);
    let first = &steps_dump.steps[0].1;
    // The loaded weights' findings first, then the first diverging layer's.
    if let Some(w) = &loaded_weights {
        findings.splice(0..0, w.findings.iter().cloned());
    }
    let report = RunReport {
        model: ModelSummary::new(file, cfg, tensor_types),
        run: dump_run_record(first, layers, dtype, &engine),
        token_ids: first.tokens.clone(),
        results,
        findings,
        dump: Some(DumpSummary {
            path: steps_dump.path.display().to_string(),
            engine,
            map: map_name.or_else(|| first.map.clone()),
            metadata,
            conversions,
            patches,
            ignored,
            not_dumped,
            dtype,
            tolerance_rows: precision,
        }),
        loaded_weights,
    };
    Ok((report, tally))
}

/// Adds to a `mismatch` finding at the first layer's `hidden_in` (judged against
/// `embed(tokens)`, before any engine code ran) that the dump may come from another model, naming
/// `dump` and `gguf`, when that site differs grossly: rel_l2 or cos_diff at least
/// [`crate::judge::tolerance::WRONG_MODEL_BAND`].
fn wrong_model_hint(findings: &mut [Finding], results: &[PathResult], dump: &std::path::Path, gguf: &std::path::Path) {
    let band = crate::judge::tolerance::WRONG_MODEL_BAND.0;
    let Some(first) = results.first() else { return };
    let Some(d) = first.diffs.iter().find(|d| d.site.stage == Stage::HiddenIn) else {
        return;
    };
    let Some(m) = &d.metrics else { return };
    if !(m.rel_l2 >= band || m.cos_diff >= band || !m.rel_l2.is_finite()) {
        return;
    }
    for f in findings.iter_mut() {
        if f.class == crate::core::class::Class::Mismatch && f.site() == Some(d.site) {
            f.hint = format!(
                "this may be another model's dump: the first site {} is not embed(tokens) of {} \
                 (rel_l2 {}, cos_diff {}), before any engine code ran; check that {} was made from \
                 that GGUF (a format-1 dump does not name its model), then {}",
                d.site,
                gguf.display(),
                crate::core::sci::sci(m.rel_l2, 2),
                crate::core::sci::sci(m.cos_diff, 2),
                dump.display(),
                f.hint
            );
        }
    }
}

/// The layers any step of `steps_dump` holds, ascending, each once.
fn steps_layers(steps_dump: &StepsDump) -> Vec<usize> {
    let set: std::collections::BTreeSet<usize> = steps_dump
        .steps
        .iter()
        .flat_map(|(_, d)| d.layers.keys().copied())
        .collect();
    set.into_iter().collect()
}

/// The tolerance rows of a format-2 comparison, first that applies: `precision` (`compare
/// --precision`), `dtype` (`compare --dtype`), the header's `kernel_precision`, the header's
/// `dtype`.
/// With the header's `act_quant` or `kv_cache_quant`, their fp8 counterpart
/// ([`Precision::with_fp8`]).
fn steps_precision(steps_dump: &StepsDump, dtype: Option<EngineDtype>, precision: Option<Dtype>) -> Precision {
    let rows = match (precision, dtype, steps_dump.header.kernel_precision) {
        (Some(p), _, _) => Precision::from(p),
        (None, Some(d), _) => d.precision(),
        (None, None, Some(k)) => Precision::from(k),
        (None, None, None) => steps_dump.steps[0].1.dtype.precision(),
    };
    let h = &steps_dump.header;
    rows.with_fp8(h.act_quant.is_some() || h.kv_cache_quant.is_some())
}

/// What [`DumpScope::full_reference`] holds for a step: `None` when no sequence has cached
/// `context`; else the reference `full` over every row of the step's sequences (replays of a
/// decode step's attention read there the keys earlier steps cached), sliced to `heads` into
/// `holder` when the dump holds some heads only.
fn full_step_reference<'a>(
    full: &'a crate::core::trace::Trace,
    heads: Option<[usize; 2]>,
    cfg: &MlaConfig,
    context: &[usize],
    holder: &'a mut Option<crate::core::trace::Trace>,
) -> Option<&'a crate::core::trace::Trace> {
    if context.iter().all(|&c| c == 0) {
        return None;
    }
    let Some(hs) = heads else { return Some(full) };
    let mut tr = crate::core::trace::Trace::new();
    for (s, t) in full.entries() {
        tr.record(*s, take_heads(t, s.stage, cfg, hs));
    }
    Some(holder.insert(tr))
}

/// The engine's TP size a format-2 dump declares (`header.tp.size`; 1 without it).
///
/// Errors: [`Error::Input`] naming the dump and `header.tp.size` when it does not divide the
/// model's heads.
fn engine_tp(steps_dump: &StepsDump, cfg: &MlaConfig) -> Result<usize> {
    match &steps_dump.header.tp {
        Some(t) if !cfg.n_head.is_multiple_of(t.size) => Err(Error::input(
            &steps_dump.path,
            "field `header.tp.size`",
            format!("{} does not divide the model's {} heads", t.size, cfg.n_head),
        )),
        Some(t) => Ok(t.size),
        None => Ok(1),
    }
}

/// What step `k` of `sd` read through the engine's paged KV cache at `layer`, for the `paged-kv`
/// replays: the step's recorded page size and block-table rows of its sequences `live` (those
/// with new tokens), the latent rows (`kv_c_normed ‖ k_pe_roped`) of every position of those
/// sequences from the dump's steps `0..=k` (a step that did not dump one of them: the
/// reference's rows, from `full_ref`, the reference over the step's full batch), their writes in
/// step order at the recorded `slot_mapping` where there is one (positions the dump did not
/// record, `unrecorded`, first, at the slots the step's recorded block tables give, when it
/// recorded them), and per row of the step how it
/// read the cache as vLLM splits a batch: a decode row (a sequence whose new rows ran absorbed,
/// [`StepSeq::runs_absorbed`](crate::model::dump::StepSeq::runs_absorbed): one new token, or the
/// decode kernel as the step records it) reads every position through the cache, its own
/// included; a prefill row reads its sequence's cached context
/// through the cache and its new tokens directly. `cache_quant`: the cache's declared fp8 format
/// (`kv_cache_quant`). `None` when no row of the step reads the cache or the layer's latent
/// sites have other shapes.
fn dump_paged_step(
    sd: &StepsDump,
    k: usize,
    live: &[usize],
    layer: usize,
    cfg: &MlaConfig,
    full_ref: &Trace,
    cache_quant: Option<KvCacheQuant>,
) -> Option<PagedStep> {
    let (l, r) = (cfg.kv_lora_rank, cfg.qk_rope_head_dim);
    let spec = &sd.steps[k].0;
    let paging = sd.paging.get(k)?;
    let reads_cache = live
        .iter()
        .any(|&i| spec.seqs[i].context > 0 || spec.seqs[i].runs_absorbed());
    if !reads_cache {
        return None;
    }
    let lens: Vec<usize> = live.iter().map(|&i| spec.seqs[i].context + spec.seqs[i].new).collect();
    let t_full: usize = lens.iter().sum();
    let (kv_ref, kp_ref) = (
        full_ref.get(&Site::new(layer, Stage::KvCNormed))?,
        full_ref.get(&Site::new(layer, Stage::KPeRoped))?,
    );
    if kv_ref.len() != t_full * l || kp_ref.len() != t_full * r {
        return None;
    }
    let mut keys = Vec::with_capacity(t_full * (l + r));
    for row in 0..t_full {
        keys.extend((0..l).map(|d| kv_ref.get(row * l + d)));
        keys.extend((0..r).map(|d| kp_ref.get(row * r + d)));
    }
    let mut seqs = Vec::with_capacity(live.len());
    let mut off = 0;
    for &len in &lens {
        seqs.push(PagedSeq { key_off: off, len });
        off += len;
    }
    let mut writes = Vec::new();
    // The positions written before the dump's first step: at the slots the recorded block
    // tables give (without them, the replays infer the tables from the recorded slots alone).
    for (li, &i) in live.iter().enumerate().filter(|_| paging.block_table.is_some()) {
        if let Some(n) = sd.steps[..=k].iter().find_map(|(sj, _)| sj.seqs[i].unrecorded) {
            writes.extend((0..n.min(lens[li])).map(|pos| CacheWrite {
                seq: li,
                pos,
                slot: None,
            }));
        }
    }
    for ((sj, dj), pj) in sd.steps[..=k].iter().zip(&sd.paging) {
        let trace = dj.layers.get(&layer);
        let own = |st: Stage| {
            trace
                .and_then(|t| t.get(&Site::new(layer, st)))
                .filter(|t| t.len() == dj.batch.n_tokens() * if st == Stage::KvCNormed { l } else { r })
        };
        let (kv, kp) = (own(Stage::KvCNormed), own(Stage::KPeRoped));
        let mut step_row = 0;
        for (i, q) in sj.seqs.iter().enumerate() {
            let li = live.iter().position(|&x| x == i);
            for n in 0..q.new {
                let pos = q.context + n;
                if let Some(li) = li.filter(|&li| pos < lens[li]) {
                    let key = (seqs[li].key_off + pos) * (l + r);
                    if let Some(kv) = kv {
                        (0..l).for_each(|d| keys[key + d] = kv.get(step_row * l + d));
                    }
                    if let Some(kp) = kp {
                        (0..r).for_each(|d| keys[key + l + d] = kp.get(step_row * r + d));
                    }
                    writes.push(CacheWrite {
                        seq: li,
                        pos,
                        slot: pj.slot_mapping.as_ref().and_then(|sm| sm.get(step_row).copied()),
                    });
                }
                step_row += 1;
            }
        }
    }
    let queries = live
        .iter()
        .enumerate()
        .flat_map(|(li, &i)| {
            let q = spec.seqs[i].clone();
            (0..q.new).map(move |n| {
                let pos = q.context + n;
                PagedQuery {
                    seq: li,
                    cached: if q.runs_absorbed() { pos + 1 } else { q.context },
                    upto: pos + 1,
                }
            })
        })
        .collect();
    Some(PagedStep {
        page_size: paging.page_size,
        block_tables: paging
            .block_table
            .as_ref()
            .map(|bt| live.iter().filter_map(|&i| bt.get(i).cloned()).collect()),
        pad_block: None,
        seqs,
        writes,
        queries,
        keys: Some(keys),
        zero_filled: false,
        cache_quant,
    })
}

/// A step's full batch: `live`, the sequences of `n_seq` with new tokens in the step; the batch
/// of those sequences whole (context and new tokens, each from position 0); and the rows of the
/// step's new tokens within it.
fn step_full_batch(spec: &crate::model::dump::StepSpec, n_seq: usize) -> (Vec<usize>, Batch, Vec<usize>) {
    let live: Vec<usize> = (0..n_seq).filter(|&i| spec.seqs[i].new > 0).collect();
    let full = Batch {
        seqs: live
            .iter()
            .map(|&i| SeqSpec {
                len: spec.seqs[i].context + spec.seqs[i].new,
                start_pos: 0,
            })
            .collect(),
    };
    let mut new_rows = Vec::new();
    let mut off = 0;
    for &i in &live {
        let q = &spec.seqs[i];
        new_rows.extend(off + q.context..off + q.context + q.new);
        off += q.context + q.new;
    }
    (live, full, new_rows)
}

/// The reference partials of step `spec`'s MHA prefill over cached context at `layer`
/// ([`context_partials`]), on the rows of the sequences listing `context_chunks`
/// ([`StepSpec::context_seqs`](crate::model::dump::StepSpec::context_seqs)) and over the chunks
/// they list, with `heads = [a, b]` sliced to heads `a..b`; `full` is the reference over the
/// step's full batch of the sequences `live`; `cache`: the fp8 latent cache the chunks read
/// their keys back from. Also returns those sequences as the detectors
/// read them. Empty when no sequence of the step lists chunks, or for a DSA model, whose
/// attention reads the indexer's keys, not the context chunks'.
fn step_context_partials(
    spec: &crate::model::dump::StepSpec,
    live: &[usize],
    layer: usize,
    cfg: &MlaConfig,
    full: &Trace,
    heads: Option<[usize; 2]>,
    cache: Option<ContextCache<'_>>,
) -> (Trace, Vec<ContextSeq>) {
    let ctx = spec.context_seqs();
    if ctx.is_empty() || cfg.indexer.is_some() {
        return (Trace::new(), Vec::new());
    }
    let mut seqs = Vec::with_capacity(ctx.len());
    let (mut off, mut row) = (0, 0);
    for &i in live {
        let q = &spec.seqs[i];
        if ctx.contains(&i) {
            seqs.push(ContextSeq {
                seq: i,
                off,
                row,
                context: q.context,
                new: q.new,
                chunks: q.context_chunks.clone().unwrap_or_default(),
            });
        }
        off += q.context + q.new;
        row += q.new;
    }
    let mut out = Trace::new();
    for (s, t) in context_partials(cfg, full, layer, &seqs, cache)
        .unwrap_or_default()
        .entries()
    {
        let t = match heads {
            Some(hs) => take_heads(t, s.stage, cfg, hs),
            None => t.clone(),
        };
        out.record(*s, t);
    }
    (out, seqs)
}

/// The layer inputs a format-2 step's reference runs from: each sequence's `hidden_in` rows as
/// the dump's steps hold them, a prefix-cache hit's from the sequence it names, and the
/// positions the dump did not record (`unrecorded`) rebuilt from the sequence's token ids, each
/// (sequence, layer) computed once however many steps attend to it.
struct ContextRows<'a> {
    sd: &'a StepsDump,
    file: &'a GgufFile,
    cfg: &'a MlaConfig,
    /// `(sequence, layer)` → the rebuilt `hidden_in` [n, H] f64 of its unrecorded positions.
    rebuilt: std::collections::HashMap<(usize, usize), Array2<f64>>,
    /// Per sequence, the highest layer rebuilt so far and the DSA selection carried to it, from
    /// which a later layer continues.
    frontier: std::collections::HashMap<usize, (usize, Option<Selection>)>,
}

impl<'a> ContextRows<'a> {
    fn new(sd: &'a StepsDump, file: &'a GgufFile, cfg: &'a MlaConfig) -> Self {
        ContextRows {
            sd,
            file,
            cfg,
            rebuilt: std::collections::HashMap::new(),
            frontier: std::collections::HashMap::new(),
        }
    }

    /// `hidden_in` [T_full, H] of `layer` for the full sequences `live` of step `k` (each from
    /// position 0), gathered from the new rows of steps `0..=k` in sequence order; the positions
    /// of a prefix-cache hit (`prefix`) from the sequence it names, unrecorded ones rebuilt
    /// ([`ContextRows::seq`]).
    ///
    /// Errors: [`Error::Input`] naming a step `0..=k` that lacks `L{layer}.hidden_in` for a
    /// sequence that step `k` attends to; a rebuild's errors ([`ContextRows::unrecorded`]).
    fn gather(&mut self, k: usize, live: &[usize], layer: usize, t_full: usize) -> Result<Array2<f64>> {
        let mut full_in = Array2::<f64>::zeros((t_full, self.cfg.hidden));
        let mut row = 0;
        for &i in live {
            for x in self.seq(k, k + 1, i, layer)? {
                if row < t_full {
                    full_in.row_mut(row).assign(&x);
                }
                row += 1;
            }
        }
        Ok(full_in)
    }

    /// The `hidden_in` rows of `layer` of sequence `i` that steps `0..end` hold, position after
    /// position: where a step declares `unrecorded = n` for `i`, first its positions `0..n`
    /// rebuilt from its token ids ([`ContextRows::unrecorded`]); where a step before `end`
    /// declares a prefix-cache hit `{seq: j, len: n}`, first sequence `j`'s positions `0..n` as
    /// steps before that one hold them (recursively: the header's checks make each hop go to an
    /// earlier step); then `i`'s own new rows, step after step. `k` is the judged step, for
    /// errors.
    ///
    /// Errors: [`Error::Input`] naming a step that lacks `L{layer}.hidden_in` for a sequence the
    /// judged step attends to; a rebuild's errors.
    fn seq(&mut self, k: usize, end: usize, i: usize, layer: usize) -> Result<Vec<ndarray::Array1<f64>>> {
        let sd = self.sd;
        let hidden = self.cfg.hidden;
        let spec = &sd.steps[k].0;
        let mut out = Vec::new();
        // Unrecorded positions were cached before the dump's first step, whichever step
        // declares them (a prefix-cache hit may read them in that very step).
        if let Some(n) = sd.steps.iter().find_map(|(sj, _)| sj.seqs[i].unrecorded) {
            out.extend(self.unrecorded(i, n, layer)?.rows().into_iter().map(|r| r.to_owned()));
        }
        let hit = sd.steps[..end]
            .iter()
            .enumerate()
            .find_map(|(k0, (sj, _))| sj.seqs[i].prefix.map(|h| (k0, h)));
        if let Some((k0, h)) = hit {
            let mut src = self.seq(k, k0, h.seq, layer)?;
            src.truncate(h.len);
            out.extend(src);
        }
        for (j, (sj, dj)) in sd.steps[..end].iter().enumerate() {
            let nj = sj.seqs[i].new;
            if nj == 0 {
                continue;
            }
            let x = dj
                .layers
                .get(&layer)
                .and_then(|t| t.get(&Site::new(layer, Stage::HiddenIn)))
                .ok_or_else(|| {
                    Error::input(
                        &sd.path,
                        format!("step {j} `{}`", sj.name),
                        format!(
                            "no L{layer}.hidden_in, which step {k} `{}` attends to: a format-2 dump needs every step's hidden_in of each layer it judges",
                            spec.name
                        ),
                    )
                })?;
            let t_j = dj.batch.n_tokens();
            let a = to_array(x, t_j, hidden)?;
            let start: usize = (0..i).map(|p| sj.seqs[p].new).sum();
            for r in 0..nj {
                out.push(a.row(start + r).to_owned());
            }
        }
        Ok(out)
    }

    /// `hidden_in` [n, H] f64 of `layer` at sequence `i`'s unrecorded positions `0..n`, rebuilt
    /// from its token ids `[..n]` as one sequence from position 0: the embedding at layer 0, the
    /// reference forward of layers `0..layer` whole after it ([`token_derived_input`]'s steps).
    /// Each (sequence, layer) is computed once; a higher layer continues from the highest one
    /// computed.
    ///
    /// Errors: [`Error::Input`] naming `seq{i}.token_ids` when the dump holds fewer than `n` ids
    /// of the sequence (the reader refuses such a dump first); a layer that cannot run.
    fn unrecorded(&mut self, i: usize, n: usize, layer: usize) -> Result<&Array2<f64>> {
        if !self.rebuilt.contains_key(&(i, layer)) {
            let ids = self.sd.token_ids.get(&i).and_then(|ids| ids.get(..n)).ok_or_else(|| {
                Error::input(
                    &self.sd.path,
                    format!("seq{i}.token_ids"),
                    format!("holds fewer than the {n} ids of the unrecorded positions it rebuilds"),
                )
            })?;
            let batch = Batch {
                seqs: vec![SeqSpec { len: n, start_pos: 0 }],
            };
            let resume = self
                .frontier
                .get(&i)
                .filter(|(m, _)| *m <= layer)
                .and_then(|(m, sel)| Some((*m, self.rebuilt.get(&(i, *m))?.clone(), sel.clone())));
            let (mut at, mut h, mut sel) = match resume {
                Some(r) => r,
                None => (0, embed_hidden(self.file, self.cfg, ids)?, None),
            };
            while at < layer {
                let quant = self.sd.header.indexer_quant.as_ref().map(IndexerQuant::qk);
                let act = self
                    .sd
                    .header
                    .act_quant
                    .as_ref()
                    .map(crate::model::dump::ActQuantDecl::act);
                let fp8 = act.map(|act| Fp8Compute {
                    act: Some(act),
                    kv_cache: None,
                    tp: 1,
                    absorbed: None,
                    context: None,
                });
                h = next_layer_input(
                    self.file,
                    self.cfg,
                    &h,
                    &batch,
                    at,
                    &mut sel,
                    quant.as_ref(),
                    fp8.as_ref(),
                )?;
                at += 1;
            }
            self.frontier.insert(i, (layer, sel));
            self.rebuilt.insert((i, layer), h);
        }
        self.rebuilt
            .get(&(i, layer))
            .ok_or_else(|| Error::Internal("rebuilt context rows not kept".into()))
    }
}

/// The keys the engine's attention read at `layer` of a step of a DSA model, over the step's
/// full batch (`t_full` rows, the new ones at `new_rows`): at a full indexer layer the dump's
/// own `idx_topk` of the layer (`dumped`), at a GLM shared layer that of the latest full layer
/// before it (`carried`, kept here: the engine's shared layers read that layer's top-k
/// buffer). Returns them with the layer whose selection they are; `None` for a model without an
/// indexer, or where the dump holds no such `idx_topk` (the attention then runs on the
/// reference's own selection).
fn engine_keys(
    cfg: &MlaConfig,
    layer: usize,
    dumped: &Trace,
    carried: &mut Option<(usize, Vec<Vec<usize>>)>,
    new_rows: &[usize],
    t_full: usize,
) -> Option<(AttendKeys, usize)> {
    let ix = cfg.indexer.as_ref()?;
    let is_full = |j: usize| ix.full.get(j).copied().unwrap_or(true);
    if is_full(layer) {
        *carried = dumped.get(&Site::new(layer, Stage::IdxTopk)).map(|t| {
            let k = t.shape.last().copied().unwrap_or(0);
            (layer, crate::compute::indexer::topk_sets(&t.to_f64(), k))
        });
    } else if (0..layer).rev().find(|&j| is_full(j)) != carried.as_ref().map(|c| c.0) {
        return None;
    }
    let (from, sets) = carried.as_ref()?;
    if sets.len() != new_rows.len() {
        return None;
    }
    let mut rows = vec![None; t_full];
    for (&r, keys) in new_rows.iter().zip(sets) {
        if let Some(slot) = rows.get_mut(r) {
            *slot = Some(keys.clone());
        }
    }
    Some((AttendKeys { rows }, *from))
}

/// The note on a DSA layer's step results when its attention ran on the engine's selection
/// ([`engine_keys`]; `from` the layer whose `idx_topk` it is).
fn attend_note(layer: usize, from: usize) -> String {
    let whose = if from == layer {
        format!("L{layer}.idx_topk")
    } else {
        format!("L{from}.idx_topk, which the shared layer L{layer} reads")
    };
    format!(
        "L{layer}: attention judged on the engine's selection ({whose}, as dumped); idx_topk judged against the reference's own selection"
    )
}

/// The note on step `spec`'s results when its sequences declare `unrecorded` positions:
/// `context rebuilt from token ids: seq 0 positions 0..n, … (not judged)`. Said on the step that
/// declares them: later steps attend to them too, but none judges them.
fn rebuilt_note(spec: &crate::model::dump::StepSpec) -> Option<String> {
    rebuilt_line(std::iter::once(spec)).map(|l| format!("context rebuilt from token ids: {l} (not judged)"))
}

/// The unrecorded positions of the sequences of the steps `seqs` that declare them: `seq {i}
/// positions 0..{n}`, comma-separated, in header order; `None` when none does.
fn rebuilt_line<'s>(seqs: impl Iterator<Item = &'s crate::model::dump::StepSpec>) -> Option<String> {
    let mut parts = Vec::new();
    for spec in seqs {
        for (i, q) in spec.seqs.iter().enumerate() {
            if let Some(n) = q.unrecorded {
                parts.push((i, format!("seq {i} positions 0..{n}")));
            }
        }
    }
    parts.sort_by_key(|p| p.0);
    (!parts.is_empty()).then(|| parts.into_iter().map(|p| p.1).collect::<Vec<_>>().join(", "))
}

/// The `metadata` a format-2 comparison reports: format, model, hook, the engine's attention
/// and prefill backends, the step names, `kernel_precision`, `heads`, the TP size and rank
/// (`tp_size`, `tp_rank`) and the positions rebuilt from token ids (`context_rebuilt`,
/// [`rebuilt_line`]) when the header has them.
fn steps_metadata(h: &crate::model::dump::DumpHeader) -> std::collections::BTreeMap<String, String> {
    let mut metadata = std::collections::BTreeMap::new();
    metadata.insert("format".to_string(), crate::model::dump::FORMAT2.to_string());
    metadata.insert("model".to_string(), h.model.file.clone());
    metadata.insert(
        "hook".to_string(),
        format!("{} {}", h.hook.name, h.hook.version).trim().to_string(),
    );
    if let Some(b) = &h.engine.attention_backend {
        metadata.insert("attention_backend".to_string(), b.clone());
    }
    if let Some(b) = &h.engine.prefill_backend {
        metadata.insert("prefill_backend".to_string(), b.clone());
    }
    let steps: Vec<String> = h.steps.iter().map(|s| s.name.clone()).collect();
    metadata.insert("steps".to_string(), steps.join(","));
    if let Some(l) = rebuilt_line(h.steps.iter()) {
        metadata.insert("context_rebuilt".to_string(), l);
    }
    if let Some(k) = h.kernel_precision {
        metadata.insert("kernel_precision".to_string(), k.to_string());
    }
    if let Some([a, b]) = h.heads {
        metadata.insert("heads".to_string(), format!("{a},{b}"));
    }
    if let Some(tp) = &h.tp {
        metadata.insert("tp_size".to_string(), tp.size.to_string());
        if let Some(r) = tp.rank {
            metadata.insert("tp_rank".to_string(), r.to_string());
        }
    }
    metadata
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A step of two sequences, `(context, new)` each, from the header's JSON.
    fn step(seqs: [(usize, usize); 2]) -> crate::model::dump::StepSpec {
        let seqs: Vec<serde_json::Value> = seqs
            .iter()
            .map(|&(context, new)| serde_json::json!({"context": context, "new": new}))
            .collect();
        serde_json::from_value(serde_json::json!({"name": "s", "seqs": seqs})).unwrap()
    }

    /// A union of sequence 0 (5 rows) and sequence 1 (3 rows), width 2, row r holding r + 0.5.
    fn union() -> UnionRef {
        UnionRef {
            r: LayerRef {
                out: RefOutput {
                    trace: Trace::new(),
                    hidden_out: None,
                    moe_nonfinite: Vec::new(),
                    selection: None,
                },
                split: None,
                whole_trace: std::cell::OnceCell::new(),
            },
            input: Array2::from_shape_fn((8, 2), |(r, c)| r as f64 + 0.5 + c as f64 * 100.0),
            off: vec![Some(0), Some(5)],
            extent: vec![5, 3],
            t: 8,
        }
    }

    #[test]
    fn a_step_takes_its_rows_of_the_union_only_where_its_input_is_the_unions() {
        let u = union();
        // Sequence 0 at positions 0..4 (3 cached, 1 new), sequence 1 at 0..3 (all new).
        let spec = step([(3, 1), (0, 3)]);
        let rows_of = |rows: &[usize]| Array2::from_shape_fn((rows.len(), 2), |(r, c)| u.input[[rows[r], c]]);
        let input = rows_of(&[0, 1, 2, 3, 5, 6, 7]);
        let r = u.rows(&spec, &[0, 1], &input).expect("the union serves the step");
        assert_eq!(r.full, [0, 1, 2, 3, 5, 6, 7]);
        assert_eq!(r.new, [3, 5, 6, 7]);
        // A sequence recomputed with another input at one position: its own reference.
        let mut other = input.clone();
        other[[2, 1]] += 1e-9;
        assert!(u.rows(&spec, &[0, 1], &other).is_none());
        // A sequence longer than the union holds it, or one the union lacks.
        assert!(
            u.rows(&step([(3, 3), (0, 3)]), &[0, 1], &rows_of(&[0, 1, 2, 3, 4, 4, 5, 6, 7]))
                .is_none()
        );
        let mut lacking = union();
        lacking.off[1] = None;
        assert!(lacking.rows(&spec, &[0, 1], &input).is_none());
    }

    /// The committed chunked-prefill dump of vLLM's real code on the CPU harness (steps 1–7 list
    /// context chunks, steps 0, 8 and 9 do not), each step's layer 0 cut to the stages `keep`.
    fn chunked_dump(keep: &[Stage]) -> (MlaConfig, StepsDump) {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let file = GgufFile::open(root.join("golden/models/legacy-kvb-f32.gguf")).unwrap();
        let cfg = MlaConfig::from_gguf(&file).unwrap();
        let path = root.join("golden/dumps/live-cpu/legacy-kvb-f32.chunked.safetensors");
        let Ok(crate::model::dump::DumpFile::Steps(mut sd)) = crate::model::dump::read(&path, None, &cfg) else {
            panic!("{}: not a format-2 dump", path.display());
        };
        for (_, d) in &mut sd.steps {
            for tr in d.layers.values_mut() {
                let mut cut = Trace::new();
                for (s, t) in tr.entries().iter().filter(|(s, _)| keep.contains(&s.stage)) {
                    cut.record(*s, t.clone());
                }
                *tr = cut;
            }
        }
        (cfg, *sd)
    }

    #[test]
    fn judging_reads_the_dumped_stages_and_what_the_context_partials_and_ties_need() {
        use Stage::*;
        let (cfg, mut sd) = chunked_dump(&[HiddenIn, AttnOut, CtxOut, HiddenOut]);
        let with_context: Vec<usize> = (0..sd.steps.len())
            .filter(|&k| !sd.steps[k].0.context_seqs().is_empty())
            .collect();
        assert_eq!(with_context, [1, 2, 3, 4, 5, 6, 7]);
        // Steps without context chunks: the dumped stages, in data-flow order.
        assert_eq!(judged_stages(&sd, &[0, 8, 9], 0, &cfg), [HiddenIn, AttnOut, HiddenOut]);
        // A step with context chunks: also the queries, keys and values the partials are
        // computed from (and the dumped ctx_out).
        let partial_inputs = [HiddenIn, Q, KPeRoped, QPeRoped, KNope, V, AttnOut, CtxOut, HiddenOut];
        let mut want = partial_inputs.to_vec();
        want.sort_by_key(Stage::order);
        assert_eq!(judged_stages(&sd, &[0, 3], 0, &cfg), want);
        assert_eq!(judged_stages(&sd, &(0..10).collect::<Vec<_>>(), 0, &cfg), want);
        // Another layer than the dumped one reads nothing.
        assert!(judged_stages(&sd, &[0, 3], 1, &cfg).is_empty());
        // A dumped selection: its scores too (ties are accepted on them).
        let t0 = sd.steps[0].1.batch.n_tokens();
        sd.steps[8].1.layers.get_mut(&0).unwrap().record(
            Site::new(0, IdxTopk),
            TraceTensor::f64(vec![t0, 1], (0..t0).map(|x| x as f64).collect()),
        );
        let got = judged_stages(&sd, &[0, 8], 0, &cfg);
        let mut want = vec![HiddenIn, AttnOut, HiddenOut, IdxTopk, IdxScores];
        want.sort_by_key(Stage::order);
        assert_eq!(got, want);
    }

    #[test]
    fn a_step_reference_holds_only_the_judged_stages_until_asked_for_every_stage() {
        use Stage::*;
        let (cfg, sd) = chunked_dump(&[HiddenIn, AttnOut]);
        let file =
            GgufFile::open(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("golden/models/legacy-kvb-f32.gguf"))
                .unwrap();
        let w = LayerWeights::load(&file, &cfg, 0).unwrap();
        let backend = CompareOptions::default().backend;
        let group: Vec<usize> = (0..sd.steps.len()).collect();
        let judged = judged_stages(&sd, &group, 0, &cfg);
        let mut ctx_rows = ContextRows::new(&sd, &file, &cfg);
        let u = UnionRef::build(
            &backend,
            &file,
            &cfg,
            &w,
            &sd,
            &mut ctx_rows,
            &group,
            0,
            false,
            1,
            Some(&judged),
        )
        .unwrap()
        .expect("the union serves the chunked steps");
        // The CPU reference is on the host whole: nothing to download, the same trace.
        assert!(u.r.split.is_none());
        assert!(std::ptr::eq(u.r.judged(), u.r.whole(&backend).unwrap()));
        let all: Vec<Stage> = u.r.judged().entries().iter().map(|(s, _)| s.stage).collect();
        assert!(all.contains(&WKvB) && all.contains(&AttnLatent), "{all:?}");
        // A step's rows: the judged stages only, each site's rows those of the full selection.
        let (spec, _) = &sd.steps[3];
        let (live, full_batch, _) = step_full_batch(spec, spec.seqs.len());
        let full_in = ctx_rows.gather(3, &live, 0, full_batch.n_tokens()).unwrap();
        let rows = u.rows(spec, &live, &full_in).expect("step 3's rows");
        let some = select_rows(u.r.judged(), &rows.new, u.t, None, &cfg, Some(&judged));
        let every = select_rows(u.r.judged(), &rows.new, u.t, None, &cfg, None);
        let stages: Vec<Stage> = some.entries().iter().map(|(s, _)| s.stage).collect();
        let mut sorted = stages.clone();
        sorted.sort_by_key(Stage::order);
        assert_eq!(sorted, judged);
        for (s, t) in some.entries() {
            assert_eq!(every.get(s), Some(t), "{s}");
        }
        assert_eq!(every.entries().len(), all.len());
    }

    #[test]
    fn selected_rows_keep_weights_whole_and_pick_each_token_row() {
        let mut tr = Trace::new();
        let lse: Vec<f64> = (0..8 * 3).map(|x| x as f64).collect();
        tr.record(Site::new(0, Stage::Lse), TraceTensor::f64(vec![8, 3], lse));
        // A weight with as many rows as the union has tokens stays whole.
        let kv_b: Vec<f64> = (0..8 * 2).map(|x| -(x as f64)).collect();
        tr.record(Site::new(0, Stage::WKvB), TraceTensor::f64(vec![8, 2], kv_b.clone()));
        let cfg = MlaConfig::from_gguf(&crate::model::fixture::open_model(None).unwrap()).unwrap();
        let s = select_rows(&tr, &[6, 1], 8, None, &cfg, None);
        let lse = s.get(&Site::new(0, Stage::Lse)).unwrap();
        assert_eq!(lse.shape, [2, 3]);
        assert_eq!(lse.to_f64(), [18.0, 19.0, 20.0, 3.0, 4.0, 5.0]);
        let w = s.get(&Site::new(0, Stage::WKvB)).unwrap();
        assert_eq!((w.shape.clone(), w.to_f64()), (vec![8, 2], kv_b));
    }
}
