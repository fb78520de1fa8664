//! The committed dumps of vLLM's live engine on the block-FP8 checkpoint `golden/hf-v3-fp8`
//! (`golden/dumps/live-gpu-fp8/`, format 2), recorded on an H200 by
//! `scripts/gpu-host/vllm_hf_fp8_cases.sh`: vLLM 0.26.0 loading the folder itself
//! (`Fp8LinearMethod` on `CutlassFp8BlockScaledMMKernel`, activations quantized per token and
//! group of 128, declared as `act_quant`), on FLASHMLA and TRITON_MLA, with a bf16 latent cache
//! and with an fp8 one (`kv_cache_quant`; FLASHMLA's decode query in fp8 too, declared as its
//! `query`), a 20-token prompt and 3 decode steps (`single`) and, over the fp8 cache, two long
//! prompts whose last prefill step reads its cached context in 7 chunks (`chunked`); and each
//! fp8 bug planted in vLLM's code. Each dump keeps its verdict, judged from a copy whose `plant:`
//! patches are removed; the loaded weights (`weights.*`) were cut from the dumps and two tensors
//! of the WEIGHTS files kept (scripts/fixtures/trim_safetensors.py).

use crate::common::{repo, run_bin};
use crate::plant_dumps::{verdict, without_plants};
use crate::vllm_gpu_live::header as header_of;

/// `<backend>.<case>: <verdict>` for each committed dump `hf-v3-fp8.<backend>.<case>`: `clean`
/// (exit 0, no finding) or `CLASS at SITE in STEP`, the first finding (exit 1).
const CASES: &[&str] = &[
    // bf16 latent cache: the prefill (FA3 on TRITON_MLA; FlashMLA's decode kernel on FLASHMLA)
    // and 3 decode steps, every site and head.
    "flashmla.single: clean",
    "triton_mla.single: clean",
    // fp8 latent cache: FLASHMLA's decode query quantized too, TRITON_MLA's bf16.
    "flashmla-kv-fp8.single: clean",
    "triton_mla-kv-fp8.single: clean",
    // ... and a prefill over cached context read back from the fp8 cache in 7 chunks.
    "flashmla-kv-fp8.chunked: clean",
    "triton_mla-kv-fp8.chunked: clean",
    // k_scale 0.5 (every layer's, as a checkpoint's), written and read correctly.
    "triton_mla-kv-fp8.plant-kv-cache-scale-mode-none: clean",
    // Planted: k_scale 0.5 applied twice where rows are written (the cache reads back × 2) ...
    "flashmla-kv-fp8.plant-kv-cache-scale: kv-cache-scale at L0.attn_latent in step-0",
    // ... or missing there (× 0.5); TRITON_MLA prefills through FA3, so its first decode step.
    "triton_mla-kv-fp8.plant-kv-cache-scale-mode-missing: kv-cache-scale at L0.attn_latent in step-1",
    // The decode query quantized with 2 × the q_scale FLASHMLA descales it by.
    "flashmla-kv-fp8.plant-fp8-query-scale: scale-only at L0.ql_nope in step-0",
    // The fused q_a/kv_a input rounded through a per-tensor scale over stale padded rows; this
    // recording holds neither attn_in nor q_c/kv_a, so it is named at kv_c_normed, replayed
    // through the GEMM and the latent norm (f = 65536, the plant's stale factor).
    "triton_mla.plant-fp8-act-padded-rows: fp8-act-scale at L0.kv_c_normed in step-0",
    // o_proj's weight_scale_inv read transposed, named from the activations alone (the dump's
    // weights cut out): one factor per 128×128 block fitted from attn_out, the applied scales
    // the grid transposed and reshaped (the WEIGHTS file beside it names the same layout).
    "triton_mla.plant-fp8-scale-transposed: quant-scale-layout at L0.o_proj in step-1",
];

/// Each dump's size limit, and the folder's.
const MAX_BYTES: u64 = 2 * 1024 * 1024;
const MAX_TOTAL: u64 = 10 * 1024 * 1024;

#[test]
fn every_live_fp8_dump_keeps_its_verdict() {
    let dir = repo().join("golden/dumps/live-gpu-fp8");
    let model = repo().join("golden/hf-v3-fp8");
    let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| !n.ends_with(".weights.safetensors"))
        .filter_map(|n| n.strip_suffix(".safetensors").map(str::to_string))
        .collect();
    on_disk.sort();
    let cases: Vec<(&str, &str)> = CASES.iter().map(|c| c.split_once(": ").unwrap()).collect();
    let mut listed: Vec<String> = cases.iter().map(|c| format!("hf-v3-fp8.{}", c.0)).collect();
    listed.sort();
    assert_eq!(on_disk, listed, "every committed live-gpu-fp8 dump is a case here");
    let tmp = tempfile::tempdir().unwrap();
    let mut total = 0;
    let mut wrong = Vec::new();
    for &(case, want) in &cases {
        let file = format!("hf-v3-fp8.{case}.safetensors");
        let src = dir.join(&file);
        let size = std::fs::metadata(&src).unwrap().len();
        total += size;
        assert!(size <= MAX_BYTES, "{case}: {size} bytes, above {MAX_BYTES}");
        let judged = tmp.path().join(&file);
        let removed = without_plants(&src, &judged);
        assert_eq!(
            removed,
            usize::from(case.contains(".plant-")),
            "{case}: one plant in a plant dump"
        );
        let (code, got, out) = verdict(case, &model, &judged);
        let want_code = if want == "clean" { 0 } else { 1 };
        if got != want || code != want_code {
            let first = out.lines().find(|l| l.contains("first divergence")).unwrap_or("");
            wrong.push(format!("{case}: want `{want}`, got exit {code} `{got}`; {first}"));
        }
    }
    assert!(total <= MAX_TOTAL, "{total} bytes in all, above {MAX_TOTAL}");
    assert!(
        wrong.is_empty(),
        "{} of {} dumps:\n{}",
        wrong.len(),
        CASES.len(),
        wrong.join("\n")
    );
}

/// What the dumps declare: the block-FP8 GEMMs' activation quantization on every dump, the fp8
/// cache with k_scale 1 (0.5 where the plant set it) and a query scale on FLASHMLA only.
#[test]
fn the_fp8_dumps_declare_what_vllm_ran() {
    let dir = repo().join("golden/dumps/live-gpu-fp8");
    let header = |name: &str| header_of(&dir.join(format!("hf-v3-fp8.{name}.safetensors")));
    for name in ["flashmla.single", "triton_mla-kv-fp8.chunked"] {
        let h = header(name);
        assert_eq!(h["act_quant"]["granularity"], "token-group", "{name}");
        assert_eq!(h["act_quant"]["group"], 128, "{name}");
    }
    assert!(header("flashmla.single")["kv_cache_quant"].is_null());
    let fl = header("flashmla-kv-fp8.single");
    assert_eq!(fl["kv_cache_quant"]["scale"], 1.0);
    assert_eq!(fl["kv_cache_quant"]["query"]["scale"], 1.0);
    let tr = header("triton_mla-kv-fp8.single");
    assert_eq!(tr["kv_cache_quant"]["scale"], 1.0);
    assert!(
        tr["kv_cache_quant"].get("query").is_none(),
        "TRITON_MLA keeps a bf16 query"
    );
    let planted = header("triton_mla-kv-fp8.plant-kv-cache-scale-mode-missing");
    assert_eq!(planted["kv_cache_quant"]["scale"], 0.5);
    // the chunked window: 7 context chunks per sequence, over the fp8 cache
    let ch = header("flashmla-kv-fp8.chunked");
    let chunks = ch["steps"][0]["seqs"][0]["context_chunks"].as_array().unwrap().len();
    assert_eq!(chunks, 7);
}

/// `weights --check` on the weights vLLM loaded (o_proj and kv_b_proj dequantized through
/// vLLM's own function, bit-exact against the checkpoint's blocks): clean, and o_proj's
/// transposed scale grid named with its layout.
#[test]
fn weights_check_passes_vllms_fp8_weights_and_names_a_transposed_scale() {
    let dir = repo().join("golden/dumps/live-gpu-fp8");
    let model = repo().join("golden/hf-v3-fp8");
    let m = model.to_str().unwrap();
    let clean = dir.join("hf-v3-fp8.triton_mla.single.weights.safetensors");
    let (code, out, err) = run_bin(&["weights", "--model", m, "--check", clean.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("L0.kv_b_proj") && out.contains("L0.o_proj"), "{out}");
    let planted = dir.join("hf-v3-fp8.triton_mla.plant-fp8-scale-transposed.weights.safetensors");
    let (code, out, err) = run_bin(&["weights", "--model", m, "--check", planted.to_str().unwrap()]);
    assert_eq!(code, 1, "{out}{err}");
    let all = format!("{out}{err}");
    assert!(all.contains("quant-scale-layout at L0.o_proj"), "{all}");
    assert!(all.contains("s.t().contiguous().view(s.shape)"), "{all}");
}
