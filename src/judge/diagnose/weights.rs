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

use super::blocks::{BlockMatch, find_blocks};
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

/// A weight site whose every element is zero or the canary while the reference's is not: the
/// engine's loader never filled the parameter (its GGUF name map lacks the file's tensors for
/// it). An activation that was never written is `phantom-output`; this is its weight twin.
pub(super) fn weight_not_loaded(x: &SiteCtx<'_>) -> Option<Detection> {
    if !x.site.stage.is_weight() {
        return None;
    }
    let m = x.diff.metrics.as_ref()?;
    if m.numel == 0 || m.norm_ref == 0.0 {
        return None;
    }
    let what = if m.canary == m.numel {
        "hold the canary"
    } else if (0..x.cand.len()).all(|i| x.cand.get(i) == 0.0) {
        "are 0"
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

/// `tp-rank-order`: each rank's shard of a `w.*.rank<r>` weight, or each rank's head block of a
/// head-split site, matched against the reference's: a permutation, one rank everywhere,
/// duplicates or missing ranks; for the MLP's activations, [`mlp_output_ranks`].
pub(super) fn tp_rank_order(x: &SiteCtx<'_>) -> Option<Detection> {
    // The MLP's activations carry their TP size in their blocks: a dump judged without one
    // still shows it.
    if x.site.stage.is_ffn() {
        return mlp_output_ranks(x);
    }
    let tp = x.input.tp;
    if tp < 2 {
        return None;
    }
    if let Stage::WRank(w, _) = x.site.stage {
        // Gather every rank's shard of this weight on both sides and match them as blocks.
        let gather = |tr: &Trace| -> Option<Vec<Vec<f64>>> {
            (0..tp as u32)
                .map(|r| tr.get(&Site::new(x.site.layer, Stage::WRank(w, r))).map(|t| t.to_f64()))
                .collect()
        };
        let c = gather(x.path.trace)?;
        let rf = gather(x.input.reference)?;
        let len = rf[0].len();
        let shape = [tp, len];
        let m = find_blocks(&c.concat(), &rf.concat(), &shape, 0, &vec![1; tp], x.explain)?;
        if !m.explains() {
            return None;
        }
        if w.is_ffn() {
            return Some(describe_mlp_ranks(&m.map, worst(&m.errors), w, "slice", x));
        }
        return Some(describe_ranks(&m, &format!("per-rank shards of {}", w.as_str()), x));
    }
    let (axis, block) = rank_axis(x.site.stage, x.input.cfg, tp)?;
    let dim = *x.refr.shape.get(axis)?;
    if dim % block != 0 || dim / block != tp {
        return None;
    }
    let m = find_blocks(
        &x.cand.to_f64(),
        &x.refr.to_f64(),
        &x.refr.shape,
        axis,
        &vec![block; tp],
        x.explain,
    )?;
    m.explains()
        .then(|| describe_ranks(&m, &format!("rank blocks of {}", x.site.stage.name()), x))
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
/// [T, I] matched block by block along the columns, one block per rank. The TP size is the
/// run's, or for a dump judged without one the block width (`ffn_gate_up.rank<r>`) or the
/// smallest one (2..=8, dividing I) whose blocks explain the candidate. Generic in which rank
/// holds which: the evidence says "rank r's gate/up output is rank s's" for each displaced rank.
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
        if tp < 2 || r as usize >= tp {
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
    let (c, rf) = (x.cand.to_f64(), x.refr.to_f64());
    let tried: Vec<usize> = if x.input.tp > 1 {
        vec![x.input.tp]
    } else {
        (2..=8).collect()
    };
    tried
        .into_iter()
        .filter(|&tp| i.is_multiple_of(tp))
        .find_map(|tp| {
            let m = find_blocks(&c, &rf, &x.refr.shape, 1, &vec![i / tp; tp], x.explain)?;
            m.explains().then_some(m)
        })
        .map(|m| describe_mlp_ranks(&m.map, worst(&m.errors), RankedWeight::GateUp, "gate/up output", x))
}

/// Reference kv_b rows regrouped per rank as `[all k rows | all v rows]`.
fn grouped_kv_b_rows(kv_b: &[f64], cfg: &MlaConfig, tp: usize) -> Vec<f64> {
    let [n, l, p, _, v] = cfg.dims().nlprv();
    let nh = n / tp;
    let mut out = Vec::with_capacity(kv_b.len());
    for rank in 0..tp {
        let heads = rank * nh..(rank + 1) * nh;
        for h in heads.clone() {
            out.extend_from_slice(&kv_b[h * (p + v) * l..(h * (p + v) + p) * l]);
        }
        for h in heads {
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

/// kv_b layout faults: rows grouped `[all k | all v]` per rank instead of per head, or `attn_k_b`
/// reshaped instead of transposed, at the site where they show.
pub(super) fn kv_b_layout(x: &SiteCtx<'_>) -> Option<Detection> {
    match x.site.stage {
        Stage::WKvB => kv_b_layout_w_kv_b(x),
        Stage::KNope | Stage::V => kv_b_layout_k_nope_v(x),
        Stage::WUkT => kv_b_layout_w_uk_t(x),
        Stage::WUv => kv_b_layout_w_uv(x),
        _ => None,
    }
}

/// The untransposed hypothesis for head `h` of the reference kv_b `kvb` [N·(P+V), L]: its K
/// rows [P, L] as `attn_k_b[h]` [L, P] read with a reshape instead of a transpose.
fn untransposed_k(kvb: &[f64], h: usize, l: usize, p: usize, v: usize) -> Vec<f64> {
    let k_rows = &kvb[h * (p + v) * l..(h * (p + v) + p) * l]; // [P, L] = k_b[h]ᵀ
    let mut kb = vec![0f64; l * p]; // k_b[h] as [L, P], row-major
    for pi in 0..p {
        for li in 0..l {
            kb[li * p + pi] = k_rows[pi * l + li];
        }
    }
    kb // read as [P, L] row-major: the reshape
}

/// `w.kv_b`: k rows reshaped instead of transposed, or rows grouped per rank.
fn kv_b_layout_w_kv_b(x: &SiteCtx<'_>) -> Option<Detection> {
    let [n, l, p, _, v] = x.input.cfg.dims().nlprv();
    let tp = x.input.tp.max(1);
    let kvb = x.ref_site(Stage::WKvB)?.to_f64();
    let mut alt = kvb.clone();
    for h in 0..n {
        let k = untransposed_k(&kvb, h, l, p, v);
        alt[h * (p + v) * l..(h * (p + v) + p) * l].copy_from_slice(&k);
    }
    if let Some(e) = x.explained_by(&alt) {
        return Some(Detection::new(
            format!(
                "w.kv_b's k rows equal k_b reshaped [N, L, P] → [N, P, L] instead of transposed ({})",
                x.vs_as_is(e)
            ),
            K_B_UNTRANSPOSED_HINT.into(),
        ));
    }
    let e = x.explained_by(&grouped_kv_b_rows(&kvb, x.input.cfg, tp))?;
    Some(Detection::new(
        format!("w.kv_b rows are grouped [all k | all v] per rank ({})", x.vs_as_is(e)),
        KV_B_GROUPED_HINT.into(),
    ))
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

/// W_UK_T [N, P, L] (`Stage::WUkT`) or W_UV [N, L, V] (`Stage::WUv`) as a loader builds it that
/// splits the reference kv_b `kvb` [N·(P+V), L] grouped per rank: of each rank's nh·(P+V) rows
/// (nh = N/tp, per head interleaved [k_nope_h | v_h]), the first nh·P taken as its heads' K rows
/// [nh, P, L] and the last nh·V as its V rows [nh, V, L], permuted to [nh, L, V].
fn split_kv_b_grouped(kvb: &[f64], cfg: &MlaConfig, tp: usize, stage: Stage) -> Vec<f64> {
    let [n, l, p, _, v] = cfg.dims().nlprv();
    let nh = n / tp;
    let mut out = Vec::with_capacity(kvb.len());
    for rank in 0..tp {
        let rank_rows = &kvb[rank * nh * (p + v) * l..(rank + 1) * nh * (p + v) * l];
        let (k_rows, v_rows) = rank_rows.split_at(nh * p * l);
        if stage == Stage::WUkT {
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

/// `W_UK_T` or `W_UV` (the failing site's stage, named `what` in the evidence): the grouped
/// split of kv_b's rows ([`split_kv_b_grouped`]), if it explains the candidate.
fn kv_b_split_grouped(x: &SiteCtx<'_>, kvb: &[f64], what: &str) -> Option<Detection> {
    let alt = split_kv_b_grouped(kvb, x.input.cfg, x.input.tp.max(1), x.site.stage);
    let e = x.explained_by(&alt)?;
    Some(Detection::new(
        format!(
            "{what} equals kv_b's rows split grouped [all k | all v] ({})",
            x.vs_as_is(e)
        ),
        KV_B_GROUPED_HINT.into(),
    ))
}

/// `W_UK_T`: kv_b's rows split grouped per rank, or `attn_k_b` reshaped instead of transposed.
fn kv_b_layout_w_uk_t(x: &SiteCtx<'_>) -> Option<Detection> {
    let kvb = x.ref_site(Stage::WKvB)?.to_f64();
    if let Some(found) = kv_b_split_grouped(x, &kvb, "W_UK_T") {
        return Some(found);
    }
    let [n, l, p, _, v] = x.input.cfg.dims().nlprv();
    let alt: Vec<f64> = (0..n).flat_map(|h| untransposed_k(&kvb, h, l, p, v)).collect();
    let e = x.explained_by(&alt)?;
    Some(Detection::new(
        format!(
            "W_UK_T equals k_b reshaped [N, L, P] → [N, P, L] instead of transposed ({})",
            x.vs_as_is(e)
        ),
        K_B_UNTRANSPOSED_HINT.into(),
    ))
}

/// `W_UV`: kv_b's rows split grouped per rank.
fn kv_b_layout_w_uv(x: &SiteCtx<'_>) -> Option<Detection> {
    kv_b_split_grouped(x, &x.ref_site(Stage::WKvB)?.to_f64(), "W_UV")
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
