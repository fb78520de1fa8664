//! The `mla-diff` binary: parses the command line, runs the command, maps its verdict to the exit
//! code contract (0 within tolerance, 1 divergence found, 2 inconclusive, or a usage, input or
//! internal error).

use std::io::Write;
use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches};
use mla_diff::cli::{Cli, dispatch};

fn main() -> ExitCode {
    mla_diff::core::memory::keep_freed_pages();
    let cli = match negatives_as_values(Cli::command())
        .try_get_matches()
        .and_then(|m| Cli::from_arg_matches(&m))
    {
        Ok(cli) => cli,
        Err(e) => return clap_exit(&e),
    };
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

/// `c` and every subcommand taking `-1` as a flag's value rather than as a flag, so that
/// `--seed -1` is refused naming `--seed` (an invalid value) instead of as an unknown argument.
fn negatives_as_values(c: clap::Command) -> clap::Command {
    c.mut_args(|a| {
        if a.get_action().takes_values() {
            a.allow_negative_numbers(true)
        } else {
            a
        }
    })
    .mut_subcommands(negatives_as_values)
}

/// Ends the process for a command line clap did not accept: `--help` and `--version` print as
/// clap renders them (exit 0), the bare command its help (exit 2); a usage error prints one line,
/// `mla-diff: error: <what clap says> (see `<command> --help`)`, with clap's tip when it gives one
/// (`to pass '-1' as a value, use '-- -1'`), and exits 2 like every other refusal.
fn clap_exit(e: &clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    let code = u8::try_from(e.exit_code()).unwrap_or(2);
    if matches!(
        e.kind(),
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
    ) {
        // A closed stream loses the text, not the exit code.
        let _ = e.print();
        return ExitCode::from(code);
    }
    let _ = writeln!(
        std::io::stderr(),
        "mla-diff: error: {}",
        usage_line(&e.render().to_string(), &subcommand_path())
    );
    ExitCode::from(code)
}

/// The command the process was asked to run, as far as the arguments name subcommands:
/// `mla-diff golden check` for `mla-diff golden check --case x`.
fn subcommand_path() -> String {
    let mut cmd = Cli::command();
    let mut path = vec!["mla-diff".to_string()];
    for arg in std::env::args_os().skip(1) {
        let Some(sub) = arg.to_str().and_then(|a| cmd.find_subcommand(a)).cloned() else {
            break;
        };
        path.push(sub.get_name().to_string());
        cmd = sub;
    }
    path.join(" ")
}

/// One line of clap's rendered usage error: its first line without `error: ` and its tips, then
/// the command whose `--help` to read.
///
/// The lines between the first and `Usage:` belong to the message: the arguments a "required
/// arguments were not provided:" names, one per line, and `[possible values: …]`; they are
/// joined onto it.
fn usage_line(rendered: &str, command: &str) -> String {
    let mut lines = rendered.lines().map(str::trim).filter(|l| !l.is_empty());
    let first = lines.next().unwrap_or("invalid command line");
    let mut msg = first.strip_prefix("error: ").unwrap_or(first).to_string();
    let mut tips = Vec::new();
    let mut listed = Vec::new();
    for l in lines {
        if l.starts_with("Usage:") || l.starts_with("For more information") {
            break;
        }
        match l.strip_prefix("tip: ") {
            Some(tip) => tips.push(tip),
            None => listed.push(l),
        }
    }
    if !listed.is_empty() {
        let sep = if msg.ends_with(':') { " " } else { "; " };
        msg.push_str(&format!("{sep}{}", listed.join(", ")));
    }
    for tip in tips {
        msg.push_str(&format!("; {tip}"));
    }
    one_line(&format!("{msg} (see `{command} --help`)"))
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
