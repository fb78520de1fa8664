//! The docs against the enums they describe. The bug classes are listed in README.md's class
//! table, docs/faults.md's class table, docs/design.md's diagnosis table and the JSON schema's
//! `class` enum, the faults in docs/faults.md's fault table and README.md's `--inject` column:
//! each must hold exactly the names of `Class::ALL` (or `Fault::ALL`), in that order, so a class
//! or fault added to the code and not to a doc (or the other way round) fails here, naming the
//! file, the table and the name. `Class::ALL` and `Fault::ALL` must hold every variant, and the
//! precedence table of the site detectors must follow `Class::ALL`. The report excerpts of
//! README.md and docs/guide.md must be what their command prints.

use std::collections::BTreeSet;

use mla_diff::compute::faults::Fault;
use mla_diff::core::class::Class;

use crate::common::{repo, run_bin};

/// Every variant of an enum, from one list that also feeds an exhaustive match: a variant added
/// to the enum does not compile until it is listed here, and the test below then fails until
/// the enum's `ALL` holds it too.
macro_rules! every_variant {
    ($ty:ident: $($v:ident),* $(,)?) => {{
        #[allow(dead_code)]
        fn exhaustive(x: $ty) {
            match x {
                $($ty::$v)|* => {}
            }
        }
        vec![$($ty::$v),*]
    }};
}

fn every_class() -> Vec<Class> {
    every_variant!(Class:
        WeightNotLoaded, PhantomOutput, UnwrittenRows, ShardOrder, TpRankOrder, TpReduce, KvBLayout,
        QuantBlockMisaligned, QuantScaleLayout, Transposed, NormSkipped, RopeStyle, SoftmaxScale, LseMerge, MoeRouting,
        IndexerRopeStyle, IndexerTopkStale, IndexerSelection, ResidualScale, Fp8ActScale, Precision, Nonfinite, ScaleOnly,
        PathDisagreement, Mismatch, WeightNonfinite,
        StridedView, PagedKv, KvCacheScale,
    )
}

fn every_fault() -> Vec<Fault> {
    every_variant!(Fault:
        PhantomOutput, UnwrittenRows, FusedShardSwap, TpRankOrder, TpRank0Everywhere, TpGateUpRank0,
        KvBGrouped, KBUntransposed, RopeNeox, NoMscale, RopeCosScaled, LsePlusInf, QuantSliceMisaligned,
        StridedKvC, IndexerRopeInterleaved, IndexerTopkStale, AllReduceTwice, AllReduceSkipRank,
        AllReduceReadEarly, PhantomOutputStale, KvNormSkipped, SplitLseBase2, SplitDropped,
        SplitDuplicated, SplitEmptyZero, SplitEmptyFinite, ResidualScaled, Fp16AccumQlNope,
        PagedKvPageSize, PagedKvBlockOffset, SlotMappingOffset, KPeStride, KvBHalvesSwapped, KvBHeadsInterleaved,
        Fp8ScalePaddedRows, KvCacheScaleTwice, Fp8ScaleTransposed, Fp8QueryUnscaled, Fp8ScaleShardRank0,
    )
}

/// What is wrong with `all` as a list of every variant once: a variant missing, or one twice.
fn all_problems<T: Copy + Ord + std::fmt::Debug>(what: &str, all: &[T], every: &[T]) -> Vec<String> {
    let mut out = Vec::new();
    for v in every {
        match all.iter().filter(|a| *a == v).count() {
            0 => out.push(format!("{what} lacks {v:?}")),
            1 => {}
            n => out.push(format!("{what} holds {v:?} {n} times")),
        }
    }
    out
}

#[test]
fn class_all_and_fault_all_hold_every_variant_once() {
    let mut problems = all_problems("Class::ALL", &Class::ALL, &every_class());
    problems.extend(all_problems("Fault::ALL", Fault::ALL, &every_fault()));
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The cells of one Markdown table row, trimmed (`\|` inside a cell is not a separator).
fn cells(row: &str) -> Vec<String> {
    let inner = row.trim().trim_start_matches('|').trim_end_matches('|');
    let mut out = vec![String::new()];
    let mut prev = ' ';
    for c in inner.chars() {
        if c == '|' && prev != '\\' {
            out.push(String::new());
        } else {
            out.last_mut().unwrap().push(c);
        }
        prev = c;
    }
    out.into_iter().map(|c| c.trim().to_string()).collect()
}

/// The body rows of the first table under the heading `heading` of `file` whose header row starts
/// with `header`, as cells; a failure message when there is no such table.
fn table(file: &str, heading: &str, header: &str) -> Result<Vec<Vec<String>>, String> {
    let text = std::fs::read_to_string(repo().join(file)).map_err(|e| format!("{file}: {e}"))?;
    let lines: Vec<&str> = text.lines().collect();
    let h = lines
        .iter()
        .position(|l| l.trim_end() == heading)
        .ok_or_else(|| format!("{file}: no heading `{heading}`"))?;
    let level = heading.split(' ').next().unwrap_or("#");
    let end = lines[h + 1..]
        .iter()
        .position(|l| {
            l.split(' ')
                .next()
                .is_some_and(|m| !m.is_empty() && m.chars().all(|c| c == '#') && m.len() <= level.len())
        })
        .map_or(lines.len(), |i| h + 1 + i);
    let start = lines[h + 1..end]
        .iter()
        .position(|l| l.starts_with(header))
        .map(|i| h + 1 + i)
        .ok_or_else(|| format!("{file}, `{heading}`: no table whose header starts `{header}`"))?;
    Ok(lines[start + 2..end]
        .iter()
        .take_while(|l| l.starts_with('|'))
        .map(|l| cells(l))
        .collect())
}

/// The text of the first `code span` of a cell.
fn first_code(cell: &str) -> Option<&str> {
    let a = cell.find('`')? + 1;
    let b = a + cell[a..].find('`')?;
    Some(&cell[a..b])
}

/// Every code span of a cell that is a kebab-case name (`rope-neox`, not `weights --check`).
fn kebab_codes(cell: &str) -> Vec<&str> {
    cell.split('`')
        .skip(1)
        .step_by(2)
        .filter(|s| {
            !s.is_empty()
                && s.split('-')
                    .all(|p| !p.is_empty() && p.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit()))
        })
        .collect()
}

/// How `got` (the names a doc lists, in its order) differs from `want` (the code's, in its
/// order): each missing and extra name, else the first position where the order differs.
fn name_problems(place: &str, source: &str, got: &[String], want: &[&str]) -> Vec<String> {
    let mut out = Vec::new();
    let got_set: BTreeSet<&str> = got.iter().map(String::as_str).collect();
    let want_set: BTreeSet<&str> = want.iter().copied().collect();
    for w in want.iter().filter(|w| !got_set.contains(**w)) {
        out.push(format!("{place}: missing `{w}` (in {source})"));
    }
    for g in got.iter().filter(|g| !want_set.contains(g.as_str())) {
        out.push(format!("{place}: extra `{g}` (not in {source})"));
    }
    let mut seen = BTreeSet::new();
    for g in got {
        if !seen.insert(g.as_str()) {
            out.push(format!("{place}: `{g}` listed twice"));
        }
    }
    // The order, over the names both hold.
    let got_common: Vec<&str> = got
        .iter()
        .map(String::as_str)
        .filter(|g| want_set.contains(g))
        .collect();
    let want_common: Vec<&str> = want.iter().copied().filter(|w| got_set.contains(w)).collect();
    if let Some(i) = (0..got_common.len().min(want_common.len())).find(|&i| got_common[i] != want_common[i]) {
        out.push(format!(
            "{place}: misordered: `{}` is listed where {source} has `{}` (the order of {source})",
            got_common[i], want_common[i]
        ));
    }
    out
}

/// Column `col` of a table, each cell's first code span.
fn names(rows: &[Vec<String>], col: usize) -> Vec<String> {
    rows.iter()
        .map(|r| {
            r.get(col)
                .and_then(|c| first_code(c))
                .unwrap_or("<no `name` in the cell>")
                .to_string()
        })
        .collect()
}

fn class_names() -> Vec<&'static str> {
    Class::ALL.iter().map(|c| c.name()).collect()
}

#[test]
fn every_class_table_lists_class_all_in_order() {
    let want = class_names();
    let mut problems = Vec::new();
    for (file, heading, header, col) in [
        ("README.md", "## Bug classes", "| class |", 0),
        ("docs/faults.md", "## Bug classes", "| # | class |", 1),
        ("docs/design.md", "## Diagnosis", "| class |", 0),
    ] {
        match table(file, heading, header) {
            Err(e) => problems.push(e),
            Ok(rows) => {
                let place = format!("{file}, table under `{heading}` (column {})", col + 1);
                problems.extend(name_problems(&place, "Class::ALL", &names(&rows, col), &want));
            }
        }
    }
    // The JSON schema's `class` enums (the findings of both document kinds).
    let schema: serde_json::Value =
        serde_json::from_slice(&std::fs::read(repo().join("docs/run-report.schema.json")).unwrap()).unwrap();
    let mut enums = Vec::new();
    class_enums(&schema, &mut enums);
    if enums.is_empty() {
        problems.push("docs/run-report.schema.json: no `class` property with an `enum`".into());
    }
    for e in enums {
        problems.extend(name_problems(
            "docs/run-report.schema.json, the `class` enum",
            "Class::ALL",
            &e,
            &want,
        ));
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// Every `enum` of a property named `class` in a JSON schema.
fn class_enums(v: &serde_json::Value, out: &mut Vec<Vec<String>>) {
    match v {
        serde_json::Value::Object(m) => {
            if let Some(list) = m
                .get("properties")
                .and_then(|p| p.get("class"))
                .and_then(|c| c.get("enum"))
                .and_then(|e| e.as_array())
            {
                out.push(
                    list.iter()
                        .map(|s| s.as_str().unwrap_or("<not a string>").to_string())
                        .collect(),
                );
            }
            m.values().for_each(|x| class_enums(x, out));
        }
        serde_json::Value::Array(a) => a.iter().for_each(|x| class_enums(x, out)),
        _ => {}
    }
}

#[test]
fn faults_md_numbers_its_classes_from_one() {
    let rows = table("docs/faults.md", "## Bug classes", "| # | class |").unwrap();
    for (i, r) in rows.iter().enumerate() {
        assert_eq!(
            r[0],
            (i + 1).to_string(),
            "docs/faults.md, `## Bug classes`: row {}",
            i + 1
        );
    }
}

#[test]
fn every_fault_table_lists_fault_all_with_its_class() {
    let mut problems = Vec::new();
    // docs/faults.md: every fault in catalogue order, its class first in the class column.
    match table("docs/faults.md", "## Faults", "| fault |") {
        Err(e) => problems.push(e),
        Ok(rows) => {
            let place = "docs/faults.md, table under `## Faults` (column 1)";
            let want: Vec<&str> = Fault::ALL.iter().map(|f| f.name()).collect();
            problems.extend(name_problems(place, "Fault::ALL", &names(&rows, 0), &want));
            for r in &rows {
                let name = r.first().and_then(|c| first_code(c)).unwrap_or("");
                let Some(f) = Fault::ALL.iter().find(|f| f.name() == name) else {
                    continue; // reported above
                };
                let got = r.get(3).and_then(|c| first_code(c)).unwrap_or("");
                if got != f.expected_class().name() {
                    problems.push(format!(
                        "docs/faults.md, table under `## Faults`: `{f}` has class `{got}`, Fault::expected_class says `{}`",
                        f.expected_class()
                    ));
                }
            }
        }
    }
    // README.md: each class's `--inject` column lists exactly the faults that must produce it.
    match table("README.md", "## Bug classes", "| class |") {
        Err(e) => problems.push(e),
        Ok(rows) => {
            for r in &rows {
                let name = r.first().and_then(|c| first_code(c)).unwrap_or("");
                let Some(class) = Class::ALL.into_iter().find(|c| c.name() == name) else {
                    continue; // reported by every_class_table_lists_class_all_in_order
                };
                let got: Vec<String> = r
                    .get(2)
                    .map(|c| kebab_codes(c).into_iter().map(String::from).collect())
                    .unwrap_or_default();
                let want: Vec<&str> = Fault::ALL
                    .iter()
                    .filter(|f| f.expected_class() == class)
                    .map(|f| f.name())
                    .collect();
                let place = format!("README.md, table under `## Bug classes`, row `{class}`, `--inject` column");
                problems.extend(name_problems(
                    &place,
                    "the faults whose Fault::expected_class it is",
                    &got,
                    &want,
                ));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The site detectors' precedence table (`DETECTORS` in src/judge/diagnose/mod.rs) names its
/// classes in `Class::ALL`'s order (it holds only the classes a site detector names; a class
/// with several detectors lists them together).
#[test]
fn the_detector_precedence_follows_class_all() {
    let src = std::fs::read_to_string(repo().join("src/judge/diagnose/mod.rs")).unwrap();
    let start = src
        .find("const DETECTORS")
        .expect("src/judge/diagnose/mod.rs has DETECTORS");
    let body = &src[start..start + src[start..].find("];").unwrap()];
    let got: Vec<&str> = body
        .lines()
        .filter_map(|l| l.trim().strip_prefix("(Class::"))
        .map(|l| l.split(',').next().unwrap())
        .collect();
    assert!(got.len() >= 10, "DETECTORS: {got:?}");
    let order: Vec<String> = Class::ALL.iter().map(|c| format!("{c:?}")).collect();
    let pos = |v: &str| {
        order
            .iter()
            .position(|o| o == v)
            .unwrap_or_else(|| panic!("DETECTORS names Class::{v}, not in Class::ALL"))
    };
    for w in got.windows(2) {
        assert!(
            pos(w[0]) <= pos(w[1]),
            "src/judge/diagnose/mod.rs, DETECTORS: Class::{} is tried before Class::{}, Class::ALL has them the other way round",
            w[0],
            w[1]
        );
    }
}

/// The report excerpts of README.md and docs/guide.md are what their command prints: every line
/// of an excerpt (a line cut with `…` up to the cut) begins a line of the output, in order.
#[test]
fn the_report_excerpts_are_what_the_command_prints() {
    let (code, out, err) = run_bin(&["run", "--layer", "1", "--path", "mqa", "--inject", "fused-shard-swap"]);
    assert_eq!(code, 1, "{err}");
    for file in ["README.md", "docs/guide.md"] {
        let text = std::fs::read_to_string(repo().join(file)).unwrap();
        let intro = "`mla-diff run --layer 1 --path mqa --inject fused-shard-swap` prints";
        let at = text
            .find(intro)
            .unwrap_or_else(|| panic!("{file} introduces its report excerpt with {intro}"));
        let block = &text[at..];
        let open = block.find("```\n").expect("the excerpt's code block") + 4;
        let excerpt = &block[open..open + block[open..].find("```").unwrap()];
        let mut lines = out.lines();
        let mut n = 0;
        for want in excerpt.lines() {
            let want = want.trim_end();
            if want == "…" || want.is_empty() {
                continue;
            }
            let prefix = want.strip_suffix('…').unwrap_or(want).trim_end();
            assert!(
                lines.any(|l| l.starts_with(prefix)),
                "{file}'s excerpt line\n{want}\nbegins no later line of the output:\n{out}"
            );
            n += 1;
        }
        assert!(n >= 5, "{file}'s excerpt has {n} lines");
    }
}
