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

/// How the router turns logits into expert scores: GGUF `expert_gating_func`, with llama.cpp's
/// enum values (`src/llama-hparams.h`, `llama_expert_gating_func_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum GatingFunc {
    /// 1: softmax over all `E` logits of a token (DeepSeek-V2/V2.5; also what llama.cpp assumes
    /// when the key is absent or 0, for older V2 files).
    Softmax,
    /// 2: elementwise sigmoid (DeepSeek-V3, Kimi-K2).
    Sigmoid,
}

impl GatingFunc {
    /// llama.cpp's enum value (1 softmax, 2 sigmoid).
    pub fn id(self) -> u64 {
        match self {
            GatingFunc::Softmax => 1,
            GatingFunc::Sigmoid => 2,
        }
    }
}

/// The routed-expert FFN of the MoE layers (layers `leading_dense_block_count..block_count`), from
/// the `deepseek2.expert_*` keys. Names: `E` routed experts, `K` experts used per token, `G`
/// expert groups, `F_e` expert FFN width.
///
/// Semantics (HF `modeling_deepseek_v3.py` `DeepseekV3TopkRouter`/`DeepseekV3MoE`, llama.cpp
/// `src/llama-graph.cpp` `build_moe_ffn`): scores = gating(router logits); the experts are chosen
/// on `scores + exp_probs_b` (the score-correction bias, for the choice only), group-limited to
/// the `G_used` best groups when `G > 1`; their weights are the unbiased scores, normalised to sum
/// 1 when `weights_norm`, then multiplied by `weights_scale`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MoeConfig {
    /// `E`: `expert_count`, routed experts per MoE layer.
    pub n_expert: usize,
    /// `K`: `expert_used_count`, experts each token is routed to (1 ≤ K ≤ E).
    pub n_expert_used: usize,
    /// `expert_shared_count`: shared experts, run on every token as one SwiGLU FFN of width
    /// `n_expert_shared · F_e` (0 when absent).
    pub n_expert_shared: usize,
    /// `F_e`: `expert_feed_forward_length`, the intermediate width of one routed expert.
    pub expert_ffn: usize,
    /// `expert_weights_scale` (HF `routed_scaling_factor`): multiplies the routing weights after
    /// any normalisation; 1 when the key is absent or 0 (llama.cpp skips the scale for 0 and 1).
    pub weights_scale: f64,
    /// `expert_weights_norm` (HF `norm_topk_prob`): normalise the K weights to sum 1 (false when
    /// absent).
    pub weights_norm: bool,
    /// `expert_gating_func`: softmax (1, also when absent or 0) or sigmoid (2).
    pub gating: GatingFunc,
    /// `G`: `expert_group_count` (HF `n_group`); 1 when absent or 0 (no group limit).
    pub n_group: usize,
    /// `G_used`: `expert_group_used_count` (HF `topk_group`), groups kept per token; `G` when
    /// absent.
    pub n_group_used: usize,
}

impl MoeConfig {
    /// Routed experts per group, `E / G`.
    pub fn experts_per_group(&self) -> usize {
        self.n_expert / self.n_group.max(1)
    }

    /// One-line summary, e.g. `E=256 K=8 G=8/4 F_e=2048 shared=1 sigmoid norm scale=2.5`.
    pub fn line(&self) -> String {
        format!(
            "E={} K={} G={}/{} F_e={} shared={} {}{} scale={}",
            self.n_expert,
            self.n_expert_used,
            self.n_group,
            self.n_group_used,
            self.expert_ffn,
            self.n_expert_shared,
            match self.gating {
                GatingFunc::Softmax => "softmax",
                GatingFunc::Sigmoid => "sigmoid",
            },
            if self.weights_norm { " norm" } else { "" },
            self.weights_scale
        )
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
    /// The routed-expert FFN of layers `leading_dense_block_count..n_layer`; `None` when the file
    /// has no `expert_count` (or 0) or every layer is dense. Absent from JSON when `None`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub moe: Option<MoeConfig>,
}

impl MlaConfig {
    /// Reads the configuration from `file`'s metadata (and, for the kv_b layout and vocabulary,
    /// its tensor index).
    ///
    /// Errors: [`Error::NotMla`] for a non-MLA architecture, [`Error::MissingKey`] naming the
    /// first required key that is absent, [`Error::BadKey`] for a value of the wrong type or an
    /// impossible value (e.g. `key_length_mla ≤ rope.dimension_count`, or MoE counts that do not
    /// fit: `expert_used_count > expert_count`, groups that do not divide the experts, …),
    /// [`Error::NotSupported`] for a RoPE scaling type other than none/yarn or an
    /// `expert_gating_func` other than softmax/sigmoid.
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
        let moe = if leading_dense_block_count < n_layer {
            moe_config(&m, &arch, hidden)?
        } else {
            None
        };

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
            moe,
        })
    }

    /// True when layer `layer` runs the routed-expert FFN (MoE) instead of a dense one: the file
    /// has an MoE config and `layer ≥ leading_dense_block_count`.
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        self.moe.is_some() && layer >= self.leading_dense_block_count
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

/// Reads and validates the `{arch}.expert_*` keys (llama.cpp `llama_model::load_hparams` and
/// `deepseek2.cpp` `load_arch_hparams`). `None` when `expert_count` is absent or 0 (a dense model
/// whose converter omitted `leading_dense_block_count`).
///
/// Errors name the key: [`Error::MissingKey`] for `expert_used_count` or
/// `expert_feed_forward_length`; [`Error::BadKey`] for K = 0 or K > E, groups that do not divide
/// E, `G_used` = 0 or > G, fewer than 2 experts per group (the group score sums a group's two best
/// experts), fewer than K experts in the kept groups, a non-finite or negative scale;
/// [`Error::NotSupported`] for a gating function other than softmax/sigmoid.
fn moe_config(m: &Meta<'_>, arch: &str, hidden: usize) -> Result<Option<MoeConfig>> {
    let k = |s: &str| format!("{arch}.{s}");
    let n_expert = match m.usize(&k("expert_count"))? {
        None | Some(0) => return Ok(None),
        Some(e) => e,
    };
    // llama.cpp's LLAMA_MAX_EXPERTS.
    if n_expert > 1024 {
        return Err(m.bad(&k("expert_count"), format!("{n_expert} exceeds 1024 experts")));
    }
    let n_expert_used = m.req_usize(&k("expert_used_count"))?;
    if n_expert_used == 0 || n_expert_used > n_expert {
        return Err(m.bad(
            &k("expert_used_count"),
            format!("{n_expert_used} must be between 1 and expert_count {n_expert}"),
        ));
    }
    let expert_ffn = m.req_usize(&k("expert_feed_forward_length"))?;
    if expert_ffn == 0 {
        return Err(m.bad(&k("expert_feed_forward_length"), "must be positive".into()));
    }
    let n_expert_shared = m.usize(&k("expert_shared_count"))?.unwrap_or(0);
    if n_expert_shared > 64 {
        return Err(m.bad(
            &k("expert_shared_count"),
            format!("{n_expert_shared} is implausibly large"),
        ));
    }
    // Shared experts are one FFN of width n_shared · F_e; keep every product bounded.
    if (n_expert_shared.max(1) * expert_ffn).saturating_mul(hidden) > 1 << 34 {
        return Err(m.bad(
            &k("expert_feed_forward_length"),
            format!("{expert_ffn} × H {hidden} is implausibly large"),
        ));
    }
    let weights_scale = match m.f64(&k("expert_weights_scale"))? {
        None => 1.0,
        Some(0.0) => 1.0,
        Some(x) if x.is_finite() && x > 0.0 => x,
        Some(x) => {
            return Err(m.bad(
                &k("expert_weights_scale"),
                format!("{x} is not a positive finite number"),
            ));
        }
    };
    let weights_norm = match m.file.meta(&k("expert_weights_norm")) {
        None => false,
        Some(v) => v.as_bool().ok_or_else(|| {
            m.bad(
                &k("expert_weights_norm"),
                format!("expected a bool, found {}", v.type_name()),
            )
        })?,
    };
    let gating = match m.usize(&k("expert_gating_func"))? {
        None | Some(0) | Some(1) => GatingFunc::Softmax,
        Some(2) => GatingFunc::Sigmoid,
        Some(other) => {
            return Err(Error::NotSupported(format!(
                "{}: metadata key `{}` is {other} ({}); only 1 (softmax) and 2 (sigmoid) are supported",
                m.file.path().display(),
                k("expert_gating_func"),
                match other {
                    3 => "softmax_weight",
                    4 => "sqrt_softplus",
                    _ => "unknown",
                }
            )));
        }
    };
    let n_group = m.usize(&k("expert_group_count"))?.unwrap_or(1).max(1);
    if !n_expert.is_multiple_of(n_group) {
        return Err(m.bad(
            &k("expert_group_count"),
            format!("{n_group} groups do not divide expert_count {n_expert}"),
        ));
    }
    let n_group_used = m.usize(&k("expert_group_used_count"))?.unwrap_or(n_group);
    if n_group > 1 {
        if n_group_used == 0 || n_group_used > n_group {
            return Err(m.bad(
                &k("expert_group_used_count"),
                format!("{n_group_used} must be between 1 and expert_group_count {n_group}"),
            ));
        }
        if n_expert / n_group < 2 {
            return Err(m.bad(
                &k("expert_group_count"),
                format!(
                    "{n_group} groups of {n_expert} experts leave {} per group; the group score sums a group's two best experts",
                    n_expert / n_group
                ),
            ));
        }
        if n_group_used * (n_expert / n_group) < n_expert_used {
            return Err(m.bad(
                &k("expert_group_used_count"),
                format!(
                    "{n_group_used} kept groups of {} experts hold fewer than expert_used_count {n_expert_used}",
                    n_expert / n_group
                ),
            ));
        }
    }
    Ok(Some(MoeConfig {
        n_expert,
        n_expert_used,
        n_expert_shared,
        expert_ffn,
        weights_scale,
        weights_norm,
        gating,
        n_group,
        n_group_used: if n_group > 1 { n_group_used } else { 1 },
    }))
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
