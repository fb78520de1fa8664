//! The other commands: `weights`, `golden record|check`, `bench`, `kernels`, `inspect`, `sites`
//! and `selftest`. Each parses nothing (clap did), calls its job and prints the job's result.

use std::io::Write;
use std::path::PathBuf;

use super::Outcome;
use super::args::*;
use super::outputs::{TextSink, check_outputs, refuse_overwrite, write_json, write_text};
use super::run::{build_run, select_backend, select_run_backend};
use crate::backend::Backend;
use crate::backend::cpu::CpuOps;
use crate::core::dtype::Dtype;
use crate::core::error::{Error, Result, chain};
use crate::core::settings::Settings;
use crate::jobs::selftest::{self, ModelSource, SelftestOptions};
use crate::judge::report::Verdict;
use crate::model::config::MlaConfig;
use crate::model::gguf::GgufFile;
use crate::output::report;

/// `mla-diff weights --check`: the model is `--model`, else for a format-2 dump the GGUF its
/// header names beside it, else the embedded fixture.
pub fn cmd_weights(a: &WeightsArgs, out: &mut dyn Write) -> Result<Outcome> {
    // A format-2 dump names its model: without --model, the GGUF next to the dump.
    let file = match (a.model.path(), crate::model::dump::peek_header(&a.check)?) {
        (None, Some(h)) => super::run::model_beside(&a.check, &h)?,
        (m, _) => crate::model::fixture::open_model(m)?,
    };
    let cfg = MlaConfig::from_gguf(&file)?;
    let map = a.map.as_deref().map(crate::model::dump::Map::load).transpose()?;
    refuse_overwrite(a.output.json.as_ref(), a.output.force)?;
    let rep = crate::jobs::weights_check::check(&file, &cfg, &a.check, map.as_ref())?;
    let sink = TextSink::for_json(a.output.json.as_ref(), false);
    sink.write(
        &crate::output::weights_check::terminal_fit(&rep, sink.table_width(a.wide)),
        out,
    )?;
    if let Some(j) = &a.output.json {
        let doc = serde_json::json!({
            "schema": report::JSON_SCHEMA_VERSION,
            "kind": "weights",
            "tool": {"name": "mla-diff", "version": env!("CARGO_PKG_VERSION")},
            "report": rep,
            "verdict": if rep.all_pass() { "pass" } else { "divergence" },
            "exit_code": if rep.all_pass() { 0 } else { 1 },
        });
        write_json(j, &report::to_json_bytes(&doc), a.output.force, out)?;
        super::run::wrote(j, false);
    }
    Ok(if rep.all_pass() {
        Outcome::Pass
    } else {
        Outcome::Divergence
    })
}

/// `mla-diff golden record`: the run's verdict line (the case written, or why not) and its
/// `--json`/`--report` outputs as `run` writes them.
///
/// An inconclusive run (nothing ran, or an injected fault never acted) is not recorded and is
/// the outcome, with its reason.
///
/// Errors: a bad case name or golden folder, an existing case or output file without `--force`
/// (all before the run); run errors.
pub fn cmd_golden_record(a: &GoldenRecordArgs, settings: &Settings, out: &mut dyn Write) -> Result<Outcome> {
    crate::jobs::golden::validate_case_name(&a.case)?;
    if !a.golden_dir.is_dir() {
        return Err(Error::Usage(format!(
            "{}: no such folder; run from the repository root or pass --golden-dir",
            a.golden_dir.display()
        )));
    }
    let o = &a.output;
    check_outputs(o.json.as_ref(), o.report.as_ref(), o.force)?;
    crate::core::fsio::check_output_folder(&a.golden_dir.join(&a.case))?;
    let (file, cfg, rc) = build_run(&a.spec)?;
    crate::jobs::limits::check(&crate::jobs::limits::run_need(&file, &cfg, &rc, None), a.max_memory)?;
    let backend = select_run_backend(&a.spec, settings, o.quiet)?;
    let (rep, summary) = crate::jobs::golden::record(&crate::jobs::golden::RecordRequest {
        case: &a.case,
        golden_dir: &a.golden_dir,
        model: a.spec.model.path().map(|p| p.as_path()),
        file: &file,
        cfg: &cfg,
        rc: &rc,
        backend: &backend,
        force: o.force,
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
            "{}\nnot recorded: {}\n",
            report::verdict_lines(&rep).join("\n"),
            match rep.verdict() {
                Verdict::Inconclusive => "the run judged nothing, and a golden case must be a passing run",
                _ => "the run diverges from the reference, and a golden case must be a passing run",
            }
        ),
    };
    TextSink::for_json(o.json.as_ref(), false).write(&text, out)?;
    super::run::write_report_files(
        &rep,
        &file,
        &backend,
        o.json.as_ref(),
        o.report.as_ref(),
        o.force,
        o.quiet,
        out,
    )?;
    Ok(Outcome::of(rep.verdict(), || rep.inconclusive_reason()))
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
/// not be checked (the error of a single case, or an inconclusive verdict naming how many),
/// else 1 if any differs, else 0.
pub fn cmd_golden_check(a: &GoldenCheckArgs, settings: &Settings, out: &mut dyn Write) -> Result<Outcome> {
    let dir = golden_dir(a.golden_dir.as_ref())?;
    let cases = if a.all {
        let c = crate::jobs::golden::list_cases(&dir)?;
        if c.is_empty() {
            return Err(Error::Usage(format!("{}: no golden cases", dir.display())));
        }
        c
    } else if a.case.is_empty() {
        return Err(Error::Usage(
            "golden check: name a case with --case NAME (repeatable), or check every case with --all".into(),
        ));
    } else {
        for c in &a.case {
            crate::jobs::golden::validate_case_name(c)?;
            if !dir.join(c).join(crate::jobs::golden::MANIFEST_FILE).is_file() {
                return Err(Error::Usage(format!(
                    "no case named {c} under {}/",
                    dir.display().to_string().trim_end_matches('/')
                )));
            }
        }
        a.case.clone()
    };
    let include = a.cuda_include.clone();
    let cuda = move |dtype: Dtype, k: crate::backend::cuda::ops::Kernels| {
        crate::backend::cuda::ops::CudaOps::new(dtype, include.as_deref(), settings)
            .map(|o| Backend::Cuda(o.with_kernels(k)))
    };
    let mut text = String::new();
    let (mut n_pass, mut n_fail, mut errors) = (0, 0, Vec::<Error>::new());
    for case in &cases {
        match crate::jobs::golden::check(&dir, case, &cuda, a.max_memory) {
            Ok(c) => {
                text.push_str(&crate::jobs::golden::summary(&c, a.quiet));
                if c.passed() {
                    n_pass += 1;
                } else {
                    n_fail += 1;
                }
            }
            Err(e) => {
                text.push_str(&format!("golden {case}: ERROR: {}\n", chain(&e)));
                errors.push(e);
            }
        }
    }
    text.push_str(&format!(
        "golden check: {} case(s): {n_pass} match, {n_fail} differ, {} could not be checked\n",
        cases.len(),
        errors.len()
    ));
    let several = (errors.len() > 1).then(|| {
        format!(
            "{} golden cases could not be checked (the lines marked ERROR above)",
            errors.len()
        )
    });
    if let Some(why) = &several {
        text.push_str(&format!("inconclusive: {why}\n"));
    }
    write_text(&text, "<stdout>", out)?;
    if let Some(why) = several {
        return Ok(Outcome::Inconclusive(why));
    }
    if !errors.is_empty() {
        return Err(errors.remove(0));
    }
    Ok(if n_fail == 0 {
        Outcome::Pass
    } else {
        Outcome::Divergence
    })
}

/// The checks of `bench --repeat` and `--threads` before anything runs: 1 to
/// [`MAX_REPEAT`](crate::jobs::limits::MAX_REPEAT) repetitions, 1 to
/// [`MAX_THREADS`](crate::jobs::limits::MAX_THREADS) threads per count. Returns the thread counts.
///
/// Errors: [`Error::Usage`] naming the flag and the value.
fn bench_counts(a: &BenchArgs) -> Result<Vec<usize>> {
    use crate::jobs::limits::{MAX_REPEAT, MAX_THREADS};
    if a.repeat == 0 || a.repeat > MAX_REPEAT {
        return Err(Error::Usage(format!(
            "--repeat {}: expected 1 to {MAX_REPEAT} timed repetitions",
            a.repeat
        )));
    }
    let threads = crate::jobs::bench_cpu::thread_counts(a.threads.as_deref());
    if threads.is_empty() {
        return Err(Error::Usage("--threads: give at least one thread count".into()));
    }
    if let Some(t) = threads.iter().find(|&&t| t == 0 || t > MAX_THREADS) {
        return Err(Error::Usage(format!(
            "--threads {t}: expected 1 to {MAX_THREADS} threads per count"
        )));
    }
    Ok(threads)
}

/// `mla-diff bench --dequant FILE`: the table of [`crate::jobs::bench_cpu::dequant_bench`].
fn cmd_bench_dequant(a: &BenchArgs, path: &PathBuf, out: &mut dyn Write) -> Result<Outcome> {
    refuse_overwrite(a.output.json.as_ref(), a.output.force)?;
    let threads = bench_counts(a)?;
    let file = GgufFile::open(path)?;
    crate::jobs::limits::check(
        &crate::jobs::limits::bench_dequant_need(&file, a.repeat, threads.len()),
        a.max_memory,
    )?;
    let figs = crate::jobs::bench_cpu::dequant_bench(&file, a.repeat, &threads)?;
    let mut t = crate::output::table::bordered(&[
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
    TextSink::for_json(a.output.json.as_ref(), false).write(&text, out)?;
    if let Some(j) = &a.output.json {
        let doc = serde_json::json!({"kind": "dequant", "file": path.display().to_string(), "figures": figs});
        write_json(j, &report::to_json_bytes(&doc), a.output.force, out)?;
        super::run::wrote(j, false);
    }
    Ok(Outcome::Pass)
}

/// `mla-diff bench --reference FILE`: the table of [`crate::jobs::bench_cpu::reference`].
fn cmd_bench_reference(a: &BenchArgs, path: &PathBuf, out: &mut dyn Write) -> Result<Outcome> {
    refuse_overwrite(a.output.json.as_ref(), a.output.force)?;
    // Positions 0..T: the bound `run` puts on its positions, checked before T sizes anything.
    if a.tokens > super::run::MAX_POSITION {
        return Err(Error::Usage(format!(
            "--tokens {}: positions must stay below {} (2^31)",
            a.tokens,
            super::run::MAX_POSITION
        )));
    }
    let threads = bench_counts(a)?;
    let file = crate::model::open(path)?;
    let cfg = MlaConfig::from_gguf(&file)?;
    if a.layer >= cfg.n_layer {
        return Err(Error::LayerOutOfRange {
            path: file.path().to_path_buf(),
            layer: a.layer,
            n_layers: cfg.n_layer,
        });
    }
    crate::jobs::limits::check(
        &crate::jobs::limits::bench_reference_need(&file, &cfg, a.layer, a.tokens, a.repeat, threads.len()),
        a.max_memory,
    )?;
    let b = crate::jobs::bench_cpu::reference(&file, &cfg, a.layer, a.tokens, a.repeat, &threads)?;
    let mut t = crate::output::table::bordered(&["forward", "layer", "T", "threads", "median", "runs"]);
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
    TextSink::for_json(a.output.json.as_ref(), false).write(&text, out)?;
    if let Some(j) = &a.output.json {
        let doc = serde_json::json!({"kind": "reference", "bench": b});
        write_json(j, &report::to_json_bytes(&doc), a.output.force, out)?;
        super::run::wrote(j, false);
    }
    Ok(Outcome::Pass)
}

/// `mla-diff bench`: the CPU benchmarks with `--dequant` or `--reference`, else the CUDA ones.
pub fn cmd_bench(a: &BenchArgs, settings: &Settings, out: &mut dyn Write) -> Result<Outcome> {
    if let Some(p) = &a.dequant {
        return cmd_bench_dequant(a, p, out);
    }
    if let Some(p) = &a.reference {
        return cmd_bench_reference(a, p, out);
    }
    refuse_overwrite(a.output.json.as_ref(), a.output.force)?;
    let ops = crate::backend::cuda::ops::CudaOps::new(Dtype::Bf16, a.cuda_include.as_deref(), settings)?;
    let figs = crate::jobs::bench_gpu::all(&ops, &settings.bench)?;
    let mut t = crate::output::table::bordered(&["benchmark", "shape", "median time", "figure", "note"]);
    for f in &figs {
        t.add_row(vec![
            f.name.clone(),
            f.shape.clone(),
            format!("{:.1} µs", f.micros),
            format!("{:.1} {}", f.value, f.unit),
            f.note.clone(),
        ]);
    }
    let text = format!("{}\n{t}\n", ops.device().describe());
    TextSink::for_json(a.output.json.as_ref(), false).write(&text, out)?;
    if let Some(j) = &a.output.json {
        write_json(j, &report::to_json_bytes(&figs), a.output.force, out)?;
        super::run::wrote(j, false);
    }
    Ok(Outcome::Pass)
}

/// `mla-diff inspect`.
pub fn cmd_inspect(a: &InspectArgs, out: &mut dyn Write) -> Result<Outcome> {
    let file = crate::model::fixture::open_model(a.path.as_ref().or(a.model.path()))?;
    if let Some(l) = a.layer {
        let n = MlaConfig::from_gguf(&file)?.n_layer;
        if l >= n {
            return Err(Error::LayerOutOfRange {
                path: file.path().to_path_buf(),
                layer: l,
                n_layers: n,
            });
        }
    }
    write_text(&crate::jobs::inspect::inspect(&file, a.layer), "<stdout>", out)?;
    Ok(Outcome::Pass)
}

/// `mla-diff sites`: the site vocabulary of dumps, a table or (`--json`) the JSON object.
pub fn cmd_sites(a: &SitesArgs, out: &mut dyn Write) -> Result<Outcome> {
    let v = crate::model::dump::SiteVocabulary::current();
    if a.json {
        // The JSON is the product: a closed pipe is an error, as for `--json -`.
        let bytes = crate::output::sites::sites_json(&v);
        out.write_all(&bytes).map_err(|e| Error::io("<stdout>", "write", e))?;
    } else {
        write_text(&crate::output::sites::sites_text(&v), "<stdout>", out)?;
    }
    Ok(Outcome::Pass)
}

/// The fixtures selftest uses: `dir` itself when it is a Hugging Face checkpoint folder, else
/// every `*.gguf` in `dir`; without `dir`, every `*.gguf` in `golden/models` of the current
/// directory or of this build's source tree and every Hugging Face checkpoint folder beside it
/// (`golden/hf-v3-fp8/`: the faults of an fp8 checkpoint's block scales need one); the embedded
/// fixture when none is found.
pub fn selftest_models(dir: Option<&PathBuf>) -> Result<Vec<ModelSource>> {
    if let Some(d) = dir.filter(|d| d.is_dir() && crate::model::hf::is_checkpoint(d)) {
        return Ok(vec![ModelSource::File(d.clone())]);
    }
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
        if dir.is_none()
            && let Some(golden) = d.parent()
            && let Ok(entries) = std::fs::read_dir(golden)
        {
            let mut hf: Vec<PathBuf> = entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.is_dir() && crate::model::hf::is_checkpoint(p))
                .collect();
            hf.sort();
            v.extend(hf);
        }
        if !v.is_empty() {
            return Ok(v.into_iter().map(ModelSource::File).collect());
        }
    }
    Ok(vec![ModelSource::Embedded])
}

/// `mla-diff selftest`.
pub fn cmd_selftest(a: &SelftestArgs, settings: &Settings, out: &mut dyn Write) -> Result<Outcome> {
    if a.cross_check && a.device.backend == BackendChoice::Cpu {
        return Err(Error::Usage(
            "--cross-check compares a GPU backend with the CPU; --backend cpu has nothing to compare".into(),
        ));
    }
    let models = selftest_models(a.models.as_ref())?;
    refuse_overwrite(a.output.json.as_ref(), a.output.force)?;
    let opts = SelftestOptions {
        models,
        layer: a.layer,
        quick: a.quick,
        seed: a.seed,
    };
    selftest::check_layer(&opts)?;
    let backend = select_backend(&a.device, settings, false)?;
    if a.cross_check && matches!(backend, Backend::Cpu(_)) {
        return Err(Error::Usage(
            "--cross-check needs a CUDA device to compare with the CPU; none answered (see the backend line above)"
                .into(),
        ));
    }
    let rep = selftest::run(&backend, &opts)?;
    let mut text = format!("backend {}, dtype {}\n", backend.describe(), backend.dtype());
    text.push_str(&crate::output::selftest::confusion_table(&rep));
    let mut ok = rep.all_ok();
    if a.cross_check {
        let cpu = selftest::run(&Backend::Cpu(CpuOps::new(backend.dtype())), &opts)?;
        let (summary, same) = selftest::cross_check(&rep, &cpu, "the CPU backend");
        text.push_str(&summary);
        ok &= same;
        if let Backend::Cuda(o) = &backend {
            let (summary, agree) = reference_cross_check(o, &opts)?;
            text.push_str(&summary);
            ok &= agree;
        }
        if let Backend::Cuda(o) = backend.clone().filter_fast() {
            let simple = Backend::Cuda(o.with_kernels(crate::backend::cuda::ops::Kernels::Simple));
            let srep = selftest::run(&simple, &opts)?;
            let (summary, same) = selftest::cross_check(&rep, &srep, "the simple CUDA kernels");
            text.push_str(&summary);
            ok &= same && srep.all_ok();
        }
    }
    TextSink::for_json(a.output.json.as_ref(), false).write(&text, out)?;
    if let Some(j) = &a.output.json {
        write_json(j, &report::to_json_bytes(&rep), a.output.force, out)?;
        super::run::wrote(j, false);
    }
    Ok(if ok { Outcome::Pass } else { Outcome::Divergence })
}

/// `selftest --cross-check`'s reference line: the GPU reference against the CPU reference on
/// every selftest model (every layer the GPU reference computes), the largest rel_l2 with its
/// site and model, and whether it is within [`crate::judge::tolerance::REFERENCE_AGREEMENT`].
fn reference_cross_check(o: &crate::backend::cuda::ops::CudaOps, opts: &SelftestOptions) -> Result<(String, bool)> {
    use crate::judge::tolerance::REFERENCE_AGREEMENT;
    let batch = selftest::selftest_batch(16);
    let (mut worst, mut at, mut sites) = (0f64, String::new(), 0usize);
    for m in &opts.models {
        let file = match m {
            ModelSource::File(p) => GgufFile::open(p)?,
            ModelSource::Embedded => crate::model::fixture::open_model(None)?,
        };
        let cfg = MlaConfig::from_gguf(&file)?;
        for (site, e) in selftest::reference_agreement(o, &file, &cfg, &batch, opts.seed)? {
            sites += 1;
            // A NaN rel_l2 counts as the worst.
            if e.is_nan() || e > worst {
                worst = e;
                at = format!("{site} of {}", file.path().display());
            }
        }
    }
    let ok = worst <= REFERENCE_AGREEMENT;
    let line = format!(
        "GPU reference vs CPU reference: {sites} sites, largest rel_l2 {worst:.3e}{} ({} {REFERENCE_AGREEMENT:e})\n",
        if at.is_empty() {
            String::new()
        } else {
            format!(" at {at}")
        },
        if ok { "within" } else { "ABOVE" }
    );
    Ok((line, ok))
}

/// `mla-diff kernels --compile-only`: NVRTC-compiles every module for every architecture.
pub fn cmd_kernels(a: &KernelsArgs, settings: &Settings, out: &mut dyn Write) -> Result<Outcome> {
    let m = crate::jobs::kernels::compile_all(&a.arch, a.cuda_include.as_deref(), a.out.as_deref(), &settings.device)?;
    let mut t =
        crate::output::table::bordered(&["module", "arch", "kernel", "registers", "spill stores", "spill loads"]);
    for b in &m.builds {
        if b.usage.is_empty() {
            t.add_row(vec![
                b.label.clone(),
                b.target.to_string(),
                "(no ptxas report)".into(),
                String::new(),
                String::new(),
                String::new(),
            ]);
        }
        for u in &b.usage {
            t.add_row(vec![
                b.label.clone(),
                b.target.to_string(),
                u.kernel.clone(),
                u.registers.to_string(),
                u.spill_stores.to_string(),
                u.spill_loads.to_string(),
            ]);
        }
    }
    let text = format!(
        "NVRTC {}.{}, include {}: every kernel module compiled for {}\n{t}\n",
        m.nvrtc.0,
        m.nvrtc.1,
        m.include.display(),
        a.arch.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
    );
    write_text(&text, "<stdout>", out)?;
    Ok(Outcome::Pass)
}
