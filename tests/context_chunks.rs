//! The MHA prefill over cached context in format-2 dumps: the step fields `order`, `kernel`,
//! `prefix`, `context_chunks`, `context_chunk_tokens` and the tensors `seq{i}.token_ids` as the
//! reader checks them (a hostile value is exit 2 naming the file and the field), and `compare`
//! judging each chunk's partial, the merged context, the suffix and the merge against the
//! reference over each request's whole context, a prefix-cache hit's included.
//!
//! The dumps are the reference's rows of tiny-v3-f32's layer 1 on two sequences of different
//! lengths (seeded layer inputs), cut into steps as a chunked-prefill engine runs them; each
//! chunk's partial and each merge is computed here (f64, expanded form) over the keys the
//! header's chunks give.

use std::collections::HashMap;

use mla_diff::compute::reference::reference_layer;
use mla_diff::core::batch::{Batch, SeqSpec, normal_f32};
use mla_diff::core::trace::{Site, Stage, Trace};
use mla_diff::model::config::MlaConfig;
use mla_diff::model::gguf::GgufFile;
use mla_diff::model::weights::LayerWeights;

use crate::common::{compare_json, repo, write_safetensors};

const LAYER: usize = 1;

fn model() -> std::path::PathBuf {
    repo().join("golden/models/tiny-v3-f32.gguf")
}

/// The reference of layer 1 over sequences of `lens` (seeded inputs; sequence 1's first `shared`
/// rows are sequence 0's, as a prefix-cache hit's are).
fn reference(lens: [usize; 2], shared: usize) -> (GgufFile, MlaConfig, Trace) {
    let file = GgufFile::open(model()).unwrap();
    let cfg = MlaConfig::from_gguf(&file).unwrap();
    let w = LayerWeights::load(&file, &cfg, LAYER).unwrap();
    let h = cfg.hidden;
    let t = lens[0] + lens[1];
    let mut x: Vec<f64> = normal_f32(39, t * h).into_iter().map(f64::from).collect();
    for j in 0..shared * h {
        x[lens[0] * h + j] = x[j];
    }
    let batch = Batch {
        seqs: lens.iter().map(|&len| SeqSpec { len, start_pos: 0 }).collect(),
    };
    let hidden = ndarray::Array2::from_shape_vec((t, h), x).unwrap();
    let trace = reference_layer(&cfg, &w, &hidden, &batch, 1, None).unwrap().trace;
    (file, cfg, trace)
}

/// `(out [N·V], lse [N])` of query row `qi` (full-batch row) over the keys `off + keys`.
fn attend(cfg: &MlaConfig, tr: &Trace, qi: usize, off: usize, keys: std::ops::Range<usize>) -> (Vec<f64>, Vec<f64>) {
    let [n, _, p, r, v] = cfg.dims().nlprv();
    let get = |st: Stage| tr.get(&Site::new(LAYER, st)).unwrap().to_f64();
    let (q, qpe, kn, vv, kpe) = (
        get(Stage::Q),
        get(Stage::QPeRoped),
        get(Stage::KNope),
        get(Stage::V),
        get(Stage::KPeRoped),
    );
    let (mut out, mut lse) = (Vec::new(), Vec::new());
    for h in 0..n {
        if keys.is_empty() {
            out.extend(std::iter::repeat_n(0.0, v));
            lse.push(f64::NEG_INFINITY);
            continue;
        }
        let z: Vec<f64> = keys
            .clone()
            .map(|j| {
                let w = off + j;
                let a: f64 = (0..p)
                    .map(|d| q[(qi * n + h) * (p + r) + d] * kn[(w * n + h) * p + d])
                    .sum();
                let b: f64 = (0..r).map(|d| qpe[(qi * n + h) * r + d] * kpe[w * r + d]).sum();
                (a + b) * cfg.softmax_scale
            })
            .collect();
        let mx = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = z.iter().map(|x| (x - mx).exp()).collect();
        let sum: f64 = e.iter().sum();
        lse.push(mx + sum.ln());
        for d in 0..v {
            out.push(
                keys.clone()
                    .zip(&e)
                    .map(|(j, ej)| ej / sum * vv[((off + j) * n + h) * v + d])
                    .sum(),
            );
        }
    }
    (out, lse)
}

/// One sequence's share of a step: new tokens `a..b`, the step's chunks (empty: none listed).
#[derive(Clone)]
struct Share {
    a: usize,
    b: usize,
    chunks: Vec<[usize; 2]>,
    prefix: Option<serde_json::Value>,
    kernel: Option<&'static str>,
}

fn share(a: usize, b: usize) -> Share {
    Share {
        a,
        b,
        chunks: Vec::new(),
        prefix: None,
        kernel: None,
    }
}

/// A planted change to the dump's values of a tensor (by its name, `s1.ctx_lse.c2`, …), made
/// before they are written.
type Plant = dyn Fn(&str, &mut Vec<f64>);

fn f32_bytes(v: &[f64]) -> Vec<u8> {
    v.iter().flat_map(|&x| (x as f32).to_le_bytes()).collect()
}

/// The format-2 dump of `steps` (per step, per sequence its share) over the reference `tr` of
/// sequences `lens`; `extra` adds header fields per step, `plant` changes values before they are
/// written; with token ids `ids` per sequence.
#[allow(clippy::too_many_arguments)]
fn dump(
    file: &GgufFile,
    cfg: &MlaConfig,
    tr: &Trace,
    lens: [usize; 2],
    steps: &[[Share; 2]],
    extra: &dyn Fn(usize, &mut serde_json::Value),
    plant: &Plant,
    ids: Option<[Vec<i64>; 2]>,
) -> (tempfile::TempDir, std::path::PathBuf) {
    let [n, _, _, _, v] = cfg.dims().nlprv();
    let off = [0, lens[0]];
    let rows = |st: Stage, seq: usize, a: usize, b: usize| -> Vec<f64> {
        let t = tr.get(&Site::new(LAYER, st)).unwrap();
        let per = t.len() / (lens[0] + lens[1]);
        ((off[seq] + a) * per..(off[seq] + b) * per).map(|i| t.get(i)).collect()
    };
    let f32 = safetensors::Dtype::F32;
    let mut tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut header_steps = Vec::new();
    for (k, shares) in steps.iter().enumerate() {
        let mut seqs = Vec::new();
        let t: usize = shares.iter().map(|s| s.b - s.a).sum();
        let mut site_vals: HashMap<Stage, Vec<f64>> = HashMap::new();
        for (i, s) in shares.iter().enumerate() {
            let mut q = serde_json::json!({"new": s.b - s.a, "context": s.a});
            if !s.chunks.is_empty() {
                q["context_chunks"] = serde_json::json!(s.chunks);
            }
            if let Some(p) = &s.prefix {
                q["prefix"] = p.clone();
            }
            if let Some(kn) = s.kernel {
                q["kernel"] = kn.into();
            }
            seqs.push(q);
            for st in [Stage::HiddenIn, Stage::Lse, Stage::AttnOut] {
                site_vals.entry(st).or_default().extend(rows(st, i, s.a, s.b));
            }
            if s.chunks.is_empty() || s.a == 0 {
                continue;
            }
            for pos in s.a..s.b {
                let qi = off[i] + pos;
                for (c, &[c0, c1]) in s.chunks.iter().enumerate() {
                    let (o, l) = attend(cfg, tr, qi, off[i], c0..c1);
                    site_vals.entry(Stage::CtxOutChunk(c as u32)).or_default().extend(o);
                    site_vals.entry(Stage::CtxLseChunk(c as u32)).or_default().extend(l);
                }
                for (so, sl, keys) in [
                    (Stage::CtxOut, Stage::CtxLse, 0..s.a),
                    (Stage::SuffixOut, Stage::SuffixLse, s.a..pos + 1),
                ] {
                    let (o, l) = attend(cfg, tr, qi, off[i], keys);
                    site_vals.entry(so).or_default().extend(o);
                    site_vals.entry(sl).or_default().extend(l);
                }
            }
        }
        let mut step = serde_json::json!({"name": format!("step-{k}"), "seqs": seqs});
        extra(k, &mut step);
        header_steps.push(step);
        for (st, mut vals) in site_vals {
            plant(&format!("s{k}.{}", st.name()), &mut vals);
            let rows_n = vals.len()
                / if st == Stage::HiddenIn {
                    cfg.hidden
                } else if st.is_lse() {
                    n
                } else {
                    n * v
                };
            let shape = match st {
                Stage::HiddenIn => vec![t, cfg.hidden],
                s if s.is_lse() => vec![rows_n, n],
                _ => vec![rows_n, n, v],
            };
            tensors.push((format!("s{k}.L{LAYER}.{}", st.name()), f32, shape, f32_bytes(&vals)));
        }
    }
    if let Some(ids) = ids {
        for (i, v) in ids.iter().enumerate() {
            let b = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            tensors.push((format!("seq{i}.token_ids"), safetensors::Dtype::I64, vec![v.len()], b));
        }
    }
    let header = serde_json::json!({
        "model": {
            "file": "tiny-v3-f32.gguf",
            "bytes": file.file_len(),
            "index_sha256": file.index_sha256_hex(),
            "layer_sha256": {LAYER.to_string(): file.layer_sha256_hex(LAYER)},
        },
        "hook": {"name": "tests/context_chunks.rs", "version": "1"},
        "engine": {"name": "chunked-context test", "version": "1"},
        "dtype": "f32",
        "steps": header_steps,
    });
    let md: HashMap<String, String> = [
        ("format".to_string(), "mla-diff dump 2".to_string()),
        ("header".to_string(), header.to_string()),
    ]
    .into_iter()
    .collect();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("chunked.safetensors");
    write_safetensors(&path, &tensors, Some(md));
    (dir, path)
}

/// Two prompts of 16 and 11 tokens, prefilled in two steps (8 and 5 tokens, then the rest over
/// the cached context in 3 chunks of up to 3 tokens, the shorter's last chunk empty), then one
/// decode step each.
const LENS: [usize; 2] = [16, 11];

fn chunked_steps() -> Vec<[Share; 2]> {
    let with = |mut s: Share, chunks: &[[usize; 2]]| {
        s.chunks = chunks.to_vec();
        s.kernel = Some("prefill");
        s
    };
    vec![
        [share(0, 8), share(0, 5)],
        [
            with(share(8, 15), &[[0, 3], [3, 6], [6, 8]]),
            with(share(5, 10), &[[0, 3], [3, 5], [5, 5]]),
        ],
        [share(15, 16), share(10, 11)],
    ]
}

fn chunked_extra(k: usize, step: &mut serde_json::Value) {
    if k == 1 {
        step["context_chunk_tokens"] = 3.into();
        step["order"] = serde_json::json!([1, 0]);
    }
    if k == 2 {
        step["seqs"][0]["kernel"] = "decode".into();
        step["seqs"][1]["kernel"] = "decode".into();
    }
}

fn no_plant(_: &str, _: &mut Vec<f64>) {}

/// Every chunk's partial, the merges and the decodes right: exit 0, every context partial
/// judged (none listed as not dumped), the empty chunk's −inf LSE matching the reference's.
#[test]
fn a_clean_chunked_context_dump_passes_with_every_partial_judged() {
    let (file, cfg, tr) = reference(LENS, 0);
    let (_d, p) = dump(
        &file,
        &cfg,
        &tr,
        LENS,
        &chunked_steps(),
        &chunked_extra,
        &no_plant,
        None,
    );
    let (code, out, err, doc) = compare_json(&model(), &p, &[]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert_eq!(doc["findings"], serde_json::json!([]), "{out}");
    let step1: Vec<&serde_json::Value> = doc["sites"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["step"] == "step-1")
        .collect();
    let sites: Vec<&str> = step1.iter().map(|s| s["site"].as_str().unwrap()).collect();
    for want in [
        "L1.ctx_out.c0",
        "L1.ctx_lse.c2",
        "L1.ctx_out",
        "L1.ctx_lse",
        "L1.suffix_out",
        "L1.suffix_lse",
        "L1.attn_out",
    ] {
        assert!(sites.contains(&want), "{want}: {sites:?}");
    }
    let pos = |s: &str| sites.iter().position(|x| *x == s).unwrap();
    assert!(pos("L1.lse") < pos("L1.ctx_out.c0") && pos("L1.ctx_lse.c2") < pos("L1.ctx_out"));
    assert!(pos("L1.suffix_lse") < pos("L1.attn_out"));
    let c2 = step1.iter().find(|s| s["site"] == "L1.ctx_lse.c2").unwrap();
    assert_eq!(c2["status"], "pass", "{c2}");
    let not_dumped = doc["dump"]["not_dumped"].to_string();
    assert!(!not_dumped.contains("ctx_"), "{not_dumped}");
}

/// A prefix-cache hit: sequence 1's first 8 positions are sequence 0's (same token ids), its
/// prefill reads them from the cache; judged over its whole context: exit 0.
#[test]
fn a_prefix_cache_hit_is_judged_over_the_whole_context() {
    let lens = [13, 13];
    let (file, cfg, tr) = reference(lens, 8);
    let mut hit = share(8, 12);
    hit.prefix = Some(serde_json::json!({"seq": 0, "len": 8}));
    hit.chunks = vec![[0, 8]];
    hit.kernel = Some("prefill");
    let steps = vec![
        [share(0, 12), share(0, 0)],
        [share(12, 12), hit],
        [share(12, 13), share(12, 13)],
    ];
    let ids0: Vec<i64> = (0..13).map(|x| 3 + 5 * x).collect();
    let mut ids1 = ids0.clone();
    ids1[10] = 1;
    let none = |_: usize, _: &mut serde_json::Value| {};
    let (_d, p) = dump(
        &file,
        &cfg,
        &tr,
        lens,
        &steps,
        &none,
        &no_plant,
        Some([ids0.clone(), ids1.clone()]),
    );
    let (code, out, err, _) = compare_json(&model(), &p, &[]);
    assert_eq!(code, 0, "{out}\n{err}");
    // Token ids that differ inside the hit: exit 2 naming the prefix.
    let mut bad = ids1;
    bad[3] = 2;
    let (_d, p) = dump(&file, &cfg, &tr, lens, &steps, &none, &no_plant, Some([ids0, bad]));
    let (code, _, err, _) = compare_json(&model(), &p, &[]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("steps[1].seqs[1].prefix") && err.contains("position 3"),
        "{err}"
    );
}

/// Token counts that add up to the tensors' rows only by wrapping past 2⁶⁴ (the last step's
/// two `new` of 2⁶³ + 1 each sum to its true T = 2), or a context near 2⁶⁴: exit 2, one line
/// naming the file and the field, never a panic or a runaway allocation.
#[test]
fn header_token_counts_that_wrap_are_input_errors_naming_the_field() {
    let (file, cfg, tr) = reference(LENS, 0);
    type Edit = fn(&mut serde_json::Value);
    let cases: Vec<(&str, Edit)> = vec![
        ("steps[2].seqs[1].new", |s| {
            s["seqs"][0]["new"] = ((1u64 << 63) + 1).into();
            s["seqs"][1]["new"] = ((1u64 << 63) + 1).into();
        }),
        ("steps[2].seqs[0].context", |s| {
            s["seqs"][0]["context"] = u64::MAX.into()
        }),
    ];
    for (field, edit) in cases {
        let extra = |k: usize, s: &mut serde_json::Value| {
            chunked_extra(k, s);
            if k == 2 {
                edit(s);
            }
        };
        let (_d, p) = dump(&file, &cfg, &tr, LENS, &chunked_steps(), &extra, &no_plant, None);
        let (code, out, err, _) = compare_json(&model(), &p, &[]);
        assert_eq!(code, 2, "{field}: {out}\n{err}");
        assert!(!err.contains("panicked"), "{field}: {err}");
        assert!(
            err.contains("chunked.safetensors") && err.contains(field),
            "{field}: {err}"
        );
        assert_eq!(err.trim().lines().count(), 1, "{err}");
    }
}

/// A hostile value of each new field: exit 2, one line naming the file and the field.
#[test]
fn hostile_context_fields_are_input_errors_naming_the_field() {
    let (file, cfg, tr) = reference(LENS, 0);
    type Edit = fn(&mut serde_json::Value);
    let cases: Vec<(&str, Edit)> = vec![
        ("steps[1].order", |s| s["order"] = serde_json::json!([0, 0])),
        ("steps[1].order", |s| s["order"] = serde_json::json!([0, 1, 2])),
        ("steps[1].order", |s| s["order"] = serde_json::json!("01")),
        ("steps[1].seqs[0].kernel", |s| s["seqs"][0]["kernel"] = "mha".into()),
        ("steps[1].seqs[0].kernel", |s| s["seqs"][0]["kernel"] = 1.into()),
        ("steps[1].context_chunk_tokens", |s| {
            s["context_chunk_tokens"] = 0.into()
        }),
        ("steps[1].seqs[0].prefix", |s| {
            s["seqs"][0]["prefix"] = serde_json::json!({"seq": 0, "len": 2})
        }),
        ("steps[1].seqs[0].prefix", |s| {
            s["seqs"][0]["prefix"] = serde_json::json!({"seq": 1, "len": -2})
        }),
        ("steps[1].seqs[0].prefix", |s| {
            s["seqs"][0]["prefix"] = serde_json::json!({"seq": 9, "len": 2})
        }),
        ("steps[1].seqs[0].context_chunks", |s| {
            s["seqs"][0]["context_chunks"] = serde_json::json!([[0, 3], [2, 8]])
        }),
        ("steps[1].seqs[0].context_chunks", |s| {
            s["seqs"][0]["context_chunks"] = serde_json::json!([[0, 3], [3, 9]])
        }),
        ("steps[1].seqs[1].context_chunks", |s| {
            s["seqs"][0]["context_chunks"] = serde_json::json!([[0, 8]])
        }),
        ("steps[1].seqs[0].context_chunks", |s| {
            s["seqs"][0]["context_chunks"] = serde_json::json!([[0, 1e30]])
        }),
        ("steps[1].seqs[0].context_chunks", |s| {
            s["seqs"][0]["context_chunks"] = serde_json::json!(vec![[0, 0]; 5000])
        }),
        ("steps[1].seqs[1].context_chunks", |s| {
            s["seqs"][0]["context_chunks"] = serde_json::json!([[0, 3], [3, 8]])
        }),
        ("steps[1].seqs[0].context_chunks", |s| {
            s["seqs"][0]["kernel"] = "decode".into()
        }),
    ];
    for (field, edit) in cases {
        let extra = |k: usize, s: &mut serde_json::Value| {
            chunked_extra(k, s);
            if k == 1 {
                edit(s);
            }
        };
        let (_d, p) = dump(&file, &cfg, &tr, LENS, &chunked_steps(), &extra, &no_plant, None);
        let (code, out, err, _) = compare_json(&model(), &p, &[]);
        assert_eq!(code, 2, "{field}: {out}\n{err}");
        assert!(
            err.contains("chunked.safetensors") && err.contains(field),
            "{field}: {err}"
        );
        assert_eq!(err.trim().lines().count(), 1, "{err}");
    }
    // Token ids of a sequence the header lacks, or of another length.
    for (ids, name) in [
        ([vec![1; 16], vec![1; 12]], "seq1.token_ids"),
        ([vec![1; 16], vec![-1; 11]], "seq1.token_ids"),
    ] {
        let (_d, p) = dump(
            &file,
            &cfg,
            &tr,
            LENS,
            &chunked_steps(),
            &chunked_extra,
            &no_plant,
            Some(ids),
        );
        let (code, _, err, _) = compare_json(&model(), &p, &[]);
        assert_eq!(code, 2, "{err}");
        assert!(err.contains(name), "{err}");
    }
}

/// Step 1's values of the clean chunked dump, by the plant's names (`s1.ctx_out.c1`, …).
fn clean_step1(file: &GgufFile, cfg: &MlaConfig, tr: &Trace) -> HashMap<String, Vec<f64>> {
    let seen = std::rc::Rc::new(std::cell::RefCell::new(HashMap::new()));
    let into = seen.clone();
    let record = move |name: &str, vals: &mut Vec<f64>| {
        if name.starts_with("s1.") {
            into.borrow_mut().insert(name.to_string(), vals.clone());
        }
    };
    let _ = dump(file, cfg, tr, LENS, &chunked_steps(), &chunked_extra, &record, None);
    seen.take()
}

/// The chunked dump with `plant`: exit code and the first finding's class, site and evidence,
/// with the step its site first fails in.
fn planted(file: &GgufFile, cfg: &MlaConfig, tr: &Trace, plant: &Plant) -> (i32, [String; 4]) {
    let (_d, p) = dump(file, cfg, tr, LENS, &chunked_steps(), &chunked_extra, plant, None);
    let (code, out, err, doc) = compare_json(&model(), &p, &[]);
    let f = &doc["findings"][0];
    let s = |v: &serde_json::Value| v.as_str().unwrap_or_else(|| panic!("{out}\n{err}")).to_string();
    let site = s(&f["site"]);
    let step = doc["sites"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["site"] == site.as_str() && r["status"] != "pass")
        .map_or(String::new(), |r| s(&r["step"]));
    (code, [s(&f["class"]), site, step, s(&f["evidence"])])
}

/// Step 1's Tc rows: sequence 0's 7 new tokens, then sequence 1's 5, whose chunk 2 is empty.
const TC0: usize = 7;
const TC: usize = 12;

/// An empty context chunk's LSE +inf (FlashAttention-2's sentinel), or 0, where the reference
/// has −inf: `lse-merge` at that chunk's LSE, naming the chunk, the sequence, the rows and the
/// value.
#[test]
fn an_empty_chunks_lse_sentinel_is_lse_merge_at_the_chunk() {
    let (file, cfg, tr) = reference(LENS, 0);
    let n = cfg.n_head;
    for (value, says) in [(f64::INFINITY, "all +inf"), (0.0, "all 0")] {
        let plant = move |name: &str, vals: &mut Vec<f64>| {
            if name == "s1.ctx_lse.c2" {
                assert!(vals[TC0 * n..].iter().all(|&v| v == f64::NEG_INFINITY));
                vals[TC0 * n..].fill(value);
            }
        };
        let (code, [class, site, step, ev]) = planted(&file, &cfg, &tr, &plant);
        assert_eq!(code, 1, "{ev}");
        assert_eq!(
            (class.as_str(), site.as_str(), step.as_str()),
            ("lse-merge", "L1.ctx_lse.c2", "step-1"),
            "{ev}"
        );
        let rows = (TC - TC0) * n;
        assert!(
            ev.contains("chunk 2 holds no key for sequence(s) [1]")
                && ev.contains(&format!("{rows} of their {rows} (token, head) rows hold {says}")),
            "{ev}"
        );
    }
}

/// The partials `outs` [Tc, N, V] merged by their LSEs `lses` [Tc, N] (natural-log rule):
/// `(out, lse)`.
fn merge(outs: &[&[f64]], lses: &[Vec<f64>], v: usize) -> (Vec<f64>, Vec<f64>) {
    let ls: Vec<&[f64]> = lses.iter().map(Vec::as_slice).collect();
    mla_diff::compute::reference::context::merge_partials(outs, &ls, v)
}

/// The chunks' merge taking an empty chunk's −inf as +inf (NaN where it merges), and the final
/// merge reading the suffix's LSE in base 2: `lse-merge` at the merge, replayed from the
/// partials that passed.
#[test]
fn a_merge_replayed_from_passing_partials_names_the_sentinel_or_the_log_base() {
    let (file, cfg, tr) = reference(LENS, 0);
    let v = cfg.v_head_dim;
    let clean = clean_step1(&file, &cfg, &tr);
    let g = |k: &str| clean[&format!("s1.{k}")].clone();
    // The chunks merged with the empty chunk's LSE +inf.
    let mut l2 = g("ctx_lse.c2");
    for x in l2.iter_mut().filter(|x| **x == f64::NEG_INFINITY) {
        *x = f64::INFINITY;
    }
    let (o0, o1, o2) = (g("ctx_out.c0"), g("ctx_out.c1"), g("ctx_out.c2"));
    let (ctx_out, ctx_lse) = merge(&[&o0, &o1, &o2], &[g("ctx_lse.c0"), g("ctx_lse.c1"), l2], v);
    assert!(ctx_out.iter().any(|x| x.is_nan()) && ctx_out.iter().any(|x| x.is_finite()));
    let plant = move |name: &str, vals: &mut Vec<f64>| match name {
        "s1.ctx_out" => vals.clone_from(&ctx_out),
        "s1.ctx_lse" => vals.clone_from(&ctx_lse),
        _ => {}
    };
    let (code, [class, site, step, ev]) = planted(&file, &cfg, &tr, &plant);
    assert_eq!(code, 1, "{ev}");
    assert_eq!(
        (class.as_str(), site.as_str(), step.as_str()),
        ("lse-merge", "L1.ctx_out", "step-1"),
        "{ev}"
    );
    assert!(
        ev.contains("every empty chunk merged with LSE +inf instead of −inf") && ev.contains("NaN"),
        "{ev}"
    );
    // The final merge with the suffix's LSE in base 2.
    let suffix_lse: Vec<f64> = g("suffix_lse").iter().map(|x| x / std::f64::consts::LN_2).collect();
    let (so, co) = (g("suffix_out"), g("ctx_out"));
    let (out, _) = merge(&[&co, &so], &[g("ctx_lse"), suffix_lse], v);
    let plant = move |name: &str, vals: &mut Vec<f64>| {
        if name == "s1.attn_out" {
            assert_eq!(vals.len(), out.len());
            vals.clone_from(&out);
        }
    };
    let (code, [class, site, step, ev]) = planted(&file, &cfg, &tr, &plant);
    assert_eq!(code, 1, "{ev}");
    assert_eq!(
        (class.as_str(), site.as_str(), step.as_str()),
        ("lse-merge", "L1.attn_out", "step-1"),
        "{ev}"
    );
    assert!(
        ev.contains("the suffix (suffix_lse)'s LSE in base 2, the other natural"),
        "{ev}"
    );
}

/// The final merge reading the suffix, held padded to V + 16 per head, with the context's head
/// stride V: `strided-view` at `attn_out`, both strides named.
#[test]
fn a_merge_reading_the_suffix_with_the_prefixs_head_stride_is_strided_view() {
    let (file, cfg, tr) = reference(LENS, 0);
    let (n, v) = (cfg.n_head, cfg.v_head_dim);
    let clean = clean_step1(&file, &cfg, &tr);
    let g = |k: &str| clean[&format!("s1.{k}")].clone();
    let (suffix, ctx) = (g("suffix_out"), g("ctx_out"));
    let s = v + 16;
    let mut padded = vec![0.0; TC * n * s];
    for th in 0..TC * n {
        padded[th * s..th * s + v].copy_from_slice(&suffix[th * v..(th + 1) * v]);
    }
    let read = padded[..TC * n * v].to_vec();
    let (out, _) = merge(&[&ctx, &read], &[g("ctx_lse"), g("suffix_lse")], v);
    let plant = move |name: &str, vals: &mut Vec<f64>| {
        if name == "s1.attn_out" {
            vals.clone_from(&out);
        }
    };
    let (code, [class, site, step, ev]) = planted(&file, &cfg, &tr, &plant);
    assert_eq!(code, 1, "{ev}");
    assert_eq!(
        (class.as_str(), site.as_str(), step.as_str()),
        ("strided-view", "L1.attn_out", "step-1"),
        "{ev}"
    );
    assert!(
        ev.contains(&format!("the suffix's output, held with head stride {s} (V+16"))
            && ev.contains(&format!("read with head stride {v} (V)"))
            && ev.contains("padding read as 0"),
        "{ev}"
    );
}

/// Context chunk 1's output never written for sequence 0's rows: stale floats (seeded, far
/// outside what attention gives), or zeros: `phantom-output` at `ctx_out.c1`, with the count.
#[test]
fn a_context_chunk_never_written_is_phantom_output_at_the_chunk() {
    let (file, cfg, tr) = reference(LENS, 0);
    let (n, v) = (cfg.n_head, cfg.v_head_dim);
    let rows = TC0 * n;
    let stale: Vec<f64> = normal_f32(41, rows * v)
        .into_iter()
        .map(|x| 50.0 * f64::from(x))
        .collect();
    for (fill, says) in [
        (
            stale,
            "sampled (token, head) rows lie outside the range of the value rows".to_string(),
        ),
        (
            vec![0.0; rows * v],
            format!("{rows} of its {} (token, head) rows with keys are all 0", TC * n),
        ),
    ] {
        let plant = move |name: &str, vals: &mut Vec<f64>| {
            if name == "s1.ctx_out.c1" {
                vals[..rows * v].copy_from_slice(&fill);
            }
        };
        let (code, [class, site, step, ev]) = planted(&file, &cfg, &tr, &plant);
        assert_eq!(code, 1, "{ev}");
        assert_eq!(
            (class.as_str(), site.as_str(), step.as_str()),
            ("phantom-output", "L1.ctx_out.c1", "step-1"),
            "{ev}"
        );
        assert!(
            ev.contains("context chunk 1: ") && ev.contains(&says) && ev.contains("ctx_lse.c1 and ctx_out.c0 passed"),
            "{ev}"
        );
    }
}
