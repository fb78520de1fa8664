//! The detectors of weight sites (`w.*`) and the findings about the GGUF file itself:
//! `weight-not-loaded`, `shard-order`, `tp-rank-order`, `kv-b-layout`,
//! `quant-block-misaligned` and `weight-nonfinite`.
//!
//! Most MLA loading bugs leave the weights numerically intact and only rearranged: shards of a
//! fused projection in load order, a rank holding another rank's heads, `kv_b`'s rows split
//! grouped instead of per head, `attn_k_b` reshaped instead of transposed. Each detector here
//! rebuilds the weight (or the activation it feeds) from the reference with the rearrangement
//! and checks whether that explains the candidate, so the finding names the rearrangement
//! rather than "the weight differs". The same families explain an engine's loaded weights in
//! [`super::loaded`], which gives the `weight-not-loaded` hint written here.

use super::blocks::{BlockMatch, find_blocks, rel_l2};
use super::{Detection, Finding, SiteCtx};
use crate::compute::path::Unservable;
use crate::core::class::Class;
use crate::core::sci::sci;
use crate::core::trace::{Site, Stage, Trace};
use crate::judge::label::PathLabel;
use crate::model::config::MlaConfig;
use crate::model::dump::is_per_head;
use crate::model::tensors::{ModelTensor, TpSplit, loader_sources, site_param};
use crate::model::weights::NonFiniteTensor;

/// The hint of every rank holding rank 0's slice of a merged-column weight (`gate_up_proj`):
/// vllm-gguf-plugin 0.0.5's `load_merged_column_weight` reads `tp_rank` from a keyword argument
/// that vLLM's `MergedColumnParallelLinear.weight_loader_v2` never passes, so it defaults to 0
/// (vllm-gguf-plugin#103, fixed by PR #106). Written once for `weights --check`, `compare` and
/// `run`.
pub(crate) const HINT_MERGED_COLUMN_RANK0: &str = "a merged-column weight loader that takes the TP rank from a keyword argument its caller never passes (vllm-gguf-plugin 0.0.5 `load_merged_column_weight`, fixed by PR #106) keeps rank 0's slice on every rank";

/// The GGUF tensors of layer `layer` that an engine's loader turns into weight site `stage`, in
/// this file's layout (split `attn_k_b`/`attn_v_b` or fused `attn_kv_b`; `attn_q_b` with a query
/// LoRA, `attn_q` without): the tensor table's [`loader_sources`], so `w.W_UK_T` and `w.W_UV`
/// name every `kv_b` tensor they are computed from; the FFN's `w.gate_up`/`w.down` shards name
/// the dense tensors in a dense layer and the shared experts' in an MoE layer.
pub fn gguf_sources(cfg: &MlaConfig, layer: usize, stage: Stage) -> Vec<String> {
    loader_sources(cfg, stage)
        .into_iter()
        .filter(|t| t.in_layer(cfg, layer))
        .map(|t| t.name(layer))
        .collect()
}

/// A weight site whose every element is zero, the canary or NaN while the reference's is not:
/// the engine's loader never filled the parameter (its GGUF name map lacks the file's tensors
/// for it). An activation that was never written is `phantom-output`; this is its weight twin.
pub(super) fn weight_not_loaded(x: &SiteCtx<'_>) -> Option<Detection> {
    if !x.site.stage.is_weight() {
        return None;
    }
    let m = x.diff.metrics.as_ref()?;
    if m.numel == 0 || m.norm_ref == 0.0 {
        return None;
    }
    // The same fills as weights --check's `not_loaded`: an engine's unfilled parameter holds
    // zeros or NaN (the canary of mla-diff's own paths is one).
    let what = if m.canary == m.numel {
        "hold the canary"
    } else if (0..x.cand.len()).all(|i| x.cand.get(i) == 0.0) {
        "are 0"
    } else if (0..x.cand.len()).all(|i| x.cand.get(i).is_nan()) {
        "are NaN"
    } else {
        return None;
    };
    let sources = gguf_sources(x.input.cfg, x.site.layer, x.site.stage);
    let names = if sources.is_empty() {
        "the GGUF tensors of this weight".to_string()
    } else {
        sources
            .iter()
            .map(|s| format!("`{s}`"))
            .collect::<Vec<_>>()
            .join(" and ")
    };
    Some(Detection::new(
        format!(
            "all {} elements {what} while ‖ref‖ = {} (rebuilt from {names})",
            m.numel,
            sci(m.norm_ref, 2)
        ),
        weight_not_loaded_hint(&names),
    ))
}

/// The hint of a weight the engine never loaded, rebuilt from the GGUF tensors `sources` (as
/// text: `` `blk.1.attn_k_b.weight` and `blk.1.attn_v_b.weight` `` at a site, with their ggml
/// types in `weights --check`).
pub(super) fn weight_not_loaded_hint(sources: &str) -> String {
    format!(
        "the engine never loaded this weight: its loader's tensor mapping has no entry for {sources} \
         (vllm-gguf-plugin 0.0.5 maps `attn_kv_b` but not the split `attn_k_b`/`attn_v_b` that \
         current llama.cpp writes)"
    )
}

/// `shard-order`: `w.fused_qkv_a` holds the reference shards `[Lq, L+R]` in another order, or
/// `q_c` equals the first Lq columns of the reference `kv_a` (the fused output swapped).
pub(super) fn shard_order(x: &SiteCtx<'_>) -> Option<Detection> {
    let cfg = x.input.cfg;
    let lq = cfg.q_lora_rank?;
    let (l, r) = (cfg.kv_lora_rank, cfg.qk_rope_head_dim);
    match x.site.stage {
        Stage::WFusedQkvA => {
            let m = find_blocks(
                &x.cand.to_f64(),
                &x.refr.to_f64(),
                &x.refr.shape,
                0,
                &[lq, l + r],
                x.explain,
            )?;
            m.explains().then(|| {
                Detection::new(
                    format!(
                        "rows are the reference shards (q_a_proj {lq} rows, kv_a_proj_with_mqa {} rows) in order {}: rel_l2 {} per shard vs {} as is",
                        l + r,
                        m.map_text(),
                        sci(m.errors.iter().copied().filter(|e| e.is_finite()).fold(0.0, f64::max), 2),
                        sci(x.as_is(), 2)
                    ),
                    "fused_qkv_a_proj must be [q_a_proj | kv_a_proj_with_mqa] (shard 0 then 1): merge GGUF shards \
                     by shard id, not by the order the file delivers them (vLLM GGUF loader fix)"
                        .into(),
                )
            })
        }
        Stage::QC => {
            // Without the weight: q_c would be the first Lq columns of the fused output in the
            // swapped order, i.e. kv_a's first Lq columns.
            let kv_a = x.ref_site(Stage::KvA)?;
            let t = x.refr.shape[0];
            if lq > l + r {
                return None;
            }
            let alt: Vec<f64> = (0..t)
                .flat_map(|i| (0..lq).map(move |j| (i, j)))
                .map(|(i, j)| kv_a.get(i * (l + r) + j))
                .collect();
            let e = x.explained_by(&alt)?;
            Some(Detection::new(
                format!(
                    "q_c equals the first {lq} columns of kv_a: the fused output is [kv_a | q_c], shard order [1,0] ({})",
                    x.vs_as_is(e)
                ),
                "fused_qkv_a_proj shards are in load order, not shard-id order".into(),
            ))
        }
        _ => None,
    }
}

/// The axis and block size along which TP ranks split a site, if any: the per-head sites
/// ([`is_per_head`]) split by heads, N/tp per rank, along the head axis (1 for `[T, N, …]`
/// activations and the `[T, N]` lse, 0 for the weights, whose rows per head are the tensor
/// table's: `P+V` for `w.kv_b`, 1 for `w.W_UK_T`/`w.W_UV`).
fn rank_axis(stage: Stage, cfg: &MlaConfig, tp: usize) -> Option<(usize, usize)> {
    if !is_per_head(stage) {
        return None;
    }
    let heads_per_rank = cfg.n_head / tp;
    Some(match site_param(cfg, stage) {
        Some((_, TpSplit::ColumnByHeads(h))) => (0, heads_per_rank * h.width(cfg.dims())),
        _ => (1, heads_per_rank),
    })
}

/// The detection of TP rank blocks matched as `m`, for the tensor described by `what`.
fn describe_ranks(m: &BlockMatch, what: &str, x: &SiteCtx<'_>) -> Detection {
    Detection::new(
        format!(
            "{what}: {}; matched shards {} vs rel_l2 {} as is",
            m.describe("rank"),
            match m.errors.iter().copied().filter(|e| e.is_finite()).fold(0.0, f64::max) {
                0.0 => "exactly".to_string(),
                e => format!("within rel_l2 {}", sci(e, 2)),
            },
            sci(x.as_is(), 2)
        ),
        "rank r must load heads [r·N/tp, (r+1)·N/tp) of q_b_proj, kv_b_proj and o_proj; check the rank \
         index the loader slices with (every rank loading rank 0's slice was the vLLM GGUF plugin bug)"
            .into(),
    )
}

/// `tp-rank-order`, only under TP (the run's or the dump's TP size ≥ 2): each rank's shard of a
/// `w.*.rank<r>` weight, or each rank's head block of a head-split site, matched against the
/// reference's: a permutation, one rank everywhere, duplicates or missing ranks; then the heads
/// of a kv_b-derived weight site in another order ([`head_order`], as `weights --check` judges a
/// loaded one), unless a kv_b layout explains it; for the MLP's activations,
/// [`mlp_output_ranks`].
pub(super) fn tp_rank_order(x: &SiteCtx<'_>) -> Option<Detection> {
    // Never without TP: a dump that declares none is judged at TP 1, and a rank class there
    // would name ranks the engine may not have had (weights --check decides the same).
    let tp = x.input.tp;
    if tp < 2 {
        return None;
    }
    if x.site.stage.is_ffn() {
        return mlp_output_ranks(x);
    }
    if let Stage::WRank(w, _) = x.site.stage {
        // A kv_b layout inside the shard is that class, as weights --check names the shard.
        if shard_kv_b_layout(x).is_some() {
            return None;
        }
        // Gather every rank's shard of this weight on both sides and match them as blocks.
        let gather = |tr: &Trace| -> Option<Vec<Vec<f64>>> {
            (0..tp as u32)
                .map(|r| tr.get(&Site::new(x.site.layer, Stage::WRank(w, r))).map(|t| t.to_f64()))
                .collect()
        };
        if let (Some(c), Some(rf)) = (gather(x.path.trace), gather(x.input.reference)) {
            let len = rf[0].len();
            let shape = [tp, len];
            if let Some(m) = find_blocks(&c.concat(), &rf.concat(), &shape, 0, &vec![1; tp], x.explain)
                && m.explains()
            {
                if w.is_ffn() {
                    return Some(describe_mlp_ranks(&m.map, worst(&m.errors), w, "slice", x));
                }
                return Some(describe_ranks(&m, &format!("per-rank shards of {}", w.as_str()), x));
            }
        }
        // The shard's own heads in another order, as weights --check reads a loaded shard.
        let (axis, unit) = match site_param(x.input.cfg, x.site.stage)?.1 {
            TpSplit::ColumnByHeads(h) => (0, h.width(x.input.cfg.dims())),
            TpSplit::RowByHeads(h) => (1, h.width(x.input.cfg.dims())),
            _ => return None,
        };
        let m = head_order(&x.cand.to_f64(), &x.refr.to_f64(), &x.refr.shape, axis, unit, x.explain)?;
        return Some(head_order_detection(&m, unit, axis, Class::TpRankOrder, x.as_is()));
    }
    let (axis, block) = rank_axis(x.site.stage, x.input.cfg, tp)?;
    let dim = *x.refr.shape.get(axis)?;
    if dim % block != 0 || dim / block != tp {
        return None;
    }
    let (cand, refr) = (x.cand.to_f64(), x.refr.to_f64());
    // A kv_b-derived weight: a kv_b layout that explains it is that class (as in weights
    // --check), though a grouped split also moves whole blocks.
    if KvBWeight::of_stage(x.site.stage).is_some() {
        let kvb = x.ref_site(Stage::WKvB)?.to_f64();
        if site_kv_b_view(x, &kvb, &cand).is_some_and(|v| kv_b_layout_of(&v).is_some()) {
            return None;
        }
    }
    if let Some(m) = find_blocks(&cand, &refr, &x.refr.shape, axis, &vec![block; tp], x.explain)
        && m.explains()
    {
        return Some(describe_ranks(
            &m,
            &format!("rank blocks of {}", x.site.stage.name()),
            x,
        ));
    }
    // Heads in another order within or across the ranks' blocks, as weights --check sees a
    // loaded weight's heads.
    if x.site.stage.is_weight() {
        let (axis, unit) = kv_b_head_blocks(x.site.stage, x.input.cfg);
        let m = head_order(&cand, &refr, &x.refr.shape, axis, unit, x.explain)?;
        return Some(head_order_detection(
            &m,
            unit,
            axis,
            head_order_class(tp, true),
            x.as_is(),
        ));
    }
    None
}

/// Which rank's block each rank has, as evidence says it; `map[r]` is the reference rank whose
/// block rank r has. For a weight (`what` = `slice`): "every rank holds rank 0's slice", or
/// "rank 1 holds rank 0's slice, rank 2 holds no rank's slice"; for an activation (`what` =
/// `gate/up output`): "every rank's gate/up output is rank 0's", or "rank 1's gate/up output is
/// rank 0's".
fn rank_holdings(map: &[Option<usize>], what: &str) -> String {
    let weight = what == "slice";
    if map.len() > 1 && map.iter().all(|m| *m == Some(0)) {
        return if weight {
            format!("every rank holds rank 0's {what}")
        } else {
            format!("every rank's {what} is rank 0's")
        };
    }
    map.iter()
        .enumerate()
        .filter_map(|(r, m)| match (m, weight) {
            (Some(s), true) if *s != r => Some(format!("rank {r} holds rank {s}'s {what}")),
            (Some(s), false) if *s != r => Some(format!("rank {r}'s {what} is rank {s}'s")),
            (None, true) => Some(format!("rank {r} holds no rank's {what}")),
            (None, false) => Some(format!("rank {r}'s {what} is no rank's")),
            _ => None,
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The largest finite error of matched blocks (0 when none is finite).
fn worst(errors: &[f64]) -> f64 {
    errors.iter().copied().filter(|e| e.is_finite()).fold(0.0, f64::max)
}

/// The finding of the MLP's per-rank blocks matched as `map` (rank r holds the reference's
/// block `map[r]`, the largest error of a matched block `err`) at a `w.gate_up`/`w.down` shard
/// (`weight`, blocks called `what`) or an activation of the MLP (`weight` = `GateUp`, the
/// projection whose slice decides it).
fn describe_mlp_ranks(
    map: &[Option<usize>],
    err: f64,
    weight: crate::core::trace::RankedWeight,
    what: &str,
    x: &SiteCtx<'_>,
) -> Detection {
    use crate::core::trace::RankedWeight;
    let every_rank0 = map.len() > 1 && map.iter().all(|m| *m == Some(0));
    let hint = match weight {
        RankedWeight::GateUp if every_rank0 => HINT_MERGED_COLUMN_RANK0.to_string(),
        RankedWeight::Down => "down_proj is row-parallel: rank r must hold its input columns r·I/tp..(r+1)·I/tp; \
                               check the rank index its loader slices with"
            .to_string(),
        _ => "gate_up_proj is merged column-parallel: rank r must hold [gate rows r·I/tp.. | up rows r·I/tp..]; \
              check the rank index its merged-column loader slices with"
            .to_string(),
    };
    let proj = if weight == RankedWeight::Down {
        "down_proj"
    } else {
        "gate_up_proj"
    };
    let matched = if err == 0.0 {
        "blocks matched exactly".to_string()
    } else {
        format!("blocks matched within rel_l2 {}", sci(err, 2))
    };
    let of = if what == "slice" {
        format!(" of {proj}")
    } else {
        String::new()
    };
    Detection::new(
        format!(
            "{}: {}{of} ({matched} vs rel_l2 {} as is)",
            x.site.stage.name(),
            rank_holdings(map, what),
            sci(x.as_is(), 2)
        ),
        hint,
    )
}

/// The reference's `ffn_gate_up.rank<s>` for `tp` ranks, `[T, 2·I/tp]` row-major: the columns
/// `s·I/tp..(s+1)·I/tp` of its `ffn_gate` then of its `ffn_up` ([T, I] each).
fn reference_gate_up_block(gate: &[f64], up: &[f64], t: usize, i: usize, tp: usize, s: usize) -> Vec<f64> {
    let ir = i / tp;
    let mut out = Vec::with_capacity(t * 2 * ir);
    for ti in 0..t {
        out.extend_from_slice(&gate[ti * i + s * ir..ti * i + (s + 1) * ir]);
        out.extend_from_slice(&up[ti * i + s * ir..ti * i + (s + 1) * ir]);
    }
    out
}

/// `tp-rank-order` from the MLP's activations alone (a dump without loaded weights): each rank's
/// `ffn_gate_up.rank<r>` replayed against every rank's block of the reference
/// (`[ffn_gate | ffn_up]` columns of that rank), or the gathered `ffn_gate`/`ffn_up`/`ffn_act`
/// [T, I] matched block by block along the columns, one block per rank, at the run's (or the
/// dump's) TP size. Generic in which rank holds which: the evidence says "rank r's gate/up
/// output is rank s's" for each displaced rank. Without TP nothing is claimed
/// ([`mlp_blocks_without_tp`] tells the hint what the blocks would say).
fn mlp_output_ranks(x: &SiteCtx<'_>) -> Option<Detection> {
    use crate::core::trace::RankedWeight;
    let gate = x.ref_site(Stage::FfnGate)?;
    let (t, i) = (*gate.shape.first()?, *gate.shape.get(1)?);
    if let Stage::FfnGateUpRank(r) = x.site.stage {
        let width = *x.cand.shape.get(1)?;
        if width == 0 || !(2 * i).is_multiple_of(width) || x.cand.shape[0] != t {
            return None;
        }
        let tp = 2 * i / width;
        if tp != x.input.tp || r as usize >= tp {
            return None;
        }
        let (g, u) = (gate.to_f64(), x.ref_site(Stage::FfnUp)?.to_f64());
        let blocks: Vec<Vec<f64>> = (0..tp).map(|s| reference_gate_up_block(&g, &u, t, i, tp, s)).collect();
        // Which reference block explains a candidate (the best one under the threshold), and
        // its error.
        let holder = |cand: &[f64]| -> Option<(usize, f64)> {
            blocks
                .iter()
                .enumerate()
                .map(|(s, b)| (s, super::blocks::rel_l2(cand, b)))
                .filter(|&(_, e)| e <= x.explain)
                .min_by(|a, b| a.1.total_cmp(&b.1))
        };
        if holder(&x.cand.to_f64()).is_none_or(|(s, _)| s == r as usize) {
            return None;
        }
        // Every rank the trace holds, so that the evidence can say "every rank".
        let held: Vec<Option<(usize, f64)>> = (0..tp as u32)
            .map(|q| {
                x.path
                    .trace
                    .get(&Site::new(x.site.layer, Stage::FfnGateUpRank(q)))
                    .and_then(|c| holder(&c.to_f64()))
            })
            .collect();
        let map: Vec<Option<usize>> = held.iter().map(|h| h.map(|(s, _)| s)).collect();
        let errors: Vec<f64> = held.iter().flatten().map(|&(_, e)| e).collect();
        return Some(describe_mlp_ranks(
            &map,
            worst(&errors),
            RankedWeight::GateUp,
            "gate/up output",
            x,
        ));
    }
    if !matches!(x.site.stage, Stage::FfnGate | Stage::FfnUp | Stage::FfnAct) || x.refr.shape != [t, i] {
        return None;
    }
    let m = mlp_column_blocks(x, &[x.input.tp])?.1;
    Some(describe_mlp_ranks(
        &m.map,
        worst(&m.errors),
        RankedWeight::GateUp,
        "gate/up output",
        x,
    ))
}

/// A gathered `ffn_gate`/`ffn_up`/`ffn_act` [T, I] of `x` matched by column block, one block per
/// rank, for the first TP size of `tps` (dividing I) whose blocks explain it: that size and the
/// match.
fn mlp_column_blocks(x: &SiteCtx<'_>, tps: &[usize]) -> Option<(usize, BlockMatch)> {
    if !matches!(x.site.stage, Stage::FfnGate | Stage::FfnUp | Stage::FfnAct) || x.refr.shape.len() != 2 {
        return None;
    }
    let i = x.refr.shape[1];
    let (c, rf) = (x.cand.to_f64(), x.refr.to_f64());
    tps.iter()
        .copied()
        .filter(|&tp| tp >= 2 && i.is_multiple_of(tp))
        .find_map(|tp| {
            let m = find_blocks(&c, &rf, &x.refr.shape, 1, &vec![i / tp; tp], x.explain)?;
            m.explains().then_some((tp, m))
        })
}

/// For a gathered MLP output judged without TP (`ffn_gate`, `ffn_up`, `ffn_act` at TP 1): what its
/// column blocks would say at a TP size of 2 to 8, as a sentence for the hint of a finding that
/// names no rank class (the dump declares no TP). `None` when no such blocks explain it.
pub(super) fn mlp_blocks_without_tp(x: &SiteCtx<'_>) -> Option<String> {
    if x.input.tp >= 2 {
        return None;
    }
    let tps: Vec<usize> = (2..=8).collect();
    let (tp, m) = mlp_column_blocks(x, &tps)?;
    Some(format!(
        "its column blocks read as {tp} TP ranks' outputs say {}, but the dump declares no TP (a format-2 header's \
         tp.size): judged at TP 1, no rank is named",
        rank_holdings(&m.map, "gate/up output")
    ))
}

/// kv_b's rows `kv_b` [heads·(P+V), L] (per head `[k_nope rows | v rows]`) regrouped in
/// `groups` equal groups of heads, each as `[all its k rows | all its v rows]`.
fn grouped_kv_b_rows(kv_b: &[f64], heads: usize, [l, p, v]: [usize; 3], groups: usize) -> Vec<f64> {
    let nh = heads / groups.max(1);
    let mut out = Vec::with_capacity(kv_b.len());
    for g in 0..groups.max(1) {
        let hs = g * nh..(g + 1) * nh;
        for h in hs.clone() {
            out.extend_from_slice(&kv_b[h * (p + v) * l..(h * (p + v) + p) * l]);
        }
        for h in hs {
            out.extend_from_slice(&kv_b[(h * (p + v) + p) * l..(h + 1) * (p + v) * l]);
        }
    }
    out
}

/// The hint of a kv_b output split grouped per rank instead of per head.
const KV_B_GROUPED_HINT: &str = "kv_b_proj rows are per head [k_nope_h | v_h]: view the output as [T, N, P+V] and \
                                 split the last dim, not [all k_nope | all v]";
/// The hint of `attn_k_b` reshaped instead of transposed.
const K_B_UNTRANSPOSED_HINT: &str = "attn_k_b is stored [N, L, P] (transposed): kv_b / W_UK_T need \
                                     k_b.transpose(1, 2), not a reshape of the same bytes";
/// The hint of `W_UV` holding kv_b's v rows untransposed.
const W_UV_UNTRANSPOSED_HINT: &str = "W_UV is [N, L, V]: per head, kv_b's V rows ([V, L], as attn_v_b stores them) \
                                      transposed; a reshape of the same bytes is not";
/// The hint of a kv_b-derived weight whose heads are in another order, without TP.
const KV_B_HEADS_HINT: &str = "kv_b_proj, W_UK_T and W_UV hold the heads in order 0..N: check how the loader \
                               splits and concatenates kv_b's rows per head";

/// kv_b-derived weights: the tensors a kv_b layout mistake shows in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum KvBWeight {
    /// `kv_b_proj` [heads·(P+V), L] (`w.kv_b`, `w.kv_b.rank<r>`).
    KvB,
    /// `W_UK_T` [heads, P, L] (`w.W_UK_T`).
    UkT,
    /// `W_UV` [heads, L, V] (`w.W_UV`).
    Uv,
}

impl KvBWeight {
    /// The kv_b-derived weight a weight site holds.
    pub(super) fn of_stage(stage: Stage) -> Option<KvBWeight> {
        match stage {
            Stage::WKvB | Stage::WRank(crate::core::trace::RankedWeight::KvB, _) => Some(KvBWeight::KvB),
            Stage::WUkT => Some(KvBWeight::UkT),
            Stage::WUv => Some(KvBWeight::Uv),
            _ => None,
        }
    }

    /// The kv_b-derived weight a weights file's param is (`kv_b_proj`, `W_UK_T`, `W_UV`).
    pub(super) fn of_param(param: &str) -> Option<KvBWeight> {
        match param {
            "kv_b_proj" => Some(KvBWeight::KvB),
            "W_UK_T" => Some(KvBWeight::UkT),
            "W_UV" => Some(KvBWeight::Uv),
            _ => None,
        }
    }

    /// What a site's evidence calls it: `w.kv_b`, `W_UK_T`, `W_UV`.
    fn site_label(self) -> &'static str {
        match self {
            KvBWeight::KvB => "w.kv_b",
            KvBWeight::UkT => "W_UK_T",
            KvBWeight::Uv => "W_UV",
        }
    }
}

/// One kv_b-derived weight as the kv_b layout hypotheses judge it, from a site or from a
/// weights file: the same decision for `compare` and `weights --check`.
pub(super) struct KvBView<'a> {
    /// Which weight.
    pub(super) which: KvBWeight,
    /// What evidence calls it (`w.kv_b`, `W_UK_T`; a weights file's tensor name).
    pub(super) label: &'a str,
    /// Its values as the engine holds them, row-major.
    pub(super) cand: &'a [f64],
    /// kv_b's rows [heads·(P+V), L] of the heads it holds, rebuilt from the GGUF.
    pub(super) kv_b: &'a [f64],
    /// The heads it holds.
    pub(super) heads: usize,
    /// `[L, P, V]`.
    pub(super) lpv: [usize; 3],
    /// The TP ranks whose heads it spans (a grouped split regroups each rank's rows): the TP
    /// size for a whole tensor, 1 for one rank's shard or without TP.
    pub(super) groups: usize,
    /// The rel_l2 at or under which a hypothesis explains it.
    pub(super) thr: f64,
    /// Its rel_l2 as is (a hypothesis must do better).
    pub(super) as_is: f64,
}

impl KvBView<'_> {
    /// The rel_l2 of the candidate against `alt`, when it explains the candidate.
    fn explained_by(&self, alt: &[f64]) -> Option<f64> {
        if alt.len() != self.cand.len() {
            return None;
        }
        let e = rel_l2(self.cand, alt);
        (e <= self.thr && e < self.as_is).then_some(e)
    }

    /// "(rel_l2 e vs as-is as is)".
    fn vs(&self, e: f64) -> String {
        format!("rel_l2 {} vs {} as is", sci(e, 2), sci(self.as_is, 2))
    }

    /// The rows a loader that splits kv_b grouped per rank builds: `kv_b_proj` regrouped; of each
    /// group's rows (per head `[k | v]`), the first heads·P taken as `W_UK_T` [·, P, L] and the
    /// last heads·V as the V rows [·, V, L], permuted to `W_UV` [·, L, V].
    fn grouped(&self) -> Vec<f64> {
        self.grouped_in(self.groups.max(1))
    }

    /// [`Self::grouped`] with `groups` equal groups of heads (each `heads / groups` heads).
    fn grouped_in(&self, groups: usize) -> Vec<f64> {
        let [l, p, v] = self.lpv;
        let groups = groups.max(1);
        if self.which == KvBWeight::KvB {
            return grouped_kv_b_rows(self.kv_b, self.heads, self.lpv, groups);
        }
        let nh = self.heads / groups;
        let mut out = Vec::with_capacity(self.cand.len());
        for g in 0..groups {
            let rows = &self.kv_b[g * nh * (p + v) * l..(g + 1) * nh * (p + v) * l];
            let (k_rows, v_rows) = rows.split_at(nh * p * l);
            if self.which == KvBWeight::UkT {
                out.extend_from_slice(k_rows);
                continue;
            }
            for h in 0..nh {
                for li in 0..l {
                    out.extend((0..v).map(|vi| v_rows[(h * v + vi) * l + li]));
                }
            }
        }
        out
    }

    /// Head `h` of the weight as it should be: kv_b's rows `[k | v]`, `W_UK_T[h]` (the k rows,
    /// [P, L]), `W_UV[h]` (the v rows transposed, [L, V]).
    fn head(&self, h: usize) -> Vec<f64> {
        let [l, p, v] = self.lpv;
        let rows = &self.kv_b[h * (p + v) * l..(h + 1) * (p + v) * l];
        match self.which {
            KvBWeight::KvB => rows.to_vec(),
            KvBWeight::UkT => rows[..p * l].to_vec(),
            KvBWeight::Uv => transpose(&rows[p * l..], v, l),
        }
    }

    /// The weight with position `i` holding head `src(i)` (within each TP group of heads).
    fn heads_from(&self, src: impl Fn(usize) -> usize) -> Vec<f64> {
        (0..self.heads).flat_map(|i| self.head(src(i))).collect()
    }

    /// The weight built from kv_b with each head's halves exchanged, `[v_h | k_h]` (P = V):
    /// `W_UK_T[h]` is then the v rows and `W_UV[h]` the k rows transposed.
    fn halves_swapped(&self) -> Option<Vec<f64>> {
        let [l, p, v] = self.lpv;
        if p != v {
            return None;
        }
        Some(
            (0..self.heads)
                .flat_map(|h| {
                    let rows = &self.kv_b[h * (p + v) * l..(h + 1) * (p + v) * l];
                    let (k, vr) = rows.split_at(p * l);
                    match self.which {
                        KvBWeight::KvB => [vr, k].concat(),
                        KvBWeight::UkT => vr.to_vec(),
                        KvBWeight::Uv => transpose(k, p, l),
                    }
                })
                .collect(),
        )
    }

    /// The weight with its heads interleaved by `g` within each TP group: position `i` of a
    /// group of `nh` heads holds head `(i mod g)·nh/g + i/g` (order 0, nh/g, 2·nh/g, …, 1, …).
    fn interleaved(&self, g: usize) -> Option<Vec<f64>> {
        let nh = self.heads / self.groups.max(1);
        if g < 2 || nh < 2 * g || !nh.is_multiple_of(g) {
            return None;
        }
        Some(self.heads_from(|i| {
            let (base, j) = (i / nh * nh, i % nh);
            base + (j % g) * (nh / g) + j / g
        }))
    }

    /// kv_b's rows with each head's `[P+V, L]` block holding the bytes of its transpose
    /// (`[L, P+V]`, as a loader that concatenates `k_b` and `v_bᵀ` along L's other side builds
    /// it) read back as `[P+V, L]`.
    fn blocks_transposed(&self) -> Option<Vec<f64>> {
        let [l, p, v] = self.lpv;
        (self.which == KvBWeight::KvB).then(|| {
            (0..self.heads)
                .flat_map(|h| transpose(&self.kv_b[h * (p + v) * l..(h + 1) * (p + v) * l], p + v, l))
                .collect()
        })
    }

    /// The weight's per-head matrix read without the transpose it needs: `attn_k_b[h]` [L, P]
    /// read with a reshape as [P, L] (in kv_b's k rows, or `W_UK_T`), or kv_b's v rows [V, L]
    /// read as `W_UV[h]` [L, V]. The same bytes as the weight held with its last two dims
    /// swapped, which a dump reads in the expected shape.
    fn untransposed(&self) -> Option<Vec<f64>> {
        let [l, p, v] = self.lpv;
        let kvb = self.kv_b;
        let k_of = |h: usize| {
            let k_rows = &kvb[h * (p + v) * l..(h * (p + v) + p) * l]; // [P, L] = k_b[h]ᵀ
            let mut kb = vec![0f64; l * p]; // k_b[h] as [L, P], row-major
            for pi in 0..p {
                for li in 0..l {
                    kb[li * p + pi] = k_rows[pi * l + li];
                }
            }
            kb // read as [P, L] row-major: the reshape
        };
        match self.which {
            KvBWeight::KvB => {
                let mut alt = kvb.to_vec();
                for h in 0..self.heads {
                    alt[h * (p + v) * l..(h * (p + v) + p) * l].copy_from_slice(&k_of(h));
                }
                Some(alt)
            }
            KvBWeight::UkT => Some((0..self.heads).flat_map(k_of).collect()),
            KvBWeight::Uv => Some(
                (0..self.heads)
                    .flat_map(|h| kvb[(h * (p + v) + p) * l..(h + 1) * (p + v) * l].iter().copied())
                    .collect(),
            ),
        }
    }
}

/// `m` [rows, cols] row-major, transposed: [cols, rows].
fn transpose(m: &[f64], rows: usize, cols: usize) -> Vec<f64> {
    (0..cols)
        .flat_map(|c| (0..rows).map(move |r| m[r * cols + c]))
        .collect()
}

/// The hint of kv_b's halves taken in the other order.
const KV_B_HALVES_HINT: &str = "kv_b_proj rows are per head [k_nope_h (P rows) | v_h (V rows)]: with P = V a split \
                                 in the other order loads without a shape error; take the k rows first";
/// The hint of kv_b's heads interleaved.
const KV_B_INTERLEAVED_HINT: &str = "kv_b_proj, W_UK_T and W_UV hold the heads in order 0..N: a loader that views the \
                                     heads as [g, N/g] (or [N/g, g]) and flattens the other way interleaves them";
/// The hint of kv_b's per-head blocks holding their transpose.
const KV_B_BLOCK_T_HINT: &str = "each head of kv_b_proj is a [P+V, L] (out, in) block: building it as [L, P+V] (k_b \
                                 and v_bᵀ concatenated along the last dim) and reshaping reads it transposed";

/// `kv-b-layout` on a kv_b-derived weight, the one decision of `compare` (the weight sites) and
/// `weights --check` (the loaded tensors): its rows split grouped `[all k | all v]` per rank
/// instead of per head, or `attn_k_b` reshaped instead of transposed; and the split variants of
/// the same family: each head's halves exchanged (P = V), the heads interleaved by 2 or 4 within
/// a rank, grouped `[all k | all v]` in groups of 2, 4, … heads, or each head's kv_b block read
/// transposed.
pub(super) fn kv_b_layout_of(w: &KvBView<'_>) -> Option<Detection> {
    let [l, p, v] = w.lpv;
    if w.kv_b.len() != w.heads * (p + v) * l || w.heads == 0 || !w.heads.is_multiple_of(w.groups.max(1)) {
        return None;
    }
    let label = w.label;
    if let Some(e) = w.untransposed().and_then(|alt| w.explained_by(&alt)) {
        if w.which == KvBWeight::Uv {
            return Some(Detection::new(
                format!(
                    "{label} equals kv_b's v rows as stored, [N, V, L] read as [N, L, V] without their transpose ({})",
                    w.vs(e)
                ),
                W_UV_UNTRANSPOSED_HINT.into(),
            ));
        }
        let what = if w.which == KvBWeight::KvB {
            format!("{label}'s k rows equal")
        } else {
            format!("{label} equals")
        };
        return Some(Detection::new(
            format!(
                "{what} k_b reshaped [N, L, P] → [N, P, L] instead of transposed ({})",
                w.vs(e)
            ),
            K_B_UNTRANSPOSED_HINT.into(),
        ));
    }
    if let Some(e) = w.explained_by(&w.grouped()) {
        let what = if w.which == KvBWeight::KvB {
            format!("{label} rows are grouped [all k | all v] per rank")
        } else {
            format!("{label} equals kv_b's rows split grouped [all k | all v]")
        };
        return Some(Detection::new(
            format!("{what} ({})", w.vs(e)),
            KV_B_GROUPED_HINT.into(),
        ));
    }
    kv_b_split_variant(w)
}

/// The kv_b split variants beyond the grouped split and the untransposed `k_b`
/// ([`kv_b_layout_of`]).
fn kv_b_split_variant(w: &KvBView<'_>) -> Option<Detection> {
    let [_, p, v] = w.lpv;
    let label = w.label;
    if let Some(e) = w.halves_swapped().and_then(|alt| w.explained_by(&alt)) {
        let what = match w.which {
            KvBWeight::KvB => format!("{label} holds each head as [v | k_nope]: the halves exchanged"),
            KvBWeight::UkT => format!("{label} equals kv_b's v rows per head: the halves exchanged"),
            KvBWeight::Uv => format!("{label} equals kv_b's k rows per head, transposed: the halves exchanged"),
        };
        return Some(Detection::new(
            format!("{what} (P = V = {p}; {})", w.vs(e)),
            KV_B_HALVES_HINT.into(),
        ));
    }
    for g in [2, 4] {
        if let Some(e) = w.interleaved(g).and_then(|alt| w.explained_by(&alt)) {
            let nh = w.heads / w.groups.max(1);
            let order: Vec<String> = (0..nh.min(8))
                .map(|j| ((j % g) * (nh / g) + j / g).to_string())
                .collect();
            return Some(Detection::new(
                format!(
                    "{label}'s heads are interleaved by {g}{}: order {}{} ({})",
                    if w.groups > 1 { " within each rank" } else { "" },
                    order.join(", "),
                    if nh > 8 { ", …" } else { "" },
                    w.vs(e)
                ),
                KV_B_INTERLEAVED_HINT.into(),
            ));
        }
    }
    let nh = w.heads / w.groups.max(1);
    let mut g = 2;
    while g < nh {
        if nh.is_multiple_of(g)
            && let Some(e) = w.explained_by(&w.grouped_in(w.heads / g))
        {
            let what = if w.which == KvBWeight::KvB {
                format!("{label} rows are grouped [all k | all v] in groups of {g} heads")
            } else {
                format!("{label} equals kv_b's rows split grouped [all k | all v] in groups of {g} heads")
            };
            return Some(Detection::new(
                format!("{what} ({})", w.vs(e)),
                KV_B_GROUPED_HINT.into(),
            ));
        }
        g *= 2;
    }
    let e = w.blocks_transposed().and_then(|alt| w.explained_by(&alt))?;
    Some(Detection::new(
        format!(
            "{label}'s per-head blocks are [L, P+V] reshaped to [P+V, L] = [{}, L] instead of transposed ({})",
            p + v,
            w.vs(e)
        ),
        KV_B_BLOCK_T_HINT.into(),
    ))
}

/// The heads of a head-split weight in another order: its per-head blocks (`unit` rows each
/// along `axis`) matched to the expected tensor's, every position matched and some displaced (a
/// permutation, one head everywhere, duplicates). A partial match (positions that hold no head's
/// block) is not a head order: a grouped split matches some heads by accident.
pub(super) fn head_order(
    cand: &[f64],
    exp: &[f64],
    shape: &[usize],
    axis: usize,
    unit: usize,
    thr: f64,
) -> Option<BlockMatch> {
    let heads = shape.get(axis)? / unit.max(1);
    if heads < 2 || cand.len() != exp.len() {
        return None;
    }
    let m = find_blocks(cand, exp, shape, axis, &vec![unit; heads], thr)?;
    (m.explains() && m.map.iter().all(Option::is_some)).then_some(m)
}

/// The class a head-split weight whose heads are in another order ([`head_order`]) gets, the same
/// in `compare` and `weights --check`: `tp-rank-order` under TP (`tp` ≥ 2: a loader sliced the
/// heads with the wrong rank or order); without TP, `kv-b-layout` for a kv_b-derived weight (a
/// split variant of kv_b) and `mismatch` for any other, never a TP class.
pub(super) fn head_order_class(tp: usize, kv_b_derived: bool) -> Class {
    if tp >= 2 {
        Class::TpRankOrder
    } else if kv_b_derived {
        Class::KvBLayout
    } else {
        Class::Mismatch
    }
}

/// The evidence and hint of heads found in order `m` (blocks of `unit` rows along `axis`) in a
/// tensor of `class` ([`head_order_class`]).
pub(super) fn head_order_detection(m: &BlockMatch, unit: usize, axis: usize, class: Class, as_is: f64) -> Detection {
    let hint = match class {
        Class::TpRankOrder => {
            "rank r must load heads [r·N/tp, (r+1)·N/tp) of q_b_proj, kv_b_proj and o_proj, in order; \
                               check the rank index and the head order the loader slices with"
                .to_string()
        }
        Class::KvBLayout => KV_B_HEADS_HINT.to_string(),
        _ => "heads are cut or concatenated in the wrong order".to_string(),
    };
    Detection::new(
        format!(
            "per-head blocks of {unit} along dim {axis}: {} ({} vs rel_l2 {} as is)",
            m.describe("head"),
            match worst(&m.errors) {
                0.0 => "matched exactly".to_string(),
                e => format!("matched within rel_l2 {}", sci(e, 2)),
            },
            sci(as_is, 2)
        ),
        hint,
    )
}

/// The kv_b-derived weight site `x` as [`KvBView`]: the reference's `w.kv_b` rows of the site's
/// heads (all N of the whole weight), grouped by the run's TP size.
fn site_kv_b_view<'a>(x: &'a SiteCtx<'_>, kvb: &'a [f64], cand: &'a [f64]) -> Option<KvBView<'a>> {
    let [n, l, p, _, v] = x.input.cfg.dims().nlprv();
    let which = KvBWeight::of_stage(x.site.stage)?;
    Some(KvBView {
        which,
        label: which.site_label(),
        cand,
        kv_b: kvb,
        heads: n,
        lpv: [l, p, v],
        groups: x.input.tp.max(1),
        thr: x.explain,
        as_is: x.as_is(),
    })
}

/// `transposed` at a weight site that holds the reference's weight `[in, out]` in the expected
/// shape (a square matrix, whose transpose no shape shows): the same test as `weights --check`'s
/// ([`super::loaded::transposed_of`]). A transposed weight of another shape differs in shape and
/// is named where the shapes are compared; `W_UK_T`/`W_UV` are `kv-b-layout`.
pub(super) fn transposed(x: &SiteCtx<'_>) -> Option<Detection> {
    if !x.site.stage.is_weight() || x.cand.shape != x.refr.shape {
        return None;
    }
    let k = x.refr.shape.len();
    if k < 2 {
        return None;
    }
    let mut swapped = x.refr.shape.clone();
    swapped.swap(k - 2, k - 1);
    let param = crate::model::tensors::dump_name(site_param(x.input.cfg, x.site.stage)?.0);
    let src = gguf_sources(x.input.cfg, x.site.layer, x.site.stage).join(" + ");
    let fused = x.input.cfg.kv_b_layout == crate::model::config::KvBLayout::Fused;
    let (class, d) = super::loaded::transposed_of(
        param,
        &x.cand.to_f64(),
        &swapped,
        &x.refr.to_f64(),
        &x.refr.shape,
        x.explain,
        &src,
        fused,
    )?;
    (class == Class::Transposed).then_some(d)
}

/// [`kv_b_layout_of`] on one rank's `w.kv_b.rank<r>` shard of `x`, against the reference's
/// `w.kv_b` rows of the rank's heads (as weights --check judges a loaded shard). `None` for any
/// other site, or when no kv_b layout explains the shard.
fn shard_kv_b_layout(x: &SiteCtx<'_>) -> Option<Detection> {
    let Stage::WRank(crate::core::trace::RankedWeight::KvB, r) = x.site.stage else {
        return None;
    };
    let [n, l, p, _, v] = x.input.cfg.dims().nlprv();
    let nh = n / x.input.tp.max(1);
    let r = r as usize;
    let kvb = x.ref_site(Stage::WKvB)?.to_f64();
    let rows = kvb.get(r * nh * (p + v) * l..(r + 1) * nh * (p + v) * l)?;
    let (cand, label) = (x.cand.to_f64(), x.site.stage.name());
    kv_b_layout_of(&KvBView {
        which: KvBWeight::KvB,
        label: &label,
        cand: &cand,
        kv_b: rows,
        heads: nh,
        lpv: [l, p, v],
        groups: 1,
        thr: x.explain,
        as_is: x.as_is(),
    })
}

/// kv_b layout faults: rows grouped `[all k | all v]` per rank instead of per head, or `attn_k_b`
/// reshaped instead of transposed, at the site where they show (a rank's `w.kv_b.rank<r>`
/// shard included); without TP, a kv_b-derived weight whose heads are in another order.
pub(super) fn kv_b_layout(x: &SiteCtx<'_>) -> Option<Detection> {
    match x.site.stage {
        Stage::WRank(crate::core::trace::RankedWeight::KvB, _) => shard_kv_b_layout(x),
        Stage::WKvB | Stage::WUkT | Stage::WUv => {
            let cand = x.cand.to_f64();
            let kvb = x.ref_site(Stage::WKvB)?.to_f64();
            let view = site_kv_b_view(x, &kvb, &cand)?;
            if let Some(d) = kv_b_layout_of(&view) {
                return Some(d);
            }
            if x.input.tp >= 2 {
                return None;
            }
            let (axis, unit) = kv_b_head_blocks(x.site.stage, x.input.cfg);
            let m = head_order(&cand, &x.refr.to_f64(), &x.refr.shape, axis, unit, x.explain)?;
            Some(head_order_detection(&m, unit, axis, Class::KvBLayout, x.as_is()))
        }
        Stage::KNope | Stage::V => kv_b_layout_k_nope_v(x),
        _ => None,
    }
}

/// The axis and rows per head of a kv_b-derived weight site: kv_b's `P+V` rows on dim 0, one
/// head per index of dim 0 for `W_UK_T`/`W_UV`.
fn kv_b_head_blocks(stage: Stage, cfg: &MlaConfig) -> (usize, usize) {
    match stage {
        Stage::WUkT | Stage::WUv => (0, 1),
        _ => (0, cfg.qk_nope_head_dim + cfg.v_head_dim),
    }
}

/// `k_nope`/`v`: the reference kv_b output split grouped `[all k_nope | all v]` per rank.
fn kv_b_layout_k_nope_v(x: &SiteCtx<'_>) -> Option<Detection> {
    let [n, _, p, _, v] = x.input.cfg.dims().nlprv();
    let tp = x.input.tp.max(1);
    let nh = n / tp;
    let k_nope = x.ref_site(Stage::KNope)?;
    let v_ref = x.ref_site(Stage::V)?;
    let t = k_nope.shape[0];
    let mut alt = Vec::with_capacity(x.cand.len());
    for ti in 0..t {
        for rank in 0..tp {
            // The rank's kv_b output row: per head [k_nope_h | v_h].
            let mut row = Vec::with_capacity(nh * (p + v));
            for h in rank * nh..(rank + 1) * nh {
                row.extend((0..p).map(|d| k_nope.get((ti * n + h) * p + d)));
                row.extend((0..v).map(|d| v_ref.get((ti * n + h) * v + d)));
            }
            if x.site.stage == Stage::KNope {
                alt.extend_from_slice(&row[..nh * p]);
            } else {
                alt.extend_from_slice(&row[nh * p..]);
            }
        }
    }
    let e = x.explained_by(&alt)?;
    Some(Detection::new(
        format!(
            "{} equals the reference kv_b_proj output split grouped as [all k_nope | all v] ({})",
            x.site.stage.name(),
            x.vs_as_is(e)
        ),
        KV_B_GROUPED_HINT.into(),
    ))
}

/// A finding for a TP cut that falls inside a quant block.
pub fn misaligned_finding(u: &Unservable, path: PathLabel) -> Finding {
    Finding::at_site(
        Class::QuantBlockMisaligned,
        u.site,
        Some(path),
        Detection::new(
            format!(
                "{} ({}, blocks of {} along ne[0]) would be cut at element {} of ne[0], inside a block; not run",
                u.tensor, u.ggml_type, u.block_size, u.at
            ),
            format!(
                "{}: a quantized shard must start and end on a {}-element block boundary",
                u.reason, u.block_size
            ),
        ),
    )
}

/// Findings for GGUF weights that hold NaN/Inf after dequantization: one per tensor, at the
/// first site that consumes it (the tensor table's `first_site`: `q` for `attn_q_b`, `idx_q` for
/// `indexer.attn_q_b`, `moe_out` for a routed expert; `hidden_out` for a name outside the
/// table), for no path (the file itself is wrong; every path inherits it).
pub fn weight_nonfinite_findings(layer: usize, bad: &[NonFiniteTensor], numel: impl Fn(&str) -> usize) -> Vec<Finding> {
    bad.iter()
        .map(|t| {
            let tensor = &t.name;
            // The first site that reads the tensor; a routed expert's slice carries ` (expert e)`.
            let stage = ModelTensor::parse(tensor.split(" (").next().unwrap_or(tensor))
                .and_then(|(_, t)| t.row().first_site)
                .unwrap_or(Stage::HiddenOut);
            Finding::at_site(
                Class::WeightNonfinite,
                Site::new(layer, stage),
                None,
                Detection::new(
                    format!(
                        "{tensor} holds {} non-finite value(s) of {} after dequantization, the first at flat index {} (PyTorch layout)",
                        t.count,
                        numel(tensor),
                        t.first_index
                    ),
                    "the GGUF itself is corrupt (a quant block with a NaN/Inf scale, or a bad conversion): every engine loading it computes garbage; re-convert or re-download the file".into(),
                ),
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The site a non-finite tensor named `name` is reported at.
    fn site_of(name: &str) -> Stage {
        let bad = [NonFiniteTensor {
            name: name.to_string(),
            count: 1,
            first_index: 0,
        }];
        let f = weight_nonfinite_findings(3, &bad, |_| 1);
        f[0].site().map(|s| s.stage).unwrap()
    }

    #[test]
    fn a_nonfinite_tensor_is_reported_where_it_is_first_read() {
        assert_eq!(site_of("blk.3.attn_q_b.weight"), Stage::Q);
        assert_eq!(site_of("blk.3.attn_kv_a_mqa.weight"), Stage::KvA);
        assert_eq!(site_of("blk.3.attn_v_b.weight"), Stage::WKvB);
        assert_eq!(site_of("blk.3.attn_output.weight"), Stage::OProj);
        assert_eq!(site_of("blk.3.ffn_norm.weight"), Stage::FfnIn);
        assert_eq!(site_of("blk.3.ffn_up.weight"), Stage::FfnUp);
        assert_eq!(site_of("blk.3.ffn_down.weight"), Stage::FfnOut);
        assert_eq!(site_of("blk.3.ffn_gate_shexp.weight"), Stage::FfnGate);
        assert_eq!(site_of("blk.3.exp_probs_b.bias"), Stage::MoeTopk);
        assert_eq!(site_of("blk.3.ffn_up_exps.weight (expert 7)"), Stage::MoeOut);
        assert_eq!(site_of("blk.3.ffn_down_shexp.weight"), Stage::SharedOut);
        // The DSA indexer's tensors feed the indexer's own sites.
        assert_eq!(site_of("blk.3.indexer.attn_q_b.weight"), Stage::IdxQ);
        assert_eq!(site_of("blk.3.indexer.attn_k.weight"), Stage::IdxK);
        assert_eq!(site_of("blk.3.indexer.k_norm.weight"), Stage::IdxK);
        assert_eq!(site_of("blk.3.indexer.k_norm.bias"), Stage::IdxK);
        assert_eq!(site_of("blk.3.indexer.proj.weight"), Stage::IdxWeights);
        assert_eq!(site_of("blk.3.nextn.eh_proj.weight"), Stage::HiddenOut);
    }
}
