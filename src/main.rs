//! The `mla-diff` binary: parses the command line, runs the command, maps the outcome to the exit
//! code contract (0 within tolerance, 1 divergence found, 2 usage or input error).

use std::process::ExitCode;

use clap::Parser;
use mla_diff::cli::{Cli, Outcome, dispatch};

fn main() -> ExitCode {
    // clap exits with code 2 on usage errors by itself.
    let cli = Cli::parse();
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    match dispatch(&cli, &mut out).map_err(anyhow::Error::from) {
        Ok(Outcome::Pass) => ExitCode::SUCCESS,
        Ok(Outcome::Divergence) => ExitCode::from(1),
        Err(e) => {
            eprintln!("mla-diff: error: {e:#}");
            ExitCode::from(2)
        }
    }
}
