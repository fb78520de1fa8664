#!/usr/bin/env python3
"""`vllm serve` with the mla_diff_hooks plugin, one HTTP completion, the dump judged.

Why: users deploy with `vllm serve`, where the model runs in an engine-core process their code
never reaches. The hooks attach there through vLLM's plugin mechanism (the `vllm.general_plugins`
entry point of mla_diff_hooks, armed by MLA_DIFF_VLLM_DUMP), with no code of the user's in the
server. This script does what a user would: start the server with the environment variables
set, wait for /health, send one request to /v1/completions (the fixture has no tokenizer:
`--skip-tokenizer-init` and a prompt of token ids), stop the server, and run
`mla-diff compare` on the dump the engine process wrote.

Usage (from the repository root, vLLM 0.26.0 importable, e.g. after
scripts/gpu-host/vllm_live_gpu.sh install with PYTHONPATH=$STAGE/site:python):

    MLA_DIFF_BIN=target/release/mla-diff python3 scripts/gpu-host/vllm_serve_case.py BACKEND OUT

writes OUT/fa3-v3-bf16.<backend>.serve.safetensors (the plugin's OUT/serve-<backend>/dump.safetensors,
renamed) and prints the server's start time, the HTTP response and the compare verdict. Exit
status: compare's. Options: --model/--config (default golden/models/fa3-v3-bf16.gguf and
golden/models/fa3-v3), --prompt-tokens (default 40), --max-tokens (default 4), --port.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("backend")
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", default="golden/models/fa3-v3-bf16.gguf")
    ap.add_argument("--config", default="golden/models/fa3-v3")
    ap.add_argument("--prompt-tokens", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--timeout", type=int, default=400, help="seconds to wait for the server")
    args = ap.parse_args()
    model, config = os.path.abspath(args.model), os.path.abspath(args.config)
    folder = (args.out / f"serve-{args.backend.lower()}").resolve()
    folder.mkdir(parents=True, exist_ok=True)
    # The plugin's entry point must be visible to importlib.metadata in every vLLM process: an
    # installed mla_diff_hooks declares it; a checkout on PYTHONPATH gets a .dist-info beside it.
    sys.path.append(str(REPO / "python"))  # after PYTHONPATH: a copy given there comes first
    import mla_diff_hooks
    from mla_diff_hooks import vllm_plugin

    package_parent = str(Path(mla_diff_hooks.__file__).resolve().parent.parent)
    meta = Path(tempfile.mkdtemp(prefix="mla-diff-plugin-"))
    vllm_plugin.write_dist_info(meta)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(meta), package_parent, env.get("PYTHONPATH", "")])
    env.update(
        {
            "MLA_DIFF_VLLM_DUMP": str(folder),
            # the prefill forward and the decode forwards of the one request
            "MLA_DIFF_VLLM_STEPS": str(args.max_tokens),
            "MLA_DIFF_VLLM_LAYERS": "0",
            "MLA_DIFF_VLLM_WEIGHTS": "0",
        }
    )
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model,
        "--hf-config-path", config,
        "--skip-tokenizer-init",
        "--enforce-eager",
        "--dtype", "bfloat16",
        "--attention-backend", args.backend,
        "--max-model-len", "1024",
        "--gpu-memory-utilization", "0.25",
        "--port", str(args.port),
    ]  # fmt: skip
    print("$ " + " ".join(cmd), flush=True)
    log = open(folder / "server.log", "w")
    t0 = time.time()
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{args.port}"
    try:
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"the server exited ({server.returncode}); see {folder / 'server.log'}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() - t0 > args.timeout:
                raise RuntimeError(f"no /health after {args.timeout} s")
            time.sleep(1)
        print(f"[{args.backend}] vllm serve up in {time.time() - t0:.1f} s", flush=True)
        prompt = [(7 * i + 3) % 120 + 2 for i in range(args.prompt_tokens)]
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": args.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        req = urllib.request.Request(
            base + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        t = time.time()
        with urllib.request.urlopen(req, timeout=120) as r:
            resp = json.loads(r.read())
        choice = (resp.get("choices") or [{}])[0]
        print(
            f"[{args.backend}] POST /v1/completions: {time.time() - t:.2f} s, finish_reason "
            f"{choice.get('finish_reason')}, token_ids {choice.get('token_ids')}, usage {resp.get('usage')}",
            flush=True,
        )
    finally:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()
    dump = folder / "dump.safetensors"
    plugin_lines = [x for x in (folder / "server.log").read_text().splitlines() if "mla_diff_hooks" in x]
    print(*plugin_lines[-4:], sep="\n", flush=True)
    if not dump.is_file():
        print(f"[{args.backend}] no dump written in {folder}", flush=True)
        return 2
    path = args.out / f"{Path(model).stem}.{args.backend.lower()}.serve.safetensors"
    dump.replace(path)
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
    verdict = [
        x for x in (r.stdout + r.stderr).splitlines() if x.startswith(("dump:", "finding", "mla-diff:"))
    ]
    print(
        f"[{args.backend}] serve: {path.stat().st_size} B; compare exit {r.returncode}",
        *verdict[:3],
        sep="\n    ",
    )
    return r.returncode


if __name__ == "__main__":
    sys.exit(main())
