//! Rendering results for people and programs: terminal tables, JSON and triage reports.
//!
//! Everything here turns a finished [`crate::judge::report::RunReport`] into text or an image;
//! nothing here computes or judges. Jobs that print summaries (golden, selftest) render through
//! these functions, which is why this layer sits below [`crate::jobs`].

pub mod report;
pub mod sites;
pub mod stats;
pub mod table;
pub mod triage;
