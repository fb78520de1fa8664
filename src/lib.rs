//! mla-diff: finds bugs in Multi-head Latent Attention (MLA) forward paths.
//!
//! An MLA model (DeepSeek-V2/V3, Kimi-K2, GLM-5, MiniCPM3) that loads cleanly and prints fluent
//! nonsense gives no error to start from. mla-diff runs engine-style MLA forward paths next to a
//! plain f64 reference on the same GGUF weights, diffs every intermediate layer by layer, and
//! points at the first tensor that diverges. The data flow, one direction only (DESIGN.md):
//!
//! GGUF file → [`gguf`] (validated, lazy) → [`config`] → [`weights`] (one layer, dequantized)
//! → [`reference`](mod@reference) and [`paths`] → [`trace`] → [`compare`] (against [`tolerance`])
//! → [`report`] / [`cli`].

// Index loops are kept where they mirror a kernel's thread/element indexing.
#![allow(clippy::needless_range_loop)]

pub mod batch;
pub mod bench_cpu;
pub mod cli;
pub mod compare;
pub mod config;
pub mod cuda;
pub mod diagnose;
pub mod dump;
pub mod error;
pub mod faults;
pub mod gguf;
pub mod golden;
pub mod indexer;
pub mod inspect;
pub mod paths;
pub mod reference;
pub mod report;
pub mod run;
pub mod selftest;
pub mod st;
pub mod tolerance;
pub mod trace;
pub mod triage;
pub mod weights;
pub mod weights_check;

pub use error::{Error, Result};
