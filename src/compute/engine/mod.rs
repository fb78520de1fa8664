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
//!
//! [`run`] here drives one layer: the engine's weights (`weights.rs`), the shared prologue
//! (`prologue.rs`), each rank's attention context and the paged cache (`attn.rs`), one of the
//! paths (`mha.rs`, `mqa.rs`, `chunked.rs`, `mixed.rs`), then the rank reassembly, `o_proj`
//! with its all-reduce, and the dense MLP with its TP split (`ffn.rs`).

mod attn;
mod chunked;
mod ffn;
mod mha;
mod mixed;
mod mqa;
mod prologue;
mod split;
mod weights;

use std::collections::BTreeSet;
use std::ops::Range;

use crate::compute::faults::Fault;
use crate::compute::indexer::{self, Selection};
use crate::compute::ops::{Copy2d, DecodeArgs, EmptyRows, Ops, PrefillArgs, Segment, sparse_segments};
use crate::compute::paged::{CacheWrite, PagedQuery, PagedSeq, PagedStep};
use crate::compute::path::{LayerInput, PathKind, PathOptions, PathRun, Unservable};
use crate::core::batch::{Batch, SplitMix64};
use crate::core::error::{Error, Result};
use crate::core::trace::{RankedWeight, Site, Stage, Trace, TraceTensor};
use crate::model::config::{KvBLayout, MlaConfig};
use crate::model::tensors::ModelTensor;
use crate::model::weights::{RawSlice, SliceError, col_slice, row_slice};

use attn::*;
use chunked::*;
use ffn::*;
use mha::*;
use mixed::*;
use mqa::*;
use prologue::*;
use split::*;
use weights::*;

pub use attn::{paged_block_tables, paged_step};
pub use chunked::chunked_split;
pub use mixed::mixed_decode_seqs;
pub use prologue::cos_sin_table;

/// Heads of rank `r` of `tp`.
fn rank_heads(n: usize, tp: usize, r: usize) -> Range<usize> {
    let nh = n / tp;
    r * nh..(r + 1) * nh
}

/// A projection's input as the path's fp8 GEMM reads it ([`PathOptions::fp8`], rows of `k`
/// values): `None` without fp8 compute, where the projection reads `x` itself.
fn fp8_in<O: Ops>(ops: &O, opts: &PathOptions, x: &O::Buf, k: usize) -> Result<Option<O::Buf>> {
    opts.fp8.as_ref().map(|q| ops.fp8_input(x, k, q)).transpose()
}

/// Starts a [`Copy2d`] of `rows` rows of `width` elements, one source row per destination row
/// (`src_row_div` 1); [`Copy2d::src`] and [`Copy2d::dst`] then say where the rows lie.
fn copy_rows(rows: usize, width: usize) -> Copy2d {
    Copy2d {
        rows,
        width,
        src_off: 0,
        src_stride: width,
        src_row_div: 1,
        dst_off: 0,
        dst_stride: width,
    }
}

/// A [`Copy2d`] of `len` contiguous elements from the start of the source to element `dst_off`
/// of the destination: one row, strides 0 (a block of rows written at a row offset).
fn copy_span_to(len: usize, dst_off: usize) -> Copy2d {
    copy_rows(1, len).src(0, 0).dst(dst_off, 0)
}

/// The placement half of the `copy_rows` builder, so that a call reads
/// `copy_rows(rows, width).src(off, stride).dst(off, stride)`.
impl Copy2d {
    /// The source element offset of the first row and the source row stride (elements).
    fn src(self, src_off: usize, src_stride: usize) -> Copy2d {
        Copy2d {
            src_off,
            src_stride,
            ..self
        }
    }

    /// The destination element offset of the first row and the destination row stride (elements).
    fn dst(self, dst_off: usize, dst_stride: usize) -> Copy2d {
        Copy2d {
            dst_off,
            dst_stride,
            ..self
        }
    }
}

/// Records a backend buffer at `stage`: downloaded into `tr`, or kept by the backend
/// ([`Ops::keep_site`]).
fn record_buf<O: Ops>(ops: &O, tr: &mut Trace, layer: usize, stage: Stage, shape: &[usize], b: &O::Buf) -> Result<()> {
    let site = Site::new(layer, stage);
    if let Some(v) = ops.keep_site(site, shape, b)? {
        tr.record(site, TraceTensor::f32(shape.to_vec(), v));
    }
    Ok(())
}

/// [`record_buf`] of a buffer the path no longer reads ([`Ops::keep_site_owned`]: moved into
/// the trace on the host).
fn record_buf_owned<O: Ops>(
    ops: &O,
    tr: &mut Trace,
    layer: usize,
    stage: Stage,
    shape: &[usize],
    b: O::Buf,
) -> Result<()> {
    let site = Site::new(layer, stage);
    if let Some(v) = ops.keep_site_owned(site, shape, b)? {
        tr.record(site, TraceTensor::f32(shape.to_vec(), v));
    }
    Ok(())
}

/// Records per-rank `[T, nh, X]` buffers at `stage` as one `[T, N, X]` site (`shape`; `[T, N]`
/// for X = 1), each rank holding `nh = N / parts.len()` heads: one rank's buffer through
/// [`record_buf`], several reassembled on the host ([`reassemble`]).
fn record_heads<O: Ops>(
    ops: &O,
    tr: &mut Trace,
    layer: usize,
    stage: Stage,
    shape: &[usize],
    parts: &[&O::Buf],
) -> Result<()> {
    if let [one] = parts {
        return record_buf(ops, tr, layer, stage, shape, one);
    }
    let (t, n) = (shape[0], shape[1]);
    let x = shape.get(2).copied().unwrap_or(1);
    let nh = n / parts.len();
    tr.record(
        Site::new(layer, stage),
        TraceTensor::f32(shape.to_vec(), reassemble(ops, parts, t, nh, x)?),
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

/// One optional per-rank output from every rank, or `None` if any rank lacks it.
fn pick_all<B>(outs: &[RankOut<B>], f: fn(&RankOut<B>) -> Option<&B>) -> Option<Vec<&B>> {
    outs.iter().map(f).collect()
}

/// Whether every path of one [`run_paths`] call records the same values at sites of `stage`:
/// the weights (one load per layer) and the prologue's outputs (one prologue per layer). A
/// comparison of such a site can be computed once per layer and reused for the other paths.
pub fn same_for_every_path(stage: Stage) -> bool {
    stage.is_weight()
        || matches!(
            stage,
            Stage::HiddenIn
                | Stage::AttnIn
                | Stage::QC
                | Stage::QCNormed
                | Stage::Q
                | Stage::KvA
                | Stage::KvCNormed
                | Stage::KPe
                | Stage::QPeRoped
                | Stage::KPeRoped
        )
}

/// Runs one path for one layer on backend `ops`.
///
/// Errors: [`Error::Usage`] for `--tp` not dividing N or a sequence of length 0;
/// [`Error::Internal`] for a `hidden_in` inconsistent with the configuration; backend errors. An
/// unservable TP cut is not an error: it comes back in [`PathRun::unservable`].
pub fn run<O: Ops>(ops: &O, kind: PathKind, input: &LayerInput<'_>, opts: &PathOptions) -> Result<PathRun> {
    let mut out = None;
    run_paths(ops, &[kind], input, opts, &mut |r| {
        out = Some(r);
        Ok(())
    })?;
    out.ok_or_else(|| Error::Internal(format!("path {kind} produced no run")))
}

/// Runs `kinds` one after another on one layer, handing each finished run to `each` before the
/// next starts (so the caller can judge it and drop its trace).
///
/// The engine's weights are loaded once for all of them: every path of a run shares the
/// options (faults, TP) that decide how the loader builds its weights, so each would build the
/// same buffers; a path never writes to them. Each run carries the loader's notes. The load is
/// timed as stage `path weights`, each path as `path <kind>` (`crate::core::timing`).
///
/// Errors: as [`run`], and whatever `each` returns.
pub fn run_paths<O: Ops>(
    ops: &O,
    kinds: &[PathKind],
    input: &LayerInput<'_>,
    opts: &PathOptions,
    each: &mut dyn FnMut(PathRun) -> Result<()>,
) -> Result<()> {
    let cfg = input.cfg;
    let t = input.batch.n_tokens();
    if input.hidden_in.shape() != [t, cfg.hidden] {
        return Err(Error::internal(format!(
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
    let mut load_notes = Vec::new();
    let mut ew = match crate::core::timing::stage("path weights", || {
        EngineWeights::load(ops, input, opts, &mut load_notes)
    }) {
        Ok(ew) => ew,
        Err(LoadError::Unservable(u)) => {
            for &kind in kinds {
                each(PathRun {
                    kind,
                    trace: Trace::new(),
                    empty_partial_rows: Vec::new(),
                    unservable: Some(u.clone()),
                    notes: load_notes.clone(),
                    paged: None,
                })?;
            }
            return Ok(());
        }
        Err(LoadError::Other(e)) => return Err(e),
    };
    // The prologue (projections, norms, RoPE) precedes the attention backend in an engine and
    // does not depend on it: it runs once and every path starts from its outputs.
    let pro = crate::core::timing::stage("prologue", || prologue(ops, input, &ew, opts))?;
    ew.release_q_proj();
    for &kind in kinds {
        let r = crate::core::timing::stage(&format!("path {kind}"), || {
            run_loaded(ops, kind, input, opts, &ew, &pro, load_notes.clone())
        })?;
        each(r)?;
    }
    Ok(())
}

/// The note of a RoPE fault that cannot act: every token at position 0, where RoPE is the
/// identity. `None` without a RoPE fault or with a token elsewhere.
fn rope_fault_note(opts: &PathOptions, batch: &Batch) -> Option<String> {
    let rope_fault = opts.faults.has(Fault::RopeNeox) || opts.faults.has(Fault::IndexerRopeInterleaved);
    (rope_fault && batch.positions().iter().all(|&p| p == 0)).then(|| {
        "every token is at position 0, where RoPE is the identity: the RoPE fault had nothing to act on (use more tokens or --start-pos)"
            .into()
    })
}

/// The softmax scale the paths' attention applies, f32: the config's (with the YaRN mscale²
/// folded in), or with the `no-mscale` fault the plain `(P+R)^-½`.
fn attention_scale(cfg: &MlaConfig, opts: &PathOptions) -> f32 {
    if opts.faults.has(Fault::NoMscale) {
        (cfg.qk_head_dim() as f64).powf(-0.5) as f32
    } else {
        cfg.softmax_scale as f32
    }
}

/// What `fp8-scale-padded-rows` did to this batch: the rows it was padded to, or that a batch of
/// a capture size (or past 512 tokens, run eagerly) has no padding to act on. `None` without the
/// fault.
fn padded_rows_note(opts: &PathOptions, batch: &Batch) -> Option<String> {
    if !opts.faults.has(Fault::Fp8ScalePaddedRows) {
        return None;
    }
    let t = batch.n_tokens();
    let padded = crate::compute::faults::padded_rows(t);
    Some(if padded > t {
        format!(
            "fp8-scale-padded-rows: the batch of {t} tokens was padded to {padded} rows (a CUDA-graph size); attn_in's per-tensor fp8 scale was taken over the {} stale rows too, whose largest |value| is {}× the batch's",
            padded - t,
            crate::compute::faults::STALE_ROW_FACTOR
        )
    } else {
        format!(
            "fp8-scale-padded-rows: a batch of {t} tokens needs no padding (a CUDA-graph size, or more than 512 tokens, run eagerly): the fault had nothing to act on"
        )
    })
}

/// One path on weights already loaded ([`run_paths`]); `notes` starts with the loader's.
fn run_loaded<O: Ops>(
    ops: &O,
    kind: PathKind,
    input: &LayerInput<'_>,
    opts: &PathOptions,
    ew: &EngineWeights<O::Buf>,
    pro: &Prologue<O::Buf>,
    mut notes: Vec<String>,
) -> Result<PathRun> {
    let cfg = input.cfg;
    let t = input.batch.n_tokens();
    let layer = input.weights.layer;
    let mut tr = Trace::new();
    pro.record(ops, ew, input, &mut tr)?;
    let own_sel = engine_indexer(ops, input, opts, kind, pro, &mut tr, &mut notes)?;
    notes.extend(rope_fault_note(opts, input.batch));
    notes.extend(padded_rows_note(opts, input.batch));
    if kind != PathKind::Mha {
        notes.extend(page_size_fault_note(opts));
    }
    let sel = match (&own_sel, input.forced_selection) {
        (Some(_), Some(forced)) => Some(forced.clone()),
        _ => own_sel,
    };
    let [n, _, _, _, v] = cfg.dims().nlprv();
    let hd = cfg.dims().hidden;
    let tp = opts.tp;
    let nh = n / tp;
    if tp > 1 {
        record_rank_weights(ops, &mut tr, layer, kind, cfg, ew)?;
    }
    record_layer_weights(ops, &mut tr, layer, kind, cfg, ew)?;
    let scale = attention_scale(cfg, opts);
    let mut empty_rows = BTreeSet::new();
    let mut outs: Vec<RankOut<O::Buf>> = Vec::with_capacity(tp);
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
        });
    }
    record_rank_outputs(ops, &mut tr, layer, t, cfg, &mut outs)?;
    if kind == PathKind::Chunked && chunked_split(input.batch, opts.new_tokens).iter().all(|&(c, _)| c == 0) {
        // No cached context: the chunk loop never ran, so the path was a plain causal prefill
        // and its own code (chunks, their merge) was never judged.
        notes.push(format!(
            "{}no sequence is longer than --new-tokens {}, so there was no cached context to process in chunks (the path ran as a plain prefill; give a longer sequence)",
            crate::compute::path::NOTHING_JUDGED,
            opts.new_tokens
        ));
    }

    // o_proj is row-parallel: each rank's partial, then the all-reduce the ranks run together
    // (`crate::compute::collective`).
    let mut parts = Vec::with_capacity(tp);
    for (rw, ro) in ew.ranks.iter().zip(&outs) {
        let xq = fp8_in(ops, opts, &ro.out, nh * v)?;
        parts.push(ops.linear(xq.as_ref().unwrap_or(&ro.out), t, nh * v, &rw.o_proj, hd)?);
    }
    drop(outs);
    if tp > 1 {
        for (rank, part) in parts.iter().enumerate() {
            record_buf(ops, &mut tr, layer, Stage::OProjRank(rank as u32), &[t, hd], part)?;
        }
    }
    let o = ops.all_reduce_sum(parts, t * hd, opts.faults.reduce_fault(tp))?;
    record_buf(ops, &mut tr, layer, Stage::OProj, &[t, hd], &o)?;
    if let Some(ffn) = &ew.ffn {
        // `residual-scaled`: the residual operand of the layer's residual add scaled by α, as
        // vLLM PR #14809 scaled it once per dense layer.
        let alpha = opts.faults.residual_alpha(cfg) as f32;
        let scaled;
        let residual = if alpha != 1.0 {
            let v: Vec<f32> = ops.download(&pro.hidden)?.into_iter().map(|x| x * alpha).collect();
            scaled = ops.upload(&v)?;
            &scaled
        } else {
            &pro.hidden
        };
        let out = ffn_block(ops, &mut tr, layer, (cfg, opts), ffn, residual, &o, t)?;
        record_buf(ops, &mut tr, layer, Stage::HiddenOut, &[t, hd], &out)?;
    } else if opts.faults.has(Fault::ResidualScaled) {
        notes.push(format!(
            "residual-scaled: layer {layer} has no dense MLP (an MoE layer, whose engine paths stop at o_proj): the fault had nothing to act on"
        ));
    }
    Ok(PathRun {
        kind,
        trace: tr,
        empty_partial_rows: empty_rows.into_iter().collect(),
        unservable: None,
        notes,
        paged: paged_step(kind, input.batch, opts, cfg),
    })
}

/// TP's per-rank weight sites `w.<name>.rank<r>`: each rank's `q_proj` `[nh·(P+R), q_lora_rank
/// or H]`, `kv_b_proj` `[nh·(P+V), L]` (not on the absorbed path, which never holds it: only
/// `W_UK_T`/`W_UV` derived from it) and `o_proj` `[H, nh·V]`.
fn record_rank_weights<O: Ops>(
    ops: &O,
    tr: &mut Trace,
    layer: usize,
    kind: PathKind,
    cfg: &MlaConfig,
    ew: &EngineWeights<O::Buf>,
) -> Result<()> {
    let [n, l, p, r, v] = cfg.dims().nlprv();
    let hd = cfg.dims().hidden;
    let q_k = cfg.q_lora_rank.unwrap_or(hd);
    let nh = n / ew.ranks.len();
    type Field<B> = fn(&RankWeights<B>) -> Option<&B>;
    let sites: [(RankedWeight, [usize; 2], Field<O::Buf>); 3] = [
        (RankedWeight::QProj, [nh * (p + r), q_k], |rw| rw.q_proj.as_ref()),
        (RankedWeight::KvB, [nh * (p + v), l], |rw| Some(&rw.kv_b)),
        (RankedWeight::OProj, [hd, nh * v], |rw| Some(&rw.o_proj)),
    ];
    for (rank, rw) in ew.ranks.iter().enumerate() {
        for &(w, shape, field) in &sites {
            if w == RankedWeight::KvB && kind == PathKind::Mqa {
                continue;
            }
            // Only q_proj is ever released, and only without TP.
            let b = field(rw).ok_or_else(|| Error::Internal("engine: q_proj released under TP".into()))?;
            record_buf(ops, tr, layer, Stage::WRank(w, rank as u32), &shape, b)?;
        }
    }
    Ok(())
}

/// The whole-layer weight sites the path holds: `kv_b_proj` `[N·(P+V), L]` (expanded paths),
/// `W_UK_T` `[N, P, L]` and `W_UV` `[N, L, V]` (absorbed paths). One rank's buffer is the site;
/// several concatenate on the host (each rank holds a contiguous block of heads).
fn record_layer_weights<O: Ops>(
    ops: &O,
    tr: &mut Trace,
    layer: usize,
    kind: PathKind,
    cfg: &MlaConfig,
    ew: &EngineWeights<O::Buf>,
) -> Result<()> {
    let [n, l, p, _, v] = cfg.dims().nlprv();
    let weight_site =
        |tr: &mut Trace, stage: Stage, shape: &[usize], f: fn(&RankWeights<O::Buf>) -> &O::Buf| match &ew.ranks[..] {
            [one] => record_buf(ops, tr, layer, stage, shape, f(one)),
            ranks => {
                let mut all = Vec::new();
                for rw in ranks {
                    all.extend(ops.download(f(rw))?);
                }
                tr.record(Site::new(layer, stage), TraceTensor::f32(shape.to_vec(), all));
                Ok(())
            }
        };
    if kind != PathKind::Mqa {
        weight_site(tr, Stage::WKvB, &[n * (p + v), l], |rw| &rw.kv_b)?;
    }
    if matches!(kind, PathKind::Mqa | PathKind::Mixed) {
        weight_site(tr, Stage::WUkT, &[n, p, l], |rw| &rw.w_uk_t)?;
        weight_site(tr, Stage::WUv, &[n, l, v], |rw| &rw.w_uv)?;
    }
    Ok(())
}

/// Moves a buffer out of a rank's output.
type TakeOut<B> = fn(&mut RankOut<B>) -> Option<B>;

/// One per-rank attention output recorded as a whole-layer `[T, N, X]` site.
struct OutSite<B> {
    stage: Stage,
    /// The site's shape: `[T, N, X]`, or `[T, N]` for `lse` (X = 1).
    shape: Vec<usize>,
    field: fn(&RankOut<B>) -> Option<&B>,
    /// For a buffer nothing reads after the attention: moves it out of a lone rank's output
    /// into the trace instead of copying it.
    take: Option<TakeOut<B>>,
}

impl<B> OutSite<B> {
    fn new(stage: Stage, shape: Vec<usize>, field: fn(&RankOut<B>) -> Option<&B>, take: Option<TakeOut<B>>) -> Self {
        OutSite {
            stage,
            shape,
            field,
            take,
        }
    }
}

/// The ranks' attention outputs recorded per head, in vLLM's names: `k_nope` and `v` (expanded
/// paths), `ql_nope` and `attn_latent` (absorbed paths), `lse` and `attn_out`. A field some rank
/// lacks is not recorded; several ranks' buffers are reassembled along heads.
fn record_rank_outputs<O: Ops>(
    ops: &O,
    tr: &mut Trace,
    layer: usize,
    t: usize,
    cfg: &MlaConfig,
    outs: &mut [RankOut<O::Buf>],
) -> Result<()> {
    let [n, l, p, _, v] = cfg.dims().nlprv();
    let sites: [OutSite<O::Buf>; 6] = [
        OutSite::new(Stage::KNope, vec![t, n, p], |o| o.k_nope.as_ref(), None),
        OutSite::new(Stage::V, vec![t, n, v], |o| o.v.as_ref(), None),
        OutSite::new(
            Stage::QlNope,
            vec![t, n, l],
            |o| o.ql_nope.as_ref(),
            Some(|o| o.ql_nope.take()),
        ),
        OutSite::new(
            Stage::AttnLatent,
            vec![t, n, l],
            |o| o.attn_latent.as_ref(),
            Some(|o| o.attn_latent.take()),
        ),
        OutSite::new(Stage::Lse, vec![t, n], |o| Some(&o.lse), None),
        OutSite::new(Stage::AttnOut, vec![t, n, v], |o| Some(&o.out), None),
    ];
    for s in &sites {
        if let ([one], Some(take)) = (&mut *outs, s.take) {
            if let Some(b) = take(one) {
                record_buf_owned(ops, tr, layer, s.stage, &s.shape, b)?;
            }
        } else if let Some(parts) = pick_all(outs, s.field) {
            record_heads(ops, tr, layer, s.stage, &s.shape, &parts)?;
        }
    }
    Ok(())
}
