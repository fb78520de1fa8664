//! The CUDA device layer: what every GPU computation needs before it decides what to compute.
//!
//! cudarc panics when a library is missing, and NVRTC compiles the `kernels/*.cu` sources at run
//! time for the device's compute capability, so both the backend and the tools that only probe
//! or compile need one place that checks and compiles safely. This module checks that the
//! driver, NVRTC and cuBLAS libraries are present before touching cudarc ([`probe`], the
//! `*_present` and version functions), names the kernel modules ([`Module`]), compiles them
//! with NVRTC for an architecture ([`compile`], or for given architectures with `kernels
//! --compile-only`) through an on-disk cache keyed by source, options and toolkit (its folder
//! from [`DeviceSettings`]) and parses ptxas's register and spill report ([`parse_usage`]).
//! [`capability`] names an architecture and says what it has (wgmma, bulk copies);
//! [`context`] holds the opened device (context, stream, cuBLAS handle, loaded modules).
//! It sits below `backend/`, so the CUDA backend and the GPU reference
//! (`backend/cuda/reference.rs`) share one device and one kernel cache.

pub mod capability;
pub mod context;

use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};

use crate::core::error::{Error, Result};
use crate::core::settings::DeviceSettings;

pub use capability::ComputeCapability;

/// The prelude prepended to every kernel module.
pub const COMMON: &str = include_str!("../../kernels/common.cuh");

/// A kernel module (one `kernels/*.cu` file).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Module {
    /// `elementwise.cu`: fills, copies, gathers, the cache write, per-head products.
    Elementwise,
    /// `norm_rope.cu`: RMSNorm over strided rows, RoPE.
    NormRope,
    /// `attention.cu`: flash prefill, split-KV decode, LSE merge.
    Attention,
    /// `dequant.cu`: GGUF dequantization (compiled with `--fmad=false`, bit-exact).
    Dequant,
    /// `fast_prefill.cu`: tensor-core flash prefill, compiled per (P+R, V).
    FastPrefill,
    /// `fast_decode.cu`: tensor-core split-KV decode, compiled per (L+R, L).
    FastDecode,
    /// `reference.cu`: the GPU reference's f64 kernels (norm, RoPE, causal softmax, SwiGLU).
    Reference,
    /// `compare.cu`: the two passes of a site comparison, reduced per block.
    Compare,
}

impl Module {
    /// Every module.
    pub const ALL: &'static [Module] = &[
        Module::Elementwise,
        Module::NormRope,
        Module::Attention,
        Module::Dequant,
        Module::FastPrefill,
        Module::FastDecode,
        Module::Reference,
        Module::Compare,
    ];

    /// The modules every run loads up front (the fast ones are compiled per shape on demand).
    pub const SIMPLE: &'static [Module] = &[
        Module::Elementwise,
        Module::NormRope,
        Module::Attention,
        Module::Dequant,
        Module::Reference,
        Module::Compare,
    ];

    /// File name under `kernels/`.
    pub fn file(self) -> &'static str {
        match self {
            Module::Elementwise => "elementwise.cu",
            Module::NormRope => "norm_rope.cu",
            Module::Attention => "attention.cu",
            Module::Dequant => "dequant.cu",
            Module::FastPrefill => "fast_prefill.cu",
            Module::FastDecode => "fast_decode.cu",
            Module::Reference => "reference.cu",
            Module::Compare => "compare.cu",
        }
    }

    /// The module's source (embedded at build time).
    pub fn source(self) -> &'static str {
        match self {
            Module::Elementwise => include_str!("../../kernels/elementwise.cu"),
            Module::NormRope => include_str!("../../kernels/norm_rope.cu"),
            Module::Attention => include_str!("../../kernels/attention.cu"),
            Module::Dequant => include_str!("../../kernels/dequant.cu"),
            Module::FastPrefill => include_str!("../../kernels/fast_prefill.cu"),
            Module::FastDecode => include_str!("../../kernels/fast_decode.cu"),
            Module::Reference => include_str!("../../kernels/reference.cu"),
            Module::Compare => include_str!("../../kernels/compare.cu"),
        }
    }

    /// NVRTC options beyond the architecture and include path.
    fn extra_options(self) -> &'static [&'static str] {
        match self {
            // No FMA contraction: every dequantized value must match the CPU decoder's bits.
            Module::Dequant => &["--fmad=false"],
            // Tensor-core kernels: bf16 inputs, so the hardware exp2 (2^-22 relative error) is
            // far below the input rounding.
            Module::FastPrefill | Module::FastDecode => &["--use_fast_math"],
            _ => &[],
        }
    }
}

/// Output of one NVRTC compilation.
#[derive(Debug, Clone)]
pub struct Compiled {
    /// CUBIN for the requested architecture.
    pub cubin: Vec<u8>,
    /// NVRTC's log (ptxas resource usage when `verbose`).
    pub log: String,
}

/// Checks that the CUDA driver library is loadable (without panicking, unlike cudarc).
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library by name.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Checks that NVRTC is loadable.
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library by name.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Checks that cuBLAS is loadable.
pub fn cublas_present() -> bool {
    // SAFETY: only tries to dlopen the library by name.
    unsafe { cudarc::cublas::sys::is_culib_present() }
}

/// NVRTC's version, e.g. (13, 0).
pub fn nvrtc_version() -> Result<(i32, i32)> {
    if !nvrtc_present() {
        return Err(Error::cuda(
            "NVRTC (libnvrtc.so) not found; put CUDA's lib64 on LD_LIBRARY_PATH",
        ));
    }
    let (mut a, mut b) = (0, 0);
    // SAFETY: NVRTC is present; the pointers are valid.
    let r = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut a, &mut b) };
    if r != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(Error::cuda(format!("nvrtcVersion failed: {r:?}")));
    }
    Ok((a, b))
}

/// The CUDA version the driver supports, e.g. (13, 0) (`cuDriverGetVersion`).
///
/// Errors: [`Error::Cuda`] when the driver library is missing or the call fails.
pub fn driver_cuda_version() -> Result<(i32, i32)> {
    if !driver_present() {
        return Err(Error::cuda("CUDA driver library (libcuda.so) not found"));
    }
    let mut v = 0;
    // SAFETY: the library is present; the pointer is valid. cuDriverGetVersion needs no cuInit.
    let r = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) };
    if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
        return Err(Error::cuda(format!("cuDriverGetVersion failed: {r:?}")));
    }
    Ok((v / 1000, (v % 1000) / 10))
}

/// The kernel driver's release (e.g. `580.159.04`) from `/proc/driver/nvidia/version`.
pub fn kernel_driver_release() -> Option<String> {
    let s = std::fs::read_to_string("/proc/driver/nvidia/version").ok()?;
    let line = s.lines().next()?;
    line.split_whitespace()
        .find(|w| w.chars().next().is_some_and(|c| c.is_ascii_digit()) && w.contains('.'))
        .map(str::to_string)
}

/// cuBLAS's version (major, minor, patch) from `cublasGetProperty`.
///
/// Errors: [`Error::Cuda`] when cuBLAS is missing or the call fails.
pub fn cublas_version() -> Result<(i32, i32, i32)> {
    use cudarc::cublas::sys::{cublasGetProperty, cublasStatus_t, libraryPropertyType};
    if !cublas_present() {
        return Err(Error::cuda("cuBLAS (libcublas.so) not found"));
    }
    let get = |p: libraryPropertyType| {
        let mut v = 0;
        // SAFETY: the library is present; the pointer is valid; no handle is needed.
        let r = unsafe { cublasGetProperty(p, &mut v) };
        if r == cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            Ok(v)
        } else {
            Err(Error::cuda(format!("cublasGetProperty failed: {r:?}")))
        }
    };
    Ok((
        get(libraryPropertyType::MAJOR_VERSION)?,
        get(libraryPropertyType::MINOR_VERSION)?,
        get(libraryPropertyType::PATCH_LEVEL)?,
    ))
}

/// The CUDA include folder: `explicit` (`--cuda-include`), else `$CUDA_HOME/include`
/// (`settings.cuda_home`), else `/usr/local/cuda/include`. It must hold `cuda_bf16.h`.
///
/// Errors: [`Error::Cuda`] naming the folder that lacks the header.
pub fn include_dir(explicit: Option<&Path>, settings: &DeviceSettings) -> Result<PathBuf> {
    let dir = match explicit {
        Some(d) => d.to_path_buf(),
        None => match &settings.cuda_home {
            Some(h) => h.join("include"),
            None => PathBuf::from("/usr/local/cuda/include"),
        },
    };
    if !dir.join("cuda_bf16.h").is_file() {
        return Err(Error::cuda(format!(
            "{}: no cuda_bf16.h (pass --cuda-include DIR or set CUDA_HOME)",
            dir.display()
        )));
    }
    Ok(dir)
}

/// The cache key of one compilation: sha256 over the full source, the options, the include
/// folder and NVRTC's version, so a changed kernel, define, architecture or toolkit never hits
/// an old CUBIN.
fn cache_key(src: &str, opts: &[String], include: &Path) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(src.as_bytes());
    for o in opts {
        h.update([0u8]);
        h.update(o.as_bytes());
    }
    h.update([1u8]);
    h.update(include.as_os_str().as_encoded_bytes());
    if let Ok((a, b)) = nvrtc_version() {
        h.update(format!("nvrtc {a}.{b}").as_bytes());
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Compiles `module` for `arch` (e.g. `sm_90`, `sm_90a`) with NVRTC, returning the CUBIN and
/// the log. `defines` become `-DNAME=VALUE` (the fast kernels' shape constants).
///
/// A compiled CUBIN is kept in the folder `cache` (the NVRTC cache of [`DeviceSettings`]; `None`:
/// no cache) under its `cache_key`, and a later compile of the same source, options and NVRTC
/// reads it instead of compiling (a second run starts in milliseconds, not seconds). Verbose
/// compiles (which want ptxas's log) bypass the cache; a cache that cannot be read or written is
/// ignored.
///
/// Errors: [`Error::Cuda`] with NVRTC's whole log when the source does not compile.
pub fn compile(
    module: Module,
    arch: ComputeCapability,
    include: &Path,
    verbose: bool,
    defines: &[(&str, usize)],
    cache: Option<&Path>,
) -> Result<Compiled> {
    use cudarc::nvrtc::sys as nv;
    if !nvrtc_present() {
        return Err(Error::cuda(
            "NVRTC (libnvrtc.so) not found; put CUDA's lib64 on LD_LIBRARY_PATH",
        ));
    }
    let src = format!("{COMMON}\n#line 1 \"{}\"\n{}", module.file(), module.source());
    let csrc = CString::new(src.as_str()).map_err(|_| Error::cuda("kernel source holds a NUL byte"))?;
    let cname = CString::new(module.file()).map_err(|_| Error::cuda("bad module name"))?;
    let mut opts: Vec<String> = vec![
        format!("--gpu-architecture={arch}"),
        format!("-I{}", include.display()),
        "--std=c++17".into(),
    ];
    opts.extend(module.extra_options().iter().map(|s| s.to_string()));
    opts.extend(defines.iter().map(|(k, v)| format!("-D{k}={v}")));
    if verbose {
        opts.push("--ptxas-options=-v".into());
    }
    let cached = cache
        .filter(|_| !verbose)
        .map(|d| d.join(format!("{}.cubin", cache_key(&src, &opts, include))));
    if let Some(cubin) = cached
        .as_ref()
        .and_then(|p| std::fs::read(p).ok())
        .filter(|c| !c.is_empty())
    {
        return Ok(Compiled {
            cubin,
            log: String::new(),
        });
    }
    let copts: Vec<CString> = opts
        .iter()
        .map(|o| CString::new(o.as_str()).map_err(|_| Error::cuda("bad NVRTC option")))
        .collect::<Result<_>>()?;
    let ptrs: Vec<*const std::ffi::c_char> = copts.iter().map(|c| c.as_ptr()).collect();
    let mut prog: nv::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: NVRTC is present; all pointers outlive the calls; the program is destroyed below.
    unsafe {
        let r = nv::nvrtcCreateProgram(
            &mut prog,
            csrc.as_ptr(),
            cname.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        );
        if r != nv::nvrtcResult::NVRTC_SUCCESS {
            return Err(Error::cuda(format!("{}: nvrtcCreateProgram: {r:?}", module.file())));
        }
        let rc = nv::nvrtcCompileProgram(prog, ptrs.len() as i32, ptrs.as_ptr());
        let mut log_len = 0usize;
        nv::nvrtcGetProgramLogSize(prog, &mut log_len);
        let mut log = vec![0u8; log_len.max(1)];
        nv::nvrtcGetProgramLog(prog, log.as_mut_ptr().cast());
        let log = CStr::from_bytes_until_nul(&log)
            .map(|c| c.to_string_lossy().into_owned())
            .unwrap_or_default();
        if rc != nv::nvrtcResult::NVRTC_SUCCESS {
            nv::nvrtcDestroyProgram(&mut prog);
            return Err(Error::cuda(format!(
                "{} does not compile for {arch} ({rc:?}); NVRTC options {opts:?}; log:\n{log}",
                module.file()
            )));
        }
        let mut n = 0usize;
        nv::nvrtcGetCUBINSize(prog, &mut n);
        let mut cubin = vec![0u8; n];
        let r = nv::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast());
        nv::nvrtcDestroyProgram(&mut prog);
        if r != nv::nvrtcResult::NVRTC_SUCCESS || n == 0 {
            return Err(Error::cuda(format!(
                "{}: nvrtcGetCUBIN for {arch}: {r:?}",
                module.file()
            )));
        }
        if let Some(p) = &cached {
            // Best effort: a read-only or full disk only costs the next run a compile.
            let _ = p
                .parent()
                .map(std::fs::create_dir_all)
                .map(|_| crate::core::fsio::write_file_atomic(p, &cubin, true));
        }
        Ok(Compiled { cubin, log })
    }
}

/// Resource usage of one kernel, parsed from ptxas's verbose log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelUsage {
    /// Kernel name.
    pub kernel: String,
    /// Registers per thread.
    pub registers: u32,
    /// Bytes of spill stores.
    pub spill_stores: u32,
    /// Bytes of spill loads.
    pub spill_loads: u32,
}

/// Parses `ptxas info` lines into per-kernel register and spill counts.
pub fn parse_usage(log: &str) -> Vec<KernelUsage> {
    let mut out: Vec<KernelUsage> = Vec::new();
    let mut current: Option<String> = None;
    let num_before = |s: &str, key: &str| -> Option<u32> {
        let i = s.find(key)?;
        s[..i].split_whitespace().last()?.parse().ok()
    };
    for line in log.lines() {
        if let Some(i) = line.find("Compiling entry function '") {
            let rest = &line[i + "Compiling entry function '".len()..];
            current = rest.split('\'').next().map(str::to_string);
        } else if let Some(i) = line.find("Function properties for ") {
            current = Some(line[i + "Function properties for ".len()..].trim().to_string());
        }
        let Some(k) = current.clone() else { continue };
        let entry = |out: &mut Vec<KernelUsage>| -> usize {
            match out.iter().position(|u| u.kernel == k) {
                Some(p) => p,
                None => {
                    out.push(KernelUsage {
                        kernel: k.clone(),
                        registers: 0,
                        spill_stores: 0,
                        spill_loads: 0,
                    });
                    out.len() - 1
                }
            }
        };
        if line.contains("spill stores") {
            let p = entry(&mut out);
            out[p].spill_stores = num_before(line, "bytes spill stores").unwrap_or(0);
            out[p].spill_loads = num_before(line, "bytes spill loads").unwrap_or(0);
        }
        if line.contains("Used ") && line.contains(" registers") {
            let p = entry(&mut out);
            out[p].registers = num_before(line, "registers").unwrap_or(0);
        }
    }
    out
}

/// Why the CUDA backend cannot be used here, or `Ok` with the device count.
pub fn probe() -> Result<usize> {
    if !driver_present() {
        return Err(Error::cuda("no CUDA driver library (libcuda.so) found"));
    }
    if !nvrtc_present() {
        return Err(Error::cuda(
            "no NVRTC library (libnvrtc.so) found; put CUDA's lib64 on LD_LIBRARY_PATH",
        ));
    }
    if !cublas_present() {
        return Err(Error::cuda(
            "no cuBLAS library (libcublas.so) found; put CUDA's lib64 on LD_LIBRARY_PATH",
        ));
    }
    let n = cudarc::driver::CudaContext::device_count().map_err(|e| Error::cuda(format!("cuDeviceGetCount: {e:?}")))?;
    if n < 1 {
        return Err(Error::cuda("the CUDA driver reports no device"));
    }
    Ok(n as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_nvrtc_cache_key_changes_with_source_options_and_include() {
        let opts = vec!["--gpu-architecture=sm_90".to_string(), "-DHM=64".to_string()];
        let inc = Path::new("/usr/local/cuda/include");
        let k = cache_key("__global__ void f(){}", &opts, inc);
        assert_eq!(k.len(), 64);
        assert_eq!(k, cache_key("__global__ void f(){}", &opts, inc), "deterministic");
        assert_ne!(k, cache_key("__global__ void g(){}", &opts, inc));
        let other_arch = vec!["--gpu-architecture=sm_80".to_string(), "-DHM=64".to_string()];
        assert_ne!(k, cache_key("__global__ void f(){}", &other_arch, inc));
        let other_define = vec!["--gpu-architecture=sm_90".to_string(), "-DHM=128".to_string()];
        assert_ne!(k, cache_key("__global__ void f(){}", &other_define, inc));
        // Options are separated in the hash: ["ab", "c"] and ["a", "bc"] differ.
        let split = |a: &str, b: &str| cache_key("x", &[a.to_string(), b.to_string()], inc);
        assert_ne!(split("ab", "c"), split("a", "bc"));
        assert_ne!(
            k,
            cache_key("__global__ void f(){}", &opts, Path::new("/opt/cuda-13/include"))
        );
    }
}
