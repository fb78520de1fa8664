//! The detectors of `weights --check`: why a tensor of an engine's weights file, as loaded,
//! differs from the same param rebuilt from the GGUF.
//!
//! The second bug behind this project was in the weights, not in a kernel: the shards of a fused
//! projection came out of GGUF dequantization in the wrong order. An engine's loaded weights
//! (dequantized, fused, sharded per tensor-parallel rank, absorbed into `W_UK_T`/`W_UV`) are
//! judged tensor by tensor against the GGUF's; each failing one is explained here with the
//! block-permutation finder, as the site detectors of `diagnose/weights.rs` explain a weight site:
//! never loaded, transposed, fused shards in the wrong order, heads permuted, a shard cut inside
//! a quant block. After every tensor, [`rank_findings`] judges how the ranks' shards fit
//! together: a rank holding another rank's slice, every rank holding rank 0's (the GGUF
//! plugin's merged-column loader that reads the rank from a keyword nobody passes), a missing
//! shard. The same detectors judge the `weights.*` tensors `compare` finds in a format-2 dump.
//! Every finding is a [`Finding`] about a [`LoadedTensor`], with the GGUF tensors it comes from.

use std::collections::BTreeMap;
use std::ops::Range;

use super::blocks::{find_blocks, rel_l2 as rel};
use super::weights::{
    HINT_MERGED_COLUMN_RANK0, KvBView, KvBWeight, head_order, head_order_class, head_order_detection, kv_b_layout_of,
    weight_not_loaded_hint,
};
use super::{Detection, Finding, LoadedTensor, TpRank};
use crate::core::class::Class;
use crate::core::dtype::Dtype;
use crate::core::sci::sci;
use crate::model::config::{KvBLayout, MlaConfig, MlaDims};
use crate::model::gguf::BlockScales;
use crate::model::tensors::TpSplit;

/// One model tensor a parameter is built from.
#[derive(Debug, Clone, PartialEq)]
pub struct Source {
    /// The tensor's name in the model's own format: `blk.1.attn_k_b.weight` in a GGUF file,
    /// `model.layers.1.self_attn.kv_b_proj.weight` in a Hugging Face checkpoint.
    pub name: String,
    /// The type it is stored in: a ggml type name (`F32`, `Q8_0`, `Q4_K`, …) or a checkpoint
    /// dtype (`F8_E4M3`, `BF16`); `?` when the model lacks the tensor.
    pub ggml_type: String,
    /// Its quant block size along ne\[0] as presented (1 for float types and for fp8, which is
    /// presented dequantized).
    pub block: u64,
    /// The block scales of a block-quantized checkpoint matrix (fp8 with `weight_scale_inv`),
    /// which the scale-layout hypothesis reads; `None` otherwise.
    pub scales: Option<BlockScales>,
}

/// One parameter (vLLM name) of the attention or the FFN rebuilt from the GGUF: what a correct
/// engine holds.
#[derive(Debug, Clone, PartialEq)]
pub struct Param {
    /// Its values, f64, row-major in `shape`.
    pub data: Vec<f64>,
    /// PyTorch shape: `[out, in]` for a linear weight, `[N, P, L]` for `W_UK_T`, `[N, L, V]` for
    /// `W_UV`.
    pub shape: Vec<usize>,
    /// How TP ranks split it (the tensor table's split of its vLLM parameter).
    pub split: TpSplit,
    /// Fused shards along dim 0 (name, rows), for shard-order findings and the merged-column
    /// TP split (`gate_up_proj`: `gate_proj` F rows, then `up_proj` F rows).
    pub shards: Vec<(&'static str, usize)>,
    /// The GGUF tensors it is built from, in order (the first one's block size serves the
    /// column-cut check of `o_proj`).
    pub sources: Vec<Source>,
}

impl Param {
    /// The source tensors as text: `blk.1.attn_k_b.weight (Q8_0)`, joined by `+`.
    pub fn source_text(&self) -> String {
        self.sources
            .iter()
            .map(|s| format!("{} ({})", s.name, s.ggml_type))
            .collect::<Vec<_>>()
            .join(" + ")
    }

    /// The source tensors, each with its ggml type name: `blk.1.attn_k_b.weight (Q8_0)`.
    pub fn source_names(&self) -> Vec<String> {
        self.sources
            .iter()
            .map(|s| format!("{} ({})", s.name, s.ggml_type))
            .collect()
    }

    /// The slice that rank `rank` of `tp` holds (of the model's `d.n_head` heads), with its
    /// shape and the ranges it covers along the split dim, in the order the slice concatenates
    /// them ([`TpSplit::rank_ranges`] along [`TpSplit::dim`]: one range, or for a merged-column
    /// param one per merged shard, `[gate rows r·F/tp.. ; up rows F + r·F/tp..]`; a replicated
    /// param: all of it, rows `0..shape[0]`).
    pub fn rank_slice(&self, d: MlaDims, tp: usize, rank: usize) -> (Vec<f64>, Vec<usize>, Vec<Range<usize>>) {
        let dim = self.split.dim().unwrap_or(0);
        let merged: Vec<usize> = self.shards.iter().map(|s| s.1).collect();
        let lens = if self.split == TpSplit::MergedColumn && merged.iter().sum::<usize>() == self.shape[dim] {
            merged
        } else {
            vec![self.shape[dim]]
        };
        let ranges = self.split.rank_ranges(d, &lens, tp, rank);
        let len: usize = ranges.iter().map(Range::len).sum();
        let data = if len == self.shape[dim] {
            self.data.clone()
        } else {
            gather_along(&self.data, &self.shape, dim, &ranges)
        };
        let mut shape = self.shape.clone();
        shape[dim] = len;
        (data, shape, ranges)
    }
}

/// The elements of `data` (row-major in `shape`) at indices `ranges` of axis `axis`, the ranges
/// concatenated in order along that axis.
fn gather_along(data: &[f64], shape: &[usize], axis: usize, ranges: &[Range<usize>]) -> Vec<f64> {
    let outer: usize = shape[..axis].iter().product();
    let inner: usize = shape[axis + 1..].iter().product();
    let dim = shape[axis];
    let mut out = Vec::with_capacity(outer * ranges.iter().map(Range::len).sum::<usize>() * inner);
    for o in 0..outer {
        let base = o * dim * inner;
        for r in ranges {
            out.extend_from_slice(&data[base + r.start * inner..base + r.end * inner]);
        }
    }
    out
}

/// What one file shard holds: its rank, the rank whose slice it equals (`None`: no rank's) and
/// the rel_l2 against that slice and against its own rank's (NaN where the shapes differ).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Held {
    /// The shard's rank (`….rank<r>` in the file).
    pub rank: usize,
    /// The rank whose slice it equals within [`match_threshold`].
    pub holds: Option<usize>,
    /// rel_l2 against the slice of `holds` (NaN without a match).
    pub rel_held: f64,
    /// rel_l2 against its own rank's slice.
    pub rel_own: f64,
}

/// Per (layer, param): what each file shard holds.
pub type Holds = BTreeMap<(usize, String), Vec<Held>>;

/// Threshold under which a block "is" another block: 1e-6 for exact dtypes, 1e-2 for bf16.
pub fn match_threshold(dtype: Dtype) -> f64 {
    match dtype {
        Dtype::F32 => 1e-6,
        Dtype::Bf16 => 1e-2,
    }
}

/// Rank-level findings from `holds`: shards permuted or duplicated across ranks (each holding
/// another rank's slice), and ranks of `expected` with no shard in the file (`expected`: every
/// rank of `0..tp`, or the one rank a per-rank dump holds). Replicated params have none.
/// `params` holds every param of the layers in `holds`, by layer.
///
/// A rank holding another rank's slice is named at the first such rank's tensor
/// (`L0.gate_up_proj.rank1`): "every rank holds rank 0's slice" when every shard holds rank 0's,
/// else "rank r holds rank s's slice" for each such rank, with the rel_l2 against the slice held
/// and against its own. The hint names the merged-column loader of the GGUF plugin for a
/// merged-column param whose ranks all hold rank 0's slice (the hint `weights --check` gives for
/// the same tensors).
pub fn rank_findings(
    holds: Holds,
    params: &BTreeMap<usize, BTreeMap<&'static str, Param>>,
    tp: usize,
    expected: &[usize],
) -> Vec<Finding> {
    let mut findings = Vec::new();
    for ((layer, param), mut v) in holds {
        v.sort_by_key(|h| h.rank);
        let p = &params[&layer][param.as_str()];
        if p.split == TpSplit::Replicated {
            continue;
        }
        let ranks: Vec<usize> = v.iter().map(|h| h.rank).collect();
        let missing: Vec<usize> = expected.iter().copied().filter(|r| !ranks.contains(r)).collect();
        if let Some(first) = v.iter().find(|h| h.holds.is_some_and(|k| k != h.rank)) {
            let tensor = LoadedTensor {
                tensor: format!("L{layer}.{param}.rank{}", first.rank),
                rank: TpRank::Rank(first.rank),
                source: p.source_names(),
            };
            let all_rank0 = tp > 1 && v.iter().all(|h| h.holds == Some(0));
            let hint = match p.split {
                TpSplit::MergedColumn if all_rank0 => HINT_MERGED_COLUMN_RANK0.to_string(),
                TpSplit::MergedColumn => format!(
                    "rank r must take rows r·F/tp..(r+1)·F/tp of each merged shard ({}), concatenated (vLLM MergedColumnParallelLinear.weight_loader: narrow(0, tp_rank * shard_size, shard_size) per shard); check the rank index the loader uses",
                    p.shards.iter().map(|s| s.0).collect::<Vec<_>>().join(", ")
                ),
                TpSplit::Row => "rank r must take input columns r·F/tp..(r+1)·F/tp (vLLM RowParallelLinear.weight_loader: narrow(1, tp_rank * shard_size, shard_size)); check the rank index the loader uses".into(),
                _ => "each rank must take its own slice of the head dim (vLLM weight_loader: narrow(dim, tp_rank * shard_size, shard_size)); check the rank index the loader uses".into(),
            };
            findings.push(Finding::at_loaded(
                Class::TpRankOrder,
                tensor,
                Detection::new(permuted_shards_evidence(&v, p, tp), hint),
            ));
        }
        if !missing.is_empty() && tp > 1 {
            findings.push(Finding::at_loaded(
                Class::TpRankOrder,
                LoadedTensor {
                    tensor: format!("L{layer}.{param}.rank*"),
                    rank: TpRank::All,
                    source: p.source_names(),
                },
                Detection::new(
                    format!("missing shard(s): rank(s) {missing:?} of tp {tp} not in the file"),
                    "dump every rank's shard (or set tp_size metadata)".into(),
                ),
            ));
        }
    }
    findings
}

/// The evidence of shards that hold other ranks' slices (`v`, by rank): which rank holds
/// whose, the slices duplicated and those held by no rank, and for each displaced shard the
/// rel_l2 against the slice it holds next to the rel_l2 against its own.
fn permuted_shards_evidence(v: &[Held], p: &Param, tp: usize) -> String {
    let ranks: Vec<usize> = v.iter().map(|h| h.rank).collect();
    let held: Vec<Option<usize>> = v.iter().map(|h| h.holds).collect();
    let text = |h: &[Option<usize>]| {
        let parts: Vec<String> = h.iter().map(|x| x.map_or("?".into(), |k| k.to_string())).collect();
        format!("[{}]", parts.join(","))
    };
    let mut dup: Vec<usize> = held.iter().flatten().copied().collect();
    dup.sort();
    let duplicated: Vec<usize> = dup.windows(2).filter(|w| w[0] == w[1]).map(|w| w[0]).collect();
    let lost: Vec<usize> = (0..tp).filter(|k| !held.contains(&Some(*k))).collect();
    let displaced: Vec<&Held> = v.iter().filter(|h| h.holds.is_some_and(|k| k != h.rank)).collect();
    let numbers: Vec<String> = displaced
        .iter()
        .map(|h| {
            format!(
                "rank {}: rel_l2 {} against rank {}'s slice vs {} against its own",
                h.rank,
                sci(h.rel_held, 2),
                h.holds.unwrap_or(h.rank),
                sci(h.rel_own, 2)
            )
        })
        .collect();
    let head = if held.iter().all(|h| *h == Some(0)) && tp > 1 {
        format!(
            "every rank holds rank 0's slice: ranks {:?} hold slices {} (duplicated shard 0; slices {:?} of {} are missing)",
            ranks,
            text(&held),
            lost,
            p.source_text()
        )
    } else {
        let who: Vec<String> = displaced
            .iter()
            .map(|h| format!("rank {} holds rank {}'s slice", h.rank, h.holds.unwrap_or(h.rank)))
            .collect();
        format!(
            "{}: ranks {:?} hold slices {}{}{}",
            who.join(", "),
            ranks,
            text(&held),
            if duplicated.is_empty() {
                String::new()
            } else {
                format!("; duplicated slices {duplicated:?}")
            },
            if lost.is_empty() {
                String::new()
            } else {
                format!("; slices {lost:?} held by no rank")
            }
        )
    };
    format!("{head}; {}", numbers.join("; "))
}

/// A failing tensor of the file, with the GGUF param it is compared with: what
/// [`super::explain_loaded`] reads.
pub struct Failing<'a> {
    /// The file's tensor name.
    pub name: &'a str,
    /// The MLA param (`kv_b_proj`, `W_UK_T`, …).
    pub param: &'a str,
    /// The param rebuilt from the GGUF.
    pub p: &'a Param,
    /// The file's values (f64, row-major).
    pub data: &'a [f64],
    /// The file's shape.
    pub shape: &'a [usize],
    /// The expected values (a shard's: its rank's slice).
    pub exp: &'a [f64],
    /// The expected shape.
    pub exp_shape: &'a [usize],
    /// A shard's rank and the ranges of the split dim it should hold, in the order it
    /// concatenates them ([`Param::rank_slice`]).
    pub rank: Option<(usize, Vec<Range<usize>>)>,
    /// The model's configuration.
    pub cfg: &'a MlaConfig,
    /// The rel_l2 at or under which a rearrangement counts as a match ([`match_threshold`]).
    pub thr: f64,
    /// The engine's TP size (1 without TP): a rank class is never claimed at 1.
    pub tp: usize,
    /// kv_b's rows [N·(P+V), L] rebuilt from the GGUF (per head `[k_nope rows | v rows]`), for
    /// a kv_b-derived tensor (`kv_b_proj`, `W_UK_T`, `W_UV`); `None` for the others.
    pub kv_b: Option<&'a [f64]>,
}

impl Failing<'_> {
    /// A finding of `class` about this tensor.
    fn finding(&self, class: Class, evidence: String, hint: String) -> Finding {
        let tensor = LoadedTensor {
            tensor: self.name.to_string(),
            rank: self.rank.as_ref().map_or(TpRank::Whole, |(r, _)| TpRank::Rank(*r)),
            source: self.p.source_names(),
        };
        Finding::at_loaded(class, tensor, Detection::new(evidence, hint))
    }
}

/// Never loaded: every element 0 (or NaN, the canary of a dump) where the GGUF's are not.
pub fn not_loaded(f: &Failing<'_>) -> Option<Finding> {
    let expected_nonzero = f.exp.iter().any(|&x| x != 0.0);
    if expected_nonzero && !f.data.is_empty() && f.data.len() == f.exp.len() {
        let what = if f.data.iter().all(|&x| x == 0.0) {
            Some("0")
        } else if f.data.iter().all(|x| x.is_nan()) {
            Some("NaN")
        } else {
            None
        };
        if let Some(what) = what {
            let src = f.p.source_text();
            return Some(f.finding(
                Class::WeightNotLoaded,
                format!("all {} elements are {what}; {src} is not", f.data.len()),
                weight_not_loaded_hint(&src),
            ));
        }
    }
    None
}

/// Transposed: the expected tensor with its last two dims swapped (`[in, out]` for `[out, in]`);
/// for `W_UK_T`/`W_UV` a `kv_b` layout finding (`transposed_of`).
pub fn transposed(f: &Failing<'_>) -> Option<Finding> {
    let fused = f.cfg.kv_b_layout == KvBLayout::Fused;
    let (class, d) = transposed_of(
        f.param,
        f.data,
        f.shape,
        f.exp,
        f.exp_shape,
        f.thr,
        &f.p.source_text(),
        fused,
    )?;
    Some(f.finding(class, d.evidence, d.hint))
}

/// Whether `data` (row-major in `shape`) holds the expected `exp` (`exp_shape`) with its last two
/// dims swapped, within `thr`: the one decision of `weights --check` (a loaded tensor) and
/// `compare` (a weight site), with its class: `kv-b-layout` for `W_UK_T`/`W_UV` (`param`, a
/// weights file's name), `transposed` for any other weight. `src` names the GGUF tensors it is
/// built from, `fused` says whether they are the legacy `attn_kv_b`.
#[allow(
    clippy::too_many_arguments,
    reason = "the tensor (param, data, shape), what it should be (exp, exp_shape), the threshold, and the GGUF it comes from (src, fused) for the hint"
)]
pub(super) fn transposed_of(
    param: &str,
    data: &[f64],
    shape: &[usize],
    exp: &[f64],
    exp_shape: &[usize],
    thr: f64,
    src: &str,
    fused: bool,
) -> Option<(Class, Detection)> {
    let k = exp_shape.len();
    // Every dim but the last two (the heads of a per-head weight) must agree, and each buffer
    // must be as long as its shape: a tensor with another head count, or an expected shard
    // sized for other ranks, is no transpose of the expected tensor (and the loop below
    // indexes both buffers by `exp_shape`).
    if !(k >= 2
        && shape.len() == k
        && shape[k - 1] == exp_shape[k - 2]
        && shape[k - 2] == exp_shape[k - 1]
        && shape[..k - 2] == exp_shape[..k - 2])
        || data.len() != exp.len()
        || shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)) != Some(data.len())
        || exp_shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)) != Some(exp.len())
    {
        return None;
    }
    let (a, b) = (exp_shape[k - 2], exp_shape[k - 1]);
    let batch: usize = exp_shape[..k - 2].iter().product();
    let mut t = vec![0.0; data.len()];
    for z in 0..batch {
        for i in 0..a {
            for j in 0..b {
                t[z * a * b + i * b + j] = data[z * a * b + j * a + i];
            }
        }
    }
    let e = rel(&t, exp);
    if e > thr {
        return None;
    }
    let (class, hint) = match (param, fused) {
        ("W_UK_T", false) => (
            Class::KvBLayout,
            format!(
                "W_UK_T is [N, P, L]; {src} is stored [N, L, P] (ggml ne [P, L, N]) and needs a transpose of its last two dims, not a reshape"
            ),
        ),
        ("W_UK_T", true) => (
            Class::KvBLayout,
            format!(
                "W_UK_T is [N, P, L]: per head, the first P rows of {src} ([N·(P+V), L]) as stored; this tensor holds them transposed"
            ),
        ),
        ("W_UV", false) => (
            Class::KvBLayout,
            format!(
                "W_UV is [N, L, V]; this tensor holds it transposed, [N, V, L], the layout {src} is stored in: transpose its last two dims when loading, not a reshape"
            ),
        ),
        ("W_UV", true) => (
            Class::KvBLayout,
            format!(
                "W_UV is [N, L, V]: per head, the last V rows of {src} ([N·(P+V), L]) transposed; this tensor holds them untransposed ([N, V, L])"
            ),
        ),
        _ => (
            Class::Transposed,
            format!(
                "PyTorch linear weights are [out, in]; the GGUF's ne order is [in, out]: reverse the dims of {src} when loading"
            ),
        ),
    };
    Some((
        class,
        Detection::new(
            format!(
                "holds the expected {exp_shape:?} transposed (shape {shape:?}; rel_l2 {e:.2e} after transposing back)"
            ),
            hint,
        ),
    ))
}

/// A shape that no transpose explains.
pub fn shape_mismatch(f: &Failing<'_>) -> Option<Finding> {
    if f.shape != f.exp_shape {
        return Some(f.finding(
            Class::Mismatch,
            format!(
                "shape {:?}, expected {:?} from {}",
                f.shape,
                f.exp_shape,
                f.p.source_text()
            ),
            "check the loader's reshape/narrow of this parameter".into(),
        ));
    }
    None
}

/// The shards of a fused projection concatenated in the wrong order (a TP shard of a
/// merged-column param: its own piece of each shard, `[gate_r | up_r]`).
pub fn shard_order(f: &Failing<'_>) -> Option<Finding> {
    if !f.p.shards.is_empty() {
        let sizes: Vec<usize> = match &f.rank {
            Some((_, ranges)) if f.p.split == TpSplit::MergedColumn && ranges.len() == f.p.shards.len() => {
                ranges.iter().map(Range::len).collect()
            }
            _ => f.p.shards.iter().map(|s| s.1).collect(),
        };
        let rows: usize = sizes.iter().sum();
        if f.shape.first() != Some(&rows) || f.exp_shape.first() != Some(&rows) {
            return None;
        }
        if let Some(m) = find_blocks(f.data, f.exp, f.shape, 0, &sizes, f.thr)
            && m.explains()
        {
            let names: Vec<String> =
                f.p.shards
                    .iter()
                    .zip(&sizes)
                    .enumerate()
                    .map(|(i, ((n, _), r))| format!("{i} = {n} ({r} rows)"))
                    .collect();
            let hint = if f.p.split == TpSplit::MergedColumn {
                format!(
                    "{} must be [{}], shard 0 then 1 (vLLM MergedColumnParallelLinear loaded_shard_id order, on every rank); check the order the GGUF shards are dequantized and concatenated",
                    f.param,
                    f.p.shards.iter().map(|s| s.0).collect::<Vec<_>>().join(" | ")
                )
            } else {
                "the fused projection must be [q_a_proj | kv_a_proj_with_mqa], shard 0 then 1 (vLLM \
                 MergedReplicatedLinear loaded_shard_id order); check the order the GGUF shards are dequantized \
                 and concatenated"
                    .into()
            };
            return Some(f.finding(
                Class::ShardOrder,
                format!(
                    "shard-order {}: {} (shards {})",
                    m.map_text(),
                    m.describe("shard"),
                    names.join(", ")
                ),
                hint,
            ));
        }
    }
    None
}

/// A kv_b-derived tensor (`kv_b_proj`, `W_UK_T`, `W_UV`, whole or one rank's shard) whose rows
/// are split grouped `[all k | all v]` per rank instead of per head, or whose `attn_k_b` was
/// reshaped instead of transposed: `kv-b-layout`, by the same decision as the weight sites of
/// `compare` (`kv_b_layout_of`).
pub fn kv_b_layout(f: &Failing<'_>) -> Option<Finding> {
    let which = KvBWeight::of_param(f.param)?;
    let kv_b = f.kv_b?;
    let [n, l, p, _, v] = f.cfg.dims().nlprv();
    if f.shape != f.exp_shape {
        return None;
    }
    // The heads the tensor holds: all N, or a shard's range of heads (kv_b_proj's rows, W_UK_T's
    // and W_UV's dim 0).
    let (heads, groups) = match &f.rank {
        Some((_, ranges)) => {
            let [range] = ranges.as_slice() else { return None };
            let per_head = if which == KvBWeight::KvB { p + v } else { 1 };
            (range.start / per_head..range.end / per_head, 1)
        }
        None => (0..n, f.tp.max(1)),
    };
    let rows = &kv_b.get(heads.start * (p + v) * l..heads.end * (p + v) * l)?;
    let view = KvBView {
        which,
        label: f.name,
        cand: f.data,
        kv_b: rows,
        heads: heads.len(),
        lpv: [l, p, v],
        groups,
        thr: f.thr,
        as_is: rel(f.data, f.exp),
    };
    let d = kv_b_layout_of(&view)?;
    Some(f.finding(Class::KvBLayout, d.evidence, d.hint))
}

/// Heads in another order within a head-split tensor (`head_order`: every position holds some
/// head's block). Its class is the one `compare` gives the same weight site
/// (`head_order_class`): `tp-rank-order` under TP, `kv-b-layout` for a kv_b-derived tensor
/// without TP, else `mismatch` with the heads' order as evidence.
pub fn heads_permuted(f: &Failing<'_>) -> Option<Finding> {
    let (axis, unit) = match f.p.split {
        TpSplit::ColumnByHeads(h) => (0, h.width(f.cfg.dims())),
        TpSplit::RowByHeads(h) => (1, h.width(f.cfg.dims())),
        _ => return None,
    };
    if f.shape != f.exp_shape {
        return None;
    }
    let m = head_order(f.data, f.exp, f.shape, axis, unit, f.thr)?;
    let class = head_order_class(f.tp, KvBWeight::of_param(f.param).is_some());
    let d = head_order_detection(&m, unit, axis, class, rel(f.data, f.exp));
    Some(f.finding(class, d.evidence, d.hint))
}

/// A TP column cut inside a quant block (`o_proj` and `down_proj` shards: the input dim is the
/// GGUF's ne\[0]).
pub fn quant_block_cut(f: &Failing<'_>) -> Option<Finding> {
    if let (Some(1), Some((r, ranges)), Some(src0)) = (f.p.split.dim(), &f.rank, f.p.sources.first())
        && let [range] = ranges.as_slice()
        && let (r, start, end) = (*r, range.start, range.end)
        && let block = src0.block
        && block > 1
        && (!(start as u64).is_multiple_of(block) || !(end as u64).is_multiple_of(block))
    {
        let bad_at = if (start as u64).is_multiple_of(block) {
            end
        } else {
            start
        };
        let b0 = bad_at as u64 / block;
        return Some(f.finding(
            Class::QuantBlockMisaligned,
            format!(
                "rank {r} covers columns {start}..{end} of {} ({}, blocks of {} along ne[0]): the cut at column \
                 {bad_at} falls inside block {b0} (columns {}..{}), and the shard differs from the dequantized slice",
                src0.name,
                src0.ggml_type,
                block,
                b0 * block,
                (b0 + 1) * block
            ),
            if f.p.split == TpSplit::Row {
                "dequantize before slicing, or keep TP cuts on block boundaries (F/tp, the FFN width per \
                     rank, must be a multiple of the block size)"
                    .into()
            } else {
                "dequantize before slicing, or keep TP cuts on block boundaries (N·V/tp must be a multiple of \
                     the block size)"
                    .into()
            },
        ));
    }
    None
}

/// A block-quantized matrix dequantized with other block scales than its own: every block of
/// the file's tensor is the expected block times one constant, and the constants differ between
/// blocks (a scale grid read transposed, or reshaped after a transpose as
/// `s.t().contiguous().view(s.shape)` does, a block given its neighbour's scale, scales rounded
/// to powers of two). Needs the stored scale grid of every source ([`Source::scales`]: an fp8
/// checkpoint), the whole tensor (no TP shard) and the sources stacked along the rows. The
/// evidence names what the applied scales are when one layout explains all of them.
pub fn scale_layout(f: &Failing<'_>) -> Option<Finding> {
    if f.rank.is_some() || f.shape != f.exp_shape || f.shape.len() != 2 || f.data.len() != f.exp.len() {
        return None;
    }
    let grids: Vec<&BlockScales> = f.p.sources.iter().map(|s| s.scales.as_ref()).collect::<Option<_>>()?;
    if grids.iter().map(|g| g.shape[0]).sum::<usize>() != f.shape[0]
        || grids
            .iter()
            .any(|g| g.shape[1] != f.shape[1] || g.scale.len() != g.grid[0] * g.grid[1])
    {
        return None;
    }
    let blocks = block_factors(f, &grids)?;
    let tol = f.thr.max(1e-3);
    let off: Vec<&BlockFactor> = blocks.iter().filter(|b| (b.factor - 1.0).abs() > tol).collect();
    let (lo, hi) = blocks.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), b| {
        (lo.min(b.factor), hi.max(b.factor))
    });
    // One factor for every block is a scale of the whole tensor, not of its blocks.
    if off.is_empty() || hi - lo <= tol * hi.abs().max(1.0) {
        return None;
    }
    let layout = applied_layout(&blocks, &grids, tol, f.tp);
    let (b, g0) = (off[0], grids[off[0].src]);
    let evidence = format!(
        "each {}×{} block is the expected block times one factor ({} of {} blocks ≠ 1, from {lo:.4} to {hi:.4}; \
         first block ({}, {}) of {}: ×{:.4}): the scales applied are {layout}",
        g0.block[0],
        g0.block[1],
        off.len(),
        blocks.len(),
        b.at[0],
        b.at[1],
        f.p.sources[b.src].name,
        b.factor
    );
    let hint = format!(
        "dequantize with {}[r / {}, c / {}] as stored (row-major [ceil(out/{}), ceil(in/{})]); check where the \
         loader or the kernel re-lays the scale grid out",
        g0.name, g0.block[0], g0.block[1], g0.block[0], g0.block[1]
    );
    Some(f.finding(Class::QuantScaleLayout, evidence, hint))
}

/// One block of a block-scaled source: the least-squares factor of the file's block over the
/// expected one, and the scale that factor implies was applied (factor × the stored scale).
pub(super) struct BlockFactor {
    /// Index of the source among the param's sources.
    pub(super) src: usize,
    /// The block's `[row, col]` in its source's grid.
    pub(super) at: [usize; 2],
    pub(super) factor: f64,
    pub(super) applied: f64,
}

/// The factor of every block of `f` with a nonzero expected block, the sources stacked along
/// the rows; `None` when some block is not its expected block times a constant (within
/// `f.thr`), so no scale explains the difference.
fn block_factors(f: &Failing<'_>, grids: &[&BlockScales]) -> Option<Vec<BlockFactor>> {
    let cols = f.shape[1];
    let mut blocks = Vec::new();
    let mut row0 = 0;
    for (src, g) in grids.iter().enumerate() {
        for bi in 0..g.grid[0] {
            for bj in 0..g.grid[1] {
                let rows = row0 + bi * g.block[0]..(row0 + (bi + 1) * g.block[0]).min(row0 + g.shape[0]);
                let cs = bj * g.block[1]..((bj + 1) * g.block[1]).min(cols);
                let at = |r: usize, c: usize| (f.data[r * cols + c], f.exp[r * cols + c]);
                let pairs = || rows.clone().flat_map(|r| cs.clone().map(move |c| (r, c)));
                let (de, ee) = pairs().fold((0.0, 0.0), |(de, ee), (r, c)| {
                    let (d, e) = at(r, c);
                    (de + d * e, ee + e * e)
                });
                if ee == 0.0 {
                    continue;
                }
                let a = de / ee;
                let res: f64 = pairs()
                    .map(|(r, c)| {
                        let (d, e) = at(r, c);
                        (d - a * e) * (d - a * e)
                    })
                    .sum();
                if !a.is_finite() || (res / ee).sqrt() > f.thr {
                    return None;
                }
                let stored = f64::from(g.scale[bi * g.grid[1] + bj]);
                blocks.push(BlockFactor {
                    src,
                    at: [bi, bj],
                    factor: a,
                    applied: a * stored,
                });
            }
        }
        row0 += g.shape[0];
    }
    Some(blocks)
}

/// What the applied scales of `blocks` are, as text: the stored grid transposed (square grids),
/// transposed and reshaped to its own shape, under TP (`tp` ≥ 2, the columns cut into `tp`
/// equal rank shards as a row-parallel matrix's are) every rank's columns with rank 0's
/// scales, powers of two (a UE8M0 conversion of scales that are not), other blocks' stored
/// scales, or none of those. Scales match within `tol`, relative.
pub(super) fn applied_layout(blocks: &[BlockFactor], grids: &[&BlockScales], tol: f64, tp: usize) -> String {
    let same = |x: f64, y: f64| (x - y).abs() <= tol * y.abs().max(f64::MIN_POSITIVE);
    let stored = |b: &BlockFactor, i: usize, j: usize| f64::from(grids[b.src].scale[i * grids[b.src].grid[1] + j]);
    let all = |h: &dyn Fn(&BlockFactor) -> Option<f64>| blocks.iter().all(|b| h(b).is_some_and(|s| same(b.applied, s)));
    // s.t().contiguous().view(s.shape): flat position k of the [gr, gc] grid holds s[k % gr, k / gr].
    let t_view = |b: &BlockFactor| {
        let [gr, gc] = grids[b.src].grid;
        let k = b.at[0] * gc + b.at[1];
        Some(stored(b, k % gr, k / gr))
    };
    let transposed = |b: &BlockFactor| {
        let [gr, gc] = grids[b.src].grid;
        (gr == gc).then(|| stored(b, b.at[1], b.at[0]))
    };
    let rank0 = |b: &BlockFactor| {
        let per = grids[b.src].grid[1] / tp.max(1);
        (tp >= 2 && per > 0 && grids[b.src].grid[1].is_multiple_of(tp)).then(|| stored(b, b.at[0], b.at[1] % per))
    };
    let pow2 = |x: f64| x > 0.0 && (x.log2() - x.log2().round()).abs() < 1e-5;
    let g0 = grids[blocks.first().map_or(0, |b| b.src)];
    if all(&transposed) {
        format!(
            "the grid transposed ({} [{}, {}] read as its transpose)",
            g0.name, g0.grid[0], g0.grid[1]
        )
    } else if all(&t_view) {
        format!(
            "the grid transposed and reshaped to its own shape ({} [{}, {}] read as s.t().contiguous().view(s.shape))",
            g0.name, g0.grid[0], g0.grid[1]
        )
    } else if all(&rank0) {
        format!(
            "rank 0's scales on every rank: each of the {tp} ranks' {} block columns of {} read with rank 0's (the \
             scale shard cut at offset 0, not at the rank's)",
            g0.grid[1] / tp.max(1),
            g0.name
        )
    } else if blocks.iter().all(|b| pow2(b.applied))
        && !grids.iter().all(|g| g.scale.iter().all(|&s| pow2(f64::from(s))))
    {
        "powers of two: the stored scales rounded (a UE8M0 conversion)".to_string()
    } else if blocks
        .iter()
        .all(|b| grids[b.src].scale.iter().any(|&s| same(b.applied, f64::from(s))))
    {
        "stored scales of other blocks".to_string()
    } else {
        "not the stored scales".to_string()
    }
}

/// Fallback: which rows differ.
pub fn row_differences(f: &Failing<'_>) -> Finding {
    let rows = f.shape[0];
    let inner: usize = f.shape[1..].iter().product();
    let bad: Vec<usize> = (0..rows)
        .filter(|&i| rel(&f.data[i * inner..(i + 1) * inner], &f.exp[i * inner..(i + 1) * inner]) > f.thr)
        .collect();
    f.finding(
        Class::Mismatch,
        format!(
            "{} of {rows} rows differ (first {:?}); rel_l2 {:.2e} overall",
            bad.len(),
            &bad[..bad.len().min(8)],
            rel(f.data, f.exp)
        ),
        "no block permutation, duplicate or transpose explains it: compare the loader's dequantization of these rows"
            .into(),
    )
}

/// A tensor of the file named for a param the model (or this layer) does not have: `q_proj` in
/// a model with a query LoRA (`q_lora_rank` set), or `q_a_proj`, `q_b_proj`,
/// `fused_qkv_a_proj` in one without; the dense MLP's `gate_up_proj`/`down_proj` in an MoE
/// layer, the `shared_experts.` ones in a dense layer or a model without shared experts. `name`
/// is the file's tensor name, `rank` its TP rank, `layer` its layer.
pub fn param_absent(name: &str, param: &str, rank: Option<usize>, layer: usize, cfg: &MlaConfig) -> Finding {
    let tensor = LoadedTensor {
        tensor: name.to_string(),
        rank: rank.map_or(TpRank::Whole, TpRank::Rank),
        source: Vec::new(),
    };
    let ffn = crate::model::tensors::FFN_DUMP_TENSORS
        .iter()
        .filter_map(|t| t.row().vllm)
        .any(|v| {
            let own = v.merged.map(|m| crate::model::tensors::dump_name(m.checkpoint));
            crate::model::tensors::dump_name(v.param) == param || own == Some(param)
        });
    let d = if ffn {
        let shared = cfg.moe.as_ref().map_or(0, |m| m.n_expert_shared);
        let what = if cfg.is_moe_layer(layer) && param.starts_with("shared_experts.") {
            format!("layer {layer} has no shared experts (expert_shared_count {shared})")
        } else if cfg.is_moe_layer(layer) {
            format!(
                "layer {layer} is an MoE layer (leading_dense_block_count {}): it has no dense MLP `{param}`",
                cfg.leading_dense_block_count
            )
        } else {
            format!(
                "layer {layer} is a dense layer (leading_dense_block_count {}): it has no `{param}`",
                cfg.leading_dense_block_count
            )
        };
        Detection::new(
            what,
            "gate_up_proj/down_proj exist in the dense layers (the first leading_dense_block_count), \
             shared_experts.gate_up_proj/down_proj in the MoE layers with expert_shared_count > 0"
                .into(),
        )
    } else {
        Detection::new(
            format!("the model has no `{param}` (q_lora_rank {:?})", cfg.q_lora_rank),
            "q_a_proj/q_b_proj/fused_qkv_a_proj exist only with q_lora_rank; q_proj only without".into(),
        )
    };
    Finding::at_loaded(Class::Mismatch, tensor, d)
}

/// A shard named for rank `rank` (file tensor `name`) of a file whose TP size `tp` has no such
/// rank; `p` is its param rebuilt from the GGUF. `tp-rank-order` under TP; at a declared TP size
/// of 1 no rank class is claimed (`mismatch`: the names and the declared size disagree).
pub fn rank_out_of_range(name: &str, rank: usize, tp: usize, p: &Param) -> Finding {
    let tensor = LoadedTensor {
        tensor: name.to_string(),
        rank: TpRank::Rank(rank),
        source: p.source_names(),
    };
    let class = if tp >= 2 { Class::TpRankOrder } else { Class::Mismatch };
    Finding::at_loaded(
        class,
        tensor,
        Detection::new(
            format!("rank {rank} ≥ tp_size {tp}"),
            "shard names must use ranks 0..tp_size (or the file must declare the TP size it was cut for)".into(),
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `exp` ([1, 3, 4], values 0..12) transposed per head: shape [1, 4, 3].
    fn one_head() -> (Vec<f64>, Vec<f64>) {
        let exp: Vec<f64> = (0..12u8).map(f64::from).collect();
        let mut data = vec![0.0; 12];
        for i in 0..3 {
            for j in 0..4 {
                data[j * 3 + i] = exp[i * 4 + j];
            }
        }
        (exp, data)
    }

    #[test]
    fn a_transposed_head_is_found() {
        let (exp, data) = one_head();
        let (class, _) = transposed_of("W_UK_T", &data, &[1, 4, 3], &exp, &[1, 3, 4], 1e-9, "src", false).unwrap();
        assert_eq!(class, Class::KvBLayout);
    }

    /// An expected shape of more heads than its buffer holds (a shard cut for another TP size),
    /// or a tensor of another head count: no transpose, and no index past either buffer.
    #[test]
    fn shapes_that_disagree_with_their_buffers_or_heads_are_no_transpose() {
        let (exp, data) = one_head();
        assert!(transposed_of("W_UK_T", &data, &[1, 4, 3], &exp, &[2, 3, 4], 1e-9, "src", false).is_none());
        assert!(transposed_of("W_UK_T", &data, &[2, 4, 3], &exp, &[1, 3, 4], 1e-9, "src", false).is_none());
        assert!(transposed_of("W_UV", &data, &[3, 4, 3], &exp, &[1, 3, 4], 1e-9, "src", true).is_none());
    }
}
