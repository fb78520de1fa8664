//! vLLM 0.26.0's own block-FP8 loader on the CPU: the committed files of
//! `mla_diff_hooks.vllm_cpu run --model golden/hf-v3-fp8` (`golden/dumps/cpu-fp8/`, made by
//! scripts/fixtures/make_cpu_fp8_dumps.py). vLLM's `Fp8LinearMethod` loaded the fp8 weights and
//! their `weight_scale_inv` grids; the fp8 GEMMs ran through the harness's recorded torch
//! stand-ins (`mla_diff_hooks.fp8_cpu`), `w8a8-block` (activations quantized per token in groups
//! of 128, as vLLM's GPU path does) or `weight-only`. The loaded weights and both activation
//! dumps must keep their verdicts: the w8a8-block dump declares its activation quantization
//! (`header.act_quant`) and the reference applies it (docs/engines.md, "Block-FP8 checkpoints").

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
/// Sets the format-2 header's field `key` of the dump at `path` to `value` (tensors kept).
fn set_header_field(path: &Path, key: &str, value: &serde_json::Value) {
    crate::common::edit_safetensors_header(path, |h| {
        let mut hd: serde_json::Value = serde_json::from_str(h["__metadata__"]["header"].as_str().unwrap()).unwrap();
        hd[key] = value.clone();
        h["__metadata__"]["header"] = serde_json::Value::String(hd.to_string());
    });
}

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
            "hf-v3-fp8.w8a8-block-moe.safetensors",
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

/// W8A8-block declares its activation quantization (`header.act_quant`, written by the hook from
/// the loaded `Fp8LinearMethod`), and with it every site of the prefill and both decode steps
/// passes the f32 rows: the reference quantizes the same GEMM inputs (per token in groups of
/// 128, f32 scales) and reproduces the stand-in's arithmetic to f32 rounding.
#[test]
fn the_w8a8_block_dump_passes_with_its_declared_activation_quantization() {
    let path = file("hf-v3-fp8.w8a8-block.safetensors");
    let h = header(&path);
    assert_eq!(h["engine"]["quantization"]["compute"], "w8a8-block");
    assert_eq!(
        h["act_quant"],
        serde_json::json!({"dtype": "fp8_e4m3", "granularity": "token-group", "group": 128, "input": "f32"})
    );
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
    let (code, out, err, doc) = compare_json(&model(), &path, &[]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("all 62 sites within tolerance"), "{out}");
    assert!(
        crate::common::conversions(&doc)
            .iter()
            .any(|c| c.starts_with("act_quant: fp8_e4m3 GEMM inputs, per token in groups of 128 columns")),
        "{doc}"
    );
    // Every GEMM output is judged at f32 precision: q_c within 1e-6 of the reference.
    let q_c = doc["sites"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["step"] == "prefill" && s["site"] == "L0.q_c")
        .unwrap();
    assert!(q_c["metrics"]["rel_l2"].as_f64().unwrap() < 1e-6, "{q_c}");
}

/// The declaration is what makes the difference: the same dump without `act_quant` is judged by
/// the f32 rows and diverges at the first GEMM output (rel_l2 about 2.4e-2, the fp8 rounding of
/// `attn_in`). One that declares a per-tensor scale instead is judged by the fp8 rows: `q_c`
/// sits 1e-3 or more from the reference (the true declaration puts it within 1e-6) and the next
/// GEMM output, `q`, leaves them (rel_l2 5.1e-2, cos_diff 1.3e-3).
#[test]
fn without_or_with_another_activation_quantization_the_w8a8_dump_diverges() {
    let dir = tempfile::tempdir().unwrap();
    for (name, act) in [
        ("none", serde_json::Value::Null),
        (
            "tensor",
            serde_json::json!({"dtype": "fp8_e4m3", "granularity": "tensor", "input": "f32"}),
        ),
    ] {
        let p = dir.path().join(format!("{name}.safetensors"));
        std::fs::copy(file("hf-v3-fp8.w8a8-block.safetensors"), &p).unwrap();
        set_header_field(&p, "act_quant", &act);
        // The identity hashes cover the model, not the dump's header: still this model's dump.
        let (code, out, err, doc) = compare_json(&model(), &p, &[]);
        assert_eq!(code, 1, "{name}: {out}\n{err}");
        if name == "none" {
            assert!(out.contains("first divergence at L0.q_c"), "{name}: {out}");
        } else {
            // Judged by the fp8 rows, the other granularity still leaves them at the next GEMM.
            assert_eq!(doc["dump"]["tolerance_rows"], "fp8", "{name}");
            assert!(out.contains("first divergence at L0.q "), "{name}: {out}");
        }
        let q_c = doc["sites"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["step"] == "prefill" && s["site"] == "L0.q_c")
            .unwrap();
        assert!(q_c["metrics"]["rel_l2"].as_f64().unwrap() > 1e-3, "{name}: {q_c}");
    }
}

/// A hostile `act_quant` is refused before any work: exit 2, one line naming the file and field.
#[test]
fn a_hostile_act_quant_is_refused_naming_its_field() {
    use serde_json::json;
    let dir = tempfile::tempdir().unwrap();
    let base = json!({"dtype": "fp8_e4m3", "granularity": "token-group", "group": 128, "input": "f32"});
    let with = |key: &str, v: serde_json::Value| {
        let mut q = base.clone();
        q[key] = v;
        q
    };
    let mut missing = base.clone();
    missing.as_object_mut().unwrap().remove("group");
    let cases = [
        (json!("fp8"), "act_quant"),
        (with("dtype", json!("fp8_e5m2")), "act_quant.dtype"),
        (with("granularity", json!("channel")), "act_quant.granularity"),
        (with("group", json!(0)), "act_quant.group"),
        (with("group", json!(1u64 << 40)), "act_quant.group"),
        (with("group", json!(-128)), "act_quant.group"),
        (with("input", json!("fp8")), "act_quant.input"),
        (with("amax_floor", json!(-1.0)), "act_quant.amax_floor"),
        (with("scale", json!("f32")), "act_quant.scale"),
        (missing, "act_quant.group"),
        (
            json!({"dtype": "fp8_e4m3", "granularity": "tensor", "group": 128}),
            "act_quant.group",
        ),
    ];
    for (i, (q, field)) in cases.into_iter().enumerate() {
        let p = dir.path().join(format!("hostile{i}.safetensors"));
        std::fs::copy(file("hf-v3-fp8.w8a8-block.safetensors"), &p).unwrap();
        set_header_field(&p, "act_quant", &q);
        let (code, out, err, _) = compare_json(&model(), &p, &[]);
        assert_eq!(code, 2, "{q}: {out}\n{err}");
        let line = err.lines().find(|l| l.contains("error")).unwrap_or(&err);
        assert!(
            line.contains(&format!("__metadata__.header.{field}")) && line.contains(p.to_str().unwrap()),
            "{q}: wants {field}: {err}"
        );
        assert!(!err.contains("panick"), "{q}: {err}");
    }
}

/// Both layers in W8A8-block: layer 1 is an MoE layer whose routed experts (vLLM's
/// `Fp8MoEMethod` through the stand-in) and shared expert quantize their inputs too. The
/// reference quantizes the same expert inputs: `hidden_out` of layer 1, which carries the routed
/// experts' weighted sum, agrees at f32 precision in every step.
#[test]
fn the_w8a8_block_moe_layer_passes_with_its_experts_quantized() {
    let path = file("hf-v3-fp8.w8a8-block-moe.safetensors");
    let (code, out, err, doc) = compare_json(&model(), &path, &[]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("all 124 sites within tolerance"), "{out}");
    let sites = doc["sites"].as_array().unwrap();
    for step in ["prefill", "decode-1", "decode-2"] {
        let h = sites
            .iter()
            .find(|s| s["step"] == step && s["site"] == "L1.hidden_out")
            .unwrap();
        assert!(h["metrics"]["rel_l2"].as_f64().unwrap() < 1e-6, "{step}: {h}");
    }
}

/// `kv_cache_quant` declares an fp8 latent cache; the reference then rounds what the decode
/// rows read. The weight-only dump's engine kept its cache unrounded, so declaring one it did not
/// use moves its decode steps' attention off the reference (while the prefill, which reads no
/// cache, stays exact): the declaration is applied where the engine reads the cache, and only
/// there.
#[test]
fn a_declared_fp8_cache_is_applied_to_the_decode_rows_only() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("kv.safetensors");
    std::fs::copy(file("hf-v3-fp8.weight-only.safetensors"), &p).unwrap();
    set_header_field(
        &p,
        "kv_cache_quant",
        &serde_json::json!({"dtype": "fp8_e4m3", "scale": 1.0, "input": "f32"}),
    );
    let (_, out, err, doc) = compare_json(&model(), &p, &[]);
    assert_eq!(doc["dump"]["tolerance_rows"], "fp8", "{out}\n{err}");
    let rel = |step: &str, site: &str| {
        doc["sites"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["step"] == step && s["site"] == site)
            .unwrap()["metrics"]["rel_l2"]
            .as_f64()
            .unwrap()
    };
    assert!(rel("prefill", "L0.attn_out") < 1e-5, "{out}");
    for step in ["decode-1", "decode-2"] {
        let lat = rel(step, "L0.attn_latent");
        assert!(lat > 1e-3, "{step}: attn_latent rel_l2 {lat}");
    }
    assert!(
        crate::common::conversions(&doc)
            .iter()
            .any(|c| c.starts_with("kv_cache_quant: fp8_e4m3 latent cache, k_scale 1")),
        "{doc}"
    );
}

/// A hostile `kv_cache_quant` is refused before any work, naming the field.
#[test]
fn a_hostile_kv_cache_quant_is_refused_naming_its_field() {
    use serde_json::json;
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        (json!(1.0), "kv_cache_quant"),
        (json!({"dtype": "fp8_e5m2", "scale": 1.0}), "kv_cache_quant.dtype"),
        (json!({"dtype": "fp8_e4m3", "scale": 0}), "kv_cache_quant.scale"),
        (json!({"dtype": "fp8_e4m3", "scale": "1"}), "kv_cache_quant.scale"),
        (json!({"dtype": "fp8_e4m3"}), "kv_cache_quant.scale"),
        (
            json!({"dtype": "fp8_e4m3", "scale": 1.0, "input": "fp8"}),
            "kv_cache_quant.input",
        ),
        (
            json!({"dtype": "fp8_e4m3", "scale": 1.0, "q_scale": 1.0}),
            "kv_cache_quant.q_scale",
        ),
    ];
    for (i, (q, field)) in cases.into_iter().enumerate() {
        let p = dir.path().join(format!("hostile{i}.safetensors"));
        std::fs::copy(file("hf-v3-fp8.weight-only.safetensors"), &p).unwrap();
        set_header_field(&p, "kv_cache_quant", &q);
        let (code, out, err, _) = compare_json(&model(), &p, &[]);
        assert_eq!(code, 2, "{q}: {out}\n{err}");
        let line = err.lines().find(|l| l.contains("error")).unwrap_or(&err);
        assert!(
            line.contains(&format!("__metadata__.header.{field}")) && line.contains(p.to_str().unwrap()),
            "{q}: wants {field}: {err}"
        );
    }
}
