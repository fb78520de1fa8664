//! The engine's linear layers on cuBLAS: [`CudaOps::cublas_linear`].
//!
//! The one step this backend does not write itself. A GEMM is row-major `y = x·wᵀ` in the
//! engine and column-major in cuBLAS, and each dtype takes a different entry point (SGEMM for
//! f32, GemmEx with bf16 inputs and f32 accumulation for bf16, or SGEMM on bf16-rounded inputs
//! where cuBLAS's bf16 kernels cannot run, `MLA_DIFF_BF16_GEMM=emulate`): those details are kept
//! apart from our own kernels.

use std::ffi::c_void;

use cudarc::cublas::{Gemm, GemmConfig, sys as cb};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};

use crate::compute::ops::Ops;
use crate::core::dtype::Dtype;
use crate::core::error::{Error, Result};

use super::CudaOps;

impl CudaOps {
    /// `y [t, o] = x [t, k] · w [o, k]ᵀ` (f32 buffers, row-major) through cuBLAS in this
    /// backend's dtype ([`Ops::linear`]); for bf16 through cuBLAS's bf16 GEMM, or as an SGEMM on
    /// bf16-rounded inputs when `MLA_DIFF_BF16_GEMM=emulate` was set when [`CudaOps::new`] ran.
    ///
    /// Errors: an input shorter than its shape, allocation, cuBLAS or launch failures.
    pub(super) fn cublas_linear(
        &self,
        x: &CudaSlice<f32>,
        t: usize,
        k: usize,
        w: &CudaSlice<f32>,
        o: usize,
    ) -> Result<CudaSlice<f32>> {
        Self::check_len(x, t * k, "linear x")?;
        Self::check_len(w, o * k, "linear w")?;
        let mut y = self.canary(t * o)?;
        if t == 0 || o == 0 || k == 0 {
            return Ok(y);
        }
        // Row-major y[t,o] = x[t,k]·w[o,k]ᵀ is column-major yᵀ = W·xᵀ: C(o×t) = Aᵀ(o×k)·B(k×t)
        // with A = w as a k×o column-major matrix and B = x as k×t.
        let sgemm = GemmConfig {
            transa: cb::cublasOperation_t::CUBLAS_OP_T,
            transb: cb::cublasOperation_t::CUBLAS_OP_N,
            m: o as i32,
            n: t as i32,
            k: k as i32,
            alpha: 1.0f32,
            lda: k as i32,
            ldb: k as i32,
            beta: 0.0f32,
            ldc: o as i32,
        };
        match self.dtype {
            Dtype::F32 => {
                // SAFETY: dims and leading dimensions match the buffers checked above.
                unsafe { self.dev.blas().gemm(sgemm, w, x, &mut y) }
                    .map_err(|e| Error::cuda(format!("cublasSgemm: {e:?}")))?;
            }
            Dtype::Bf16 if self.emulate_bf16_gemm => {
                // bf16 inputs held exactly in f32, f32 accumulation: the same arithmetic as the
                // bf16 GEMM, through cublasSgemm. For compute-sanitizer runs, which cannot handle
                // cuBLAS's bf16 kernels.
                let (xr, wr) = (self.round_bf16(x, t * k)?, self.round_bf16(w, o * k)?);
                // SAFETY: dims and leading dimensions match the buffers checked above.
                unsafe { self.dev.blas().gemm(sgemm, &wr, &xr, &mut y) }
                    .map_err(|e| Error::cuda(format!("cublasSgemm: {e:?}")))?;
            }
            Dtype::Bf16 => {
                let (wb, xb) = (self.to_bf16(w, o * k)?, self.to_bf16(x, t * k)?);
                let (alpha, beta) = (1.0f32, 0.0f32);
                let stream = &self.dev.stream();
                let (wp, _gw) = wb.device_ptr(stream);
                let (xp, _gx) = xb.device_ptr(stream);
                let (yp, _gy) = y.device_ptr_mut(stream);
                // SAFETY: bf16 inputs, f32 output, f32 compute; dims as above.
                unsafe {
                    cudarc::cublas::result::gemm_ex(
                        *self.dev.blas().handle(),
                        cb::cublasOperation_t::CUBLAS_OP_T,
                        cb::cublasOperation_t::CUBLAS_OP_N,
                        o as i32,
                        t as i32,
                        k as i32,
                        (&alpha as *const f32).cast::<c_void>(),
                        wp as *const c_void,
                        cb::cudaDataType_t::CUDA_R_16BF,
                        k as i32,
                        xp as *const c_void,
                        cb::cudaDataType_t::CUDA_R_16BF,
                        k as i32,
                        (&beta as *const f32).cast::<c_void>(),
                        yp as *mut c_void,
                        cb::cudaDataType_t::CUDA_R_32F,
                        o as i32,
                        cb::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                        cb::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                    )
                }
                .map_err(|e| Error::cuda(format!("cublasGemmEx (bf16 in, f32 out): {e:?}")))?;
            }
        }
        self.sync("cublas gemm")?;
        Ok(y)
    }
}
