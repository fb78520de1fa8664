//! The commands' work, one module per job, callable as a library.
//!
//! `run` (reference and paths on the same layer), `export` (a layer's inputs for production
//! kernels, from the reference), `compare` (an engine dump against the reference),
//! `weights_check`, `golden`, `selftest`, `inspect`, the CPU and GPU benchmarks and the kernel
//! compile check. Each takes typed options and returns a typed result; the command
//! line in [`crate::cli`] only parses arguments and prints.

pub mod bench_cpu;
pub mod bench_gpu;
pub mod compare;
pub mod export;
pub mod golden;
pub mod inspect;
pub mod kernels;
pub mod limits;
pub mod run;
pub mod selftest;
pub mod weights_check;
