//! The MLA configuration of a model, read from GGUF metadata.
//!
//! Every later stage needs the MLA dims (`N`, `Lq`, `L`, `P`, `R`, `V`), the RoPE/YaRN settings
//! and the softmax scale, and the GGUF keys that carry them changed over time: MLA-era files (the
//! converter since llama.cpp's MLA support) split `kv_b` and add `*_mla` key/value lengths; legacy
//! files have one `attn_kv_b` and put the MLA head widths in `key_length`/`value_length`. This
//! module reads both, treats an absent or zero `q_lora_rank` as "no q compression", and derives
//! the YaRN softmax scale of MLA.md step 7. A missing or unusable key is an error naming the key.

use serde::Serialize;

use crate::error::{Error, Result};
use crate::gguf::GgufFile;

/// GGUF architectures whose attention is MLA and which this build loads.
pub const SUPPORTED_ARCHS: &[&str] = &["deepseek2"];

/// How the file stores the `kv_b_proj` up-projection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum KvBLayout {
    /// MLA-era files: `attn_k_b` (PyTorch [N, L, P], transposed) and `attn_v_b` ([N, V, L]).
    Split,
    /// Legacy files: one `attn_kv_b` ([N·(P+V), L], head-major, per head `[k_nope | v]`).
    Fused,
}

/// YaRN RoPE scaling parameters (MLA.md step 9), present only when the file asks for YaRN with
/// `factor > 1`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct YarnConfig {
    /// `rope.scaling.factor` (DeepSeek-V3: 40).
    pub factor: f64,
    /// `rope.scaling.original_context_length` (tokens).
    pub original_context: f64,
    /// `rope.scaling.yarn_log_multiplier` = 0.1 · mscale_all_dim (0 when absent, as in llama.cpp).
    pub log_multiplier: f64,
    /// `rope.scaling.yarn_beta_fast` (default 32).
    pub beta_fast: f64,
    /// `rope.scaling.yarn_beta_slow` (default 1).
    pub beta_slow: f64,
}

impl YarnConfig {
    /// `m = yarn_log_multiplier · ln(factor) + 1` (MLA.md step 7): the square of it multiplies
    /// the softmax scale. V2-Lite (mscale_all_dim 0.707, factor 40): m ≈ 1.2608, m² ≈ 1.5896.
    pub fn mscale(&self) -> f64 {
        self.log_multiplier * self.factor.ln() + 1.0
    }
}

/// The MLA attention configuration of one model, in MLA.md's dim names.
///
/// Built by [`MlaConfig::from_gguf`]. Dims are element counts; `softmax_scale` multiplies the raw
/// `q·k` logits (natural-log softmax).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MlaConfig {
    /// `general.architecture`, e.g. `deepseek2`.
    pub arch: String,
    /// `block_count`: number of transformer layers.
    pub n_layer: usize,
    /// `H`: hidden size (`embedding_length`).
    pub hidden: usize,
    /// `N`: attention heads (`attention.head_count`).
    pub n_head: usize,
    /// `Lq`: `attention.q_lora_rank`; `None` when absent or 0 (no q compression: `attn_q`).
    pub q_lora_rank: Option<usize>,
    /// `L`: `attention.kv_lora_rank` (latent width).
    pub kv_lora_rank: usize,
    /// `P`: qk_nope_head_dim (`key_length_mla − R`, or `key_length − R` in legacy files).
    pub qk_nope_head_dim: usize,
    /// `R`: qk_rope_head_dim (`rope.dimension_count`).
    pub qk_rope_head_dim: usize,
    /// `V`: v_head_dim (`value_length_mla`, or `value_length` in legacy files).
    pub v_head_dim: usize,
    /// `attention.layer_norm_rms_epsilon`.
    pub rms_eps: f64,
    /// `rope.freq_base`.
    pub rope_base: f64,
    /// YaRN parameters, when `rope.scaling.type` is `yarn` and the factor exceeds 1.
    pub yarn: Option<YarnConfig>,
    /// `(P+R)^-0.5 · m²` (MLA.md step 7). Never `(L+R)^-0.5`, even on the absorbed path.
    pub softmax_scale: f64,
    /// How `kv_b_proj` is stored (from the tensor index of layer 0).
    pub kv_b_layout: KvBLayout,
    /// `leading_dense_block_count` (0 when absent).
    pub leading_dense_block_count: usize,
    /// Vocabulary size (rows of `token_embd.weight`), 0 when the file has no embedding.
    pub vocab: usize,
}

impl MlaConfig {
    /// Reads the configuration from `file`'s metadata (and, for the kv_b layout and vocabulary,
    /// its tensor index).
    ///
    /// Errors: [`Error::NotMla`] for a non-MLA architecture, [`Error::MissingKey`] naming the
    /// first required key that is absent, [`Error::BadKey`] for a value of the wrong type or an
    /// impossible value (e.g. `key_length_mla ≤ rope.dimension_count`), [`Error::NotSupported`]
    /// for a RoPE scaling type other than none/yarn.
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let m = Meta { file };
        let arch = m
            .str("general.architecture")?
            .ok_or_else(|| m.missing("general.architecture"))?
            .to_string();
        if !SUPPORTED_ARCHS.contains(&arch.as_str()) {
            return Err(Error::NotMla {
                path: file.path().to_path_buf(),
                arch,
                supported: SUPPORTED_ARCHS.join(", "),
            });
        }
        let k = |s: &str| format!("{arch}.{s}");
        let n_layer = m.req_usize(&k("block_count"))?;
        let hidden = m.req_usize(&k("embedding_length"))?;
        let n_head = m.req_usize(&k("attention.head_count"))?;
        let q_lora_rank = m.usize(&k("attention.q_lora_rank"))?.filter(|&r| r > 0);
        let kv_lora_rank = m.req_usize(&k("attention.kv_lora_rank"))?;
        let rope_dim = m.req_usize(&k("rope.dimension_count"))?;
        let (key_len_key, val_len_key) = if m.file.meta(&k("attention.key_length_mla")).is_some() {
            (k("attention.key_length_mla"), k("attention.value_length_mla"))
        } else {
            (k("attention.key_length"), k("attention.value_length"))
        };
        let key_len = m.req_usize(&key_len_key)?;
        let v_head_dim = m.req_usize(&val_len_key)?;
        if key_len <= rope_dim {
            return Err(m.bad(
                &key_len_key,
                format!("{key_len} must exceed rope.dimension_count {rope_dim} (it is P+R)"),
            ));
        }
        if rope_dim % 2 != 0 {
            return Err(m.bad(
                &k("rope.dimension_count"),
                format!("{rope_dim} is odd; RoPE rotates pairs"),
            ));
        }
        let qk_nope_head_dim = key_len - rope_dim;
        let rms_eps = m
            .f64(&k("attention.layer_norm_rms_epsilon"))?
            .ok_or_else(|| m.missing(&k("attention.layer_norm_rms_epsilon")))?;
        let rope_base = m.f64(&k("rope.freq_base"))?.unwrap_or(10000.0);
        // A NaN, infinite or non-positive epsilon or base would not fail loudly: every normalized
        // activation turns NaN or 0, and the run would blame the engine paths instead of the file.
        if !(rms_eps.is_finite() && rms_eps > 0.0) {
            return Err(m.bad(
                &k("attention.layer_norm_rms_epsilon"),
                format!("{rms_eps} is not a positive finite number"),
            ));
        }
        if !(rope_base.is_finite() && rope_base > 0.0) {
            return Err(m.bad(
                &k("rope.freq_base"),
                format!("{rope_base} is not a positive finite number"),
            ));
        }

        let scaling = m.str(&k("rope.scaling.type"))?.unwrap_or("none").to_string();
        let yarn = match scaling.as_str() {
            "none" => None,
            "yarn" => {
                let factor = m
                    .f64(&k("rope.scaling.factor"))?
                    .ok_or_else(|| m.missing(&k("rope.scaling.factor")))?;
                if !(factor.is_finite() && factor > 0.0) {
                    return Err(m.bad(&k("rope.scaling.factor"), format!("{factor} is not a positive number")));
                }
                if factor > 1.0 {
                    let original_context = m
                        .f64(&k("rope.scaling.original_context_length"))?
                        .ok_or_else(|| m.missing(&k("rope.scaling.original_context_length")))?;
                    Some(YarnConfig {
                        factor,
                        original_context,
                        log_multiplier: m.f64(&k("rope.scaling.yarn_log_multiplier"))?.unwrap_or(0.0),
                        beta_fast: m.f64(&k("rope.scaling.yarn_beta_fast"))?.unwrap_or(32.0),
                        beta_slow: m.f64(&k("rope.scaling.yarn_beta_slow"))?.unwrap_or(1.0),
                    })
                } else {
                    None
                }
            }
            other => {
                return Err(Error::NotSupported(format!(
                    "{}: metadata key `{}` is `{other}`; only `none` and `yarn` are supported for MLA models",
                    file.path().display(),
                    k("rope.scaling.type")
                )));
            }
        };
        let mscale = yarn.map_or(1.0, |y| y.mscale());
        let softmax_scale = (key_len as f64).powf(-0.5) * mscale * mscale;

        let kv_b_layout = if file.tensor("blk.0.attn_kv_b.weight").is_some() {
            KvBLayout::Fused
        } else {
            KvBLayout::Split
        };
        let vocab = file.tensor("token_embd.weight").map_or(0, |t| t.shape()[0] as usize);
        let leading_dense_block_count = m.usize(&k("leading_dense_block_count"))?.unwrap_or(0);

        for (key, v) in [
            (k("block_count"), n_layer),
            (k("embedding_length"), hidden),
            (k("attention.head_count"), n_head),
            (k("attention.kv_lora_rank"), kv_lora_rank),
            (val_len_key.clone(), v_head_dim),
        ] {
            if v == 0 {
                return Err(m.bad(&key, "must be positive".into()));
            }
        }
        Ok(MlaConfig {
            arch,
            n_layer,
            hidden,
            n_head,
            q_lora_rank,
            kv_lora_rank,
            qk_nope_head_dim,
            qk_rope_head_dim: rope_dim,
            v_head_dim,
            rms_eps,
            rope_base,
            yarn,
            softmax_scale,
            kv_b_layout,
            leading_dense_block_count,
            vocab,
        })
    }

    /// `P + R`: the per-head query/key width of the expanded path (192 for DeepSeek-V3).
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// `m` of MLA.md step 7 (1 without YaRN).
    pub fn mscale(&self) -> f64 {
        self.yarn.map_or(1.0, |y| y.mscale())
    }

    /// One-line summary in MLA.md's dim names, e.g. `N=6 H=256 Lq=64 L=96 P=32 R=16 V=64`.
    pub fn dims_line(&self) -> String {
        format!(
            "N={} H={} Lq={} L={} P={} R={} V={}",
            self.n_head,
            self.hidden,
            self.q_lora_rank.map_or("none".to_string(), |r| r.to_string()),
            self.kv_lora_rank,
            self.qk_nope_head_dim,
            self.qk_rope_head_dim,
            self.v_head_dim
        )
    }
}

/// Typed metadata access that names the key in every error.
struct Meta<'a> {
    file: &'a GgufFile,
}

impl Meta<'_> {
    fn missing(&self, key: &str) -> Error {
        Error::MissingKey {
            path: self.file.path().to_path_buf(),
            key: key.to_string(),
        }
    }

    fn bad(&self, key: &str, reason: String) -> Error {
        Error::BadKey {
            path: self.file.path().to_path_buf(),
            key: key.to_string(),
            reason,
        }
    }

    fn str(&self, key: &str) -> Result<Option<&str>> {
        match self.file.meta(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| self.bad(key, format!("expected a string, found {}", v.type_name()))),
        }
    }

    fn usize(&self, key: &str) -> Result<Option<usize>> {
        match self.file.meta(key) {
            None => Ok(None),
            Some(v) => {
                let n = v.as_u64().ok_or_else(|| {
                    self.bad(key, format!("expected a non-negative integer, found {}", v.type_name()))
                })?;
                // Dims beyond 2^24 are not a real model; rejecting them keeps every later
                // allocation sized by them bounded.
                if n > 1 << 24 {
                    return Err(self.bad(key, format!("{n} is implausibly large")));
                }
                Ok(Some(n as usize))
            }
        }
    }

    fn req_usize(&self, key: &str) -> Result<usize> {
        self.usize(key)?.ok_or_else(|| self.missing(key))
    }

    fn f64(&self, key: &str) -> Result<Option<f64>> {
        match self.file.meta(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.bad(key, format!("expected a number, found {}", v.type_name()))),
        }
    }
}
