//! `MlaConfig::from_gguf` on every metadata variant real converters write.

mod common;

use common::{Dims, Val, deepseek2};
use mla_diff::config::{KvBLayout, MlaConfig};
use mla_diff::gguf::GgufFile;

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
    // DeepSeek-V2-Lite: P+R = 192, factor 40, mscale_all_dim 0.707 → 0.114721 (MLA.md step 7).
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
