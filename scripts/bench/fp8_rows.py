#!/usr/bin/env python3
"""The measurements behind the tolerance table's fp8 rows (`fp8`, `bf16-fp8`).

Why
---
With `run --fp8-compute` every projection reads its input quantized to fp8 E4M3 (with
`--kv-cache-dtype fp8` the latent cache holds E4M3), and the reference applies the same
roundings, yet the two sides still differ: wherever one side's value
(an f32 or bf16 rounding away from the other's) lands on the other side of an E4M3 midpoint, its
quantized value moves by a whole step (6-12 % of it), and the next quantized projection carries
and re-quantizes that through the layer. How far that goes is measured here, not guessed: every
committed fixture model, both activation modes and the fp8 cache, both dtypes, two batches. The rows in
src/judge/tolerance.rs quote this script's table.

Usage
-----
    cargo build --release
    python3 scripts/bench/fp8_rows.py [--bin target/release/mla-diff] [--layer 1]

Prints one Markdown table (stdout): per fp8 mode, dtype and stage group (activations, LSE), the
worst rel_l2, cos_diff, |norm ratio - 1|, largest element error in units of the site's reference
RMS, and the lowest pass fraction under the rows as compiled, each with the site it came from;
then how many runs exited 0 (within tolerance) of how many ran. Exit status 1 when a run did not
exit 0 or 1.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODELS = sorted(str(p) for p in (ROOT / "golden" / "models").glob("*.gguf"))
MODELS.append(str(ROOT / "golden" / "hf-v3-fp8"))
BATCHES = [["--seqs", "1,15,16,17,53"], ["--tokens", "390"]]
# mode -> (run arguments, paths). `tensor` cannot judge chunked (one scale per context chunk's
# kv_b call): run refuses the pair. mha reads no cache
MODES = {
    "token-group": (["--fp8-compute", "token-group"], ["all"]),
    "tensor": (["--fp8-compute", "tensor"], ["mha", "mqa", "mixed"]),
    "kv-cache": (["--kv-cache-dtype", "fp8"], ["mqa", "chunked", "mixed"]),
    "token-group+kv-cache": (["--fp8-compute", "token-group", "--kv-cache-dtype", "fp8"], ["all"]),
}


def group(site: str) -> str | None:
    stage = site.split(".", 1)[1]
    if stage.startswith("w.") or stage.startswith("idx_") or stage == "moe_topk":
        return None  # weights are exact; selections are judged by the tie band
    return "lse" if "lse" in stage else "act"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=str(ROOT / "target" / "release" / "mla-diff"))
    ap.add_argument("--layer", default="1")
    args = ap.parse_args()
    rows, runs, clean, bad = [], 0, 0, []
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "r.json"
        cases = itertools.product(MODELS, ["f32", "bf16"], MODES.items(), BATCHES)
        for model, dtype, (mode, (mode_args, paths)), batch in cases:
            for path in paths:
                cmd = [args.bin, "run", "--model", model, "--backend", "cpu", *mode_args]
                cmd += ["--dtype", dtype, "--path", path, "--layer", args.layer, "--quiet", "--force"]
                cmd += ["--json", str(report), *batch]
                r = subprocess.run(cmd, capture_output=True, text=True)
                runs += 1
                if r.returncode not in (0, 1):
                    bad.append(f"{' '.join(cmd)}: exit {r.returncode}: {r.stderr.strip()[:200]}")
                    continue
                clean += r.returncode == 0
                for s in json.loads(report.read_text())["sites"]:
                    g = group(s["site"])
                    if g is None:
                        continue
                    m = s["metrics"]
                    rms = m["norm_ref"] / math.sqrt(m["numel"]) if m["numel"] else 0.0
                    rows.append(
                        {
                            "key": (mode, dtype, g),
                            "rel": m["rel_l2"],
                            "cos": m["cos_diff"],
                            "norm": abs(m["norm_ratio"] - 1),
                            "elem": m["max_abs"] / rms if rms > 0 else 0.0,
                            "pass": m["pass_fraction"],
                            "where": f"{Path(model).name} {s['path']} {s['site']} {s['shape']}",
                        }
                    )
    print("| fp8 mode | dtype | sites | rel_l2 | cos_diff | norm ratio − 1 | elem / rms | pass fraction |")
    print("|---|---|---|---|---|---|---|---|")
    for key in sorted({r["key"] for r in rows}):
        sel = [r for r in rows if r["key"] == key]
        cells = []
        for k in ("rel", "cos", "norm", "elem"):
            w = max(sel, key=lambda r: r[k])
            cells.append(f"{w[k]:.3g} ({w['where']})")
        w = min(sel, key=lambda r: r["pass"])
        cells.append(f"{w['pass']:.5f} ({w['where']})")
        print(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(cells) + " |")
    print(f"\n{clean} of {runs} runs within tolerance")
    for b in bad:
        print(b, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
