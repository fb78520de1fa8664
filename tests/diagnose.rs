//! Each detector on real traces of the embedded fixture: it explains the fault it is for, and
//! stays silent on another fault's divergence. These run the whole pipeline (reference, a CPU
//! path with a fault, the metrics), so they live with the integration tests.

use mla_diff::backend::run_cpu;
use mla_diff::compute::faults::{Fault, FaultSet};
use mla_diff::compute::path::{LayerInput, PathKind, PathOptions, PathRun};
use mla_diff::compute::reference::reference_layer;
use mla_diff::core::batch::Batch;
use mla_diff::core::class::Class;
use mla_diff::core::dtype::Dtype;
use mla_diff::core::trace::{Site, Stage, Trace};
use mla_diff::judge::diagnose::{Detection, DiagnoseInput, PathEvidence, detect_at, diagnose};
use mla_diff::judge::metrics::{self, SiteDiff};
use mla_diff::judge::tolerance::Precision;
use mla_diff::model::config::MlaConfig;
use mla_diff::model::gguf::GgufFile;
use mla_diff::model::weights::LayerWeights;

struct Fixture {
    cfg: MlaConfig,
    batch: Batch,
    reference: Trace,
    runs: Vec<PathRun>,
    diffs: Vec<Vec<SiteDiff>>,
    tp: usize,
}

fn fixture_with(faults: &[Fault], tp: usize, paths: &[PathKind], tweak: impl Fn(&mut MlaConfig)) -> Fixture {
    let file: GgufFile = mla_diff::model::fixture::open_model(None).unwrap();
    let cfg = MlaConfig::from_gguf(&file).unwrap();
    let w = LayerWeights::load(&file, &cfg, 1).unwrap();
    let batch = Batch {
        seqs: [1usize, 15, 16, 17, 21]
            .iter()
            .map(|&len| mla_diff::core::batch::SeqSpec { len, start_pos: 0 })
            .collect(),
    };
    let t = batch.n_tokens();
    let hidden = ndarray::Array2::from_shape_vec(
        (t, cfg.hidden),
        mla_diff::core::batch::normal_f32(3, t * cfg.hidden)
            .into_iter()
            .map(f64::from)
            .collect(),
    )
    .unwrap();
    let reference = reference_layer(&cfg, &w, &hidden, &batch, tp, None).unwrap().trace;
    let mut path_cfg = cfg.clone();
    tweak(&mut path_cfg);
    let h32 = hidden.mapv(|x| x as f32);
    let input = LayerInput {
        file: &file,
        cfg: &path_cfg,
        weights: &w,
        hidden_in: &h32,
        batch: &batch,
        shared_selection: None,
        forced_selection: None,
        dequantized: None,
    };
    let opts = PathOptions {
        tp,
        faults: FaultSet(faults.to_vec()),
        ..PathOptions::default()
    };
    let runs: Vec<PathRun> = paths.iter().map(|&p| run_cpu(p, &input, &opts).unwrap()).collect();
    let diffs = runs
        .iter()
        .map(|r| metrics::diff(&reference, &r.trace, Dtype::F32))
        .collect();
    Fixture {
        cfg,
        batch,
        reference,
        runs,
        diffs,
        tp,
    }
}

fn fixture(faults: &[Fault], tp: usize, paths: &[PathKind]) -> Fixture {
    fixture_with(faults, tp, paths, |_| {})
}

/// Runs the detector of `class` alone on path `i`'s first divergence.
fn detect(fx: &Fixture, i: usize, class: Class) -> Option<Detection> {
    let input = DiagnoseInput {
        cfg: &fx.cfg,
        batch: &fx.batch,
        reference: &fx.reference,
        paths: fx.runs.iter().zip(&fx.diffs).map(|(r, d)| evidence(r, d)).collect(),
        tp: fx.tp,
        precision: Precision::F32,
        dump: None,
        model: None,
    };
    assert!(
        metrics::first_divergence(&fx.diffs[i]).is_some(),
        "the fault makes a divergence"
    );
    detect_at(&input, i, class)
}

#[test]
fn clean_runs_have_no_divergence_to_diagnose() {
    let fx = fixture(&[], 2, PathKind::ALL);
    for d in &fx.diffs {
        assert!(metrics::first_divergence(d).is_none());
    }
}

#[test]
fn phantom_output_sees_the_untouched_canary() {
    let fx = fixture(&[Fault::PhantomOutput], 1, &[PathKind::Mqa]);
    let Detection { evidence: ev, .. } = detect(&fx, 0, Class::PhantomOutput).unwrap();
    assert!(ev.contains("canary"), "{ev}");
    let fx = fixture(&[Fault::RopeNeox], 1, &[PathKind::Mha]);
    assert!(detect(&fx, 0, Class::PhantomOutput).is_none());
}

#[test]
fn unwritten_rows_names_the_rows() {
    let fx = fixture(&[Fault::UnwrittenRows], 1, &[PathKind::Chunked]);
    let Detection { evidence: ev, .. } = detect(&fx, 0, Class::UnwrittenRows).unwrap();
    assert!(ev.contains("in token rows [0]"), "{ev}");
    // lse-plus-inf reads an unwritten partial too, but through a wrong sentinel: not this.
    let fx = fixture(&[Fault::LsePlusInf], 1, &[PathKind::Mqa]);
    assert!(detect(&fx, 0, Class::UnwrittenRows).is_none());
}

#[test]
fn shard_order_reports_the_permutation() {
    let fx = fixture(&[Fault::FusedShardSwap], 1, &[PathKind::Mha]);
    let Detection { evidence: ev, hint } = detect(&fx, 0, Class::ShardOrder).unwrap();
    assert!(ev.contains("in order [1,0]"), "{ev}");
    assert!(hint.contains("shard id"), "{hint}");
    let fx = fixture(&[Fault::StridedKvC], 1, &[PathKind::Mha]);
    assert!(detect(&fx, 0, Class::ShardOrder).is_none());
}

#[test]
fn tp_rank_order_reports_permutation_and_duplicate() {
    let fx = fixture(&[Fault::TpRankOrder], 3, &[PathKind::Mha]);
    let Detection { evidence: ev, .. } = detect(&fx, 0, Class::TpRankOrder).unwrap();
    assert!(ev.contains("[1,2,0]"), "{ev}");
    let fx = fixture(&[Fault::TpRank0Everywhere], 2, &[PathKind::Mqa]);
    let Detection { evidence: ev, .. } = detect(&fx, 0, Class::TpRankOrder).unwrap();
    assert!(ev.contains("rank 0 everywhere"), "{ev}");
    let fx = fixture(&[Fault::RopeNeox], 2, &[PathKind::Mha]);
    assert!(detect(&fx, 0, Class::TpRankOrder).is_none());
}

#[test]
fn kv_b_layout_tells_grouped_from_untransposed() {
    let fx = fixture(&[Fault::KvBGrouped], 2, &[PathKind::Mha, PathKind::Mqa]);
    assert!(detect(&fx, 0, Class::KvBLayout).unwrap().evidence.contains("grouped"));
    assert!(detect(&fx, 1, Class::KvBLayout).unwrap().evidence.contains("grouped"));
    let fx = fixture(&[Fault::KBUntransposed], 1, &[PathKind::Mha, PathKind::Mqa]);
    assert!(
        detect(&fx, 0, Class::KvBLayout)
            .unwrap()
            .evidence
            .contains("instead of transposed")
    );
    assert!(
        detect(&fx, 1, Class::KvBLayout)
            .unwrap()
            .evidence
            .contains("instead of transposed")
    );
    let fx = fixture(&[Fault::PhantomOutput], 1, &[PathKind::Mha]);
    assert!(detect(&fx, 0, Class::KvBLayout).is_none());
}

#[test]
fn rope_style_re_rotates_with_neox() {
    let fx = fixture(&[Fault::RopeNeox], 1, &[PathKind::Mqa]);
    let Detection { evidence: ev, .. } = detect(&fx, 0, Class::RopeStyle).unwrap();
    assert!(ev.contains("NeoX"), "{ev}");
    let fx = fixture(&[Fault::StridedKvC], 1, &[PathKind::Mqa]);
    assert!(detect(&fx, 0, Class::RopeStyle).is_none());
}

#[test]
fn softmax_scale_fits_the_factor() {
    // The path runs with half the softmax scale; the reference with the right one.
    let fx = fixture_with(&[], 1, &[PathKind::Mha, PathKind::Mqa], |c| c.softmax_scale *= 0.5);
    for i in 0..2 {
        let Detection { evidence: ev, .. } = detect(&fx, i, Class::SoftmaxScale).unwrap();
        assert!(ev.contains("×0.500"), "{ev}");
    }
    let fx = fixture(&[Fault::PhantomOutput], 1, &[PathKind::Mha]);
    assert!(detect(&fx, 0, Class::SoftmaxScale).is_none());
}

#[test]
fn lse_merge_ties_bad_rows_to_empty_partials() {
    let fx = fixture(&[Fault::LsePlusInf], 1, &[PathKind::Chunked, PathKind::Mqa]);
    // Chunked prefill: the rows the path recorded as merging an empty context chunk.
    let Detection { evidence: ev, .. } = detect(&fx, 0, Class::LseMerge).unwrap();
    assert!(ev.contains("merged an empty partial"), "{ev}");
    // The split-KV decode: its replay with the empty splits merged at LSE +inf.
    let Detection { evidence: ev, .. } = detect(&fx, 1, Class::LseMerge).unwrap();
    assert!(
        ev.contains("K = 4 splits per row") && ev.contains("empty split merged as if it had keys, with LSE +inf"),
        "{ev}"
    );
    let fx = fixture(&[Fault::RopeNeox], 1, &[PathKind::Mqa]);
    assert!(detect(&fx, 0, Class::LseMerge).is_none());
}

/// Each `split-*` fault on the split-KV decode (every row of `mqa`, the decode rows of `mixed`)
/// is named by the replay's rule at the path's split count (4, searched), with the replay far
/// below the error as is; another attention fault is not.
#[test]
fn lse_merge_replays_the_split_kv_merge() {
    for (fault, rule) in [
        (
            Fault::SplitLseBase2,
            "each split's LSE in base 2, merged as natural log",
        ),
        (Fault::SplitDropped, "split 3 of 4 lost from the merge"),
        (Fault::SplitDuplicated, "split 0 of 4 merged twice"),
        (Fault::SplitEmptyZero, "with LSE 0 and a zero output"),
    ] {
        let fx = fixture(&[fault], 1, &[PathKind::Mqa, PathKind::Mixed]);
        for (i, site) in [(0, "attn_latent"), (1, "attn_out")] {
            let Detection { evidence: ev, hint } = detect(&fx, i, Class::LseMerge).unwrap();
            assert!(ev.contains(rule), "{fault}: {ev}");
            assert!(
                ev.contains("K = 4 splits per row (searched: no num_kv_splits recorded)"),
                "{fault}: {ev}"
            );
            assert!(
                ev.contains(&format!("a replay of the split-KV decode explains {site}")),
                "{ev}"
            );
            // The replay's error against the as-is one: f32 rounding against an O(0.1) error.
            let e: f64 = ev
                .split(&format!("{site} rel_l2 "))
                .nth(1)
                .and_then(|r| r.split(' ').next())
                .unwrap()
                .parse()
                .unwrap();
            assert!(e < 1e-5, "{fault}: {ev}");
            assert!(!hint.is_empty());
        }
    }
    // Stale finite states in the empty splits: no replay, the footprint.
    let fx = fixture(&[Fault::SplitEmptyFinite], 1, &[PathKind::Mqa]);
    let Detection { evidence: ev, .. } = detect(&fx, 0, Class::LseMerge).unwrap();
    assert!(
        ev.contains("all have an empty split at K = 4") && ev.contains("with a finite stale LSE and output"),
        "{ev}"
    );
    for f in [Fault::PhantomOutputStale, Fault::KvBGrouped, Fault::RopeNeox] {
        let fx = fixture(&[f], 1, &[PathKind::Mqa, PathKind::Mixed]);
        for i in 0..2 {
            let d = detect(&fx, i, Class::LseMerge);
            assert!(d.is_none(), "{f}: {d:?}");
        }
    }
    // A wrong softmax scale reweights every row's keys: no merge of splits explains it.
    let fx = fixture_with(&[], 1, &[PathKind::Mqa], |c| c.softmax_scale *= 0.5);
    let d = detect(&fx, 0, Class::LseMerge);
    assert!(d.is_none(), "{d:?}");
}

#[test]
fn lse_merge_names_a_base_2_lse() {
    // A clean trace whose lse is then given in base 2 (×1/ln 2), or a base-2 LSE read as natural
    // log (×ln 2): a log-base mix-up, named before the scale-only fallback.
    for (f, word) in [
        (1.0 / std::f32::consts::LN_2, "log2"),
        (std::f32::consts::LN_2, "read as natural log"),
    ] {
        let mut fx = fixture(&[], 1, &[PathKind::Mha]);
        let site = Site::new(1, Stage::Lse);
        let mut t = fx.runs[0].trace.get(&site).unwrap().clone();
        if let mla_diff::core::trace::TensorData::F32(v) = &mut t.data {
            v.iter_mut().for_each(|x| *x *= f);
        }
        fx.runs[0].trace.record(site, t);
        fx.diffs[0] = metrics::diff(&fx.reference, &fx.runs[0].trace, Dtype::F32);
        let Detection { evidence: ev, .. } = detect(&fx, 0, Class::LseMerge).unwrap();
        assert!(ev.contains(word), "{ev}");
    }
}

#[test]
fn nonfinite_counts_nans_that_are_not_canaries() {
    let fx = fixture(&[Fault::LsePlusInf], 1, &[PathKind::Chunked]);
    let Detection { evidence: ev, .. } = detect(&fx, 0, Class::Nonfinite).unwrap();
    assert!(ev.contains("NaN/Inf where the reference is finite"), "{ev}");
    let fx = fixture(&[Fault::RopeNeox], 1, &[PathKind::Mha]);
    assert!(detect(&fx, 0, Class::Nonfinite).is_none());
}

#[test]
fn scale_only_sees_what_cosine_cannot() {
    // A clean trace whose q_pe_roped is scaled by 1.3 afterwards (a detector unit test).
    let mut fx = fixture(&[], 1, &[PathKind::Mha]);
    let site = Site::new(1, Stage::QPeRoped);
    let mut t = fx.runs[0].trace.get(&site).unwrap().clone();
    if let mla_diff::core::trace::TensorData::F32(v) = &mut t.data {
        v.iter_mut().for_each(|x| *x *= 1.3);
    }
    fx.runs[0].trace.record(site, t);
    fx.diffs[0] = metrics::diff(&fx.reference, &fx.runs[0].trace, Dtype::F32);
    let Detection { evidence: ev, .. } = detect(&fx, 0, Class::ScaleOnly).unwrap();
    assert!(ev.contains("norm ratio 1.3000"), "{ev}");
    let fx = fixture(&[Fault::RopeNeox], 1, &[PathKind::Mha]);
    assert!(detect(&fx, 0, Class::ScaleOnly).is_none());
}

#[test]
fn path_disagreement_needs_another_path_passing() {
    // mha clean, mqa with the strided norm bug: only mqa fails kv_c_normed.
    let clean = fixture(&[], 1, &[PathKind::Mha]);
    let broken = fixture(&[Fault::StridedKvC], 1, &[PathKind::Mqa]);
    let fx = Fixture {
        runs: vec![clean.runs[0].clone(), broken.runs[0].clone()],
        diffs: vec![clean.diffs[0].clone(), broken.diffs[0].clone()],
        ..clean
    };
    let Detection { evidence: ev, .. } = detect(&fx, 1, Class::PathDisagreement).unwrap();
    assert!(ev.contains("mha (rel_l2"), "{ev}");
    // The same bug in both paths disagrees with nobody.
    let fx = fixture(&[Fault::StridedKvC], 1, &[PathKind::Mha, PathKind::Mqa]);
    assert!(detect(&fx, 1, Class::PathDisagreement).is_none());
}

/// A row-stride signature no stride of the strided-view set explains (the strided-kv-c
/// rows past the first moved 1 % further) is `mismatch`, with the rows localised.
#[test]
fn mismatch_localises_rows() {
    let fx = fixture(&[Fault::StridedKvC], 1, &[PathKind::Mha]);
    let site = Site::new(1, Stage::KvCNormed);
    let mut trace = fx.runs[0].trace.clone();
    let t = trace.get(&site).unwrap();
    let l = fx.cfg.kv_lora_rank;
    let moved: Vec<f64> = t
        .to_f64()
        .iter()
        .enumerate()
        .map(|(i, &v)| if i < l { v } else { v * 1.01 })
        .collect();
    trace.record(site, mla_diff::core::trace::TraceTensor::f64(t.shape.clone(), moved));
    let diffs = metrics::diff(&fx.reference, &trace, Dtype::F32);
    let input = DiagnoseInput {
        cfg: &fx.cfg,
        batch: &fx.batch,
        reference: &fx.reference,
        paths: vec![PathEvidence {
            kind: PathKind::Mha.into(),
            trace: &trace,
            diffs: &diffs,
            empty_partial_rows: &[],
            unservable: None,
            paged: fx.runs[0].paged.as_ref(),
        }],
        tp: 1,
        precision: Precision::F32,
        dump: None,
        model: None,
    };
    let f = diagnose(&input);
    assert_eq!(f.len(), 1);
    assert_eq!(f[0].class, Class::Mismatch);
    assert!(f[0].evidence.contains("rows [0] exact"), "{}", f[0].evidence);
    assert!(f[0].hint.contains("row stride"), "{}", f[0].hint);
}

/// What the detectors see of one path's run: its trace, diffs and the records it keeps.
fn evidence<'a>(r: &'a mla_diff::compute::path::PathRun, diffs: &'a [SiteDiff]) -> PathEvidence<'a> {
    PathEvidence {
        kind: r.kind.into(),
        trace: &r.trace,
        diffs,
        empty_partial_rows: &r.empty_partial_rows,
        unservable: r.unservable.as_ref(),
        paged: r.paged.as_ref(),
    }
}

/// Layer 1 of the fixture `model` with the selftest batch at page 16, every path at TP 1 in
/// `dtype` with `faults`, as `run` computes it (the DSA selection forced in bf16): the config,
/// batch, reference and each path's run with its diffs.
fn runs_of(
    model: &str,
    dtype: Dtype,
    faults: &[Fault],
) -> (
    MlaConfig,
    Batch,
    Trace,
    Vec<(mla_diff::compute::path::PathRun, Vec<SiteDiff>)>,
) {
    use mla_diff::backend::Backend;
    use mla_diff::backend::cuda::compare::SplitTrace;
    let file = GgufFile::open(crate::common::repo().join("golden/models").join(model)).unwrap();
    let cfg = MlaConfig::from_gguf(&file).unwrap();
    let w = LayerWeights::load(&file, &cfg, 1).unwrap();
    let batch = mla_diff::jobs::selftest::selftest_batch(16);
    let t = batch.n_tokens();
    let hidden = ndarray::Array2::from_shape_vec(
        (t, cfg.hidden),
        mla_diff::core::batch::normal_f32(16, t * cfg.hidden)
            .into_iter()
            .map(f64::from)
            .collect(),
    )
    .unwrap();
    let reference = mla_diff::compute::reference::forward(&cfg, &w, &hidden, &batch)
        .unwrap()
        .trace;
    let rc = mla_diff::judge::report::RunConfig {
        layers: vec![1],
        batch: batch.clone(),
        seed: 0,
        input: mla_diff::judge::report::InputMode::Random,
        paths: PathKind::ALL.to_vec(),
        path_options: PathOptions {
            faults: FaultSet(faults.to_vec()),
            ..PathOptions::default()
        },
        backend: "cpu".into(),
    };
    let backend = Backend::Cpu(mla_diff::backend::cpu::CpuOps::new(dtype));
    let split = SplitTrace {
        host: reference.clone(),
        device: Vec::new(),
    };
    let (results, _, runs) =
        mla_diff::jobs::run::compare_layer(&backend, &file, &cfg, &w, &hidden, &split, &rc, None, None, true, &[])
            .unwrap();
    let runs = runs.into_iter().zip(results.into_iter().map(|r| r.diffs)).collect();
    (cfg, batch, reference, runs)
}

/// The phantom-output hypothesis at an attention output of every path of `model` in `dtype`
/// with `faults`: per (path, stage), whether it explains the site, and its evidence.
fn phantom_at_outputs(model: &str, dtype: Dtype, faults: &[Fault]) -> Vec<(PathKind, Stage, Option<String>)> {
    let (cfg, batch, reference, runs) = runs_of(model, dtype, faults);
    let input = DiagnoseInput {
        cfg: &cfg,
        batch: &batch,
        reference: &reference,
        paths: runs.iter().map(|(r, d)| evidence(r, d)).collect(),
        tp: 1,
        precision: dtype.into(),
        dump: None,
        model: None,
    };
    let mut out = Vec::new();
    for (i, (r, _)) in runs.iter().enumerate() {
        for st in [Stage::AttnOut, Stage::AttnLatent] {
            if r.trace.get(&Site::new(1, st)).is_some() {
                let d = mla_diff::judge::diagnose::detect_at_site(&input, i, Site::new(1, st), Class::PhantomOutput);
                out.push((r.kind, st, d.map(|d| d.evidence)));
            }
        }
    }
    out
}

/// A clean attention output lies within the range of the value rows its token attends to, to the
/// precision's rounding, on every path in f32 and bf16 (with and without a query LoRA, a DSA
/// selection, YaRN, a legacy kv_b, MiniCPM3's NeoX RoPE): the hull test that names stale memory
/// `phantom-output` holds nothing against a written output. Stale floats of the output's own
/// RMS in the buffer (`phantom-output-stale`) fall outside it on every path.
#[test]
fn attention_outputs_stay_in_their_value_rows_range() {
    for model in [
        "tiny-v3-q8_0.gguf",
        "lite-v2-q8_0.gguf",
        "dsa-glm-q8_0.gguf",
        "minicpm3-f32.gguf",
        "legacy-kvb-f32.gguf",
    ] {
        for dtype in [Dtype::F32, Dtype::Bf16] {
            let clean = phantom_at_outputs(model, dtype, &[]);
            assert_eq!(clean.iter().filter(|c| c.1 == Stage::AttnOut).count(), 4, "{model}");
            assert!(
                clean.iter().any(|c| c.0 == PathKind::Mqa && c.1 == Stage::AttnLatent),
                "{model}"
            );
            for (path, st, found) in clean {
                assert!(found.is_none(), "{model} {dtype:?} {path:?} {}: {found:?}", st.name());
            }
        }
        let stale = phantom_at_outputs(model, Dtype::Bf16, &[Fault::PhantomOutputStale]);
        for (path, st, found) in stale {
            if st == Stage::AttnOut {
                let ev = found.unwrap_or_else(|| panic!("{model} {path:?}: stale attn_out not found"));
                assert!(ev.contains("lie outside the range of the"), "{ev}");
            } else {
                assert!(found.is_none(), "{model} {path:?}: attn_latent was written: {found:?}");
            }
        }
    }
}

/// Path `i`'s tensor at `stage` of layer 1, as f64.
fn site_values(fx: &Fixture, i: usize, stage: Stage) -> Vec<f64> {
    fx.runs[i].trace.get(&Site::new(1, stage)).unwrap().to_f64()
}

/// Replaces path `i`'s tensor at `stage` of layer 1 with `v` (same shape) and re-judges it.
fn replace_site(fx: &mut Fixture, i: usize, stage: Stage, v: Vec<f64>) {
    let site = Site::new(1, stage);
    let shape = fx.runs[i].trace.get(&site).unwrap().shape.clone();
    let t = mla_diff::core::trace::TraceTensor::f32(shape, v.into_iter().map(|x| x as f32).collect());
    fx.runs[i].trace.record(site, t);
    fx.diffs[i] = metrics::diff(&fx.reference, &fx.runs[i].trace, Dtype::F32);
}

/// The diagnosis of path `i` as `precision` judges it, through every detector.
fn diagnose_as(fx: &Fixture, precision: Precision) -> Vec<mla_diff::judge::diagnose::Finding> {
    diagnose(&DiagnoseInput {
        cfg: &fx.cfg,
        batch: &fx.batch,
        reference: &fx.reference,
        paths: fx.runs.iter().zip(&fx.diffs).map(|(r, d)| evidence(r, d)).collect(),
        tp: fx.tp,
        precision,
        dump: None,
        model: None,
    })
}

/// `residual-scaled` (the residual operand of the layer's add × 0.4) is found at `ffn_in` with
/// α = 0.4 on every path; at `hidden_out` (a dump without `ffn_in`'s change: the FFN's add
/// scaled) the least-squares fit gives α; a pure scale of `hidden_out` stays `scale-only`; on a
/// clean run the hypothesis holds nothing at either site.
#[test]
fn residual_scale_fits_the_residual_factor() {
    let fx = fixture(&[Fault::ResidualScaled], 1, PathKind::ALL);
    for i in 0..4 {
        let Detection { evidence: ev, hint } = detect(&fx, i, Class::ResidualScale).unwrap();
        assert!(ev.starts_with("ffn_in = RMSNorm(α·hidden_in + o_proj)"), "{ev}");
        assert!(ev.contains("α = 0.4000"), "{ev}");
        assert!(hint.contains("#14809"), "{hint}");
    }
    // hidden_out = ffn_out + 0.5·(hidden_in + o_proj), every other site right.
    let mut fx = fixture(&[], 1, &[PathKind::Mha]);
    let (hin, o, f) = (
        site_values(&fx, 0, Stage::HiddenIn),
        site_values(&fx, 0, Stage::OProj),
        site_values(&fx, 0, Stage::FfnOut),
    );
    let out: Vec<f64> = (0..hin.len()).map(|j| f[j] + 0.5 * (hin[j] + o[j])).collect();
    replace_site(&mut fx, 0, Stage::HiddenOut, out);
    let Detection { evidence: ev, .. } = detect(&fx, 0, Class::ResidualScale).unwrap();
    assert!(ev.starts_with("hidden_out = α·h1 + FFN output"), "{ev}");
    assert!(
        ev.contains("α = 0.5000") && ev.contains("the model has no MoE layer"),
        "{ev}"
    );
    // A pure scale of hidden_out is scale-only's.
    let mut fx = fixture(&[], 1, &[PathKind::Mha]);
    let out: Vec<f64> = site_values(&fx, 0, Stage::HiddenOut).iter().map(|v| v * 1.3).collect();
    replace_site(&mut fx, 0, Stage::HiddenOut, out);
    assert!(detect(&fx, 0, Class::ResidualScale).is_none());
    assert_eq!(diagnose_as(&fx, Precision::F32)[0].class, Class::ScaleOnly);
    // Clean: nothing at either site, f32 and bf16.
    for dtype in [Dtype::F32, Dtype::Bf16] {
        let (cfg, batch, reference, runs) = runs_of("tiny-v3-q8_0.gguf", dtype, &[]);
        let input = DiagnoseInput {
            cfg: &cfg,
            batch: &batch,
            reference: &reference,
            paths: runs.iter().map(|(r, d)| evidence(r, d)).collect(),
            tp: 1,
            precision: dtype.into(),
            dump: None,
            model: None,
        };
        for (i, (run, _)) in runs.iter().enumerate() {
            for st in [Stage::FfnIn, Stage::HiddenOut] {
                let d = mla_diff::judge::diagnose::detect_at_site(&input, i, Site::new(1, st), Class::ResidualScale);
                assert!(d.is_none(), "{dtype:?} {} {}: {d:?}", run.kind, st.name());
            }
        }
    }
}

/// `ql_nope` as a half-precision GEMM on the CPU computes it (f16 operands, an f32 sum, an f16
/// result), from the path's own `q` and `w.W_UK_T`.
fn ql_nope_f16_output(fx: &Fixture, i: usize, narrow: fn(f64) -> f64) -> Vec<f64> {
    let [n, l, p, r, _] = fx.cfg.dims().nlprv();
    let (q, w) = (site_values(fx, i, Stage::Q), site_values(fx, i, Stage::WUkT));
    let t = q.len() / (n * (p + r));
    let mut out = vec![0.0; t * n * l];
    for ti in 0..t {
        for h in 0..n {
            for j in 0..l {
                let s: f64 = (0..p)
                    .map(|d| narrow(q[(ti * n + h) * (p + r) + d]) * narrow(w[(h * p + d) * l + j]))
                    .sum();
                out[(ti * n + h) * l + j] = narrow(s);
            }
        }
    }
    out
}

/// `fp16-accum-ql-nope` is `precision` with the f16 accumulator; a half-precision product with an
/// f32 sum is `precision` with its output rounding; noise of the same size is not; a bf16
/// product is not `precision` where the run declares bf16 outputs (the engine-bf16 rows).
#[test]
fn precision_replays_the_narrow_product() {
    let fx = fixture(&[Fault::Fp16AccumQlNope], 1, &[PathKind::Mqa]);
    let Detection { evidence: ev, hint } = detect(&fx, 0, Class::Precision).unwrap();
    assert!(
        ev.contains("inputs rounded to f16 and the running sum rounded to f16 after every term"),
        "{ev}"
    );
    assert!(
        ev.contains("rel_l2 0 vs") && ev.contains("the run declares f32"),
        "{ev}"
    );
    assert!(hint.contains("#13137"), "{hint}");
    let f16 = |v: f64| half::f16::from_f64(v).to_f64();
    let bf16 = |v: f64| half::bf16::from_f64(v).to_f64();
    let mut fx = fixture(&[], 1, &[PathKind::Mqa]);
    let out = ql_nope_f16_output(&fx, 0, f16);
    replace_site(&mut fx, 0, Stage::QlNope, out);
    let Detection { evidence: ev, .. } = detect(&fx, 0, Class::Precision).unwrap();
    assert!(ev.contains("inputs and output rounded to f16"), "{ev}");
    // Seeded noise of the f16 error's size: not a narrow product.
    let mut fx = fixture(&[], 1, &[PathKind::Mqa]);
    let clean = site_values(&fx, 0, Stage::QlNope);
    let rms = (clean.iter().map(|v| v * v).sum::<f64>() / clean.len() as f64).sqrt();
    let noise = mla_diff::core::batch::normal_f32(5, clean.len());
    let noisy: Vec<f64> = clean
        .iter()
        .zip(noise)
        .map(|(v, e)| v + 4e-4 * rms * f64::from(e))
        .collect();
    replace_site(&mut fx, 0, Stage::QlNope, noisy);
    assert!(detect(&fx, 0, Class::Precision).is_none());
    // A bf16 product: precision under f32, the declared rounding under the engine-bf16 rows.
    let mut fx = fixture(&[], 1, &[PathKind::Mqa]);
    let out = ql_nope_f16_output(&fx, 0, bf16);
    replace_site(&mut fx, 0, Stage::QlNope, out);
    let f = diagnose_as(&fx, Precision::F32);
    assert_eq!(f[0].class, Class::Precision, "{:?}", f[0]);
    assert!(
        f[0].evidence.contains("inputs and output rounded to bf16"),
        "{}",
        f[0].evidence
    );
    let input = DiagnoseInput {
        cfg: &fx.cfg,
        batch: &fx.batch,
        reference: &fx.reference,
        paths: vec![PathEvidence {
            kind: fx.runs[0].kind.into(),
            trace: &fx.runs[0].trace,
            diffs: &fx.diffs[0],
            empty_partial_rows: &[],
            unservable: None,
            paged: None,
        }],
        tp: 1,
        precision: Precision::EngineBf16,
        dump: None,
        model: None,
    };
    let d = mla_diff::judge::diagnose::detect_at_site(&input, 0, Site::new(1, Stage::QlNope), Class::Precision);
    assert!(d.is_none(), "{d:?}");
}

/// `q_pe` cut out of `q` with a per-head stride of P instead of P+R (head 0 right, every later
/// head read from the wrong place), then rotated: `strided-view` at `q_pe_roped` naming the head
/// stride, not `rope-style` (the rotation is right) or `mismatch`.
#[test]
fn strided_view_replays_q_pe_cut_with_another_head_stride() {
    let mut fx = fixture(&[], 1, &[PathKind::Mha]);
    let cfg = fx.cfg.clone();
    let [n, _, p, r, _] = cfg.dims().nlprv();
    let q = fx.runs[0].trace.get(&Site::new(1, Stage::Q)).unwrap().to_f64();
    let t = q.len() / (n * (p + r));
    let positions = fx.batch.positions();
    let inv = mla_diff::compute::reference::rope_inv_freq(&cfg);
    let mut cut = Vec::with_capacity(t * n * r);
    for (ti, &pos) in positions.iter().enumerate() {
        for h in 0..n {
            let start = ti * n * (p + r) + h * p + p;
            let mut seg = q[start..start + r].to_vec();
            mla_diff::compute::indexer::rope_f64(&mut seg, pos, &inv, cfg.rope_style);
            cut.extend(seg);
        }
    }
    fx.runs[0].trace.record(
        Site::new(1, Stage::QPeRoped),
        mla_diff::core::trace::TraceTensor::f64(vec![t, n, r], cut),
    );
    fx.diffs[0] = metrics::diff(&fx.reference, &fx.runs[0].trace, Dtype::F32);
    let input = DiagnoseInput {
        cfg: &fx.cfg,
        batch: &fx.batch,
        reference: &fx.reference,
        paths: vec![PathEvidence {
            kind: PathKind::Mha.into(),
            trace: &fx.runs[0].trace,
            diffs: &fx.diffs[0],
            empty_partial_rows: &[],
            unservable: None,
            paged: None,
        }],
        tp: 1,
        precision: Precision::F32,
        dump: None,
        model: None,
    };
    let f = diagnose(&input);
    assert_eq!(
        (f[0].class, f[0].site()),
        (Class::StridedView, Some(Site::new(1, Stage::QPeRoped))),
        "{f:?}"
    );
    assert!(
        f[0].evidence.contains(
            "q_pe_roped equals q's 16-wide cut read with head stride 32 (P, q_nope's and k_nope's width) instead of 48 \
             (P+R, q's per-head width), then RoPE"
        ),
        "{}",
        f[0].evidence
    );
}
