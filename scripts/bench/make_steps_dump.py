#!/usr/bin/env python3
"""Write a synthetic format-2 dump of one prefill and several decode steps, for timing `compare`.

Why: `compare` on a serving engine's dump of a long prefill and its decode steps runs the
reference of each dumped layer once over the union of the steps (each step judged on its rows
of it). Its time at real size is mostly that reference, which needs a real-shaped GGUF and the
steps' layer inputs, not an engine: this script writes one sequence's seeded `hidden_in` rows
of one layer (standard normal, f32), split into a prefill step of `--prefill` tokens and
`--decode` steps of one token each, with the header (model identity, steps) `compare` checks.
The dump holds `hidden_in` only, so `compare` judges each step's input rows (which pass) and
reports every other site as not dumped: a timing of the reference, the step rows and the
judging machinery, not of a detector.

Usage (needs numpy and gguf):
    python scripts/bench/make_steps_dump.py MODEL.gguf OUT.safetensors --layer 3 \
        --prefill 512 --decode 8 [--seed 0]
then `mla-diff compare --model MODEL.gguf --dump OUT.safetensors --stats` (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))
from mla_diff_hooks import dump_format  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--layer", type=int, default=3)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--decode", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    import gguf

    rd = gguf.GGUFReader(str(a.model))
    arch = bytes(rd.fields["general.architecture"].parts[-1]).decode()
    hidden = int(rd.fields[f"{arch}.embedding_length"].parts[-1][0])
    rng = np.random.default_rng(a.seed)
    rows = rng.standard_normal((a.prefill + a.decode, hidden), dtype=np.float32)
    steps = [{"name": "prefill", "seqs": [{"new": a.prefill, "context": 0}]}]
    tensors = {f"s0.L{a.layer}.hidden_in": rows[: a.prefill]}
    for j in range(a.decode):
        steps.append({"name": f"decode-{j + 1}", "seqs": [{"new": 1, "context": a.prefill + j}]})
        tensors[f"s{j + 1}.L{a.layer}.hidden_in"] = rows[a.prefill + j : a.prefill + j + 1]
    header = {
        "model": dump_format.model_identity(a.model, [a.layer]),
        "hook": {"name": "scripts/bench/make_steps_dump.py", "version": "1"},
        "engine": {"name": "synthetic", "version": ""},
        "dtype": "f32",
        "conventions": {"rope_order": "interleaved"},
        "steps": steps,
        "patches": [],
    }
    dump_format.write_format2(a.out, tensors, header)
    print(f"{a.out}: {a.prefill} + {a.decode} tokens of L{a.layer}.hidden_in, {a.out.stat().st_size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
