//! `lse-merge`'s split-KV replay on an engine's format-2 dump: a decode step that batches a long
//! row with a short one (whose splits past its context are empty), its `attn_latent` and `lse`
//! merged by a wrong rule from the reference's own inputs, is named with the split count and the
//! rule, from the step's `num_kv_splits` or by the search; a hostile `num_kv_splits` is refused.

use mla_diff::compute::reference::reference_layer;
use mla_diff::core::batch::{Batch, SeqSpec, normal_f32};
use mla_diff::core::trace::{Site, Stage, Trace};
use mla_diff::model::config::MlaConfig;
use mla_diff::model::gguf::GgufFile;
use mla_diff::model::weights::LayerWeights;

use crate::common::{compare_json, repo, write_safetensors};

const MODEL: &str = "tiny-v3-f32.gguf";
const LAYER: usize = 0;
/// The two requests: a long one and a short one, decoded together in the second step.
const LONG: usize = 40;
const SHORT: usize = 2;

/// How the dump's decode step merged each row's splits.
#[derive(Clone, Copy)]
enum Merge {
    /// Every empty split merged with LSE 0 and a zero output.
    EmptyZero,
    /// Every empty split merged with a stale finite state: LSE `ell`, output all `value`.
    EmptyStale { ell: f64, value: f64 },
    /// Each row's last split with keys left out (empty splits skipped).
    LastFilledLost,
}

/// `log Σ e^s`.
fn lse_of(s: &[f64]) -> f64 {
    let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    m + s.iter().map(|x| (x - m).exp()).sum::<f64>().ln()
}

/// The decode step's `attn_latent` [2, N, L] and `lse` [2, N] for the last token of each
/// sequence of `batch` (rows `rows` of `tr`), each row's keys cut into `k` splits of ⌈ctx/k⌉ and
/// merged by `merge`, in f64 from the reference's `ql_nope`, `q_pe_roped`, `kv_c_normed`,
/// `k_pe_roped`.
fn decode_outputs(
    cfg: &MlaConfig,
    tr: &Trace,
    rows: &[(usize, usize)],
    k: usize,
    merge: Merge,
) -> (Vec<f32>, Vec<f32>) {
    let site = |st| tr.get(&Site::new(LAYER, st)).unwrap().to_f64();
    let (ql, qpe, kvc, kpe) = (
        site(Stage::QlNope),
        site(Stage::QPeRoped),
        site(Stage::KvCNormed),
        site(Stage::KPeRoped),
    );
    let [n, l, _, r, _] = cfg.dims().nlprv();
    let (mut latent, mut lse) = (Vec::new(), Vec::new());
    for &(row, first) in rows {
        let ctx = row - first + 1;
        for h in 0..n {
            let s: Vec<f64> = (first..=row)
                .map(|j| {
                    let a: f64 = (0..l).map(|d| ql[(row * n + h) * l + d] * kvc[j * l + d]).sum();
                    let b: f64 = (0..r).map(|d| qpe[(row * n + h) * r + d] * kpe[j * r + d]).sum();
                    (a + b) * cfg.softmax_scale
                })
                .collect();
            let sl = ctx.div_ceil(k);
            // (LSE, output) per split; the empty ones as the buggy merge reads them.
            let mut states: Vec<(f64, Vec<f64>)> = Vec::new();
            for sp in 0..k {
                let range = (sp * sl).min(ctx)..((sp + 1) * sl).min(ctx);
                if range.is_empty() {
                    states.push(match merge {
                        Merge::EmptyZero => (0.0, vec![0.0; l]),
                        Merge::EmptyStale { ell, value } => (ell, vec![value; l]),
                        Merge::LastFilledLost => (f64::NEG_INFINITY, vec![0.0; l]),
                    });
                    continue;
                }
                let ls = lse_of(&s[range.clone()]);
                let mut o = vec![0.0; l];
                for j in range {
                    let p = (s[j] - ls).exp();
                    for (od, &v) in o.iter_mut().zip(&kvc[(first + j) * l..(first + j + 1) * l]) {
                        *od += p * v;
                    }
                }
                states.push((ls, o));
            }
            if let Merge::LastFilledLost = merge {
                let last = states.iter().rposition(|st| st.0 > f64::NEG_INFINITY).unwrap();
                states[last].0 = f64::NEG_INFINITY;
            }
            let m = lse_of(&states.iter().map(|st| st.0).collect::<Vec<_>>());
            let mut o = vec![0.0; l];
            for (ls, so) in states.iter().filter(|st| st.0 > f64::NEG_INFINITY) {
                let w = (ls - m).exp();
                for (od, v) in o.iter_mut().zip(so) {
                    *od += w * v;
                }
            }
            latent.extend(o.iter().map(|&v| v as f32));
            lse.push(m as f32);
        }
    }
    (latent, lse)
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A format-2 dump of two requests (`LONG` and `SHORT` tokens of seeded hidden states): a
/// prefill step of all but their last tokens, then one decode step of both, whose
/// `attn_latent` and `lse` merge `k` splits by `merge`; `num_kv_splits` is the decode step's
/// header field as written (absent when `None`).
fn decode_dump(
    k: usize,
    merge: Merge,
    num_kv_splits: Option<serde_json::Value>,
) -> (tempfile::TempDir, std::path::PathBuf) {
    let file = GgufFile::open(repo().join("golden/models").join(MODEL)).unwrap();
    let cfg = MlaConfig::from_gguf(&file).unwrap();
    let w = LayerWeights::load(&file, &cfg, LAYER).unwrap();
    let batch = Batch {
        seqs: [LONG, SHORT].iter().map(|&len| SeqSpec { len, start_pos: 0 }).collect(),
    };
    let t = batch.n_tokens();
    let hidden = ndarray::Array2::from_shape_vec(
        (t, cfg.hidden),
        normal_f32(11, t * cfg.hidden).into_iter().map(f64::from).collect(),
    )
    .unwrap();
    let tr = reference_layer(&cfg, &w, &hidden, &batch, 1, None).unwrap().trace;
    // Full rows: the long sequence's 0..LONG, then the short one's LONG..LONG+SHORT.
    let decode_rows = [(LONG - 1, 0), (LONG + SHORT - 1, LONG)];
    let prefill_rows: Vec<usize> = (0..LONG - 1).chain(LONG..LONG + SHORT - 1).collect();
    let rows_of = |stage: Stage, rows: &[usize]| -> (Vec<usize>, Vec<f32>) {
        let x = tr.get(&Site::new(LAYER, stage)).unwrap();
        let per = x.len() / t;
        let all = x.to_f64();
        let mut shape = x.shape.clone();
        shape[0] = rows.len();
        let v = rows
            .iter()
            .flat_map(|&r| all[r * per..(r + 1) * per].iter().map(|&v| v as f32))
            .collect();
        (shape, v)
    };
    let mut tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    let (shape, v) = rows_of(Stage::HiddenIn, &prefill_rows);
    tensors.push((
        format!("s0.L{LAYER}.hidden_in"),
        safetensors::Dtype::F32,
        shape,
        f32_bytes(&v),
    ));
    let dec: Vec<usize> = decode_rows.iter().map(|r| r.0).collect();
    for stage in [
        Stage::HiddenIn,
        Stage::Q,
        Stage::KvCNormed,
        Stage::KPeRoped,
        Stage::QPeRoped,
        Stage::QlNope,
    ] {
        let (shape, v) = rows_of(stage, &dec);
        tensors.push((
            format!("s1.L{LAYER}.{}", stage.name()),
            safetensors::Dtype::F32,
            shape,
            f32_bytes(&v),
        ));
    }
    let (latent, lse) = decode_outputs(&cfg, &tr, &decode_rows, k, merge);
    let [n, l, ..] = cfg.dims().nlprv();
    tensors.push((
        format!("s1.L{LAYER}.attn_latent"),
        safetensors::Dtype::F32,
        vec![2, n, l],
        f32_bytes(&latent),
    ));
    tensors.push((
        format!("s1.L{LAYER}.lse"),
        safetensors::Dtype::F32,
        vec![2, n],
        f32_bytes(&lse),
    ));
    let mut decode = serde_json::json!({
        "name": "decode-1",
        "seqs": [{"new": 1, "context": LONG - 1}, {"new": 1, "context": SHORT - 1}],
    });
    if let Some(kv) = num_kv_splits {
        decode["num_kv_splits"] = kv;
    }
    let header = serde_json::json!({
        "model": {
            "file": MODEL,
            "bytes": file.file_len(),
            "index_sha256": file.index_sha256_hex(),
            "layer_sha256": {LAYER.to_string(): file.layer_sha256_hex(LAYER)},
        },
        "hook": {"name": "tests/split_merge.rs", "version": "1"},
        "engine": {"name": "split-kv test", "version": "1", "attention_backend": "TRITON_MLA"},
        "dtype": "f32",
        "steps": [
            {"name": "prefill", "seqs": [{"new": LONG - 1, "context": 0}, {"new": SHORT - 1, "context": 0}]},
            decode,
        ],
    });
    let md: std::collections::HashMap<String, String> = [
        ("format".to_string(), "mla-diff dump 2".to_string()),
        ("header".to_string(), header.to_string()),
    ]
    .into_iter()
    .collect();
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("split.safetensors");
    write_safetensors(&p, &tensors, Some(md));
    (dir, p)
}

fn compare(p: &std::path::Path) -> (i32, String, String, serde_json::Value) {
    compare_json(&repo().join("golden/models").join(MODEL), p, &[])
}

/// The right merge passes: every site of both steps within tolerance.
#[test]
fn a_right_split_merge_with_an_empty_split_passes() {
    // Empty splits merged with LSE −inf are left out: a stale state of LSE −inf is the right one.
    let merge = Merge::EmptyStale {
        ell: f64::NEG_INFINITY,
        value: 0.0,
    };
    let (_d, p) = decode_dump(4, merge, Some(4.into()));
    let (code, out, err, _) = compare(&p);
    assert_eq!(code, 0, "{out}\n{err}");
}

/// Empty splits merged from a zero-filled buffer: named from the step's `num_kv_splits`, and by
/// the search when the hook did not record it (only 4 splits leave the short row's two empty ones).
#[test]
fn empty_splits_merged_as_zeros_are_named_with_the_split_count() {
    for (recorded, says) in [
        (Some(4), "K = 4 splits per row (the step's num_kv_splits)"),
        (None, "K = 4 splits per row (searched: no num_kv_splits recorded)"),
    ] {
        let (_d, p) = decode_dump(4, Merge::EmptyZero, recorded.map(Into::into));
        let (code, out, err, doc) = compare(&p);
        assert_eq!(code, 1, "{out}\n{err}");
        let f = &doc["findings"][0];
        assert_eq!(
            (f["class"].as_str(), f["site"].as_str()),
            (Some("lse-merge"), Some("L0.attn_latent")),
            "{f}"
        );
        let ev = f["evidence"].as_str().unwrap();
        assert!(ev.contains(says) && ev.contains("with LSE 0 and a zero output"), "{ev}");
        assert!(ev.contains("explains attn_latent and lse"), "{ev}");
    }
}

/// Each row's last split with keys lost (a merge loop one short of the row's filled splits):
/// the short row loses its second key's split, the long row its last split.
#[test]
fn the_last_filled_split_lost_is_named() {
    let (_d, p) = decode_dump(4, Merge::LastFilledLost, Some(4.into()));
    let (code, out, err, doc) = compare(&p);
    assert_eq!(code, 1, "{out}\n{err}");
    let f = &doc["findings"][0];
    assert_eq!(f["class"], "lse-merge", "{f}");
    let ev = f["evidence"].as_str().unwrap();
    assert!(
        ev.contains("each row's last split with keys lost from the merge"),
        "{ev}"
    );
}

/// Stale finite states in the empty splits cannot be replayed: the footprint names them (the
/// wrong rows are the short row's, the long row is right, each wrong LSE rose).
#[test]
fn empty_splits_merged_with_stale_states_are_named_by_their_footprint() {
    let (_d, p) = decode_dump(4, Merge::EmptyStale { ell: 1.5, value: 0.3 }, Some(4.into()));
    let (code, out, err, doc) = compare(&p);
    assert_eq!(code, 1, "{out}\n{err}");
    let f = &doc["findings"][0];
    assert_eq!(f["class"], "lse-merge", "{f}");
    let ev = f["evidence"].as_str().unwrap();
    assert!(
        ev.contains("all have an empty split at K = 4 splits per row (the step's num_kv_splits)"),
        "{ev}"
    );
    assert!(ev.contains("with a finite stale LSE and output"), "{ev}");
}

/// `num_kv_splits` other than null or an integer from 1 to 4096: exit 2 naming the field.
#[test]
fn a_hostile_num_kv_splits_is_refused() {
    for bad in [
        serde_json::json!(0),
        serde_json::json!(-3),
        serde_json::json!(2.5),
        serde_json::json!("4"),
        serde_json::json!(1_000_000),
    ] {
        let (_d, p) = decode_dump(4, Merge::EmptyZero, Some(bad.clone()));
        let (code, out, err, _) = compare(&p);
        assert_eq!(code, 2, "{bad}: {out}\n{err}");
        assert!(err.contains("header.steps[1].num_kv_splits"), "{bad}: {err}");
    }
    let (_d, p) = decode_dump(4, Merge::EmptyZero, Some(serde_json::Value::Null));
    let (code, _, err, _) = compare(&p);
    assert_eq!(code, 1, "{err}");
}
