//! The expanded MHA prefill path (vLLM `forward_mha`): K and V expanded through `kv_b_proj`,
//! causal attention with LSE; with a DSA selection, each token attends over its kept keys, read
//! by index ([`RankAttn::sparse_rows`]).

use super::*;

/// Expanded prefill (vLLM `forward_mha`) on one rank: K/V through `kv_b_proj`, tiled causal
/// attention over each sequence.
pub(super) fn mha_rank<O: Ops>(a: &RankAttn<'_, O>, batch: &Batch) -> Result<RankOut<O::Buf>> {
    let t = batch.n_tokens();
    let (p, r, v, nh) = (a.cfg.qk_nope_head_dim, a.cfg.qk_rope_head_dim, a.cfg.v_head_dim, a.nh);
    let ops = a.ops;
    let (k_nope, vv) = a.expand_kv(a.kv_c_normed, t)?;
    let qf = a.full_q(t)?;
    let kf = a.full_k(&k_nope, a.k_pe_roped, t)?;
    let seqs: Vec<(usize, usize)> = batch
        .offsets()
        .into_iter()
        .zip(batch.seqs.iter().map(|s| s.len))
        .collect();
    let (result, lse) = if a.sel.is_some() {
        let rows: Vec<usize> = (0..t).collect();
        let keys: Vec<Vec<usize>> = seqs
            .iter()
            .flat_map(|&(off, len)| (0..len).map(move |i| (off, i)))
            .map(|(off, i)| a.kept(off + i, off, 0..i + 1))
            .collect();
        a.sparse_rows(&qf, &rows, &kf, &vv, &keys, EmptyRows::ZeroMinusInf)?
    } else {
        let mut result = ops.canary(t * nh * v)?;
        let mut lse = ops.canary(t * nh)?;
        ops.flash_attention(
            &PrefillArgs {
                q: &qf,
                k: &kf,
                v: &vv,
                nh,
                dqk: p + r,
                dv: v,
                segments: &RankAttn::<O>::causal_segments(&seqs),
                scale: a.scale,
                empty: EmptyRows::ZeroMinusInf,
                key_rows: None,
            },
            &mut result,
            &mut lse,
        )?;
        (result, lse)
    };
    a.expanded_out(t, result, lse, k_nope, vv)
}
