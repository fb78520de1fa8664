//! The layout conventions a dump is written in, and how they are told for one file.
//!
//! Engines differ in ways that are not bugs: HF returns rotated rope vectors as `[even | odd]`
//! halves, HF's attention tensors are head-major, older llama.cpp cache rows put `k_pe` before
//! the latent, and engines compute in bf16 or f16. A dump declares these in its metadata
//! (format 1) or header (format 2), a [`Map`] may override them, and a llama.cpp dump without a
//! map gets the built-in one ([`map_from_metadata`]). Reading resolves them once per file into
//! `DumpConventions`, which the layout conversions then undo; an unknown value is an input error
//! naming its metadata key, never a silent default.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::dump_error;
use super::map::Map;
use crate::core::dtype::Dtype;
use crate::core::error::Result;
use crate::core::trace::Site;

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

/// The built-in map a dump needs when none was given, from its metadata: `llama.cpp` for a dump
/// whose `engine` starts with `llama.cpp` (what `python -m mla_diff_hooks.llama_cpp` writes) and none of
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
pub(super) struct DumpConventions {
    /// Order of the rotated rope elements.
    pub(super) rope_order: RopeOrder,
    /// Axis order of the `[T, N, X]` sites.
    pub(super) layout: Layout,
    /// Column order of `kv_a` rows.
    pub(super) kv_a_order: KvAOrder,
    /// The engine's compute dtype.
    pub(super) dtype: EngineDtype,
}

/// One two-valued dump convention: the map's value when it sets one, else `metadata[key]` as one
/// of the two `names` (the first is the default when the key is absent).
///
/// Errors: [`Error::Safetensors`](crate::core::error::Error::Safetensors) naming
/// `__metadata__.{key}` when the value is neither name.
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
/// Errors: [`Error::Safetensors`](crate::core::error::Error::Safetensors) naming the metadata key
/// of an unknown value.
pub(super) fn conventions(
    path: &Path,
    map: Option<&Map>,
    metadata: &BTreeMap<String, String>,
) -> Result<DumpConventions> {
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

/// Checks a format-2 header's `conventions` and `dtype` by the reader's own rules
/// ([`conventions`]), naming their format-2 fields: `__metadata__.header.conventions.rope_order`,
/// `….layout`, `….kv_a_order` and `__metadata__.header.dtype` (a format-2 dump has no
/// `__metadata__.rope_order`).
///
/// Errors: [`Error::Safetensors`](crate::core::error::Error::Safetensors) naming the field.
pub(super) fn check_header_conventions(path: &Path, h: &super::DumpHeader) -> crate::core::error::Result<()> {
    use crate::core::error::Error;
    let mut meta = BTreeMap::new();
    for (key, v) in [
        ("rope_order", &h.conventions.rope_order),
        ("layout", &h.conventions.layout),
        ("kv_a_order", &h.conventions.kv_a_order),
        ("dtype", &h.dtype),
    ] {
        if let Some(v) = v {
            meta.insert(key.to_string(), v.clone());
        }
    }
    conventions(path, None, &meta).map(|_| ()).map_err(|e| match e {
        Error::Safetensors { path, what, reason } => {
            let key = what.trim_start_matches("__metadata__.");
            let what = if key == "dtype" {
                "__metadata__.header.dtype".to_string()
            } else {
                format!("__metadata__.header.conventions.{key}")
            };
            Error::Safetensors { path, what, reason }
        }
        other => other,
    })
}
