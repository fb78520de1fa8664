//! `run --export-inputs`: one layer's attention inputs, from the reference, in the layouts that
//! production MLA kernels take.
//!
//! A production kernel (FlashMLA, vLLM's Triton MLA decode, FlashInfer MLA, FA3) is best judged
//! alone: fed inputs that are right by construction, so any difference in its outputs is its own.
//! This module writes those inputs from the f64 reference trace of a run (rounded to f32) into
//! one safetensors file: the absorbed decode query and the paged latent cache behind a shuffled
//! block table (the engine paths' own layout, [`paged_block_tables`]), and the expanded prefill
//! query, key and value with the sequences' cumulative lengths. Its metadata carries the softmax
//! scale, the dims and a format-2 dump header for the runner that calls the kernels to complete,
//! so that `mla-diff compare` judges the kernels' outputs against the reference of the same
//! layer input (docs/dump-format.md, "Kernel inputs").
//!
//! A DSA layer (`deepseek32`, `glm-dsa`) attends only to the keys its lightning indexer kept, so
//! its export carries the reference's selection in the two index layouts vLLM's sparse MLA
//! kernels take (per-request positions as the indexer writes them, and global cache slots as
//! `triton_convert_req_index_to_global_index` hands them to FlashMLA and FA3), with the f64
//! attention of the exported query and cache over that selection as the expected output: the
//! dense prefill tensors, which describe causal attention over every key, are left out.

use std::collections::BTreeMap;
use std::path::PathBuf;

use crate::compute::engine::paged_block_tables;
use crate::core::batch::Batch;
use crate::core::error::{Error, Result};
use crate::core::st::{RawTensor, raw_to_bytes};
use crate::core::trace::{Site, Stage, Trace, TraceTensor};
use crate::judge::report::RunConfig;
use crate::model::config::MlaConfig;
use crate::model::gguf::GgufFile;

/// The `format` metadata value of a kernel-inputs file.
pub const FORMAT: &str = "mla-diff kernel inputs 1";

/// The file written inside the `--export-inputs` folder.
pub const FILE_NAME: &str = "inputs.safetensors";

/// What `run --export-inputs DIR [--rank R]` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportRequest {
    /// The folder (created when missing); the file is `dir/inputs.safetensors`.
    pub dir: PathBuf,
    /// With `--tp TP`: export only the heads of this rank, `R·N/TP .. (R+1)·N/TP`; `None`: all N.
    pub rank: Option<usize>,
    /// Replace an existing `inputs.safetensors`.
    pub force: bool,
}

/// What was written, for the line `run` prints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exported {
    /// The file.
    pub path: PathBuf,
    /// The layer.
    pub layer: usize,
    /// Tokens T.
    pub tokens: usize,
    /// The heads exported, `[a, b)`.
    pub heads: (usize, usize),
    /// Size of the file in bytes.
    pub bytes: u64,
}

impl ExportRequest {
    /// `dir/inputs.safetensors`.
    pub fn path(&self) -> PathBuf {
        self.dir.join(FILE_NAME)
    }

    /// The heads `[a, b)` exported for a model of `n_head` heads at `tp` ranks (all N without a
    /// rank). `tp` must divide `n_head` and the rank be below `tp` ([`ExportRequest::check`]).
    pub fn heads(&self, n_head: usize, tp: usize) -> (usize, usize) {
        match self.rank {
            Some(r) => {
                let nh = n_head / tp.max(1);
                (r * nh, (r + 1) * nh)
            }
            None => (0, n_head),
        }
    }

    /// Everything that can be refused before any work: more than one layer, a batch not at
    /// position 0, a rank outside `0..tp` or a `tp` that does not divide N, a batch whose ids
    /// (or a DSA model's `K_idx`) do not fit I32, the folder being a file, and an existing
    /// `inputs.safetensors` without `force`.
    ///
    /// Errors: [`Error::Usage`], one line naming the flag or the file.
    pub fn check(&self, file: &GgufFile, cfg: &MlaConfig, rc: &RunConfig) -> Result<()> {
        if rc.layers.len() != 1 {
            return Err(Error::Usage(format!(
                "--export-inputs writes the inputs of one layer; {} layers are requested (use --layer N)",
                rc.layers.len()
            )));
        }
        if let Some(s) = rc.batch.seqs.iter().find(|s| s.start_pos != 0) {
            return Err(Error::Usage(format!(
                "--export-inputs needs --start-pos 0 (sequences start at position {}): the kernel \
                 inputs hold whole sequences from position 0",
                s.start_pos
            )));
        }
        let tp = rc.path_options.tp.max(1);
        if !cfg.n_head.is_multiple_of(tp) {
            return Err(Error::Usage(format!(
                "--tp {tp} does not divide the {} attention heads of {}",
                cfg.n_head,
                file.path().display()
            )));
        }
        if let Some(r) = self.rank
            && r >= tp
        {
            return Err(Error::Usage(format!(
                "--rank {r} is not a rank of --tp {tp} (ranks 0..{tp})"
            )));
        }
        let (num_blocks, _) = paged_block_tables(&rc.batch, rc.path_options.page_size, rc.seed);
        let t = rc.batch.n_tokens();
        let top_k = cfg.indexer.as_ref().map_or(0, |ix| ix.top_k);
        let slots = num_blocks.saturating_mul(rc.path_options.page_size.max(1));
        if t.max(num_blocks).max(top_k).max(if top_k > 0 { slots } else { 0 }) > i32::MAX as usize {
            return Err(Error::Usage(format!(
                "--export-inputs: T = {t} tokens in {num_blocks} cache blocks (K_idx = {top_k}) do not fit \
                 the I32 tensors of the export"
            )));
        }
        if self.dir.exists() && !self.dir.is_dir() {
            return Err(Error::Usage(format!(
                "--export-inputs {}: exists and is not a folder",
                self.dir.display()
            )));
        }
        if !self.dir.exists() {
            // The export creates its folder: every existing ancestor must be a folder.
            let mut up = self.dir.parent();
            while let Some(d) = up.filter(|d| !d.as_os_str().is_empty() && !d.exists()) {
                up = d.parent();
            }
            if let Some(d) = up.filter(|d| !d.as_os_str().is_empty() && !d.is_dir()) {
                return Err(Error::Usage(format!(
                    "--export-inputs {}: {} is not a folder",
                    self.dir.display(),
                    d.display()
                )));
            }
            return crate::core::fsio::check_output_folder(&self.dir);
        }
        crate::core::fsio::check_output(&self.path(), self.force)
    }
}

/// Size in bytes of the tensors of an export of `nh` heads for the run `rc` (the file adds a
/// header of a few KB): what the memory check adds to the run's own estimate.
pub fn estimate_bytes(cfg: &MlaConfig, rc: &RunConfig, nh: usize) -> u64 {
    let t = rc.batch.n_tokens() as u64;
    let s = rc.batch.seqs.len() as u64;
    let page = rc.path_options.page_size.max(1) as u64;
    let (h, l, p, r, v, nh) = (
        cfg.hidden as u64,
        cfg.kv_lora_rank as u64,
        cfg.qk_nope_head_dim as u64,
        cfg.qk_rope_head_dim as u64,
        cfg.v_head_dim as u64,
        nh as u64,
    );
    let blocks: u64 = rc.batch.seqs.iter().map(|q| (q.len as u64).div_ceil(page)).sum::<u64>() + 1;
    let max_blocks = rc
        .batch
        .seqs
        .iter()
        .map(|q| (q.len as u64).div_ceil(page))
        .max()
        .unwrap_or(0);
    let decode = t * h + t * nh * (l + r) + blocks * page * (l + r);
    let i32s = t * max_blocks + t;
    match &cfg.indexer {
        // DSA: no dense prefill tensors; two [T, K] index tensors, the valid counts, and the
        // expected latent and LSE in f64.
        Some(ix) => {
            let k = ix.top_k as u64;
            4 * (decode + i32s + 2 * t * k + t) + 8 * (t * nh * (l + 1))
        }
        None => 4 * (decode + 2 * t * nh * (p + r) + t * nh * v + i32s + s + 1),
    }
}

/// One reference site, checked against its expected shape.
fn site<'a>(reference: &'a Trace, layer: usize, stage: Stage, shape: &[usize]) -> Result<&'a TraceTensor> {
    let s = Site::new(layer, stage);
    let t = reference
        .get(&s)
        .ok_or_else(|| Error::Internal(format!("--export-inputs: the reference recorded no {s}")))?;
    if t.shape != shape {
        return Err(Error::Internal(format!(
            "--export-inputs: the reference's {s} has shape {:?}, expected {shape:?}",
            t.shape
        )));
    }
    Ok(t)
}

/// Little-endian f32 bytes of `[rows, heads a..b, parts…]`: for every row and head, the columns
/// of each part (`(tensor [rows, N, w] or [rows, w] broadcast over heads, width w, columns)`),
/// concatenated; values rounded from f64 to f32.
fn per_head_rows(
    rows: usize,
    n: usize,
    heads: (usize, usize),
    parts: &[(&TraceTensor, usize, std::ops::Range<usize>)],
) -> Vec<u8> {
    let width: usize = parts.iter().map(|(_, _, c)| c.len()).sum();
    let mut out = Vec::with_capacity(rows * (heads.1 - heads.0) * width * 4);
    for i in 0..rows {
        for h in heads.0..heads.1 {
            for (t, w, cols) in parts {
                let per_head = t.shape.len() == 3;
                let base = if per_head { (i * n + h) * w } else { i * w };
                for c in cols.clone() {
                    out.extend_from_slice(&(t.get(base + c) as f32).to_le_bytes());
                }
            }
        }
    }
    out
}

/// The i32 bytes of `v` (every value checked to fit by [`ExportRequest::check`]).
fn i32_bytes(v: impl IntoIterator<Item = usize>) -> Vec<u8> {
    v.into_iter()
        .flat_map(|x| i32::try_from(x).unwrap_or(i32::MAX).to_le_bytes())
        .collect()
}

/// The format-2 dump header a kernel runner completes (docs/dump-format.md, "Kernel inputs"):
/// the model's identity with `layer`'s hash, one step `kernel` of the batch's sequences from
/// position 0, the heads, and natural-log token-major conventions.
pub fn dump_header(file: &GgufFile, batch: &Batch, layer: usize, heads: (usize, usize)) -> serde_json::Value {
    let seqs: Vec<serde_json::Value> = batch
        .seqs
        .iter()
        .map(|s| serde_json::json!({"new": s.len, "context": 0}))
        .collect();
    let mut model = serde_json::json!({
        "file": crate::model::fixture::model_file_name(file),
        "bytes": file.file_len(),
        "index_sha256": file.index_sha256_hex(),
        "layer_sha256": {layer.to_string(): file.layer_sha256_hex(layer)},
    });
    if !file.is_gguf() {
        model["format"] = crate::model::dump::HF_SAFETENSORS.into();
    }
    serde_json::json!({
        "model": model,
        "steps": [{"name": "kernel", "seqs": seqs}],
        "heads": [heads.0, heads.1],
        "conventions": {"lse_base": "e", "layout": "token-major"},
    })
}

/// The bytes of `inputs.safetensors` for heads `[a, b)` of layer `layer`, from the reference
/// trace `reference` of the run `rc` (docs/dump-format.md, "Kernel inputs" lists every tensor
/// and metadata key).
///
/// Errors: [`Error::Internal`] when the reference lacks a site or holds it in another shape (a
/// bug, not an input error), and for heads outside `0..N` ([`ExportRequest::heads`] gives heads
/// inside).
pub fn build(
    file: &GgufFile,
    cfg: &MlaConfig,
    rc: &RunConfig,
    layer: usize,
    reference: &Trace,
    heads: (usize, usize),
) -> Result<Vec<u8>> {
    let [n, l, p, r, v] = cfg.dims().nlprv();
    let hd = cfg.hidden;
    if heads.0 >= heads.1 || heads.1 > n {
        return Err(Error::internal(format!(
            "--export-inputs: heads [{}, {}) outside the {n} heads",
            heads.0, heads.1
        )));
    }
    let nh = heads.1 - heads.0;
    let batch = &rc.batch;
    let t = batch.n_tokens();
    let hidden = site(reference, layer, Stage::HiddenIn, &[t, hd])?;
    let q_pe = site(reference, layer, Stage::QPeRoped, &[t, n, r])?;
    let ql_nope = site(reference, layer, Stage::QlNope, &[t, n, l])?;
    let kv_c = site(reference, layer, Stage::KvCNormed, &[t, l])?;
    let k_pe = site(reference, layer, Stage::KPeRoped, &[t, r])?;

    // The paged latent cache: every token's row [kv_c_normed | k_pe_roped] at its slot.
    let page = rc.path_options.page_size.max(1);
    let (num_blocks, tables) = paged_block_tables(batch, page, rc.seed);
    let max_blocks = tables.iter().map(Vec::len).max().unwrap_or(0);
    let width = l + r;
    let mut cache = vec![0u8; num_blocks * page * width * 4];
    let offsets = batch.offsets();
    let mut block_table = Vec::with_capacity(t * max_blocks);
    let mut seqlens = Vec::with_capacity(t);
    for (s, (sq, &off)) in batch.seqs.iter().zip(&offsets).enumerate() {
        for i in 0..sq.len {
            let slot = tables[s][i / page] * page + i % page;
            let row = &mut cache[slot * width * 4..(slot + 1) * width * 4];
            let vals = (0..l)
                .map(|c| kv_c.get((off + i) * l + c))
                .chain((0..r).map(|c| k_pe.get((off + i) * r + c)));
            for (dst, x) in row.chunks_exact_mut(4).zip(vals) {
                dst.copy_from_slice(&(x as f32).to_le_bytes());
            }
            block_table.extend(tables[s].iter().copied());
            block_table.extend(std::iter::repeat_n(0, max_blocks - tables[s].len()));
            seqlens.push(i + 1);
        }
    }

    let raw = |dtype, shape: Vec<usize>, bytes: Vec<u8>| RawTensor { dtype, shape, bytes };
    let f32t = safetensors::Dtype::F32;
    let i32t = safetensors::Dtype::I32;
    let hidden_bytes: Vec<u8> = (0..t * hd).flat_map(|i| (hidden.get(i) as f32).to_le_bytes()).collect();
    let mut tensors: Vec<(String, RawTensor)> = vec![
        ("hidden_in".into(), raw(f32t, vec![t, hd], hidden_bytes)),
        (
            "decode.q".into(),
            raw(
                f32t,
                vec![t, nh, l + r],
                per_head_rows(t, n, heads, &[(ql_nope, l, 0..l), (q_pe, r, 0..r)]),
            ),
        ),
        (
            "decode.kv_cache".into(),
            raw(f32t, vec![num_blocks, page, width], cache),
        ),
        (
            "decode.block_table".into(),
            raw(i32t, vec![t, max_blocks], i32_bytes(block_table)),
        ),
        ("decode.cache_seqlens".into(), raw(i32t, vec![t], i32_bytes(seqlens))),
    ];
    let mut top_k = None;
    if let Some(ix) = &cfg.indexer {
        let rows = selection_rows(reference, layer, t)?;
        let paged = Paged {
            tables: &tables,
            page,
            offsets: &offsets,
        };
        let lat = Latent {
            ql_nope,
            q_pe,
            kv_c,
            k_pe,
            n,
        };
        tensors.extend(sparse_tensors(
            batch,
            &rows,
            ix.top_k,
            &paged,
            &lat,
            heads,
            cfg.softmax_scale,
        ));
        top_k = Some(ix.top_k);
    } else {
        tensors.extend(prefill_tensors(cfg, batch, layer, reference, heads, q_pe, k_pe)?);
    }
    let list = |v: Vec<String>| v.join(",");
    let header = dump_header(file, batch, layer, heads);
    let meta: BTreeMap<String, String> = [
        ("format", FORMAT.to_string()),
        ("softmax_scale", format!("{}", cfg.softmax_scale)),
        ("page_size", page.to_string()),
        ("n_head", n.to_string()),
        ("heads", format!("{},{}", heads.0, heads.1)),
        ("kv_lora_rank", l.to_string()),
        ("qk_rope_head_dim", r.to_string()),
        ("qk_nope_head_dim", p.to_string()),
        ("v_head_dim", v.to_string()),
        ("layer", layer.to_string()),
        ("seqs", list(batch.seqs.iter().map(|s| s.len.to_string()).collect())),
        ("dump_header", header.to_string()),
    ]
    .into_iter()
    .chain(top_k.map(|k| ("index_topk", k.to_string())))
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    raw_to_bytes(&tensors, &meta)
}

/// The `prefill.*` tensors of a dense layer (expanded `q`, `k`, `v` of heads `[a, b)` and the
/// sequences' `cu_seqlens`), from the reference sites `q`, `k_nope`, `v` and the roped `q_pe`
/// [T, N, R] and `k_pe` [T, R] the caller looked up.
///
/// Errors: [`Error::Internal`] as [`build`].
fn prefill_tensors(
    cfg: &MlaConfig,
    batch: &Batch,
    layer: usize,
    reference: &Trace,
    heads: (usize, usize),
    q_pe: &TraceTensor,
    k_pe: &TraceTensor,
) -> Result<Vec<(String, RawTensor)>> {
    let [n, _, p, r, v] = cfg.dims().nlprv();
    let (t, nh) = (batch.n_tokens(), heads.1 - heads.0);
    let q = site(reference, layer, Stage::Q, &[t, n, p + r])?;
    let k_nope = site(reference, layer, Stage::KNope, &[t, n, p])?;
    let vv = site(reference, layer, Stage::V, &[t, n, v])?;
    let raw = |dtype, shape: Vec<usize>, bytes: Vec<u8>| RawTensor { dtype, shape, bytes };
    let f32t = safetensors::Dtype::F32;
    Ok(vec![
        (
            "prefill.q".into(),
            raw(
                f32t,
                vec![t, nh, p + r],
                per_head_rows(t, n, heads, &[(q, p + r, 0..p), (q_pe, r, 0..r)]),
            ),
        ),
        (
            "prefill.k".into(),
            raw(
                f32t,
                vec![t, nh, p + r],
                per_head_rows(t, n, heads, &[(k_nope, p, 0..p), (k_pe, r, 0..r)]),
            ),
        ),
        (
            "prefill.v".into(),
            raw(f32t, vec![t, nh, v], per_head_rows(t, n, heads, &[(vv, v, 0..v)])),
        ),
        (
            "prefill.cu_seqlens".into(),
            raw(
                safetensors::Dtype::I32,
                vec![batch.seqs.len() + 1],
                i32_bytes(cu_seqlens(batch)),
            ),
        ),
    ])
}

/// The reference's DSA selection of `layer`: per packed token, the kept key positions within its
/// sequence (ascending), read from the `idx_topk` site [T, K'] (−1 padding dropped).
///
/// Errors: [`Error::Internal`] when the reference recorded no `idx_topk` of T rows, or holds a
/// value that is not a key position.
fn selection_rows(reference: &Trace, layer: usize, t: usize) -> Result<Vec<Vec<usize>>> {
    let s = Site::new(layer, Stage::IdxTopk);
    let sel = reference
        .get(&s)
        .ok_or_else(|| Error::Internal(format!("--export-inputs: the reference recorded no {s}")))?;
    if sel.shape.len() != 2 || sel.shape[0] != t {
        return Err(Error::Internal(format!(
            "--export-inputs: the reference's {s} has shape {:?}, expected [{t}, K]",
            sel.shape
        )));
    }
    let k = sel.shape[1];
    (0..t)
        .map(|i| {
            let mut row = Vec::with_capacity(k);
            for c in 0..k {
                let x = sel.get(i * k + c);
                if x < 0.0 {
                    continue;
                }
                if x.fract() != 0.0 || x > i32::MAX as f64 {
                    return Err(Error::Internal(format!(
                        "--export-inputs: {s} holds {x}, not a key position"
                    )));
                }
                row.push(x as usize);
            }
            Ok(row)
        })
        .collect()
}

/// Where each token's cache row lives: the block tables of [`paged_block_tables`], the page size
/// and each sequence's first packed token.
struct Paged<'a> {
    /// Per sequence, its blocks in order.
    tables: &'a [Vec<usize>],
    /// Tokens per block.
    page: usize,
    /// [`Batch::offsets`].
    offsets: &'a [usize],
}

impl Paged<'_> {
    /// The global slot of key position `pos` of sequence `s`: the row of `decode.kv_cache` viewed
    /// as [num_blocks · page_size, L+R].
    fn slot(&self, s: usize, pos: usize) -> usize {
        self.tables[s][pos / self.page] * self.page + pos % self.page
    }
}

/// The reference sites of the absorbed attention: `ql_nope` [T, N, L], `q_pe_roped` [T, N, R],
/// `kv_c_normed` [T, L], `k_pe_roped` [T, R], with N.
struct Latent<'a> {
    ql_nope: &'a TraceTensor,
    q_pe: &'a TraceTensor,
    kv_c: &'a TraceTensor,
    k_pe: &'a TraceTensor,
    n: usize,
}

impl Latent<'_> {
    /// Token `i`'s query of head `h` as exported: `ql_nope ‖ q_pe_roped`, rounded to f32.
    fn query(&self, i: usize, h: usize) -> Vec<f64> {
        let (l, r) = (self.kv_c.shape[1], self.k_pe.shape[1]);
        let a = (0..l).map(|c| self.ql_nope.get((i * self.n + h) * l + c));
        let b = (0..r).map(|c| self.q_pe.get((i * self.n + h) * r + c));
        a.chain(b).map(|x| f64::from(x as f32)).collect()
    }

    /// Token `j`'s cache row as exported: `kv_c_normed ‖ k_pe_roped`, rounded to f32.
    fn key(&self, j: usize) -> Vec<f64> {
        let (l, r) = (self.kv_c.shape[1], self.k_pe.shape[1]);
        let a = (0..l).map(|c| self.kv_c.get(j * l + c));
        let b = (0..r).map(|c| self.k_pe.get(j * r + c));
        a.chain(b).map(|x| f64::from(x as f32)).collect()
    }
}

/// The `sparse.*` tensors of a DSA layer (docs/dump-format.md, "Kernel inputs"): the selection
/// `rows` as per-request positions and as global cache slots, both [T, `top_k`] padded with −1,
/// the valid count per row, and the expected `attn_latent` [T, nh, L] and natural-log `lse`
/// [T, nh] in f64: softmax(`scale` · q·k) over each row's selected keys, with q and k the exported
/// f32 `decode.q` and `decode.kv_cache` rows (one row per (token, head), summed in key order).
fn sparse_tensors(
    batch: &Batch,
    rows: &[Vec<usize>],
    top_k: usize,
    paged: &Paged<'_>,
    lat: &Latent<'_>,
    heads: (usize, usize),
    scale: f64,
) -> Vec<(String, RawTensor)> {
    use rayon::prelude::*;
    let t = rows.len();
    let l = lat.kv_c.shape[1];
    let nh = heads.1 - heads.0;
    let seq_of: Vec<usize> = batch
        .seqs
        .iter()
        .enumerate()
        .flat_map(|(s, sq)| std::iter::repeat_n(s, sq.len))
        .collect();
    let pad = |v: Vec<i64>| -> Vec<u8> {
        let n = v.len();
        v.into_iter()
            .chain(std::iter::repeat_n(-1, top_k.saturating_sub(n)))
            .take(top_k)
            .flat_map(|x| i32::try_from(x).unwrap_or(-1).to_le_bytes())
            .collect()
    };
    let mut positions = Vec::with_capacity(t * top_k * 4);
    let mut slots = Vec::with_capacity(t * top_k * 4);
    for (i, row) in rows.iter().enumerate() {
        positions.extend(pad(row.iter().map(|&p| p as i64).collect()));
        slots.extend(pad(row.iter().map(|&p| paged.slot(seq_of[i], p) as i64).collect()));
    }
    let lengths = i32_bytes(rows.iter().map(|r| r.len().min(top_k)));
    // One (token, head) row per task; each sums its keys in order, so the bits do not depend on
    // the threads.
    let out: Vec<(Vec<f64>, f64)> = (0..t * nh)
        .into_par_iter()
        .map(|x| {
            let (i, h) = (x / nh, heads.0 + x % nh);
            let q = lat.query(i, h);
            let off = paged.offsets[seq_of[i]];
            let keys: Vec<Vec<f64>> = rows[i].iter().take(top_k).map(|&p| lat.key(off + p)).collect();
            let logits: Vec<f64> = keys
                .iter()
                .map(|k| scale * q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>())
                .collect();
            let m = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = logits.iter().map(|&z| (z - m).exp()).collect();
            let sum: f64 = e.iter().sum();
            let mut o = vec![0f64; l];
            for (ej, k) in e.iter().zip(&keys) {
                for (oc, kc) in o.iter_mut().zip(&k[..l]) {
                    *oc += ej / sum * kc;
                }
            }
            (o, m + sum.ln())
        })
        .collect();
    let f64_bytes = |v: &mut dyn Iterator<Item = f64>| -> Vec<u8> { v.flat_map(f64::to_le_bytes).collect() };
    let latent = f64_bytes(&mut out.iter().flat_map(|(o, _)| o.iter().copied()));
    let lse = f64_bytes(&mut out.iter().map(|(_, s)| *s));
    let raw = |dtype, shape: Vec<usize>, bytes: Vec<u8>| RawTensor { dtype, shape, bytes };
    let i32t = safetensors::Dtype::I32;
    let f64t = safetensors::Dtype::F64;
    vec![
        ("sparse.topk_indices".into(), raw(i32t, vec![t, top_k], positions)),
        ("sparse.indices".into(), raw(i32t, vec![t, top_k], slots)),
        ("sparse.topk_length".into(), raw(i32t, vec![t], lengths)),
        ("sparse.expected_latent".into(), raw(f64t, vec![t, nh, l], latent)),
        ("sparse.expected_lse".into(), raw(f64t, vec![t, nh], lse)),
    ]
}

/// `cu_seqlens` of `batch`: 0, then the running total of the sequence lengths ([S+1]).
fn cu_seqlens(batch: &Batch) -> Vec<usize> {
    let mut cu = vec![0usize];
    for sq in &batch.seqs {
        cu.push(cu.last().copied().unwrap_or(0) + sq.len);
    }
    cu
}

/// Builds the export ([`build`]) and writes it to `req.path()` (the folder created when missing;
/// written through a temporary file and a rename, an existing file replaced only with `force`).
///
/// Errors: as [`build`]; [`Error::Io`] when the folder or the file cannot be written;
/// [`Error::Usage`] when the file exists and `force` is not set.
pub fn write(
    req: &ExportRequest,
    file: &GgufFile,
    cfg: &MlaConfig,
    rc: &RunConfig,
    layer: usize,
    reference: &Trace,
) -> Result<Exported> {
    let heads = req.heads(cfg.n_head, rc.path_options.tp);
    let bytes = build(file, cfg, rc, layer, reference, heads)?;
    let path = req.path();
    std::fs::create_dir_all(&req.dir).map_err(|e| Error::io(&req.dir, "create folder", e))?;
    crate::core::fsio::write_file_atomic(&path, &bytes, req.force)?;
    Ok(Exported {
        path,
        layer,
        tokens: rc.batch.n_tokens(),
        heads,
        bytes: bytes.len() as u64,
    })
}

impl Exported {
    /// The line `run` prints: the file, the layer, T, the heads and the size.
    pub fn line(&self, n_head: usize) -> String {
        format!(
            "kernel inputs: wrote {} (layer {}, T={}, heads [{}, {}) of {n_head}, {} bytes)",
            self.path.display(),
            self.layer,
            self.tokens,
            self.heads.0,
            self.heads.1,
            self.bytes
        )
    }
}
