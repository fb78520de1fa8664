//! DSA at GLM-5's size: the sparse attention of every path reads each token's kept keys by
//! index, so a layer's memory grows with T · top-k and never holds a copy of the keys per query.
//!
//! GLM-5's attention and indexer (N = 64, P/R/V = 192/64/256, 32 indexer heads of 128, top-k
//! 2048) on a small residual stream (H = 256, Lq = L = 128), at T = 1024: every token keeps every
//! key up to itself (T ≤ top-k), 524,800 kept keys. Copied out per query, the expanded paths'
//! keys and values would take 524,800 · 64 · (256 + 256) floats, 68.7 GB, and a GPU launch over
//! the 8.6·10^9 key elements covered only their count mod 2^32 (the keys of the first 31 rows):
//! the clean layer's `lse` failed from T ≈ 724 (T(T+1)/2 · 64 · 256 ≥ 2^32). The full GLM-5 layer
//! (scripts/fixtures/make_glm5_gguf.py) is measured in BENCHMARKS.md.

use crate::common::{Dims, IndexerDims, glm_dsa, write_temp};

/// GLM-5's attention heads and indexer on H = 256, Lq = L = 128, one layer with a dense FFN.
fn glm5_heads() -> (tempfile::TempDir, std::path::PathBuf) {
    let d = Dims {
        n_layer: 1,
        h: 256,
        n: 64,
        lq: Some(128),
        l: 128,
        p: 192,
        r: 64,
        v: 256,
        f: 64,
        vocab: 16,
    };
    let ix = IndexerDims {
        n_head: 32,
        head_dim: 128,
        top_k: 2048,
    };
    write_temp(&glm_dsa(d, ix).build().bytes, "glm5-heads.gguf")
}

/// `mla-diff run` with `args` under a 16 GiB address-space limit (a per-query copy of the keys
/// fails its allocation instead of taking the machine's memory); (exit code, stdout, stderr).
fn run_limited(args: &[&str]) -> (i32, String, String) {
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg("ulimit -v 16777216 && exec \"$0\" \"$@\"")
        .arg(env!("CARGO_BIN_EXE_mla-diff"))
        .args(args)
        .output()
        .expect("run mla-diff under sh");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Bytes of a size as `--stats` and the refusal message print it (`1.81 GiB`, `640.0 MiB`).
fn bytes_after(text: &str, prefix: &str) -> f64 {
    let at = text.find(prefix).unwrap_or_else(|| panic!("no {prefix:?} in {text}")) + prefix.len();
    let mut words = text[at..].split_whitespace();
    let x: f64 = words.next().unwrap().parse().unwrap();
    let unit = words.next().unwrap().trim_end_matches([',', ')']);
    x * match unit {
        "KiB" => 1024.0,
        "MiB" => 1024.0 * 1024.0,
        "GiB" => 1024.0 * 1024.0 * 1024.0,
        u => panic!("unit {u}"),
    }
}

#[test]
fn a_glm5_shaped_layer_at_t_1024_is_clean_on_every_path_in_bounded_memory() {
    let (_d, path) = glm5_heads();
    let p = path.to_str().unwrap();
    let json = _d.path().join("report.json");
    let base = [
        "run",
        "--model",
        p,
        "--layer",
        "0",
        "--tokens",
        "1024",
        "--backend",
        "cpu",
    ];
    // The estimate the run is admitted with.
    let (code, _, err) = run_limited(&[&base[..], &["--max-memory", "1K"]].concat());
    assert_eq!(code, 2, "{err}");
    let estimate = bytes_after(&err, "needs about ");
    let (code, out, err) = run_limited(&[&base[..], &["--stats", "--json", json.to_str().unwrap()]].concat());
    assert_eq!(code, 0, "{out}\n{err}");
    for path in ["mha", "mqa", "chunked", "mixed"] {
        assert!(out.contains(&format!("{path}: all ")), "{path}: {out}");
    }
    // Memory: a few hundred MB, under the estimate; the per-query copy alone was 68.7 GB.
    let peak = bytes_after(&err, "peak RSS ");
    eprintln!(
        "T = 1024: peak RSS {:.2} GiB, estimate {:.2} GiB",
        peak / 1073741824.0,
        estimate / 1073741824.0
    );
    assert!(peak < 2.0 * 1073741824.0, "peak RSS {peak} B");
    assert!(
        estimate >= peak && estimate < 4.0 * 1073741824.0,
        "estimate {estimate} B, peak {peak} B"
    );
    // Values: every path's lse and attn_out against the f64 reference, all 1024 rows.
    let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(doc["verdict"], "pass");
    assert_eq!(doc["exit_code"], 0);
    let mut checked = 0;
    for s in doc["sites"].as_array().unwrap() {
        let site = s["site"].as_str().unwrap();
        if !matches!(site, "L0.lse" | "L0.attn_out" | "L0.idx_topk") {
            continue;
        }
        assert_eq!(s["status"], "pass", "{s}");
        let rel = s["metrics"]["rel_l2"].as_f64().unwrap();
        let bound = if site == "L0.idx_topk" { 0.0 } else { 1e-5 };
        assert!(rel <= bound, "{} {site}: rel_l2 {rel:e}", s["path"]);
        checked += 1;
    }
    assert_eq!(checked, 12, "lse, attn_out and idx_topk of four paths");
}

/// The layout that failed in its second sequence: two sequences of 512 (262,656 kept keys, just
/// past 2^32 key elements at GLM-5's heads), through the expanded path.
#[test]
fn two_glm5_sequences_of_512_pass_through_the_expanded_path() {
    let (_d, path) = glm5_heads();
    let (code, out, err) = run_limited(&[
        "run",
        "--model",
        path.to_str().unwrap(),
        "--seqs",
        "512,512",
        "--path",
        "mha",
        "--backend",
        "cpu",
        "--json",
        "-",
        "--quiet",
    ]);
    assert_eq!(code, 0, "{err}");
    let doc: serde_json::Value = serde_json::from_str(&out).unwrap();
    let lse = doc["sites"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["site"] == "L0.lse")
        .unwrap();
    assert_eq!(lse["status"], "pass");
    assert!(lse["metrics"]["rel_l2"].as_f64().unwrap() <= 1e-5, "{lse}");
}
