//! The `mla-diff` binary: parses the command line, runs the command, maps the outcome to the exit
//! code contract (0 within tolerance, 1 divergence found, 2 usage, input or internal error).

use std::process::ExitCode;

use clap::Parser;
use mla_diff::cli::{Cli, Outcome, dispatch};

fn main() -> ExitCode {
    mla_diff::core::memory::keep_freed_pages();
    // clap exits with code 2 on usage errors by itself.
    let cli = Cli::parse();
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    match dispatch(&cli, &mut out) {
        Ok(Outcome::Pass) => ExitCode::SUCCESS,
        Ok(Outcome::Divergence) => ExitCode::from(1),
        Err(e) => {
            let code = e.exit_code();
            let e = anyhow::Error::from(e);
            // Keys, tensor names and strings come from the (possibly hostile) file: escape control
            // characters so the error stays one line and nothing reaches the terminal raw.
            eprintln!("mla-diff: error: {}", one_line(&format!("{e:#}")));
            ExitCode::from(code)
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
