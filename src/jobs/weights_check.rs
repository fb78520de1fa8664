//! `mla-diff weights --check`: an engine's weights as loaded, against the GGUF.
//!
//! The bugs behind this project were in the weights, not in a kernel: the shards of a fused
//! projection came out of GGUF dequantization in the wrong order, and every TP rank kept rank
//! 0's slice of a quantized merged-column `gate_up_proj`. An engine's loaded weights
//! (dequantized, fused, sharded per tensor-parallel rank, absorbed into `W_UK_T`/`W_UV`) can be
//! dumped with vLLM's parameter names and checked here against the same tensors rebuilt from the
//! GGUF. This job reads the file, rebuilds each param and judges each tensor; a tensor that
//! differs is explained by the detectors of [`crate::judge::diagnose::loaded`] (fused shards in
//! the wrong order, a rank holding another rank's slice, a missing shard, a transposed matrix, a
//! shard cut inside a quant block), and [`crate::output::weights_check`] renders the report.
//! `compare` judges the `weights.*` tensors of a format-2 dump through [`check_dump_weights`],
//! the same code.
//!
//! File format: safetensors, tensors `L{n}.{param}` (whole) or `L{n}.{param}.rank{r}` (one TP
//! rank's shard), PyTorch `[out, in]` layout, any float dtype; params are vLLM's names without
//! `self_attn.`/`mlp.` and `.weight` (`vllm/model_executor/models/deepseek_v2.py`):
//! `fused_qkv_a_proj`, `q_a_proj`, `q_b_proj`, `q_proj`, `kv_a_proj_with_mqa`, `kv_b_proj`,
//! `o_proj`, the MLA backend's `W_UK_T` `[N, P, L]` and `W_UV` `[N, L, V]`
//! (`vllm/v1/attention/backends/mla/common.py`), and the FFN's `gate_up_proj` `[2·F, H]`,
//! `down_proj` `[H, F]` (dense layers) and `shared_experts.gate_up_proj`,
//! `shared_experts.down_proj` (MoE layers). Metadata: `tp_size` (else the largest rank + 1),
//! `dtype` (`f32` exact, `bf16`/`f16` judged by the bf16 weight row), `engine`. A format-2 dump
//! holds them as `weights.L{n}.…`; its header gives the engine, the dtype, `tp` (size, rank) and
//! `heads`, and binds the dump to its GGUF (another model's dump is refused).

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
use crate::judge::diagnose::loaded::{self, Failing, Held, Holds, Param, Source, match_threshold};
use crate::judge::metrics;
use crate::judge::tolerance::tolerance;
use crate::judge::weights_check::{TensorCheck, WeightsReport};
use crate::model::config::MlaConfig;
use crate::model::dump::{DumpHeader, FORMAT1, FORMAT2, Map, check_identity};
use crate::model::gguf::GgufFile;
use crate::model::tensors::{self, ModelTensor};
use crate::model::weights::{LayerWeights, MoeWeights, QWeights};

/// The params named `wanted` of layer `w.layer` rebuilt from the GGUF `file`, by the name a
/// weights dump gives them: the tensor table's [`tensors::dump_params`] of the model's layout
/// (`q_proj` or the LoRA three, and the rest; the dense MLP's in a dense layer, the shared
/// experts' in an MoE layer when `moe` holds them), each with its TP split, merged shards and
/// GGUF sources. Only the wanted ones: a real model's dense `gate_up_proj` alone is gigabytes
/// in f64.
fn params(
    file: &GgufFile,
    cfg: &MlaConfig,
    w: &LayerWeights,
    moe: Option<&MoeWeights>,
    wanted: &[&str],
) -> BTreeMap<&'static str, Param> {
    let [n, l, p, _, v] = cfg.dims().nlprv();
    let layer = w.layer;
    let info = |t: ModelTensor| {
        let name = t.name(layer);
        match file.tensor(&name) {
            Some(i) => Source {
                name: file.source_name(i),
                ggml_type: file.stored_type(i),
                block: i.ggml_type.block_size(),
                scales: file.block_scales(i),
            },
            None => Source {
                name,
                ggml_type: "?".into(),
                block: 1,
                scales: None,
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
            (ModelTensor::FfnGate, _) => w.ffn.as_ref().map(|f| widen_to_f64(&f.gate)),
            (ModelTensor::FfnUp, _) => w.ffn.as_ref().map(|f| widen_to_f64(&f.up)),
            (ModelTensor::FfnDown, _) => w.ffn.as_ref().map(|f| widen_to_f64(&f.down)),
            (ModelTensor::FfnGateShexp, _) => moe?.shared.as_ref().map(|f| widen_to_f64(&f.gate)),
            (ModelTensor::FfnUpShexp, _) => moe?.shared.as_ref().map(|f| widen_to_f64(&f.up)),
            (ModelTensor::FfnDownShexp, _) => moe?.shared.as_ref().map(|f| widen_to_f64(&f.down)),
            _ => None,
        }
    };
    let flat = |a: &Array2<f64>| (a.iter().copied().collect::<Vec<f64>>(), a.shape().to_vec());
    let kv_b = if wanted.iter().any(|p| ["kv_b_proj", "W_UK_T", "W_UV"].contains(p)) {
        assemble_kv_b(cfg, &w.kv_b)
    } else {
        Array2::zeros((0, 0))
    };
    let mut m = BTreeMap::new();
    for dp in tensors::dump_params(cfg) {
        if !wanted.contains(&dp.name) {
            continue;
        }
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
                let Some(mats) = parts.iter().map(|&t| matrix(t)).collect::<Option<Vec<Array2<f64>>>>() else {
                    // A param this layer does not have (the dense MLP in an MoE layer, …).
                    continue;
                };
                let views: Vec<_> = mats.iter().map(|a| a.view()).collect();
                let Ok(a) = ndarray::concatenate(ndarray::Axis(0), &views) else {
                    continue;
                };
                flat(&a)
            }
        };
        // The merged shards' rows, from the file's index (PyTorch order: rows first).
        let shards = dp
            .shards
            .iter()
            .filter_map(|&t| {
                let checkpoint = t.row().vllm?.merged?.checkpoint;
                let rows = *file.tensor(&t.name(layer))?.shape().first()?;
                Some((tensors::dump_name(checkpoint), usize::try_from(rows).ok()?))
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

/// One param tensor read from the weights file.
struct Entry {
    /// Its name in the file (`weights.L0.gate_up_proj.rank1` in a format-2 dump).
    file_name: String,
    /// Its name as a weights file gives it (`L0.gate_up_proj.rank1`).
    name: String,
    layer: usize,
    param: String,
    rank: Option<usize>,
    shape: Vec<usize>,
    data: Vec<f64>,
    /// safetensors dtype string (`F32`, `BF16`, …).
    dtype: String,
}

/// Parses `L{n}.{param}` or `L{n}.{param}.rank{r}` for a param of
/// [`tensors::dump_param_names`].
fn parse_name(name: &str) -> Option<(usize, String, Option<usize>)> {
    let (layer, param, rank) = split_name(name)?;
    tensors::dump_param_names()
        .contains(&param)
        .then(|| (layer, param.to_string(), rank))
}

/// Splits `L{n}.{param}` or `L{n}.{param}.rank{r}` into its parts, whatever the param.
fn split_name(name: &str) -> Option<(usize, &str, Option<usize>)> {
    let rest = name.strip_prefix('L')?;
    let (layer, rest) = rest.split_once('.')?;
    let layer = layer.parse().ok()?;
    Some(match rest.rsplit_once(".rank") {
        Some((p, r)) => (layer, p, Some(r.parse().ok()?)),
        None => (layer, rest, None),
    })
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
/// Errors: an unreadable or malformed file (a format-2 header included), an activation dump
/// (the file `compare` reads), a format-2 dump of another model ([`check_identity`]: exit 2
/// naming both files), a tensor with an integer dtype or with another number of dims than its
/// param, a layer out of range, GGUF tensors that cannot be loaded, no known param at all in the
/// file, a TP size that does not fit the model.
pub fn check(file: &GgufFile, cfg: &MlaConfig, path: &Path, map: Option<&Map>) -> Result<WeightsReport> {
    let wf = read_weights_file(cfg, path, map)?;
    refuse_activation_dump(path, &wf.metadata, &wf.names, wf.header.is_some())?;
    if wf.entries.is_empty() {
        return Err(bad(
            path,
            "tensors",
            format!(
                "no weight found (names like `L0.kv_b_proj` or `L0.gate_up_proj.rank1`; params {}); {} other tensor(s)",
                tensors::dump_param_names().join(", "),
                wf.ignored.len()
            ),
        ));
    }
    judge_file(file, cfg, path, wf)
}

/// The loaded weights a format-2 dump carries (`weights.L{n}.…`), judged exactly as
/// [`check`] judges them (`compare` calls this: one implementation); `None` when the dump
/// holds no weight `weights --check` knows.
///
/// Errors: as [`check`]'s, except that a dump without weights is not one.
pub fn check_dump_weights(file: &GgufFile, cfg: &MlaConfig, path: &Path) -> Result<Option<WeightsReport>> {
    let wf = read_weights_file(cfg, path, None)?;
    if wf.entries.is_empty() {
        return Ok(None);
    }
    judge_file(file, cfg, path, wf).map(Some)
}

/// Judges every entry of `wf` (read from `path`) against the GGUF: the model's identity for a
/// format-2 dump, the TP size, each tensor, then how the ranks' shards fit together.
fn judge_file(file: &GgufFile, cfg: &MlaConfig, path: &Path, wf: WeightsFile) -> Result<WeightsReport> {
    let WeightsFile {
        metadata,
        header,
        dtype,
        entries,
        ignored,
        ..
    } = wf;
    if let Some(h) = &header {
        let mut layers: Vec<usize> = entries.iter().map(|e| e.layer).collect();
        layers.dedup();
        check_identity(path, h, file, &layers)?;
    }
    let Tp { tp, expected } = tp_size(path, &metadata, header.as_ref(), &entries, cfg)?;
    let mut cache: BTreeMap<usize, BTreeMap<&'static str, Param>> = BTreeMap::new();
    for layer in entries.iter().map(|e| e.layer) {
        if let std::collections::btree_map::Entry::Vacant(slot) = cache.entry(layer) {
            let w = LayerWeights::load(file, cfg, layer)?;
            let mut wanted: Vec<&str> = entries
                .iter()
                .filter(|e| e.layer == layer)
                .map(|e| e.param.as_str())
                .collect();
            // W_UK_T and W_UV are judged against the kv_b rows they come from (a grouped split
            // mixes a head's k and v rows).
            if wanted.iter().any(|p| ["W_UK_T", "W_UV"].contains(p)) {
                wanted.push("kv_b_proj");
            }
            // The shared experts load with the layer's MoE weights, only when the file holds
            // them: the router and the routed experts' shapes are checked on the way.
            let wants_shared = wanted.iter().any(|p| p.starts_with("shared_experts."));
            let moe = if wants_shared && cfg.is_moe_layer(layer) && cfg.moe.is_some() {
                Some(MoeWeights::load(file, cfg, layer)?)
            } else {
                None
            };
            slot.insert(params(file, cfg, &w, moe.as_ref(), &wanted));
        }
    }
    let mut tensors = Vec::new();
    let mut findings = Vec::new();
    // Per (layer, param): which rank's slice each file shard holds.
    let mut holds: Holds = BTreeMap::new();
    for e in &entries {
        let Some(p) = cache[&e.layer].get(e.param.as_str()) else {
            findings.push(loaded::param_absent(&e.name, &e.param, e.rank, e.layer, cfg));
            continue;
        };
        if e.shape.len() != p.shape.len() {
            return Err(bad(
                path,
                &e.file_name,
                format!(
                    "shape {:?} has {} dims; `{}` has {} ({:?} from {})",
                    e.shape,
                    e.shape.len(),
                    e.param,
                    p.shape.len(),
                    p.shape,
                    p.source_text()
                ),
            ));
        }
        let kv_b = cache[&e.layer].get("kv_b_proj").map(|k| k.data.as_slice());
        if let Some(tc) = check_entry(e, p, kv_b, cfg, dtype, tp, &mut holds, &mut findings) {
            tensors.push(tc);
        }
    }
    findings.extend(loaded::rank_findings(holds, &cache, tp, &expected));
    let engine = match &header {
        Some(h) => format!("{} {}", h.engine.name, h.engine.version).trim().to_string(),
        None => metadata.get("engine").cloned().unwrap_or_default(),
    };
    Ok(WeightsReport {
        model: file.path().display().to_string(),
        weights: path.display().to_string(),
        engine: if engine.is_empty() { "unknown".into() } else { engine },
        tp,
        heads: header.as_ref().and_then(|h| h.heads),
        metadata_dtype: header
            .as_ref()
            .map_or_else(|| metadata.get("dtype").cloned(), |h| h.dtype.clone()),
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

/// What [`read_weights_file`] reads: the file's `__metadata__`, a format-2 dump's header, the
/// dtype it declares, the params found (sorted by name), the names of the tensors that are not
/// params `weights --check` knows, and every tensor name of the file.
struct WeightsFile {
    metadata: BTreeMap<String, String>,
    header: Option<DumpHeader>,
    dtype: Dtype,
    entries: Vec<Entry>,
    ignored: Vec<String>,
    names: Vec<String>,
}

/// Reads every param tensor of the weights file `path` (format 1 names, `weights.…` tensors of
/// a format-2 dump, or names `map` renames), decoded to f64; a format-2 dump's header is read
/// and checked by `compare`'s reader, and gives the dtype.
///
/// Errors: an unreadable or malformed file or header, a bad `dtype`, a layer out of range, an
/// integer dtype.
fn read_weights_file(cfg: &MlaConfig, path: &Path, map: Option<&Map>) -> Result<WeightsFile> {
    let bytes = crate::core::fsio::read_regular(path)?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| header_error(path, &bytes, &e))?;
    let (_, meta) = SafeTensors::read_metadata(&bytes).map_err(|e| header_error(path, &bytes, &e))?;
    let metadata: BTreeMap<String, String> = meta.metadata().clone().unwrap_or_default().into_iter().collect();
    // A format-2 dump carries the weights as `weights.L{n}.{param}` next to its steps, and its
    // engine, dtype, TP size and heads in the header.
    let header = crate::model::dump::header_from_metadata(
        path,
        metadata.get("format").map(String::as_str),
        metadata.get("header").map(String::as_str),
    )?;
    let (dtype_what, dtype_text) = match &header {
        Some(h) => ("__metadata__.header.dtype", h.dtype.clone()),
        None => ("__metadata__.dtype", metadata.get("dtype").cloned()),
    };
    let dtype = match dtype_text.as_deref() {
        None | Some("f32" | "float32" | "f64") => Dtype::F32,
        Some("bf16" | "bfloat16" | "f16" | "float16") => Dtype::Bf16,
        Some(o) => {
            return Err(bad(path, dtype_what, format!("`{o}`: expected f32, bf16 or f16")));
        }
    };

    let mut entries: Vec<Entry> = Vec::new();
    let mut ignored = Vec::new();
    let mut names: Vec<String> = st.names().into_iter().map(str::to_string).collect();
    names.sort();
    for full_name in &names {
        let name = if header.is_some() {
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
        let view = st.tensor(full_name).map_err(|e| bad(path, full_name, e.to_string()))?;
        let tt = crate::core::st::decode_tensor(path, full_name, &view)?;
        if !crate::core::st::is_float_dtype(view.dtype()) {
            return Err(bad(
                path,
                &name,
                format!("integer dtype {:?}; weights must be floats", view.dtype()),
            ));
        }
        entries.push(Entry {
            file_name: full_name.clone(),
            name,
            layer,
            param,
            rank,
            shape: view.shape().to_vec(),
            data: tt.to_f64(),
            dtype: format!("{:?}", view.dtype()),
        });
    }
    Ok(WeightsFile {
        metadata,
        header,
        dtype,
        entries,
        ignored,
        names,
    })
}

/// The TP size the shards are cut for, and the ranks whose shards the file should hold.
struct Tp {
    tp: usize,
    /// Every rank of `0..tp`, or for a format-2 dump of one rank's heads, that rank.
    expected: Vec<usize>,
}

/// The TP size of the file: a format-2 header's `tp.size` (one rank's dump: `tp.rank`), else
/// its `heads = [a, b]` (one rank of `N / (b − a)`, rank `a / (b − a)`), else
/// `__metadata__.tp_size`, else one more than the highest shard rank (1 without shards).
///
/// Errors: [`Error::Safetensors`] naming the field: a TP size that is not a positive integer or
/// does not divide the `N` heads, `heads` that are no rank's share of the heads, or a `tp` that
/// `heads` contradicts.
fn tp_size(
    path: &Path,
    metadata: &BTreeMap<String, String>,
    header: Option<&DumpHeader>,
    entries: &[Entry],
    cfg: &MlaConfig,
) -> Result<Tp> {
    let n = cfg.n_head;
    let heads = header.and_then(|h| h.heads);
    // One rank's heads: (tp, rank) from `heads = [a, b]`.
    let from_heads = match heads {
        Some([a, b]) if a == 0 && b == n => None,
        Some([a, b]) => {
            let w = b.saturating_sub(a);
            if w == 0 || b > n || !n.is_multiple_of(w) || !a.is_multiple_of(w) {
                return Err(bad(
                    path,
                    "__metadata__.header.heads",
                    format!("[{a}, {b}] is not one TP rank's share of the {n} heads"),
                ));
            }
            Some((n / w, a / w))
        }
        None => None,
    };
    let declared = header.and_then(|h| h.tp.as_ref());
    let (field, tp, rank) = match (declared, from_heads) {
        (Some(t), _) => ("__metadata__.header.tp.size", t.size, t.rank),
        (None, Some((t, r))) => ("__metadata__.header.heads", t, Some(r)),
        (None, None) => match metadata.get("tp_size") {
            Some(s) => (
                "__metadata__.tp_size",
                s.trim()
                    .parse::<usize>()
                    .ok()
                    .filter(|&t| t >= 1)
                    .ok_or_else(|| bad(path, "__metadata__.tp_size", format!("`{s}` is not a positive integer")))?,
                None,
            ),
            None => (
                "__metadata__.tp_size",
                entries.iter().filter_map(|e| e.rank).max().map_or(1, |r| r + 1),
                None,
            ),
        },
    };
    if tp == 0 || !n.is_multiple_of(tp) {
        return Err(bad(path, field, format!("{tp} does not divide the {n} heads")));
    }
    if let (Some((t, r)), Some(d)) = (from_heads, declared)
        && (t != d.size || d.rank.is_some_and(|dr| dr != r))
    {
        return Err(bad(
            path,
            "__metadata__.header.tp",
            format!(
                "size {} rank {:?}, but `heads` {:?} are rank {r}'s share at tp {t}",
                d.size,
                d.rank,
                heads.unwrap_or_default()
            ),
        ));
    }
    let expected = match rank {
        Some(r) => vec![r],
        None => (0..tp).collect(),
    };
    Ok(Tp { tp, expected })
}

/// Judges one file tensor `e` against the GGUF's param `p` (or, for a shard, its rank's slice):
/// returns its row of the report, or `None` for a rank outside `0..tp` (a finding). Records
/// which rank's slice a shard holds in `holds`, and pushes the explanation of a failing tensor
/// that holds no other rank's slice to `findings`; `kv_b` is the layer's `kv_b_proj` rebuilt from
/// the GGUF, which the kv_b layout hypotheses of a kv_b-derived tensor read.
#[allow(
    clippy::too_many_arguments,
    reason = "the tensor and what it is judged against (e, p, kv_b), the model and how to judge (cfg, dtype, tp), and the two accumulators of the file's judgement"
)]
fn check_entry(
    e: &Entry,
    p: &Param,
    kv_b: Option<&[f64]>,
    cfg: &MlaConfig,
    dtype: Dtype,
    tp: usize,
    holds: &mut Holds,
    findings: &mut Vec<Finding>,
) -> Option<TensorCheck> {
    let tol = tolerance(Stage::WKvB, dtype).0;
    let thr = match_threshold(dtype);
    let (exp, exp_shape, ranges) = match e.rank {
        Some(r) if r < tp => p.rank_slice(cfg.dims(), tp, r),
        Some(r) => {
            findings.push(loaded::rank_out_of_range(&e.name, r, tp, p));
            return None;
        }
        None => (p.data.clone(), p.shape.clone(), Vec::new()),
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
        let slice_rel = |k: usize| {
            let (x, s, _) = p.rank_slice(cfg.dims(), tp, k);
            if s == e.shape { rel(&e.data, &x) } else { f64::NAN }
        };
        let rel_own = slice_rel(r);
        let found = (0..tp).map(|k| (k, slice_rel(k))).find(|&(_, x)| x <= thr);
        held_other = found.is_some_and(|(k, _)| k != r);
        holds.entry((e.layer, e.param.clone())).or_default().push(Held {
            rank: r,
            holds: found.map(|(k, _)| k),
            rel_held: found.map_or(f64::NAN, |(_, x)| x),
            rel_own,
        });
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
            rank: e.rank.map(|r| (r, ranges)),
            cfg,
            thr,
            tp,
            kv_b,
        }));
    }
    Some(tc)
}
