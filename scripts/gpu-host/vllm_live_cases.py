#!/usr/bin/env python3
"""The live engine's bug-prone scheduling paths on a GPU, one vLLM process per backend.

Why: a one-request, one-step run never reaches the code where MLA bugs have lived: vLLM's
chunked prefill over cached context (per-chunk attention, then `merge_attn_states`), a
prefix-cache hit, and steps that mix decode rows with prefill chunks. This script runs vLLM's
offline engine (`vllm.LLM`, in-process: `VLLM_ENABLE_V1_MULTIPROCESSING=0`) once on the given
attention backend and records three cases with `mla_diff_hooks.vllm` (armed and finished per
case through `apply_model`, the GPU model runner's `execute_model` watched so each forward is
planned from the scheduler's own output), then judges each dump with `mla-diff compare`:

- `chunked`: two prompts (960 and 840 tokens) prefilled in the same six steps, 160 and 140 tokens
  a step (`long_prefill_token_threshold` 160 within a budget of 300 tokens), then decode steps;
  vLLM's chunked-prefill workspace is set to `--workspace` tokens (recorded as the patch
  `chunked-prefill-workspace`) so that later steps read their cached context in chunks of 128
  tokens, up to 7, the shorter request's last one empty where the longer needs one more; the
  dump holds the last prefill step and the decode steps (RECORD), the positions before them
  rebuilt by mla-diff from the requests' token ids;
- `prefix`: a request of 286 tokens, then one sharing its first 256 (four full 64-token pages)
  whose prefill reads them from the prefix cache;
- `batch`: requests of 1, 63, 65 and 300 tokens in one call, so decode rows share steps with the
  long prompt's prefill chunks; it also times the same shapes without hooks (the hooks' cost).

With `--plant NAME` a bug of mla_diff_hooks.plants is planted in vLLM's code before the engine
starts and only the chunked case runs (the plant recorded in the dump's patches as plant:NAME):
the exit status is then 0 when compare finds it (exit 1).

The model may be a Hugging Face checkpoint folder (config.json and safetensors shards, e.g.
golden/hf-v3-fp8) instead of a GGUF: vLLM loads it itself (no GGUF plugin, no --config), the
quantization is read from config.json's `quantization_config`, and for an `fp8` checkpoint the
runner sets VLLM_USE_DEEP_GEMM=0 before vLLM is imported (recorded as the patch `no-deep-gemm`:
vLLM then runs Fp8LinearMethod through CutlassFp8BlockScaledMMKernel on sm90, without DeepGEMM's
minutes of warm-up and JIT). The dump's header names the folder (docs/dump-format.md,
`model.format` hf-safetensors) and what the quantized layers ran (`engine.quantization`). With
`--weights` each dump also holds the loaded weights (`weights.*`, dequantized to float32 by
mla_diff_hooks.vllm.dequant_weight) and a WEIGHTS file is written beside it
(<dump>.weights.safetensors), which `mla-diff weights --check` judges too. The `single` case is
one prompt (`--tokens`, 20 ids by default) prefilled in one step, then 3 decode steps, every
step recorded. `--plant fp8-scale-transposed` (an fp8 checkpoint) fails the run when no layer
met it.

Usage (from the repository root, vLLM 0.26.0 importable, e.g. after
scripts/gpu-host/vllm_live_gpu.sh install with PYTHONPATH=$STAGE/site:python):

    MLA_DIFF_BIN=target/release/mla-diff python3 scripts/gpu-host/vllm_live_cases.py FLASHMLA OUTDIR

writes OUTDIR/fa3-v3-bf16.<backend>.<case>.safetensors (layer 0, the stages of SITES, the heads
and forwards of RECORD; `<backend>-kv-<dtype>` with a `--kv-cache-dtype` other than auto) and
prints, per case, the generate time, tokens/s and the compare verdict. Exit 0 when every compare
exits 0. Options: --model/--config (default golden/models/fa3-v3-bf16.gguf and its folder
fa3-v3, the fixture whose head dims FlashMLA accepts), --workspace (default 256 tokens; 0 keeps
vLLM's own size), --heads A:B and --steps N (what each case records; a plant recorded with every
head, so that a view across heads can be replayed, fits 2 MB as `--heads 0:4 --steps 1
--workspace 0`: the last prefill step, its context in one chunk).
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import time
from pathlib import Path

# The stages every step keeps: the layer's input and output, the fused q_a/kv_a projection's
# input and outputs (where an fp8 GEMM's input quantization shows first), the latent cache's
# rows, the absorbed decode's sites, the per-chunk partials of a prefill over cached context,
# and o_proj.
SITES = [
    "hidden_in",
    "attn_in",
    "q_c",
    "kv_a",
    "kv_c_normed",
    "k_pe_roped",
    "q_pe_roped",
    "ql_nope",
    "attn_latent",
    "lse",
    "ctx_out",
    "ctx_lse",
    "suffix_out",
    "suffix_lse",
    "attn_out",
    "o_proj",
    "hidden_out",
]


# What each case records: the forwards from `first` on (None: all), `steps` of them at most, the
# heads kept in the per-head sites (a dump stays under 2 MB: the fixture's 4 heads over 1,800
# rows of context partials would be 30 MB), the stages (None: SITES).
RECORD = {
    # the last prefill step (contexts 800 and 700: 7 context chunks of 128, the shorter
    # request's last one empty) and the decode steps; the positions before it are rebuilt by
    # mla-diff from the token ids
    "chunked": {"first": 5, "steps": 4, "heads": (0, 1)},
    "prefix": {"first": 0, "steps": 64, "heads": (0, 1)},
    "batch": {"first": 0, "steps": 64, "heads": (0, 1)},
    # one short prompt: its prefill and 3 decode steps, every head (the fixtures have 4)
    "single": {"first": 0, "steps": 4, "heads": None},
}
# the single case's prompt (ids below every fixture's vocabulary of 128)
SINGLE_TOKENS = "3,17,42,5,99,23,7,64,11,80,2,31,58,9,120,44,6,73,15,27"
# the stages a plant dump keeps: the layer input, the partials and the merge (the chunk loop's
# bugs are judged on the partials the reference computes from the layer input; the latent cache's
# rows would add a third to each dump)
PLANT_SITES = [
    "hidden_in",
    "ctx_out",
    "ctx_lse",
    "suffix_out",
    "suffix_lse",
    "attn_out",
]


def hf_quantization(model: str) -> str | None:
    """The `quant_method` of a Hugging Face checkpoint folder's config.json `quantization_config`
    (`fp8` for DeepSeek-V3's block FP8), None for an unquantized folder or a GGUF file."""
    import json

    cfg = Path(model) / "config.json"
    if not Path(model).is_dir() or not cfg.is_file():
        return None
    q = json.loads(cfg.read_text()).get("quantization_config") or {}
    return str(q.get("quant_method")) if q.get("quant_method") else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("backend", help="vLLM attention backend: FLASHMLA, TRITON_MLA, FLASH_ATTN_MLA, ...")
    ap.add_argument("out", type=Path, help="folder for the dumps")
    ap.add_argument("--model", default="golden/models/fa3-v3-bf16.gguf")
    ap.add_argument("--config", default="golden/models/fa3-v3", help="folder of the model's HF config.json")
    ap.add_argument(
        "--workspace", type=int, default=256, help="chunked-prefill workspace in tokens (0: vLLM's)"
    )
    ap.add_argument(
        "--cases",
        default=None,
        help="comma-separated cases to run: chunked, prefix, batch, single (default: the first three; "
        "with --plant: chunked)",
    )
    ap.add_argument("--tokens", default=SINGLE_TOKENS, help="the single case's prompt ids (comma-separated)")
    ap.add_argument(
        "--sites",
        default=None,
        help="comma-separated stages every case keeps, or `all` (SITES; default: SITES, with --plant "
        "PLANT_SITES)",
    )
    ap.add_argument(
        "--kv-cache-dtype", default="auto", help="vLLM kv_cache_dtype (default auto: the model dtype)"
    )
    ap.add_argument(
        "--weights",
        action="store_true",
        help="keep the loaded weights in each dump (weights.*) and write <dump>.weights.safetensors, "
        "which mla-diff weights --check judges",
    )
    ap.add_argument(
        "--plant",
        default=None,
        help="apply this plant of mla_diff_hooks.plants (NAME or NAME:k=v) before vLLM starts and run "
        "the chunked case unless --cases says otherwise, its dump named "
        "<model>.<backend>.plant-<SPEC> (the spec, its punctuation as -)",
    )
    ap.add_argument(
        "--heads", default=None, help="A:B: keep heads A..B in every case (default: RECORD's per case)"
    )
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help="record at most this many forwards from each case's first (default: RECORD's per case); "
        "with every head, one step keeps a plant dump under 2 MB",
    )
    args = ap.parse_args()
    heads = tuple(int(x) for x in args.heads.split(":")) if args.heads else None
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # apply_model and the runner in this process
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    hf = Path(args.model).is_dir()
    quant = hf_quantization(args.model)
    patches = []
    if quant == "fp8":
        # read by vLLM's envs when Fp8LinearMethod is built: set before vLLM is imported
        os.environ["VLLM_USE_DEEP_GEMM"] = "0"
        patches.append(
            (
                "no-deep-gemm",
                "VLLM_USE_DEEP_GEMM=0: Fp8LinearMethod takes the CUTLASS block-FP8 kernel "
                "(CutlassFp8BlockScaledMMKernel on sm90) instead of DeepGEMM, whose warm-up and JIT "
                "take minutes; the weights keep the checkpoint's layout after loading",
            )
        )
    import numpy as np

    hooks = __import__("mla_diff_hooks.vllm", fromlist=["arm"])
    model, config = os.path.abspath(args.model), os.path.abspath(args.config)
    args.out.mkdir(parents=True, exist_ok=True)
    print(
        f"[{args.backend}] model {model}: "
        + (f"HF checkpoint folder, quantization {quant or 'none'}" if hf else "GGUF, config " + config),
        flush=True,
    )
    if args.plant:
        from mla_diff_hooks import plants

        patches.append(plants.apply(args.plant))
    if args.workspace:
        import vllm.model_executor.layers.attention.mla_attention as mla_mod

        w = args.workspace
        mla_mod.MLACommonMetadataBuilder.determine_chunked_prefill_workspace_size = staticmethod(
            lambda cfg: w
        )
        patches.append(
            (
                "chunked-prefill-workspace",
                f"MLACommonMetadataBuilder.determine_chunked_prefill_workspace_size returns {w} tokens "
                "(vLLM: at least 8 x max_model_len), so a prefill reads its cached context in several chunks",
            )
        )
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.time()
    llm = LLM(
        model=model,
        **({} if hf else {"hf_config_path": config}),
        kv_cache_dtype=args.kv_cache_dtype,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="bfloat16",
        attention_backend=args.backend,
        max_model_len=1024,
        gpu_memory_utilization=0.25,
        max_num_seqs=4,
        max_num_batched_tokens=300,
        long_prefill_token_threshold=160,
        enable_prefix_caching=True,
    )
    print(
        f"[{args.backend}] LLM up in {time.time() - t0:.1f} s; runner watched: {hooks.watch_runner()}",
        flush=True,
    )
    if args.plant and args.plant.partition(":")[0].strip() == "fp8-scale-transposed":
        from mla_diff_hooks import plants

        if not plants.SCALE_PLANTED:
            print(f"[{args.backend}] fp8-scale-transposed met no layer (is the model block FP8?)", flush=True)
            return 1
        print(f"[{args.backend}] fp8-scale-transposed planted: {plants.SCALE_PLANTED}", flush=True)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    rng = np.random.default_rng(39)

    def toks(n: int) -> list[int]:
        return [int(x) for x in rng.integers(1, vocab - 1, n)]

    def generate(prompts, decode):
        sp = SamplingParams(max_tokens=decode, temperature=0.0, ignore_eos=True)
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)

    worst = 0
    # a plant's dump is named by its spec, so that two settings of one plant do not collide
    label = (
        "plant-" + "".join(c if c.isalnum() or c in "-_." else "-" for c in args.plant)
        if args.plant
        else None
    )

    def case(name, batches, decode, bare=None):
        nonlocal worst
        if bare is not None:
            t = time.time()
            generate(bare, decode)
            dt = time.time() - t
            rate = sum(len(p) + decode for p in bare) / dt
            print(f"[{args.backend}] {name}: without hooks {dt:.3f} s, {rate:.0f} tok/s")
        rec = RECORD[name]
        sites = (
            SITES
            if args.sites == "all"
            else args.sites.split(",")
            if args.sites
            else PLANT_SITES
            if args.plant
            else SITES
        )
        arm = functools.partial(
            hooks.arm,
            forward_index=rec["first"],
            steps=args.steps or rec["steps"],
            layers=[0],
            sites=sites,
            heads=heads or rec["heads"],
        )
        print(llm.apply_model(arm)[0], flush=True)
        t = time.time()
        for b in batches:
            generate(b, decode)
        dt = time.time() - t
        n = sum(len(p) + decode for b in batches for p in b)
        kv = "" if args.kv_cache_dtype == "auto" else f"-kv-{args.kv_cache_dtype}"
        stem = f"{Path(model).name if hf else Path(model).stem}.{args.backend.lower()}{kv}.{label or name}"
        path = args.out / f"{stem}.safetensors"
        wpath = args.out / f"{stem}.weights.safetensors" if args.weights else None
        llm.apply_model(
            functools.partial(
                hooks.finish,
                dump_path=str(path),
                weights_path=None if wpath is None else str(wpath),
                model_path=model,
                weight_sites=False,
                weights=args.weights,
                patches=patches or None,
            )
        )
        bin_ = os.environ.get("MLA_DIFF_BIN", "target/release/mla-diff")
        r = subprocess.run(
            [
                bin_,
                "compare",
                "--model",
                model,
                "--dump",
                str(path),
                "--json",
                str(path) + ".json",
                "--force",
            ],
            capture_output=True,
            text=True,
        )
        (args.out / f"{stem}.compare.log").write_text(r.stdout + r.stderr)
        worst = max(worst, r.returncode if not args.plant else int(r.returncode != 1))
        if wpath is not None:
            rw = subprocess.run(
                [bin_, "weights", "--model", model, "--check", str(wpath)], capture_output=True, text=True
            )
            (args.out / f"{stem}.weights-check.log").write_text(rw.stdout + rw.stderr)
            worst = max(worst, rw.returncode if not args.plant else int(rw.returncode != 1))
            print(f"[{args.backend}] {label or name}: weights --check exit {rw.returncode}", flush=True)
        verdict = [
            x
            for x in (r.stdout + r.stderr).splitlines()
            if x.startswith(("dump:", "finding", "mla-diff:", "  hint"))
        ]
        print(
            f"[{args.backend}] {label or name}: with hooks {dt:.3f} s, {n / dt:.0f} tok/s; "
            f"{path.stat().st_size} B; compare exit {r.returncode}",
            *verdict[:4],
            sep="\n    ",
            flush=True,
        )

    wanted = (
        args.cases.split(",") if args.cases else ["chunked"] if args.plant else ["chunked", "prefix", "batch"]
    )
    unknown = [c for c in wanted if c not in RECORD]
    if unknown:
        print(f"unknown case(s) {unknown} (known: {', '.join(RECORD)})", file=sys.stderr)
        return 2
    if "single" in wanted:
        case("single", [[[int(x) for x in args.tokens.split(",") if x.strip()]]], 3)
    if "chunked" in wanted:
        case("chunked", [[toks(960), toks(840)]], 4)
    if "prefix" in wanted:
        p1 = toks(286)
        case("prefix", [[p1], [p1[:256] + toks(50)]], 2)
    if "batch" in wanted:
        case(
            "batch",
            [[toks(1), toks(63), toks(65), toks(300)]],
            3,
            bare=[toks(1), toks(63), toks(65), toks(300)],
        )
    return 0 if worst == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
