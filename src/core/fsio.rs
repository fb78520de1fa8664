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
