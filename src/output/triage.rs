//! Triage reports: a run written as GitHub-flavoured Markdown for a bug ticket, with an error heat
//! map next to it.
//!
//! Whoever files the bug is rarely whoever fixes it. The report carries what the fixer needs
//! without asking back: the verdict first (first divergence and the named bug class with its
//! evidence and hint), the exact command, the machine (backend, GPU, driver, CUDA/NVRTC/cuBLAS,
//! CPU, tool version and git revision), the model's dims and quant types, every site's numbers
//! folded into `<details>`, and a per-(layer, path) × per-site `rel_l2` heat map drawn with
//! plotters. Floats use fixed formats and nothing depends on hash order or time apart from the
//! one `Date:` line, so two reports of the same run differ only there.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use plotters::prelude::*;

use crate::backend::Backend;
use crate::core::error::{Error, Result};
use crate::core::fsio::write_file_atomic;
use crate::judge::metrics::{SiteDiff, Status};
use crate::judge::report::{RunReport, Verdict};
use crate::model::gguf::GgufFile;
use crate::output::report::{finding_lines, run_line, verdict_lines};

/// The machine a run happened on. Fields that do not apply (no GPU) are `None`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Environment {
    /// The backend's one-line description.
    pub backend: String,
    /// GPU name and compute capability.
    pub gpu: Option<String>,
    /// Kernel driver release and the CUDA version it supports.
    pub driver: Option<String>,
    /// NVRTC version.
    pub nvrtc: Option<String>,
    /// cuBLAS version.
    pub cublas: Option<String>,
    /// CPU model (Linux `/proc/cpuinfo`), else the architecture.
    pub cpu: String,
    /// Operating system and architecture.
    pub os: String,
    /// `mla-diff` version.
    pub tool_version: String,
    /// Git revision the binary was built from (`-dirty` when the tree had changes), if known.
    pub git_revision: Option<String>,
    /// UTC date and time of the report (RFC 3339, seconds).
    pub date: String,
}

impl Environment {
    /// Describes this machine and `backend`. Never fails: unknown fields read `unknown`.
    pub fn detect(backend: &Backend) -> Environment {
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("model name"))
                    .and_then(|l| l.split_once(':'))
                    .map(|(_, v)| v.trim().to_string())
            })
            .unwrap_or_else(|| std::env::consts::ARCH.to_string());
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let mut env = Environment {
            backend: backend.describe(),
            gpu: None,
            driver: None,
            nvrtc: None,
            cublas: None,
            cpu: format!("{cpu} ({threads} threads)"),
            os: format!("{} {}", std::env::consts::OS, std::env::consts::ARCH),
            tool_version: env!("CARGO_PKG_VERSION").to_string(),
            git_revision: option_env!("MLA_DIFF_GIT_REV")
                .filter(|s| !s.is_empty())
                .map(str::to_string),
            date: humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
        };
        if let Backend::Cuda(o) = backend {
            let d = o.device();
            env.gpu = Some(format!(
                "{} (compute {}.{}, code for {}, {} kernels)",
                d.name,
                d.arch.major,
                d.arch.minor,
                d.arch,
                match o.kernels() {
                    crate::backend::cuda::ops::Kernels::Fast => "fast (tensor-core)",
                    crate::backend::cuda::ops::Kernels::Simple => "simple (f32 FMA)",
                }
            ));
            let unknown = || "unknown".to_string();
            env.driver = Some(format!(
                "{} (CUDA {})",
                crate::device::kernel_driver_release().unwrap_or_else(unknown),
                crate::device::driver_cuda_version().map_or_else(|_| unknown(), |(a, b)| format!("{a}.{b}"))
            ));
            env.nvrtc = Some(crate::device::nvrtc_version().map_or_else(|_| unknown(), |(a, b)| format!("{a}.{b}")));
            env.cublas =
                Some(crate::device::cublas_version().map_or_else(|_| unknown(), |(a, b, c)| format!("{a}.{b}.{c}")));
        }
        env
    }
}

/// The heat map's file: the report's path with the extension `svg` (`r.md` → `r.svg`).
pub fn plot_path(report: &Path) -> PathBuf {
    report.with_extension("svg")
}

/// Escapes text for GFM: `|` (table cells), `*`, `\\`, `<` and `>`. Backquoted spans stay code
/// spans; intraword `_` is not emphasis in GFM and stays as is.
pub fn md_escape(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '|' | '*' | '\\' => {
                o.push('\\');
                o.push(c);
            }
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '\n' => o.push(' '),
            _ => o.push(c),
        }
    }
    o
}

/// Findings grouped by (class, site): the paths that share them, and the first one's evidence
/// and hint.
fn grouped_findings(rep: &RunReport) -> Vec<(&crate::judge::diagnose::Finding, Vec<String>)> {
    let mut g: Vec<(&crate::judge::diagnose::Finding, Vec<String>)> = Vec::new();
    for f in &rep.findings {
        let p = crate::output::report::finding_origin(f);
        // Site findings of several paths at one site group; loaded-weight findings by tensor.
        let same = |h: &crate::judge::diagnose::Finding| {
            h.class == f.class && h.site() == f.site() && (f.site().is_some() || h.subject == f.subject)
        };
        match g.iter_mut().find(|(h, _)| same(h)) {
            Some((_, paths)) => paths.push(p),
            None => g.push((f, vec![p])),
        }
    }
    g
}

fn status_cell(d: &SiteDiff, first: bool) -> String {
    let w = crate::output::report::status_word(d);
    let s = if d.status == Status::Pass {
        w
    } else {
        format!("**{w}**")
    };
    if first { format!("{s} ◀ first") } else { s }
}

/// The GFM table of one (layer, path).
fn site_table_md(diffs: &[SiteDiff]) -> String {
    let first = crate::judge::metrics::first_divergence(diffs).map(|d| d.site);
    let mut s = String::from(
        "| site | shape | status | rel_l2 | cos_diff | norm ratio | max abs diff at [idx] (ref → cand) | pass |\n\
         |---|---|---|---:|---:|---:|---|---:|\n",
    );
    for d in diffs {
        let [rel, cos, ratio, worst, pass] = crate::output::report::metric_cells(d);
        let _ = writeln!(
            s,
            "| `{}` | {:?} | {} | {rel} | {cos} | {ratio} | {} | {pass} |",
            d.site,
            d.shape_cand,
            status_cell(d, first == Some(d.site)),
            md_escape(&worst)
        );
    }
    s
}

/// The one-paragraph verdict.
fn verdict_paragraph(rep: &RunReport) -> String {
    let layers: Vec<String> = rep.run.layers.iter().map(|l| l.to_string()).collect();
    let paths: Vec<&str> = rep.run.paths.iter().map(|p| p.name()).collect();
    let mut p = format!(
        "mla-diff ran the f64 reference and the {} path(s) on layer(s) {} of `{}`. ",
        paths.join(", "),
        layers.join(", "),
        rep.model.path.replace('`', "'")
    );
    let not_run = rep.not_run();
    let skipped = if not_run.is_empty() {
        String::new()
    } else {
        format!(" Not run: {}.", md_escape(&rep.not_run_summary()))
    };
    match rep.verdict() {
        Verdict::Pass if not_run.is_empty() => {
            p.push_str("Every site of every path is within tolerance; nothing was found.");
            return p;
        }
        Verdict::Pass => {
            p.push_str("Every site of every path that ran is within tolerance; nothing was found.");
            p.push_str(&skipped);
            return p;
        }
        Verdict::Inconclusive => {
            let why = rep.inconclusive_reason().unwrap_or_default();
            let _ = write!(p, "Nothing was judged: {}.", md_escape(&why));
            return p;
        }
        Verdict::Divergence => {}
    }
    let mut firsts: Vec<(String, Vec<String>)> = Vec::new();
    if let Some(t) = rep.first_loaded_divergence() {
        firsts.push((format!("loaded weight {}", t.name), vec!["dump".to_string()]));
    }
    for (path, d) in rep.first_divergence() {
        if rep.first_loaded_divergence().is_some() && path == crate::judge::label::PathLabel::Dump {
            continue;
        }
        if let Some(d) = d {
            let site = d.site.to_string();
            match firsts.iter_mut().find(|(s, _)| *s == site) {
                Some((_, v)) => v.push(path.to_string()),
                None => firsts.push((site, vec![path.to_string()])),
            }
        }
    }
    if !firsts.is_empty() {
        let parts: Vec<String> = firsts
            .iter()
            .map(|(site, paths)| format!("`{site}` on {}", paths.join(", ")))
            .collect();
        let _ = write!(p, "First divergence: {}. ", parts.join("; "));
    }
    for (f, paths) in grouped_findings(rep) {
        let _ = write!(
            p,
            "Finding **{}** at `{}` (path {}): {}. Hint: {}. ",
            f.class,
            f.subject,
            paths.join(", "),
            md_escape(f.evidence.trim_end_matches('.')),
            md_escape(f.hint.trim_end_matches('.'))
        );
    }
    p.push_str(skipped.trim_start());
    p.trim_end().to_string()
}

/// The report's headline: the first finding's class and site, or the verdict.
fn headline(rep: &RunReport) -> String {
    let groups = grouped_findings(rep);
    if let Some((f, paths)) = groups.first() {
        let more = if groups.len() > 1 {
            format!(" (+{} more finding(s))", groups.len() - 1)
        } else {
            String::new()
        };
        if let crate::judge::diagnose::Subject::Loaded(t) = &f.subject {
            return format!("{} at loaded weight {}{more}", f.class, t.tensor);
        }
        return format!("{} at {} on path {}{more}", f.class, f.subject, paths.join(", "));
    }
    let n_not_run = rep.not_run().len();
    match rep.verdict() {
        Verdict::Pass if n_not_run == 0 => "all paths within tolerance".to_string(),
        Verdict::Pass => format!(
            "all paths that ran within tolerance ({n_not_run} of {} layer × path not run)",
            rep.results.len()
        ),
        Verdict::Inconclusive if n_not_run == rep.results.len() => "no requested path could run".to_string(),
        Verdict::Inconclusive => "inconclusive: an injected fault never acted".to_string(),
        Verdict::Divergence => "divergence found (no class named)".to_string(),
    }
}

/// The Markdown report. `plot_name` is the heat map's file name (linked relative to the report).
pub fn markdown(rep: &RunReport, env: &Environment, command: &str, file: &GgufFile, plot_name: &str) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "# mla-diff triage: {}\n", headline(rep));
    let _ = writeln!(s, "{}\n", verdict_paragraph(rep));
    let _ = writeln!(s, "Date: {}\n", env.date);

    s.push_str("## Reproduce\n\n```sh\n");
    s.push_str(command);
    s.push_str("\n```\n\n");
    let _ = writeln!(s, "Run: {}\n", md_escape(&run_line(rep)));
    s.push_str(&dump_section(rep));

    s.push_str("## Findings and verdict per path\n\n");
    for l in verdict_lines(rep) {
        let _ = writeln!(s, "- {}", md_escape(&l));
    }
    for l in finding_lines(rep) {
        let _ = writeln!(s, "- {}", md_escape(&l.replace("\n  ", " — ")));
    }
    s.push('\n');

    s.push_str("## Environment\n\n| | |\n|---|---|\n");
    let none = "— (CPU backend)".to_string();
    for (k, v) in [
        ("backend", env.backend.clone()),
        ("GPU", env.gpu.clone().unwrap_or_else(|| none.clone())),
        ("driver", env.driver.clone().unwrap_or_else(|| none.clone())),
        ("NVRTC", env.nvrtc.clone().unwrap_or_else(|| none.clone())),
        ("cuBLAS", env.cublas.clone().unwrap_or_else(|| none.clone())),
        ("CPU", env.cpu.clone()),
        ("OS", env.os.clone()),
        ("mla-diff", env.tool_version.clone()),
        (
            "git revision",
            env.git_revision.clone().unwrap_or_else(|| "unknown".into()),
        ),
    ] {
        let _ = writeln!(s, "| {k} | {} |", md_escape(&v));
    }
    s.push('\n');

    let c = &rep.model.config;
    s.push_str("## Model\n\n");
    let _ = writeln!(
        s,
        "`{}`: arch `{}`, {} layers, {}, softmax scale {:.6}, RoPE base {}, YaRN {}, rms eps {:.3e}, kv_b {}, {} leading dense layer(s).\n",
        rep.model.path.replace('`', "'"),
        c.arch,
        c.n_layer,
        c.dims_line(),
        c.softmax_scale,
        c.rope_base,
        c.yarn
            .as_ref()
            .map_or("off".to_string(), |y| format!("factor {}", y.factor)),
        c.rms_eps,
        match c.kv_b_layout {
            crate::model::config::KvBLayout::Split => "split (attn_k_b, attn_v_b)",
            crate::model::config::KvBLayout::Fused => "fused (one attn_kv_b)",
        },
        c.leading_dense_block_count
    );
    if let Some(m) = &c.moe {
        let _ = writeln!(
            s,
            "MoE layers {}..{}: {} (E experts, K used, G groups / kept, F_e expert width).\n",
            c.leading_dense_block_count,
            c.n_layer,
            m.line()
        );
    }
    let quirks = c.quirks();
    if !quirks.is_empty() {
        let _ = writeln!(s, "Architecture specifics: {}.\n", quirks.join("; "));
    }
    s.push_str("| tensor | ggml type | shape (PyTorch order) |\n|---|---|---|\n");
    for t in &rep.model.tensor_types {
        let shape = file.tensor(&t.name).map(|i| i.shape()).unwrap_or_default();
        let _ = writeln!(s, "| `{}` | {} | {:?} |", t.name, t.ggml_type.name(), shape);
    }
    s.push('\n');

    s.push_str(&heatmap_section(rep, plot_name));

    s.push_str("## Per-site tables\n\n");
    for r in &rep.results {
        let first = match crate::judge::metrics::first_divergence(&r.diffs) {
            _ if r.diffs.is_empty() => "not run".to_string(),
            Some(d) => format!("first divergence {}", d.site),
            None => "all sites within tolerance".to_string(),
        };
        let _ = writeln!(
            s,
            "<details>\n<summary>layer {} · path {} — {}</summary>\n",
            r.layer, r.path, first
        );
        if r.diffs.is_empty() {
            match &r.not_run {
                Some(n) => {
                    let _ = writeln!(s, "Not run: {}.", md_escape(&n.reason));
                }
                None => s.push_str("Not run: no site recorded.\n"),
            }
        } else {
            s.push_str(&site_table_md(&r.diffs));
        }
        for n in &r.notes {
            let _ = writeln!(s, "\nnote: {}", md_escape(n));
        }
        s.push_str("\n</details>\n\n");
    }
    s
}

/// The report's "Error heat map" section: the SVG `plot_name` linked beside the report, its
/// legend, and the same map as text ([`heatmap_text`]).
fn heatmap_section(rep: &RunReport, plot_name: &str) -> String {
    let mut s = String::from("## Error heat map\n\n");
    let _ = writeln!(
        s,
        "![rel_l2 per layer and path (rows) and site (columns), log scale]({plot_name})\n\n\
         Each cell is a site's `rel_l2` against the reference on a log scale (viridis: purple \
         exact, teal f32 rounding, yellow order 1); red outlines fail, `1st` marks each row's \
         first divergence, black cells are non-finite (`NaN`), grey cells were not recorded by \
         that path.{}\n",
        if rep.not_run().is_empty() {
            ""
        } else {
            " A row written `not run` is a path that could not run at that layer."
        }
    );
    // The same map as text: the image is a file beside the report, which a report pasted
    // into an issue loses.
    let _ = writeln!(
        s,
        "As text (`log10(rel_l2)` rounded; `*` fails, `<` first divergence, `.` not recorded):\n\n```text\n{}```\n",
        heatmap_text(rep)
    );

    s
}

/// For `mla-diff compare`: the dump (file, engine, dtype, tolerance rows, map) and three lists:
/// the conversions applied (map overrides, renames, reshapes, rope and kv_a reorders), the
/// reference sites the dump lacks ("not dumped", not compared) and the dump tensors that were
/// ignored. Empty for `run`.
fn dump_section(rep: &RunReport) -> String {
    let Some(d) = &rep.dump else {
        return String::new();
    };
    let mut s = String::from("## Dump\n\n| | |\n|---|---|\n");
    for (k, v) in [
        ("file", format!("`{}`", d.path.replace('`', "'"))),
        ("engine", md_escape(&d.engine)),
        ("engine dtype", d.dtype.to_string()),
        ("tolerance rows", format!("`{}`", d.tolerance_rows)),
        ("map", d.map.as_deref().map_or("none".to_string(), md_escape)),
    ] {
        let _ = writeln!(s, "| {k} | {v} |");
    }
    s.push('\n');
    let list = |s: &mut String, title: &str, items: &[String], empty: &str| {
        let _ = writeln!(s, "### {title} ({})\n", items.len());
        if items.is_empty() {
            let _ = writeln!(s, "{empty}\n");
            return;
        }
        for i in items {
            let _ = writeln!(s, "- {}", md_escape(i));
        }
        s.push('\n');
    };
    if !d.patches.is_empty() {
        list(&mut s, "Engine patches (the engine ran with them)", &d.patches, "");
    }
    list(
        &mut s,
        "Conversions",
        &d.conversions,
        "None: every tensor was read as dumped.",
    );
    let not_dumped: Vec<String> = d.not_dumped.iter().map(|x| format!("`{x}`")).collect();
    list(
        &mut s,
        "Not dumped (not compared)",
        &not_dumped,
        "None: the dump holds every site the reference computes.",
    );
    let ignored: Vec<String> = d.ignored.iter().map(|x| format!("`{}`", x.replace('`', "'"))).collect();
    list(
        &mut s,
        "Ignored dump tensors (not sites, not renamed by the map)",
        &ignored,
        "None.",
    );
    // Failing loaded weights (`weights.*`): the table `weights --check` prints, their rows only.
    let loaded = crate::output::report::loaded_weight_lines(rep, None);
    if let [title, table] = loaded.as_slice() {
        let _ = writeln!(s, "### {}\n", md_escape(title.trim_matches(|c| c == '=' || c == ' ')));
        let _ = writeln!(s, "```text\n{table}\n```\n");
    }
    s
}

/// Heat-map colour for `log10(rel_l2)` in [-16, 0] (viridis stops): dark purple (exact) through
/// teal (f32 rounding, ~1e-7) to yellow (order 1).
fn heat_color(v: f64) -> RGBColor {
    let t = ((v + 16.0) / 16.0).clamp(0.0, 1.0);
    let stops = [
        (0.0, (68.0, 1.0, 84.0)),
        (0.25, (59.0, 82.0, 139.0)),
        (0.5, (33.0, 145.0, 140.0)),
        (0.75, (94.0, 201.0, 98.0)),
        (1.0, (253.0, 231.0, 37.0)),
    ];
    let i = stops
        .iter()
        .rposition(|(p, _)| *p <= t)
        .unwrap_or(0)
        .min(stops.len() - 2);
    let (p0, c0) = stops[i];
    let (p1, c1) = stops[i + 1];
    let f = (t - p0) / (p1 - p0);
    let mix = |a: f64, b: f64| (a + (b - a) * f).round() as u8;
    RGBColor(mix(c0.0, c1.0), mix(c0.1, c1.1), mix(c0.2, c1.2))
}

/// The heat map's smallest width in pixels: its caption and the legend beside it fit even when
/// few sites (or none, when no path ran) make the columns.
const MIN_HEATMAP_WIDTH: u32 = 560;

/// What one heat-map cell shows.
enum Cell {
    /// Not recorded by that path.
    Absent,
    /// Non-finite where the reference is finite (NaN canary, computed NaN/Inf).
    NonFinite,
    /// `log10(rel_l2)`, clamped to [-16, 0].
    Value(f64),
}

impl Cell {
    /// The cell of one site's diff: absent, non-finite, or `log10(rel_l2)` clamped to [-16, 0]
    /// (0 for a site without metrics or with a non-finite `rel_l2`).
    fn of(d: Option<&SiteDiff>) -> Cell {
        match d {
            None => Cell::Absent,
            Some(d) => match &d.metrics {
                Some(m) if m.nonfinite_mismatch > 0 => Cell::NonFinite,
                Some(m) if m.rel_l2.is_finite() => Cell::Value(if m.rel_l2 > 0.0 {
                    m.rel_l2.log10().clamp(-16.0, 0.0)
                } else {
                    -16.0
                }),
                _ => Cell::Value(0.0),
            },
        }
    }
}

/// An [`Error::Internal`] from a plotters failure while drawing the heat map.
fn heatmap_err(e: &dyn std::fmt::Display) -> Error {
    Error::Internal(format!("heat map: {e}"))
}

/// Draws the heat map's legend into `legend` (of a picture `h` pixels high): the colour scale
/// from 1e-16 to 1, then the non-finite, failing and not-recorded cells.
///
/// Errors: [`Error::Internal`] when plotters fails.
fn draw_legend(legend: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>, h: u32) -> Result<()> {
    let lh = (h as i32 - 210).max(64);
    let top = 40;
    for k in 0..=32 {
        let v = -16.0 + 0.5 * f64::from(k);
        let y = top + lh - (lh * k / 32);
        legend
            .draw(&Rectangle::new(
                [(10, y - lh / 32 - 1), (30, y)],
                heat_color(v).filled(),
            ))
            .map_err(|e| heatmap_err(&e))?;
        if k % 8 == 0 {
            legend
                .draw(&Text::new(format!("1e{}", v as i32), (36, y - 7), ("sans-serif", 12)))
                .map_err(|e| heatmap_err(&e))?;
        }
    }
    legend
        .draw(&Text::new("rel_l2", (10, 18), ("sans-serif", 13)))
        .map_err(|e| heatmap_err(&e))?;
    let y = top + lh + 14;
    legend
        .draw(&Rectangle::new([(10, y), (30, y + 16)], BLACK.filled()))
        .map_err(|e| heatmap_err(&e))?;
    legend
        .draw(&Text::new("non-finite", (36, y + 2), ("sans-serif", 12)))
        .map_err(|e| heatmap_err(&e))?;
    legend
        .draw(&Rectangle::new([(10, y + 24), (30, y + 40)], RED.stroke_width(3)))
        .map_err(|e| heatmap_err(&e))?;
    legend
        .draw(&Text::new("fails", (36, y + 26), ("sans-serif", 12)))
        .map_err(|e| heatmap_err(&e))?;
    legend
        .draw(&Rectangle::new(
            [(10, y + 48), (30, y + 64)],
            RGBColor(215, 215, 215).filled(),
        ))
        .map_err(|e| heatmap_err(&e))?;
    legend
        .draw(&Text::new("not recorded", (36, y + 50), ("sans-serif", 12)))
        .map_err(|e| heatmap_err(&e))?;
    Ok(())
}

/// The heat map's columns: every stage some result recorded, in data-flow order.
fn heatmap_stages(rep: &RunReport) -> Vec<crate::core::trace::Stage> {
    let mut stages: Vec<crate::core::trace::Stage> = Vec::new();
    for r in &rep.results {
        for d in &r.diffs {
            if !stages.contains(&d.site.stage) {
                stages.push(d.site.stage);
            }
        }
    }
    stages.sort_by_key(|s| s.order());
    stages
}

/// The heat map's row labels, one per result: `L1 mqa`, and `L0 dump decode-1` for a step of
/// a format-2 dump.
fn heatmap_rows(rep: &RunReport) -> Vec<String> {
    rep.results
        .iter()
        .map(|r| match &r.step {
            Some(k) => format!("L{} {} {k}", r.layer, r.path),
            None => format!("L{} {}", r.layer, r.path),
        })
        .collect()
}

/// The heat map as text, for where an image does not show (a report pasted into a GitHub
/// issue drops relative and `data:` images): one row per (layer, path[, step]), one column per
/// stage numbered in a key below, each cell `log10(rel_l2)` rounded to an integer (−16 exact,
/// about −7 f32 rounding, 0 order 1), `*` after a failing cell, `<` after the row's first
/// divergence, `.` not recorded, `NaN` non-finite where the reference is finite.
pub fn heatmap_text(rep: &RunReport) -> String {
    let stages = heatmap_stages(rep);
    let rows = heatmap_rows(rep);
    let label_w = rows.iter().map(|r| r.chars().count()).max().unwrap_or(0).max(4);
    let mut s = format!("{:label_w$}", "site");
    for i in 1..=stages.len() {
        s.push_str(&format!("{i:>6}"));
    }
    s.push('\n');
    for (r, name) in rep.results.iter().zip(&rows) {
        s.push_str(&format!("{name:label_w$}"));
        if r.diffs.is_empty() {
            s.push_str("  not run\n");
            continue;
        }
        let first = crate::judge::metrics::first_divergence(&r.diffs).map(|d| d.site.stage);
        for st in &stages {
            let d = r.diffs.iter().find(|d| d.site.stage == *st);
            let mut c = match Cell::of(d) {
                Cell::Absent => ".".to_string(),
                Cell::NonFinite => "NaN".to_string(),
                Cell::Value(v) => format!("{}", v.round() as i64),
            };
            if d.is_some_and(SiteDiff::is_failure) {
                c.push('*');
            }
            if first == Some(*st) {
                c.push('<');
            }
            s.push_str(&format!("{c:>6}"));
        }
        s.push('\n');
    }
    let key: Vec<String> = stages
        .iter()
        .enumerate()
        .map(|(i, st)| format!("{} {}", i + 1, st.name()))
        .collect();
    s.push_str(&format!("\nsites: {}\n", key.join(", ")));
    s
}

/// Draws the per-(layer, path) × per-site `log10(rel_l2)` heat map as SVG text: failing cells
/// outlined in red, the first divergence of each row marked `1st`, non-finite cells black with
/// `NaN`, absent cells grey, and a row that did not run written `not run`.
///
/// Errors: [`Error::Internal`] when plotters fails (it does not for SVG output in memory).
pub fn heatmap_svg(rep: &RunReport) -> Result<String> {
    let stages = heatmap_stages(rep);
    let rows = heatmap_rows(rep);
    let (nc, nr) = (stages.len().max(1), rows.len().max(1));
    let cell = 30u32;
    // At least wide enough for the caption above the plot, whatever the column count.
    let (w, h) = ((300 + cell * nc as u32).max(MIN_HEATMAP_WIDTH), 170 + cell * nr as u32);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (w, h)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| heatmap_err(&e))?;
        let (plot, legend) = root.split_horizontally(w - 130);
        let mut chart = ChartBuilder::on(&plot)
            .caption("rel_l2 against the reference (log10)", ("sans-serif", 17))
            .margin(8)
            .x_label_area_size(105)
            .y_label_area_size(110)
            .build_cartesian_2d(0f64..nc as f64, 0f64..nr as f64)
            .map_err(|e| heatmap_err(&e))?;
        chart
            .configure_mesh()
            .disable_mesh()
            .x_labels(0)
            .y_labels(0)
            .draw()
            .map_err(|e| heatmap_err(&e))?;
        let anchor = |h, v| plotters::style::text_anchor::Pos::new(h, v);
        use plotters::style::text_anchor::{HPos, VPos};
        // Column labels, rotated to run downwards from under each column; row labels left.
        let col_style = ("sans-serif", 13)
            .into_font()
            .transform(FontTransform::Rotate90)
            .color(&BLACK)
            .pos(anchor(HPos::Left, VPos::Center));
        for (ci, st) in stages.iter().enumerate() {
            let (px, py) = chart.backend_coord(&(ci as f64 + 0.5, 0.0));
            root.draw(&Text::new(st.name(), (px, py + 6), col_style.clone()))
                .map_err(|e| heatmap_err(&e))?;
        }
        let row_style = ("sans-serif", 13)
            .into_font()
            .color(&BLACK)
            .pos(anchor(HPos::Right, VPos::Center));
        for (ri, name) in rows.iter().enumerate() {
            let (px, py) = chart.backend_coord(&(0.0, (nr - 1 - ri) as f64 + 0.5));
            root.draw(&Text::new(name.clone(), (px - 8, py), row_style.clone()))
                .map_err(|e| heatmap_err(&e))?;
        }
        let mark_style = ("sans-serif", 11)
            .into_font()
            .color(&WHITE)
            .pos(anchor(HPos::Center, VPos::Center));
        let not_run_style = ("sans-serif", 12)
            .into_font()
            .color(&RGBColor(90, 90, 90))
            .pos(anchor(HPos::Left, VPos::Center));
        for (ri, r) in rep.results.iter().enumerate() {
            let y0 = (nr - 1 - ri) as f64;
            if r.diffs.is_empty() {
                let (px, py) = chart.backend_coord(&(0.0, y0 + 0.5));
                root.draw(&Text::new("not run", (px + 6, py), not_run_style.clone()))
                    .map_err(|e| heatmap_err(&e))?;
                continue;
            }
            let first = crate::judge::metrics::first_divergence(&r.diffs).map(|d| d.site.stage);
            for (ci, st) in stages.iter().enumerate() {
                let x0 = ci as f64;
                let d = r.diffs.iter().find(|d| d.site.stage == *st);
                let c = Cell::of(d);
                let fill = match c {
                    Cell::Absent => RGBColor(215, 215, 215),
                    Cell::NonFinite => BLACK,
                    Cell::Value(v) => heat_color(v),
                };
                let rect = [(x0 + 0.05, y0 + 0.05), (x0 + 0.95, y0 + 0.95)];
                chart
                    .draw_series(std::iter::once(Rectangle::new(rect, fill.filled())))
                    .map_err(|e| heatmap_err(&e))?;
                let (cx, cy) = chart.backend_coord(&(x0 + 0.5, y0 + 0.5));
                if matches!(c, Cell::NonFinite) {
                    root.draw(&Text::new("NaN", (cx, cy), mark_style.clone()))
                        .map_err(|e| heatmap_err(&e))?;
                }
                if d.is_some_and(|d| d.is_failure()) {
                    chart
                        .draw_series(std::iter::once(Rectangle::new(rect, RED.stroke_width(4))))
                        .map_err(|e| heatmap_err(&e))?;
                }
                if first == Some(*st) && !matches!(c, Cell::NonFinite) {
                    let style = ("sans-serif", 11)
                        .into_font()
                        .color(&BLACK)
                        .pos(anchor(HPos::Center, VPos::Center));
                    root.draw(&Text::new("1st", (cx, cy), style))
                        .map_err(|e| heatmap_err(&e))?;
                } else if first == Some(*st) {
                    let style = ("sans-serif", 9)
                        .into_font()
                        .color(&WHITE)
                        .pos(anchor(HPos::Center, VPos::Top));
                    root.draw(&Text::new("1st", (cx, cy + 4), style))
                        .map_err(|e| heatmap_err(&e))?;
                }
            }
        }
        draw_legend(&legend, h)?;
        root.present().map_err(|e| heatmap_err(&e))?;
    }
    Ok(svg)
}

/// Writes the report to `path` and the heat map next to it ([`plot_path`]), each through a
/// temporary file and a rename.
///
/// Errors: [`Error::Usage`] when either file exists and `force` is false; [`Error::Io`].
pub fn write(
    path: &Path,
    rep: &RunReport,
    env: &Environment,
    command: &str,
    file: &GgufFile,
    force: bool,
) -> Result<()> {
    let plot = plot_path(path);
    let plot_name = plot
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "plot.svg".into());
    let md = markdown(rep, env, command, file, &plot_name);
    let svg = heatmap_svg(rep)?;
    write_file_atomic(&plot, svg.as_bytes(), force)?;
    write_file_atomic(path, md.as_bytes(), force)
}

/// The command line of this process, shell-quoted, without its output flags (`--report`,
/// `--json` and their values, `--force`, `--quiet`/`-q`, `--wide`, `--stats`), so that it reruns as is and prints
/// the full table: for "how to reproduce" lines.
pub fn reproduce_command() -> String {
    reproduce_from(std::env::args().skip(1))
}

/// [`reproduce_command`] for given arguments (without the program name).
pub fn reproduce_from(args: impl IntoIterator<Item = String>) -> String {
    let mut v = vec!["mla-diff".to_string()];
    let mut skip_value = false;
    for a in args {
        if skip_value {
            skip_value = false;
            continue;
        }
        if a == "--report" || a == "--json" {
            skip_value = true;
            continue;
        }
        if matches!(a.as_str(), "--force" | "--quiet" | "-q" | "--wide" | "--stats")
            || a.starts_with("--report=")
            || a.starts_with("--json=")
        {
            continue;
        }
        v.push(a);
    }
    v.iter().map(|a| shell_quote(a)).collect::<Vec<_>>().join(" ")
}

/// Quotes `s` for a POSIX shell when it holds anything but safe characters.
pub fn shell_quote(s: &str) -> String {
    if !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_./=,:+@%".contains(c)) {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}
