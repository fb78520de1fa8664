//! The tensor-core launches: `flash_prefill_mma` (kernels/fast_prefill.cu) and
//! `decode_split_mma` (kernels/fast_decode.cu).
//!
//! Unlike the simple kernels, these are compiled per shape and launch configuration, read bf16
//! copies of their inputs, and carry rules the configuration must meet on the device (wgmma only
//! on sm_90, a cluster merge only where its partials fit). The engine reaches them through
//! `launches`; the benchmarks call [`CudaOps::prefill_mma`] and [`CudaOps::decode_mma`]
//! directly with a configuration of their own, so the launch descriptions ([`DecodeLaunch`],
//! [`DecodeShape`], [`DecodeMerge`]) are public.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use crate::backend::decode_cfg::DecodeCfg;
use crate::backend::prefill_cfg::PrefillCfg;
use crate::compute::ops::{DecodeArgs, PrefillArgs};
use crate::core::error::{Error, Result};
use crate::device::Module;

use super::CudaOps;

impl CudaOps {
    /// Tensor-core flash prefill ([`CudaOps::prefill_mma`]) on bf16 copies of `a`'s f32 inputs.
    pub(super) fn flash_prefill_fast(
        &self,
        a: &PrefillArgs<'_, CudaSlice<f32>>,
        out: &mut CudaSlice<f32>,
        lse: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let (qb, kb, vb) = (
            self.to_bf16(a.q, a.q.len())?,
            self.to_bf16(a.k, a.k.len())?,
            self.to_bf16(a.v, a.v.len())?,
        );
        self.prefill_mma(None, &a.with_inputs(&qb, &kb, &vb), out, lse)
    }

    /// Launches `flash_prefill_mma` on bf16 inputs (`a.q [Tq, nh, dqk]`, `a.k [Tk, nh, dqk]`,
    /// `a.v [Tk, nh, dv]`), writing `out [Tq, nh, dv]` and `lse [Tq, nh]` (f32; see
    /// fast_prefill.cu), in configuration `cfg` (None: `MLA_DIFF_PREFILL_CFG` as read by
    /// [`CudaOps::new`] if set, else the default), adapted to the head widths by
    /// [`PrefillCfg::for_shape`]. The caller checks the buffer lengths
    /// ([`PrefillArgs::check_lens`]).
    ///
    /// Errors: tile offsets past 32 bits, an NVRTC compile or module load failure, or a launch
    /// failure, each naming the kernel.
    pub fn prefill_mma(
        &self,
        cfg: Option<PrefillCfg>,
        a: &PrefillArgs<'_, CudaSlice<half::bf16>>,
        out: &mut CudaSlice<f32>,
        lse: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let (nh, dqk, dv, scale) = (a.nh, a.dqk, a.dv, a.scale);
        let pc = self.prefill_cfg_for(cfg, dqk, dv);
        // The kernel's offsets inside one K/V tile are 32-bit.
        if pc.bk * nh * dqk.max(dv) > i32::MAX as usize {
            return Err(Error::cuda(format!(
                "flash_prefill_mma: {nh} heads of width {} overflow the kernel's 32-bit tile offsets",
                dqk.max(dv)
            )));
        }
        let mut segs = Vec::new();
        let mut tiles = Vec::new();
        for (si, sg) in a.segments.iter().enumerate() {
            segs.extend([sg.q_off, sg.q_len, sg.k_off, sg.k_len, usize::from(sg.causal)]);
            // Causal tiles further down see more keys: schedule the heaviest first.
            for q0 in (0..sg.q_len).step_by(pc.rows()).rev() {
                tiles.extend([si, q0]);
            }
        }
        if tiles.is_empty() {
            return Ok(());
        }
        let smem = pc.smem(dqk, dv);
        // Keys read by index are a build of their own, so the dense kernel's registers stay.
        let mut defines = pc.defines();
        if a.key_rows.is_some() {
            defines.push(("FP_INDIRECT", 1));
        }
        let f = self.dev.fast_function(Module::FastPrefill, dqk, dv, &defines, smem)?;
        let (segs_d, tiles_d) = (self.idx(&segs)?, self.idx(&tiles)?);
        let krows_d = self.idx(a.key_rows.unwrap_or(&[]))?;
        let cfg = LaunchConfig {
            grid_dim: ((tiles.len() / 2) as u32, nh as u32, 1),
            block_dim: (pc.threads() as u32, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let (h, em) = (nh as i64, a.empty.code());
        let mut b = self.dev.stream().launch_builder(&f);
        b.arg(a.q)
            .arg(a.k)
            .arg(a.v)
            .arg(out)
            .arg(lse)
            .arg(&segs_d)
            .arg(&tiles_d)
            .arg(&krows_d)
            .arg(&h)
            .arg(&scale)
            .arg(&em);
        // SAFETY: arguments match flash_prefill_mma in fast_prefill.cu.
        unsafe { b.launch(cfg) }.map_err(|e| Error::cuda(format!("launch flash_prefill_mma: {e:?}")))?;
        self.sync("flash_prefill_mma")
    }

    /// The device inputs of a tensor-core decode launch for `d`: bf16 copies of the query rows
    /// and the cache, the block tables (padded to one `[n, max_blocks]` array) and context
    /// lengths as i64, and the launch configuration (`MLA_DIFF_DECODE_CFG` as read by
    /// [`CudaOps::new`] if set, else the default for the head count, fitted to the widths and the
    /// device).
    ///
    /// Errors: a block table shorter than its context or reaching
    /// past the cache, CUDA allocation or copy failures.
    pub(super) fn fast_decode_inputs(&self, d: &DecodeArgs<'_, CudaSlice<f32>>) -> Result<FastDecodeInputs> {
        let (flat, max_blocks) = Self::flat_tables(d.cache, d.block_size, d.width, d.tables, d.ctx)?;
        let cfg = self.decode_cfg_for(d.nh, d.width, d.dv);
        Ok(FastDecodeInputs {
            q: self.to_bf16(d.q, d.q.len())?,
            cache: self.to_bf16(d.cache, d.cache.len())?,
            tables: self.idx(&flat)?,
            ctx: self.idx(d.ctx)?,
            shape: DecodeShape {
                n: d.n,
                nh: d.nh,
                block_size: d.block_size,
                width: d.width,
                max_blocks,
                splits: d.splits,
                dv: d.dv,
                cfg,
                spin: None,
            },
            scale: d.scale,
            empty_lse: d.empty_lse,
        })
    }

    /// Launches `decode_split_mma` on the device inputs of `l` ([`DecodeLaunch`]), writing each
    /// split's partial output into `parts [splits, n, nh, dv]` and its LSE into
    /// `lses [splits, n, nh]` (f32). With `merge`, the kernel also merges
    /// the splits, as [`crate::compute::ops::Ops::merge`] would, into `merge.out` and
    /// `merge.lse`: through a thread-block cluster of the `splits` blocks of each token and head group where
    /// [`DecodeCfg::cluster_size`] is not 0 for this device (then `parts`, `lses` and
    /// `merge.counters` are not touched), else by the last block of each token and head group
    /// to finish, through `parts` and `lses`.
    ///
    /// # Errors
    /// [`Error::Cuda`] when a merge output or the counters are too short, when `l.shape.cfg` is the
    /// wgmma block and the device is not sm_90 or the shape is outside
    /// [`DecodeCfg::wgmma_fits`], when the cluster
    /// merge's partials do not fit in a block's shared memory ([`DecodeCfg::cluster_fits`]), or
    /// on a compile or launch failure.
    pub fn decode_mma(
        &self,
        l: &DecodeLaunch<'_>,
        parts: &mut CudaSlice<f32>,
        lses: &mut CudaSlice<f32>,
        merge: Option<DecodeMerge<'_>>,
    ) -> Result<()> {
        let (sh, dc) = (l.shape, l.shape.cfg);
        if dc.wgmma && !(self.dev.arch.has_wgmma() && DecodeCfg::wgmma_fits(sh.width, sh.dv)) {
            return Err(Error::cuda(format!(
                "decode configuration {}: wgmma needs sm_90 (this device is {}) and L a multiple of 128 with L+R <= 576 (here L+R = {}, L = {})",
                dc.label(),
                self.dev.arch,
                sh.width,
                sh.dv
            )));
        }
        let smem = dc.smem(sh.width);
        let cluster = dc.cluster_size(self.dev.arch, sh.splits, sh.dv, merge.is_some());
        if (cluster > 0 || dc.teams > 1) && !dc.cluster_fits(sh.width, sh.dv, cluster) {
            return Err(Error::cuda(format!(
                "decode configuration {}: the {} partial output [{}, {}] f32 does not fit in the block's {smem} bytes of shared memory (use CLUSTER 0, one team or fewer heads per block)",
                dc.label(),
                if cluster > 0 {
                    "cluster merge's"
                } else {
                    "team combine's"
                },
                dc.heads,
                sh.dv
            )));
        }
        let f = self
            .dev
            .fast_function(Module::FastDecode, sh.width, sh.dv, &dc.defines_for(cluster), smem)?;
        // With a cluster, grid.y = splits = the cluster's y size (__cluster_dims__(1, c, 1)):
        // one cluster per (token, head group).
        let cfg = LaunchConfig {
            grid_dim: ((sh.n * sh.nh.div_ceil(dc.heads)) as u32, sh.splits as u32, 1),
            block_dim: (dc.threads() as u32, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let a = [sh.n, sh.nh, sh.block_size, sh.max_blocks, sh.splits].map(|x| x as i64);
        let mut b = self.dev.stream().launch_builder(&f);
        b.arg(l.q).arg(l.cache).arg(l.tables).arg(l.ctx).arg(parts).arg(lses);
        b.arg(&a[0])
            .arg(&a[1])
            .arg(&a[2])
            .arg(&a[3])
            .arg(&a[4])
            .arg(&l.scale)
            .arg(&l.empty_lse);
        let null = 0u64;
        // The splits can share the merge out only when it runs through global memory.
        let possible = merge.is_some() && cluster == 0 && (2..=255).contains(&sh.splits);
        let spin = i32::from(self.spin_merge(&sh, possible)?);
        match merge {
            Some(m) => {
                let groups = sh.n * sh.nh.div_ceil(dc.heads);
                Self::check_len(m.out, sh.n * sh.nh * sh.dv, "decode merged out")?;
                Self::check_len(m.lse, sh.n * sh.nh, "decode merged lse")?;
                if m.counters.len() < groups {
                    return Err(Error::cuda(format!(
                        "decode merge counters: {} for {groups} blocks per split",
                        m.counters.len()
                    )));
                }
                b.arg(m.out).arg(m.lse).arg(m.counters);
            }
            None => {
                b.arg(&null).arg(&null).arg(&null);
            }
        }
        b.arg(&spin);
        // SAFETY: arguments match decode_split_mma in fast_decode.cu (null out: no merge).
        unsafe { b.launch(cfg) }.map_err(|e| Error::cuda(format!("launch decode_split_mma: {e:?}")))?;
        self.sync("decode_split_mma")
    }
}

/// Outputs of the merge fused into `decode_split_mma` ([`CudaOps::decode_mma`]).
pub struct DecodeMerge<'a> {
    /// Merged output `[n, nh, dv]`.
    pub out: &'a mut CudaSlice<f32>,
    /// Merged LSE `[n, nh]`.
    pub lse: &'a mut CudaSlice<f32>,
    /// One counter per (token, head group), `n·⌈nh/heads⌉` of them: zero before the launch, zero
    /// again after it.
    pub counters: &'a mut CudaSlice<i32>,
}

/// Shape of a split-KV decode launch.
#[derive(Debug, Clone, Copy)]
pub struct DecodeShape {
    /// Query rows (decode tokens).
    pub n: usize,
    /// Heads per row.
    pub nh: usize,
    /// Tokens per cache page.
    pub block_size: usize,
    /// Cache row width, L+R.
    pub width: usize,
    /// Columns of the block-table array.
    pub max_blocks: usize,
    /// KV splits per row.
    pub splits: usize,
    /// Value width, L.
    pub dv: usize,
    /// Launch configuration.
    pub cfg: DecodeCfg,
    /// How the fused merge is shared out (see fast_decode.cu's `fd_merge_tail`): `None` lets
    /// [`CudaOps::decode_mma`] choose (every split merges its share when every block of the
    /// launch is resident at once, unless `MLA_DIFF_DECODE_SPIN=0`; `force` spins regardless);
    /// `Some(false)`: the last split merges everything; `Some(true)`: every split merges its
    /// share even when the blocks do not all fit (the kernel then gives up waiting after a few ms
    /// per block and falls back to the last split merging everything: for tests).
    pub spin: Option<bool>,
}

/// One launch of `decode_split_mma` ([`CudaOps::decode_mma`]): its inputs already on the
/// device, its shape, and the scalars of the softmax.
pub struct DecodeLaunch<'a> {
    /// Query rows `[n, nh, width]`, bf16: each head's `[ql_nope | q_pe]` (roped).
    pub q: &'a CudaSlice<half::bf16>,
    /// The paged latent cache `[num_blocks·block_size, width]`, bf16, rows `[kv_c_normed | k_pe]`.
    pub cache: &'a CudaSlice<half::bf16>,
    /// Block ids of each row's pages `[n, max_blocks]`, i64, rows padded with block 0.
    pub tables: &'a CudaSlice<i64>,
    /// Context length (tokens) of each row `[n]`, i64.
    pub ctx: &'a CudaSlice<i64>,
    /// Shape and configuration.
    pub shape: DecodeShape,
    /// Softmax scale multiplying `q·k`.
    pub scale: f32,
    /// LSE an empty split reports (−inf is right).
    pub empty_lse: f32,
}

/// What [`CudaOps::fast_decode_inputs`] puts on the device for one [`DecodeArgs`].
pub(super) struct FastDecodeInputs {
    q: CudaSlice<half::bf16>,
    cache: CudaSlice<half::bf16>,
    tables: CudaSlice<i64>,
    ctx: CudaSlice<i64>,
    pub(super) shape: DecodeShape,
    scale: f32,
    empty_lse: f32,
}

impl FastDecodeInputs {
    /// The launch reading these inputs.
    pub(super) fn launch(&self) -> DecodeLaunch<'_> {
        DecodeLaunch {
            q: &self.q,
            cache: &self.cache,
            tables: &self.tables,
            ctx: &self.ctx,
            shape: self.shape,
            scale: self.scale,
            empty_lse: self.empty_lse,
        }
    }
}
