//! The table of an MLA model's GGUF tensors: one typed id per tensor kind, and what it becomes.
//!
//! A tensor is named four ways: by llama.cpp's GGUF short name (`attn_kv_b`), by the weight site
//! mla-diff records it at (`w.kv_b`), by the vLLM parameter an engine loads it into
//! (`self_attn.kv_b_proj.weight`) and by how tensor parallelism cuts that parameter
//! (column-parallel by heads, `P+V` rows per head). The loader, the engine paths, the detectors
//! and the weights check all need the same facts, so they read them from one row per
//! [`ModelTensor`] (the idea of gguf-py's `MODEL_TENSOR` / `TENSOR_NAMES`), and the name builder
//! (`blk.{n}.{short}.weight`) lives here too.
//!
//! Shapes are PyTorch `[out, in]` order (the GGUF `ne` reversed), in the MLA dim names of
//! docs/mla.md (`N`, `H`, `Lq`, `L`, `P`, `R`, `V`) plus the FFN's `F` (dense width), `E`
//! (routed experts), `F_e` (one expert's width), `n_shared·F_e` (the shared experts' width),
//! `vocab`, and the DSA indexer's `N_idx`, `D_idx`. Sources: llama.cpp `src/llama-arch.cpp`
//! (`LLM_ARCH_DEEPSEEK2`, `deepseek32`, `glm-dsa`, `minicpm3` tensor lists) and vLLM 0.26
//! `vllm/model_executor/models/deepseek_v2.py` (`DeepseekV2MLAAttention`, `DeepseekV2MLP`,
//! `DeepseekV2MoE`, `Indexer`, `load_weights`' stacked-parameter mappings).

use std::ops::Range;

use crate::core::trace::{RankedWeight, Stage};
use crate::model::config::{KvBLayout, MlaConfig, MlaDims};

/// One kind of GGUF tensor of an MLA model (gguf-py `MODEL_TENSOR`). Each has one row,
/// [`ModelTensor::row`]; the per-variant docs give the PyTorch shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ModelTensor {
    /// `token_embd.weight`, [vocab, H], global.
    TokenEmbd,
    /// `output_norm.weight`, \[H], global: the final RMSNorm.
    OutputNorm,
    /// `output.weight`, [vocab, H], global: the LM head (optional, tied to `token_embd`).
    Output,
    /// `rope_factors_short.weight`, \[R/2], global, F32: MiniCPM3's LongRoPE short factors.
    RopeFactorsShort,
    /// `blk.{n}.attn_norm.weight`, \[H].
    AttnNorm,
    /// `blk.{n}.attn_q_a.weight`, [Lq, H] (with `Lq` only).
    AttnQA,
    /// `blk.{n}.attn_q_a_norm.weight`, \[Lq] (with `Lq` only).
    AttnQANorm,
    /// `blk.{n}.attn_q_b.weight`, [N·(P+R), Lq] (with `Lq` only).
    AttnQB,
    /// `blk.{n}.attn_q.weight`, [N·(P+R), H] (without `Lq`).
    AttnQ,
    /// `blk.{n}.attn_kv_a_mqa.weight`, [L+R, H].
    AttnKvAMqa,
    /// `blk.{n}.attn_kv_a_norm.weight`, \[L].
    AttnKvANorm,
    /// `blk.{n}.attn_kv_b.weight`, [N·(P+V), L], per head `[P k_nope rows | V v rows]` (legacy
    /// and MiniCPM3 files).
    AttnKvB,
    /// `blk.{n}.attn_k_b.weight`, [N, L, P]: each head's k_nope rows of `kv_b` transposed
    /// (MLA-era files).
    AttnKB,
    /// `blk.{n}.attn_v_b.weight`, [N, V, L]: each head's v rows of `kv_b` (MLA-era files).
    AttnVB,
    /// `blk.{n}.attn_output.weight`, [H, N·V].
    AttnOutput,
    /// `blk.{n}.indexer.attn_q_b.weight`, [N_idx·D_idx, Lq].
    IndexerAttnQB,
    /// `blk.{n}.indexer.attn_k.weight`, [D_idx, H].
    IndexerAttnK,
    /// `blk.{n}.indexer.k_norm.weight`, \[D_idx]: the indexer key LayerNorm's gain.
    IndexerKNorm,
    /// `blk.{n}.indexer.k_norm.bias`, \[D_idx]: the indexer key LayerNorm's bias.
    IndexerKNormBias,
    /// `blk.{n}.indexer.proj.weight`, [N_idx, H].
    IndexerProj,
    /// `blk.{n}.ffn_norm.weight`, \[H].
    FfnNorm,
    /// `blk.{n}.ffn_gate.weight`, [F, H] (dense layers).
    FfnGate,
    /// `blk.{n}.ffn_up.weight`, [F, H] (dense layers).
    FfnUp,
    /// `blk.{n}.ffn_down.weight`, [H, F] (dense layers).
    FfnDown,
    /// `blk.{n}.ffn_gate_inp.weight`, [E, H]: the router (MoE layers).
    FfnGateInp,
    /// `blk.{n}.exp_probs_b.bias`, \[E]: the score-correction bias (MoE layers, optional).
    ExpProbsB,
    /// `blk.{n}.ffn_gate_exps.weight`, [E, F_e, H].
    FfnGateExps,
    /// `blk.{n}.ffn_up_exps.weight`, [E, F_e, H].
    FfnUpExps,
    /// `blk.{n}.ffn_down_exps.weight`, [E, H, F_e].
    FfnDownExps,
    /// `blk.{n}.ffn_gate_shexp.weight`, [n_shared·F_e, H].
    FfnGateShexp,
    /// `blk.{n}.ffn_up_shexp.weight`, [n_shared·F_e, H].
    FfnUpShexp,
    /// `blk.{n}.ffn_down_shexp.weight`, [H, n_shared·F_e].
    FfnDownShexp,
}

/// The GGUF tensor's last name part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Suffix {
    /// `.weight`.
    Weight,
    /// `.bias`.
    Bias,
}

impl Suffix {
    /// `weight` or `bias`.
    pub fn as_str(self) -> &'static str {
        match self {
            Suffix::Weight => "weight",
            Suffix::Bias => "bias",
        }
    }
}

/// Rows (or columns) per attention head of a head-split parameter, in MLA dims.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PerHead {
    /// `P+R` (vLLM `qk_head_dim`): `q_b_proj`, `q_proj`.
    QkHeadDim,
    /// `P+V`: `kv_b_proj`.
    KvBHeadDim,
    /// `V` (`v_head_dim`): the input columns of `o_proj`.
    VHeadDim,
    /// 1: the head is dim 0 itself (`W_UK_T` [N, P, L], `W_UV` [N, L, V]).
    One,
}

impl PerHead {
    /// The width in elements for the model's dims.
    pub fn width(self, d: MlaDims) -> usize {
        match self {
            PerHead::QkHeadDim => d.qk_nope_head_dim + d.qk_rope_head_dim,
            PerHead::KvBHeadDim => d.qk_nope_head_dim + d.v_head_dim,
            PerHead::VHeadDim => d.v_head_dim,
            PerHead::One => 1,
        }
    }
}

/// How vLLM's tensor parallelism cuts a parameter across `tp` ranks (its linear-layer kinds).
/// Dims are those of the 2-D matrix; for a 3-D routed-expert tensor the cut applies to each
/// expert (one dim later), under TP without expert parallelism.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TpSplit {
    /// Every rank holds the whole tensor (`ReplicatedLinear`, norms, and a
    /// `MergedColumnParallelLinear` built with `disable_tp`: `fused_qkv_a_proj`, the indexer).
    Replicated,
    /// `ColumnParallelLinear` over the attention heads: dim 0 (output rows) cut by heads, rank
    /// `r` of `tp` holding heads `r·N/tp..(r+1)·N/tp`, the given rows per head.
    ColumnByHeads(PerHead),
    /// `RowParallelLinear` over the attention heads (`o_proj`): dim 1 (input columns) cut by
    /// heads, the given columns per head; each rank's output is a partial sum, all-reduced.
    RowByHeads(PerHead),
    /// `MergedColumnParallelLinear` (`gate_up_proj`, `w13_weight`): dim 0 is the concatenation of
    /// the merged shards (gate, up); each shard's rows are cut into `tp` equal parts on their
    /// own, and a rank holds `[its gate rows | its up rows]`.
    MergedColumn,
    /// `RowParallelLinear` over the FFN width (`down_proj`, `w2_weight`): dim 1 (input columns)
    /// cut into `tp` equal parts.
    Row,
    /// `VocabParallelEmbedding` / `ParallelLMHead`: dim 0 (vocabulary rows) cut into `tp` equal
    /// parts (vLLM pads the vocabulary to its padding multiple first; not modelled here).
    Vocab,
}

impl TpSplit {
    /// The dim of the 2-D matrix that is cut: `None` when replicated, 0 for the column-parallel
    /// kinds and the vocabulary, 1 for the row-parallel kinds.
    pub fn dim(self) -> Option<usize> {
        match self {
            TpSplit::Replicated => None,
            TpSplit::ColumnByHeads(_) | TpSplit::MergedColumn | TpSplit::Vocab => Some(0),
            TpSplit::RowByHeads(_) | TpSplit::Row => Some(1),
        }
    }

    /// The index ranges along [`TpSplit::dim`] that rank `rank` of `tp` holds, in the order its
    /// shard concatenates them. `shards` are the lengths of the merged shards along that dim
    /// (one entry for an unmerged parameter; `[F, F]` for `gate_up_proj`). A replicated
    /// parameter is one range over the whole length; a head split uses `d.n_head` heads of
    /// [`PerHead::width`] each. Units: elements (rows or columns). `tp` must divide the heads
    /// (for a head split) or each shard (otherwise), which the callers check; `tp = 0` yields no
    /// range.
    pub fn rank_ranges(self, d: MlaDims, shards: &[usize], tp: usize, rank: usize) -> Vec<Range<usize>> {
        if tp == 0 {
            return Vec::new();
        }
        let total: usize = shards.iter().sum();
        let equal = |len: usize, offset: usize| offset + rank * len / tp..offset + (rank + 1) * len / tp;
        match self {
            TpSplit::Replicated => std::iter::once(0..total).collect(),
            TpSplit::ColumnByHeads(w) | TpSplit::RowByHeads(w) => {
                let per_rank = d.n_head / tp * w.width(d);
                std::iter::once(rank * per_rank..(rank + 1) * per_rank).collect()
            }
            TpSplit::Row | TpSplit::Vocab => std::iter::once(equal(total, 0)).collect(),
            TpSplit::MergedColumn => shards
                .iter()
                .scan(0, |offset, &len| {
                    let r = equal(len, *offset);
                    *offset += len;
                    Some(r)
                })
                .collect(),
        }
    }
}

impl std::fmt::Display for PerHead {
    /// The width in MLA dim names: `P+R`, `P+V`, `V`, `1`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PerHead::QkHeadDim => "P+R",
            PerHead::KvBHeadDim => "P+V",
            PerHead::VHeadDim => "V",
            PerHead::One => "1",
        })
    }
}

impl std::fmt::Display for TpSplit {
    /// One phrase: `replicated`, `column-parallel by heads (P+R rows each)`, `row-parallel by
    /// heads (V columns each)`, `merged column-parallel`, `row-parallel`, `vocab-parallel`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TpSplit::Replicated => f.write_str("replicated"),
            TpSplit::ColumnByHeads(w) => write!(f, "column-parallel by heads ({w} rows each)"),
            TpSplit::RowByHeads(w) => write!(f, "row-parallel by heads ({w} columns each)"),
            TpSplit::MergedColumn => f.write_str("merged column-parallel"),
            TpSplit::Row => f.write_str("row-parallel"),
            TpSplit::Vocab => f.write_str("vocab-parallel"),
        }
    }
}

/// Where vLLM merges several checkpoint tensors into one parameter (`load_weights`'
/// `stacked_params_mapping`, or the fused-MoE expert mapping).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Merged {
    /// Position of this tensor among the merged shards, along the merged dim (0 = first).
    pub shard: usize,
    /// The HF checkpoint name vLLM loads the shard from (`self_attn.q_a_proj.weight`,
    /// `mlp.gate_proj.weight`), also the parameter's name when the model has no merge partner.
    pub checkpoint: &'static str,
}

/// The vLLM parameter a GGUF tensor becomes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VllmParam {
    /// Parameter name as `named_parameters()` gives it, under the decoder layer
    /// `model.layers.{n}.` (`self_attn.fused_qkv_a_proj.weight`, `mlp.experts.w13_weight`), or
    /// from the model's root for a global tensor (`model.embed_tokens.weight`).
    pub param: &'static str,
    /// Set when the parameter merges several tensors; `None` when this tensor alone fills it
    /// (`attn_k_b` and `attn_v_b` fill `kv_b_proj` interleaved per head, a layout conversion,
    /// not a shard merge).
    pub merged: Option<Merged>,
    /// How tensor parallelism cuts the parameter.
    pub split: TpSplit,
}

/// One row of the table: every name of one tensor kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorRow {
    /// The GGUF short name without `blk.{n}.` or suffix (`attn_q_a`, `indexer.k_norm`).
    pub short: &'static str,
    /// The name's last part.
    pub suffix: Suffix,
    /// True for `blk.{n}.` tensors, false for the global ones (`token_embd`, `output_norm`,
    /// `output`, `rope_factors_short`).
    pub per_layer: bool,
    /// PyTorch shape in the dim names of the module docs.
    pub shape: &'static str,
    /// The whole-tensor weight sites whose values this tensor provides (`w.fused_qkv_a`,
    /// `w.kv_b`, `w.W_UK_T`, `w.W_UV`); empty for tensors mla-diff records no weight site for.
    pub sites: &'static [Stage],
    /// The TP-split weight whose per-rank shards (`w.<weight>.rank<r>`) are cut from it.
    pub ranked: Option<RankedWeight>,
    /// The first site of its layer whose value reads it (`None` for the tensors after the last
    /// layer): where a corrupt copy of it first shows. `ffn_norm` feeds `ffn_in` in dense and
    /// MoE layers alike; the shared experts' `ffn_gate_shexp`/`ffn_up_shexp` feed `ffn_gate`/
    /// `ffn_up` as the dense pair does, and `ffn_down_shexp` feeds `shared_out` (an MoE layer
    /// has no `ffn_out`).
    pub first_site: Option<Stage>,
    /// The vLLM parameter it becomes; `None` where vLLM builds the values from the config
    /// (`rope_factors_short`).
    pub vllm: Option<VllmParam>,
}

impl ModelTensor {
    /// Every tensor kind, in the table's order (a layer's load order: norms and attention, the
    /// indexer, the FFN).
    pub const ALL: [ModelTensor; 32] = [
        ModelTensor::TokenEmbd,
        ModelTensor::OutputNorm,
        ModelTensor::Output,
        ModelTensor::RopeFactorsShort,
        ModelTensor::AttnNorm,
        ModelTensor::AttnQA,
        ModelTensor::AttnQANorm,
        ModelTensor::AttnQB,
        ModelTensor::AttnQ,
        ModelTensor::AttnKvAMqa,
        ModelTensor::AttnKvANorm,
        ModelTensor::AttnKvB,
        ModelTensor::AttnKB,
        ModelTensor::AttnVB,
        ModelTensor::AttnOutput,
        ModelTensor::IndexerAttnQB,
        ModelTensor::IndexerAttnK,
        ModelTensor::IndexerKNorm,
        ModelTensor::IndexerKNormBias,
        ModelTensor::IndexerProj,
        ModelTensor::FfnNorm,
        ModelTensor::FfnGate,
        ModelTensor::FfnUp,
        ModelTensor::FfnDown,
        ModelTensor::FfnGateInp,
        ModelTensor::ExpProbsB,
        ModelTensor::FfnGateExps,
        ModelTensor::FfnUpExps,
        ModelTensor::FfnDownExps,
        ModelTensor::FfnGateShexp,
        ModelTensor::FfnUpShexp,
        ModelTensor::FfnDownShexp,
    ];

    /// This tensor's row of the table.
    #[allow(clippy::too_many_lines)] // one table row per arm
    pub fn row(self) -> TensorRow {
        use ModelTensor as T;
        use RankedWeight as RW;
        use TpSplit::{ColumnByHeads, MergedColumn, Replicated, Row, RowByHeads, Vocab};
        let (short, suffix, shape) = self.name_parts();
        let row = |sites: &'static [Stage],
                   ranked: Option<RankedWeight>,
                   first_site: Option<Stage>,
                   vllm: Option<VllmParam>| TensorRow {
            short,
            suffix,
            per_layer: self.per_layer(),
            shape,
            sites,
            ranked,
            first_site,
            vllm,
        };
        let p = |param: &'static str, split: TpSplit| {
            Some(VllmParam {
                param,
                merged: None,
                split,
            })
        };
        let m = |param: &'static str, shard: usize, checkpoint: &'static str, split: TpSplit| {
            Some(VllmParam {
                param,
                merged: Some(Merged { shard, checkpoint }),
                split,
            })
        };
        const FUSED_A: &str = "self_attn.fused_qkv_a_proj.weight";
        const KV_B: &str = "self_attn.kv_b_proj.weight";
        const KV_B_SPLIT: TpSplit = ColumnByHeads(PerHead::KvBHeadDim);
        const WK_PROJ: &str = "self_attn.indexer.wk_weights_proj.weight";
        match self {
            T::TokenEmbd => row(&[], None, Some(Stage::HiddenIn), p("model.embed_tokens.weight", Vocab)),
            T::OutputNorm => row(&[], None, None, p("model.norm.weight", Replicated)),
            T::Output => row(&[], None, None, p("lm_head.weight", Vocab)),
            T::RopeFactorsShort => row(&[], None, Some(Stage::QPeRoped), None),
            T::AttnNorm => row(&[], None, Some(Stage::AttnIn), p("input_layernorm.weight", Replicated)),
            T::AttnQA => row(
                &[Stage::WFusedQkvA],
                None,
                Some(Stage::QC),
                m(FUSED_A, 0, "self_attn.q_a_proj.weight", Replicated),
            ),
            T::AttnQANorm => row(
                &[],
                None,
                Some(Stage::QCNormed),
                p("self_attn.q_a_layernorm.weight", Replicated),
            ),
            T::AttnQB => row(
                &[],
                Some(RW::QProj),
                Some(Stage::Q),
                p("self_attn.q_b_proj.weight", ColumnByHeads(PerHead::QkHeadDim)),
            ),
            T::AttnQ => row(
                &[],
                Some(RW::QProj),
                Some(Stage::Q),
                p("self_attn.q_proj.weight", ColumnByHeads(PerHead::QkHeadDim)),
            ),
            T::AttnKvAMqa => row(
                &[Stage::WFusedQkvA],
                None,
                Some(Stage::KvA),
                m(FUSED_A, 1, "self_attn.kv_a_proj_with_mqa.weight", Replicated),
            ),
            T::AttnKvANorm => row(
                &[],
                None,
                Some(Stage::KvCNormed),
                p("self_attn.kv_a_layernorm.weight", Replicated),
            ),
            T::AttnKvB => row(
                &[Stage::WKvB, Stage::WUkT, Stage::WUv],
                Some(RW::KvB),
                Some(Stage::WKvB),
                p(KV_B, KV_B_SPLIT),
            ),
            T::AttnKB => row(
                &[Stage::WKvB, Stage::WUkT],
                Some(RW::KvB),
                Some(Stage::WKvB),
                p(KV_B, KV_B_SPLIT),
            ),
            T::AttnVB => row(
                &[Stage::WKvB, Stage::WUv],
                Some(RW::KvB),
                Some(Stage::WKvB),
                p(KV_B, KV_B_SPLIT),
            ),
            T::AttnOutput => row(
                &[],
                Some(RW::OProj),
                Some(Stage::OProj),
                p("self_attn.o_proj.weight", RowByHeads(PerHead::VHeadDim)),
            ),
            T::IndexerAttnQB => row(
                &[],
                None,
                Some(Stage::IdxQ),
                p("self_attn.indexer.wq_b.weight", Replicated),
            ),
            T::IndexerAttnK => row(
                &[],
                None,
                Some(Stage::IdxK),
                m(WK_PROJ, 0, "self_attn.indexer.wk.weight", Replicated),
            ),
            T::IndexerKNorm => row(
                &[],
                None,
                Some(Stage::IdxK),
                p("self_attn.indexer.k_norm.weight", Replicated),
            ),
            T::IndexerKNormBias => row(
                &[],
                None,
                Some(Stage::IdxK),
                p("self_attn.indexer.k_norm.bias", Replicated),
            ),
            T::IndexerProj => row(
                &[],
                None,
                Some(Stage::IdxWeights),
                m(WK_PROJ, 1, "self_attn.indexer.weights_proj.weight", Replicated),
            ),
            T::FfnNorm => row(
                &[],
                None,
                Some(Stage::FfnIn),
                p("post_attention_layernorm.weight", Replicated),
            ),
            T::FfnGate => row(
                &[],
                Some(RW::GateUp),
                Some(Stage::FfnGate),
                m("mlp.gate_up_proj.weight", 0, "mlp.gate_proj.weight", MergedColumn),
            ),
            T::FfnUp => row(
                &[],
                Some(RW::GateUp),
                Some(Stage::FfnUp),
                m("mlp.gate_up_proj.weight", 1, "mlp.up_proj.weight", MergedColumn),
            ),
            T::FfnDown => row(&[], Some(RW::Down), Some(Stage::FfnOut), p("mlp.down_proj.weight", Row)),
            T::FfnGateInp => row(
                &[],
                None,
                Some(Stage::MoeRouterLogits),
                p("mlp.gate.weight", Replicated),
            ),
            T::ExpProbsB => row(
                &[],
                None,
                Some(Stage::MoeTopk),
                p("mlp.gate.e_score_correction_bias", Replicated),
            ),
            T::FfnGateExps => row(
                &[],
                None,
                Some(Stage::MoeOut),
                m(
                    "mlp.experts.w13_weight",
                    0,
                    "mlp.experts.{e}.gate_proj.weight",
                    MergedColumn,
                ),
            ),
            T::FfnUpExps => row(
                &[],
                None,
                Some(Stage::MoeOut),
                m(
                    "mlp.experts.w13_weight",
                    1,
                    "mlp.experts.{e}.up_proj.weight",
                    MergedColumn,
                ),
            ),
            T::FfnDownExps => row(&[], None, Some(Stage::MoeOut), p("mlp.experts.w2_weight", Row)),
            T::FfnGateShexp => row(
                &[],
                Some(RW::GateUp),
                Some(Stage::FfnGate),
                m(
                    "mlp.shared_experts.gate_up_proj.weight",
                    0,
                    "mlp.shared_experts.gate_proj.weight",
                    MergedColumn,
                ),
            ),
            T::FfnUpShexp => row(
                &[],
                Some(RW::GateUp),
                Some(Stage::FfnUp),
                m(
                    "mlp.shared_experts.gate_up_proj.weight",
                    1,
                    "mlp.shared_experts.up_proj.weight",
                    MergedColumn,
                ),
            ),
            T::FfnDownShexp => row(
                &[],
                Some(RW::Down),
                Some(Stage::SharedOut),
                p("mlp.shared_experts.down_proj.weight", Row),
            ),
        }
    }

    /// False for the global tensors (no `blk.{n}.` prefix).
    fn per_layer(self) -> bool {
        !matches!(
            self,
            ModelTensor::TokenEmbd | ModelTensor::OutputNorm | ModelTensor::Output | ModelTensor::RopeFactorsShort
        )
    }

    /// (GGUF short name, suffix, PyTorch shape).
    fn name_parts(self) -> (&'static str, Suffix, &'static str) {
        use ModelTensor as T;
        use Suffix::{Bias, Weight};
        match self {
            T::TokenEmbd => ("token_embd", Weight, "[vocab, H]"),
            T::OutputNorm => ("output_norm", Weight, "[H]"),
            T::Output => ("output", Weight, "[vocab, H]"),
            T::RopeFactorsShort => ("rope_factors_short", Weight, "[R/2]"),
            T::AttnNorm => ("attn_norm", Weight, "[H]"),
            T::AttnQA => ("attn_q_a", Weight, "[Lq, H]"),
            T::AttnQANorm => ("attn_q_a_norm", Weight, "[Lq]"),
            T::AttnQB => ("attn_q_b", Weight, "[N·(P+R), Lq]"),
            T::AttnQ => ("attn_q", Weight, "[N·(P+R), H]"),
            T::AttnKvAMqa => ("attn_kv_a_mqa", Weight, "[L+R, H]"),
            T::AttnKvANorm => ("attn_kv_a_norm", Weight, "[L]"),
            T::AttnKvB => ("attn_kv_b", Weight, "[N·(P+V), L]"),
            T::AttnKB => ("attn_k_b", Weight, "[N, L, P]"),
            T::AttnVB => ("attn_v_b", Weight, "[N, V, L]"),
            T::AttnOutput => ("attn_output", Weight, "[H, N·V]"),
            T::IndexerAttnQB => ("indexer.attn_q_b", Weight, "[N_idx·D_idx, Lq]"),
            T::IndexerAttnK => ("indexer.attn_k", Weight, "[D_idx, H]"),
            T::IndexerKNorm => ("indexer.k_norm", Weight, "[D_idx]"),
            T::IndexerKNormBias => ("indexer.k_norm", Bias, "[D_idx]"),
            T::IndexerProj => ("indexer.proj", Weight, "[N_idx, H]"),
            T::FfnNorm => ("ffn_norm", Weight, "[H]"),
            T::FfnGate => ("ffn_gate", Weight, "[F, H]"),
            T::FfnUp => ("ffn_up", Weight, "[F, H]"),
            T::FfnDown => ("ffn_down", Weight, "[H, F]"),
            T::FfnGateInp => ("ffn_gate_inp", Weight, "[E, H]"),
            T::ExpProbsB => ("exp_probs_b", Bias, "[E]"),
            T::FfnGateExps => ("ffn_gate_exps", Weight, "[E, F_e, H]"),
            T::FfnUpExps => ("ffn_up_exps", Weight, "[E, F_e, H]"),
            T::FfnDownExps => ("ffn_down_exps", Weight, "[E, H, F_e]"),
            T::FfnGateShexp => ("ffn_gate_shexp", Weight, "[n_shared·F_e, H]"),
            T::FfnUpShexp => ("ffn_up_shexp", Weight, "[n_shared·F_e, H]"),
            T::FfnDownShexp => ("ffn_down_shexp", Weight, "[H, n_shared·F_e]"),
        }
    }

    /// The GGUF short name (`attn_kv_b`, `indexer.k_norm`).
    pub fn short(self) -> &'static str {
        self.name_parts().0
    }

    /// The full GGUF tensor name in layer `layer`: `blk.{layer}.{short}.{weight|bias}`; for a
    /// global tensor (`token_embd`, …) `{short}.weight`, `layer` unused.
    pub fn name(self, layer: usize) -> String {
        let (short, suffix, _) = self.name_parts();
        if self.per_layer() {
            format!("{}{short}.{}", block_prefix(layer), suffix.as_str())
        } else {
            format!("{short}.{}", suffix.as_str())
        }
    }

    /// The tensor kind and layer (`None` for a global tensor) of a full GGUF name; `None` for a
    /// name outside the table (`nextn.eh_proj`, `rope_factors_long`, a misspelling).
    pub fn parse(name: &str) -> Option<(Option<usize>, ModelTensor)> {
        let (layer, rest) = match layer_of(name) {
            Some(l) => (Some(l), name.strip_prefix(&block_prefix(l))?),
            None => (None, name),
        };
        let (short, suffix) = rest.rsplit_once('.')?;
        ModelTensor::ALL.into_iter().find_map(|t| {
            let (s, x, _) = t.name_parts();
            (s == short && x.as_str() == suffix && t.per_layer() == layer.is_some()).then_some((layer, t))
        })
    }

    /// False for the tensor of a layout this model does not use, so never in its file: the
    /// `Lq` tensors (`attn_q_a`, `attn_q_a_norm`, `attn_q_b`) without `Lq` and `attn_q` with it,
    /// `attn_kv_b` in a split file and `attn_k_b`/`attn_v_b` in a fused one, the indexer without
    /// a DSA indexer. True for every other tensor (whether a layer is dense or MoE, and the
    /// optional ones, are for the loader to ask).
    pub fn in_layout(self, cfg: &MlaConfig) -> bool {
        use ModelTensor as T;
        let lora = cfg.q_lora_rank.is_some();
        match self {
            T::AttnQA | T::AttnQANorm | T::AttnQB => lora,
            T::AttnQ => !lora,
            T::AttnKvB => cfg.kv_b_layout == KvBLayout::Fused,
            T::AttnKB | T::AttnVB => cfg.kv_b_layout == KvBLayout::Split,
            T::IndexerAttnQB | T::IndexerAttnK | T::IndexerKNorm | T::IndexerKNormBias | T::IndexerProj => {
                cfg.indexer.is_some()
            }
            _ => true,
        }
    }

    /// [`ModelTensor::in_layout`], and for the FFN the kind of layer: the dense FFN's tensors
    /// (`ffn_gate`, `ffn_up`, `ffn_down`) only in a dense layer, the MoE block's (router, bias,
    /// routed and shared experts) only in an MoE layer ([`MlaConfig::is_moe_layer`]).
    pub fn in_layer(self, cfg: &MlaConfig, layer: usize) -> bool {
        use ModelTensor as T;
        let moe = cfg.is_moe_layer(layer);
        self.in_layout(cfg)
            && match self {
                T::FfnGate | T::FfnUp | T::FfnDown => !moe,
                T::FfnGateInp
                | T::ExpProbsB
                | T::FfnGateExps
                | T::FfnUpExps
                | T::FfnDownExps
                | T::FfnGateShexp
                | T::FfnUpShexp
                | T::FfnDownShexp => moe,
                _ => true,
            }
    }

    /// The tensor's name in a Hugging Face checkpoint of the DeepSeek-V2/V3 family (the name
    /// transformers' `DeepseekV3ForCausalLM` and DeepSeek's own checkpoints use), with `{n}` for
    /// the layer and `{e}` for the expert of a routed-expert tensor, which such a checkpoint
    /// stores one per expert (GGUF stacks them). An fp8 matrix has its block scales beside it as
    /// `<name>_scale_inv`. `None` for the GGUF-only tensors (`attn_k_b`/`attn_v_b`, which
    /// llama.cpp's converter cuts from `kv_b_proj`; MiniCPM3's `rope_factors_short`) and the DSA
    /// indexer (whose checkpoints are not read).
    pub fn hf_name(self) -> Option<&'static str> {
        use ModelTensor as T;
        Some(match self {
            T::TokenEmbd => "model.embed_tokens.weight",
            T::OutputNorm => "model.norm.weight",
            T::Output => "lm_head.weight",
            T::AttnNorm => "model.layers.{n}.input_layernorm.weight",
            T::AttnQA => "model.layers.{n}.self_attn.q_a_proj.weight",
            T::AttnQANorm => "model.layers.{n}.self_attn.q_a_layernorm.weight",
            T::AttnQB => "model.layers.{n}.self_attn.q_b_proj.weight",
            T::AttnQ => "model.layers.{n}.self_attn.q_proj.weight",
            T::AttnKvAMqa => "model.layers.{n}.self_attn.kv_a_proj_with_mqa.weight",
            T::AttnKvANorm => "model.layers.{n}.self_attn.kv_a_layernorm.weight",
            T::AttnKvB => "model.layers.{n}.self_attn.kv_b_proj.weight",
            T::AttnOutput => "model.layers.{n}.self_attn.o_proj.weight",
            T::FfnNorm => "model.layers.{n}.post_attention_layernorm.weight",
            T::FfnGate => "model.layers.{n}.mlp.gate_proj.weight",
            T::FfnUp => "model.layers.{n}.mlp.up_proj.weight",
            T::FfnDown => "model.layers.{n}.mlp.down_proj.weight",
            T::FfnGateInp => "model.layers.{n}.mlp.gate.weight",
            T::ExpProbsB => "model.layers.{n}.mlp.gate.e_score_correction_bias",
            T::FfnGateExps => "model.layers.{n}.mlp.experts.{e}.gate_proj.weight",
            T::FfnUpExps => "model.layers.{n}.mlp.experts.{e}.up_proj.weight",
            T::FfnDownExps => "model.layers.{n}.mlp.experts.{e}.down_proj.weight",
            T::FfnGateShexp => "model.layers.{n}.mlp.shared_experts.gate_proj.weight",
            T::FfnUpShexp => "model.layers.{n}.mlp.shared_experts.up_proj.weight",
            T::FfnDownShexp => "model.layers.{n}.mlp.shared_experts.down_proj.weight",
            T::RopeFactorsShort
            | T::AttnKB
            | T::AttnVB
            | T::IndexerAttnQB
            | T::IndexerAttnK
            | T::IndexerKNorm
            | T::IndexerKNormBias
            | T::IndexerProj => return None,
        })
    }

    /// The `kv_b` tensor of `layout` whose input dim (`ne[0]`, along which quant blocks run) is
    /// the latent `L`: `attn_v_b` [N, V, L] in a split file, `attn_kv_b` [N·(P+V), L] in a fused
    /// one. A loader that cuts `kv_b_proj` along `L` cuts this tensor's quant blocks.
    pub fn kv_b_latent_input(layout: KvBLayout) -> ModelTensor {
        match layout {
            KvBLayout::Split => ModelTensor::AttnVB,
            KvBLayout::Fused => ModelTensor::AttnKvB,
        }
    }

    /// The name of the vLLM parameter this tensor fills in `cfg`'s model: the merged parameter,
    /// or the shard's own checkpoint name when its merge partner is not in the layout (without
    /// `Lq`, `attn_kv_a_mqa` becomes `self_attn.kv_a_proj_with_mqa.weight`, not a shard of
    /// `fused_qkv_a_proj`). `None` where vLLM has no such parameter.
    pub fn vllm_param(self, cfg: &MlaConfig) -> Option<&'static str> {
        let v = self.row().vllm?;
        let Some(m) = v.merged else {
            return Some(v.param);
        };
        let partners_present = ModelTensor::ALL
            .into_iter()
            .filter(|t| t.row().vllm.is_some_and(|o| o.param == v.param))
            .all(|t| t.in_layout(cfg));
        Some(if partners_present { v.param } else { m.checkpoint })
    }
}

/// `blk.{layer}.`: the prefix of every per-layer tensor name.
pub fn block_prefix(layer: usize) -> String {
    format!("blk.{layer}.")
}

/// The layer of a `blk.{layer}.…` tensor name; `None` for a global tensor or another name.
pub fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

/// `blk.{layer}.{short}.weight`: a per-layer weight tensor's name from its GGUF short name (for
/// the table's rows, [`ModelTensor::name`] gives every name, biases and global tensors included).
pub fn tensor_name(layer: usize, short: &str) -> String {
    format!("{}{short}.weight", block_prefix(layer))
}

/// The tensors of `cfg`'s layout whose values weight site `stage` holds, in table order:
/// `w.fused_qkv_a` ← `attn_q_a`, `attn_kv_a_mqa`; `w.kv_b` and `w.kv_b.rank<r>` ←
/// `attn_k_b`, `attn_v_b` (or `attn_kv_b`); `w.W_UK_T` ← `attn_k_b` (or `attn_kv_b`); `w.W_UV` ←
/// `attn_v_b` (or `attn_kv_b`); `w.q_b.rank<r>` ← `attn_q_b` (or `attn_q`); `w.o_proj.rank<r>`
/// ← `attn_output`; `w.gate_up.rank<r>` ← `ffn_gate`, `ffn_up` and their `_shexp` twins;
/// `w.down.rank<r>` ← `ffn_down`, `ffn_down_shexp` (which of each pair a layer holds:
/// [`ModelTensor::in_layer`]). Empty for a site that is not a weight.
pub fn site_sources(cfg: &MlaConfig, stage: Stage) -> Vec<ModelTensor> {
    ModelTensor::ALL
        .into_iter()
        .filter(|t| t.in_layout(cfg))
        .filter(|t| {
            let row = t.row();
            match stage {
                Stage::WRank(w, _) => row.ranked == Some(w),
                s => row.sites.contains(&s),
            }
        })
        .collect()
}

/// The tensors an engine's loader reads to build weight site `stage`: [`site_sources`], except
/// that `W_UK_T` and `W_UV` are computed after loading from the whole `kv_b_proj`
/// (vLLM `process_weights_after_loading`), so they name every `kv_b` tensor of the layout.
pub fn loader_sources(cfg: &MlaConfig, stage: Stage) -> Vec<ModelTensor> {
    match stage {
        Stage::WUkT | Stage::WUv => site_sources(cfg, Stage::WKvB),
        s => site_sources(cfg, s),
    }
}

/// The MLA backend's absorbed weights (`vllm/v1/attention/backends/mla/common.py`,
/// `process_weights_after_loading`): `W_UK_T` [N, P, L] at `w.W_UK_T` and `W_UV` [N, L, V] at
/// `w.W_UV`. Each rank derives them from its own `kv_b_proj` heads, so they split by heads on
/// dim 0, one head per index.
const ABSORBED: [(Stage, &str); 2] = [(Stage::WUkT, "W_UK_T"), (Stage::WUv, "W_UV")];

/// The vLLM name and TP split of what weight site `stage` holds: the parameter its tensors fill
/// (`self_attn.fused_qkv_a_proj.weight`, `self_attn.kv_b_proj.weight`, `q_b_proj` or `q_proj`,
/// `o_proj`), or for `w.W_UK_T` [N, P, L] and `w.W_UV` [N, L, V] the MLA backend's `W_UK_T` /
/// `W_UV`, which each rank derives from its own `kv_b_proj` heads (so they split by heads on
/// dim 0). `None` for a site that is not a weight.
pub fn site_param(cfg: &MlaConfig, stage: Stage) -> Option<(&'static str, TpSplit)> {
    if let Some((_, name)) = ABSORBED.iter().find(|(s, _)| *s == stage) {
        return Some((name, TpSplit::ColumnByHeads(PerHead::One)));
    }
    let t = *site_sources(cfg, stage).first()?;
    Some((t.vllm_param(cfg)?, t.row().vllm?.split))
}

/// The name a weights dump gives vLLM parameter `param` of a decoder layer under `L{n}.`:
/// without the module prefix `self_attn.` or `mlp.` and the suffix `.weight`
/// (`self_attn.q_b_proj.weight` → `q_b_proj`, `mlp.shared_experts.gate_up_proj.weight` →
/// `shared_experts.gate_up_proj`; `W_UK_T` stays `W_UK_T`).
pub fn dump_name(param: &'static str) -> &'static str {
    let p = param
        .strip_prefix("self_attn.")
        .or_else(|| param.strip_prefix("mlp."))
        .unwrap_or(param);
    p.strip_suffix(".weight").unwrap_or(p)
}

/// True for the attention tensors a weight site is built from (a whole-tensor `w.*` site or a
/// per-rank `w.<weight>.rank<r>` one): the attention projections, not the FFN's `gate_up` and
/// `down` shards.
fn feeds_weight_site(t: ModelTensor) -> bool {
    let row = t.row();
    !row.sites.is_empty() || row.ranked.is_some_and(|w| !w.is_ffn())
}

/// The FFN tensors whose vLLM parameters a weights dump may hold, in table order: the dense
/// MLP's (`gate_up_proj` ← `ffn_gate` + `ffn_up`, `down_proj` ← `ffn_down`) and the shared
/// experts' (`shared_experts.gate_up_proj`, `shared_experts.down_proj`, from the `_shexp`
/// tensors). The routed experts (`experts.w13_weight`, `experts.w2_weight`) are left out:
/// rebuilding them dequantizes every expert of a layer, E times a dense FFN.
pub const FFN_DUMP_TENSORS: [ModelTensor; 6] = [
    ModelTensor::FfnGate,
    ModelTensor::FfnUp,
    ModelTensor::FfnDown,
    ModelTensor::FfnGateShexp,
    ModelTensor::FfnUpShexp,
    ModelTensor::FfnDownShexp,
];

/// One parameter of an engine's loaded weights (the MLA attention and the FFN of a dense layer
/// or the shared experts), under the name a weights dump gives it (`L{n}.{name}`, or
/// `L{n}.{name}.rank{r}` for rank `r`'s shard): what `weights --check` rebuilds from the GGUF
/// and compares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DumpParam {
    /// The parameter's [`dump_name`]: `fused_qkv_a_proj`, `q_a_proj`, `q_b_proj` or `q_proj`,
    /// `kv_a_proj_with_mqa`, `kv_b_proj`, `o_proj`, `W_UK_T`, `W_UV`, `gate_up_proj`,
    /// `down_proj`, `shared_experts.gate_up_proj`, `shared_experts.down_proj`, and the merged
    /// shards on their own (`q_a_proj`, `gate_proj`, `up_proj`, `shared_experts.gate_proj`, …).
    pub name: &'static str,
    /// The weight site it holds the values of (`w.fused_qkv_a`, `w.kv_b`, `w.W_UK_T`, `w.W_UV`;
    /// rank 0's `w.q_b.rank0`, `w.o_proj.rank0` for a weight recorded only per rank); `None` for
    /// a merged shard dumped on its own (`q_a_proj` and `kv_a_proj_with_mqa` beside
    /// `fused_qkv_a_proj`) and for an FFN parameter without a weight site.
    pub site: Option<Stage>,
    /// How tensor parallelism cuts it.
    pub split: TpSplit,
    /// The GGUF tensors it is built from, in table order ([`loader_sources`] of its site).
    pub sources: Vec<ModelTensor>,
    /// The tensors it concatenates along dim 0, in vLLM's merged shard order
    /// (`fused_qkv_a_proj`: `attn_q_a` then `attn_kv_a_mqa`); empty unless it merges tensors.
    pub shards: Vec<ModelTensor>,
}

/// The parameters of `cfg`'s layout that a weights dump may hold, one per name: each weight
/// site's parameter ([`site_param`], sources [`site_sources`]), then the FFN parameters of
/// [`FFN_DUMP_TENSORS`] (`gate_up_proj`, `down_proj` and their `shared_experts.` twins; which
/// of them a layer has depends on whether it is dense or MoE), then each merged shard under its
/// own checkpoint name (vLLM's `stacked_params_mapping`), which an engine that does not fuse
/// holds instead. Without `Lq` there is no merge: `kv_a_proj_with_mqa` is a parameter of its
/// own, and `q_proj` replaces `q_a_proj`/`q_b_proj`.
pub fn dump_params(cfg: &MlaConfig) -> Vec<DumpParam> {
    let sites = crate::core::trace::STAGES
        .iter()
        .copied()
        .filter(|s| s.is_weight())
        .chain(
            RankedWeight::ALL
                .into_iter()
                .filter(|w| !w.is_ffn())
                .map(|w| Stage::WRank(w, 0)),
        );
    let mut out: Vec<DumpParam> = Vec::new();
    for site in sites {
        let Some((param, split)) = site_param(cfg, site) else {
            continue;
        };
        let name = dump_name(param);
        if out.iter().any(|p| p.name == name) {
            continue;
        }
        let sources = site_sources(cfg, site);
        let mut shards: Vec<ModelTensor> = sources
            .iter()
            .copied()
            .filter(|t| t.row().vllm.is_some_and(|v| v.merged.is_some() && v.param == param))
            .collect();
        shards.sort_by_key(|t| t.row().vllm.and_then(|v| v.merged).map(|m| m.shard));
        out.push(DumpParam {
            name,
            site: Some(site),
            split,
            sources,
            shards,
        });
    }
    for t in FFN_DUMP_TENSORS {
        let Some(v) = t.row().vllm else { continue };
        let name = dump_name(v.param);
        if out.iter().any(|p| p.name == name) {
            continue;
        }
        let sources: Vec<ModelTensor> = FFN_DUMP_TENSORS
            .into_iter()
            .filter(|o| o.row().vllm.is_some_and(|w| w.param == v.param))
            .collect();
        let mut shards: Vec<ModelTensor> = sources
            .iter()
            .copied()
            .filter(|o| o.row().vllm.is_some_and(|w| w.merged.is_some()))
            .collect();
        shards.sort_by_key(|o| o.row().vllm.and_then(|w| w.merged).map(|m| m.shard));
        out.push(DumpParam {
            name,
            site: None,
            split: v.split,
            sources,
            shards,
        });
    }
    let merged: Vec<ModelTensor> = out.iter().flat_map(|p| p.shards.clone()).collect();
    for t in merged {
        let Some(v) = t.row().vllm else { continue };
        out.push(DumpParam {
            name: dump_name(v.merged.map_or(v.param, |m| m.checkpoint)),
            site: None,
            split: v.split,
            sources: vec![t],
            shards: Vec::new(),
        });
    }
    out
}

/// Every name [`dump_params`] gives in any layout, in data-flow order: the attention's in table
/// order (`fused_qkv_a_proj`, `q_a_proj`, `q_b_proj`, `q_proj`, `kv_a_proj_with_mqa`,
/// `kv_b_proj`, `o_proj`), the absorbed `W_UK_T`, `W_UV`, then the FFN's (`gate_up_proj`,
/// `gate_proj`, `up_proj`, `down_proj`, and the same under `shared_experts.`). A dump's
/// `L{n}.{name}` is read as a weight when its name is here.
pub fn dump_param_names() -> Vec<&'static str> {
    /// The parameter `t` fills and its own checkpoint name when it is a merged shard.
    fn push(t: ModelTensor, names: &mut Vec<&'static str>) {
        let Some(v) = t.row().vllm else { return };
        let own = v.merged.map(|m| m.checkpoint);
        for param in std::iter::once(v.param).chain(own) {
            let name = dump_name(param);
            if !names.contains(&name) {
                names.push(name);
            }
        }
    }
    let mut names: Vec<&'static str> = Vec::new();
    for t in ModelTensor::ALL.into_iter().filter(|&t| feeds_weight_site(t)) {
        push(t, &mut names);
    }
    names.extend(ABSORBED.map(|(_, name)| name));
    for t in FFN_DUMP_TENSORS {
        push(t, &mut names);
    }
    names
}

#[cfg(test)]
#[allow(clippy::single_range_in_vec_init)] // a rank's one range, as rank_ranges returns it
mod tests {
    use super::*;
    use crate::model::config::RopeStyle;

    fn cfg(q_lora_rank: Option<usize>, kv_b_layout: KvBLayout) -> MlaConfig {
        MlaConfig {
            arch: crate::model::arch::Arch::Deepseek2,
            n_layer: 2,
            hidden: 64,
            n_head: 4,
            q_lora_rank,
            kv_lora_rank: 32,
            qk_nope_head_dim: 16,
            qk_rope_head_dim: 8,
            v_head_dim: 12,
            rms_eps: 1e-6,
            rope_base: 10000.0,
            yarn: None,
            softmax_scale: 24f64.powf(-0.5),
            kv_b_layout,
            leading_dense_block_count: 2,
            vocab: 128,
            moe: None,
            rope_style: RopeStyle::Interleaved,
            rope_factors: None,
            indexer: None,
            nextn_predict_layers: 0,
            embedding_scale: 1.0,
            residual_scale: 1.0,
        }
    }

    #[test]
    fn names_round_trip_through_the_table() {
        let mut seen = std::collections::HashSet::new();
        for t in ModelTensor::ALL {
            let name = t.name(7);
            assert!(seen.insert(name.clone()), "{name} twice");
            let layer = t.row().per_layer.then_some(7);
            assert_eq!(ModelTensor::parse(&name), Some((layer, t)), "{name}");
        }
        assert_eq!(ModelTensor::AttnKvAMqa.name(3), "blk.3.attn_kv_a_mqa.weight");
        assert_eq!(ModelTensor::IndexerKNormBias.name(0), "blk.0.indexer.k_norm.bias");
        assert_eq!(ModelTensor::ExpProbsB.name(12), "blk.12.exp_probs_b.bias");
        assert_eq!(ModelTensor::TokenEmbd.name(5), "token_embd.weight");
        assert_eq!(ModelTensor::RopeFactorsShort.name(0), "rope_factors_short.weight");
        assert_eq!(tensor_name(2, "attn_q_b"), ModelTensor::AttnQB.name(2));
        assert_eq!(layer_of("blk.61.ffn_down_exps.weight"), Some(61));
        assert_eq!(layer_of("token_embd.weight"), None);
        for bad in [
            "blk.1.attn_q_b.bias",
            "blk.x.attn_q_b.weight",
            "blk.1.nextn.eh_proj.weight",
            "attn_q_b.weight",
            "blk.1.token_embd.weight",
            "rope_factors_long.weight",
        ] {
            assert_eq!(ModelTensor::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn vllm_params_and_their_splits() {
        let row = |t: ModelTensor| t.row().vllm.unwrap();
        let heads = |w| TpSplit::ColumnByHeads(w);
        assert_eq!(row(ModelTensor::AttnQB).param, "self_attn.q_b_proj.weight");
        assert_eq!(row(ModelTensor::AttnQB).split, heads(PerHead::QkHeadDim));
        assert_eq!(row(ModelTensor::AttnQ).split, heads(PerHead::QkHeadDim));
        for t in [ModelTensor::AttnKvB, ModelTensor::AttnKB, ModelTensor::AttnVB] {
            assert_eq!(row(t).param, "self_attn.kv_b_proj.weight");
            assert_eq!(row(t).split, heads(PerHead::KvBHeadDim));
            assert_eq!(row(t).merged, None);
        }
        assert_eq!(
            row(ModelTensor::AttnOutput).split,
            TpSplit::RowByHeads(PerHead::VHeadDim)
        );
        // Merged parameters: shard order and checkpoint names (vLLM's stacked_params_mapping).
        let merged = |t: ModelTensor| {
            let v = row(t);
            (v.param, v.merged.map(|m| (m.shard, m.checkpoint)), v.split)
        };
        assert_eq!(
            merged(ModelTensor::AttnQA),
            (
                "self_attn.fused_qkv_a_proj.weight",
                Some((0, "self_attn.q_a_proj.weight")),
                TpSplit::Replicated
            )
        );
        assert_eq!(
            merged(ModelTensor::AttnKvAMqa),
            (
                "self_attn.fused_qkv_a_proj.weight",
                Some((1, "self_attn.kv_a_proj_with_mqa.weight")),
                TpSplit::Replicated
            )
        );
        assert_eq!(
            merged(ModelTensor::FfnUp),
            (
                "mlp.gate_up_proj.weight",
                Some((1, "mlp.up_proj.weight")),
                TpSplit::MergedColumn
            )
        );
        assert_eq!(
            merged(ModelTensor::FfnDown),
            ("mlp.down_proj.weight", None, TpSplit::Row)
        );
        assert_eq!(
            merged(ModelTensor::FfnGateShexp),
            (
                "mlp.shared_experts.gate_up_proj.weight",
                Some((0, "mlp.shared_experts.gate_proj.weight")),
                TpSplit::MergedColumn
            )
        );
        assert_eq!(merged(ModelTensor::FfnUpExps).0, "mlp.experts.w13_weight");
        assert_eq!(
            merged(ModelTensor::FfnDownExps),
            ("mlp.experts.w2_weight", None, TpSplit::Row)
        );
        assert_eq!(
            merged(ModelTensor::FfnGateInp),
            ("mlp.gate.weight", None, TpSplit::Replicated)
        );
        assert_eq!(row(ModelTensor::TokenEmbd).split, TpSplit::Vocab);
        assert!(ModelTensor::RopeFactorsShort.row().vllm.is_none());
        // Every merged shard index is unique within its parameter, and the shards count from 0.
        for t in ModelTensor::ALL {
            let Some(v) = t.row().vllm else { continue };
            let shards: Vec<usize> = ModelTensor::ALL
                .into_iter()
                .filter_map(|o| o.row().vllm.filter(|w| w.param == v.param)?.merged.map(|m| m.shard))
                .collect();
            let mut sorted = shards.clone();
            sorted.sort_unstable();
            sorted.dedup();
            assert_eq!(sorted.len(), shards.len(), "{}", v.param);
            assert!(sorted.iter().enumerate().all(|(i, &s)| i == s), "{}", v.param);
        }
        // Without Lq the kv_a tensor is its own parameter; with Lq a shard of the fused one.
        let lora = cfg(Some(24), KvBLayout::Split);
        let direct = cfg(None, KvBLayout::Split);
        assert_eq!(
            ModelTensor::AttnKvAMqa.vllm_param(&lora),
            Some("self_attn.fused_qkv_a_proj.weight")
        );
        assert_eq!(
            ModelTensor::AttnKvAMqa.vllm_param(&direct),
            Some("self_attn.kv_a_proj_with_mqa.weight")
        );
        assert_eq!(
            ModelTensor::FfnGate.vllm_param(&direct),
            Some("mlp.gate_up_proj.weight")
        );
    }

    #[test]
    fn tp_splits_cut_the_ranges_vllm_cuts() {
        let c = cfg(Some(24), KvBLayout::Split);
        let d = c.dims();
        // N = 4 heads over tp = 2: two heads per rank.
        let q = TpSplit::ColumnByHeads(PerHead::QkHeadDim);
        assert_eq!(q.rank_ranges(d, &[4 * 24], 2, 1), vec![48..96]);
        let kv_b = TpSplit::ColumnByHeads(PerHead::KvBHeadDim);
        assert_eq!(kv_b.rank_ranges(d, &[4 * 28], 2, 0), vec![0..56]);
        let o = TpSplit::RowByHeads(PerHead::VHeadDim);
        assert_eq!(o.dim(), Some(1));
        assert_eq!(o.rank_ranges(d, &[4 * 12], 4, 3), vec![36..48]);
        assert_eq!(
            TpSplit::ColumnByHeads(PerHead::One).rank_ranges(d, &[4], 2, 1),
            vec![2..4]
        );
        // gate_up_proj [2F, H], F = 8, tp = 2: rank 1 holds gate rows 4..8 and up rows 12..16.
        assert_eq!(TpSplit::MergedColumn.rank_ranges(d, &[8, 8], 2, 1), vec![4..8, 12..16]);
        assert_eq!(TpSplit::Row.rank_ranges(d, &[8], 4, 2), vec![4..6]);
        assert_eq!(TpSplit::Replicated.rank_ranges(d, &[24, 40], 8, 5), vec![0..64]);
        assert_eq!(TpSplit::Replicated.dim(), None);
        assert!(TpSplit::Row.rank_ranges(d, &[8], 0, 0).is_empty());
    }

    #[test]
    fn weight_sites_name_their_tensors_for_each_layout() {
        use ModelTensor as T;
        let split = cfg(Some(24), KvBLayout::Split);
        let fused = cfg(None, KvBLayout::Fused);
        assert_eq!(site_sources(&split, Stage::WFusedQkvA), vec![T::AttnQA, T::AttnKvAMqa]);
        assert_eq!(site_sources(&fused, Stage::WFusedQkvA), vec![T::AttnKvAMqa]);
        assert_eq!(site_sources(&split, Stage::WKvB), vec![T::AttnKB, T::AttnVB]);
        assert_eq!(site_sources(&fused, Stage::WKvB), vec![T::AttnKvB]);
        assert_eq!(site_sources(&split, Stage::WUkT), vec![T::AttnKB]);
        assert_eq!(site_sources(&split, Stage::WUv), vec![T::AttnVB]);
        assert_eq!(site_sources(&fused, Stage::WUv), vec![T::AttnKvB]);
        assert_eq!(loader_sources(&split, Stage::WUkT), vec![T::AttnKB, T::AttnVB]);
        let rank = |w| Stage::WRank(w, 1);
        assert_eq!(site_sources(&split, rank(RankedWeight::QProj)), vec![T::AttnQB]);
        assert_eq!(site_sources(&fused, rank(RankedWeight::QProj)), vec![T::AttnQ]);
        assert_eq!(
            site_sources(&split, rank(RankedWeight::KvB)),
            vec![T::AttnKB, T::AttnVB]
        );
        assert_eq!(site_sources(&fused, rank(RankedWeight::OProj)), vec![T::AttnOutput]);
        assert!(site_sources(&split, Stage::KvA).is_empty());
        assert_eq!(
            site_sources(&split, rank(RankedWeight::GateUp)),
            vec![T::FfnGate, T::FfnUp, T::FfnGateShexp, T::FfnUpShexp]
        );
        assert_eq!(
            site_sources(&split, rank(RankedWeight::Down)),
            vec![T::FfnDown, T::FfnDownShexp]
        );
        // A layer holds the dense FFN or the shared experts, never both (moe-v3: layer 0 dense).
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("golden/models/moe-v3-f32.gguf");
        let moe = MlaConfig::from_gguf(&crate::model::gguf::GgufFile::open(path).unwrap()).unwrap();
        let gate_up = site_sources(&moe, rank(RankedWeight::GateUp));
        let in_layer = |l: usize| {
            gate_up
                .iter()
                .copied()
                .filter(|t| t.in_layer(&moe, l))
                .collect::<Vec<_>>()
        };
        assert_eq!(in_layer(0), vec![T::FfnGate, T::FfnUp]);
        assert_eq!(in_layer(1), vec![T::FfnGateShexp, T::FfnUpShexp]);
        assert!(T::AttnKB.in_layer(&moe, 1) && !T::FfnGateInp.in_layer(&moe, 0));
        assert_eq!(
            site_param(&split, rank(RankedWeight::QProj)),
            Some(("self_attn.q_b_proj.weight", TpSplit::ColumnByHeads(PerHead::QkHeadDim)))
        );
        assert_eq!(
            site_param(&fused, rank(RankedWeight::QProj)).map(|p| p.0),
            Some("self_attn.q_proj.weight")
        );
        assert_eq!(
            site_param(&split, Stage::WFusedQkvA),
            Some(("self_attn.fused_qkv_a_proj.weight", TpSplit::Replicated))
        );
        assert_eq!(
            site_param(&split, Stage::WUkT),
            Some(("W_UK_T", TpSplit::ColumnByHeads(PerHead::One)))
        );
        assert_eq!(site_param(&split, Stage::Q), None);
        // Every weight site the engine records is covered.
        for s in crate::core::trace::STAGES.iter().filter(|s| s.is_weight()) {
            assert!(!site_sources(&split, *s).is_empty(), "{}", s.name());
            assert!(site_param(&split, *s).is_some(), "{}", s.name());
        }
    }

    #[test]
    fn dump_params_name_what_a_weights_dump_holds() {
        let names = "fused_qkv_a_proj q_a_proj q_b_proj q_proj kv_a_proj_with_mqa kv_b_proj o_proj W_UK_T W_UV \
                     gate_up_proj gate_proj up_proj down_proj shared_experts.gate_up_proj \
                     shared_experts.gate_proj shared_experts.up_proj shared_experts.down_proj";
        assert_eq!(dump_param_names().join(" "), names);
        assert_eq!(dump_name("self_attn.kv_b_proj.weight"), "kv_b_proj");
        assert_eq!(
            dump_name("mlp.shared_experts.gate_up_proj.weight"),
            "shared_experts.gate_up_proj"
        );
        assert_eq!(dump_name("mlp.experts.w13_weight"), "experts.w13_weight");
        // One line per parameter: name, site, split, sources, merged shards.
        let lines = |c: &MlaConfig| -> Vec<String> {
            let short = |ts: &[ModelTensor]| ts.iter().map(|t| t.short()).collect::<Vec<_>>().join("+");
            let site = |s: Option<Stage>| s.map_or("-".into(), |s| s.name());
            let line = |p: DumpParam| {
                let (src, shards) = (short(&p.sources), short(&p.shards));
                format!("{} {} {} {src} [{shards}]", p.name, site(p.site), p.split)
            };
            dump_params(c).into_iter().map(line).collect()
        };
        assert_eq!(
            lines(&cfg(Some(24), KvBLayout::Split)),
            [
                "fused_qkv_a_proj w.fused_qkv_a replicated attn_q_a+attn_kv_a_mqa [attn_q_a+attn_kv_a_mqa]",
                "kv_b_proj w.kv_b column-parallel by heads (P+V rows each) attn_k_b+attn_v_b []",
                "W_UK_T w.W_UK_T column-parallel by heads (1 rows each) attn_k_b []",
                "W_UV w.W_UV column-parallel by heads (1 rows each) attn_v_b []",
                "q_b_proj w.q_b.rank0 column-parallel by heads (P+R rows each) attn_q_b []",
                "o_proj w.o_proj.rank0 row-parallel by heads (V columns each) attn_output []",
                "gate_up_proj - merged column-parallel ffn_gate+ffn_up [ffn_gate+ffn_up]",
                "down_proj - row-parallel ffn_down []",
                "shared_experts.gate_up_proj - merged column-parallel ffn_gate_shexp+ffn_up_shexp [ffn_gate_shexp+ffn_up_shexp]",
                "shared_experts.down_proj - row-parallel ffn_down_shexp []",
                "q_a_proj - replicated attn_q_a []",
                "kv_a_proj_with_mqa - replicated attn_kv_a_mqa []",
                "gate_proj - merged column-parallel ffn_gate []",
                "up_proj - merged column-parallel ffn_up []",
                "shared_experts.gate_proj - merged column-parallel ffn_gate_shexp []",
                "shared_experts.up_proj - merged column-parallel ffn_up_shexp []",
            ]
        );
        // Without Lq the attention merges nothing: kv_a_proj_with_mqa is a parameter of its own.
        assert_eq!(
            lines(&cfg(None, KvBLayout::Fused)),
            [
                "kv_a_proj_with_mqa w.fused_qkv_a replicated attn_kv_a_mqa []",
                "kv_b_proj w.kv_b column-parallel by heads (P+V rows each) attn_kv_b []",
                "W_UK_T w.W_UK_T column-parallel by heads (1 rows each) attn_kv_b []",
                "W_UV w.W_UV column-parallel by heads (1 rows each) attn_kv_b []",
                "q_proj w.q_b.rank0 column-parallel by heads (P+R rows each) attn_q []",
                "o_proj w.o_proj.rank0 row-parallel by heads (V columns each) attn_output []",
                "gate_up_proj - merged column-parallel ffn_gate+ffn_up [ffn_gate+ffn_up]",
                "down_proj - row-parallel ffn_down []",
                "shared_experts.gate_up_proj - merged column-parallel ffn_gate_shexp+ffn_up_shexp [ffn_gate_shexp+ffn_up_shexp]",
                "shared_experts.down_proj - row-parallel ffn_down_shexp []",
                "gate_proj - merged column-parallel ffn_gate []",
                "up_proj - merged column-parallel ffn_up []",
                "shared_experts.gate_proj - merged column-parallel ffn_gate_shexp []",
                "shared_experts.up_proj - merged column-parallel ffn_up_shexp []",
            ]
        );
    }

    #[test]
    fn first_sites_follow_the_data_flow() {
        use ModelTensor as T;
        let first = |t: T| t.row().first_site;
        assert_eq!(first(T::AttnQA), Some(Stage::QC));
        assert_eq!(first(T::AttnKvANorm), Some(Stage::KvCNormed));
        assert_eq!(first(T::AttnKB), Some(Stage::WKvB));
        assert_eq!(first(T::IndexerProj), Some(Stage::IdxWeights));
        assert_eq!(first(T::ExpProbsB), Some(Stage::MoeTopk));
        assert_eq!(first(T::FfnDownShexp), Some(Stage::SharedOut));
        assert_eq!(first(T::FfnNorm), Some(Stage::FfnIn));
        assert_eq!(first(T::FfnGate), Some(Stage::FfnGate));
        assert_eq!(first(T::FfnUpShexp), Some(Stage::FfnUp));
        assert_eq!(first(T::FfnDown), Some(Stage::FfnOut));
        assert_eq!(first(T::Output), None);
        // Within the attention block a later tensor never feeds an earlier site.
        let attn = [
            T::AttnNorm,
            T::AttnQA,
            T::AttnQANorm,
            T::AttnQB,
            T::AttnKvAMqa,
            T::AttnKvANorm,
            T::AttnKvB,
            T::AttnOutput,
        ];
        let order: Vec<_> = attn.iter().map(|&t| first(t).unwrap().order()).collect();
        assert!(order.windows(2).all(|w| w[0] <= w[1]), "{order:?}");
    }
}
