//! vLLM's MLA layer, step by step, written once against the kernel interface [`Ops`].
//!
//! This is where the engine *structure* lives, the structure real bugs hide in: the
//! `fused_qkv_a_proj` weight merged from its two GGUF shards, strided views for `q_c`/`kv_c`, a
//! cos/sin cache, `kv_b_proj` rebuilt from the split GGUF pair, `W_UK_T`/`W_UV` derived from it
//! as vLLM's `process_weights_after_loading` does, a paged latent cache behind a shuffled block
//! table, decode steps with split-KV partials merged by LSE, chunked context, mixed
//! decode/prefill batches, and simulated tensor parallelism with shards cut from the raw quantized
//! bytes and dequantized per rank. Faults of [`crate::compute::faults`] act at the place the real bug
//! lived. Every backend (CPU, CUDA) runs exactly this code; only the kernels differ.

use std::collections::BTreeSet;
use std::ops::Range;

use crate::compute::faults::Fault;
use crate::compute::indexer::{self, Selection};
use crate::compute::ops::{Copy2d, DecodeArgs, EmptyRows, Ops, Segment};
use crate::compute::path::{LayerInput, PathKind, PathOptions, PathRun, Unservable};
use crate::core::batch::{Batch, SplitMix64};
use crate::core::error::{Error, Result};
use crate::core::trace::{RankedWeight, Site, Stage, Trace, TraceTensor};
use crate::model::config::{KvBLayout, MlaConfig};
use crate::model::gguf::GgufFile;
use crate::model::weights::{RawSlice, SliceError, col_slice, row_slice, tensor_name};

/// One TP rank's shards, as that rank's loader produced them.
struct RankWeights<B> {
    /// `q_b_proj` / `q_proj` rows of this rank's heads, [nh·(P+R), Lq or H].
    q_proj: B,
    /// `kv_b_proj` rows of this rank's heads, [nh·(P+V), L].
    kv_b: B,
    /// `W_UK_T` of this rank's heads, [nh, P, L].
    w_uk_t: B,
    /// `W_UV` of this rank's heads, [nh, L, V].
    w_uv: B,
    /// `o_proj` columns (input dim) of this rank's heads, [H, nh·V].
    o_proj: B,
}

/// The dense FFN weights: norm [H], gate/up [F, H], down [H, F], and F.
struct Ffn<B> {
    norm: B,
    gate: B,
    up: B,
    down: B,
    f: usize,
}

/// The weights as an engine holds them after loading.
struct EngineWeights<B> {
    attn_norm: B,
    /// `fused_qkv_a_proj` [Lq+L+R, H] (with Lq), replicated on every rank.
    fused_qkv_a: Option<B>,
    /// `q_a_layernorm` [Lq].
    q_a_norm: Option<B>,
    /// `kv_a_proj_with_mqa` [L+R, H] (without Lq), replicated.
    kv_a: Option<B>,
    kv_a_norm: B,
    ranks: Vec<RankWeights<B>>,
    ffn: Option<Ffn<B>>,
}

/// Why the engine could not load its weights.
enum LoadError {
    Unservable(Unservable),
    Other(Error),
}

impl From<Error> for LoadError {
    fn from(e: Error) -> Self {
        LoadError::Other(e)
    }
}

fn slice_to_load(site: Site, reason: &str, e: SliceError) -> LoadError {
    match e {
        SliceError::Misaligned {
            tensor,
            ggml_type,
            block_size,
            at,
        } => LoadError::Unservable(Unservable {
            site,
            tensor,
            ggml_type,
            block_size,
            at,
            reason: reason.to_string(),
        }),
        SliceError::Other(e) => LoadError::Other(e),
    }
}

/// Heads of rank `r` of `tp`.
fn rank_heads(n: usize, tp: usize, r: usize) -> Range<usize> {
    let nh = n / tp;
    r * nh..(r + 1) * nh
}

fn cp(rows: usize, width: usize, src_off: usize, src_stride: usize, dst_off: usize, dst_stride: usize) -> Copy2d {
    Copy2d {
        rows,
        width,
        src_off,
        src_stride,
        src_row_div: 1,
        dst_off,
        dst_stride,
    }
}

/// Dequantizes a raw slice with the backend's dequantizer.
fn dq<O: Ops>(ops: &O, raw: &RawSlice<'_>) -> Result<O::Buf> {
    ops.dequant(raw.ggml_type, &raw.bytes, raw.n_elements(), &raw.tensor)
}

fn whole<O: Ops>(ops: &O, file: &GgufFile, name: &str) -> Result<O::Buf> {
    let t = file.require_tensor(name)?;
    dq(ops, &row_slice(file, name, 0..t.n_rows() as usize)?)
}

impl<B> EngineWeights<B> {
    fn load<O: Ops<Buf = B>>(
        ops: &O,
        input: &LayerInput<'_>,
        opts: &PathOptions,
        notes: &mut Vec<String>,
    ) -> Result<Self, LoadError> {
        let cfg = input.cfg;
        let file = input.file;
        let layer = input.weights.layer;
        let (n, h, l, p, r, v) = (
            cfg.n_head,
            cfg.hidden,
            cfg.kv_lora_rank,
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
        );
        let f = &opts.faults;
        let tp = opts.tp;
        let name = |s: &str| tensor_name(layer, s);

        let attn_norm = whole(ops, file, &name("attn_norm"))?;
        let kv_a_norm = whole(ops, file, &name("attn_kv_a_norm"))?;
        let kv_a_w = whole(ops, file, &name("attn_kv_a_mqa"))?;
        let (fused_qkv_a, q_a_norm, kv_a) = match cfg.q_lora_rank {
            Some(lq) => {
                // MergedColumnParallelLinear: shard 0 = q_a_proj, shard 1 = kv_a_proj_with_mqa.
                let q_a = whole(ops, file, &name("attn_q_a"))?;
                let mut fused = ops.canary((lq + l + r) * h)?;
                let (first, first_rows, second, second_rows) = if f.has(Fault::FusedShardSwap) {
                    (&kv_a_w, l + r, &q_a, lq)
                } else {
                    (&q_a, lq, &kv_a_w, l + r)
                };
                ops.copy2d(first, &mut fused, cp(first_rows, h, 0, h, 0, h))?;
                ops.copy2d(second, &mut fused, cp(second_rows, h, 0, h, first_rows * h, h))?;
                (Some(fused), Some(whole(ops, file, &name("attn_q_a_norm"))?), None)
            }
            None => (None, None, Some(kv_a_w)),
        };
        let q_tensor = if cfg.q_lora_rank.is_some() {
            name("attn_q_b")
        } else {
            name("attn_q")
        };

        // Which rank's shard each rank's loader reads (faults reorder or duplicate ranks).
        let source = |rank: usize, weight: RankedWeight| -> usize {
            if f.has(Fault::TpRank0Everywhere) {
                0
            } else if f.has(Fault::TpRankOrder) && weight != RankedWeight::OProj {
                (rank + 1) % tp
            } else {
                rank
            }
        };
        if tp > 1 && f.has(Fault::QuantSliceMisaligned) {
            // The broken loader shards kv_b_proj along its input (latent) dim, as if it were
            // row-parallel. The cut tensor is the one whose rows run along L.
            let t = match cfg.kv_b_layout {
                KvBLayout::Split => name("attn_v_b"),
                KvBLayout::Fused => name("attn_kv_b"),
            };
            for rank in 0..tp {
                let cols = rank * l / tp..(rank + 1) * l / tp;
                if let Err(e) = col_slice(file, &t, cols) {
                    return Err(slice_to_load(
                        Site::new(layer, Stage::WKvB),
                        "kv_b_proj sharded along its input (latent) dim L instead of by heads",
                        e,
                    ));
                }
            }
            notes.push(
                "quant-slice-misaligned: the L cut lands on quant block boundaries here; the fault had no effect"
                    .into(),
            );
        }
        let mut ranks = Vec::with_capacity(tp);
        for rank in 0..tp {
            let qh = rank_heads(n, tp, source(rank, RankedWeight::QProj));
            let q_proj = dq(ops, &row_slice(file, &q_tensor, qh.start * (p + r)..qh.end * (p + r))?)?;
            let kh = rank_heads(n, tp, source(rank, RankedWeight::KvB));
            let nh = kh.len();
            let kv_b = match cfg.kv_b_layout {
                KvBLayout::Fused => dq(
                    ops,
                    &row_slice(file, &name("attn_kv_b"), kh.start * (p + v)..kh.end * (p + v))?,
                )?,
                KvBLayout::Split => {
                    // attn_k_b is [N, L, P] (rows of P); attn_v_b is [N, V, L] (rows of L).
                    let k_b = dq(ops, &row_slice(file, &name("attn_k_b"), kh.start * l..kh.end * l)?)?;
                    let v_b = dq(ops, &row_slice(file, &name("attn_v_b"), kh.start * v..kh.end * v)?)?;
                    // The k rows of kv_b are k_b transposed per head; the bug reads the same
                    // bytes as [P, L] (a reshape).
                    let k_rows = if f.has(Fault::KBUntransposed) {
                        k_b
                    } else {
                        ops.transpose(&k_b, nh, l, p)?
                    };
                    let mut kv_b = ops.canary(nh * (p + v) * l)?;
                    for hh in 0..nh {
                        ops.copy2d(&k_rows, &mut kv_b, cp(p, l, hh * p * l, l, hh * (p + v) * l, l))?;
                        ops.copy2d(&v_b, &mut kv_b, cp(v, l, hh * v * l, l, (hh * (p + v) + p) * l, l))?;
                    }
                    kv_b
                }
            };
            // process_weights_after_loading: W_UK_T [nh, P, L] and W_UV [nh, L, V] from kv_b.
            let mut w_uk_t = ops.canary(nh * p * l)?;
            let mut w_uv_t = ops.canary(nh * v * l)?; // [nh, V, L] before the transpose
            if f.has(Fault::KvBGrouped) {
                // [all k rows | all v rows] instead of per head.
                ops.copy2d(&kv_b, &mut w_uk_t, cp(nh * p, l, 0, l, 0, l))?;
                ops.copy2d(&kv_b, &mut w_uv_t, cp(nh * v, l, nh * p * l, l, 0, l))?;
            } else {
                for hh in 0..nh {
                    ops.copy2d(&kv_b, &mut w_uk_t, cp(p, l, hh * (p + v) * l, l, hh * p * l, l))?;
                    ops.copy2d(&kv_b, &mut w_uv_t, cp(v, l, (hh * (p + v) + p) * l, l, hh * v * l, l))?;
                }
            }
            let w_uv = ops.transpose(&w_uv_t, nh, v, l)?;
            let oh = rank_heads(n, tp, source(rank, RankedWeight::OProj));
            let o_raw = col_slice(file, &name("attn_output"), oh.start * v..oh.end * v).map_err(|e| {
                slice_to_load(
                    Site::new(layer, Stage::WRank(RankedWeight::OProj, rank as u32)),
                    "o_proj is row-parallel: its input dim N·V is cut by heads",
                    e,
                )
            })?;
            let o_proj = dq(ops, &o_raw)?;
            ranks.push(RankWeights {
                q_proj,
                kv_b,
                w_uk_t,
                w_uv,
                o_proj,
            });
        }
        let ffn = match &input.weights.ffn {
            Some(fw) => Some(Ffn {
                norm: whole(ops, file, &name("ffn_norm"))?,
                gate: whole(ops, file, &name("ffn_gate"))?,
                up: whole(ops, file, &name("ffn_up"))?,
                down: whole(ops, file, &name("ffn_down"))?,
                f: fw.gate.nrows(),
            }),
            None => None,
        };
        Ok(EngineWeights {
            attn_norm,
            fused_qkv_a,
            q_a_norm,
            kv_a,
            kv_a_norm,
            ranks,
            ffn,
        })
    }
}

/// Records a backend buffer (downloaded) at `stage`.
fn rec<O: Ops>(ops: &O, tr: &mut Trace, layer: usize, stage: Stage, shape: &[usize], b: &O::Buf) -> Result<()> {
    tr.record(
        Site::new(layer, stage),
        TraceTensor::f32(shape.to_vec(), ops.download(b)?),
    );
    Ok(())
}

/// Downloads per-rank `[T, nh, X]` buffers and concatenates them along heads into `[T, N, X]`.
fn reassemble<O: Ops>(ops: &O, parts: &[&O::Buf], t: usize, nh: usize, x: usize) -> Result<Vec<f32>> {
    let tp = parts.len();
    let host: Vec<Vec<f32>> = parts.iter().map(|b| ops.download(b)).collect::<Result<_>>()?;
    let mut out = vec![0f32; t * tp * nh * x];
    for ti in 0..t {
        for (r, part) in host.iter().enumerate() {
            out[(ti * tp + r) * nh * x..(ti * tp + r + 1) * nh * x]
                .copy_from_slice(&part[ti * nh * x..(ti + 1) * nh * x]);
        }
    }
    Ok(out)
}

/// Inverse RoPE frequencies with YaRN, computed the way vLLM's `DeepseekScalingRotaryEmbedding`
/// does (correction range from beta_fast/beta_slow, linear ramp, interpolation blend).
fn engine_inv_freq(cfg: &MlaConfig) -> Vec<f64> {
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
struct Prologue<B> {
    /// Per rank: `q` [T, nh, P+R] (q_pe part not yet rotated).
    q: Vec<B>,
    /// Per rank: `q_pe_roped` [T, nh, R].
    q_pe_roped: Vec<B>,
    /// `kv_c_normed` [T, L].
    kv_c_normed: B,
    /// `k_pe_roped` [T, R].
    k_pe_roped: B,
    /// The layer input, [T, H].
    hidden: B,
    /// `attn_in` [T, H] (the indexer's key and weight input).
    attn_in: B,
    /// `q_c_normed` [T, Lq], when the model compresses q (the indexer's query input).
    q_c_normed: Option<B>,
}

fn prologue<O: Ops>(
    ops: &O,
    input: &LayerInput<'_>,
    ew: &EngineWeights<O::Buf>,
    opts: &PathOptions,
    tr: &mut Trace,
) -> Result<Prologue<O::Buf>> {
    let cfg = input.cfg;
    let layer = input.weights.layer;
    let t = input.batch.n_tokens();
    let f = &opts.faults;
    let (hd, n, l, p, r) = (
        cfg.hidden,
        cfg.n_head,
        cfg.kv_lora_rank,
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
    );
    let tp = ew.ranks.len();
    let nh = n / tp;
    let eps = cfg.rms_eps as f32;
    let hidden_host: Vec<f32> = input.hidden_in.iter().copied().collect();
    let hidden = ops.upload(&hidden_host)?;
    rec(ops, tr, layer, Stage::HiddenIn, &[t, hd], &hidden)?;
    let attn_in = ops.rms_norm(&hidden, t, 0, hd, hd, &ew.attn_norm, eps)?;
    rec(ops, tr, layer, Stage::AttnIn, &[t, hd], &attn_in)?;

    let (q_c_normed_keep, q_k, kv_a) = match (&ew.fused_qkv_a, &ew.q_a_norm, &ew.kv_a) {
        (Some(fused), Some(q_a_norm), _) => {
            let lq = cfg.q_lora_rank.unwrap_or(0);
            rec(ops, tr, layer, Stage::WFusedQkvA, &[lq + l + r, hd], fused)?;
            // One GEMM; the output is split by the fixed sizes [Lq | L+R].
            let qkv = ops.linear(&attn_in, t, hd, fused, lq + l + r)?;
            let mut q_c = ops.canary(t * lq)?;
            ops.copy2d(&qkv, &mut q_c, cp(t, lq, 0, lq + l + r, 0, lq))?;
            rec(ops, tr, layer, Stage::QC, &[t, lq], &q_c)?;
            // q_c is a strided view of the fused output (row stride Lq+L+R).
            let q_c_normed = ops.rms_norm(&qkv, t, 0, lq + l + r, lq, q_a_norm, eps)?;
            rec(ops, tr, layer, Stage::QCNormed, &[t, lq], &q_c_normed)?;
            let mut kv_a = ops.canary(t * (l + r))?;
            ops.copy2d(&qkv, &mut kv_a, cp(t, l + r, lq, lq + l + r, 0, l + r))?;
            (Some(q_c_normed), lq, kv_a)
        }
        (None, _, Some(kv_a_w)) => {
            let kv_a = ops.linear(&attn_in, t, hd, kv_a_w, l + r)?;
            (None, hd, kv_a)
        }
        _ => return Err(Error::Usage("engine: inconsistent q weights".into())),
    };
    let q_input = q_c_normed_keep.as_ref().unwrap_or(&attn_in);
    // Column-parallel q projection, per rank.
    let q: Vec<O::Buf> = ew
        .ranks
        .iter()
        .map(|rw| ops.linear(q_input, t, q_k, &rw.q_proj, nh * (p + r)))
        .collect::<Result<_>>()?;
    let qs: Vec<&O::Buf> = q.iter().collect();
    tr.record(
        Site::new(layer, Stage::Q),
        TraceTensor::f32(vec![t, n, p + r], reassemble(ops, &qs, t, nh, p + r)?),
    );
    rec(ops, tr, layer, Stage::KvA, &[t, l + r], &kv_a)?;

    // kv_c is a strided view of kv_a: rows of width L, row stride L+R.
    let stride = if f.has(Fault::StridedKvC) { l } else { l + r };
    let kv_c_normed = ops.rms_norm(&kv_a, t, 0, stride, l, &ew.kv_a_norm, eps)?;
    rec(ops, tr, layer, Stage::KvCNormed, &[t, l], &kv_c_normed)?;
    let mut k_pe = ops.canary(t * r)?;
    ops.copy2d(&kv_a, &mut k_pe, cp(t, r, l, l + r, 0, r))?;
    rec(ops, tr, layer, Stage::KPe, &[t, r], &k_pe)?;

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
        ops.copy2d(qr, &mut x, cp(t * nh, r, p, p + r, 0, r))?;
        ops.rope(&mut x, t * nh, r, &head_rows, &cos, &sin, style)?;
        q_pe_roped.push(x);
    }
    let mut k_pe_roped = k_pe;
    ops.rope(&mut k_pe_roped, t, r, &token_rows, &cos, &sin, style)?;
    let qp: Vec<&O::Buf> = q_pe_roped.iter().collect();
    tr.record(
        Site::new(layer, Stage::QPeRoped),
        TraceTensor::f32(vec![t, n, r], reassemble(ops, &qp, t, nh, r)?),
    );
    rec(ops, tr, layer, Stage::KPeRoped, &[t, r], &k_pe_roped)?;
    Ok(Prologue {
        q,
        q_pe_roped,
        kv_c_normed,
        k_pe_roped,
        hidden,
        attn_in,
        q_c_normed: q_c_normed_keep,
    })
}

/// The engine's DSA lightning indexer for one layer (vLLM's sparse MLA indexer: its own GEMMs on
/// the backend, then LayerNorm, RoPE, ReLU scores and top-k on the host in f32). Records
/// `idx_q`, `idx_k`, `idx_weights`, `idx_scores` and `idx_topk` (a shared layer given the
/// earlier layer's selection records `idx_topk` only) and returns the selection the attention
/// uses; `None` for a model without an indexer.
///
/// Faults: `indexer-rope-interleaved` rotates with adjacent pairs; `indexer-topk-stale` (chunked
/// path) hands each new token the selection of the token one chunk (the new-token count) earlier.
fn engine_indexer<O: Ops>(
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
    let r = cfg.qk_rope_head_dim;
    let up = |a: &ndarray::Array2<f32>| ops.upload(&a.iter().copied().collect::<Vec<f32>>());
    let q = ops.download(&ops.linear(qcn, t, lq, &up(&iw.q_b)?, ni * d)?)?;
    let k_raw = ops.download(&ops.linear(&pro.attn_in, t, hd, &up(&iw.k)?, d)?)?;
    let w = ops.download(&ops.linear(&pro.attn_in, t, hd, &up(&iw.proj)?, ni)?)?;
    // LayerNorm in f32 (two passes: mean, then variance).
    let eps = ix.norm_eps as f32;
    let mut k = k_raw.clone();
    for row in k.chunks_mut(d) {
        let mean = row.iter().sum::<f32>() / d as f32;
        let var = row.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / d as f32;
        let inv = 1.0 / (var + eps).sqrt();
        for (i, x) in row.iter_mut().enumerate() {
            *x = (*x - mean) * inv * iw.k_norm[i] + iw.k_norm_b[i];
        }
    }
    let style = if opts.faults.has(Fault::IndexerRopeInterleaved) {
        crate::model::config::RopeStyle::Interleaved
    } else {
        ix.rope_style
    };
    let positions = batch.positions();
    let (cos, sin) = cos_sin_table(&engine_inv_freq(cfg), &positions, 1.0);
    let half = r / 2;
    let (mut qr, mut kr) = (q.clone(), k.clone());
    for ti in 0..t {
        let (c, s) = (&cos[ti * half..(ti + 1) * half], &sin[ti * half..(ti + 1) * half]);
        for h in 0..ni {
            let o = (ti * ni + h) * d;
            crate::compute::ops::rope_row(&mut qr[o..o + r], c, s, style);
        }
        crate::compute::ops::rope_row(&mut kr[ti * d..ti * d + r], c, s, style);
    }
    // Scores in f32: Σ_h w·N_idx^-½·ReLU(D_idx^-½·q·k), causal within each sequence.
    let smax = batch.seqs.iter().map(|x| x.len).max().unwrap_or(0);
    let (hs, ds) = ((ni as f32).powf(-0.5), (d as f32).powf(-0.5));
    let mut scores = vec![0f32; t * smax];
    for (sq, off) in batch.seqs.iter().zip(batch.offsets()) {
        for i in 0..sq.len {
            let ti = off + i;
            for j in 0..=i {
                let kk = &kr[(off + j) * d..(off + j + 1) * d];
                let mut acc = 0f32;
                for h in 0..ni {
                    let qq = &qr[(ti * ni + h) * d..(ti * ni + h + 1) * d];
                    let dot: f32 = qq.iter().zip(kk).map(|(a, b)| a * b).sum();
                    acc += w[ti * ni + h] * hs * (dot * ds).max(0.0);
                }
                scores[ti * smax + j] = acc;
            }
        }
    }
    let sc64: Vec<f64> = scores.iter().map(|&x| f64::from(x)).collect();
    let mut sel = indexer::select(ix.top_k, batch, &sc64);
    if opts.faults.has(Fault::IndexerTopkStale) && kind == PathKind::Chunked {
        // The new tokens read the top-k buffer the previous chunk left behind.
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
        notes.push(if changed > 0 {
            format!(
                "{changed} new token(s) read the top-k of the token --new-tokens {} positions earlier",
                opts.new_tokens
            )
        } else {
            format!(
                "no new token's selection changed: the stale top-k fault had nothing to act on (it needs a sequence longer than --new-tokens {} whose tokens see more keys than the indexer's top-k {})",
                opts.new_tokens, ix.top_k
            )
        });
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

/// Per-rank attention inputs and settings shared by the attention variants.
struct RankAttn<'a, O: Ops> {
    ops: &'a O,
    cfg: &'a MlaConfig,
    rw: &'a RankWeights<O::Buf>,
    /// Heads on this rank.
    nh: usize,
    /// `q` [T, nh, P+R].
    q: &'a O::Buf,
    /// `q_pe_roped` [T, nh, R].
    q_pe_roped: &'a O::Buf,
    /// `kv_c_normed` [T, L] (replicated).
    kv_c_normed: &'a O::Buf,
    /// `k_pe_roped` [T, R] (replicated).
    k_pe_roped: &'a O::Buf,
    /// Softmax scale the kernels use.
    scale: f32,
    opts: &'a PathOptions,
    /// The DSA selection (packed token → kept key indices of its sequence); `None`: dense.
    sel: Option<&'a Selection>,
}

/// What one rank's attention op produced. `out` is what the CALLER's buffer holds afterwards.
struct RankOut<B> {
    /// `attn_out` [T, nh, V] as the caller sees it.
    out: B,
    /// `lse` [T, nh].
    lse: B,
    /// `k_nope` [T, nh, P] and `v` [T, nh, V] (expanded paths).
    k_nope: Option<B>,
    v: Option<B>,
    /// `ql_nope` and `attn_latent` [T, nh, L] (absorbed path).
    ql_nope: Option<B>,
    attn_latent: Option<B>,
}

impl<O: Ops> RankAttn<'_, O> {
    /// Expanded K/V of `rows` latent rows: `kv_b_proj`, then the per-head split (or the grouped
    /// split of the `kv-b-grouped` fault). Returns (`k_nope` [rows, nh, P], `v` [rows, nh, V]).
    fn expand_kv(&self, kv_c: &O::Buf, rows: usize) -> Result<(O::Buf, O::Buf)> {
        let (l, p, v, nh) = (
            self.cfg.kv_lora_rank,
            self.cfg.qk_nope_head_dim,
            self.cfg.v_head_dim,
            self.nh,
        );
        let ops = self.ops;
        let kv = ops.linear(kv_c, rows, l, &self.rw.kv_b, nh * (p + v))?;
        let mut k_nope = ops.canary(rows * nh * p)?;
        let mut vv = ops.canary(rows * nh * v)?;
        if self.opts.faults.has(Fault::KvBGrouped) {
            ops.copy2d(&kv, &mut k_nope, cp(rows, nh * p, 0, nh * (p + v), 0, nh * p))?;
            ops.copy2d(&kv, &mut vv, cp(rows, nh * v, nh * p, nh * (p + v), 0, nh * v))?;
        } else {
            ops.copy2d(&kv, &mut k_nope, cp(rows * nh, p, 0, p + v, 0, p))?;
            ops.copy2d(&kv, &mut vv, cp(rows * nh, v, p, p + v, 0, v))?;
        }
        Ok((k_nope, vv))
    }

    /// `[q_nope | q_pe_roped]` for all T rows, [T, nh, P+R].
    fn full_q(&self, t: usize) -> Result<O::Buf> {
        let (p, r, nh) = (self.cfg.qk_nope_head_dim, self.cfg.qk_rope_head_dim, self.nh);
        let mut qf = self.ops.canary(t * nh * (p + r))?;
        self.ops.copy2d(self.q, &mut qf, cp(t * nh, p, 0, p + r, 0, p + r))?;
        self.ops
            .copy2d(self.q_pe_roped, &mut qf, cp(t * nh, r, 0, r, p, p + r))?;
        Ok(qf)
    }

    /// `[k_nope | k_pe_roped broadcast over heads]` for `rows` rows, [rows, nh, P+R].
    fn full_k(&self, k_nope: &O::Buf, k_pe_roped: &O::Buf, rows: usize) -> Result<O::Buf> {
        let (p, r, nh) = (self.cfg.qk_nope_head_dim, self.cfg.qk_rope_head_dim, self.nh);
        let mut kf = self.ops.canary(rows * nh * (p + r))?;
        self.ops.copy2d(k_nope, &mut kf, cp(rows * nh, p, 0, p, 0, p + r))?;
        self.ops.copy2d(
            k_pe_roped,
            &mut kf,
            Copy2d {
                rows: rows * nh,
                width: r,
                src_off: 0,
                src_stride: r,
                src_row_div: nh,
                dst_off: p,
                dst_stride: p + r,
            },
        )?;
        Ok(kf)
    }

    /// The attention custom op's output contract: the op gets the caller-allocated output and
    /// must write it in place. With `phantom-output`, the op's result lands in a private tensor
    /// and the caller's buffer stays as allocated (the canary).
    fn deliver(&self, result: O::Buf, n: usize) -> Result<O::Buf> {
        if self.opts.faults.has(Fault::PhantomOutput) {
            self.ops.canary(n)
        } else {
            Ok(result)
        }
    }

    /// `ql_nope = q_nope · W_UK_T` per head, [T, nh, L].
    fn absorb_q(&self, t: usize) -> Result<O::Buf> {
        let (l, p, r, nh) = (
            self.cfg.kv_lora_rank,
            self.cfg.qk_nope_head_dim,
            self.cfg.qk_rope_head_dim,
            self.nh,
        );
        let mut q_nope = self.ops.canary(t * nh * p)?;
        self.ops.copy2d(self.q, &mut q_nope, cp(t * nh, p, 0, p + r, 0, p))?;
        self.ops.bmm_heads(&q_nope, t, nh, p, &self.rw.w_uk_t, l)
    }

    /// Per-sequence causal segments over packed rows.
    fn causal_segments(seqs: &[(usize, usize)]) -> Vec<Segment> {
        seqs.iter()
            .map(|&(off, len)| Segment {
                q_off: off,
                q_len: len,
                k_off: off,
                k_len: len,
                causal: true,
            })
            .collect()
    }
}

impl<O: Ops> RankAttn<'_, O> {
    /// Sparse attention of query rows `q_rows` of `q` [·, nh, P+R] over per-row key lists
    /// (`keys[i]`: rows of `k` [·, nh, P+R] / `v` [·, nh, V]): the keys of every row are
    /// gathered into one packed buffer and each row is its own non-causal segment (what a sparse
    /// MLA prefill kernel does with the indexer's indices). A row with no key gets `empty`.
    /// Returns (`out` [n, nh, V], `lse` [n, nh]) in `q_rows` order.
    #[allow(clippy::too_many_arguments)]
    fn sparse_rows(
        &self,
        q: &O::Buf,
        q_rows: &[usize],
        k: &O::Buf,
        v: &O::Buf,
        keys: &[Vec<usize>],
        empty: EmptyRows,
    ) -> Result<(O::Buf, O::Buf)> {
        let (p, r, dv, nh) = (
            self.cfg.qk_nope_head_dim,
            self.cfg.qk_rope_head_dim,
            self.cfg.v_head_dim,
            self.nh,
        );
        let ops = self.ops;
        let n = q_rows.len();
        let mut flat: Vec<usize> = keys.iter().flatten().copied().collect();
        let mut segs = Vec::with_capacity(n);
        let mut k_off = 0;
        for (i, kr) in keys.iter().enumerate() {
            segs.push(Segment {
                q_off: i,
                q_len: 1,
                k_off,
                k_len: kr.len(),
                causal: false,
            });
            k_off += kr.len();
        }
        if flat.is_empty() {
            // Never read (every segment is empty); keeps the gathers non-empty.
            flat.push(0);
        }
        let qg = ops.gather_rows(q, nh * (p + r), q_rows)?;
        let kg = ops.gather_rows(k, nh * (p + r), &flat)?;
        let vg = ops.gather_rows(v, nh * dv, &flat)?;
        let mut out = ops.canary(n * nh * dv)?;
        let mut lse = ops.canary(n * nh)?;
        ops.flash_attention(
            &qg,
            &kg,
            &vg,
            nh,
            p + r,
            dv,
            &segs,
            self.scale,
            empty,
            &mut out,
            &mut lse,
        )?;
        Ok((out, lse))
    }

    /// Causal attention of every row of the sequences `seqs` ((first packed row, length)) over
    /// its own sequence, written into those rows of `out` [T, nh, V] / `lse` [T, nh]; with a DSA
    /// selection, over the kept keys only.
    fn causal_into(
        &self,
        q: &O::Buf,
        k: &O::Buf,
        v: &O::Buf,
        seqs: &[(usize, usize)],
        out: &mut O::Buf,
        lse: &mut O::Buf,
    ) -> Result<()> {
        let (p, r, dv, nh) = (
            self.cfg.qk_nope_head_dim,
            self.cfg.qk_rope_head_dim,
            self.cfg.v_head_dim,
            self.nh,
        );
        if self.sel.is_none() {
            return self.ops.flash_attention(
                q,
                k,
                v,
                nh,
                p + r,
                dv,
                &Self::causal_segments(seqs),
                self.scale,
                EmptyRows::ZeroMinusInf,
                out,
                lse,
            );
        }
        let rows: Vec<usize> = seqs.iter().flat_map(|&(off, len)| off..off + len).collect();
        if rows.is_empty() {
            return Ok(());
        }
        let keys: Vec<Vec<usize>> = seqs
            .iter()
            .flat_map(|&(off, len)| (0..len).map(move |i| (off, i)))
            .map(|(off, i)| self.kept(off + i, off, 0..i + 1))
            .collect();
        let (o, l) = self.sparse_rows(q, &rows, k, v, &keys, EmptyRows::ZeroMinusInf)?;
        self.ops.scatter_rows(out, &o, nh * dv, &rows)?;
        self.ops.scatter_rows(lse, &l, nh, &rows)
    }

    /// The kept keys of packed token `row` as packed rows (`off` = its sequence's first row),
    /// limited to key indices in `range`.
    fn kept(&self, row: usize, off: usize, range: Range<usize>) -> Vec<usize> {
        match self.sel {
            Some(sel) => sel.rows[row]
                .iter()
                .filter(|j| range.contains(j))
                .map(|&j| off + j)
                .collect(),
            None => range.map(|j| off + j).collect(),
        }
    }
}

/// The paged latent cache and each sequence's (shuffled) block table.
struct CacheState<B> {
    cache: B,
    tables: Vec<Vec<usize>>,
    block_size: usize,
    width: usize,
}

impl<B> CacheState<B> {
    /// Enough pages for every sequence plus one spare, handed out in a shuffled order; the cache
    /// is canary-filled, so reading a slot never written yields NaN.
    fn new<O: Ops<Buf = B>>(ops: &O, batch: &Batch, cfg: &MlaConfig, opts: &PathOptions) -> Result<Self> {
        let page = opts.page_size.max(1);
        let pages: Vec<usize> = batch.seqs.iter().map(|s| s.len.div_ceil(page)).collect();
        let num_blocks = pages.iter().sum::<usize>() + 1;
        let mut physical: Vec<usize> = (0..num_blocks).collect();
        SplitMix64::new(opts.seed ^ 0x5EED_B10C).shuffle(&mut physical);
        let mut tables = Vec::new();
        let mut next = 0;
        for &np in &pages {
            tables.push(physical[next..next + np].to_vec());
            next += np;
        }
        let width = cfg.kv_lora_rank + cfg.qk_rope_head_dim;
        Ok(CacheState {
            cache: ops.canary(num_blocks * page * width)?,
            tables,
            block_size: page,
            width,
        })
    }

    /// The cache slot of position `i` of sequence `seq` (slot = block · block_size + offset).
    fn slot(&self, seq: usize, i: usize) -> usize {
        self.tables[seq][i / self.block_size] * self.block_size + i % self.block_size
    }

    /// `concat_and_cache_mla` for packed rows `rows` (positions `pos` of sequences `seqs`).
    fn write<O: Ops<Buf = B>>(
        &mut self,
        a: &RankAttn<'_, O>,
        rows: &[usize],
        seqs: &[usize],
        pos: &[usize],
    ) -> Result<()> {
        if rows.is_empty() {
            return Ok(());
        }
        let (l, r) = (a.cfg.kv_lora_rank, a.cfg.qk_rope_head_dim);
        let kv = a.ops.gather_rows(a.kv_c_normed, l, rows)?;
        let kp = a.ops.gather_rows(a.k_pe_roped, r, rows)?;
        let slots: Vec<usize> = seqs.iter().zip(pos).map(|(&s, &i)| self.slot(s, i)).collect();
        a.ops.cache_write(&mut self.cache, self.width, &kv, &kp, l, r, &slots)
    }
}

/// Split-KV absorbed decode of query rows `rows` (packed) of sequences `seqs` with context
/// lengths `ctx`: stage 1 writes `splits` partials, stage 2 merges them. Returns
/// (latent [n, nh, L], lse [n, nh]) and records rows that merged an empty split.
fn decode_rows<O: Ops>(
    a: &RankAttn<'_, O>,
    cs: &CacheState<O::Buf>,
    qrow: &O::Buf,
    rows: &[usize],
    seqs: &[usize],
    ctx: &[usize],
    empty_rows: &mut BTreeSet<usize>,
) -> Result<(O::Buf, O::Buf)> {
    let (l, r, nh) = (a.cfg.kv_lora_rank, a.cfg.qk_rope_head_dim, a.nh);
    let splits = a.opts.num_splits.max(1);
    let n = rows.len();
    let q = a.ops.gather_rows(qrow, nh * (l + r), rows)?;
    let tables: Vec<Vec<usize>> = seqs.iter().map(|&s| cs.tables[s].clone()).collect();
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
    a.ops.decode_merged(&DecodeArgs {
        q: &q,
        n,
        nh,
        cache: &cs.cache,
        block_size: cs.block_size,
        width: cs.width,
        tables: &tables,
        ctx,
        splits,
        dv: l,
        scale: a.scale,
        empty_lse,
    })
}

/// [`decode_rows`] over the DSA selection: each row's kept cache slots (`slots[i]`) are gathered
/// into a compact paged cache, one run of pages per row, and decoded there (FlashMLA's sparse
/// decode reads the same rows through the indexer's indices).
fn decode_rows_sparse<O: Ops>(
    a: &RankAttn<'_, O>,
    cs: &CacheState<O::Buf>,
    qrow: &O::Buf,
    rows: &[usize],
    slots: &[Vec<usize>],
    empty_rows: &mut BTreeSet<usize>,
) -> Result<(O::Buf, O::Buf)> {
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
    };
    let idx: Vec<usize> = (0..rows.len()).collect();
    let ctx: Vec<usize> = slots.iter().map(Vec::len).collect();
    decode_rows(a, &compact, qrow, rows, &idx, &ctx, empty_rows)
}

/// The cache slots of the keys row `row` (sequence `seq`, first packed row `off`) keeps among
/// key indices `0..ctx` (all of them without an indexer).
fn kept_slots<O: Ops>(a: &RankAttn<'_, O>, cs: &CacheState<O::Buf>, row: usize, seq: usize, ctx: usize) -> Vec<usize> {
    match a.sel {
        Some(sel) => sel.rows[row]
            .iter()
            .filter(|&&j| j < ctx)
            .map(|&j| cs.slot(seq, j))
            .collect(),
        None => (0..ctx).map(|j| cs.slot(seq, j)).collect(),
    }
}

/// Absorbed decode (vLLM `forward_mqa`): decode steps over the batch. At step i every sequence
/// longer than i writes its token i into the paged cache and decodes it against positions 0..=i.
fn mqa_rank<O: Ops>(a: &RankAttn<'_, O>, batch: &Batch, empty_rows: &mut BTreeSet<usize>) -> Result<RankOut<O::Buf>> {
    let t = batch.n_tokens();
    let (l, r, v, nh) = (a.cfg.kv_lora_rank, a.cfg.qk_rope_head_dim, a.cfg.v_head_dim, a.nh);
    let ops = a.ops;
    let ql_nope = a.absorb_q(t)?;
    let mut qrow = ops.canary(t * nh * (l + r))?;
    ops.copy2d(&ql_nope, &mut qrow, cp(t * nh, l, 0, l, 0, l + r))?;
    ops.copy2d(a.q_pe_roped, &mut qrow, cp(t * nh, r, 0, r, l, l + r))?;
    let mut cs = CacheState::new(ops, batch, a.cfg, a.opts)?;
    let mut attn_latent = ops.canary(t * nh * l)?;
    let mut lse = ops.canary(t * nh)?;
    let offsets = batch.offsets();
    let max_len = batch.seqs.iter().map(|s| s.len).max().unwrap_or(0);
    for i in 0..max_len {
        let seqs: Vec<usize> = (0..batch.seqs.len()).filter(|&s| batch.seqs[s].len > i).collect();
        let rows: Vec<usize> = seqs.iter().map(|&s| offsets[s] + i).collect();
        let pos = vec![i; seqs.len()];
        cs.write(a, &rows, &seqs, &pos)?;
        let (lat, ls) = if a.sel.is_some() {
            let slots: Vec<Vec<usize>> = rows
                .iter()
                .zip(&seqs)
                .map(|(&row, &s)| kept_slots(a, &cs, row, s, i + 1))
                .collect();
            decode_rows_sparse(a, &cs, &qrow, &rows, &slots, empty_rows)?
        } else {
            let ctx = vec![i + 1; seqs.len()];
            decode_rows(a, &cs, &qrow, &rows, &seqs, &ctx, empty_rows)?
        };
        ops.scatter_rows(&mut attn_latent, &lat, nh * l, &rows)?;
        ops.scatter_rows(&mut lse, &ls, nh, &rows)?;
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

/// Expanded prefill (vLLM `forward_mha`) on one rank: K/V through `kv_b_proj`, tiled causal
/// attention over each sequence.
fn mha_rank<O: Ops>(a: &RankAttn<'_, O>, batch: &Batch) -> Result<RankOut<O::Buf>> {
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
            &qf,
            &kf,
            &vv,
            nh,
            p + r,
            v,
            &RankAttn::<O>::causal_segments(&seqs),
            a.scale,
            EmptyRows::ZeroMinusInf,
            &mut result,
            &mut lse,
        )?;
        (result, lse)
    };
    Ok(RankOut {
        out: a.deliver(result, t * nh * v)?,
        lse,
        k_nope: Some(k_nope),
        v: Some(vv),
        ql_nope: None,
        attn_latent: None,
    })
}

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
fn chunked_rank<O: Ops>(
    a: &RankAttn<'_, O>,
    batch: &Batch,
    empty_rows: &mut BTreeSet<usize>,
    notes: &mut Vec<String>,
) -> Result<RankOut<O::Buf>> {
    let t = batch.n_tokens();
    let (l, p, r, v, nh) = (
        a.cfg.kv_lora_rank,
        a.cfg.qk_nope_head_dim,
        a.cfg.qk_rope_head_dim,
        a.cfg.v_head_dim,
        a.nh,
    );
    let ops = a.ops;
    let f = &a.opts.faults;
    let split = chunked_split(batch, a.opts.new_tokens);
    let offsets = batch.offsets();
    let (k_nope, vv) = a.expand_kv(a.kv_c_normed, t)?;
    let qf = a.full_q(t)?;
    let kf = a.full_k(&k_nope, a.k_pe_roped, t)?;
    let mut result = ops.canary(t * nh * v)?;
    let mut lse = ops.canary(t * nh)?;

    // Phase 1: context tokens, causal, and into the cache.
    let ctx_seqs: Vec<(usize, usize)> = split
        .iter()
        .zip(&offsets)
        .filter(|(x, _)| x.0 > 0)
        .map(|(x, &off)| (off, x.0))
        .collect();
    a.causal_into(&qf, &kf, &vv, &ctx_seqs, &mut result, &mut lse)?;
    let mut cs = CacheState::new(ops, batch, a.cfg, a.opts)?;
    let (mut rows, mut seqs, mut pos) = (Vec::new(), Vec::new(), Vec::new());
    for (si, (&(c, _), &off)) in split.iter().zip(&offsets).enumerate() {
        for i in 0..c {
            rows.push(off + i);
            seqs.push(si);
            pos.push(i);
        }
    }
    cs.write(a, &rows, &seqs, &pos)?;

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
        // Gather this chunk's context rows of every sequence from the cache and expand them.
        let mut slots = Vec::new();
        let mut segs = Vec::new();
        let mut q_off = 0;
        for (si, &(c, n)) in split.iter().enumerate() {
            let keys = c0.min(c)..(c0 + chunk).min(c);
            if let Some(sel) = a.sel {
                // DSA: each new token reads only its kept keys of this chunk.
                for j in 0..n {
                    let row = offsets[si] + c + j;
                    let k_off = slots.len();
                    slots.extend(
                        sel.rows[row]
                            .iter()
                            .filter(|p| keys.contains(p))
                            .map(|&p| cs.slot(si, p)),
                    );
                    if slots.len() == k_off {
                        skipped += 1;
                        empty_rows.insert(row);
                    }
                    segs.push(Segment {
                        q_off: q_off + j,
                        q_len: 1,
                        k_off,
                        k_len: slots.len() - k_off,
                        causal: false,
                    });
                }
                q_off += n;
                continue;
            }
            let k_off = slots.len();
            for pos in keys.clone() {
                slots.push(cs.slot(si, pos));
            }
            if keys.is_empty() {
                skipped += n;
                for j in 0..n {
                    empty_rows.insert(offsets[si] + c + j);
                }
            }
            segs.push(Segment {
                q_off,
                q_len: n,
                k_off,
                k_len: keys.len(),
                causal: false,
            });
            q_off += n;
        }
        if slots.is_empty() {
            // No row keeps a key of this chunk: one written slot, never read, keeps the gather
            // non-empty.
            if let Some(si) = split.iter().position(|x| x.0 > 0) {
                slots.push(cs.slot(si, 0));
            }
        }
        let nk = slots.len();
        let rows_c = ops.gather_rows(&cs.cache, cs.width, &slots)?;
        let mut kv_c = ops.canary(nk * l)?;
        ops.copy2d(&rows_c, &mut kv_c, cp(nk, l, 0, cs.width, 0, l))?;
        let mut kpe = ops.canary(nk * r)?;
        ops.copy2d(&rows_c, &mut kpe, cp(nk, r, l, cs.width, 0, r))?;
        let (ck, cv) = a.expand_kv(&kv_c, nk)?;
        let ckf = a.full_k(&ck, &kpe, nk)?;
        let mut po = ops.canary(t_new * nh * v)?;
        let mut pl = ops.canary(t_new * nh)?;
        ops.flash_attention(&qn, &ckf, &cv, nh, p + r, v, &segs, a.scale, empty, &mut po, &mut pl)?;
        ops.copy2d(&po, &mut parts, cp(1, t_new * nh * v, 0, 0, ci * t_new * nh * v, 0))?;
        ops.copy2d(&pl, &mut lses, cp(1, t_new * nh, 0, 0, ci * t_new * nh, 0))?;
    }
    if f.has(Fault::UnwrittenRows) || f.has(Fault::LsePlusInf) {
        notes.push(if skipped > 0 {
            format!("{skipped} (new token, chunk) rows had no context keys and got the faulty empty-row handling")
        } else {
            "no context chunk was empty for any row: the empty-row fault had nothing to act on (use several --seqs of different lengths)".into()
        });
    }
    // The new tokens among themselves, causal (DSA: their kept keys among them).
    let (so, sl) = if a.sel.is_some() {
        let keys: Vec<Vec<usize>> = split
            .iter()
            .zip(&offsets)
            .flat_map(|(&(c, n), &off)| (c..c + n).map(move |i| (off, c, i)))
            .map(|(off, c, i)| a.kept(off + i, off, c..i + 1))
            .collect();
        a.sparse_rows(&qf, &new_rows, &kf, &vv, &keys, EmptyRows::ZeroMinusInf)?
    } else {
        let sk = ops.gather_rows(&kf, nh * (p + r), &new_rows)?;
        let sv = ops.gather_rows(&vv, nh * v, &new_rows)?;
        let mut q_off = 0;
        let suffix: Vec<(usize, usize)> = split
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
            &qn,
            &sk,
            &sv,
            nh,
            p + r,
            v,
            &RankAttn::<O>::causal_segments(&suffix),
            a.scale,
            EmptyRows::ZeroMinusInf,
            &mut so,
            &mut sl,
        )?;
        (so, sl)
    };
    ops.copy2d(
        &so,
        &mut parts,
        cp(1, t_new * nh * v, 0, 0, n_chunks * t_new * nh * v, 0),
    )?;
    ops.copy2d(&sl, &mut lses, cp(1, t_new * nh, 0, 0, n_chunks * t_new * nh, 0))?;
    // merge_attn_states over all partials.
    let (mo, ml) = ops.merge(&parts, &lses, k_parts, t_new, nh, v)?;
    ops.scatter_rows(&mut result, &mo, nh * v, &new_rows)?;
    ops.scatter_rows(&mut lse, &ml, nh, &new_rows)?;
    Ok(RankOut {
        out: a.deliver(result, t * nh * v)?,
        lse,
        k_nope: Some(k_nope),
        v: Some(vv),
        ql_nope: None,
        attn_latent: None,
    })
}

/// Which sequences of a mixed batch are decodes: the first ⌈S/2⌉ (vLLM puts decodes first).
pub fn mixed_decode_seqs(batch: &Batch) -> usize {
    batch.seqs.len().div_ceil(2)
}

/// A mixed batch (vLLM `MLACommonImpl.forward`) on one rank. Earlier steps prefilled every
/// decode sequence except its last token (into the cache). This step's packed batch is
/// `[one decode token per decode sequence | every token of the prefill sequences]`; decode rows
/// `[:num_decodes]` go through the absorbed path, the rest through the expanded path, and both
/// write into ONE caller-allocated output by row offset.
fn mixed_rank<O: Ops>(a: &RankAttn<'_, O>, batch: &Batch, empty_rows: &mut BTreeSet<usize>) -> Result<RankOut<O::Buf>> {
    let t = batch.n_tokens();
    let (l, p, r, v, nh) = (
        a.cfg.kv_lora_rank,
        a.cfg.qk_nope_head_dim,
        a.cfg.qk_rope_head_dim,
        a.cfg.v_head_dim,
        a.nh,
    );
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
        let ql_nope = a.absorb_q(t)?;
        let mut qrow = ops.canary(t * nh * (l + r))?;
        ops.copy2d(&ql_nope, &mut qrow, cp(t * nh, l, 0, l, 0, l + r))?;
        ops.copy2d(a.q_pe_roped, &mut qrow, cp(t * nh, r, 0, r, l, l + r))?;
        let dec_seqs: Vec<usize> = (0..n_dec).collect();
        let ctx: Vec<usize> = dec_seqs.iter().map(|&s| batch.seqs[s].len).collect();
        let (lat, ls) = if a.sel.is_some() {
            let slots: Vec<Vec<usize>> = dec_rows
                .iter()
                .zip(&dec_seqs)
                .zip(&ctx)
                .map(|((&row, &s), &c)| kept_slots(a, &cs, row, s, c))
                .collect();
            decode_rows_sparse(a, &cs, &qrow, &dec_rows, &slots, empty_rows)?
        } else {
            decode_rows(a, &cs, &qrow, &dec_rows, &dec_seqs, &ctx, empty_rows)?
        };
        let dec_out = ops.bmm_heads(&lat, n_dec, nh, l, &a.rw.w_uv, v)?;
        ops.copy2d(&dec_out, &mut step_out, cp(1, n_dec * nh * v, 0, 0, 0, 0))?;
        ops.copy2d(&ls, &mut step_lse, cp(1, n_dec * nh, 0, 0, 0, 0))?;
    }
    // Prefill part: rows [num_decodes, n_step), expanded, causal per sequence.
    if !pre_rows.is_empty() && a.sel.is_some() {
        let keys: Vec<Vec<usize>> = (n_dec..batch.seqs.len())
            .flat_map(|si| (0..batch.seqs[si].len).map(move |i| (si, i)))
            .map(|(si, i)| a.kept(offsets[si] + i, offsets[si], 0..i + 1))
            .collect();
        let np = pre_rows.len();
        let (po, pl) = a.sparse_rows(&qf, &pre_rows, &kf, &vv, &keys, EmptyRows::ZeroMinusInf)?;
        ops.copy2d(&po, &mut step_out, cp(1, np * nh * v, 0, 0, n_dec * nh * v, 0))?;
        ops.copy2d(&pl, &mut step_lse, cp(1, np * nh, 0, 0, n_dec * nh, 0))?;
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
            &pq,
            &pk,
            &pv,
            nh,
            p + r,
            v,
            &RankAttn::<O>::causal_segments(&segs),
            a.scale,
            EmptyRows::ZeroMinusInf,
            &mut po,
            &mut pl,
        )?;
        ops.copy2d(&po, &mut step_out, cp(1, np * nh * v, 0, 0, n_dec * nh * v, 0))?;
        ops.copy2d(&pl, &mut step_lse, cp(1, np * nh, 0, 0, n_dec * nh, 0))?;
    }
    // Scatter the step's rows back to packed token order.
    ops.scatter_rows(&mut result, &step_out, nh * v, &step_rows)?;
    ops.scatter_rows(&mut lse, &step_lse, nh, &step_rows)?;
    // Every invocation of the attention op (earlier steps and this one) has the same contract.
    Ok(RankOut {
        out: a.deliver(result, t * nh * v)?,
        lse,
        k_nope: Some(k_nope),
        v: Some(vv),
        ql_nope: None,
        attn_latent: None,
    })
}

/// One optional per-rank output from every rank, or `None` if any rank lacks it.
fn pick_all<B>(outs: &[RankOut<B>], f: fn(&RankOut<B>) -> Option<&B>) -> Option<Vec<&B>> {
    outs.iter().map(f).collect()
}

/// Runs one path for one layer on backend `ops`.
///
/// Errors: `--tp` not dividing N, shapes inconsistent with the configuration, a sequence of
/// length 0, backend errors. An unservable TP cut is not an error: it comes back in
/// [`PathRun::unservable`].
pub fn run<O: Ops>(ops: &O, kind: PathKind, input: &LayerInput<'_>, opts: &PathOptions) -> Result<PathRun> {
    let cfg = input.cfg;
    let t = input.batch.n_tokens();
    if kind == PathKind::Dump {
        return Err(Error::Usage(
            "`dump` is an external engine's trace, not a path mla-diff runs".into(),
        ));
    }
    if input.hidden_in.shape() != [t, cfg.hidden] {
        return Err(Error::Usage(format!(
            "hidden_in has shape {:?}, expected [T={t}, H={}]",
            input.hidden_in.shape(),
            cfg.hidden
        )));
    }
    if opts.tp == 0 || !cfg.n_head.is_multiple_of(opts.tp) {
        return Err(Error::Usage(format!(
            "--tp {} does not divide the {} attention heads of {}",
            opts.tp,
            cfg.n_head,
            input.file.path().display()
        )));
    }
    if input.batch.seqs.iter().any(|s| s.len == 0) {
        return Err(Error::Usage("every sequence needs at least one token".into()));
    }
    let layer = input.weights.layer;
    let mut notes = Vec::new();
    let ew = match EngineWeights::load(ops, input, opts, &mut notes) {
        Ok(ew) => ew,
        Err(LoadError::Unservable(u)) => {
            return Ok(PathRun {
                kind,
                trace: Trace::new(),
                empty_partial_rows: Vec::new(),
                unservable: Some(u),
                notes,
            });
        }
        Err(LoadError::Other(e)) => return Err(e),
    };
    let mut tr = Trace::new();
    let pro = prologue(ops, input, &ew, opts, &mut tr)?;
    let own_sel = engine_indexer(ops, input, opts, kind, &pro, &mut tr, &mut notes)?;
    if (opts.faults.has(Fault::RopeNeox) || opts.faults.has(Fault::IndexerRopeInterleaved))
        && input.batch.positions().iter().all(|&p| p == 0)
    {
        notes.push(
            "every token is at position 0, where RoPE is the identity: the RoPE fault had nothing to act on (use more tokens or --start-pos)"
                .into(),
        );
    }
    let sel = match (&own_sel, input.forced_selection) {
        (Some(_), Some(forced)) => Some(forced.clone()),
        _ => own_sel,
    };
    let (n, hd, l, p, r, v) = (
        cfg.n_head,
        cfg.hidden,
        cfg.kv_lora_rank,
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.v_head_dim,
    );
    let q_k = cfg.q_lora_rank.unwrap_or(hd);
    let tp = opts.tp;
    let nh = n / tp;
    if tp > 1 {
        for (rank, rw) in ew.ranks.iter().enumerate() {
            let rk = rank as u32;
            rec(
                ops,
                &mut tr,
                layer,
                Stage::WRank(RankedWeight::QProj, rk),
                &[nh * (p + r), q_k],
                &rw.q_proj,
            )?;
            // The absorbed path never holds kv_b itself (only W_UK_T / W_UV derived from it).
            if kind != PathKind::Mqa {
                rec(
                    ops,
                    &mut tr,
                    layer,
                    Stage::WRank(RankedWeight::KvB, rk),
                    &[nh * (p + v), l],
                    &rw.kv_b,
                )?;
            }
            rec(
                ops,
                &mut tr,
                layer,
                Stage::WRank(RankedWeight::OProj, rk),
                &[hd, nh * v],
                &rw.o_proj,
            )?;
        }
    }
    let gather_host = |bufs: Vec<&O::Buf>| -> Result<Vec<f32>> {
        let mut out = Vec::new();
        for b in bufs {
            out.extend(ops.download(b)?);
        }
        Ok(out)
    };
    if kind != PathKind::Mqa {
        let kvb = gather_host(ew.ranks.iter().map(|rw| &rw.kv_b).collect())?;
        tr.record(
            Site::new(layer, Stage::WKvB),
            TraceTensor::f32(vec![n * (p + v), l], kvb),
        );
    }
    if matches!(kind, PathKind::Mqa | PathKind::Mixed) {
        let wk = gather_host(ew.ranks.iter().map(|rw| &rw.w_uk_t).collect())?;
        let wv = gather_host(ew.ranks.iter().map(|rw| &rw.w_uv).collect())?;
        tr.record(Site::new(layer, Stage::WUkT), TraceTensor::f32(vec![n, p, l], wk));
        tr.record(Site::new(layer, Stage::WUv), TraceTensor::f32(vec![n, l, v], wv));
    }
    let scale = if opts.faults.has(Fault::NoMscale) {
        (cfg.qk_head_dim() as f64).powf(-0.5) as f32
    } else {
        cfg.softmax_scale as f32
    };
    let mut empty_rows = BTreeSet::new();
    let mut outs = Vec::with_capacity(tp);
    for (rank, rw) in ew.ranks.iter().enumerate() {
        let a = RankAttn {
            ops,
            cfg,
            rw,
            nh,
            q: &pro.q[rank],
            q_pe_roped: &pro.q_pe_roped[rank],
            kv_c_normed: &pro.kv_c_normed,
            k_pe_roped: &pro.k_pe_roped,
            scale,
            opts,
            sel: sel.as_ref(),
        };
        outs.push(match kind {
            PathKind::Mha => mha_rank(&a, input.batch)?,
            PathKind::Mqa => mqa_rank(&a, input.batch, &mut empty_rows)?,
            PathKind::Chunked => chunked_rank(&a, input.batch, &mut empty_rows, &mut notes)?,
            PathKind::Mixed => mixed_rank(&a, input.batch, &mut empty_rows)?,
            PathKind::Dump => unreachable!("rejected at the top of run"),
        });
    }
    let pick = |f: fn(&RankOut<O::Buf>) -> Option<&O::Buf>| pick_all(&outs, f);
    if let Some(k) = pick(|o| o.k_nope.as_ref()) {
        tr.record(
            Site::new(layer, Stage::KNope),
            TraceTensor::f32(vec![t, n, p], reassemble(ops, &k, t, nh, p)?),
        );
    }
    if let Some(x) = pick(|o| o.v.as_ref()) {
        tr.record(
            Site::new(layer, Stage::V),
            TraceTensor::f32(vec![t, n, v], reassemble(ops, &x, t, nh, v)?),
        );
    }
    if let Some(x) = pick(|o| o.ql_nope.as_ref()) {
        tr.record(
            Site::new(layer, Stage::QlNope),
            TraceTensor::f32(vec![t, n, l], reassemble(ops, &x, t, nh, l)?),
        );
    }
    if let Some(x) = pick(|o| o.attn_latent.as_ref()) {
        tr.record(
            Site::new(layer, Stage::AttnLatent),
            TraceTensor::f32(vec![t, n, l], reassemble(ops, &x, t, nh, l)?),
        );
    }
    let lse: Vec<&O::Buf> = outs.iter().map(|o| &o.lse).collect();
    tr.record(
        Site::new(layer, Stage::Lse),
        TraceTensor::f32(vec![t, n], reassemble(ops, &lse, t, nh, 1)?),
    );
    let attn: Vec<&O::Buf> = outs.iter().map(|o| &o.out).collect();
    tr.record(
        Site::new(layer, Stage::AttnOut),
        TraceTensor::f32(vec![t, n, v], reassemble(ops, &attn, t, nh, v)?),
    );

    // o_proj is row-parallel: per-rank partial sums, all-reduced in rank order.
    let mut o: Option<O::Buf> = None;
    for (rw, ro) in ew.ranks.iter().zip(&outs) {
        let part = ops.linear(&ro.out, t, nh * v, &rw.o_proj, hd)?;
        o = Some(match o {
            None => part,
            Some(acc) => ops.add(&acc, &part, t * hd)?,
        });
    }
    let o = o.ok_or_else(|| Error::Usage("no TP rank".into()))?;
    rec(ops, &mut tr, layer, Stage::OProj, &[t, hd], &o)?;
    if let Some(ffn) = &ew.ffn {
        // MiniCPM3 scales each residual branch (llama.cpp `scale_res`); on the host, once.
        let rs = cfg.residual_scale as f32;
        let scaled = |b: &O::Buf| -> Result<O::Buf> {
            let v: Vec<f32> = ops.download(b)?.into_iter().map(|x| x * rs).collect();
            ops.upload(&v)
        };
        let h1 = if rs != 1.0 {
            ops.add(&pro.hidden, &scaled(&o)?, t * hd)?
        } else {
            ops.add(&pro.hidden, &o, t * hd)?
        };
        let xn = ops.rms_norm(&h1, t, 0, hd, hd, &ffn.norm, cfg.rms_eps as f32)?;
        let gate = ops.linear(&xn, t, hd, &ffn.gate, ffn.f)?;
        let up = ops.linear(&xn, t, hd, &ffn.up, ffn.f)?;
        let act = ops.silu_mul(&gate, &up, t * ffn.f)?;
        let down = ops.linear(&act, t, ffn.f, &ffn.down, hd)?;
        let down = if rs != 1.0 { scaled(&down)? } else { down };
        let out = ops.add(&h1, &down, t * hd)?;
        rec(ops, &mut tr, layer, Stage::HiddenOut, &[t, hd], &out)?;
    }
    Ok(PathRun {
        kind,
        trace: tr,
        empty_partial_rows: empty_rows.into_iter().collect(),
        unservable: None,
        notes,
    })
}
