"""Tensor-compare throughput (GB/s) and peak RSS on two full-tensor dumps of >= 2 GB each, against the
machine's limit: a plain sequential read of the same files, timed in the same run.

Why: full-tensor dumps of a real model run to gigabytes; the comparator must stream them (bounded memory) and
be bound by reading the bytes (issue 28: compare wall time <= 1.3x a plain read of the same bytes). The
anchor: msprobe compares 2 x 1.83 GB in 25 s (~150 MB/s of input), ~505 MB RSS.

Generates two run stores in a temporary directory (baseline; candidate = baseline + 1e-6 relative noise, one
tensor perturbed by 1e-3). Page cache: warm for both. The generator just wrote the files and one untimed
plain read goes over them before timing (the machine has the memory to hold both dumps), so the plain read
and the compare both read from the page cache; nothing is dropped. Each repeat then runs, each in a fresh
subprocess (so peak RSS is the comparator's own; times exclude interpreter start-up and imports): the plain
read (every .h5 file of both dumps, in order, 16 MiB ``readinto`` calls, one thread) and the compare at
jobs=1, at the product's default (2 reader threads) and with 2 reader processes; the order rotates per
repeat. Ratio = compare wall / the same repeat's plain-read wall (paired), min and median over repeats.

    python benchmarks/bench_tensor_compare.py [--gb 2.1] [--repeats 3] [--keep DIR] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TENSOR = 4 * 1024 * 2048          # elements per tensor (32 MiB of float32): a [4, 1024, 2048] activation


def generate(root: Path, gb: float) -> int:
    from runstore import RunWriter

    n = max(1, int(gb * 1e9 // (TENSOR * 4)) + 1)
    rng = np.random.default_rng(0)
    writers = {s: RunWriter(root / s, rank=0, meta={"framework": "bench"}) for s in ("base", "cand")}
    rows = {s: [] for s in writers}
    for i in range(n):
        a = rng.standard_normal(TENSOR, dtype=np.float32).reshape(4, 1024, 2048)
        b = a + (a * np.float32(1e-6 if i != n // 2 else 1e-3))
        for s, arr in (("base", a), ("cand", b)):
            writers[s].put_array(1, f"tensors/{i:06d}", arr, attrs={"module": f"decoder.layers.{i}", "kind":
                                                                    "forward.output.0", "dtype": "float32"})
            rows[s].append((i, float(np.linalg.norm(arr.ravel())), float(arr.max()), float(arr.min())))
    for s, w in writers.items():
        r = rows[s]
        w.put_table(1, "tensor_stats", {
            "order": np.array([x[0] for x in r]), "module": np.array([f"decoder.layers.{x[0]}" for x in r]),
            "kind": np.array(["forward.output.0"] * len(r)), "dtype": np.array(["float32"] * len(r)),
            "shape": np.array(["4x1024x2048"] * len(r)), "numel": np.full(len(r), TENSOR),
            "max": np.array([x[2] for x in r]), "min": np.array([x[3] for x in r]),
            "mean": np.zeros(len(r)), "norm": np.array([x[1] for x in r]),
            "nan": np.zeros(len(r), int), "inf": np.zeros(len(r), int)})
        w.close()
    return n


def measure(root: Path, threads: int, executor: str = "thread") -> dict:
    """Runs in a fresh process: compare, report wall time, bytes and peak RSS (above the imports' RSS, and
    of the largest reader process when readers are processes)."""
    import resource

    from comparators.layer_tensors import compare_layer_tensors
    from models import load_mapping
    from sources.layers import layer_source

    nbytes = sum(f.stat().st_size for s in ("base", "cand") for f in (root / s / "steps").rglob("*.h5"))
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0 = time.perf_counter()
    res = compare_layer_tensors(layer_source(root / "base"), layer_source(root / "cand"), load_mapping(),
                                jobs=threads, executor=executor)
    dt = time.perf_counter() - t0
    self_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    child_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {"bytes_both_sides": nbytes, "seconds": dt, "gb_per_s": nbytes / dt / 1e9, "threads": threads,
            "executor": executor, "peak_rss_mb": max(self_mb, child_mb), "rss_over_imports_mb": self_mb - rss0,
            "worker_peak_rss_mb": child_mb if executor == "process" else None,
            "rows": res.details["compared"], "first_departing": res.details["first_departing_forward"]}


def plain_read(root: Path) -> dict:
    """The machine's limit for this input: every .h5 file of both dumps read once, in order, with 16 MiB
    ``readinto`` calls into one buffer (no parsing, one thread)."""
    files = sorted(f for s in ("base", "cand") for f in (root / s / "steps").rglob("*.h5"))
    buf = bytearray(16 << 20)
    view = memoryview(buf)
    total = 0
    t0 = time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(view):
                total += n
    dt = time.perf_counter() - t0
    return {"bytes_both_sides": total, "seconds": dt, "gb_per_s": total / dt / 1e9, "files": len(files)}


def _sub(root: Path, threads: int, executor: str) -> dict:
    """One measurement in a fresh process: the compare (``threads`` readers on ``executor``) or, with
    executor "read", the plain read."""
    out = subprocess.run([sys.executable, __file__, "--_measure", str(root), "--threads", str(threads),
                          "--executor", executor], capture_output=True, text=True, check=True, env=dict(os.environ))
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=2.1, help="size of EACH dump in GB (default 2.1)")
    ap.add_argument("--threads", type=int, default=2, help="parallel readers (threads, then processes)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of (plain read, every compare variant)")
    ap.add_argument("--executor", default="thread", help=argparse.SUPPRESS)
    ap.add_argument("--keep", help="generate into this directory and keep it")
    ap.add_argument("--json", help="also write the numbers to this JSON file (for benchmarks/summary.py)")
    ap.add_argument("--_measure", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._measure:
        root = Path(args._measure)
        print(json.dumps(plain_read(root) if args.executor == "read" else measure(root, args.threads, args.executor)))
        return
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench_tensors_"))
    try:
        t0 = time.perf_counter()
        n = generate(root, args.gb)
        print(f"generated 2 dumps x {n} tensors of {TENSOR * 4 / 2**20:.0f} MiB in {time.perf_counter() - t0:.0f} s")
        tensor_mb = TENSOR * 4 / 2**20
        variants = [(0, "read"), (1, "thread")] + ([(args.threads, "thread"), (args.threads, "process")]
                                                   if args.threads > 1 else [])
        warm = _sub(root, 0, "read")      # untimed: both dumps in the page cache before anything is timed
        print(f"page cache: warm for both (files just written, then one untimed plain read: "
              f"{warm['gb_per_s']:.2f} GB/s); nothing dropped", flush=True)
        runs: dict[str, list[dict]] = {}
        paired: dict[str, list[float]] = {}
        for rep in range(args.repeats):
            k = rep % len(variants)
            for threads, executor in variants[k:] + variants[:k]:
                name = "plain_read" if executor == "read" else f"jobs{threads}_{executor}"
                r = _sub(root, threads, executor)
                runs.setdefault(name, []).append(r)
                if executor == "read":
                    print(f"  plain read    : {r['bytes_both_sides'] / 1e9:.2f} GB in {r['seconds']:.2f} s -> "
                          f"{r['gb_per_s']:.2f} GB/s", flush=True)
                    continue
                extra = (f" (reader processes: largest {r['worker_peak_rss_mb']:.0f} MB)"
                         if r["worker_peak_rss_mb"] is not None else "")
                print(f"  jobs={threads} {executor:7s}: {r['bytes_both_sides'] / 1e9:.2f} GB (both sides) in "
                      f"{r['seconds']:.2f} s -> {r['gb_per_s']:.2f} GB/s; peak RSS {r['peak_rss_mb']:.0f} MB, "
                      f"{r['rss_over_imports_mb']:.0f} MB above the imports = "
                      f"{r['rss_over_imports_mb'] / tensor_mb:.2f}x the largest tensor{extra}; {r['rows']} tensor "
                      f"pairs; first departing: {r['first_departing']['module'] if r['first_departing'] else None}",
                      flush=True)
            for name, rs in runs.items():
                if name != "plain_read" and len(rs) == rep + 1:
                    paired.setdefault(name, []).append(rs[-1]["seconds"] / runs["plain_read"][-1]["seconds"])
        summary: dict = {"gb_each": args.gb, "page_cache": "warm for both (one untimed plain read first)",
                         "default": f"jobs{args.threads}_thread", "variants": {}}
        print("\ncompare wall / plain-read wall of the same repeat (paired), min and median over repeats:")
        for name, rs in runs.items():
            secs = [r["seconds"] for r in rs]
            v = {"seconds": secs, "gb_per_s": [r["gb_per_s"] for r in rs], "bytes": rs[0]["bytes_both_sides"]}
            if name in paired:
                v.update(ratio_min=min(paired[name]), ratio_median=statistics.median(paired[name]),
                         paired=paired[name], peak_rss_mb=max(r["peak_rss_mb"] for r in rs))
                print(f"  {name:16s} {min(paired[name]):.2f}x min, {statistics.median(paired[name]):.2f}x median "
                      f"(best {max(v['gb_per_s']):.2f} GB/s)")
            summary["variants"][name] = v
        if args.json:
            summary["loadavg"] = list(os.getloadavg())
            Path(args.json).write_text(json.dumps(summary, indent=1))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
