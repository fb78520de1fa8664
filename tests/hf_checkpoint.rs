//! Hugging Face checkpoints as a model source (`--model DIR`): the bf16 checkpoint gives the same
//! reference as its GGUF conversion, fp8 block dequantization is bit-exact against vectors made
//! by an independent implementation (scripts/fixtures/make_hf_checkpoints.py, torch) on every
//! block shape (full, edge rows, edge columns, corner), every path runs clean on the fp8
//! checkpoint, the identity a dump records matches the hooks' definition, and a damaged or
//! hostile checkpoint is one line naming the file and field, exit 2.

use std::path::{Path, PathBuf};

use crate::common::{repo, run_bin};

use mla_diff::core::batch::Batch;
use mla_diff::jobs::run::reference_chain;
use mla_diff::model::config::MlaConfig;
use mla_diff::model::gguf::GgufFile;
use mla_diff::model::weights::dequant_tensor;

fn bf16_dir() -> PathBuf {
    repo().join("golden/hf-v3-bf16")
}

fn fp8_dir() -> PathBuf {
    repo().join("golden/hf-v3-fp8")
}

/// Seeded token ids within the fixtures' vocabulary of 256.
fn tokens(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + 11) % 256).collect()
}

#[test]
fn the_bf16_checkpoint_and_its_gguf_conversion_give_the_same_reference() {
    let hf = mla_diff::model::open(bf16_dir()).unwrap();
    let gg = GgufFile::open(bf16_dir().join("model.gguf")).unwrap();
    let (ch, cg) = (MlaConfig::from_gguf(&hf).unwrap(), MlaConfig::from_gguf(&gg).unwrap());
    assert_eq!(ch.dims(), cg.dims());
    assert_eq!(ch.moe, cg.moe);
    assert_eq!(
        (ch.n_layer, ch.vocab, ch.softmax_scale),
        (cg.n_layer, cg.vocab, cg.softmax_scale)
    );
    assert_eq!((ch.rms_eps as f32, ch.rope_base), (cg.rms_eps as f32, cg.rope_base));
    let toks = tokens(19);
    let batch = Batch::single(toks.len(), 0);
    // llama.cpp stores rms_norm_eps as f32 (1e-6 → 9.99999997e-7); the checkpoint's is the f64
    // 1e-6, so each side runs with its own and the difference (3e-15 relative) stays below 1e-12.
    let a = reference_chain(&hf, &ch, &toks, &batch, ch.n_layer - 1).unwrap();
    let b = reference_chain(&gg, &cg, &toks, &batch, cg.n_layer - 1).unwrap();
    let mut sites = 0;
    let mut worst = 0f64;
    for (l, (ta, tb)) in a.iter().zip(&b).enumerate() {
        for (site, va) in ta.entries() {
            let Some(vb) = tb.get(site) else { continue };
            assert_eq!(va.shape, vb.shape, "L{l} {site}");
            let (x, y) = (va.to_f64(), vb.to_f64());
            let num: f64 = x.iter().zip(&y).map(|(p, q)| (p - q) * (p - q)).sum();
            let den: f64 = y.iter().map(|q| q * q).sum::<f64>().max(f64::MIN_POSITIVE);
            let e = (num / den).sqrt();
            assert!(
                e <= 1e-12,
                "L{l} {site}: rel_l2 {e:.3e} between the checkpoint and its GGUF"
            );
            worst = worst.max(e);
            sites += 1;
        }
    }
    assert!(sites >= 40, "only {sites} sites compared");
    eprintln!("{sites} sites, worst rel_l2 {worst:.2e}");
}

/// The tensors `name.{fp8,scale_inv,dequant_f32}` of the vectors file.
fn vectors(name: &str) -> (Vec<u8>, Vec<f32>, Vec<f32>, Vec<usize>) {
    let bytes = std::fs::read(fp8_dir().join("dequant_vectors.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let f32s = |t: &str| -> Vec<f32> {
        let v = st.tensor(&format!("{name}.{t}")).unwrap();
        v.data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    };
    let codes = st.tensor(&format!("{name}.fp8")).unwrap();
    (
        codes.data().to_vec(),
        f32s("scale_inv"),
        f32s("dequant_f32"),
        codes.shape().to_vec(),
    )
}

#[test]
fn fp8_block_dequantization_is_bit_exact_on_every_block_shape() {
    // The reader's own path, on the checkpoint's tensors (full blocks; kv_a's 576 rows end in a
    // 64-row edge block).
    let file = mla_diff::model::open(fp8_dir()).unwrap();
    for (name, gguf) in [("q_a", "blk.0.attn_q_a.weight"), ("kv_a", "blk.0.attn_kv_a_mqa.weight")] {
        let (_, _, want, _) = vectors(name);
        let got = dequant_tensor(&file, file.require_tensor(gguf).unwrap()).unwrap();
        assert_eq!(got.len(), want.len(), "{name}");
        let bad = got
            .iter()
            .zip(&want)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(bad, 0, "{name}: {bad} of {} values differ in their bits", want.len());
    }
    // The same arithmetic on the synthetic [160, 200] tensor: an edge block in rows, in columns
    // and in both.
    let (codes, scale, want, shape) = vectors("synthetic");
    assert_eq!(shape, [160, 200]);
    let got = mla_diff::model::hf::dequant_fp8_block(&codes, &scale, 200, [128, 128], 0..160 * 200);
    let got: Vec<f32> = got
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()));
    // A row range read alone (one expert's rows, a TP shard) gives the same bits as the whole.
    let t = file.require_tensor("blk.0.attn_kv_a_mqa.weight").unwrap();
    let rows = mla_diff::model::weights::dequant_rows(&file, &t.name, 500..576).unwrap();
    let (_, _, want, _) = vectors("kv_a");
    assert_eq!(rows.as_slice().unwrap(), &want[500 * 256..]);
}

#[test]
fn the_routed_experts_are_one_stacked_tensor_read_one_expert_at_a_time() {
    let file = mla_diff::model::open(fp8_dir()).unwrap();
    let t = file.require_tensor("blk.1.ffn_up_exps.weight").unwrap();
    assert_eq!(t.shape(), [4, 256, 256]);
    assert_eq!(
        file.source_name(t),
        "model.layers.1.mlp.experts.{e}.up_proj.weight",
        "the checkpoint's own name, for hints and findings"
    );
    let origin = file.origin(t).unwrap();
    assert!(
        origin.contains("F8_E4M3") && origin.contains("up_proj.weight_scale_inv"),
        "{origin}"
    );
    let all = dequant_tensor(&file, t).unwrap();
    let e2 = mla_diff::model::weights::dequant_rows(&file, &t.name, 512..768).unwrap();
    assert_eq!(e2.as_slice().unwrap(), &all[2 * 256 * 256..3 * 256 * 256]);
    assert!(all.iter().all(|x| x.is_finite()) && all.iter().any(|&x| x != 0.0));
}

#[test]
fn the_identity_a_dump_records_is_the_hooks_definition() {
    // docs/dump-format.md: index_sha256 = sha256(config.json ‖ index), layer_sha256 = sha256 of
    // the stored bytes of every `model.layers.{n}.` tensor in name order. The values are those
    // python/mla_diff_hooks computes for the committed fixture.
    let file = mla_diff::model::open(fp8_dir()).unwrap();
    assert_eq!(
        file.index_sha256_hex(),
        "6fe59ab29594713e3a69603ae4772e43bd3728c6b41aba763e8483c2e970067c"
    );
    assert_eq!(
        file.layer_sha256_hex(0),
        "7624f587c894e1e704214b40187d37f3d411a8a06f750c8bcbf95d0b13f0c6cf"
    );
    assert_eq!(
        file.layer_sha256_hex(1),
        "5a93aeb6e32b0ceb720e4bfe838ae62aa9583fdf252b8625ff4ae27aea1fc752"
    );
    assert_eq!(file.file_len(), 3_332_906);
}

#[test]
fn run_on_the_fp8_checkpoint_is_clean_on_every_path() {
    let dir = fp8_dir();
    for layer in ["0", "1"] {
        let (code, out, err) = run_bin(&[
            "run",
            "--model",
            dir.to_str().unwrap(),
            "--backend",
            "cpu",
            "--layer",
            layer,
        ]);
        assert_eq!(code, 0, "layer {layer}: {out}{err}");
        for path in ["mha", "mqa", "chunked", "mixed"] {
            assert!(out.contains(&format!("{path}: all ")), "layer {layer}, {path}: {out}");
        }
    }
    // The index file itself names the checkpoint too.
    let index = dir.join("model.safetensors.index.json");
    let (code, out, err) = run_bin(&[
        "run",
        "--model",
        index.to_str().unwrap(),
        "--backend",
        "cpu",
        "--path",
        "mqa",
    ]);
    assert_eq!(code, 0, "{out}{err}");
}

#[test]
fn every_fault_is_found_on_the_fp8_checkpoint() {
    let dir = fp8_dir();
    let (code, out, err) = run_bin(&[
        "selftest",
        "--models",
        dir.to_str().unwrap(),
        "--backend",
        "cpu",
        "--quick",
        "--layer",
        "1",
    ]);
    assert_eq!(code, 0, "{out}{err}");
    let line = out.lines().find(|l| l.starts_with("selftest:")).unwrap_or_default();
    let (found, total) = line
        .split_whitespace()
        .nth(1)
        .and_then(|f| f.split_once('/'))
        .map(|(a, b)| (a.parse::<usize>().unwrap(), b.parse::<usize>().unwrap()))
        .unwrap();
    assert_eq!(found, total, "{line}");
    assert!(total >= 80, "{line}");
    assert!(out.contains("hf-v3-fp8") && out.contains(" 0 "), "{out}");
}

/// A writable copy of a fixture folder.
fn copy_dir(src: &Path) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dst = tmp.path().join(src.file_name().unwrap());
    std::fs::create_dir(&dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "json" || x == "safetensors") {
            std::fs::copy(&p, dst.join(p.file_name().unwrap())).unwrap();
        }
    }
    (tmp, dst)
}

fn edit_json(path: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(path, serde_json::to_vec(&v).unwrap()).unwrap();
}

/// Runs `run --model DIR` and returns (exit code, the stderr's error lines).
fn refused(dir: &Path) -> (i32, Vec<String>) {
    let (code, _out, err) = run_bin(&["run", "--model", dir.to_str().unwrap(), "--backend", "cpu", "--quiet"]);
    let lines = err
        .lines()
        .filter(|l| l.contains("error"))
        .map(str::to_string)
        .collect();
    (code, lines)
}

const SHARD1: &str = "model-00001-of-00002.safetensors";

/// An edit of a copy of the fp8 fixture.
type Edit = Box<dyn Fn(&Path)>;

/// A config.json that holds both RoPE blocks, the older one as transformers writes it before
/// converting (`type`, no `rope_theta`), is read when they agree: DeepSeek-V3's own YaRN block.
#[test]
fn rope_scaling_beside_the_same_rope_parameters_is_read() {
    let (_tmp, dir) = copy_dir(&fp8_dir());
    let yarn = serde_json::json!({"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
        "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096});
    edit_json(&dir.join("config.json"), |v| {
        let mut p = yarn.clone();
        p["rope_type"] = "yarn".into();
        p["rope_theta"] = 10000.0.into();
        v["rope_parameters"] = p;
        let mut s = yarn.clone();
        s["type"] = "yarn".into();
        v["rope_scaling"] = s;
    });
    let (code, out, err) = run_bin(&["inspect", "--model", dir.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("yarn") || out.contains("YaRN"), "{out}");
}

/// Each damaged or hostile config.json: what it is, the edit that makes it, and what the one
/// error line must name.
fn hostile_cases() -> Vec<(&'static str, Edit, &'static [&'static str])> {
    vec![
        (
            "rope_scaling that differs from rope_parameters",
            Box::new(|d| {
                edit_json(&d.join("config.json"), |v| {
                    v["rope_scaling"] = serde_json::json!({"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707});
                })
            }),
            &["config.json", "rope_scaling", "differs from rope_parameters"],
        ),
        (
            "RoPE on NeoX halves",
            Box::new(|d| edit_json(&d.join("config.json"), |v| v["rope_interleave"] = false.into())),
            &["config.json", "rope_interleave false"],
        ),
        (
            "no model_type",
            Box::new(|d| {
                edit_json(&d.join("config.json"), |v| {
                    _ = v.as_object_mut().unwrap().remove("model_type")
                })
            }),
            &["config.json", "model_type", "missing", "deepseek_v3"],
        ),
        (
            "config key missing",
            Box::new(|d| {
                edit_json(&d.join("config.json"), |v| {
                    _ = v.as_object_mut().unwrap().remove("kv_lora_rank")
                })
            }),
            &["config.json", "kv_lora_rank"],
        ),
        (
            "config key of the wrong type",
            Box::new(|d| edit_json(&d.join("config.json"), |v| v["num_attention_heads"] = "four".into())),
            &["config.json", "num_attention_heads", "non-negative integer"],
        ),
        (
            "unsupported model_type",
            Box::new(|d| edit_json(&d.join("config.json"), |v| v["model_type"] = "llama".into())),
            &["model_type `llama`", "deepseek_v3"],
        ),
        (
            "another quantization method",
            Box::new(|d| {
                edit_json(&d.join("config.json"), |v| {
                    v["quantization_config"]["quant_method"] = "awq".into()
                })
            }),
            &["quant_method `awq`"],
        ),
    ]
}

/// The damaged or hostile index and shards (see [`hostile_cases`]).
fn hostile_shard_cases() -> Vec<(&'static str, Edit, &'static [&'static str])> {
    vec![
        (
            "a shard outside the folder",
            Box::new(|d| {
                edit_json(&d.join("model.safetensors.index.json"), |v| {
                    v["weight_map"]["model.norm.weight"] = "../../etc/passwd".into();
                })
            }),
            &[
                "model.safetensors.index.json",
                "weight_map[\"model.norm.weight\"]",
                "not a file name",
            ],
        ),
        (
            "a tensor the index places in a shard without it",
            Box::new(|d| {
                edit_json(&d.join("model.safetensors.index.json"), |v| {
                    v["weight_map"]["model.norm.weight"] = SHARD1.into();
                })
            }),
            &["weight_map[\"model.norm.weight\"]", SHARD1],
        ),
        (
            "a missing block scale",
            Box::new(move |d| {
                // Renamed, not removed: its bytes stay covered, as safetensors requires.
                let (old, new) = (
                    "model.layers.0.self_attn.kv_b_proj.weight_scale_inv",
                    "model.layers.0.self_attn.kv_b_proj.weight_scale_gone",
                );
                crate::common::edit_safetensors_header(&d.join(SHARD1), |h| {
                    let m = h.as_object_mut().unwrap();
                    let v = m.remove(old).unwrap();
                    m.insert(new.into(), v);
                });
                edit_json(&d.join("model.safetensors.index.json"), |v| {
                    let m = v["weight_map"].as_object_mut().unwrap();
                    let s = m.remove(old).unwrap();
                    m.insert(new.into(), s);
                });
            }),
            &[
                SHARD1,
                "model.layers.0.self_attn.kv_b_proj.weight",
                "without its block scale",
            ],
        ),
        (
            "a block scale of the wrong grid",
            Box::new(move |d| {
                crate::common::edit_safetensors_header(&d.join(SHARD1), |h| {
                    h["model.layers.0.self_attn.kv_b_proj.weight_scale_inv"]["shape"] = serde_json::json!([4, 8]);
                })
            }),
            &["kv_b_proj.weight_scale_inv", "[8, 4]"],
        ),
        (
            "an unsupported dtype",
            Box::new(move |d| {
                crate::common::edit_safetensors_header(&d.join(SHARD1), |h| {
                    h["model.layers.0.self_attn.kv_b_proj.weight"]["dtype"] = "U8".into();
                })
            }),
            &[SHARD1, "kv_b_proj.weight", "dtype U8"],
        ),
        (
            "a shape that overruns its bytes",
            Box::new(move |d| {
                crate::common::edit_safetensors_header(&d.join(SHARD1), |h| {
                    h["model.layers.0.self_attn.o_proj.weight"]["shape"] = serde_json::json!([256, 4096]);
                })
            }),
            &[SHARD1, "safetensors header"],
        ),
        (
            "a truncated shard",
            Box::new(move |d| {
                let p = d.join(SHARD1);
                let b = std::fs::read(&p).unwrap();
                std::fs::write(&p, &b[..b.len() / 2]).unwrap();
            }),
            &[SHARD1, "safetensors header"],
        ),
        (
            "a header length past the file",
            Box::new(move |d| {
                let p = d.join(SHARD1);
                let mut b = std::fs::read(&p).unwrap();
                b[..8].copy_from_slice(&u64::MAX.to_le_bytes());
                std::fs::write(&p, &b).unwrap();
            }),
            &[SHARD1, "safetensors header"],
        ),
        (
            "config.json not JSON",
            Box::new(|d| std::fs::write(d.join("config.json"), b"{\"model_type\": ").unwrap()),
            &["config.json", "JSON"],
        ),
    ]
}

#[test]
fn a_damaged_or_hostile_checkpoint_is_one_line_naming_file_and_field() {
    for (what, edit, want) in hostile_cases().into_iter().chain(hostile_shard_cases()) {
        let (_tmp, dir) = copy_dir(&fp8_dir());
        edit(&dir);
        let (code, lines) = refused(&dir);
        assert_eq!(code, 2, "{what}: exit {code}, {lines:?}");
        assert_eq!(lines.len(), 1, "{what}: {lines:?}");
        for w in want {
            assert!(lines[0].contains(w), "{what}: `{}` lacks `{w}`", lines[0]);
        }
    }
}

/// An engine's loaded weights of layer 0 of the fp8 checkpoint (f32, `[out, in]`), each
/// projection's blocks multiplied by `factor(param, block_row, block_col, stored_scale)` / the
/// stored scale: a loader that applies another scale than the stored one to a block.
/// The scale a loader applies to block `(row, col)` of a param: `(param, row, col, stored scale,
/// the stored grid, its shape)`.
type ScaleFn = dyn Fn(&str, usize, usize, f32, &[f32], [usize; 2]) -> f32;

fn fp8_weights_file(dir: &Path, factor: &ScaleFn) -> PathBuf {
    let file = mla_diff::model::open(fp8_dir()).unwrap();
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    for (param, gguf) in [
        (
            "fused_qkv_a_proj",
            &["blk.0.attn_q_a.weight", "blk.0.attn_kv_a_mqa.weight"][..],
        ),
        ("kv_b_proj", &["blk.0.attn_kv_b.weight"][..]),
        ("o_proj", &["blk.0.attn_output.weight"][..]),
    ] {
        let mut data = Vec::new();
        let mut rows = 0;
        let mut cols = 0;
        for name in gguf {
            let t = file.require_tensor(name).unwrap();
            let s = file.block_scales(t).expect("fp8 source");
            let [r, c] = s.shape;
            let mut w = dequant_tensor(&file, t).unwrap();
            for (i, x) in w.iter_mut().enumerate() {
                let (bi, bj) = (i / c / s.block[0], i % c / s.block[1]);
                let stored = s.scale[bi * s.grid[1] + bj];
                *x *= factor(param, bi, bj, stored, &s.scale, s.grid) / stored;
            }
            data.extend(w);
            rows += r;
            cols = c;
        }
        tensors.push((format!("L0.{param}"), vec![rows, cols], data));
    }
    let p = dir.join("weights.safetensors");
    crate::common::write_f32_safetensors(&p, &tensors, &[("engine", "test"), ("tp_size", "1"), ("dtype", "f32")]);
    p
}

fn check_fp8(p: &Path) -> (i32, String, String) {
    run_bin(&[
        "weights",
        "--model",
        fp8_dir().to_str().unwrap(),
        "--check",
        p.to_str().unwrap(),
    ])
}

#[test]
fn weights_check_names_block_scales_applied_in_another_layout() {
    let tmp = tempfile::tempdir().unwrap();
    // As stored: every tensor passes, named by the checkpoint's tensors.
    let ok = fp8_weights_file(tmp.path(), &|_, _, _, s, _, _| s);
    let (code, out, err) = check_fp8(&ok);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("all 3 tensors match"), "{out}");

    // o_proj's [2, 4] grid read as s.t().contiguous().view(s.shape).
    let t_view = |p: &str, i: usize, j: usize, s: f32, all: &[f32], g: [usize; 2]| {
        if p == "o_proj" {
            let k = i * g[1] + j;
            all[(k % g[0]) * g[1] + k / g[0]]
        } else {
            s
        }
    };
    let bad = fp8_weights_file(tmp.path(), &t_view);
    let (code, out, err) = check_fp8(&bad);
    assert_eq!(code, 1, "{out}{err}");
    assert!(out.contains("quant-scale-layout at L0.o_proj"), "{out}");
    assert!(
        out.contains("transposed and reshaped")
            && out.contains("model.layers.0.self_attn.o_proj.weight_scale_inv [2, 4]"),
        "{out}"
    );
    assert!(
        !out.contains("at L0.kv_b_proj") && !out.contains("at L0.fused_qkv_a_proj"),
        "{out}"
    );

    // The fused projection's kv_a half ([576, 256]: a grid of [5, 2] with 64-row edge blocks)
    // given each block the scale of the block below it (the last row keeps its own).
    let shifted = |p: &str, i: usize, j: usize, s: f32, all: &[f32], g: [usize; 2]| {
        if p == "fused_qkv_a_proj" && g[0] == 5 && i + 1 < g[0] {
            all[(i + 1) * g[1] + j]
        } else {
            s
        }
    };
    let bad = fp8_weights_file(tmp.path(), &shifted);
    let (code, out, err) = check_fp8(&bad);
    assert_eq!(code, 1, "{out}{err}");
    assert!(out.contains("quant-scale-layout at L0.fused_qkv_a_proj"), "{out}");
    assert!(out.contains("stored scales of other blocks"), "{out}");

    // kv_b's scales rounded up to powers of two (a UE8M0 conversion).
    let ue8m0 = |p: &str, _: usize, _: usize, s: f32, _: &[f32], _: [usize; 2]| {
        if p == "kv_b_proj" { s.log2().ceil().exp2() } else { s }
    };
    let bad = fp8_weights_file(tmp.path(), &ue8m0);
    let (code, out, err) = check_fp8(&bad);
    assert_eq!(code, 1, "{out}{err}");
    assert!(out.contains("quant-scale-layout at L0.kv_b_proj"), "{out}");
    assert!(out.contains("powers of two"), "{out}");
}

#[test]
fn inspect_shows_the_checkpoint_and_where_each_tensor_is_stored() {
    let (code, out, err) = run_bin(&["inspect", "--model", fp8_dir().to_str().unwrap(), "--layer", "0"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("Hugging Face checkpoint, 24 metadata keys from config.json"),
        "{out}"
    );
    assert!(out.contains("N=4 H=256 Lq=128 L=512 P=128 R=64 V=128"), "{out}");
    let row = out
        .lines()
        .find(|l| l.contains("blk.0.attn_kv_a_mqa.weight"))
        .unwrap_or_default();
    assert!(
        row.contains("[576, 256]")
            && row.contains(
                "model.layers.0.self_attn.kv_a_proj_with_mqa.weight F8_E4M3 × weight_scale_inv [5, 2] (128×128 blocks)"
            ),
        "{row}"
    );
    // Layer by layer, as a GGUF file's: no layer-1 tensor with --layer 0.
    assert!(!out.contains("blk.1."), "{out}");
}

#[test]
fn a_folder_a_shard_a_weights_file_and_a_golden_case_are_sent_where_they_belong() {
    // A folder without config.json, and one shard instead of its folder.
    let (code, lines) = refused(&repo().join("golden"));
    assert_eq!(code, 2, "{lines:?}");
    assert!(
        lines.len() == 1 && lines[0].contains("a folder without config.json"),
        "{lines:?}"
    );
    let (code, lines) = refused(&fp8_dir().join(SHARD1));
    assert_eq!(code, 2, "{lines:?}");
    assert!(lines.len() == 1 && lines[0].contains("pass the folder"), "{lines:?}");
    // A WEIGHTS file handed to compare.
    let weights = repo().join("golden/dumps/cpu-fp8/hf-v3-fp8.weights.safetensors");
    let (code, _out, err) = run_bin(&[
        "compare",
        "--model",
        fp8_dir().to_str().unwrap(),
        "--dump",
        weights.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("use `mla-diff weights --check`"), "{err}");
    // A dump of the checkpoint judged against a GGUF file names the model's form.
    let dump = repo().join("golden/dumps/cpu-fp8/hf-v3-fp8.weight-only.safetensors");
    let gguf = bf16_dir().join("model.gguf");
    let (code, _out, err) = run_bin(&[
        "compare",
        "--model",
        gguf.to_str().unwrap(),
        "--dump",
        dump.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("header.model.format") && err.contains("Hugging Face checkpoint folder (hf-v3-fp8)"),
        "{err}"
    );
    // A golden case pins a GGUF file.
    let tmp = tempfile::tempdir().unwrap();
    let (code, _out, err) = run_bin(&[
        "golden",
        "record",
        "--case",
        "hf-fp8",
        "--model",
        fp8_dir().to_str().unwrap(),
        "--golden-dir",
        tmp.path().to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("a golden case pins a GGUF file"), "{err}");
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
}

#[test]
fn exported_kernel_inputs_name_the_checkpoint_as_their_model() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("k");
    let (code, o, err) = run_bin(&[
        "run",
        "--model",
        fp8_dir().to_str().unwrap(),
        "--layer",
        "0",
        "--path",
        "mqa",
        "--backend",
        "cpu",
        "--quiet",
        "--export-inputs",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{o}{err}");
    let bytes = std::fs::read(out.join("inputs.safetensors")).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let header: serde_json::Value = serde_json::from_str(&meta.metadata().as_ref().unwrap()["dump_header"]).unwrap();
    assert_eq!(header["model"]["format"], "hf-safetensors");
    assert_eq!(header["model"]["file"], "hf-v3-fp8");
    assert_eq!(
        header["model"]["index_sha256"],
        "6fe59ab29594713e3a69603ae4772e43bd3728c6b41aba763e8483c2e970067c"
    );
}
