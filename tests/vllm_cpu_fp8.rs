//! vLLM 0.26.0's own block-FP8 loader on the CPU: the committed files of
//! `mla_diff_hooks.vllm_cpu run --model golden/hf-v3-fp8` (`golden/dumps/cpu-fp8/`, made by
//! scripts/fixtures/make_cpu_fp8_dumps.py). vLLM's `Fp8LinearMethod` loaded the fp8 weights and
//! their `weight_scale_inv` grids; the fp8 GEMMs ran through the harness's recorded torch
//! stand-ins (`mla_diff_hooks.fp8_cpu`), `w8a8-block` (activations quantized per token in groups
//! of 128, as vLLM's GPU path does) or `weight-only`. The loaded weights and the weight-only
//! activations must keep their verdicts; the w8a8-block dump is checked for what it records only,
//! since mla-diff's f32 rows do not allow for fp8 activations (docs/engines.md, "Block-FP8
//! checkpoints").

use std::path::{Path, PathBuf};

use crate::common::{compare_json, repo, run_bin};

fn model() -> PathBuf {
    repo().join("golden/hf-v3-fp8")
}

fn file(name: &str) -> PathBuf {
    repo().join("golden/dumps/cpu-fp8").join(name)
}

/// A safetensors file's `__metadata__`.
fn metadata(path: &Path) -> std::collections::HashMap<String, String> {
    let bytes = std::fs::read(path).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    meta.metadata().clone().unwrap_or_default()
}

/// A format-2 dump's `header`.
fn header(path: &Path) -> serde_json::Value {
    serde_json::from_str(&metadata(path)["header"]).unwrap()
}

fn check(path: &Path) -> (i32, String, String) {
    run_bin(&[
        "weights",
        "--model",
        model().to_str().unwrap(),
        "--check",
        path.to_str().unwrap(),
    ])
}

#[test]
fn every_committed_cpu_fp8_file_is_a_case_here() {
    let mut on_disk: Vec<String> = std::fs::read_dir(repo().join("golden/dumps/cpu-fp8"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    on_disk.sort();
    assert_eq!(
        on_disk,
        [
            "hf-v3-fp8.fp8-scale-transposed.weights.safetensors",
            "hf-v3-fp8.w8a8-block.safetensors",
            "hf-v3-fp8.weight-only.safetensors",
            "hf-v3-fp8.weights.safetensors",
        ]
    );
}

/// The clean run's loaded `o_proj` and `fused_qkv_a_proj` (q_a and kv_a stacked, kv_a's last
/// block 64 rows) are the checkpoint's fp8 blocks times their scales, bit for bit.
#[test]
fn vllms_loaded_fp8_weights_equal_the_checkpoints_dequantization() {
    let path = file("hf-v3-fp8.weights.safetensors");
    let (code, out, err) = check(&path);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("all 2 tensors match"), "{out}");
    for line in ["L0.fused_qkv_a_proj", "L0.o_proj"] {
        let row = out
            .lines()
            .find(|l| l.contains(line))
            .unwrap_or_else(|| panic!("{out}"));
        assert!(row.contains("pass") && row.contains("0.000e0"), "{row}");
    }
    let meta = metadata(&path);
    assert_eq!(meta["format"], "mla-diff vllm weights 1");
    assert_eq!(meta["engine"], "vllm 0.26.0 (vllm_cpu.py, CPU)");
    assert_eq!(meta["dtype"], "f32");
    assert!(meta["kept"].starts_with("only fused_qkv_a_proj, o_proj"), "{meta:?}");
    assert!(
        meta["dequant"]
            .contains("L0.o_proj: Fp8LinearMethod via vllm get_and_maybe_dequant_weights (TorchBlockFp8Kernel")
    );
}

/// `fp8-scale-transposed` on the CPU harness: o_proj's [2, 4] grid applied as
/// `s.t().contiguous().view(s.shape)` is named, with the layout, at o_proj only.
#[test]
fn the_planted_transposed_scale_grid_is_named_at_o_proj() {
    let path = file("hf-v3-fp8.fp8-scale-transposed.weights.safetensors");
    let (code, out, err) = check(&path);
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(out.contains("quant-scale-layout at L0.o_proj"), "{out}");
    assert!(out.contains("transposed and reshaped"), "{out}");
    assert!(
        out.contains(
            "model.layers.0.self_attn.o_proj.weight_scale_inv [2, 4] read as s.t().contiguous().view(s.shape)"
        ),
        "{out}"
    );
    assert!(out.contains("6 of 8 blocks"), "{out}");
    assert!(!out.contains("at L0.fused_qkv_a_proj"), "{out}");
    let meta = metadata(&path);
    assert!(meta["patches"].contains("plant:fp8-scale-transposed: "), "{meta:?}");
}

/// Weight-only: every site of the prefill and both decode steps passes the f32 rows.
#[test]
fn the_weight_only_dump_passes_every_site() {
    let path = file("hf-v3-fp8.weight-only.safetensors");
    let (code, out, err, doc) = compare_json(&model(), &path, &[]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("all 62 sites within tolerance"), "{out}");
    let sites = doc["sites"].as_array().unwrap();
    for step in ["prefill", "decode-1", "decode-2"] {
        assert!(sites.iter().any(|s| s["step"] == step), "no {step}");
    }
    for site in ["L0.q_c", "L0.kv_a", "L0.o_proj", "L0.ffn_out", "L0.hidden_out"] {
        let s = sites
            .iter()
            .find(|s| s["step"] == "prefill" && s["site"] == site)
            .unwrap();
        assert_eq!(s["status"], "pass", "{s}");
    }
    assert!(doc["findings"].as_array().unwrap().is_empty());
    let h = header(&path);
    assert_eq!(h["model"]["format"], "hf-safetensors");
    assert_eq!(h["model"]["file"], "hf-v3-fp8");
    let q = &h["engine"]["quantization"];
    assert_eq!(q["compute"], "weight-only");
    assert_eq!(q["linear_method"], "Fp8LinearMethod");
    assert_eq!(q["linear_kernel"], "TorchBlockFp8Kernel");
    assert_eq!(q["weight_block_size"], serde_json::json!([128, 128]));
    assert_eq!(q["moe_method"], "Fp8MoEMethod");
    let names: Vec<&str> = h["patches"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    for p in ["fp8-f32-activations", "fp8-block-linear", "fp8-block-moe"] {
        assert!(names.contains(&p), "{names:?}");
    }
    // No GGUF plugin on this path.
    assert!(!names.contains(&"triton-cuda-check"), "{names:?}");
}

/// W8A8-block records its arithmetic and is read as a dump of this checkpoint; its verdict is
/// not pinned here (the f32 rows do not allow for fp8 activations).
#[test]
fn the_w8a8_block_dump_records_its_arithmetic() {
    let path = file("hf-v3-fp8.w8a8-block.safetensors");
    let h = header(&path);
    assert_eq!(h["engine"]["quantization"]["compute"], "w8a8-block");
    let linear = h["patches"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "fp8-block-linear")
        .unwrap();
    assert!(
        linear["reason"].as_str().unwrap().starts_with("w8a8-block: ")
            && linear["reason"].as_str().unwrap().contains("per_token_group_quant_fp8"),
        "{linear}"
    );
    let (code, out, err, _) = compare_json(&model(), &path, &[]);
    assert_ne!(code, 2, "{out}\n{err}");
}
