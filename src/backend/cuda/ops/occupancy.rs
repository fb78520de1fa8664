//! What fits on the device, and which launch configuration a tensor-core launch runs.
//!
//! How many KV splits a decode launch runs, and whether its fused merge may spin, depend on how
//! many blocks of the compiled kernel an SM keeps resident: its registers and static shared
//! memory (from the compiled function) against the SM's limits (from the device). Those
//! queries, the configuration each tensor-core launch runs in (the backend's or the default,
//! fitted to the shape and the device) and whether a tensor-core kernel serves a shape at all
//! live here, so that the launches in [`super::fast`] only carry out what was decided.

use cudarc::driver::LaunchConfig;

use crate::backend::decode_cfg::{DecodeCfg, wave_splits};
use crate::backend::prefill_cfg::PrefillCfg;
use crate::core::error::{Error, Result};
use crate::core::settings::DecodeSpin;
use crate::device::Module;

use super::{CudaOps, DecodeShape};

impl CudaOps {
    /// Number of streaming multiprocessors of the device.
    pub fn sm_count(&self) -> Result<usize> {
        self.dev
            .context()
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map(|x| x.max(1) as usize)
            .map_err(|e| Error::cuda(format!("multiprocessor count: {e:?}")))
    }

    /// Blocks of `decode_split_mma` in configuration `cfg` resident per SM, for (L+R, L): the
    /// least of the thread, register and shared-memory limits (from the compiled kernel's
    /// attributes and the device's).
    pub fn decode_blocks_per_sm(&self, width: usize, dv: usize, cfg: DecodeCfg) -> Result<usize> {
        use cudarc::driver::sys::{CUdevice_attribute as D, CUfunction_attribute as F};
        let smem = cfg.smem(width);
        let f = self
            .dev
            .fast_function(Module::FastDecode, width, dv, &cfg.defines(), smem)?;
        let fa = |a: F| {
            f.get_attribute(a)
                .map(|x| x.max(0) as usize)
                .map_err(|e| Error::cuda(format!("decode_split_mma attribute {a:?}: {e:?}")))
        };
        let da = |a: D| {
            self.dev
                .context()
                .attribute(a)
                .map(|x| x.max(0) as usize)
                .map_err(|e| Error::cuda(format!("device attribute {a:?}: {e:?}")))
        };
        let (regs, static_smem) = (
            fa(F::CU_FUNC_ATTRIBUTE_NUM_REGS)?,
            fa(F::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)?,
        );
        let sm_threads = da(D::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR)?;
        let sm_regs = da(D::CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR)?;
        let sm_smem = da(D::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)?;
        let threads = cfg.threads();
        // Registers are allocated per warp in units of 256 (8 per thread), from the SM's four
        // sub-partitions (a quarter of the register file each; a block's warps are spread over
        // all four: cuda_occupancy.h); each block reserves 1 KiB of shared memory for the system.
        let warp_regs = regs.max(1).div_ceil(8) * 8 * 32;
        let by_threads = sm_threads / threads;
        let by_regs = ((sm_regs / 4) / warp_regs * 4) / (threads / 32);
        let by_smem = sm_smem / (smem + static_smem + 1024);
        Ok(by_threads.min(by_regs).min(by_smem).clamp(1, 32))
    }

    /// Clusters of `cluster` blocks of `decode_split_mma` in configuration `cfg` (compiled with
    /// `FD_CLUSTER` = `cluster`, for (L+R, L) = (`width`, `dv`)) that the device can hold at
    /// once (`cuOccupancyMaxActiveClusters`): a launch of more clusters than this runs in more
    /// than one wave.
    ///
    /// # Errors
    /// [`Error::Cuda`] when the kernel does not compile or the driver refuses the query (e.g.
    /// below sm_90).
    pub fn decode_max_active_clusters(&self, width: usize, dv: usize, cfg: DecodeCfg, cluster: usize) -> Result<usize> {
        let smem = cfg.smem(width);
        let f = self
            .dev
            .fast_function(Module::FastDecode, width, dv, &cfg.defines_for(cluster), smem)?;
        let lc = LaunchConfig {
            grid_dim: (1, cluster.max(1) as u32, 1),
            block_dim: (cfg.threads() as u32, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        f.occupancy_max_active_clusters(lc, self.dev.stream())
            .map(|x| x as usize)
            .map_err(|e| Error::cuda(format!("decode_split_mma: max active clusters of {cluster}: {e:?}")))
    }

    /// KV splits that fill whole waves: the `s` in `1..=max_splits` minimizing
    /// `⌈rows·groups·s / slots⌉ / s` (time in units of one unsplit block), the smallest on ties,
    /// where `slots` = SMs × resident blocks per SM.
    pub fn decode_splits_for(
        &self,
        rows: usize,
        nh: usize,
        width: usize,
        dv: usize,
        cfg: DecodeCfg,
        max_splits: usize,
    ) -> Result<usize> {
        let slots = self.sm_count()? * self.decode_blocks_per_sm(width, dv, cfg)?;
        Ok(wave_splits(rows * nh.div_ceil(cfg.heads), slots, max_splits))
    }

    /// Whether the tensor-core decode kernel serves rows of `width` (L+R) with value width `dv`
    /// (L) in this backend's dtype and kernels.
    pub(super) fn fast_decode_serves(&self, width: usize, dv: usize) -> bool {
        self.uses_fast() && width.is_multiple_of(16) && dv.is_multiple_of(32) && dv <= width
    }

    /// The decode configuration a tensor-core decode of `nh` heads over cache rows of `width`
    /// (L+R) with `dv` (L) value columns runs: `MLA_DIFF_DECODE_CFG` as read by [`CudaOps::new`]
    /// if set, else the default for the head count; fitted to the widths
    /// ([`DecodeCfg::fit`]) and the device ([`DecodeCfg::for_arch`]).
    pub(super) fn decode_cfg_for(&self, nh: usize, width: usize, dv: usize) -> DecodeCfg {
        self.decode_cfg
            .unwrap_or_else(|| DecodeCfg::for_heads(nh))
            .fit(width, dv)
            .for_arch(self.dev.arch)
    }

    /// The prefill configuration a tensor-core prefill of head widths (`dqk`, `dv`) = (P+R, V)
    /// runs: `cfg` if given, else `MLA_DIFF_PREFILL_CFG` as read by [`CudaOps::new`] if set,
    /// else the default; adapted to the widths by [`PrefillCfg::for_shape`].
    pub fn prefill_cfg_for(&self, cfg: Option<PrefillCfg>, dqk: usize, dv: usize) -> PrefillCfg {
        match cfg {
            Some(c) => c,
            None => self.prefill_cfg.unwrap_or_default(),
        }
        .for_shape(dqk, dv)
    }

    /// Whether every split of a decode launch of shape `sh` merges its share of the value
    /// columns once all have arrived (the kernel's spin mode), where sharing is `possible` (a
    /// fused merge through global memory of 2 to 255 splits): `sh.spin` when set; else
    /// `MLA_DIFF_DECODE_SPIN` as read by [`CudaOps::new`]: `0` keeps the last block merging
    /// everything, `force` spins even when the blocks do not all fit (for testing the kernel's
    /// give-up path); else when every block of the launch is resident at once.
    ///
    /// Errors: [`Error::Cuda`] when the occupancy query fails ([`CudaOps::decode_blocks_per_sm`]).
    pub(super) fn spin_merge(&self, sh: &DecodeShape, possible: bool) -> Result<bool> {
        let dc = sh.cfg;
        Ok(possible
            && match (sh.spin, self.decode_spin) {
                (Some(on), _) => on,
                (None, DecodeSpin::Off) => false,
                (None, DecodeSpin::Force) => true,
                (None, DecodeSpin::Auto) => {
                    sh.n * sh.nh.div_ceil(dc.heads) * sh.splits
                        <= self.sm_count()? * self.decode_blocks_per_sm(sh.width, sh.dv, dc)?
                }
            })
    }
}
