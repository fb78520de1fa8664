//! `MlaConfig::from_gguf` on every metadata variant real converters write.

use crate::common;

use crate::common::{Dims, Val, deepseek2};
use mla_diff::model::config::{KvBLayout, MlaConfig};
use mla_diff::model::gguf::GgufFile;

fn cfg_of(g: &common::GgufBuilder) -> Result<MlaConfig, mla_diff::Error> {
    MlaConfig::from_gguf(&GgufFile::from_bytes("t.gguf", g.build().bytes).unwrap())
}

#[test]
fn mla_era_file_with_q_lora() {
    let c = cfg_of(&deepseek2(Dims::default(), false)).unwrap();
    assert_eq!(
        (
            c.n_head,
            c.hidden,
            c.q_lora_rank,
            c.kv_lora_rank,
            c.qk_nope_head_dim,
            c.qk_rope_head_dim,
            c.v_head_dim
        ),
        (3, 32, Some(16), 24, 8, 4, 12)
    );
    assert_eq!(c.dims().nlprv(), [3, 24, 8, 4, 12]);
    assert_eq!(c.kv_b_layout, KvBLayout::Split);
    assert_eq!(c.vocab, 20);
    approx::assert_relative_eq!(c.softmax_scale, 12f64.powf(-0.5), max_relative = 1e-15);
}

#[test]
fn q_lora_rank_absent_or_zero_means_no_q_compression() {
    let d = Dims {
        lq: None,
        ..Dims::default()
    };
    let g = deepseek2(d, false);
    assert_eq!(cfg_of(&g).unwrap().q_lora_rank, None);
    let mut g0 = g.clone();
    g0.kv("deepseek2.attention.q_lora_rank", Val::U32(0));
    assert_eq!(cfg_of(&g0).unwrap().q_lora_rank, None);
}

#[test]
fn legacy_file_reads_head_dims_from_key_and_value_length() {
    let c = cfg_of(&deepseek2(Dims::default(), true)).unwrap();
    assert_eq!(c.kv_b_layout, KvBLayout::Fused);
    assert_eq!((c.qk_nope_head_dim, c.v_head_dim), (8, 12));
}

#[test]
fn yarn_softmax_scale_matches_mla_md() {
    // DeepSeek-V2-Lite: P+R = 192, factor 40, mscale_all_dim 0.707 → 0.114721 (docs/mla.md step 7).
    let d = Dims {
        p: 128,
        r: 64,
        v: 128,
        ..Dims::default()
    };
    let mut g = deepseek2(d, false);
    g.kv("deepseek2.rope.scaling.type", Val::Str("yarn".into()));
    g.kv("deepseek2.rope.scaling.factor", Val::F32(40.0));
    g.kv("deepseek2.rope.scaling.original_context_length", Val::U32(4096));
    g.kv("deepseek2.rope.scaling.yarn_log_multiplier", Val::F32(0.0707));
    let c = cfg_of(&g).unwrap();
    approx::assert_abs_diff_eq!(c.softmax_scale, 0.114721, epsilon = 5e-7);
    // DeepSeek-V3: mscale_all_dim 1.0 → 0.135234.
    g.set_kv("deepseek2.rope.scaling.yarn_log_multiplier", Val::F32(0.1));
    approx::assert_abs_diff_eq!(cfg_of(&g).unwrap().softmax_scale, 0.135234, epsilon = 5e-7);
    // Plain: 192^-0.5 = 0.072169.
    g.set_kv("deepseek2.rope.scaling.type", Val::Str("none".into()));
    approx::assert_abs_diff_eq!(cfg_of(&g).unwrap().softmax_scale, 0.072169, epsilon = 5e-7);
}

#[test]
fn yarn_without_factor_names_the_key() {
    let mut g = deepseek2(Dims::default(), false);
    g.kv("deepseek2.rope.scaling.type", Val::Str("yarn".into()));
    let e = cfg_of(&g).unwrap_err().to_string();
    assert!(e.contains("deepseek2.rope.scaling.factor"), "{e}");
    g.set_kv("deepseek2.rope.scaling.type", Val::Str("linear".into()));
    let e = cfg_of(&g).unwrap_err().to_string();
    assert!(e.contains("rope.scaling.type") && e.contains("linear"), "{e}");
}

#[test]
fn wrong_value_type_names_the_key_and_type() {
    let mut g = deepseek2(Dims::default(), false);
    g.set_kv("deepseek2.attention.head_count", Val::Str("six".into()));
    let e = cfg_of(&g).unwrap_err().to_string();
    assert!(
        e.contains("deepseek2.attention.head_count") && e.contains("string"),
        "{e}"
    );
}

#[test]
fn mtp_blocks_are_outside_the_trunk() {
    // The V3.2 / GLM-5 / GLM-4.7-Flash converters append NextN (MTP) blocks and count them in
    // block_count; `--layers all` and the token path cover the trunk only.
    let g0 = deepseek2(Dims::default(), false);
    let n = cfg_of(&g0).unwrap().n_layer;
    let mut g = g0.clone();
    g.kv("deepseek2.nextn_predict_layers", Val::U32(1));
    let c = cfg_of(&g).unwrap();
    assert_eq!((c.n_layer, c.nextn_predict_layers, c.trunk_layers()), (n, 1, n - 1));
    let mut g = g0.clone();
    g.kv("deepseek2.nextn_predict_layers", Val::U32(n as u32));
    let e = cfg_of(&g).unwrap_err().to_string();
    assert!(
        e.contains("deepseek2.nextn_predict_layers") && e.contains("no trunk"),
        "{e}"
    );
}

#[test]
fn dsa_and_minicpm3_fixtures_read_their_architecture_keys() {
    let open = |m: &str| {
        let f = GgufFile::open(common::repo().join("golden/models").join(m)).unwrap();
        MlaConfig::from_gguf(&f).unwrap()
    };
    use mla_diff::model::config::RopeStyle;
    let v32 = open("dsa-v32-q8_0.gguf");
    let ix = v32.indexer.as_ref().unwrap();
    assert_eq!(
        (ix.n_head, ix.head_dim, ix.top_k, ix.rope_style),
        (8, 64, 8, RopeStyle::Neox)
    );
    assert_eq!(
        (ix.full.clone(), v32.rope_style),
        (vec![true, true], RopeStyle::Interleaved)
    );
    let glm = open("dsa-glm-f32.gguf");
    let ix = glm.indexer.as_ref().unwrap();
    assert_eq!(
        (ix.rope_style, ix.full.clone()),
        (RopeStyle::Interleaved, vec![true, true, false])
    );
    assert_eq!(ix.source_layer(2), Some(1));
    let m3 = open("minicpm3-f32.gguf");
    assert!(m3.indexer.is_none());
    assert_eq!(
        (m3.rope_style, m3.kv_b_layout, m3.v_head_dim),
        (RopeStyle::Neox, KvBLayout::Fused, 32)
    );
    assert_eq!(m3.embedding_scale, 12.0);
    approx::assert_relative_eq!(m3.residual_scale, 1.4 / 2f64.sqrt(), max_relative = 1e-15);
    // deepseek2 keeps the plain settings.
    let t = open("tiny-v3-f32.gguf");
    assert_eq!(
        (t.rope_style, t.embedding_scale, t.residual_scale),
        (RopeStyle::Interleaved, 1.0, 1.0)
    );
}

#[test]
fn longrope_short_factors_divide_the_rope_frequencies() {
    // MiniCPM3-style `rope_factors_short.weight` [R/2]: θ_i = base^(−2i/R) / factor_i, in the
    // reference and, through the same config, the engine paths.
    let d = Dims::default();
    let r = cfg_of(&deepseek2(d, false)).unwrap().qk_rope_head_dim;
    let factors: Vec<f32> = (0..r / 2).map(|i| 1.0 + i as f32).collect();
    let mut g = deepseek2(d, false);
    g.f32_tensor("rope_factors_short.weight", &[(r / 2) as u64], &factors);
    let c = cfg_of(&g).unwrap();
    assert_eq!(
        c.rope_factors.as_deref(),
        Some(&factors.iter().map(|&x| f64::from(x)).collect::<Vec<_>>()[..])
    );
    let plain = mla_diff::compute::reference::rope_inv_freq(&cfg_of(&deepseek2(d, false)).unwrap());
    let scaled = mla_diff::compute::reference::rope_inv_freq(&c);
    for (i, (p, s)) in plain.iter().zip(&scaled).enumerate() {
        approx::assert_relative_eq!(*s, p / (1.0 + i as f64), max_relative = 1e-15);
    }
    // A factor tensor of the wrong length is an error naming the tensor.
    let mut bad = deepseek2(d, false);
    bad.f32_tensor(
        "rope_factors_short.weight",
        &[(r / 2 + 1) as u64],
        &vec![1.0; r / 2 + 1],
    );
    let e = cfg_of(&bad).unwrap_err().to_string();
    assert!(e.contains("rope_factors_short.weight"), "{e}");
}
