//! Hostile input: a generated corpus of several hundred malformed (and a few deliberately odd but
//! legal) GGUF files, each pushed through the library and through the binary.
//!
//! For every file:
//! - in process, under `catch_unwind`: `GgufFile::from_bytes`, then `dequant_tensor` on every
//!   tensor of the index, `MlaConfig::from_gguf` and `LayerWeights::load(…, 0)`; the stage that
//!   fails must be the one the case expects (or none for legal files), and nothing may panic;
//! - a counting global allocator checks that all of that never holds more than
//!   [`alloc_bound`] bytes at once beyond what was live before (see its comment);
//! - through the binary: `inspect FILE` for every file, and `run --model FILE --layer 0 --backend
//!   cpu --quiet` for the files that open; an input error exits 2 with exactly one stderr line that
//!   starts with `mla-diff: error:`, names the file and holds no control characters.
//!
//! A check that fails today because of a known library bug is listed in [`KNOWN_FAILURES`]
//! (case name, check) instead of being removed from the corpus; the summary line says how many of
//! those still fail and names any that now pass (remove them from the list then).
//!
//! `cargo test --release --test tests hostile:: -- --nocapture` prints the per-category summary.

use crate::common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::BTreeMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

use crate::common::{
    Built, Dims, GgufBuilder, TensorSpec, Val, data_offsets, deepseek2, raw_array, run_bin, tensor_pos, write_temp,
};
use mla_diff::model::config::MlaConfig;
use mla_diff::model::gguf::GgufFile;
use mla_diff::model::weights::{LayerWeights, dequant_tensor};

// ---------------------------------------------------------------------------------------------
// Counting allocator
// ---------------------------------------------------------------------------------------------

/// `System`, counting the bytes currently allocated and the peak since the last reset.
struct Counting;

pub(crate) static CURRENT: AtomicUsize = AtomicUsize::new(0);
pub(crate) static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(n: usize) {
    let now = CURRENT.fetch_add(n, Ordering::SeqCst) + n;
    PEAK.fetch_max(now, Ordering::SeqCst);
}

fn shrank(n: usize) {
    CURRENT.fetch_sub(n, Ordering::SeqCst);
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged; the counters
// are side bookkeeping.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            grew(l.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(l) };
        if !p.is_null() {
            grew(l.size());
        }
        p
    }

    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) };
        shrank(l.size());
    }

    unsafe fn realloc(&self, p: *mut u8, l: Layout, new_size: usize) -> *mut u8 {
        let q = unsafe { System.realloc(p, l, new_size) };
        if !q.is_null() {
            // Counted as a copying realloc: old and new block live at once for a moment.
            grew(new_size);
            shrank(l.size());
        }
        q
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Serializes the tests that measure the allocator (this file's and `hostile_dump`'s): its
/// counters are process-wide, so a test that measures them must not share the process with
/// another one that allocates.
static SERIAL: Mutex<()> = Mutex::new(());

pub(crate) fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// The most bytes that opening a `file_len`-byte GGUF, dequantizing each of its tensors in turn,
/// deriving the config and loading layer 0 may hold at once (beyond the file image itself,
/// which the caller owns and hands over).
///
/// Why 64 × file_len + 1 MiB:
/// - The index: the parser rejects any count that cannot fit in the bytes left (a metadata entry
///   is ≥ 13 bytes, a tensor info ≥ 32), so the reserved `Vec`s are ≤ 64 B per 13 B and 72 B per
///   32 B (< 5× the file), and the key/name strings, the two duplicate-check maps and the two
///   lookup maps (copies of the strings plus hashbrown tables at ≤ 2× load) add < 10× more.
/// - Dequantization: f32 output is 4 bytes per element; the densest stored type is IQ1_S
///   (256 elements in 50 bytes), so one tensor dequantizes to ≤ 20.5× its bytes, and the
///   per-worker decoder run (≤ 1024 blocks, copied into the output) at most doubles that:
///   ≤ 41× the tensor's bytes. The tensors of layer 0 held by `LayerWeights` are ≤ 20.5× their
///   bytes in total, and tensor bytes plus index bytes ≤ file_len.
/// - So ≤ ~50× in the worst case; 64× leaves headroom, and the 1 MiB covers fixed costs (rayon's
///   pool, error strings, the lookup maps' initial tables).
fn alloc_bound(file_len: usize) -> usize {
    64 * file_len + (1 << 20)
}

// ---------------------------------------------------------------------------------------------
// Cases
// ---------------------------------------------------------------------------------------------

/// How far a file gets through the in-process pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Outcome {
    /// `GgufFile::from_bytes` fails.
    OpenErr,
    /// Opens, `MlaConfig::from_gguf` fails.
    ConfigErr,
    /// Config derived, `LayerWeights::load(…, 0)` fails.
    LoadErr,
    /// Everything succeeds: the file is legal (if odd).
    Valid,
}

struct Case {
    cat: &'static str,
    name: String,
    bytes: Vec<u8>,
    /// `None`: a blind mutation whose outcome is not predicted (only no-panic, the allocation
    /// bound and binary/library agreement are checked).
    expect: Option<Outcome>,
}

/// Checks that fail today because of a library bug, as (case name, check). Keep the case in the
/// corpus; fix the library; then delete the line (the summary names lines that now pass).
const KNOWN_FAILURES: &[(&str, &str)] = &[];

#[derive(Default)]
struct Corpus {
    cases: Vec<Case>,
}

impl Corpus {
    fn add(&mut self, cat: &'static str, name: impl Into<String>, bytes: Vec<u8>, expect: Option<Outcome>) {
        self.cases.push(Case {
            cat,
            name: format!("{cat}/{}", name.into()),
            bytes,
            expect,
        });
    }

    fn err(&mut self, cat: &'static str, name: impl Into<String>, bytes: Vec<u8>) {
        self.add(cat, name, bytes, Some(Outcome::OpenErr));
    }
}

use Outcome::{ConfigErr, LoadErr, OpenErr, Valid};

/// A small valid MLA file: one layer, split kv_b, 8-token vocabulary (~30 KB).
fn small() -> GgufBuilder {
    deepseek2(
        Dims {
            n_layer: 1,
            vocab: 8,
            ..Dims::default()
        },
        false,
    )
}

fn with_tensor(mut g: GgufBuilder, name: &str, f: impl FnOnce(&mut TensorSpec)) -> GgufBuilder {
    let i = tensor_pos(&g, name);
    f(&mut g.tensors[i]);
    g
}

fn u32le(v: u32) -> Vec<u8> {
    v.to_le_bytes().to_vec()
}

fn u64le(v: u64) -> Vec<u8> {
    v.to_le_bytes().to_vec()
}

/// A GGUF string: u64 length then bytes.
fn gstr(s: &[u8]) -> Vec<u8> {
    let mut v = u64le(s.len() as u64);
    v.extend_from_slice(s);
    v
}

/// Payload of a `depth`-deep array of arrays of u8 (`depth` = 1 is a plain `[1, 2, 3]`).
fn nested(depth: usize) -> Vec<u8> {
    let mut inner = raw_array(0, 3, &[1, 2, 3]);
    for _ in 1..depth {
        inner = raw_array(9, 1, &inner);
    }
    inner
}

const KV_A: &str = "blk.0.attn_kv_a_mqa.weight";
const LAYER0_TENSORS: &[&str] = &[
    "blk.0.attn_norm.weight",
    "blk.0.attn_q_a.weight",
    "blk.0.attn_q_a_norm.weight",
    "blk.0.attn_q_b.weight",
    KV_A,
    "blk.0.attn_kv_a_norm.weight",
    "blk.0.attn_k_b.weight",
    "blk.0.attn_v_b.weight",
    "blk.0.attn_output.weight",
    "blk.0.ffn_norm.weight",
    "blk.0.ffn_gate.weight",
    "blk.0.ffn_up.weight",
    "blk.0.ffn_down.weight",
];

/// The whole corpus, deterministic.
fn corpus() -> Corpus {
    let mut c = Corpus::default();
    let b0 = small().build();
    container_header_cases(&mut c, &b0);
    string_and_array_cases(&mut c, &b0);
    tensor_info_cases(&mut c, &b0);
    metadata_type_and_duplicate_cases(&mut c, &b0);
    data_size_and_alignment_cases(&mut c);
    name_and_dim_cases(&mut c, &b0);
    mla_config_key_cases(&mut c);
    top_bit_blind_and_size_cases(&mut c, &b0);
    c
}

/// The container's head: the legal controls, truncation at every field boundary, bad magic and
/// version, impossible tensor and metadata counts.
fn container_header_cases(c: &mut Corpus, b0: &Built) {
    let len = b0.bytes.len();
    let n_t = small().tensors.len() as u64;
    let n_kv = small().kvs.len() as u64;
    // The unmodified base file and a v2 copy are legal.
    c.add("control", "base", b0.bytes.clone(), Some(Valid));
    let mut g = small();
    g.version = 2;
    c.add("control", "version 2", g.build().bytes, Some(Valid));
    let mut bytes = b0.bytes.clone();
    bytes.extend_from_slice(&[0xAB; 100]);
    c.add("control", "trailing garbage after the data", bytes, Some(Valid));

    // ---- truncation at every field boundary (and one byte into every field) ----
    let mut cuts: BTreeMap<usize, String> = BTreeMap::new();
    for (off, name) in &b0.fields {
        if *off < len {
            cuts.entry(*off).or_insert_with(|| format!("at {name}"));
        }
        if off + 1 < len {
            cuts.entry(off + 1).or_insert_with(|| format!("1 byte into {name}"));
        }
    }
    for (cut, what) in cuts {
        c.err("truncation", format!("{cut} bytes ({what})"), b0.bytes[..cut].to_vec());
    }

    // ---- magic and version ----
    for m in [*b"GGML", *b"gguf", *b"FUGG", [0; 4], *b"GGJT", *b"\x7fELF", *b"GGU\0"] {
        let mut g = small();
        g.magic = m;
        c.err("magic", format!("{:?}", String::from_utf8_lossy(&m)), g.build().bytes);
    }
    for v in [
        0u32,
        1,
        4,
        5,
        0xFFFF_FFFF,
        3u32.swap_bytes(),
        2u32.swap_bytes(),
        0x8000_0003,
    ] {
        let mut g = small();
        g.version = v;
        c.err("version", format!("{v:#x}"), g.build().bytes);
    }

    // ---- tensor and metadata counts ----
    for (what, v) in [
        ("2^63", 1u64 << 63),
        ("u64::MAX", u64::MAX),
        ("2^32", 1 << 32),
        ("2^63 + actual", (1 << 63) + n_t),
        ("actual + 1", n_t + 1),
    ] {
        let mut g = small();
        g.tensor_count_override = Some(v);
        c.err("counts", format!("tensor_count {what}"), g.build().bytes);
    }
    let mut g = small();
    g.tensor_count_override = Some(n_t - 1);
    c.add(
        "counts",
        "tensor_count actual - 1 (last tensor unlisted)",
        g.build().bytes,
        Some(LoadErr),
    );
    let mut g = small();
    g.tensor_count_override = Some(0);
    c.add("counts", "tensor_count 0", g.build().bytes, Some(LoadErr));
    for (what, v) in [
        ("2^63", 1u64 << 63),
        ("u64::MAX", u64::MAX),
        ("2^32", 1 << 32),
        ("2^62 + actual", (1 << 62) + n_kv),
        ("actual + 1", n_kv + 1),
        ("actual - 1", n_kv - 1),
        ("0", 0),
    ] {
        let mut g = small();
        g.kv_count_override = Some(v);
        c.err("counts", format!("metadata_kv_count {what}"), g.build().bytes);
    }
    let mut g = small();
    g.kv_count_override = Some(0);
    g.tensor_count_override = Some(0);
    c.add("counts", "both counts 0", g.build().bytes, Some(ConfigErr));
}

/// Metadata strings whose length runs past the end, and arrays nested or sized past the file.
fn string_and_array_cases(c: &mut Corpus, b0: &Built) {
    let len = b0.bytes.len();
    // ---- string lengths past the end ----
    let tok_val = b0.field("tokenizer.ggml.tokens: value");
    let string_fields: Vec<(String, usize)> = [
        "general.architecture: key",
        "deepseek2.block_count: key",
        "tokenizer.ggml.tokens: key",
        "general.architecture: value",
        "token_embd.weight: name",
        "blk.0.attn_kv_a_mqa.weight: name",
        "blk.0.ffn_down.weight: name",
    ]
    .iter()
    .map(|f| (f.to_string(), b0.field(f)))
    .chain([("tokenizer.ggml.tokens[0]".to_string(), tok_val + 12)])
    .collect();
    for (f, at) in &string_fields {
        let left = (len - at - 8) as u64;
        for (what, v) in [
            ("u64::MAX", u64::MAX),
            ("2^63", 1 << 63),
            ("file length", len as u64),
            ("bytes left + 1", left + 1),
            ("exactly the bytes left", left),
        ] {
            c.err(
                "string-length",
                format!("{f} = {what}"),
                b0.clone_bytes().patched(*at, &u64le(v)),
            );
        }
    }

    // ---- nested arrays ----
    for d in [1usize, 2, 3, 4] {
        let mut g = small();
        g.kv("hostile.nested", Val::Raw(9, nested(d)));
        c.add("nested-array", format!("depth {d}"), g.build().bytes, Some(Valid));
    }
    for d in [5usize, 6, 8, 64, 100_000] {
        let mut g = small();
        g.kv("hostile.nested", Val::Raw(9, nested(d)));
        c.err("nested-array", format!("depth {d}"), g.build().bytes);
    }
    let arr_cases: Vec<(&str, Vec<u8>, Outcome)> = vec![
        ("empty array of arrays", raw_array(9, 0, &[]), Valid),
        ("array of arrays, count 2^61", raw_array(9, 1 << 61, &[]), OpenErr),
        ("array of arrays, count 2^40", raw_array(9, 1 << 40, &[]), OpenErr),
        (
            "array of arrays, inner count 2^62",
            raw_array(9, 1, &raw_array(0, 1 << 62, &[])),
            OpenErr,
        ),
        (
            "array of arrays, inner count u64::MAX",
            raw_array(9, 1, &raw_array(6, u64::MAX, &[])),
            OpenErr,
        ),
        (
            "array of arrays of unknown type 13",
            raw_array(9, 1, &raw_array(13, 1, &[0; 8])),
            OpenErr,
        ),
        ("array of unknown type 13", raw_array(13, 1, &[0; 8]), OpenErr),
        (
            "array of unknown type u32::MAX",
            raw_array(u32::MAX, 1, &[0; 8]),
            OpenErr,
        ),
        ("array of u32, count 2^62", raw_array(4, 1 << 62, &[0; 16]), OpenErr),
        (
            "array of u32, count 2^62 + 1 (×4 wraps to 4)",
            raw_array(4, (1 << 62) + 1, &[0; 16]),
            OpenErr,
        ),
        (
            "array of f64, count 2^61 (×8 wraps to 0)",
            raw_array(12, 1 << 61, &[]),
            OpenErr,
        ),
        ("array of strings, count 2^61", raw_array(8, 1 << 61, &[]), OpenErr),
        (
            "array of strings, 2nd length u64::MAX",
            raw_array(8, 2, &[gstr(b"a"), u64le(u64::MAX)].concat()),
            OpenErr,
        ),
        ("array of bool holding 2", raw_array(7, 3, &[0, 1, 2]), OpenErr),
        (
            "array of arrays of strings",
            raw_array(9, 2, &[raw_array(8, 1, &gstr(b"x")), raw_array(8, 0, &[])].concat()),
            Valid,
        ),
        (
            "array of arrays of arrays, last cut short",
            raw_array(9, 2, &raw_array(9, 1, &raw_array(0, 1, &[7]))),
            OpenErr,
        ),
    ];
    for (what, payload, expect) in arr_cases {
        let mut g = small();
        g.kv("hostile.array", Val::Raw(9, payload));
        c.add("nested-array", what, g.build().bytes, Some(expect));
    }
    let mut g = small();
    g.kv("hostile.bool", Val::Raw(7, vec![2]));
    c.err("nested-array", "scalar bool holding 2", g.build().bytes);
}

/// Tensor infos: dims whose product overflows, data offsets past the end, overlapping or
/// misaligned, and unknown ggml types.
fn tensor_info_cases(c: &mut Corpus, b0: &Built) {
    let base = small();
    let len = b0.bytes.len();
    // ---- dims whose product overflows ----
    for ne in [
        vec![1u64 << 32, 1 << 32, 1 << 32],
        vec![1 << 63],
        vec![u64::MAX],
        vec![i64::MAX as u64],
        vec![1 << 62, 2],
        vec![1 << 31, 1 << 31, 4],
        vec![3, 1 << 62],
        vec![65536, 65536, 65536, 65536],
        vec![1 << 61],
        vec![32, (1 << 61) / 32],
        vec![u32::MAX as u64 + 1, u32::MAX as u64 + 1],
    ] {
        let g = with_tensor(small(), "blk.0.attn_q_a.weight", |t| t.ne = ne.clone());
        c.err("dims-overflow", format!("F32 {ne:?}"), g.build().bytes);
    }
    for (ty, ne) in [
        (12u32, vec![256u64 << 55]),
        (8, vec![32, 1 << 58]),
        (39, vec![1u64 << 62, 2]),
    ] {
        let g = with_tensor(small(), "blk.0.attn_q_a.weight", |t| {
            t.type_id = ty;
            t.ne = ne.clone();
        });
        c.err("dims-overflow", format!("type {ty} {ne:?}"), g.build().bytes);
    }

    // ---- offsets past the end, overlapping, misaligned ----
    let offs = data_offsets(&base);
    let data_len = (len as u64) - (b0.field("token_embd.weight: data") as u64);
    for name in ["token_embd.weight", KV_A, "blk.0.ffn_down.weight"] {
        let i = tensor_pos(&base, name);
        let own = offs[i];
        let other = if i == 0 { offs[1] } else { offs[i - 1] };
        for (what, v) in [
            ("2^40", 1u64 << 40),
            ("u64::MAX rounded down to 32 (offset + size wraps)", u64::MAX / 32 * 32),
            ("2^63", 1 << 63),
            ("end of the data section", data_len.div_ceil(32) * 32),
            ("a neighbour's offset", other),
            ("inside a neighbour's data", other + 32),
            ("own + 1", own + 1),
            ("own + 8", own + 8),
            ("own + 16", own + 16),
            ("own + 31", own + 31),
        ] {
            let g = with_tensor(small(), name, |t| t.offset_override = Some(v));
            c.err("offsets", format!("{name} at {what}"), g.build().bytes);
        }
    }
    // Two tensors claiming exactly the same bytes.
    let mut g = small();
    let i = tensor_pos(&g, KV_A);
    let j = tensor_pos(&g, "blk.0.attn_q_b.weight");
    g.tensors[j].offset_override = Some(offs[i]);
    c.err("offsets", "attn_q_b at attn_kv_a_mqa's offset", g.build().bytes);

    // ---- F32 tensors at offsets that are 4-aligned but not data-aligned ----
    for add in [4u64, 12, 20, 28] {
        let name = "blk.0.attn_norm.weight";
        let own = offs[tensor_pos(&base, name)];
        let g = with_tensor(small(), name, |t| t.offset_override = Some(own + add));
        c.err("f32-unaligned", format!("{name} at +{add}"), g.build().bytes);
    }
    let mut g8 = small();
    g8.alignment = 8;
    g8.kv("general.alignment", Val::U32(8));
    let o8 = data_offsets(&g8);
    let i = tensor_pos(&g8, KV_A);
    let mut g = g8.clone();
    g.tensors[i].offset_override = Some(o8[i] + 4);
    c.err("f32-unaligned", "alignment 8, attn_kv_a_mqa at +4", g.build().bytes);
    let mut bytes = b0.clone_bytes();
    bytes.insert(b0.field("token_embd.weight: data"), 0);
    c.add(
        "f32-unaligned",
        "one byte inserted before the data section (every tensor shifted by 1)",
        bytes,
        None,
    );

    // ---- unknown ggml types ----
    for ty in [
        4u32,
        5,
        31,
        32,
        33,
        36,
        37,
        38,
        40,
        41,
        64,
        99,
        255,
        1000,
        0x8000_0000,
        u32::MAX,
    ] {
        let g = with_tensor(small(), KV_A, |t| t.type_id = ty);
        c.err("ggml-type", format!("{KV_A} type {ty}"), g.build().bytes);
    }
    let g = with_tensor(small(), "token_embd.weight", |t| t.type_id = 77);
    c.err("ggml-type", "token_embd type 77 (not a layer tensor)", g.build().bytes);
}

/// Unknown metadata value types, and duplicated keys and tensor names.
fn metadata_type_and_duplicate_cases(c: &mut Corpus, b0: &Built) {
    // ---- unknown metadata value types ----
    for t in [13u32, 14, 15, 100, 255, 0x8000_0004, u32::MAX] {
        let mut g = small();
        g.kv("hostile.value", Val::Raw(t, vec![0; 8]));
        c.err("meta-type", format!("extra key of type {t}"), g.build().bytes);
    }
    for (f, t) in [
        ("general.architecture: type", 13u32),
        ("deepseek2.block_count: type", u32::MAX),
        ("tokenizer.ggml.tokens: type", 99),
    ] {
        c.err(
            "meta-type",
            format!("{f} = {t}"),
            b0.clone_bytes().patched(b0.field(f), &u32le(t)),
        );
    }
    for (what, v, expect) in [
        ("block_count as f32", Val::F32(1.0), ConfigErr),
        ("block_count as string", Val::Str("1".into()), ConfigErr),
        (
            "block_count as i64 -1",
            Val::Raw(11, (-1i64).to_le_bytes().to_vec()),
            ConfigErr,
        ),
        ("block_count as bool", Val::Bool(true), ConfigErr),
        (
            "block_count as array",
            Val::Raw(9, raw_array(4, 1, &u32le(1))),
            ConfigErr,
        ),
        ("block_count as u8", Val::Raw(0, vec![1]), Valid),
        ("block_count as u64", Val::U64(1), Valid),
        ("block_count as i16", Val::Raw(3, 1i16.to_le_bytes().to_vec()), Valid),
    ] {
        let mut g = small();
        g.set_kv("deepseek2.block_count", v);
        c.add("meta-type", what, g.build().bytes, Some(expect));
    }

    // ---- duplicates ----
    let mut g = small();
    let t = g.tensors[tensor_pos(&g, KV_A)].clone();
    g.tensors.push(t);
    c.err("duplicate", "tensor attn_kv_a_mqa twice", g.build().bytes);
    let mut g = small();
    let mut t = g.tensors[tensor_pos(&g, KV_A)].clone();
    t.ne = vec![4];
    t.data = vec![0; 16];
    g.tensors.insert(0, t);
    c.err(
        "duplicate",
        "tensor attn_kv_a_mqa twice, different dims, first one first",
        g.build().bytes,
    );
    let mut g = small();
    g.kv("general.architecture", Val::Str("deepseek2".into()));
    c.err(
        "duplicate",
        "key general.architecture twice, same value",
        g.build().bytes,
    );
    let mut g = small();
    g.kv("deepseek2.block_count", Val::U32(7));
    c.err("duplicate", "key block_count twice, different values", g.build().bytes);
    let mut g = small();
    g.kv("deepseek2.block_count", Val::Str("x".into()));
    c.err("duplicate", "key block_count twice, different types", g.build().bytes);
    let mut g = small();
    g.kvs.insert(0, ("tokenizer.ggml.tokens".into(), Val::U32(0)));
    c.err("duplicate", "key tokenizer.ggml.tokens first and last", g.build().bytes);
    let mut g = small();
    g.kv("General.Architecture", Val::Str("llama".into()));
    c.add(
        "duplicate",
        "keys differing only in case are distinct",
        g.build().bytes,
        Some(Valid),
    );
    let mut g = small();
    g.kv("", Val::U32(1));
    c.add("duplicate", "one empty key is legal", g.build().bytes, Some(Valid));
    let mut g = small();
    g.kv("", Val::U32(1));
    g.kv("", Val::U32(2));
    c.err("duplicate", "two empty keys", g.build().bytes);
}

/// Tensor byte sizes against their type and dims, types without a decoder, and `general.alignment`
/// values.
fn data_size_and_alignment_cases(c: &mut Corpus) {
    // ---- byte size vs type and dims ----
    // attn_kv_a_mqa is [L+R, H] = [28, 32] (ne [32, 28]), 3584 bytes of F32 data.
    for (ty, ne, what) in [
        (8u32, vec![24u64, 28], "Q8_0 with ne0 24"),
        (8, vec![33, 28], "Q8_0 with ne0 33"),
        (12, vec![32, 28], "Q4_K with ne0 32"),
        (12, vec![255, 4], "Q4_K with ne0 255"),
        (14, vec![128, 7], "Q6_K with ne0 128"),
        (15, vec![32, 28], "Q8_K with ne0 32"),
        (39, vec![16, 56], "MXFP4 with ne0 16"),
        (20, vec![31, 28], "IQ4_NL with ne0 31"),
        (2, vec![40, 28], "Q4_0 with ne0 40"),
        (
            28,
            vec![32, 28],
            "F64: twice the bytes present (overlaps the next tensor)",
        ),
        (27, vec![32, 28], "I64: twice the bytes present"),
        (0, vec![32, 56], "F32 with twice the rows present"),
    ] {
        let g = with_tensor(small(), KV_A, |t| {
            t.type_id = ty;
            t.ne = ne;
        });
        c.err("byte-size", what, g.build().bytes);
    }
    let g = with_tensor(small(), "blk.0.ffn_down.weight", |t| t.ne = vec![16, 33]);
    c.err(
        "byte-size",
        "last tensor with one row more than its data",
        g.build().bytes,
    );
    // Fewer bytes than the data the builder wrote: legal (the rest is an unused gap).
    for (ty, what) in [
        (8u32, "Q8_0"),
        (1, "F16"),
        (30, "BF16"),
        (24, "I8"),
        (2, "Q4_0"),
        (39, "MXFP4"),
        (26, "I32"),
    ] {
        let g = with_tensor(small(), KV_A, |t| t.type_id = ty);
        c.add(
            "byte-size",
            format!("F32 data declared {what} (fewer bytes)"),
            g.build().bytes,
            Some(Valid),
        );
    }
    // Types with no decoder: open, but a layer that uses one cannot load.
    let g = with_tensor(small(), KV_A, |t| t.type_id = 9);
    c.add(
        "byte-size",
        "attn_kv_a_mqa declared Q8_1 (no decoder)",
        g.build().bytes,
        Some(LoadErr),
    );
    let g = with_tensor(small(), "token_embd.weight", |t| t.type_id = 9);
    c.add(
        "byte-size",
        "token_embd declared Q8_1 (not loaded for layer 0)",
        g.build().bytes,
        Some(Valid),
    );

    // ---- general.alignment ----
    for a in [0u32, 1, 2, 4, 7, 12, 24, 33, 48, 96, u32::MAX] {
        let mut g = small();
        g.kv("general.alignment", Val::U32(a));
        c.err("alignment", format!("u32 {a}"), g.build().bytes);
    }
    let mut g = small();
    g.kv("general.alignment", Val::U32(1 << 31));
    c.err("alignment", "u32 2^31 (data section past the end)", g.build().bytes);
    for (what, v) in [
        ("f32 32.0", Val::F32(32.0)),
        ("string \"32\"", Val::Str("32".into())),
        ("u64 32", Val::U64(32)),
        ("i32 32", Val::I32(32)),
        ("u8 32", Val::Raw(0, vec![32])),
        ("bool", Val::Bool(true)),
        ("array [32]", Val::Raw(9, raw_array(4, 1, &u32le(32)))),
    ] {
        let mut g = small();
        g.kv("general.alignment", v);
        c.err("alignment", format!("{what} (must be u32)"), g.build().bytes);
    }
    for a in [8u32, 16, 64, 128] {
        let mut g = small();
        g.alignment = a as u64;
        g.kv("general.alignment", Val::U32(a));
        c.add(
            "alignment",
            format!("u32 {a}, file laid out for it"),
            g.build().bytes,
            Some(Valid),
        );
    }
    let mut g = small();
    g.kv("general.alignment", Val::U32(64));
    c.add("alignment", "u32 64 but offsets laid out for 32", g.build().bytes, None);
}

/// Names and keys that are not UTF-8 or hold control characters, and `n_dims` or dims out of range.
fn name_and_dim_cases(c: &mut Corpus, b0: &Built) {
    let tok_val = b0.field("tokenizer.ggml.tokens: value");
    // ---- names and keys that are not UTF-8 ----
    let bad_utf8: [(&str, &[u8]); 4] = [
        ("0xFF", &[0xFF]),
        ("overlong NUL C0 80", &[0xC0, 0x80]),
        ("surrogate ED A0 80", &[0xED, 0xA0, 0x80]),
        ("cut sequence E2 82", &[0xE2, 0x82]),
    ];
    for (what, seq) in bad_utf8 {
        let at = b0.field("general.architecture: key") + 8 + 3;
        c.err(
            "utf8",
            format!("key general.architecture with {what}"),
            b0.clone_bytes().patched(at, seq),
        );
        let at = b0.field(&format!("{KV_A}: name")) + 8 + 6;
        c.err(
            "utf8",
            format!("tensor name {KV_A} with {what}"),
            b0.clone_bytes().patched(at, seq),
        );
    }
    let mut g = small();
    g.kv("general.name", Val::Str("XXXXXXXX".into()));
    let b = g.build();
    let at = b.field("general.name: value") + 8;
    c.add(
        "utf8",
        "string value general.name not UTF-8",
        b.bytes.patched(at, &[0xFF, 0xFE, 0xC0]),
        Some(Valid),
    );
    let at = b0.field("general.architecture: value") + 8 + 5;
    c.add(
        "utf8",
        "general.architecture value not UTF-8",
        b0.clone_bytes().patched(at, &[0xFF]),
        Some(ConfigErr),
    );
    let at = tok_val + 12 + 8;
    c.add(
        "utf8",
        "token string not UTF-8",
        b0.clone_bytes().patched(at, &[0xFF]),
        Some(Valid),
    );

    // ---- control characters in names that end up in error messages ----
    let g = with_tensor(small(), KV_A, |t| {
        t.name = "blk.0.evil\nmla-diff: error: forged second line".into();
        t.ne = vec![1, 1, 1, 1, 1];
        t.data = vec![0; 4];
    });
    c.err("control-chars", "tensor name with a newline, n_dims 5", g.build().bytes);
    let mut g = small();
    g.kv("evil\nkey", Val::U32(1));
    g.kv("evil\nkey", Val::U32(2));
    c.err("control-chars", "duplicate key with a newline", g.build().bytes);
    let mut g = small();
    g.kv("evil\x1b[2Jkey", Val::Raw(13, vec![0; 4]));
    c.err(
        "control-chars",
        "key with an ANSI clear-screen, unknown value type",
        g.build().bytes,
    );
    let mut g = small();
    g.kv("evil\rkey", Val::Raw(13, vec![0; 4]));
    c.err(
        "control-chars",
        "key with a carriage return, unknown value type",
        g.build().bytes,
    );
    let mut g = small();
    g.set_kv("general.architecture", Val::Str("llama\nsecond line".into()));
    c.add(
        "control-chars",
        "architecture with a newline",
        g.build().bytes,
        Some(ConfigErr),
    );

    // ---- n_dims out of range ----
    for nd in [0u32, 5, 8, 64, u32::MAX] {
        let f = "blk.0.attn_q_a.weight: n_dims";
        c.err(
            "n-dims",
            format!("n_dims {nd}"),
            b0.clone_bytes().patched(b0.field(f), &u32le(nd)),
        );
    }
    let g = with_tensor(small(), "blk.0.attn_q_a.weight", |t| t.ne = vec![32, 16, 1, 1, 1]);
    c.err("n-dims", "5 real dims [32, 16, 1, 1, 1]", g.build().bytes);
    let g = with_tensor(small(), "blk.0.attn_q_a.weight", |t| t.ne = vec![32, 16, 1, 1]);
    c.add(
        "n-dims",
        "4 dims [32, 16, 1, 1] where 2 are expected",
        g.build().bytes,
        Some(LoadErr),
    );
    let f = "blk.0.attn_q_a.weight: n_dims";
    c.err(
        "n-dims",
        "n_dims 1 on a 2-D tensor",
        b0.clone_bytes().patched(b0.field(f), &u32le(1)),
    );

    // ---- zero-sized dims ----
    for ne in [vec![0u64], vec![32, 0], vec![0, 16], vec![32, 16, 0], vec![1, 1, 1, 0]] {
        let g = with_tensor(small(), "blk.0.attn_q_a.weight", |t| t.ne = ne.clone());
        c.err("zero-dims", format!("attn_q_a ne {ne:?}"), g.build().bytes);
    }
}

/// Well-formed GGUF files whose MLA configuration keys are missing, of the wrong type or
/// inconsistent.
fn mla_config_key_cases(c: &mut Corpus) {
    // ---- MLA configuration keys (the file is a well-formed GGUF) ----
    let a = "deepseek2";
    for (what, key, v, expect) in [
        ("block_count 0", "block_count", Val::U32(0), ConfigErr),
        (
            "block_count 2^24 + 1",
            "block_count",
            Val::U32((1 << 24) + 1),
            ConfigErr,
        ),
        ("block_count u64::MAX", "block_count", Val::U64(u64::MAX), ConfigErr),
        ("head_count -3", "attention.head_count", Val::I32(-3), ConfigErr),
        (
            "head_count 4 (tensors say 3)",
            "attention.head_count",
            Val::U32(4),
            LoadErr,
        ),
        ("embedding_length 2^24", "embedding_length", Val::U32(1 << 24), LoadErr),
        (
            "kv_lora_rank 2^24",
            "attention.kv_lora_rank",
            Val::U32(1 << 24),
            LoadErr,
        ),
        (
            "key_length_mla = rope dim",
            "attention.key_length_mla",
            Val::U32(4),
            ConfigErr,
        ),
        ("key_length_mla 0", "attention.key_length_mla", Val::U32(0), ConfigErr),
        (
            "rope.dimension_count odd",
            "rope.dimension_count",
            Val::U32(3),
            ConfigErr,
        ),
        (
            "value_length_mla 0",
            "attention.value_length_mla",
            Val::U32(0),
            ConfigErr,
        ),
        (
            "rope.scaling.type linear",
            "rope.scaling.type",
            Val::Str("linear".into()),
            ConfigErr,
        ),
        (
            "yarn without a factor",
            "rope.scaling.type",
            Val::Str("yarn".into()),
            ConfigErr,
        ),
        (
            "rms eps NaN",
            "attention.layer_norm_rms_epsilon",
            Val::F32(f32::NAN),
            ConfigErr,
        ),
        (
            "rms eps -1",
            "attention.layer_norm_rms_epsilon",
            Val::F32(-1.0),
            ConfigErr,
        ),
        (
            "rms eps +inf",
            "attention.layer_norm_rms_epsilon",
            Val::F32(f32::INFINITY),
            ConfigErr,
        ),
        ("rope freq_base NaN", "rope.freq_base", Val::F32(f32::NAN), ConfigErr),
        ("rope freq_base 0", "rope.freq_base", Val::F32(0.0), ConfigErr),
        ("rope freq_base -10000", "rope.freq_base", Val::F32(-10000.0), ConfigErr),
    ] {
        let mut g = small();
        g.set_kv(&format!("{a}.{key}"), v);
        c.add("config", what, g.build().bytes, Some(expect));
    }
    for (what, factor) in [("NaN", f32::NAN), ("-1", -1.0), ("+inf", f32::INFINITY)] {
        let mut g = small();
        g.kv(&format!("{a}.rope.scaling.type"), Val::Str("yarn".into()));
        g.kv(&format!("{a}.rope.scaling.factor"), Val::F32(factor));
        g.kv(&format!("{a}.rope.scaling.original_context_length"), Val::U32(4096));
        c.add(
            "config",
            format!("yarn factor {what}"),
            g.build().bytes,
            Some(ConfigErr),
        );
    }
    let mut g = small();
    g.remove_kv("general.architecture");
    c.add("config", "no general.architecture", g.build().bytes, Some(ConfigErr));
    let mut g = small();
    g.set_kv("general.architecture", Val::U32(2));
    c.add(
        "config",
        "general.architecture as u32",
        g.build().bytes,
        Some(ConfigErr),
    );
    let g = with_tensor(small(), "blk.0.attn_q_a.weight", |t| t.ne = vec![512]);
    c.add("config", "attn_q_a 1-D", g.build().bytes, Some(LoadErr));
    for name in LAYER0_TENSORS {
        let mut g = small();
        g.tensors.retain(|t| t.name != *name);
        c.add("missing-tensor", *name, g.build().bytes, Some(LoadErr));
    }
}

/// The top bit of every u64 field, blind 0xFF mutations, and files that stress the allocation bound
/// at ~1 MB.
fn top_bit_blind_and_size_cases(c: &mut Corpus, b0: &Built) {
    // ---- the top bit of every u64 count, length, dim and offset ----
    for (off, name) in &b0.fields {
        let is_u64 = name.ends_with(": key")
            || name.ends_with(": name")
            || name.contains(": ne[")
            || name.ends_with(": offset")
            || name.ends_with("_count");
        if is_u64 {
            let mut bytes = b0.clone_bytes();
            bytes[off + 7] |= 0x80;
            c.err("high-bit", format!("{name} |= 2^63"), bytes);
        }
    }

    // ---- blind: 0xFF over the first byte of every field (outcome not predicted) ----
    for (off, name) in &b0.fields {
        if name.ends_with(": data") {
            continue;
        }
        let mut bytes = b0.clone_bytes();
        bytes[*off] = 0xFF;
        c.add("blind-ff", format!("{name} [0] = 0xFF"), bytes, None);
    }

    // ---- size stress: the allocation bound at ~1 MB ----
    // A metadata count that exactly fits 13-byte entries, all an empty key with a u8 value: the
    // second is a duplicate.
    let n = 80_000u64;
    let mut bytes = b"GGUF".to_vec();
    bytes.extend(u32le(3));
    bytes.extend(u64le(0));
    bytes.extend(u64le(n));
    bytes.resize(bytes.len() + 13 * n as usize, 0);
    c.err(
        "stress",
        "80k metadata entries of 13 bytes (duplicate empty keys)",
        bytes,
    );
    // A tensor count that exactly fits 32-byte infos of zeros.
    let n = 32_768u64;
    let mut bytes = b"GGUF".to_vec();
    bytes.extend(u32le(3));
    bytes.extend(u64le(n));
    bytes.extend(u64le(0));
    bytes.resize(bytes.len() + 32 * n as usize, 0);
    c.err("stress", "32k zeroed tensor infos", bytes);
    // 64k distinct 3-letter keys.
    let mut g = GgufBuilder::default();
    let alpha = b"abcdefghijklmnopqrstuvwxyz0123456789._-+";
    'outer: for x in alpha {
        for y in alpha {
            for z in alpha {
                if g.kvs.len() == 64_000 {
                    break 'outer;
                }
                g.kv(std::str::from_utf8(&[*x, *y, *z]).unwrap(), Val::Raw(0, vec![1]));
            }
        }
    }
    c.add("stress", "64k distinct keys", g.build().bytes, Some(ConfigErr));
    // 30k one-byte tensors at alignment 8.
    let mut g = GgufBuilder {
        alignment: 8,
        ..Default::default()
    };
    g.kv("general.alignment", Val::U32(8));
    for i in 0..30_000 {
        g.tensors.push(TensorSpec {
            name: format!("t{i}"),
            ne: vec![1],
            type_id: 24,
            data: vec![i as u8],
            offset_override: None,
        });
    }
    c.add("stress", "30k one-byte I8 tensors", g.build().bytes, Some(ConfigErr));
    // 100k empty arrays in an array of arrays; a 100k-token vocabulary.
    let mut g = small();
    g.kv(
        "hostile.arrays",
        Val::Raw(9, raw_array(9, 100_000, &raw_array(0, 0, &[]).repeat(100_000))),
    );
    c.add("stress", "100k empty arrays in one array", g.build().bytes, Some(Valid));
    let mut g = small();
    g.set_kv(
        "tokenizer.ggml.tokens",
        Val::ArrStr((0..100_000).map(|i| format!("tok{i}")).collect()),
    );
    c.add("stress", "100k-token vocabulary", g.build().bytes, Some(Valid));
    // Dequantization amplification: the densest types, as an extra tensor of ~400 KB.
    for (ty, name, block_bytes) in [
        (19u32, "IQ1_S", 50usize),
        (29, "IQ1_M", 56),
        (34, "TQ1_0", 54),
        (10, "Q2_K", 84),
        (39, "MXFP4", 17),
    ] {
        let block = if ty == 39 { 32u64 } else { 256 };
        let blocks = 400_000 / block_bytes;
        let mut g = small();
        g.tensors.push(TensorSpec {
            name: format!("hostile.{name}"),
            ne: vec![block * 64, blocks as u64 / 64],
            type_id: ty,
            data: (0..blocks / 64 * 64 * block_bytes).map(|i| (i * 7 + 3) as u8).collect(),
            offset_override: None,
        });
        c.add(
            "stress",
            format!("~400 KB extra {name} tensor"),
            g.build().bytes,
            Some(Valid),
        );
    }
}

/// `Vec<u8>` helpers for the byte-patching cases.
trait Bytes {
    fn patched(self, at: usize, b: &[u8]) -> Vec<u8>;
}

impl Bytes for Vec<u8> {
    fn patched(mut self, at: usize, b: &[u8]) -> Vec<u8> {
        self[at..at + b.len()].copy_from_slice(b);
        self
    }
}

trait CloneBytes {
    fn clone_bytes(&self) -> Vec<u8>;
}

impl CloneBytes for common::Built {
    fn clone_bytes(&self) -> Vec<u8> {
        self.bytes.clone()
    }
}

// ---------------------------------------------------------------------------------------------
// Running a case
// ---------------------------------------------------------------------------------------------

/// What the library did with one file.
struct InProcess {
    /// `Err(panic message)` when something panicked.
    outcome: Result<Outcome, String>,
    /// The error message of the failing stage.
    error: Option<String>,
    /// Peak bytes allocated beyond what was live before.
    peak: usize,
}

pub(crate) fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "non-string panic payload".into())
}

fn in_process(file_name: &str, bytes: &[u8]) -> InProcess {
    let image = bytes.to_vec();
    let name = file_name.to_string();
    let before = CURRENT.load(Ordering::SeqCst);
    PEAK.store(before, Ordering::SeqCst);
    let r = catch_unwind(AssertUnwindSafe(move || {
        let file = match GgufFile::from_bytes(name, image) {
            Ok(f) => f,
            Err(e) => return (OpenErr, Some(e.to_string())),
        };
        // Anything in the index may be dequantized (inspect, weights --check, the fuzz target).
        for t in file.tensors() {
            let _ = dequant_tensor(&file, t);
        }
        let cfg = match MlaConfig::from_gguf(&file) {
            Ok(c) => c,
            Err(e) => return (ConfigErr, Some(e.to_string())),
        };
        match LayerWeights::load(&file, &cfg, 0) {
            Ok(_) => (Valid, None),
            Err(e) => (LoadErr, Some(e.to_string())),
        }
    }));
    let peak = PEAK.load(Ordering::SeqCst).saturating_sub(before);
    match r {
        Ok((o, e)) => InProcess {
            outcome: Ok(o),
            error: e,
            peak,
        },
        Err(p) => InProcess {
            outcome: Err(panic_message(&*p)),
            error: None,
            peak,
        },
    }
}

/// Failed checks, split into new ones and the ones listed in [`KNOWN_FAILURES`].
#[derive(Default)]
struct Failures {
    new: Vec<String>,
    known_hit: Vec<(String, String)>,
}

impl Failures {
    fn fail(&mut self, case: &str, check: &str, detail: String) {
        if KNOWN_FAILURES.iter().any(|(c, k)| *c == case && *k == check) {
            self.known_hit.push((case.to_string(), check.to_string()));
        } else {
            self.new.push(format!("[{check}] {case}: {detail}"));
        }
    }

    /// Panics with every new failure; reports known failures that no longer fail.
    fn finish(self, checks_run: &[&str], label: &str) -> String {
        let stale: Vec<String> = KNOWN_FAILURES
            .iter()
            .filter(|(_, k)| checks_run.contains(k))
            .filter(|(c, k)| !self.known_hit.iter().any(|(hc, hk)| hc == c && hk == k))
            .map(|(c, k)| format!("({c:?}, {k:?})"))
            .collect();
        let summary = format!(
            "{label}: {} known failures still fail; {} now pass{}",
            self.known_hit.len(),
            stale.len(),
            if stale.is_empty() {
                String::new()
            } else {
                format!(" (remove from KNOWN_FAILURES: {})", stale.join(", "))
            }
        );
        assert!(
            self.new.is_empty(),
            "{} hostile-input check(s) failed:\n{}\n{summary}",
            self.new.len(),
            self.new.join("\n")
        );
        summary
    }
}

fn file_name(i: usize, cat: &str) -> String {
    format!("hostile-{i:03}-{cat}.gguf")
}

// ---------------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------------

#[test]
fn corpus_in_process_never_panics_and_allocates_within_the_bound() {
    let _g = serial();
    let corpus = corpus();
    assert!(corpus.cases.len() >= 200, "only {} cases", corpus.cases.len());
    let mut names = std::collections::HashSet::new();
    for c in &corpus.cases {
        assert!(names.insert(c.name.as_str()), "duplicate case name {}", c.name);
    }
    let mut fails = Failures::default();
    let mut per_cat: BTreeMap<&str, BTreeMap<String, usize>> = BTreeMap::new();
    let (mut worst_ratio, mut worst_case) = (0f64, String::new());
    let mut worst_peak = (0usize, String::new());
    for (i, case) in corpus.cases.iter().enumerate() {
        let fname = file_name(i, case.cat);
        let r = in_process(&fname, &case.bytes);
        let len = case.bytes.len();
        let label = match &r.outcome {
            Ok(o) => format!("{o:?}"),
            Err(_) => "PANIC".into(),
        };
        *per_cat.entry(case.cat).or_default().entry(label).or_default() += 1;
        match &r.outcome {
            Err(msg) => fails.fail(&case.name, "panic", format!("panicked: {msg}")),
            Ok(o) => {
                if let Some(e) = case.expect
                    && e != *o
                {
                    fails.fail(
                        &case.name,
                        "outcome",
                        format!(
                            "expected {e:?}, got {o:?} ({})",
                            r.error.as_deref().unwrap_or("no error")
                        ),
                    );
                }
                if let Some(msg) = &r.error
                    && !msg.contains(&fname)
                {
                    fails.fail(
                        &case.name,
                        "error-names-file",
                        format!("error does not name the file: {msg}"),
                    );
                }
            }
        }
        if r.peak > alloc_bound(len) {
            fails.fail(
                &case.name,
                "alloc",
                format!(
                    "peak {} bytes for a {len}-byte file (bound {})",
                    r.peak,
                    alloc_bound(len)
                ),
            );
        }
        if len >= 64 * 1024 {
            let ratio = r.peak as f64 / len as f64;
            if ratio > worst_ratio {
                (worst_ratio, worst_case) = (ratio, case.name.clone());
            }
        }
        if r.peak > worst_peak.0 {
            worst_peak = (r.peak, case.name.clone());
        }
    }
    let total: usize = per_cat.values().flat_map(|m| m.values()).sum();
    let cats: Vec<String> = per_cat
        .iter()
        .map(|(c, m)| {
            let n: usize = m.values().sum();
            let detail: Vec<String> = m.iter().map(|(k, v)| format!("{k} {v}")).collect();
            format!("{c} {n} ({})", detail.join(", "))
        })
        .collect();
    println!("hostile corpus: {total} cases: {}", cats.join("; "));
    println!(
        "allocation: worst peak/file_len {worst_ratio:.2} over files ≥ 64 KiB ({worst_case}); \
         largest peak {} bytes ({}); bound 64 × file_len + 1 MiB",
        worst_peak.0, worst_peak.1
    );
    let s = fails.finish(&["panic", "outcome", "alloc", "error-names-file"], "in-process");
    println!("{s}");
}

/// The stderr contract of an input error: exit 2, exactly one line, `mla-diff: error:` first,
/// the file named, no control characters (a CR or an escape sequence can rewrite what a terminal
/// shows).
/// What one binary invocation gave: exit code, stdout, stderr.
type BinRun = (i32, String, String);

fn check_error_exit(
    fails: &mut Failures,
    case: &str,
    cmd: &str,
    fname: &str,
    (code, _out, err): &(i32, String, String),
) {
    if err.contains("panicked") || *code != 2 {
        fails.fail(case, &format!("{cmd}-exit"), format!("exit {code}, stderr: {err:?}"));
        return;
    }
    let lines: Vec<&str> = err.lines().collect();
    if lines.len() != 1 || !lines[0].starts_with("mla-diff: error:") {
        fails.fail(
            case,
            "stderr-one-line",
            format!("{cmd}: {} stderr lines: {err:?}", lines.len()),
        );
    } else if !lines[0].contains(fname) {
        fails.fail(case, "stderr-names-file", format!("{cmd}: {err:?}"));
    }
    if err.trim_end_matches('\n').chars().any(|c| c.is_control()) {
        fails.fail(case, "stderr-control-chars", format!("{cmd}: {err:?}"));
    }
}

#[test]
fn corpus_through_the_binary_exits_2_with_one_line() {
    let _g = serial();
    let corpus = corpus();
    let dir = tempfile::tempdir().expect("tempdir");
    // The in-process outcome decides which commands to expect what from.
    let jobs: Vec<(usize, &Case, Result<Outcome, String>)> = corpus
        .cases
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let o = in_process(&file_name(i, c.cat), &c.bytes).outcome;
            (i, c, o)
        })
        .collect();
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get()).clamp(2, 8);
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<(usize, BinRun, Option<BinRun>)>> = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| {
                loop {
                    let k = next.fetch_add(1, Ordering::SeqCst);
                    let Some((i, case, outcome)) = jobs.get(k) else {
                        break;
                    };
                    let path = dir.path().join(file_name(*i, case.cat));
                    std::fs::write(&path, &case.bytes).expect("write case");
                    let p = path.to_str().unwrap();
                    let inspect = run_bin(&["inspect", p]);
                    let run = match outcome {
                        Ok(o) if *o != OpenErr => Some(run_bin(&[
                            "run",
                            "--model",
                            p,
                            "--layer",
                            "0",
                            "--backend",
                            "cpu",
                            "--quiet",
                        ])),
                        _ => None,
                    };
                    let _ = std::fs::remove_file(&path);
                    results.lock().unwrap().push((*i, inspect, run));
                }
            });
        }
    });
    let mut results = results.into_inner().unwrap();
    results.sort_by_key(|r| r.0);
    let mut fails = Failures::default();
    let (mut n_inspect, mut n_run) = (0, 0);
    let mut run_codes: BTreeMap<i32, usize> = BTreeMap::new();
    for (i, inspect, run) in &results {
        let (_, case, outcome) = &jobs[*i];
        let fname = file_name(*i, case.cat);
        n_inspect += 1;
        match outcome {
            Ok(OpenErr) => check_error_exit(&mut fails, &case.name, "inspect", &fname, inspect),
            _ => {
                if inspect.0 != 0 || inspect.2.contains("panicked") {
                    fails.fail(
                        &case.name,
                        "inspect-exit",
                        format!("opens in process, inspect exit {}: {:?}", inspect.0, inspect.2),
                    );
                }
            }
        }
        if let Some(run) = run {
            n_run += 1;
            *run_codes.entry(run.0).or_default() += 1;
            match outcome {
                Ok(Valid) => {
                    if !(run.0 == 0 || run.0 == 1) || run.2.contains("panicked") {
                        fails.fail(
                            &case.name,
                            "run-exit",
                            format!("loads in process, run exit {}: {:?}", run.0, run.2),
                        );
                    }
                }
                _ => check_error_exit(&mut fails, &case.name, "run", &fname, run),
            }
        }
    }
    println!("binary: {n_inspect} inspect runs, {n_run} run runs (exit codes {run_codes:?})");
    let s = fails.finish(
        &[
            "inspect-exit",
            "run-exit",
            "stderr-one-line",
            "stderr-names-file",
            "stderr-control-chars",
        ],
        "binary",
    );
    println!("{s}");
}

/// Values that are not finite in a weight matrix are a finding of the run, not a silent pass.
#[test]
fn non_finite_weights_are_a_finding() {
    let _g = serial();
    let mut g = deepseek2(Dims::default(), false);
    let i = tensor_pos(&g, KV_A);
    // 13 non-finite values: 6 NaN, 4 +inf, 3 -inf.
    let bad = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY];
    let mut n_bad = 0;
    for (k, pos) in [3usize, 40, 77, 100, 150, 201, 333, 400, 512, 600, 700, 800, 895]
        .iter()
        .enumerate()
    {
        let v = if k < 6 {
            bad[0]
        } else if k < 10 {
            bad[1]
        } else {
            bad[2]
        };
        g.tensors[i].data[pos * 4..pos * 4 + 4].copy_from_slice(&v.to_le_bytes());
        n_bad += 1;
    }
    assert_eq!(n_bad, 13);
    let (_d, p) = write_temp(&g.build().bytes, "nan-weights.gguf");
    let (code, out, err) = run_bin(&[
        "run",
        "--model",
        p.to_str().unwrap(),
        "--layer",
        "0",
        "--backend",
        "cpu",
    ]);
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(code, 1, "expected exit 1 (a finding); stdout:\n{out}\nstderr:\n{err}");
    let line = out
        .lines()
        .find(|l| l.contains(KV_A))
        .unwrap_or_else(|| panic!("no finding line names {KV_A}; stdout:\n{out}"));
    let numbers: Vec<&str> = line.split(|c: char| !c.is_ascii_digit()).collect();
    assert!(
        numbers.contains(&"13"),
        "the finding must count the 13 non-finite values: {line}"
    );
}

/// `HOSTILE_DUMP_DIR=DIR cargo test --release --test tests hostile::dump_corpus` writes every case
/// to
/// `DIR/hostile-NNN-<category>.gguf` (the names the other tests use) and `DIR/index.tsv` (file,
/// case, expected outcome), to reproduce a failure by hand or seed a fuzzer. A no-op otherwise.
#[test]
fn dump_corpus() {
    let Some(dir) = std::env::var_os("HOSTILE_DUMP_DIR") else {
        return;
    };
    let dir = std::path::PathBuf::from(dir);
    std::fs::create_dir_all(&dir).expect("create HOSTILE_DUMP_DIR");
    let mut index = String::new();
    for (i, c) in corpus().cases.iter().enumerate() {
        let f = file_name(i, c.cat);
        std::fs::write(dir.join(&f), &c.bytes).expect("write case");
        let expect = c.expect.map_or("any".to_string(), |o| format!("{o:?}"));
        index.push_str(&format!("{f}\t{}\t{expect}\n", c.name.replace(['\t', '\n'], " ")));
    }
    std::fs::write(dir.join("index.tsv"), index).expect("write index");
}
