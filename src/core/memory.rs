//! How much memory this process may use, so a run too big for the machine is refused before it
//! starts instead of aborting on an allocation hours (or seconds) in.
//!
//! `MemTotal` overstates the limit inside containers and batch jobs, where a cgroup caps the
//! process far below the machine's RAM; the limit here is the smallest of `MemTotal` and every
//! cgroup memory limit on the path of this process (v2 `memory.max`, v1
//! `memory.limit_in_bytes`), each found through `/proc/self/cgroup`.

use std::path::{Path, PathBuf};

/// Keeps freed memory in the process for the next allocation instead of returning it to the OS.
///
/// A run allocates and frees buffers of tens to hundreds of MB per step (each path's
/// activations, the reference's f64 products). glibc serves every allocation above its mmap
/// threshold (128 KiB, adapting up to 32 MiB) with a fresh mapping and unmaps it on free, so the
/// next buffer of the same size page-faults and is zeroed again: on the 2-core machine of
/// BENCHMARKS.md's P8 that was about a quarter of the samples of a profile (10–15 s of system
/// time per run). Raising the mmap threshold to 2 GiB and the trim threshold to the same serves
/// those buffers from the heap, where freed memory is reused; the cost is a peak RSS a few
/// percent higher (freed heap memory is kept, not returned). Call once, first thing in `main`;
/// elsewhere than Linux with glibc this does nothing. Returns whether both settings took.
pub fn keep_freed_pages() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only sets allocator parameters; it is called before any thread exists.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, i32::MAX) == 1 && libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

/// A memory limit and where it was read: bytes and a short source (`cgroup v2 /sys/fs/…`,
/// `MemTotal`, `--max-memory`).
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryLimit {
    /// Bytes this process may use.
    pub bytes: u64,
    /// Where the number comes from, for the refusal message.
    pub source: String,
}

/// Values at or above this are "no limit" (cgroup v1 writes 2^63 rounded down to a page).
const UNLIMITED: u64 = 1 << 60;

/// The memory this process may use: the smallest of the cgroup limits on its path and `MemTotal`;
/// `None` when neither can be read (not Linux).
pub fn memory_limit() -> Option<MemoryLimit> {
    let total = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| meminfo_total(&s))
        .map(|bytes| MemoryLimit {
            bytes,
            source: "MemTotal".into(),
        });
    let cgroup = std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|s| cgroup_limit(&s, Path::new("/sys/fs/cgroup")));
    match (cgroup, total) {
        (Some(c), Some(t)) if t.bytes < c.bytes => Some(t),
        (Some(c), _) => Some(c),
        (None, t) => t,
    }
}

/// `MemTotal` of a `/proc/meminfo` text, in bytes.
fn meminfo_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kb.checked_mul(1024)
}

/// The smallest memory limit of the cgroups named in a `/proc/self/cgroup` text, read under
/// `root` (normally `/sys/fs/cgroup`), walking from each group up to the root of its hierarchy.
fn cgroup_limit(proc_cgroup: &str, root: &Path) -> Option<MemoryLimit> {
    let mut best: Option<MemoryLimit> = None;
    for line in proc_cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        let (base, file, kind) = if controllers.is_empty() {
            // v2: the unified hierarchy, mounted at root itself or at root/unified (hybrid).
            let base = if root.join("cgroup.controllers").exists() {
                root.to_path_buf()
            } else {
                root.join("unified")
            };
            (base, "memory.max", "v2")
        } else if controllers.split(',').any(|c| c == "memory") {
            (root.join("memory"), "memory.limit_in_bytes", "v1")
        } else {
            continue;
        };
        let mut dir: PathBuf = base.join(path.trim_start_matches('/'));
        loop {
            let f = dir.join(file);
            if let Some(bytes) = std::fs::read_to_string(&f)
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok())
                && bytes < UNLIMITED
                && best.as_ref().is_none_or(|b| bytes < b.bytes)
            {
                best = Some(MemoryLimit {
                    bytes,
                    source: format!("cgroup {kind} {}", f.display()),
                });
            }
            if dir == base || !dir.pop() || !dir.starts_with(&base) {
                break;
            }
        }
    }
    best
}

/// Parses a size such as `24G`, `512M`, `1.5GiB` or `3000000000` (bytes; K/M/G/T are powers of
/// 1024, with or without `iB`/`B`).
///
/// Errors: a message naming what could not be read.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let unit_at = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (num, unit) = t.split_at(unit_at);
    let value: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a size (e.g. 24G, 512M, 3000000000)"))?;
    let mult: f64 = match unit
        .trim()
        .to_ascii_uppercase()
        .trim_end_matches("IB")
        .trim_end_matches('B')
    {
        "" => 1.0,
        "K" => 1024.0,
        "M" => 1024f64.powi(2),
        "G" => 1024f64.powi(3),
        "T" => 1024f64.powi(4),
        _ => return Err(format!("`{s}`: unknown unit `{unit}` (use K, M, G or T)")),
    };
    let bytes = value * mult;
    if !(bytes.is_finite() && bytes >= 1.0 && bytes < UNLIMITED as f64) {
        return Err(format!("`{s}` is not a usable memory size"));
    }
    Ok(bytes as u64)
}

/// Bytes as `12.3 GiB`, `456.7 MiB`, `1.0 KiB` or `12 B`.
pub fn human(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= (1u64 << 30) as f64 {
        format!("{:.1} GiB", b / (1u64 << 30) as f64)
    } else if b >= (1u64 << 20) as f64 {
        format!("{:.1} MiB", b / (1u64 << 20) as f64)
    } else if b >= 1024.0 {
        format!("{:.1} KiB", b / 1024.0)
    } else {
        format!("{bytes} B")
    }
}

#[cfg(test)]
mod tests {

    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn glibc_takes_both_thresholds() {
        assert!(keep_freed_pages());
        // A buffer above glibc's default 32 MiB mmap-threshold ceiling, now served from the heap,
        // keeps its contents.
        let v = vec![7u8; 64 << 20];
        assert_eq!(v.iter().map(|&b| b as u64).sum::<u64>(), 7 * (64 << 20));
    }
    use super::*;

    #[test]
    fn sizes_parse_in_powers_of_1024() {
        assert_eq!(parse_size("24G"), Ok(24 << 30));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("1.5g"), Ok(3 << 29));
        assert_eq!(parse_size("3000000000"), Ok(3_000_000_000));
        assert!(parse_size("lots").unwrap_err().contains("not a size"));
        assert!(parse_size("5Q").unwrap_err().contains("unknown unit"));
        assert!(parse_size("0").is_err());
    }

    #[test]
    fn cgroup_limits_are_read_up_the_tree_and_the_smallest_wins() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path();
        // v1 memory hierarchy: the job's group is capped at 3 GiB, its parent at 8 GiB.
        let v1 = root.join("memory/batch/job7");
        std::fs::create_dir_all(&v1).unwrap();
        std::fs::write(v1.join("memory.limit_in_bytes"), "3221225472\n").unwrap();
        std::fs::write(root.join("memory/batch/memory.limit_in_bytes"), "8589934592\n").unwrap();
        std::fs::write(root.join("memory/memory.limit_in_bytes"), "9223372036854771712\n").unwrap();
        let got = cgroup_limit("4:memory:/batch/job7\n3:cpuset:/\n", root).unwrap();
        assert_eq!(got.bytes, 3 << 30);
        assert!(
            got.source.contains("v1") && got.source.ends_with("job7/memory.limit_in_bytes"),
            "{}",
            got.source
        );
        // v2 unified: `max` is no limit; a 2 GiB parent limit applies.
        std::fs::write(root.join("cgroup.controllers"), "memory\n").unwrap();
        let v2 = root.join("user.slice/app");
        std::fs::create_dir_all(&v2).unwrap();
        std::fs::write(v2.join("memory.max"), "max\n").unwrap();
        std::fs::write(root.join("user.slice/memory.max"), "2147483648\n").unwrap();
        let got = cgroup_limit("0::/user.slice/app\n", root).unwrap();
        assert_eq!(got.bytes, 2 << 30);
        // No memory controller, no limit.
        assert_eq!(cgroup_limit("3:cpuset:/\n", root), None);
        assert_eq!(meminfo_total("MemTotal:       24683584 kB\n"), Some(24_683_584 * 1024));
    }
}
