"""Issue 28's goals side by side: one table from the JSON files the benchmark scripts wrote (``--json``).

Rows, each with its goal, the measured min and median of one run (ratios: of pairs measured side by side in
that run) and met / NOT met: the tensor compare against a plain read of the same bytes and against msprobe,
the dump overhead (statistics, full tensors, named norms + batch), the 1M-line log ingest (clean and
garbled), the 100k-step report, the fresh-clone ``make demo`` / ``make test`` times (measured by hand, given
as a JSON file or flags), and the scale run on a Dask cluster (measured, no goal: docs/scale.md uses it).
A part whose JSON is missing prints its row as "not measured" and says why.

    .venv/bin/python benchmarks/summary.py --logs bench_out/logs.json --msprobe bench_out/msprobe.json \\
        --tensors bench_out/tensors.json --scale bench_out/scale.json \\
        [--fresh bench_out/fresh_clone.json | --demo-s 170 --test-s 460]

``--fresh`` JSON: {"make_demo_s": seconds, "make_test_s": seconds} (either may be absent).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

Row = tuple[str, str, str, str]

#: Issue 28's goals.
COMPARE_VS_READ_X = 1.3          # compare wall / plain sequential read of the same bytes
COMPARE_VS_MSPROBE_X = 15.0      # our compare throughput / msprobe's, median wall
STEP_GOALS = {"ours_stats": ("dump overhead, statistics of every module: dumped / undumped step", 1.10),
              "ours_full": ("dump overhead, full tensors: dumped / undumped step", 1.3),
              "ours_norms": ("dump overhead, named norms + batch: dumped / undumped step", 1.03)}
FRESH_GOALS = {"make_demo_s": ("`make demo` from a fresh clone (environment included)", 180.0),
               "make_test_s": ("`make test` from a fresh clone (environment included)", 480.0)}
#: Issue 15's: our dump step no slower than msprobe's at the same level (kept as a reference).
OVERHEAD_VS_MSPROBE_X = 1.0


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


def _verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def rows_tensors(data: dict[str, Any] | None, why: str) -> list[Row]:
    """bench_tensor_compare.py: compare wall / plain-read wall of the same repeat, judged on the median."""
    label = "tensor compare / plain sequential read of the same bytes"
    goal = f"<= {COMPARE_VS_READ_X:g}x"
    variants = (data or {}).get("variants") or {}
    default = (data or {}).get("default")
    out = []
    for name, v in variants.items():
        if "ratio_median" not in v:
            continue
        what = f"{label} ({name.replace('_', ' ')}{', the default' if name == default else ''})"
        read = variants.get("plain_read", {})
        out.append((what, goal, f"{v['ratio_min']:.2f}x min, {v['ratio_median']:.2f}x median (compare "
                    f"{max(v['gb_per_s']):.2f} GB/s, read {max(read.get('gb_per_s', [0])):.2f} GB/s best; "
                    f"{v['bytes'] / 1e9:.1f} GB, cache warm)",
                    _verdict(v["ratio_median"] <= COMPARE_VS_READ_X) if name == default else "(reference)"))
    return out or [(label, goal, "not measured", why or "no compare variants in the JSON")]


def rows_msprobe(data: dict[str, Any] | None, why: str) -> list[Row]:
    """bench_vs_msprobe.py: compare throughput against msprobe, and the dump overhead."""
    out = []
    compare = (data or {}).get("compare") or {}
    ours, ms = compare.get("ours"), compare.get("msprobe")
    name = "compare throughput, ours / msprobe (same dump pair)"
    goal = f">= {COMPARE_VS_MSPROBE_X:g}x"
    if ours and ms and ms.get("mb_per_s_best") and ms.get("mb_per_s"):
        variants = [(name, ours)] + [(f"{name}, {k[len('ours_'):]} readers", v) for k, v in compare.items()
                                     if k.startswith("ours_jobs") and isinstance(v, dict) and v.get("mb_per_s")]
        for label, v in variants:
            best = v["mb_per_s_best"] / ms["mb_per_s_best"]
            med = v["mb_per_s"] / ms["mb_per_s"]
            out.append((label, goal, f"{best:.1f}x best wall, {med:.1f}x median wall",
                        _verdict(med >= COMPARE_VS_MSPROBE_X)))
    else:
        why_ms = why or ("msprobe not installed" if data is not None and not data.get("msprobe_available", True)
                         else "no msprobe compare in the JSON")
        out.append((name, goal, "not measured", why_ms))
    overhead = (data or {}).get("overhead") or {}
    steps = overhead.get("steps") or {}
    for key, (label, limit) in STEP_GOALS.items():
        r = overhead.get(key)
        if isinstance(r, dict) and "paired_median" in r:
            n, reps = len((steps.get(key) or {}).get("wall", [])), len(r["paired"])
            out.append((label, f"<= {limit:g}x", f"{min(r['paired']):.3f}x min, {r['paired_median']:.3f}x median "
                        f"(paired; CPU {r.get('cpu_median', float('nan')):.2f}x; {n // max(reps, 1)} steps x {reps})",
                        _verdict(r["paired_median"] <= limit)))
        else:
            out.append((label, f"<= {limit:g}x", "not measured", why or f"no {key} in the JSON"))
    vs = overhead.get("toolkit_over_msprobe") or {}
    for what in ("statistics", "full tensors"):
        label = f"dump step time, {what}: ours / msprobe (issue 15)"
        goal = f"<= {OVERHEAD_VS_MSPROBE_X:g}x"
        if what in vs:
            out.append((label, goal, f"{vs[what]:.2f}x median", _verdict(vs[what] <= OVERHEAD_VS_MSPROBE_X)))
        else:
            out.append((label, goal, "not measured", why or "no msprobe overhead in the JSON"))
    return out


LOG_ROWS = {
    "ingest_megatron": "ingest, {lines:,}-line Megatron-LM log",
    "ingest_mindformers": "ingest, {lines:,}-line MindFormers log",
    "garbled_megatron": "ingest, Megatron-LM log with {garbled:,} garbled values / clean",
    "garbled_mindformers": "ingest, MindFormers log with {garbled:,} garbled values / clean",
    "report_logs": "report, {steps:,}-step logs (pair + repeat)",
    "report_golden": "report, {steps:,}-step golden-values pair (issue 15)",
}


def rows_logs(data: dict[str, Any] | None, why: str) -> list[Row]:
    """bench_logs.py: seconds judged on the best wall time (the least loaded repeat), median beside it;
    garbled / clean judged on the median of the pairs' ratios."""
    out = []
    for key, label in LOG_ROWS.items():
        res = (data or {}).get(key)
        if not res:
            out.append((label.format(lines=1_000_000, steps=100_000, garbled=1000), "", "not measured",
                        why or "part not run"))
            continue
        label = label.format(lines=res.get("lines", 0), steps=res.get("steps", 0),
                             garbled=res.get("garbled_records", 0))
        if "ratio" in res:
            goal = res["goal_x"]
            g = res["garbled"]["wall_s"]
            out.append((label, f"<= {goal:g}x", f"{res['ratio_min']:.2f}x min, {res['ratio_median']:.2f}x median "
                        f"(paired; garbled {min(g):.2f} s best, {statistics.median(g):.2f} s median)",
                        _verdict(res["ratio_median"] <= goal)))
            continue
        goal, wall = res["goal_s"], res["wall_s"]
        out.append((label, f"<= {goal:g} s", f"{min(wall):.2f} s min, {statistics.median(wall):.2f} s median wall "
                    f"(CPU {statistics.median(res['cpu_s']):.2f} s)", _verdict(min(wall) <= goal)))
    return out


def rows_fresh(data: dict[str, Any] | None, why: str) -> list[Row]:
    """Fresh-clone times, measured by hand (a loaded machine makes them meaningless inside `make bench`)."""
    out = []
    for key, (label, limit) in FRESH_GOALS.items():
        s = (data or {}).get(key)
        goal = f"<= {limit / 60:g} min"
        if isinstance(s, (int, float)):
            out.append((label, goal, f"{s:.0f} s ({s / 60:.1f} min)", _verdict(s <= limit)))
        else:
            out.append((label, goal, "not measured", why or f"no {key} given (measured by hand, --fresh)"))
    return out


def rows_scale(data: dict[str, Any] | None, why: str) -> list[Row]:
    """bench_scale.py: throughput and peak memory per worker, the scaling (no goal: docs/scale.md)."""
    label = "scale: 64-rank 48-layer MoE store on Dask"
    if not data or not data.get("dask"):
        return [(label, "measured", "not measured", why or "no Dask runs in the JSON")]
    st = data["store"]
    out = []
    head = (f"{st['ranks']} ranks x {st['layers']} layers, {data['stats_rows']:,} statistics row pairs, "
            f"{st['tensor_bytes_both_sides'] / 1e9:.2f} GB full tensors")
    for r in data["dask"]:
        same = r.get("full_same_as_local") and r.get("stats_same_as_local")
        out.append((f"scale, {r['workers']} Dask worker(s): {head}", "measured",
                    f"full {r['full_gb_per_s_per_worker']:.2f} GB/s/worker, stats "
                    f"{r['stats_rows_per_s_per_worker']:,.0f} row pairs/s/worker; peak RSS/worker "
                    f"{max(r['peak_rss_mb']):.0f} MB", "same as local" if same else "DIFFERS from local"))
    sc = data.get("scaling") or {}
    if sc:
        out.append((f"scale, {sc['workers'][0]} -> {sc['workers'][1]} workers (wall time ratio)", "measured",
                    f"full tensors {sc['full']:.2f}x, statistics {sc['stats']:.2f}x ({data.get('cores')} cores, "
                    "shared)", "(no goal)"))
    return out


def _loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--logs", help="bench_logs.py --json output")
    ap.add_argument("--msprobe", help="bench_vs_msprobe.py --json output")
    ap.add_argument("--tensors", help="bench_tensor_compare.py --json output")
    ap.add_argument("--scale", help="bench_scale.py --json output")
    ap.add_argument("--fresh", help='JSON {"make_demo_s": S, "make_test_s": S}: fresh-clone times measured by hand')
    ap.add_argument("--demo-s", type=float, help="fresh-clone `make demo` seconds (overrides --fresh)")
    ap.add_argument("--test-s", type=float, help="fresh-clone `make test` seconds (overrides --fresh)")
    a = ap.parse_args()
    ms, ms_why = _load(a.msprobe)
    fresh, fresh_why = _load(a.fresh) if a.fresh else (None, "")
    fresh = dict(fresh or {})
    for key, value in (("make_demo_s", a.demo_s), ("make_test_s", a.test_s)):
        if value is not None:
            fresh[key] = value
    if not fresh:
        fresh_why = (f"{fresh_why}; " if fresh_why else "") + "measured by hand: --fresh JSON or --demo-s / --test-s"
    parts = {"tensors": _load(a.tensors), "msprobe": (ms, ms_why), "logs": _load(a.logs), "scale": _load(a.scale)}
    rows = (rows_tensors(*parts["tensors"]) + rows_msprobe(ms, ms_why) + rows_logs(*parts["logs"])
            + rows_fresh(fresh, "" if fresh else fresh_why) + rows_scale(*parts["scale"]))
    head = ("measure", "goal", "measured (one run)", "verdict")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(4)]
    print(f"\n== issue 28: every goal side by side (load average at the summary: {_loadavg()}) ==")
    for r in [head, tuple("-" * w for w in widths), *rows]:
        print("  " + "  ".join(f"{c:<{w}}" for c, w in zip(r, widths, strict=True)).rstrip())
    print("  ratios: of pairs measured side by side in the same run, judged on their median (min beside it); "
          "seconds: judged on the\n  best wall time over the repeats (the least loaded one on a shared machine), "
          "median beside it")
    loads = [f"{k} {' '.join(f'{x:.1f}' for x in d['loadavg'])}" for k, (d, _) in parts.items()
             if d and isinstance(d.get("loadavg"), list)]
    if loads:
        print("  load average (1, 5, 15 min) at the end of each part: " + "; ".join(loads))
    missing = sum(r[2] == "not measured" for r in rows)
    failed = sum(r[3] == "NOT met" for r in rows)
    print(f"  {len(rows)} rows: {failed} NOT met, {missing} not measured")


if __name__ == "__main__":
    main()
