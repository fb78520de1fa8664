//! Reading and writing traces as safetensors files.
//!
//! HF intermediates, golden traces and engine dumps all travel as safetensors files whose tensor
//! names are our site names (`L3.kv_c_normed`). This module turns such a file into a [`Trace`]
//! plus its non-site tensors (`tokens`, `positions`, `logits`) and `__metadata__`, checking
//! dtypes and byte lengths so that a malformed file is an error naming the file and tensor, and
//! writes traces back (f32) for golden records, and named tensors of any dtype (the kernel inputs
//! of `run --export-inputs`).

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::{Dtype as StDtype, SafeTensors, tensor::TensorView};

use crate::core::error::{Error, Result};
use crate::core::trace::{Site, TensorData, Trace, TraceTensor};

/// A non-site tensor of a trace file, widened to f64.
#[derive(Debug, Clone, PartialEq)]
pub struct ExtraTensor {
    /// Shape.
    pub shape: Vec<usize>,
    /// Values (integers converted exactly up to 2^53).
    pub data: Vec<f64>,
}

/// Everything read from a trace file.
#[derive(Debug, Clone, Default)]
pub struct TraceFile {
    /// Tensors whose names parse as sites.
    pub trace: Trace,
    /// Other tensors by name (`tokens`, `positions`, `logits`, …).
    pub extra: BTreeMap<String, ExtraTensor>,
    /// `__metadata__`.
    pub metadata: BTreeMap<String, String>,
    /// Names that look like sites (`L…`) but name no known stage.
    pub unknown_sites: Vec<String>,
}

fn bad(path: &Path, what: &str, reason: impl Into<String>) -> Error {
    Error::Safetensors {
        path: path.to_path_buf(),
        what: what.to_string(),
        reason: reason.into(),
    }
}

/// `data` read as consecutive little-endian elements of `W` bytes, each converted by `from_le`
/// (the caller has checked that the length is a whole number of elements).
fn each_le<const W: usize, T>(data: &[u8], from_le: impl Fn([u8; W]) -> T) -> Vec<T> {
    data.chunks_exact(W)
        .map(|b| from_le(b.try_into().unwrap_or([0; W])))
        .collect()
}

/// Decodes a tensor view: floats keep their width class (f32/f16/bf16 → f32 data, f64 → f64
/// data); integers go to f64.
fn decode(path: &Path, name: &str, v: &TensorView<'_>) -> Result<TensorData> {
    let d = v.data();
    let n: usize = v.shape().iter().product();
    let width = match v.dtype() {
        StDtype::F64 | StDtype::I64 | StDtype::U64 => 8,
        StDtype::F32 | StDtype::I32 | StDtype::U32 => 4,
        StDtype::F16 | StDtype::BF16 | StDtype::I16 | StDtype::U16 => 2,
        StDtype::I8 | StDtype::U8 | StDtype::BOOL => 1,
        other => return Err(bad(path, name, format!("unsupported dtype {other:?}"))),
    };
    if d.len() != n * width {
        return Err(bad(
            path,
            name,
            format!("{} bytes for shape {:?} of {:?}", d.len(), v.shape(), v.dtype()),
        ));
    }
    Ok(match v.dtype() {
        StDtype::F32 => TensorData::F32(each_le(d, f32::from_le_bytes)),
        StDtype::F16 => TensorData::F32(each_le(d, |b| half::f16::from_le_bytes(b).to_f32())),
        StDtype::BF16 => TensorData::F32(each_le(d, |b| half::bf16::from_le_bytes(b).to_f32())),
        StDtype::F64 => TensorData::F64(each_le(d, f64::from_le_bytes)),
        StDtype::I64 => TensorData::F64(each_le(d, |b| i64::from_le_bytes(b) as f64)),
        StDtype::U64 => TensorData::F64(each_le(d, |b| u64::from_le_bytes(b) as f64)),
        StDtype::I32 => TensorData::F64(each_le(d, |b| i32::from_le_bytes(b) as f64)),
        StDtype::U32 => TensorData::F64(each_le(d, |b| u32::from_le_bytes(b) as f64)),
        StDtype::I16 => TensorData::F64(each_le(d, |b| i16::from_le_bytes(b) as f64)),
        StDtype::U16 => TensorData::F64(each_le(d, |b| u16::from_le_bytes(b) as f64)),
        StDtype::I8 => TensorData::F64(d.iter().map(|&b| b as i8 as f64).collect()),
        _ => TensorData::F64(d.iter().map(|&b| b as f64).collect()),
    })
}

/// Decodes one safetensors tensor (any float or integer dtype) into a [`TraceTensor`].
///
/// Errors: [`Error::Safetensors`] for an unsupported dtype or a byte length that disagrees with
/// the shape.
pub fn decode_tensor(path: &Path, name: &str, v: &TensorView<'_>) -> Result<TraceTensor> {
    Ok(TraceTensor {
        shape: v.shape().to_vec(),
        data: decode(path, name, v)?,
    })
}

/// True for the float dtypes a site may have (F64, F32, F16, BF16).
pub fn is_float_dtype(d: StDtype) -> bool {
    matches!(d, StDtype::F64 | StDtype::F32 | StDtype::F16 | StDtype::BF16)
}

/// The error for `bytes` that the safetensors parser refused with `e`, naming `path` and the
/// field `header`. Bytes that cannot be a safetensors file at all get a reason that says so and
/// what was found instead of the parser's message (which for an arbitrary file is a misleading
/// "header too large"): fewer than 8 bytes; a GGUF file (magic `GGUF`); a header length (the
/// first 8 bytes, little-endian u64) past the end of the file; a header that does not open
/// with `{`. Anything else (a safetensors file with a bad header) keeps the parser's message.
pub fn header_error(path: &Path, bytes: &[u8], e: &safetensors::SafeTensorError) -> Error {
    let reason = match bytes
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
    {
        _ if bytes.starts_with(b"GGUF") => "not a safetensors file: this is a GGUF file (magic `GGUF`)".to_string(),
        None => format!(
            "not a safetensors file: {} bytes, fewer than the 8-byte header length a safetensors file starts with",
            bytes.len()
        ),
        Some(n) if n > (bytes.len() - 8) as u64 => format!(
            "not a safetensors file (or a truncated one): its first 8 bytes declare a header of {n} bytes, but the file has {} bytes",
            bytes.len()
        ),
        Some(_) if bytes.get(8) != Some(&b'{') => {
            "not a safetensors file: the header after the 8-byte length does not open with `{`".to_string()
        }
        Some(_) => e.to_string(),
    };
    bad(path, "header", reason)
}

/// Reads a trace file from bytes (`path` is used in error messages).
///
/// Errors: [`Error::Safetensors`] for a malformed header (bytes that are no safetensors file:
/// [`header_error`]), an unsupported dtype or a byte length that disagrees with the shape.
pub fn read_bytes(path: &Path, bytes: &[u8]) -> Result<TraceFile> {
    let st = SafeTensors::deserialize(bytes).map_err(|e| header_error(path, bytes, &e))?;
    let (_, meta) = SafeTensors::read_metadata(bytes).map_err(|e| header_error(path, bytes, &e))?;
    let mut out = TraceFile {
        metadata: meta.metadata().clone().unwrap_or_default().into_iter().collect(),
        ..TraceFile::default()
    };
    let mut tensors = st.tensors();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, view) in tensors {
        let data = decode(path, &name, &view)?;
        let shape = view.shape().to_vec();
        match Site::parse(&name) {
            Some(site) => out.trace.record(site, TraceTensor { shape, data }),
            None if name.starts_with('L')
                && name[1..].split('.').next().is_some_and(|x| x.parse::<usize>().is_ok()) =>
            {
                out.unknown_sites.push(name)
            }
            None => {
                let data = match data {
                    TensorData::F32(v) => v.into_iter().map(f64::from).collect(),
                    TensorData::F64(v) => v,
                };
                out.extra.insert(name, ExtraTensor { shape, data });
            }
        }
    }
    Ok(out)
}

/// Reads a trace file from disk.
pub fn read(path: &Path) -> Result<TraceFile> {
    let bytes = crate::core::fsio::read_regular(path)?;
    read_bytes(path, &bytes)
}

/// Serializes a trace (every tensor as f32, or f64 where the trace holds f64 and `keep_f64`)
/// plus extra i64 tensors and metadata to safetensors bytes. Sites are written in data-flow
/// order; the bytes are deterministic for the same input.
pub fn to_bytes(
    trace: &Trace,
    extra_i64: &[(&str, Vec<i64>)],
    metadata: &BTreeMap<String, String>,
    keep_f64: bool,
) -> Result<Vec<u8>> {
    let mut owned: Vec<(String, RawTensor)> = Vec::new();
    for site in trace.sites_in_order() {
        let t = trace.get(&site).expect("site listed by the trace");
        let (dtype, bytes) = match (&t.data, keep_f64) {
            (TensorData::F64(v), true) => (StDtype::F64, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
            (TensorData::F64(v), false) => (StDtype::F32, v.iter().flat_map(|x| (*x as f32).to_le_bytes()).collect()),
            (TensorData::F32(v), _) => (StDtype::F32, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        };
        owned.push((
            site.to_string(),
            RawTensor {
                dtype,
                shape: t.shape.clone(),
                bytes,
            },
        ));
    }
    for (name, v) in extra_i64 {
        owned.push((name.to_string(), RawTensor::i64(vec![v.len()], v)));
    }
    raw_to_bytes(&owned, metadata)
}

/// One tensor to write: its safetensors dtype, shape and little-endian element bytes
/// (`bytes.len()` = the product of `shape` × the dtype's width).
#[derive(Debug, Clone, PartialEq)]
pub struct RawTensor {
    /// Element dtype.
    pub dtype: StDtype,
    /// Shape.
    pub shape: Vec<usize>,
    /// Little-endian element bytes, row-major.
    pub bytes: Vec<u8>,
}

impl RawTensor {
    /// An F32 tensor of `shape` holding `v`.
    pub fn f32(shape: Vec<usize>, v: &[f32]) -> Self {
        RawTensor {
            dtype: StDtype::F32,
            shape,
            bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }

    /// An I32 tensor of `shape` holding `v`.
    pub fn i32(shape: Vec<usize>, v: &[i32]) -> Self {
        RawTensor {
            dtype: StDtype::I32,
            shape,
            bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }

    /// An I64 tensor of `shape` holding `v`.
    pub fn i64(shape: Vec<usize>, v: &[i64]) -> Self {
        RawTensor {
            dtype: StDtype::I64,
            shape,
            bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }
}

/// Serializes named tensors and string metadata to safetensors bytes, with the header's keys
/// sorted ([`canonical_header`]): the bytes are a function of the content alone.
///
/// Errors: [`Error::Internal`] when a tensor's byte length disagrees with its shape and dtype, or
/// two tensors share a name (safetensors refuses both).
pub fn raw_to_bytes(tensors: &[(String, RawTensor)], metadata: &BTreeMap<String, String>) -> Result<Vec<u8>> {
    struct View<'a>(&'a RawTensor);
    impl safetensors::View for View<'_> {
        fn dtype(&self) -> StDtype {
            self.0.dtype
        }
        fn shape(&self) -> &[usize] {
            &self.0.shape
        }
        fn data(&self) -> std::borrow::Cow<'_, [u8]> {
            std::borrow::Cow::Borrowed(&self.0.bytes)
        }
        fn data_len(&self) -> usize {
            self.0.bytes.len()
        }
    }
    for (name, t) in tensors {
        let want = t.shape.iter().product::<usize>() * t.dtype.bitsize() / 8;
        if t.bytes.len() != want {
            return Err(Error::internal(format!(
                "safetensors serialization: tensor `{name}` holds {} bytes, its shape {:?} of {:?} needs {want}",
                t.bytes.len(),
                t.shape,
                t.dtype
            )));
        }
    }
    let meta: std::collections::HashMap<String, String> = metadata.clone().into_iter().collect();
    safetensors::serialize(tensors.iter().map(|(n, t)| (n.clone(), View(t))), Some(meta))
        .map_err(|e| Error::internal(format!("safetensors serialization: {e}")))
        .and_then(canonical_header)
}

/// Rewrites a safetensors file's JSON header with its keys sorted (including `__metadata__`'s),
/// padded with spaces to a multiple of 8 bytes as the format asks. `safetensors::serialize` takes
/// metadata as a `HashMap`, whose order differs between processes; this makes the bytes a
/// function of the content alone. Tensor data and offsets are unchanged.
///
/// Errors: [`Error::Internal`] when `bytes` is not a safetensors image (never for the output of
/// `safetensors::serialize`).
pub fn canonical_header(bytes: Vec<u8>) -> Result<Vec<u8>> {
    let bad = |w: &str| Error::internal(format!("safetensors canonicalization: {w}"));
    let n = bytes
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])) as usize)
        .ok_or_else(|| bad("no header length"))?;
    let header = bytes.get(8..8 + n).ok_or_else(|| bad("header past the end"))?;
    // serde_json's Map is ordered by key (no `preserve_order`), so re-serializing sorts it.
    let v: serde_json::Value = serde_json::from_slice(header).map_err(|e| bad(&e.to_string()))?;
    let mut h = serde_json::to_vec(&v).map_err(|e| bad(&e.to_string()))?;
    while h.len() % 8 != 0 {
        h.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + h.len() + bytes.len() - 8 - n);
    out.extend_from_slice(&(h.len() as u64).to_le_bytes());
    out.extend_from_slice(&h);
    out.extend_from_slice(&bytes[8 + n..]);
    Ok(out)
}
