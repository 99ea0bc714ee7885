"""``align`` command line. Exit status: 0 pass or warn, 1 fail, 2 bad input (one line, no traceback)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from align.core.errors import BadInput
from align.core.findings import EXIT

# Subcommands implemented in their own modules: each has add_arguments(parser) and run(args) -> int.
MODULE_COMMANDS = {
    "check-config": ("align.checks.config", "config checklist: Megatron arguments vs MindFormers YAML"),
    "check-data": ("align.checks.data", "data checks over a run store or the step_N/rank_R layout"),
    "convert-weights": ("align.convert_weights", "Megatron-core <-> MindFormers checkpoint conversion"),
    "mapping": ("align.core.mapping", "show or check a name mapping preset"),
}


def _add_report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="compare a candidate run with a baseline and write the report",
                       description="Each RUN is a run-store directory, a Megatron-LM log, a MindFormers log "
                                   "or a TensorBoard directory (detected).")
    p.add_argument("baseline", metavar="BASELINE")
    p.add_argument("candidate", metavar="CANDIDATE")
    p.add_argument("--repeat", action="append", default=[], metavar="RUN",
                   help="a repeat of the baseline (same settings, run again): builds the error band")
    p.add_argument("--mapping", default=None, metavar="PRESET_OR_FILE",
                   help="name mapping for local norms (default: Megatron-core <-> MindFormers Llama)")
    p.add_argument("--out", required=True, metavar="DIR")
    g = p.add_argument_group("thresholds (README: 'How the verdict is reached')")
    g.add_argument("--step-rtol", type=float, default=5e-3, help="step-1/2 loss relative tolerance")
    g.add_argument("--rtol", type=float, default=1e-2, help="band as a share of |loss| with no repeats")
    g.add_argument("--band-k", type=float, default=3.0, help="band = K x rolling RMS of repeat deltas")
    g.add_argument("--band-window", type=int, default=51, help="rolling window of the band, in steps")
    g.add_argument("--band-floor", type=float, default=0.0, help="smallest band (absolute)")
    g.add_argument("--band-floor-ulps", type=float, default=8.0,
                   help="smallest band in float32 ulps of the largest baseline value (rounding, not training)")
    g.add_argument("--max-outside", type=float, default=0.05, help="allowed share of steps outside band")
    g.add_argument("--max-bias", type=float, default=0.5, help="allowed |mean delta| / std(delta)")
    g.add_argument("--sustain", type=int, default=10,
                   help="consecutive out-of-band steps that make a divergence")
    g.add_argument("--tail", type=float, default=0.2, help="share of final steps checked for a late gap")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")


def _run_report(args: argparse.Namespace) -> int:
    from align.procedure import report, stderr_progress
    from comparators.scalars import ScalarOptions
    opt = ScalarOptions(step_rtol=args.step_rtol, rtol=args.rtol, band_k=args.band_k,
                        band_window=args.band_window, band_floor=args.band_floor,
                        band_floor_ulps=args.band_floor_ulps,
                        max_outside=args.max_outside, max_bias=args.max_bias, sustain=args.sustain,
                        tail=args.tail)
    data = report(args.baseline, args.candidate, args.out, args.repeat, opt, args.mapping,
                  None if args.quiet else stderr_progress)
    _print_verdict(data, Path(args.out))
    return EXIT[data["verdict"]]


def _print_verdict(data: dict, out: Path) -> None:
    lines = [f"verdict: {data['verdict']}"]
    lines += [f"  {name:<18} {st['verdict']}" for name, st in data["stages"].items()]
    lines += [f"  - [{f['verdict']}] {f['stage']}: {f['message']}" for f in data["findings"]
              if f["verdict"] != "pass"]
    lines.append(f"report: {out / 'report.html'}")
    try:
        print("\n".join(lines), flush=True)
    except BrokenPipeError:  # `align report ... | head`: the reader left early; the exit status still counts
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _add_import(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("import", help="turn a Megatron/MindFormers log or TensorBoard dir into a run store")
    p.add_argument("source")
    p.add_argument("--out", required=True, metavar="RUN_DIR")


def _run_import(args: argparse.Namespace) -> int:
    from align.core.run import save_run
    from align.sources import detect, load_run
    kind = detect(args.source)
    if kind == "runstore":
        raise BadInput(f"{args.source}: already a run store")
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise BadInput(f"{out}: exists and is not empty")
    run = load_run(args.source, kind)
    save_run(run, out)
    print(f"{args.source} ({kind}): {len(run.steps)} steps -> {out}")
    for note in run.notes:
        print(f"  note: {note}")
    return 0


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the paired Megatron-core vs MindFormers experiment (CPU) and report")
    p.add_argument("--out", default="demo_out", metavar="DIR")
    p.add_argument("--steps", type=int, default=300, metavar="N", help="steps of the long pair (default 300)")
    p.add_argument("--lr0-steps", type=int, default=20, metavar="N", help="steps of the lr=0 pair (default 20)")
    p.add_argument("--inject", metavar="FAULT", default=None,
                   help="plant a known fault: embedding_fp16, weight_decay_all, norm_eps, dropout_on, "
                        "lr_schedule, qk_swap, pad_eos, loss_mask_mutation, nan_param")
    p.add_argument("--reuse-baseline", metavar="DIR", default=None,
                   help="reuse the baseline-side runs of an earlier demo DIR (same --steps) for a "
                        "candidate-side fault")
    p.add_argument("--example-logs", action="store_true",
                   help="compare the bundled example logs instead (no framework needed)")


def _run_demo(args: argparse.Namespace) -> int:
    from demo.pair import run_demo
    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="align", description="Cross-framework accuracy alignment: "
                                     "Megatron-LM (PyTorch) vs MindFormers (MindSpore).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_report(sub)
    _add_import(sub)
    _add_demo(sub)
    for name, (module, help_text) in MODULE_COMMANDS.items():
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        if hasattr(mod, "add_arguments") and hasattr(mod, "run"):
            p = sub.add_parser(name, help=help_text)
            mod.add_arguments(p)
            p.set_defaults(_module_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handlers = {"report": _run_report, "import": _run_import, "demo": _run_demo}
    try:
        if args.command in handlers:
            return handlers[args.command](args)
        return int(args._module_run(args))
    except BadInput as exc:
        print(f"align: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("align: interrupted", file=sys.stderr)
        return 130



if __name__ == "__main__":
    sys.exit(main())
