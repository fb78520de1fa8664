//! The site vocabulary of dumps: every tensor name a hook may write, derived from the reader's
//! own types.
//!
//! Hooks in another language (the Python package `mla_diff_hooks`) name their tensors by our
//! sites, and a name the reader does not know is ignored and listed, not an error: a hook whose
//! list of names drifts from [`Stage`] would lose sites quietly. So the vocabulary is built here
//! from [`STAGES`], [`RankedWeight::ALL`], [`Site`]'s printed form and the format markers, never
//! from a second list, and `mla-diff sites --json` prints it for the hooks' tests to compare
//! with theirs. The human form adds each stage's shape in MLA dim names and one line on what it
//! holds (docs/design.md, "Sites", has the full table).

use serde::Serialize;

use super::header::{FORMAT1, FORMAT2};
use crate::core::trace::{RankedWeight, STAGES, Site, Stage};
use crate::model::config::MlaConfig;

/// The site vocabulary of dumps, as `mla-diff sites --json` writes it (the field order is the
/// JSON's). Build it with [`SiteVocabulary::current`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SiteVocabulary {
    /// Every stage of [`STAGES`] as a dump names it after `L{n}.` ([`Stage::name`]), in
    /// data-flow order: `hidden_in`, `attn_in`, `w.fused_qkv_a`, …, `hidden_out`.
    pub stages: Vec<String>,
    /// The weights tensor parallelism splits ([`RankedWeight::as_str`]), in declaration order:
    /// `q_b`, `kv_b`, `o_proj`, `gate_up`, `down`.
    pub ranked_weights: Vec<&'static str>,
    /// How a site's tensor name is built from a layer, a stage, a weight and a rank.
    pub site_templates: SiteTemplates,
    /// The `format` metadata values a dump may carry ([`FORMAT1`], [`FORMAT2`]).
    pub dump_formats: Vec<&'static str>,
}

/// Tensor-name templates of a dump's sites; `{layer}`, `{stage}`, `{weight}` and `{rank}` are
/// decimal layer and rank numbers and names from [`SiteVocabulary`]'s lists.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SiteTemplates {
    /// A stage of a layer: `L{layer}.{stage}`.
    pub layer: String,
    /// One TP rank's shard of a ranked weight: `L{layer}.w.{weight}.rank{rank}`.
    pub weight_rank: String,
    /// One TP rank's `o_proj` partial before the all-reduce: `L{layer}.o_proj.rank{rank}`.
    pub o_proj_rank: String,
    /// One TP rank's merged-column `gate_up_proj` output: `L{layer}.ffn_gate_up.rank{rank}`.
    pub ffn_gate_up_rank: String,
    /// One TP rank's `down_proj` partial before the all-reduce: `L{layer}.ffn_down.rank{rank}`.
    pub ffn_down_rank: String,
    /// Context chunk `{chunk}`'s attention output in a prefill over cached context:
    /// `L{layer}.ctx_out.c{chunk}`.
    pub ctx_out_chunk: String,
    /// Context chunk `{chunk}`'s LSE: `L{layer}.ctx_lse.c{chunk}`.
    pub ctx_lse_chunk: String,
}

/// A layer number no real site has, printed by [`Site`] and then replaced by `{layer}`.
const LAYER_MARK: usize = 987_654_321;
/// A rank number no real site has, printed by [`Site`] and then replaced by `{rank}`.
const RANK_MARK: u32 = 876_543_210;
/// A chunk number no real site has, printed by [`Site`] and then replaced by `{chunk}`.
const CHUNK_MARK: u32 = 765_432_109;

/// `site` as [`Site`] prints it, with each `(value, placeholder)` of `fills` replaced once.
fn template(site: Site, fills: &[(&str, &str)]) -> String {
    fills.iter().fold(site.to_string(), |s, (value, placeholder)| {
        s.replacen(value, placeholder, 1)
    })
}

impl SiteVocabulary {
    /// The vocabulary of this build, from [`STAGES`], [`RankedWeight::ALL`], [`Site`]'s
    /// `Display` and the format markers.
    pub fn current() -> SiteVocabulary {
        let (layer, rank, chunk) = (LAYER_MARK.to_string(), RANK_MARK.to_string(), CHUNK_MARK.to_string());
        let stage = Stage::HiddenIn.name();
        let weight = RankedWeight::QProj.as_str();
        SiteVocabulary {
            stages: STAGES.iter().map(Stage::name).collect(),
            ranked_weights: RankedWeight::ALL.iter().map(|w| w.as_str()).collect(),
            site_templates: SiteTemplates {
                layer: template(
                    Site::new(LAYER_MARK, Stage::HiddenIn),
                    &[(&layer, "{layer}"), (&stage, "{stage}")],
                ),
                weight_rank: template(
                    Site::new(LAYER_MARK, Stage::WRank(RankedWeight::QProj, RANK_MARK)),
                    &[(&layer, "{layer}"), (&rank, "{rank}"), (weight, "{weight}")],
                ),
                o_proj_rank: template(
                    Site::new(LAYER_MARK, Stage::OProjRank(RANK_MARK)),
                    &[(&layer, "{layer}"), (&rank, "{rank}")],
                ),
                ffn_gate_up_rank: template(
                    Site::new(LAYER_MARK, Stage::FfnGateUpRank(RANK_MARK)),
                    &[(&layer, "{layer}"), (&rank, "{rank}")],
                ),
                ffn_down_rank: template(
                    Site::new(LAYER_MARK, Stage::FfnDownRank(RANK_MARK)),
                    &[(&layer, "{layer}"), (&rank, "{rank}")],
                ),
                ctx_out_chunk: template(
                    Site::new(LAYER_MARK, Stage::CtxOutChunk(CHUNK_MARK)),
                    &[(&layer, "{layer}"), (&chunk, "{chunk}")],
                ),
                ctx_lse_chunk: template(
                    Site::new(LAYER_MARK, Stage::CtxLseChunk(CHUNK_MARK)),
                    &[(&layer, "{layer}"), (&chunk, "{chunk}")],
                ),
            },
            dump_formats: vec![FORMAT1, FORMAT2],
        }
    }

    /// The human site table: one row per stage of [`STAGES`] (the per-chunk `ctx_out.c{chunk}`
    /// and `ctx_lse.c{chunk}` just after `lse`), then one per ranked weight's shard
    /// (`w.{weight}.rank{rank}`) and the per-rank outputs (`o_proj.rank{rank}`,
    /// `ffn_gate_up.rank{rank}`, `ffn_down.rank{rank}`), each named as a dump writes it after
    /// `L{layer}.`.
    pub fn rows(&self) -> Vec<StageRow> {
        let mut rows: Vec<StageRow> = Vec::new();
        for &s in STAGES {
            rows.push(stage_row(s));
            if s == Stage::Lse {
                for (name, stage) in [
                    ("ctx_out.c{chunk}", Stage::CtxOutChunk(0)),
                    ("ctx_lse.c{chunk}", Stage::CtxLseChunk(0)),
                ] {
                    rows.push(StageRow {
                        name: name.to_string(),
                        ..stage_row(stage)
                    });
                }
            }
        }
        for w in RankedWeight::ALL {
            rows.push(StageRow {
                name: format!("w.{}.rank{{rank}}", w.as_str()),
                ..stage_row(Stage::WRank(w, 0))
            });
        }
        for (name, stage) in [
            ("o_proj.rank{rank}", Stage::OProjRank(0)),
            ("ffn_gate_up.rank{rank}", Stage::FfnGateUpRank(0)),
            ("ffn_down.rank{rank}", Stage::FfnDownRank(0)),
        ] {
            rows.push(StageRow {
                name: name.to_string(),
                ..stage_row(stage)
            });
        }
        rows
    }
}

/// The dim names the shapes of [`StageRow`] use, each with what it counts (MLA's dims first).
pub const SHAPE_DIMS: &[(&str, &str)] = &[
    ("T", "tokens"),
    ("N", "heads"),
    ("H", "hidden"),
    ("Lq", "q_lora_rank"),
    ("L", "kv_lora_rank"),
    ("P", "qk_nope_head_dim"),
    ("R", "qk_rope_head_dim"),
    ("V", "v_head_dim"),
    (
        "I",
        "SwiGLU MLP width: feed_forward_length, or n_shared·F_e for the shared experts",
    ),
    ("E", "experts"),
    ("K", "experts used"),
    ("N_idx", "DSA indexer heads"),
    ("D_idx", "DSA indexer head dim"),
    ("K_idx", "DSA indexer top-k"),
    (
        "S",
        "key positions: the longest sequence's, cached context included (a format-2 step's context + new; T for one sequence from position 0)",
    ),
    (
        "Tc",
        "rows of a step's prefill sequences with cached context (the MHA prefill over context)",
    ),
    ("TP", "tensor-parallel ranks"),
];

/// One row of the human site table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageRow {
    /// The stage as a dump names it after `L{layer}.` (`kv_c_normed`, `w.kv_b.rank1`).
    pub name: String,
    /// Its shape in dim names ([`SHAPE_DIMS`]), e.g. `[T, N, P+R]`.
    pub shape: &'static str,
    /// What the site holds, in one line.
    pub meaning: &'static str,
}

/// The table row of `stage`: its name ([`Stage::name`]), shape and meaning. The shapes are the
/// ones [`expected_shape`](super::expected_shape) checks, in dim names (a test evaluates them on
/// the fixtures); the per-rank sites and the `[T, I]` FFN sites (whose width differs between
/// dense and MoE layers) have no fixed expectation there.
pub fn stage_row(stage: Stage) -> StageRow {
    let (shape, meaning) = match stage {
        Stage::HiddenIn => ("[T, H]", "residual stream entering the layer"),
        Stage::AttnIn => ("[T, H]", "after attn_norm"),
        Stage::WFusedQkvA => ("[Lq+L+R, H]", "[q_a | kv_a_mqa] weight rows (with Lq)"),
        Stage::QC => ("[T, Lq]", "q_a_proj output (with Lq)"),
        Stage::QCNormed => ("[T, Lq]", "after q_a_layernorm (with Lq)"),
        Stage::Q => ("[T, N, P+R]", "q_b_proj (or q_proj) output, [nope | rope] per head"),
        Stage::KvA => ("[T, L+R]", "kv_a_proj_with_mqa output, [latent | rope]"),
        Stage::KvCNormed => ("[T, L]", "the latent after kv_a_layernorm"),
        Stage::KPe => ("[T, R]", "the shared rope key, before RoPE"),
        Stage::QPeRoped => ("[T, N, R]", "query rope part after RoPE, interleaved pairs"),
        Stage::KPeRoped => ("[T, R]", "key rope part after RoPE, interleaved pairs"),
        Stage::IdxQ => ("[T, N_idx, D_idx]", "DSA indexer query, before its RoPE"),
        Stage::IdxK => ("[T, D_idx]", "DSA indexer key, before its RoPE"),
        Stage::IdxWeights => ("[T, N_idx]", "DSA indexer per-head score weights, unscaled"),
        Stage::IdxScores => ("[T, S]", "DSA indexer scores (masked entries 0)"),
        Stage::IdxTopk => (
            "[T, min(K_idx, S)]",
            "key positions each token keeps (a set, −1 padded)",
        ),
        Stage::WKvB => ("[N·(P+V), L]", "kv_b_proj weight, [k_nope | v] rows per head"),
        Stage::KNope => ("[T, N, P]", "expanded keys, non-rope part"),
        Stage::V => ("[T, N, V]", "expanded values"),
        Stage::WUkT => ("[N, P, L]", "kv_b's key rows per head, absorbed into q"),
        Stage::WUv => ("[N, L, V]", "kv_b's value rows per head, transposed"),
        Stage::QlNope => ("[T, N, L]", "q_nope · W_UK_T: the query in latent space"),
        Stage::AttnLatent => ("[T, N, L]", "attention output in latent space"),
        Stage::Lse => ("[T, N]", "log-sum-exp of the scaled logits (natural log)"),
        Stage::CtxOutChunk(_) => (
            "[Tc, N, V]",
            "context chunk c's own attention output over its keys (0 where empty)",
        ),
        Stage::CtxLseChunk(_) => ("[Tc, N]", "context chunk c's LSE over its keys (−inf where empty)"),
        Stage::CtxOut => ("[Tc, N, V]", "the context chunks' outputs merged"),
        Stage::CtxLse => ("[Tc, N]", "the merged context's LSE"),
        Stage::SuffixOut => ("[Tc, N, V]", "the new tokens' causal attention over themselves"),
        Stage::SuffixLse => ("[Tc, N]", "the suffix attention's LSE"),
        Stage::AttnOut => ("[T, N, V]", "attention output per head: the o_proj input"),
        Stage::OProj => ("[T, H]", "o_proj output (after the TP all-reduce)"),
        Stage::FfnIn => (
            "[T, H]",
            "after ffn_norm (post_attention_layernorm): the MLP or MoE input",
        ),
        Stage::FfnGate => ("[T, I]", "gate_proj output (dense MLP, or the shared experts)"),
        Stage::FfnUp => ("[T, I]", "up_proj output (dense MLP, or the shared experts)"),
        Stage::FfnAct => ("[T, I]", "SiLU(ffn_gate)·ffn_up: the down_proj input"),
        Stage::FfnOut => ("[T, H]", "dense MLP's down_proj output (after the TP all-reduce)"),
        Stage::MoeRouterLogits => ("[T, E]", "router logits (MoE layers)"),
        Stage::MoeTopk => ("[T, K]", "selected expert ids (a set per token)"),
        Stage::MoeOut => ("[T, H]", "weighted sum of the routed experts"),
        Stage::SharedOut => ("[T, H]", "shared experts' output"),
        Stage::HiddenOut => ("[T, H]", "after the attention residual and the FFN"),
        Stage::WRank(RankedWeight::QProj, _) => ("[N/TP·(P+R), Lq or H]", "one TP rank's rows of q_b_proj (q_proj)"),
        Stage::WRank(RankedWeight::KvB, _) => ("[N/TP·(P+V), L]", "one TP rank's rows of kv_b_proj"),
        Stage::WRank(RankedWeight::OProj, _) => ("[H, N/TP·V]", "one TP rank's columns of o_proj"),
        Stage::WRank(RankedWeight::GateUp, _) => (
            "[2·I/TP, H]",
            "one TP rank's rows of gate_up_proj: [its gate rows | its up rows]",
        ),
        Stage::WRank(RankedWeight::Down, _) => ("[H, I/TP]", "one TP rank's columns of down_proj"),
        Stage::OProjRank(_) => ("[T, H]", "one TP rank's o_proj partial, before the all-reduce"),
        Stage::FfnGateUpRank(_) => (
            "[T, 2·I/TP]",
            "one TP rank's gate_up_proj output: [its gate cols | its up cols]",
        ),
        Stage::FfnDownRank(_) => ("[T, H]", "one TP rank's down_proj partial, before the all-reduce"),
    };
    StageRow {
        name: stage.name(),
        shape,
        meaning,
    }
}

/// The sites a stage is computed from, within its layer: the data-flow edges of the site table
/// (docs/design.md, "Sites"), as a hint names the inputs of a failing stage. `absorbed` picks
/// the absorbed form of attention (`ql_nope` against the latent `kv_c_normed`, then `W_UV`) over
/// the expanded one (`q` against `k_nope`, `v`) for `lse` and `attn_out`, which either form
/// computes. A weight site (`w.*`, built from the GGUF) and `hidden_in` (the previous layer's
/// output) have none; a per-rank output lists its rank's own shard. `cfg` decides the query
/// path (`q_c_normed` with a query LoRA, `attn_in` without) and whether attention reads the DSA
/// selection (`idx_topk`). A model's layer may lack some of them (an MoE layer's `ffn_out`, a
/// shared indexer layer's `idx_scores`): callers keep those the layer's reference holds.
pub fn stage_inputs(stage: Stage, cfg: &MlaConfig, absorbed: bool) -> Vec<Stage> {
    use Stage::*;
    let q_in = if cfg.q_lora_rank.is_some() { QCNormed } else { AttnIn };
    let dsa = cfg.indexer.is_some();
    let attention = |v: &[Stage]| -> Vec<Stage> {
        let mut v = v.to_vec();
        if dsa {
            v.push(IdxTopk);
        }
        v
    };
    match stage {
        HiddenIn | WFusedQkvA | WKvB | WUkT | WUv | WRank(..) => Vec::new(),
        AttnIn => vec![HiddenIn],
        QC | KvA if cfg.q_lora_rank.is_some() => vec![AttnIn, WFusedQkvA],
        QC | KvA => vec![AttnIn],
        QCNormed => vec![QC],
        Q => vec![q_in],
        KvCNormed | KPe => vec![KvA],
        QPeRoped => vec![Q],
        KPeRoped => vec![KPe],
        IdxQ => vec![q_in],
        IdxK | IdxWeights => vec![AttnIn],
        IdxScores => vec![IdxQ, IdxK, IdxWeights],
        IdxTopk => vec![IdxScores],
        KNope | V => vec![KvCNormed, WKvB],
        QlNope => vec![Q, WUkT],
        AttnLatent => attention(&[QlNope, QPeRoped, KvCNormed, KPeRoped]),
        Lse if absorbed => attention(&[QlNope, QPeRoped, KvCNormed, KPeRoped]),
        Lse => attention(&[Q, QPeRoped, KNope, KPeRoped]),
        CtxLseChunk(_) | CtxLse | SuffixLse => vec![Q, QPeRoped, KNope, KPeRoped],
        CtxOutChunk(_) | CtxOut | SuffixOut => vec![Q, QPeRoped, KNope, V, KPeRoped],
        AttnOut if absorbed => vec![AttnLatent, WUv],
        AttnOut => attention(&[Q, QPeRoped, KNope, V, KPeRoped]),
        OProj => vec![AttnOut],
        OProjRank(r) => vec![AttnOut, WRank(RankedWeight::OProj, r)],
        FfnIn => vec![HiddenIn, OProj],
        FfnGate | FfnUp | MoeRouterLogits => vec![FfnIn],
        FfnGateUpRank(r) => vec![FfnIn, WRank(RankedWeight::GateUp, r)],
        FfnAct => vec![FfnGate, FfnUp],
        FfnDownRank(r) => vec![FfnAct, WRank(RankedWeight::Down, r)],
        FfnOut | SharedOut => vec![FfnAct],
        MoeTopk => vec![MoeRouterLogits],
        MoeOut => vec![FfnIn, MoeTopk],
        HiddenOut if cfg.moe.is_some() => vec![HiddenIn, OProj, FfnOut, MoeOut, SharedOut],
        HiddenOut => vec![HiddenIn, OProj, FfnOut],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every input of a stage comes before it in data-flow order, so that at a path's first
    /// divergence every input that was compared has passed.
    #[test]
    fn stage_inputs_precede_their_stage() {
        let fixture = crate::model::fixture::open_model(None).unwrap();
        let cfg = MlaConfig::from_gguf(&fixture).unwrap();
        let mut stages: Vec<Stage> = STAGES.to_vec();
        stages.extend([
            Stage::OProjRank(1),
            Stage::FfnGateUpRank(1),
            Stage::FfnDownRank(1),
            Stage::WRank(RankedWeight::KvB, 1),
        ]);
        for s in stages {
            for absorbed in [false, true] {
                for input in stage_inputs(s, &cfg, absorbed) {
                    assert!(input.order() < s.order(), "{} feeds {}", input.name(), s.name());
                }
            }
        }
        assert_eq!(stage_inputs(Stage::KNope, &cfg, false), [Stage::KvCNormed, Stage::WKvB]);
        assert_eq!(
            stage_inputs(Stage::AttnOut, &cfg, true),
            [Stage::AttnLatent, Stage::WUv]
        );
        assert_eq!(stage_inputs(Stage::Q, &cfg, false), [Stage::QCNormed]);
        assert!(stage_inputs(Stage::WKvB, &cfg, false).is_empty());
    }

    #[test]
    fn templates_are_the_printed_site_forms() {
        let v = SiteVocabulary::current();
        assert_eq!(v.site_templates.layer, "L{layer}.{stage}");
        assert_eq!(v.site_templates.weight_rank, "L{layer}.w.{weight}.rank{rank}");
        assert_eq!(v.site_templates.o_proj_rank, "L{layer}.o_proj.rank{rank}");
        assert_eq!(v.site_templates.ffn_gate_up_rank, "L{layer}.ffn_gate_up.rank{rank}");
        assert_eq!(v.site_templates.ffn_down_rank, "L{layer}.ffn_down.rank{rank}");
        assert_eq!(v.ranked_weights, ["q_b", "kv_b", "o_proj", "gate_up", "down"]);
        assert_eq!(v.dump_formats, ["mla-diff dump 1", "mla-diff dump 2"]);
        assert_eq!(v.stages.len(), STAGES.len());
        assert_eq!(v.site_templates.ctx_out_chunk, "L{layer}.ctx_out.c{chunk}");
        assert_eq!(v.site_templates.ctx_lse_chunk, "L{layer}.ctx_lse.c{chunk}");
        assert_eq!(v.rows().len(), STAGES.len() + 2 + RankedWeight::ALL.len() + 3);
    }
}
