"""Log path benchmark: ingest of a 1,000,000-line Megatron log and `align report` on a 100,000-step pair.

Prints min / median over repeats (this machine is shared and noisy) and the ratio to the goals from
issue 2 (ingest <= 2 s, report <= 5 s). Inputs are generated in a temporary folder and removed.

    .venv/bin/python benchmarks/bench_logs.py [--repeats 3] [--lines 1000000] [--steps 100000]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from align.examples.make_example_logs import megatron_log, mindformers_log
from align.procedure import report
from align.sources.megatron_log import parse_megatron_log
from align.stages import Inputs


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def line(ms: list[float], goal: float, what: str) -> None:
    print(f"{what:<46} min {min(ms):6.2f} s  median {statistics.median(ms):6.2f} s  goal {goal:.0f} s  "
          f"median/goal {statistics.median(ms) / goal:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--steps", type=int, default=100_000)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        big = d / "megatron_1m.log"
        megatron_log(big, a.lines, seed=1)  # one iteration line per step: the worst case for a line count
        mb = big.stat().st_size / 2**20
        ms = timed(lambda: parse_megatron_log(big), a.repeats)
        line(ms, 2.0, f"ingest {a.lines:,} Megatron lines ({mb:.0f} MB)")
        print(f"{'':<46} throughput {mb / statistics.median(ms):.0f} MB/s")

        base, rep, cand = d / "b.log", d / "r.log", d / "c.log"
        megatron_log(base, a.steps, seed=1)
        megatron_log(rep, a.steps, seed=2)
        mindformers_log(cand, a.steps, seed=3)
        ms = timed(lambda: report(Inputs(str(base), str(cand), repeats=[str(rep)]), str(d / "out")), a.repeats)
        line(ms, 5.0, f"report {a.steps:,}-step pair + 1 repeat")


if __name__ == "__main__":
    main()
