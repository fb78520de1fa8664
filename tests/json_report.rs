//! The `--json` document: every produced file validates against the published schema
//! (docs/run-report.schema.json), and the same inputs give byte-identical files.

use crate::common::{repo, run_bin};

fn schema() -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(repo().join("docs/run-report.schema.json")).unwrap()).unwrap()
}

fn produce(dir: &std::path::Path, name: &str, extra: &[&str]) -> (i32, Vec<u8>) {
    let p = dir.join(name);
    let mut args = vec!["run", "--backend", "cpu", "--quiet", "--json", p.to_str().unwrap()];
    args.extend_from_slice(extra);
    let (code, out, err) = run_bin(&args);
    assert!(code == 0 || code == 1, "{out}\n{err}");
    (code, std::fs::read(&p).unwrap())
}

#[test]
fn produced_files_validate_against_the_schema() {
    let validator = jsonschema::validator_for(&schema()).expect("the schema itself is valid");
    let dir = tempfile::tempdir().unwrap();
    let legacy = repo().join("golden/models/legacy-kvb-f32.gguf");
    let yarn = repo().join("golden/models/yarn-v3-f32.gguf");
    let dsa = repo().join("golden/models/dsa-glm-q8_0.gguf");
    let moe = repo().join("golden/models/moe-v3-q8_0.gguf");
    let cases: Vec<(&str, Vec<&str>, i32)> = vec![
        ("clean.json", vec!["--layer", "1"], 0),
        ("fp8.json", vec!["--layer", "1", "--fp8-compute", "token-group"], 0),
        (
            "fp8-kv.json",
            vec![
                "--layer",
                "1",
                "--kv-cache-dtype",
                "fp8",
                "--kv-scale",
                "0.5",
                "--path",
                "mqa",
            ],
            0,
        ),
        (
            "fp8-tensor.json",
            vec![
                "--layer",
                "1",
                "--fp8-compute",
                "tensor",
                "--path",
                "mqa",
                "--dtype",
                "bf16",
            ],
            0,
        ),
        ("phantom.json", vec!["--layer", "1", "--inject", "phantom-output"], 1),
        (
            "tokens-tp.json",
            vec!["--layers", "0..=1", "--input", "tokens", "--tp", "2", "--seqs", "3,9"],
            0,
        ),
        (
            "legacy.json",
            vec!["--model", legacy.to_str().unwrap(), "--inject", "kv-b-grouped"],
            1,
        ),
        (
            "yarn.json",
            vec!["--model", yarn.to_str().unwrap(), "--path", "mqa", "--dtype", "bf16"],
            0,
        ),
        (
            "moe.json",
            vec!["--model", moe.to_str().unwrap(), "--layers", "all", "--input", "tokens"],
            0,
        ),
        (
            "dsa.json",
            vec![
                "--model",
                dsa.to_str().unwrap(),
                "--layer",
                "1",
                "--inject",
                "indexer-topk-stale",
                "--path",
                "chunked",
            ],
            1,
        ),
    ];
    for (name, args, want) in cases {
        let (code, bytes) = produce(dir.path(), name, &args);
        assert_eq!(code, want, "{name}");
        let doc: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        let errors: Vec<String> = validator
            .iter_errors(&doc)
            .map(|e| format!("{} at {}", e, e.instance_path()))
            .collect();
        assert!(errors.is_empty(), "{name}: {errors:#?}");
        assert_eq!(doc["schema"], mla_diff::output::report::JSON_SCHEMA_VERSION);
        assert_eq!(doc["exit_code"], want);
    }
}

#[test]
fn the_schema_rejects_a_wrong_document() {
    let validator = jsonschema::validator_for(&schema()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (_, bytes) = produce(dir.path(), "x.json", &["--layer", "1"]);
    let mut doc: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    assert!(validator.is_valid(&doc));
    doc["verdict"] = "maybe".into();
    assert!(!validator.is_valid(&doc));
    doc["verdict"] = "pass".into();
    doc["sites"][0]["status"] = "fine".into();
    assert!(!validator.is_valid(&doc));
}

#[test]
fn same_inputs_give_byte_identical_json() {
    let dir = tempfile::tempdir().unwrap();
    let args = [
        "--layer",
        "1",
        "--seqs",
        "4,13",
        "--inject",
        "fused-shard-swap",
        "--tp",
        "2",
    ];
    let (c1, a) = produce(dir.path(), "a.json", &args);
    let (c2, b) = produce(dir.path(), "b.json", &args);
    assert_eq!((c1, c2), (1, 1));
    assert!(a == b, "two runs with the same inputs wrote different JSON");
}

#[test]
fn undefined_metrics_are_null_and_paths_that_did_not_run_say_so() {
    let dir = tempfile::tempdir().unwrap();
    let (_, bytes) = produce(dir.path(), "p.json", &["--layer", "1", "--inject", "phantom-output"]);
    let doc: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    let site = doc["sites"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["path"] == "mha" && s["site"] == "L1.attn_out")
        .unwrap();
    // Every element still holds the NaN canary: nothing to measure, never a perfect 0.
    assert!(site["metrics"]["rel_l2"].is_null(), "{site}");
    assert!(site["metrics"]["cos_diff"].is_null() && site["metrics"]["norm_ratio"].is_null());
    assert_eq!(site["failed"], serde_json::json!(["nonfinite", "pass_fraction"]));
    assert_eq!(doc["path_status"]["mha"], "divergence");

    let (_, bytes) = produce(
        dir.path(),
        "q.json",
        &["--layer", "1", "--tp", "2", "--inject", "quant-slice-misaligned"],
    );
    let doc: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    for p in ["mha", "mqa", "chunked", "mixed"] {
        assert_eq!(doc["path_status"][p], "not-run", "{p}");
        assert!(doc["first_divergence"][p].is_null());
    }
    assert_eq!(doc["findings"][0]["class"], "quant-block-misaligned");
    assert_eq!(doc["verdict"], "divergence");
}
