//! A validating, lazy GGUF reader.
//!
//! MLA models ship as GGUF files of 300–700 GB, and the tool is pointed at files that may be
//! truncated, half-downloaded or hostile. So opening a file memory-maps it and parses only the
//! header, the metadata and the tensor index, checking every count, length, dim and offset against
//! the bytes the file actually holds before anything is allocated from it. Tensor data is never
//! touched at open time; [`GgufFile::tensor_bytes`] hands out already-validated slices of the map,
//! and [`dequant`] turns them into f32.
//!
//! The container format is ggml's `docs/gguf.md` (versions 2 and 3, little-endian). Metadata arrays
//! are validated by walking them but kept as byte ranges, so a hostile array count can never size
//! an allocation.
//!
//! A model that is not one GGUF file (a Hugging Face checkpoint, `crate::model::hf`) is presented
//! through the same type: its reader builds GGUF metadata and a GGUF tensor index and hands the
//! bytes over through a [`TensorSource`], so every layer above reads one kind of model.

pub mod dequant;
pub mod types;

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use types::GgmlType;

use crate::core::error::{Error, Result};

/// The GGUF magic, `"GGUF"` read as little-endian bytes.
pub const GGUF_MAGIC: &[u8; 4] = b"GGUF";
/// Default data alignment when `general.alignment` is absent (gguf.md).
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's `GGML_MAX_DIMS`: a tensor has at most 4 dims.
pub const MAX_DIMS: u32 = 4;
/// Deepest nesting of metadata arrays accepted (real files use 1).
pub const MAX_ARRAY_DEPTH: u32 = 4;

/// Metadata value type ids of gguf.md (`GGUF_TYPE_*`).
mod vt {
    pub const U8: u32 = 0;
    pub const I8: u32 = 1;
    pub const U16: u32 = 2;
    pub const I16: u32 = 3;
    pub const U32: u32 = 4;
    pub const I32: u32 = 5;
    pub const F32: u32 = 6;
    pub const BOOL: u32 = 7;
    pub const STRING: u32 = 8;
    pub const ARRAY: u32 = 9;
    pub const U64: u32 = 10;
    pub const I64: u32 = 11;
    pub const F64: u32 = 12;
}

/// One metadata value.
///
/// Scalars are decoded; arrays stay as a validated byte range of the file ([`MetaArray`]) and are
/// decoded on request, so their element count never sizes an allocation at open time.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    /// `GGUF_TYPE_UINT8`.
    U8(u8),
    /// `GGUF_TYPE_INT8`.
    I8(i8),
    /// `GGUF_TYPE_UINT16`.
    U16(u16),
    /// `GGUF_TYPE_INT16`.
    I16(i16),
    /// `GGUF_TYPE_UINT32`.
    U32(u32),
    /// `GGUF_TYPE_INT32`.
    I32(i32),
    /// `GGUF_TYPE_FLOAT32`.
    F32(f32),
    /// `GGUF_TYPE_BOOL`.
    Bool(bool),
    /// `GGUF_TYPE_STRING` (invalid UTF-8 replaced by U+FFFD).
    String(String),
    /// `GGUF_TYPE_ARRAY`.
    Array(MetaArray),
    /// `GGUF_TYPE_UINT64`.
    U64(u64),
    /// `GGUF_TYPE_INT64`.
    I64(i64),
    /// `GGUF_TYPE_FLOAT64`.
    F64(f64),
}

/// A metadata array: element type, count, and where its elements live in the file.
#[derive(Debug, Clone, PartialEq)]
pub struct MetaArray {
    /// gguf.md value type id of the elements.
    pub elem_type: u32,
    /// Number of elements (validated against the bytes they occupy).
    pub len: u64,
    /// Byte range of the elements in the file.
    pub range: std::ops::Range<usize>,
}

impl MetaValue {
    /// The value as an unsigned integer, if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v.into()),
            MetaValue::U16(v) => Some(v.into()),
            MetaValue::U32(v) => Some(v.into()),
            MetaValue::U64(v) => Some(v),
            MetaValue::I8(v) => u64::try_from(v).ok(),
            MetaValue::I16(v) => u64::try_from(v).ok(),
            MetaValue::I32(v) => u64::try_from(v).ok(),
            MetaValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float, if it is a float or an integer.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v.into()),
            MetaValue::F64(v) => Some(v),
            MetaValue::I8(v) => Some(v.into()),
            MetaValue::I16(v) => Some(v.into()),
            MetaValue::I32(v) => Some(v.into()),
            MetaValue::I64(v) => Some(v as f64),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    /// The value as a string, if it is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// The value as a bool, if it is one.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// gguf.md's name of the value's type (`"u32"`, `"string"`, `"array[string]"`…).
    pub fn type_name(&self) -> String {
        match self {
            MetaValue::U8(_) => "u8".into(),
            MetaValue::I8(_) => "i8".into(),
            MetaValue::U16(_) => "u16".into(),
            MetaValue::I16(_) => "i16".into(),
            MetaValue::U32(_) => "u32".into(),
            MetaValue::I32(_) => "i32".into(),
            MetaValue::F32(_) => "f32".into(),
            MetaValue::Bool(_) => "bool".into(),
            MetaValue::String(_) => "string".into(),
            MetaValue::Array(a) => format!("array[{}]", value_type_name(a.elem_type)),
            MetaValue::U64(_) => "u64".into(),
            MetaValue::I64(_) => "i64".into(),
            MetaValue::F64(_) => "f64".into(),
        }
    }
}

fn value_type_name(t: u32) -> &'static str {
    match t {
        vt::U8 => "u8",
        vt::I8 => "i8",
        vt::U16 => "u16",
        vt::I16 => "i16",
        vt::U32 => "u32",
        vt::I32 => "i32",
        vt::F32 => "f32",
        vt::BOOL => "bool",
        vt::STRING => "string",
        vt::ARRAY => "array",
        vt::U64 => "u64",
        vt::I64 => "i64",
        vt::F64 => "f64",
        _ => "?",
    }
}

/// One entry of the tensor index, validated against the file.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// Tensor name, e.g. `blk.0.attn_kv_a_mqa.weight`.
    pub name: String,
    /// ggml dims, innermost first (`ne[0]` is contiguous): the REVERSE of the PyTorch shape.
    pub ne: Vec<u64>,
    /// Element type.
    pub ggml_type: GgmlType,
    /// Offset of the data relative to the data section (a multiple of the alignment).
    pub offset: u64,
    /// Size of the data in bytes, computed from `ne` and the type's block geometry.
    pub n_bytes: u64,
}

impl TensorInfo {
    /// Number of elements (the product of `ne`, checked at open time).
    pub fn n_elements(&self) -> u64 {
        self.ne.iter().product()
    }

    /// The PyTorch-order shape (`ne` reversed), e.g. `[L+R, H]` for `attn_kv_a_mqa`.
    pub fn shape(&self) -> Vec<u64> {
        self.ne.iter().rev().copied().collect()
    }

    /// Length of one row (`ne[0]`): the dim quant blocks run along.
    pub fn row_len(&self) -> u64 {
        self.ne.first().copied().unwrap_or(1)
    }

    /// Number of rows (product of `ne[1..]`).
    pub fn n_rows(&self) -> u64 {
        self.ne.iter().skip(1).product()
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> u64 {
        self.n_bytes / self.n_rows().max(1)
    }
}

/// Where a file's bytes live.
enum Backing {
    Mmap(memmap2::Mmap),
    Static(&'static [u8]),
    Owned(Vec<u8>),
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Mmap(m) => m,
            Backing::Static(s) => s,
            Backing::Owned(v) => v,
        }
    }
}

/// The tensor data of a model that is not a single GGUF image, behind the GGUF tensor index its
/// reader built (a Hugging Face checkpoint: several mapped shards, fp8 block-scaled matrices,
/// experts stored one tensor each).
///
/// Tensor `index` is the position in that index. Every range handed in lies within the tensor's
/// `n_bytes` (checked by [`GgufFile`] before the call), so an implementation never bounds-checks
/// twice; the bytes it returns are in the layout of the [`TensorInfo`]'s `ggml_type` and `ne`.
pub trait TensorSource: Send + Sync {
    /// Bytes `range` of tensor `index`'s data, borrowed from a mapping when they are stored as
    /// presented, computed otherwise (fp8 times its block scale, in f32).
    fn bytes(&self, index: usize, range: Range<usize>) -> Cow<'_, [u8]>;
    /// Where tensor `index` is stored, in the source's own terms (e.g.
    /// `model.layers.0.self_attn.kv_b_proj.weight F8_E4M3 [1024, 512] × weight_scale_inv [8, 4]
    /// in model-00001-of-00002.safetensors`).
    fn origin(&self, index: usize) -> String;
    /// The name tensor `index` has in the source (`model.layers.0.self_attn.kv_b_proj.weight`;
    /// for experts stored one tensor each, expert 0's name with `{e}` for the expert).
    fn source_name(&self, index: usize) -> String;
    /// What kind of source it is, for the header line of `inspect` (`Hugging Face checkpoint`).
    fn kind(&self) -> &'static str;
    /// SHA-256 (hex) of every byte the source holds, in a fixed order.
    fn sha256_hex(&self) -> String;
    /// SHA-256 (hex) of the source's structure (configuration and tensor headers), no tensor data.
    fn index_sha256_hex(&self) -> String;
    /// SHA-256 (hex) of layer `layer`'s stored tensor data, in the source's own order; `None`
    /// to hash the presented bytes as for a GGUF file.
    fn layer_sha256_hex(&self, layer: usize) -> Option<String>;
    /// Bytes the source occupies (all its files).
    fn total_bytes(&self) -> u64;
    /// Bytes read to open it (configuration, index, shard headers).
    fn header_bytes_read(&self) -> usize;
    /// Drops resident pages of its mappings (see [`GgufFile::release_resident_pages`]).
    fn release_resident_pages(&self);
    /// The stored dtype of tensor `index` in the source's own terms (`F8_E4M3`, `BF16`), where
    /// it differs from the presented ggml type.
    fn stored_type(&self, index: usize) -> String;
    /// The block scales tensor `index` is stored with, for a block-quantized matrix (fp8 with a
    /// `weight_scale_inv` grid); `None` for a tensor stored as presented.
    fn block_scales(&self, index: usize) -> Option<BlockScales>;
    /// Tensor `index`'s values as f32 when the source computes them (an fp8 matrix), made
    /// straight into the vector a whole-tensor read returns; `None` where [`TensorSource::bytes`]
    /// borrows them.
    fn values_f32(&self, index: usize) -> Option<Vec<f32>>;
}

/// The scale grid of a block-quantized matrix `[rows, cols]` as the checkpoint stores it:
/// element `(r, c)` is `code(r, c) × scale[(r / block[0]) · grid[1] + c / block[1]]`.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockScales {
    /// The scale tensor's name in the checkpoint (`….o_proj.weight_scale_inv`).
    pub name: String,
    /// The matrix's shape `[rows, cols]` (PyTorch `[out, in]`).
    pub shape: [usize; 2],
    /// Block shape `[rows, cols]` (128 × 128 for DeepSeek-V3's fp8).
    pub block: [usize; 2],
    /// Grid shape `[ceil(rows / block[0]), ceil(cols / block[1])]`.
    pub grid: [usize; 2],
    /// The scales, f32, row-major in `grid` (DeepSeek's `weight_scale_inv`: the dequantized
    /// weight is the code times it).
    pub scale: Vec<f32>,
}

/// An opened GGUF file: header, metadata and tensor index parsed and validated; data untouched.
///
/// Cheap to clone (the mapping is shared). Errors from every constructor are
/// [`Error::GgufFormat`] (naming the byte offset and field), [`Error::UnsupportedType`] or
/// [`Error::Io`].
#[derive(Clone)]
pub struct GgufFile {
    inner: Arc<Inner>,
}

struct Inner {
    path: PathBuf,
    backing: Backing,
    /// The tensor data when the model is not one GGUF image (`backing` is then empty).
    source: Option<Box<dyn TensorSource>>,
    /// Bytes the header parser read (the header, metadata and tensor index only).
    header_bytes_read: usize,
    /// Every tensor-data read, in order: (tensor index, byte offset in the file, length).
    data_reads: std::sync::Mutex<Vec<(usize, u64, u64)>>,
    version: u32,
    metadata: Vec<(String, MetaValue)>,
    meta_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    alignment: u64,
    data_offset: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.inner.path)
            .field("version", &self.inner.version)
            .field("metadata", &self.inner.metadata.len())
            .field("tensors", &self.inner.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Memory-maps `path` and parses its header, metadata and tensor index.
    ///
    /// Reads no tensor data. Errors: [`Error::Io`] when the file cannot be opened or mapped,
    /// [`Error::GgufFormat`] / [`Error::UnsupportedType`] when it is malformed.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        if path.is_dir() {
            return Err(Error::input(path, "open", "is a directory, not a GGUF file"));
        }
        // A device or FIFO would be mapped or read without end: refused before any read.
        let (file, len) = crate::core::fsio::open_regular(path)?;
        let backing = if len == 0 {
            Backing::Owned(Vec::new())
        } else {
            // SAFETY: the map is read-only; if another process truncates the file while we hold
            // the map, reads past the new end fault (SIGBUS). That is the documented limit of
            // memory-mapped readers (llama.cpp and rlx-gguf share it) and accepted here.
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, "mmap", e))?;
            Backing::Mmap(map)
        };
        Self::parse(path.to_path_buf(), backing)
    }

    /// Parses a GGUF image held in static memory (the embedded default fixture).
    pub fn from_static(name: impl Into<PathBuf>, bytes: &'static [u8]) -> Result<Self> {
        Self::parse(name.into(), Backing::Static(bytes))
    }

    /// Parses a GGUF image held in an owned buffer (tests, fuzzing).
    pub fn from_bytes(name: impl Into<PathBuf>, bytes: Vec<u8>) -> Result<Self> {
        Self::parse(name.into(), Backing::Owned(bytes))
    }

    fn parse(path: PathBuf, backing: Backing) -> Result<Self> {
        let header = parse_header(&path, backing.bytes())?;
        Ok(GgufFile {
            inner: Arc::new(Inner {
                path,
                backing,
                version: header.version,
                meta_index: header
                    .metadata
                    .iter()
                    .enumerate()
                    .map(|(i, (k, _))| (k.clone(), i))
                    .collect(),
                metadata: header.metadata,
                tensor_index: header
                    .tensors
                    .iter()
                    .enumerate()
                    .map(|(i, t)| (t.name.clone(), i))
                    .collect(),
                tensors: header.tensors,
                alignment: header.alignment,
                data_offset: header.data_offset,
                header_bytes_read: header.bytes_read,
                data_reads: std::sync::Mutex::new(Vec::new()),
                source: None,
            }),
        })
    }

    /// A model presented in GGUF terms by another reader: `metadata` with GGUF keys, `tensors` a
    /// GGUF tensor index (names, `ne`, type, `n_bytes`; `offset` is the tensor's start in the
    /// concatenation of all presented data) and `source` serving their bytes.
    ///
    /// Errors: [`Error::Input`] when two tensors share a name or a tensor's `n_bytes` is not what
    /// its type and `ne` need (a reader's bug, refused rather than read past).
    pub fn from_source(
        path: impl Into<PathBuf>,
        metadata: Vec<(String, MetaValue)>,
        tensors: Vec<TensorInfo>,
        source: Box<dyn TensorSource>,
    ) -> Result<Self> {
        let path = path.into();
        let mut tensor_index = HashMap::with_capacity(tensors.len());
        for (i, t) in tensors.iter().enumerate() {
            if tensor_index.insert(t.name.clone(), i).is_some() {
                return Err(Error::input(&path, format!("tensor `{}`", t.name), "presented twice"));
            }
            let n = t.ne.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
            if n.and_then(|n| t.ggml_type.bytes_for(n)) != Some(t.n_bytes) {
                return Err(Error::input(
                    &path,
                    format!("tensor `{}`", t.name),
                    format!("{} bytes do not hold {:?} of {}", t.n_bytes, t.ne, t.ggml_type.name()),
                ));
            }
        }
        Ok(GgufFile {
            inner: Arc::new(Inner {
                header_bytes_read: source.header_bytes_read(),
                path,
                backing: Backing::Owned(Vec::new()),
                version: 0,
                meta_index: metadata.iter().enumerate().map(|(i, (k, _))| (k.clone(), i)).collect(),
                metadata,
                tensor_index,
                tensors,
                alignment: 1,
                data_offset: 0,
                data_reads: std::sync::Mutex::new(Vec::new()),
                source: Some(source),
            }),
        })
    }

    /// The source's kind and where tensor `t` is stored in it, for a model that is not a GGUF
    /// file (`None` for a GGUF file, whose tensors are where the index says).
    pub fn origin(&self, t: &TensorInfo) -> Option<String> {
        let src = self.inner.source.as_ref()?;
        self.inner.tensor_index.get(&t.name).map(|&i| src.origin(i))
    }

    /// The name tensor `t` has in the model's own format: its GGUF name for a GGUF file, the
    /// checkpoint's name otherwise (see [`TensorSource::source_name`]).
    pub fn source_name(&self, t: &TensorInfo) -> String {
        match (&self.inner.source, self.inner.tensor_index.get(&t.name)) {
            (Some(src), Some(&i)) => src.source_name(i),
            _ => t.name.clone(),
        }
    }

    /// The type tensor `t` is stored in: its ggml type name in a GGUF file, the source's dtype
    /// otherwise (`F8_E4M3` for an fp8 matrix presented as F32).
    pub fn stored_type(&self, t: &TensorInfo) -> String {
        match (&self.inner.source, self.inner.tensor_index.get(&t.name)) {
            (Some(src), Some(&i)) => src.stored_type(i),
            _ => t.ggml_type.name().to_string(),
        }
    }

    /// Tensor `t`'s values as f32 computed by the model's source ([`TensorSource::values_f32`]);
    /// `None` for a GGUF file and for tensors stored as presented, which are decoded from
    /// [`GgufFile::tensor_bytes`].
    pub fn values_f32(&self, t: &TensorInfo) -> Option<Vec<f32>> {
        let src = self.inner.source.as_ref()?;
        let i = *self.inner.tensor_index.get(&t.name)?;
        let v = src.values_f32(i)?;
        // Logged as a read of the whole tensor, as `tensor_bytes` logs one.
        if let Ok(mut log) = self.inner.data_reads.lock() {
            log.push((i, self.inner.data_offset + t.offset, t.n_bytes));
        }
        Some(v)
    }

    /// The block scales tensor `t` is stored with ([`TensorSource::block_scales`]); `None` for a
    /// GGUF file, whose quant blocks live inside the tensor data.
    pub fn block_scales(&self, t: &TensorInfo) -> Option<BlockScales> {
        let src = self.inner.source.as_ref()?;
        src.block_scales(*self.inner.tensor_index.get(&t.name)?)
    }

    /// `GGUF` for a GGUF file, else the source's kind (`Hugging Face checkpoint`).
    pub fn kind(&self) -> &'static str {
        self.inner.source.as_ref().map_or("GGUF", |s| s.kind())
    }

    /// Whether the model is a GGUF file (golden cases and selftest pin GGUF files only).
    pub fn is_gguf(&self) -> bool {
        self.inner.source.is_none()
    }

    /// How many bytes of the file opening it read: the header, metadata and tensor index, never
    /// tensor data (always ≤ [`GgufFile::data_offset`]).
    pub fn header_bytes_read(&self) -> usize {
        self.inner.header_bytes_read
    }

    /// Every read of tensor data so far, in order: the tensor's name, the byte offset of its data
    /// in the file and the length read. Lets tests and `--stats` prove that asking about one
    /// layer touches only that layer's tensors.
    pub fn data_reads(&self) -> Vec<(String, u64, u64)> {
        let reads = self.inner.data_reads.lock().map(|g| g.clone()).unwrap_or_default();
        reads
            .into_iter()
            .map(|(i, off, len)| (self.inner.tensors[i].name.clone(), off, len))
            .collect()
    }

    /// SHA-256 of the whole file as lowercase hex. Reads every byte of the file (golden
    /// manifests pin their GGUF with it; nothing else touches tensor data wholesale).
    pub fn sha256_hex(&self) -> String {
        match &self.inner.source {
            Some(src) => src.sha256_hex(),
            None => sha256_hex(self.inner.backing.bytes()),
        }
    }

    /// SHA-256 (lowercase hex) of the bytes before the tensor data: magic, version, metadata,
    /// tensor index and alignment padding. Identifies a file's structure without reading its
    /// tensors (format-2 dumps carry it as `model.index_sha256`).
    pub fn index_sha256_hex(&self) -> String {
        if let Some(src) = &self.inner.source {
            return src.index_sha256_hex();
        }
        let all = self.inner.backing.bytes();
        sha256_hex(all.get(..self.inner.data_offset as usize).unwrap_or(all))
    }

    /// SHA-256 (lowercase hex) of the raw bytes of every tensor named `blk.{layer}.*`,
    /// concatenated in the order of the tensor index (format-2 dumps: `model.layer_sha256`).
    /// Reads only that layer's tensor data.
    pub fn layer_sha256_hex(&self, layer: usize) -> String {
        use sha2::Digest;
        if let Some(h) = self.inner.source.as_ref().and_then(|s| s.layer_sha256_hex(layer)) {
            return h;
        }
        let prefix = crate::model::tensors::block_prefix(layer);
        let mut h = sha2::Sha256::new();
        for t in self.tensors().iter().filter(|t| t.name.starts_with(&prefix)) {
            h.update(&*self.tensor_bytes(t));
        }
        h.finalize().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Drops this process's resident pages of a memory-mapped file (`madvise(MADV_DONTNEED)`);
    /// a later read faults them in again from the page cache, with the same bytes.
    ///
    /// A run calls it once a layer is dequantized: the layer's raw bytes (213 MB for a
    /// DeepSeek-V3 attention layer) otherwise stay counted in the peak RSS although only TP
    /// shards and device uploads read them again. A no-op for in-memory images; the advice is
    /// best effort, so an error is ignored (the pages simply stay).
    pub fn release_resident_pages(&self) {
        if let Some(src) = &self.inner.source {
            src.release_resident_pages();
        }
        if let Backing::Mmap(m) = &self.inner.backing {
            // SAFETY: the mapping is a read-only map of a file, so discarding its pages loses no
            // writes: the next access reads the file again, as the first one did.
            let _ = unsafe { m.unchecked_advise(memmap2::UncheckedAdvice::DontNeed) };
        }
    }

    /// The path the file was opened from (or the embedded fixture's name).
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// GGUF container version (2 or 3; 0 for a model that is not a GGUF file).
    pub fn version(&self) -> u32 {
        self.inner.version
    }

    /// Size of the file in bytes.
    pub fn file_len(&self) -> u64 {
        if let Some(src) = &self.inner.source {
            return src.total_bytes();
        }
        self.inner.backing.bytes().len() as u64
    }

    /// Data alignment in bytes (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.inner.alignment
    }

    /// Absolute byte offset of the data section.
    pub fn data_offset(&self) -> u64 {
        self.inner.data_offset
    }

    /// Metadata in file order.
    pub fn metadata(&self) -> &[(String, MetaValue)] {
        &self.inner.metadata
    }

    /// One metadata value by full key (e.g. `deepseek2.attention.kv_lora_rank`).
    pub fn meta(&self, key: &str) -> Option<&MetaValue> {
        self.inner.meta_index.get(key).map(|&i| &self.inner.metadata[i].1)
    }

    /// The tensor index in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.inner.tensors
    }

    /// One tensor's index entry by name.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.inner.tensor_index.get(name).map(|&i| &self.inner.tensors[i])
    }

    /// One tensor's index entry by name, or [`Error::MissingTensor`].
    pub fn require_tensor(&self, name: &str) -> Result<&TensorInfo> {
        self.tensor(name).ok_or_else(|| Error::MissingTensor {
            path: self.path().to_path_buf(),
            tensor: name.to_string(),
        })
    }

    /// The raw bytes of a tensor (validated at open time to lie inside the file).
    ///
    /// This is the only place tensor data is touched; with a mapped file only the pages of this
    /// tensor are read. Borrowed from the map for a GGUF file; a [`TensorSource`] may compute
    /// them (an fp8 matrix times its block scales).
    pub fn tensor_bytes(&self, t: &TensorInfo) -> Cow<'_, [u8]> {
        self.read(t, 0..t.n_bytes as usize)
    }

    /// Bytes `range` (relative to the start of the tensor's data) of a tensor, logged in
    /// [`GgufFile::data_reads`] as a read of that range only: what reading one expert's rows of
    /// a 3-D expert tensor costs. `None` when the range does not lie within the tensor.
    pub fn tensor_bytes_range(&self, t: &TensorInfo, range: Range<usize>) -> Option<Cow<'_, [u8]>> {
        if range.start > range.end || range.end as u64 > t.n_bytes {
            return None;
        }
        Some(self.read(t, range))
    }

    /// `range` of `t`'s data, which the callers checked lies within `t.n_bytes`.
    fn read(&self, t: &TensorInfo, range: Range<usize>) -> Cow<'_, [u8]> {
        let start = (self.inner.data_offset + t.offset) as usize;
        let index = self.inner.tensor_index.get(&t.name).copied();
        if let (Some(i), Ok(mut log)) = (index, self.inner.data_reads.lock()) {
            log.push((i, (start + range.start) as u64, range.len() as u64));
        }
        match (&self.inner.source, index) {
            (Some(src), Some(i)) => src.bytes(i, range),
            (Some(_), None) => Cow::Owned(Vec::new()),
            (None, _) => Cow::Borrowed(&self.inner.backing.bytes()[start + range.start..start + range.end]),
        }
    }

    /// Decodes a string-array metadata value (e.g. `tokenizer.ggml.tokens`) up to `max` entries.
    pub fn meta_string_array(&self, arr: &MetaArray, max: usize) -> Vec<String> {
        let mut out = Vec::new();
        if arr.elem_type != vt::STRING {
            return out;
        }
        let bytes = &self.inner.backing.bytes()[arr.range.clone()];
        let mut pos = 0usize;
        for _ in 0..arr.len.min(max as u64) {
            // The range was validated at open time, so these reads cannot fail.
            let n = u64::from_le_bytes(bytes[pos..pos + 8].try_into().unwrap_or([0; 8])) as usize;
            pos += 8;
            out.push(String::from_utf8_lossy(&bytes[pos..pos + n]).into_owned());
            pos += n;
        }
        out
    }

    /// Decodes a numeric metadata array (any integer, float or bool element type; bools as 0/1) up
    /// to `max` entries.
    pub fn meta_numeric_array(&self, arr: &MetaArray, max: usize) -> Vec<f64> {
        let size = match scalar_size(arr.elem_type) {
            Some(s) if arr.elem_type != vt::STRING && arr.elem_type != vt::ARRAY => s,
            _ => return Vec::new(),
        };
        let bytes = &self.inner.backing.bytes()[arr.range.clone()];
        bytes
            .chunks_exact(size)
            .take(max)
            .map(|c| {
                let v = decode_scalar(arr.elem_type, c);
                v.as_f64()
                    .or_else(|| v.as_bool().map(|b| f64::from(u8::from(b))))
                    .unwrap_or(f64::NAN)
            })
            .collect()
    }
}

fn scalar_size(t: u32) -> Option<usize> {
    Some(match t {
        vt::U8 | vt::I8 | vt::BOOL => 1,
        vt::U16 | vt::I16 => 2,
        vt::U32 | vt::I32 | vt::F32 => 4,
        vt::U64 | vt::I64 | vt::F64 => 8,
        vt::STRING | vt::ARRAY => return None,
        _ => return None,
    })
}

/// Decodes a fixed-size scalar of type `t` from exactly `scalar_size(t)` bytes.
fn decode_scalar(t: u32, b: &[u8]) -> MetaValue {
    let a2 = |b: &[u8]| [b[0], b[1]];
    let a4 = |b: &[u8]| [b[0], b[1], b[2], b[3]];
    let a8 = |b: &[u8]| [b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]];
    match t {
        vt::U8 => MetaValue::U8(b[0]),
        vt::I8 => MetaValue::I8(b[0] as i8),
        vt::U16 => MetaValue::U16(u16::from_le_bytes(a2(b))),
        vt::I16 => MetaValue::I16(i16::from_le_bytes(a2(b))),
        vt::U32 => MetaValue::U32(u32::from_le_bytes(a4(b))),
        vt::I32 => MetaValue::I32(i32::from_le_bytes(a4(b))),
        vt::F32 => MetaValue::F32(f32::from_le_bytes(a4(b))),
        vt::BOOL => MetaValue::Bool(b[0] != 0),
        vt::U64 => MetaValue::U64(u64::from_le_bytes(a8(b))),
        vt::I64 => MetaValue::I64(i64::from_le_bytes(a8(b))),
        _ => MetaValue::F64(f64::from_le_bytes(a8(b))),
    }
}

/// What [`parse_header`] returns.
struct Header {
    version: u32,
    metadata: Vec<(String, MetaValue)>,
    tensors: Vec<TensorInfo>,
    alignment: u64,
    data_offset: u64,
    /// Bytes of the image the parser read (everything before this offset, nothing after).
    bytes_read: usize,
}

/// A bounds-checked little-endian reader over the file image that names the field it reads.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn err(&self, at: usize, field: &str, reason: impl Into<String>) -> Error {
        Error::GgufFormat {
            path: self.path.to_path_buf(),
            offset: at as u64,
            field: field.to_string(),
            reason: reason.into(),
        }
    }

    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize, field: &dyn Fn() -> String) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(self.err(
                self.pos,
                &field(),
                format!(
                    "file truncated: needs {n} bytes, {} left (file is {} bytes)",
                    self.remaining(),
                    self.buf.len()
                ),
            ));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn u32(&mut self, field: &dyn Fn() -> String) -> Result<u32> {
        let b = self.take(4, field)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self, field: &dyn Fn() -> String) -> Result<u64> {
        let b = self.take(8, field)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    /// A gguf string: u64 length then bytes. The length is checked against the bytes left
    /// before anything is allocated.
    fn str_bytes(&mut self, field: &dyn Fn() -> String) -> Result<&'a [u8]> {
        let at = self.pos;
        let n = self.u64(field)?;
        if n > self.remaining() as u64 {
            return Err(self.err(
                at,
                &field(),
                format!(
                    "string length {n} exceeds the {} bytes left in the file",
                    self.remaining()
                ),
            ));
        }
        self.take(n as usize, field)
    }

    fn utf8(&mut self, field: &dyn Fn() -> String) -> Result<String> {
        let at = self.pos;
        let b = self.str_bytes(field)?;
        std::str::from_utf8(b)
            .map(str::to_owned)
            .map_err(|e| self.err(at, &field(), format!("not valid UTF-8: {e}")))
    }

    /// Walks one metadata value of type `t`, decoding scalars and validating arrays in place.
    fn value(&mut self, t: u32, depth: u32, field: &dyn Fn() -> String) -> Result<MetaValue> {
        let at = self.pos;
        if let Some(n) = scalar_size(t) {
            let b = self.take(n, field)?;
            if t == vt::BOOL && b[0] > 1 {
                return Err(self.err(at, &field(), format!("bool value {} is not 0 or 1", b[0])));
            }
            return Ok(decode_scalar(t, b));
        }
        match t {
            vt::STRING => Ok(MetaValue::String(
                String::from_utf8_lossy(self.str_bytes(field)?).into_owned(),
            )),
            vt::ARRAY => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(self.err(at, &field(), format!("arrays nested deeper than {MAX_ARRAY_DEPTH}")));
                }
                let elem_type = self.u32(field)?;
                let len_at = self.pos;
                let len = self.u64(field)?;
                let min_size = match elem_type {
                    vt::STRING => 8,
                    vt::ARRAY => 12,
                    t => scalar_size(t)
                        .ok_or_else(|| self.err(at, &field(), format!("unknown array element type {t}")))?
                        as u64,
                };
                if len.checked_mul(min_size).is_none_or(|b| b > self.remaining() as u64) {
                    return Err(self.err(
                        len_at,
                        &field(),
                        format!(
                            "array of {len} elements needs at least {min_size} bytes each, only {} bytes left",
                            self.remaining()
                        ),
                    ));
                }
                let start = self.pos;
                if let Some(s) = scalar_size(elem_type) {
                    self.take(len as usize * s, field)?;
                    if elem_type == vt::BOOL && self.buf[start..self.pos].iter().any(|&b| b > 1) {
                        return Err(self.err(start, &field(), "bool array value is not 0 or 1"));
                    }
                } else if elem_type == vt::STRING {
                    for i in 0..len {
                        self.str_bytes(&|| format!("{}[{i}]", field()))?;
                    }
                } else {
                    for i in 0..len {
                        let f = || format!("{}[{i}]", field());
                        self.value(elem_type, depth + 1, &f)?;
                    }
                }
                Ok(MetaValue::Array(MetaArray {
                    elem_type,
                    len,
                    range: start..self.pos,
                }))
            }
            other => Err(self.err(at, &field(), format!("unknown metadata value type {other}"))),
        }
    }
}

/// `general.alignment` (default [`DEFAULT_ALIGNMENT`]).
///
/// Errors: [`Error::GgufFormat`] for a value that is not a u32 power of two that is a multiple
/// of 8.
fn alignment_of(c: &Cursor<'_>, metadata: &[(String, MetaValue)]) -> Result<u64> {
    let Some((_, v)) = metadata.iter().find(|(k, _)| k == "general.alignment") else {
        return Ok(DEFAULT_ALIGNMENT);
    };
    let a = match v {
        MetaValue::U32(a) => *a as u64,
        other => {
            return Err(c.err(
                0,
                "general.alignment",
                format!("must be u32, found {}", other.type_name()),
            ));
        }
    };
    if a == 0 || !a.is_power_of_two() || a % 8 != 0 {
        return Err(c.err(
            0,
            "general.alignment",
            format!("{a} is not a power of two that is a multiple of 8 (gguf.md)"),
        ));
    }
    Ok(a)
}

/// Reads the rest of the info of tensor `name` at the cursor: its dims, ggml type and data
/// offset, with its byte size.
///
/// Errors: [`Error::GgufFormat`] for 0 or more than [`MAX_DIMS`] dims, a dim out of range, an
/// element count or byte size that overflows, a row length that is not a whole number of
/// blocks, an offset off the alignment; [`Error::UnsupportedType`] for an unknown type id.
fn read_tensor_info(c: &mut Cursor<'_>, name: String, alignment: u64) -> Result<TensorInfo> {
    let nd_at = c.pos;
    let n_dims = c.u32(&|| format!("{name}: n_dims"))?;
    if n_dims == 0 || n_dims > MAX_DIMS {
        return Err(c.err(
            nd_at,
            &format!("{name}: n_dims"),
            format!("{n_dims} dims; must be 1..={MAX_DIMS}"),
        ));
    }
    let mut ne = Vec::with_capacity(n_dims as usize);
    for d in 0..n_dims {
        let at = c.pos;
        let v = c.u64(&|| format!("{name}: ne[{d}]"))?;
        if v == 0 || v > i64::MAX as u64 {
            return Err(c.err(at, &format!("{name}: ne[{d}]"), format!("dim {v} out of range")));
        }
        ne.push(v);
    }
    let n_el = ne
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d).filter(|&p| p <= i64::MAX as u64))
        .ok_or_else(|| {
            c.err(
                nd_at,
                &format!("{name}: ne"),
                format!("dims {ne:?}: element count overflows"),
            )
        })?;
    let ty_at = c.pos;
    let type_id = c.u32(&|| format!("{name}: type"))?;
    let ggml_type = GgmlType::from_id(type_id).ok_or_else(|| Error::UnsupportedType {
        path: c.path.to_path_buf(),
        tensor: name.clone(),
        type_id,
        reason: format!("unknown ggml type (tensor info at byte {ty_at})"),
    })?;
    if ne[0] % ggml_type.block_size() != 0 {
        return Err(c.err(
            nd_at,
            &format!("{name}: ne[0]"),
            format!(
                "row length {} is not a multiple of the {} block size {}",
                ne[0],
                ggml_type,
                ggml_type.block_size()
            ),
        ));
    }
    let n_bytes = ggml_type.bytes_for(n_el).ok_or_else(|| {
        c.err(
            nd_at,
            &format!("{name}: ne"),
            format!("byte size of {n_el} {ggml_type} elements overflows"),
        )
    })?;
    let off_at = c.pos;
    let offset = c.u64(&|| format!("{name}: offset"))?;
    if offset % alignment != 0 {
        return Err(c.err(
            off_at,
            &format!("{name}: offset"),
            format!("offset {offset} is not a multiple of the alignment {alignment}"),
        ));
    }
    Ok(TensorInfo {
        name,
        ne,
        ggml_type,
        offset,
        n_bytes,
    })
}

/// Parses and validates everything before the data section.
fn parse_header(path: &Path, buf: &[u8]) -> Result<Header> {
    let mut c = Cursor { buf, pos: 0, path };
    let magic = c.take(4, &|| "magic".into())?;
    if magic != GGUF_MAGIC {
        return Err(c.err(
            0,
            "magic",
            format!("expected \"GGUF\", found {:?}", String::from_utf8_lossy(magic)),
        ));
    }
    let version = c.u32(&|| "version".into())?;
    if version != 2 && version != 3 {
        let hint = if version.swap_bytes() == 2 || version.swap_bytes() == 3 {
            " (a big-endian GGUF; only little-endian files are supported)"
        } else if version == 1 {
            " (GGUF v1 uses 32-bit counts and is obsolete; re-convert the model)"
        } else {
            ""
        };
        return Err(c.err(
            4,
            "version",
            format!("unsupported version {version}; supported: 2, 3{hint}"),
        ));
    }
    let tc_at = c.pos;
    let tensor_count = c.u64(&|| "tensor_count".into())?;
    let kv_at = c.pos;
    let kv_count = c.u64(&|| "metadata_kv_count".into())?;
    // Smallest possible encodings: a metadata entry is a key length (8), a value type (4) and a
    // one-byte value; a tensor info is a name length (8), n_dims (4), one dim (8), type (4) and
    // offset (8). Counts that cannot fit in the file are rejected before anything is allocated.
    let left = c.remaining() as u64;
    if kv_count.checked_mul(13).is_none_or(|b| b > left) {
        return Err(c.err(
            kv_at,
            "metadata_kv_count",
            format!("{kv_count} entries cannot fit in the {left} bytes left (corrupt count or truncated file)"),
        ));
    }

    let mut metadata: Vec<(String, MetaValue)> = Vec::with_capacity(kv_count as usize);
    let mut seen_keys: HashSet<String> = HashSet::new();
    for i in 0..kv_count {
        let key_at = c.pos;
        let key = c.utf8(&|| format!("metadata[{i}].key"))?;
        if !seen_keys.insert(key.clone()) {
            return Err(c.err(key_at, &format!("metadata[{i}].key"), format!("duplicate key `{key}`")));
        }
        let t = c.u32(&|| format!("{key}: value type"))?;
        let v = c.value(t, 0, &|| key.clone())?;
        metadata.push((key, v));
    }

    let alignment = alignment_of(&c, &metadata)?;

    // Checked after the metadata, against the bytes that are left for the tensor index, so a
    // file truncated inside the metadata is reported at the metadata field that is cut.
    let left = c.remaining() as u64;
    if tensor_count.checked_mul(32).is_none_or(|b| b > left) {
        return Err(c.err(
            tc_at,
            "tensor_count",
            format!(
                "{tensor_count} tensor infos cannot fit in the {left} bytes left (corrupt count or truncated file)"
            ),
        ));
    }
    let mut tensors: Vec<TensorInfo> = Vec::with_capacity(tensor_count as usize);
    let mut seen_names: HashMap<String, usize> = HashMap::new();
    for i in 0..tensor_count {
        let name_at = c.pos;
        let name = c.utf8(&|| format!("tensor_info[{i}].name"))?;
        if let Some(prev) = seen_names.insert(name.clone(), i as usize) {
            return Err(c.err(
                name_at,
                &format!("tensor_info[{i}].name"),
                format!("duplicate tensor name `{name}` (also tensor_info[{prev}])"),
            ));
        }
        tensors.push(read_tensor_info(&mut c, name, alignment)?);
    }

    let end_of_infos = c.pos as u64;
    let data_offset = end_of_infos.div_ceil(alignment) * alignment;
    let file_len = buf.len() as u64;
    if !tensors.is_empty() && data_offset > file_len {
        return Err(c.err(
            c.pos,
            "data section",
            format!("file truncated: data section starts at byte {data_offset}, file is {file_len} bytes"),
        ));
    }
    let data_len = file_len.saturating_sub(data_offset);
    for t in &tensors {
        let end = t.offset.checked_add(t.n_bytes);
        if end.is_none_or(|e| e > data_len) {
            return Err(c.err(
                (data_offset.saturating_add(t.offset)) as usize,
                &format!("{}: offset", t.name),
                format!(
                    "tensor data [{}, +{}) runs past the end of the data section ({} bytes): file truncated or offset corrupt",
                    t.offset, t.n_bytes, data_len
                ),
            ));
        }
    }
    let mut by_offset: Vec<&TensorInfo> = tensors.iter().collect();
    by_offset.sort_by_key(|t| t.offset);
    for w in by_offset.windows(2) {
        if w[0].offset + w[0].n_bytes > w[1].offset {
            return Err(c.err(
                (data_offset + w[1].offset) as usize,
                &format!("{}: offset", w[1].name),
                format!("tensor data overlaps `{}`", w[0].name),
            ));
        }
    }
    Ok(Header {
        version,
        metadata,
        tensors,
        alignment,
        data_offset,
        bytes_read: c.pos,
    })
}

/// SHA-256 of `bytes` as lowercase hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    let d = sha2::Sha256::digest(bytes);
    d.iter().map(|b| format!("{b:02x}")).collect()
}
