//! The layering rule of the crate, checked: every folder of `src/` imports only from the folders
//! below it.
//!
//! The data flows one way (docs/design.md, "Layers"); an import that points back up it is how
//! cycles start and how a low layer ends up depending on the command line. This check reads every
//! `crate::…` path in code (`use`, `pub use`, inline paths) and every `super::…` path resolved
//! against the file's module, and fails on any that reaches a layer above the file's own.
//! Comments are skipped: an intra-doc link is not a dependency.

use std::path::{Path, PathBuf};

/// The layers, lowest first. `src/<layer>/…` or `src/<layer>.rs` belongs to the layer.
pub const LAYERS: &[&str] = &[
    "core", "model", "device", "compute", "backend", "judge", "output", "jobs", "cli",
];

/// One import that reaches up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// The file, relative to `src/`.
    pub file: String,
    /// 1-based line.
    pub line: usize,
    /// The file's layer.
    pub from: &'static str,
    /// The layer it reaches.
    pub to: &'static str,
    /// The path as written.
    pub path: String,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "src/{}:{}: `{}` ({}) reaches up into {}",
            self.file, self.line, self.path, self.from, self.to
        )
    }
}

fn rank(layer: &str) -> Option<usize> {
    LAYERS.iter().position(|l| *l == layer)
}

/// The module path of a file under `src/` (`backend/cuda/ops.rs` → `[backend, cuda, ops]`;
/// `mod.rs` names its folder; `lib.rs` and `main.rs` are the crate root).
fn module_of(rel: &str) -> Vec<String> {
    let mut parts: Vec<String> = rel.trim_end_matches(".rs").split('/').map(str::to_string).collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib" | "main")) {
        parts.pop();
    }
    parts
}

/// Code of one line without its `//` comment (a `//` inside a string literal ends the line too
/// early, which can only hide a path, and no path of this crate sits in a string after `//`).
fn code_of(line: &str) -> &str {
    match line.find("//") {
        Some(i) => &line[..i],
        None => line,
    }
}

fn ident_end(s: &str) -> usize {
    s.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(s.len())
}

/// The layers named by the paths of one line of code in the module `module`, with the path text.
fn reaches(code: &str, module: &[String]) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let bytes = code.as_bytes();
    let mut i = 0;
    while i < code.len() {
        let rest = &code[i..];
        let boundary =
            i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_' || bytes[i - 1] == b':');
        if boundary && rest.starts_with("crate::") {
            let tail = &rest[7..];
            let n = ident_end(tail);
            out.push((tail[..n].to_string(), format!("crate::{}", &tail[..n])));
            i += 7 + n;
        } else if boundary && rest.starts_with("super::") {
            // Resolve every leading `super::` against the module path.
            let mut up = 0;
            let mut tail = rest;
            while let Some(t) = tail.strip_prefix("super::") {
                up += 1;
                tail = t;
            }
            let n = ident_end(tail);
            let base: Vec<&String> = module.iter().take(module.len().saturating_sub(up)).collect();
            let first = base
                .first()
                .map(|s| s.to_string())
                .unwrap_or_else(|| tail[..n].to_string());
            out.push((first, format!("{}{}", "super::".repeat(up), &tail[..n])));
            i += rest.len() - tail.len() + n;
        } else {
            i += rest.chars().next().map_or(1, char::len_utf8);
        }
    }
    out
}

/// Checks one file's text; `rel` is its path relative to `src/`.
pub fn check_source(rel: &str, text: &str) -> Vec<Violation> {
    let module = module_of(rel);
    let Some(from) = module.first().and_then(|m| rank(m)) else {
        return Vec::new();
    };
    let mut v = Vec::new();
    for (n, line) in text.lines().enumerate() {
        for (target, path) in reaches(code_of(line), &module) {
            if let Some(to) = rank(&target)
                && to > from
            {
                v.push(Violation {
                    file: rel.to_string(),
                    line: n + 1,
                    from: LAYERS[from],
                    to: LAYERS[to],
                    path,
                });
            }
        }
    }
    v
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

/// Checks every file under `src`.
pub fn check_tree(src: &Path) -> (usize, Vec<Violation>) {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut v = Vec::new();
    for f in &files {
        let rel = f.strip_prefix(src).unwrap().to_string_lossy().replace('\\', "/");
        v.extend(check_source(&rel, &std::fs::read_to_string(f).unwrap()));
    }
    (files.len(), v)
}

#[test]
fn src_imports_only_downwards() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let (files, v) = check_tree(&src);
    assert!(files > 40, "the check read only {files} files under {}", src.display());
    // Every layer exists as a folder: a layer that vanished would silently check nothing.
    for l in LAYERS {
        assert!(src.join(l).is_dir(), "layer folder src/{l} is missing");
    }
    let lines: Vec<String> = v.iter().map(|x| x.to_string()).collect();
    assert!(
        lines.is_empty(),
        "{} imports reach up a layer:\n{}",
        lines.len(),
        lines.join("\n")
    );
}

#[test]
fn planted_upward_imports_are_caught() {
    let sample = r#"//! A planted sample: a model module that reaches into the judge and the jobs.
use crate::core::error::Result; // fine: below
use crate::model::gguf::GgufFile; // fine: same layer
use crate::judge::metrics::SiteDiff;
pub use crate::jobs::run::RunReport;
fn f() -> Result<()> {
    let _ = crate::cli::dispatch; // inline path
    // use crate::cli::Cli;  (a comment: not a dependency)
    Ok(())
}
"#;
    let v = check_source("model/planted.rs", sample);
    let got: Vec<(usize, &str, &str)> = v.iter().map(|x| (x.line, x.to, x.path.as_str())).collect();
    assert_eq!(
        got,
        vec![
            (4, "judge", "crate::judge"),
            (5, "jobs", "crate::jobs"),
            (7, "cli", "crate::cli"),
        ]
    );
    // `super::` resolves against the module: from backend/cuda/ops.rs, `super::super::super::judge`
    // is `crate::judge` (a reach up), `super::ops` stays in the backend.
    let v = check_source(
        "backend/cuda/ops.rs",
        "use super::super::super::judge::tolerance;\nuse super::ops::X;\n",
    );
    assert_eq!(v.len(), 1, "{v:?}");
    assert_eq!((v[0].line, v[0].to), (1, "judge"));
    // A layer's own mod.rs and a lower layer are never flagged.
    assert!(
        check_source(
            "jobs/mod.rs",
            "use crate::output::report;\nuse crate::core::trace::Site;\n"
        )
        .is_empty()
    );
    assert!(check_source("cli/mod.rs", "use crate::jobs::run;\n").is_empty());
}
