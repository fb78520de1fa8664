//! `compare` on a format-2 dump runs one reference per dumped layer over the union of the
//! steps' sequences and gives each step its rows of it. Attention is causal within a sequence
//! and every other stage acts row by row, so each step's judgement must be the one its own
//! reference over its full batch gives: the same verdict, findings and sites, every number
//! within 1e-12 relative (a GEMM over another number of rows may sum in another order). Checked
//! on every committed multi-step dump: vLLM's real code on the CPU harness (chunked prefill
//! over cached context, a prefix-cache hit, mixed batches, the chunk-loop plants) and the plant
//! dumps (split-KV decode, paged cache, residual scale, …). Also `compare --stats` and
//! `compare --backend cuda` on a machine without a GPU.

use std::path::Path;

use mla_diff::core::trace::{Stage, Trace};
use mla_diff::jobs::compare::{CompareOptions, ReferenceDownload, ReferenceTally, StepReferences, compare_steps_with};
use mla_diff::model::config::MlaConfig;
use mla_diff::model::dump::{self, DumpFile};
use mla_diff::model::gguf::GgufFile;

use crate::common::{repo, run_bin};

/// The JSON report of the format-2 dump `dump` (its model `golden/models/<fixture>.gguf`), its
/// steps' references as `references` says, and how many ran.
fn judged(dump: &Path, references: StepReferences) -> (serde_json::Value, ReferenceTally) {
    judged_with(
        dump,
        &CompareOptions {
            references,
            ..CompareOptions::default()
        },
        None,
    )
}

/// The JSON report of the format-2 dump `dump` (its model `golden/models/<fixture>.gguf`)
/// compared with `opts`, and how many references ran; with `stages`, only the sites of those
/// stages and the context partials are kept of the dump (what an engine's hooks dump).
fn judged_with(dump: &Path, opts: &CompareOptions, stages: Option<&[Stage]>) -> (serde_json::Value, ReferenceTally) {
    let name = dump.file_name().unwrap().to_string_lossy().into_owned();
    let fixture = name.split('.').next().unwrap();
    let file = GgufFile::open(repo().join("golden/models").join(format!("{fixture}.gguf"))).unwrap();
    let cfg = MlaConfig::from_gguf(&file).unwrap();
    let DumpFile::Steps(mut sd) = dump::read(dump, None, &cfg).unwrap() else {
        panic!("{name}: not a format-2 dump");
    };
    if let Some(stages) = stages {
        for (_, d) in &mut sd.steps {
            for tr in d.layers.values_mut() {
                let mut kept = Trace::new();
                for (s, t) in tr.entries() {
                    if stages.contains(&s.stage) || s.stage.is_context_partial() {
                        kept.record(*s, t.clone());
                    }
                }
                *tr = kept;
            }
        }
    }
    let (rep, tally) = compare_steps_with(&file, &cfg, &sd, None, None, None, opts).unwrap();
    (mla_diff::output::report::json(&rep), tally)
}

/// Where `a` and `b` differ (`at` names the place): a string, bool, null or array length that
/// is not the same, or a number beyond 1e-12 relative (of the larger magnitude; equal
/// infinities and two NaN-free nulls are the same).
fn differences(at: &str, a: &serde_json::Value, b: &serde_json::Value, out: &mut Vec<String>) {
    use serde_json::Value;
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => {
            let (x, y) = (x.as_f64().unwrap(), y.as_f64().unwrap());
            let scale = x.abs().max(y.abs());
            if x != y && (x - y).abs() > 1e-12 * scale {
                out.push(format!("{at}: {x} vs {y}"));
            }
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
            for (i, (p, q)) in x.iter().zip(y).enumerate() {
                differences(&format!("{at}[{i}]"), p, q, out);
            }
        }
        (Value::Object(x), Value::Object(y)) if x.keys().eq(y.keys()) => {
            for (k, p) in x {
                differences(&format!("{at}.{k}"), p, &y[k], out);
            }
        }
        _ if a == b => {}
        _ => out.push(format!("{at}: {a} vs {b}")),
    }
}

/// The committed format-2 dumps of `folder` (under golden/dumps).
pub fn multi_step_dumps(folder: &str) -> Vec<std::path::PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(repo().join("golden/dumps").join(folder))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    v.sort();
    v
}

#[test]
fn one_union_reference_judges_every_step_as_its_own_reference_does() {
    let mut checked = 0;
    let mut diverging = 0;
    for folder in ["live-cpu", "plants"] {
        for p in multi_step_dumps(folder) {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            let (per_step, t_step) = judged(&p, StepReferences::PerStep);
            let steps = t_step.per_step;
            if steps < 2 {
                continue;
            }
            let (union, t_union) = judged(&p, StepReferences::Union);
            // Every layer's steps served by its union reference.
            assert!(t_union.union >= 1, "{name}: {t_union:?}");
            assert_eq!((t_union.union_steps, t_union.per_step), (steps, 0), "{name}");
            assert_eq!(t_step.union, 0, "{name}");
            let mut diff = Vec::new();
            differences("report", &per_step, &union, &mut diff);
            assert!(diff.is_empty(), "{name}: {diff:#?}");
            assert!(!union["sites"].as_array().unwrap().is_empty(), "{name}");
            if union["findings"].as_array().is_some_and(|f| !f.is_empty()) {
                diverging += 1;
            }
            checked += 1;
        }
    }
    // 6 live-cpu dumps and 58 plant dumps, clean and planted.
    assert!(checked >= 60, "{checked} multi-step dumps");
    assert!(diverging >= 40, "{diverging} dumps with a finding");
}

/// The stages a vLLM deployment's hooks dump without the absorbed internals: the layer's input
/// and output, the latent and the rope key, the queries, the attention output and LSE, o_proj
/// (and the context partials, always kept).
const ENGINE_STAGES: [Stage; 8] = [
    Stage::HiddenIn,
    Stage::KvCNormed,
    Stage::KPeRoped,
    Stage::Q,
    Stage::Lse,
    Stage::AttnOut,
    Stage::OProj,
    Stage::HiddenOut,
];

/// Judging reads the reference only at the dumped stages (and at the inputs of the context
/// partials and the selection's tie check) until a step diverges, when its diagnosis reads every
/// stage: the report is the one judging with every stage at hand gives, byte for byte, on every
/// committed format-2 dump, clean and planted, whole and cut to [`ENGINE_STAGES`].
#[test]
fn judging_with_the_judged_stages_reports_what_the_whole_reference_does() {
    let (mut checked, mut diverging, mut context) = (0, 0, 0);
    for folder in ["live-cpu", "plants"] {
        for (p, stages) in multi_step_dumps(folder)
            .into_iter()
            .flat_map(|p| [(p.clone(), None), (p, Some(&ENGINE_STAGES[..]))])
        {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            let with = |download| CompareOptions {
                download,
                ..CompareOptions::default()
            };
            let (judged, _) = judged_with(&p, &with(ReferenceDownload::Judged), stages);
            let (whole, _) = judged_with(&p, &with(ReferenceDownload::Whole), stages);
            assert_eq!(
                mla_diff::output::report::to_json_bytes(&judged),
                mla_diff::output::report::to_json_bytes(&whole),
                "{name} ({stages:?})"
            );
            if judged["findings"].as_array().is_some_and(|f| !f.is_empty()) {
                diverging += 1;
            }
            if judged["sites"]
                .as_array()
                .unwrap()
                .iter()
                .any(|s| s["site"].as_str().is_some_and(|x| x.contains("ctx_out")))
            {
                context += 1;
            }
            checked += 1;
        }
    }
    assert!(checked >= 120, "{checked} dumps");
    assert!(diverging >= 80, "{diverging} dumps with a finding");
    assert!(context >= 6, "{context} dumps judging context partials");
}

#[test]
fn compare_stats_names_the_references_and_every_stage() {
    let dump = repo().join("golden/dumps/live-cpu/legacy-kvb-f32.merge-suffix-stride.safetensors");
    let model = repo().join("golden/models/legacy-kvb-f32.gguf");
    let (code, out, err) = run_bin(&[
        "compare",
        "--model",
        model.to_str().unwrap(),
        "--dump",
        dump.to_str().unwrap(),
        "--quiet",
        "--stats",
    ]);
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(err.contains("mla-diff: stats: wall "), "{err}");
    assert!(err.contains("peak RSS"), "{err}");
    assert!(
        err.contains("mla-diff: references: 1 over the union of 10 step(s), 0 of one step each"),
        "{err}"
    );
    let stages = err
        .lines()
        .find(|l| l.starts_with("mla-diff: stages: "))
        .unwrap_or_default();
    for stage in [
        "open ",
        "read ",
        "identity ",
        "dequant ",
        "input ",
        "reference ",
        "step rows ",
        "judge ",
        "diagnose ",
        "report ",
    ] {
        assert!(stages.contains(stage), "`{stage}` not in {stages}");
    }
    // One reference, ten steps judged.
    let stage = |name: &str| {
        stages
            .trim_start_matches("mla-diff: stages: ")
            .split(", ")
            .find(|s| s.starts_with(name))
            .unwrap_or_default()
            .to_string()
    };
    assert!(!stage("reference ").contains('×'), "{stages}");
    assert!(stage("judge ").ends_with("(10×)"), "{stages}");
}

#[test]
fn compare_backend_cuda_without_a_gpu_is_one_exit_2_line() {
    if mla_diff::device::probe().is_ok() {
        eprintln!("skipped: a CUDA device answers");
        return;
    }
    let dump = repo().join("golden/dumps/live-cpu/legacy-kvb-f32.prefix.safetensors");
    let model = repo().join("golden/models/legacy-kvb-f32.gguf");
    let (code, out, err) = run_bin(&[
        "compare",
        "--model",
        model.to_str().unwrap(),
        "--dump",
        dump.to_str().unwrap(),
        "--backend",
        "cuda",
    ]);
    assert_eq!(code, 2, "{out}\n{err}");
    assert!(out.is_empty(), "{out}");
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(lines[0].starts_with("mla-diff: error: CUDA"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    // auto falls back to the CPU reference and says why; the verdict is the CPU one.
    let (code, out, err) = run_bin(&[
        "compare",
        "--model",
        model.to_str().unwrap(),
        "--dump",
        dump.to_str().unwrap(),
        "--backend",
        "auto",
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(err.contains("mla-diff: backend cpu (auto: "), "{err}");
}
