//! A DSA engine whose indexer scores fp8 operands (vLLM's `Indexer`: query and key quantized to
//! E4M3 with ue8m0 scales before DeepGEMM's `fp8_mqa_logits`), judged by `compare` on a
//! format-2 dump: with the header's `indexer_quant` the reference scores the same quantized
//! operands and the engine's selection passes; without it the same selection is
//! `indexer-selection`. Either way each stage is judged on its own inputs: a DSA layer's
//! attention runs over the keys the dump's `idx_topk` says the engine kept, so a selection flip
//! does not cascade into `attn_latent`, while an attention bug on those keys is still found. A
//! decode step's `idx_topk` ([1, min(top_k, S)] over its whole sequence) is read and judged.
//!
//! The "engine" is the reference itself with the quantization on (`reference_layer_with`), run
//! on the live fixture `golden/models/dsa-live-bf16.gguf` (glm-dsa, index_topk 128) over a
//! prompt of [`PROMPT`] tokens and one decode step: its values are what a correct fp8 engine
//! computes on exact inputs.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use mla_diff::compute::reference::{RefInputs, reference_layer_with};
use mla_diff::core::batch::{Batch, SeqSpec, normal_f32};
use mla_diff::core::trace::{Site, Stage, Trace};
use mla_diff::model::config::MlaConfig;
use mla_diff::model::dump::IndexerQuant;
use mla_diff::model::gguf::GgufFile;
use mla_diff::model::weights::LayerWeights;
use safetensors::Dtype;
use serde_json::{Value, json};

use crate::common::{compare_json, conversions, repo, write_safetensors};

/// Prompt tokens: above index_topk (128), so the selection drops keys.
const PROMPT: usize = 200;

/// The header field vLLM 0.26's hooks write for this model.
fn vllm_quant() -> Value {
    json!({"dtype": "fp8_e4m3", "block": 128, "scale": "ue8m0", "input": "bf16",
           "q_amax_floor": 1e-10, "k_amax_floor": 1e-4})
}

fn model() -> PathBuf {
    repo().join("golden/models/dsa-live-bf16.gguf")
}

/// The engine's layer-0 trace over `PROMPT + 1` tokens of one sequence (seeded f32 inputs) with
/// the indexer quantization `quant` (none: the f64 reference's own scores), and its input.
fn engine(quant: Option<&Value>) -> (Trace, Vec<f32>) {
    let file = GgufFile::open(model()).unwrap();
    let cfg = MlaConfig::from_gguf(&file).unwrap();
    let w = LayerWeights::load(&file, &cfg, 0).unwrap();
    let t = PROMPT + 1;
    let x = normal_f32(39, t * cfg.hidden);
    let hidden = ndarray::Array2::from_shape_vec((t, cfg.hidden), x.iter().map(|&v| f64::from(v)).collect()).unwrap();
    let batch = Batch {
        seqs: vec![SeqSpec { len: t, start_pos: 0 }],
    };
    let qk = quant.map(|q| serde_json::from_value::<IndexerQuant>(q.clone()).unwrap().qk());
    let dsa = RefInputs {
        quant: qk.as_ref(),
        ..RefInputs::default()
    };
    let r = reference_layer_with(&cfg, &w, &hidden, &batch, 1, &dsa).unwrap();
    (r.trace, x)
}

/// Rows `rows` of the trace's `stage` as F32 little-endian bytes, with its shape.
fn rows_of(tr: &Trace, stage: Stage, rows: std::ops::Range<usize>) -> (Vec<usize>, Vec<f64>) {
    let t = tr.get(&Site::new(0, stage)).unwrap();
    let per = t.len() / t.shape[0];
    let mut shape = t.shape.clone();
    shape[0] = rows.len();
    (shape, t.to_f64()[rows.start * per..rows.end * per].to_vec())
}

fn f32_bytes(v: &[f64]) -> Vec<u8> {
    v.iter().flat_map(|&x| (x as f32).to_le_bytes()).collect()
}

/// Writes a format-2 dump of `tr` (a prefill of `PROMPT` tokens, then one decode step) at
/// `path`: per step `hidden_in`, `idx_topk`, `attn_latent`, `lse`, `attn_out`, with
/// `corrupt(stage, step, values)` applied first; `quant` goes into the header as
/// `indexer_quant` (absent for `None`).
fn write_dump(path: &Path, tr: &Trace, x: &[f32], quant: Option<Value>, corrupt: &dyn Fn(Stage, usize, &mut [f64])) {
    let file = GgufFile::open(model()).unwrap();
    let h = x.len() / (PROMPT + 1);
    let mut tensors = Vec::new();
    for (k, rows) in [(0, 0..PROMPT), (1, PROMPT..PROMPT + 1)] {
        let hid: Vec<f64> = x[rows.start * h..rows.end * h].iter().map(|&v| f64::from(v)).collect();
        tensors.push((
            format!("s{k}.L0.hidden_in"),
            Dtype::F32,
            vec![rows.len(), h],
            f32_bytes(&hid),
        ));
        for stage in [Stage::IdxTopk, Stage::AttnLatent, Stage::Lse, Stage::AttnOut] {
            let (shape, mut v) = rows_of(tr, stage, rows.clone());
            corrupt(stage, k, &mut v);
            tensors.push((format!("s{k}.L0.{}", stage.name()), Dtype::F32, shape, f32_bytes(&v)));
        }
    }
    let mut header = json!({
        "model": {
            "file": "dsa-live-bf16.gguf",
            "bytes": std::fs::metadata(model()).unwrap().len(),
            "index_sha256": file.index_sha256_hex(),
            "layer_sha256": {"0": file.layer_sha256_hex(0)},
        },
        "hook": {"name": "tests/dsa_fp8.rs", "version": "1"},
        "engine": {"name": "fp8-indexer", "version": "1"},
        "dtype": "bf16",
        "steps": [
            {"name": "prefill", "seqs": [{"new": PROMPT, "context": 0}]},
            {"name": "decode-1", "seqs": [{"new": 1, "context": PROMPT}]},
        ],
    });
    if let Some(q) = quant {
        header["indexer_quant"] = q;
    }
    let meta = HashMap::from([
        ("format".to_string(), "mla-diff dump 2".to_string()),
        ("header".to_string(), header.to_string()),
    ]);
    write_safetensors(path, &tensors, Some(meta));
}

/// `(status, step)` of every judged site named `site`.
fn statuses<'a>(doc: &'a Value, site: &str) -> Vec<(&'a str, &'a str)> {
    doc["sites"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["site"] == site)
        .map(|s| (s["status"].as_str().unwrap(), s["step"].as_str().unwrap()))
        .collect()
}

fn no_change(_: Stage, _: usize, _: &mut [f64]) {}

#[test]
fn an_fp8_indexer_passes_when_its_dump_declares_the_quantization_and_is_named_when_not() {
    let q = vllm_quant();
    let (tr, x) = engine(Some(&q));
    // The quantization changes the selection of many tokens (what the live run showed).
    let (f64_tr, _) = engine(None);
    let sets = |t: &Trace| {
        let v = t.get(&Site::new(0, Stage::IdxTopk)).unwrap();
        mla_diff::compute::indexer::topk_sets(&v.to_f64(), v.shape[1])
    };
    let differ = sets(&tr).iter().zip(sets(&f64_tr)).filter(|(a, b)| *a != b).count();
    assert!(differ >= 10, "only {differ} tokens keep other keys under fp8");
    eprintln!(
        "fp8 scores: {differ} of {} tokens keep other keys than the f64 scores'",
        PROMPT + 1
    );

    let dir = tempfile::tempdir().unwrap();
    let with = dir.path().join("with.safetensors");
    write_dump(&with, &tr, &x, Some(q), &no_change);
    let (code, out, err, doc) = compare_json(&model(), &with, &[]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert_eq!(
        statuses(&doc, "L0.idx_topk"),
        vec![("pass", "prefill"), ("pass", "decode-1")],
        "a decode step's [1, 128] selection over 201 keys is read and judged"
    );
    assert_eq!(
        statuses(&doc, "L0.attn_latent"),
        vec![("pass", "prefill"), ("pass", "decode-1")]
    );
    let conv = conversions(&doc);
    assert!(
        conv.iter()
            .any(|c| c
                .starts_with("indexer_quant: indexer scores on fp8_e4m3 query and key (blocks of 128, ue8m0 scales")),
        "{conv:?}"
    );
    assert!(
        conv.iter().any(
            |c| c.starts_with("L0: attention judged on the engine's selection (L0.idx_topk, as dumped)")
                && c.ends_with("(steps prefill, decode-1)")
        ),
        "{conv:?}"
    );
    assert!(
        out.contains("note: L0: attention judged on the engine's selection"),
        "{out}"
    );

    // The same tensors without the field: the f64 reference's scores keep other keys, beyond the
    // bf16 tie band; the attention, judged on the engine's keys, still passes.
    let without = dir.path().join("without.safetensors");
    write_dump(&without, &tr, &x, None, &no_change);
    let (code, out, err, doc) = compare_json(&model(), &without, &[]);
    assert_eq!(code, 1, "{out}\n{err}");
    assert_eq!(doc["findings"][0]["class"], "indexer-selection", "{out}");
    eprintln!("without indexer_quant: {}", doc["findings"][0]["evidence"]);
    assert_eq!(doc["findings"][0]["site"], "L0.idx_topk", "{out}");
    assert_eq!(statuses(&doc, "L0.idx_topk")[0], ("fail", "prefill"));
    assert_eq!(
        statuses(&doc, "L0.attn_latent"),
        vec![("pass", "prefill"), ("pass", "decode-1")],
        "{out}"
    );
    assert_eq!(
        statuses(&doc, "L0.attn_out"),
        vec![("pass", "prefill"), ("pass", "decode-1")],
        "{out}"
    );
}

#[test]
fn an_attention_bug_on_the_engines_own_keys_is_still_found() {
    let q = vllm_quant();
    let (tr, x) = engine(Some(&q));
    let dir = tempfile::tempdir().unwrap();
    // Head 1's latent output of the prefill's last 50 tokens scaled by 1.25 (the output of
    // another softmax): the selection is the engine's own and passes, the attention does not.
    let n_lat = 2 * 512;
    let corrupt = |stage: Stage, step: usize, v: &mut [f64]| {
        if stage == Stage::AttnLatent && step == 0 {
            for t in PROMPT - 50..PROMPT {
                v[t * n_lat + 512..(t + 1) * n_lat].iter_mut().for_each(|e| *e *= 1.25);
            }
        }
    };
    let path = dir.path().join("bug.safetensors");
    write_dump(&path, &tr, &x, Some(q), &corrupt);
    let (code, out, err, doc) = compare_json(&model(), &path, &[]);
    assert_eq!(code, 1, "{out}\n{err}");
    assert_eq!(doc["findings"][0]["site"], "L0.attn_latent", "{out}");
    assert_eq!(
        statuses(&doc, "L0.idx_topk"),
        vec![("pass", "prefill"), ("pass", "decode-1")]
    );
    assert_eq!(statuses(&doc, "L0.attn_latent")[0], ("fail", "prefill"));
}

#[test]
fn a_hostile_indexer_quant_is_refused_naming_its_field() {
    let (tr, x) = engine(None);
    let dir = tempfile::tempdir().unwrap();
    let base = vllm_quant();
    let with = |key: &str, v: Value| {
        let mut q = base.clone();
        q[key] = v;
        q
    };
    let mut missing = base.clone();
    missing.as_object_mut().unwrap().remove("scale");
    let cases: Vec<(Value, &str)> = vec![
        (json!("fp8"), "indexer_quant"),
        (json!([1, 2]), "indexer_quant"),
        (with("dtype", json!("fp8_e5m2")), "indexer_quant.dtype"),
        (with("block", json!(0)), "indexer_quant.block"),
        (with("block", json!(-128)), "indexer_quant.block"),
        (with("block", json!(1.5)), "indexer_quant.block"),
        (with("block", json!(1u64 << 40)), "indexer_quant.block"),
        // 96 does not divide the indexer's head width 128.
        (with("block", json!(96)), "indexer_quant.block"),
        (with("scale", json!("e8m0")), "indexer_quant.scale"),
        (with("input", json!("fp8")), "indexer_quant.input"),
        (with("q_amax_floor", json!(-1.0)), "indexer_quant.q_amax_floor"),
        (with("k_amax_floor", json!(0)), "indexer_quant.k_amax_floor"),
        (with("k_amax_floor", json!("1e-4")), "indexer_quant.k_amax_floor"),
        (with("blocks", json!(128)), "indexer_quant.blocks"),
        (missing, "indexer_quant.scale"),
    ];
    for (i, (q, field)) in cases.into_iter().enumerate() {
        let path = dir.path().join(format!("hostile{i}.safetensors"));
        write_dump(&path, &tr, &x, Some(q.clone()), &no_change);
        let (code, out, err, _) = compare_json(&model(), &path, &[]);
        assert_eq!(code, 2, "{q}: {out}\n{err}");
        let line = err.lines().find(|l| l.contains("error")).unwrap_or(&err);
        assert!(
            line.contains(&format!("__metadata__.header.{field}")) && line.contains(path.to_str().unwrap()),
            "{q}: wants {field}: {err}"
        );
        assert!(!err.contains("panick"), "{q}: {err}");
    }
    // On a model without an indexer the field itself is refused (before the identity check).
    let plain = repo().join("golden/models/fa3-v3-bf16.gguf");
    let path = dir.path().join("no-indexer.safetensors");
    write_dump(&path, &tr, &x, Some(vllm_quant()), &no_change);
    let (code, _, err, _) = compare_json(&plain, &path, &[]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("__metadata__.header.indexer_quant") && err.contains("no DSA indexer"),
        "{err}"
    );
}
