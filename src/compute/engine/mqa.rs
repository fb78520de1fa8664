//! The absorbed MQA decode path (vLLM `forward_mqa`): queries absorbed through `W_UK_T`, split-KV
//! attention over the paged latent cache, partials merged by LSE, output through `W_UV`.

use super::*;
use crate::core::fp8::KvCacheQuant;

/// The decode queries of one launch: `qrow` holds `[ql_nope | q_pe]` [rows, nh, L+R] of the
/// packed rows `q_first..`, and `rows` names the packed rows to decode (each ≥ `q_first`).
pub(super) struct DecodeQueries<'q, B> {
    /// `[ql_nope | q_pe]` [rows, nh, L+R], f32.
    pub(super) qrow: &'q B,
    /// The packed row of `qrow`'s first row.
    pub(super) q_first: usize,
    /// The packed rows to decode.
    pub(super) rows: &'q [usize],
}

/// `fp8-query-unscaled`: the decode query cast to E4M3 without the division by q_scale, read by
/// a kernel that multiplies by q_scale: `Q·e4m3(x)` for each element.
fn unscaled_query<O: Ops>(ops: &O, q: &O::Buf, c: &KvCacheQuant) -> Result<O::Buf> {
    let qs = c.query.unwrap_or(1.0);
    let cast = KvCacheQuant { query: Some(1.0), ..*c };
    let v = ops.download(&ops.fp8_query_rows(q, &cast)?)?;
    ops.adopt(v.into_iter().map(|x| (f64::from(x) * qs) as f32).collect())
}

/// Split-KV absorbed decode of the `queries` rows of sequences `seqs` with context lengths
/// `ctx`: stage 1 writes `splits` partials, stage 2 merges them. Returns (latent [n, nh, L],
/// lse [n, nh]) and records rows that merged an empty split.
pub(super) fn decode_rows<O: Ops>(
    a: &RankAttn<'_, O>,
    cs: &CacheState<O::Buf>,
    queries: &DecodeQueries<'_, O::Buf>,
    seqs: &[usize],
    ctx: &[usize],
    empty_rows: &mut BTreeSet<usize>,
) -> Result<(O::Buf, O::Buf)> {
    let (qrow, q_first, rows) = (queries.qrow, queries.q_first, queries.rows);
    let (l, r, nh) = (a.cfg.kv_lora_rank, a.cfg.qk_rope_head_dim, a.nh);
    let splits = a.opts.num_splits.max(1);
    let n = rows.len();
    let local: Vec<usize> = rows.iter().map(|&row| row - q_first).collect();
    let mut q = a.ops.gather_rows(qrow, nh * (l + r), &local)?;
    // A kernel that takes an fp8 query reads `ql_nope ‖ q_pe` rounded with q_scale.
    if let Some(c) = a.opts.kv_cache.as_ref().filter(|c| c.query.is_some()) {
        q = match a.opts.faults.has(Fault::Fp8QueryUnscaled) {
            true => unscaled_query(a.ops, &q, c)?,
            false => a.ops.fp8_query_rows(&q, c)?,
        };
    }
    // The tables and block size the kernel reads with (a paged-cache fault's, under one).
    let tables: Vec<Vec<usize>> = seqs.iter().zip(ctx).map(|(&s, &c)| cs.read_table(s, c).0).collect();
    let empty_lse = if a.opts.faults.has(Fault::LsePlusInf) {
        f32::INFINITY
    } else {
        f32::NEG_INFINITY
    };
    for (&row, &c) in rows.iter().zip(ctx) {
        let sl = c.div_ceil(splits);
        if (0..splits).any(|s| (s * sl).min(c) == ((s + 1) * sl).min(c)) {
            empty_rows.insert(row);
        }
    }
    let args = DecodeArgs {
        q: &q,
        n,
        nh,
        cache: &cs.cache,
        block_size: cs.read_block_size(),
        width: cs.width,
        tables: &tables,
        ctx,
        splits,
        dv: l,
        scale: a.scale,
        empty_lse,
    };
    match a.opts.faults.split_fault() {
        Some(f) => decode_merged_faulted(a.ops, &args, f, a.opts.seed ^ rows.first().map_or(0, |&r| r as u64)),
        None => a.ops.decode_merged(&args),
    }
}

/// [`decode_rows`] over the DSA selection: each row's kept cache slots (`slots[i]`) are gathered
/// into a compact paged cache, one run of pages per row, and decoded there (FlashMLA's sparse
/// decode reads the same rows through the indexer's indices).
pub(super) fn decode_rows_sparse<O: Ops>(
    a: &RankAttn<'_, O>,
    cs: &CacheState<O::Buf>,
    queries: &DecodeQueries<'_, O::Buf>,
    slots: &[Vec<usize>],
    empty_rows: &mut BTreeSet<usize>,
) -> Result<(O::Buf, O::Buf)> {
    let rows = queries.rows;
    let bs = cs.block_size;
    let mut gather = Vec::new();
    let mut tables = Vec::with_capacity(rows.len());
    for sl in slots {
        let pages = sl.len().div_ceil(bs).max(1);
        let first = gather.len() / bs;
        tables.push((first..first + pages).collect::<Vec<usize>>());
        let pad = sl.first().copied().unwrap_or(0);
        gather.extend(sl.iter().copied());
        gather.extend(std::iter::repeat_n(pad, pages * bs - sl.len()));
    }
    let compact = CacheState {
        cache: a.ops.gather_rows(&cs.cache, cs.width, &gather)?,
        tables,
        block_size: bs,
        width: cs.width,
        mode: CacheFault::None,
    };
    let idx: Vec<usize> = (0..rows.len()).collect();
    let ctx: Vec<usize> = slots.iter().map(Vec::len).collect();
    decode_rows(a, &compact, queries, &idx, &ctx, empty_rows)
}

/// The cache slots of the keys row `row` (sequence `seq`, first packed row `off`) keeps among
/// key indices `0..ctx` (all of them without an indexer).
pub(super) fn kept_slots<O: Ops>(
    a: &RankAttn<'_, O>,
    cs: &CacheState<O::Buf>,
    row: usize,
    seq: usize,
    ctx: usize,
) -> Vec<usize> {
    match a.sel {
        Some(sel) => sel.rows[row]
            .iter()
            .filter(|&&j| j < ctx)
            .map(|&j| cs.read_slot(seq, j))
            .collect(),
        None => (0..ctx).map(|j| cs.read_slot(seq, j)).collect(),
    }
}

/// Decode queries per launch of the absorbed path ([`mqa_rank`]).
const DECODE_ROWS: usize = 128;

/// Absorbed decode (vLLM `forward_mqa`) of every token of the batch: each token writes its
/// latent row into the paged cache and is decoded against positions 0..=i of its sequence, as
/// the decode step at its position would; the rows go in batches of [`DECODE_ROWS`].
pub(super) fn mqa_rank<O: Ops>(
    a: &RankAttn<'_, O>,
    batch: &Batch,
    empty_rows: &mut BTreeSet<usize>,
) -> Result<RankOut<O::Buf>> {
    let t = batch.n_tokens();
    let [_, l, _, r, v] = a.cfg.dims().nlprv();
    let nh = a.nh;
    let ops = a.ops;
    let ql_nope = if a.opts.faults.has(Fault::Fp16AccumQlNope) {
        a.absorb_q_f16_accum(t)?
    } else {
        a.absorb_q(t)?
    };
    let mut cs = CacheState::new(ops, batch, a.cfg, a.opts)?;
    let mut attn_latent = ops.canary(t * nh * l)?;
    let mut lse = ops.canary(t * nh)?;
    // Every token is a decode query over its own sequence's positions 0..=i: one decode batch of
    // T rows, each with its own context length, as an engine batches the decode steps of many
    // sequences. The whole cache is written first; a row reads only the slots below its context
    // length, so it sees what a decode step at its position would, and the kernels compute each
    // row on its own (same splits, same order), so the values are those of T single-row steps,
    // in a few launches instead of T (4096 steps took 1.5 s of launches on an H200). Rows go in
    // blocks of [`DECODE_ROWS`] so the split partials ([splits, rows, nh, L]) and the queries
    // `[ql_nope | q_pe]` ([rows, nh, L+R]) stay small.
    let offsets = batch.offsets();
    let (mut rows, mut seqs, mut pos) = (Vec::with_capacity(t), Vec::with_capacity(t), Vec::with_capacity(t));
    for (s, (sq, off)) in batch.seqs.iter().zip(&offsets).enumerate() {
        for i in 0..sq.len {
            rows.push(off + i);
            seqs.push(s);
            pos.push(i);
        }
    }
    cs.write(a, &rows, &seqs, &pos)?;
    for b in (0..rows.len()).step_by(DECODE_ROWS) {
        let e = (b + DECODE_ROWS).min(rows.len());
        let (rows, seqs, pos) = (&rows[b..e], &seqs[b..e], &pos[b..e]);
        // The packed rows are 0..T in order, so this block's queries are rows b..e.
        let n = e - b;
        let mut qrow = ops.canary(n * nh * (l + r))?;
        ops.copy2d(
            &ql_nope,
            &mut qrow,
            copy_rows(n * nh, l).src(b * nh * l, l).dst(0, l + r),
        )?;
        ops.copy2d(
            a.q_pe_roped,
            &mut qrow,
            copy_rows(n * nh, r).src(b * nh * r, r).dst(l, l + r),
        )?;
        let queries = DecodeQueries {
            qrow: &qrow,
            q_first: b,
            rows,
        };
        let (lat, ls) = if a.sel.is_some() {
            let slots: Vec<Vec<usize>> = rows
                .iter()
                .zip(seqs)
                .zip(pos)
                .map(|((&row, &s), &i)| kept_slots(a, &cs, row, s, i + 1))
                .collect();
            decode_rows_sparse(a, &cs, &queries, &slots, empty_rows)?
        } else {
            let ctx: Vec<usize> = pos.iter().map(|&i| i + 1).collect();
            decode_rows(a, &cs, &queries, seqs, &ctx, empty_rows)?
        };
        ops.scatter_rows(&mut attn_latent, &lat, nh * l, rows)?;
        ops.scatter_rows(&mut lse, &ls, nh, rows)?;
    }
    let result = ops.bmm_heads(&attn_latent, t, nh, l, &a.rw.w_uv, v)?;
    Ok(RankOut {
        out: a.deliver(result, t * nh * v)?,
        lse,
        k_nope: None,
        v: None,
        ql_nope: Some(ql_nope),
        attn_latent: Some(attn_latent),
    })
}
