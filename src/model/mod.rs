//! What a model file and an engine dump say, read and checked.
//!
//! The GGUF reader (validated header, lazy tensors, dequantization), the supported architectures
//! and their quirks, the table of GGUF tensor names, the MLA configuration read from its
//! metadata, one layer's weights, the embedded default fixture, and the reader of engine dumps
//! with its name maps. It computes nothing but dequantization, and it judges nothing.
//!
//! A model is a GGUF file or a Hugging Face checkpoint folder ([`hf`]), which is presented in
//! GGUF terms so that everything above reads one kind of model; [`open`] takes either.

use std::path::Path;

/// Opens the model at `path`: a Hugging Face checkpoint when `path` is a folder holding
/// `config.json` (or a `.json` file of one), else a GGUF file.
///
/// Errors: as [`hf::open`] or [`gguf::GgufFile::open`].
pub fn open(path: impl AsRef<Path>) -> crate::core::error::Result<gguf::GgufFile> {
    let path = path.as_ref();
    if hf::is_checkpoint(path) {
        return hf::open(path);
    }
    // The two mistakes a GGUF reader would only call a bad magic: a folder that is no
    // checkpoint, and one shard of a checkpoint.
    if path.is_dir() {
        return Err(crate::core::error::Error::Usage(format!(
            "{}: a folder without {}: a model is a GGUF file or a Hugging Face checkpoint folder ({} and its safetensors shards)",
            path.display(),
            hf::CONFIG_FILE,
            hf::CONFIG_FILE
        )));
    }
    if path.extension().is_some_and(|e| e == "safetensors") {
        return Err(crate::core::error::Error::Usage(format!(
            "{}: a safetensors file: a Hugging Face checkpoint is read from its folder ({}, the index and the shards); pass the folder",
            path.display(),
            hf::CONFIG_FILE
        )));
    }
    gguf::GgufFile::open(path)
}

pub mod arch;
pub mod config;
pub mod dump;
pub mod fixture;
pub mod gguf;
pub mod hf;
pub mod tensors;
pub mod weights;
