"""``align demo``: the bundled example, end to end, in one command.

Until the paired Megatron-core vs MindFormers experiment lands, the demo compares the bundled example
logs (a Megatron-LM baseline, a repeat of it for the error band, and a MindFormers candidate).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from align.cli import EXIT
from align.examples.make_example_logs import write_examples
from align.procedure import report, stderr_progress


def run_demo(args: argparse.Namespace) -> int:
    out = Path(args.out)
    paths = write_examples(out / "inputs")
    data = report(str(paths["baseline"]), str(paths["candidate"]), str(out), [str(paths["repeat"])],
                  progress=stderr_progress)
    print(f"verdict: {data['verdict']}")
    print(f"inputs: {out / 'inputs'}")
    print(f"report: {(out / 'report.html').resolve()}")
    return EXIT[data["verdict"]]
