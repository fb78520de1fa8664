//! `mla-diff weights --check`: an engine's MLA weights as loaded, against the GGUF.
//!
//! The second bug behind this project was in the weights, not in a kernel: the shards of a fused
//! projection came out of GGUF dequantization in the wrong order. An engine's loaded weights
//! (dequantized, fused, sharded per tensor-parallel rank, absorbed into `W_UK_T`/`W_UV`) can be
//! dumped with vLLM's parameter names and checked here against the same tensors rebuilt from the
//! GGUF. This job reads the file, rebuilds each param and judges each tensor; a tensor that
//! differs is explained by the detectors of [`crate::judge::diagnose::loaded`] (fused shards in
//! the wrong order, a rank holding another rank's slice, a missing shard, a transposed matrix, a
//! shard cut inside a quant block), and [`crate::output::weights_check`] renders the report.
//!
//! File format: safetensors, tensors `L{n}.{param}` (whole) or `L{n}.{param}.rank{r}` (one TP
//! rank's shard), PyTorch `[out, in]` layout, any float dtype; params are vLLM's names
//! (`vllm/model_executor/models/deepseek_v2.py`): `fused_qkv_a_proj`, `q_a_proj`, `q_b_proj`,
//! `q_proj`, `kv_a_proj_with_mqa`, `kv_b_proj`, `o_proj`, and the MLA backend's `W_UK_T`
//! `[N, P, L]` and `W_UV` `[N, L, V]` (`vllm/v1/attention/backends/mla/common.py`). Metadata:
//! `tp_size` (else the largest rank + 1), `dtype` (`f32` exact, `bf16`/`f16` judged by the bf16
//! weight row), `engine`.

use std::collections::BTreeMap;
use std::path::Path;

use ndarray::Array2;
use safetensors::SafeTensors;

use crate::compute::reference::{assemble_kv_b, widen_to_f64};
use crate::core::dtype::Dtype;
use crate::core::error::{Error, Result};
use crate::core::st::header_error;
use crate::core::trace::{Stage, TraceTensor};
use crate::judge::diagnose::Finding;
use crate::judge::diagnose::blocks::rel_l2 as rel;
use crate::judge::diagnose::explain_loaded;
use crate::judge::diagnose::loaded::{self, Failing, Holds, Param, Source, match_threshold};
use crate::judge::metrics;
use crate::judge::tolerance::tolerance;
use crate::judge::weights_check::{TensorCheck, WeightsReport};
use crate::model::config::MlaConfig;
use crate::model::dump::{FORMAT1, FORMAT2, Map};
use crate::model::gguf::GgufFile;
use crate::model::tensors::{self, ModelTensor};
use crate::model::weights::{LayerWeights, QWeights};

/// Every MLA param of layer `w.layer` rebuilt from the GGUF `file`, by the name a weights dump
/// gives it: the tensor table's [`tensors::dump_params`] of the model's layout (`q_proj` or the
/// LoRA three, and the rest), each with its TP split, merged shards and GGUF sources.
fn params(file: &GgufFile, cfg: &MlaConfig, w: &LayerWeights) -> BTreeMap<&'static str, Param> {
    let [n, l, p, _, v] = cfg.dims().nlprv();
    let layer = w.layer;
    let info = |t: ModelTensor| {
        let name = t.name(layer);
        match file.tensor(&name) {
            Some(i) => Source {
                name,
                ggml_type: i.ggml_type.name().to_string(),
                block: i.ggml_type.block_size(),
            },
            None => Source {
                name,
                ggml_type: "?".into(),
                block: 1,
            },
        }
    };
    // The [out, in] matrix of each projection tensor that a param holds as is or concatenates.
    let matrix = |t: ModelTensor| -> Option<Array2<f64>> {
        match (t, &w.q) {
            (ModelTensor::AttnQA, QWeights::Lora { q_a, .. }) => Some(widen_to_f64(q_a)),
            (ModelTensor::AttnQB, QWeights::Lora { q_b, .. }) => Some(widen_to_f64(q_b)),
            (ModelTensor::AttnQ, QWeights::Direct { q }) => Some(widen_to_f64(q)),
            (ModelTensor::AttnKvAMqa, _) => Some(widen_to_f64(&w.kv_a_mqa)),
            (ModelTensor::AttnOutput, _) => Some(widen_to_f64(&w.o_proj)),
            _ => None,
        }
    };
    let flat = |a: &Array2<f64>| (a.iter().copied().collect::<Vec<f64>>(), a.shape().to_vec());
    let kv_b = assemble_kv_b(cfg, &w.kv_b);
    let mut m = BTreeMap::new();
    for dp in tensors::dump_params(cfg) {
        let (data, shape) = match dp.site {
            Some(Stage::WKvB) => flat(&kv_b),
            // W_UK_T [N, P, L]: each head's k_nope rows of kv_b as stored.
            Some(Stage::WUkT) => {
                let mut uk = Vec::with_capacity(n * p * l);
                for h in 0..n {
                    for pi in 0..p {
                        for li in 0..l {
                            uk.push(kv_b[[h * (p + v) + pi, li]]);
                        }
                    }
                }
                (uk, vec![n, p, l])
            }
            // W_UV [N, L, V]: each head's v rows of kv_b, transposed.
            Some(Stage::WUv) => {
                let mut uv = Vec::with_capacity(n * l * v);
                for h in 0..n {
                    for li in 0..l {
                        for vi in 0..v {
                            uv.push(kv_b[[h * (p + v) + p + vi, li]]);
                        }
                    }
                }
                (uv, vec![n, l, v])
            }
            _ => {
                let parts = if dp.shards.is_empty() { &dp.sources } else { &dp.shards };
                let mats: Vec<Array2<f64>> = parts.iter().filter_map(|&t| matrix(t)).collect();
                let views: Vec<_> = mats.iter().map(|a| a.view()).collect();
                let Ok(a) = ndarray::concatenate(ndarray::Axis(0), &views) else {
                    continue;
                };
                flat(&a)
            }
        };
        let shards = dp
            .shards
            .iter()
            .filter_map(|&t| {
                let checkpoint = t.row().vllm?.merged?.checkpoint;
                Some((tensors::dump_name(checkpoint), matrix(t)?.nrows()))
            })
            .collect();
        m.insert(
            dp.name,
            Param {
                data,
                shape,
                split: dp.split,
                shards,
                sources: dp.sources.iter().map(|&t| info(t)).collect(),
            },
        );
    }
    m
}

/// One MLA param tensor read from the weights file.
struct Entry {
    name: String,
    layer: usize,
    param: String,
    rank: Option<usize>,
    shape: Vec<usize>,
    data: Vec<f64>,
    /// safetensors dtype string (`F32`, `BF16`, …).
    dtype: String,
}

/// Parses `L{n}.{param}` or `L{n}.{param}.rank{r}`.
fn parse_name(name: &str) -> Option<(usize, String, Option<usize>)> {
    let rest = name.strip_prefix('L')?;
    let (layer, rest) = rest.split_once('.')?;
    let layer = layer.parse().ok()?;
    let (param, rank) = match rest.rsplit_once(".rank") {
        Some((p, r)) => (p, Some(r.parse().ok()?)),
        None => (rest, None),
    };
    tensors::dump_param_names()
        .contains(&param)
        .then(|| (layer, param.to_string(), rank))
}

/// Refuses an activation dump, the file `compare` reads, before its `L{n}.o_proj` [T, H] (an
/// activation site whose name is also the `o_proj` param's) is judged as a weight: a format-2
/// dump without `weights.…` tensors, or a file whose `L{n}.{param}` names are at most `o_proj`
/// while it holds activation sites (`L0.hidden_in`, …) or says `format = mla-diff dump 1`.
///
/// Errors: [`Error::Safetensors`] naming the file and `tensors`, saying to use `compare`.
fn refuse_activation_dump(
    path: &Path,
    metadata: &BTreeMap<String, String>,
    names: &[String],
    format2: bool,
) -> Result<()> {
    let refuse = |why: String| Error::Safetensors {
        path: path.to_path_buf(),
        what: "tensors".into(),
        reason: format!(
            "this is an activation dump ({why}): use `mla-diff compare --dump`; `weights --check` reads an engine's loaded weights (`L0.kv_b_proj`, …, or a format-2 dump's `weights.L0.kv_b_proj`)"
        ),
    };
    if format2 {
        if names.iter().any(|n| n.starts_with("weights.")) {
            return Ok(());
        }
        return Err(refuse(format!("`{FORMAT2}` without `weights.…` tensors")));
    }
    let weights_besides_o_proj = names
        .iter()
        .any(|n| parse_name(n).is_some_and(|(_, param, _)| param != "o_proj"));
    if weights_besides_o_proj {
        return Ok(());
    }
    let site = names
        .iter()
        .find(|n| parse_name(n).is_none() && crate::core::trace::Site::parse(n).is_some_and(|s| !s.stage.is_weight()));
    match (site, metadata.get("format").map(|f| f.trim())) {
        (Some(s), _) => Err(refuse(format!("activation sites such as `{s}`"))),
        (None, Some(FORMAT1)) => Err(refuse(format!("`format = {FORMAT1}`"))),
        _ => Ok(()),
    }
}

/// Checks the weights in `path` against the GGUF.
///
/// Errors: an unreadable or malformed file, an activation dump (the file `compare` reads), a
/// tensor with an integer dtype, a layer out of range, GGUF tensors that cannot be loaded, no
/// MLA param at all in the file.
pub fn check(file: &GgufFile, cfg: &MlaConfig, path: &Path, map: Option<&Map>) -> Result<WeightsReport> {
    let WeightsFile {
        metadata,
        dtype,
        entries,
        ignored,
    } = read_weights_file(cfg, path, map)?;
    let tp = tp_size(path, &metadata, &entries, cfg)?;
    let mut cache: BTreeMap<usize, BTreeMap<&'static str, Param>> = BTreeMap::new();
    for layer in entries.iter().map(|e| e.layer) {
        if let std::collections::btree_map::Entry::Vacant(slot) = cache.entry(layer) {
            let w = LayerWeights::load(file, cfg, layer)?;
            slot.insert(params(file, cfg, &w));
        }
    }
    let mut tensors = Vec::new();
    let mut findings = Vec::new();
    // Per (layer, param): which rank's slice each file shard holds.
    let mut holds: Holds = BTreeMap::new();
    for e in &entries {
        let Some(p) = cache[&e.layer].get(e.param.as_str()) else {
            findings.push(loaded::param_absent(&e.name, &e.param, e.rank, cfg.q_lora_rank));
            continue;
        };
        if let Some(tc) = check_entry(e, p, cfg, dtype, tp, &mut holds, &mut findings) {
            tensors.push(tc);
        }
    }
    findings.extend(loaded::rank_findings(holds, &cache, tp));
    Ok(WeightsReport {
        model: file.path().display().to_string(),
        weights: path.display().to_string(),
        engine: metadata.get("engine").cloned().unwrap_or_else(|| "unknown".into()),
        tp,
        metadata_dtype: metadata.get("dtype").cloned(),
        dtype,
        tensors,
        findings,
        ignored,
    })
}

/// An [`Error::Safetensors`] naming `path` and the tensor or field `what`.
fn bad(path: &Path, what: &str, reason: String) -> Error {
    Error::Safetensors {
        path: path.to_path_buf(),
        what: what.to_string(),
        reason,
    }
}

/// What [`read_weights_file`] reads: the file's `__metadata__`, the dtype it declares, the MLA
/// params found (sorted by name) and the names of the tensors that are not MLA params.
struct WeightsFile {
    metadata: BTreeMap<String, String>,
    dtype: Dtype,
    entries: Vec<Entry>,
    ignored: Vec<String>,
}

/// Reads every MLA param tensor of the weights file `path` (format 1 names, `weights.…` tensors
/// of a format-2 dump, or names `map` renames), decoded to f64.
///
/// Errors: as [`check`]'s, except those of the GGUF and the TP size.
fn read_weights_file(cfg: &MlaConfig, path: &Path, map: Option<&Map>) -> Result<WeightsFile> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, "read", e))?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| header_error(path, &bytes, &e))?;
    let (_, meta) = SafeTensors::read_metadata(&bytes).map_err(|e| header_error(path, &bytes, &e))?;
    let metadata: BTreeMap<String, String> = meta.metadata().clone().unwrap_or_default().into_iter().collect();
    // A format-2 dump carries the weights as `weights.L{n}.{param}` next to its steps, and its
    // dtype in the header.
    let format2 = metadata.get("format").map(|f| f.trim()) == Some(FORMAT2);
    let header_dtype = format2
        .then(|| metadata.get("header"))
        .flatten()
        .and_then(|h| serde_json::from_str::<serde_json::Value>(h).ok())
        .and_then(|h| h["dtype"].as_str().map(str::to_string));
    let dtype = match header_dtype.as_deref().or(metadata.get("dtype").map(String::as_str)) {
        None | Some("f32" | "float32" | "f64") => Dtype::F32,
        Some("bf16" | "bfloat16" | "f16" | "float16") => Dtype::Bf16,
        Some(o) => {
            return Err(bad(
                path,
                "__metadata__.dtype",
                format!("`{o}`: expected f32, bf16 or f16"),
            ));
        }
    };

    let mut entries: Vec<Entry> = Vec::new();
    let mut ignored = Vec::new();
    let mut names: Vec<String> = st.names().into_iter().map(str::to_string).collect();
    names.sort();
    refuse_activation_dump(path, &metadata, &names, format2)?;
    for full_name in names {
        let name = if format2 {
            match full_name.strip_prefix("weights.") {
                Some(rest) => rest.to_string(),
                // The steps' activations: `compare`'s business.
                None => continue,
            }
        } else {
            full_name.clone()
        };
        let target = map.and_then(|m| m.rename_match(&name, cfg)).map(|(l, t)| match l {
            Some(l) => format!("L{l}.{t}"),
            None => t.to_string(),
        });
        let Some((layer, param, rank)) = parse_name(target.as_deref().unwrap_or(&name)) else {
            ignored.push(name);
            continue;
        };
        if layer >= cfg.n_layer {
            return Err(bad(
                path,
                &name,
                format!("layer {layer} out of range: the model has {} layers", cfg.n_layer),
            ));
        }
        let view = st
            .tensor(&full_name)
            .map_err(|e| bad(path, &full_name, e.to_string()))?;
        let tt = crate::core::st::decode_tensor(path, &full_name, &view)?;
        if !crate::core::st::is_float_dtype(view.dtype()) {
            return Err(bad(
                path,
                &name,
                format!("integer dtype {:?}; weights must be floats", view.dtype()),
            ));
        }
        entries.push(Entry {
            name,
            layer,
            param,
            rank,
            shape: view.shape().to_vec(),
            data: tt.to_f64(),
            dtype: format!("{:?}", view.dtype()),
        });
    }
    if entries.is_empty() {
        return Err(bad(
            path,
            "tensors",
            format!(
                "no MLA weight found (names like `L0.kv_b_proj` or `L0.kv_b_proj.rank1`; params {}); {} other tensor(s)",
                tensors::dump_param_names().join(", "),
                ignored.len()
            ),
        ));
    }
    Ok(WeightsFile {
        metadata,
        dtype,
        entries,
        ignored,
    })
}

/// The TP size of the file: `__metadata__.tp_size`, else one more than the highest shard rank
/// (1 without shards).
///
/// Errors: [`Error::Safetensors`] for a `tp_size` that is not a positive integer or does not
/// divide the `N` heads.
fn tp_size(path: &Path, metadata: &BTreeMap<String, String>, entries: &[Entry], cfg: &MlaConfig) -> Result<usize> {
    let tp = match metadata.get("tp_size") {
        Some(s) => s
            .trim()
            .parse::<usize>()
            .ok()
            .filter(|&t| t >= 1)
            .ok_or_else(|| bad(path, "__metadata__.tp_size", format!("`{s}` is not a positive integer")))?,
        None => entries.iter().filter_map(|e| e.rank).max().map_or(1, |r| r + 1),
    };
    if !cfg.n_head.is_multiple_of(tp) {
        return Err(bad(
            path,
            "__metadata__.tp_size",
            format!("{tp} does not divide the {} heads", cfg.n_head),
        ));
    }
    Ok(tp)
}

/// Judges one file tensor `e` against the GGUF's param `p` (or, for a shard, its rank's slice):
/// returns its row of the report, or `None` for a rank outside `0..tp` (a finding). Records
/// which rank's slice a shard holds in `holds`, and pushes the explanation of a failing tensor
/// that holds no other rank's slice to `findings`.
fn check_entry(
    e: &Entry,
    p: &Param,
    cfg: &MlaConfig,
    dtype: Dtype,
    tp: usize,
    holds: &mut Holds,
    findings: &mut Vec<Finding>,
) -> Option<TensorCheck> {
    let tol = tolerance(Stage::WKvB, dtype).0;
    let thr = match_threshold(dtype);
    let (exp, exp_shape, range) = match e.rank {
        Some(r) if r < tp => p.rank_slice(cfg.dims(), tp, r),
        Some(r) => {
            findings.push(loaded::rank_out_of_range(&e.name, r, tp, p));
            return None;
        }
        None => (p.data.clone(), p.shape.clone(), (0, 0)),
    };
    let mut tc = TensorCheck {
        name: e.name.clone(),
        layer: e.layer,
        param: e.param.clone(),
        rank: e.rank,
        shape: e.shape.clone(),
        expected_shape: exp_shape.clone(),
        pass: false,
        metrics: None,
        file_dtype: e.dtype.clone(),
        source: p.source_names(),
    };
    if e.shape == exp_shape {
        let m = metrics::metrics(
            &TraceTensor::f64(exp_shape.clone(), exp.clone()),
            &TraceTensor::f64(e.shape.clone(), e.data.clone()),
            &tol,
        );
        tc.pass = metrics::judge(&m, &tol).is_empty();
        tc.metrics = Some(m);
    }
    let mut held_other = false;
    if let Some(r) = e.rank {
        // Which rank's slice does this shard hold? Another rank's is a rank-level finding.
        let held = (0..tp).find(|&k| {
            let (x, s, _) = p.rank_slice(cfg.dims(), tp, k);
            s == e.shape && rel(&e.data, &x) <= thr
        });
        held_other = held.is_some_and(|k| k != r);
        holds.entry((e.layer, e.param.clone())).or_default().push((r, held));
    }
    if !tc.pass && !held_other {
        findings.push(explain_loaded(&Failing {
            name: &e.name,
            param: &e.param,
            p,
            data: &e.data,
            shape: &e.shape,
            exp: &exp,
            exp_shape: &exp_shape,
            rank: e.rank.map(|r| (r, range)),
            cfg,
            thr,
        }));
    }
    Some(tc)
}
