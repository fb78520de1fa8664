//! The fault catalogue: real MLA bugs, injectable into a path with `--inject NAME`.
//!
//! A bug finder that has never been shown a bug proves nothing. Each [`Fault`] here reproduces one
//! row of docs/faults.md *inside* a path, at the point where the real bug lived (the shard assembly,
//! the norm kernel's stride, the merge's empty-row sentinel, …), never by editing a result
//! afterwards, so that the detectors see what they would see in a broken engine. The metadata
//! here (applicability, expected class, expected first site) is what `mla-diff selftest` checks
//! the detectors against.

use serde::{Deserialize, Serialize};

use crate::compute::collective::ReduceFault;
use crate::compute::path::PathKind;
use crate::core::class::Class;
use crate::core::trace::{RankedWeight, Stage};
use crate::model::config::{KvBLayout, MlaConfig};

/// One injectable bug (docs/faults.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Fault {
    /// Attention writes into a private buffer; the caller reads its untouched output buffer.
    PhantomOutput,
    /// Rows whose context chunk has no keys are skipped (output and LSE keep the canary).
    UnwrittenRows,
    /// `fused_qkv_a_proj` assembled as `[kv_a | q_a]`.
    FusedShardSwap,
    /// TP rank shards of `q_b_proj`/`kv_b_proj` handed out in a rotated rank order.
    TpRankOrder,
    /// Every TP rank loads rank 0's shards.
    TpRank0Everywhere,
    /// Every TP rank keeps rank 0's slice of the dense MLP's merged-column `gate_up_proj`
    /// (vllm-gguf-plugin#103).
    TpGateUpRank0,
    /// `kv_b_proj` output split as `[all k_nope | all v]` instead of per head.
    KvBGrouped,
    /// `attn_k_b` ([N, L, P]) reshaped to [N, P, L] instead of transposed.
    #[serde(rename = "k-b-untransposed")]
    KBUntransposed,
    /// NeoX rotation instead of DeepSeek's interleaved rotation.
    RopeNeox,
    /// Softmax scale without the YaRN m² factor.
    NoMscale,
    /// cos/sin multiplied by m(factor, mscale_all_dim) instead of the ratio (1).
    RopeCosScaled,
    /// An empty partial reports LSE = +inf instead of −inf.
    LsePlusInf,
    /// A TP loader shards `kv_b_proj` along its input (latent) dim, off the quant blocks.
    QuantSliceMisaligned,
    /// RMSNorm reads `kv_c` rows with row stride L instead of L+R.
    StridedKvC,
    /// The DSA indexer rotates its q/k with interleaved pairs instead of NeoX halves (the
    /// DeepSeek-V3.2 indexer bug; `deepseek32` only).
    IndexerRopeInterleaved,
    /// Chunked prefill reuses the previous chunk's indexer top-k for the new tokens.
    IndexerTopkStale,
    /// The `o_proj` all-reduce runs a second time on its own output: every rank holds tp × the
    /// sum.
    AllReduceTwice,
    /// The last TP rank skips the `o_proj` all-reduce: its partial is summed as zero.
    AllReduceSkipRank,
    /// TP rank 0 reads its `o_proj` output before the all-reduce finished: it still holds its
    /// own partial.
    AllReduceReadEarly,
    /// The attention op's result never reaches the caller's output buffer, which holds the
    /// stale finite floats the allocator handed out (`torch.empty`), not the canary.
    PhantomOutputStale,
    /// The latent RMSNorm (`kv_a_layernorm`) is not applied: `kv_c_normed` is `kv_a`'s latent
    /// columns as they are.
    KvNormSkipped,
    /// The split-KV decode's split LSEs are in base 2 and merged by the natural-log rule
    /// (sglang#40903).
    SplitLseBase2,
    /// The split-KV decode's merge leaves out each row's last split.
    SplitDropped,
    /// The split-KV decode's merge counts each row's first split twice.
    SplitDuplicated,
    /// The split-KV decode merges each empty split as if it had keys, from a zero-filled partial
    /// buffer: LSE 0, output 0.
    SplitEmptyZero,
    /// The split-KV decode merges each empty split as if it had keys, with the stale finite LSE
    /// and output its partial buffer held (flashinfer#3047).
    SplitEmptyFinite,
    /// A dense layer's residual add scales the residual: `h1 = α·hidden_in + o_proj` with α =
    /// 1/routed_scaling_factor, or 0.4 for a model without one (vLLM PR #14809).
    ResidualScaled,
    /// The absorbed path's `ql_nope = q_nope·W_UK_T` computed with f16 operands and an f16
    /// accumulator in an f32 run (llama.cpp PR #13137).
    Fp16AccumQlNope,
    /// The attention reads the paged latent cache with page size 1 (the block table's ids as
    /// token slots) while the cache was written with the engine's page size (ROCm AITER #2996).
    PagedKvPageSize,
    /// The attention reads each sequence's block table one entry further on (the entry past the
    /// end reads block 0, the table's padding).
    PagedKvBlockOffset,
    /// `concat_and_cache_mla` writes each new latent row one slot early (the previous token's
    /// slot; slot 0's row is dropped).
    SlotMappingOffset,
    /// `k_pe` is cut out of `kv_a` with `kv_c`'s row stride L instead of `kv_a`'s L+R.
    KPeStride,
    /// The loader builds `kv_b_proj` per head as `[v_h | k_nope_h]` instead of
    /// `[k_nope_h | v_h]` (when P = V the shapes agree).
    KvBHalvesSwapped,
    /// The loader concatenates `kv_b_proj`'s heads interleaved by 2 (head order 0, nh/2, 1,
    /// nh/2+1, … within each rank).
    KvBHeadsInterleaved,
    /// The MLA input's per-tensor fp8 scale is taken over the engine's padded batch: rows past
    /// the last token hold stale values (SGLang PR #26133). Needs `--fp8-compute tensor`.
    Fp8ScalePaddedRows,
    /// The fp8 latent cache's scale is applied twice where rows are written
    /// (`e4m3(x/k_scale²)` stored, read back × k_scale): the cache reads back 1/k_scale × what
    /// was written. Needs `--kv-cache-dtype fp8 --kv-scale S` with S ≠ 1.
    KvCacheScaleTwice,
    /// The loader dequantizes `o_proj`'s fp8 weight with its `weight_scale_inv` grid transposed
    /// and reshaped to the grid's own shape (`s.t().contiguous().view(s.shape)`): every 128 × 128
    /// block gets another block's scale. Needs an fp8 block-scaled checkpoint.
    Fp8ScaleTransposed,
    /// The decode query reaches a kernel that takes an fp8 query unscaled (cast to E4M3
    /// without the division by q_scale, or not quantized at all) while the kernel multiplies
    /// by q_scale: each decode row's logits × q_scale. Needs `--fp8-query --q-scale Q`, Q ≠ 1.
    Fp8QueryUnscaled,
    /// Under TP, every rank dequantizes its `o_proj` shard (its heads' input columns) with rank
    /// 0's columns of the `weight_scale_inv` grid: the scale shard cut at offset 0 instead of the
    /// rank's. Needs `--tp ≥ 2` and an fp8 block-scaled checkpoint.
    Fp8ScaleShardRank0,
}

impl Fault {
    /// Every fault, in the order of docs/faults.md.
    pub const ALL: &'static [Fault] = &[
        Fault::PhantomOutput,
        Fault::UnwrittenRows,
        Fault::FusedShardSwap,
        Fault::TpRankOrder,
        Fault::TpRank0Everywhere,
        Fault::TpGateUpRank0,
        Fault::KvBGrouped,
        Fault::KBUntransposed,
        Fault::RopeNeox,
        Fault::NoMscale,
        Fault::RopeCosScaled,
        Fault::LsePlusInf,
        Fault::QuantSliceMisaligned,
        Fault::StridedKvC,
        Fault::IndexerRopeInterleaved,
        Fault::IndexerTopkStale,
        Fault::AllReduceTwice,
        Fault::AllReduceSkipRank,
        Fault::AllReduceReadEarly,
        Fault::PhantomOutputStale,
        Fault::KvNormSkipped,
        Fault::SplitLseBase2,
        Fault::SplitDropped,
        Fault::SplitDuplicated,
        Fault::SplitEmptyZero,
        Fault::SplitEmptyFinite,
        Fault::ResidualScaled,
        Fault::Fp16AccumQlNope,
        Fault::PagedKvPageSize,
        Fault::PagedKvBlockOffset,
        Fault::SlotMappingOffset,
        Fault::KPeStride,
        Fault::KvBHalvesSwapped,
        Fault::KvBHeadsInterleaved,
        Fault::Fp8ScalePaddedRows,
        Fault::KvCacheScaleTwice,
        Fault::Fp8ScaleTransposed,
        Fault::Fp8QueryUnscaled,
        Fault::Fp8ScaleShardRank0,
    ];

    /// The `--inject` name (`fused-shard-swap`).
    pub fn name(self) -> &'static str {
        match self {
            Fault::PhantomOutput => "phantom-output",
            Fault::UnwrittenRows => "unwritten-rows",
            Fault::FusedShardSwap => "fused-shard-swap",
            Fault::TpRankOrder => "tp-rank-order",
            Fault::TpRank0Everywhere => "tp-rank0-everywhere",
            Fault::TpGateUpRank0 => "tp-gate-up-rank0",
            Fault::KvBGrouped => "kv-b-grouped",
            Fault::KBUntransposed => "k-b-untransposed",
            Fault::RopeNeox => "rope-neox",
            Fault::NoMscale => "no-mscale",
            Fault::RopeCosScaled => "rope-cos-scaled",
            Fault::LsePlusInf => "lse-plus-inf",
            Fault::QuantSliceMisaligned => "quant-slice-misaligned",
            Fault::StridedKvC => "strided-kv-c",
            Fault::IndexerRopeInterleaved => "indexer-rope-interleaved",
            Fault::IndexerTopkStale => "indexer-topk-stale",
            Fault::AllReduceTwice => "all-reduce-twice",
            Fault::AllReduceSkipRank => "all-reduce-skip-rank",
            Fault::AllReduceReadEarly => "all-reduce-read-early",
            Fault::PhantomOutputStale => "phantom-output-stale",
            Fault::KvNormSkipped => "kv-norm-skipped",
            Fault::SplitLseBase2 => "split-lse-base2",
            Fault::SplitDropped => "split-dropped",
            Fault::SplitDuplicated => "split-duplicated",
            Fault::SplitEmptyZero => "split-empty-zero",
            Fault::SplitEmptyFinite => "split-empty-finite",
            Fault::ResidualScaled => "residual-scaled",
            Fault::Fp16AccumQlNope => "fp16-accum-ql-nope",
            Fault::PagedKvPageSize => "paged-kv-page-size",
            Fault::PagedKvBlockOffset => "paged-kv-block-offset",
            Fault::SlotMappingOffset => "slot-mapping-offset",
            Fault::KPeStride => "k-pe-stride",
            Fault::KvBHalvesSwapped => "kv-b-halves-swapped",
            Fault::KvBHeadsInterleaved => "kv-b-heads-interleaved",
            Fault::Fp8ScalePaddedRows => "fp8-scale-padded-rows",
            Fault::KvCacheScaleTwice => "kv-cache-scale-twice",
            Fault::Fp8ScaleTransposed => "fp8-scale-transposed",
            Fault::Fp8QueryUnscaled => "fp8-query-unscaled",
            Fault::Fp8ScaleShardRank0 => "fp8-scale-shard-rank0",
        }
    }

    /// One line on what the fault does (the help beside `--inject NAME`).
    pub fn summary(self) -> &'static str {
        match self {
            Fault::PhantomOutput => {
                "Attention writes into a private buffer; the caller reads its untouched output buffer"
            }
            Fault::UnwrittenRows => "Rows whose context chunk has no keys are skipped (output and LSE keep the canary)",
            Fault::FusedShardSwap => "`fused_qkv_a_proj` assembled as `[kv_a | q_a]`",
            Fault::TpRankOrder => "TP rank shards of `q_b_proj`/`kv_b_proj` handed out in a rotated rank order",
            Fault::TpRank0Everywhere => "Every TP rank loads rank 0's shards",
            Fault::TpGateUpRank0 => {
                "Every TP rank keeps rank 0's slice of the dense MLP's merged-column `gate_up_proj` (vllm-gguf-plugin#103)"
            }
            Fault::KvBGrouped => "`kv_b_proj` output split as `[all k_nope | all v]` instead of per head",
            Fault::KBUntransposed => "`attn_k_b` ([N, L, P]) reshaped to [N, P, L] instead of transposed",
            Fault::RopeNeox => "NeoX rotation instead of DeepSeek's interleaved rotation",
            Fault::NoMscale => "Softmax scale without the YaRN m² factor",
            Fault::RopeCosScaled => "cos/sin multiplied by m(factor, mscale_all_dim) instead of the ratio (1)",
            Fault::LsePlusInf => "An empty partial reports LSE = +inf instead of −inf",
            Fault::QuantSliceMisaligned => {
                "A TP loader shards `kv_b_proj` along its input (latent) dim, off the quant blocks"
            }
            Fault::StridedKvC => "RMSNorm reads `kv_c` rows with row stride L instead of L+R",
            Fault::IndexerRopeInterleaved => {
                "The DSA indexer rotates its q/k with interleaved pairs instead of NeoX halves (the DeepSeek-V3.2 indexer bug; `deepseek32` only)"
            }
            Fault::IndexerTopkStale => "Chunked prefill reuses the previous chunk's indexer top-k for the new tokens",
            Fault::AllReduceTwice => {
                "The `o_proj` all-reduce runs a second time on its own output: every rank holds tp × the sum"
            }
            Fault::AllReduceSkipRank => "The last TP rank skips the `o_proj` all-reduce: its partial is summed as zero",
            Fault::AllReduceReadEarly => {
                "TP rank 0 reads its `o_proj` output before the all-reduce finished: it still holds its own partial"
            }
            Fault::PhantomOutputStale => {
                "The attention op's result never reaches the caller's output buffer, which holds the stale finite floats the allocator handed out (`torch.empty`), not the canary"
            }
            Fault::KvNormSkipped => {
                "The latent RMSNorm (`kv_a_layernorm`) is not applied: `kv_c_normed` is `kv_a`'s latent columns as they are"
            }
            Fault::SplitLseBase2 => {
                "The split-KV decode's split LSEs are in base 2 and merged by the natural-log rule (sglang#40903)"
            }
            Fault::SplitDropped => "The split-KV decode's merge leaves out each row's last split",
            Fault::SplitDuplicated => "The split-KV decode's merge counts each row's first split twice",
            Fault::SplitEmptyZero => {
                "The split-KV decode merges each empty split as if it had keys, from a zero-filled partial buffer: LSE 0, output 0"
            }
            Fault::SplitEmptyFinite => {
                "The split-KV decode merges each empty split as if it had keys, with the stale finite LSE and output its partial buffer held (flashinfer#3047)"
            }
            Fault::ResidualScaled => {
                "A dense layer's residual add scales the residual: `h1 = α·hidden_in + o_proj` with α = 1/routed_scaling_factor, or 0.4 for a model without one (vLLM PR #14809)"
            }
            Fault::Fp16AccumQlNope => {
                "The absorbed path's `ql_nope = q_nope·W_UK_T` computed with f16 operands and an f16 accumulator in an f32 run (llama.cpp PR #13137)"
            }
            Fault::PagedKvPageSize => {
                "The attention reads the paged latent cache with page size 1 (the block table's ids as token slots) while the cache was written with the engine's page size (ROCm AITER #2996)"
            }
            Fault::PagedKvBlockOffset => {
                "The attention reads each sequence's block table one entry further on (the entry past the end reads block 0, the table's padding)"
            }
            Fault::SlotMappingOffset => {
                "`concat_and_cache_mla` writes each new latent row one slot early (the previous token's slot; slot 0's row is dropped)"
            }
            Fault::KPeStride => "`k_pe` is cut out of `kv_a` with `kv_c`'s row stride L instead of `kv_a`'s L+R",
            Fault::KvBHalvesSwapped => {
                "The loader builds `kv_b_proj` per head as `[v_h | k_nope_h]` instead of `[k_nope_h | v_h]` (when P = V the shapes agree)"
            }
            Fault::KvBHeadsInterleaved => {
                "The loader concatenates `kv_b_proj`'s heads interleaved by 2 (head order 0, nh/2, 1, nh/2+1, … within each rank)"
            }
            Fault::Fp8ScalePaddedRows => {
                "The MLA input's per-tensor fp8 scale is taken over the engine's padded batch, whose rows past the last token hold stale values (SGLang PR #26133; needs --fp8-compute tensor)"
            }
            Fault::KvCacheScaleTwice => {
                "The fp8 latent cache's scale is applied twice where rows are written (x/k_scale² stored, read back × k_scale; needs --kv-cache-dtype fp8 --kv-scale S, S ≠ 1)"
            }
            Fault::Fp8ScaleTransposed => {
                "The loader dequantizes o_proj's fp8 weight with its weight_scale_inv grid transposed and reshaped to the grid's shape (s.t().contiguous().view(s.shape); needs an fp8 block-scaled checkpoint)"
            }
            Fault::Fp8ScaleShardRank0 => {
                "Under TP, every rank dequantizes its o_proj shard with rank 0's columns of the weight_scale_inv grid (needs --tp ≥ 2 and an fp8 block-scaled checkpoint)"
            }
            Fault::Fp8QueryUnscaled => {
                "The decode query reaches the fp8 kernel unscaled (cast without ÷q_scale) while the kernel multiplies by q_scale: decode logits × q_scale (needs --fp8-query --q-scale Q, Q ≠ 1)"
            }
        }
    }

    /// The class the detectors must name (docs/faults.md, "expected class").
    pub fn expected_class(self) -> Class {
        match self {
            Fault::PhantomOutput => Class::PhantomOutput,
            Fault::UnwrittenRows => Class::UnwrittenRows,
            Fault::FusedShardSwap => Class::ShardOrder,
            Fault::TpRankOrder | Fault::TpRank0Everywhere | Fault::TpGateUpRank0 => Class::TpRankOrder,
            Fault::KvBGrouped | Fault::KBUntransposed => Class::KvBLayout,
            Fault::RopeNeox => Class::RopeStyle,
            Fault::NoMscale => Class::SoftmaxScale,
            Fault::RopeCosScaled => Class::ScaleOnly,
            Fault::LsePlusInf => Class::LseMerge,
            Fault::QuantSliceMisaligned => Class::QuantBlockMisaligned,
            Fault::StridedKvC | Fault::KPeStride => Class::StridedView,
            Fault::IndexerRopeInterleaved => Class::IndexerRopeStyle,
            Fault::IndexerTopkStale => Class::IndexerTopkStale,
            Fault::AllReduceTwice => Class::ScaleOnly,
            Fault::AllReduceSkipRank | Fault::AllReduceReadEarly => Class::TpReduce,
            Fault::PhantomOutputStale => Class::PhantomOutput,
            Fault::KvNormSkipped => Class::NormSkipped,
            Fault::SplitLseBase2
            | Fault::SplitDropped
            | Fault::SplitDuplicated
            | Fault::SplitEmptyZero
            | Fault::SplitEmptyFinite => Class::LseMerge,
            Fault::ResidualScaled => Class::ResidualScale,
            Fault::Fp16AccumQlNope => Class::Precision,
            Fault::PagedKvPageSize | Fault::PagedKvBlockOffset | Fault::SlotMappingOffset => Class::PagedKv,
            Fault::KvBHalvesSwapped | Fault::KvBHeadsInterleaved => Class::KvBLayout,
            Fault::Fp8ScalePaddedRows => Class::Fp8ActScale,
            Fault::KvCacheScaleTwice => Class::KvCacheScale,
            Fault::Fp8ScaleTransposed | Fault::Fp8ScaleShardRank0 => Class::QuantScaleLayout,
            Fault::Fp8QueryUnscaled => Class::SoftmaxScale,
        }
    }

    /// The first site that must flag on `path` (docs/faults.md, "first site"), as stages that are
    /// accepted (the first accepted stage is the canonical one).
    pub fn expected_stages(self, path: PathKind) -> Vec<Stage> {
        use PathKind::*;
        match (self, path) {
            (Fault::PhantomOutput, _) => vec![Stage::AttnOut],
            (Fault::UnwrittenRows, _) => vec![Stage::Lse, Stage::AttnOut],
            (Fault::FusedShardSwap, _) => vec![Stage::WFusedQkvA],
            (Fault::TpRankOrder, _) => vec![Stage::WRank(RankedWeight::QProj, 0)],
            (Fault::TpRank0Everywhere, _) => vec![Stage::WRank(RankedWeight::QProj, 1)],
            (Fault::TpGateUpRank0, _) => vec![Stage::WRank(RankedWeight::GateUp, 1)],
            (Fault::KvBGrouped, Mqa) => vec![Stage::WUkT],
            (Fault::KvBGrouped, _) => vec![Stage::KNope],
            (Fault::KBUntransposed, Mqa) => vec![Stage::WUkT],
            (Fault::KBUntransposed, _) => vec![Stage::WKvB],
            (Fault::RopeNeox, _) => vec![Stage::QPeRoped],
            (Fault::NoMscale, Mqa) => vec![Stage::AttnLatent],
            (Fault::NoMscale, _) => vec![Stage::Lse],
            (Fault::RopeCosScaled, _) => vec![Stage::QPeRoped],
            (Fault::LsePlusInf, Mqa) => vec![Stage::AttnLatent],
            (Fault::LsePlusInf, _) => vec![Stage::Lse],
            (Fault::QuantSliceMisaligned, _) => vec![Stage::WKvB],
            (Fault::StridedKvC, _) => vec![Stage::KvCNormed],
            (Fault::IndexerRopeInterleaved, _) => vec![Stage::IdxScores],
            (Fault::IndexerTopkStale, _) => vec![Stage::IdxTopk],
            (Fault::AllReduceTwice | Fault::AllReduceSkipRank | Fault::AllReduceReadEarly, _) => vec![Stage::OProj],
            (Fault::PhantomOutputStale, _) => vec![Stage::AttnOut],
            (Fault::KvNormSkipped, _) => vec![Stage::KvCNormed],
            (Fault::PagedKvPageSize | Fault::PagedKvBlockOffset | Fault::SlotMappingOffset, Mqa) => {
                vec![Stage::AttnLatent]
            }
            (Fault::PagedKvPageSize | Fault::PagedKvBlockOffset | Fault::SlotMappingOffset, _) => {
                vec![Stage::Lse, Stage::AttnOut]
            }
            (Fault::KPeStride, _) => vec![Stage::KPe],
            (Fault::KvBHalvesSwapped | Fault::KvBHeadsInterleaved, Mqa) => vec![Stage::WUkT],
            (Fault::KvBHalvesSwapped | Fault::KvBHeadsInterleaved, _) => vec![Stage::WKvB],
            (f, Mqa) if f.is_split_merge() => vec![Stage::AttnLatent, Stage::Lse],
            (f, _) if f.is_split_merge() => vec![Stage::Lse, Stage::AttnOut],
            (Fault::ResidualScaled, _) => vec![Stage::FfnIn, Stage::HiddenOut],
            (Fault::Fp16AccumQlNope, _) => vec![Stage::QlNope],
            (Fault::Fp8ScalePaddedRows, _) => vec![Stage::QC],
            (Fault::KvCacheScaleTwice, Mqa) => vec![Stage::AttnLatent],
            (Fault::KvCacheScaleTwice, _) => vec![Stage::Lse, Stage::AttnOut],
            (Fault::Fp8ScaleTransposed, _) => vec![Stage::OProj],
            (Fault::Fp8ScaleShardRank0, _) => vec![Stage::WRank(RankedWeight::OProj, 1), Stage::OProj],
            (Fault::Fp8QueryUnscaled, Mqa) => vec![Stage::AttnLatent],
            (Fault::Fp8QueryUnscaled, _) => vec![Stage::Lse, Stage::AttnOut],
            _ => Vec::new(),
        }
    }

    /// Whether the fault can act on `path` for this model and TP size (and why not).
    /// `latent_block` is the quant block size of the tensor whose rows run along the latent
    /// dim L (`attn_v_b`, or legacy `attn_kv_b`): 1 for unquantized files.
    pub fn applies(self, path: PathKind, cfg: &MlaConfig, tp: usize, latent_block: u64) -> Result<(), &'static str> {
        match self {
            Fault::UnwrittenRows if path != PathKind::Chunked => Err("only chunked prefill has context chunks"),
            Fault::FusedShardSwap if cfg.q_lora_rank.is_none() => Err("no q_lora_rank: no fused_qkv_a_proj"),
            Fault::TpRankOrder
            | Fault::TpRank0Everywhere
            | Fault::TpGateUpRank0
            | Fault::AllReduceTwice
            | Fault::AllReduceSkipRank
            | Fault::AllReduceReadEarly
                if tp < 2 =>
            {
                Err("needs --tp ≥ 2")
            }
            Fault::KBUntransposed if cfg.kv_b_layout != KvBLayout::Split => {
                Err("legacy attn_kv_b: nothing to transpose")
            }
            Fault::NoMscale | Fault::RopeCosScaled if cfg.yarn.is_none() => Err("needs a YaRN model"),
            Fault::LsePlusInf if !matches!(path, PathKind::Chunked | PathKind::Mqa) => {
                Err("only chunked prefill and split-KV decode merge partials")
            }
            Fault::QuantSliceMisaligned | Fault::Fp8ScaleShardRank0 if tp < 2 => Err("needs --tp ≥ 2"),
            Fault::QuantSliceMisaligned if ((cfg.kv_lora_rank / tp) as u64).is_multiple_of(latent_block) => {
                Err("a cut of L into TP shards lands on quant block boundaries here")
            }
            Fault::IndexerRopeInterleaved | Fault::IndexerTopkStale if cfg.indexer.is_none() => {
                Err("no DSA indexer (deepseek32 / glm-dsa only)")
            }
            Fault::IndexerRopeInterleaved
                if cfg
                    .indexer
                    .as_ref()
                    .is_some_and(|ix| ix.rope_style != crate::model::config::RopeStyle::Neox) =>
            {
                Err("this indexer's RoPE is interleaved already (glm-dsa)")
            }
            Fault::IndexerTopkStale if path != PathKind::Chunked => Err("only chunked prefill has a previous chunk"),
            Fault::Fp16AccumQlNope if path != PathKind::Mqa => Err("only the absorbed path records ql_nope"),
            f if f.is_split_merge() && !matches!(path, PathKind::Mqa | PathKind::Mixed) => {
                Err("only the split-KV decode (mqa, mixed's decode rows) merges KV splits")
            }
            Fault::PagedKvPageSize | Fault::PagedKvBlockOffset | Fault::SlotMappingOffset if path == PathKind::Mha => {
                Err("mha attends over its own K/V: no paged cache")
            }
            Fault::PagedKvPageSize | Fault::PagedKvBlockOffset | Fault::SlotMappingOffset if cfg.indexer.is_some() => {
                Err(
                    "a DSA layer reads the indexer's kept keys through a compact cache: the paged-cache faults act on dense attention",
                )
            }
            Fault::KvBHalvesSwapped if cfg.qk_nope_head_dim != cfg.v_head_dim => {
                Err("needs P = V (qk_nope_head_dim = v_head_dim): the halves are swapped where their shapes agree")
            }
            Fault::KvBHeadsInterleaved if cfg.n_head / tp.max(1) < 4 || !(cfg.n_head / tp.max(1)).is_multiple_of(2) => {
                Err("needs an even number of heads per rank, at least 4 (with 2 the interleave is the identity)")
            }
            Fault::Fp8ScalePaddedRows if path == PathKind::Chunked => Err(
                "per-tensor fp8 scales (--fp8-compute tensor) do not judge the chunked path, whose context chunks each get their own",
            ),
            Fault::KvCacheScaleTwice if path == PathKind::Mha => Err("mha attends over its own K/V: no paged cache"),
            Fault::Fp8QueryUnscaled if !matches!(path, PathKind::Mqa | PathKind::Mixed) => {
                Err("only the absorbed decode (mqa, mixed's decode rows) has a decode query")
            }
            Fault::Fp8QueryUnscaled if cfg.indexer.is_some() => {
                Err("a DSA layer decodes over the indexer's kept keys, where the reference does not score an fp8 query")
            }
            Fault::KvCacheScaleTwice if cfg.indexer.is_some() => {
                Err("a DSA layer reads the indexer's kept keys: the cache replay acts on dense attention")
            }
            Fault::Fp8ScalePaddedRows if cfg.q_lora_rank.is_none() => Err(
                "no q_lora_rank: the fused q_a/kv_a projection whose input it quantizes is what the detector replays",
            ),
            _ => Ok(()),
        }
    }
}

impl Fault {
    /// Whether the fault can show in a run of paths computing in `dtype`: `fp16-accum-ql-nope`
    /// needs an f32 run (an f16 accumulator's error is within a bf16 run's own rounding, so a
    /// bf16 run cannot tell it from right). Every other fault: `Ok`.
    pub fn applies_to_dtype(self, dtype: crate::core::dtype::Dtype) -> Result<(), &'static str> {
        match (self, dtype) {
            (Fault::Fp16AccumQlNope, crate::core::dtype::Dtype::Bf16) => {
                Err("an f16 accumulator's error is within a bf16 run's own rounding: needs --dtype f32")
            }
            _ => Ok(()),
        }
    }

    /// Whether the fault can act under the run's fp8 compute `fp8` (`PathOptions::fp8`) and
    /// latent cache `kv_cache` (`PathOptions::kv_cache`): `fp8-scale-padded-rows` needs
    /// per-tensor scales (`--fp8-compute tensor`; a per-token scale never sees another row),
    /// `kv-cache-scale-twice` an fp8 cache whose scale is not 1 (applied twice, 1 is still 1).
    /// Every other fault: `Ok`.
    pub fn applies_to_fp8(
        self,
        fp8: Option<&crate::core::fp8::ActQuant>,
        kv_cache: Option<&crate::core::fp8::KvCacheQuant>,
    ) -> Result<(), &'static str> {
        use crate::core::fp8::ActGranularity;
        match (self, fp8.map(|a| a.granularity)) {
            (Fault::Fp8ScalePaddedRows, Some(ActGranularity::Tensor)) => Ok(()),
            (Fault::Fp8ScalePaddedRows, _) => Err(
                "needs --fp8-compute tensor (one dynamic scale over the input: a per-token scale never sees the padding)",
            ),
            (Fault::KvCacheScaleTwice, _) if kv_cache.is_none_or(|k| k.scale == 1.0) => Err(
                "needs an fp8 latent cache with a k_scale other than 1 (--kv-cache-dtype fp8 --kv-scale S, S ≠ 1): a scale of 1 applied twice is still 1",
            ),
            (Fault::Fp8QueryUnscaled, _) if kv_cache.and_then(|k| k.query).is_none_or(|q| q == 1.0) => Err(
                "needs an fp8 decode query with a q_scale other than 1 (--kv-cache-dtype fp8 --fp8-query --q-scale Q, Q ≠ 1): an unscaled query is right when q_scale is 1",
            ),
            _ => Ok(()),
        }
    }

    /// Whether the fault can act on layer `layer` of the model `file` at TP size `tp`, beyond
    /// [`Fault::applies`]: `fp8-scale-transposed` needs `o_proj` stored with a block-scale grid
    /// (an fp8 checkpoint's `weight_scale_inv`) that its transposed-and-reshaped read changes (at
    /// least two blocks each way, not all scales equal); `fp8-scale-shard-rank0` such a grid
    /// whose rank shards (N·V/tp columns, on block boundaries) hold other scales than rank 0's.
    /// Every other fault: `Ok`.
    pub fn applies_to_model(
        self,
        file: &crate::model::gguf::GgufFile,
        layer: usize,
        tp: usize,
    ) -> Result<(), &'static str> {
        // Without TP, `applies` gives the reason ("needs --tp ≥ 2").
        if !matches!(self, Fault::Fp8ScaleTransposed | Fault::Fp8ScaleShardRank0)
            || (self == Fault::Fp8ScaleShardRank0 && tp < 2)
        {
            return Ok(());
        }
        let name = crate::model::tensors::ModelTensor::AttnOutput.name(layer);
        let Some(g) = file.tensor(&name).and_then(|t| file.block_scales(t)) else {
            return Err("needs o_proj stored in fp8 with block scales (a Hugging Face fp8 checkpoint as the model)");
        };
        let changed = match self {
            Fault::Fp8ScaleTransposed => transposed_view(&g).is_some_and(|t| t != g.scale),
            _ => rank0_scale_view(&g, tp).is_some_and(|t| t != g.scale),
        };
        match (changed, self) {
            (true, _) => Ok(()),
            (false, Fault::Fp8ScaleTransposed) => Err(
                "o_proj's scale grid reads the same transposed and reshaped (one block row or column, or equal scales)",
            ),
            (false, _) => {
                Err("o_proj's rank shards do not fall on scale-block boundaries, or every rank's scales equal rank 0's")
            }
        }
    }

    /// The latent cache a selftest case of the fault runs with: an fp8 cache with k_scale 0.5
    /// for `kv-cache-scale-twice`, an fp8 cache (k_scale 1) and an fp8 decode query with
    /// q_scale 2 for `fp8-query-unscaled`, none for every other fault.
    pub fn selftest_kv_cache(self, dtype: crate::core::dtype::Dtype) -> Option<crate::core::fp8::KvCacheQuant> {
        use crate::core::fp8::{InputDtype, KvCacheQuant};
        let input = match dtype {
            crate::core::dtype::Dtype::F32 => InputDtype::F32,
            crate::core::dtype::Dtype::Bf16 => InputDtype::Bf16,
        };
        match self {
            Fault::KvCacheScaleTwice => Some(KvCacheQuant {
                scale: 0.5,
                input: Some(input),
                query: None,
            }),
            Fault::Fp8QueryUnscaled => Some(KvCacheQuant {
                scale: 1.0,
                input: Some(input),
                query: Some(2.0),
            }),
            _ => None,
        }
    }

    /// The fp8 compute a selftest case of the fault runs with: per-tensor scales for
    /// `fp8-scale-padded-rows`, none for every other fault.
    pub fn selftest_fp8(self, dtype: crate::core::dtype::Dtype) -> Option<crate::core::fp8::ActQuant> {
        use crate::core::fp8::{ActQuant, InputDtype};
        let input = match dtype {
            crate::core::dtype::Dtype::F32 => InputDtype::F32,
            crate::core::dtype::Dtype::Bf16 => InputDtype::Bf16,
        };
        (self == Fault::Fp8ScalePaddedRows).then_some(ActQuant::tensor(Some(input)))
    }

    /// Whether the fault acts on the split-KV decode's merge of its KV splits (the `split-*`
    /// faults, [`SplitFault`]).
    pub fn is_split_merge(self) -> bool {
        self.split_fault().is_some()
    }

    /// The split-merge bug this fault injects, if it is one of the `split-*` faults.
    pub fn split_fault(self) -> Option<SplitFault> {
        match self {
            Fault::SplitLseBase2 => Some(SplitFault::LseBase2),
            Fault::SplitDropped => Some(SplitFault::DropLast),
            Fault::SplitDuplicated => Some(SplitFault::DuplicateFirst),
            Fault::SplitEmptyZero => Some(SplitFault::EmptyZero),
            Fault::SplitEmptyFinite => Some(SplitFault::EmptyStale),
            _ => None,
        }
    }

    /// Whether the fault can act on layer `w`, beyond [`Fault::applies`]: `tp-gate-up-rank0`
    /// needs a dense MLP whose width divides by `tp` (an MoE layer's engine paths stop at
    /// `o_proj`; an MLP the ranks cannot share runs unsplit), `residual-scaled` a dense MLP (the
    /// residual add it scales is the MLP block's). Every other fault: `Ok`.
    pub fn applies_to_layer(self, w: &crate::model::weights::LayerWeights, tp: usize) -> Result<(), &'static str> {
        match (self, &w.ffn) {
            (Fault::TpGateUpRank0 | Fault::ResidualScaled, None) => Err("the layer has no dense MLP"),
            (Fault::TpGateUpRank0, Some(f)) if !f.gate.nrows().is_multiple_of(tp.max(1)) => {
                Err("the MLP width does not divide by the TP size")
            }
            _ => Ok(()),
        }
    }
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The rows an engine's CUDA-graph batch of `t` tokens is padded to: vLLM's capture sizes 1, 2, 4
/// and every multiple of 8 up to 512 (`cudagraph_capture_sizes`), the smallest at least `t`;
/// beyond 512 a batch runs eagerly, unpadded (`t`).
pub fn padded_rows(t: usize) -> usize {
    match t {
        0..=2 => t,
        3..=4 => 4,
        5..=512 => t.div_ceil(8) * 8,
        _ => t,
    }
}

/// The scale grid `g` as `fp8-scale-transposed`'s loader reads it, row-major in `g.grid`:
/// `s.t().contiguous().view(s.shape)`, so flat position `k` holds `s[k % rows, k / rows]`.
/// `None` when the grid holds fewer scales than its shape says.
pub fn transposed_view(g: &crate::model::gguf::BlockScales) -> Option<Vec<f32>> {
    let [gr, gc] = g.grid;
    (g.scale.len() == gr * gc).then(|| (0..gr * gc).map(|k| g.scale[(k % gr) * gc + k / gr]).collect())
}

/// The scale grid `g` of a row-parallel matrix (`o_proj`: its input columns cut into `tp`
/// equal rank shards) as `fp8-scale-shard-rank0`'s ranks read it, row-major in `g.grid`: each
/// rank's columns hold rank 0's columns, `s[i, j mod (cols/tp)]`. `None` when `tp < 2` or the
/// shards do not cover whole block columns.
pub fn rank0_scale_view(g: &crate::model::gguf::BlockScales, tp: usize) -> Option<Vec<f32>> {
    let [gr, gc] = g.grid;
    let per = gc.checked_div(tp)?;
    (tp >= 2
        && per > 0
        && gc.is_multiple_of(tp)
        && g.shape[1].is_multiple_of(tp)
        && (g.shape[1] / tp).is_multiple_of(g.block[1])
        && g.scale.len() == gr * gc)
        .then(|| (0..gr * gc).map(|k| g.scale[(k / gc) * gc + (k % gc) % per]).collect())
}

/// How far above the batch's largest |value| the stale rows of `fp8-scale-padded-rows` reach:
/// memory a padded row never had written holds whatever a kernel left there, often another
/// tensor's floats orders of magnitude away (a residual stream before its norm) or garbage bits.
/// E4M3's normal range spans 2^15, so a scale 1024× too large still keeps every value within
/// 1/28 of the largest at full precision and the bug hides in the rounding; at 2^16 every value
/// of the batch lands among E4M3's subnormals (at most 448/65536 = 0.0068 after scaling, four
/// steps of 2^-9), as with the huge stale values behind SGLang PR #26133's gibberish.
pub const STALE_ROW_FACTOR: f64 = 65536.0;

/// What a `split-*` fault does to the split-KV decode's merge (`compute::engine`, after stage 1
/// wrote each split's partial output and LSE).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SplitFault {
    /// Every split's LSE multiplied by log2(e) (a base-2 LSE) before the natural-log merge.
    LseBase2,
    /// The last split's partial left out of the merge.
    DropLast,
    /// The first split's partial merged twice.
    DuplicateFirst,
    /// Every empty split merged with LSE 0 and a zero output.
    EmptyZero,
    /// Every empty split merged with stale finite floats as its LSE and output.
    EmptyStale,
}

/// The set of faults injected into a run.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FaultSet(pub Vec<Fault>);

impl FaultSet {
    /// True when `f` is injected.
    pub fn has(&self, f: Fault) -> bool {
        self.0.contains(&f)
    }

    /// True when nothing is injected.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The factor `residual-scaled` puts on a dense layer's residual: 1/routed_scaling_factor,
    /// or 0.4 for a model without one; 1 without the fault.
    pub fn residual_alpha(&self, cfg: &MlaConfig) -> f64 {
        if !self.has(Fault::ResidualScaled) {
            return 1.0;
        }
        cfg.moe
            .as_ref()
            .map(|m| m.weights_scale)
            .filter(|&f| f > 0.0 && f != 1.0)
            .map_or(0.4, |f| 1.0 / f)
    }

    /// The split-merge bug of the first `split-*` fault injected, if any.
    pub fn split_fault(&self) -> Option<SplitFault> {
        self.0.iter().find_map(|f| f.split_fault())
    }

    /// The bug the `o_proj` all-reduce of `tp` ranks runs with (the first `all-reduce-*` fault
    /// injected): the skipping rank is the last, the early reader rank 0 (the rank whose copy
    /// the layer goes on with). `None` for one rank, where there is nothing to reduce.
    pub fn reduce_fault(&self, tp: usize) -> Option<ReduceFault> {
        if tp < 2 {
            return None;
        }
        self.0.iter().find_map(|f| match f {
            Fault::AllReduceTwice => Some(ReduceFault::Twice),
            Fault::AllReduceSkipRank => Some(ReduceFault::SkipRank(tp - 1)),
            Fault::AllReduceReadEarly => Some(ReduceFault::ReadEarly(0)),
            _ => None,
        })
    }
}
