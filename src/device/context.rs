//! The CUDA device: context, stream, cuBLAS handle, compiled kernel modules and their cache.
//!
//! Everything a GPU computation needs before it decides what to compute: opening device 0,
//! compiling `kernels/*.cu` with NVRTC for its architecture, caching kernels by name (and the fast
//! kernels by shape and configuration), allocation, index upload and dequantization of GGUF bytes.
//! It sits below the computations so that the CUDA backend (`backend/cuda/ops/`) and the f64
//! GPU reference (`backend/cuda/reference.rs`) share one device.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};

use crate::core::error::{Error, Result};
use crate::core::settings::DeviceSettings;
use crate::device::{ComputeCapability, Module, compile, include_dir, probe};
use crate::model::gguf::GgmlType;

/// Threads per block of the elementwise kernels.
pub const THREADS: u32 = 256;

/// A one-dimensional grid of [`THREADS`]-thread blocks covering `n` elements (at least one block).
///
/// The block count is computed in `usize`: a count truncated to 32 bits before the division
/// covers only `n mod 2^32` elements, and the kernels (one element per thread, no grid-stride
/// loop) then leave the rest of their output as it was, with no error. A count past the
/// device's grid limit (2^31 − 1 blocks, 5.5·10^11 elements) saturates, so that the launch
/// fails instead of covering less.
pub fn grid1(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(THREADS as usize).max(1);
    LaunchConfig {
        grid_dim: (u32::try_from(blocks).unwrap_or(u32::MAX), 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Cache key of a fast kernel: module, its two shape dims, its configuration defines.
type FastKey = (Module, usize, usize, Vec<(&'static str, usize)>);

/// The device, its stream, cuBLAS and the loaded kernel modules, shared by every `CudaOps`.
pub struct Device {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    modules: HashMap<Module, Arc<CudaModule>>,
    functions: Mutex<HashMap<&'static str, CudaFunction>>,
    /// Fast kernels, compiled per shape on first use: (module, dim a, dim b, launch
    /// configuration's defines) → function.
    fast: Mutex<HashMap<FastKey, CudaFunction>>,
    /// Whole weight tensors of the layer being judged, dequantized on this device from the raw
    /// GGUF bytes once (f32, ggml element order), by GGUF tensor name: the GPU reference reads
    /// them and the engine paths take them over, so that a layer is dequantized once.
    layer_weights: Mutex<HashMap<String, CudaSlice<f32>>>,
    /// Device name, e.g. "NVIDIA H200".
    pub name: String,
    /// The device's compute capability, which the kernels are compiled for (`sm_90`; the fast
    /// decode's wgmma build for its architecture-specific form, [`ComputeCapability::target_for`]).
    pub arch: ComputeCapability,
    /// The CUDA include folder NVRTC used.
    pub include: PathBuf,
    /// The on-disk NVRTC cache the kernels compile through ([`DeviceSettings::nvrtc_cache`]).
    nvrtc_cache: Option<PathBuf>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("name", &self.name)
            .field("arch", &self.arch)
            .finish()
    }
}

impl Device {
    /// Opens device 0, compiles every kernel module with NVRTC for its compute capability
    /// (headers from `include`, else as [`include_dir`] finds them in `settings`; through
    /// `settings`' NVRTC cache) and loads it, and creates a cuBLAS handle.
    ///
    /// Errors: [`Error::Cuda`] when a library or the device is missing (checked before cudarc
    /// is called), when the include folder lacks `cuda_bf16.h`, or with NVRTC's whole log when a
    /// kernel does not compile.
    pub fn open(include: Option<&Path>, settings: &DeviceSettings) -> Result<Self> {
        probe()?;
        let include = include_dir(include, settings)?;
        let nvrtc_cache = settings.nvrtc_cache.clone();
        let ctx = CudaContext::new(0).map_err(|e| Error::cuda(format!("cuCtxCreate on device 0: {e:?}")))?;
        let name = ctx.name().map_err(|e| Error::cuda(format!("cuDeviceGetName: {e:?}")))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| Error::cuda(format!("compute capability: {e:?}")))?;
        let arch = ComputeCapability::from_device(major, minor)?;
        let stream = ctx.default_stream();
        let blas = CudaBlas::new(stream.clone()).map_err(|e| Error::cuda(format!("cublasCreate: {e:?}")))?;
        let mut modules = HashMap::new();
        for &m in Module::SIMPLE {
            let c = compile(m, arch, &include, false, &[], nvrtc_cache.as_deref())?;
            let module = ctx
                .load_module(cudarc::nvrtc::Ptx::from_binary(c.cubin))
                .map_err(|e| Error::cuda(format!("{}: cuModuleLoadData: {e:?}", m.file())))?;
            modules.insert(m, module);
        }
        Ok(Device {
            ctx,
            stream,
            blas,
            modules,
            functions: Mutex::new(HashMap::new()),
            fast: Mutex::new(HashMap::new()),
            layer_weights: Mutex::new(HashMap::new()),
            name,
            arch,
            include,
            nvrtc_cache,
        })
    }

    /// The stream every launch goes to.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The CUDA context (for attribute queries).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The cuBLAS handle, bound to [`Device::stream`].
    pub fn blas(&self) -> &CudaBlas {
        &self.blas
    }

    /// One line for reports: name, compute capability, kernel architecture, NVRTC version and
    /// include folder.
    pub fn describe(&self) -> String {
        let nv = crate::device::nvrtc_version()
            .map(|(a, b)| format!("{a}.{b}"))
            .unwrap_or_else(|_| "?".into());
        format!(
            "{} (compute {}.{}, kernels {}, NVRTC {nv}, include {})",
            self.name,
            self.arch.major,
            self.arch.minor,
            self.arch,
            self.include.display()
        )
    }

    /// A fast kernel compiled for shape `(a, b)` (prefill: P+R, V; decode: L+R, L) and the
    /// configuration `extra` (more `-D` defines), with its dynamic shared memory limit raised to
    /// `smem` bytes.
    pub fn fast_function(
        &self,
        module: Module,
        a: usize,
        b: usize,
        extra: &[(&'static str, usize)],
        smem: usize,
    ) -> Result<CudaFunction> {
        let mut cache = self
            .fast
            .lock()
            .map_err(|_| Error::cuda("fast kernel cache poisoned"))?;
        let key = (module, a, b, extra.to_vec());
        if let Some(f) = cache.get(&key) {
            return Ok(f.clone());
        }
        let (mut defines, name): (Vec<(&str, usize)>, &str) = match module {
            Module::FastPrefill => (vec![("MLA_DQK", a), ("MLA_DV", b)], "flash_prefill_mma"),
            Module::FastDecode => (vec![("MLA_W", a), ("MLA_DV", b)], "decode_split_mma"),
            _ => return Err(Error::cuda(format!("{} is not a fast kernel module", module.file()))),
        };
        defines.extend_from_slice(extra);
        let c = compile(
            module,
            self.arch.target_for(&defines),
            &self.include,
            false,
            &defines,
            self.nvrtc_cache.as_deref(),
        )?;
        let m = self
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(c.cubin))
            .map_err(|e| Error::cuda(format!("{}: cuModuleLoadData: {e:?}", module.file())))?;
        let f = m
            .load_function(name)
            .map_err(|e| Error::cuda(format!("{}: kernel `{name}` not found: {e:?}", module.file())))?;
        f.set_attribute(
            cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )
        .map_err(|e| Error::cuda(format!("{name}: cannot allow {smem} bytes of shared memory: {e:?}")))?;
        cache.insert(key, f.clone());
        Ok(f)
    }

    /// A kernel of a module loaded at [`Device::open`], looked up once.
    pub fn func(&self, module: Module, name: &'static str) -> Result<CudaFunction> {
        let mut cache = self
            .functions
            .lock()
            .map_err(|_| Error::cuda("kernel cache poisoned"))?;
        if let Some(f) = cache.get(name) {
            return Ok(f.clone());
        }
        let m = self
            .modules
            .get(&module)
            .ok_or_else(|| Error::cuda(format!("module {} not loaded", module.file())))?;
        let f = m
            .load_function(name)
            .map_err(|e| Error::cuda(format!("{}: kernel `{name}` not found: {e:?}", module.file())))?;
        cache.insert(name, f.clone());
        Ok(f)
    }

    /// Keeps `buf`, the whole tensor `name` dequantized on this device, for the layer being
    /// judged (replacing an earlier one of that name).
    pub fn keep_layer_weight(&self, name: &str, buf: CudaSlice<f32>) {
        if let Ok(mut m) = self.layer_weights.lock() {
            m.insert(name.to_string(), buf);
        }
    }

    /// Runs `f` on the kept tensor `name` when it holds exactly `n` elements; `None` when there
    /// is no such tensor (never kept, taken, or another size).
    pub fn with_layer_weight<R>(&self, name: &str, n: usize, f: impl FnOnce(&CudaSlice<f32>) -> R) -> Option<R> {
        let m = self.layer_weights.lock().ok()?;
        m.get(name).filter(|b| b.len() == n).map(f)
    }

    /// Takes the kept tensor `name` when it holds exactly `n` elements (an engine path loading
    /// the whole tensor); `None` otherwise, and the caller dequantizes the raw bytes itself.
    pub fn take_layer_weight(&self, name: &str, n: usize) -> Option<CudaSlice<f32>> {
        let mut m = self.layer_weights.lock().ok()?;
        if m.get(name).is_some_and(|b| b.len() == n) {
            m.remove(name)
        } else {
            None
        }
    }

    /// Frees every kept tensor (the layer is judged).
    pub fn release_layer_weights(&self) {
        if let Ok(mut m) = self.layer_weights.lock() {
            m.clear();
        }
    }

    /// An uninitialized buffer of `n` floats (at least one): the caller fills it before any read.
    pub fn alloc(&self, n: usize) -> Result<CudaSlice<f32>> {
        // SAFETY: the memory is filled by the canary kernel (or fully written) before any read.
        unsafe { self.stream.alloc::<f32>(n.max(1)) }
            .map_err(|e| Error::cuda(format!("cuMemAlloc of {n} floats: {e:?}")))
    }

    /// Uploads indices as i64 (one zero for an empty list, so the pointer is valid).
    pub fn idx(&self, v: &[usize]) -> Result<CudaSlice<i64>> {
        let w: Vec<i64> = if v.is_empty() {
            vec![0]
        } else {
            v.iter().map(|&x| x as i64).collect()
        };
        self.stream
            .clone_htod(&w)
            .map_err(|e| Error::cuda(format!("upload indices: {e:?}")))
    }

    /// Dequantizes `n` elements of ggml type `ty` from their raw `bytes` on the GPU, when a kernel
    /// exists for `ty` (`None` otherwise), with the kernel's name; the launch is not waited for.
    ///
    /// Errors: [`Error::Cuda`] when `bytes` does not hold `n` elements of `ty`, or on a failed
    /// upload, allocation or launch.
    pub fn dequant(&self, ty: GgmlType, bytes: &[u8], n: usize) -> Result<Option<(CudaSlice<f32>, &'static str)>> {
        let kernel = match ty {
            GgmlType::F32 => "dequant_f32",
            GgmlType::F16 => "dequant_f16",
            GgmlType::BF16 => "dequant_bf16",
            GgmlType::Q8_0 => "dequant_q8_0",
            GgmlType::Q4_0 => "dequant_q4_0",
            GgmlType::Q4_1 => "dequant_q4_1",
            GgmlType::Q5_0 => "dequant_q5_0",
            GgmlType::Q5_1 => "dequant_q5_1",
            GgmlType::Q4_K => "dequant_q4_k",
            GgmlType::Q5_K => "dequant_q5_k",
            GgmlType::Q6_K => "dequant_q6_k",
            _ => return Ok(None),
        };
        let bs = ty.block_size() as usize;
        let ts = ty.type_size() as usize;
        if !n.is_multiple_of(bs) || bytes.len() != n / bs * ts {
            return Err(Error::cuda(format!(
                "{ty}: {} bytes do not hold {n} elements",
                bytes.len()
            )));
        }
        let raw = self
            .stream
            .clone_htod(bytes)
            .map_err(|e| Error::cuda(format!("upload raw {ty}: {e:?}")))?;
        let mut y = self.alloc(n)?;
        let nblocks = (n / bs) as i64;
        let f = self.func(Module::Dequant, kernel)?;
        let mut b = self.stream.launch_builder(&f);
        b.arg(&raw).arg(&mut y).arg(&nblocks);
        // SAFETY: argument types match dequant.cu.
        unsafe { b.launch(grid1(n)) }.map_err(|e| Error::cuda(format!("launch {kernel}: {e:?}")))?;
        Ok(Some((y, kernel)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid1_covers_counts_past_32_bits() {
        let covered = |n: usize| grid1(n).grid_dim.0 as usize * THREADS as usize;
        // Past 2^32 elements: one GLM-5 layer's per-query key copy at T = 1024 (524,800 kept keys
        // of 64 heads × 256 floats) is 8,598,323,200 elements; a 32-bit count covered 8,388,608.
        for n in [1, 255, 256, 257, (1 << 32) - 1, 1 << 32, 524_800 * 64 * 256] {
            assert!(covered(n) >= n && covered(n) < n + THREADS as usize, "n = {n}");
        }
        assert_eq!(grid1(0).grid_dim.0, 1);
        // Past the device's grid limit the count saturates, so that the launch fails.
        assert_eq!(grid1(usize::MAX / 2).grid_dim.0, u32::MAX);
    }
}
