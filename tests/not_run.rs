//! Paths that could not run and faults that never acted or were masked: "not run" with its reason
//! on the terminal, in JSON, in the Markdown report and in its heat map; exit 2 (inconclusive)
//! when nothing ran or an injected fault was never exercised; which of several faults were found
//! and which were downstream of another's divergence.

use crate::common::{repo, run_bin};
use crate::outputs::embedded_report;
use mla_diff::compute::faults::Fault;
use mla_diff::judge::report::{FaultOutcome, Verdict};

/// Fails naming every place where `doc` breaks docs/run-report.schema.json.
fn validate(doc: &serde_json::Value) {
    let schema: serde_json::Value =
        serde_json::from_slice(&std::fs::read(repo().join("docs/run-report.schema.json")).unwrap()).unwrap();
    let validator = jsonschema::validator_for(&schema).unwrap();
    let errors: Vec<String> = validator
        .iter_errors(doc)
        .map(|e| format!("{} at {}", e, e.instance_path()))
        .collect();
    assert!(errors.is_empty(), "{errors:#?}");
}

fn moe_q8() -> String {
    repo()
        .join("golden/models/moe-v3-q8_0.gguf")
        .to_str()
        .unwrap()
        .to_string()
}

/// `moe-v3-q8_0 --tp 2`: the model's own `o_proj` cut lands inside a Q8_0 block on every layer,
/// so no path runs. That is a limit of the run, not a bug: exit 2 with the reason as the last
/// line (`inconclusive: …`, no error line), `not run` in every output, and no "within tolerance"
/// anywhere.
#[test]
fn a_run_where_no_path_could_run_is_inconclusive_everywhere() {
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("r.json");
    let md = tmp.path().join("r.md");
    let m = moe_q8();
    let (code, out, err) = run_bin(&[
        "run",
        "--model",
        &m,
        "--layers",
        "all",
        "--tp",
        "2",
        "--json",
        json.to_str().unwrap(),
        "--report",
        md.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{out}{err}");
    // The verdict, not an error: the run's last line says why nothing was judged.
    assert!(!err.contains("error"), "{err}");
    assert!(
        out.lines().last().unwrap().starts_with(
            "inconclusive: no requested path could run: L0–L2 mha, mqa, chunked, mixed: blk.N.attn_output.weight (Q8_0"
        ),
        "{out}"
    );
    assert!(!out.contains("within tolerance") && !out.contains("finding"), "{out}");
    for p in ["mha", "mqa", "chunked", "mixed"] {
        assert!(
            out.contains(&format!("{p}: not run (L0–L2: blk.N.attn_output.weight")),
            "{out}"
        );
    }
    assert!(
        out.contains("(not run: blk.0.attn_output.weight (Q8_0, blocks of 32"),
        "{out}"
    );
    assert!(out.contains("inconclusive: no requested path could run"), "{out}");

    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(doc["verdict"], "inconclusive");
    assert_eq!(doc["exit_code"], 2);
    assert_eq!(doc["findings"], serde_json::json!([]));
    assert_eq!(doc["not_run"].as_array().unwrap().len(), 12);
    assert_eq!(doc["not_run"][0]["site"], "L0.w.o_proj.rank0");
    assert_eq!(doc["not_run"][0]["by_fault"], false);
    assert!(
        doc["inconclusive_reason"]
            .as_str()
            .unwrap()
            .starts_with("no requested path could run")
    );
    for p in ["mha", "mqa", "chunked", "mixed"] {
        assert_eq!(doc["path_status"][p], "not-run");
    }
    validate(&doc);

    let report = std::fs::read_to_string(&md).unwrap();
    assert!(
        report.starts_with("# mla-diff triage: no requested path could run\n"),
        "{report}"
    );
    assert!(!report.contains("within tolerance"), "{report}");
    assert_eq!(report.matches("</summary>").count(), 12);
    assert_eq!(report.matches(" — not run</summary>").count(), 12, "{report}");
    assert!(report.contains("Not run: blk.2.attn_output.weight (Q8_0"), "{report}");
    let svg = std::fs::read_to_string(tmp.path().join("r.svg")).unwrap();
    assert_eq!(svg.matches("not run").count(), 12, "{svg}");
    let width: u32 = svg
        .split("width=\"")
        .nth(1)
        .and_then(|s| s.split('"').next())
        .and_then(|s| s.parse().ok())
        .unwrap();
    assert!(width >= 560, "{width}");
}

/// With `--inject quant-slice-misaligned` the cut is the fault's: a finding, exit 1 as documented,
/// and the report's tables say `not run`, not "within tolerance".
#[test]
fn an_injected_misaligned_cut_is_a_finding_and_its_paths_are_not_run() {
    let tmp = tempfile::tempdir().unwrap();
    let md = tmp.path().join("q.md");
    let (code, out, err) = run_bin(&[
        "run",
        "--layer",
        "1",
        "--tp",
        "2",
        "--inject",
        "quant-slice-misaligned",
        "--report",
        md.to_str().unwrap(),
    ]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        out.contains("finding [mha, mqa, chunked, mixed] quant-block-misaligned at L1.w.kv_b"),
        "{out}"
    );
    assert!(out.contains("mha: not run (L1: blk.1.attn_v_b.weight"), "{out}");
    let report = std::fs::read_to_string(&md).unwrap();
    assert!(!report.contains("within tolerance"), "{report}");
    assert_eq!(report.matches(" — not run</summary>").count(), 4, "{report}");
}

/// A run where some (layer, path) ran keeps the verdict of what ran and lists the rest.
#[test]
fn a_run_where_some_paths_ran_keeps_its_verdict_and_lists_the_rest() {
    let mut rep = embedded_report(vec![], 1);
    assert_eq!(rep.verdict(), Verdict::Pass);
    // The mqa path's layer, as a layer whose cut could not be served.
    let i = rep.results.iter().position(|r| r.path.name() == "mqa").unwrap();
    rep.results[i].diffs.clear();
    rep.results[i].not_run = Some(mla_diff::judge::report::NotRun {
        site: mla_diff::core::trace::Site::parse("L1.w.o_proj.rank0").unwrap(),
        reason: "blk.1.attn_output.weight (q8_0, blocks of 32 along ne[0]) would be cut at element 48 of ne[0], inside a block (o_proj is row-parallel)".into(),
        by_fault: false,
    });
    assert_eq!(rep.verdict(), Verdict::Pass);
    let lines = mla_diff::output::report::verdict_lines(&rep);
    assert!(
        lines
            .iter()
            .any(|l| l == "mha: all 40 sites within tolerance" || l.starts_with("mha: all ")),
        "{lines:?}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("mqa: not run (L1: blk.1.attn_output.weight")),
        "{lines:?}"
    );
    assert!(!lines.iter().any(|l| l.starts_with("inconclusive")), "{lines:?}");
    let doc = mla_diff::output::report::json(&rep);
    assert_eq!(doc["verdict"], "pass");
    assert_eq!(doc["not_run"][0]["path"], "mqa");
    assert_eq!(doc["path_status"]["mqa"], "not-run");
}

/// `--inject rope-neox --tp 2` on moe-v3-q8_0: the fault acts on every path, none of which can
/// run; the verdict says the fault was never exercised (exit 2).
#[test]
fn a_fault_whose_paths_could_not_run_is_not_exercised() {
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("f.json");
    let m = moe_q8();
    let (code, out, err) = run_bin(&[
        "run",
        "--model",
        &m,
        "--tp",
        "2",
        "--inject",
        "rope-neox",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(!err.contains("error"), "{err}");
    assert!(
        out.lines()
            .last()
            .unwrap()
            .starts_with("inconclusive: no requested path could run: L0 mha, mqa, chunked, mixed"),
        "{out}"
    );
    assert!(
        out.contains("injected rope-neox: not exercised (the paths it acts on did not run (L0 mha, mqa, chunked, mixed: blk.0.attn_output.weight"),
        "{out}"
    );
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(doc["faults"][0]["fault"], "rope-neox");
    assert_eq!(doc["faults"][0]["outcome"], "not-exercised");
    assert_eq!(doc["verdict"], "inconclusive");
    validate(&doc);
}

/// Two faults: the one upstream is found, the other is named as masked by its divergence.
#[test]
fn with_two_faults_the_masked_one_is_named() {
    let rep = embedded_report(vec![Fault::FusedShardSwap, Fault::RopeNeox], 1);
    let st = rep.fault_status();
    assert_eq!(st.len(), 2);
    assert_eq!(st[0].outcome, FaultOutcome::Found);
    assert_eq!(
        st[0].detail,
        "shard-order at L1.w.fused_qkv_a on mha, mqa, chunked, mixed"
    );
    assert_eq!(st[1].outcome, FaultOutcome::Masked);
    assert_eq!(
        st[1].detail,
        "downstream of the first divergence at L1.w.fused_qkv_a (shard-order, from fused-shard-swap) on mha, mqa, chunked, mixed, at or before its own site L1.q_pe_roped; not diagnosed separately"
    );
    let (code, out, err) = run_bin(&[
        "run",
        "--layer",
        "1",
        "--inject",
        "fused-shard-swap",
        "--inject",
        "rope-neox",
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(
        out.contains("injected fused-shard-swap: found (shard-order at L1.w.fused_qkv_a"),
        "{out}"
    );
    assert!(
        out.contains("injected rope-neox: masked (downstream of the first divergence at L1.w.fused_qkv_a"),
        "{out}"
    );
    // Two faults on different paths: both found.
    let rep = embedded_report(vec![Fault::PhantomOutput, Fault::RopeNeox], 1);
    let st = rep.fault_status();
    assert_eq!(st[0].outcome, FaultOutcome::Masked, "{st:?}");
    assert_eq!(st[1].outcome, FaultOutcome::Found, "{st:?}");
    validate(&mla_diff::output::report::json(&rep));
    // One fault found alone adds no line to the findings.
    let rep = embedded_report(vec![Fault::RopeNeox], 1);
    assert!(mla_diff::output::report::fault_lines(&rep).is_empty());
}
