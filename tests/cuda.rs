//! GPU tests: the CUDA backend against the CPU backend. They need a device; without one each test
//! prints why it is skipped and passes (CI has no GPU; `kernels --compile-only` covers
//! compilation there). On a GPU machine, build with `cargo test --release --no-run` and run the
//! `cuda-*` test binary there with CUDA's lib64 on LD_LIBRARY_PATH.

mod common;

use mla_diff::batch::{Batch, SeqSpec, normal_f32};
use mla_diff::config::MlaConfig;
use mla_diff::cuda::CudaOps;
use mla_diff::gguf::{GgmlType, dequant::dequantize};
use mla_diff::paths::ops::Ops;
use mla_diff::paths::{Backend, LayerInput, PathKind, PathOptions, cpu::CpuOps};
use mla_diff::tolerance::Dtype;
use mla_diff::weights::LayerWeights;

fn device() -> Option<CudaOps> {
    match CudaOps::new(Dtype::F32, None) {
        Ok(o) => Some(o),
        Err(e) => {
            // Written to stderr directly so the reason shows even when the harness captures output.
            let _ = std::io::Write::write_all(
                &mut std::io::stderr(),
                format!("skipped: no usable CUDA device ({e})\n").as_bytes(),
            );
            None
        }
    }
}

#[test]
fn device_dequantization_is_bit_exact_on_every_vector() {
    let Some(ops) = device() else { return };
    let bytes = std::fs::read(common::repo().join("golden/dequant/vectors.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut checked = 0;
    for name in st.names() {
        let Some(ty) = name.strip_suffix(".raw").and_then(GgmlType::from_name) else {
            continue;
        };
        let raw = st.tensor(name).unwrap();
        let n = st.tensor(&format!("{}.expected", ty.name())).unwrap().data().len() / 4;
        let cpu = dequantize(ty, raw.data(), n).unwrap();
        let gpu = ops.download(&ops.dequant(ty, raw.data(), n, name).unwrap()).unwrap();
        let bad = cpu.iter().zip(&gpu).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        assert_eq!(bad, 0, "{ty}: {bad} of {n} values differ from the CPU decoder");
        checked += 1;
    }
    assert!(checked >= 15);
}

#[test]
fn device_paths_match_the_cpu_paths() {
    let Some(ops) = device() else { return };
    let file = mla_diff::cli::open_model(None).unwrap();
    let cfg = MlaConfig::from_gguf(&file).unwrap();
    let w = LayerWeights::load(&file, &cfg, 1).unwrap();
    let batch = Batch {
        seqs: [1usize, 15, 16, 17, 53]
            .iter()
            .map(|&len| SeqSpec { len, start_pos: 0 })
            .collect(),
    };
    let t = batch.n_tokens();
    let hidden = ndarray::Array2::from_shape_vec((t, cfg.hidden), normal_f32(5, t * cfg.hidden)).unwrap();
    let input = LayerInput {
        file: &file,
        cfg: &cfg,
        weights: &w,
        hidden_in: &hidden,
        batch: &batch,
        shared_selection: None,
        forced_selection: None,
    };
    let gpu = Backend::Cuda(ops);
    let cpu = Backend::Cpu(CpuOps::new(Dtype::F32));
    for &kind in PathKind::ALL {
        for tp in [1, 2, 3] {
            let opts = PathOptions {
                tp,
                ..PathOptions::default()
            };
            let g = gpu.run(kind, &input, &opts).unwrap();
            let c = cpu.run(kind, &input, &opts).unwrap();
            assert_eq!(
                g.trace.sites_in_order(),
                c.trace.sites_in_order(),
                "{kind} tp {tp}: same sites"
            );
            for site in c.trace.sites_in_order() {
                let (a, b) = (
                    g.trace.get(&site).unwrap().to_f64(),
                    c.trace.get(&site).unwrap().to_f64(),
                );
                let d: f64 = a.iter().zip(&b).map(|(x, y)| (x - y) * (x - y)).sum::<f64>().sqrt();
                let n: f64 = b.iter().map(|y| y * y).sum::<f64>().sqrt();
                assert!(d <= 1e-5 * n, "{kind} tp {tp} {site}: gpu vs cpu rel_l2 {:.3e}", d / n);
            }
        }
    }
}
