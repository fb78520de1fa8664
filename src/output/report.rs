//! Human and machine output of a run: the terminal table and the versioned JSON document.
//!
//! The person reading the terminal wants the verdict first (per path: everything passes, or the
//! first divergence and what kind of wrong it is) and then a table per path and layer with every
//! site's numbers. Machines get the same content as JSON with a `schema` version. Floats are
//! formatted with fixed rules (`{:.3e}` in tables; shortest round-trip in JSON), so two runs on
//! the same inputs print the same bytes.

use comfy_table::{Cell, ContentArrangement};
use serde::Serialize;
use serde_json::{Value, json};

use crate::core::dtype::Dtype;
use crate::core::sci::sci;
use crate::judge::diagnose::{Finding, Subject};
use crate::judge::label::PathLabel;
use crate::judge::metrics::{self, SiteDiff, Status};
use crate::judge::weights_check::TensorCheck;

use crate::judge::report::{FaultOutcome, PathResult, RunReport, Verdict, summarize_not_run};

/// Version of the `--json` document. Bump on any incompatible change.
pub const JSON_SCHEMA_VERSION: u32 = 6;

/// The status cell: `pass`, or `FAIL` with the failed metrics abbreviated (rel, cos, norm, elem,
/// nan), `SHAPE …`, `no reference`.
pub fn status_word(d: &SiteDiff) -> String {
    match d.status {
        Status::Pass => "pass".into(),
        Status::Fail => format!("FAIL {}", short_metrics(&d.failed)),
        Status::ShapeMismatch => format!("SHAPE {:?} vs {:?}", d.shape_cand, d.shape_ref),
        Status::NoReference => "no reference".into(),
    }
}

/// The numeric cells of one site's row, shared by the terminal table and the Markdown report:
/// rel_l2, cos_diff, norm ratio, the worst element (`max |Δ| at [idx] (ref → cand)`) and the
/// pass fraction; `n/a` when every element is a non-finite mismatch, empty without metrics.
pub fn metric_cells(d: &SiteDiff) -> [String; 5] {
    match &d.metrics {
        Some(m) if m.numel > 0 && m.nonfinite_mismatch == m.numel => [
            "n/a".into(),
            "n/a".into(),
            "n/a".into(),
            format!("all {} elements non-finite", m.numel),
            format!("{:.2}%", 100.0 * m.pass_fraction),
        ],
        Some(m) => [
            sci(m.rel_l2, 3),
            sci(m.cos_diff, 3),
            format!("{:.6}", m.norm_ratio),
            format!(
                "{} at {:?} ({} → {})",
                sci(m.max_abs, 3),
                m.max_abs_index,
                sci(m.max_abs_ref, 3),
                sci(m.max_abs_cand, 3)
            ),
            format!("{:.2}%", 100.0 * m.pass_fraction),
        ],
        None => Default::default(),
    }
}

/// The per-site table of one (layer, path) as text, every column. The first failing site is
/// marked `◀ first`. Failed metrics are abbreviated: rel (rel_l2), cos (cos_diff), norm (norm
/// ratio), elem (fraction of elements within atol + rtol), nan (non-finite positions).
pub fn site_table(diffs: &[SiteDiff]) -> String {
    site_table_fit(diffs, None).0
}

/// The header of the per-site table's columns, in order.
const SITE_COLUMNS: [&str; 8] = [
    "site",
    "shape",
    "status",
    "rel_l2",
    "cos_diff",
    "norm ratio",
    "max |Δ| at [idx] (ref → cand)",
    "pass",
];

/// The order in which columns are left out to fit a terminal (indices into the columns): the
/// worst element, the shape, cos_diff, the norm ratio, the pass fraction. Site, status and
/// rel_l2 always stay.
const DROP_ORDER: [usize; 5] = [6, 1, 4, 5, 7];

/// Width in terminal columns of the widest line of `text`.
fn text_width(text: &str) -> usize {
    text.lines().map(|l| l.chars().count()).max().unwrap_or(0)
}

/// [`site_table`] fitted to `width` terminal columns (`None`: every column, unwrapped): columns
/// are left out (the worst element first, then the shape, cos_diff, the norm ratio and the pass
/// fraction) until the table fits, and what still does not fit wraps inside its cells. Returns
/// the table and the headers of the columns left out.
pub fn site_table_fit(diffs: &[SiteDiff], width: Option<usize>) -> (String, Vec<&'static str>) {
    let first = crate::judge::metrics::first_divergence(diffs).map(|d| d.site);
    let rows: Vec<[String; 8]> = diffs
        .iter()
        .map(|d| {
            let [rel, cos, ratio, worst, pass] = metric_cells(d);
            [
                d.site.to_string(),
                format!("{:?}", d.shape_cand),
                if first == Some(d.site) {
                    format!("{} ◀ first", status_word(d))
                } else {
                    status_word(d)
                },
                rel,
                cos,
                ratio,
                worst,
                pass,
            ]
        })
        .collect();
    let render = |keep: &[usize], fit: Option<usize>| {
        let mut t = crate::output::table::bordered(&keep.iter().map(|&i| SITE_COLUMNS[i]).collect::<Vec<_>>());
        t.set_content_arrangement(ContentArrangement::Disabled);
        for r in &rows {
            t.add_row(keep.iter().map(|&i| Cell::new(&r[i])).collect::<Vec<_>>());
        }
        if let Some(w) = fit {
            crate::output::table::fit(&mut t, w);
        }
        t.to_string()
    };
    let mut keep: Vec<usize> = (0..SITE_COLUMNS.len()).collect();
    let mut dropped = Vec::new();
    let Some(w) = width else {
        return (render(&keep, None), dropped);
    };
    let mut text = render(&keep, None);
    for i in DROP_ORDER {
        if text_width(&text) <= w {
            return (text, dropped);
        }
        keep.retain(|&k| k != i);
        dropped.push(SITE_COLUMNS[i]);
        text = render(&keep, None);
    }
    if text_width(&text) > w {
        text = render(&keep, Some(w));
    }
    (text, dropped)
}

/// One line per path: all pass, where the first divergence is, or not run (with the reason),
/// naming the layers at which a path that ran elsewhere did not; then, when faults were
/// injected and not all of them were simply found (several faults, or one masked, never
/// exercised or missed), one line per fault; then the reason of an inconclusive verdict.
pub fn verdict_lines(report: &RunReport) -> Vec<String> {
    let mut out = Vec::new();
    for (path, first) in report.first_divergence() {
        let of_path: Vec<&PathResult> = report.results.iter().filter(|r| r.path == path).collect();
        let n_sites: usize = of_path.iter().map(|r| r.diffs.len()).sum();
        let skipped: Vec<&PathResult> = of_path.iter().copied().filter(|r| r.diffs.is_empty()).collect();
        let also = if skipped.is_empty() {
            String::new()
        } else {
            format!("; not run at {}", summarize_not_run(&skipped, false))
        };
        if let Some(t) = report.first_loaded_divergence().filter(|_| path == PathLabel::Dump) {
            let then = match first {
                Some(d) => format!("; first failing site {} [{}]", d.site, status_word(d)),
                None if n_sites > 0 => format!("; all {n_sites} sites within tolerance"),
                None => String::new(),
            };
            out.push(format!(
                "{path}: first divergence at {}{then}",
                loaded_weight_text(report, t)
            ));
            continue;
        }
        match first {
            None if n_sites == 0 && skipped.is_empty() => out.push(format!("{path}: not run")),
            None if n_sites == 0 => out.push(format!("{path}: not run ({})", summarize_not_run(&skipped, false))),
            None => match nothing_judged(&of_path) {
                Some(why) => out.push(format!(
                    "{path}: nothing judged ({why}); its {n_sites} sites within tolerance{also}"
                )),
                None => out.push(format!("{path}: all {n_sites} sites within tolerance{also}")),
            },
            Some(d) => {
                let detail = d
                    .metrics
                    .as_ref()
                    .map(|m| {
                        if m.nonfinite_mismatch > 0 {
                            format!(
                                " ({} of {} elements non-finite where the reference is finite)",
                                m.nonfinite_mismatch, m.numel
                            )
                        } else {
                            format!(
                                " (rel_l2 {}, cos_diff {}, norm ratio {:.4})",
                                sci(m.rel_l2, 3),
                                sci(m.cos_diff, 3),
                                m.norm_ratio
                            )
                        }
                    })
                    .unwrap_or_default();
                out.push(format!(
                    "{path}: first divergence at {} [{}]{detail}{also}",
                    d.site,
                    status_word(d)
                ));
            }
        }
    }
    out.extend(fault_lines(report));
    if let Some(why) = report
        .inconclusive_reason()
        .filter(|_| report.verdict() == Verdict::Inconclusive)
    {
        out.push(format!("inconclusive: {why}"));
    }
    out
}

/// Why a path that ran had nothing of its own to act on, when every result of it that ran
/// says so (a note starting with [`crate::compute::path::NOTHING_JUDGED`]); `None` otherwise.
fn nothing_judged(of_path: &[&PathResult]) -> Option<String> {
    let ran: Vec<&PathResult> = of_path.iter().copied().filter(|r| !r.diffs.is_empty()).collect();
    let whys: Vec<String> = ran
        .iter()
        .filter_map(|r| {
            r.notes
                .iter()
                .find_map(|n| n.strip_prefix(crate::compute::path::NOTHING_JUDGED))
                .map(str::to_string)
        })
        .collect();
    (!ran.is_empty() && whys.len() == ran.len()).then(|| whys[0].clone())
}

/// A dump's failing loaded weight as the verdict line names it: `loaded weight
/// L0.gate_up_proj.rank1 [FAIL rel,cos,elem] (rel_l2 …, cos_diff …, norm ratio …)`, or with
/// `SHAPE [a, b] vs [c, d]` when the shapes differ.
fn loaded_weight_text(report: &RunReport, t: &TensorCheck) -> String {
    let dtype = report.loaded_weights.as_ref().map_or(Dtype::F32, |w| w.dtype);
    match &t.metrics {
        Some(m) => format!(
            "loaded weight {} [FAIL {}] (rel_l2 {}, cos_diff {}, norm ratio {:.4})",
            t.name,
            short_metrics(&t.failed(dtype)),
            sci(m.rel_l2, 3),
            sci(m.cos_diff, 3),
            m.norm_ratio
        ),
        None => format!(
            "loaded weight {} [SHAPE {:?} vs {:?}]",
            t.name, t.shape, t.expected_shape
        ),
    }
}

/// The failed metrics abbreviated as the status cell writes them (`rel`, `cos`, `norm`,
/// `elem`, `nan`), joined by commas.
fn short_metrics(failed: &[&'static str]) -> String {
    failed
        .iter()
        .map(|m| match *m {
            "rel_l2" => "rel",
            "cos_diff" => "cos",
            "norm_ratio" => "norm",
            "pass_fraction" => "elem",
            "nonfinite" => "nan",
            other => other,
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// The loaded weights a dump carries, when some fail: a heading with the TP size and the count,
/// and the table of the failing tensors (`weights --check` prints every one). Empty otherwise.
pub fn loaded_weight_lines(report: &RunReport, width: Option<usize>) -> Vec<String> {
    let Some(w) = &report.loaded_weights else {
        return Vec::new();
    };
    let failing = w.failing();
    if failing.is_empty() {
        return Vec::new();
    }
    vec![
        format!(
            "== loaded weights · tp {} · {} of {} tensors differ from the GGUF (judged by the {} weight row) ==",
            w.tp,
            failing.len(),
            w.tensors.len(),
            w.dtype
        ),
        crate::output::weights_check::tensor_table(&failing, width),
    ]
}

/// The label a finding's line gives its origin: the path or dump, `file` for the GGUF itself,
/// `loaded weights` for a tensor of an engine's loaded weights.
pub fn finding_origin(f: &Finding) -> String {
    match &f.subject {
        Subject::Site { path: Some(p), .. } => p.to_string(),
        Subject::Site { path: None, .. } => "file".to_string(),
        Subject::Loaded(_) => "loaded weights".to_string(),
    }
}

/// One line per injected fault (`injected F: found (…)`, `masked (…)`, `not exercised (…)`,
/// `missed (…)`), when there is more to say than the findings do: several faults, or one that
/// was not found. Empty otherwise.
pub fn fault_lines(report: &RunReport) -> Vec<String> {
    let st = report.fault_status();
    if st.len() < 2 && st.iter().all(|f| f.outcome == FaultOutcome::Found) {
        return Vec::new();
    }
    st.iter()
        .map(|f| {
            format!(
                "injected {}: {} ({})",
                f.fault,
                f.outcome.name().replace('-', " "),
                f.detail
            )
        })
        .collect()
}

/// The whole terminal report: header, one table per (layer, path) with every column, verdict
/// lines.
pub fn terminal(report: &RunReport) -> String {
    terminal_fit(report, None)
}

/// [`terminal`] with its tables fitted to `width` terminal columns ([`site_table_fit`]), and a
/// line naming the columns left out; `None` gives every column.
pub fn terminal_fit(report: &RunReport, width: Option<usize>) -> String {
    let mut s = String::new();
    let mut left_out: Vec<&'static str> = Vec::new();
    let c = &report.model.config;
    s.push_str(&format!(
        "model {} ({}, {} layers, {}; softmax scale {:.6}{})\n",
        report.model.path,
        c.arch,
        c.n_layer,
        c.dims_line(),
        c.softmax_scale,
        c.moe.as_ref().map_or(String::new(), |m| format!(
            "; MoE from layer {}: {}",
            c.leading_dense_block_count,
            m.line()
        )) + &c.quirks().iter().map(|q| format!("; {q}")).collect::<String>()
    ));
    s.push_str(&format!("{}\n", run_line(report)));
    for l in dump_lines(report) {
        s.push_str(&l);
        s.push('\n');
    }
    let loaded = loaded_weight_lines(report, width);
    if !loaded.is_empty() {
        s.push('\n');
        for l in loaded {
            s.push_str(&l);
            s.push('\n');
        }
    }
    for r in &report.results {
        match &r.step {
            Some(k) => s.push_str(&format!("\n== layer {} · path {} · step {k} ==\n", r.layer, r.path)),
            None => s.push_str(&format!("\n== layer {} · path {} ==\n", r.layer, r.path)),
        }
        if r.diffs.is_empty() {
            match &r.not_run {
                Some(n) => s.push_str(&format!("(not run: {})\n", n.reason)),
                None => s.push_str("(not run)\n"),
            }
        } else {
            let (table, dropped) = site_table_fit(&r.diffs, width);
            for d in dropped {
                if !left_out.contains(&d) {
                    left_out.push(d);
                }
            }
            s.push_str(&table);
            s.push('\n');
        }
        for n in &r.notes {
            s.push_str(&format!("note: {n}\n"));
        }
        for d in r.diffs.iter().filter(|d| d.note.is_some()) {
            s.push_str(&format!("note: {}: {}\n", d.site, d.note.as_deref().unwrap_or("")));
        }
    }
    s.push('\n');
    for l in verdict_lines(report) {
        s.push_str(&l);
        s.push('\n');
    }
    for l in finding_lines(report) {
        s.push_str(&l);
        s.push('\n');
    }
    if let (Some(w), false) = (width, left_out.is_empty()) {
        s.push_str(&format!(
            "(tables fitted to {w} columns, without: {}; --wide, --json or --report has every column)\n",
            left_out.join(", ")
        ));
    }
    s
}

/// One line describing what ran: input, batch, seed, dtype, paging, TP, the chunked path's
/// chunk size and new tokens, faults; for a dump,
/// the file, engine, batch, the engine's dtype, the tolerance rows applied (marked `(kernel
/// precision)` when a kernel precision chose them instead of the engine dtype) and the map.
pub fn run_line(report: &RunReport) -> String {
    let r = &report.run;
    if let Some(d) = &report.dump {
        let lens: Vec<String> = r.batch.seqs.iter().map(|s| s.len.to_string()).collect();
        let starts: Vec<String> = r.batch.seqs.iter().map(|s| s.start_pos.to_string()).collect();
        return format!(
            "dump {} from engine `{}`, T={} in {} sequence(s) [{}] from position(s) [{}], engine dtype {}, tolerance rows {}{}, map {}",
            d.path,
            d.engine,
            r.batch.n_tokens(),
            r.batch.seqs.len(),
            lens.join(","),
            starts.join(","),
            d.dtype,
            d.tolerance_rows,
            // Rows other than the engine dtype's come from declared fp8 (the header's act_quant
            // or kv_cache_quant, listed among the conversions) or a kernel precision.
            match d.tolerance_rows {
                r if r == d.dtype.precision() => "",
                crate::judge::tolerance::Precision::Fp8 | crate::judge::tolerance::Precision::Bf16Fp8 =>
                    " (the header declares fp8: see the conversions)",
                _ => " (kernel precision)",
            },
            d.map.as_deref().unwrap_or("none")
        );
    }
    let o = &r.path_options;
    let lens: Vec<String> = r.batch.seqs.iter().map(|s| s.len.to_string()).collect();
    let start = r.batch.seqs.first().map_or(0, |s| s.start_pos);
    let faults: Vec<&str> = o.faults.0.iter().map(|f| f.name()).collect();
    let fp8: Vec<String> = [o.fp8.map(|a| a.describe()), o.kv_cache.map(|k| k.describe())]
        .into_iter()
        .flatten()
        .collect();
    let fp8 = if fp8.is_empty() {
        String::new()
    } else {
        format!(", {} (judged by the fp8 rows)", fp8.join(", "))
    };
    format!(
        "input {}, T={} in {} sequence(s) [{}] from position {}, seed {}, dtype {}, page size {}, splits {}, tp {}, chunk {}, new tokens {}{fp8}{}",
        r.input.name(),
        r.batch.n_tokens(),
        r.batch.seqs.len(),
        lens.join(","),
        start,
        r.seed,
        r.dtype,
        o.page_size,
        o.num_splits,
        o.tp,
        o.chunk_size,
        o.new_tokens,
        if faults.is_empty() {
            String::new()
        } else {
            format!(", injected: {}", faults.join(", "))
        }
    )
}

/// For a dump: the conversions applied, the sites not dumped and the tensors ignored (one line
/// each, lists shortened past 12 entries). Empty for `run`.
pub fn dump_lines(report: &RunReport) -> Vec<String> {
    let Some(d) = &report.dump else {
        return Vec::new();
    };
    fn short(v: &[String]) -> String {
        if v.len() <= 12 {
            v.join(", ")
        } else {
            format!("{}, … ({} in all)", v[..12].join(", "), v.len())
        }
    }
    let mut out = Vec::new();
    // The engine's own patches are provenance, not conversions: one line naming them; the
    // JSON `dump.patches` and the report's "Engine patches" list each with its reason.
    if !d.patches.is_empty() {
        let names: Vec<&str> = d
            .patches
            .iter()
            .map(|p| p.split_once(": ").map_or(p.as_str(), |(n, _)| n).trim_matches('`'))
            .collect();
        out.push(format!(
            "engine patches: {} ({}): the engine ran with them; --json and --report list each with its reason",
            names.len(),
            names.join(", ")
        ));
    }
    for c in &d.conversions {
        out.push(format!("converted {c}"));
    }
    // A dump of several steps lists its missing sites per step (`STEP: SITE`); steps that lack
    // the same sites share a line.
    let mut groups: Vec<(Vec<&str>, Vec<String>)> = Vec::new();
    for entry in &d.not_dumped {
        let (step, site) = entry.split_once(": ").unwrap_or(("", entry.as_str()));
        match groups.iter_mut().find(|(steps, _)| steps.last() == Some(&step)) {
            Some((_, sites)) => sites.push(site.to_string()),
            None => groups.push((vec![step], vec![site.to_string()])),
        }
    }
    let mut merged: Vec<(Vec<&str>, Vec<String>)> = Vec::new();
    for (steps, sites) in groups {
        match merged.iter_mut().find(|(_, s)| *s == sites) {
            Some((st, _)) => st.extend(steps),
            None => merged.push((steps, sites)),
        }
    }
    for (steps, sites) in &merged {
        if steps == &[""] {
            out.push(format!("not dumped (not compared): {}", short(sites)));
        } else {
            out.push(format!(
                "not dumped in {} (not compared): {}",
                steps.join(", "),
                short(sites)
            ));
        }
    }
    if !d.ignored.is_empty() {
        out.push(format!(
            "ignored (not sites, not renamed by a map): {}",
            short(&d.ignored)
        ));
    }
    out
}

/// One paragraph per finding: class, site (and, in a dump of several steps, the step it first
/// diverged in), path, evidence, hint. Findings that say the same thing (class, site, step,
/// evidence and hint) on several paths share one paragraph naming every path
/// (`finding [mha, mqa, chunked, mixed] …`), so one bug is printed once.
pub fn finding_lines(report: &RunReport) -> Vec<String> {
    let mut groups: Vec<(Vec<String>, String)> = Vec::new();
    for f in &report.findings {
        let body = format!(
            "{} at {}{}: {}\n  hint: {}",
            f.class,
            f.subject,
            finding_step(report, f).map_or(String::new(), |s| format!(" in {s}")),
            f.evidence,
            f.hint
        );
        let origin = finding_origin(f);
        match groups.iter_mut().find(|(_, b)| *b == body) {
            Some((origins, _)) if !origins.contains(&origin) => origins.push(origin),
            Some(_) => {}
            None => groups.push((vec![origin], body)),
        }
    }
    groups
        .into_iter()
        .map(|(origins, body)| format!("finding [{}] {body}", origins.join(", ")))
        .collect()
}

/// The step of a format-2 dump in which a finding's site is its path's first divergence
/// (`decode-1`, `step-3`); `None` for runs, single-step dumps and findings about other subjects.
fn finding_step<'a>(report: &'a RunReport, f: &Finding) -> Option<&'a str> {
    let Subject::Site { site, path: Some(p) } = &f.subject else {
        return None;
    };
    let with_steps: Vec<&PathResult> = report
        .results
        .iter()
        .filter(|r| r.path == *p && r.step.is_some())
        .collect();
    if with_steps.len() < 2 {
        return None;
    }
    with_steps
        .iter()
        .find(|r| metrics::first_divergence(&r.diffs).is_some_and(|d| d.site == *site))
        .and_then(|r| r.step.as_deref())
}

/// Per path: `pass` (every site within tolerance), `divergence`, or `not-run` (no site recorded,
/// e.g. a TP cut inside a quant block; its finding says why).
pub fn path_status(report: &RunReport) -> serde_json::Map<String, Value> {
    report
        .first_divergence()
        .into_iter()
        .map(|(p, d)| {
            let n_sites: usize = report
                .results
                .iter()
                .filter(|r| r.path == p)
                .map(|r| r.diffs.len())
                .sum();
            let loaded = p == PathLabel::Dump && report.first_loaded_divergence().is_some();
            let st = match d {
                _ if loaded => "divergence",
                _ if n_sites == 0 => "not-run",
                None if report.findings.iter().any(|f| f.path() == Some(p)) => "divergence",
                None => "pass",
                Some(_) => "divergence",
            };
            (p.name().to_string(), Value::from(st))
        })
        .collect()
}

/// The `--json` document (schema [`JSON_SCHEMA_VERSION`]).
pub fn json(report: &RunReport) -> Value {
    let sites: Vec<Value> = report
        .results
        .iter()
        .flat_map(|r| {
            r.diffs.iter().map(move |d| {
                let mut v = json!({
                    "path": r.path,
                    "site": d.site,
                    "status": d.status,
                    "shape": d.shape_cand,
                    "shape_ref": d.shape_ref,
                    "failed": d.failed,
                    "metrics": d.metrics,
                });
                if let (Some(n), Some(o)) = (&d.note, v.as_object_mut()) {
                    o.insert("note".into(), json!(n));
                }
                if let (Some(k), Some(o)) = (&r.step, v.as_object_mut()) {
                    o.insert("step".into(), json!(k));
                }
                v
            })
        })
        .collect();
    let first: serde_json::Map<String, Value> = report
        .first_divergence()
        .into_iter()
        .map(|(p, d)| {
            // A dump's failing loaded weight comes before any site.
            let loaded = report
                .first_loaded_divergence()
                .filter(|_| p == PathLabel::Dump)
                .map(|t| {
                    let dtype = report.loaded_weights.as_ref().map_or(Dtype::F32, |w| w.dtype);
                    json!({
                        "tensor": t.name,
                        "status": if t.metrics.is_some() { "fail" } else { "shape-mismatch" },
                        "failed": t.failed(dtype),
                        "metrics": t.metrics,
                    })
                });
            (
                p.name().to_string(),
                loaded.unwrap_or_else(|| {
                    d.map_or(
                        Value::Null,
                        |d| json!({"site": d.site, "status": d.status, "failed": d.failed, "metrics": d.metrics}),
                    )
                }),
            )
        })
        .collect();
    let not_run: Vec<Value> = report
        .not_run()
        .iter()
        .map(|r| {
            json!({
                "layer": r.layer,
                "path": r.path,
                "site": r.not_run.as_ref().map(|n| n.site),
                "reason": r.not_run.as_ref().map_or("no site recorded", |n| n.reason.as_str()),
                "by_fault": r.not_run.as_ref().is_some_and(|n| n.by_fault),
            })
        })
        .collect();
    let verdict = report.verdict();
    json!({
        "schema": JSON_SCHEMA_VERSION,
        "tool": {"name": "mla-diff", "version": env!("CARGO_PKG_VERSION")},
        "model": report.model,
        "run": report.run,
        "token_ids": report.token_ids,
        "sites": sites,
        "first_divergence": first,
        "path_status": path_status(report),
        "not_run": not_run,
        "faults": report.fault_status(),
        "verdict": verdict.name(),
        "exit_code": verdict.exit_code(),
        "inconclusive_reason": report.inconclusive_reason().filter(|_| verdict == Verdict::Inconclusive),
        "findings": report.findings,
        "dump": report.dump,
    })
}

/// Serializes `value` as pretty JSON with a trailing newline.
pub fn to_json_bytes<T: Serialize>(value: &T) -> Vec<u8> {
    let mut v = serde_json::to_vec_pretty(value).unwrap_or_default();
    v.push(b'\n');
    v
}
