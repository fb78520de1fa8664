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
//! Each figure is the median of `REPS` timed repetitions after `WARM` warm-up calls, with CUDA
//! events around each repetition and all repetitions enqueued back to back (one host
//! synchronization after the last, as Triton's `do_bench`), so a figure is GPU time without the
//! host's launch latency; `MLA_DIFF_BENCH_SYNC=1` synchronizes after every repetition instead
//! (which adds one launch latency to every call). Errors are checked once after each timing loop.
//! The variables are read by the command line ([`BenchSettings`]; docs/environment.md).

use cudarc::driver::CudaSlice;
use serde::Serialize;

use crate::backend::cuda::ops::{CudaOps, DecodeLaunch, DecodeMerge, DecodeShape};
use crate::backend::decode_cfg::DecodeCfg;
use crate::backend::prefill_cfg::{PrefillCfg, bench_variants};
use crate::compute::ops::{EmptyRows, Ops, PrefillArgs, Segment};
use crate::core::batch::SplitMix64;
use crate::core::error::{Error, Result};
use crate::core::settings::BenchSettings;

/// One benchmark figure.
#[derive(Debug, Clone, Serialize)]
pub struct BenchFigure {
    /// Benchmark name.
    pub name: String,
    /// The shape, in the dim names of docs/mla.md.
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

/// Warm-up calls before each timing loop.
const WARM: usize = 3;
/// Timed calls per figure (the median is reported). With 10, the memory-bound decode's median
/// moved by up to 2 % between runs of the same kernel.
const REPS: usize = 30;

/// Median of a timing loop: `reps` timed calls of `f` (each between two events) after `warm`,
/// enqueued back to back (see the module documentation; `MLA_DIFF_BENCH_SYNC=1`,
/// `s.sync_each`: a host synchronization after each).
fn time_us(
    ops: &CudaOps,
    s: &BenchSettings,
    warm: usize,
    reps: usize,
    mut f: impl FnMut() -> Result<()>,
) -> Result<f64> {
    for _ in 0..warm {
        f()?;
    }
    ops.synchronize()?;
    let sync_each = s.sync_each;
    let stream = ops.stream();
    let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let mut events = Vec::with_capacity(reps);
    for _ in 0..reps {
        let a = stream.record_event(flags).map_err(|e| Error::cuda_call("event", e))?;
        f()?;
        let b = stream.record_event(flags).map_err(|e| Error::cuda_call("event", e))?;
        if sync_each {
            b.synchronize().map_err(|e| Error::cuda_call("event sync", e))?;
        }
        events.push((a, b));
    }
    ops.synchronize()?;
    let mut times = Vec::with_capacity(reps);
    for (a, b) in &events {
        times.push(a.elapsed_ms(b).map_err(|e| Error::cuda_call("elapsed", e))? as f64 * 1000.0);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// `n` random bf16 values (standard normal × `scale`) on the device.
fn random_bf16(ops: &CudaOps, n: usize, seed: u64, scale: f64) -> Result<CudaSlice<half::bf16>> {
    let mut r = SplitMix64::new(seed);
    let host: Vec<half::bf16> = (0..n).map(|_| half::bf16::from_f64(r.normal() * scale)).collect();
    ops.stream()
        .clone_htod(&host)
        .map_err(|e| Error::cuda_call("upload", e))
}

/// Device-to-device copy bandwidth of a `bytes`-byte buffer, counting read + write (timed as
/// `s` says).
pub fn copy_bandwidth(ops: &CudaOps, s: &BenchSettings, bytes: usize) -> Result<BenchFigure> {
    let n = bytes / 4;
    let src = ops.alloc(n)?;
    let mut dst = ops.alloc(n)?;
    let us = time_us(ops, s, WARM, REPS, || {
        ops.stream()
            .memcpy_dtod(&src, &mut dst)
            .map_err(|e| Error::cuda_call("memcpy_dtod", e))
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

/// One decode benchmark shape: `b` sequences × `seq` tokens of a paged latent cache, `nh`
/// heads.
#[derive(Debug, Clone, Copy)]
pub struct DecodeBench {
    /// Sequences (decode tokens).
    pub b: usize,
    /// Heads.
    pub nh: usize,
    /// Context length of every sequence.
    pub seq: usize,
    /// Tokens per cache page.
    pub page: usize,
    /// kv_lora_rank.
    pub l: usize,
    /// qk_rope_head_dim.
    pub r: usize,
    /// Report TFLOP/s (else latent-cache GB/s).
    pub compute_bound: bool,
}

/// Device inputs of a decode benchmark shape (made once, shared by the configurations timed).
pub struct DecodeInputs {
    cache: CudaSlice<half::bf16>,
    q: CudaSlice<half::bf16>,
    tables_d: CudaSlice<i64>,
    ctx_d: CudaSlice<i64>,
}

/// Random cache and queries of shape `d`, pages in random order (in order with
/// `MLA_DIFF_BENCH_SEQUENTIAL=1`, `s.sequential_pages`, to tell page-table effects apart); block
/// tables and context lengths uploaded once, outside any timed loop.
pub fn decode_inputs(ops: &CudaOps, s: &BenchSettings, d: DecodeBench) -> Result<DecodeInputs> {
    let w = d.l + d.r;
    let blocks_per_seq = d.seq / d.page;
    let num_blocks = d.b * blocks_per_seq;
    let cache = random_bf16(ops, num_blocks * d.page * w, 1, 1.0)?;
    let q = random_bf16(ops, d.b * d.nh * w, 2, 0.05)?;
    let mut phys: Vec<usize> = (0..num_blocks).collect();
    if !s.sequential_pages {
        SplitMix64::new(3).shuffle(&mut phys);
    }
    let ctx = vec![d.seq; d.b];
    Ok(DecodeInputs {
        cache,
        q,
        tables_d: ops.idx(&phys)?,
        ctx_d: ops.idx(&ctx)?,
    })
}

/// Split-KV decode (stage 1 + merge) of shape `d` on `inp` in configuration `cfg` (default: the
/// real path's) with `splits` (default: [`CudaOps::decode_splits_for`]); the merge fused into
/// the kernel when `fused_merge` (through a thread-block cluster where
/// [`DecodeCfg::cluster_size`] allows, else through global memory), else the separate merge
/// kernel ([`Ops::merge`], into fresh canary-filled buffers), timed as `s` says. Also returns the
/// merged output, for comparing configurations.
pub fn decode(
    ops: &CudaOps,
    s: &BenchSettings,
    d: DecodeBench,
    inp: &DecodeInputs,
    cfg: Option<DecodeCfg>,
    splits: Option<usize>,
    fused_merge: bool,
) -> Result<(BenchFigure, Vec<f32>)> {
    let DecodeBench {
        b,
        nh,
        seq,
        page,
        l,
        r,
        compute_bound: _,
    } = d;
    let w = l + r;
    let blocks_per_seq = seq / page;
    let cfg = cfg.unwrap_or_else(|| DecodeCfg::for_heads(nh).fit(w, l).for_arch(ops.arch()));
    let splits = match splits {
        Some(s) => s.max(1),
        None => ops.decode_splits_for(b, nh, w, l, cfg, seq.div_ceil(64))?,
    };
    let shape = DecodeShape {
        n: b,
        nh,
        block_size: page,
        width: w,
        max_blocks: blocks_per_seq,
        splits,
        dv: l,
        cfg,
        spin: None,
    };
    let mut parts = ops.alloc(splits * b * nh * l)?;
    let mut lses = ops.alloc(splits * b * nh)?;
    let mut mout = ops.alloc(b * nh * l)?;
    let mut mlse = ops.alloc(b * nh)?;
    let mut counters = ops
        .stream()
        .alloc_zeros::<i32>(b * nh.div_ceil(cfg.heads))
        .map_err(|e| Error::cuda_call("counters", e))?;
    let launch = DecodeLaunch {
        q: &inp.q,
        cache: &inp.cache,
        tables: &inp.tables_d,
        ctx: &inp.ctx_d,
        shape,
        scale: (192f64).powf(-0.5) as f32,
        empty_lse: f32::NEG_INFINITY,
    };
    let mut run = || -> Result<Option<CudaSlice<f32>>> {
        let merge = fused_merge.then_some(DecodeMerge {
            out: &mut mout,
            lse: &mut mlse,
            counters: &mut counters,
        });
        ops.decode_mma(&launch, &mut parts, &mut lses, merge)?;
        if fused_merge {
            Ok(None)
        } else {
            ops.merge(&parts, &lses, splits, b, nh, l).map(|(o, _)| Some(o))
        }
    };
    let separate = run()?;
    let us = time_us(ops, s, WARM, REPS, || run().map(|_| ()))?;
    // Every call writes the same merged output; the last timed one's is read.
    let out = ops
        .stream()
        .clone_dtoh(separate.as_ref().unwrap_or(&mout))
        .map_err(|e| Error::cuda_call("download", e))?;
    // Stage 1 alone, for telling the kernel from the merge and the launches around it.
    let us1 = time_us(ops, s, WARM, REPS, || {
        ops.decode_mma(&launch, &mut parts, &mut lses, None)
    })?;
    let fig = decode_figure(ops, d, cfg, splits, fused_merge, us, us1);
    Ok((fig, out))
}

/// The figure of one decode configuration: `us` µs for stage 1 and the merge, `us1` for stage 1
/// alone; TFLOP/s (2·B·N·seq·(2L+R)) for the compute-bound shape, latent-cache GB/s for the
/// memory-bound one; the note names the splits, the configuration and how the merge ran.
fn decode_figure(
    ops: &CudaOps,
    d: DecodeBench,
    cfg: DecodeCfg,
    splits: usize,
    fused_merge: bool,
    us: f64,
    us1: f64,
) -> BenchFigure {
    let DecodeBench {
        b,
        nh,
        seq,
        page,
        l,
        r,
        compute_bound,
    } = d;
    let w = l + r;
    let cache_bytes = (b * seq * w * 2) as f64;
    let flops = 2.0 * (b * nh * seq) as f64 * (2 * l + r) as f64;
    let shape = format!("B={b} N={nh} seq={seq} page={page} L={l} R={r} bf16");
    let cluster = cfg.cluster_size(ops.arch(), splits, l, fused_merge);
    let merge_kind = if cluster > 0 {
        // The clusters resident at once against those launched: more launched than resident
        // is a second wave.
        let resident = ops
            .decode_max_active_clusters(w, l, cfg, cluster)
            .map_or_else(|e| format!("? ({})", crate::core::error::chain(&e)), |x| x.to_string());
        format!(
            "merge fused into the kernel, through a cluster of {cluster} blocks ({} clusters launched, at most {resident} resident)",
            b * nh.div_ceil(cfg.heads)
        )
    } else if fused_merge {
        "merge fused into the kernel".to_string()
    } else {
        "separate merge kernel".to_string()
    };
    // TFLOP/s (2·B·N·seq·(2L+R)) for the compute-bound shape, latent-cache GB/s for the other.
    let (bound, work, per, unit, counts, digits) = if compute_bound {
        ("compute-bound", flops, 1e12, "TFLOP/s", "counts 2·B·N·seq·(2L+R)", 1)
    } else {
        ("memory-bound", cache_bytes, 1e9, "GB/s", "latent-cache bytes read", 0)
    };
    let rate = |micros: f64| work / (micros * 1e-6) / per;
    BenchFigure {
        name: format!("mqa decode, {bound}"),
        shape,
        micros: us,
        value: rate(us),
        unit: unit.into(),
        note: format!(
            "{splits} splits; {}; {merge_kind}; {counts}; stage 1 + merge; stage 1 alone {us1:.1} µs = {:.digits$} {unit}",
            cfg.label(),
            rate(us1)
        ),
    }
}

/// One extra decode variant from `MLA_DIFF_BENCH_DECODE`, timed against the default
/// configuration on the same inputs.
struct Variant {
    /// The compute-bound shape (`c`, `C`) rather than the memory-bound one (`m`, `M`).
    compute_bound: bool,
    /// The kernel configuration ([`DecodeCfg::parse`]'s fields).
    cfg: DecodeCfg,
    /// KV splits (`@SPLITS`); `None`: the engine's choice for the shape.
    splits: Option<usize>,
    /// Merge the splits inside the decode kernel (`m`, `c`) rather than in the separate merge
    /// kernel (`M`, `C`).
    fused_merge: bool,
}

/// Extra decode variants from `spec`, the text of `MLA_DIFF_BENCH_DECODE`: `;`-separated entries
/// `m|c|M|C:HM,WARPS,PARTS,QREG,STAGES[,MINBLOCKS[,FUSED[,TMA[,CLUSTER[,WGMMA[,TEAMS]]]]]][@SPLITS]`
/// or the same fields named, `m|c|M|C:heads=16,warps=4,…[@SPLITS]`
/// (the fields of [`DecodeCfg::parse`]; m: the memory-bound shape, c: the compute-bound one,
/// merge fused into the kernel; M, C: the same with the separate merge kernel; CLUSTER 1: the
/// fused merge through a thread-block cluster of SPLITS blocks where
/// [`DecodeCfg::cluster_size`] allows), each timed and compared with the default
/// configuration's merged output. E.g. `m:16,4,1,0,5,1,0,4,1,0,2` is the N < 64 default (the
/// teams block) with 5 stages, `m:16,8,2,0,2,2,0,1@4` the one-team block with one producer warp
/// at 4 splits, merging through global memory.
fn variants(spec: Option<&str>) -> Result<Vec<Variant>> {
    let Some(spec) = spec else {
        return Ok(Vec::new());
    };
    let mut v = Vec::new();
    for e in spec.split(';').map(str::trim).filter(|e| !e.is_empty()) {
        let bad = || {
            Error::Usage(format!(
                "MLA_DIFF_BENCH_DECODE entry `{e}`: expected m|c|M|C:HM,WARPS,PARTS,QREG,STAGES[,MINBLOCKS[,FUSED[,TMA[,CLUSTER[,WGMMA[,TEAMS]]]]]][@SPLITS] or m|c|M|C:heads=16,warps=4,…[@SPLITS] (docs/kernels.md)"
            ))
        };
        let (kind, rest) = e.split_once(':').ok_or_else(bad)?;
        let (cfg, splits) = match rest.split_once('@') {
            Some((c, s)) => (c, Some(s.parse::<usize>().map_err(|_| bad())?)),
            None => (rest, None),
        };
        let (compute_bound, fused_merge) = match kind {
            "m" => (false, true),
            "c" => (true, true),
            "M" => (false, false),
            "C" => (true, false),
            _ => return Err(bad()),
        };
        v.push(Variant {
            compute_bound,
            cfg: DecodeCfg::parse_named("MLA_DIFF_BENCH_DECODE", cfg)?,
            splits,
            fused_merge,
        });
    }
    Ok(v)
}

/// Largest |a − b| over two equally long outputs (NaN when they differ in length or hold NaN).
fn max_abs_diff(a: &[f32], b: &[f32]) -> f64 {
    if a.len() != b.len() {
        return f64::NAN;
    }
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() as f64)
        .fold(0.0, |m, d| if d.is_nan() || m.is_nan() { f64::NAN } else { m.max(d) })
}

/// Causal MHA prefill of one sequence of `t` tokens in configuration `cfg` (None: the
/// engine's), timed as `s` says, and its output (`out` then `lse`, for comparing
/// configurations).
pub fn prefill(
    ops: &CudaOps,
    s: &BenchSettings,
    cfg: Option<PrefillCfg>,
    t: usize,
    nh: usize,
    dqk: usize,
    dv: usize,
) -> Result<(BenchFigure, Vec<f32>)> {
    let q = random_bf16(ops, t * nh * dqk, 4, 1.0)?;
    let k = random_bf16(ops, t * nh * dqk, 5, 1.0)?;
    let v = random_bf16(ops, t * nh * dv, 6, 1.0)?;
    let mut out = ops.alloc(t * nh * dv)?;
    let mut lse = ops.alloc(t * nh)?;
    let seg = [Segment::causal_self(0, t)];
    let args = PrefillArgs {
        q: &q,
        k: &k,
        v: &v,
        nh,
        dqk,
        dv,
        segments: &seg,
        scale: (dqk as f64).powf(-0.5) as f32,
        empty: EmptyRows::ZeroMinusInf,
        key_rows: None,
    };
    let us = time_us(ops, s, WARM, REPS, || ops.prefill_mma(cfg, &args, &mut out, &mut lse))?;
    let flops = (nh as f64) * (t as f64) * (t as f64) * (dqk + dv) as f64;
    let used = ops.prefill_cfg_for(cfg, dqk, dv);
    let mut o = ops.download(&out)?;
    o.extend(ops.download(&lse)?);
    let fig = BenchFigure {
        name: "mha prefill".into(),
        shape: format!("T={t} N={nh} P+R={dqk} V={dv} causal bf16"),
        micros: us,
        value: flops / (us * 1e-6) / 1e12,
        unit: "TFLOP/s".into(),
        note: format!("counts N·T²·(P+R+V); {}", used.label()),
    };
    Ok((fig, o))
}

/// Every benchmark of the CUDA issue, in one run, with the extra variants and the timing of
/// `s`.
///
/// Errors: [`Error::Usage`] naming the variable and the entry when an `MLA_DIFF_BENCH_PREFILL`
/// or `MLA_DIFF_BENCH_DECODE` entry does not parse, before anything runs; CUDA failures.
pub fn all(ops: &CudaOps, s: &BenchSettings) -> Result<Vec<BenchFigure>> {
    let prefill_variants = bench_variants(s.prefill_variants.as_deref())?;
    let decode_variants = variants(s.decode_variants.as_deref())?;
    let ops = ops.with_sync_each(false);
    let mem = DecodeBench {
        b: 64,
        nh: 16,
        seq: 4096,
        page: 64,
        l: 512,
        r: 64,
        compute_bound: false,
    };
    let comp = DecodeBench {
        nh: 128,
        compute_bound: true,
        ..mem
    };
    let (im, ic) = (decode_inputs(&ops, s, mem)?, decode_inputs(&ops, s, comp)?);
    let (fm, om) = decode(&ops, s, mem, &im, None, None, true)?;
    let (fc, oc) = decode(&ops, s, comp, &ic, None, None, true)?;
    let (fp, op) = prefill(&ops, s, None, 4096, 16, 192, 128)?;
    let mut figs = vec![copy_bandwidth(&ops, s, 2 << 30)?, fm, fc, fp];
    for cfg in prefill_variants {
        let (mut f, o) = prefill(&ops, s, Some(cfg), 4096, 16, 192, 128)?;
        f.name = format!("{} [{}]", f.name, cfg.label());
        f.note = format!(
            "{}; max |Δ| vs the default configuration {:.3e}",
            f.note,
            max_abs_diff(&o, &op)
        );
        figs.push(f);
    }
    for Variant {
        compute_bound,
        cfg,
        splits,
        fused_merge,
    } in decode_variants
    {
        let (d, inp, base) = if compute_bound {
            (comp, &ic, &oc)
        } else {
            (mem, &im, &om)
        };
        let (mut f, o) = decode(&ops, s, d, inp, Some(cfg), splits, fused_merge)?;
        f.name = format!(
            "{} [{}{}]",
            f.name,
            cfg.label(),
            if fused_merge { "" } else { ", separate merge" }
        );
        f.note = format!(
            "{}; max |Δ| vs the default configuration {:.3e}",
            f.note,
            max_abs_diff(&o, base)
        );
        figs.push(f);
    }
    Ok(figs)
}
