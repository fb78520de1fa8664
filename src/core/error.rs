//! The one error type of the library.
//!
//! Every failure a user can cause (a truncated or hostile GGUF, a missing tensor, a bad flag, a
//! mismatched dump) becomes one variant of [`Error`] with structured fields naming the file, the
//! tensor and the field involved, so that the binary can print a single line and exit with code 2.
//! Nothing in the library panics on bad input; divergences between paths are *results*, not
//! errors, and never appear here.

use std::path::PathBuf;

/// Result alias used throughout the library.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong before a comparison produces a verdict.
///
/// Each variant's message is one line and names the file and the field or tensor, as docs/design.md's
/// "Rules of the road" ask. The binary maps every variant to exit code 2 ([`Error::exit_code`]).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Reading or writing a file failed at the OS level.
    #[error("{path}: {what}: {err}")]
    Io {
        /// The file involved.
        path: PathBuf,
        /// What was being done (e.g. "open", "mmap", "write").
        what: &'static str,
        /// The OS error (part of the message, not a separate cause, so it prints once).
        err: std::io::Error,
    },

    /// The GGUF container is malformed: truncated, bad magic, impossible counts or offsets.
    #[error("{path}: malformed GGUF at byte {offset}, field `{field}`: {reason}")]
    GgufFormat {
        /// The GGUF file.
        path: PathBuf,
        /// Byte offset of the field in the file.
        offset: u64,
        /// The field being read (e.g. `tensor_count`, `metadata[3].key`, `blk.0.attn_q_a.weight: offset`).
        field: String,
        /// What is wrong with it.
        reason: String,
    },

    /// A tensor uses a ggml type id this build does not know or cannot dequantize.
    #[error("{path}: tensor `{tensor}`: {reason} (ggml type id {type_id})")]
    UnsupportedType {
        /// The GGUF file.
        path: PathBuf,
        /// The tensor name.
        tensor: String,
        /// The raw ggml type id.
        type_id: u32,
        /// Why it is not supported.
        reason: String,
    },

    /// A metadata key the MLA configuration needs is absent.
    #[error("{path}: missing metadata key `{key}`")]
    MissingKey {
        /// The GGUF file.
        path: PathBuf,
        /// The full key, e.g. `deepseek2.attention.kv_lora_rank`.
        key: String,
    },

    /// A metadata key is present but its value cannot be used.
    #[error("{path}: metadata key `{key}`: {reason}")]
    BadKey {
        /// The GGUF file.
        path: PathBuf,
        /// The full key.
        key: String,
        /// What is wrong with its value.
        reason: String,
    },

    /// The file's `general.architecture` is not an MLA architecture this build supports.
    #[error(
        "{path}: `general.architecture` is `{arch}`, which is not a supported MLA architecture (supported: {supported})"
    )]
    NotMla {
        /// The GGUF file.
        path: PathBuf,
        /// The architecture found.
        arch: String,
        /// Comma-separated list of supported architectures.
        supported: String,
    },

    /// A tensor the MLA layer needs is not in the file.
    #[error("{path}: missing tensor `{tensor}`")]
    MissingTensor {
        /// The GGUF file.
        path: PathBuf,
        /// The tensor name, e.g. `blk.3.attn_kv_a_mqa.weight`.
        tensor: String,
    },

    /// A tensor exists but its shape does not match what the configuration implies.
    #[error("{path}: tensor `{tensor}` has shape {got:?}, expected {expected:?} ({why})")]
    TensorShape {
        /// The GGUF file (or dump) holding the tensor.
        path: PathBuf,
        /// The tensor name.
        tensor: String,
        /// The expected PyTorch-order shape.
        expected: Vec<u64>,
        /// The shape found, PyTorch order.
        got: Vec<u64>,
        /// Which dims the expectation came from.
        why: String,
    },

    /// Dequantizing a tensor's bytes failed (the bytes do not form whole blocks, say).
    #[error("{path}: tensor `{tensor}`: dequantization failed: {reason}")]
    Dequant {
        /// The GGUF file.
        path: PathBuf,
        /// The tensor name.
        tensor: String,
        /// The reason.
        reason: String,
    },

    /// A layer index outside the model was asked for.
    #[error("{path}: layer {layer} out of range: the model has {n_layers} layers (`block_count`)")]
    LayerOutOfRange {
        /// The GGUF file.
        path: PathBuf,
        /// The layer asked for.
        layer: usize,
        /// The model's `block_count`.
        n_layers: usize,
    },

    /// A request the library cannot serve (bad flag combination, unsupported input mode, …).
    #[error("{0}")]
    Usage(String),

    /// A broken internal invariant: a shape the code itself built does not fit, a stage that
    /// must have been recorded is missing, a weight released too early. Never caused by the
    /// user's input; the message says which invariant and where, so that it can be reported.
    #[error("internal error: {0}")]
    Internal(String),

    /// A safetensors file (golden, dump, weights) is malformed or does not match what is expected.
    #[error("{path}: {what}: {reason}")]
    Safetensors {
        /// The safetensors file.
        path: PathBuf,
        /// The tensor or field involved.
        what: String,
        /// What is wrong.
        reason: String,
    },

    /// A JSON file (manifest, map) cannot be read or written.
    #[error("{path}: JSON: {reason}")]
    Json {
        /// The JSON file.
        path: PathBuf,
        /// The parser's message.
        reason: String,
    },

    /// A golden case cannot be checked: its GGUF changed (sha256 mismatch), a site is missing
    /// on one side, the manifest disagrees with the recomputation's configuration. Never a pass.
    #[error("golden case `{case}` ({path}): {reason}")]
    Golden {
        /// The case name.
        case: String,
        /// The file involved (manifest, trace or GGUF).
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },

    /// A feature of the model that mla-diff does not implement (e.g. a RoPE scaling type other
    /// than none/yarn, or an expert gating function other than softmax/sigmoid).
    #[error("{0}")]
    NotSupported(String),

    /// The CUDA backend is unavailable or failed: a missing library or device, a kernel that
    /// does not compile (with NVRTC's whole log), a failed launch (naming the kernel).
    #[error("CUDA: {0}")]
    Cuda(String),
}

impl Error {
    /// Builds an [`Error::Io`] for `path`.
    pub fn io(path: impl Into<PathBuf>, what: &'static str, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            what,
            err: source,
        }
    }

    /// Builds an [`Error::Cuda`] from a failure of the CUDA driver, NVRTC or cuBLAS, or from a
    /// kernel configuration the device cannot run; `what` names the call or field and its cause.
    pub fn cuda(what: impl std::fmt::Display) -> Self {
        Error::Cuda(what.to_string())
    }

    /// Builds an [`Error::Internal`]: `what` names the invariant that broke and where.
    pub fn internal(what: impl std::fmt::Display) -> Self {
        Error::Internal(what.to_string())
    }

    /// The process exit code for this error: 2 for every variant, input and internal errors
    /// alike (0 and 1 are verdicts, never errors; see docs/design.md, "Exit codes").
    pub fn exit_code(&self) -> u8 {
        2
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn internal_error_is_prefixed_and_exits_2() {
        let e = Error::internal("engine: q_proj released under TP");
        assert_eq!(e.to_string(), "internal error: engine: q_proj released under TP");
        assert_eq!(e.exit_code(), 2);
        assert!(matches!(e, Error::Internal(_)));
        assert_eq!(Error::Usage("--tp must be at least 1".into()).exit_code(), 2);
    }
}
