//! The tensor table (`model::tensors`) against what it describes: the table in
//! docs/architectures.md lists exactly its rows, in order, and every tensor of every committed
//! fixture is one of them.

use std::path::Path;

use mla_diff::model::gguf::GgufFile;
use mla_diff::model::tensors::ModelTensor;

/// One Markdown row of docs/architectures.md's tensor table, rendered from the code's row.
fn doc_row(t: ModelTensor) -> String {
    let row = t.row();
    let name = format!(
        "`{}.{}`{}",
        row.short,
        row.suffix.as_str(),
        if row.per_layer { "" } else { " (global)" }
    );
    let mut sites: Vec<String> = row.sites.iter().map(|s| format!("`{}`", s.name())).collect();
    if let Some(w) = row.ranked {
        sites.push(format!("`w.{}.rank<r>`", w.as_str()));
    }
    let sites = if sites.is_empty() {
        "—".to_string()
    } else {
        sites.join(", ")
    };
    let (param, split) = match row.vllm {
        None => ("—".to_string(), "—".to_string()),
        Some(v) => (
            match v.merged {
                None => format!("`{}`", v.param),
                Some(m) => format!("`{}` shard {} (`{}`)", v.param, m.shard, m.checkpoint),
            },
            v.split.to_string(),
        ),
    };
    format!("| {name} | {} | {sites} | {param} | {split} |", row.shape)
}

#[test]
fn the_docs_table_lists_every_row_of_the_code_in_order() {
    let doc = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/architectures.md")).unwrap();
    let header = "| GGUF tensor | shape | weight sites | vLLM parameter | TP split |";
    let start = doc.find(header).expect("docs/architectures.md has the tensor table");
    let got: Vec<&str> = doc[start..]
        .lines()
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .collect();
    let want: Vec<String> = ModelTensor::ALL.into_iter().map(doc_row).collect();
    assert_eq!(
        got, want,
        "docs/architectures.md's tensor table differs from model::tensors"
    );
}

#[test]
fn every_tensor_of_every_fixture_is_in_the_table() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("golden/models");
    let mut seen = std::collections::BTreeSet::new();
    let mut files = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_none_or(|x| x != "gguf") {
            continue;
        }
        files += 1;
        let f = GgufFile::open(&p).unwrap();
        for t in f.tensors() {
            let Some((layer, id)) = ModelTensor::parse(&t.name) else {
                panic!("{}: `{}` is not in model::tensors", p.display(), t.name);
            };
            assert_eq!(id.name(layer.unwrap_or(0)), t.name);
            seen.insert(id);
        }
    }
    assert!(files >= 10, "{files} fixtures");
    // The fixtures hold every kind except MiniCPM3's LongRoPE factors (tested on a synthetic
    // file in tests/config.rs).
    let missing: Vec<_> = ModelTensor::ALL.into_iter().filter(|t| !seen.contains(t)).collect();
    assert_eq!(missing, vec![ModelTensor::RopeFactorsShort]);
}
