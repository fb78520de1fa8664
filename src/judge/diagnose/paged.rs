//! The paged-cache detector (`paged-kv`): the attention read its paged latent cache through
//! other metadata than the cache was written with.
//!
//! A decode or chunked-context kernel reads position `j` of a sequence at slot
//! `block_table[seq][j / page_size] · page_size + j % page_size`, which `concat_and_cache_mla`
//! filled at the slots of the step's `slot_mapping`. When one side ignores the page size, reads
//! the block table one entry off (or another sequence's row), or the slot mapping is a slot or
//! a block off, every input of the attention is right and its output is wrong: `mismatch` at
//! `attn_latent`, `lse` or `attn_out`. The detector rebuilds the cache from the path's (or
//! dump's) own latent rows that passed (`kv_c_normed ‖ k_pe_roped` of this step and the earlier
//! steps it reads), replays the attention on sampled rows and heads under each hypothesis (a
//! bounded set: the recorded metadata, page sizes 1 … 256 (addressing token slots, or pages by
//! their stride), block tables shifted by an entry or a sequence, slot mappings shifted by a
//! slot or a block, the recorded slot mapping against the block table), and names the one that
//! reproduces the failing site, `lse` included when it was compared, while the metadata as
//! recorded does not.

use std::collections::{HashMap, HashSet};

use rayon::prelude::*;

use super::blocks::rel_l2;
use super::{Detection, SiteCtx, explain_threshold};
use crate::compute::paged::{PagedStep, table_slot};
use crate::core::sci::sci;
use crate::core::trace::{Site, Stage, TraceTensor};
use crate::judge::tolerance::tolerance;

/// Token rows the replay reads at most: the rows that differ most from the reference, then
/// rows spread over the rest of those that read the cache. Every hypothesis moves whole rows
/// (every head alike), so a few rows decide, and the replay of a V3-size layer stays a
/// fraction of a second.
const SAMPLE_ROWS: usize = 24;

/// Heads per sampled row the replay computes (spread over the heads).
const SAMPLE_HEADS: usize = 8;

/// Output columns per (row, head) the replay compares (spread over `L` or `V`).
const SAMPLE_COLS: usize = 16;

/// The page sizes a read (or write) is replayed with besides the recorded one: the powers of two
/// engines page with.
const PAGE_SIZES: [usize; 9] = [1, 2, 4, 8, 16, 32, 64, 128, 256];

/// The page sizes tried when a dump recorded none: vLLM's default, token granularity, FlashMLA's.
const UNRECORDED_PAGE_SIZES: [usize; 3] = [16, 1, 64];

/// `"3 rows × 4 heads"`, singular where one.
fn rows_heads(rows: usize, heads: usize) -> String {
    let s = |n: usize| if n == 1 { "" } else { "s" };
    format!("{rows} row{} × {heads} head{}", s(rows), s(heads))
}

/// Screened factors of [`kv_cache_scale`] replayed exactly (the cache re-rounded at the written
/// scale): the nearest few, since neighbouring half octaves are far apart (and the declared
/// scale's ±1 powers besides).
const EXACT_REPLAYS: usize = 3;

/// The factors a cache read back may be off by: half-octave steps from 2⁻⁸ to 2⁸ (a scale
/// applied twice or missing multiplies the cache by 1/k_scale or k_scale, and checkpoints'
/// k_scales are anything), besides the declared scale's own ±1 powers.
fn cache_factors(ps: &PagedStep) -> Vec<f64> {
    let mut f: Vec<f64> = (-16..=16)
        .filter(|&j| j != 0)
        .map(|j| 2f64.powf(f64::from(j) / 2.0))
        .collect();
    if let Some(s) = ps.cache_quant.map(|c| c.scale).filter(|&s| s != 1.0) {
        for c in [s, 1.0 / s] {
            if f.iter().all(|&g| (g / c - 1.0).abs() > 1e-6) {
                f.push(c);
            }
        }
    }
    f
}

/// `kv-cache-scale` at an attention output read through a paged latent cache (`attn_latent`,
/// `attn_out`): every row of the cache read back `c` times what was written (a scale applied
/// twice where rows are written, or missing where they are read), so the logits and the
/// weighted latent both scale by `c`. The replay with the recorded metadata, its cache times
/// each factor of [`cache_factors`], must explain the sampled rows as [`paged_kv`]'s hypotheses
/// do (its `lse` too, when compared) while the cache as written does not. At a failing `lse`
/// (chunked prefill, mixed batches: no `attn_latent`), judged at the path's `attn_out`, since at
/// `lse` alone scaled logits are a softmax scale.
pub(super) fn kv_cache_scale(x: &SiteCtx<'_>) -> Option<Detection> {
    if x.site.stage == Stage::Lse {
        return x.at_stage(Stage::AttnOut).and_then(|y| kv_cache_scale(&y));
    }
    if !matches!(x.site.stage, Stage::AttnLatent | Stage::AttnOut) || x.input.cfg.indexer.is_some() {
        return None;
    }
    let (ps, inp) = replay_inputs(x)?;
    let reads = reads_of(&inp, hypotheses(ps).first()?);
    let mut used: Vec<HashSet<usize>> = vec![HashSet::new(); inp.rows.len()];
    add_keys(&mut used, &reads);
    let pre = Precomputed::new(x, &inp, &used);
    // A row's positions past its cached ones are the step's own new keys, which the attention
    // reads as computed (a prefill over cached context): neither rounded nor scaled.
    let fresh_inp = match ps.cache_quant {
        Some(_)
            if inp
                .rows
                .iter()
                .any(|&row| ps.queries[row].cached < ps.queries[row].upto) =>
        {
            Some(inputs_read(x, ps, None)?)
        }
        _ => None,
    };
    let fresh_pre = fresh_inp.as_ref().map(|f| Precomputed::new(x, f, &used));
    let fresh = Some(fresh_pre.as_ref().unwrap_or(&pre));
    let base = replay(&inp, &pre, &reads, fresh);
    // Screened on the cache as written times c; the nearest few then replayed exactly: a
    // cache written with scale S/c and read with S holds c·round_{S/c}(x), whose E4M3 grid is
    // round_S's only when c is a power of two (elsewhere one step of rounding apart on every
    // value, and near E4M3's ends saturated or flushed to zero differently).
    let mut screened: Vec<(f64, f64)> = cache_factors(ps)
        .into_iter()
        .map(|c| {
            let rep = replay(&inp, &pre.scaled(c), &reads, fresh);
            let (mut a, mut b) = (Vec::new(), Vec::new());
            for (i, v) in rep.vals.iter().enumerate() {
                if let Some(v) = v {
                    a.push(inp.cand_vals[i]);
                    b.push(*v);
                }
            }
            (c, rel_l2(&a, &b))
        })
        .filter(|(_, e)| e.is_finite())
        .collect();
    screened.sort_by(|a, b| a.1.total_cmp(&b.1));
    // The declared scale's own powers are always replayed exactly: where E4M3 saturates or
    // flushes the written values, the screening's grid is far from them.
    let mut exact: Vec<f64> = screened.iter().take(EXACT_REPLAYS).map(|&(c, _)| c).collect();
    if let Some(s) = ps.cache_quant.map(|q| q.scale).filter(|&s| s != 1.0) {
        for c in [s, 1.0 / s] {
            if !exact.iter().any(|e| (e / c - 1.0).abs() < 1e-9) {
                exact.push(c);
            }
        }
    }
    let (c, v) = exact
        .into_iter()
        .filter_map(|c| {
            let rep = match ps.cache_quant {
                Some(q) => {
                    let written = crate::core::fp8::KvCacheQuant {
                        scale: q.scale / c,
                        ..q
                    };
                    let read = move |k: f64| c * written.round(k);
                    let inp_c = inputs_read(x, ps, Some(&read))?;
                    replay(&inp_c, &Precomputed::new(x, &inp_c, &used), &reads, fresh)
                }
                None => replay(&inp, &pre.scaled(c), &reads, fresh),
            };
            // A prefill over cached context expands its context keys through kv_b (an fp8
            // GEMM when the run's are), which the absorbed replay does not model: there the
            // site's own rows, and a tenth of the cache as written, decide.
            judge(x, &inp, &reads, &rep, &base)
                .or_else(|| fresh_inp.as_ref().and_then(|_| scale_verdict(x, &inp, &rep, &base)))
                .map(|v| (c, v))
        })
        .min_by(|a, b| a.1.err.total_cmp(&b.1.err))?;
    let source = key_source(ps);
    let declared = match ps.cache_quant {
        Some(q) => format!(" (fp8 cache, k_scale {} declared)", q.scale),
        None => String::new(),
    };
    let mut ev = format!(
        "{} equals the replay of the paged cache read back ×{} of what was written{declared}, rebuilt from {source}, on \
         {}: rel_l2 {} vs {} for the cache as written (the candidate against the reference: {})",
        x.site.stage.name(),
        sci(c, 3),
        rows_heads(v.compared, inp.heads.len()),
        sci(v.err, 2),
        sci(v.base_err, 2),
        sci(x.as_is(), 2)
    );
    if let Some(e) = v.lse_err {
        ev.push_str(&format!("; lse rel_l2 {}", sci(e, 2)));
    }
    let which = match ps.cache_quant.map(|q| q.scale).filter(|&s| s != 1.0) {
        Some(s) if (c * s - 1.0).abs() < 1e-6 => "×1/k_scale: the scale was applied twice where the rows were written \
                                                   (x/k_scale² stored, read back × k_scale), or the reads divide by it"
            .to_string(),
        Some(s) if (c / s - 1.0).abs() < 1e-6 => "×k_scale: the write stored x unscaled while the reads multiply by \
                                                   k_scale (the scale missing on the write), or the reads apply it twice"
            .to_string(),
        _ => "a factor no declared scale gives: the write and the reads use different scales".to_string(),
    };
    let hint = format!(
        "the latent cache's fp8 scale differs between concat_and_cache_mla (the write's scale) and the reads (the \
         decode kernel's k_scale / descale_k, the context gather's scale): {which}; pass the layer's one k_scale to both"
    );
    Some(Detection::new(ev, hint))
}

/// How a hypothesis writes the step's rows into the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Write {
    /// At the slot the block table gives (the metadata's own rule).
    Table,
    /// At the slot the dump's `slot_mapping` recorded.
    Recorded,
    /// At the table's slot plus `d`.
    Shift(i64),
    /// At the slot the block table gives with page size `p'`.
    Page(usize),
}

/// How a hypothesis reads the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Read {
    /// Through the sequence's own block-table row with the page size.
    Table,
    /// With page size `p'`: position `j` at slot `block_table[j / p'] · p' + j % p'` (a kernel
    /// handed a cache of token slots, addressing it by the page size it was told).
    Page(usize),
    /// With page size `p'` for the block index and the row in the page, the page's address from
    /// the cache's own layout: slot `block_table[j / p'] · p + j % p'` (a kernel that steps
    /// through the cache by its page stride, as vLLM's Triton decode does, told another page
    /// size: rows past the page's end land in the next block).
    PageIndex(usize),
    /// Through the sequence's row `d` entries further on.
    BlockShift(i64),
    /// Through the row of the sequence `d` further on.
    SeqShift(i64),
}

/// One hypothesis: the page size the metadata holds, and how rows were written and read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Hyp {
    page: usize,
    write: Write,
    read: Read,
}

/// What a read of one position returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Src {
    /// Key row `k`.
    Key(usize),
    /// A slot no write reached (a zero row in a zeroed cache).
    Unwritten,
}

/// The replay of one row under one hypothesis: what each attended position returned, or `None`
/// when a read has no slot the metadata can tell (past a table row without known padding).
type RowReads = Option<Vec<Src>>;

/// The inputs of the replay, gathered once per site.
struct Inputs<'a> {
    ps: &'a PagedStep,
    /// Latent rows `[K, L+R]` (`kv_c_normed ‖ k_pe_roped`).
    keys: std::borrow::Cow<'a, [f64]>,
    /// Per sampled row and head: `ql_nope` \[L] ‖ `q_pe_roped` \[R].
    q: Vec<Vec<f64>>,
    /// `W_UV` `[N, L, V]` for `attn_out`; `None` for the latent sites.
    w_uv: Option<Vec<f64>>,
    rows: Vec<usize>,
    heads: Vec<usize>,
    cols: Vec<usize>,
    /// The compared site's width per head (`L`, `V`, or 0 for `lse`).
    width: usize,
    /// The candidate's values on (row, head, col) and its `lse` on (row, head), when compared.
    cand_vals: Vec<f64>,
    cand_lse: Option<Vec<f64>>,
}

/// `softmax-scale` on a step's decode rows alone: the logits of every row that reads all its
/// positions through the paged cache (a decode kernel's rows, the ones an fp8 decode query
/// reaches) times `c` ≠ 1, while the step's other rows are right. A batch that mixes decode
/// rows with prefill rows shows a decode kernel's scale bug (its query's q_scale applied on one
/// side only, its own softmax scale) on the decode rows alone, which no constant scale of the
/// whole site fits. The replay reads the cache as the engine does (an fp8 cache and query
/// rounded), `c` screened over quarter octaves from 2⁻⁶ to 2⁶ and the declared q_scale's ±1
/// powers, then refined; it must explain the sampled rows as [`paged_kv`]'s hypotheses do. At a
/// failing `lse`, judged at the path's `attn_out`. `None` when every row is a decode row (the
/// plain `softmax-scale` fit answers) or the other rows are not right.
pub(super) fn decode_logit_scale(x: &SiteCtx<'_>) -> Option<Detection> {
    if x.site.stage == Stage::Lse {
        return x.at_stage(Stage::AttnOut).and_then(|y| decode_logit_scale(&y));
    }
    if !matches!(x.site.stage, Stage::AttnLatent | Stage::AttnOut) || x.input.cfg.indexer.is_some() {
        return None;
    }
    let ps = x.path.paged?;
    let is_decode = |row: usize| ps.queries.get(row).is_some_and(|q| q.cached == q.upto && q.upto > 0);
    let t = ps.queries.len();
    let others: Vec<usize> = (0..t).filter(|&row| !is_decode(row)).collect();
    // Every row a decode row: the plain fit of the whole site answers, except over a declared
    // fp8 query, whose rounding (E4M3 saturation, subnormals) only the exact replay models.
    let declared = ps.cache_quant.and_then(|q| q.query).is_some_and(|q| q != 1.0);
    if (others.is_empty() && !declared)
        || others.len() == t
        || x.cand.len() != x.refr.len()
        || !x.cand.len().is_multiple_of(t)
    {
        return None;
    }
    // The other rows must be right as they are.
    let per_row = x.cand.len() / t;
    let pick = |tt: &TraceTensor| -> Vec<f64> {
        others
            .iter()
            .flat_map(|&row| (row * per_row..(row + 1) * per_row).map(|i| tt.get(i)))
            .collect()
    };
    let others_err = rel_l2(&pick(x.cand), &pick(x.refr));
    if others_err > x.explain {
        return None;
    }
    let (ps, inp) = replay_inputs(x)?;
    let decode: Vec<bool> = inp.rows.iter().map(|&row| is_decode(row)).collect();
    if !decode.contains(&true) {
        return None;
    }
    let reads = reads_of(&inp, hypotheses(ps).first()?);
    let mut used: Vec<HashSet<usize>> = vec![HashSet::new(); inp.rows.len()];
    add_keys(&mut used, &reads);
    let pre = Precomputed::new(x, &inp, &used);
    let base = replay(&inp, &pre, &reads, None);
    let query = ps.cache_quant.and_then(|q| q.query).filter(|&q| q != 1.0);
    let c = screen_logit_scale(&inp, query, &|c| {
        replay(&inp, &pre.logits_scaled(c, &decode), &reads, None)
    });
    // With an fp8 query, each candidate exactly: the query quantized at q_scale/c and read back
    // × q_scale (an unscaled cast is c = q_scale), so each element is c·round_{Q/c}(x), whose
    // E4M3 grid differs from c × round_Q(x) among the subnormals and where E4M3 saturates (the
    // screen is blurred there, so the declared q_scale's ±1 powers are always replayed).
    let mut tries: Vec<f64> = vec![c];
    tries.extend(
        query
            .into_iter()
            .flat_map(|q| [q, 1.0 / q])
            .filter(|p| (p / c - 1.0).abs() > 1e-9),
    );
    let exact = |c: f64| -> Option<Replay> {
        match ps.cache_quant.filter(|q| q.query.is_some()) {
            Some(kq) => {
                let at = crate::core::fp8::KvCacheQuant {
                    query: kq.query.map(|q| q / c),
                    ..kq
                };
                let read = move |v: f64| c * at.round_query(v);
                let cached = ps.cache_quant.map(|k| move |v: f64| k.round(v));
                let inp_c = inputs_query(x, ps, cached.as_ref().map(|f| f as &dyn Fn(f64) -> f64), Some(&read))?;
                Some(replay(&inp_c, &Precomputed::new(x, &inp_c, &used), &reads, None))
            }
            None => Some(replay(&inp, &pre.logits_scaled(c, &decode), &reads, None)),
        }
    };
    // Held to the site's own thresholds (the run's rows, fp8 ones included) and far nearer than
    // the logits as they are: where the path records no ql_nope (a mixed batch), the replay
    // recomputes it, and an fp8 query's rounding flips on a few elements with the f32/f64
    // difference.
    let (c, v) = tries
        .into_iter()
        .filter(|c| (c - 1.0).abs() >= 1e-3)
        .filter_map(|c| scale_verdict(x, &inp, &exact(c)?, &base).map(|v| (c, v)))
        .min_by(|a, b| a.1.err.total_cmp(&b.1.err))?;
    let n_dec = (0..t).filter(|&row| is_decode(row)).count();
    let s = |k: usize| if k == 1 { "" } else { "s" };
    let rest = if others.is_empty() {
        String::new()
    } else {
        format!(
            "; the {} other row{} right as they are (rel_l2 {})",
            others.len(),
            s(others.len()),
            sci(others_err, 2)
        )
    };
    let mut ev = format!(
        "{} equals the replay of the paged cache with the logits of the step's {n_dec} decode row{} (every position \
         read through the cache) ×{}, on {}: rel_l2 {} vs {} with the logits as they are{rest}",
        x.site.stage.name(),
        s(n_dec),
        sci(c, 4),
        rows_heads(v.compared, inp.heads.len()),
        sci(v.err, 2),
        sci(v.base_err, 2),
    );
    if let Some(e) = v.lse_err {
        ev.push_str(&format!("; lse rel_l2 {}", sci(e, 2)));
    }
    let cause = super::attention::query_scale_cause(x, c).unwrap_or_else(|| {
        format!(
            "the decode kernel scales its logits ×{} (its softmax scale, or its query's scale)",
            sci(c, 4)
        )
    });
    let hint = if others.is_empty() {
        format!("{cause}; quantize the decode query and descale it with the layer's one q_scale")
    } else {
        format!(
            "{cause}; the prefill's attention in the same batch is right, so the decode kernel's scale differs from \
             the prefill's: check the softmax scale and the query scale it is handed"
        )
    };
    Some(Detection::new(ev, hint))
}

/// The decode rows' logit scale nearest the candidate on the sampled values: screened over
/// quarter octaves from 2⁻⁶ to 2⁶ and the declared q_scale's ±1 powers (`query`), refined by
/// golden section; a fit within 1 % of one of those powers is that power (the screen is
/// blurred by the query's rounding). `replay_at(c)` replays with the logits × c.
fn screen_logit_scale(inp: &Inputs<'_>, query: Option<f64>, replay_at: &dyn Fn(f64) -> Replay) -> f64 {
    let screen = |c: f64| {
        let (a, b): (Vec<f64>, Vec<f64>) = replay_at(c)
            .vals
            .iter()
            .zip(&inp.cand_vals)
            .filter_map(|(v, c)| v.map(|v| (*c, v)))
            .unzip();
        rel_l2(&a, &b)
    };
    let mut grid: Vec<f64> = (-24..=24)
        .filter(|&j| j != 0)
        .map(|j| 2f64.powf(f64::from(j) / 4.0))
        .collect();
    grid.extend(query.into_iter().flat_map(|q| [q, 1.0 / q]));
    let (mut best, mut best_e) = (1.0, screen(1.0));
    for c in grid {
        let e = screen(c);
        if e < best_e {
            (best, best_e) = (c, e);
        }
    }
    let (mut a, mut b) = (best / 2f64.powf(0.25), best * 2f64.powf(0.25));
    let inv_phi = (5f64.sqrt() - 1.0) / 2.0;
    for _ in 0..30 {
        let (c1, c2) = (b - inv_phi * (b - a), a + inv_phi * (b - a));
        if screen(c1) < screen(c2) {
            b = c2;
        } else {
            a = c1;
        }
    }
    let refined = (a + b) / 2.0;
    let c = if screen(refined) < best_e { refined } else { best };
    query
        .into_iter()
        .flat_map(|q| [q, 1.0 / q])
        .find(|&p| (c / p - 1.0).abs() < 1e-2)
        .unwrap_or(c)
}

/// Whether the replay `rep` explains the sampled rows where `base` does not, for
/// [`decode_logit_scale`]: the output within the site's explain threshold, the `lse` (when
/// compared) within `lse`'s, and the output at most a tenth of the baseline's distance.
fn scale_verdict(x: &SiteCtx<'_>, inp: &Inputs<'_>, rep: &Replay, base: &Replay) -> Option<Verdict> {
    let pairs = |vals: &[Option<f64>], cand: &[f64]| -> (Vec<f64>, Vec<f64>) {
        vals.iter().zip(cand).filter_map(|(v, c)| v.map(|v| (*c, v))).unzip()
    };
    let (c, r) = pairs(&rep.vals, &inp.cand_vals);
    let (cb, b) = pairs(&base.vals, &inp.cand_vals);
    if c.is_empty() {
        return None;
    }
    let (err, base_err) = (rel_l2(&c, &r), rel_l2(&cb, &b));
    let lse_err = inp.cand_lse.as_ref().map(|cl| {
        let (c, r) = pairs(&rep.lse, cl);
        rel_l2(&c, &r)
    });
    let lse_ok = lse_err.is_none_or(|e| e <= explain_threshold(Stage::Lse, x.input.precision));
    let compared = inp.rows.len();
    (err <= x.explain && err <= 0.1 * base_err && lse_ok).then_some(Verdict {
        err,
        lse_err,
        base_err,
        compared,
        left_out: 0,
        zero_rows: 0,
    })
}

/// `paged-kv` at an attention output read through a paged cache (`attn_latent`, `lse`,
/// `attn_out`): a replay under one hypothesis of the bounded set reproduces the sampled rows
/// (and `lse` when compared) within the explain threshold, while the metadata as recorded does
/// not. Rows whose reads the metadata cannot place are left out and counted; rows that read a
/// slot nothing was written to are replayed with a zero row (a zeroed cache) and left out when
/// that does not match on a dump, whose cache may hold an earlier request's rows.
pub(super) fn paged_kv(x: &SiteCtx<'_>) -> Option<Detection> {
    if !matches!(x.site.stage, Stage::AttnLatent | Stage::Lse | Stage::AttnOut) || x.input.cfg.indexer.is_some() {
        return None;
    }
    let (ps, inp) = replay_inputs(x)?;
    let hyps = hypotheses(ps);
    let base_reads = reads_of(&inp, hyps.first()?);
    // The hypotheses that move a sampled row's reads, and every key any of them reads: the
    // logits and values are computed once per (row, key) and (key) for all of them.
    let mut used: Vec<HashSet<usize>> = vec![HashSet::new(); inp.rows.len()];
    add_keys(&mut used, &base_reads);
    let mut moving = Vec::new();
    for h in &hyps[1..] {
        let r = reads_of(&inp, h);
        if r != base_reads {
            add_keys(&mut used, &r);
            moving.push(*h);
        }
    }
    if moving.is_empty() {
        return None;
    }
    let pre = Precomputed::new(x, &inp, &used);
    let base_rep = replay(&inp, &pre, &base_reads, None);
    let explained: Vec<(Verdict, Hyp)> = moving
        .into_iter()
        .filter_map(|h| {
            let r = reads_of(&inp, &h);
            let rep = replay(&inp, &pre, &r, None);
            judge(x, &inp, &r, &rep, &base_rep).map(|v| (v, h))
        })
        .collect();
    // The best, or among those within rounding of it the first in the hypotheses' order; the
    // others that explain the rows are named beside it (a read that lands only on
    // never-written slots is the same zero rows under several mechanisms).
    let best = explained.iter().map(|(v, _)| v.err).fold(f64::INFINITY, f64::min);
    let pick = explained
        .iter()
        .position(|(v, _)| v.err <= TIE_FACTOR * best + f64::MIN_POSITIVE)?;
    // Over an fp8 cache, a cache read back × c with the recorded metadata (`kv-cache-scale`, tried
    // after this class) that explains the site is the more specific answer: in bf16 a wrong
    // page size can fit the same rows loosely.
    if ps.cache_quant.is_some() && kv_cache_scale(x).is_some() {
        return None;
    }
    let (v, h) = &explained[pick];
    let also: Vec<Hyp> = explained
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != pick)
        .map(|(_, (_, h))| *h)
        .collect();
    Some(detection(x, &inp, v, h, &also))
}

/// The failing site's paged step and the replay's inputs ([`inputs`]): `None` without a paged
/// step, with non-finite candidate values, or when the step's rows are not the site's.
fn replay_inputs<'a>(x: &SiteCtx<'a>) -> Option<(&'a PagedStep, Inputs<'a>)> {
    let ps = x.path.paged?;
    let m = x.diff.metrics.as_ref()?;
    if m.nonfinite_cand > 0 || ps.queries.len() != *x.refr.shape.first()? {
        return None;
    }
    Some((ps, inputs(x, ps)?))
}

/// Where the replay's latent rows came from, as evidence says it.
fn key_source(ps: &PagedStep) -> &'static str {
    if ps.keys.is_some() {
        "the dump's own kv_c_normed ‖ k_pe_roped rows of this and the earlier steps"
    } else {
        "the path's own kv_c_normed ‖ k_pe_roped rows"
    }
}

/// Gathers what the replay reads: the latent rows, the sampled rows, heads and columns with
/// their queries, `W_UV` for `attn_out`, and the candidate's values there. `None` when a site
/// the replay needs is missing or has another shape.
fn inputs<'a>(x: &SiteCtx<'_>, ps: &'a PagedStep) -> Option<Inputs<'a>> {
    let round = ps.cache_quant.map(|c| move |k: f64| c.round(k));
    inputs_read(x, ps, round.as_ref().map(|f| f as &dyn Fn(f64) -> f64))
}

/// [`inputs`] with every cached value read back as `read` gives it (`None`: as computed).
fn inputs_read<'a>(x: &SiteCtx<'_>, ps: &'a PagedStep, read: Option<&dyn Fn(f64) -> f64>) -> Option<Inputs<'a>> {
    inputs_query(x, ps, read, None)
}

/// [`inputs_read`] with each decode row's query element read as `query` gives it (`None`: as
/// the step declares, [`crate::core::fp8::KvCacheQuant::round_query`]).
fn inputs_query<'a>(
    x: &SiteCtx<'_>,
    ps: &'a PagedStep,
    read: Option<&dyn Fn(f64) -> f64>,
    query: Option<&(dyn Fn(f64) -> f64 + Sync)>,
) -> Option<Inputs<'a>> {
    let cfg = x.input.cfg;
    let [n, l, p, r, v] = cfg.dims().nlprv();
    let layer = x.site.layer;
    let own = |st: Stage| {
        let s = Site::new(layer, st);
        x.path.trace.get(&s).or_else(|| x.input.reference.get(&s))
    };
    let t = ps.queries.len();
    let keys: std::borrow::Cow<'a, [f64]> = match &ps.keys {
        Some(k) => std::borrow::Cow::Borrowed(k.as_slice()),
        None => {
            let (kv, kp) = (own(Stage::KvCNormed)?, own(Stage::KPeRoped)?);
            if kv.len() != t * l || kp.len() != t * r {
                return None;
            }
            let mut k = Vec::with_capacity(t * (l + r));
            for i in 0..t {
                k.extend((0..l).map(|d| kv.get(i * l + d)));
                k.extend((0..r).map(|d| kp.get(i * r + d)));
            }
            std::borrow::Cow::Owned(k)
        }
    };
    // An fp8 cache hands back its rows rounded (a prefill row's own new keys are replayed so
    // too: one E4M3 step's noise on those rows).
    let keys = match read {
        Some(f) => std::borrow::Cow::Owned(keys.iter().map(|&k| f(k)).collect()),
        None => keys,
    };
    let n_keys = keys.len() / (l + r).max(1);
    if ps.seqs.iter().any(|s| s.key_off + s.len > n_keys) {
        return None;
    }
    let width = match x.site.stage {
        Stage::AttnLatent => l,
        Stage::AttnOut => v,
        _ => 0,
    };
    if x.cand.len() != t * n * width.max(1) {
        return None;
    }
    let rows = sample_rows(x, ps, n, width.max(1));
    if rows.is_empty() {
        return None;
    }
    let heads = spread(n, SAMPLE_HEADS);
    let cols = spread(width, SAMPLE_COLS);
    let qpe = own(Stage::QPeRoped)?;
    let ql = own(Stage::QlNope).filter(|t| t.len() == ps.queries.len() * n * l);
    let (qt, wuk) = (own(Stage::Q)?, own(Stage::WUkT)?);
    if qpe.len() != t * n * r || qt.len() != t * n * (p + r) || wuk.len() != n * p * l {
        return None;
    }
    let q: Vec<Vec<f64>> = rows
        .par_iter()
        .flat_map_iter(|&row| heads.iter().map(move |&h| (row, h)))
        .map(|(row, h)| {
            let mut out: Vec<f64> = match ql {
                Some(ql) => (0..l).map(|d| ql.get((row * n + h) * l + d)).collect(),
                None => {
                    // ql_nope = q_nope · W_UK_T[h] ([P] · [P, L]).
                    let mut o = vec![0f64; l];
                    for pi in 0..p {
                        let qv = qt.get((row * n + h) * (p + r) + pi);
                        for (d, od) in o.iter_mut().enumerate() {
                            *od += qv * wuk.get((h * p + pi) * l + d);
                        }
                    }
                    o
                }
            };
            out.extend((0..r).map(|d| qpe.get((row * n + h) * r + d)));
            // A decode row (every position read through the cache) of a kernel that takes an
            // fp8 query reads it rounded.
            read_query(&mut out, ps, row, query);
            out
        })
        .collect();
    let w_uv = if x.site.stage == Stage::AttnOut {
        let w = own(Stage::WUv)?;
        if w.len() != n * l * v {
            return None;
        }
        Some(w.to_f64())
    } else {
        None
    };
    let cand_vals: Vec<f64> = rows
        .iter()
        .flat_map(|&row| heads.iter().map(move |&h| (row, h)))
        .flat_map(|(row, h)| cols.iter().map(move |&c| (row * n + h) * width + c))
        .map(|i| x.cand.get(i))
        .collect();
    let lse_site = Site::new(layer, Stage::Lse);
    let cand_lse = x
        .path
        .diffs
        .iter()
        .any(|d| d.site == lse_site)
        .then(|| x.path.trace.get(&lse_site))
        .flatten()
        .filter(|t| t.len() == ps.queries.len() * n)
        .map(|lt| {
            rows.iter()
                .flat_map(|&row| heads.iter().map(move |&h| row * n + h))
                .map(|i| lt.get(i))
                .collect()
        });
    Some(Inputs {
        ps,
        keys,
        q,
        w_uv,
        rows,
        heads,
        cols,
        width,
        cand_vals,
        cand_lse,
    })
}

/// A decode row's query (every position read through the cache) as the kernel reads it: each
/// element through `query`, else rounded as the step's fp8 query is; any other row as it is.
fn read_query(q: &mut [f64], ps: &PagedStep, row: usize, query: Option<&(dyn Fn(f64) -> f64 + Sync)>) {
    let pq = ps.queries[row];
    if pq.cached != pq.upto {
        return;
    }
    match (query, ps.cache_quant.filter(|c| c.query.is_some())) {
        (Some(f), _) => q.iter_mut().for_each(|v| *v = f(*v)),
        (None, Some(c)) => q.iter_mut().for_each(|v| *v = c.round_query(*v)),
        (None, None) => {}
    }
}

/// Up to `k` of `0..n`, evenly spread.
fn spread(n: usize, k: usize) -> Vec<usize> {
    if n <= k {
        return (0..n).collect();
    }
    let mut v: Vec<usize> = (0..k).map(|i| (i * n + n / 2) / k).collect();
    v.dedup();
    v
}

/// The token rows the replay reads: of the rows that read the cache, the half of
/// [`SAMPLE_ROWS`] that differ most from the reference (on the sampled heads), then rows spread
/// over the rest; ascending.
fn sample_rows(x: &SiteCtx<'_>, ps: &PagedStep, n: usize, width: usize) -> Vec<usize> {
    let eligible: Vec<usize> = (0..ps.queries.len()).filter(|&i| ps.queries[i].cached > 0).collect();
    if eligible.len() <= SAMPLE_ROWS {
        return eligible;
    }
    let heads = spread(n, SAMPLE_HEADS);
    let mut err: Vec<(f64, usize)> = eligible
        .par_iter()
        .map(|&row| {
            let e: f64 = heads
                .iter()
                .flat_map(|&h| (0..width).map(move |c| (row * n + h) * width + c))
                .map(|i| (x.cand.get(i) - x.refr.get(i)).powi(2))
                .sum();
            (e, row)
        })
        .collect();
    err.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    let mut rows: Vec<usize> = err.iter().take(SAMPLE_ROWS / 2).map(|&(_, r)| r).collect();
    for i in spread(eligible.len(), SAMPLE_ROWS / 2) {
        if !rows.contains(&eligible[i]) {
            rows.push(eligible[i]);
        }
    }
    rows.sort_unstable();
    rows
}

/// The hypotheses, the metadata's own first (the baseline: every position reads its own row).
/// With a recorded page size p: the recorded slot mapping, block tables shifted by ±1 entry,
/// slot mappings shifted by ±1 slot and ±1 block, block tables of the sequence ±1, then reads
/// and writes with every other page size of [`PAGE_SIZES`]; the order in which rows that several
/// explain alike are named (off-by-one mistakes first). A dump that recorded no page size tries
/// each of [`UNRECORDED_PAGE_SIZES`] as p.
fn hypotheses(ps: &PagedStep) -> Vec<Hyp> {
    let pages: Vec<usize> = match ps.page_size {
        Some(p) => vec![p],
        None => UNRECORDED_PAGE_SIZES.to_vec(),
    };
    let mut out = vec![Hyp {
        page: pages[0],
        write: Write::Table,
        read: Read::Table,
    }];
    let recorded = ps.writes.iter().any(|w| w.slot.is_some());
    for &p in &pages {
        let h = |write, read| Hyp { page: p, write, read };
        if recorded {
            out.push(h(Write::Recorded, Read::Table));
        }
        for d in [1, -1] {
            out.push(h(Write::Table, Read::BlockShift(d)));
            out.push(h(Write::Shift(d), Read::Table));
        }
        for d in [1, -1] {
            out.push(h(Write::Shift(d * p as i64), Read::Table));
            out.push(h(Write::Table, Read::SeqShift(d)));
        }
        for pp in PAGE_SIZES.iter().copied().filter(|&pp| pp != p) {
            out.push(h(Write::Table, Read::Page(pp)));
            out.push(h(Write::Table, Read::PageIndex(pp)));
            out.push(h(Write::Page(pp), Read::Table));
        }
    }
    out.dedup();
    out
}

/// Each sequence's block-table row under page size `p`: the recorded rows; without them, the
/// rows the recorded slots imply (block = slot / p at each written position); without those,
/// blocks handed out in sequence order from block 0.
fn tables(ps: &PagedStep, p: usize) -> Vec<Vec<i64>> {
    if let Some(t) = &ps.block_tables {
        return t.clone();
    }
    let p = p.max(1);
    let mut out: Vec<Vec<i64>> = ps.seqs.iter().map(|s| vec![-1; s.len.div_ceil(p)]).collect();
    if ps.writes.iter().all(|w| w.slot.is_some_and(|s| s >= 0)) && !ps.writes.is_empty() {
        for w in &ps.writes {
            if let (Some(slot), Some(row)) = (w.slot, out.get_mut(w.seq))
                && let Some(b) = row.get_mut(w.pos / p)
                && *b < 0
            {
                *b = slot / p as i64;
            }
        }
        return out;
    }
    let mut next = 0i64;
    for row in &mut out {
        for b in row.iter_mut() {
            *b = next;
            next += 1;
        }
    }
    out
}

/// The slot of every write under `h` (`None`: not written), keyed by slot to the key row last
/// written there.
fn written(inp: &Inputs<'_>, h: &Hyp, tabs: &[Vec<i64>]) -> HashMap<i64, usize> {
    let ps = inp.ps;
    let mut map = HashMap::with_capacity(ps.writes.len());
    for w in &ps.writes {
        let Some(row) = tabs.get(w.seq) else { continue };
        let own = table_slot(row, ps.pad_block, h.page, w.pos);
        let slot = match h.write {
            Write::Recorded => w.slot.or(own),
            Write::Table => own,
            Write::Shift(d) => own.and_then(|s| s.checked_add(d)),
            Write::Page(pp) => table_slot(row, ps.pad_block, pp, w.pos),
        };
        if let Some(s) = slot.filter(|&s| s >= 0)
            && w.pos < ps.seqs[w.seq].len
        {
            map.insert(s, ps.seqs[w.seq].key_off + w.pos);
        }
    }
    map
}

/// What each sampled row read under `h`.
fn reads_of(inp: &Inputs<'_>, h: &Hyp) -> Vec<RowReads> {
    let ps = inp.ps;
    let tabs = tables(ps, h.page);
    let map = written(inp, h, &tabs);
    let p = h.page.max(1);
    inp.rows
        .iter()
        .map(|&row| {
            let q = ps.queries[row];
            let own = tabs.get(q.seq)?;
            let mut out = Vec::with_capacity(q.upto);
            for j in 0..q.cached.min(q.upto) {
                let slot = match h.read {
                    Read::Table => table_slot(own, ps.pad_block, p, j),
                    Read::Page(pp) => table_slot(own, ps.pad_block, pp, j),
                    Read::PageIndex(pp) => {
                        let pp = pp.max(1);
                        own.get(j / pp)
                            .copied()
                            .or(ps.pad_block)
                            .filter(|&b| b >= 0)
                            .and_then(|b| b.checked_mul(p as i64)?.checked_add((j % pp) as i64))
                    }
                    Read::BlockShift(d) => {
                        let idx = (j / p) as i64 + d;
                        if idx < 0 {
                            None
                        } else {
                            own.get(idx as usize)
                                .copied()
                                .or(ps.pad_block)
                                .filter(|&b| b >= 0)
                                .and_then(|b| b.checked_mul(p as i64)?.checked_add((j % p) as i64))
                        }
                    }
                    Read::SeqShift(d) => {
                        let other = q.seq as i64 + d;
                        let row = usize::try_from(other).ok().and_then(|o| tabs.get(o))?;
                        table_slot(row, ps.pad_block, p, j)
                    }
                };
                out.push(map.get(&slot?).map_or(Src::Unwritten, |&k| Src::Key(k)));
            }
            let seq = ps.seqs.get(q.seq)?;
            for j in q.cached..q.upto {
                if j >= seq.len {
                    return None;
                }
                out.push(Src::Key(seq.key_off + j));
            }
            Some(out)
        })
        .collect()
}

/// Adds the keys each sampled row reads in `reads` to `used`.
fn add_keys(used: &mut [HashSet<usize>], reads: &[RowReads]) {
    for (u, rd) in used.iter_mut().zip(reads) {
        u.extend(rd.iter().flatten().filter_map(|s| match s {
            Src::Key(k) => Some(*k),
            Src::Unwritten => None,
        }));
    }
}

/// What every hypothesis's replay shares: per sampled row the logits of the keys it may read,
/// and per key its value on the sampled heads and columns.
struct Precomputed {
    /// Per sampled row: key → its row in `z`.
    at: Vec<HashMap<usize, usize>>,
    /// Per sampled row: the logits `(ql_nope·kv_c_k + q_pe·k_pe_k)·scale`, `[keys, heads]`.
    z: Vec<Vec<f64>>,
    /// Key → its row in `vals`.
    vat: HashMap<usize, usize>,
    /// Per key: `kv_c` on the sampled columns (`attn_latent`), or `kv_c · W_UV[h]` on them
    /// (`attn_out`), `[keys, heads, cols]`; empty for `lse`.
    vals: Vec<f64>,
}

impl Precomputed {
    fn new(x: &SiteCtx<'_>, inp: &Inputs<'_>, used: &[HashSet<usize>]) -> Self {
        let [_, l, _, r, v] = x.input.cfg.dims().nlprv();
        let scale = x.input.cfg.softmax_scale;
        let nh = inp.heads.len();
        let keys = &inp.keys;
        let per_row: Vec<(HashMap<usize, usize>, Vec<f64>)> = used
            .par_iter()
            .enumerate()
            .map(|(ri, u)| {
                let mut ks: Vec<usize> = u.iter().copied().collect();
                ks.sort_unstable();
                let mut z = Vec::with_capacity(ks.len() * nh);
                for &k in &ks {
                    let kr = &keys[k * (l + r)..(k + 1) * (l + r)];
                    for hi in 0..nh {
                        let q = &inp.q[ri * nh + hi];
                        z.push(kr.iter().zip(q).map(|(a, b)| a * b).sum::<f64>() * scale);
                    }
                }
                (ks.into_iter().enumerate().map(|(i, k)| (k, i)).collect(), z)
            })
            .collect();
        let (at, z) = per_row.into_iter().unzip();
        let mut all: Vec<usize> = used
            .iter()
            .flatten()
            .copied()
            .collect::<HashSet<_>>()
            .into_iter()
            .collect();
        all.sort_unstable();
        let vals: Vec<f64> = if inp.width == 0 {
            Vec::new()
        } else {
            all.par_iter()
                .flat_map_iter(|&k| {
                    let kr = &keys[k * (l + r)..k * (l + r) + l];
                    inp.heads.iter().flat_map(move |&h| {
                        inp.cols.iter().map(move |&c| match &inp.w_uv {
                            Some(w) => (0..l).map(|li| kr[li] * w[(h * l + li) * v + c]).sum(),
                            None => kr[c],
                        })
                    })
                })
                .collect()
        };
        Precomputed {
            at,
            z,
            vat: all.into_iter().enumerate().map(|(i, k)| (k, i)).collect(),
            vals,
        }
    }

    /// The same reads with the logits of the sampled rows flagged in `rows` times `c` (values
    /// as they are).
    fn logits_scaled(&self, c: f64, rows: &[bool]) -> Precomputed {
        Precomputed {
            at: self.at.clone(),
            z: self
                .z
                .iter()
                .zip(rows)
                .map(|(r, &on)| {
                    if on {
                        r.iter().map(|v| v * c).collect()
                    } else {
                        r.clone()
                    }
                })
                .collect(),
            vat: self.vat.clone(),
            vals: self.vals.clone(),
        }
    }

    /// The same reads with the cache read back `c` times what was written: every logit (both
    /// of its products read a cached key) and every value times `c`.
    fn scaled(&self, c: f64) -> Precomputed {
        Precomputed {
            at: self.at.clone(),
            z: self.z.iter().map(|r| r.iter().map(|v| v * c).collect()).collect(),
            vat: self.vat.clone(),
            vals: self.vals.iter().map(|v| v * c).collect(),
        }
    }
}

/// One sampled row's replayed values (`None` where its reads are unknown).
type RowValues = Vec<Option<f64>>;

/// One hypothesis's replay on the sampled rows: per (row, head) its `lse`, and per (row, head,
/// column) its output; `None` for a row whose reads are unknown.
struct Replay {
    lse: Vec<Option<f64>>,
    vals: Vec<Option<f64>>,
}

/// Replays attention (absorbed form, f64) on the sampled rows and heads over the positions
/// `reads` gives: the softmax of the logits (0 for a slot never written: a zero row), then the
/// weighted values (`kv_c`, or `kv_c · W_UV` for `attn_out`) on the sampled columns. With
/// `fresh` (the same keys and reads, precomputed from the keys as computed), each row's
/// positions past its cached ones take their logits and values from it.
fn replay(inp: &Inputs<'_>, pre: &Precomputed, reads: &[RowReads], fresh: Option<&Precomputed>) -> Replay {
    let (nh, nc) = (inp.heads.len(), inp.cols.len());
    let per_row: Vec<(RowValues, RowValues)> = reads
        .par_iter()
        .enumerate()
        .map(|(ri, rd)| {
            let Some(rd) = rd else {
                return (vec![None; nh], vec![None; nh * nc]);
            };
            // Each read as (row in z, row in vals); None for a zero row.
            let idx: Vec<Option<(usize, usize)>> = rd
                .iter()
                .map(|s| match s {
                    Src::Key(k) => Some((pre.at[ri][k], pre.vat.get(k).copied().unwrap_or(0))),
                    Src::Unwritten => None,
                })
                .collect();
            let cached = inp.ps.queries[inp.rows[ri]].cached;
            let from = |j: usize| match fresh {
                Some(f) if j >= cached => f,
                _ => pre,
            };
            let mut lse = Vec::with_capacity(nh);
            let mut vals = Vec::with_capacity(nh * nc);
            for hi in 0..nh {
                let z: Vec<f64> = idx
                    .iter()
                    .enumerate()
                    .map(|(j, i)| i.map_or(0.0, |(zi, _)| from(j).z[ri][zi * nh + hi]))
                    .collect();
                let mx = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = z.iter().map(|s| (s - mx).exp()).collect();
                let sum: f64 = e.iter().sum();
                lse.push(Some(mx + sum.ln()));
                if inp.width == 0 {
                    continue;
                }
                let mut o = vec![0f64; nc];
                for (j, (ej, i)) in e.iter().zip(&idx).enumerate() {
                    if let Some((_, vi)) = i {
                        let row = &from(j).vals[(vi * nh + hi) * nc..(vi * nh + hi + 1) * nc];
                        for (oc, &vc) in o.iter_mut().zip(row) {
                            *oc += ej / sum * vc;
                        }
                    }
                }
                vals.extend(o.into_iter().map(Some));
            }
            (lse, vals)
        })
        .collect();
    let mut out = Replay {
        lse: Vec::new(),
        vals: Vec::new(),
    };
    for (l, v) in per_row {
        out.lse.extend(l);
        out.vals.extend(v);
    }
    out
}

/// How a hypothesis fared on the sampled rows.
struct Verdict {
    /// rel_l2 of the candidate against the replay, on the compared rows' outputs (or `lse` at
    /// the `lse` site).
    err: f64,
    /// The same for `lse`, when compared beside an output.
    lse_err: Option<f64>,
    /// rel_l2 of the candidate against the metadata's own replay on the same rows.
    base_err: f64,
    /// Rows compared, rows left out (reads the metadata cannot place, or a never-written slot
    /// that a zero row does not explain on a dump).
    compared: usize,
    left_out: usize,
    /// Compared rows that read a slot nothing was written to (replayed as zero rows).
    zero_rows: usize,
}

/// Whether the replay `rep` (reads `reads`) explains the candidate where the baseline `base`
/// does not: on the compared rows together within the explain thresholds of the site (and of
/// `lse`, when compared), no row beyond [`ROW_SLACK`] times them; and the baseline out of the
/// site's tolerance on them by [`BASELINE_FACTOR`] times the hypothesis's error, or some row
/// out of the explain threshold under the baseline where the two replays are further apart than
/// twice it (a wrong cache read moves a few rows as much as many, and the site may fail on
/// those rows alone; twice, so that rounding cannot tell the replays apart by chance). Rows whose reads are
/// unknown are left out; rows that read a never-written slot are compared as zero rows on a
/// zeroed cache, and on a dump only when they all fit so.
fn judge(x: &SiteCtx<'_>, inp: &Inputs<'_>, reads: &[RowReads], rep: &Replay, base: &Replay) -> Option<Verdict> {
    let (nh, nc) = (inp.heads.len(), inp.cols.len());
    // The replay rebuilds the engine's own arithmetic from its own rows, an fp8 cache's
    // rounding included: it is held to the thresholds of the dtype the engine computed in, not
    // the fp8 rows, which allow for fp8 steps flipped upstream and carried through the layer
    // (5× them would let an O(1) miss explain).
    let dtype_rows = x.input.precision.without_fp8();
    let (site_thr, lse_thr) = (
        explain_threshold(x.site.stage, dtype_rows),
        explain_threshold(Stage::Lse, dtype_rows),
    );
    let unwritten = |ri: usize| reads[ri].as_ref().is_some_and(|r| r.contains(&Src::Unwritten));
    // (candidate, replay, baseline) on the rows `sel`: the output values and the lse.
    let collect = |sel: &[usize]| {
        let (mut c, mut a, mut b) = (Vec::new(), Vec::new(), Vec::new());
        let (mut cl, mut al, mut bl) = (Vec::new(), Vec::new(), Vec::new());
        for &ri in sel {
            for i in ri * nh * nc..(ri + 1) * nh * nc {
                if let (Some(av), Some(bv)) = (rep.vals[i], base.vals[i]) {
                    c.push(inp.cand_vals[i]);
                    a.push(av);
                    b.push(bv);
                }
            }
            if let Some(cand_lse) = &inp.cand_lse {
                for i in ri * nh..(ri + 1) * nh {
                    if let (Some(av), Some(bv)) = (rep.lse[i], base.lse[i]) {
                        cl.push(cand_lse[i]);
                        al.push(av);
                        bl.push(bv);
                    }
                }
            }
        }
        (c, a, b, cl, al, bl)
    };
    // One row's errors in units of the thresholds (≤ 1: within them), the larger of the
    // output's and the lse's: candidate against the replay, against the baseline, and the two
    // replays against each other.
    let scores = |ri: usize| -> [f64; 3] {
        let (c, a, b, cl, al, bl) = collect(&[ri]);
        let unit = |x0: &[f64], y: &[f64], thr: f64| if x0.is_empty() { 0.0 } else { rel_l2(x0, y) / thr };
        let (vt, lt) = (site_thr, lse_thr);
        [
            unit(&c, &a, vt).max(unit(&cl, &al, lt)),
            unit(&c, &b, vt).max(unit(&cl, &bl, lt)),
            unit(&a, &b, vt).max(unit(&al, &bl, lt)),
        ]
    };
    let known: Vec<usize> = (0..reads.len())
        .filter(|&ri| reads[ri].is_some() && base.lse[ri * nh].is_some())
        .collect();
    let per_row: Vec<(usize, [f64; 3])> = known.iter().map(|&ri| (ri, scores(ri))).collect();
    let fits = |rows: &[usize]| {
        let (c, a, _, cl, al, _) = collect(rows);
        (c.is_empty() || rel_l2(&c, &a) <= site_thr) && (cl.is_empty() || rel_l2(&cl, &al) <= lse_thr)
    };
    let zeroed: Vec<usize> = known.iter().copied().filter(|&ri| unwritten(ri)).collect();
    let zero_fit = fits(&zeroed) && per_row.iter().all(|(ri, s)| !unwritten(*ri) || s[0] <= ROW_SLACK);
    let compared: Vec<(usize, [f64; 3])> = per_row
        .into_iter()
        .filter(|(ri, _)| !unwritten(*ri) || inp.ps.zero_filled || zero_fit)
        .collect();
    let rows: Vec<usize> = compared.iter().map(|&(ri, _)| ri).collect();
    if rows.is_empty() || !fits(&rows) || compared.iter().any(|(_, s)| s[0] > ROW_SLACK) {
        return None;
    }
    let (c, a, b, cl, al, bl) = collect(&rows);
    let (err, base_err, lse_err) = if inp.width == 0 {
        (rel_l2(&cl, &al), rel_l2(&cl, &bl), None)
    } else {
        (
            rel_l2(&c, &a),
            rel_l2(&c, &b),
            (!cl.is_empty()).then(|| rel_l2(&cl, &al)),
        )
    };
    // The metadata's own replay fails the site's tolerance on these rows, and by many times the
    // hypothesis's error (its rounding noise); or some row is out of the explain threshold under
    // it and the replays stand apart there.
    let tol = tolerance(x.site.stage, x.input.precision).0.rel_l2;
    let far = base_err > tol && base_err >= BASELINE_FACTOR * err;
    if !(far || compared.iter().any(|(_, s)| s[1] > 1.0 && s[2] > 2.0)) {
        return None;
    }
    Some(Verdict {
        err,
        lse_err,
        base_err,
        compared: rows.len(),
        left_out: reads.len() - rows.len(),
        zero_rows: rows.iter().filter(|&&ri| unwritten(ri)).count(),
    })
}

/// How far beyond the explain thresholds one row of an explained site may be: a row's error
/// scatters around the site's (bf16 rounding of a few large logits moves one row's output by
/// several times the site's rel_l2), a wrong read moves it by the whole output.
const ROW_SLACK: f64 = 4.0;

/// How many times the hypothesis's error the metadata's own replay must miss the sampled rows
/// by, where no single row is out of the explain threshold (a site that fails marginally, as
/// bf16 rounding leaves a wrong read of a few rows).
const BASELINE_FACTOR: f64 = 4.0;

/// Hypotheses whose errors are within this factor of the best one explain the rows alike
/// (rounding decides between them, not the data): the first in the hypotheses' order is named.
const TIE_FACTOR: f64 = 2.0;

/// Hypotheses that also explain the rows, at most this many named in the evidence.
const ALSO_NAMED: usize = 3;

/// The finding of hypothesis `h`, explained as `v`; `also`: the others that explain the
/// sampled rows too.
fn detection(x: &SiteCtx<'_>, inp: &Inputs<'_>, v: &Verdict, h: &Hyp, also: &[Hyp]) -> Detection {
    let (what, hint) = describe(inp.ps, h);
    let source = key_source(inp.ps);
    let mut ev = format!(
        "{} equals the replay of the paged cache {what}, rebuilt from {source}, on {}: rel_l2 {} vs {} for the replay \
         with the recorded metadata (the dump against the reference: {})",
        x.site.stage.name(),
        rows_heads(v.compared, inp.heads.len()),
        sci(v.err, 2),
        sci(v.base_err, 2),
        sci(x.as_is(), 2)
    );
    if let Some(e) = v.lse_err {
        ev.push_str(&format!("; lse rel_l2 {}", sci(e, 2)));
    }
    if v.zero_rows > 0 {
        ev.push_str(&format!(
            "; {} of them read slots nothing was written to (zero rows)",
            v.zero_rows
        ));
    }
    if v.left_out > 0 {
        ev.push_str(&format!(
            "; {} sampled rows left out (reads the metadata cannot place)",
            v.left_out
        ));
    }
    if !also.is_empty() {
        let names: Vec<String> = also.iter().take(ALSO_NAMED).map(|a| describe(inp.ps, a).0).collect();
        ev.push_str(&format!(
            "; these rows are also what {} gives{}",
            names.join(", or "),
            if also.len() > ALSO_NAMED {
                format!(" (and {} more)", also.len() - ALSO_NAMED)
            } else {
                String::new()
            }
        ));
    }
    Detection::new(ev, hint)
}

/// What hypothesis `h` did to the cache, as evidence says it, and the hint for it.
fn describe(ps: &PagedStep, h: &Hyp) -> (String, String) {
    let p = h.page;
    let recorded = if ps.page_size.is_some() {
        ""
    } else {
        " (not recorded: tried)"
    };
    match (h.write, h.read) {
        (Write::Table, Read::Page(pp)) => (
            format!("read with page size {pp}, written with {p}{recorded}"),
            format!(
                "the attention kernel indexed the paged KV cache with block size {pp} while the cache was written with \
                 {p}: pass the cache's block_size to the kernel's metadata, or flatten the block table to token slots \
                 for a kernel that supports only page size 1 (ROCm AITER #2996)"
            ),
        ),
        (Write::Table, Read::PageIndex(pp)) => (
            format!(
                "read with page size {pp} (block index pos // {pp}, row pos % {pp} of the cache's {p}-row pages), \
                 written with {p}{recorded}"
            ),
            format!(
                "the attention kernel was told block size {pp} while the cache's pages hold {p} rows: it took each \
                 position's block-table entry and row with {pp} and stepped through the cache by its real page stride; \
                 pass the cache's block_size to the kernel (ROCm AITER #2996)"
            ),
        ),
        (Write::Page(pp), Read::Table) => (
            format!("written with page size {pp}, read with {p}{recorded}"),
            format!(
                "concat_and_cache_mla computed its slots with block size {pp} while the block tables and the kernel \
                 use {p}: slot_mapping must be block_table[seq][pos // {p}] * {p} + pos % {p}"
            ),
        ),
        (Write::Table, Read::BlockShift(d)) => (
            format!("block table shifted by {d:+} entry (page size {p}{recorded})"),
            "the kernel read each sequence's block table one entry off: check the block index (pos // page_size) and \
             the block-table row pointer (row · max_blocks + index) it reads"
                .to_string(),
        ),
        (Write::Table, Read::SeqShift(d)) => (
            format!("each sequence read the block-table row of the sequence {d:+} from it (page size {p}{recorded})"),
            "the kernel read another sequence's block-table row: the batch was reordered (decodes first) without its \
             block table, or the row index is off by one"
                .to_string(),
        ),
        (Write::Shift(d), Read::Table) if d.unsigned_abs() == p as u64 && p > 1 => (
            format!("rows written one block {} (slot mapping {d:+}, page size {p}{recorded})", if d > 0 { "late" } else { "early" }),
            "new rows were cached a whole block from their slot: slot_mapping must index the token's own block \
             (block_table[seq][pos // page_size]), not the next or previous one"
                .to_string(),
        ),
        (Write::Shift(d), Read::Table) => (
            format!("rows written {} slot{} {} (slot mapping {d:+}{recorded})", d.unsigned_abs(), if d.unsigned_abs() == 1 { "" } else { "s" }, if d > 0 { "late" } else { "early" }),
            "new rows were cached at the next or previous token's slot: slot_mapping must be \
             block_table[seq][pos // page_size] * page_size + pos % page_size at the token's own position (an off-by-one \
             in the positions it is computed from)"
                .to_string(),
        ),
        (Write::Recorded, _) => {
            let (n, of) = recorded_mismatch(ps, p);
            (
                format!("rows written where the step's slot_mapping says, which differs from its block table at {n} of {of} rows (page size {p}{recorded})"),
                "the step's slot_mapping and block table disagree: the rows were cached where the attention does not \
                 read them; slot_mapping must be block_table[seq][pos // page_size] * page_size + pos % page_size"
                    .to_string(),
            )
        }
        _ => (format!("{h:?}"), String::new()),
    }
}

/// Of a step's writes with a recorded slot, how many differ from the slot the block table
/// gives with page size `p`, and how many there are.
fn recorded_mismatch(ps: &PagedStep, p: usize) -> (usize, usize) {
    let tabs = tables(ps, p);
    let with: Vec<_> = ps.writes.iter().filter(|w| w.slot.is_some()).collect();
    let differ = with
        .iter()
        .filter(|w| {
            let own = tabs.get(w.seq).and_then(|row| table_slot(row, ps.pad_block, p, w.pos));
            w.slot != own
        })
        .count();
    (differ, with.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compute::paged::{CacheWrite, PagedQuery, PagedSeq};

    /// Two sequences of 5 and 3 positions in pages of 2, blocks [4, 1, 6] and [0, 3].
    fn step() -> PagedStep {
        let seqs = vec![PagedSeq { key_off: 0, len: 5 }, PagedSeq { key_off: 5, len: 3 }];
        let writes = (0..5)
            .map(|pos| CacheWrite {
                seq: 0,
                pos,
                slot: None,
            })
            .chain((0..3).map(|pos| CacheWrite {
                seq: 1,
                pos,
                slot: None,
            }))
            .collect();
        let queries = (0..5)
            .map(|i| PagedQuery {
                seq: 0,
                cached: i + 1,
                upto: i + 1,
            })
            .chain((0..3).map(|i| PagedQuery {
                seq: 1,
                cached: i + 1,
                upto: i + 1,
            }))
            .collect();
        PagedStep {
            page_size: Some(2),
            block_tables: Some(vec![vec![4, 1, 6], vec![0, 3]]),
            pad_block: Some(0),
            seqs,
            writes,
            queries,
            keys: Some(vec![0.0; 8]),
            zero_filled: true,
            cache_quant: None,
        }
    }

    fn inputs_of(ps: &PagedStep) -> Inputs<'_> {
        Inputs {
            ps,
            keys: std::borrow::Cow::Borrowed(&[]),
            q: Vec::new(),
            w_uv: None,
            rows: (0..8).collect(),
            heads: vec![0],
            cols: Vec::new(),
            width: 0,
            cand_vals: Vec::new(),
            cand_lse: None,
        }
    }

    fn keys(r: &RowReads) -> Vec<Option<usize>> {
        r.as_ref()
            .unwrap()
            .iter()
            .map(|s| match s {
                Src::Key(k) => Some(*k),
                Src::Unwritten => None,
            })
            .collect()
    }

    #[test]
    fn the_metadata_reads_every_position_of_its_own_sequence() {
        let ps = step();
        let inp = inputs_of(&ps);
        let r = reads_of(&inp, &hypotheses(&ps)[0]);
        assert_eq!(keys(&r[4]), [0, 1, 2, 3, 4].map(Some));
        assert_eq!(keys(&r[7]), [5, 6, 7].map(Some));
    }

    #[test]
    fn each_hypothesis_moves_the_reads_as_its_mechanism_does() {
        let ps = step();
        let inp = inputs_of(&ps);
        let hyp = |write, read| Hyp { page: 2, write, read };
        // Page size 1: position j reads slot table[j] (past the row: block 0's slot 0, which
        // holds sequence 1's position 0, key 5).
        let r = reads_of(&inp, &hyp(Write::Table, Read::Page(1)));
        // Slot 4 = block 2 offset 0: nobody; slot 1 = block 0 offset 1: seq 1 pos 1 (key 6);
        // slot 6 = block 3 offset 0: seq 1 pos 2 (key 7); then block 0 (padding) → slot 0.
        assert_eq!(keys(&r[4]), [None, Some(6), Some(7), Some(5), Some(5)]);
        // Block table +1: block 1 for positions 0-1, block 6 for 2-3, padding block 0 for 4.
        let r = reads_of(&inp, &hyp(Write::Table, Read::BlockShift(1)));
        assert_eq!(keys(&r[4]), [Some(2), Some(3), Some(4), None, Some(5)]);
        // Sequence +1's row for sequence 0, none for the last sequence.
        let r = reads_of(&inp, &hyp(Write::Table, Read::SeqShift(1)));
        assert_eq!(keys(&r[2]), [5, 6, 7].map(Some));
        assert!(r[7].is_none());
        // Written one slot early: position j reads what position j+1 wrote.
        // Slots 8, 9, 2, 3, 12 then hold keys 1, –, 3, –, – (slot 0's row, key 5, is dropped).
        let r = reads_of(&inp, &hyp(Write::Shift(-1), Read::Table));
        assert_eq!(keys(&r[4]), [Some(1), None, Some(3), None, None]);
    }

    #[test]
    fn a_recorded_slot_mapping_is_written_where_it_says() {
        let mut ps = step();
        // Position 0 of sequence 0 recorded at slot 13 (block 6, offset 1), position 1 not
        // written (−1), position 2 where its table says.
        ps.writes[0].slot = Some(13);
        ps.writes[1].slot = Some(-1);
        ps.writes[2].slot = Some(2);
        let inp = inputs_of(&ps);
        let hs = hypotheses(&ps);
        assert!(hs.contains(&Hyp {
            page: 2,
            write: Write::Recorded,
            read: Read::Table
        }));
        let r = reads_of(
            &inp,
            &Hyp {
                page: 2,
                write: Write::Recorded,
                read: Read::Table,
            },
        );
        // Slots 8 and 9 were never written.
        assert_eq!(keys(&r[3]), [None, None, Some(2), Some(3)]);
        assert_eq!(recorded_mismatch(&ps, 2), (2, 3));
    }

    #[test]
    fn without_tables_the_recorded_slots_or_the_allocation_order_give_them() {
        let mut ps = step();
        ps.block_tables = None;
        assert_eq!(tables(&ps, 2), vec![vec![0, 1, 2], vec![3, 4]]);
        for w in &mut ps.writes {
            w.slot = Some(10 * w.seq as i64 + w.pos as i64 + 20);
        }
        assert_eq!(tables(&ps, 2), vec![vec![10, 11, 12], vec![15, 16]]);
    }
}
