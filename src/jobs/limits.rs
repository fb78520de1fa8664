//! The memory a command will need, checked against the memory it may use before it allocates
//! anything: one estimate per command that allocates (`run`, `bench --reference`,
//! `bench --dequant`, `golden check`, `compare`) and one refusal.
//!
//! A size taken from the command line or a file (T, a page size, a split count, a repetition
//! count, a manifest's batch) reaches an allocation through products: T · N · (L+R) floats, pages
//! × page size × (L+R), splits × rows × N × L partials. An unchecked product past the machine's
//! memory aborts the process halfway (or grows for minutes first); one past 2^64 wraps to a small
//! number and is admitted. Every estimate here is computed in `u128` and saturates, and
//! [`check`] refuses one over the limit ([`crate::core::memory::memory_limit`], or
//! `--max-memory`) with one line naming the sizes that drive it and the flag to lower.
//!
//! The run estimate itself is [`crate::jobs::run::estimate_peak_bytes`], beside the run whose
//! buffers it counts; this module adds the other commands' and the refusal.

use crate::core::error::{Error, Result};
use crate::core::memory::{MemoryLimit, human, memory_limit};
use crate::judge::report::RunConfig;
use crate::model::config::MlaConfig;
use crate::model::dump::DumpFile;
use crate::model::gguf::GgufFile;

/// The most timed repetitions `bench --repeat` takes: each is one call per tensor (or forward)
/// and thread count, and its time is kept (8 bytes per figure).
pub const MAX_REPEAT: usize = 1_000_000;

/// The most threads `bench --threads` starts in one pool.
pub const MAX_THREADS: usize = 1024;

/// What a command will need: bytes, the sizes that drive them (`T=19, page size 16, splits 4,
/// 4 path(s)`), and what to lower (`use fewer --tokens, a smaller --page-size or fewer --splits`).
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryNeed {
    /// Estimated peak resident bytes.
    pub bytes: u64,
    /// The sizes the estimate grows with, for the refusal.
    pub what: String,
    /// What to change, starting `use …`.
    pub advice: String,
}

/// The limit: `--max-memory` when given, else the cgroup/MemTotal limit of this process.
pub fn limit(max_memory: Option<u64>) -> Option<MemoryLimit> {
    match max_memory {
        Some(bytes) => Some(MemoryLimit {
            bytes,
            source: "--max-memory".into(),
        }),
        None => memory_limit(),
    }
}

/// Refuses `need` when it exceeds the limit ([`limit`]).
///
/// Errors: [`Error::Usage`] (exit 2), one line: `this run needs about X (what) and the limit is
/// Y (source): advice, or pass --max-memory …`.
pub fn check(need: &MemoryNeed, max_memory: Option<u64>) -> Result<()> {
    match limit(max_memory) {
        Some(lim) if need.bytes > lim.bytes => Err(Error::Usage(refusal(need, &lim, max_memory.is_some()))),
        _ => Ok(()),
    }
}

/// The refusal line of [`check`].
fn refusal(need: &MemoryNeed, lim: &MemoryLimit, given: bool) -> String {
    format!(
        "this run needs about {} ({}) and the limit is {} ({}): {}, or {} --max-memory if the limit is wrong",
        human(need.bytes),
        need.what,
        human(lim.bytes),
        lim.source,
        need.advice,
        if given { "raise" } else { "pass" }
    )
}

/// `u128` bytes clamped to `u64`.
fn clamp(b: u128) -> u64 {
    u64::try_from(b).unwrap_or(u64::MAX)
}

/// The sizes of a run in words: `T=…, page size …, splits …, N path(s), L layer(s)`.
fn run_sizes(cfg: &MlaConfig, rc: &RunConfig) -> String {
    format!(
        "T={}, page size {}, splits {}, N={}, H={}, {} path(s), {} layer(s)",
        rc.batch.seqs.iter().map(|s| s.len as u128).sum::<u128>(),
        rc.path_options.page_size,
        rc.path_options.num_splits,
        cfg.n_head,
        cfg.hidden,
        rc.paths.len(),
        rc.layers.len()
    )
}

/// A run's need ([`crate::jobs::run::estimate_peak_bytes`]), plus twice `export` bytes (the
/// `--export-inputs` tensors and the file's image), for `file`.
pub fn run_need(file: &GgufFile, cfg: &MlaConfig, rc: &RunConfig, export: Option<u64>) -> MemoryNeed {
    let dense = crate::jobs::run::dense_ffn_width(file, cfg, rc);
    let run = crate::jobs::run::estimate_peak_bytes(cfg, rc, dense);
    let bytes = run.saturating_add(export.unwrap_or(0).saturating_mul(2));
    let export = export.map_or(String::new(), |b| {
        format!(
            "; the run about {}, the --export-inputs file about {} held twice",
            human(run),
            human(b)
        )
    });
    MemoryNeed {
        bytes,
        what: format!("{}: {}{export}", file.path().display(), run_sizes(cfg, rc)),
        advice: "use fewer --tokens (or shorter --seqs), a smaller --page-size or fewer --splits".into(),
    }
}

/// `golden check`'s need for one case (`manifest`, its manifest file): its run ([`run_need`])
/// plus the golden trace file, which is read whole (`trace_bytes`).
pub fn golden_need(
    file: &GgufFile,
    cfg: &MlaConfig,
    rc: &RunConfig,
    manifest: &std::path::Path,
    trace_bytes: u64,
) -> MemoryNeed {
    let mut need = run_need(file, cfg, rc, None);
    need.bytes = need.bytes.saturating_add(trace_bytes);
    need.what = format!("{}: {}", manifest.display(), need.what);
    need.advice =
        "the manifest's fields `run.batch` and `run.path_options` ask for it: check the case on a larger machine"
            .into();
    need
}

/// `bench --reference`'s need (on `golden/models/tiny-v3-q4_k_m.gguf`, `--repeat 1`: 98.1 MiB
/// estimated for 81.0 MiB peak RSS at `--tokens 512`, 335.3 MiB for 213.5 MiB at 2048): one layer, one sequence of `tokens`, the reference and the `mha`
/// path ([`crate::jobs::run::estimate_peak_bytes`] of that run), the f32 and f64 copies of the
/// layer input, and the timings (`repeat` × threads × 2 figures).
pub fn bench_reference_need(
    file: &GgufFile,
    cfg: &MlaConfig,
    layer: usize,
    tokens: usize,
    repeat: usize,
    threads: usize,
) -> MemoryNeed {
    let rc = RunConfig {
        layers: vec![layer],
        batch: crate::core::batch::Batch::single(tokens, 0),
        seed: 0,
        input: crate::judge::report::InputMode::Random,
        paths: vec![crate::compute::path::PathKind::Mha],
        path_options: crate::compute::path::PathOptions::default(),
        backend: String::new(),
    };
    let dense = crate::jobs::run::dense_ffn_width(file, cfg, &rc);
    let run = crate::jobs::run::estimate_peak_bytes(cfg, &rc, dense) as u128;
    let input = tokens as u128 * cfg.hidden as u128 * 12;
    let times = repeat as u128 * threads as u128 * 2 * 8;
    MemoryNeed {
        bytes: clamp(run + input + times),
        what: format!(
            "{}: T={tokens}, N={}, H={}, --repeat {repeat}, {threads} thread count(s)",
            file.path().display(),
            cfg.n_head,
            cfg.hidden
        ),
        advice: "use fewer --tokens or a smaller --repeat".into(),
    }
}

/// `bench --dequant`'s need (20.6 MiB estimated for 11.3 MiB peak RSS on
/// `golden/models/tiny-v3-q4_k_m.gguf`, `--repeat 3`): one reused f32 buffer per quantized tensor (all live at once), the
/// largest tensor twice more (the fresh output and its bytes for the digest), and the timings
/// (`repeat` × tensors × threads × 2 figures of 8 bytes), plus the process's base.
pub fn bench_dequant_need(file: &GgufFile, repeat: usize, threads: usize) -> MemoryNeed {
    let sizes: Vec<u128> = file
        .tensors()
        .iter()
        .filter(|t| t.ggml_type.is_quantized())
        .map(|t| t.n_elements() as u128 * 4)
        .collect();
    let all: u128 = sizes.iter().sum();
    let largest = sizes.iter().copied().max().unwrap_or(0);
    let times = repeat as u128 * sizes.len() as u128 * threads as u128 * 2 * 8;
    let bytes = all + 2 * largest + times;
    MemoryNeed {
        bytes: clamp(crate::jobs::run::BASE_BYTES as u128 + bytes + bytes / 4),
        what: format!(
            "{}: {} quantized tensor(s), {} as f32, --repeat {repeat}, {threads} thread count(s)",
            file.path().display(),
            sizes.len(),
            human(clamp(all))
        ),
        advice: "use a smaller --repeat or fewer --threads".into(),
    }
}

/// `compare`'s need once the dump is read: the reference over the dump's layers and batch (the
/// union of a format-2 dump's steps: each sequence at its longest context + new), judged as one
/// run with no engine path.
pub fn compare_need(file: &GgufFile, cfg: &MlaConfig, dump: &DumpFile) -> MemoryNeed {
    use crate::core::batch::{Batch, SeqSpec};
    let (layers, batch): (Vec<usize>, Batch) = match dump {
        DumpFile::One(d) => (d.layers.keys().copied().collect(), d.batch.clone()),
        DumpFile::Steps(sd) => {
            let mut lens: Vec<usize> = Vec::new();
            for (spec, _) in &sd.steps {
                for (i, s) in spec.seqs.iter().enumerate() {
                    if lens.len() <= i {
                        lens.resize(i + 1, 0);
                    }
                    lens[i] = lens[i].max(s.context.saturating_add(s.new));
                }
            }
            let mut layers: Vec<usize> = sd.steps.iter().flat_map(|(_, d)| d.layers.keys().copied()).collect();
            layers.sort_unstable();
            layers.dedup();
            let seqs = lens
                .into_iter()
                .filter(|&len| len > 0)
                .map(|len| SeqSpec { len, start_pos: 0 })
                .collect();
            (layers, Batch { seqs })
        }
    };
    let rc = RunConfig {
        layers,
        batch,
        seed: 0,
        input: crate::judge::report::InputMode::Random,
        paths: Vec::new(),
        path_options: crate::compute::path::PathOptions::default(),
        backend: String::new(),
    };
    let mut need = run_need(file, cfg, &rc, None);
    need.what = format!(
        "{}: the reference over the dump's T={} in {} sequence(s), {} layer(s), N={}, H={}",
        file.path().display(),
        rc.batch.seqs.iter().map(|s| s.len as u128).sum::<u128>(),
        rc.batch.seqs.len(),
        rc.layers.len(),
        cfg.n_head,
        cfg.hidden
    );
    need.advice = "dump fewer tokens or layers".into();
    need
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_refusal_is_one_line_naming_the_sizes_and_the_source() {
        let need = MemoryNeed {
            bytes: 3 << 30,
            what: "m.gguf: T=4096, page size 16, splits 4".into(),
            advice: "use fewer --tokens".into(),
        };
        let lim = MemoryLimit {
            bytes: 1 << 30,
            source: "--max-memory".into(),
        };
        assert_eq!(
            refusal(&need, &lim, true),
            "this run needs about 3.0 GiB (m.gguf: T=4096, page size 16, splits 4) and the limit is 1.0 GiB \
             (--max-memory): use fewer --tokens, or raise --max-memory if the limit is wrong"
        );
        assert!(check(&need, Some(3 << 30)).is_ok());
        assert!(matches!(check(&need, Some((3 << 30) - 1)), Err(Error::Usage(_))));
        assert_eq!(clamp(u128::MAX), u64::MAX);
    }
}
