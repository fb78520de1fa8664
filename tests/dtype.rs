//! One dtype: the backend a run is given decides both what its kernels compute in and which rows
//! of the tolerance table judge them. A library caller cannot judge bf16 kernels with f32 rows.

use mla_diff::backend::Backend;
use mla_diff::backend::cpu::CpuOps;
use mla_diff::compute::path::PathKind;
use mla_diff::core::dtype::Dtype;
use mla_diff::judge::report::RunConfig;
use mla_diff::judge::tolerance::tolerance;
use mla_diff::model::config::MlaConfig;
use mla_diff::model::fixture::open_model;

#[test]
fn tolerance_rows_follow_the_backend_dtype() {
    let file = open_model(None).unwrap();
    let cfg = MlaConfig::from_gguf(&file).unwrap();
    let rc = RunConfig {
        layers: vec![1],
        paths: vec![PathKind::Mha],
        ..RunConfig::default()
    };
    for dtype in [Dtype::F32, Dtype::Bf16] {
        let backend = Backend::Cpu(CpuOps::new(dtype));
        let rep = mla_diff::jobs::run::run(&backend, &file, &cfg, &rc).unwrap();
        assert_eq!(rep.run.dtype, dtype, "the report records the backend's dtype");
        let diffs = &rep.results[0].diffs;
        assert!(diffs.len() > 10, "{} sites", diffs.len());
        for d in diffs {
            assert_eq!(
                d.tolerance,
                tolerance(d.site.stage, dtype).0,
                "{} judged with another dtype's row",
                d.site
            );
        }
        // bf16 rows are looser than f32 rows for attention outputs, so the two runs really
        // were judged differently.
        if dtype == Dtype::Bf16 {
            let out = diffs.iter().find(|d| d.site.stage.name() == "attn_out").unwrap();
            assert!(out.tolerance.rel_l2 > tolerance(out.site.stage, Dtype::F32).0.rel_l2);
        }
    }
}
