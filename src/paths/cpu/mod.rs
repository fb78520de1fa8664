//! The CPU backend: vLLM's MLA layer, step by step, in f32 on the CPU.
//!
//! This is the backend that runs everywhere (CI has no GPU), so it carries the full engine
//! structure: the `fused_qkv_a_proj` weight merged from its two GGUF shards, strided views for
//! `q_c`/`kv_c`, a cos/sin cache, `kv_b_proj` rebuilt from the split GGUF pair, `W_UK_T`/`W_UV`
//! derived from it the way vLLM's `process_weights_after_loading` does, a paged latent cache
//! behind a shuffled block table, split-KV decode, chunked context with the LSE merge, mixed
//! decode/prefill batches, and simulated tensor parallelism with shards cut from the raw
//! quantized bytes. Faults of [`crate::faults`] act at the place the real bug lived. Kernels are
//! in [`ops`].

pub mod ops;

use std::collections::BTreeSet;
use std::ops::Range;

use ndarray::{Array2, Array3, Axis, s};
use rayon::prelude::*;

use super::{LayerInput, PathKind, PathOptions, PathRun, Unservable, canary_vec};
use crate::batch::SplitMix64;
use crate::config::{KvBLayout, MlaConfig};
use crate::error::{Error, Result};
use crate::faults::Fault;
use crate::trace::{RankedWeight, Site, Stage, Trace, TraceTensor};
use crate::weights::{SliceError, dequant_cols, dequant_rows, tensor_name};
use ops::{EmptyRows, PagedLatentCache, RopeCache, RopeStyle, Segment};

fn shape_err(e: ndarray::ShapeError) -> Error {
    Error::Usage(format!("internal shape error in the CPU backend: {e}"))
}

/// One TP rank's shards, as that rank's loader produced them.
struct RankWeights {
    /// `q_b_proj` / `q_proj` rows of this rank's heads, [nh·(P+R), Lq or H].
    q_proj: Array2<f32>,
    /// `kv_b_proj` rows of this rank's heads, [nh·(P+V), L].
    kv_b: Array2<f32>,
    /// `W_UK_T` of this rank's heads, [nh, P, L].
    w_uk_t: Array3<f32>,
    /// `W_UV` of this rank's heads, [nh, L, V].
    w_uv: Array3<f32>,
    /// `o_proj` columns (input dim) of this rank's heads, [H, nh·V].
    o_proj: Array2<f32>,
}

/// The weights as an engine holds them after loading.
struct EngineWeights {
    /// `fused_qkv_a_proj` [Lq+L+R, H] (with Lq), replicated on every rank.
    fused_qkv_a: Option<Array2<f32>>,
    /// `kv_a_proj_with_mqa` [L+R, H] (without Lq), replicated.
    kv_a: Option<Array2<f32>>,
    /// Per-rank shards.
    ranks: Vec<RankWeights>,
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

impl EngineWeights {
    fn load(input: &LayerInput<'_>, opts: &PathOptions, notes: &mut Vec<String>) -> Result<Self, LoadError> {
        let cfg = input.cfg;
        let file = input.file;
        let w = input.weights;
        let layer = w.layer;
        let (n, l, p, r, v) = (
            cfg.n_head,
            cfg.kv_lora_rank,
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
        );
        let f = &opts.faults;
        let tp = opts.tp;
        let name = |s: &str| tensor_name(layer, s);

        let (fused_qkv_a, kv_a) = match &w.q {
            crate::weights::QWeights::Lora { q_a, .. } => {
                // MergedColumnParallelLinear: shard 0 = q_a_proj, shard 1 = kv_a_proj_with_mqa.
                let shards = if f.has(Fault::FusedShardSwap) {
                    [w.kv_a_mqa.view(), q_a.view()]
                } else {
                    [q_a.view(), w.kv_a_mqa.view()]
                };
                (Some(ndarray::concatenate(Axis(0), &shards).map_err(shape_err)?), None)
            }
            crate::weights::QWeights::Direct { .. } => (None, Some(w.kv_a_mqa.clone())),
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
                if let Err(e) = dequant_cols(file, &t, cols) {
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
            let q_proj = dequant_rows(file, &q_tensor, qh.start * (p + r)..qh.end * (p + r))?;
            let kh = rank_heads(n, tp, source(rank, RankedWeight::KvB));
            let nh = kh.len();
            let kv_b = match cfg.kv_b_layout {
                KvBLayout::Fused => dequant_rows(file, &name("attn_kv_b"), kh.start * (p + v)..kh.end * (p + v))?,
                KvBLayout::Split => {
                    // attn_k_b is [N, L, P] (rows of P); attn_v_b is [N, V, L] (rows of L).
                    let k_b = dequant_rows(file, &name("attn_k_b"), kh.start * l..kh.end * l)?;
                    let v_b = dequant_rows(file, &name("attn_v_b"), kh.start * v..kh.end * v)?;
                    let mut kv_b = Array2::<f32>::zeros((nh * (p + v), l));
                    for h in 0..nh {
                        let kb = k_b.slice(s![h * l..(h + 1) * l, ..]); // [L, P]
                        let k_rows = if f.has(Fault::KBUntransposed) {
                            // Reshape instead of transpose: the [L, P] bytes read as [P, L].
                            Array2::from_shape_vec((p, l), kb.iter().copied().collect()).map_err(shape_err)?
                        } else {
                            kb.t().to_owned()
                        };
                        kv_b.slice_mut(s![h * (p + v)..h * (p + v) + p, ..]).assign(&k_rows);
                        kv_b.slice_mut(s![h * (p + v) + p..(h + 1) * (p + v), ..])
                            .assign(&v_b.slice(s![h * v..(h + 1) * v, ..]));
                    }
                    kv_b
                }
            };
            // process_weights_after_loading: split kv_b into W_UK_T / W_UV per head.
            let (w_uk_t, w_uv) = if f.has(Fault::KvBGrouped) {
                // [all k rows | all v rows] instead of per head.
                let wk = kv_b
                    .slice(s![..nh * p, ..])
                    .to_owned()
                    .into_shape_with_order((nh, p, l))
                    .map_err(shape_err)?;
                let wv = kv_b
                    .slice(s![nh * p.., ..])
                    .to_owned()
                    .into_shape_with_order((nh, v, l))
                    .map_err(shape_err)?
                    .permuted_axes([0, 2, 1])
                    .as_standard_layout()
                    .to_owned();
                (wk, wv)
            } else {
                let kv3 = kv_b.view().into_shape_with_order((nh, p + v, l)).map_err(shape_err)?;
                (
                    kv3.slice(s![.., ..p, ..]).to_owned(),
                    kv3.slice(s![.., p.., ..])
                        .permuted_axes([0, 2, 1])
                        .as_standard_layout()
                        .to_owned(),
                )
            };
            let oh = rank_heads(n, tp, source(rank, RankedWeight::OProj));
            let o_proj = dequant_cols(file, &name("attn_output"), oh.start * v..oh.end * v).map_err(|e| {
                slice_to_load(
                    Site::new(layer, Stage::WRank(RankedWeight::OProj, rank as u32)),
                    "o_proj is row-parallel: its input dim N·V is cut by heads",
                    e,
                )
            })?;
            ranks.push(RankWeights {
                q_proj,
                kv_b,
                w_uk_t,
                w_uv,
                o_proj,
            });
        }
        Ok(EngineWeights {
            fused_qkv_a,
            kv_a,
            ranks,
        })
    }
}

/// Records a row-major f32 buffer at `stage`.
fn rec(tr: &mut Trace, layer: usize, stage: Stage, shape: &[usize], data: &[f32]) {
    tr.record(Site::new(layer, stage), TraceTensor::f32(shape.to_vec(), data.to_vec()));
}

fn rec_arr<D: ndarray::Dimension>(tr: &mut Trace, layer: usize, stage: Stage, a: &ndarray::Array<f32, D>) {
    let std = a.as_standard_layout();
    tr.record(
        Site::new(layer, stage),
        TraceTensor::f32(a.shape().to_vec(), std.iter().copied().collect()),
    );
}

/// Concatenates per-rank `[T, nh, X]` buffers along heads into `[T, N, X]`.
fn reassemble_heads(parts: &[Vec<f32>], t: usize, nh: usize, x: usize) -> Vec<f32> {
    let tp = parts.len();
    let mut out = vec![0f32; t * tp * nh * x];
    for ti in 0..t {
        for (r, part) in parts.iter().enumerate() {
            let src = &part[ti * nh * x..(ti + 1) * nh * x];
            out[(ti * tp + r) * nh * x..(ti * tp + r + 1) * nh * x].copy_from_slice(src);
        }
    }
    out
}

/// The shared MLA prologue's outputs, and each rank's query.
struct Prologue {
    /// Per rank: `q` [T, nh, P+R] (q_pe part not yet rotated).
    q: Vec<Vec<f32>>,
    /// Per rank: `q_pe_roped` [T, nh, R].
    q_pe_roped: Vec<Vec<f32>>,
    /// `kv_c_normed` [T, L].
    kv_c_normed: Vec<f32>,
    /// `k_pe_roped` [T, R].
    k_pe_roped: Vec<f32>,
}

/// Inverse RoPE frequencies with YaRN, computed the way vLLM's `DeepseekScalingRotaryEmbedding`
/// does (correction range from beta_fast/beta_slow, linear ramp, interpolation blend).
fn engine_inv_freq(cfg: &MlaConfig) -> Vec<f64> {
    let r = cfg.qk_rope_head_dim as f64;
    let base = cfg.rope_base;
    let half = cfg.qk_rope_head_dim / 2;
    let extrapolation: Vec<f64> = (0..half).map(|i| 1.0 / base.powf(2.0 * i as f64 / r)).collect();
    let Some(y) = cfg.yarn else {
        return extrapolation;
    };
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

fn prologue(input: &LayerInput<'_>, ew: &EngineWeights, opts: &PathOptions, tr: &mut Trace) -> Result<Prologue> {
    let cfg = input.cfg;
    let w = input.weights;
    let layer = w.layer;
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
    let hidden = input.hidden_in.as_standard_layout();
    let hidden_s = hidden.as_slice().unwrap_or(&[]);
    rec(tr, layer, Stage::HiddenIn, &[t, hd], hidden_s);

    let attn_in_v = ops::rms_norm_strided(hidden_s, t, hd, hd, w.attn_norm.as_slice().unwrap_or(&[]), eps);
    rec(tr, layer, Stage::AttnIn, &[t, hd], &attn_in_v);
    let attn_in = Array2::from_shape_vec((t, hd), attn_in_v).map_err(shape_err)?;

    let (q_input, kv_a) = match (&ew.fused_qkv_a, &ew.kv_a, &w.q) {
        (Some(fused), _, crate::weights::QWeights::Lora { q_a_norm, .. }) => {
            let lq = fused.nrows() - (l + r);
            rec_arr(tr, layer, Stage::WFusedQkvA, fused);
            let qkv = ops::linear(&attn_in, fused); // [T, Lq+L+R], split by the fixed sizes
            let q_c = qkv.slice(s![.., ..lq]).to_owned();
            rec_arr(tr, layer, Stage::QC, &q_c);
            // q_c is a strided view of the fused output (row stride Lq+L+R).
            let q_c_normed_v = ops::rms_norm_strided(
                qkv.as_slice().unwrap_or(&[]),
                t,
                lq + l + r,
                lq,
                q_a_norm.as_slice().unwrap_or(&[]),
                eps,
            );
            rec(tr, layer, Stage::QCNormed, &[t, lq], &q_c_normed_v);
            let q_c_normed = Array2::from_shape_vec((t, lq), q_c_normed_v).map_err(shape_err)?;
            (q_c_normed, qkv.slice(s![.., lq..]).to_owned())
        }
        (None, Some(kv_a_w), _) => {
            let kv_a = ops::linear(&attn_in, kv_a_w);
            (attn_in, kv_a)
        }
        _ => return Err(Error::Usage("CPU backend: inconsistent q weights".into())),
    };
    // Column-parallel q projection, per rank.
    let q: Vec<Vec<f32>> = ew
        .ranks
        .iter()
        .map(|rw| ops::linear(&q_input, &rw.q_proj).iter().copied().collect())
        .collect();
    rec(tr, layer, Stage::Q, &[t, n, p + r], &reassemble_heads(&q, t, nh, p + r));
    let kv_a_v: Vec<f32> = kv_a.iter().copied().collect();
    rec(tr, layer, Stage::KvA, &[t, l + r], &kv_a_v);

    // kv_c is a strided view of kv_a: rows of width L, row stride L+R.
    let stride = if f.has(Fault::StridedKvC) { l } else { l + r };
    let kv_c_normed = ops::rms_norm_strided(&kv_a_v, t, stride, l, w.kv_a_norm.as_slice().unwrap_or(&[]), eps);
    rec(tr, layer, Stage::KvCNormed, &[t, l], &kv_c_normed);
    let k_pe: Vec<f32> = (0..t)
        .flat_map(|i| kv_a_v[i * (l + r) + l..(i + 1) * (l + r)].to_vec())
        .collect();
    rec(tr, layer, Stage::KPe, &[t, r], &k_pe);

    let positions = input.batch.positions();
    let max_pos = positions.iter().copied().max().unwrap_or(0) + 1;
    let cos_scale = if f.has(Fault::RopeCosScaled) { cfg.mscale() } else { 1.0 };
    let style = if f.has(Fault::RopeNeox) {
        RopeStyle::Neox
    } else {
        RopeStyle::Interleaved
    };
    let rope = RopeCache::new(&engine_inv_freq(cfg), max_pos, cos_scale);
    let q_pe_roped: Vec<Vec<f32>> = q
        .iter()
        .map(|qr| {
            let mut out = vec![0f32; t * nh * r];
            for ti in 0..t {
                for h in 0..nh {
                    let dst = &mut out[(ti * nh + h) * r..(ti * nh + h + 1) * r];
                    dst.copy_from_slice(&qr[(ti * nh + h) * (p + r) + p..(ti * nh + h + 1) * (p + r)]);
                    rope.apply(dst, positions[ti], style);
                }
            }
            out
        })
        .collect();
    let mut k_pe_roped = k_pe;
    for ti in 0..t {
        rope.apply(&mut k_pe_roped[ti * r..(ti + 1) * r], positions[ti], style);
    }
    rec(
        tr,
        layer,
        Stage::QPeRoped,
        &[t, n, r],
        &reassemble_heads(&q_pe_roped, t, nh, r),
    );
    rec(tr, layer, Stage::KPeRoped, &[t, r], &k_pe_roped);
    Ok(Prologue {
        q,
        q_pe_roped,
        kv_c_normed,
        k_pe_roped,
    })
}

/// Per-rank attention inputs and settings shared by the attention variants.
struct RankAttn<'a> {
    cfg: &'a MlaConfig,
    rw: &'a RankWeights,
    /// Heads on this rank.
    nh: usize,
    /// `q` [T, nh, P+R].
    q: &'a [f32],
    /// `q_pe_roped` [T, nh, R].
    q_pe_roped: &'a [f32],
    /// `kv_c_normed` [T, L] (replicated).
    kv_c_normed: &'a [f32],
    /// `k_pe_roped` [T, R] (replicated).
    k_pe_roped: &'a [f32],
    /// Softmax scale the kernels use.
    scale: f32,
    opts: &'a PathOptions,
}

/// Expanded K/V of `rows` latent rows: `kv_b_proj` then the per-head split (or the grouped split
/// of the `kv-b-grouped` fault). Returns (`k_nope` [rows, nh, P], `v` [rows, nh, V]).
fn expand_kv(a: &RankAttn<'_>, kv_c: &[f32], rows: usize) -> Result<(Vec<f32>, Vec<f32>)> {
    let (l, p, v, nh) = (a.cfg.kv_lora_rank, a.cfg.qk_nope_head_dim, a.cfg.v_head_dim, a.nh);
    let x = Array2::from_shape_vec((rows, l), kv_c.to_vec()).map_err(shape_err)?;
    let kv = ops::linear(&x, &a.rw.kv_b); // [rows, nh·(P+V)]
    let kv_s = kv.as_slice().unwrap_or(&[]);
    let mut k_nope = vec![0f32; rows * nh * p];
    let mut vv = vec![0f32; rows * nh * v];
    let grouped = a.opts.faults.has(Fault::KvBGrouped);
    for ti in 0..rows {
        let row = &kv_s[ti * nh * (p + v)..(ti + 1) * nh * (p + v)];
        if grouped {
            k_nope[ti * nh * p..(ti + 1) * nh * p].copy_from_slice(&row[..nh * p]);
            vv[ti * nh * v..(ti + 1) * nh * v].copy_from_slice(&row[nh * p..]);
        } else {
            for h in 0..nh {
                let hr = &row[h * (p + v)..(h + 1) * (p + v)];
                k_nope[(ti * nh + h) * p..(ti * nh + h + 1) * p].copy_from_slice(&hr[..p]);
                vv[(ti * nh + h) * v..(ti * nh + h + 1) * v].copy_from_slice(&hr[p..]);
            }
        }
    }
    Ok((k_nope, vv))
}

/// `[q_nope | q_pe_roped]` for all T rows [T, nh, P+R].
fn full_q(a: &RankAttn<'_>, t: usize) -> Vec<f32> {
    let (p, r, nh) = (a.cfg.qk_nope_head_dim, a.cfg.qk_rope_head_dim, a.nh);
    let mut qf = vec![0f32; t * nh * (p + r)];
    for i in 0..t * nh {
        qf[i * (p + r)..i * (p + r) + p].copy_from_slice(&a.q[i * (p + r)..i * (p + r) + p]);
        qf[i * (p + r) + p..(i + 1) * (p + r)].copy_from_slice(&a.q_pe_roped[i * r..(i + 1) * r]);
    }
    qf
}

/// `[k_nope | k_pe_roped broadcast]` for `rows` rows [rows, nh, P+R].
fn full_k(a: &RankAttn<'_>, k_nope: &[f32], k_pe_roped: &[f32], rows: usize) -> Vec<f32> {
    let (p, r, nh) = (a.cfg.qk_nope_head_dim, a.cfg.qk_rope_head_dim, a.nh);
    let mut kf = vec![0f32; rows * nh * (p + r)];
    for ti in 0..rows {
        for h in 0..nh {
            let o = (ti * nh + h) * (p + r);
            kf[o..o + p].copy_from_slice(&k_nope[(ti * nh + h) * p..(ti * nh + h + 1) * p]);
            kf[o + p..o + p + r].copy_from_slice(&k_pe_roped[ti * r..(ti + 1) * r]);
        }
    }
    kf
}

/// What one rank's attention op produced. `out` is what the CALLER's buffer holds afterwards.
struct RankOut {
    /// `attn_out` [T, nh, V] as the caller sees it.
    out: Vec<f32>,
    /// `lse` [T, nh].
    lse: Vec<f32>,
    /// `k_nope` [T, nh, P] / `v` [T, nh, V] (expanded paths).
    k_nope: Option<Vec<f32>>,
    v: Option<Vec<f32>>,
    /// `ql_nope` and `attn_latent` [T, nh, L] (absorbed path).
    ql_nope: Option<Vec<f32>>,
    attn_latent: Option<Vec<f32>>,
}

/// The attention custom op's output contract: the op gets the caller-allocated `out` buffer and
/// must write it in place. With `phantom-output`, the op's result lands in a private tensor and
/// the caller's buffer stays as allocated (the canary).
fn deliver(result: Vec<f32>, caller_out: &mut [f32], phantom: bool) {
    if !phantom {
        caller_out.copy_from_slice(&result);
    }
}

/// Expanded prefill (vLLM `forward_mha`) on one rank: K/V through `kv_b_proj`, tiled causal
/// attention over each sequence.
fn mha_rank(a: &RankAttn<'_>, batch: &crate::batch::Batch) -> Result<RankOut> {
    let t = batch.n_tokens();
    let (p, r, v, nh) = (a.cfg.qk_nope_head_dim, a.cfg.qk_rope_head_dim, a.cfg.v_head_dim, a.nh);
    let (k_nope, vv) = expand_kv(a, a.kv_c_normed, t)?;
    let qf = full_q(a, t);
    let kf = full_k(a, &k_nope, a.k_pe_roped, t);
    let segments: Vec<Segment> = batch
        .seqs
        .iter()
        .zip(batch.offsets())
        .map(|(sq, off)| Segment {
            q_off: off,
            q_len: sq.len,
            k_off: off,
            k_len: sq.len,
            causal: true,
        })
        .collect();
    let mut out = canary_vec(t * nh * v);
    let mut lse = canary_vec(t * nh);
    let mut private = canary_vec(t * nh * v);
    ops::flash_attention(
        &qf,
        &kf,
        &vv,
        nh,
        p + r,
        v,
        &segments,
        a.scale,
        a.opts.tile,
        EmptyRows::ZeroMinusInf,
        &mut private,
        &mut lse,
    );
    deliver(private, &mut out, a.opts.faults.has(Fault::PhantomOutput));
    Ok(RankOut {
        out,
        lse,
        k_nope: Some(k_nope),
        v: Some(vv),
        ql_nope: None,
        attn_latent: None,
    })
}

/// `ql_nope = q_nope · W_UK_T` per head: [T, nh, L].
fn absorb_q(a: &RankAttn<'_>, t: usize) -> Vec<f32> {
    let (l, p, r, nh) = (a.cfg.kv_lora_rank, a.cfg.qk_nope_head_dim, a.cfg.qk_rope_head_dim, a.nh);
    let mut ql = canary_vec(t * nh * l);
    ql.par_chunks_mut(nh * l).enumerate().for_each(|(ti, row)| {
        for h in 0..nh {
            let qn = &a.q[(ti * nh + h) * (p + r)..(ti * nh + h) * (p + r) + p];
            let wk = a.rw.w_uk_t.slice(s![h, .., ..]);
            let o = &mut row[h * l..(h + 1) * l];
            o.iter_mut().for_each(|x| *x = 0.0);
            for (pi, &qv) in qn.iter().enumerate() {
                for (li, x) in o.iter_mut().enumerate() {
                    *x += qv * wk[[pi, li]];
                }
            }
        }
    });
    ql
}

/// `out = attn_latent · W_UV` per head for rows `rows`: [rows, nh, V].
fn unabsorb(a: &RankAttn<'_>, latent: &[f32], rows: usize) -> Vec<f32> {
    let (l, v, nh) = (a.cfg.kv_lora_rank, a.cfg.v_head_dim, a.nh);
    let mut out = canary_vec(rows * nh * v);
    out.par_chunks_mut(nh * v).enumerate().for_each(|(ti, row)| {
        for h in 0..nh {
            let lat = &latent[(ti * nh + h) * l..(ti * nh + h + 1) * l];
            let wv = a.rw.w_uv.slice(s![h, .., ..]);
            let o = &mut row[h * v..(h + 1) * v];
            o.iter_mut().for_each(|x| *x = 0.0);
            for (li, &x) in lat.iter().enumerate() {
                for (vi, y) in o.iter_mut().enumerate() {
                    *y += x * wv[[li, vi]];
                }
            }
        }
    });
    out
}

/// The paged latent cache and each sequence's (shuffled) block table.
struct CacheState {
    cache: PagedLatentCache,
    tables: Vec<Vec<usize>>,
}

impl CacheState {
    /// Enough pages for every sequence plus one spare, handed out in a shuffled order.
    fn new(batch: &crate::batch::Batch, cfg: &MlaConfig, opts: &PathOptions) -> Self {
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
        CacheState {
            cache: PagedLatentCache::new(num_blocks, page, cfg.kv_lora_rank + cfg.qk_rope_head_dim),
            tables,
        }
    }

    /// `concat_and_cache_mla` for position `i` of sequence `seq`: `kv_c` [L], `k_pe` [R].
    fn write(&mut self, seq: usize, i: usize, kv_c: &[f32], k_pe: &[f32]) {
        let page = self.cache.block_size;
        let slot = self.tables[seq][i / page] * page + i % page;
        self.cache.write(slot, kv_c, k_pe);
    }
}

/// Split-KV absorbed decode of one query row (packed `ti`) of sequence `seq` against its first
/// `ctx` cached positions, all heads: returns (latent [nh, L], lse [nh], any split empty).
fn decode_row(
    a: &RankAttn<'_>,
    cs: &CacheState,
    seq: usize,
    ti: usize,
    ctx: usize,
    ql_nope: &[f32],
) -> (Vec<f32>, Vec<f32>, bool) {
    let (l, r, nh) = (a.cfg.kv_lora_rank, a.cfg.qk_rope_head_dim, a.nh);
    let splits = a.opts.num_splits.max(1);
    let split_len = ctx.div_ceil(splits);
    let empty_lse = if a.opts.faults.has(Fault::LsePlusInf) {
        f32::INFINITY
    } else {
        f32::NEG_INFINITY
    };
    let any_empty = (0..splits).any(|s| (s * split_len).min(ctx) == ((s + 1) * split_len).min(ctx));
    let per_head: Vec<(Vec<f32>, f32)> = (0..nh)
        .into_par_iter()
        .map(|h| {
            let mut qrow = Vec::with_capacity(l + r);
            qrow.extend_from_slice(&ql_nope[(ti * nh + h) * l..(ti * nh + h + 1) * l]);
            qrow.extend_from_slice(&a.q_pe_roped[(ti * nh + h) * r..(ti * nh + h + 1) * r]);
            let mut partials = vec![canary_vec(l); splits];
            let mut lses = vec![f32::NEG_INFINITY; splits];
            for (sidx, part) in partials.iter_mut().enumerate() {
                let keys = (sidx * split_len).min(ctx)..((sidx + 1) * split_len).min(ctx);
                lses[sidx] = ops::decode_split(&qrow, &cs.cache, &cs.tables[seq], keys, a.scale, l, empty_lse, part);
            }
            let views: Vec<(&[f32], f32)> = partials
                .iter()
                .map(|x| x.as_slice())
                .zip(lses.iter().copied())
                .collect();
            let mut merged = canary_vec(l);
            let lse_m = ops::merge_states(&views, &mut merged);
            (merged, lse_m)
        })
        .collect();
    let mut lat = Vec::with_capacity(nh * l);
    let mut lse = Vec::with_capacity(nh);
    for (m, ls) in per_head {
        lat.extend_from_slice(&m);
        lse.push(ls);
    }
    (lat, lse, any_empty)
}

/// Absorbed decode (vLLM `forward_mqa`) on one rank: every token is decoded in order against the
/// paged latent cache, split-KV partials merged by LSE.
fn mqa_rank(a: &RankAttn<'_>, batch: &crate::batch::Batch, empty_rows: &mut BTreeSet<usize>) -> Result<RankOut> {
    let t = batch.n_tokens();
    let (l, r, v, nh) = (a.cfg.kv_lora_rank, a.cfg.qk_rope_head_dim, a.cfg.v_head_dim, a.nh);
    let ql_nope = absorb_q(a, t);
    let mut cs = CacheState::new(batch, a.cfg, a.opts);
    let mut attn_latent = canary_vec(t * nh * l);
    let mut lse = canary_vec(t * nh);
    for (si, (sq, off)) in batch.seqs.iter().zip(batch.offsets()).enumerate() {
        for i in 0..sq.len {
            let ti = off + i;
            cs.write(
                si,
                i,
                &a.kv_c_normed[(ti) * l..(ti + 1) * l],
                &a.k_pe_roped[(ti) * r..(ti + 1) * r],
            );
            let (lat, ls, any_empty) = decode_row(a, &cs, si, ti, i + 1, &ql_nope);
            if any_empty {
                empty_rows.insert(ti);
            }
            attn_latent[ti * nh * l..(ti + 1) * nh * l].copy_from_slice(&lat);
            lse[ti * nh..(ti + 1) * nh].copy_from_slice(&ls);
        }
    }
    let mut out = canary_vec(t * nh * v);
    deliver(
        unabsorb(a, &attn_latent, t),
        &mut out,
        a.opts.faults.has(Fault::PhantomOutput),
    );
    Ok(RankOut {
        out,
        lse,
        k_nope: None,
        v: None,
        ql_nope: Some(ql_nope),
        attn_latent: Some(attn_latent),
    })
}

/// Per sequence of the chunked path: (context length, new tokens).
pub fn chunked_split(batch: &crate::batch::Batch, new_tokens: usize) -> Vec<(usize, usize)> {
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
fn chunked_rank(
    a: &RankAttn<'_>,
    batch: &crate::batch::Batch,
    empty_rows: &mut BTreeSet<usize>,
    notes: &mut Vec<String>,
) -> Result<RankOut> {
    let t = batch.n_tokens();
    let (l, p, r, v, nh) = (
        a.cfg.kv_lora_rank,
        a.cfg.qk_nope_head_dim,
        a.cfg.qk_rope_head_dim,
        a.cfg.v_head_dim,
        a.nh,
    );
    let f = &a.opts.faults;
    let split = chunked_split(batch, a.opts.new_tokens);
    let offsets = batch.offsets();
    let (k_nope, vv) = expand_kv(a, a.kv_c_normed, t)?;
    let qf = full_q(a, t);
    let kf = full_k(a, &k_nope, a.k_pe_roped, t);
    let mut result = canary_vec(t * nh * v);
    let mut lse = canary_vec(t * nh);

    // Phase 1: context tokens, causal, and into the cache.
    let mut cs = CacheState::new(batch, a.cfg, a.opts);
    let ctx_segments: Vec<Segment> = split
        .iter()
        .zip(&offsets)
        .filter(|((c, _), _)| *c > 0)
        .map(|(&(c, _), &off)| Segment {
            q_off: off,
            q_len: c,
            k_off: off,
            k_len: c,
            causal: true,
        })
        .collect();
    ops::flash_attention(
        &qf,
        &kf,
        &vv,
        nh,
        p + r,
        v,
        &ctx_segments,
        a.scale,
        a.opts.tile,
        EmptyRows::ZeroMinusInf,
        &mut result,
        &mut lse,
    );
    for (si, (&(c, _), &off)) in split.iter().zip(&offsets).enumerate() {
        for i in 0..c {
            cs.write(
                si,
                i,
                &a.kv_c_normed[(off + i) * l..(off + i + 1) * l],
                &a.k_pe_roped[(off + i) * r..(off + i + 1) * r],
            );
        }
    }

    // Phase 2: the new tokens, packed [T_new, nh, ·].
    let new_rows: Vec<usize> = split
        .iter()
        .zip(&offsets)
        .flat_map(|(&(c, n), &off)| off + c..off + c + n)
        .collect();
    let t_new = new_rows.len();
    let mut qn = vec![0f32; t_new * nh * (p + r)];
    for (j, &ti) in new_rows.iter().enumerate() {
        qn[j * nh * (p + r)..(j + 1) * nh * (p + r)].copy_from_slice(&qf[ti * nh * (p + r)..(ti + 1) * nh * (p + r)]);
    }
    let max_ctx = split.iter().map(|x| x.0).max().unwrap_or(0);
    let chunk = a.opts.chunk_size.max(1);
    let empty = if f.has(Fault::UnwrittenRows) {
        EmptyRows::Skip
    } else if f.has(Fault::LsePlusInf) {
        EmptyRows::ZeroPlusInf
    } else {
        EmptyRows::ZeroMinusInf
    };
    let mut partials: Vec<(Vec<f32>, Vec<f32>)> = Vec::new();
    let mut skipped = 0usize;
    for c0 in (0..max_ctx).step_by(chunk) {
        // Gather this chunk's context rows of every sequence from the cache, expand them.
        let mut kv_c = Vec::new();
        let mut kpe = Vec::new();
        let mut segs = Vec::new();
        let mut q_off = 0;
        for (si, &(c, n)) in split.iter().enumerate() {
            let keys = c0.min(c)..(c0 + chunk).min(c);
            let k_off = kv_c.len() / l;
            for pos in keys.clone() {
                let row = cs.cache.row(&cs.tables[si], pos);
                kv_c.extend_from_slice(&row[..l]);
                kpe.extend_from_slice(&row[l..]);
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
        let rows = kv_c.len() / l;
        let (ck, cv) = if rows > 0 {
            expand_kv(a, &kv_c, rows)?
        } else {
            (Vec::new(), Vec::new())
        };
        let ckf = full_k(a, &ck, &kpe, rows);
        let mut po = canary_vec(t_new * nh * v);
        let mut pl = canary_vec(t_new * nh);
        ops::flash_attention(
            &qn,
            &ckf,
            &cv,
            nh,
            p + r,
            v,
            &segs,
            a.scale,
            a.opts.tile,
            empty,
            &mut po,
            &mut pl,
        );
        partials.push((po, pl));
    }
    if f.has(Fault::UnwrittenRows) || f.has(Fault::LsePlusInf) {
        notes.push(if skipped > 0 {
            format!("{skipped} (new token, chunk) rows had no context keys and got the faulty empty-row handling")
        } else {
            "no context chunk was empty for any row: the empty-row fault had nothing to act on (use several --seqs of different lengths)".into()
        });
    }
    // The new tokens among themselves, causal.
    let mut suffix_k = vec![0f32; t_new * nh * (p + r)];
    let mut suffix_v = vec![0f32; t_new * nh * v];
    for (j, &ti) in new_rows.iter().enumerate() {
        suffix_k[j * nh * (p + r)..(j + 1) * nh * (p + r)]
            .copy_from_slice(&kf[ti * nh * (p + r)..(ti + 1) * nh * (p + r)]);
        suffix_v[j * nh * v..(j + 1) * nh * v].copy_from_slice(&vv[ti * nh * v..(ti + 1) * nh * v]);
    }
    let mut q_off = 0;
    let suffix_segs: Vec<Segment> = split
        .iter()
        .map(|&(_, n)| {
            let sg = Segment {
                q_off,
                q_len: n,
                k_off: q_off,
                k_len: n,
                causal: true,
            };
            q_off += n;
            sg
        })
        .collect();
    let mut so = canary_vec(t_new * nh * v);
    let mut sl = canary_vec(t_new * nh);
    ops::flash_attention(
        &qn,
        &suffix_k,
        &suffix_v,
        nh,
        p + r,
        v,
        &suffix_segs,
        a.scale,
        a.opts.tile,
        EmptyRows::ZeroMinusInf,
        &mut so,
        &mut sl,
    );
    partials.push((so, sl));

    // merge_attn_states over all partials, per (row, head).
    for (j, &ti) in new_rows.iter().enumerate() {
        for h in 0..nh {
            let views: Vec<(&[f32], f32)> = partials
                .iter()
                .map(|(o, ls)| (&o[(j * nh + h) * v..(j * nh + h + 1) * v], ls[j * nh + h]))
                .collect();
            let mut merged = canary_vec(v);
            let lm = ops::merge_states(&views, &mut merged);
            result[(ti * nh + h) * v..(ti * nh + h + 1) * v].copy_from_slice(&merged);
            lse[ti * nh + h] = lm;
        }
    }
    let mut out = canary_vec(t * nh * v);
    deliver(result, &mut out, f.has(Fault::PhantomOutput));
    Ok(RankOut {
        out,
        lse,
        k_nope: Some(k_nope),
        v: Some(vv),
        ql_nope: None,
        attn_latent: None,
    })
}

/// Which sequences of a mixed batch are decodes: the first ⌈S/2⌉ (vLLM puts decodes first).
pub fn mixed_decode_seqs(batch: &crate::batch::Batch) -> usize {
    batch.seqs.len().div_ceil(2)
}

/// A mixed batch (vLLM `MLACommonImpl.forward`) on one rank. Earlier steps prefilled every
/// decode sequence except its last token (into the cache). This step's packed batch is
/// `[one decode token per decode sequence | every token of the prefill sequences]`; decode rows
/// `[:num_decodes]` go through the absorbed path, the rest through the expanded path, and both
/// write into ONE caller-allocated output by row offset.
fn mixed_rank(a: &RankAttn<'_>, batch: &crate::batch::Batch, empty_rows: &mut BTreeSet<usize>) -> Result<RankOut> {
    let t = batch.n_tokens();
    let (l, p, r, v, nh) = (
        a.cfg.kv_lora_rank,
        a.cfg.qk_nope_head_dim,
        a.cfg.qk_rope_head_dim,
        a.cfg.v_head_dim,
        a.nh,
    );
    let n_dec = mixed_decode_seqs(batch);
    let offsets = batch.offsets();
    let (k_nope, vv) = expand_kv(a, a.kv_c_normed, t)?;
    let qf = full_q(a, t);
    let kf = full_k(a, &k_nope, a.k_pe_roped, t);
    let mut result = canary_vec(t * nh * v);
    let mut lse = canary_vec(t * nh);
    let mut cs = CacheState::new(batch, a.cfg, a.opts);

    // Earlier steps: decode sequences' tokens before the last, causal, and into the cache.
    let early: Vec<Segment> = (0..n_dec)
        .filter(|&si| batch.seqs[si].len > 1)
        .map(|si| Segment {
            q_off: offsets[si],
            q_len: batch.seqs[si].len - 1,
            k_off: offsets[si],
            k_len: batch.seqs[si].len - 1,
            causal: true,
        })
        .collect();
    ops::flash_attention(
        &qf,
        &kf,
        &vv,
        nh,
        p + r,
        v,
        &early,
        a.scale,
        a.opts.tile,
        EmptyRows::ZeroMinusInf,
        &mut result,
        &mut lse,
    );

    // This step. Packed step rows: decode tokens first, then prefill tokens.
    let dec_rows: Vec<usize> = (0..n_dec).map(|si| offsets[si] + batch.seqs[si].len - 1).collect();
    let pre_rows: Vec<usize> = (n_dec..batch.seqs.len())
        .flat_map(|si| offsets[si]..offsets[si] + batch.seqs[si].len)
        .collect();
    let step_rows: Vec<usize> = dec_rows.iter().chain(&pre_rows).copied().collect();
    let n_step = step_rows.len();
    let mut step_out = canary_vec(n_step * nh * v); // the caller-allocated output of the step
    let mut step_lse = canary_vec(n_step * nh);
    let mut private = canary_vec(n_step * nh * v);

    // Decode part: rows [0, num_decodes).
    let ql_nope = absorb_q(a, t);
    let mut dec_lat = canary_vec(n_dec * nh * l);
    for (j, si) in (0..n_dec).enumerate() {
        let len = batch.seqs[si].len;
        for i in 0..len {
            cs.write(
                si,
                i,
                &a.kv_c_normed[(offsets[si] + i) * l..(offsets[si] + i + 1) * l],
                &a.k_pe_roped[(offsets[si] + i) * r..(offsets[si] + i + 1) * r],
            );
        }
        let ti = dec_rows[j];
        let (lat, ls, any_empty) = decode_row(a, &cs, si, ti, len, &ql_nope);
        if any_empty {
            empty_rows.insert(ti);
        }
        dec_lat[j * nh * l..(j + 1) * nh * l].copy_from_slice(&lat);
        step_lse[j * nh..(j + 1) * nh].copy_from_slice(&ls);
    }
    let dec_out = unabsorb(a, &dec_lat, n_dec);
    private[..n_dec * nh * v].copy_from_slice(&dec_out);

    // Prefill part: rows [num_decodes, n_step), expanded, causal per sequence.
    let mut pq = vec![0f32; pre_rows.len() * nh * (p + r)];
    let mut pk = vec![0f32; pre_rows.len() * nh * (p + r)];
    let mut pv = vec![0f32; pre_rows.len() * nh * v];
    for (j, &ti) in pre_rows.iter().enumerate() {
        pq[j * nh * (p + r)..(j + 1) * nh * (p + r)].copy_from_slice(&qf[ti * nh * (p + r)..(ti + 1) * nh * (p + r)]);
        pk[j * nh * (p + r)..(j + 1) * nh * (p + r)].copy_from_slice(&kf[ti * nh * (p + r)..(ti + 1) * nh * (p + r)]);
        pv[j * nh * v..(j + 1) * nh * v].copy_from_slice(&vv[ti * nh * v..(ti + 1) * nh * v]);
    }
    let mut q_off = 0;
    let segs: Vec<Segment> = (n_dec..batch.seqs.len())
        .map(|si| {
            let n = batch.seqs[si].len;
            let sg = Segment {
                q_off,
                q_len: n,
                k_off: q_off,
                k_len: n,
                causal: true,
            };
            q_off += n;
            sg
        })
        .collect();
    let mut po = canary_vec(pre_rows.len() * nh * v);
    let mut pl = canary_vec(pre_rows.len() * nh);
    ops::flash_attention(
        &pq,
        &pk,
        &pv,
        nh,
        p + r,
        v,
        &segs,
        a.scale,
        a.opts.tile,
        EmptyRows::ZeroMinusInf,
        &mut po,
        &mut pl,
    );
    private[n_dec * nh * v..].copy_from_slice(&po);
    step_lse[n_dec * nh..].copy_from_slice(&pl);
    step_out.copy_from_slice(&private);

    // Scatter the step's rows back to packed token order.
    for (j, &ti) in step_rows.iter().enumerate() {
        result[ti * nh * v..(ti + 1) * nh * v].copy_from_slice(&step_out[j * nh * v..(j + 1) * nh * v]);
        lse[ti * nh..(ti + 1) * nh].copy_from_slice(&step_lse[j * nh..(j + 1) * nh]);
    }
    // Every invocation of the attention op (earlier steps and this one) has the same contract.
    let mut out = canary_vec(t * nh * v);
    deliver(result, &mut out, a.opts.faults.has(Fault::PhantomOutput));
    Ok(RankOut {
        out,
        lse,
        k_nope: Some(k_nope),
        v: Some(vv),
        ql_nope: None,
        attn_latent: None,
    })
}

/// Runs one path for one layer on the CPU.
///
/// Errors: `--tp` not dividing N, shapes inconsistent with the configuration, a sequence of
/// length 0. An unservable TP cut is not an error: it comes back in [`PathRun::unservable`].
pub fn run(kind: PathKind, input: &LayerInput<'_>, opts: &PathOptions) -> Result<PathRun> {
    let cfg = input.cfg;
    let t = input.batch.n_tokens();
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
    let ew = match EngineWeights::load(input, opts, &mut notes) {
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
    let pro = prologue(input, &ew, opts, &mut tr)?;
    let (n, l, p, v) = (cfg.n_head, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim);
    let tp = opts.tp;
    let nh = n / tp;
    if tp > 1 {
        for (rank, rw) in ew.ranks.iter().enumerate() {
            let rk = rank as u32;
            rec_arr(&mut tr, layer, Stage::WRank(RankedWeight::QProj, rk), &rw.q_proj);
            // The absorbed path never holds kv_b itself (only W_UK_T / W_UV derived from it).
            if kind != PathKind::Mqa {
                rec_arr(&mut tr, layer, Stage::WRank(RankedWeight::KvB, rk), &rw.kv_b);
            }
            rec_arr(&mut tr, layer, Stage::WRank(RankedWeight::OProj, rk), &rw.o_proj);
        }
    }
    match kind {
        PathKind::Mha | PathKind::Chunked | PathKind::Mixed => {
            let parts: Vec<f32> = ew.ranks.iter().flat_map(|rw| rw.kv_b.iter().copied()).collect();
            rec(&mut tr, layer, Stage::WKvB, &[n * (p + v), l], &parts);
        }
        PathKind::Mqa => {}
    }
    if matches!(kind, PathKind::Mqa | PathKind::Mixed) {
        let wk: Vec<f32> = ew.ranks.iter().flat_map(|rw| rw.w_uk_t.iter().copied()).collect();
        let wv: Vec<f32> = ew.ranks.iter().flat_map(|rw| rw.w_uv.iter().copied()).collect();
        rec(&mut tr, layer, Stage::WUkT, &[n, p, l], &wk);
        rec(&mut tr, layer, Stage::WUv, &[n, l, v], &wv);
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
            cfg,
            rw,
            nh,
            q: &pro.q[rank],
            q_pe_roped: &pro.q_pe_roped[rank],
            kv_c_normed: &pro.kv_c_normed,
            k_pe_roped: &pro.k_pe_roped,
            scale,
            opts,
        };
        outs.push(match kind {
            PathKind::Mha => mha_rank(&a, input.batch)?,
            PathKind::Mqa => mqa_rank(&a, input.batch, &mut empty_rows)?,
            PathKind::Chunked => chunked_rank(&a, input.batch, &mut empty_rows, &mut notes)?,
            PathKind::Mixed => mixed_rank(&a, input.batch, &mut empty_rows)?,
        });
    }
    let gather = |f: &dyn Fn(&RankOut) -> Option<&Vec<f32>>| -> Option<Vec<Vec<f32>>> {
        outs.iter().map(|o| f(o).cloned()).collect()
    };
    if let Some(k) = gather(&|o| o.k_nope.as_ref()) {
        rec(
            &mut tr,
            layer,
            Stage::KNope,
            &[t, n, p],
            &reassemble_heads(&k, t, nh, p),
        );
    }
    if let Some(vv) = gather(&|o| o.v.as_ref()) {
        rec(&mut tr, layer, Stage::V, &[t, n, v], &reassemble_heads(&vv, t, nh, v));
    }
    if let Some(q) = gather(&|o| o.ql_nope.as_ref()) {
        rec(
            &mut tr,
            layer,
            Stage::QlNope,
            &[t, n, l],
            &reassemble_heads(&q, t, nh, l),
        );
    }
    if let Some(x) = gather(&|o| o.attn_latent.as_ref()) {
        rec(
            &mut tr,
            layer,
            Stage::AttnLatent,
            &[t, n, l],
            &reassemble_heads(&x, t, nh, l),
        );
    }
    let lse: Vec<Vec<f32>> = outs.iter().map(|o| o.lse.clone()).collect();
    rec(&mut tr, layer, Stage::Lse, &[t, n], &reassemble_heads(&lse, t, nh, 1));
    let attn: Vec<Vec<f32>> = outs.iter().map(|o| o.out.clone()).collect();
    rec(
        &mut tr,
        layer,
        Stage::AttnOut,
        &[t, n, v],
        &reassemble_heads(&attn, t, nh, v),
    );

    // o_proj is row-parallel: per-rank partial sums, all-reduced in rank order.
    let mut o = Array2::<f32>::zeros((t, cfg.hidden));
    for (rw, ro) in ew.ranks.iter().zip(&outs) {
        let a = Array2::from_shape_vec((t, nh * v), ro.out.clone()).map_err(shape_err)?;
        o += &ops::linear(&a, &rw.o_proj);
    }
    rec_arr(&mut tr, layer, Stage::OProj, &o);
    if let Some(ffn) = &input.weights.ffn {
        let hd = cfg.hidden;
        let h1 = input.hidden_in + &o;
        let h1s = h1.as_standard_layout();
        let xn_v = ops::rms_norm_strided(
            h1s.as_slice().unwrap_or(&[]),
            t,
            hd,
            hd,
            ffn.norm.as_slice().unwrap_or(&[]),
            cfg.rms_eps as f32,
        );
        let xn = Array2::from_shape_vec((t, hd), xn_v).map_err(shape_err)?;
        let gate = ops::linear(&xn, &ffn.gate);
        let up = ops::linear(&xn, &ffn.up);
        let act = ndarray::Zip::from(&gate)
            .and(&up)
            .map_collect(|&g, &u| g / (1.0 + (-g).exp()) * u);
        let out = h1 + ops::linear(&act, &ffn.down);
        rec_arr(&mut tr, layer, Stage::HiddenOut, &out);
    }
    Ok(PathRun {
        kind,
        trace: tr,
        empty_partial_rows: empty_rows.into_iter().collect(),
        unservable: None,
        notes,
    })
}
