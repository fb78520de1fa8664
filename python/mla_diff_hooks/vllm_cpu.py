#!/usr/bin/env python3
"""Run vLLM's real DeepSeek MLA model code on a CPU and dump it for `mla-diff compare`.

Why this exists: vLLM refuses to start its MLA code without a GPU; this harness runs the
unmodified vLLM 0.26.0 Python code of `DeepseekV3ForCausalLM` on the CPU (GGUF through
vllm-gguf-plugin, quantized layers through the plugin's own Triton kernels, a torch SDPA prefill
backend, the Triton MLA decode kernel, both under TRITON_INTERPRET=1, float32) and records it with
`mla_diff_hooks.vllm`. Tensor parallelism runs one process per rank over gloo (vLLM's own
distributed initialisation); each rank writes a format-2 dump and the driver joins them. A
scheduled run (--chunk-tokens, --arrivals, --prefix, --workspace-tokens) spreads the requests
over steps as vLLM's scheduler would, through vLLM's own attention-metadata builder and its
chunked-context loop and merges, the hooks armed through their vllm.general_plugins entry point
(SCHEDULE_PATCHES lists what it changes). A Hugging Face checkpoint folder (--model DIR) is loaded
by vLLM itself instead, no plugin involved; a block-FP8 one (DeepSeek-V3's fp8) through vLLM's own
Fp8LinearMethod / Fp8MoEMethod, with the fp8 GEMMs vLLM cannot run on a CPU replaced by the
recorded torch stand-ins of mla_diff_hooks.fp8_cpu (--fp8-compute w8a8-block or weight-only). Every
change it makes to vLLM's behaviour is applied from outside vLLM's files, listed in PATCHES (or
OPTIONAL_PATCHES, opt-in) and recorded in the dump. Subcommands: setup, config, run, test.
Reference (patches and what fails without each, --zero-unloaded, --tp, the end-to-end test):
docs/engines.md, "vLLM on a CPU".
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import dump_format
from .fp8_cpu import MODES as FP8_MODES
from .vllm import GLM_DSA_NAME_MAP

PACKAGE_DIR = Path(__file__).resolve().parent
# The checkout this package lives in (golden/ for `test`, target/ for the binary, .venv-vllm/);
# from an installed wheel, the working directory.
_CHECKOUT = PACKAGE_DIR.parent.parent
ROOT = _CHECKOUT if (_CHECKOUT / "golden").is_dir() else Path.cwd()
MODULE = "mla_diff_hooks.vllm_cpu"
# the harness's name in the dumps it writes (metadata `harness`, the engine's description)
HARNESS = "vllm_cpu.py"

# exact versions; gguf: vllm-gguf-plugin 0.0.5 asks for gguf>=0.17.0, pinned to the newest
PINS = ["vllm==0.26.0", "vllm-gguf-plugin==0.0.5", "gguf==0.19.0"]
TESTED_VLLM = "0.26.0"

# (name, reason) of every change the harness makes to vLLM's behaviour, in the order applied.
# only with --zero-unloaded (changes what the engine computes; recorded in the dump when applied)
ZERO_UNLOADED = (
    "zero-unloaded-weights",
    "a linear layer whose GGUF weight the loader never filled gets an all-zero float32 "
    "weight (UnquantizedLinearMethod) instead of an empty GGUF parameter, so vLLM "
    "loads and runs and the dump shows what a never-loaded weight computes",
)

PATCHES = [
    (
        "cpu-platform",
        "no GPU driver: vLLM cannot infer a device (UnspecifiedPlatform); use vllm.platforms.cpu.CpuPlatform",
    ),
    (
        "triton-interpreter",
        "vllm.triton_utils disables Triton when no GPU driver is active (placeholders instead of "
        "triton / tl); bind the real triton, which TRITON_INTERPRET=1 runs on the CPU",
    ),
    (
        "cpu-mla-backend",
        "CpuPlatform.get_attn_backend_cls raises 'MLA is not supported on CPU'; hand out TRITON_MLA",
    ),
    (
        "sdpa-prefill-backend",
        "vLLM's MLA prefill backends (FlashAttention, FlashInfer, TRT-LLM) need a GPU; register a torch "
        "SDPA backend as MLAPrefillBackendEnum.CUSTOM and select it (the selector picks FlashAttention "
        "whenever the device has no compute capability)",
    ),
    (
        "native-custom-ops",
        "vllm._C is absent on a CPU: compilation_config.custom_ops=['none'] runs RMSNorm, RoPE and "
        "SiluAndMul through their forward_native",
    ),
    (
        "silu-and-mul-init",
        "SiluAndMul.__init__ looks up torch.ops._C.silu_and_mul (absent on CPU); skip the lookup",
    ),
    (
        "latent-cache-write",
        "MLA's KV-cache write calls vllm._custom_ops.concat_and_cache_mla (a CUDA op): write "
        "[kv_c_normed | k_pe] into the paged cache at slot_mapping with torch indexing",
    ),
    (
        "triton-cuda-check",
        "vllm-gguf-plugin's Triton GEMM and dequantize kernels refuse CPU tensors in their argument "
        "checks ('Triton kernels require CUDA tensors'); those two checks are handed views of the "
        "same tensors that answer is_cuda=True, and the kernels run unchanged under TRITON_INTERPRET=1",
    ),
    (
        "unloaded-weights-report",
        "observes only: after each GGUF linear layer's process_weights_after_loading, list the layers "
        "whose weight the loader never filled (vLLM then fails on them with its own error)",
    ),
    (
        "attention-metadata-by-hand",
        "the GPU model runner builds the attention metadata: built here as MLACommonMetadata "
        "(+ MLACommonPrefillMetadata or MLACommonDecodeMetadata) inside set_forward_context",
    ),
    (
        "block-pool-history",
        "the scheduler's KV blocks come from vLLM's own BlockPool (block 0 its null block), after "
        "an earlier request took half as many blocks as this run needs and freed them (tail "
        "first, as KVCacheManager does), which the pool hands out again first: block tables are "
        "not the identity (e.g. [3, 2, 1, 4, 5]); rows are padded with 0 to cdiv(max_model_len, block_size) "
        "entries, and the cache tensor has four spare blocks past the pool's, never handed out",
    ),
]


# the PATCHES that act on vllm-gguf-plugin: left out of a run on a Hugging Face folder (--model)
GGUF_ONLY_PATCHES = ("triton-cuda-check", "unloaded-weights-report")
# the opt-in patches that change vllm-gguf-plugin (refused with --model)
GGUF_PLUGIN_PATCHES = ("fix-merged-column-rank", "fix-moe-name-map", "load-split-kv-b", "glm-dsa-name-map")

# blocks of the cache tensor past the BlockPool's, never handed out: a kernel that reads a page
# with a larger block size than it was written with (the page-size-ignored plant, up to 4x) stays
# inside the tensor
SPARE_BLOCKS = 4

# --kv-split-work W: recorded when applied
H200_SMS = 132  # streaming multiprocessors of an H100 / H200 SXM, what the split rule is capped by


def kv_split_rule(work: int) -> tuple[str, str]:
    """The patch --kv-split-work records: Triton MLA's split rule with another work per split."""
    return (
        "kv-split-rule",
        f"TritonMLAImpl's split count next_power_of_2(max(1, max_seq_len // W)), capped at 2·SMs: "
        f"W (vllm/v1/attention/backends/mla/triton_mla.py _MIN_WORK_PER_SPLIT, 512) set to {work} so "
        f"contexts that fit the fixtures' 1,024 positions get 2, 4 or 8 splits, and the SM count "
        f"(on a CPU: torch's thread count) set to {H200_SMS}, an H200's",
    )


# Opt-in patches (`--patch NAME`): each changes what the engine computes and is recorded in the
# dump when applied, for provenance only (mla-diff judges the values, never this list).
FIX_MERGED_COLUMN_RANK = (
    "fix-merged-column-rank",
    "vllm-gguf-plugin PR #106 applied in-process: _GGUFParamLoadMixin.load_merged_column_weight and "
    "load_qkv_weight take the TP rank from get_tensor_model_parallel_rank() inside their sharding "
    "guard instead of kwargs.get('tp_rank', 0), a keyword vLLM's weight_loader_v2 never passes "
    "(vllm-gguf-plugin#103: every rank kept rank 0's shard of a quantized merged-column weight)",
)
FIX_MOE_NAME_MAP = (
    "fix-moe-name-map",
    "vllm-gguf-plugin 0.0.5's GGUF-to-HF name map, in-process: transformers 5 names a DeepSeek MoE "
    "layer's routed experts as fused parameters mlp.experts.gate_up_proj / mlp.experts.down_proj, "
    "gguf-py's deepseek2 table has no ffn_gate_up_exps, and the plugin side-loads only per-expert "
    "names (mlp.experts.<id>.{gate,up,down}_proj.weight) for deepseek2, so build_name_map fails; the "
    "fused names are side-loaded too (the GGUF's per-expert tensors fill the experts, as the plugin "
    "does for olmoe)",
)
LOAD_SPLIT_KV_B = (
    "load-split-kv-b",
    "vllm-gguf-plugin 0.0.5 maps a DeepSeek GGUF's fused attn_kv_b to kv_b_proj but not the split "
    "attn_k_b / attn_v_b that current llama.cpp converters write, so vLLM never loads kv_b_proj "
    "from such a file; here each layer's kv_b_proj weight is rebuilt from the two tensors "
    "(dequantized by gguf-py: per head the k_b rows transposed to [P, L], then the v_b rows "
    "[V, L]) and loaded as an unquantized float32 weight",
)
CPU_SPARSE_MLA_BACKEND = (
    "cpu-sparse-mla-backend",
    "CpuPlatform has no sparse MLA backend (a DSA model's MLAAttention asks for one: 'MLA is not "
    "supported on CPU'); hand out FLASHMLA_SPARSE, the sparse backend whose module imports "
    "without CUDA, and a workspace manager on the CPU (vLLM's GPU runner makes one; the sparse "
    "impl reserves its query buffer there), so vLLM builds and loads the model; its kernels (and "
    "the indexer's DeepGEMM ones) need CUDA, so a run with this patch loads weights only "
    "(--weights-only)",
)
# glm-dsa-name-map (vllm.GLM_DSA_NAME_MAP) lives beside the hooks: a GPU run applies it too
OPTIONAL_PATCHES = {
    p[0]: p
    for p in (
        FIX_MERGED_COLUMN_RANK,
        FIX_MOE_NAME_MAP,
        LOAD_SPLIT_KV_B,
        GLM_DSA_NAME_MAP,
        CPU_SPARSE_MLA_BACKEND,
    )
}

# What a user reads when vllm-gguf-plugin 0.0.5 cannot map a DeepSeek MoE GGUF (loader_hint).
MOE_MAP_HINT = (
    "vllm-gguf-plugin cannot map this GGUF's routed experts: a plugin bug, not the file. With "
    "transformers 5 the HF DeepSeek model it maps names against holds each MoE layer's routed "
    "experts as fused parameters (mlp.experts.gate_up_proj, mlp.experts.down_proj); gguf-py's "
    "deepseek2 table has no ffn_gate_up_exps, and the plugin's deepseek2 branch side-loads only "
    "per-expert names (mlp.experts.<id>.{gate,up,down}_proj.weight), so "
    "GGUFWeightsAdapter.build_name_map (vllm_gguf_plugin/weights_adapter/default.py) refuses every "
    "DeepSeek MoE GGUF. Its olmoe branch side-loads the fused names; --patch fix-moe-name-map does "
    "the same for deepseek2 in this process (recorded in the dump)."
)


def loader_hint(message: str) -> str | None:
    """The hint for a model-loading error the harness recognises, else None."""
    if "Failed to map GGUF parameters" in message and ".mlp.experts." in message:
        return MOE_MAP_HINT
    return None


def patch_list(
    optional: list[str] | tuple[str, ...] = (),
    zeroed: list[str] | tuple[str, ...] = (),
    *,
    fp8: list[tuple[str, str]] | None = None,
) -> list:
    """The (name, reason) patches a run records, in the order applied: PATCHES (without the
    GGUF-only ones, GGUF_ONLY_PATCHES, when `fp8` is given: a Hugging Face folder that vLLM loads
    itself), the block-FP8 stand-ins `fp8` (mla_diff_hooks.fp8_cpu.patch_entries; [] for an
    unquantized folder), the opt-in `optional` ones (names of OPTIONAL_PATCHES, each once, in
    the order given), then, when --zero-unloaded zeroed the layers `zeroed`, ZERO_UNLOADED and
    ("zeroed", their names). Errors: ValueError for a name OPTIONAL_PATCHES lacks."""
    out = list(PATCHES) if fp8 is None else [p for p in PATCHES if p[0] not in GGUF_ONLY_PATCHES] + list(fp8)
    for name in dict.fromkeys(optional):
        if name not in OPTIONAL_PATCHES:
            raise ValueError(f"unknown patch {name!r} (known: {', '.join(OPTIONAL_PATCHES)})")
        out.append(OPTIONAL_PATCHES[name])
    if zeroed:
        out += [ZERO_UNLOADED, ("zeroed", ", ".join(zeroed))]
    return out


def never_filled(qweight) -> bool:
    """Whether a GGUF linear layer's `qweight`, read after the layer's own
    process_weights_after_loading, holds no data: still an UninitializedParameter, or empty with
    no shards waiting in its `data_container`. Before that call a quantized merged layer
    (gate_up_proj, fused_qkv_a_proj) keeps its shards in `qweight.data_container` while `qweight`
    itself is empty, so only the state after it tells a loaded layer from a never-loaded one."""
    if qweight is None:
        return False
    if any(c.__name__ == "UninitializedParameter" for c in type(qweight).__mro__):
        return True
    numel = getattr(qweight, "numel", None)
    if not callable(numel) or numel() != 0:
        return False
    return not getattr(qweight, "data_container", None)


class CudaView:
    """A tensor as the plugin's Triton argument checks see it: `is_cuda` answers True, every
    other attribute is the tensor's own (the checks return `W.contiguous()`, a real tensor)."""

    __slots__ = ("_tensor",)

    def __init__(self, tensor):
        object.__setattr__(self, "_tensor", tensor)

    @property
    def is_cuda(self) -> bool:
        return True

    def __getattr__(self, name: str):
        return getattr(self._tensor, name)


# =============================================================================================
# setup
# =============================================================================================


def venv_python(venv: Path) -> Path:
    return Path(venv) / "bin" / "python"


def _in_venv(venv) -> bool:
    return Path(sys.prefix).resolve() == Path(venv).resolve()


@contextlib.contextmanager
def _venv_command(venv, args: list[str], env: dict | None = None):
    """(argv, env) that run this module with `args` under the venv's python. The venv holds vLLM
    but not this package: PYTHONPATH gets a temporary folder holding only a link to it (the
    package's own parent may be a site-packages whose packages would shadow the venv's)."""
    py = venv_python(Path(venv))
    if not py.exists():
        raise SystemExit(f"{py} missing: run `python -m {MODULE} setup --venv {venv}` first")
    with tempfile.TemporaryDirectory(prefix="mla-diff-hooks-") as d:
        (Path(d) / PACKAGE_DIR.name).symlink_to(PACKAGE_DIR, target_is_directory=True)
        from .vllm_plugin import write_dist_info

        write_dist_info(Path(d))  # vLLM's load_general_plugins finds the hooks' plugin there
        env = dict(os.environ if env is None else env)
        env["PYTHONPATH"] = d + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        yield [str(py), "-m", MODULE, *args], env


def cmd_setup(args) -> int:
    venv = Path(args.venv)
    t0 = time.time()
    if not venv_python(venv).exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv_python(venv))
    subprocess.run([py, "-m", "pip", "install", "--disable-pip-version-check", *PINS], check=True)
    dt = time.time() - t0
    out = subprocess.run(
        [py, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True, check=True
    ).stdout
    names = {p.split("==")[0].lower(): p for p in out.split()}
    want = ["vllm", "vllm-gguf-plugin", "gguf", "torch", "triton", "transformers", "numpy", "safetensors"]
    print("installed:", ", ".join(names.get(w, f"{w} (missing)") for w in want))
    print(f"{len(names)} distributions in {venv}, {dt:.0f} s")
    bad = [p for p in PINS if p.lower() not in (v.lower() for v in names.values())]
    if bad:
        print(f"error: not installed at the pinned version: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


# =============================================================================================
# config.json from GGUF metadata
# =============================================================================================


def config_from_gguf(gguf_path: Path, torch_dtype: str = "float32") -> dict:
    """A HF DeepseekV3 config.json from a deepseek2 GGUF's metadata (needs the gguf package).

    torch_dtype: the model dtype the config declares (what vLLM's dtype="auto" starts from); the
    CPU harness passes dtype="float32" to vLLM itself, so it runs in float32 whatever this says.
    """
    import gguf

    rd = gguf.GGUFReader(str(gguf_path))
    kv = {}
    for k, f in rd.fields.items():
        try:
            kv[k] = f.contents()
        except Exception:  # noqa: BLE001 - array fields we do not need
            pass
    arch = kv.get("general.architecture")
    if arch != "deepseek2":
        raise SystemExit(f"{gguf_path}: architecture {arch!r}, expected deepseek2")
    a = "deepseek2."
    g = lambda k, d=None: kv.get(a + k, d)  # noqa: E731
    names = {t.name for t in rd.tensors}
    n_layers = int(g("block_count"))
    heads = int(g("attention.head_count"))
    rope = int(g("rope.dimension_count"))
    # key_length_mla / value_length_mla exist when the file has split attn_k_b / attn_v_b (and on
    # newer files); otherwise key_length / value_length are the per-head MHA sizes P+R and V
    key_len = g("attention.key_length_mla") or g("attention.key_length")
    val_len = g("attention.value_length_mla") or g("attention.value_length")
    vocab = g("vocab_size")
    if vocab is None:
        emb = next(t for t in rd.tensors if t.name == "token_embd.weight")
        vocab = int(emb.shape[-1] if emb.shape[0] == g("embedding_length") else emb.shape[0])
    n_dense = int(g("leading_dense_block_count", n_layers))
    n_experts = int(g("expert_count", 0) or 0)
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": int(g("embedding_length")),
        "intermediate_size": int(g("feed_forward_length")),
        "num_hidden_layers": n_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "q_lora_rank": int(g("attention.q_lora_rank")) if g("attention.q_lora_rank") else None,
        "kv_lora_rank": int(g("attention.kv_lora_rank")),
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": int(key_len) - rope,
        "v_head_dim": int(val_len),
        "vocab_size": int(vocab),
        "max_position_embeddings": int(g("context_length", 4096)),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "first_k_dense_replace": n_dense if n_experts else n_layers,
        "n_routed_experts": n_experts if n_experts else None,
        "n_shared_experts": int(g("expert_shared_count", 0) or 0) or None,
        "num_experts_per_tok": int(g("expert_used_count", 0) or 0) or None,
        "moe_intermediate_size": int(g("expert_feed_forward_length", 0) or 0) or None,
        "routed_scaling_factor": float(g("expert_weights_scale", 1.0) or 1.0),
        "norm_topk_prob": bool(g("expert_weights_norm", False)),
        "scoring_func": {2: "sigmoid", 1: "softmax"}.get(int(g("expert_gating_func", 0) or 0), "softmax"),
        "topk_method": "noaux_tc" if int(g("expert_gating_func", 0) or 0) == 2 else "greedy",
        "n_group": 1,
        "topk_group": 1,
        "moe_layer_freq": 1,
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": False,
        "torch_dtype": torch_dtype,
        "bos_token_id": int(kv.get("tokenizer.ggml.bos_token_id", 0) or 0),
        "eos_token_id": int(kv.get("tokenizer.ggml.eos_token_id", 1) or 1),
    }
    stype = g("rope.scaling.type")
    if stype == "yarn":
        # GGUF keeps one YaRN multiplier, 0.1·mscale_all_dim (`yarn_log_multiplier`), and llama.cpp
        # scales the rope by get_mscale(mscale)/get_mscale(mscale_all_dim) = 1: the released
        # DeepSeek configs have mscale = mscale_all_dim (V3: 1.0, V2-Lite: 0.707), so the config
        # says so (vLLM's DeepseekScalingRotaryEmbedding multiplies cos/sin by that ratio).
        mscale_all_dim = (
            float(g("rope.scaling.yarn_log_multiplier", 0.0) or 0.0) / 0.1
            if g("rope.scaling.yarn_log_multiplier")
            else 0.0
        )
        cfg["rope_scaling"] = {
            "type": "yarn",
            "rope_type": "yarn",
            "factor": float(g("rope.scaling.factor")),
            "original_max_position_embeddings": int(g("rope.scaling.original_context_length")),
            "beta_fast": float(g("rope.scaling.yarn_beta_fast", 32.0) or 32.0),
            "beta_slow": float(g("rope.scaling.yarn_beta_slow", 1.0) or 1.0),
            "mscale": mscale_all_dim or 1.0,
            "mscale_all_dim": mscale_all_dim,
        }
    elif stype not in (None, "none"):
        raise SystemExit(f"{gguf_path}: rope scaling {stype!r} not handled by this harness")
    return {k: v for k, v in cfg.items() if v is not None or k == "q_lora_rank"}


def cmd_config(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = config_from_gguf(Path(args.gguf), args.dtype)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    print(f"{out / 'config.json'}: {json.dumps(cfg)}")
    return 0


# =============================================================================================
# run (inside the venv)
# =============================================================================================


def _relaunch_in_venv(args) -> int:
    """Run this module's `_inner` subcommand with the venv's python, TRITON_INTERPRET=1."""
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "1"
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    with _venv_command(args.venv, ["_inner"] + sys.argv[2:], env) as (argv, env):
        return subprocess.run(argv, env=env).returncode


def cmd_run(args) -> int:
    if os.environ.get("TRITON_INTERPRET") != "1" or not _in_venv(args.venv):
        return _relaunch_in_venv(args)
    return inner_run(args)


def parse_prompts(tokens: str | None, prompts: str | None) -> list[list[int]]:
    """The requests' prompt token ids: `--tokens 1,2,3` (one request) or `--prompts
    "1,2,3;4,5"` (one request per `;`-separated list). Errors: SystemExit for both, neither, an
    empty prompt or a token id that is not a non-negative integer."""
    if (tokens is None) == (prompts is None):
        raise SystemExit("give --tokens (one request) or --prompts (several), not both")
    out = []
    for part in (tokens,) if tokens is not None else prompts.split(";"):
        try:
            ids = [int(x) for x in part.split(",") if x.strip()]
        except ValueError:
            raise SystemExit(f"prompt {part!r}: token ids are comma-separated integers") from None
        if not ids or min(ids) < 0:
            raise SystemExit(f"prompt {part!r}: at least one token id, none negative")
        out.append(ids)
    return out


def check_source(args) -> None:
    """Exactly one model source: --gguf (through vllm-gguf-plugin) or --model (a Hugging Face
    checkpoint folder vLLM loads itself), and no GGUF-only option with --model. Errors:
    SystemExit naming the options."""
    if (args.gguf is None) == (args.model is None):
        raise SystemExit(
            "give one of --gguf FILE (through vllm-gguf-plugin) and --model DIR (a Hugging Face folder)"
        )
    if args.model is None:
        if getattr(args, "fp8_compute", None):
            raise SystemExit("--fp8-compute: for a block-FP8 Hugging Face folder (--model), not a GGUF")
        return
    if not (Path(args.model) / "config.json").is_file():
        raise SystemExit(f"--model {args.model}: a Hugging Face checkpoint folder with config.json")
    bad = [f"--patch {p}" for p in args.patch or [] if p in GGUF_PLUGIN_PATCHES]
    bad += ["--config-dir"] if args.config_dir else []
    bad += ["--zero-unloaded"] if args.zero_unloaded else []
    if bad:
        raise SystemExit(f"{', '.join(bad)}: for a GGUF through vllm-gguf-plugin, not with --model")


def hf_quant_method(folder) -> str | None:
    """config.json's `quantization_config.quant_method` (`fp8` for DeepSeek-V3's block FP8), None
    for an unquantized folder."""
    cfg = json.loads((Path(folder) / "config.json").read_text())
    return (cfg.get("quantization_config") or {}).get("quant_method")


def inner_run(args) -> int:
    t_start = time.time()
    tokens = parse_prompts(args.tokens, args.prompts)
    check_source(args)
    if args.model is not None:
        folder = Path(args.model).resolve()
        if args.cmd == "_rank":
            return _rank_run(
                args, tokens, folder, None, t_start, rank=args.rank, port=args.port, out=Path(args.out)
            )
        return _run(args, tokens, folder, None, t_start)
    gguf_path = Path(args.gguf).resolve()
    tmpdir = None
    if args.config_dir:
        config_dir = Path(args.config_dir).resolve()
        if not (config_dir / "config.json").is_file():
            raise SystemExit(f"{config_dir}/config.json missing")
    else:
        tmpdir = tempfile.mkdtemp(prefix="vllm-cpu-cfg-")
        config_dir = Path(tmpdir)
        (config_dir / "config.json").write_text(json.dumps(config_from_gguf(gguf_path), indent=2))
    try:
        if args.cmd == "_rank":
            return _rank_run(
                args,
                tokens,
                gguf_path,
                config_dir,
                t_start,
                rank=args.rank,
                port=args.port,
                out=Path(args.out),
            )
        return _run(args, tokens, gguf_path, config_dir, t_start)
    finally:
        if tmpdir:
            shutil.rmtree(tmpdir, ignore_errors=True)


def _on(name: str) -> bool:
    """False for a patch named in $MLA_VLLM_CPU_SKIP (comma-separated): to see what it is for."""
    return name not in os.environ.get("MLA_VLLM_CPU_SKIP", "").split(",")


def _apply_patches(sdpa_cls_holder: dict, gguf: bool = True) -> None:
    """Every patch of PATCHES, in order (attention metadata is built in _step); without `gguf`
    (a Hugging Face folder) those of GGUF_ONLY_PATCHES are left out."""
    import torch
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    # cpu-platform
    platforms._current_platform = CpuPlatform()

    # triton-interpreter (before any module decorates a kernel with vllm.triton_utils.triton)
    if _on("triton-interpreter"):
        import triton
        import triton.language as tl
        import triton.language.extra.libdevice as tldevice
        import vllm.triton_utils as vtu
        import vllm.triton_utils.importing as vtu_imp

        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("TRITON_INTERPRET=1 must be set before triton is imported")
        vtu_imp.HAS_TRITON = vtu.HAS_TRITON = True
        vtu.triton, vtu.tl, vtu.tldevice = triton, tl, tldevice

    # cpu-mla-backend
    if _on("cpu-mla-backend"):
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        orig_backend = CpuPlatform.get_attn_backend_cls.__func__

        def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
            if attn_selector_config.use_mla and not attn_selector_config.use_sparse:
                return AttentionBackendEnum.TRITON_MLA.get_path()
            return orig_backend(cls, selected_backend, attn_selector_config, num_heads)

        CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)

    # sdpa-prefill-backend
    if _on("sdpa-prefill-backend"):
        from vllm.v1.attention.backends.mla.prefill.base import MLAPrefillBackend
        from vllm.v1.attention.backends.mla.prefill.registry import (
            MLAPrefillBackendEnum,
            register_mla_prefill_backend,
        )

        class SdpaPrefillBackend(MLAPrefillBackend):
            """Causal attention of the new prefill tokens with torch SDPA, per sequence."""

            supported_dtypes = [torch.float32, torch.float16, torch.bfloat16]

            @staticmethod
            def get_name() -> str:
                return "TORCH_SDPA_CPU"

            def run_prefill_new_tokens(self, q, k, v, return_softmax_lse, out=None, output_scale=None):
                qsl = self._prefill_metadata.query_start_loc.tolist()
                res = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype)
                lses = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32)
                for a, b in zip(qsl[:-1], qsl[1:]):
                    qs, ks, vs = (x[a:b].transpose(0, 1) for x in (q, k, v))  # [N, t, d]
                    res[a:b] = torch.nn.functional.scaled_dot_product_attention(
                        qs, ks, vs, is_causal=True, scale=self.scale
                    ).transpose(0, 1)
                    if return_softmax_lse:
                        lg = (qs.float() @ ks.float().transpose(1, 2)) * self.scale
                        mask = torch.ones(b - a, b - a, dtype=torch.bool).tril()
                        lses[:, a:b] = lg.masked_fill(~mask, float("-inf")).logsumexp(-1)
                if out is not None:
                    out.copy_(res)
                    res = out
                return (res, lses) if return_softmax_lse else res

            def run_prefill_context_chunk(self, chunk_idx, q, k, v):
                """Chunk `chunk_idx` of the cached context: each prefill request's queries attend
                (not causally) to its own keys of the chunk, cu_seq_lens[chunk_idx] cutting k/v
                per request. A request whose chunk is empty keeps what torch.empty handed out
                and LSE -inf, as FlashAttention leaves it (vLLM's mask_empty_context then zeroes
                it). Returns (out [Tp, N, V], lse [N, Tp] natural log)."""
                md = self._prefill_metadata
                qsl = md.query_start_loc.tolist()
                csl = md.chunked_context.cu_seq_lens[chunk_idx].tolist()
                res = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype)
                lses = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32)
                for (a, b), (ka, kb) in zip(zip(qsl[:-1], qsl[1:]), zip(csl[:-1], csl[1:])):
                    if kb == ka or b == a:
                        continue
                    qs, ks, vs = q[a:b].transpose(0, 1), k[ka:kb].transpose(0, 1), v[ka:kb].transpose(0, 1)
                    res[a:b] = torch.nn.functional.scaled_dot_product_attention(
                        qs, ks, vs, scale=self.scale
                    ).transpose(0, 1)
                    lses[:, a:b] = ((qs.float() @ ks.float().transpose(1, 2)) * self.scale).logsumexp(-1)
                return res, lses

        SdpaPrefillBackend.__module__ = __name__
        SdpaPrefillBackend.__qualname__ = "SdpaPrefillBackend"
        globals()["SdpaPrefillBackend"] = SdpaPrefillBackend
        register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM)(SdpaPrefillBackend)
        sdpa_cls_holder["cls"] = SdpaPrefillBackend
        sdpa_cls_holder["enum"] = MLAPrefillBackendEnum.CUSTOM
        import vllm.model_executor.layers.attention.mla_attention as mla_mod

        def get_mla_prefill_backend(vllm_config):
            sel = vllm_config.attention_config.mla_prefill_backend
            if sel is not None:
                return sel.get_class()
            return SdpaPrefillBackend

        mla_mod.get_mla_prefill_backend = get_mla_prefill_backend

    # native-custom-ops: set in the config (_build_config)

    # silu-and-mul-init
    if _on("silu-and-mul-init"):
        from vllm.model_executor.custom_op import CustomOp
        from vllm.model_executor.layers import activation as act

        def silu_init(self, *a, **kw):
            CustomOp.__init__(self)

        act.SiluAndMul.__init__ = silu_init

    # latent-cache-write
    if _on("latent-cache-write"):
        from vllm.v1.attention import backend as be

        def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale):
            if kv_cache.numel() == 0:
                return
            flat = kv_cache.view(-1, kv_cache.shape[-1])
            row = torch.cat([kv_c_normed, k_pe.reshape(k_pe.shape[0], -1)], -1).to(flat.dtype)
            flat[slot_mapping.flatten().long()] = row

        for name in dir(be):
            cls = getattr(be, name)
            if isinstance(cls, type) and "do_kv_cache_update" in cls.__dict__:
                cls.do_kv_cache_update = do_kv_cache_update

    # triton-cuda-check
    if gguf and _on("triton-cuda-check"):
        import vllm_gguf_plugin.triton.dequantize.utils as dequant_utils
        import vllm_gguf_plugin.triton.gemm.utils as gemm_utils

        check_gemm, check_dequant = gemm_utils._validate_args, dequant_utils.validate_dequant_args

        def validate_gemm(W, X, *args, **kwargs):
            return check_gemm(CudaView(W), CudaView(X), *args, **kwargs)

        def validate_dequant(W, *args, **kwargs):
            return check_dequant(CudaView(W), *args, **kwargs)

        gemm_utils._validate_args = validate_gemm
        dequant_utils.validate_dequant_args = validate_dequant


def _zero_linear(mod) -> None:
    """zero-unloaded-weights on one linear layer: an all-zero float32 weight of its partition's
    shape through UnquantizedLinearMethod, in place of the empty GGUF parameters."""
    import torch
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    for attr in ("qweight", "qweight_type"):
        if attr in mod._parameters:
            del mod._parameters[attr]
    mod.quant_method = UnquantizedLinearMethod()
    mod.weight = torch.nn.Parameter(
        torch.zeros(
            int(mod.output_size_per_partition), int(mod.input_size_per_partition), dtype=torch.float32
        ),
        requires_grad=False,
    )
    # The method's own post-load step: on a CPU it picks the GEMM the forward calls (cpu_linear).
    mod.quant_method.process_weights_after_loading(mod)


def _patch_unloaded(zero: bool, found: list) -> None:
    """unloaded-weights-report (and, with zero=True, zero-unloaded-weights): after each GGUF linear
    layer's own process_weights_after_loading (GGUFLinearMethod: materializes the parameters and
    concatenates a merged layer's shards), a layer whose `qweight` stayed empty (never_filled) is
    appended to `found` by name, and zeroed with zero=True, before vLLM's attention layers
    post-process (MLAAttention reads kv_b_proj there). The names are printed on stderr, also when
    vLLM then fails on them."""
    import vllm_gguf_plugin.loader as gl
    from vllm_gguf_plugin.quantization.linear import GGUFLinearMethod

    whole_model, one_layer = gl.process_weights_after_loading, GGUFLinearMethod.process_weights_after_loading
    names: dict[int, str] = {}

    def process_layer(self, layer):
        one_layer(self, layer)
        if never_filled(getattr(layer, "qweight", None)):
            found.append(names.get(id(layer), type(layer).__name__))
            if zero:
                _zero_linear(layer)

    def process_weights_after_loading(model, model_config, target_device):
        names.update({id(m): n for n, m in model.named_modules()})
        try:
            return whole_model(model, model_config, target_device)
        finally:
            if found:
                print(
                    "vllm_cpu: linear layers the GGUF loader never filled: " + ", ".join(found),
                    file=sys.stderr,
                    flush=True,
                )

    GGUFLinearMethod.process_weights_after_loading = process_layer
    gl.process_weights_after_loading = process_weights_after_loading


def _patch_fix_merged_column_rank() -> None:
    """fix-merged-column-rank: vllm-gguf-plugin PR #106's change to its merged-column and QKV
    loaders, in this process. The plugin's 0.0.5 loaders narrow each shard at rank
    `kwargs.get("tp_rank", 0)`; vLLM's MergedColumnParallelLinear / QKVParallelLinear
    weight_loader_v2 pass shard_id, shard_offset and shard_size but no tp_rank, so every rank
    kept rank 0's rows. These take the rank from vLLM's parallel state where they cut."""
    from vllm.distributed import get_tensor_model_parallel_rank
    from vllm_gguf_plugin.quantization import params

    def cuts(loaded_weight, shard_size) -> bool:
        return shard_size is not None and loaded_weight.ndim >= 1 and 0 < shard_size < loaded_weight.shape[0]

    def load_merged_column_weight(self, loaded_weight, **kwargs):
        shard_id, shard_size = kwargs.get("shard_id"), kwargs.get("shard_size")
        if cuts(loaded_weight, shard_size):
            rank = get_tensor_model_parallel_rank()
            loaded_weight = loaded_weight.narrow(0, rank * shard_size, shard_size)
        self._store(loaded_weight, shard_id=shard_id)

    def load_qkv_weight(self, loaded_weight, **kwargs):
        shard_id, shard_size = kwargs.get("shard_id"), kwargs.get("shard_size")
        if cuts(loaded_weight, shard_size):
            rank = get_tensor_model_parallel_rank()
            if shard_id in ("k", "v"):
                rank //= kwargs.get("num_heads", 1)
            loaded_weight = loaded_weight.narrow(0, rank * shard_size, shard_size)
        self._store(loaded_weight, shard_id=shard_id)

    params._GGUFParamLoadMixin.load_merged_column_weight = load_merged_column_weight
    params._GGUFParamLoadMixin.load_qkv_weight = load_qkv_weight


def _patch_fix_moe_name_map() -> None:
    """fix-moe-name-map: build_name_map filters the HF parameters it could not name through
    `regex.fullmatch(pattern, name)` against its side-load patterns; the module's `regex` is
    replaced by one whose fullmatch also accepts a MoE layer's fused routed-expert names."""
    import regex
    import vllm_gguf_plugin.weights_adapter.default as adapter

    fused = regex.compile(r"model\.layers\.[0-9]+\.mlp\.experts\.(gate_up_proj|down_proj)")

    class _Regex:
        compile = staticmethod(regex.compile)

        @staticmethod
        def fullmatch(pattern, name, *args, **kwargs):
            return regex.fullmatch(pattern, name, *args, **kwargs) or fused.fullmatch(name)

    adapter.regex = _Regex


def _patch_cpu_sparse_mla_backend() -> None:
    """cpu-sparse-mla-backend: CpuPlatform.get_attn_backend_cls answers a sparse MLA layer with
    FLASHMLA_SPARSE (the layers without an indexer keep what cpu-mla-backend gives them), and
    vLLM's workspace manager is made on the CPU."""
    import torch
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.worker import workspace

    if getattr(workspace, "_manager", None) is None:
        workspace.init_workspace_manager(torch.device("cpu"))

    orig = CpuPlatform.get_attn_backend_cls.__func__

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if attn_selector_config.use_mla and attn_selector_config.use_sparse:
            return AttentionBackendEnum.FLASHMLA_SPARSE.get_path()
        return orig(cls, selected_backend, attn_selector_config, num_heads)

    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)


def split_kv_b_weights(gguf_path) -> dict:
    """`model.layers.{n}.self_attn.kv_b_proj.weight` [N·(P+V), L] float32 for every layer of a GGUF
    that has the split `blk.{n}.attn_k_b.weight` (ggml ne {P, L, N}) and `attn_v_b.weight`
    (ne {L, V, N}) and no fused `attn_kv_b`: per head h the rows `k_b[h]ᵀ` ([P, L]) then
    `v_b[h]` ([V, L]), vLLM's (and HF's) kv_b_proj layout. Quantized tensors are dequantized
    by gguf-py. Empty for a file with fused kv_b."""
    import gguf
    import numpy as np

    rd = gguf.GGUFReader(str(gguf_path))
    by_name = {t.name: t for t in rd.tensors}

    def values(t):
        a = gguf.quants.dequantize(np.array(t.data), t.tensor_type)
        return np.asarray(a, np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))

    out = {}
    n = 0
    while f"blk.{n}.attn_norm.weight" in by_name:
        kb, vb = by_name.get(f"blk.{n}.attn_k_b.weight"), by_name.get(f"blk.{n}.attn_v_b.weight")
        if kb is not None and vb is not None and f"blk.{n}.attn_kv_b.weight" not in by_name:
            k = values(kb).transpose(0, 2, 1)  # [N, L, P] -> [N, P, L]
            v = values(vb)  # [N, V, L]
            w = np.concatenate([k, v], axis=1)
            out[f"model.layers.{n}.self_attn.kv_b_proj.weight"] = np.ascontiguousarray(
                w.reshape(-1, w.shape[-1]), np.float32
            )
        n += 1
    return out


def _patch_load_split_kv_b() -> None:
    """load-split-kv-b: the plugin's default weights adapter, in this process, marks every layer's
    kv_b_proj unquantized (prepare_loading) and yields split_kv_b_weights after the GGUF's own
    tensors (prepare_weights), so vLLM's DeepSeek load_weights fills kv_b_proj from them."""
    import torch
    from vllm_gguf_plugin.weights_adapter.default import GGUFWeightsAdapter

    prepare_loading, prepare_weights = GGUFWeightsAdapter.prepare_loading, GGUFWeightsAdapter.prepare_weights

    def loading(self, model_path, model_config):
        spec = prepare_loading(self, model_path, model_config)
        self.split_kv_b = {}
        for f in spec.weights_source:
            self.split_kv_b.update(split_kv_b_weights(f))
        spec.unquantized_modules.extend(name.removesuffix(".weight") for name in self.split_kv_b)
        return spec

    def weights(self, model_config):
        yield from prepare_weights(self, model_config)
        for name, w in getattr(self, "split_kv_b", {}).items():
            yield name, torch.from_numpy(w)

    GGUFWeightsAdapter.prepare_loading = loading
    GGUFWeightsAdapter.prepare_weights = weights


def _build_config(model_path: Path, config_dir: Path | None, max_len: int, block_size: int, tp: int = 1):
    """vLLM's engine config for the GGUF `model_path` with the HF config in `config_dir`, or for
    the Hugging Face folder `model_path` (config_dir None: its own config.json, its
    quantization_config included)."""
    from vllm.engine.arg_utils import EngineArgs

    ea = EngineArgs(
        model=str(model_path),
        hf_config_path=None if config_dir is None else str(config_dir),
        tokenizer=None,
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=max_len,
        block_size=block_size,
        enable_prefix_caching=False,
        compilation_config={"custom_ops": ["none"] if _on("native-custom-ops") else [], "mode": 0},
        attention_config={"mla_prefill_backend": "CUSTOM"},
        distributed_executor_backend="uni",
        tensor_parallel_size=tp,
    )
    return ea.create_engine_config()


def _run(args, tokens, gguf_path, config_dir, t_start) -> int:
    """TP 1: rank 0 in this process, writing args.out. TP > 1: one `_rank` process per rank over
    gloo (TORCHDYNAMO_DISABLE=1: VocabParallelEmbedding's @torch.compile'd masking would cost ~45 s
    of inductor compile per rank on 2 cores and changes no value), each writing its format-2
    dump, then join_rank_dumps joins them into args.out."""
    if args.tp == 1:
        return _rank_run(
            args, tokens, gguf_path, config_dir, t_start, rank=0, port=_free_port(), out=Path(args.out)
        )
    if args.format != 2:
        raise SystemExit("--tp > 1 writes format 2 (every rank's dump, joined); drop --format 1")
    from . import vllm as dump_vllm

    out = Path(args.out)
    work = Path(args.rank_dir) if args.rank_dir else Path(tempfile.mkdtemp(prefix="vllm-cpu-tp-"))
    work.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1")
    procs = []
    for r in range(args.tp):
        argv = [sys.executable, "-m", MODULE, "_rank", *sys.argv[2:]]
        argv += ["--rank", str(r), "--port", str(port), "--out", str(work / out.name)]
        argv += [] if config_dir is None else ["--config-dir", str(config_dir)]
        log = open(work / f"rank{r}.log", "w")
        procs.append((r, subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    failed = None
    while any(p.poll() is None for _, p, _ in procs):
        for r, p, _ in procs:
            if p.poll() not in (None, 0) and failed is None:
                failed = r
                for _, q, _ in procs:  # the others would wait in a collective forever
                    if q.poll() is None:
                        q.kill()
        time.sleep(0.5)
    for r, p, log in procs:
        log.close()
        if p.returncode != 0 and failed is None:
            failed = r
    for r, p, _ in procs:
        text = (work / f"rank{r}.log").read_text()
        lines = text.strip().splitlines()
        keep = (
            lines
            if (r == failed)
            else [ln for ln in lines if not ln.startswith(("INFO", "WARNING", "DEBUG"))]
        )
        tail = keep[-40:] if r == failed else keep[-8:]
        print(
            f"[rank {r}] exit {p.returncode}" + ("".join("\n  " + ln for ln in tail) if tail else ""),
            flush=True,
        )
    if failed is not None:
        print(f"rank {failed} failed (logs kept in {work})", file=sys.stderr)
        return 1
    rank_files = [dump_vllm.rank_path(work / out.name, r, args.tp) for r in range(args.tp)]
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.weights_only:
        dump_vllm.merge_weight_files(rank_files, out)
    else:
        dump_vllm.join_rank_dumps(rank_files, out)
    print(f"joined {len(rank_files)} rank dumps in {time.time() - t_start:.1f} s; wrote {out}")
    if not args.rank_dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _rank_run(args, prompts, gguf_path, config_dir, t_start, *, rank: int, port: int, out: Path) -> int:
    """One TP rank: vLLM's model built and loaded through the plugin, or by vLLM itself from a
    Hugging Face folder (--model; `gguf_path` is then the folder, `config_dir` None, and a
    block-FP8 checkpoint gets the fp8_cpu stand-ins), with the opt-in patches and the plants
    applied first, the hooks armed with mla_diff_hooks.vllm.arm, every request prefilled in one
    step and decoded together for --decode-steps steps, and finish writing this rank's dump
    (`out` at TP 1, `rank_path(out)` at TP > 1)."""
    import torch

    tp = args.tp
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // tp))
    if scheduled(args):
        # the hooks arm through their vLLM plugin, as in `vllm serve`; this process writes the dump
        from . import vllm_plugin

        os.environ[vllm_plugin.ENV_DUMP] = str(out.parent.resolve())
        os.environ[vllm_plugin.ENV_STEPS] = f"{getattr(args, 'record_from', 0)}:{1 << 20}"
        os.environ[vllm_plugin.ENV_HEADS] = getattr(args, "heads", None) or ""
        os.environ[vllm_plugin.ENV_WRITE] = "0"
        os.environ[vllm_plugin.ENV_LAYERS] = args.layers or ""
        os.environ[vllm_plugin.ENV_SITES] = args.sites or ""
    holder: dict = {}
    hf = args.model is not None
    _apply_patches(holder, gguf=not hf)
    import vllm

    if vllm.__version__ != TESTED_VLLM:
        print(
            f"warning: vLLM {vllm.__version__}; this harness was tested with {TESTED_VLLM}", file=sys.stderr
        )
    zeroed: list[str] = []
    if hf:
        from . import fp8_cpu

        fp8 = hf_quant_method(gguf_path) == "fp8"
        args.fp8_patches = fp8_cpu.install(args.fp8_compute or FP8_MODES[0]) if fp8 else []
    else:
        import vllm_gguf_plugin

        vllm_gguf_plugin_register = getattr(vllm_gguf_plugin, "register", None)
        if vllm_gguf_plugin_register is not None:
            vllm_gguf_plugin_register()
        _patch_unloaded(args.zero_unloaded, zeroed)
    for name in dict.fromkeys(args.patch or []):
        if name == FIX_MERGED_COLUMN_RANK[0]:
            _patch_fix_merged_column_rank()
        elif name == FIX_MOE_NAME_MAP[0]:
            _patch_fix_moe_name_map()
        elif name == LOAD_SPLIT_KV_B[0]:
            _patch_load_split_kv_b()
        elif name == GLM_DSA_NAME_MAP[0]:
            from . import vllm as dump_vllm

            dump_vllm.map_glm_dsa_names()
        elif name == CPU_SPARSE_MLA_BACKEND[0]:
            _patch_cpu_sparse_mla_backend()
    from . import plants

    planted = [plants.apply(spec) for spec in args.plant or []]
    scale_plant = any(spec.partition(":")[0].strip() == "fp8-scale-transposed" for spec in args.plant or [])
    if scheduled(args):
        _apply_schedule_patches(args.workspace_tokens)
        from vllm.plugins import load_general_plugins

        load_general_plugins()
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.model_executor.model_loader import get_model_loader

    from . import vllm as dump_vllm

    block_size = args.block_size
    total = max(len(t) for t in prompts) + args.decode_steps
    max_len = max(block_size * 2, ((total + block_size - 1) // block_size + 1) * block_size)
    vcfg = _build_config(gguf_path, config_dir, max_len, block_size, tp)
    t_cfg = time.time()
    with set_current_vllm_config(vcfg):
        init_distributed_environment(
            world_size=tp,
            rank=rank,
            local_rank=rank,
            backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{port}",
        )
        ensure_model_parallel_initialized(tp, 1)
        loader = get_model_loader(vcfg.load_config)
        try:
            model = loader.load_model(vcfg, vcfg.model_config)
        except RuntimeError as e:
            hint = loader_hint(str(e))
            if hint is None:
                raise
            print(f"vllm_cpu: vLLM could not load {gguf_path.name}: {e}\n  hint: {hint}", file=sys.stderr)
            return 3
    model.eval()
    t_load = time.time()
    if scale_plant:
        if not plants.SCALE_PLANTED:
            raise SystemExit("fp8-scale-transposed met no layer: is the model a block-FP8 checkpoint?")
        print(f"fp8-scale-transposed planted: {plants.SCALE_PLANTED}")
    layer_list = [int(x) for x in args.layers.split(",")] if args.layers else None
    if args.weights_only:
        written = dump_vllm.write_weights(
            model,
            weights_path=str(out),
            engine=f"vllm {vllm.__version__} ({HARNESS}, CPU)",
            layers=layer_list,
            extra_meta={
                "harness": HARNESS,
                "loader": loader_name(args),
                "patches": "; ".join(
                    f"{e['name']}: {e['reason']}"
                    for e in map(dump_vllm.patch_entry, run_patches(args, zeroed) + planted)
                ),
            },
        )
        keep_weights(written, args.weights_keep)
        print(f"rank {rank}/{tp}: load {t_load - t_cfg:.1f} s; wrote {written} (weights only)")
        return 0
    layers = _mla_layers(vcfg)
    extra_patches = []
    if args.kv_split_work:
        from vllm.v1.attention.backends.mla import triton_mla

        triton_mla._MIN_WORK_PER_SPLIT = args.kv_split_work
        for lay in layers.values():
            if hasattr(lay.impl, "_sm_count"):
                lay.impl._sm_count = H200_SMS
        extra_patches.append(kv_split_rule(args.kv_split_work))
    lens = [len(t) + args.decode_steps for t in prompts]
    pool = BlockAllocator(lens, block_size, max_len)
    L_R = next(iter(layers.values())).head_size
    for lay in layers.values():
        lay.kv_cache = torch.zeros(pool.num_blocks + SPARE_BLOCKS, block_size, L_R, dtype=torch.float32)
    if scheduled(args):
        return _rank_run_scheduled(
            args, prompts, gguf_path, model, vcfg, layers, pool, extra_patches, zeroed, planted, out, t_load
        )
    step_sites, weight_sites = prefill_keep(args.prefill_sites, args.weight_sites)
    print(
        dump_vllm.arm(
            model,
            steps=1 + args.decode_steps,
            engine=f"vllm {vllm.__version__} ({HARNESS}, CPU)",
            layers=layer_list,
            step_sites=step_sites,
        )
    )
    seqs = [list(t) for t in prompts]
    decode_ids: list[list[int]] = [[] for _ in prompts]
    with set_current_vllm_config(vcfg), torch.no_grad():
        for i, t in enumerate(prompts):
            pool.grow(i, len(t))
        h = _step(
            model,
            vcfg,
            layers,
            new=[list(t) for t in prompts],
            contexts=[0] * len(prompts),
            pool=pool,
            holder=holder,
            decode=False,
        )
        t_prefill = time.time()
        rows = [x - 1 for x in itertools.accumulate(len(t) for t in prompts)]  # each request's last row
        for k in range(args.decode_steps):
            nxt = _next_tokens(model, h, rows, args, k, tp)
            rows = list(range(len(prompts)))
            contexts = [len(x) for x in seqs]
            for i, tok in enumerate(nxt):
                decode_ids[i].append(tok)
                seqs[i].append(tok)
                pool.grow(i, len(seqs[i]))
            h = _step(
                model,
                vcfg,
                layers,
                new=[[tok] for tok in nxt],
                contexts=contexts,
                pool=pool,
                holder=holder,
                decode=True,
            )
    t_end = time.time()
    loader = loader_name(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    patches = run_patches(args, zeroed) + extra_patches + planted
    if args.format == 2:
        engine = {
            "name": "vllm",
            "version": vllm.__version__,
            "attention_backend": "TRITON_MLA",
            "prefill_backend": f"TORCH_SDPA_CPU ({HARNESS}, MLAPrefillBackendEnum.CUSTOM)",
        }
        res = dump_vllm.finish(
            model,
            dump_path=str(out),
            model_path=str(gguf_path),
            engine_info=engine,
            patches=patches,
            weights=not args.no_weights,
            weights_path=args.weights,
            weight_sites=weight_sites,
            extra_meta={
                "harness": HARNESS,
                "loader": loader,
                "triton": "TRITON_INTERPRET=1 " + _dist_version("triton"),
            },
        )
        written = [res["dump"]] + ([res["weights"]] if "weights" in res else [])
        if "weights" in res:
            keep_weights(res["weights"], args.weights_keep)
    else:
        cap = dump_vllm._ACTIVE
        cap.remove()
        extra = {
            "harness": HARNESS,
            "patches": "; ".join(f"{e['name']}: {e['reason']}" for e in map(dump_vllm.patch_entry, patches)),
            "attention_backend": "TRITON_MLA (decode, Triton interpreter), TORCH_SDPA_CPU (prefill)",
            "model": gguf_path.name,
            "loader": loader,
        }
        written = cap.write_steps(out, extra_meta=extra, weight_sites=weight_sites)
        if args.weights:
            cap.write_weights(args.weights)
            keep_weights(args.weights, args.weights_keep)
            written.append(Path(args.weights))
    shown = "; ".join(f"{len(t)} prompt tokens, decode {d}" for t, d in zip(prompts, decode_ids))
    print(f"rank {rank}/{tp}: {len(prompts)} request(s): {shown}")
    print(f"block tables: {pool.describe()}")
    print(
        f"config {t_cfg - t_start:.1f} s, load {t_load - t_cfg:.1f} s, prefill "
        f"{t_prefill - t_load:.1f} s, {args.decode_steps} decode step(s) {t_end - t_prefill:.1f} s"
    )
    for p in written:
        print(f"wrote {p}")
    return 0


def keep_weights(path, params: str | None) -> None:
    """Rewrite the WEIGHTS file `path` with only the tensors of the comma-separated `params`
    (`o_proj`, `fused_qkv_a_proj`, `shared_experts.down_proj`, ...: a name `L{n}.{param}` or
    `L{n}.{param}.rank{r}`), its metadata kept and `kept` added; None keeps every tensor. For a
    committed file of a few tensors. Errors: SystemExit when no tensor is left."""
    if not params:
        return
    from . import st_io

    want = {p.strip() for p in params.split(",") if p.strip()}
    tensors, meta = st_io.load(path)

    def param(name: str) -> str:
        base = name.split(".", 1)[1] if name.startswith("L") and "." in name else name
        head, _, last = base.rpartition(".")
        return head if last.startswith("rank") and last[4:].isdigit() else base

    kept = {k: v for k, v in tensors.items() if param(k) in want}
    if not kept:
        raise SystemExit(f"--weights-keep {params}: no tensor of {path} is one of them")
    meta["kept"] = f"only {', '.join(sorted(want))} (--weights-keep); the other tensors left out"
    st_io.save(kept, Path(path), metadata=meta)


def run_patches(args, zeroed: list[str]) -> list:
    """patch_list for this run: its opt-in patches, the layers --zero-unloaded zeroed, and on a
    Hugging Face folder the block-FP8 stand-ins installed (args.fp8_patches)."""
    fp8 = getattr(args, "fp8_patches", []) if args.model is not None else None
    return patch_list(args.patch or [], zeroed if args.zero_unloaded else [], fp8=fp8)


def loader_name(args) -> str:
    """The dump's `loader`: vllm-gguf-plugin with its version, or vLLM's own safetensors loader."""
    if args.model is not None:
        return f"vllm {_dist_version('vllm')} DefaultModelLoader (safetensors)"
    return f"vllm-gguf-plugin {_dist_version('vllm-gguf-plugin')}"


def prefill_keep(prefill_sites: str | None, weight_sites: str | None) -> tuple[dict | None, bool]:
    """(step_sites for mla_diff_hooks.vllm.arm, whether to write weight sites) from
    --prefill-sites (activation stages step 0 keeps; default all) and --weight-sites (weight
    sites kept; `none`; default all). Errors: SystemExit naming a stage mla-diff does not know,
    or a weight site among the activation stages (and the other way round)."""
    weights = dump_format.WEIGHT_STAGES
    acts = [x for x in dump_format.STAGES if x not in weights]

    def parse(text, allowed, what):
        got = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in got if x not in allowed]
        if bad:
            raise SystemExit(f"{what}: {', '.join(bad)} not among {', '.join(allowed)}")
        return got

    if prefill_sites is None and weight_sites is None:
        return None, True
    keep_acts = acts if prefill_sites is None else parse(prefill_sites, acts, "--prefill-sites")
    keep_w = (
        list(weights)
        if weight_sites is None
        else []
        if weight_sites.strip() == "none"
        else parse(weight_sites, weights, "--weight-sites")
    )
    return {0: keep_acts + keep_w}, bool(keep_w)


class BlockAllocator:
    """Each request's KV blocks, handed out by vLLM's own BlockPool as a scheduler would: a
    request gets a block when its tokens reach a new page. Before the run an earlier request
    took half as many blocks as this run needs and freed them tail first (KVCacheManager's
    order); BlockPool.free_blocks puts blocks without a hash at the front of its free queue, so
    this run gets those blocks first, in descending order, then the never-used ones: the block
    tables are not the identity (e.g. [3, 2, 1, 4, 5] and [6]; block 0 is the pool's null block).

    lens: each request's final length (prompt + decode steps); block_size: tokens per block;
    max_len: max_model_len (a row has cdiv(max_len, block_size) entries, padded with 0)."""

    def __init__(self, lens: list[int], block_size: int, max_len: int):
        from vllm.v1.core.block_pool import BlockPool

        self.block_size = block_size
        need = sum(-(-n // block_size) for n in lens)
        self.pool = BlockPool(num_gpu_blocks=need + 1, enable_caching=False, hash_block_size=block_size)
        earlier = self.pool.get_new_blocks(max(1, need // 2))
        self.pool.free_blocks(reversed(earlier))
        self.num_blocks = need + 1
        self.width = -(-max_len // block_size)
        self.blocks: list[list[int]] = [[] for _ in lens]

    def grow(self, i: int, n_tokens: int) -> None:
        """Give request i the blocks that hold its first n_tokens tokens."""
        want = -(-n_tokens // self.block_size)
        if want > len(self.blocks[i]):
            got = self.pool.get_new_blocks(want - len(self.blocks[i]))
            self.blocks[i] += [b.block_id for b in got]

    def share(self, i: int, j: int, n_tokens: int) -> None:
        """Give request i request j's blocks of its first n_tokens tokens (full blocks only: a
        prefix-cache hit)."""
        if n_tokens % self.block_size or len(self.blocks[j]) * self.block_size < n_tokens:
            raise SystemExit(f"prefix hit of {n_tokens} tokens: full blocks request {j} holds, please")
        self.blocks[i] = list(self.blocks[j][: n_tokens // self.block_size])

    def table(self):
        """[S, cdiv(max_len, block_size)] int32, each request's block ids padded with 0."""
        import torch

        t = torch.zeros(len(self.blocks), self.width, dtype=torch.int32)
        for i, b in enumerate(self.blocks):
            t[i, : len(b)] = torch.tensor(b, dtype=torch.int32)
        return t

    def slot(self, i: int, pos: int) -> int:
        return self.blocks[i][pos // self.block_size] * self.block_size + pos % self.block_size

    def describe(self) -> str:
        return "; ".join(f"request {i}: {b}" for i, b in enumerate(self.blocks))


def _dist_version(name: str) -> str:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # noqa: BLE001
        return "unknown"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mla_layers(vcfg) -> dict:
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    ctx = vcfg.compilation_config.static_forward_context
    out = {k: v for k, v in ctx.items() if isinstance(v, MLAAttention)}
    if not out:
        raise SystemExit("no MLAAttention layer registered in static_forward_context")
    return out


def _step(model, vcfg, layers, *, new, contexts, pool, holder, decode: bool):
    """One forward of every request: request i's tokens `new[i]` at positions contexts[i].. (a
    prefill from position 0, or one decode token each), its rows packed in request order, with
    the attention metadata a GPU model runner would build (block table from `pool`)."""
    import torch
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.attention.mla_attention import (
        MLACommonDecodeMetadata,
        MLACommonMetadata,
        MLACommonPrefillMetadata,
    )

    ids = torch.tensor([x for t in new for x in t], dtype=torch.long)
    positions = [c + j for c, t in zip(contexts, new) for j in range(len(t))]
    pos = torch.tensor(positions, dtype=torch.long)
    slots = torch.tensor(
        [pool.slot(i, c + j) for i, (c, t) in enumerate(zip(contexts, new)) for j in range(len(t))],
        dtype=torch.long,
    )
    t = len(positions)
    n_req = len(new)
    seq_lens = [c + len(x) for c, x in zip(contexts, new)]
    qsl = torch.tensor([0, *itertools.accumulate(len(x) for x in new)], dtype=torch.int32)
    block_table = pool.table()
    max_q = max(len(x) for x in new)
    md = {}
    slot_map = {}
    for name, lay in layers.items():
        if decode:
            dec = MLACommonDecodeMetadata(
                block_table=block_table,
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                dcp_tot_seq_lens=None,
            )
            m = MLACommonMetadata(
                num_reqs=n_req,
                max_query_len=max_q,
                max_seq_len=max(seq_lens),
                num_actual_tokens=t,
                query_start_loc=qsl,
                slot_mapping=slots,
                num_decodes=n_req,
                num_decode_tokens=t,
                num_prefills=0,
                prefill=None,
                decode=dec,
            )
        else:
            pre = MLACommonPrefillMetadata(
                block_table=block_table,
                query_start_loc=qsl,
                max_query_len=max_q,
                chunked_context=None,
                q_data_type=torch.float32,
                output_dtype=torch.float32,
                prefill_backend=lay.prefill_backend,
            )
            lay.prefill_backend.prepare_metadata(pre)
            m = MLACommonMetadata(
                num_reqs=n_req,
                max_query_len=max_q,
                max_seq_len=max(seq_lens),
                num_actual_tokens=t,
                query_start_loc=qsl,
                slot_mapping=slots,
                num_decodes=0,
                num_decode_tokens=0,
                num_prefills=n_req,
                prefill=pre,
                decode=None,
            )
        md[name] = m
        slot_map[name] = slots
    with set_forward_context(md, vcfg, num_tokens=t, slot_mapping=slot_map):
        return model(input_ids=ids, positions=pos)


def _next_tokens(model, hidden, rows, args, k, tp: int = 1) -> list[int]:
    """Each request's next token: greedy from vLLM's own logits of its last row in `hidden`
    (`rows`), or --decode-tokens (step k's entry, the same for every request) when given. Under
    TP the logits are gathered on rank 0 only (LogitsProcessor); its choices are broadcast to
    every rank so that all of them decode the same tokens."""
    if args.decode_tokens:
        ids = [int(x) for x in args.decode_tokens.split(",") if x.strip()]
        return [ids[k % len(ids)]] * len(rows)
    import torch

    logits = model.compute_logits(hidden[rows])
    if logits is not None:
        choice = logits.argmax(dim=-1).to(torch.long)
    else:
        choice = torch.full((len(rows),), -1, dtype=torch.long)
    if tp > 1:
        torch.distributed.broadcast(choice, src=0)
    return [int(x) for x in choice]


# =============================================================================================
# test
# =============================================================================================


def _mla_diff() -> Path:
    for c in (
        os.environ.get("MLA_DIFF"),
        ROOT / "target" / "release" / "mla-diff",
        ROOT / "target" / "debug" / "mla-diff",
        shutil.which("mla-diff"),
    ):
        if c and Path(c).is_file():
            return Path(c)
    raise SystemExit("no mla-diff binary: cargo build --release, pip install . (or set MLA_DIFF)")


def _reads_format2(exe: Path) -> bool:
    """Whether this mla-diff build knows format 2 (its reader carries the format string)."""
    return dump_format.FORMAT2.encode() in exe.read_bytes()


def _read_st(path: Path):
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})


def prefill_as_format1(src: Path, dst: Path) -> Path:
    """Step 0 of a format-2 dump as a format-1 dump (for an mla-diff that reads only format 1)."""
    t, meta = _read_st(src)
    h = json.loads(meta["header"])
    s0 = dump_format.step_tensor(0, "")
    out = {k[len(s0) :]: v for k, v in t.items() if k.startswith(s0)}
    c = h.get("conventions", {})
    m1 = {
        "engine": f"{h['engine']['name']} {h['engine']['version']}",
        "dtype": h.get("dtype", "f32"),
        "rope_order": c.get("rope_order", "interleaved"),
        "layout": c.get("layout", "token-major"),
        "kv_a_order": c.get("kv_a_order", "latent-rope"),
        "model": h["model"]["file"],
        "converted_from": f"{src.name} (format 2, step 0)",
    }
    return dump_format.write_format1(dst, out, m1)


def step_site(step: int, layer: int, stage: str) -> str:
    """`s{step}.L{layer}.{stage}`: a site's tensor in a format-2 dump."""
    return dump_format.step_tensor(step, dump_format.site(layer, stage))


def check_decode(path: Path) -> tuple[list[str], float]:
    """float64 check of every decode step's MQA sites from the dump's own inputs.

    For layer n and decode step k: the latent cache is [kv_c_normed | k_pe_roped] of steps 0..k;
    ql_nope = q_nope W_UK_T, scores = (ql_nope kv_c^T + q_pe k_pe^T) / sqrt(P+R) (no YaRN
    mscale: for the plain-RoPE fixtures), lse = logsumexp, attn_latent = softmax kv_c,
    attn_out = attn_latent W_UV. Returns one line per site: its worst rel_l2 over steps/layers.
    """
    import numpy as np

    t, meta = _read_st(path)
    h = json.loads(meta["header"])
    s0 = dump_format.step_tensor(0, "")
    layers = sorted(
        {p[0] for k in t if k.startswith(s0) for p in [dump_format.parse_site(k[len(s0) :])] if p is not None}
    )
    worst: dict[str, float] = {}

    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))

    for n in layers:
        wk = t[step_site(0, n, "w.W_UK_T")].astype(np.float64)  # [N, P, L]
        wv = t[step_site(0, n, "w.W_UV")].astype(np.float64)  # [N, L, V]
        P = wk.shape[1]
        for k in range(1, len(h["steps"])):
            g = lambda s, j=k: t[step_site(j, n, s)].astype(np.float64)  # noqa: E731, B023
            kv = np.concatenate([g("kv_c_normed", j) for j in range(k + 1)])  # [S, L]
            kp = np.concatenate([g("k_pe_roped", j) for j in range(k + 1)])  # [S, R]
            q, qpe = g("q"), g("q_pe_roped")
            R = qpe.shape[-1]
            ql = np.einsum("tnp,npl->tnl", q[..., :P], wk)
            sc = (np.einsum("tnl,sl->tns", ql, kv) + np.einsum("tnr,sr->tns", qpe, kp)) / np.sqrt(P + R)
            mx = sc.max(-1, keepdims=True)
            lse = mx[..., 0] + np.log(np.exp(sc - mx).sum(-1))
            lat = np.einsum("tns,sl->tnl", np.exp(sc - lse[..., None]), kv)
            ref = {
                "ql_nope": ql,
                "lse": lse,
                "attn_latent": lat,
                "attn_out": np.einsum("tnl,nlv->tnv", lat, wv),
            }
            for stage, r in ref.items():
                worst[stage] = max(worst.get(stage, 0.0), rel(g(stage), r))
    return [f"{s}: rel_l2 {v:.2e}" for s, v in worst.items()], max(worst.values()) if worst else 0.0


def merged_column_slice(gate, up, rank: int, tp: int):
    """Rank `rank`'s rows of a merged-column `gate_up_proj` built from `ffn_gate` and `ffn_up`
    ([I, H] each, PyTorch layout): `[gate rows r·I/tp..(r+1)·I/tp ; up rows r·I/tp..(r+1)·I/tp]`,
    [2·I/tp, H] (vLLM's MergedColumnParallelLinear of output sizes [I, I])."""
    import numpy as np

    i = gate.shape[0] // tp
    return np.concatenate([gate[rank * i : (rank + 1) * i], up[rank * i : (rank + 1) * i]])


def row_parallel_slice(down, rank: int, tp: int):
    """Rank `rank`'s columns of a row-parallel `down_proj` ([H, I]): `r·I/tp..(r+1)·I/tp`."""
    i = down.shape[1] // tp
    return down[:, rank * i : (rank + 1) * i]


def rel_l2(a, b) -> float:
    """‖a − b‖ / ‖b‖ in float64 (∞ for different shapes)."""
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return float("inf")
    return float(np.linalg.norm(a - b) / max(float(np.linalg.norm(b)), 1e-300))


def slice_table(weights: dict, gguf_tensors: dict, tp: int) -> list[dict]:
    """Which rank's slice each loaded FFN weight holds. `weights`: `L{n}.[shared_experts.]{param}
    .rank{r}` arrays ([out, in]); `gguf_tensors`: the GGUF's `blk.{n}.ffn_{gate,up,down}[_shexp]
    .weight` as [out, in] float arrays. One row per loaded gate_up_proj / down_proj shard: layer,
    param, rank, rel_l2 against every rank's expected slice (`vs`) and the rank it equals best."""
    rows = []
    for name in sorted(weights):
        parts = name.split(".")
        if not parts[0].startswith("L") or not parts[-1].startswith("rank"):
            continue
        n, rank, param = int(parts[0][1:]), int(parts[-1][4:]), ".".join(parts[1:-1])
        shexp = "_shexp" if param.startswith("shared_experts.") else ""
        base = param.rsplit(".", 1)[-1]
        g = lambda t: gguf_tensors.get(f"blk.{n}.ffn_{t}{shexp}.weight")  # noqa: E731, B023
        if base == "gate_up_proj" and g("gate") is not None and g("up") is not None:
            want = [merged_column_slice(g("gate"), g("up"), s, tp) for s in range(tp)]
        elif base == "down_proj" and g("down") is not None:
            want = [row_parallel_slice(g("down"), s, tp) for s in range(tp)]
        else:
            continue
        vs = [rel_l2(weights[name], w) for w in want]
        rows.append(
            {"layer": n, "param": param, "rank": rank, "vs": vs, "holds": min(range(tp), key=vs.__getitem__)}
        )
    return rows


def cmd_slices(args) -> int:
    """Print slice_table for a dump's loaded FFN weights against the GGUF (gguf-py dequantizes)."""
    if not _in_venv(args.venv):  # numpy and gguf
        with _venv_command(args.venv, sys.argv[1:]) as (argv, env):
            return subprocess.run(argv, env=env).returncode
    import gguf
    import numpy as np

    from . import st_io

    t, meta = st_io.load(args.dump)
    if meta.get("format") == dump_format.VLLM_WEIGHTS:  # a WEIGHTS file (--weights, --weights-only)
        tp, weights = int(meta.get("tp_size", "1")), t
    else:
        h = json.loads(meta.get("header", "{}"))
        tp = int((h.get("tp") or {}).get("size", 1))
        prefix = dump_format.weights_tensor("")
        weights = {k[len(prefix) :]: v for k, v in t.items() if k.startswith(prefix)}
    rd = gguf.GGUFReader(str(args.gguf))
    tensors = {}
    for x in rd.tensors:
        if ".ffn_" in x.name and "_exps" not in x.name and not x.name.endswith("_inp.weight"):
            a = gguf.quants.dequantize(np.array(x.data), x.tensor_type)
            tensors[x.name] = np.asarray(a, np.float64).reshape(tuple(int(d) for d in reversed(x.shape)))
    rows = slice_table(weights, tensors, tp)
    if not rows:
        print(f"{args.dump}: no loaded gate_up_proj/down_proj shard (.rank<r>) with its GGUF tensors")
        return 2
    wrong = 0
    for r in rows:
        vs = ", ".join(f"rank {s} {v:.3g}" for s, v in enumerate(r["vs"]))
        ok = r["holds"] == r["rank"] and r["vs"][r["rank"]] < 1e-6
        wrong += not ok
        print(
            f"L{r['layer']}.{r['param']}.rank{r['rank']}: holds rank {r['holds']}'s slice "
            f"({'ok' if ok else 'WRONG'}; rel_l2 vs {vs})"
        )
    print(f"{len(rows)} shards, {wrong} holding another rank's slice")
    return 1 if wrong else 0


def _show(text: str, n: int = 12) -> None:
    print("\n".join("  " + ln for ln in text.strip().splitlines()[-n:]))


def cmd_test(args) -> int:
    if not _in_venv(args.venv):  # numpy/safetensors for the checks
        with _venv_command(args.venv, sys.argv[1:]) as (argv, env):
            return subprocess.run(argv, env=env).returncode
    exe = _mla_diff()
    f2 = _reads_format2(exe)
    out_dir = Path(tempfile.mkdtemp(prefix="vllm-cpu-test-"))
    me = [sys.executable, "-m", MODULE]
    base = ["--venv", args.venv, "--tokens", args.tokens, "--decode-steps", str(args.decode_steps)]
    ok = True

    def harness(name, extra=(), tag=None):
        gguf_path = ROOT / "golden" / "models" / name
        dump = out_dir / (gguf_path.stem + (tag or ("-zeroed" if extra else "")) + ".safetensors")
        cmd = me + ["run", "--gguf", str(gguf_path), "--out", str(dump), *base, *extra]
        print("$ " + " ".join(cmd), flush=True)
        t0 = time.time()
        r = subprocess.run(cmd, capture_output=True, text=True)
        print(f"  harness exit {r.returncode} in {time.time() - t0:.1f} s")
        return gguf_path, dump, r

    def compare(gguf_path, dump, want_rc, want_text):
        judged = dump if f2 else prefill_as_format1(dump, dump.with_suffix(".f1.safetensors"))
        cmd = [str(exe), "compare", "--model", str(gguf_path), "--dump", str(judged)]
        print("$ " + " ".join(cmd) + ("" if f2 else "   (this mla-diff reads format 1: the prefill step)"))
        c = subprocess.run(cmd, capture_output=True, text=True)
        text = c.stdout + c.stderr
        _show(text)
        good = c.returncode == want_rc and want_text in text
        print(
            f"  {'ok' if good else 'FAIL'}: compare exit {c.returncode} (want {want_rc}, "
            f"output containing {want_text!r})"
        )
        return good

    # 1. fused attn_kv_b: loads, runs, passes
    g, d, r = harness("legacy-kvb-f32.gguf")
    _show(r.stdout, 4)
    if r.returncode != 0:
        _show(r.stderr)
        ok = False
    else:
        ok &= compare(g, d, 0, "within tolerance")
        if args.decode_steps:
            lines, worst = check_decode(d)
            good = worst < 1e-5
            print(
                f"  {'ok' if good else 'FAIL'}: decode steps' MQA sites vs float64 from the dump's "
                f"own inputs (bound 1e-5): " + "; ".join(lines)
            )
            ok &= good
    # 2. split attn_k_b/attn_v_b: the unmodified plugin never loads kv_b_proj; vLLM fails at load
    g, d, r = harness("tiny-v3-f32.gguf")
    err = r.stderr
    good = (
        r.returncode != 0
        and "never filled: model.layers.0.self_attn.kv_b_proj" in err
        and "size mismatch" in err
    )
    _show("\n".join(ln for ln in err.splitlines() if "never filled" in ln or "Error" in ln), 3)
    print(
        f"  {'ok' if good else 'FAIL'}: vLLM fails in process_weights_after_loading, "
        "kv_b_proj named as never loaded"
    )
    ok &= good
    # 3. the same with the never-loaded weight zeroed: runs, and compare fails at w.kv_b
    g, d, r = harness("tiny-v3-f32.gguf", ["--zero-unloaded"])
    if r.returncode != 0:
        _show(r.stderr)
        ok = False
    else:
        ok &= compare(g, d, 1, "L0.w.kv_b")
    import gguf
    import numpy as np

    # 4. Q8_0 at TP 2: every rank keeps rank 0's gate_up_proj rows (vllm-gguf-plugin 0.0.5), and
    #    each rank its own with the fix patch; the attention's quantized weights load right
    for tag, extra in (
        ("-tp2", ["--tp", "2"]),
        ("-tp2-fixed", ["--tp", "2", "--patch", FIX_MERGED_COLUMN_RANK[0]]),
    ):
        g, d, r = harness("legacy-kvb-q8_0.gguf", extra, tag)
        if r.returncode != 0:
            _show(r.stdout + r.stderr)
            ok = False
            continue
        t, meta = _read_st(d)
        h = json.loads(meta["header"])
        tens = {}
        for x in gguf.GGUFReader(str(g)).tensors:
            if ".ffn_" in x.name:
                a = gguf.quants.dequantize(np.array(x.data), x.tensor_type)
                tens[x.name] = np.asarray(a, np.float64).reshape(tuple(int(n) for n in reversed(x.shape)))
        prefix = dump_format.weights_tensor("")
        rows = slice_table({k[len(prefix) :]: v for k, v in t.items() if k.startswith(prefix)}, tens, 2)
        held = {(row["layer"], row["param"], row["rank"]): row["holds"] for row in rows}
        fixed = "fixed" in tag
        want = {k: (k[2] if fixed or k[1] != "gate_up_proj" else 0) for k in held}
        good = bool(held) and held == want and h["tp"]["size"] == 2
        print(
            f"  {'ok' if good else 'FAIL'}: loaded FFN shards hold the slices of ranks {held} "
            f"(want {'each its own' if fixed else 'gate_up_proj: rank 0 everywhere'})"
        )
        ok &= good
        ok &= compare(g, d, 0 if fixed else 1, "within tolerance" if fixed else "L0.")
    # 5. the block-FP8 checkpoint golden/hf-v3-fp8 loaded by vLLM itself (--model): every loaded
    #    weight equals the checkpoint's dequantization in both compute modes, both pass compare,
    #    and fp8-scale-transposed's relaid o_proj scales are named by weights --check
    fp8 = ROOT / "golden" / "hf-v3-fp8"
    for mode in FP8_MODES:
        dump = out_dir / f"hf-v3-fp8.{mode}.safetensors"
        wfile = out_dir / f"hf-v3-fp8.{mode}.weights.safetensors"
        cmd = me + ["run", "--model", str(fp8), "--fp8-compute", mode, "--out", str(dump)]
        cmd += ["--weights", str(wfile), "--layers", "0", *base]
        print("$ " + " ".join(cmd), flush=True)
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            _show(r.stdout + r.stderr)
            ok = False
            continue
        w = subprocess.run(
            [str(exe), "weights", "--model", str(fp8), "--check", str(wfile)], capture_output=True, text=True
        )
        good = w.returncode == 0 and "all 10 tensors match" in w.stdout
        print(f"  {'ok' if good else 'FAIL'}: weights --check exit {w.returncode} (want 0, all 10 tensors)")
        ok &= good
        # w8a8-block declares its activation quantization (act_quant), which the reference applies
        ok &= compare(fp8, dump, 0, "within tolerance")
    planted = out_dir / "hf-v3-fp8.fp8-scale-transposed.weights.safetensors"
    cmd = me + ["run", "--model", str(fp8), "--out", str(planted), "--weights-only", "--layers", "0"]
    cmd += ["--plant", "fp8-scale-transposed", *base]
    print("$ " + " ".join(cmd), flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True)
    w = subprocess.run(
        [str(exe), "weights", "--model", str(fp8), "--check", str(planted)], capture_output=True, text=True
    )
    good = r.returncode == 0 and w.returncode == 1 and "quant-scale-layout at L0.o_proj" in w.stdout
    _show("\n".join(ln for ln in w.stdout.splitlines() if ln.startswith("finding")), 2)
    want = "want 1, quant-scale-layout at L0.o_proj"
    print(f"  {'ok' if good else 'FAIL'}: weights --check exit {w.returncode} ({want})")
    ok &= good
    if args.keep:
        print(f"dumps kept in {out_dir}")
    else:
        shutil.rmtree(out_dir, ignore_errors=True)
    print("all passed" if ok else "FAILED")
    return 0 if ok else 1


# =============================================================================================


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("setup", help="create the venv with the pinned vLLM")
    s.add_argument("--venv", required=True)
    c = sub.add_parser("config", help="write config.json derived from a GGUF")
    c.add_argument("--gguf", required=True)
    c.add_argument("--out", required=True, help="folder for config.json")
    c.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="torch_dtype written into config.json (default float32)",
    )
    for name in ("run", "_inner", "_rank"):
        r = sub.add_parser(name, help="run vLLM on the CPU and dump" if name == "run" else argparse.SUPPRESS)
        r.add_argument("--venv", default=os.environ.get("MLA_VLLM_VENV", str(ROOT / ".venv-vllm")))
        r.add_argument("--gguf", default=None, help="the GGUF file, loaded through vllm-gguf-plugin")
        r.add_argument(
            "--model",
            default=None,
            help="a Hugging Face checkpoint folder (config.json, safetensors) that vLLM loads itself, "
            "instead of --gguf; a block-FP8 one (DeepSeek-V3's fp8) runs through the fp8_cpu stand-ins",
        )
        r.add_argument(
            "--fp8-compute",
            default=None,
            choices=FP8_MODES,
            help="--model with a block-FP8 checkpoint: w8a8-block (default) quantizes every GEMM input "
            "per token in groups of 128 as vLLM's GPU path does; weight-only leaves activations "
            "unquantized (recorded in engine.quantization.compute and the patches)",
        )
        r.add_argument(
            "--config-dir",
            default=None,
            help="folder with the HF config.json (default: derived from the GGUF's metadata)",
        )
        r.add_argument("--tokens", default=None, help="one request's prompt token ids, comma-separated")
        r.add_argument(
            "--prompts",
            default=None,
            help="several requests' prompts, ';'-separated lists of comma-separated token ids: all "
            "prefilled in one step, then decoded together (instead of --tokens)",
        )
        r.add_argument(
            "--block-size",
            type=int,
            default=16,
            help="tokens per KV-cache block (a multiple of 16; default 16)",
        )
        r.add_argument(
            "--kv-split-work",
            type=int,
            default=0,
            help="Triton MLA's work per KV split (vLLM: 512) and an H200's SM count for the split rule, "
            "recorded as the patch kv-split-rule (default: vLLM's rule as it runs on this CPU)",
        )
        r.add_argument(
            "--plant",
            action="append",
            default=[],
            help="apply a planted bug, NAME or NAME:key=value,... (repeatable; mla_diff_hooks.plants, "
            "recorded in the dump's patches as plant:NAME)",
        )
        r.add_argument(
            "--prefill-sites",
            default=None,
            help="comma-separated activation stages the prefill step keeps (default: all); e.g. "
            "hidden_in,kv_c_normed,k_pe_roped for a long context the decode steps read",
        )
        r.add_argument(
            "--weight-sites",
            default=None,
            help="comma-separated weight sites the dump keeps, e.g. w.kv_b,w.W_UK_T,w.W_UV, or none "
            "(default: all four, w.fused_qkv_a, w.kv_b, w.W_UK_T, w.W_UV)",
        )
        r.add_argument(
            "--chunk-tokens",
            type=int,
            default=0,
            help="schedule the prompts in steps of at most N new tokens per request (vLLM's "
            "long_prefill_token_threshold); default: each prompt in one step",
        )
        r.add_argument(
            "--arrivals",
            default=None,
            help="comma-separated step at which each request arrives (default: all at step 0)",
        )
        r.add_argument(
            "--prefix",
            default=None,
            help="I=J:N[;...]: request I's first N tokens (full blocks, equal to request J's) are a "
            "prefix-cache hit on request J (recorded as the patch prefix-cache-hit-by-hand)",
        )
        r.add_argument(
            "--workspace-tokens",
            type=int,
            default=0,
            help="vLLM's chunked-prefill workspace in tokens (recorded as chunked-prefill-workspace): "
            "a cached context is read in chunks of W // (prefills with context), block-aligned",
        )
        r.add_argument(
            "--sites",
            default=None,
            help="a scheduled run: comma-separated stages every step keeps (default: all), e.g. "
            "hidden_in,ctx_out,ctx_lse,suffix_out,suffix_lse,attn_out for a smaller dump",
        )
        r.add_argument(
            "--record-from",
            type=int,
            default=0,
            help="a scheduled run: record from forward K on (MLA_DIFF_VLLM_STEPS=K:...); the "
            "positions computed before it are rebuilt by mla-diff from the token ids (unrecorded)",
        )
        r.add_argument(
            "--heads",
            default=None,
            help="a scheduled run: A:B keeps only heads A..B of the per-head sites (MLA_DIFF_VLLM_HEADS)",
        )
        r.add_argument("--decode-steps", type=int, default=0)
        r.add_argument(
            "--decode-tokens",
            default=None,
            help="token ids fed to the decode steps (default: greedy from vLLM's logits)",
        )
        r.add_argument("--out", required=True, help="dump to write (the prefill step)")
        r.add_argument(
            "--weights",
            default=None,
            help="also write vLLM's loaded weights as a WEIGHTS file (per rank at TP > 1)",
        )
        r.add_argument(
            "--weights-keep",
            default=None,
            help="comma-separated params the WEIGHTS file (--weights, --weights-only) keeps, e.g. "
            "o_proj,fused_qkv_a_proj (default: all); recorded in its metadata as `kept`",
        )
        r.add_argument(
            "--tp",
            type=int,
            default=1,
            help="tensor-parallel size: one process per rank over gloo, ~0.9 GiB each (default 1)",
        )
        r.add_argument(
            "--patch",
            action="append",
            choices=sorted(OPTIONAL_PATCHES),
            default=[],
            help="apply an opt-in patch, recorded in the dump (repeatable): fix-merged-column-rank = "
            "vllm-gguf-plugin PR #106 (every rank loads its own merged-column shard)",
        )
        r.add_argument(
            "--threads", type=int, default=0, help="torch threads per rank (default: CPUs / tp, at least 1)"
        )
        r.add_argument(
            "--rank-dir",
            default=None,
            help="--tp > 1: write the ranks' own dumps (and logs) there and keep them "
            "(default: a temporary folder, removed after the join)",
        )
        r.add_argument(
            "--layers",
            default=None,
            help="comma-separated decoder layers to record (default: all); fewer layers, smaller dump",
        )
        r.add_argument(
            "--weights-only",
            action="store_true",
            help="load the model and write only vLLM's loaded weights to --out (a WEIGHTS file, every "
            "rank's joined; for `mla-diff weights --check`), with no forward",
        )
        if name == "_rank":
            r.add_argument("--rank", type=int, required=True)
            r.add_argument("--port", type=int, required=True)
        r.add_argument(
            "--no-weights",
            action="store_true",
            help="format 2: leave vLLM's loaded weights (weights.*) out of the dump (the w.* sites stay)",
        )
        r.add_argument(
            "--format",
            type=int,
            choices=(1, 2),
            default=2,
            help="2 (default): one file with every step, model identity and patches "
            "(docs/dump-format.md, format 2); 1: the prefill step in format 1, decode "
            "step k in <out stem>.decode{k}.safetensors",
        )
        r.add_argument(
            "--zero-unloaded",
            action="store_true",
            help="give linear layers the GGUF loader never filled an all-zero weight "
            "(recorded as a patch) instead of letting vLLM fail at load",
        )
    sl = sub.add_parser("slices", help="which TP rank's slice each loaded FFN weight of a dump holds")
    sl.add_argument("--venv", default=os.environ.get("MLA_VLLM_VENV", str(ROOT / ".venv-vllm")))
    sl.add_argument("--gguf", required=True)
    sl.add_argument("--dump", required=True, help="a format-2 dump with weights.*, or a WEIGHTS file")
    t = sub.add_parser("test", help="end-to-end test on real vLLM (run by hand; CI has no vLLM)")
    t.add_argument("--venv", default=os.environ.get("MLA_VLLM_VENV", str(ROOT / ".venv-vllm")))
    t.add_argument("--tokens", default="1,7,42,99,3,250,17,8")
    t.add_argument("--decode-steps", type=int, default=2)
    t.add_argument("--keep", action="store_true", help="keep the dumps")
    args = ap.parse_args()
    if args.cmd == "setup":
        return cmd_setup(args)
    if args.cmd == "config":
        return cmd_config(args)
    if args.cmd == "run":
        return cmd_run(args)
    if args.cmd in ("_inner", "_rank"):
        return inner_run(args)
    if args.cmd == "slices":
        return cmd_slices(args)
    return cmd_test(args)


# ---------------------------------------------------------------------------------------------
# scheduled runs: chunked prefill over cached context, prefix-cache hits, mixed batches
# ---------------------------------------------------------------------------------------------

# Recorded instead of attention-metadata-by-hand when a run is scheduled (--chunk-tokens,
# --arrivals, --prefix or --workspace-tokens).
SCHEDULE_PATCHES = [
    (
        "attention-metadata-builder",
        "the GPU model runner builds each step's attention metadata: here vLLM's own "
        "TritonMLAMetadataBuilder.build runs on a CommonAttentionMetadata filled as the runner fills "
        "it, the step's requests packed decodes first (query length <= the builder's "
        "reorder_batch_threshold, 1), then prefills with cached context, then prefills without",
    ),
    (
        "mla-head-size",
        "MLACommonMetadata (what the builder returns) accepts only the head sizes of vLLM's GPU MLA "
        "kernels (L+R = 576); the fixtures' smaller L+R run on the CPU kernels, so any size is accepted",
    ),
    (
        "pinned-host-memory",
        "build_mla_chunked_context_metadata allocates its chunk tables with torch.empty/zeros("
        "pin_memory=True), which needs a GPU driver: allocated unpinned (the same values)",
    ),
    (
        "context-gather",
        "MLA's chunked-context gather vllm._custom_ops.gather_and_maybe_dequant_cache is a CUDA op: "
        "a torch equivalent copies each context token's cached [kv_c_normed | k_pe] row (block "
        "block_table[req, pos // block_size], offset pos % block_size, pos = seq_starts[req] + its "
        "index in the chunk) into the workspace at cu_seq_lens[req] + index (kv_cache_dtype auto)",
    ),
    (
        "sdpa-context-chunk",
        "the SDPA prefill backend's run_prefill_context_chunk: each prefill request's queries attend "
        "(not causally) to its keys of the chunk (cu_seq_lens), LSE natural log [N, Tp]; a request "
        "whose chunk is empty keeps what torch.empty handed out, LSE -inf (as FlashAttention leaves "
        "it; vLLM's mask_empty_context then zeroes it)",
    ),
]


def scheduler_patch(chunk: int, arrivals: list[int], decode_steps: int) -> tuple[str, str]:
    """The patch recording how the harness schedules a run (no vLLM Scheduler runs here)."""
    cap = f"min({chunk}, what is left of its prompt)" if chunk else "its whole prompt"
    return (
        "scheduler-by-hand",
        f"no vLLM scheduler: from its arrival step ({','.join(map(str, arrivals))}) each request gets "
        f"{cap} new tokens a step (vLLM's long_prefill_token_threshold), then one greedy decode token "
        f"a step for {decode_steps} step(s) (a request whose prompt ended decodes next to the others' "
        "prefill chunks); every request is in every step, with 0 new tokens before its arrival and "
        "after its last decode",
    )


def workspace_patch(tokens: int) -> tuple[str, str]:
    return (
        "chunked-prefill-workspace",
        f"MLACommonMetadataBuilder.determine_chunked_prefill_workspace_size returns {tokens} instead "
        "of max(8 x max_model_len, 4 x max_num_seqs x block_size) capped at 64 Ki tokens, so a cached "
        f"context is read in chunks of {tokens} // (prefills with context) tokens rounded down to the "
        "block size (vLLM's max_context_chunk)",
    )


PREFIX_HIT = (
    "prefix-cache-hit-by-hand",
    "no KVCacheManager: a prefix-cache hit of n tokens (full blocks of an earlier request with "
    "the same token ids) is set up as the manager sets it: the request's block table starts with "
    "the earlier request's first n / block_size blocks and its first step starts at position n "
    "(num_computed_tokens = n), so its prefill reads those positions from the cache as context",
)


def parse_prefix(text: str | None, n_req: int) -> dict[int, tuple[int, int]]:
    """--prefix `I=J:N[;...]`: request I's first N tokens are a prefix-cache hit on request J.
    Errors: SystemExit for a malformed entry or a request index out of range."""
    out: dict[int, tuple[int, int]] = {}
    for part in filter(None, (x.strip() for x in (text or "").split(";"))):
        try:
            i, rest = part.split("=")
            j, n = rest.split(":")
            i, j, n = int(i), int(j), int(n)
        except ValueError:
            raise SystemExit(
                f"--prefix {part!r}: I=J:N (request I reuses request J's first N tokens)"
            ) from None
        if not (0 <= i < n_req and 0 <= j < n_req) or i == j or n <= 0:
            raise SystemExit(f"--prefix {part!r}: requests 0..{n_req - 1}, I != J, N > 0")
        out[i] = (j, n)
    return out


def _apply_schedule_patches(workspace_tokens: int) -> None:
    """pinned-host-memory, context-gather and (with workspace_tokens) chunked-prefill-workspace."""
    import torch
    import vllm._custom_ops as ops
    import vllm.model_executor.layers.attention.mla_attention as mla_mod

    class Unpinned:
        """mla_attention's `torch`, whose empty/zeros drop pin_memory (no driver to pin with)."""

        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def empty(*a, pin_memory=False, **kw):
            return torch.empty(*a, **kw)

        @staticmethod
        def zeros(*a, pin_memory=False, **kw):
            return torch.zeros(*a, **kw)

    mla_mod.torch = Unpinned()

    def gather_and_maybe_dequant_cache(
        src_cache,
        dst,
        block_table,
        cu_seq_lens,
        token_to_seq,
        num_tokens,
        kv_cache_dtype,
        scale,
        seq_starts=None,
    ):
        if kv_cache_dtype not in ("auto", None):
            raise NotImplementedError(f"context-gather: kv_cache_dtype {kv_cache_dtype}")
        n = int(num_tokens)
        if n == 0:
            return
        seq = token_to_seq[:n].long()
        idx = torch.arange(n) - cu_seq_lens.long()[seq]
        pos = idx + (seq_starts.long()[seq] if seq_starts is not None else 0)
        bs = src_cache.shape[1]
        blocks = block_table.long()[seq, pos // bs]
        dst[:n] = src_cache[blocks, pos % bs].to(dst.dtype)

    ops.gather_and_maybe_dequant_cache = gather_and_maybe_dequant_cache
    # mla-head-size
    mla_mod.MLACommonBackend.supports_head_size = classmethod(lambda cls, size: size > 0)
    if workspace_tokens:
        mla_mod.MLACommonMetadataBuilder.determine_chunked_prefill_workspace_size = staticmethod(
            lambda vllm_config: workspace_tokens
        )


def runner_order(new: list[int], contexts: list[int], threshold: int = 1) -> list[int]:
    """The order the runner packs a step's requests (those with new > 0): decodes (new <=
    threshold), then prefills with cached context, then prefills without, each in request
    order (vLLM reorders a batch so; MLACommonMetadataBuilder counts the first num_decodes as
    decodes and merges context only into the first prefills)."""
    live = [i for i, n in enumerate(new) if n > 0]
    dec = [i for i in live if new[i] <= threshold]
    ext = [i for i in live if new[i] > threshold and contexts[i] > 0]
    pre = [i for i in live if new[i] > threshold and contexts[i] == 0]
    return dec + ext + pre


def plan_schedule(prompts: list[list[int]], chunk: int, arrivals: list[int], prefix: dict) -> list[dict]:
    """The prefill part of a scheduled run: per step, each request's (start, count) of prompt
    tokens, until every prompt is computed. A prefix hit (i -> (j, n)) starts request i at n."""
    done = [prefix[i][1] if i in prefix else 0 for i in range(len(prompts))]
    steps = []
    k = 0
    while any(d < len(p) for d, p in zip(done, prompts)):
        step = []
        for i, p in enumerate(prompts):
            if k < arrivals[i] or done[i] >= len(p):
                step.append(None)
                continue
            take = len(p) - done[i] if not chunk else min(chunk, len(p) - done[i])
            step.append((done[i], take))
            done[i] += take
        steps.append(step)
        k += 1
    return steps


def _scheduled_steps(model, vcfg, layers, builder, prompts, args, pool, prefix, tp: int):
    """Run the schedule: per step the requests' new tokens, the attention metadata from vLLM's
    builder over the runner's order, the hooks told the step's plan. Returns
    (per-request decoded tokens, per-request full token ids, steps run)."""
    import torch
    from vllm.forward_context import set_forward_context
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from . import vllm as dump_vllm

    n_req = len(prompts)
    arrivals = args.arrival_list
    prefill_plan = plan_schedule(prompts, args.chunk_tokens, arrivals, prefix)
    seqs = [list(p) for p in prompts]
    computed = [0] * n_req  # positions computed or cached (prefix hits included)
    decoded: list[list[int]] = [[] for _ in prompts]
    pending: dict[int, int] = {}  # request -> its next (decode) token
    k = 0
    while True:
        pre = prefill_plan[k] if k < len(prefill_plan) else [None] * n_req
        new_ids: list[list[int]] = []
        contexts = list(computed)
        hits: dict[int, dict] = {}
        for i in range(n_req):
            if pre[i] is not None:
                a, b = pre[i]
                if i in prefix and computed[i] == 0:
                    j, n = prefix[i]
                    contexts[i] = n
                    hits[i] = {"seq": j, "len": n}
                new_ids.append(prompts[i][a : a + b])
            elif i in pending:
                new_ids.append([pending.pop(i)])
            else:
                new_ids.append([])
        if not any(new_ids):
            break
        for i in range(n_req):
            if i in prefix and (i in hits or computed[i] > 0):
                hits[i] = {"seq": prefix[i][0], "len": prefix[i][1]}
        new = [len(x) for x in new_ids]
        order = runner_order(new, contexts)
        for i in order:
            if i in prefix and computed[i] == 0:
                pool.share(i, prefix[i][0], prefix[i][1])
            pool.grow(i, contexts[i] + new[i])
        table = pool.table()
        cap = dump_vllm._ACTIVE
        if cap is not None:
            cap.plan_step(
                {
                    "seqs": [
                        {
                            "new": new[i],
                            "context": contexts[i] if new[i] else computed[i],
                            "prefix": hits.get(i),
                        }
                        for i in range(n_req)
                    ],
                    "order": order,
                    "block_table": table.numpy(),
                    "name": f"step-{k}",
                }
            )
        ids = torch.tensor([x for i in order for x in new_ids[i]], dtype=torch.long)
        pos = torch.tensor([contexts[i] + r for i in order for r in range(new[i])], dtype=torch.long)
        slots = torch.tensor(
            [pool.slot(i, contexts[i] + r) for i in order for r in range(new[i])], dtype=torch.long
        )
        qsl = torch.tensor([0, *itertools.accumulate(new[i] for i in order)], dtype=torch.int32)
        seq_lens = torch.tensor([contexts[i] + new[i] for i in order], dtype=torch.int32)
        cm = CommonAttentionMetadata(
            query_start_loc=qsl,
            query_start_loc_cpu=qsl.clone(),
            seq_lens=seq_lens,
            num_reqs=len(order),
            num_actual_tokens=int(qsl[-1]),
            max_query_len=max(new),
            max_seq_len=int(seq_lens.max()),
            block_table_tensor=table[order],
            slot_mapping=slots,
            positions=pos,
            seq_lens_cpu_upper_bound=seq_lens.clone(),
        )
        md = builder.build(0, cm)
        with set_forward_context(
            dict.fromkeys(layers, md),
            vcfg,
            num_tokens=int(qsl[-1]),
            slot_mapping=dict.fromkeys(layers, slots),
        ):
            h = model(input_ids=ids, positions=pos)
        # next tokens: each request whose prompt is done (and decode budget left), from its last row
        last_rows, who = [], []
        for i in range(n_req):
            computed[i] = contexts[i] + new[i] if new[i] else computed[i]
            if new[i] and computed[i] >= len(prompts[i]) and len(decoded[i]) < args.decode_steps:
                off = int(qsl[order.index(i)]) + new[i] - 1
                last_rows.append(off)
                who.append(i)
        if who:
            nxt = _next_tokens(model, h, last_rows, args, len(decoded[who[0]]), tp)
            for i, tok in zip(who, nxt):
                decoded[i].append(tok)
                seqs[i].append(tok)
                pending[i] = tok
        k += 1
    # a decode token never fed (its request's budget ended) is not part of the sequence
    for i in range(n_req):
        if i in pending:
            seqs[i].pop()
            decoded[i].pop()
    return decoded, seqs, k


def scheduled(args) -> bool:
    """Whether the run is scheduled over several steps (a prompt in chunks, a late arrival, a
    prefix hit, or a context read in chunks) rather than every prompt prefilled in one step."""
    return bool(
        getattr(args, "chunk_tokens", 0)
        or getattr(args, "arrivals", None)
        or getattr(args, "prefix", None)
        or getattr(args, "workspace_tokens", 0)
    )


def _rank_run_scheduled(
    args, prompts, gguf_path, model, vcfg, layers, pool, extra_patches, zeroed, planted, out, t_load
):
    """A scheduled run at TP 1 (_scheduled_steps), its dump written with the step plans, the
    requests' token ids and the patches that set it up."""
    import torch
    import vllm
    from vllm.config import set_current_vllm_config

    from . import vllm as dump_vllm

    if args.tp != 1:
        raise SystemExit("a scheduled run (--chunk-tokens, --arrivals, --prefix, --workspace-tokens) is TP 1")
    if args.format != 2:
        raise SystemExit("a scheduled run writes format 2")
    n_req = len(prompts)
    args.arrival_list = [int(x) for x in args.arrivals.split(",")] if args.arrivals else [0] * n_req
    if len(args.arrival_list) != n_req or min(args.arrival_list) < 0:
        raise SystemExit(f"--arrivals: one step index >= 0 per request ({n_req})")
    prefix = parse_prefix(args.prefix, n_req)
    for i, (j, n) in prefix.items():
        if prompts[i][:n] != prompts[j][:n] or len(prompts[i]) <= n:
            raise SystemExit(
                f"--prefix {i}={j}:{n}: request {i} must start with request {j}'s first {n} tokens and go on"
            )
        if args.arrival_list[i] <= args.arrival_list[j]:
            raise SystemExit(
                f"--prefix {i}={j}:{n}: request {i} must arrive after request {j} has cached them"
            )
    lay0 = next(iter(layers.values()))
    with set_current_vllm_config(vcfg):
        builder = lay0.attn_backend.get_builder_cls()(
            lay0.get_kv_cache_spec(vcfg), list(layers), vcfg, torch.device("cpu")
        )
    if dump_vllm._ACTIVE is None or dump_vllm._ACTIVE.root is not dump_vllm.find_model(model):
        raise SystemExit(
            "the mla_diff_hooks vLLM plugin did not arm the model: vllm.general_plugins has no "
            "mla_diff_hooks entry point on sys.path (or VLLM_PLUGINS leaves it out)"
        )
    dump_vllm._ACTIVE.engine = f"vllm {vllm.__version__} ({HARNESS}, CPU)"
    print("armed through vllm.general_plugins (mla_diff_hooks.vllm_plugin)")
    t0 = time.time()
    with set_current_vllm_config(vcfg), torch.no_grad():
        decoded, seqs, n_steps = _scheduled_steps(
            model, vcfg, layers, builder, prompts, args, pool, prefix, args.tp
        )
    t_end = time.time()
    cap = dump_vllm._ACTIVE
    cap.token_ids = dict(enumerate(seqs))
    patches = run_patches(args, zeroed)
    patches = [x for x in patches if x[0] != "attention-metadata-by-hand"] + SCHEDULE_PATCHES
    patches.append(scheduler_patch(args.chunk_tokens, args.arrival_list, args.decode_steps))
    if args.workspace_tokens:
        patches.append(workspace_patch(args.workspace_tokens))
    if prefix:
        patches.append(PREFIX_HIT)
    patches += extra_patches + planted
    engine = {
        "name": "vllm",
        "version": vllm.__version__,
        "attention_backend": "TRITON_MLA",
        "prefill_backend": f"TORCH_SDPA_CPU ({HARNESS}, MLAPrefillBackendEnum.CUSTOM)",
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    res = dump_vllm.finish(
        model,
        dump_path=str(out),
        model_path=str(gguf_path),
        engine_info=engine,
        patches=patches,
        weight_sites=prefill_keep(None, args.weight_sites)[1],
        weights=not args.no_weights,
        weights_path=args.weights,
        extra_meta={
            "harness": HARNESS,
            "loader": loader_name(args),
            "triton": "TRITON_INTERPRET=1 " + _dist_version("triton"),
        },
    )
    shown = "; ".join(f"{len(t)} prompt tokens, decode {d}" for t, d in zip(prompts, decoded))
    print(f"{n_req} request(s) in {n_steps} step(s): {shown}")
    print(f"block tables: {pool.describe()}")
    print(f"{n_steps} steps {t_end - t0:.1f} s")
    print(f"wrote {res['dump']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
