//! `mla-diff inspect`: what is in a model (a GGUF file or a Hugging Face checkpoint), as mla-diff
//! understands it.
//!
//! Before blaming a kernel, an engineer wants to see what the file claims: the metadata, the MLA
//! configuration derived from it (or the exact key that prevents deriving it), and every tensor's
//! ggml type, dims and size, per layer. Quantizers pick different types for different MLA
//! matrices (small ones fall back from K-quants), and that is where shard and layout surprises
//! start, so the per-tensor type is shown for each.

use crate::model::config::MlaConfig;
use crate::model::gguf::{GgufFile, MetaValue};

/// Longest metadata value shown in full; longer strings and arrays are elided.
const MAX_VALUE_CHARS: usize = 80;

fn show_value(file: &GgufFile, v: &MetaValue) -> String {
    let s = match v {
        MetaValue::String(s) => format!("{s:?}"),
        MetaValue::Array(a) => {
            let head: Vec<String> = if a.elem_type == 8 {
                file.meta_string_array(a, 4).iter().map(|s| format!("{s:?}")).collect()
            } else {
                file.meta_numeric_array(a, 8).iter().map(|x| format!("{x}")).collect()
            };
            let more = if (head.len() as u64) < a.len { ", …" } else { "" };
            format!("[{}{more}] (len {})", head.join(", "), a.len)
        }
        MetaValue::F32(x) => format!("{x}"),
        MetaValue::F64(x) => format!("{x}"),
        MetaValue::Bool(b) => format!("{b}"),
        other => other.as_u64().map_or_else(|| format!("{:?}", other), |x| x.to_string()),
    };
    if s.chars().count() > MAX_VALUE_CHARS {
        let cut: String = s.chars().take(MAX_VALUE_CHARS).collect();
        format!("{cut}…")
    } else {
        s
    }
}

/// Human-readable size.
fn bytes(n: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut x = n as f64;
    let mut u = 0;
    while x >= 1024.0 && u < U.len() - 1 {
        x /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{x:.1} {}", U[u])
    }
}

/// The full `inspect` text for `file`; `layer` restricts the tensor table to one layer (plus the
/// non-layer tensors).
pub fn inspect(file: &GgufFile, layer: Option<usize>) -> String {
    let mut s = String::new();
    if file.is_gguf() {
        s.push_str(&format!(
            "file {}\nGGUF v{}, {} metadata keys, {} tensors, alignment {}, data at byte {}, {}\n\n",
            file.path().display(),
            file.version(),
            file.metadata().len(),
            file.tensors().len(),
            file.alignment(),
            file.data_offset(),
            bytes(file.file_len())
        ));
    } else {
        // A checkpoint folder: its config.json read as the GGUF keys mla-diff derives the MLA
        // configuration from, its tensors presented under their GGUF names.
        s.push_str(&format!(
            "model {}\n{}, {} metadata keys from config.json (as GGUF keys), {} tensors, {}\n\n",
            file.path().display(),
            file.kind(),
            file.metadata().len(),
            file.tensors().len(),
            bytes(file.file_len())
        ));
    }

    let mut meta = crate::output::table::bordered(&["key", "type", "value"]);
    for (k, v) in file.metadata() {
        meta.add_row(vec![k.clone(), v.type_name(), show_value(file, v)]);
    }
    s.push_str("metadata\n");
    s.push_str(&meta.to_string());
    s.push_str("\n\n");

    match MlaConfig::from_gguf(file) {
        Ok(c) => {
            s.push_str(&format!("MLA config ({}): {}\n", c.arch, c.dims_line()));
            s.push_str(&format!(
                "  layers {}, kv_b {:?}, rms eps {:.3e}, rope base {}, softmax scale {:.6} (m = {:.6})\n",
                c.n_layer,
                c.kv_b_layout,
                c.rms_eps,
                c.rope_base,
                c.softmax_scale,
                c.mscale()
            ));
            match c.yarn {
                Some(y) => s.push_str(&format!(
                    "  YaRN factor {}, original context {}, log multiplier {} (0.1·mscale_all_dim), beta fast {} slow {}\n",
                    y.factor, y.original_context, y.log_multiplier, y.beta_fast, y.beta_slow
                )),
                None => s.push_str("  no RoPE scaling\n"),
            }
            if let Some(m) = &c.moe {
                s.push_str(&format!(
                    "  MoE from layer {} ({} dense): {}\n",
                    c.leading_dense_block_count,
                    c.leading_dense_block_count,
                    m.line()
                ));
            }
            for q in c.quirks() {
                s.push_str(&format!("  {q}\n"));
            }
            s.push('\n');
        }
        Err(e) => s.push_str(&format!("MLA config: not derivable: {e}\n\n")),
    }

    let mut header = vec!["tensor", "type", "ne (ggml)", "shape (PyTorch)", "bytes"];
    if !file.is_gguf() {
        header.push("stored as");
    }
    let mut tensors = crate::output::table::bordered(&header);
    let mut rows: Vec<_> = file.tensors().iter().collect();
    if !file.is_gguf() {
        // A checkpoint's tensors are presented kind by kind; shown layer by layer as a GGUF's.
        rows.sort_by_key(|t| crate::model::tensors::layer_of(&t.name).map_or(0, |l| l + 1));
    }
    for t in rows {
        let tl = crate::model::tensors::layer_of(&t.name);
        if layer.is_some_and(|want| tl.is_some_and(|got| got != want)) {
            continue;
        }
        let mut row = vec![
            t.name.clone(),
            t.ggml_type.to_string(),
            format!("{:?}", t.ne),
            format!("{:?}", t.shape()),
            bytes(t.n_bytes),
        ];
        if !file.is_gguf() {
            let scales = file
                .block_scales(t)
                .map(|b| {
                    format!(
                        " × {} {:?} ({}×{} blocks)",
                        b.name.rsplit('.').next().unwrap_or(""),
                        b.grid,
                        b.block[0],
                        b.block[1]
                    )
                })
                .unwrap_or_default();
            row.push(format!("{} {}{scales}", file.source_name(t), file.stored_type(t)));
        }
        tensors.add_row(row);
    }
    s.push_str("tensors\n");
    s.push_str(&tensors.to_string());
    s.push('\n');
    s
}
