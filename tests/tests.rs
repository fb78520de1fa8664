//! The integration tests, one binary (a module per area): one link instead of one per file, and
//! `tests/common` compiled once. The CUDA tests are their own binary (`tests/cuda.rs`), since
//! they need a GPU (ignored unless asked for with `--include-ignored`).

mod common;

mod bad_input;
mod bench_cpu;
mod compare_dump;
mod config;
mod context_chunks;
mod dequant_vectors;
mod diagnose;
mod doc_tables;
mod dsa_export;
mod dsa_fp8;
mod dsa_scale;
mod dtype;
mod exit_codes;
mod faults;
mod ffn;
mod first_use;
mod fixtures;
mod fp8_compute;
mod golden;
mod hf_checkpoint;
mod hf_golden;
mod hostile;
mod hostile_dump;
mod hostile_flags;
mod json_report;
mod kernel_inputs;
mod layering;
mod moe;
mod moe_fixture;
mod not_compared;
mod not_run;
mod one_answer;
mod outputs;
mod paged;
mod plant_dumps;
mod scale;
mod scripts;
mod selftest;
mod sites;
mod snapshots;
mod split_merge;
mod tensor_table;
mod triage_report;
mod union_reference;
mod vllm_cpu_chunked;
mod vllm_cpu_fp8;
mod vllm_dumps;
mod vllm_gpu_fp8;
mod vllm_gpu_live;
mod weights_check;
mod windowed_dumps;
