"""``align demo``: the paired experiment, Megatron-core vs MindFormers on CPU, every stage of the procedure.

Why one command: the procedure of the MindFormers accuracy guide has a dozen steps (checklist, same weights,
same data, step-1/2, optimizer, layer profile, lr=0, band, long run, data checks) and the evidence only
convinces when all of them come from the same pair of runs. The framework code runs in subprocesses
(``demo.megatron_runner``, ``demo.mindformers_runner``; the repeat under torchrun with TP=2), each
writing a run store; this module stays framework-free, compares the stores and writes the report.

``--inject FAULT`` plants one known migration mistake (see :data:`demo.spec.FAULTS`); the report must
fail at the fault's stage and name its component. ``--example-logs`` keeps the old log-only example.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from align.procedure import report, stderr_progress
from align.procedure.arguments import parse_report_args, report_inputs
from align.stages import Inputs
from core.errors import BadInput
from core.findings import EXIT
from demo.spec import DEFAULT_SEED, FAULTS, MODEL_KINDS, Spec, fault, repeat_layout, trains_in_graph, write_spec
from reports.terminal import lines as terminal_lines

REPO = Path(__file__).resolve().parent.parent
DEFAULT_STEPS = 300
DEFAULT_LR0_STEPS = 20
# The repeat's layer tensors at step 1: the noise floor each step-1 layer row is judged against
# (comparators.noise_floor). Only a TP repeat has them: a DP=2 repeat's activations are half the batch.
REPEAT_TENSOR_STEPS = "1"
# Layer tensors: both sides compute float32 on the same CPU, and the clean pair's worst layer row is ~5e-7
# relative (measured), so float32 passes up to 1e-5 (20x that) and fails beyond 1e-4. The comparator's own
# float32 default (1e-4 / 1e-2) is meant for different hardware kernels (NPU vs GPU).
LAYER_TOLERANCE = (1e-5, 1e-4, 0.999999)   # float32 on one CPU: (pass, warn, cosine)
# The mcore candidates (--model dense): MindFormers' flash-attention path casts q, k and v to float16 even in
# a float32 run (the NPU kernel takes only float16/bfloat16). `align report` sees it without any option: the
# core_attention row is float16, so that row and every later one are judged at float16's line
# (comparators.layer_tensors.judged_dtypes) while the embedding and first norm keep the float32 line above, and the
# candidate's config (use_flash_attention, compute_dtype float32) makes the local-norm and lr = 0 stages judge
# at float16 (align.stages.evidence.Evidence.dtype; the optimizer check, on given gradients, keeps float32);
# its mcore model picks the mapping preset.


def _log(msg: str) -> None:
    stderr_progress(msg)


# ---------------------------------------------------------------------------------------------------------
# Specs for every run of the pair
# ---------------------------------------------------------------------------------------------------------

def make_specs(work: Path, steps: int, lr0_steps: int, inject: str | None,
               model_kind: str = "dense", seed: int = DEFAULT_SEED, candidate_graph: bool = True) -> dict[str, Spec]:
    """Baseline, repeat (TP=2), candidate, optimizer check and the lr=0 pair, with the fault applied.
    ``seed`` draws the initial weights and the batches (every run of the pair shares it);
    ``candidate_graph=False`` trains the mcore candidate in PYNATIVE (:func:`demo.spec.trains_in_graph`)."""
    f = fault(inject)
    base = Spec(role="baseline", out=str(work / "baseline"), steps=steps, inject=inject,
                init_weights=str(work / "megatron_init.pt"), optimizer_evidence=True,
                result_file=str(work / "baseline.json"), model_kind=model_kind, seed=seed)
    converted = "mindformers_init.ckpt" if model_kind == "llama" else "mindformers_init.safetensors"
    cand = replace(base, role="candidate", out=str(work / "candidate"), optimizer_evidence=False,
                   replay_dir=base.out, converted=str(work / converted),
                   result_file=str(work / "candidate.json"), graph=candidate_graph)
    if f is not None:
        name = f.name
        if name == "dropout_on":
            base.model = replace(base.model, hidden_dropout=0.1, attention_dropout=0.1)
        elif name == "norm_eps":
            cand.model = replace(cand.model, rms_norm_eps=1e-2)
        elif name == "lr_schedule":
            cand.lr_schedule, cand.warmup_steps = "cosine", max(1, steps // 10)
        elif name == "pad_eos":
            base.pad_id = cand.pad_id = base.eos_id
    layout = repeat_layout(model_kind)
    repeat = replace(base, role="repeat", out=str(work / ("repeat_tp2" if layout["tp"] > 1 else "repeat_dp2")),
                     **layout, tensor_steps=REPEAT_TENSOR_STEPS if layout["tp"] > 1 else "", init_weights=None,
                     optimizer_evidence=False,
                     result_file=str(work / "repeat.json"))
    optcheck = replace(cand, role="optimizer_check", out=str(work / "optimizer_check"), steps=1,
                       init_weights=None, step1_file=base.out, result_file=str(work / "optcheck.json"))
    lr0_base = replace(base, role="baseline", out=str(work / "lr0_baseline"), steps=lr0_steps, lr=0.0,
                       tensor_steps="", init_weights=None, optimizer_evidence=False, result_file=None)
    lr0_cand = replace(cand, role="candidate", out=str(work / "lr0_candidate"), steps=lr0_steps, lr=0.0,
                       tensor_steps="", init_weights=None, replay_dir=lr0_base.out, result_file=None)
    if lr0_cand.lr_schedule == "cosine":
        lr0_cand.lr_schedule = "constant"     # lr = 0 is lr = 0 whatever the schedule
    specs = {"baseline": base, "repeat": repeat, "candidate": cand, "optimizer_check": optcheck,
             "lr0_baseline": lr0_base, "lr0_candidate": lr0_cand}
    # the repeat at lr = 0 over the lr = 0 pair's steps: each lr = 0 step's noise floor (--lr0-repeat), measured
    # on the steps it judges, not step 1 alone. Not for the legacy Llama pair: its float32 TP=2 repeat at lr = 0
    # measures no noise (with no update to amplify the partial sums' rounding it stays below what float32
    # implies), which the report would warn about, and the step-1 floor judges those steps anyway
    if model_kind != "llama":
        specs["lr0_repeat"] = replace(repeat, out=str(work / "lr0_repeat"), steps=lr0_steps, lr=0.0,
                                      tensor_steps="", result_file=None)
    return specs


def _command(specs: list[Spec], paths: list[Path]) -> list[str]:
    py = sys.executable
    if specs[0].role in ("candidate", "optimizer_check"):
        return [py, "-m", "demo.mindformers_runner", *map(str, paths)]
    if specs[0].tp * specs[0].dp > 1:
        return [py, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={specs[0].tp * specs[0].dp}",
                "-m", "demo.megatron_runner", *map(str, paths)]
    return [py, "-m", "demo.megatron_runner", *map(str, paths)]


def run_jobs(jobs: list[tuple], work: Path, parallel: int = 2) -> dict[str, float]:
    """Run runner subprocesses, ``parallel`` at a time: each job as soon as a slot is free and the jobs it
    waits for have finished (a third item, their names; a name not among ``jobs`` counts as done), the first
    ready in list order; a failing runner stops the demo with its log.

    A job is a list of specs run in one process (MindSpore runs share one start-up)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", GLOG_v="3")
    pending = [(job[0], job[1], set(job[2]) if len(job) > 2 else set()) for job in jobs]
    names = {job[0] for job in pending}
    running: list[tuple[str, subprocess.Popen, float, Path]] = []
    took: dict[str, float] = {}
    while pending or running:
        while len(running) < parallel:
            ready = [job for job in pending if not (job[2] & names) - set(took)]
            if not ready:
                if not running:
                    raise RuntimeError(f"demo jobs wait for each other: {[job[0] for job in pending]}")
                break
            pending.remove(ready[0])
            name, specs, _ = ready[0]
            paths = []
            for spec in specs:     # next to the run it describes (one job may hold several pairs' runs)
                shutil.rmtree(spec.out, ignore_errors=True)
                spec_file = Path(spec.out).parent / "specs" / f"{spec.role}_{Path(spec.out).name}.json"
                paths.append(write_spec(spec, spec_file))
            log = work / "logs" / f"{name}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            with open(log, "w") as fh:
                proc = subprocess.Popen(_command(specs, paths), cwd=REPO, env=env, stdout=fh,
                                        stderr=subprocess.STDOUT)
            _log(f"started {name} ({', '.join(f'{s.role} {s.steps} steps' for s in specs)})")
            running.append((name, proc, time.perf_counter(), log))
        time.sleep(0.2)
        for item in list(running):
            name, proc, t0, log = item
            if proc.poll() is None:
                continue
            running.remove(item)
            took[name] = time.perf_counter() - t0
            if proc.returncode != 0:
                for _, other, _, _ in running:
                    other.kill()
                tail = log.read_text(errors="replace").strip().splitlines()[-15:]
                raise RuntimeError(f"{name} runner failed (exit {proc.returncode}); see {log}:\n"
                                   + "\n".join(tail))
            _log(f"finished {name} in {took[name]:.1f} s")
    return took


# ---------------------------------------------------------------------------------------------------------
# Report sections
# ---------------------------------------------------------------------------------------------------------

# The moe / mla pairs (demo.spec.MOE_KINDS): what each side is, and where the error band comes from.
_MOE_PAIRS = {
    "moe": ("Qwen3-MoE-shaped (q/k layernorm, every MLP 4 routed experts, top-2, softmax router)",
            "MindFormers 2.x mcore TrainingQwen3MoeForCausalLM (<code>use_legacy: False</code>, stacked experts, "
            "mapping <code>megatron_core__mindformers_mcore_moe</code>; {mode}; CPU stand-ins for the MoE kernels "
            "MindSpore 2.10 lacks on CPU; attention inputs cast to float16 by MindFormers' flash-attention path)",
            "the baseline run again with data parallelism 2 (each rank half of the same batch, gradients "
            "averaged: another summation order; megatron-core allows MoE with TP only under sequence parallelism, "
            "which its local norms do not support) and with attention q, k, v and output rounded through float16, "
            "the precision the candidate computes attention in: top-k routing and Adam's first steps turn that "
            "rounding into loss deltas of ~1e-4 within a few steps, which a float32 repeat cannot cover."),
    "mla": ("DeepSeek-V3-shaped (MLA with q/kv low-rank projections, every MLP 4 routed experts, top-2, sigmoid "
            "router with expert bias, one shared expert)",
            "MindFormers 2.x mcore TrainingDeepseekV3ForCausalLM (<code>use_legacy: False</code>, mapping "
            "<code>megatron_core__mindformers_mcore_mla</code>; {mode}; CPU stand-ins for the MoE kernels)",
            "the baseline run again with data parallelism 2 (each rank half of the same batch, gradients "
            "averaged: another summation order; megatron-core allows MoE with TP only under sequence "
            "parallelism, which its local norms do not support)."),
}


def _candidate_model(spec: Spec) -> str:
    kind = spec.model_kind
    if kind == "llama":
        return "MindFormers LlamaForCausalLM (legacy, <code>use_legacy: True</code>)"
    mode = ("trained in GRAPH, layer statistics captured inside the compiled step at the tensor steps"
            if trains_in_graph(spec) else "trained in PYNATIVE, layers captured by hooks at the tensor steps")
    if kind in _MOE_PAIRS:
        return _MOE_PAIRS[kind][1].format(mode=mode)
    return ("MindFormers 2.x mcore TrainingQwen3ForCausalLM (<code>use_legacy: False</code>, q/k layernorm on "
            "both sides, safetensors weights, mapping <code>megatron_core__mindformers_mcore_dense</code>; "
            f"{mode}; CPU stand-ins for the kernels MindSpore 2.10 lacks on CPU; attention inputs cast to float16 by "
            "MindFormers' flash-attention path, so the report judges attention and what follows it at float16's "
            "line, the embedding and first norm at float32's)")


def _candidate_build(kind: str) -> str:
    if kind == "llama":
        return "built in Python with the LlamaConfig values of its MindFormers YAML (the one the checklist reads)"
    return ("built from its MindFormers YAML (the one the checklist reads) by MindFormers' own "
            "<code>build_context</code> and <code>build_network</code>, as run_mindformer.py's Trainer builds it; "
            "the YAML's runner wrapper installs the CPU stand-ins")


def _model_shape(kind: str) -> str:
    if kind in _MOE_PAIRS:
        return _MOE_PAIRS[kind][0]
    return "Llama-shaped" if kind == "llama" else "Qwen3-shaped (Llama + q/k layernorm)"


def _section_setup(specs: dict[str, Spec], took: dict[str, float], inject: str | None) -> str:
    b = specs["baseline"]
    m = b.model
    f = fault(inject)
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{v:.1f} s</td></tr>" for k, v in took.items())
    fault_html = (f"<p><b>Injected fault:</b> <code>{html.escape(f.name)}</code> ({html.escape(f.what)}); "
                  f"expected to fail at stage <code>{f.stage}</code> naming "
                  f"<code>{f.component_for(b.model_kind)}</code>.</p>"
                  if f else "<p>No fault injected: the clean pair.</p>")
    band_html = _band_source(b.model_kind)
    return (
        f"{fault_html}"
        f"<p><b>Model:</b> {_model_shape(b.model_kind)}, "
        f"{m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads / "
        f"{m.num_query_groups} query groups, SwiGLU {m.ffn_hidden_size}, vocab {m.vocab_size}, seq "
        f"{m.seq_length}, micro-batch {m.micro_batch_size}, float32, on CPU.</p>"
        "<p><b>Baseline:</b> Megatron-core GPTModel (local spec) with Megatron's DDP, <code>get_megatron_optimizer"
        "</code> (Adam, clip 1.0, weight decay 0.1 with Megatron's groups) and OptimizerParamScheduler; "
        "the MegatronDumper records every step's batch (also in the seed layout <code>step_N/rank_R/*.npy</code>), "
        "named local norms (inside Megatron's grad-norm call), scalars, and layer statistics at steps "
        f"{html.escape(b.tensor_steps)}.</p>"
        f"<p><b>Candidate:</b> {_candidate_model(specs['candidate'])} from the converted baseline weights "
        f"(<code>align convert-weights</code>), {_candidate_build(b.model_kind)}, MindFormers AdamW over "
        "MindFormers' own weight-decay groups, its lr schedule, "
        f"{'CPUTrainOneStepCell' if b.model_kind == 'llama' else 'McoreCPUTrainOneStepCell'} (MFTrainOneStepCell "
        "with a CPU overflow check) with clipping and local norms; it replays the baseline's batches "
        "(MegatronReplayDataset's reader) and the MindSporeDumper records the same evidence.</p>"
        f"{band_html}"
        f"<p><b>lr = 0 pair:</b> {specs['lr0_baseline'].steps} steps each, learning rate 0 (weights never move), "
        "loss and global grad norm compared per step.</p>"
        f"<table><tr><th>run</th><th>wall time</th></tr>{rows}</table>")


def _band_source(kind: str) -> str:
    if kind in _MOE_PAIRS:
        return f"<p><b>Error band source:</b> {_MOE_PAIRS[kind][2]}</p>"
    return (
        "<p><b>Error band source:</b> the baseline run again with tensor parallelism 2 under torchrun "
        "(gloo). On CPU, torch is bit-deterministic for a fixed layout (a different thread count gave "
        "bit-identical losses here), so a plain re-run would give a zero band. TP=2 splits every row-parallel "
        "matmul (attention output, fc2) into two partial sums added by an all-reduce: a different floating-point "
        "summation order, which is the same kind of non-determinism a GPU run shows from run to run. It is honest "
        "but small, smaller than the float32 rounding between two frameworks, so the band has a floor of 8 "
        "float32 ulps of the largest baseline loss (a few ulps is what two different cross-entropy reductions "
        "give on the same logits).</p>")


# ---------------------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------------------

def paired_demo(out: str | Path, *, steps: int = DEFAULT_STEPS, lr0_steps: int = DEFAULT_LR0_STEPS,
                inject: str | None = None, reuse_baseline: str | Path | None = None,
                repeat: bool = True, parallel: int = 2, model_kind: str = "dense",
                optimizer_check: bool = True, seed: int = DEFAULT_SEED, candidate_graph: bool = True) -> dict[str, Any]:
    """Run the whole pair and write ``out/report.html``; returns summary.json's content.

    ``repeat=False`` skips the TP=2 repeat (the band then falls back to a relative tolerance; for short
    fault tests). ``reuse_baseline``: a previous demo output of the same ``steps``/``lr0_steps`` whose
    baseline-side runs (baseline, repeat, lr=0 baseline) are reused for a candidate-side fault (tests share
    one; a candidate-side fault test may run fewer ``steps`` than the reused baseline). ``lr0_steps=0`` runs no
    lr = 0 pair, ``optimizer_check=False`` no optimizer check (short fault tests). ``model_kind``: the candidate
    model (:data:`demo.spec.MODEL_KINDS`); a reused baseline must
    come from a demo of the same kind (the dense baseline has q/k layernorm) and ``seed`` (it draws the weights
    and batches: a clean pair must pass whatever the seed, so tests and `align demo --seed` draw others).
    ``candidate_graph=False``: the mcore candidate trains in PYNATIVE with layer hooks, not in GRAPH with its
    statistics captured in the compiled step (fault tests: a GRAPH compile with capture takes 10-25 s here, a
    dozen PYNATIVE steps a few).
    """
    out = Path(out)
    work = out / "runs"
    work.mkdir(parents=True, exist_ok=True)
    specs = make_specs(work, steps, lr0_steps, inject, model_kind, seed, candidate_graph)
    f = fault(inject)
    t0 = time.perf_counter()
    reused = False
    if reuse_baseline is not None and (f is None or f.side in ("candidate", "conversion")):
        copy_baseline_side(reuse_baseline, work, model_kind, seed)
        reused = True
    lr0 = lr0_steps > 0        # 0: no lr = 0 pair (short fault tests; the lr0_run stage is skipped)
    # The lr = 0 baseline runs in the baseline's process, the lr = 0 repeat in the repeat's (demo.megatron_runner
    # runs a list of specs: one torch + Megatron start-up, one torchrun launch fewer; its runs seed and build from
    # their own specs, bit for bit what a process of their own writes)
    jobs: list[tuple] = [] if reused else \
        [("baseline", [specs["baseline"]] + ([specs["lr0_baseline"]] if lr0 else []))]
    # One schedule, each run as soon as what it replays exists: the candidate after the baseline, while the
    # repeat (which needs nothing) fills the other slot. The lr = 0 candidate then runs in a process of its own
    # (converting the weights itself) in the slot the repeat leaves, instead of after the candidate in its
    # process (one MindSpore start-up more, ~40 s less on 2 cores); without a repeat it stays there.
    own = lr0 and not reused and repeat
    jobs.append(("candidate", [specs["candidate"]] + ([specs["optimizer_check"]] if optimizer_check else [])
                 + ([specs["lr0_candidate"]] if lr0 and not own else []),
                 {"baseline"}))
    if not reused and repeat:
        jobs.append(("repeat", [specs["repeat"]] + ([specs["lr0_repeat"]] if lr0 and "lr0_repeat" in specs else [])))
    if own:
        c = specs["lr0_candidate"]
        weights = Path(c.converted).with_name("lr0_" + Path(c.converted).name)
        jobs.append(("lr0_candidate", [replace(c, init_weights=specs["baseline"].init_weights, converted=str(weights))],
                     {"baseline"}))
    took = run_jobs(jobs, work, parallel)
    _log(f"runs done in {time.perf_counter() - t0:.1f} s{' (baseline side reused)' if reused else ''}")
    data = compare_pair(out, specs, took, inject)
    meta = {"inject": inject, "model": model_kind, "seed": seed, "steps": steps, "lr0_steps": lr0_steps,
            "wall_seconds": time.perf_counter() - t0, "run_seconds": took, "baseline_reused": reused}
    (out / "demo.json").write_text(json.dumps(meta, indent=1))
    return data


def copy_baseline_side(reuse_baseline: str | Path, work: Path, model_kind: str, seed: int) -> None:
    """Copy a previous demo's baseline-side runs (baseline, repeat, lr = 0 baseline and repeat, the initial
    weights) into ``work``; refused when that demo drew another model kind or seed (its weights and batches)."""
    src = Path(reuse_baseline) / "runs"
    prev = Path(reuse_baseline) / "demo.json"
    prev_meta = json.loads(prev.read_text()) if prev.is_file() else {"model": model_kind}
    prev_kind = prev_meta.get("model", "llama")
    if prev_kind != model_kind:
        raise BadInput(f"--reuse-baseline {reuse_baseline}: its baseline is for --model {prev_kind}, "
                       f"not {model_kind}")
    prev_seed = prev_meta.get("seed", DEFAULT_SEED)
    if prev_seed != seed:
        raise BadInput(f"--reuse-baseline {reuse_baseline}: its baseline was drawn with --seed {prev_seed}, "
                       f"not {seed}")
    for name in ("baseline", "lr0_baseline", "repeat_tp2", "repeat_dp2", "lr0_repeat"):
        if (src / name).is_dir():
            shutil.copytree(src / name, work / name, dirs_exist_ok=True)
    for name in ("megatron_init.pt", "baseline.json", "repeat.json"):
        if (src / name).is_file():
            shutil.copy2(src / name, work / name)


def report_argv(specs: dict[str, Spec], out: Path) -> list[str]:
    """The demo's report as the `align report` command a user would type on the same runs."""
    lr0 = [specs["lr0_baseline"].out, specs["lr0_candidate"].out]
    argv = [specs["baseline"].out, specs["candidate"].out, "--out", str(out),
            *(["--lr0", *lr0] if all(Path(p, "meta.json").is_file() for p in lr0) else []),
            *(["--optimizer-check", specs["optimizer_check"].out]
              if Path(specs["optimizer_check"].out, "evidence").is_dir() else []),
            "--layer-tolerance", "float32={},{},{}".format(*LAYER_TOLERANCE)]
    if Path(specs["repeat"].out, "meta.json").is_file():
        argv += ["--repeat", specs["repeat"].out]
        if "--lr0" in argv and "lr0_repeat" in specs and Path(specs["lr0_repeat"].out, "meta.json").is_file():
            argv += ["--lr0-repeat", specs["lr0_repeat"].out]
    return argv


def compare_pair(out: Path, specs: dict[str, Spec], took: dict[str, float], inject: str | None) -> dict[str, Any]:
    """The procedure on the finished runs, exactly as `align report` runs it (the command is saved in
    ``out/report_command.txt``); the demo adds only its description of the pair."""
    argv = report_argv(specs, out)
    data = report(report_inputs(parse_report_args(argv)), str(out), progress=stderr_progress,
                  preface=[("Setup of the pair", _section_setup(specs, took, inject))])
    (out / "report_command.txt").write_text("align report " + " ".join(shlex.quote(a) for a in argv) + "\n")
    return data


def run_demo(args: argparse.Namespace) -> int:
    if getattr(args, "example_logs", False):
        return run_example_logs(args)
    if args.inject is not None and args.inject not in FAULTS:
        raise BadInput(f"--inject {args.inject}: unknown fault; known: {', '.join(FAULTS)}")
    model_kind = getattr(args, "model", None) or "dense"
    if model_kind not in MODEL_KINDS:
        raise BadInput(f"--model {model_kind}: unknown model; known: {', '.join(MODEL_KINDS)}")
    if args.inject == "qk_swap" and model_kind == "mla":
        raise BadInput("--inject qk_swap: the mla model has no fused linear_qkv to permute")
    if args.inject is not None and model_kind not in FAULTS[args.inject].kinds:
        raise BadInput(f"--inject {args.inject}: applies to --model {' / '.join(FAULTS[args.inject].kinds)} only")
    if args.steps < 3:
        raise BadInput("--steps must be at least 3 (step 1, step 2 and a long run)")
    t0 = time.perf_counter()
    data = paired_demo(args.out, steps=args.steps, lr0_steps=args.lr0_steps, inject=args.inject,
                       reuse_baseline=args.reuse_baseline, model_kind=model_kind,
                       seed=getattr(args, "seed", DEFAULT_SEED))
    print("\n".join(terminal_lines(data, Path(args.out).resolve())))
    print(f"took: {time.perf_counter() - t0:.0f} s")
    return EXIT[data["verdict"]]


def run_example_logs(args: argparse.Namespace) -> int:
    """The log-only example: bundled Megatron-LM / MindFormers logs, no framework needed."""
    from demo.example_logs import write_examples

    out = Path(args.out)
    paths = write_examples(out / "inputs")
    data = report(Inputs(str(paths["baseline"]), str(paths["candidate"]), repeats=[str(paths["repeat"])]),
                  str(out), progress=stderr_progress)
    print("\n".join(terminal_lines(data, out.resolve())))
    print(f"inputs: {out / 'inputs'}")
    return EXIT[data["verdict"]]
