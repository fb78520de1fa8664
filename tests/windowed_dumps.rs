//! Windowed format-2 dumps: a recording that starts after a request's first forwards (vLLM's
//! `MLA_DIFF_VLLM_STEPS=A:N`), declaring each sequence's positions computed before its first
//! recorded row as `steps[k].seqs[i].unrecorded`, which `compare` rebuilds from
//! `seq{i}.token_ids`.
//!
//! The windowed dumps are cut here from committed dumps of vLLM's real code: the scheduled runs
//! of `golden/dumps/live-cpu/` (chunked prefill over context chunks, a prefix-cache hit, a mixed
//! batch, and the chunk-loop plants), the decode plants of `golden/dumps/plants/`, and the
//! two-layer `golden/dumps/legacy-kvb-f32.vllm` (layers 0 and 1). Steps `0..w` are dropped, the later `s{k}.` tensors renumbered, and each
//! sequence whose first kept step has a context declares it `unrecorded` (a prefix-cache hit on a
//! request before the window becomes unrecorded positions too). Every kept step must be judged
//! as in the full dump, site by site; a plant found at the same step and site with the same
//! class; a hostile header or token-id tensor refused with exit 2 naming it.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};
use serde_json::{Value, json};

use crate::common::{compare_json, repo, write_safetensors};
use crate::plant_dumps::verdict;

/// A tensor as written: name, dtype, shape, little-endian bytes.
type Tensor = (String, Dtype, Vec<usize>, Vec<u8>);

/// The integers of an I64 or I32 tensor.
fn ints(dtype: Dtype, data: &[u8]) -> Vec<i64> {
    match dtype {
        Dtype::I64 => data
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
            .collect(),
        Dtype::I32 => data
            .chunks_exact(4)
            .map(|b| i64::from(i32::from_le_bytes(b.try_into().unwrap())))
            .collect(),
        other => panic!("token ids of dtype {other:?}"),
    }
}

fn i64_tensor(name: &str, ids: &[i64]) -> Tensor {
    let bytes = ids.iter().flat_map(|x| x.to_le_bytes()).collect();
    (name.to_string(), Dtype::I64, vec![ids.len()], bytes)
}

/// The tensors and format-2 header of the dump `src`, without the `plant:` patches (a plant is
/// recorded for provenance and judged with the record removed). Sequences without
/// `seq{i}.token_ids` get them from the steps' `s{k}.tokens`.
fn open(src: &Path) -> (Vec<Tensor>, Value) {
    let bytes = std::fs::read(src).unwrap();
    let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    let md = meta.metadata().clone().unwrap();
    assert_eq!(md["format"], "mla-diff dump 2");
    let mut header: Value = serde_json::from_str(&md["header"]).unwrap();
    if let Some(p) = header["patches"].as_array_mut() {
        p.retain(|p| !p["name"].as_str().unwrap_or("").starts_with("plant:"));
    }
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<Tensor> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let n_seq = header["steps"][0]["seqs"].as_array().unwrap().len();
    for i in 0..n_seq {
        let name = format!("seq{i}.token_ids");
        if tensors.iter().any(|t| t.0 == name) {
            continue;
        }
        let mut ids = Vec::new();
        for (k, step) in header["steps"].as_array().unwrap().iter().enumerate() {
            let seqs = step["seqs"].as_array().unwrap();
            let before: usize = seqs[..i].iter().map(|q| q["new"].as_u64().unwrap() as usize).sum();
            let new = seqs[i]["new"].as_u64().unwrap() as usize;
            let t = tensors.iter().find(|t| t.0 == format!("s{k}.tokens")).unwrap();
            ids.extend_from_slice(&ints(t.1, &t.3)[before..before + new]);
        }
        tensors.push(i64_tensor(&name, &ids));
    }
    (tensors, header)
}

/// `(tensors, header)` without steps `0..w`: the later steps' tensors renumbered, each
/// sequence's first kept step with new tokens declaring its context `unrecorded` (its
/// prefix-cache hits dropped: they hit a request before the window), and the token ids of a
/// sequence with no new token in the window dropped (it is not a request the window holds).
fn window((tensors, header): &(Vec<Tensor>, Value), w: usize) -> (Vec<Tensor>, Value) {
    let mut header = header.clone();
    let kept: Vec<Value> = header["steps"].as_array().unwrap()[w..].to_vec();
    let n_seq = kept[0]["seqs"].as_array().unwrap().len();
    let mut steps = kept;
    let mut idle = Vec::new();
    for i in 0..n_seq {
        let Some(first) = steps.iter().position(|s| s["seqs"][i]["new"].as_u64().unwrap() > 0) else {
            idle.push(format!("seq{i}.token_ids"));
            continue;
        };
        let context = steps[first]["seqs"][i]["context"].clone();
        if context.as_u64().unwrap() > 0 {
            steps[first]["seqs"][i]["unrecorded"] = context;
            for s in &mut steps {
                s["seqs"][i].as_object_mut().unwrap().remove("prefix");
            }
        }
    }
    header["steps"] = Value::Array(steps);
    let out = tensors
        .iter()
        .filter(|t| !idle.contains(&t.0))
        .filter_map(|(name, d, s, b)| {
            let renamed = match name.strip_prefix('s').and_then(|r| r.split_once('.')) {
                Some((k, rest)) if k.parse::<usize>().is_ok() && !name.starts_with("seq") => {
                    let k: usize = k.parse().unwrap();
                    (k >= w).then(|| format!("s{}.{rest}", k - w))?
                }
                _ => name.clone(),
            };
            Some((renamed, *d, s.clone(), b.clone()))
        })
        .collect();
    (out, header)
}

/// Writes a format-2 dump of `tensors` and `header` into `dir` as `name`.
fn write(dir: &Path, name: &str, tensors: &[Tensor], header: &Value) -> PathBuf {
    let path = dir.join(name);
    let md: HashMap<String, String> = [
        ("format".to_string(), "mla-diff dump 2".to_string()),
        ("header".to_string(), header.to_string()),
    ]
    .into_iter()
    .collect();
    write_safetensors(&path, tensors, Some(md));
    path
}

/// `(step, site) → status` of a `compare --json` report.
fn statuses(doc: &Value) -> BTreeMap<(String, String), String> {
    doc["sites"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                (
                    s["step"].as_str().unwrap().to_string(),
                    s["site"].as_str().unwrap().to_string(),
                ),
                s["status"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

fn live(case: &str) -> PathBuf {
    repo().join(format!("golden/dumps/live-cpu/legacy-kvb-f32.{case}.safetensors"))
}

fn legacy_model() -> PathBuf {
    repo().join("golden/models/legacy-kvb-f32.gguf")
}

/// The windowed dump `(tensors, header)` judged exactly as the full dump `full` on every kept
/// step: both exit 0, the same (step, site) rows, each with the same status.
fn assert_same_verdicts(dir: &Path, what: &str, full: &Value, windowed: &(Vec<Tensor>, Value)) -> (String, Value) {
    let path = write(
        dir,
        &format!("{}.safetensors", what.replace([' ', '='], "-")),
        &windowed.0,
        &windowed.1,
    );
    let (code, out, err, doc) = compare_json(&legacy_model(), &path, &[]);
    assert_eq!(code, 0, "{what}: {out}\n{err}");
    let kept: Vec<String> = windowed.1["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap().to_string())
        .collect();
    let want: BTreeMap<_, _> = statuses(full)
        .into_iter()
        .filter(|((s, _), _)| kept.contains(s))
        .collect();
    let got = statuses(&doc);
    assert!(!got.is_empty(), "{what}: nothing judged");
    assert_eq!(got, want, "{what}: the kept steps' per-site verdicts");
    (out, doc)
}

/// Every window of the clean scheduled runs judges each kept step as the full dump does: the
/// chunked run from steps 1, 2, 3 and 7 on (its first recorded step a prefill over 1 to 3
/// context chunks whose partials are judged, or a decode row next to a prefill), the prefix run
/// from step 1 on (both requests' context unrecorded, the hit's included), the mixed batch from
/// steps 1 and 2 on. The step that declares the rebuilt positions says so, and so does the
/// report's metadata.
#[test]
fn windows_of_the_scheduled_runs_judge_every_kept_step_as_the_full_dump() {
    let tmp = tempfile::tempdir().unwrap();
    for (case, windows) in [("chunked", &[1, 2, 3, 7][..]), ("prefix", &[1]), ("batch", &[1, 2])] {
        let src = live(case);
        let (code, _, err, full) = compare_json(&legacy_model(), &src, &[]);
        assert_eq!(code, 0, "{case}: {err}");
        let dump = open(&src);
        for &w in windows {
            let windowed = window(&dump, w);
            let what = format!("{case} w={w}");
            let (out, doc) = assert_same_verdicts(tmp.path(), &what, &full, &windowed);
            let first = &windowed.1["steps"][0];
            let line: Vec<String> = first["seqs"]
                .as_array()
                .unwrap()
                .iter()
                .enumerate()
                .filter_map(|(i, q)| q["unrecorded"].as_u64().map(|n| format!("seq {i} positions 0..{n}")))
                .collect();
            assert!(!line.is_empty(), "{what}: nothing unrecorded");
            let line = line.join(", ");
            assert_eq!(doc["dump"]["metadata"]["context_rebuilt"], line.as_str(), "{what}");
            assert!(
                out.contains(&format!("note: context rebuilt from token ids: {line} (not judged)")),
                "{what}: {out}"
            );
        }
    }
}

/// The expected values of the windows above, spelled out for the chunked run from step 3 on: its
/// first recorded step reads both requests' context (24 and 8 positions, the shorter's second
/// chunk empty) in two chunks, every partial judged and passing.
#[test]
fn the_first_recorded_steps_context_partials_are_judged() {
    let tmp = tempfile::tempdir().unwrap();
    let windowed = window(&open(&live("chunked")), 3);
    assert_eq!(windowed.1["steps"][0]["name"], "step-3");
    assert_eq!(windowed.1["steps"][0]["seqs"][0]["unrecorded"], 24);
    assert_eq!(windowed.1["steps"][0]["seqs"][1]["unrecorded"], 8);
    let path = write(tmp.path(), "w3.safetensors", &windowed.0, &windowed.1);
    let (code, out, err, doc) = compare_json(&legacy_model(), &path, &[]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert_eq!(
        doc["dump"]["metadata"]["context_rebuilt"],
        "seq 0 positions 0..24, seq 1 positions 0..8"
    );
    let st = statuses(&doc);
    for site in [
        "L0.ctx_out.c0",
        "L0.ctx_lse.c0",
        "L0.ctx_out.c1",
        "L0.ctx_lse.c1",
        "L0.ctx_out",
        "L0.ctx_lse",
        "L0.suffix_out",
        "L0.suffix_lse",
        "L0.attn_out",
    ] {
        assert_eq!(
            st.get(&("step-3".to_string(), site.to_string())).map(String::as_str),
            Some("pass"),
            "{site} in step-3"
        );
    }
}

/// A plant of the chunk loop or the merge in a window is found at the same step and site, with
/// the same class, as in the full dump, also when the window starts at the step it first shows
/// in.
#[test]
fn a_planted_bug_in_a_window_is_found_where_the_full_dump_shows_it() {
    let tmp = tempfile::tempdir().unwrap();
    for (case, want, windows) in [
        ("ctx-empty-lse-inf", "lse-merge at L0.ctx_lse.c1 in step-3", &[2, 3][..]),
        ("merge-suffix-stride", "strided-view at L0.attn_out in step-1", &[1]),
        (
            "ctx-chunk-unwritten",
            "phantom-output at L0.ctx_out.c1 in step-3",
            &[1, 3],
        ),
    ] {
        let dump = open(&live(case));
        for &w in windows {
            let (tensors, header) = window(&dump, w);
            let path = write(tmp.path(), &format!("{case}-w{w}.safetensors"), &tensors, &header);
            let (code, got, out) = verdict(case, &legacy_model(), &path);
            assert_eq!((code, got.as_str()), (1, want), "{case} w={w}: {out}");
            assert!(out.contains(&format!("finding [dump] {want}: ")), "{case} w={w}: {out}");
        }
    }
}

/// A two-layer dump (vLLM's prefill and two decodes of legacy-kvb-f32, layers 0 and 1) recorded
/// from its first or second decode on: layer 1's unrecorded inputs are the reference's layer 0
/// over the embedded token ids, and every kept step's sites are judged as in the full dump. A
/// token id changed inside the unrecorded positions changes the context the decode attends to:
/// the rebuild reads the token ids, and the decode diverges.
#[test]
fn a_window_of_a_two_layer_dump_rebuilds_layer_1_from_the_token_ids() {
    let tmp = tempfile::tempdir().unwrap();
    let src = repo().join("golden/dumps/legacy-kvb-f32.vllm.safetensors");
    let (code, _, err, full) = compare_json(&legacy_model(), &src, &[]);
    assert_eq!(code, 0, "{err}");
    let dump = open(&src);
    for w in [1, 2] {
        let windowed = window(&dump, w);
        let (_, doc) = assert_same_verdicts(tmp.path(), &format!("two-layer w={w}"), &full, &windowed);
        assert_eq!(
            doc["dump"]["metadata"]["context_rebuilt"],
            format!("seq 0 positions 0..{}", 5 + w)
        );
        let judged = doc["sites"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|s| s["site"] == "L1.attn_out" && s["status"] == "pass")
            .count();
        assert_eq!(judged, 3 - w, "L1.attn_out judged in every kept step");
    }
    let (mut tensors, header) = window(&dump, 1);
    let ids = tensors.iter_mut().find(|t| t.0 == "seq0.token_ids").unwrap();
    let mut v = ints(ids.1, &ids.3);
    v[2] = (v[2] + 1) % 256;
    *ids = i64_tensor("seq0.token_ids", &v);
    let path = write(tmp.path(), "wrong-context.safetensors", &tensors, &header);
    let (code, out, err, doc) = compare_json(&legacy_model(), &path, &[]);
    assert_eq!(code, 1, "{out}\n{err}");
    let failing = statuses(&doc)
        .into_iter()
        .find(|(_, s)| s != "pass")
        .map(|(k, _)| k)
        .unwrap();
    assert_eq!(failing.0, "decode-1", "{out}");
}

/// A hostile `unrecorded` or token-id tensor in a window of the chunked run (from step 3 on):
/// exit 2, one line naming the file and the field or tensor.
#[test]
fn hostile_unrecorded_positions_are_input_errors_naming_the_field() {
    let tmp = tempfile::tempdir().unwrap();
    let base = window(&open(&live("chunked")), 3);
    type Edit = Box<dyn Fn(&mut Vec<Tensor>, &mut Value)>;
    let set = |k: usize, i: usize, f: &'static str, v: Value| -> Edit {
        Box::new(move |_, h| h["steps"][k]["seqs"][i][f] = v.clone())
    };
    let field = |k: usize, i: usize, f: &str| format!("__metadata__.header.steps[{k}].seqs[{i}].{f}");
    let cases: Vec<(String, &str, Edit)> = vec![
        // On a later step than the sequence's first with new tokens.
        (
            field(1, 0, "unrecorded"),
            "already has 8 tokens",
            set(1, 0, "unrecorded", json!(32)),
        ),
        // On a step where the sequence has no new token.
        (
            field(6, 0, "unrecorded"),
            "has no new token",
            set(6, 0, "unrecorded", json!(58)),
        ),
        // Not the step's context.
        (
            field(0, 0, "unrecorded"),
            "the step's context is 24",
            set(0, 0, "unrecorded", json!(23)),
        ),
        // Next to a prefix-cache hit.
        (
            field(0, 1, "unrecorded"),
            "prefix-cache hit",
            set(0, 1, "prefix", json!({"seq": 0, "len": 8})),
        ),
        // Out of range, not an integer, zero.
        (
            field(0, 0, "unrecorded"),
            "2³²",
            set(0, 0, "unrecorded", json!(1u64 << 40)),
        ),
        (field(0, 0, "unrecorded"), "2³²", set(0, 0, "unrecorded", json!("24"))),
        (field(0, 0, "unrecorded"), "2³²", set(0, 0, "unrecorded", json!(0))),
        // Not declared: the context is what no earlier step computed.
        (field(0, 0, "context"), "unrecorded", {
            Box::new(|_, h| {
                h["steps"][0]["seqs"][0].as_object_mut().unwrap().remove("unrecorded");
            })
        }),
        // The token ids the rebuild reads: missing, too short.
        ("seq0.token_ids".to_string(), "missing", {
            Box::new(|t, _| t.retain(|t| t.0 != "seq0.token_ids"))
        }),
        ("seq0.token_ids".to_string(), "expected [58]", {
            Box::new(|t, _| {
                let ids = t.iter_mut().find(|t| t.0 == "seq0.token_ids").unwrap();
                let v = ints(ids.1, &ids.3);
                *ids = i64_tensor("seq0.token_ids", &v[..20]);
            })
        }),
        // Token ids that differ from a recorded step's tokens.
        ("s0.tokens".to_string(), "seq0.token_ids[26]", {
            Box::new(|t, _| {
                let ids = t.iter_mut().find(|t| t.0 == "seq0.token_ids").unwrap();
                let mut v = ints(ids.1, &ids.3);
                v[26] = (v[26] + 1) % 256;
                *ids = i64_tensor("seq0.token_ids", &v);
            })
        }),
    ];
    for (n, (name, says, edit)) in cases.into_iter().enumerate() {
        let (mut tensors, mut header) = base.clone();
        edit(&mut tensors, &mut header);
        let path = write(tmp.path(), &format!("hostile-{n}.safetensors"), &tensors, &header);
        let (code, out, err, _) = compare_json(&legacy_model(), &path, &[]);
        assert_eq!(code, 2, "{name}: {out}\n{err}");
        assert!(
            err.contains(&format!("hostile-{n}.safetensors")) && err.contains(&name) && err.contains(says),
            "{name} ({says}): {err}"
        );
        assert_eq!(err.trim().lines().count(), 1, "{err}");
    }
}

/// The decode plants of `golden/dumps/plants/` recorded from their first decode on (the
/// prefill's positions unrecorded): the paged-cache replays (which take the unrecorded
/// positions as written at the slots their block tables give), the split-KV merge replays and
/// the precision replay name the same class at the same site and step, and the clean run passes.
#[test]
fn a_window_from_the_first_decode_keeps_the_decode_plants_verdicts() {
    let tmp = tempfile::tempdir().unwrap();
    for (case, want) in [
        ("legacy-kvb-q8_0.clean-splits4", "clean"),
        (
            "legacy-kvb-q8_0.page-size-ignored",
            "paged-kv at L0.attn_latent in decode-1",
        ),
        (
            "legacy-kvb-q8_0.block-table-offset",
            "paged-kv at L0.attn_latent in decode-1",
        ),
        (
            "legacy-kvb-q8_0.slot-mapping-offset",
            "paged-kv at L0.attn_latent in decode-1",
        ),
        (
            "legacy-kvb-q8_0.block-id-truncated",
            "paged-kv at L0.attn_latent in decode-1",
        ),
        (
            "legacy-kvb-q8_0.split-lse-base2",
            "lse-merge at L0.attn_latent in decode-1",
        ),
        (
            "legacy-kvb-q8_0.empty-split-lse-inf",
            "lse-merge at L0.attn_latent in decode-1",
        ),
        ("legacy-kvb-q8_0.fp16-ql-nope", "precision at L0.ql_nope in decode-1"),
    ] {
        let src = repo().join(format!("golden/dumps/plants/{case}.safetensors"));
        let (tensors, header) = window(&open(&src), 1);
        let prefill = open(&src).1["steps"][0]["seqs"][0]["new"].clone();
        assert_eq!(header["steps"][0]["seqs"][0]["unrecorded"], prefill, "{case}");
        let path = write(tmp.path(), &format!("{case}.safetensors"), &tensors, &header);
        let model = repo().join("golden/models/legacy-kvb-q8_0.gguf");
        let (code, got, out) = verdict(case, &model, &path);
        assert_eq!(
            (code, got.as_str()),
            (i32::from(want != "clean"), want),
            "{case}: {out}"
        );
    }
}

/// The prefix run from its step 1 on, the second request's prefix-cache hit kept as a hit on
/// the first request's unrecorded positions (cached before the window, declared in the same
/// step): its 48 positions take the rows rebuilt for the first request, and every kept step is
/// judged as in the full dump. A hit longer than those positions is refused, naming the hit.
#[test]
fn a_prefix_hit_on_unrecorded_positions_reads_the_rebuilt_rows() {
    let tmp = tempfile::tempdir().unwrap();
    let src = live("prefix");
    let (code, _, err, full) = compare_json(&legacy_model(), &src, &[]);
    assert_eq!(code, 0, "{err}");
    let dump = open(&src);
    let (tensors, mut header) = window(&dump, 1);
    assert_eq!(header["steps"][0]["seqs"][0]["unrecorded"], 56);
    for step in header["steps"].as_array_mut().unwrap() {
        let q = step["seqs"][1].as_object_mut().unwrap();
        if q["new"].as_u64().unwrap() > 0 {
            q.remove("unrecorded");
            q.insert("prefix".into(), json!({"seq": 0, "len": 48}));
        }
    }
    let (_, doc) = assert_same_verdicts(
        tmp.path(),
        "prefix w=1 hit kept",
        &full,
        &(tensors.clone(), header.clone()),
    );
    assert_eq!(doc["dump"]["metadata"]["context_rebuilt"], "seq 0 positions 0..56");
    let mut long = header;
    long["steps"][0]["seqs"][0]["unrecorded"] = json!(56);
    long["steps"][0]["seqs"][1]["prefix"] = json!({"seq": 0, "len": 57});
    long["steps"][0]["seqs"][1]["context"] = json!(57);
    let path = write(tmp.path(), "long-hit.safetensors", &tensors, &long);
    let (code, _, err, _) = compare_json(&legacy_model(), &path, &[]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("steps[0].seqs[1].prefix") && err.contains("holds 56 cached positions"),
        "{err}"
    );
}
