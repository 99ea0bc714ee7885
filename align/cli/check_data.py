"""`align check-data PATH`: token ids, masks and EOD handling of recorded batches."""

from __future__ import annotations

import argparse
import json

HELP = "data checks over a run store or the step_N/rank_R layout"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`align check-data PATH [--vocab-size V] [--eos-id E] [--pad-id P] [--json OUT|-]`."""
    parser.add_argument("path", help="run store, or a step_N/rank_R/*.npy batch dump")
    parser.add_argument("--vocab-size", type=int, help="ids must lie in [0, vocab)")
    parser.add_argument("--eos-id", type=int, help="EOD / eos token id")
    parser.add_argument("--pad-id", type=int, help="pad token id")
    parser.add_argument("--ignore-index", type=int, default=-100, help="label value that means 'no target'")
    parser.add_argument("--json", metavar="OUT", help="write findings as JSON to OUT ('-' = stdout)")


def run(args: argparse.Namespace) -> int:
    from align.checks.data import check_batches, iter_batches
    from core.outputs import write_text_output

    res = check_batches(iter_batches(args.path), vocab_size=args.vocab_size, eos_id=args.eos_id,
                        pad_id=args.pad_id, ignore_index=args.ignore_index)
    payload = {"verdict": res.verdict, **res.details, "findings": [f.to_json() for f in res.findings]}
    if args.json == "-":
        print(json.dumps(payload, indent=2))
    else:
        for f in res.findings:
            print(f"{f.verdict.upper():4} {f.message}")
        print(f"check-data: {res.verdict} ({res.details['batches']} batches)")
        if args.json:
            write_text_output(args.json, json.dumps(payload, indent=2))
    return 1 if res.verdict == "fail" else 0
