"""Each judged quantity's ratio to its noise floor, before (the dtype line) and after (the measured floor).

Why: issue 25 item 1 asks for the demo's fault table and clean pairs judged against measured noise; this
prints, per pair and per floor-judged stage (lr0_run, step1_local_norm, layer_tensors, optimizer), the worst
row: its difference, the dtype line it was judged against before and that ratio with the verdict it gave,
then the measured floor, the ratio to it and today's verdict.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/noise_floor_ratios.py --run OUT [--seeds 1234,5]  # clean
        dense + moe pairs at each seed and every candidate-side fault of each kind on its first clean pair
        (dense: steps 12, lr=0 steps 3; moe: 6 and 2; ~6 min a seed on 2 cores)
    PYTHONPATH=$PWD .venv/bin/python benchmarks/noise_floor_ratios.py DEMO_OUT ...  # existing demo outputs
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

STAGES = {"lr0_run": ("floors", "quantity", "max_rel"), "step1_local_norm": ("parameters", "name", "rel_diff"),
          "layer_tensors": ("rows", "module", "value"), "optimizer": ("parameters", "name", "rel_diff")}


def rows_of(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Per stage judged against floors: the row with the largest ratio (or, without floors, the largest value
    over its dtype line)."""
    out = []
    for stage, (key, name, value) in STAGES.items():
        st = summary["stages"].get(stage, {})
        rows = [r for r in st.get(key) or [] if "floor_source" in r]
        if not rows:
            out.append({"stage": stage, "verdict_after": st.get("verdict"), "component": None})
            continue

        def before(r: dict[str, Any], value: str = value) -> float:
            v = r[value] if r[value] is not None else math.inf     # summary.json writes inf / nan as null
            return v / r["dtype_line"] if r.get("dtype_line") else math.nan

        def after(r: dict[str, Any], value: str = value) -> float:
            return r["ratio"] if r.get("ratio") is not None else (math.inf if r[value] is None else -1.0)

        worst = max(rows, key=lambda r: (after(r), before(r)))
        comp = worst[name] + (f" {worst['kind']}" if stage == "layer_tensors" else "")
        out.append({"stage": stage, "component": comp, "value": worst[value], "dtype_line": worst.get("dtype_line"),
                    "ratio_before": before(worst), "verdict_before": worst.get("dtype_verdict"),
                    "floor": worst.get("floor"), "ratio_after": worst.get("ratio"), "verdict_after": worst["verdict"],
                    "floor_source": worst.get("floor_source"), "stage_verdict": st.get("verdict")})
    return out


def fmt(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def print_table(label: str, summary: dict[str, Any]) -> None:
    print(f"\n## {label}: overall {summary['verdict']}")
    print("| stage | worst row | difference | dtype line | ratio before | verdict before | floor | ratio after | "
          "verdict after | floor source |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows_of(summary):
        print("| " + " | ".join(fmt(r.get(k)) for k in (
            "stage", "component", "value", "dtype_line", "ratio_before", "verdict_before", "floor", "ratio_after",
            "verdict_after", "floor_source")) + " |")


def run_all(out: Path, seeds: list[int]) -> list[Path]:
    """Clean dense and moe pairs at every seed; each candidate-side fault of a kind on that kind's first clean
    pair (its baseline reused)."""
    from demo.pair import paired_demo
    from demo.spec import FAULTS

    done = []
    for kind, steps, lr0 in (("dense", 12, 3), ("moe", 6, 2)):
        for seed in seeds:
            clean = out / f"clean_{kind}_seed{seed}"
            paired_demo(clean, steps=steps, lr0_steps=lr0, model_kind=kind, seed=seed)
            done.append(clean)
        first = out / f"clean_{kind}_seed{seeds[0]}"
        for name, f in FAULTS.items():
            if f.side in ("candidate", "conversion") and kind in f.kinds:
                paired_demo(out / f"{kind}_{name}", steps=steps, lr0_steps=lr0, inject=name, reuse_baseline=first,
                            repeat=False, model_kind=kind, seed=seeds[0])
                done.append(out / f"{kind}_{name}")
    return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="*", type=Path, help="demo outputs (each with summary.json)")
    ap.add_argument("--run", type=Path, help="run the clean pairs and the candidate-side faults here first")
    ap.add_argument("--seeds", default="1234", help="comma-separated seeds of the clean pairs (default 1234)")
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    dirs = (run_all(args.run, seeds) if args.run else []) + list(args.dirs)
    for d in dirs:
        print_table(d.name, json.loads((d / "summary.json").read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
