//! The terminal text of `weights --check`: one row per tensor of the engine's weights file, then
//! the findings.
//!
//! A reader of a weights check wants the failing tensor, what it should have been rebuilt from
//! (the GGUF tensors with their ggml types, since a quant type is often the cause) and the
//! finding's evidence and hint in one place; the JSON of the same [`WeightsReport`] is its
//! serialization, written by the command.

use crate::judge::diagnose::{Finding, Subject};
use crate::judge::weights_check::{TensorCheck, WeightsReport};
use crate::output::table;

/// The terminal table and findings of a weights check: a header (file, engine, TP size, the
/// heads of a one-rank dump, the `dtype` metadata string as written and the weight row it
/// selects), one row per tensor (its safetensors dtype, shape, expected shape, the GGUF tensors
/// it is rebuilt from with their ggml type names, status, `rel_l2` and max |Δ|), the tensors
/// ignored and why, then the findings, each with the model tensors it comes from.
pub fn terminal(rep: &WeightsReport) -> String {
    terminal_fit(rep, None)
}

/// The table of `rows`, one per tensor: name, safetensors dtype, shape, expected shape, GGUF
/// source with ggml types, status, `rel_l2`, max |Δ|; fitted to `width` terminal columns
/// (cells wrap, tensor names stay whole), or `None` for every cell on one line. `compare`
/// prints the failing loaded weights of a dump with it.
pub fn tensor_table(rows: &[&TensorCheck], width: Option<usize>) -> String {
    let mut t = table::bordered(&[
        "tensor",
        "dtype",
        "shape",
        "expected",
        "model source (type)",
        "status",
        "rel_l2",
        "max |Δ|",
    ]);
    for c in rows {
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
    t.to_string()
}

/// The lines listing the ignored tensors of a weights file, apart by why: the routed experts
/// (not rebuilt: dequantizing every expert of a layer costs E dense FFNs) and the rest (no param
/// `weights --check` knows). Empty when nothing was ignored.
pub fn ignored_lines(ignored: &[String]) -> Vec<String> {
    let (routed, other): (Vec<&String>, Vec<&String>) = ignored
        .iter()
        .partition(|n| crate::judge::weights_check::is_routed_expert(n));
    let join = |v: &[&String]| v.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ");
    let mut out = Vec::new();
    if !routed.is_empty() {
        out.push(format!(
            "ignored (routed experts, not rebuilt: dequantizing every expert of a layer costs E dense FFNs; the dense MLP and the shared experts are checked): {}",
            join(&routed)
        ));
    }
    if !other.is_empty() {
        out.push(format!(
            "ignored (not a parameter weights --check rebuilds): {}",
            join(&other)
        ));
    }
    out
}

/// [`terminal`] with the table fitted to `width` terminal columns (cells wrap, tensor names
/// stay whole); `None` leaves every cell on one line.
pub fn terminal_fit(rep: &WeightsReport, width: Option<usize>) -> String {
    let rows: Vec<&TensorCheck> = rep.tensors.iter().collect();
    let t = tensor_table(&rows, width);
    let mut s = format!(
        "weights {} (engine `{}`, tp {}{}, dtype metadata {}, judged by the {} weight row) against {}\n{t}\n",
        rep.weights,
        rep.engine,
        rep.tp,
        rep.heads
            .map_or(String::new(), |[a, b]| format!(", heads {a}..{b} (one rank's)")),
        rep.metadata_dtype
            .as_deref()
            .map_or("absent (f32)".to_string(), |d| format!("`{d}`")),
        rep.dtype,
        rep.model
    );
    for l in ignored_lines(&rep.ignored) {
        s.push_str(&l);
        s.push('\n');
    }
    if rep.findings.is_empty() {
        s.push_str(&format!(
            "{}\n",
            if rep.all_pass() {
                format!("all {} tensors match the model", rep.tensors.len())
            } else {
                "some tensors differ (see the table)".into()
            }
        ));
    }
    for f in &rep.findings {
        s.push_str(&finding_text(f));
    }
    s
}

/// A loaded-weight finding as `weights --check` prints it: `finding CLASS at TENSOR: evidence`,
/// the hint, and the line naming the model tensors it comes from.
pub fn finding_text(f: &Finding) -> String {
    let mut s = format!(
        "finding {} at {}: {}\n  hint: {}\n",
        f.class, f.subject, f.evidence, f.hint
    );
    if let Subject::Loaded(t) = &f.subject
        && !t.source.is_empty()
    {
        s.push_str(&format!("  model source: {}\n", t.source.join(" + ")));
    }
    s
}
