"""`align drill BASELINE --module M --candidate-yaml Y --candidate-ckpt CKPT --out DIR`: operator drill-down.

Inside the module the isolation (or layer) stage named, which operator accounts for the module's difference:
the baseline's aten operators (dumpers.torch_op_trace, written in the baseline's process from its module
backward capture) against the candidate's MindSpore kernels, from the real MindFormers cell compiled and run
on the same inputs and output gradient in a fresh process under MindSpore's kernel dump
(dumpers.mindspore_op_trace). Judged by align.procedure.drill; writes DIR/operators.csv and DIR/drill.json.
Exit 0: no operator departs; 1: operators named (or the module differs); 2: bad input; 3: internal error.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from core.errors import BadInput

HELP = "name the operator(s) inside one module whose own or semantic error accounts for its difference"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "BASELINE is a run store holding a module backward capture (dumpers.torch_module_backward) and its operator "
        "trace (dumpers.torch_op_trace.trace_modules) of MODULE. The candidate is built from its MindFormers YAML "
        "with CKPT's weights (the same as for `align isolate`); its cell for MODULE is compiled and run, forward and "
        "backward, on the baseline's captured inputs and output gradient under MindSpore's kernel dump, in a fresh "
        "process.")
    parser.add_argument("baseline", metavar="BASELINE", help="the baseline run store")
    parser.add_argument("--module", required=True,
                        help="the baseline module (as isolation or the layer stage names it)")
    parser.add_argument("--candidate-yaml", required=True, metavar="YAML", help="the candidate's MindFormers YAML")
    parser.add_argument("--candidate-ckpt", required=True, metavar="CKPT",
                        help="the candidate's weights at that step (.safetensors / .ckpt / a Megatron checkpoint)")
    parser.add_argument("--out", required=True, metavar="DIR", help="writes DIR/operators.csv and DIR/drill.json")
    parser.add_argument("--step", type=int, help="the traced step (default: the baseline's first)")
    parser.add_argument("--rank", type=int, default=0, help="the baseline rank (default: %(default)s)")
    parser.add_argument("--mapping", metavar="PRESET_OR_FILE",
                        help="name mapping preset or YAML file (default: the preset the YAML needs)")
    parser.add_argument("--candidate-hook", metavar="MODULE:FUNCTION",
                        help="a function called with the built candidate network before it runs (a patch of yours: "
                             "a CPU stand-in, a planted fault)")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds the candidate's process may take (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    from align.checks.config import mindformers_attention_dtype
    from align.cli.isolate import read_yaml
    from align.procedure.drill import read_trace, write_drill
    from core.outputs import check_out_dir
    from dumpers.mindspore_backward_isolation import read_backward
    from models import load_mapping, preset_for_config

    out = check_out_dir(args.out, [args.baseline])
    cfg = read_yaml(args.candidate_yaml)
    if not Path(args.baseline).is_dir():
        raise BadInput(f"{args.baseline}: not a run store folder")
    if not Path(args.candidate_ckpt).exists():
        raise BadInput(f"{args.candidate_ckpt}: no such file")
    step, trace, arrays = read_trace(args.baseline, args.step, args.rank, args.module)
    try:
        bmeta, capture = read_backward(args.baseline, step, args.rank)
    except ValueError as exc:
        raise BadInput(" ".join(str(exc).split())) from None
    if args.module not in {m["module"] for m in bmeta["modules"]}:
        raise BadInput(f"{args.baseline}: module {args.module} is not in the module backward capture of step {step}")
    m = load_mapping(args.mapping or preset_for_config(cfg) or "megatron_core__mindformers_mcore_dense")
    cand = m.map_module(args.module, "baseline")
    if cand is None:
        raise BadInput(f"{args.module}: no module rule of the mapping {m.name} covers it")
    work = Path(tempfile.mkdtemp(prefix="xf_align_drill_"))    # MindSpore's dump path: [A-Za-z0-9_/-] only
    try:
        t0 = time.perf_counter()
        job = {"yaml": str(Path(args.candidate_yaml).resolve()), "ckpt": str(Path(args.candidate_ckpt).resolve()),
               "mapping": str(Path(args.mapping).resolve()) if args.mapping and Path(args.mapping).is_file()
               else args.mapping or m.name, "baseline": str(Path(args.baseline).resolve()), "step": step,
               "rank": args.rank, "module": args.module, "cell": cand, "out": str(work.resolve()),
               "hook": args.candidate_hook}
        _candidate_process(job, work, args.timeout)
        t1 = time.perf_counter()
        # MindFormers' attention computes q/k/v in float16 by design: its modules are judged at that line
        coarse = mindformers_attention_dtype(cfg) if m.module_kind(args.module, "baseline") in (
            "attention", "layer") else None
        result, lines = write_drill(out, args.module, step, trace, arrays, work / "kernels", work / "returned.npz",
                                    capture, candidate=cand, dtype=coarse,
                                    timings={"candidate_process": round(t1 - t0, 2)})
        result["seconds"]["compare"] = round(time.perf_counter() - t1, 2)
        (out / "drill.json").write_text(json.dumps(result, indent=1, default=float), encoding="utf-8")
    finally:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    for line in lines:
        print(line)
    print(f"drill: {out / 'operators.csv'}, {out / 'drill.json'} ({result['seconds']['candidate_process']:.1f} s "
          f"candidate, {result['seconds']['compare']:.1f} s compare)")
    return 1 if result["verdict"] == "fail" else 0


def _candidate_process(job: dict[str, Any], work: Path, timeout: float) -> None:
    """The candidate's cell under the kernel dump, in a fresh process (MindSpore reads the dump config once, at
    import); its output goes to WORK/candidate.log, a failure comes back as one line."""
    from dumpers.mindspore_op_trace import write_dump_config

    try:
        cfg = write_dump_config(work)
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    (work / "job.json").write_text(json.dumps(job))
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "MINDSPORE_DUMP_CONFIG": str(cfg),
           "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    code = "import sys; from align.cli.drill import candidate_worker; sys.exit(candidate_worker(sys.argv[1]))"
    log = work / "candidate.log"
    with open(log, "w", encoding="utf-8") as fh:
        try:
            rc = subprocess.run([sys.executable, "-c", code, str(work / "job.json")], stdout=fh,
                                stderr=subprocess.STDOUT, env=env, timeout=timeout, check=False,
                                cwd=work).returncode     # MindSpore writes rank_0/ (IR on a failure) in its cwd
        except subprocess.TimeoutExpired:
            raise BadInput(f"the candidate's process took more than {timeout:.0f} s (--timeout)") from None
    err = work / "error.txt"
    if rc == 2 and err.is_file():
        raise BadInput(err.read_text(encoding="utf-8").strip())
    if rc != 0 or not (work / "returned.npz").is_file():
        tail = [ln for ln in log.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()][-1:]
        raise RuntimeError(f"the candidate's process failed (exit {rc}): {' '.join(tail)[:300]}")


def candidate_worker(job_file: str) -> int:
    """In the fresh process: build the candidate (PYNATIVE, CPU stand-ins), load its weights, run the cell
    compiled under the kernel dump. Exit 2 with WORK/error.txt for input that does not fit."""
    job = json.loads(Path(job_file).read_text())
    work = Path(job["out"])
    try:
        _worker(job)
    except (BadInput, ValueError, KeyError) as exc:
        (work / "error.txt").write_text(" ".join(str(exc).split())[:500], encoding="utf-8")
        return 2
    return 0


def _worker(job: dict[str, Any]) -> None:
    import dataclasses
    import importlib

    from align.cli.isolate import candidate_weights, read_yaml, transform_params
    from demo import mindformers_mcore_cpu as mcc
    from dumpers.mindspore_backward_isolation import read_backward, to_baseline
    from dumpers.mindspore_isolation import find_cell, step_batch
    from dumpers.mindspore_op_trace import run_cell_kernels
    from models import load_mapping

    cfg = read_yaml(job["yaml"])
    m = load_mapping(job["mapping"])
    net = mcc.build_pynative_model(cfg)
    try:
        mcc.load_parameter_arrays(net, candidate_weights(job["ckpt"], net, m, cfg))
    except (KeyError, ValueError) as exc:
        raise BadInput(f"{job['ckpt']}: does not fit the candidate's model ({exc})") from None
    if job.get("hook"):
        mod, _, fn = str(job["hook"]).partition(":")
        try:
            hook = getattr(importlib.import_module(mod), fn)
        except (ImportError, AttributeError) as exc:
            raise BadInput(f"--candidate-hook {job['hook']}: {exc}") from None
        hook(net)
    cell = find_cell({n: c for n, c in net.cells_and_names() if n}, job["cell"])
    if cell is None:
        raise BadInput(f"{job['yaml']}: the candidate has no cell {job['cell']} (for {job['module']})")
    meta, arrays = read_backward(job["baseline"], job["step"], job["rank"])
    mc = (cfg.get("model") or {}).get("model_config") or {}
    experts = mc.get("num_experts") or mc.get("num_moe_experts") or mc.get("n_routed_experts")
    params = dataclasses.replace(transform_params(cfg), num_experts=int(experts) if experts else None)
    entry = next(e for e in meta["modules"] if e["module"] == job["module"])
    run_cell_kernels(net, cell, job["module"], entry, arrays, job["out"],
                     batch=step_batch(job["baseline"], job["step"], job["rank"]),
                     layouts=(m.activation_layout.get("baseline"), m.activation_layout.get("candidate")),
                     to_baseline=lambda g: to_baseline(g, m, params))
