"""Issue 15's goals side by side: one table from the JSON files the benchmark scripts wrote (``--json``).

Rows: compare throughput against msprobe, dump overhead against msprobe (statistics and full tensors), the
1M-line log ingest and the 100k-step report, each with its goal and met / NOT met. A part whose JSON is
missing (msprobe not installed, a part skipped) prints its row as "not measured" and says why.

    .venv/bin/python benchmarks/summary.py --logs bench_out/logs.json --msprobe bench_out/msprobe.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

#: Goals: compare throughput >= 10x msprobe (DESIGN.md, "Our bar"); our dump step time no more than
#: msprobe's at the same level (ours / msprobe <= 1); the log path from issue 15.
COMPARE_GOAL_X = 10.0
OVERHEAD_GOAL_X = 1.0
#: Issue 15's own overhead goals: a dumped step over the undumped one.
STEP_GOALS = {"ours_stats": ("dump overhead, statistics: dumped step / undumped step", 1.2),
              "ours_full": ("dump overhead, full tensors: dumped step / undumped step", 2.0)}


def _load(path: str | None) -> tuple[dict[str, Any] | None, str]:
    if not path:
        return None, "not run"
    p = Path(path)
    if not p.is_file():
        return None, f"{p} missing"
    try:
        return json.loads(p.read_text()), ""
    except (OSError, json.JSONDecodeError) as exc:
        return None, f"{p}: {exc}"


def rows_msprobe(data: dict[str, Any] | None, why: str) -> list[tuple[str, str, str, str]]:
    """(measure, goal, measured, verdict) rows of bench_vs_msprobe.py's JSON."""
    out = []
    compare = (data or {}).get("compare") or {}
    ours, ms = compare.get("ours"), compare.get("msprobe")
    name = "compare throughput, ours / msprobe (same dump pair)"
    goal = f">= {COMPARE_GOAL_X:g}x"
    if ours and ms and ms.get("mb_per_s_best") and ms.get("mb_per_s"):
        variants = [(name, ours)] + [(f"{name}, {k[len('ours_'):]} readers", v) for k, v in compare.items()
                                     if k.startswith("ours_jobs") and isinstance(v, dict) and v.get("mb_per_s")]
        for label, v in variants:
            best = v["mb_per_s_best"] / ms["mb_per_s_best"]
            med = v["mb_per_s"] / ms["mb_per_s"]
            out.append((label, goal, f"{best:.1f}x best wall, {med:.1f}x median wall",
                        "met" if med >= COMPARE_GOAL_X else "NOT met"))
    else:
        out.append((name, goal, "not measured", why or "no msprobe compare in the JSON"))
    overhead = (data or {}).get("overhead") or {}
    for key, (label, limit) in STEP_GOALS.items():
        r = overhead.get(key)
        if isinstance(r, dict) and "median" in r:
            judged = r.get("paired_median", r["median"])   # older JSON: no paired ratios
            paired = f"{judged:.2f}x paired median, " if "paired_median" in r else ""
            out.append((label, f"<= {limit:g}x", f"{paired}{r['min']:.2f}x min, {r['median']:.2f}x median wall "
                        f"(CPU {r.get('cpu_median', float('nan')):.2f}x)",
                        "met" if judged <= limit else "NOT met"))
        else:
            out.append((label, f"<= {limit:g}x", "not measured", why or "no overhead in the JSON"))
    vs = ((data or {}).get("overhead") or {}).get("toolkit_over_msprobe") or {}
    for what, label in (("statistics", "dump overhead, statistics: step time ours / msprobe"),
                        ("full tensors", "dump overhead, full tensors: step time ours / msprobe")):
        goal = f"<= {OVERHEAD_GOAL_X:g}x"
        if what in vs:
            out.append((label, goal, f"{vs[what]:.2f}x median", "met" if vs[what] <= OVERHEAD_GOAL_X else "NOT met"))
        else:
            out.append((label, goal, "not measured", why or "no msprobe overhead in the JSON"))
    return out


LOG_ROWS = {
    "ingest_megatron": "ingest, {lines:,}-line Megatron-LM log",
    "ingest_mindformers": "ingest, {lines:,}-line MindFormers log",
    "report_logs": "report, {steps:,}-step logs (pair + repeat)",
    "report_golden": "report, {steps:,}-step golden-values pair",
}


def rows_logs(data: dict[str, Any] | None, why: str) -> list[tuple[str, str, str, str]]:
    """Rows of bench_logs.py's JSON: judged on the best wall time (the least loaded repeat), median wall
    and median CPU seconds beside it."""
    out = []
    for key, label in LOG_ROWS.items():
        res = (data or {}).get(key)
        if not res:
            out.append((label.format(lines=1_000_000, steps=100_000), "", "not measured", why or "part not run"))
            continue
        label = label.format(lines=res.get("lines", 0), steps=res.get("steps", 0))
        goal = res["goal_s"]
        wall = res["wall_s"]
        out.append((label, f"<= {goal:g} s", f"{min(wall):.2f} s best wall (median {statistics.median(wall):.2f};"
                    f" CPU {statistics.median(res['cpu_s']):.2f})", "met" if min(wall) <= goal else "NOT met"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--logs", help="bench_logs.py --json output")
    ap.add_argument("--msprobe", help="bench_vs_msprobe.py --json output")
    a = ap.parse_args()
    ms, ms_why = _load(a.msprobe)
    logs, logs_why = _load(a.logs)
    if ms is not None and not ms.get("msprobe_available", True):
        ms_why = "msprobe not installed"
    rows = rows_msprobe(ms, ms_why) + rows_logs(logs, logs_why)
    head = ("measure", "goal", "measured", "verdict")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(4)]
    print("\n== issue 15: every goal side by side ==")
    for r in [head, tuple("-" * w for w in widths), *rows]:
        print("  " + "  ".join(f"{c:<{w}}" for c, w in zip(r, widths, strict=True)))
    print("  (log rows: judged on the best wall time over the repeats, the least loaded one on a shared machine;"
          " median wall and median CPU seconds beside it)")


if __name__ == "__main__":
    main()
