#!/usr/bin/env python3
"""CPU benchmarks P1, P2 and P3 of BENCHMARKS.md: mla-diff next to gguf-py / transformers, interleaved.

Why
---
The scale issue's goals are ratios against other tools on the same machine (P2: dequantization
>= 10x gguf-py; P1: a 61-layer file costs <= 1.1x a 4-layer one; P3: one reference layer
against transformers' DeepseekV3Attention). On a shared 2-core box a figure measured alone means
little, so this script runs both sides of each ratio in one process tree, alternating them round
by round, and reports medians and the load average it saw.

Usage
-----
    cargo build --release
    /work/venv/fx/bin/python scripts/bench/bench_cpu.py [--sections p2,p1,p3] [--workdir /work/scale]
        [--rounds 5] [--bin target/release/mla-diff] [--p1-tokens 19] [--p3-tokens 128]

Sections (Markdown tables on stdout, progress on stderr, raw figures in WORKDIR/bench_cpu.json):
  p2  Writes WORKDIR/bench-dequant.gguf once (one 4096 x 4096 tensor per type Q8_0, Q4_K, Q6_K,
      IQ4_NL: random N(0, 0.02) f32 quantized by llama.cpp's own ggml_quantize_chunk through
      llama-cpp-python's libggml-base; about 10-18 MB in, 64 MB of f32 out each). Then ROUNDS
      rounds of: gguf-py `gguf.quants.dequantize` on each tensor (numpy, one thread), ggml's C
      `to_float` on each tensor (one thread, for scale), and one `mla-diff bench --dequant
      --repeat 1` process (1 thread and all threads; a fresh output vector per call, as weight
      loading does, and a reused buffer). Checks that mla-diff's output bits equal gguf-py's
      (SHA-256 of the f32 bytes) and exits 1 if not.
  p1  `mla-diff run --model M --layer 3 --path mha --backend cpu --stats` on the sparse 61-layer
      and 4-layer DeepSeek-V3 files of scripts/fixtures/make_sparse_gguf.py (layers 0-3 hold data),
      ROUNDS rounds in ABBA order after one untimed run of each; wall time and peak RSS from
      `--stats` and from /usr/bin/time.
  p3  `mla-diff bench --reference M61 --layer 3 --tokens T` (reference f64 forward and the
      CPU engine's mha path, 1 thread and all threads) and scripts/bench/bench_p3_hf.py (transformers
      DeepseekV3Attention, eager, f32 and f64, 1 thread and all threads), alternated for
      P3_ROUNDS rounds; ratios at equal thread counts.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gguf
import numpy as np

REPO = Path(__file__).resolve().parents[2]
TYPES = ("Q8_0", "Q4_K", "Q6_K", "IQ4_NL")
ROWS = COLS = 4096


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def load3() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def med(v: list[float]) -> float:
    return statistics.median(v) if v else float("nan")


# --- ggml through llama-cpp-python -------------------------------------------------------------

class _TypeTraits(ctypes.Structure):
    """struct ggml_type_traits (ggml.h of the vendored llama.cpp)."""
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                ("from_float_ref", ctypes.c_void_p)]


def ggml_lib() -> ctypes.CDLL:
    import llama_cpp
    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
    lib.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
    lib.ggml_get_type_traits.restype = ctypes.POINTER(_TypeTraits)
    lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
    return lib


def quantize(lib: ctypes.CDLL, x: np.ndarray, qt: gguf.GGMLQuantizationType) -> np.ndarray:
    """llama.cpp's quantizer on rows of x (f32 [rows, cols]), two row halves on two threads."""
    if lib.ggml_quantize_requires_imatrix(int(qt)):
        sys.exit(f"error: {qt.name} needs an importance matrix")
    rows, cols = x.shape
    bs, ts = gguf.GGML_QUANT_SIZES[qt]
    row_bytes = cols // bs * ts
    dst = np.empty((rows, row_bytes), dtype=np.uint8)
    x = np.ascontiguousarray(x, dtype=np.float32)
    half = rows // 2

    def part(r0: int, r1: int) -> int:
        # ggml_quantize_chunk(type, src, dst, start, nrows, n_per_row, imatrix): start is an
        # element offset into src and dst alike (it must be a multiple of n_per_row).
        return lib.ggml_quantize_chunk(int(qt), x.ctypes.data, dst.ctypes.data, r0 * cols, r1 - r0, cols, None)

    with ThreadPoolExecutor(2) as ex:  # ctypes releases the GIL
        n = sum(ex.map(lambda a: part(*a), [(0, half), (half, rows)]))
    if n != dst.size:
        sys.exit(f"error: ggml_quantize_chunk wrote {n} bytes for {qt.name}, expected {dst.size}")
    return dst


def ggml_to_float(lib: ctypes.CDLL, qt: gguf.GGMLQuantizationType):
    traits = lib.ggml_get_type_traits(int(qt)).contents
    fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.c_int64)(traits.to_float)

    def run(raw: np.ndarray, n: int) -> np.ndarray:
        out = np.empty(n, dtype=np.float32)
        fn(raw.ctypes.data, out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), n)
        return out
    return run


def write_bench_gguf(path: Path, lib: ctypes.CDLL) -> None:
    t0 = time.time()
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "bench")
    for name in TYPES:
        qt = gguf.GGMLQuantizationType[name]
        x = (rng.standard_normal((ROWS, COLS), dtype=np.float32) * 0.02).astype(np.float32)
        q = quantize(lib, x, qt)
        y = gguf.quants.dequantize(q, qt)
        if not np.isfinite(y).all():
            sys.exit(f"error: {name}: non-finite values after quantization")
        log(f"  {name}: {q.nbytes / 1e6:.1f} MB, rms error {float(np.sqrt(((y - x) ** 2).mean())):.2e} (x std 0.02)")
        w.add_tensor(f"bench.{name}", q, raw_shape=q.shape, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    log(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB) in {time.time() - t0:.1f} s")


# --- sections ----------------------------------------------------------------------------------

def run_json(cmd: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as d:
        j = Path(d) / "out.json"
        p = subprocess.run(cmd + ["--json", str(j)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if p.returncode != 0:
            sys.exit(f"error: {' '.join(cmd)} exited {p.returncode}:\n{p.stderr}")
        return json.loads(j.read_text())


def section_p2(a, results: dict) -> None:
    lib = ggml_lib()
    path = a.workdir / "bench-dequant.gguf"
    if not path.exists() or a.regen:
        log(f"P2: writing {path}")
        write_bench_gguf(path, lib)
    r = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in r.tensors}
    ours = {name: {"fresh": {}, "warm": {}} for name in TYPES}
    ggpy: dict[str, list[float]] = {name: [] for name in TYPES}
    cref: dict[str, list[float]] = {name: [] for name in TYPES}
    digests: dict[str, str] = {}
    meta: dict[str, tuple[int, int]] = {}
    loads = []
    for rnd in range(a.rounds + 1):  # round 0: warm-up, not counted
        loads.append(load3())
        for name in TYPES:
            t = tensors[f"bench.{name}"]
            raw = np.asarray(t.data)
            n = int(np.prod([int(x) for x in t.shape]))
            meta[name] = (n, raw.nbytes)
            t0 = time.perf_counter()
            y = gguf.quants.dequantize(raw, t.tensor_type)
            dt = time.perf_counter() - t0
            if rnd == 0:
                digests[name] = hashlib.sha256(np.ascontiguousarray(y, dtype="<f4").tobytes()).hexdigest()
            else:
                ggpy[name].append(dt)
            del y
            to_float = ggml_to_float(lib, t.tensor_type)
            t0 = time.perf_counter()
            y = to_float(raw, n)
            dt = time.perf_counter() - t0
            if rnd:
                cref[name].append(dt)
            del y
        doc = run_json([str(a.bin), "bench", "--dequant", str(path), "--repeat", "1"]
                       + (["--threads", a.threads] if a.threads else []))
        if rnd == 0:
            continue
        for f in doc["figures"]:
            name = f["ggml_type"]
            ours[name]["fresh"].setdefault(f["threads"], []).append(f["median_s"])
            ours[name]["warm"].setdefault(f["threads"], []).append(f["warm_median_s"])
            if f["sha256"] != digests[name]:
                sys.exit(f"error: {name}: mla-diff's output differs from gguf-py's (sha256)")
        log(f"  P2 round {rnd}/{a.rounds} done, load {loads[-1]}")
    loads.append(load3())
    threads = sorted({k for v in ours.values() for k in v["fresh"]})
    rows = []
    for name in TYPES:
        n, nin = meta[name]
        out_b = 4 * n
        gb = lambda s: out_b / s / 1e9  # noqa: E731
        row = {"type": name, "elements": n, "mb_in": nin / 1e6, "mb_out": out_b / 1e6,
               "gguf_py_s": med(ggpy[name]), "ggml_c_s": med(cref[name]),
               "ours_s": {k: med(ours[name]["fresh"][k]) for k in threads},
               "ours_warm_s": {k: med(ours[name]["warm"][k]) for k in threads},
               "bit_exact_vs_gguf_py": True}
        row["gguf_py_gbps"] = gb(row["gguf_py_s"])
        row["ggml_c_gbps"] = gb(row["ggml_c_s"])
        row["ours_gbps"] = {k: gb(v) for k, v in row["ours_s"].items()}
        row["ours_warm_gbps"] = {k: gb(v) for k, v in row["ours_warm_s"].items()}
        row["ratio"] = {k: row["gguf_py_s"] / row["ours_s"][k] for k in threads}
        row["ratio_warm"] = {k: row["gguf_py_s"] / row["ours_warm_s"][k] for k in threads}
        rows.append(row)
    results["p2"] = {"file": str(path), "rounds": a.rounds, "threads": threads, "loadavg": loads, "rows": rows}
    print(f"\n### P2: dequantization throughput (GB/s of f32 written; median of {a.rounds} interleaved rounds)\n")
    print(f"load average during the run (1/5/15 min): {loads[0]} -> {loads[-1]}\n")
    print("fresh = `dequantize` (a new output vector per call, as weight loading does); "
          "warm = `dequantize_into` a reused buffer; ratio = gguf-py time / mla-diff time\n")
    cols = [f"mla-diff fresh {k} thr" for k in threads] + [f"mla-diff warm {k} thr" for k in threads]
    rcols = [f"ratio fresh {k} thr" for k in threads] + [f"ratio warm {k} thr" for k in threads]
    print("| type | MB in | MB out | gguf-py | ggml C (1 thr) | " + " | ".join(cols) + " | " + " | ".join(rcols)
          + " | bits = gguf-py |")
    print("|---|---|---|---|---|" + "---|" * (len(cols) + len(rcols)) + "---|")
    for r in rows:
        vals = [f"{r['ours_gbps'][k]:.2f}" for k in threads] + [f"{r['ours_warm_gbps'][k]:.2f}" for k in threads]
        rats = [f"{r['ratio'][k]:.1f}x" for k in threads] + [f"{r['ratio_warm'][k]:.1f}x" for k in threads]
        print(f"| {r['type']} | {r['mb_in']:.1f} | {r['mb_out']:.1f} | {r['gguf_py_gbps']:.2f} | "
              f"{r['ggml_c_gbps']:.2f} | " + " | ".join(vals) + " | " + " | ".join(rats) + " | yes |")


def parse_stats(stderr: str) -> tuple[float, float, float]:
    """(wall s, peak RSS GiB, tensor data MB) from the `--stats` line."""
    line = next((l for l in stderr.splitlines() if "mla-diff: stats:" in l), None)
    if line is None:
        sys.exit(f"error: no --stats line in:\n{stderr}")
    wall = float(line.split("wall ")[1].split(" s")[0])
    rss = float(line.split("peak RSS ")[1].split(" GiB")[0])
    data = float(line.split("tensor data read ")[1].split(" MB")[0])
    return wall, rss, data


def section_p1(a, results: dict) -> None:
    models = {"61L": a.workdir / "deepseek-v3-sparse-61L.gguf", "4L": a.workdir / "deepseek-v3-sparse-4L.gguf"}
    for m in models.values():
        if not m.exists():
            sys.exit(f"error: {m} missing: run scripts/fixtures/make_sparse_gguf.py {a.workdir}")

    def one(key: str) -> dict:
        cmd = ["/usr/bin/time", "-f", "TIME %e %M", str(a.bin), "run", "--model", str(models[key]), "--layer", "3",
               "--path", "mha", "--backend", "cpu", "--tokens", str(a.p1_tokens), "--stats", "--quiet"]
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if p.returncode not in (0, 1):
            sys.exit(f"error: {' '.join(cmd)} exited {p.returncode}:\n{p.stderr}")
        wall, rss, data = parse_stats(p.stderr)
        tl = next(l for l in p.stderr.splitlines() if l.startswith("TIME "))
        _, e, m = tl.split()
        return {"rc": p.returncode, "stats_wall_s": wall, "stats_rss_gib": rss, "data_mb": data,
                "time_wall_s": float(e), "time_rss_gib": int(m) / 2**20, "verdict": p.stdout.strip()}

    log("P1: one untimed run of each file")
    one("61L")
    one("4L")
    runs: dict[str, list[dict]] = {"61L": [], "4L": []}
    loads = [load3()]
    for rnd in range(a.rounds):
        order = ("61L", "4L") if rnd % 2 == 0 else ("4L", "61L")
        for k in order:
            runs[k].append(one(k))
        loads.append(load3())
        log(f"  P1 round {rnd + 1}/{a.rounds}: " + ", ".join(
            f"{k} {runs[k][-1]['stats_wall_s']:.2f} s" for k in order) + f", load {loads[-1]}")
    summ = {}
    for k, v in runs.items():
        summ[k] = {f: med([r[f] for r in v]) for f in ("stats_wall_s", "stats_rss_gib", "time_wall_s",
                                                        "time_rss_gib", "data_mb")}
    ratio = {f: summ["61L"][f] / summ["4L"][f] for f in summ["61L"]}
    results["p1"] = {"tokens": a.p1_tokens, "rounds": a.rounds, "loadavg": loads, "runs": runs,
                     "median": summ, "ratio": ratio, "verdicts": {k: v[0]["verdict"] for k, v in runs.items()},
                     "exit_codes": {k: sorted({r["rc"] for r in v}) for k, v in runs.items()}}
    print(f"\n### P1: `run --layer 3 --path mha --tokens {a.p1_tokens}` on 61 vs 4 layers "
          f"(median of {a.rounds} rounds, ABBA order)\n")
    print(f"load average during the run: {loads[0]} -> {loads[-1]}\n")
    print("| file | wall (--stats) | wall (/usr/bin/time) | peak RSS (--stats) | max RSS (/usr/bin/time) | "
          "tensor data read | exit |")
    print("|---|---|---|---|---|---|---|")
    for k in ("61L", "4L"):
        s = summ[k]
        print(f"| {models[k].name} | {s['stats_wall_s']:.2f} s | {s['time_wall_s']:.2f} s | "
              f"{s['stats_rss_gib']:.2f} GiB | {s['time_rss_gib']:.2f} GiB | {s['data_mb']:.1f} MB | "
              f"{results['p1']['exit_codes'][k]} |")
    print(f"| **61L / 4L** | **{ratio['stats_wall_s']:.3f}** | **{ratio['time_wall_s']:.3f}** | "
          f"**{ratio['stats_rss_gib']:.3f}** | **{ratio['time_rss_gib']:.3f}** | {ratio['data_mb']:.3f} | |")


def section_p3(a, results: dict) -> None:
    model = a.workdir / "deepseek-v3-sparse-61L.gguf"
    if not model.exists():
        sys.exit(f"error: {model} missing: run scripts/fixtures/make_sparse_gguf.py {a.workdir}")
    ncpu = os.cpu_count() or 1
    counts = sorted({1, ncpu})
    ours: dict[tuple[str, int], list[float]] = {}
    hf: dict[tuple[str, int], list[float]] = {}
    loads = [load3()]
    for rnd in range(a.p3_rounds):
        doc = run_json([str(a.bin), "bench", "--reference", str(model), "--layer", "3", "--tokens",
                        str(a.p3_tokens), "--repeat", str(a.p3_runs), "--threads", ",".join(map(str, counts))])
        for f in doc["bench"]["figures"]:
            ours.setdefault((f["what"], f["threads"]), []).extend(f["runs_s"])
        log(f"  P3 round {rnd + 1}: mla-diff " + ", ".join(
            f"{f['what']} {f['threads']} thr {f['median_s']:.2f} s" for f in doc["bench"]["figures"]))
        for k in counts:
            for dt in ("f32", "f64"):
                p = subprocess.run([sys.executable, str(REPO / "scripts" / "bench" / "bench_p3_hf.py"), str(model), "--layer",
                                    "3", "--tokens", str(a.p3_tokens), "--runs", str(a.p3_runs), "--dtype", dt,
                                    "--threads", str(k)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                if p.returncode != 0:
                    sys.exit(f"error: bench_p3_hf.py exited {p.returncode}:\n{p.stderr}")
                h = json.loads(p.stdout.strip().splitlines()[-1])
                hf.setdefault((dt, h["threads"]), []).extend(h["runs"])
                results.setdefault("p3_hf_meta", h)
                log(f"  P3 round {rnd + 1}: HF {dt} {h['threads']} thr {h['t_median_s']:.2f} s")
        loads.append(load3())
    results["p3"] = {"tokens": a.p3_tokens, "rounds": a.p3_rounds, "runs_per_round": a.p3_runs, "loadavg": loads,
                     "ours": {f"{w}/{k}": v for (w, k), v in ours.items()},
                     "hf": {f"{d}/{k}": v for (d, k), v in hf.items()}}
    print(f"\n### P3: one MLA layer at DeepSeek-V3 dims, T = {a.p3_tokens} (median of "
          f"{a.p3_rounds} x {a.p3_runs} runs, interleaved)\n")
    print(f"load average during the run: {loads[0]} -> {loads[-1]}\n")
    print("| threads | transformers f32 | transformers f64 | mla-diff reference (f64) | mla-diff engine mha (f32) | "
          "reference / transformers f64 | reference / transformers f32 | engine / transformers f32 |")
    print("|---|---|---|---|---|---|---|---|")
    for k in counts:
        h32, h64 = med(hf[("f32", k)]), med(hf[("f64", k)])
        r, e = med(ours[("reference", k)]), med(ours[("engine mha", k)])
        print(f"| {k} | {h32:.3f} s | {h64:.3f} s | {r:.3f} s | {e:.3f} s | **{r / h64:.2f}x** | {r / h32:.2f}x | "
              f"{e / h32:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", default="p2,p1,p3")
    ap.add_argument("--workdir", type=Path, default=Path("/work/scale"))
    ap.add_argument("--bin", type=Path, default=REPO / "target" / "release" / "mla-diff")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds for P1 and P2")
    ap.add_argument("--threads", default=None, help="mla-diff thread counts for P2, e.g. 1,2 (default 1,all)")
    ap.add_argument("--regen", action="store_true", help="rewrite the P2 bench GGUF")
    ap.add_argument("--p1-tokens", type=int, default=19, help="run's default --tokens")
    ap.add_argument("--p3-tokens", type=int, default=128)
    ap.add_argument("--p3-rounds", type=int, default=4)
    ap.add_argument("--p3-runs", type=int, default=3, help="timed runs per process per round")
    ap.add_argument("--out-json", type=Path, default=None, help="default WORKDIR/bench_cpu.json")
    a = ap.parse_args()
    if not a.bin.exists():
        sys.exit(f"error: {a.bin} missing: cargo build --release")
    a.workdir.mkdir(parents=True, exist_ok=True)
    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cpus": os.cpu_count(),
                     "loadavg_start": load3(), "gguf": _version("gguf"), "numpy": np.__version__}
    for s in a.sections.split(","):
        {"p1": section_p1, "p2": section_p2, "p3": section_p3}[s.strip()](a, results)
    results["loadavg_end"] = load3()
    out = a.out_json or a.workdir / "bench_cpu.json"
    out.write_text(json.dumps(results, indent=1, default=str) + "\n")
    log(f"raw figures: {out}")


def _version(pkg: str) -> str:
    from importlib.metadata import version
    return version(pkg)


if __name__ == "__main__":
    main()
