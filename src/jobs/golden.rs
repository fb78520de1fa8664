//! Golden traces: record a passing run once, and check later runs against it bit-for-bit-tight.
//!
//! The reference diff catches bugs that make a path disagree with the maths. It cannot catch a
//! change that moves the reference and the paths together (a regression in the GGUF reader, the
//! config derivation or the reference itself), nor a change small enough to stay inside the
//! reference tolerances. A golden case pins everything: the GGUF by sha256, the derived
//! `MlaConfig`, the run's inputs, and every site of every path. Because
//! every reduction runs in a fixed order (docs/design.md, "Metrics"), a rerun on the same backend reproduces the
//! same bits, so [`GOLDEN_TOLERANCE`] can be tight enough that a 1% change of one element fails.
//!
//! Layout of a case, `golden/<case>/`:
//! - `manifest.json`: [`Manifest`] (schema [`GOLDEN_SCHEMA_VERSION`]);
//! - `trace.safetensors`: the activation sites as f32 tensors, identical tensors stored once
//!   (the manifest maps each `(trace, site)` to its tensor). Weight sites (`w.*`) are stored as
//!   sha256 digests of their f32 bytes only: they are large, and the pinned GGUF plus the
//!   bit-exact dequantization determine them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::backend::Backend;
use crate::backend::cpu::CpuOps;
use crate::core::batch::MAX_POSITION;
use crate::core::error::{Error, Result};
use crate::core::fsio::write_file_atomic;
use crate::core::trace::{Site, TensorData, Trace, TraceTensor};
use crate::jobs::run::{self, LayerTraces};
use crate::judge::metrics::{self, SiteDiff, Status};
use crate::judge::report::{RunConfig, RunRecord, RunReport};
use crate::judge::tolerance::{GOLDEN_TOLERANCE, TOLERANCES, Tolerance};
use crate::model::config::MlaConfig;
use crate::model::dump::{MAX_NUM_KV_SPLITS, MAX_PAGE_SIZE};
use crate::model::gguf::{GgufFile, sha256_hex};

/// Version of `manifest.json`. Bump on any incompatible change.
pub const GOLDEN_SCHEMA_VERSION: u32 = 1;
/// File name of a case's manifest.
pub const MANIFEST_FILE: &str = "manifest.json";
/// File name of a case's tensors.
pub const TRACE_FILE: &str = "trace.safetensors";
/// What the manifest stores as the GGUF path of the embedded default fixture.
pub const EMBEDDED_PATH: &str = "<embedded>";
/// Folder names under `golden/` that hold other things than cases.
const RESERVED: &[&str] = &["models", "hf", "dequant"];

/// The GGUF a case was recorded on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GgufRef {
    /// Path relative to the repository root (`/`-separated), or [`EMBEDDED_PATH`].
    pub path: String,
    /// SHA-256 of the whole file, lowercase hex.
    pub sha256: String,
    /// File size in bytes.
    pub bytes: u64,
}

/// The backend a case was recorded on; `check` reruns on the same kind.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackendRef {
    /// `cpu` or `cuda`.
    pub kind: String,
    /// CUDA kernels (`fast`/`simple`); absent for the CPU.
    pub kernels: Option<crate::backend::cuda::ops::Kernels>,
    /// The backend's description at record time (informational).
    pub recorded_on: String,
}

/// One recorded site.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GoldenSite {
    /// The path name (`mha`, `mqa`, `chunked`, `mixed`).
    pub trace: String,
    /// The site, e.g. `L1.kv_c_normed`.
    pub site: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Tensor name in `trace.safetensors` (activation sites).
    pub tensor: Option<String>,
    /// SHA-256 of the f32 little-endian bytes (weight sites).
    pub sha256: Option<String>,
}

/// One row of the tolerance table, as recorded.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToleranceRow {
    /// Stage group (`Weights`, `Lse`, `Activations`).
    pub group: String,
    /// The rows' precision (`f32`, `bf16`, `engine-bf16`, `engine-f16`).
    pub dtype: crate::judge::tolerance::Precision,
    /// The limits.
    pub tolerance: Tolerance,
    /// Where the numbers come from.
    pub why: String,
}

/// The tolerances in force when the case was recorded.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToleranceRecord {
    /// Golden vs recomputation ([`GOLDEN_TOLERANCE`]).
    pub golden: Tolerance,
    /// Its provenance.
    pub golden_why: String,
    /// The reference table (paths vs reference), for the normal diff that `check` also runs.
    pub reference_table: Vec<ToleranceRow>,
}

/// `golden/<case>/manifest.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`GOLDEN_SCHEMA_VERSION`].
    pub schema: u32,
    /// Case name (the folder name).
    pub case: String,
    /// `mla-diff` version that recorded it.
    pub tool_version: String,
    /// The GGUF.
    pub gguf: GgufRef,
    /// `MlaConfig` derived from the GGUF (as JSON; `check` re-derives and compares).
    pub config: serde_json::Value,
    /// Layers, batch, seed, input mode, paths, path options and dtype (the dtype builds the
    /// backend `check` runs on, which then judges with its own).
    pub run: RunRecord,
    /// Token ids (token input mode).
    pub token_ids: Option<Vec<u32>>,
    /// Backend.
    pub backend: BackendRef,
    /// Tolerances.
    pub tolerance: ToleranceRecord,
    /// Every site of every trace, in record order.
    pub sites: Vec<GoldenSite>,
}

/// Case names: ASCII letters, digits, `.`, `_`, `-`; not a reserved folder of `golden/`.
///
/// Errors: [`Error::Usage`] naming the rule broken.
pub fn validate_case_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && !name.starts_with('.')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c));
    if !ok {
        return Err(Error::Usage(format!(
            "--case `{name}`: use ASCII letters, digits, `.`, `_` and `-` (not starting with `.`)"
        )));
    }
    if RESERVED.contains(&name) {
        return Err(Error::Usage(format!(
            "--case `{name}`: golden/{name} holds other files; pick another name"
        )));
    }
    Ok(())
}

/// The repository root a golden folder belongs to: its parent.
fn repo_root(golden_dir: &Path) -> Result<PathBuf> {
    let resolved = golden_dir
        .canonicalize()
        .map_err(|e| Error::io(golden_dir, "resolve golden folder", e))?;
    Ok(resolved.parent().map(Path::to_path_buf).unwrap_or(resolved))
}

/// `model` relative to the repository root, `/`-separated.
fn relative_model_path(golden_dir: &Path, model: &Path) -> Result<String> {
    let root = repo_root(golden_dir)?;
    let m = model.canonicalize().map_err(|e| Error::io(model, "resolve model", e))?;
    let rel = m.strip_prefix(&root).map_err(|_| {
        Error::Usage(format!(
            "{}: a golden case must use a GGUF inside the repository ({}) so that a clone anywhere can check it; copy it under golden/models/",
            model.display(),
            root.display()
        ))
    })?;
    Ok(rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join("/"))
}

fn f32_bytes(t: &TraceTensor) -> Vec<u8> {
    match &t.data {
        TensorData::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        TensorData::F64(v) => v.iter().flat_map(|x| (*x as f32).to_le_bytes()).collect(),
    }
}

/// The traces a case records: every path's. The reference is not recorded: a change in it
/// either moves a path out of tolerance (the run's own diff fails) or is caught by the HF golden
/// tests (`tests/hf_golden.rs`, agreement ≤ 5e-15), and leaving it out halves the bytes.
fn traces_of(lt: &LayerTraces) -> Vec<(String, &Trace)> {
    lt.paths.iter().map(|(k, t)| (k.name().to_string(), t)).collect()
}

/// What `record` wrote.
#[derive(Debug, Clone)]
pub struct RecordSummary {
    /// The case folder.
    pub dir: PathBuf,
    /// Sites recorded (all traces).
    pub sites: usize,
    /// Distinct tensors stored.
    pub tensors: usize,
    /// Bytes of `trace.safetensors`.
    pub trace_bytes: usize,
}

/// What to record.
pub struct RecordRequest<'a> {
    /// Case name.
    pub case: &'a str,
    /// The `golden/` folder (its parent is the repository root).
    pub golden_dir: &'a Path,
    /// The model's path, `None` for the embedded fixture.
    pub model: Option<&'a Path>,
    /// The opened model.
    pub file: &'a GgufFile,
    /// Its configuration.
    pub cfg: &'a MlaConfig,
    /// What to run (its `backend` field is replaced by the backend's kind).
    pub rc: &'a RunConfig,
    /// The backend.
    pub backend: &'a Backend,
    /// Replace an existing case.
    pub force: bool,
}

/// Runs `req.rc` and, when every path passes against the reference, writes the case.
///
/// Returns the run report and `Some(summary)` when written; `None` when the run diverged (a
/// golden must be a passing run; nothing is written).
///
/// Errors: [`Error::Usage`] for a bad case name, an existing case without `force`, a model
/// outside the repository; run errors; [`Error::Io`] writing the files.
pub fn record(req: &RecordRequest<'_>) -> Result<(RunReport, Option<RecordSummary>)> {
    validate_case_name(req.case)?;
    let dir = req.golden_dir.join(req.case);
    let manifest_path = dir.join(MANIFEST_FILE);
    let trace_path = dir.join(TRACE_FILE);
    if (manifest_path.exists() || trace_path.exists()) && !req.force {
        return Err(Error::Usage(format!(
            "golden case `{}` exists ({}); pass --force to replace it",
            req.case,
            dir.display()
        )));
    }
    if !req.file.is_gguf() {
        return Err(Error::Usage(format!(
            "{}: a golden case pins a GGUF file (its manifest records the file's path and sha256); a {} is \
             not one: convert it to GGUF, or check it with `run`",
            req.model
                .map_or_else(|| "the model".to_string(), |m| m.display().to_string()),
            req.file.kind()
        )));
    }
    let gguf_path = match req.model {
        Some(m) => relative_model_path(req.golden_dir, m)?,
        None => EMBEDDED_PATH.to_string(),
    };
    let rc = RunConfig {
        backend: req.backend.name().to_string(),
        ..req.rc.clone()
    };
    let (rep, layers) = run::run_with_traces(req.backend, req.file, req.cfg, &rc)?;
    if !rep.all_pass() {
        return Ok((rep, None));
    }

    let mut sites = Vec::new();
    let mut by_digest: BTreeMap<String, String> = BTreeMap::new();
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for lt in &layers {
        for (name, trace) in traces_of(lt) {
            for site in trace.sites_in_order() {
                let t = trace.get(&site).expect("listed site");
                let bytes = f32_bytes(t);
                let digest = sha256_hex(&bytes);
                let mut gs = GoldenSite {
                    trace: name.clone(),
                    site: site.to_string(),
                    shape: t.shape.clone(),
                    tensor: None,
                    sha256: None,
                };
                if site.stage.is_weight() {
                    gs.sha256 = Some(digest);
                } else {
                    let tname = by_digest
                        .entry(digest)
                        .or_insert_with(|| {
                            let n = format!("{name}.{site}");
                            tensors.push((n.clone(), t.shape.clone(), bytes));
                            n
                        })
                        .clone();
                    gs.tensor = Some(tname);
                }
                sites.push(gs);
            }
        }
    }
    let manifest = Manifest {
        schema: GOLDEN_SCHEMA_VERSION,
        case: req.case.to_string(),
        tool_version: env!("CARGO_PKG_VERSION").to_string(),
        gguf: GgufRef {
            path: gguf_path,
            sha256: req.file.sha256_hex(),
            bytes: req.file.file_len(),
        },
        config: serde_json::to_value(req.cfg).map_err(|e| json_err(&manifest_path, e))?,
        run: RunRecord::new(&rc, req.backend.dtype()),
        token_ids: rep.token_ids.clone(),
        backend: BackendRef {
            kind: req.backend.name().to_string(),
            kernels: match req.backend {
                Backend::Cuda(o) => Some(o.kernels()),
                Backend::Cpu(_) => None,
            },
            recorded_on: req.backend.describe(),
        },
        tolerance: tolerance_record(),
        sites,
    };
    let st_bytes = safetensors_bytes(&tensors, req.case)?;
    std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, "create folder", e))?;
    write_file_atomic(&trace_path, &st_bytes, true)?;
    write_file_atomic(&manifest_path, &crate::output::report::to_json_bytes(&manifest), true)?;
    Ok((
        rep,
        Some(RecordSummary {
            dir,
            sites: manifest.sites.len(),
            tensors: tensors.len(),
            trace_bytes: st_bytes.len(),
        }),
    ))
}

fn json_err(path: &Path, e: serde_json::Error) -> Error {
    Error::Json {
        path: path.to_path_buf(),
        reason: e.to_string(),
    }
}

fn tolerance_record() -> ToleranceRecord {
    ToleranceRecord {
        golden: GOLDEN_TOLERANCE.0,
        golden_why: GOLDEN_TOLERANCE.1.to_string(),
        reference_table: TOLERANCES
            .iter()
            .map(|(group, precision, limits, why)| ToleranceRow {
                group: format!("{group:?}"),
                dtype: *precision,
                tolerance: *limits,
                why: why.to_string(),
            })
            .collect(),
    }
}

fn safetensors_bytes(tensors: &[(String, Vec<usize>, Vec<u8>)], case: &str) -> Result<Vec<u8>> {
    struct V<'a>(&'a [usize], &'a [u8]);
    impl safetensors::View for V<'_> {
        fn dtype(&self) -> safetensors::Dtype {
            safetensors::Dtype::F32
        }
        fn shape(&self) -> &[usize] {
            self.0
        }
        fn data(&self) -> std::borrow::Cow<'_, [u8]> {
            std::borrow::Cow::Borrowed(self.1)
        }
        fn data_len(&self) -> usize {
            self.1.len()
        }
    }
    let meta: std::collections::HashMap<String, String> = [
        ("format".to_string(), "mla-diff golden trace".to_string()),
        ("case".to_string(), case.to_string()),
        ("schema".to_string(), GOLDEN_SCHEMA_VERSION.to_string()),
    ]
    .into_iter()
    .collect();
    safetensors::serialize(tensors.iter().map(|(n, s, b)| (n.clone(), V(s, b))), Some(meta))
        .map_err(|e| Error::Internal(format!("safetensors serialization: {e}")))
        .and_then(crate::core::st::canonical_header)
}

/// The golden comparison of one path's trace.
#[derive(Debug, Clone)]
pub struct TraceCheck {
    /// The path name.
    pub trace: String,
    /// One entry per site, in record order, judged against [`GOLDEN_TOLERANCE`]. Weight sites
    /// carry no metrics: they pass when the digest matches, else fail with `sha256`.
    pub diffs: Vec<SiteDiff>,
}

/// The result of checking one case.
#[derive(Debug, Clone)]
pub struct CaseCheck {
    /// The case.
    pub case: String,
    /// The recomputed run, with its usual reference diffs and findings.
    pub report: RunReport,
    /// Golden comparisons, per trace.
    pub traces: Vec<TraceCheck>,
    /// Remarks (a different tool version recorded the case, …).
    pub notes: Vec<String>,
}

impl CaseCheck {
    /// The first site that differs from the golden, per trace order then site order.
    pub fn first_golden_failure(&self) -> Option<(&str, &SiteDiff)> {
        self.traces
            .iter()
            .find_map(|t| t.diffs.iter().find(|d| d.is_failure()).map(|d| (t.trace.as_str(), d)))
    }

    /// True when every site matches the golden and the run itself passes.
    pub fn passed(&self) -> bool {
        self.first_golden_failure().is_none() && self.report.all_pass()
    }
}

/// Every case folder under `golden_dir` (holding a `manifest.json`), sorted by name.
///
/// Errors: [`Error::Io`] reading the folder.
pub fn list_cases(golden_dir: &Path) -> Result<Vec<String>> {
    let mut v: Vec<String> = std::fs::read_dir(golden_dir)
        .map_err(|e| Error::io(golden_dir, "read folder", e))?
        .filter_map(|e| e.ok())
        .filter(|e| e.path().join(MANIFEST_FILE).is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    Ok(v)
}

/// Reads and validates `golden/<case>/manifest.json`.
///
/// Errors: [`Error::Io`], [`Error::Json`] naming the field serde rejects, [`Error::Golden`] for
/// another schema version or a case name that disagrees with the folder.
pub fn read_manifest(golden_dir: &Path, case: &str) -> Result<Manifest> {
    let path = golden_dir.join(case).join(MANIFEST_FILE);
    let bytes = crate::core::fsio::read_regular(&path)?;
    let m: Manifest = serde_json::from_slice(&bytes).map_err(|e| json_err(&path, e))?;
    if m.schema != GOLDEN_SCHEMA_VERSION {
        return Err(golden_err(
            case,
            &path,
            format!(
                "manifest schema {} (this tool reads {GOLDEN_SCHEMA_VERSION}); re-record the case",
                m.schema
            ),
        ));
    }
    if m.case != case {
        return Err(golden_err(
            case,
            &path,
            format!("manifest names case `{}`, folder is `{case}`", m.case),
        ));
    }
    Ok(m)
}

/// Checks the manifest's numbers as the command line checks its flags, before any of them
/// sizes or indexes anything: at least one layer, each inside the model; at least one sequence,
/// each of at least one token, positions below [`MAX_POSITION`]; page size, split count, TP
/// size, chunk size and new tokens at least 1, the page size and split count within the bounds
/// of a dump header's, the TP size a divisor of the head count; every recorded tolerance a
/// finite number ≥ 0.
///
/// Errors: [`Error::Golden`] naming the manifest and the field (`run.batch.seqs[1].len`, …).
fn check_numbers(case: &str, path: &Path, cfg: &MlaConfig, m: &Manifest) -> Result<()> {
    let bad = |field: String, reason: String| golden_err(case, path, format!("field `{field}`: {reason}"));
    let r = &m.run;
    if r.layers.is_empty() {
        return Err(bad("run.layers".into(), "no layer".into()));
    }
    if let Some((i, l)) = r.layers.iter().enumerate().find(|&(_, &l)| l >= cfg.n_layer) {
        return Err(bad(
            format!("run.layers[{i}]"),
            format!("layer {l}: the model has {} layers (`block_count`)", cfg.n_layer),
        ));
    }
    if r.batch.seqs.is_empty() {
        return Err(bad("run.batch.seqs".into(), "no sequence".into()));
    }
    for (i, s) in r.batch.seqs.iter().enumerate() {
        if s.len == 0 {
            return Err(bad(
                format!("run.batch.seqs[{i}].len"),
                "0: a sequence needs at least one token".into(),
            ));
        }
        if s.start_pos.checked_add(s.len).is_none_or(|p| p > MAX_POSITION) {
            return Err(bad(
                format!("run.batch.seqs[{i}]"),
                format!(
                    "start_pos {} + len {}: positions must stay below {MAX_POSITION} (2^31)",
                    s.start_pos, s.len
                ),
            ));
        }
    }
    let o = &r.path_options;
    let splits = usize::try_from(MAX_NUM_KV_SPLITS).unwrap_or(usize::MAX);
    for (field, v, max) in [
        ("page_size", o.page_size, Some(MAX_PAGE_SIZE)),
        ("num_splits", o.num_splits, Some(splits)),
        ("tp", o.tp, None),
        ("chunk_size", o.chunk_size, None),
        ("new_tokens", o.new_tokens, None),
    ] {
        if v == 0 || max.is_some_and(|m| v > m) {
            return Err(bad(
                format!("run.path_options.{field}"),
                match max {
                    Some(m) => format!("{v}: expected an integer from 1 to {m}"),
                    None => format!("{v}: expected at least 1"),
                },
            ));
        }
    }
    if !cfg.n_head.is_multiple_of(o.tp) {
        return Err(bad(
            "run.path_options.tp".into(),
            format!("{}: does not divide the model's {} attention heads", o.tp, cfg.n_head),
        ));
    }
    let rows = std::iter::once(("tolerance.golden".to_string(), &m.tolerance.golden)).chain(
        m.tolerance
            .reference_table
            .iter()
            .enumerate()
            .map(|(i, row)| (format!("tolerance.reference_table[{i}].tolerance"), &row.tolerance)),
    );
    for (at, t) in rows {
        for (field, v) in [
            ("rel_l2", t.rel_l2),
            ("cos_diff", t.cos_diff),
            ("norm_ratio", t.norm_ratio),
            ("atol_rms", t.atol_rms),
            ("rtol", t.rtol),
            ("min_pass_fraction", t.min_pass_fraction),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(bad(
                    format!("{at}.{field}"),
                    format!("{v}: expected a finite number ≥ 0"),
                ));
            }
        }
    }
    Ok(())
}

/// An [`Error::Golden`] of `case` naming `path`.
fn golden_err(case: &str, path: &Path, reason: String) -> Error {
    Error::Golden {
        case: case.to_string(),
        path: path.to_path_buf(),
        reason,
    }
}

/// The case's GGUF (the embedded fixture, or a file under the repository root), pinned by the
/// manifest's sha256.
///
/// Errors: [`Error::Golden`] when the file is missing or its sha256 changed; GGUF errors.
fn open_pinned_gguf(golden_dir: &Path, case: &str, m: &Manifest) -> Result<GgufFile> {
    let file = if m.gguf.path == EMBEDDED_PATH {
        GgufFile::from_static(
            crate::model::fixture::EMBEDDED_NAME,
            crate::model::fixture::EMBEDDED_GGUF,
        )?
    } else {
        let p = repo_root(golden_dir)?.join(&m.gguf.path);
        if !p.is_file() {
            return Err(golden_err(case, &p, "the case's GGUF is missing".into()));
        }
        GgufFile::open(&p)?
    };
    let sha = file.sha256_hex();
    if sha != m.gguf.sha256 {
        return Err(golden_err(
            case,
            file.path(),
            format!(
                "GGUF changed: sha256 {sha}, the manifest pins {}; re-record the case if the change is intended",
                m.gguf.sha256
            ),
        ));
    }
    Ok(file)
}

/// Refuses a case whose manifest `config` differs from the [`MlaConfig`] derived now, naming
/// every field that differs.
///
/// Errors: [`Error::Golden`] naming the manifest; [`Error::Json`].
fn check_config(case: &str, case_dir: &Path, cfg: &MlaConfig, m: &Manifest) -> Result<()> {
    let cfg_json = serde_json::to_value(cfg).map_err(|e| json_err(case_dir, e))?;
    if cfg_json == m.config {
        return Ok(());
    }
    let fields: Vec<String> = match (cfg_json.as_object(), m.config.as_object()) {
        (Some(a), Some(b)) => a
            .keys()
            .chain(b.keys())
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .filter(|k| a.get(*k) != b.get(*k))
            .map(|k| {
                format!(
                    "{k}: now {}, recorded {}",
                    a.get(k).unwrap_or(&serde_json::Value::Null),
                    b.get(k).unwrap_or(&serde_json::Value::Null)
                )
            })
            .collect(),
        _ => vec!["field `config` is not an object".into()],
    };
    Err(golden_err(
        case,
        &case_dir.join(MANIFEST_FILE),
        format!(
            "MlaConfig derived from the GGUF differs from the manifest's `config`: {}",
            fields.join("; ")
        ),
    ))
}

/// The backend the case was recorded on, in its dtype (CUDA through `cuda`, with the recorded
/// kernels).
///
/// Errors: [`Error::Golden`] for a CUDA case where CUDA is unavailable, or an unknown backend.
fn recorded_backend(case: &str, case_dir: &Path, m: &Manifest, cuda: CudaFactory<'_>) -> Result<Backend> {
    let dtype = m.run.dtype;
    match m.backend.kind.as_str() {
        "cpu" => Ok(Backend::Cpu(CpuOps::new(dtype))),
        "cuda" => cuda(
            dtype,
            m.backend.kernels.unwrap_or(crate::backend::cuda::ops::Kernels::Fast),
        )
        .map_err(|e| {
            golden_err(
                case,
                &case_dir.join(MANIFEST_FILE),
                format!(
                    "recorded on CUDA, which is unavailable here: {}",
                    crate::core::error::chain(&e)
                ),
            )
        }),
        other => Err(golden_err(
            case,
            &case_dir.join(MANIFEST_FILE),
            format!("field `backend.kind`: unknown backend `{other}`"),
        )),
    }
}

/// How `check` obtains the CUDA backend for cases recorded on CUDA.
pub type CudaFactory<'a> = &'a dyn Fn(crate::core::dtype::Dtype, crate::backend::cuda::ops::Kernels) -> Result<Backend>;

/// Recomputes case `case` and compares it with its golden.
///
/// Errors ([`Error::Golden`] unless said otherwise; never a pass): the GGUF is missing or its
/// sha256 differs; the derived `MlaConfig` or the token ids differ from the manifest; a site is
/// in the golden but not recomputed, or recomputed but not in the golden; a tensor is missing
/// from `trace.safetensors` or has another shape; the case needs CUDA and `cuda` cannot provide
/// it; plus the errors of [`read_manifest`] and of the run. [`Error::Usage`] when the run the
/// manifest asks for needs more memory than `max_memory` (else the cgroup/MemTotal limit) allows
/// ([`crate::jobs::limits::golden_need`]), before the trace is read or anything runs.
pub fn check(golden_dir: &Path, case: &str, cuda: CudaFactory<'_>, max_memory: Option<u64>) -> Result<CaseCheck> {
    let m = read_manifest(golden_dir, case)?;
    let case_dir = golden_dir.join(case);
    let err = |path: &Path, reason: String| golden_err(case, path, reason);
    let mut notes = Vec::new();
    if m.tool_version != env!("CARGO_PKG_VERSION") {
        notes.push(format!(
            "recorded by mla-diff {}, checked by {}",
            m.tool_version,
            env!("CARGO_PKG_VERSION")
        ));
    }
    if m.tolerance.golden != GOLDEN_TOLERANCE.0 {
        notes.push("the manifest's golden tolerance differs from this tool's; this tool's is applied".into());
    }
    let file = open_pinned_gguf(golden_dir, case, &m)?;
    let cfg = MlaConfig::from_gguf(&file)?;
    check_config(case, &case_dir, &cfg, &m)?;
    check_numbers(case, &case_dir.join(MANIFEST_FILE), &cfg, &m)?;
    let trace_path = case_dir.join(TRACE_FILE);
    let rc = m.run.config().ok_or_else(|| {
        err(
            &case_dir.join(MANIFEST_FILE),
            "field `run`: records a dump comparison (input or path `dump`), which no run reproduces".into(),
        )
    })?;
    // Before the trace is read or anything runs: the manifest's batch and options size the run.
    let trace_bytes = std::fs::metadata(&trace_path).map_or(0, |md| md.len());
    crate::jobs::limits::check(
        &crate::jobs::limits::golden_need(&file, &cfg, &rc, &case_dir.join(MANIFEST_FILE), trace_bytes),
        max_memory,
    )?;
    let backend = recorded_backend(case, &case_dir, &m, cuda)?;

    // The golden tensors.
    let tf = crate::core::st::read(&trace_path)?;
    let mut golden: BTreeMap<(String, String), &GoldenSite> = BTreeMap::new();
    for s in &m.sites {
        if golden.insert((s.trace.clone(), s.site.clone()), s).is_some() {
            return Err(err(
                &case_dir.join(MANIFEST_FILE),
                format!("site {} of trace {} is listed twice", s.site, s.trace),
            ));
        }
    }

    let (report, layers) = run::run_with_traces(&backend, &file, &cfg, &rc)?;
    if report.token_ids != m.token_ids {
        return Err(err(
            &case_dir.join(MANIFEST_FILE),
            "the recomputed token ids differ from the manifest's `token_ids`".into(),
        ));
    }

    let (tol, _) = GOLDEN_TOLERANCE;
    let mut traces: Vec<TraceCheck> = Vec::new();
    let mut seen = 0usize;
    for lt in &layers {
        for (name, trace) in traces_of(lt) {
            let mut diffs = Vec::new();
            for site in trace.sites_in_order() {
                let new = trace.get(&site).expect("listed site");
                let Some(gs) = golden.get(&(name.clone(), site.to_string())) else {
                    return Err(err(
                        &case_dir.join(MANIFEST_FILE),
                        format!("site {site} of trace {name} is recomputed but not in the golden; re-record the case"),
                    ));
                };
                seen += 1;
                diffs.push(golden_diff(site, gs, new, &tf, &tol).map_err(|r| err(&trace_path, r))?);
            }
            match traces.iter_mut().find(|t| t.trace == name) {
                Some(t) => t.diffs.extend(diffs),
                None => traces.push(TraceCheck { trace: name, diffs }),
            }
        }
    }
    if seen != m.sites.len() {
        let produced: std::collections::BTreeSet<(String, String)> = layers
            .iter()
            .flat_map(|lt| {
                traces_of(lt)
                    .into_iter()
                    .flat_map(|(n, t)| t.sites_in_order().into_iter().map(move |s| (n.clone(), s.to_string())))
                    .collect::<Vec<_>>()
            })
            .collect();
        let missing: Vec<String> = m
            .sites
            .iter()
            .filter(|s| !produced.contains(&(s.trace.clone(), s.site.clone())))
            .map(|s| format!("{} of trace {}", s.site, s.trace))
            .collect();
        return Err(err(
            &case_dir.join(MANIFEST_FILE),
            format!(
                "missing site(s): {} recorded in the golden but not produced by the recomputation",
                missing.join(", ")
            ),
        ));
    }
    Ok(CaseCheck {
        case: case.to_string(),
        report,
        traces,
        notes,
    })
}

/// Compares one recomputed site with its golden entry. `Err` is a reason for [`Error::Golden`].
fn golden_diff(
    site: Site,
    gs: &GoldenSite,
    new: &TraceTensor,
    tf: &crate::core::st::TraceFile,
    tol: &Tolerance,
) -> std::result::Result<SiteDiff, String> {
    let shape_ok = crate::core::trace::shapes_compatible(&gs.shape, &new.shape);
    let mut d = SiteDiff {
        site,
        status: Status::Pass,
        shape_ref: gs.shape.clone(),
        shape_cand: new.shape.clone(),
        metrics: None,
        failed: vec![],
        tolerance: *tol,
        note: None,
    };
    if !shape_ok {
        d.status = Status::ShapeMismatch;
        d.failed = vec!["shape"];
        return Ok(d);
    }
    if let Some(digest) = &gs.sha256 {
        if sha256_hex(&f32_bytes(new)) != *digest {
            d.status = Status::Fail;
            d.failed = vec!["sha256"];
        }
        return Ok(d);
    }
    let name = gs
        .tensor
        .as_ref()
        .ok_or_else(|| format!("site {site} of trace {}: neither `tensor` nor `sha256`", gs.trace))?;
    let stored = tf
        .extra
        .get(name)
        .ok_or_else(|| format!("tensor `{name}` (site {site} of trace {}) is missing", gs.trace))?;
    if stored.shape != gs.shape {
        return Err(format!(
            "tensor `{name}` has shape {:?}, the manifest says {:?}",
            stored.shape, gs.shape
        ));
    }
    let golden = TraceTensor::f32(stored.shape.clone(), stored.data.iter().map(|&x| x as f32).collect());
    let new32 = TraceTensor::f32(
        new.shape.clone(),
        match &new.data {
            TensorData::F32(v) => v.clone(),
            TensorData::F64(v) => v.iter().map(|&x| x as f32).collect(),
        },
    );
    let m = metrics::metrics(&golden, &new32, tol);
    let failed = metrics::judge(&m, tol);
    d.status = if failed.is_empty() { Status::Pass } else { Status::Fail };
    d.failed = failed;
    d.metrics = Some(m);
    Ok(d)
}

/// Human summary of a checked case: one line when it matches; otherwise the first differing
/// site, the table of each trace that differs (every site, or only the differing ones when
/// `quiet`), and the run's own verdict and findings when it no longer passes.
pub fn summary(c: &CaseCheck, quiet: bool) -> String {
    let n_sites: usize = c.traces.iter().map(|t| t.diffs.len()).sum();
    let n_bad: usize = c
        .traces
        .iter()
        .map(|t| t.diffs.iter().filter(|d| d.is_failure()).count())
        .sum();
    let max_abs = c
        .traces
        .iter()
        .flat_map(|t| t.diffs.iter())
        .filter_map(|d| d.metrics.as_ref().map(|m| m.max_abs))
        .fold(0f64, f64::max);
    let paths = c.traces.len();
    let mut s = String::new();
    match c.first_golden_failure() {
        None => s.push_str(&format!(
            "golden {}: match ({paths} path(s), {n_sites} sites; max |Δ| vs golden {})\n",
            c.case,
            if max_abs == 0.0 {
                "0".to_string()
            } else {
                format!("{max_abs:.3e}")
            }
        )),
        Some((trace, d)) => {
            let detail = d
                .metrics
                .as_ref()
                .map(|m| {
                    format!(
                        " (max |Δ| {:.3e} at {:?}: golden {:.6e} → now {:.6e})",
                        m.max_abs, m.max_abs_index, m.max_abs_ref, m.max_abs_cand
                    )
                })
                .unwrap_or_default();
            s.push_str(&format!(
                "golden {}: DIFFERS: first at {trace} {} [{}]{detail}; {n_bad} of {n_sites} sites differ{}\n",
                c.case,
                d.site,
                d.failed.join(","),
                if n_bad > 1 {
                    " (paths share identical tensors in the golden, so one stored change shows in every path that shares it)"
                } else {
                    ""
                }
            ));
            for t in c.traces.iter().filter(|t| t.diffs.iter().any(|d| d.is_failure())) {
                let rows: Vec<SiteDiff> = if quiet {
                    t.diffs.iter().filter(|d| d.is_failure()).cloned().collect()
                } else {
                    t.diffs.clone()
                };
                s.push_str(&format!(
                    "== {} · trace {} vs golden (ref = golden, cand = recomputed) ==\n{}\n",
                    c.case,
                    t.trace,
                    crate::output::report::site_table(&rows)
                ));
            }
        }
    }
    for n in &c.notes {
        s.push_str(&format!("  note: {n}\n"));
    }
    if !c.report.all_pass() {
        for l in crate::output::report::verdict_lines(&c.report) {
            s.push_str(&format!("  run: {l}\n"));
        }
        for l in crate::output::report::finding_lines(&c.report) {
            s.push_str(&format!("  {l}\n"));
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn case_names() {
        assert!(validate_case_name("tiny-v3-q8_0").is_ok());
        assert!(validate_case_name("models").is_err());
        assert!(validate_case_name("../x").is_err());
        assert!(validate_case_name("").is_err());
        assert!(validate_case_name(".hidden").is_err());
    }

    /// The promise of [`GOLDEN_TOLERANCE`]: a ±1% change of any one element at or above
    /// 1.1e-4·rms fails the site; an unchanged tensor passes.
    #[test]
    fn one_percent_of_one_element_fails() {
        let (tol, _) = GOLDEN_TOLERANCE;
        let data = crate::core::batch::normal_f32(7, 4096);
        let rms = (data.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>() / 4096.0).sqrt();
        let g = TraceTensor::f32(vec![64, 64], data.clone());
        assert!(metrics::judge(&metrics::metrics(&g, &g, &tol), &tol).is_empty());
        let mut checked = 0;
        for i in 0..data.len() {
            if f64::from(data[i].abs()) < 1.1e-4 * rms {
                continue;
            }
            for s in [1.01f32, 0.99] {
                let mut e = data.clone();
                e[i] *= s;
                let c = TraceTensor::f32(vec![64, 64], e);
                let failed = metrics::judge(&metrics::metrics(&g, &c, &tol), &tol);
                assert!(failed.contains(&"pass_fraction"), "element {i} ×{s} passed");
            }
            checked += 1;
        }
        assert!(checked > 4000, "{checked}");
    }
}
