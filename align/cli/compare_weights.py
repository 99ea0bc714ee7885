"""`align compare-weights BASELINE CANDIDATE --out DIR`: two checkpoints' weights, parameter by parameter,
through the mapping (a conversion must agree exactly; weights after N steps on the same data within the
dtype's band). Writes DIR/summary.json, DIR/report.html, DIR/weights.csv and DIR/figures/weights.png."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from core.errors import BadInput

HELP = "compare two checkpoints' weights (Megatron torch_dist / legacy / .pt, MindFormers safetensors / ckpt)"
#: what each checkpoint format's names are: Megatron's (the mappings' baseline side) or MindFormers'
_MEGATRON_FORMATS = ("megatron", "torch")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Each CHECKPOINT is a Megatron torch_dist or legacy (mp_rank_*) folder (the save root or an iter_N), a "
        "torch state_dict .pt, a MindFormers .safetensors file or folder of them, or a MindSpore .ckpt. "
        "Tensors are brought into the baseline's layout by the mapping and compared one at a time.")
    parser.add_argument("baseline", help="the reference CHECKPOINT (findings use its parameter names)")
    parser.add_argument("candidate", help="the CHECKPOINT compared with it")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="folder for summary.json, report.html, weights.csv, figures/ (created)")
    parser.add_argument("--repeat", metavar="CHECKPOINT", help="the baseline's weights from a repeat of its run "
                        "(same steps, e.g. without determinism or at another TP size): each parameter is then "
                        "judged against how far the baseline is from itself (pass within 3 x that band, fail "
                        "beyond 10 x), never tighter than its dtype's tolerance (default: none, the dtype decides)")
    parser.add_argument("--mapping", help="preset name or YAML mapping file (default: the preset whose rules "
                        "cover the most of both checkpoints' names)")
    parser.add_argument("--tolerance", action="append", default=[], metavar="[DTYPE=]PASS[,FAIL]",
                        help="relative L2 difference that passes (and above which it fails; default 100 x PASS) "
                        "for every dtype, or for one (bfloat16=1e-2,5e-2); repeatable. Defaults: float32 1e-4 "
                        "(fails above 1e-2), bfloat16 1e-2 (5e-2), float16 2e-3 (2e-2)")
    parser.add_argument("--num-heads", type=int, help="attention heads (needed by presets that split fused QKV: the "
                        "legacy Llama; default: none)")
    parser.add_argument("--num-query-groups", type=int, help="GQA groups (default: = heads)")
    parser.add_argument("--num-experts", type=int, help="routed experts per MoE layer (default: from the "
                        "checkpoints)")
    parser.add_argument("--size", action="append", default=[], metavar="NAME=N",
                        help="a named size a fused tensor splits back by (as for convert-weights; repeatable; "
                             "default: none)")
    parser.add_argument("--top", type=int, default=10,
                        help="how many of the most drifted parameters to list (default: %(default)s)")
    parser.add_argument("--strict", action="store_true", help="exit 1 on warn too (CI gates; default: warn exits 0)")


def parse_tolerances(items: Sequence[str]) -> dict[str, tuple[float, float]]:
    """``["1e-3", "bfloat16=1e-2,5e-2"]`` -> ``{"*": (1e-3, 1e-1), "bfloat16": (1e-2, 5e-2)}``."""
    from core.dtypes import normalize

    out: dict[str, tuple[float, float]] = {}
    for item in items:
        dtype, sep, values = item.rpartition("=")
        parts = values.split(",")
        try:
            nums = [float(x) for x in parts]
        except ValueError:
            nums = []
        if len(nums) not in (1, 2) or any(not (x >= 0 and x < float("inf")) for x in nums) or (
                len(nums) == 2 and nums[1] < nums[0]) or (sep and not dtype.strip()):
            raise BadInput(f"--tolerance {item!r}: expected [DTYPE=]PASS[,FAIL] with 0 <= PASS <= FAIL")
        out[normalize(dtype) if sep else "*"] = (nums[0], nums[1] if len(nums) == 2 else nums[0] * 100)
    return out


def _hint(src: Any) -> str:
    return "baseline" if str(src.kind).startswith(_MEGATRON_FORMATS) else "candidate"


def run(args: argparse.Namespace) -> int:
    from align.cli.convert_weights import parse_sizes
    from checkpoints.convert import check_model_params
    from checkpoints.weights import open_weights
    from comparators.weights import compare_weights
    from core.findings import EXIT
    from core.outputs import check_out_dir
    from mapping import TransformParams
    from models import load_mapping, preset_for_names
    from sources.input_kind import CHECKPOINT_KINDS, refuse_unless

    # command-line mistakes first: nothing is read, nothing written
    out = check_out_dir(args.out)
    tolerances = parse_tolerances(args.tolerance)
    if args.num_heads is not None or args.num_query_groups is not None or args.num_experts is not None:
        check_model_params(args.num_heads if args.num_heads is not None else 1, args.num_query_groups,
                           args.num_experts)
    if args.top < 0:
        raise BadInput(f"--top {args.top}: expected a number >= 0")
    sizes = parse_sizes(args.size)
    for p in (args.baseline, args.candidate, *([args.repeat] if args.repeat else [])):
        if not Path(p).exists():
            raise BadInput(f"{p}: no such file or folder")
        refuse_unless(p, CHECKPOINT_KINDS, "a checkpoint")    # another kind of input, named
    a = open_weights(args.baseline)
    b = open_weights(args.candidate)
    r = open_weights(args.repeat) if args.repeat else None
    hints = (_hint(a), _hint(b))
    if args.mapping:
        mapping = load_mapping(args.mapping)
    else:
        preset = preset_for_names((a.names(), hints[0]), (b.names(), hints[1]),
                                  *([(r.names(), _hint(r))] if r is not None else []))
        if preset is None:
            some = [*a.names()[:2], *b.names()[:2]]
            raise BadInput(f"{args.baseline}, {args.candidate}: no preset covers their tensor names (e.g. "
                           f"{', '.join(repr(n) for n in some) or 'none'}); pass --mapping with a preset "
                           "(align mapping list) or a mapping file")
        mapping = load_mapping(preset)
    params = TransformParams(num_heads=args.num_heads, num_query_groups=args.num_query_groups or args.num_heads,
                             num_experts=args.num_experts, sizes=sizes)
    counts = (len(a.names()), len(b.names()))
    try:
        bands, repeat_findings = _bands(a, r, mapping, params, hints[0], tolerances) if r is not None else (None, [])
        stage, rows = compare_weights(a, b, mapping, params=params, tolerances=tolerances, sides=hints, top=args.top,
                                      bands=bands)
        for f in repeat_findings:
            stage.add(f)
    finally:
        for src in (a, b, r):
            if src is not None:
                src.close()
    if r is not None:
        stage.details["repeat"] = str(r.path)
    data = _write(out, stage, rows, a, b, counts, r)
    _print(data, stage, rows, out)
    if args.strict and data["verdict"] == "warn":
        return 1
    return EXIT[data["verdict"]]


def _bands(a: Any, r: Any, mapping: Any, params: Any, side: str, tolerances: Any) -> tuple[dict[str, float], list]:
    """Each baseline parameter's rel L2 difference from the repeat's (the same compare, baseline vs repeat),
    and what the repeat's own TP copies say (replicated parameters that drifted apart)."""
    from comparators.weights import compare_weights, replica_findings

    _stage, rows = compare_weights(a, r, mapping, params=params, sides=(side, _hint(r)))
    bands = {row["name"]: row["rel_l2"] for row in rows if row["rel_l2"] is not None}
    if not bands:
        raise BadInput(f"{r.path}: --repeat shares no parameter with {a.path}")
    return bands, replica_findings(r, "repeat", tolerances)


def _write(out: Path, stage: Any, rows: list[dict[str, Any]], a: Any, b: Any, counts: tuple[int, int],
           r: Any = None) -> dict[str, Any]:
    import pandas as pd

    from reports import html
    from reports.figures import weights_chart
    from reports.render import Figure
    from reports.writer import ReportInput, write_report

    d = stage.details
    runs = [{"role": "baseline", "path": str(a.path), "kind": a.kind, "steps": None,
             "notes": [f"{counts[0]} tensors, names on the mapping's {d['baseline_side']} side"]},
            {"role": "candidate", "path": str(b.path), "kind": b.kind, "steps": None,
             "notes": [f"{counts[1]} tensors, names on the mapping's {d['candidate_side']} side"]}]
    if r is not None:
        runs.append({"role": "repeat", "path": str(r.path), "kind": r.kind, "steps": None,
                     "notes": ["the baseline run again: each parameter's band"]})
    top = [{k: r[k] for k in ("name", "verdict", "rel_l2", "max_abs_err", "cosine", "judged_dtype", "diagnosis")}
           for r in stage.details["most_drifted"]]
    fig = Figure("Weights: relative L2 difference per parameter", "weights.png",
                 functools.partial(weights_chart, rows, stage.verdict))
    inp = ReportInput(runs=runs, stages={stage.name: stage}, figures=[fig],
                      extra_sections=[("Most drifted parameters", html.table(top))] if top else [],
                      extra_tables={"weights.csv": pd.DataFrame(rows)})
    return write_report(inp, out)


def _print(data: dict[str, Any], stage: Any, rows: list[dict[str, Any]], out: Path) -> None:
    d = stage.details
    lines = [f"compare-weights: {d['compared']} of {d['parameters']} parameters compared, mapping {d['mapping']}: "
             f"{d['passed']} pass, {d['warned']} warn, {d['failed']} fail"]
    bad = [f for f in stage.findings if f.verdict != "pass"]
    lines += [f"  {f.verdict.upper():4} {f.message}" for f in bad[:10]]
    if len(bad) > 10:
        lines.append(f"  ... {len(bad) - 10} more in {out / 'weights.csv'}")
    if d["compared"] and d["max_rel_l2"] == 0:
        lines.append("  every compared parameter is bit-identical")
    elif d["most_drifted"]:
        lines.append("  most drifted: " + ", ".join(f"{r['name']} {r['rel_l2']:.3g}" for r in d["most_drifted"][:3]))
    if data["verdict"] != "pass" and not d.get("repeat") and d["compared"] and d["max_rel_l2"]:
        lines.append("  (judged by dtype alone: for weights after N training steps pass --repeat with the baseline's "
                     "repeat, to judge each parameter against the baseline's own band)")
    lines.append(f"verdict: {data['verdict']}; report: {out / 'report.html'}")
    try:
        print("\n".join(lines), flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
