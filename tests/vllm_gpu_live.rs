//! The committed dumps of vLLM's live engine on an H200 (`golden/dumps/live-gpu/*.safetensors`,
//! format 2): vLLM 0.26.0 with vllm-gguf-plugin 0.0.5 on `fa3-v3-bf16.gguf`, each of the three
//! MLA backends vLLM accepts on sm90 (FLASHMLA, TRITON_MLA, FLASH_ATTN_MLA), recorded by
//! `mla_diff_hooks` through `scripts/gpu-host/vllm_live_cases.py` (one in-process `LLM` per
//! backend) and `scripts/gpu-host/vllm_serve_case.py` (`vllm serve` and an HTTP completion). The
//! cases: chunked prefill over cached context read in 7 context chunks (the last prefill step and
//! the decode steps; the positions before them rebuilt from the token ids), a prefix-cache hit of
//! four full pages, a batch of 1, 63, 65 and 300 tokens whose decode rows share steps with a
//! prefill; on TRITON_MLA the chunked case also with a bug of the chunk loop or the merge planted
//! in vLLM's code. Each dump keeps its verdict, judged from a copy whose `plant:` patches are
//! removed. Every file of the folder is a case here; each is at most 2 MB, the cases 16 MiB in
//! all. The sparse MLA (DSA) dumps of `scripts/gpu-host/vllm_dsa_live.py`
//! (`dsa-live-bf16.<backend>`, on `golden/models/dsa-live-bf16.gguf`) are judged by their own
//! test below, each at most 2 MB.

use crate::common::{compare_json, repo};
use crate::plant_dumps::{verdict, without_plants};

/// `<backend>.<case>: <verdict>` for each committed dump `fa3-v3-bf16.<backend>.<case>`:
/// `clean` (exit 0, no finding) or `CLASS at SITE in STEP`, the first finding (exit 1).
const CASES: &[&str] = &[
    "flashmla.chunked: clean",
    "flashmla.prefix: clean",
    "flashmla.batch: clean",
    "triton_mla.chunked: clean",
    "triton_mla.prefix: clean",
    "triton_mla.batch: clean",
    // FLASH_ATTN_MLA sends prefills of up to 512 tokens through its decode kernel: no context
    // partials at these chunk sizes, every row judged as a decode row.
    "flash_attn_mla.chunked: clean",
    "flash_attn_mla.prefix: clean",
    // One head: the last step's single decode row is one (token, head) row, judged by the
    // norm-ratio limit of its size (|ratio − 1| 7.5e-3 on that row in an earlier recording).
    "flash_attn_mla.batch: clean",
    // `vllm serve` and one HTTP completion (40 prompt tokens, 4 generated): the plugin armed the
    // engine-core process and wrote the dump itself.
    "triton_mla.serve: clean",
    // Planted in vLLM's code, the chunked window: an empty context chunk's LSE returned as +inf
    // (the shorter request's chunk 6), ...
    "triton_mla.plant-ctx-empty-lse-inf: lse-merge at L0.ctx_lse.c6 in step-5",
    // ... a context chunk's output never written (torch.empty's NaNs and stale values) ...
    "triton_mla.plant-ctx-chunk-unwritten: phantom-output at L0.ctx_out.c1 in step-5",
    // ... and the merge reading the suffix with the prefix's head stride, recorded with every
    // head (the last prefill step, its context in one chunk): a stride across heads is replayed.
    "triton_mla.plant-merge-suffix-stride: strided-view at L0.attn_out in step-5",
];

/// The file prefix of the sparse (DSA) dumps of `scripts/gpu-host/vllm_dsa_live.py`, on
/// `golden/models/dsa-live-bf16.gguf`.
const DSA_PREFIX: &str = "dsa-live-bf16.";

/// The committed DSA dumps (`dsa-live-bf16.<backend>.safetensors`), by name.
fn dsa_dumps() -> Vec<std::path::PathBuf> {
    let dir = repo().join("golden/dumps/live-gpu");
    let mut v: Vec<std::path::PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(DSA_PREFIX) && n.ends_with(".safetensors"))
        })
        .collect();
    v.sort();
    v
}

/// Each dump's size limit, and the folder's.
const MAX_BYTES: u64 = 2 * 1024 * 1024;
const MAX_TOTAL: u64 = 16 * 1024 * 1024;

/// The format-2 header of a safetensors file.
pub(crate) fn header(path: &std::path::Path) -> serde_json::Value {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let outer: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    serde_json::from_str(outer["__metadata__"]["header"].as_str().unwrap()).unwrap()
}

#[test]
fn every_live_gpu_dump_keeps_its_verdict() {
    let dir = repo().join("golden/dumps/live-gpu");
    let model = repo().join("golden/models/fa3-v3-bf16.gguf");
    let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter_map(|n| n.strip_suffix(".safetensors").map(str::to_string))
        .filter(|n| !n.starts_with(DSA_PREFIX))
        .collect();
    on_disk.sort();
    let cases: Vec<(&str, &str)> = CASES.iter().map(|c| c.split_once(": ").unwrap()).collect();
    let mut listed: Vec<String> = cases.iter().map(|c| format!("fa3-v3-bf16.{}", c.0)).collect();
    listed.sort();
    assert_eq!(on_disk, listed, "every committed live-gpu dump is a case here");
    let tmp = tempfile::tempdir().unwrap();
    let mut total = 0;
    let mut wrong = Vec::new();
    for &(case, want) in &cases {
        let file = format!("fa3-v3-bf16.{case}.safetensors");
        let src = dir.join(&file);
        let size = std::fs::metadata(&src).unwrap().len();
        total += size;
        assert!(size <= MAX_BYTES, "{case}: {size} bytes, above {MAX_BYTES}");
        let judged = tmp.path().join(&file);
        let removed = without_plants(&src, &judged);
        assert_eq!(
            removed,
            usize::from(want != "clean"),
            "{case}: one plant in a plant dump"
        );
        let (code, got, out) = verdict(case, &model, &judged);
        let want_code = if want == "clean" { 0 } else { 1 };
        // The finding's line names the step only when the dump holds several.
        let one_step = header(&src)["steps"].as_array().is_some_and(|s| s.len() == 1);
        let line_want = match want.rsplit_once(" in ") {
            Some((at, _)) if one_step => at,
            _ => want,
        };
        let line_ok = want == "clean" || out.contains(&format!("finding [dump] {line_want}: "));
        if got != want || code != want_code || !line_ok {
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

/// The chunked case on FLASHMLA and TRITON_MLA: its window's prefill step reads 7 context chunks
/// of 128 tokens (vLLM's workspace cut to 256 tokens, recorded as a patch), the shorter request's
/// last one empty; every chunk's output and LSE, the merged context, the suffix and the merge
/// are judged and pass, over contexts of 800 and 700 tokens rebuilt from the token ids.
#[test]
fn the_chunked_window_judges_seven_context_chunks_on_both_backends() {
    let dir = repo().join("golden/dumps/live-gpu");
    let model = repo().join("golden/models/fa3-v3-bf16.gguf");
    for backend in ["flashmla", "triton_mla"] {
        let dump = dir.join(format!("fa3-v3-bf16.{backend}.chunked.safetensors"));
        let h = header(&dump);
        let s0 = &h["steps"][0];
        assert_eq!(s0["name"], "step-5", "{backend}");
        assert_eq!(s0["context_chunk_tokens"], 128, "{backend}");
        let chunks = |i: usize| s0["seqs"][i]["context_chunks"].as_array().unwrap().len();
        assert_eq!((chunks(0), chunks(1)), (7, 7), "{backend}");
        assert_eq!(
            s0["seqs"][1]["context_chunks"][6],
            serde_json::json!([700, 700]),
            "{backend}"
        );
        assert_eq!(s0["seqs"][0]["unrecorded"], 800, "{backend}");
        assert_eq!(s0["seqs"][1]["unrecorded"], 700, "{backend}");
        assert!(
            h["patches"]
                .as_array()
                .unwrap()
                .iter()
                .any(|p| p["name"] == "chunked-prefill-workspace"),
            "{backend}"
        );
        let (code, _, err, doc) = compare_json(&model, &dump, &[]);
        assert_eq!(code, 0, "{backend}: {err}");
        let sites = doc["sites"].as_array().expect("a sites table");
        let mut judged = 0;
        for c in 0..7 {
            for site in [format!("L0.ctx_out.c{c}"), format!("L0.ctx_lse.c{c}")] {
                let row = sites
                    .iter()
                    .find(|s| s["site"] == site.as_str() && s["step"] == "step-5");
                assert_eq!(
                    row.map(|r| &r["status"]),
                    Some(&serde_json::json!("pass")),
                    "{backend} {site}"
                );
                judged += 1;
            }
        }
        for site in [
            "L0.ctx_out",
            "L0.ctx_lse",
            "L0.suffix_out",
            "L0.suffix_lse",
            "L0.attn_out",
        ] {
            let row = sites.iter().find(|s| s["site"] == site && s["step"] == "step-5");
            assert_eq!(
                row.map(|r| &r["status"]),
                Some(&serde_json::json!("pass")),
                "{backend} {site}"
            );
            judged += 1;
        }
        assert_eq!(judged, 19, "{backend}");
    }
}

/// What the hooks read of vLLM's scheduler on the GPU: the prefix-cache hit of 256 tokens (four
/// 64-token pages) and, in the batch, the 1-token prompt's rows through the decode kernel next
/// to three prefills; what the plugin wrote under `vllm serve`.
#[test]
fn the_live_headers_record_vllms_scheduling() {
    let dir = repo().join("golden/dumps/live-gpu");
    for backend in ["flashmla", "triton_mla", "flash_attn_mla"] {
        let h = header(&dir.join(format!("fa3-v3-bf16.{backend}.prefix.safetensors")));
        assert_eq!(h["engine"]["version"], "0.26.0", "{backend}");
        let hit = h["steps"]
            .as_array()
            .unwrap()
            .iter()
            .find_map(|s| s["seqs"][1].get("prefix").filter(|p| !p.is_null()).cloned());
        assert_eq!(hit, Some(serde_json::json!({"seq": 0, "len": 256})), "{backend}");
    }
    for backend in ["flashmla", "triton_mla"] {
        let h = header(&dir.join(format!("fa3-v3-bf16.{backend}.batch.safetensors")));
        let kernels: Vec<&str> = h["steps"][0]["seqs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["kernel"].as_str().unwrap())
            .collect();
        assert_eq!(kernels, ["decode", "prefill", "prefill", "prefill"], "{backend}");
    }
    // vllm serve: the plugin's dump names the GGUF the engine loaded and the plugin as its loader
    let h = header(&dir.join("fa3-v3-bf16.triton_mla.serve.safetensors"));
    assert_eq!(h["model"]["file"], "fa3-v3-bf16.gguf");
    assert_eq!(
        h["steps"].as_array().unwrap().len(),
        4,
        "the prefill and 3 decode forwards"
    );
    assert_eq!(h["steps"][0]["seqs"][0]["new"], 40);
}

/// Copies the format-2 dump `src` to `dst` keeping heads `a..b` of its per-head tensors (those
/// whose second dim is the header's head count: `[T, N, X]` and `[T, N]`), the header's `heads`
/// set to `[a, b]`: what `MLA_DIFF_VLLM_HEADS=a:b` would have recorded of the same run.
fn keep_heads(src: &std::path::Path, dst: &std::path::Path, [a, b]: [usize; 2]) {
    let bytes = std::fs::read(src).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let data = &bytes[8 + n..];
    let mut outer: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let mut header: serde_json::Value =
        serde_json::from_str(outer["__metadata__"]["header"].as_str().unwrap()).unwrap();
    let heads = header["heads"][1].as_u64().unwrap() as usize - header["heads"][0].as_u64().unwrap() as usize;
    header["heads"] = serde_json::json!([a, b]);
    outer["__metadata__"]["header"] = serde_json::Value::String(header.to_string());
    let mut names: Vec<String> = outer
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| *k != "__metadata__")
        .cloned()
        .collect();
    names.sort_by_key(|k| outer[k]["data_offsets"][0].as_u64().unwrap());
    let mut body = Vec::new();
    for name in names {
        let t = &mut outer[&name];
        let [from, to] = [0, 1].map(|i| t["data_offsets"][i].as_u64().unwrap() as usize);
        let raw = &data[from..to];
        let shape: Vec<usize> = t["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap() as usize)
            .collect();
        let start = body.len();
        if shape.len() >= 2 && shape[1] == heads && name.starts_with('s') {
            let inner = raw.len() / (shape[0] * heads);
            for row in raw.chunks(heads * inner) {
                body.extend_from_slice(&row[a * inner..b * inner]);
            }
            t["shape"][1] = serde_json::json!(b - a);
        } else {
            body.extend_from_slice(raw);
        }
        t["data_offsets"] = serde_json::json!([start, body.len()]);
    }
    let mut json = serde_json::to_vec(&outer).unwrap();
    while !json.len().is_multiple_of(8) {
        json.push(b' ');
    }
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&json);
    out.extend_from_slice(&body);
    std::fs::write(dst, out).unwrap();
}

/// A head subset hides a stride across heads from the replays: the merge-stride plant, recorded
/// with every head, is named `strided-view`; the same recording cut to head 0 is found at the
/// merge but not named, and its hint says which heads the dump holds and that recording every
/// head would have the bug named.
#[test]
fn a_head_subset_says_what_it_hides() {
    let dir = repo().join("golden/dumps/live-gpu");
    let model = repo().join("golden/models/fa3-v3-bf16.gguf");
    let tmp = tempfile::tempdir().unwrap();
    let judged = tmp.path().join("stride.safetensors");
    without_plants(
        &dir.join("fa3-v3-bf16.triton_mla.plant-merge-suffix-stride.safetensors"),
        &judged,
    );
    let (code, got, _) = verdict("stride", &model, &judged);
    assert_eq!((code, got.as_str()), (1, "strided-view at L0.attn_out in step-5"));
    let one = tmp.path().join("stride-head0.safetensors");
    keep_heads(&judged, &one, [0, 1]);
    let (code, got, out) = verdict("stride-head0", &model, &one);
    assert_eq!((code, got.as_str()), (1, "mismatch at L0.attn_out in step-5"), "{out}");
    assert!(
        out.contains("the dump holds heads 0..1 of 4: a view or stride across heads reads heads it leaves out"),
        "{out}"
    );
}

/// vLLM's sparse MLA path on an H200 (`scripts/gpu-host/vllm_dsa_live.py`: a 160-token prompt and
/// 4 decode steps of the glm-dsa fixture, index_topk 128, layer 0 hooked): each committed dump
/// declares the indexer's fp8 quantization as vLLM's `Indexer` has it, holds `idx_topk` in every
/// step (the decode steps' rows over their whole sequence), and passes: the selection against
/// the reference's on the same quantized operands (within the bf16 tie band), the attention on
/// the engine's own selection.
#[test]
fn the_live_dsa_dumps_pass_with_the_declared_fp8_indexer() {
    let model = repo().join("golden/models/dsa-live-bf16.gguf");
    for dump in dsa_dumps() {
        let name = dump.file_name().unwrap().to_string_lossy().into_owned();
        let size = std::fs::metadata(&dump).unwrap().len();
        assert!(size <= MAX_BYTES, "{name}: {size} bytes, above {MAX_BYTES}");
        let h = header(&dump);
        assert_eq!(
            h["indexer_quant"],
            serde_json::json!({"dtype": "fp8_e4m3", "block": 128, "scale": "ue8m0", "input": "bf16",
                               "q_amax_floor": 1e-10, "k_amax_floor": 1e-4}),
            "{name}"
        );
        let (code, out, err, doc) = compare_json(&model, &dump, &[]);
        assert_eq!(code, 0, "{name}: {out}\n{err}");
        let steps = h["steps"].as_array().unwrap().len();
        let judged: Vec<&serde_json::Value> = doc["sites"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|s| s["site"] == "L0.idx_topk")
            .collect();
        assert_eq!(judged.len(), steps, "{name}: idx_topk judged in every step");
        assert!(judged.iter().all(|s| s["status"] == "pass"), "{name}");
        assert!(
            crate::common::conversions(&doc)
                .iter()
                .any(|c| c.starts_with("L0: attention judged on the engine's selection")),
            "{name}"
        );
    }
}
