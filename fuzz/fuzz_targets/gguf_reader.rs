//! Coverage-guided fuzzing of the GGUF reader and everything that consumes its index.
//!
//! One input is one GGUF image: open it from memory, dequantize every tensor of the index,
//! render `inspect`'s text (which decodes metadata arrays), derive the MLA configuration and load
//! layer 0. Every error is fine; a panic, an abort, a timeout or an allocation past
//! `-rss_limit_mb` / `-malloc_limit_mb` is a bug.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mla_diff::model::config::MlaConfig;
use mla_diff::model::gguf::GgufFile;
use mla_diff::model::weights::{LayerWeights, dequant_tensor};

fuzz_target!(|data: &[u8]| {
    let Ok(file) = GgufFile::from_bytes("fuzz.gguf", data.to_vec()) else {
        return;
    };
    // The parser checked every tensor's bytes against the file, so this is ≤ ~20 f32 per input
    // byte: cheap for fuzzer-sized inputs.
    for t in file.tensors() {
        let _ = dequant_tensor(&file, t);
    }
    let _ = mla_diff::jobs::inspect::inspect(&file, None);
    let Ok(cfg) = MlaConfig::from_gguf(&file) else {
        return;
    };
    let _ = LayerWeights::load(&file, &cfg, 0);
});
