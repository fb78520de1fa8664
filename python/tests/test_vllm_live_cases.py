"""scripts/gpu-host/vllm_live_cases.py up to the engine, with a stand-in `vllm` package.

Why this exists: the live runner runs only on a GPU host; what it hands vLLM for a Hugging Face
checkpoint folder (no GGUF config path, the KV cache dtype, VLLM_USE_DEEP_GEMM=0 set before vLLM
is imported for an fp8 checkpoint) decides which kernels the H200 run exercises, so it is checked
here where a mistake costs no GPU time. The stand-in `vllm.LLM` prints what it was given and the
environment, then stops the script.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from support import GOLDEN, ROOT

RUNNER = ROOT / "scripts" / "gpu-host" / "vllm_live_cases.py"

FAKE_VLLM = """
import json, os, sys
class LLM:
    def __init__(self, **kw):
        print("LLM " + json.dumps({"kw": kw, "deep_gemm": os.environ.get("VLLM_USE_DEEP_GEMM"),
                                   "mp": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")}), flush=True)
        sys.exit(3)
class SamplingParams:
    pass
"""


def run(tmp_path, *args):
    fake = tmp_path / "fake"
    (fake / "vllm").mkdir(parents=True, exist_ok=True)
    (fake / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    (fake / "vllm" / "inputs.py").write_text("class TokensPrompt(dict):\n    pass\n")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_USE_DEEP_GEMM"}
    env["PYTHONPATH"] = os.pathsep.join([str(fake), str(ROOT / "python")])
    r = subprocess.run(
        [sys.executable, str(RUNNER), *args], capture_output=True, text=True, env=env, cwd=ROOT
    )
    line = next((x for x in r.stdout.splitlines() if x.startswith("LLM ")), None)
    return r, (json.loads(line[4:]) if line else None)


def test_an_fp8_checkpoint_folder_runs_without_deep_gemm_or_a_gguf_config(tmp_path):
    pytest.importorskip("numpy")
    r, got = run(
        tmp_path,
        "TRITON_MLA",
        str(tmp_path / "out"),
        "--model",
        str(GOLDEN / "hf-v3-fp8"),
        "--cases",
        "single",
        "--weights",
        "--workspace",
        "0",
    )
    assert r.returncode == 3, r.stdout + r.stderr
    assert "HF checkpoint folder, quantization fp8" in r.stdout
    assert got["deep_gemm"] == "0" and got["mp"] == "0"
    kw = got["kw"]
    assert kw["model"] == str((GOLDEN / "hf-v3-fp8").resolve()) and "hf_config_path" not in kw
    assert kw["kv_cache_dtype"] == "auto" and kw["attention_backend"] == "TRITON_MLA"


def test_a_bf16_folder_keeps_deep_gemm_and_a_gguf_keeps_its_config(tmp_path):
    pytest.importorskip("numpy")
    r, got = run(
        tmp_path,
        "FLASHMLA",
        str(tmp_path / "out"),
        "--model",
        str(GOLDEN / "hf-v3-bf16"),
        "--kv-cache-dtype",
        "bfloat16",
        "--workspace",
        "0",
    )
    assert r.returncode == 3 and "quantization none" in r.stdout
    assert got["deep_gemm"] is None and got["kw"]["kv_cache_dtype"] == "bfloat16"
    r, got = run(tmp_path, "FLASHMLA", str(tmp_path / "out"), "--workspace", "0")
    assert r.returncode == 3 and "GGUF, config" in r.stdout
    assert got["kw"]["hf_config_path"] == str((GOLDEN / "models" / "fa3-v3").resolve())
