//! Sites (the names of intermediates) and traces (the tensors a forward pass recorded at them).
//!
//! Everything mla-diff compares is keyed by a [`Site`]: a layer and a [`Stage`] such as
//! `kv_c_normed`, printed `L3.kv_c_normed`. The reference, every engine path, an engine's dump and
//! a golden file all produce a [`Trace`] of such sites, so one comparison serves them all. The
//! stage list, its data-flow order and each stage's shape are the site table of docs/design.md; the order is
//! what "first divergence" means.

use std::fmt;

use serde::Serialize;

/// A weight that tensor parallelism splits across ranks; its per-rank shards are recorded as
/// `w.<name>.rank<r>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum RankedWeight {
    /// `q_b_proj` (with `Lq`) or `q_proj` (without): column-parallel, rows split by heads.
    QProj,
    /// `kv_b_proj`: column-parallel, rows split by heads.
    KvB,
    /// `o_proj`: row-parallel, the input dim split by heads.
    OProj,
    /// `gate_up_proj` (vLLM's `MergedColumnParallelLinear` of `ffn_gate`/`ffn_up`, or of the
    /// `_shexp` pair in an MoE layer): rank r holds `[gate rows r·I/tp.. | up rows r·I/tp..]`,
    /// [2·I/tp, H].
    GateUp,
    /// `down_proj` (`ffn_down`, or `ffn_down_shexp`): row-parallel, rank r holds the input
    /// columns `r·I/tp..(r+1)·I/tp`, [H, I/tp].
    Down,
}

impl RankedWeight {
    /// Every ranked weight, in declaration order.
    pub const ALL: [RankedWeight; 5] = [
        RankedWeight::QProj,
        RankedWeight::KvB,
        RankedWeight::OProj,
        RankedWeight::GateUp,
        RankedWeight::Down,
    ];

    /// Name used in the site: `q_b`, `kv_b`, `o_proj`, `gate_up`, `down`.
    pub fn as_str(self) -> &'static str {
        match self {
            RankedWeight::QProj => "q_b",
            RankedWeight::KvB => "kv_b",
            RankedWeight::OProj => "o_proj",
            RankedWeight::GateUp => "gate_up",
            RankedWeight::Down => "down",
        }
    }

    /// True for the FFN's weights (`gate_up`, `down`), split by the FFN width rather than by
    /// attention heads.
    pub fn is_ffn(self) -> bool {
        matches!(self, RankedWeight::GateUp | RankedWeight::Down)
    }
}

/// A stage of one MLA layer, in the data-flow order of docs/design.md ("Sites") (the declaration order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum Stage {
    /// `hidden_in`: residual stream entering the layer, [T, H].
    HiddenIn,
    /// `attn_in`: after `attn_norm`, [T, H].
    AttnIn,
    /// `w.fused_qkv_a`: `[q_a | kv_a_mqa]` rows, [Lq+L+R, H] (only with Lq).
    WFusedQkvA,
    /// `q_c`: `q_a_proj` output, [T, Lq].
    QC,
    /// `q_c_normed`: after `q_a_layernorm`, [T, Lq].
    QCNormed,
    /// `q`: [T, N, P+R].
    Q,
    /// `kv_a`: `kv_a_proj_with_mqa` output, [T, L+R].
    KvA,
    /// `kv_c_normed`: [T, L].
    KvCNormed,
    /// `k_pe` before RoPE, [T, R].
    KPe,
    /// `q_pe_roped`: [T, N, R], interleaved pair order.
    QPeRoped,
    /// `k_pe_roped`: [T, R].
    KPeRoped,
    /// `idx_q`: the DSA indexer's query projection `indexer.attn_q_b · q_c_normed`, before its
    /// RoPE, [T, N_idx, D_idx] (`deepseek32`/`glm-dsa` layers with their own indexer).
    IdxQ,
    /// `idx_k`: the indexer key `LayerNorm(indexer.attn_k · attn_in)`, before its RoPE,
    /// [T, D_idx].
    IdxK,
    /// `idx_weights`: the per-head score weights `indexer.proj · attn_in`, unscaled, [T, N_idx].
    IdxWeights,
    /// `idx_scores`: `Σ_h w·N_idx^-½·ReLU(D_idx^-½·q·k)` after the indexer RoPE, [T, S]
    /// (S = longest sequence; entry [i, j] is key position j of token i's sequence; masked
    /// entries, j > position of i, are 0).
    IdxScores,
    /// `idx_topk`: the key positions each token keeps, [T, K] (K = min(top_k, S); ascending, −1
    /// padding where fewer keys are visible; compared as a set per token).
    IdxTopk,
    /// `w.kv_b`: [N·(P+V), L].
    WKvB,
    /// `k_nope`: [T, N, P].
    KNope,
    /// `v`: [T, N, V].
    V,
    /// `w.W_UK_T`: [N, P, L].
    WUkT,
    /// `w.W_UV`: [N, L, V].
    WUv,
    /// `ql_nope`: `q_nope · W_UK_T`, [T, N, L].
    QlNope,
    /// `attn_latent`: attention output in latent space, [T, N, L].
    AttnLatent,
    /// `lse`: natural-log log-sum-exp of the scaled logits, [T, N].
    Lse,
    /// `ctx_out.c<c>`: the MHA prefill over cached context, context chunk c's own attention
    /// output over that chunk's keys only (vLLM `_compute_prefill_context`), [Tc, N, V] (Tc: the
    /// step's rows of prefill sequences with cached context); 0 where the chunk is empty.
    CtxOutChunk(u32),
    /// `ctx_lse.c<c>`: context chunk c's natural-log LSE over its keys, [Tc, N]; −inf where the
    /// chunk is empty.
    CtxLseChunk(u32),
    /// `ctx_out`: the context chunks' outputs merged by their LSEs, [Tc, N, V].
    CtxOut,
    /// `ctx_lse`: the merged context's natural-log LSE, [Tc, N].
    CtxLse,
    /// `suffix_out`: the new tokens' causal attention over themselves, [Tc, N, V].
    SuffixOut,
    /// `suffix_lse`: its natural-log LSE, [Tc, N].
    SuffixLse,
    /// `attn_out`: the `o_proj` input, [T, N, V].
    AttnOut,
    /// `o_proj`: [T, H].
    OProj,
    /// `ffn_in`: after the post-attention RMSNorm (`ffn_norm`, vLLM `post_attention_layernorm`),
    /// [T, H]: the input of the dense MLP, or of the whole MoE block (router, routed and shared
    /// experts).
    FfnIn,
    /// `ffn_gate`: the gate projection of the layer's SwiGLU MLP, [T, I] (I: the dense FFN's
    /// `feed_forward_length`, or the shared experts' `n_shared·F_e` in an MoE layer).
    FfnGate,
    /// `ffn_up`: the up projection of the same MLP, [T, I].
    FfnUp,
    /// `ffn_act`: `SiLU(ffn_gate)·ffn_up`, the `down_proj` input, [T, I].
    FfnAct,
    /// `ffn_out`: the dense MLP's `down_proj` output after the TP all-reduce, before the
    /// residual add (and before MiniCPM3's residual scale), [T, H]. MoE layers record the
    /// shared experts' output at `shared_out` instead.
    FfnOut,
    /// `moe_router_logits`: the router's raw logits `RMSNorm(h)·ffn_gate_inpᵀ`, [T, E] (MoE
    /// layers only).
    MoeRouterLogits,
    /// `moe_topk`: the ids of the K experts each token selected, [T, K] (as numbers; compared as
    /// a set per token, so their order does not matter).
    MoeTopk,
    /// `moe_out`: the weighted sum of the selected routed experts' outputs, [T, H].
    MoeOut,
    /// `shared_out`: the shared experts' output, [T, H] (MoE layers with shared experts).
    SharedOut,
    /// `hidden_out`: after the attention residual and the FFN, [T, H].
    HiddenOut,
    /// `w.<weight>.rank<r>`: one TP rank's shard of a split weight.
    WRank(RankedWeight, u32),
    /// `o_proj.rank<r>`: TP rank r's row-parallel `o_proj` partial, its heads' `attn_out`
    /// through its `w.o_proj.rank<r>` columns, before the all-reduce, [T, H].
    OProjRank(u32),
    /// `ffn_gate_up.rank<r>`: TP rank r's merged-column `gate_up_proj` output, `[gate cols
    /// r·I/tp..(r+1)·I/tp | up cols r·I/tp..(r+1)·I/tp]`, [T, 2·I/tp].
    FfnGateUpRank(u32),
    /// `ffn_down.rank<r>`: TP rank r's row-parallel `down_proj` partial before the all-reduce
    /// (dense MLP, or the shared experts in an MoE layer), [T, H].
    FfnDownRank(u32),
}

/// Stages in data-flow order (without the per-rank sites and the per-chunk `ctx_out.c<c>`,
/// `ctx_lse.c<c>`).
pub const STAGES: &[Stage] = &[
    Stage::HiddenIn,
    Stage::AttnIn,
    Stage::WFusedQkvA,
    Stage::QC,
    Stage::QCNormed,
    Stage::Q,
    Stage::KvA,
    Stage::KvCNormed,
    Stage::KPe,
    Stage::QPeRoped,
    Stage::KPeRoped,
    Stage::IdxQ,
    Stage::IdxK,
    Stage::IdxWeights,
    Stage::IdxScores,
    Stage::IdxTopk,
    Stage::WKvB,
    Stage::KNope,
    Stage::V,
    Stage::WUkT,
    Stage::WUv,
    Stage::QlNope,
    Stage::AttnLatent,
    Stage::Lse,
    Stage::CtxOut,
    Stage::CtxLse,
    Stage::SuffixOut,
    Stage::SuffixLse,
    Stage::AttnOut,
    Stage::OProj,
    Stage::FfnIn,
    Stage::FfnGate,
    Stage::FfnUp,
    Stage::FfnAct,
    Stage::FfnOut,
    Stage::MoeRouterLogits,
    Stage::MoeTopk,
    Stage::MoeOut,
    Stage::SharedOut,
    Stage::HiddenOut,
];

impl Stage {
    /// The site-table name (`kv_c_normed`, `w.W_UK_T`, `w.kv_b.rank1`).
    pub fn name(&self) -> String {
        match self {
            Stage::WRank(w, r) => format!("w.{}.rank{r}", w.as_str()),
            Stage::OProjRank(r) => format!("o_proj.rank{r}"),
            Stage::FfnGateUpRank(r) => format!("ffn_gate_up.rank{r}"),
            Stage::FfnDownRank(r) => format!("ffn_down.rank{r}"),
            Stage::CtxOutChunk(c) => format!("ctx_out.c{c}"),
            Stage::CtxLseChunk(c) => format!("ctx_lse.c{c}"),
            s => s.base_name().to_string(),
        }
    }

    fn base_name(&self) -> &'static str {
        match self {
            Stage::HiddenIn => "hidden_in",
            Stage::AttnIn => "attn_in",
            Stage::WFusedQkvA => "w.fused_qkv_a",
            Stage::QC => "q_c",
            Stage::QCNormed => "q_c_normed",
            Stage::Q => "q",
            Stage::KvA => "kv_a",
            Stage::KvCNormed => "kv_c_normed",
            Stage::KPe => "k_pe",
            Stage::QPeRoped => "q_pe_roped",
            Stage::KPeRoped => "k_pe_roped",
            Stage::IdxQ => "idx_q",
            Stage::IdxK => "idx_k",
            Stage::IdxWeights => "idx_weights",
            Stage::IdxScores => "idx_scores",
            Stage::IdxTopk => "idx_topk",
            Stage::WKvB => "w.kv_b",
            Stage::KNope => "k_nope",
            Stage::V => "v",
            Stage::WUkT => "w.W_UK_T",
            Stage::WUv => "w.W_UV",
            Stage::QlNope => "ql_nope",
            Stage::AttnLatent => "attn_latent",
            Stage::Lse => "lse",
            Stage::CtxOut => "ctx_out",
            Stage::CtxLse => "ctx_lse",
            Stage::SuffixOut => "suffix_out",
            Stage::SuffixLse => "suffix_lse",
            Stage::AttnOut => "attn_out",
            Stage::OProj => "o_proj",
            Stage::FfnIn => "ffn_in",
            Stage::FfnGate => "ffn_gate",
            Stage::FfnUp => "ffn_up",
            Stage::FfnAct => "ffn_act",
            Stage::FfnOut => "ffn_out",
            Stage::MoeRouterLogits => "moe_router_logits",
            Stage::MoeTopk => "moe_topk",
            Stage::MoeOut => "moe_out",
            Stage::SharedOut => "shared_out",
            Stage::HiddenOut => "hidden_out",
            Stage::WRank(..) => "w.rank",
            Stage::OProjRank(..) => "o_proj.rank",
            Stage::FfnGateUpRank(..) => "ffn_gate_up.rank",
            Stage::FfnDownRank(..) => "ffn_down.rank",
            Stage::CtxOutChunk(..) => "ctx_out.c",
            Stage::CtxLseChunk(..) => "ctx_lse.c",
        }
    }

    /// Parses a site-table name (inverse of [`Stage::name`]).
    pub fn parse(s: &str) -> Option<Stage> {
        if let Some(r) = s.strip_prefix("o_proj.rank") {
            return r.parse().ok().map(Stage::OProjRank);
        }
        if let Some(r) = s.strip_prefix("ffn_gate_up.rank") {
            return r.parse().ok().map(Stage::FfnGateUpRank);
        }
        if let Some(r) = s.strip_prefix("ffn_down.rank") {
            return r.parse().ok().map(Stage::FfnDownRank);
        }
        if let Some(c) = s.strip_prefix("ctx_out.c") {
            return c.parse().ok().map(Stage::CtxOutChunk);
        }
        if let Some(c) = s.strip_prefix("ctx_lse.c") {
            return c.parse().ok().map(Stage::CtxLseChunk);
        }
        if let Some((w, r)) = s.strip_prefix("w.").and_then(|rest| rest.split_once(".rank")) {
            let rw = match w {
                "q_b" => RankedWeight::QProj,
                "kv_b" => RankedWeight::KvB,
                "o_proj" => RankedWeight::OProj,
                "gate_up" => RankedWeight::GateUp,
                "down" => RankedWeight::Down,
                _ => return None,
            };
            return r.parse().ok().map(|r| Stage::WRank(rw, r));
        }
        STAGES.iter().copied().find(|st| st.base_name() == s)
    }

    /// Sort key in data-flow order. A rank shard sorts just before the stage that consumes it
    /// (`q` for q_b, right after `w.kv_b` for kv_b, `o_proj` for o_proj, `ffn_gate` for gate_up,
    /// `ffn_out` for down), ranks in order; each rank's output (`o_proj.rank<r>`,
    /// `ffn_gate_up.rank<r>`, `ffn_down.rank<r>`) sorts after those shards and before the
    /// stage, which for `o_proj` and `ffn_out` is the all-reduce's output.
    pub fn order(&self) -> (u32, u32) {
        let idx = |s: Stage| STAGES.iter().position(|&x| x == s).unwrap_or(0) as u32 * 4;
        match *self {
            Stage::WRank(RankedWeight::QProj, r) => (idx(Stage::Q) - 1, r),
            Stage::WRank(RankedWeight::KvB, r) => (idx(Stage::WKvB) + 1, r),
            Stage::WRank(RankedWeight::OProj, r) => (idx(Stage::OProj) - 2, r),
            Stage::OProjRank(r) => (idx(Stage::OProj) - 1, r),
            Stage::WRank(RankedWeight::GateUp, r) => (idx(Stage::FfnGate) - 2, r),
            Stage::FfnGateUpRank(r) => (idx(Stage::FfnGate) - 1, r),
            Stage::WRank(RankedWeight::Down, r) => (idx(Stage::FfnOut) - 2, r),
            Stage::FfnDownRank(r) => (idx(Stage::FfnOut) - 1, r),
            // Chunk c's output, then its LSE, chunk after chunk, between `lse` and `ctx_out`.
            Stage::CtxOutChunk(c) => (idx(Stage::CtxOut) - 1, c.saturating_mul(2)),
            Stage::CtxLseChunk(c) => (idx(Stage::CtxOut) - 1, c.saturating_mul(2).saturating_add(1)),
            s => (idx(s), 0),
        }
    }

    /// True for weight sites (`w.*`).
    pub fn is_weight(&self) -> bool {
        self.base_name().starts_with("w.")
    }

    /// True for sites holding ids, not values (`moe_topk`, `idx_topk`): compared as a set per
    /// row.
    pub fn is_id_set(&self) -> bool {
        matches!(self, Stage::MoeTopk | Stage::IdxTopk)
    }

    /// True for the sites holding a natural-log LSE `[rows, N]`: `lse`, `ctx_lse.c<c>`,
    /// `ctx_lse`, `suffix_lse`.
    pub fn is_lse(&self) -> bool {
        matches!(
            self,
            Stage::Lse | Stage::CtxLseChunk(_) | Stage::CtxLse | Stage::SuffixLse
        )
    }

    /// True for the partial sites of the MHA prefill over cached context (`ctx_out.c<c>`,
    /// `ctx_lse.c<c>`, `ctx_out`, `ctx_lse`, `suffix_out`, `suffix_lse`), whose rows are the
    /// step's rows of prefill sequences with cached context (Tc), not all T.
    pub fn is_context_partial(&self) -> bool {
        matches!(
            self,
            Stage::CtxOutChunk(_)
                | Stage::CtxLseChunk(_)
                | Stage::CtxOut
                | Stage::CtxLse
                | Stage::SuffixOut
                | Stage::SuffixLse
        )
    }

    /// True for the DSA indexer's stages (`idx_*`).
    pub fn is_indexer(&self) -> bool {
        matches!(
            self,
            Stage::IdxQ | Stage::IdxK | Stage::IdxWeights | Stage::IdxScores | Stage::IdxTopk
        )
    }

    /// True for the sites of the layer's SwiGLU MLP (the dense FFN, or the shared experts of an
    /// MoE layer): `ffn_in` … `ffn_out` and the per-rank `ffn_gate_up.rank<r>`, `ffn_down.rank<r>`.
    pub fn is_ffn(&self) -> bool {
        matches!(
            self,
            Stage::FfnIn
                | Stage::FfnGate
                | Stage::FfnUp
                | Stage::FfnAct
                | Stage::FfnOut
                | Stage::FfnGateUpRank(_)
                | Stage::FfnDownRank(_)
        )
    }

    /// True for the stages only MoE layers have.
    pub fn is_moe(&self) -> bool {
        matches!(
            self,
            Stage::MoeRouterLogits | Stage::MoeTopk | Stage::MoeOut | Stage::SharedOut
        )
    }
}

/// A site: one stage of one layer, printed `L3.kv_c_normed`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Site {
    /// Layer index.
    pub layer: usize,
    /// Stage within the layer.
    pub stage: Stage,
}

impl Site {
    /// A site.
    pub fn new(layer: usize, stage: Stage) -> Self {
        Site { layer, stage }
    }

    /// Parses `L3.kv_c_normed`.
    pub fn parse(s: &str) -> Option<Site> {
        let rest = s.strip_prefix('L')?;
        let (layer, stage) = rest.split_once('.')?;
        Some(Site {
            layer: layer.parse().ok()?,
            stage: Stage::parse(stage)?,
        })
    }

    /// Sort key: layer, then data-flow order.
    pub fn order(&self) -> (usize, u32, u32) {
        let (a, b) = self.stage.order();
        (self.layer, a, b)
    }
}

impl fmt::Display for Site {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "L{}.{}", self.layer, self.stage.name())
    }
}

impl Serialize for Site {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// Element data of a recorded tensor. Engine paths record f32 (so a NaN canary keeps its exact
/// bits); the reference records f64.
#[derive(Debug, Clone, PartialEq)]
pub enum TensorData {
    /// f32 values (engine paths, dumps).
    F32(Vec<f32>),
    /// f64 values (the reference).
    F64(Vec<f64>),
}

/// A recorded tensor: row-major data and its shape.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceTensor {
    /// Shape in the site-table form of docs/design.md, e.g. [T, N, P+R].
    pub shape: Vec<usize>,
    /// Row-major values.
    pub data: TensorData,
}

impl TraceTensor {
    /// An f32 tensor. `data.len()` must equal the product of `shape` (checked in debug builds).
    pub fn f32(shape: Vec<usize>, data: Vec<f32>) -> Self {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len());
        TraceTensor {
            shape,
            data: TensorData::F32(data),
        }
    }

    /// An f64 tensor.
    pub fn f64(shape: Vec<usize>, data: Vec<f64>) -> Self {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len());
        TraceTensor {
            shape,
            data: TensorData::F64(data),
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match &self.data {
            TensorData::F32(v) => v.len(),
            TensorData::F64(v) => v.len(),
        }
    }

    /// True when the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element `i` widened to f64.
    pub fn get(&self, i: usize) -> f64 {
        match &self.data {
            TensorData::F32(v) => v[i] as f64,
            TensorData::F64(v) => v[i],
        }
    }

    /// All elements widened to f64.
    pub fn to_f64(&self) -> Vec<f64> {
        match &self.data {
            TensorData::F32(v) => v.iter().map(|&x| x as f64).collect(),
            TensorData::F64(v) => v.clone(),
        }
    }

    /// The f32 bits of each element, when the data is f32 (for canary detection).
    pub fn f32_data(&self) -> Option<&[f32]> {
        match &self.data {
            TensorData::F32(v) => Some(v),
            TensorData::F64(_) => None,
        }
    }
}

/// An ordered record of (site, tensor) pairs from one forward path.
#[derive(Debug, Clone, Default)]
pub struct Trace {
    entries: Vec<(Site, TraceTensor)>,
}

impl Trace {
    /// An empty trace.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records `tensor` at `site`, replacing an earlier record of the same site.
    pub fn record(&mut self, site: Site, tensor: TraceTensor) {
        if let Some(e) = self.entries.iter_mut().find(|(s, _)| *s == site) {
            e.1 = tensor;
        } else {
            self.entries.push((site, tensor));
        }
    }

    /// The tensor recorded at `site`.
    pub fn get(&self, site: &Site) -> Option<&TraceTensor> {
        self.entries.iter().find(|(s, _)| s == site).map(|(_, t)| t)
    }

    /// All entries in recording order.
    pub fn entries(&self) -> &[(Site, TraceTensor)] {
        &self.entries
    }

    /// All sites, sorted in data-flow order.
    pub fn sites_in_order(&self) -> Vec<Site> {
        let mut s: Vec<Site> = self.entries.iter().map(|(s, _)| *s).collect();
        s.sort_by_key(|s| s.order());
        s
    }

    /// Appends every entry of `other`.
    pub fn extend(&mut self, other: Trace) {
        for (s, t) in other.entries {
            self.record(s, t);
        }
    }
}

/// True when two shapes hold the same elements in the same order: equal, or equal after
/// flattening trailing dims (`[T, N, X]` vs `[T, N·X]`).
pub fn shapes_compatible(a: &[usize], b: &[usize]) -> bool {
    if a == b {
        return true;
    }
    let pa: usize = a.iter().product();
    let pb: usize = b.iter().product();
    pa == pb && !a.is_empty() && !b.is_empty() && a[0] == b[0]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn site_names_round_trip_and_order() {
        for &st in STAGES {
            let site = Site::new(3, st);
            assert_eq!(Site::parse(&site.to_string()), Some(site));
        }
        let r = Site::new(0, Stage::WRank(RankedWeight::KvB, 1));
        assert_eq!(r.to_string(), "L0.w.kv_b.rank1");
        assert_eq!(Site::parse("L0.w.kv_b.rank1"), Some(r));
        let p = Site::new(2, Stage::OProjRank(3));
        assert_eq!(p.to_string(), "L2.o_proj.rank3");
        assert_eq!(Site::parse("L2.o_proj.rank3"), Some(p));
        assert!(Stage::WRank(RankedWeight::OProj, 7).order() < Stage::OProjRank(0).order());
        assert!(Stage::OProjRank(0).order() < Stage::OProjRank(1).order());
        assert!(Stage::OProjRank(7).order() < Stage::OProj.order());
        assert!(Stage::AttnOut.order() < Stage::WRank(RankedWeight::OProj, 0).order());
        assert!(!Stage::OProjRank(0).is_weight());
        assert!(Stage::WRank(RankedWeight::QProj, 0).order() < Stage::Q.order());
        assert!(Stage::WRank(RankedWeight::QProj, 0).order() > Stage::QCNormed.order());
        assert!(Stage::WKvB.order() < Stage::WRank(RankedWeight::KvB, 0).order());
        assert!(Stage::WRank(RankedWeight::KvB, 3).order() < Stage::KNope.order());
        assert!(Stage::KvCNormed.order() < Stage::QPeRoped.order());
        assert!(Stage::OProj.order() < Stage::MoeRouterLogits.order());
        assert!(Stage::MoeRouterLogits.order() < Stage::MoeTopk.order());
        assert!(Stage::MoeTopk.order() < Stage::MoeOut.order());
        assert!(Stage::SharedOut.order() < Stage::HiddenOut.order());
        assert_eq!(Site::parse("L3.moe_topk"), Some(Site::new(3, Stage::MoeTopk)));
        assert!(Stage::MoeTopk.is_id_set() && !Stage::MoeOut.is_id_set());
        assert_eq!(Site::parse("L1.nonsense"), None);
    }

    #[test]
    fn ffn_sites_sort_between_o_proj_and_the_moe_sites() {
        let names = [
            "o_proj",
            "ffn_in",
            "w.gate_up.rank0",
            "w.gate_up.rank1",
            "ffn_gate_up.rank0",
            "ffn_gate_up.rank1",
            "ffn_gate",
            "ffn_up",
            "ffn_act",
            "w.down.rank0",
            "w.down.rank3",
            "ffn_down.rank0",
            "ffn_down.rank3",
            "ffn_out",
            "moe_router_logits",
        ];
        let stages: Vec<Stage> = names.iter().map(|n| Stage::parse(n).unwrap()).collect();
        for (st, n) in stages.iter().zip(names) {
            assert_eq!(st.name(), n);
        }
        assert!(stages.windows(2).all(|w| w[0].order() < w[1].order()), "{stages:?}");
        assert_eq!(
            Stage::parse("w.gate_up.rank1"),
            Some(Stage::WRank(RankedWeight::GateUp, 1))
        );
        assert_eq!(Stage::parse("ffn_down.rank2"), Some(Stage::FfnDownRank(2)));
        assert!(Stage::WRank(RankedWeight::Down, 0).is_weight());
        assert!(!Stage::FfnGateUpRank(0).is_weight() && Stage::FfnGateUpRank(0).is_ffn());
        assert!(Stage::FfnAct.is_ffn() && !Stage::SharedOut.is_ffn() && !Stage::FfnIn.is_moe());
        assert!(RankedWeight::GateUp.is_ffn() && !RankedWeight::OProj.is_ffn());
        assert_eq!(Stage::parse("ffn_gate_up.rankx"), None);
    }

    #[test]
    fn context_partials_sort_between_lse_and_attn_out() {
        let names = [
            "lse",
            "ctx_out.c0",
            "ctx_lse.c0",
            "ctx_out.c1",
            "ctx_lse.c1",
            "ctx_out.c12",
            "ctx_lse.c12",
            "ctx_out",
            "ctx_lse",
            "suffix_out",
            "suffix_lse",
            "attn_out",
        ];
        let stages: Vec<Stage> = names.iter().map(|n| Stage::parse(n).unwrap()).collect();
        for (st, n) in stages.iter().zip(names) {
            assert_eq!(st.name(), n);
        }
        assert!(stages.windows(2).all(|w| w[0].order() < w[1].order()), "{stages:?}");
        assert!(Stage::CtxLseChunk(3).is_lse() && Stage::SuffixLse.is_lse() && !Stage::CtxOut.is_lse());
        assert!(Stage::CtxOutChunk(0).is_context_partial() && !Stage::Lse.is_context_partial());
        assert_eq!(Stage::parse("ctx_out.cx"), None);
        assert_eq!(Stage::parse("ctx_out.c-1"), None);
    }
}
