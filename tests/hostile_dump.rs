//! Hostile format-2 dumps: a corpus generated from a committed dump
//! (`golden/dumps/plants/legacy-kvb-q8_0.clean-short.safetensors`, two steps of two sequences on
//! `legacy-kvb-q8_0.gguf`), mutated in its header JSON (types, numbers, missing and extra
//! fields, nesting, sizes), its safetensors index (dtypes, shapes, offsets, the header length),
//! truncated, and flipped byte by byte (seeded).
//!
//! Every case runs in process under `catch_unwind` through what `compare` does (the dump reader,
//! the identity check, the comparison) and what `weights --check` does: no panic, and the
//! counting allocator of `tests/hostile.rs` bounds what it holds at once ([`ALLOC_BOUND`]). An
//! error names the file, and a header case's error names its field. A sample goes through the
//! binary: exit 2 with exactly one stderr line `mla-diff: error: FILE: …`, or a verdict (0 or 1).
//!
//! Beside the corpus, the promises the corpus cannot state: token ids judged against
//! `hidden_in`, per-step ignored names, TP rank names, special files, `weights --check`'s header.
//!
//! `cargo test --release --test tests hostile_dump:: -- --nocapture` prints the per-category
//! summary.

use std::collections::BTreeMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::sync::atomic::Ordering;

use serde_json::{Value, json};

use crate::common::{compare_json, repo, run_bin};
use crate::hostile::{CURRENT, PEAK, panic_message, serial};
use mla_diff::model::config::MlaConfig;
use mla_diff::model::dump::{self, DumpFile};
use mla_diff::model::gguf::GgufFile;

/// The base dump: 94 KB, format 2, two steps (a prefill of 5 + 2 tokens, a decode of 1 + 1).
const BASE: &str = "golden/dumps/plants/legacy-kvb-q8_0.clean-short.safetensors";
/// Its GGUF.
const MODEL: &str = "golden/models/legacy-kvb-q8_0.gguf";
/// A dump of the same model with loaded weights (`weights.L0.…`), for `weights --check`.
const WITH_WEIGHTS: &str = "golden/dumps/legacy-kvb-q8_0.vllm.safetensors";

/// The most bytes one case may hold at once in process (reading a 94 KB dump, the reference of
/// one layer of a 4-head, H = 128 model over at most 8 rows, the diagnosis): measured at a few
/// MiB; 256 MiB leaves room and still catches any allocation sized from a hostile number.
const ALLOC_BOUND: usize = 256 << 20;

/// A safetensors file taken apart: its JSON index (with `__metadata__`) and its data bytes.
#[derive(Clone)]
struct St {
    index: Value,
    data: Vec<u8>,
}

impl St {
    fn read(path: &Path) -> St {
        let b = std::fs::read(path).unwrap();
        let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
        St {
            index: serde_json::from_slice(&b[8..8 + n]).unwrap(),
            data: b[8 + n..].to_vec(),
        }
    }

    /// The file: index JSON padded with spaces to 8 bytes, then the data.
    fn bytes(&self) -> Vec<u8> {
        with_index(&serde_json::to_vec(&self.index).unwrap(), &self.data)
    }

    /// The format-2 header (`__metadata__.header`, parsed).
    fn header(&self) -> Value {
        serde_json::from_str(self.index["__metadata__"]["header"].as_str().unwrap()).unwrap()
    }

    fn with_header(mut self, h: &Value) -> St {
        self.index["__metadata__"]["header"] = Value::String(h.to_string());
        self
    }

    /// The header with `f` applied.
    fn map_header(self, f: impl FnOnce(&mut Value)) -> St {
        let mut h = self.header();
        f(&mut h);
        self.with_header(&h)
    }

    /// The bytes of tensor `name`.
    fn tensor(&self, name: &str) -> Vec<u8> {
        let o = &self.index[name]["data_offsets"];
        self.data[o[0].as_u64().unwrap() as usize..o[1].as_u64().unwrap() as usize].to_vec()
    }

    /// Appends tensor `name` (its bytes at the end of the data).
    fn add(mut self, name: &str, dtype: &str, shape: &[usize], bytes: &[u8]) -> St {
        let at = self.data.len();
        self.data.extend_from_slice(bytes);
        self.index[name] = json!({"dtype": dtype, "shape": shape, "data_offsets": [at, at + bytes.len()]});
        self
    }
}

/// A safetensors image of index JSON `index` (padded with spaces to 8 bytes) and `data`.
fn with_index(index: &[u8], data: &[u8]) -> Vec<u8> {
    let mut idx = index.to_vec();
    while !idx.len().is_multiple_of(8) {
        idx.push(b' ');
    }
    let mut out = (idx.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&idx);
    out.extend_from_slice(data);
    out
}

/// One corpus case.
struct Case {
    cat: &'static str,
    name: String,
    bytes: Vec<u8>,
    /// A header field the case changed (`steps[0].seqs[1].new`): an error must name it (its
    /// last key at least).
    field: Option<String>,
}

/// The JSON pointer `/steps/0/seqs/1/new` as the field path `steps[0].seqs[1].new`.
fn field_path(ptr: &str) -> String {
    let mut out = String::new();
    for part in ptr.trim_start_matches('/').split('/') {
        if part.parse::<usize>().is_ok() {
            out.push_str(&format!("[{part}]"));
        } else {
            if !out.is_empty() {
                out.push('.');
            }
            out.push_str(part);
        }
    }
    out
}

/// The last key of a field path (`new` of `steps[0].seqs[1].new`, `steps` of `steps[0]`).
fn leaf(field: &str) -> &str {
    let last = field.rsplit('.').next().unwrap_or(field);
    last.split('[').next().unwrap_or(last)
}

/// Deterministic xorshift64*.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// The header fields the corpus retypes and removes (JSON pointers into the format-2 header).
const HEADER_FIELDS: &[&str] = &[
    "/model",
    "/model/file",
    "/model/bytes",
    "/model/index_sha256",
    "/model/layer_sha256",
    "/model/layer_sha256/0",
    "/hook",
    "/engine",
    "/engine/name",
    "/dtype",
    "/conventions",
    "/conventions/rope_order",
    "/conventions/layout",
    "/conventions/kv_a_order",
    "/conventions/lse_base",
    "/conventions/residual_scale",
    "/steps",
    "/steps/0",
    "/steps/0/name",
    "/steps/0/seqs",
    "/steps/0/seqs/0",
    "/steps/0/seqs/0/new",
    "/steps/0/seqs/1/context",
    "/steps/1/seqs/1/context",
    "/steps/1/num_kv_splits",
    "/steps/0/page_size",
    "/patches",
    "/patches/0/name",
];

/// Fields that may be added to a header with a hostile value (absent from the base).
const OPTIONAL_FIELDS: &[&str] = &[
    "/tp",
    "/heads",
    "/kernel_precision",
    "/indexer_quant",
    "/steps/0/order",
    "/steps/0/context_chunk_tokens",
    "/steps/0/seqs/0/kernel",
    "/steps/0/seqs/0/prefix",
    "/steps/0/seqs/0/unrecorded",
    "/steps/0/seqs/0/context_chunks",
];

/// Hostile JSON values: other types, negative, huge, wrapping and fractional numbers, NaN as a
/// string, deep nesting, a long array.
fn hostile_values() -> Vec<(&'static str, Value)> {
    let mut deep = json!(1);
    for _ in 0..100 {
        deep = json!([deep]);
    }
    vec![
        ("string", json!("x")),
        ("nan-string", json!("NaN")),
        ("negative", json!(-1)),
        ("i64-min", json!(i64::MIN)),
        ("u64-max", json!(u64::MAX)),
        ("u32-wrap", json!(1u64 << 32)),
        ("huge-float", json!(1e300)),
        ("fraction", json!(2.5)),
        ("zero", json!(0)),
        ("null", Value::Null),
        ("bool", json!(true)),
        ("empty-array", json!([])),
        ("object", json!({"a": 1})),
        ("deep", deep),
        ("long-array", Value::Array(vec![json!(7); 100_000])),
    ]
}

fn set_ptr(h: &mut Value, ptr: &str, v: Value) {
    let (parent, key) = ptr.rsplit_once('/').unwrap();
    let p = if parent.is_empty() {
        Some(h)
    } else {
        h.pointer_mut(parent)
    };
    match p {
        Some(Value::Object(o)) => {
            o.insert(key.to_string(), v);
        }
        Some(Value::Array(a)) => {
            if let Some(slot) = key.parse::<usize>().ok().and_then(|i| a.get_mut(i)) {
                *slot = v;
            }
        }
        _ => panic!("no parent for {ptr}"),
    }
}

fn remove_ptr(h: &mut Value, ptr: &str) {
    let (parent, key) = ptr.rsplit_once('/').unwrap();
    let p = if parent.is_empty() {
        Some(h)
    } else {
        h.pointer_mut(parent)
    };
    match p {
        Some(Value::Object(o)) => {
            o.remove(key);
        }
        Some(Value::Array(a)) => {
            if let Ok(i) = key.parse::<usize>() {
                a.remove(i);
            }
        }
        _ => panic!("no parent for {ptr}"),
    }
}

#[allow(
    clippy::too_many_lines,
    reason = "one list of cases, category after category, each a few lines"
)]
fn corpus() -> Vec<Case> {
    let base = St::read(&repo().join(BASE));
    let mut cases = Vec::new();
    let mut add = |cat: &'static str, name: String, bytes: Vec<u8>, field: Option<String>| {
        cases.push(Case {
            cat,
            name,
            bytes,
            field,
        });
    };
    add("legal", "base".into(), base.bytes(), None);
    // Header fields retyped.
    for ptr in HEADER_FIELDS.iter().chain(OPTIONAL_FIELDS) {
        for (vname, v) in hostile_values() {
            let st = base.clone().map_header(|h| set_ptr(h, ptr, v));
            add(
                "header-type",
                format!("{ptr} = {vname}"),
                st.bytes(),
                Some(field_path(ptr)),
            );
        }
    }
    // Header fields removed.
    for ptr in HEADER_FIELDS {
        let st = base.clone().map_header(|h| remove_ptr(h, ptr));
        add(
            "header-missing",
            format!("{ptr} removed"),
            st.bytes(),
            Some(field_path(ptr)),
        );
    }
    // Extra fields (ignored, or named).
    for ptr in ["/extra", "/steps/0/extra", "/steps/0/seqs/0/extra", "/model/extra"] {
        let st = base.clone().map_header(|h| set_ptr(h, ptr, json!({"x": [1, 2]})));
        add("header-extra", format!("{ptr} added"), st.bytes(), None);
    }
    // The header as a whole.
    let mut deep = String::new();
    for _ in 0..100_000 {
        deep.push('[');
    }
    let many_seqs: Vec<Value> = (0..100_000).map(|_| json!({"new": 1, "context": 0})).collect();
    let many_steps: Vec<Value> = (0..20_000)
        .map(|k| json!({"name": format!("s{k}"), "seqs": [{"new": 1, "context": k}]}))
        .collect();
    for (name, text) in [
        ("not json", "{broken".to_string()),
        ("deep nesting", deep),
        ("a number", "7".to_string()),
        ("empty", String::new()),
        (
            "100k sequences",
            base.header()
                .as_object()
                .map(|o| {
                    let mut o = o.clone();
                    o["steps"] = json!([{"name": "p", "seqs": many_seqs}]);
                    Value::Object(o).to_string()
                })
                .unwrap(),
        ),
        (
            "20k steps",
            base.header()
                .as_object()
                .map(|o| {
                    let mut o = o.clone();
                    o["steps"] = Value::Array(many_steps.clone());
                    Value::Object(o).to_string()
                })
                .unwrap(),
        ),
    ] {
        let mut st = base.clone();
        st.index["__metadata__"]["header"] = Value::String(text);
        add("header-whole", name.into(), st.bytes(), Some("header".into()));
    }
    for (name, f) in [
        (
            "header missing",
            Box::new(|m: &mut Value| m.as_object_mut().unwrap().remove("header").map(|_| ()))
                as Box<dyn Fn(&mut Value) -> Option<()>>,
        ),
        (
            "header a number",
            Box::new(|m: &mut Value| {
                m["header"] = json!(7);
                Some(())
            }),
        ),
        (
            "format a number",
            Box::new(|m: &mut Value| {
                m["format"] = json!(2);
                Some(())
            }),
        ),
        (
            "format 3",
            Box::new(|m: &mut Value| {
                m["format"] = json!("mla-diff dump 3");
                Some(())
            }),
        ),
        (
            "metadata an array",
            Box::new(|m: &mut Value| {
                *m = json!([1]);
                Some(())
            }),
        ),
    ] {
        let mut st = base.clone();
        f(&mut st.index["__metadata__"]);
        add("metadata", name.into(), st.bytes(), None);
    }
    // The safetensors index: dtypes, shapes, offsets.
    let t = "s0.L0.q";
    for dt in ["I32", "F64", "BF16", "BOOL", "U8", "XX", "F8_E4M3"] {
        let mut st = base.clone();
        st.index[t]["dtype"] = json!(dt);
        add("st-dtype", format!("{t} dtype {dt}"), st.bytes(), None);
    }
    for (name, shape) in [
        ("one more column", json!([7, 4, 49])),
        ("scalar", json!([])),
        ("zero rows", json!([0, 4, 48])),
        ("u64 max", json!([u64::MAX, 1])),
        ("wrapping product", json!([1u64 << 32, 1u64 << 32, 4])),
        ("negative", json!([-7, 4, 48])),
        ("flattened", json!([7, 192])),
        ("head-major", json!([4, 7, 48])),
        ("string", json!("7,4,48")),
    ] {
        let mut st = base.clone();
        st.index[t]["shape"] = shape;
        add("st-shape", format!("{t} shape {name}"), st.bytes(), None);
    }
    let end = base.data.len() as u64;
    for (name, off) in [
        ("reversed", json!([16128, 10752])),
        ("past the end", json!([end, end + 5376])),
        ("u64 max", json!([u64::MAX - 1, u64::MAX])),
        ("overlapping", json!([10000, 15376])),
        ("three", json!([10752, 16128, 1])),
        ("negative", json!([-1, 5375])),
    ] {
        let mut st = base.clone();
        st.index[t]["data_offsets"] = off;
        add("st-offsets", format!("{t} offsets {name}"), st.bytes(), None);
    }
    for name in ["s0.tokens", "s0.positions", "s0.block_table", "s1.slot_mapping"] {
        for dt in ["F32", "I8", "U64"] {
            let mut st = base.clone();
            let o = st.index[name]["data_offsets"].clone();
            let len = o[1].as_u64().unwrap() - o[0].as_u64().unwrap();
            let width = match dt {
                "I8" => 1,
                "F32" => 4,
                _ => 8,
            };
            st.index[name]["dtype"] = json!(dt);
            st.index[name]["shape"] = json!([len / width]);
            add("st-ids", format!("{name} as {dt}"), st.bytes(), None);
        }
    }
    // Id tensors with hostile values.
    let tokens_at = |st: &St, name: &str| {
        let o = &st.index[name]["data_offsets"];
        o[0].as_u64().unwrap() as usize
    };
    for (name, v) in [
        ("s0.tokens", -1i64),
        ("s0.tokens", i64::MAX),
        ("s0.positions", -5),
        ("s0.positions", i64::MAX),
        ("s1.slot_mapping", i64::MIN),
        ("s1.slot_mapping", 1 << 50),
    ] {
        let mut st = base.clone();
        let at = tokens_at(&st, name);
        st.data[at..at + 8].copy_from_slice(&v.to_le_bytes());
        add("id-values", format!("{name}[0] = {v}"), st.bytes(), None);
    }
    // The 8-byte header length.
    let good = base.bytes();
    let hlen = u64::from_le_bytes(good[..8].try_into().unwrap());
    for (name, n) in [
        ("zero", 0u64),
        ("seven", 7),
        ("one past the file", good.len() as u64 - 7),
        ("u64 max", u64::MAX),
        ("2^63", 1 << 63),
        ("one short", hlen - 1),
    ] {
        let mut b = good.clone();
        b[..8].copy_from_slice(&n.to_le_bytes());
        add("length", format!("header length {name}"), b, None);
    }
    // Truncations.
    for cut in [
        0,
        3,
        8,
        9,
        100,
        hlen as usize + 8,
        hlen as usize + 9 + 4000,
        good.len() - 1,
    ] {
        add("truncated", format!("cut at {cut}"), good[..cut].to_vec(), None);
    }
    // Seeded byte flips: the index (JSON made invalid or values changed) and the data.
    let mut rng = Rng(0x6d6c_612d_6469_6666);
    for i in 0..80 {
        let mut b = good.clone();
        let in_index = i % 2 == 0;
        let flips = 1 + (rng.next() % 4) as usize;
        for _ in 0..flips {
            let at = if in_index {
                8 + (rng.next() % hlen) as usize
            } else {
                8 + hlen as usize + (rng.next() % (good.len() as u64 - 8 - hlen)) as usize
            };
            b[at] ^= 1 << (rng.next() % 8);
        }
        add(
            if in_index { "flip-index" } else { "flip-data" },
            format!("flip {i}"),
            b,
            None,
        );
    }
    cases
}

/// What one case gave in process: `Ok(Some(error))`, `Ok(None)` for a verdict, `Err(panic)`.
struct InProcess {
    compare: Result<Option<String>, String>,
    weights: Result<Option<String>, String>,
    peak: usize,
}

/// `compare` and `weights --check` on the dump at `path`, as the binary runs them.
fn in_process(file: &GgufFile, cfg: &MlaConfig, path: &Path) -> InProcess {
    let before = CURRENT.load(Ordering::SeqCst);
    PEAK.store(before, Ordering::SeqCst);
    let compare = catch_unwind(AssertUnwindSafe(|| -> Option<String> {
        let run = || -> mla_diff::core::error::Result<()> {
            match dump::read(path, None, cfg)? {
                DumpFile::One(d) => {
                    mla_diff::jobs::compare::compare_dump(file, cfg, &d, None, None, None)?;
                }
                DumpFile::Steps(sd) => {
                    let mut layers: Vec<usize> = sd.steps.iter().flat_map(|(_, d)| d.layers.keys().copied()).collect();
                    layers.sort_unstable();
                    layers.dedup();
                    dump::check_identity(path, &sd.header, file, &layers)?;
                    mla_diff::jobs::compare::compare_steps(file, cfg, &sd, None, None, None)?;
                }
            }
            Ok(())
        };
        run().err().map(|e| e.to_string())
    }))
    .map_err(|p| panic_message(&*p));
    let weights = catch_unwind(AssertUnwindSafe(|| {
        mla_diff::jobs::weights_check::check(file, cfg, path, None)
            .err()
            .map(|e| e.to_string())
    }))
    .map_err(|p| panic_message(&*p));
    let peak = PEAK.load(Ordering::SeqCst).saturating_sub(before);
    InProcess { compare, weights, peak }
}

fn case_file(i: usize, cat: &str) -> String {
    format!("hostile-dump-{i:03}-{cat}.safetensors")
}

/// The corpus in process: no panic, peak allocation within [`ALLOC_BOUND`], every error naming
/// the file and, for a header case, its field; then a sample through the binary.
#[test]
fn dump_corpus_never_panics_names_the_field_and_stays_bounded() {
    let _g = serial();
    let started = std::time::Instant::now();
    let file = GgufFile::open(repo().join(MODEL)).unwrap();
    let cfg = MlaConfig::from_gguf(&file).unwrap();
    let corpus = corpus();
    assert!(corpus.len() >= 500, "only {} cases", corpus.len());
    let dir = tempfile::tempdir().unwrap();
    let mut fails = Vec::new();
    // Per category: cases, compare errors, compare verdicts, weights errors, peak.
    let mut summary: BTreeMap<&str, (usize, usize, usize, usize, usize)> = BTreeMap::new();
    let mut max_peak = 0;
    let mut paths = Vec::new();
    for (i, c) in corpus.iter().enumerate() {
        let fname = case_file(i, c.cat);
        let path = dir.path().join(&fname);
        std::fs::write(&path, &c.bytes).unwrap();
        let r = in_process(&file, &cfg, &path);
        let e = summary.entry(c.cat).or_default();
        e.0 += 1;
        e.4 = e.4.max(r.peak);
        max_peak = max_peak.max(r.peak);
        if r.peak > ALLOC_BOUND {
            fails.push(format!("[alloc] {}: peak {} bytes", c.name, r.peak));
        }
        for (what, res) in [("compare", &r.compare), ("weights", &r.weights)] {
            match res {
                Err(p) => fails.push(format!("[panic] {what} {}: {p}", c.name)),
                Ok(Some(err)) => {
                    if what == "compare" {
                        e.1 += 1;
                    } else {
                        e.3 += 1;
                    }
                    if !err.contains(&fname) {
                        fails.push(format!("[names-file] {what} {}: {err}", c.name));
                    }
                    if err.contains('\n') {
                        fails.push(format!("[one-line] {what} {}: {err:?}", c.name));
                    }
                    // A header error names a field: the one changed, or the one the change broke
                    // (`steps[1].seqs[0].context` after `steps[0].seqs[0].new`), never only
                    // the header. A legal value may meet another refusal (weights --check of a
                    // dump without weights): no header error then.
                    if let Some(f) = &c.field {
                        // The message past the file's name (which holds the category).
                        let msg = err.rsplit(&fname).next().unwrap_or(err);
                        let names_field = msg.contains(leaf(f))
                            || msg.contains("__metadata__.header.")
                            || msg.contains("header.model.")
                            || !msg.contains("header");
                        if !names_field {
                            fails.push(format!("[names-field {f}] {what} {}: {err}", c.name));
                        }
                    }
                }
                Ok(None) => {
                    if what == "compare" {
                        e.2 += 1;
                    }
                }
            }
        }
        paths.push(path);
    }
    let in_process_s = started.elapsed().as_secs_f64();
    // A sample through the binary: every 25th case, both commands.
    let model = repo().join(MODEL);
    let mut bin_runs = 0;
    for (i, c) in corpus.iter().enumerate().filter(|(i, _)| i % 25 == 0) {
        let p = paths[i].to_str().unwrap();
        let fname = case_file(i, c.cat);
        for args in [
            vec!["compare", "--model", model.to_str().unwrap(), "--dump", p, "--quiet"],
            vec!["weights", "--check", p, "--model", model.to_str().unwrap()],
        ] {
            bin_runs += 1;
            let (code, _out, err) = run_bin(&args);
            let lines: Vec<&str> = err.lines().collect();
            let ok = match code {
                0 | 1 => !err.contains("panicked"),
                2 => {
                    lines.len() == 1 && lines[0].starts_with(&format!("mla-diff: error: {p}: "))
                        || lines.len() == 1 && lines[0].starts_with("mla-diff: error: ") && lines[0].contains(&fname)
                }
                _ => false,
            };
            if !ok {
                fails.push(format!("[binary] {} {}: exit {code}, stderr {err:?}", args[0], c.name));
            }
        }
    }
    println!(
        "hostile dumps: {} cases in process in {in_process_s:.1} s (peak {:.1} MiB of {} MiB allowed), {bin_runs} binary runs, {:.1} s in all",
        corpus.len(),
        max_peak as f64 / (1 << 20) as f64,
        ALLOC_BOUND >> 20,
        started.elapsed().as_secs_f64()
    );
    println!("category         cases  compare-err  verdict  weights-err  peak-MiB");
    for (cat, (n, ce, cv, we, pk)) in &summary {
        println!(
            "{cat:<16} {n:>5}  {ce:>11}  {cv:>7}  {we:>11}  {:>8.1}",
            *pk as f64 / (1 << 20) as f64
        );
    }
    assert!(fails.is_empty(), "{} failure(s):\n{}", fails.len(), fails.join("\n"));
    // The mutations of the data that keep the file well formed are judged, not refused.
    assert!(summary["flip-data"].2 > 0, "no data flip reached a verdict");
}

/// Runs `compare` on `st` written to a temporary file: (exit code, stdout, stderr, JSON report).
fn compare_st(st: &St) -> (i32, String, String, Value, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("d.safetensors");
    std::fs::write(&p, st.bytes()).unwrap();
    let (code, out, err, doc) = compare_json(&repo().join(MODEL), &p, &[]);
    (code, out, err, doc, dir)
}

/// Every token id changed (+1) in every step of a format-2 dump: its `hidden_in` rows are no
/// longer the embedding of its tokens, and `compare` says so at `L0.hidden_in` (exit 1), as it
/// does for format 1, with a hint naming the tokens and `token_embd`; the dump as committed
/// passes.
#[test]
fn changing_every_token_id_of_a_format2_dump_is_found() {
    let base = St::read(&repo().join(BASE));
    let (code, out, err, _, _d) = compare_st(&base);
    assert_eq!(code, 0, "the committed dump passes:\n{out}\n{err}");
    let mut st = base.clone();
    for name in ["s0.tokens", "s1.tokens"] {
        let o = st.index[name]["data_offsets"].clone();
        let (a, b) = (o[0].as_u64().unwrap() as usize, o[1].as_u64().unwrap() as usize);
        for c in st.data[a..b].chunks_mut(8) {
            let v = i64::from_le_bytes(c.try_into().unwrap());
            c.copy_from_slice(&((v + 1) % 100).to_le_bytes());
        }
    }
    let (code, out, err, doc, _d) = compare_st(&st);
    assert_eq!(code, 1, "{out}\n{err}");
    let first = &doc["first_divergence"]["dump"];
    assert_eq!(first["site"], "L0.hidden_in", "{}", doc["first_divergence"]);
    let finding = out
        .lines()
        .find(|l| l.starts_with("finding [dump]"))
        .unwrap_or_default();
    assert!(finding.contains("at L0.hidden_in in prefill"), "{out}");
    // layer 0's hint speaks of the tokens and the embedding, not of a previous layer
    let hint = out
        .lines()
        .find(|l| l.trim_start().starts_with("hint:"))
        .unwrap_or_default();
    assert!(
        hint.contains("layer 0's hidden_in is embed(tokens)")
            && hint.contains("token_embd")
            && !hint.contains("previous layer"),
        "{out}"
    );
}

/// Text a dump carries is printed: a step name, a patch name, a metadata value or a tensor name
/// holding a newline or an escape sequence (which could forge "all sites within tolerance" lines
/// or hide the verdict) is exit 2 naming the field and the code point, never printed; a
/// `model.file` that is a path is refused before any file is opened.
#[test]
fn dump_text_is_plain_and_model_file_a_bare_name() {
    let base = St::read(&repo().join(BASE));
    let forged = "decode-1\n\ndump: all 24 sites within tolerance\u{1b}[8m".to_string();
    let cases: Vec<(St, &str)> = vec![
        (
            base.clone()
                .map_header(|h| h["steps"][0]["name"] = Value::String(forged.clone())),
            "__metadata__.header.steps[0].name: holds the control character U+000A",
        ),
        (
            base.clone()
                .map_header(|h| h["engine"]["name"] = Value::String("vllm\u{1b}[8m".into())),
            "__metadata__.header.engine.name: holds the control character U+001B",
        ),
        (
            {
                let mut st = base.clone();
                st.index["__metadata__"]["note"] = Value::String("a\rb".into());
                st
            },
            "__metadata__.note: holds the control character U+000D",
        ),
        (
            {
                let q = base.tensor("s1.L0.q");
                base.clone().add("s1.L0.q\nforged", "F32", &[2, 4, 48], &q)
            },
            "tensor \"s1.L0.q\\nforged\": holds the control character U+000A",
        ),
    ];
    for (st, want) in cases {
        let (code, out, err, _, _d) = compare_st(&st);
        assert_eq!(code, 2, "{out}\n{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(
            err.starts_with("mla-diff: error: ") && err.contains(want),
            "want {want:?}:\n{err}"
        );
        assert!(!out.contains("within tolerance"), "{out}");
    }
    // model.file names the GGUF beside the dump, as a bare name: a path is refused unopened
    let d = tempfile::tempdir().unwrap();
    for file in ["/etc/passwd", "../../../etc/passwd", "models/x.gguf", ".."] {
        let st = base
            .clone()
            .map_header(|h| h["model"]["file"] = Value::String(file.into()));
        let p = d.path().join("d.safetensors");
        std::fs::write(&p, st.bytes()).unwrap();
        let (code, _, err) = crate::common::run_bin(&["compare", "--dump", p.to_str().unwrap()]);
        assert_eq!(code, 2, "{file}: {err}");
        assert!(
            err.contains("__metadata__.header.model.file") && err.contains("bare file name") && !err.contains("root"),
            "{file}: {err}"
        );
    }
}

/// A misspelled site inside a step and an unknown step tensor are listed as ignored with their
/// step; the sites `run --tp` names a rank's partial (`o_proj.rank0`, `ffn_down.rank1`) are listed
/// as ignored with the reason, not judged against a reference that has none (exit 0).
#[test]
fn unknown_and_rank_names_inside_a_step_are_listed_ignored() {
    let base = St::read(&repo().join(BASE));
    let q = base.tensor("s1.L0.q");
    let o = base.tensor("s0.L0.o_proj");
    let st = base
        .clone()
        .add("s1.L0.q_nopee", "F32", &[2, 4, 48], &q)
        .add("s0.L0.o_proj.rank0", "F32", &[7, 128], &o)
        .add("s0.L0.ffn_down.rank1", "F32", &[7, 128], &o)
        .add("s0.extra", "F32", &[2, 4, 48], &q);
    let (code, out, err, doc, _d) = compare_st(&st);
    assert_eq!(code, 0, "{out}\n{err}");
    let ignored: Vec<&str> = doc["dump"]["ignored"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(ignored.contains(&"s1.L0.q_nopee"), "{ignored:?}");
    assert!(ignored.contains(&"s0.extra"), "{ignored:?}");
    for rank in ["s0.L0.o_proj.rank0", "s0.L0.ffn_down.rank1"] {
        let line = ignored
            .iter()
            .find(|l| l.starts_with(&format!("{rank} (")))
            .unwrap_or_else(|| panic!("{rank} not listed: {ignored:?}"));
        assert!(line.contains("TP rank"), "{line}");
    }
    assert_eq!(ignored.len(), 4, "{ignored:?}");
}

/// Special files (a device, a FIFO, a folder) given as any input are refused by name and kind
/// before any read: exit 2, one line.
#[test]
fn special_files_are_refused_before_any_read() {
    let model = repo().join(MODEL);
    let m = model.to_str().unwrap();
    let base = repo().join(BASE);
    let b = base.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .is_ok_and(|s| s.success());
    let fifo_s = fifo.to_str().unwrap().to_string();
    let d = dir.path().to_str().unwrap().to_string();
    let mut cases: Vec<(Vec<&str>, String)> = vec![
        (
            vec!["compare", "--model", m, "--dump", "/dev/zero"],
            "/dev/zero: not a regular file (a character device)".into(),
        ),
        (
            vec!["compare", "--model", m, "--dump", b, "--map", "/dev/zero"],
            "/dev/zero: not a regular file (a character device)".into(),
        ),
        (
            vec!["compare", "--model", "/dev/zero", "--dump", b],
            "/dev/zero: not a regular file (a character device)".into(),
        ),
        (
            vec!["weights", "--check", "/dev/zero", "--model", m],
            "/dev/zero: not a regular file (a character device)".into(),
        ),
        (
            vec!["compare", "--model", m, "--dump", &d],
            format!("{d}: not a regular file (a directory)"),
        ),
    ];
    if made {
        cases.push((
            vec!["compare", "--model", m, "--dump", &fifo_s],
            format!("{fifo_s}: not a regular file (a FIFO)"),
        ));
        cases.push((
            vec!["weights", "--check", &fifo_s, "--model", m],
            format!("{fifo_s}: not a regular file (a FIFO)"),
        ));
    }
    for (args, want) in &cases {
        let (code, out, err) = run_bin(args);
        assert_eq!(code, 2, "{args:?}: {out}{err}");
        assert_eq!(err.trim_end(), format!("mla-diff: error: {want}"), "{args:?}");
    }
}

/// `weights --check` reads a format-2 header as `compare` does: a broken header, a field of the
/// wrong type, another model's identity and a missing identity are refused (exit 2, one line
/// naming the field).
#[test]
fn weights_check_refuses_a_broken_or_foreign_header() {
    let base = St::read(&repo().join(WITH_WEIGHTS));
    let model = repo().join(MODEL);
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("w.safetensors");
    let ps = p.to_str().unwrap();
    let check = |st: &St| {
        std::fs::write(&p, st.bytes()).unwrap();
        let (c, o, e) = run_bin(&["weights", "--check", ps, "--model", model.to_str().unwrap()]);
        let c2 = run_bin(&["compare", "--dump", ps, "--model", model.to_str().unwrap()]);
        (c, o, e, c2)
    };
    let (code, out, err, _) = check(&base);
    assert_eq!(code, 0, "{out}{err}");
    let mut broken = base.clone();
    broken.index["__metadata__"]["header"] = json!("{broken");
    let other = "00".repeat(32);
    let good = base.header()["model"]["index_sha256"].as_str().unwrap().to_string();
    for (st, want) in [
        (
            broken,
            format!("{ps}: __metadata__.header: not valid JSON: key must be a string at line 1 column 2"),
        ),
        (
            base.clone()
                .map_header(|h| h["steps"][0]["seqs"][0]["new"] = json!("x")),
            format!("{ps}: __metadata__.header.steps[0].seqs[0].new: invalid type: string \"x\", expected usize"),
        ),
        (
            base.clone()
                .map_header(|h| h["conventions"]["rope_order"] = json!("neox")),
            format!("{ps}: __metadata__.header.conventions.rope_order: `neox`: expected `interleaved` or `hf`"),
        ),
        (
            base.clone().map_header(|h| h["model"]["index_sha256"] = json!(other)),
            format!(
                "{ps}: field `header.model.index_sha256`: is {other}, but {} gives {good}: the dump was made from another file of the same name (legacy-kvb-q8_0.gguf): its contents differ; pass the GGUF the dump was made from",
                model.display()
            ),
        ),
        (
            base.clone().map_header(|h| {
                h.as_object_mut().unwrap().remove("model");
            }),
            format!("{ps}: __metadata__.header: missing field `model`"),
        ),
    ] {
        let (code, out, err, (ccode, _, cerr)) = check(&st);
        assert_eq!(code, 2, "{out}{err}");
        assert_eq!(err.trim_end(), format!("mla-diff: error: {want}"));
        // compare reads it the same way.
        assert_eq!(
            (ccode, cerr.trim_end()),
            (2, format!("mla-diff: error: {want}").as_str())
        );
    }
}
