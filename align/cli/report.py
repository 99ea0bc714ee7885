"""`align report BASELINE CANDIDATE --out DIR`: every stage of the procedure, then report.html and summary.json."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

HELP = "compare a candidate run with a baseline and write the report"


def description() -> str:
    from sources import sources
    kinds = "; ".join(s.describe for s in sources())
    return (f"Each RUN is detected: {kinds}. Every stage of the procedure runs when its evidence is there; "
            "a skipped stage says what to capture.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from align.procedure.arguments import add_report_arguments
    parser.description = description()
    add_report_arguments(parser)
    parser.add_argument("--explain", action="store_true",
                        help="print every skipped stage with what to capture to run it (default: one line "
                             "listing them; the report always shows them)")


def run(args: argparse.Namespace) -> int:
    from align.procedure import report, stderr_progress
    from align.procedure.arguments import report_inputs
    from core.findings import EXIT
    data = report(report_inputs(args), args.out, None if args.quiet else stderr_progress)
    _print_verdict(data, Path(args.out), args.explain)
    if args.strict and data["verdict"] == "warn":
        return 1
    return EXIT[data["verdict"]]


def _print_verdict(data: dict, out: Path, explain: bool = False) -> None:
    from reports.terminal import lines
    try:
        print("\n".join(lines(data, out, explain)), flush=True)
    except BrokenPipeError:  # `align report ... | head`: the reader left early; the exit status still counts
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
