//! CPU benchmarks behind `mla-diff bench --dequant` and `mla-diff bench --reference`.
//!
//! The performance goals of the scale issue are ratios against other tools measured on the same
//! machine in the same run (BENCHMARKS.md, P2 and P3), so mla-diff needs entry points that time
//! exactly one piece of work and nothing around it: dequantizing one tensor with the library's
//! own decoder ([`crate::model::gguf::dequant`]), and one reference layer forward
//! ([`crate::compute::reference::forward`]) with its weights loaded and dequantized before the clock
//! starts. `scripts/bench/bench_cpu.py` runs these next to gguf-py and transformers, interleaved.
//!
//! Every figure is the median of `repeat` timed calls after one untimed warm-up call, with
//! `std::time::Instant` around the call only. Thread counts are set per call with a private rayon
//! pool of that size ([`rayon::ThreadPool::install`]), so one process measures 1 thread and all
//! threads interleaved; the decoders' results do not depend on the thread count (fixed work
//! splits), which the figures' output digests let a caller check.

use std::time::Instant;

use ndarray::Array2;
use serde::Serialize;

use crate::compute::path::{LayerInput, PathKind, PathOptions};
use crate::core::batch::{Batch, normal_f32};
use crate::core::error::{Error, Result};
use crate::model::config::MlaConfig;
use crate::model::gguf::{GgmlType, GgufFile, dequant};
use crate::model::weights::LayerWeights;

/// Dequantization throughput of one tensor at one thread count.
#[derive(Debug, Clone, Serialize)]
pub struct DequantFigure {
    /// GGUF tensor name.
    pub tensor: String,
    /// ggml storage type.
    pub ggml_type: GgmlType,
    /// Elements in the tensor (f32 values written).
    pub elements: u64,
    /// Quantized bytes read.
    pub bytes_in: u64,
    /// Rayon threads the decoder ran on.
    pub threads: usize,
    /// Median seconds of [`dequant::dequantize`] (a fresh output vector per call, as weight
    /// loading does).
    pub median_s: f64,
    /// Output throughput of that median: `4·elements / median_s / 1e9`, GB/s of f32 written.
    pub gb_per_s_out: f64,
    /// Median seconds of [`dequant::dequantize_into`] writing into one reused buffer (no page
    /// faults for fresh memory).
    pub warm_median_s: f64,
    /// Output throughput of `warm_median_s`, GB/s of f32 written.
    pub warm_gb_per_s_out: f64,
    /// Every timed call of [`dequant::dequantize`], seconds, in order.
    pub runs_s: Vec<f64>,
    /// SHA-256 of the output as little-endian f32 bytes (compare with another decoder's output).
    pub sha256: String,
}

/// Time of one layer forward (reference or an engine path) at one thread count.
#[derive(Debug, Clone, Serialize)]
pub struct ForwardFigure {
    /// What ran: `reference` (f64, [`crate::compute::reference::forward`]) or `engine mha` (CPU backend,
    /// f32, [`crate::backend::run_cpu`] with [`PathKind::Mha`], which dequantizes its own weights
    /// from the file inside the timed call, as in `run`).
    pub what: String,
    /// Layer index.
    pub layer: usize,
    /// Tokens T (one sequence, positions 0..T).
    pub tokens: usize,
    /// Rayon threads.
    pub threads: usize,
    /// Median seconds per forward.
    pub median_s: f64,
    /// Every timed call, seconds, in order.
    pub runs_s: Vec<f64>,
}

/// Result of [`reference()`]: the untimed load and the timed forwards.
#[derive(Debug, Clone, Serialize)]
pub struct ReferenceBench {
    /// The GGUF file.
    pub model: String,
    /// Its MLA configuration.
    pub config: MlaConfig,
    /// Seconds to load and dequantize the layer's weights (once, outside every timed region).
    pub load_s: f64,
    /// The figures, grouped by thread count then by `what`.
    pub figures: Vec<ForwardFigure>,
}

/// A rayon pool of `threads` threads.
///
/// Errors: [`Error::Usage`] for 0 threads or when the OS refuses to start the threads.
pub fn pool(threads: usize) -> Result<rayon::ThreadPool> {
    if threads == 0 {
        return Err(Error::Usage("--threads: a thread count must be at least 1".into()));
    }
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| Error::Usage(format!("cannot start a pool of {threads} threads: {e}")))
}

/// The thread counts to measure: `requested`, else 1 and the global rayon pool's size (which
/// `RAYON_NUM_THREADS` sets), without duplicates, in the given order.
pub fn thread_counts(requested: Option<&[usize]>) -> Vec<usize> {
    let mut v: Vec<usize> = match requested {
        Some(r) => r.to_vec(),
        None => vec![1, rayon::current_num_threads()],
    };
    let mut seen = std::collections::BTreeSet::new();
    v.retain(|t| seen.insert(*t));
    v
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => s[n / 2],
        n => 0.5 * (s[n / 2 - 1] + s[n / 2]),
    }
}

fn dequant_err(file: &GgufFile, tensor: &str, reason: String) -> Error {
    Error::Dequant {
        path: file.path().to_path_buf(),
        tensor: tensor.to_string(),
        reason,
    }
}

/// Times [`dequant::dequantize`] on every tensor of `file` whose type is quantized (plain F32/F16
/// tensors are skipped: they are copies, not decoding), at each of `threads`.
///
/// Each (tensor, thread count) gets one untimed warm-up call, then `repeat` rounds; within a
/// round every tensor and thread count is timed once, fresh output then warm buffer, so drift in
/// machine load spreads over all figures alike. Output: one figure per (tensor, thread count),
/// in file order then `threads` order.
/// Errors: [`Error::Usage`] for `repeat == 0` or an empty `threads`; [`Error::Input`] for a file
/// without quantized tensors; [`Error::Dequant`] (naming the file and tensor) when a tensor cannot be decoded.
pub fn dequant_bench(file: &GgufFile, repeat: usize, threads: &[usize]) -> Result<Vec<DequantFigure>> {
    if repeat == 0 || threads.is_empty() {
        return Err(Error::Usage("--repeat and --threads need at least one value".into()));
    }
    let tensors: Vec<_> = file.tensors().iter().filter(|t| t.ggml_type.is_quantized()).collect();
    if tensors.is_empty() {
        return Err(Error::input(
            file.path(),
            "tensors",
            "no quantized tensor to dequantize",
        ));
    }
    let pools = threads.iter().map(|&k| pool(k)).collect::<Result<Vec<_>>>()?;
    let mut fresh = vec![vec![Vec::<f64>::new(); pools.len()]; tensors.len()];
    let mut warm = fresh.clone();
    let mut digests = vec![vec![String::new(); pools.len()]; tensors.len()];
    let mut bufs: Vec<Vec<f32>> = Vec::new();
    for t in &tensors {
        let n = usize::try_from(t.n_elements())
            .map_err(|_| dequant_err(file, &t.name, "too many elements for this machine".into()))?;
        bufs.push(vec![0f32; n]);
    }
    for round in 0..=repeat {
        for (ti, t) in tensors.iter().enumerate() {
            let bytes = file.tensor_bytes(t);
            let n = bufs[ti].len();
            for (pi, p) in pools.iter().enumerate() {
                let t0 = Instant::now();
                let out = p
                    .install(|| dequant::dequantize(t.ggml_type, &bytes, n))
                    .map_err(|e| dequant_err(file, &t.name, e))?;
                let fresh_s = t0.elapsed().as_secs_f64();
                let buf = &mut bufs[ti];
                let t0 = Instant::now();
                p.install(|| dequant::dequantize_into(t.ggml_type, &bytes, buf))
                    .map_err(|e| dequant_err(file, &t.name, e))?;
                let warm_s = t0.elapsed().as_secs_f64();
                if round == 0 {
                    let raw: Vec<u8> = out.iter().flat_map(|x| x.to_le_bytes()).collect();
                    digests[ti][pi] = crate::model::gguf::sha256_hex(&raw);
                } else {
                    fresh[ti][pi].push(fresh_s);
                    warm[ti][pi].push(warm_s);
                }
                drop(out);
            }
        }
    }
    let mut figs = Vec::new();
    for (ti, t) in tensors.iter().enumerate() {
        for (pi, &k) in threads.iter().enumerate() {
            let out_bytes = 4.0 * t.n_elements() as f64;
            let (m, w) = (median(&fresh[ti][pi]), median(&warm[ti][pi]));
            figs.push(DequantFigure {
                tensor: t.name.clone(),
                ggml_type: t.ggml_type,
                elements: t.n_elements(),
                bytes_in: file.tensor_bytes(t).len() as u64,
                threads: k,
                median_s: m,
                gb_per_s_out: out_bytes / m / 1e9,
                warm_median_s: w,
                warm_gb_per_s_out: out_bytes / w / 1e9,
                runs_s: fresh[ti][pi].clone(),
                sha256: digests[ti][pi].clone(),
            });
        }
    }
    Ok(figs)
}

/// Times one reference layer forward ([`crate::compute::reference::forward`], f64) and the CPU engine's
/// `mha` path (f32) on layer `layer` of `file`, for one sequence of `tokens` tokens at positions
/// `0..tokens` with `run`'s random layer input (seed 0), at each of `threads`.
///
/// The layer's weights are loaded and dequantized once, before any clock starts
/// ([`ReferenceBench::load_s`]); the reference's timed region is the forward call alone (which
/// widens the weights to f64 and records every site, as in `run`). One untimed warm-up per
/// (thread count, what), then `repeat` rounds alternating reference and engine.
/// Errors: [`Error::Usage`] for zero `tokens`/`repeat`/threads; model errors (missing tensors,
/// wrong shapes, layer out of range), each naming the file.
pub fn reference(
    file: &GgufFile,
    cfg: &MlaConfig,
    layer: usize,
    tokens: usize,
    repeat: usize,
    threads: &[usize],
) -> Result<ReferenceBench> {
    if tokens == 0 || repeat == 0 || threads.is_empty() {
        return Err(Error::Usage(
            "--tokens, --repeat and --threads need at least one token, repetition and thread count".into(),
        ));
    }
    let pools = threads.iter().map(|&k| pool(k)).collect::<Result<Vec<_>>>()?;
    let t0 = Instant::now();
    let w = LayerWeights::load(file, cfg, layer)?;
    let load_s = t0.elapsed().as_secs_f64();
    let batch = Batch::single(tokens, 0);
    let seed = crate::jobs::run::layer_seed(0, layer);
    let h32 = Array2::from_shape_vec((tokens, cfg.hidden), normal_f32(seed, tokens * cfg.hidden))
        .map_err(|e| Error::Internal(e.to_string()))?;
    let h64 = h32.mapv(f64::from);
    let input = LayerInput {
        file,
        cfg,
        weights: &w,
        hidden_in: &h32,
        batch: &batch,
        shared_selection: None,
        forced_selection: None,
        dequantized: None,
    };
    let opts = PathOptions::default();
    let mut times = vec![[Vec::<f64>::new(), Vec::new()]; pools.len()];
    for round in 0..=repeat {
        for (pi, p) in pools.iter().enumerate() {
            let t0 = Instant::now();
            let r = p.install(|| crate::compute::reference::forward(cfg, &w, &h64, &batch))?;
            let ref_s = t0.elapsed().as_secs_f64();
            drop(r);
            let t0 = Instant::now();
            let e = p.install(|| crate::backend::run_cpu(PathKind::Mha, &input, &opts))?;
            let eng_s = t0.elapsed().as_secs_f64();
            drop(e);
            if round > 0 {
                times[pi][0].push(ref_s);
                times[pi][1].push(eng_s);
            }
        }
    }
    let mut figures = Vec::new();
    for (pi, &k) in threads.iter().enumerate() {
        for (wi, what) in ["reference", "engine mha"].into_iter().enumerate() {
            figures.push(ForwardFigure {
                what: what.into(),
                layer,
                tokens,
                threads: k,
                median_s: median(&times[pi][wi]),
                runs_s: times[pi][wi].clone(),
            });
        }
    }
    Ok(ReferenceBench {
        model: file.path().display().to_string(),
        config: cfg.clone(),
        load_s,
        figures,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
    }

    #[test]
    fn thread_counts_dedup_in_order() {
        assert_eq!(thread_counts(Some(&[2, 1, 2])), vec![2, 1]);
        assert_eq!(thread_counts(None)[0], 1);
    }

    #[test]
    fn zero_threads_is_a_usage_error() {
        assert!(matches!(pool(0), Err(Error::Usage(_))));
    }
}
