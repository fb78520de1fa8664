//! The committed scheduled-run dumps (`golden/dumps/live-cpu/*.safetensors`, format 2): vLLM
//! 0.26.0's real code on the CPU harness, scheduled as a serving engine runs it (`python -m
//! mla_diff_hooks.vllm_cpu run ... --chunk-tokens/--arrivals/--prefix/--workspace-tokens`, all
//! remade by `scripts/fixtures/make_live_cpu_dumps.py`): chunked prefill over cached context read
//! in several context chunks (one empty for the shorter request), a prefix-cache hit, and a
//! batch whose steps mix decode and prefill rows; the chunked case also with one bug of the chunk
//! loop or the merge planted. Each dump keeps its verdict, judged from a copy whose `plant:`
//! patches are removed: a clean run exit 0 with the per-chunk partial sites judged and passing;
//! a plant exit 1, its class named at its site in the step it first shows in; and a recording
//! that starts mid-request with a head subset (`--record-from`, `--heads`). Every file of the
//! folder is a case here, and none is above 2 MB.

use std::path::Path;

use crate::common::{compare_json, repo};
use crate::plant_dumps::{verdict, without_plants};

/// `<fixture>.<case>: <verdict>` for each committed dump (its model `golden/models/<fixture>.gguf`):
/// `clean` (exit 0, no finding) or `CLASS at SITE in STEP`, the first finding (exit 1).
const CASES: &[&str] = &[
    // Two prompts of 56 and 48 tokens in chunks of 8 (the second 2 steps later), their context
    // read in chunks of 16 (steps 3-6: 2-3 chunks, the shorter request's last one empty), then
    // 2 decode steps (step 7 mixes a decode row with the last prefill chunk).
    "legacy-kvb-f32.chunked: clean",
    // The second request's first 48 tokens a prefix-cache hit on the first's 3 full pages: its
    // 12 new tokens attend to them in 2 context chunks, next to the first request's decode row.
    "legacy-kvb-f32.prefix: clean",
    // 4 requests of 1, 15, 17 and 33 tokens in chunks of 16: the 1-token prompt through the
    // decode kernel next to three prefills, then decode rows next to a prefill over context.
    "legacy-kvb-f32.batch: clean",
    // An empty context chunk's LSE returned as +inf (FA2's sentinel; vLLM PR #15492): the chunk's
    // own LSE is wrong where vLLM's mask would say -inf, first in step 3 (chunk 1 of the
    // shorter request).
    "legacy-kvb-f32.ctx-empty-lse-inf: lse-merge at L0.ctx_lse.c1 in step-3",
    // The final merge reads the suffix (the new tokens' attention) with the context output's
    // head stride: every partial passes, the merged output does not.
    "legacy-kvb-f32.merge-suffix-stride: strided-view at L0.attn_out in step-1",
    // Context chunk 1's output never written (vLLM PR #26397): the chunk loop merges what
    // torch.empty handed out.
    "legacy-kvb-f32.ctx-chunk-unwritten: phantom-output at L0.ctx_out.c1 in step-3",
    // The chunked run recorded from forward 4 on, heads 1..3 of 4: the positions computed
    // before the window are rebuilt from the token ids (`unrecorded`).
    "legacy-kvb-f32.window: clean",
    // The same window from forward 3, with context chunk 1's output never written.
    "legacy-kvb-f32.window-ctx-chunk-unwritten: phantom-output at L0.ctx_out.c1 in step-3",
];

/// Each dump's size limit: the committed live dumps stay small enough for the repository.
const MAX_BYTES: u64 = 2 * 1024 * 1024;

/// The format-2 header of a safetensors file.
fn header(path: &Path) -> serde_json::Value {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let outer: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    serde_json::from_str(outer["__metadata__"]["header"].as_str().unwrap()).unwrap()
}

#[test]
fn every_scheduled_dump_keeps_its_verdict() {
    let dir = repo().join("golden/dumps/live-cpu");
    let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter_map(|n| n.strip_suffix(".safetensors").map(str::to_string))
        .collect();
    on_disk.sort();
    let cases: Vec<(&str, &str)> = CASES.iter().map(|c| c.split_once(": ").unwrap()).collect();
    let mut listed: Vec<String> = cases.iter().map(|c| c.0.to_string()).collect();
    listed.sort();
    assert_eq!(on_disk, listed, "every committed live-cpu dump is a case here");
    let tmp = tempfile::tempdir().unwrap();
    let mut wrong = Vec::new();
    for &(case, want) in &cases {
        let file = format!("{case}.safetensors");
        let src = dir.join(&file);
        let size = std::fs::metadata(&src).unwrap().len();
        assert!(size <= MAX_BYTES, "{case}: {size} bytes, above {MAX_BYTES}");
        let fixture = case.split('.').next().unwrap();
        let judged = tmp.path().join(&file);
        let removed = without_plants(&src, &judged);
        assert_eq!(
            removed,
            usize::from(want != "clean"),
            "{case}: one plant in a plant dump"
        );
        let model = repo().join("golden/models").join(format!("{fixture}.gguf"));
        let (code, got, out) = verdict(case, &model, &judged);
        let want_code = if want == "clean" { 0 } else { 1 };
        // The terminal's finding line names the step too, as the JSON's failing site does.
        let line_ok = want == "clean" || out.contains(&format!("finding [dump] {want}: "));
        if got != want || code != want_code || !line_ok {
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

/// The clean chunked run's partials are judged, not skipped: every context chunk of step 6 (3
/// chunks, the shorter request's last one empty), the merged context and the suffix pass.
#[test]
fn the_clean_chunked_run_judges_every_context_partial() {
    let model = repo().join("golden/models/legacy-kvb-f32.gguf");
    let dump = repo().join("golden/dumps/live-cpu/legacy-kvb-f32.chunked.safetensors");
    let (code, _, err, doc) = compare_json(&model, &dump, &[]);
    assert_eq!(code, 0, "{err}");
    let sites = doc["sites"].as_array().expect("a sites table");
    for site in [
        "L0.ctx_out.c0",
        "L0.ctx_lse.c0",
        "L0.ctx_out.c1",
        "L0.ctx_lse.c1",
        "L0.ctx_out.c2",
        "L0.ctx_lse.c2",
        "L0.ctx_out",
        "L0.ctx_lse",
        "L0.suffix_out",
        "L0.suffix_lse",
    ] {
        let row = sites.iter().find(|s| s["site"] == site && s["step"] == "step-6");
        let row = row.unwrap_or_else(|| panic!("{site} in step-6 not judged"));
        assert_eq!(row["status"], "pass", "{site} in step-6: {row}");
    }
}

/// What the hooks recorded of vLLM's scheduling, as the dumps' headers say it.
#[test]
fn the_headers_record_the_engines_scheduling() {
    let dir = repo().join("golden/dumps/live-cpu");
    let h = header(&dir.join("legacy-kvb-f32.chunked.safetensors"));
    let s6 = &h["steps"][6];
    assert_eq!(s6["order"], serde_json::json!([0, 1]));
    assert_eq!(s6["context_chunk_tokens"], 16);
    assert_eq!(
        s6["seqs"][0]["context_chunks"],
        serde_json::json!([[0, 16], [16, 32], [32, 48]])
    );
    assert_eq!(
        s6["seqs"][1]["context_chunks"],
        serde_json::json!([[0, 16], [16, 32], [32, 32]])
    );
    assert_eq!(h["steps"][7]["seqs"][0]["kernel"], "decode");
    assert_eq!(h["steps"][7]["seqs"][1]["kernel"], "prefill");
    let names: Vec<&str> = h["patches"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| p["name"].as_str())
        .collect();
    for p in [
        "attention-metadata-builder",
        "context-gather",
        "sdpa-context-chunk",
        "chunked-prefill-workspace",
    ] {
        assert!(names.contains(&p), "patch {p} recorded: {names:?}");
    }
    let h = header(&dir.join("legacy-kvb-f32.prefix.safetensors"));
    assert_eq!(
        h["steps"][1]["seqs"][1]["prefix"],
        serde_json::json!({"seq": 0, "len": 48})
    );
    assert_eq!(h["steps"][1]["seqs"][1]["context"], 48);
    let h = header(&dir.join("legacy-kvb-f32.batch.safetensors"));
    let kernels: Vec<&str> = h["steps"][0]["seqs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["kernel"].as_str().unwrap())
        .collect();
    assert_eq!(
        kernels,
        ["decode", "prefill", "prefill", "prefill"],
        "the 1-token prompt runs the decode kernel"
    );
}

/// A window of forwards with a head subset: the first recorded step declares each request's
/// earlier positions `unrecorded` (their context rebuilt from the token ids, noted, not judged),
/// and the per-head sites hold heads 1..3 while the latent cache stays whole.
#[test]
fn a_windowed_head_subset_recording_is_judged_over_the_whole_context() {
    let dir = repo().join("golden/dumps/live-cpu");
    let h = header(&dir.join("legacy-kvb-f32.window.safetensors"));
    assert_eq!(h["heads"], serde_json::json!([1, 3]));
    assert_eq!(h["steps"][0]["name"], "step-4");
    assert_eq!(h["steps"][0]["seqs"][0]["unrecorded"], 32);
    assert_eq!(h["steps"][0]["seqs"][1]["unrecorded"], 16);
    assert!(h["steps"][1]["seqs"][0].get("unrecorded").is_none());
    let model = repo().join("golden/models/legacy-kvb-f32.gguf");
    let (code, out, err, doc) = compare_json(&model, &dir.join("legacy-kvb-f32.window.safetensors"), &[]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("context rebuilt from token ids: seq 0 positions 0..32, seq 1 positions 0..16 (not judged)"),
        "{out}"
    );
    let sites = doc["sites"].as_array().expect("a sites table");
    let attn = sites
        .iter()
        .find(|s| s["site"] == "L0.attn_out" && s["step"] == "step-4")
        .expect("attn_out judged in the window's first step");
    assert_eq!(attn["status"], "pass");
    assert_eq!(attn["shape"], serde_json::json!([16, 2, 64]), "two heads of attn_out");
    for site in ["L0.ctx_out.c0", "L0.ctx_out.c1", "L0.ctx_out", "L0.suffix_out"] {
        let row = sites.iter().find(|s| s["site"] == site && s["step"] == "step-5");
        assert_eq!(
            row.map(|r| &r["status"]),
            Some(&serde_json::json!("pass")),
            "{site} in step-5"
        );
    }
}
