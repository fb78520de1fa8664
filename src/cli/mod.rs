//! Command-line interface: argument definitions and the commands behind them.
//!
//! The binary is a thin shell over this module so that commands can be tested (and snapshotted)
//! in-process. Every command returns an [`Outcome`] (0 = within tolerance, 1 = divergence found)
//! or a library [`Error`] (exit 2), the exit-code contract of docs/design.md.

pub mod values;

use std::io::Write;
use std::path::{Path, PathBuf};

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::backend::Backend;
use crate::backend::cpu::CpuOps;
use crate::compute::faults::{Fault, FaultSet};
use crate::compute::path::{PathKind, PathOptions};
use crate::core::batch::{Batch, SeqSpec};
use crate::core::dtype::Dtype;
use crate::core::error::{Error, Result};
use crate::jobs::run;
use crate::jobs::selftest::{self, ModelSource, SelftestOptions};
use crate::judge::report::{InputMode, RunConfig, RunReport};
use crate::model::config::MlaConfig;
use crate::model::gguf::GgufFile;
use crate::output::report;
use values::{DtypeArg, EngineDtypeArg, InputArg, KernelsArg};

/// What a successful command concluded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Everything within tolerance (exit 0).
    Pass,
    /// A divergence or finding (exit 1).
    Divergence,
}

/// mla-diff: find the first tensor where an MLA forward path goes wrong, and what kind of wrong.
#[derive(Debug, Parser)]
#[command(name = "mla-diff", version, about, long_about = None)]
pub struct Cli {
    /// The command.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the reference and the engine paths on a GGUF model and diff every site.
    Run(RunArgs),
    /// Show a GGUF file's metadata, derived MLA config and per-tensor types.
    Inspect(InspectArgs),
    /// Inject every fault into every path of every fixture, and run every path clean: prove the
    /// detectors find each bug class at its first site and nothing on clean runs.
    Selftest(SelftestArgs),
    /// Diff an engine's dump (safetensors of our site names) against the reference on the same GGUF.
    Compare(CompareArgs),
    /// Check an engine's weights as loaded (fused, sharded per TP rank) against the GGUF.
    Weights(WeightsArgs),
    /// Record a passing run as a golden case, or check golden cases (the CI gate).
    #[command(subcommand)]
    Golden(GoldenCommand),
    /// Compile every CUDA kernel with NVRTC (no GPU needed) and print registers and spills.
    Kernels(KernelsArgs),
    /// Time the fast CUDA kernels at DeepSeek-V3 sizes (needs a GPU); with --dequant or
    /// --reference, time CPU dequantization or one reference layer forward instead.
    Bench(BenchArgs),
}

/// Arguments of `mla-diff compare`.
#[derive(Debug, Args)]
pub struct CompareArgs {
    /// GGUF model file the engine loaded (default: the embedded tiny-v3 Q4_K_M fixture).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// The engine's dump (docs/dump-format.md).
    #[arg(long)]
    pub dump: PathBuf,
    /// Undo an engine's names and layouts: `hf`, `vllm`, `llama.cpp`, or a map JSON file.
    #[arg(long)]
    pub map: Option<String>,
    /// The dtype the engine computed in, which picks the tolerance rows (f32, or the engine-bf16 /
    /// engine-f16 rows); default: the dump's `dtype` metadata, else f32.
    #[arg(long, value_enum)]
    pub dtype: Option<EngineDtypeArg>,
    /// Write the JSON report here (schema: docs/json-schema.md).
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write a Markdown triage report here, with its heat map next to it.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Overwrite existing output files.
    #[arg(long)]
    pub force: bool,
    /// Print only the verdict lines.
    #[arg(long)]
    pub quiet: bool,
}

/// Where a report goes besides the terminal.
struct Outputs<'a> {
    json: Option<&'a PathBuf>,
    md: Option<&'a PathBuf>,
    force: bool,
    quiet: bool,
}

/// Writes `--json`/`--report` outputs and the terminal text of a report; the outcome by verdict.
fn finish_report(
    rep: &RunReport,
    file: &GgufFile,
    backend: &Backend,
    o: Outputs<'_>,
    out: &mut dyn Write,
) -> Result<Outcome> {
    let Outputs { json, md, force, quiet } = o;
    if let Some(j) = json {
        crate::core::fsio::write_file_atomic(j, &report::to_json_bytes(&report::json(rep)), force)?;
    }
    if let Some(r) = md {
        let env = crate::output::triage::Environment::detect(backend);
        crate::output::triage::write(r, rep, &env, &reproduce_command(), file, force)?;
    }
    let text = if quiet {
        let mut lines = report::verdict_lines(rep);
        for r in &rep.results {
            lines.extend(r.notes.iter().map(|n| format!("note ({} L{}): {n}", r.path, r.layer)));
        }
        lines.extend(report::finding_lines(rep));
        lines.join("\n") + "\n"
    } else {
        report::terminal(rep)
    };
    out.write_all(text.as_bytes())
        .map_err(|e| Error::io("<stdout>", "write", e))?;
    Ok(if rep.all_pass() {
        Outcome::Pass
    } else {
        Outcome::Divergence
    })
}

/// Refuses to start when an output file exists and `--force` is absent (before any work).
///
/// Also refuses two outputs that name the same file (`--json x.md --report x.md`, or a `--json`
/// path equal to the report's `<name>.svg` heat map): one would silently replace the other.
fn check_outputs(json: Option<&PathBuf>, md: Option<&PathBuf>, force: bool) -> Result<()> {
    refuse_overwrite(json, force)?;
    refuse_overwrite(md, force)?;
    if let Some(r) = md {
        let plot = crate::output::triage::plot_path(r);
        refuse_overwrite(Some(&plot), force)?;
        if let Some(j) = json {
            for (other, what) in [(r, "--report"), (&plot, "the report's heat map")] {
                if same_file(j, other) {
                    return Err(Error::Usage(format!(
                        "--json {} is the same file as {what} ({}); give them different paths",
                        j.display(),
                        other.display()
                    )));
                }
            }
        }
    }
    Ok(())
}

/// Whether two output paths name the same file: equal as written, or equal once their existing
/// parent folders are canonicalized (`./x.md` and `x.md`).
fn same_file(a: &Path, b: &Path) -> bool {
    let canon = |p: &Path| {
        let dir = p
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        dir.canonicalize()
            .ok()
            .map(|d| d.join(p.file_name().unwrap_or_default()))
    };
    a == b || matches!((canon(a), canon(b)), (Some(x), Some(y)) if x == y)
}

/// `mla-diff compare`.
pub fn cmd_compare(a: &CompareArgs, out: &mut dyn Write) -> Result<Outcome> {
    let file = crate::model::fixture::open_model(a.model.as_ref())?;
    let cfg = MlaConfig::from_gguf(&file)?;
    let map = a.map.as_deref().map(crate::model::dump::Map::load).transpose()?;
    check_outputs(a.json.as_ref(), a.report.as_ref(), a.force)?;
    let dump = crate::model::dump::load(&a.dump, map.as_ref(), &cfg)?;
    let map_name = map
        .as_ref()
        .map(|m| m.name.clone().unwrap_or_else(|| a.map.clone().unwrap_or_default()));
    let rep = crate::jobs::compare::compare_dump(&file, &cfg, &dump, map_name, a.dtype.map(Into::into))?;
    let backend = Backend::Cpu(CpuOps::new(rep.run.dtype));
    let o = Outputs {
        json: a.json.as_ref(),
        md: a.report.as_ref(),
        force: a.force,
        quiet: a.quiet,
    };
    finish_report(&rep, &file, &backend, o, out)
}

/// Arguments of `mla-diff weights`.
#[derive(Debug, Args)]
pub struct WeightsArgs {
    /// GGUF model file the engine loaded (default: the embedded tiny-v3 Q4_K_M fixture).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// The engine's weights as loaded: tensors `L<n>.<param>` or `L<n>.<param>.rank<r>`, vLLM
    /// parameter names, PyTorch [out, in] layout.
    #[arg(long)]
    pub check: PathBuf,
    /// Rename the engine's tensor names: a map JSON file (docs/dump-format.md, "Maps") whose
    /// targets are `<param>` (the layer taken from the pattern) or `L<n>.<param>[.rank<r>]`.
    #[arg(long)]
    pub map: Option<String>,
    /// Write the result as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Overwrite an existing JSON file.
    #[arg(long)]
    pub force: bool,
}

/// `mla-diff weights --check`.
pub fn cmd_weights(a: &WeightsArgs, out: &mut dyn Write) -> Result<Outcome> {
    let file = crate::model::fixture::open_model(a.model.as_ref())?;
    let cfg = MlaConfig::from_gguf(&file)?;
    let map = a.map.as_deref().map(crate::model::dump::Map::load).transpose()?;
    refuse_overwrite(a.json.as_ref(), a.force)?;
    let rep = crate::jobs::weights_check::check(&file, &cfg, &a.check, map.as_ref())?;
    if let Some(j) = &a.json {
        let doc = serde_json::json!({
            "schema": report::JSON_SCHEMA_VERSION,
            "kind": "weights",
            "tool": {"name": "mla-diff", "version": env!("CARGO_PKG_VERSION")},
            "report": rep,
            "verdict": if rep.all_pass() { "pass" } else { "divergence" },
            "exit_code": if rep.all_pass() { 0 } else { 1 },
        });
        crate::core::fsio::write_file_atomic(j, &report::to_json_bytes(&doc), a.force)?;
    }
    out.write_all(crate::jobs::weights_check::terminal(&rep).as_bytes())
        .map_err(|e| Error::io("<stdout>", "write", e))?;
    Ok(if rep.all_pass() {
        Outcome::Pass
    } else {
        Outcome::Divergence
    })
}

/// `mla-diff golden …`.
#[derive(Debug, Subcommand)]
pub enum GoldenCommand {
    /// Run once and write `golden/<CASE>/{manifest.json,trace.safetensors}` (the run must pass).
    Record(GoldenRecordArgs),
    /// Recompute golden cases and compare every site (exit 0 match, 1 differ, 2 cannot check).
    Check(GoldenCheckArgs),
}

/// Arguments of `mla-diff golden record`.
#[derive(Debug, Args)]
pub struct GoldenRecordArgs {
    /// Case name (folder under the golden folder).
    #[arg(long)]
    pub case: String,
    /// What to run (the model must lie inside the repository, or be the embedded default).
    #[command(flatten)]
    pub spec: RunSpec,
    /// The golden folder; its parent is the repository root (default: ./golden).
    #[arg(long, default_value = "golden")]
    pub golden_dir: PathBuf,
    /// Replace an existing case.
    #[arg(long)]
    pub force: bool,
}

/// Arguments of `mla-diff golden check`.
#[derive(Debug, Args)]
pub struct GoldenCheckArgs {
    /// Case(s) to check (repeatable).
    #[arg(long, required_unless_present = "all", conflicts_with = "all")]
    pub case: Vec<String>,
    /// Check every case under the golden folder.
    #[arg(long)]
    pub all: bool,
    /// The golden folder (default: ./golden, else this build's source tree's golden/).
    #[arg(long)]
    pub golden_dir: Option<PathBuf>,
    /// CUDA include folder, for cases recorded on CUDA.
    #[arg(long)]
    pub cuda_include: Option<PathBuf>,
    /// One line per case; for a case that differs, only its differing sites.
    #[arg(long)]
    pub quiet: bool,
}

/// `mla-diff golden record`.
pub fn cmd_golden_record(a: &GoldenRecordArgs, out: &mut dyn Write) -> Result<Outcome> {
    crate::jobs::golden::validate_case_name(&a.case)?;
    if !a.golden_dir.is_dir() {
        return Err(Error::Usage(format!(
            "{}: no such folder; run from the repository root or pass --golden-dir",
            a.golden_dir.display()
        )));
    }
    let (file, cfg, rc) = build_run(&a.spec)?;
    let backend = select_backend(&a.spec.device, false)?;
    let (rep, summary) = crate::jobs::golden::record(&crate::jobs::golden::RecordRequest {
        case: &a.case,
        golden_dir: &a.golden_dir,
        model: a.spec.model.as_deref(),
        file: &file,
        cfg: &cfg,
        rc: &rc,
        backend: &backend,
        force: a.force,
    })?;
    let text = match summary {
        Some(s) => format!(
            "recorded golden case `{}` in {}: {} sites, {} distinct tensors, {} bytes of trace\n",
            a.case,
            s.dir.display(),
            s.sites,
            s.tensors,
            s.trace_bytes
        ),
        None => format!(
            "{}\nnot recorded: the run diverges from the reference, and a golden case must be a passing run\n",
            report::verdict_lines(&rep).join("\n")
        ),
    };
    out.write_all(text.as_bytes())
        .map_err(|e| Error::io("<stdout>", "write", e))?;
    Ok(if rep.all_pass() {
        Outcome::Pass
    } else {
        Outcome::Divergence
    })
}

/// The golden folder: `--golden-dir`, else `./golden`, else this build's source tree's.
fn golden_dir(arg: Option<&PathBuf>) -> Result<PathBuf> {
    if let Some(d) = arg {
        return if d.is_dir() {
            Ok(d.clone())
        } else {
            Err(Error::Usage(format!("--golden-dir {}: not a folder", d.display())))
        };
    }
    [
        PathBuf::from("golden"),
        PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/golden")),
    ]
    .into_iter()
    .find(|d| d.is_dir())
    .ok_or_else(|| Error::Usage("no golden folder here; run from the repository root or pass --golden-dir".into()))
}

/// `mla-diff golden check`: every case is checked even after a failure; exit 2 if any case could
/// not be checked, else 1 if any differs, else 0.
pub fn cmd_golden_check(a: &GoldenCheckArgs, out: &mut dyn Write) -> Result<Outcome> {
    let dir = golden_dir(a.golden_dir.as_ref())?;
    let cases = if a.all {
        let c = crate::jobs::golden::list_cases(&dir)?;
        if c.is_empty() {
            return Err(Error::Usage(format!("{}: no golden cases", dir.display())));
        }
        c
    } else {
        for c in &a.case {
            crate::jobs::golden::validate_case_name(c)?;
        }
        a.case.clone()
    };
    let include = a.cuda_include.clone();
    let cuda = move |dtype: Dtype, k: crate::backend::cuda::ops::Kernels| {
        crate::backend::cuda::ops::CudaOps::new(dtype, include.as_deref()).map(|o| Backend::Cuda(o.with_kernels(k)))
    };
    let mut text = String::new();
    let (mut n_pass, mut n_fail, mut errors) = (0, 0, Vec::<Error>::new());
    for case in &cases {
        match crate::jobs::golden::check(&dir, case, &cuda) {
            Ok(c) => {
                text.push_str(&crate::jobs::golden::summary(&c, a.quiet));
                if c.passed() {
                    n_pass += 1;
                } else {
                    n_fail += 1;
                }
            }
            Err(e) => {
                text.push_str(&format!("golden {case}: ERROR: {e}\n"));
                errors.push(e);
            }
        }
    }
    text.push_str(&format!(
        "golden check: {} case(s): {n_pass} match, {n_fail} differ, {} could not be checked\n",
        cases.len(),
        errors.len()
    ));
    out.write_all(text.as_bytes())
        .map_err(|e| Error::io("<stdout>", "write", e))?;
    match errors.len() {
        0 => {}
        1 => return Err(errors.remove(0)),
        k => {
            return Err(Error::Usage(format!(
                "{k} golden cases could not be checked (the lines marked ERROR above)"
            )));
        }
    }
    Ok(if n_fail == 0 {
        Outcome::Pass
    } else {
        Outcome::Divergence
    })
}

/// Arguments of `mla-diff bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// CUDA include folder (holding cuda_bf16.h).
    #[arg(long)]
    pub cuda_include: Option<PathBuf>,
    /// CPU, no GPU needed: time the library's dequantization of every quantized tensor of this
    /// GGUF (output GB/s of f32), at 1 thread and at all threads.
    #[arg(long, value_name = "GGUF", conflicts_with = "reference")]
    pub dequant: Option<PathBuf>,
    /// CPU, no GPU needed: time one reference layer forward (f64) and the CPU engine's mha path
    /// on this GGUF, weights loaded and dequantized before the clock starts.
    #[arg(long, value_name = "GGUF")]
    pub reference: Option<PathBuf>,
    /// Layer for --reference.
    #[arg(long, default_value_t = 0, requires = "reference")]
    pub layer: usize,
    /// Tokens T for --reference (one sequence, positions 0..T).
    #[arg(long, default_value_t = 128, requires = "reference")]
    pub tokens: usize,
    /// Timed repetitions per figure for --dequant/--reference (after one warm-up); the median
    /// is reported.
    #[arg(long, default_value_t = 5)]
    pub repeat: usize,
    /// Rayon thread counts for --dequant/--reference, e.g. `1,2` (default: 1 and all threads,
    /// as RAYON_NUM_THREADS or the core count sets them).
    #[arg(long, value_delimiter = ',')]
    pub threads: Option<Vec<usize>>,
    /// Write the figures as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Overwrite an existing JSON file.
    #[arg(long)]
    pub force: bool,
}

/// `mla-diff bench --dequant FILE`: the table of [`crate::jobs::bench_cpu::dequant_bench`].
fn cmd_bench_dequant(a: &BenchArgs, path: &PathBuf, out: &mut dyn Write) -> Result<Outcome> {
    refuse_overwrite(a.json.as_ref(), a.force)?;
    let file = GgufFile::open(path)?;
    let threads = crate::jobs::bench_cpu::thread_counts(a.threads.as_deref());
    let figs = crate::jobs::bench_cpu::dequant_bench(&file, a.repeat, &threads)?;
    let mut t = comfy_table::Table::new();
    t.load_style(comfy_table::presets::UTF8_BORDERS_ONLY).set_header(vec![
        "tensor",
        "type",
        "MB out (f32)",
        "threads",
        "median",
        "GB/s out",
        "warm buffer GB/s out",
    ]);
    for f in &figs {
        t.add_row(vec![
            f.tensor.clone(),
            f.ggml_type.to_string(),
            format!("{:.1}", 4.0 * f.elements as f64 / 1e6),
            f.threads.to_string(),
            format!("{:.2} ms", f.median_s * 1e3),
            format!("{:.2}", f.gb_per_s_out),
            format!("{:.2}", f.warm_gb_per_s_out),
        ]);
    }
    let text = format!(
        "{}: dequantization, median of {} timed calls after 1 warm-up\n{t}\n",
        path.display(),
        a.repeat
    );
    out.write_all(text.as_bytes())
        .map_err(|e| Error::io("<stdout>", "write", e))?;
    if let Some(j) = &a.json {
        let doc = serde_json::json!({"kind": "dequant", "file": path.display().to_string(), "figures": figs});
        crate::core::fsio::write_file_atomic(j, &report::to_json_bytes(&doc), a.force)?;
    }
    Ok(Outcome::Pass)
}

/// `mla-diff bench --reference FILE`: the table of [`crate::jobs::bench_cpu::reference`].
fn cmd_bench_reference(a: &BenchArgs, path: &PathBuf, out: &mut dyn Write) -> Result<Outcome> {
    refuse_overwrite(a.json.as_ref(), a.force)?;
    let file = GgufFile::open(path)?;
    let cfg = MlaConfig::from_gguf(&file)?;
    let threads = crate::jobs::bench_cpu::thread_counts(a.threads.as_deref());
    let b = crate::jobs::bench_cpu::reference(&file, &cfg, a.layer, a.tokens, a.repeat, &threads)?;
    let mut t = comfy_table::Table::new();
    t.load_style(comfy_table::presets::UTF8_BORDERS_ONLY)
        .set_header(vec!["forward", "layer", "T", "threads", "median", "runs"]);
    for f in &b.figures {
        t.add_row(vec![
            f.what.clone(),
            f.layer.to_string(),
            f.tokens.to_string(),
            f.threads.to_string(),
            format!("{:.3} s", f.median_s),
            f.runs_s.iter().map(|s| format!("{s:.3}")).collect::<Vec<_>>().join(" "),
        ]);
    }
    let text = format!(
        "{}: N={} H={} Lq={} L={} P={} R={} V={}; weights loaded and dequantized in {:.2} s (not timed)\n{t}\n",
        path.display(),
        cfg.n_head,
        cfg.hidden,
        cfg.q_lora_rank.map_or("-".into(), |q| q.to_string()),
        cfg.kv_lora_rank,
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.v_head_dim,
        b.load_s
    );
    out.write_all(text.as_bytes())
        .map_err(|e| Error::io("<stdout>", "write", e))?;
    if let Some(j) = &a.json {
        let doc = serde_json::json!({"kind": "reference", "bench": b});
        crate::core::fsio::write_file_atomic(j, &report::to_json_bytes(&doc), a.force)?;
    }
    Ok(Outcome::Pass)
}

/// `mla-diff bench`: the CPU benchmarks with `--dequant` or `--reference`, else the CUDA ones.
pub fn cmd_bench(a: &BenchArgs, out: &mut dyn Write) -> Result<Outcome> {
    if let Some(p) = &a.dequant {
        return cmd_bench_dequant(a, p, out);
    }
    if let Some(p) = &a.reference {
        return cmd_bench_reference(a, p, out);
    }
    let ops = crate::backend::cuda::ops::CudaOps::new(Dtype::Bf16, a.cuda_include.as_deref())?;
    let figs = crate::jobs::bench_gpu::all(&ops)?;
    let mut t = comfy_table::Table::new();
    t.load_style(comfy_table::presets::UTF8_BORDERS_ONLY).set_header(vec![
        "benchmark",
        "shape",
        "median time",
        "figure",
        "note",
    ]);
    for f in &figs {
        t.add_row(vec![
            f.name.clone(),
            f.shape.clone(),
            format!("{:.1} µs", f.micros),
            format!("{:.1} {}", f.value, f.unit),
            f.note.clone(),
        ]);
    }
    let text = format!("{}\n{t}\n", crate::backend::cuda::ops::describe(ops.device()));
    out.write_all(text.as_bytes())
        .map_err(|e| Error::io("<stdout>", "write", e))?;
    if let Some(j) = &a.json {
        crate::core::fsio::write_file_atomic(j, &report::to_json_bytes(&figs), a.force)?;
    }
    Ok(Outcome::Pass)
}

/// Arguments of `mla-diff kernels`.
#[derive(Debug, Args)]
pub struct KernelsArgs {
    /// Only compile (the only mode so far; kept explicit for scripts and CI).
    #[arg(long)]
    pub compile_only: bool,
    /// Target architectures, e.g. `sm_90,sm_80`.
    #[arg(long, value_delimiter = ',', default_value = "sm_90,sm_80")]
    pub arch: Vec<String>,
    /// CUDA include folder (holding cuda_bf16.h).
    #[arg(long)]
    pub cuda_include: Option<PathBuf>,
    /// Also write each compiled CUBIN here (`<module>.<arch>.cubin`, and
    /// `<module>.<configuration>.<arch>.cubin` for each kernel configuration, e.g.
    /// `fast_decode.cu.hm64-w8-p1-qsmem-s2-wgmma.sm_90a.cubin`), e.g. for cuobjdump.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// `mla-diff kernels --compile-only`: NVRTC-compiles every module for every architecture.
pub fn cmd_kernels(a: &KernelsArgs, out: &mut dyn Write) -> Result<Outcome> {
    let include = crate::device::include_dir(a.cuda_include.as_deref())?;
    let (maj, min) = crate::device::nvrtc_version()?;
    let mut t = comfy_table::Table::new();
    t.load_style(comfy_table::presets::UTF8_BORDERS_ONLY).set_header(vec![
        "module",
        "arch",
        "kernel",
        "registers",
        "spill stores",
        "spill loads",
    ]);
    for arch in &a.arch {
        // The decode kernel also in its 64-head configurations (wgmma, compiled for sm_90a on
        // sm_90, and mma.sync; the macros' defaults are the 16-head one), with the in-register
        // softmax, with the TMA producer warp (the merge through global memory), with the
        // merge through a cluster of 4 blocks, the 64-head block with TMA and a cluster of 8,
        // and the teams block (the N < 64 default) with the cluster of the bench shape's 2
        // splits and with the merge through global memory, and with 5 stages (a team then also
        // waits for the other team's release of a stage).
        use crate::backend::decode_cfg::DecodeCfg;
        let wgmma = DecodeCfg::WGMMA.for_arch(arch);
        let hm64 = DecodeCfg::MMA64;
        let fused = DecodeCfg::parse("16,8,2,1,4,1,1")?;
        let tma = DecodeCfg::TMA16;
        let cluster16 = DecodeCfg::parse("16,8,2,0,2,2,0,1,1")?.for_arch(arch);
        let hm64_cluster = DecodeCfg::parse("64,8,2,0,2,1,0,1,1")?.for_arch(arch);
        let teams = DecodeCfg::TEAMS.for_arch(arch);
        let teams_s5 = DecodeCfg {
            stages: 5,
            ..DecodeCfg::TEAMS
        }
        .for_arch(arch);
        type Job = (crate::device::Module, String, Vec<(&'static str, usize)>);
        let mut jobs: Vec<Job> = crate::device::Module::ALL
            .iter()
            .map(|&m| (m, m.file().to_string(), Vec::new()))
            .collect();
        // The TMA producer warp needs sm_90+: an older architecture compiles the variant it
        // would run instead (the same block without the producer warp).
        // (Below sm_90 the cluster variants fall back to the fused merge and the same block
        // without the producer warp: compiled once.)
        for (c, splits) in [
            (wgmma, 0),
            (hm64, 0),
            (fused, 0),
            (tma.for_arch(arch), 0),
            (cluster16, 4),
            (hm64_cluster, 8),
            (teams, 2),
            (
                DecodeCfg {
                    cluster: false,
                    ..teams
                },
                0,
            ),
            (teams_s5, 2),
        ] {
            let cluster = c.cluster_size(arch, splits, 512, true);
            let size = if cluster > 0 {
                format!("{cluster}")
            } else {
                String::new()
            };
            let defines = c.defines_for(cluster);
            if jobs.iter().all(|j| j.2 != defines) {
                jobs.push((
                    crate::device::Module::FastDecode,
                    format!("{} ({}{size})", crate::device::Module::FastDecode.file(), c.label()),
                    defines,
                ));
            }
        }
        // The prefill kernel in the other layouts its configurations select (Q in registers,
        // 32-key tiles, a deeper pipeline, 8 warps).
        for s in ["4,64,2,1,1", "8,32,3,0,2"] {
            let c = crate::backend::prefill_cfg::PrefillCfg::parse(s)?;
            jobs.push((
                crate::device::Module::FastPrefill,
                format!("{} ({})", crate::device::Module::FastPrefill.file(), c.label()),
                c.defines(),
            ));
        }
        for (m, label, defines) in jobs {
            let target = crate::device::target_arch(arch, &defines);
            let c = crate::device::compile(m, &target, &include, true, &defines)?;
            if let Some(dir) = &a.out {
                // `<module>.<arch>.cubin` for the default build, `<module>.<label>.<target>.cubin`
                // (label without parentheses, spaces as `-`) for each configuration.
                let name = if defines.is_empty() {
                    format!("{}.{arch}.cubin", m.file())
                } else {
                    let inner = label.split_once(" (").map_or("", |(_, r)| r.trim_end_matches(')'));
                    format!("{}.{}.{target}.cubin", m.file(), inner.replace(' ', "-"))
                };
                crate::core::fsio::write_file_atomic(&dir.join(name), &c.cubin, true)?;
            }
            let usage = crate::device::parse_usage(&c.log);
            if usage.is_empty() {
                t.add_row(vec![
                    label.clone(),
                    target.clone(),
                    "(no ptxas report)".into(),
                    String::new(),
                    String::new(),
                    String::new(),
                ]);
            }
            for u in usage {
                t.add_row(vec![
                    label.clone(),
                    target.clone(),
                    u.kernel,
                    u.registers.to_string(),
                    u.spill_stores.to_string(),
                    u.spill_loads.to_string(),
                ]);
            }
        }
    }
    let text = format!(
        "NVRTC {maj}.{min}, include {}: every kernel module compiled for {}\n{t}\n",
        include.display(),
        a.arch.join(", ")
    );
    out.write_all(text.as_bytes())
        .map_err(|e| Error::io("<stdout>", "write", e))?;
    Ok(Outcome::Pass)
}

/// Arguments of `mla-diff selftest`.
#[derive(Debug, Args)]
pub struct SelftestArgs {
    /// Folder of GGUF fixtures (default: `golden/models` of this checkout, else the embedded one).
    #[arg(long)]
    pub models: Option<PathBuf>,
    /// A subset: of the fixtures given, those named tiny-v3-q8_0, yarn-v3-f32, k256-q4_k_m,
    /// dsa-glm-q8_0 or the embedded one (all given fixtures when none of these is among them);
    /// page size 16, TP 1 and the smallest TP > 1.
    #[arg(long)]
    pub quick: bool,
    /// Layer to test in each fixture.
    #[arg(long, default_value_t = 1)]
    pub layer: usize,
    /// Backend and dtype.
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Also run every case on the CPU and compare the findings (class and first site) with the
    /// chosen backend's.
    #[arg(long)]
    pub cross_check: bool,
    /// Seed of the inputs.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Write every case as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Overwrite an existing JSON file.
    #[arg(long)]
    pub force: bool,
}

/// `--path` choices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PathChoice {
    /// Expanded MHA prefill (vLLM forward_mha).
    Mha,
    /// Absorbed MQA decode over a paged latent cache (vLLM forward_mqa).
    Mqa,
    /// Chunked-context prefill merged by LSE.
    Chunked,
    /// Mixed batch: decode tokens first, prefill tokens after.
    Mixed,
    /// Every path.
    All,
}

impl PathChoice {
    /// The paths selected.
    pub fn paths(self) -> Vec<PathKind> {
        match self {
            PathChoice::Mha => vec![PathKind::Mha],
            PathChoice::Mqa => vec![PathKind::Mqa],
            PathChoice::Chunked => vec![PathKind::Chunked],
            PathChoice::Mixed => vec![PathKind::Mixed],
            PathChoice::All => PathKind::ALL.to_vec(),
        }
    }
}

/// `--backend` choices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BackendChoice {
    /// The CUDA backend when a device answers, else the CPU (and say which).
    Auto,
    /// The CPU backend.
    Cpu,
    /// The CUDA backend (an error if no device answers).
    Cuda,
}

/// Where the device backend finds things.
#[derive(Debug, Clone, Args)]
pub struct DeviceArgs {
    /// Compute backend.
    #[arg(long, value_enum, default_value_t = BackendChoice::Auto)]
    pub backend: BackendChoice,
    /// Compute dtype of the paths: f32, or bf16 inputs with f32 accumulation.
    #[arg(long, value_enum, default_value_t = DtypeArg::F32)]
    pub dtype: DtypeArg,
    /// CUDA include folder for NVRTC (holding cuda_bf16.h); default $CUDA_HOME/include, else
    /// /usr/local/cuda/include.
    #[arg(long)]
    pub cuda_include: Option<PathBuf>,
    /// CUDA attention kernels: tensor-core ones for bf16 (fast) or the plain FMA ones (simple).
    #[arg(long, value_enum, default_value_t = KernelsArg::Fast)]
    pub kernels: KernelsArg,
}

/// Picks the backend and says which on stderr (unless `quiet`): `auto` takes CUDA when a device
/// answers.
///
/// Errors: `--backend cuda` without a usable device, library or include folder.
pub fn select_backend(d: &DeviceArgs, quiet: bool) -> Result<Backend> {
    let cuda = || {
        crate::backend::cuda::ops::CudaOps::new(d.dtype.into(), d.cuda_include.as_deref())
            .map(|o| Backend::Cuda(o.with_kernels(d.kernels.into())))
    };
    let b = match d.backend {
        BackendChoice::Cpu => Backend::Cpu(CpuOps::new(d.dtype.into())),
        BackendChoice::Cuda => cuda()?,
        BackendChoice::Auto => match crate::device::probe() {
            Ok(_) => match cuda() {
                Ok(b) => {
                    if !quiet {
                        eprintln!("mla-diff: backend {} (auto: a CUDA device answered)", b.describe());
                    }
                    return Ok(b);
                }
                Err(e) => {
                    if !quiet {
                        eprintln!("mla-diff: backend cpu (auto: CUDA unusable: {e})");
                    }
                    Backend::Cpu(CpuOps::new(d.dtype.into()))
                }
            },
            Err(e) => {
                if !quiet {
                    eprintln!("mla-diff: backend cpu (auto: {e})");
                }
                Backend::Cpu(CpuOps::new(d.dtype.into()))
            }
        },
    };
    if d.backend != BackendChoice::Auto && !quiet {
        eprintln!("mla-diff: backend {}", b.describe());
    }
    Ok(b)
}

/// What to run: the model, layers, batch, backend, paths and path options (shared by `run` and
/// `golden record`).
#[derive(Debug, Clone, Args)]
pub struct RunSpec {
    /// GGUF model file (default: the embedded tiny-v3 Q4_K_M fixture).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Layer to check.
    #[arg(long, conflicts_with = "layers")]
    pub layer: Option<usize>,
    /// Layers to check: `A..B` (B excluded), `A..=B`, or `all`.
    #[arg(long)]
    pub layers: Option<String>,
    /// Tokens in the batch (one sequence; see --seqs for several).
    #[arg(long, default_value_t = 19)]
    pub tokens: usize,
    /// Sequence lengths of a multi-sequence batch, e.g. `1,15,16,17,53` (overrides --tokens).
    #[arg(long, value_delimiter = ',')]
    pub seqs: Option<Vec<usize>>,
    /// Position of the first token (tests RoPE/YaRN far from position 0).
    #[arg(long, default_value_t = 0)]
    pub start_pos: usize,
    /// Seed of the random inputs, token ids and block-table shuffle.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Layer input: seeded random hidden states, or seeded token ids through the embedding and
    /// the reference forward of the preceding layers.
    #[arg(long, value_enum, default_value_t = InputArg::Random)]
    pub input: InputArg,
    /// Engine path(s) to run.
    #[arg(long, value_enum, default_value_t = PathChoice::All)]
    pub path: PathChoice,
    /// Backend and dtype.
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Tokens per page of the paged latent cache.
    #[arg(long, default_value_t = 16)]
    pub page_size: usize,
    /// KV splits per decode query (mqa, mixed).
    #[arg(long, default_value_t = 4)]
    pub splits: usize,
    /// Simulated tensor-parallel ranks (must divide the head count).
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// Context tokens per chunk (chunked).
    #[arg(long, default_value_t = 8)]
    pub chunk_size: usize,
    /// New (uncached) tokens per sequence (chunked); the rest of each sequence is context.
    #[arg(long, default_value_t = 5)]
    pub new_tokens: usize,
    /// Inject a fault from the catalogue into the paths (repeatable).
    #[arg(long, value_parser = values::fault_parser())]
    pub inject: Vec<Fault>,
}

/// Arguments of `mla-diff run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// What to run.
    #[command(flatten)]
    pub spec: RunSpec,
    /// Write the JSON report here (schema: docs/json-schema.md).
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write a Markdown triage report here (GitHub-flavoured, for a bug ticket), with its error
    /// heat map next to it (`<name>.svg`).
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Overwrite existing output files.
    #[arg(long)]
    pub force: bool,
    /// Print only the verdict lines (and no progress bar).
    #[arg(long)]
    pub quiet: bool,
    /// Print resource use on stderr: wall time, peak RSS, and which tensors' data was read.
    #[arg(long)]
    pub stats: bool,
}

/// Arguments of `mla-diff inspect`.
#[derive(Debug, Args)]
pub struct InspectArgs {
    /// GGUF model file.
    pub path: PathBuf,
    /// Show only this layer's tensors (and the non-layer ones).
    #[arg(long)]
    pub layer: Option<usize>,
}

/// Largest RoPE position accepted (`--start-pos` plus the sequence length): 2^31, far past any
/// released context length, and exact in the f64 angle computation.
pub const MAX_POSITION: usize = 1 << 31;

/// Rejects injected faults that act on none of the requested paths (a run that "passes" with an
/// inert fault would read as a detector failure), and notes the paths a fault skips.
fn check_faults(file: &GgufFile, cfg: &MlaConfig, rc: &RunConfig) -> Result<()> {
    let layer = rc.layers.first().copied().unwrap_or(0);
    let latent = match cfg.kv_b_layout {
        crate::model::config::KvBLayout::Split => crate::model::weights::tensor_name(layer, "attn_v_b"),
        crate::model::config::KvBLayout::Fused => crate::model::weights::tensor_name(layer, "attn_kv_b"),
    };
    let block = file.tensor(&latent).map_or(1, |t| t.ggml_type.block_size());
    for &f in &rc.path_options.faults.0 {
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
                "--inject {f} acts on none of the requested paths ({}); see `mla-diff run --help` and README's fault table",
                why.join("; ")
            )));
        }
        for (p, v) in verdicts {
            if let Err(e) = v {
                eprintln!("mla-diff: note: --inject {f} does not act on path {p} ({e})");
            }
        }
    }
    Ok(())
}

/// Parses `--layers`: `A..B`, `A..=B`, `all`, or a single number.
pub fn parse_layers(spec: &str, n_layer: usize) -> Result<Vec<usize>> {
    let bad = || {
        Error::Usage(format!(
            "--layers `{spec}`: expected `A..B` (B excluded), `A..=B`, `all` or a number"
        ))
    };
    let v: Vec<usize> = if spec == "all" {
        (0..n_layer).collect()
    } else if let Some((a, b)) = spec.split_once("..=") {
        let (a, b) = (
            a.parse::<usize>().map_err(|_| bad())?,
            b.parse::<usize>().map_err(|_| bad())?,
        );
        (a..=b).collect()
    } else if let Some((a, b)) = spec.split_once("..") {
        let (a, b) = (
            a.parse::<usize>().map_err(|_| bad())?,
            b.parse::<usize>().map_err(|_| bad())?,
        );
        (a..b).collect()
    } else {
        vec![spec.parse::<usize>().map_err(|_| bad())?]
    };
    if v.is_empty() {
        return Err(Error::Usage(format!("--layers `{spec}` selects no layer")));
    }
    Ok(v)
}

/// Validates a [`RunSpec`] and opens its model: the file, its configuration and the run
/// configuration (with an empty `backend` field).
///
/// Errors: [`Error::Usage`] for zero sizes, empty sequences, positions past [`MAX_POSITION`] and
/// faults that act on no requested path; model and configuration errors.
pub fn build_run(a: &RunSpec) -> Result<(GgufFile, MlaConfig, RunConfig)> {
    let file = crate::model::fixture::open_model(a.model.as_ref())?;
    let cfg = MlaConfig::from_gguf(&file)?;
    let layers = match (&a.layers, a.layer) {
        (Some(spec), _) => parse_layers(spec, cfg.trunk_layers())?,
        (None, Some(l)) => vec![l],
        (None, None) => vec![0],
    };
    if a.tokens == 0 {
        return Err(Error::Usage("--tokens must be at least 1".into()));
    }
    if a.tp == 0 {
        return Err(Error::Usage("--tp must be at least 1".into()));
    }
    if a.new_tokens == 0 {
        return Err(Error::Usage(
            "--new-tokens must be at least 1 (the tokens each chunked-prefill step adds)".into(),
        ));
    }
    if a.page_size == 0 || a.splits == 0 || a.chunk_size == 0 {
        return Err(Error::Usage(
            "--page-size, --splits and --chunk-size must be at least 1".into(),
        ));
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
    let last_pos = batch
        .seqs
        .iter()
        .map(|s| s.len)
        .max()
        .unwrap_or(0)
        .checked_add(a.start_pos);
    if last_pos.is_none_or(|p| p > MAX_POSITION) {
        return Err(Error::Usage(format!(
            "--start-pos {}: positions must stay below {MAX_POSITION} (2^31)",
            a.start_pos
        )));
    }

    let rc = RunConfig {
        layers,
        batch,
        seed: a.seed,
        input: a.input.into(),
        paths: a.path.paths(),
        path_options: PathOptions {
            page_size: a.page_size,
            num_splits: a.splits,
            tp: a.tp,
            chunk_size: a.chunk_size,
            new_tokens: a.new_tokens,
            faults: FaultSet(a.inject.clone()),
            ..PathOptions::default()
        },
        backend: String::new(),
    };
    check_faults(&file, &cfg, &rc)?;
    Ok((file, cfg, rc))
}

/// A run that injected faults, found nothing, and whose paths said a fault had nothing to act on
/// is not a pass: the user asked to see a bug and the batch gave it no chance (e.g.
/// `unwritten-rows` on one sequence, where no context chunk is empty for any row).
///
/// Errors: [`Error::Usage`] quoting the path's note, which says what batch would exercise it.
fn refuse_idle_fault(rep: &RunReport) -> Result<()> {
    if rep.run.path_options.faults.is_empty() || !rep.all_pass() {
        return Ok(());
    }
    let idle: Vec<String> = rep
        .results
        .iter()
        .flat_map(|r| {
            r.notes
                .iter()
                .filter(|n| n.contains("nothing to act on"))
                .map(move |n| (r.path, n))
        })
        .map(|(p, n)| format!("{}: {n}", p.name()))
        .collect();
    match idle.first() {
        Some(first) => Err(Error::Usage(format!(
            "the injected fault did not act on this batch, so the clean result says nothing: {first}"
        ))),
        None => Ok(()),
    }
}

/// Refuses to replace `path` unless `force`.
///
/// A folder is refused even with `--force`: the output is a file, and `--force` would not help.
fn refuse_overwrite(path: Option<&PathBuf>, force: bool) -> Result<()> {
    if let Some(p) = path.filter(|p| p.is_dir()) {
        return Err(Error::Usage(format!("{} is a folder; give a file path", p.display())));
    }
    match path {
        Some(p) if p.exists() && !force => Err(Error::Usage(format!(
            "{} exists; pass --force to overwrite it",
            p.display()
        ))),
        _ => Ok(()),
    }
}

/// A progress bar on stderr for multi-layer runs: drawn only when stderr is a terminal, the run
/// is not `--quiet`, more than one layer is computed, and the work is still going after a second.
struct LayerProgress {
    bar: Option<indicatif::ProgressBar>,
    done: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl LayerProgress {
    fn new(quiet: bool, total: usize) -> Self {
        use std::io::IsTerminal;
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        if quiet || total < 2 || !std::io::stderr().is_terminal() {
            return LayerProgress { bar: None, done };
        }
        let bar = indicatif::ProgressBar::with_draw_target(Some(total as u64), indicatif::ProgressDrawTarget::hidden());
        if let Ok(style) = indicatif::ProgressStyle::with_template("{elapsed_precise} [{bar:30}] layer {pos}/{len}") {
            bar.set_style(style.progress_chars("=> "));
        }
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
        self.done.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(b) = self.bar {
            b.finish_and_clear();
        }
    }
}

/// `mla-diff run`.
pub fn cmd_run(a: &RunArgs, out: &mut dyn Write) -> Result<Outcome> {
    let started = std::time::Instant::now();
    let (file, cfg, rc) = build_run(&a.spec)?;
    check_outputs(a.json.as_ref(), a.report.as_ref(), a.force)?;
    let backend = select_backend(&a.spec.device, a.quiet)?;
    let rc = RunConfig {
        backend: backend.describe(),
        ..rc
    };
    let computed = match rc.input {
        InputMode::Tokens => rc.layers.iter().max().map_or(0, |l| l + 1),
        InputMode::Random | InputMode::Dump => rc.layers.len(),
    };
    let progress = LayerProgress::new(a.quiet, computed);
    let rep = run::run_with_progress(&backend, &file, &cfg, &rc, &mut |d, _| progress.update(d));
    progress.finish();
    let rep = rep?;
    if a.stats {
        eprintln!("{}", stats_line(&file, started.elapsed()));
    }
    refuse_idle_fault(&rep)?;
    let o = Outputs {
        json: a.json.as_ref(),
        md: a.report.as_ref(),
        force: a.force,
        quiet: a.quiet,
    };
    finish_report(&rep, &file, &backend, o, out)
}

/// Peak resident set size of this process in bytes (Linux `VmHWM`), if known.
pub fn peak_rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// `--stats`: wall time, peak RSS, the header bytes read at open, and the tensor data read,
/// grouped by layer (`blk.N.`) and other tensors.
pub fn stats_line(file: &GgufFile, wall: std::time::Duration) -> String {
    let reads = file.data_reads();
    let mut by_layer: std::collections::BTreeMap<String, (usize, u64)> = std::collections::BTreeMap::new();
    let mut tensors = std::collections::BTreeSet::new();
    for (name, _, len) in &reads {
        let key = name
            .strip_prefix("blk.")
            .and_then(|r| r.split('.').next())
            .map_or_else(|| name.clone(), |l| format!("layer {l}"));
        let e = by_layer.entry(key).or_default();
        if tensors.insert(name.clone()) {
            e.0 += 1;
        }
        e.1 += len;
    }
    let total: u64 = reads.iter().map(|r| r.2).sum();
    let parts: Vec<String> = by_layer
        .iter()
        .map(|(k, (n, b))| format!("{k}: {n} tensors, {:.1} MB", *b as f64 / 1e6))
        .collect();
    format!(
        "mla-diff: stats: wall {:.2} s, peak RSS {}, file {:.1} GB declared, header read at open {:.2} MB, tensor data read {:.1} MB ({})",
        wall.as_secs_f64(),
        peak_rss_bytes().map_or("n/a".into(), |b| format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)),
        file.file_len() as f64 / 1e9,
        file.header_bytes_read() as f64 / 1e6,
        total as f64 / 1e6,
        if parts.is_empty() {
            "none".into()
        } else {
            parts.join("; ")
        }
    )
}

/// The command line of this process, shell-quoted, without its output flags (`--report`,
/// `--json` and their values, `--force`, `--quiet`, `--stats`), so that it reruns as is and prints
/// the full table: for "how to reproduce" lines.
pub fn reproduce_command() -> String {
    reproduce_from(std::env::args().skip(1))
}

/// [`reproduce_command`] for given arguments (without the program name).
pub fn reproduce_from(args: impl IntoIterator<Item = String>) -> String {
    let mut v = vec!["mla-diff".to_string()];
    let mut skip_value = false;
    for a in args {
        if skip_value {
            skip_value = false;
            continue;
        }
        if a == "--report" || a == "--json" {
            skip_value = true;
            continue;
        }
        if matches!(a.as_str(), "--force" | "--quiet" | "--stats")
            || a.starts_with("--report=")
            || a.starts_with("--json=")
        {
            continue;
        }
        v.push(a);
    }
    v.iter().map(|a| shell_quote(a)).collect::<Vec<_>>().join(" ")
}

/// Quotes `s` for a POSIX shell when it holds anything but safe characters.
pub fn shell_quote(s: &str) -> String {
    if !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_./=,:+@%".contains(c)) {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

/// `mla-diff inspect`.
pub fn cmd_inspect(a: &InspectArgs, out: &mut dyn Write) -> Result<Outcome> {
    let file = GgufFile::open(&a.path)?;
    if let Some(l) = a.layer {
        let n = MlaConfig::from_gguf(&file)?.n_layer;
        if l >= n {
            return Err(Error::LayerOutOfRange {
                path: a.path.clone(),
                layer: l,
                n_layers: n,
            });
        }
    }
    out.write_all(crate::jobs::inspect::inspect(&file, a.layer).as_bytes())
        .map_err(|e| Error::io("<stdout>", "write", e))?;
    Ok(Outcome::Pass)
}

/// The fixtures selftest uses: every `*.gguf` in `dir`, or in `golden/models` of the current
/// directory or of this build's source tree; the embedded fixture when none is found.
pub fn selftest_models(dir: Option<&PathBuf>) -> Result<Vec<ModelSource>> {
    let candidates: Vec<PathBuf> = match dir {
        Some(d) => vec![d.clone()],
        None => vec![
            PathBuf::from("golden/models"),
            PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/golden/models")),
        ],
    };
    for d in candidates {
        if !d.is_dir() {
            if dir.is_some() {
                return Err(Error::Usage(format!("--models {}: not a folder", d.display())));
            }
            continue;
        }
        let mut v: Vec<PathBuf> = std::fs::read_dir(&d)
            .map_err(|e| Error::io(&d, "read folder", e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
            .collect();
        v.sort();
        if v.is_empty() && dir.is_some() {
            return Err(Error::Usage(format!("--models {}: no .gguf files", d.display())));
        }
        if !v.is_empty() {
            return Ok(v.into_iter().map(ModelSource::File).collect());
        }
    }
    Ok(vec![ModelSource::Embedded])
}

/// `mla-diff selftest`.
pub fn cmd_selftest(a: &SelftestArgs, out: &mut dyn Write) -> Result<Outcome> {
    if a.cross_check && a.device.backend == BackendChoice::Cpu {
        return Err(Error::Usage(
            "--cross-check compares a GPU backend with the CPU; --backend cpu has nothing to compare".into(),
        ));
    }
    let models = selftest_models(a.models.as_ref())?;
    if let Some(j) = a.json.as_ref().filter(|j| j.exists() && !a.force) {
        return Err(Error::Usage(format!(
            "{} exists; pass --force to overwrite it",
            j.display()
        )));
    }
    let backend = select_backend(&a.device, false)?;
    if a.cross_check && matches!(backend, Backend::Cpu(_)) {
        return Err(Error::Usage(
            "--cross-check needs a CUDA device to compare with the CPU; none answered (see the backend line above)"
                .into(),
        ));
    }
    let opts = SelftestOptions {
        models,
        layer: a.layer,
        quick: a.quick,
        seed: a.seed,
    };
    let rep = selftest::run(&backend, &opts)?;
    if let Some(j) = &a.json {
        crate::core::fsio::write_file_atomic(j, &report::to_json_bytes(&rep), a.force)?;
    }
    let mut text = format!("backend {}, dtype {}\n", backend.describe(), backend.dtype());
    text.push_str(&selftest::confusion_table(&rep));
    let mut ok = rep.all_ok();
    if a.cross_check {
        let cpu = selftest::run(&Backend::Cpu(CpuOps::new(backend.dtype())), &opts)?;
        let (summary, same) = selftest::cross_check(&rep, &cpu, "the CPU backend");
        text.push_str(&summary);
        ok &= same;
        if let Backend::Cuda(o) = backend.clone().filter_fast() {
            let simple = Backend::Cuda(o.with_kernels(crate::backend::cuda::ops::Kernels::Simple));
            let srep = selftest::run(&simple, &opts)?;
            let (summary, same) = selftest::cross_check(&rep, &srep, "the simple CUDA kernels");
            text.push_str(&summary);
            ok &= same && srep.all_ok();
        }
    }
    out.write_all(text.as_bytes())
        .map_err(|e| Error::io("<stdout>", "write", e))?;
    Ok(if ok { Outcome::Pass } else { Outcome::Divergence })
}

/// Runs a parsed command line, writing human output to `out`.
pub fn dispatch(cli: &Cli, out: &mut dyn Write) -> Result<Outcome> {
    match &cli.command {
        Command::Run(a) => cmd_run(a, out),
        Command::Inspect(a) => cmd_inspect(a, out),
        Command::Selftest(a) => cmd_selftest(a, out),
        Command::Compare(a) => cmd_compare(a, out),
        Command::Weights(a) => cmd_weights(a, out),
        Command::Golden(GoldenCommand::Record(a)) => cmd_golden_record(a, out),
        Command::Golden(GoldenCommand::Check(a)) => cmd_golden_check(a, out),
        Command::Kernels(a) => cmd_kernels(a, out),
        Command::Bench(a) => cmd_bench(a, out),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// Every help string of `c` and its subcommands: about, argument help, value help.
    fn help_texts(c: &clap::Command, out: &mut Vec<(String, String)>) {
        let name = c.get_name().to_string();
        for t in [c.get_about(), c.get_long_about()].into_iter().flatten() {
            out.push((name.clone(), t.to_string()));
        }
        for a in c.get_arguments() {
            for t in [a.get_help(), a.get_long_help()].into_iter().flatten() {
                out.push((format!("{name} --{}", a.get_id()), t.to_string()));
            }
            for pv in a.get_possible_values() {
                if let Some(t) = pv.get_help() {
                    out.push((format!("{name} --{} {}", a.get_id(), pv.get_name()), t.to_string()));
                }
            }
        }
        for s in c.get_subcommands() {
            help_texts(s, out);
        }
    }

    /// clap renders `{n}` in help text as a line break (`L{n}.{param}` came out as "L" and a
    /// new line), so help strings spell placeholders `L<n>.<param>` instead.
    #[test]
    fn help_texts_have_no_brace_placeholders() {
        let mut texts = Vec::new();
        help_texts(&Cli::command(), &mut texts);
        assert!(texts.len() > 50, "{}", texts.len());
        let bad: Vec<&(String, String)> = texts
            .iter()
            .filter(|(_, t)| {
                t.match_indices('{').any(|(i, _)| {
                    let rest = &t[i + 1..];
                    let word: String = rest
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect();
                    !word.is_empty() && rest[word.len()..].starts_with('}')
                })
            })
            .collect();
        assert!(bad.is_empty(), "{bad:#?}");
        let mut cmd = Cli::command();
        let help = cmd
            .find_subcommand_mut("weights")
            .expect("weights subcommand")
            .render_help()
            .to_string();
        assert!(help.contains("`L<n>.<param>` or `L<n>.<param>.rank<r>`"), "{help}");
        assert!(help.contains("`L<n>.<param>[.rank<r>]`"), "{help}");
    }
}
