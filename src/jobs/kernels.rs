//! `mla-diff kernels --compile-only`: every CUDA kernel module, and the kernel configurations
//! the fast kernels select, compiled with NVRTC for given architectures.
//!
//! No GPU is needed: NVRTC alone compiles, so CI proves every kernel builds. The register and
//! spill counts ptxas reports come back per kernel, for the table the command prints.

use std::path::{Path, PathBuf};

use crate::backend::decode_cfg::DecodeCfg;
use crate::backend::prefill_cfg::PrefillCfg;
use crate::core::error::Result;
use crate::core::settings::DeviceSettings;
use crate::device::{ComputeCapability, KernelUsage, Module};

/// One compiled module or configuration.
#[derive(Debug, Clone)]
pub struct KernelBuild {
    /// The module's file, with the configuration's label for a configured build
    /// (`fast_decode.cu (hm64 …)`).
    pub label: String,
    /// The NVRTC target (`sm_90`, `sm_90a`, `sm_80`).
    pub target: ComputeCapability,
    /// ptxas's report per kernel (empty when it printed none).
    pub usage: Vec<KernelUsage>,
}

/// Everything `kernels --compile-only` compiled.
#[derive(Debug, Clone)]
pub struct KernelMatrix {
    /// NVRTC's version (major, minor).
    pub nvrtc: (i32, i32),
    /// The CUDA include folder used.
    pub include: PathBuf,
    /// One entry per module or configuration and architecture, in compile order.
    pub builds: Vec<KernelBuild>,
}

/// Compiles every module for every architecture in `archs` (plus the decode and prefill
/// configurations the fast kernels select), with the headers of `include`, else as
/// [`crate::device::include_dir`] finds them in `settings`, writing each CUBIN into `out` when
/// given (`<module>.<arch>.cubin`, or `<module>.<configuration>.<target>.cubin`). The compiles
/// are verbose (for ptxas's report), so they bypass the NVRTC cache.
///
/// Errors: [`crate::Error::Cuda`] when NVRTC or the include folder is missing, with NVRTC's log when
/// a kernel does not compile; [`crate::Error::Io`] when a CUBIN cannot be written.
pub fn compile_all(
    archs: &[ComputeCapability],
    include: Option<&Path>,
    out: Option<&Path>,
    settings: &DeviceSettings,
) -> Result<KernelMatrix> {
    let include = crate::device::include_dir(include, settings)?;
    let nvrtc = crate::device::nvrtc_version()?;
    let mut builds = Vec::new();
    for &arch in archs {
        // The decode kernel also in its 64-head configurations (wgmma, compiled for sm_90a on
        // sm_90, and mma.sync; the macros' defaults are the 16-head one), with the in-register
        // softmax, with the TMA producer warp (the merge through global memory), with the
        // merge through a cluster of 4 blocks, the 64-head block with TMA and a cluster of 8,
        // and the teams block (the N < 64 default) with the cluster of the bench shape's 2
        // splits and with the merge through global memory, and with 5 stages (a team then also
        // waits for the other team's release of a stage).
        let wgmma = DecodeCfg::WGMMA.for_arch(arch);
        let hm64 = DecodeCfg::MMA64;
        let fused = DecodeCfg::parse("16,8,2,1,4,1,1")?;
        let tma = DecodeCfg::TMA16;
        let cluster16 = DecodeCfg::parse("16,8,2,0,2,2,0,1,1")?.for_arch(arch);
        let hm64_cluster = DecodeCfg::parse("64,8,2,0,2,1,0,1,1")?.for_arch(arch);
        let teams = DecodeCfg::TEAMS.for_arch(arch);
        let teams_s5 = DecodeCfg {
            stages: 5,
            ..DecodeCfg::TEAMS
        }
        .for_arch(arch);
        type Job = (Module, String, Vec<(&'static str, usize)>);
        let mut jobs: Vec<Job> = Module::ALL
            .iter()
            .map(|&m| (m, m.file().to_string(), Vec::new()))
            .collect();
        // The TMA producer warp needs sm_90+: an older architecture compiles the variant it
        // would run instead (the same block without the producer warp).
        // (Below sm_90 the cluster variants fall back to the fused merge and the same block
        // without the producer warp: compiled once.)
        for (c, splits) in [
            (wgmma, 0),
            (hm64, 0),
            (fused, 0),
            (tma.for_arch(arch), 0),
            (cluster16, 4),
            (hm64_cluster, 8),
            (teams, 2),
            (
                DecodeCfg {
                    cluster: false,
                    ..teams
                },
                0,
            ),
            (teams_s5, 2),
        ] {
            let cluster = c.cluster_size(arch, splits, 512, true);
            let size = if cluster > 0 {
                format!("{cluster}")
            } else {
                String::new()
            };
            let defines = c.defines_for(cluster);
            if jobs.iter().all(|j| j.2 != defines) {
                jobs.push((
                    Module::FastDecode,
                    format!("{} ({}{size})", Module::FastDecode.file(), c.label()),
                    defines,
                ));
            }
        }
        // The prefill kernel in the other layouts its configurations select (Q in registers,
        // 32-key tiles, a deeper pipeline, 8 warps).
        for s in ["4,64,2,1,1", "8,32,3,0,2"] {
            let c = PrefillCfg::parse(s)?;
            jobs.push((
                Module::FastPrefill,
                format!("{} ({})", Module::FastPrefill.file(), c.label()),
                c.defines(),
            ));
        }
        // The prefill kernel that reads a DSA selection's keys by index.
        jobs.push((
            Module::FastPrefill,
            format!("{} (indexed keys)", Module::FastPrefill.file()),
            vec![("FP_INDIRECT", 1)],
        ));
        for (m, label, defines) in jobs {
            let target = arch.target_for(&defines);
            let c = crate::device::compile(m, target, &include, true, &defines, settings.nvrtc_cache.as_deref())?;
            if let Some(dir) = out {
                // `<module>.<arch>.cubin` for the default build, `<module>.<label>.<target>.cubin`
                // (label without parentheses, spaces as `-`) for each configuration.
                let name = if defines.is_empty() {
                    format!("{}.{arch}.cubin", m.file())
                } else {
                    let inner = label.split_once(" (").map_or("", |(_, r)| r.trim_end_matches(')'));
                    format!("{}.{}.{target}.cubin", m.file(), inner.replace(' ', "-"))
                };
                crate::core::fsio::write_file_atomic(&dir.join(name), &c.cubin, true)?;
            }
            builds.push(KernelBuild {
                label,
                target,
                usage: crate::device::parse_usage(&c.log),
            });
        }
    }
    Ok(KernelMatrix { nvrtc, include, builds })
}
