//! The GPU's compute capability as a value: `sm_90`, `sm_90a`, `sm_80`.
//!
//! NVRTC names its target with a string, and the fast kernels' rules are facts about that
//! target: wgmma exists only on Hopper's sm_90, bulk copies, mbarrier transaction counts and
//! thread-block clusters from sm_90 on, and a wgmma build needs the architecture-specific
//! `sm_90a`. Parsing the string once, from `--arch` or from the device's attributes, turns a typo
//! into a usage error naming the flag instead of an NVRTC failure in the middle of a compile, and
//! turns each rule into a method rather than a string compared in several places.

use std::fmt;
use std::str::FromStr;

use crate::core::error::{Error, Result};

/// A compute capability, `major.minor`, as NVRTC's `sm_<major><minor>[a]` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ComputeCapability {
    /// Major version: 8 for Ampere and Ada, 9 for Hopper, 10 and 12 for Blackwell.
    pub major: u32,
    /// Minor version, one digit (`sm_89`: 9).
    pub minor: u32,
    /// The architecture-specific target (`sm_90a`): code that uses features of exactly this
    /// capability (wgmma) and runs on no other.
    pub arch_specific: bool,
}

impl ComputeCapability {
    /// `sm_<major><minor>`, not architecture-specific.
    pub const fn new(major: u32, minor: u32) -> Self {
        ComputeCapability {
            major,
            minor,
            arch_specific: false,
        }
    }

    /// The capability a device reports (`cuDeviceGetAttribute`'s major and minor, as cudarc's
    /// `compute_capability` returns them), which its kernels are compiled for.
    ///
    /// Errors: [`Error::Cuda`] when a number is negative or the minor has more than one digit
    /// (no device reports that; NVRTC could not name it).
    pub fn from_device(major: i32, minor: i32) -> Result<Self> {
        match (u32::try_from(major), u32::try_from(minor)) {
            (Ok(major), Ok(minor)) if major > 0 && minor < 10 => Ok(Self::new(major, minor)),
            _ => Err(Error::cuda(format!(
                "the device reports compute capability {major}.{minor}, which has no sm_ name"
            ))),
        }
    }

    /// Parses `sm_<major><minor>` with an optional `a` (`sm_90`, `sm_90a`, `sm_80`, `sm_100`):
    /// the last digit is the minor version, the digits before it (no leading zero) the major.
    ///
    /// Errors: the reason, for the caller to put next to the flag and value (clap does for
    /// `--arch`).
    pub fn parse(s: &str) -> std::result::Result<Self, String> {
        let bad =
            || format!("`{s}` is not a compute capability: expected sm_<major><minor>[a], e.g. sm_90, sm_90a, sm_80");
        let digits = s.strip_prefix("sm_").ok_or_else(bad)?;
        let (digits, arch_specific) = match digits.strip_suffix('a') {
            Some(d) => (d, true),
            None => (digits, false),
        };
        if !(2..=3).contains(&digits.len()) || !digits.bytes().all(|b| b.is_ascii_digit()) || digits.starts_with('0') {
            return Err(bad());
        }
        let (major, minor) = digits.split_at(digits.len() - 1);
        Ok(ComputeCapability {
            major: major.parse().map_err(|_| bad())?,
            minor: minor.parse().map_err(|_| bad())?,
            arch_specific,
        })
    }

    /// The same capability as an architecture-specific target (`sm_90` → `sm_90a`).
    pub const fn arch_specific(self) -> Self {
        ComputeCapability {
            arch_specific: true,
            ..self
        }
    }

    /// True for Hopper (sm_90, sm_90a).
    pub const fn is_hopper(self) -> bool {
        self.major == 9
    }

    /// True where `wgmma.mma_async` exists: sm_90 and sm_90a only (Blackwell replaced it).
    pub const fn has_wgmma(self) -> bool {
        self.major == 9 && self.minor == 0
    }

    /// True for sm_90 and newer (sm_90a, sm_100, …): bulk async copies (TMA),
    /// transaction-count mbarriers and thread-block clusters.
    pub const fn has_tma(self) -> bool {
        self.major >= 9
    }

    /// The NVRTC target for kernels of configuration `defines` on this capability: the
    /// architecture-specific one (`sm_90a`, which wgmma needs) when `FD_WG` is 1 where wgmma
    /// exists, else this one.
    pub fn target_for(self, defines: &[(&str, usize)]) -> Self {
        if self.has_wgmma() && defines.contains(&("FD_WG", 1)) {
            self.arch_specific()
        } else {
            self
        }
    }
}

impl fmt::Display for ComputeCapability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "sm_{}{}{}",
            self.major,
            self.minor,
            if self.arch_specific { "a" } else { "" }
        )
    }
}

impl FromStr for ComputeCapability {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Self::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sm(s: &str) -> ComputeCapability {
        s.parse().unwrap()
    }

    #[test]
    fn names_parse_and_print_back() {
        for s in [
            "sm_80", "sm_86", "sm_89", "sm_90", "sm_90a", "sm_100", "sm_100a", "sm_120",
        ] {
            assert_eq!(sm(s).to_string(), s);
        }
        assert_eq!(sm("sm_90"), ComputeCapability::new(9, 0));
        assert_eq!(sm("sm_100a"), ComputeCapability::new(10, 0).arch_specific());
        assert_eq!(sm("sm_89").minor, 9);
        for bad in [
            "",
            "sm_",
            "sm_9",
            "sm_090",
            "sm_9x",
            "sm_1000",
            "sm_90b",
            "compute_90",
            "SM_90",
            "sm_-9",
            "sm_9a",
        ] {
            let e = ComputeCapability::parse(bad).unwrap_err();
            assert!(
                e.contains(&format!("`{bad}`")) && e.contains("sm_<major><minor>[a]"),
                "{bad}: {e}"
            );
        }
        assert_eq!(ComputeCapability::from_device(9, 0).unwrap(), sm("sm_90"));
        assert!(ComputeCapability::from_device(-1, 0).is_err() && ComputeCapability::from_device(9, 10).is_err());
    }

    #[test]
    fn the_feature_rules_follow_the_capability() {
        assert!(sm("sm_90").has_wgmma() && sm("sm_90a").has_wgmma());
        assert!(!sm("sm_80").has_wgmma() && !sm("sm_100").has_wgmma() && !sm("sm_89").has_wgmma());
        assert!(sm("sm_90").has_tma() && sm("sm_90a").has_tma() && sm("sm_100").has_tma() && sm("sm_120").has_tma());
        assert!(!sm("sm_89").has_tma() && !sm("sm_80").has_tma());
        assert!(sm("sm_90").is_hopper() && !sm("sm_100").is_hopper());
        let wg = [("FD_WG", 1)];
        assert_eq!(sm("sm_90").target_for(&wg), sm("sm_90a"));
        assert_eq!(sm("sm_90a").target_for(&wg), sm("sm_90a"));
        assert_eq!(sm("sm_90").target_for(&[("FD_WG", 0)]), sm("sm_90"));
        assert_eq!(sm("sm_80").target_for(&wg), sm("sm_80"));
        assert_eq!(sm("sm_100").target_for(&wg), sm("sm_100"));
    }
}
