//! Where a command's results go: output paths checked before any work, `-` as standard output,
//! and the width the terminal table may take.
//!
//! Every command that writes files (`--json`, `--report` and its heat map) refuses a bad path
//! before it starts, so that a long run never ends in "cannot write" with its result lost; the
//! rules (no folder given as a file, the folder must exist and take files, only a regular file
//! is replaced and only with `--force`, no two outputs on one file) live here once. `--json -` sends the document to standard output, and the
//! human text then goes to standard error so that the JSON stays parseable.
//!
//! A reader that closes the pipe early (`mla-diff run | head`) ends the human text, not the
//! command: the text is dropped from the first broken-pipe write on and the command keeps its
//! verdict and exit code, as ripgrep does. The JSON document is the product of `--json -`, so a
//! closed pipe there stays an error (exit 2).

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::core::error::{Error, Result};

/// True for the path `-`: standard output.
pub fn is_stdout(p: &Path) -> bool {
    p.as_os_str() == "-"
}

/// Refuses `path` as an output file before any work ([`crate::core::fsio::check_output`]): a
/// trailing `/` or a name longer than a file system takes, a file in a folder that does not
/// exist or takes no files (the temporary twin the write uses is created and removed there),
/// anything but a regular file at the path (a folder, device node, FIFO or symlink, even with
/// `--force`), or an existing file without `force`. `-` (standard output) is always accepted.
///
/// Errors: [`Error::Usage`] naming the file.
pub fn refuse_overwrite(path: Option<&PathBuf>, force: bool) -> Result<()> {
    match path {
        Some(p) if !is_stdout(p) => crate::core::fsio::check_output(p, force),
        _ => Ok(()),
    }
}

/// Checks the outputs of a verdict (`--json`, `--report` and the report's `<name>.svg` heat map)
/// before any work: each path as [`refuse_overwrite`] does; a report whose own path is its heat
/// map's (`--report x.svg`); `--report -` (a report is two files); and two outputs that name
/// the same file (`--json x.md --report x.md`, or `--json` on the heat map), where one would
/// silently replace the other.
///
/// Errors: [`Error::Usage`] naming the path and what to do instead.
pub fn check_outputs(json: Option<&PathBuf>, md: Option<&PathBuf>, force: bool) -> Result<()> {
    if let Some(r) = md {
        if is_stdout(r) {
            return Err(Error::Usage(
                "--report -: a report is a Markdown file with its heat map next to it; give a file path (`--json -` writes JSON to standard output)".into(),
            ));
        }
        let plot = crate::output::triage::plot_path(r);
        if same_file(r, &plot) {
            return Err(Error::Usage(format!(
                "--report {}: the report writes its heat map to {}, the same file; give the report another extension, e.g. {}",
                r.display(),
                plot.display(),
                r.with_extension("md").display()
            )));
        }
    }
    refuse_overwrite(json, force)?;
    refuse_overwrite(md, force)?;
    if let Some(r) = md {
        let plot = crate::output::triage::plot_path(r);
        refuse_overwrite(Some(&plot), force)?;
        if let Some(j) = json.filter(|j| !is_stdout(j)) {
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
pub fn same_file(a: &Path, b: &Path) -> bool {
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

/// Writes human text to `stream` (standard output or error, named in errors): a reader that has
/// closed the pipe (`EPIPE`) drops the text without an error, so the command keeps its verdict.
///
/// Errors: [`Error::Io`] for any other write failure.
pub fn write_text(text: &str, stream: &'static str, out: &mut dyn Write) -> Result<()> {
    match out.write_all(text.as_bytes()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(Error::io(stream, "write", e)),
        _ => Ok(()),
    }
}

/// Writes a JSON document to `path` (atomically, refusing an existing file unless `force`), or
/// to `out` when `path` is `-`; a closed pipe there is an error, the document being the product.
///
/// Errors: as [`crate::core::fsio::write_file_atomic`]; [`Error::Io`] writing to `out`.
pub fn write_json(path: &Path, bytes: &[u8], force: bool, out: &mut dyn Write) -> Result<()> {
    if is_stdout(path) {
        out.write_all(bytes).map_err(|e| Error::io("<stdout>", "write", e))
    } else {
        crate::core::fsio::write_file_atomic(path, bytes, force)
    }
}

/// Where the human text goes when `--json` is `json`: standard output, or standard error when
/// the JSON takes standard output (`None` then with `quiet`: the text is left out).
pub enum TextSink {
    /// The command's output stream.
    Out,
    /// Standard error.
    Err,
    /// Nowhere.
    None,
}

impl TextSink {
    /// The sink for a command whose `--json` is `json`.
    pub fn for_json(json: Option<&PathBuf>, quiet: bool) -> TextSink {
        match json {
            Some(j) if is_stdout(j) && quiet => TextSink::None,
            Some(j) if is_stdout(j) => TextSink::Err,
            _ => TextSink::Out,
        }
    }

    /// Writes `text` to the sink (`out` for [`TextSink::Out`]) with [`write_text`]: a closed
    /// pipe drops it.
    ///
    /// Errors: [`Error::Io`] writing.
    pub fn write(&self, text: &str, out: &mut dyn Write) -> Result<()> {
        match self {
            TextSink::Out => write_text(text, "<stdout>", out),
            TextSink::Err => write_text(text, "<stderr>", &mut std::io::stderr()),
            TextSink::None => Ok(()),
        }
    }

    /// The width in columns a table may take on this sink: the terminal's when the stream is a
    /// terminal and `wide` is false; `None` (the full table) otherwise, e.g. into a pipe or file.
    pub fn table_width(&self, wide: bool) -> Option<usize> {
        if wide {
            return None;
        }
        // comfy-table asks the terminal (stdout, or stderr with `use_stderr`) for its size, and
        // answers `None` when the stream is not a terminal; a terminal that reports no size
        // (0 columns) gets the full table too.
        let mut probe = comfy_table::Table::new();
        match self {
            TextSink::Out => {}
            TextSink::Err => {
                probe.use_stderr();
            }
            TextSink::None => return None,
        }
        probe.width().filter(|&w| w > 0).map(usize::from)
    }
}
