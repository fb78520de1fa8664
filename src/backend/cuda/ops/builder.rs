//! The kernel and argument builder of [`CudaOps`]: a kernel name and its arguments in, a
//! checked launch out.
//!
//! Every launch of the simple kernels goes the same way: look the kernel up in the device's
//! module cache, push the arguments in the order of its `kernels/*.cu` signature, launch, then
//! synchronize and name the kernel in any error. Writing that once (the `launch!` macro, the
//! length check every caller runs first, the bf16 casts and the block-table flattening several
//! launches share) keeps each launch in [`super::launches`] to its arguments, and keeps the
//! error attribution identical for all of them.

use cudarc::driver::{CudaFunction, CudaSlice, PushKernelArg};

use crate::core::error::{Error, Result};
use crate::device::Module;
use crate::device::context::grid1;
use crate::model::gguf::GgmlType;

use super::CudaOps;

impl CudaOps {
    /// Kernel `name` of `module`, from the device's cache ([`crate::device::context::Device::func`]).
    pub(super) fn func(&self, module: Module, name: &'static str) -> Result<CudaFunction> {
        self.dev.func(module, name)
    }

    /// Waits for the stream and turns any asynchronous error into one naming `kernel`.
    pub(super) fn sync(&self, kernel: &str) -> Result<()> {
        if !self.sync_each {
            return Ok(());
        }
        self.dev
            .stream()
            .synchronize()
            .map_err(|e| Error::cuda(format!("kernel `{kernel}` failed: {e:?}")))
    }

    /// An uninitialized f32 buffer of `n` elements (at least one), to be filled before any read.
    pub(crate) fn alloc(&self, n: usize) -> Result<CudaSlice<f32>> {
        self.dev.alloc(n)
    }

    /// `v` uploaded as i64 indices (one zero for an empty list).
    pub(crate) fn idx(&self, v: &[usize]) -> Result<CudaSlice<i64>> {
        self.dev.idx(v)
    }

    /// A bf16 copy of `x` (`n` elements), for kernels and GEMMs that read bf16.
    pub(crate) fn to_bf16(&self, x: &CudaSlice<f32>, n: usize) -> Result<CudaSlice<half::bf16>> {
        // SAFETY: every element is written by cast_bf16 below.
        let mut y = unsafe { self.dev.stream().alloc::<half::bf16>(n.max(1)) }
            .map_err(|e| Error::cuda(format!("alloc bf16: {e:?}")))?;
        let f = self.func(Module::Elementwise, "cast_bf16")?;
        let nn = n as i64;
        let mut b = self.dev.stream().launch_builder(&f);
        b.arg(x).arg(&mut y).arg(&nn);
        // SAFETY: argument types match the kernel signature in elementwise.cu.
        unsafe { b.launch(grid1(n)) }.map_err(|e| Error::cuda(format!("launch cast_bf16: {e:?}")))?;
        self.sync("cast_bf16")?;
        Ok(y)
    }

    /// `x` rounded to bf16 and held in f32 (`n` elements).
    pub(super) fn round_bf16(&self, x: &CudaSlice<f32>, n: usize) -> Result<CudaSlice<f32>> {
        let mut y = self.alloc(n)?;
        let nn = n as i64;
        let f = self.func(Module::Elementwise, "round_bf16")?;
        let mut b = self.dev.stream().launch_builder(&f);
        b.arg(x).arg(&mut y).arg(&nn);
        // SAFETY: argument types match round_bf16 in elementwise.cu.
        unsafe { b.launch(grid1(n)) }.map_err(|e| Error::cuda(format!("launch round_bf16: {e:?}")))?;
        self.sync("round_bf16")?;
        Ok(y)
    }

    /// Refuses a buffer shorter than the `need` elements a launch reads or writes.
    ///
    /// Errors: an internal error naming `what`, the need and the length.
    pub(super) fn check_len(b: &CudaSlice<f32>, need: usize, what: &str) -> Result<()> {
        if b.len() < need {
            return Err(Error::internal(format!(
                "CUDA backend: {what} needs {need} elements, buffer has {}",
                b.len()
            )));
        }
        Ok(())
    }

    /// `out [n]` from the first `n` elements of two inputs by the elementwise kernel `kernel`
    /// (`add` or `silu_mul` in elementwise.cu, each `kernel(x, y, out, n)`); each input comes with
    /// its name for the length error.
    ///
    /// Errors: an input shorter than `n`, allocation or launch failures.
    pub(super) fn binary(
        &self,
        kernel: &'static str,
        inputs: [(&CudaSlice<f32>, &str); 2],
        n: usize,
    ) -> Result<CudaSlice<f32>> {
        let [(x, x_name), (y, y_name)] = inputs;
        Self::check_len(x, n, &format!("{kernel} {x_name}"))?;
        Self::check_len(y, n, &format!("{kernel} {y_name}"))?;
        let mut out = self.alloc(n)?;
        let nn = n as i64;
        let f = self.func(Module::Elementwise, kernel)?;
        let mut b = self.dev.stream().launch_builder(&f);
        b.arg(x).arg(y).arg(&mut out).arg(&nn);
        // SAFETY: the kernel takes (x, y, out, n), and both inputs hold n elements (checked above).
        unsafe { b.launch(grid1(n)) }.map_err(|e| Error::cuda(format!("launch {kernel}: {e:?}")))?;
        self.sync(kernel)?;
        Ok(out)
    }

    /// Dequantizes on the GPU when a kernel exists for `ty` ([`crate::device::context::Device::dequant`]).
    pub(super) fn gpu_dequant(&self, ty: GgmlType, bytes: &[u8], n: usize) -> Result<Option<CudaSlice<f32>>> {
        match self.dev.dequant(ty, bytes, n)? {
            Some((y, kernel)) => {
                self.sync(kernel)?;
                Ok(Some(y))
            }
            None => Ok(None),
        }
    }

    /// Block tables as one `[n, max_blocks]` array (rows padded with block 0), checked against
    /// the context lengths and the cache's size; returns it and `max_blocks`.
    pub(super) fn flat_tables(
        cache: &CudaSlice<f32>,
        block_size: usize,
        width: usize,
        tables: &[Vec<usize>],
        ctx: &[usize],
    ) -> Result<(Vec<usize>, usize)> {
        let max_blocks = tables.iter().map(Vec::len).max().unwrap_or(1).max(1);
        let mut flat = vec![0usize; tables.len() * max_blocks];
        for (i, (t, &c)) in tables.iter().zip(ctx).enumerate() {
            if c.div_ceil(block_size) > t.len() {
                return Err(Error::cuda(format!(
                    "decode: context {c} exceeds row {i}'s block table"
                )));
            }
            for (j, &b) in t.iter().enumerate() {
                Self::check_len(cache, (b + 1) * block_size * width, "decode block")?;
                flat[i * max_blocks + j] = b;
            }
        }
        Ok((flat, max_blocks))
    }
}

/// Launches kernel `$name` of `$module` with `$cfg` and the arguments in order, then
/// synchronizes ([`CudaOps::sync`]); an error names the kernel.
macro_rules! launch {
    ($self:ident, $module:expr, $name:literal, $cfg:expr, $($arg:expr),* $(,)?) => {{
        let f = $self.func($module, $name)?;
        let mut b = $self.dev.stream().launch_builder(&f);
        $( b.arg($arg); )*
        // SAFETY: the argument list matches the kernel's signature in kernels/*.cu, and every
        // buffer was length-checked by the caller.
        unsafe { b.launch($cfg) }.map_err(|e| Error::cuda(format!("launch {}: {e:?}", $name)))?;
        $self.sync($name)?;
    }};
}

pub(super) use launch;
