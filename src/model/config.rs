//! The MLA configuration of a model, read from GGUF metadata.
//!
//! Every later stage needs the MLA dims (`N`, `Lq`, `L`, `P`, `R`, `V`), the RoPE/YaRN settings
//! and the softmax scale, and the GGUF keys that carry them changed over time: MLA-era files (the
//! converter since llama.cpp's MLA support) split `kv_b` and add `*_mla` key/value lengths; legacy
//! files have one `attn_kv_b` and put the MLA head widths in `key_length`/`value_length`. This
//! module reads both, treats an absent or zero `q_lora_rank` as "no q compression", and derives
//! the YaRN softmax scale of docs/mla.md step 7. A missing or unusable key is an error naming the key.

use serde::Serialize;

use crate::core::error::{Error, Result};
use crate::model::arch::Arch;
use crate::model::gguf::{GgufFile, MetaValue};
use crate::model::tensors::ModelTensor;

/// RoPE pairing (which elements of a rotated vector form a pair).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum RopeStyle {
    /// GPT-J / DeepSeek: adjacent pairs `(x[2i], x[2i+1])` (vLLM `is_neox_style=False`, llama.cpp
    /// `LLAMA_ROPE_TYPE_NORM`).
    Interleaved,
    /// NeoX: `(x[i], x[i+R/2])` (HF `rotate_half`, llama.cpp `LLAMA_ROPE_TYPE_NEOX`).
    Neox,
}

impl RopeStyle {
    /// The other pairing.
    pub fn other(self) -> RopeStyle {
        match self {
            RopeStyle::Interleaved => RopeStyle::Neox,
            RopeStyle::Neox => RopeStyle::Interleaved,
        }
    }

    /// `interleaved` or `neox`.
    pub fn name(self) -> &'static str {
        match self {
            RopeStyle::Interleaved => "interleaved",
            RopeStyle::Neox => "neox",
        }
    }
}

/// The DSA lightning indexer of `deepseek32` and `glm-dsa` files (DeepSeek-V3.2 paper; HF
/// `DeepseekV32Indexer`/`GlmMoeDsaIndexer`; llama.cpp `src/models/deepseek32.cpp`,
/// `glm-dsa.cpp`). Names: `N_idx` indexer heads, `D_idx` indexer head width, `K_idx` top-k.
///
/// Per token `i` and key `j ≤ i` of its sequence: `score[i,j] = Σ_h w[i,h]·N_idx^-½ ·
/// ReLU(D_idx^-½ · q_idx[i,h]·k_idx[j])`, with `q_idx = attn_q_b_idx·q_c_normed` and
/// `k_idx = LayerNorm(attn_k_idx·attn_in)` rotated on their first `R` dims, `w =
/// indexer.proj·attn_in`; the `K_idx` best keys (ties to the lower position) are the only keys
/// the token's MLA attention sees.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct IndexerConfig {
    /// `N_idx`: `attention.indexer.head_count`.
    pub n_head: usize,
    /// `D_idx`: `attention.indexer.key_length` (≥ R; each head is `[rope R | nope D_idx−R]`).
    pub head_dim: usize,
    /// `K_idx`: `attention.indexer.top_k`, keys kept per query token.
    pub top_k: usize,
    /// Pairing of the indexer's RoPE: NeoX for `deepseek32` (unlike its interleaved main path),
    /// interleaved for `glm-dsa`.
    pub rope_style: RopeStyle,
    /// Epsilon of the indexer key LayerNorm: 1e-6 (hard-coded by HF and llama.cpp's deepseek32).
    pub norm_eps: f64,
    /// Per trunk layer: true when the layer runs its own indexer ("full"), false when it reuses
    /// the selection of the nearest earlier full layer ("shared", GLM-5.2's
    /// `attention.indexer.types`); all true when the key is absent (mla-diff follows the file,
    /// not llama.cpp's built-in GLM-5.2 table for ≥ 1M-context files without the key). MTP
    /// blocks past the trunk have no entry and no indexer.
    pub full: Vec<bool>,
}

impl IndexerConfig {
    /// The layer whose indexer selects `layer`'s keys: `layer` itself when full, else the
    /// nearest earlier full layer (`None` when there is none, which the config rejects).
    pub fn source_layer(&self, layer: usize) -> Option<usize> {
        (0..=layer.min(self.full.len().saturating_sub(1)))
            .rev()
            .find(|&l| self.full[l])
    }
}

/// The MLA dims of one model, copied out of [`MlaConfig`] by [`MlaConfig::dims`] so that the
/// shape arithmetic can take them in one line (`let [n, l, p, r, v] = cfg.dims().nlprv();`, or
/// `cfg.dims().hidden` for the others).
/// Units: elements; the names and GGUF sources are those of the [`MlaConfig`] fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlaDims {
    /// `N`: attention heads.
    pub n_head: usize,
    /// `H`: hidden size.
    pub hidden: usize,
    /// `Lq`: q compression rank; `None` when the model projects q directly (`attn_q`).
    pub q_lora_rank: Option<usize>,
    /// `L`: latent width of the KV cache.
    pub kv_lora_rank: usize,
    /// `P`: per-head width of `q_nope`/`k_nope`.
    pub qk_nope_head_dim: usize,
    /// `R`: per-head width of `q_pe`/`k_pe` (the rotated part).
    pub qk_rope_head_dim: usize,
    /// `V`: per-head width of `v` and `attn_out`.
    pub v_head_dim: usize,
}

impl MlaDims {
    /// The five attention widths under their docs/mla.md letters, in the order the letters spell:
    /// `[N, L, P, R, V]` = `[n_head, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
    /// v_head_dim]`. The index arithmetic of the paths reads in these letters; one line
    /// `let [n, l, p, r, v] = cfg.dims().nlprv();` binds them (`_` for the unused ones).
    pub fn nlprv(self) -> [usize; 5] {
        [
            self.n_head,
            self.kv_lora_rank,
            self.qk_nope_head_dim,
            self.qk_rope_head_dim,
            self.v_head_dim,
        ]
    }
}

/// How the file stores the `kv_b_proj` up-projection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum KvBLayout {
    /// MLA-era files: `attn_k_b` (PyTorch [N, L, P], transposed) and `attn_v_b` ([N, V, L]).
    Split,
    /// Legacy files: one `attn_kv_b` ([N·(P+V), L], head-major, per head `[k_nope | v]`).
    Fused,
}

/// YaRN RoPE scaling parameters (docs/mla.md step 9), present only when the file asks for YaRN with
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
    /// `m = yarn_log_multiplier · ln(factor) + 1` (docs/mla.md step 7): the square of it multiplies
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

/// The MLA attention configuration of one model, in the dim names of docs/mla.md.
///
/// Built by [`MlaConfig::from_gguf`]. Dims are element counts; `softmax_scale` multiplies the raw
/// `q·k` logits (natural-log softmax).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MlaConfig {
    /// `general.architecture`, e.g. `deepseek2` (serialized as that name).
    pub arch: Arch,
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
    /// `(P+R)^-0.5 · m²` (docs/mla.md step 7). Never `(L+R)^-0.5`, even on the absorbed path.
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
    /// Pairing of the main MLA RoPE (`q_pe`, `k_pe`): interleaved for the DeepSeek and GLM
    /// families, NeoX for `minicpm3` (llama.cpp `llama_model_rope_type`).
    pub rope_style: RopeStyle,
    /// Per-pair RoPE frequency divisors (`rope_factors_short.weight`, LongRoPE, \[R/2]; MiniCPM3):
    /// `θ_i = base^(−2i/R) / factor_i`. `None` when the file has none. Absent from JSON when `None`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rope_factors: Option<Vec<f64>>,
    /// The DSA lightning indexer (`deepseek32`, `glm-dsa`); `None` for dense-attention MLA.
    /// Absent from JSON when `None`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub indexer: Option<IndexerConfig>,
    /// `nextn_predict_layers`: MTP (NextN) blocks the converter appended after the trunk
    /// (`blk.{n_layer − nextn}..`, counted in `block_count`); 0 when absent. They are not on the
    /// token path (`--layers all` stops before them); an explicit `--layer` in them runs their
    /// attention as dense MLA, as llama.cpp's MTP graph does (no indexer).
    pub nextn_predict_layers: usize,
    /// Multiplies the token embedding on the token path: 12 for `minicpm3` (llama.cpp's
    /// hard-coded `scale_emb`), 1 otherwise.
    pub embedding_scale: f64,
    /// Multiplies each residual branch (attention and FFN output) before it is added:
    /// `scale_depth/√n_layer` = 1.4/√n_layer for `minicpm3` (llama.cpp's hard-coded
    /// `scale_depth`), 1 otherwise.
    pub residual_scale: f64,
}

impl MlaConfig {
    /// The MLA dims `N`, `H`, `Lq`, `L`, `P`, `R`, `V` of this model.
    pub fn dims(&self) -> MlaDims {
        MlaDims {
            n_head: self.n_head,
            hidden: self.hidden,
            q_lora_rank: self.q_lora_rank,
            kv_lora_rank: self.kv_lora_rank,
            qk_nope_head_dim: self.qk_nope_head_dim,
            qk_rope_head_dim: self.qk_rope_head_dim,
            v_head_dim: self.v_head_dim,
        }
    }

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
        let name = m
            .str("general.architecture")?
            .ok_or_else(|| m.missing("general.architecture"))?;
        let Some(arch) = Arch::parse(name) else {
            return Err(Error::NotMla {
                path: file.path().to_path_buf(),
                arch: name.to_string(),
                supported: Arch::supported_list(),
            });
        };
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
        let v_head_dim = match m.usize(&val_len_key)? {
            Some(v) => v,
            None if arch.value_length_defaults_to_head_width() && n_head > 0 && hidden.is_multiple_of(n_head) => {
                hidden / n_head
            }
            None => return Err(m.missing(&val_len_key)),
        };
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
        let (rms_eps, rope_base) = norm_eps_and_rope_base(&m, arch)?;

        let yarn = yarn_config(&m, arch)?;
        let mscale = yarn.map_or(1.0, |y| y.mscale());
        let softmax_scale = (key_len as f64).powf(-0.5) * mscale * mscale;

        let kv_b_layout = if file.tensor(&ModelTensor::AttnKvB.name(0)).is_some() {
            KvBLayout::Fused
        } else {
            KvBLayout::Split
        };
        let vocab = file
            .tensor(&ModelTensor::TokenEmbd.name(0))
            .map_or(0, |t| t.shape()[0] as usize);
        let nextn_predict_layers = m.usize(&k("nextn_predict_layers"))?.unwrap_or(0);
        if nextn_predict_layers >= n_layer.max(1) {
            return Err(m.bad(
                &k("nextn_predict_layers"),
                format!("{nextn_predict_layers} MTP blocks leave no trunk in block_count {n_layer}"),
            ));
        }
        let trunk = n_layer - nextn_predict_layers;
        let leading_dense_block_count = m.usize(&k("leading_dense_block_count"))?.unwrap_or(0);
        let moe = if leading_dense_block_count < n_layer {
            moe_config(&m, arch, hidden, trunk, vocab)?
        } else {
            None
        };
        let indexer = if arch.has_dsa_indexer() {
            Some(indexer_config(&m, arch, trunk, rope_dim, q_lora_rank)?)
        } else {
            None
        };
        let rope_factors = rope_factors(file, rope_dim)?;

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
            rope_style: arch.main_rope_style(),
            rope_factors,
            indexer,
            nextn_predict_layers,
            embedding_scale: arch.embedding_scale(),
            residual_scale: arch.residual_scale(n_layer),
        })
    }

    /// Trunk layers, `block_count − nextn_predict_layers`: what `--layers all` and the token path
    /// cover.
    pub fn trunk_layers(&self) -> usize {
        self.n_layer - self.nextn_predict_layers
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

    /// `m` of docs/mla.md step 7 (1 without YaRN).
    pub fn mscale(&self) -> f64 {
        self.yarn.map_or(1.0, |y| y.mscale())
    }

    /// The architecture's departures from plain DeepSeek MLA, one phrase each (empty for
    /// `deepseek2`): the DSA indexer (`DSA indexer N_idx=8 D_idx=64 top-k 8, neox RoPE, shared
    /// layers [2]`), a NeoX main RoPE, LongRoPE factors, embedding and residual scales.
    pub fn quirks(&self) -> Vec<String> {
        let mut q = Vec::new();
        if let Some(ix) = &self.indexer {
            let shared: Vec<usize> = (0..ix.full.len()).filter(|&l| !ix.full[l]).collect();
            q.push(format!(
                "DSA indexer N_idx={} D_idx={} top-k {}, {} RoPE{}",
                ix.n_head,
                ix.head_dim,
                ix.top_k,
                ix.rope_style.name(),
                if shared.is_empty() {
                    String::new()
                } else {
                    format!(", shared layers {shared:?}")
                }
            ));
        }
        if self.rope_style != RopeStyle::Interleaved {
            q.push(format!("{} main RoPE", self.rope_style.name()));
        }
        if self.rope_factors.is_some() {
            q.push("RoPE frequencies divided by the LongRoPE short factors (rope_factors_short)".into());
        }
        if self.embedding_scale != 1.0 {
            q.push(format!("embedding ×{}", self.embedding_scale));
        }
        if self.residual_scale != 1.0 {
            q.push(format!("residual branches ×{:.6}", self.residual_scale));
        }
        q
    }

    /// One-line summary in the dim names of docs/mla.md, e.g. `N=6 H=256 Lq=64 L=96 P=32 R=16 V=64`.
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

/// `attention.layer_norm_rms_epsilon` and `rope.freq_base` (default 10000) of `arch`.
///
/// Errors: [`Error::MissingKey`] for the epsilon; [`Error::BadKey`] for either when it is not a
/// positive finite number.
fn norm_eps_and_rope_base(m: &Meta<'_>, arch: Arch) -> Result<(f64, f64)> {
    let k = |s: &str| format!("{arch}.{s}");
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
    Ok((rms_eps, rope_base))
}

/// The YaRN parameters of `arch` (`rope.scaling.*`): `None` without scaling or for a factor of
/// at most 1.
///
/// Errors: [`Error::MissingKey`] for a YaRN file without factor or original context length;
/// [`Error::BadKey`] for a factor that is not a positive number; [`Error::NotSupported`] for a
/// scaling type other than `none` and `yarn`.
fn yarn_config(m: &Meta<'_>, arch: Arch) -> Result<Option<YarnConfig>> {
    let k = |s: &str| format!("{arch}.{s}");
    let scaling = m.str(&k("rope.scaling.type"))?.unwrap_or("none").to_string();
    Ok(match scaling.as_str() {
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
                m.file.path().display(),
                k("rope.scaling.type")
            )));
        }
    })
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
fn moe_config(m: &Meta<'_>, arch: Arch, hidden: usize, trunk: usize, vocab: usize) -> Result<Option<MoeConfig>> {
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
        None => arch
            .gating_when_absent(trunk, vocab)
            .ok_or_else(|| m.missing(&k("expert_gating_func")))?,
        Some(0) | Some(1) => GatingFunc::Softmax,
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

/// Reads the `{arch}.attention.indexer.*` keys (llama.cpp `deepseek32.cpp` / `glm-dsa.cpp`
/// `load_arch_hparams`).
///
/// Errors name the key: [`Error::MissingKey`] for `head_count`, `key_length`, `top_k` or an
/// absent `q_lora_rank` (the indexer query reads `q_c_normed`); [`Error::BadKey`] for zero
/// counts, `key_length < rope.dimension_count`, a `types` array of the wrong length or type, or
/// a first layer that is not full (a shared layer needs an earlier full one).
fn indexer_config(
    m: &Meta<'_>,
    arch: Arch,
    n_layer: usize,
    rope_dim: usize,
    q_lora_rank: Option<usize>,
) -> Result<IndexerConfig> {
    let k = |s: &str| format!("{arch}.{s}");
    if q_lora_rank.is_none() {
        return Err(m.missing(&k("attention.q_lora_rank")));
    }
    let n_head = m.req_usize(&k("attention.indexer.head_count"))?;
    let head_dim = m.req_usize(&k("attention.indexer.key_length"))?;
    let top_k = m.req_usize(&k("attention.indexer.top_k"))?;
    for (key, v) in [("head_count", n_head), ("key_length", head_dim), ("top_k", top_k)] {
        if v == 0 {
            return Err(m.bad(&k(&format!("attention.indexer.{key}")), "must be positive".into()));
        }
    }
    if head_dim < rope_dim {
        return Err(m.bad(
            &k("attention.indexer.key_length"),
            format!("{head_dim} is smaller than rope.dimension_count {rope_dim} (each indexer head is [rope | nope])"),
        ));
    }
    let types_key = k("attention.indexer.types");
    let full = match m.file.meta(&types_key) {
        None => vec![true; n_layer],
        Some(crate::model::gguf::MetaValue::Array(arr)) => {
            if arr.len < n_layer as u64 {
                return Err(m.bad(&types_key, format!("{} entries for block_count {n_layer}", arr.len)));
            }
            let vals = m.file.meta_numeric_array(arr, n_layer);
            if vals.len() != n_layer || vals.iter().any(|x| !(*x == 0.0 || *x == 1.0)) {
                return Err(m.bad(
                    &types_key,
                    format!(
                        "expected {n_layer} bools (or 0/1), found {}",
                        crate::model::gguf::MetaValue::Array(arr.clone()).type_name()
                    ),
                ));
            }
            vals.into_iter().map(|x| x == 1.0).collect()
        }
        Some(v) => {
            return Err(m.bad(
                &types_key,
                format!("expected an array of bools, found {}", v.type_name()),
            ));
        }
    };
    if n_layer > 0 && !full[0] {
        return Err(m.bad(
            &types_key,
            "layer 0 is `shared` but a shared layer reuses an earlier full layer's selection".into(),
        ));
    }
    Ok(IndexerConfig {
        n_head,
        head_dim,
        top_k,
        rope_style: arch.indexer_rope_style(),
        norm_eps: 1e-6,
        full,
    })
}

/// The LongRoPE short factors (`rope_factors_short.weight`, \[R/2], F32), when the file has them.
/// llama.cpp switches to `rope_factors_long` only when its context exceeds the original
/// training context; mla-diff's sequences never do, so the short factors apply.
///
/// Errors: [`Error::TensorShape`] for a factor tensor of the wrong length, [`Error::Dequant`] for
/// a non-finite or non-positive factor or undecodable bytes.
fn rope_factors(file: &GgufFile, rope_dim: usize) -> Result<Option<Vec<f64>>> {
    let name = &ModelTensor::RopeFactorsShort.name(0);
    let Some(t) = file.tensor(name) else {
        return Ok(None);
    };
    if t.n_elements() as usize != rope_dim / 2 {
        return Err(Error::TensorShape {
            path: file.path().to_path_buf(),
            tensor: name.to_string(),
            expected: vec![(rope_dim / 2) as u64],
            got: t.shape(),
            why: format!("R/2 for rope.dimension_count {rope_dim}"),
        });
    }
    let v = crate::model::weights::dequant_tensor(file, t)?;
    if let Some(x) = v.iter().find(|x| !(x.is_finite() && **x > 0.0)) {
        return Err(Error::Dequant {
            path: file.path().to_path_buf(),
            tensor: name.to_string(),
            reason: format!("LongRoPE factor {x} is not a positive finite number"),
        });
    }
    Ok(Some(v.into_iter().map(f64::from).collect()))
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

    /// `key`'s value through `get` (`None` when the key is absent); `expected` names the type the
    /// error asks for when `get` refuses the value.
    fn typed<'v, T>(
        &'v self,
        key: &str,
        expected: &str,
        get: impl Fn(&'v MetaValue) -> Option<T>,
    ) -> Result<Option<T>> {
        let Some(v) = self.file.meta(key) else {
            return Ok(None);
        };
        get(v)
            .map(Some)
            .ok_or_else(|| self.bad(key, format!("expected {expected}, found {}", v.type_name())))
    }

    fn str(&self, key: &str) -> Result<Option<&str>> {
        self.typed(key, "a string", MetaValue::as_str)
    }

    fn usize(&self, key: &str) -> Result<Option<usize>> {
        let Some(n) = self.typed(key, "a non-negative integer", MetaValue::as_u64)? else {
            return Ok(None);
        };
        // Dims beyond 2^24 are not a real model; rejecting them keeps every later allocation
        // sized by them bounded.
        if n > 1 << 24 {
            return Err(self.bad(key, format!("{n} is implausibly large")));
        }
        Ok(Some(n as usize))
    }

    fn req_usize(&self, key: &str) -> Result<usize> {
        self.usize(key)?.ok_or_else(|| self.missing(key))
    }

    fn f64(&self, key: &str) -> Result<Option<f64>> {
        self.typed(key, "a number", MetaValue::as_f64)
    }
}
