//! The CUDA backend: the [`crate::compute::ops::Ops`] trait on NVRTC kernels and cuBLAS.
//!
//! The device context, kernel compilation and module cache live in [`crate::device`]; this
//! module turns each engine step into launches, with the launch configuration chosen by
//! [`crate::backend::decode_cfg`] and [`crate::backend::prefill_cfg`].

pub mod compare;
pub mod nccl;
pub mod ops;
pub mod reference;
