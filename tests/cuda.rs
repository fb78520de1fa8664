//! GPU tests: the CUDA backend against the CPU backend. Each needs a device, so each is
//! `#[ignore]`d with that reason: `cargo test` on a machine without a GPU lists them as
//! `ignored` (never as passed), and a GPU run asks for them with `--include-ignored`
//! (`cargo test --release --test cuda -- --include-ignored`, or the built binary `cuda-*` with
//! `--include-ignored`, as `scripts/gpu-host/gpu_validate.sh` runs it). Asked for on a machine
//! whose CUDA does not answer, they fail with the reason. CI has no GPU; `kernels
//! --compile-only` covers compilation there. The one test that always runs checks that every
//! other test here is ignored so.

mod common;

use mla_diff::backend::Backend;
use mla_diff::backend::cpu::CpuOps;
use mla_diff::backend::cuda::ops::CudaOps;
use mla_diff::compute::ops::Ops;
use mla_diff::compute::path::{LayerInput, PathKind, PathOptions};
use mla_diff::core::batch::{Batch, SeqSpec, normal_f32};
use mla_diff::core::dtype::Dtype;
use mla_diff::device::ComputeCapability;
use mla_diff::model::config::MlaConfig;
use mla_diff::model::gguf::{GgmlType, dequant::dequantize};
use mla_diff::model::weights::LayerWeights;

/// The CUDA backend as the command line builds it (its include folder, NVRTC cache and kernel
/// configurations from this process's environment). Panics, naming the reason, when no device
/// answers: only tests asked for with `--include-ignored` call it.
fn device() -> Option<CudaOps> {
    match CudaOps::new(Dtype::F32, None, &mla_diff::cli::settings_from_env()) {
        Ok(o) => Some(o),
        // The test was asked for (`--include-ignored`): no device is a failure, with the reason.
        Err(e) => {
            panic!("no usable CUDA device: {e} (these tests are ignored unless asked for with --include-ignored)")
        }
    }
}

/// [`device`] when its architecture passes `supported`, else `None` with the skip printed
/// (`lacks`: what the device lacks, e.g. "wgmma (sm_90 only)").
fn device_with(supported: fn(ComputeCapability) -> bool, lacks: &str) -> Option<CudaOps> {
    let ops = device()?;
    if supported(ops.arch()) {
        Some(ops)
    } else {
        eprintln!("skipped: {} has no {lacks}", ops.arch());
        None
    }
}

#[test]
#[ignore = "needs a CUDA device: cargo test --release --test cuda -- --include-ignored"]
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
#[ignore = "needs a CUDA device: cargo test --release --test cuda -- --include-ignored"]
fn device_paths_match_the_cpu_paths() {
    let Some(ops) = device() else { return };
    let file = mla_diff::model::fixture::open_model(None).unwrap();
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
        dequantized: None,
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

/// A layer is dequantized once on the device: the device copy `load_layer_weights` keeps holds
/// the CPU decoder's bits, the GPU reference reading it gives the bits it gives from the host
/// copy, and the paths that take it over give the bits of paths that dequantize the raw bytes
/// themselves.
#[test]
#[ignore = "needs a CUDA device: cargo test --release --test cuda -- --include-ignored"]
fn a_layer_dequantized_once_on_the_device_gives_the_bits_of_separate_dequantizations() {
    let Some(ops) = device() else { return };
    let file = mla_diff::model::fixture::open_model(None).unwrap();
    let cfg = MlaConfig::from_gguf(&file).unwrap();
    let host = LayerWeights::load(&file, &cfg, 1).unwrap();
    let gpu = Backend::Cuda(ops);
    let Backend::Cuda(o) = &gpu else { unreachable!() };
    let batch = mla_diff::jobs::selftest::selftest_batch(16);
    let t = batch.n_tokens();
    let hidden = ndarray::Array2::from_shape_vec((t, cfg.hidden), normal_f32(11, t * cfg.hidden)).unwrap();
    let hidden64 = hidden.mapv(f64::from);
    let reference = |w: &LayerWeights| {
        mla_diff::backend::cuda::reference::reference_layer(o.device(), &cfg, w, &hidden64, &batch, 1).unwrap()
    };
    let from_host = reference(&host);
    let paths = |w: &LayerWeights| {
        let input = LayerInput {
            file: &file,
            cfg: &cfg,
            weights: w,
            hidden_in: &hidden,
            batch: &batch,
            shared_selection: None,
            forced_selection: None,
            dequantized: None,
        };
        let mut runs = Vec::new();
        gpu.run_paths(PathKind::ALL, &input, &PathOptions::default(), &mut |r| {
            runs.push(r);
            Ok(())
        })
        .unwrap();
        runs
    };
    let separate = paths(&host);

    let once = gpu.load_layer_weights(&file, &cfg, 1).unwrap();
    let o_proj = "blk.1.attn_output.weight";
    let mut kept = 0;
    for tt in &once.types {
        let n = file.tensor(&tt.name).unwrap().n_elements() as usize;
        let dev = o
            .device()
            .with_layer_weight(&tt.name, n, |b| o.download(b).unwrap())
            .unwrap();
        let cpu = mla_diff::model::weights::dequant_tensor(&file, file.tensor(&tt.name).unwrap()).unwrap();
        assert_eq!(
            first_bit_difference(&dev, &cpu),
            None,
            "{}: device copy vs CPU decoder",
            tt.name
        );
        kept += 1;
    }
    assert!(kept >= 6, "{kept} tensors kept on the device");
    let from_device = reference(&once);
    let mut compared = 0;
    for (site, x) in from_host.trace.entries() {
        let y = from_device.trace.get(site).unwrap();
        let same = x
            .to_f64()
            .iter()
            .zip(y.to_f64().iter())
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{site}: the GPU reference reading the device copy differs");
        compared += 1;
    }
    assert!(compared > 10, "{compared} reference sites");
    let shared = paths(&once);
    assert_eq!(
        o.device().with_layer_weight(o_proj, host.o_proj.len(), |b| b.len()),
        None,
        "the paths took o_proj over"
    );
    gpu.release_layer_weights();
    assert_eq!(shared.len(), separate.len());
    for (a, b) in shared.iter().zip(&separate) {
        assert_eq!(a.trace.sites_in_order(), b.trace.sites_in_order(), "{}: sites", a.kind);
        for site in b.trace.sites_in_order() {
            let (x, y) = (
                a.trace.get(&site).unwrap().to_f64(),
                b.trace.get(&site).unwrap().to_f64(),
            );
            let same = x.iter().zip(&y).all(|(p, q)| p.to_bits() == q.to_bits());
            assert!(same, "{} {site}: paths on the shared device copy differ", a.kind);
        }
    }
    eprintln!(
        "one device dequantization: {compared} reference sites and {} path traces bit-identical",
        shared.len()
    );
}

/// Inputs of a merged-decode comparison: bf16 cache and queries from seeded normals, pages in a
/// shuffled order, one token per entry of `ctx` (its context length).
struct MergeCase {
    ctx: Vec<usize>,
    nh: usize,
    l: usize,
    page: usize,
    max_blocks: usize,
    cache: cudarc::driver::CudaSlice<half::bf16>,
    q: cudarc::driver::CudaSlice<half::bf16>,
    tables: cudarc::driver::CudaSlice<i64>,
    ctx_d: cudarc::driver::CudaSlice<i64>,
}

impl MergeCase {
    fn new(ops: &CudaOps, ctx: &[usize], nh: usize) -> Self {
        use mla_diff::core::batch::SplitMix64;
        let (l, r, page) = (512usize, 64usize, 16usize);
        let w = l + r;
        let n = ctx.len();
        let max_blocks = ctx.iter().copied().max().unwrap_or(1).max(1).div_ceil(page);
        let num_blocks = n * max_blocks;
        let mut phys: Vec<usize> = (0..num_blocks).collect();
        SplitMix64::new(7).shuffle(&mut phys);
        let mut rng = SplitMix64::new(1);
        let cache: Vec<half::bf16> = (0..num_blocks * page * w)
            .map(|_| half::bf16::from_f64(rng.normal()))
            .collect();
        let q: Vec<half::bf16> = (0..n * nh * w)
            .map(|_| half::bf16::from_f64(rng.normal() * 0.05))
            .collect();
        let s = ops.stream();
        MergeCase {
            ctx: ctx.to_vec(),
            nh,
            l,
            page,
            max_blocks,
            cache: s.clone_htod(&cache).unwrap(),
            q: s.clone_htod(&q).unwrap(),
            tables: s
                .clone_htod(&phys.iter().map(|&x| x as i64).collect::<Vec<_>>())
                .unwrap(),
            ctx_d: s
                .clone_htod(&ctx.iter().map(|&x| x as i64).collect::<Vec<_>>())
                .unwrap(),
        }
    }

    /// Panics at the first element whose bits differ (NaNs count as equal) between two merged
    /// outputs `[n, nh, L]` and LSEs `[n, nh]` of this case, each given as (name, out, lse),
    /// naming the token, head and column.
    fn assert_same_bits(&self, what: &str, a: (&str, &[f32], &[f32]), b: (&str, &[f32], &[f32])) {
        let (nh, l) = (self.nh, self.l);
        if let Some(e) = first_bit_difference(a.1, b.1) {
            panic!(
                "{what}: out[{e}] (token {}, head {}, column {}) {} {} vs {} {}",
                e / (nh * l),
                e / l % nh,
                e % l,
                a.0,
                a.1[e],
                b.0,
                b.1[e]
            );
        }
        if let Some(e) = first_bit_difference(a.2, b.2) {
            panic!("{what}: lse[{e}] {} {} vs {} {}", a.0, a.2[e], b.0, b.2[e]);
        }
    }

    /// One `decode_mma` launch: with `merged`, the merged output `[n, nh, L]`, merged LSE
    /// `[n, nh]` and the counters after it; without, stage 1's partials `[splits, n, nh, L]` and
    /// LSEs `[splits, n, nh]` (and no counters: empty). Every output buffer NaN-poisoned first.
    fn launch(
        &self,
        ops: &CudaOps,
        cfg: mla_diff::backend::decode_cfg::DecodeCfg,
        splits: usize,
        empty_lse: f32,
        spin: Option<bool>,
        merged: bool,
    ) -> (Vec<f32>, Vec<f32>, Vec<i32>) {
        use mla_diff::backend::cuda::ops::{DecodeLaunch, DecodeMerge, DecodeShape};
        let (n, nh, l) = (self.ctx.len(), self.nh, self.l);
        let shape = DecodeShape {
            n,
            nh,
            block_size: self.page,
            width: l + 64,
            max_blocks: self.max_blocks,
            splits,
            dv: l,
            cfg,
            spin,
        };
        let mut parts = ops.canary(splits * n * nh * l).unwrap();
        let mut lses = ops.canary(splits * n * nh).unwrap();
        let mut out = ops.canary(n * nh * l).unwrap();
        let mut lse = ops.canary(n * nh).unwrap();
        let mut counters = ops.stream().alloc_zeros::<i32>(n * nh.div_ceil(cfg.heads)).unwrap();
        let merge = merged.then_some(DecodeMerge {
            out: &mut out,
            lse: &mut lse,
            counters: &mut counters,
        });
        let launch = DecodeLaunch {
            q: &self.q,
            cache: &self.cache,
            tables: &self.tables,
            ctx: &self.ctx_d,
            shape,
            scale: (192f64).powf(-0.5) as f32,
            empty_lse,
        };
        ops.decode_mma(&launch, &mut parts, &mut lses, merge).unwrap();
        if !merged {
            return (ops.download(&parts).unwrap(), ops.download(&lses).unwrap(), Vec::new());
        }
        let counts = ops.stream().clone_dtoh(&counters).unwrap();
        (ops.download(&out).unwrap(), ops.download(&lse).unwrap(), counts)
    }
}

/// Index of the first element whose bits differ (NaNs of any payload count as equal).
fn first_bit_difference(a: &[f32], b: &[f32]) -> Option<usize> {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .position(|(x, y)| x.to_bits() != y.to_bits() && !(x.is_nan() && y.is_nan()))
}

/// The merge through a thread-block cluster (`FD_CLUSTER`, `16,8,2,0,2,2,0,1,1` on sm_90+) and
/// the fused merge through global memory (`16,8,2,0,2,2,0,1`, the N < 64 default) with the last
/// split merging everything and with every split merging its share (spin) give the same bits,
/// at 2, 4 and 8 splits, with a token of no positions (every split empty), tokens with fewer
/// positions than splits (empty splits), 20 heads (a second head group of 4 real heads and 12
/// zero rows) and both empty-split LSEs (−inf, and the +inf of the `lse-plus-inf` fault); the
/// counters are zero again after every launch.
#[test]
#[ignore = "needs a CUDA device: cargo test --release --test cuda -- --include-ignored"]
fn device_cluster_merge_matches_the_fused_merge_bit_for_bit() {
    use mla_diff::backend::decode_cfg::DecodeCfg;
    let Some(ops) = device_with(ComputeCapability::has_tma, "thread-block clusters (sm_90+)") else {
        return;
    };
    let case = MergeCase::new(&ops, &[0, 1, 3, 7, 31, 64, 100, 257], 20);
    let (n, nh, l) = (case.ctx.len(), case.nh, case.l);
    let global = DecodeCfg::parse("16,8,2,0,2,2,0,1").unwrap();
    let cluster = DecodeCfg::parse("16,8,2,0,2,2,0,1,1").unwrap().for_arch(ops.arch());
    for splits in [2usize, 4, 8] {
        assert_eq!(cluster.cluster_size(ops.arch(), splits, l, true), splits);
        for empty_lse in [f32::NEG_INFINITY, f32::INFINITY] {
            let (co, cl, _) = case.launch(&ops, cluster, splits, empty_lse, None, true);
            for spin in [Some(false), Some(true)] {
                let (go, gl, counts) = case.launch(&ops, global, splits, empty_lse, spin, true);
                let what = format!("splits {splits}, empty lse {empty_lse}, spin {spin:?}");
                case.assert_same_bits(&what, ("global", &go, &gl), ("cluster", &co, &cl));
                assert!(counts.iter().all(|&c| c == 0), "{what}: counters left {counts:?}");
            }
            // Not vacuous: the token with 257 positions has finite, non-zero outputs.
            assert!(co[(n - 1) * nh * l..].iter().any(|&x| x != 0.0 && x.is_finite()));
        }
    }
}

/// Every split merging its share (spin) forced on a launch whose blocks cannot all be resident
/// (64 tokens × 2 head groups × 8 splits = 1024 blocks): waiting blocks give up, the last split
/// of each token merges everything, and the output is bit-identical to the last-split merge,
/// with the counters zero again.
#[test]
#[ignore = "needs a CUDA device: cargo test --release --test cuda -- --include-ignored"]
fn device_spin_merge_gives_up_when_blocks_are_not_resident() {
    use mla_diff::backend::decode_cfg::DecodeCfg;
    let Some(ops) = device() else { return };
    let ctx: Vec<usize> = (0..64).map(|i| [0, 5, 40, 300][i % 4] + i).collect();
    let case = MergeCase::new(&ops, &ctx, 20);
    let cfg = DecodeCfg::TMA16.for_arch(ops.arch());
    let blocks = ctx.len() * 2 * 8;
    let resident = ops.sm_count().unwrap() * ops.decode_blocks_per_sm(576, 512, cfg).unwrap();
    assert!(
        blocks > resident,
        "{blocks} blocks fit in {resident}: not a give-up case"
    );
    let (lo, ll, _) = case.launch(&ops, cfg, 8, f32::NEG_INFINITY, Some(false), true);
    let start = std::time::Instant::now();
    let (so, sl, counts) = case.launch(&ops, cfg, 8, f32::NEG_INFINITY, Some(true), true);
    eprintln!(
        "forced spin on {blocks} blocks ({resident} resident): {:?}",
        start.elapsed()
    );
    assert_eq!(first_bit_difference(&so, &lo), None, "out");
    assert_eq!(first_bit_difference(&sl, &ll), None, "lse");
    assert!(counts.iter().all(|&c| c == 0), "counters left {counts:?}");
    assert!(so.iter().any(|&x| x != 0.0 && x.is_finite()));
}

/// Merged split-KV decode through [`Ops::decode_merged`] (the engine's call) on `ops`, for
/// queries `q [n, nh, L+R]` and a paged `cache [blocks·page, L+R]` (f32 holding bf16 values):
/// merged output `[n, nh, L]` and LSE `[n, nh]`.
#[allow(
    clippy::too_many_arguments,
    reason = "the host-side DecodeArgs a test varies, uploaded here before the call"
)]
fn decode_merged_on<O: Ops>(
    ops: &O,
    q: &[f32],
    cache: &[f32],
    nh: usize,
    (l, r, page): (usize, usize, usize),
    tables: &[Vec<usize>],
    ctx: &[usize],
    splits: usize,
) -> (Vec<f32>, Vec<f32>) {
    use mla_diff::compute::ops::DecodeArgs;
    let (qb, cb) = (ops.upload(q).unwrap(), ops.upload(cache).unwrap());
    let (o, lse) = ops
        .decode_merged(&DecodeArgs {
            q: &qb,
            n: ctx.len(),
            nh,
            cache: &cb,
            block_size: page,
            width: l + r,
            tables,
            ctx,
            splits,
            dv: l,
            scale: (192f64).powf(-0.5) as f32,
            empty_lse: f32::NEG_INFINITY,
        })
        .unwrap();
    (ops.download(&o).unwrap(), ops.download(&lse).unwrap())
}

/// The fast merged decode through the engine's call ([`Ops::decode_merged`], default
/// configuration for the head count) at DeepSeek-V3's L = 512, R = 64, against the simple f32
/// kernels and the CPU bf16 reference on the same bf16-valued inputs, judged by the tolerance
/// table's bf16 rows for the attention latent and the LSE, for each (heads, page) of `cases`
/// (pages in shuffled order) and each split count of `splits`, with contexts `ctx`. `what`
/// names the block in messages.
fn check_fast_decode_at_v3(dev: &CudaOps, what: &str, cases: &[(usize, usize)], splits: &[usize], ctx: &[usize]) {
    use mla_diff::backend::cuda::ops::Kernels;
    use mla_diff::core::trace::{Stage, TraceTensor};
    use mla_diff::judge::metrics::{judge, metrics};
    use mla_diff::judge::tolerance::tolerance;
    let (l, r) = (512usize, 64usize);
    let fast = dev.with_dtype(Dtype::Bf16).with_kernels(Kernels::Fast);
    let simple = dev.with_dtype(Dtype::Bf16).with_kernels(Kernels::Simple);
    let cpu = CpuOps::new(Dtype::Bf16);
    let bf = |x: f64| half::bf16::from_f64(x).to_f32();
    let mut rng = mla_diff::core::batch::SplitMix64::new(11);
    for &(nh, page) in cases {
        let per = ctx.iter().map(|c| c.div_ceil(page)).collect::<Vec<_>>();
        let mut phys: Vec<usize> = (0..per.iter().sum()).collect();
        rng.shuffle(&mut phys);
        let mut tables = Vec::new();
        let mut at = 0;
        for p in &per {
            tables.push(phys[at..at + p].to_vec());
            at += p;
        }
        let cache: Vec<f32> = (0..phys.len() * page * (l + r)).map(|_| bf(rng.normal())).collect();
        let q: Vec<f32> = (0..ctx.len() * nh * (l + r)).map(|_| bf(rng.normal() * 0.5)).collect();
        for &splits in splits {
            let dims = (l, r, page);
            let (fo, fl) = decode_merged_on(&fast, &q, &cache, nh, dims, &tables, ctx, splits);
            let (so, sl) = decode_merged_on(&simple, &q, &cache, nh, dims, &tables, ctx, splits);
            let (co, cl) = decode_merged_on(&cpu, &q, &cache, nh, dims, &tables, ctx, splits);
            assert!(fo.iter().all(|x| x.is_finite()) && fo.iter().any(|&x| x != 0.0));
            for (other, (cand, c_lse)) in [("simple", (&so, &sl)), ("cpu", (&co, &cl))] {
                let (to, _) = tolerance(Stage::AttnLatent, Dtype::Bf16);
                let (tl, _) = tolerance(Stage::Lse, Dtype::Bf16);
                let shape = vec![ctx.len(), nh, l];
                let m = metrics(
                    &TraceTensor::f32(shape.clone(), cand.clone()),
                    &TraceTensor::f32(shape, fo.clone()),
                    &to,
                );
                let bad = judge(&m, &to);
                assert!(
                    bad.is_empty(),
                    "{what}: nh {nh} page {page} splits {splits}: out vs {other}: {bad:?} {m:?}"
                );
                let ml = metrics(
                    &TraceTensor::f32(vec![ctx.len(), nh], c_lse.clone()),
                    &TraceTensor::f32(vec![ctx.len(), nh], fl.clone()),
                    &tl,
                );
                let bad = judge(&ml, &tl);
                assert!(
                    bad.is_empty(),
                    "{what}: nh {nh} page {page} splits {splits}: lse vs {other}: {bad:?} {ml:?}"
                );
                eprintln!(
                    "{what} vs {other}: nh {nh} page {page} splits {splits}: out rel_l2 {:.2e}, lse rel_l2 {:.2e}",
                    m.rel_l2, ml.rel_l2
                );
            }
        }
    }
}

/// The wgmma decode block (the N >= 64 default on sm_90) against the simple kernels and the CPU
/// ([`check_fast_decode_at_v3`]): 128 heads (two full head groups) and 80 (a second group of 16
/// real heads and 48 zero rows), contexts that end inside, at and past a 64-row tile, pages of 16
/// and 64, 1 split (the compute-bound bench's) and 3 (the fused merge).
#[test]
#[ignore = "needs a CUDA device: cargo test --release --test cuda -- --include-ignored"]
fn device_wgmma_decode_matches_the_simple_kernels_and_the_cpu() {
    use mla_diff::backend::decode_cfg::DecodeCfg;
    let Some(dev) = device_with(ComputeCapability::has_wgmma, "wgmma (sm_90 only)") else {
        return;
    };
    assert!(DecodeCfg::for_heads(128).fit(576, 512).for_arch(dev.arch()).wgmma);
    let ctx = [1usize, 3, 63, 64, 65, 200, 1000];
    check_fast_decode_at_v3(&dev, "wgmma", &[(128, 16), (80, 64)], &[1, 3], &ctx);
}

/// The teams block (the N < 64 default on sm_90+: two consumer teams, four producer warps, four
/// stages, the splits merged through a thread-block cluster) against the simple kernels and
/// the CPU ([`check_fast_decode_at_v3`]): 16 heads and 20 (a second head group of 4 real heads
/// and 12 zero rows), contexts of 1 tile (team 1 idle) to 1000 positions, pages of 64 and 16,
/// 1 split (no merge), 2 (the cluster merge), 3 and 12 (the merge through global memory: 512
/// value columns do not split into 3 float4 shares, and 12 blocks are past a cluster).
#[test]
#[ignore = "needs a CUDA device: cargo test --release --test cuda -- --include-ignored"]
fn device_teams_decode_matches_the_simple_kernels_and_the_cpu() {
    use mla_diff::backend::decode_cfg::DecodeCfg;
    let Some(dev) = device_with(ComputeCapability::has_tma, "bulk copies (sm_90+)") else {
        return;
    };
    assert_eq!(
        DecodeCfg::for_heads(16).fit(576, 512).for_arch(dev.arch()),
        DecodeCfg::TEAMS
    );
    let ctx = [1usize, 3, 31, 32, 33, 64, 65, 200, 1000];
    check_fast_decode_at_v3(&dev, "teams", &[(16, 64), (20, 16)], &[1, 2, 3, 12], &ctx);
}

/// The teams block's variants give the bits of the default: 5 stages
/// (a team also waits for the other team's release of a stage), 1 and 2 producer warps, and the merge through global
/// memory (last split, and every split its share) instead of the cluster, at 1, 2, 3 and 8
/// splits, with a token of no positions, tokens shorter than a tile, and 20 heads; the
/// counters are zero again after every launch.
#[test]
#[ignore = "needs a CUDA device: cargo test --release --test cuda -- --include-ignored"]
fn device_teams_variants_give_the_same_bits() {
    use mla_diff::backend::decode_cfg::DecodeCfg;
    let Some(ops) = device_with(ComputeCapability::has_tma, "bulk copies (sm_90+)") else {
        return;
    };
    let case = MergeCase::new(&ops, &[0, 1, 3, 7, 31, 32, 33, 64, 100, 257, 1000], 20);
    let (nh, l) = (case.nh, case.l);
    let t = DecodeCfg::TEAMS;
    let variants = [
        (DecodeCfg { stages: 5, ..t }, None),
        (DecodeCfg { producers: 1, ..t }, None),
        (DecodeCfg { producers: 2, ..t }, None),
        (DecodeCfg { cluster: false, ..t }, Some(false)),
        (DecodeCfg { cluster: false, ..t }, Some(true)),
    ];
    for splits in [1usize, 2, 3, 8] {
        let (bo, bl, counts) = case.launch(&ops, t, splits, f32::NEG_INFINITY, None, true);
        assert!(
            counts.iter().all(|&c| c == 0),
            "splits {splits}: counters left {counts:?}"
        );
        assert!(
            bo[(case.ctx.len() - 1) * nh * l..]
                .iter()
                .any(|&x| x != 0.0 && x.is_finite())
        );
        for (cfg, spin) in variants {
            let (vo, vl, counts) = case.launch(&ops, cfg, splits, f32::NEG_INFINITY, spin, true);
            let what = format!("{} spin {spin:?} splits {splits}", cfg.label());
            case.assert_same_bits(&what, (&cfg.label(), &vo, &vl), ("the default", &bo, &bl));
            assert!(counts.iter().all(|&c| c == 0), "{what}: counters left {counts:?}");
        }
    }
}

/// With one split the wgmma block writes the merged output directly when every LSE of a block
/// is finite: the same bits as its stage-1 partials passed through the merge (`p + 0`, LSE
/// `+ 0`), checked against the partials and LSEs of a launch without the merge, at 80 heads
/// (a second head group of 16 real heads), V3 dims, with a token of no positions (its block
/// takes the merge path: LSE −inf); the counters stay zero.
#[test]
#[ignore = "needs a CUDA device: cargo test --release --test cuda -- --include-ignored"]
fn device_wgmma_one_split_writes_the_merge_directly() {
    use mla_diff::backend::decode_cfg::DecodeCfg;
    let Some(ops) = device_with(ComputeCapability::has_wgmma, "wgmma (sm_90 only)") else {
        return;
    };
    let case = MergeCase::new(&ops, &[0, 1, 3, 64, 65, 257, 1000], 80);
    let (nh, l) = (case.nh, case.l);
    let (p, pl, _) = case.launch(&ops, DecodeCfg::WGMMA, 1, f32::NEG_INFINITY, None, false);
    let (mo, ml, counts) = case.launch(&ops, DecodeCfg::WGMMA, 1, f32::NEG_INFINITY, None, true);
    assert!(counts.iter().all(|&c| c == 0), "counters left {counts:?}");
    // Token 0 has no positions: merged output zeros and LSE −inf; every other token's merged
    // output is its partial + 0 (−0 becomes +0), bit for bit.
    let plus0 = |x: f32| x + 0.0;
    for (e, (&m, &q)) in mo.iter().zip(&p).enumerate().skip(nh * l) {
        assert_eq!(m.to_bits(), plus0(q).to_bits(), "out[{e}]: merged {m} partial {q}");
    }
    assert!(mo[..nh * l].iter().all(|&x| x == 0.0) && ml[..nh].iter().all(|&x| x == f32::NEG_INFINITY));
    for (e, (&m, &q)) in ml.iter().zip(&pl).enumerate().skip(nh) {
        assert_eq!(m.to_bits(), plus0(q).to_bits(), "lse[{e}]: merged {m} partial {q}");
    }
    assert!(mo[nh * l..].iter().any(|&x| x != 0.0 && x.is_finite()));
}

/// The GPU reference against the CPU reference on every committed fixture (and, when
/// `MLA_DIFF_V3` names the sparse DeepSeek-V3 file of `scripts/fixtures/make_sparse_gguf.py`, its layer 3
/// at T = 512): the largest rel_l2 of any site is printed and must be within
/// `REFERENCE_AGREEMENT`.
#[test]
#[ignore = "needs a CUDA device: cargo test --release --test cuda -- --include-ignored"]
fn device_reference_matches_the_cpu_reference() {
    use mla_diff::judge::tolerance::REFERENCE_AGREEMENT;
    let Some(ops) = device() else { return };
    let mut models: Vec<(std::path::PathBuf, Batch, Option<usize>)> =
        std::fs::read_dir(common::repo().join("golden/models"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
            .map(|p| (p, mla_diff::jobs::selftest::selftest_batch(16), None))
            .collect();
    models.sort_by(|a, b| a.0.cmp(&b.0));
    if let Some(v3) = std::env::var_os("MLA_DIFF_V3") {
        models.push((v3.into(), Batch::single(512, 0), Some(3)));
    }
    let (mut worst, mut at, mut sites) = (0f64, String::new(), 0);
    for (path, batch, only) in &models {
        let file = mla_diff::model::gguf::GgufFile::open(path).unwrap();
        let cfg = MlaConfig::from_gguf(&file).unwrap();
        let per_site = match only {
            None => mla_diff::jobs::selftest::reference_agreement(&ops, &file, &cfg, batch, 7).unwrap(),
            Some(layer) => {
                let w = LayerWeights::load(&file, &cfg, *layer).unwrap();
                let t = batch.n_tokens();
                let hidden = ndarray::Array2::from_shape_vec((t, cfg.hidden), normal_f32(9, t * cfg.hidden))
                    .unwrap()
                    .mapv(f64::from);
                let cpu = mla_diff::compute::reference::reference_layer(&cfg, &w, &hidden, batch, 1, None).unwrap();
                let gpu =
                    mla_diff::backend::cuda::reference::reference_layer(ops.device(), &cfg, &w, &hidden, batch, 1)
                        .unwrap();
                let tol = mla_diff::judge::tolerance::GOLDEN_TOLERANCE.0;
                cpu.trace
                    .entries()
                    .iter()
                    .map(|(s, r)| {
                        (
                            *s,
                            mla_diff::judge::metrics::metrics(r, gpu.trace.get(s).unwrap(), &tol).rel_l2,
                        )
                    })
                    .collect()
            }
        };
        for (site, e) in per_site {
            sites += 1;
            // A NaN rel_l2 counts as the worst.
            if e.is_nan() || e > worst {
                worst = e;
                at = format!("{site} of {}", path.display());
            }
        }
    }
    eprintln!(
        "GPU vs CPU reference: {sites} sites of {} models, largest rel_l2 {worst:.3e} at {at}",
        models.len()
    );
    assert!(sites > 100, "{sites} sites compared");
    assert!(worst <= REFERENCE_AGREEMENT, "largest rel_l2 {worst:e} at {at}");
}

/// Every site of `a` against the same site of `b`: same status, failed metrics, counts and worst
/// element; the f64 sums (norms, rel_l2) to 1e-9 relative (block order vs chunk order), cos_diff
/// to 1e-12 absolute.
fn assert_same_diffs(a: &[mla_diff::judge::metrics::SiteDiff], b: &[mla_diff::judge::metrics::SiteDiff], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: site counts");
    for (x, y) in a.iter().zip(b) {
        assert_eq!((x.site, x.status, &x.failed), (y.site, y.status, &y.failed), "{what}");
        let (Some(m), Some(n)) = (&x.metrics, &y.metrics) else {
            assert_eq!(x.metrics.is_none(), y.metrics.is_none(), "{what} {}", x.site);
            continue;
        };
        let counts = |m: &mla_diff::judge::metrics::Metrics| {
            (
                m.numel,
                m.nonfinite_ref,
                m.nonfinite_cand,
                m.nonfinite_mismatch,
                m.first_nonfinite_mismatch,
                m.canary,
                m.zero_where_ref_nonzero,
                m.max_abs_index.clone(),
                m.pass_fraction.to_bits(),
            )
        };
        assert_eq!(counts(m), counts(n), "{what} {}", x.site);
        for (u, v, name) in [
            (m.norm_ref, n.norm_ref, "norm_ref"),
            (m.norm_cand, n.norm_cand, "norm_cand"),
            (m.rel_l2, n.rel_l2, "rel_l2"),
            (m.max_abs, n.max_abs, "max_abs"),
            (m.max_rel, n.max_rel, "max_rel"),
        ] {
            let same = (u.is_nan() && v.is_nan()) || u == v || (u - v).abs() <= 1e-9 * u.abs().max(v.abs());
            assert!(same, "{what} {}: {name} {u:e} vs {v:e}", x.site);
        }
        // 1 − 2Σrc/Σ(r²+c²) cancels: its rounding is absolute, about 1e-16 per term summed.
        let (u, v) = (m.cos_diff, n.cos_diff);
        assert!(
            (u.is_nan() && v.is_nan()) || (u - v).abs() <= 1e-12,
            "{what} {}: cos_diff {u:e} vs {v:e}",
            x.site
        );
    }
}

#[test]
#[ignore = "needs a CUDA device: cargo test --release --test cuda -- --include-ignored"]
fn device_comparison_counts_special_values_as_the_host_does() {
    use mla_diff::backend::cuda::compare::SplitTrace;
    use mla_diff::core::canary::CANARY;
    use mla_diff::core::trace::{Site, Stage, Trace, TraceTensor};
    let Some(ops) = device() else { return };
    // Seeded values with planted NaNs, infinities, canaries (exact and quieted), zeros and a tie
    // for the worst element in two blocks far apart.
    let n = 300_001;
    let r: Vec<f64> = normal_f32(3, n).into_iter().map(|x| x as f64 * 2.0).collect();
    let mut c: Vec<f32> = r
        .iter()
        .zip(normal_f32(4, n))
        .map(|(&x, e)| (x + 1e-3 * e as f64) as f32)
        .collect();
    let mut r = r;
    c[5] = CANARY;
    c[70_000] = -f32::from_bits(CANARY.to_bits() | 0x0040_0000);
    c[9] = f32::NAN;
    r[11] = f64::NAN;
    c[11] = f32::NAN;
    r[13] = f64::INFINITY;
    c[13] = f32::INFINITY;
    r[250_000] = f64::NEG_INFINITY;
    c[20] = 0.0;
    for i in [1_000, 200_000] {
        r[i] = 1.0;
        c[i] = 9.0;
    }
    let site = |s| Site::new(0, s);
    let mut host_ref = Trace::new();
    let mut cand = Trace::new();
    host_ref.record(site(Stage::AttnOut), TraceTensor::f64(vec![n], r.clone()));
    cand.record(site(Stage::AttnOut), TraceTensor::f32(vec![n], c.clone()));
    // A clean site and one whose reference is all zeros.
    host_ref.record(
        site(Stage::Lse),
        TraceTensor::f64(vec![7, 3], (0..21).map(|i| i as f64).collect()),
    );
    cand.record(
        site(Stage::Lse),
        TraceTensor::f32(vec![7, 3], (0..21).map(|i| i as f32).collect()),
    );
    host_ref.record(site(Stage::OProj), TraceTensor::f64(vec![4, 5], vec![0.0; 20]));
    cand.record(
        site(Stage::OProj),
        TraceTensor::f32(vec![4, 5], (0..20).map(|i| i as f32 * 0.5).collect()),
    );
    for dtype in [Dtype::F32, Dtype::Bf16] {
        let expected = mla_diff::judge::metrics::diff(&host_ref, &cand, dtype);
        let split = SplitTrace {
            host: Trace::new(),
            device: host_ref
                .entries()
                .iter()
                .map(|(s, t)| mla_diff::backend::cuda::compare::DeviceSite {
                    site: *s,
                    shape: t.shape.clone(),
                    buf: mla_diff::backend::cuda::compare::upload_f64(ops.device(), t).unwrap(),
                })
                .collect(),
        };
        let got = mla_diff::judge::device::diff_host_candidate(ops.device(), &split, &cand, dtype).unwrap();
        assert_same_diffs(&got, &expected, &format!("{dtype:?}"));
        let at = got.iter().position(|d| d.site.stage == Stage::AttnOut).unwrap();
        let m = got[at].metrics.as_ref().unwrap();
        assert_eq!((m.canary, m.first_nonfinite_mismatch), (2, Some(5)));
        assert_eq!(m.max_abs_index, vec![5]);
    }
}

#[test]
#[ignore = "needs a CUDA device: cargo test --release --test cuda -- --include-ignored"]
fn device_comparison_gives_the_verdicts_and_findings_of_the_host_comparison() {
    use mla_diff::compute::faults::{Fault, FaultSet};
    use mla_diff::judge::report::RunConfig;
    let Some(ops) = device() else { return };
    let path = common::repo().join("golden/models/lite-v2-q8_0.gguf");
    let file = mla_diff::model::gguf::GgufFile::open(&path).unwrap();
    let cfg = MlaConfig::from_gguf(&file).unwrap();
    for (dtype, faults) in [
        (Dtype::F32, vec![]),
        (Dtype::Bf16, vec![]),
        (Dtype::F32, vec![Fault::NoMscale]),
        (Dtype::Bf16, vec![Fault::PhantomOutput]),
    ] {
        let backend = Backend::Cuda(ops.with_dtype(dtype).with_gpu_reference(true));
        let rc = RunConfig {
            layers: vec![1],
            batch: mla_diff::jobs::selftest::selftest_batch(16),
            path_options: PathOptions {
                faults: FaultSet(faults.clone()),
                ..PathOptions::default()
            },
            ..RunConfig::default()
        };
        // On the device (a plain run) and on the host (a run keeping its traces).
        let dev = mla_diff::jobs::run::run(&backend, &file, &cfg, &rc).unwrap();
        let (host, _) = mla_diff::jobs::run::run_with_traces(&backend, &file, &cfg, &rc).unwrap();
        let what = format!("{dtype:?} {faults:?}");
        assert_eq!(dev.results.len(), host.results.len(), "{what}");
        for (a, b) in dev.results.iter().zip(&host.results) {
            assert_same_diffs(&a.diffs, &b.diffs, &format!("{what} {}", a.path));
        }
        let classes = |r: &mla_diff::judge::report::RunReport| {
            r.findings
                .iter()
                .map(|f| (f.class, f.site(), f.path()))
                .collect::<Vec<_>>()
        };
        assert_eq!(classes(&dev), classes(&host), "{what}");
        assert_eq!(
            faults.is_empty(),
            dev.findings.is_empty(),
            "{what}: {:?}",
            classes(&dev)
        );
    }
}

/// A 1-rank NCCL all-reduce through the collective interface on GPU 0: NCCL's own call, and the
/// CUDA backend's `Ops::all_reduce_sum` as the engine calls it. The sum over one rank is its
/// partial, bit for bit. Prints the input and both outputs; skips, printing why, without a GPU
/// or without NCCL (docs/gpu-validation.md says how to provide `libnccl.so`).
#[test]
#[ignore = "needs a CUDA device: cargo test --release --test cuda -- --include-ignored"]
fn nccl_one_rank_all_reduce_is_the_identity() {
    use mla_diff::backend::cuda::nccl::{NCCL_MISSING, NcclAllReduce, nccl_present};
    let Some(ops) = device() else { return };
    if !nccl_present() {
        eprintln!("skipped: {NCCL_MISSING}");
        return;
    }
    let input = normal_f32(25, 8);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let nccl = NcclAllReduce::new(&[0]).unwrap();
    assert_eq!(std::env::var("NCCL_NVLS_ENABLE").as_deref(), Ok("0"));
    let out = nccl.all_reduce_sum(std::slice::from_ref(&input), None).unwrap();
    eprintln!("NCCL all-reduce, 1 rank on GPU 0 ({}), NCCL_NVLS_ENABLE=0", ops.arch());
    eprintln!("  input                 {input:?}");
    eprintln!("  NcclAllReduce output  {:?}", out[0]);
    assert_eq!(out.len(), 1);
    assert_eq!(bits(&out[0]), bits(&input));
    let ops = ops.with_nccl(std::rc::Rc::new(nccl));
    assert_eq!(ops.nccl_devices(), Some(&[0usize][..]));
    let buf = ops.upload(&input).unwrap();
    let reduced = ops.all_reduce_sum(vec![buf], input.len(), None).unwrap();
    let got = ops.download(&reduced).unwrap();
    eprintln!("  Ops::all_reduce_sum   {got:?}");
    assert_eq!(bits(&got), bits(&input));
}

/// A buffer of more than 2^32 floats is filled to its last element: a launch covers every
/// element whatever the count (the grid's block count is never cut to 32 bits, which covered
/// `n mod 2^32` elements and left the rest as it was). 16 GiB of device memory.
#[test]
#[ignore = "needs a CUDA device: cargo test --release --test cuda -- --include-ignored"]
fn device_launches_cover_buffers_past_32_bit_counts() {
    let Some(ops) = device() else { return };
    let n = (1usize << 32) + 1024;
    let buf = ops.canary(n).unwrap();
    let tail = ops
        .download(&ops.gather_rows(&buf, 1, &[1023, n - 1]).unwrap())
        .unwrap();
    assert!(
        tail.iter().all(|&x| mla_diff::core::canary::is_canary(x)),
        "the canary fill reached elements {:?}",
        tail.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    );
}

/// Attention over keys read by index (`PrefillArgs::key_rows`, a DSA selection) at GLM-5's head
/// widths (P+R = V = 256): the simple kernel in f32, and the tensor-core build that reads by
/// index in bf16, against the CPU kernel on the same inputs, for causal runs (rows that keep
/// every key up to themselves), spread selections of more than one key tile, an empty row and
/// rows of one key.
#[test]
#[ignore = "needs a CUDA device: cargo test --release --test cuda -- --include-ignored"]
fn device_attention_over_keys_read_by_index_matches_the_cpu() {
    use mla_diff::backend::cuda::ops::Kernels;
    use mla_diff::compute::ops::{EmptyRows, PrefillArgs, sparse_segments};
    let Some(ops) = device() else { return };
    let (nq, nk, nh, dqk, dv) = (300, 400, 4, 256, 256);
    let q = normal_f32(41, nq * nh * dqk);
    let k = normal_f32(42, nk * nh * dqk);
    let v = normal_f32(43, nk * nh * dv);
    let mut keys: Vec<Vec<usize>> = (0..200).map(|i| (0..=i).collect()).collect();
    keys.extend((200..296).map(|i| (0..150).map(|j| (j * 13 + 7 * i) % nk).collect::<Vec<_>>()));
    keys.extend([vec![], vec![399], vec![5, 6], vec![5, 6, 7]]);
    let (segs, rows) = sparse_segments(&keys);
    for (dtype, kernels, bound) in [
        (Dtype::F32, Kernels::Simple, 1e-5),
        (Dtype::Bf16, Kernels::Simple, 1e-5),
        (Dtype::Bf16, Kernels::Fast, 2e-2),
    ] {
        let gpu = ops.with_dtype(dtype).with_kernels(kernels);
        let cpu = CpuOps::new(dtype);
        let cpu_args = PrefillArgs {
            q: &q,
            k: &k,
            v: &v,
            nh,
            dqk,
            dv,
            segments: &segs,
            scale: 0.0625,
            empty: EmptyRows::ZeroMinusInf,
            key_rows: Some(&rows),
        };
        let mut want = (cpu.canary(nq * nh * dv).unwrap(), cpu.canary(nq * nh).unwrap());
        cpu.flash_attention(&cpu_args, &mut want.0, &mut want.1).unwrap();
        let (qd, kd, vd) = (
            gpu.upload(&q).unwrap(),
            gpu.upload(&k).unwrap(),
            gpu.upload(&v).unwrap(),
        );
        let mut out = gpu.canary(nq * nh * dv).unwrap();
        let mut lse = gpu.canary(nq * nh).unwrap();
        gpu.flash_attention(&cpu_args.with_inputs(&qd, &kd, &vd), &mut out, &mut lse)
            .unwrap();
        let got = (gpu.download(&out).unwrap(), gpu.download(&lse).unwrap());
        let what = format!("{dtype:?} {kernels:?}");
        for (name, g, c) in [("out", &got.0, &want.0), ("lse", &got.1, &want.1)] {
            let finite: Vec<(f64, f64)> = g
                .iter()
                .zip(c)
                .filter(|(_, c)| c.is_finite())
                .map(|(&g, &c)| (f64::from(g), f64::from(c)))
                .collect();
            let d = finite.iter().map(|(g, c)| (g - c) * (g - c)).sum::<f64>().sqrt();
            let n = finite.iter().map(|(_, c)| c * c).sum::<f64>().sqrt();
            eprintln!("{what} {name}: rel_l2 {:.3e} vs the CPU", d / n);
            assert!(d <= bound * n, "{what} {name}: rel_l2 {:.3e}", d / n);
        }
        assert_eq!(got.1[296 * nh], f32::NEG_INFINITY, "{what}: the row with no key");
    }
}

/// `compare --backend cuda`: each committed scheduled-run dump (format 2, vLLM's real code on
/// the CPU harness) judged with the f64 reference on the GPU gives the verdict, findings and
/// site statuses the CPU reference gives, through the same union reference.
#[test]
#[ignore = "needs a CUDA device: cargo test --release --test cuda -- --include-ignored"]
fn compare_with_the_gpu_reference_judges_as_the_cpu_one() {
    use mla_diff::jobs::compare::{CompareOptions, compare_steps_with};
    use mla_diff::model::dump::DumpFile;
    let Some(ops) = device() else { return };
    let gpu = CompareOptions {
        backend: Backend::Cuda(ops.with_gpu_reference(true)),
        ..CompareOptions::default()
    };
    let dir = common::repo().join("golden/dumps/live-cpu");
    let mut names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    names.sort();
    let file = mla_diff::model::gguf::GgufFile::open(common::repo().join("golden/models/legacy-kvb-f32.gguf")).unwrap();
    let cfg = MlaConfig::from_gguf(&file).unwrap();
    let verdicts = |opts: &CompareOptions, p: &std::path::Path| {
        let DumpFile::Steps(sd) = mla_diff::model::dump::read(p, None, &cfg).unwrap() else {
            panic!("{}: not format 2", p.display())
        };
        let (rep, tally) = compare_steps_with(&file, &cfg, &sd, None, None, None, opts).unwrap();
        let doc = mla_diff::output::report::json(&rep);
        let sites: Vec<String> = doc["sites"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| format!("{} {} {}", s["step"], s["site"], s["status"]))
            .collect();
        let findings: Vec<String> = doc["findings"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| format!("{} {}", f["class"], f["site"]))
            .collect();
        (sites, findings, tally.per_step)
    };
    for p in names
        .iter()
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
    {
        let cpu = verdicts(&CompareOptions::default(), p);
        let on_gpu = verdicts(&gpu, p);
        eprintln!("{}: {} sites, findings {:?}", p.display(), cpu.0.len(), cpu.1);
        assert_eq!(cpu, on_gpu, "{}", p.display());
        assert_eq!(on_gpu.2, 0, "{}: the union served every step", p.display());
    }
}

/// `compare --backend cuda` brings to the host only the reference stages judging reads, and
/// every stage only where a step diverges (its diagnosis reads them): its JSON report is the one
/// downloading every site at once gives, byte for byte, on each committed format-2 dump of vLLM's
/// real code on the CPU harness and each plant dump (which diverge, so the lazy whole download
/// runs); a clean dump downloads once per reference, one with a site out of tolerance again.
#[test]
#[ignore = "needs a CUDA device: cargo test --release --test cuda -- --include-ignored"]
fn compare_on_the_gpu_downloads_the_judged_stages_and_reports_as_downloading_all() {
    use mla_diff::jobs::compare::{CompareOptions, ReferenceDownload, compare_steps_with};
    use mla_diff::model::dump::DumpFile;
    let Some(ops) = device() else { return };
    let with = |download| CompareOptions {
        backend: Backend::Cuda(ops.with_gpu_reference(true)),
        download,
        ..CompareOptions::default()
    };
    let (judged_opts, whole_opts) = (with(ReferenceDownload::Judged), with(ReferenceDownload::Whole));
    let (mut checked, mut diverging) = (0, 0);
    for folder in ["live-cpu", "plants"] {
        let dir = common::repo().join("golden/dumps").join(folder);
        let mut names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        names.sort();
        for p in names {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            let fixture = name.split('.').next().unwrap();
            let file = mla_diff::model::gguf::GgufFile::open(
                common::repo().join("golden/models").join(format!("{fixture}.gguf")),
            )
            .unwrap();
            let cfg = MlaConfig::from_gguf(&file).unwrap();
            let DumpFile::Steps(sd) = mla_diff::model::dump::read(&p, None, &cfg).unwrap() else {
                panic!("{name}: not format 2")
            };
            let report = |opts: &CompareOptions| {
                let _ = mla_diff::core::timing::take();
                let (rep, tally) = compare_steps_with(&file, &cfg, &sd, None, None, None, opts).unwrap();
                let downloads = mla_diff::core::timing::take()
                    .iter()
                    .find(|s| s.name == "download")
                    .map_or(0, |s| s.count as usize);
                let doc = mla_diff::output::report::json(&rep);
                (mla_diff::output::report::to_json_bytes(&doc), doc, tally, downloads)
            };
            let (judged, doc, tally, downloads) = report(&judged_opts);
            let (whole, _, _, _) = report(&whole_opts);
            assert_eq!(
                String::from_utf8_lossy(&judged),
                String::from_utf8_lossy(&whole),
                "{name}"
            );
            let references = tally.union + tally.per_step;
            // A step with a site out of tolerance is diagnosed, which downloads the rest.
            let failed = doc["sites"].as_array().unwrap().iter().any(|s| s["status"] != "pass");
            if failed {
                diverging += 1;
                assert!(downloads > references, "{name}: {downloads} downloads, {tally:?}");
            } else {
                assert_eq!(downloads, references, "{name}: {tally:?}");
            }
            checked += 1;
        }
    }
    eprintln!("{checked} dumps, {diverging} diverging");
    assert!(
        checked >= 60 && diverging >= 40,
        "{checked} dumps, {diverging} diverging"
    );
}

/// `compare --backend cuda` judges each step on the device, its rows (and a head subset's heads)
/// gathered there: every site's status, failing metrics and findings are those of judging on the
/// host after downloading every site, and each metric agrees to f64 rounding, on every committed
/// format-2 dump of vLLM's real code (CPU harness, plants, and the H200's live dumps, some of
/// which hold a head subset).
#[test]
#[ignore = "needs a CUDA device: cargo test --release --test cuda -- --include-ignored"]
fn compare_judging_on_the_device_gives_the_hosts_verdicts() {
    use mla_diff::jobs::compare::{CompareOptions, ReferenceDownload, compare_steps_with};
    use mla_diff::model::dump::DumpFile;
    let Some(ops) = device() else { return };
    let with = |download| CompareOptions {
        backend: Backend::Cuda(ops.with_gpu_reference(true)),
        download,
        ..CompareOptions::default()
    };
    let (device_opts, whole_opts) = (with(ReferenceDownload::Device), with(ReferenceDownload::Whole));
    let mut checked = 0;
    for folder in ["live-cpu", "plants", "live-gpu"] {
        let dir = common::repo().join("golden/dumps").join(folder);
        let mut names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        names.sort();
        for p in names {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            let fixture = name.split('.').next().unwrap();
            let file = mla_diff::model::gguf::GgufFile::open(
                common::repo().join("golden/models").join(format!("{fixture}.gguf")),
            )
            .unwrap();
            let cfg = MlaConfig::from_gguf(&file).unwrap();
            let DumpFile::Steps(sd) = mla_diff::model::dump::read(&p, None, &cfg).unwrap() else {
                panic!("{name}: not format 2")
            };
            let report = |opts: &CompareOptions| {
                let (rep, _) = compare_steps_with(&file, &cfg, &sd, None, None, None, opts).unwrap();
                mla_diff::output::report::json(&rep)
            };
            let (on_device, whole) = (report(&device_opts), report(&whole_opts));
            assert_eq!(on_device["findings"], whole["findings"], "{name}");
            let (a, b) = (
                on_device["sites"].as_array().unwrap(),
                whole["sites"].as_array().unwrap(),
            );
            assert_eq!(a.len(), b.len(), "{name}");
            for (x, y) in a.iter().zip(b) {
                let what = format!("{name}: {} {}", x["step"], x["site"]);
                assert_eq!(
                    (&x["site"], &x["step"], &x["status"]),
                    (&y["site"], &y["step"], &y["status"]),
                    "{what}"
                );
                assert_eq!(x["failed"], y["failed"], "{what}");
                for m in ["rel_l2", "cos_diff", "norm_ratio", "max_abs", "pass_fraction"] {
                    let (u, v) = (x["metrics"][m].as_f64(), y["metrics"][m].as_f64());
                    if let (Some(u), Some(v)) = (u, v) {
                        // Sums in another order: relative f64 rounding, and absolute near 0
                        // (a cos_diff of 1e-15 is 1 − a ratio that is 1 to 15 digits).
                        assert!((u - v).abs() <= 1e-9 * v.abs() + 1e-12, "{what} {m}: {u} vs {v}");
                    } else {
                        assert_eq!(u, v, "{what} {m}");
                    }
                }
            }
            checked += 1;
        }
    }
    eprintln!("{checked} dumps judged on the device and on the host");
    assert!(checked >= 70, "{checked} dumps");
}

/// Every GPU test of this file is `#[ignore]`d with the reason, so a machine without a GPU
/// reports them as ignored, not passed; this test (the only one that runs without a device)
/// counts them.
#[test]
fn every_gpu_test_is_ignored_without_being_asked_for() {
    let src = std::fs::read_to_string(common::repo().join("tests/cuda.rs")).unwrap();
    let lines: Vec<&str> = src.lines().collect();
    let tests: Vec<usize> = (0..lines.len()).filter(|&i| lines[i] == "#[test]").collect();
    let ignored = tests
        .iter()
        .filter(|&&i| {
            lines.get(i + 1)
                == Some(&"#[ignore = \"needs a CUDA device: cargo test --release --test cuda -- --include-ignored\"]")
        })
        .count();
    // This test itself is the one not ignored.
    assert_eq!((tests.len(), ignored), (19, 18));
}
