//! Atomic file writes that never replace a user's file without `--force`.
//!
//! Every job that writes a file (JSON, reports, goldens, heat maps) goes through here, so the
//! rule "write to a temporary name in the same folder, then rename; refuse an existing file unless
//! forced" is written once.

use std::io::Write;
use std::path::Path;

use crate::core::error::{Error, Result};

/// Writes `bytes` to `path` through a temporary file in the same folder and a rename, refusing
/// to replace an existing file unless `force`.
///
/// Errors: [`Error::Usage`] when `path` is a folder, or when the file exists and `force` is
/// false; [`Error::Io`] otherwise.
pub fn write_file_atomic(path: &Path, bytes: &[u8], force: bool) -> Result<()> {
    refuse_existing(path, force)?;
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "out".into());
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    // Errors name the file the user asked for; the temporary name is an implementation detail.
    let res = (|| {
        let mut f = std::fs::File::create(&tmp).map_err(|e| Error::io(path, "create", e))?;
        f.write_all(bytes).map_err(|e| Error::io(path, "write", e))?;
        f.sync_all().map_err(|e| Error::io(path, "sync", e))?;
        std::fs::rename(&tmp, path).map_err(|e| Error::io(path, "rename", e))
    })();
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res
}

/// The check [`write_file_atomic`] makes first, for refusing before any work: `path` must not
/// be a folder, its folder must exist, and it must not exist unless `force`.
///
/// Errors: [`Error::Usage`] naming the file.
pub fn refuse_existing(path: &Path, force: bool) -> Result<()> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty());
    if let Some(d) = dir.filter(|d| !d.is_dir()) {
        return Err(Error::Usage(format!(
            "{}: the folder {} {}; create it first or give another path",
            path.display(),
            d.display(),
            if d.exists() {
                "is not a folder"
            } else {
                "does not exist"
            }
        )));
    }
    if path.is_dir() {
        return Err(Error::Usage(format!(
            "{} is a folder; give a file path",
            path.display()
        )));
    }
    if path.exists() && !force {
        return Err(Error::Usage(format!(
            "{} exists; pass --force to overwrite it",
            path.display()
        )));
    }
    Ok(())
}

/// What a path that is not a regular file is, in words (`a character device`, `a FIFO`, …).
fn special_kind(meta: &std::fs::Metadata) -> &'static str {
    let ft = meta.file_type();
    if ft.is_dir() {
        return "a directory";
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if ft.is_char_device() {
            return "a character device";
        }
        if ft.is_block_device() {
            return "a block device";
        }
        if ft.is_fifo() {
            return "a FIFO";
        }
        if ft.is_socket() {
            return "a socket";
        }
    }
    "not a file"
}

/// Opens the input file `path` for reading, refusing before any read (and before `open`, which
/// blocks on a FIFO) anything that is not a regular file: a device such as `/dev/zero` has no
/// end and a FIFO no length, so reading either would grow memory until the process dies. Every
/// input a command reads (a dump, a map, a GGUF model, a manifest, a weights file) is opened
/// here. Returns the file and its length in bytes (from the open file's metadata).
///
/// Errors: [`Error::Usage`] `FILE: not a regular file (a character device)` (exit 2) for a
/// directory, device, FIFO or socket; [`Error::Io`] when the file cannot be opened or stat'ed.
pub fn open_regular(path: &Path) -> Result<(std::fs::File, u64)> {
    let refuse =
        |m: &std::fs::Metadata| Error::Usage(format!("{}: not a regular file ({})", path.display(), special_kind(m)));
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, "open", e))?;
    if !meta.is_file() {
        return Err(refuse(&meta));
    }
    let f = std::fs::File::open(path).map_err(|e| Error::io(path, "open", e))?;
    // The path may have been replaced between the two looks: the open file is what is read.
    let meta = f.metadata().map_err(|e| Error::io(path, "stat", e))?;
    if !meta.is_file() {
        return Err(refuse(&meta));
    }
    Ok((f, meta.len()))
}

/// Reads the whole input file `path` ([`open_regular`]), never more than the length its
/// metadata gives: a file growing while it is read is cut there, not followed.
///
/// Errors: as [`open_regular`]; [`Error::Io`] when a read fails.
pub fn read_regular(path: &Path) -> Result<Vec<u8>> {
    use std::io::Read;
    let (f, len) = open_regular(path)?;
    let cap = usize::try_from(len).unwrap_or(usize::MAX);
    let mut bytes = Vec::new();
    bytes
        .try_reserve_exact(cap)
        .map_err(|_| Error::Usage(format!("{}: {len} bytes do not fit in memory", path.display())))?;
    f.take(len)
        .read_to_end(&mut bytes)
        .map_err(|e| Error::io(path, "read", e))?;
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A device, a FIFO-like special file and a directory are refused by name and kind before
    /// any read; a regular file is read whole.
    #[test]
    fn only_regular_files_are_read() {
        #[cfg(unix)]
        {
            let e = read_regular(Path::new("/dev/zero")).unwrap_err().to_string();
            assert_eq!(e, "/dev/zero: not a regular file (a character device)");
        }
        let dir = std::env::temp_dir();
        let e = read_regular(&dir).unwrap_err().to_string();
        assert_eq!(e, format!("{}: not a regular file (a directory)", dir.display()));
        let p = dir.join(format!("mla-diff-fsio-{}.bin", std::process::id()));
        std::fs::write(&p, b"12345").unwrap();
        assert_eq!(read_regular(&p).unwrap(), b"12345");
        assert_eq!(open_regular(&p).unwrap().1, 5);
        std::fs::remove_file(&p).unwrap();
    }
}
