//! The reference of the MHA prefill over cached context, partial by partial.
//!
//! An engine that prefills new tokens after a cached context (vLLM's chunked prefill and
//! prefix-cache hits, `_compute_prefill_context`) does not run one attention over the whole
//! context: it attends each context chunk's keys on its own, merges the chunks by their LSEs,
//! attends the new tokens causally over themselves (the suffix), and merges context and suffix.
//! A bug in any merge is invisible in the final `attn_out` alone, so the reference computes
//! each partial the engine computes, in f64, on the same rows and key ranges: the merge whose
//! inputs pass and whose output fails is then the one at fault.

use std::collections::HashMap;

use crate::core::fp8::{ActQuant, KvCacheQuant};
use crate::core::trace::{Site, Stage, Trace, TraceTensor};
use crate::model::config::MlaConfig;

/// An fp8 latent cache the context chunks are read back from: each context key's
/// `kv_c_normed ‖ k_pe` rounded as the cache holds it, `k_nope`/`v` expanded from the rounded
/// latent through `kv_b_proj` (its input quantized by `act`, when the engine's GEMMs are fp8:
/// per chunk, the rows of every sequence's chunk together, as vLLM's one `kv_b_proj` call per
/// chunk reads them).
#[derive(Debug, Clone, Copy)]
pub struct ContextCache<'a> {
    /// The cache's rounding.
    pub kv: &'a KvCacheQuant,
    /// The quantization of `kv_b_proj`'s input; `None`: read as it is.
    pub act: Option<&'a ActQuant>,
}

/// A context key as the chunk read it back: `k_nope` \[N·P\], `v` \[N·V\], `k_pe` \[R\].
type CachedKey = (Vec<f64>, Vec<f64>, Vec<f64>);

/// Every context key of `seqs` (full-batch rows) as read back from `cache`: needs
/// `kv_c_normed` [T, L], `k_pe_roped` [T, R] and the weight `w.kv_b` [N·(P+V), L] in `full`.
fn cached_keys(
    cfg: &MlaConfig,
    full: &Trace,
    layer: usize,
    seqs: &[ContextSeq],
    cache: ContextCache<'_>,
) -> Option<HashMap<usize, CachedKey>> {
    let [n, l, p, r, dv] = cfg.dims().nlprv();
    let get = |st: Stage| full.get(&Site::new(layer, st));
    let (kvc, kpe, kv_b) = (get(Stage::KvCNormed)?, get(Stage::KPeRoped)?, get(Stage::WKvB)?);
    if kv_b.len() != n * (p + dv) * l {
        return None;
    }
    let n_chunks = seqs.first().map_or(0, |s| s.chunks.len());
    let mut out = HashMap::new();
    for c in 0..n_chunks {
        // The rows of chunk c over every sequence, quantized together (one kv_b call).
        let rows: Vec<usize> = seqs
            .iter()
            .flat_map(|s| {
                let [c0, c1] = s.chunks[c];
                (c0..c1.min(s.context)).map(move |j| s.off + j)
            })
            .filter(|kj| !out.contains_key(kj))
            .collect();
        if rows
            .iter()
            .any(|&kj| (kj + 1) * l > kvc.len() || (kj + 1) * r > kpe.len())
        {
            return None;
        }
        let mut x: Vec<f64> = rows
            .iter()
            .flat_map(|&kj| (0..l).map(move |d| cache.kv.round(kvc.get(kj * l + d))))
            .collect();
        if let Some(a) = cache.act {
            a.quantize(&mut x, l, 1);
        }
        for (i, &kj) in rows.iter().enumerate() {
            let xr = &x[i * l..(i + 1) * l];
            let (mut kn, mut vv) = (Vec::with_capacity(n * p), Vec::with_capacity(n * dv));
            for h in 0..n {
                for o in 0..p + dv {
                    let wr = (h * (p + dv) + o) * l;
                    let y: f64 = xr.iter().enumerate().map(|(d, &xv)| xv * kv_b.get(wr + d)).sum();
                    if o < p { kn.push(y) } else { vv.push(y) }
                }
            }
            let kp = (0..r).map(|d| cache.kv.round(kpe.get(kj * r + d))).collect();
            out.insert(kj, (kn, vv, kp));
        }
    }
    Some(out)
}

/// One sequence of a step's prefill over cached context, as the reference reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContextSeq {
    /// Its index among the dump header's sequences (evidence names it).
    pub seq: usize,
    /// The step's row of its first new token (rows of the step's `[T, …]` sites).
    pub row: usize,
    /// The full-batch row of the sequence's position 0 (rows of the traces given to
    /// [`context_partials`]).
    pub off: usize,
    /// Its cached context (positions `0..context`).
    pub context: usize,
    /// Its new tokens (positions `context..context + new`), the partials' rows.
    pub new: usize,
    /// The context positions `[start, end)` of each chunk (ascending, covering `0..context`;
    /// an empty chunk is `[e, e]`).
    pub chunks: Vec<[usize; 2]>,
}

/// Softmax-weighted sum over the keys `keys` of one query: `(out [V], lse)` from the scaled
/// logits `z` (indexed by key position) and the values `v(j)` \[V\]; no key: `(0, −inf)`.
fn attend(z: &[f64], keys: std::ops::Range<usize>, v: &dyn Fn(usize, usize) -> f64, dv: usize) -> (Vec<f64>, f64) {
    if keys.is_empty() {
        return (vec![0.0; dv], f64::NEG_INFINITY);
    }
    let m = z[keys.clone()].iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = z[keys.clone()].iter().map(|x| (x - m).exp()).collect();
    let sum: f64 = e.iter().sum();
    let out = (0..dv)
        .map(|d| keys.clone().zip(&e).map(|(j, w)| w * v(j, d)).sum::<f64>() / sum)
        .collect();
    (out, m + sum.ln())
}

/// The partials of a step's MHA prefill over cached context at `layer`: `ctx_out.c<c>`
/// [Tc, N, V] and `ctx_lse.c<c>` [Tc, N] for each chunk c over exactly its keys (an empty chunk:
/// 0 and −inf), `ctx_out`/`ctx_lse` over the whole context (what merging the chunks gives),
/// `suffix_out`/`suffix_lse` over the new tokens, causally. The rows (Tc) are the new tokens of
/// `seqs`, in order; `full` is the reference over the step's full batch (each sequence from
/// position 0), whose `q`, `q_pe_roped`, `k_nope`, `k_pe_roped` and `v` it reads (f64, natural
/// log, the model's softmax scale). Every sequence lists the same number of chunks (checked
/// with the dump's header). With `cache`, the context keys are those read back from an fp8
/// cache ([`ContextCache`]; `kv_c_normed`, `k_pe_roped` and `w.kv_b` read from `full` too), the
/// suffix's its own as computed. `None` when `full` lacks one of those sites or their rows do
/// not cover `seqs`.
pub fn context_partials(
    cfg: &MlaConfig,
    full: &Trace,
    layer: usize,
    seqs: &[ContextSeq],
    cache: Option<ContextCache<'_>>,
) -> Option<Trace> {
    let [n, _, p, r, dv] = cfg.dims().nlprv();
    let get = |st: Stage| full.get(&Site::new(layer, st));
    let (q, qpe, kn, kpe, vv) = (
        get(Stage::Q)?,
        get(Stage::QPeRoped)?,
        get(Stage::KNope)?,
        get(Stage::KPeRoped)?,
        get(Stage::V)?,
    );
    let rows = seqs.iter().map(|s| s.off + s.context + s.new).max().unwrap_or(0);
    let fits = |t: &TraceTensor, per: usize| t.len() >= rows * per;
    if !(fits(q, n * (p + r)) && fits(qpe, n * r) && fits(kn, n * p) && fits(kpe, r) && fits(vv, n * dv)) {
        return None;
    }
    let n_chunks = seqs.first().map_or(0, |s| s.chunks.len());
    if seqs.iter().any(|s| s.chunks.len() != n_chunks) {
        return None;
    }
    let cached = match cache {
        Some(c) => Some(cached_keys(cfg, full, layer, seqs, c)?),
        None => None,
    };
    // Key row kj's k_nope[h, d], k_pe[d] and v[h, d]: from the cache for a context key.
    let from_cache = |kj: usize| cached.as_ref().and_then(|m| m.get(&kj));
    let k_nope = |kj: usize, h: usize, d: usize| match from_cache(kj) {
        Some((kn_c, _, _)) => kn_c[h * p + d],
        None => kn.get((kj * n + h) * p + d),
    };
    let k_pe = |kj: usize, d: usize| match from_cache(kj) {
        Some((_, _, kp)) => kp[d],
        None => kpe.get(kj * r + d),
    };
    let tc: usize = seqs.iter().map(|s| s.new).sum();
    let mut chunk_out = vec![vec![0.0; tc * n * dv]; n_chunks];
    let mut chunk_lse = vec![vec![0.0; tc * n]; n_chunks];
    let (mut ctx_out, mut ctx_lse) = (vec![0.0; tc * n * dv], vec![0.0; tc * n]);
    let (mut suf_out, mut suf_lse) = (vec![0.0; tc * n * dv], vec![0.0; tc * n]);
    let mut row = 0;
    for s in seqs {
        for a in 0..s.new {
            let pos = s.context + a;
            let qi = s.off + pos;
            for h in 0..n {
                // Scaled logits of this query against keys 0..=pos of its sequence.
                let z: Vec<f64> = (0..=pos)
                    .map(|j| {
                        let kj = s.off + j;
                        let nope: f64 = (0..p)
                            .map(|d| q.get((qi * n + h) * (p + r) + d) * k_nope(kj, h, d))
                            .sum();
                        let rope: f64 = (0..r).map(|d| qpe.get((qi * n + h) * r + d) * k_pe(kj, d)).sum();
                        (nope + rope) * cfg.softmax_scale
                    })
                    .collect();
                let v = |j: usize, d: usize| match from_cache(s.off + j) {
                    Some((_, vc, _)) => vc[h * dv + d],
                    None => vv.get(((s.off + j) * n + h) * dv + d),
                };
                let at = (row * n + h) * dv;
                for (c, &[c0, c1]) in s.chunks.iter().enumerate() {
                    let (o, l) = attend(&z, c0..c1.min(s.context), &v, dv);
                    chunk_out[c][at..at + dv].copy_from_slice(&o);
                    chunk_lse[c][row * n + h] = l;
                }
                let (o, l) = attend(&z, 0..s.context, &v, dv);
                ctx_out[at..at + dv].copy_from_slice(&o);
                ctx_lse[row * n + h] = l;
                let (o, l) = attend(&z, s.context..pos + 1, &v, dv);
                suf_out[at..at + dv].copy_from_slice(&o);
                suf_lse[row * n + h] = l;
            }
            row += 1;
        }
    }
    let mut tr = Trace::new();
    let site = |st: Stage| Site::new(layer, st);
    for (c, (o, l)) in chunk_out.into_iter().zip(chunk_lse).enumerate() {
        let c = u32::try_from(c).ok()?;
        tr.record(site(Stage::CtxOutChunk(c)), TraceTensor::f64(vec![tc, n, dv], o));
        tr.record(site(Stage::CtxLseChunk(c)), TraceTensor::f64(vec![tc, n], l));
    }
    tr.record(site(Stage::CtxOut), TraceTensor::f64(vec![tc, n, dv], ctx_out));
    tr.record(site(Stage::CtxLse), TraceTensor::f64(vec![tc, n], ctx_lse));
    tr.record(site(Stage::SuffixOut), TraceTensor::f64(vec![tc, n, dv], suf_out));
    tr.record(site(Stage::SuffixLse), TraceTensor::f64(vec![tc, n], suf_lse));
    Some(tr)
}

/// Merges attention partials by their natural-log LSEs, as vLLM's `merge_attn_states` does:
/// `out = Σ_i e^(lse_i − m) out_i / Σ_i e^(lse_i − m)`, `lse = m + ln Σ_i e^(lse_i − m)` with
/// `m = max_i lse_i`; where every partial is −inf (no key at all), `(0, −inf)`. Each of `outs`
/// is `[rows, N, V]` and each of `lses` `[rows, N]` (row-major, the same rows; `dv` = V);
/// returns the merged `[rows, N, V]` and `[rows, N]`. A +inf LSE gives NaN, as the engine's arithmetic does.
pub fn merge_partials(outs: &[&[f64]], lses: &[&[f64]], dv: usize) -> (Vec<f64>, Vec<f64>) {
    let rows_n = lses.first().map_or(0, |l| l.len());
    let mut out = vec![0.0; rows_n * dv];
    let mut lse = vec![f64::NEG_INFINITY; rows_n];
    for i in 0..rows_n {
        let m = lses.iter().map(|l| l[i]).fold(f64::NEG_INFINITY, f64::max);
        if m == f64::NEG_INFINITY {
            continue;
        }
        let w: Vec<f64> = lses.iter().map(|l| (l[i] - m).exp()).collect();
        let sum: f64 = w.iter().sum();
        for d in 0..dv {
            out[i * dv + d] = outs.iter().zip(&w).map(|(o, wi)| wi * o[i * dv + d]).sum::<f64>() / sum;
        }
        lse[i] = m + sum.ln();
    }
    (out, lse)
}
