//! Reading a dump file of either format into our sites, shapes and orders.
//!
//! A dump is untrusted input written by someone else's hook, so reading is where it is checked:
//! each tensor is a site (by name or through the map), `tokens`, `positions`, or ignored and
//! listed; a site's dtype, byte length and shape are checked against the model before its values
//! are used; T, the sequences and their positions must agree. Every check fails as one input
//! error naming the file and the tensor or metadata key (exit 2), never a panic. Format 2 is
//! read as one format-1 dump per step, so both formats share one reader and one set of checks.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use safetensors::{Dtype as StDtype, SafeTensors};

use super::conventions::{DumpConventions, EngineDtype, KvAOrder, Layout, RopeOrder, conventions, map_from_metadata};
use super::dump_error;
use super::header::{DumpHeader, StepSpec, check_plain, check_plain_json, header_from_metadata, heads_config};
use super::layout::{expected_shape_keys, hf_rope_to_interleaved, kv_a_to_latent_rope, normalize_shape};
use super::map::Map;
use crate::core::batch::{Batch, SeqSpec};
#[cfg(doc)]
use crate::core::error::Error;
use crate::core::error::Result;
use crate::core::st::header_error;
use crate::core::trace::{Site, Stage, Trace, TraceTensor};
use crate::model::config::MlaConfig;

/// What was read from a dump, in our sites and layouts.
#[derive(Debug, Clone)]
pub struct Dump {
    /// The dump file.
    pub path: PathBuf,
    /// The built-in map picked from the metadata when none was given ([`map_from_metadata`]).
    pub map: Option<String>,
    /// `__metadata__`.
    pub metadata: BTreeMap<String, String>,
    /// Each dumped layer's sites (f32 or f64 data, our shapes).
    pub layers: BTreeMap<usize, Trace>,
    /// Token ids, if dumped.
    pub tokens: Option<Vec<u32>>,
    /// The batch: sequence lengths and start positions.
    pub batch: Batch,
    /// The engine's compute dtype (metadata `dtype`; picks the tolerance rows).
    pub dtype: EngineDtype,
    /// Conversions applied (one line each), e.g. "L0.q_pe_roped: hf rope order → interleaved".
    pub conversions: Vec<String>,
    /// Tensors that are not sites and that no map rule renamed.
    pub ignored: Vec<String>,
}

/// A format-2 dump: its header and one [`Dump`] per step (the step's sites, rows = its new
/// tokens in sequence order).
#[derive(Debug, Clone)]
pub struct StepsDump {
    /// The dump file.
    pub path: PathBuf,
    /// The header.
    pub header: DumpHeader,
    /// `(step, its sites)`, in step order.
    pub steps: Vec<(StepSpec, Dump)>,
    /// Per step (same order), the paged KV cache metadata it recorded.
    pub paging: Vec<StepPaging>,
    /// Tensors that belong to no step and are not weights.
    pub ignored: Vec<String>,
    /// `seq{i}.token_ids`: every token id of header sequence `i`, a prefix-cache hit's
    /// included, where the dump holds them.
    pub token_ids: BTreeMap<usize, Vec<u32>>,
}

/// What a format-2 step recorded of the engine's paged KV cache: the metadata its attention read
/// the cache with and its new rows were written with. Every field is optional; the `paged-kv`
/// replays search what is missing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepPaging {
    /// Tokens per cache block (`steps[k].page_size`), 1 ..= [`super::MAX_PAGE_SIZE`].
    pub page_size: Option<usize>,
    /// `s{k}.block_table` `[S, B]`: row `i` = header sequence `i`'s block ids as the engine's
    /// attention read them in this step, padding included as the engine had it (each id −1 ..
    /// 2³¹−1).
    pub block_table: Option<Vec<Vec<i64>>>,
    /// `s{k}.slot_mapping` `[T]`: the cache slot each of the step's new rows (sequence order) was
    /// written to, `block id · page_size + offset`; −1 = not written (each −1 .. 2⁴⁸).
    pub slot_mapping: Option<Vec<i64>>,
}

/// The largest cache slot a `slot_mapping` may hold: 2⁴⁸ slots is beyond any engine's cache, and
/// every such value is exact in the f64 the reader decodes integers through.
const MAX_SLOT: f64 = (1u64 << 48) as f64;

/// The step tensors that are the engine's paged-cache metadata rather than sites.
const PAGING_TENSORS: [&str; 2] = ["block_table", "slot_mapping"];

/// Reads step `k`'s paged-cache metadata from `st`: `spec.page_size` (checked with the header),
/// `s{k}.block_table` and `s{k}.slot_mapping` when present, checked against the step (an integer
/// dtype; `[S, B]` with S the header's sequences and B ≥ 1; `[T]` with T the step's new tokens;
/// ids in range).
///
/// Errors: [`Error::Safetensors`] naming the file and the tensor.
fn step_paging(path: &Path, st: &SafeTensors<'_>, k: usize, spec: &StepSpec) -> Result<StepPaging> {
    let read = |name: &str| -> Result<Option<(Vec<usize>, Vec<f64>)>> {
        let full = format!("s{k}.{name}");
        let Ok(view) = st.tensor(&full) else {
            return Ok(None);
        };
        let shape = view.shape().to_vec();
        let (v, is_float) = values(path, &full, view.dtype(), &shape, view.data())?;
        if is_float {
            return Err(dump_error(
                path,
                &full,
                format!("dtype {:?}: must be an integer tensor (I32 or I64)", view.dtype()),
            ));
        }
        Ok(Some((shape, v)))
    };
    let s = spec.seqs.len();
    let t: usize = spec.seqs.iter().map(|q| q.new).sum();
    let block_table = match read("block_table")? {
        None => None,
        Some((shape, v)) => {
            let name = format!("s{k}.block_table");
            if shape.len() != 2 || shape[0] != s || shape[1] == 0 {
                return Err(dump_error(
                    path,
                    &name,
                    format!("shape {shape:?}: expected [S, B] with S = {s} (the header's sequences) and B ≥ 1"),
                ));
            }
            if let Some(bad) = v.iter().find(|&&x| !(-1.0..=f64::from(i32::MAX)).contains(&x)) {
                return Err(dump_error(
                    path,
                    &name,
                    format!("block id {bad}: expected −1 (padding) or an id from 0 to 2³¹−1"),
                ));
            }
            Some(
                v.chunks(shape[1])
                    .map(|row| row.iter().map(|&x| x as i64).collect())
                    .collect(),
            )
        }
    };
    let slot_mapping = match read("slot_mapping")? {
        None => None,
        Some((shape, v)) => {
            let name = format!("s{k}.slot_mapping");
            if shape.iter().filter(|&&d| d != 1).count() > 1 || v.len() != t {
                return Err(dump_error(
                    path,
                    &name,
                    format!("shape {shape:?}: expected [T] with T = {t} (the step's new tokens)"),
                ));
            }
            if let Some(bad) = v.iter().find(|&&x| !(-1.0..MAX_SLOT).contains(&x)) {
                return Err(dump_error(
                    path,
                    &name,
                    format!("slot {bad}: expected −1 (not written) or a slot from 0 to 2⁴⁸"),
                ));
            }
            Some(v.iter().map(|&x| x as i64).collect())
        }
    };
    Ok(StepPaging {
        page_size: spec.page_size,
        block_table,
        slot_mapping,
    })
}

/// What a dump file holds: format 1 (one forward) or format 2 (steps with an identity).
#[derive(Debug, Clone)]
pub enum DumpFile {
    /// Format 1.
    One(Dump),
    /// Format 2.
    Steps(Box<StepsDump>),
}

/// Refuses a dump whose tensor names or `__metadata__` text hold a control character
/// ([`check_plain`]): every name and string of a dump may reach the terminal or a report. A
/// value holding JSON is checked string by string once parsed (JSON text may hold newlines
/// between its tokens); the format-2 `header` is checked where it is parsed.
///
/// Returns `metadata`. Errors: [`Error::Safetensors`]
/// naming the tensor or the metadata key; a WEIGHTS file ([`refuse_weights_file`]).
fn check_printable(
    path: &Path,
    bytes: &[u8],
    metadata: std::collections::HashMap<String, String>,
) -> Result<std::collections::HashMap<String, String>> {
    let st = SafeTensors::deserialize(bytes).map_err(|e| header_error(path, bytes, &e))?;
    for name in st.names() {
        check_plain(path, &format!("tensor {name:?}"), name)?;
    }
    for (k, v) in &metadata {
        let field = format!("__metadata__.{}", k.escape_debug());
        check_plain(path, &field, k)?;
        if k == "header" {
            continue;
        }
        match serde_json::from_str::<serde_json::Value>(v) {
            Ok(json) => check_plain_json(path, &field, &json)?,
            Err(_) => check_plain(path, &field, v)?,
        }
    }
    refuse_weights_file(path, metadata)
}

/// The `format` metadata of the WEIGHTS files the hooks write (`mla-diff vllm weights 1`).
const WEIGHTS_FORMAT_PREFIX: &str = "mla-diff vllm weights";

/// Refuses a WEIGHTS file, the other file the hooks write beside a dump (an engine's loaded
/// weights), naming the command that reads it; hands any other file's metadata back.
fn refuse_weights_file(
    path: &Path,
    metadata: std::collections::HashMap<String, String>,
) -> Result<std::collections::HashMap<String, String>> {
    match metadata.get("format") {
        Some(f) if f.starts_with(WEIGHTS_FORMAT_PREFIX) => Err(dump_error(
            path,
            "__metadata__.format",
            format!(
                "`{f}`: this is an engine's loaded weights, not an activation dump: use `mla-diff weights --check`"
            ),
        )),
        _ => Ok(metadata),
    }
}

/// Reads a dump of either format. Format 2's steps are each read as a format-1 dump of the step's
/// new tokens (tensors `s{k}.…` without the prefix), with the header's dtype and conventions (a
/// base-2 `lse` converted to natural log; a declared `residual_scale` divided out of the
/// residual-stream sites, [`Conventions::residual_scale()`](super::Conventions::residual_scale);
/// each listed among the conversions); with `heads = [a, b]`, the per-head sites
/// ([`is_per_head`](super::is_per_head)) have `b − a` heads. A step's paged-cache metadata
/// (`page_size`, `s{k}.block_table`, `s{k}.slot_mapping`) goes to [`StepsDump::paging`].
/// `weights.…` tensors are for `weights --check` and skipped here.
///
/// Errors: as [`load_bytes`], with the file named `<dump> [step k `name`]` for a step's tensors;
/// a malformed header names its field (`heads` past the model's N heads included, a
/// `steps[k].page_size` out of range); a `block_table` or `slot_mapping` of a float dtype, a
/// shape that does not fit the step, or an id out of range names the tensor; so do a
/// `seq{i}.token_ids` missing for a sequence that declares `unrecorded` positions (the reference
/// rebuilds them from it) and a step's `s{k}.tokens` that differ from the token ids; a WEIGHTS
/// file (an engine's loaded weights) is sent to `weights --check`.
pub fn read(path: &Path, map: Option<&Map>, cfg: &MlaConfig) -> Result<DumpFile> {
    let bytes = crate::core::fsio::read_regular(path)?;
    if bytes.starts_with(b"GGUF") {
        return load_bytes(path, &bytes, map, cfg).map(DumpFile::One);
    }
    let (_, meta) = SafeTensors::read_metadata(&bytes).map_err(|e| header_error(path, &bytes, &e))?;
    let metadata = check_printable(path, &bytes, meta.metadata().clone().unwrap_or_default())?;
    let Some(header) = header_from_metadata(
        path,
        metadata.get("format").map(String::as_str),
        metadata.get("header").map(String::as_str),
    )?
    else {
        return load_bytes(path, &bytes, map, cfg).map(DumpFile::One);
    };
    let heads_cfg = match header.heads {
        Some([a, b]) if b > cfg.n_head => {
            return Err(dump_error(
                path,
                "__metadata__.header.heads",
                format!(
                    "[{a}, {b}]: the model has {} heads; expected 0 ≤ a < b ≤ {}",
                    cfg.n_head, cfg.n_head
                ),
            ));
        }
        Some(h) => Some(heads_config(cfg, h)),
        None => None,
    };
    if let Some(q) = &header.indexer_quant {
        check_indexer_quant_model(path, q, cfg)?;
    }
    // A dump of heads a..b: its per-head sites are read with b − a heads.
    let cfg = heads_cfg.as_ref().unwrap_or(cfg);
    let st = SafeTensors::deserialize(&bytes).map_err(|e| header_error(path, &bytes, &e))?;
    let mut ignored = Vec::new();
    for name in st.names() {
        let stepped = name
            .strip_prefix('s')
            .and_then(|r| r.split_once('.'))
            .is_some_and(|(k, _)| k.parse::<usize>().is_ok_and(|k| k < header.steps.len()));
        if !stepped && !name.starts_with("weights.") && seq_token_ids_index(name).is_none() {
            ignored.push(name.to_string());
        }
    }
    let token_ids = read_token_ids(path, &st, &header, cfg)?;
    ignored.sort();
    let mut steps = Vec::new();
    let mut paging = Vec::new();
    for (k, spec) in header.steps.iter().enumerate() {
        let prefix = format!("s{k}.");
        let mut meta1: std::collections::HashMap<String, String> = std::collections::HashMap::new();
        let lens: Vec<String> = spec
            .seqs
            .iter()
            .filter(|q| q.new > 0)
            .map(|q| q.new.to_string())
            .collect();
        meta1.insert("seq_lens".into(), lens.join(","));
        meta1.insert(
            "engine".into(),
            format!("{} {}", header.engine.name, header.engine.version),
        );
        if let Some(d) = &header.dtype {
            meta1.insert("dtype".into(), d.clone());
        }
        for (key, v) in [
            ("rope_order", &header.conventions.rope_order),
            ("layout", &header.conventions.layout),
            ("kv_a_order", &header.conventions.kv_a_order),
        ] {
            if let Some(v) = v {
                meta1.insert(key.into(), v.clone());
            }
        }
        let mut views = Vec::new();
        for name in st.names() {
            if let Some(rest) = name.strip_prefix(&prefix)
                && !PAGING_TENSORS.contains(&rest)
            {
                let view = st.tensor(name).map_err(|e| dump_error(path, name, e.to_string()))?;
                views.push((rest.to_string(), view));
            }
        }
        let step_bytes =
            safetensors::serialize(views, Some(meta1)).map_err(|e| dump_error(path, &prefix, e.to_string()))?;
        let label = PathBuf::from(format!("{} [step {k} `{}`]", path.display(), spec.name));
        let mut d = load_step_bytes(&label, &step_bytes, map, cfg, Some(StepRows::of(spec)))?;
        d.path = path.to_path_buf();
        if header.conventions.lse_base.as_deref() == Some("2") {
            let ln2 = std::f64::consts::LN_2;
            for trace in d.layers.values_mut() {
                let lse: Vec<(Site, TraceTensor)> = trace
                    .entries()
                    .iter()
                    .filter(|(s, _)| s.stage.is_lse())
                    .cloned()
                    .collect();
                for (site, t) in lse {
                    let v: Vec<f64> = t.to_f64().iter().map(|x| x * ln2).collect();
                    trace.record(site, TraceTensor::f64(t.shape.clone(), v));
                    d.conversions.push(format!("{site}: base-2 LSE → natural log (×ln 2)"));
                }
            }
        }
        if let Some(s) = header.conventions.residual_scale().filter(|&s| s != 1.0) {
            undo_residual_scale(&mut d, s);
        }
        if let Some(tokens) = &d.tokens {
            check_step_tokens(path, k, spec, tokens, &token_ids)?;
        }
        paging.push(step_paging(path, &st, k, spec)?);
        steps.push((spec.clone(), d));
    }
    Ok(DumpFile::Steps(Box::new(StepsDump {
        path: path.to_path_buf(),
        header,
        steps,
        paging,
        ignored,
        token_ids,
    })))
}

/// Checks a declared `indexer_quant` against the model: it has a DSA indexer, and the block
/// divides the indexer's head width `D_idx` (the query's blocks then never straddle two heads).
///
/// Errors: [`Error::Safetensors`] naming `__metadata__.header.indexer_quant` (no indexer) or its
/// `block`.
fn check_indexer_quant_model(path: &Path, q: &super::IndexerQuant, cfg: &MlaConfig) -> Result<()> {
    let Some(ix) = cfg.indexer.as_ref() else {
        return Err(dump_error(
            path,
            "__metadata__.header.indexer_quant",
            "declared, but the model has no DSA indexer (a deepseek32 or glm-dsa GGUF has one)",
        ));
    };
    if !ix.head_dim.is_multiple_of(q.block) {
        return Err(dump_error(
            path,
            "__metadata__.header.indexer_quant.block",
            format!(
                "{} does not divide the indexer's head width {} (D_idx)",
                q.block, ix.head_dim
            ),
        ));
    }
    Ok(())
}

/// Checks step `k`'s token ids `tokens` (`s{k}.tokens`, the step's rows in sequence order)
/// against the dump's `seq{i}.token_ids`: each new row of a sequence with token ids at position
/// `p` holds that sequence's id `p`. A step whose `tokens` do not have one id per new row is
/// left to the step reader's own checks.
///
/// Errors: [`Error::Safetensors`] naming `s{k}.tokens` and `seq{i}.token_ids` at the first row
/// that differs.
fn check_step_tokens(
    path: &Path,
    k: usize,
    spec: &StepSpec,
    tokens: &[u32],
    token_ids: &BTreeMap<usize, Vec<u32>>,
) -> Result<()> {
    if tokens.len() != spec.seqs.iter().map(|q| q.new).sum::<usize>() {
        return Ok(());
    }
    let mut row = 0;
    for (i, q) in spec.seqs.iter().enumerate() {
        if let Some(ids) = token_ids.get(&i) {
            for n in 0..q.new {
                let p = q.context + n;
                if ids.get(p) != Some(&tokens[row + n]) {
                    return Err(dump_error(
                        path,
                        format!("s{k}.tokens"),
                        format!(
                            "row {} (sequence {i}, position {p}) is token {}, seq{i}.token_ids[{p}] is {}",
                            row + n,
                            tokens[row + n],
                            ids.get(p).map_or("absent".to_string(), u32::to_string)
                        ),
                    ));
                }
            }
        }
        row += q.new;
    }
    Ok(())
}

/// The sequence index `i` of a tensor named `seq{i}.token_ids`.
fn seq_token_ids_index(name: &str) -> Option<usize> {
    name.strip_prefix("seq")?.strip_suffix(".token_ids")?.parse().ok()
}

/// Reads every `seq{i}.token_ids` of `st`: `i` one of the header's sequences, a 1-D integer
/// tensor as long as the sequence's tokens (its last step's context and new tokens), each id in
/// the vocabulary; a prefix-cache hit whose two sequences both have token ids must share their
/// first `len` ids; a sequence declaring `unrecorded` positions must have token ids.
///
/// Errors: [`Error::Safetensors`] naming the tensor, or the hit's
/// `__metadata__.header.steps[k].seqs[i].prefix`.
fn read_token_ids(
    path: &Path,
    st: &SafeTensors<'_>,
    header: &DumpHeader,
    cfg: &MlaConfig,
) -> Result<BTreeMap<usize, Vec<u32>>> {
    let n_seq = header.steps[0].seqs.len();
    let mut out = BTreeMap::new();
    for name in st.names() {
        let Some(i) = seq_token_ids_index(name) else {
            continue;
        };
        if i >= n_seq {
            return Err(dump_error(
                path,
                name,
                format!("sequence {i}: the header has {n_seq} sequences"),
            ));
        }
        let view = st.tensor(name).map_err(|e| dump_error(path, name, e.to_string()))?;
        let shape = view.shape().to_vec();
        let len = header
            .steps
            .iter()
            .filter(|s| s.seqs[i].new > 0)
            .map(|s| s.seqs[i].context + s.seqs[i].new)
            .max()
            .unwrap_or(0);
        if shape.iter().filter(|&&d| d != 1).count() > 1 || shape.iter().product::<usize>() != len {
            let unrecorded = header.steps.iter().find_map(|s| s.seqs[i].unrecorded);
            return Err(dump_error(
                path,
                name,
                format!(
                    "shape {shape:?}: expected [{len}] (sequence {i}'s tokens, a cached prefix included{})",
                    unrecorded.map_or(String::new(), |u| format!(
                        "; the first {u} rebuild its unrecorded positions"
                    ))
                ),
            ));
        }
        let (v, is_float) = values(path, name, view.dtype(), &shape, view.data())?;
        if is_float {
            return Err(dump_error(
                path,
                name,
                format!("dtype {:?}: must be an integer tensor (I32 or I64)", view.dtype()),
            ));
        }
        let vocab = if cfg.vocab > 0 {
            cfg.vocab as f64
        } else {
            f64::from(u32::MAX)
        };
        if let Some(bad) = v.iter().find(|&&x| !(0.0..vocab).contains(&x)) {
            return Err(dump_error(
                path,
                name,
                format!("token id {bad} outside the vocabulary of {vocab}"),
            ));
        }
        out.insert(i, v.iter().map(|&x| x as u32).collect::<Vec<u32>>());
    }
    for (k, spec) in header.steps.iter().enumerate() {
        for (i, q) in spec.seqs.iter().enumerate() {
            if let Some(u) = q.unrecorded
                && !out.contains_key(&i)
            {
                return Err(dump_error(
                    path,
                    format!("seq{i}.token_ids"),
                    format!(
                        "missing: __metadata__.header.steps[{k}].seqs[{i}].unrecorded = {u} asks the reference to rebuild positions 0..{u} from it"
                    ),
                ));
            }
            let Some(hit) = q.prefix else { continue };
            if let (Some(a), Some(b)) = (out.get(&i), out.get(&hit.seq))
                && let Some(p) = (0..hit.len).find(|&p| a.get(p) != b.get(p))
            {
                return Err(dump_error(
                    path,
                    format!("__metadata__.header.steps[{k}].seqs[{i}].prefix"),
                    format!(
                        "position {p}: seq{i}.token_ids and seq{}.token_ids differ inside the {} cached positions",
                        hit.seq, hit.len
                    ),
                ));
            }
        }
    }
    Ok(out)
}

/// Divides the declared residual-stream factor `s` (`conventions.residual_scale`) out of the
/// residual-stream sites of `d`: every `hidden_out`, and `hidden_in` of layers > 0 (layer 0's
/// input is the embedding, before any layer scaled it). Each division is listed among the
/// conversions.
fn undo_residual_scale(d: &mut Dump, s: f64) {
    for trace in d.layers.values_mut() {
        let stream: Vec<(Site, TraceTensor)> = trace
            .entries()
            .iter()
            .filter(|(site, _)| site.stage == Stage::HiddenOut || (site.stage == Stage::HiddenIn && site.layer > 0))
            .cloned()
            .collect();
        for (site, t) in stream {
            let v: Vec<f64> = t.to_f64().iter().map(|x| x / s).collect();
            trace.record(site, TraceTensor::f64(t.shape.clone(), v));
            d.conversions.push(format!(
                "{site}: residual stream ×{s} (conventions.residual_scale) divided out"
            ));
        }
    }
}

/// A dumped site before normalization.
struct RawSite {
    site: Site,
    name: String,
    shape: Vec<usize>,
    data: Vec<f64>,
}

/// Decodes one tensor as f64 values (floats) or integers, checking the byte length.
fn values(path: &Path, name: &str, dtype: StDtype, shape: &[usize], d: &[u8]) -> Result<(Vec<f64>, bool)> {
    let n: usize = shape
        .iter()
        .try_fold(1usize, |a, &x| a.checked_mul(x))
        .ok_or_else(|| dump_error(path, name, format!("shape {shape:?} overflows")))?;
    let (width, is_float) = match dtype {
        StDtype::F64 => (8, true),
        StDtype::F32 => (4, true),
        StDtype::F16 | StDtype::BF16 => (2, true),
        StDtype::I64 | StDtype::U64 => (8, false),
        StDtype::I32 | StDtype::U32 => (4, false),
        StDtype::I16 | StDtype::U16 => (2, false),
        StDtype::I8 | StDtype::U8 => (1, false),
        other => return Err(dump_error(path, name, format!("unsupported dtype {other:?}"))),
    };
    if Some(d.len()) != n.checked_mul(width) {
        return Err(dump_error(
            path,
            name,
            format!("{} bytes for shape {shape:?} of {dtype:?}", d.len()),
        ));
    }
    let c = |i: usize| &d[i * width..(i + 1) * width];
    let v: Vec<f64> = (0..n)
        .map(|i| {
            let b = c(i);
            match dtype {
                StDtype::F64 => f64::from_le_bytes(b.try_into().unwrap_or([0; 8])),
                StDtype::F32 => f64::from(f32::from_le_bytes(b.try_into().unwrap_or([0; 4]))),
                StDtype::F16 => half::f16::from_le_bytes([b[0], b[1]]).to_f64(),
                StDtype::BF16 => half::bf16::from_le_bytes([b[0], b[1]]).to_f64(),
                StDtype::I64 => i64::from_le_bytes(b.try_into().unwrap_or([0; 8])) as f64,
                StDtype::U64 => u64::from_le_bytes(b.try_into().unwrap_or([0; 8])) as f64,
                StDtype::I32 => f64::from(i32::from_le_bytes(b.try_into().unwrap_or([0; 4]))),
                StDtype::U32 => f64::from(u32::from_le_bytes(b.try_into().unwrap_or([0; 4]))),
                StDtype::I16 => f64::from(i16::from_le_bytes([b[0], b[1]])),
                StDtype::U16 => f64::from(u16::from_le_bytes([b[0], b[1]])),
                StDtype::I8 => f64::from(b[0] as i8),
                _ => f64::from(b[0]),
            }
        })
        .collect();
    Ok((v, is_float))
}

/// Integer ids from a dumped `tokens`/`positions` tensor: a 1-D (or `[1, T]`) integer tensor of
/// non-negative values.
fn ids(path: &Path, name: &str, shape: &[usize], v: &[f64], is_float: bool) -> Result<Vec<usize>> {
    if is_float {
        return Err(dump_error(path, name, "must be an integer tensor (I64 or I32)"));
    }
    if shape.iter().filter(|&&d| d != 1).count() > 1 {
        return Err(dump_error(path, name, format!("must be 1-D [T], got shape {shape:?}")));
    }
    v.iter()
        .map(|&x| {
            (x >= 0.0 && x.fract() == 0.0 && x < 4.0e9)
                .then_some(x as usize)
                .ok_or_else(|| dump_error(path, name, format!("value {x} is not a valid id")))
        })
        .collect()
}

/// The comma-separated integers of metadata `key` (`seq_lens`, `positions`).
///
/// Errors: [`Error::Safetensors`] naming `__metadata__.{key}` when `s` is not such a list.
fn parse_list(path: &Path, key: &str, s: &str) -> Result<Vec<usize>> {
    s.split(',')
        .map(|x| {
            x.trim().parse::<usize>().map_err(|_| {
                dump_error(
                    path,
                    format!("__metadata__.{key}"),
                    format!("`{s}` is not a comma-separated list of integers"),
                )
            })
        })
        .collect()
}

/// A dump's tensors sorted out: sites (after renames), `tokens`, `positions`, and the names of
/// the other tensors.
struct DumpTensors {
    raw: Vec<RawSite>,
    tokens: Option<Vec<usize>>,
    positions: Option<Vec<usize>>,
    ignored: Vec<String>,
}

/// Reads every tensor of `st` that is a site (by name or through `map`), `tokens` or
/// `positions`, in name order.
///
/// Errors: [`Error::Safetensors`] naming the tensor: an unreadable tensor, a site with an
/// integer dtype (but id sites), two tensors for one site, no site at all.
fn collect_tensors(
    path: &Path,
    st: &SafeTensors<'_>,
    map: Option<&Map>,
    cfg: &MlaConfig,
    metadata: &BTreeMap<String, String>,
) -> Result<DumpTensors> {
    let mut raw: Vec<RawSite> = Vec::new();
    let mut tokens = None;
    let mut positions = None;
    let mut ignored = Vec::new();
    let mut names: Vec<String> = st.names().into_iter().map(str::to_string).collect();
    names.sort();
    for name in names {
        let view = st.tensor(&name).map_err(|e| dump_error(path, &name, e.to_string()))?;
        let shape = view.shape().to_vec();
        let site = map.and_then(|m| m.rename_of(&name, cfg)).or_else(|| Site::parse(&name));
        let is_special = name == "tokens" || name == "positions";
        if site.is_none() && !is_special {
            ignored.push(name);
            continue;
        }
        let (v, is_float) = values(path, &name, view.dtype(), &shape, view.data())?;
        if is_special && site.is_none() {
            let x = ids(path, &name, &shape, &v, is_float)?;
            if name == "tokens" {
                tokens = Some(x);
            } else {
                positions = Some(x);
            }
            continue;
        }
        let site = site.expect("checked above");
        if !is_float && !site.stage.is_id_set() {
            return Err(dump_error(
                path,
                &name,
                format!(
                    "site {site} has integer dtype {:?}; sites must be F32, F16, BF16 or F64 (only id sites such as moe_topk may be integers)",
                    view.dtype()
                ),
            ));
        }
        if let Some(prev) = raw.iter().find(|e| e.site == site) {
            return Err(dump_error(
                path,
                &name,
                format!("maps to site {site}, which `{}` already provides", prev.name),
            ));
        }
        raw.push(RawSite {
            site,
            name,
            shape,
            data: v,
        });
    }
    if raw.is_empty() {
        return Err(dump_error(
            path,
            "tensors",
            format!(
                "no site found (names like `L3.kv_c_normed`); {} other tensor(s){}",
                ignored.len(),
                match (map, metadata.get("engine")) {
                    (Some(_), _) => String::new(),
                    (None, Some(e)) => format!(
                        ": does the dump need --map (hf, vllm, llama.cpp or a MAP.json)? Its metadata says engine `{}`",
                        e.trim()
                    ),
                    (None, None) => ": does the dump need --map (hf, vllm, llama.cpp or a MAP.json)?".to_string(),
                }
            ),
        ));
    }
    Ok(DumpTensors {
        raw,
        tokens,
        positions,
        ignored,
    })
}

/// T: the length of `tokens`, else of `positions`, else the token dim of the first activation
/// site (dim 1 of a head-major `[N, T, X]` site).
///
/// Errors: [`Error::Safetensors`] when T cannot be told, `tokens` and `positions` differ in
/// length, or a token id is outside the vocabulary.
fn token_count(
    path: &Path,
    raw: &[RawSite],
    tokens: Option<&[usize]>,
    positions: Option<&[usize]>,
    layout: Layout,
    cfg: &MlaConfig,
) -> Result<usize> {
    let t = match (tokens, positions) {
        (Some(tk), _) => tk.len(),
        (None, Some(p)) => p.len(),
        (None, None) => raw
            .iter()
            .find(|e| !e.site.stage.is_weight() && !e.site.stage.is_context_partial())
            .map(|e| {
                if layout == Layout::HeadMajor && e.shape.len() == 3 {
                    e.shape[1]
                } else {
                    e.shape[0]
                }
            })
            .unwrap_or(0),
    };
    if t == 0 {
        return Err(dump_error(
            path,
            "tokens",
            "cannot tell the number of tokens T (no activation site, no tokens)",
        ));
    }
    if let (Some(tk), Some(p)) = (tokens, positions)
        && tk.len() != p.len()
    {
        return Err(dump_error(
            path,
            "positions",
            format!("{} positions for {} tokens", p.len(), tk.len()),
        ));
    }
    if let Some(tk) = tokens
        && cfg.vocab > 0
        && let Some(&bad) = tk.iter().find(|&&x| x >= cfg.vocab)
    {
        return Err(dump_error(
            path,
            "tokens",
            format!("token id {bad} outside the vocabulary of {}", cfg.vocab),
        ));
    }
    Ok(t)
}

/// The batch of a dump with T = `t` tokens: sequences from `seq_lens` metadata (default one),
/// each starting at its first position (`positions` tensor, else metadata, else 0).
///
/// Errors: [`Error::Safetensors`] for `seq_lens` that do not add up to T, positions of another
/// length, or positions that do not increase by one within a sequence.
fn dump_batch(
    path: &Path,
    metadata: &BTreeMap<String, String>,
    positions: Option<Vec<usize>>,
    t: usize,
) -> Result<Batch> {
    let seq_lens = match metadata.get("seq_lens") {
        Some(s) => parse_list(path, "seq_lens", s)?,
        None => vec![t],
    };
    let total = seq_lens.iter().try_fold(0usize, |a, &n| a.checked_add(n));
    if total != Some(t) || seq_lens.contains(&0) {
        return Err(dump_error(
            path,
            "__metadata__.seq_lens",
            format!("{seq_lens:?} does not add up to T = {t} (or has a 0)"),
        ));
    }
    let positions = match (positions, metadata.get("positions")) {
        (Some(p), _) => p,
        (None, Some(s)) => parse_list(path, "positions", s)?,
        (None, None) => seq_lens.iter().flat_map(|&n| 0..n).collect(),
    };
    if positions.len() != t {
        return Err(dump_error(
            path,
            "positions",
            format!("{} positions for T = {t}", positions.len()),
        ));
    }
    let mut seqs = Vec::new();
    let mut off = 0;
    for &len in &seq_lens {
        let start = positions[off];
        for i in 0..len {
            if start.checked_add(i) != Some(positions[off + i]) {
                return Err(dump_error(
                    path,
                    "positions",
                    format!(
                        "token {} has position {} where its sequence (starting at {start}) needs {}; give `seq_lens` metadata for several sequences",
                        off + i,
                        positions[off + i],
                        start + i
                    ),
                ));
            }
        }
        seqs.push(SeqSpec { len, start_pos: start });
        off += len;
    }
    Ok(Batch { seqs })
}

/// Reads and normalizes a dump.
///
/// Errors ([`Error::Safetensors`], naming the file and the tensor or metadata key): a malformed
/// file; a site with an integer or unsupported dtype, or a shape that fits none of the accepted
/// forms (the message gives the expected shape); `tokens`/`positions` that are not 1-D integer
/// tensors or disagree with T; unknown metadata values; positions that do not increase by one
/// within a sequence; no site at all.
pub fn load(path: &Path, map: Option<&Map>, cfg: &MlaConfig) -> Result<Dump> {
    let bytes = crate::core::fsio::read_regular(path)?;
    load_bytes(path, &bytes, map, cfg)
}

/// [`load`] from bytes (`path` names the file in errors).
pub fn load_bytes(path: &Path, bytes: &[u8], map: Option<&Map>, cfg: &MlaConfig) -> Result<Dump> {
    load_step_bytes(path, bytes, map, cfg, None)
}

/// What a format-2 step's sites are as long as, beyond its T new rows.
#[derive(Debug, Clone, Copy)]
struct StepRows {
    /// The rows (Tc) of the context partial sites ([`Stage::is_context_partial`]).
    context: usize,
    /// The key axis S of the DSA sites: the step's longest sequence, context included.
    keys: usize,
}

impl StepRows {
    /// The rows of step `spec`: Tc of its context partials, and S its longest sequence with new
    /// tokens (`context + new`).
    fn of(spec: &StepSpec) -> StepRows {
        StepRows {
            context: spec.context_rows(),
            keys: spec
                .seqs
                .iter()
                .filter(|q| q.new > 0)
                .map(|q| q.context + q.new)
                .max()
                .unwrap_or(0),
        }
    }
}

/// [`load_bytes`] of one format-2 step, whose context partial sites and DSA key axis are as
/// `step` says where given; else (format 1) Tc = T and S = the longest sequence of the batch.
fn load_step_bytes(
    path: &Path,
    bytes: &[u8],
    map: Option<&Map>,
    cfg: &MlaConfig,
    step: Option<StepRows>,
) -> Result<Dump> {
    if bytes.starts_with(b"GGUF") {
        return Err(dump_error(
            path,
            "header",
            "this is a GGUF file, not a safetensors dump; pass it as --model",
        ));
    }
    let st = SafeTensors::deserialize(bytes).map_err(|e| header_error(path, bytes, &e))?;
    let (_, meta) = SafeTensors::read_metadata(bytes).map_err(|e| header_error(path, bytes, &e))?;
    let metadata: BTreeMap<String, String> = meta.metadata().clone().unwrap_or_default().into_iter().collect();
    let auto = match map {
        Some(_) => None,
        None => map_from_metadata(&metadata, &st.names())?,
    };
    let map = map.or(auto.as_ref());
    let DumpConventions {
        rope_order,
        layout,
        kv_a_order,
        dtype,
    } = conventions(path, map, &metadata)?;

    let DumpTensors {
        raw,
        tokens,
        positions,
        ignored,
    } = collect_tensors(path, &st, map, cfg, &metadata)?;

    let t = token_count(path, &raw, tokens.as_deref(), positions.as_deref(), layout, cfg)?;

    let batch = dump_batch(path, &metadata, positions, t)?;

    // Normalize every site.
    let (l, r) = (cfg.kv_lora_rank, cfg.qk_rope_head_dim);
    let mut layers: BTreeMap<usize, Trace> = BTreeMap::new();
    let mut conversions = Vec::new();
    if let (Some(m), Some(engine)) = (&auto, metadata.get("engine")) {
        conversions.push(format!(
            "map `{}` picked from the metadata `engine = {engine}` (no --map given; no tensor is named as a site)",
            m.name.as_deref().unwrap_or_default()
        ));
    }
    conversions.extend(map.map(|m| m.override_lines(&metadata)).unwrap_or_default());
    for RawSite {
        site,
        name,
        shape,
        data: v,
    } in raw
    {
        if site.layer >= cfg.n_layer {
            return Err(dump_error(
                path,
                &name,
                format!(
                    "layer {} out of range: the model has {} layers",
                    site.layer, cfg.n_layer
                ),
            ));
        }
        let rows = match step {
            Some(st) if site.stage.is_context_partial() => st.context,
            _ => t,
        };
        let keys = match step {
            Some(st) => st.keys,
            None => batch.seqs.iter().map(|q| q.len).max().unwrap_or(t),
        };
        let (mut data, shape) = match expected_shape_keys(site.stage, cfg, rows, keys) {
            // A weight held [in, out] where [out, in] is expected: kept as dumped, so that the
            // judge names the transpose (as weights --check names a loaded one).
            Some(want)
                if site.stage.is_weight() && want.len() == 2 && shape == [want[1], want[0]] && want[0] != want[1] =>
            {
                conversions.push(format!(
                    "{site}: shape {shape:?} is the expected {want:?} transposed: kept as dumped"
                ));
                (v, shape)
            }
            Some(want) => {
                let (d, note) = normalize_shape(
                    v,
                    &shape,
                    &want,
                    if site.stage.is_weight() {
                        Layout::TokenMajor
                    } else {
                        layout
                    },
                    site.stage.is_lse(),
                )
                .map_err(|why| dump_error(path, &name, format!("site {site} has shape {shape:?}; {why}")))?;
                if let Some(n) = note {
                    conversions.push(format!("{site}: {n}"));
                }
                (d, want)
            }
            None => (v, shape),
        };
        if rope_order == RopeOrder::Hf && matches!(site.stage, Stage::QPeRoped | Stage::KPeRoped) {
            data = hf_rope_to_interleaved(&data, r);
            conversions.push(format!("{site}: HF [even | odd] rope order → interleaved pairs"));
        }
        if kv_a_order == KvAOrder::RopeLatent && site.stage == Stage::KvA {
            data = kv_a_to_latent_rope(&data, l, r);
            conversions.push(format!("{site}: [rope | latent] columns → [latent | rope]"));
        }
        if name != site.to_string() {
            conversions.push(format!("{site}: from dump tensor `{name}`"));
        }
        layers
            .entry(site.layer)
            .or_default()
            .record(site, TraceTensor::f64(shape, data));
    }
    Ok(Dump {
        path: path.to_path_buf(),
        map: auto.and_then(|m| m.name),
        metadata,
        layers,
        tokens: tokens.map(|v| v.into_iter().map(|x| x as u32).collect()),
        batch,
        dtype,
        conversions,
        ignored,
    })
}
