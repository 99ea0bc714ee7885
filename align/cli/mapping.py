"""`align mapping list|show|check`: the name mapping presets, and whether two runs' names pair up."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from core.errors import BadInput
from models import DEFAULT_PRESET, load_mapping, presets
from runstore.schema import parse_json, read_text, validate

HELP = "show or check a name mapping preset"


def _read_names(path: str) -> list[str]:
    """Names from a text file (one a line), a JSON list/dict, or a run store's step-1 local_norm table."""
    p = Path(path)
    if p.is_dir():
        from runstore import RunReader

        reader = RunReader(p)
        steps = reader.array_steps()
        if not steps:
            raise BadInput(f"{p}: run store has no array files to take names from")
        names: list[str] = []
        for r in reader.array_ranks(steps[0]):
            t = reader.step_arrays(steps[0], r).table("local_norm")
            if t is not None:
                names.extend(n for n in t["name"] if n not in names)
        if not names:
            raise BadInput(f"{p}: no local_norm table in step {steps[0]}")
        return names
    text = read_text(p, "name list")
    if p.suffix == ".json":
        obj = validate(parse_json(text, p), {"type": ["array", "object"]}, p)
        names = list(obj)
        validate(names, {"type": "array", "items": {"type": "string"}}, p)
        return names
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`align mapping show PRESET` / `align mapping check PRESET --baseline NAMES --candidate NAMES`."""
    parser.add_argument("action", choices=["show", "check", "list"],
                        help="show a mapping, check names against it, or list the presets")
    parser.add_argument("preset", nargs="?", default=DEFAULT_PRESET,
                        help="preset name or YAML file (default: %(default)s)")
    parser.add_argument("--baseline", help="check: baseline names: text file (one a line), JSON list, or run store")
    parser.add_argument("--candidate", help="check: candidate names: text file, JSON list, or run store")
    parser.add_argument("--json", action="store_true", help="machine-readable output (default: text)")


def run(args: argparse.Namespace) -> int:
    if args.action == "list":
        print("\n".join(presets()))
        return 0
    m = load_mapping(args.preset)
    if args.action == "show":
        if args.json:
            print(json.dumps({"name": m.name, "rules": [
                {"id": r.id, "kind": r.kind, "baseline": [p.text for p in r.baseline],
                 "candidate": [p.text for p in r.candidate], "transform": r.transform,
                 "tp_partition_dim": r.tp_partition_dim, "scheme": r.scheme} for r in m.rules],
                "modules": [{"baseline": x.baseline.text, "candidate": x.candidate.text} for x in m.modules]},
                indent=2))
        else:
            print(m.describe())
        return 0
    if not args.baseline or not args.candidate:
        raise BadInput("mapping check needs --baseline and --candidate name lists")
    res = m.check(_read_names(args.baseline), _read_names(args.candidate))
    if args.json:
        print(json.dumps({"verdict": res.verdict, **res.details,
                          "findings": [f.to_json() for f in res.findings]}, indent=2))
    else:
        print(f"mapping check ({m.name}): {res.verdict}; {res.details['pairs']} groups paired")
        for f in res.findings:
            print(f"  {f.verdict.upper():4} {f.message}")
    return 1 if res.verdict == "fail" else 0
