//! The helper scripts on a machine that lacks what they need: an exit code and one line saying
//! what to install, never a shell's 127 or a Python traceback.

use std::path::PathBuf;
use std::process::Command;

use crate::common::repo;

/// `tool` on this process's PATH.
fn which(tool: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(tool))
        .find(|p| p.is_file())
}

/// Without cmark-gfm, pandoc and rsvg-convert (and chromium for --screenshot) on PATH, the render
/// check exits 2 naming them and the apt-get line, before building or running anything.
#[test]
fn check_report_render_names_its_missing_tools() {
    let bash = which("bash").expect("bash");
    let dir = tempfile::tempdir().unwrap();
    // Only `dirname` (the script's first line needs it): every render tool is missing.
    std::os::unix::fs::symlink(which("dirname").expect("dirname"), dir.path().join("dirname")).unwrap();
    for (args, want) in [
        (
            &[][..],
            "check_report_render: missing cmark-gfm pandoc rsvg-convert: install with apt-get install cmark-gfm pandoc librsvg2-bin",
        ),
        (
            &["--screenshot"][..],
            "check_report_render: missing cmark-gfm pandoc rsvg-convert chromium: install with apt-get install cmark-gfm pandoc librsvg2-bin chromium",
        ),
    ] {
        let out = Command::new(&bash)
            .arg(repo().join("scripts/ci/check_report_render.sh"))
            .args(args)
            .env("PATH", dir.path())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert_eq!(err.trim(), want);
    }
}

/// The sparse-file makers (make_sparse_gguf.py, make_glm5_gguf.py) on a Python without numpy
/// (`-S`: no site-packages) say to install numpy and gguf, in one line, instead of a traceback.
#[test]
fn make_sparse_gguf_without_numpy_says_what_to_install() {
    let Some(py) = which("python3") else {
        eprintln!("skipped: no python3 on PATH");
        return;
    };
    for script in ["make_sparse_gguf.py", "make_glm5_gguf.py"] {
        let dir = tempfile::tempdir().unwrap();
        let out = Command::new(&py)
            .arg("-S")
            .arg(repo().join("scripts/fixtures").join(script))
            .arg(dir.path().join("out"))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{script}: {err}");
        assert_eq!(
            err.trim(),
            format!("{script} needs numpy and gguf (gguf-py): pip install numpy gguf (No module named 'numpy')")
        );
        assert!(!dir.path().join("out").exists());
    }
}
