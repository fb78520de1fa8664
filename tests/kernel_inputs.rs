//! `run --export-inputs`: the kernel inputs it writes reproduce the reference when run through
//! the CPU backend's own decode and flash-attention kernels (so a production kernel fed the same
//! file is judged alone), `--rank` exports the slice of heads of the full export, and a format-2
//! dump built on the export's `dump_header` is judged by `compare` with `kernel_precision` and
//! `heads`: a clean bf16 kernel passes, a base-2 LSE and shifted heads do not.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use mla_diff::backend::cpu::CpuOps;
use mla_diff::compute::ops::{DecodeArgs, EmptyRows, Ops, PrefillArgs, Segment};
use mla_diff::core::batch::{Batch, SeqSpec};
use mla_diff::core::dtype::Dtype;
use mla_diff::core::st::ExtraTensor;
use mla_diff::core::trace::{Site, Stage, Trace, TraceTensor};
use mla_diff::judge::metrics;
use mla_diff::judge::tolerance::Precision;
use mla_diff::model::config::MlaConfig;
use mla_diff::model::gguf::GgufFile;
use mla_diff::model::weights::LayerWeights;

use crate::common::{compare_json, repo, run_bin, write_safetensors};

/// An `inputs.safetensors` as read back: tensors (widened to f64) and metadata.
struct Inputs {
    t: BTreeMap<String, ExtraTensor>,
    meta: BTreeMap<String, String>,
}

impl Inputs {
    fn read(p: &Path) -> Inputs {
        let f = mla_diff::core::st::read(p).unwrap();
        assert!(f.trace.entries().is_empty(), "no site names in the export");
        Inputs {
            t: f.extra,
            meta: f.metadata,
        }
    }

    fn get(&self, name: &str) -> &ExtraTensor {
        self.t.get(name).unwrap_or_else(|| panic!("{name} missing"))
    }

    fn f32(&self, name: &str) -> Vec<f32> {
        self.get(name).data.iter().map(|&x| x as f32).collect()
    }

    fn usize(&self, name: &str) -> Vec<usize> {
        self.get(name).data.iter().map(|&x| x as usize).collect()
    }

    fn meta_usize(&self, key: &str) -> usize {
        self.meta[key].parse().unwrap()
    }
}

/// Runs `mla-diff run ARGS --export-inputs DIR --quiet` (exit 0 asserted) and reads the export.
fn export(args: &[&str], dir: &Path) -> Inputs {
    let mut a = vec!["run", "--quiet", "--export-inputs", dir.to_str().unwrap()];
    a.extend_from_slice(args);
    let (code, out, err) = run_bin(&a);
    assert_eq!(code, 0, "{out}\n{err}");
    let line = out.lines().find(|l| l.starts_with("kernel inputs: wrote")).expect(&out);
    let file = dir.join("inputs.safetensors");
    let bytes = std::fs::metadata(&file).unwrap().len();
    assert!(line.contains(&format!("{bytes} bytes")), "{line}");
    Inputs::read(&file)
}

/// The model, its config, and the reference trace of `layer` run on the export's `hidden_in`.
fn reference(model: Option<&str>, layer: usize, inp: &Inputs) -> (GgufFile, MlaConfig, Batch, Trace) {
    let file =
        mla_diff::model::fixture::open_model(model.map(|m| repo().join("golden/models").join(m)).as_ref()).unwrap();
    let cfg = MlaConfig::from_gguf(&file).unwrap();
    let seqs: Vec<usize> = inp.meta["seqs"].split(',').map(|s| s.parse().unwrap()).collect();
    let batch = Batch {
        seqs: seqs.iter().map(|&len| SeqSpec { len, start_pos: 0 }).collect(),
    };
    let h = inp.get("hidden_in");
    let hidden = ndarray::Array2::from_shape_vec((h.shape[0], h.shape[1]), h.data.clone()).unwrap();
    let w = LayerWeights::load(&file, &cfg, layer).unwrap();
    let r = mla_diff::compute::reference::reference_layer(&cfg, &w, &hidden, &batch, 1, None).unwrap();
    (file, cfg, batch, r.trace)
}

/// The reference site `stage` of `layer`, heads `a..b` of a `[T, N, X]` or `[T, N]` site.
fn heads_of(tr: &Trace, layer: usize, stage: Stage, n: usize, (a, b): (usize, usize)) -> TraceTensor {
    let t = tr.get(&Site::new(layer, stage)).unwrap();
    let rows = t.shape[0];
    let x = t.len() / (rows * n);
    let all = t.to_f64();
    let v: Vec<f64> = (0..rows)
        .flat_map(|i| all[(i * n + a) * x..(i * n + b) * x].to_vec())
        .collect();
    let mut shape = t.shape.clone();
    shape[1] = b - a;
    TraceTensor::f64(shape, v)
}

/// Every site of `cand` within the f32 tolerance rows against `reference`.
fn assert_f32_pass(reference: &Trace, cand: &Trace, what: &str) {
    let diffs = metrics::diff(reference, cand, Precision::F32);
    assert_eq!(diffs.len(), cand.entries().len());
    for d in &diffs {
        assert!(!d.is_failure(), "{what}: {} fails: {d:?}", d.site);
        let m = d.metrics.as_ref().unwrap();
        assert!(m.rel_l2 < 1e-5, "{what}: {} rel_l2 {}", d.site, m.rel_l2);
    }
}

/// The exported decode inputs through the CPU decode (split-KV partials merged by LSE), and the
/// prefill inputs through the CPU flash attention, give the reference's `attn_latent`, `lse` and
/// `attn_out` within the f32 rows; the tensors themselves are the reference's sites rounded to
/// f32, the cache laid out through the engine paths' block tables with unused slots 0.
#[test]
fn exported_inputs_reproduce_the_reference_through_the_cpu_kernels() {
    // (model, layer, seed, arguments): the embedded default; a YaRN model without q compression
    // and P ≠ V, several sequences, a page size that divides none of them; the fixture with
    // DeepSeek-V3's head dims at FlashMLA's page size.
    let cases: [(Option<&str>, usize, u64, &[&str]); 3] = [
        (None, 1, 0, &["--layer", "1"]),
        (
            Some("lite-v2-f32.gguf"),
            0,
            3,
            &[
                "--layer",
                "0",
                "--seqs",
                "1,15,17,5",
                "--page-size",
                "6",
                "--seed",
                "3",
                "--path",
                "mqa",
            ],
        ),
        (
            Some("fa3-v3-bf16.gguf"),
            1,
            0,
            &["--layer", "1", "--seqs", "3,70", "--page-size", "64", "--path", "mha"],
        ),
    ];
    for (model, layer, seed, args) in cases {
        let dir = tempfile::tempdir().unwrap();
        let mut a: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        if let Some(m) = model {
            a.extend([
                "--model".into(),
                repo().join("golden/models").join(m).display().to_string(),
            ]);
        }
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        let inp = export(&a, dir.path());
        let (file, cfg, batch, tr) = reference(model, layer, &inp);
        let case = ExportCase {
            inp,
            file,
            cfg,
            batch,
            tr,
            layer,
            seed,
            what: model.unwrap_or("embedded").to_string(),
        };
        let scale = case.check_metadata();
        case.check_tensors_are_reference_sites();
        case.check_cache_layout();
        case.check_cpu_decode(scale);
        case.check_cpu_prefill(scale);
        case.check_dump_header();
    }
}

/// One export with the reference it is checked against.
struct ExportCase {
    inp: Inputs,
    file: GgufFile,
    cfg: MlaConfig,
    batch: Batch,
    tr: Trace,
    layer: usize,
    seed: u64,
    what: String,
}

impl ExportCase {
    /// The metadata names the format, the heads, the layer and the MLA dims; returns the
    /// `softmax_scale`, printed in full.
    fn check_metadata(&self) -> f64 {
        let (inp, what) = (&self.inp, &self.what);
        let [n, l, p, r, v] = self.cfg.dims().nlprv();
        assert_eq!(inp.meta["format"], "mla-diff kernel inputs 1");
        assert_eq!(inp.meta["heads"], format!("0,{n}"));
        assert_eq!(inp.meta_usize("n_head"), n);
        assert_eq!(inp.meta_usize("layer"), self.layer);
        assert_eq!(
            [
                inp.meta_usize("kv_lora_rank"),
                inp.meta_usize("qk_nope_head_dim"),
                inp.meta_usize("qk_rope_head_dim"),
                inp.meta_usize("v_head_dim")
            ],
            [l, p, r, v]
        );
        let scale: f64 = inp.meta["softmax_scale"].parse().unwrap();
        assert_eq!(scale, self.cfg.softmax_scale, "{what}: softmax_scale printed in full");
        scale
    }

    /// The decode and prefill tensors are the reference's sites, rounded to f32 (`k_pe`
    /// broadcast to every head).
    fn check_tensors_are_reference_sites(&self) {
        let inp = &self.inp;
        let [n, l, p, r, v] = self.cfg.dims().nlprv();
        let t = self.batch.n_tokens();
        let site = |s: Stage| self.tr.get(&Site::new(self.layer, s)).unwrap().to_f64();
        let (ql, qpe, q, kn, kpe) = (
            site(Stage::QlNope),
            site(Stage::QPeRoped),
            site(Stage::Q),
            site(Stage::KNope),
            site(Stage::KPeRoped),
        );
        let dq = inp.f32("decode.q");
        let pq = inp.f32("prefill.q");
        let pk = inp.f32("prefill.k");
        assert_eq!(inp.get("decode.q").shape, vec![t, n, l + r]);
        assert_eq!(inp.get("prefill.q").shape, vec![t, n, p + r]);
        assert_eq!(inp.get("prefill.v").shape, vec![t, n, v]);
        for (i, h) in [(0, 0), (t - 1, n - 1), (t / 2, n / 2)] {
            let row = i * n + h;
            assert_eq!(dq[row * (l + r) + 3], ql[row * l + 3] as f32);
            assert_eq!(dq[row * (l + r) + l + 1], qpe[row * r + 1] as f32);
            assert_eq!(pq[row * (p + r) + 2], q[row * (p + r) + 2] as f32);
            assert_eq!(pq[row * (p + r) + p + 1], qpe[row * r + 1] as f32);
            assert_eq!(pk[row * (p + r) + 5], kn[row * p + 5] as f32);
            assert_eq!(
                pk[row * (p + r) + p + 2],
                kpe[i * r + 2] as f32,
                "k_pe broadcast to every head"
            );
        }
    }

    /// The cache: the engine paths' block tables, every token's row (`kv_c_normed` ‖ `k_pe`) at
    /// its slot, the rest 0; `cu_seqlens` spans the batch.
    fn check_cache_layout(&self) {
        let (inp, batch) = (&self.inp, &self.batch);
        let [_, l, _, r, _] = self.cfg.dims().nlprv();
        let site = |s: Stage| self.tr.get(&Site::new(self.layer, s)).unwrap().to_f64();
        let (kpe, kvc) = (site(Stage::KPeRoped), site(Stage::KvCNormed));
        let page = inp.meta_usize("page_size");
        let (num_blocks, tables) = mla_diff::compute::engine::paged_block_tables(batch, page, self.seed);
        let cache = inp.f32("decode.kv_cache");
        assert_eq!(inp.get("decode.kv_cache").shape, vec![num_blocks, page, l + r]);
        let bt = inp.usize("decode.block_table");
        let max_blocks = inp.get("decode.block_table").shape[1];
        assert_eq!(max_blocks, tables.iter().map(Vec::len).max().unwrap());
        let seqlens = inp.usize("decode.cache_seqlens");
        let mut written = vec![false; num_blocks * page];
        let mut row = 0;
        for (s, sq) in batch.seqs.iter().enumerate() {
            for i in 0..sq.len {
                assert_eq!(seqlens[row], i + 1);
                let tbl = &bt[row * max_blocks..(row + 1) * max_blocks];
                assert_eq!(&tbl[..tables[s].len()], tables[s].as_slice());
                assert!(tbl[tables[s].len()..].iter().all(|&b| b == 0), "padded with 0");
                let slot = tables[s][i / page] * page + i % page;
                written[slot] = true;
                assert_eq!(cache[slot * (l + r) + 7], kvc[row * l + 7] as f32);
                assert_eq!(cache[slot * (l + r) + l + 3], kpe[row * r + 3] as f32);
                row += 1;
            }
        }
        for (slot, w) in written.iter().enumerate() {
            if !w {
                assert!(cache[slot * (l + r)..(slot + 1) * (l + r)].iter().all(|&x| x == 0.0));
            }
        }
        let cu = inp.usize("prefill.cu_seqlens");
        assert_eq!(cu.len(), batch.seqs.len() + 1);
        assert_eq!(*cu.last().unwrap(), batch.n_tokens());
    }

    /// The decode inputs through the CPU backend's split-KV decode and merge give the
    /// reference's `attn_latent` and `lse` within the f32 rows.
    fn check_cpu_decode(&self, scale: f64) {
        let inp = &self.inp;
        let [n, l, _, r, _] = self.cfg.dims().nlprv();
        let t = self.batch.n_tokens();
        let ops = CpuOps::new(Dtype::F32);
        let max_blocks = inp.get("decode.block_table").shape[1];
        let bt = inp.usize("decode.block_table");
        let row_tables: Vec<Vec<usize>> = bt.chunks(max_blocks).map(<[usize]>::to_vec).collect();
        let (lat, lse) = ops
            .decode_merged(&DecodeArgs {
                q: &inp.f32("decode.q"),
                n: t,
                nh: n,
                cache: &inp.f32("decode.kv_cache"),
                block_size: inp.meta_usize("page_size"),
                width: l + r,
                tables: &row_tables,
                ctx: &inp.usize("decode.cache_seqlens"),
                splits: 4,
                dv: l,
                scale: scale as f32,
                empty_lse: f32::NEG_INFINITY,
            })
            .unwrap();
        let mut cand = Trace::new();
        cand.record(
            Site::new(self.layer, Stage::AttnLatent),
            TraceTensor::f32(vec![t, n, l], lat),
        );
        cand.record(Site::new(self.layer, Stage::Lse), TraceTensor::f32(vec![t, n], lse));
        assert_f32_pass(&self.tr, &cand, &format!("{} decode", self.what));
    }

    /// The prefill inputs through the CPU flash attention, one causal segment per sequence of
    /// `cu_seqlens`, give the reference's `attn_out` and `lse` within the f32 rows.
    fn check_cpu_prefill(&self, scale: f64) {
        let inp = &self.inp;
        let [n, _, p, r, v] = self.cfg.dims().nlprv();
        let t = self.batch.n_tokens();
        let ops = CpuOps::new(Dtype::F32);
        let segs: Vec<Segment> = inp
            .usize("prefill.cu_seqlens")
            .windows(2)
            .map(|w| Segment::causal_self(w[0], w[1] - w[0]))
            .collect();
        let mut out = ops.canary(t * n * v).unwrap();
        let mut lse = ops.canary(t * n).unwrap();
        ops.flash_attention(
            &PrefillArgs {
                q: &inp.f32("prefill.q"),
                k: &inp.f32("prefill.k"),
                v: &inp.f32("prefill.v"),
                nh: n,
                dqk: p + r,
                dv: v,
                segments: &segs,
                scale: scale as f32,
                empty: EmptyRows::ZeroMinusInf,
                key_rows: None,
            },
            &mut out,
            &mut lse,
        )
        .unwrap();
        let mut cand = Trace::new();
        cand.record(
            Site::new(self.layer, Stage::AttnOut),
            TraceTensor::f32(vec![t, n, v], out),
        );
        cand.record(Site::new(self.layer, Stage::Lse), TraceTensor::f32(vec![t, n], lse));
        assert_f32_pass(&self.tr, &cand, &format!("{} prefill", self.what));
    }

    /// The dump header names this model and layer, all heads, and one `kernel` step whose
    /// sequences are all new tokens.
    fn check_dump_header(&self) {
        let (file, layer, n) = (&self.file, self.layer, self.cfg.n_head);
        let h: serde_json::Value = serde_json::from_str(&self.inp.meta["dump_header"]).unwrap();
        assert_eq!(h["model"]["index_sha256"], file.index_sha256_hex());
        assert_eq!(
            h["model"]["layer_sha256"][layer.to_string()],
            file.layer_sha256_hex(layer)
        );
        assert_eq!(h["model"]["bytes"], file.file_len());
        assert_eq!(h["heads"], serde_json::json!([0, n]));
        assert_eq!(h["steps"][0]["name"], "kernel");
        let news: Vec<usize> = h["steps"][0]["seqs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| {
                assert_eq!(s["context"], 0);
                s["new"].as_u64().unwrap() as usize
            })
            .collect();
        assert_eq!(news, self.batch.seqs.iter().map(|s| s.len).collect::<Vec<_>>());
    }
}

/// `--tp TP --rank R` exports heads `R·N/TP .. (R+1)·N/TP`: the per-head tensors are that slice of
/// the full export, bit for bit, and everything else is the full export's.
#[test]
fn a_ranks_export_is_its_slice_of_the_full_export() {
    let (full_dir, rank_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let base = ["--layer", "1", "--seqs", "4,9", "--page-size", "4", "--path", "mha"];
    let full = export(&base, full_dir.path());
    let mut args = base.to_vec();
    args.extend(["--tp", "3", "--rank", "2"]);
    let part = export(&args, rank_dir.path());
    let n = full.meta_usize("n_head");
    let (a, b) = (2 * n / 3, n);
    assert_eq!(part.meta["heads"], format!("{a},{b}"));
    let h: serde_json::Value = serde_json::from_str(&part.meta["dump_header"]).unwrap();
    assert_eq!(h["heads"], serde_json::json!([a, b]));
    for (name, x) in [
        (
            "decode.q",
            full.meta_usize("kv_lora_rank") + full.meta_usize("qk_rope_head_dim"),
        ),
        (
            "prefill.q",
            full.meta_usize("qk_nope_head_dim") + full.meta_usize("qk_rope_head_dim"),
        ),
        (
            "prefill.k",
            full.meta_usize("qk_nope_head_dim") + full.meta_usize("qk_rope_head_dim"),
        ),
        ("prefill.v", full.meta_usize("v_head_dim")),
    ] {
        let (f, q) = (full.get(name), part.get(name));
        let t = f.shape[0];
        assert_eq!(q.shape, vec![t, b - a, x], "{name}");
        let want: Vec<f64> = (0..t)
            .flat_map(|i| f.data[(i * n + a) * x..(i * n + b) * x].to_vec())
            .collect();
        assert_eq!(q.data, want, "{name}");
    }
    for name in [
        "hidden_in",
        "decode.kv_cache",
        "decode.block_table",
        "decode.cache_seqlens",
        "prefill.cu_seqlens",
    ] {
        assert_eq!(full.get(name), part.get(name), "{name}");
    }
    for key in ["softmax_scale", "page_size", "n_head", "seqs", "layer"] {
        assert_eq!(full.meta[key], part.meta[key], "{key}");
    }
}

/// Refused before any work (exit 2, one line): an existing file without --force, several layers,
/// a start position, a rank outside --tp, a memory limit the export does not fit.
#[test]
fn export_refusals_are_usage_errors() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let (code, out, err) = run_bin(&["run", "--quiet", "--path", "mha", "--export-inputs", d]);
    assert_eq!(code, 0, "{out}\n{err}");
    let file = dir.path().join("inputs.safetensors");
    let before = std::fs::read(&file).unwrap();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec![], "exists; pass --force"),
        (vec!["--layers", "0..2"], "one layer"),
        (vec!["--start-pos", "4", "--force"], "--start-pos 0"),
        (vec!["--tp", "2", "--rank", "2", "--force"], "--rank 2"),
        (vec!["--max-memory", "64K", "--force"], "--export-inputs file about"),
    ];
    for (extra, want) in cases {
        let mut a = vec!["run", "--quiet", "--path", "mha", "--export-inputs", d];
        a.extend(extra.iter().copied());
        let (code, out, err) = run_bin(&a);
        assert_eq!(code, 2, "{extra:?}: {out}\n{err}");
        assert!(err.contains(want), "{extra:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert_eq!(std::fs::read(&file).unwrap(), before, "{extra:?} touched the file");
    }
    // --rank needs --export-inputs (clap's usage error, exit 2).
    let (code, _, _) = run_bin(&["run", "--quiet", "--rank", "0"]);
    assert_eq!(code, 2);
    // --force replaces the file.
    let (code, out, err) = run_bin(&[
        "run",
        "--quiet",
        "--path",
        "mha",
        "--seed",
        "1",
        "--force",
        "--export-inputs",
        d,
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert_ne!(std::fs::read(&file).unwrap(), before);
}

/// A kernel's format-2 dump made from an export: `dump_header` completed with engine, dtype and
/// `kernel_precision`, `hidden_in` from the export, and the given `attn_latent` / `lse` of the
/// export's heads, written as BF16 into a new folder (compare is given --model).
fn kernel_dump(
    inp: &Inputs,
    layer: usize,
    latent: &TraceTensor,
    lse: &TraceTensor,
    edit: impl Fn(&mut serde_json::Value),
) -> (tempfile::TempDir, PathBuf) {
    use safetensors::Dtype as D;
    let bf16 = |t: &TraceTensor| -> Vec<u8> {
        t.to_f64()
            .iter()
            .flat_map(|&x| half::bf16::from_f64(x).to_le_bytes())
            .collect()
    };
    let h = inp.get("hidden_in");
    let hidden: Vec<u8> = h.data.iter().flat_map(|&x| (x as f32).to_le_bytes()).collect();
    let tensors = [
        (format!("s0.L{layer}.hidden_in"), D::F32, h.shape.clone(), hidden),
        (
            format!("s0.L{layer}.attn_latent"),
            D::BF16,
            latent.shape.clone(),
            bf16(latent),
        ),
        (format!("s0.L{layer}.lse"), D::BF16, lse.shape.clone(), bf16(lse)),
    ];
    let mut header: serde_json::Value = serde_json::from_str(&inp.meta["dump_header"]).unwrap();
    header["engine"] = serde_json::json!({"name": "test-kernel", "version": "1", "attention_backend": "CPU_DECODE"});
    header["hook"] = serde_json::json!({"name": "tests/kernel_inputs.rs", "version": "1"});
    header["dtype"] = "bf16".into();
    header["kernel_precision"] = "bf16".into();
    edit(&mut header);
    let meta: std::collections::HashMap<String, String> = [
        ("format".to_string(), "mla-diff dump 2".to_string()),
        ("header".to_string(), header.to_string()),
    ]
    .into_iter()
    .collect();
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("kernel.safetensors");
    write_safetensors(&p, &tensors, Some(meta));
    (dir, p)
}

/// `compare` on a kernel's dump of heads `a..b`: the reference's own values rounded to bf16 pass
/// under `kernel_precision: bf16` (the rows `run --dtype bf16` applies), fail under
/// `--precision f32`; an undeclared base-2 LSE is `lse-merge` at `lse`; heads shifted by one fail
/// at `attn_latent`; a `heads` range outside the model is an input error naming the field.
#[test]
fn compare_judges_a_kernel_dump_of_some_heads() {
    let model = "tiny-v3-q4_k_m.gguf";
    let model_path = repo().join("golden/models").join(model);
    let layer = 1;
    let dir = tempfile::tempdir().unwrap();
    let inp = export(
        &[
            "--model",
            model_path.to_str().unwrap(),
            "--layer",
            "1",
            "--seqs",
            "5,14",
            "--page-size",
            "4",
            "--tp",
            "3",
            "--rank",
            "1",
            "--path",
            "mha",
        ],
        dir.path(),
    );
    let (_file, cfg, _batch, tr) = reference(Some(model), layer, &inp);
    let n = cfg.n_head;
    let (a, b) = (n / 3, 2 * n / 3);
    assert_eq!(inp.meta["heads"], format!("{a},{b}"));
    let latent = heads_of(&tr, layer, Stage::AttnLatent, n, (a, b));
    let lse = heads_of(&tr, layer, Stage::Lse, n, (a, b));

    // Clean: passes under the bf16 rows, and says so.
    let (_d, p) = kernel_dump(&inp, layer, &latent, &lse, |_| {});
    let (code, out, err, doc) = compare_json(&model_path, &p, &[]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert_eq!(doc["dump"]["tolerance_rows"], "bf16");
    assert_eq!(doc["dump"]["metadata"]["heads"], format!("{a},{b}"));
    assert_eq!(doc["dump"]["metadata"]["kernel_precision"], "bf16");
    assert!(out.contains("tolerance rows bf16 (kernel precision)"), "{out}");
    let sites: Vec<&str> = doc["sites"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            assert_eq!(s["status"], "pass", "{s}");
            s["site"].as_str().unwrap()
        })
        .collect();
    assert_eq!(sites, ["L1.hidden_in", "L1.attn_latent", "L1.lse"]);
    let lat_site = doc["sites"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["site"] == "L1.attn_latent")
        .unwrap();
    assert_eq!(lat_site["shape_ref"], serde_json::json!([19, b - a, cfg.kv_lora_rank]));
    // bf16-rounded values are not f32 values: --precision f32 (over the header) fails them.
    let (code, out, err, doc) = compare_json(&model_path, &p, &["--precision", "f32"]);
    assert_eq!(code, 1, "{out}\n{err}");
    assert_eq!(doc["dump"]["tolerance_rows"], "f32");
    let (code, _, err, _) = compare_json(&model_path, &p, &["--precision", "fp8"]);
    assert_eq!(code, 2, "{err}");
    // Without kernel_precision the dump's dtype picks the engine-bf16 rows.
    let (_d2, p2) = kernel_dump(&inp, layer, &latent, &lse, |h| {
        h.as_object_mut().unwrap().remove("kernel_precision");
    });
    let (code, out, err, doc) = compare_json(&model_path, &p2, &[]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert_eq!(doc["dump"]["tolerance_rows"], "engine-bf16");
    assert!(!out.contains("(kernel precision)"), "{out}");
    let (code, _, _, doc) = compare_json(&model_path, &p2, &["--precision", "bf16"]);
    assert_eq!((code, doc["dump"]["tolerance_rows"].as_str()), (0, Some("bf16")));

    // A base-2 LSE the header does not declare.
    let lse2 = TraceTensor::f64(
        lse.shape.clone(),
        lse.to_f64().iter().map(|x| x / std::f64::consts::LN_2).collect(),
    );
    let (_d3, p3) = kernel_dump(&inp, layer, &latent, &lse2, |_| {});
    let (code, out, err, doc) = compare_json(&model_path, &p3, &[]);
    assert_eq!(code, 1, "{out}\n{err}");
    assert_eq!(doc["findings"][0]["class"], "lse-merge", "{}", doc["findings"]);
    assert_eq!(doc["findings"][0]["site"], "L1.lse");
    // Declared, it is converted and passes.
    let (_d4, p4) = kernel_dump(&inp, layer, &latent, &lse2, |h| {
        h["conventions"]["lse_base"] = "2".into();
    });
    let (code, out, err, _) = compare_json(&model_path, &p4, &[]);
    assert_eq!(code, 0, "{out}\n{err}");

    // The header says heads a..b, the tensors hold a+1..b+1.
    let (_d5, p5) = kernel_dump(
        &inp,
        layer,
        &heads_of(&tr, layer, Stage::AttnLatent, n, (a + 1, b + 1)),
        &heads_of(&tr, layer, Stage::Lse, n, (a + 1, b + 1)),
        |_| {},
    );
    let (code, out, err, doc) = compare_json(&model_path, &p5, &[]);
    assert_eq!(code, 1, "{out}\n{err}");
    assert_eq!(doc["findings"][0]["site"], "L1.attn_latent", "{}", doc["findings"]);
    // No detector knows a head offset: rows with one visible key (each sequence's first token)
    // match whatever the head, every other row is wrong.
    assert_eq!(doc["findings"][0]["class"], "mismatch", "{}", doc["findings"]);

    // Bad ranges and precisions: exit 2 naming the file and the field.
    for (edit, field) in [
        (serde_json::json!([a, n + 1]), "header.heads"),
        (serde_json::json!([b, a]), "header.heads"),
        (serde_json::json!([a]), "header.heads"),
    ] {
        let (_d6, p6) = kernel_dump(&inp, layer, &latent, &lse, |h| h["heads"] = edit.clone());
        let (code, out, err, _) = compare_json(&model_path, &p6, &[]);
        assert_eq!(code, 2, "{edit}: {out}\n{err}");
        assert!(err.contains("kernel.safetensors") && err.contains(field), "{err}");
    }
    let (_d7, p7) = kernel_dump(&inp, layer, &latent, &lse, |h| h["kernel_precision"] = "fp8".into());
    let (code, _, err, _) = compare_json(&model_path, &p7, &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("header.kernel_precision"), "{err}");
}

/// The production kernels' dumps made on an H200 by `scripts/gpu-host/kernels_gpu.sh` (case `ci-fa3`:
/// fa3-v3-bf16 layer 0, sequences 1, 63, 64, 65 at page 64, bf16): (file, engine, LSE base).
const KERNEL_DUMPS: &[(&str, &str, &str)] = &[
    ("fa3-v3-bf16.kernel-flashmla.safetensors", "flashmla vllm 0.26.0", "e"),
    (
        "fa3-v3-bf16.kernel-triton-mla.safetensors",
        "triton-mla vllm 0.26.0",
        "e",
    ),
    (
        "fa3-v3-bf16.kernel-flashinfer.safetensors",
        "flashinfer flashinfer-python 0.6.14",
        "2",
    ),
    ("fa3-v3-bf16.kernel-fa3.safetensors", "fa3 vllm 0.26.0", "e"),
];

/// The dump at `src` with its format-2 header's `conventions.lse_base` replaced, written to `dst`.
fn with_lse_base(src: &Path, dst: &Path, base: &str) {
    let bytes = std::fs::read(src).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut head: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let h = head["__metadata__"]["header"].as_str().unwrap().to_string();
    let mut h: serde_json::Value = serde_json::from_str(&h).unwrap();
    h["conventions"]["lse_base"] = serde_json::Value::String(base.into());
    head["__metadata__"]["header"] = serde_json::Value::String(h.to_string());
    let mut text = serde_json::to_vec(&head).unwrap();
    while !text.len().is_multiple_of(8) {
        text.push(b' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&text);
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(dst, out).unwrap();
}

#[test]
fn every_committed_kernel_dump_passes_with_the_kernel_precision_rows() {
    let dir = repo().join("golden/dumps");
    let model = repo().join("golden/models/fa3-v3-bf16.gguf");
    let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".kernel-"))
        .collect();
    on_disk.sort();
    let mut listed: Vec<String> = KERNEL_DUMPS.iter().map(|c| c.0.to_string()).collect();
    listed.sort();
    assert_eq!(on_disk, listed, "every committed kernel dump is a case here");
    for &(dump, engine, base) in KERNEL_DUMPS {
        let (code, out, err, doc) = compare_json(&model, &dir.join(dump), &[]);
        assert_eq!(code, 0, "{dump}: {out}\n{err}");
        assert_eq!(doc["dump"]["engine"], engine, "{dump}");
        // bf16 inputs, f32 accumulation: run --dtype bf16's rows, not the engine rows.
        assert_eq!(doc["dump"]["tolerance_rows"], "bf16", "{dump}");
        assert_eq!(doc["dump"]["metadata"]["kernel_precision"], "bf16", "{dump}");
        let converted = doc["dump"]["conversions"].to_string().contains("base-2 LSE");
        assert_eq!(converted, base == "2", "{dump}: {}", doc["dump"]["conversions"]);
        let sites = doc["sites"].as_array().unwrap();
        // FA3 is the prefill kernel: its output is attn_out [T, N, V].
        let out_site = if dump.contains("kernel-fa3") {
            "L0.attn_out"
        } else {
            "L0.attn_latent"
        };
        assert_eq!(sites.len(), 3, "{dump}");
        for site in ["L0.hidden_in", out_site, "L0.lse"] {
            let s = sites
                .iter()
                .find(|s| s["site"] == site)
                .unwrap_or_else(|| panic!("{dump}: {site}"));
            assert_eq!(s["status"], "pass", "{dump}: {site}");
            assert_eq!(
                s["shape"],
                serde_json::json!(if site == "L0.hidden_in" {
                    vec![193, 64]
                } else if site == "L0.lse" {
                    vec![193, 4]
                } else if site == "L0.attn_out" {
                    vec![193, 4, 128]
                } else {
                    vec![193, 4, 512]
                }),
                "{dump}: {site}"
            );
        }
    }
}

#[test]
fn flashinfers_base_2_lse_left_undeclared_is_named_lse_merge() {
    let tmp = tempfile::tempdir().unwrap();
    let src = repo().join("golden/dumps/fa3-v3-bf16.kernel-flashinfer.safetensors");
    let dst = tmp.path().join("undeclared.safetensors");
    with_lse_base(&src, &dst, "e");
    let (code, out, err, doc) = compare_json(&repo().join("golden/models/fa3-v3-bf16.gguf"), &dst, &[]);
    assert_eq!(code, 1, "{out}\n{err}");
    let f = &doc["findings"][0];
    assert_eq!(
        (f["class"].as_str(), f["site"].as_str()),
        (Some("lse-merge"), Some("L0.lse")),
        "{f}"
    );
}

/// A decode kernel's latent output and LSE per the `--plant lse-base2` of
/// `mla_diff_hooks.kernels`, from the reference's own sites in f64: each token's context split
/// at `c = ⌊n/2 / page⌋·page` keys, each half's state with its LSE in base 2, the halves merged
/// by the natural-log rule (a token with c = 0 keeps its one state and its base-2 LSE).
fn base2_split_merge(
    cfg: &MlaConfig,
    batch: &Batch,
    tr: &Trace,
    layer: usize,
    page: usize,
) -> (TraceTensor, TraceTensor) {
    // The kernel's inputs are bf16 (its accumulation wider).
    let site = |st| -> Vec<f64> {
        tr.get(&Site::new(layer, st))
            .unwrap()
            .to_f64()
            .iter()
            .map(|&x| half::bf16::from_f64(x).to_f64())
            .collect()
    };
    let (ql, qpe, kvc, kpe) = (
        site(Stage::QlNope),
        site(Stage::QPeRoped),
        site(Stage::KvCNormed),
        site(Stage::KPeRoped),
    );
    let [n, l, _, r, _] = cfg.dims().nlprv();
    let t = batch.n_tokens();
    let ln2 = std::f64::consts::LN_2;
    let (mut latent, mut lse) = (vec![0f64; t * n * l], vec![0f64; t * n]);
    let lse_of = |s: &[f64]| {
        let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        m + s.iter().map(|x| (x - m).exp()).sum::<f64>().ln()
    };
    for (sq, off) in batch.seqs.iter().zip(batch.offsets()) {
        for i in 0..sq.len {
            let (row, nk) = (off + i, i + 1);
            let c = (nk / 2) / page * page;
            for h in 0..n {
                let s: Vec<f64> = (0..nk)
                    .map(|j| {
                        let k = off + j;
                        let a: f64 = (0..l).map(|d| ql[(row * n + h) * l + d] * kvc[k * l + d]).sum();
                        let b: f64 = (0..r).map(|d| qpe[(row * n + h) * r + d] * kpe[k * r + d]).sum();
                        (a + b) * cfg.softmax_scale
                    })
                    .collect();
                let cuts: &[usize] = if c == 0 { &[0, nk] } else { &[0, c, nk] };
                let halves: Vec<std::ops::Range<usize>> = cuts.windows(2).map(|w| w[0]..w[1]).collect();
                let part_lse: Vec<f64> = halves.iter().map(|h| lse_of(&s[h.clone()])).collect();
                let merged = if c == 0 {
                    part_lse[0] / ln2
                } else {
                    let (a, b) = (part_lse[0] / ln2, part_lse[1] / ln2);
                    let m = a.max(b);
                    m + ((a - m).exp() + (b - m).exp()).ln()
                };
                lse[row * n + h] = merged;
                let o = &mut latent[(row * n + h) * l..(row * n + h + 1) * l];
                for (range, pl) in halves.iter().zip(&part_lse) {
                    let w = if c == 0 { 1.0 } else { (pl / ln2 - merged).exp() };
                    for j in range.clone() {
                        let p = (s[j] - pl).exp() * w;
                        for (od, &v) in o.iter_mut().zip(&kvc[(off + j) * l..(off + j + 1) * l]) {
                            *od += p * v;
                        }
                    }
                }
            }
        }
    }
    (
        TraceTensor::f64(vec![t, n, l], latent),
        TraceTensor::f64(vec![t, n], lse),
    )
}

/// FlashInfer's base-2 LSEs fed to vLLM's natural-log `merge_attn_states` (the kernel runner's
/// `--plant lse-base2`, made here from the reference): `compare` names `lse-merge` at the first
/// site it spoils, `attn_latent`, on a YaRN model (where a wrong softmax scale is the other
/// suspect) and on the live-vLLM fixture; the unsplit tokens alone would be the plain ×1/ln 2.
#[test]
fn base_2_partials_merged_as_natural_log_are_named_lse_merge() {
    for (model, layer) in [("yarn-v3-f32.gguf", 1usize), ("fa3-v3-bf16.gguf", 0)] {
        let model_path = repo().join("golden/models").join(model);
        let dir = tempfile::tempdir().unwrap();
        let inp = export(
            &[
                "--model",
                model_path.to_str().unwrap(),
                "--layer",
                &layer.to_string(),
                "--seqs",
                "1,63,64,65,200",
                "--page-size",
                "64",
                "--path",
                "mqa",
            ],
            dir.path(),
        );
        let (_file, cfg, batch, tr) = reference(Some(model), layer, &inp);
        let (latent, lse) = base2_split_merge(&cfg, &batch, &tr, layer, 64);
        let (_d, p) = kernel_dump(&inp, layer, &latent, &lse, |_| {});
        let (code, out, err, doc) = compare_json(&model_path, &p, &[]);
        assert_eq!(code, 1, "{model}: {out}\n{err}");
        let f = &doc["findings"][0];
        let site = format!("L{layer}.attn_latent");
        assert_eq!(
            (f["class"].as_str(), f["site"].as_str()),
            (Some("lse-merge"), Some(site.as_str())),
            "{model}: {f}"
        );
        assert!(
            f["evidence"]
                .as_str()
                .unwrap()
                .contains("base-2 LSE, merged as natural log"),
            "{f}"
        );
    }
}

/// `--export-inputs DIR` creates DIR (and its missing parents) as docs/engines.md's example expects,
/// and refuses, before the run, a DIR below a file.
#[test]
fn the_export_folder_is_created_and_a_file_in_its_path_is_refused() {
    let export = |dir: &Path| {
        run_bin(&[
            "run",
            "--quiet",
            "--path",
            "mha",
            "--export-inputs",
            dir.to_str().unwrap(),
        ])
    };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("k/in");
    let (code, out, err) = export(&dir);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(dir.join("inputs.safetensors").is_file());
    let file = tmp.path().join("plain");
    std::fs::write(&file, b"x").unwrap();
    let (code, out, err) = export(&file.join("in"));
    assert_eq!(code, 2, "{out}\n{err}");
    assert!(
        err.contains("is not a folder") && !out.contains("within tolerance"),
        "{out}\n{err}"
    );
}
