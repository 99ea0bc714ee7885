"""`align demo`: the paired Megatron-core vs MindFormers experiment on CPU, then the same report."""

from __future__ import annotations

import argparse

HELP = "run the paired Megatron-core vs MindFormers experiment (CPU) and report"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from demo.spec import DEFAULT_SEED, FAULTS, MODEL_KINDS  # numpy only: in --help even without the frameworks

    p.add_argument("--out", default="demo_out", metavar="DIR",
                   help="folder for the runs (DIR/runs/) and the report (default: %(default)s)")
    p.add_argument("--steps", type=int, default=300, metavar="N", help="steps of the long pair (default 300)")
    p.add_argument("--lr0-steps", type=int, default=20, metavar="N", help="steps of the lr=0 pair (default 20)")
    p.add_argument("--inject", metavar="FAULT", default=None,
                   help="plant a known fault (default: none, the clean pair): " + ", ".join(FAULTS))
    p.add_argument("--model", choices=MODEL_KINDS, default="dense",
                   help="candidate model: dense = MindFormers 2.x mcore Qwen3-style model, the one MindFormers 2.x "
                        "trains (default; baseline with q/k layernorm to match), llama = MindFormers' legacy "
                        "LlamaForCausalLM (MindFormers <= 1.6), moe = mcore Qwen3-MoE-style (4 experts, top-2), "
                        "mla = mcore DeepSeek-V3-style (MLA + MoE + shared expert)")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, metavar="N",
                   help=f"draws the initial weights and the batches of every run of the pair (default {DEFAULT_SEED}); "
                        "a clean pair passes whatever the seed")
    p.add_argument("--reuse-baseline", metavar="DIR", default=None,
                   help="reuse the baseline-side runs of an earlier demo DIR (same --steps) for a "
                        "candidate-side fault (default: run the baseline side too)")
    p.add_argument("--example-logs", action="store_true",
                   help="compare the bundled example logs instead (no framework needed; default: the paired runs)")


# what the paired runs import (in their own processes, so a missing one would surface there as a traceback)
FRAMEWORKS = ("torch", "megatron.core", "mindspore", "mindformers")


def run(args: argparse.Namespace) -> int:
    import importlib.util

    from core.outputs import check_out_dir
    from demo.pair import run_demo

    check_out_dir(args.out)         # before minutes of training: an --out that cannot be written
    if not args.example_logs:
        for name in FRAMEWORKS:
            top = name.split(".")[0]
            if importlib.util.find_spec(top) is None or importlib.util.find_spec(name) is None:
                raise ModuleNotFoundError(f"No module named '{name}'", name=name)
    return run_demo(args)
