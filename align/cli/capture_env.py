"""`align capture-env --out FILE`: one cluster's side of the cluster diff (run it on each cluster).

Records the environment variables that change numerics (the documented list, core/numerics_env.yaml), library,
runtime and driver versions, the framework's determinism and precision settings, content hashes of the
dataset files and fingerprints of the weights the run loads; `align report --baseline-env A --candidate-env B`
names every difference that matters in the checklist. The training process's random generators are recorded
by the dumpers (``DumpConfig(capture_env=True)``), which write the same capture into the run's meta.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path

from core.errors import BadInput

HELP = "record this cluster's environment, versions, precision settings, data and weight hashes (cluster diff)"
_SIDE_PREFIXES = {"torch": ("NCCL_", "CUDA_", "CUBLAS_", "NVTE_"), "mindspore": ("HCCL_", "ASCEND_", "MS_")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`align capture-env --out FILE [--framework F] [--data PATH ...] [--weights CKPT] [--workers N]`."""
    parser.add_argument("--out", required=True, metavar="FILE", help="where the capture (JSON) goes")
    parser.add_argument("--framework", choices=("torch", "mindspore"),
                        help="the side this cluster trains with (default: the one installed; say it when both are)")
    parser.add_argument("--data", action="append", default=[], metavar="PATH",
                        help="a dataset file or folder to hash (repeatable; give them in the same order on both "
                             "clusters; default: none)")
    parser.add_argument("--weights", metavar="CKPT",
                        help="the weights the run loads: Megatron checkpoint folder or .pt, MindFormers .safetensors / "
                             ".ckpt (fingerprinted per parameter, compared through the mapping; default: none)")
    parser.add_argument("--workers", type=int, default=None, metavar="N", help="hashing threads (default: up to 8)")


def _framework(choice: str | None) -> str:
    if choice:
        return choice
    have = [fw for fw in ("torch", "mindspore") if importlib.util.find_spec(fw) is not None]
    if len(have) == 1:
        return have[0]
    hints = [fw for fw, ps in _SIDE_PREFIXES.items() if any(k.startswith(ps) for k in os.environ)]
    if len(hints) == 1:
        return hints[0]
    found = "both torch and mindspore are" if have else "neither torch nor mindspore is"
    raise BadInput(f"{found} installed here: say --framework torch or --framework mindspore")


def run(args: argparse.Namespace) -> int:
    from core.outputs import check_out_file
    from dumpers.environment import capture_environment, write_capture

    check_out_file(args.out, "--out")     # before hashing gigabytes: a capture that cannot be saved is refused
    if args.workers is not None and args.workers < 1:
        raise BadInput(f"--workers {args.workers}: expected a positive number of threads")
    framework = _framework(args.framework)
    weights = None
    if args.weights:
        from checkpoints.weights import read_weights
        from sources.input_kind import CHECKPOINT_KINDS, refuse_unless

        if Path(args.weights).exists():
            refuse_unless(args.weights, CHECKPOINT_KINDS, "a checkpoint")    # another kind of input, named

        arrays, dtypes = read_weights(args.weights)
        weights = [(name, (lambda a=a: a), dtypes[name]) for name, a in arrays.items()]
    capture = capture_environment(framework, by="align capture-env", data=args.data, weights=weights,
                                  weights_source=args.weights, observe_random=False,
                                  import_frameworks=(framework,), workers=args.workers)
    write_capture(args.out, capture)
    parts = [f"{framework} side", f"{len(capture['env'])} variables",
             f"{sum(v is not None for v in capture['versions'].values())} versions"]
    if capture["data"]:
        total = sum(e["bytes"] for e in capture["data"])
        parts.append(f"data: {sum(len(e['files']) for e in capture['data'])} files, {total / 1e6:.1f} MB at "
                     f"{capture['data'][0]['mb_per_s'] or 0:.0f} MB/s")
    if capture["weights"]:
        w = capture["weights"]
        parts.append(f"weights: {len(w['params'])} tensors, {w['bytes'] / 1e6:.1f} MB at {w['mb_per_s'] or 0:.0f} MB/s")
    print(f"capture-env: {args.out} ({'; '.join(parts)})")
    return 0
