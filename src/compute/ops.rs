//! The kernel interface every backend implements.
//!
//! The engine paths ([`crate::compute::engine`]) are written once against this trait, so the CPU and CUDA
//! backends run the same structure (the same shards, views, caches, splits and merges, and the
//! same faults at the same places) and differ only in where each kernel runs. Buffers are opaque
//! row-major f32 tensors owned by the backend (host vectors, or device memory); every dimension
//! is passed explicitly in the dim names of docs/mla.md. Output buffers are allocated holding the NaN canary.
//! Every method returns [`Result`] so that a device error surfaces as an error, never a panic.

use crate::compute::collective::{ReduceFault, host_all_reduce_sum};
use crate::core::dtype::Dtype;
use crate::core::error::{Error, Result};
use crate::core::fp8::{ActQuant, KvCacheQuant};
use crate::core::trace::Site;
use crate::model::gguf::GgmlType;

/// RoPE pairing (defined with the model configuration, which says which one a model uses).
pub use crate::model::config::RopeStyle;

/// What an attention kernel does with a query row that has no visible key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EmptyRows {
    /// Write output 0 and LSE −inf (flash-attention's convention; correct).
    ZeroMinusInf,
    /// Write output 0 and LSE +inf (the wrong sentinel of the `lse-plus-inf` fault).
    ZeroPlusInf,
    /// Write nothing: output and LSE keep what the caller allocated (`unwritten-rows`).
    Skip,
}

impl EmptyRows {
    /// Integer code passed to kernels: 0, 1, 2.
    pub fn code(self) -> i32 {
        match self {
            EmptyRows::ZeroMinusInf => 0,
            EmptyRows::ZeroPlusInf => 1,
            EmptyRows::Skip => 2,
        }
    }
}

/// One attention segment: `q_len` query rows from packed row `q_off` attend to `k_len` key rows
/// from `k_off`. With `causal`, local query `i` sees local key `j` iff `j ≤ i + (k_len − q_len)`
/// (bottom-right alignment, as flash-attention).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// First query row.
    pub q_off: usize,
    /// Query rows.
    pub q_len: usize,
    /// First key row.
    pub k_off: usize,
    /// Key rows.
    pub k_len: usize,
    /// Causal masking.
    pub causal: bool,
}

impl Segment {
    /// One sequence of `len` packed rows from row `off` attending causally to itself (prefill
    /// without context): query `i` sees keys `0..=i`.
    pub fn causal_self(off: usize, len: usize) -> Segment {
        Segment {
            q_off: off,
            q_len: len,
            k_off: off,
            k_len: len,
            causal: true,
        }
    }
}

/// The attention segments and key indices of per-row key lists (the engine's sparse attention):
/// query row `i` reads rows `keys[i]` of K/V, in that order, through [`PrefillArgs::key_rows`].
///
/// A run of rows whose each key list is the previous row's plus one more key (every row of a
/// sequence while its length is at most the indexer's top-k, where DSA keeps all visible keys)
/// is one causal segment over the last row's list: its row `r` reads the first `k + r` entries,
/// `k` the first row's count. Any other row is a segment of its own. Either way a row reads the
/// same keys in the same order, so the values are those of one segment per row; a kernel that
/// tiles query rows (the tensor-core prefill's 64, the CPU kernel's 16) then fills its tiles
/// instead of computing one row per tile, and the indices hold one list per run instead of one
/// per row. Returns (segments, `q_off` = the row's index in `keys`; key indices).
pub fn sparse_segments(keys: &[Vec<usize>]) -> (Vec<Segment>, Vec<usize>) {
    let mut segs: Vec<Segment> = Vec::new();
    let mut key_rows: Vec<usize> = Vec::new();
    for (i, kr) in keys.iter().enumerate() {
        if let Some(sg) = segs.last_mut()
            && sg.k_len > 0
            && kr.len() == sg.k_len + 1
            && kr[..sg.k_len] == key_rows[sg.k_off..sg.k_off + sg.k_len]
        {
            key_rows.push(kr[sg.k_len]);
            sg.q_len += 1;
            sg.k_len += 1;
            sg.causal = true;
            continue;
        }
        segs.push(Segment {
            q_off: i,
            q_len: 1,
            k_off: key_rows.len(),
            k_len: kr.len(),
            causal: false,
        });
        key_rows.extend_from_slice(kr);
    }
    (segs, key_rows)
}

/// A strided 2-D block copy: `rows` rows of `width` elements from `src[src_off + (r / src_row_div)
/// · src_stride ..]` to `dst[dst_off + r · dst_stride ..]`. `src_row_div > 1` repeats source rows
/// (a broadcast, e.g. `k_pe` to every head).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Copy2d {
    /// Rows to copy.
    pub rows: usize,
    /// Elements per row.
    pub width: usize,
    /// Source element offset.
    pub src_off: usize,
    /// Source row stride (elements).
    pub src_stride: usize,
    /// Source row = destination row / `src_row_div`.
    pub src_row_div: usize,
    /// Destination element offset.
    pub dst_off: usize,
    /// Destination row stride.
    pub dst_stride: usize,
}

/// The kernels an MLA engine path needs.
pub trait Ops {
    /// A row-major f32 tensor owned by the backend.
    type Buf;

    /// Backend name (`cpu`, `cuda`).
    fn name(&self) -> &'static str;
    /// Compute dtype: with `Bf16`, GEMM and attention inputs are bf16, accumulation f32.
    fn dtype(&self) -> Dtype;
    /// Copies host data into a new buffer.
    fn upload(&self, data: &[f32]) -> Result<Self::Buf>;
    /// Copies a buffer back to the host.
    fn download(&self, b: &Self::Buf) -> Result<Vec<f32>>;
    /// Whether whole dequantized host tensors ([`crate::model::weights::Dequantized`]) should
    /// become buffers through [`Ops::adopt`] instead of a dequantization of the raw bytes: true
    /// where that is a move (host memory), false where it would be a copy to another memory
    /// (a device dequantizes the raw bytes, a third of the f32 size for 8-bit types, itself).
    fn adopts_host_tensors(&self) -> bool {
        false
    }
    /// A buffer holding `data` (a move on the host backend, an upload elsewhere).
    fn adopt(&self, data: Vec<f32>) -> Result<Self::Buf> {
        self.upload(&data)
    }
    /// `x` (rows of `k` values, f32) as an fp8 GEMM reads it: `s·e4m3(x/s)` per group of `q`
    /// ([`ActQuant::quantize_f32`]), a new buffer. On the host for every backend: engines fuse
    /// this into a small kernel before the GEMM, and mla-diff's paths run it once per
    /// projection, so the round trip is not where their time goes.
    fn fp8_input(&self, x: &Self::Buf, k: usize, q: &ActQuant) -> Result<Self::Buf> {
        let mut v = self.download(x)?;
        q.quantize_f32(&mut v, k, 1);
        self.adopt(v)
    }
    /// Rows bound for an fp8 latent cache as it stores them ([`KvCacheQuant::round`]), a new
    /// buffer; on the host for every backend, as [`Ops::fp8_input`].
    fn fp8_cache_rows(&self, x: &Self::Buf, q: &KvCacheQuant) -> Result<Self::Buf> {
        let v = self.download(x)?;
        self.adopt(v.into_iter().map(|x| q.round(f64::from(x)) as f32).collect())
    }
    /// Decode queries `[ql_nope ‖ q_pe]` as a kernel that takes an fp8 query reads them
    /// ([`KvCacheQuant::round_query`]), a new buffer; on the host for every backend.
    fn fp8_query_rows(&self, x: &Self::Buf, q: &KvCacheQuant) -> Result<Self::Buf> {
        let v = self.download(x)?;
        self.adopt(v.into_iter().map(|x| q.round_query(f64::from(x)) as f32).collect())
    }
    /// Whole tensor `name` (`n` elements) as the backend already dequantized it in its own
    /// memory for this layer, taken over by the caller; `None` (the default) when the backend
    /// keeps no such copy and the caller dequantizes the raw bytes. The CUDA backend keeps what
    /// it dequantized on the device for the reference.
    fn take_dequantized(&self, name: &str, n: usize) -> Option<Self::Buf> {
        let _ = (name, n);
        None
    }
    /// Keeps the site `site` (shape `shape`, the first `shape`-product elements of `b`) that a
    /// path records: the values for the host trace, or `None` when the backend keeps the site
    /// itself to compare it where it lives (the CUDA backend's device comparison). The default
    /// downloads.
    fn keep_site(&self, site: Site, shape: &[usize], b: &Self::Buf) -> Result<Option<Vec<f32>>> {
        let _ = site;
        let mut v = self.download(b)?;
        v.truncate(shape.iter().product());
        Ok(Some(v))
    }
    /// [`Ops::keep_site`] of a buffer the path no longer reads: the host backend moves it into
    /// the trace instead of copying it (a [T, N, L] site is 134 MB at DeepSeek-V3 size and
    /// T = 512). The default keeps a copy as [`Ops::keep_site`] does.
    fn keep_site_owned(&self, site: Site, shape: &[usize], b: Self::Buf) -> Result<Option<Vec<f32>>> {
        self.keep_site(site, shape, &b)
    }
    /// A new buffer of `n` canary values.
    fn canary(&self, n: usize) -> Result<Self::Buf>;
    /// Dequantizes `n` elements of raw GGUF bytes (whole blocks of `ty`).
    fn dequant(&self, ty: GgmlType, bytes: &[u8], n: usize, label: &str) -> Result<Self::Buf>;

    /// `y [t, o] = x [t, k] · wᵀ` with `w [o, k]` (PyTorch `F.linear`; cuBLAS on the GPU).
    fn linear(&self, x: &Self::Buf, t: usize, k: usize, w: &Self::Buf, o: usize) -> Result<Self::Buf>;
    /// `a + b` elementwise (`n` elements).
    fn add(&self, a: &Self::Buf, b: &Self::Buf, n: usize) -> Result<Self::Buf>;
    /// The all-reduce (sum) that ends the row-parallel `o_proj`: `parts[r]` is TP rank r's
    /// `[T, H]` partial (`n` = T·H elements, f32); returns rank 0's copy of the sum, the one the
    /// layer goes on with. `fault` acts inside the collective (docs/faults.md, `all-reduce-*`).
    ///
    /// The default runs [`host_all_reduce_sum`] on the downloaded partials (one thread per rank,
    /// rank-order f32 sum: bit-identical to one [`Ops::add`] per rank); one rank without a fault
    /// is its own sum. Errors: no rank, backend transfer errors.
    fn all_reduce_sum(&self, parts: Vec<Self::Buf>, n: usize, fault: Option<ReduceFault>) -> Result<Self::Buf> {
        host_all_reduce(self, parts, n, fault)
    }
    /// `silu(g) · u` elementwise (SwiGLU).
    fn silu_mul(&self, g: &Self::Buf, u: &Self::Buf, n: usize) -> Result<Self::Buf>;
    /// RMSNorm of `rows` rows of `width` read at `src[off + r·stride]`: `[rows, width]`.
    #[allow(
        clippy::too_many_arguments,
        reason = "vLLM's rms_norm over a strided row view of src (rows, off, stride, width), its weight and eps, each named at the call"
    )]
    fn rms_norm(
        &self,
        src: &Self::Buf,
        rows: usize,
        off: usize,
        stride: usize,
        width: usize,
        g: &Self::Buf,
        eps: f32,
    ) -> Result<Self::Buf>;
    /// Strided block copy into `dst` (see [`Copy2d`]).
    fn copy2d(&self, src: &Self::Buf, dst: &mut Self::Buf, c: Copy2d) -> Result<()>;
    /// Per-matrix transpose: `src [batch, rows, cols]` → `[batch, cols, rows]`.
    fn transpose(&self, src: &Self::Buf, batch: usize, rows: usize, cols: usize) -> Result<Self::Buf>;
    /// Rows `idx` of `src` (`row_len` each) → `[idx.len(), row_len]`.
    fn gather_rows(&self, src: &Self::Buf, row_len: usize, idx: &[usize]) -> Result<Self::Buf>;
    /// Writes row `i` of `src` into row `idx[i]` of `dst`.
    fn scatter_rows(&self, dst: &mut Self::Buf, src: &Self::Buf, row_len: usize, idx: &[usize]) -> Result<()>;
    /// Rotates `x [rows, R]` in place: row `r` with row `table_rows[r]` of the cos/sin tables
    /// (`[n, R/2]` each, built on the host from the YaRN frequencies and the tokens' positions).
    #[allow(
        clippy::too_many_arguments,
        reason = "vLLM's rotary_embedding: the rows and their width, each row's table row, the cos and sin tables and the pairing"
    )]
    fn rope(
        &self,
        x: &mut Self::Buf,
        rows: usize,
        r: usize,
        table_rows: &[usize],
        cos: &Self::Buf,
        sin: &Self::Buf,
        style: RopeStyle,
    ) -> Result<()>;
    /// Per-head matrix product: `out [t, nh, b] = x [t, nh, a] · w [nh, a, b]`.
    fn bmm_heads(&self, x: &Self::Buf, t: usize, nh: usize, a: usize, w: &Self::Buf, b: usize) -> Result<Self::Buf>;
    /// Tiled online-softmax attention with LSE over the segments of `a` (see [`PrefillArgs`]);
    /// writes `out [Tq, nh, dv]` and `lse [Tq, nh]` in place (f32; LSE natural-log). Rows that no
    /// segment covers are not touched.
    ///
    /// Errors: a buffer shorter than a segment reaches, a head width the backend's kernels do not
    /// support, device errors.
    fn flash_attention(&self, a: &PrefillArgs<'_, Self::Buf>, out: &mut Self::Buf, lse: &mut Self::Buf) -> Result<()>;
    /// `concat_and_cache_mla`: writes row `i` of `kv_c [n, L]` / `k_pe [n, R]` into cache slot
    /// `slots[i]` of `cache [num_blocks·block_size, L+R]`.
    #[allow(
        clippy::too_many_arguments,
        reason = "vLLM's concat_and_cache_mla: the cache and its row width, kv_c and k_pe with their widths L and R, the slots"
    )]
    fn cache_write(
        &self,
        cache: &mut Self::Buf,
        width: usize,
        kv_c: &Self::Buf,
        k_pe: &Self::Buf,
        l: usize,
        r: usize,
        slots: &[usize],
    ) -> Result<()>;
    /// Split-KV decode, stage 1 of the launch `d` (see [`DecodeArgs`]): each of `d.splits`
    /// splits of `⌈ctx/splits⌉` positions of every query row writes a partial output into
    /// `parts [splits, n, nh, dv]` (value = the first `dv` columns of each cache row) and its LSE
    /// into `lses [splits, n, nh]`; an empty split writes no output and LSE `d.empty_lse`.
    fn decode_split(&self, d: &DecodeArgs<'_, Self::Buf>, parts: &mut Self::Buf, lses: &mut Self::Buf) -> Result<()>;
    /// LSE merge of `k` stacked partials `parts [k, rows, nh, dv]`, `lses [k, rows, nh]` into
    /// `(out [rows, nh, dv], lse [rows, nh])` (docs/mla.md "Attention state merge"; a partial with
    /// LSE −inf contributes nothing and is not read).
    fn merge(
        &self,
        parts: &Self::Buf,
        lses: &Self::Buf,
        k: usize,
        rows: usize,
        nh: usize,
        dv: usize,
    ) -> Result<(Self::Buf, Self::Buf)>;
    /// [`Ops::decode_split`] into canary-filled partials, then [`Ops::merge`] of them:
    /// `(out [n, nh, dv], lse [n, nh])`. A backend may fuse the two (the CUDA fast kernels do).
    fn decode_merged(&self, d: &DecodeArgs<'_, Self::Buf>) -> Result<(Self::Buf, Self::Buf)> {
        decode_then_merge(self, d)
    }
}

/// [`Ops::all_reduce_sum`] through the host collective: the partials downloaded (first `n`
/// elements each), [`host_all_reduce_sum`] by one thread per rank, rank 0's copy back in a
/// buffer; one rank without a fault is returned as it is.
///
/// Errors: [`Error::Internal`] for no rank; backend transfer errors.
pub fn host_all_reduce<O: Ops + ?Sized>(
    ops: &O,
    parts: Vec<O::Buf>,
    n: usize,
    fault: Option<ReduceFault>,
) -> Result<O::Buf> {
    if parts.len() == 1 && fault.is_none() {
        return parts
            .into_iter()
            .next()
            .ok_or_else(|| Error::internal("all-reduce over no rank"));
    }
    let host = download_parts(ops, &parts, n)?;
    drop(parts);
    let mut copies = host_all_reduce_sum(&host, fault)?;
    drop(host);
    ops.adopt(copies.swap_remove(0))
}

/// The first `n` elements of each of `parts`, downloaded.
///
/// Errors: backend transfer errors.
pub fn download_parts<O: Ops + ?Sized>(ops: &O, parts: &[O::Buf], n: usize) -> Result<Vec<Vec<f32>>> {
    parts
        .iter()
        .map(|b| {
            let mut v = ops.download(b)?;
            v.truncate(n);
            Ok(v)
        })
        .collect()
}

/// The inputs of one flash-attention prefill launch ([`Ops::flash_attention`]), vLLM's
/// `forward_mha` attention: packed rows of every sequence, each attending over its
/// [`Segment`]s. `B` is the buffer type (a backend's `Buf`, or a host slice `[f32]`); the
/// inputs are row-major f32 (bf16 values where the backend computes in bf16).
pub struct PrefillArgs<'a, B: ?Sized> {
    /// Queries `[Tq, nh, dqk]`: `[q_nope | q_pe]` per head on the expanded (MHA) path.
    pub q: &'a B,
    /// Keys `[Tk, nh, dqk]`: `[k_nope | k_pe]` per head (`k_pe` broadcast to every head).
    pub k: &'a B,
    /// Values `[Tk, nh, dv]`.
    pub v: &'a B,
    /// Heads per row.
    pub nh: usize,
    /// Query/key width per head, P+R (`qk_nope_head_dim + qk_rope_head_dim`).
    pub dqk: usize,
    /// Value width per head, V (`v_head_dim`).
    pub dv: usize,
    /// Which query rows attend to which key rows (row offsets into `q` and `k`/`v`).
    pub segments: &'a [Segment],
    /// Softmax scale multiplying `q·k` (the model's `softmax_scale`).
    pub scale: f32,
    /// What a query row with no visible key gets.
    pub empty: EmptyRows,
    /// The keys read by index, as a sparse MLA prefill reads the DSA indexer's top-k (FlashMLA's
    /// sparse prefill takes the indices, never a copy of the keys): with `Some(rows)`, key `j`
    /// of a segment is row `rows[k_off + j]` of `k` and `v` (`k_off`/`k_len` then index `rows`);
    /// `None`, row `k_off + j`. A query's kept keys are never copied out per query: copies would
    /// hold `Σ kept keys · nh · (dqk + dv)` floats, 68.7 GB for one GLM-5 layer at T = 1024
    /// (every row keeps all its keys while T ≤ top-k), where the indices hold `Σ kept keys`.
    pub key_rows: Option<&'a [usize]>,
}

impl<'a, B: ?Sized> PrefillArgs<'a, B> {
    /// The same launch on other inputs (e.g. dtype-rounded or bf16 copies of `q`, `k`, `v`, in
    /// the same shapes).
    pub fn with_inputs<'b, C: ?Sized>(&self, q: &'b C, k: &'b C, v: &'b C) -> PrefillArgs<'b, C>
    where
        'a: 'b,
    {
        PrefillArgs {
            q,
            k,
            v,
            nh: self.nh,
            dqk: self.dqk,
            dv: self.dv,
            segments: self.segments,
            scale: self.scale,
            empty: self.empty,
            key_rows: self.key_rows,
        }
    }
}

impl<B: ?Sized> PrefillArgs<'_, B> {
    /// Runs `check(buffer, elements needed, name)` on `q`, `k`, `v`, `out [Tq, nh, dv]` and
    /// `lse [Tq, nh]` for every segment (names `flash q`, `flash k`, `flash v`, `flash out`,
    /// `flash lse`), so that a backend's kernel never reads or writes past a buffer; with
    /// [`PrefillArgs::key_rows`], `k` and `v` are checked against the largest key row a segment
    /// names.
    ///
    /// Errors: the first error `check` returns; [`Error::Internal`] for a segment reaching past
    /// `key_rows`.
    pub fn check_lens(&self, out: &B, lse: &B, check: impl Fn(&B, usize, &str) -> Result<()>) -> Result<()> {
        let (nh, dqk, dv) = (self.nh, self.dqk, self.dv);
        for sg in self.segments {
            let (q_end, k_span) = (sg.q_off + sg.q_len, sg.k_off..sg.k_off + sg.k_len);
            let k_end = match self.key_rows {
                None => k_span.end,
                Some(rows) => rows
                    .get(k_span.clone())
                    .ok_or_else(|| {
                        Error::internal(format!(
                            "flash key_rows: a segment reads entries {k_span:?} of {}",
                            rows.len()
                        ))
                    })?
                    .iter()
                    .max()
                    .map_or(0, |&m| m + 1),
            };
            check(self.q, q_end * nh * dqk, "flash q")?;
            check(self.k, k_end * nh * dqk, "flash k")?;
            check(self.v, k_end * nh * dv, "flash v")?;
            check(out, q_end * nh * dv, "flash out")?;
            check(lse, q_end * nh, "flash lse")?;
        }
        Ok(())
    }

    /// The row of `k`/`v` that key `j` (an index into the segments' key span, `k_off + local`)
    /// reads: `key_rows[j]`, or `j` itself without [`PrefillArgs::key_rows`].
    #[inline(always)]
    pub fn key_row(&self, j: usize) -> usize {
        self.key_rows.map_or(j, |rows| rows[j])
    }
}

impl<B: ?Sized> Clone for PrefillArgs<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: ?Sized> Copy for PrefillArgs<'_, B> {}

/// The inputs of one split-KV decode launch ([`Ops::decode_split`], [`Ops::decode_merged`]),
/// vLLM's `forward_mqa` over a paged latent cache.
pub struct DecodeArgs<'a, B> {
    /// Query rows `[n, nh, L+R]` (`ql_nope` absorbed through `W_UK_T`, then `q_pe` roped).
    pub q: &'a B,
    /// Query rows (decode tokens).
    pub n: usize,
    /// Heads per row.
    pub nh: usize,
    /// The paged cache `[num_blocks·block_size, width]`, rows `[kv_c_normed | k_pe]`.
    pub cache: &'a B,
    /// Tokens per cache page.
    pub block_size: usize,
    /// Cache row width, L+R.
    pub width: usize,
    /// Block ids of each row's pages, in position order.
    pub tables: &'a [Vec<usize>],
    /// Context length of each row.
    pub ctx: &'a [usize],
    /// KV splits per row.
    pub splits: usize,
    /// Value width (the first `dv` columns of a cache row), L.
    pub dv: usize,
    /// Softmax scale.
    pub scale: f32,
    /// LSE an empty split reports.
    pub empty_lse: f32,
}

impl<B> Clone for DecodeArgs<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B> Copy for DecodeArgs<'_, B> {}

impl<B> DecodeArgs<'_, B> {
    /// Runs `check(buffer, elements needed, name)` on `q [n, nh, width]`,
    /// `parts [splits, n, nh, dv]` and `lses [splits, n, nh]` (names `decode q`, `decode parts`,
    /// `decode lses`), so that a backend's kernel never reads or writes past them.
    ///
    /// Errors: the first error `check` returns.
    pub fn check_lens(&self, parts: &B, lses: &B, check: impl Fn(&B, usize, &str) -> Result<()>) -> Result<()> {
        let (n, nh, splits) = (self.n, self.nh, self.splits);
        check(self.q, n * nh * self.width, "decode q")?;
        check(parts, splits * n * nh * self.dv, "decode parts")?;
        check(lses, splits * n * nh, "decode lses")
    }
}

/// The unfused [`Ops::decode_merged`]: stage 1 into canary-filled partials, then the merge.
pub fn decode_then_merge<O: Ops + ?Sized>(ops: &O, d: &DecodeArgs<'_, O::Buf>) -> Result<(O::Buf, O::Buf)> {
    let (n, nh, splits, dv) = (d.n, d.nh, d.splits, d.dv);
    let mut parts = ops.canary(splits * n * nh * dv)?;
    let mut lses = ops.canary(splits * n * nh)?;
    ops.decode_split(d, &mut parts, &mut lses)?;
    ops.merge(&parts, &lses, splits, n, nh, dv)
}

/// Rotates one rope vector `x` \[R] in place with the cos/sin row of its position (`[R/2]` each).
/// Host code, shared by the CPU backend's rope kernel and the engine's host-side indexer.
pub fn rope_row(x: &mut [f32], cos: &[f32], sin: &[f32], style: RopeStyle) {
    let half = cos.len();
    for i in 0..half {
        let (ia, ib) = match style {
            RopeStyle::Interleaved => (2 * i, 2 * i + 1),
            RopeStyle::Neox => (i, i + half),
        };
        let (a, b) = (x[ia], x[ib]);
        x[ia] = a * cos[i] - b * sin[i];
        x[ib] = b * cos[i] + a * sin[i];
    }
}
