//! Snapshot tests (insta) of what people read: the terminal table, the Markdown triage report and
//! `inspect`. Machine-specific fields (CPU, GPU, thread counts, paths, dates, git revision) are
//! redacted by filters. Floats are never rewritten after rendering (that would break the tables'
//! column alignment): before a report is rendered, [`round_noise`] replaces every noise-level
//! error metric (below [`NOISE_FLOOR`], where another CPU's GEMM kernel or the cancellation in
//! `cos_diff` moves the digits) with the fixed [`NOISE`], so the rendered tables are the same on
//! every machine. CI runs the suite with `INSTA_UPDATE=no`, so a changed snapshot fails;
//! [`every_snapshot_file_is_asserted`] fails on a `.snap` file that no `assert_snapshot!` here
//! names and on a pending `.snap.new` (every snapshot is named, so the names in this file are the
//! whole set).
//!
//! To accept an intended change: `INSTA_UPDATE=always cargo test --release --test tests snapshots::`,
//! then review `git diff tests/snapshots/`.

use crate::common::repo;
use mla_diff::backend::Backend;
use mla_diff::backend::cpu::CpuOps;
use mla_diff::compute::faults::{Fault, FaultSet};
use mla_diff::compute::path::{PathKind, PathOptions};
use mla_diff::core::batch::Batch;
use mla_diff::core::dtype::Dtype;
use mla_diff::judge::report::{RunConfig, RunReport};
use mla_diff::model::config::MlaConfig;
use mla_diff::model::gguf::GgufFile;

fn settings() -> insta::Settings {
    let mut s = insta::Settings::clone_current();
    s.set_snapshot_path(repo().join("tests/snapshots"));
    s.set_prepend_module_to_snapshot(false);
    s.set_omit_expression(true);
    s.set_description(format!(
        "error metrics (rel_l2, cos_diff, max |Δ|) below {NOISE_FLOOR:e} in magnitude show as {NOISE:e} (rounding noise)"
    ));
    s.add_filter(r"cpu \(\d+ threads\)", "cpu ([threads])");
    s.add_filter(r"Date: \S+", "Date: [date]");
    s.add_filter(r"\| CPU \| .* \|", "| CPU | [cpu] |");
    s.add_filter(r"\| OS \| .* \|", "| OS | [os] |");
    s.add_filter(r"\| git revision \| .* \|", "| git revision | [git revision] |");
    s.add_filter(r"\| mla-diff \| .* \|", "| mla-diff | [version] |");
    s.add_filter(r"/\S*/golden/models/", "[repo]/golden/models/");
    s
}

/// Error metrics smaller than this in magnitude are rounding noise of the f32 paths against the
/// f64 reference (order 1e-7 for `rel_l2` and max |Δ|, 1e-14 for `cos_diff`); their digits, and
/// for `cos_diff` even the sign, depend on the CPU the reference ran on.
const NOISE_FLOOR: f64 = 1e-3;

/// What a noise-level error metric shows as: far below any real measurement, so it reads as a
/// placeholder, and nonzero, so it stays distinct from an exact match (`0`).
const NOISE: f64 = 1e-99;

/// Replaces every nonzero error metric of `rep` below [`NOISE_FLOOR`] in magnitude (`rel_l2`,
/// `cos_diff`, `max_abs`, `max_rel`) with [`NOISE`], before rendering. Values of the tensors
/// (`max_abs_ref`, `max_abs_cand`, norms) and exact zeros are kept.
fn round_noise(mut rep: RunReport) -> RunReport {
    for d in rep.results.iter_mut().flat_map(|r| r.diffs.iter_mut()) {
        if let Some(m) = d.metrics.as_mut() {
            for x in [&mut m.rel_l2, &mut m.cos_diff, &mut m.max_abs, &mut m.max_rel] {
                if *x != 0.0 && x.abs() < NOISE_FLOOR {
                    *x = NOISE;
                }
            }
        }
    }
    rep
}

/// Runs `rc` on `model` (a file of golden/models, or the embedded fixture) on the f32 CPU
/// backend; the report's noise-level metrics are rounded by [`round_noise`].
fn run(model: Option<&str>, rc: RunConfig) -> (GgufFile, RunReport) {
    let file = match model {
        Some(m) => GgufFile::open(repo().join("golden/models").join(m)).unwrap(),
        None => GgufFile::from_static(
            mla_diff::model::fixture::EMBEDDED_NAME,
            mla_diff::model::fixture::EMBEDDED_GGUF,
        )
        .unwrap(),
    };
    let cfg = MlaConfig::from_gguf(&file).unwrap();
    let rep = mla_diff::jobs::run::run(&Backend::Cpu(CpuOps::new(Dtype::F32)), &file, &cfg, &rc).unwrap();
    (file, round_noise(rep))
}

fn rc(layers: Vec<usize>, seqs: &[usize], faults: Vec<Fault>, tp: usize, paths: Vec<PathKind>) -> RunConfig {
    RunConfig {
        layers,
        batch: Batch {
            seqs: seqs
                .iter()
                .map(|&len| mla_diff::core::batch::SeqSpec { len, start_pos: 0 })
                .collect(),
        },
        paths,
        path_options: PathOptions {
            page_size: 4,
            num_splits: 2,
            tp,
            chunk_size: 3,
            new_tokens: 2,
            faults: FaultSet(faults),
            ..PathOptions::default()
        },
        backend: "cpu (2 threads)".into(),
        ..RunConfig::default()
    }
}

#[test]
fn terminal_tables() {
    let (_, clean) = run(
        None,
        rc(vec![1], &[3, 6], vec![], 1, vec![PathKind::Mha, PathKind::Mqa]),
    );
    assert!(clean.all_pass());
    let (_, bad) = run(
        None,
        rc(vec![1], &[3, 6], vec![Fault::PhantomOutput], 1, vec![PathKind::Mqa]),
    );
    settings().bind(|| {
        insta::assert_snapshot!("terminal_clean", mla_diff::output::report::terminal(&clean));
        insta::assert_snapshot!("terminal_phantom", mla_diff::output::report::terminal(&bad));
    });
}

#[test]
fn markdown_reports() {
    let backend = Backend::Cpu(CpuOps::new(Dtype::F32));
    let env = mla_diff::output::triage::Environment::detect(&backend);
    let (file, bad) = run(
        None,
        rc(vec![1], &[3, 6], vec![Fault::PhantomOutput], 1, PathKind::ALL.to_vec()),
    );
    let cmd = "mla-diff run --layer 1 --inject phantom-output --report /tmp/r.md";
    let md = mla_diff::output::triage::markdown(&bad, &env, cmd, &file, "r.svg");
    assert!(md.lines().next().unwrap().contains("phantom-output at L1.attn_out"));
    let (file2, clean) = run(
        Some("k256-q4_k_m.gguf"),
        rc(vec![0, 1], &[5], vec![], 2, vec![PathKind::Mha, PathKind::Chunked]),
    );
    let md2 = mla_diff::output::triage::markdown(&clean, &env, "mla-diff run --layers 0..=1 --tp 2", &file2, "k.svg");
    settings().bind(|| {
        insta::assert_snapshot!("report_phantom", md);
        insta::assert_snapshot!("report_clean_tp2", md2);
    });
}

#[test]
fn inspect_output() {
    let f = GgufFile::open(repo().join("golden/models/tiny-v3-q8_0.gguf")).unwrap();
    let k = GgufFile::open(repo().join("golden/models/k256-q4_k_m.gguf")).unwrap();
    // A DSA file: inspect names the architecture, its MLA dims and the indexer (a shared layer).
    let g = GgufFile::open(repo().join("golden/models/dsa-glm-q8_0.gguf")).unwrap();
    settings().bind(|| {
        insta::assert_snapshot!("inspect_tiny_v3_q8_0", mla_diff::jobs::inspect::inspect(&f, None));
        insta::assert_snapshot!("inspect_layer1_k256", mla_diff::jobs::inspect::inspect(&k, Some(1)));
        insta::assert_snapshot!("inspect_layer1_dsa_glm", mla_diff::jobs::inspect::inspect(&g, Some(1)));
    });
}

/// The snapshot folder holds exactly the snapshots this file asserts: a `.snap` whose name no
/// `assert_snapshot!` here names (its first argument) is an orphan (a renamed or deleted test), a
/// pending `.snap.new` or `.pending-snap` is an unreviewed change, and an asserted name without
/// its file would be written on first run instead of checked.
#[test]
fn every_snapshot_file_is_asserted() {
    let source = std::fs::read_to_string(repo().join("tests/snapshots.rs")).expect("read tests/snapshots.rs");
    let marker = concat!("assert_snap", "shot!(\"");
    let asserted: std::collections::BTreeSet<String> = source
        .match_indices(marker)
        .filter_map(|(i, _)| {
            let rest = &source[i + marker.len()..];
            rest.find('"').map(|end| rest[..end].to_string())
        })
        .collect();
    assert!(
        !asserted.is_empty(),
        "no named snapshot assertion found in tests/snapshots.rs"
    );
    let mut on_disk = std::collections::BTreeSet::new();
    let mut pending = Vec::new();
    for entry in std::fs::read_dir(repo().join("tests/snapshots")).expect("list tests/snapshots") {
        let name = entry
            .expect("read tests/snapshots entry")
            .file_name()
            .to_string_lossy()
            .into_owned();
        if let Some(stem) = name.strip_suffix(".snap") {
            on_disk.insert(stem.to_string());
        } else {
            pending.push(name);
        }
    }
    assert!(
        pending.is_empty(),
        "tests/snapshots holds files that are not accepted snapshots: {pending:?}"
    );
    let orphans: Vec<_> = on_disk.difference(&asserted).collect();
    assert!(
        orphans.is_empty(),
        "snapshot files no test asserts (delete them): {orphans:?}"
    );
    let missing: Vec<_> = asserted.difference(&on_disk).collect();
    assert!(
        missing.is_empty(),
        "asserted snapshots without a committed file: {missing:?}"
    );
}
