//! Verdicts: per-site metrics against the tolerance table, and the diagnosis of a divergence.
//!
//! [`metrics`] compares a candidate trace with the reference site by site ([`device`] where both
//! stay on the GPU); [`tolerance`] is the
//! one table of limits with the provenance of each number; [`diagnose`] names the bug class of
//! each path's first divergence and of each failing tensor of an engine's loaded weights;
//! [`report`], [`weights_check`] and [`selftest`] hold the result types that jobs fill and
//! outputs render.

pub mod device;
pub mod diagnose;
pub mod label;
pub mod metrics;
pub mod report;
pub mod selftest;
pub mod tolerance;
pub mod weights_check;
