//! Diagnosis: naming the bug class of each path's first divergence, with numeric evidence.
//!
//! "Tensor X differs" sends an engineer back to printing norms by hand; "`w.fused_qkv_a` holds
//! the reference shards in order \[1,0]" points at the line to fix. For each path's first
//! divergence, the detectors below each test one hypothesis against the reference trace (re-rotate
//! with the other RoPE style, re-split kv_b grouped, fit a softmax scale, match blocks to shards,
//! …). The first detector in precedence list of docs/design.md ("Diagnosis") whose hypothesis explains the candidate
//! names the [`Class`]; evidence always compares the explained error with the error as is. A clean
//! run produces no finding: every detector only runs on a site that already failed.

pub mod blocks;
mod collective;

use std::collections::BTreeSet;

use rayon::prelude::*;
use serde::Serialize;

use crate::compute::indexer;
use crate::compute::path::Unservable;
use crate::compute::reference::rope_inv_freq;
use crate::core::batch::Batch;
use crate::core::class::Class;
use crate::core::sci::sci;
use crate::core::trace::{Site, Stage, Trace, TraceTensor};
use crate::judge::label::PathLabel;
use crate::judge::metrics::{self, SiteDiff, Status, is_canary_like};
use crate::judge::tolerance::{Precision, tolerance};
use crate::model::config::{MlaConfig, RopeStyle};
use crate::model::dump::is_per_head;
use crate::model::weights::NonFiniteTensor;
use blocks::rel_l2;
use blocks::{BlockMatch, find_blocks};

/// One diagnosis: what kind of wrong, where, the numbers that show it, and where to look.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Finding {
    /// The bug class.
    pub class: Class,
    /// The site it was found at (the path's first divergence).
    pub site: Site,
    /// The path or dump (absent for findings about the file itself).
    pub path: Option<PathLabel>,
    /// Numeric evidence, e.g. "cos 0.999999 vs permuted block; 0.012 as is".
    pub evidence: String,
    /// Where to look.
    pub hint: String,
}

/// One path's results, as the detectors need them.
#[derive(Debug, Clone, Copy)]
pub struct PathEvidence<'a> {
    /// The path, or the dump.
    pub kind: PathLabel,
    /// Its trace.
    pub trace: &'a Trace,
    /// Its per-site comparison.
    pub diffs: &'a [SiteDiff],
    /// Packed token rows whose merge had an empty partial.
    pub empty_partial_rows: &'a [usize],
    /// Set when the configuration could not be served.
    pub unservable: Option<&'a Unservable>,
}

/// Everything diagnosis looks at for one layer.
#[derive(Debug, Clone)]
pub struct DiagnoseInput<'a> {
    /// Model configuration.
    pub cfg: &'a MlaConfig,
    /// The batch both sides ran.
    pub batch: &'a Batch,
    /// The reference trace (f64).
    pub reference: &'a Trace,
    /// Every path that ran on the same inputs.
    pub paths: Vec<PathEvidence<'a>>,
    /// TP ranks the paths used.
    pub tp: usize,
    /// The tolerance rows the diffs were judged by (a path's compute dtype, or a dump's engine
    /// dtype).
    pub precision: Precision,
}

/// What every detector sees for one failing site of one path.
struct SiteCtx<'a> {
    input: &'a DiagnoseInput<'a>,
    path: PathEvidence<'a>,
    site: Site,
    diff: &'a SiteDiff,
    refr: &'a TraceTensor,
    cand: &'a TraceTensor,
    /// Relative L2 under which an alternative hypothesis "explains" the candidate.
    explain: f64,
}

/// What a detector reports when its hypothesis explains a failing site; it becomes the
/// [`Finding`]'s `evidence` and `hint`, printed as the finding's paragraph in the text report,
/// the two last columns of the triage table and the `evidence`/`hint` fields of the JSON report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Detection {
    /// The numbers that show the hypothesis holds, always the explained error against the error
    /// as is, e.g. "W_UK_T equals kv_b's rows split grouped [all k | all v] (rel_l2 1.2e-7 vs
    /// 4.1e-1 as is)".
    pub evidence: String,
    /// Where to look in the engine to fix it: the rule the code broke and, where known, the
    /// engine code that broke it.
    pub hint: String,
}

impl Detection {
    fn new(evidence: String, hint: String) -> Self {
        Detection { evidence, hint }
    }
}

impl SiteCtx<'_> {
    fn as_is(&self) -> f64 {
        self.diff.metrics.as_ref().map_or(f64::NAN, |m| m.rel_l2)
    }

    /// "rel_l2 `e` vs `as is` as is": an explained error beside the error as is, as evidence
    /// states it.
    fn vs_as_is(&self, e: f64) -> String {
        format!("rel_l2 {} vs {} as is", sci(e, 2), sci(self.as_is(), 2))
    }

    fn ref_site(&self, stage: Stage) -> Option<&TraceTensor> {
        self.input.reference.get(&Site::new(self.site.layer, stage))
    }

    /// Compares the candidate with an alternative built from the reference: Some(rel) if it
    /// explains.
    fn explained_by(&self, alt: &[f64]) -> Option<f64> {
        let c = self.cand.to_f64();
        if alt.len() != c.len() {
            return None;
        }
        let e = rel_l2(&c, alt);
        (e <= self.explain && e < self.as_is()).then_some(e)
    }
}

// ---------------------------------------------------------------------------------------------
// Detectors, in precedence order.

fn phantom_output(x: &SiteCtx<'_>) -> Option<Detection> {
    let m = x.diff.metrics.as_ref()?;
    if m.numel > 0 && m.canary == m.numel {
        return Some(Detection::new(
            format!(
                "all {} elements still hold the canary (f32 bits 0x{:08X}): the output buffer was never written",
                m.numel,
                crate::core::canary::CANARY_BITS
            ),
            "the attention op wrote its result into a tensor the caller never reads; it must write the \
             caller-allocated `output` in place (vLLM custom op with mutates_args=[\"output\"])"
                .into(),
        ));
    }
    let all_zero = (0..x.cand.len()).all(|i| x.cand.get(i) == 0.0);
    if all_zero && m.norm_ref > 0.0 {
        return Some(Detection::new(
            format!("all {} elements are 0 while ‖ref‖ = {}", m.numel, sci(m.norm_ref, 2)),
            "an output buffer allocated with zeros was returned unwritten (the op's result went elsewhere)".into(),
        ));
    }
    None
}

/// The GGUF tensors of layer `layer` that an engine's loader turns into weight site `stage`, in
/// this file's layout (split `attn_k_b`/`attn_v_b` or fused `attn_kv_b`; `attn_q_b` with a query
/// LoRA, `attn_q` without).
pub fn gguf_sources(cfg: &MlaConfig, layer: usize, stage: Stage) -> Vec<String> {
    use crate::core::trace::RankedWeight;
    use crate::model::config::KvBLayout;
    let kv_b = || match cfg.kv_b_layout {
        KvBLayout::Split => vec!["attn_k_b", "attn_v_b"],
        KvBLayout::Fused => vec!["attn_kv_b"],
    };
    let names = match stage {
        Stage::WFusedQkvA => vec!["attn_q_a", "attn_kv_a_mqa"],
        Stage::WKvB | Stage::WUkT | Stage::WUv | Stage::WRank(RankedWeight::KvB, _) => kv_b(),
        Stage::WRank(RankedWeight::QProj, _) if cfg.q_lora_rank.is_some() => vec!["attn_q_b"],
        Stage::WRank(RankedWeight::QProj, _) => vec!["attn_q"],
        Stage::WRank(RankedWeight::OProj, _) => vec!["attn_output"],
        _ => vec![],
    };
    names
        .into_iter()
        .map(|n| crate::model::weights::tensor_name(layer, n))
        .collect()
}

/// A weight site whose every element is zero or the canary while the reference's is not: the
/// engine's loader never filled the parameter (its GGUF name map lacks the file's tensors for
/// it). An activation that was never written is `phantom-output`; this is its weight twin.
fn weight_not_loaded(x: &SiteCtx<'_>) -> Option<Detection> {
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
        format!(
            "the engine never loaded this weight: its loader's tensor mapping has no entry for {names} \
             (vllm-gguf-plugin 0.0.5 maps `attn_kv_b` but not the split `attn_k_b`/`attn_v_b` that \
             current llama.cpp writes)"
        ),
    ))
}

/// Token rows (dim 0) holding at least one element that satisfies `bad`.
fn rows_where(t: &TraceTensor, bad: impl Fn(usize) -> bool) -> Vec<usize> {
    let rows = t.shape.first().copied().unwrap_or(0).max(1);
    let per = t.len() / rows;
    (0..rows).filter(|&r| (r * per..(r + 1) * per).any(&bad)).collect()
}

fn list(v: &[usize]) -> String {
    if v.len() <= 10 {
        format!("{v:?}")
    } else {
        format!("{:?}… ({} in all)", &v[..10], v.len())
    }
}

fn unwritten_rows(x: &SiteCtx<'_>) -> Option<Detection> {
    let m = x.diff.metrics.as_ref()?;
    let cf = x.cand.f32_data()?;
    if m.canary == 0 || m.canary == m.numel {
        return None;
    }
    let exact = cf
        .iter()
        .filter(|v| v.to_bits() == crate::core::canary::CANARY_BITS)
        .count();
    let rows = rows_where(x.cand, |i| is_canary_like(cf[i]));
    if exact == 0 && x.site.stage != Stage::Lse {
        // Only quieted canaries: unwritten memory was read by arithmetic. If the same rows'
        // LSE is a computed (non-canary) NaN, a merge used an unwritten partial because its
        // sentinel was wrong: that is an LSE-merge bug, not an unwritten output.
        if let Some(lse) = x
            .path
            .trace
            .get(&Site::new(x.site.layer, Stage::Lse))
            .and_then(|t| t.f32_data())
        {
            let per = lse.len() / x.cand.shape[0].max(1);
            let merge_nan = rows.iter().any(|&r| {
                lse[r * per..(r + 1) * per]
                    .iter()
                    .any(|v| v.is_nan() && !is_canary_like(*v))
            });
            if merge_nan {
                return None;
            }
        }
    }
    Some(Detection::new(
        format!(
            "{} of {} elements hold the canary ({} exact, {} quieted by arithmetic) in token rows {}",
            m.canary,
            m.numel,
            exact,
            m.canary - exact,
            list(&rows)
        ),
        "rows were skipped instead of written: a row with no keys in a context chunk must still get \
         output 0 and LSE −inf (or be excluded from the merge)"
            .into(),
    ))
}

fn shard_order(x: &SiteCtx<'_>) -> Option<Detection> {
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
/// activations and the `[T, N]` lse, 0 for the weights; a `w.kv_b` head is P+V rows).
fn rank_axis(stage: Stage, cfg: &MlaConfig, tp: usize) -> Option<(usize, usize)> {
    if !is_per_head(stage) {
        return None;
    }
    let heads_per_rank = cfg.n_head / tp;
    Some(match stage {
        Stage::WKvB => (0, heads_per_rank * (cfg.qk_nope_head_dim + cfg.v_head_dim)),
        Stage::WUkT | Stage::WUv => (0, heads_per_rank),
        _ => (1, heads_per_rank),
    })
}

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

fn tp_rank_order(x: &SiteCtx<'_>) -> Option<Detection> {
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
        return m
            .explains()
            .then(|| describe_ranks(&m, &format!("per-rank shards of {}", w.as_str()), x));
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
fn kv_b_layout(x: &SiteCtx<'_>) -> Option<Detection> {
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

/// Rotates every `r`-wide row of `data` at its position with the given pairing.
fn rotate(data: &[f64], r: usize, positions: &[usize], inv_freq: &[f64], style: RopeStyle) -> Vec<f64> {
    let mut out = data.to_vec();
    for (row, &pos) in out.chunks_mut(r).zip(positions) {
        indexer::rope_f64(row, pos, inv_freq, style);
    }
    out
}

fn rope_style(x: &SiteCtx<'_>) -> Option<Detection> {
    let cfg = x.input.cfg;
    let [n, _, p, r, _] = cfg.dims().nlprv();
    let pos = x.input.batch.positions();
    let inv = rope_inv_freq(cfg);
    let (raw, positions): (Vec<f64>, Vec<usize>) = match x.site.stage {
        Stage::QPeRoped => {
            let q = x.ref_site(Stage::Q)?;
            let t = q.shape[0];
            let raw = (0..t * n)
                .flat_map(|i| (0..r).map(move |d| (i, d)))
                .map(|(i, d)| q.get(i * (p + r) + p + d))
                .collect();
            (raw, (0..t * n).map(|i| pos[i / n]).collect())
        }
        Stage::KPeRoped => (x.ref_site(Stage::KPe)?.to_f64(), pos.clone()),
        _ => return None,
    };
    let wrong = cfg.rope_style.other();
    let alt = rotate(&raw, r, &positions, &inv, wrong);
    // An engine dump read with `rope_order = hf` has had its halves re-interleaved; a NeoX
    // rotation there comes out in natural order, so also try NeoX seen through that conversion.
    let alt_hf: Vec<f64> = alt
        .chunks(r)
        .flat_map(|c| (0..r).map(move |k| if k % 2 == 0 { c[k / 2] } else { c[r / 2 + k / 2] }))
        .collect();
    let (e, through_hf) = match x.explained_by(&alt) {
        Some(e) => (e, false),
        None if wrong == RopeStyle::Neox => (x.explained_by(&alt_hf)?, true),
        None => return None,
    };
    if wrong == RopeStyle::Interleaved {
        return Some(Detection::new(
            format!(
                "interleaved rotation (x[2i], x[2i+1]) of the reference's un-rotated input explains {} ({})",
                x.site.stage.name(),
                x.vs_as_is(e)
            ),
            format!(
                "{} rotates NeoX halves (x[i], x[i+R/2]): vLLM is_neox_style=True, llama.cpp rope type NEOX",
                cfg.arch
            ),
        ));
    }
    Some(Detection::new(
        format!(
            "NeoX rotation (x[i], x[i+R/2]) of the reference's un-rotated input explains {}{} (rel_l2 {} vs {} as is)",
            x.site.stage.name(),
            if through_hf {
                " once the dump's HF [even | odd] rope-order conversion is undone"
            } else {
                ""
            },
            sci(e, 2),
            sci(x.as_is(), 2)
        ),
        "DeepSeek MLA rotates adjacent pairs (x[2i], x[2i+1]): vLLM is_neox_style=False, llama.cpp rope type NORM"
            .into(),
    ))
}

/// (token, head) rows the softmax-scale hypothesis is tested on, at most: the recomputation
/// costs rows × keys × width per trial scale, and about 70 trial scales run, so a bound on the
/// rows keeps the detector below the cost of the paths it judges at any T (a wrong scale moves
/// every row, so a spread sample shows it as clearly as the whole tensor).
const SCALE_SAMPLE_ROWS: usize = 96;

/// Reference attention recomputed with the logit scale multiplied by `c`, for the stage asked
/// (`lse` [T,N], `attn_latent` [T,N,L] or `attn_out` [T,N,V]), on a spread sample of at most
/// [`SCALE_SAMPLE_ROWS`] (token, head) rows. `None` if an input is missing.
struct AttnRecompute {
    /// Per sampled row: its flat (token·N + head) index, the raw logits `q·k` (unscaled) over
    /// its visible keys, and the key rows.
    sampled_rows: Vec<(usize, Vec<f64>, Vec<usize>)>,
    /// Rows that are averaged: kv_c_normed [T, L] (latent) or v [T, N, V].
    values: Vec<f64>,
    width: usize,
    per_head_values: bool,
    n: usize,
    scale: f64,
}

impl AttnRecompute {
    fn build(x: &SiteCtx<'_>) -> Option<Self> {
        Self::build_for(x, x.site.stage)
    }

    /// [`AttnRecompute::build`] for `stage` (of the same layer) instead of the failing site's.
    fn build_for(x: &SiteCtx<'_>, stage: Stage) -> Option<Self> {
        let cfg = x.input.cfg;
        let [n, l, p, r, v] = cfg.dims().nlprv();
        let q = x.ref_site(Stage::Q)?;
        let qpe = x.ref_site(Stage::QPeRoped)?;
        let kn = x.ref_site(Stage::KNope)?;
        let kpe = x.ref_site(Stage::KPeRoped)?;
        let (values, width, per_head_values) = match stage {
            Stage::AttnLatent => (x.ref_site(Stage::KvCNormed)?.to_f64(), l, false),
            Stage::AttnOut => (x.ref_site(Stage::V)?.to_f64(), v, true),
            Stage::Lse => (Vec::new(), 0, false),
            _ => return None,
        };
        // DSA models attend over the indexer's selection, which the reference recorded.
        let sel = x.ref_site(Stage::IdxTopk).map(|t| {
            let k = t.shape.last().copied().unwrap_or(0);
            indexer::topk_sets(&t.to_f64(), k)
        });
        let offsets = x.input.batch.offsets();
        let seq_start: Vec<usize> = x
            .input
            .batch
            .seqs
            .iter()
            .zip(&offsets)
            .flat_map(|(sq, &off)| std::iter::repeat_n(off, sq.len))
            .collect();
        let rows = seq_start.len() * n;
        // Evenly spread tokens; heads stepped by a stride coprime with most head counts, so the
        // sample does not sit on one head when rows/sample is a multiple of N.
        let sample: Vec<usize> = if rows <= SCALE_SAMPLE_ROWS {
            (0..rows).collect()
        } else {
            (0..SCALE_SAMPLE_ROWS)
                .map(|k| {
                    let ti = (k * seq_start.len() + seq_start.len() / 2) / SCALE_SAMPLE_ROWS;
                    ti * n + (k * 37 + 11) % n
                })
                .collect()
        };
        let sampled_rows = sample
            .par_iter()
            .map(|&row| {
                let (ti, h) = (row / n, row % n);
                let off = seq_start[ti];
                let keys: Vec<usize> = match &sel {
                    Some(sel) => sel.get(ti).map_or(Vec::new(), |v| v.iter().map(|&j| off + j).collect()),
                    None => (off..=ti).collect(),
                };
                let z = keys
                    .iter()
                    .map(|&tj| {
                        let a: f64 = (0..p)
                            .map(|d| q.get((ti * n + h) * (p + r) + d) * kn.get((tj * n + h) * p + d))
                            .sum();
                        let b: f64 = (0..r)
                            .map(|d| qpe.get((ti * n + h) * r + d) * kpe.get(tj * r + d))
                            .sum();
                        a + b
                    })
                    .collect();
                (row, z, keys)
            })
            .collect();
        Some(AttnRecompute {
            sampled_rows,
            values,
            width,
            per_head_values,
            n,
            scale: cfg.softmax_scale,
        })
    }

    /// The sampled rows of `t` (a [T, N, width] or [T, N] tensor), in sample order.
    fn sampled(&self, t: &TraceTensor) -> Vec<f64> {
        let w = self.width.max(1);
        self.sampled_rows
            .iter()
            .flat_map(|(row, _, _)| (row * w..(row + 1) * w).map(|i| t.get(i)))
            .collect()
    }

    /// The sampled rows recomputed with the logit scale times `c`.
    fn eval(&self, c: f64) -> Vec<f64> {
        let per_row: Vec<Vec<f64>> = self
            .sampled_rows
            .par_iter()
            .map(|(row, z, keys)| {
                let h = row % self.n;
                let s: Vec<f64> = z.iter().map(|v| v * self.scale * c).collect();
                let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
                let sum: f64 = e.iter().sum();
                if self.width == 0 {
                    return vec![m + sum.ln()];
                }
                let mut o = vec![0f64; self.width];
                for (ej, &tj) in e.iter().zip(keys) {
                    let base = if self.per_head_values {
                        (tj * self.n + h) * self.width
                    } else {
                        tj * self.width
                    };
                    for d in 0..self.width {
                        o[d] += ej / sum * self.values[base + d];
                    }
                }
                o
            })
            .collect();
        per_row.concat()
    }
}

fn softmax_scale(x: &SiteCtx<'_>) -> Option<Detection> {
    if !matches!(x.site.stage, Stage::Lse | Stage::AttnLatent | Stage::AttnOut) {
        return None;
    }
    let m = x.diff.metrics.as_ref()?;
    if m.nonfinite_mismatch > 0 {
        return None;
    }
    let recompute = AttnRecompute::build(x)?;
    if x.cand.len() != x.refr.len() {
        return None;
    }
    let cand = recompute.sampled(x.cand);
    // The error as is, on the same rows the hypothesis is tested on.
    let as_is = rel_l2(&cand, &recompute.sampled(x.refr));
    let err = |c: f64| rel_l2(&cand, &recompute.eval(c));
    // Coarse log-spaced grid over ×0.1 … ×10, then golden-section refinement.
    let grid: Vec<f64> = (0..=40)
        .map(|i| (0.1f64.ln() + i as f64 * (100f64.ln() / 40.0)).exp())
        .collect();
    let (mut best_c, mut best_e) = (1.0, err(1.0));
    for &c in &grid {
        let e = err(c);
        if e < best_e {
            best_c = c;
            best_e = e;
        }
    }
    let (mut a, mut b) = (best_c / 1.13, best_c * 1.13);
    let inv_phi = (5f64.sqrt() - 1.0) / 2.0;
    for _ in 0..30 {
        let c1 = b - inv_phi * (b - a);
        let c2 = a + inv_phi * (b - a);
        if err(c1) < err(c2) {
            b = c2;
        } else {
            a = c1;
        }
    }
    let c = (a + b) / 2.0;
    let e = err(c);
    if !(e <= x.explain && e < as_is && (c - 1.0).abs() > 1e-3) {
        return None;
    }
    let cfg = x.input.cfg;
    let msq = cfg.mscale() * cfg.mscale();
    let named = [
        (
            1.0 / msq,
            format!("the YaRN m² = {msq:.4} factor is missing from the softmax scale"),
        ),
        (msq, format!("the YaRN m² = {msq:.4} factor is applied twice")),
        (
            1.0 / cfg.mscale(),
            format!("only one m = {:.4} of the YaRN m² factor is applied", cfg.mscale()),
        ),
        (
            (cfg.qk_head_dim() as f64 / (cfg.kv_lora_rank + cfg.qk_rope_head_dim) as f64).sqrt(),
            format!(
                "the scale uses (L+R)^-0.5 = {}^-0.5 (the absorbed width) instead of (P+R)^-0.5",
                cfg.kv_lora_rank + cfg.qk_rope_head_dim
            ),
        ),
    ];
    let cause = named
        .iter()
        .filter(|(f, _)| (c / f - 1.0).abs() < 5e-3 && (f - 1.0).abs() > 1e-3)
        .map(|(_, s)| s.clone())
        .next()
        .unwrap_or_else(|| format!("the logits are scaled by ×{c:.4} relative to (P+R)^-0.5 · m²"));
    Some(Detection::new(
        format!(
            "a logit scale of ×{c:.4} explains {} ({})",
            x.site.stage.name(),
            x.vs_as_is(e)
        ),
        format!(
            "{cause}; the right scale is (P+R)^-0.5 · m² = {:.6}, m = 0.1·mscale_all_dim·ln(factor) + 1 (DeepSeek-V2 with YaRN)",
            cfg.softmax_scale
        ),
    ))
}

/// Token rows (dim 0) whose relative L2 error exceeds ten times the site's rel_l2 tolerance,
/// or that hold a non-finite value where the reference is finite: rows that are clearly wrong,
/// not merely noisy at the path's precision.
fn failing_rows(x: &SiteCtx<'_>) -> Vec<usize> {
    let (tol, _) = tolerance(x.site.stage, x.input.precision);
    let rows = x.refr.shape.first().copied().unwrap_or(1).max(1);
    let per = x.refr.len() / rows;
    let (r, c) = (x.refr.to_f64(), x.cand.to_f64());
    // A row's error is measured against its own norm, but never against less than the norm of a
    // typical row: rows near zero (an LSE over few keys, as in DSA's sparse attention) would
    // otherwise fail on rounding alone.
    let finite: Vec<f64> = r.iter().copied().filter(|v| v.is_finite()).collect();
    let rms = (finite.iter().map(|v| v * v).sum::<f64>() / finite.len().max(1) as f64).sqrt();
    let floor = rms * (per as f64).sqrt();
    (0..rows)
        .filter(|&i| {
            let (rr, cc) = (&r[i * per..(i + 1) * per], &c[i * per..(i + 1) * per]);
            let d = rr.iter().zip(cc).map(|(a, b)| (a - b) * (a - b)).sum::<f64>().sqrt();
            let n = rr.iter().map(|a| a * a).sum::<f64>().sqrt();
            rr.iter().zip(cc).any(|(a, b)| a.is_finite() != b.is_finite())
                || d / n.max(floor).max(f64::MIN_POSITIVE) > (10.0 * tol.rel_l2).max(1e-6)
        })
        .collect()
}

fn lse_merge(x: &SiteCtx<'_>) -> Option<Detection> {
    if !matches!(x.site.stage, Stage::Lse | Stage::AttnLatent | Stage::AttnOut) {
        return None;
    }
    let hint_sentinel = "an empty partial (a split or context chunk with no keys) must carry LSE = −inf and \
                         contribute nothing to the merge; +inf (or a base-2 LSE) poisons it";
    let bad = failing_rows(x);
    let empty: BTreeSet<usize> = x.path.empty_partial_rows.iter().copied().collect();
    if !bad.is_empty() && !empty.is_empty() && bad.iter().all(|r| empty.contains(r)) {
        return Some(Detection::new(
            format!(
                "the {} wrong token rows {} all merged an empty partial (an empty split or context chunk); the other {} rows pass",
                bad.len(),
                list(&bad),
                x.refr.shape[0] - bad.len()
            ),
            hint_sentinel.into(),
        ));
    }
    if x.site.stage == Stage::Lse {
        let m = x.diff.metrics.as_ref()?;
        // A scale moves cos_diff (1 − 2Σab/Σ(a²+b²) is not scale-blind): the direction is judged
        // by the true cosine, as right as the rows' precision allows.
        let (tol, _) = tolerance(x.site.stage, x.input.precision);
        let direction_right = 1.0 - true_cosine(x) <= (tol.rel_l2 * tol.rel_l2).max(1e-10);
        for (f, what) in [
            (1.0 / std::f64::consts::LN_2, "log2 (base-2 LSE)"),
            (std::f64::consts::LN_2, "a base-2 LSE read as natural log"),
        ] {
            if (m.norm_ratio / f - 1.0).abs() < 2e-3 && direction_right {
                return Some(Detection::new(
                    format!("LSE is the reference times {f:.4}: {what}"),
                    "merge states in one log base: natural log everywhere, or convert with ln 2".into(),
                ));
            }
        }
    }
    if x.site.stage == Stage::AttnOut && x.path.trace.get(&Site::new(x.site.layer, Stage::AttnLatent)).is_some() {
        // The merge happened on the latent; its output site judges it.
        return None;
    }
    base2_merge(x)
}

/// Natural log of `e^a + e^b`, exact for infinities.
fn log_add_exp(a: f64, b: f64) -> f64 {
    let m = a.max(b);
    if m == f64::NEG_INFINITY {
        return m;
    }
    m + ((a - m).exp() + (b - m).exp()).ln()
}

impl AttnRecompute {
    /// The sampled rows under "each row's context in one or two partials whose LSEs are in base
    /// 2, merged by the natural-log rule" (`M = ln(e^a + e^b)`, outputs weighted `e^(a−M)`,
    /// `e^(b−M)`, with `a`, `b` the partials' natural LSEs divided by ln 2): the split point of
    /// each row is the one whose merged LSE is nearest the candidate's LSE `cand_lse` [T, N]
    /// (no split: one partial, LSE/ln 2). Returns the merged outputs of the sampled rows (the
    /// LSEs when the recompute is for `lse`), their merged LSEs, and how many rows were split.
    fn base2_merge(&self, cand_lse: &TraceTensor) -> (Vec<f64>, Vec<f64>, usize) {
        let ln2 = std::f64::consts::LN_2;
        let per_row: Vec<(Vec<f64>, f64, bool)> = self
            .sampled_rows
            .par_iter()
            .map(|(row, z, keys)| {
                let h = row % self.n;
                let s: Vec<f64> = z.iter().map(|v| v * self.scale).collect();
                let nk = s.len();
                // pre[c] = LSE of keys [0, c), suf[c] = LSE of keys [c, nk).
                let mut pre = vec![f64::NEG_INFINITY; nk + 1];
                let mut suf = vec![f64::NEG_INFINITY; nk + 1];
                for c in 0..nk {
                    pre[c + 1] = log_add_exp(pre[c], s[c]);
                    suf[nk - 1 - c] = log_add_exp(suf[nk - c], s[nk - 1 - c]);
                }
                let want = cand_lse.get(*row);
                let merged = |c: usize| -> f64 {
                    if c == 0 || c == nk {
                        pre[nk] / ln2
                    } else {
                        log_add_exp(pre[c] / ln2, suf[c] / ln2)
                    }
                };
                let c = (0..nk.max(1))
                    .min_by(|&a, &b| (merged(a) - want).abs().total_cmp(&(merged(b) - want).abs()))
                    .unwrap_or(0);
                let lse = merged(c);
                if self.width == 0 {
                    return (vec![lse], lse, c > 0);
                }
                // Each partial's softmax over its own keys, weighted by e^(a−M) and e^(b−M).
                let mut o = vec![0f64; self.width];
                let parts: Vec<(std::ops::Range<usize>, f64, f64)> = if c == 0 {
                    vec![(0..nk, pre[nk], 1.0)]
                } else {
                    let (a, b) = (pre[c], suf[c]);
                    vec![(0..c, a, (a / ln2 - lse).exp()), (c..nk, b, (b / ln2 - lse).exp())]
                };
                for (range, part_lse, weight) in parts {
                    for j in range {
                        let pj = (s[j] - part_lse).exp() * weight;
                        let base = if self.per_head_values {
                            (keys[j] * self.n + h) * self.width
                        } else {
                            keys[j] * self.width
                        };
                        for (od, &vd) in o.iter_mut().zip(&self.values[base..base + self.width]) {
                            *od += pj * vd;
                        }
                    }
                }
                (o, lse, c > 0)
            })
            .collect();
        let split = per_row.iter().filter(|r| r.2).count();
        let lses = per_row.iter().map(|r| r.1).collect();
        (per_row.into_iter().flat_map(|r| r.0).collect(), lses, split)
    }
}

/// Partial attention states whose LSEs are in base 2 (FlashInfer's and TRT-LLM's MLA kernels by
/// default) merged by a natural-log merge (vLLM's `merge_attn_states`): the candidate's LSE picks
/// each sampled row's split point, and the merged output that split predicts, which nothing was
/// fitted to, must explain the output site (`attn_latent` or `attn_out`, the failing one or the
/// one that goes with a failing `lse`).
fn base2_merge(x: &SiteCtx<'_>) -> Option<Detection> {
    let layer = x.site.layer;
    let cand_of = |stage| x.path.trace.get(&Site::new(layer, stage));
    let out_stage = match x.site.stage {
        Stage::Lse => [Stage::AttnLatent, Stage::AttnOut]
            .into_iter()
            .find(|&st| cand_of(st).is_some() && x.ref_site(st).is_some())?,
        st => st,
    };
    let (cand_out, ref_out, cand_lse) = (cand_of(out_stage)?, x.ref_site(out_stage)?, cand_of(Stage::Lse)?);
    if cand_out.len() != ref_out.len() || cand_lse.len() != x.ref_site(Stage::Lse)?.len() {
        return None;
    }
    let recompute = AttnRecompute::build_for(x, out_stage)?;
    let (pred, pred_lse, split) = recompute.base2_merge(cand_lse);
    if split == 0 {
        return None;
    }
    let cand = recompute.sampled(cand_out);
    let as_is = rel_l2(&cand, &recompute.sampled(ref_out));
    let e = rel_l2(&cand, &pred);
    let lse_rows: Vec<f64> = recompute
        .sampled_rows
        .iter()
        .map(|(row, _, _)| cand_lse.get(*row))
        .collect();
    let e_lse = rel_l2(&lse_rows, &pred_lse);
    let explain = explain_threshold(out_stage, x.input.precision);
    let explain_lse = explain_threshold(Stage::Lse, x.input.precision);
    if e > explain || e >= as_is || e_lse > explain_lse {
        return None;
    }
    Some(Detection::new(
        format!(
            "{split} of {} sampled (token, head) rows are two partials over their context, each with a \
             base-2 LSE, merged as natural log; the rest one partial with a base-2 LSE: {} rel_l2 {} \
             (as is {}), lse {}",
            recompute.sampled_rows.len(),
            out_stage.name(),
            sci(e, 2),
            sci(as_is, 2),
            sci(e_lse, 2)
        ),
        "a kernel returned its LSE in base 2 (FlashInfer's and TRT-LLM's MLA kernels do by default) and \
         a natural-log merge combined the partials: multiply the LSE by ln 2 before the merge, or ask \
         the kernel for natural-log LSEs"
            .into(),
    ))
}

/// The reference's indexer inputs of this layer, re-scored with `style` (f64): `idx_scores`
/// [T, S] as the reference lays it out. `None` when a site is missing.
fn rescore_indexer(x: &SiteCtx<'_>, style: RopeStyle) -> Option<Vec<f64>> {
    let idx_cfg = x.input.cfg.indexer.as_ref()?;
    let q = x.ref_site(Stage::IdxQ)?.to_f64();
    let k = x.ref_site(Stage::IdxK)?.to_f64();
    let w = x.ref_site(Stage::IdxWeights)?.to_f64();
    let (ni, d) = (idx_cfg.n_head, idx_cfg.head_dim);
    let inv = rope_inv_freq(x.input.cfg);
    let pos = x.input.batch.positions();
    let t = pos.len();
    if q.len() != t * ni * d || k.len() != t * d || w.len() != t * ni {
        return None;
    }
    let (mut qr, mut kr) = (q, k);
    indexer::rope_indexer(&mut qr, &mut kr, idx_cfg, &pos, &inv, style);
    Some(indexer::scores(idx_cfg, x.input.batch, &qr, &kr, &w))
}

/// `idx_scores` differs while the indexer's q and k matched: the other RoPE pairing applied to
/// the reference's own un-rotated `idx_q`/`idx_k` explains the candidate's scores (the
/// DeepSeek-V3.2 indexer bug: interleaved pairs where the indexer wants NeoX halves).
fn indexer_rope_style(x: &SiteCtx<'_>) -> Option<Detection> {
    if x.site.stage != Stage::IdxScores {
        return None;
    }
    let idx_cfg = x.input.cfg.indexer.as_ref()?;
    let wrong = idx_cfg.rope_style.other();
    let alt = rescore_indexer(x, wrong)?;
    let e = x.explained_by(&alt)?;
    let sel = x.ref_site(Stage::IdxTopk);
    let k = sel.map_or(0, |t| t.shape.last().copied().unwrap_or(0));
    let longer = x.input.batch.seqs.iter().any(|s| s.len > idx_cfg.top_k);
    Some(Detection::new(
        format!(
            "{} rotation of the reference's un-rotated idx_q/idx_k explains idx_scores (rel_l2 {} vs {} as is){}",
            wrong.name(),
            sci(e, 2),
            sci(x.as_is(), 2),
            if longer {
                format!(
                    "; the sequences are longer than top-k {k}, so the wrong scores change which keys attention sees"
                )
            } else {
                format!(
                    "; every sequence is at most top-k {} long, so attention is unaffected here (it shows past top-k)",
                    idx_cfg.top_k
                )
            }
        ),
        format!(
            "the {} indexer rotates {} (x[i], x[i+R/2]) on the first R dims of each indexer head, unlike its main MLA RoPE; check the indexer's rotary call (is_neox_style / rope type)",
            x.input.cfg.arch,
            match idx_cfg.rope_style {
                RopeStyle::Neox => "NeoX halves",
                RopeStyle::Interleaved => "adjacent pairs",
            }
        ),
    ))
}

/// Per token, a set of kept key indices.
type KeySets = Vec<Vec<usize>>;

/// Tokens whose selections differ only at ties within the precision's band (see
/// [`crate::judge::tolerance::selection_tie_band`]); empty without the reference's `idx_scores`.
fn tie_rows(x: &SiteCtx<'_>, r: &KeySets, c: &KeySets) -> BTreeSet<usize> {
    let Some(sc) = x.ref_site(Stage::IdxScores) else {
        return BTreeSet::new();
    };
    let s = sc.shape.last().copied().unwrap_or(0);
    let scores = sc.to_f64();
    let (band, _) = crate::judge::tolerance::selection_tie_band(x.input.precision);
    (0..r.len().min(c.len()))
        .filter(|&i| {
            r[i] != c[i]
                && scores
                    .get(i * s..(i + 1) * s)
                    .and_then(|row| indexer::tie_gap(&r[i], &c[i], row, band))
                    .is_some()
        })
        .collect()
}

/// Per token, the reference's and the candidate's `idx_topk` sets.
fn topk_pairs(x: &SiteCtx<'_>) -> Option<(KeySets, KeySets)> {
    if x.site.stage != Stage::IdxTopk {
        return None;
    }
    let k = x.refr.shape.last().copied().unwrap_or(0);
    let kc = x.cand.shape.last().copied().unwrap_or(0);
    let r = indexer::topk_sets(&x.refr.to_f64(), k);
    let c = indexer::topk_sets(&x.cand.to_f64(), kc);
    (r.len() == c.len()).then_some((r, c))
}

/// `idx_topk` differs while `idx_scores` matched, and each differing token's set equals the
/// reference's set of an earlier token of its sequence at one common distance: a top-k buffer
/// from a previous chunk was reused.
fn indexer_topk_stale(x: &SiteCtx<'_>) -> Option<Detection> {
    let (r, c) = topk_pairs(x)?;
    let ties = tie_rows(x, &r, &c);
    let bad: Vec<usize> = (0..r.len()).filter(|&i| r[i] != c[i] && !ties.contains(&i)).collect();
    if bad.is_empty() {
        return None;
    }
    let seq = indexer::seq_index(x.input.batch);
    // Each differing token must be (much) closer to the reference's selection of the token d
    // earlier than to its own; equality is not required, since a reduced-precision indexer also
    // flips ties in the stale rows.
    let explained = |d: usize, i: usize| {
        seq[i] >= d && {
            let stale = indexer::jaccard(&c[i], &r[i - d]);
            stale >= 0.6 && stale > indexer::jaccard(&c[i], &r[i])
        }
    };
    // The stride that explains every differing token best (the largest summed overlap).
    let fit = |d: usize| bad.iter().map(|&i| indexer::jaccard(&c[i], &r[i - d])).sum::<f64>();
    let d = (1..=seq.iter().copied().max().unwrap_or(0))
        .filter(|&d| bad.iter().all(|&i| explained(d, i)))
        .max_by(|&a, &b| fit(a).total_cmp(&fit(b)).then(b.cmp(&a)))?;
    let scores_state = match x
        .path
        .diffs
        .iter()
        .find(|s| s.site == Site::new(x.site.layer, Stage::IdxScores))
    {
        Some(s) if s.status == Status::Pass => "idx_scores match, so the scores were right and the selection is old",
        Some(_) => "idx_scores differ too",
        None => "idx_scores were not compared",
    };
    let j = indexer::jaccard(&r[bad[0]], &c[bad[0]]);
    Some(Detection::new(
        format!(
            "{} of {} tokens keep the reference's selection of the token {d} positions earlier ({scores_state}); token {}: Jaccard {:.3} with its own selection",
            bad.len(),
            r.len(),
            bad[0],
            j
        ),
        format!(
            "a top-k index buffer is reused across chunks: the new tokens read the previous chunk's indices (stride {d} = the tokens each chunked-prefill step adds, --new-tokens here); recompute or re-slice the indexer output per chunk"
        ),
    ))
}

/// `idx_topk` differs as a set: the tokens, their Jaccard overlap, and whether the scores matched
/// (then ties at the cut or a wrong selection rule) or not.
fn indexer_selection(x: &SiteCtx<'_>) -> Option<Detection> {
    let (ref_topk, cand_topk) = topk_pairs(x)?;
    let differing: Vec<usize> = (0..ref_topk.len()).filter(|&i| ref_topk[i] != cand_topk[i]).collect();
    if differing.is_empty() {
        return None;
    }
    let jaccards: Vec<f64> = differing
        .iter()
        .map(|&i| indexer::jaccard(&ref_topk[i], &cand_topk[i]))
        .collect();
    let mean = jaccards.iter().sum::<f64>() / jaccards.len() as f64;
    let scores_pass = x
        .path
        .diffs
        .iter()
        .find(|s| s.site == Site::new(x.site.layer, Stage::IdxScores))
        .map(|s| s.status == Status::Pass);
    let shown: Vec<String> = differing
        .iter()
        .zip(&jaccards)
        .take(4)
        .map(|(&i, j)| {
            let only_ref: Vec<usize> = ref_topk[i]
                .iter()
                .filter(|p| !cand_topk[i].contains(p))
                .copied()
                .collect();
            let only_cand: Vec<usize> = cand_topk[i]
                .iter()
                .filter(|p| !ref_topk[i].contains(p))
                .copied()
                .collect();
            format!("token {i}: Jaccard {j:.3}, only reference {only_ref:?}, only candidate {only_cand:?}")
        })
        .collect();
    Some(Detection::new(
        format!(
            "{} of {} tokens keep other keys (mean Jaccard {mean:.3}; {}): {}",
            differing.len(),
            ref_topk.len(),
            match scores_pass {
                Some(true) => "idx_scores match, so the selection rule differs (k, masking, tie order)",
                Some(false) => "idx_scores differ too",
                None => "idx_scores were not compared",
            },
            shown.join("; ")
        ),
        "keep the top_k largest scores among keys at or before the token (ties to the lower position); a shared-indexer layer reuses the latest full layer's selection".into(),
    ))
}

/// `moe_topk` differs as a set: lists the tokens and the ids only one side selected, with the
/// reference's router logits at those ids and whether the candidate's router logits matched.
fn moe_routing(x: &SiteCtx<'_>) -> Option<Detection> {
    if x.site.stage != Stage::MoeTopk {
        return None;
    }
    let k = x.refr.shape.last().copied().unwrap_or(1).max(1);
    let (ref_sorted, cand_sorted) = (
        metrics::sorted_rows(x.refr).to_f64(),
        metrics::sorted_rows(x.cand).to_f64(),
    );
    let tokens = ref_sorted.len() / k;
    let logits = x.ref_site(Stage::MoeRouterLogits);
    let n_exp = logits.map_or(0, |l| l.shape.last().copied().unwrap_or(0));
    let id = |v: f64| v as i64;
    let mut rows = Vec::new();
    for t in 0..tokens {
        let (ref_ids, cand_ids) = (&ref_sorted[t * k..(t + 1) * k], &cand_sorted[t * k..(t + 1) * k]);
        let only_ref: Vec<i64> = ref_ids
            .iter()
            .filter(|v| !cand_ids.contains(v))
            .map(|&v| id(v))
            .collect();
        let only_cand: Vec<i64> = cand_ids
            .iter()
            .filter(|v| !ref_ids.contains(v))
            .map(|&v| id(v))
            .collect();
        if only_ref.is_empty() && only_cand.is_empty() {
            continue;
        }
        let logit = |e: i64| {
            logits
                .filter(|_| e >= 0 && (e as usize) < n_exp)
                .map_or("n/a".to_string(), |l| format!("{:.4}", l.get(t * n_exp + e as usize)))
        };
        let show = |v: &[i64]| {
            v.iter()
                .map(|&e| format!("{e} (logit {})", logit(e)))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let set = |v: &[f64]| v.iter().map(|&x| id(x).to_string()).collect::<Vec<_>>().join(", ");
        rows.push(format!(
            "token {t}: reference {{{}}}, candidate {{{}}} (only reference: {}; only candidate: {})",
            set(ref_ids),
            set(cand_ids),
            show(&only_ref),
            show(&only_cand)
        ));
    }
    if rows.is_empty() {
        return None;
    }
    let logit_site = Site::new(x.site.layer, Stage::MoeRouterLogits);
    let logits_state = match x.path.diffs.iter().find(|d| d.site == logit_site) {
        Some(d) if d.status == Status::Pass => format!(
            "the router logits match (rel_l2 {}), so the selection rule differs",
            sci(d.metrics.as_ref().map_or(0.0, |m| m.rel_l2), 2)
        ),
        Some(_) => "the router logits differ too".to_string(),
        None => "the candidate's router logits were not compared".to_string(),
    };
    let shown = rows.len().min(4);
    Some(Detection::new(
        format!(
            "{} of {tokens} tokens select other experts ({logits_state}): {}{}",
            rows.len(),
            rows[..shown].join("; "),
            if rows.len() > shown {
                format!("; … {} more", rows.len() - shown)
            } else {
                String::new()
            }
        ),
        "experts are chosen on scores + exp_probs_b (the score-correction bias: for the choice only, never in the \
         weights), within the expert_group_used_count best groups (a group scores the sum of its two best \
         experts), with scores = sigmoid or softmax of the logits per expert_gating_func; check each against \
         the engine. A difference only where two scores tie at the k-th place is rounding, not a bug"
            .into(),
    ))
}

fn nonfinite(x: &SiteCtx<'_>) -> Option<Detection> {
    let m = x.diff.metrics.as_ref()?;
    if m.nonfinite_mismatch == 0 {
        return None;
    }
    let idx = m
        .first_nonfinite_mismatch
        .map(|i| metrics::unravel(i, &x.refr.shape))
        .unwrap_or_default();
    Some(Detection::new(
        format!(
            "{} elements are NaN/Inf where the reference is finite ({} non-finite in all); first at {:?}",
            m.nonfinite_mismatch, m.nonfinite_cand, idx
        ),
        "look for an exp without max subtraction, a division by a zero sum, or reads of uninitialised memory".into(),
    ))
}

/// The true cosine similarity of candidate and reference over the elements finite on both sides
/// (the metrics' cos_diff is not scale-blind, this is); 0 without metrics or with a zero norm.
fn true_cosine(x: &SiteCtx<'_>) -> f64 {
    let Some(m) = x.diff.metrics.as_ref() else {
        return 0.0;
    };
    let (r, c) = (x.refr.to_f64(), x.cand.to_f64());
    let dot: f64 = r
        .iter()
        .zip(&c)
        .filter(|(a, b)| a.is_finite() && b.is_finite())
        .map(|(a, b)| a * b)
        .sum();
    if m.norm_ref > 0.0 && m.norm_cand > 0.0 {
        dot / (m.norm_ref * m.norm_cand)
    } else {
        0.0
    }
}

fn scale_only(x: &SiteCtx<'_>) -> Option<Detection> {
    let m = x.diff.metrics.as_ref()?;
    let (tol, _) = tolerance(x.site.stage, x.input.precision);
    if m.nonfinite_mismatch > 0 || (m.norm_ratio - 1.0).abs() <= tol.norm_ratio {
        return None;
    }
    let cos = true_cosine(x);
    // The direction must be as right as the path's precision allows: 1 − cos ≈ rel_l2² / 2.
    if 1.0 - cos > (tol.rel_l2 * tol.rel_l2).max(1e-10) {
        return None;
    }
    let cfg = x.input.cfg;
    let ratio = m.norm_ratio;
    // The residual stream between layers (a layer's input or output): an engine's deliberate
    // rescale that the dump does not declare, or one applied more often than intended.
    if matches!(x.site.stage, Stage::HiddenIn | Stage::HiddenOut) {
        let rsf = cfg
            .moe
            .as_ref()
            .map(|m| m.weights_scale)
            .filter(|&f| f > 0.0 && f != 1.0);
        let named = rsf
            .into_iter()
            .flat_map(|f| (1..=4).map(move |k| (f.powi(-k), k)))
            .find(|(f, _)| (ratio / f - 1.0).abs() < 2e-3)
            .map(|(f, k)| {
                let power = if k == 1 { String::new() } else { format!("^{k}") };
                format!(" (the ratio is {f:.4} = (1/routed_scaling_factor){power})")
            })
            .unwrap_or_default();
        return Some(Detection::new(
            format!(
                "cosine similarity 1 − {} (direction right) but norm ratio {ratio:.4}: the residual stream is scaled{named}",
                sci(1.0 - cos, 2)
            ),
            "a residual stream scaled on purpose (vLLM's fp16 path carries it × 1/routed_scaling_factor) must be declared as dump format 2's `conventions.residual_scale`, which compare divides out; an undeclared scale, or one applied again in every layer (vLLM #14809), is a bug between the layers".into(),
        ));
    }
    // At o_proj under TP, × tp is the o_proj all-reduce applied twice (SGLang #31699).
    let tp = x.input.tp as f64;
    let twice = (x.site.stage == Stage::OProj && x.input.tp >= 2).then_some((
        tp,
        "tp, the TP size: the o_proj all-reduce was applied twice (each rank reduced the already reduced sum again)",
    ));
    let named = twice.into_iter().chain([
        (
            cfg.mscale(),
            "the YaRN m(factor, mscale_all_dim): RoPE cos/sin must be scaled by m(factor, mscale)/m(factor, mscale_all_dim) = 1 for DeepSeek GGUFs, not by m",
        ),
        (cfg.mscale() * cfg.mscale(), "the YaRN m²"),
        (1.0 / std::f64::consts::LN_2, "1/ln 2 (a base-2 log)"),
    ]);
    let cause = named
        .into_iter()
        .find(|(f, _)| (f - 1.0).abs() > 1e-3 && (ratio / f - 1.0).abs() < 2e-3)
        .map(|(f, s)| format!("the ratio is {f:.4} = {s}"))
        .unwrap_or_else(|| "a constant factor multiplies this tensor".into());
    Some(Detection::new(
        format!(
            "cosine similarity 1 − {} (direction right) but norm ratio {ratio:.4}: a pure scale",
            sci(1.0 - cos, 2)
        ),
        cause,
    ))
}

fn path_disagreement(x: &SiteCtx<'_>) -> Option<Detection> {
    let others: Vec<String> = x
        .input
        .paths
        .iter()
        .filter(|p| p.kind != x.path.kind)
        .filter_map(|p| {
            p.diffs
                .iter()
                .find(|d| d.site == x.site)
                .filter(|d| d.status == Status::Pass)
                .map(|d| {
                    format!(
                        "{} (rel_l2 {})",
                        p.kind,
                        sci(d.metrics.as_ref().map_or(0.0, |m| m.rel_l2), 2)
                    )
                })
        })
        .collect();
    if others.is_empty() {
        return None;
    }
    Some(Detection::new(
        format!(
            "{} passes here but {} has rel_l2 {}",
            others.join(", "),
            x.path.kind,
            sci(x.as_is(), 2)
        ),
        format!(
            "the bug is specific to the {} path's code for this stage, not to the shared weights or inputs",
            x.path.kind
        ),
    ))
}

fn mismatch(x: &SiteCtx<'_>) -> Detection {
    let rows = x.refr.shape.first().copied().unwrap_or(1).max(1);
    let per = x.refr.len() / rows;
    let r = x.refr.to_f64();
    let c = x.cand.to_f64();
    let row_err: Vec<f64> = (0..rows)
        .map(|i| rel_l2(&c[i * per..(i + 1) * per], &r[i * per..(i + 1) * per]))
        .collect();
    let (tol, _) = tolerance(x.site.stage, x.input.precision);
    let ok: Vec<usize> = (0..rows).filter(|&i| row_err[i] <= tol.rel_l2.max(1e-6)).collect();
    let worst = x.diff.metrics.as_ref();
    let mut ev = format!("rel_l2 {}", sci(x.as_is(), 2));
    if let Some(m) = worst {
        ev.push_str(&format!(
            ", worst at {:?}: ref {} → cand {}; {:.1}% of elements within tolerance",
            m.max_abs_index,
            sci(m.max_abs_ref, 2),
            sci(m.max_abs_cand, 2),
            100.0 * m.pass_fraction
        ));
    }
    if !ok.is_empty() && ok.len() < rows {
        let bad_min = row_err
            .iter()
            .copied()
            .enumerate()
            .filter(|(i, _)| !ok.contains(i))
            .map(|(_, e)| e)
            .fold(f64::INFINITY, f64::min);
        ev.push_str(&format!(
            "; rows {} exact (rel ≤ {}), the other {} rows wrong (rel ≥ {})",
            list(&ok),
            sci(ok.iter().map(|&i| row_err[i]).fold(0.0, f64::max), 2),
            rows - ok.len(),
            sci(bad_min, 2)
        ));
    }
    let hint = if ok == [0] && rows > 1 {
        "row 0 right and later rows wrong is the signature of a wrong row stride (a strided view read as contiguous)"
            .to_string()
    } else {
        "no known bug class explains this; compare the stage's inputs, which passed, with its code".to_string()
    };
    Detection::new(ev, hint)
}

/// Classifies one failing site.
/// A detector: one hypothesis tested on one failing site.
type Detector = fn(&SiteCtx<'_>) -> Option<Detection>;

/// Every detector with the class it names, in precedence order (earlier wins).
const DETECTORS: [(Class, Detector); 17] = [
    (Class::WeightNotLoaded, weight_not_loaded),
    (Class::PhantomOutput, phantom_output),
    (Class::UnwrittenRows, unwritten_rows),
    (Class::ShardOrder, shard_order),
    (Class::TpRankOrder, tp_rank_order),
    (Class::TpReduce, collective::tp_reduce),
    (Class::KvBLayout, kv_b_layout),
    (Class::RopeStyle, rope_style),
    // Before the scale: a base-2 merge also reweights the logits, and a free scale fits part of it.
    (Class::LseMerge, lse_merge),
    (Class::SoftmaxScale, softmax_scale),
    (Class::MoeRouting, moe_routing),
    (Class::IndexerRopeStyle, indexer_rope_style),
    (Class::IndexerTopkStale, indexer_topk_stale),
    (Class::IndexerSelection, indexer_selection),
    (Class::Nonfinite, nonfinite),
    (Class::ScaleOnly, scale_only),
    (Class::PathDisagreement, path_disagreement),
];

/// Runs the detector of `class` alone on the first divergence of path `path` of `input` (no
/// precedence, no other detector): whether that one hypothesis explains the divergence, and
/// with what evidence and hint.
///
/// `None` when the path has no divergence, when `class` has no site detector (`mismatch`,
/// `quant-block-misaligned`, `transposed`, `weight-nonfinite` come from elsewhere), or when the
/// hypothesis does not explain it. For tests and for callers that ask about one bug class.
pub fn detect_at(input: &DiagnoseInput<'_>, path: usize, class: Class) -> Option<Detection> {
    let ev = *input.paths.get(path)?;
    let first = metrics::first_divergence(ev.diffs)?;
    let x = SiteCtx {
        input,
        path: ev,
        site: first.site,
        diff: first,
        refr: input.reference.get(&first.site)?,
        cand: ev.trace.get(&first.site)?,
        explain: explain_threshold(first.site.stage, input.precision),
    };
    let (_, det) = DETECTORS.iter().find(|(c, _)| *c == class)?;
    det(&x)
}

fn classify(x: &SiteCtx<'_>) -> Finding {
    for (class, det) in DETECTORS {
        // Id sites hold ids, not values: only the set comparisons apply to them.
        let set_class = matches!(
            class,
            Class::MoeRouting | Class::IndexerTopkStale | Class::IndexerSelection
        );
        if x.site.stage.is_id_set() != set_class {
            continue;
        }
        if let Some(Detection { evidence, hint }) =
            crate::core::timing::stage(&format!("detect {}", class.name()), || det(x))
        {
            return Finding {
                class,
                site: x.site,
                path: Some(x.path.kind),
                evidence,
                hint,
            };
        }
    }
    let Detection { evidence, hint } = crate::core::timing::stage("detect mismatch", || mismatch(x));
    Finding {
        class: Class::Mismatch,
        site: x.site,
        path: Some(x.path.kind),
        evidence,
        hint,
    }
}

/// A finding for a TP cut that falls inside a quant block.
pub fn misaligned_finding(u: &Unservable, path: PathLabel) -> Finding {
    Finding {
        class: Class::QuantBlockMisaligned,
        site: u.site,
        path: Some(path),
        evidence: format!(
            "{} ({}, blocks of {} along ne[0]) would be cut at element {} of ne[0], inside a block; not run",
            u.tensor, u.ggml_type, u.block_size, u.at
        ),
        hint: format!(
            "{}: a quantized shard must start and end on a {}-element block boundary",
            u.reason, u.block_size
        ),
    }
}

/// Findings for GGUF weights that hold NaN/Inf after dequantization: one per tensor, at the
/// first site that consumes it, for no path (the file itself is wrong; every path inherits it).
pub fn weight_nonfinite_findings(layer: usize, bad: &[NonFiniteTensor], numel: impl Fn(&str) -> usize) -> Vec<Finding> {
    bad.iter()
        .map(|t| {
            let tensor = &t.name;
            let stage = match tensor.rsplit('.').nth(1).unwrap_or("") {
                "attn_norm" => Stage::AttnIn,
                "attn_q_a" => Stage::QC,
                "attn_q_a_norm" => Stage::QCNormed,
                "attn_q_b" | "attn_q" => Stage::Q,
                "attn_kv_a_mqa" => Stage::KvA,
                "attn_kv_a_norm" => Stage::KvCNormed,
                "attn_k_b" | "attn_v_b" | "attn_kv_b" => Stage::WKvB,
                "attn_output" => Stage::OProj,
                "ffn_gate_inp" => Stage::MoeRouterLogits,
                "exp_probs_b" => Stage::MoeTopk,
                "ffn_gate_exps" | "ffn_up_exps" | "ffn_down_exps" => Stage::MoeOut,
                "ffn_gate_shexp" | "ffn_up_shexp" | "ffn_down_shexp" => Stage::SharedOut,
                _ => Stage::HiddenOut,
            };
            Finding {
                class: Class::WeightNonfinite,
                site: Site::new(layer, stage),
                path: None,
                evidence: format!(
                    "{tensor} holds {} non-finite value(s) of {} after dequantization, the first at flat index {} (PyTorch layout)",
                    t.count,
                    numel(tensor),
                    t.first_index
                ),
                hint: "the GGUF itself is corrupt (a quant block with a NaN/Inf scale, or a bad conversion): every engine loading it computes garbage; re-convert or re-download the file".into(),
            }
        })
        .collect()
}

/// The threshold under which an alternative hypothesis explains a candidate: 5× the site's
/// rel_l2 tolerance, at least 1e-4 (f32: the explained error is ~1e-7; bf16: ~1e-2; a wrong
/// hypothesis leaves an O(1) error).
fn explain_threshold(stage: Stage, precision: Precision) -> f64 {
    (5.0 * tolerance(stage, precision).0.rel_l2).max(1e-4)
}

/// Diagnoses every path of one layer: one finding per path at its first divergence (or the
/// unservable cut), none for a path that passes.
pub fn diagnose(input: &DiagnoseInput<'_>) -> Vec<Finding> {
    let mut out = Vec::new();
    for path in &input.paths {
        if let Some(u) = path.unservable {
            out.push(misaligned_finding(u, path.kind));
            continue;
        }
        let Some(first) = metrics::first_divergence(path.diffs) else {
            continue;
        };
        let (Some(refr), Some(cand)) = (input.reference.get(&first.site), path.trace.get(&first.site)) else {
            out.push(Finding {
                class: Class::Mismatch,
                site: first.site,
                path: Some(path.kind),
                evidence: format!(
                    "site {} has no reference counterpart or no candidate tensor",
                    first.site
                ),
                hint: "the trace is incomplete".into(),
            });
            continue;
        };
        if first.status == Status::ShapeMismatch {
            out.push(Finding {
                class: Class::Mismatch,
                site: first.site,
                path: Some(path.kind),
                evidence: format!(
                    "shape {:?} where the reference has {:?}",
                    first.shape_cand, first.shape_ref
                ),
                hint: "check the view/reshape that produced this tensor".into(),
            });
            continue;
        }
        let x = SiteCtx {
            input,
            path: *path,
            site: first.site,
            diff: first,
            refr,
            cand,
            explain: explain_threshold(first.site.stage, input.precision),
        };
        out.push(classify(&x));
    }
    out
}
