//! The split-KV decode replay behind `lse-merge`: what a decode's merge of its KV splits did.
//!
//! vLLM's Triton MLA decode (and the `mqa` path) cuts each decode row's `ctx` keys into
//! `K = num_kv_splits` splits of `⌈ctx/K⌉` keys (split `s` holds keys `[s·⌈ctx/K⌉, (s+1)·⌈ctx/K⌉)`
//! cut at `ctx`), computes one partial state per split (its softmax-weighted values and its LSE)
//! and merges the partials by LSE. `K` is set by the step's longest sequence, so a short row
//! batched with a long one gets splits with no keys, which the merge must skip. A merge bug
//! leaves every input of attention right and bends the output and the LSE of the rows it
//! reaches, in a way the replay can reproduce: from the reference's inputs (which the candidate's
//! passed), each row's splits are rebuilt for a split count `K` (the step's recorded
//! `num_kv_splits`, else each of a bounded search) and merged under each rule: the partial LSEs
//! in base 2 merged as natural logs (sglang#40903), split `j` (or each row's last split with
//! keys) lost from the merge or merged twice, the empty splits merged as if they had keys with
//! LSE 0 and a zero output (a zero-filled partial buffer) or with LSE +∞. A rule explains the site when the replay matches
//! the output site and the LSE together; nothing is fitted beyond the discrete choices (`K`, the
//! rule, `j`). An empty split merged with a finite stale LSE and output (whatever its partial
//! buffer held) cannot be replayed value for value; it is recognised by its footprint instead:
//! the wrong rows are exactly rows with an empty split at some `K`, the correct merge explains
//! every other row, and each wrong row's LSE is above the right one (a stale partial only adds
//! weight).

use rayon::prelude::*;

use super::attention::{AttnRecompute, spread_rows};
use super::{Detection, SiteCtx, explain_threshold};
use crate::compute::path::PathKind;
use crate::core::sci::sci;
use crate::core::trace::{Site, Stage, TraceTensor};
use crate::judge::label::PathLabel;
use crate::judge::tolerance::tolerance;

/// Failing (token, head) rows the replay samples at most, and as many spread over every row: a
/// merge bug reaches the rows with empty or uneven splits, which a spread sample alone can miss
/// (a short row batched with a long one is one token of many).
const SPLIT_SAMPLE_ROWS: usize = 64;

/// The largest split count the search tries without a recorded one: vLLM's Triton MLA takes the
/// next power of two of `max_seq_len / 512`, capped at twice the GPU's SMs (264 on an H200), so
/// 256 covers sequences up to 128k tokens; counts above a row's context add only empty splits.
const MAX_SEARCHED_SPLITS: usize = 256;

/// How a merge combined the partials of a row's splits: the hypotheses the replay tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rule {
    /// Each split's LSE in base 2 (`log2 Σ 2^x`-style kernels), merged by the natural-log rule.
    Base2,
    /// Split `j` left out of the merge.
    Dropped(usize),
    /// Split `j` merged twice.
    Duplicated(usize),
    /// Each row's last split with keys left out of the merge (a loop bound one short).
    DroppedLast,
    /// Each row's last split with keys merged twice.
    DuplicatedLast,
    /// Every empty split merged as a state with LSE 0 and a zero output (a zero-filled buffer).
    EmptyZero,
    /// Every empty split merged as a state with LSE +∞.
    EmptyPlusInf,
}

impl Rule {
    /// The rule as evidence states it.
    fn describe(self, k: usize) -> String {
        match self {
            Rule::Base2 => "each split's LSE in base 2, merged as natural log".into(),
            Rule::Dropped(j) => format!("split {j} of {k} lost from the merge"),
            Rule::Duplicated(j) => format!("split {j} of {k} merged twice"),
            Rule::DroppedLast => "each row's last split with keys lost from the merge".into(),
            Rule::DuplicatedLast => "each row's last split with keys merged twice".into(),
            Rule::EmptyZero => "each empty split merged as if it had keys, with LSE 0 and a zero output".into(),
            Rule::EmptyPlusInf => "each empty split merged as if it had keys, with LSE +inf".into(),
        }
    }

    /// Where to look in the engine.
    fn hint(self, k: usize) -> String {
        match self {
            Rule::Base2 => "a kernel returned its split LSEs in base 2 (FlashInfer's and TRT-LLM's MLA kernels do by \
                            default) and a natural-log merge combined them: multiply each LSE by ln 2 before the \
                            merge, or ask the kernel for natural-log LSEs"
                .into(),
            Rule::Dropped(j) if j + 1 == k => format!(
                "the merge loop stops one split short (split {j}, the last of num_kv_splits = {k}): every split's \
                 partial must enter the merge (a range(num_kv_splits - 1), or a split count read from another \
                 launch)"
            ),
            Rule::Dropped(j) => format!(
                "split {j}'s partial never reaches the merge (its LSE read as −inf, or its index skipped): every \
                 split of num_kv_splits = {k} must enter it"
            ),
            Rule::Duplicated(j) => format!(
                "split {j}'s partial enters the merge twice (an accumulator initialised with it and a loop that \
                 starts at it again, or a split index read twice): each of the {k} splits must be merged once"
            ),
            Rule::DroppedLast => format!(
                "the merge of a row's {k} splits stops one short of its last split with keys (a loop bound of \
                 the row's filled splits minus one): every split with keys must enter the merge"
            ),
            Rule::DuplicatedLast => format!(
                "a row's last split with keys enters the merge twice (the loop's final partial merged again \
                 after it): each of the {k} splits must be merged once"
            ),
            Rule::EmptyZero => format!(
                "{}; here its partial buffer was merged as it was left, zero-filled",
                empty_split_rule(k)
            ),
            Rule::EmptyPlusInf => format!("{}, never +inf (which turns the merge into NaN)", empty_split_rule(k)),
        }
    }
}

/// What an empty split must do in a merge of `k` splits.
fn empty_split_rule(k: usize) -> String {
    format!(
        "an empty split (its ⌈ctx/{k}⌉-key range starts at or past the row's ctx: a short row batched with a long \
         one) must contribute nothing: the merge must skip it (vLLM's Triton MLA stage 2 checks split_kv_end > \
         split_kv_start) or stage 1 must write LSE −inf for it"
    )
}

/// A rel_l2 as evidence quotes it; `non-finite` where a value is finite on one side only.
fn rel_text(e: f64) -> String {
    if e.is_finite() { sci(e, 2) } else { "non-finite".into() }
}

/// The key ranges of `k` splits of `nk` keys: `⌈nk/k⌉` keys each, the last ones cut at `nk`
/// (empty when they start at or past it).
fn split_ranges(nk: usize, k: usize) -> Vec<std::ops::Range<usize>> {
    let sl = nk.div_ceil(k.max(1));
    (0..k).map(|s| (s * sl).min(nk)..((s + 1) * sl).min(nk)).collect()
}

/// Natural-log LSE merge of `states` (LSE, output; `None` is a zero output) into (output, LSE),
/// as vLLM's merges and the `mqa` path's compute it: a −∞ state contributes nothing, only −∞
/// states give zeros and −∞, a +∞ state gives NaN (its weight is e^(∞−∞)).
fn merge(states: &[(f64, Option<&[f64]>)], width: usize) -> (Vec<f64>, f64) {
    let m = states.iter().map(|s| s.0).fold(f64::NEG_INFINITY, f64::max);
    if m == f64::NEG_INFINITY {
        return (vec![0.0; width], m);
    }
    let mut o = vec![0.0; width];
    let mut z = 0.0;
    for &(l, out) in states {
        if l == f64::NEG_INFINITY {
            continue;
        }
        let w = (l - m).exp();
        z += w;
        if let Some(out) = out {
            for (a, b) in o.iter_mut().zip(out) {
                *a += w * b;
            }
        }
    }
    o.iter_mut().for_each(|a| *a /= z);
    (o, m + z.ln())
}

/// One row's split states and the sums of its right merge, from which the rules' merges follow.
struct RowStates {
    /// Per split: its LSE and softmax-weighted values; `None` for an empty split.
    parts: Vec<Option<(f64, Vec<f64>)>>,
    width: usize,
    /// The largest split LSE, each split's weight e^(LSE − m) (0 when empty), their sum and the
    /// weighted sum of the split outputs.
    m: f64,
    w: Vec<f64>,
    z: f64,
    sum: Vec<f64>,
}

impl RowStates {
    /// The states of the splits `ranges` of a row with scaled logits `s`, the value row of key
    /// `j` being `value(j)` (`width` values).
    fn new<'v>(ranges: &[std::ops::Range<usize>], s: &[f64], value: impl Fn(usize) -> &'v [f64], width: usize) -> Self {
        let parts: Vec<Option<(f64, Vec<f64>)>> = ranges
            .iter()
            .map(|rg| {
                if rg.is_empty() {
                    return None;
                }
                let lse = lse_of(&s[rg.clone()]);
                let mut o = vec![0.0; width];
                for j in rg.clone() {
                    let p = (s[j] - lse).exp();
                    for (od, vd) in o.iter_mut().zip(value(j)) {
                        *od += p * vd;
                    }
                }
                Some((lse, o))
            })
            .collect();
        let m = parts.iter().flatten().map(|p| p.0).fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = parts
            .iter()
            .map(|p| p.as_ref().map_or(0.0, |(l, _)| (l - m).exp()))
            .collect();
        let mut sum = vec![0.0; width];
        for (p, &wi) in parts.iter().zip(&w) {
            if let Some((_, o)) = p {
                for (a, b) in sum.iter_mut().zip(o) {
                    *a += wi * b;
                }
            }
        }
        RowStates {
            z: w.iter().sum(),
            parts,
            width,
            m,
            w,
            sum,
        }
    }

    /// The last split with keys.
    fn last_filled(&self) -> Option<usize> {
        self.parts.iter().rposition(Option::is_some)
    }

    fn n_empty(&self) -> usize {
        self.parts.iter().filter(|p| p.is_none()).count()
    }

    /// The filled splits as merge states.
    fn filled(&self) -> Vec<(f64, Option<&[f64]>)> {
        self.parts
            .iter()
            .flatten()
            .map(|(l, o)| (*l, Some(o.as_slice())))
            .collect()
    }

    /// The right merge: the filled splits, the empty ones left out.
    fn exact(&self) -> (Vec<f64>, f64) {
        merge(&self.filled(), self.width)
    }

    /// The merge under `rule`; `None` where the rule changes nothing for this row (no empty
    /// split for the empty-split rules, split `j` empty or absent for a lost or doubled split).
    /// A lost or doubled split comes from the right merge's sums, so each costs one pass over
    /// the output, not one merge of every split.
    fn predict(&self, rule: Rule) -> Option<(Vec<f64>, f64)> {
        let width = self.width;
        match rule {
            Rule::Base2 => {
                let st: Vec<(f64, Option<&[f64]>)> = self
                    .filled()
                    .into_iter()
                    .map(|(l, o)| (l / std::f64::consts::LN_2, o))
                    .collect();
                Some(merge(&st, width))
            }
            Rule::EmptyZero | Rule::EmptyPlusInf if self.n_empty() == 0 => None,
            Rule::EmptyZero => {
                let mut st = self.filled();
                st.extend(std::iter::repeat_n((0.0, None), self.n_empty()));
                Some(merge(&st, width))
            }
            Rule::EmptyPlusInf => {
                let mut st = self.filled();
                st.push((f64::INFINITY, None));
                Some(merge(&st, width))
            }
            Rule::DroppedLast => self.predict(Rule::Dropped(self.last_filled()?)),
            Rule::DuplicatedLast => self.predict(Rule::Duplicated(self.last_filled()?)),
            Rule::Duplicated(j) => {
                let (_, oj) = self.parts.get(j)?.as_ref()?;
                let (wj, z) = (self.w[j], self.z + self.w[j]);
                let o = self.sum.iter().zip(oj).map(|(s, o)| (s + wj * o) / z).collect();
                Some((o, self.m + z.ln()))
            }
            Rule::Dropped(j) => {
                let (_, oj) = self.parts.get(j)?.as_ref()?;
                // The remaining weight summed directly: z − w_j cancels when split j dominates.
                let z: f64 = self.w.iter().enumerate().filter(|&(s, _)| s != j).map(|(_, w)| w).sum();
                if z == 0.0 {
                    return Some((vec![0.0; width], f64::NEG_INFINITY));
                }
                let wj = self.w[j];
                let o = if wj <= 0.5 * self.z {
                    self.sum.iter().zip(oj).map(|(s, o)| (s - wj * o) / z).collect()
                } else {
                    let mut st = self.filled();
                    let filled_j = self.parts[..j].iter().flatten().count();
                    st.remove(filled_j);
                    merge(&st, width).0
                };
                Some((o, self.m + z.ln()))
            }
        }
    }
}

/// `log Σ e^s` over `s`.
fn lse_of(s: &[f64]) -> f64 {
    let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if m == f64::NEG_INFINITY {
        return m;
    }
    m + s.iter().map(|v| (v - m).exp()).sum::<f64>().ln()
}

/// The candidate's values of one sampled row, and which of them it holds.
struct CandRow {
    out: Vec<f64>,
    lse: Option<f64>,
}

/// A row's squared distances to the candidate, or a mismatch of finiteness.
#[derive(Debug, Clone, Copy, Default)]
struct Dist {
    out: f64,
    lse: f64,
    /// An element finite on one side only.
    mismatch: bool,
}

impl Dist {
    fn of(pred_out: &[f64], pred_lse: f64, c: &CandRow) -> Dist {
        let mut d = Dist::default();
        for (p, q) in pred_out.iter().zip(&c.out) {
            match (p.is_finite(), q.is_finite()) {
                (true, true) => d.out += (p - q) * (p - q),
                (false, false) => {}
                _ => d.mismatch = true,
            }
        }
        if let Some(q) = c.lse {
            match (pred_lse.is_finite(), q.is_finite()) {
                (true, true) => d.lse += (pred_lse - q) * (pred_lse - q),
                (false, false) => {}
                _ => d.mismatch = true,
            }
        }
        d
    }

    fn add(&mut self, o: Dist) {
        self.out += o.out;
        self.lse += o.lse;
        self.mismatch |= o.mismatch;
    }
}

/// One rule's replay summed over the sampled rows.
#[derive(Debug, Clone, Copy, Default)]
struct RuleSum {
    dist: Dist,
    /// The same over the clearly wrong rows alone.
    wrong: Dist,
    /// Rows where the rule's prediction differs from the right merge.
    acted: usize,
}

/// The stale-partial footprint at one split count, summed over the sampled rows.
#[derive(Debug, Clone, Default)]
struct Footprint {
    /// Sampled rows with an empty split.
    with_empty: usize,
    /// Clearly wrong rows with an empty split, and their LSE above the right merge's and the
    /// implied LSE of one empty split (both `None` without a candidate LSE).
    wrong_in_empty: Vec<(Option<f64>, Option<f64>)>,
    /// Clearly wrong rows without one.
    wrong_elsewhere: usize,
    /// The right merge against the candidate on the rows without an empty split.
    others: Dist,
    /// How many rows those are.
    others_rows: usize,
    /// The candidate's squared norms on those rows.
    others_norm: (f64, f64),
}

/// What one split count gives on the sampled rows.
struct AtK {
    k: usize,
    rules: Vec<(Rule, RuleSum)>,
    footprint: Footprint,
}

/// The sampled rows with what the replay needs: the recomputed logits and keys, the candidate's
/// values, and whether the row is a decode row (split) or a prefill row (one state).
struct Sample<'a> {
    rc: AttnRecompute,
    cand: Vec<CandRow>,
    decode: Vec<bool>,
    /// Per row: clearly wrong against the reference.
    wrong: Vec<bool>,
    /// The candidate's squared norms over the sampled rows (finite elements): output, LSE.
    norm: (f64, f64),
    /// The same over the clearly wrong rows.
    norm_wrong: (f64, f64),
    /// The error as is on the sampled rows: output, LSE.
    as_is: (f64, f64),
    /// The same over the clearly wrong rows.
    as_is_wrong: (f64, f64),
    out_stage: Stage,
    has_lse: bool,
    /// The path's rows, for [`Sample::describe_k`].
    x: &'a SiteCtx<'a>,
}

/// Per token of the judged batch, whether a split-KV decode computed it; `None` on a path
/// without one. `mqa` decodes every token; `mixed` the last token of each of its first ⌈S/2⌉
/// sequences ([`crate::compute::engine::mixed_decode_seqs`]); a dump that holds `attn_latent`
/// decoded every row (only the absorbed decode computes it: vLLM's hook dumps it when the step
/// is all decodes, a decode kernel's dump for each of its queries), and in a dump without it the
/// decode rows are the sequences with one new token in the step (vLLM's decode threshold).
fn decode_tokens(x: &SiteCtx<'_>) -> Option<Vec<bool>> {
    let batch = x.input.batch;
    let latent = x.path.trace.get(&Site::new(x.site.layer, Stage::AttnLatent)).is_some();
    let per_seq: Vec<bool> = match x.path.kind {
        PathLabel::Path(PathKind::Mqa) => return Some(vec![true; batch.n_tokens()]),
        PathLabel::Dump if latent => return Some(vec![true; batch.n_tokens()]),
        PathLabel::Path(PathKind::Mixed) => {
            let n_dec = crate::compute::engine::mixed_decode_seqs(batch);
            let mut v = Vec::with_capacity(batch.n_tokens());
            for (si, sq) in batch.seqs.iter().enumerate() {
                v.extend((0..sq.len).map(|i| si < n_dec && i + 1 == sq.len));
            }
            return v.iter().any(|&d| d).then_some(v);
        }
        PathLabel::Dump => batch.seqs.iter().map(|sq| sq.len == 1).collect(),
        PathLabel::Path(_) => return None,
    };
    let v: Vec<bool> = batch
        .seqs
        .iter()
        .zip(per_seq)
        .flat_map(|(sq, d)| std::iter::repeat_n(d, sq.len))
        .collect();
    v.iter().any(|&d| d).then_some(v)
}

/// Each row's relative L2 error against the reference, for rows of `width` values, with the
/// norm floored at a typical row's (rows near zero would otherwise fail on rounding alone);
/// infinite for a row with a value finite on one side only. Reads the tensors in place (an
/// attention output at real size is gigabytes as f64).
fn row_errors(refr: &TraceTensor, cand: &TraceTensor, width: usize) -> Vec<f64> {
    let w = width.max(1);
    let rows = refr.len() / w;
    let (sum, count) = (0..refr.len())
        .into_par_iter()
        .map(|i| refr.get(i))
        .filter(|v| v.is_finite())
        .map(|v| (v * v, 1usize))
        .reduce(|| (0.0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
    let floor = (sum / count.max(1) as f64).sqrt() * (w as f64).sqrt();
    (0..rows)
        .into_par_iter()
        .map(|i| {
            let (mut d, mut n) = (0.0, 0.0);
            for j in i * w..(i + 1) * w {
                let (a, b) = (refr.get(j), cand.get(j));
                match (a.is_finite(), b.is_finite()) {
                    (true, true) => d += (a - b) * (a - b),
                    (false, false) => {}
                    _ => return f64::INFINITY,
                }
                n += a * a;
            }
            d.sqrt() / n.sqrt().max(floor).max(f64::MIN_POSITIVE)
        })
        .collect()
}

/// At most `count` of `v`, spread evenly.
fn spread_pick(v: &[usize], count: usize) -> Vec<usize> {
    if v.len() <= count {
        return v.to_vec();
    }
    (0..count).map(|i| v[i * v.len() / count]).collect()
}

impl<'a> Sample<'a> {
    /// The sample for the failing site of `x`: its clearly wrong (token, head) rows first, then
    /// a spread over every row; `None` without the inputs the replay needs.
    fn build(x: &'a SiteCtx<'a>) -> Option<Self> {
        let layer = x.site.layer;
        let cand_of = |stage| x.path.trace.get(&Site::new(layer, stage));
        let out_stage = match x.site.stage {
            Stage::Lse => [Stage::AttnLatent, Stage::AttnOut]
                .into_iter()
                .find(|&st| cand_of(st).is_some() && x.ref_site(st).is_some())?,
            st => st,
        };
        let (cand_out, ref_out) = (cand_of(out_stage)?, x.ref_site(out_stage)?);
        if cand_out.len() != ref_out.len() {
            return None;
        }
        let lse = match (cand_of(Stage::Lse), x.ref_site(Stage::Lse)) {
            (Some(c), Some(r)) if c.len() == r.len() => Some((c, r)),
            _ => None,
        };
        let decode_tok = decode_tokens(x)?;
        let n = x.input.cfg.n_head;
        let t = x.input.batch.n_tokens();
        let rows = t * n;
        let width = cand_out.len() / rows.max(1);
        if rows == 0 || width * rows != cand_out.len() || lse.is_some_and(|(c, _)| c.len() != rows) {
            return None;
        }
        let tol = |st| tolerance(st, x.input.precision).0.rel_l2;
        let mut err: Vec<f64> = row_errors(ref_out, cand_out, width)
            .into_iter()
            .map(|e| e / tol(out_stage))
            .collect();
        if let Some((c, r)) = lse {
            for (e, l) in err.iter_mut().zip(row_errors(r, c, 1)) {
                *e = e.max(l / tol(Stage::Lse));
            }
        }
        // Clearly wrong: ten times the site's rel_l2 tolerance (noise stays below it).
        let wrong_rows: Vec<usize> = (0..rows).filter(|&i| err[i] > 10.0).collect();
        let mut rows_sampled = spread_pick(&wrong_rows, SPLIT_SAMPLE_ROWS);
        rows_sampled.extend(spread_rows(t, n, SPLIT_SAMPLE_ROWS));
        rows_sampled.sort_unstable();
        rows_sampled.dedup();
        let rc = AttnRecompute::build_rows(x, out_stage, rows_sampled)?;
        let cand: Vec<CandRow> = rc
            .sampled_rows
            .iter()
            .map(|(row, _, _)| CandRow {
                out: (row * width..(row + 1) * width).map(|j| cand_out.get(j)).collect(),
                lse: lse.map(|(c, _)| c.get(*row)),
            })
            .collect();
        let decode = rc.sampled_rows.iter().map(|(row, _, _)| decode_tok[row / n]).collect();
        let wrong: Vec<bool> = rc.sampled_rows.iter().map(|(row, _, _)| err[*row] > 10.0).collect();
        // Squares of finite values; a value finite on one side only is an infinite difference.
        let sq = |v: f64| if v.is_finite() { v * v } else { 0.0 };
        let dsq = |a: f64, b: f64| match (a.is_finite(), b.is_finite()) {
            (true, true) => (a - b) * (a - b),
            (false, false) => 0.0,
            _ => f64::INFINITY,
        };
        let (mut norm, mut diff) = ([0.0; 2], [0.0; 2]);
        let (mut norm_w, mut diff_w) = ([0.0; 2], [0.0; 2]);
        for (((row, _, _), c), &w) in rc.sampled_rows.iter().zip(&cand).zip(&wrong) {
            let n0 = c.out.iter().map(|&v| sq(v)).sum::<f64>();
            let d0 = (0..width)
                .map(|d| dsq(c.out[d], ref_out.get(row * width + d)))
                .sum::<f64>();
            let (n1, d1) = match (c.lse, lse) {
                (Some(l), Some((_, r))) => (sq(l), dsq(l, r.get(*row))),
                _ => (0.0, 0.0),
            };
            norm[0] += n0;
            norm[1] += n1;
            diff[0] += d0;
            diff[1] += d1;
            if w {
                norm_w[0] += n0;
                norm_w[1] += n1;
                diff_w[0] += d0;
                diff_w[1] += d1;
            }
        }
        let rel = Self::rel;
        Some(Sample {
            rc,
            cand,
            decode,
            wrong,
            as_is: (rel(diff[0], norm[0]), rel(diff[1], norm[1])),
            as_is_wrong: (rel(diff_w[0], norm_w[0]), rel(diff_w[1], norm_w[1])),
            norm: (norm[0], norm[1]),
            norm_wrong: (norm_w[0], norm_w[1]),
            out_stage,
            has_lse: lse.is_some(),
            x,
        })
    }

    /// Every rule replayed at split count `k` on every sampled row, and the stale footprint.
    fn at_k(&self, k: usize) -> AtK {
        let mut rules = vec![
            Rule::Base2,
            Rule::EmptyZero,
            Rule::EmptyPlusInf,
            Rule::DroppedLast,
            Rule::DuplicatedLast,
        ];
        rules.extend((0..k).map(Rule::Dropped));
        rules.extend((0..k).map(Rule::Duplicated));
        let per_row: Vec<(Vec<RuleSum>, Footprint)> = (0..self.rc.sampled_rows.len())
            .into_par_iter()
            .map(|i| self.row_at_k(i, k, &rules))
            .collect();
        let mut sums = vec![RuleSum::default(); rules.len()];
        let mut fp = Footprint::default();
        for (row_sums, row_fp) in per_row {
            for (acc, r) in sums.iter_mut().zip(row_sums) {
                acc.dist.add(r.dist);
                acc.wrong.add(r.wrong);
                acc.acted += r.acted;
            }
            fp.with_empty += row_fp.with_empty;
            fp.wrong_in_empty.extend(row_fp.wrong_in_empty);
            fp.wrong_elsewhere += row_fp.wrong_elsewhere;
            fp.others.add(row_fp.others);
            fp.others_rows += row_fp.others_rows;
            fp.others_norm.0 += row_fp.others_norm.0;
            fp.others_norm.1 += row_fp.others_norm.1;
        }
        AtK {
            k,
            rules: rules.into_iter().zip(sums).collect(),
            footprint: fp,
        }
    }

    /// Sampled row `i` replayed at split count `k` under each of `rules` (the right merge where a
    /// rule changes nothing), and its share of the stale footprint.
    fn row_at_k(&self, i: usize, k: usize, rules: &[Rule]) -> (Vec<RuleSum>, Footprint) {
        let (row, z, keys) = &self.rc.sampled_rows[i];
        let h = row % self.rc.n;
        let c = &self.cand[i];
        let s: Vec<f64> = z.iter().map(|v| v * self.rc.scale).collect();
        let ranges = split_ranges(s.len(), if self.decode[i] { k } else { 1 });
        let st = RowStates::new(&ranges, &s, |j| self.rc.value(keys[j], h), self.rc.width);
        let exact = st.exact();
        let d_exact = Dist::of(&exact.0, exact.1, c);
        let differs = |o: &[f64], l: f64| {
            let scale = exact.0.iter().map(|v| v * v).sum::<f64>() + exact.1 * exact.1;
            let d: f64 =
                o.iter().zip(&exact.0).map(|(a, b)| (a - b) * (a - b)).sum::<f64>() + (l - exact.1) * (l - exact.1);
            d.is_nan() || d > 1e-20 * scale.max(1e-300)
        };
        let sums = rules
            .iter()
            .map(|&rule| {
                let pred = if self.decode[i] { st.predict(rule) } else { None };
                let (dist, acted) = match pred {
                    Some((o, l)) if differs(&o, l) => (Dist::of(&o, l, c), 1),
                    _ => (d_exact, 0),
                };
                let wrong = if self.wrong[i] { dist } else { Dist::default() };
                RuleSum { dist, wrong, acted }
            })
            .collect();
        let mut fp = Footprint::default();
        let n_empty = st.n_empty();
        let empty_here = self.decode[i] && n_empty > 0;
        if empty_here {
            fp.with_empty = 1;
        }
        if self.wrong[i] && empty_here {
            let excess = c.lse.map(|l| l - exact.1);
            let ell = excess
                .filter(|&e| e > 0.0)
                .map(|e| exact.1 + (e.exp_m1() / n_empty as f64).ln());
            fp.wrong_in_empty.push((excess, ell));
        } else if self.wrong[i] {
            fp.wrong_elsewhere = 1;
        } else if !empty_here {
            fp.others = d_exact;
            fp.others_rows = 1;
            let sq = |v: f64| if v.is_finite() { v * v } else { 0.0 };
            fp.others_norm = (c.out.iter().map(|&v| sq(v)).sum(), c.lse.map_or(0.0, sq));
        }
        (sums, fp)
    }

    /// The split counts to try: the recorded one first, then (when it explains nothing) the
    /// powers of two up to the longest sampled decode row's key count (at least 8, at most
    /// [`MAX_SEARCHED_SPLITS`]), then 3, 5, 6 and 7 (`--splits` of the tool's own paths).
    fn split_counts(&self) -> (Option<usize>, Vec<usize>) {
        let recorded = self.x.input.dump.and_then(|d| d.num_kv_splits).filter(|&k| k >= 1);
        let longest = self
            .rc
            .sampled_rows
            .iter()
            .zip(&self.decode)
            .filter(|(_, d)| **d)
            .map(|((_, z, _), _)| z.len())
            .max()
            .unwrap_or(1);
        let bound = longest.next_power_of_two().clamp(8, MAX_SEARCHED_SPLITS);
        // vLLM's split counts (powers of two) first: where two counts give the same splits (a
        // row's kept keys fewer than both), the earlier one is named.
        let mut ks: Vec<usize> = (0..=bound.ilog2()).map(|e| 1usize << e).collect();
        ks.extend([3, 5, 6, 7]);
        ks.retain(|&k| Some(k) != recorded && k <= bound);
        (recorded, ks)
    }

    /// How evidence names split count `k`: recorded, or found by the search.
    fn describe_k(&self, k: usize) -> String {
        match self.x.input.dump.and_then(|d| d.num_kv_splits) {
            Some(r) if r == k => format!("K = {k} splits per row (the step's num_kv_splits)"),
            Some(r) => format!("K = {k} splits per row (the step recorded num_kv_splits = {r})"),
            None => format!("K = {k} splits per row (searched: no num_kv_splits recorded)"),
        }
    }

    /// `sqrt(d / n)`: a relative L2 error from its squared sums; 0 for rows that hold only
    /// values non-finite on both sides (`d = n = 0`).
    fn rel(d: f64, n: f64) -> f64 {
        if n > 0.0 {
            (d / n).sqrt()
        } else if d == 0.0 {
            0.0
        } else {
            f64::INFINITY
        }
    }

    /// Rows with an empty split at `k` among the sampled decode rows.
    fn with_empty(&self, at: &AtK) -> String {
        format!(
            "{} of {} sampled (token, head) rows have an empty split",
            at.footprint.with_empty,
            self.rc.sampled_rows.len()
        )
    }
}

/// `lse-merge` by replaying a split-KV decode (see the module doc): the rule and split count
/// whose replay explains the output site and the LSE, or the footprint of empty splits merged
/// with stale finite states. `None` on paths without a split-KV decode (`mha`, `chunked`) and
/// when no hypothesis explains the site.
pub(super) fn split_merge(x: &SiteCtx<'_>) -> Option<Detection> {
    let sample = Sample::build(x)?;
    // The sample must hold the failure: clearly wrong rows, which a hypothesis must put right
    // (a few wrong rows among many are a small error over the whole sample).
    if !sample.wrong.contains(&true) {
        return None;
    }
    let explain_out = explain_threshold(sample.out_stage, x.input.precision);
    let explain_lse = explain_threshold(Stage::Lse, x.input.precision);
    let (recorded, searched) = sample.split_counts();
    let mut best: Option<(f64, usize, Rule, RuleSum, usize)> = None;
    let mut footprint: Option<AtK> = None;
    for (pass, ks) in [recorded.into_iter().collect::<Vec<_>>(), searched]
        .into_iter()
        .enumerate()
    {
        for k in ks {
            let at = sample.at_k(k);
            for &(rule, sum) in &at.rules {
                if sum.acted == 0 || sum.dist.mismatch {
                    continue;
                }
                let e_out = Sample::rel(sum.dist.out, sample.norm.0);
                let e_lse = Sample::rel(sum.dist.lse, sample.norm.1);
                let w_out = Sample::rel(sum.wrong.out, sample.norm_wrong.0);
                let w_lse = Sample::rel(sum.wrong.lse, sample.norm_wrong.1);
                // Every sampled row within the explain threshold, and the wrong rows put right at
                // the failing site: the replay at most half as far from them as the reference
                // (bf16's explain threshold can exceed a failing site's error as is).
                let (w_site, as_is_site) = if x.site.stage == Stage::Lse {
                    (w_lse, sample.as_is_wrong.1)
                } else {
                    (w_out, sample.as_is_wrong.0)
                };
                let explains = e_out <= explain_out
                    && w_out <= explain_out
                    && w_site <= 0.5 * as_is_site
                    && (!sample.has_lse || (e_lse <= explain_lse && w_lse <= explain_lse));
                let score = e_out / explain_out + if sample.has_lse { e_lse / explain_lse } else { 0.0 };
                // Hypotheses that explain alike: the earlier in the search order is named.
                if explains && best.as_ref().is_none_or(|b| score < 0.5 * b.0) {
                    best = Some((score, k, rule, sum, at.footprint.with_empty));
                }
            }
            if footprint.is_none() && stale_footprint(&sample, &at, explain_out, explain_lse) {
                footprint = Some(at);
            }
        }
        // A recorded split count that explains is the answer; the search is for when it does not.
        if pass == 0 && best.is_some() {
            break;
        }
    }
    if let Some((_, k, rule, sum, with_empty)) = best {
        let e_out = Sample::rel(sum.dist.out, sample.norm.0);
        let lse = if sample.has_lse {
            format!(
                ", lse {} vs {}",
                sci(Sample::rel(sum.dist.lse, sample.norm.1), 2),
                rel_text(sample.as_is.1)
            )
        } else {
            " (no lse dumped)".into()
        };
        return Some(Detection::new(
            format!(
                "a replay of the split-KV decode explains {}{}: {}, ⌈ctx/{k}⌉ keys each, {}; of {} sampled \
                 (token, head) rows, {} have an empty split and the rule merges {} of them otherwise than the \
                 right merge: {} rel_l2 {} vs {} as is{lse}",
                sample.out_stage.name(),
                if sample.has_lse { " and lse" } else { "" },
                sample.describe_k(k),
                rule.describe(k),
                sample.rc.sampled_rows.len(),
                with_empty,
                sum.acted,
                sample.out_stage.name(),
                sci(e_out, 2),
                rel_text(sample.as_is.0),
            ),
            rule.hint(k),
        ));
    }
    let at = footprint?;
    // Wrong rows that one logit scale on the decode rows puts right are a decode kernel's scale
    // (`softmax-scale`, tried after this class), not a stale partial: a batch with few decode
    // rows may have an empty split on each of them by chance.
    if super::paged::decode_logit_scale(x).is_some() {
        return None;
    }
    let fp = &at.footprint;
    let excess: Vec<f64> = fp.wrong_in_empty.iter().filter_map(|w| w.0).collect();
    let ell: Vec<f64> = fp.wrong_in_empty.iter().filter_map(|w| w.1).collect();
    let range = |v: &[f64]| {
        let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        format!("{lo:.3} to {hi:.3}")
    };
    let lse_part = if excess.is_empty() {
        String::new()
    } else {
        format!(
            "; their LSE is above the right merge's by {} (a stale state only adds weight: one empty split's LSE ℓ \
             from {})",
            range(&excess),
            range(&ell)
        )
    };
    Some(Detection::new(
        format!(
            "the {} clearly wrong sampled (token, head) rows all have an empty split at {}, ⌈ctx/{}⌉ keys each ({}); \
             the right merge explains the {} others ({} rel_l2 {} vs {} as is){lse_part}: empty splits merged as if \
             they had keys, with a finite stale LSE and output",
            fp.wrong_in_empty.len(),
            sample.describe_k(at.k),
            at.k,
            sample.with_empty(&at),
            fp.others_rows,
            sample.out_stage.name(),
            sci(Sample::rel(fp.others.out, fp.others_norm.0), 2),
            rel_text(sample.as_is.0),
        ),
        format!(
            "{}; here it was merged with the finite LSE and the output its partial buffer held (stage 1 writes \
             nothing for an empty split)",
            empty_split_rule(at.k)
        ),
    ))
}

/// Whether the stale-partial footprint at `at.k` holds: some sampled rows clearly wrong, every
/// one of them with an empty split and finite, some rows without an empty split and the right
/// merge explaining them, and (with a candidate LSE) each wrong row's LSE above the right merge's.
fn stale_footprint(s: &Sample<'_>, at: &AtK, explain_out: f64, explain_lse: f64) -> bool {
    let fp = &at.footprint;
    let finite = s
        .cand
        .iter()
        .all(|c| c.out.iter().all(|v| v.is_finite()) && c.lse.is_none_or(f64::is_finite));
    if !finite || fp.wrong_in_empty.is_empty() || fp.wrong_elsewhere > 0 || fp.others_rows == 0 {
        return false;
    }
    let others_out = Sample::rel(fp.others.out, fp.others_norm.0);
    let others_lse = Sample::rel(fp.others.lse, fp.others_norm.1);
    if fp.others.mismatch || others_out > explain_out || (s.has_lse && others_lse > explain_lse) {
        return false;
    }
    // A state merged in adds weight e^ℓ: the LSE of a wrong row can only rise.
    !s.has_lse || fp.wrong_in_empty.iter().all(|(e, _)| e.is_some_and(|e| e > 0.0))
}
