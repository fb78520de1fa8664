#!/usr/bin/env python3
"""vLLM's sparse MLA (DSA) path on a GPU, on the glm-dsa fixture, judged by `mla-diff compare`.

Why: a DSA layer attends only to the keys its lightning indexer keeps, and vLLM runs it through
its own sparse backends (FLASH_ATTN_MLA_SPARSE and FLASHMLA_SPARSE on sm90), fp8 DeepGEMM
indexer kernels and its topk_indices_buffer; none of that is reached by the dense cases. This
script runs vLLM's offline engine (`vllm.LLM`, in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0) on
golden/models/dsa-live-bf16.gguf (two glm-dsa layers, index_topk 128; its config folder
golden/models/dsa-live) with vllm-gguf-plugin loading it through the recorded patch
`glm-dsa-name-map` (mla_diff_hooks.vllm.map_glm_dsa_names: the plugin 0.0.5 does not map
glm_moe_dsa), a prompt of --prompt tokens (default 160, above index_topk, so vLLM runs the whole
prefill through the sparse backend's forward_mqa, not its dense prefill, and its indexer drops
keys) and --decode steps, the hooks of mla_diff_hooks.vllm armed on layer 0 for every step. The
dump holds the indexer's selection (`idx_topk`, every step: a decode step's row is index_topk
wide over its whole sequence), the absorbed sites (`ql_nope`, `attn_latent`), `attn_out` and the
layer's other sites, and its header declares the indexer's fp8 quantization (`indexer_quant`,
read from vLLM's Indexer module: E4M3 in blocks of quant_block_size 128, ue8m0 scales, bf16
input). `mla-diff compare` scores the reference's indexer on the same quantized operands and
judges `idx_topk` against the reference's selection (a key flipped at a near tie of the scores
passes within the tie band), and the attention on the engine's own selection (the dumped
`idx_topk`). At 160 prompt tokens and 4 decode steps the dump is under 2 MB (about 10.5 KB a
token), small enough to commit under golden/dumps/live-gpu/. It prints, per backend, the backend
vLLM ran, the generate time, the dump's size and the compare verdict.

Usage (from the repository root, vLLM 0.26.0 importable with DeepGEMM, e.g. after
scripts/gpu-host/vllm_live_gpu.sh install with PYTHONPATH=$STAGE/site:python):

    MLA_DIFF_BIN=target/release/mla-diff python3 scripts/gpu-host/vllm_dsa_live.py OUTDIR

runs vLLM's own choice (`auto`), then FLASH_ATTN_MLA_SPARSE and FLASHMLA_SPARSE, each in its
own process (--backends to choose; `--one BACKEND` runs one in this process), and writes
OUTDIR/dsa-live-bf16.<backend>.safetensors (lower-case backend). Exit 0 when every compare
exits 0.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

BACKENDS = "auto,FLASH_ATTN_MLA_SPARSE,FLASHMLA_SPARSE"
BIN = os.environ.get("MLA_DIFF_BIN", "target/release/mla-diff")


def run_one(args) -> int:
    """One backend in this process: the engine, the recorded steps, the dump and its verdict."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the patch, apply_model and the runner here
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    import numpy as np

    hooks = __import__("mla_diff_hooks.vllm", fromlist=["arm"])
    patches: list = []
    hooks.map_glm_dsa_names(patches)
    try:
        from vllm.utils.deep_gemm import has_deep_gemm

        if not has_deep_gemm():
            print(f"[{args.one}] DeepGEMM is not usable here: vLLM's sparse indexer cannot run", flush=True)
            return 1
    except ImportError:
        pass
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model, config = os.path.abspath(args.model), os.path.abspath(args.config)
    kw = {} if args.one == "auto" else {"attention_backend": args.one}
    t0 = time.time()
    llm = LLM(
        model=model,
        hf_config_path=config,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="bfloat16",
        max_model_len=1024,
        gpu_memory_utilization=0.25,
        max_num_seqs=4,
        max_num_batched_tokens=1024,
        enable_prefix_caching=False,
        **kw,
    )
    print(
        f"[{args.one}] LLM up in {time.time() - t0:.1f} s; runner watched: {hooks.watch_runner()}", flush=True
    )
    vocab = llm.llm_engine.model_config.get_vocab_size()
    ids = [int(x) for x in np.random.default_rng(39).integers(1, vocab - 1, args.prompt)]
    print(llm.apply_model(functools.partial(hooks.arm, steps=1 + args.decode, layers=[0]))[0], flush=True)
    t = time.time()
    llm.generate(
        [TokensPrompt(prompt_token_ids=ids)],
        SamplingParams(max_tokens=1 + args.decode, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )
    dt = time.time() - t
    path = args.out / f"{Path(model).stem}.{args.one.lower()}.safetensors"
    res = llm.apply_model(
        functools.partial(
            hooks.finish,
            dump_path=str(path),
            model_path=model,
            expect_tokens=ids,
            weight_sites=False,
            weights=False,
            patches=patches,
        )
    )[0]
    from mla_diff_hooks import st_io

    header = json.loads(st_io.load(path)[1]["header"])
    engine = header.get("engine", {})
    print(
        f"[{args.one}] ran {engine.get('attention_backend')} ({engine.get('attention_impl')}); "
        f"{args.prompt} prompt tokens + {args.decode} decode steps in {dt:.3f} s; "
        f"{path.stat().st_size} B; indexer_quant {header.get('indexer_quant')}; notes: {res['notes'][:3]}",
        flush=True,
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
    out = (r.stdout + r.stderr).splitlines()
    verdict = [x for x in out if x.startswith(("dump:", "finding", "mla-diff:", "  hint", "note"))]
    verdict += [x for x in out if "idx_topk" in x or "attn_latent" in x][:6]
    print(f"[{args.one}] compare exit {r.returncode}", *verdict[:14], sep="\n    ", flush=True)
    return r.returncode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="folder for the dumps")
    ap.add_argument("--model", default="golden/models/dsa-live-bf16.gguf")
    ap.add_argument("--config", default="golden/models/dsa-live", help="folder of the model's HF config.json")
    ap.add_argument(
        "--backends", default=BACKENDS, help=f"comma-separated, each in its own process ({BACKENDS})"
    )
    ap.add_argument("--one", default=None, help="run this backend (or auto) in this process")
    ap.add_argument("--prompt", type=int, default=160, help="prompt tokens (default 160, above index_topk)")
    ap.add_argument("--decode", type=int, default=4, help="decode steps (default 4)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.one:
        return run_one(args)
    worst = 0
    for b in args.backends.split(","):
        t = time.time()
        argv = [sys.executable, __file__, str(args.out), "--one", b, "--model", args.model]
        argv += ["--config", args.config, "--prompt", str(args.prompt), "--decode", str(args.decode)]
        rc = subprocess.run(argv, timeout=600).returncode
        print(f"[{b}] process exit {rc} in {time.time() - t:.1f} s", flush=True)
        worst = max(worst, rc)
    return 0 if worst == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
