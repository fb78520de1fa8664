//! The terminal text of `selftest`: the confusion table of faults against findings, the clean
//! runs per fixture, and every case that did not come out as expected.
//!
//! Selftest is the proof that the detectors work, so its summary must show at a glance which
//! fault was found as which class at which first site, per path, and where a clean run raised a
//! false alarm; the JSON of the same [`SelftestReport`] keeps every case.

use std::collections::BTreeMap;

use comfy_table::Table;

use crate::compute::faults::Fault;
use crate::compute::path::PathKind;
use crate::judge::selftest::{CaseResult, SelftestReport};
use crate::output::table;

/// The confusion table (fault × found class × first site), the clean-run summary and every case
/// that did not come out as expected.
pub fn confusion_table(rep: &SelftestReport) -> String {
    let mut s = String::new();
    s.push_str("faults (every fixture, every path each applies to)\n");
    s.push_str(&fault_table(rep).to_string());
    s.push('\n');
    s.push_str("\nclean runs\n");
    s.push_str(&clean_table(rep).to_string());
    s.push('\n');

    let bad: Vec<&CaseResult> = rep.cases.iter().filter(|c| !c.ok()).collect();
    if !bad.is_empty() {
        s.push_str("\nnot as expected:\n");
        for c in bad {
            s.push_str(&format!(
                "  {} {} path {} tp {} page {}: {} (expected {}; found {})\n",
                c.fixture,
                c.case,
                c.path,
                c.tp,
                c.page,
                c.verdict,
                c.expected
                    .as_ref()
                    .map_or("no finding".into(), |(cl, st)| format!("{cl} at {}", st.join("|"))),
                c.found.as_ref().map_or("nothing".into(), |f| format!(
                    "{} at {}: {}",
                    f.class, f.subject, f.evidence
                )),
            ));
        }
    }
    if let Some(d) = &rep.dequant {
        s.push_str(&format!(
            "\ndequantization on the device vs the CPU: {} tensors, {} values, {} bit mismatches (types {})\n",
            d.tensors,
            d.elements,
            d.mismatches,
            d.types.join(", ")
        ));
        if let Some(m) = &d.first_mismatch {
            s.push_str(&format!("  first mismatch: {m}\n"));
        }
    }
    let total = rep.cases.len();
    let ok = rep.cases.iter().filter(|c| c.ok()).count();
    s.push_str(&format!(
        "\nselftest: {ok}/{total} cases as expected in {:.1} s\n",
        rep.seconds
    ));
    s
}

/// One row per fault of [`Fault::ALL`]: its expected class and first sites, the class and first
/// site found (with counts, per path in [`PathKind::ALL`] order), and how many cases were right.
fn fault_table(rep: &SelftestReport) -> Table {
    let mut by_fault: BTreeMap<String, Vec<&CaseResult>> = BTreeMap::new();
    for c in rep.cases.iter().filter(|c| c.case != "clean") {
        by_fault.entry(c.case.clone()).or_default().push(c);
    }
    let mut t = table::bordered(&[
        "fault",
        "expected class",
        "expected first site",
        "found class @ first site (cases)",
        "ok",
    ]);
    for f in Fault::ALL {
        let Some(cs) = by_fault.get(f.name()) else {
            t.add_row(vec![
                f.name().to_string(),
                f.expected_class().to_string(),
                "-".into(),
                "not applicable to any fixture".into(),
                "-".into(),
            ]);
            continue;
        };
        // Keyed by (path order, text) so both columns list mha, mqa, chunked, mixed in order.
        let mut found: BTreeMap<(usize, String), usize> = BTreeMap::new();
        let mut sites: Vec<String> = Vec::new();
        for c in cs {
            if let Some((_, st)) = &c.expected {
                for x in st {
                    let x = format!("{}: {x}", c.path);
                    if !sites.contains(&x) {
                        sites.push(x);
                    }
                }
            }
            let k = match &c.found {
                Some(fi) => format!(
                    "{}: {} @ {}",
                    c.path,
                    fi.class,
                    fi.site().map_or_else(|| "-".to_string(), |s| s.stage.name())
                ),
                None => format!("{}: nothing", c.path),
            };
            let order = PathKind::ALL.iter().position(|&p| p == c.path).unwrap_or(0);
            *found.entry((order, k)).or_default() += 1;
        }
        let ok = cs.iter().filter(|c| c.ok()).count();
        t.add_row(vec![
            f.name().to_string(),
            f.expected_class().to_string(),
            sites.join("\n"),
            found
                .iter()
                .map(|((_, k), v)| format!("{k} ({v})"))
                .collect::<Vec<_>>()
                .join("\n"),
            format!("{ok}/{}", cs.len()),
        ]);
    }
    t
}

/// One row per fixture: its clean runs (path × TP × page), the TP and page sizes covered, and
/// the false alarms among them.
fn clean_table(rep: &SelftestReport) -> Table {
    let mut by_fix: BTreeMap<String, (usize, usize, String, String)> = BTreeMap::new();
    for c in rep.cases.iter().filter(|c| c.case == "clean") {
        let e = by_fix.entry(c.fixture.clone()).or_default();
        e.0 += 1;
        if !c.ok() {
            e.1 += 1;
        }
        if !e.2.split(',').any(|x| x == c.tp.to_string()) {
            if !e.2.is_empty() {
                e.2.push(',');
            }
            e.2.push_str(&c.tp.to_string());
        }
        if !e.3.split(',').any(|x| x == c.page.to_string()) {
            if !e.3.is_empty() {
                e.3.push(',');
            }
            e.3.push_str(&c.page.to_string());
        }
    }
    let mut t = table::bordered(&[
        "fixture",
        "clean runs (path × tp × page)",
        "tp sizes",
        "page sizes",
        "false alarms",
    ]);
    for (f, (n, bad, tps, pages)) in &by_fix {
        t.add_row(vec![
            f.clone(),
            n.to_string(),
            tps.clone(),
            pages.clone(),
            bad.to_string(),
        ]);
    }
    t
}
