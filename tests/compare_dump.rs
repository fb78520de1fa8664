//! `mla-diff compare`: committed engine dumps (HF transformers and llama.cpp, made by
//! scripts/dump_hf.py and scripts/dump_llama_cpp.py on the F32 fixtures) pass with every dumped
//! site within tolerance, and deliberately broken HF attention is named by class and site.

mod common;

use common::{repo, run_bin};

fn compare(model: &str, dump: &str, extra: &[&str]) -> (i32, String, String, serde_json::Value) {
    let dir = tempfile::tempdir().unwrap();
    let j = dir.path().join("c.json");
    let m = repo().join("golden/models").join(model);
    let d = repo().join("golden/dumps").join(dump);
    let mut args = vec![
        "compare",
        "--model",
        m.to_str().unwrap(),
        "--dump",
        d.to_str().unwrap(),
        "--json",
        j.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let (code, out, err) = run_bin(&args);
    let doc = std::fs::read(&j)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or(serde_json::Value::Null);
    (code, out, err, doc)
}

/// Every dumped site of every layer passed, and the expected number of sites was compared.
fn assert_all_pass(doc: &serde_json::Value, min_sites: usize) {
    let sites = doc["sites"].as_array().unwrap();
    assert!(sites.len() >= min_sites, "{} sites", sites.len());
    for s in sites {
        assert_eq!(s["status"], "pass", "{s}");
        assert!(s["metrics"]["rel_l2"].as_f64().unwrap() < 1e-5, "{s}");
    }
    assert_eq!(doc["verdict"], "pass");
    assert_eq!(doc["path_status"]["dump"], "pass");
}

#[test]
fn hf_dumps_pass() {
    for (model, dump) in [
        ("tiny-v3-f32.gguf", "tiny-v3-f32.hf.safetensors"),
        ("yarn-v3-f32.gguf", "yarn-v3-f32.hf.safetensors"),
    ] {
        let (code, out, err, doc) = compare(model, dump, &[]);
        assert_eq!(code, 0, "{dump}: {out}\n{err}");
        // 16 sites per layer, 2 layers, rope order converted from HF's [even | odd] halves.
        assert_all_pass(&doc, 32);
        let conv = doc["dump"]["conversions"].as_array().unwrap();
        assert!(
            conv.iter()
                .any(|c| c.as_str().unwrap().contains("L0.q_pe_roped: HF [even | odd]"))
        );
        assert_eq!(doc["dump"]["metadata"]["rope_order"], "hf");
        assert!(doc["dump"]["engine"].as_str().unwrap().starts_with("transformers"));
        // Not dumped: the weight and absorbed-only sites, listed, not failed.
        let nd: Vec<&str> = doc["dump"]["not_dumped"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        assert!(nd.contains(&"L0.ql_nope") && nd.contains(&"L1.w.kv_b"), "{nd:?}");
    }
}

#[test]
fn llama_cpp_dumps_pass_through_the_map() {
    let (code, out, err, doc) = compare(
        "tiny-v3-f32.gguf",
        "tiny-v3-f32.llama-cpp.safetensors",
        &["--map", "llama.cpp"],
    );
    assert_eq!(code, 0, "{out}\n{err}");
    // 14 sites per layer (absorbed form: ql_nope and attn_latent, no k_nope/v/lse).
    assert_all_pass(&doc, 28);
    let sites: Vec<&str> = doc["sites"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["site"].as_str().unwrap())
        .collect();
    assert!(sites.contains(&"L1.attn_latent") && sites.contains(&"L0.ql_nope"));
    assert_eq!(doc["dump"]["map"], "llama.cpp");

    let (code, out, err, doc) = compare(
        "lite-v2-f32.gguf",
        "lite-v2-f32.llama-cpp.safetensors",
        &["--map", "llama.cpp"],
    );
    assert_eq!(code, 0, "{out}\n{err}");
    assert_all_pass(&doc, 20);

    // Without the map nothing is a site: a clear error that suggests --map.
    let (code, _, err, _) = compare("tiny-v3-f32.gguf", "tiny-v3-f32.llama-cpp.safetensors", &[]);
    assert_eq!(code, 2);
    assert!(err.contains("no site found") && err.contains("--map"), "{err}");
}

#[test]
fn broken_hf_attention_is_named() {
    for (model, dump, class, site) in [
        (
            "tiny-v3-f32.gguf",
            "tiny-v3-f32.hf-neox.safetensors",
            "rope-style",
            "L0.q_pe_roped",
        ),
        (
            "yarn-v3-f32.gguf",
            "yarn-v3-f32.hf-no-mscale.safetensors",
            "softmax-scale",
            "L0.lse",
        ),
        (
            "tiny-v3-f32.gguf",
            "tiny-v3-f32.hf-zero-attn-out.safetensors",
            "phantom-output",
            "L0.attn_out",
        ),
    ] {
        let (code, out, err, doc) = compare(model, dump, &[]);
        assert_eq!(code, 1, "{dump}: {out}\n{err}");
        let f = &doc["findings"][0];
        assert_eq!(f["class"], class, "{dump}: {f}");
        assert_eq!(f["site"], site, "{dump}: {f}");
        assert_eq!(f["path"], "dump");
        assert_eq!(doc["first_divergence"]["dump"]["site"], site);
        assert!(out.contains(&format!("finding [dump] {class} at {site}")), "{out}");
    }
}

#[test]
fn multi_layer_dumps_check_the_handover_between_layers() {
    // Corrupt L1.hidden_in of a copy: layer 1 is still computed from it (so its other sites
    // pass), but it no longer equals the engine's own L0.hidden_out.
    let src = std::fs::read(repo().join("golden/dumps/tiny-v3-f32.hf.safetensors")).unwrap();
    let n = u64::from_le_bytes(src[..8].try_into().unwrap()) as usize;
    let h: serde_json::Value = serde_json::from_slice(&src[8..8 + n]).unwrap();
    let off = 8 + n + h["L1.hidden_in"]["data_offsets"][0].as_u64().unwrap() as usize;
    let mut b = src.clone();
    let v = f32::from_le_bytes(b[off..off + 4].try_into().unwrap());
    b[off..off + 4].copy_from_slice(&(v + 1.0).to_le_bytes());
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("d.safetensors");
    std::fs::write(&p, b).unwrap();
    let m = repo().join("golden/models/tiny-v3-f32.gguf");
    let (code, out, _) = run_bin(&[
        "compare",
        "--model",
        m.to_str().unwrap(),
        "--dump",
        p.to_str().unwrap(),
        "--quiet",
    ]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("dump: first divergence at L1.hidden_in"), "{out}");
}

#[test]
fn bad_dumps_are_clear_errors() {
    use std::collections::HashMap;
    let dir = tempfile::tempdir().unwrap();
    let m = repo().join("golden/models/tiny-v3-f32.gguf");
    let write = |name: &str,
                 tensors: Vec<(&str, safetensors::Dtype, Vec<usize>, Vec<u8>)>,
                 meta: Option<HashMap<String, String>>| {
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
            .iter()
            .map(|(n, d, s, b)| {
                (
                    n.to_string(),
                    safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
                )
            })
            .collect();
        let bytes = safetensors::serialize(views, meta).unwrap();
        let p = dir.path().join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    };
    let f32s = |n: usize| {
        (0..n)
            .flat_map(|i| ((i % 7) as f32 * 0.1).to_le_bytes())
            .collect::<Vec<u8>>()
    };
    let run =
        |p: &std::path::Path| run_bin(&["compare", "--model", m.to_str().unwrap(), "--dump", p.to_str().unwrap()]);

    // Wrong shape: q must be [T, N, P+R] = [4, 6, 48].
    let p = write(
        "shape.safetensors",
        vec![
            ("L0.hidden_in", safetensors::Dtype::F32, vec![4, 256], f32s(4 * 256)),
            ("L0.q", safetensors::Dtype::F32, vec![4, 6, 40], f32s(4 * 240)),
        ],
        None,
    );
    let (code, _, err) = run(&p);
    assert_eq!(code, 2);
    assert!(
        err.contains("L0.q:") && err.contains("[4, 6, 40]") && err.contains("[4, 6, 48]"),
        "{err}"
    );

    // Integer dtype on a site.
    let p = write(
        "dtype.safetensors",
        vec![("L0.hidden_in", safetensors::Dtype::I32, vec![4, 256], f32s(4 * 256))],
        None,
    );
    let (code, _, err) = run(&p);
    assert_eq!(code, 2);
    assert!(err.contains("L0.hidden_in:") && err.contains("integer dtype"), "{err}");

    // Bad metadata value.
    let meta: HashMap<String, String> = [("rope_order".to_string(), "sideways".to_string())]
        .into_iter()
        .collect();
    let p = write(
        "meta.safetensors",
        vec![("L0.hidden_in", safetensors::Dtype::F32, vec![4, 256], f32s(4 * 256))],
        Some(meta),
    );
    let (code, _, err) = run(&p);
    assert_eq!(code, 2);
    assert!(err.contains("rope_order") && err.contains("sideways"), "{err}");

    // A layer without input.
    let p = write(
        "noinput.safetensors",
        vec![("L1.attn_in", safetensors::Dtype::F32, vec![4, 256], f32s(4 * 256))],
        None,
    );
    let (code, _, err) = run(&p);
    assert_eq!(code, 2);
    assert!(err.contains("layer 1 has no input"), "{err}");

    // A partial, truthful dump: only hidden_in — compares, lists the rest as not dumped.
    let p = write(
        "partial.safetensors",
        vec![("L0.hidden_in", safetensors::Dtype::F32, vec![4, 256], f32s(4 * 256))],
        None,
    );
    let (code, out, err) = run(&p);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("not dumped (not compared): L0.attn_in"), "{out}");
}
