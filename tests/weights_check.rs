//! `mla-diff weights --check`: an engine's loaded weights against the GGUF. A correct file
//! passes; swapped fused_qkv_a_proj halves are `shard-order [1,0]`; every TP rank holding rank
//! 0's kv_b_proj slice is reported as the duplication; transposes are named.

use std::collections::HashMap;

use crate::common::{repo, run_bin};
use mla_diff::compute::reference::{assemble_kv_b, widen_to_f64};
use mla_diff::model::config::MlaConfig;
use mla_diff::model::gguf::GgufFile;
use mla_diff::model::weights::{LayerWeights, QWeights};
use ndarray::{Array2, Axis, concatenate, s};

/// vLLM-named weights of `layer`, as a correct engine holds them with `tp` ranks.
/// (name, shape, values) of each tensor of a weights file.
type Tensors = Vec<(String, Vec<usize>, Vec<f32>)>;

fn engine_weights(model: &str, layer: usize, tp: usize) -> (MlaConfig, Tensors) {
    let file = GgufFile::open(repo().join("golden/models").join(model)).unwrap();
    let cfg = MlaConfig::from_gguf(&file).unwrap();
    let w = LayerWeights::load(&file, &cfg, layer).unwrap();
    let [n, l, p, _, v] = cfg.dims().nlprv();
    let r = cfg.qk_rope_head_dim;
    let nh = n / tp;
    let mut out = Vec::new();
    let mut put = |name: String, a: Array2<f64>| {
        out.push((name, a.shape().to_vec(), a.iter().map(|&x| x as f32).collect()));
    };
    let QWeights::Lora { q_a, q_b, .. } = &w.q else {
        panic!("needs q_lora")
    };
    let fused = concatenate(Axis(0), &[widen_to_f64(q_a).view(), widen_to_f64(&w.kv_a_mqa).view()]).unwrap();
    put(format!("L{layer}.fused_qkv_a_proj"), fused);
    let kv_b = assemble_kv_b(&cfg, &w.kv_b);
    let qb = widen_to_f64(q_b);
    let o = widen_to_f64(&w.o_proj);
    for rank in 0..tp {
        let h = rank * nh..(rank + 1) * nh;
        put(
            format!("L{layer}.q_b_proj.rank{rank}"),
            qb.slice(s![h.start * (p + r)..h.end * (p + r), ..]).to_owned(),
        );
        put(
            format!("L{layer}.kv_b_proj.rank{rank}"),
            kv_b.slice(s![h.start * (p + v)..h.end * (p + v), ..]).to_owned(),
        );
        put(
            format!("L{layer}.o_proj.rank{rank}"),
            o.slice(s![.., h.start * v..h.end * v]).to_owned(),
        );
    }
    let _ = l;
    (cfg, out)
}

fn write(
    dir: &std::path::Path,
    name: &str,
    tensors: &[(String, Vec<usize>, Vec<f32>)],
    tp: usize,
) -> std::path::PathBuf {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|t| t.2.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .zip(&bytes)
        .map(|(t, b)| {
            (
                t.0.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, t.1.clone(), b).unwrap(),
            )
        })
        .collect();
    let meta: HashMap<String, String> = [
        ("engine".to_string(), "test".to_string()),
        ("tp_size".to_string(), tp.to_string()),
    ]
    .into_iter()
    .collect();
    let p = dir.join(name);
    std::fs::write(&p, safetensors::serialize(views, Some(meta)).unwrap()).unwrap();
    p
}

fn check(path: &std::path::Path) -> (i32, String, String) {
    let m = repo().join("golden/models/tiny-v3-q8_0.gguf");
    run_bin(&[
        "weights",
        "--model",
        m.to_str().unwrap(),
        "--check",
        path.to_str().unwrap(),
    ])
}

#[test]
fn correct_weights_pass() {
    let dir = tempfile::tempdir().unwrap();
    let (_, w) = engine_weights("tiny-v3-q8_0.gguf", 1, 2);
    let p = write(dir.path(), "ok.safetensors", &w, 2);
    let (code, out, err) = check(&p);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        out.contains(&format!("all {} tensors match the GGUF", w.len())),
        "{out}"
    );
}

#[test]
fn swapped_fused_halves_are_shard_order() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, mut w) = engine_weights("tiny-v3-q8_0.gguf", 1, 2);
    let lq = cfg.q_lora_rank.unwrap();
    let h = cfg.hidden;
    let f = &mut w[0];
    assert!(f.0.ends_with("fused_qkv_a_proj"));
    let (qa, kva) = f.2.split_at(lq * h);
    f.2 = [kva, qa].concat();
    let p = write(dir.path(), "swap.safetensors", &w, 2);
    let (code, out, err) = check(&p);
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(
        out.contains("finding shard-order at L1.fused_qkv_a_proj: shard-order [1,0]"),
        "{out}"
    );
    assert!(
        out.contains("0 = q_a_proj (64 rows), 1 = kv_a_proj_with_mqa (112 rows)"),
        "{out}"
    );
}

#[test]
fn every_rank_holding_rank0_kv_b_is_the_duplication() {
    let dir = tempfile::tempdir().unwrap();
    let (_, mut w) = engine_weights("tiny-v3-q8_0.gguf", 1, 2);
    let r0 = w.iter().find(|t| t.0 == "L1.kv_b_proj.rank0").unwrap().2.clone();
    w.iter_mut().find(|t| t.0 == "L1.kv_b_proj.rank1").unwrap().2 = r0;
    let p = write(dir.path(), "dup.safetensors", &w, 2);
    let (code, out, err) = check(&p);
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(
        out.contains("finding tp-rank-order at L1.kv_b_proj.rank*: every rank holds rank 0's slice: ranks [0, 1] hold slices [0,0] (duplicated shard 0; slices [1] of blk.1.attn_k_b.weight (Q8_0) + blk.1.attn_v_b.weight (Q8_0) are missing)"),
        "{out}"
    );
    // kv_b_proj is rebuilt from both split tensors: the finding names both.
    assert!(
        out.contains("  GGUF source: blk.1.attn_k_b.weight (Q8_0) + blk.1.attn_v_b.weight (Q8_0)\n"),
        "{out}"
    );
    // Only kv_b is named: the other params pass.
    assert_eq!(out.matches("finding ").count(), 1, "{out}");
}

#[test]
fn transposes_and_missing_shards_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let (_, mut w) = engine_weights("tiny-v3-q8_0.gguf", 1, 2);
    // o_proj rank 0 stored [in, out].
    let o = w.iter_mut().find(|t| t.0 == "L1.o_proj.rank0").unwrap();
    let (a, b) = (o.1[0], o.1[1]);
    let mut t = vec![0f32; a * b];
    for i in 0..a {
        for j in 0..b {
            t[j * a + i] = o.2[i * b + j];
        }
    }
    o.2 = t;
    o.1 = vec![b, a];
    // q_b rank 1 missing.
    w.retain(|t| t.0 != "L1.q_b_proj.rank1");
    let p = write(dir.path(), "tr.safetensors", &w, 2);
    let (code, out, err) = check(&p);
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(
        out.contains("finding transposed at L1.o_proj.rank0: holds the expected [256, 192] transposed"),
        "{out}"
    );
    assert!(out.contains("missing shard(s): rank(s) [1] of tp 2"), "{out}");
}

/// `W_UK_T` [N, P, L] and `W_UV` [N, L, V] of `layer`, as vLLM's MLA backend holds them.
fn absorbed(model: &str, layer: usize) -> (MlaConfig, Tensors) {
    let file = GgufFile::open(repo().join("golden/models").join(model)).unwrap();
    let cfg = MlaConfig::from_gguf(&file).unwrap();
    let w = LayerWeights::load(&file, &cfg, layer).unwrap();
    let [n, l, p, _, v] = cfg.dims().nlprv();
    let kv_b = assemble_kv_b(&cfg, &w.kv_b);
    let mut uk = Vec::new();
    let mut uv = Vec::new();
    for h in 0..n {
        for pi in 0..p {
            for li in 0..l {
                uk.push(kv_b[[h * (p + v) + pi, li]] as f32);
            }
        }
    }
    for h in 0..n {
        for li in 0..l {
            for vi in 0..v {
                uv.push(kv_b[[h * (p + v) + p + vi, li]] as f32);
            }
        }
    }
    let whole = kv_b.iter().map(|&x| x as f32).collect();
    let out = vec![
        (format!("L{layer}.W_UK_T"), vec![n, p, l], uk),
        (format!("L{layer}.W_UV"), vec![n, l, v], uv),
        (format!("L{layer}.kv_b_proj"), vec![n * (p + v), l], whole),
    ];
    (cfg, out)
}

fn check_model(model: &str, path: &std::path::Path) -> (i32, String, String) {
    let m = repo().join("golden/models").join(model);
    run_bin(&[
        "weights",
        "--model",
        m.to_str().unwrap(),
        "--check",
        path.to_str().unwrap(),
    ])
}

#[test]
fn absorbed_weights_name_their_gguf_sources() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, w) = absorbed("tiny-v3-q8_0.gguf", 1);
    let p = write(dir.path(), "ok.safetensors", &w, 1);
    let (code, out, err) = check(&p);
    assert_eq!(code, 0, "{out}\n{err}");
    // The table names each tensor's file dtype and its GGUF source with the ggml type.
    let row = |name: &str| out.lines().find(|l| l.contains(name)).unwrap_or_default().to_string();
    assert!(
        row("L1.W_UK_T ").contains("F32") && row("L1.W_UK_T ").contains("blk.1.attn_k_b.weight (Q8_0)"),
        "{out}"
    );
    assert!(row("L1.W_UV ").contains("blk.1.attn_v_b.weight (Q8_0)"), "{out}");
    assert!(
        out.contains("dtype metadata absent (f32), judged by the f32 weight row"),
        "{out}"
    );

    // W_UK_T with one head's values off: a mismatch whose source is attn_k_b alone.
    let [n, l, p_, _, v] = cfg.dims().nlprv();
    let mut bad = w.clone();
    for x in &mut bad[0].2[2 * p_ * l..3 * p_ * l] {
        *x *= 1.5;
    }
    let p = write(dir.path(), "uk.safetensors", &bad, 1);
    let (code, out, _) = check(&p);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("finding mismatch at L1.W_UK_T: 1 of 6 rows differ (first [2])"),
        "{out}"
    );
    let finding = out
        .split("finding ")
        .find(|f| f.starts_with("mismatch at L1.W_UK_T"))
        .unwrap();
    assert!(
        finding.contains("  GGUF source: blk.1.attn_k_b.weight (Q8_0)\n"),
        "{finding}"
    );
    assert!(!finding.contains("attn_v_b"), "{finding}");
    assert_eq!(out.matches("finding ").count(), 1, "{out}");

    // W_UV held as attn_v_b is stored, [N, V, L]: "transposed", naming attn_v_b.
    let mut tr = w.clone();
    let uv = &tr[1].2;
    let mut t = vec![0f32; uv.len()];
    for h in 0..n {
        for li in 0..l {
            for vi in 0..v {
                t[(h * v + vi) * l + li] = uv[(h * l + li) * v + vi];
            }
        }
    }
    tr[1].2 = t;
    tr[1].1 = vec![n, v, l];
    let p = write(dir.path(), "uv.safetensors", &tr, 1);
    let (code, out, _) = check(&p);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains(&format!(
            "finding kv-b-layout at L1.W_UV: holds the expected [{n}, {l}, {v}] transposed (shape [{n}, {v}, {l}]"
        )),
        "{out}"
    );
    let hint = out.lines().skip_while(|x| !x.contains("at L1.W_UV")).nth(1).unwrap();
    assert!(
        hint.contains("hint: W_UV is [N, L, V]; this tensor holds it transposed, [N, V, L], the layout blk.1.attn_v_b.weight (Q8_0) is stored in"),
        "{hint}"
    );
    assert!(out.contains("  GGUF source: blk.1.attn_v_b.weight (Q8_0)\n"), "{out}");
}

#[test]
fn legacy_kv_b_mismatches_name_attn_kv_b() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, mut w) = absorbed("legacy-kvb-f32.gguf", 1);
    // kv_b_proj: one head's rows off.
    let [_, l, p, _, v] = cfg.dims().nlprv();
    for x in &mut w[2].2[(p + v) * l..2 * (p + v) * l] {
        *x += 0.25;
    }
    let path = write(dir.path(), "legacy.safetensors", &w, 1);
    let (code, out, _) = check_model("legacy-kvb-f32.gguf", &path);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("finding mismatch at L1.kv_b_proj:"), "{out}");
    assert!(out.contains("  GGUF source: blk.1.attn_kv_b.weight (F32)\n"), "{out}");
    // W_UK_T and W_UV of a legacy file come from attn_kv_b too (and pass here).
    let row = |name: &str| out.lines().find(|x| x.contains(name)).unwrap_or_default().to_string();
    assert!(
        row("L1.W_UK_T ").contains("blk.1.attn_kv_b.weight (F32)") && row("L1.W_UK_T ").contains("pass"),
        "{out}"
    );
    assert!(row("L1.W_UV ").contains("blk.1.attn_kv_b.weight (F32)"), "{out}");
}

#[test]
fn weights_header_shows_the_dtype_metadata_string() {
    let dir = tempfile::tempdir().unwrap();
    let (_, w) = absorbed("tiny-v3-q8_0.gguf", 1);
    let bytes: Vec<Vec<u8>> = w
        .iter()
        .map(|t| t.2.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = w
        .iter()
        .zip(&bytes)
        .map(|(t, b)| {
            (
                t.0.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, t.1.clone(), b).unwrap(),
            )
        })
        .collect();
    let meta: HashMap<String, String> = [("dtype".to_string(), "float16".to_string())].into_iter().collect();
    let p = dir.path().join("f16.safetensors");
    std::fs::write(&p, safetensors::serialize(views, Some(meta)).unwrap()).unwrap();
    let (code, out, err) = check(&p);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        out.contains("dtype metadata `float16`, judged by the bf16 weight row"),
        "{out}"
    );
    assert!(out.contains("GGUF source (ggml type)"), "{out}");
}

#[test]
fn an_unloaded_kv_b_is_weight_not_loaded() {
    // vllm-gguf-plugin 0.0.5 maps `attn_kv_b` but not the split `attn_k_b`/`attn_v_b`: kv_b_proj
    // keeps the zeros it was allocated with. Every rank's shard is zero here.
    let dir = tempfile::tempdir().unwrap();
    let (_, mut w) = engine_weights("tiny-v3-q8_0.gguf", 1, 2);
    let mut zeroed = 0;
    for t in w.iter_mut().filter(|t| t.0.contains(".kv_b_proj.")) {
        t.2.iter_mut().for_each(|x| *x = 0.0);
        zeroed += 1;
    }
    assert_eq!(zeroed, 2);
    let p = write(dir.path(), "unloaded.safetensors", &w, 2);
    let (code, out, err) = check(&p);
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(out.contains("finding weight-not-loaded at L1.kv_b_proj.rank0"), "{out}");
    assert!(
        out.contains("blk.1.attn_k_b.weight"),
        "the hint names the GGUF tensors: {out}"
    );
    assert!(out.contains("never loaded"), "{out}");
    assert!(!out.contains("phantom-output"), "{out}");
}

#[test]
fn format2_dumps_carry_weights_for_weights_check() {
    // The same weights under `weights.` next to a step's activation (which weights --check skips),
    // with the format-2 header's dtype.
    let dir = tempfile::tempdir().unwrap();
    let (_, w) = engine_weights("tiny-v3-q8_0.gguf", 1, 2);
    let mut t: Vec<(String, Vec<usize>, Vec<f32>)> = w
        .iter()
        .map(|(n, s, v)| (format!("weights.{n}"), s.clone(), v.clone()))
        .collect();
    t.push(("s0.L1.attn_out".into(), vec![2, 3], vec![0.5; 6]));
    let bytes: Vec<Vec<u8>> = t
        .iter()
        .map(|x| x.2.iter().flat_map(|f| f.to_le_bytes()).collect())
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = t
        .iter()
        .zip(&bytes)
        .map(|(x, b)| {
            (
                x.0.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, x.1.clone(), b).unwrap(),
            )
        })
        .collect();
    let header = r#"{"model":{"file":"tiny-v3-q8_0.gguf","bytes":0,"index_sha256":"","layer_sha256":{}},"dtype":"f32","steps":[{"name":"prefill","seqs":[{"new":2,"context":0}]}]}"#;
    let meta: HashMap<String, String> = [
        ("format".to_string(), "mla-diff dump 2".to_string()),
        ("header".to_string(), header.to_string()),
        ("tp_size".to_string(), "2".to_string()),
    ]
    .into_iter()
    .collect();
    let p = dir.path().join("f2.safetensors");
    std::fs::write(&p, safetensors::serialize(views, Some(meta)).unwrap()).unwrap();
    let (code, out, err) = check(&p);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        out.contains(&format!("all {} tensors match the GGUF", w.len())),
        "{out}"
    );
}

/// On a narrow terminal the weights table wraps its cells to the width, tensor names whole; a
/// pipe and `--json -` (the table then on stderr) keep every cell on one line.
#[test]
fn the_weights_table_fits_a_terminal_and_stays_whole_elsewhere() {
    let dir = tempfile::tempdir().unwrap();
    let (_, w) = absorbed("tiny-v3-q8_0.gguf", 1);
    let p = write(dir.path(), "abs.safetensors", &w, 1);
    let file = GgufFile::open(repo().join("golden/models/tiny-v3-q8_0.gguf")).unwrap();
    let cfg = MlaConfig::from_gguf(&file).unwrap();
    let rep = mla_diff::jobs::weights_check::check(&file, &cfg, &p, None).unwrap();
    let table_width = |s: &str| {
        s.lines()
            .filter(|l| l.starts_with('│') || l.starts_with('┌'))
            .map(|l| l.chars().count())
            .max()
            .unwrap()
    };
    let full = mla_diff::output::weights_check::terminal(&rep);
    assert!(table_width(&full) > 100, "{full}");
    let fit = mla_diff::output::weights_check::terminal_fit(&rep, Some(80));
    assert!(table_width(&fit) <= 80, "{fit}");
    assert!(fit.contains("│ L1.W_UK_T "), "{fit}");
    let (code, out, err) = check_model("tiny-v3-q8_0.gguf", &p);
    assert_eq!(code, 0, "{err}");
    assert_eq!(table_width(&out), table_width(&full));
    let m = repo().join("golden/models/tiny-v3-q8_0.gguf");
    let (code, out, err) = run_bin(&[
        "weights",
        "--model",
        m.to_str().unwrap(),
        "--check",
        p.to_str().unwrap(),
        "--json",
        "-",
    ]);
    assert_eq!(code, 0, "{err}");
    let doc: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(doc["kind"], "weights");
    assert!(err.contains("tensors match the GGUF"), "{err}");
}

/// An activation dump given to `weights --check` is sent to `compare` (exit 2), not read as
/// weights: format 1's `L0.o_proj` [T, H] would otherwise be judged as the `o_proj` weight
/// [H, N·V], and a format-2 dump without `weights.…` tensors holds no weight at all.
#[test]
fn an_activation_dump_is_sent_to_compare() {
    for (model, dump, why) in [
        (
            "tiny-v3-f32.gguf",
            "tiny-v3-f32.hf.safetensors",
            "activation sites such as `L0.attn_in`",
        ),
        (
            "fa3-v3-bf16.gguf",
            "fa3-v3-bf16.vllm-live-flashmla.safetensors",
            "`mla-diff dump 2` without `weights.…` tensors",
        ),
    ] {
        let d = repo().join("golden/dumps").join(dump);
        let (code, out, err) = check_model(model, &d);
        assert_eq!(code, 2, "{dump}: {out}\n{err}");
        let line = err.trim();
        assert!(
            line.contains(&format!("{}: tensors: this is an activation dump ({why})", d.display()))
                && line.contains("use `mla-diff compare --dump`"),
            "{dump}: {line}"
        );
        assert!(!out.contains("o_proj"), "{out}");
    }

    // Only `L0.o_proj` [T, H] and `format = mla-diff dump 1`: still an activation dump.
    let dir = tempfile::tempdir().unwrap();
    let vals: Vec<u8> = crate::common::vals(7, 6 * 256, 1.0)
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    let views = vec![(
        "L0.o_proj".to_string(),
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![6, 256], &vals).unwrap(),
    )];
    let meta: HashMap<String, String> = [("format".to_string(), "mla-diff dump 1".to_string())].into();
    let p = dir.path().join("o_proj.safetensors");
    std::fs::write(&p, safetensors::serialize(views, Some(meta)).unwrap()).unwrap();
    let (code, out, err) = check_model("tiny-v3-f32.gguf", &p);
    assert_eq!(code, 2, "{out}\n{err}");
    assert!(
        err.contains("this is an activation dump (`format = mla-diff dump 1`)"),
        "{err}"
    );
}
