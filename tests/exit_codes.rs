//! The exit-code contract when the reader of standard output has gone (`mla-diff run | head`):
//! the human text stops quietly and the verdict keeps its code (0, 1, 2 for inconclusive), while
//! a `--json -` document that cannot be written is an error (exit 2). Each run below gets a pipe
//! whose read end is closed before the binary starts, so every write to stdout fails with EPIPE;
//! the same run on an open pipe shows that it does write to stdout.

use std::process::{Command, Stdio};

use crate::common::repo;

/// Runs the binary with `args`, standard output on a pipe that nobody reads (its read end closed
/// before the spawn); returns (exit code, stderr).
fn run_into_closed_pipe(args: &[&str]) -> (i32, String) {
    let (reader, writer) = std::io::pipe().expect("pipe");
    drop(reader);
    let out = Command::new(env!("CARGO_BIN_EXE_mla-diff"))
        .args(args)
        .stdout(Stdio::from(writer))
        .output()
        .expect("run mla-diff");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs `args` on an open pipe and into a closed one; checks that the first wrote to stdout (so
/// the second met EPIPE) and exited `open_code`, and that the second exited `closed_code`;
/// returns the second's stderr.
fn closed_pipe_exit(args: &[&str], open_code: i32, closed_code: i32) -> String {
    let open = Command::new(env!("CARGO_BIN_EXE_mla-diff"))
        .args(args)
        .output()
        .expect("run mla-diff");
    assert_eq!(open.status.code(), Some(open_code), "{args:?} on an open pipe");
    assert!(open.stdout.len() > 1000, "{args:?} writes to stdout: {open:?}");
    let (got, err) = run_into_closed_pipe(args);
    assert_eq!(got, closed_code, "{args:?} into a closed pipe: {err}");
    assert!(!err.contains("panicked"), "{args:?}: {err}");
    err
}

#[test]
fn a_closed_stdout_keeps_the_verdicts_exit_code() {
    let err = closed_pipe_exit(&["run", "--layer", "1"], 0, 0);
    assert!(!err.contains("error"), "{err}");
    let err = closed_pipe_exit(&["run", "--layer", "1", "--inject", "fused-shard-swap"], 1, 1);
    assert!(!err.contains("error"), "{err}");
    let m = repo().join("golden/models/moe-v3-q8_0.gguf");
    let err = closed_pipe_exit(&["run", "--model", m.to_str().unwrap(), "--tp", "2"], 2, 2);
    assert!(!err.contains("error"), "{err}");
}

/// `--json -` makes the JSON document the product: a reader gone before it is written is the
/// one-line write error, exit 2, where the open pipe gets the document and the pass (exit 0).
#[test]
fn a_closed_stdout_under_json_dash_is_an_error() {
    let err = closed_pipe_exit(&["run", "--layer", "1", "--json", "-"], 0, 2);
    // The human text went to stderr; the error is the one line after it.
    let errors: Vec<&str> = err.lines().filter(|l| l.contains("error")).collect();
    assert_eq!(errors.len(), 1, "{err}");
    assert_eq!(err.lines().last(), Some(errors[0]), "{err}");
    assert!(errors[0].starts_with("mla-diff: error: <stdout>: write: "), "{err}");
    assert!(errors[0].contains("os error 32"), "EPIPE: {err}");
}

/// With the text dropped, the rest of the command still happens: the `--json FILE` document is
/// written whole.
#[test]
fn a_closed_stdout_does_not_stop_the_json_file() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("r.json");
    let (code, err) = run_into_closed_pipe(&["run", "--layer", "1", "--json", json.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(doc["verdict"], "pass");
    assert_eq!(doc["exit_code"], 0);
}
