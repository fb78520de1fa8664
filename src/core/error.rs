//! The one error type of the library.
//!
//! Every failure a user can cause (a truncated or hostile GGUF, a missing tensor, a bad flag, a
//! mismatched dump) becomes one variant of [`Error`] with structured fields naming the file, the
//! tensor and the field involved, so that the binary can print a single line and exit with code 2.
//! The classes stay apart: [`Error::Usage`] is a flag or a combination of flags, [`Error::Input`]
//! and the format variants are a file whose content is at fault, [`Error::Internal`] is a bug of
//! the tool. An OS or driver error is kept as the [`std::error::Error::source`] of its variant,
//! and [`chain`] writes the message with every cause as one line.
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
    #[error("{path}: {what}")]
    Io {
        /// The file involved.
        path: PathBuf,
        /// What was being done (e.g. "open", "mmap", "write").
        what: &'static str,
        /// The OS error: the cause, printed after the message by [`chain`].
        #[source]
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

    /// A flag, or a combination of flags, that cannot be served: a value out of range, two
    /// flags that exclude each other, an output path that would be overwritten; the message
    /// names the flag.
    #[error("{0}")]
    Usage(String),

    /// A file whose content is at fault without being malformed as a container: a dump that
    /// lacks a tensor a comparison needs, a model that holds nothing a command can work on.
    #[error("{path}: {what}: {reason}")]
    Input {
        /// The file.
        path: PathBuf,
        /// The part of it involved (a layer, a step, its tensors).
        what: String,
        /// What is wrong with it.
        reason: String,
    },

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
    #[error("CUDA: {what}")]
    Cuda {
        /// The call or field that failed, or the whole reason when no driver error caused it.
        what: String,
        /// The error the CUDA driver, NVRTC, cuBLAS or NCCL returned, when one did.
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
    },
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
        Error::Cuda {
            what: what.to_string(),
            source: None,
        }
    }

    /// Builds an [`Error::Cuda`] for the call `what` that failed with the library's `source`
    /// error (a cudarc `DriverError`, say), kept as the cause: [`chain`] prints `CUDA: what: source`.
    pub fn cuda_call(what: impl std::fmt::Display, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        Error::Cuda {
            what: what.to_string(),
            source: Some(Box::new(source)),
        }
    }

    /// Builds an [`Error::Input`]: `what` part of the file at `path` is at fault, for `reason`.
    pub fn input(path: impl Into<PathBuf>, what: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::Input {
            path: path.into(),
            what: what.into(),
            reason: reason.into(),
        }
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

/// `e`'s message followed by each of its causes ([`std::error::Error::source`]), joined by
/// `: ` into one line, e.g. `<stdout>: write: Broken pipe (os error 32)`.
pub fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cause = c.source();
    }
    s
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

    /// The OS error of an I/O failure is its cause, not part of its message, and [`chain`]
    /// prints it once after the message.
    #[test]
    fn io_errors_keep_the_os_error_as_their_cause() {
        let os = std::io::Error::from(std::io::ErrorKind::BrokenPipe);
        let want = format!("<stdout>: write: {os}");
        let e = Error::io("<stdout>", "write", os);
        assert_eq!(e.to_string(), "<stdout>: write");
        assert!(std::error::Error::source(&e).is_some());
        assert_eq!(chain(&e), want);
    }

    /// A CUDA error built from a library error keeps it as the cause; one built from a message
    /// has none.
    #[test]
    fn cuda_errors_keep_the_library_error_as_their_cause() {
        let lib = std::io::Error::other("CUDA_ERROR_OUT_OF_MEMORY");
        let e = Error::cuda_call("upload", lib);
        assert_eq!(e.to_string(), "CUDA: upload");
        assert_eq!(chain(&e), "CUDA: upload: CUDA_ERROR_OUT_OF_MEMORY");
        let e = Error::cuda("no CUDA driver library (libcuda.so) found");
        assert!(std::error::Error::source(&e).is_none());
        assert_eq!(chain(&e), "CUDA: no CUDA driver library (libcuda.so) found");
    }

    #[test]
    fn input_errors_name_the_file_the_part_and_the_reason() {
        let e = Error::input("d.safetensors", "layer 1", "no input");
        assert_eq!(chain(&e), "d.safetensors: layer 1: no input");
    }
}
