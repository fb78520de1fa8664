//! Asking about one layer costs one layer: on a sparse 61-layer MoE GGUF (gigabytes declared,
//! almost nothing on disk), opening reads only the header and `run --layer 3` reads only layer
//! 3's tensor data. The full-size DeepSeek-V3 version of this file is made by
//! scripts/fixtures/make_sparse_gguf.py and measured in BENCHMARKS.md (P1).

use std::io::{Seek, SeekFrom, Write};

use crate::common::{GgufBuilder, TensorSpec, Val, run_bin, vals};
use mla_diff::model::config::MlaConfig;
use mla_diff::model::gguf::GgufFile;

const A: &str = "deepseek2";
const LAYERS: usize = 61;
const DENSE: usize = 3;
// Dims: N=8, H=512, Lq=128, L=128, P=32, R=32, V=32, dense FFN 1024, 64 experts of 256.
const N: usize = 8;
const H: usize = 512;
const LQ: usize = 128;
const L: usize = 128;
const P: usize = 32;
const R: usize = 32;
const V: usize = 32;
const F: usize = 1024;
const E: usize = 64;
const FE: usize = 256;

/// (name, PyTorch shape) of every tensor of the model, in file order.
fn index() -> Vec<(String, Vec<usize>)> {
    let mut v = vec![("token_embd.weight".to_string(), vec![256, H])];
    for i in 0..LAYERS {
        let b = |s: &str| format!("blk.{i}.{s}.weight");
        v.push((b("attn_norm"), vec![H]));
        v.push((b("attn_q_a"), vec![LQ, H]));
        v.push((b("attn_q_a_norm"), vec![LQ]));
        v.push((b("attn_q_b"), vec![N * (P + R), LQ]));
        v.push((b("attn_kv_a_mqa"), vec![L + R, H]));
        v.push((b("attn_kv_a_norm"), vec![L]));
        v.push((b("attn_k_b"), vec![N, L, P]));
        v.push((b("attn_v_b"), vec![N, V, L]));
        v.push((b("attn_output"), vec![H, N * V]));
        v.push((b("ffn_norm"), vec![H]));
        if i < DENSE {
            v.push((b("ffn_gate"), vec![F, H]));
            v.push((b("ffn_up"), vec![F, H]));
            v.push((b("ffn_down"), vec![H, F]));
        } else {
            v.push((b("ffn_gate_inp"), vec![E, H]));
            v.push((b("ffn_gate_exps"), vec![E, FE, H]));
            v.push((b("ffn_up_exps"), vec![E, FE, H]));
            v.push((b("ffn_down_exps"), vec![E, H, FE]));
            v.push((b("ffn_gate_shexp"), vec![FE, H]));
            v.push((b("ffn_up_shexp"), vec![FE, H]));
            v.push((b("ffn_down_shexp"), vec![H, FE]));
        }
    }
    v.push(("output_norm.weight".to_string(), vec![H]));
    v
}

/// Writes the sparse file: header and index, the full declared length as a hole, and real F32
/// data only for the tensors of `layer_with_data`. Returns (path guard, path, declared bytes).
fn sparse_file(layer_with_data: usize) -> (tempfile::TempDir, std::path::PathBuf, u64) {
    let mut g = GgufBuilder::default();
    g.kv("general.architecture", Val::Str(A.into()));
    for (k, x) in [
        ("block_count", LAYERS),
        ("embedding_length", H),
        ("attention.head_count", N),
        ("attention.head_count_kv", 1),
        ("attention.q_lora_rank", LQ),
        ("attention.kv_lora_rank", L),
        ("attention.key_length", L + R),
        ("attention.value_length", L),
        ("attention.key_length_mla", P + R),
        ("attention.value_length_mla", V),
        ("rope.dimension_count", R),
        ("leading_dense_block_count", DENSE),
        ("expert_count", E),
        ("expert_used_count", 8),
        ("expert_feed_forward_length", FE),
    ] {
        g.kv(&format!("{A}.{k}"), Val::U32(x as u32));
    }
    g.kv(&format!("{A}.attention.layer_norm_rms_epsilon"), Val::F32(1e-6));
    g.kv(&format!("{A}.rope.freq_base"), Val::F32(10000.0));
    let align = g.alignment;
    let mut off = 0u64;
    let mut placed = Vec::new();
    for (name, shape) in index() {
        let n: u64 = shape.iter().map(|&x| x as u64).product();
        g.tensors.push(TensorSpec {
            name: name.clone(),
            ne: shape.iter().rev().map(|&x| x as u64).collect(),
            type_id: 0,
            data: Vec::new(),
            offset_override: Some(off),
        });
        placed.push((name, shape, off));
        off = (off + 4 * n).div_ceil(align) * align;
    }
    let header = g.build().bytes;
    let total = header.len() as u64 + off;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sparse-61L.gguf");
    let mut f = std::fs::File::create(&path).unwrap();
    f.write_all(&header).unwrap();
    f.set_len(total).unwrap();
    let prefix = format!("blk.{layer_with_data}.");
    for (i, (name, shape, o)) in placed.iter().enumerate() {
        if !name.starts_with(&prefix) || name.contains("exps") || name.contains("shexp") || name.contains("gate_inp") {
            continue;
        }
        let n: usize = shape.iter().product();
        let mut v = vals(1000 + i as u64, n, 0.05);
        if shape.len() == 1 {
            v.iter_mut().for_each(|x| *x += 1.0);
        }
        f.seek(SeekFrom::Start(header.len() as u64 + o)).unwrap();
        f.write_all(&v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>())
            .unwrap();
    }
    (dir, path, total)
}

#[test]
fn opening_reads_no_tensor_data_and_one_layer_reads_one_layer() {
    let (_d, path, declared) = sparse_file(3);
    let on_disk = std::fs::metadata(&path).unwrap().len();
    assert_eq!(on_disk, declared);
    assert!(declared > 6_000_000_000, "declared {declared} bytes");

    let file = GgufFile::open(&path).unwrap();
    assert!(
        file.header_bytes_read() as u64 <= file.data_offset(),
        "the header parser read past the index"
    );
    assert!(file.data_reads().is_empty(), "opening read tensor data");
    let cfg = MlaConfig::from_gguf(&file).unwrap();
    assert_eq!(cfg.n_layer, LAYERS);
    assert!(file.data_reads().is_empty(), "deriving the config read tensor data");

    // The whole run (reference and all four paths) on layer 3 of the in-process library.
    let rc = mla_diff::judge::report::RunConfig {
        layers: vec![3],
        batch: mla_diff::core::batch::Batch::single(9, 0),
        ..mla_diff::judge::report::RunConfig::default()
    };
    let backend =
        mla_diff::backend::Backend::Cpu(mla_diff::backend::cpu::CpuOps::new(mla_diff::core::dtype::Dtype::F32));
    let rep = mla_diff::jobs::run::run(&backend, &file, &cfg, &rc).unwrap();
    assert!(rep.all_pass());
    let reads = file.data_reads();
    assert!(!reads.is_empty());
    for (name, _, _) in &reads {
        assert!(
            name.starts_with("blk.3.attn_") || name == "blk.3.ffn_norm.weight",
            "read {name}"
        );
    }
    let bytes: u64 = reads.iter().map(|r| r.2).sum();
    // Each of the 9 attention tensors of layer 3 is read by the reference and by each path (4),
    // so at most 5 reads of the layer's attention bytes: far below one other layer, let alone 61.
    let layer_attn: u64 =
        4 * (H + LQ * H + LQ + N * (P + R) * LQ + (L + R) * H + L + N * L * P + N * V * L + H * N * V) as u64;
    assert!(
        bytes <= 5 * layer_attn,
        "{bytes} bytes read, one layer's attention is {layer_attn}"
    );
}

#[test]
fn the_binary_reports_what_it_read() {
    let (_d, path, _) = sparse_file(3);
    let (code, out, err) = run_bin(&[
        "run",
        "--model",
        path.to_str().unwrap(),
        "--layer",
        "3",
        "--path",
        "mha",
        "--tokens",
        "8",
        "--backend",
        "cpu",
        "--quiet",
        "--stats",
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    let stats = err.lines().find(|l| l.starts_with("mla-diff: stats:")).unwrap();
    assert!(stats.contains("peak RSS"), "{stats}");
    // Only layer 3's data, 9 attention tensors (the reference and the mha path read the same ones).
    assert!(stats.contains("(layer 3: 9 tensors,"), "{stats}");
    assert!(!stats.contains("layer 4") && !stats.contains("token_embd"), "{stats}");
}

#[test]
fn stats_name_every_stage_of_the_run() {
    let (_d, path, _) = sparse_file(3);
    let (code, out, err) = run_bin(&[
        "run",
        "--model",
        path.to_str().unwrap(),
        "--layer",
        "3",
        "--tokens",
        "8",
        "--backend",
        "cpu",
        "--quiet",
        "--stats",
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    let stages = err.lines().find(|l| l.starts_with("mla-diff: stages:")).unwrap();
    let names: Vec<&str> = stages
        .trim_start_matches("mla-diff: stages: ")
        .split(", ")
        .map(|s| s.split(" 0.").next().unwrap().split(" 1.").next().unwrap())
        .collect();
    for want in [
        "open",
        "backend",
        "dequant",
        "reference",
        "path mha",
        "path mqa",
        "path chunked",
        "path mixed",
        "compare",
        "diagnose",
        "report",
    ] {
        assert!(
            names.iter().any(|n| n.starts_with(want)),
            "{want} missing from {stages}"
        );
    }
    // Four paths, four comparisons.
    assert!(stages.contains("compare") && stages.contains("(4×)"), "{stages}");
}

#[test]
fn a_run_bigger_than_the_memory_limit_is_refused_before_any_work() {
    let (_d, path, _) = sparse_file(3);
    let p = path.to_str().unwrap();
    let run = |extra: &[&str]| {
        let mut a = vec!["run", "--model", p, "--layer", "3", "--backend", "cpu", "--quiet"];
        a.extend_from_slice(extra);
        run_bin(&a)
    };
    // A million tokens of this model need far more than any machine here: refused at once, with
    // the file, the estimate and where the limit came from (MemTotal or a cgroup).
    let (code, _, err) = run(&["--tokens", "1000000"]);
    assert_eq!(code, 2, "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains(p) && err.contains("needs about") && err.contains("GiB"),
        "{err}"
    );
    assert!(err.contains("MemTotal") || err.contains("cgroup"), "{err}");
    // --max-memory sets the limit, both ways.
    let (code, _, err) = run(&["--tokens", "8", "--max-memory", "1M"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("the limit is 1.0 MiB (--max-memory)"), "{err}");
    let (code, out, err) = run(&["--tokens", "8", "--path", "mha", "--max-memory", "64G"]);
    assert_eq!(code, 0, "{out}\n{err}");
    let (code, _, err) = run(&["--tokens", "8", "--max-memory", "lots"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("not a size"), "{err}");
}

#[test]
fn the_gpu_reference_needs_a_gpu_backend() {
    let (code, _, err) = run_bin(&["run", "--backend", "cpu", "--reference-backend", "cuda", "--quiet"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("--reference-backend cuda") && err.contains("--backend cpu"),
        "{err}"
    );
}

#[test]
fn the_softmax_scale_fit_on_sampled_rows_still_names_the_missing_yarn_factor() {
    // 64 tokens × the fixture's heads is more rows than the fit samples, so this exercises the
    // sampled recomputation; the fitted scale must still be 1/m² within 0.5%.
    let model = crate::common::repo().join("golden/models/yarn-v3-f32.gguf");
    let (code, out, err) = run_bin(&[
        "run",
        "--model",
        model.to_str().unwrap(),
        "--tokens",
        "64",
        "--path",
        "mha",
        "--inject",
        "no-mscale",
        "--backend",
        "cpu",
        "--quiet",
    ]);
    assert_eq!(code, 1, "{out}\n{err}");
    let finding = out
        .lines()
        .find(|l| l.starts_with("finding [mha] softmax-scale"))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(out.contains("the YaRN m² ="), "{out}");
    let c: f64 = finding
        .split('×')
        .nth(1)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let cfg = MlaConfig::from_gguf(&GgufFile::open(&model).unwrap()).unwrap();
    let msq = cfg.mscale() * cfg.mscale();
    assert!((c * msq - 1.0).abs() < 5e-3, "fitted ×{c}, 1/m² = {}", 1.0 / msq);
}
