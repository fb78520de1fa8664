//! Bad input never panics: every malformed or unusable GGUF, and every impossible request, exits
//! with code 2 and ONE line naming the file and the field or tensor.

use crate::common::{Dims, GgufBuilder, Val, deepseek2, run_bin, write_temp};

/// Runs `mla-diff <args…> --model FILE` (or `inspect FILE`) on `bytes` and checks the contract:
/// exit 2, one stderr line, naming the file and every string in `must_name`.
fn expect_exit2(bytes: &[u8], cmd: &[&str], must_name: &[&str]) -> String {
    let (_dir, path) = write_temp(bytes, "bad.gguf");
    let p = path.to_str().unwrap();
    let mut args: Vec<&str> = cmd.to_vec();
    if cmd[0] == "inspect" {
        args.push(p);
    } else {
        args.extend(["--model", p]);
    }
    let (code, _out, err) = run_bin(&args);
    assert_eq!(code, 2, "exit code for {must_name:?}; stderr: {err}");
    let lines: Vec<&str> = err.lines().filter(|l| !l.starts_with("mla-diff: backend")).collect();
    assert_eq!(lines.len(), 1, "one error line expected, got: {err}");
    assert!(lines[0].contains("bad.gguf"), "error must name the file: {err}");
    for s in must_name {
        assert!(lines[0].contains(s), "error must name `{s}`: {err}");
    }
    assert!(!err.contains("panicked"), "{err}");
    lines[0].to_string()
}

fn good() -> GgufBuilder {
    deepseek2(Dims::default(), false)
}

#[test]
fn a_valid_built_model_passes_both_paths() {
    let b = good().build();
    let (_d, p) = write_temp(&b.bytes, "good.gguf");
    let (code, out, err) = run_bin(&["run", "--model", p.to_str().unwrap(), "--layer", "1", "--quiet"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("mha: all") && out.contains("mqa: all"), "{out}");
}

#[test]
fn truncated_in_header() {
    let b = good().build();
    expect_exit2(&b.bytes[..10], &["run"], &["tensor_count", "truncated"]);
}

#[test]
fn truncated_inside_metadata() {
    let b = good().build();
    let (at, name) = b
        .fields
        .iter()
        .find(|(_, n)| n.starts_with("deepseek2.attention.kv_lora_rank: value"))
        .unwrap()
        .clone();
    let msg = expect_exit2(&b.bytes[..at + 2], &["run"], &["truncated"]);
    assert!(msg.contains("deepseek2.attention.kv_lora_rank"), "{msg} ({name})");
}

#[test]
fn truncated_inside_tensor_data() {
    let b = good().build();
    let (at, _) = b
        .fields
        .iter()
        .find(|(_, n)| n == "blk.1.attn_output.weight: data")
        .unwrap()
        .clone();
    expect_exit2(&b.bytes[..at + 8], &["run"], &["blk.1.attn_output.weight", "offset"]);
}

#[test]
fn wrong_magic() {
    let mut g = good();
    g.magic = *b"GGML";
    expect_exit2(&g.build().bytes, &["run"], &["magic"]);
}

#[test]
fn unsupported_versions() {
    for (v, hint) in [
        (1u32, "obsolete"),
        (4, "unsupported version 4"),
        (3u32.swap_bytes(), "big-endian"),
    ] {
        let mut g = good();
        g.version = v;
        expect_exit2(&g.build().bytes, &["run"], &["version", hint]);
    }
}

#[test]
fn tensor_offset_past_end_of_file() {
    let mut g = good();
    let i = g
        .tensors
        .iter()
        .position(|t| t.name == "blk.0.attn_q_b.weight")
        .unwrap();
    g.tensors[i].offset_override = Some(1 << 40);
    expect_exit2(
        &g.build().bytes,
        &["run"],
        &["blk.0.attn_q_b.weight", "offset", "past the end"],
    );
}

#[test]
fn absurd_counts() {
    let mut g = good();
    g.tensor_count_override = Some(1 << 63);
    expect_exit2(&g.build().bytes, &["run"], &["tensor_count"]);
    let mut g = good();
    g.kv_count_override = Some(u64::MAX);
    expect_exit2(&g.build().bytes, &["run"], &["metadata_kv_count"]);
    let mut g = good();
    g.kv(
        "tokenizer.ggml.scores",
        Val::Raw(9, {
            let mut v = 6u32.to_le_bytes().to_vec();
            v.extend_from_slice(&(1u64 << 62).to_le_bytes());
            v
        }),
    );
    expect_exit2(&g.build().bytes, &["run"], &["tokenizer.ggml.scores", "array"]);
}

#[test]
fn huge_string_length() {
    let mut g = good();
    g.kv("general.name", Val::Raw(8, (u64::MAX / 2).to_le_bytes().to_vec()));
    expect_exit2(&g.build().bytes, &["run"], &["general.name", "string length"]);
}

#[test]
fn unknown_quant_type() {
    let mut g = good();
    let i = g
        .tensors
        .iter()
        .position(|t| t.name == "blk.0.attn_kv_a_mqa.weight")
        .unwrap();
    g.tensors[i].type_id = 99;
    expect_exit2(
        &g.build().bytes,
        &["run"],
        &["blk.0.attn_kv_a_mqa.weight", "ggml type id 99"],
    );
}

#[test]
fn missing_mla_tensor() {
    let mut g = good();
    g.tensors.retain(|t| t.name != "blk.1.attn_kv_a_mqa.weight");
    expect_exit2(
        &g.build().bytes,
        &["run", "--layer", "1"],
        &["blk.1.attn_kv_a_mqa.weight", "missing tensor"],
    );
}

#[test]
fn wrong_tensor_shape_names_the_dims() {
    let mut g = good();
    let i = g
        .tensors
        .iter()
        .position(|t| t.name == "blk.0.attn_k_b.weight")
        .unwrap();
    g.tensors[i].ne.swap(0, 1);
    expect_exit2(&g.build().bytes, &["run"], &["blk.0.attn_k_b.weight", "N × L × P"]);
}

#[test]
fn layer_out_of_range() {
    let b = good().build();
    expect_exit2(&b.bytes, &["run", "--layer", "7"], &["layer 7", "block_count"]);
}

#[test]
fn missing_key_and_non_mla_architecture() {
    let mut g = good();
    g.remove_kv("deepseek2.attention.kv_lora_rank");
    expect_exit2(&g.build().bytes, &["run"], &["deepseek2.attention.kv_lora_rank"]);
    let mut g = good();
    g.set_kv("general.architecture", Val::Str("llama".into()));
    expect_exit2(&g.build().bytes, &["run"], &["general.architecture", "llama"]);
}

#[test]
fn alignment_zero_and_overflowing_dims_and_duplicates() {
    let mut g = good();
    g.kv("general.alignment", Val::U32(0));
    expect_exit2(&g.build().bytes, &["inspect"], &["general.alignment"]);
    let mut g = good();
    let i = g
        .tensors
        .iter()
        .position(|t| t.name == "blk.0.attn_norm.weight")
        .unwrap();
    g.tensors[i].ne = vec![1 << 32, 1 << 32, 1 << 32];
    expect_exit2(&g.build().bytes, &["inspect"], &["blk.0.attn_norm.weight", "overflows"]);
    let mut g = good();
    let dup = g.tensors[3].clone();
    g.tensors.push(dup);
    expect_exit2(&g.build().bytes, &["inspect"], &["duplicate tensor name"]);
}

#[test]
fn output_file_is_not_overwritten_without_force() {
    let b = good().build();
    let (dir, p) = write_temp(&b.bytes, "good.gguf");
    let json = dir.path().join("r.json");
    std::fs::write(&json, "keep me").unwrap();
    let (code, _, err) = run_bin(&["run", "--model", p.to_str().unwrap(), "--json", json.to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--force"), "{err}");
    assert_eq!(std::fs::read_to_string(&json).unwrap(), "keep me");
    let (code, _, err) = run_bin(&[
        "run",
        "--model",
        p.to_str().unwrap(),
        "--json",
        json.to_str().unwrap(),
        "--force",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["schema"], mla_diff::output::report::JSON_SCHEMA_VERSION);
}

/// Runs the binary on the embedded fixture and returns (code, stderr).
fn embedded(args: &[&str]) -> (i32, String) {
    let (code, _, err) = run_bin(args);
    (code, err)
}

#[test]
fn flags_out_of_range_are_usage_errors_not_crashes() {
    for (args, needle) in [
        (&["run", "--start-pos", "18446744073709551615"][..], "--start-pos"),
        (&["run", "--start-pos", "4294967296"][..], "2^31"),
        (&["run", "--tp", "0"][..], "--tp must be at least 1"),
        (&["run", "--tokens", "0"][..], "--tokens must be at least 1"),
        (&["run", "--model", "/"][..], "a folder without config.json"),
        (&["run", "--inject", "tp-rank-order"][..], "needs --tp ≥ 2"),
        (&["run", "--inject", "no-mscale"][..], "needs a YaRN model"),
        (&["selftest", "--backend", "cpu", "--cross-check"][..], "--cross-check"),
    ] {
        let (code, err) = embedded(args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

/// Numeric flags at their type's maximum: exit 2, one `mla-diff: error:` line naming the flag,
/// before anything is sized by them (no panic, no capacity overflow).
#[test]
fn flags_at_their_types_maximum_are_refused_naming_the_flag() {
    let max = "18446744073709551615";
    let gguf = crate::common::repo().join("golden/models/tiny-v3-q8_0.gguf");
    let gguf = gguf.to_str().unwrap();
    let layers = format!("0..{max}");
    let layers_incl = format!("0..={max}");
    for (args, needle) in [
        (vec!["run", "--page-size", max], "--page-size"),
        (vec!["run", "--splits", max], "--splits"),
        (vec!["run", "--layers", &layers], "--layers"),
        (vec!["run", "--layers", &layers_incl], "--layers"),
        (vec!["bench", "--reference", gguf, "--tokens", max], "--tokens"),
    ] {
        let (code, err) = embedded(&args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        let lines: Vec<&str> = err.lines().filter(|l| !l.starts_with("mla-diff: backend")).collect();
        assert_eq!(lines.len(), 1, "{args:?}: {err}");
        assert!(
            lines[0].starts_with("mla-diff: error:") && lines[0].contains(needle),
            "{args:?}: {err}"
        );
    }
}

/// A `--layers` range past the model names the first layer of the range the model lacks, and a
/// reversed or empty range selects no layer, whatever its bounds.
#[test]
fn a_layers_range_names_its_first_missing_layer() {
    // the embedded fixture has 2 layers
    for (range, want) in [
        ("2..5", "--layers `2..5`: layer 2 out of range: the model has 2 layers"),
        (
            "1..=7",
            "--layers `1..=7`: layer 2 out of range: the model has 2 layers",
        ),
        ("4..9", "--layers `4..9`: layer 4 out of range: the model has 2 layers"),
        ("5..3", "--layers `5..3` selects no layer"),
        ("5..=3", "--layers `5..=3` selects no layer"),
        ("1..1", "--layers `1..1` selects no layer"),
    ] {
        let (code, err) = embedded(&["run", "--layers", range]);
        assert_eq!(code, 2, "{range}: {err}");
        let line = err
            .lines()
            .find(|l| l.starts_with("mla-diff: error:"))
            .unwrap_or_default();
        assert!(line.contains(want), "{range}: {err}");
    }
    // refused before the backend is chosen: the error is the only line
    for args in [
        &["run", "--layer", "2"][..],
        &["run", "--tp", "4"],
        &["run", "--layer", "99999999999"],
    ] {
        let (code, err) = embedded(args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(err.starts_with("mla-diff: error:"), "{args:?}: {err}");
    }
}

/// An `--arch` value that is no compute capability is refused when the flag is read, naming the
/// flag and the value, before NVRTC is looked for (so it shows on a machine without CUDA).
#[test]
fn kernels_arch_values_are_compute_capabilities() {
    for bad in ["sm_9x", "90", "sm_090", "compute_90"] {
        let arch = format!("sm_90,{bad}");
        let (code, err) = embedded(&["kernels", "--compile-only", "--arch", &arch]);
        assert_eq!(code, 2, "{bad}: {err}");
        assert!(
            err.contains("--arch") && err.contains(&format!("`{bad}`")),
            "{bad}: {err}"
        );
        assert!(!err.contains("NVRTC") && !err.contains("panicked"), "{bad}: {err}");
    }
}

/// `--devices` mistakes are exit-2 lines naming the flag, found before any GPU is asked (so
/// they show on a machine without one); a machine without the GPUs says so.
#[test]
fn devices_must_be_one_distinct_gpu_per_rank_on_the_cuda_backend() {
    for (args, needle) in [
        (
            &["run", "--tp", "2", "--devices", "0,1"][..],
            "--devices puts each TP rank on its own GPU and needs --backend cuda",
        ),
        (
            &["run", "--backend", "cuda", "--tp", "2", "--devices", "0"][..],
            "--devices lists 1 GPU(s) for --tp 2",
        ),
        (
            &["run", "--backend", "cuda", "--tp", "3", "--devices", "0,1,0"][..],
            "--devices lists GPU 0 twice",
        ),
        (
            &["run", "--backend", "cuda", "--tp", "2", "--devices", "0,x"][..],
            "--devices",
        ),
    ] {
        let (code, err) = embedded(args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
    // Past those checks the GPUs are asked for: without a device (CI) that is the CUDA error;
    // with fewer GPUs than ranks, the count.
    let (code, err) = embedded(&["run", "--backend", "cuda", "--tp", "6", "--devices", "0,1,2,3,4,5"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("CUDA") || err.contains("--tp 6 needs 6 GPUs"), "{err}");
}

/// The kernel configuration variables are read when the CUDA backend starts, before any GPU is
/// asked: a bad string is one exit-2 line naming the variable, the string and the field on every
/// CUDA run (f32 and the simple kernels too, which never launch a fast kernel), so it shows on a
/// machine without a GPU. The CPU backend does not read them.
#[test]
fn kernel_configuration_variables_are_checked_when_the_cuda_backend_starts() {
    let run = |var: &str, val: &str, args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_mla-diff"))
            .args(args)
            .env(var, val)
            .output()
            .expect("run mla-diff");
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let cuda_f32 = ["run", "--backend", "cuda", "--dtype", "f32", "--kernels", "simple"];
    for (var, val, field) in [
        (
            "MLA_DIFF_DECODE_CFG",
            "heads=16,warp=4,stages=4",
            "unknown field `warp`",
        ),
        ("MLA_DIFF_DECODE_CFG", "16,8,x,0,2", "field 3 (parts) is `x`"),
        ("MLA_DIFF_PREFILL_CFG", "4,64,2,0", "expected 5 to 6"),
    ] {
        let (code, err) = run(var, val, &cuda_f32);
        assert_eq!(code, 2, "{var}={val}: {err}");
        let lines: Vec<&str> = err.lines().collect();
        assert_eq!(lines.len(), 1, "{var}={val}: {err}");
        for s in [var, &format!("`{val}`"), field] {
            assert!(lines[0].contains(s), "{var}={val}: `{s}` not in {err}");
        }
        assert!(!err.contains("CUDA:") && !err.contains("panicked"), "{err}");
        let (code, err) = run(var, val, &["run", "--backend", "cpu"]);
        assert_ne!(code, 2, "the CPU backend ignores {var}: {err}");
    }
}

/// `--reference-backend cuda` under `auto` on a machine where no CUDA device answers: exit 2 with
/// one line that carries the reason itself, since `--quiet` hides the backend line.
#[test]
fn reference_backend_cuda_without_a_device_says_why_in_its_one_line() {
    if mla_diff::device::probe().is_ok() {
        eprintln!("skipped: a CUDA device answers here, so auto takes it");
        return;
    }
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mla-diff"))
        .args(["run", "--reference-backend", "cuda", "--quiet"])
        .output()
        .expect("run mla-diff");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(
        lines[0].contains("--reference-backend cuda needs a CUDA device; none answered ("),
        "{err}"
    );
    assert!(!lines[0].contains("above"), "{err}");
}

/// Output-path mistakes are refused before anything is written: the same file for `--json` and
/// `--report` (or its heat map), and a folder given where a file is expected (even with --force).
#[test]
fn output_paths_that_collide_or_name_a_folder_are_refused_before_writing() {
    let dir = tempfile_dir();
    let md = dir.join("x.md");
    let m = md.to_str().unwrap();
    let (code, _, err) = run_bin(&["run", "--layer", "1", "--report", m, "--json", m]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("same file as --report"), "{err}");
    let svg = dir.join("x.svg");
    let (code, _, err) = run_bin(&["run", "--layer", "1", "--report", m, "--json", svg.to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("same file as the report's heat map"), "{err}");
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "nothing may be written");
    let d = dir.to_str().unwrap();
    let (code, _, err) = run_bin(&["run", "--layer", "1", "--json", d, "--force"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("is a folder; give a file path"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A fault that had nothing to act on in the requested batch is inconclusive (exit 2), not a
/// pass: `unwritten-rows` on one sequence leaves no context chunk empty for any row. The verdict
/// line says so, last, with the hint.
#[test]
fn an_injected_fault_that_did_not_act_exits_2_with_the_hint() {
    let (code, out, err) = run_bin(&["run", "--layer", "1", "--inject", "unwritten-rows", "--quiet"]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(!err.contains("error"), "{err}");
    let last = out.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("inconclusive: ") && last.contains("did not act on this batch"),
        "{out}"
    );
    assert!(
        last.contains("use several --seqs"),
        "the hint must say what batch exercises it: {out}"
    );
    // With sequences of different lengths it acts, and is found.
    let (code, out, _) = run_bin(&[
        "run",
        "--layer",
        "1",
        "--inject",
        "unwritten-rows",
        "--path",
        "chunked",
        "--seqs",
        "1,15,16,17,53",
        "--quiet",
    ]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("unwritten-rows at L1.lse"), "{out}");
}

/// The chunked path's note says what each empty-row fault did, in its own words: unwritten-rows
/// skips rows, lse-plus-inf writes them with LSE = +inf; and an idle one names itself.
#[test]
fn the_empty_row_faults_notes_name_their_own_fault() {
    for fault in ["lse-plus-inf", "unwritten-rows"] {
        let (code, out, err) = run_bin(&["run", "--layer", "1", "--inject", fault, "--path", "chunked", "--quiet"]);
        assert_eq!(code, 2, "{out}{err}");
        let last = out.lines().last().unwrap_or_default();
        assert!(
            last.starts_with("inconclusive: ")
                && last.contains(&format!(
                    "chunked: no context chunk was empty for any row: the {fault} fault had nothing to act on"
                )),
            "{out}"
        );
    }
    let seqs = ["--path", "chunked", "--seqs", "1,15,16,17,53"];
    let (code, out, _) = run_bin(&[&["run", "--layer", "1", "--inject", "lse-plus-inf"][..], &seqs].concat());
    assert_eq!(code, 1, "{out}");
    let note = out
        .lines()
        .find(|l| l.contains("had no context keys"))
        .unwrap_or_default();
    assert!(
        note.starts_with("note: ")
            && note.ends_with("rows had no context keys and got output 0 with LSE = +inf instead of −inf, the empty partial's wrong sentinel (lse-plus-inf)"),
        "{out}"
    );
    let n: usize = note["note: ".len()..].split(' ').next().unwrap().parse().unwrap();
    assert!(n > 0, "{note}");
    let (code, out, _) = run_bin(&[&["run", "--layer", "1", "--inject", "unwritten-rows"][..], &seqs].concat());
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains(&format!(
            "note: {n} (new token, chunk) rows had no context keys and were skipped: their output and LSE keep the canary (unwritten-rows)"
        )),
        "the same rows, in unwritten-rows' words: {out}"
    );
}

/// A fresh empty folder under the system temp folder.
fn tempfile_dir() -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!(
        "mla-diff-outputs-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}
