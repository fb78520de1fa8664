//! Hugging Face checkpoints (`config.json` plus sharded safetensors) as a model source.
//!
//! Most MLA deployments serve the published checkpoints, not GGUF: DeepSeek-V3/R1 and Kimi-K2 in
//! `float8_e4m3fn` with 128 × 128 block scales, DeepSeek-V2 in bf16. So that every command reads
//! them as it reads a GGUF file, this module presents a checkpoint in GGUF terms: `config.json`
//! becomes the `deepseek2.*` metadata llama.cpp's converter would write (the key table is
//! [`CONFIG_KEYS`]), every tensor gets its GGUF name from the tensor table
//! ([`ModelTensor::hf_name`]), the per-expert tensors of a layer are presented as one stacked
//! `ffn_*_exps` tensor, and an fp8 matrix is presented as f32 computed from its codes and its
//! `weight_scale_inv` on each read. Nothing is read at open time but `config.json`, the index and
//! each shard's safetensors header; a layer's tensors are read when the layer is.
//!
//! fp8 block dequantization follows DeepSeek-V3's own (`inference/kernel.py`, `weight_dequant`):
//! `w[r, c] = f32(e4m3(code[r, c])) × scale_inv[r / 128, c / 128]`, one f32 multiply, the scale
//! grid `[⌈out/128⌉, ⌈in/128⌉]` row-major, an edge block being the partial block alone. The block
//! size comes from `quantization_config.weight_block_size`.
//!
//! Untrusted input is checked as a GGUF header is: JSON files are bounded in size, shard names
//! must be bare file names in the folder, every safetensors header is validated (length, dtype,
//! shape × dtype = byte span, spans inside the file) by the `safetensors` crate before a byte of
//! data is touched, and every shape and scale grid is checked against the configuration.
//!
//! Sources: transformers 5.x `DeepseekV2Config` / `DeepseekV3Config` (key names and defaults),
//! llama.cpp `convert_hf_to_gguf.py` `DeepseekV2Model` (the key and tensor mapping), DeepSeek-V3
//! `inference/fp8_cast_bf16.py` (`weight_scale_inv` naming and layout).

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::path::{Path, PathBuf};

use safetensors::Dtype;
use serde_json::Value;

use crate::core::error::{Error, Result};
use crate::model::config::MlaConfig;
use crate::model::gguf::{BlockScales, GgmlType, GgufFile, MetaValue, TensorInfo, TensorSource};
use crate::model::tensors::ModelTensor;

/// The configuration file of a checkpoint folder.
pub const CONFIG_FILE: &str = "config.json";
/// The shard index of a sharded checkpoint (`weight_map`: tensor name → shard file).
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// The single file of an unsharded checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";
/// Largest `config.json` or index read (DeepSeek-V3's index is 8.9 MB).
pub const MAX_JSON_BYTES: u64 = 64 << 20;
/// Most shards a checkpoint may list (DeepSeek-V3 has 163).
pub const MAX_SHARDS: usize = 100_000;
/// The `model_type`s read, with the family each is (all DeepSeek-V2-style MLA).
pub const SUPPORTED_MODEL_TYPES: [&str; 3] = ["deepseek_v2", "deepseek_v3", "kimi_k2"];

/// `config.json` key ↔ GGUF key (without the `deepseek2.` prefix): which config key each piece of
/// metadata comes from, so an error names the key the user can see. Keys not listed are derived:
/// `attention.key_length_mla` = `qk_nope_head_dim + qk_rope_head_dim`,
/// `rope.scaling.yarn_log_multiplier` = 0.1 · `mscale_all_dim`, `block_count` =
/// `num_hidden_layers + num_nextn_predict_layers`.
pub const CONFIG_KEYS: [(&str, &str); 22] = [
    ("num_hidden_layers", "block_count"),
    ("hidden_size", "embedding_length"),
    ("intermediate_size", "feed_forward_length"),
    ("num_attention_heads", "attention.head_count"),
    ("q_lora_rank", "attention.q_lora_rank"),
    ("kv_lora_rank", "attention.kv_lora_rank"),
    ("qk_rope_head_dim", "rope.dimension_count"),
    ("qk_nope_head_dim", "attention.key_length_mla"),
    ("v_head_dim", "attention.value_length_mla"),
    ("rms_norm_eps", "attention.layer_norm_rms_epsilon"),
    ("rope_theta", "rope.freq_base"),
    ("rope_scaling.factor", "rope.scaling.factor"),
    (
        "rope_scaling.original_max_position_embeddings",
        "rope.scaling.original_context_length",
    ),
    ("first_k_dense_replace", "leading_dense_block_count"),
    ("n_routed_experts", "expert_count"),
    ("num_experts_per_tok", "expert_used_count"),
    ("n_shared_experts", "expert_shared_count"),
    ("moe_intermediate_size", "expert_feed_forward_length"),
    ("routed_scaling_factor", "expert_weights_scale"),
    ("scoring_func", "expert_gating_func"),
    ("n_group", "expert_group_count"),
    ("topk_group", "expert_group_used_count"),
];

/// Whether `path` names a Hugging Face checkpoint: a folder holding `config.json`, or a
/// `*.json` file in such a folder (its index or its config).
pub fn is_checkpoint(path: &Path) -> bool {
    if path.is_dir() {
        return path.join(CONFIG_FILE).is_file();
    }
    path.extension().is_some_and(|e| e == "json")
}

/// Opens a checkpoint folder (or its index or `config.json`) and presents it as a [`GgufFile`].
///
/// Reads `config.json`, the index and every shard's safetensors header; no tensor data. The
/// configuration is validated once here ([`MlaConfig::from_gguf`] on the presented metadata), with
/// its errors naming the `config.json` key.
///
/// Errors: [`Error::Io`] for an unreadable file; [`Error::Input`] naming the file and field for
/// malformed JSON, a shard outside the folder, a bad safetensors header, an unsupported dtype, a
/// tensor the index places in a shard that lacks it, a missing or misshapen `weight_scale_inv`,
/// experts of unequal shape; [`Error::MissingKey`] / [`Error::BadKey`] naming the `config.json`
/// key; [`Error::NotSupported`] for a `model_type`, quantization method or MoE routing mla-diff
/// does not model.
pub fn open(path: &Path) -> Result<GgufFile> {
    let dir = if path.is_dir() {
        path.to_path_buf()
    } else {
        path.parent().map_or_else(|| PathBuf::from("."), Path::to_path_buf)
    };
    let config_path = dir.join(CONFIG_FILE);
    let config_bytes = read_json_file(&config_path)?;
    let config: Value = parse_json(&config_path, &config_bytes)?;
    let cfg = Config {
        path: &config_path,
        v: &config,
    };
    let Some(model_type) = cfg.str("model_type")? else {
        return Err(cfg.bad(
            "model_type",
            format!("missing (supported: {})", SUPPORTED_MODEL_TYPES.join(", ")),
        ));
    };
    if !SUPPORTED_MODEL_TYPES.contains(&model_type) {
        return Err(Error::NotSupported(format!(
            "{}: model_type `{model_type}` is not read from Hugging Face checkpoints (supported: {}); \
             convert it to GGUF with llama.cpp's convert_hf_to_gguf.py",
            config_path.display(),
            SUPPORTED_MODEL_TYPES.join(", ")
        )));
    }
    let block = fp8_block(&cfg)?;
    let (metadata, key_names) = gguf_metadata(&cfg)?;

    let index_path = dir.join(INDEX_FILE);
    let (index_bytes, weight_map) = if index_path.is_file() {
        let bytes = read_json_file(&index_path)?;
        let v = parse_json(&index_path, &bytes)?;
        (bytes, weight_map(&index_path, &v)?)
    } else if dir.join(SINGLE_FILE).is_file() {
        (Vec::new(), BTreeMap::new())
    } else {
        return Err(Error::input(
            &dir,
            "checkpoint",
            format!("neither {INDEX_FILE} nor {SINGLE_FILE} is in the folder"),
        ));
    };
    let mut shard_names: Vec<String> = weight_map.values().cloned().collect();
    shard_names.sort();
    shard_names.dedup();
    if shard_names.is_empty() {
        shard_names.push(SINGLE_FILE.to_string());
    }
    if shard_names.len() > MAX_SHARDS {
        return Err(Error::input(
            &index_path,
            "weight_map",
            format!("{} shards, more than {MAX_SHARDS}", shard_names.len()),
        ));
    }
    let mut shards = Vec::with_capacity(shard_names.len());
    let mut stored: HashMap<String, Stored> = HashMap::new();
    let mut header_bytes_read = config_bytes.len() + index_bytes.len();
    for (si, name) in shard_names.iter().enumerate() {
        let shard = Shard::open(&dir, name)?;
        header_bytes_read += shard.header_len;
        for (tname, info) in shard.meta.tensors() {
            let (begin, end) = info.data_offsets;
            stored.insert(
                tname.clone(),
                Stored {
                    shard: si,
                    name: tname,
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    start: shard.header_len + begin,
                    len: end - begin,
                },
            );
        }
        shards.push(shard);
    }
    for (tname, shard) in &weight_map {
        match stored.get(tname) {
            Some(s) if shard_names[s.shard] == *shard => {}
            _ => {
                return Err(Error::input(
                    &index_path,
                    format!("weight_map[\"{tname}\"]"),
                    format!("names shard {shard}, whose header has no such tensor"),
                ));
            }
        }
    }

    let (infos, presented) = present(&dir, &stored, &shard_names, block)?;
    let source = HfSource {
        by_name: stored.into_iter().collect(),
        shards,
        shard_names,
        tensors: presented,
        config_bytes,
        index_bytes,
        header_bytes_read,
    };
    let file = GgufFile::from_source(dir.clone(), metadata, infos, Box::new(source))?;
    MlaConfig::from_gguf(&file).map_err(|e| config_error(e, &config_path, &key_names))?;
    Ok(file)
}

/// `(GGUF key → config.json key)` for the keys this checkpoint's metadata came from.
type KeyNames = HashMap<String, String>;

/// A presented-metadata error renamed to the `config.json` key it came from.
fn config_error(e: Error, config_path: &Path, names: &KeyNames) -> Error {
    match e {
        Error::MissingKey { key, .. } => Error::MissingKey {
            path: config_path.to_path_buf(),
            key: names.get(&key).cloned().unwrap_or_else(|| hf_key_for(&key)),
        },
        Error::BadKey { key, reason, .. } => Error::BadKey {
            path: config_path.to_path_buf(),
            key: names.get(&key).cloned().unwrap_or_else(|| hf_key_for(&key)),
            reason,
        },
        other => other,
    }
}

/// The `config.json` key a GGUF key comes from, by [`CONFIG_KEYS`] (or the GGUF key itself).
fn hf_key_for(gguf_key: &str) -> String {
    let short = gguf_key.split_once('.').map_or(gguf_key, |(_, rest)| rest);
    CONFIG_KEYS
        .iter()
        .find(|(_, g)| *g == short)
        .map_or_else(|| gguf_key.to_string(), |(h, _)| (*h).to_string())
}

fn read_json_file(path: &Path) -> Result<Vec<u8>> {
    let (_, len) = crate::core::fsio::open_regular(path)?;
    if len > MAX_JSON_BYTES {
        return Err(Error::input(
            path,
            "size",
            format!("{len} bytes, more than the {MAX_JSON_BYTES} a checkpoint's JSON may have"),
        ));
    }
    crate::core::fsio::read_regular(path)
}

fn parse_json(path: &Path, bytes: &[u8]) -> Result<Value> {
    let v: Value = serde_json::from_slice(bytes).map_err(|e| Error::input(path, "JSON", e.to_string()))?;
    if !v.is_object() {
        return Err(Error::input(path, "JSON", "is not an object"));
    }
    Ok(v)
}

/// The index's `weight_map`, every shard a bare file name.
fn weight_map(path: &Path, v: &Value) -> Result<BTreeMap<String, String>> {
    let Some(map) = v.get("weight_map").and_then(Value::as_object) else {
        return Err(Error::input(path, "weight_map", "missing or not an object"));
    };
    let mut out = BTreeMap::new();
    for (k, shard) in map {
        let Some(shard) = shard.as_str() else {
            return Err(Error::input(path, format!("weight_map[\"{k}\"]"), "is not a string"));
        };
        if !is_bare_name(shard) {
            return Err(Error::input(
                path,
                format!("weight_map[\"{k}\"]"),
                format!(
                    "shard `{}` is not a file name in the checkpoint's folder",
                    shard.escape_debug()
                ),
            ));
        }
        out.insert(k.clone(), shard.to_string());
    }
    Ok(out)
}

/// A file name without a folder part, `.`/`..` or control characters.
fn is_bare_name(s: &str) -> bool {
    !s.is_empty() && s != "." && s != ".." && !s.contains(['/', '\\']) && !s.chars().any(char::is_control)
}

/// Typed reads of `config.json` that name the key on error.
struct Config<'a> {
    path: &'a Path,
    v: &'a Value,
}

impl Config<'_> {
    /// `key` (dotted for a nested object: `rope_scaling.factor`), `None` when absent or null.
    fn get(&self, key: &str) -> Option<&Value> {
        let mut v = self.v;
        for part in key.split('.') {
            v = v.get(part)?;
        }
        (!v.is_null()).then_some(v)
    }

    fn bad(&self, key: &str, reason: impl Into<String>) -> Error {
        Error::BadKey {
            path: self.path.to_path_buf(),
            key: key.to_string(),
            reason: reason.into(),
        }
    }

    fn str(&self, key: &str) -> Result<Option<&str>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| self.bad(key, format!("expected a string, found {v}"))),
        }
    }

    fn u64(&self, key: &str) -> Result<Option<u64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(Some)
                .ok_or_else(|| self.bad(key, format!("expected a non-negative integer, found {v}"))),
        }
    }

    fn f64(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .filter(|x| x.is_finite())
                .map(Some)
                .ok_or_else(|| self.bad(key, format!("expected a finite number, found {v}"))),
        }
    }

    fn bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.bad(key, format!("expected true or false, found {v}"))),
        }
    }

    /// The RoPE block: `rope_parameters` (transformers 5.x), else the older `rope_scaling`, with
    /// the name of the object it came from. Both present and different is refused: which one a
    /// loader reads differs between versions. They are compared as transformers converts the
    /// older one: its `type` is `rope_type`, and `rope_theta` may live in the newer one only.
    fn rope_object(&self) -> Result<Option<(&'static str, &Value)>> {
        let p = self.get("rope_parameters").filter(|v| v.is_object());
        let s = self.get("rope_scaling").filter(|v| v.is_object());
        if let (Some(p), Some(s)) = (p, s) {
            let differ = s.as_object().into_iter().flatten().any(|(k, v)| {
                let key = if k == "type" { "rope_type" } else { k.as_str() };
                p.get(key).is_none_or(|w| w != v) && k != "rope_theta"
            });
            if differ {
                return Err(self.bad(
                    "rope_scaling",
                    format!("{s} differs from rope_parameters {p}; keep one of the two"),
                ));
            }
        }
        Ok(p.map(|v| ("rope_parameters", v)).or(s.map(|v| ("rope_scaling", v))))
    }
}

/// The block of `quantization_config` (`[128, 128]` for DeepSeek-V3), `None` without one.
fn fp8_block(cfg: &Config<'_>) -> Result<Option<[usize; 2]>> {
    let Some(method) = cfg.str("quantization_config.quant_method")? else {
        if cfg.get("quantization_config").is_some() {
            return Err(cfg.bad("quantization_config.quant_method", "missing"));
        }
        return Ok(None);
    };
    if method != "fp8" {
        return Err(Error::NotSupported(format!(
            "{}: quantization_config.quant_method `{method}` is not read (only DeepSeek-V3's block-scaled `fp8`)",
            cfg.path.display()
        )));
    }
    if let Some(fmt) = cfg.str("quantization_config.fmt")?
        && fmt != "e4m3"
    {
        return Err(Error::NotSupported(format!(
            "{}: quantization_config.fmt `{fmt}` is not read (only `e4m3`)",
            cfg.path.display()
        )));
    }
    let key = "quantization_config.weight_block_size";
    let Some(v) = cfg.get(key) else {
        return Err(Error::NotSupported(format!(
            "{}: fp8 without `{key}` (per-tensor scales) is not read; only 128 × 128 block scales are",
            cfg.path.display()
        )));
    };
    let dims: Vec<u64> = v
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default();
    match dims.as_slice() {
        [r, c] if (1..=1 << 16).contains(r) && (1..=1 << 16).contains(c) => Ok(Some([*r as usize, *c as usize])),
        _ => Err(cfg.bad(key, format!("expected two block sizes in 1..65536, found {v}"))),
    }
}

/// The `deepseek2.*` metadata llama.cpp's converter writes for this configuration, and the
/// config key each GGUF key came from.
fn gguf_metadata(cfg: &Config<'_>) -> Result<(Vec<(String, MetaValue)>, KeyNames)> {
    let arch = "deepseek2";
    let mut meta: Vec<(String, MetaValue)> = vec![
        ("general.architecture".into(), MetaValue::String(arch.into())),
        (
            "general.name".into(),
            MetaValue::String(cfg.str("model_type")?.unwrap_or("").to_string()),
        ),
    ];
    let mut names = KeyNames::new();
    let mut put = |gguf: &str, hf: &str, v: MetaValue, meta: &mut Vec<(String, MetaValue)>| {
        let key = format!("{arch}.{gguf}");
        names.insert(key.clone(), hf.to_string());
        meta.push((key, v));
    };
    for (hf, gguf) in [
        ("hidden_size", "embedding_length"),
        ("intermediate_size", "feed_forward_length"),
        ("num_attention_heads", "attention.head_count"),
        ("kv_lora_rank", "attention.kv_lora_rank"),
        ("qk_rope_head_dim", "rope.dimension_count"),
        ("v_head_dim", "attention.value_length_mla"),
        ("first_k_dense_replace", "leading_dense_block_count"),
        ("n_routed_experts", "expert_count"),
        ("num_experts_per_tok", "expert_used_count"),
        ("n_shared_experts", "expert_shared_count"),
        ("moe_intermediate_size", "expert_feed_forward_length"),
        ("n_group", "expert_group_count"),
        ("topk_group", "expert_group_used_count"),
        ("num_nextn_predict_layers", "nextn_predict_layers"),
    ] {
        if let Some(v) = cfg.u64(hf)? {
            put(gguf, hf, MetaValue::U64(v), &mut meta);
        }
    }
    if let Some(v) = cfg.u64("q_lora_rank")? {
        put("attention.q_lora_rank", "q_lora_rank", MetaValue::U64(v), &mut meta);
    }
    if let Some(n) = cfg.u64("num_hidden_layers")? {
        let nextn = cfg.u64("num_nextn_predict_layers")?.unwrap_or(0);
        let Some(total) = n.checked_add(nextn) else {
            return Err(cfg.bad("num_nextn_predict_layers", "overflows with num_hidden_layers"));
        };
        put("block_count", "num_hidden_layers", MetaValue::U64(total), &mut meta);
    }
    if let (Some(p), Some(r)) = (cfg.u64("qk_nope_head_dim")?, cfg.u64("qk_rope_head_dim")?) {
        let Some(k) = p.checked_add(r) else {
            return Err(cfg.bad("qk_nope_head_dim", "overflows with qk_rope_head_dim"));
        };
        put(
            "attention.key_length_mla",
            "qk_nope_head_dim",
            MetaValue::U64(k),
            &mut meta,
        );
    }
    if let Some(e) = cfg.f64("rms_norm_eps")? {
        put(
            "attention.layer_norm_rms_epsilon",
            "rms_norm_eps",
            MetaValue::F64(e),
            &mut meta,
        );
    }
    if let Some(s) = cfg.f64("routed_scaling_factor")? {
        put(
            "expert_weights_scale",
            "routed_scaling_factor",
            MetaValue::F64(s),
            &mut meta,
        );
    }
    if let Some(b) = cfg.bool("norm_topk_prob")? {
        put("expert_weights_norm", "norm_topk_prob", MetaValue::Bool(b), &mut meta);
    }
    if cfg.u64("n_routed_experts")?.is_some_and(|e| e > 0) {
        let gating = match cfg.str("scoring_func")?.unwrap_or("softmax") {
            "softmax" => 1,
            "sigmoid" => 2,
            other => {
                return Err(Error::NotSupported(format!(
                    "{}: scoring_func `{other}` is not modelled (softmax and sigmoid are)",
                    cfg.path.display()
                )));
            }
        };
        put("expert_gating_func", "scoring_func", MetaValue::U32(gating), &mut meta);
        let method = cfg.str("topk_method")?.unwrap_or("greedy");
        let groups = cfg.u64("n_group")?.unwrap_or(1);
        // mla-diff's router ranks groups by the sum of their two best experts (noaux_tc); V2's
        // group_limited_greedy ranks them by their best expert, which it does not model.
        if method == "group_limited_greedy" && groups > 1 {
            return Err(Error::NotSupported(format!(
                "{}: topk_method `group_limited_greedy` with n_group {groups} (a group ranked by its best expert) \
                 is not modelled; greedy and noaux_tc are",
                cfg.path.display()
            )));
        }
        if let Some(freq) = cfg.u64("moe_layer_freq")?
            && freq != 1
        {
            return Err(Error::NotSupported(format!(
                "{}: moe_layer_freq {freq} (MoE on one layer in {freq}) is not modelled",
                cfg.path.display()
            )));
        }
    }
    // DeepSeek's RoPE rotates adjacent pairs of q_pe/k_pe; `rope_interleave: false` is HF's flag
    // for the NeoX halves, another model.
    if cfg.bool("rope_interleave")? == Some(false) {
        return Err(Error::NotSupported(format!(
            "{}: rope_interleave false (RoPE on NeoX halves) is not modelled; DeepSeek-V2/V3 rotate adjacent pairs",
            cfg.path.display()
        )));
    }
    if let Some(act) = cfg.str("hidden_act")?
        && act != "silu"
    {
        return Err(Error::NotSupported(format!(
            "{}: hidden_act `{act}` is not modelled (the FFN is SwiGLU, silu)",
            cfg.path.display()
        )));
    }
    rope_metadata(cfg, &mut put, &mut meta)?;
    Ok((meta, names))
}

/// The `rope.*` keys: the base, and YaRN's parameters from `rope_parameters` or `rope_scaling`.
fn rope_metadata(
    cfg: &Config<'_>,
    put: &mut impl FnMut(&str, &str, MetaValue, &mut Vec<(String, MetaValue)>),
    meta: &mut Vec<(String, MetaValue)>,
) -> Result<()> {
    let rope = cfg.rope_object()?;
    let theta_key = match rope {
        Some((obj, v)) if v.get("rope_theta").is_some() => format!("{obj}.rope_theta"),
        _ => "rope_theta".to_string(),
    };
    if let Some(t) = cfg.f64(&theta_key)? {
        put("rope.freq_base", &theta_key, MetaValue::F64(t), meta);
    }
    if let Some((obj, v)) = rope {
        let ty_key = if v.get("rope_type").is_some() {
            format!("{obj}.rope_type")
        } else {
            format!("{obj}.type")
        };
        let ty = cfg.str(&ty_key)?.unwrap_or("default");
        match ty {
            "default" => {}
            "yarn" => {
                let k = |s: &str| format!("{obj}.{s}");
                put("rope.scaling.type", &ty_key, MetaValue::String("yarn".into()), meta);
                for (hf, gguf) in [
                    ("factor", "rope.scaling.factor"),
                    (
                        "original_max_position_embeddings",
                        "rope.scaling.original_context_length",
                    ),
                    ("beta_fast", "rope.scaling.yarn_beta_fast"),
                    ("beta_slow", "rope.scaling.yarn_beta_slow"),
                ] {
                    if let Some(x) = cfg.f64(&k(hf))? {
                        put(gguf, &k(hf), MetaValue::F64(x), meta);
                    }
                }
                let all_dim = cfg.f64(&k("mscale_all_dim"))?.unwrap_or(0.0);
                let mscale = cfg.f64(&k("mscale"))?.unwrap_or(1.0);
                // The rotary tables carry m(mscale)/m(mscale_all_dim), 1 when the two are equal,
                // which is what llama.cpp's converter and mla-diff's reference assume.
                if all_dim != 0.0 && (mscale - all_dim).abs() > 0.0 {
                    return Err(Error::NotSupported(format!(
                        "{}: {obj}.mscale {mscale} differs from mscale_all_dim {all_dim}; a rotary table \
                         scaled by their ratio is not modelled",
                        cfg.path.display()
                    )));
                }
                put(
                    "rope.scaling.yarn_log_multiplier",
                    &k("mscale_all_dim"),
                    MetaValue::F64(0.1 * all_dim),
                    meta,
                );
            }
            other => {
                return Err(Error::NotSupported(format!(
                    "{}: {ty_key} `{other}` is not modelled (default and yarn are)",
                    cfg.path.display()
                )));
            }
        }
    }
    Ok(())
}

/// One tensor as a shard stores it: dtype, shape, and its absolute byte span in the shard.
#[derive(Debug, Clone)]
struct Stored {
    shard: usize,
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    start: usize,
    len: usize,
}

/// How a presented tensor's bytes are made.
enum Presented {
    /// Stored as presented (bf16, f16, f32): borrowed from the map.
    Plain(Stored),
    /// An fp8 matrix [out, in] and its scale grid, presented as f32.
    Fp8 {
        w: Stored,
        scale: Stored,
        block: [usize; 2],
    },
    /// Per-expert tensors presented as one `[E, rows, cols]` tensor; each part `part_bytes` long.
    Stacked { parts: Vec<Presented>, part_bytes: usize },
}

/// One mapped shard and its validated safetensors header.
struct Shard {
    map: Option<memmap2::Mmap>,
    /// 8 + the JSON header's length: where the data section starts.
    header_len: usize,
    meta: safetensors::tensor::Metadata,
}

impl Shard {
    fn open(dir: &Path, name: &str) -> Result<Shard> {
        let path = dir.join(name);
        let (file, len) = crate::core::fsio::open_regular(&path)?;
        if len < 8 {
            return Err(Error::input(
                &path,
                "safetensors header",
                format!("file is {len} bytes, shorter than the 8-byte header length"),
            ));
        }
        // SAFETY: a read-only map of a regular file; a file truncated by another process while
        // mapped faults on access, the documented limit of memory-mapped readers (as for GGUF).
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(&path, "mmap", e))?;
        let (n, meta) = safetensors::SafeTensors::read_metadata(&map)
            .map_err(|e| Error::input(&path, "safetensors header", e.to_string()))?;
        Ok(Shard {
            map: Some(map),
            header_len: 8 + n,
            meta,
        })
    }

    fn bytes(&self) -> &[u8] {
        self.map.as_deref().unwrap_or(&[])
    }
}

/// The presented GGUF type of a stored dtype (fp8 is handled apart).
fn plain_type(d: Dtype) -> Option<GgmlType> {
    match d {
        Dtype::BF16 => Some(GgmlType::BF16),
        Dtype::F16 => Some(GgmlType::F16),
        Dtype::F32 => Some(GgmlType::F32),
        _ => None,
    }
}

/// How one stored tensor is presented: fp8 with its block scale (checked against the grid its
/// shape and `block` need), or a plain dtype as stored.
fn present_one(
    s: &Stored,
    stored: &HashMap<String, Stored>,
    block: Option<[usize; 2]>,
    shard_path: &dyn Fn(&Stored) -> PathBuf,
) -> Result<(GgmlType, Presented)> {
    if s.dtype == Dtype::F8_E4M3 {
        let scale_name = format!("{}_scale_inv", s.name);
        let Some(block) = block else {
            return Err(Error::input(
                shard_path(s),
                format!("tensor `{}`", s.name),
                "is F8_E4M3 but config.json has no quantization_config.weight_block_size",
            ));
        };
        let Some(scale) = stored.get(&scale_name) else {
            return Err(Error::input(
                shard_path(s),
                format!("tensor `{}`", s.name),
                format!("is F8_E4M3 without its block scale `{scale_name}`"),
            ));
        };
        let [rows, cols] = s.shape[..] else {
            return Err(Error::input(
                shard_path(s),
                format!("tensor `{}`", s.name),
                format!("F8_E4M3 with shape {:?}; block scales need a matrix", s.shape),
            ));
        };
        let grid = [rows.div_ceil(block[0]), cols.div_ceil(block[1])];
        if scale.dtype != Dtype::F32 || scale.shape != grid {
            return Err(Error::input(
                shard_path(scale),
                format!("tensor `{scale_name}`"),
                format!(
                    "is {:?} {:?}; the {}×{} blocks of {:?} need F32 {grid:?}",
                    scale.dtype, scale.shape, block[0], block[1], s.shape
                ),
            ));
        }
        return Ok((
            GgmlType::F32,
            Presented::Fp8 {
                w: s.clone(),
                scale: scale.clone(),
                block,
            },
        ));
    }
    let Some(ty) = plain_type(s.dtype) else {
        return Err(Error::input(
            shard_path(s),
            format!("tensor `{}`", s.name),
            format!(
                "dtype {:?} is not read (BF16, F16, F32 and block-scaled F8_E4M3 are)",
                s.dtype
            ),
        ));
    };
    Ok((ty, Presented::Plain(s.clone())))
}

/// Maps every stored tensor the tensor table knows to its GGUF name and presentation.
fn present(
    dir: &Path,
    stored: &HashMap<String, Stored>,
    shard_names: &[String],
    block: Option<[usize; 2]>,
) -> Result<(Vec<TensorInfo>, Vec<Presented>)> {
    let shard_path = |s: &Stored| dir.join(&shard_names[s.shard]);
    let one = |s: &Stored| present_one(s, stored, block, &shard_path);
    let mut layers: Vec<usize> = stored.keys().filter_map(|n| hf_layer(n)).collect();
    layers.sort_unstable();
    layers.dedup();
    let mut infos = Vec::new();
    let mut presented = Vec::new();
    let mut offset = 0u64;
    let mut push =
        |gguf: String, shape: Vec<usize>, ty: GgmlType, p: Presented, infos: &mut Vec<TensorInfo>| -> Result<()> {
            let ne: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect();
            let n = ne.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
            let Some(n_bytes) = n.and_then(|n| ty.bytes_for(n)) else {
                return Err(Error::input(
                    dir,
                    format!("tensor `{gguf}`"),
                    format!("shape {shape:?} overflows"),
                ));
            };
            infos.push(TensorInfo {
                name: gguf,
                ne,
                ggml_type: ty,
                offset,
                n_bytes,
            });
            offset = offset.saturating_add(n_bytes);
            presented.push(p);
            Ok(())
        };
    for t in ModelTensor::ALL {
        let Some(pattern) = t.hf_name() else { continue };
        let row = t.row();
        let targets: Vec<Option<usize>> = if row.per_layer {
            layers.iter().map(|&l| Some(l)).collect()
        } else {
            vec![None]
        };
        for layer in targets {
            let gguf = t.name(layer.unwrap_or(0));
            let name_for = |e: Option<usize>| hf_tensor_name(pattern, layer, e);
            if pattern.contains("{e}") {
                let mut parts = Vec::new();
                let mut shape: Option<Vec<usize>> = None;
                let mut ty = None;
                for e in 0.. {
                    let Some(s) = stored.get(&name_for(Some(e))) else { break };
                    let (t1, p) = one(s)?;
                    if shape.as_ref().is_some_and(|sh| *sh != s.shape) || ty.is_some_and(|t| t != t1) {
                        return Err(Error::input(
                            shard_path(s),
                            format!("tensor `{}`", s.name),
                            format!("shape {:?} or dtype {:?} differs from expert 0's", s.shape, s.dtype),
                        ));
                    }
                    shape = Some(s.shape.clone());
                    ty = Some(t1);
                    parts.push(p);
                }
                let (Some(shape), Some(ty)) = (shape, ty) else { continue };
                let per: usize = shape.iter().product();
                let part_bytes = ty.bytes_for(per as u64).unwrap_or(0) as usize;
                let mut full = vec![parts.len()];
                full.extend(shape);
                push(gguf, full, ty, Presented::Stacked { parts, part_bytes }, &mut infos)?;
            } else if let Some(s) = stored.get(&name_for(None)) {
                let (ty, p) = one(s)?;
                push(gguf, s.shape.clone(), ty, p, &mut infos)?;
            }
        }
    }
    Ok((infos, presented))
}

/// The layer of a `model.layers.{n}.…` name.
fn hf_layer(name: &str) -> Option<usize> {
    name.strip_prefix("model.layers.")?.split('.').next()?.parse().ok()
}

/// The checkpoint name of a table pattern: `{n}` the layer, `{e}` the expert.
pub fn hf_tensor_name(pattern: &str, layer: Option<usize>, expert: Option<usize>) -> String {
    let mut s = pattern.to_string();
    if let Some(l) = layer {
        s = s.replace("{n}", &l.to_string());
    }
    if let Some(e) = expert {
        s = s.replace("{e}", &e.to_string());
    }
    s
}

/// The tensor data of an opened checkpoint.
struct HfSource {
    shards: Vec<Shard>,
    /// Every stored tensor by name, in byte order of the names (the layer hash's order).
    by_name: BTreeMap<String, Stored>,
    shard_names: Vec<String>,
    tensors: Vec<Presented>,
    config_bytes: Vec<u8>,
    index_bytes: Vec<u8>,
    header_bytes_read: usize,
}

/// E4M3 (`float8_e4m3fn`) code → f32, all 256 codes (0x7F and 0xFF are NaN).
fn e4m3_table() -> &'static [f32; 256] {
    static TABLE: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| std::array::from_fn(|c| crate::core::fp8::e4m3_value(c as u8) as f32))
}

/// `w[r, c] = f32(e4m3(codes[r, c])) × scale[r / br, c / bc]` for the flat elements `elems` of a
/// `[rows, cols]` fp8 matrix, as little-endian f32 bytes.
pub fn dequant_fp8_block(codes: &[u8], scale: &[f32], cols: usize, block: [usize; 2], elems: Range<usize>) -> Vec<u8> {
    let mut out = vec![0u8; elems.len() * 4];
    fp8_block_into(codes, scale, cols, block, elems.start, &mut out, |d, x| {
        d.copy_from_slice(&x.to_le_bytes())
    });
    out
}

/// [`dequant_fp8_block`] of a whole matrix as f32 values: what a whole-tensor read wants,
/// without the byte copy in between.
fn fp8_block_values(codes: &[u8], scale: &[f32], cols: usize, block: [usize; 2]) -> Vec<f32> {
    let mut out = vec![0f32; codes.len()];
    fp8_block_into(codes, scale, cols, block, 0, &mut out, |d, x| d[0] = x);
    out
}

/// Writes element `first + j` of the dequantized matrix into the `j`-th 4-byte group of `out`
/// (one `f32`, or four `u8`) through `put`. Runs on rayon's pool in chunks of 64 Ki elements: a
/// real model's matrix is 10⁸ elements, each independent.
fn fp8_block_into<T: Send>(
    codes: &[u8],
    scale: &[f32],
    cols: usize,
    block: [usize; 2],
    first: usize,
    out: &mut [T],
    put: impl Fn(&mut [T], f32) + Sync,
) {
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 16;
    let width = std::mem::size_of::<f32>() / std::mem::size_of::<T>();
    let lut = e4m3_table();
    let grid_cols = cols.div_ceil(block[1]);
    out.par_chunks_mut(CHUNK * width).enumerate().for_each(|(k, dst)| {
        let base = first + k * CHUNK;
        let end = base + dst.len() / width;
        // Segment by segment, a segment being the part of a row inside one block: one scale
        // lookup (and its divisions) per segment of up to `block[1]` elements.
        let mut i = base;
        while i < end {
            let (r, c) = (i / cols, i % cols);
            let seg_end = end.min(r * cols + ((c / block[1] + 1) * block[1]).min(cols));
            let s = scale[(r / block[0]) * grid_cols + c / block[1]];
            for (d, &code) in dst[(i - base) * width..(seg_end - base) * width]
                .chunks_exact_mut(width)
                .zip(&codes[i..seg_end])
            {
                put(d, lut[code as usize] * s);
            }
            i = seg_end;
        }
    });
}

impl HfSource {
    fn stored_bytes(&self, s: &Stored) -> &[u8] {
        &self.shards[s.shard].bytes()[s.start..s.start + s.len]
    }

    /// An F32 scale grid's values (its dtype and shape were checked at open).
    fn scale_values(&self, s: &Stored) -> Vec<f32> {
        self.stored_bytes(s)
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    }

    fn part_bytes(&self, p: &Presented, range: Range<usize>) -> Cow<'_, [u8]> {
        match p {
            Presented::Plain(s) => Cow::Borrowed(&self.stored_bytes(s)[range]),
            Presented::Fp8 { w, scale, block } => {
                let codes = self.stored_bytes(w);
                let scale = self.scale_values(scale);
                let cols = w.shape[1];
                let (e0, e1) = (range.start / 4, range.end.div_ceil(4));
                let mut bytes = dequant_fp8_block(codes, &scale, cols, *block, e0..e1);
                let skip = range.start - e0 * 4;
                // A range on element boundaries (every read but a hostile one) is the buffer.
                if skip != 0 || bytes.len() != range.len() {
                    bytes = bytes[skip..skip + range.len()].to_vec();
                }
                Cow::Owned(bytes)
            }
            Presented::Stacked { parts, part_bytes } => {
                let pb = (*part_bytes).max(1);
                let (first, last) = (range.start / pb, range.end.saturating_sub(1) / pb);
                if first == last && first < parts.len() {
                    let base = first * pb;
                    return self.part_bytes(&parts[first], range.start - base..range.end - base);
                }
                let mut out = Vec::with_capacity(range.len());
                for (i, part) in parts.iter().enumerate().take(last + 1).skip(first) {
                    let base = i * pb;
                    let lo = range.start.max(base) - base;
                    let hi = range.end.min(base + pb) - base;
                    out.extend_from_slice(&self.part_bytes(part, lo..hi));
                }
                Cow::Owned(out)
            }
        }
    }

    fn describe(&self, p: &Presented) -> String {
        let at = |s: &Stored| format!("{:?} {:?} in {}", s.dtype, s.shape, self.shard_names[s.shard]);
        match p {
            Presented::Plain(s) => format!("{} {}", s.name, at(s)),
            Presented::Fp8 { w, scale, .. } => format!("{} {} × {} {:?}", w.name, at(w), scale.name, scale.shape),
            Presented::Stacked { parts, .. } => match parts.first() {
                Some(first) => format!("{} experts, expert 0: {}", parts.len(), self.describe(first)),
                None => "no experts".into(),
            },
        }
    }

    fn name_of(p: &Presented) -> String {
        match p {
            Presented::Plain(s) | Presented::Fp8 { w: s, .. } => s.name.clone(),
            Presented::Stacked { parts, .. } => parts.first().map_or_else(String::new, |f| {
                let n = Self::name_of(f);
                n.replacen(".experts.0.", ".experts.{e}.", 1)
            }),
        }
    }
}

impl TensorSource for HfSource {
    fn bytes(&self, index: usize, range: Range<usize>) -> Cow<'_, [u8]> {
        match self.tensors.get(index) {
            Some(p) => self.part_bytes(p, range),
            None => Cow::Owned(Vec::new()),
        }
    }

    fn origin(&self, index: usize) -> String {
        self.tensors.get(index).map_or_else(String::new, |p| self.describe(p))
    }

    fn source_name(&self, index: usize) -> String {
        self.tensors.get(index).map_or_else(String::new, Self::name_of)
    }

    fn kind(&self) -> &'static str {
        "Hugging Face checkpoint"
    }

    fn stored_type(&self, index: usize) -> String {
        fn of(p: &Presented) -> String {
            match p {
                Presented::Plain(s) | Presented::Fp8 { w: s, .. } => format!("{:?}", s.dtype),
                Presented::Stacked { parts, .. } => parts.first().map_or_else(String::new, of),
            }
        }
        self.tensors.get(index).map_or_else(String::new, of)
    }

    fn values_f32(&self, index: usize) -> Option<Vec<f32>> {
        let Some(Presented::Fp8 { w, scale, block }) = self.tensors.get(index) else {
            return None;
        };
        let scale = self.scale_values(scale);
        Some(fp8_block_values(self.stored_bytes(w), &scale, w.shape[1], *block))
    }

    fn block_scales(&self, index: usize) -> Option<BlockScales> {
        let Some(Presented::Fp8 { w, scale, block }) = self.tensors.get(index) else {
            return None;
        };
        let scales = self.scale_values(scale);
        Some(BlockScales {
            name: scale.name.clone(),
            shape: [w.shape[0], w.shape[1]],
            block: *block,
            grid: [w.shape[0].div_ceil(block[0]), w.shape[1].div_ceil(block[1])],
            scale: scales,
        })
    }

    fn sha256_hex(&self) -> String {
        // Every byte: config.json, the index, then each shard in name order.
        use sha2::Digest;
        let mut h = sha2::Sha256::new();
        h.update(&self.config_bytes);
        h.update(&self.index_bytes);
        for s in &self.shards {
            h.update(s.bytes());
        }
        h.finalize().iter().map(|b| format!("{b:02x}")).collect()
    }

    fn index_sha256_hex(&self) -> String {
        use sha2::Digest;
        let mut h = sha2::Sha256::new();
        h.update(&self.config_bytes);
        if self.index_bytes.is_empty() {
            // An unsharded checkpoint: its one file's length prefix and JSON header.
            if let Some(s) = self.shards.first() {
                h.update(&s.bytes()[..s.header_len.min(s.bytes().len())]);
            }
        } else {
            h.update(&self.index_bytes);
        }
        h.finalize().iter().map(|b| format!("{b:02x}")).collect()
    }

    fn layer_sha256_hex(&self, layer: usize) -> Option<String> {
        use sha2::Digest;
        let mut h = sha2::Sha256::new();
        for (name, s) in &self.by_name {
            if name.starts_with(&format!("model.layers.{layer}.")) {
                h.update(self.stored_bytes(s));
            }
        }
        Some(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
    }

    fn total_bytes(&self) -> u64 {
        let shards: u64 = self.shards.iter().map(|s| s.bytes().len() as u64).sum();
        shards + self.config_bytes.len() as u64 + self.index_bytes.len() as u64
    }

    fn header_bytes_read(&self) -> usize {
        self.header_bytes_read
    }

    fn release_resident_pages(&self) {
        for s in &self.shards {
            if let Some(m) = &s.map {
                // SAFETY: read-only file maps; discarded pages are read again from the file.
                let _ = unsafe { m.unchecked_advise(memmap2::UncheckedAdvice::DontNeed) };
            }
        }
    }
}
