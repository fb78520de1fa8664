//! `run --export-inputs` on a DSA layer (`glm-dsa`, `deepseek32`): the exported selection is the
//! reference's, in vLLM's two index layouts (per-request positions and global cache slots); the
//! expected `attn_latent` / `lse` are the f64 attention of the exported query and cache over
//! that selection (recomputed here to 1e-12) and the reference's own to f32 rounding; and a
//! kernel's dump of them passes `compare`, while one that attended to every key fails.

use std::collections::BTreeMap;
use std::path::Path;

use mla_diff::core::batch::{Batch, SeqSpec};
use mla_diff::core::st::ExtraTensor;
use mla_diff::core::trace::{Site, Stage, Trace};
use mla_diff::model::config::MlaConfig;
use mla_diff::model::gguf::GgufFile;
use mla_diff::model::weights::LayerWeights;

use crate::common::{compare_json, repo, run_bin, write_safetensors};

/// An export read back: tensors widened to f64, and metadata.
struct Export {
    t: BTreeMap<String, ExtraTensor>,
    meta: BTreeMap<String, String>,
}

impl Export {
    fn get(&self, name: &str) -> &ExtraTensor {
        self.t.get(name).unwrap_or_else(|| panic!("{name} missing"))
    }

    fn ints(&self, name: &str) -> Vec<i64> {
        self.get(name).data.iter().map(|&x| x as i64).collect()
    }
}

/// `mla-diff run --quiet --path mha ARGS --export-inputs DIR` (exit 0 asserted), read back.
fn export(model: &Path, args: &[&str], dir: &Path) -> Export {
    let mut a = vec![
        "run",
        "--quiet",
        "--path",
        "mha",
        "--model",
        model.to_str().unwrap(),
        "--export-inputs",
        dir.to_str().unwrap(),
    ];
    a.extend_from_slice(args);
    let (code, out, err) = run_bin(&a);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("kernel inputs: wrote"), "{out}");
    let f = mla_diff::core::st::read(&dir.join("inputs.safetensors")).unwrap();
    Export {
        t: f.extra,
        meta: f.metadata,
    }
}

/// The reference of `layer` on the export's `hidden_in` (seeded random inputs are f32 values, so
/// this is the run's own reference): its trace and selection.
fn reference(file: &GgufFile, cfg: &MlaConfig, layer: usize, ex: &Export) -> (Batch, Trace, Vec<Vec<usize>>) {
    let seqs: Vec<usize> = ex.meta["seqs"].split(',').map(|s| s.parse().unwrap()).collect();
    let batch = Batch {
        seqs: seqs.iter().map(|&len| SeqSpec { len, start_pos: 0 }).collect(),
    };
    let h = ex.get("hidden_in");
    let hidden = ndarray::Array2::from_shape_vec((h.shape[0], h.shape[1]), h.data.clone()).unwrap();
    let w = LayerWeights::load(file, cfg, layer).unwrap();
    let r = mla_diff::compute::reference::reference_layer(cfg, &w, &hidden, &batch, 1, None).unwrap();
    let sel = r.selection.expect("a DSA layer's reference records its selection").rows;
    (batch, r.trace, sel)
}

/// Softmax attention in f64 of every (row, head) of `q` [T, nh, W] over the cache rows of its
/// slots (`cache` viewed as [slots, W]): (latent [T·nh·L], lse [T·nh]).
fn attend(q: &ExtraTensor, cache: &ExtraTensor, slots: &[Vec<usize>], l: usize, scale: f64) -> (Vec<f64>, Vec<f64>) {
    let (t, nh, w) = (q.shape[0], q.shape[1], q.shape[2]);
    let mut lat = Vec::with_capacity(t * nh * l);
    let mut lse = Vec::with_capacity(t * nh);
    for (i, keys) in slots.iter().enumerate().take(t) {
        for h in 0..nh {
            let qr = &q.data[(i * nh + h) * w..(i * nh + h + 1) * w];
            let z: Vec<f64> = keys
                .iter()
                .map(|&s| {
                    scale
                        * qr.iter()
                            .zip(&cache.data[s * w..(s + 1) * w])
                            .map(|(a, b)| a * b)
                            .sum::<f64>()
                })
                .collect();
            let m = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = z.iter().map(|x| (x - m).exp()).collect();
            let sum: f64 = e.iter().sum();
            let mut o = vec![0f64; l];
            for (p, &s) in e.iter().zip(keys) {
                for (oc, kc) in o.iter_mut().zip(&cache.data[s * w..s * w + l]) {
                    *oc += p / sum * kc;
                }
            }
            lat.extend(o);
            lse.push(m + sum.ln());
        }
    }
    (lat, lse)
}

fn max_abs(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
}

fn rel_l2(a: &[f64], b: &[f64]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    (num / den).sqrt()
}

/// Heads `a..b` of the reference site `stage` ([T, N, X] or [T, N]), flattened.
fn heads_of(tr: &Trace, layer: usize, stage: Stage, n: usize, (a, b): (usize, usize)) -> Vec<f64> {
    let t = tr.get(&Site::new(layer, stage)).unwrap();
    let x = t.len() / (t.shape[0] * n);
    let all = t.to_f64();
    (0..t.shape[0])
        .flat_map(|i| all[(i * n + a) * x..(i * n + b) * x].to_vec())
        .collect()
}

/// `sparse.indices` of an export: row i's keys through its block table, −1 after them, each slot
/// holding its key's `kv_c_normed ‖ k_pe_roped` (rounded to f32) in `decode.kv_cache`. Returns the
/// slots per row.
fn check_slots(
    ex: &Export,
    batch: &Batch,
    tr: &Trace,
    layer: usize,
    sel: &[Vec<usize>],
    (top_k, l, r): (usize, usize, usize),
    model: &str,
) -> Vec<Vec<usize>> {
    let page: usize = ex.meta["page_size"].parse().unwrap();
    let table = ex.get("decode.block_table");
    let mb = table.shape[1];
    let slots = ex.ints("sparse.indices");
    let cache = ex.get("decode.kv_cache");
    let kv_c = tr.get(&Site::new(layer, Stage::KvCNormed)).unwrap().to_f64();
    let k_pe = tr.get(&Site::new(layer, Stage::KPeRoped)).unwrap().to_f64();
    let offsets = batch.offsets();
    let seq_of: Vec<usize> = (0..batch.seqs.len())
        .flat_map(|s| std::iter::repeat_n(s, batch.seqs[s].len))
        .collect();
    let mut slot_rows = Vec::with_capacity(sel.len());
    for (i, row) in sel.iter().enumerate() {
        let mut keys = Vec::new();
        for (c, &p) in row.iter().enumerate() {
            let s = slots[i * top_k + c];
            assert_eq!(
                s,
                table.data[i * mb + p / page] as i64 * page as i64 + (p % page) as i64
            );
            let s = s as usize;
            let j = offsets[seq_of[i]] + p;
            let want: Vec<f64> = kv_c[j * l..(j + 1) * l]
                .iter()
                .chain(&k_pe[j * r..(j + 1) * r])
                .map(|&x| f64::from(x as f32))
                .collect();
            assert_eq!(
                &cache.data[s * (l + r)..(s + 1) * (l + r)],
                &want[..],
                "{model}: slot {s}"
            );
            keys.push(s);
        }
        assert!(slots[i * top_k + row.len()..(i + 1) * top_k].iter().all(|&s| s == -1));
        slot_rows.push(keys);
    }
    slot_rows
}

/// The selection, both index layouts, the valid counts, the metadata and the expected outputs
/// of a DSA export, on a GLM full layer (three sequences, pages of 4) and a DeepSeek-V3.2 layer
/// (rank 1 of TP 2): rows longer than `K_idx` keep a strict subset of their keys, so the test
/// sees a real selection.
#[test]
fn dsa_export_holds_the_reference_selection_and_its_attention() {
    let cases: [(&str, usize, &[&str]); 2] = [
        (
            "dsa-glm-f32.gguf",
            1,
            &["--layer", "1", "--seqs", "1,12,20", "--page-size", "4"],
        ),
        (
            "dsa-v32-f32.gguf",
            1,
            &[
                "--layer",
                "1",
                "--seqs",
                "9,23",
                "--page-size",
                "16",
                "--tp",
                "2",
                "--rank",
                "1",
                "--seed",
                "5",
            ],
        ),
    ];
    for (model, layer, args) in cases {
        let path = repo().join("golden/models").join(model);
        let dir = tempfile::tempdir().unwrap();
        let ex = export(&path, args, dir.path());
        let file = GgufFile::open(&path).unwrap();
        let cfg = MlaConfig::from_gguf(&file).unwrap();
        let top_k = cfg.indexer.as_ref().unwrap().top_k;
        let (batch, tr, sel) = reference(&file, &cfg, layer, &ex);
        let t = batch.n_tokens();
        let (l, r) = (cfg.kv_lora_rank, cfg.qk_rope_head_dim);
        let heads: Vec<usize> = ex.meta["heads"].split(',').map(|x| x.parse().unwrap()).collect();
        let (a, b) = (heads[0], heads[1]);
        assert_eq!(ex.meta["index_topk"], top_k.to_string(), "{model}");
        for gone in ["prefill.q", "prefill.k", "prefill.v", "prefill.cu_seqlens"] {
            assert!(!ex.t.contains_key(gone), "{model}: a DSA export has no {gone}");
        }
        assert!(
            sel.iter()
                .any(|row| row.len() == top_k && row.last() > Some(&(top_k - 1))),
            "{model}: no row is sparse"
        );

        // Per-request positions: the reference's selection, ascending, −1 after the valid ones.
        let pos = ex.ints("sparse.topk_indices");
        assert_eq!(ex.get("sparse.topk_indices").shape, vec![t, top_k]);
        let lengths = ex.ints("sparse.topk_length");
        for (i, row) in sel.iter().enumerate() {
            let want: Vec<i64> = row
                .iter()
                .map(|&p| p as i64)
                .chain(std::iter::repeat(-1))
                .take(top_k)
                .collect();
            assert_eq!(&pos[i * top_k..(i + 1) * top_k], &want[..], "{model}: row {i}");
            assert_eq!(lengths[i], row.len() as i64, "{model}: row {i}");
        }

        // Global slots: through the row's block table, and the slot holds that key's cache row.
        let slot_rows = check_slots(&ex, &batch, &tr, layer, &sel, (top_k, l, r), model);
        // Expected outputs: recomputed from the exported tensors to 1e-12, and the reference's
        // own attn_latent / lse to the f32 rounding of the inputs.
        let scale: f64 = ex.meta["softmax_scale"].parse().unwrap();
        assert_eq!(scale, cfg.softmax_scale);
        let (lat, lse) = attend(ex.get("decode.q"), ex.get("decode.kv_cache"), &slot_rows, l, scale);
        let exp_lat = &ex.get("sparse.expected_latent").data;
        let exp_lse = &ex.get("sparse.expected_lse").data;
        assert_eq!(ex.get("sparse.expected_latent").shape, vec![t, b - a, l]);
        assert!(
            max_abs(&lat, exp_lat) < 1e-12,
            "{model}: latent {}",
            max_abs(&lat, exp_lat)
        );
        assert!(
            max_abs(&lse, exp_lse) < 1e-12,
            "{model}: lse {}",
            max_abs(&lse, exp_lse)
        );
        let n = cfg.n_head;
        let ref_lat = heads_of(&tr, layer, Stage::AttnLatent, n, (a, b));
        let ref_lse = heads_of(&tr, layer, Stage::Lse, n, (a, b));
        assert!(
            rel_l2(exp_lat, &ref_lat) < 1e-6,
            "{model}: {}",
            rel_l2(exp_lat, &ref_lat)
        );
        assert!(
            rel_l2(exp_lse, &ref_lse) < 1e-6,
            "{model}: {}",
            rel_l2(exp_lse, &ref_lse)
        );
    }
}

/// A sparse kernel's dump of the export (its `dump_header` completed, `attn_latent` and `lse` in
/// bf16): the expected outputs pass `compare` under the bf16 rows; the same kernel attending to
/// every causal key instead of the selection fails at `attn_latent`.
#[test]
fn compare_judges_a_sparse_kernel_dump_of_the_export() {
    let path = repo().join("golden/models/dsa-glm-f32.gguf");
    let layer = 1;
    let dir = tempfile::tempdir().unwrap();
    let ex = export(
        &path,
        &["--layer", "1", "--seqs", "3,21", "--page-size", "8", "--seed", "2"],
        dir.path(),
    );
    let l = 64;
    let dump = |name: &str, lat: &[f64], lse: &[f64]| {
        use safetensors::Dtype as D;
        let bf16 = |v: &[f64]| -> Vec<u8> { v.iter().flat_map(|&x| half::bf16::from_f64(x).to_le_bytes()).collect() };
        let h = ex.get("hidden_in");
        let t = h.shape[0];
        let nh = lse.len() / t;
        let tensors = [
            (
                format!("s0.L{layer}.hidden_in"),
                D::F32,
                h.shape.clone(),
                h.data.iter().flat_map(|&x| (x as f32).to_le_bytes()).collect(),
            ),
            (format!("s0.L{layer}.attn_latent"), D::BF16, vec![t, nh, l], bf16(lat)),
            (format!("s0.L{layer}.lse"), D::BF16, vec![t, nh], bf16(lse)),
        ];
        let mut header: serde_json::Value = serde_json::from_str(&ex.meta["dump_header"]).unwrap();
        header["engine"] =
            serde_json::json!({"name": "test-sparse", "version": "1", "attention_backend": "FLASHMLA_SPARSE"});
        header["hook"] = serde_json::json!({"name": "tests/dsa_export.rs", "version": "1"});
        header["dtype"] = "bf16".into();
        header["kernel_precision"] = "bf16".into();
        let meta: std::collections::HashMap<String, String> = [
            ("format".to_string(), "mla-diff dump 2".to_string()),
            ("header".to_string(), header.to_string()),
        ]
        .into_iter()
        .collect();
        let p = dir.path().join(format!("{name}.safetensors"));
        write_safetensors(&p, &tensors, Some(meta));
        p
    };
    let clean = dump(
        "clean",
        &ex.get("sparse.expected_latent").data,
        &ex.get("sparse.expected_lse").data,
    );
    let (code, out, err, doc) = compare_json(&path, &clean, &[]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert_eq!(doc["dump"]["tolerance_rows"], "bf16");

    // Every causal key of the row, through the row's block table (what a dense kernel reads).
    let table = ex.get("decode.block_table");
    let lens = ex.ints("decode.cache_seqlens");
    let page: usize = ex.meta["page_size"].parse().unwrap();
    let mb = table.shape[1];
    let dense: Vec<Vec<usize>> = (0..lens.len())
        .map(|i| {
            (0..lens[i] as usize)
                .map(|p| table.data[i * mb + p / page] as usize * page + p % page)
                .collect()
        })
        .collect();
    let scale: f64 = ex.meta["softmax_scale"].parse().unwrap();
    let (lat, lse) = attend(ex.get("decode.q"), ex.get("decode.kv_cache"), &dense, l, scale);
    let wrong = dump("dense", &lat, &lse);
    let (code, out, err, doc) = compare_json(&path, &wrong, &[]);
    assert_eq!(code, 1, "{out}\n{err}");
    let failed: Vec<&str> = doc["sites"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["status"] != "pass")
        .map(|s| s["site"].as_str().unwrap())
        .collect();
    assert!(failed.contains(&"L1.attn_latent"), "{failed:?}\n{out}");
}
