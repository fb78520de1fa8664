//! mla-diff: finds bugs in Multi-head Latent Attention (MLA) forward paths.
//!
//! An MLA model (DeepSeek-V2/V3, Kimi-K2, GLM-5, MiniCPM3) that loads cleanly and prints fluent
//! nonsense gives no error to start from. mla-diff runs engine-style MLA forward paths next to a
//! plain f64 reference on the same GGUF weights, diffs every intermediate layer by layer, and
//! points at the first tensor that diverges.
//!
//! The crate is layered by data flow; each folder imports only from the folders listed before it
//! (`tests/layering.rs` enforces it, docs/design.md explains it):
//!
//! [`core`] → [`model`] → [`device`] → [`compute`] → [`backend`] → [`judge`] → [`output`] →
//! [`jobs`] → [`cli`].

// Index loops are kept where they mirror a kernel's thread/element indexing.
#![allow(clippy::needless_range_loop)]

pub mod backend;
pub mod cli;
pub mod compute;
pub mod core;
pub mod device;
pub mod jobs;
pub mod judge;
pub mod model;
pub mod output;

pub use core::error::{Error, Result};
