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
    from align.report_args import add_report_arguments
    p = sub.add_parser("report", help="compare a candidate run with a baseline and write the report",
                       description="Each RUN is a run-store directory, a Megatron-LM log, a MindFormers log "
                                   "or a TensorBoard directory (detected). Every stage of the procedure runs "
                                   "when its evidence is there; a skipped stage says what to capture.")
    add_report_arguments(p)


def _run_report(args: argparse.Namespace) -> int:
    from align.procedure import report, stderr_progress
    from align.report_args import report_inputs
    data = report(report_inputs(args), args.out, None if args.quiet else stderr_progress)
    _print_verdict(data, Path(args.out))
    if args.strict and data["verdict"] == "warn":
        return 1
    return EXIT[data["verdict"]]


def _print_verdict(data: dict, out: Path) -> None:
    lines = [f"verdict: {data['verdict']}"]
    for name, st in data["stages"].items():
        lines.append(f"  {name:<18} {st['verdict']}")
        if st["verdict"] == "skipped" and st.get("capture"):
            lines.append(f"  {'':<18} to run it: {st['capture']}")
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
    from align.core.outputs import check_out_dir
    from align.core.run import save_run
    from align.sources import detect, load_run
    kind = detect(args.source)
    if kind == "runstore":
        raise BadInput(f"{args.source}: already a run store")
    out = Path(args.out)
    check_out_dir(out)
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
    p.add_argument("--model", choices=("dense", "llama", "moe", "mla"), default="dense",
                   help="candidate model: dense = MindFormers 2.x mcore Qwen3-style model, the one MindFormers 2.x "
                        "trains (default; baseline with q/k layernorm to match), llama = MindFormers' legacy "
                        "LlamaForCausalLM (MindFormers <= 1.6), moe = mcore Qwen3-MoE-style (4 experts, top-2), "
                        "mla = mcore DeepSeek-V3-style (MLA + MoE + shared expert)")
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
