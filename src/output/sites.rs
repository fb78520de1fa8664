//! `mla-diff sites`: the site vocabulary of dumps, as a table for people and as JSON for hooks.
//!
//! Someone writing a hook needs the names a dump may hold, their shapes and what each holds,
//! without reading the source; a hook's tests need the same names in a form they can parse.
//! Both render one [`SiteVocabulary`], so the two can never list different names.

use crate::model::dump::{SHAPE_DIMS, SiteVocabulary};
use crate::output::report::to_json_bytes;
use crate::output::table::bordered;

/// The human form: how a site's tensor is named, the table of stages (name after `L{layer}.`,
/// shape in dim names, meaning), the dim legend ([`SHAPE_DIMS`]) and the `format` values.
pub fn sites_text(v: &SiteVocabulary) -> String {
    let mut table = bordered(&["site", "shape", "holds"]);
    for row in v.rows() {
        table.add_row(vec![row.name, row.shape.to_string(), row.meaning.to_string()]);
    }
    // The dim legend, wrapped at the table's usual width.
    let mut legend = String::from("dims:");
    let mut line = legend.len();
    for (k, (dim, what)) in SHAPE_DIMS.iter().enumerate() {
        let item = format!(" {dim} {what}{}", if k + 1 < SHAPE_DIMS.len() { "," } else { "" });
        if line + item.len() > 100 {
            legend.push_str("\n     ");
            line = 5;
        }
        legend.push_str(&item);
        line += item.len();
    }
    let formats: Vec<String> = v.dump_formats.iter().map(|f| format!("`{f}`")).collect();
    format!(
        "A dump names each tensor `{}` (docs/dump-format.md); the sites, in data-flow order:\n\
         {table}\n{legend}\nmetadata `format`: {}\n",
        v.site_templates.layer,
        formats.join(", "),
    )
}

/// The JSON form (`mla-diff sites --json`): the vocabulary object, pretty-printed, with a final
/// newline.
pub fn sites_json(v: &SiteVocabulary) -> Vec<u8> {
    to_json_bytes(v)
}
