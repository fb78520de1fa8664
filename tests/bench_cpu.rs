//! `mla-diff bench --dequant` and `bench --reference` (the CPU benchmarks of BENCHMARKS.md P2 and
//! P3) run without a GPU, report one figure per tensor (or forward) and thread count, produce the
//! same output bits at every thread count, and refuse bad input with exit 2 and one line naming
//! the file. Speed itself is measured by `scripts/bench/bench_cpu.py`, never asserted here.

use crate::common::{Dims, deepseek2, repo, run_bin, write_temp};
use mla_diff::model::gguf::{GgufFile, dequant::dequantize, sha256_hex};

fn json(path: &std::path::Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

#[test]
fn dequant_bench_covers_every_quantized_tensor_with_the_library_bits() {
    let model = repo().join("golden/models/tiny-v3-q4_k_m.gguf");
    let dir = tempfile::tempdir().unwrap();
    let j = dir.path().join("d.json");
    let (code, out, err) = run_bin(&[
        "bench",
        "--dequant",
        model.to_str().unwrap(),
        "--repeat",
        "2",
        "--threads",
        "1,2",
        "--json",
        j.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("GB/s out"), "{out}");
    let doc = json(&j);
    assert_eq!(doc["kind"], "dequant");
    let figs = doc["figures"].as_array().unwrap();
    let file = GgufFile::open(&model).unwrap();
    let quantized: Vec<_> = file.tensors().iter().filter(|t| t.ggml_type.is_quantized()).collect();
    assert_eq!(figs.len(), 2 * quantized.len());
    for (t, pair) in quantized.iter().zip(figs.chunks(2)) {
        let v = dequantize(t.ggml_type, &file.tensor_bytes(t), t.n_elements() as usize).unwrap();
        let raw: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        let digest = sha256_hex(&raw);
        for (f, threads) in pair.iter().zip([1, 2]) {
            assert_eq!(f["tensor"], t.name.as_str());
            assert_eq!(f["threads"], threads);
            assert_eq!(f["sha256"], digest.as_str(), "{}", t.name);
            assert_eq!(f["runs_s"].as_array().unwrap().len(), 2);
            assert!(f["gb_per_s_out"].as_f64().unwrap() > 0.0);
        }
    }
}

#[test]
fn reference_bench_times_the_reference_and_the_engine_mha_path() {
    let model = repo().join("golden/models/tiny-v3-q4_k_m.gguf");
    let dir = tempfile::tempdir().unwrap();
    let j = dir.path().join("r.json");
    let (code, out, err) = run_bin(&[
        "bench",
        "--reference",
        model.to_str().unwrap(),
        "--layer",
        "1",
        "--tokens",
        "5",
        "--repeat",
        "1",
        "--threads",
        "1",
        "--json",
        j.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}{err}");
    let doc = json(&j);
    let figs = doc["bench"]["figures"].as_array().unwrap();
    let what: Vec<&str> = figs.iter().map(|f| f["what"].as_str().unwrap()).collect();
    assert_eq!(what, ["reference", "engine mha"]);
    for f in figs {
        assert_eq!(f["tokens"], 5);
        assert_eq!(f["layer"], 1);
        assert!(f["median_s"].as_f64().unwrap() > 0.0);
    }
    assert!(doc["bench"]["load_s"].as_f64().unwrap() >= 0.0);
}

/// Exit 2, one stderr line containing every string of `must`, no panic.
fn expect_exit2(args: &[&str], must: &[&str]) {
    let (code, out, err) = run_bin(args);
    assert_eq!(code, 2, "{args:?}: {out}{err}");
    assert_eq!(err.lines().count(), 1, "{args:?}: one error line expected: {err}");
    for s in must {
        assert!(err.contains(s), "{args:?}: error must name `{s}`: {err}");
    }
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn bench_bad_input_exits_2_with_one_line_naming_the_file() {
    expect_exit2(&["bench", "--dequant", "/nonexistent/nope.gguf"], &["nope.gguf"]);
    expect_exit2(&["bench", "--reference", "/nonexistent/nope.gguf"], &["nope.gguf"]);

    let good = deepseek2(Dims::default(), false).build();
    let (_d1, trunc) = write_temp(&good.bytes[..good.bytes.len() / 2], "half.gguf");
    let trunc = trunc.to_str().unwrap();
    expect_exit2(&["bench", "--dequant", trunc], &["half.gguf"]);
    expect_exit2(&["bench", "--reference", trunc], &["half.gguf"]);

    // A valid model with only F32 tensors: nothing to decode.
    let (_d2, f32_only) = write_temp(&good.bytes, "f32.gguf");
    let f32_only = f32_only.to_str().unwrap();
    expect_exit2(&["bench", "--dequant", f32_only], &["f32.gguf", "no quantized tensor"]);
    expect_exit2(
        &["bench", "--reference", f32_only, "--layer", "99"],
        &["f32.gguf", "out of range"],
    );

    let q = repo().join("golden/models/tiny-v3-q4_k_m.gguf");
    let q = q.to_str().unwrap();
    expect_exit2(&["bench", "--dequant", q, "--repeat", "0"], &["--repeat"]);
    expect_exit2(&["bench", "--dequant", q, "--threads", "0"], &["--threads"]);
    expect_exit2(&["bench", "--reference", q, "--tokens", "0"], &["--tokens"]);
}
