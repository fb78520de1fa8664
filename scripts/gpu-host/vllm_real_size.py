#!/usr/bin/env python3
"""vLLM's live engine on a DeepSeek-V3-shaped layer: a 4,096-token prefill and 8 decode steps.

Why: the fixtures the other live cases use have 4 heads and a 64-wide residual; the kernels vLLM
picks at DeepSeek-V3's real shapes (128 heads, H 7168, Lq 1536, prompts of thousands of tokens)
take other code paths (FlashMLA's head grouping, Triton MLA's split count, FA3's varlen prefill
tiles). This script runs one in-process `vllm.LLM` on the given backend on the GGUF that
scripts/fixtures/make_v3_real_gguf.py writes, records layer 0 of the prefill and the decode
steps with mla_diff_hooks.vllm, and times `mla-diff compare --stats` on the dump (which is
hundreds of MB: it stays where it was made).

Usage (from the repository root, vLLM 0.26.0 importable):

    MLA_DIFF_BIN=target/release/mla-diff python3 scripts/gpu-host/vllm_real_size.py BACKEND \
        --model DIR/v3-real-1L-bf16.gguf --config DIR/v3-real --out DIR [--compare-backend cuda]

prints the LLM's start time, the generate time with the hooks, the dump's size, and compare's
exit status, wall time, peak memory and stage times. Exit status: compare's.
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import time
from pathlib import Path

SITES = [
    "hidden_in",
    "kv_c_normed",
    "k_pe_roped",
    "q_pe_roped",
    "ql_nope",
    "attn_latent",
    "lse",
    "attn_out",
    "o_proj",
    "hidden_out",
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("backend")
    ap.add_argument("--model", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--decode", type=int, default=8)
    ap.add_argument("--compare-backend", default="cuda", help="compare --backend (default cuda)")
    args = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    import numpy as np

    hooks = __import__("mla_diff_hooks.vllm", fromlist=["arm"])
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model = os.path.abspath(args.model)
    t0 = time.time()
    llm = LLM(
        model=model,
        hf_config_path=os.path.abspath(args.config),
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="bfloat16",
        attention_backend=args.backend,
        max_model_len=args.tokens + args.decode + 64,
        max_num_batched_tokens=args.tokens,
        max_num_seqs=1,
        gpu_memory_utilization=0.5,
        enable_prefix_caching=False,
    )
    print(
        f"[{args.backend}] LLM up in {time.time() - t0:.1f} s; runner watched: {hooks.watch_runner()}",
        flush=True,
    )
    vocab = llm.llm_engine.model_config.get_vocab_size()
    prompt = [int(x) for x in np.random.default_rng(4096).integers(1, vocab - 1, args.tokens)]
    sp = SamplingParams(max_tokens=1 + args.decode, temperature=0.0, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)  # warm-up, no hooks
    print(llm.apply_model(functools.partial(hooks.arm, steps=1 + args.decode, layers=[0], sites=SITES))[0])
    t = time.time()
    llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)
    dt = time.time() - t
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{Path(model).stem}.{args.backend.lower()}.t{args.tokens}.safetensors"
    t = time.time()
    llm.apply_model(
        functools.partial(
            hooks.finish, dump_path=str(path), model_path=model, weight_sites=False, weights=False
        )
    )
    print(
        f"[{args.backend}] generate with hooks {dt:.2f} s; dump written in {time.time() - t:.1f} s, "
        f"{path.stat().st_size / 2**20:.0f} MiB",
        flush=True,
    )
    del llm  # the compare below may use the GPU
    import gc

    gc.collect()
    cmd = [
        os.environ.get("MLA_DIFF_BIN", "target/release/mla-diff"),
        "compare",
        "--model",
        model,
        "--dump",
        str(path),
        "--stats",
    ]
    if args.compare_backend:
        cmd += ["--backend", args.compare_backend]
    t = time.time()
    r = subprocess.run(["/usr/bin/time", "-f", "host: %e s %M KB", *cmd], capture_output=True, text=True)
    wall = time.time() - t
    lines = [
        x
        for x in (r.stdout + r.stderr).splitlines()
        if x.startswith(("dump:", "finding", "mla-diff:", "host:", "stats", "stages", "wall", "peak"))
        or "stage" in x
    ]
    print(
        f"[{args.backend}] compare exit {r.returncode} in {wall:.2f} s", *lines[-8:], sep="\n    ", flush=True
    )
    return r.returncode


if __name__ == "__main__":
    sys.exit(main())
