//! The argument schema of every command, with the groups several commands share.
//!
//! `--model`, `--json`/`--force` and `--report`/`--quiet` mean the same on every command that
//! takes them, so each is declared once ([`ModelArgs`], [`OutputArgs`], [`ReportArgs`],
//! [`DeviceArgs`]) and flattened into the commands.

use std::path::PathBuf;

use clap::{Args, Subcommand, ValueEnum};

use super::values::{self, DtypeArg, EngineDtypeArg, InputArg, KernelsArg, PrecisionArg, ReferenceArg};
use crate::compute::faults::Fault;
use crate::compute::path::PathKind;
use crate::core::error::Result;
use crate::device::ComputeCapability;
use crate::model::gguf::GgufFile;

/// `--model`: the GGUF file.
#[derive(Debug, Clone, Args)]
pub struct ModelArgs {
    /// GGUF model file or Hugging Face checkpoint folder (`config.json` with sharded
    /// safetensors, bf16 or DeepSeek-V3's block-scaled fp8; default: the embedded tiny-v3 Q4_K_M
    /// fixture). For `compare` and
    /// `weights`, the file the engine loaded: required with a format-1 dump; a format-2 dump
    /// names it, and `compare` and `weights` open it from the dump's folder.
    #[arg(long)]
    pub model: Option<PathBuf>,
}

impl ModelArgs {
    /// The file given, if any.
    pub fn path(&self) -> Option<&PathBuf> {
        self.model.as_ref()
    }

    /// Opens `--model`, or the embedded fixture when absent.
    ///
    /// Errors: as [`crate::model::open`].
    pub fn open(&self) -> Result<GgufFile> {
        crate::model::fixture::open_model(self.model.as_ref())
    }
}

/// `--json` and `--force`: a machine-readable result file.
#[derive(Debug, Clone, Args)]
pub struct OutputArgs {
    /// Write the result as JSON here; `-` writes it to standard output, and the tables then go
    /// to standard error.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Overwrite existing output files.
    #[arg(long)]
    pub force: bool,
}

/// `--json`, `--report`, `--force`, `--quiet` and `--wide`: the outputs of a verdict (`run`,
/// `compare`, `golden record`).
#[derive(Debug, Clone, Args)]
pub struct ReportArgs {
    /// Write the JSON report here (schema: docs/json-schema.md); `-` writes it to standard
    /// output, and the tables then go to standard error (or nowhere with --quiet).
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write a Markdown triage report here (GitHub-flavoured, for a bug ticket), with its error
    /// heat map next to it (`<name>.svg`; the report's own name must differ from it).
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Overwrite existing output files.
    #[arg(long)]
    pub force: bool,
    /// Print only the verdict lines (and no progress bar).
    #[arg(long, short)]
    pub quiet: bool,
    /// Print every table column even on a narrow terminal (tables into a pipe or file, --json
    /// and --report always have every column).
    #[arg(long)]
    pub wide: bool,
}

/// Arguments of `mla-diff compare`.
#[derive(Debug, Args)]
pub struct CompareArgs {
    /// The model.
    #[command(flatten)]
    pub model: ModelArgs,
    /// The engine's dump (docs/dump-format.md).
    #[arg(long)]
    pub dump: PathBuf,
    /// Undo an engine's names and layouts: `hf`, `vllm`, `llama.cpp`, or a map JSON file.
    #[arg(long)]
    pub map: Option<String>,
    /// The dtype the engine computed in, which picks the tolerance rows (f32, or the engine-bf16 /
    /// engine-f16 rows); default: the dump's `dtype` metadata, else f32.
    #[arg(long, value_enum)]
    pub dtype: Option<EngineDtypeArg>,
    /// The dump comes from a kernel that read inputs of this dtype and accumulated in f32: judge
    /// it by the tolerance rows `run --dtype` applies for that dtype (not the engine rows
    /// --dtype picks). Overrides a format-2 header's `kernel_precision` and --dtype's rows.
    #[arg(long, value_enum)]
    pub precision: Option<PrecisionArg>,
    /// Where the f64 reference runs: cpu; cuda, the GPU reference (cuBLAS DGEMM) for the layers
    /// it computes and the CPU one for DSA layers and MoE FFNs, an error if no device answers;
    /// auto, cuda when a device answers.
    #[arg(long, value_enum, default_value_t = BackendChoice::Cpu)]
    pub backend: BackendChoice,
    /// CUDA include folder for NVRTC (holding cuda_bf16.h); default $CUDA_HOME/include, else
    /// /usr/local/cuda/include.
    #[arg(long)]
    pub cuda_include: Option<PathBuf>,
    /// Print resource use on stderr: wall time, peak RSS, which tensors' data was read, the
    /// references run (one per dumped layer over the union of a format-2 dump's steps, or per
    /// step), and the wall time of each stage (open, read, identity, backend, loaded weights,
    /// dequant, input, reference, step rows, judge, diagnose with each detector that ran as a
    /// part of it, report).
    #[arg(long)]
    pub stats: bool,
    /// Memory this command may use (e.g. `24G`, `512M`; K/M/G/T are powers of 1024): a command
    /// whose estimated peak exceeds it is refused before any work. Default: the smallest of the
    /// cgroup memory limits of this process and MemTotal.
    #[arg(long, value_name = "SIZE", value_parser = crate::core::memory::parse_size)]
    pub max_memory: Option<u64>,
    /// Where the result goes.
    #[command(flatten)]
    pub output: ReportArgs,
}

/// Arguments of `mla-diff weights`.
#[derive(Debug, Args)]
pub struct WeightsArgs {
    /// The model.
    #[command(flatten)]
    pub model: ModelArgs,
    /// The engine's weights as loaded: tensors `L<n>.<param>` or `L<n>.<param>.rank<r>`, vLLM
    /// parameter names, PyTorch [out, in] layout.
    #[arg(long)]
    pub check: PathBuf,
    /// Rename the engine's tensor names: a map JSON file (docs/dump-format.md, "Maps") whose
    /// targets are `<param>` (the layer taken from the pattern) or `L<n>.<param>[.rank<r>]`.
    #[arg(long)]
    pub map: Option<String>,
    /// Where the result goes.
    #[command(flatten)]
    pub output: OutputArgs,
    /// Print every table cell on one line even on a narrow terminal (a pipe, a file and --json
    /// always have them so).
    #[arg(long)]
    pub wide: bool,
}

/// `mla-diff golden …`.
// Parsed once per process: the size of the larger variant does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum GoldenCommand {
    /// Run once and write `golden/<CASE>/{manifest.json,trace.safetensors}` (the run must pass).
    Record(GoldenRecordArgs),
    /// Recompute golden cases and compare every site (exit 0 match, 1 differ, 2 cannot check).
    Check(GoldenCheckArgs),
}

/// Arguments of `mla-diff golden record`.
#[derive(Debug, Args)]
pub struct GoldenRecordArgs {
    /// Case name (folder under the golden folder).
    #[arg(long)]
    pub case: String,
    /// What to run (the model must be a GGUF file inside the repository, or the embedded
    /// default: a case pins the file by its path and sha256).
    #[command(flatten)]
    pub spec: RunSpec,
    /// The golden folder; its parent is the repository root (default: ./golden).
    #[arg(long, default_value = "golden")]
    pub golden_dir: PathBuf,
    /// Where the run's result goes, as for `run`; `--force` also replaces an existing case.
    #[command(flatten)]
    pub output: ReportArgs,
    /// Memory this command may use (e.g. `24G`, `512M`; K/M/G/T are powers of 1024): a command
    /// whose estimated peak exceeds it is refused before any work. Default: the smallest of the
    /// cgroup memory limits of this process and MemTotal.
    #[arg(long, value_name = "SIZE", value_parser = crate::core::memory::parse_size)]
    pub max_memory: Option<u64>,
}

/// Arguments of `mla-diff golden check`.
#[derive(Debug, Args)]
pub struct GoldenCheckArgs {
    /// Case(s) to check (repeatable); or --all.
    #[arg(long, conflicts_with = "all")]
    pub case: Vec<String>,
    /// Check every case under the golden folder.
    #[arg(long)]
    pub all: bool,
    /// The golden folder (default: ./golden, else this build's source tree's golden/).
    #[arg(long)]
    pub golden_dir: Option<PathBuf>,
    /// CUDA include folder, for cases recorded on CUDA.
    #[arg(long)]
    pub cuda_include: Option<PathBuf>,
    /// One line per case; for a case that differs, only its differing sites.
    #[arg(long, short)]
    pub quiet: bool,
    /// Memory this command may use (e.g. `24G`, `512M`; K/M/G/T are powers of 1024): a command
    /// whose estimated peak exceeds it is refused before any work. Default: the smallest of the
    /// cgroup memory limits of this process and MemTotal.
    #[arg(long, value_name = "SIZE", value_parser = crate::core::memory::parse_size)]
    pub max_memory: Option<u64>,
}

/// Arguments of `mla-diff bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// CUDA include folder (holding cuda_bf16.h).
    #[arg(long)]
    pub cuda_include: Option<PathBuf>,
    /// CPU, no GPU needed: time the library's dequantization of every quantized tensor of this
    /// GGUF (output GB/s of f32), at 1 thread and at all threads.
    #[arg(long, value_name = "GGUF", conflicts_with = "reference")]
    pub dequant: Option<PathBuf>,
    /// CPU, no GPU needed: time one reference layer forward (f64) and the CPU engine's mha path
    /// on this GGUF, weights loaded and dequantized before the clock starts.
    #[arg(long, value_name = "GGUF")]
    pub reference: Option<PathBuf>,
    /// Layer for --reference.
    #[arg(long, default_value_t = 0, requires = "reference")]
    pub layer: usize,
    /// Tokens T for --reference (one sequence, positions 0..T).
    #[arg(long, default_value_t = 128, requires = "reference")]
    pub tokens: usize,
    /// Timed repetitions per figure for --dequant/--reference (after one warm-up), 1 to
    /// 1000000; the median is reported.
    #[arg(long, default_value_t = 5)]
    pub repeat: usize,
    /// Rayon thread counts for --dequant/--reference, e.g. `1,2`, each 1 to 1024 (default: 1 and
    /// all threads, as RAYON_NUM_THREADS or the core count sets them).
    #[arg(long, value_delimiter = ',')]
    pub threads: Option<Vec<usize>>,
    /// Memory this command may use (e.g. `24G`, `512M`; K/M/G/T are powers of 1024): a command
    /// whose estimated peak exceeds it is refused before any work. Default: the smallest of the
    /// cgroup memory limits of this process and MemTotal.
    #[arg(long, value_name = "SIZE", value_parser = crate::core::memory::parse_size)]
    pub max_memory: Option<u64>,

    /// Where the result goes.
    #[command(flatten)]
    pub output: OutputArgs,
}

/// Arguments of `mla-diff kernels`.
#[derive(Debug, Args)]
pub struct KernelsArgs {
    /// Only compile (the only mode so far; kept explicit for scripts and CI).
    #[arg(long)]
    pub compile_only: bool,
    /// Target architectures, e.g. `sm_90,sm_80`.
    #[arg(long, value_delimiter = ',', default_value = "sm_90,sm_80", value_parser = ComputeCapability::parse)]
    pub arch: Vec<ComputeCapability>,
    /// CUDA include folder (holding cuda_bf16.h).
    #[arg(long)]
    pub cuda_include: Option<PathBuf>,
    /// Also write each compiled CUBIN here (`<module>.<arch>.cubin`, and
    /// `<module>.<configuration>.<arch>.cubin` for each kernel configuration, e.g.
    /// `fast_decode.cu.hm64-w8-p1-qsmem-s2-wgmma.sm_90a.cubin`), e.g. for cuobjdump.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// Arguments of `mla-diff selftest`.
#[derive(Debug, Args)]
pub struct SelftestArgs {
    /// Folder of GGUF fixtures, or one Hugging Face checkpoint folder (default: `golden/models` of
    /// this checkout, else the embedded one).
    #[arg(long)]
    pub models: Option<PathBuf>,
    /// A subset: of the fixtures given, those named tiny-v3-q8_0, yarn-v3-f32, k256-q4_k_m,
    /// dsa-glm-q8_0 or the embedded one (all given fixtures when none of these is among them);
    /// page size 16, TP 1 and the smallest TP > 1.
    #[arg(long)]
    pub quick: bool,
    /// Layer to test in each fixture.
    #[arg(long, default_value_t = 1)]
    pub layer: usize,
    /// Backend and dtype.
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Also run every case on the CPU and compare the findings (class and first site) with the
    /// chosen backend's.
    #[arg(long)]
    pub cross_check: bool,
    /// Seed of the inputs.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Where the result goes.
    #[command(flatten)]
    pub output: OutputArgs,
}

/// `--path` choices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PathChoice {
    /// Expanded MHA prefill (vLLM forward_mha).
    Mha,
    /// Absorbed MQA decode over a paged latent cache (vLLM forward_mqa).
    Mqa,
    /// Chunked-context prefill merged by LSE.
    Chunked,
    /// Mixed batch: decode tokens first, prefill tokens after.
    Mixed,
    /// Every path.
    All,
}

impl PathChoice {
    /// The paths selected.
    pub fn paths(self) -> Vec<PathKind> {
        match self {
            PathChoice::Mha => vec![PathKind::Mha],
            PathChoice::Mqa => vec![PathKind::Mqa],
            PathChoice::Chunked => vec![PathKind::Chunked],
            PathChoice::Mixed => vec![PathKind::Mixed],
            PathChoice::All => PathKind::ALL.to_vec(),
        }
    }
}

/// `--backend` choices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BackendChoice {
    /// The CUDA backend when a device answers, else the CPU (and say which).
    Auto,
    /// The CPU backend.
    Cpu,
    /// The CUDA backend (an error if no device answers).
    Cuda,
}

/// Where the device backend finds things.
#[derive(Debug, Clone, Args)]
pub struct DeviceArgs {
    /// Compute backend.
    #[arg(long, value_enum, default_value_t = BackendChoice::Auto)]
    pub backend: BackendChoice,
    /// Compute dtype of the paths: f32, or bf16 inputs with f32 accumulation.
    #[arg(long, value_enum, default_value_t = DtypeArg::F32)]
    pub dtype: DtypeArg,
    /// CUDA include folder for NVRTC (holding cuda_bf16.h); default $CUDA_HOME/include, else
    /// /usr/local/cuda/include.
    #[arg(long)]
    pub cuda_include: Option<PathBuf>,
    /// CUDA attention kernels: tensor-core ones for bf16 (fast) or the plain FMA ones (simple).
    #[arg(long, value_enum, default_value_t = KernelsArg::Fast)]
    pub kernels: KernelsArg,
    /// Where the f64 reference runs: on the GPU when the backend is CUDA (auto), or on the CPU.
    #[arg(long, value_enum, default_value_t = ReferenceArg::Auto)]
    pub reference_backend: ReferenceArg,
}

/// What to run: the model, layers, batch, backend, paths and path options (shared by `run` and
/// `golden record`).
#[derive(Debug, Clone, Args)]
pub struct RunSpec {
    /// The model.
    #[command(flatten)]
    pub model: ModelArgs,
    /// Layer to check.
    #[arg(long, conflicts_with = "layers")]
    pub layer: Option<usize>,
    /// Layers to check: `A..B` (B excluded), `A..=B`, or `all`.
    // A value starting `-` (`-1..=1`) is a bad range, refused naming --layers, not a flag.
    #[arg(long, allow_hyphen_values = true)]
    pub layers: Option<String>,
    /// Tokens in the batch (one sequence; see --seqs for several).
    #[arg(long, default_value_t = 19)]
    pub tokens: usize,
    /// Sequence lengths of a multi-sequence batch, e.g. `1,15,16,17,53` (overrides --tokens).
    #[arg(long, value_delimiter = ',')]
    pub seqs: Option<Vec<usize>>,
    /// Position of the first token (tests RoPE/YaRN far from position 0).
    #[arg(long, default_value_t = 0)]
    pub start_pos: usize,
    /// Seed of the random inputs, token ids and block-table shuffle.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Layer input: seeded random hidden states, or seeded token ids through the embedding and
    /// the reference forward of the preceding layers.
    #[arg(long, value_enum, default_value_t = InputArg::Random)]
    pub input: InputArg,
    /// Engine path(s) to run.
    #[arg(long, value_enum, default_value_t = PathChoice::All)]
    pub path: PathChoice,
    /// Backend and dtype.
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Tokens per page of the paged latent cache.
    #[arg(long, default_value_t = 16)]
    pub page_size: usize,
    /// KV splits per decode query (mqa, mixed).
    #[arg(long, default_value_t = 4)]
    pub splits: usize,
    /// Simulated tensor-parallel ranks (must divide the head count).
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// With --backend cuda: the GPU of each TP rank, comma-separated CUDA ordinals, one per
    /// rank of --tp and distinct (e.g. 0,1); the o_proj all-reduce then runs through NCCL on
    /// these GPUs. The ranks' kernels run on the backend's GPU either way.
    #[arg(long, value_delimiter = ',')]
    pub devices: Option<Vec<usize>>,
    /// Context tokens per chunk (chunked).
    #[arg(long, default_value_t = 8)]
    pub chunk_size: usize,
    /// New (uncached) tokens per sequence (chunked; default 5); the rest of each sequence is
    /// context. Given, or with --path chunked, some sequence must be longer.
    #[arg(long)]
    pub new_tokens: Option<usize>,
    /// Inject a fault from the catalogue into the paths (repeatable).
    #[arg(long, value_parser = values::fault_parser())]
    pub inject: Vec<Fault>,
    /// fp8 GEMMs, in the paths and the reference alike: every projection reads its input
    /// quantized to fp8 E4M3 with f32 scales (the weights as dequantized). `token-group`: per
    /// token in groups of 128 columns, as vLLM's block-FP8 layers; `tensor`: one dynamic scale
    /// per tensor (not with the chunked path: pick --path mha, mqa or mixed). A decode (absorbed)
    /// token's keys come from the unquantized latent, as in vLLM. Judged by the fp8 rows.
    #[arg(long, value_enum)]
    pub fp8_compute: Option<values::Fp8ComputeArg>,
    /// What the paged latent cache stores: `fp8` rounds every row written to it to E4M3 with the
    /// scale --kv-scale (vLLM's `kv_cache_dtype="fp8"`), which the decode and the chunked
    /// prefill's context read back; the reference rounds what they read the same way. Judged by
    /// the fp8 rows.
    #[arg(long, value_enum, default_value_t = values::KvCacheDtypeArg::Auto)]
    pub kv_cache_dtype: values::KvCacheDtypeArg,
    /// The fp8 latent cache's per-tensor scale, a positive number within f32's normal range (vLLM's `k_scale`,
    /// which vLLM takes from the checkpoint when it carries one, else 1.0); default 1.0. Only
    /// with --kv-cache-dtype fp8.
    #[arg(long)]
    pub kv_scale: Option<f64>,
    /// The decode kernel takes an fp8 query too, as vLLM's FLASHMLA does over an fp8 cache: the
    /// absorbed paths quantize each decode row's `ql_nope ‖ q_pe` to E4M3 with q_scale
    /// (--q-scale, default 1.0 as vLLM's) before the attention, and the reference scores those rows in the
    /// absorbed form with the same query. Only with --kv-cache-dtype fp8.
    #[arg(long)]
    pub fp8_query: bool,
    /// The fp8 decode query's per-tensor scale, a positive number within f32's normal range
    /// (vLLM's `q_scale`: 1.0 unless the checkpoint carries one or the engine computes it);
    /// default 1.0. Only with --fp8-query.
    #[arg(long)]
    pub q_scale: Option<f64>,
}

/// Arguments of `mla-diff run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// What to run.
    #[command(flatten)]
    pub spec: RunSpec,
    /// Where the result goes.
    #[command(flatten)]
    pub output: ReportArgs,
    /// Print resource use on stderr: wall time, peak RSS, which tensors' data was read, and the
    /// wall time of each stage (open, backend, dequant, input, reference, path weights, each
    /// path, compare, download when a GPU run diverged, diagnose with each detector that ran as a
    /// part of it, export, report).
    #[arg(long)]
    pub stats: bool,
    /// Memory this run may use (e.g. `24G`, `512M`; K/M/G/T are powers of 1024). A run whose
    /// estimated peak exceeds it is refused before any work. Default: the smallest of the
    /// cgroup memory limits of this process and MemTotal.
    #[arg(long, value_name = "SIZE", value_parser = crate::core::memory::parse_size)]
    pub max_memory: Option<u64>,
    /// After the reference of the one requested layer, write its attention inputs for production
    /// kernels to DIR/inputs.safetensors (created when missing; replaced only with --force):
    /// decode query and paged latent cache, prefill q/k/v, from the reference rounded to f32,
    /// with a format-2 dump header for the kernels' outputs (docs/dump-format.md, "Kernel
    /// inputs"). Needs --start-pos 0.
    #[arg(long, value_name = "DIR")]
    pub export_inputs: Option<PathBuf>,
    /// With --export-inputs: export only the heads of this TP rank of --tp (R·N/TP .. (R+1)·N/TP);
    /// default all N heads.
    #[arg(long, value_name = "R", requires = "export_inputs")]
    pub rank: Option<usize>,
}

/// Arguments of `mla-diff inspect`.
#[derive(Debug, Args)]
pub struct InspectArgs {
    /// GGUF model file or Hugging Face checkpoint folder (the same as --model).
    #[arg(conflicts_with = "model", value_name = "MODEL")]
    pub path: Option<PathBuf>,
    /// The model (default: the embedded fixture).
    #[command(flatten)]
    pub model: ModelArgs,
    /// Show only this layer's tensors (and the non-layer ones).
    #[arg(long)]
    pub layer: Option<usize>,
}

/// Arguments of `mla-diff sites`.
#[derive(Debug, Args)]
pub struct SitesArgs {
    /// Write the vocabulary as one JSON object to standard output (`stages`, `ranked_weights`,
    /// `site_templates`, `dump_formats`) instead of the table.
    #[arg(long)]
    pub json: bool,
}
