//! `mla-diff selftest`: proof that the detectors find every bug class, and nothing on clean runs.
//!
//! A diagnosis tool earns trust by catching known bugs and staying quiet on correct code. For
//! every fixture, selftest injects every fault of the catalogue into every path it applies to and
//! checks that the finding names the expected class at the expected first site; it also runs every
//! path clean under every TP size that divides the head count (up to 4) and page sizes 1, 16 and
//! 64, where any finding is a false alarm. Batches use the sequence lengths that break paged and
//! split kernels: 1, page−1, page, page+1 and a few pages plus a remainder.

use std::path::PathBuf;

use ndarray::Array2;

use crate::backend::Backend;
use crate::backend::cuda::compare::SplitTrace;
use crate::compute::faults::{Fault, FaultSet};
use crate::compute::path::{PathKind, PathOptions};
use crate::compute::reference;
use crate::core::batch::{Batch, SeqSpec, normal_f32};
use crate::core::class::Class;
use crate::core::error::{Error, Result};
use crate::core::trace::{Site, Stage};
use crate::jobs::run::compare_layer;
use crate::judge::diagnose::Finding;
use crate::judge::report::RunConfig;
use crate::judge::selftest::{CaseResult, DequantCheck, SelftestReport};
use crate::model::config::MlaConfig;
use crate::model::gguf::GgufFile;
use crate::model::tensors::ModelTensor;
use crate::model::weights::LayerWeights;

/// Where the fixtures come from.
#[derive(Debug, Clone)]
pub enum ModelSource {
    /// A GGUF file or a Hugging Face checkpoint folder on disk.
    File(PathBuf),
    /// The embedded default fixture.
    Embedded,
}

/// What selftest runs.
#[derive(Debug, Clone)]
pub struct SelftestOptions {
    /// Fixtures to test.
    pub models: Vec<ModelSource>,
    /// Layer to test in each fixture (every selected fixture must have it: [`check_layer`]).
    pub layer: usize,
    /// A subset: fewer fixtures, page size 16 only, TP 1 and the smallest TP > 1.
    pub quick: bool,
    /// Seed of the inputs.
    pub seed: u64,
}

/// Dequantizes every tensor of `file` with the backend and with the CPU decoder and compares
/// the bits.
fn dequant_check_file(backend: &Backend, file: &GgufFile, acc: &mut DequantCheck) -> Result<()> {
    use crate::compute::ops::Ops;
    let Backend::Cuda(ops) = backend else { return Ok(()) };
    for t in file.tensors() {
        let raw = crate::model::weights::row_slice(file, &t.name, 0..t.n_rows() as usize)?;
        let n = raw.n_elements();
        let gpu = ops.download(&ops.dequant(t.ggml_type, &raw.bytes, n, &t.name)?)?;
        let cpu =
            crate::model::gguf::dequant::dequantize(t.ggml_type, &raw.bytes, n).map_err(|reason| Error::Dequant {
                path: file.path().to_path_buf(),
                tensor: t.name.clone(),
                reason,
            })?;
        let bad = gpu.iter().zip(&cpu).filter(|(a, b)| a.to_bits() != b.to_bits()).count()
            + cpu.len().abs_diff(gpu.len().min(n));
        if bad > 0 && acc.first_mismatch.is_none() {
            acc.first_mismatch = Some(format!(
                "{}: {} ({}): {bad} of {n} values differ",
                file.path().display(),
                t.name,
                t.ggml_type
            ));
        }
        acc.tensors += 1;
        acc.elements += n;
        acc.mismatches += bad;
        let ty = t.ggml_type.name().to_string();
        if !acc.types.contains(&ty) {
            acc.types.push(ty);
        }
    }
    Ok(())
}

/// The selftest batch for page size `page`: sequence lengths 1, page−1, page, page+1 and three
/// pages plus a remainder (zero lengths dropped).
pub fn selftest_batch(page: usize) -> Batch {
    let lens = [1, page.saturating_sub(1), page, page + 1, 3 * page + 5];
    Batch {
        seqs: lens
            .iter()
            .filter(|&&l| l > 0)
            .map(|&len| SeqSpec { len, start_pos: 0 })
            .collect(),
    }
}

/// TP sizes that divide N, up to 4.
fn tp_sizes(n: usize) -> Vec<usize> {
    (1..=4).filter(|t| n.is_multiple_of(*t)).collect()
}

fn verdict(expected: &Option<(Class, Vec<Stage>)>, found: Option<&Finding>, layer: usize) -> String {
    match (expected, found) {
        (None, None) => "ok".into(),
        (None, Some(_)) => "false alarm".into(),
        (Some(_), None) => "miss".into(),
        (Some((class, stages)), Some(f)) => {
            if f.class != *class {
                "wrong class".into()
            } else if f.site().is_none_or(|s| s.layer != layer || !stages.contains(&s.stage)) {
                "wrong site".into()
            } else {
                "ok".into()
            }
        }
    }
}

/// Block size of the tensor whose rows run along the latent dim L (for `quant-slice-misaligned`).
fn latent_block(file: &GgufFile, cfg: &MlaConfig, layer: usize) -> u64 {
    let name = ModelTensor::kv_b_latent_input(cfg.kv_b_layout).name(layer);
    file.tensor(&name).map_or(1, |t| t.ggml_type.block_size())
}

/// Whether a clean TP cut of `o_proj` falls inside a quant block (then the right answer is a
/// `quant-block-misaligned` finding, not silence). The finding is at rank 0, whose column range
/// `0..cut` already ends inside a block.
fn natural_misalignment(file: &GgufFile, cfg: &MlaConfig, layer: usize, tp: usize) -> Option<Site> {
    let t = file.tensor(&ModelTensor::AttnOutput.name(layer))?;
    let cut = (cfg.n_head / tp * cfg.v_head_dim) as u64;
    (tp > 1 && !cut.is_multiple_of(t.ggml_type.block_size()))
        .then(|| Site::new(layer, Stage::WRank(crate::core::trace::RankedWeight::OProj, 0)))
}

fn fixture_name(src: &ModelSource) -> String {
    match src {
        ModelSource::File(p) => p.file_stem().map_or("?".into(), |s| s.to_string_lossy().into_owned()),
        ModelSource::Embedded => "embedded".into(),
    }
}

/// The fixtures a selftest runs: all of `opts.models`, or with `quick` those named
/// tiny-v3-q8_0, yarn-v3-f32, k256-q4_k_m, dsa-glm-q8_0, hf-v3-fp8 or the embedded one (all when
/// none is).
pub fn selected_models(opts: &SelftestOptions) -> Vec<&ModelSource> {
    if !opts.quick {
        return opts.models.iter().collect();
    }
    let pick: Vec<&ModelSource> = opts
        .models
        .iter()
        .filter(|m| {
            let n = fixture_name(m);
            [
                "tiny-v3-q8_0",
                "yarn-v3-f32",
                "k256-q4_k_m",
                "dsa-glm-q8_0",
                "hf-v3-fp8",
                "embedded",
            ]
            .contains(&n.as_str())
        })
        .collect();
    if pick.is_empty() {
        opts.models.iter().collect()
    } else {
        pick
    }
}

/// Refuses `opts.layer` when a selected fixture has no such layer, before any work (as `run`
/// refuses `--layer`).
///
/// Errors: [`Error::LayerOutOfRange`] naming the first such fixture; errors opening a fixture.
pub fn check_layer(opts: &SelftestOptions) -> Result<()> {
    for src in selected_models(opts) {
        let file = match src {
            ModelSource::File(p) => crate::model::open(p)?,
            ModelSource::Embedded => crate::model::fixture::open_model(None)?,
        };
        let n_layers = MlaConfig::from_gguf(&file)?.n_layer;
        if opts.layer >= n_layers {
            return Err(Error::LayerOutOfRange {
                path: file.path().to_path_buf(),
                layer: opts.layer,
                n_layers,
            });
        }
    }
    Ok(())
}

/// Runs the whole selftest.
///
/// Errors: a layer some selected fixture lacks ([`check_layer`]); a fixture that cannot be
/// opened or run (input errors); detection outcomes are results.
pub fn run(backend: &Backend, opts: &SelftestOptions) -> Result<SelftestReport> {
    let start = std::time::Instant::now();
    let mut cases = Vec::new();
    let mut dequant_check = matches!(backend, Backend::Cuda(_)).then(DequantCheck::default);
    check_layer(opts)?;
    for src in selected_models(opts) {
        let file = match src {
            ModelSource::File(p) => crate::model::open(p)?,
            ModelSource::Embedded => crate::model::fixture::open_model(None)?,
        };
        let name = fixture_name(src);
        if let Some(acc) = dequant_check.as_mut() {
            dequant_check_file(backend, &file, acc)?;
        }
        let cfg = MlaConfig::from_gguf(&file)?;
        let layer = opts.layer;
        let w = LayerWeights::load(&file, &cfg, layer)?;
        let tps = tp_sizes(cfg.n_head);
        let tps: Vec<usize> = if opts.quick {
            tps.iter()
                .copied()
                .filter(|&t| t == 1 || Some(t) == tps.get(1).copied())
                .collect()
        } else {
            tps
        };
        let pages: &[usize] = if opts.quick { &[16] } else { &[1, 16, 64] };
        for &page in pages {
            let batch = selftest_batch(page);
            let t = batch.n_tokens();
            let hidden = Array2::from_shape_vec(
                (t, cfg.hidden),
                normal_f32(opts.seed ^ page as u64, t * cfg.hidden)
                    .into_iter()
                    .map(f64::from)
                    .collect(),
            )
            .map_err(|e| Error::Internal(e.to_string()))?;
            let base = reference::forward(&cfg, &w, &hidden, &batch)?.trace;
            let pr = PageRun {
                backend,
                file: &file,
                cfg: &cfg,
                w: &w,
                hidden: &hidden,
                base: &base,
                batch: &batch,
                layer,
                page,
                seed: opts.seed,
                fixture: &name,
            };
            pr.clean_cases(&tps, &mut cases)?;
            // Faults, at page 16 only (the batch already spans page boundaries).
            if page == 16 {
                pr.fault_cases(&tps, &mut cases)?;
            }
        }
    }
    if let Some(acc) = dequant_check.as_mut() {
        acc.types.sort();
    }
    Ok(SelftestReport {
        cases,
        dequant: dequant_check,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// One fixture's layer at one page size: what the clean and faulted runs of [`run`] share.
struct PageRun<'a> {
    backend: &'a Backend,
    file: &'a GgufFile,
    cfg: &'a MlaConfig,
    w: &'a LayerWeights,
    /// `hidden_in` [T, H], seeded.
    hidden: &'a Array2<f64>,
    /// The reference trace of the layer, without per-rank weight sites.
    base: &'a crate::core::trace::Trace,
    batch: &'a Batch,
    layer: usize,
    page: usize,
    seed: u64,
    /// The fixture's name in the report.
    fixture: &'a str,
}

impl PageRun<'_> {
    /// The findings of `paths` at TP size `tp` with `faults` injected, judged on the host
    /// against the reference (selftest judges on the host on every backend).
    fn findings(&self, tp: usize, paths: Vec<PathKind>, faults: Vec<Fault>) -> Result<Vec<Finding>> {
        // A fault of fp8 compute runs with it, judged against the reference of the same fp8.
        let fp8 = faults.iter().find_map(|f| f.selftest_fp8(self.backend.dtype()));
        let kv_cache = faults.iter().find_map(|f| f.selftest_kv_cache(self.backend.dtype()));
        let rc = RunConfig {
            layers: vec![self.layer],
            batch: self.batch.clone(),
            seed: self.seed,
            input: crate::judge::report::InputMode::Random,
            paths,
            path_options: PathOptions {
                page_size: self.page,
                tp,
                faults: FaultSet(faults),
                fp8,
                kv_cache,
                ..PathOptions::default()
            },
            backend: self.backend.name().into(),
        };
        // The reference on the host: selftest judges on the host on every backend.
        let fp8_base = match fp8 {
            Some(act) => {
                let f = reference::Fp8Compute {
                    act: Some(act),
                    kv_cache: None,
                    tp,
                    absorbed: None,
                    context: None,
                };
                let inputs = reference::RefInputs {
                    fp8: Some(&f),
                    ..Default::default()
                };
                Some(reference::forward_sel(self.cfg, self.w, self.hidden, self.batch, &inputs)?.trace)
            }
            None => None,
        };
        let base = fp8_base.as_ref().unwrap_or(self.base);
        let act = fp8.as_ref();
        let mut r = base.clone();
        r.extend(reference::rank_weight_sites(self.cfg, self.w, tp));
        r.extend(reference::rank_partial_sites_of(self.cfg, self.w, base, tp, act)?);
        r.extend(reference::ffn_rank_sites_of(self.w, base, tp, act)?);
        let absorbed = crate::jobs::run::absorbed_references(
            self.backend,
            self.file,
            self.cfg,
            self.w,
            self.hidden,
            &rc,
            tp,
            None,
            false,
        )?;
        let reference = SplitTrace {
            host: r,
            device: Vec::new(),
        };
        let (_, findings, _) = compare_layer(
            self.backend,
            self.file,
            self.cfg,
            self.w,
            self.hidden,
            &reference,
            &rc,
            None,
            None,
            false,
            &absorbed,
        )?;
        Ok(findings)
    }

    /// Clean runs of every path at every TP size of `tps`: no finding expected, except the
    /// quant-block cut some TP sizes force on a fixture.
    fn clean_cases(&self, tps: &[usize], cases: &mut Vec<CaseResult>) -> Result<()> {
        let layer = self.layer;
        for &tp in tps {
            let findings = self.findings(tp, PathKind::ALL.to_vec(), vec![])?;
            let expected = natural_misalignment(self.file, self.cfg, layer, tp)
                .map(|s| (Class::QuantBlockMisaligned, vec![s.stage]));
            for &path in PathKind::ALL {
                let found = findings.iter().find(|f| f.path() == Some(path.into()));
                cases.push(CaseResult {
                    fixture: self.fixture.to_string(),
                    case: "clean".into(),
                    path,
                    tp,
                    page: self.page,
                    verdict: verdict(&expected, found, layer),
                    expected: expected
                        .as_ref()
                        .map(|(c, s)| (*c, s.iter().map(|x| x.name()).collect())),
                    found: found.cloned(),
                });
            }
        }
        Ok(())
    }

    /// The TP size a fault runs at: 1 unless the fault needs ranks; then the smallest that works.
    /// A TP size whose clean cut of o_proj already falls inside a quant block cannot show any
    /// other fault (the run stops at the unservable cut), so it is skipped, except for the fault
    /// that is about that cut. `None` when no TP size serves the fault.
    fn fault_tp(&self, fault: Fault, tps: &[usize], lblock: u64) -> Option<usize> {
        let (file, cfg, layer) = (self.file, self.cfg, self.layer);
        let servable =
            |tp: usize| fault == Fault::QuantSliceMisaligned || natural_misalignment(file, cfg, layer, tp).is_none();
        let works = |tp: usize| {
            servable(tp)
                && fault.applies_to_dtype(self.backend.dtype()).is_ok()
                && fault
                    .applies_to_fp8(
                        fault.selftest_fp8(self.backend.dtype()).as_ref(),
                        fault.selftest_kv_cache(self.backend.dtype()).as_ref(),
                    )
                    .is_ok()
                && fault.applies_to_layer(self.w, tp).is_ok()
                && fault.applies_to_model(file, layer, tp).is_ok()
                && PathKind::ALL.iter().any(|&p| fault.applies(p, cfg, tp, lblock).is_ok())
        };
        tps.iter()
            .copied()
            .find(|&tp| works(tp))
            .or_else(|| tp_sizes(cfg.n_head).into_iter().find(|&tp| works(tp)))
    }

    /// Each fault of [`Fault::ALL`] injected on every path it applies to, at its TP size
    /// ([`PageRun::fault_tp`]): the expected class at the expected stages.
    fn fault_cases(&self, tps: &[usize], cases: &mut Vec<CaseResult>) -> Result<()> {
        let lblock = latent_block(self.file, self.cfg, self.layer);
        for &fault in Fault::ALL {
            let Some(tp) = self.fault_tp(fault, tps, lblock) else {
                continue;
            };
            let paths: Vec<PathKind> = PathKind::ALL
                .iter()
                .copied()
                .filter(|&p| fault.applies(p, self.cfg, tp, lblock).is_ok())
                .collect();
            if paths.is_empty() {
                continue;
            }
            let findings = self.findings(tp, paths.clone(), vec![fault])?;
            for path in paths {
                let stages = fault.expected_stages(path);
                let expected = Some((fault.expected_class(), stages.clone()));
                let found = findings.iter().find(|f| f.path() == Some(path.into()));
                cases.push(CaseResult {
                    fixture: self.fixture.to_string(),
                    case: fault.name().into(),
                    path,
                    tp,
                    page: self.page,
                    verdict: verdict(&expected, found, self.layer),
                    expected: Some((fault.expected_class(), stages.iter().map(|s| s.name()).collect())),
                    found: found.cloned(),
                });
            }
        }
        Ok(())
    }
}

/// Compares two selftest runs case by case (class and first site of the finding). Returns the
/// summary text and whether every case agreed.
pub fn cross_check(a: &SelftestReport, b: &SelftestReport, against: &str) -> (String, bool) {
    let key = |c: &CaseResult| (c.fixture.clone(), c.case.clone(), c.path, c.tp, c.page);
    let found = |c: &CaseResult| c.found.as_ref().map(|f| (f.class, f.subject.clone()));
    let mut differ = Vec::new();
    let mut same = 0;
    for ca in &a.cases {
        match b.cases.iter().find(|cb| key(cb) == key(ca)) {
            Some(cb) if found(cb) == found(ca) => same += 1,
            Some(cb) => differ.push(format!(
                "  {} {} {} tp {} page {}: {:?} vs {:?}",
                ca.fixture,
                ca.case,
                ca.path,
                ca.tp,
                ca.page,
                found(ca).map(|(c, s)| format!("{c} at {s}")),
                found(cb).map(|(c, s)| format!("{c} at {s}"))
            )),
            None => differ.push(format!("  {} {} {}: no CPU counterpart", ca.fixture, ca.case, ca.path)),
        }
    }
    let mut s = format!(
        "\ncross-check against {against}: {same}/{} cases with the same finding (class and first site)\n",
        a.cases.len()
    );
    for d in &differ {
        s.push_str(d);
        s.push('\n');
    }
    (s, differ.is_empty() && a.cases.len() == b.cases.len())
}

/// The GPU reference against the CPU reference on one model: every layer the GPU reference
/// computes ([`crate::backend::cuda::reference::supported`]), on seeded random inputs over
/// `batch`; returns each compared site with its rel_l2 (f64 vs f64), in layer and site order.
/// Layers it does not compute are skipped (the run falls back to the CPU reference there).
///
/// Errors: missing tensors, a failed launch or DGEMM.
pub fn reference_agreement(
    ops: &crate::backend::cuda::ops::CudaOps,
    file: &GgufFile,
    cfg: &MlaConfig,
    batch: &Batch,
    seed: u64,
) -> Result<Vec<(Site, f64)>> {
    let t = batch.n_tokens();
    let mut out = Vec::new();
    for layer in 0..cfg.n_layer {
        if !crate::backend::cuda::reference::supported(cfg, layer, false) {
            continue;
        }
        let w = LayerWeights::load(file, cfg, layer)?;
        let v = normal_f32(crate::jobs::run::layer_seed(seed, layer), t * cfg.hidden);
        let hidden = Array2::from_shape_vec((t, cfg.hidden), v.into_iter().map(f64::from).collect())
            .map_err(|e| Error::Internal(e.to_string()))?;
        let cpu = crate::compute::reference::reference_layer(cfg, &w, &hidden, batch, 1, None)?;
        let gpu = crate::backend::cuda::reference::reference_layer(ops.device(), cfg, &w, &hidden, batch, 1)?;
        for (site, r) in cpu.trace.entries() {
            let Some(g) = gpu.trace.get(site) else {
                return Err(Error::Internal(format!("the GPU reference has no site {site}")));
            };
            let m = crate::judge::metrics::metrics(r, g, &crate::judge::tolerance::GOLDEN_TOLERANCE.0);
            out.push((*site, m.rel_l2));
        }
    }
    Ok(out)
}
