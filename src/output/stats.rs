//! `--stats`: what a run cost, for time-to-verdict work at real model size.
//!
//! Wall time, the peak resident set (Linux `VmHWM`), and how much of the GGUF was read, grouped by
//! layer, so a lazy reader that starts reading whole files shows at once; and the wall time of
//! each stage of the run ([`crate::core::timing`]), so the stage that dominates can be read off.

use crate::core::timing::StageTime;
use crate::model::gguf::GgufFile;

/// `--stats`' second line: each stage's summed wall time (and how many times it ran, when more
/// than once), in the order the stages first ran. Each `detect …` (one detector) is a part of
/// `diagnose`, not an addition to it; every other stage is disjoint from the rest.
pub fn stages_line(stages: &[StageTime]) -> String {
    let parts: Vec<String> = stages
        .iter()
        .map(|s| {
            let n = if s.count > 1 {
                format!(" ({}×)", s.count)
            } else {
                String::new()
            };
            format!("{} {:.2} s{n}", s.name, s.wall.as_secs_f64())
        })
        .collect();
    format!(
        "mla-diff: stages: {}",
        if parts.is_empty() {
            "none".into()
        } else {
            parts.join(", ")
        }
    )
}

/// Peak resident set size of this process in bytes (Linux `VmHWM`), if known.
pub fn peak_rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// `--stats`: wall time, peak RSS, the header bytes read at open, and the tensor data read,
/// grouped by layer (`blk.N.`) and other tensors.
pub fn stats_line(file: &GgufFile, wall: std::time::Duration) -> String {
    let reads = file.data_reads();
    let mut by_layer: std::collections::BTreeMap<String, (usize, u64)> = std::collections::BTreeMap::new();
    let mut tensors = std::collections::BTreeSet::new();
    for (name, _, len) in &reads {
        let key = crate::model::tensors::layer_of(name).map_or_else(|| name.clone(), |l| format!("layer {l}"));
        let e = by_layer.entry(key).or_default();
        if tensors.insert(name.clone()) {
            e.0 += 1;
        }
        e.1 += len;
    }
    let total: u64 = reads.iter().map(|r| r.2).sum();
    let parts: Vec<String> = by_layer
        .iter()
        .map(|(k, (n, b))| format!("{k}: {n} tensors, {:.1} MB", *b as f64 / 1e6))
        .collect();
    format!(
        "mla-diff: stats: wall {:.2} s, peak RSS {}, file {:.1} GB declared, header read at open {:.2} MB, tensor data read {:.1} MB ({})",
        wall.as_secs_f64(),
        peak_rss_bytes().map_or("n/a".into(), |b| format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)),
        file.file_len() as f64 / 1e9,
        file.header_bytes_read() as f64 / 1e6,
        total as f64 / 1e6,
        if parts.is_empty() {
            "none".into()
        } else {
            parts.join("; ")
        }
    )
}
