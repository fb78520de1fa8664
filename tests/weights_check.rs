//! `mla-diff weights --check`: an engine's loaded weights against the GGUF. A correct file
//! passes; swapped fused_qkv_a_proj halves are `shard-order [1,0]`; every TP rank holding rank
//! 0's kv_b_proj slice is reported as the duplication; transposes are named. The FFN's
//! `gate_up_proj`/`down_proj` (and the shared experts') are checked with their merged-column
//! and row-parallel splits, in weights files and in format-2 dumps, where `compare` judges them
//! with the same code before any site (vllm-gguf-plugin#103: every rank keeping rank 0's slice).

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
    let p = dir.join(name);
    crate::common::write_f32_safetensors(&p, tensors, &[("engine", "test"), ("tp_size", &tp.to_string())]);
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
        out.contains(&format!("all {} tensors match the model", w.len())),
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
        out.contains("finding tp-rank-order at L1.kv_b_proj.rank1: every rank holds rank 0's slice: ranks [0, 1] hold slices [0,0] (duplicated shard 0; slices [1] of blk.1.attn_k_b.weight (Q8_0) + blk.1.attn_v_b.weight (Q8_0) are missing); rank 1: rel_l2 0 against rank 0's slice vs "),
        "{out}"
    );
    // The head-split attention keeps its own hint; only a merged-column param names the
    // GGUF plugin's merged-column loader.
    assert!(
        out.contains("hint: each rank must take its own slice of the head dim"),
        "{out}"
    );
    assert!(!out.contains("load_merged_column_weight"), "{out}");
    // kv_b_proj is rebuilt from both split tensors: the finding names both.
    assert!(
        out.contains("  model source: blk.1.attn_k_b.weight (Q8_0) + blk.1.attn_v_b.weight (Q8_0)\n"),
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
    // The table names each tensor's file dtype and its model source with the stored type.
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
        finding.contains("  model source: blk.1.attn_k_b.weight (Q8_0)\n"),
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
    assert!(out.contains("  model source: blk.1.attn_v_b.weight (Q8_0)\n"), "{out}");
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
    assert!(out.contains("  model source: blk.1.attn_kv_b.weight (F32)\n"), "{out}");
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
    assert!(out.contains("model source (type)"), "{out}");
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
    // The header binds the dump to its GGUF, as compare's reader checks it.
    let file = GgufFile::open(repo().join("golden/models/tiny-v3-q8_0.gguf")).unwrap();
    let header = serde_json::json!({
        "model": {
            "file": "tiny-v3-q8_0.gguf",
            "bytes": file.file_len(),
            "index_sha256": file.index_sha256_hex(),
            "layer_sha256": {"1": file.layer_sha256_hex(1)},
        },
        "dtype": "f32",
        "steps": [{"name": "prefill", "seqs": [{"new": 2, "context": 0}]}],
    });
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
        out.contains(&format!("all {} tensors match the model", w.len())),
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
    assert!(err.contains("tensors match the model"), "{err}");
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

/// The dense MLP's loaded weights of `layer` as vLLM holds them at `tp` ranks:
/// `L{layer}.gate_up_proj.rank{r}` `[2·F/tp, H]` (rank r's gate rows, then its up rows) and
/// `L{layer}.down_proj.rank{r}` `[H, F/tp]` (rank r's input columns), from the dequantized GGUF.
/// With `rank0_everywhere`, every rank's `gate_up_proj` holds rank 0's slice (the loader of
/// vllm-gguf-plugin#103).
fn ffn_weights(model: &str, layer: usize, tp: usize, rank0_everywhere: bool) -> Tensors {
    let file = GgufFile::open(repo().join("golden/models").join(model)).unwrap();
    let cfg = MlaConfig::from_gguf(&file).unwrap();
    let w = LayerWeights::load(&file, &cfg, layer).unwrap();
    let ffn = w.ffn.as_ref().expect("a dense layer");
    let f = ffn.gate.nrows();
    let per = f / tp;
    let mut out = Vec::new();
    for rank in 0..tp {
        let src = if rank0_everywhere { 0 } else { rank };
        let rows = src * per..(src + 1) * per;
        let gate_up = concatenate(
            Axis(0),
            &[ffn.gate.slice(s![rows.clone(), ..]), ffn.up.slice(s![rows, ..])],
        )
        .unwrap();
        out.push((
            format!("L{layer}.gate_up_proj.rank{rank}"),
            gate_up.shape().to_vec(),
            gate_up.iter().copied().collect(),
        ));
        let down = ffn.down.slice(s![.., rank * per..(rank + 1) * per]).to_owned();
        out.push((
            format!("L{layer}.down_proj.rank{rank}"),
            down.shape().to_vec(),
            down.iter().copied().collect(),
        ));
    }
    out
}

/// A format-2 dump of `model` (`tp.size` in its header when given) holding `weights` as
/// `weights.…` and one prefill step of layer 0 with `T = 5` tokens: `s0.L0.hidden_in` (seeded),
/// each rank's `s0.L0.o_proj.rank{r}` partial at TP > 1 and `s0.L0.hidden_out`, the
/// reference's, the latter times `out_scale` (1: what a correct engine computes). `engine` is the header's `engine.name`, version `0.26.0`; `index_sha256` plants
/// another model's identity.
fn format2_dump(
    dir: &std::path::Path,
    model: &str,
    weights: &Tensors,
    tp_size: Option<usize>,
    out_scale: f32,
    index_sha256: Option<String>,
) -> std::path::PathBuf {
    let file = GgufFile::open(repo().join("golden/models").join(model)).unwrap();
    let cfg = MlaConfig::from_gguf(&file).unwrap();
    let t = 5;
    let hidden: Vec<f32> = crate::common::vals(37, t * cfg.hidden, 1.0);
    let input =
        ndarray::Array2::from_shape_vec((t, cfg.hidden), hidden.iter().map(|&x| f64::from(x)).collect()).unwrap();
    let w0 = LayerWeights::load(&file, &cfg, 0).unwrap();
    let batch = mla_diff::core::batch::Batch::single(t, 0);
    // A TP size that does not divide the heads (a test of its refusal) records no partials.
    let tp = tp_size.filter(|t| cfg.n_head.is_multiple_of(*t)).unwrap_or(1);
    let r = mla_diff::compute::reference::reference_layer(&cfg, &w0, &input, &batch, tp, None).unwrap();
    let out: Vec<f32> = r.hidden_out.unwrap().iter().map(|&x| x as f32 * out_scale).collect();
    let f32_bytes = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    let mut tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = vec![
        (
            "s0.L0.hidden_in".into(),
            safetensors::Dtype::F32,
            vec![t, cfg.hidden],
            f32_bytes(&hidden),
        ),
        (
            "s0.L0.hidden_out".into(),
            safetensors::Dtype::F32,
            vec![t, cfg.hidden],
            f32_bytes(&out),
        ),
    ];
    // Each rank's o_proj partial, as a TP engine's hook records it.
    for rank in (0..tp).filter(|_| tp > 1) {
        let site = mla_diff::core::trace::Site::parse(&format!("L0.o_proj.rank{rank}")).unwrap();
        let v: Vec<f32> = r.trace.get(&site).unwrap().to_f64().iter().map(|&x| x as f32).collect();
        tensors.push((
            format!("s0.L0.o_proj.rank{rank}"),
            safetensors::Dtype::F32,
            vec![t, cfg.hidden],
            f32_bytes(&v),
        ));
    }
    let mut layers = serde_json::Map::new();
    layers.insert("0".into(), file.layer_sha256_hex(0).into());
    for (name, shape, v) in weights {
        let layer: usize = name[1..].split('.').next().unwrap().parse().unwrap();
        layers.insert(layer.to_string(), file.layer_sha256_hex(layer).into());
        tensors.push((
            format!("weights.{name}"),
            safetensors::Dtype::F32,
            shape.clone(),
            f32_bytes(v),
        ));
    }
    let mut header = serde_json::json!({
        "model": {
            "file": model,
            "bytes": file.file_len(),
            "index_sha256": index_sha256.unwrap_or_else(|| file.index_sha256_hex()),
            "layer_sha256": layers,
        },
        "hook": {"name": "tests/weights_check.rs", "version": "1"},
        "engine": {"name": "vllm", "version": "0.26.0"},
        "dtype": "f32",
        "steps": [{"name": "prefill", "seqs": [{"new": t, "context": 0}]}],
    });
    if let Some(tp) = tp_size {
        header["tp"] = serde_json::json!({"size": tp});
    }
    let meta: HashMap<String, String> = [
        ("format".to_string(), "mla-diff dump 2".to_string()),
        ("header".to_string(), header.to_string()),
    ]
    .into_iter()
    .collect();
    let p = dir.join("ffn.safetensors");
    crate::common::write_safetensors(&p, &tensors, Some(meta));
    p
}

/// vllm-gguf-plugin#103 in the loaded weights: at TP 2 (tiny-v3's Q8_0 FFN) and TP 4 (k256's
/// Q4_K FFN), every rank's quantized `gate_up_proj` holding rank 0's slice is `tp-rank-order` at
/// rank 1's tensor, with the evidence and the hint naming the loader; each rank holding its own
/// slice passes.
#[test]
fn every_rank_holding_rank0_gate_up_is_tp_rank_order() {
    for (model, tp, ggml) in [("tiny-v3-q8_0.gguf", 2, "Q8_0"), ("k256-q4_k_m.gguf", 4, "Q4_K")] {
        let dir = tempfile::tempdir().unwrap();
        let bug = format2_dump(dir.path(), model, &ffn_weights(model, 0, tp, true), Some(tp), 1.0, None);
        let (code, out, err) = check_model(model, &bug);
        assert_eq!(code, 1, "{model}: {out}\n{err}");
        assert!(
            out.contains(&format!("(engine `vllm 0.26.0`, tp {tp},")),
            "{model}: {out}"
        );
        let ranks: Vec<String> = (0..tp).map(|r| r.to_string()).collect();
        let zeros = vec!["0"; tp].join(",");
        assert!(
            out.contains(&format!(
                "finding tp-rank-order at L0.gate_up_proj.rank1: every rank holds rank 0's slice: ranks [{}] hold slices [{zeros}] (duplicated shard 0; slices {:?} of blk.0.ffn_gate.weight ({ggml}) + blk.0.ffn_up.weight ({ggml}) are missing); rank 1: rel_l2 0 against rank 0's slice vs 1.4",
                ranks.join(", "),
                (1..tp).collect::<Vec<_>>()
            )),
            "{model}: {out}"
        );
        assert!(
            out.contains("  hint: a merged-column weight loader that takes the TP rank from a keyword argument its caller never passes (vllm-gguf-plugin 0.0.5 `load_merged_column_weight`, fixed by PR #106) keeps rank 0's slice on every rank\n"),
            "{model}: {out}"
        );
        // Only gate_up_proj: every down_proj shard and rank 0's gate_up_proj pass.
        assert_eq!(out.matches("finding ").count(), 1, "{model}: {out}");
        let fails = out
            .lines()
            .filter(|l| l.starts_with("│ L") && l.contains(" FAIL "))
            .count();
        assert_eq!(fails, tp - 1, "{model}: {out}");

        // Fixed: each rank its own slice.
        let dir = tempfile::tempdir().unwrap();
        let fixed = format2_dump(
            dir.path(),
            model,
            &ffn_weights(model, 0, tp, false),
            Some(tp),
            1.0,
            None,
        );
        let (code, out, err) = check_model(model, &fixed);
        assert_eq!(code, 0, "{model}: {out}\n{err}");
        assert!(
            out.contains(&format!("all {} tensors match the model", 2 * tp)),
            "{model}: {out}"
        );
    }
}

/// Rank 2 holding rank 3's slice and rank 3 rank 2's (TP 4): each rank named with whose slice
/// it holds, and the general merged-column hint (not the rank-0 loader's).
#[test]
fn swapped_gate_up_ranks_say_which_rank_holds_whose_slice() {
    let model = "k256-q4_k_m.gguf";
    let dir = tempfile::tempdir().unwrap();
    let mut w = ffn_weights(model, 0, 4, false);
    let i2 = w.iter().position(|t| t.0 == "L0.gate_up_proj.rank2").unwrap();
    let i3 = w.iter().position(|t| t.0 == "L0.gate_up_proj.rank3").unwrap();
    let (a, b) = (w[i2].2.clone(), w[i3].2.clone());
    w[i2].2 = b;
    w[i3].2 = a;
    let p = format2_dump(dir.path(), model, &w, Some(4), 1.0, None);
    let (code, out, err) = check_model(model, &p);
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(
        out.contains("finding tp-rank-order at L0.gate_up_proj.rank2: rank 2 holds rank 3's slice, rank 3 holds rank 2's slice: ranks [0, 1, 2, 3] hold slices [0,1,3,2]; rank 2: rel_l2 0 against rank 3's slice vs "),
        "{out}"
    );
    assert!(
        out.contains("hint: rank r must take rows r·F/tp..(r+1)·F/tp of each merged shard (gate_proj, up_proj)"),
        "{out}"
    );
    assert!(!out.contains("load_merged_column_weight"), "{out}");
}

/// The shared experts of an MoE layer (moe-v3's Q8_0 layer 1, TP 2): rank 1 holding rank 0's
/// `shared_experts.gate_up_proj` is the same finding; a dense `gate_up_proj` dumped for that
/// layer is named as absent, and the routed experts are listed as ignored, saying why.
#[test]
fn shared_experts_and_routed_experts_of_an_moe_layer() {
    let model = "moe-v3-q8_0.gguf";
    let file = GgufFile::open(repo().join("golden/models").join(model)).unwrap();
    let cfg = MlaConfig::from_gguf(&file).unwrap();
    let moe = mla_diff::model::weights::MoeWeights::load(&file, &cfg, 1).unwrap();
    let sh = moe.shared.as_ref().unwrap();
    let per = sh.gate.nrows() / 2;
    let mut w: Tensors = Vec::new();
    for rank in 0..2 {
        let rows = 0..per; // rank 0's slice on both ranks
        let gu = concatenate(
            Axis(0),
            &[sh.gate.slice(s![rows.clone(), ..]), sh.up.slice(s![rows, ..])],
        )
        .unwrap();
        w.push((
            format!("L1.shared_experts.gate_up_proj.rank{rank}"),
            gu.shape().to_vec(),
            gu.iter().copied().collect(),
        ));
    }
    let h = cfg.hidden;
    w.push(("L1.gate_up_proj".into(), vec![8, h], crate::common::vals(3, 8 * h, 1.0)));
    w.push((
        "L1.experts.w13_weight".into(),
        vec![2, 4, 4],
        crate::common::vals(4, 32, 1.0),
    ));
    let dir = tempfile::tempdir().unwrap();
    let p = format2_dump(dir.path(), model, &w, Some(2), 1.0, None);
    let (code, out, err) = check_model(model, &p);
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(
        out.contains("finding tp-rank-order at L1.shared_experts.gate_up_proj.rank1: every rank holds rank 0's slice: ranks [0, 1] hold slices [0,0] (duplicated shard 0; slices [1] of blk.1.ffn_gate_shexp.weight (Q8_0) + blk.1.ffn_up_shexp.weight (Q8_0) are missing)"),
        "{out}"
    );
    assert!(
        out.contains("vllm-gguf-plugin 0.0.5 `load_merged_column_weight`"),
        "{out}"
    );
    assert!(
        out.contains("finding mismatch at L1.gate_up_proj: layer 1 is an MoE layer (leading_dense_block_count 1): it has no dense MLP `gate_up_proj`"),
        "{out}"
    );
    assert!(
        out.contains("ignored (routed experts, not rebuilt: dequantizing every expert of a layer costs E dense FFNs; the dense MLP and the shared experts are checked): L1.experts.w13_weight"),
        "{out}"
    );
}

/// `weights --check` reads a format-2 dump's header with `compare`'s reader: the engine and TP
/// size come from it, and a dump of another model is refused naming both files. Without
/// `--model`, the GGUF the header names is opened beside the dump.
#[test]
fn weights_check_reads_the_format2_header() {
    let model = "tiny-v3-q8_0.gguf";
    let dir = tempfile::tempdir().unwrap();
    // No tp_size anywhere: from the shards' ranks.
    let p = format2_dump(dir.path(), model, &ffn_weights(model, 1, 2, false), None, 1.0, None);
    let (code, out, err) = check_model(model, &p);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        out.contains("(engine `vllm 0.26.0`, tp 2, dtype metadata `f32`"),
        "{out}"
    );
    let (code, out, err) = run_bin(&["weights", "--check", p.to_str().unwrap()]);
    assert_eq!(code, 2, "{out}\n{err}");
    assert!(err.contains("`tiny-v3-q8_0.gguf`, which is not next to it"), "{err}");
    std::fs::copy(repo().join("golden/models").join(model), dir.path().join(model)).unwrap();
    let (code, out, err) = run_bin(&["weights", "--check", p.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}\n{err}");

    // Another model's dump.
    let other = GgufFile::open(repo().join("golden/models/tiny-v3-f32.gguf")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let p = format2_dump(
        dir.path(),
        model,
        &ffn_weights(model, 1, 2, false),
        Some(2),
        1.0,
        Some(other.index_sha256_hex()),
    );
    let (code, out, err) = check_model(model, &p);
    assert_eq!(code, 2, "{out}\n{err}");
    let line = err.trim();
    assert_eq!(line.lines().count(), 1, "{line}");
    assert!(
        line.contains(&p.display().to_string())
            && line.contains("tiny-v3-q8_0.gguf")
            && line.contains("header.model.index_sha256"),
        "{line}"
    );

    // A tp_size that does not divide the heads, and one that is not a positive integer.
    let dir = tempfile::tempdir().unwrap();
    let p = format2_dump(dir.path(), model, &ffn_weights(model, 1, 2, false), Some(4), 1.0, None);
    let (code, _, err) = check_model(model, &p);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("__metadata__.header.tp.size: 4 does not divide the 6 heads"),
        "{err}"
    );
}

/// Hostile weights: a tensor with another number of dims than its param is exit 2, one line
/// naming the file, the tensor and its shape; a same-rank wrong shape is a `mismatch` finding
/// naming both shapes; an unknown param is listed as ignored; a rank past tp_size is named.
#[test]
fn hostile_ffn_weights_are_errors_findings_or_ignored() {
    let model = "tiny-v3-q8_0.gguf";
    let dir = tempfile::tempdir().unwrap();
    let mut w = ffn_weights(model, 0, 2, false);
    let i = w.iter().position(|t| t.0 == "L0.down_proj.rank1").unwrap();
    w[i].1 = vec![w[i].2.len()];
    let p = format2_dump(dir.path(), model, &w, Some(2), 1.0, None);
    let (code, out, err) = check_model(model, &p);
    assert_eq!(code, 2, "{out}\n{err}");
    let line = err.trim();
    assert_eq!(line.lines().count(), 1, "{line}");
    assert!(
        line.contains(&format!("{}: weights.L0.down_proj.rank1: shape [16384] has 1 dims; `down_proj` has 2 ([256, 128] from blk.0.ffn_down.weight (Q8_0))", p.display())),
        "{line}"
    );

    let dir = tempfile::tempdir().unwrap();
    let mut w = ffn_weights(model, 0, 2, false);
    let i = w.iter().position(|t| t.0 == "L0.gate_up_proj.rank1").unwrap();
    w[i].1 = vec![64, 512];
    w.push(("L0.gate_up_projection.rank0".into(), vec![2, 2], vec![1.0; 4]));
    w.push(("L0.down_proj.rank2".into(), vec![256, 64], vec![0.5; 256 * 64]));
    let p = format2_dump(dir.path(), model, &w, Some(2), 1.0, None);
    let (code, out, err) = check_model(model, &p);
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(
        out.contains("finding mismatch at L0.gate_up_proj.rank1: shape [64, 512], expected [128, 256] from blk.0.ffn_gate.weight (Q8_0) + blk.0.ffn_up.weight (Q8_0)"),
        "{out}"
    );
    assert!(
        out.contains("finding tp-rank-order at L0.down_proj.rank2: rank 2 ≥ tp_size 2"),
        "{out}"
    );
    assert!(
        out.contains("ignored (not a parameter weights --check rebuilds): L0.gate_up_projection.rank0"),
        "{out}"
    );
}

/// A file holding only FFN weights is checked (format 1, tensor names `L{n}.{param}.rank{r}`).
#[test]
fn a_file_of_ffn_weights_only_is_checked() {
    let dir = tempfile::tempdir().unwrap();
    let w = ffn_weights("tiny-v3-q8_0.gguf", 1, 2, false);
    let p = write(dir.path(), "ffn.safetensors", &w, 2);
    let (code, out, err) = check(&p);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("all 4 tensors match the model"), "{out}");
    let row = out.lines().find(|l| l.contains("L1.gate_up_proj.rank1 ")).unwrap();
    assert!(
        row.contains("[128, 256]") && row.contains("blk.1.ffn_gate.weight (Q8_0) + blk.1.ffn_up.weight (Q8_0)"),
        "{row}"
    );
    // Whole (tp 1) gate_up_proj with its halves swapped: shard-order, with the merged-column hint.
    let file = GgufFile::open(repo().join("golden/models/tiny-v3-q8_0.gguf")).unwrap();
    let cfg = MlaConfig::from_gguf(&file).unwrap();
    let lw = LayerWeights::load(&file, &cfg, 1).unwrap();
    let ffn = lw.ffn.as_ref().unwrap();
    let swapped = concatenate(Axis(0), &[ffn.up.view(), ffn.gate.view()]).unwrap();
    let w = vec![(
        "L1.gate_up_proj".to_string(),
        swapped.shape().to_vec(),
        swapped.iter().copied().collect(),
    )];
    let p = write(dir.path(), "swap.safetensors", &w, 1);
    let (code, out, _) = check(&p);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("finding shard-order at L1.gate_up_proj: shard-order [1,0]")
            && out.contains("(shards 0 = gate_proj (128 rows), 1 = up_proj (128 rows))"),
        "{out}"
    );
    assert!(
        out.contains("hint: gate_up_proj must be [gate_proj | up_proj]"),
        "{out}"
    );
}

/// Errors of `doc` against docs/run-report.schema.json.
fn run_schema_errors(doc: &serde_json::Value) -> Vec<String> {
    let schema: serde_json::Value =
        serde_json::from_slice(&std::fs::read(repo().join("docs/run-report.schema.json")).unwrap()).unwrap();
    let v = jsonschema::validator_for(&schema).unwrap();
    v.iter_errors(doc)
        .map(|e| format!("{e} at {}", e.instance_path()))
        .collect()
}

/// `compare` judges a format-2 dump's loaded weights with `weights --check`'s code, before any
/// site: at TP 2 (Q8_0) and TP 4 (Q4_K), every rank holding rank 0's `gate_up_proj` is the
/// dump's first divergence, `tp-rank-order` at rank 1's tensor, though the layer's output
/// diverges too (scaled here); with each rank's own slice and the right output, nothing is
/// found and the report reads as one without weights: the reference records the per-rank
/// `o_proj.rank<r>` partials for the header's `tp.size`.
#[test]
fn compare_names_rank1s_loaded_gate_up_first() {
    for (model, tp) in [("tiny-v3-q8_0.gguf", 2), ("k256-q4_k_m.gguf", 4)] {
        let dir = tempfile::tempdir().unwrap();
        let gguf = repo().join("golden/models").join(model);
        let bug = format2_dump(
            dir.path(),
            model,
            &ffn_weights(model, 0, tp, true),
            Some(tp),
            1.25,
            None,
        );
        let (code, out, err, doc) = crate::common::compare_json(&gguf, &bug, &[]);
        assert_eq!(code, 1, "{model}: {out}\n{err}");
        assert!(
            run_schema_errors(&doc).is_empty(),
            "{model}: {:?}",
            run_schema_errors(&doc)
        );
        let first = &doc["first_divergence"]["dump"];
        assert_eq!(first["tensor"], "L0.gate_up_proj.rank1", "{model}: {first}");
        assert_eq!(first["status"], "fail", "{model}: {first}");
        assert!(first["metrics"]["rel_l2"].as_f64().unwrap() > 1.4, "{model}: {first}");
        assert_eq!(doc["path_status"]["dump"], "divergence");
        let f = &doc["findings"][0];
        assert_eq!(f["class"], "tp-rank-order", "{model}: {f}");
        assert_eq!(f["tensor"], "L0.gate_up_proj.rank1", "{model}: {f}");
        assert!(
            f["evidence"]
                .as_str()
                .unwrap()
                .starts_with("every rank holds rank 0's slice"),
            "{f}"
        );
        assert!(
            f["hint"].as_str().unwrap().contains("`load_merged_column_weight`"),
            "{f}"
        );
        // The activation's own finding follows.
        assert_eq!(doc["findings"][1]["site"], "L0.hidden_out", "{}", doc["findings"]);
        assert!(
            out.contains(
                "dump: first divergence at loaded weight L0.gate_up_proj.rank1 [FAIL rel,cos,norm,elem] (rel_l2 1.4"
            ),
            "{model}: {out}"
        );
        assert!(
            out.contains("; first failing site L0.hidden_out [FAIL"),
            "{model}: {out}"
        );
        assert!(
            out.contains(&format!(
                "== loaded weights · tp {tp} · {} of {} tensors differ from the GGUF (judged by the f32 weight row) ==",
                tp - 1,
                2 * tp
            )),
            "{model}: {out}"
        );
        assert!(
            out.contains(
                "finding [loaded weights] tp-rank-order at L0.gate_up_proj.rank1: every rank holds rank 0's slice"
            ),
            "{model}: {out}"
        );
        // The triage report leads with it and carries the failing loaded weights' table.
        let md = dir.path().join("triage.md");
        let (code, _, err) = run_bin(&[
            "compare",
            "--model",
            gguf.to_str().unwrap(),
            "--dump",
            bug.to_str().unwrap(),
            "--report",
            md.to_str().unwrap(),
            "--quiet",
        ]);
        assert_eq!(code, 1, "{err}");
        let md = std::fs::read_to_string(&md).unwrap();
        assert!(
            md.starts_with(
                "# mla-diff triage: tp-rank-order at loaded weight L0.gate_up_proj.rank1 (+1 more finding(s))\n"
            ),
            "{md}"
        );
        assert!(
            md.contains("First divergence: `loaded weight L0.gate_up_proj.rank1` on dump."),
            "{md}"
        );
        assert!(md.contains("### loaded weights · tp "), "{md}");

        let dir = tempfile::tempdir().unwrap();
        let fixed = format2_dump(
            dir.path(),
            model,
            &ffn_weights(model, 0, tp, false),
            Some(tp),
            1.0,
            None,
        );
        let (code, out, err, doc) = crate::common::compare_json(&gguf, &fixed, &[]);
        assert_eq!(code, 0, "{model}: {out}\n{err}");
        assert!(
            doc["findings"].as_array().unwrap().is_empty(),
            "{model}: {}",
            doc["findings"]
        );
        assert_eq!(doc["first_divergence"]["dump"], serde_json::Value::Null);
        assert!(!out.contains("loaded weight"), "{model}: {out}");
        let sites = doc["sites"].as_array().unwrap();
        for rank in 0..tp {
            let s = sites
                .iter()
                .find(|s| s["site"] == format!("L0.o_proj.rank{rank}"))
                .unwrap();
            assert_eq!(s["status"], "pass", "{model}: {s}");
        }
        assert_eq!(doc["dump"]["metadata"]["tp_size"], tp.to_string());
    }
}

/// A malformed loaded weight in a format-2 dump is `compare`'s exit 2 as it is
/// `weights --check`'s: the same reader.
#[test]
fn compare_refuses_a_malformed_loaded_weight() {
    let model = "tiny-v3-q8_0.gguf";
    let dir = tempfile::tempdir().unwrap();
    let mut w = ffn_weights(model, 0, 2, false);
    let i = w.iter().position(|t| t.0 == "L0.down_proj.rank1").unwrap();
    w[i].1 = vec![w[i].2.len()];
    let p = format2_dump(dir.path(), model, &w, Some(2), 1.0, None);
    let (code, _, err, _) = crate::common::compare_json(&repo().join("golden/models").join(model), &p, &[]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("weights.L0.down_proj.rank1: shape [16384] has 1 dims; `down_proj` has 2"),
        "{err}"
    );
}

/// A transposed `W_UK_T`/`W_UV` with another head count than the model's (unsharded, or a
/// shard whose `tp_size` disagrees with its rank suffix) is a shape mismatch naming both
/// shapes: exit 1, never a panic.
#[test]
fn transposed_absorbed_weights_of_another_head_count_are_a_shape_mismatch() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, _) = absorbed("tiny-v3-q8_0.gguf", 1);
    let [n, l, p, _, v] = cfg.dims().nlprv();
    for (name, shape, tp, want) in [
        ("L1.W_UK_T", vec![n - 2, l, p], 1, vec![n, p, l]),
        ("L1.W_UK_T.rank1", vec![n, l, p], 2, vec![n / 2, p, l]),
        ("L1.W_UV.rank0", vec![n / 2, v, l], 3, vec![n / 3, l, v]),
    ] {
        let len = shape.iter().product();
        let w = vec![(name.to_string(), shape.clone(), vec![0.01f32; len])];
        let path = write(dir.path(), "heads.safetensors", &w, tp);
        let (code, out, err) = check(&path);
        assert_eq!(code, 1, "{name}: {out}\n{err}");
        assert!(!err.contains("panicked"), "{name}: {err}");
        assert!(
            out.contains(&format!(
                "finding mismatch at {name}: shape {shape:?}, expected {want:?}"
            )),
            "{name}: {out}"
        );
    }
}
