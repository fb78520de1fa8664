//! The whole selftest in-process: every fault found with the right class at the right first
//! site on every fixture and path, and no finding on any clean run across all fixtures × quant
//! types × paths × TP sizes dividing the head count (≤ 4) × page sizes {1, 16, 64}.

use mla_diff::core::dtype::Dtype;
use mla_diff::jobs::selftest::{self, ModelSource, SelftestOptions};

#[test]
fn selftest_finds_every_fault_and_nothing_on_clean_runs() {
    // The default set: golden/models' GGUF files and the checkpoint folders beside them (the
    // block-scale faults need the fp8 one).
    let models = mla_diff::cli::selftest_models(None).unwrap();
    assert!(models.len() >= 9);
    assert!(
        models
            .iter()
            .any(|m| matches!(m, ModelSource::File(p) if p.ends_with("hf-v3-fp8"))),
        "{models:?}"
    );
    assert!(models.iter().all(|m| matches!(m, ModelSource::File(_))));
    let cpu = mla_diff::backend::Backend::Cpu(mla_diff::backend::cpu::CpuOps::new(Dtype::F32));
    let rep = selftest::run(
        &cpu,
        &SelftestOptions {
            models,
            layer: 1,
            quick: false,
            seed: 0,
        },
    )
    .unwrap();
    let bad: Vec<_> = rep.cases.iter().filter(|c| !c.ok()).collect();
    assert!(bad.is_empty(), "{}", mla_diff::output::selftest::confusion_table(&rep));
    let clean: Vec<_> = rep.cases.iter().filter(|c| c.case == "clean").collect();
    // A clean run finds nothing, except where the clean TP cut of o_proj itself falls inside a
    // quant block (moe-v3-q8_0 at TP 2: N·V/2 = 16 columns of Q8_0 blocks of 32), which must be
    // reported as such.
    assert!(
        clean.iter().all(|c| c
            .found
            .as_ref()
            .is_none_or(|f| c.expected.is_some() && f.class == mla_diff::core::class::Class::QuantBlockMisaligned)),
        "a clean run produced a finding"
    );
    assert!(
        clean
            .iter()
            .any(|c| c.fixture == "moe-v3-q8_0" && c.tp == 2 && c.found.is_some()),
        "the naturally misaligned TP cut was not reported"
    );
    // 13 fixtures: 9 with 3 TP sizes and 4 (lite-v2 N=3, moe-v3 N=2) with 2, × 3 page sizes
    // × 4 paths.
    assert!(
        clean.len() >= 9 * 3 * 3 * 4 + 4 * 2 * 3 * 4,
        "{} clean cases",
        clean.len()
    );
    for fault in mla_diff::compute::faults::Fault::ALL {
        assert!(
            rep.cases.iter().any(|c| c.case == fault.name()),
            "{} ran on no fixture",
            fault.name()
        );
    }
}
