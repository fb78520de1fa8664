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

Usage (from the repository root, vLLM 0.26.0 importable, e.g. after
scripts/gpu-host/vllm_live_gpu.sh install with PYTHONPATH=$STAGE/site:python):

    MLA_DIFF_BIN=target/release/mla-diff python3 scripts/gpu-host/vllm_live_cases.py FLASHMLA OUTDIR

writes OUTDIR/fa3-v3-bf16.<backend>.<case>.safetensors (layer 0, the stages of SITES, the heads
and forwards of RECORD) and
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

# The stages every step keeps: the layer's input and output, the latent cache's rows, the
# absorbed decode's sites, the per-chunk partials of a prefill over cached context, and o_proj.
SITES = [
    "hidden_in",
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
}
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
        "--cases", default="chunked,prefix,batch", help="comma-separated cases to run (default: all three)"
    )
    ap.add_argument(
        "--plant",
        default=None,
        help="apply this plant of mla_diff_hooks.plants (NAME or NAME:k=v) before vLLM starts and run "
        "the chunked case only, its dump named <model>.<backend>.plant-<NAME>",
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
    import numpy as np

    hooks = __import__("mla_diff_hooks.vllm", fromlist=["arm"])
    model, config = os.path.abspath(args.model), os.path.abspath(args.config)
    args.out.mkdir(parents=True, exist_ok=True)
    patches = []
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
        hf_config_path=config,
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
    vocab = llm.llm_engine.model_config.get_vocab_size()
    rng = np.random.default_rng(39)

    def toks(n: int) -> list[int]:
        return [int(x) for x in rng.integers(1, vocab - 1, n)]

    def generate(prompts, decode):
        sp = SamplingParams(max_tokens=decode, temperature=0.0, ignore_eos=True)
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)

    worst = 0
    label = f"plant-{args.plant.partition(':')[0]}" if args.plant else None

    def case(name, batches, decode, bare=None):
        nonlocal worst
        if bare is not None:
            t = time.time()
            generate(bare, decode)
            dt = time.time() - t
            rate = sum(len(p) + decode for p in bare) / dt
            print(f"[{args.backend}] {name}: without hooks {dt:.3f} s, {rate:.0f} tok/s")
        rec = RECORD[name]
        arm = functools.partial(
            hooks.arm,
            forward_index=rec["first"],
            steps=args.steps or rec["steps"],
            layers=[0],
            sites=PLANT_SITES if args.plant else SITES,
            heads=heads or rec["heads"],
        )
        print(llm.apply_model(arm)[0], flush=True)
        t = time.time()
        for b in batches:
            generate(b, decode)
        dt = time.time() - t
        n = sum(len(p) + decode for b in batches for p in b)
        path = args.out / f"{Path(model).stem}.{args.backend.lower()}.{label or name}.safetensors"
        llm.apply_model(
            functools.partial(
                hooks.finish,
                dump_path=str(path),
                model_path=model,
                weight_sites=False,
                weights=False,
                patches=patches or None,
            )
        )
        r = subprocess.run(
            [
                os.environ.get("MLA_DIFF_BIN", "target/release/mla-diff"),
                "compare",
                "--model",
                model,
                "--dump",
                str(path),
            ],
            capture_output=True,
            text=True,
        )
        worst = max(worst, r.returncode if not args.plant else int(r.returncode != 1))
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

    wanted = ["chunked"] if args.plant else args.cases.split(",")
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
