//! The committed dumps of vLLM's real code (`golden/dumps/*.vllm*.safetensors`, format 2), made by
//! `mla_diff_hooks.vllm_cpu` with vLLM 0.26.0 and vllm-gguf-plugin 0.0.5 on the CPU: a prefill and two
//! decode steps through vLLM's own MLA layer and its Triton decode kernel, at TP 1 and, for the
//! Q8_0 fixture, at TP 2 and 4 (every rank's dump joined into one). Each must keep the verdict it
//! had when it was made; a new committed vLLM dump must be listed here.

use crate::common::{compare_json, repo, run_bin};

/// A committed dump: (file, its model, exit code, finding `(class, site)` or none).
type Case = (&'static str, &'static str, i32, Option<(&'static str, &'static str)>);

const CASES: &[Case] = &[
    // Legacy fused `attn_kv_b`: the plugin loads every weight; all steps within the f32 rows.
    ("legacy-kvb-f32.vllm.safetensors", "legacy-kvb-f32.gguf", 0, None),
    // Split `attn_k_b`/`attn_v_b`: the plugin maps neither, vLLM leaves `kv_b_proj` unloaded
    // (the harness's recorded `zero-unloaded` patch lets the run go on with zeros).
    (
        "tiny-v3-f32.vllm-unloaded.safetensors",
        "tiny-v3-f32.gguf",
        1,
        Some(("weight-not-loaded", "L0.w.kv_b")),
    ),
    // Q8_0: the quantized layers run through vllm-gguf-plugin's Triton kernels.
    ("legacy-kvb-q8_0.vllm.safetensors", "legacy-kvb-q8_0.gguf", 0, None),
    // TP 2 and 4: vllm-gguf-plugin 0.0.5's merged-column loader keeps rank 0's rows of the
    // quantized `gate_up_proj` on every rank (vllm-gguf-plugin#103); every attention site passes.
    (
        "legacy-kvb-q8_0.vllm-tp2.safetensors",
        "legacy-kvb-q8_0.gguf",
        1,
        Some(("tp-rank-order", "L0.gate_up_proj.rank1")),
    ),
    (
        "legacy-kvb-q8_0.vllm-tp4.safetensors",
        "legacy-kvb-q8_0.gguf",
        1,
        Some(("tp-rank-order", "L0.gate_up_proj.rank1")),
    ),
    // The same runs with the harness's `fix-merged-column-rank` patch (the plugin's PR #106).
    (
        "legacy-kvb-q8_0.vllm-tp2-fixed.safetensors",
        "legacy-kvb-q8_0.gguf",
        0,
        None,
    ),
    (
        "legacy-kvb-q8_0.vllm-tp4-fixed.safetensors",
        "legacy-kvb-q8_0.gguf",
        0,
        None,
    ),
];

#[test]
fn every_committed_vllm_dump_keeps_its_verdict() {
    let dir = repo().join("golden/dumps");
    let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".vllm") && !n.contains(".vllm-live"))
        .collect();
    on_disk.sort();
    let mut listed: Vec<String> = CASES.iter().map(|c| c.0.to_string()).collect();
    listed.sort();
    assert_eq!(on_disk, listed, "every committed vLLM dump is a case here");
    for &(dump, model, want, finding) in CASES {
        let (code, out, err, doc) = compare_json(&repo().join("golden/models").join(model), &dir.join(dump), &[]);
        assert_eq!(code, want, "{dump}: {out}\n{err}");
        assert_eq!(doc["dump"]["engine"], "vllm 0.26.0", "{dump}");
        assert_eq!(doc["dump"]["metadata"]["format"], "mla-diff dump 2");
        assert_eq!(doc["dump"]["metadata"]["attention_backend"], "TRITON_MLA");
        // Prefill and both decode steps were judged, the decode steps through the MQA sites.
        let sites = doc["sites"].as_array().unwrap();
        for step in ["prefill", "decode-1", "decode-2"] {
            assert!(sites.iter().any(|s| s["step"] == step), "{dump}: no {step}");
        }
        for site in ["L0.ql_nope", "L0.attn_latent", "L0.lse"] {
            let s = sites
                .iter()
                .find(|s| s["step"] == "decode-1" && s["site"] == site)
                .unwrap_or_else(|| panic!("{dump}: decode-1 {site} not judged"));
            if want == 0 {
                assert_eq!(s["status"], "pass", "{dump}: {s}");
            }
        }
        let patches: Vec<&str> = doc["dump"]["patches"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|c| c.as_str())
            .collect();
        assert!(
            patches.iter().any(|p| p.starts_with("`cpu-platform`: ")),
            "{dump}: {patches:?}"
        );
        match finding {
            None => assert!(doc["findings"].as_array().unwrap().is_empty(), "{dump}"),
            Some((class, site)) => {
                assert_eq!(doc["findings"][0]["class"], class, "{dump}");
                // a finding on a site names it `site`, one on a loaded weight `tensor`
                let subject = doc["findings"][0]["site"]
                    .as_str()
                    .or(doc["findings"][0]["tensor"].as_str());
                assert_eq!(subject, Some(site), "{dump}");
                assert!(!doc["findings"][0]["hint"].as_str().unwrap().contains("  "), "{dump}");
            }
        }
    }
    // The dump carries vLLM's loaded weights too: `weights --check` reads them from it.
    let (code, out, err) = run_bin(&[
        "weights",
        "--model",
        repo().join("golden/models/legacy-kvb-f32.gguf").to_str().unwrap(),
        "--check",
        dir.join("legacy-kvb-f32.vllm.safetensors").to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("all 16 tensors match the model"), "{out}");
}

/// The MoE fixture's loaded weights at TP 2 (a WEIGHTS file: vLLM's routed experts do not run on
/// a CPU): the shared experts' `gate_up_proj` of rank 1 holds rank 0's rows.
#[test]
fn the_moe_fixtures_loaded_shared_experts_show_the_merged_column_shard_bug() {
    let (code, out, err) = run_bin(&[
        "weights",
        "--model",
        repo().join("golden/models/legacy-kvb-moe-q8_0.gguf").to_str().unwrap(),
        "--check",
        repo()
            .join("golden/dumps/legacy-kvb-moe-q8_0.loaded-vllm-tp2.safetensors")
            .to_str()
            .unwrap(),
    ]);
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(out.contains("tp-rank-order"), "{out}");
    assert!(out.contains("shared_experts.gate_up_proj"), "{out}");
}

/// The TP dumps of the Q8_0 fixture carry every rank's loaded weights: `weights --check` names
/// rank 0's slice of `gate_up_proj` on the other ranks of the unfixed runs and passes the fixed
/// ones; the fix is recorded as a patch in the fixed dumps only.
#[test]
fn the_tp_dumps_weights_show_the_merged_column_shard_bug() {
    let dir = repo().join("golden/dumps");
    let model = repo().join("golden/models/legacy-kvb-q8_0.gguf");
    for (tp, fixed) in [(2, false), (2, true), (4, false), (4, true)] {
        let dump = dir.join(format!(
            "legacy-kvb-q8_0.vllm-tp{tp}{}.safetensors",
            if fixed { "-fixed" } else { "" }
        ));
        let (code, out, err) = run_bin(&[
            "weights",
            "--model",
            model.to_str().unwrap(),
            "--check",
            dump.to_str().unwrap(),
        ]);
        assert_eq!(code, if fixed { 0 } else { 1 }, "{}: {out}\n{err}", dump.display());
        if !fixed {
            assert!(out.contains("tp-rank-order"), "{out}");
            assert!(out.contains("every rank holds rank 0's slice"), "{out}");
        }
        let (_, _, _, doc) = compare_json(&model, &dump, &[]);
        let patches: Vec<&str> = doc["dump"]["patches"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|c| c.as_str())
            .collect();
        assert_eq!(
            patches.iter().any(|p| p.starts_with("`fix-merged-column-rank`: ")),
            fixed,
            "{}: {patches:?}",
            dump.display()
        );
    }
}

#[test]
fn a_vllm_dump_against_another_model_is_refused() {
    let (code, out, err, _) = compare_json(
        &repo().join("golden/models/tiny-v3-q8_0.gguf"),
        &repo().join("golden/dumps/tiny-v3-f32.vllm-unloaded.safetensors"),
        &[],
    );
    assert_eq!(code, 2, "{out}\n{err}");
    assert!(
        err.contains("header.model.index_sha256") && err.contains("tiny-v3-q8_0.gguf"),
        "{err}"
    );
}

/// A committed dump of the live engine (`vllm.LLM` on an H200, `scripts/gpu-host/vllm_live_gpu.sh`): file,
/// model, exit code, decode backend, the prefill step's attention site (`L0.lse` when the
/// backend decoded the prompt through forward_mqa, `L0.k_nope` when FA3's forward_mha ran it),
/// finding `(class, site)` or none. The dumps hold the activation sites only (the weight
/// sites and loaded weights left out to keep them small), except the split model's `L0.w.kv_b`.
type LiveCase = (
    &'static str,
    &'static str,
    i32,
    &'static str,
    &'static str,
    Option<(&'static str, &'static str)>,
);

const LIVE: &[LiveCase] = &[
    // FlashMLA decodes the 20-token prompt too (vLLM sends short prompts to forward_mqa): its lse
    // comes as [requests, N, q_len] and the hook makes it token-major.
    (
        "fa3-v3-bf16.vllm-live-flashmla.safetensors",
        "fa3-v3-bf16.gguf",
        0,
        "FLASHMLA",
        "L0.lse",
        None,
    ),
    // Triton MLA decodes one token at a time; the prompt goes through FA3 (forward_mha).
    (
        "fa3-v3-bf16.vllm-live-triton-mla.safetensors",
        "fa3-v3-bf16.gguf",
        0,
        "TRITON_MLA",
        "L0.k_nope",
        None,
    ),
    // Split attn_k_b/attn_v_b: vllm-gguf-plugin 0.0.5 never loads kv_b_proj (vLLM stops at load);
    // mla_diff_hooks.vllm --zero-unloaded gives it zeros so the engine runs, and compare names it.
    (
        "fa3-v3-split.vllm-live-unloaded.safetensors",
        "fa3-v3-split.gguf",
        1,
        "FLASHMLA",
        "L0.lse",
        Some(("weight-not-loaded", "L0.w.kv_b")),
    ),
];

#[test]
fn every_committed_live_vllm_dump_keeps_its_verdict() {
    let dir = repo().join("golden/dumps");
    let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".vllm-live"))
        .collect();
    on_disk.sort();
    let mut listed: Vec<String> = LIVE.iter().map(|c| c.0.to_string()).collect();
    listed.sort();
    assert_eq!(on_disk, listed, "every committed live vLLM dump is a case here");
    for &(dump, model, want, backend, prefill_site, finding) in LIVE {
        let (code, out, err, doc) = compare_json(&repo().join("golden/models").join(model), &dir.join(dump), &[]);
        assert_eq!(code, want, "{dump}: {out}\n{err}");
        assert_eq!(doc["dump"]["engine"], "vllm 0.26.0", "{dump}");
        assert_eq!(doc["dump"]["metadata"]["format"], "mla-diff dump 2", "{dump}");
        assert_eq!(doc["dump"]["metadata"]["attention_backend"], backend, "{dump}");
        // bf16 activations: judged with the bf16 engine rows.
        assert_eq!(doc["run"]["dtype"], "bf16", "{dump}");
        let sites = doc["sites"].as_array().unwrap();
        let status = |step: &str, site: &str| -> String {
            sites
                .iter()
                .find(|s| s["step"] == step && s["site"] == site)
                .unwrap_or_else(|| panic!("{dump}: {step} {site} not judged"))["status"]
                .as_str()
                .unwrap()
                .to_string()
        };
        for step in ["decode-1", "decode-2", "decode-3"] {
            for site in [
                "L0.ql_nope",
                "L0.attn_latent",
                "L0.lse",
                "L1.lse",
                "L1.attn_out",
                "L1.hidden_out",
            ] {
                let st = status(step, site);
                if want == 0 {
                    assert_eq!(st, "pass", "{dump}: {step} {site}");
                }
            }
        }
        let st = status("prefill", prefill_site);
        if want == 0 {
            assert_eq!(st, "pass", "{dump}: prefill {prefill_site}");
            assert!(doc["findings"].as_array().unwrap().is_empty(), "{dump}");
        }
        if let Some((class, site)) = finding {
            assert_eq!(doc["findings"][0]["class"], class, "{dump}");
            assert_eq!(doc["findings"][0]["site"], site, "{dump}");
            let patches: Vec<&str> = doc["dump"]["patches"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(|c| c.as_str())
                .collect();
            assert!(
                patches.iter().any(|c| c.starts_with("`zero-unloaded-weights`: ")),
                "{dump}: {patches:?}"
            );
        }
    }
}
