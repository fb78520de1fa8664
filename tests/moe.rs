//! MoE layers (DeepSeek-V3 routing) in the reference's token path: the `expert_*` keys are read
//! with llama.cpp's defaults and every impossible value is an error naming the key; the token
//! path runs through MoE layers, records the MoE sites, and reads only the experts its tokens
//! select; bad MoE files exit 2 naming the key or tensor. (HF agreement at every site is
//! tests/hf_golden.rs; the `moe_topk` finding is tests/moe_findings.rs.)

use crate::common;

use std::collections::BTreeSet;

use crate::common::{Dims, MoeDims, Val, deepseek2_moe, run_bin, write_temp};
use mla_diff::core::batch::Batch;
use mla_diff::core::trace::{Site, Stage};
use mla_diff::jobs::run::{reference_chain, seeded_tokens};
use mla_diff::model::config::{GatingFunc, MlaConfig};
use mla_diff::model::gguf::GgufFile;

fn dims() -> Dims {
    Dims {
        n_layer: 3,
        ..Dims::default()
    }
}

fn cfg_of(g: &common::GgufBuilder) -> Result<MlaConfig, mla_diff::Error> {
    MlaConfig::from_gguf(&GgufFile::from_bytes("t.gguf", g.build().bytes).unwrap())
}

#[test]
fn expert_keys_are_read_with_llama_cpp_defaults() {
    let g = deepseek2_moe(dims(), MoeDims::default());
    let c = cfg_of(&g).unwrap();
    let m = c.moe.clone().unwrap();
    assert_eq!(
        (
            m.n_expert,
            m.n_expert_used,
            m.n_group,
            m.n_group_used,
            m.n_expert_shared,
            m.expert_ffn
        ),
        (16, 2, 4, 2, 1, 8)
    );
    assert_eq!(
        (m.gating, m.weights_norm, m.weights_scale),
        (GatingFunc::Sigmoid, true, 2.5)
    );
    assert_eq!(m.line(), "E=16 K=2 G=4/2 F_e=8 shared=1 sigmoid norm scale=2.5");
    assert!(!c.is_moe_layer(0) && c.is_moe_layer(1) && c.is_moe_layer(2));

    // Absent optional keys: softmax gating (llama.cpp's default for old V2 files), no
    // normalisation, scale 1, no group limit.
    let mut g2 = g.clone();
    for k in [
        "expert_gating_func",
        "expert_weights_norm",
        "expert_weights_scale",
        "expert_group_count",
        "expert_group_used_count",
    ] {
        g2.remove_kv(&format!("deepseek2.{k}"));
    }
    let m2 = cfg_of(&g2).unwrap().moe.unwrap();
    assert_eq!(
        (
            m2.gating,
            m2.weights_norm,
            m2.weights_scale,
            m2.n_group,
            m2.n_group_used
        ),
        (GatingFunc::Softmax, false, 1.0, 1, 1)
    );
    // A scale of 0 means "no scale" (llama.cpp skips it), and gating 0 means softmax.
    g2.kv("deepseek2.expert_weights_scale", Val::F32(0.0));
    g2.kv("deepseek2.expert_gating_func", Val::U32(0));
    let m3 = cfg_of(&g2).unwrap().moe.unwrap();
    assert_eq!((m3.weights_scale, m3.gating), (1.0, GatingFunc::Softmax));

    // Every layer dense (leading_dense_block_count = block_count): no MoE config, whatever the
    // expert keys say, so dense fixtures keep their manifests.
    let mut dense = g.clone();
    dense.set_kv("deepseek2.leading_dense_block_count", Val::U32(3));
    assert!(cfg_of(&dense).unwrap().moe.is_none());
}

#[test]
fn impossible_expert_counts_are_errors_naming_the_key() {
    let base = deepseek2_moe(dims(), MoeDims::default());
    let cases: Vec<(&str, Val, &str)> = vec![
        ("expert_used_count", Val::U32(0), "between 1 and expert_count 16"),
        ("expert_used_count", Val::U32(17), "between 1 and expert_count 16"),
        ("expert_group_count", Val::U32(5), "do not divide expert_count 16"),
        ("expert_group_count", Val::U32(16), "leave 1 per group"),
        (
            "expert_group_used_count",
            Val::U32(0),
            "between 1 and expert_group_count 4",
        ),
        (
            "expert_group_used_count",
            Val::U32(5),
            "between 1 and expert_group_count 4",
        ),
        ("expert_weights_scale", Val::F32(-2.5), "not a positive finite number"),
        (
            "expert_weights_scale",
            Val::F32(f32::NAN),
            "not a positive finite number",
        ),
        ("expert_weights_norm", Val::U32(1), "expected a bool"),
        ("expert_feed_forward_length", Val::U32(0), "must be positive"),
        ("expert_count", Val::U32(4096), "exceeds 1024"),
    ];
    for (key, v, why) in cases {
        let mut g = base.clone();
        g.set_kv(&format!("deepseek2.{key}"), v);
        let e = cfg_of(&g).unwrap_err().to_string();
        assert!(
            e.contains("t.gguf") && e.contains(&format!("deepseek2.{key}")) && e.contains(why),
            "{key}: {e}"
        );
    }
    // 1 kept group of 4 experts cannot hold K = 6.
    let mut g = base.clone();
    g.set_kv("deepseek2.expert_group_used_count", Val::U32(1));
    g.set_kv("deepseek2.expert_used_count", Val::U32(6));
    let e = cfg_of(&g).unwrap_err().to_string();
    assert!(
        e.contains("deepseek2.expert_group_used_count") && e.contains("fewer than expert_used_count 6"),
        "{e}"
    );
    // Missing required keys, and a gating function this build does not implement.
    let mut g = base.clone();
    g.remove_kv("deepseek2.expert_used_count");
    let e = cfg_of(&g).unwrap_err().to_string();
    assert!(e.contains("missing metadata key `deepseek2.expert_used_count`"), "{e}");
    let mut g = base.clone();
    g.set_kv("deepseek2.expert_gating_func", Val::U32(4));
    let e = cfg_of(&g).unwrap_err().to_string();
    assert!(
        e.contains("deepseek2.expert_gating_func") && e.contains("sqrt_softplus"),
        "{e}"
    );
}

/// The reference trace of every layer for 3 seeded tokens, and the file (with its read log).
fn chain(g: &common::GgufBuilder) -> (GgufFile, MlaConfig, Vec<mla_diff::core::trace::Trace>) {
    let file = GgufFile::from_bytes("moe.gguf", g.build().bytes).unwrap();
    let cfg = MlaConfig::from_gguf(&file).unwrap();
    let tokens = seeded_tokens(7, 3, cfg.vocab);
    let traces = reference_chain(&file, &cfg, &tokens, &Batch::single(3, 0), cfg.n_layer - 1).unwrap();
    (file, cfg, traces)
}

#[test]
fn token_path_runs_moe_layers_and_hidden_out_is_residual_plus_routed_plus_shared() {
    let (_file, cfg, traces) = chain(&deepseek2_moe(dims(), MoeDims::default()));
    let get = |l: usize, s: Stage| traces[l].get(&Site::new(l, s)).unwrap().to_f64();
    assert!(
        traces[0].get(&Site::new(0, Stage::MoeTopk)).is_none(),
        "layer 0 is dense"
    );
    for (l, t) in traces.iter().enumerate().skip(1) {
        assert_eq!(t.get(&Site::new(l, Stage::MoeRouterLogits)).unwrap().shape, vec![3, 16]);
        assert_eq!(t.get(&Site::new(l, Stage::MoeTopk)).unwrap().shape, vec![3, 2]);
        assert_eq!(t.get(&Site::new(l, Stage::MoeOut)).unwrap().shape, vec![3, cfg.hidden]);
        // hidden_out = hidden_in + o_proj + moe_out + shared_out, element by element.
        let (hi, o, mo, so, ho) = (
            get(l, Stage::HiddenIn),
            get(l, Stage::OProj),
            get(l, Stage::MoeOut),
            get(l, Stage::SharedOut),
            get(l, Stage::HiddenOut),
        );
        for i in 0..ho.len() {
            approx::assert_abs_diff_eq!(ho[i], hi[i] + o[i] + mo[i] + so[i], epsilon = 1e-12);
        }
        // The layer's input is the previous layer's output (the token path carries it).
        assert_eq!(get(l, Stage::HiddenIn), get(l - 1, Stage::HiddenOut));
        // Each token selected K distinct experts in range, and the routed part is not zero.
        let ids = get(l, Stage::MoeTopk);
        for row in ids.chunks(2) {
            assert!(
                row[0] != row[1] && row.iter().all(|&e| (0.0..16.0).contains(&e)),
                "{row:?}"
            );
        }
        assert!(mo.iter().map(|x| x * x).sum::<f64>() > 1e-6);
    }
}

#[test]
fn only_the_selected_experts_are_read() {
    let g = deepseek2_moe(dims(), MoeDims::default());
    let (file, cfg, traces) = chain(&g);
    let fe = 8;
    for (l, t) in traces.iter().enumerate().skip(1) {
        let selected: BTreeSet<u64> = t
            .get(&Site::new(l, Stage::MoeTopk))
            .unwrap()
            .to_f64()
            .iter()
            .map(|&e| e as u64)
            .collect();
        // 3 tokens × 2 experts cannot cover 16 experts: the test is meaningful.
        assert!(selected.len() <= 6);
        for (tensor, rows_per_expert) in [
            ("ffn_gate_exps", fe),
            ("ffn_up_exps", fe),
            ("ffn_down_exps", cfg.hidden),
        ] {
            let name = format!("blk.{l}.{tensor}.weight");
            let info = file.tensor(&name).unwrap();
            let start = file.data_offset() + info.offset;
            let expert_bytes = rows_per_expert as u64 * info.row_bytes();
            let read: BTreeSet<u64> = file
                .data_reads()
                .iter()
                .filter(|(n, _, _)| *n == name)
                .map(|&(_, off, len)| {
                    assert_eq!(len, expert_bytes, "{name}: one expert's rows per read");
                    (off - start) / expert_bytes
                })
                .collect();
            assert_eq!(read, selected, "{name}");
        }
    }
}

#[test]
fn bad_moe_files_exit_2_naming_the_key_or_tensor() {
    let run = |g: &common::GgufBuilder| {
        let (_d, p) = write_temp(&g.build().bytes, "moe.gguf");
        run_bin(&[
            "run",
            "--model",
            p.to_str().unwrap(),
            "--layers",
            "all",
            "--input",
            "tokens",
            "--tokens",
            "4",
            "--quiet",
        ])
    };
    let good = deepseek2_moe(dims(), MoeDims::default());
    let (code, out, err) = run(&good);
    assert_eq!(code, 0, "{out}{err}");

    let mut g = good.clone();
    g.set_kv("deepseek2.expert_group_count", Val::U32(3));
    let (code, _, err) = run(&g);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("moe.gguf") && err.contains("deepseek2.expert_group_count"),
        "{err}"
    );

    let mut g = good.clone();
    g.tensors.retain(|t| t.name != "blk.2.ffn_up_exps.weight");
    let (code, _, err) = run(&g);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("missing tensor `blk.2.ffn_up_exps.weight`"), "{err}");

    // ffn_down_exps with its last two dims swapped ([E, F_e, H] instead of [E, H, F_e]).
    let mut g = good.clone();
    let i = common::tensor_pos(&g, "blk.1.ffn_down_exps.weight");
    g.tensors[i].ne = vec![32, 8, 16];
    let (code, _, err) = run(&g);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("blk.1.ffn_down_exps.weight") && err.contains("E × H × F_e"),
        "{err}"
    );

    // MoE tensors without the expert keys: the token path cannot run the layer and says why.
    let mut g = good.clone();
    g.remove_kv("deepseek2.expert_count");
    let (code, _, err) = run(&g);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("blk.1.ffn_gate_inp.weight") && err.contains("deepseek2.expert_count"),
        "{err}"
    );
}
