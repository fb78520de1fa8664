//! Atomic file writes that never replace a user's file without `--force`.
//!
//! Every job that writes a file (JSON, reports, goldens, heat maps) goes through here, so the
//! rule "write to a temporary name in the same folder, then rename; refuse an existing file unless
//! forced" is written once, with what a path must be to be written at all: a file name (no
//! trailing `/`, at most [`NAME_MAX`] bytes) in a folder that takes files, and nothing there but
//! a regular file. A rename replaces whatever entry the path names, so `--force` on a symlink,
//! FIFO or device node (`/dev/stdout` as root) would replace that entry itself: refused.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::core::error::{Error, Result};

/// The longest file name, in bytes, mla-diff writes (`NAME_MAX` of Linux's file systems: ext4,
/// xfs, btrfs, tmpfs).
pub const NAME_MAX: usize = 255;

/// The temporary twin of `path` that [`write_file_atomic`] writes and renames: a hidden file in
/// the same folder, `.mla-diff-<pid>-<hash>.tmp` with a 64-bit FNV-1a hash of the whole path
/// (two outputs of one process never share a twin). At most 41 bytes whatever the name, so a
/// legal output name never has an illegal twin.
pub fn temp_twin(path: &Path) -> PathBuf {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in path.as_os_str().as_encoded_bytes() {
        hash = (hash ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
    }
    folder_of(path).join(format!(".mla-diff-{}-{hash:016x}.tmp", std::process::id()))
}

/// The folder a file path lies in (`.` for a bare name).
fn folder_of(path: &Path) -> &Path {
    path.parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

/// Writes `bytes` to `path` through a temporary file in the same folder ([`temp_twin`]) and a
/// rename, refusing to replace an existing file unless `force`, and never replacing anything
/// but a regular file: a device node, FIFO, symlink or folder at `path` is refused even with
/// `force`, checked first and again just before the rename.
///
/// Errors: [`Error::Usage`] as [`refuse_existing`]; [`Error::Io`] otherwise.
pub fn write_file_atomic(path: &Path, bytes: &[u8], force: bool) -> Result<()> {
    refuse_existing(path, force)?;
    let tmp = temp_twin(path);
    // Errors name the file the user asked for; the temporary name is an implementation detail.
    let res = (|| {
        let mut f = create_new(&tmp).map_err(|e| Error::io(path, "create", e))?;
        f.write_all(bytes).map_err(|e| Error::io(path, "write", e))?;
        f.sync_all().map_err(|e| Error::io(path, "sync", e))?;
        // What appeared at the path while the bytes were written is judged as before the work.
        refuse_existing(path, force)?;
        std::fs::rename(&tmp, path).map_err(|e| Error::io(path, "rename", e))
    })();
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res
}

/// Creates `tmp` for writing, never through an existing entry: a stale twin of this process id
/// (a crash's leftover, a regular file by that name) is removed first.
fn create_new(tmp: &Path) -> std::io::Result<std::fs::File> {
    let open = || std::fs::OpenOptions::new().write(true).create_new(true).open(tmp);
    match open() {
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            std::fs::remove_file(tmp)?;
            open()
        }
        r => r,
    }
}

/// The check [`write_file_atomic`] makes first, for refusing before any work: `path` must name
/// a file (no trailing `/`, a name of at most [`NAME_MAX`] bytes), its folder must exist, what
/// is at `path` must be a regular file or nothing (a folder, device node, FIFO, socket or symlink
/// is refused whatever `force`), and it must not exist unless `force`.
///
/// Errors: [`Error::Usage`] naming the file.
pub fn refuse_existing(path: &Path, force: bool) -> Result<()> {
    let shown = path.display();
    if path.as_os_str().as_encoded_bytes().ends_with(b"/") {
        return Err(Error::Usage(format!(
            "{shown}: ends with `/`, which names a folder; give a file path"
        )));
    }
    let Some(name) = path.file_name() else {
        return Err(Error::Usage(format!("{shown} is a folder; give a file path")));
    };
    let len = name.as_encoded_bytes().len();
    if len > NAME_MAX {
        return Err(Error::Usage(format!(
            "{shown}: the file name is {len} bytes and file systems take at most {NAME_MAX}; give a shorter name"
        )));
    }
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty());
    if let Some(d) = dir.filter(|d| !d.is_dir()) {
        return Err(Error::Usage(format!(
            "{}: the folder {} {}; create it first or give another path",
            shown,
            d.display(),
            if d.exists() {
                "is not a folder"
            } else {
                "does not exist"
            }
        )));
    }
    match std::fs::symlink_metadata(path) {
        Ok(md) if md.is_dir() => Err(Error::Usage(format!("{shown} is a folder; give a file path"))),
        Ok(md) if !md.file_type().is_file() => Err(Error::Usage(format!(
            "{shown}: not a regular file ({}); --force replaces only regular files",
            special_kind(&md)
        ))),
        Ok(_) if !force => Err(Error::Usage(format!("{shown} exists; pass --force to overwrite it"))),
        _ => Ok(()),
    }
}

/// [`refuse_existing`], then the real test of the folder: create [`temp_twin`] there and remove
/// it, as the write will. A folder that refuses files (`/proc`, read-only, no permission, full
/// inode table) is refused here, before the work, instead of after it.
///
/// Errors: [`Error::Usage`] as [`refuse_existing`], or naming the file, its folder and the
/// system's reason.
pub fn check_output(path: &Path, force: bool) -> Result<()> {
    refuse_existing(path, force)?;
    probe(&temp_twin(path)).map_err(|reason| {
        Error::Usage(format!(
            "{}: cannot create a file in {} ({reason}); give a path in a writable folder",
            path.display(),
            folder_of(path).display()
        ))
    })
}

/// Creates and removes `twin`: the system's reason when it cannot.
fn probe(twin: &Path) -> std::result::Result<(), String> {
    create_new(twin).map_err(|e| e.to_string())?;
    std::fs::remove_file(twin).map_err(|e| e.to_string())
}

/// Whether files can be created in the folder `dir` (which may not exist yet: then its nearest
/// existing ancestor, where the folder will be created): [`check_output`] for a folder a command
/// fills (`--export-inputs DIR`, `golden record`'s case folder).
///
/// Errors: [`Error::Usage`] naming `dir` and the system's reason.
pub fn check_output_folder(dir: &Path) -> Result<()> {
    let mut at = dir;
    while !at.as_os_str().is_empty() && !at.exists() {
        match at.parent() {
            Some(p) => at = p,
            None => break,
        }
    }
    let at = if at.as_os_str().is_empty() { Path::new(".") } else { at };
    if !at.is_dir() {
        return Err(Error::Usage(format!(
            "{}: {} is not a folder",
            dir.display(),
            at.display()
        )));
    }
    probe(&temp_twin(&at.join("out"))).map_err(|reason| {
        Error::Usage(format!(
            "{}: cannot create files in {} ({reason}); give a writable folder",
            dir.display(),
            at.display()
        ))
    })
}

/// What a path that is not a regular file is, in words (`a character device`, `a FIFO`, …).
fn special_kind(meta: &std::fs::Metadata) -> &'static str {
    let ft = meta.file_type();
    if ft.is_dir() {
        return "a directory";
    }
    if ft.is_symlink() {
        return "a symbolic link";
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

    use std::os::unix::fs::FileTypeExt;

    #[test]
    fn a_twin_is_short_hidden_and_beside_its_file() {
        let long = "x".repeat(NAME_MAX);
        let twin = temp_twin(&Path::new("/tmp/a").join(&long));
        assert_eq!(twin.parent(), Some(Path::new("/tmp/a")));
        let name = twin.file_name().unwrap().to_str().unwrap();
        assert!(name.starts_with(".mla-diff-") && name.ends_with(".tmp"), "{name}");
        assert!(name.len() <= 41, "{name}");
        assert_ne!(temp_twin(Path::new("a.json")), temp_twin(Path::new("b.json")));
        assert_eq!(temp_twin(Path::new("a.json")).parent(), Some(Path::new(".")));
    }

    #[test]
    fn a_name_at_the_limit_is_written_and_one_past_it_refused() {
        let d = tempfile::tempdir().unwrap();
        let ok = d.path().join("y".repeat(NAME_MAX));
        write_file_atomic(&ok, b"{}", false).unwrap();
        assert_eq!(std::fs::read(&ok).unwrap(), b"{}");
        let long = d.path().join("y".repeat(NAME_MAX + 1));
        let e = crate::core::error::chain(&write_file_atomic(&long, b"{}", true).unwrap_err());
        assert!(e.contains("256 bytes") && e.contains("at most 255"), "{e}");
        // Nothing but the written file is left: no twin.
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 1);
    }

    #[test]
    fn force_replaces_only_regular_files() {
        let d = tempfile::tempdir().unwrap();
        let target = d.path().join("target.json");
        std::fs::write(&target, b"keep").unwrap();
        let link = d.path().join("link.json");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let e = crate::core::error::chain(&write_file_atomic(&link, b"new", true).unwrap_err());
        assert_eq!(
            e,
            format!(
                "{}: not a regular file (a symbolic link); --force replaces only regular files",
                link.display()
            )
        );
        assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
        assert_eq!(std::fs::read(&target).unwrap(), b"keep");
        let fifo = d.path().join("fifo");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: mkfifo reads a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert!(write_file_atomic(&fifo, b"new", true).is_err());
        assert!(std::fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo());
        // A regular file is replaced with --force, refused without.
        assert!(write_file_atomic(&target, b"new", false).is_err());
        write_file_atomic(&target, b"new", true).unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"new");
    }

    #[test]
    fn paths_that_name_no_writable_file_are_refused_before_the_work() {
        let d = tempfile::tempdir().unwrap();
        let slash = format!("{}/out.json/", d.path().display());
        let e = crate::core::error::chain(&check_output(Path::new(&slash), false).unwrap_err());
        assert!(e.contains("ends with `/`"), "{e}");
        let e = crate::core::error::chain(&check_output(Path::new("/proc/out.json"), false).unwrap_err());
        assert!(e.starts_with("/proc/out.json: cannot create a file in /proc ("), "{e}");
        check_output(&d.path().join("out.json"), false).unwrap();
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 0, "the probe left a file");
        assert!(check_output_folder(&d.path().join("new/deeper")).is_ok());
        assert!(check_output_folder(Path::new("/proc/new")).is_err());
    }
}
