//! `mla-diff run` and `mla-diff compare`: building what to run from the arguments, checking every
//! argument and output path before the work, choosing the backend, and writing the verdict.
//!
//! Both commands end in the same report (terminal table, `--json`, `--report`), so their output
//! handling lives together; the work itself is [`crate::jobs::run`] and [`crate::jobs::compare`].

use std::io::Write;
use std::path::{Path, PathBuf};

use super::Outcome;
use super::args::*;
use super::outputs::{TextSink, check_outputs, same_file};
use super::values::{DtypeArg, KernelsArg, ReferenceArg};
use crate::backend::Backend;
use crate::backend::cpu::CpuOps;
use crate::compute::faults::FaultSet;
use crate::compute::path::{PathKind, PathOptions};
use crate::core::batch::{Batch, SeqSpec};
use crate::core::error::{Error, Result, chain};
use crate::core::settings::Settings;
use crate::jobs::export::ExportRequest;
use crate::jobs::run;
use crate::judge::report::{InputMode, RunConfig, RunReport};
use crate::model::config::MlaConfig;
use crate::model::dump::{MAX_NUM_KV_SPLITS, MAX_PAGE_SIZE};
use crate::model::gguf::GgufFile;
use crate::output::report;

/// Where a report goes besides the terminal.
struct Outputs<'a> {
    json: Option<&'a PathBuf>,
    md: Option<&'a PathBuf>,
    force: bool,
    quiet: bool,
    wide: bool,
}

impl<'a> Outputs<'a> {
    fn of(a: &'a ReportArgs) -> Self {
        Outputs {
            json: a.json.as_ref(),
            md: a.report.as_ref(),
            force: a.force,
            quiet: a.quiet,
            wide: a.wide,
        }
    }
}

/// Prints the terminal text of a report (to stdout; to stderr, or nowhere with `--quiet`, when
/// `--json -` takes stdout), then writes `--json`/`--report`; the outcome by verdict, an
/// inconclusive one with its reason (no requested path could run, or an injected fault never
/// acted), which the text's `inconclusive:` line says. The text comes first so that a file that
/// cannot be written still leaves the verdict on screen.
///
/// Errors: writing the files or the `--json -` document.
fn finish_report(
    rep: &RunReport,
    file: &GgufFile,
    backend: &Backend,
    o: Outputs<'_>,
    out: &mut dyn Write,
) -> Result<Outcome> {
    let Outputs {
        json,
        md,
        force,
        quiet,
        wide,
    } = o;
    let sink = TextSink::for_json(json, quiet);
    let text = if quiet {
        let mut lines = report::verdict_lines(rep);
        // An inconclusive verdict's line (the last verdict line) ends the text, after the notes.
        let inconclusive = lines.pop_if(|l| l.starts_with("inconclusive: "));
        for r in &rep.results {
            lines.extend(r.notes.iter().map(|n| format!("note ({} L{}): {n}", r.path, r.layer)));
        }
        lines.extend(report::finding_lines(rep));
        lines.extend(inconclusive);
        lines.join("\n") + "\n"
    } else {
        report::terminal_fit(rep, sink.table_width(wide))
    };
    sink.write(&text, out)?;
    write_report_files(rep, file, backend, json, md, force, quiet, out)?;
    Ok(Outcome::of(rep.verdict(), || rep.inconclusive_reason()))
}

/// Writes a report's `--json` document (to `out` for `-`) and `--report` Markdown and heat map,
/// naming each file written on stderr (`wrote PATH`) unless `quiet`.
///
/// Errors: as [`super::outputs::write_json`] and [`crate::output::triage::write`].
#[allow(
    clippy::too_many_arguments,
    reason = "the report and what it needs (file, backend), its two outputs, and how to write them (force, quiet, out)"
)]
pub(super) fn write_report_files(
    rep: &RunReport,
    file: &GgufFile,
    backend: &Backend,
    json: Option<&PathBuf>,
    md: Option<&PathBuf>,
    force: bool,
    quiet: bool,
    out: &mut dyn Write,
) -> Result<()> {
    if let Some(j) = json {
        super::outputs::write_json(j, &report::to_json_bytes(&report::json(rep)), force, out)?;
        wrote(j, quiet);
    }
    if let Some(r) = md {
        let env = crate::output::triage::Environment::detect(backend);
        crate::output::triage::write(r, rep, &env, &crate::output::triage::reproduce_command(), file, force)?;
        wrote(r, quiet);
        wrote(&crate::output::triage::plot_path(r), quiet);
    }
    Ok(())
}

/// `wrote PATH` on stderr for a file an output flag wrote (not for `-`, standard output), so a
/// user sees every file a command left behind; nothing when `quiet`.
pub(super) fn wrote(path: &std::path::Path, quiet: bool) {
    if !quiet && !super::outputs::is_stdout(path) {
        eprintln!("wrote {}", path.display());
    }
}

/// `mla-diff compare`.
pub fn cmd_compare(a: &CompareArgs, settings: &Settings, out: &mut dyn Write) -> Result<Outcome> {
    use crate::core::timing;
    use crate::jobs::compare::{CompareOptions, ReferenceDownload, StepReferences};
    use crate::model::dump::{self, DumpFile};
    let started = std::time::Instant::now();
    let _ = timing::take();
    // A format-2 dump names its model: without --model, the GGUF next to the dump.
    let (file, cfg) = timing::stage("open", || -> Result<(GgufFile, MlaConfig)> {
        let header = dump::peek_header(&a.dump)?;
        let file = match (a.model.path(), &header) {
            (Some(m), _) => crate::model::open(m)?,
            (None, Some(h)) => model_beside(&a.dump, h)?,
            // A format-1 dump does not say which file it was made from: judging it against the
            // embedded fixture would report the difference between two models as an engine bug.
            (None, None) => {
                return Err(Error::Usage(format!(
                    "{}: a format-1 dump does not identify its GGUF; pass --model with the file the engine loaded",
                    a.dump.display()
                )));
            }
        };
        let cfg = MlaConfig::from_gguf(&file)?;
        Ok((file, cfg))
    })?;
    let map = a.map.as_deref().map(dump::Map::load).transpose()?;
    check_outputs(a.output.json.as_ref(), a.output.report.as_ref(), a.output.force)?;
    let map_name = map
        .as_ref()
        .map(|m| m.name.clone().unwrap_or_else(|| a.map.clone().unwrap_or_default()));
    let (dtype, precision) = (a.dtype.map(Into::into), a.precision.map(Into::into));
    let read = timing::stage("read", || dump::read(&a.dump, map.as_ref(), &cfg))?;
    crate::jobs::limits::check(&crate::jobs::limits::compare_need(&file, &cfg, &read), a.max_memory)?;
    if let DumpFile::Steps(sd) = &read {
        let mut layers: Vec<usize> = sd.steps.iter().flat_map(|(_, d)| d.layers.keys().copied()).collect();
        layers.sort_unstable();
        layers.dedup();
        timing::stage("identity", || dump::check_identity(&a.dump, &sd.header, &file, &layers))?;
        // The hashed layers' pages (an MoE layer of DeepSeek-V3: gigabytes) are read again only
        // for the attention weights.
        file.release_resident_pages();
    }
    // The CPU reference by default, silently as before; another choice says which backend.
    let backend = match a.backend {
        BackendChoice::Cpu => Backend::Cpu(CpuOps::new(crate::core::dtype::Dtype::F32)),
        choice => {
            let device = DeviceArgs {
                backend: choice,
                dtype: DtypeArg::F32,
                cuda_include: a.cuda_include.clone(),
                kernels: KernelsArg::Fast,
                reference_backend: ReferenceArg::Auto,
            };
            timing::stage("backend", || select_backend(&device, settings, a.output.quiet))?
        }
    };
    // A GPU reference judges each step where it lives; the CPU one on the host.
    let download = match backend {
        Backend::Cpu(_) => ReferenceDownload::Judged,
        _ => ReferenceDownload::Device,
    };
    let opts = CompareOptions {
        backend,
        references: StepReferences::Union,
        download,
    };
    let (rep, tally) = match read {
        DumpFile::One(d) => (
            crate::jobs::compare::compare_dump_with(&file, &cfg, &d, map_name, dtype, precision, &opts)?,
            None,
        ),
        DumpFile::Steps(sd) => {
            let (rep, tally) =
                crate::jobs::compare::compare_steps_with(&file, &cfg, &sd, map_name, dtype, precision, &opts)?;
            (rep, Some(tally))
        }
    };
    let backend = opts.backend.with_dtype(rep.run.dtype);
    let outcome = timing::stage("report", || {
        finish_report(&rep, &file, &backend, Outputs::of(&a.output), out)
    });
    if a.stats {
        eprintln!("{}", crate::output::stats::stats_line(&file, started.elapsed()));
        if let Some(t) = tally {
            eprintln!(
                "mla-diff: references: {} over the union of {} step(s), {} of one step each",
                t.union, t.union_steps, t.per_step
            );
        }
        eprintln!("{}", crate::output::stats::stages_line(&timing::take()));
    }
    outcome
}

/// The GGUF a format-2 dump names (`header.model.file`), opened from the dump's folder.
///
/// Errors: [`Error::Usage`] naming the dump and the file when it is not next to the dump;
/// the GGUF's own errors.
pub(super) fn model_beside(dump: &Path, h: &crate::model::dump::DumpHeader) -> Result<GgufFile> {
    let beside = dump.parent().unwrap_or(Path::new(".")).join(&h.model.file);
    if !beside.exists() {
        return Err(Error::Usage(format!(
            "{}: the dump was made from `{}`, which is not next to it ({}); pass --model",
            dump.display(),
            h.model.file,
            beside.display()
        )));
    }
    crate::model::open(&beside)
}

/// Picks the backend and says which on stderr (unless `quiet`): `auto` takes CUDA when a device
/// answers. A CUDA backend takes its device and kernel settings from `settings`.
///
/// Errors: `--backend cuda` without a usable device, library or include folder; a bad kernel
/// configuration variable with a CUDA device (auto included); `--reference-backend cuda` when no
/// device answers, the reason in the same line.
pub fn select_backend(d: &DeviceArgs, settings: &Settings, quiet: bool) -> Result<Backend> {
    if d.reference_backend == ReferenceArg::Cuda && d.backend == BackendChoice::Cpu {
        return Err(Error::Usage(
            "--reference-backend cuda runs the reference on the CUDA backend's device; --backend cpu has none".into(),
        ));
    }
    let gpu_reference = d.reference_backend != ReferenceArg::Cpu;
    let cuda = || {
        crate::backend::cuda::ops::CudaOps::new(d.dtype.into(), d.cuda_include.as_deref(), settings)
            .map(|o| Backend::Cuda(o.with_kernels(d.kernels.into()).with_gpu_reference(gpu_reference)))
    };
    let b = match d.backend {
        BackendChoice::Cpu => Backend::Cpu(CpuOps::new(d.dtype.into())),
        BackendChoice::Cuda => cuda()?,
        BackendChoice::Auto => {
            // Why CUDA was not taken; a usage error (a bad kernel configuration variable) is the
            // user's to fix, not a reason to fall back to the CPU.
            let unusable = match crate::device::probe() {
                Ok(_) => match cuda() {
                    Ok(b) => {
                        if !quiet {
                            eprintln!("mla-diff: backend {} (auto: a CUDA device answered)", b.describe());
                        }
                        return Ok(b);
                    }
                    Err(e @ Error::Usage(_)) => return Err(e),
                    Err(e) => format!("CUDA unusable: {}", chain(&e)),
                },
                Err(e) => chain(&e),
            };
            if d.reference_backend == ReferenceArg::Cuda {
                // Said here in full: under --quiet no backend line was printed.
                return Err(Error::Usage(format!(
                    "--reference-backend cuda needs a CUDA device; none answered ({unusable})"
                )));
            }
            if !quiet {
                eprintln!("mla-diff: backend cpu (auto: {unusable})");
            }
            Backend::Cpu(CpuOps::new(d.dtype.into()))
        }
    };
    if d.backend != BackendChoice::Auto && !quiet {
        eprintln!("mla-diff: backend {}", b.describe());
    }
    Ok(b)
}

/// The checks of `--devices` that need no GPU: `--backend cuda`, one GPU per rank of `--tp`,
/// no GPU twice.
///
/// Errors: each as an exit-2 line naming `--devices`.
fn check_devices(a: &RunSpec) -> Result<()> {
    let Some(devs) = a.devices.as_ref() else {
        return Ok(());
    };
    if a.device.backend != BackendChoice::Cuda {
        return Err(Error::Usage(
            "--devices puts each TP rank on its own GPU and needs --backend cuda".into(),
        ));
    }
    if devs.len() != a.tp {
        return Err(Error::Usage(format!(
            "--devices lists {} GPU(s) for --tp {}: give one GPU per rank",
            devs.len(),
            a.tp
        )));
    }
    if let Some(d) = crate::backend::cuda::nccl::repeated_device(devs) {
        return Err(Error::Usage(format!(
            "--devices lists GPU {d} twice: NCCL refuses two ranks on one GPU (without --devices the ranks share one GPU and all-reduce on the host)"
        )));
    }
    Ok(())
}

/// [`select_backend`] for a run, with `--devices` (`check_devices` passed): every listed GPU
/// must exist, and the CUDA backend gets the NCCL communicators of those GPUs
/// ([`crate::backend::cuda::nccl::NcclAllReduce`]) for its `o_proj` all-reduce.
///
/// Errors: as [`select_backend`]; a listed GPU the driver does not report, fewer GPUs than
/// ranks, NCCL missing or failing (exit 2).
pub fn select_run_backend(a: &RunSpec, settings: &Settings, quiet: bool) -> Result<Backend> {
    let b = select_backend(&a.device, settings, quiet)?;
    let Some(devs) = a.devices.as_ref() else {
        return Ok(b);
    };
    let Backend::Cuda(ops) = b else {
        return Err(Error::Usage("--devices needs --backend cuda".into()));
    };
    let visible = crate::device::probe()?;
    if let Some(d) = devs.iter().find(|&&d| d >= visible) {
        let fewer = if a.tp > visible {
            format!(
                "; --tp {} needs {} GPUs and this machine has {visible} (without --devices the ranks share one GPU and all-reduce on the host)",
                a.tp, a.tp
            )
        } else {
            String::new()
        };
        return Err(Error::Usage(format!(
            "--devices {d}: no such GPU ({visible} visible, ordinals 0..{}){fewer}",
            visible - 1
        )));
    }
    let nccl = crate::backend::cuda::nccl::NcclAllReduce::new(devs)?;
    if !quiet {
        eprintln!("mla-diff: o_proj all-reduce through NCCL on GPUs {devs:?}");
    }
    Ok(Backend::Cuda(ops.with_nccl(std::rc::Rc::new(nccl))))
}

/// `--new-tokens` when not given: the new tokens per sequence of the chunked path.
pub const DEFAULT_NEW_TOKENS: usize = 5;

pub use crate::core::batch::MAX_POSITION;

/// Rejects injected faults that act on none of the requested paths (a run that "passes" with an
/// inert fault would read as a detector failure), and notes the paths a fault skips.
fn check_faults(file: &GgufFile, cfg: &MlaConfig, rc: &RunConfig, dtype: crate::core::dtype::Dtype) -> Result<()> {
    let layer = rc.layers.first().copied().unwrap_or(0);
    let latent = crate::model::tensors::ModelTensor::kv_b_latent_input(cfg.kv_b_layout).name(layer);
    let block = file.tensor(&latent).map_or(1, |t| t.ggml_type.block_size());
    for &f in &rc.path_options.faults.0 {
        if let Err(e) = f.applies_to_dtype(dtype) {
            return Err(Error::Usage(format!("--inject {f}: {e}")));
        }
        if let Err(e) = f.applies_to_fp8(rc.path_options.fp8.as_ref(), rc.path_options.kv_cache.as_ref()) {
            return Err(Error::Usage(format!("--inject {f}: {e}")));
        }
        if let Some(e) = rc
            .layers
            .iter()
            .find_map(|&l| f.applies_to_model(file, l, rc.path_options.tp).err())
        {
            return Err(Error::Usage(format!("--inject {f}: {e}")));
        }
        let verdicts: Vec<(PathKind, std::result::Result<(), &str>)> = rc
            .paths
            .iter()
            .map(|&p| (p, f.applies(p, cfg, rc.path_options.tp, block)))
            .collect();
        if verdicts.iter().all(|(_, v)| v.is_err()) {
            // One reason per distinct cause, with the paths that share it.
            let mut why: Vec<(String, Vec<String>)> = Vec::new();
            for (p, v) in &verdicts {
                let e = v.err().unwrap_or_default().to_string();
                match why.iter_mut().find(|(r, _)| *r == e) {
                    Some((_, ps)) => ps.push(p.to_string()),
                    None => why.push((e, vec![p.to_string()])),
                }
            }
            let why: Vec<String> = why
                .into_iter()
                .map(|(e, ps)| format!("{}: {e}", ps.join(", ")))
                .collect();
            return Err(Error::Usage(format!(
                "--inject {f} acts on none of the requested paths ({}); see `mla-diff run --help` and the fault table of docs/faults.md",
                why.join("; ")
            )));
        }
        // One note per distinct reason, naming every path it holds for.
        let mut idle: Vec<(String, Vec<String>)> = Vec::new();
        for (p, v) in verdicts {
            if let Err(e) = v {
                let e = e.to_string();
                match idle.iter_mut().find(|(r, _)| *r == e) {
                    Some((_, ps)) => ps.push(p.to_string()),
                    None => idle.push((e, vec![p.to_string()])),
                }
            }
        }
        for (e, ps) in idle {
            let paths = if ps.len() == 1 { "path" } else { "paths" };
            eprintln!(
                "mla-diff: note: --inject {f} does not act on {paths} {} ({e})",
                ps.join(", ")
            );
        }
    }
    Ok(())
}

/// Parses `--layers`: `A..B`, `A..=B`, `all` (the `n_layer` trunk layers), or a single number.
///
/// Errors: [`Error::Usage`] for another form, an empty range, or a range past the model's
/// `block_count` layers.
pub fn parse_layers(spec: &str, n_layer: usize, block_count: usize) -> Result<Vec<usize>> {
    let bad = || {
        Error::Usage(format!(
            "--layers `{spec}`: expected `A..B` (B excluded), `A..=B`, `all` or a number"
        ))
    };
    // The range's end is checked against the model before the layers are listed, so a bound
    // near the integer's maximum is refused instead of listed; the layer named is the first one
    // of the range the model lacks.
    let past = |b: usize| {
        Error::Usage(format!(
            "--layers `{spec}`: layer {b} out of range: the model has {block_count} layers (`block_count`)"
        ))
    };
    let v: Vec<usize> = if spec == "all" {
        (0..n_layer).collect()
    } else if let Some((a, b)) = spec.split_once("..=") {
        let (a, b) = (
            a.parse::<usize>().map_err(|_| bad())?,
            b.parse::<usize>().map_err(|_| bad())?,
        );
        if a > b {
            return Err(Error::Usage(format!("--layers `{spec}` selects no layer")));
        }
        if b >= block_count {
            return Err(past(a.max(block_count)));
        }
        (a..=b).collect()
    } else if let Some((a, b)) = spec.split_once("..") {
        let (a, b) = (
            a.parse::<usize>().map_err(|_| bad())?,
            b.parse::<usize>().map_err(|_| bad())?,
        );
        if a >= b {
            return Err(Error::Usage(format!("--layers `{spec}` selects no layer")));
        }
        if b > block_count {
            return Err(past(a.max(block_count)));
        }
        (a..b).collect()
    } else {
        vec![spec.parse::<usize>().map_err(|_| bad())?]
    };
    if v.is_empty() {
        return Err(Error::Usage(format!("--layers `{spec}` selects no layer")));
    }
    Ok(v)
}

/// The fp8 compute and latent cache `a` asks for, checked against each other and the paths:
/// `--kv-scale` positive, finite and only with an fp8 cache; no per-tensor scales with the
/// chunked path (one scale per context chunk's `kv_b` call, which the reference does not model);
/// no fp8 decode query on a model `cfg` with DSA layers.
///
/// Errors: [`Error::Usage`] naming the flag.
fn fp8_options(
    a: &RunSpec,
    paths: &[PathKind],
    cfg: &MlaConfig,
) -> Result<(
    Option<crate::core::fp8::ActQuant>,
    Option<crate::core::fp8::KvCacheQuant>,
)> {
    let fp8_cache = a.kv_cache_dtype == super::values::KvCacheDtypeArg::Fp8;
    let kv_scale = a.kv_scale.unwrap_or(1.0);
    if !crate::core::fp8::is_scale(kv_scale) {
        return Err(Error::Usage(format!(
            "--kv-scale {kv_scale:e}: expected a positive number within f32's normal range (k_scale is an f32)"
        )));
    }
    if a.kv_scale.is_some() && !fp8_cache {
        return Err(Error::Usage("--kv-scale: only with --kv-cache-dtype fp8".into()));
    }
    let q_scale = a.q_scale.unwrap_or(1.0);
    if !crate::core::fp8::is_scale(q_scale) {
        return Err(Error::Usage(format!(
            "--q-scale {q_scale:e}: expected a positive number within f32's normal range (q_scale is an f32)"
        )));
    }
    if a.q_scale.is_some() && !a.fp8_query {
        return Err(Error::Usage("--q-scale: only with --fp8-query".into()));
    }
    if a.fp8_query && cfg.indexer.is_some() {
        return Err(Error::Usage(
            "--fp8-query: this model's DSA layers decode over the indexer's kept keys, where the reference does not \
             score an fp8 query (only dense attention's absorbed form); drop --fp8-query"
                .into(),
        ));
    }
    if a.fp8_query && !fp8_cache {
        return Err(Error::Usage(
            "--fp8-query: only with --kv-cache-dtype fp8 (a kernel takes an fp8 query only over an fp8 cache)".into(),
        ));
    }
    // Flags that would act on no requested path would read as a clean fp8 run.
    if fp8_cache && paths.iter().all(|&p| p == PathKind::Mha) {
        return Err(Error::Usage(
            "--kv-cache-dtype fp8: the mha path keeps no cache; add --path mqa, chunked or mixed (or all)".into(),
        ));
    }
    if a.fp8_query && !paths.iter().any(|&p| matches!(p, PathKind::Mqa | PathKind::Mixed)) {
        return Err(Error::Usage(
            "--fp8-query: only the absorbed decode (mqa, mixed's decode rows) has a decode query; add --path mqa or mixed (or all)"
                .into(),
        ));
    }
    if a.fp8_compute == Some(super::values::Fp8ComputeArg::Tensor) && paths.contains(&PathKind::Chunked) {
        return Err(Error::Usage(
            "--fp8-compute tensor: the chunked path runs kv_b_proj once per context chunk, each call with its own \
             per-tensor scale, which the reference (one scale per projection over the batch) does not model; \
             use --path mha, mqa or mixed, or --fp8-compute token-group"
                .into(),
        ));
    }
    let dtype = a.device.dtype.into();
    Ok((
        a.fp8_compute.map(|f| f.act(dtype)),
        fp8_cache.then(|| crate::core::fp8::KvCacheQuant {
            scale: kv_scale,
            input: Some(super::values::Fp8ComputeArg::input(dtype)),
            query: a.fp8_query.then_some(q_scale),
        }),
    ))
}

/// Validates a [`RunSpec`] and opens its model: the file, its configuration and the run
/// configuration (with an empty `backend` field).
///
/// Errors: [`Error::Usage`] for zero sizes, empty sequences, positions past [`MAX_POSITION`], a
/// TP size that does not divide the heads and faults that act on no requested path;
/// [`Error::LayerOutOfRange`]; model and configuration errors.
pub fn build_run(a: &RunSpec) -> Result<(GgufFile, MlaConfig, RunConfig)> {
    let file = crate::model::fixture::open_model(a.model.path())?;
    let cfg = MlaConfig::from_gguf(&file)?;
    let layers = match (&a.layers, a.layer) {
        (Some(spec), _) => parse_layers(spec, cfg.trunk_layers(), cfg.n_layer)?,
        (None, Some(l)) => vec![l],
        (None, None) => vec![0],
    };
    if a.tokens == 0 {
        return Err(Error::Usage("--tokens must be at least 1".into()));
    }
    if a.tp == 0 {
        return Err(Error::Usage("--tp must be at least 1".into()));
    }
    check_devices(a)?;
    let new_tokens = a.new_tokens.unwrap_or(DEFAULT_NEW_TOKENS);
    if new_tokens == 0 {
        return Err(Error::Usage(
            "--new-tokens must be at least 1 (the tokens each chunked-prefill step adds)".into(),
        ));
    }
    for (flag, v) in [
        ("--page-size", a.page_size),
        ("--splits", a.splits),
        ("--chunk-size", a.chunk_size),
    ] {
        if v == 0 {
            return Err(Error::Usage(format!("{flag} must be at least 1")));
        }
    }
    // The same bounds a dump header's `page_size` and `num_kv_splits` have: the paged and
    // split-KV paths allocate per page and per split.
    if a.page_size > MAX_PAGE_SIZE {
        return Err(Error::Usage(format!(
            "--page-size {}: at most {MAX_PAGE_SIZE} tokens per page",
            a.page_size
        )));
    }
    if a.splits as u64 > MAX_NUM_KV_SPLITS {
        return Err(Error::Usage(format!(
            "--splits {}: at most {MAX_NUM_KV_SPLITS} KV splits per decode query",
            a.splits
        )));
    }
    let batch = match &a.seqs {
        Some(lens) => {
            if lens.is_empty() || lens.contains(&0) {
                return Err(Error::Usage("--seqs: every sequence needs at least one token".into()));
            }
            Batch {
                seqs: lens
                    .iter()
                    .map(|&len| SeqSpec {
                        len,
                        start_pos: a.start_pos,
                    })
                    .collect(),
            }
        }
        None => Batch::single(a.tokens, a.start_pos),
    };
    // Name the flag that puts a position past the bound: a sequence longer than the bound is
    // --tokens' (or --seqs'), a start past it --start-pos', and otherwise their sum.
    let longest = batch.seqs.iter().map(|s| s.len).max().unwrap_or(0);
    let lengths = if a.seqs.is_some() {
        format!("--seqs (longest {longest})")
    } else {
        format!("--tokens {longest}")
    };
    if longest > MAX_POSITION {
        return Err(Error::Usage(format!(
            "{lengths}: positions must stay below {MAX_POSITION} (2^31)"
        )));
    }
    if a.start_pos >= MAX_POSITION {
        return Err(Error::Usage(format!(
            "--start-pos {}: positions must stay below {MAX_POSITION} (2^31)",
            a.start_pos
        )));
    }
    if longest.checked_add(a.start_pos).is_none_or(|p| p > MAX_POSITION) {
        return Err(Error::Usage(format!(
            "--start-pos {} + {lengths}: positions must stay below {MAX_POSITION} (2^31)",
            a.start_pos
        )));
    }

    let paths = a.path.paths();
    let (fp8, kv_cache) = fp8_options(a, &paths, &cfg)?;
    if paths.contains(&PathKind::Chunked)
        && longest <= new_tokens
        && (a.new_tokens.is_some() || a.path == PathChoice::Chunked)
    {
        return Err(Error::Usage(format!(
            "--new-tokens {new_tokens}: no sequence is longer (the longest has {longest} tokens), so the chunked path has \
             no cached context to test; use fewer --new-tokens, longer sequences, or a --path without chunked"
        )));
    }

    let rc = RunConfig {
        layers,
        batch,
        seed: a.seed,
        input: a.input.into(),
        paths,
        path_options: PathOptions {
            page_size: a.page_size,
            num_splits: a.splits,
            tp: a.tp,
            chunk_size: a.chunk_size,
            new_tokens,
            faults: FaultSet(a.inject.clone()),
            fp8,
            kv_cache,
            ..PathOptions::default()
        },
        backend: String::new(),
    };
    // The layers and the TP size against the model, here and not only when the run starts, so
    // that a refusal comes before the backend is chosen and named.
    crate::jobs::run::check_run(&file, &cfg, &rc)?;
    check_faults(&file, &cfg, &rc, a.device.dtype.into())?;
    Ok((file, cfg, rc))
}

/// A progress bar on stderr naming the layer and the stage being run (dequant, reference, each
/// path, compare, diagnose): drawn only when stderr is a terminal, the run is not `--quiet`, and
/// the work is still going after a second.
struct LayerProgress {
    bar: Option<indicatif::ProgressBar>,
    done: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl LayerProgress {
    fn new(quiet: bool, total: usize) -> Self {
        use std::io::IsTerminal;
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        if quiet || !std::io::stderr().is_terminal() {
            return LayerProgress { bar: None, done };
        }
        let bar = indicatif::ProgressBar::with_draw_target(Some(total as u64), indicatif::ProgressDrawTarget::hidden());
        if let Ok(style) =
            indicatif::ProgressStyle::with_template("{elapsed_precise} [{bar:30}] layer {pos}/{len}: {msg}")
        {
            bar.set_style(style.progress_chars("=> "));
        }
        let named = bar.clone();
        crate::core::timing::set_listener(Some(Box::new(move |stage| named.set_message(stage.to_string()))));
        let (b, d) = (bar.clone(), done.clone());
        std::thread::spawn(move || {
            for _ in 0..20 {
                std::thread::sleep(std::time::Duration::from_millis(50));
                if d.load(std::sync::atomic::Ordering::Relaxed) {
                    return;
                }
            }
            b.set_draw_target(indicatif::ProgressDrawTarget::stderr());
            b.enable_steady_tick(std::time::Duration::from_millis(200));
        });
        LayerProgress { bar: Some(bar), done }
    }

    fn update(&self, done: usize) {
        if let Some(b) = &self.bar {
            b.set_position(done as u64);
        }
    }

    fn finish(self) {
        crate::core::timing::set_listener(None);
        self.done.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(b) = self.bar {
            b.finish_and_clear();
        }
    }
}

/// Refuses a GPU run whose estimated peak device memory ([`run::estimate_device_bytes`])
/// exceeds the device's free memory, before any work: the device answers an allocation past it
/// with an out-of-memory error halfway through a layer. Nothing for another backend.
///
/// Errors: [`Error::Usage`] naming the estimate, T and what the device has free; a failed query
/// of the device's memory.
fn check_device_memory(file: &GgufFile, cfg: &MlaConfig, rc: &RunConfig, backend: &Backend) -> Result<()> {
    use crate::core::memory::human;
    let Backend::Cuda(o) = backend else {
        return Ok(());
    };
    let full = rc.input == InputMode::Tokens;
    let gpu_reference = o.gpu_reference()
        && rc
            .layers
            .iter()
            .any(|&l| crate::backend::cuda::reference::supported(cfg, l, full));
    let need = run::estimate_device_bytes(cfg, rc, run::dense_ffn_width(file, cfg, rc), gpu_reference);
    let (free, total) = o
        .device()
        .context()
        .mem_get_info()
        .map_err(|e| Error::cuda(format!("query the device's free memory: {e:?}")))?;
    if need > free as u64 {
        return Err(Error::Usage(format!(
            "{}: this run needs about {} of GPU memory (T={}, N={}, H={}{}) and the GPU has {} free of {}: use fewer --tokens",
            file.path().display(),
            human(need),
            rc.batch.n_tokens(),
            cfg.n_head,
            cfg.hidden,
            if gpu_reference {
                ", the reference on the GPU"
            } else {
                ""
            },
            human(free as u64),
            human(total as u64),
        )));
    }
    Ok(())
}

/// `mla-diff run`.
pub fn cmd_run(a: &RunArgs, settings: &Settings, out: &mut dyn Write) -> Result<Outcome> {
    let started = std::time::Instant::now();
    let _ = crate::core::timing::take();
    let (file, cfg, rc) = crate::core::timing::stage("open", || build_run(&a.spec))?;
    check_outputs(a.output.json.as_ref(), a.output.report.as_ref(), a.output.force)?;
    let export = a.export_inputs.as_ref().map(|dir| ExportRequest {
        dir: dir.clone(),
        rank: a.rank,
        force: a.output.force,
    });
    if let Some(req) = &export {
        req.check(&file, &cfg, &rc)?;
        if let Some(j) = a.output.json.as_ref().filter(|j| same_file(j, &req.path())) {
            return Err(Error::Usage(format!(
                "--json {} is the file --export-inputs writes; give them different paths",
                j.display()
            )));
        }
    }
    let export_bytes = export.as_ref().map(|req| {
        let (lo, hi) = req.heads(cfg.n_head, rc.path_options.tp);
        crate::jobs::export::estimate_bytes(&cfg, &rc, hi - lo)
    });
    let need = crate::jobs::limits::run_need(&file, &cfg, &rc, export_bytes);
    crate::jobs::limits::check(&need, a.max_memory)?;
    let backend = crate::core::timing::stage("backend", || select_run_backend(&a.spec, settings, a.output.quiet))?;
    check_device_memory(&file, &cfg, &rc, &backend)?;
    let rc = RunConfig {
        backend: backend.describe(),
        ..rc
    };
    let computed = match rc.input {
        InputMode::Tokens => rc.layers.iter().max().map_or(0, |l| l + 1),
        InputMode::Random => rc.layers.len(),
    };
    let progress = LayerProgress::new(a.output.quiet, computed);
    let rep = match &export {
        None => run::run_with_progress(&backend, &file, &cfg, &rc, &mut |d, _| progress.update(d)).map(|r| (r, None)),
        Some(_) => run::run_keeping_reference(&backend, &file, &cfg, &rc, &mut |d, _| progress.update(d))
            .map(|(r, refs)| (r, refs.into_iter().next())),
    };
    progress.finish();
    let (rep, reference) = rep?;
    let exported = match (&export, reference) {
        (Some(req), Some((layer, trace))) => Some(crate::core::timing::stage("export", || {
            crate::jobs::export::write(req, &file, &cfg, &rc, layer, &trace)
        })?),
        _ => None,
    };
    let o = Outputs::of(&a.output);
    let outcome = crate::core::timing::stage("report", || finish_report(&rep, &file, &backend, o, out));
    let judged = matches!(outcome, Ok(Outcome::Pass | Outcome::Divergence));
    if let Some(e) = exported.as_ref().filter(|_| judged) {
        TextSink::for_json(a.output.json.as_ref(), false).write(&format!("{}\n", e.line(cfg.n_head)), out)?;
    }
    if a.stats {
        eprintln!("{}", crate::output::stats::stats_line(&file, started.elapsed()));
        eprintln!("{}", crate::output::stats::stages_line(&crate::core::timing::take()));
    }
    outcome
}
