//! The dump formats' markers and format 2's header: what a dump says about itself.
//!
//! A format-1 dump is one forward whose few facts (engine, dtype, sequence lengths, conventions)
//! are flat metadata strings. Format 2 records an engine's steps (prefill, then decodes) and
//! binds the dump to the model it was made from, so it carries one JSON header
//! (`__metadata__.header`): the model identity (hashes of the GGUF's index and of each dumped
//! layer's bytes), the hook and the engine, the declared conventions, the steps with each
//! sequence's new and cached tokens, and optionally the head range of a tensor-parallel rank.
//! The header is checked here as a whole before any tensor is read, so a malformed one is one
//! error naming its field; [`check_identity`] refuses a dump of another model.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::dump_error;
use crate::core::dtype::Dtype;
use crate::core::error::{Error, Result};
use crate::core::fp8::{ActQuant, BlockQuant, InputDtype, KvCacheQuant, QkQuant, ScaleFormat};
use crate::core::trace::Stage;
use crate::model::config::MlaConfig;
use crate::model::gguf::GgufFile;

/// The `format` metadata value of a format-1 dump (optional: a file without it is format 1 too).
pub const FORMAT1: &str = "mla-diff dump 1";

/// The `format` metadata value of a format-2 dump.
pub const FORMAT2: &str = "mla-diff dump 2";

/// `header.model.format` of a dump made from a Hugging Face checkpoint folder.
pub const HF_SAFETENSORS: &str = "hf-safetensors";

/// The model a format-2 dump was made from (`header.model`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelIdentity {
    /// The model's form: absent for a GGUF file, [`HF_SAFETENSORS`] for a Hugging Face
    /// checkpoint folder (whose `file` is the folder's name and whose hashes are the
    /// checkpoint's own, [`GgufFile::index_sha256_hex`] and [`GgufFile::layer_sha256_hex`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<String>,
    /// The GGUF's file name (a checkpoint's folder name), no folders.
    pub file: String,
    /// Its size in bytes.
    pub bytes: u64,
    /// SHA-256 (hex) of the bytes before the tensor data ([`GgufFile::index_sha256_hex`]).
    pub index_sha256: String,
    /// Per dumped layer (decimal key): SHA-256 (hex) of the layer's raw tensor bytes
    /// ([`GgufFile::layer_sha256_hex`]).
    #[serde(default)]
    pub layer_sha256: BTreeMap<String, String>,
}

/// The hook that wrote a dump, or the engine that computed it (`header.hook`, `header.engine`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Software {
    /// Name, e.g. `dump_vllm.py`, `vllm`.
    pub name: String,
    /// Version string.
    #[serde(default)]
    pub version: String,
    /// The attention (decode) backend, for an engine (`TRITON_MLA`, `FLASHMLA`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_backend: Option<String>,
    /// The prefill backend, for an engine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_backend: Option<String>,
}

/// Declared layout conventions that `compare` undoes (`header.conventions`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Conventions {
    /// As format 1's `rope_order` (`interleaved`, `hf`).
    #[serde(default)]
    pub rope_order: Option<String>,
    /// As format 1's `layout` (`token-major`, `head-major`).
    #[serde(default)]
    pub layout: Option<String>,
    /// As format 1's `kv_a_order` (`latent-rope`, `rope-latent`).
    #[serde(default)]
    pub kv_a_order: Option<String>,
    /// `e` (default) or `2`: the base of the dumped `lse`.
    #[serde(default)]
    pub lse_base: Option<String>,
    /// The factor `s` (a positive number; null or absent = 1) by which the engine's residual
    /// stream differs from the model's on purpose: every dumped `hidden_out`, and `hidden_in`
    /// of every layer but the model's first (layer 0's is the embedding), holds `s ×` the
    /// model's value. vLLM's fp16 path carries `s = 1/routed_scaling_factor`. Kept as JSON so a
    /// wrong value is reported as written; read it with [`Conventions::residual_scale()`].
    #[serde(default)]
    pub residual_scale: Option<serde_json::Value>,
}

impl Conventions {
    /// The declared residual-stream factor (the `residual_scale` field), `None` when
    /// absent, null or not a number (a header that passed [`peek_header`] or
    /// [`read`](fn@super::read) holds a positive finite number or nothing).
    pub fn residual_scale(&self) -> Option<f64> {
        self.residual_scale.as_ref().and_then(serde_json::Value::as_f64)
    }
}

/// One sequence's share of a step (`header.steps[k].seqs[i]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepSeq {
    /// New tokens of the sequence computed in this step.
    pub new: usize,
    /// Tokens of the sequence before them: what earlier steps computed and cached, plus a
    /// prefix-cache hit's `prefix.len`.
    pub context: usize,
    /// Which attention kernel computed the sequence's new rows in this step (vLLM sends short
    /// prefills through the decode kernel); `None`: not recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel: Option<SeqKernel>,
    /// A prefix-cache hit: the sequence's first `len` positions are sequence `seq`'s positions
    /// `0..len` (same token ids), which an earlier step computed; this sequence never computed
    /// them. The reference takes those rows' inputs from sequence `seq`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<PrefixHit>,
    /// The context positions `[start, end)` each context chunk of the step's MHA prefill over
    /// cached context read for this sequence (vLLM `_compute_prefill_context`), ascending,
    /// disjoint, covering `0..context`; an empty chunk is `[e, e]`. At most
    /// [`MAX_CONTEXT_CHUNKS`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_chunks: Option<Vec<[usize; 2]>>,
    /// The sequence's first `n` positions were computed by the engine in forwards the dump does
    /// not hold (recorded from a later forward on, or a prefix-cache hit on a request recorded
    /// before the dump's first step); the reference rebuilds their layer inputs from the
    /// sequence's `seq{i}.token_ids`. Only on the step where the sequence first has new tokens,
    /// equal to its `context` there, without a `prefix`; 1 ≤ n < 2³².
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unrecorded: Option<usize>,
}

/// Which attention kernel computed a sequence's rows in a step (`steps[k].seqs[i].kernel`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SeqKernel {
    /// The prefill (MHA) kernel: `"prefill"`.
    Prefill,
    /// The decode (absorbed MQA) kernel: `"decode"`.
    Decode,
}

/// A prefix-cache hit (`steps[k].seqs[i].prefix`): the first `len` positions of the sequence
/// are sequence `seq`'s positions `0..len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefixHit {
    /// The header index of the sequence whose cached positions were reused.
    pub seq: usize,
    /// How many positions (tokens) the hit covers.
    pub len: usize,
}

/// The largest number of context chunks a sequence may list (`context_chunks`): vLLM cuts the
/// context into chunks of its workspace's width (thousands of tokens), so 4096 chunks covers
/// any context a model has, and bounds what the reference allocates per chunk.
pub const MAX_CONTEXT_CHUNKS: usize = 4096;

/// One engine step (`header.steps[k]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepSpec {
    /// Its name in reports, e.g. `prefill`, `decode-1`.
    pub name: String,
    /// One entry per sequence (the same request in every step).
    pub seqs: Vec<StepSeq>,
    /// The split count the step's split-KV decode used (vLLM Triton MLA's `num_kv_splits`: each
    /// decode row's keys cut into this many splits of `⌈ctx/num_kv_splits⌉` keys, merged by
    /// LSE); `None` (absent or null) when unknown. The split-KV replays of `lse-merge` read it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_kv_splits: Option<usize>,
    /// Tokens per block of the engine's paged KV cache in this step (vLLM `block_size`,
    /// 1 ..= [`MAX_PAGE_SIZE`]); `None`: not recorded (the `paged-kv` replays search it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub page_size: Option<usize>,
    /// The order in which the engine's runner packed the step's rows, as header sequence
    /// indices (vLLM reorders a step decodes-first): a permutation of the sequences with new
    /// tokens. Provenance: the dump's tensors are in header sequence order whatever it says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub order: Option<Vec<usize>>,
    /// The context-chunk width the engine used (vLLM `max_context_chunk`), in tokens;
    /// provenance.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_chunk_tokens: Option<usize>,
}

impl StepSeq {
    /// vLLM's MLA sends a sequence's new tokens through the decode (absorbed MQA) kernel when
    /// they are at most this many (`reorder_batch_threshold`, 1 without speculative decoding).
    pub const DECODE_THRESHOLD: usize = 1;

    /// Whether the sequence's new rows ran absorbed (the decode kernel): as `kernel` records it,
    /// else when it has new tokens and at most [`StepSeq::DECODE_THRESHOLD`] of them.
    pub fn runs_absorbed(&self) -> bool {
        match self.kernel {
            Some(SeqKernel::Decode) => true,
            Some(SeqKernel::Prefill) => false,
            None => (1..=Self::DECODE_THRESHOLD).contains(&self.new),
        }
    }
}

impl StepSpec {
    /// The sequences (header indices, in header order) whose rows the step's MHA prefill over
    /// cached context computed with context chunks: those listing `context_chunks`, with new
    /// tokens and a context. Their new rows, in this order, are the rows (Tc) of the context
    /// partial sites (`ctx_out.c<c>`, …, [`Stage::is_context_partial`]).
    pub fn context_seqs(&self) -> Vec<usize> {
        (0..self.seqs.len())
            .filter(|&i| {
                let q = &self.seqs[i];
                q.context_chunks.is_some() && q.new > 0 && q.context > 0
            })
            .collect()
    }

    /// The rows of the context partial sites: the new tokens of [`StepSpec::context_seqs`].
    pub fn context_rows(&self) -> usize {
        self.context_seqs().iter().map(|&i| self.seqs[i].new).sum()
    }

    /// The number of context chunks of the step (every sequence listing `context_chunks` lists
    /// as many); 0 when none does.
    pub fn n_context_chunks(&self) -> usize {
        self.seqs
            .iter()
            .find_map(|q| q.context_chunks.as_ref().map(Vec::len))
            .unwrap_or(0)
    }
}

/// The largest `steps[k].page_size` a dump may declare: engines page their KV cache in blocks
/// of 1 to 1,024 tokens (vLLM 16 by default, FlashMLA 64); a larger value is a corrupt header,
/// refused before any replay indexes by it.
pub const MAX_PAGE_SIZE: usize = 1 << 16;

/// A change a harness made to the engine's code path (`header.patches[i]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Patch {
    /// Short name.
    pub name: String,
    /// Why it was needed.
    #[serde(default)]
    pub reason: String,
}

/// The header of a format-2 dump (`__metadata__.header`, JSON).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DumpHeader {
    /// The model the dump was made from.
    pub model: ModelIdentity,
    /// The hook that wrote it.
    #[serde(default)]
    pub hook: Software,
    /// The engine that computed it.
    #[serde(default)]
    pub engine: Software,
    /// As format 1's `dtype` (default f32).
    #[serde(default)]
    pub dtype: Option<String>,
    /// Layout conventions.
    #[serde(default)]
    pub conventions: Conventions,
    /// The steps, in order.
    pub steps: Vec<StepSpec>,
    /// Changes a harness made to the engine's code path.
    #[serde(default)]
    pub patches: Vec<Patch>,
    /// The dump comes from a kernel that read inputs of this dtype and accumulated in f32: it
    /// is judged by the rows `run --dtype` of that dtype applies, not by those `dtype` selects.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel_precision: Option<Dtype>,
    /// `[a, b]`: the per-head sites hold only heads `a..b` (`0 ≤ a < b ≤ N`); see
    /// [`heads_config`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heads: Option<[usize; 2]>,
    /// The engine's tensor parallelism; see [`TpInfo`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tp: Option<TpInfo>,
    /// How the engine's DSA indexer quantizes its query and key before scoring; see
    /// [`IndexerQuant`]. `None`: it scores the values unquantized.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub indexer_quant: Option<IndexerQuant>,
    /// How the engine quantizes the inputs of its fp8 GEMMs; see [`ActQuantDecl`]. `None`: its
    /// projections read their inputs unquantized (bf16/f32 weights, or a weight-only kernel).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub act_quant: Option<ActQuantDecl>,
    /// What the engine's paged latent cache stores; see [`KvCacheQuantDecl`]. `None`: the
    /// values as computed (the activation dtype).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_cache_quant: Option<KvCacheQuantDecl>,
}

/// An fp8 latent cache (`header.kv_cache_quant`), as vLLM's `kv_cache_dtype="fp8"` stores MLA's
/// `kv_c_normed ‖ k_pe` rows: `e4m3(x / scale)` with one per-tensor scale (`k_scale`). The
/// reference rounds what the engine read from the cache: every key of a decode (absorbed) row,
/// and the cached context keys of a prefill row ([`KvCacheQuantDecl::quant`]). Checked when the
/// header is read.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvCacheQuantDecl {
    /// The stored type: `fp8_e4m3`.
    pub dtype: String,
    /// The per-tensor scale `k_scale` (positive, finite).
    pub scale: f64,
    /// The dtype the cache write reads (`bf16`, `f16`, `f32`); absent: the reference's values.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<String>,
    /// Present when the decode kernel takes an fp8 query too (vLLM's FLASHMLA; TRITON_MLA
    /// keeps a bf16 query): `{"scale": q_scale}`, the per-tensor scale `ql_nope ‖ q_pe` is
    /// quantized with. The reference then scores decode rows in the absorbed form with that
    /// query rounded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub query: Option<KvQueryDecl>,
}

/// `header.kv_cache_quant.query`: the decode query's fp8 quantization.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvQueryDecl {
    /// The per-tensor scale `q_scale` (positive, finite; vLLM's `_q_scale`, 1.0 by default).
    pub scale: f64,
}

impl KvCacheQuantDecl {
    /// The rounding this declares. A header that passed [`peek_header`] holds only documented
    /// values.
    pub fn quant(&self) -> KvCacheQuant {
        KvCacheQuant {
            scale: self.scale,
            input: match self.input.as_deref() {
                Some("bf16") => Some(InputDtype::Bf16),
                Some("f16") => Some(InputDtype::F16),
                Some("f32") => Some(InputDtype::F32),
                _ => None,
            },
            query: self.query.as_ref().map(|q| q.scale),
        }
    }
}

/// The activation quantization of an engine's fp8 GEMMs (`header.act_quant`), as vLLM's
/// `Fp8LinearMethod` applies it before a block-scaled GEMM (`per_token_group_quant_fp8`,
/// groups of 128) or a per-tensor dynamic scale does: the reference quantizes the input of
/// every projection the same way ([`ActQuantDecl::act`]; which projections, and the
/// decode/prefill difference of `kv_b`, in
/// [`Fp8Compute`](crate::compute::reference::Fp8Compute)). Checked when the header is read.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ActQuantDecl {
    /// The stored type: `fp8_e4m3`.
    pub dtype: String,
    /// `token-group` (one scale per token and `group` columns) or `tensor` (one dynamic scale
    /// over the whole input).
    pub granularity: String,
    /// Columns per scale for `token-group` (128 for DeepSeek-V3's block fp8), 1 to
    /// [`MAX_QUANT_BLOCK`]; absent for `tensor`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<usize>,
    /// The dtype the quantizer reads (`bf16`, `f16`, `f32`); absent: the reference's values.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<String>,
    /// The floor under a group's largest magnitude; absent: vLLM's 1e-10.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub amax_floor: Option<f64>,
}

impl ActQuantDecl {
    /// The quantization this declares (defaults filled in). A header that passed
    /// [`peek_header`] holds only documented values.
    pub fn act(&self) -> ActQuant {
        let input = match self.input.as_deref() {
            Some("bf16") => Some(InputDtype::Bf16),
            Some("f16") => Some(InputDtype::F16),
            Some("f32") => Some(InputDtype::F32),
            _ => None,
        };
        let mut a = match (self.granularity.as_str(), self.group) {
            ("tensor", _) => ActQuant::tensor(input),
            (_, g) => ActQuant::token_group(g.unwrap_or(128).max(1), input),
        };
        if let Some(f) = self.amax_floor {
            a.amax_floor = f;
        }
        a
    }
}

/// The quantization a DSA indexer applies to its query and key before scoring
/// (`header.indexer_quant`), as vLLM's `Indexer` does (fp8 E4M3, `quant_block_size` 128,
/// `scale_fmt = "ue8m0"`): the reference's indexer applies the same roundings
/// ([`IndexerQuant::qk`]), so that its scores and selection are what the engine's arithmetic
/// gives on exact inputs. Checked when the header is read ([`peek_header`],
/// [`read`](fn@super::read)), and against the model by the reader.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IndexerQuant {
    /// The stored type: `fp8_e4m3` (OCP E4M3, finite, ±448; round to nearest even, saturating).
    pub dtype: String,
    /// Values per scale along the indexer's head dim `D_idx`, for the query (per token and
    /// head) and the key (per token): vLLM's `quant_block_size`. Divides `D_idx`.
    pub block: usize,
    /// `ue8m0` (`2^⌈log2(max(amax, floor)/448)⌉`) or `f32` (`max(amax, floor)/448` in f32).
    pub scale: String,
    /// The dtype the quantizer reads, which the reference rounds its query and key (after RoPE)
    /// to first: `bf16`, `f16` or `f32`; absent: the reference's own values.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<String>,
    /// The floor under a query block's largest magnitude; absent: vLLM's 1e-10.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub q_amax_floor: Option<f64>,
    /// The floor under a key block's largest magnitude; absent: vLLM's 1e-4.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub k_amax_floor: Option<f64>,
}

/// The largest `indexer_quant.block`: a block is part of one indexer head (128 wide in every
/// DSA model), so anything larger is a corrupt header.
pub const MAX_QUANT_BLOCK: usize = 1 << 16;

impl IndexerQuant {
    /// The query and key quantizations this declares (defaults filled in). A header that passed
    /// [`peek_header`] holds only the documented values; anything else reads as `ue8m0`
    /// without input rounding.
    pub fn qk(&self) -> QkQuant {
        let scale = if self.scale == "f32" {
            ScaleFormat::F32
        } else {
            ScaleFormat::Ue8m0
        };
        let input = match self.input.as_deref() {
            Some("bf16") => Some(InputDtype::Bf16),
            Some("f16") => Some(InputDtype::F16),
            Some("f32") => Some(InputDtype::F32),
            _ => None,
        };
        let side = |floor: f64| BlockQuant {
            block: self.block.max(1),
            scale,
            amax_floor: floor,
            input,
        };
        QkQuant {
            q: side(self.q_amax_floor.unwrap_or(1e-10)),
            k: side(self.k_amax_floor.unwrap_or(1e-4)),
        }
    }

    /// One line for reports: what the reference's indexer applies.
    pub fn describe(&self) -> String {
        let q = self.qk();
        format!(
            "indexer scores on {} query and key (blocks of {}, {} scales, amax floors {:e} and {:e}{})",
            self.dtype,
            self.block,
            self.scale,
            q.q.amax_floor,
            q.k.amax_floor,
            self.input
                .as_deref()
                .map(|d| format!(", read from {d}"))
                .unwrap_or_default()
        )
    }
}

/// The tensor parallelism of the engine run a format-2 dump records (`header.tp`): the size the
/// loaded weights' shards (`weights.L{n}.{param}.rank{r}`) are cut for, and, for one rank's
/// dump (with `heads`), which rank wrote it; a dump joined from every rank's lists each rank's
/// heads instead.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TpInfo {
    /// The TP size (≥ 1).
    pub size: usize,
    /// The rank that wrote this dump (`0 ≤ rank < size`); absent in a joined dump.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank: Option<usize>,
    /// Each rank's heads `[a, b]`, in rank order (a joined dump); informational.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heads: Option<Vec<[usize; 2]>>,
}

/// The stages whose sites hold one block per attention head: `[T, N, X]` activations and the
/// `[T, N]` lse (head axis 1), and the weights `w.kv_b` ([N·(P+V), L]), `w.W_UK_T` and `w.W_UV`
/// ([N, …]) (head axis 0). A format-2 dump with `heads` holds these for its heads only.
pub fn is_per_head(stage: Stage) -> bool {
    matches!(
        stage,
        Stage::Q
            | Stage::QPeRoped
            | Stage::KNope
            | Stage::V
            | Stage::QlNope
            | Stage::AttnLatent
            | Stage::Lse
            | Stage::CtxOutChunk(_)
            | Stage::CtxLseChunk(_)
            | Stage::CtxOut
            | Stage::CtxLse
            | Stage::SuffixOut
            | Stage::SuffixLse
            | Stage::AttnOut
            | Stage::WKvB
            | Stage::WUkT
            | Stage::WUv
    )
}

/// The configuration a dump of heads `a..b` is read and judged with: `cfg` with `n_head = b − a`
/// (every per-head site, [`is_per_head`], has `b − a` heads; every other dim is the model's).
pub fn heads_config(cfg: &MlaConfig, heads: [usize; 2]) -> MlaConfig {
    MlaConfig {
        n_head: heads[1].saturating_sub(heads[0]),
        ..cfg.clone()
    }
}

/// The header of a format-2 dump without reading its tensors; `None` for format 1.
///
/// Errors: [`Error::Io`] when the file cannot be read; [`Error::Safetensors`] naming
/// `__metadata__.header` when a format-2 header is not valid JSON of the documented shape.
pub fn peek_header(path: &Path) -> Result<Option<DumpHeader>> {
    use std::io::Read;
    let (f, file_len) = crate::core::fsio::open_regular(path)?;
    // Never read past the file's length, whatever its first bytes declare.
    let mut f = f.take(file_len);
    let mut len = [0u8; 8];
    if f.read_exact(&mut len).is_err() {
        return Ok(None);
    }
    let n = u64::from_le_bytes(len);
    // The safetensors header is small; a huge declared length is not a dump this can peek at
    // (the full read reports it properly).
    if n > 64 << 20 || n > file_len.saturating_sub(8) {
        return Ok(None);
    }
    let mut head = vec![0u8; n as usize];
    if f.read_exact(&mut head).is_err() {
        return Ok(None);
    }
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(&head) else {
        return Ok(None);
    };
    let meta = &v["__metadata__"];
    header_from_metadata(path, meta["format"].as_str(), meta["header"].as_str())
}

/// The header of the dump `path` whose `__metadata__` gives `format` and `header`: `None` for
/// format 1 (any `format` but [`FORMAT2`]), else the header parsed and checked as `compare`'s
/// reader does. `compare` and `weights --check` both read a format-2 header through here.
///
/// Errors: [`Error::Safetensors`] naming the field (`__metadata__.header…`) that is missing or
/// wrong.
pub fn header_from_metadata(path: &Path, format: Option<&str>, header: Option<&str>) -> Result<Option<DumpHeader>> {
    if format.map(str::trim) != Some(FORMAT2) {
        return Ok(None);
    }
    let h = parse_header(path, header)?;
    super::conventions::check_header_conventions(path, &h)?;
    Ok(Some(h))
}

/// The format-2 header `text` (`__metadata__.header`) of the dump `path`, parsed and checked:
/// `kernel_precision`, `heads` and `tp` of the documented forms, at least one step, a positive
/// `residual_scale`, an `lse_base` of `e` or `2`, every step listing every sequence with new
/// tokens and a context equal to what earlier steps computed (with a prefix-cache hit's `len`
/// and the `unrecorded` positions, each where its checks allow it).
///
/// Errors: [`Error::Safetensors`] naming the field (`__metadata__.header…`) that is missing or
/// wrong.
pub(super) fn parse_header(path: &Path, text: Option<&str>) -> Result<DumpHeader> {
    let text = text.ok_or_else(|| {
        dump_error(
            path,
            "__metadata__.header",
            format!("missing: a `{FORMAT2}` dump needs it"),
        )
    })?;
    let v: serde_json::Value = serde_json::from_str(text)
        .map_err(|e| dump_error(path, "__metadata__.header", format!("not valid JSON: {e}")))?;
    match v.get("kernel_precision") {
        None | Some(serde_json::Value::Null) => {}
        Some(serde_json::Value::String(p)) if p == "bf16" || p == "f32" => {}
        Some(other) => {
            return Err(dump_error(
                path,
                "__metadata__.header.kernel_precision",
                format!("{other}: expected \"bf16\" or \"f32\""),
            ));
        }
    }
    match v.get("heads") {
        None | Some(serde_json::Value::Null) => {}
        Some(x) => {
            let pair = x
                .as_array()
                .filter(|a| a.len() == 2)
                .and_then(|a| Some((a[0].as_u64()?, a[1].as_u64()?)));
            if pair.is_none_or(|(a, b)| a >= b) {
                return Err(dump_error(
                    path,
                    "__metadata__.header.heads",
                    format!("{x}: expected [a, b] with integers 0 ≤ a < b ≤ N"),
                ));
            }
        }
    }
    check_tp(path, v.get("tp"))?;
    check_indexer_quant(path, v.get("indexer_quant"))?;
    check_act_quant(path, v.get("act_quant"))?;
    check_kv_cache_quant(path, v.get("kv_cache_quant"))?;
    check_num_kv_splits(path, v.get("steps"))?;
    check_page_sizes(path, v.get("steps"))?;
    check_step_fields(path, v.get("steps"))?;
    check_plain_json(path, "__metadata__.header", &v)?;
    let h = deserialize_header(path, v)?;
    check_model_file(path, &h.model.file)?;
    if h.steps.is_empty() {
        return Err(dump_error(path, "__metadata__.header.steps", "no step"));
    }
    if let Some(v) = h.conventions.residual_scale.as_ref().filter(|v| !v.is_null())
        && v.as_f64().is_none_or(|x| !(x.is_finite() && x > 0.0))
    {
        return Err(dump_error(
            path,
            "__metadata__.header.conventions.residual_scale",
            format!("{v}: expected a positive number (the factor the engine's residual stream carries) or null"),
        ));
    }
    if let Some(b) = h.conventions.lse_base.as_deref()
        && b != "e"
        && b != "2"
    {
        return Err(dump_error(
            path,
            "__metadata__.header.conventions.lse_base",
            format!("`{b}`: expected `e` or `2`"),
        ));
    }
    check_totals(path, &h.steps)?;
    let n = h.steps[0].seqs.len();
    // Each sequence's prefix-cache hit: (the step that declares it first, the hit).
    let mut prefixes: Vec<Option<(usize, PrefixHit)>> = vec![None; n];
    // Each sequence's positions computed before the dump: (the step that declares them, n).
    let mut unrecorded: Vec<Option<(usize, usize)>> = vec![None; n];
    for (k, st) in h.steps.iter().enumerate() {
        if st.seqs.len() != n {
            return Err(dump_error(
                path,
                format!("__metadata__.header.steps[{k}].seqs"),
                format!(
                    "{} sequences, step 0 has {n}: every step lists every sequence",
                    st.seqs.len()
                ),
            ));
        }
        if st.seqs.iter().all(|q| q.new == 0) {
            return Err(dump_error(
                path,
                format!("__metadata__.header.steps[{k}].seqs"),
                "no new token",
            ));
        }
        // Every sequence's unrecorded positions first: they were in the cache before the dump,
        // so a prefix-cache hit of this step may read them.
        for (i, q) in st.seqs.iter().enumerate() {
            if let Some(u) = q.unrecorded {
                let own: usize = h.steps[..k].iter().map(|p| p.seqs[i].new).sum();
                check_unrecorded(path, &prefixes, k, i, q, u, own)?;
                unrecorded[i] = Some((k, u));
            }
        }
        for (i, q) in st.seqs.iter().enumerate() {
            let own: usize = h.steps[..k].iter().map(|p| p.seqs[i].new).sum();
            let before = own + unrecorded[i].map_or(0, |(_, u)| u);
            if let Some(hit) = q.prefix {
                check_prefix(path, &h.steps, &prefixes, &unrecorded, k, i, hit, before)?;
                prefixes[i].get_or_insert((k, hit));
            }
            let before = before + prefixes[i].map_or(0, |(_, hit)| hit.len);
            if q.new > 0 && q.context != before {
                return Err(dump_error(
                    path,
                    format!("__metadata__.header.steps[{k}].seqs[{i}].context"),
                    format!(
                        "{}, but earlier steps computed {before} tokens of that sequence (a prefix-cache hit's `prefix.len` and the `unrecorded` positions included; positions computed before the dump's first step are declared with `unrecorded`)",
                        q.context
                    ),
                ));
            }
        }
        check_step_chunks(path, k, st)?;
    }
    Ok(h)
}

/// Refuses text from a dump that holds a control character (C0, DEL or C1: `char::is_control`).
/// Step names, patch names, notes and tensor names are printed on the terminal and in reports;
/// a newline or an escape sequence there could forge lines ("all sites within tolerance") or
/// hide the real verdict, so such text is an input error, never printed.
///
/// Errors: [`Error::Safetensors`] naming `field` and the character's code point.
pub fn check_plain(path: &Path, field: &str, text: &str) -> Result<()> {
    match text.chars().find(|c| c.is_control()) {
        None => Ok(()),
        Some(c) => Err(dump_error(
            path,
            field,
            format!(
                "holds the control character U+{:04X}; text a dump carries is printed, so it may hold none",
                c as u32
            ),
        )),
    }
}

/// [`check_plain`] on every key and string of the JSON value `v`, naming its path under `base`.
/// serde_json's parser bounds the nesting depth (128), so the recursion is bounded too.
///
/// Errors: as [`check_plain`].
pub fn check_plain_json(path: &Path, base: &str, v: &serde_json::Value) -> Result<()> {
    match v {
        serde_json::Value::String(t) => check_plain(path, base, t),
        serde_json::Value::Array(a) => a
            .iter()
            .enumerate()
            .try_for_each(|(i, x)| check_plain_json(path, &format!("{base}[{i}]"), x)),
        serde_json::Value::Object(o) => o.iter().try_for_each(|(k, x)| {
            let field = format!("{base}.{k}");
            check_plain(path, &field, k)?;
            check_plain_json(path, &field, x)
        }),
        _ => Ok(()),
    }
}

/// `header.model.file` names the GGUF beside the dump that `compare` opens when no `--model` is
/// given: a bare file name. A path (`/etc/passwd`, `../x.gguf`) would make the dump choose which
/// file of the machine is read, so it is refused before anything is opened.
///
/// Errors: [`Error::Safetensors`] naming `__metadata__.header.model.file`.
fn check_model_file(path: &Path, file: &str) -> Result<()> {
    let bare = !file.is_empty() && file != "." && file != ".." && !file.contains(['/', '\\']);
    if bare {
        return Ok(());
    }
    Err(dump_error(
        path,
        "__metadata__.header.model.file",
        format!("{file:?}: expected the GGUF's bare file name, without folders"),
    ))
}

/// The header JSON `v` as a [`DumpHeader`], through `serde_path_to_error` so that a type error
/// or a missing field names its path (`__metadata__.header.steps[0].seqs[1].new`), not only the
/// header.
///
/// Errors: [`Error::Safetensors`] naming the field.
fn deserialize_header(path: &Path, v: serde_json::Value) -> Result<DumpHeader> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let field = match e.path().to_string() {
            p if p == "." => "__metadata__.header".to_string(),
            p => format!("__metadata__.header.{p}"),
        };
        dump_error(path, field, e.into_inner().to_string())
    })
}

/// Checks that the token counts of the header add up without overflow, before any reader
/// sums them: each step's rows T (the sum of its `new`), and, per sequence, the sum over the
/// steps of its `new`, `context`, `unrecorded` and `prefix.len` — every sum the readers and
/// `compare` take of them (T, a sequence's tokens before a step, `context + new`, what a
/// prefix-cache hit may read) is bounded by one of these. Runs before the steps' sequence
/// counts are compared, so it reads only the sequences each step lists.
///
/// Errors: [`Error::Safetensors`] naming `__metadata__.header.steps[k].seqs[i].<field>` where
/// the sum first exceeds 2⁶⁴ − 1.
fn check_totals(path: &Path, steps: &[StepSpec]) -> Result<()> {
    let n = steps.iter().map(|s| s.seqs.len()).max().unwrap_or(0);
    let mut per_seq = vec![0usize; n];
    for (k, st) in steps.iter().enumerate() {
        let mut t = 0usize;
        for (i, q) in st.seqs.iter().enumerate() {
            let overflow = |field: &str| {
                dump_error(
                    path,
                    format!("__metadata__.header.steps[{k}].seqs[{i}].{field}"),
                    "the header's token counts add up past 2⁶⁴ − 1 (the step's new tokens, or the sequence's tokens over the steps)",
                )
            };
            t = t.checked_add(q.new).ok_or_else(|| overflow("new"))?;
            for (field, x) in [
                ("new", q.new),
                ("context", q.context),
                ("unrecorded", q.unrecorded.unwrap_or(0)),
                ("prefix", q.prefix.map_or(0, |p| p.len)),
            ] {
                per_seq[i] = per_seq[i].checked_add(x).ok_or_else(|| overflow(field))?;
            }
        }
    }
    Ok(())
}

/// Checks sequence `i`'s `unrecorded = u` declared in step `k` (whose share is `q`; its steps
/// before `k` computed `own` of its tokens): the step where the sequence first has new tokens
/// (`q.new > 0`, `own` = 0), no prefix-cache hit declared for it at or before `k`, and `u`
/// equal to the step's `context` (the positions before the sequence's first recorded row are
/// exactly the unrecorded ones).
///
/// Errors: [`Error::Safetensors`] naming `__metadata__.header.steps[k].seqs[i].unrecorded`.
fn check_unrecorded(
    path: &Path,
    prefixes: &[Option<(usize, PrefixHit)>],
    k: usize,
    i: usize,
    q: &StepSeq,
    u: usize,
    own: usize,
) -> Result<()> {
    let field = format!("__metadata__.header.steps[{k}].seqs[{i}].unrecorded");
    if q.new == 0 || own > 0 {
        return Err(dump_error(
            path,
            field,
            format!(
                "{u} on a step where the sequence {}: it belongs on the step where the sequence first has new tokens",
                if q.new == 0 {
                    "has no new token".to_string()
                } else {
                    format!("already has {own} tokens from earlier steps")
                }
            ),
        ));
    }
    if q.prefix.is_some() || prefixes[i].is_some() {
        return Err(dump_error(
            path,
            field,
            format!(
                "{u} next to a prefix-cache hit (`prefix`) of the sequence: its first positions are either a hit on a recorded sequence or unrecorded, not both"
            ),
        ));
    }
    if u != q.context {
        return Err(dump_error(
            path,
            field,
            format!(
                "{u}, but the step's context is {}: the unrecorded positions are the whole context before the sequence's first recorded row",
                q.context
            ),
        ));
    }
    Ok(())
}

/// Checks sequence `i`'s prefix-cache hit `hit`, declared in step `k`, whose steps before `k`
/// computed `before` of its tokens (its `unrecorded` positions included): another sequence
/// `hit.seq` of the header, no other hit of `i` declared earlier, declared where the sequence
/// starts (`before` = 0), and at most what `hit.seq` holds in its cache by step `k` (what its
/// earlier steps computed, plus its own hit when declared in an earlier step, plus its
/// `unrecorded` positions when declared in this step or an earlier one: they were cached before
/// the dump's first step).
///
/// Errors: [`Error::Safetensors`] naming `__metadata__.header.steps[k].seqs[i].prefix`.
#[allow(
    clippy::too_many_arguments,
    reason = "the steps, what earlier steps declared of every sequence (prefixes, unrecorded), and the hit with where it is declared"
)]
fn check_prefix(
    path: &Path,
    steps: &[StepSpec],
    prefixes: &[Option<(usize, PrefixHit)>],
    unrecorded: &[Option<(usize, usize)>],
    k: usize,
    i: usize,
    hit: PrefixHit,
    before: usize,
) -> Result<()> {
    let field = format!("__metadata__.header.steps[{k}].seqs[{i}].prefix");
    let n = prefixes.len();
    let j = hit.seq;
    if j >= n || j == i {
        return Err(dump_error(
            path,
            field,
            format!("seq {j}: expected another sequence of the header's {n} (not {i} itself)"),
        ));
    }
    if let Some((k0, first)) = prefixes[i] {
        if first != hit {
            return Err(dump_error(
                path,
                field,
                format!(
                    "{{\"seq\": {j}, \"len\": {}}} where step {k0} declared {{\"seq\": {}, \"len\": {}}}",
                    hit.len, first.seq, first.len
                ),
            ));
        }
        return Ok(());
    }
    if before > 0 {
        return Err(dump_error(
            path,
            field,
            format!(
                "declared after earlier steps computed {before} tokens of the sequence: a prefix-cache hit is a sequence's first positions"
            ),
        ));
    }
    let own: usize = steps[..k].iter().map(|p| p.seqs[j].new).sum();
    let cached = own
        + prefixes[j].filter(|&(kj, _)| kj < k).map_or(0, |(_, h)| h.len)
        + unrecorded[j].filter(|&(kj, _)| kj <= k).map_or(0, |(_, u)| u);
    if hit.len > cached {
        return Err(dump_error(
            path,
            field,
            format!(
                "len {}: sequence {j} holds {cached} cached positions by step {k}",
                hit.len
            ),
        ));
    }
    Ok(())
}

/// Checks step `k`'s `order` and its sequences' `context_chunks`: `order` a permutation of the
/// sequences with new tokens; chunks only on sequences with new tokens that the prefill kernel
/// computed, each `[start, end)` with `start ≤ end`, the first starting at 0, each starting
/// where the previous ended, the last ending at the sequence's context; every sequence of the
/// step listing chunks listing as many.
///
/// Errors: [`Error::Safetensors`] naming `__metadata__.header.steps[k].order` or
/// `….seqs[i].context_chunks`.
fn check_step_chunks(path: &Path, k: usize, st: &StepSpec) -> Result<()> {
    if let Some(order) = &st.order {
        let mut live: Vec<usize> = (0..st.seqs.len()).filter(|&i| st.seqs[i].new > 0).collect();
        let mut got = order.clone();
        got.sort_unstable();
        live.sort_unstable();
        if got != live {
            return Err(dump_error(
                path,
                format!("__metadata__.header.steps[{k}].order"),
                format!("{order:?}: expected a permutation of the sequences with new tokens {live:?}"),
            ));
        }
    }
    let mut count: Option<(usize, usize)> = None;
    for (i, q) in st.seqs.iter().enumerate() {
        let Some(chunks) = &q.context_chunks else {
            continue;
        };
        let field = format!("__metadata__.header.steps[{k}].seqs[{i}].context_chunks");
        if q.new == 0 || q.kernel == Some(SeqKernel::Decode) {
            return Err(dump_error(
                path,
                field,
                "given for a sequence the step's prefill kernel did not compute (no new token, or kernel \"decode\")",
            ));
        }
        let mut at = 0;
        for (c, &[s, e]) in chunks.iter().enumerate() {
            if s != at || e < s {
                return Err(dump_error(
                    path,
                    field,
                    format!(
                        "chunk {c} is [{s}, {e}]: expected [{at}, end ≥ {at}] (ascending, disjoint chunks covering 0..{})",
                        q.context
                    ),
                ));
            }
            at = e;
        }
        if at != q.context || chunks.is_empty() {
            return Err(dump_error(
                path,
                field,
                format!(
                    "the chunks cover 0..{at}, the sequence's context is {} (an empty chunk is [e, e])",
                    q.context
                ),
            ));
        }
        match count {
            Some((i0, n0)) if n0 != chunks.len() => {
                return Err(dump_error(
                    path,
                    field,
                    format!(
                        "{} chunks, sequence {i0} lists {n0}: every prefill sequence of a step has the same chunks",
                        chunks.len()
                    ),
                ));
            }
            _ => count = Some((i, chunks.len())),
        }
    }
    Ok(())
}

/// Checks the types of the header's step fields in its JSON before they are deserialized, so a
/// hostile value is one error naming its field: `steps[k].order` a list of at most
/// [`MAX_CONTEXT_CHUNKS`] integers, `steps[k].context_chunk_tokens` a positive integer,
/// `seqs[i].kernel` `"prefill"` or `"decode"`, `seqs[i].prefix` `{"seq": j, "len": n}`,
/// `seqs[i].unrecorded` an integer from 1 to 2³²−1,
/// `seqs[i].context_chunks` at most [`MAX_CONTEXT_CHUNKS`] pairs of integers (each below 2³²);
/// each may be absent or null.
///
/// Errors: [`Error::Safetensors`] naming `__metadata__.header.steps[k]…` and the field.
fn check_step_fields(path: &Path, steps: Option<&serde_json::Value>) -> Result<()> {
    use serde_json::Value;
    let Some(steps) = steps.and_then(Value::as_array) else {
        return Ok(());
    };
    let int = |x: &Value| x.as_u64().filter(|&n| n <= u64::from(u32::MAX));
    fn present(x: Option<&serde_json::Value>) -> Option<&serde_json::Value> {
        x.filter(|x| !x.is_null())
    }
    for (k, st) in steps.iter().enumerate() {
        if let Some(x) = present(st.get("order"))
            && x.as_array()
                .is_none_or(|a| a.len() > MAX_CONTEXT_CHUNKS || a.iter().any(|i| int(i).is_none()))
        {
            return Err(dump_error(
                path,
                format!("__metadata__.header.steps[{k}].order"),
                format!("{x}: expected a list of sequence indices (the runner's row order)"),
            ));
        }
        if let Some(x) = present(st.get("context_chunk_tokens"))
            && int(x).is_none_or(|n| n == 0)
        {
            return Err(dump_error(
                path,
                format!("__metadata__.header.steps[{k}].context_chunk_tokens"),
                format!("{x}: expected a positive integer (the engine's context-chunk width) or null"),
            ));
        }
        let Some(seqs) = st.get("seqs").and_then(Value::as_array) else {
            continue;
        };
        for (i, q) in seqs.iter().enumerate() {
            let field = |f: &str| format!("__metadata__.header.steps[{k}].seqs[{i}].{f}");
            if let Some(x) = present(q.get("kernel"))
                && !matches!(x.as_str(), Some("prefill" | "decode"))
            {
                return Err(dump_error(
                    path,
                    field("kernel"),
                    format!("{x}: expected \"prefill\" or \"decode\""),
                ));
            }
            if let Some(x) = present(q.get("prefix"))
                && (x.as_object().is_none_or(|o| o.len() != 2)
                    || x.get("seq").and_then(int).is_none()
                    || x.get("len").and_then(int).is_none())
            {
                return Err(dump_error(
                    path,
                    field("prefix"),
                    format!("{x}: expected {{\"seq\": j, \"len\": n}} with integers j and n"),
                ));
            }
            if let Some(x) = present(q.get("unrecorded"))
                && int(x).is_none_or(|n| n == 0)
            {
                return Err(dump_error(
                    path,
                    field("unrecorded"),
                    format!(
                        "{x}: expected an integer from 1 to 2³²−1 (the positions computed before the dump's steps) or null"
                    ),
                ));
            }
            if let Some(x) = present(q.get("context_chunks")) {
                let ok = x.as_array().is_some_and(|a| {
                    a.len() <= MAX_CONTEXT_CHUNKS
                        && a.iter().all(|c| {
                            c.as_array()
                                .is_some_and(|p| p.len() == 2 && p.iter().all(|e| int(e).is_some()))
                        })
                });
                if !ok {
                    return Err(dump_error(
                        path,
                        field("context_chunks"),
                        format!(
                            "{}: expected at most {MAX_CONTEXT_CHUNKS} chunks [start, end] of context positions",
                            short(x)
                        ),
                    ));
                }
            }
        }
    }
    Ok(())
}

/// Checks `header.indexer_quant` (`q` is its value, if any): absent or null, or an object of
/// exactly the fields of [`IndexerQuant`]: `dtype` `"fp8_e4m3"`, `block` an integer from 1 to
/// [`MAX_QUANT_BLOCK`], `scale` `"ue8m0"` or `"f32"`, and optionally `input` (`"bf16"`, `"f16"`,
/// `"f32"` or null), `q_amax_floor` and `k_amax_floor` (positive finite numbers or null).
///
/// Errors: [`Error::Safetensors`] naming `__metadata__.header.indexer_quant` or its field.
fn check_indexer_quant(path: &Path, q: Option<&serde_json::Value>) -> Result<()> {
    const FIELD: &str = "__metadata__.header.indexer_quant";
    let Some(obj) = header_object(
        path,
        FIELD,
        q,
        "{\"dtype\": \"fp8_e4m3\", \"block\": 128, \"scale\": \"ue8m0\"}",
    )?
    else {
        return Ok(());
    };
    let fail = |key: &str, x: &serde_json::Value, want: &str| Err(field_error(path, FIELD, key, x, want));
    for (key, x) in obj {
        match key.as_str() {
            "dtype" if x.as_str() == Some("fp8_e4m3") => {}
            "dtype" => return fail(key, x, "\"fp8_e4m3\" (the only quantized type the reference applies)"),
            "block" if x.as_u64().is_some_and(|b| (1..=MAX_QUANT_BLOCK as u64).contains(&b)) => {}
            "block" => {
                return fail(
                    key,
                    x,
                    &format!("an integer from 1 to {MAX_QUANT_BLOCK} (values per scale)"),
                );
            }
            "scale" if matches!(x.as_str(), Some("ue8m0" | "f32")) => {}
            "scale" => return fail(key, x, "\"ue8m0\" or \"f32\""),
            "input" if x.is_null() || matches!(x.as_str(), Some("bf16" | "f16" | "f32")) => {}
            "input" => {
                return fail(
                    key,
                    x,
                    "\"bf16\", \"f16\", \"f32\" or null (the dtype the quantizer reads)",
                );
            }
            "q_amax_floor" | "k_amax_floor" if x.is_null() || x.as_f64().is_some_and(|f| f.is_finite() && f > 0.0) => {}
            "q_amax_floor" | "k_amax_floor" => return fail(key, x, "a positive finite number or null"),
            _ => {
                return Err(dump_error(
                    path,
                    format!("{FIELD}.{key}"),
                    "unknown field: expected dtype, block, scale, input, q_amax_floor, k_amax_floor",
                ));
            }
        }
    }
    require_keys(path, FIELD, obj, &["dtype", "block", "scale"])?;
    Ok(())
}

/// Checks `header.act_quant` (`q` is its value, if any): absent or null, or an object of exactly
/// the fields of [`ActQuantDecl`]: `dtype` `"fp8_e4m3"`, `granularity` `"token-group"` (with
/// `group` an integer from 1 to [`MAX_QUANT_BLOCK`]) or `"tensor"` (without `group`), and
/// optionally `input` (`"bf16"`, `"f16"`, `"f32"` or null) and `amax_floor` (a positive finite
/// number or null).
///
/// Errors: [`Error::Safetensors`] naming `__metadata__.header.act_quant` or its field.
fn check_act_quant(path: &Path, q: Option<&serde_json::Value>) -> Result<()> {
    const FIELD: &str = "__metadata__.header.act_quant";
    let Some(obj) = header_object(
        path,
        FIELD,
        q,
        "{\"dtype\": \"fp8_e4m3\", \"granularity\": \"token-group\", \"group\": 128}",
    )?
    else {
        return Ok(());
    };
    let fail = |key: &str, x: &serde_json::Value, want: &str| Err(field_error(path, FIELD, key, x, want));
    for (key, x) in obj {
        match key.as_str() {
            "dtype" if x.as_str() == Some("fp8_e4m3") => {}
            "dtype" => return fail(key, x, "\"fp8_e4m3\" (the only quantized type the reference applies)"),
            "granularity" if matches!(x.as_str(), Some("token-group" | "tensor")) => {}
            "granularity" => return fail(key, x, "\"token-group\" or \"tensor\""),
            "group" if x.as_u64().is_some_and(|b| (1..=MAX_QUANT_BLOCK as u64).contains(&b)) => {}
            "group" => {
                return fail(
                    key,
                    x,
                    &format!("an integer from 1 to {MAX_QUANT_BLOCK} (columns per scale)"),
                );
            }
            "input" if x.is_null() || matches!(x.as_str(), Some("bf16" | "f16" | "f32")) => {}
            "input" => {
                return fail(
                    key,
                    x,
                    "\"bf16\", \"f16\", \"f32\" or null (the dtype the quantizer reads)",
                );
            }
            "amax_floor" if x.is_null() || x.as_f64().is_some_and(|f| f.is_finite() && f > 0.0) => {}
            "amax_floor" => return fail(key, x, "a positive finite number or null"),
            _ => {
                return Err(dump_error(
                    path,
                    format!("{FIELD}.{key}"),
                    "unknown field: expected dtype, granularity, group, input, amax_floor",
                ));
            }
        }
    }
    require_keys(path, FIELD, obj, &["dtype", "granularity"])?;
    match (obj.get("granularity").and_then(|g| g.as_str()), obj.get("group")) {
        (Some("token-group"), None) => Err(dump_error(
            path,
            format!("{FIELD}.group"),
            "missing (granularity \"token-group\")",
        )),
        (Some("tensor"), Some(g)) if !g.is_null() => fail(
            "group",
            g,
            "no group with granularity \"tensor\" (one scale per tensor)",
        ),
        _ => Ok(()),
    }
}

/// Checks `header.kv_cache_quant` (`q`, if any) against the fields of [`KvCacheQuantDecl`]:
/// `dtype` `"fp8_e4m3"`, `scale` a positive finite number, optionally `input` (`"bf16"`, `"f16"`,
/// `"f32"` or null), optionally `query` ([`check_kv_query`]).
///
/// Errors: [`Error::Safetensors`] naming `__metadata__.header.kv_cache_quant` or its field.
fn check_kv_cache_quant(path: &Path, q: Option<&serde_json::Value>) -> Result<()> {
    const FIELD: &str = "__metadata__.header.kv_cache_quant";
    let Some(obj) = header_object(path, FIELD, q, "{\"dtype\": \"fp8_e4m3\", \"scale\": 1.0}")? else {
        return Ok(());
    };
    let fail = |key: &str, x: &serde_json::Value, want: &str| Err(field_error(path, FIELD, key, x, want));
    for (key, x) in obj {
        match key.as_str() {
            "dtype" if x.as_str() == Some("fp8_e4m3") => {}
            "dtype" => return fail(key, x, "\"fp8_e4m3\""),
            "scale" if x.as_f64().is_some_and(crate::core::fp8::is_scale) => {}
            "scale" => return fail(key, x, "a positive number within f32's normal range (k_scale)"),
            "input" if x.is_null() || matches!(x.as_str(), Some("bf16" | "f16" | "f32")) => {}
            "input" => return fail(key, x, "\"bf16\", \"f16\", \"f32\" or null"),
            "query" => check_kv_query(path, x)?,
            _ => {
                return Err(dump_error(
                    path,
                    format!("{FIELD}.{key}"),
                    "unknown field: expected dtype, scale, input, query",
                ));
            }
        }
    }
    require_keys(path, FIELD, obj, &["dtype", "scale"])
}

/// Checks `header.kv_cache_quant.query` (`x`): null, or an object whose only field `scale` is a
/// positive finite number.
///
/// Errors: [`Error::Safetensors`] naming the field.
fn check_kv_query(path: &Path, x: &serde_json::Value) -> Result<()> {
    const FIELD: &str = "__metadata__.header.kv_cache_quant.query";
    let Some(obj) = header_object(path, FIELD, Some(x), "{\"scale\": 1.0}")? else {
        return Ok(());
    };
    for (key, v) in obj {
        match key.as_str() {
            "scale" if v.as_f64().is_some_and(crate::core::fp8::is_scale) => {}
            "scale" => {
                return Err(field_error(
                    path,
                    FIELD,
                    key,
                    v,
                    "a positive number within f32's normal range (q_scale)",
                ));
            }
            _ => {
                return Err(dump_error(
                    path,
                    format!("{FIELD}.{key}"),
                    "unknown field: expected scale",
                ));
            }
        }
    }
    require_keys(path, FIELD, obj, &["scale"])
}

/// The object at header field `field` (`q`, its value if any): `None` when absent or null.
///
/// Errors: [`Error::Safetensors`] naming `field` when it is anything else (`example` shows an
/// object it takes).
fn header_object<'v>(
    path: &Path,
    field: &str,
    q: Option<&'v serde_json::Value>,
    example: &str,
) -> Result<Option<&'v serde_json::Map<String, serde_json::Value>>> {
    match q {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::Object(o)) => Ok(Some(o)),
        Some(x) => Err(dump_error(
            path,
            field,
            format!("{}: expected an object such as {example}", short(x)),
        )),
    }
}

/// The error of `field.key` holding `x` where `want` was expected.
fn field_error(path: &Path, field: &str, key: &str, x: &serde_json::Value, want: &str) -> Error {
    dump_error(path, format!("{field}.{key}"), format!("{}: expected {want}", short(x)))
}

/// Checks that `obj` (header field `field`) holds every one of `keys`.
///
/// Errors: [`Error::Safetensors`] naming `field.key` for the first missing.
fn require_keys(
    path: &Path,
    field: &str,
    obj: &serde_json::Map<String, serde_json::Value>,
    keys: &[&str],
) -> Result<()> {
    match keys.iter().find(|k| !obj.contains_key(**k)) {
        Some(k) => Err(dump_error(path, format!("{field}.{k}"), "missing")),
        None => Ok(()),
    }
}

/// A JSON value as an error quotes it: whole up to 80 characters, else its first 80 and `…`.
fn short(x: &serde_json::Value) -> String {
    let s = x.to_string();
    match s.char_indices().nth(80) {
        Some((at, _)) => format!("{}…", &s[..at]),
        None => s,
    }
}

/// The largest `num_kv_splits` a step may declare: vLLM's Triton MLA caps it at twice the
/// GPU's streaming multiprocessors (264 on an H200), so 4096 leaves room for any GPU while
/// bounding what a replay allocates per split.
pub const MAX_NUM_KV_SPLITS: u64 = 4096;

/// Checks each step's `num_kv_splits` (`steps` is the header's `steps` value, if any): absent,
/// null, or an integer from 1 to [`MAX_NUM_KV_SPLITS`].
///
/// Errors: [`Error::Safetensors`] naming `__metadata__.header.steps[k].num_kv_splits`.
fn check_num_kv_splits(path: &Path, steps: Option<&serde_json::Value>) -> Result<()> {
    let Some(steps) = steps.and_then(serde_json::Value::as_array) else {
        return Ok(());
    };
    for (k, st) in steps.iter().enumerate() {
        match st.get("num_kv_splits") {
            None | Some(serde_json::Value::Null) => {}
            Some(x) if x.as_u64().is_some_and(|n| (1..=MAX_NUM_KV_SPLITS).contains(&n)) => {}
            Some(x) => {
                return Err(dump_error(
                    path,
                    format!("__metadata__.header.steps[{k}].num_kv_splits"),
                    format!(
                        "{x}: expected an integer from 1 to {MAX_NUM_KV_SPLITS} (the decode's KV split count) or null"
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Checks every `steps[k].page_size` of a format-2 header (`steps` is its value, if any): absent,
/// `null`, or an integer in `1..=`[`MAX_PAGE_SIZE`].
///
/// Errors: [`Error::Safetensors`] naming `__metadata__.header.steps[k].page_size`.
fn check_page_sizes(path: &Path, steps: Option<&serde_json::Value>) -> Result<()> {
    let Some(steps) = steps.and_then(serde_json::Value::as_array) else {
        return Ok(());
    };
    for (k, st) in steps.iter().enumerate() {
        match st.get("page_size") {
            None | Some(serde_json::Value::Null) => {}
            Some(x) if x.as_u64().is_some_and(|p| (1..=MAX_PAGE_SIZE as u64).contains(&p)) => {}
            Some(x) => {
                return Err(dump_error(
                    path,
                    format!("__metadata__.header.steps[{k}].page_size"),
                    format!(
                        "{x}: expected an integer from 1 to {MAX_PAGE_SIZE} (tokens per block of the paged KV cache)"
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Checks a format-2 header's `tp` (`tp` is its value, if any): a positive integer `size` and,
/// when given, a `rank` below it.
///
/// Errors: [`Error::Safetensors`] naming `__metadata__.header.tp.size` or `.tp.rank`.
fn check_tp(path: &Path, tp: Option<&serde_json::Value>) -> Result<()> {
    let Some(tp) = tp.filter(|t| !t.is_null()) else {
        return Ok(());
    };
    let size = tp.get("size").and_then(serde_json::Value::as_u64).filter(|&t| t >= 1);
    let Some(size) = size else {
        return Err(dump_error(
            path,
            "__metadata__.header.tp.size",
            format!(
                "{}: expected a positive integer (the engine's tensor-parallel size)",
                tp.get("size").unwrap_or(&serde_json::Value::Null)
            ),
        ));
    };
    match tp.get("rank") {
        None | Some(serde_json::Value::Null) => Ok(()),
        Some(r) if r.as_u64().is_some_and(|r| r < size) => Ok(()),
        Some(r) => Err(dump_error(
            path,
            "__metadata__.header.tp.rank",
            format!("{r}: expected an integer rank below tp.size {size}"),
        )),
    }
}

/// Checks that `file` is the model a format-2 dump was made from: the header-and-index hash, and
/// the raw-byte hash of every layer in `layers`.
///
/// Errors: [`Error::Input`] naming the dump, the field that differs and the model (exit 2); a
/// dump of a Hugging Face checkpoint judged against a GGUF file, or the other way round, at
/// `header.model.format`.
pub fn check_identity(dump: &Path, h: &DumpHeader, file: &GgufFile, layers: &[usize]) -> Result<()> {
    let same_name = file
        .path()
        .file_name()
        .is_some_and(|n| n.to_string_lossy() == h.model.file);
    if let Some(f) = h.model.format.as_deref()
        && f != HF_SAFETENSORS
    {
        return Err(Error::input(
            dump,
            "field `header.model.format`",
            format!("is `{f}`; known: absent (a GGUF file) or `{HF_SAFETENSORS}`"),
        ));
    }
    let from_hf = h.model.format.as_deref() == Some(HF_SAFETENSORS);
    let what = if from_hf {
        "Hugging Face checkpoint folder"
    } else {
        "GGUF"
    };
    if from_hf == file.is_gguf() {
        return Err(Error::input(
            dump,
            "field `header.model.format`",
            format!(
                "says the dump was made from a {what} ({}), but {} is a {}: pass the model the dump names",
                h.model.file,
                file.path().display(),
                if file.is_gguf() {
                    "GGUF file"
                } else {
                    "Hugging Face checkpoint folder"
                }
            ),
        ));
    }
    let refuse = |field: &str, want: &str, got: &str| {
        let why = if same_name {
            format!(
                "the dump was made from another {} of the same name ({}): its contents differ; pass the {what} the dump was made from",
                if from_hf { "folder" } else { "file" },
                h.model.file
            )
        } else {
            format!(
                "the dump was made from another model ({}); pass the {what} it names",
                h.model.file
            )
        };
        Error::input(
            dump,
            format!("field `header.model.{field}`"),
            format!("is {want}, but {} gives {got}: {why}", file.path().display()),
        )
    };
    let idx = file.index_sha256_hex();
    if !idx.eq_ignore_ascii_case(h.model.index_sha256.trim()) {
        return Err(refuse("index_sha256", h.model.index_sha256.trim(), &idx));
    }
    for &l in layers {
        let key = l.to_string();
        let Some(want) = h.model.layer_sha256.get(&key) else {
            return Err(Error::input(
                dump,
                "field `header.model.layer_sha256`",
                format!("has no entry for layer {l}, which the dump holds"),
            ));
        };
        let got = file.layer_sha256_hex(l);
        if !got.eq_ignore_ascii_case(want.trim()) {
            return Err(refuse(&format!("layer_sha256.{key}"), want.trim(), &got));
        }
    }
    Ok(())
}
