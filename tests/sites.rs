//! `mla-diff sites`: the site vocabulary the Python hooks test against.
//!
//! Its JSON is a contract (the hooks' pytest reads it), so the object is pinned here: its keys,
//! the stage list equal to `STAGES`' names in data-flow order, the ranked weights, the templates
//! and the format markers. The templates must name tensors the dump reader takes as sites, and
//! the table's shapes in dim names must be the shapes the reader checks.

use std::collections::BTreeMap;

use mla_diff::core::trace::{RankedWeight, STAGES, Site, Stage};
use mla_diff::model::config::MlaConfig;
use mla_diff::model::dump::{self, SiteVocabulary};
use mla_diff::model::gguf::GgufFile;

use crate::common::{repo, run_bin};

/// `mla-diff sites --json`, parsed (the run must exit 0 with nothing on stderr).
fn sites_json() -> serde_json::Value {
    let (code, out, err) = run_bin(&["sites", "--json"]);
    assert_eq!(code, 0, "{err}");
    assert!(err.is_empty(), "{err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"))
}

/// `template` with each `{key}` of `fills` replaced.
fn fill(template: &str, fills: &[(&str, &str)]) -> String {
    fills
        .iter()
        .fold(template.to_string(), |s, (k, v)| s.replace(&format!("{{{k}}}"), v))
}

#[test]
fn json_is_the_pinned_object_from_the_rust_constants() {
    let v = sites_json();
    let keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
    let mut want_keys = vec!["stages", "ranked_weights", "site_templates", "dump_formats"];
    want_keys.sort_unstable();
    let mut got_keys = keys.clone();
    got_keys.sort_unstable();
    assert_eq!(got_keys, want_keys);
    let names: Vec<String> = STAGES.iter().map(Stage::name).collect();
    let stages: Vec<&str> = v["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap())
        .collect();
    assert_eq!(stages, names);
    assert_eq!(stages.first(), Some(&"hidden_in"));
    assert_eq!(&stages[..3], ["hidden_in", "attn_in", "w.fused_qkv_a"]);
    assert_eq!(stages.last(), Some(&"hidden_out"));
    let weights: Vec<&str> = RankedWeight::ALL.iter().map(|w| w.as_str()).collect();
    assert_eq!(v["ranked_weights"], serde_json::json!(weights));
    assert_eq!(
        v["ranked_weights"],
        serde_json::json!(["q_b", "kv_b", "o_proj", "gate_up", "down"])
    );
    assert_eq!(
        v["site_templates"],
        serde_json::json!({
            "layer": "L{layer}.{stage}",
            "weight_rank": "L{layer}.w.{weight}.rank{rank}",
            "o_proj_rank": "L{layer}.o_proj.rank{rank}",
            "ffn_gate_up_rank": "L{layer}.ffn_gate_up.rank{rank}",
            "ffn_down_rank": "L{layer}.ffn_down.rank{rank}",
            "ctx_out_chunk": "L{layer}.ctx_out.c{chunk}",
            "ctx_lse_chunk": "L{layer}.ctx_lse.c{chunk}",
        })
    );
    assert_eq!(v["dump_formats"], serde_json::json!([dump::FORMAT1, dump::FORMAT2]));
    assert_eq!(v, serde_json::to_value(SiteVocabulary::current()).unwrap());
}

#[test]
fn templates_name_sites_the_reader_accepts() {
    let v = SiteVocabulary::current();
    let t = &v.site_templates;
    for (k, stage) in v.stages.iter().enumerate() {
        let name = fill(&t.layer, &[("layer", "7"), ("stage", stage)]);
        assert_eq!(Site::parse(&name), Some(Site::new(7, STAGES[k])), "{name}");
    }
    for (w, weight) in RankedWeight::ALL.iter().zip(&v.ranked_weights) {
        let name = fill(&t.weight_rank, &[("layer", "3"), ("weight", weight), ("rank", "1")]);
        assert_eq!(Site::parse(&name), Some(Site::new(3, Stage::WRank(*w, 1))), "{name}");
    }
    let name = fill(&t.o_proj_rank, &[("layer", "0"), ("rank", "2")]);
    assert_eq!(Site::parse(&name), Some(Site::new(0, Stage::OProjRank(2))), "{name}");
    let name = fill(&t.ffn_gate_up_rank, &[("layer", "1"), ("rank", "3")]);
    assert_eq!(
        Site::parse(&name),
        Some(Site::new(1, Stage::FfnGateUpRank(3))),
        "{name}"
    );
    let name = fill(&t.ffn_down_rank, &[("layer", "2"), ("rank", "0")]);
    assert_eq!(Site::parse(&name), Some(Site::new(2, Stage::FfnDownRank(0))), "{name}");

    // A dump whose tensors are named by the templates: every one is read as its site.
    let file = mla_diff::model::fixture::open_model(None).unwrap();
    let cfg = MlaConfig::from_gguf(&file).unwrap();
    let tokens = 2;
    let f32s = |n: usize| -> Vec<u8> { (0..n).flat_map(|i| (i as f32 * 0.01).to_le_bytes()).collect() };
    let names = [
        fill(&t.layer, &[("layer", "0"), ("stage", &v.stages[0])]),
        fill(
            &t.weight_rank,
            &[("layer", "0"), ("weight", v.ranked_weights[1]), ("rank", "1")],
        ),
        fill(&t.o_proj_rank, &[("layer", "0"), ("rank", "1")]),
    ];
    let shapes = [
        vec![tokens, cfg.hidden],
        vec![4, cfg.kv_lora_rank],
        vec![tokens, cfg.hidden],
    ];
    let bytes: Vec<Vec<u8>> = shapes.iter().map(|s| f32s(s.iter().product())).collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = names
        .iter()
        .zip(&shapes)
        .zip(&bytes)
        .map(|((n, s), b)| {
            let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b).unwrap();
            (n.clone(), view)
        })
        .collect();
    let meta = [("format".to_string(), v.dump_formats[0].to_string())];
    let st = safetensors::serialize(views, Some(meta.into_iter().collect())).unwrap();
    let d = dump::load_bytes(std::path::Path::new("templates.safetensors"), &st, None, &cfg).unwrap();
    assert!(d.ignored.is_empty(), "{:?}", d.ignored);
    let read: Vec<String> = d.layers[&0].sites_in_order().iter().map(Site::to_string).collect();
    let mut want = names.to_vec();
    want.sort_by_key(|n| Site::parse(n).unwrap().order());
    assert_eq!(read, want);
}

/// The value of a shape term in dim names (`N·(P+V)`, `min(K_idx, S)`, `Lq+L+R`): sums of
/// products of dims, parentheses and `min(a, b)`.
fn eval(term: &str, dims: &BTreeMap<&str, usize>) -> usize {
    let term = term.trim();
    let top = |sep: char| -> Vec<&str> {
        let (mut depth, mut start, mut parts) = (0i32, 0, Vec::new());
        for (i, c) in term.char_indices() {
            match c {
                '(' => depth += 1,
                ')' => depth -= 1,
                c if c == sep && depth == 0 => {
                    parts.push(&term[start..i]);
                    start = i + c.len_utf8();
                }
                _ => {}
            }
        }
        parts.push(&term[start..]);
        parts
    };
    let sum = top('+');
    if sum.len() > 1 {
        return sum.iter().map(|t| eval(t, dims)).sum();
    }
    let product = top('·');
    if product.len() > 1 {
        return product.iter().map(|t| eval(t, dims)).product();
    }
    if let Some(inner) = term.strip_prefix("min(").and_then(|r| r.strip_suffix(')')) {
        let (a, b) = inner.split_once(',').unwrap();
        return eval(a, dims).min(eval(b, dims));
    }
    if let Some(inner) = term.strip_prefix('(').and_then(|r| r.strip_suffix(')')) {
        return eval(inner, dims);
    }
    *dims.get(term).unwrap_or_else(|| panic!("unknown dim `{term}`"))
}

/// A shape in dim names (`[T, N, P+R]`) evaluated with `dims`.
fn eval_shape(shape: &str, dims: &BTreeMap<&str, usize>) -> Vec<usize> {
    let inner = shape.strip_prefix('[').and_then(|s| s.strip_suffix(']')).unwrap();
    let mut out = Vec::new();
    let (mut depth, mut start) = (0i32, 0);
    for (i, c) in inner.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(eval(&inner[start..i], dims));
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(eval(&inner[start..], dims));
    out
}

#[test]
fn table_shapes_are_the_shapes_the_reader_checks() {
    let (t, s_keys) = (5, 7);
    let mut checked = std::collections::BTreeSet::new();
    for model in [
        "tiny-v3-q4_k_m.gguf",
        "lite-v2-q8_0.gguf",
        "minicpm3-q8_0.gguf",
        "moe-v3-q8_0.gguf",
        "dsa-glm-q8_0.gguf",
        "dsa-v32-q8_0.gguf",
    ] {
        let cfg = MlaConfig::from_gguf(&GgufFile::open(repo().join("golden/models").join(model)).unwrap()).unwrap();
        let mut dims: BTreeMap<&str, usize> = [
            ("T", t),
            // expected_shape_keys takes the context partials' rows (Tc) where it takes T, and the
            // DSA sites' key positions S apart (a decode step's T rows over S > T keys).
            ("Tc", t),
            ("S", s_keys),
            ("N", cfg.n_head),
            ("H", cfg.hidden),
            ("Lq", cfg.q_lora_rank.unwrap_or(0)),
            ("L", cfg.kv_lora_rank),
            ("P", cfg.qk_nope_head_dim),
            ("R", cfg.qk_rope_head_dim),
            ("V", cfg.v_head_dim),
        ]
        .into_iter()
        .collect();
        if let Some(m) = &cfg.moe {
            dims.extend([("E", m.n_expert), ("K", m.n_expert_used)]);
        }
        if let Some(ix) = &cfg.indexer {
            dims.extend([("N_idx", ix.n_head), ("D_idx", ix.head_dim), ("K_idx", ix.top_k)]);
        }
        for &stage in STAGES {
            let Some(want) = dump::expected_shape_keys(stage, &cfg, t, s_keys) else {
                continue;
            };
            let row = dump::stage_row(stage);
            assert_eq!(
                eval_shape(row.shape, &dims),
                want,
                "{model}: {} {}",
                row.name,
                row.shape
            );
            checked.insert(row.name);
        }
    }
    // Every stage but the [T, I] FFN sites, whose width I differs between a model's dense and
    // MoE layers (the comparison checks them against the reference's shape).
    let all: std::collections::BTreeSet<String> = STAGES
        .iter()
        .filter(|&&s| dump::stage_row(s).shape != "[T, I]")
        .map(Stage::name)
        .collect();
    assert_eq!(checked, all, "stages no fixture checked");
}

#[test]
fn table_lists_every_name() {
    let (code, out, err) = run_bin(&["sites"]);
    assert_eq!(code, 0, "{err}");
    let v = SiteVocabulary::current();
    for row in v.rows() {
        assert!(
            out.lines().any(|l| l.contains(&format!(" {} ", row.name))),
            "{} missing:\n{out}",
            row.name
        );
    }
    assert!(out.contains("`L{layer}.{stage}`"), "{out}");
    assert!(out.contains("`mla-diff dump 1`, `mla-diff dump 2`"), "{out}");
}
