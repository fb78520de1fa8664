//! The TP all-reduce through NCCL, one rank per GPU.
//!
//! The host collective ([`crate::compute::collective`]) shows what the ranks compute; NCCL is how
//! an engine's ranks on separate GPUs actually meet, with its own buffers, streams and ring
//! order. [`NcclAllReduce`] holds one communicator per listed device (`--devices`), all in this
//! process (`ncclCommInitAll`), and all-reduces the ranks' partials through them; the
//! `all-reduce-*` faults act around the NCCL call as they act inside the host participants.
//!
//! NCCL is loaded at run time like the rest of cudarc's libraries (`dynamic-loading`): a build
//! needs no NCCL, and a machine without it gets an exit-2 error naming what to install
//! ([`NCCL_MISSING`]). NCCL refuses two ranks on one GPU, so the devices must be distinct. NVLink
//! multicast (NVLS) stays off: `NCCL_NVLS_ENABLE=0` is set in the process environment before the
//! first communicator is created, whatever the caller's environment says.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use cudarc::nccl::{Comm, ReduceOp, group_end, group_start};

use crate::compute::collective::ReduceFault;
use crate::core::error::{Error, Result};

/// What a machine without a loadable NCCL is told (exit 2).
///
/// cudarc opens NCCL by the names `libnccl.so`, `libnccl.so.<CUDA major>` and a few others,
/// never `libnccl.so.2`, the only name the `nvidia-nccl-cu13` wheel ships; a link named
/// `libnccl.so` on `LD_LIBRARY_PATH` serves it.
pub const NCCL_MISSING: &str = "NCCL not found: the NCCL all-reduce loads libnccl.so at run time. Install it \
     (`pip install nvidia-nccl-cu13`, or torch, which brings it) and put a link named libnccl.so to its \
     libnccl.so.2 on LD_LIBRARY_PATH: d=$(python -c 'import nvidia.nccl as n; print(n.__path__[0])')/lib; \
     mkdir -p ~/.nccl && ln -sf $d/libnccl.so.2 ~/.nccl/libnccl.so && export LD_LIBRARY_PATH=~/.nccl:$LD_LIBRARY_PATH";

/// Whether NCCL is loadable under one of the names cudarc tries (no panic, unlike cudarc).
pub fn nccl_present() -> bool {
    // SAFETY: only tries to dlopen the library by name.
    unsafe { cudarc::nccl::sys::is_culib_present() }
}

/// The first CUDA ordinal that `devices` lists a second time, if any (NCCL refuses two ranks
/// on one GPU).
pub fn repeated_device(devices: &[usize]) -> Option<usize> {
    devices
        .iter()
        .enumerate()
        .find_map(|(i, d)| devices[..i].contains(d).then_some(*d))
}

/// One NCCL communicator per TP rank, rank r on GPU `devices[r]`, all driven from this process.
#[derive(Debug)]
pub struct NcclAllReduce {
    comms: Vec<Comm>,
    devices: Vec<usize>,
}

impl NcclAllReduce {
    /// Communicators for the ranks on `devices` (CUDA ordinals, rank order): sets
    /// `NCCL_NVLS_ENABLE=0`, then `ncclCommInitAll`.
    ///
    /// Errors: no device, a device listed twice (NCCL refuses two ranks on one GPU), NCCL not
    /// loadable ([`NCCL_MISSING`]), a device that does not open, NCCL's own errors.
    pub fn new(devices: &[usize]) -> Result<Self> {
        if devices.is_empty() {
            // `--devices` is checked to name at least one GPU before a group is built.
            return Err(Error::internal("NCCL all-reduce over no device"));
        }
        if let Some(d) = repeated_device(devices) {
            return Err(Error::Usage(format!(
                "--devices lists GPU {d} twice: NCCL refuses two ranks on one GPU"
            )));
        }
        if !crate::device::driver_present() {
            return Err(Error::cuda("the CUDA driver library (libcuda.so) is not loadable"));
        }
        if !nccl_present() {
            return Err(Error::cuda(NCCL_MISSING));
        }
        // SAFETY: set before NCCL reads its environment (at the first communicator), from the
        // thread that creates the communicators; mla-diff reads no NCCL variable elsewhere.
        unsafe { std::env::set_var("NCCL_NVLS_ENABLE", "0") };
        let streams: Vec<Arc<CudaStream>> = devices
            .iter()
            .map(|&d| {
                CudaContext::new(d)
                    .map(|c| c.default_stream())
                    .map_err(|e| Error::cuda(format!("cuCtxCreate on device {d}: {e:?}")))
            })
            .collect::<Result<_>>()?;
        let comms = Comm::from_devices(streams).map_err(|e| Error::cuda(format!("NCCL ncclCommInitAll: {e:?}")))?;
        Ok(NcclAllReduce {
            comms,
            devices: devices.to_vec(),
        })
    }

    /// The CUDA ordinal of each rank.
    pub fn devices(&self) -> &[usize] {
        &self.devices
    }

    /// Every rank's copy of the sum of `parts` (`parts[r]`, rank r's `[n]` f32 partial, is copied
    /// to its GPU), all-reduced in place through NCCL (one group call over the ranks) and copied
    /// back. NCCL sums in its own order: bit-identical to the rank-order sum for one or two
    /// ranks, within f32 rounding beyond. `fault` acts around the call: `Twice` all-reduces
    /// again, `SkipRank(r)` sends zeros from rank r, `ReadEarly(r)` takes rank r's buffer before
    /// the call.
    ///
    /// Errors: [`Error::Internal`] for `parts.len()` not the number of ranks or partials of
    /// different or zero lengths (the caller's shapes); CUDA or NCCL errors.
    pub fn all_reduce_sum(&self, parts: &[Vec<f32>], fault: Option<ReduceFault>) -> Result<Vec<Vec<f32>>> {
        if parts.len() != self.comms.len() {
            return Err(Error::internal(format!(
                "NCCL all-reduce of {} partials over {} ranks",
                parts.len(),
                self.comms.len()
            )));
        }
        let n = parts[0].len();
        if parts.iter().any(|p| p.len() != n) || n == 0 {
            return Err(Error::internal(
                "NCCL all-reduce: partials of different or zero lengths",
            ));
        }
        let zeros = vec![0f32; n];
        let mut bufs: Vec<CudaSlice<f32>> = Vec::with_capacity(parts.len());
        for (r, c) in self.comms.iter().enumerate() {
            let src = match fault {
                Some(ReduceFault::SkipRank(s)) if s == r => &zeros,
                _ => &parts[r],
            };
            bufs.push(
                c.stream()
                    .clone_htod(src)
                    .map_err(|e| Error::cuda(format!("NCCL upload: {e:?}")))?,
            );
        }
        let early = match fault {
            Some(ReduceFault::ReadEarly(r)) if r < parts.len() => Some((r, parts[r].clone())),
            _ => None,
        };
        let rounds = if fault == Some(ReduceFault::Twice) { 2 } else { 1 };
        for _ in 0..rounds {
            group_start().map_err(|e| Error::cuda(format!("NCCL ncclGroupStart: {e:?}")))?;
            for (c, b) in self.comms.iter().zip(bufs.iter_mut()) {
                c.all_reduce_in_place(b, &ReduceOp::Sum)
                    .map_err(|e| Error::cuda(format!("NCCL ncclAllReduce: {e:?}")))?;
            }
            group_end().map_err(|e| Error::cuda(format!("NCCL ncclGroupEnd: {e:?}")))?;
        }
        let mut out = Vec::with_capacity(bufs.len());
        for (c, b) in self.comms.iter().zip(&bufs) {
            out.push(
                c.stream()
                    .clone_dtoh(b)
                    .map_err(|e| Error::cuda(format!("NCCL download: {e:?}")))?,
            );
        }
        if let Some((r, own)) = early {
            out[r] = own;
        }
        Ok(out)
    }
}
