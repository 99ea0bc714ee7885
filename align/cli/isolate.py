"""`align isolate BASELINE --candidate-yaml Y --candidate-ckpt CKPT --out RUN`: single-module isolation.

Builds the candidate (MindFormers 2.x mcore model from its YAML, in PYNATIVE, with the weights it had at the
tensor step), runs each chosen module on the baseline's captured input (dumpers.mindspore_isolation) and
writes RUN/evidence/isolation.npz; where the baseline holds a module backward capture
(dumpers.torch_module_backward), each module is also fed the baseline's output gradient and its input and
weight gradients are compared (dumpers.mindspore_backward_isolation; ``--graph`` compiles each module).
`align report ... --isolation RUN` shows each module's own error next to
its inherited one, and names the module whose own error departs. MindSpore and MindFormers are imported only
here, inside ``run``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from core.errors import BadInput

HELP = "run the candidate's modules on the baseline's captured inputs (own vs inherited error)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "BASELINE is a run store holding full input and output tensors of the chosen modules at one step "
        "(DumpConfig(tensors='full', tensor_steps=[N], modules=[...])) or a module backward capture of it "
        "(dumpers.torch_module_backward.ModuleBackwardCapture: gradients compared too), and that step's batch. "
        "The candidate is built from its MindFormers YAML in PYNATIVE (on CPU with the CPU stand-ins) and given "
        "CKPT's weights: the candidate's weights at step N, before that step's update (for step 1 its converted "
        "initial weights). Megatron-named weights are converted through the mapping.")
    parser.add_argument("baseline", metavar="BASELINE", help="the baseline run store")
    parser.add_argument("--candidate-yaml", required=True, metavar="YAML", help="the candidate's MindFormers YAML")
    parser.add_argument("--candidate-ckpt", required=True, metavar="CKPT",
                        help="the candidate's weights at that step (.safetensors / .ckpt / a Megatron checkpoint)")
    parser.add_argument("--out", required=True, metavar="RUN", help="writes RUN/evidence/isolation.npz")
    parser.add_argument("--step", type=int, help="the tensor step (default: the baseline's first with full tensors)")
    parser.add_argument("--rank", type=int, default=0,
                        help="the baseline rank whose tensors and batch are used (default: %(default)s)")
    parser.add_argument("--modules", action="append", metavar="PATTERN",
                        help="fnmatch pattern over the baseline's module names (repeatable; default: every "
                             "captured layer, attention, MLP, norm and output module the mapping maps)")
    parser.add_argument("--mapping", metavar="PRESET_OR_FILE",
                        help="name mapping preset or YAML file (default: the preset the YAML needs)")
    parser.add_argument("--graph", action="store_true",
                        help="backward isolation: run each module's forward and backward compiled (mindspore.jit: "
                             "GRAPH kernels and autodiff, as a GRAPH-trained candidate) instead of PYNATIVE; the "
                             "inherited error's inputs and output gradients still come from one PYNATIVE run of the "
                             "whole network (a GRAPH run hands no cell's arguments out)")
    parser.add_argument("--candidate-run", metavar="STORE",
                        help="the candidate's GRAPH run store with a kernel dump at the step (the MindFormers "
                             "callback's kernel_dump): the inherited error is read from the run that trained, not "
                             "from a PYNATIVE re-run (forward isolation: with --forward-only where the baseline "
                             "holds a module backward capture)")
    parser.add_argument("--forward-only", action="store_true",
                        help="forward isolation only, even where the baseline holds a module backward capture")


def read_yaml(path: str) -> dict[str, Any]:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise BadInput(f"{p}: no such file")
    try:
        cfg = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise BadInput(f"{p}: not YAML ({' '.join(str(exc).split())[:80]})") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model"), dict):
        raise BadInput(f"{p}: not a MindFormers YAML (no model: block)")
    return cfg


def transform_params(cfg: dict[str, Any]) -> Any:
    """The mapping's TransformParams (heads, query groups) from a MindFormers YAML."""
    from mapping import TransformParams

    mc = (cfg.get("model") or {}).get("model_config") or {}
    heads = mc.get("num_attention_heads") or mc.get("num_heads")
    return TransformParams(num_heads=heads, num_query_groups=mc.get("num_key_value_heads") or mc.get("n_kv_heads")
                           or mc.get("num_query_groups") or heads)


def candidate_weights(path: str, net: Any, m: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """CKPT's weights in the candidate's names: as they are, or converted through the mapping when they carry
    the baseline's (Megatron) names."""
    from checkpoints.weights import read_weights

    arrays, _ = read_weights(path)
    names = {p.name for p in net.get_parameters()}
    if len(names & set(arrays)) >= len(names) / 2 and not any(k.startswith("module.") for k in arrays):
        return arrays
    converted, _ = m.convert(arrays, "candidate", transform_params(cfg))
    return converted


def run(args: argparse.Namespace) -> int:
    from align.checks.config import mindformers_attention_dtype
    from core.outputs import check_out_dir
    from models import load_mapping, preset_for_config

    check_out_dir(args.out)                  # before a model is built: an --out that cannot be written
    cfg = read_yaml(args.candidate_yaml)
    if not Path(args.baseline).is_dir():
        raise BadInput(f"{args.baseline}: not a run store folder")
    m = load_mapping(args.mapping or preset_for_config(cfg) or "megatron_core__mindformers_mcore_dense")
    from align.procedure.graph_run import graph_run_tensors
    from dumpers.mindspore_backward_isolation import backward_steps, isolate_with_backward, read_backward
    from dumpers.mindspore_isolation import baseline_modules, isolate_modules

    graph = None
    steps = [] if args.forward_only else backward_steps(args.baseline, args.rank)
    backward = bool(steps) and (args.step is None or args.step in steps)
    if args.candidate_run is not None and backward:
        raise BadInput(f"{args.candidate_run}: --candidate-run gives the forward isolation's inherited error (the "
                       "backward's inherited gradients come from a PYNATIVE run): add --forward-only")
    if args.graph and not backward:
        raise BadInput(f"{args.baseline}: --graph needs a module backward capture at the step "
                       "(dumpers.torch_module_backward.ModuleBackwardCapture)")
    try:                                     # the baseline's evidence first: bad input before any model is built
        if backward:
            read_backward(args.baseline, args.step if args.step is not None else steps[0], args.rank)
        else:
            step, _, _ = baseline_modules(args.baseline, args.step, args.rank)
            if args.candidate_run is not None:
                graph = graph_run_tensors(args.candidate_run, step)
    except ValueError as exc:
        raise BadInput(" ".join(str(exc).split())) from None
    from demo import mindformers_mcore_cpu as mcc

    net = mcc.build_pynative_model(cfg)      # PYNATIVE: the cells are called one by one
    try:
        mcc.load_parameter_arrays(net, candidate_weights(args.candidate_ckpt, net, m, cfg))
    except (KeyError, ValueError) as exc:
        raise BadInput(f"{args.candidate_ckpt}: does not fit the candidate's model ({exc})") from None
    try:
        if backward:
            path = isolate_with_backward(net, args.baseline, args.out, mapping=m, step=args.step, rank=args.rank,
                                         modules=args.modules, dtype=mindformers_attention_dtype(cfg),
                                         weights=str(args.candidate_ckpt), params=transform_params(cfg),
                                         graph=args.graph)
        else:
            path = isolate_modules(net, args.baseline, args.out, mapping=m, step=args.step, rank=args.rank,
                                   modules=args.modules, dtype=mindformers_attention_dtype(cfg),
                                   weights=str(args.candidate_ckpt), candidate_run=args.candidate_run,
                                   graph_tensors=graph)
    except ValueError as exc:
        raise BadInput(" ".join(str(exc).split())) from None
    print(f"isolation evidence: {path}")
    return 0
