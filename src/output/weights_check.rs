//! The terminal text of `weights --check`: one row per tensor of the engine's weights file, then
//! the findings.
//!
//! A reader of a weights check wants the failing tensor, what it should have been rebuilt from
//! (the GGUF tensors with their ggml types, since a quant type is often the cause) and the
//! finding's evidence and hint in one place; the JSON of the same [`WeightsReport`] is its
//! serialization, written by the command.

use crate::judge::diagnose::Subject;
use crate::judge::weights_check::WeightsReport;
use crate::output::table;

/// The terminal table and findings of a weights check: a header (file, engine, TP size, the
/// `dtype` metadata string as written and the weight row it selects), one row per tensor (its
/// safetensors dtype, shape, expected shape, the GGUF tensors it is rebuilt from with their ggml
/// type names, status, `rel_l2` and max |Δ|), then the findings, each with its GGUF source.
pub fn terminal(rep: &WeightsReport) -> String {
    terminal_fit(rep, None)
}

/// [`terminal`] with the table fitted to `width` terminal columns (cells wrap, tensor names
/// stay whole); `None` leaves every cell on one line.
pub fn terminal_fit(rep: &WeightsReport, width: Option<usize>) -> String {
    let mut t = table::bordered(&[
        "tensor",
        "dtype",
        "shape",
        "expected",
        "GGUF source (ggml type)",
        "status",
        "rel_l2",
        "max |Δ|",
    ]);
    for c in &rep.tensors {
        let (rel, max) = c.metrics.as_ref().map_or((String::new(), String::new()), |m| {
            (format!("{:.3e}", m.rel_l2), format!("{:.3e}", m.max_abs))
        });
        t.add_row(vec![
            c.name.clone(),
            c.file_dtype.clone(),
            format!("{:?}", c.shape),
            format!("{:?}", c.expected_shape),
            c.source.join(" + "),
            if c.pass { "pass".into() } else { "FAIL".into() },
            rel,
            max,
        ]);
    }
    if let Some(w) = width {
        table::fit(&mut t, w);
    }
    let mut s = format!(
        "weights {} (engine `{}`, tp {}, dtype metadata {}, judged by the {} weight row) against {}\n{t}\n",
        rep.weights,
        rep.engine,
        rep.tp,
        rep.metadata_dtype
            .as_deref()
            .map_or("absent (f32)".to_string(), |d| format!("`{d}`")),
        rep.dtype,
        rep.model
    );
    if !rep.ignored.is_empty() {
        s.push_str(&format!("ignored (not MLA params): {}\n", rep.ignored.join(", ")));
    }
    if rep.findings.is_empty() {
        s.push_str(&format!(
            "{}\n",
            if rep.all_pass() {
                format!("all {} tensors match the GGUF", rep.tensors.len())
            } else {
                "some tensors differ (see the table)".into()
            }
        ));
    }
    for f in &rep.findings {
        s.push_str(&format!(
            "finding {} at {}: {}\n  hint: {}\n",
            f.class, f.subject, f.evidence, f.hint
        ));
        if let Subject::Loaded(t) = &f.subject
            && !t.source.is_empty()
        {
            s.push_str(&format!("  GGUF source: {}\n", t.source.join(" + ")));
        }
    }
    s
}
