//! The chunked-context prefill path (vLLM `_compute_prefill_context`): new tokens attend to their
//! cached context chunk by chunk and to themselves, the partial states merged by LSE.

use super::*;
use crate::compute::faults::FaultSet;
use std::ops::Range;

/// Per sequence of the chunked path: (context length, new tokens).
pub fn chunked_split(batch: &Batch, new_tokens: usize) -> Vec<(usize, usize)> {
    batch
        .seqs
        .iter()
        .map(|s| {
            let new = new_tokens.clamp(1, s.len.max(1)).min(s.len);
            (s.len - new, new)
        })
        .collect()
}

/// Chunked prefill (vLLM `_compute_prefill_context` + `_forward_prefill`) on one rank.
///
/// Phase 1 (an earlier step): each sequence's context tokens are prefilled causally and their
/// latent rows written to the paged cache. Phase 2: the new tokens attend to the cached context
/// in chunks of `chunk_size` positions across the whole batch (a sequence whose context is
/// shorter than a chunk's start has no keys there: LSE −inf), each chunk's K/V re-expanded from
/// the cache through `kv_b_proj`, then to themselves causally; all partials are merged by LSE.
pub(super) fn chunked_rank<O: Ops>(
    a: &RankAttn<'_, O>,
    batch: &Batch,
    empty_rows: &mut BTreeSet<usize>,
    notes: &mut Vec<String>,
) -> Result<RankOut<O::Buf>> {
    let t = batch.n_tokens();
    let [_, _, p, r, v] = a.cfg.dims().nlprv();
    let nh = a.nh;
    let ops = a.ops;
    let f = &a.opts.faults;
    let split = chunked_split(batch, a.opts.new_tokens);
    let offsets = batch.offsets();
    let seqs = ChunkedSeqs {
        split: &split,
        offsets: &offsets,
    };
    let (k_nope, vv) = a.expand_kv(a.kv_c_normed, t)?;
    let qf = a.full_q(t)?;
    let kf = a.full_k(&k_nope, a.k_pe_roped, t)?;
    let full = FullQkv { q: &qf, k: &kf, v: &vv };
    let mut result = ops.canary(t * nh * v)?;
    let mut lse = ops.canary(t * nh)?;

    // Phase 1: context tokens, causal, and into the cache.
    let cs = prefill_context(a, batch, seqs, full, &mut result, &mut lse)?;

    // Phase 2: the new tokens, packed [T_new, nh, ·].
    let new_rows: Vec<usize> = split
        .iter()
        .zip(&offsets)
        .flat_map(|(&(c, n), &off)| off + c..off + c + n)
        .collect();
    let t_new = new_rows.len();
    let qn = ops.gather_rows(&qf, nh * (p + r), &new_rows)?;
    let max_ctx = split.iter().map(|x| x.0).max().unwrap_or(0);
    let chunk = a.opts.chunk_size.max(1);
    let n_chunks = max_ctx.div_ceil(chunk);
    let empty = if f.has(Fault::UnwrittenRows) {
        EmptyRows::Skip
    } else if f.has(Fault::LsePlusInf) {
        EmptyRows::ZeroPlusInf
    } else {
        EmptyRows::ZeroMinusInf
    };
    let k_parts = n_chunks + 1;
    let mut parts = ops.canary(k_parts * t_new * nh * v)?;
    let mut lses = ops.canary(k_parts * t_new * nh)?;
    let mut skipped = 0usize;
    for (ci, c0) in (0..max_ctx).step_by(chunk).enumerate() {
        let ck = context_chunk_keys(a, &cs, seqs, c0..c0 + chunk, empty_rows);
        skipped += ck.skipped;
        let (po, pl) = context_chunk_attention(a, &cs, &qn, t_new, &ck, empty)?;
        ops.copy2d(&po, &mut parts, copy_span_to(t_new * nh * v, ci * t_new * nh * v))?;
        ops.copy2d(&pl, &mut lses, copy_span_to(t_new * nh, ci * t_new * nh))?;
    }
    notes.extend(empty_row_fault_note(f, skipped));
    let (so, sl) = new_tokens_attention(a, seqs, full, &qn, &new_rows)?;
    ops.copy2d(&so, &mut parts, copy_span_to(t_new * nh * v, n_chunks * t_new * nh * v))?;
    ops.copy2d(&sl, &mut lses, copy_span_to(t_new * nh, n_chunks * t_new * nh))?;
    // merge_attn_states over all partials.
    let (mo, ml) = ops.merge(&parts, &lses, k_parts, t_new, nh, v)?;
    ops.scatter_rows(&mut result, &mo, nh * v, &new_rows)?;
    ops.scatter_rows(&mut lse, &ml, nh, &new_rows)?;
    a.expanded_out(t, result, lse, k_nope, vv)
}

/// The batch as the chunked path splits it: per sequence (context length, new tokens) and the
/// sequence's first row in the packed token order.
#[derive(Clone, Copy)]
struct ChunkedSeqs<'s> {
    split: &'s [(usize, usize)],
    offsets: &'s [usize],
}

/// The whole batch's full-width heads: Q and K `[T, nh, qk_nope_head_dim + qk_rope_head_dim]`,
/// V `[T, nh, v_head_dim]`, f32.
struct FullQkv<'b, B> {
    q: &'b B,
    k: &'b B,
    v: &'b B,
}

impl<B> Clone for FullQkv<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B> Copy for FullQkv<'_, B> {}

/// The context's prefill of an earlier step (vLLM `_forward_prefill` over the context tokens):
/// each sequence's context attends causally to itself, its output and LSE written into `result`
/// and `lse`, and its latent rows (`kv_c_normed` ‖ `k_pe`) land in a fresh paged cache
/// (vLLM `concat_and_cache_mla`), which is returned.
fn prefill_context<O: Ops>(
    a: &RankAttn<'_, O>,
    batch: &Batch,
    seqs: ChunkedSeqs<'_>,
    full: FullQkv<'_, O::Buf>,
    result: &mut O::Buf,
    lse: &mut O::Buf,
) -> Result<CacheState<O::Buf>> {
    let ctx_seqs: Vec<(usize, usize)> = seqs
        .split
        .iter()
        .zip(seqs.offsets)
        .filter(|(x, _)| x.0 > 0)
        .map(|(x, &off)| (off, x.0))
        .collect();
    a.causal_into(full.q, full.k, full.v, &ctx_seqs, result, lse)?;
    let mut cs = CacheState::new(a.ops, batch, a.cfg, a.opts)?;
    let (mut rows, mut seq_ids, mut pos) = (Vec::new(), Vec::new(), Vec::new());
    for (si, (&(c, _), &off)) in seqs.split.iter().zip(seqs.offsets).enumerate() {
        for i in 0..c {
            rows.push(off + i);
            seq_ids.push(si);
            pos.push(i);
        }
    }
    cs.write(a, &rows, &seq_ids, &pos)?;
    Ok(cs)
}

/// One context chunk's keys (vLLM `_compute_prefill_context`, one iteration): the cache slots of
/// positions `window` of every sequence's context, gathered once per chunk, and the attention
/// segments reading them: per sequence its new tokens over the sequence's slots, or with a DSA
/// selection per new token its kept keys among them, read by index (the third value, indices
/// into the slots). Rows left with no key are added to `empty_rows` and counted in the fourth.
fn context_chunk_keys<O: Ops>(
    a: &RankAttn<'_, O>,
    cs: &CacheState<O::Buf>,
    seqs: ChunkedSeqs<'_>,
    window: Range<usize>,
    empty_rows: &mut BTreeSet<usize>,
) -> ChunkKeys {
    let mut ck = ChunkKeys {
        slots: Vec::new(),
        segs: Vec::new(),
        key_rows: a.sel.map(|_| Vec::new()),
        skipped: 0,
    };
    let mut q_off = 0;
    for (si, &(c, n)) in seqs.split.iter().enumerate() {
        let keys = window.start.min(c)..window.end.min(c);
        let k_off = ck.slots.len();
        ck.slots.extend(keys.clone().map(|pos| cs.read_slot(si, pos)));
        if let (Some(sel), Some(key_rows)) = (a.sel, ck.key_rows.as_mut()) {
            // DSA: each new token reads only its kept keys of this chunk.
            for j in 0..n {
                let row = seqs.offsets[si] + c + j;
                let first = key_rows.len();
                key_rows.extend(
                    sel.rows[row]
                        .iter()
                        .filter(|p| keys.contains(p))
                        .map(|&p| k_off + (p - keys.start)),
                );
                if key_rows.len() == first {
                    ck.skipped += 1;
                    empty_rows.insert(row);
                }
                ck.segs.push(Segment {
                    q_off: q_off + j,
                    q_len: 1,
                    k_off: first,
                    k_len: key_rows.len() - first,
                    causal: false,
                });
            }
            q_off += n;
            continue;
        }
        if keys.is_empty() {
            ck.skipped += n;
            for j in 0..n {
                empty_rows.insert(seqs.offsets[si] + c + j);
            }
        }
        ck.segs.push(Segment {
            q_off,
            q_len: n,
            k_off,
            k_len: keys.len(),
            causal: false,
        });
        q_off += n;
    }
    if ck.slots.is_empty() {
        // No sequence has context in this chunk: one written slot, never read, keeps the gather
        // non-empty.
        if let Some(si) = seqs.split.iter().position(|x| x.0 > 0) {
            ck.slots.push(cs.slot(si, 0));
        }
    }
    ck
}

/// The keys of one context chunk ([`context_chunk_keys`]).
struct ChunkKeys {
    /// The cache slots of the chunk's positions, every sequence's in turn: the chunk's K/V rows.
    slots: Vec<usize>,
    /// One segment per sequence's new tokens, or per new token with a DSA selection.
    segs: Vec<Segment>,
    /// With a DSA selection, the rows of the chunk's K/V each new token keeps, indexed by its
    /// segment ([`PrefillArgs::key_rows`]).
    key_rows: Option<Vec<usize>>,
    /// New-token rows with no key in this chunk.
    skipped: usize,
}

/// One context chunk's attention (vLLM `_run_prefill_context_chunk`): the chunk's latent rows
/// gathered from the cache, split into `kv_c_normed` and `k_pe`, re-expanded through `kv_b_proj`
/// once, and attended by the `t_new` new tokens `qn` over the chunk's segments (with a DSA
/// selection, each token's kept rows by index). Returns the partial output
/// `[t_new, nh, v_head_dim]` and its LSE `[t_new, nh]`, f32.
fn context_chunk_attention<O: Ops>(
    a: &RankAttn<'_, O>,
    cs: &CacheState<O::Buf>,
    qn: &O::Buf,
    t_new: usize,
    ck: &ChunkKeys,
    empty: EmptyRows,
) -> Result<(O::Buf, O::Buf)> {
    let [_, l, p, r, v] = a.cfg.dims().nlprv();
    let (nh, ops) = (a.nh, a.ops);
    let nk = ck.slots.len();
    let rows_c = ops.gather_rows(&cs.cache, cs.width, &ck.slots)?;
    let mut kv_c = ops.canary(nk * l)?;
    ops.copy2d(&rows_c, &mut kv_c, copy_rows(nk, l).src(0, cs.width).dst(0, l))?;
    let mut kpe = ops.canary(nk * r)?;
    ops.copy2d(&rows_c, &mut kpe, copy_rows(nk, r).src(l, cs.width).dst(0, r))?;
    let (ck_nope, cv) = a.expand_kv(&kv_c, nk)?;
    let ckf = a.full_k(&ck_nope, &kpe, nk)?;
    let mut po = ops.canary(t_new * nh * v)?;
    let mut pl = ops.canary(t_new * nh)?;
    ops.flash_attention(
        &PrefillArgs {
            q: qn,
            k: &ckf,
            v: &cv,
            nh,
            dqk: p + r,
            dv: v,
            segments: &ck.segs,
            scale: a.scale,
            empty,
            key_rows: ck.key_rows.as_deref(),
        },
        &mut po,
        &mut pl,
    )?;
    Ok((po, pl))
}

/// The empty-row faults' note, each in its own words: unwritten-rows skips the rows with no
/// context key, lse-plus-inf writes them with the wrong sentinel. `None` without either fault.
fn empty_row_fault_note(f: &FaultSet, skipped: usize) -> Option<String> {
    if !(f.has(Fault::UnwrittenRows) || f.has(Fault::LsePlusInf)) {
        return None;
    }
    let (acted, fault) = if f.has(Fault::UnwrittenRows) {
        (
            "were skipped: their output and LSE keep the canary (unwritten-rows)",
            "the unwritten-rows fault",
        )
    } else {
        (
            "got output 0 with LSE = +inf instead of −inf, the empty partial's wrong sentinel (lse-plus-inf)",
            "the lse-plus-inf fault",
        )
    };
    Some(if skipped > 0 {
        format!("{skipped} (new token, chunk) rows had no context keys and {acted}")
    } else {
        format!(
            "no context chunk was empty for any row: {fault} had nothing to act on (use several --seqs of different lengths)"
        )
    })
}

/// The new tokens among themselves (vLLM `_run_prefill_new_tokens`): causal within each
/// sequence (DSA: each row's kept keys among them). Returns the partial output
/// `[T_new, nh, v_head_dim]` and its LSE `[T_new, nh]`, f32.
fn new_tokens_attention<O: Ops>(
    a: &RankAttn<'_, O>,
    seqs: ChunkedSeqs<'_>,
    full: FullQkv<'_, O::Buf>,
    qn: &O::Buf,
    new_rows: &[usize],
) -> Result<(O::Buf, O::Buf)> {
    let [_, _, p, r, v] = a.cfg.dims().nlprv();
    let (nh, ops) = (a.nh, a.ops);
    if a.sel.is_some() {
        let keys: Vec<Vec<usize>> = seqs
            .split
            .iter()
            .zip(seqs.offsets)
            .flat_map(|(&(c, n), &off)| (c..c + n).map(move |i| (off, c, i)))
            .map(|(off, c, i)| a.kept(off + i, off, c..i + 1))
            .collect();
        return a.sparse_rows(full.q, new_rows, full.k, full.v, &keys, EmptyRows::ZeroMinusInf);
    }
    let t_new = new_rows.len();
    let sk = ops.gather_rows(full.k, nh * (p + r), new_rows)?;
    let sv = ops.gather_rows(full.v, nh * v, new_rows)?;
    let mut q_off = 0;
    let suffix: Vec<(usize, usize)> = seqs
        .split
        .iter()
        .map(|&(_, n)| {
            let s = (q_off, n);
            q_off += n;
            s
        })
        .collect();
    let mut so = ops.canary(t_new * nh * v)?;
    let mut sl = ops.canary(t_new * nh)?;
    ops.flash_attention(
        &PrefillArgs {
            q: qn,
            k: &sk,
            v: &sv,
            nh,
            dqk: p + r,
            dv: v,
            segments: &RankAttn::<O>::causal_segments(&suffix),
            scale: a.scale,
            empty: EmptyRows::ZeroMinusInf,
            key_rows: None,
        },
        &mut so,
        &mut sl,
    )?;
    Ok((so, sl))
}
