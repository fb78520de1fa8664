//! Dequantization is bit-exact against gguf-py (`gguf.quants.dequantize`, itself bit-exact with
//! ggml's C code) for every ggml type present in the committed fixtures, plus the other types the
//! vector file carries. Vectors: `golden/dequant/vectors.safetensors`, made by
//! `scripts/fixtures/make_dequant_vectors.py` (raw blocks from the real fixtures where a type occurs).

use crate::common;

use mla_diff::model::gguf::{GgmlType, GgufFile, dequant::dequantize};
use safetensors::SafeTensors;

#[test]
fn every_vector_is_bit_exact() {
    let bytes = std::fs::read(common::repo().join("golden/dequant/vectors.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<String> = st
        .names()
        .iter()
        .filter_map(|n| n.strip_suffix(".raw").map(str::to_string))
        .collect();
    names.sort();
    assert!(names.len() >= 15, "{names:?}");
    for name in &names {
        let ty = GgmlType::from_name(name).unwrap_or_else(|| panic!("unknown type {name}"));
        let raw = st.tensor(&format!("{name}.raw")).unwrap();
        let exp = st.tensor(&format!("{name}.expected")).unwrap();
        let expected: Vec<u32> = exp
            .data()
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let got = dequantize(ty, raw.data(), expected.len()).unwrap();
        let mismatches = got.iter().zip(&expected).filter(|(g, e)| g.to_bits() != **e).count();
        assert_eq!(
            mismatches,
            0,
            "{name}: {mismatches} of {} values differ in bits",
            expected.len()
        );
    }
}

#[test]
fn every_type_in_the_fixtures_has_a_vector() {
    let bytes = std::fs::read(common::repo().join("golden/dequant/vectors.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let dir = common::repo().join("golden/models");
    let mut seen = std::collections::BTreeSet::new();
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "gguf") {
            for t in GgufFile::open(&p).unwrap().tensors() {
                seen.insert(t.ggml_type);
            }
        }
    }
    assert!(seen.contains(&GgmlType::Q4_K) && seen.contains(&GgmlType::Q6_K));
    for ty in seen {
        assert!(st.tensor(&format!("{}.raw", ty.name())).is_ok(), "no vector for {ty}");
    }
}
