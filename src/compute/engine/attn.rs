//! One rank's attention context (its heads, weights and prologue outputs), the causal and sparse
//! attention helpers every path uses, and the paged latent cache with its shuffled block table.

use super::*;

/// Per-rank attention inputs and settings shared by the attention variants.
pub(super) struct RankAttn<'a, O: Ops> {
    pub(super) ops: &'a O,
    pub(super) cfg: &'a MlaConfig,
    pub(super) rw: &'a RankWeights<O::Buf>,
    /// Heads on this rank.
    pub(super) nh: usize,
    /// `q` [T, nh, P+R].
    pub(super) q: &'a O::Buf,
    /// `q_pe_roped` [T, nh, R].
    pub(super) q_pe_roped: &'a O::Buf,
    /// `kv_c_normed` [T, L] (replicated).
    pub(super) kv_c_normed: &'a O::Buf,
    /// `k_pe_roped` [T, R] (replicated).
    pub(super) k_pe_roped: &'a O::Buf,
    /// Softmax scale the kernels use.
    pub(super) scale: f32,
    pub(super) opts: &'a PathOptions,
    /// The DSA selection (packed token → kept key indices of its sequence); `None`: dense.
    pub(super) sel: Option<&'a Selection>,
}

/// What one rank's attention op produced. `out` is what the CALLER's buffer holds afterwards.
pub(super) struct RankOut<B> {
    /// `attn_out` [T, nh, V] as the caller sees it.
    pub(super) out: B,
    /// `lse` [T, nh].
    pub(super) lse: B,
    /// `k_nope` [T, nh, P] and `v` [T, nh, V] (expanded paths).
    pub(super) k_nope: Option<B>,
    pub(super) v: Option<B>,
    /// `ql_nope` and `attn_latent` [T, nh, L] (absorbed path).
    pub(super) ql_nope: Option<B>,
    pub(super) attn_latent: Option<B>,
}

impl<O: Ops> RankAttn<'_, O> {
    /// Expanded K/V of `rows` latent rows: `kv_b_proj`, then the per-head split (or the grouped
    /// split of the `kv-b-grouped` fault). Returns (`k_nope` [rows, nh, P], `v` [rows, nh, V]).
    pub(super) fn expand_kv(&self, kv_c: &O::Buf, rows: usize) -> Result<(O::Buf, O::Buf)> {
        let [_, l, p, _, v] = self.cfg.dims().nlprv();
        let nh = self.nh;
        let ops = self.ops;
        let kv_q = fp8_in(ops, self.opts, kv_c, l)?;
        let kv = ops.linear(kv_q.as_ref().unwrap_or(kv_c), rows, l, &self.rw.kv_b, nh * (p + v))?;
        let mut k_nope = ops.canary(rows * nh * p)?;
        let mut vv = ops.canary(rows * nh * v)?;
        if self.opts.faults.has(Fault::KvBGrouped) {
            ops.copy2d(
                &kv,
                &mut k_nope,
                copy_rows(rows, nh * p).src(0, nh * (p + v)).dst(0, nh * p),
            )?;
            ops.copy2d(
                &kv,
                &mut vv,
                copy_rows(rows, nh * v).src(nh * p, nh * (p + v)).dst(0, nh * v),
            )?;
        } else {
            ops.copy2d(&kv, &mut k_nope, copy_rows(rows * nh, p).src(0, p + v).dst(0, p))?;
            ops.copy2d(&kv, &mut vv, copy_rows(rows * nh, v).src(p, p + v).dst(0, v))?;
        }
        Ok((k_nope, vv))
    }

    /// `[q_nope | q_pe_roped]` for all T rows, [T, nh, P+R].
    pub(super) fn full_q(&self, t: usize) -> Result<O::Buf> {
        let (p, r, nh) = (self.cfg.qk_nope_head_dim, self.cfg.qk_rope_head_dim, self.nh);
        let mut qf = self.ops.canary(t * nh * (p + r))?;
        self.ops
            .copy2d(self.q, &mut qf, copy_rows(t * nh, p).src(0, p + r).dst(0, p + r))?;
        self.ops
            .copy2d(self.q_pe_roped, &mut qf, copy_rows(t * nh, r).src(0, r).dst(p, p + r))?;
        Ok(qf)
    }

    /// `[k_nope | k_pe_roped broadcast over heads]` for `rows` rows, [rows, nh, P+R].
    pub(super) fn full_k(&self, k_nope: &O::Buf, k_pe_roped: &O::Buf, rows: usize) -> Result<O::Buf> {
        let (p, r, nh) = (self.cfg.qk_nope_head_dim, self.cfg.qk_rope_head_dim, self.nh);
        let mut kf = self.ops.canary(rows * nh * (p + r))?;
        self.ops
            .copy2d(k_nope, &mut kf, copy_rows(rows * nh, p).src(0, p).dst(0, p + r))?;
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
    /// and the caller's buffer stays as allocated (the canary); with `phantom-output-stale` it
    /// stays as a real allocator hands it out ([`stale_floats`]).
    pub(super) fn deliver(&self, result: O::Buf, n: usize) -> Result<O::Buf> {
        if self.opts.faults.has(Fault::PhantomOutput) {
            self.ops.canary(n)
        } else if self.opts.faults.has(Fault::PhantomOutputStale) {
            let lost = self.ops.download(&result)?;
            self.ops.upload(&stale_floats(&lost))
        } else {
            Ok(result)
        }
    }

    /// The [`RankOut`] of an expanded path (MHA, chunked, mixed): `result` [T, nh, V] as
    /// [`Self::deliver`] hands it to the caller, `lse` [T, nh], and the `k_nope` [T, nh, P] and
    /// `v` [T, nh, V] the path attended over.
    pub(super) fn expanded_out(
        &self,
        t: usize,
        result: O::Buf,
        lse: O::Buf,
        k_nope: O::Buf,
        v: O::Buf,
    ) -> Result<RankOut<O::Buf>> {
        Ok(RankOut {
            out: self.deliver(result, t * self.nh * self.cfg.v_head_dim)?,
            lse,
            k_nope: Some(k_nope),
            v: Some(v),
            ql_nope: None,
            attn_latent: None,
        })
    }

    /// `ql_nope = q_nope · W_UK_T` per head, [T, nh, L].
    pub(super) fn absorb_q(&self, t: usize) -> Result<O::Buf> {
        let [_, l, p, _, _] = self.cfg.dims().nlprv();
        self.ops.bmm_heads(&self.q_nope(t)?, t, self.nh, p, &self.rw.w_uk_t, l)
    }

    /// [`RankAttn::absorb_q`] as a half-precision GEMM computes it, for `fp16-accum-ql-nope`
    /// ([`bmm_heads_f16_accum`], on the host).
    ///
    /// Errors: backend errors.
    pub(super) fn absorb_q_f16_accum(&self, t: usize) -> Result<O::Buf> {
        let [_, l, p, _, _] = self.cfg.dims().nlprv();
        let x = self.ops.download(&self.q_nope(t)?)?;
        let w = self.ops.download(&self.rw.w_uk_t)?;
        self.ops.upload(&bmm_heads_f16_accum(&x, t, self.nh, p, &w, l))
    }

    /// `q_nope` [T, nh, P]: the first P columns of each head of `q`.
    fn q_nope(&self, t: usize) -> Result<O::Buf> {
        let [_, _, p, r, _] = self.cfg.dims().nlprv();
        let nh = self.nh;
        let mut q_nope = self.ops.canary(t * nh * p)?;
        self.ops
            .copy2d(self.q, &mut q_nope, copy_rows(t * nh, p).src(0, p + r).dst(0, p))?;
        Ok(q_nope)
    }

    /// Per-sequence causal segments over packed rows.
    pub(super) fn causal_segments(seqs: &[(usize, usize)]) -> Vec<Segment> {
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

/// What a freshly allocated output buffer of `lost.len()` f32 held before the attention op
/// should have written it, for `phantom-output-stale`: `torch.empty` (a caching allocator's
/// reused block) returns the floats some earlier tensor left there, finite and of any size. The
/// values here are seeded normals with the RMS of the result that never arrived (`lost`), which
/// makes them as hard to tell from an attention output by their size as stale memory can be;
/// they are drawn independently of the result, as an earlier tensor's bytes are.
pub(super) fn stale_floats(lost: &[f32]) -> Vec<f32> {
    let finite: Vec<f64> = lost.iter().filter(|v| v.is_finite()).map(|&v| f64::from(v)).collect();
    let rms = (finite.iter().map(|v| v * v).sum::<f64>() / finite.len().max(1) as f64).sqrt();
    let rms = if rms > 0.0 { rms } else { 1.0 };
    crate::core::batch::normal_f32(STALE_SEED, lost.len())
        .into_iter()
        .map(|v| (f64::from(v) * rms) as f32)
        .collect()
}

/// The seed of [`stale_floats`]: any fixed value (the fault must give the same bytes on every
/// backend and run).
const STALE_SEED: u64 = 0x5717_E0F7;

impl<O: Ops> RankAttn<'_, O> {
    /// Sparse attention of query rows `q_rows` of `q` [·, nh, P+R] over per-row key lists
    /// (`keys[i]`: rows of `k` [·, nh, P+R] / `v` [·, nh, V]), as a sparse MLA prefill kernel
    /// runs it on the indexer's indices: the kernel reads each kept key in place through
    /// [`PrefillArgs::key_rows`] ([`sparse_segments`] lays them out). A row with no key gets
    /// `empty`. Returns (`out` [n, nh, V], `lse` [n, nh]) in `q_rows` order.
    ///
    /// Memory: the indices, `Σ |keys[i]|` of them (at most T · top-k), and the `n` query rows;
    /// never a copy of the keys per query, which would hold `Σ |keys[i]| · nh · (P+R+V)` floats.
    pub(super) fn sparse_rows(
        &self,
        q: &O::Buf,
        q_rows: &[usize],
        k: &O::Buf,
        v: &O::Buf,
        keys: &[Vec<usize>],
        empty: EmptyRows,
    ) -> Result<(O::Buf, O::Buf)> {
        let [_, _, p, r, dv] = self.cfg.dims().nlprv();
        let nh = self.nh;
        let ops = self.ops;
        let n = q_rows.len();
        let (segs, key_rows) = sparse_segments(keys);
        let qg = ops.gather_rows(q, nh * (p + r), q_rows)?;
        let mut out = ops.canary(n * nh * dv)?;
        let mut lse = ops.canary(n * nh)?;
        ops.flash_attention(
            &PrefillArgs {
                q: &qg,
                k,
                v,
                nh,
                dqk: p + r,
                dv,
                segments: &segs,
                scale: self.scale,
                empty,
                key_rows: Some(&key_rows),
            },
            &mut out,
            &mut lse,
        )?;
        Ok((out, lse))
    }

    /// Causal attention of every row of the sequences `seqs` ((first packed row, length)) over
    /// its own sequence, written into those rows of `out` [T, nh, V] / `lse` [T, nh]; with a DSA
    /// selection, over the kept keys only.
    pub(super) fn causal_into(
        &self,
        q: &O::Buf,
        k: &O::Buf,
        v: &O::Buf,
        seqs: &[(usize, usize)],
        out: &mut O::Buf,
        lse: &mut O::Buf,
    ) -> Result<()> {
        let [_, _, p, r, dv] = self.cfg.dims().nlprv();
        let nh = self.nh;
        if self.sel.is_none() {
            return self.ops.flash_attention(
                &PrefillArgs {
                    q,
                    k,
                    v,
                    nh,
                    dqk: p + r,
                    dv,
                    segments: &Self::causal_segments(seqs),
                    scale: self.scale,
                    empty: EmptyRows::ZeroMinusInf,
                    key_rows: None,
                },
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
    pub(super) fn kept(&self, row: usize, off: usize, range: Range<usize>) -> Vec<usize> {
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
pub(super) struct CacheState<B> {
    pub(super) cache: B,
    pub(super) tables: Vec<Vec<usize>>,
    pub(super) block_size: usize,
    pub(super) width: usize,
    /// How the cache is read and written: as its metadata says, or with a paged-cache fault.
    pub(super) mode: CacheFault,
}

/// A paged-cache fault of the cache's readers or writer (docs/faults.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum CacheFault {
    /// Read and written as the block tables and the page size say.
    None,
    /// `paged-kv-page-size`: read with page size 1, the block ids taken as token slots.
    ReadPageOne,
    /// `paged-kv-block-offset`: read through each table one entry further on.
    ReadNextBlock,
    /// `slot-mapping-offset`: each row written one slot early.
    WriteSlotEarly,
}

impl CacheFault {
    fn of(opts: &PathOptions) -> Self {
        let f = &opts.faults;
        if f.has(Fault::PagedKvPageSize) && opts.page_size > 1 {
            CacheFault::ReadPageOne
        } else if f.has(Fault::PagedKvBlockOffset) {
            CacheFault::ReadNextBlock
        } else if f.has(Fault::SlotMappingOffset) {
            CacheFault::WriteSlotEarly
        } else {
            CacheFault::None
        }
    }
}

/// The note of `paged-kv-page-size` at page size 1, where reading the block ids as token slots
/// is what the cache holds: the fault has nothing to act on.
pub(super) fn page_size_fault_note(opts: &PathOptions) -> Option<String> {
    (opts.faults.has(Fault::PagedKvPageSize) && opts.page_size <= 1).then(|| {
        "paged-kv-page-size: at page size 1 the block ids are the token slots already; the fault had nothing to act on (use --page-size 16)"
            .into()
    })
}

impl<B> CacheState<B> {
    /// Enough pages for every sequence plus one spare, handed out in a shuffled order. The cache
    /// starts zeroed, as vLLM allocates it (`torch.zeros`): a slot no row was written to reads
    /// as a zero latent row.
    pub(super) fn new<O: Ops<Buf = B>>(ops: &O, batch: &Batch, cfg: &MlaConfig, opts: &PathOptions) -> Result<Self> {
        let page = opts.page_size.max(1);
        let (num_blocks, tables) = paged_block_tables(batch, page, opts.seed);
        let width = cfg.kv_lora_rank + cfg.qk_rope_head_dim;
        Ok(CacheState {
            cache: ops.upload(&vec![0f32; num_blocks * page * width])?,
            tables,
            block_size: page,
            width,
            mode: CacheFault::of(opts),
        })
    }

    /// The cache slot of position `i` of sequence `seq` (slot = block · block_size + offset).
    pub(super) fn slot(&self, seq: usize, i: usize) -> usize {
        self.tables[seq][i / self.block_size] * self.block_size + i % self.block_size
    }

    /// Block `b` of sequence `seq`'s table as a kernel reads it: past the table's end, block 0
    /// (the padding of vLLM's `[S, max_blocks]` block table).
    fn table_entry(&self, seq: usize, b: usize) -> usize {
        self.tables[seq].get(b).copied().unwrap_or(0)
    }

    /// The slot a kernel reads for position `i` of sequence `seq`: [`Self::slot`], or with a
    /// read fault the slot its wrong metadata gives.
    pub(super) fn read_slot(&self, seq: usize, i: usize) -> usize {
        let p = self.block_size;
        match self.mode {
            CacheFault::ReadPageOne => self.table_entry(seq, i),
            CacheFault::ReadNextBlock => self.table_entry(seq, i / p + 1) * p + i % p,
            CacheFault::None | CacheFault::WriteSlotEarly => self.slot(seq, i),
        }
    }

    /// The block table and block size a decode kernel reads sequence `seq` with for a context
    /// of `ctx` positions: its own and the cache's, or with a read fault the wrong ones (padded
    /// with block 0 to cover `ctx`, as an engine's block-table rows are).
    pub(super) fn read_table(&self, seq: usize, ctx: usize) -> (Vec<usize>, usize) {
        let p = self.block_size;
        match self.mode {
            CacheFault::ReadPageOne => ((0..ctx.max(1)).map(|b| self.table_entry(seq, b)).collect(), 1),
            CacheFault::ReadNextBlock => (
                (0..ctx.div_ceil(p).max(1))
                    .map(|b| self.table_entry(seq, b + 1))
                    .collect(),
                p,
            ),
            CacheFault::None | CacheFault::WriteSlotEarly => (self.tables[seq].clone(), p),
        }
    }

    /// The block size a decode kernel reads the cache with ([`Self::read_table`]).
    pub(super) fn read_block_size(&self) -> usize {
        if self.mode == CacheFault::ReadPageOne {
            1
        } else {
            self.block_size
        }
    }

    /// `concat_and_cache_mla` for packed rows `rows` (positions `pos` of sequences `seqs`); with
    /// `slot-mapping-offset` each row goes one slot early, and a row whose slot would be −1 is not
    /// written (vLLM skips negative slots).
    pub(super) fn write<O: Ops<Buf = B>>(
        &mut self,
        a: &RankAttn<'_, O>,
        rows: &[usize],
        seqs: &[usize],
        pos: &[usize],
    ) -> Result<()> {
        let mut kept = Vec::with_capacity(rows.len());
        let mut slots = Vec::with_capacity(rows.len());
        for ((&row, &s), &i) in rows.iter().zip(seqs).zip(pos) {
            let slot = self.slot(s, i);
            let slot = if self.mode == CacheFault::WriteSlotEarly {
                match slot.checked_sub(1) {
                    Some(x) => x,
                    None => continue,
                }
            } else {
                slot
            };
            kept.push(row);
            slots.push(slot);
        }
        if kept.is_empty() {
            return Ok(());
        }
        let (l, r) = (a.cfg.kv_lora_rank, a.cfg.qk_rope_head_dim);
        let mut kv = a.ops.gather_rows(a.kv_c_normed, l, &kept)?;
        let mut kp = a.ops.gather_rows(a.k_pe_roped, r, &kept)?;
        // An fp8 cache stores what `concat_and_cache_mla` converts: e4m3(x / k_scale).
        if let Some(q) = &a.opts.kv_cache {
            if a.opts.faults.has(Fault::KvCacheScaleTwice) {
                // Stored e4m3(x/S²), read back × S: the written scale S² as the cache rounds with
                // it, divided by S.
                let twice = crate::core::fp8::KvCacheQuant {
                    scale: q.scale * q.scale,
                    ..*q
                };
                let back = |b: &B| -> Result<B> {
                    let v = a.ops.download(b)?;
                    a.ops.adopt(
                        v.into_iter()
                            .map(|x| (twice.round(f64::from(x)) / q.scale) as f32)
                            .collect(),
                    )
                };
                kv = back(&kv)?;
                kp = back(&kp)?;
            } else {
                kv = a.ops.fp8_cache_rows(&kv, q)?;
                kp = a.ops.fp8_cache_rows(&kp, q)?;
            }
        }
        a.ops.cache_write(&mut self.cache, self.width, &kv, &kp, l, r, &slots)
    }
}

/// The paged latent cache's layout for `batch` with `page` tokens per page (at least 1): the
/// number of blocks (every sequence's ⌈len/page⌉ pages plus one spare that no table holds) and
/// each sequence's block table, its block ids in position order. The blocks are handed out in an
/// order shuffled from `seed`, so a kernel that reads block `i` where the table says another
/// reads another sequence's rows. Every engine path's cache and `run --export-inputs` use it.
pub fn paged_block_tables(batch: &Batch, page: usize, seed: u64) -> (usize, Vec<Vec<usize>>) {
    let page = page.max(1);
    let pages: Vec<usize> = batch.seqs.iter().map(|s| s.len.div_ceil(page)).collect();
    let num_blocks = pages.iter().sum::<usize>() + 1;
    let mut physical: Vec<usize> = (0..num_blocks).collect();
    SplitMix64::new(seed ^ 0x5EED_B10C).shuffle(&mut physical);
    let mut tables = Vec::with_capacity(pages.len());
    let mut next = 0;
    for &np in &pages {
        tables.push(physical[next..next + np].to_vec());
        next += np;
    }
    (num_blocks, tables)
}

/// `fp16-accum-ql-nope`'s product: `x [t, nh, a] · w [nh, a, b] → [t, nh, b]` as a half-precision
/// GEMM computes it (llama.cpp PR #13137's `q_nope·W_UK` under an f32 flag): each operand
/// rounded to f16, each product added to an f16 running sum in `a` order and the sum rounded to
/// f16 after every term, on the host.
fn bmm_heads_f16_accum(x: &[f32], t: usize, nh: usize, a: usize, w: &[f32], b: usize) -> Vec<f32> {
    use rayon::prelude::*;
    let h16 = |v: f32| half::f16::from_f32(v).to_f64();
    let xr: Vec<f64> = x.iter().map(|&v| h16(v)).collect();
    let wr: Vec<f64> = w.iter().map(|&v| h16(v)).collect();
    let mut out = vec![0f32; t * nh * b];
    out.par_chunks_mut(b).enumerate().for_each(|(row, o)| {
        let h = row % nh;
        let xs = &xr[row * a..(row + 1) * a];
        for (j, oj) in o.iter_mut().enumerate() {
            let acc = xs.iter().enumerate().fold(0f64, |acc, (i, &xv)| {
                half::f16::from_f64(acc + xv * wr[(h * a + i) * b + j]).to_f64()
            });
            *oj = acc as f32;
        }
    });
    out
}

/// What path `kind` read through its paged latent cache for `batch`, as the `paged-kv` replays
/// need it ([`PagedStep`]): the page size and block tables of its metadata (the cache's own,
/// whatever a paged-cache fault made the kernels read), its writes in the order it made them,
/// and per packed row the positions it read through the cache. `mqa` decodes every token over
/// the cache after writing every row; `mixed` writes its decode sequences and decodes their last
/// token; `chunked` writes each sequence's context and its new tokens read it through the cache
/// (and themselves directly). `None` for `mha`, which keeps no cache, and for a DSA layer, whose
/// attention reads the indexer's kept keys.
pub fn paged_step(kind: PathKind, batch: &Batch, opts: &PathOptions, cfg: &MlaConfig) -> Option<PagedStep> {
    if kind == PathKind::Mha || cfg.indexer.is_some() {
        return None;
    }
    let page = opts.page_size.max(1);
    let (_, tables) = paged_block_tables(batch, page, opts.seed);
    let offsets = batch.offsets();
    let lens: Vec<usize> = batch.seqs.iter().map(|s| s.len).collect();
    let n_dec = mixed_decode_seqs(batch);
    let split = chunked_split(batch, opts.new_tokens);
    let mut writes = Vec::new();
    let mut queries = Vec::with_capacity(batch.n_tokens());
    for (s, &len) in lens.iter().enumerate() {
        // Positions written to the cache, and the first position whose row reads it.
        let (written, cached_from) = match kind {
            PathKind::Mqa => (len, 0),
            PathKind::Mixed if s < n_dec => (len, len - 1),
            PathKind::Chunked => (split[s].0, split[s].0),
            _ => (0, len),
        };
        writes.extend((0..written).map(|pos| CacheWrite {
            seq: s,
            pos,
            slot: None,
        }));
        for i in 0..len {
            let cached = match kind {
                PathKind::Mqa => i + 1,
                PathKind::Mixed if i >= cached_from => len,
                PathKind::Chunked if i >= cached_from => cached_from,
                _ => 0,
            };
            queries.push(PagedQuery {
                seq: s,
                cached,
                upto: i + 1,
            });
        }
    }
    Some(PagedStep {
        page_size: Some(page),
        block_tables: Some(tables.iter().map(|t| t.iter().map(|&b| b as i64).collect()).collect()),
        pad_block: Some(0),
        seqs: offsets
            .iter()
            .zip(&lens)
            .map(|(&key_off, &len)| PagedSeq { key_off, len })
            .collect(),
        writes,
        queries,
        keys: None,
        zero_filled: true,
        cache_quant: opts.kv_cache,
    })
}
