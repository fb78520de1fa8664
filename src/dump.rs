//! Engine dumps: what an external engine computed, read into our sites and layouts.
//!
//! People debug their own engine (vLLM, SGLang, llama.cpp, HF transformers, their own), not ours.
//! This module reads the safetensors dump that a hook script wrote (docs/dump-format.md), applies
//! a [`Map`] (renames from engine tensor names, HF's `[even|odd]` rope order, head-major shapes,
//! a `[rope | latent]` kv_a row) so that known layout differences are undone instead of reported
//! as bugs, validates every site's dtype and shape against the model's configuration, and returns
//! one [`Trace`] per dumped layer plus the batch (sequence lengths, positions) and the tokens.
//! Comparing it with the reference is [`compare_dump`]'s job.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ndarray::Array2;
use safetensors::{Dtype as StDtype, SafeTensors};
use serde::{Deserialize, Serialize};

use crate::batch::{Batch, SeqSpec};
use crate::compare;
use crate::config::MlaConfig;
use crate::diagnose::{self, DiagnoseInput, PathEvidence};
use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::paths::{PathKind, PathOptions};
use crate::run::{InputMode, ModelSummary, PathResult, RunConfig, RunReport};
use crate::tolerance::Dtype;
use crate::trace::{Site, Stage, Trace, TraceTensor};
use crate::weights::{LayerWeights, embed_tokens};

/// Order of the elements of every rotated rope vector in a dump.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RopeOrder {
    /// DeepSeek's interleaved pairs `(x[2i], x[2i+1])` (vLLM, llama.cpp, our sites).
    #[serde(rename = "interleaved")]
    Interleaved,
    /// `[rotated even elements | rotated odd elements]`, as HF's
    /// `apply_rotary_pos_emb_interleave` returns it.
    #[serde(rename = "hf")]
    Hf,
}

/// Axis order of `[T, N, X]` sites in a dump.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Layout {
    /// `[T, N, X]` (our sites, vLLM).
    #[serde(rename = "token-major")]
    TokenMajor,
    /// `[N, T, X]` (HF's attention tensors before the final transpose).
    #[serde(rename = "head-major")]
    HeadMajor,
}

/// Column order of `kv_a` rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum KvAOrder {
    /// `[kv_c (L) | k_pe (R)]`: vLLM, HF, current llama.cpp.
    #[serde(rename = "latent-rope")]
    LatentRope,
    /// `[k_pe (R) | kv_c (L)]`: older llama.cpp cache rows.
    #[serde(rename = "rope-latent")]
    RopeLatent,
}

/// A map from an engine's dump to our sites (docs/dump-format.md, "Maps").
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Map {
    /// Name shown in reports.
    #[serde(default)]
    pub name: Option<String>,
    /// Overrides the dump's `rope_order` metadata.
    #[serde(default)]
    pub rope_order: Option<RopeOrder>,
    /// Overrides the dump's `layout` metadata.
    #[serde(default)]
    pub layout: Option<Layout>,
    /// Overrides the dump's `kv_a_order` metadata.
    #[serde(default)]
    pub kv_a_order: Option<KvAOrder>,
    /// `(dump tensor name pattern, stage or full site)`; `{n}` in the pattern matches the layer.
    #[serde(default)]
    pub rename: Vec<(String, String)>,
}

/// The built-in `llama.cpp` map (graph-callback names written by `scripts/dump_llama_cpp.py`).
const LLAMA_CPP_MAP: &str = include_str!("maps/llama.cpp.json");

impl Map {
    /// A built-in map (`hf`, `vllm`, `llama.cpp`) or a JSON file.
    ///
    /// Errors: [`Error::Io`] / [`Error::Json`] for an unreadable or invalid file (naming the field
    /// serde rejects).
    pub fn load(spec: &str) -> Result<Map> {
        match spec {
            "hf" => Ok(Map {
                name: Some("hf".into()),
                rope_order: Some(RopeOrder::Hf),
                ..Map::default()
            }),
            "vllm" => Ok(Map {
                name: Some("vllm".into()),
                rope_order: Some(RopeOrder::Interleaved),
                layout: Some(Layout::TokenMajor),
                ..Map::default()
            }),
            "llama.cpp" => serde_json::from_str(LLAMA_CPP_MAP).map_err(|e| Error::Json {
                path: PathBuf::from("<built-in llama.cpp map>"),
                reason: e.to_string(),
            }),
            path => {
                let p = Path::new(path);
                let bytes = std::fs::read(p).map_err(|e| Error::io(p, "read map", e))?;
                serde_json::from_slice(&bytes).map_err(|e| Error::Json {
                    path: p.to_path_buf(),
                    reason: e.to_string(),
                })
            }
        }
    }

    /// The first rename rule matching `name`: the layer matched by `{n}` (`None` for a literal
    /// pattern) and the rule's target.
    pub fn rename_match(&self, name: &str) -> Option<(Option<usize>, &str)> {
        for (pat, target) in &self.rename {
            let layer = match pat.split_once("{n}") {
                Some((pre, post)) => {
                    let Some(d) = name.strip_prefix(pre).and_then(|rest| rest.strip_suffix(post)) else {
                        continue;
                    };
                    if d.is_empty() || !d.bytes().all(|b| b.is_ascii_digit()) {
                        continue;
                    }
                    match d.parse::<usize>() {
                        Ok(n) => Some(n),
                        Err(_) => continue,
                    }
                }
                None if pat == name => None,
                None => continue,
            };
            return Some((layer, target.as_str()));
        }
        None
    }

    /// The site a dump tensor name maps to, if a rename rule matches: the target is a full site
    /// (`L0.hidden_in`), or a stage completed with the layer matched by `{n}`.
    pub fn rename_of(&self, name: &str) -> Option<Site> {
        let (layer, target) = self.rename_match(name)?;
        Site::parse(target).or_else(|| Some(Site::new(layer?, Stage::parse(target)?)))
    }
}

/// What was read from a dump, in our sites and layouts.
#[derive(Debug, Clone)]
pub struct Dump {
    /// The dump file.
    pub path: PathBuf,
    /// `__metadata__`.
    pub metadata: BTreeMap<String, String>,
    /// Each dumped layer's sites (f32 or f64 data, our shapes).
    pub layers: BTreeMap<usize, Trace>,
    /// Token ids, if dumped.
    pub tokens: Option<Vec<u32>>,
    /// The batch: sequence lengths and start positions.
    pub batch: Batch,
    /// The engine's compute dtype (tolerance rows).
    pub dtype: Dtype,
    /// Conversions applied (one line each), e.g. "L0.q_pe_roped: hf rope order → interleaved".
    pub conversions: Vec<String>,
    /// Tensors that are not sites and that no map rule renamed.
    pub ignored: Vec<String>,
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
}

/// A dumped site before normalization.
struct RawSite {
    site: Site,
    name: String,
    shape: Vec<usize>,
    data: Vec<f64>,
}

fn derr(path: &Path, what: impl Into<String>, reason: impl Into<String>) -> Error {
    Error::Safetensors {
        path: path.to_path_buf(),
        what: what.into(),
        reason: reason.into(),
    }
}

/// Decodes one tensor as f64 values (floats) or integers, checking the byte length.
fn values(path: &Path, name: &str, dtype: StDtype, shape: &[usize], d: &[u8]) -> Result<(Vec<f64>, bool)> {
    let n: usize = shape
        .iter()
        .try_fold(1usize, |a, &x| a.checked_mul(x))
        .ok_or_else(|| derr(path, name, format!("shape {shape:?} overflows")))?;
    let (width, is_float) = match dtype {
        StDtype::F64 => (8, true),
        StDtype::F32 => (4, true),
        StDtype::F16 | StDtype::BF16 => (2, true),
        StDtype::I64 | StDtype::U64 => (8, false),
        StDtype::I32 | StDtype::U32 => (4, false),
        StDtype::I16 | StDtype::U16 => (2, false),
        StDtype::I8 | StDtype::U8 => (1, false),
        other => return Err(derr(path, name, format!("unsupported dtype {other:?}"))),
    };
    if Some(d.len()) != n.checked_mul(width) {
        return Err(derr(
            path,
            name,
            format!("{} bytes for shape {shape:?} of {dtype:?}", d.len()),
        ));
    }
    let c = |i: usize| &d[i * width..(i + 1) * width];
    let v: Vec<f64> = (0..n)
        .map(|i| {
            let b = c(i);
            match dtype {
                StDtype::F64 => f64::from_le_bytes(b.try_into().unwrap_or([0; 8])),
                StDtype::F32 => f64::from(f32::from_le_bytes(b.try_into().unwrap_or([0; 4]))),
                StDtype::F16 => half::f16::from_le_bytes([b[0], b[1]]).to_f64(),
                StDtype::BF16 => half::bf16::from_le_bytes([b[0], b[1]]).to_f64(),
                StDtype::I64 => i64::from_le_bytes(b.try_into().unwrap_or([0; 8])) as f64,
                StDtype::U64 => u64::from_le_bytes(b.try_into().unwrap_or([0; 8])) as f64,
                StDtype::I32 => f64::from(i32::from_le_bytes(b.try_into().unwrap_or([0; 4]))),
                StDtype::U32 => f64::from(u32::from_le_bytes(b.try_into().unwrap_or([0; 4]))),
                StDtype::I16 => f64::from(i16::from_le_bytes([b[0], b[1]])),
                StDtype::U16 => f64::from(u16::from_le_bytes([b[0], b[1]])),
                StDtype::I8 => f64::from(b[0] as i8),
                _ => f64::from(b[0]),
            }
        })
        .collect();
    Ok((v, is_float))
}

/// Integer ids from a dumped `tokens`/`positions` tensor: a 1-D (or `[1, T]`) integer tensor of
/// non-negative values.
fn ids(path: &Path, name: &str, shape: &[usize], v: &[f64], is_float: bool) -> Result<Vec<usize>> {
    if is_float {
        return Err(derr(path, name, "must be an integer tensor (I64 or I32)"));
    }
    if shape.iter().filter(|&&d| d != 1).count() > 1 {
        return Err(derr(path, name, format!("must be 1-D [T], got shape {shape:?}")));
    }
    v.iter()
        .map(|&x| {
            (x >= 0.0 && x.fract() == 0.0 && x < 4.0e9)
                .then_some(x as usize)
                .ok_or_else(|| derr(path, name, format!("value {x} is not a valid id")))
        })
        .collect()
}

/// The expected shape of `stage` for `t` tokens, `None` for stages without a fixed expectation
/// (per-rank weight shards).
pub fn expected_shape(stage: Stage, cfg: &MlaConfig, t: usize) -> Option<Vec<usize>> {
    let (n, h, l, p, r, v) = (
        cfg.n_head,
        cfg.hidden,
        cfg.kv_lora_rank,
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.v_head_dim,
    );
    let lq = cfg.q_lora_rank.unwrap_or(0);
    Some(match stage {
        Stage::HiddenIn | Stage::AttnIn | Stage::OProj | Stage::HiddenOut => vec![t, h],
        Stage::QC | Stage::QCNormed => vec![t, lq],
        Stage::Q => vec![t, n, p + r],
        Stage::KvA => vec![t, l + r],
        Stage::KvCNormed => vec![t, l],
        Stage::KPe | Stage::KPeRoped => vec![t, r],
        Stage::QPeRoped => vec![t, n, r],
        Stage::KNope => vec![t, n, p],
        Stage::V | Stage::AttnOut => vec![t, n, v],
        Stage::QlNope | Stage::AttnLatent => vec![t, n, l],
        Stage::Lse => vec![t, n],
        Stage::WFusedQkvA => vec![lq + l + r, h],
        Stage::WKvB => vec![n * (p + v), l],
        Stage::WUkT => vec![n, p, l],
        Stage::WUv => vec![n, l, v],
        Stage::MoeRouterLogits => vec![t, cfg.moe.as_ref()?.n_expert],
        Stage::MoeTopk => vec![t, cfg.moe.as_ref()?.n_expert_used],
        Stage::MoeOut | Stage::SharedOut => vec![t, h],
        Stage::WRank(..) => return None,
    })
}

/// Brings a dumped tensor to the site's shape: equal, flattened trailing dims, `[T, 1, X]` for
/// `[T, X]`, or head-major `[N, T, X]` (transposed). Returns the data in our order and a note
/// when something was converted.
fn normalize_shape(
    data: Vec<f64>,
    shape: &[usize],
    want: &[usize],
    layout: Layout,
) -> std::result::Result<(Vec<f64>, Option<String>), String> {
    let numel: usize = want.iter().product();
    let head_major = |data: &[f64], nn: usize, tt: usize, x: usize| {
        let mut out = vec![0.0; data.len()];
        for h in 0..nn {
            for ti in 0..tt {
                for k in 0..x {
                    out[(ti * nn + h) * x + k] = data[(h * tt + ti) * x + k];
                }
            }
        }
        out
    };
    let is_3d = want.len() == 3;
    let hm_shape_ok = is_3d && shape.len() == 3 && shape == [want[1], want[0], want[2]];
    if layout == Layout::HeadMajor && is_3d {
        if hm_shape_ok {
            let out = head_major(&data, want[1], want[0], want[2]);
            return Ok((out, Some("head-major [N, T, X] transposed to [T, N, X]".into())));
        }
        return Err(format!(
            "layout=head-major expects [N, T, X] = {:?}",
            [want[1], want[0], want[2]]
        ));
    }
    if shape == want {
        return Ok((data, None));
    }
    let n: usize = shape.iter().product();
    if n == numel && !shape.is_empty() && shape[0] == want[0] {
        // [T, N·X] for [T, N, X], [T, 1, X] for [T, X], or any other split of the trailing dims.
        if compare::shapes_compatible(want, shape) || shape.iter().skip(1).product::<usize>() == numel / want[0] {
            return Ok((data, Some(format!("shape {shape:?} read as {want:?}"))));
        }
    }
    if hm_shape_ok && want[0] != want[1] {
        let out = head_major(&data, want[1], want[0], want[2]);
        return Ok((
            out,
            Some("head-major [N, T, X] transposed to [T, N, X] (the only reading that fits)".into()),
        ));
    }
    Err(format!("expected {want:?} (or a flattened [T, …] form)"))
}

/// `[even | odd]` halves of every `r`-wide vector back to interleaved pairs.
fn hf_rope_to_interleaved(data: &[f64], r: usize) -> Vec<f64> {
    let half = r / 2;
    let mut out = data.to_vec();
    for (o, i) in out.chunks_mut(r).zip(data.chunks(r)) {
        for k in 0..half {
            o[2 * k] = i[k];
            o[2 * k + 1] = i[half + k];
        }
    }
    out
}

/// `[R | L]` rows to `[L | R]`.
fn kv_a_to_latent_rope(data: &[f64], l: usize, r: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(data.len());
    for row in data.chunks(l + r) {
        out.extend_from_slice(&row[r..]);
        out.extend_from_slice(&row[..r]);
    }
    out
}

fn parse_list(path: &Path, key: &str, s: &str) -> Result<Vec<usize>> {
    s.split(',')
        .map(|x| {
            x.trim().parse::<usize>().map_err(|_| {
                derr(
                    path,
                    format!("__metadata__.{key}"),
                    format!("`{s}` is not a comma-separated list of integers"),
                )
            })
        })
        .collect()
}

/// Reads and normalizes a dump.
///
/// Errors ([`Error::Safetensors`], naming the file and the tensor or metadata key): a malformed
/// file; a site with an integer or unsupported dtype, or a shape that fits none of the accepted
/// forms (the message gives the expected shape); `tokens`/`positions` that are not 1-D integer
/// tensors or disagree with T; unknown metadata values; positions that do not increase by one
/// within a sequence; no site at all.
pub fn load(path: &Path, map: Option<&Map>, cfg: &MlaConfig) -> Result<Dump> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, "read", e))?;
    load_bytes(path, &bytes, map, cfg)
}

/// [`load`] from bytes (`path` names the file in errors).
pub fn load_bytes(path: &Path, bytes: &[u8], map: Option<&Map>, cfg: &MlaConfig) -> Result<Dump> {
    let st = SafeTensors::deserialize(bytes).map_err(|e| derr(path, "header", e.to_string()))?;
    let (_, meta) = SafeTensors::read_metadata(bytes).map_err(|e| derr(path, "header", e.to_string()))?;
    let metadata: BTreeMap<String, String> = meta.metadata().clone().unwrap_or_default().into_iter().collect();
    let meta_enum = |key: &str| -> Result<Option<String>> { Ok(metadata.get(key).map(|s| s.trim().to_string())) };
    let rope_order = match (map.and_then(|m| m.rope_order), meta_enum("rope_order")?.as_deref()) {
        (Some(o), _) => o,
        (None, None | Some("interleaved")) => RopeOrder::Interleaved,
        (None, Some("hf")) => RopeOrder::Hf,
        (None, Some(o)) => {
            return Err(derr(
                path,
                "__metadata__.rope_order",
                format!("`{o}`: expected `interleaved` or `hf`"),
            ));
        }
    };
    let layout = match (map.and_then(|m| m.layout), meta_enum("layout")?.as_deref()) {
        (Some(o), _) => o,
        (None, None | Some("token-major")) => Layout::TokenMajor,
        (None, Some("head-major")) => Layout::HeadMajor,
        (None, Some(o)) => {
            return Err(derr(
                path,
                "__metadata__.layout",
                format!("`{o}`: expected `token-major` or `head-major`"),
            ));
        }
    };
    let kv_a_order = match (map.and_then(|m| m.kv_a_order), meta_enum("kv_a_order")?.as_deref()) {
        (Some(o), _) => o,
        (None, None | Some("latent-rope")) => KvAOrder::LatentRope,
        (None, Some("rope-latent")) => KvAOrder::RopeLatent,
        (None, Some(o)) => {
            return Err(derr(
                path,
                "__metadata__.kv_a_order",
                format!("`{o}`: expected `latent-rope` or `rope-latent`"),
            ));
        }
    };
    let dtype = match meta_enum("dtype")?.as_deref() {
        None | Some("f32") | Some("float32") | Some("f64") | Some("float64") => Dtype::F32,
        Some("bf16") | Some("bfloat16") | Some("f16") | Some("float16") => Dtype::Bf16,
        Some(o) => {
            return Err(derr(
                path,
                "__metadata__.dtype",
                format!("`{o}`: expected f32, bf16 or f16"),
            ));
        }
    };

    // Collect raw tensors under their site (after renames), tokens and positions.
    let mut raw: Vec<RawSite> = Vec::new();
    let mut tokens = None;
    let mut positions = None;
    let mut ignored = Vec::new();
    let mut names: Vec<String> = st.names().into_iter().map(str::to_string).collect();
    names.sort();
    for name in names {
        let view = st.tensor(&name).map_err(|e| derr(path, &name, e.to_string()))?;
        let shape = view.shape().to_vec();
        let site = map.and_then(|m| m.rename_of(&name)).or_else(|| Site::parse(&name));
        let is_special = name == "tokens" || name == "positions";
        if site.is_none() && !is_special {
            ignored.push(name);
            continue;
        }
        let (v, is_float) = values(path, &name, view.dtype(), &shape, view.data())?;
        if is_special && site.is_none() {
            let x = ids(path, &name, &shape, &v, is_float)?;
            if name == "tokens" {
                tokens = Some(x);
            } else {
                positions = Some(x);
            }
            continue;
        }
        let site = site.expect("checked above");
        if !is_float && !site.stage.is_id_set() {
            return Err(derr(
                path,
                &name,
                format!(
                    "site {site} has integer dtype {:?}; sites must be F32, F16, BF16 or F64 (only id sites such as moe_topk may be integers)",
                    view.dtype()
                ),
            ));
        }
        if let Some(prev) = raw.iter().find(|e| e.site == site) {
            return Err(derr(
                path,
                &name,
                format!("maps to site {site}, which `{}` already provides", prev.name),
            ));
        }
        raw.push(RawSite {
            site,
            name,
            shape,
            data: v,
        });
    }
    if raw.is_empty() {
        return Err(derr(
            path,
            "tensors",
            format!(
                "no site found (names like `L3.kv_c_normed`); {} other tensor(s){}",
                ignored.len(),
                if map.is_none() {
                    ": does the dump need --map?"
                } else {
                    ""
                }
            ),
        ));
    }

    // T: tokens, positions, or the first token-major site.
    let t = match (&tokens, &positions) {
        (Some(tk), _) => tk.len(),
        (None, Some(p)) => p.len(),
        (None, None) => raw
            .iter()
            .find(|e| !e.site.stage.is_weight())
            .map(|e| {
                if layout == Layout::HeadMajor && e.shape.len() == 3 {
                    e.shape[1]
                } else {
                    e.shape[0]
                }
            })
            .unwrap_or(0),
    };
    if t == 0 {
        return Err(derr(
            path,
            "tokens",
            "cannot tell the number of tokens T (no activation site, no tokens)",
        ));
    }
    if let (Some(tk), Some(p)) = (&tokens, &positions)
        && tk.len() != p.len()
    {
        return Err(derr(
            path,
            "positions",
            format!("{} positions for {} tokens", p.len(), tk.len()),
        ));
    }
    if let Some(tk) = &tokens
        && cfg.vocab > 0
        && let Some(&bad) = tk.iter().find(|&&x| x >= cfg.vocab)
    {
        return Err(derr(
            path,
            "tokens",
            format!("token id {bad} outside the vocabulary of {}", cfg.vocab),
        ));
    }

    // Batch from seq_lens and positions.
    let seq_lens = match metadata.get("seq_lens") {
        Some(s) => parse_list(path, "seq_lens", s)?,
        None => vec![t],
    };
    if seq_lens.iter().sum::<usize>() != t || seq_lens.contains(&0) {
        return Err(derr(
            path,
            "__metadata__.seq_lens",
            format!("{seq_lens:?} does not add up to T = {t} (or has a 0)"),
        ));
    }
    let positions = match (positions, metadata.get("positions")) {
        (Some(p), _) => p,
        (None, Some(s)) => parse_list(path, "positions", s)?,
        (None, None) => seq_lens.iter().flat_map(|&n| 0..n).collect(),
    };
    if positions.len() != t {
        return Err(derr(
            path,
            "positions",
            format!("{} positions for T = {t}", positions.len()),
        ));
    }
    let mut seqs = Vec::new();
    let mut off = 0;
    for &len in &seq_lens {
        let start = positions[off];
        for i in 0..len {
            if positions[off + i] != start + i {
                return Err(derr(
                    path,
                    "positions",
                    format!(
                        "token {} has position {} where its sequence (starting at {start}) needs {}; give `seq_lens` metadata for several sequences",
                        off + i,
                        positions[off + i],
                        start + i
                    ),
                ));
            }
        }
        seqs.push(SeqSpec { len, start_pos: start });
        off += len;
    }

    // Normalize every site.
    let (l, r) = (cfg.kv_lora_rank, cfg.qk_rope_head_dim);
    let mut layers: BTreeMap<usize, Trace> = BTreeMap::new();
    let mut conversions = Vec::new();
    for RawSite {
        site,
        name,
        shape,
        data: v,
    } in raw
    {
        if site.layer >= cfg.n_layer {
            return Err(derr(
                path,
                &name,
                format!(
                    "layer {} out of range: the model has {} layers",
                    site.layer, cfg.n_layer
                ),
            ));
        }
        let (mut data, shape) = match expected_shape(site.stage, cfg, t) {
            Some(want) => {
                let (d, note) = normalize_shape(
                    v,
                    &shape,
                    &want,
                    if site.stage.is_weight() {
                        Layout::TokenMajor
                    } else {
                        layout
                    },
                )
                .map_err(|why| derr(path, &name, format!("site {site} has shape {shape:?}; {why}")))?;
                if let Some(n) = note {
                    conversions.push(format!("{site}: {n}"));
                }
                (d, want)
            }
            None => (v, shape),
        };
        if rope_order == RopeOrder::Hf && matches!(site.stage, Stage::QPeRoped | Stage::KPeRoped) {
            data = hf_rope_to_interleaved(&data, r);
            conversions.push(format!("{site}: HF [even | odd] rope order → interleaved pairs"));
        }
        if kv_a_order == KvAOrder::RopeLatent && site.stage == Stage::KvA {
            data = kv_a_to_latent_rope(&data, l, r);
            conversions.push(format!("{site}: [rope | latent] columns → [latent | rope]"));
        }
        if name != site.to_string() {
            conversions.push(format!("{site}: from dump tensor `{name}`"));
        }
        layers
            .entry(site.layer)
            .or_default()
            .record(site, TraceTensor::f64(shape, data));
    }
    Ok(Dump {
        path: path.to_path_buf(),
        metadata,
        layers,
        tokens: tokens.map(|v| v.into_iter().map(|x| x as u32).collect()),
        batch: Batch { seqs },
        dtype,
        conversions,
        ignored,
    })
}

fn to_array(t: &TraceTensor, rows: usize, cols: usize) -> Result<Array2<f64>> {
    Array2::from_shape_vec((rows, cols), t.to_f64()).map_err(|e| Error::Usage(e.to_string()))
}

/// Compares a dump with the reference on the same GGUF: every dumped site, the same metrics,
/// tolerances (the dump's dtype, or `dtype` when given) and detectors as `run`.
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
    dtype: Option<Dtype>,
) -> Result<RunReport> {
    let dtype = dtype.unwrap_or(dump.dtype);
    let t = dump.batch.n_tokens();
    let layers: Vec<usize> = dump.layers.keys().copied().collect();
    let mut results = Vec::new();
    let mut findings = Vec::new();
    let mut not_dumped = Vec::new();
    let mut tensor_types = Vec::new();
    let mut prev: Option<(usize, Option<Array2<f64>>)> = None; // (layer, dump's hidden_out)
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
                let mut h = embed_tokens(file, cfg, tk)?.mapv(f64::from);
                for k in 0..layer {
                    let wk = LayerWeights::load(file, cfg, k)?;
                    h = crate::reference::forward_full(file, cfg, &wk, &h, &dump.batch)?
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
        let mut reference = if cfg.is_moe_layer(layer) && wants_ffn {
            crate::run::reference_layer_full(file, cfg, &w, &input, &dump.batch, 1)?.trace
        } else {
            crate::run::reference_layer(cfg, &w, &input, &dump.batch, 1)?.trace
        };
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
        let diffs = compare::diff(&reference, dl, dtype);
        let evidence = PathEvidence {
            kind: PathKind::Dump,
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
            dtype,
        });
        if findings.is_empty() {
            findings.extend(f);
        }
        results.push(PathResult {
            path: PathKind::Dump,
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
    };
    Ok(RunReport {
        model: ModelSummary {
            path: file.path().display().to_string(),
            config: cfg.clone(),
            tensor_types,
        },
        run: RunConfig {
            layers,
            batch: dump.batch.clone(),
            seed: 0,
            input: InputMode::Dump,
            paths: vec![PathKind::Dump],
            path_options: PathOptions::default(),
            dtype,
            backend: format!("dump: {engine}"),
        },
        token_ids: dump.tokens.clone(),
        results,
        findings,
        dump: Some(summary),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rename_patterns() {
        let m = Map {
            rename: vec![
                ("kv_cmpr-{n}#1".into(), "kv_c_normed".into()),
                ("inp_embd#0".into(), "L0.hidden_in".into()),
                ("l_out-{n}#0".into(), "hidden_out".into()),
            ],
            ..Map::default()
        };
        assert_eq!(m.rename_of("kv_cmpr-12#1"), Site::parse("L12.kv_c_normed"));
        assert_eq!(m.rename_of("kv_cmpr-12#0"), None);
        assert_eq!(m.rename_of("kv_cmpr-x#1"), None);
        assert_eq!(m.rename_of("inp_embd#0"), Site::parse("L0.hidden_in"));
        assert_eq!(m.rename_of("l_out-0#0"), Site::parse("L0.hidden_out"));
    }

    #[test]
    fn rope_and_kv_a_reorders_invert_the_engine_layouts() {
        // interleaved x → hf halves → back.
        let x: Vec<f64> = (0..8).map(f64::from).collect();
        let halves = vec![0.0, 2.0, 4.0, 6.0, 1.0, 3.0, 5.0, 7.0];
        assert_eq!(hf_rope_to_interleaved(&halves, 8), x);
        let row = vec![10.0, 11.0, 1.0, 2.0, 3.0]; // [rope R=2 | latent L=3]
        assert_eq!(kv_a_to_latent_rope(&row, 3, 2), vec![1.0, 2.0, 3.0, 10.0, 11.0]);
    }

    #[test]
    fn shapes_accepted_and_rejected() {
        let d: Vec<f64> = (0..24).map(f64::from).collect();
        // [T=2, N=3, X=4]: flattened ok, head-major transposed, wrong rejected.
        let (o, note) = normalize_shape(d.clone(), &[2, 12], &[2, 3, 4], Layout::TokenMajor).unwrap();
        assert_eq!(o, d);
        assert!(note.unwrap().contains("read as"));
        let (o, note) = normalize_shape(d.clone(), &[3, 2, 4], &[2, 3, 4], Layout::TokenMajor).unwrap();
        assert!(note.unwrap().contains("head-major"));
        assert_eq!(&o[4..8], &d[8..12]); // [t=0, h=1] came from [h=1, t=0]
        assert!(normalize_shape(d.clone(), &[4, 6], &[2, 3, 4], Layout::TokenMajor).is_err());
        assert!(normalize_shape(d, &[2, 3, 4], &[2, 3, 4], Layout::HeadMajor).is_err());
    }
}
