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

use safetensors::{Dtype as StDtype, SafeTensors};
use serde::{Deserialize, Serialize};

use crate::core::batch::{Batch, SeqSpec};
use crate::core::dtype::Dtype;
use crate::core::error::{Error, Result};
use crate::core::st::header_error;
use crate::core::trace::{Site, Stage, Trace, TraceTensor};
use crate::model::config::{KvBLayout, MlaConfig};
use crate::model::gguf::GgufFile;

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

impl RopeOrder {
    /// The metadata value (`interleaved`, `hf`).
    pub fn name(self) -> &'static str {
        match self {
            RopeOrder::Interleaved => "interleaved",
            RopeOrder::Hf => "hf",
        }
    }
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

impl Layout {
    /// The metadata value (`token-major`, `head-major`).
    pub fn name(self) -> &'static str {
        match self {
            Layout::TokenMajor => "token-major",
            Layout::HeadMajor => "head-major",
        }
    }
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

impl KvAOrder {
    /// The metadata value (`latent-rope`, `rope-latent`).
    pub fn name(self) -> &'static str {
        match self {
            KvAOrder::LatentRope => "latent-rope",
            KvAOrder::RopeLatent => "rope-latent",
        }
    }
}

/// A condition on a map's rename rule, evaluated from the model's [`MlaConfig`]: some engine
/// names mean different tensors depending on the model (llama.cpp's `kqv-N` is the latent
/// attention output `[T, N, L]` in the absorbed graph of split-kv_b files, but the per-head value
/// output `[T, N, V]` in the expanded graph it runs for legacy fused-kv_b files).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Condition {
    /// The file stores `attn_k_b`/`attn_v_b` ([`KvBLayout::Split`]; llama.cpp runs its absorbed
    /// MLA graph).
    #[serde(rename = "split_kv_b")]
    SplitKvB,
    /// The file stores one legacy `attn_kv_b` ([`KvBLayout::Fused`]; llama.cpp runs the expanded
    /// MHA graph).
    #[serde(rename = "fused_kv_b")]
    FusedKvB,
    /// The model compresses q (`q_lora_rank` > 0: `q_a_proj`, `q_a_layernorm`, `q_b_proj`).
    #[serde(rename = "q_lora")]
    QLora,
    /// The model projects q directly (`q_proj`; no or zero `q_lora_rank`).
    #[serde(rename = "no_q_lora")]
    NoQLora,
}

impl Condition {
    /// The condition's name in map files (`split_kv_b`, `fused_kv_b`, `q_lora`, `no_q_lora`).
    pub fn name(self) -> &'static str {
        match self {
            Condition::SplitKvB => "split_kv_b",
            Condition::FusedKvB => "fused_kv_b",
            Condition::QLora => "q_lora",
            Condition::NoQLora => "no_q_lora",
        }
    }

    /// True when the condition holds for `cfg` (its `kv_b_layout` and `q_lora_rank`).
    pub fn holds(self, cfg: &MlaConfig) -> bool {
        match self {
            Condition::SplitKvB => cfg.kv_b_layout == KvBLayout::Split,
            Condition::FusedKvB => cfg.kv_b_layout == KvBLayout::Fused,
            Condition::QLora => cfg.q_lora_rank.is_some_and(|r| r > 0),
            Condition::NoQLora => !Condition::QLora.holds(cfg),
        }
    }
}

/// One rename rule of a [`Map`]. JSON: `[pattern, target]` or `[pattern, target, condition]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rename {
    /// Dump tensor name; `{n}` matches a layer number (decimal digits).
    pub pattern: String,
    /// A stage (`kv_c_normed`, completed with the layer `{n}` matched) or a full site
    /// (`L0.hidden_in`); for `weights --check`, a param or `L<n>.<param>[.rank<r>]`.
    pub target: String,
    /// The rule applies only when this holds for the model (absent: always).
    pub when: Option<Condition>,
}

impl Rename {
    /// An unconditional rule.
    pub fn new(pattern: impl Into<String>, target: impl Into<String>) -> Rename {
        Rename {
            pattern: pattern.into(),
            target: target.into(),
            when: None,
        }
    }

    /// True when the rule applies to `cfg` (no condition, or the condition holds).
    pub fn applies(&self, cfg: &MlaConfig) -> bool {
        self.when.is_none_or(|c| c.holds(cfg))
    }
}

impl Serialize for Rename {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeSeq;
        let mut q = s.serialize_seq(Some(if self.when.is_some() { 3 } else { 2 }))?;
        q.serialize_element(&self.pattern)?;
        q.serialize_element(&self.target)?;
        if let Some(c) = &self.when {
            q.serialize_element(c)?;
        }
        q.end()
    }
}

impl<'de> Deserialize<'de> for Rename {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Rename, D::Error> {
        use serde::de::{Error as _, IgnoredAny, SeqAccess, Visitor};
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Rename;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("[pattern, target] or [pattern, target, condition]")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> std::result::Result<Rename, A::Error> {
                let pattern: String = a.next_element()?.ok_or_else(|| A::Error::invalid_length(0, &self))?;
                let target: String = a.next_element()?.ok_or_else(|| A::Error::invalid_length(1, &self))?;
                let when: Option<Condition> = a.next_element()?;
                if a.next_element::<IgnoredAny>()?.is_some() {
                    return Err(A::Error::invalid_length(4, &self));
                }
                Ok(Rename { pattern, target, when })
            }
        }
        d.deserialize_seq(V)
    }
}

/// A map from an engine's dump to our sites (docs/dump-format.md, "Maps").
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Map {
    /// Name shown in reports.
    #[serde(default)]
    pub name: Option<String>,
    /// Overrides the dump's `rope_order` metadata (listed among the conversions).
    #[serde(default)]
    pub rope_order: Option<RopeOrder>,
    /// Overrides the dump's `layout` metadata (listed among the conversions).
    #[serde(default)]
    pub layout: Option<Layout>,
    /// Overrides the dump's `kv_a_order` metadata (listed among the conversions).
    #[serde(default)]
    pub kv_a_order: Option<KvAOrder>,
    /// Rename rules, tried in order; the first that matches and applies to the model wins.
    #[serde(default)]
    pub rename: Vec<Rename>,
}

/// The built-in `llama.cpp` map (graph-callback names written by `scripts/dump_llama_cpp.py`).
const LLAMA_CPP_MAP: &str = include_str!("maps/llama.cpp.json");

impl Map {
    /// A built-in map (`hf`, `vllm`, `llama.cpp`) or a JSON file.
    ///
    /// `hf` sets `rope_order = hf` (HF's `[even | odd]` rotated halves); `vllm` changes nothing
    /// (vLLM's DeepSeek rope is interleaved and its tensors token-major, the defaults: the dump's
    /// own metadata stands); `llama.cpp` is `src/maps/llama.cpp.json`.
    ///
    /// Errors: [`Error::Io`] / [`Error::Json`] for an unreadable or invalid file (naming the field
    /// serde rejects, e.g. an unknown condition).
    pub fn load(spec: &str) -> Result<Map> {
        match spec {
            "hf" => Ok(Map {
                name: Some("hf".into()),
                rope_order: Some(RopeOrder::Hf),
                ..Map::default()
            }),
            "vllm" => Ok(Map {
                name: Some("vllm".into()),
                ..Map::default()
            }),
            "llama.cpp" => serde_json::from_str(LLAMA_CPP_MAP).map_err(|e| Error::Json {
                path: PathBuf::from("<built-in llama.cpp map>"),
                reason: e.to_string(),
            }),
            path => {
                let p = Path::new(path);
                if !p.exists() {
                    return Err(Error::Usage(format!(
                        "--map {path}: not a built-in map (hf, vllm, llama.cpp) and no such file"
                    )));
                }
                let bytes = std::fs::read(p).map_err(|e| Error::io(p, "read map", e))?;
                serde_json::from_slice(&bytes).map_err(|e| Error::Json {
                    path: p.to_path_buf(),
                    reason: e.to_string(),
                })
            }
        }
    }

    /// The first rename rule that matches `name` and applies to `cfg` (see [`Condition`]): the
    /// layer matched by `{n}` (`None` for a literal pattern) and the rule's target.
    pub fn rename_match(&self, name: &str, cfg: &MlaConfig) -> Option<(Option<usize>, &str)> {
        for rule in &self.rename {
            if !rule.applies(cfg) {
                continue;
            }
            let pat = rule.pattern.as_str();
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
            return Some((layer, rule.target.as_str()));
        }
        None
    }

    /// The site a dump tensor name maps to, if a rename rule matches and applies to `cfg`: the
    /// target is a full site (`L0.hidden_in`), or a stage completed with the layer matched by
    /// `{n}`.
    pub fn rename_of(&self, name: &str, cfg: &MlaConfig) -> Option<Site> {
        let (layer, target) = self.rename_match(name, cfg)?;
        Site::parse(target).or_else(|| Some(Site::new(layer?, Stage::parse(target)?)))
    }

    /// One line per setting this map overrides (`rope_order`, `layout`, `kv_a_order`), naming the
    /// dump's own metadata value: for the report's conversions.
    pub fn override_lines(&self, metadata: &BTreeMap<String, String>) -> Vec<String> {
        let name = self.name.as_deref().unwrap_or("map");
        let mut out = Vec::new();
        let settings = [
            ("rope_order", self.rope_order.map(RopeOrder::name)),
            ("layout", self.layout.map(Layout::name)),
            ("kv_a_order", self.kv_a_order.map(KvAOrder::name)),
        ];
        for (key, value) in settings {
            let Some(v) = value else { continue };
            let dump = metadata.get(key).map(|s| s.trim());
            out.push(format!(
                "map `{name}` sets {key} = {v} ({})",
                match dump {
                    None => "the dump has no such metadata".to_string(),
                    Some(d) if d == v => format!("the dump's metadata says {d} too"),
                    Some(d) => format!("overrides the dump's metadata {key} = {d}"),
                }
            ));
        }
        out
    }
}

/// The dtype an engine computed in (dump metadata `dtype`, or `compare --dtype`): picks the
/// tolerance rows (`EngineDtype::precision`, in [`crate::judge::tolerance`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineDtype {
    /// f32 (or f64): judged by the f32 rows.
    F32,
    /// bf16 throughout: judged by the `engine-bf16` rows.
    Bf16,
    /// f16 throughout: judged by the `engine-f16` rows.
    F16,
}

impl EngineDtype {
    /// The closest compute dtype of mla-diff's own paths (`run.dtype` of a compare report):
    /// f32 for f32, bf16 for bf16 and f16.
    pub fn compute_dtype(self) -> Dtype {
        match self {
            EngineDtype::F32 => Dtype::F32,
            EngineDtype::Bf16 | EngineDtype::F16 => Dtype::Bf16,
        }
    }
}

impl std::fmt::Display for EngineDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            EngineDtype::F32 => "f32",
            EngineDtype::Bf16 => "bf16",
            EngineDtype::F16 => "f16",
        })
    }
}

/// The `format` metadata value of a format-1 dump (optional: a file without it is format 1 too).
pub const FORMAT1: &str = "mla-diff dump 1";

/// The `format` metadata value of a format-2 dump.
pub const FORMAT2: &str = "mla-diff dump 2";

/// The model a format-2 dump was made from (`header.model`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelIdentity {
    /// The GGUF's file name, no folders.
    pub file: String,
    /// Its size in bytes.
    pub bytes: u64,
    /// SHA-256 (hex) of the bytes before the tensor data ([`GgufFile::index_sha256_hex`]).
    pub index_sha256: String,
    /// Per dumped layer (decimal key): SHA-256 (hex) of the layer's raw tensor bytes
    /// ([`GgufFile::layer_sha256_hex`]).
    #[serde(default)]
    pub layer_sha256: BTreeMap<String, String>,
}

/// The hook that wrote a dump, or the engine that computed it (`header.hook`, `header.engine`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Software {
    /// Name, e.g. `dump_vllm.py`, `vllm`.
    pub name: String,
    /// Version string.
    #[serde(default)]
    pub version: String,
    /// The attention (decode) backend, for an engine (`TRITON_MLA`, `FLASHMLA`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_backend: Option<String>,
    /// The prefill backend, for an engine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_backend: Option<String>,
}

/// Declared layout conventions that `compare` undoes (`header.conventions`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Conventions {
    /// As format 1's `rope_order` (`interleaved`, `hf`).
    #[serde(default)]
    pub rope_order: Option<String>,
    /// As format 1's `layout` (`token-major`, `head-major`).
    #[serde(default)]
    pub layout: Option<String>,
    /// As format 1's `kv_a_order` (`latent-rope`, `rope-latent`).
    #[serde(default)]
    pub kv_a_order: Option<String>,
    /// `e` (default) or `2`: the base of the dumped `lse`.
    #[serde(default)]
    pub lse_base: Option<String>,
    /// The factor `s` (a positive number; null or absent = 1) by which the engine's residual
    /// stream differs from the model's on purpose: every dumped `hidden_out`, and `hidden_in`
    /// of every layer but the model's first (layer 0's is the embedding), holds `s ×` the
    /// model's value. vLLM's fp16 path carries `s = 1/routed_scaling_factor`. Kept as JSON so a
    /// wrong value is reported as written; read it with [`Conventions::residual_scale()`].
    #[serde(default)]
    pub residual_scale: Option<serde_json::Value>,
}

impl Conventions {
    /// The declared residual-stream factor (the `residual_scale` field), `None` when
    /// absent, null or not a number (a header that passed [`peek_header`] or [`read`] holds a
    /// positive finite number or nothing).
    pub fn residual_scale(&self) -> Option<f64> {
        self.residual_scale.as_ref().and_then(serde_json::Value::as_f64)
    }
}

/// One sequence's share of a step (`header.steps[k].seqs[i]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepSeq {
    /// New tokens of the sequence computed in this step.
    pub new: usize,
    /// Tokens of the sequence that earlier steps computed and cached.
    pub context: usize,
}

/// One engine step (`header.steps[k]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepSpec {
    /// Its name in reports, e.g. `prefill`, `decode-1`.
    pub name: String,
    /// One entry per sequence (the same request in every step).
    pub seqs: Vec<StepSeq>,
}

/// A change a harness made to the engine's code path (`header.patches[i]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Patch {
    /// Short name.
    pub name: String,
    /// Why it was needed.
    #[serde(default)]
    pub reason: String,
}

/// The header of a format-2 dump (`__metadata__.header`, JSON).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DumpHeader {
    /// The model the dump was made from.
    pub model: ModelIdentity,
    /// The hook that wrote it.
    #[serde(default)]
    pub hook: Software,
    /// The engine that computed it.
    #[serde(default)]
    pub engine: Software,
    /// As format 1's `dtype` (default f32).
    #[serde(default)]
    pub dtype: Option<String>,
    /// Layout conventions.
    #[serde(default)]
    pub conventions: Conventions,
    /// The steps, in order.
    pub steps: Vec<StepSpec>,
    /// Changes a harness made to the engine's code path.
    #[serde(default)]
    pub patches: Vec<Patch>,
    /// The dump comes from a kernel that read inputs of this dtype and accumulated in f32: it
    /// is judged by the rows `run --dtype` of that dtype applies, not by those `dtype` selects.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel_precision: Option<Dtype>,
    /// `[a, b]`: the per-head sites hold only heads `a..b` (`0 ≤ a < b ≤ N`); see
    /// [`heads_config`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heads: Option<[usize; 2]>,
}

/// The stages whose sites hold one block per attention head: `[T, N, X]` activations and the
/// `[T, N]` lse (head axis 1), and the weights `w.kv_b` ([N·(P+V), L]), `w.W_UK_T` and `w.W_UV`
/// ([N, …]) (head axis 0). A format-2 dump with `heads` holds these for its heads only.
pub fn is_per_head(stage: Stage) -> bool {
    matches!(
        stage,
        Stage::Q
            | Stage::QPeRoped
            | Stage::KNope
            | Stage::V
            | Stage::QlNope
            | Stage::AttnLatent
            | Stage::Lse
            | Stage::AttnOut
            | Stage::WKvB
            | Stage::WUkT
            | Stage::WUv
    )
}

/// The configuration a dump of heads `a..b` is read and judged with: `cfg` with `n_head = b − a`
/// (every per-head site, [`is_per_head`], has `b − a` heads; every other dim is the model's).
pub fn heads_config(cfg: &MlaConfig, heads: [usize; 2]) -> MlaConfig {
    MlaConfig {
        n_head: heads[1].saturating_sub(heads[0]),
        ..cfg.clone()
    }
}

/// A format-2 dump: its header and one [`Dump`] per step (the step's sites, rows = its new
/// tokens in sequence order).
#[derive(Debug, Clone)]
pub struct StepsDump {
    /// The dump file.
    pub path: PathBuf,
    /// The header.
    pub header: DumpHeader,
    /// `(step, its sites)`, in step order.
    pub steps: Vec<(StepSpec, Dump)>,
    /// Tensors that belong to no step and are not weights.
    pub ignored: Vec<String>,
}

/// What a dump file holds: format 1 (one forward) or format 2 (steps with an identity).
#[derive(Debug, Clone)]
pub enum DumpFile {
    /// Format 1.
    One(Dump),
    /// Format 2.
    Steps(Box<StepsDump>),
}

/// The header of a format-2 dump without reading its tensors; `None` for format 1.
///
/// Errors: [`Error::Io`] when the file cannot be read; [`Error::Safetensors`] naming
/// `__metadata__.header` when a format-2 header is not valid JSON of the documented shape.
pub fn peek_header(path: &Path) -> Result<Option<DumpHeader>> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).map_err(|e| Error::io(path, "open", e))?;
    let mut len = [0u8; 8];
    if f.read_exact(&mut len).is_err() {
        return Ok(None);
    }
    let n = u64::from_le_bytes(len);
    // The safetensors header is small; a huge declared length is not a dump this can peek at
    // (the full read reports it properly).
    if n > 64 << 20 {
        return Ok(None);
    }
    let mut head = vec![0u8; n as usize];
    if f.read_exact(&mut head).is_err() {
        return Ok(None);
    }
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(&head) else {
        return Ok(None);
    };
    let meta = &v["__metadata__"];
    if meta["format"].as_str().map(str::trim) != Some(FORMAT2) {
        return Ok(None);
    }
    parse_header(path, meta["header"].as_str()).map(Some)
}

fn parse_header(path: &Path, text: Option<&str>) -> Result<DumpHeader> {
    let text = text.ok_or_else(|| {
        dump_error(
            path,
            "__metadata__.header",
            format!("missing: a `{FORMAT2}` dump needs it"),
        )
    })?;
    let v: serde_json::Value =
        serde_json::from_str(text).map_err(|e| dump_error(path, "__metadata__.header", e.to_string()))?;
    match v.get("kernel_precision") {
        None | Some(serde_json::Value::Null) => {}
        Some(serde_json::Value::String(p)) if p == "bf16" || p == "f32" => {}
        Some(other) => {
            return Err(dump_error(
                path,
                "__metadata__.header.kernel_precision",
                format!("{other}: expected \"bf16\" or \"f32\""),
            ));
        }
    }
    match v.get("heads") {
        None | Some(serde_json::Value::Null) => {}
        Some(x) => {
            let pair = x
                .as_array()
                .filter(|a| a.len() == 2)
                .and_then(|a| Some((a[0].as_u64()?, a[1].as_u64()?)));
            if pair.is_none_or(|(a, b)| a >= b) {
                return Err(dump_error(
                    path,
                    "__metadata__.header.heads",
                    format!("{x}: expected [a, b] with integers 0 ≤ a < b ≤ N"),
                ));
            }
        }
    }
    let h: DumpHeader =
        serde_json::from_value(v).map_err(|e| dump_error(path, "__metadata__.header", e.to_string()))?;
    if h.steps.is_empty() {
        return Err(dump_error(path, "__metadata__.header.steps", "no step"));
    }
    if let Some(v) = h.conventions.residual_scale.as_ref().filter(|v| !v.is_null())
        && v.as_f64().is_none_or(|x| !(x.is_finite() && x > 0.0))
    {
        return Err(dump_error(
            path,
            "__metadata__.header.conventions.residual_scale",
            format!("{v}: expected a positive number (the factor the engine's residual stream carries) or null"),
        ));
    }
    if let Some(b) = h.conventions.lse_base.as_deref()
        && b != "e"
        && b != "2"
    {
        return Err(dump_error(
            path,
            "__metadata__.header.conventions.lse_base",
            format!("`{b}`: expected `e` or `2`"),
        ));
    }
    let n = h.steps[0].seqs.len();
    for (k, st) in h.steps.iter().enumerate() {
        if st.seqs.len() != n {
            return Err(dump_error(
                path,
                format!("__metadata__.header.steps[{k}].seqs"),
                format!(
                    "{} sequences, step 0 has {n}: every step lists every sequence",
                    st.seqs.len()
                ),
            ));
        }
        if st.seqs.iter().all(|q| q.new == 0) {
            return Err(dump_error(
                path,
                format!("__metadata__.header.steps[{k}].seqs"),
                "no new token",
            ));
        }
        for (i, q) in st.seqs.iter().enumerate() {
            let before: usize = h.steps[..k].iter().map(|p| p.seqs[i].new).sum();
            if q.new > 0 && q.context != before {
                return Err(dump_error(
                    path,
                    format!("__metadata__.header.steps[{k}].seqs[{i}].context"),
                    format!(
                        "{}, but earlier steps computed {before} tokens of that sequence",
                        q.context
                    ),
                ));
            }
        }
    }
    Ok(h)
}

/// Reads a dump of either format. Format 2's steps are each read as a format-1 dump of the step's
/// new tokens (tensors `s{k}.…` without the prefix), with the header's dtype and conventions (a
/// base-2 `lse` converted to natural log; a declared `residual_scale` divided out of the
/// residual-stream sites, [`Conventions::residual_scale()`]; each listed among the conversions);
/// with `heads = [a, b]`, the per-head sites ([`is_per_head`]) have `b − a` heads.
/// `weights.…` tensors are for `weights --check` and skipped here.
///
/// Errors: as [`load_bytes`], with the file named `<dump> [step k `name`]` for a step's tensors;
/// a malformed header names its field (`heads` past the model's N heads included).
pub fn read(path: &Path, map: Option<&Map>, cfg: &MlaConfig) -> Result<DumpFile> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, "read", e))?;
    if bytes.starts_with(b"GGUF") {
        return load_bytes(path, &bytes, map, cfg).map(DumpFile::One);
    }
    let (_, meta) = SafeTensors::read_metadata(&bytes).map_err(|e| header_error(path, &bytes, &e))?;
    let metadata = meta.metadata().clone().unwrap_or_default();
    if metadata.get("format").map(|s| s.trim()) != Some(FORMAT2) {
        return load_bytes(path, &bytes, map, cfg).map(DumpFile::One);
    }
    let header = parse_header(path, metadata.get("header").map(String::as_str))?;
    let heads_cfg = match header.heads {
        Some([a, b]) if b > cfg.n_head => {
            return Err(dump_error(
                path,
                "__metadata__.header.heads",
                format!(
                    "[{a}, {b}]: the model has {} heads; expected 0 ≤ a < b ≤ {}",
                    cfg.n_head, cfg.n_head
                ),
            ));
        }
        Some(h) => Some(heads_config(cfg, h)),
        None => None,
    };
    // A dump of heads a..b: its per-head sites are read with b − a heads.
    let cfg = heads_cfg.as_ref().unwrap_or(cfg);
    let st = SafeTensors::deserialize(&bytes).map_err(|e| header_error(path, &bytes, &e))?;
    let mut ignored = Vec::new();
    for name in st.names() {
        let stepped = name
            .strip_prefix('s')
            .and_then(|r| r.split_once('.'))
            .is_some_and(|(k, _)| k.parse::<usize>().is_ok_and(|k| k < header.steps.len()));
        if !stepped && !name.starts_with("weights.") {
            ignored.push(name.to_string());
        }
    }
    ignored.sort();
    let mut steps = Vec::new();
    for (k, spec) in header.steps.iter().enumerate() {
        let prefix = format!("s{k}.");
        let mut meta1: std::collections::HashMap<String, String> = std::collections::HashMap::new();
        let lens: Vec<String> = spec
            .seqs
            .iter()
            .filter(|q| q.new > 0)
            .map(|q| q.new.to_string())
            .collect();
        meta1.insert("seq_lens".into(), lens.join(","));
        meta1.insert(
            "engine".into(),
            format!("{} {}", header.engine.name, header.engine.version),
        );
        if let Some(d) = &header.dtype {
            meta1.insert("dtype".into(), d.clone());
        }
        for (key, v) in [
            ("rope_order", &header.conventions.rope_order),
            ("layout", &header.conventions.layout),
            ("kv_a_order", &header.conventions.kv_a_order),
        ] {
            if let Some(v) = v {
                meta1.insert(key.into(), v.clone());
            }
        }
        let mut views = Vec::new();
        for name in st.names() {
            if let Some(rest) = name.strip_prefix(&prefix) {
                let view = st.tensor(name).map_err(|e| dump_error(path, name, e.to_string()))?;
                views.push((rest.to_string(), view));
            }
        }
        let step_bytes =
            safetensors::serialize(views, Some(meta1)).map_err(|e| dump_error(path, &prefix, e.to_string()))?;
        let label = PathBuf::from(format!("{} [step {k} `{}`]", path.display(), spec.name));
        let mut d = load_bytes(&label, &step_bytes, map, cfg)?;
        d.path = path.to_path_buf();
        if header.conventions.lse_base.as_deref() == Some("2") {
            let ln2 = std::f64::consts::LN_2;
            for trace in d.layers.values_mut() {
                let lse: Vec<(Site, TraceTensor)> = trace
                    .entries()
                    .iter()
                    .filter(|(s, _)| s.stage == Stage::Lse)
                    .cloned()
                    .collect();
                for (site, t) in lse {
                    let v: Vec<f64> = t.to_f64().iter().map(|x| x * ln2).collect();
                    trace.record(site, TraceTensor::f64(t.shape.clone(), v));
                    d.conversions.push(format!("{site}: base-2 LSE → natural log (×ln 2)"));
                }
            }
        }
        if let Some(s) = header.conventions.residual_scale().filter(|&s| s != 1.0) {
            undo_residual_scale(&mut d, s);
        }
        steps.push((spec.clone(), d));
    }
    Ok(DumpFile::Steps(Box::new(StepsDump {
        path: path.to_path_buf(),
        header,
        steps,
        ignored,
    })))
}

/// Divides the declared residual-stream factor `s` (`conventions.residual_scale`) out of the
/// residual-stream sites of `d`: every `hidden_out`, and `hidden_in` of layers > 0 (layer 0's
/// input is the embedding, before any layer scaled it). Each division is listed among the
/// conversions.
fn undo_residual_scale(d: &mut Dump, s: f64) {
    for trace in d.layers.values_mut() {
        let stream: Vec<(Site, TraceTensor)> = trace
            .entries()
            .iter()
            .filter(|(site, _)| site.stage == Stage::HiddenOut || (site.stage == Stage::HiddenIn && site.layer > 0))
            .cloned()
            .collect();
        for (site, t) in stream {
            let v: Vec<f64> = t.to_f64().iter().map(|x| x / s).collect();
            trace.record(site, TraceTensor::f64(t.shape.clone(), v));
            d.conversions.push(format!(
                "{site}: residual stream ×{s} (conventions.residual_scale) divided out"
            ));
        }
    }
}

/// Checks that `file` is the model a format-2 dump was made from: the header-and-index hash, and
/// the raw-byte hash of every layer in `layers`.
///
/// Errors: [`Error::Usage`] naming the dump, the GGUF and the field that differs (exit 2).
pub fn check_identity(dump: &Path, h: &DumpHeader, file: &GgufFile, layers: &[usize]) -> Result<()> {
    let refuse = |field: &str, want: &str, got: &str| {
        Error::Usage(format!(
            "{}: field `header.model.{field}` is {want}, but {} gives {got}: the dump was made from another model ({}); pass the GGUF it names",
            dump.display(),
            file.path().display(),
            h.model.file
        ))
    };
    let idx = file.index_sha256_hex();
    if !idx.eq_ignore_ascii_case(h.model.index_sha256.trim()) {
        return Err(refuse("index_sha256", h.model.index_sha256.trim(), &idx));
    }
    for &l in layers {
        let key = l.to_string();
        let Some(want) = h.model.layer_sha256.get(&key) else {
            return Err(Error::Usage(format!(
                "{}: field `header.model.layer_sha256` has no entry for layer {l}, which the dump holds",
                dump.display()
            )));
        };
        let got = file.layer_sha256_hex(l);
        if !got.eq_ignore_ascii_case(want.trim()) {
            return Err(refuse(&format!("layer_sha256.{key}"), want.trim(), &got));
        }
    }
    Ok(())
}

/// What was read from a dump, in our sites and layouts.
#[derive(Debug, Clone)]
pub struct Dump {
    /// The dump file.
    pub path: PathBuf,
    /// The built-in map picked from the metadata when none was given ([`map_from_metadata`]).
    pub map: Option<String>,
    /// `__metadata__`.
    pub metadata: BTreeMap<String, String>,
    /// Each dumped layer's sites (f32 or f64 data, our shapes).
    pub layers: BTreeMap<usize, Trace>,
    /// Token ids, if dumped.
    pub tokens: Option<Vec<u32>>,
    /// The batch: sequence lengths and start positions.
    pub batch: Batch,
    /// The engine's compute dtype (metadata `dtype`; picks the tolerance rows).
    pub dtype: EngineDtype,
    /// Conversions applied (one line each), e.g. "L0.q_pe_roped: hf rope order → interleaved".
    pub conversions: Vec<String>,
    /// Tensors that are not sites and that no map rule renamed.
    pub ignored: Vec<String>,
}

/// A dumped site before normalization.
struct RawSite {
    site: Site,
    name: String,
    shape: Vec<usize>,
    data: Vec<f64>,
}

fn dump_error(path: &Path, what: impl Into<String>, reason: impl Into<String>) -> Error {
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
        .ok_or_else(|| dump_error(path, name, format!("shape {shape:?} overflows")))?;
    let (width, is_float) = match dtype {
        StDtype::F64 => (8, true),
        StDtype::F32 => (4, true),
        StDtype::F16 | StDtype::BF16 => (2, true),
        StDtype::I64 | StDtype::U64 => (8, false),
        StDtype::I32 | StDtype::U32 => (4, false),
        StDtype::I16 | StDtype::U16 => (2, false),
        StDtype::I8 | StDtype::U8 => (1, false),
        other => return Err(dump_error(path, name, format!("unsupported dtype {other:?}"))),
    };
    if Some(d.len()) != n.checked_mul(width) {
        return Err(dump_error(
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
        return Err(dump_error(path, name, "must be an integer tensor (I64 or I32)"));
    }
    if shape.iter().filter(|&&d| d != 1).count() > 1 {
        return Err(dump_error(path, name, format!("must be 1-D [T], got shape {shape:?}")));
    }
    v.iter()
        .map(|&x| {
            (x >= 0.0 && x.fract() == 0.0 && x < 4.0e9)
                .then_some(x as usize)
                .ok_or_else(|| dump_error(path, name, format!("value {x} is not a valid id")))
        })
        .collect()
}

/// The expected shape of `stage` for `t` tokens, `None` for stages without a fixed expectation
/// (per-rank weight shards).
pub fn expected_shape(stage: Stage, cfg: &MlaConfig, t: usize) -> Option<Vec<usize>> {
    let [n, l, p, r, v] = cfg.dims().nlprv();
    let h = cfg.dims().hidden;
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
        // Dumps hold one sequence, so S = T.
        Stage::IdxQ => {
            let ix = cfg.indexer.as_ref()?;
            vec![t, ix.n_head, ix.head_dim]
        }
        Stage::IdxK => vec![t, cfg.indexer.as_ref()?.head_dim],
        Stage::IdxWeights => vec![t, cfg.indexer.as_ref()?.n_head],
        Stage::IdxScores => vec![t, t],
        Stage::IdxTopk => vec![t, cfg.indexer.as_ref()?.top_k.min(t)],
        Stage::WRank(..) | Stage::OProjRank(..) => return None,
    })
}

/// Brings a dumped tensor to the site's shape: equal, flattened trailing dims, `[T, 1, X]` for
/// `[T, X]`, or head-major (transposed): `[N, T, X]` for a `[T, N, X]` site and, when `per_head`
/// (the `[T, N]` lse), `[N, T]` for `[T, N]`. Under `layout = head-major` the head-major form is
/// expected; otherwise it is taken only when `N ≠ T` and it is the only reading that fits.
/// Returns the data in our order and a note when something was converted.
fn normalize_shape(
    data: Vec<f64>,
    shape: &[usize],
    want: &[usize],
    layout: Layout,
    per_head: bool,
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
    // (T, N, X) of a site with a head axis: [T, N, X], or the [T, N] lse with X = 1.
    let dims = match want {
        [t, n, x] => Some((*t, *n, *x)),
        [t, n] if per_head => Some((*t, *n, 1)),
        _ => None,
    };
    let (hm_shape, hm_text, tm_text) = match want {
        [t, n, x] => (vec![*n, *t, *x], "[N, T, X]", "[T, N, X]"),
        [t, n] => (vec![*n, *t], "[N, T]", "[T, N]"),
        _ => (Vec::new(), "", ""),
    };
    let hm_shape_ok = dims.is_some() && shape == hm_shape.as_slice();
    if layout == Layout::HeadMajor
        && let Some((tt, nn, x)) = dims
    {
        if hm_shape_ok {
            let out = head_major(&data, nn, tt, x);
            return Ok((out, Some(format!("head-major {hm_text} transposed to {tm_text}"))));
        }
        if !(want.len() == 2 && shape == want && tt != nn) {
            return Err(format!("layout=head-major expects {hm_text} = {hm_shape:?}"));
        }
    }
    if shape == want {
        return Ok((data, None));
    }
    let n: usize = shape.iter().product();
    if n == numel && !shape.is_empty() && shape[0] == want[0] {
        // [T, N·X] for [T, N, X], [T, 1, X] for [T, X], or any other split of the trailing dims.
        if crate::core::trace::shapes_compatible(want, shape)
            || shape.iter().skip(1).product::<usize>() == numel / want[0]
        {
            return Ok((data, Some(format!("shape {shape:?} read as {want:?}"))));
        }
    }
    if hm_shape_ok
        && let Some((tt, nn, x)) = dims
        && tt != nn
    {
        let out = head_major(&data, nn, tt, x);
        return Ok((
            out,
            Some(format!(
                "head-major {hm_text} transposed to {tm_text} (the only reading that fits)"
            )),
        ));
    }
    Err(format!(
        "expected {want:?} (or a flattened [T, …] form{})",
        if dims.is_some() {
            format!(", or head-major {hm_text} = {hm_shape:?}")
        } else {
            String::new()
        }
    ))
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
                dump_error(
                    path,
                    format!("__metadata__.{key}"),
                    format!("`{s}` is not a comma-separated list of integers"),
                )
            })
        })
        .collect()
}

/// The built-in map a dump needs when none was given, from its metadata: `llama.cpp` for a dump
/// whose `engine` starts with `llama.cpp` (what `scripts/dump_llama_cpp.py` writes) and none of
/// whose tensor `names` is a site (`L0.hidden_in`, …): llama.cpp's graph names (`kv_cmpr-0#1`)
/// mean nothing without it. `None` otherwise.
///
/// Errors: as [`Map::load`] for the built-in map.
pub fn map_from_metadata(metadata: &BTreeMap<String, String>, names: &[&str]) -> Result<Option<Map>> {
    let llama_cpp = metadata
        .get("engine")
        .is_some_and(|e| e.trim().to_ascii_lowercase().starts_with("llama.cpp"));
    if llama_cpp && !names.iter().any(|n| Site::parse(n).is_some()) {
        return Map::load("llama.cpp").map(Some);
    }
    Ok(None)
}

/// How a dump's sites are laid out, from the map (which wins) or the file's metadata.
struct DumpConventions {
    rope_order: RopeOrder,
    layout: Layout,
    kv_a_order: KvAOrder,
    dtype: EngineDtype,
}

/// One two-valued dump convention: the map's value when it sets one, else `metadata[key]` as one
/// of the two `names` (the first is the default when the key is absent).
///
/// Errors: [`Error::Safetensors`] naming `__metadata__.{key}` when the value is neither name.
fn two_valued<T: Copy>(
    path: &Path,
    from_map: Option<T>,
    metadata: &BTreeMap<String, String>,
    key: &str,
    names: [(&str, T); 2],
) -> Result<T> {
    if let Some(v) = from_map {
        return Ok(v);
    }
    let Some(value) = metadata.get(key).map(|s| s.trim()) else {
        return Ok(names[0].1);
    };
    match names.iter().find(|(name, _)| *name == value) {
        Some(&(_, v)) => Ok(v),
        None => Err(dump_error(
            path,
            format!("__metadata__.{key}"),
            format!("`{value}`: expected `{}` or `{}`", names[0].0, names[1].0),
        )),
    }
}

/// The dump's conventions: `rope_order`, `layout`, `kv_a_order` from `map` or `metadata`
/// (defaults interleaved, token-major, latent-rope), `dtype` from `metadata` (default f32).
///
/// Errors: [`Error::Safetensors`] naming the metadata key of an unknown value.
fn conventions(path: &Path, map: Option<&Map>, metadata: &BTreeMap<String, String>) -> Result<DumpConventions> {
    let rope_order = two_valued(
        path,
        map.and_then(|m| m.rope_order),
        metadata,
        "rope_order",
        [("interleaved", RopeOrder::Interleaved), ("hf", RopeOrder::Hf)],
    )?;
    let layout = two_valued(
        path,
        map.and_then(|m| m.layout),
        metadata,
        "layout",
        [("token-major", Layout::TokenMajor), ("head-major", Layout::HeadMajor)],
    )?;
    let kv_a_order = two_valued(
        path,
        map.and_then(|m| m.kv_a_order),
        metadata,
        "kv_a_order",
        [
            ("latent-rope", KvAOrder::LatentRope),
            ("rope-latent", KvAOrder::RopeLatent),
        ],
    )?;
    let dtype = match metadata.get("dtype").map(|s| s.trim()) {
        None | Some("f32") | Some("float32") | Some("f64") | Some("float64") => EngineDtype::F32,
        Some("bf16") | Some("bfloat16") => EngineDtype::Bf16,
        Some("f16") | Some("float16") => EngineDtype::F16,
        Some(o) => {
            return Err(dump_error(
                path,
                "__metadata__.dtype",
                format!("`{o}`: expected f32, bf16 or f16"),
            ));
        }
    };
    Ok(DumpConventions {
        rope_order,
        layout,
        kv_a_order,
        dtype,
    })
}

/// A dump's tensors sorted out: sites (after renames), `tokens`, `positions`, and the names of
/// the other tensors.
struct DumpTensors {
    raw: Vec<RawSite>,
    tokens: Option<Vec<usize>>,
    positions: Option<Vec<usize>>,
    ignored: Vec<String>,
}

/// Reads every tensor of `st` that is a site (by name or through `map`), `tokens` or
/// `positions`, in name order.
///
/// Errors: [`Error::Safetensors`] naming the tensor: an unreadable tensor, a site with an
/// integer dtype (but id sites), two tensors for one site, no site at all.
fn collect_tensors(
    path: &Path,
    st: &SafeTensors<'_>,
    map: Option<&Map>,
    cfg: &MlaConfig,
    metadata: &BTreeMap<String, String>,
) -> Result<DumpTensors> {
    let mut raw: Vec<RawSite> = Vec::new();
    let mut tokens = None;
    let mut positions = None;
    let mut ignored = Vec::new();
    let mut names: Vec<String> = st.names().into_iter().map(str::to_string).collect();
    names.sort();
    for name in names {
        let view = st.tensor(&name).map_err(|e| dump_error(path, &name, e.to_string()))?;
        let shape = view.shape().to_vec();
        let site = map.and_then(|m| m.rename_of(&name, cfg)).or_else(|| Site::parse(&name));
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
            return Err(dump_error(
                path,
                &name,
                format!(
                    "site {site} has integer dtype {:?}; sites must be F32, F16, BF16 or F64 (only id sites such as moe_topk may be integers)",
                    view.dtype()
                ),
            ));
        }
        if let Some(prev) = raw.iter().find(|e| e.site == site) {
            return Err(dump_error(
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
        return Err(dump_error(
            path,
            "tensors",
            format!(
                "no site found (names like `L3.kv_c_normed`); {} other tensor(s){}",
                ignored.len(),
                match (map, metadata.get("engine")) {
                    (Some(_), _) => String::new(),
                    (None, Some(e)) => format!(
                        ": does the dump need --map (hf, vllm, llama.cpp or a MAP.json)? Its metadata says engine `{}`",
                        e.trim()
                    ),
                    (None, None) => ": does the dump need --map (hf, vllm, llama.cpp or a MAP.json)?".to_string(),
                }
            ),
        ));
    }
    Ok(DumpTensors {
        raw,
        tokens,
        positions,
        ignored,
    })
}

/// T: the length of `tokens`, else of `positions`, else the token dim of the first activation
/// site (dim 1 of a head-major `[N, T, X]` site).
///
/// Errors: [`Error::Safetensors`] when T cannot be told, `tokens` and `positions` differ in
/// length, or a token id is outside the vocabulary.
fn token_count(
    path: &Path,
    raw: &[RawSite],
    tokens: Option<&[usize]>,
    positions: Option<&[usize]>,
    layout: Layout,
    cfg: &MlaConfig,
) -> Result<usize> {
    let t = match (tokens, positions) {
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
        return Err(dump_error(
            path,
            "tokens",
            "cannot tell the number of tokens T (no activation site, no tokens)",
        ));
    }
    if let (Some(tk), Some(p)) = (tokens, positions)
        && tk.len() != p.len()
    {
        return Err(dump_error(
            path,
            "positions",
            format!("{} positions for {} tokens", p.len(), tk.len()),
        ));
    }
    if let Some(tk) = tokens
        && cfg.vocab > 0
        && let Some(&bad) = tk.iter().find(|&&x| x >= cfg.vocab)
    {
        return Err(dump_error(
            path,
            "tokens",
            format!("token id {bad} outside the vocabulary of {}", cfg.vocab),
        ));
    }
    Ok(t)
}

/// The batch of a dump with T = `t` tokens: sequences from `seq_lens` metadata (default one),
/// each starting at its first position (`positions` tensor, else metadata, else 0).
///
/// Errors: [`Error::Safetensors`] for `seq_lens` that do not add up to T, positions of another
/// length, or positions that do not increase by one within a sequence.
fn dump_batch(
    path: &Path,
    metadata: &BTreeMap<String, String>,
    positions: Option<Vec<usize>>,
    t: usize,
) -> Result<Batch> {
    let seq_lens = match metadata.get("seq_lens") {
        Some(s) => parse_list(path, "seq_lens", s)?,
        None => vec![t],
    };
    if seq_lens.iter().sum::<usize>() != t || seq_lens.contains(&0) {
        return Err(dump_error(
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
        return Err(dump_error(
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
                return Err(dump_error(
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
    Ok(Batch { seqs })
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
    if bytes.starts_with(b"GGUF") {
        return Err(dump_error(
            path,
            "header",
            "this is a GGUF file, not a safetensors dump; pass it as --model",
        ));
    }
    let st = SafeTensors::deserialize(bytes).map_err(|e| header_error(path, bytes, &e))?;
    let (_, meta) = SafeTensors::read_metadata(bytes).map_err(|e| header_error(path, bytes, &e))?;
    let metadata: BTreeMap<String, String> = meta.metadata().clone().unwrap_or_default().into_iter().collect();
    let auto = match map {
        Some(_) => None,
        None => map_from_metadata(&metadata, &st.names())?,
    };
    let map = map.or(auto.as_ref());
    let DumpConventions {
        rope_order,
        layout,
        kv_a_order,
        dtype,
    } = conventions(path, map, &metadata)?;

    let DumpTensors {
        raw,
        tokens,
        positions,
        ignored,
    } = collect_tensors(path, &st, map, cfg, &metadata)?;

    let t = token_count(path, &raw, tokens.as_deref(), positions.as_deref(), layout, cfg)?;

    let batch = dump_batch(path, &metadata, positions, t)?;

    // Normalize every site.
    let (l, r) = (cfg.kv_lora_rank, cfg.qk_rope_head_dim);
    let mut layers: BTreeMap<usize, Trace> = BTreeMap::new();
    let mut conversions = Vec::new();
    if let (Some(m), Some(engine)) = (&auto, metadata.get("engine")) {
        conversions.push(format!(
            "map `{}` picked from the metadata `engine = {engine}` (no --map given; no tensor is named as a site)",
            m.name.as_deref().unwrap_or_default()
        ));
    }
    conversions.extend(map.map(|m| m.override_lines(&metadata)).unwrap_or_default());
    for RawSite {
        site,
        name,
        shape,
        data: v,
    } in raw
    {
        if site.layer >= cfg.n_layer {
            return Err(dump_error(
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
                    site.stage == Stage::Lse,
                )
                .map_err(|why| dump_error(path, &name, format!("site {site} has shape {shape:?}; {why}")))?;
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
        map: auto.and_then(|m| m.name),
        metadata,
        layers,
        tokens: tokens.map(|v| v.into_iter().map(|x| x as u32).collect()),
        batch,
        dtype,
        conversions,
        ignored,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rename_patterns() {
        let m = Map {
            rename: vec![
                Rename::new("kv_cmpr-{n}#1", "kv_c_normed"),
                Rename::new("inp_embd#0", "L0.hidden_in"),
                Rename::new("l_out-{n}#0", "hidden_out"),
            ],
            ..Map::default()
        };
        let cfg = cfg(KvBLayout::Split, Some(64));
        assert_eq!(m.rename_of("kv_cmpr-12#1", &cfg), Site::parse("L12.kv_c_normed"));
        assert_eq!(m.rename_of("kv_cmpr-12#0", &cfg), None);
        assert_eq!(m.rename_of("kv_cmpr-x#1", &cfg), None);
        assert_eq!(m.rename_of("inp_embd#0", &cfg), Site::parse("L0.hidden_in"));
        assert_eq!(m.rename_of("l_out-0#0", &cfg), Site::parse("L0.hidden_out"));
    }

    /// A config with the given kv_b layout and q_lora_rank (other dims irrelevant here).
    fn cfg(kv_b_layout: KvBLayout, q_lora_rank: Option<usize>) -> MlaConfig {
        MlaConfig {
            arch: crate::model::arch::Arch::Deepseek2,
            n_layer: 2,
            hidden: 8,
            n_head: 2,
            q_lora_rank,
            kv_lora_rank: 4,
            qk_nope_head_dim: 2,
            qk_rope_head_dim: 2,
            v_head_dim: 2,
            rms_eps: 1e-6,
            rope_base: 10000.0,
            yarn: None,
            softmax_scale: 0.5,
            kv_b_layout,
            leading_dense_block_count: 2,
            vocab: 0,
            moe: None,
            rope_style: crate::model::config::RopeStyle::Interleaved,
            rope_factors: None,
            indexer: None,
            nextn_predict_layers: 0,
            embedding_scale: 1.0,
            residual_scale: 1.0,
        }
    }

    #[test]
    fn rename_conditions_select_rules_by_model() {
        let m: Map = serde_json::from_str(
            r#"{"rename": [["q-{n}#1", "q_c_normed", "q_lora"], ["q-{n}#1", "q", "no_q_lora"],
                           ["kqv-{n}#0", "attn_latent", "split_kv_b"], ["kv-{n}#0", "k_nope", "fused_kv_b"]]}"#,
        )
        .unwrap();
        assert_eq!(m.rename[0].when, Some(Condition::QLora));
        let (split_lora, fused_plain) = (cfg(KvBLayout::Split, Some(64)), cfg(KvBLayout::Fused, None));
        assert_eq!(m.rename_of("q-3#1", &split_lora), Site::parse("L3.q_c_normed"));
        assert_eq!(m.rename_of("q-3#1", &fused_plain), Site::parse("L3.q"));
        assert_eq!(m.rename_of("kqv-0#0", &split_lora), Site::parse("L0.attn_latent"));
        assert_eq!(m.rename_of("kqv-0#0", &fused_plain), None);
        assert_eq!(m.rename_of("kv-0#0", &split_lora), None);
        assert_eq!(m.rename_of("kv-0#0", &fused_plain), Site::parse("L0.k_nope"));
        // q_lora_rank 0 counts as no q_lora.
        assert!(Condition::NoQLora.holds(&cfg(KvBLayout::Split, Some(0))));
        // Round trip: two- and three-element rules.
        let back: Map = serde_json::from_str(&serde_json::to_string(&m).unwrap()).unwrap();
        assert_eq!(back, m);
        assert!(serde_json::to_string(&Rename::new("a", "b")).unwrap() == r#"["a","b"]"#);
        // Unknown condition, too short or too long: serde errors naming what is wrong.
        let e = serde_json::from_str::<Map>(r#"{"rename": [["a", "b", "absorbed"]]}"#).unwrap_err();
        assert!(e.to_string().contains("unknown variant `absorbed`"), "{e}");
        let e = serde_json::from_str::<Map>(r#"{"rename": [["a"]]}"#).unwrap_err();
        assert!(e.to_string().contains("invalid length 1"), "{e}");
        assert!(serde_json::from_str::<Map>(r#"{"rename": [["a", "b", "q_lora", "x"]]}"#).is_err());
    }

    #[test]
    fn map_overrides_are_listed() {
        let meta: BTreeMap<String, String> = [("rope_order".to_string(), "hf".to_string())].into_iter().collect();
        let m = Map {
            name: Some("m".into()),
            rope_order: Some(RopeOrder::Interleaved),
            kv_a_order: Some(KvAOrder::RopeLatent),
            ..Map::default()
        };
        assert_eq!(
            m.override_lines(&meta),
            vec![
                "map `m` sets rope_order = interleaved (overrides the dump's metadata rope_order = hf)".to_string(),
                "map `m` sets kv_a_order = rope-latent (the dump has no such metadata)".to_string(),
            ]
        );
        assert!(Map::load("vllm").unwrap().override_lines(&meta).is_empty());
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
        let (o, note) = normalize_shape(d.clone(), &[2, 12], &[2, 3, 4], Layout::TokenMajor, false).unwrap();
        assert_eq!(o, d);
        assert!(note.unwrap().contains("read as"));
        let (o, note) = normalize_shape(d.clone(), &[3, 2, 4], &[2, 3, 4], Layout::TokenMajor, false).unwrap();
        assert!(note.unwrap().contains("head-major"));
        assert_eq!(&o[4..8], &d[8..12]); // [t=0, h=1] came from [h=1, t=0]
        assert!(normalize_shape(d.clone(), &[4, 6], &[2, 3, 4], Layout::TokenMajor, false).is_err());
        assert!(normalize_shape(d, &[2, 3, 4], &[2, 3, 4], Layout::HeadMajor, false).is_err());
    }

    #[test]
    fn lse_is_accepted_head_major() {
        // lse [T=2, N=3] given as [N, T]: transposed, noted.
        let hm: Vec<f64> = vec![0.0, 1.0, 10.0, 11.0, 20.0, 21.0]; // [h][t] = 10h + t
        let (o, note) = normalize_shape(hm.clone(), &[3, 2], &[2, 3], Layout::TokenMajor, true).unwrap();
        assert_eq!(o, vec![0.0, 10.0, 20.0, 1.0, 11.0, 21.0]);
        assert_eq!(
            note.unwrap(),
            "head-major [N, T] transposed to [T, N] (the only reading that fits)"
        );
        // A [T, H] site is never transposed.
        assert!(normalize_shape(hm.clone(), &[3, 2], &[2, 3], Layout::TokenMajor, false).is_err());
        // N = T: token-major unless the metadata says head-major.
        let sq: Vec<f64> = vec![0.0, 1.0, 10.0, 11.0]; // [h][t]
        let (o, note) = normalize_shape(sq.clone(), &[2, 2], &[2, 2], Layout::TokenMajor, true).unwrap();
        assert_eq!((o, note), (sq.clone(), None));
        let (o, note) = normalize_shape(sq, &[2, 2], &[2, 2], Layout::HeadMajor, true).unwrap();
        assert_eq!(o, vec![0.0, 10.0, 1.0, 11.0]);
        assert_eq!(note.unwrap(), "head-major [N, T] transposed to [T, N]");
        // Under layout=head-major a token-major lse is still read when only that fits (N ≠ T).
        let (o, note) = normalize_shape(hm.clone(), &[2, 3], &[2, 3], Layout::HeadMajor, true).unwrap();
        assert_eq!((o, note), (hm, None));
    }
}
