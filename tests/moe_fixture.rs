//! The committed MoE fixture (golden/models/moe-v3-*.gguf: a random HF DeepSeek-V3 with MoE
//! layers 1 and 2, converted and quantized by llama.cpp): `run --input tokens --layers all`
//! passes on the F32 and Q8_0 files, and an engine whose expert selection differs is named at
//! `moe_topk` with the tokens and expert ids: one that dropped the score-correction bias (its
//! router logits still match) and one with a corrupted router weight (dumping only the ids).

use crate::common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::common::{compare_json, repo, run_bin};
use mla_diff::core::batch::Batch;
use mla_diff::core::trace::{Stage, Trace};
use mla_diff::jobs::run::{reference_chain, seeded_tokens};
use mla_diff::model::config::MlaConfig;
use mla_diff::model::gguf::GgufFile;
use safetensors::{Dtype, tensor::TensorView};

const F32: &str = "golden/models/moe-v3-f32.gguf";

#[test]
fn token_path_through_every_layer_passes_on_f32_and_q8_0() {
    for f in [F32, "golden/models/moe-v3-q8_0.gguf"] {
        let dir = tempfile::tempdir().unwrap();
        let j = dir.path().join("r.json");
        let path = repo().join(f);
        let (code, out, err) = run_bin(&[
            "run",
            "--model",
            path.to_str().unwrap(),
            "--layers",
            "all",
            "--input",
            "tokens",
            "--json",
            j.to_str().unwrap(),
            "--quiet",
        ]);
        assert_eq!(code, 0, "{f}: {out}{err}");
        let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&j).unwrap()).unwrap();
        assert_eq!(doc["verdict"], "pass");
        let moe = &doc["model"]["config"]["moe"];
        assert_eq!(
            (&moe["n_expert"], &moe["n_expert_used"], &moe["n_group"], &moe["gating"]),
            (&8.into(), &2.into(), &4.into(), &"sigmoid".into()),
            "{f}"
        );
        // Every layer of every path ran (3 layers × 4 paths).
        assert_eq!(doc["path_status"]["mha"], "pass");
        let layers: std::collections::BTreeSet<i64> = doc["sites"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["site"].as_str().unwrap()[1..2].parse().unwrap())
            .collect();
        assert_eq!(layers.into_iter().collect::<Vec<_>>(), vec![0, 1, 2], "{f}");
    }
}

/// A copy of the F32 fixture with `edit(file, bytes)` applied to its bytes.
fn corrupted(edit: impl Fn(&GgufFile, &mut Vec<u8>)) -> (tempfile::TempDir, PathBuf) {
    let src = repo().join(F32);
    let mut bytes = std::fs::read(&src).unwrap();
    let file = GgufFile::open(&src).unwrap();
    edit(&file, &mut bytes);
    common::write_temp(&bytes, "engine.gguf")
}

/// Byte range of tensor `name`'s data.
fn data_range(file: &GgufFile, name: &str) -> std::ops::Range<usize> {
    let t = file.tensor(name).unwrap();
    let start = (file.data_offset() + t.offset) as usize;
    start..start + t.n_bytes as usize
}

/// What an engine running `model` would dump for layer 1: `tokens` and every activation site of
/// the reference on that model, except `skip`; `moe_topk` as I64 ids in the order given by
/// `order` (a permutation of 0..K applied to each row).
fn dump_of(model: &Path, tokens: &[u32], skip: &[Stage], order: &[usize]) -> Vec<u8> {
    let file = GgufFile::open(model).unwrap();
    let cfg = MlaConfig::from_gguf(&file).unwrap();
    let traces: Vec<Trace> = reference_chain(&file, &cfg, tokens, &Batch::single(tokens.len(), 0), 1).unwrap();
    let mut blobs: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    let ids: Vec<u8> = tokens.iter().flat_map(|&t| (t as i64).to_le_bytes()).collect();
    blobs.push(("tokens".into(), Dtype::I64, vec![tokens.len()], ids));
    for (site, t) in traces[1].entries() {
        if site.stage.is_weight() || skip.contains(&site.stage) {
            continue;
        }
        if site.stage == Stage::MoeTopk {
            let k = t.shape[1];
            let v = t.to_f64();
            let bytes = v
                .chunks(k)
                .flat_map(|row| order.iter().map(|&j| row[j] as i64).collect::<Vec<_>>())
                .flat_map(|x| x.to_le_bytes())
                .collect();
            blobs.push((site.to_string(), Dtype::I64, t.shape.clone(), bytes));
        } else {
            let bytes = t.to_f64().iter().flat_map(|x| x.to_le_bytes()).collect();
            blobs.push((site.to_string(), Dtype::F64, t.shape.clone(), bytes));
        }
    }
    let views: Vec<(String, TensorView<'_>)> = blobs
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    let meta = HashMap::from([("engine".to_string(), "test engine".to_string())]);
    safetensors::tensor::serialize(views, Some(meta)).unwrap()
}

/// `mla-diff compare` of `dump` against the clean F32 fixture: (exit code, stdout, JSON).
fn compare(dump: &[u8]) -> (i32, String, serde_json::Value) {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().join("dump.safetensors");
    std::fs::write(&d, dump).unwrap();
    let (code, out, err, doc) = compare_json(&repo().join(F32), &d, &[]);
    assert!(code == 0 || code == 1, "{out}{err}");
    assert!(!doc.is_null(), "no JSON report: {err}");
    (code, out, doc)
}

fn tokens() -> Vec<u32> {
    seeded_tokens(11, 16, 128)
}

#[test]
fn a_clean_dump_passes_whatever_order_it_lists_the_experts_in() {
    let (code, out, doc) = compare(&dump_of(&repo().join(F32), &tokens(), &[], &[1, 0]));
    assert_eq!(code, 0, "{out}");
    let topk = doc["sites"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["site"] == "L1.moe_topk")
        .expect("moe_topk compared");
    assert_eq!(topk["status"], "pass");
    for s in ["L1.moe_router_logits", "L1.moe_out", "L1.shared_out", "L1.hidden_out"] {
        let d = doc["sites"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["site"] == s)
            .unwrap();
        assert!(d["metrics"]["rel_l2"].as_f64().unwrap() < 1e-12, "{s}: {d}");
    }
}

/// The one finding: class `moe-routing` at `L1.moe_topk`, with tokens and ids as evidence; the
/// document validates against the published schema.
fn assert_routing_finding(doc: &serde_json::Value) -> String {
    let schema: serde_json::Value =
        serde_json::from_slice(&std::fs::read(repo().join("docs/run-report.schema.json")).unwrap()).unwrap();
    let validator = jsonschema::validator_for(&schema).unwrap();
    let errors: Vec<String> = validator.iter_errors(doc).map(|e| e.to_string()).collect();
    assert!(errors.is_empty(), "{errors:#?}");
    let f = &doc["findings"].as_array().unwrap()[0];
    assert_eq!(f["class"], "moe-routing", "{f}");
    assert_eq!(f["site"], "L1.moe_topk", "{f}");
    assert_eq!(doc["first_divergence"]["dump"]["site"], "L1.moe_topk");
    let ev = f["evidence"].as_str().unwrap().to_string();
    assert!(
        ev.contains("token ") && ev.contains("only reference: ") && ev.contains("only candidate: "),
        "{ev}"
    );
    ev
}

#[test]
fn an_engine_without_the_score_correction_bias_is_a_moe_topk_finding() {
    // The engine's copy of the file has exp_probs_b of layer 1 zeroed: its router logits are
    // unchanged, but it chooses on the bare scores.
    let (_d, engine) = corrupted(|file, bytes| {
        for b in &mut bytes[data_range(file, "blk.1.exp_probs_b.bias")] {
            *b = 0;
        }
    });
    let (code, out, doc) = compare(&dump_of(&engine, &tokens(), &[], &[0, 1]));
    assert_eq!(code, 1, "{out}");
    let ev = assert_routing_finding(&doc);
    assert!(ev.contains("the router logits match"), "{ev}");
    // Everything before the router is exact.
    for s in doc["sites"].as_array().unwrap() {
        if s["site"] == "L1.o_proj" || s["site"] == "L1.moe_router_logits" {
            assert_eq!(s["status"], "pass", "{s}");
        }
    }
    assert!(out.contains("moe-routing at L1.moe_topk"), "{out}");
}

#[test]
fn a_corrupted_router_weight_is_a_moe_topk_finding_when_only_ids_are_dumped() {
    // The engine's router of layer 1 has every row negated (a sign error at load time); the dump
    // carries the selected ids but not the logits.
    let (_d, engine) = corrupted(|file, bytes| {
        for w in bytes[data_range(file, "blk.1.ffn_gate_inp.weight")].chunks_mut(4) {
            let x = -f32::from_le_bytes([w[0], w[1], w[2], w[3]]);
            w.copy_from_slice(&x.to_le_bytes());
        }
    });
    let (code, out, doc) = compare(&dump_of(&engine, &tokens(), &[Stage::MoeRouterLogits], &[0, 1]));
    assert_eq!(code, 1, "{out}");
    let ev = assert_routing_finding(&doc);
    assert!(ev.contains("router logits were not compared"), "{ev}");
}
