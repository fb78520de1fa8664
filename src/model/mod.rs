//! What a model file and an engine dump say, read and checked.
//!
//! The GGUF reader (validated header, lazy tensors, dequantization), the supported architectures
//! and their quirks, the table of GGUF tensor names, the MLA configuration read from its
//! metadata, one layer's weights, the embedded default fixture, and the reader of engine dumps
//! with its name maps. It computes nothing but dequantization, and it judges nothing.

pub mod arch;
pub mod config;
pub mod dump;
pub mod fixture;
pub mod gguf;
pub mod tensors;
pub mod weights;
