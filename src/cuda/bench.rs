//! `mla-diff bench`: the fast kernels at DeepSeek-V3 sizes, timed on the GPU.
//!
//! Speed claims need numbers measured the same way every time, against a ceiling measured in the
//! same run. Three benchmarks of the CUDA issue:
//! - MQA decode, memory-bound: a DeepSeek-V3 TP8 slice (N = 16, L = 512, R = 64), B = 64
//!   sequences of 4096 tokens, page 64: latent-cache bytes read per second, next to a
//!   device-to-device copy (read + write bytes per second) timed in the same run;
//! - MQA decode, compute-bound: N = 128, same shape: TFLOP/s counting 2·B·N·seq·(2L+R);
//! - MHA prefill: T = 4096, N = 16, P+R = 192, V = 128, causal: TFLOP/s counting
//!   N·T²·(P+R+V) (the causal half of 2·T²·(P+R) + 2·T²·V per head).
//!
//! Each figure is the median of timed repetitions after warm-up, with CUDA events around
//! back-to-back launches; errors are checked once after each timing loop.

use cudarc::driver::CudaSlice;
use serde::Serialize;

use super::ops::CudaOps;
use crate::batch::SplitMix64;
use crate::error::{Error, Result};
use crate::paths::ops::{EmptyRows, Ops, Segment};

/// One benchmark figure.
#[derive(Debug, Clone, Serialize)]
pub struct BenchFigure {
    /// Benchmark name.
    pub name: String,
    /// The shape, in MLA.md's dim names.
    pub shape: String,
    /// Median time per call, microseconds.
    pub micros: f64,
    /// The figure of merit's value.
    pub value: f64,
    /// Its unit (`GB/s`, `TFLOP/s`).
    pub unit: String,
    /// Notes (split count, what is counted).
    pub note: String,
}

fn cerr(what: impl std::fmt::Display) -> Error {
    Error::Cuda(what.to_string())
}

/// Median of a timing loop: `reps` timed calls of `f` (each between two events) after `warm`.
fn time_us(ops: &CudaOps, warm: usize, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..warm {
        f()?;
    }
    ops.synchronize()?;
    let stream = ops.stream();
    let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        let a = stream.record_event(flags).map_err(|e| cerr(format!("event: {e:?}")))?;
        f()?;
        let b = stream.record_event(flags).map_err(|e| cerr(format!("event: {e:?}")))?;
        b.synchronize().map_err(|e| cerr(format!("event sync: {e:?}")))?;
        times.push(a.elapsed_ms(&b).map_err(|e| cerr(format!("elapsed: {e:?}")))? as f64 * 1000.0);
    }
    ops.synchronize()?;
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// `n` random bf16 values (standard normal × `scale`) on the device.
fn random_bf16(ops: &CudaOps, n: usize, seed: u64, scale: f64) -> Result<CudaSlice<half::bf16>> {
    let mut r = SplitMix64::new(seed);
    let host: Vec<half::bf16> = (0..n).map(|_| half::bf16::from_f64(r.normal() * scale)).collect();
    ops.stream()
        .clone_htod(&host)
        .map_err(|e| cerr(format!("upload: {e:?}")))
}

/// Device-to-device copy bandwidth of a `bytes`-byte buffer, counting read + write.
pub fn copy_bandwidth(ops: &CudaOps, bytes: usize) -> Result<BenchFigure> {
    let n = bytes / 4;
    let src = ops.alloc(n)?;
    let mut dst = ops.alloc(n)?;
    let us = time_us(ops, 3, 10, || {
        ops.stream()
            .memcpy_dtod(&src, &mut dst)
            .map_err(|e| cerr(format!("memcpy_dtod: {e:?}")))
    })?;
    Ok(BenchFigure {
        name: "device-to-device copy".into(),
        shape: format!("{} MiB", bytes >> 20),
        micros: us,
        value: 2.0 * bytes as f64 / (us * 1e-6) / 1e9,
        unit: "GB/s".into(),
        note: "read + write bytes".into(),
    })
}

/// Split-KV decode over a paged latent cache of `b` sequences × `seq` tokens, `nh` heads.
#[allow(clippy::too_many_arguments)]
pub fn decode(
    ops: &CudaOps,
    b: usize,
    nh: usize,
    seq: usize,
    page: usize,
    l: usize,
    r: usize,
    compute_bound: bool,
) -> Result<BenchFigure> {
    let w = l + r;
    let blocks_per_seq = seq / page;
    let num_blocks = b * blocks_per_seq;
    let cache = random_bf16(ops, num_blocks * page * w, 1, 1.0)?;
    let q = random_bf16(ops, b * nh * w, 2, 0.05)?;
    let mut phys: Vec<usize> = (0..num_blocks).collect();
    SplitMix64::new(3).shuffle(&mut phys);
    let groups = nh.div_ceil(16);
    // Splits sized so the grid covers the SMs about twice.
    let sms = 132usize;
    let splits = (2 * sms).div_ceil(b * groups).clamp(1, seq / 64);
    let ctx = vec![seq; b];
    let mut parts = ops.alloc(splits * b * nh * l)?;
    let mut lses = ops.alloc(splits * b * nh)?;
    let scale = (192f64).powf(-0.5) as f32;
    let us = time_us(ops, 2, 10, || {
        ops.decode_split_fast(
            &q,
            b,
            nh,
            &cache,
            page,
            w,
            &phys,
            blocks_per_seq,
            &ctx,
            splits,
            l,
            scale,
            f32::NEG_INFINITY,
            &mut parts,
            &mut lses,
        )?;
        ops.merge(&parts, &lses, splits, b, nh, l).map(|_| ())
    })?;
    let cache_bytes = (b * seq * w * 2) as f64;
    let flops = 2.0 * (b * nh * seq) as f64 * (2 * l + r) as f64;
    let shape = format!("B={b} N={nh} seq={seq} page={page} L={l} R={r} bf16");
    Ok(if compute_bound {
        BenchFigure {
            name: "mqa decode, compute-bound".into(),
            shape,
            micros: us,
            value: flops / (us * 1e-6) / 1e12,
            unit: "TFLOP/s".into(),
            note: format!("{splits} splits; counts 2·B·N·seq·(2L+R); stage 1 + merge"),
        }
    } else {
        BenchFigure {
            name: "mqa decode, memory-bound".into(),
            shape,
            micros: us,
            value: cache_bytes / (us * 1e-6) / 1e9,
            unit: "GB/s".into(),
            note: format!("{splits} splits; latent-cache bytes read; stage 1 + merge"),
        }
    })
}

/// Causal MHA prefill of one sequence of `t` tokens.
pub fn prefill(ops: &CudaOps, t: usize, nh: usize, dqk: usize, dv: usize) -> Result<BenchFigure> {
    let q = random_bf16(ops, t * nh * dqk, 4, 1.0)?;
    let k = random_bf16(ops, t * nh * dqk, 5, 1.0)?;
    let v = random_bf16(ops, t * nh * dv, 6, 1.0)?;
    let mut out = ops.alloc(t * nh * dv)?;
    let mut lse = ops.alloc(t * nh)?;
    let seg = [Segment {
        q_off: 0,
        q_len: t,
        k_off: 0,
        k_len: t,
        causal: true,
    }];
    let scale = (dqk as f64).powf(-0.5) as f32;
    let us = time_us(ops, 2, 10, || {
        ops.prefill_mma(
            &q,
            &k,
            &v,
            nh,
            dqk,
            dv,
            &seg,
            scale,
            EmptyRows::ZeroMinusInf,
            &mut out,
            &mut lse,
        )
    })?;
    let flops = (nh as f64) * (t as f64) * (t as f64) * (dqk + dv) as f64;
    Ok(BenchFigure {
        name: "mha prefill".into(),
        shape: format!("T={t} N={nh} P+R={dqk} V={dv} causal bf16"),
        micros: us,
        value: flops / (us * 1e-6) / 1e12,
        unit: "TFLOP/s".into(),
        note: "counts N·T²·(P+R+V)".into(),
    })
}

/// Every benchmark of the CUDA issue, in one run.
pub fn all(ops: &CudaOps) -> Result<Vec<BenchFigure>> {
    let ops = ops.with_sync_each(false);
    Ok(vec![
        copy_bandwidth(&ops, 2 << 30)?,
        decode(&ops, 64, 16, 4096, 64, 512, 64, false)?,
        decode(&ops, 64, 128, 4096, 64, 512, 64, true)?,
        prefill(&ops, 4096, 16, 192, 128)?,
    ])
}
