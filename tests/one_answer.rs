//! One answer per tensor: the weights an engine path built, judged as the weight sites of a dump
//! (`compare`'s detectors) and as a weights file (`weights --check`), get the same class, for
//! every weight fault of the catalogue and for heads in another order, on fixtures with P ≠ V and
//! P = V, split and fused kv_b, with and without TP; and `tp-rank-order` is never claimed
//! without TP.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use mla_diff::backend::run_cpu;
use mla_diff::compute::faults::{Fault, FaultSet};
use mla_diff::compute::path::{LayerInput, PathKind, PathOptions};
use mla_diff::compute::reference::reference_layer;
use mla_diff::core::batch::{Batch, SeqSpec, normal_f32};
use mla_diff::core::class::Class;
use mla_diff::core::dtype::Dtype;
use mla_diff::core::trace::{Site, Stage, Trace, TraceTensor};
use mla_diff::judge::diagnose::{DiagnoseInput, PathEvidence, Subject, diagnose};
use mla_diff::judge::metrics;
use mla_diff::judge::tolerance::Precision;
use mla_diff::model::config::MlaConfig;
use mla_diff::model::gguf::GgufFile;
use mla_diff::model::tensors::{dump_name, site_param};
use mla_diff::model::weights::LayerWeights;

use crate::common::{repo, write_safetensors};

/// A weight as both commands see it: its param name in a weights file and the sites holding it.
type Weights = BTreeMap<String, Vec<(Site, TraceTensor)>>;

/// The weight sites of `trace` grouped by the vLLM param they hold (`kv_b_proj`: `w.kv_b`, or
/// every `w.kv_b.rank<r>`; a whole site and its rank shards are separate entries).
fn weights_of(cfg: &MlaConfig, trace: &Trace) -> Weights {
    let mut out: Weights = BTreeMap::new();
    for (s, t) in trace.entries() {
        if !s.stage.is_weight() {
            continue;
        }
        let probe = match s.stage {
            Stage::WRank(w, _) => Stage::WRank(w, 0),
            st => st,
        };
        let Some((param, _)) = site_param(cfg, probe) else {
            continue;
        };
        let key = match s.stage {
            Stage::WRank(..) => format!("{}.rank*", dump_name(param)),
            _ => dump_name(param).to_string(),
        };
        out.entry(key).or_default().push((*s, t.clone()));
    }
    out
}

/// The class `compare` gives a dump holding only `sites` (one weight), at its first divergence;
/// `None` when it passes.
fn site_class(
    cfg: &MlaConfig,
    batch: &Batch,
    reference: &Trace,
    sites: &[(Site, TraceTensor)],
    tp: usize,
) -> Option<Class> {
    let mut trace = Trace::new();
    for (s, t) in sites {
        trace.record(*s, t.clone());
    }
    let diffs = metrics::diff(reference, &trace, Dtype::F32);
    metrics::first_divergence(&diffs)?;
    let f = diagnose(&DiagnoseInput {
        cfg,
        batch,
        reference,
        paths: vec![PathEvidence {
            kind: PathKind::Mha.into(),
            trace: &trace,
            diffs: &diffs,
            empty_partial_rows: &[],
            unservable: None,
            paged: None,
        }],
        tp,
        precision: Precision::F32,
        dump: None,
        model: None,
    });
    f.first().map(|f| f.class)
}

/// The classes `weights --check` gives the tensors of `sites` written as a weights file named by
/// `param` (`kv_b_proj`, `q_b_proj.rank*`) at TP size `tp`.
fn loaded_classes(
    model: &str,
    cfg: &MlaConfig,
    param: &str,
    sites: &[(Site, TraceTensor)],
    tp: usize,
) -> BTreeSet<Class> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("weights.safetensors");
    let tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = sites
        .iter()
        .map(|(s, t)| {
            let name = match s.stage {
                Stage::WRank(_, r) => format!("L{}.{}.rank{r}", s.layer, param.trim_end_matches(".rank*")),
                _ => format!("L{}.{param}", s.layer),
            };
            let bytes = t.to_f64().iter().flat_map(|&x| (x as f32).to_le_bytes()).collect();
            (name, safetensors::Dtype::F32, t.shape.clone(), bytes)
        })
        .collect();
    let meta: HashMap<String, String> = [("tp_size".to_string(), tp.to_string())].into_iter().collect();
    write_safetensors(&path, &tensors, Some(meta));
    let file = GgufFile::open(repo().join("golden/models").join(model)).unwrap();
    let rep = mla_diff::jobs::weights_check::check(&file, cfg, &path, None).unwrap();
    rep.findings
        .iter()
        .filter(|f| matches!(&f.subject, Subject::Loaded(_)))
        .map(|f| f.class)
        .collect()
}

/// Layer 1 of `model` with `faults` on `paths` at `tp`, and `edit` applied to the path's trace:
/// for every weight the trace holds, the class of `compare` and those of `weights --check`.
fn both(
    model: &str,
    faults: &[Fault],
    tp: usize,
    paths: &[PathKind],
    edit: impl Fn(&MlaConfig, &mut Trace),
) -> Vec<(String, Option<Class>, BTreeSet<Class>)> {
    let file = GgufFile::open(repo().join("golden/models").join(model)).unwrap();
    let cfg = MlaConfig::from_gguf(&file).unwrap();
    let w = LayerWeights::load(&file, &cfg, 1).unwrap();
    let batch = Batch {
        seqs: vec![SeqSpec { len: 5, start_pos: 0 }],
    };
    let hidden = ndarray::Array2::from_shape_vec(
        (5, cfg.hidden),
        normal_f32(1, 5 * cfg.hidden).into_iter().map(f64::from).collect(),
    )
    .unwrap();
    let reference = reference_layer(&cfg, &w, &hidden, &batch, tp, None).unwrap().trace;
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
        tp,
        faults: FaultSet(faults.to_vec()),
        ..PathOptions::default()
    };
    let mut out = Vec::new();
    for &path in paths {
        let mut trace = run_cpu(path, &input, &opts).unwrap().trace;
        edit(&cfg, &mut trace);
        for (param, sites) in weights_of(&cfg, &trace) {
            let site = site_class(&cfg, &batch, &reference, &sites, tp);
            let loaded = loaded_classes(model, &cfg, &param, &sites, tp);
            out.push((format!("{model} {path:?} tp {tp} {param}"), site, loaded));
        }
    }
    out
}

/// Every weight both commands judged: the same class (a weight that passes has no finding in
/// either), and no rank class at TP 1.
fn assert_one_answer(rows: &[(String, Option<Class>, BTreeSet<Class>)], tp: usize) -> usize {
    let mut failing = 0;
    for (what, site, loaded) in rows {
        let site_set: BTreeSet<Class> = site.iter().copied().collect();
        assert_eq!(
            &site_set, loaded,
            "{what}: compare {site:?}, weights --check {loaded:?}"
        );
        if tp < 2 {
            assert!(
                !loaded.contains(&Class::TpRankOrder),
                "{what}: tp-rank-order without TP"
            );
        }
        failing += usize::from(site.is_some());
    }
    failing
}

/// The weight faults of the catalogue, each where it acts.
#[test]
fn compare_and_weights_check_name_each_weight_fault_alike() {
    let all = [PathKind::Mha, PathKind::Mqa, PathKind::Mixed];
    let mut failing = 0;
    for model in ["tiny-v3-q8_0.gguf", "minicpm3-f32.gguf", "legacy-kvb-f32.gguf"] {
        for (fault, tp) in [
            (Fault::FusedShardSwap, 1),
            (Fault::KvBGrouped, 1),
            (Fault::KvBGrouped, 2),
            (Fault::KBUntransposed, 1),
            (Fault::KBUntransposed, 2),
            (Fault::TpRankOrder, 2),
            (Fault::TpRank0Everywhere, 2),
            (Fault::TpGateUpRank0, 2),
        ] {
            let file = GgufFile::open(repo().join("golden/models").join(model)).unwrap();
            let cfg = MlaConfig::from_gguf(&file).unwrap();
            if fault == Fault::KBUntransposed && cfg.kv_b_layout != mla_diff::model::config::KvBLayout::Split {
                continue;
            }
            let rows = both(model, &[fault], tp, &all, |_, _| {});
            failing += assert_one_answer(&rows, tp);
        }
    }
    assert!(failing >= 30, "{failing} failing weights compared");
}

/// `kv_b`'s heads in another order (a split variant), whole at TP 1 and as whole tensors at TP 2,
/// on split and fused kv_b, P ≠ V and P = V: `kv-b-layout` at TP 1 and `tp-rank-order` at TP 2
/// in both commands (the measured disagreement was a grouped kv_b called `tp-rank-order` with
/// missing heads at TP 1 by weights --check).
#[test]
fn heads_in_another_order_get_one_class_and_no_rank_class_without_tp() {
    // Heads reversed in every kv_b-derived weight site (and the whole kv_b).
    let reverse = |cfg: &MlaConfig, trace: &mut Trace| {
        let [n, l, p, _, v] = cfg.dims().nlprv();
        let mut edited = Vec::new();
        for (s, t) in trace.entries() {
            let per_head = match s.stage {
                Stage::WKvB => (p + v) * l,
                Stage::WUkT => p * l,
                Stage::WUv => l * v,
                _ => continue,
            };
            let x = t.to_f64();
            let y: Vec<f64> = (0..n)
                .rev()
                .flat_map(|h| x[h * per_head..(h + 1) * per_head].iter().copied())
                .collect();
            edited.push((*s, TraceTensor::f64(t.shape.clone(), y)));
        }
        for (s, t) in edited {
            trace.record(s, t);
        }
    };
    for model in ["tiny-v3-q8_0.gguf", "minicpm3-f32.gguf", "legacy-kvb-f32.gguf"] {
        for tp in [1, 2] {
            let rows = both(model, &[], tp, &[PathKind::Mha, PathKind::Mqa], reverse);
            assert_one_answer(&rows, tp);
            let named: BTreeSet<Class> = rows.iter().filter_map(|r| r.1).collect();
            let want = if tp == 1 { Class::KvBLayout } else { Class::TpRankOrder };
            assert_eq!(named, [want].into_iter().collect(), "{model} tp {tp}: {rows:?}");
        }
    }
}

/// Every weight held with its last two dims swapped (`[in, out]` for `[out, in]`; `W_UK_T` as
/// `[N, L, P]`): `transposed` in both commands, `kv-b-layout` for `W_UK_T`/`W_UV`; and a dump
/// holding such a `w.kv_b` is read and named by `compare`, not refused.
#[test]
fn a_transposed_weight_gets_one_class() {
    let transpose = |_: &MlaConfig, trace: &mut Trace| {
        let mut edited = Vec::new();
        for (s, t) in trace.entries() {
            if !s.stage.is_weight() || t.shape.len() < 2 {
                continue;
            }
            let k = t.shape.len();
            let (a, b) = (t.shape[k - 2], t.shape[k - 1]);
            let batch: usize = t.shape[..k - 2].iter().product();
            let x = t.to_f64();
            let mut y = vec![0.0; x.len()];
            for z in 0..batch {
                for i in 0..a {
                    for j in 0..b {
                        y[z * a * b + j * a + i] = x[z * a * b + i * b + j];
                    }
                }
            }
            let mut shape = t.shape.clone();
            shape.swap(k - 2, k - 1);
            edited.push((*s, TraceTensor::f64(shape, y)));
        }
        for (s, t) in edited {
            trace.record(s, t);
        }
    };
    for model in ["tiny-v3-q8_0.gguf", "legacy-kvb-f32.gguf"] {
        for tp in [1, 2] {
            let rows = both(model, &[], tp, &[PathKind::Mha, PathKind::Mqa], transpose);
            assert_one_answer(&rows, tp);
            for (what, site, _) in &rows {
                let want = if what.contains("W_U") {
                    Class::KvBLayout
                } else {
                    Class::Transposed
                };
                assert_eq!(*site, Some(want), "{what}");
            }
        }
    }

    // Through compare's reader: a dump whose L0.w.kv_b is [L, N·(P+V)].
    let file = GgufFile::open(repo().join("golden/models/tiny-v3-f32.gguf")).unwrap();
    let cfg = MlaConfig::from_gguf(&file).unwrap();
    let w = LayerWeights::load(&file, &cfg, 0).unwrap();
    let kv_b = mla_diff::compute::reference::assemble_kv_b(&cfg, &w.kv_b);
    let t = kv_b.t();
    let bytes: Vec<u8> = t.iter().flat_map(|&x| (x as f32).to_le_bytes()).collect();
    let src = std::fs::read(repo().join("golden/dumps/tiny-v3-f32.hf.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&src).unwrap();
    let (_, m) = safetensors::SafeTensors::read_metadata(&src).unwrap();
    let mut views = st.tensors();
    views.push((
        "L0.w.kv_b".into(),
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, t.shape().to_vec(), &bytes).unwrap(),
    ));
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("transposed.safetensors");
    std::fs::write(&p, safetensors::serialize(views, m.metadata().clone()).unwrap()).unwrap();
    let (code, out, err, doc) = crate::common::compare_json(&repo().join("golden/models/tiny-v3-f32.gguf"), &p, &[]);
    assert_eq!(code, 1, "{out}\n{err}");
    let f = &doc["findings"][0];
    assert_eq!(
        (f["class"].as_str(), f["site"].as_str()),
        (Some("transposed"), Some("L0.w.kv_b")),
        "{f}"
    );
}

/// The kv_b split variants beyond the grouped split and the untransposed `k_b` (the
/// llama.cpp#13094 family): each head's halves exchanged (`kv-b-halves-swapped`, P = V), the
/// heads interleaved by 2 (`kv-b-heads-interleaved`), the rows grouped `[all k | all v]` in
/// pairs of heads and each head's block read transposed (edits of `w.kv_b`): `kv-b-layout` in
/// both commands, never `mismatch` or a rank class.
#[test]
fn kv_b_split_variants_get_one_class() {
    let kv_b_only = |f: fn(&[f64], usize, [usize; 3]) -> Vec<f64>| {
        move |cfg: &MlaConfig, trace: &mut Trace| {
            let [n, l, p, _, v] = cfg.dims().nlprv();
            let edited: Vec<(Site, TraceTensor)> = trace
                .entries()
                .iter()
                .filter(|(s, _)| s.stage == Stage::WKvB)
                .map(|(s, t)| (*s, TraceTensor::f64(t.shape.clone(), f(&t.to_f64(), n, [l, p, v]))))
                .collect();
            for (s, t) in edited {
                trace.record(s, t);
            }
        }
    };
    // Pairs of heads, each pair's rows [k_0 k_1 | v_0 v_1].
    let pairs = |x: &[f64], n: usize, [l, p, v]: [usize; 3]| -> Vec<f64> {
        let head = |h: usize| &x[h * (p + v) * l..(h + 1) * (p + v) * l];
        (0..n / 2)
            .flat_map(|g| {
                let (a, b) = (head(2 * g), head(2 * g + 1));
                [&a[..p * l], &b[..p * l], &a[p * l..], &b[p * l..]].concat()
            })
            .collect()
    };
    // Each head's [P+V, L] block holding its transpose's bytes.
    let blocks_t = |x: &[f64], n: usize, [l, p, v]: [usize; 3]| -> Vec<f64> {
        let w = p + v;
        (0..n)
            .flat_map(|h| {
                let b = &x[h * w * l..(h + 1) * w * l];
                (0..l).flat_map(move |c| (0..w).map(move |r| b[r * l + c]))
            })
            .collect()
    };
    let mut named = 0;
    let mut check = |rows: Vec<(String, Option<Class>, BTreeSet<Class>)>, tp: usize| {
        assert_one_answer(&rows, tp);
        for (what, site, _) in &rows {
            assert!(site.is_none() || *site == Some(Class::KvBLayout), "{what}: {site:?}");
            named += usize::from(site.is_some());
        }
    };
    let paths = [PathKind::Mha, PathKind::Mqa];
    for (model, tp) in [
        ("yarn-v3-f32.gguf", 1),
        ("yarn-v3-f32.gguf", 2),
        ("minicpm3-f32.gguf", 1),
    ] {
        check(both(model, &[Fault::KvBHalvesSwapped], tp, &paths, |_, _| {}), tp);
    }
    for model in ["tiny-v3-q8_0.gguf", "yarn-v3-f32.gguf", "legacy-kvb-f32.gguf"] {
        check(both(model, &[Fault::KvBHeadsInterleaved], 1, &paths, |_, _| {}), 1);
    }
    check(both("tiny-v3-q8_0.gguf", &[], 1, &[PathKind::Mha], kv_b_only(pairs)), 1);
    check(
        both("legacy-kvb-f32.gguf", &[], 1, &[PathKind::Mha], kv_b_only(blocks_t)),
        1,
    );
    check(
        both("tiny-v3-q8_0.gguf", &[], 1, &[PathKind::Mha], kv_b_only(blocks_t)),
        1,
    );
    assert!(named >= 14, "{named} weights named kv-b-layout");
}
