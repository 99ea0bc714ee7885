"""`align check-config MEGATRON MINDFORMERS_YAML`: the checklist of both runs' settings, side by side."""

from __future__ import annotations

import argparse
import json

HELP = "config checklist: Megatron arguments vs MindFormers YAML"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`align check-config MEGATRON MINDFORMERS_YAML [--json OUT|-]`."""
    parser.add_argument("megatron", help="Megatron log (arguments block), launch script, or JSON arguments")
    parser.add_argument("mindformers", help="MindFormers YAML config")
    parser.add_argument("--json", metavar="OUT",
                        help="also write machine-readable results to OUT ('-' = stdout, JSON only; default: the table "
                             "only)")


def run(args: argparse.Namespace) -> int:
    from align.checks.config import compare_configs, config_bases, format_table
    from core.outputs import check_out_file, write_text_output
    from sources.configs import read_megatron, read_mindformers

    if args.json:
        check_out_file(args.json, "--json")   # before the configs are read
    mg_args, kind = read_megatron(args.megatron)
    rows, res = compare_configs(mg_args, read_mindformers(args.mindformers),
                                base=config_bases(args.mindformers, is_file=True))
    payload = {"verdict": res.verdict, "megatron_source": kind, **res.details,
               "findings": [f.to_json() for f in res.findings]}
    if args.json == "-":
        print(json.dumps(payload, indent=2, default=str))
    else:
        print(format_table(rows))
        c = res.details["counts"]
        print(f"\n{c['match']} match, {c['mismatch']} mismatch, {c['check']} to check by hand, "
              f"{c['not read']} not read -> {res.verdict}")
        if args.json:
            write_text_output(args.json, json.dumps(payload, indent=2, default=str))
    return 1 if res.verdict == "fail" else 0
