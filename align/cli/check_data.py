"""`align check-data PATH`: token ids, masks and EOD handling of recorded batches."""

from __future__ import annotations

import argparse
import json

HELP = "data checks over a run store or the step_N/rank_R layout"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`align check-data PATH [--vocab-size V] [--eos-id E] [--pad-id P] [--json OUT|-]`."""
    parser.add_argument("path", help="run store, or a step_N/rank_R/*.npy batch dump")
    parser.add_argument("--vocab-size", type=int, help="ids must lie in [0, vocab) (default: what a run store "
                        "recorded: its Megatron arguments' padded vocabulary, a dumper's data block)")
    parser.add_argument("--eos-id", type=int, help="EOD / eos token id (default: what a run store recorded)")
    parser.add_argument("--pad-id", type=int, help="pad token id (default: what a run store recorded)")
    parser.add_argument("--ignore-index", type=int, default=-100,
                        help="label value that means 'no target' (default: %(default)s)")
    parser.add_argument("--json", metavar="OUT",
                        help="also write findings as JSON to OUT ('-' = stdout, JSON only; default: text only)")


def _store_ids(path: str) -> dict:
    """What a run store recorded of its vocabulary and special ids (its meta ``data`` block, its Megatron
    arguments), so that a store checks against its own padded vocabulary without --vocab-size."""
    from pathlib import Path

    from align.stages.data_checks import recorded_ids
    from align.stages.evidence import meta_config
    from runstore import RunReader

    if not (Path(path) / "meta.json").is_file():
        return {}
    meta = RunReader(path).meta
    return recorded_ids([(meta, meta_config(meta))])


def run(args: argparse.Namespace) -> int:
    from align.checks.data import check_batches, iter_batches
    from align.stages.data_checks import with_options
    from core.outputs import check_out_file, write_text_output

    if args.json:
        check_out_file(args.json, "--json")   # before the batches are read
    ids = with_options(_store_ids(args.path), args.vocab_size, args.eos_id, args.pad_id)
    res = check_batches(iter_batches(args.path), ignore_index=args.ignore_index, **ids)
    payload = {"verdict": res.verdict, **res.details, "vocabulary": ids,
               "findings": [f.to_json() for f in res.findings]}
    if args.json == "-":
        print(json.dumps(payload, indent=2))
    else:
        for f in res.findings:
            print(f"{f.verdict.upper():4} {f.message}")
        if ids.get("vocab_size") is not None:
            print(f"vocabulary: {ids['vocab_size']} ({ids.get('vocab_source', 'recorded in the store')})")
        print(f"check-data: {res.verdict} ({res.details['batches']} batches)")
        if args.json:
            write_text_output(args.json, json.dumps(payload, indent=2))
    return 1 if res.verdict == "fail" else 0
