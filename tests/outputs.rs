//! Where results go and which arguments are refused before any work: output paths in folders
//! that do not exist, a report named like its own heat map, `--json -` on standard output, the
//! flags every command shares (`-q`, `inspect --model`, `golden record`'s output flags), `golden
//! check` without a case, `selftest --layer` and `--new-tokens` out of range, and tables fitted
//! to the terminal.

use std::path::Path;

use crate::common::{repo, run_bin};

/// Runs the binary in `dir`; returns (exit code, stdout, stderr).
fn run_in(dir: &Path, args: &[&str]) -> (i32, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mla-diff"))
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run mla-diff");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A run of layer 1 of the embedded fixture on every path (two sequences, 3 and 6 tokens).
pub fn embedded_report(faults: Vec<mla_diff::compute::faults::Fault>, tp: usize) -> mla_diff::judge::report::RunReport {
    use mla_diff::backend::{Backend, cpu::CpuOps};
    let file = mla_diff::model::fixture::open_model(None).unwrap();
    let cfg = mla_diff::model::config::MlaConfig::from_gguf(&file).unwrap();
    let rc = mla_diff::judge::report::RunConfig {
        layers: vec![1],
        batch: mla_diff::core::batch::Batch {
            seqs: [3, 6]
                .iter()
                .map(|&len| mla_diff::core::batch::SeqSpec { len, start_pos: 0 })
                .collect(),
        },
        path_options: mla_diff::compute::path::PathOptions {
            tp,
            new_tokens: 2,
            faults: mla_diff::compute::faults::FaultSet(faults),
            ..Default::default()
        },
        ..Default::default()
    };
    let backend = Backend::Cpu(CpuOps::new(mla_diff::core::dtype::Dtype::F32));
    mla_diff::jobs::run::run(&backend, &file, &cfg, &rc).unwrap()
}

fn files_in(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// An output in a folder that does not exist is refused before the run, naming the file the user
/// gave (the report's Markdown, not its heat map): the run below would otherwise end inconclusive
/// (its fault has nothing to act on) after all its work.
#[test]
fn an_output_in_a_missing_folder_is_refused_before_the_run() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("no-such-folder");
    let json = missing.join("r.json");
    let base = ["run", "--layer", "1", "--inject", "unwritten-rows"];
    let (code, out, err) = run_bin(&[&base[..], &["--json", json.to_str().unwrap()]].concat());
    assert_eq!(code, 2, "{out}{err}");
    assert!(out.is_empty(), "nothing may run: {out}");
    assert!(
        err.contains(&format!(
            "{}: the folder {} does not exist",
            json.display(),
            missing.display()
        )),
        "{err}"
    );
    assert!(!err.contains("did not act"), "refused after the run: {err}");

    let md = missing.join("x.md");
    let (code, out, err) = run_bin(&[&base[..], &["--report", md.to_str().unwrap()]].concat());
    assert_eq!(code, 2, "{out}{err}");
    assert!(out.is_empty(), "{out}");
    assert!(err.contains("x.md: the folder"), "{err}");
    assert!(!err.contains("x.svg"), "{err}");
    // A file where the folder should be is named as such.
    let file = tmp.path().join("plain");
    std::fs::write(&file, "x").unwrap();
    let (code, _, err) = run_bin(&["run", "--json", file.join("r.json").to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("is not a folder"), "{err}");
    assert_eq!(files_in(tmp.path()), vec!["plain"]);
}

/// When a file cannot be written after the run, the verdict is on screen first. The folder passes
/// the check before the run (an empty file can be created there); a file-size limit of 1 KiB
/// (`RLIMIT_FSIZE`, with `SIGXFSZ` ignored so the write fails with `EFBIG`) makes the JSON itself
/// fail. Nothing is left at the path or beside it.
#[test]
fn the_verdict_is_printed_before_the_files_are_written() {
    use std::os::unix::process::CommandExt;
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("r.json");
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_mla-diff"));
    cmd.args(["run", "--layer", "1", "--json", json.to_str().unwrap()]);
    // SAFETY: setrlimit and signal are async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            let lim = libc::rlimit {
                rlim_cur: 1024,
                rlim_max: 1024,
            };
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            if libc::setrlimit(libc::RLIMIT_FSIZE, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let o = cmd.output().unwrap();
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert_eq!(o.status.code(), Some(2), "{out}{err}");
    assert!(out.contains("mha: all"), "{out}");
    let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("mla-diff: error:")).collect();
    assert_eq!(errors.len(), 1, "{err}");
    assert!(errors[0].contains("r.json: write: File too large"), "{err}");
    assert!(files_in(tmp.path()).is_empty(), "{:?}", files_in(tmp.path()));
}

/// `--report x.svg` names the file its own heat map goes to: refused with and without --force,
/// nothing written.
#[test]
fn a_report_named_like_its_heat_map_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let svg = tmp.path().join("x.svg");
    for force in [false, true] {
        let mut args = vec!["run", "--layer", "1", "--report", svg.to_str().unwrap()];
        if force {
            args.push("--force");
        }
        let (code, out, err) = run_bin(&args);
        assert_eq!(code, 2, "{out}{err}");
        assert!(
            err.contains("the report writes its heat map to") && err.contains("x.md"),
            "{err}"
        );
        assert!(files_in(tmp.path()).is_empty(), "{:?}", files_in(tmp.path()));
    }
    let (code, _, err) = run_bin(&["run", "--report", "-"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--report -"), "{err}");
}

/// `--json -` is standard output: the document alone there, the tables on stderr (nothing with
/// `-q`), and no file named `-`.
#[test]
fn json_dash_is_standard_output() {
    let tmp = tempfile::tempdir().unwrap();
    let (code, out, err) = run_in(tmp.path(), &["run", "--layer", "1", "--path", "mha", "--json", "-"]);
    assert_eq!(code, 0, "{err}");
    let doc: serde_json::Value = serde_json::from_str(&out).expect("stdout is one JSON document");
    assert_eq!(doc["verdict"], "pass");
    assert_eq!(doc["exit_code"], 0);
    assert!(err.contains("== layer 1 · path mha =="), "{err}");
    assert!(err.contains("mha: all"), "{err}");
    assert!(files_in(tmp.path()).is_empty(), "{:?}", files_in(tmp.path()));

    let (code, out, err) = run_in(
        tmp.path(),
        &["run", "--layer", "1", "--path", "mha", "--json", "-", "-q"],
    );
    assert_eq!(code, 0, "{err}");
    let doc: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(doc["path_status"]["mha"], "pass");
    assert!(!err.contains("mha:"), "{err}");
    assert!(files_in(tmp.path()).is_empty());

    // The other commands' --json too.
    let (code, out, err) = run_in(
        tmp.path(),
        &[
            "bench",
            "--reference",
            repo().join("golden/models/tiny-v3-q8_0.gguf").to_str().unwrap(),
            "--tokens",
            "4",
            "--repeat",
            "1",
            "--threads",
            "1",
            "--json",
            "-",
        ],
    );
    assert_eq!(code, 0, "{err}");
    let doc: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(doc["kind"], "reference");
    assert!(err.contains("median"), "{err}");
    assert!(files_in(tmp.path()).is_empty());
}

/// `-q` is `--quiet`; `inspect` takes `--model` like every command (and its positional path);
/// `golden record` takes `run`'s output flags.
#[test]
fn shared_flags_are_accepted_everywhere() {
    let (code, out, err) = run_bin(&["run", "--layer", "1", "-q"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.lines().all(|l| !l.starts_with("== layer")), "{out}");
    assert!(out.contains("mha: all"), "{out}");

    let m = repo().join("golden/models/tiny-v3-q8_0.gguf");
    let m = m.to_str().unwrap();
    let (c1, positional, e1) = run_bin(&["inspect", m, "--layer", "1"]);
    let (c2, flag, e2) = run_bin(&["inspect", "--model", m, "--layer", "1"]);
    assert_eq!((c1, c2), (0, 0), "{e1}{e2}");
    assert_eq!(positional, flag);
    assert!(flag.contains("tiny-v3-q8_0.gguf"), "{flag}");
    let (code, _, err) = run_bin(&["inspect", m, "--model", m]);
    assert_eq!(code, 2, "{err}");

    let tmp = tempfile::tempdir().unwrap();
    let g = tmp.path().join("golden");
    std::fs::create_dir(&g).unwrap();
    let json = tmp.path().join("rec.json");
    let args = [
        "golden",
        "record",
        "--case",
        "c",
        "--golden-dir",
        g.to_str().unwrap(),
        "--layer",
        "1",
        "--seqs",
        "2,5",
        "--new-tokens",
        "2",
        "--backend",
        "cpu",
        "-q",
        "--json",
        json.to_str().unwrap(),
    ];
    let (code, out, err) = run_bin(&args);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.starts_with("recorded golden case `c`"), "{out}");
    assert!(!err.contains("backend cpu"), "--quiet: {err}");
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(doc["verdict"], "pass");
    // The JSON exists now: without --force the record is refused before running.
    let (code, _, err) = run_bin(&args);
    assert_eq!(code, 2);
    assert!(err.contains("rec.json exists"), "{err}");
}

/// `golden check` without a case suggests `--all`; a missing case is one line naming it.
#[test]
fn golden_check_names_what_is_missing() {
    let (code, out, err) = run_bin(&["golden", "check"]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(err.contains("--all"), "{err}");
    let tmp = tempfile::tempdir().unwrap();
    let (code, out, err) = run_in(&repo(), &["golden", "check", "--case", "nope"]);
    assert_eq!(code, 2, "{out}{err}");
    assert_eq!(err.trim(), "mla-diff: error: no case named nope under golden/");
    assert!(out.is_empty(), "{out}");
    let g = tmp.path().join("g");
    std::fs::create_dir(&g).unwrap();
    let (code, _, err) = run_bin(&["golden", "check", "--case", "nope", "--golden-dir", g.to_str().unwrap()]);
    assert_eq!(code, 2);
    assert_eq!(err.matches("nope").count(), 1, "{err}");
    assert!(
        err.contains(&format!("no case named nope under {}/", g.display())),
        "{err}"
    );
}

/// `selftest --layer` past a fixture's last layer is refused before the work, as `run` refuses.
#[test]
fn selftest_refuses_a_layer_a_fixture_lacks() {
    let (code, out, err) = run_bin(&["selftest", "--layer", "5", "--quick", "--backend", "cpu"]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(err.contains("layer 5 out of range"), "{err}");
    assert!(out.is_empty(), "{out}");
}

/// `--new-tokens` that leaves every sequence without context is refused; the run line shows it.
#[test]
fn new_tokens_must_leave_the_chunked_path_some_context() {
    let (code, out, err) = run_bin(&["run", "--new-tokens", "50"]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(
        err.contains("--new-tokens 50: no sequence is longer (the longest has 19 tokens)"),
        "{err}"
    );
    let (code, _, err) = run_bin(&["run", "--path", "chunked", "--tokens", "5"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--new-tokens 5"), "{err}");
    // Without chunked, or with context left, it runs; the header names the new tokens.
    let (code, out, err) = run_bin(&["run", "--new-tokens", "50", "--path", "mha"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("chunk 8, new tokens 50"), "{out}");
    let (code, out, err) = run_bin(&["run", "--new-tokens", "18", "--path", "chunked"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("new tokens 18"), "{out}");
}

/// Tables fit a narrow terminal (columns left out, then cells wrapped, and a line saying so),
/// and keep every column into a pipe, in `--wide` and in files.
#[test]
fn tables_fit_the_terminal_and_keep_every_column_elsewhere() {
    use mla_diff::output::report::{terminal, terminal_fit};
    let rep = embedded_report(vec![mla_diff::compute::faults::Fault::PhantomOutput], 1);
    let full = terminal(&rep);
    let widest = |s: &str| {
        s.lines()
            .filter(|l| l.starts_with('│') || l.starts_with('┌'))
            .map(|l| l.chars().count())
            .max()
            .unwrap()
    };
    assert!(widest(&full) > 120, "{}", widest(&full));
    assert!(full.contains("max |Δ| at [idx]") && !full.contains("tables fitted"));
    for w in [80usize, 60, 40] {
        let fit = terminal_fit(&rep, Some(w));
        assert!(widest(&fit) <= w, "{w}: {}\n{fit}", widest(&fit));
        assert!(
            fit.contains(&format!(
                "(tables fitted to {w} columns, without: max |Δ| at [idx] (ref → cand)"
            )),
            "{fit}"
        );
        assert!(fit.contains("│ L1.hidden_in "), "site names stay whole: {fit}");
        assert!(fit.contains("mha: first divergence at L1.attn_out"), "{fit}");
        if w >= 60 {
            assert!(fit.contains("◀ first"), "{fit}");
        }
    }
    assert_eq!(terminal_fit(&rep, Some(400)), full);
    // Into a pipe (tests capture stdout), every column.
    let (code, out, _) = run_bin(&["run", "--layer", "1", "--path", "mha"]);
    assert_eq!(code, 0);
    assert!(out.contains("max |Δ| at [idx] (ref → cand)"), "{out}");
    let (code, wide, _) = run_bin(&["run", "--layer", "1", "--path", "mha", "--wide"]);
    assert_eq!(code, 0);
    assert_eq!(wide, out);
}

/// Output paths that name no writable regular file are refused before the run, in one line:
/// a folder that takes no files (`/proc`), a trailing `/`, and with `--force` a symlink or FIFO
/// (the rename would replace the entry itself; the symlink's target is left as it was). A legal
/// 250-byte name is written: its temporary twin is short whatever the name.
#[test]
fn output_paths_are_checked_for_what_the_write_needs() {
    let d = tempfile::tempdir().unwrap();
    let target = d.path().join("target.json");
    std::fs::write(&target, b"keep").unwrap();
    let link = d.path().join("link.json");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let fifo = d.path().join("fifo.json");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo reads a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let slash = format!("{}/", d.path().join("out.json").display());
    let cases: Vec<(String, String)> = vec![
        (
            "/proc/out.json".into(),
            "/proc/out.json: cannot create a file in /proc (".into(),
        ),
        (slash.clone(), format!("{slash}: ends with `/`")),
        (
            link.display().to_string(),
            format!(
                "{}: not a regular file (a symbolic link); --force replaces only regular files",
                link.display()
            ),
        ),
        (
            fifo.display().to_string(),
            format!(
                "{}: not a regular file (a FIFO); --force replaces only regular files",
                fifo.display()
            ),
        ),
    ];
    for (path, want) in &cases {
        for flag in ["--json", "--report"] {
            let started = std::time::Instant::now();
            let (code, out, err) = run_bin(&["run", "--quiet", "--path", "mha", flag, path, "--force"]);
            assert_eq!(code, 2, "{flag} {path}: {out}\n{err}");
            assert_eq!(err.lines().count(), 1, "{err}");
            assert!(
                err.starts_with("mla-diff: error: ") && err.contains(want.as_str()),
                "{flag} {path}: {err}"
            );
            assert!(out.is_empty(), "{flag} {path}: the run ran: {out}");
            assert!(started.elapsed().as_secs_f64() < 5.0);
        }
    }
    assert_eq!(std::fs::read(&target).unwrap(), b"keep");
    assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
    // A 250-byte name (its old twin `.<name>.tmp-<pid>` was past 255 bytes) is written.
    let long = d.path().join(format!("{}.json", "z".repeat(245)));
    let (code, out, err) = run_bin(&["run", "--quiet", "--path", "mha", "--json", long.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}\n{err}");
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&long).unwrap()).unwrap();
    assert_eq!(doc["verdict"], "pass");
    // Nothing is left beside the outputs: no twin.
    let mut names = files_in(d.path());
    names.retain(|n| n.starts_with('.'));
    assert!(names.is_empty(), "{names:?}");
}
