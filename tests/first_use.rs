//! What a new user meets first, from the README's commands: one bug printed once however many
//! paths find it, a harness's engine patches told apart from conversions, a format-2 dump's
//! "not dumped" list that does not name a weight another step holds, heat-map rows that name
//! their step, a report readable without its SVG, every written file named, a dump of another
//! model called so, and runs that judged nothing saying it.

use crate::common::{Dims, compare_json, deepseek2, repo, run_bin, write_safetensors, write_temp};

/// The vLLM dump of `fa3-v3-split` whose engine never loaded kv_b (format 2: a prefill and three
/// decode steps, the weights dumped in the prefill, two harness patches).
fn unloaded_dump() -> (std::path::PathBuf, std::path::PathBuf) {
    (
        repo().join("golden/models/fa3-v3-split.gguf"),
        repo().join("golden/dumps/fa3-v3-split.vllm-live-unloaded.safetensors"),
    )
}

#[test]
fn one_bug_found_on_every_path_is_one_finding_line() {
    let (code, out, _) = run_bin(&["run", "--layer", "1", "--inject", "kv-norm-skipped", "-q"]);
    assert_eq!(code, 1, "{out}");
    let findings: Vec<&str> = out.lines().filter(|l| l.starts_with("finding ")).collect();
    assert_eq!(findings.len(), 1, "{out}");
    assert!(
        findings[0].starts_with("finding [mha, mqa, chunked, mixed] norm-skipped at L1.kv_c_normed: "),
        "{out}"
    );
    assert_eq!(out.lines().filter(|l| l.starts_with("  hint: ")).count(), 1, "{out}");
}

#[test]
fn a_fault_with_nothing_to_act_on_says_so_once_for_every_path() {
    // At one token every position is 0, where RoPE is the identity: the same sentence on every
    // path, said once with the paths.
    let (code, out, err) = run_bin(&["run", "--layer", "1", "--tokens", "1", "--inject", "rope-neox", "-q"]);
    assert_eq!(code, 2, "{out}\n{err}");
    let line: Vec<&str> = out.lines().filter(|l| l.starts_with("injected rope-neox: ")).collect();
    assert_eq!(
        line,
        [
            "injected rope-neox: not exercised (mha, mqa, chunked, mixed: every token is at position 0, where RoPE is the identity: the RoPE fault had nothing to act on (use more tokens or --start-pos))"
        ],
        "{out}"
    );
    // The paths a fault does not act on share one note on stderr.
    let (_, _, err) = run_bin(&["run", "--layer", "1", "--inject", "lse-plus-inf", "-q"]);
    let notes: Vec<&str> = err.lines().filter(|l| l.contains("does not act on")).collect();
    assert_eq!(
        notes,
        [
            "mla-diff: note: --inject lse-plus-inf does not act on paths mha, mixed (only chunked prefill and split-KV decode merge partials)"
        ],
        "{err}"
    );
}

#[test]
fn engine_patches_are_provenance_and_a_prefill_weight_is_not_missing_from_decode_steps() {
    let (model, dump) = unloaded_dump();
    let (code, out, err, doc) = compare_json(&model, &dump, &[]);
    assert_eq!(code, 1, "{out}\n{err}");
    // The finding's site, dumped in the prefill, is not "not dumped" in the decode steps.
    assert_eq!(doc["findings"][0]["site"], "L0.w.kv_b");
    let not_dumped: Vec<&str> = doc["dump"]["not_dumped"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap())
        .collect();
    assert!(!not_dumped.iter().any(|s| s.ends_with(": L0.w.kv_b")), "{not_dumped:?}");
    assert!(not_dumped.contains(&"prefill: L1.w.kv_b") || !not_dumped.iter().any(|s| s.ends_with("L1.w.kv_b")));
    // Patches: in the JSON with their reasons, apart from the conversions; one text line.
    let patches: Vec<&str> = doc["dump"]["patches"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap())
        .collect();
    assert_eq!(patches.len(), 2, "{patches:?}");
    assert!(patches[0].starts_with("`zero-unloaded-weights`: a linear layer whose GGUF weight"));
    assert_eq!(
        patches[1],
        "`zeroed`: model.layers.0.self_attn.kv_b_proj, model.layers.1.self_attn.kv_b_proj"
    );
    assert!(
        !doc["dump"]["conversions"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c.as_str().unwrap().contains("zero")),
        "{}",
        doc["dump"]["conversions"]
    );
    let head: Vec<&str> = out.lines().take_while(|l| !l.starts_with("== ")).collect();
    assert_eq!(
        head.iter().filter(|l| l.contains("patch")).copied().collect::<Vec<_>>(),
        [
            "engine patches: 2 (zero-unloaded-weights, zeroed): the engine ran with them; --json and --report list each with its reason"
        ],
        "{out}"
    );
    assert!(!out.contains("converted patch"), "{out}");
}

#[test]
fn a_report_names_its_files_and_carries_a_text_heat_map_with_steps() {
    let (model, dump) = unloaded_dump();
    let dir = tempfile::tempdir().unwrap();
    let md = dir.path().join("r.md");
    let json = dir.path().join("r.json");
    let args = [
        "compare",
        "--model",
        model.to_str().unwrap(),
        "--dump",
        dump.to_str().unwrap(),
        "--report",
        md.to_str().unwrap(),
        "--json",
        json.to_str().unwrap(),
    ];
    let (code, out, err) = run_bin(&args);
    assert_eq!(code, 1, "{out}\n{err}");
    let wrote: Vec<&str> = err.lines().filter(|l| l.starts_with("wrote ")).collect();
    let svg = dir.path().join("r.svg");
    assert_eq!(
        wrote,
        [
            format!("wrote {}", json.display()),
            format!("wrote {}", md.display()),
            format!("wrote {}", svg.display())
        ],
        "{err}"
    );
    let text = std::fs::read_to_string(&md).unwrap();
    let block = text
        .split("```text\n")
        .find(|b| b.starts_with("site "))
        .and_then(|b| b.split("```").next())
        .unwrap_or_else(|| panic!("no text heat map in\n{text}"));
    let rows: Vec<&str> = block.lines().skip(1).take_while(|l| !l.is_empty()).collect();
    let labels: Vec<&str> = rows.iter().map(|r| r.split("  ").next().unwrap().trim()).collect();
    assert_eq!(
        labels,
        [
            "L0 dump prefill",
            "L1 dump prefill",
            "L0 dump decode-1",
            "L1 dump decode-1",
            "L0 dump decode-2",
            "L1 dump decode-2",
            "L0 dump decode-3",
            "L1 dump decode-3"
        ],
        "{block}"
    );
    // The all-zero kv_b is order 1 and the first divergence of the prefill's layer 0.
    assert!(rows[0].contains(" 0*<"), "{block}");
    assert!(block.contains("sites: 1 hidden_in, "), "{block}");
    let svg_text = std::fs::read_to_string(&svg).unwrap();
    assert!(svg_text.contains("L0 dump decode-1"), "the SVG rows name the step");
    // --quiet names nothing.
    let mut quiet = args.to_vec();
    quiet.extend(["--force", "--quiet"]);
    let (_, _, err) = run_bin(&quiet);
    assert!(!err.contains("wrote "), "{err}");
}

/// A copy of the HF dump of `tiny-v3-f32` whose `L0.hidden_in` rows are in reverse token order:
/// what another model's dump looks like at its first site (rows unrelated to embed(tokens)).
fn dump_with_foreign_hidden_in() -> (tempfile::TempDir, std::path::PathBuf) {
    use safetensors::SafeTensors;
    let src = std::fs::read(repo().join("golden/dumps/tiny-v3-f32.hf.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&src).unwrap();
    let (_, m) = SafeTensors::read_metadata(&src).unwrap();
    let meta = m.metadata().clone().unwrap_or_default();
    let mut tensors = Vec::new();
    for (name, view) in st.tensors() {
        let mut data = view.data().to_vec();
        if name == "L0.hidden_in" {
            let row = data.len() / view.shape()[0];
            data = data.chunks(row).rev().flatten().copied().collect();
        }
        tensors.push((name, view.dtype(), view.shape().to_vec(), data));
    }
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("other.safetensors");
    write_safetensors(&p, &tensors, Some(meta.into_iter().collect()));
    (dir, p)
}

#[test]
fn a_first_site_far_from_the_gguf_says_the_dump_may_be_another_models() {
    let model = repo().join("golden/models/tiny-v3-f32.gguf");
    let (_dir, dump) = dump_with_foreign_hidden_in();
    let (code, out, err, doc) = compare_json(&model, &dump, &[]);
    assert_eq!(code, 1, "{out}\n{err}");
    assert_eq!(doc["findings"][0]["class"], "mismatch");
    assert_eq!(doc["findings"][0]["site"], "L0.hidden_in");
    let hint = doc["findings"][0]["hint"].as_str().unwrap();
    assert!(
        hint.starts_with(&format!(
            "this may be another model's dump: the first site L0.hidden_in is not embed(tokens) of {} (rel_l2 ",
            model.display()
        )),
        "{hint}"
    );
    assert!(
        hint.contains(&format!("check that {} was made from that GGUF", dump.display())),
        "{hint}"
    );
    // The same model requantized differs by rounding only: no such hint.
    let q8 = repo().join("golden/models/tiny-v3-q8_0.gguf");
    let (_, _, _, doc) = compare_json(&q8, &repo().join("golden/dumps/tiny-v3-f32.hf.safetensors"), &[]);
    assert_eq!(doc["findings"][0]["site"], "L0.hidden_in");
    assert!(
        !doc["findings"][0]["hint"].as_str().unwrap().contains("another model"),
        "{}",
        doc["findings"][0]["hint"]
    );
}

#[test]
fn a_chunked_path_without_cached_context_says_nothing_was_judged() {
    // Four tokens, five new tokens per sequence: no cached context for the chunk loop.
    let (code, out, err) = run_bin(&["run", "--layer", "1", "--tokens", "4", "-q"]);
    assert_eq!(code, 0, "{out}\n{err}");
    let chunked: Vec<&str> = out.lines().filter(|l| l.starts_with("chunked: ")).collect();
    assert_eq!(
        chunked,
        [
            "chunked: nothing judged (no sequence is longer than --new-tokens 5, so there was no cached context to process in chunks (the path ran as a plain prefill; give a longer sequence)); its 23 sites within tolerance"
        ],
        "{out}"
    );
    assert!(out.lines().any(|l| l == "mha: all 23 sites within tolerance"), "{out}");
    // With context, the usual line.
    let (_, out, _) = run_bin(&["run", "--layer", "1", "--tokens", "6", "--path", "chunked", "-q"]);
    assert_eq!(
        out.lines().next(),
        Some("chunked: all 23 sites within tolerance"),
        "{out}"
    );
}

#[test]
fn a_layer_with_an_all_zero_weight_gets_a_note() {
    let mut g = deepseek2(Dims::default(), false);
    for t in &mut g.tensors {
        if t.name == "blk.0.attn_output.weight" {
            t.data.iter_mut().for_each(|b| *b = 0);
        }
    }
    let (_dir, p) = write_temp(&g.build().bytes, "zero.gguf");
    let (code, out, err) = run_bin(&["run", "--model", p.to_str().unwrap(), "--layer", "0", "-q"]);
    assert_eq!(code, 0, "{out}\n{err}");
    let notes: Vec<&str> = out.lines().filter(|l| l.contains("all zeros")).collect();
    assert_eq!(
        notes,
        [
            "note (mha L0): layer 0's `blk.0.attn_output.weight` is all zeros in the GGUF: what it feeds is 0 in the reference and on every path, so it passes without judging anything"
        ],
        "{out}"
    );
    // Layer 1 keeps its weights: no note.
    let (_, out, _) = run_bin(&["run", "--model", p.to_str().unwrap(), "--layer", "1", "-q"]);
    assert!(!out.contains("all zeros"), "{out}");
}
