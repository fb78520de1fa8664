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
        hf::open(path)
    } else {
        gguf::GgufFile::open(path)
    }
}

pub mod arch;
pub mod config;
pub mod dump;
pub mod fixture;
pub mod gguf;
pub mod hf;
pub mod tensors;
pub mod weights;
