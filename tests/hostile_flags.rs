//! Hostile numbers on the command line and in golden manifests, through the binary: every numeric
//! flag of `run`, `bench`, `compare` and `golden check` at 0, 1, its type's maximum − 1 and
//! maximum, 2^31, 2^32, −1 and a 30-digit string, and a golden manifest's numbers at the same
//! values (plus values that wrap a sum). Each command runs under an address-space cap with a
//! deadline, and must end by itself with exit 0, 1 or 2 (no signal: no panic abort, no
//! out-of-memory abort), at a peak RSS under 2 GiB (the kernel's `ru_maxrss` from `wait4`); a
//! refusal (exit 2) is exactly one stderr line starting `mla-diff: error:` that names the flag or
//! the manifest field.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::common::repo;

/// The address space each command may map: far above the 2 GiB RSS bound (thread stacks and
/// the allocator's reservations are virtual), far below what an unchecked size would ask for.
const AS_CAP: u64 = 6 << 30;
/// The peak RSS each command must stay under.
const RSS_CAP_KB: i64 = 2 << 20;
/// Each command's deadline.
const DEADLINE: Duration = Duration::from_secs(20);

/// How one command ended.
struct Ended {
    args: String,
    code: Option<i32>,
    signal: Option<i32>,
    stderr: String,
    maxrss_kb: i64,
    timed_out: bool,
}

/// Runs the binary with `args` in `dir` under [`AS_CAP`], reaped by `wait4` for its rusage;
/// killed at [`DEADLINE`].
fn run_capped(args: &[String], dir: &Path) -> Ended {
    use std::os::unix::process::CommandExt;
    let err_file = tempfile::NamedTempFile::new().unwrap();
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_mla-diff"));
    cmd.args(args)
        .current_dir(dir)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(err_file.reopen().unwrap());
    // SAFETY: setrlimit is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            let lim = libc::rlimit {
                rlim_cur: AS_CAP,
                rlim_max: AS_CAP,
            };
            if libc::setrlimit(libc::RLIMIT_AS, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd.spawn().expect("spawn mla-diff");
    let pid = child.id() as libc::pid_t;
    let started = Instant::now();
    let mut status = 0;
    // SAFETY: an all-zero rusage is a valid value to be overwritten.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let mut timed_out = false;
    loop {
        // SAFETY: wait4 on our own child with valid out-pointers.
        let r = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut usage) };
        if r == pid {
            break;
        }
        assert!(r == 0, "wait4: {}", std::io::Error::last_os_error());
        if started.elapsed() > DEADLINE {
            timed_out = true;
            // SAFETY: signalling our own child.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    drop(child);
    let (code, signal) = if libc::WIFEXITED(status) {
        (Some(libc::WEXITSTATUS(status)), None)
    } else {
        (None, Some(libc::WTERMSIG(status)))
    };
    Ended {
        args: args.join(" "),
        code,
        signal,
        stderr: std::fs::read_to_string(err_file.path()).unwrap_or_default(),
        maxrss_kb: usage.ru_maxrss,
        timed_out,
    }
}

/// The values every numeric flag is tried at: 0, 1, the type's maximum − 1 and maximum
/// (`usize`/`u64` here), 2^31, 2^32, −1 and a number no integer type holds.
const VALUES: &[&str] = &[
    "0",
    "1",
    "18446744073709551614",
    "18446744073709551615",
    "2147483648",
    "4294967296",
    "-1",
    "999999999999999999999999999999",
];

/// One command of the corpus: its arguments and the words one of which its refusal must contain.
struct Case {
    args: Vec<String>,
    names: Vec<String>,
}

fn case(args: &[&str], names: &[&str]) -> Case {
    Case {
        args: args.iter().map(|s| s.to_string()).collect(),
        names: names.iter().map(|s| s.to_string()).collect(),
    }
}

/// The command-line corpus: each numeric flag at each of [`VALUES`].
fn flag_cases(export_dir: &Path) -> Vec<Case> {
    let model = repo().join("golden/models/tiny-v3-q4_k_m.gguf");
    let model = model.to_str().unwrap();
    let f32_model = repo().join("golden/models/tiny-v3-f32.gguf");
    let dump = repo().join("golden/dumps/tiny-v3-f32.hf.safetensors");
    let export = export_dir.to_str().unwrap();
    let run = ["run", "--backend", "cpu", "--quiet"];
    let mut v = Vec::new();
    for &x in VALUES {
        // `run`: each flag alone on the embedded model; its refusal names the flag (a layer out
        // of range names the layer; a size that fits the flags but not the memory, the flag to
        // lower).
        for (flag, extra) in [
            ("--layer", &["layer "][..]),
            ("--tokens", &[][..]),
            ("--seqs", &[][..]),
            ("--start-pos", &[][..]),
            ("--seed", &[][..]),
            ("--page-size", &[][..]),
            ("--splits", &[][..]),
            ("--tp", &[][..]),
            ("--chunk-size", &[][..]),
            ("--new-tokens", &[][..]),
            ("--max-memory", &["this run needs about"][..]),
            ("--devices", &[][..]),
        ] {
            let mut names = vec![flag];
            names.extend_from_slice(extra);
            v.push(case(&[&run[..], &[flag, x]].concat(), &names));
        }
        v.push(case(
            &[&run[..], &["--layers", &format!("0..{x}")]].concat(),
            &["--layers"],
        ));
        v.push(case(
            &[&run[..], &["--layers", &format!("{x}..=1")]].concat(),
            &["--layers"],
        ));
        v.push(case(&[&run[..], &["--seqs", &format!("3,{x}")]].concat(), &["--seqs"]));
        v.push(case(
            &[&run[..], &["--start-pos", "2147483000", "--tokens", x]].concat(),
            &["--start-pos", "--tokens"],
        ));
        v.push(case(
            &[
                &run[..],
                &["--path", "mha", "--export-inputs", export, "--force", "--rank", x],
            ]
            .concat(),
            &["--rank"],
        ));
        // `bench --reference` and `--dequant` on the committed fixture.
        for flag in ["--layer", "--tokens", "--repeat", "--threads", "--max-memory"] {
            let names: &[&str] = match flag {
                "--layer" => &["--layer", "layer "],
                "--max-memory" => &["--max-memory", "this run needs about"],
                _ => &[flag],
            };
            v.push(case(&["bench", "--reference", model, "--repeat", "1", flag, x], names));
        }
        for flag in ["--repeat", "--threads", "--max-memory"] {
            let names: &[&str] = if flag == "--max-memory" {
                &["--max-memory", "this run needs about"]
            } else {
                &[flag]
            };
            v.push(case(&["bench", "--dequant", model, flag, x], names));
        }
        // `compare` and `golden check`: --max-memory, their one numeric flag.
        v.push(case(
            &[
                "compare",
                "--dump",
                dump.to_str().unwrap(),
                "--model",
                f32_model.to_str().unwrap(),
                "--map",
                "hf",
                "--quiet",
                "--max-memory",
                x,
            ],
            &["--max-memory", "this run needs about"],
        ));
        v.push(case(
            &[
                "golden",
                "check",
                "--case",
                "embedded-default",
                "--quiet",
                "--max-memory",
                x,
            ],
            &["--max-memory", "this run needs about"],
        ));
    }
    v
}

/// Checks one ending: no signal, no deadline, exit 0/1/2, RSS under the cap, and a refusal of
/// one line naming one of `names`. Returns a description of what is wrong, if anything.
fn judge(e: &Ended, names: &[String]) -> Option<String> {
    let what = &e.args;
    if e.timed_out {
        return Some(format!("{what}: still running after {DEADLINE:?}"));
    }
    if let Some(s) = e.signal {
        return Some(format!("{what}: killed by signal {s}: {}", e.stderr));
    }
    if e.maxrss_kb > RSS_CAP_KB {
        return Some(format!("{what}: peak RSS {} KiB", e.maxrss_kb));
    }
    if e.stderr.contains("panicked") {
        return Some(format!("{what}: panicked: {}", e.stderr));
    }
    match e.code {
        Some(0 | 1) => None,
        Some(2) => {
            let lines: Vec<&str> = e.stderr.lines().collect();
            if lines.len() != 1 || !lines[0].starts_with("mla-diff: error: ") {
                Some(format!(
                    "{what}: refusal is not one `mla-diff: error:` line: {:?}",
                    e.stderr
                ))
            } else if !names.iter().any(|n| lines[0].contains(n.as_str())) {
                Some(format!("{what}: refusal names none of {names:?}: {}", lines[0]))
            } else {
                None
            }
        }
        c => Some(format!("{what}: exit {c:?}: {}", e.stderr)),
    }
}

/// Runs `cases` on two workers; returns the endings in order.
fn run_all(cases: &[(Vec<String>, PathBuf)]) -> Vec<Ended> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let out = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some((args, dir)) = cases.get(i) else { break };
                    let e = run_capped(args, dir);
                    out.lock().unwrap().push((i, e));
                }
            });
        }
    });
    let mut v = out.into_inner().unwrap();
    v.sort_by_key(|(i, _)| *i);
    v.into_iter().map(|(_, e)| e).collect()
}

/// A golden manifest edit: the field as a refusal names it, and the JSON pointer it sets.
fn manifest_cases() -> Vec<(String, &'static str, serde_json::Value)> {
    let fields: &[(&str, &str)] = &[
        ("/run/batch/seqs/0/len", "run.batch.seqs[0]"),
        ("/run/batch/seqs/1/start_pos", "run.batch.seqs[1]"),
        ("/run/layers/0", "run.layers[0]"),
        ("/run/path_options/page_size", "run.path_options.page_size"),
        ("/run/path_options/num_splits", "run.path_options.num_splits"),
        ("/run/path_options/tp", "run.path_options.tp"),
        ("/run/path_options/chunk_size", "run.path_options.chunk_size"),
        ("/run/path_options/new_tokens", "run.path_options.new_tokens"),
        ("/run/seed", "run.seed"),
    ];
    let mut v = Vec::new();
    for &(ptr, field) in fields {
        for x in [
            serde_json::json!(0),
            serde_json::json!(1),
            serde_json::json!(u64::MAX - 1),
            serde_json::json!(u64::MAX),
            serde_json::json!(1u64 << 31),
            serde_json::json!(1u64 << 32),
            serde_json::json!(-1),
            serde_json::json!(1e30),
        ] {
            v.push((ptr.to_string(), field, x));
        }
    }
    // Two sequences whose lengths wrap a 64-bit sum, and a page size × pages product past 2^64.
    v.push((
        "/run/batch/seqs/1/len".into(),
        "run.batch.seqs[1]",
        serde_json::json!(u64::MAX - 2),
    ));
    v.push((
        "/run/path_options/page_size".into(),
        "run.path_options.page_size",
        serde_json::json!(65536),
    ));
    v
}

#[test]
fn hostile_numbers_end_in_one_line_refusals_in_bounded_memory_and_time() {
    let started = Instant::now();
    let scratch = tempfile::tempdir().unwrap();
    let export = scratch.path().join("export");
    let mut cases: Vec<(Vec<String>, PathBuf, Vec<String>)> = flag_cases(&export)
        .into_iter()
        .map(|c| (c.args, repo(), c.names))
        .collect();
    // The golden manifests: one copy of the embedded default case per edit.
    let src = repo().join("golden/embedded-default");
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(src.join("manifest.json")).unwrap()).unwrap();
    let n_flags = cases.len();
    for (i, (ptr, field, x)) in manifest_cases().into_iter().enumerate() {
        let g = scratch.path().join(format!("g{i}"));
        let dir = g.join("embedded-default");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(src.join("trace.safetensors"), dir.join("trace.safetensors")).unwrap();
        let mut m = manifest.clone();
        *m.pointer_mut(&ptr).unwrap_or_else(|| panic!("{ptr}")) = x.clone();
        std::fs::write(dir.join("manifest.json"), serde_json::to_vec(&m).unwrap()).unwrap();
        let args = [
            "golden",
            "check",
            "--case",
            "embedded-default",
            "--quiet",
            "--golden-dir",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([g.to_str().unwrap().to_string()])
        .collect();
        // A value serde cannot read as the field's type is named by its line and column, and a
        // legal value the golden trace does not match (another layer) names the manifest.
        cases.push((args, repo(), vec![field.to_string(), "manifest.json".to_string()]));
    }
    let runs: Vec<(Vec<String>, PathBuf)> = cases.iter().map(|(a, d, _)| (a.clone(), d.clone())).collect();
    let ended = run_all(&runs);
    let problems: Vec<String> = ended
        .iter()
        .zip(&cases)
        .filter_map(|(e, (_, _, names))| judge(e, names))
        .collect();
    let refused = ended.iter().filter(|e| e.code == Some(2)).count();
    let peak = ended.iter().map(|e| e.maxrss_kb).max().unwrap_or(0);
    eprintln!(
        "hostile flags: {} commands ({n_flags} command lines, {} manifests), {refused} refused, peak RSS {peak} KiB, {:.1} s",
        ended.len(),
        ended.len() - n_flags,
        started.elapsed().as_secs_f64()
    );
    assert!(
        problems.is_empty(),
        "{} problem(s):\n{}",
        problems.len(),
        problems.join("\n")
    );
    assert_eq!((n_flags, ended.len() - n_flags), (8 * 27, 9 * 8 + 2));
    // Every value past the bounds is refused: most of the corpus.
    assert!(refused > ended.len() / 2, "{refused} of {}", ended.len());
}

/// The refusals that name a specific flag, value by value: the flag a user must change, never
/// another one.
#[test]
fn a_refusal_names_the_flag_at_fault() {
    let cases: &[(&[&str], &str)] = &[
        (
            &["run", "--tokens", "4294967296"],
            "--tokens 4294967296: positions must stay below",
        ),
        (
            &["run", "--start-pos", "4294967296"],
            "--start-pos 4294967296: positions must stay below",
        ),
        (
            &["run", "--start-pos", "2147483000", "--tokens", "1000"],
            "--start-pos 2147483000 + --tokens 1000: positions must stay below",
        ),
        (&["run", "--seed", "-1"], "invalid value '-1' for '--seed <SEED>'"),
        (&["run", "--chunk-size", "0"], "--chunk-size must be at least 1"),
        (&["run", "--splits", "0"], "--splits must be at least 1"),
        (
            &["bench", "--dequant", "x.gguf", "--repeat", "18446744073709551615"],
            "--repeat 18446744073709551615: expected 1 to 1000000",
        ),
        (
            &["bench", "--dequant", "x.gguf", "--threads", "1,4096"],
            "--threads 4096: expected 1 to 1024",
        ),
        (
            &["run", "--bogus"],
            "unexpected argument '--bogus' found (see `mla-diff run --help`)",
        ),
        (
            &["golden", "check", "--nope"],
            "unexpected argument '--nope' found (see `mla-diff golden check --help`)",
        ),
        // what clap lists under its first line belongs to the one line
        (
            &["compare"],
            "the following required arguments were not provided: --dump <DUMP> (see `mla-diff compare --help`)",
        ),
        (
            &["run", "--path", "xyz"],
            "invalid value 'xyz' for '--path <PATH>'; [possible values: ",
        ),
    ];
    for (args, want) in cases {
        let (code, _, err) = crate::common::run_bin(args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(
            err.starts_with("mla-diff: error: ") && err.contains(want),
            "{args:?}: {err}"
        );
    }
    // --help and --version are not errors.
    let (code, out, _) = crate::common::run_bin(&["--version"]);
    assert_eq!(code, 0);
    assert!(out.starts_with("mla-diff "), "{out}");
    let (code, out, _) = crate::common::run_bin(&["run", "--help"]);
    assert_eq!(code, 0);
    assert!(out.contains("Usage: mla-diff run"), "{out}");
}

/// The memory estimate bounds a run's size by every dimension that allocates: page size ×
/// pages and splits grow the estimate, and --max-memory refuses before any work with the sizes.
#[test]
fn page_size_and_splits_count_in_the_memory_estimate() {
    let estimate = |extra: &[&str]| {
        let mut a = vec!["run", "--backend", "cpu", "--quiet", "--max-memory", "1K"];
        a.extend_from_slice(extra);
        let (code, _, err) = crate::common::run_bin(&a);
        assert_eq!(code, 2, "{err}");
        assert!(err.contains("and the limit is 1.0 KiB (--max-memory)"), "{err}");
        let mib = |s: &str| -> f64 {
            let at = s.find("needs about ").unwrap() + "needs about ".len();
            let mut it = s[at..].split_whitespace();
            let v: f64 = it.next().unwrap().parse().unwrap();
            match it.next().unwrap() {
                "GiB" => v * 1024.0,
                _ => v,
            }
        };
        (mib(&err), err)
    };
    let (base, err) = estimate(&[]);
    assert!(err.contains("T=19, page size 16, splits 4"), "{err}");
    // 20 one-token sequences of 65536-token pages: 21 pages · 65536 · (L+R = 112) f32, twice.
    let (paged, err) = estimate(&[
        "--seqs",
        "1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1",
        "--page-size",
        "65536",
    ]);
    assert!(err.contains("page size 65536"), "{err}");
    assert!(
        paged - base > 1.25 * 21.0 * 65536.0 * 112.0 * 8.0 / 1048576.0 * 0.99,
        "{base} {paged}"
    );
    // 4096 splits: 4096 · 19 rows · N=6 · (L+1 = 97) f32 partials, twice.
    let (split, _) = estimate(&["--splits", "4096"]);
    assert!(
        split - base > 1.25 * 2.0 * 4096.0 * 19.0 * 6.0 * 97.0 * 4.0 / 1048576.0 * 0.99,
        "{base} {split}"
    );
    // mha alone has no paged cache: the page size does not count.
    let (mha, _) = estimate(&["--path", "mha", "--page-size", "65536"]);
    let (mha16, _) = estimate(&["--path", "mha"]);
    assert_eq!(mha, mha16);
}
