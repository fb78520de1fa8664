"""Shared helpers of python/tests: the checkout, the mla-diff binary and the mla_diff_hooks under test.

Why this exists: the tests run in two settings. `.ci/run` installs the built wheel into a clean
venv, and there the wheel's binary (next to the venv's python) and its installed package are what
is tested; in a checkout without an install they fall back to python/ and target/release. Both
lookups live here so every test file agrees on them.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: golden/, target/, src/
GOLDEN = ROOT / "golden"


def hooks_module(name: str):
    """mla_diff_hooks.<name> as installed, else from the checkout's python/."""
    try:
        return importlib.import_module(f"mla_diff_hooks.{name}")
    except ModuleNotFoundError as e:
        if e.name != "mla_diff_hooks":
            raise
    sys.path.insert(0, str(ROOT / "python"))
    return importlib.import_module(f"mla_diff_hooks.{name}")


def mla_diff_candidates() -> list[str]:
    """Where a binary is looked for, in order: $MLA_DIFF, this Python's scripts folder (a venv's
    bin/, where the wheel puts it), PATH, target/release, target/debug."""
    exe = "mla-diff.exe" if os.name == "nt" else "mla-diff"
    cands = [
        os.environ.get("MLA_DIFF"),
        os.path.join(sysconfig.get_path("scripts"), exe),
        shutil.which("mla-diff"),
    ]
    cands += [str(ROOT / "target" / b / exe) for b in ("release", "debug")]
    return [c for c in cands if c]


def find_mla_diff() -> Path | None:
    """The first candidate binary that runs and has the `compare` subcommand; None if none."""
    for c in mla_diff_candidates():
        if Path(c).is_file():
            r = subprocess.run([c, "compare", "--help"], capture_output=True, text=True)
            if r.returncode == 0:
                return Path(c)
    return None
