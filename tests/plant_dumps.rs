//! The committed plant dumps (`golden/dumps/plants/*.safetensors`, format 2): vLLM 0.26.0's real
//! code on the CPU harness (`python -m mla_diff_hooks.vllm_cpu run ... --plant NAME`, all remade
//! by `scripts/fixtures/make_plant_dumps.py`) with one historical MLA bug mechanism planted in
//! it, and clean runs of the same settings (several KV splits with empty ones, a non-identity
//! block table, a context of several pages). A plant is recorded in the header's `patches` for
//! provenance only: each dump is judged here from a copy whose `plant:` patches are removed, and
//! must keep its verdict: a clean run exit 0; a plant exit 1, its class named at its first dumped
//! site in the step it first shows in. Every file of the folder is a case here.

use std::path::Path;

use crate::common::{compare_json, repo};

/// `<fixture>.<case>: <verdict>` for each committed dump (its model `golden/models/<fixture>.gguf`):
/// `clean` (exit 0, no finding) or `CLASS at SITE in STEP`, the first finding (exit 1).
const CASES: &[&str] = &[
    // Clean: 4 KV splits (the 1-token row's last 2 empty), 8 splits, and two short requests; the
    // block tables come out of order from vLLM's BlockPool, the long row spans 7 pages.
    "legacy-kvb-q8_0.clean-splits4: clean",
    "yarn-v3-f32.clean-splits4: clean",
    "legacy-kvb-q8_0.clean-splits8: clean",
    "legacy-kvb-q8_0.clean-short: clean",
    "yarn-v3-f32.clean-short: clean",
    // Phantom output: the prefill's result never copied into the caller's buffer (vLLM PR #26397).
    "legacy-kvb-q8_0.dropped-output-copy: phantom-output at L0.attn_out in prefill",
    "yarn-v3-f32.dropped-output-copy: phantom-output at L0.attn_out in prefill",
    // Split-KV merges of the Triton MLA decode (sglang#40903, flashinfer#3047).
    "legacy-kvb-q8_0.split-lse-base2: lse-merge at L0.attn_latent in decode-1",
    "yarn-v3-f32.split-lse-base2: lse-merge at L0.attn_latent in decode-1",
    "legacy-kvb-q8_0.split-lse-base2-splits8: lse-merge at L0.attn_latent in decode-1",
    "legacy-kvb-q8_0.split-lost: lse-merge at L0.attn_latent in decode-1",
    "yarn-v3-f32.split-lost: lse-merge at L0.attn_latent in decode-1",
    "legacy-kvb-q8_0.split-lost-splits8: lse-merge at L0.attn_latent in decode-1",
    "legacy-kvb-q8_0.split-twice: lse-merge at L0.attn_latent in decode-1",
    "yarn-v3-f32.split-twice: lse-merge at L0.attn_latent in decode-1",
    "legacy-kvb-q8_0.split-twice-splits8: lse-merge at L0.attn_latent in decode-1",
    "legacy-kvb-q8_0.empty-split: lse-merge at L0.attn_latent in decode-1",
    "yarn-v3-f32.empty-split: lse-merge at L0.attn_latent in decode-1",
    "legacy-kvb-q8_0.empty-split-splits8: lse-merge at L0.attn_latent in decode-1",
    "legacy-kvb-q8_0.empty-split-lse-inf: lse-merge at L0.attn_latent in decode-1",
    "legacy-kvb-q8_0.empty-split-lse-stale: lse-merge at L0.attn_latent in decode-1",
    // Paged KV (AITER #2996, vLLM#56380, ROCm/ATOM#702).
    "legacy-kvb-q8_0.page-size-ignored: paged-kv at L0.attn_latent in decode-1",
    "yarn-v3-f32.page-size-ignored: paged-kv at L0.attn_latent in decode-1",
    "legacy-kvb-q8_0.page-size-ignored-read64: paged-kv at L0.attn_latent in decode-1",
    "legacy-kvb-q8_0.block-table-offset: paged-kv at L0.attn_latent in decode-1",
    "yarn-v3-f32.block-table-offset: paged-kv at L0.attn_latent in decode-1",
    "legacy-kvb-q8_0.block-table-offset-shift2: paged-kv at L0.attn_latent in decode-1",
    "legacy-kvb-q8_0.slot-mapping-offset: paged-kv at L0.attn_latent in decode-1",
    "yarn-v3-f32.slot-mapping-offset: paged-kv at L0.attn_latent in decode-1",
    "legacy-kvb-q8_0.slot-mapping-offset-shift16: paged-kv at L0.attn_latent in decode-1",
    "legacy-kvb-q8_0.block-id-truncated: paged-kv at L0.attn_latent in decode-1",
    "yarn-v3-f32.block-id-truncated: paged-kv at L0.attn_latent in decode-1",
    "legacy-kvb-q8_0.block-id-truncated-bits2: paged-kv at L0.attn_latent in decode-1",
    // The residual stream scaled (vLLM PR #14809, DeepSpeed PR #2310).
    "legacy-kvb-q8_0.residual-scale: residual-scale at L0.hidden_out in prefill",
    "yarn-v3-f32.residual-scale: residual-scale at L0.hidden_out in prefill",
    "legacy-kvb-q8_0.residual-scale-factor16: residual-scale at L0.hidden_out in prefill",
    "legacy-kvb-q8_0.residual-mp-scale: residual-scale at L0.hidden_out in prefill",
    "yarn-v3-f32.residual-mp-scale: residual-scale at L0.hidden_out in prefill",
    "legacy-kvb-q8_0.residual-mp-scale-mp4: residual-scale at L0.hidden_out in prefill",
    // Reduced precision in an f32 run (llama.cpp PR #13137, pytorch#188492).
    "legacy-kvb-q8_0.fp16-ql-nope: precision at L0.ql_nope in decode-1",
    "yarn-v3-f32.fp16-ql-nope: precision at L0.ql_nope in decode-1",
    "legacy-kvb-q8_0.fp16-ql-nope-bf16: precision at L0.ql_nope in decode-1",
    "legacy-kvb-q8_0.bf16-accum-v-up: precision at L0.attn_out in decode-1",
    "yarn-v3-f32.bf16-accum-v-up: precision at L0.attn_out in decode-1",
    "legacy-kvb-q8_0.bf16-accum-v-up-f16: precision at L0.attn_out in decode-1",
    // kv_b split variants (llama.cpp#13094).
    "legacy-kvb-q8_0.kv-b-head-grouping: kv-b-layout at L0.w.W_UK_T in prefill",
    "yarn-v3-f32.kv-b-head-grouping: kv-b-layout at L0.w.W_UK_T in prefill",
    "legacy-kvb-q8_0.kv-b-head-grouping-groups2: kv-b-layout at L0.w.W_UK_T in prefill",
    "yarn-v3-f32.kv-b-halves-swapped: kv-b-layout at L0.w.W_UK_T in prefill",
    // Skipped norms (the latent RMSNorm; vllm-metal#656's skipped query norm).
    "legacy-kvb-q8_0.kv-a-norm-skipped: norm-skipped at L0.kv_c_normed in prefill",
    "yarn-v3-f32.kv-a-norm-skipped: norm-skipped at L0.kv_c_normed in prefill",
    "legacy-kvb-q8_0.q-a-norm-skipped: norm-skipped at L0.q_c_normed in prefill",
    "yarn-v3-f32.q-a-norm-skipped: norm-skipped at L0.q_c_normed in prefill",
    // Strided views (llama.cpp#12956, vLLM#16658).
    "legacy-kvb-q8_0.k-pe-stride: strided-view at L0.k_pe_roped in prefill",
    "yarn-v3-f32.k-pe-stride: strided-view at L0.k_pe_roped in prefill",
    "legacy-kvb-q8_0.k-pe-stride-kv_a: strided-view at L0.k_pe_roped in prefill",
    "legacy-kvb-q8_0.q-pe-stride: strided-view at L0.q_pe_roped in prefill",
    "yarn-v3-f32.q-pe-stride: strided-view at L0.q_pe_roped in prefill",
];

/// `compare`'s verdict on the vLLM dump `judged` of `model`: its exit code, `clean` (exit 0, no
/// finding) or `CLASS at SITE in STEP` (the first finding, at its step's failing site), and the
/// terminal output. Panics (naming `case`) when the dump is not vLLM 0.26.0's.
pub(crate) fn verdict(case: &str, model: &Path, judged: &Path) -> (i32, String, String) {
    let (code, out, err, doc) = compare_json(model, judged, &[]);
    assert_eq!(doc["dump"]["engine"], "vllm 0.26.0", "{case}: {err}");
    let finding = &doc["findings"][0];
    let got = if code == 0 && doc["findings"].as_array().is_some_and(|f| f.is_empty()) {
        "clean".to_string()
    } else {
        let subject = finding["site"].as_str().or(finding["tensor"].as_str()).unwrap_or("?");
        let step = doc["sites"]
            .as_array()
            .and_then(|sites| sites.iter().find(|s| s["site"] == subject && s["status"] != "pass"))
            .and_then(|s| s["step"].as_str())
            .unwrap_or("?");
        format!("{} at {subject} in {step}", finding["class"].as_str().unwrap_or("?"))
    };
    (code, got, out)
}

/// Copies the safetensors file `src` to `dst` with every `plant:` entry removed from the format-2
/// header's `patches`, and returns how many were removed. The tensor data is copied as is: its
/// offsets are relative to the end of the JSON header, whose new length is written in front.
pub(crate) fn without_plants(src: &Path, dst: &Path) -> usize {
    let bytes = std::fs::read(src).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut outer: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let header_text = outer["__metadata__"]["header"].as_str().unwrap().to_string();
    let mut header: serde_json::Value = serde_json::from_str(&header_text).unwrap();
    let patches = header["patches"].as_array_mut().unwrap();
    let before = patches.len();
    patches.retain(|p| !p["name"].as_str().unwrap_or("").starts_with("plant:"));
    let removed = before - patches.len();
    outer["__metadata__"]["header"] = serde_json::Value::String(header.to_string());
    let mut json = serde_json::to_vec(&outer).unwrap();
    while !json.len().is_multiple_of(8) {
        json.push(b' ');
    }
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&json);
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(dst, out).unwrap();
    removed
}

#[test]
fn every_plant_dump_names_its_bug_and_every_clean_run_passes() {
    let dir = repo().join("golden/dumps/plants");
    let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter_map(|n| n.strip_suffix(".safetensors").map(str::to_string))
        .collect();
    on_disk.sort();
    let cases: Vec<(&str, &str)> = CASES.iter().map(|c| c.split_once(": ").unwrap()).collect();
    let mut listed: Vec<String> = cases.iter().map(|c| c.0.to_string()).collect();
    listed.sort();
    assert_eq!(on_disk, listed, "every committed plant dump is a case here");
    let tmp = tempfile::tempdir().unwrap();
    let mut wrong = Vec::new();
    for &(case, want) in &cases {
        let file = format!("{case}.safetensors");
        let fixture = case.split('.').next().unwrap();
        let judged = tmp.path().join(&file);
        let removed = without_plants(&dir.join(&file), &judged);
        assert_eq!(
            removed,
            usize::from(want != "clean"),
            "{case}: one plant in a plant dump"
        );
        let model = repo().join("golden/models").join(format!("{fixture}.gguf"));
        let (code, got, out) = verdict(case, &model, &judged);
        let want_code = if want == "clean" { 0 } else { 1 };
        if got != want || code != want_code {
            let first = out.lines().find(|l| l.contains("first divergence")).unwrap_or("");
            wrong.push(format!("{case}: want `{want}`, got exit {code} `{got}`; {first}"));
        }
    }
    assert!(
        wrong.is_empty(),
        "{} of {} dumps:\n{}",
        wrong.len(),
        CASES.len(),
        wrong.join("\n")
    );
}
