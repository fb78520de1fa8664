//! The bug classes mla-diff names.
//!
//! A class is what a finding claims and what a fault is expected to produce, so both the fault
//! catalogue (which runs inside the engine paths) and the detectors (which judge them) refer to
//! it. It sits at the bottom so that neither has to import the other.

use serde::Serialize;

/// Bug classes. [`Class::ALL`] lists them in precedence order (earlier wins when several explain
/// a site); the declaration order differs from it only in `SoftmaxScale` and `LseMerge`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Class {
    /// A weight the engine never loaded: all zeros or the canary where the GGUF tensor is not.
    WeightNotLoaded,
    /// The output buffer was never written (canary everywhere, or all zero).
    PhantomOutput,
    /// Some rows keep the canary.
    UnwrittenRows,
    /// A fused weight's shards are in the wrong order.
    ShardOrder,
    /// TP rank blocks are permuted or duplicated.
    TpRankOrder,
    /// The TP all-reduce summed the wrong ranks: a rank's partial missing, or one rank's
    /// partial alone (read before the reduction finished).
    TpReduce,
    /// kv_b per-head interleave vs grouped, or k_b transpose.
    KvBLayout,
    /// A quantized weight was cut off a quant block boundary.
    QuantBlockMisaligned,
    /// A block-quantized weight dequantized with other block scales than its own: each block is
    /// the expected block times a constant, different between blocks (the scale grid read
    /// transposed, another block's scale, scales rounded).
    QuantScaleLayout,
    /// A loaded weight holds the expected matrix transposed (`[in, out]` for `[out, in]`).
    Transposed,
    /// An RMSNorm was not applied: the site, or the first compared site after a norm whose
    /// output was not dumped, equals the replay with the norm skipped.
    NormSkipped,
    /// The other RoPE rotation style explains the values.
    RopeStyle,
    /// A view of a fused tensor read with another row stride, head stride or offset than the
    /// tensor's layout (`k_pe` cut out of `kv_a` with `kv_c`'s stride).
    StridedView,
    /// The paged KV cache read or written with other metadata than it holds: a page size one side
    /// ignores, a block table read off by an entry or another sequence's, a slot mapping off by
    /// a slot or a block.
    PagedKv,
    /// The paged latent cache read back a constant factor off what was written (an fp8 cache's
    /// scale applied twice or missing on one side): the replay with the cache times c ≠ 1
    /// explains the attention output.
    KvCacheScale,
    /// A constant logit scale explains the attention output.
    SoftmaxScale,
    /// Sentinel or log-base error in an LSE merge.
    LseMerge,
    /// The tokens select other experts than the reference (`moe_topk`, compared as sets).
    MoeRouting,
    /// The DSA indexer's scores are explained by the other RoPE pairing (`idx_scores`).
    IndexerRopeStyle,
    /// The DSA indexer's selection is an earlier token's selection (`idx_topk`).
    IndexerTopkStale,
    /// The DSA indexer keeps other keys than the reference (`idx_topk`, compared as sets).
    IndexerSelection,
    /// The residual stream scaled where a layer adds its branches: `hidden_out` (or `ffn_in`'s
    /// `h1`) is the branches plus α × the residual, α fitted and ≠ 1.
    ResidualScale,
    /// An fp8 GEMM's input quantized with a per-tensor scale its batch does not give: a replay
    /// with one scale f× the batch's own (an amax over padded rows or another tensor)
    /// reproduces the error.
    Fp8ActScale,
    /// A product computed at lower precision than declared: a replay with inputs and/or the
    /// accumulator rounded to f16 or bf16 reproduces the error.
    Precision,
    /// NaN/Inf where the reference is finite.
    Nonfinite,
    /// Cosine ≈ 1 but the norm ratio is off.
    ScaleOnly,
    /// Only this path fails a site the other paths pass.
    PathDisagreement,
    /// None of the above.
    Mismatch,
    /// The GGUF weights themselves hold NaN/Inf.
    WeightNonfinite,
}

impl Class {
    /// Every class, in precedence order: when several hypotheses explain a site, the earlier
    /// class wins. The site detectors (the `DETECTORS` table of `judge::diagnose`) are tried in
    /// this order; `lse-merge` comes before `softmax-scale` because partials merged in the wrong
    /// log base reweight the logits, and a free logit scale fits part of that. `strided-view`
    /// and `paged-kv` replay one mechanism from the stage's own inputs: after the layout classes
    /// (`kv-b-layout`, `norm-skipped`, `rope-style`) whose rearrangements a free stride could
    /// also fit, and before the merge, whose empty-partial test also holds for rows a wrong
    /// cache read moved. The classes no
    /// site detector names sit where their source decides them: `quant-block-misaligned` (the
    /// path's weight loader), `quant-scale-layout` and `transposed` (`weights --check`) among the weight classes,
    /// `mismatch` when no detector explains a site, `weight-nonfinite` (a check of the GGUF
    /// itself) last. README.md, docs/faults.md, docs/design.md and docs/run-report.schema.json
    /// list the classes in this order (tests/doc_tables.rs).
    pub const ALL: [Class; 29] = [
        Class::WeightNotLoaded,
        Class::PhantomOutput,
        Class::UnwrittenRows,
        Class::ShardOrder,
        Class::TpRankOrder,
        Class::TpReduce,
        Class::KvBLayout,
        Class::QuantBlockMisaligned,
        Class::QuantScaleLayout,
        Class::Transposed,
        Class::NormSkipped,
        Class::RopeStyle,
        Class::StridedView,
        Class::PagedKv,
        Class::KvCacheScale,
        Class::LseMerge,
        Class::SoftmaxScale,
        Class::MoeRouting,
        Class::IndexerRopeStyle,
        Class::IndexerTopkStale,
        Class::IndexerSelection,
        Class::ResidualScale,
        Class::Fp8ActScale,
        Class::Precision,
        Class::Nonfinite,
        Class::ScaleOnly,
        Class::PathDisagreement,
        Class::Mismatch,
        Class::WeightNonfinite,
    ];

    /// kebab-case name (`shard-order`).
    pub fn name(self) -> &'static str {
        match self {
            Class::WeightNotLoaded => "weight-not-loaded",
            Class::PhantomOutput => "phantom-output",
            Class::UnwrittenRows => "unwritten-rows",
            Class::ShardOrder => "shard-order",
            Class::TpRankOrder => "tp-rank-order",
            Class::TpReduce => "tp-reduce",
            Class::KvBLayout => "kv-b-layout",
            Class::QuantBlockMisaligned => "quant-block-misaligned",
            Class::QuantScaleLayout => "quant-scale-layout",
            Class::Transposed => "transposed",
            Class::NormSkipped => "norm-skipped",
            Class::RopeStyle => "rope-style",
            Class::SoftmaxScale => "softmax-scale",
            Class::LseMerge => "lse-merge",
            Class::StridedView => "strided-view",
            Class::PagedKv => "paged-kv",
            Class::KvCacheScale => "kv-cache-scale",
            Class::MoeRouting => "moe-routing",
            Class::IndexerRopeStyle => "indexer-rope-style",
            Class::IndexerTopkStale => "indexer-topk-stale",
            Class::IndexerSelection => "indexer-selection",
            Class::ResidualScale => "residual-scale",
            Class::Fp8ActScale => "fp8-act-scale",
            Class::Precision => "precision",
            Class::Nonfinite => "nonfinite",
            Class::ScaleOnly => "scale-only",
            Class::PathDisagreement => "path-disagreement",
            Class::Mismatch => "mismatch",
            Class::WeightNonfinite => "weight-nonfinite",
        }
    }
}

impl std::fmt::Display for Class {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
