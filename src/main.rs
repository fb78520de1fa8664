//! The `mla-diff` binary: parses the command line, runs the command, maps its verdict to the exit
//! code contract (0 within tolerance, 1 divergence found, 2 inconclusive, or a usage, input or
//! internal error).

use std::io::Write;
use std::process::ExitCode;

use clap::Parser;
use mla_diff::cli::{Cli, dispatch};

fn main() -> ExitCode {
    mla_diff::core::memory::keep_freed_pages();
    // clap exits with code 2 on usage errors by itself.
    let cli = Cli::parse();
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    match dispatch(&cli, &mut out) {
        // The command has printed its verdict, an inconclusive one with its reason.
        Ok(outcome) => ExitCode::from(outcome.exit_code()),
        Err(e) => {
            // Keys, tensor names and strings come from the (possibly hostile) file: escape control
            // characters so the error stays one line and nothing reaches the terminal raw. A
            // closed stderr loses the line, not the exit code.
            let line = one_line(&mla_diff::core::error::chain(&e));
            let _ = writeln!(std::io::stderr(), "mla-diff: error: {line}");
            ExitCode::from(e.exit_code())
        }
    }
}

/// `msg` with every control character (newline, CR, ESC, NUL, …) written as a Rust escape, e.g.
/// `\n` or `\u{1b}`, so an error built from file contents prints as one inert line.
fn one_line(msg: &str) -> String {
    msg.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}
