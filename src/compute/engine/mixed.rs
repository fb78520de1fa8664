//! The mixed batch: decode tokens first, prefill tokens after, each part through its own path,
//! written into one caller-allocated output (vLLM's MLA batch split).

use super::*;

/// Which sequences of a mixed batch are decodes: the first ⌈S/2⌉ (vLLM puts decodes first).
pub fn mixed_decode_seqs(batch: &Batch) -> usize {
    batch.seqs.len().div_ceil(2)
}

/// A mixed batch (vLLM `MLACommonImpl.forward`) on one rank. Earlier steps prefilled every
/// decode sequence except its last token (into the cache). This step's packed batch is
/// `[one decode token per decode sequence | every token of the prefill sequences]`; decode rows
/// `[:num_decodes]` go through the absorbed path, the rest through the expanded path, and both
/// write into ONE caller-allocated output by row offset.
pub(super) fn mixed_rank<O: Ops>(
    a: &RankAttn<'_, O>,
    batch: &Batch,
    empty_rows: &mut BTreeSet<usize>,
) -> Result<RankOut<O::Buf>> {
    let t = batch.n_tokens();
    let [_, _, p, r, v] = a.cfg.dims().nlprv();
    let nh = a.nh;
    let ops = a.ops;
    let n_dec = mixed_decode_seqs(batch);
    let offsets = batch.offsets();
    let (k_nope, vv) = a.expand_kv(a.kv_c_normed, t)?;
    let qf = a.full_q(t)?;
    let kf = a.full_k(&k_nope, a.k_pe_roped, t)?;
    let mut result = ops.canary(t * nh * v)?;
    let mut lse = ops.canary(t * nh)?;

    // Earlier steps: decode sequences' tokens before the last, causal, and into the cache.
    let early: Vec<(usize, usize)> = (0..n_dec)
        .filter(|&si| batch.seqs[si].len > 1)
        .map(|si| (offsets[si], batch.seqs[si].len - 1))
        .collect();
    a.causal_into(&qf, &kf, &vv, &early, &mut result, &mut lse)?;
    let mut cs = CacheState::new(ops, batch, a.cfg, a.opts)?;
    let (mut rows, mut seqs, mut pos) = (Vec::new(), Vec::new(), Vec::new());
    for si in 0..n_dec {
        for i in 0..batch.seqs[si].len {
            rows.push(offsets[si] + i);
            seqs.push(si);
            pos.push(i);
        }
    }
    cs.write(a, &rows, &seqs, &pos)?;

    // This step. Packed step rows: decode tokens first, then prefill tokens.
    let dec_rows: Vec<usize> = (0..n_dec).map(|si| offsets[si] + batch.seqs[si].len - 1).collect();
    let pre_rows: Vec<usize> = (n_dec..batch.seqs.len())
        .flat_map(|si| offsets[si]..offsets[si] + batch.seqs[si].len)
        .collect();
    let step_rows: Vec<usize> = dec_rows.iter().chain(&pre_rows).copied().collect();
    let n_step = step_rows.len();
    let mut step_out = ops.canary(n_step * nh * v)?; // the caller-allocated output of the step
    let mut step_lse = ops.canary(n_step * nh)?;

    // Decode part: rows [0, num_decodes).
    if n_dec > 0 {
        let (dec_out, dec_lse) = mixed_decode_part(a, batch, &cs, &dec_rows, empty_rows)?;
        ops.copy2d(&dec_out, &mut step_out, copy_span_to(n_dec * nh * v, 0))?;
        ops.copy2d(&dec_lse, &mut step_lse, copy_span_to(n_dec * nh, 0))?;
    }
    // Prefill part: rows [num_decodes, n_step), expanded, causal per sequence.
    if !pre_rows.is_empty() && a.sel.is_some() {
        let keys: Vec<Vec<usize>> = (n_dec..batch.seqs.len())
            .flat_map(|si| (0..batch.seqs[si].len).map(move |i| (si, i)))
            .map(|(si, i)| a.kept(offsets[si] + i, offsets[si], 0..i + 1))
            .collect();
        let np = pre_rows.len();
        let (po, pl) = a.sparse_rows(&qf, &pre_rows, &kf, &vv, &keys, EmptyRows::ZeroMinusInf)?;
        ops.copy2d(&po, &mut step_out, copy_span_to(np * nh * v, n_dec * nh * v))?;
        ops.copy2d(&pl, &mut step_lse, copy_span_to(np * nh, n_dec * nh))?;
    } else if !pre_rows.is_empty() {
        let pq = ops.gather_rows(&qf, nh * (p + r), &pre_rows)?;
        let pk = ops.gather_rows(&kf, nh * (p + r), &pre_rows)?;
        let pv = ops.gather_rows(&vv, nh * v, &pre_rows)?;
        let mut q_off = 0;
        let segs: Vec<(usize, usize)> = (n_dec..batch.seqs.len())
            .map(|si| {
                let s = (q_off, batch.seqs[si].len);
                q_off += batch.seqs[si].len;
                s
            })
            .collect();
        let np = pre_rows.len();
        let mut po = ops.canary(np * nh * v)?;
        let mut pl = ops.canary(np * nh)?;
        ops.flash_attention(
            &PrefillArgs {
                q: &pq,
                k: &pk,
                v: &pv,
                nh,
                dqk: p + r,
                dv: v,
                segments: &RankAttn::<O>::causal_segments(&segs),
                scale: a.scale,
                empty: EmptyRows::ZeroMinusInf,
                key_rows: None,
            },
            &mut po,
            &mut pl,
        )?;
        ops.copy2d(&po, &mut step_out, copy_span_to(np * nh * v, n_dec * nh * v))?;
        ops.copy2d(&pl, &mut step_lse, copy_span_to(np * nh, n_dec * nh))?;
    }
    // Scatter the step's rows back to packed token order.
    ops.scatter_rows(&mut result, &step_out, nh * v, &step_rows)?;
    ops.scatter_rows(&mut lse, &step_lse, nh, &step_rows)?;
    // Every invocation of the attention op (earlier steps and this one) has the same contract.
    a.expanded_out(t, result, lse, k_nope, vv)
}

/// The decode part of a mixed step: the last token of each of the first `dec_rows.len()`
/// sequences (packed rows `dec_rows`), absorbed through `W_UK_T` and decoded against the paged
/// cache `cs`, then through `W_UV`. Returns (`attn_out` [n_dec, nh, V], `lse` [n_dec, nh]).
fn mixed_decode_part<O: Ops>(
    a: &RankAttn<'_, O>,
    batch: &Batch,
    cs: &CacheState<O::Buf>,
    dec_rows: &[usize],
    empty_rows: &mut BTreeSet<usize>,
) -> Result<(O::Buf, O::Buf)> {
    let t = batch.n_tokens();
    let [_, l, _, r, v] = a.cfg.dims().nlprv();
    let (nh, ops, n_dec) = (a.nh, a.ops, dec_rows.len());
    let ql_nope = a.absorb_q(t)?;
    let mut qrow = ops.canary(t * nh * (l + r))?;
    ops.copy2d(&ql_nope, &mut qrow, copy_rows(t * nh, l).src(0, l).dst(0, l + r))?;
    ops.copy2d(a.q_pe_roped, &mut qrow, copy_rows(t * nh, r).src(0, r).dst(l, l + r))?;
    let dec_seqs: Vec<usize> = (0..n_dec).collect();
    let ctx: Vec<usize> = dec_seqs.iter().map(|&s| batch.seqs[s].len).collect();
    let queries = DecodeQueries {
        qrow: &qrow,
        q_first: 0,
        rows: dec_rows,
    };
    let (lat, ls) = if a.sel.is_some() {
        let slots: Vec<Vec<usize>> = dec_rows
            .iter()
            .zip(&dec_seqs)
            .zip(&ctx)
            .map(|((&row, &s), &c)| kept_slots(a, cs, row, s, c))
            .collect();
        decode_rows_sparse(a, cs, &queries, &slots, empty_rows)?
    } else {
        decode_rows(a, cs, &queries, &dec_seqs, &ctx, empty_rows)?
    };
    let dec_out = ops.bmm_heads(&lat, n_dec, nh, l, &a.rw.w_uv, v)?;
    Ok((dec_out, ls))
}
