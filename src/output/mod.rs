//! Rendering results for people and programs: terminal tables, JSON and triage reports.
//!
//! Everything here turns a finished result (a [`crate::judge::report::RunReport`], a
//! [`crate::judge::weights_check::WeightsReport`], a [`crate::judge::selftest::SelftestReport`])
//! into text or an image; nothing here computes or judges. Every table of the tool is built here,
//! from [`table`]'s style. Jobs that print summaries (golden, selftest) render through these
//! functions, which is why this layer sits below [`crate::jobs`].

pub mod report;
pub mod selftest;
pub mod sites;
pub mod stats;
pub mod table;
pub mod triage;
pub mod weights_check;
