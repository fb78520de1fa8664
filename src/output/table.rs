//! The terminal table style every mla-diff table shares.
//!
//! Reports, benchmarks, `inspect`, `weights --check` and `selftest` all print comfy-table tables
//! with UTF-8 borders only, fitted to a narrow terminal the same way; one constructor and one
//! fitting rule keep them alike.

use comfy_table::{ColumnConstraint, ContentArrangement, Table, presets};

/// An empty table in the mla-diff style (UTF-8 borders only) whose columns are named `header`.
pub fn bordered(header: &[&str]) -> Table {
    let mut table = Table::new();
    table.load_style(presets::UTF8_BORDERS_ONLY).set_header(header.to_vec());
    table
}

/// Fits `table` to `width` terminal columns: cells wrap, except those of the first column (the
/// site or tensor names a reader searches for), which stay whole.
pub fn fit(table: &mut Table, width: usize) {
    table
        .set_content_arrangement(ContentArrangement::Dynamic)
        .set_width(u16::try_from(width).unwrap_or(u16::MAX));
    if let Some(c) = table.column_mut(0) {
        c.set_constraint(ColumnConstraint::ContentWidth);
    }
}
