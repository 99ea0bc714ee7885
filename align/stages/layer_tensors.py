"""Layer tensors at step 1: the first layer whose output departs beyond its dtype's noise, forward then
backward, from whatever both stores captured (statistics or full tensors), through the mapping."""

from __future__ import annotations

from typing import Any

from align.stages import Figure, FigureContext, Stage
from align.stages.evidence import Evidence
from comparators.tensors import compare_layer_tensors, layer_source
from core.findings import StageResult, skipped, worst
from reports.figures import layer_profile
from reports.html import table
from runstore.run import Run

SEARCH = 20
# Row kinds one dumper records and the other may not (the MindSpore dumper records outputs and output
# gradients only): rows of such a kind with no counterpart at all are reported, not judged.
ONE_SIDED_KINDS = ("forward.input", "backward.grad_input")


def _has_layers(run: Run) -> bool:
    return run.store is not None or run.kind == "msprobe"


def _first_tensor_step(a: Any, b: Any) -> int | None:
    """The first step (of the first SEARCH both runs have files for) where both hold layer rows; a step's
    rows are read only until one is found, and the comparator reads that step again in full."""
    for s in sorted(set(a.array_steps()) & set(b.array_steps()))[:SEARCH]:
        if all(src.layer_rows(s, src.array_ranks(s)[0])[0] for src in (a, b)):
            return s
    return None


def run(ev: Evidence) -> StageResult:
    b, c = ev.baseline, ev.candidate
    if not _has_layers(b) or not _has_layers(c):
        return skipped("layer_tensors", "layer tensors come from run stores or msprobe dumps; "
                       f"{', '.join(r.label for r in (b, c) if not _has_layers(r))} is a log")
    srcs = [layer_source(r) for r in (b, c)]
    step = _first_tensor_step(*srcs)
    if step is None:
        return skipped("layer_tensors", "no step where both runs hold layer tensors (tensor_stats / dump.json)")
    opt = ev.options
    res = compare_layer_tensors(srcs[0], srcs[1], ev.mapping, step=step,
                                candidate_rank=srcs[1].array_ranks(step)[0], rank=srcs[0].array_ranks(step)[0],
                                tolerances=opt.layer_tolerance or None, jobs=opt.jobs, scheduler=opt.scheduler,
                                readers=_readers(b, c))
    unmatched = res.details.get("unmatched_baseline") or []
    if unmatched and all(u.split(" ")[-1].startswith(ONE_SIDED_KINDS) for u in unmatched):
        res.findings = [f for f in res.findings if f.metric != "unmatched_rows"]
        res.verdict = worst([f.verdict for f in res.findings])
        res.details["note"] = (f"{len(unmatched)} baseline rows (module inputs / input gradients) have no "
                               "counterpart kind in the candidate's dump; outputs and output gradients are compared")
    res.details["step"] = step
    return res


def _readers(*runs: Run) -> Any:
    """msprobe's PyTorch dumps keep full tensors as .pt files: read them with torch (weights_only), when
    torch is installed; without it the comparator falls back to msprobe's own statistics and says so."""
    import importlib.util

    if not any(r.kind == "msprobe" for r in runs) or importlib.util.find_spec("torch") is None:
        return None
    from checkpoints.torch_tensors import READERS

    return READERS


def section(res: StageResult) -> str:
    rows = res.details.get("per_layer") or []
    if not rows:
        return ""
    keys = [k for k in rows[0] if not isinstance(rows[0][k], (dict, list))]
    return table([{k: r.get(k) for k in keys} for r in rows])


def figures(res: StageResult, ctx: FigureContext) -> list[Figure]:
    rows = res.details.get("rows")
    if not rows:
        return []
    return [Figure("Layer profile (red: beyond the dtype's tolerance)", "layer_profile.png",
                   lambda p: layer_profile(rows, res.verdict, p))]


STAGE = Stage(
    name="layer_tensors", order=60, title="Layer profile (step 1, forward then backward)",
    needs="layer tensor statistics or full tensors of the same step in both run stores",
    capture="MegatronDumper / TorchDumper DumpConfig(tensor_steps=[1, 2], modules=[...]); MindSporeDumper "
            "DumpConfig(tensor_steps=[1, 2], cells=[...]) in PYNATIVE (re-run steps 1-2 in PYNATIVE when "
            "training runs in GRAPH mode)",
    run=run, section=section, figures=figures, figure_order=4)
