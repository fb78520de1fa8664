//! The layer's prologue, shared by every path: norms, the query and latent projections, RoPE with
//! the engine's cos/sin cache, and the DSA indexer's selection.

use super::*;
use crate::compute::faults::{STALE_ROW_FACTOR, padded_rows};
use crate::core::fp8::{ActGranularity, ActQuant};
use crate::model::config::{IndexerConfig, RopeStyle};

/// Inverse RoPE frequencies with YaRN, computed the way vLLM's `DeepseekScalingRotaryEmbedding`
/// does (correction range from beta_fast/beta_slow, linear ramp, interpolation blend).
pub(super) fn engine_inv_freq(cfg: &MlaConfig) -> Vec<f64> {
    let r = cfg.qk_rope_head_dim as f64;
    let base = cfg.rope_base;
    let half = cfg.qk_rope_head_dim / 2;
    // LongRoPE factors (MiniCPM3) divide each pair's frequency, as llama.cpp's rope_factors do.
    let factor = |i: usize| cfg.rope_factors.as_ref().and_then(|v| v.get(i)).copied().unwrap_or(1.0);
    let extrapolation: Vec<f64> = (0..half)
        .map(|i| 1.0 / (base.powf(2.0 * i as f64 / r) * factor(i)))
        .collect();
    let Some(y) = cfg.yarn else { return extrapolation };
    let correction_dim =
        |rot: f64| (r * (y.original_context / (rot * 2.0 * std::f64::consts::PI)).ln()) / (2.0 * base.ln());
    let low = correction_dim(y.beta_fast).floor().max(0.0);
    let high = correction_dim(y.beta_slow).ceil().min(r - 1.0);
    let high = if low == high { high + 0.001 } else { high };
    (0..half)
        .map(|i| {
            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
            let extrapolation_mask = 1.0 - ramp;
            let interp = extrapolation[i] / y.factor;
            interp * (1.0 - extrapolation_mask) + extrapolation[i] * extrapolation_mask
        })
        .collect()
}

/// The cos/sin table `[rows, R/2]` for the given positions (one row per token, as an engine
/// gathers rows of its `cos_sin_cache` by position): angles formed in f64, rounded to f32 once,
/// times `mscale`.
pub fn cos_sin_table(inv_freq: &[f64], positions: &[usize], mscale: f64) -> (Vec<f32>, Vec<f32>) {
    let mut cos = Vec::with_capacity(positions.len() * inv_freq.len());
    let mut sin = Vec::with_capacity(positions.len() * inv_freq.len());
    for &pos in positions {
        for &f in inv_freq {
            let (s, c) = (pos as f64 * f).sin_cos();
            cos.push((c * mscale) as f32);
            sin.push((s * mscale) as f32);
        }
    }
    (cos, sin)
}

/// The shared MLA prologue's outputs, and each rank's query.
pub(super) struct Prologue<B> {
    /// Per rank: `q` [T, nh, P+R] (q_pe part not yet rotated).
    pub(super) q: Vec<B>,
    /// Per rank: `q_pe_roped` [T, nh, R].
    pub(super) q_pe_roped: Vec<B>,
    /// `kv_c_normed` [T, L].
    pub(super) kv_c_normed: B,
    /// `k_pe_roped` [T, R].
    pub(super) k_pe_roped: B,
    /// The layer input, [T, H].
    pub(super) hidden: B,
    /// `attn_in` [T, H] (the indexer's key and weight input).
    pub(super) attn_in: B,
    /// `q_c_normed` [T, Lq], when the model compresses q (the indexer's query input).
    pub(super) q_c_normed: Option<B>,
    /// `q_c` [T, Lq], when the model compresses q (kept for its site).
    q_c: Option<B>,
    /// `kv_a` [T, L+R] (kept for its site).
    kv_a: B,
    /// `k_pe` [T, R] before RoPE (kept for its site).
    k_pe: B,
}

impl<B> Prologue<B> {
    /// Records the prologue's sites into a path's trace, in the order the prologue computes
    /// them: every path runs on the same prologue (as in an engine, where it precedes the
    /// attention backend), and each path's trace holds its sites.
    pub(super) fn record<O: Ops<Buf = B>>(
        &self,
        ops: &O,
        ew: &EngineWeights<B>,
        input: &LayerInput<'_>,
        tr: &mut Trace,
    ) -> Result<()> {
        let cfg = input.cfg;
        let layer = input.weights.layer;
        let t = input.batch.n_tokens();
        let [n, l, p, r, _] = cfg.dims().nlprv();
        let hd = cfg.dims().hidden;
        record_buf(ops, tr, layer, Stage::HiddenIn, &[t, hd], &self.hidden)?;
        record_buf(ops, tr, layer, Stage::AttnIn, &[t, hd], &self.attn_in)?;
        if let (Some(fused), Some(q_c), Some(q_c_normed)) = (&ew.fused_qkv_a, &self.q_c, &self.q_c_normed) {
            let lq = cfg.q_lora_rank.unwrap_or(0);
            record_buf(ops, tr, layer, Stage::WFusedQkvA, &[lq + l + r, hd], fused)?;
            record_buf(ops, tr, layer, Stage::QC, &[t, lq], q_c)?;
            record_buf(ops, tr, layer, Stage::QCNormed, &[t, lq], q_c_normed)?;
        }
        let qs: Vec<&B> = self.q.iter().collect();
        record_heads(ops, tr, layer, Stage::Q, &[t, n, p + r], &qs)?;
        record_buf(ops, tr, layer, Stage::KvA, &[t, l + r], &self.kv_a)?;
        record_buf(ops, tr, layer, Stage::KvCNormed, &[t, l], &self.kv_c_normed)?;
        record_buf(ops, tr, layer, Stage::KPe, &[t, r], &self.k_pe)?;
        let qp: Vec<&B> = self.q_pe_roped.iter().collect();
        record_heads(ops, tr, layer, Stage::QPeRoped, &[t, n, r], &qp)?;
        record_buf(ops, tr, layer, Stage::KPeRoped, &[t, r], &self.k_pe_roped)
    }
}

pub(super) fn prologue<O: Ops>(
    ops: &O,
    input: &LayerInput<'_>,
    ew: &EngineWeights<O::Buf>,
    opts: &PathOptions,
) -> Result<Prologue<O::Buf>> {
    let cfg = input.cfg;
    let t = input.batch.n_tokens();
    let f = &opts.faults;
    let [n, l, p, r, _] = cfg.dims().nlprv();
    let hd = cfg.dims().hidden;
    let tp = ew.ranks.len();
    let nh = n / tp;
    let eps = cfg.rms_eps as f32;
    let hidden_host: Vec<f32> = input.hidden_in.iter().copied().collect();
    let hidden = ops.upload(&hidden_host)?;
    let attn_in = ops.rms_norm(&hidden, t, 0, hd, hd, &ew.attn_norm, eps)?;

    // fp8 GEMMs: the latent projections read attn_in quantized once; q_b reads q_c_normed
    // quantized (a model without q_lora_rank: q_proj reads the quantized attn_in).
    let attn_q = match &opts.fp8 {
        Some(q) if f.has(Fault::Fp8ScalePaddedRows) && q.granularity == ActGranularity::Tensor => {
            Some(padded_scale_input(ops, &attn_in, t, hd, q)?)
        }
        _ => fp8_in(ops, opts, &attn_in, hd)?,
    };
    let LatentProjections {
        q_c: q_c_keep,
        q_in_width,
        kv_a,
    } = latent_projections(ops, cfg, ew, attn_q.as_ref().unwrap_or(&attn_in), t)?;
    let q_c_q = match &q_c_keep {
        Some((_, qcn)) => fp8_in(ops, opts, qcn, q_in_width)?,
        None => None,
    };
    let q_input = match (&q_c_keep, &q_c_q, &attn_q) {
        (Some(_), Some(x), _) | (None, _, Some(x)) => x,
        (Some((_, qcn)), None, _) => qcn,
        (None, _, None) => &attn_in,
    };
    // Column-parallel q projection, per rank.
    let q: Vec<O::Buf> = ew
        .ranks
        .iter()
        .map(|rw| {
            let w = rw
                .q_proj
                .as_ref()
                .ok_or_else(|| Error::Internal("engine: q_proj released".into()))?;
            ops.linear(q_input, t, q_in_width, w, nh * (p + r))
        })
        .collect::<Result<_>>()?;

    // kv_c is a strided view of kv_a: rows of width L, row stride L+R.
    let stride = if f.has(Fault::StridedKvC) { l } else { l + r };
    let kv_c_normed = if f.has(Fault::KvNormSkipped) {
        // The latent goes on as kv_a_proj_with_mqa wrote it: the norm call is missing.
        let mut kv_c = ops.canary(t * l)?;
        ops.copy2d(&kv_a, &mut kv_c, copy_rows(t, l).src(0, stride).dst(0, l))?;
        kv_c
    } else {
        ops.rms_norm(&kv_a, t, 0, stride, l, &ew.kv_a_norm, eps)?
    };
    // k_pe is the other strided view of kv_a: columns L.., row stride L+R (`k-pe-stride` cuts
    // it with kv_c's row stride L).
    let k_pe_stride = if f.has(Fault::KPeStride) { l } else { l + r };
    let mut k_pe = ops.canary(t * r)?;
    ops.copy2d(&kv_a, &mut k_pe, copy_rows(t, r).src(l, k_pe_stride).dst(0, r))?;

    let positions = input.batch.positions();
    let cos_scale = if f.has(Fault::RopeCosScaled) { cfg.mscale() } else { 1.0 };
    // The model's pairing (interleaved; NeoX for MiniCPM3); `rope-neox` applies the other one.
    let style = if f.has(Fault::RopeNeox) {
        cfg.rope_style.other()
    } else {
        cfg.rope_style
    };
    let (cos_h, sin_h) = cos_sin_table(&engine_inv_freq(cfg), &positions, cos_scale);
    let (cos, sin) = (ops.upload(&cos_h)?, ops.upload(&sin_h)?);
    // Table row of each rotated row: its token (q rows are token-major, nh heads each).
    let token_rows: Vec<usize> = (0..t).collect();
    let head_rows: Vec<usize> = (0..t).flat_map(|ti| std::iter::repeat_n(ti, nh)).collect();
    let mut q_pe_roped = Vec::with_capacity(tp);
    for qr in &q {
        let mut x = ops.canary(t * nh * r)?;
        ops.copy2d(qr, &mut x, copy_rows(t * nh, r).src(p, p + r).dst(0, r))?;
        ops.rope(&mut x, t * nh, r, &head_rows, &cos, &sin, style)?;
        q_pe_roped.push(x);
    }
    let mut k_pe_roped = ops.canary(t * r)?;
    ops.copy2d(&k_pe, &mut k_pe_roped, copy_rows(t, r).src(0, r).dst(0, r))?;
    ops.rope(&mut k_pe_roped, t, r, &token_rows, &cos, &sin, style)?;
    let (q_c, q_c_normed) = q_c_keep.unzip();
    Ok(Prologue {
        q,
        q_pe_roped,
        kv_c_normed,
        k_pe_roped,
        hidden,
        attn_in,
        q_c_normed,
        q_c,
        kv_a,
        k_pe,
    })
}

/// `fp8-scale-padded-rows`: `attn_in` [t, hd] quantized with one per-tensor scale taken over the
/// engine's padded batch ([`padded_rows`]): the stale rows past the last token reach
/// [`STALE_ROW_FACTOR`] × the batch's largest |value|. A batch that needs no padding is quantized
/// as it should be.
fn padded_scale_input<O: Ops>(ops: &O, attn_in: &O::Buf, t: usize, hd: usize, q: &ActQuant) -> Result<O::Buf> {
    let host = ops.download(attn_in)?;
    let mut x: Vec<f64> = host.iter().map(|&v| f64::from(v)).collect();
    let stale = (padded_rows(t) > t).then(|| {
        let amax = x.iter().fold(0f64, |m, v| m.max(v.abs()));
        amax * STALE_ROW_FACTOR
    });
    q.quantize_columns(&mut x, hd, 0..hd, stale);
    ops.adopt(x.into_iter().map(|v| v as f32).collect())
}

/// The engine's DSA lightning indexer for one layer (vLLM's sparse MLA indexer: its own GEMMs on
/// the backend, then LayerNorm, RoPE, ReLU scores and top-k on the host in f32). Records
/// `idx_q`, `idx_k`, `idx_weights`, `idx_scores` and `idx_topk` (a shared layer given the
/// earlier layer's selection records `idx_topk` only) and returns the selection the attention
/// uses; `None` for a model without an indexer.
///
/// Faults: `indexer-rope-interleaved` rotates with adjacent pairs; `indexer-topk-stale` (chunked
/// path) hands each new token the selection of the token one chunk (the new-token count) earlier.
pub(super) fn engine_indexer<O: Ops>(
    ops: &O,
    input: &LayerInput<'_>,
    opts: &PathOptions,
    kind: PathKind,
    pro: &Prologue<O::Buf>,
    tr: &mut Trace,
    notes: &mut Vec<String>,
) -> Result<Option<Selection>> {
    let cfg = input.cfg;
    let (Some(ix), Some(iw)) = (&cfg.indexer, &input.weights.indexer) else {
        return Ok(None);
    };
    let Some(qcn) = &pro.q_c_normed else {
        return Ok(None);
    };
    let layer = input.weights.layer;
    let batch = input.batch;
    let t = batch.n_tokens();
    let full = ix.full.get(layer).copied().unwrap_or(true);
    let record_topk = |tr: &mut Trace, sel: &Selection| {
        let (shape, v) = indexer::topk_tensor(ix.top_k, batch, sel);
        tr.record(
            Site::new(layer, Stage::IdxTopk),
            TraceTensor::f32(shape, v.into_iter().map(|x| x as f32).collect()),
        );
    };
    if let (false, Some(sel)) = (full, input.shared_selection) {
        record_topk(tr, sel);
        return Ok(Some(sel.clone()));
    }
    let (ni, d, hd) = (ix.n_head, ix.head_dim, cfg.hidden);
    let lq = cfg.q_lora_rank.unwrap_or(0);
    let up = |a: &ndarray::Array2<f32>| ops.upload(&a.iter().copied().collect::<Vec<f32>>());
    let q = ops.download(&ops.linear(qcn, t, lq, &up(&iw.q_b)?, ni * d)?)?;
    let k_raw = ops.download(&ops.linear(&pro.attn_in, t, hd, &up(&iw.k)?, d)?)?;
    let w = ops.download(&ops.linear(&pro.attn_in, t, hd, &up(&iw.proj)?, ni)?)?;
    let mut k = k_raw.clone();
    layer_norm_rows_f32(&mut k, d, &iw.k_norm, &iw.k_norm_b, ix.norm_eps as f32);
    let style = if opts.faults.has(Fault::IndexerRopeInterleaved) {
        RopeStyle::Interleaved
    } else {
        ix.rope_style
    };
    let (mut qr, mut kr) = (q.clone(), k.clone());
    indexer_rope(cfg, ix, batch, style, &mut qr, &mut kr);
    // Scores in f32: Σ_h w·N_idx^-½·ReLU(D_idx^-½·q·k), causal within each sequence.
    let scores: Vec<f32> = indexer::scores(ix, batch, &qr, &kr, &w);
    let smax = batch.seqs.iter().map(|x| x.len).max().unwrap_or(0);
    let sc64: Vec<f64> = scores.iter().map(|&x| f64::from(x)).collect();
    let mut sel = indexer::select(ix.top_k, batch, &sc64);
    if opts.faults.has(Fault::IndexerTopkStale) && kind == PathKind::Chunked {
        notes.push(stale_topk(&mut sel, batch, opts, ix.top_k));
    }
    if full {
        tr.record(Site::new(layer, Stage::IdxQ), TraceTensor::f32(vec![t, ni, d], q));
        tr.record(Site::new(layer, Stage::IdxK), TraceTensor::f32(vec![t, d], k));
        tr.record(Site::new(layer, Stage::IdxWeights), TraceTensor::f32(vec![t, ni], w));
        tr.record(
            Site::new(layer, Stage::IdxScores),
            TraceTensor::f32(vec![t, smax], scores),
        );
    }
    record_topk(tr, &sel);
    Ok(Some(sel))
}

/// The `indexer-topk-stale` fault of the chunked path: the new tokens read the top-k buffer the
/// previous chunk left behind, so each new token at sequence position ≥ `--new-tokens` takes the
/// selection of the token `--new-tokens` positions earlier. Returns the note saying how many
/// selections changed.
fn stale_topk(sel: &mut Selection, batch: &Batch, opts: &PathOptions, top_k: usize) -> String {
    let fresh = sel.clone();
    let mut changed = 0usize;
    for ((&(c, n), off), sq) in chunked_split(batch, opts.new_tokens)
        .iter()
        .zip(batch.offsets())
        .zip(&batch.seqs)
    {
        for i in c..sq.len.min(c + n) {
            if i >= n {
                sel.rows[off + i] = fresh.rows[off + i - n].clone();
                changed += usize::from(sel.rows[off + i] != fresh.rows[off + i]);
            }
        }
    }
    if changed > 0 {
        format!(
            "{changed} new token(s) read the top-k of the token --new-tokens {} positions earlier",
            opts.new_tokens
        )
    } else {
        format!(
            "no new token's selection changed: the stale top-k fault had nothing to act on (it needs a sequence longer than --new-tokens {} whose tokens see more keys than the indexer's top-k {})",
            opts.new_tokens, top_k
        )
    }
}

/// LayerNorm in f32, in place, of each `d`-wide row of `rows` (two passes: mean, then
/// variance), with gain and bias \[d] (the indexer's `k_norm`).
fn layer_norm_rows_f32(rows: &mut [f32], d: usize, gain: &ndarray::Array1<f32>, bias: &ndarray::Array1<f32>, eps: f32) {
    for row in rows.chunks_mut(d) {
        let mean = row.iter().sum::<f32>() / d as f32;
        let var = row.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / d as f32;
        let inv = 1.0 / (var + eps).sqrt();
        for (i, x) in row.iter_mut().enumerate() {
            *x = (*x - mean) * inv * gain[i] + bias[i];
        }
    }
}

/// The indexer's RoPE in f32, in place, on the first R dims of every head of `q`
/// [T, N_idx, D_idx] and of `k` [T, D_idx], at the batch's positions, with the pairing `style`.
fn indexer_rope(cfg: &MlaConfig, ix: &IndexerConfig, batch: &Batch, style: RopeStyle, q: &mut [f32], k: &mut [f32]) {
    let (t, ni, d, r) = (batch.n_tokens(), ix.n_head, ix.head_dim, cfg.qk_rope_head_dim);
    let (cos, sin) = cos_sin_table(&engine_inv_freq(cfg), &batch.positions(), 1.0);
    let half = r / 2;
    for ti in 0..t {
        let (c, s) = (&cos[ti * half..(ti + 1) * half], &sin[ti * half..(ti + 1) * half]);
        for h in 0..ni {
            let o = (ti * ni + h) * d;
            crate::compute::ops::rope_row(&mut q[o..o + r], c, s, style);
        }
        crate::compute::ops::rope_row(&mut k[ti * d..ti * d + r], c, s, style);
    }
}

/// What [`latent_projections`] produced, f32 backend buffers.
struct LatentProjections<B> {
    /// `q_c` [T, Lq] and its RMSNorm `q_c_normed`; `None` without `q_lora_rank`.
    q_c: Option<(B, B)>,
    /// The input width of the q projection: Lq, or H when q is projected from `attn_in`.
    q_in_width: usize,
    /// `kv_a` [T, L+R] (`[kv_c | k_pe]` per row).
    kv_a: B,
}

/// The first projections of `attn_in` [T, H]: with `q_lora_rank` one fused GEMM split into
/// `q_c` [T, Lq] (kept with its RMSNorm `q_c_normed`) and `kv_a` [T, L+R]; without, `kv_a`
/// alone (q is then projected from `attn_in` directly).
///
/// Errors: [`Error::Internal`] when the loaded weights fit neither layout.
fn latent_projections<O: Ops>(
    ops: &O,
    cfg: &MlaConfig,
    ew: &EngineWeights<O::Buf>,
    attn_in: &O::Buf,
    t: usize,
) -> Result<LatentProjections<O::Buf>> {
    let [_, l, _, r, _] = cfg.dims().nlprv();
    let hd = cfg.dims().hidden;
    let eps = cfg.rms_eps as f32;
    Ok(match (&ew.fused_qkv_a, &ew.q_a_norm, &ew.kv_a) {
        (Some(fused), Some(q_a_norm), _) => {
            let lq = cfg.q_lora_rank.unwrap_or(0);
            // One GEMM; the output is split by the fixed sizes [Lq | L+R].
            let qkv = ops.linear(attn_in, t, hd, fused, lq + l + r)?;
            let mut q_c = ops.canary(t * lq)?;
            ops.copy2d(&qkv, &mut q_c, copy_rows(t, lq).src(0, lq + l + r).dst(0, lq))?;
            // q_c is a strided view of the fused output (row stride Lq+L+R).
            let q_c_normed = ops.rms_norm(&qkv, t, 0, lq + l + r, lq, q_a_norm, eps)?;
            let mut kv_a = ops.canary(t * (l + r))?;
            ops.copy2d(&qkv, &mut kv_a, copy_rows(t, l + r).src(lq, lq + l + r).dst(0, l + r))?;
            LatentProjections {
                q_c: Some((q_c, q_c_normed)),
                q_in_width: lq,
                kv_a,
            }
        }
        (None, _, Some(kv_a_w)) => {
            let kv_a = ops.linear(attn_in, t, hd, kv_a_w, l + r)?;
            LatentProjections {
                q_c: None,
                q_in_width: hd,
                kv_a,
            }
        }
        _ => return Err(Error::Internal("engine: inconsistent q weights".into())),
    })
}
