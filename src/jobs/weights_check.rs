//! `mla-diff weights --check`: an engine's MLA weights as loaded, against the GGUF.
//!
//! The second bug behind this project was in the weights, not in a kernel: the shards of a fused
//! projection came out of GGUF dequantization in the wrong order. An engine's loaded weights
//! (dequantized, fused, sharded per tensor-parallel rank, absorbed into `W_UK_T`/`W_UV`) can be
//! dumped with vLLM's parameter names and checked here against the same tensors rebuilt from the
//! GGUF. A tensor that differs is explained with the block-permutation finder: fused shards in
//! the wrong order, a rank holding another rank's slice (or every rank holding rank 0's), a
//! missing shard, a transposed matrix, or a shard cut inside a quant block.
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

use safetensors::SafeTensors;
use serde::Serialize;

use crate::compute::reference::{assemble_kv_b, widen_to_f64};
use crate::core::class::Class;
use crate::core::dtype::Dtype;
use crate::core::error::{Error, Result};
use crate::core::st::header_error;
use crate::core::trace::{Stage, TraceTensor};
use crate::judge::diagnose::blocks::find_blocks;
use crate::judge::diagnose::blocks::rel_l2 as rel;
use crate::judge::metrics::{self, Metrics};
use crate::judge::tolerance::tolerance;
use crate::model::config::{KvBLayout, MlaConfig};
use crate::model::dump::{FORMAT1, FORMAT2, Map};
use crate::model::gguf::GgufFile;
use crate::model::weights::{LayerWeights, QWeights, tensor_name};

/// How tensor parallelism splits a parameter (vLLM's linear layer kinds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Split {
    /// Every rank holds the whole tensor (`ReplicatedLinear`: `fused_qkv_a_proj`, `q_a_proj`,
    /// `kv_a_proj_with_mqa`).
    Replicated,
    /// Rows (dim 0) split by heads, `unit` rows per head (`ColumnParallelLinear`: `q_b_proj`,
    /// `q_proj`, `kv_b_proj`; and `W_UK_T`/`W_UV` by their head dim with unit 1).
    Rows(usize),
    /// Columns (dim 1) split by heads, `unit` columns per head (`RowParallelLinear`: `o_proj`).
    Cols(usize),
}

/// One GGUF tensor a parameter is built from.
struct Source {
    /// GGUF tensor name, e.g. `blk.1.attn_k_b.weight`.
    name: String,
    /// Its ggml type name (`F32`, `Q8_0`, `Q4_K`, …; `?` when the file lacks the tensor).
    ggml_type: String,
    /// Its quant block size along ne[0] (1 for float types).
    block: u64,
}

/// One parameter rebuilt from the GGUF.
struct Param {
    data: Vec<f64>,
    shape: Vec<usize>,
    split: Split,
    /// Fused shards along dim 0 (name, rows), for shard-order findings.
    shards: Vec<(&'static str, usize)>,
    /// The GGUF tensors it is built from, in order (the first one's block size serves the
    /// column-cut check of `o_proj`).
    sources: Vec<Source>,
}

impl Param {
    /// The source tensors as text: `blk.1.attn_k_b.weight (Q8_0)`, joined by `+`.
    fn source_text(&self) -> String {
        self.sources
            .iter()
            .map(|s| format!("{} ({})", s.name, s.ggml_type))
            .collect::<Vec<_>>()
            .join(" + ")
    }

    /// The source tensor names only.
    fn source_names(&self) -> Vec<String> {
        self.sources
            .iter()
            .map(|s| format!("{} ({})", s.name, s.ggml_type))
            .collect()
    }
}

fn params(file: &GgufFile, cfg: &MlaConfig, w: &LayerWeights) -> BTreeMap<&'static str, Param> {
    let [n, l, p, r, v] = cfg.dims().nlprv();
    let layer = w.layer;
    let info = |name: &str| {
        let t = tensor_name(layer, name);
        match file.tensor(&t) {
            Some(i) => Source {
                name: t,
                ggml_type: i.ggml_type.name().to_string(),
                block: i.ggml_type.block_size(),
            },
            None => Source {
                name: t,
                ggml_type: "?".into(),
                block: 1,
            },
        }
    };
    let flat = |a: &ndarray::Array2<f64>| (a.iter().copied().collect::<Vec<f64>>(), a.shape().to_vec());
    let mut m = BTreeMap::new();
    let mut put = |name: &'static str, (data, shape): (Vec<f64>, Vec<usize>), split, shards, srcs: &[&str]| {
        let sources = srcs.iter().map(|s| info(s)).collect();
        m.insert(
            name,
            Param {
                data,
                shape,
                split,
                shards,
                sources,
            },
        );
    };
    let kv_a = widen_to_f64(&w.kv_a_mqa);
    put(
        "kv_a_proj_with_mqa",
        flat(&kv_a),
        Split::Replicated,
        vec![],
        &["attn_kv_a_mqa"],
    );
    match &w.q {
        QWeights::Lora { q_a, q_b, .. } => {
            let qa = widen_to_f64(q_a);
            let lq = qa.shape()[0];
            let fused = ndarray::concatenate(ndarray::Axis(0), &[qa.view(), kv_a.view()]).expect("same H");
            put(
                "fused_qkv_a_proj",
                flat(&fused),
                Split::Replicated,
                vec![("q_a_proj", lq), ("kv_a_proj_with_mqa", l + r)],
                &["attn_q_a", "attn_kv_a_mqa"],
            );
            put("q_a_proj", flat(&qa), Split::Replicated, vec![], &["attn_q_a"]);
            put(
                "q_b_proj",
                flat(&widen_to_f64(q_b)),
                Split::Rows(p + r),
                vec![],
                &["attn_q_b"],
            );
        }
        QWeights::Direct { q } => put(
            "q_proj",
            flat(&widen_to_f64(q)),
            Split::Rows(p + r),
            vec![],
            &["attn_q"],
        ),
    }
    let kv_b = assemble_kv_b(cfg, &w.kv_b);
    // W_UK_T comes from attn_k_b, W_UV from attn_v_b, kv_b_proj from both (interleaved per head);
    // a legacy file holds all three in attn_kv_b.
    let fused = matches!(w.kv_b, crate::model::weights::KvBWeights::Fused { .. });
    let (kv_b_src, uk_src, uv_src): (&[&str], &[&str], &[&str]) = if fused {
        (&["attn_kv_b"], &["attn_kv_b"], &["attn_kv_b"])
    } else {
        (&["attn_k_b", "attn_v_b"], &["attn_k_b"], &["attn_v_b"])
    };
    put("kv_b_proj", flat(&kv_b), Split::Rows(p + v), vec![], kv_b_src);
    put(
        "o_proj",
        flat(&widen_to_f64(&w.o_proj)),
        Split::Cols(v),
        vec![],
        &["attn_output"],
    );
    let mut uk = Vec::with_capacity(n * p * l);
    let mut uv = Vec::with_capacity(n * l * v);
    for h in 0..n {
        for pi in 0..p {
            for li in 0..l {
                uk.push(kv_b[[h * (p + v) + pi, li]]);
            }
        }
    }
    for h in 0..n {
        for li in 0..l {
            for vi in 0..v {
                uv.push(kv_b[[h * (p + v) + p + vi, li]]);
            }
        }
    }
    put("W_UK_T", (uk, vec![n, p, l]), Split::Rows(1), vec![], uk_src);
    put("W_UV", (uv, vec![n, l, v]), Split::Rows(1), vec![], uv_src);
    m
}

/// The slice of `p` that rank `rank` of `tp` holds, with its shape and the range it covers
/// along the split dim.
fn rank_slice(p: &Param, n_head: usize, tp: usize, rank: usize) -> (Vec<f64>, Vec<usize>, (usize, usize)) {
    let nh = n_head / tp;
    match p.split {
        Split::Replicated => (p.data.clone(), p.shape.clone(), (0, p.shape[0])),
        Split::Rows(unit) => {
            let rows = nh * unit;
            let inner: usize = p.shape[1..].iter().product();
            let d = p.data[rank * rows * inner..(rank + 1) * rows * inner].to_vec();
            let mut s = p.shape.clone();
            s[0] = rows;
            (d, s, (rank * rows, (rank + 1) * rows))
        }
        Split::Cols(unit) => {
            let cols = nh * unit;
            let d = crate::judge::diagnose::blocks::take_along(&p.data, &p.shape, 1, rank * cols, cols);
            (d, vec![p.shape[0], cols], (rank * cols, (rank + 1) * cols))
        }
    }
}

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

/// A finding about the loaded weights.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WeightFinding {
    /// Bug class.
    pub class: Class,
    /// The tensor(s) involved, e.g. `L0.kv_b_proj.rank1`.
    pub tensor: String,
    /// What the numbers show, naming the blocks.
    pub evidence: String,
    /// Where to look.
    pub hint: String,
    /// The GGUF tensors the correct values come from, each with its ggml type name, e.g.
    /// `blk.1.attn_k_b.weight (Q8_0)` for `W_UK_T` (empty when the model has no such param).
    pub source: Vec<String>,
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
    /// The file's `dtype` metadata as written (`bf16`, `float16`, …), `None` when absent.
    pub metadata_dtype: Option<String>,
    /// Dtype whose weight tolerance applied (`bf16` also for f16 files).
    pub dtype: Dtype,
    /// One entry per tensor checked, by layer, param, rank.
    pub tensors: Vec<TensorCheck>,
    /// Findings, one per problem.
    pub findings: Vec<WeightFinding>,
    /// File tensors that are not MLA params (ignored).
    pub ignored: Vec<String>,
}

impl WeightsReport {
    /// True when every tensor passed and nothing was found.
    pub fn all_pass(&self) -> bool {
        self.findings.is_empty() && self.tensors.iter().all(|t| t.pass)
    }
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

/// Per (layer, param): each file shard's rank and the rank whose slice it holds.
type Holds = BTreeMap<(usize, String), Vec<(usize, Option<usize>)>>;

const PARAMS: &[&str] = &[
    "fused_qkv_a_proj",
    "q_a_proj",
    "q_b_proj",
    "q_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
    "o_proj",
    "W_UK_T",
    "W_UV",
];

/// Parses `L{n}.{param}` or `L{n}.{param}.rank{r}`.
fn parse_name(name: &str) -> Option<(usize, String, Option<usize>)> {
    let rest = name.strip_prefix('L')?;
    let (layer, rest) = rest.split_once('.')?;
    let layer = layer.parse().ok()?;
    let (param, rank) = match rest.rsplit_once(".rank") {
        Some((p, r)) => (p, Some(r.parse().ok()?)),
        None => (rest, None),
    };
    PARAMS.contains(&param).then(|| (layer, param.to_string(), rank))
}

/// Threshold under which a block "is" another block: 1e-6 for exact dtypes, 1e-2 for bf16.
fn match_threshold(dtype: Dtype) -> f64 {
    match dtype {
        Dtype::F32 => 1e-6,
        Dtype::Bf16 => 1e-2,
    }
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
            findings.push(WeightFinding {
                class: Class::Mismatch,
                tensor: e.name.clone(),
                evidence: format!("the model has no `{}` (q_lora_rank {:?})", e.param, cfg.q_lora_rank),
                hint: "q_a_proj/q_b_proj/fused_qkv_a_proj exist only with q_lora_rank; q_proj only without".into(),
                source: Vec::new(),
            });
            continue;
        };
        if let Some(tc) = check_entry(e, p, cfg, dtype, tp, &mut holds, &mut findings) {
            tensors.push(tc);
        }
    }
    findings.extend(rank_findings(holds, &cache, tp));
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
                PARAMS.join(", "),
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
    findings: &mut Vec<WeightFinding>,
) -> Option<TensorCheck> {
    let tol = tolerance(Stage::WKvB, dtype).0;
    let thr = match_threshold(dtype);
    let (exp, exp_shape, range) = match e.rank {
        Some(r) if r < tp => rank_slice(p, cfg.n_head, tp, r),
        Some(r) => {
            findings.push(WeightFinding {
                class: Class::TpRankOrder,
                tensor: e.name.clone(),
                evidence: format!("rank {r} ≥ tp_size {tp}"),
                hint: "shard names must use ranks 0..tp_size".into(),
                source: p.source_names(),
            });
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
            let (x, s, _) = rank_slice(p, cfg.n_head, tp, k);
            s == e.shape && rel(&e.data, &x) <= thr
        });
        held_other = held.is_some_and(|k| k != r);
        holds.entry((e.layer, e.param.clone())).or_default().push((r, held));
    }
    if !tc.pass && !held_other {
        findings.push(explain(&Failing {
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

/// Rank-level findings from `holds`: shards permuted or duplicated across ranks (each holding
/// another rank's slice), and ranks of `0..tp` with no shard in the file. Replicated params
/// have none.
fn rank_findings(
    holds: Holds,
    cache: &BTreeMap<usize, BTreeMap<&'static str, Param>>,
    tp: usize,
) -> Vec<WeightFinding> {
    let mut findings = Vec::new();
    for ((layer, param), mut v) in holds {
        v.sort();
        let p = &cache[&layer][param.as_str()];
        if p.split == Split::Replicated {
            continue;
        }
        let ranks: Vec<usize> = v.iter().map(|x| x.0).collect();
        let missing: Vec<usize> = (0..tp).filter(|r| !ranks.contains(r)).collect();
        let held: Vec<Option<usize>> = v.iter().map(|x| x.1).collect();
        let wrong = v.iter().any(|(r, h)| h.is_some_and(|h| h != *r));
        if wrong {
            findings.push(WeightFinding {
                class: Class::TpRankOrder,
                tensor: format!("L{layer}.{param}.rank*"),
                evidence: permuted_shards_evidence(&ranks, &held, p, tp),
                hint: "each rank must take its own slice of the head dim (vLLM weight_loader: narrow(dim, tp_rank * shard_size, shard_size)); check the rank index the loader uses".into(),
                source: p.source_names(),
            });
        }
        if !missing.is_empty() && tp > 1 {
            findings.push(WeightFinding {
                class: Class::TpRankOrder,
                tensor: format!("L{layer}.{param}.rank*"),
                evidence: format!("missing shard(s): rank(s) {missing:?} of tp {tp} not in the file"),
                hint: "dump every rank's shard (or set tp_size metadata)".into(),
                source: p.source_names(),
            });
        }
    }
    findings
}

/// The evidence of shards that hold other ranks' slices: file ranks `ranks` hold slices `held`
/// (`?`: no rank's), with the slices duplicated and those held by no rank.
fn permuted_shards_evidence(ranks: &[usize], held: &[Option<usize>], p: &Param, tp: usize) -> String {
    let text = |h: &[Option<usize>]| {
        let parts: Vec<String> = h.iter().map(|x| x.map_or("?".into(), |k| k.to_string())).collect();
        format!("[{}]", parts.join(","))
    };
    let mut dup: Vec<usize> = held.iter().flatten().copied().collect();
    dup.sort();
    let duplicated: Vec<usize> = dup.windows(2).filter(|w| w[0] == w[1]).map(|w| w[0]).collect();
    let lost: Vec<usize> = (0..tp).filter(|k| !held.contains(&Some(*k))).collect();
    if held.iter().all(|h| *h == Some(0)) && tp > 1 {
        format!(
            "every rank holds rank 0's slice: ranks {:?} hold slices {} (duplicated shard 0; slices {:?} of {} are missing)",
            ranks,
            text(held),
            lost,
            p.source_text()
        )
    } else {
        format!(
            "ranks {:?} hold slices {}{}{}",
            ranks,
            text(held),
            if duplicated.is_empty() {
                String::new()
            } else {
                format!("; duplicated slices {duplicated:?}")
            },
            if lost.is_empty() {
                String::new()
            } else {
                format!("; slices {lost:?} held by no rank")
            }
        )
    }
}

/// A failing tensor of the file, with the GGUF param it is compared with: what [`explain`] reads.
struct Failing<'a> {
    /// The file's tensor name.
    name: &'a str,
    /// The MLA param (`kv_b_proj`, `W_UK_T`, …).
    param: &'a str,
    /// The param rebuilt from the GGUF.
    p: &'a Param,
    /// The file's values and shape.
    data: &'a [f64],
    shape: &'a [usize],
    /// The expected values and shape (a shard's: its rank's slice).
    exp: &'a [f64],
    exp_shape: &'a [usize],
    /// A shard's rank and the range of the head dim it should hold.
    rank: Option<(usize, (usize, usize))>,
    cfg: &'a MlaConfig,
    /// The rel_l2 at or under which a rearrangement counts as a match ([`match_threshold`]).
    thr: f64,
}

/// Explains one failing tensor: never loaded, transposed, fused shards permuted, heads
/// permuted, a column cut inside a quant block, or (fallback) where the differences are.
fn explain(f: &Failing<'_>) -> WeightFinding {
    not_loaded(f)
        .or_else(|| transposed(f))
        .or_else(|| shape_mismatch(f))
        .or_else(|| shard_order(f))
        .or_else(|| heads_permuted(f))
        .or_else(|| quant_block_cut(f))
        .unwrap_or_else(|| row_differences(f))
}

/// Never loaded: every element 0 (or NaN, the canary of a dump) where the GGUF's are not.
fn not_loaded(f: &Failing<'_>) -> Option<WeightFinding> {
    let expected_nonzero = f.exp.iter().any(|&x| x != 0.0);
    if expected_nonzero && !f.data.is_empty() && f.data.len() == f.exp.len() {
        let what = if f.data.iter().all(|&x| x == 0.0) {
            Some("0")
        } else if f.data.iter().all(|x| x.is_nan()) {
            Some("NaN")
        } else {
            None
        };
        if let Some(what) = what {
            let src = f.p.source_text();
            return Some(WeightFinding {
                class: Class::WeightNotLoaded,
                tensor: f.name.into(),
                source: f.p.source_names(),
                evidence: format!("all {} elements are {what}; {src} is not", f.data.len()),
                hint: format!(
                    "the engine never loaded this weight: its loader's tensor mapping has no entry for {src} \
                     (vllm-gguf-plugin 0.0.5 maps `attn_kv_b` but not the split `attn_k_b`/`attn_v_b` that \
                     current llama.cpp writes)"
                ),
            });
        }
    }
    None
}

/// Transposed: the expected tensor with its last two dims swapped (`[in, out]` for `[out, in]`);
/// for `W_UK_T`/`W_UV` a `kv_b` layout finding.
fn transposed(f: &Failing<'_>) -> Option<WeightFinding> {
    let k = f.exp_shape.len();
    if k >= 2 && f.shape.len() == k && f.shape[k - 1] == f.exp_shape[k - 2] && f.shape[k - 2] == f.exp_shape[k - 1] {
        let (a, b) = (f.exp_shape[k - 2], f.exp_shape[k - 1]);
        let batch: usize = f.exp_shape[..k - 2].iter().product();
        let mut t = vec![0.0; f.data.len()];
        for z in 0..batch {
            for i in 0..a {
                for j in 0..b {
                    t[z * a * b + i * b + j] = f.data[z * a * b + j * a + i];
                }
            }
        }
        let e = rel(&t, f.exp);
        if e <= f.thr {
            let src = f.p.source_text();
            let fused = f.cfg.kv_b_layout == KvBLayout::Fused;
            let (class, hint) = match (f.param, fused) {
                ("W_UK_T", false) => (
                    Class::KvBLayout,
                    format!(
                        "W_UK_T is [N, P, L]; {src} is stored [N, L, P] (ggml ne [P, L, N]) and needs a transpose of its last two dims, not a reshape"
                    ),
                ),
                ("W_UK_T", true) => (
                    Class::KvBLayout,
                    format!(
                        "W_UK_T is [N, P, L]: per head, the first P rows of {src} ([N·(P+V), L]) as stored; this tensor holds them transposed"
                    ),
                ),
                ("W_UV", false) => (
                    Class::KvBLayout,
                    format!(
                        "W_UV is [N, L, V]; this tensor holds it transposed, [N, V, L], the layout {src} is stored in: transpose its last two dims when loading, not a reshape"
                    ),
                ),
                ("W_UV", true) => (
                    Class::KvBLayout,
                    format!(
                        "W_UV is [N, L, V]: per head, the last V rows of {src} ([N·(P+V), L]) transposed; this tensor holds them untransposed ([N, V, L])"
                    ),
                ),
                _ => (
                    Class::Transposed,
                    format!(
                        "PyTorch linear weights are [out, in]; the GGUF's ne order is [in, out]: reverse the dims of {src} when loading"
                    ),
                ),
            };
            return Some(WeightFinding {
                class,
                tensor: f.name.into(),
                source: f.p.source_names(),
                evidence: format!(
                    "holds the expected {:?} transposed (shape {:?}; rel_l2 {e:.2e} after transposing back)",
                    f.exp_shape, f.shape
                ),
                hint,
            });
        }
    }
    None
}

/// A shape that no transpose explains.
fn shape_mismatch(f: &Failing<'_>) -> Option<WeightFinding> {
    if f.shape != f.exp_shape {
        return Some(WeightFinding {
            class: Class::Mismatch,
            tensor: f.name.into(),
            source: f.p.source_names(),
            evidence: format!(
                "shape {:?}, expected {:?} from {}",
                f.shape,
                f.exp_shape,
                f.p.source_text()
            ),
            hint: "check the loader's reshape/narrow of this parameter".into(),
        });
    }
    None
}

/// The shards of a fused projection concatenated in the wrong order.
fn shard_order(f: &Failing<'_>) -> Option<WeightFinding> {
    if !f.p.shards.is_empty() {
        let sizes: Vec<usize> = f.p.shards.iter().map(|s| s.1).collect();
        if let Some(m) = find_blocks(f.data, f.exp, f.shape, 0, &sizes, f.thr)
            && m.explains()
        {
            let names: Vec<String> =
                f.p.shards
                    .iter()
                    .enumerate()
                    .map(|(i, (n, r))| format!("{i} = {n} ({r} rows)"))
                    .collect();
            return Some(WeightFinding {
                class: Class::ShardOrder,
                tensor: f.name.into(),
                source: f.p.source_names(),
                evidence: format!("shard-order {}: {} (shards {})", m.map_text(), m.describe("shard"), names.join(", ")),
                hint: "the fused projection must be [q_a_proj | kv_a_proj_with_mqa], shard 0 then 1 (vLLM MergedReplicatedLinear loaded_shard_id order); check the order the GGUF shards are dequantized and concatenated".into(),
            });
        }
    }
    None
}

/// Heads permuted within a head-split tensor.
fn heads_permuted(f: &Failing<'_>) -> Option<WeightFinding> {
    let head_axis_unit = match f.p.split {
        Split::Rows(u) => Some((0, u)),
        Split::Cols(u) => Some((1, u)),
        Split::Replicated => None,
    };
    if let Some((axis, unit)) = head_axis_unit {
        let heads = f.shape[axis] / unit;
        if heads > 1
            && let Some(m) = find_blocks(f.data, f.exp, f.shape, axis, &vec![unit; heads], f.thr)
            && m.explains()
        {
            return Some(WeightFinding {
                class: Class::TpRankOrder,
                tensor: f.name.into(),
                source: f.p.source_names(),
                evidence: format!("per-head blocks of {unit} along dim {axis}: {}", m.describe("head")),
                hint: "heads are cut or concatenated in the wrong order".into(),
            });
        }
    }
    None
}

/// A TP column cut inside a quant block (o_proj shards: the input dim is the GGUF's ne[0]).
fn quant_block_cut(f: &Failing<'_>) -> Option<WeightFinding> {
    if let (Split::Cols(_), Some((r, (start, end))), Some(src0)) = (f.p.split, f.rank, f.p.sources.first())
        && let block = src0.block
        && block > 1
        && (!(start as u64).is_multiple_of(block) || !(end as u64).is_multiple_of(block))
    {
        let bad_at = if (start as u64).is_multiple_of(block) {
            end
        } else {
            start
        };
        let b0 = bad_at as u64 / block;
        return Some(WeightFinding {
            class: Class::QuantBlockMisaligned,
            tensor: f.name.into(),
            source: f.p.source_names(),
            evidence: format!(
                "rank {r} covers columns {start}..{end} of {} ({}, blocks of {} along ne[0]): the cut at column {bad_at} falls inside block {b0} (columns {}..{}), and the shard differs from the dequantized slice",
                src0.name,
                src0.ggml_type,
                block,
                b0 * block,
                (b0 + 1) * block
            ),
            hint: "dequantize before slicing, or keep TP cuts on block boundaries (N·V/tp must be a multiple of the block size)".into(),
        });
    }
    None
}

/// Fallback: which rows differ.
fn row_differences(f: &Failing<'_>) -> WeightFinding {
    let rows = f.shape[0];
    let inner: usize = f.shape[1..].iter().product();
    let bad: Vec<usize> = (0..rows)
        .filter(|&i| rel(&f.data[i * inner..(i + 1) * inner], &f.exp[i * inner..(i + 1) * inner]) > f.thr)
        .collect();
    WeightFinding {
        class: Class::Mismatch,
        tensor: f.name.into(),
        source: f.p.source_names(),
        evidence: format!(
            "{} of {rows} rows differ (first {:?}); rel_l2 {:.2e} overall",
            bad.len(),
            &bad[..bad.len().min(8)],
            rel(f.data, f.exp)
        ),
        hint: "no block permutation, duplicate or transpose explains it: compare the loader's dequantization of these rows".into(),
    }
}

/// The terminal table and findings of a weights check: a header (file, engine, TP size, the
/// `dtype` metadata string as written and the weight row it selects), one row per tensor (its
/// safetensors dtype, shape, expected shape, the GGUF tensors it is rebuilt from with their ggml
/// type names, status, `rel_l2` and max |Δ|), then the findings, each with its GGUF source.
pub fn terminal(rep: &WeightsReport) -> String {
    terminal_fit(rep, None)
}

/// [`terminal`] with the table fitted to `width` terminal columns (cells wrap, tensor names
/// stay whole); `None` leaves every cell on one line.
pub fn terminal_fit(rep: &WeightsReport, width: Option<usize>) -> String {
    let mut t = crate::output::table::bordered(&[
        "tensor",
        "dtype",
        "shape",
        "expected",
        "GGUF source (ggml type)",
        "status",
        "rel_l2",
        "max |Δ|",
    ]);
    for c in &rep.tensors {
        let (rel, max) = c.metrics.as_ref().map_or((String::new(), String::new()), |m| {
            (format!("{:.3e}", m.rel_l2), format!("{:.3e}", m.max_abs))
        });
        t.add_row(vec![
            c.name.clone(),
            c.file_dtype.clone(),
            format!("{:?}", c.shape),
            format!("{:?}", c.expected_shape),
            c.source.join(" + "),
            if c.pass { "pass".into() } else { "FAIL".into() },
            rel,
            max,
        ]);
    }
    if let Some(w) = width {
        t.set_content_arrangement(comfy_table::ContentArrangement::Dynamic)
            .set_width(u16::try_from(w).unwrap_or(u16::MAX));
        if let Some(c) = t.column_mut(0) {
            c.set_constraint(comfy_table::ColumnConstraint::ContentWidth);
        }
    }
    let mut s = format!(
        "weights {} (engine `{}`, tp {}, dtype metadata {}, judged by the {} weight row) against {}\n{t}\n",
        rep.weights,
        rep.engine,
        rep.tp,
        rep.metadata_dtype
            .as_deref()
            .map_or("absent (f32)".to_string(), |d| format!("`{d}`")),
        rep.dtype,
        rep.model
    );
    if !rep.ignored.is_empty() {
        s.push_str(&format!("ignored (not MLA params): {}\n", rep.ignored.join(", ")));
    }
    if rep.findings.is_empty() {
        s.push_str(&format!(
            "{}\n",
            if rep.all_pass() {
                format!("all {} tensors match the GGUF", rep.tensors.len())
            } else {
                "some tensors differ (see the table)".into()
            }
        ));
    }
    for f in &rep.findings {
        s.push_str(&format!(
            "finding {} at {}: {}\n  hint: {}\n",
            f.class, f.tensor, f.evidence, f.hint
        ));
        if !f.source.is_empty() {
            s.push_str(&format!("  GGUF source: {}\n", f.source.join(" + ")));
        }
    }
    s
}
