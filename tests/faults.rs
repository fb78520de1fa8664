//! Every row of docs/faults.md through the binary: `run --inject NAME` exits 1 and names the expected
//! class at the expected first site on every path the fault applies to, in the JSON report.

use crate::common::{repo, run_bin};
use serde_json::Value;

/// Runs `mla-diff run --layer 1 --json … <args>` and returns (exit code, findings).
fn findings(args: &[&str]) -> (i32, Vec<Value>) {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("r.json");
    let mut a = vec!["run", "--layer", "1", "--quiet", "--json", json.to_str().unwrap()];
    a.extend_from_slice(args);
    let (code, out, err) = run_bin(&a);
    assert!(code == 0 || code == 1, "{out}{err}");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    (code, v["findings"].as_array().unwrap().clone())
}

/// Asserts one finding per path in `expect` = [(path, class, site)].
fn expect(args: &[&str], want: &[(&str, &str, &str)]) -> Vec<Value> {
    let (code, f) = findings(args);
    assert_eq!(code, 1, "{args:?}: a finding must exit 1");
    for (path, class, site) in want {
        let got = f
            .iter()
            .find(|x| x["path"] == *path)
            .unwrap_or_else(|| panic!("{args:?}: no finding for {path}: {f:#?}"));
        assert_eq!(got["class"], *class, "{args:?} {path}: {got:#?}");
        assert_eq!(got["site"], *site, "{args:?} {path}: {got:#?}");
        assert!(!got["evidence"].as_str().unwrap().is_empty() && !got["hint"].as_str().unwrap().is_empty());
    }
    f
}

const ALL4: [&str; 4] = ["mha", "mqa", "chunked", "mixed"];

fn model(name: &str) -> String {
    repo().join("golden/models").join(name).to_string_lossy().into_owned()
}

#[test]
fn phantom_output() {
    let want: Vec<_> = ALL4.iter().map(|p| (*p, "phantom-output", "L1.attn_out")).collect();
    expect(&["--inject", "phantom-output"], &want);
}

#[test]
fn unwritten_rows() {
    expect(
        &[
            "--inject",
            "unwritten-rows",
            "--path",
            "chunked",
            "--seqs",
            "1,15,16,17,53",
        ],
        &[("chunked", "unwritten-rows", "L1.lse")],
    );
}

#[test]
fn fused_shard_swap_reports_permutation_1_0() {
    let want: Vec<_> = ALL4.iter().map(|p| (*p, "shard-order", "L1.w.fused_qkv_a")).collect();
    let f = expect(&["--inject", "fused-shard-swap"], &want);
    assert!(f[0]["evidence"].as_str().unwrap().contains("[1,0]"), "{f:#?}");
}

#[test]
fn tp_rank_order_and_rank0_everywhere() {
    let want: Vec<_> = ALL4.iter().map(|p| (*p, "tp-rank-order", "L1.w.q_b.rank0")).collect();
    let f = expect(&["--inject", "tp-rank-order", "--tp", "2"], &want);
    assert!(f[0]["evidence"].as_str().unwrap().contains("[1,0]"));
    let want: Vec<_> = ALL4.iter().map(|p| (*p, "tp-rank-order", "L1.w.q_b.rank1")).collect();
    let f = expect(&["--inject", "tp-rank0-everywhere", "--tp", "3"], &want);
    assert!(f[0]["evidence"].as_str().unwrap().contains("rank 0 everywhere"));
}

#[test]
fn kv_b_grouped_and_k_b_untransposed() {
    expect(
        &["--inject", "kv-b-grouped"],
        &[
            ("mha", "kv-b-layout", "L1.k_nope"),
            ("mqa", "kv-b-layout", "L1.w.W_UK_T"),
            ("chunked", "kv-b-layout", "L1.k_nope"),
            ("mixed", "kv-b-layout", "L1.k_nope"),
        ],
    );
    expect(
        &["--inject", "k-b-untransposed"],
        &[
            ("mha", "kv-b-layout", "L1.w.kv_b"),
            ("mqa", "kv-b-layout", "L1.w.W_UK_T"),
            ("chunked", "kv-b-layout", "L1.w.kv_b"),
            ("mixed", "kv-b-layout", "L1.w.kv_b"),
        ],
    );
}

#[test]
fn rope_neox() {
    let want: Vec<_> = ALL4.iter().map(|p| (*p, "rope-style", "L1.q_pe_roped")).collect();
    expect(&["--inject", "rope-neox"], &want);
}

#[test]
fn no_mscale_names_the_missing_m_squared() {
    let m = model("yarn-v3-f32.gguf");
    let f = expect(
        &["--model", &m, "--inject", "no-mscale"],
        &[
            ("mha", "softmax-scale", "L1.lse"),
            ("mqa", "softmax-scale", "L1.attn_latent"),
            ("chunked", "softmax-scale", "L1.lse"),
            ("mixed", "softmax-scale", "L1.lse"),
        ],
    );
    assert!(f[0]["hint"].as_str().unwrap().contains("m² = 1.5896"), "{f:#?}");
}

#[test]
fn rope_cos_scaled_is_scale_only() {
    let m = model("lite-v2-f32.gguf");
    let want: Vec<_> = ALL4.iter().map(|p| (*p, "scale-only", "L1.q_pe_roped")).collect();
    let f = expect(&["--model", &m, "--inject", "rope-cos-scaled"], &want);
    assert!(
        f[0]["evidence"].as_str().unwrap().contains("norm ratio 1.2608"),
        "{f:#?}"
    );
}

#[test]
fn lse_plus_inf() {
    expect(
        &["--inject", "lse-plus-inf", "--path", "all", "--seqs", "1,15,16,17,53"],
        &[
            ("mqa", "lse-merge", "L1.attn_latent"),
            ("chunked", "lse-merge", "L1.lse"),
        ],
    );
}

/// The split-KV decode's merge bugs, on `mqa` (every row a decode) and `mixed` (its decode
/// rows), each named with its rule at the path's 4 splits; `mha` and `chunked` have no split-KV
/// decode and pass. A DSA model decodes its selection the same way.
#[test]
fn split_merge_faults_are_lse_merge_with_their_rule() {
    for (model_name, fault, rule) in [
        (None, "split-lse-base2", "each split's LSE in base 2"),
        (None, "split-dropped", "split 3 of 4 lost from the merge"),
        (None, "split-duplicated", "split 0 of 4 merged twice"),
        (None, "split-empty-zero", "with LSE 0 and a zero output"),
        (None, "split-empty-finite", "with a finite stale LSE and output"),
        (
            Some("dsa-glm-q8_0.gguf"),
            "split-dropped",
            "split 3 of 4 lost from the merge",
        ),
    ] {
        let m = model_name.map(model);
        let mut args = vec!["--inject", fault, "--path", "all", "--seqs", "1,15,16,17,53"];
        if let Some(m) = &m {
            args.extend(["--model", m.as_str()]);
        }
        let f = expect(
            &args,
            &[("mqa", "lse-merge", "L1.attn_latent"), ("mixed", "lse-merge", "L1.lse")],
        );
        assert_eq!(f.len(), 2, "{fault}: {f:#?}");
        for x in &f {
            assert!(x["evidence"].as_str().unwrap().contains(rule), "{fault}: {x:#?}");
        }
    }
}

/// The residual operand of a dense layer's add × 1/routed_scaling_factor (0.4 on a model
/// without one): `residual-scale` at `ffn_in` on every path, naming the factor.
#[test]
fn residual_scaled_names_the_factor() {
    let f = expect(
        &["--inject", "residual-scaled"],
        &ALL4.map(|p| (p, "residual-scale", "L1.ffn_in")),
    );
    assert!(f[0]["evidence"].as_str().unwrap().contains("α = 0.4000"), "{f:#?}");
    // moe-v3's dense layer 0, on a model with routed_scaling_factor 2.5.
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("r.json");
    let m = model("moe-v3-f32.gguf");
    let (code, out, err) = run_bin(&[
        "run",
        "--model",
        &m,
        "--layer",
        "0",
        "--path",
        "mha",
        "--inject",
        "residual-scaled",
        "--quiet",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert_eq!(code, 1, "{out}{err}");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let f = &v["findings"][0];
    assert_eq!(
        (f["class"].as_str(), f["site"].as_str()),
        (Some("residual-scale"), Some("L0.ffn_in")),
        "{f:#?}"
    );
    assert!(
        f["evidence"]
            .as_str()
            .unwrap()
            .contains("α = 1/routed_scaling_factor = 0.4000 (routed_scaling_factor 2.5)"),
        "{f:#?}"
    );
}

/// `ql_nope` through an f16 GEMM in an f32 run: `precision` on the absorbed path; refused in a
/// bf16 run, where it cannot show.
#[test]
fn fp16_accum_ql_nope_is_precision() {
    let f = expect(
        &["--inject", "fp16-accum-ql-nope", "--path", "mqa"],
        &[("mqa", "precision", "L1.ql_nope")],
    );
    assert!(f[0]["evidence"].as_str().unwrap().contains("f16"), "{f:#?}");
    let (code, _, err) = run_bin(&[
        "run",
        "--dtype",
        "bf16",
        "--inject",
        "fp16-accum-ql-nope",
        "--path",
        "mqa",
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("needs --dtype f32"), "{err}");
}

#[test]
fn quant_slice_misaligned_is_reported_without_running() {
    let want: Vec<_> = ALL4
        .iter()
        .map(|p| (*p, "quant-block-misaligned", "L1.w.kv_b"))
        .collect();
    let f = expect(&["--inject", "quant-slice-misaligned", "--tp", "2"], &want);
    assert!(f[0]["evidence"].as_str().unwrap().contains("attn_v_b"), "{f:#?}");
}

#[test]
fn a_view_read_with_another_stride_is_strided_view() {
    let want: Vec<_> = ALL4.iter().map(|p| (*p, "strided-view", "L1.kv_c_normed")).collect();
    let f = expect(&["--inject", "strided-kv-c"], &want);
    let ev = f[0]["evidence"].as_str().unwrap();
    assert!(
        ev.contains("kv_c_normed equals kv_a's 96-wide cut read with row stride 96 (L, kv_c's width) instead of 112 (L+R, kv_a's width), then kv_a_layernorm"),
        "{ev}"
    );
    let want: Vec<_> = ALL4.iter().map(|p| (*p, "strided-view", "L1.k_pe")).collect();
    let f = expect(&["--inject", "k-pe-stride"], &want);
    let ev = f[0]["evidence"].as_str().unwrap();
    assert!(
        ev.contains("k_pe equals kv_a's 16-wide cut read with row stride 96 (L, kv_c's width) instead of 112 (L+R, kv_a's width)")
            && ev.contains("(rel_l2 0 vs"),
        "{ev}"
    );
}

#[test]
fn clean_run_has_no_finding_and_bad_tp_is_an_input_error() {
    let (code, f) = findings(&["--tp", "3", "--seqs", "1,15,16,17,53"]);
    assert_eq!((code, f.len()), (0, 0));
    let (code, _, err) = run_bin(&["run", "--tp", "4"]);
    assert_eq!(code, 2);
    assert!(err.contains("--tp 4 does not divide the 6 attention heads"), "{err}");
}

#[test]
fn indexer_rope_interleaved_is_named_at_idx_scores() {
    // DeepSeek-V3.2's indexer rotates NeoX halves; the interleaved pairing of its main RoPE is
    // the real bug. The 19-token batch is past top-k 8, so attention sees other keys too.
    let want: Vec<_> = ALL4
        .iter()
        .map(|p| (*p, "indexer-rope-style", "L1.idx_scores"))
        .collect();
    for m in ["dsa-v32-f32.gguf", "dsa-v32-q8_0.gguf"] {
        let f = expect(&["--model", &model(m), "--inject", "indexer-rope-interleaved"], &want);
        let ev = f[0]["evidence"].as_str().unwrap();
        assert!(
            ev.contains("interleaved rotation") && ev.contains("longer than top-k"),
            "{ev}"
        );
    }
}

#[test]
fn indexer_topk_stale_is_named_at_idx_topk_with_the_chunk_stride() {
    // GLM-5 (glm-dsa): layer 1 runs its own indexer.
    let stale = [
        "--path",
        "chunked",
        "--new-tokens",
        "6",
        "--inject",
        "indexer-topk-stale",
    ];
    let m = model("dsa-glm-f32.gguf");
    let mut args = vec!["--model", m.as_str()];
    args.extend_from_slice(&stale);
    let f = expect(&args, &[("chunked", "indexer-topk-stale", "L1.idx_topk")]);
    let ev = f[0]["evidence"].as_str().unwrap();
    assert!(ev.contains("6 positions earlier"), "{ev}");
    // Layer 2 is a shared layer: it reuses layer 1's selection, and a stale buffer there too.
    let mut a = vec!["run", "--model", m.as_str(), "--layer", "2", "--quiet"];
    a.extend_from_slice(&stale);
    let (code, out, err) = run_bin(&a);
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        out.contains("finding [chunked] indexer-topk-stale at L2.idx_topk"),
        "{out}"
    );
}

#[test]
fn indexer_faults_are_refused_where_they_cannot_act() {
    // No indexer on deepseek2; glm-dsa's indexer RoPE is interleaved already; staleness needs a
    // previous chunk.
    for (m, fault, path) in [
        ("tiny-v3-f32.gguf", "indexer-rope-interleaved", "mha"),
        ("dsa-glm-f32.gguf", "indexer-rope-interleaved", "mha"),
        ("dsa-v32-f32.gguf", "indexer-topk-stale", "mqa"),
    ] {
        let (code, out, err) = run_bin(&[
            "run",
            "--model",
            &model(m),
            "--layer",
            "1",
            "--path",
            path,
            "--inject",
            fault,
        ]);
        assert_eq!(code, 2, "{m} {fault}: {out}{err}");
    }
}

#[test]
fn rope_neox_on_a_neox_model_swaps_to_interleaved() {
    // MiniCPM3's main RoPE is NeoX; the fault applies the other pairing and the detector says so.
    let want: Vec<_> = ALL4.iter().map(|p| (*p, "rope-style", "L1.q_pe_roped")).collect();
    let f = expect(
        &["--model", &model("minicpm3-q8_0.gguf"), "--inject", "rope-neox"],
        &want,
    );
    assert!(f[0]["evidence"].as_str().unwrap().contains("interleaved rotation"));
}

/// The `o_proj` all-reduce's faults, injected in the per-rank collective of simulated TP: twice is
/// a pure × tp scale, a skipped rank and an early read name the rank, all at `o_proj` (the
/// partials `o_proj.rank<r>` before the collective pass).
#[test]
fn all_reduce_faults_are_named_at_o_proj() {
    let want: Vec<_> = ALL4.iter().map(|p| (*p, "scale-only", "L1.o_proj")).collect();
    let f = expect(&["--inject", "all-reduce-twice", "--tp", "2"], &want);
    let ev = f[0]["evidence"].as_str().unwrap();
    assert!(ev.contains("norm ratio 2.0000"), "{ev}");
    assert!(f[0]["hint"].as_str().unwrap().contains("applied twice"), "{f:#?}");
    let f = expect(&["--inject", "all-reduce-twice", "--tp", "3"], &want);
    assert!(
        f[0]["evidence"].as_str().unwrap().contains("norm ratio 3.0000"),
        "{f:#?}"
    );

    let want: Vec<_> = ALL4.iter().map(|p| (*p, "tp-reduce", "L1.o_proj")).collect();
    let f = expect(&["--inject", "all-reduce-skip-rank", "--tp", "3"], &want);
    for x in &f {
        let ev = x["evidence"].as_str().unwrap();
        assert!(
            ev.contains("every rank but rank 2") && ev.contains("missing from the all-reduce"),
            "{ev}"
        );
    }
    let f = expect(&["--inject", "all-reduce-read-early", "--tp", "3"], &want);
    for x in &f {
        let ev = x["evidence"].as_str().unwrap();
        assert!(ev.contains("rank 0's reference o_proj partial alone"), "{ev}");
    }
    // At tp = 2 the two readings are one: rank 1 missing is rank 0 alone, and the evidence says so.
    let f = expect(&["--inject", "all-reduce-read-early", "--tp", "2"], &want);
    let ev = f[0]["evidence"].as_str().unwrap();
    assert!(
        ev.contains("every rank but rank 1") && ev.contains("rank 0's partial alone"),
        "{ev}"
    );
}

/// One rank has nothing to reduce: the collective faults are refused without TP.
#[test]
fn all_reduce_faults_need_tp() {
    let (code, _out, err) = run_bin(&["run", "--layer", "1", "--inject", "all-reduce-skip-rank"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("needs --tp ≥ 2"), "{err}");
}

/// The paged-cache faults on the paths that read a paged cache, on a batch of several pages and
/// a shuffled block table: `paged-kv`, the evidence naming the mechanism the replay reproduced;
/// `mha` keeps no cache (a note, not a finding).
#[test]
fn paged_cache_faults_are_paged_kv_with_the_mechanism() {
    let want = [
        ("mqa", "paged-kv", "L1.attn_latent"),
        ("chunked", "paged-kv", "L1.lse"),
        ("mixed", "paged-kv", "L1.lse"),
    ];
    for (fault, what) in [
        ("paged-kv-page-size", "read with page size 1, written with 16"),
        (
            "paged-kv-block-offset",
            "block table shifted by +1 entry (page size 16)",
        ),
        ("slot-mapping-offset", "rows written 1 slot early (slot mapping -1)"),
    ] {
        let f = expect(&["--inject", fault, "--seqs", "1,15,16,17,53"], &want);
        assert!(!f.iter().any(|x| x["path"] == "mha"), "{fault}: {f:#?}");
        for x in &f {
            let ev = x["evidence"].as_str().unwrap();
            // mixed decodes the last token of short sequences, whose misreads land on slots no
            // row was written to under several mechanisms alike: the evidence says so.
            let tied = x["path"] == "mixed" && ev.contains("these rows are also what");
            assert!(ev.contains(what) || tied, "{fault} {}: {ev}", x["path"]);
            assert!(
                ev.contains("rebuilt from the path's own kv_c_normed ‖ k_pe_roped rows"),
                "{ev}"
            );
        }
    }
    // At page size 1 the block ids are the token slots: nothing to act on, said in a note.
    let (code, out, err) = run_bin(&[
        "run",
        "--layer",
        "1",
        "--page-size",
        "1",
        "--inject",
        "paged-kv-page-size",
        "--path",
        "mqa",
    ]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(
        format!("{out}{err}").contains("paged-kv-page-size: at page size 1"),
        "{out}{err}"
    );
}

/// kv_b split variants the loader builds: each head's halves exchanged where P = V (yarn-v3),
/// the heads interleaved by 2 (the embedded fixture's 6 heads): `kv-b-layout` at the first
/// weight site, naming the variant; the swap is refused where P ≠ V.
#[test]
fn kv_b_split_variants_are_kv_b_layout() {
    let want = [
        ("mha", "kv-b-layout", "L1.w.kv_b"),
        ("mqa", "kv-b-layout", "L1.w.W_UK_T"),
        ("chunked", "kv-b-layout", "L1.w.kv_b"),
        ("mixed", "kv-b-layout", "L1.w.kv_b"),
    ];
    let m = model("yarn-v3-f32.gguf");
    let f = expect(&["--model", &m, "--inject", "kv-b-halves-swapped"], &want);
    for x in &f {
        let ev = x["evidence"].as_str().unwrap();
        assert!(ev.contains("the halves exchanged (P = V = 32; rel_l2 0 vs"), "{ev}");
    }
    let f = expect(&["--inject", "kv-b-heads-interleaved"], &want);
    for x in &f {
        let ev = x["evidence"].as_str().unwrap();
        assert!(
            ev.contains("heads are interleaved by 2: order 0, 3, 1, 4, 2, 5 (rel_l2 0 vs"),
            "{ev}"
        );
    }
    let (code, out, err) = run_bin(&["run", "--layer", "1", "--inject", "kv-b-halves-swapped"]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(err.contains("needs P = V"), "{err}");
}
