//! The terminal table style every mla-diff table shares.
//!
//! Reports, benchmarks, `inspect`, `weights-check` and `selftest` all print comfy-table tables
//! with UTF-8 borders only; one constructor keeps them alike.

use comfy_table::{Table, presets};

/// An empty table in the mla-diff style (UTF-8 borders only) whose columns are named `header`.
pub fn bordered(header: &[&str]) -> Table {
    let mut table = Table::new();
    table.load_style(presets::UTF8_BORDERS_ONLY).set_header(header.to_vec());
    table
}
