//! The main job: run the reference and the engine paths on the same layer inputs and diff them.
//!
//! This module ties the data flow of docs/design.md together for `mla-diff run` (and for golden
//! checks and selftest): it builds each requested layer's input (seeded random hidden states, or
//! token ids pushed through the embedding and the reference forward of the preceding layers),
//! runs the reference and every requested path on it, collects the per-site comparisons, and
//! hands each layer's traces to [`crate::judge::diagnose`] for the findings.

use ndarray::Array2;

use crate::backend::Backend;
use crate::backend::cuda::compare::SplitTrace;
use crate::compute::engine::same_for_every_path;
use crate::compute::indexer::Selection;
use crate::compute::path::{LayerInput, PathKind, PathRun};
use crate::compute::reference::{self, Fp8Compute};
use crate::core::batch::{Batch, SplitMix64, normal_f32};
use crate::core::error::{Error, Result};
use crate::core::timing;
use crate::core::trace::{Site, Stage, Trace};
use crate::judge::diagnose::{self, DiagnoseInput, Finding, PathEvidence};
use crate::judge::report::{InputMode, ModelSummary, NotRun, PathResult, RunConfig, RunRecord, RunReport};
use crate::judge::{device, metrics};
use crate::model::config::MlaConfig;
use crate::model::gguf::GgufFile;
use crate::model::tensors::ModelTensor;
use crate::model::weights::{Dequantized, LayerWeights, NonFiniteTensor, embed_hidden};

/// Frees what [`Backend::load_layer_weights`] kept on the device when a layer is done, and on
/// an early return with an error, so that no later layer (or later run in the same process)
/// reads another layer's or file's tensors.
struct ReleaseLayerWeights<'a>(&'a Backend);

impl Drop for ReleaseLayerWeights<'_> {
    fn drop(&mut self) {
        self.0.release_layer_weights();
    }
}

/// Seed of layer `layer`'s random input.
pub(crate) fn layer_seed(seed: u64, layer: usize) -> u64 {
    seed ^ (layer as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// Seeded token ids in `0..vocab`.
pub fn seeded_tokens(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    let mut r = SplitMix64::new(seed ^ 0x70C3_E115);
    (0..n).map(|_| r.below(vocab.max(1)) as u32).collect()
}

/// Per path whose attention runs absorbed on some tokens, the fp8 reference those tokens need
/// (`mqa`: every token; `mixed`: its decode rows, the last token of each of the first ⌈S/2⌉
/// sequences): their keys expanded from the unquantized latent ([`Fp8Compute`]); with an fp8
/// cache, `chunked` too (its new tokens read their context back from the cache, rounded). Empty
/// without fp8; `mha` is judged by the layer's reference.
///
/// Errors: the reference's own.
#[allow(
    clippy::too_many_arguments,
    reason = "the backend, the model (file, cfg, w), the layer's input and run configuration, and how the layer's own reference ran (tp, the borrowed selection, with its FFN or not)"
)]
pub(crate) fn absorbed_references(
    backend: &Backend,
    file: &GgufFile,
    cfg: &MlaConfig,
    w: &LayerWeights,
    hidden: &Array2<f64>,
    rc: &RunConfig,
    tp: usize,
    shared: Option<&Selection>,
    full: bool,
) -> Result<Vec<(PathKind, Trace)>> {
    let (act, kv_cache) = (rc.path_options.fp8, rc.path_options.kv_cache);
    if act.is_none() && kv_cache.is_none() {
        return Ok(Vec::new());
    }
    let batch = &rc.batch;
    let t = batch.n_tokens();
    let offsets = batch.offsets();
    let mut out = Vec::new();
    for &kind in &rc.paths {
        // (absorbed tokens, context tokens) of the path's batch.
        let (absorbed, context): (Option<Vec<bool>>, Option<Vec<bool>>) = match kind {
            PathKind::Mqa => (Some(vec![true; t]), None),
            PathKind::Mixed => {
                let mut m = vec![false; t];
                for si in 0..crate::compute::engine::mixed_decode_seqs(batch).min(batch.seqs.len()) {
                    if let Some(r) = (offsets[si] + batch.seqs[si].len).checked_sub(1) {
                        m[r] = true;
                    }
                }
                (Some(m), None)
            }
            // The chunked path's new tokens read their context from the cache.
            PathKind::Chunked if kv_cache.is_some() => {
                let mut m = vec![false; t];
                let split = crate::compute::engine::chunked_split(batch, rc.path_options.new_tokens);
                for (&(c, _), &off) in split.iter().zip(&offsets) {
                    m[off..off + c].iter_mut().for_each(|x| *x = true);
                }
                (None, Some(m))
            }
            PathKind::Mha | PathKind::Chunked => continue,
        };
        let fp8 = Fp8Compute {
            act,
            kv_cache,
            tp,
            absorbed: absorbed.as_deref(),
            context: context.as_deref(),
        };
        let inputs = crate::compute::reference::RefInputs {
            shared,
            fp8: Some(&fp8),
            ..Default::default()
        };
        let (r, _) = timing::stage("reference", || {
            backend.reference(file, cfg, w, hidden, batch, tp, &inputs, full, false)
        })?;
        out.push((kind, r.trace));
    }
    Ok(out)
}

/// Diagnoses each path against the reference it was judged by: the paths that share `base`'s
/// reference together (their disagreement is evidence), each path with an fp8 reference of its
/// own (`own`, [`absorbed_references`]) on its own. Findings in the order of `runs`.
fn diagnose_paths(
    base: &DiagnoseInput<'_>,
    runs: &[PathRun],
    diffs: &[Vec<metrics::SiteDiff>],
    own: &[(PathKind, Trace)],
) -> Vec<Finding> {
    let mut groups: Vec<(&Trace, Vec<PathEvidence<'_>>)> = Vec::new();
    for (pr, d) in runs.iter().zip(diffs) {
        let ev = PathEvidence {
            kind: pr.kind.into(),
            trace: &pr.trace,
            diffs: d,
            empty_partial_rows: &pr.empty_partial_rows,
            unservable: pr.unservable.as_ref(),
            paged: pr.paged.as_ref(),
        };
        match own.iter().find(|(k, _)| *k == pr.kind) {
            Some((_, t)) => groups.push((t, vec![ev])),
            None => match groups.iter_mut().find(|(t, _)| std::ptr::eq(*t, base.reference)) {
                Some((_, g)) => g.push(ev),
                None => groups.push((base.reference, vec![ev])),
            },
        }
    }
    let mut found: Vec<Finding> = groups
        .into_iter()
        .flat_map(|(reference, paths)| {
            diagnose::diagnose(&DiagnoseInput {
                reference,
                paths,
                ..base.clone()
            })
        })
        .collect();
    found.sort_by_key(|f| runs.iter().position(|r| f.path() == Some(r.kind.into())));
    found
}

/// What one layer of a run computes on: its input rows, the TP size, the selection a GLM shared
/// layer borrows, and whether the layer runs whole (its MoE FFN included).
struct LayerRun<'a> {
    hidden: &'a Array2<f64>,
    tp: usize,
    shared: Option<&'a Selection>,
    full: bool,
}

/// The reference of one layer of a run ([`Backend::reference`]), with the run's fp8 compute
/// (every token expanded; [`absorbed_references`] has the others).
///
/// Errors: the reference's own.
fn layer_reference(
    backend: &Backend,
    file: &GgufFile,
    cfg: &MlaConfig,
    w: &LayerWeights,
    rc: &RunConfig,
    at: &LayerRun<'_>,
    keep_on_device: bool,
) -> Result<(
    reference::RefOutput,
    Vec<crate::backend::cuda::compare::DeviceSite<f64>>,
)> {
    let o = &rc.path_options;
    let fp8 = (o.fp8.is_some() || o.kv_cache.is_some()).then_some(Fp8Compute {
        act: o.fp8,
        kv_cache: o.kv_cache,
        tp: at.tp,
        absorbed: None,
        context: None,
    });
    let inputs = reference::RefInputs {
        fp8: fp8.as_ref(),
        ..reference::RefInputs::shared(at.shared)
    };
    backend.reference(
        file,
        cfg,
        w,
        at.hidden,
        &rc.batch,
        at.tp,
        &inputs,
        at.full,
        keep_on_device,
    )
}

/// The selection a reduced-precision run's paths attend to: the reference's DSA selection of
/// `layer` (the paths' own is still recorded and judged at `idx_topk`, with the tie band of the
/// rows), for any rows but f32's; `None` at f32 or without an indexer. DSA layers run the CPU
/// reference, so the selection is on the host.
fn forced_selection(
    reference: &Trace,
    layer: usize,
    precision: crate::judge::tolerance::Precision,
) -> Option<Selection> {
    if precision == crate::judge::tolerance::Precision::F32 {
        return None;
    }
    let t = reference.get(&Site::new(layer, Stage::IdxTopk))?;
    Some(Selection {
        rows: crate::compute::indexer::topk_sets(&t.to_f64(), t.shape.last().copied().unwrap_or(0)),
    })
}

/// Runs the requested paths on one layer, compares them with the reference and diagnoses them.
///
/// The paths run one at a time, each compared as soon as it finishes; a path within tolerance
/// drops its trace then (unless `keep_traces`, for golden recording), so a clean layer holds at
/// most one path's trace next to the reference's whatever the number of paths. Diagnosis runs
/// once over every path (a detector compares a diverging path with the others' verdicts). The
/// returned runs have empty traces unless `keep_traces`.
///
/// When the reference left sites on the device (the GPU reference, `reference.device` not
/// empty), each path's sites stay there too and are judged there ([`crate::judge::device`]); a
/// path that diverges there runs again with its sites downloaded, and the reference is
/// downloaded, so that diagnosis sees host traces as on every other backend. `absorbed`: per
/// path, the reference it is judged by instead (`absorbed_references`; fp8 compute only).
///
/// Errors: input errors of the paths (shapes inconsistent with the configuration), CUDA
/// failures of the device comparison.
#[allow(
    clippy::too_many_arguments,
    reason = "the backend, the model (file, cfg, w, dequantized), the layer's input and reference, the run's configuration and the selection carried across layers have different owners; both callers assemble them from different places"
)]
pub fn compare_layer(
    backend: &Backend,
    file: &GgufFile,
    cfg: &MlaConfig,
    w: &LayerWeights,
    hidden: &Array2<f64>,
    reference: &SplitTrace,
    rc: &RunConfig,
    shared: Option<&Selection>,
    dequantized: Option<&Dequantized>,
    keep_traces: bool,
    absorbed: &[(PathKind, Trace)],
) -> Result<(Vec<PathResult>, Vec<Finding>, Vec<PathRun>)> {
    let hidden32 = timing::stage("input", || hidden.mapv(|x| x as f32));
    let dtype = backend.dtype();
    let fp8 = rc.path_options.fp8.is_some() || rc.path_options.kv_cache.is_some();
    let precision = crate::judge::tolerance::Precision::from(dtype).with_fp8(fp8);
    let forced = forced_selection(&reference.host, w.layer, precision);
    let input = LayerInput {
        file,
        cfg,
        weights: w,
        hidden_in: &hidden32,
        batch: &rc.batch,
        shared_selection: shared,
        forced_selection: forced.as_ref(),
        dequantized,
    };
    let mut opts = rc.path_options.clone();
    opts.seed = rc.seed;
    let on_device = match backend {
        Backend::Cuda(o) if !keep_traces && !reference.device.is_empty() => Some(o),
        _ => None,
    };
    let mut runs = Vec::new();
    let mut all_diffs = Vec::new();
    let mut again = Vec::new();
    // Diffs of the sites every path shares (weights, prologue), computed for the first path.
    let mut seen = Vec::new();
    if let Some(o) = on_device {
        o.keep_sites_on_device(true);
    }
    let result = backend.run_paths(&rc.paths, &input, &opts, &mut |mut pr| {
        let diffs = match on_device {
            Some(o) => {
                let sites = o.take_device_sites();
                timing::stage("compare", || {
                    device::diff(o.device(), reference, &pr.trace, &sites, precision)
                })?
            }
            None => timing::stage("compare", || {
                let own = absorbed.iter().find(|(k, _)| *k == pr.kind).map(|(_, t)| t);
                metrics::diff_reusing(
                    own.unwrap_or(&reference.host),
                    &pr.trace,
                    precision,
                    same_for_every_path,
                    &mut seen,
                )
            }),
        };
        let clean = pr.unservable.is_none() && metrics::first_divergence(&diffs).is_none();
        if on_device.is_some() && !clean {
            again.push(pr.kind);
        }
        // Only a diverging path's trace is diagnosed; a clean one's is dropped at once.
        if !keep_traces && clean {
            pr.trace = Trace::default();
        }
        all_diffs.push(diffs);
        runs.push(pr);
        Ok(())
    });
    if let Some(o) = on_device {
        o.keep_sites_on_device(false);
    }
    result?;
    // Diagnosis reads host traces: download the reference and rerun the paths that diverged on
    // the device with their sites downloaded (the same kernels, inputs and seed: the same values).
    let host_reference;
    let reference_trace = match on_device {
        Some(o) if !again.is_empty() => {
            host_reference = timing::stage("download", || reference.to_host(o.device()))?;
            backend.run_paths(&again, &input, &opts, &mut |pr| {
                let diffs = timing::stage("compare", || metrics::diff(&host_reference, &pr.trace, precision));
                if let Some(i) = runs.iter().position(|r| r.kind == pr.kind) {
                    all_diffs[i] = diffs;
                    runs[i] = pr;
                }
                Ok(())
            })?;
            &host_reference
        }
        _ => &reference.host,
    };
    let own = if on_device.is_none() { absorbed } else { &[] };
    let findings = timing::stage("diagnose", || {
        let base = DiagnoseInput {
            cfg,
            batch: &rc.batch,
            reference: reference_trace,
            paths: Vec::new(),
            tp: opts.tp,
            precision,
            dump: None,
            model: Some(file),
        };
        diagnose_paths(&base, &runs, &all_diffs, own)
    });
    let results = runs
        .iter()
        .zip(all_diffs)
        .map(|(pr, d)| PathResult {
            path: pr.kind.into(),
            layer: w.layer,
            diffs: d,
            notes: pr.notes.clone(),
            step: None,
            not_run: pr.unservable.as_ref().map(|u| NotRun::of(u, &rc.path_options.faults)),
        })
        .collect();
    if !keep_traces {
        for pr in &mut runs {
            pr.trace = Trace::default();
        }
    }
    Ok((results, findings, runs))
}

/// The traces behind one layer of a [`RunReport`]: what golden files record.
#[derive(Debug, Clone)]
pub struct LayerTraces {
    /// Layer index.
    pub layer: usize,
    /// The reference trace (f64), including the per-rank weight sites under TP.
    pub reference: Trace,
    /// Each path's trace (f32), in run order.
    pub paths: Vec<(PathKind, Trace)>,
}

/// Runs the reference and the requested paths on every requested layer.
///
/// With `--input tokens` every layer up to the last requested one runs whole, MoE FFN included
/// (its sites are in the reference trace; the paths stop at `o_proj` there); with random inputs
/// an MoE layer's reference stops at `o_proj`, since no path computes its FFN.
///
/// Errors: a layer out of range, missing tensors, token input on a model without embedding, an
/// MoE layer in a file without `expert_count`, a TP size that does not divide N.
pub fn run(backend: &Backend, file: &GgufFile, cfg: &MlaConfig, rc: &RunConfig) -> Result<RunReport> {
    run_inner(backend, file, cfg, rc, false, false, &mut |_, _| {}).map(|(r, _)| r)
}

/// [`run`], also returning every trace (one [`LayerTraces`] per requested layer, ascending).
///
/// Errors: as [`run`].
pub fn run_with_traces(
    backend: &Backend,
    file: &GgufFile,
    cfg: &MlaConfig,
    rc: &RunConfig,
) -> Result<(RunReport, Vec<LayerTraces>)> {
    run_inner(backend, file, cfg, rc, true, false, &mut |_, _| {})
}

/// [`run`], calling `progress(done, total)` after each layer that is computed (for progress bars).
///
/// Errors: as [`run`].
pub fn run_with_progress(
    backend: &Backend,
    file: &GgufFile,
    cfg: &MlaConfig,
    rc: &RunConfig,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<RunReport> {
    run_inner(backend, file, cfg, rc, false, false, progress).map(|(r, _)| r)
}

/// [`run_with_progress`], also returning the reference trace of every requested layer (ascending,
/// kept on the host whatever the backend): what `run --export-inputs` writes the kernel inputs
/// from. The paths' traces are dropped as in [`run`].
///
/// Errors: as [`run`].
pub fn run_keeping_reference(
    backend: &Backend,
    file: &GgufFile,
    cfg: &MlaConfig,
    rc: &RunConfig,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<(RunReport, Vec<(usize, Trace)>)> {
    run_inner(backend, file, cfg, rc, false, true, progress)
        .map(|(r, traces)| (r, traces.into_iter().map(|t| (t.layer, t.reference)).collect()))
}

/// The work of [`run`] and its variants: with `keep_traces` every trace of every requested layer
/// comes back (golden recording); with `keep_reference` only the reference's (the paths' empty).
fn run_inner(
    backend: &Backend,
    file: &GgufFile,
    cfg: &MlaConfig,
    rc: &RunConfig,
    keep_traces: bool,
    keep_reference: bool,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<(RunReport, Vec<LayerTraces>)> {
    check_run(file, cfg, rc)?;
    let t = rc.batch.n_tokens();
    let tp = rc.path_options.tp;
    let mut results = Vec::new();
    let mut findings: Vec<Finding> = Vec::new();
    let mut tensor_types = Vec::new();
    let mut token_ids = None;

    let mut carried: Option<Array2<f64>> = None;
    // The selection of the latest full DSA indexer layer, for GLM's shared layers (token path).
    let mut prev_sel: Option<Selection> = None;
    if rc.input == InputMode::Tokens {
        if cfg.vocab == 0 {
            return Err(Error::MissingTensor {
                path: file.path().to_path_buf(),
                tensor: ModelTensor::TokenEmbd.name(0),
            });
        }
        let ids = seeded_tokens(rc.seed, t, cfg.vocab);
        carried = Some(embed_hidden(file, cfg, &ids)?);
        token_ids = Some(ids);
    }
    let last = rc.layers.iter().copied().max().unwrap_or(0);
    let first_layer = if rc.input == InputMode::Tokens { 0 } else { rc.layers[0] };
    let mut traces = Vec::new();
    let total = if rc.input == InputMode::Tokens {
        last + 1
    } else {
        rc.layers.len()
    };
    let mut done = 0;
    for layer in first_layer..=last {
        let wanted = rc.layers.contains(&layer);
        if !wanted && rc.input == InputMode::Random {
            continue;
        }
        let mut w = timing::stage("dequant", || backend.load_layer_weights(file, cfg, layer))?;
        let _release = ReleaseLayerWeights(backend);
        if tensor_types.is_empty() && wanted {
            tensor_types = w.types.clone();
        }
        let bad = timing::stage("dequant", || w.nonfinite());
        let zeros = if wanted { w.zero_matrices() } else { Vec::new() };
        file.release_resident_pages();
        findings.extend(nonfinite_weight_findings(file, layer, &bad));
        let hidden = layer_hidden_in(cfg, rc, layer, &mut carried)?;
        let layer_tp = if wanted { tp } else { 1 };
        let shared = if rc.input == InputMode::Tokens {
            prev_sel.as_ref()
        } else {
            None
        };
        let full = rc.input == InputMode::Tokens;
        // The reference stays on the device for a GPU run of a wanted layer (judged there);
        // golden recording, an export and the layers a token run only passes through need it on
        // the host.
        let keep_on_device = wanted && !keep_traces && !keep_reference;
        let (layer_ref, device_sites) = timing::stage("reference", || {
            let what = LayerRun {
                hidden: &hidden,
                tp: layer_tp,
                shared,
                full,
            };
            layer_reference(backend, file, cfg, &w, rc, &what, keep_on_device)
        })?;
        let absorbed = if wanted {
            absorbed_references(backend, file, cfg, &w, &hidden, rc, layer_tp, shared, full)?
        } else {
            Vec::new()
        };
        findings.extend(nonfinite_weight_findings(file, layer, &layer_ref.moe_nonfinite));
        if wanted {
            let split = SplitTrace {
                host: layer_ref.trace,
                device: device_sites,
            };
            // The reference is done with the attention tensors: the paths take them over.
            let handed = w.hand_over();
            let (res, f, runs) = compare_layer(
                backend,
                file,
                cfg,
                &w,
                &hidden,
                &split,
                rc,
                shared,
                Some(&handed),
                keep_traces,
                &absorbed,
            )?;
            drop(handed);
            add_path_findings(&mut findings, &res, f);
            let mut res = res;
            // Once per layer, on its first path: the sites an all-zero matrix feeds are 0 on
            // both sides, which "within tolerance" alone does not say.
            if let (Some(note), Some(r)) = (zero_weights_note(layer, &zeros), res.first_mut()) {
                r.notes.insert(0, note);
            }
            results.extend(res);
            if keep_traces || keep_reference {
                traces.push(LayerTraces {
                    layer,
                    reference: split.host,
                    paths: runs.into_iter().map(|r| (r.kind, r.trace)).collect(),
                });
            }
        }
        if cfg.indexer.as_ref().is_some_and(|ix| ix.full.get(layer) == Some(&true)) {
            prev_sel = layer_ref.selection;
        }
        carried = layer_ref.hidden_out;
        done += 1;
        progress(done, total);
    }
    let report = RunReport {
        model: ModelSummary::new(file, cfg, tensor_types),
        run: RunRecord::new(rc, backend.dtype()),
        token_ids,
        results,
        findings,
        dump: None,
        loaded_weights: None,
    };
    Ok((report, traces))
}

/// The note of a layer whose GGUF holds all-zero projection matrices (`zeros`, their GGUF
/// names, from [`LayerWeights::zero_matrices`]); `None` when there is none.
fn zero_weights_note(layer: usize, zeros: &[String]) -> Option<String> {
    if zeros.is_empty() {
        return None;
    }
    let one = zeros.len() == 1;
    Some(format!(
        "layer {layer}'s {} {} all zeros in the GGUF: what {} feeds is 0 in the reference and on every path, so it passes without judging anything",
        zeros.iter().map(|z| format!("`{z}`")).collect::<Vec<_>>().join(", "),
        if one { "is" } else { "are" },
        if one { "it" } else { "each" },
    ))
}

/// Refuses a run with an empty sequence, a TP size that does not divide the `N` heads, or a
/// layer outside the model.
///
/// Errors: [`Error::Usage`]; [`Error::LayerOutOfRange`].
pub fn check_run(file: &GgufFile, cfg: &MlaConfig, rc: &RunConfig) -> Result<()> {
    if rc.batch.seqs.is_empty() || rc.batch.seqs.iter().any(|s| s.len == 0) {
        return Err(Error::Usage("every sequence needs at least one token".into()));
    }
    // T is summed unchecked downstream ([`Batch::n_tokens`]): refuse lengths that wrap.
    if rc
        .batch
        .seqs
        .iter()
        .try_fold(0usize, |a, s| a.checked_add(s.len))
        .is_none()
    {
        return Err(Error::Usage(
            "the sequences' lengths add up past 2^64 − 1 tokens".into(),
        ));
    }
    if rc.layers.is_empty() {
        return Err(Error::Usage("no layer to run".into()));
    }
    let tp = rc.path_options.tp;
    if tp == 0 || !cfg.n_head.is_multiple_of(tp) {
        return Err(Error::Usage(format!(
            "--tp {tp} does not divide the {} attention heads of {}",
            cfg.n_head,
            file.path().display()
        )));
    }
    for &l in &rc.layers {
        if l >= cfg.n_layer {
            return Err(Error::LayerOutOfRange {
                path: file.path().to_path_buf(),
                layer: l,
                n_layers: cfg.n_layer,
            });
        }
    }
    Ok(())
}

/// `weight-nonfinite` findings of `layer` for the tensors `bad`; none when `bad` is empty.
fn nonfinite_weight_findings(file: &GgufFile, layer: usize, bad: &[NonFiniteTensor]) -> Vec<Finding> {
    if bad.is_empty() {
        return Vec::new();
    }
    let numel = |t: &str| file.tensor(t).map_or(0, |i| i.n_elements() as usize);
    diagnose::weight_nonfinite_findings(layer, bad, numel)
}

/// The `hidden_in` [T, H] of `layer`: seeded N(0, 1) values for random input, else the
/// previous layer's output taken from `carried`.
///
/// Errors: [`Error::Internal`] when a token run carries no hidden state into `layer`.
fn layer_hidden_in(
    cfg: &MlaConfig,
    rc: &RunConfig,
    layer: usize,
    carried: &mut Option<Array2<f64>>,
) -> Result<Array2<f64>> {
    let t = rc.batch.n_tokens();
    match rc.input {
        InputMode::Random => timing::stage("input", || {
            let v = normal_f32(layer_seed(rc.seed, layer), t * cfg.hidden);
            Array2::from_shape_vec((t, cfg.hidden), v.into_iter().map(f64::from).collect())
                .map_err(|e| Error::Internal(e.to_string()))
        }),
        InputMode::Tokens => carried.take().ok_or_else(|| {
            Error::Internal(format!(
                "layer {layer}: no hidden state carried from layer {}",
                layer.saturating_sub(1)
            ))
        }),
    }
}

/// Adds a layer's path findings `new` to `findings`: at most one per path, and none for a cut
/// the model itself forces at this TP size (not an injected fault's), which is a limit of the
/// run: that path is reported not run, with the reason, not as a bug.
fn add_path_findings(findings: &mut Vec<Finding>, results: &[PathResult], new: Vec<Finding>) {
    for fi in new {
        let natural = results.iter().any(|r| {
            Some(r.path) == fi.path()
                && r.not_run
                    .as_ref()
                    .is_some_and(|n| !n.by_fault && Some(n.site) == fi.site())
        });
        if !natural && !findings.iter().any(|g| g.path() == fi.path()) {
            findings.push(fi);
        }
    }
}

/// The reference forward of layers `0..=last` on given token ids (no paths), MoE layers whole:
/// one trace per layer. This is what HF-golden tests compare against.
///
/// Errors: ids outside the vocabulary, missing tensors, an MoE layer in a file without
/// `expert_count`.
pub fn reference_chain(
    file: &GgufFile,
    cfg: &MlaConfig,
    tokens: &[u32],
    batch: &Batch,
    last: usize,
) -> Result<Vec<Trace>> {
    let mut hidden = embed_hidden(file, cfg, tokens)?;
    let mut out = Vec::new();
    let mut prev_sel: Option<Selection> = None;
    for layer in 0..=last {
        let w = LayerWeights::load(file, cfg, layer)?;
        let dsa = reference::RefInputs::shared(prev_sel.as_ref());
        let r = reference::forward_full_sel(file, cfg, &w, &hidden, batch, &dsa)?;
        if cfg.indexer.as_ref().is_some_and(|ix| ix.full.get(layer) == Some(&true)) {
            prev_sel = r.selection.clone();
        }
        out.push(r.trace);
        if let Some(h) = r.hidden_out {
            hidden = h;
        }
    }
    Ok(out)
}

/// The widest dense SwiGLU FFN (`ffn_gate` rows, `I`) among the layers a run computes (the
/// requested ones; with token input every layer up to the last requested), 0 when none has one
/// (MoE layers, or a file without dense FFN tensors). The memory estimates read it, since the
/// configuration does not hold it.
pub fn dense_ffn_width(file: &GgufFile, cfg: &MlaConfig, rc: &RunConfig) -> usize {
    let last = rc.layers.iter().max().copied().unwrap_or(0);
    let layers: Vec<usize> = match rc.input {
        InputMode::Tokens => (0..=last).collect(),
        InputMode::Random => rc.layers.clone(),
    };
    layers
        .into_iter()
        .filter(|&l| !cfg.is_moe_layer(l))
        .filter_map(|l| file.tensor(&ModelTensor::FfnGate.name(l)))
        .map(|t| t.shape().first().copied().unwrap_or(0) as usize)
        .max()
        .unwrap_or(0)
}

/// The keys the DSA selection keeps over `batch`: `Σ_seq Σ_i min(K_idx, i + 1)`, at most
/// T · K_idx (0 without an indexer). The selections, the sparse attention's key lists and its
/// key indices each hold this many entries.
pub fn dsa_kept_keys(cfg: &MlaConfig, batch: &Batch) -> u64 {
    let Some(ix) = &cfg.indexer else { return 0 };
    let k = ix.top_k as u64;
    batch
        .seqs
        .iter()
        .map(|s| {
            let len = s.len as u64;
            if len <= k {
                len.saturating_mul(len + 1) / 2
            } else {
                (k * (k + 1) / 2).saturating_add((len - k).saturating_mul(k))
            }
        })
        .fold(0u64, u64::saturating_add)
}

/// The per-layer sizes both memory estimates are built from (element counts unless named
/// bytes).
struct LayerSizes {
    /// T.
    t: u64,
    /// The layer's attention weights (and the indexer's and a dense FFN's) as one f32 copy.
    weights: u64,
    /// The reference's f64 weight sites (`w.fused_qkv_a`, `w.kv_b`, `w.W_UK_T`, `w.W_UV`).
    weight_sites: u64,
    /// Values per token over every site of a trace (the reference's; a path's holds fewer).
    per_token: u64,
    /// The DSA selection's kept keys ([`dsa_kept_keys`]).
    kept: u64,
    /// The longest sequence, S (the width of `idx_scores`).
    s: u64,
    /// Keys one decode query of the absorbed path reads at most: min(K_idx, S) with an
    /// indexer, else S.
    decode_keys: u64,
}

impl LayerSizes {
    fn new(cfg: &MlaConfig, rc: &RunConfig, dense_ffn: usize) -> Self {
        let t = rc.batch.seqs.iter().map(|x| x.len as u64).fold(0, u64::saturating_add);
        let s = rc.batch.seqs.iter().map(|x| x.len).max().unwrap_or(0) as u64;
        let (h, n, l, p, r, v) = (
            cfg.hidden as u64,
            cfg.n_head as u64,
            cfg.kv_lora_rank as u64,
            cfg.qk_nope_head_dim as u64,
            cfg.qk_rope_head_dim as u64,
            cfg.v_head_dim as u64,
        );
        let lq = cfg.q_lora_rank.unwrap_or(0) as u64;
        let q_in = if lq > 0 { lq } else { h };
        let f = dense_ffn as u64;
        let mut weights = h * (lq + l + r) + q_in * n * (p + r) + n * (p + v) * l + h * n * v + 3 * h * f;
        // Values per token over every site of the reference trace (docs/design.md's site
        // table): the attention's, the dense FFN's (`ffn_in`, `ffn_gate`, `ffn_up`, `ffn_act`,
        // `ffn_out`) and the indexer's (`idx_q`, `idx_k`, `idx_weights`, `idx_scores` [T, S],
        // `idx_topk` [T, min(K_idx, S)]).
        let mut per_token =
            4 * h + 2 * lq + n * (p + r) + (l + r) + l + 2 * r + n * r + n * (p + v) + 2 * n * l + n + n * v;
        if f > 0 {
            per_token += 2 * h + 3 * f;
        }
        let mut decode_keys = s;
        if let Some(ix) = &cfg.indexer {
            let (ni, d, k) = (ix.n_head as u64, ix.head_dim as u64, ix.top_k as u64);
            weights += ni * d * lq.max(1) + d * h + ni * h + 2 * d;
            per_token += ni * d + d + ni + s + k.min(s);
            decode_keys = k.min(s);
        }
        LayerSizes {
            t,
            weights,
            weight_sites: (lq + l + r) * h + 2 * n * (p + v) * l,
            per_token,
            kept: dsa_kept_keys(cfg, &rc.batch),
            s,
            decode_keys,
        }
    }

    /// Bytes of a DSA layer's selection bookkeeping on the host: the reference's selection, the
    /// path's own and the one it attends with, the sparse attention's key lists and indices
    /// (`usize` each), and the engine indexer's scores (f32, and widened to f64 to select).
    fn dsa_host_bytes(&self) -> u64 {
        if self.kept == 0 {
            return 0;
        }
        (5 * self.kept as u128 * 8 + self.t as u128 * self.s as u128 * (4 + 8))
            .try_into()
            .unwrap_or(u64::MAX)
    }
}

/// An upper estimate of a run's peak host memory in bytes, from the dims, T, the paths, the
/// path options (page size, splits), the input mode and `dense_ffn` (the widest dense FFN the
/// run computes, [`dense_ffn_width`]), for refusing a run the machine cannot hold before any
/// work ([`crate::jobs::limits`]). Computed in `u128` and saturated, so no size wraps to a small
/// estimate.
///
/// Per layer, what is live at the peak: the layer's weights in f32 once (attention, indexer,
/// dense FFN: the CPU paths take over the reference's copy; a GPU run's paths hold theirs on the
/// device) plus the reference's f64 weight sites (`w.fused_qkv_a`, `w.kv_b`, `w.W_UK_T`,
/// `w.W_UV`); the reference trace in f64 and one path's trace in f32 (the paths run one at a
/// time and each trace is dropped once judged), each about `T ·` (the per-token width of every
/// site, `idx_scores` included: [T, S]); the transient working set of the widest step, the
/// expanded `[T, N, P+V]` K/V in f64 twice; the reference attention's score blocks, one
/// `[64, S]` f64 block and its probabilities per thread; with a DSA indexer, the selections and
/// the sparse attention's key indices (five lists of the kept keys, at most T · K_idx entries
/// each, never a copy of the keys per query) and the engine indexer's scores; the absorbed
/// path's decode block (128 queries' kept latent rows, `[128, min(K_idx, S), L+R]`, each row's
/// run padded to whole pages under DSA). With a paged path (mqa, mixed, chunked): the paged
/// latent cache, `(Σ ⌈len/page⌉ + 1) · page · (L+R)` f32, twice (the zeroed vector and the
/// backend's copy), and with a split-KV decode (mqa, mixed) the splits' partial outputs and LSEs,
/// `splits · 128 · N · (L+1)` f32, twice (a split fault's host copy). A 25 % margin covers
/// allocator slack and the smaller temporaries, and [`BASE_BYTES`] the process itself. Token
/// input adds one layer's MoE or dense FFN and the embedding rows.
///
/// A GPU run whose traces stay on the device holds far less on the host while the layer is
/// clean, but a divergence downloads the reference and the diverging path's trace for the
/// diagnosis: the estimate covers that case, so it holds for every backend. The device's own
/// peak is [`estimate_device_bytes`].
///
/// Provenance (peak RSS from `/usr/bin/time -f %M`, `mla-diff run --backend cpu --quiet` on the
/// embedded tiny-v3 fixture, 2-core VM; estimate from the `--max-memory 1` refusal):
///
/// | flags | estimate | measured peak | ratio |
/// |---|---|---|---|
/// | (default, T=19) | 21.2 MiB | 14.0 MiB | 1.5 |
/// | `--page-size 65536` | 161.2 MiB | 125.7 MiB | 1.3 |
/// | `--seqs 1,…,1` (20 ones) `--page-size 65536` | 1.5 GiB | 1.16 GiB | 1.3 |
/// | `--splits 4096` | 452.7 MiB | 192.3 MiB | 2.4 |
/// | `--tokens 4096` | 646.9 MiB | 325.7 MiB | 2.0 |
/// | `--tokens 8192` | 1.2 GiB | 642.6 MiB | 1.9 |
pub fn estimate_peak_bytes(cfg: &MlaConfig, rc: &RunConfig, dense_ffn: usize) -> u64 {
    use crate::compute::path::PathKind;
    let z = LayerSizes::new(cfg, rc, dense_ffn);
    let w = |x: usize| x as u128;
    let t = z.t as u128;
    let (h, n, l, p, r, v) = (
        w(cfg.hidden),
        w(cfg.n_head),
        w(cfg.kv_lora_rank),
        w(cfg.qk_nope_head_dim),
        w(cfg.qk_rope_head_dim),
        w(cfg.v_head_dim),
    );
    let ffn = if rc.input == InputMode::Tokens {
        // An MoE layer's FFN width is not in the config; bound it by the MoE's shared width, the
        // file's dense FFN or 4·H.
        let f = cfg
            .moe
            .as_ref()
            .map_or(4 * h, |m| w(m.n_expert_shared.max(1)) * w(m.expert_ffn))
            .max(4 * h)
            .max(w(dense_ffn));
        3 * h * f * 4 + t * h * 8 * 2
    } else {
        0
    };
    let page = w(rc.path_options.page_size.max(1));
    let rows = DECODE_BLOCK_ROWS.min(z.t) as u128;
    let paged = rc
        .paths
        .iter()
        .any(|k| matches!(k, PathKind::Mqa | PathKind::Mixed | PathKind::Chunked));
    let split_kv = rc.paths.iter().any(|k| matches!(k, PathKind::Mqa | PathKind::Mixed));
    let cache = if paged {
        let blocks: u128 = rc.batch.seqs.iter().map(|s| w(s.len).div_ceil(page)).sum::<u128>() + 1;
        2 * blocks * page * (l + r) * 4
    } else {
        0
    };
    let partials = if split_kv {
        2 * w(rc.path_options.num_splits.max(1)) * rows * n * (l + 1) * 4
    } else {
        0
    };
    let padded_keys = z.decode_keys.max(1) as u128 + if cfg.indexer.is_some() { page } else { 0 };
    let decode_block = rows * padded_keys * ((l + r) * 4 + 8);
    let scores = w(rayon::current_num_threads()) * REFERENCE_Q_BLOCK * z.s as u128 * 8 * 2;
    let bytes = z.weights as u128 * 4
        + z.weight_sites as u128 * 8
        + t * z.per_token as u128 * (8 + 4)
        + 2 * t * n * (p + v) * 8
        + z.dsa_host_bytes() as u128
        + decode_block
        + cache
        + partials
        + scores
        + ffn;
    u64::try_from(BASE_BYTES as u128 + bytes + bytes / 4).unwrap_or(u64::MAX)
}

/// What the process holds before a run allocates: the binary's pages, the embedded fixture, the
/// allocator's arenas and thread stacks (`mla-diff sites`: 5.3 MiB peak RSS, `mla-diff inspect`
/// 6.0 MiB, on the 2-core VM), with room for a model's index.
pub const BASE_BYTES: u64 = 16 << 20;

/// Query rows per block of the reference attention (`compute::reference`'s `ATTN_Q_BLOCK`):
/// each thread holds one block's `[64, S]` scores and probabilities.
const REFERENCE_Q_BLOCK: u128 = 64;

/// Query rows per launch of the absorbed path's decode (`compute::engine`'s `DECODE_ROWS`),
/// for the estimates.
const DECODE_BLOCK_ROWS: u64 = 128;

/// An upper estimate of a GPU run's peak device memory in bytes (the CUDA backend), from the
/// same inputs as [`estimate_peak_bytes`] and whether the GPU reference computes the layer
/// (`gpu_reference`: not with a DSA indexer, see [`crate::backend::cuda::reference::supported`]).
///
/// What one layer holds on the device at the peak: its weights dequantized in f32 (kept for
/// the reference, then taken over by the engine); one path's recorded sites (kept there for the
/// device comparison, about `T ·` the per-token width in f32) and its working set: `q`, the
/// full-width `[T, N, P+R]` queries and keys, the `kv_b_proj` output `[T, N, P+V]` and its
/// split, each with the bf16 copy the kernels read, and the key indices of a DSA selection
/// (i64, one per kept key; no per-query copy of the keys), and the absorbed path's decode block
/// (128 queries' kept latent rows with their bf16 copy and the split partials). With the GPU
/// reference, its f64 trace, the largest weight widened to f64, its f64 K/V expansion and its
/// score buffer ([`crate::backend::cuda::reference::SCORE_BYTES`] of heads, or one head's
/// `[S, S]` when larger). The paged latent cache, pages × page size × (L+R) with its bf16 copy.
/// A 25 % margin as on the host.
pub fn estimate_device_bytes(cfg: &MlaConfig, rc: &RunConfig, dense_ffn: usize, gpu_reference: bool) -> u64 {
    let z = LayerSizes::new(cfg, rc, dense_ffn);
    let t = z.t;
    let (h, n, l, p, r, v) = (
        cfg.hidden as u64,
        cfg.n_head as u64,
        cfg.kv_lora_rank as u64,
        cfg.qk_nope_head_dim as u64,
        cfg.qk_rope_head_dim as u64,
        cfg.v_head_dim as u64,
    );
    let splits = rc.path_options.num_splits.max(1) as u64;
    let rows = DECODE_BLOCK_ROWS.min(t);
    let working = t * n * (3 * (p + r) + 3 * (p + v)) * 6
        + z.kept * 8
        + rows * z.decode_keys.max(1) * (l + r) * 6
        + 2 * splits * rows * n * l * 4;
    let reference = if gpu_reference {
        let q_in = cfg.q_lora_rank.map_or(h, |q| q as u64);
        let largest = [h * n * v, q_in * n * (p + r), n * (p + v) * l, h * dense_ffn as u64]
            .into_iter()
            .max()
            .unwrap_or(0);
        let scores = (crate::backend::cuda::reference::SCORE_BYTES as u64)
            .max(z.s * z.s * 8)
            .min(n * z.s * z.s * 8);
        t * z.per_token * 8 + largest * 8 + 2 * t * n * (p + v) * 8 + scores
    } else {
        0
    };
    // The paged latent cache of the paged paths, f32 with the bf16 copy the kernels read.
    let page = rc.path_options.page_size.max(1) as u64;
    let blocks = rc
        .batch
        .seqs
        .iter()
        .map(|s| (s.len as u64).div_ceil(page))
        .fold(1u64, u64::saturating_add);
    let cache = blocks.saturating_mul(page).saturating_mul((l + r) * 6);
    let bytes = (z.weights * 4 + t * z.per_token * 4 + working + reference).saturating_add(cache);
    bytes.saturating_add(bytes / 4)
}
