//! Command-line interface: the argument schema ([`args`]) and a thin dispatch to the commands
//! ([`run`], [`commands`]), each of which calls its job in [`crate::jobs`] and prints the result.
//!
//! The binary is a thin shell over this module so that commands can be tested (and snapshotted)
//! in-process. Every command returns its verdict as an [`Outcome`] (0 = within tolerance,
//! 1 = divergence found, 2 = inconclusive) or a library [`Error`](crate::core::error::Error)
//! (exit 2), the exit-code contract of docs/design.md. Human text written to a closed standard
//! output is dropped without changing the verdict ([`outputs::write_text`]); a `--json -`
//! document that cannot be written is an error.

pub mod args;
pub mod commands;
pub mod outputs;
pub mod run;
pub mod values;

use std::io::Write;

use clap::{Parser, Subcommand};

use crate::core::error::Result;
use crate::core::settings::Settings;
use crate::judge::report::Verdict;
use args::*;
use commands::*;
use run::{cmd_compare, cmd_run};

pub use commands::selftest_models;

/// What a command concluded: its verdict, printed by the command before it returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Everything within tolerance (exit 0).
    Pass,
    /// A divergence or finding (exit 1).
    Divergence,
    /// Nothing was judged (exit 2): no requested path could run, an injected fault never acted,
    /// or golden cases could not be checked. The reason, which the command printed as its
    /// `inconclusive: …` line.
    Inconclusive(String),
}

impl Outcome {
    /// The outcome of a report's verdict; `reason` is asked only for an inconclusive one.
    pub fn of(verdict: Verdict, reason: impl FnOnce() -> Option<String>) -> Self {
        match verdict {
            Verdict::Pass => Outcome::Pass,
            Verdict::Divergence => Outcome::Divergence,
            Verdict::Inconclusive => Outcome::Inconclusive(reason().unwrap_or_else(|| "nothing was judged".into())),
        }
    }

    /// The process exit code: 0, 1 or 2 (docs/design.md, "Exit codes").
    pub fn exit_code(&self) -> u8 {
        match self {
            Outcome::Pass => 0,
            Outcome::Divergence => 1,
            Outcome::Inconclusive(_) => 2,
        }
    }
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
    /// Run the reference and the engine paths on a model (GGUF or HF checkpoint) and diff every site.
    Run(RunArgs),
    /// Show a model's metadata, derived MLA config and per-tensor types (GGUF or HF checkpoint).
    Inspect(InspectArgs),
    /// List the site names a dump may hold (stages, per-rank templates, formats), with shapes.
    Sites(SitesArgs),
    /// Inject every fault into every path of every fixture, and run every path clean: prove the
    /// detectors find each bug class at its first site and nothing on clean runs.
    Selftest(SelftestArgs),
    /// Diff an engine's dump (safetensors of our site names) against the reference on the same model.
    Compare(CompareArgs),
    /// Check an engine's weights as loaded (fused, sharded per TP rank) against the model's.
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

/// The environment variables mla-diff reads ([`Settings`]; docs/environment.md), from the
/// process environment: the one place the crate reads it.
pub fn settings_from_env() -> Settings {
    Settings::from_vars(|name| std::env::var_os(name))
}

/// Runs a parsed command line, writing human output to `out`; the environment is read once, here
/// ([`settings_from_env`]), and handed to the commands that use it.
pub fn dispatch(cli: &Cli, out: &mut dyn Write) -> Result<Outcome> {
    let s = &settings_from_env();
    match &cli.command {
        Command::Run(a) => cmd_run(a, s, out),
        Command::Inspect(a) => cmd_inspect(a, out),
        Command::Sites(a) => cmd_sites(a, out),
        Command::Selftest(a) => cmd_selftest(a, s, out),
        Command::Compare(a) => cmd_compare(a, s, out),
        Command::Weights(a) => cmd_weights(a, out),
        Command::Golden(GoldenCommand::Record(a)) => cmd_golden_record(a, s, out),
        Command::Golden(GoldenCommand::Check(a)) => cmd_golden_check(a, s, out),
        Command::Kernels(a) => cmd_kernels(a, s, out),
        Command::Bench(a) => cmd_bench(a, s, out),
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
