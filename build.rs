//! Records the git revision the binary is built from (for triage reports) as `MLA_DIFF_GIT_REV`:
//! `git rev-parse --short=12 HEAD`, with `-dirty` when tracked files have changes; empty when git
//! or the repository is unavailable (a crates.io build).

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let o = Command::new("git").args(args).output().ok()?;
    o.status
        .success()
        .then(|| String::from_utf8_lossy(&o.stdout).trim().to_string())
}

fn main() {
    let rev = git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_default();
    let dirty =
        git(&["--no-optional-locks", "status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
    let value = if rev.is_empty() {
        String::new()
    } else if dirty {
        format!("{rev}-dirty")
    } else {
        rev
    };
    println!("cargo:rustc-env=MLA_DIFF_GIT_REV={value}");
    if let Some(head) = git(&["rev-parse", "--git-path", "HEAD"]) {
        println!("cargo:rerun-if-changed={head}");
    }
    if let Some(r) = git(&["symbolic-ref", "-q", "HEAD"])
        && let Some(p) = git(&["rev-parse", "--git-path", &r])
    {
        println!("cargo:rerun-if-changed={p}");
    }
    if let Some(index) = git(&["rev-parse", "--git-path", "index"]) {
        println!("cargo:rerun-if-changed={index}");
    }
    println!("cargo:rerun-if-changed=build.rs");
}
