//! The chunked-context detectors: the partials and merges of an MHA prefill over cached context
//! (vLLM's `_compute_prefill_context` and the `merge_attn_states` after it), named from the
//! dump's own partials that passed.
//!
//! Such a prefill attends each context chunk's keys on its own (`ctx_out.c<c>`,
//! `ctx_lse.c<c>`), merges the chunks by their LSEs (`ctx_out`, `ctx_lse`), attends the new
//! tokens over themselves (`suffix_out`, `suffix_lse`) and merges context and suffix
//! (`attn_out`). Every partial is judged on its own, so a bug shows first where it happens: at a
//! chunk's own output or LSE (a chunk never written, an empty chunk's sentinel), or at a merge
//! whose inputs passed. The detectors here replay that one step from the candidate's own tensors
//! that passed (the merge with another sentinel, log base or head stride) or test what a
//! partial can hold at all (an attention output is a convex combination of its value rows), so
//! the finding names the mechanism where it acts. They run only on a dump whose step records
//! its context chunks ([`super::DumpScope::chunks`]).

use super::blocks::rel_l2;
use super::{Detection, SiteCtx, list};
use crate::compute::reference::context::{ContextSeq, merge_partials};
use crate::core::sci::sci;
use crate::core::trace::{Site, Stage, TraceTensor};
use crate::judge::metrics::Status;
use crate::judge::tolerance::hull_margin;

/// (token, head) rows of a context partial the convex-range test reads at most, spread over
/// the rows: per row it reads keys × V values, so the bound keeps the test far below the cost of
/// the engine step at any size, and a never-written buffer leaves most rows outside.
const RANGE_SAMPLE_ROWS: usize = 512;

/// Tokens each merge-stride hypothesis is first tried on (spread, the first included) before
/// the one that explains them is confirmed on every merged row: a wrong head stride moves every
/// head after the first of every token.
const STRIDE_SAMPLE_TOKENS: usize = 8;

/// The step's context sequences when the failing site is one of their partials or merges and
/// the rows add up: `(seqs, Tc, N)`.
fn scope<'a>(x: &'a SiteCtx<'_>) -> Option<(&'a [ContextSeq], usize, usize)> {
    let seqs = x.input.dump?.chunks;
    if seqs.is_empty() {
        return None;
    }
    let tc: usize = seqs.iter().map(|s| s.new).sum();
    let n = x.input.cfg.n_head;
    Some((seqs, tc, n))
}

/// The candidate's own tensor at `stage` of the failing site's layer, where it was compared and
/// passed.
fn own_passed<'a>(x: &'a SiteCtx<'_>, stage: Stage) -> Option<&'a TraceTensor> {
    let site = Site::new(x.site.layer, stage);
    x.path
        .diffs
        .iter()
        .any(|d| d.site == site && d.status == Status::Pass)
        .then(|| x.path.trace.get(&site))
        .flatten()
}

/// Whether chunk `[c0, c1)` of a sequence with `context` cached tokens holds no key.
fn is_empty(chunk: [usize; 2], context: usize) -> bool {
    chunk[1].min(context) <= chunk[0]
}

/// The kind of a non-finite value, for matching patterns: NaN, +inf, −inf; `None` when finite.
fn kind(v: f64) -> Option<i8> {
    if v.is_nan() {
        Some(0)
    } else if v == f64::INFINITY {
        Some(1)
    } else if v == f64::NEG_INFINITY {
        Some(-1)
    } else {
        None
    }
}

/// The relative L2 error of `cand` against `alt` over their finite elements, when both hold
/// the same non-finite values (NaN, +inf, −inf) in the same places; `None` otherwise. Elements
/// where `keep` is false are left out.
fn match_rel(cand: &[f64], alt: &[f64], keep: &dyn Fn(usize) -> bool) -> Option<f64> {
    if cand.len() != alt.len() {
        return None;
    }
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for (i, (&c, &r)) in cand.iter().zip(alt).enumerate() {
        if !keep(i) {
            continue;
        }
        match (kind(c), kind(r)) {
            (None, None) => {
                a.push(c);
                b.push(r);
            }
            (Some(p), Some(q)) if p == q => {}
            _ => return None,
        }
    }
    Some(rel_l2(&a, &b))
}

/// Evidence's name of an LSE value.
fn lse_value(v: f64) -> String {
    match kind(v) {
        Some(0) => "NaN".into(),
        Some(1) => "+inf".into(),
        Some(_) => "−inf".into(),
        None => sci(v, 3),
    }
}

/// `lse-merge` at a partial's own LSE (`ctx_lse.c<c>`, `ctx_lse`, `suffix_lse`): at chunk c's
/// LSE, the wrong elements are exactly on rows whose chunk c holds no key, where the reference
/// has −inf and the candidate +inf, 0, NaN or another finite value (an empty chunk's sentinel:
/// FlashAttention-2's +inf, a zeroed buffer's 0), while every other row passes; at any of them,
/// every finite LSE the reference × 1/ln 2 with the non-finite ones in place (a base-2 LSE
/// handed to a natural-log merge).
pub(super) fn partial_lse(x: &SiteCtx<'_>) -> Option<Detection> {
    if !matches!(x.site.stage, Stage::CtxLseChunk(_) | Stage::CtxLse | Stage::SuffixLse) {
        return None;
    }
    let (seqs, tc, n) = scope(x)?;
    let (r, c) = (x.refr.to_f64(), x.cand.to_f64());
    if r.len() != tc * n || c.len() != r.len() {
        return None;
    }
    if let Stage::CtxLseChunk(k) = x.site.stage
        && let Some(d) = empty_chunk_lse(x, seqs, n, k as usize, &r, &c)
    {
        return Some(d);
    }
    let base2: Vec<f64> = r.iter().map(|v| v / std::f64::consts::LN_2).collect();
    let e = match_rel(&c, &base2, &|_| true)?;
    (e <= x.explain && (e < x.as_is() || match_rel(&c, &r, &|_| true).is_none())).then(|| {
        Detection::new(
            format!(
                "{} is the reference × 1/ln 2 = {:.4} ({}): the LSE is in base 2",
                x.site.stage.name(),
                1.0 / std::f64::consts::LN_2,
                x.vs_as_is(e)
            ),
            "the merge of attention states (vLLM's merge_attn_states) reads natural-log LSEs: convert the \
             kernel's base-2 LSE (× ln 2) before the merge, or ask the kernel for natural-log LSEs"
                .into(),
        )
    })
}

/// The empty-chunk sentinel test of [`partial_lse`] at chunk `k`'s LSE `c` (reference `r`).
fn empty_chunk_lse(
    x: &SiteCtx<'_>,
    seqs: &[ContextSeq],
    n: usize,
    k: usize,
    r: &[f64],
    c: &[f64],
) -> Option<Detection> {
    // Per Tc row: whether chunk k is empty for its sequence.
    let mut empty = Vec::new();
    let mut seqs_empty = Vec::new();
    for s in seqs {
        let e = s.chunks.get(k).is_some_and(|&ch| is_empty(ch, s.context));
        if e {
            seqs_empty.push(s.seq);
        }
        empty.extend(std::iter::repeat_n(e, s.new));
    }
    let wrong: Vec<usize> = (0..r.len())
        .filter(|&i| empty[i / n] && c[i] != f64::NEG_INFINITY)
        .collect();
    if wrong.is_empty() {
        return None;
    }
    // Every row with keys in the chunk passes, as the reference's rounding allows.
    let e = match_rel(c, r, &|i| !empty[i / n])?;
    if e > x.explain {
        return None;
    }
    let first = c[wrong[0]];
    let same = wrong
        .iter()
        .all(|&i| kind(c[i]) == kind(first) && (kind(first).is_some() || c[i] == first));
    let what = if same {
        format!("all {}", lse_value(first))
    } else if wrong.iter().all(|&i| c[i].is_finite()) {
        format!("finite values (first {})", sci(first, 3))
    } else {
        format!("values other than −inf (first {})", lse_value(first))
    };
    let mut tokens: Vec<usize> = wrong.iter().map(|&i| i / n).collect();
    tokens.dedup();
    let empty_rows = empty.iter().filter(|&&e| e).count();
    Some(Detection::new(
        format!(
            "chunk {k} holds no key for sequence(s) {seqs_empty:?}: {} of their {} (token, head) rows hold {what} \
             where the reference has −inf (partial rows {}), and every row with keys in the chunk passes (rel_l2 {})",
            wrong.len(),
            empty_rows * n,
            list(&tokens),
            sci(e, 2)
        ),
        "an empty context chunk must report LSE −inf (and output 0) so that the merge gives it no weight: \
         vLLM masks it (mask_empty_context) where FlashAttention-2 returns +inf; +inf turns the merge into \
         NaN, 0 or a stale value gives the zero output weight"
            .into(),
    ))
}

/// One hypothesis of a wrong merge: how the partials' LSEs are changed before a natural-log
/// merge, and its name in evidence.
struct Rule {
    name: String,
    /// Per partial (in merge order), whether its LSE is read as base 2 (÷ ln 2).
    base2: Vec<bool>,
    /// The LSE an empty chunk gets instead of −inf (`None`: as dumped).
    empty_as: Option<f64>,
}

/// The rules tried on a merge of `k` partials named `names`: an empty chunk's LSE as +inf or 0
/// (when `empty` says some row has one), every partial's LSE in base 2, one partial's alone.
fn rules(names: &[String], empty: bool) -> Vec<Rule> {
    let k = names.len();
    let mut out = Vec::new();
    if empty {
        for (v, what) in [(f64::INFINITY, "+inf"), (0.0, "0")] {
            out.push(Rule {
                name: format!("every empty chunk merged with LSE {what} instead of −inf"),
                base2: vec![false; k],
                empty_as: Some(v),
            });
        }
    }
    out.push(Rule {
        name: "every partial's LSE in base 2, merged as natural log".into(),
        base2: vec![true; k],
        empty_as: None,
    });
    if k > 1 {
        for (i, nm) in names.iter().enumerate() {
            let mut b = vec![false; k];
            b[i] = true;
            out.push(Rule {
                name: format!(
                    "{nm}'s LSE in base 2, the other{} natural, merged as natural log",
                    if k > 2 { "s" } else { "" }
                ),
                base2: b,
                empty_as: None,
            });
        }
    }
    out
}

/// Partials of the merge `(outs [Tc·N·V], lses [Tc·N], names)`, and per partial per Tc row
/// whether it is an empty chunk.
struct MergeInputs {
    outs: Vec<Vec<f64>>,
    lses: Vec<Vec<f64>>,
    names: Vec<String>,
    empty: Vec<Vec<bool>>,
}

impl MergeInputs {
    /// The merge under `rule`: `(out [Tc·N·V], lse [Tc·N])`.
    fn replay(&self, rule: &Rule, n: usize, dv: usize) -> (Vec<f64>, Vec<f64>) {
        let ln2 = std::f64::consts::LN_2;
        let lses: Vec<Vec<f64>> = self
            .lses
            .iter()
            .zip(&rule.base2)
            .zip(&self.empty)
            .map(|((l, &b2), empty)| {
                l.iter()
                    .enumerate()
                    .map(|(i, &v)| match rule.empty_as {
                        Some(s) if empty[i / n] => s,
                        _ if b2 => v / ln2,
                        _ => v,
                    })
                    .collect()
            })
            .collect();
        let outs: Vec<&[f64]> = self.outs.iter().map(Vec::as_slice).collect();
        let ls: Vec<&[f64]> = lses.iter().map(Vec::as_slice).collect();
        merge_partials(&outs, &ls, dv)
    }
}

/// The context chunks' own partials of the candidate, every one passed: the inputs of the
/// chunks' merge.
fn chunk_inputs(x: &SiteCtx<'_>, seqs: &[ContextSeq]) -> Option<MergeInputs> {
    let k = seqs.first()?.chunks.len();
    let mut m = MergeInputs {
        outs: Vec::new(),
        lses: Vec::new(),
        names: Vec::new(),
        empty: Vec::new(),
    };
    for c in 0..k {
        let cu = u32::try_from(c).ok()?;
        m.outs.push(own_passed(x, Stage::CtxOutChunk(cu))?.to_f64());
        m.lses.push(own_passed(x, Stage::CtxLseChunk(cu))?.to_f64());
        m.names.push(format!("chunk {c}"));
        m.empty.push(
            seqs.iter()
                .flat_map(|s| std::iter::repeat_n(s.chunks.get(c).is_some_and(|&ch| is_empty(ch, s.context)), s.new))
                .collect(),
        );
    }
    (k > 0).then_some(m)
}

/// Scatters the merged rows `merged` [Tc·per] into a copy of the reference `base` [T·per] of
/// the step's rows, at each context sequence's rows.
fn scatter(base: &[f64], merged: &[f64], seqs: &[ContextSeq], per: usize) -> Option<Vec<f64>> {
    let mut out = base.to_vec();
    let mut at = 0;
    for s in seqs {
        let (a, b) = (s.row * per, (s.row + s.new) * per);
        out.get_mut(a..b)?.copy_from_slice(merged.get(at..at + (b - a))?);
        at += b - a;
    }
    Some(out)
}

/// `lse-merge` at a merge (`ctx_out`, `ctx_lse`: the chunks' merge; `attn_out`: context and
/// suffix) whose inputs passed: replayed from the candidate's own partials with an empty chunk's
/// LSE +inf or 0 instead of −inf, or LSEs in base 2 (every one, or one partial's) merged by the
/// natural-log rule, one [`rules`] explains the site, NaN where the candidate has NaN. At
/// `attn_out` the context side is the candidate's `ctx_out`/`ctx_lse` where they passed, else
/// the chunks' partials merged under the same rule; rows outside the context sequences are the
/// reference's.
pub(super) fn merge_replay(x: &SiteCtx<'_>) -> Option<Detection> {
    let (seqs, tc, n) = scope(x)?;
    let dv = x.input.cfg.v_head_dim;
    let cand = x.cand.to_f64();
    let (inputs, ctx_from_chunks) = match x.site.stage {
        Stage::CtxOut | Stage::CtxLse => (chunk_inputs(x, seqs)?, true),
        Stage::AttnOut => {
            let suffix = (
                own_passed(x, Stage::SuffixOut)?.to_f64(),
                own_passed(x, Stage::SuffixLse)?.to_f64(),
            );
            match (own_passed(x, Stage::CtxOut), own_passed(x, Stage::CtxLse)) {
                (Some(o), Some(l)) => (
                    MergeInputs {
                        outs: vec![o.to_f64(), suffix.0],
                        lses: vec![l.to_f64(), suffix.1],
                        names: vec!["the context (ctx_lse)".into(), "the suffix (suffix_lse)".into()],
                        empty: vec![vec![false; tc]; 2],
                    },
                    false,
                ),
                _ => {
                    let mut m = chunk_inputs(x, seqs)?;
                    m.outs.push(suffix.0);
                    m.lses.push(suffix.1);
                    m.names.push("the suffix (suffix_lse)".into());
                    m.empty.push(vec![false; tc]);
                    (m, true)
                }
            }
        }
        _ => return None,
    };
    if inputs.outs.iter().any(|o| o.len() != tc * n * dv) || inputs.lses.iter().any(|l| l.len() != tc * n) {
        return None;
    }
    let any_empty = inputs.empty.iter().any(|e| e.iter().any(|&b| b));
    let want_lse = x.site.stage == Stage::CtxLse;
    let refr = x.refr.to_f64();
    // Whether the candidate's non-finite elements are the reference's: when not, a replay that
    // puts them right explains what the finite rel_l2 as is does not measure.
    let pattern_as_is = match_rel(&cand, &refr, &|_| true).is_some();
    for rule in rules(&inputs.names, any_empty && ctx_from_chunks) {
        let (out, lse) = inputs.replay(&rule, n, dv);
        let alt = match x.site.stage {
            Stage::AttnOut => scatter(&refr, &out, seqs, n * dv)?,
            _ if want_lse => lse,
            _ => out,
        };
        let Some(e) = match_rel(&cand, &alt, &|_| true) else {
            continue;
        };
        if e <= x.explain && (e < x.as_is() || !pattern_as_is) {
            let nan = alt.iter().filter(|v| v.is_nan()).count();
            let nan_note = if nan > 0 {
                format!(", its {nan} NaN elements where the candidate's are")
            } else {
                String::new()
            };
            return Some(Detection::new(
                format!(
                    "the merge of {} replayed from the candidate's own partials, which passed, with {}: {}{nan_note}",
                    inputs.names.join(", "),
                    rule.name,
                    x.vs_as_is(e)
                ),
                "the merge of attention states must read natural-log LSEs, an empty chunk's as −inf (no weight): \
                 check the sentinel the chunk loop hands merge_attn_states and the log base of each kernel's LSE"
                    .into(),
            ));
        }
    }
    None
}

/// The two sides of the final merge as the candidate computed them (`ctx_out`/`ctx_lse`,
/// `suffix_out`/`suffix_lse`, each `[Tc, N, V]` and `[Tc, N]`), for the head-stride replays.
struct StrideMerge {
    ctx: (Vec<f64>, Vec<f64>),
    suf: (Vec<f64>, Vec<f64>),
    tc: usize,
    n: usize,
    dv: usize,
    /// The step row (of `attn_out`) of each Tc row.
    step_row: Vec<usize>,
}

impl StrideMerge {
    /// The merged elements of Tc rows `tokens` with side `side`'s (0: the suffix, 1: the
    /// context) element (t, h, d) read at `t·N·read + h·read + d` of its buffer of head stride
    /// `buf` (token stride N·buf): per element its index in `attn_out`, its value, and whether
    /// it read the buffer's padding or past its end (then 0, and flagged unless `zero_pad`).
    fn merged(
        &self,
        tokens: &[usize],
        side: usize,
        buf: usize,
        read: usize,
        zero_pad: bool,
    ) -> Vec<(usize, f64, bool)> {
        let (n, dv) = (self.n, self.dv);
        let read_side = if side == 0 { &self.suf.0 } else { &self.ctx.0 };
        let mut out = Vec::with_capacity(tokens.len() * n * dv);
        for &t in tokens {
            for h in 0..n {
                let (lc, ls) = (self.ctx.1[t * n + h], self.suf.1[t * n + h]);
                let mx = lc.max(ls);
                let (wc, ws) = ((lc - mx).exp(), (ls - mx).exp());
                for d in 0..dv {
                    let addr = t * n * read + h * read + d;
                    let (bt, rem) = (addr / (n * buf), addr % (n * buf));
                    let (bh, bd) = (rem / buf, rem % buf);
                    let (v, pad) = if bt < self.tc && bd < dv {
                        (read_side[(bt * n + bh) * dv + bd], false)
                    } else {
                        (0.0, !zero_pad)
                    };
                    let own = (t * n + h) * dv + d;
                    let (o_ctx, o_suf) = if side == 0 {
                        (self.ctx.0[own], v)
                    } else {
                        (v, self.suf.0[own])
                    };
                    out.push((
                        (self.step_row[t] * n + h) * dv + d,
                        (wc * o_ctx + ws * o_suf) / (wc + ws),
                        pad,
                    ));
                }
            }
        }
        out
    }
}

/// The relative L2 error of the replayed elements `rows` against the candidate over those not
/// flagged, and how many were flagged; `None` when more than half were.
fn stride_error(cand: &[f64], rows: &[(usize, f64, bool)]) -> Option<(f64, usize)> {
    let kept: Vec<&(usize, f64, bool)> = rows.iter().filter(|e| !e.2).collect();
    if kept.len() * 2 < rows.len() {
        return None;
    }
    let a: Vec<f64> = kept.iter().map(|e| cand[e.0]).collect();
    let b: Vec<f64> = kept.iter().map(|e| e.1).collect();
    Some((rel_l2(&a, &b), rows.len() - kept.len()))
}

/// The head strides the merge-stride replay tries: `(reads, buffers, names)`, the reads MLA's
/// widths, the buffers those of them at least V wide and V padded by each multiple of 8 up to
/// 2V; `names` names each width.
fn stride_set(x: &SiteCtx<'_>) -> (Vec<usize>, Vec<usize>, Vec<(usize, &'static str)>) {
    let [_, l, p, r, dv] = x.input.cfg.dims().nlprv();
    let named = vec![
        (dv, "V"),
        (p, "P"),
        (r, "R"),
        (l, "L"),
        (p + r, "P+R"),
        (p + dv, "P+V"),
        (l + r, "L+R"),
    ];
    let mut reads: Vec<usize> = named.iter().map(|w| w.0).filter(|&w| w > 0).collect();
    reads.sort_unstable();
    reads.dedup();
    let mut bufs: Vec<usize> = reads.iter().copied().filter(|&w| w >= dv).collect();
    bufs.extend((1..=dv / 8).map(|k| dv + 8 * k));
    bufs.sort_unstable();
    bufs.dedup();
    (reads, bufs, named)
}

/// A head stride by its names: the padded V it is (an attention output padded past V), then
/// the MLA widths it equals.
fn stride_name(s: usize, dv: usize, named: &[(usize, &str)]) -> String {
    let mut names: Vec<String> = Vec::new();
    if s > dv {
        names.push(format!("V+{}", s - dv));
    }
    names.extend(named.iter().filter(|(w, _)| *w == s).map(|(_, nm)| (*nm).to_string()));
    format!("{s} ({})", names.join(" = "))
}

/// `strided-view` at `attn_out` where the context's (`ctx_out`, `ctx_lse`) and the suffix's
/// (`suffix_out`, `suffix_lse`) partials passed: the merge replayed with one side's output read
/// from its buffer with another head stride than the buffer's (token stride N × the head
/// stride, as a merge kernel that derives both from one tensor's head stride reads it). The
/// buffer's head stride and the read's are tried among MLA's widths (V, P, R, L, P+R, P+V, L+R;
/// an attention kernel pads V to the QK head dim P+R) and V padded by multiples of 8 up to 2V
/// ([`stride_set`]), first on [`STRIDE_SAMPLE_TOKENS`] spread rows, then on every merged row;
/// elements the read finds in the buffer's padding or past its end are left out (their content
/// is unknown), unless the padding read as 0 explains them too.
pub(super) fn merge_stride(x: &SiteCtx<'_>) -> Option<Detection> {
    if x.site.stage != Stage::AttnOut || x.diff.metrics.as_ref()?.nonfinite_cand > 0 {
        return None;
    }
    let (seqs, tc, n) = scope(x)?;
    let dv = x.input.cfg.v_head_dim;
    let own = |st| own_passed(x, st).map(TraceTensor::to_f64);
    let sm = StrideMerge {
        ctx: (own(Stage::CtxOut)?, own(Stage::CtxLse)?),
        suf: (own(Stage::SuffixOut)?, own(Stage::SuffixLse)?),
        tc,
        n,
        dv,
        step_row: seqs.iter().flat_map(|s| s.row..s.row + s.new).collect(),
    };
    if [&sm.ctx.0, &sm.suf.0].iter().any(|o| o.len() != tc * n * dv)
        || [&sm.ctx.1, &sm.suf.1].iter().any(|l| l.len() != tc * n)
    {
        return None;
    }
    let (reads, bufs, named) = stride_set(x);
    let (cand, refr) = (x.cand.to_f64(), x.refr.to_f64());
    let all: Vec<usize> = (0..tc).collect();
    let k = STRIDE_SAMPLE_TOKENS;
    let sample: Vec<usize> = if tc <= k {
        all.clone()
    } else {
        (0..k).map(|i| i * (tc - 1) / (k - 1)).collect()
    };
    for (side, side_name, other_name) in [(0usize, "suffix", "context"), (1, "context", "suffix")] {
        for (&buf, &read) in bufs.iter().flat_map(|b| reads.iter().map(move |r| (b, r))) {
            if read == buf {
                continue;
            }
            let explains = |z: bool| {
                stride_error(&cand, &sm.merged(&sample, side, buf, read, z)).is_some_and(|(e, _)| e <= x.explain)
            };
            let Some(zero_pad) = [true, false].into_iter().find(|&z| explains(z)) else {
                continue;
            };
            let rows = sm.merged(&all, side, buf, read, zero_pad);
            let Some((e_merged, left_out)) = stride_error(&cand, &rows) else {
                continue;
            };
            // The whole site: the merged rows as replayed (padding reads as the candidate has
            // them), every other row the reference's.
            let mut alt = refr.clone();
            for &(i, v, pad) in &rows {
                alt[i] = if pad { cand[i] } else { v };
            }
            let e = rel_l2(&cand, &alt);
            if e_merged > x.explain || e > x.explain || e >= x.as_is() {
                continue;
            }
            let pad_note = if zero_pad {
                "the buffer's padding read as 0".to_string()
            } else {
                format!("{left_out} elements read from the buffer's padding or past its end left out")
            };
            return Some(Detection::new(
                format!(
                    "the merge of the {other_name} and the {side_name} (ctx_out/ctx_lse, suffix_out/suffix_lse passed) \
                     replayed with the {side_name}'s output, held with head stride {}, read with head stride {}: \
                     {} ({pad_note})",
                    stride_name(buf, dv, &named),
                    stride_name(read, dv, &named),
                    x.vs_as_is(e)
                ),
                format!(
                    "the merge kernel reads the {side_name}'s output with another tensor's strides (vLLM's \
                     merge_attn_states derives the suffix's head stride from prefix_output): pass each \
                     partial's own strides, or make the {side_name}'s output contiguous (.contiguous() after \
                     slicing a padded attention output to V)"
                ),
            ));
        }
    }
    None
}

/// Per Tc row of a partial, the keys it attends to (rows of the whole step's reference): chunk
/// `chunk`'s context positions (none when empty), or the suffix's causal new tokens (`None`).
fn partial_keys(seqs: &[ContextSeq], chunk: Option<usize>) -> Option<Vec<std::ops::Range<usize>>> {
    let mut keys = Vec::new();
    for s in seqs {
        for a in 0..s.new {
            keys.push(match chunk {
                Some(c) => {
                    let [c0, c1] = *s.chunks.get(c)?;
                    let c1 = c1.min(s.context);
                    if c1 <= c0 { 0..0 } else { s.off + c0..s.off + c1 }
                }
                None => s.off + s.context..s.off + s.context + a + 1,
            });
        }
    }
    Some(keys)
}

/// An element outside its value rows' range: how far out in units of the margin, its (Tc·N +
/// head) row, its index, its value and the range.
type Worst = (f64, usize, usize, f64, f64, f64);

/// The value rows a partial averages (`v` of the whole step `[rows, N, V]`) and each Tc row's
/// keys, for the convex-range test.
struct ValueRange<'a> {
    values: &'a TraceTensor,
    keys: &'a [std::ops::Range<usize>],
    n: usize,
    dv: usize,
    /// The RMS of the reference partial, for [`hull_margin`].
    rms_ref: f64,
}

impl ValueRange<'_> {
    /// On the (Tc·N + head) rows `sample` of the candidate partial `cand` (rows all 0 skipped):
    /// the rows with elements outside their keys' value range by more than [`hull_margin`],
    /// how many elements, and the one furthest out.
    fn outside(&self, x: &SiteCtx<'_>, cand: &[f64], sample: &[usize]) -> (Vec<usize>, usize, Option<Worst>) {
        let (n, dv) = (self.n, self.dv);
        let (mut rows, mut count) = (Vec::new(), 0usize);
        let mut worst: Option<Worst> = None;
        for &row in sample {
            let c = &cand[row * dv..(row + 1) * dv];
            if c.iter().all(|&v| v == 0.0) {
                continue;
            }
            let h = row % n;
            let mut hit = 0;
            for (d, &cd) in c.iter().enumerate() {
                let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
                for j in self.keys[row / n].clone() {
                    let v = self.values.get((j * n + h) * dv + d);
                    lo = lo.min(v);
                    hi = hi.max(v);
                }
                let margin = hull_margin(x.input.precision, self.rms_ref, lo.abs().max(hi.abs()));
                let excess = if cd.is_finite() {
                    (lo - cd).max(cd - hi)
                } else {
                    f64::INFINITY
                };
                if excess > margin {
                    hit += 1;
                    let ratio = excess / margin;
                    if worst.is_none_or(|w| ratio > w.0) {
                        worst = Some((ratio, row, d, cd, lo, hi));
                    }
                }
            }
            if hit > 0 {
                count += hit;
                rows.push(row);
            }
        }
        (rows, count, worst)
    }
}

/// `phantom-output` at a partial's own output (`ctx_out.c<c>`, `suffix_out`) whose LSE passed
/// and beside another output partial of the step that passed (the value rows are right): rows
/// with keys that are all 0 where the reference is not, or elements outside the range of the
/// value rows of the partial's keys (the chunk's context positions, the suffix's causal new
/// tokens; the reference's `v` of the whole step) by more than the precision's rounding
/// ([`hull_margin`]): a convex combination of value rows cannot leave their range, so the buffer
/// was never written (stale memory from torch.empty, or a zeroed one).
pub(super) fn partial_unwritten(x: &SiteCtx<'_>) -> Option<Detection> {
    let (lse_stage, chunk) = match x.site.stage {
        Stage::CtxOutChunk(c) => (Stage::CtxLseChunk(c), Some(c as usize)),
        Stage::SuffixOut => (Stage::SuffixLse, None),
        _ => return None,
    };
    let (seqs, tc, n) = scope(x)?;
    own_passed(x, lse_stage)?;
    let n_chunks = seqs.first()?.chunks.len();
    let others = (0..n_chunks)
        .filter_map(|c| u32::try_from(c).ok())
        .map(Stage::CtxOutChunk)
        .chain([Stage::SuffixOut, Stage::CtxOut])
        .filter(|&st| st != x.site.stage);
    let vouch = others.into_iter().find(|&st| own_passed(x, st).is_some())?;
    let dv = x.input.cfg.v_head_dim;
    let values = x.input.dump?.full_reference?.get(&Site::new(x.site.layer, Stage::V))?;
    let (cand, refr) = (x.cand.to_f64(), x.refr.to_f64());
    if cand.len() != tc * n * dv || refr.len() != cand.len() {
        return None;
    }
    let keys = partial_keys(seqs, chunk)?;
    if values.len() < keys.iter().map(|k| k.end).max().unwrap_or(0) * n * dv {
        return None;
    }
    let with_keys: Vec<usize> = (0..tc * n).filter(|&row| !keys[row / n].is_empty()).collect();
    if with_keys.is_empty() {
        return None;
    }
    let is_zero = |row: usize| cand[row * dv..(row + 1) * dv].iter().all(|&v| v == 0.0);
    let ref_zero = |row: usize| refr[row * dv..(row + 1) * dv].iter().all(|&v| v == 0.0);
    let zero: Vec<usize> = with_keys
        .iter()
        .copied()
        .filter(|&r| is_zero(r) && !ref_zero(r))
        .collect();
    let rms_ref = (refr.iter().map(|v| v * v).sum::<f64>() / refr.len().max(1) as f64).sqrt();
    let sample: Vec<usize> = if with_keys.len() <= RANGE_SAMPLE_ROWS {
        with_keys.clone()
    } else {
        (0..RANGE_SAMPLE_ROWS)
            .map(|i| with_keys[i * (with_keys.len() - 1) / (RANGE_SAMPLE_ROWS - 1)])
            .collect()
    };
    let range = ValueRange {
        values,
        keys: &keys,
        n,
        dv,
        rms_ref,
    };
    let (outside_rows, outside, worst) = range.outside(x, &cand, &sample);
    if zero.is_empty() && outside == 0 {
        return None;
    }
    let what = match chunk {
        Some(c) => format!("context chunk {c}"),
        None => "the suffix".into(),
    };
    let tokens = |rows: &[usize]| {
        let mut t: Vec<usize> = rows.iter().map(|r| r / n).collect();
        t.dedup();
        list(&t)
    };
    let mut parts = Vec::new();
    if !zero.is_empty() {
        parts.push(format!(
            "{} of its {} (token, head) rows with keys are all 0 where the reference is not (partial rows {})",
            zero.len(),
            with_keys.len(),
            tokens(&zero)
        ));
    }
    if let Some((_, row, d, cd, lo, hi)) = worst {
        parts.push(format!(
            "{outside} elements in {} of {} sampled (token, head) rows lie outside the range of the value rows of \
             its keys, by more than the {} rounding (partial rows {}); worst: row {}, head {}, element {d} holds {} where \
             the rows span [{}, {}]",
            outside_rows.len(),
            sample.len(),
            x.input.precision.name(),
            tokens(&outside_rows),
            row / n,
            row % n,
            sci(cd, 3),
            sci(lo, 3),
            sci(hi, 3)
        ));
    }
    Some(Detection::new(
        format!(
            "{}: {}; its {} and {} passed, so its keys and value rows are right and an attention over them \
             cannot give these values",
            what,
            parts.join("; "),
            lse_stage.name(),
            vouch.name()
        ),
        "the partial's output buffer was never written (what torch.empty or a zeroed allocation handed out): \
         the chunk loop must merge the output the kernel returned for this chunk (vLLM PR #26397)"
            .into(),
    ))
}
