//! The embedded default fixture and the one way to open a model.
//!
//! `mla-diff run` must work with no `--model` anywhere, so the smallest quantized fixture of
//! `golden/models/` is compiled into the binary. Jobs (run, golden, selftest) and the command line
//! open models through [`open_model`], which falls back to it.

use std::path::PathBuf;

use crate::core::error::Result;
use crate::model::gguf::GgufFile;

/// Name under which the embedded default fixture is reported.
pub const EMBEDDED_NAME: &str = "<embedded tiny-v3-q4_k_m.gguf>";

/// The file name of the embedded default fixture in `golden/models/` (what a format-2 dump made
/// from it names as its model).
pub const EMBEDDED_FILE: &str = "tiny-v3-q4_k_m.gguf";

/// The embedded default fixture: the smallest quantized fixture of `golden/models/`, so that
/// `mla-diff run` works with no `--model` anywhere.
pub static EMBEDDED_GGUF: &[u8] = include_bytes!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/golden/models/tiny-v3-q4_k_m.gguf"
));

/// Opens `--model` (a GGUF file or a Hugging Face checkpoint folder, see [`crate::model::open`]),
/// or the embedded fixture when absent.
pub fn open_model(model: Option<&PathBuf>) -> Result<GgufFile> {
    match model {
        Some(p) => crate::model::open(p),
        None => GgufFile::from_static(EMBEDDED_NAME, EMBEDDED_GGUF),
    }
}

/// The file name a dump records for `file` (format 2's `model.file`): its name without folders,
/// or [`EMBEDDED_FILE`] for the embedded fixture.
pub fn model_file_name(file: &GgufFile) -> String {
    if file.path() == std::path::Path::new(EMBEDDED_NAME) {
        return EMBEDDED_FILE.to_string();
    }
    file.path().file_name().map_or_else(
        || file.path().display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    )
}
