//! Engine-side weights: what each TP rank's loader builds from the GGUF (shards cut from the raw
//! quantized bytes, the fused `q_a`/`kv_a` weight, `kv_b_proj`, `W_UK_T`/`W_UV`; the dense MLP's
//! in `ffn.rs`), where the weight-loading faults act.

use super::*;
use crate::compute::faults;

/// One TP rank's shards, as that rank's loader produced them.
pub(super) struct RankWeights<B> {
    /// `q_b_proj` / `q_proj` rows of this rank's heads, [nh·(P+R), Lq or H]; `None` once the
    /// prologue no longer needs it ([`EngineWeights::release_q_proj`]).
    pub(super) q_proj: Option<B>,
    /// `kv_b_proj` rows of this rank's heads, [nh·(P+V), L].
    pub(super) kv_b: B,
    /// `W_UK_T` of this rank's heads, [nh, P, L].
    pub(super) w_uk_t: B,
    /// `W_UV` of this rank's heads, [nh, L, V].
    pub(super) w_uv: B,
    /// `o_proj` columns (input dim) of this rank's heads, [H, nh·V].
    pub(super) o_proj: B,
}

/// The weights as an engine holds them after loading.
pub(super) struct EngineWeights<B> {
    pub(super) attn_norm: B,
    /// `fused_qkv_a_proj` [Lq+L+R, H] (with Lq), replicated on every rank.
    pub(super) fused_qkv_a: Option<B>,
    /// `q_a_layernorm` \[Lq].
    pub(super) q_a_norm: Option<B>,
    /// `kv_a_proj_with_mqa` [L+R, H] (without Lq), replicated.
    pub(super) kv_a: Option<B>,
    pub(super) kv_a_norm: B,
    pub(super) ranks: Vec<RankWeights<B>>,
    pub(super) ffn: Option<Ffn<B>>,
}

impl<B> EngineWeights<B> {
    /// Frees each rank's `q_proj` (151 MB of f32 for DeepSeek-V3's `q_b_proj`) once the shared
    /// prologue has run, when no path records it again: only TP's per-rank weight sites do.
    pub(super) fn release_q_proj(&mut self) {
        if self.ranks.len() == 1 {
            self.ranks.iter_mut().for_each(|rw| rw.q_proj = None);
        }
    }
}

/// Why the engine could not load its weights.
pub(super) enum LoadError {
    Unservable(Unservable),
    Other(Error),
}

impl From<Error> for LoadError {
    fn from(e: Error) -> Self {
        LoadError::Other(e)
    }
}

pub(super) fn slice_to_load(site: Site, reason: &str, e: SliceError) -> LoadError {
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

/// A raw slice's values as a buffer. A whole tensor is dequantized once per layer: the
/// backend's own copy when it keeps one ([`Ops::take_dequantized`], the CUDA backend's device
/// copy), else the reference's host copy handed over in `input.dequantized` when the backend
/// adopts host tensors; a shard, or a tensor no one kept, goes through the backend's
/// dequantizer on the raw bytes.
pub(super) fn dequantize_slice<O: Ops>(ops: &O, input: &LayerInput<'_>, raw: &RawSlice<'_>) -> Result<O::Buf> {
    if let Some(b) = kept(ops, input, &raw.tensor, raw.n_elements())? {
        return Ok(b);
    }
    ops.dequant(raw.ggml_type, &raw.bytes, raw.n_elements(), &raw.tensor)
}

/// Whole tensor `name` (`n` elements) as already dequantized for this layer (see
/// [`dequantize_slice`]), or `None`. Asked before the raw bytes are cut: reading them can cost
/// a dequantization of its own (a checkpoint's fp8 matrix is presented as f32).
fn kept<O: Ops>(ops: &O, input: &LayerInput<'_>, name: &str, n: usize) -> Result<Option<O::Buf>> {
    if let Some(b) = ops.take_dequantized(name, n) {
        return Ok(Some(b));
    }
    if ops.adopts_host_tensors()
        && let Some(v) = input.dequantized.and_then(|d| d.take(name, n))
    {
        return ops.adopt(v).map(Some);
    }
    Ok(None)
}

/// Rows `rows` of tensor `name` as a buffer: the kept whole tensor when `rows` is all of it,
/// else the slice's bytes dequantized.
fn rows_of<O: Ops>(ops: &O, input: &LayerInput<'_>, name: &str, rows: Range<usize>) -> Result<O::Buf> {
    let t = input.file.require_tensor(name)?;
    if rows == (0..t.n_rows() as usize)
        && let Some(b) = kept(ops, input, name, t.n_elements() as usize)?
    {
        return Ok(b);
    }
    dequantize_slice(ops, input, &row_slice(input.file, name, rows)?)
}

pub(super) fn whole<O: Ops>(ops: &O, input: &LayerInput<'_>, name: &str) -> Result<O::Buf> {
    let t = input.file.require_tensor(name)?;
    rows_of(ops, input, name, 0..t.n_rows() as usize)
}

impl<B> EngineWeights<B> {
    /// Loads one layer's engine weights as every TP rank's loader builds them: the replicated
    /// norms and fused `q_a`/`kv_a` weight, each rank's shards, and the FFN. Loader faults act
    /// here; a note goes to `notes` when one has nothing to act on.
    ///
    /// Errors: [`LoadError::Unservable`] for a TP cut the quantized bytes cannot serve, other
    /// GGUF or backend errors as [`LoadError::Other`].
    pub(super) fn load<O: Ops<Buf = B>>(
        ops: &O,
        input: &LayerInput<'_>,
        opts: &PathOptions,
        notes: &mut Vec<String>,
    ) -> Result<Self, LoadError> {
        let cfg = input.cfg;
        let name = |t: ModelTensor| t.name(input.weights.layer);
        let attn_norm = whole(ops, input, &name(ModelTensor::AttnNorm))?;
        let kv_a_norm = whole(ops, input, &name(ModelTensor::AttnKvANorm))?;
        let (fused_qkv_a, q_a_norm, kv_a) = load_qkv_a(ops, input, opts)?;
        if opts.tp > 1 && opts.faults.has(Fault::QuantSliceMisaligned) {
            check_kv_b_latent_cut(input, opts.tp)?;
            notes.push(
                "quant-slice-misaligned: the L cut lands on quant block boundaries here; the fault had no effect"
                    .into(),
            );
        }
        let q_tensor = if cfg.q_lora_rank.is_some() {
            name(ModelTensor::AttnQB)
        } else {
            name(ModelTensor::AttnQ)
        };
        let ranks = (0..opts.tp)
            .map(|rank| load_rank(ops, input, opts, rank, &q_tensor))
            .collect::<Result<Vec<_>, LoadError>>()?;
        Ok(EngineWeights {
            attn_norm,
            fused_qkv_a,
            q_a_norm,
            kv_a,
            kv_a_norm,
            ranks,
            ffn: load_ffn(ops, input, opts, notes)?,
        })
    }
}

/// (`fused_qkv_a`, `q_a_norm`, `kv_a`) of [`EngineWeights`].
type QkvA<B> = (Option<B>, Option<B>, Option<B>);

/// The replicated `q_a`/`kv_a` weights: with `q_lora_rank` Lq, vLLM's `fused_qkv_a_proj`
/// (a `MergedColumnParallelLinear`: shard 0 = `q_a_proj`, shard 1 = `kv_a_proj_with_mqa`) as
/// `[Lq+L+R, H]` and `q_a_layernorm` `[Lq]`; without, `kv_a_proj_with_mqa` `[L+R, H]`. Returns
/// (`fused_qkv_a`, `q_a_norm`, `kv_a`), f32. The fused-shard-swap fault swaps the two shards.
fn load_qkv_a<O: Ops>(ops: &O, input: &LayerInput<'_>, opts: &PathOptions) -> Result<QkvA<O::Buf>> {
    let [_, l, _, r, _] = input.cfg.dims().nlprv();
    let h = input.cfg.dims().hidden;
    let name = |t: ModelTensor| t.name(input.weights.layer);
    let kv_a_w = whole(ops, input, &name(ModelTensor::AttnKvAMqa))?;
    let Some(lq) = input.cfg.q_lora_rank else {
        return Ok((None, None, Some(kv_a_w)));
    };
    let q_a = whole(ops, input, &name(ModelTensor::AttnQA))?;
    let mut fused = ops.canary((lq + l + r) * h)?;
    let (first, first_rows, second, second_rows) = if opts.faults.has(Fault::FusedShardSwap) {
        (&kv_a_w, l + r, &q_a, lq)
    } else {
        (&q_a, lq, &kv_a_w, l + r)
    };
    ops.copy2d(first, &mut fused, copy_rows(first_rows, h).src(0, h).dst(0, h))?;
    ops.copy2d(
        second,
        &mut fused,
        copy_rows(second_rows, h).src(0, h).dst(first_rows * h, h),
    )?;
    Ok((
        Some(fused),
        Some(whole(ops, input, &name(ModelTensor::AttnQANorm))?),
        None,
    ))
}

/// The quant-slice-misaligned fault's cut: the broken loader shards `kv_b_proj` along its input
/// (latent) dim L, as if it were row-parallel; the tensor cut is the one whose rows run along L.
/// Errors: [`LoadError::Unservable`] at `w.kv_b_proj` when a cut splits a quant block.
fn check_kv_b_latent_cut(input: &LayerInput<'_>, tp: usize) -> Result<(), LoadError> {
    let l = input.cfg.kv_lora_rank;
    let layer = input.weights.layer;
    let t = ModelTensor::kv_b_latent_input(input.cfg.kv_b_layout).name(layer);
    for rank in 0..tp {
        let cols = rank * l / tp..(rank + 1) * l / tp;
        if let Err(e) = col_slice(input.file, &t, cols) {
            return Err(slice_to_load(
                Site::new(layer, Stage::WKvB),
                "kv_b_proj sharded along its input (latent) dim L instead of by heads",
                e,
            ));
        }
    }
    Ok(())
}

/// Which rank's shard of `weight` rank `rank`'s loader reads: its own, or another one under the
/// faults that reorder (tp-rank-order) or duplicate (tp-rank0-everywhere) ranks.
fn shard_source(opts: &PathOptions, rank: usize, weight: RankedWeight) -> usize {
    let f = &opts.faults;
    if f.has(Fault::TpRank0Everywhere) {
        0
    } else if f.has(Fault::TpRankOrder) && weight != RankedWeight::OProj {
        (rank + 1) % opts.tp
    } else {
        rank
    }
}

/// One TP rank's shards as its loader builds them: `q_proj` rows of its heads from `q_tensor`,
/// `kv_b_proj` rows ([`load_kv_b`]), `W_UK_T`/`W_UV` derived from them
/// ([`absorbed_weights`]), and the `o_proj` columns of its heads.
///
/// Errors: [`LoadError::Unservable`] when the `o_proj` cut splits a quant block; GGUF and
/// backend errors.
fn load_rank<O: Ops>(
    ops: &O,
    input: &LayerInput<'_>,
    opts: &PathOptions,
    rank: usize,
    q_tensor: &str,
) -> Result<RankWeights<O::Buf>, LoadError> {
    let [n, _, p, r, v] = input.cfg.dims().nlprv();
    let (file, layer, tp) = (input.file, input.weights.layer, opts.tp);
    let qh = rank_heads(n, tp, shard_source(opts, rank, RankedWeight::QProj));
    let q_proj = rows_of(ops, input, q_tensor, qh.start * (p + r)..qh.end * (p + r))?;
    let kh = rank_heads(n, tp, shard_source(opts, rank, RankedWeight::KvB));
    let kv_b = kv_b_variant(ops, input.cfg, opts, load_kv_b(ops, input, opts, kh.clone())?, kh.len())?;
    let (w_uk_t, w_uv) = absorbed_weights(ops, input, opts, &kv_b, kh.len())?;
    let oh = rank_heads(n, tp, shard_source(opts, rank, RankedWeight::OProj));
    let o_name = ModelTensor::AttnOutput.name(layer);
    let o_whole = oh.len() == n;
    let o_proj = match o_whole {
        true => kept(ops, input, &o_name, file.require_tensor(&o_name)?.n_elements() as usize)?,
        false => None,
    };
    let o_proj = match o_proj {
        Some(b) => b,
        None => {
            let o_raw = col_slice(file, &o_name, oh.start * v..oh.end * v).map_err(|e| {
                slice_to_load(
                    Site::new(layer, Stage::WRank(RankedWeight::OProj, rank as u32)),
                    "o_proj is row-parallel: its input dim N·V is cut by heads",
                    e,
                )
            })?;
            dequantize_slice(ops, input, &o_raw)?
        }
    };
    let cols = oh.start * v..oh.end * v;
    let o_proj = if opts.faults.has(Fault::Fp8ScaleTransposed) {
        rescale_blocks(ops, input, &o_name, o_proj, cols, faults::transposed_view)?
    } else if opts.faults.has(Fault::Fp8ScaleShardRank0) {
        rescale_blocks(ops, input, &o_name, o_proj, cols, |g| {
            faults::rank0_scale_view(g, opts.tp)
        })?
    } else {
        o_proj
    };
    Ok(RankWeights {
        q_proj: Some(q_proj),
        kv_b,
        w_uk_t,
        w_uv,
        o_proj,
    })
}

/// Columns `cols` of the block-scaled matrix `name` (`[rows, in]`), dequantized as stored in
/// `w`, as a loader that reads the scale grid as `applied` gives it dequantizes them (the grid
/// transposed and reshaped, [`faults::transposed_view`]; every rank's shard with rank 0's
/// scales, [`faults::rank0_scale_view`]): each element is `w × s'[block] / s[block]`. On the
/// host for every backend (a loader's bug, not a kernel's). A matrix without a block-scale grid,
/// or one `applied` leaves alone, comes back as it is.
fn rescale_blocks<O: Ops>(
    ops: &O,
    input: &LayerInput<'_>,
    name: &str,
    w: O::Buf,
    cols: Range<usize>,
    applied: impl Fn(&crate::model::gguf::BlockScales) -> Option<Vec<f32>>,
) -> Result<O::Buf> {
    let file = input.file;
    let Some((g, t)) = file
        .tensor(name)
        .and_then(|t| file.block_scales(t))
        .and_then(|g| applied(&g).map(|t| (g, t)))
    else {
        return Ok(w);
    };
    let mut v = ops.download(&w)?;
    let width = cols.len();
    if width == 0 || v.len() != g.shape[0] * width {
        return Err(Error::Internal(format!(
            "{name}: {} values for {} rows of {width} columns",
            v.len(),
            g.shape[0]
        )));
    }
    let [br, bc] = g.block;
    for (i, row) in v.chunks_mut(width).enumerate() {
        for (j, x) in row.iter_mut().enumerate() {
            let k = (i / br) * g.grid[1] + (cols.start + j) / bc;
            if g.scale[k] != 0.0 {
                *x = (f64::from(*x) * f64::from(t[k]) / f64::from(g.scale[k])) as f32;
            }
        }
    }
    ops.adopt(v)
}

/// `kv_b_proj` rows of heads `kh`, `[nh·(P+V), L]` f32: read from `attn_kv_b`, or rebuilt per
/// head from the split pair `attn_k_b` `[N, L, P]` (transposed) and `attn_v_b` `[N, V, L]`. The
/// k-b-untransposed fault reads `attn_k_b`'s bytes as `[P, L]` (a reshape).
fn load_kv_b<O: Ops>(ops: &O, input: &LayerInput<'_>, opts: &PathOptions, kh: Range<usize>) -> Result<O::Buf> {
    let [_, l, p, _, v] = input.cfg.dims().nlprv();
    let (file, layer) = (input.file, input.weights.layer);
    let nh = kh.len();
    if input.cfg.kv_b_layout == KvBLayout::Fused {
        return rows_of(
            ops,
            input,
            &ModelTensor::AttnKvB.name(layer),
            kh.start * (p + v)..kh.end * (p + v),
        );
    }
    // attn_k_b is [N, L, P] (rows of P); attn_v_b is [N, V, L] (rows of L).
    let k_b = dequantize_slice(
        ops,
        input,
        &row_slice(file, &ModelTensor::AttnKB.name(layer), kh.start * l..kh.end * l)?,
    )?;
    let v_b = dequantize_slice(
        ops,
        input,
        &row_slice(file, &ModelTensor::AttnVB.name(layer), kh.start * v..kh.end * v)?,
    )?;
    // The k rows of kv_b are k_b transposed per head; the bug reads the same bytes as [P, L].
    let k_rows = if opts.faults.has(Fault::KBUntransposed) {
        k_b
    } else {
        ops.transpose(&k_b, nh, l, p)?
    };
    let mut kv_b = ops.canary(nh * (p + v) * l)?;
    for hh in 0..nh {
        ops.copy2d(
            &k_rows,
            &mut kv_b,
            copy_rows(p, l).src(hh * p * l, l).dst(hh * (p + v) * l, l),
        )?;
        ops.copy2d(
            &v_b,
            &mut kv_b,
            copy_rows(v, l).src(hh * v * l, l).dst((hh * (p + v) + p) * l, l),
        )?;
    }
    Ok(kv_b)
}

/// `kv_b_proj` `[nh·(P+V), L]` as a loader with a kv_b split variant fault concatenates it:
/// `kv-b-halves-swapped` puts each head's v rows before its k rows, `kv-b-heads-interleaved`
/// puts the heads in the order 0, nh/2, 1, nh/2+1, … Without either, `kv_b` as it is.
fn kv_b_variant<O: Ops>(ops: &O, cfg: &MlaConfig, opts: &PathOptions, kv_b: O::Buf, nh: usize) -> Result<O::Buf> {
    let [_, l, p, _, v] = cfg.dims().nlprv();
    let f = &opts.faults;
    let halves = f.has(Fault::KvBHalvesSwapped) && p == v;
    let interleave = f.has(Fault::KvBHeadsInterleaved) && nh >= 4 && nh.is_multiple_of(2);
    if !halves && !interleave {
        return Ok(kv_b);
    }
    let mut out = ops.canary(nh * (p + v) * l)?;
    for h in 0..nh {
        let src = if interleave { (h % 2) * (nh / 2) + h / 2 } else { h };
        let (s0, d0) = (src * (p + v) * l, h * (p + v) * l);
        if halves {
            ops.copy2d(&kv_b, &mut out, copy_rows(v, l).src(s0 + p * l, l).dst(d0, l))?;
            ops.copy2d(&kv_b, &mut out, copy_rows(p, l).src(s0, l).dst(d0 + v * l, l))?;
        } else {
            ops.copy2d(&kv_b, &mut out, copy_rows(p + v, l).src(s0, l).dst(d0, l))?;
        }
    }
    Ok(out)
}

/// vLLM's `process_weights_after_loading`: `W_UK_T` `[nh, P, L]` and `W_UV` `[nh, L, V]`, f32,
/// from `nh` heads of `kv_b_proj` `[nh·(P+V), L]`. The kv-b-grouped fault reads `kv_b` as all
/// k rows then all v rows instead of per head.
fn absorbed_weights<O: Ops>(
    ops: &O,
    input: &LayerInput<'_>,
    opts: &PathOptions,
    kv_b: &O::Buf,
    nh: usize,
) -> Result<(O::Buf, O::Buf)> {
    let [_, l, p, _, v] = input.cfg.dims().nlprv();
    let mut w_uk_t = ops.canary(nh * p * l)?;
    let mut w_uv_t = ops.canary(nh * v * l)?; // [nh, V, L] before the transpose
    if opts.faults.has(Fault::KvBGrouped) {
        // [all k rows | all v rows] instead of per head.
        ops.copy2d(kv_b, &mut w_uk_t, copy_rows(nh * p, l).src(0, l).dst(0, l))?;
        ops.copy2d(kv_b, &mut w_uv_t, copy_rows(nh * v, l).src(nh * p * l, l).dst(0, l))?;
    } else {
        for hh in 0..nh {
            ops.copy2d(
                kv_b,
                &mut w_uk_t,
                copy_rows(p, l).src(hh * (p + v) * l, l).dst(hh * p * l, l),
            )?;
            ops.copy2d(
                kv_b,
                &mut w_uv_t,
                copy_rows(v, l).src((hh * (p + v) + p) * l, l).dst(hh * v * l, l),
            )?;
        }
    }
    let w_uv = ops.transpose(&w_uv_t, nh, v, l)?;
    Ok((w_uk_t, w_uv))
}
