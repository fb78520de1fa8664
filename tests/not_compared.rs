//! A failing site whose inputs were not dumped: its hint names them (those the hook writes in
//! another step or layer first, then those never dumped) and calls "passed" only the inputs that
//! were compared and passed; and a skipped RMSNorm behind a `kv_c_normed` that was not dumped is
//! still named `norm-skipped`, at the first compared site after it, by replaying the
//! un-normalized latent through `kv_b_proj` or attention.

use mla_diff::backend::run_cpu;
use mla_diff::compute::faults::{Fault, FaultSet};
use mla_diff::compute::path::{LayerInput, PathKind, PathOptions, PathRun};
use mla_diff::compute::reference::reference_layer;
use mla_diff::core::batch::{Batch, SeqSpec, normal_f32};
use mla_diff::core::class::Class;
use mla_diff::core::dtype::Dtype;
use mla_diff::core::trace::{Site, Stage, Trace, TraceTensor};
use mla_diff::judge::diagnose::{DiagnoseInput, DumpScope, Finding, PathEvidence, diagnose};
use mla_diff::judge::metrics;
use mla_diff::judge::tolerance::Precision;
use mla_diff::model::config::MlaConfig;
use mla_diff::model::gguf::GgufFile;
use mla_diff::model::weights::LayerWeights;

use crate::common::repo;

/// Layer 1 of tiny-v3-q8_0 on seeded inputs: its reference and its paths' runs with `faults`.
struct Layer {
    cfg: MlaConfig,
    batch: Batch,
    reference: Trace,
    runs: Vec<PathRun>,
}

fn layer(faults: &[Fault], paths: &[PathKind]) -> Layer {
    let file = GgufFile::open(repo().join("golden/models/tiny-v3-q8_0.gguf")).unwrap();
    let cfg = MlaConfig::from_gguf(&file).unwrap();
    let w = LayerWeights::load(&file, &cfg, 1).unwrap();
    let batch = Batch {
        seqs: [1usize, 15, 16, 17, 21]
            .iter()
            .map(|&len| SeqSpec { len, start_pos: 0 })
            .collect(),
    };
    let t = batch.n_tokens();
    let hidden = ndarray::Array2::from_shape_vec(
        (t, cfg.hidden),
        normal_f32(5, t * cfg.hidden).into_iter().map(f64::from).collect(),
    )
    .unwrap();
    let reference = reference_layer(&cfg, &w, &hidden, &batch, 1, None).unwrap().trace;
    let h32 = hidden.mapv(|x| x as f32);
    let input = LayerInput {
        file: &file,
        cfg: &cfg,
        weights: &w,
        hidden_in: &h32,
        batch: &batch,
        shared_selection: None,
        forced_selection: None,
        dequantized: None,
    };
    let opts = PathOptions {
        faults: FaultSet(faults.to_vec()),
        ..PathOptions::default()
    };
    let runs = paths.iter().map(|&p| run_cpu(p, &input, &opts).unwrap()).collect();
    Layer {
        cfg,
        batch,
        reference,
        runs,
    }
}

/// `trace` without the stages of `drop`.
fn without(trace: &Trace, drop: &[Stage]) -> Trace {
    let mut out = Trace::new();
    for (s, t) in trace.entries() {
        if !drop.contains(&s.stage) {
            out.record(*s, t.clone());
        }
    }
    out
}

/// The finding of `trace` judged as path `kind` of `l`, as a dump that holds `trace`'s sites
/// here and the stages `elsewhere` in another step.
fn finding(l: &Layer, kind: PathKind, trace: &Trace, elsewhere: &[Stage]) -> Finding {
    let diffs = metrics::diff(&l.reference, trace, Dtype::F32);
    let mut dumped: Vec<Stage> = trace.entries().iter().map(|(s, _)| s.stage).collect();
    dumped.extend_from_slice(elsewhere);
    let context = vec![0; l.batch.seqs.len()];
    let mut f = diagnose(&DiagnoseInput {
        cfg: &l.cfg,
        batch: &l.batch,
        reference: &l.reference,
        paths: vec![PathEvidence {
            kind: kind.into(),
            trace,
            diffs: &diffs,
            empty_partial_rows: &[],
            unservable: None,
            paged: None,
        }],
        tp: 1,
        precision: Precision::F32,
        dump: Some(DumpScope {
            dumped: &dumped,
            context: &context,
            full_reference: None,
            num_kv_splits: None,
            chunks: &[],
            head_subset: None,
        }),
        model: None,
    });
    assert_eq!(f.len(), 1, "{f:?}");
    f.remove(0)
}

fn stage_of(f: &Finding) -> Stage {
    f.site().unwrap().stage
}

/// `kv-norm-skipped` (the latent RMSNorm not applied) is `norm-skipped` at `kv_c_normed` when
/// that is dumped, and where `kv_c_normed` was not dumped, at the first compared site that reads
/// it: `k_nope` (then `v`) on the expanded paths, `attn_latent` on the absorbed one, whether or
/// not `kv_a` was dumped (without it the replay starts from the reference's `kv_a`).
#[test]
fn a_skipped_latent_norm_is_named_where_it_first_shows() {
    let l = layer(
        &[Fault::KvNormSkipped],
        &[PathKind::Mha, PathKind::Mqa, PathKind::Chunked],
    );
    for run in &l.runs {
        let f = finding(&l, run.kind, &run.trace, &[]);
        assert_eq!((f.class, stage_of(&f)), (Class::NormSkipped, Stage::KvCNormed), "{f:?}");
        assert!(
            f.evidence
                .starts_with("kv_c_normed equals kv_a's first 96 columns without the norm (rel_l2 "),
            "{}",
            f.evidence
        );
        assert!(
            f.hint.contains("kv_a_layernorm (weight `blk.1.attn_kv_a_norm.weight`)"),
            "{}",
            f.hint
        );
        for drop in [&[Stage::KvCNormed][..], &[Stage::KvCNormed, Stage::KvA]] {
            let f = finding(&l, run.kind, &without(&run.trace, drop), &[]);
            let first = if run.kind == PathKind::Mqa {
                Stage::AttnLatent
            } else {
                Stage::KNope
            };
            assert_eq!(
                (f.class, stage_of(&f)),
                (Class::NormSkipped, first),
                "{} {drop:?}: {f:?}",
                run.kind
            );
            assert!(
                f.evidence.contains("equals the replay with kv_a_layernorm skipped"),
                "{}",
                f.evidence
            );
            assert!(f.evidence.contains("kv_c_normed was not compared"), "{}", f.evidence);
        }
    }
    // Without k_nope either, the expanded path shows it at v; without the absorbed path's
    // attn_latent, at its lse.
    let mha = &l.runs[0].trace;
    let f = finding(&l, PathKind::Mha, &without(mha, &[Stage::KvCNormed, Stage::KNope]), &[]);
    assert_eq!((f.class, stage_of(&f)), (Class::NormSkipped, Stage::V), "{f:?}");
    let mqa = &l.runs[1].trace;
    let f = finding(
        &l,
        PathKind::Mqa,
        &without(mqa, &[Stage::KvCNormed, Stage::AttnLatent]),
        &[],
    );
    assert_eq!((f.class, stage_of(&f)), (Class::NormSkipped, Stage::Lse), "{f:?}");
}

/// The trace with the rows of `stage` moved by seeded noise of a tenth of their RMS: a
/// divergence no detector explains.
fn noisy(trace: &Trace, stage: Stage) -> Trace {
    let mut out = Trace::new();
    for (s, t) in trace.entries() {
        if s.stage != stage {
            out.record(*s, t.clone());
            continue;
        }
        let v = t.to_f64();
        let rms = (v.iter().map(|x| x * x).sum::<f64>() / v.len() as f64).sqrt();
        let noise = normal_f32(77, v.len());
        let moved: Vec<f64> = v
            .iter()
            .zip(&noise)
            .map(|(x, n)| x + 0.1 * rms * f64::from(*n))
            .collect();
        out.record(*s, TraceTensor::f64(t.shape.clone(), moved));
    }
    out
}

/// A divergence no hypothesis explains, at a site whose inputs were not all dumped: the hint
/// names the ones not compared (the stage the dump holds in another step first) and says
/// "passed" only of those compared; with every input compared it says they passed, and never
/// claims inputs it did not check. The same skipped norm is not claimed where the replay does
/// not hold.
#[test]
fn hints_name_the_inputs_that_were_not_compared() {
    let l = layer(&[], &[PathKind::Mha]);
    let clean = &l.runs[0].trace;
    let broken = noisy(clean, Stage::KNope);

    let f = finding(&l, PathKind::Mha, &broken, &[]);
    assert_eq!((f.class, stage_of(&f)), (Class::Mismatch, Stage::KNope), "{f:?}");
    assert_eq!(
        f.hint,
        "no known bug class explains this; its inputs `L1.kv_c_normed`, `L1.w.kv_b` passed: the bug is in this stage's own code"
    );

    let f = finding(&l, PathKind::Mha, &without(&broken, &[Stage::KvCNormed]), &[]);
    assert_eq!((f.class, stage_of(&f)), (Class::Mismatch, Stage::KNope), "{f:?}");
    assert_eq!(
        f.hint,
        "no known bug class explains this; this stage's inputs `L1.kv_c_normed` (not dumped) were not compared, so the \
         divergence may begin in them: dump them in this step; `L1.w.kv_b` passed"
    );

    // The dump holds w.kv_b in another step: it comes first, though kv_c_normed is earlier in
    // the data flow.
    let f = finding(
        &l,
        PathKind::Mha,
        &without(&broken, &[Stage::KvCNormed, Stage::WKvB]),
        &[Stage::WKvB],
    );
    assert_eq!(
        f.hint,
        "no known bug class explains this; this stage's inputs `L1.w.kv_b` (the dump holds this stage in another \
         step or layer, not in this one) and `L1.kv_c_normed` (not dumped) were not compared, so the divergence may \
         begin in them: dump them in this step"
    );
    assert!(!f.hint.contains("passed"), "{}", f.hint);

    // A weight's inputs are GGUF tensors: the hint names them, not "inputs that passed".
    let w = noisy(clean, Stage::WKvB);
    let f = finding(&l, PathKind::Mha, &w, &[]);
    assert_eq!((f.class, stage_of(&f)), (Class::Mismatch, Stage::WKvB), "{f:?}");
    assert!(
        f.hint.contains("`blk.1.attn_k_b.weight` and `blk.1.attn_v_b.weight`"),
        "{}",
        f.hint
    );
}

/// A row-stride bug in `kv_c_normed`'s norm (`strided-kv-c`) seen at `k_nope` because
/// `kv_c_normed` was not dumped: the row-stride signature, and the hint says the stride may be in
/// the input that was not compared; no skipped norm is claimed.
#[test]
fn a_stride_bug_behind_an_input_not_dumped_is_not_called_passed() {
    let l = layer(&[Fault::StridedKvC], &[PathKind::Mha]);
    let f = finding(&l, PathKind::Mha, &without(&l.runs[0].trace, &[Stage::KvCNormed]), &[]);
    assert_eq!((f.class, stage_of(&f)), (Class::Mismatch, Stage::KNope), "{f:?}");
    assert!(f.evidence.contains("rows [0] exact"), "{}", f.evidence);
    assert!(
        f.hint.ends_with(
            "signature of a wrong row stride (a strided view read as contiguous); this stage's inputs \
             `L1.kv_c_normed` (not dumped) were not compared, so the stride may be theirs"
        ),
        "{}",
        f.hint
    );
    // Where kv_c_normed was dumped, the view of kv_a is replayed there and named.
    assert_eq!(
        diagnose_site(&l, &l.runs[0].trace, Site::new(1, Stage::KvCNormed)),
        Some(Class::StridedView)
    );
}

/// The class `trace` (path mha of `l`) gets, when its first divergence is at `site`.
fn diagnose_site(l: &Layer, trace: &Trace, site: Site) -> Option<Class> {
    let f = finding(l, PathKind::Mha, trace, &[]);
    (f.site() == Some(site)).then_some(f.class)
}
