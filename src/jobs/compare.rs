//! `mla-diff compare`: an engine's own dump judged against the reference on the same GGUF.
//!
//! The dump reader ([`crate::model::dump`]) turns the engine's tensors into our sites and
//! layouts; this job runs the reference from the dump's own layer inputs, compares every dumped
//! site with the metrics, tolerance rows and detectors that `run` uses, and returns the same
//! [`RunReport`], so the same renderers print it.

use ndarray::Array2;

use crate::compute::path::PathOptions;
use crate::compute::reference::{reference_layer, reference_layer_full};
use crate::core::error::{Error, Result};
use crate::core::trace::{Site, Stage, TraceTensor};
use crate::judge::diagnose::{self, DiagnoseInput, PathEvidence};
use crate::judge::label::PathLabel;
use crate::judge::metrics;
use crate::judge::report::{DumpSummary, InputSource, ModelSummary, PathResult, RunRecord, RunReport};
use crate::model::config::MlaConfig;
use crate::model::dump::{Dump, EngineDtype};
use crate::model::gguf::GgufFile;
use crate::model::weights::{LayerWeights, embed_hidden};

fn to_array(t: &TraceTensor, rows: usize, cols: usize) -> Result<Array2<f64>> {
    Array2::from_shape_vec((rows, cols), t.to_f64()).map_err(|e| Error::Usage(e.to_string()))
}

/// Compares a dump with the reference on the same GGUF: every dumped site, the same metrics,
/// detectors and table as `run`; the tolerance rows are those of the dtype the engine computed in
/// (the dump's `dtype` metadata, or `dtype` when given): [`EngineDtype::precision`].
///
/// Each dumped layer runs the reference from the dump's own `L{n}.hidden_in`; without it, from
/// the dump's `L{n-1}.hidden_out`, or (first layer only) from `tokens` through the embedding and
/// the reference forward of layers `0..n`. When `tokens` are dumped, the first layer's dumped
/// `hidden_in` is judged against the token-derived input; each later dumped `L{n}.hidden_in` is
/// judged against the dump's own `L{n-1}.hidden_out`.
///
/// An MoE layer's reference runs its MoE FFN (sites `moe_*`, `shared_out`, `hidden_out`) when the
/// dump holds any of them for that layer; a token-derived input runs every earlier layer whole.
///
/// Errors: no input for a layer; a reference layer that cannot run (missing tensors, an MoE
/// layer in a file without `expert_count`).
pub fn compare_dump(
    file: &GgufFile,
    cfg: &MlaConfig,
    dump: &Dump,
    map_name: Option<String>,
    dtype: Option<EngineDtype>,
) -> Result<RunReport> {
    let dtype = dtype.unwrap_or(dump.dtype);
    let precision = dtype.precision();
    let t = dump.batch.n_tokens();
    let layers: Vec<usize> = dump.layers.keys().copied().collect();
    let mut results = Vec::new();
    let mut findings = Vec::new();
    let mut not_dumped = Vec::new();
    let mut tensor_types = Vec::new();
    let mut prev: Option<(usize, Option<Array2<f64>>)> = None; // (layer, dump's hidden_out)
    // The reference selection of the latest full DSA indexer layer, for GLM's shared layers.
    let mut prev_sel: Option<crate::compute::indexer::Selection> = None;
    for (i, &layer) in layers.iter().enumerate() {
        let dl = &dump.layers[&layer];
        let w = LayerWeights::load(file, cfg, layer)?;
        if tensor_types.is_empty() {
            tensor_types = w.types.clone();
        }
        let own_in = dl.get(&Site::new(layer, Stage::HiddenIn));
        // The expected input (what hidden_in is judged against), when known independently.
        let mut expected_in: Option<Array2<f64>> = None;
        if i == 0 {
            if let Some(tk) = &dump.tokens {
                let mut h = embed_hidden(file, cfg, tk)?;
                for k in 0..layer {
                    let wk = LayerWeights::load(file, cfg, k)?;
                    let r = crate::compute::reference::forward_full_sel(
                        file,
                        cfg,
                        &wk,
                        &h,
                        &dump.batch,
                        prev_sel.as_ref(),
                    )?;
                    if cfg.indexer.as_ref().is_some_and(|ix| ix.full.get(k) == Some(&true)) {
                        prev_sel = r.selection;
                    }
                    h = r
                        .hidden_out
                        .ok_or_else(|| Error::Usage(format!("reference: layer {k} produced no hidden_out")))?;
                }
                expected_in = Some(h);
            }
        } else if let Some((pl, Some(ho))) = &prev
            && *pl + 1 == layer
        {
            expected_in = Some(ho.clone());
        }
        let input = match (own_in, &expected_in, &prev) {
            (Some(x), _, _) => to_array(x, t, cfg.hidden)?,
            (None, Some(e), _) => e.clone(),
            _ => {
                return Err(Error::Usage(format!(
                    "{}: layer {layer} has no input: dump L{layer}.hidden_in{}",
                    dump.path.display(),
                    if i == 0 { " or tokens" } else { "" }
                )));
            }
        };
        let wants_ffn = dl
            .entries()
            .iter()
            .any(|(s, _)| s.stage.is_moe() || s.stage == Stage::HiddenOut);
        let refo = if cfg.is_moe_layer(layer) && wants_ffn {
            reference_layer_full(file, cfg, &w, &input, &dump.batch, 1, prev_sel.as_ref())?
        } else {
            reference_layer(cfg, &w, &input, &dump.batch, 1, prev_sel.as_ref())?
        };
        if cfg.indexer.as_ref().is_some_and(|ix| ix.full.get(layer) == Some(&true)) {
            prev_sel = refo.selection.clone();
        }
        let mut reference = refo.trace;
        if let Some(e) = expected_in {
            let flat: Vec<f64> = e.iter().copied().collect();
            reference.record(
                Site::new(layer, Stage::HiddenIn),
                TraceTensor::f64(vec![t, cfg.hidden], flat),
            );
        }
        for s in reference.sites_in_order() {
            if dl.get(&s).is_none() {
                not_dumped.push(s.to_string());
            }
        }
        let diffs = metrics::diff(&reference, dl, precision);
        let evidence = PathEvidence {
            kind: PathLabel::Dump,
            trace: dl,
            diffs: &diffs,
            empty_partial_rows: &[],
            unservable: None,
        };
        let f = diagnose::diagnose(&DiagnoseInput {
            cfg,
            batch: &dump.batch,
            reference: &reference,
            paths: vec![evidence],
            tp: 1,
            precision,
        });
        if findings.is_empty() {
            findings.extend(f);
        }
        results.push(PathResult {
            path: PathLabel::Dump,
            layer,
            diffs,
            notes: Vec::new(),
        });
        let ho = dl
            .get(&Site::new(layer, Stage::HiddenOut))
            .map(|x| to_array(x, t, cfg.hidden))
            .transpose()?;
        prev = Some((layer, ho));
    }
    let engine = dump.metadata.get("engine").cloned().unwrap_or_else(|| "unknown".into());
    let summary = DumpSummary {
        path: dump.path.display().to_string(),
        engine: engine.clone(),
        map: map_name,
        metadata: dump.metadata.clone(),
        conversions: dump.conversions.clone(),
        ignored: dump.ignored.clone(),
        not_dumped,
        dtype,
        tolerance_rows: precision,
    };
    Ok(RunReport {
        model: ModelSummary {
            path: file.path().display().to_string(),
            config: cfg.clone(),
            tensor_types,
        },
        run: RunRecord {
            layers,
            batch: dump.batch.clone(),
            seed: 0,
            input: InputSource::Dump,
            paths: vec![PathLabel::Dump],
            path_options: PathOptions::default(),
            dtype: dtype.compute_dtype(),
            backend: format!("dump: {engine}"),
        },
        token_ids: dump.tokens.clone(),
        results,
        findings,
        dump: Some(summary),
    })
}
