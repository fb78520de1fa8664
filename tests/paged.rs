//! The paged KV cache in format-2 dumps: the step fields `page_size`, `s{k}.block_table` and
//! `s{k}.slot_mapping` as the reader checks them (a hostile value is exit 2 naming the file and
//! the field), and `paged-kv` named on an engine's decode steps from the dump's own rows, with the
//! mechanism the replay reproduced, while the same dump with a right cache passes.
//!
//! The dumps are the reference's rows of tiny-v3-f32's layer 1 on one sequence, cut into a
//! prefill and decode steps as an engine runs them; each decode step's `lse` and `attn_out` are
//! computed here (f64, expanded form) over the positions a paged cache with a planted mechanism
//! returns: positions written to the slots the step's block table gives (or a recorded slot
//! mapping), read through the table as the mechanism reads it, a slot nothing was written to
//! read as a zero row (a zeroed cache).

use std::collections::HashMap;

use mla_diff::compute::reference::reference_layer;
use mla_diff::core::batch::{Batch, SeqSpec, normal_f32};
use mla_diff::core::trace::{Site, Stage, Trace};
use mla_diff::model::config::MlaConfig;
use mla_diff::model::dump::{DumpFile, StepPaging};
use mla_diff::model::gguf::GgufFile;
use mla_diff::model::weights::LayerWeights;

use crate::common::{compare_json, repo, write_safetensors};

/// Tokens of the sequence, and how many of them the prefill step computes.
const T: usize = 40;
const PREFILL: usize = 34;
/// The engine's page size and its block table for the sequence (10 pages of 4), shuffled, then
/// padding as vLLM pads a row (block 0).
const PAGE: usize = 4;
const TABLE: [i64; 12] = [7, 2, 9, 0, 5, 1, 8, 3, 6, 4, 0, 0];

const LAYER: usize = 1;

fn model() -> std::path::PathBuf {
    repo().join("golden/models/tiny-v3-f32.gguf")
}

/// The reference trace of tiny-v3-f32's layer 1 on one sequence of [`T`] seeded tokens.
fn reference() -> (GgufFile, MlaConfig, Trace) {
    let file = GgufFile::open(model()).unwrap();
    let cfg = MlaConfig::from_gguf(&file).unwrap();
    let w = LayerWeights::load(&file, &cfg, LAYER).unwrap();
    let batch = Batch {
        seqs: vec![SeqSpec { len: T, start_pos: 0 }],
    };
    let hidden = ndarray::Array2::from_shape_vec(
        (T, cfg.hidden),
        normal_f32(38, T * cfg.hidden).into_iter().map(f64::from).collect(),
    )
    .unwrap();
    let trace = reference_layer(&cfg, &w, &hidden, &batch, 1, None).unwrap().trace;
    (file, cfg, trace)
}

/// A planted cache mechanism: where position `j` is written (`write(j)`, `None`: not written)
/// and which slot a decode reads for it (`read(j)`, `None`: the metadata places no slot).
struct Cache {
    write: fn(usize) -> Option<i64>,
    read: fn(usize) -> Option<i64>,
}

/// The slot of position `j` through [`TABLE`] with page size `p`, block `TABLE[j / p + shift]`
/// (`None` past the recorded row).
fn slot(j: usize, p: usize, shift: usize) -> Option<i64> {
    TABLE.get(j / p + shift).map(|b| b * p as i64 + (j % p) as i64)
}

fn right(j: usize) -> Option<i64> {
    slot(j, PAGE, 0)
}

/// `lse` [N] and `attn_out` [N, V] of the decode of position `c` over positions `0..=c` read
/// through `cache` (the rows of positions `0..=c` written first, a later write to a slot winning).
fn decode(cfg: &MlaConfig, tr: &Trace, c: usize, cache: &Cache) -> (Vec<f32>, Vec<f32>) {
    let [n, _, p, r, v] = cfg.dims().nlprv();
    let get = |st: Stage| tr.get(&Site::new(LAYER, st)).unwrap().to_f64();
    let (q, qpe, kn, vv, kpe) = (
        get(Stage::Q),
        get(Stage::QPeRoped),
        get(Stage::KNope),
        get(Stage::V),
        get(Stage::KPeRoped),
    );
    let mut at: HashMap<i64, usize> = HashMap::new();
    for w in 0..=c {
        if let Some(s) = (cache.write)(w) {
            at.insert(s, w);
        }
    }
    let keys: Vec<Option<usize>> = (0..=c)
        .map(|j| (cache.read)(j).and_then(|s| at.get(&s).copied()))
        .collect();
    let (mut lse, mut out) = (Vec::new(), Vec::new());
    for h in 0..n {
        let z: Vec<f64> = keys
            .iter()
            .map(|k| match k {
                None => 0.0,
                Some(w) => {
                    let a: f64 = (0..p)
                        .map(|d| q[(c * n + h) * (p + r) + d] * kn[(w * n + h) * p + d])
                        .sum();
                    let b: f64 = (0..r).map(|d| qpe[(c * n + h) * r + d] * kpe[w * r + d]).sum();
                    (a + b) * cfg.softmax_scale
                }
            })
            .collect();
        let mx = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = z.iter().map(|x| (x - mx).exp()).collect();
        let sum: f64 = e.iter().sum();
        lse.push((mx + sum.ln()) as f32);
        for d in 0..v {
            let o: f64 = keys
                .iter()
                .zip(&e)
                .filter_map(|(k, ej)| k.map(|w| ej / sum * vv[(w * n + h) * v + d]))
                .sum();
            out.push(o as f32);
        }
    }
    (lse, out)
}

/// What a dump's steps record of the cache, beside the planted mechanism.
#[derive(Clone)]
struct Recorded {
    page_size: Option<serde_json::Value>,
    block_table: Option<(safetensors::Dtype, Vec<usize>, Vec<u8>)>,
    slot_mapping: Option<fn(usize) -> Option<i64>>,
}

impl Recorded {
    /// The engine's metadata as it had it: page size, block table and slot mapping.
    fn all() -> Self {
        Recorded {
            page_size: Some(PAGE.into()),
            block_table: Some(i32_tensor(vec![1, TABLE.len()], &TABLE)),
            slot_mapping: Some(right),
        }
    }
}

fn i32_tensor(shape: Vec<usize>, v: &[i64]) -> (safetensors::Dtype, Vec<usize>, Vec<u8>) {
    let b = v.iter().flat_map(|&x| (x as i32).to_le_bytes()).collect();
    (safetensors::Dtype::I32, shape, b)
}

fn f32_bytes(v: impl IntoIterator<Item = f32>) -> Vec<u8> {
    v.into_iter().flat_map(f32::to_le_bytes).collect()
}

/// The format-2 dump of the reference's rows (prefill of [`PREFILL`] tokens, then one decode step
/// per token), each decode's `lse`/`attn_out` through `cache`, recording `rec`; in a temp dir.
fn dump(cache: &Cache, rec: &Recorded) -> (tempfile::TempDir, std::path::PathBuf) {
    let (file, cfg, tr) = reference();
    let [n, l, p, r, v] = cfg.dims().nlprv();
    let rows = |st: Stage, a: usize, b: usize| -> Vec<u8> {
        let t = tr.get(&Site::new(LAYER, st)).unwrap();
        let per = t.len() / T;
        f32_bytes((a * per..b * per).map(|i| t.get(i) as f32))
    };
    let mut steps = Vec::new();
    let mut tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    let ranges: Vec<(usize, usize)> = std::iter::once((0, PREFILL))
        .chain((PREFILL..T).map(|c| (c, c + 1)))
        .collect();
    let f32 = safetensors::Dtype::F32;
    for (k, &(a, b)) in ranges.iter().enumerate() {
        let mut step = serde_json::json!({
            "name": if k == 0 { "prefill".to_string() } else { format!("decode-{k}") },
            "seqs": [{"new": b - a, "context": a}],
        });
        if let Some(ps) = &rec.page_size {
            step["page_size"] = ps.clone();
        }
        steps.push(step);
        let m = b - a;
        for (st, width) in [
            (Stage::HiddenIn, vec![cfg.hidden]),
            (Stage::Q, vec![n, p + r]),
            (Stage::KvCNormed, vec![l]),
            (Stage::QPeRoped, vec![n, r]),
            (Stage::KPeRoped, vec![r]),
        ] {
            let mut shape = vec![m];
            shape.extend(width);
            tensors.push((format!("s{k}.L{LAYER}.{}", st.name()), f32, shape, rows(st, a, b)));
        }
        let (lse, out) = if k == 0 {
            (rows(Stage::Lse, a, b), rows(Stage::AttnOut, a, b))
        } else {
            let (lse, out) = decode(&cfg, &tr, a, cache);
            (f32_bytes(lse), f32_bytes(out))
        };
        tensors.push((format!("s{k}.L{LAYER}.lse"), f32, vec![m, n], lse));
        tensors.push((format!("s{k}.L{LAYER}.attn_out"), f32, vec![m, n, v], out));
        if let Some((dt, shape, bytes)) = &rec.block_table {
            tensors.push((format!("s{k}.block_table"), *dt, shape.clone(), bytes.clone()));
        }
        if let Some(sm) = rec.slot_mapping {
            let slots: Vec<i64> = (a..b).map(|j| sm(j).unwrap_or(-1)).collect();
            let bytes = slots.iter().flat_map(|x| x.to_le_bytes()).collect();
            tensors.push((format!("s{k}.slot_mapping"), safetensors::Dtype::I64, vec![m], bytes));
        }
    }
    let header = serde_json::json!({
        "model": {
            "file": "tiny-v3-f32.gguf",
            "bytes": file.file_len(),
            "index_sha256": file.index_sha256_hex(),
            "layer_sha256": {LAYER.to_string(): file.layer_sha256_hex(LAYER)},
        },
        "hook": {"name": "tests/paged.rs", "version": "1"},
        "engine": {"name": "paged-cache test", "version": "1"},
        "dtype": "f32",
        "steps": steps,
    });
    let md: HashMap<String, String> = [
        ("format".to_string(), "mla-diff dump 2".to_string()),
        ("header".to_string(), header.to_string()),
    ]
    .into_iter()
    .collect();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("paged.safetensors");
    write_safetensors(&path, &tensors, Some(md));
    (dir, path)
}

const RIGHT: Cache = Cache {
    write: right,
    read: right,
};

/// The cache read and written as its metadata says: the dump passes, the metadata read back as
/// recorded.
#[test]
fn a_right_cache_passes_and_its_metadata_reads_back() {
    let (_d, p) = dump(&RIGHT, &Recorded::all());
    let (code, out, err, doc) = compare_json(&model(), &p, &[]);
    assert_eq!(code, 0, "{out}\n{err}\n{}", doc["findings"]);
    let file = GgufFile::open(model()).unwrap();
    let cfg = MlaConfig::from_gguf(&file).unwrap();
    let DumpFile::Steps(sd) = mla_diff::model::dump::read(&p, None, &cfg).unwrap() else {
        panic!("format 2")
    };
    assert_eq!(sd.paging.len(), 1 + T - PREFILL);
    assert_eq!(
        sd.paging[2],
        StepPaging {
            page_size: Some(PAGE),
            block_table: Some(vec![TABLE.to_vec()]),
            slot_mapping: Some(vec![right(PREFILL + 1).unwrap()]),
        }
    );
    assert_eq!(sd.paging[0].slot_mapping.as_ref().unwrap().len(), PREFILL);
    // Neither is a site nor listed as ignored.
    assert!(sd.ignored.is_empty(), "{:?}", sd.ignored);
}

/// The finding of `cache` recorded as `rec`: class, site and evidence.
fn finding(cache: &Cache, rec: &Recorded) -> (String, String, String) {
    let (_d, p) = dump(cache, rec);
    let (code, out, err, doc) = compare_json(&model(), &p, &[]);
    assert_eq!(code, 1, "{out}\n{err}");
    let f = &doc["findings"][0];
    (
        f["class"].as_str().unwrap().to_string(),
        f["site"].as_str().unwrap().to_string(),
        f["evidence"].as_str().unwrap().to_string(),
    )
}

/// Decodes that read each block-table row one entry further on (the padding block past its
/// end): `paged-kv` at the first decode step's `lse`, the shift named, from the dump's own rows.
#[test]
fn a_block_table_read_one_entry_off_is_paged_kv() {
    let cache = Cache {
        write: right,
        read: |j| slot(j, PAGE, 1),
    };
    let (class, site, ev) = finding(&cache, &Recorded::all());
    assert_eq!((class.as_str(), site.as_str()), ("paged-kv", "L1.lse"), "{ev}");
    assert!(ev.contains("block table shifted by +1 entry (page size 4)"), "{ev}");
    assert!(
        ev.contains("rebuilt from the dump's own kv_c_normed ‖ k_pe_roped rows of this and the earlier steps"),
        "{ev}"
    );
}

/// Rows written one slot early and recorded so (the step's `slot_mapping` as the engine computed
/// it): the recorded slot mapping against the block table.
#[test]
fn a_recorded_slot_mapping_off_its_block_table_is_paged_kv() {
    fn early(j: usize) -> Option<i64> {
        right(j).map(|s| s - 1).filter(|&s| s >= 0)
    }
    let cache = Cache {
        write: early,
        read: right,
    };
    let rec = Recorded {
        slot_mapping: Some(early),
        ..Recorded::all()
    };
    let (class, site, ev) = finding(&cache, &rec);
    assert_eq!((class.as_str(), site.as_str()), ("paged-kv", "L1.lse"), "{ev}");
    assert!(
        ev.contains("rows written where the step's slot_mapping says, which differs from its block table at"),
        "{ev}"
    );
    assert!(ev.contains("rows written 1 slot early"), "{ev}");
}

/// A kernel that reads the cache with page size 1 where the dump recorded no page size and no
/// slot mapping (the block table padded far enough): found by the search, which says the page
/// size was tried.
#[test]
fn an_ignored_page_size_is_found_without_a_recorded_one() {
    fn token_slots(j: usize) -> Option<i64> {
        TABLE.get(j).copied().or(Some(0))
    }
    let cache = Cache {
        write: right,
        read: token_slots,
    };
    let mut padded = TABLE.to_vec();
    padded.resize(T, 0);
    let rec = Recorded {
        page_size: None,
        block_table: Some(i32_tensor(vec![1, T], &padded)),
        slot_mapping: None,
    };
    let (class, site, ev) = finding(&cache, &rec);
    assert_eq!((class.as_str(), site.as_str()), ("paged-kv", "L1.lse"), "{ev}");
    // Without a recorded page size the search takes either side as the metadata's.
    assert!(
        ev.contains("written with page size 4, read with 1 (not recorded: tried)")
            || ev.contains("read with page size 1, written with 4 (not recorded: tried)"),
        "{ev}"
    );
}

/// A hostile paging field: exit 2, one message naming the file and the field.
#[test]
fn hostile_paging_fields_are_input_errors_naming_the_field() {
    let table = |shape: Vec<usize>, v: &[i64]| Some(i32_tensor(shape, v));
    let cases: Vec<(&str, Recorded)> = vec![
        (
            "header.steps[0].page_size",
            Recorded {
                page_size: Some(0.into()),
                ..Recorded::all()
            },
        ),
        (
            "header.steps[0].page_size",
            Recorded {
                page_size: Some("16".into()),
                ..Recorded::all()
            },
        ),
        (
            "header.steps[0].page_size",
            Recorded {
                page_size: Some((1u64 << 40).into()),
                ..Recorded::all()
            },
        ),
        (
            "header.steps[0].page_size",
            Recorded {
                page_size: Some((-4).into()),
                ..Recorded::all()
            },
        ),
        (
            "s0.block_table",
            Recorded {
                block_table: table(vec![2, 6], &TABLE),
                ..Recorded::all()
            },
        ),
        (
            "s0.block_table",
            Recorded {
                block_table: table(vec![1, 3], &[1, -2, 3]),
                ..Recorded::all()
            },
        ),
        (
            "s0.block_table",
            Recorded {
                block_table: Some((safetensors::Dtype::F32, vec![1, 2], f32_bytes([1.0, 2.0]))),
                ..Recorded::all()
            },
        ),
        (
            "s0.slot_mapping",
            Recorded {
                slot_mapping: Some(|_| Some(-7)),
                ..Recorded::all()
            },
        ),
    ];
    for (field, rec) in cases {
        let (_d, p) = dump(&RIGHT, &rec);
        let (code, out, err, _) = compare_json(&model(), &p, &[]);
        assert_eq!(code, 2, "{field}: {out}\n{err}");
        assert!(
            err.contains("paged.safetensors") && err.contains(field),
            "{field}: {err}"
        );
        assert_eq!(err.trim().lines().count(), 1, "{err}");
    }
    // A slot mapping of another length than the step's rows.
    let (_d, p) = dump(&RIGHT, &Recorded::all());
    let bytes = std::fs::read(&p).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let (_, m) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let two = [1i64, 2].iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let mut views: Vec<(String, safetensors::tensor::TensorView<'_>)> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| n != "s1.slot_mapping")
        .collect();
    views.push((
        "s1.slot_mapping".into(),
        safetensors::tensor::TensorView::new(safetensors::Dtype::I64, vec![2], &two).unwrap(),
    ));
    let q = p.with_file_name("paged-len.safetensors");
    std::fs::write(&q, safetensors::serialize(views, m.metadata().clone()).unwrap()).unwrap();
    let (code, out, err, _) = compare_json(&model(), &q, &[]);
    assert_eq!(code, 2, "{out}\n{err}");
    assert!(err.contains("s1.slot_mapping") && err.contains("T = 1"), "{err}");
}
