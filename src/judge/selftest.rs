//! The result types of `selftest`: what the job fills in and `output` renders.
//!
//! A [`SelftestReport`] holds one [`CaseResult`] per (fixture, fault or clean run, path, TP
//! size, page size) with the finding diagnosis made, and the device's dequantization checked
//! against the CPU's. Keeping the types here, below the renderers and the jobs, lets both use
//! them without either depending on the other, as [`super::report`] does for runs.

use serde::Serialize;

use crate::compute::path::PathKind;
use crate::core::class::Class;
use crate::judge::diagnose::Finding;

/// One selftest case.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CaseResult {
    /// Fixture name (file stem).
    pub fixture: String,
    /// `clean` or the fault's name.
    pub case: String,
    /// The path.
    pub path: PathKind,
    /// TP ranks.
    pub tp: usize,
    /// Page size.
    pub page: usize,
    /// Expected class and accepted first sites (`None` for a clean run).
    pub expected: Option<(Class, Vec<String>)>,
    /// What diagnosis found.
    pub found: Option<Finding>,
    /// `ok`, `miss`, `wrong class`, `wrong site`, `false alarm`.
    pub verdict: String,
}

impl CaseResult {
    /// True when the case came out as expected.
    pub fn ok(&self) -> bool {
        self.verdict == "ok"
    }
}

/// The backend's dequantization of every tensor of every fixture, bit for bit against the CPU.
#[derive(Debug, Clone, Default, Serialize)]
pub struct DequantCheck {
    /// Tensors compared.
    pub tensors: usize,
    /// Elements compared.
    pub elements: usize,
    /// Elements whose bits differ.
    pub mismatches: usize,
    /// ggml types covered.
    pub types: Vec<String>,
    /// The first mismatching tensor, if any.
    pub first_mismatch: Option<String>,
}

/// All cases of a selftest run.
#[derive(Debug, Clone, Serialize)]
pub struct SelftestReport {
    /// Every case.
    pub cases: Vec<CaseResult>,
    /// The backend's dequantization against the CPU's (absent for the CPU backend itself).
    pub dequant: Option<DequantCheck>,
    /// Wall time in seconds.
    pub seconds: f64,
}

impl SelftestReport {
    /// True when every case came out as expected and dequantization matched bit for bit.
    pub fn all_ok(&self) -> bool {
        self.cases.iter().all(CaseResult::ok) && self.dequant.as_ref().is_none_or(|d| d.mismatches == 0)
    }
}
