//! The environment variables mla-diff reads, as one typed value.
//!
//! A variable read where it is used is a hidden input: a kernel launch that consults the
//! process environment cannot be tested without changing that environment for every thread,
//! and nothing shows in one place what the tool reads. So the command line reads the
//! environment once, when a command starts ([`Settings::from_vars`] over the process
//! environment), and hands this value down to what uses it: the device layer (the CUDA include
//! folder and the NVRTC cache), the CUDA backend (its kernel configurations and switches) and
//! `mla-diff bench`. Tests build it directly. The kernel configuration strings stay text here:
//! their grammar and rules belong to the backend, which parses them when the CUDA backend starts
//! (so the CPU backend never looks at them). docs/environment.md lists every variable.

use std::ffi::OsString;
use std::path::PathBuf;

/// Every environment variable mla-diff reads ([`Settings::from_vars`]); the default is an empty
/// environment (no NVRTC cache, the kernels' defaults).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Settings {
    /// What the device layer reads.
    pub device: DeviceSettings,
    /// What the CUDA backend reads.
    pub kernels: KernelSettings,
    /// What `mla-diff bench` reads.
    pub bench: BenchSettings,
}

/// Where NVRTC finds CUDA's headers and where compiled kernels are kept
/// ([`crate::device`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceSettings {
    /// `CUDA_HOME`: without `--cuda-include`, NVRTC's include folder is `$CUDA_HOME/include`
    /// (else `/usr/local/cuda/include`).
    pub cuda_home: Option<PathBuf>,
    /// The on-disk NVRTC cache folder: `$MLA_DIFF_CACHE_DIR/nvrtc`, else
    /// `$XDG_CACHE_HOME/mla-diff/nvrtc`, else `$HOME/.cache/mla-diff/nvrtc`; `None` (compile
    /// every time) with `MLA_DIFF_NVRTC_CACHE=off` or when none of the three is set.
    pub nvrtc_cache: Option<PathBuf>,
}

/// The CUDA backend's kernel configurations and switches
/// ([`crate::backend::cuda::ops::CudaOps::new`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KernelSettings {
    /// `MLA_DIFF_DECODE_CFG`, when set and not empty: the decode configuration the engine's
    /// tensor-core decode runs (docs/kernels.md's syntax), parsed when the CUDA backend starts.
    pub decode_cfg: Option<String>,
    /// `MLA_DIFF_PREFILL_CFG`, when set and not empty: the prefill configuration, as
    /// `decode_cfg`.
    pub prefill_cfg: Option<String>,
    /// `MLA_DIFF_DECODE_SPIN`: how the decode's fused merge through global memory is shared out.
    pub decode_spin: DecodeSpin,
    /// `MLA_DIFF_BF16_GEMM=emulate`: bf16 GEMMs run as cuBLAS SGEMMs on bf16-rounded inputs
    /// (the same arithmetic) instead of cuBLAS's bf16 kernels, which compute-sanitizer cannot
    /// run.
    pub emulate_bf16_gemm: bool,
}

/// `MLA_DIFF_DECODE_SPIN`: whether every split of a token merges its share of the value columns
/// (the fast decode kernel's spin mode) or the last split to finish merges everything.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum DecodeSpin {
    /// Unset, or any value but `0` and `force`: share when every block of the launch is
    /// resident at once.
    #[default]
    Auto,
    /// `0`: the last split merges everything.
    Off,
    /// `force`: share even when the blocks are not all resident (the kernel then gives up
    /// waiting and falls back; for testing that path).
    Force,
}

/// What `mla-diff bench` reads ([`crate::jobs::bench_gpu`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BenchSettings {
    /// `MLA_DIFF_BENCH_SYNC=1`: synchronize the host after every timed call.
    pub sync_each: bool,
    /// `MLA_DIFF_BENCH_SEQUENTIAL=1`: decode cache pages in order instead of shuffled.
    pub sequential_pages: bool,
    /// `MLA_DIFF_BENCH_DECODE`, when set and not empty: `;`-separated extra decode variants,
    /// parsed before the first benchmark runs.
    pub decode_variants: Option<String>,
    /// `MLA_DIFF_BENCH_PREFILL`, when set and not empty: `;`-separated extra prefill
    /// configurations, as `decode_variants`.
    pub prefill_variants: Option<String>,
}

impl Settings {
    /// The settings `var` gives: `var(name)` is the variable's value, `None` when unset (the
    /// command line passes the process environment's `var_os`). A value that is not UTF-8
    /// counts as unset, except for the paths, which take any bytes. Never fails: every variable
    /// has a meaning for every value, and the kernel configurations are checked where they are
    /// parsed.
    pub fn from_vars(var: impl Fn(&str) -> Option<OsString>) -> Settings {
        let text = |name: &str| var(name).and_then(|v| v.into_string().ok());
        let is = |name: &str, want: &str| text(name).is_some_and(|v| v == want);
        let non_empty = |name: &str| text(name).filter(|v| !v.is_empty());
        let nvrtc_cache = if is("MLA_DIFF_NVRTC_CACHE", "off") {
            None
        } else {
            match (var("MLA_DIFF_CACHE_DIR"), var("XDG_CACHE_HOME"), var("HOME")) {
                (Some(d), _, _) => Some(PathBuf::from(d)),
                (None, Some(x), _) => Some(PathBuf::from(x).join("mla-diff")),
                (None, None, Some(h)) => Some(PathBuf::from(h).join(".cache/mla-diff")),
                (None, None, None) => None,
            }
            .map(|base| base.join("nvrtc"))
        };
        Settings {
            device: DeviceSettings {
                cuda_home: var("CUDA_HOME").map(PathBuf::from),
                nvrtc_cache,
            },
            kernels: KernelSettings {
                decode_cfg: non_empty("MLA_DIFF_DECODE_CFG"),
                prefill_cfg: non_empty("MLA_DIFF_PREFILL_CFG"),
                decode_spin: match text("MLA_DIFF_DECODE_SPIN").as_deref() {
                    Some("0") => DecodeSpin::Off,
                    Some("force") => DecodeSpin::Force,
                    _ => DecodeSpin::Auto,
                },
                emulate_bf16_gemm: is("MLA_DIFF_BF16_GEMM", "emulate"),
            },
            bench: BenchSettings {
                sync_each: is("MLA_DIFF_BENCH_SYNC", "1"),
                sequential_pages: is("MLA_DIFF_BENCH_SEQUENTIAL", "1"),
                decode_variants: non_empty("MLA_DIFF_BENCH_DECODE"),
                prefill_variants: non_empty("MLA_DIFF_BENCH_PREFILL"),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn from(vars: &[(&str, &str)]) -> Settings {
        Settings::from_vars(|name| vars.iter().find(|(k, _)| *k == name).map(|(_, v)| OsString::from(v)))
    }

    #[test]
    fn an_empty_environment_gives_the_defaults() {
        assert_eq!(from(&[]), Settings::default());
    }

    #[test]
    fn each_variable_sets_its_field() {
        let s = from(&[
            ("CUDA_HOME", "/opt/cuda"),
            ("MLA_DIFF_DECODE_CFG", "64,8,1,0,2,1,0,0,0,1"),
            ("MLA_DIFF_PREFILL_CFG", "4,64,2,0,1"),
            ("MLA_DIFF_DECODE_SPIN", "force"),
            ("MLA_DIFF_BF16_GEMM", "emulate"),
            ("MLA_DIFF_BENCH_SYNC", "1"),
            ("MLA_DIFF_BENCH_SEQUENTIAL", "1"),
            ("MLA_DIFF_BENCH_DECODE", "m:16,4,1,0,4"),
            ("MLA_DIFF_BENCH_PREFILL", "4,32,3,0,3"),
        ]);
        assert_eq!(s.device.cuda_home, Some(PathBuf::from("/opt/cuda")));
        assert_eq!(s.kernels.decode_cfg.as_deref(), Some("64,8,1,0,2,1,0,0,0,1"));
        assert_eq!(s.kernels.prefill_cfg.as_deref(), Some("4,64,2,0,1"));
        assert_eq!(s.kernels.decode_spin, DecodeSpin::Force);
        assert!(s.kernels.emulate_bf16_gemm && s.bench.sync_each && s.bench.sequential_pages);
        assert_eq!(s.bench.decode_variants.as_deref(), Some("m:16,4,1,0,4"));
        assert_eq!(s.bench.prefill_variants.as_deref(), Some("4,32,3,0,3"));
        assert_eq!(
            from(&[("MLA_DIFF_DECODE_SPIN", "0")]).kernels.decode_spin,
            DecodeSpin::Off
        );
    }

    /// Values other than the documented ones keep the default, and an empty configuration string
    /// counts as unset.
    #[test]
    fn other_values_keep_the_default() {
        let s = from(&[
            ("MLA_DIFF_DECODE_CFG", ""),
            ("MLA_DIFF_BENCH_DECODE", ""),
            ("MLA_DIFF_DECODE_SPIN", "1"),
            ("MLA_DIFF_BF16_GEMM", "1"),
            ("MLA_DIFF_BENCH_SYNC", "yes"),
            ("MLA_DIFF_BENCH_SEQUENTIAL", "true"),
            ("MLA_DIFF_NVRTC_CACHE", "on"),
        ]);
        assert_eq!(s, Settings::default());
    }

    /// docs/environment.md's table lists exactly the variables [`Settings::from_vars`] reads.
    #[test]
    fn the_environment_table_lists_every_variable_read() {
        let read = std::cell::RefCell::new(Vec::new());
        Settings::from_vars(|name| {
            read.borrow_mut().push(name.to_string());
            None
        });
        let mut read = read.into_inner();
        read.dedup();
        let doc = include_str!("../../docs/environment.md");
        let rows: Vec<&str> = doc
            .lines()
            .filter_map(|l| l.strip_prefix("| `"))
            .filter_map(|l| l.split_once('`').map(|(name, _)| name))
            .collect();
        let mut sorted_read = read.clone();
        sorted_read.sort_unstable();
        let mut sorted_rows = rows.clone();
        sorted_rows.sort_unstable();
        assert_eq!(
            sorted_rows, sorted_read,
            "docs/environment.md rows {rows:?}, read {read:?}"
        );
    }

    #[test]
    fn the_nvrtc_cache_folder_follows_the_first_variable_set() {
        let cache = |vars: &[(&str, &str)]| from(vars).device.nvrtc_cache;
        let all = [("MLA_DIFF_CACHE_DIR", "/c"), ("XDG_CACHE_HOME", "/x"), ("HOME", "/h")];
        assert_eq!(cache(&all), Some(PathBuf::from("/c/nvrtc")));
        assert_eq!(cache(&all[1..]), Some(PathBuf::from("/x/mla-diff/nvrtc")));
        assert_eq!(cache(&all[2..]), Some(PathBuf::from("/h/.cache/mla-diff/nvrtc")));
        assert_eq!(cache(&[]), None);
        assert_eq!(cache(&[("MLA_DIFF_NVRTC_CACHE", "off"), all[0]]), None);
    }
}
