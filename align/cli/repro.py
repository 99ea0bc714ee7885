"""`align repro ISOLATION_RUN --module M --candidate-yaml Y --out DIR`: a self-contained repro folder of one module.

The module's captured input (and output gradient), both sides' weights, both saved outputs and two short
scripts (PyTorch; MindSpore) that recompute it and print the report's metrics (align.procedure.repro). The
folder depends on nothing of this project: send it to the framework team.
"""

from __future__ import annotations

import argparse

HELP = "write a self-contained folder (inputs, weights, outputs, a torch and a MindSpore script) for one module"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "ISOLATION_RUN is what `align isolate` wrote (its evidence names the baseline store, the step and the "
        "candidate's weights). MODULE is a baseline module it isolated, say the one the report named. Kinds "
        "with scripts: RMSNorm, a linear layer, a gated (SwiGLU) MLP, Megatron-style self-attention, the token "
        "embedding, the loss (masked-mean cross-entropy; needs the baseline's module backward capture of 'loss').")
    parser.add_argument("isolation", metavar="ISOLATION_RUN", help="the `align isolate` output folder")
    parser.add_argument("--module", required=True, help="the baseline module (as the isolation report names it)")
    parser.add_argument("--candidate-yaml", required=True, metavar="YAML",
                        help="the candidate's MindFormers YAML (its settings: epsilon, dtypes, heads)")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="the folder to write (a repro folder there is replaced; any other non-empty folder is "
                             "refused)")
    parser.add_argument("--baseline-weights", metavar="CKPT",
                        help="the baseline's weights at that step, when its store holds no module backward capture")
    parser.add_argument("--candidate-ckpt", metavar="CKPT",
                        help="the candidate's weights at that step (default: the file `align isolate` was given)")
    parser.add_argument("--mapping", metavar="PRESET_OR_FILE",
                        help="name mapping preset or YAML file (default: the preset the YAML needs)")


def run(args: argparse.Namespace) -> int:
    from align.cli.isolate import read_yaml, transform_params
    from align.procedure.repro import isolation_file, write_repro
    from core.outputs import check_out_dir
    from models import load_mapping, preset_for_config

    check_out_dir(args.out, [args.isolation])
    cfg = read_yaml(args.candidate_yaml)
    isolation_file(args.isolation)
    m = load_mapping(args.mapping or preset_for_config(cfg) or "megatron_core__mindformers_mcore_dense")
    out = write_repro(args.isolation, args.module, args.out, candidate_cfg=cfg, mapping=m,
                      params=transform_params(cfg), baseline_weights=args.baseline_weights,
                      candidate_weights=args.candidate_ckpt)
    print(f"repro folder: {out} (python {out}/repro_torch.py; python {out}/repro_mindspore.py)")
    return 0
