"""Layer tensors at step 1: the first layer whose output departs beyond its noise, forward then backward, from
whatever both stores captured (statistics or full tensors), through the mapping. The noise is the baseline's
repeat at the same step where it holds layer rows (comparators.noise_floor), under the dtype's line."""

from __future__ import annotations

from typing import Any

from align.stages import AFTER_STEP1, Figure, FigureContext, Stage
from align.stages.evidence import Evidence
from comparators.layer_tensors import ONE_SIDED_KINDS, compare_layer_tensors
from core.findings import Finding, StageResult, skipped
from reports.figures import layer_profile
from reports.html import table
from sources.layers import GatheredLayers, LayerSource, gather_layers, layer_source

SEARCH = 20


def _first_tensor_step(a: LayerSource, b: LayerSource) -> tuple[int, Any] | None:
    """The first step (of the first SEARCH both runs have files for) where both hold layer rows, with both
    sides' rows of that step (a gathered source's one whole model, else each side's first rank): read once,
    handed to the comparator."""
    for s in sorted(set(a.array_steps()) & set(b.array_steps()))[:SEARCH]:
        rows = []
        for src in (a, b):
            rows.append(src.layer_rows(s, src.array_ranks(s)[0]))
            if not rows[-1][0]:
                break
        else:
            return s, tuple(rows)
    return None


def run(ev: Evidence) -> StageResult:
    b, c = ev.baseline, ev.candidate
    # a parallel run's rank files are put back together into one whole model's rows first
    srcs = [gather_layers(layer_source(r, required=False)) for r in (b, c)]
    found = _first_tensor_step(*srcs) if None not in srcs else None
    from_rerun = False
    if found is None and srcs[0] is not None and ev.rerun is not None:
        # the candidate holds no layer tensors: its re-run's stand in (the rerun_check stage says how far)
        rerun_src = gather_layers(layer_source(ev.rerun, required=False))
        found = _first_tensor_step(srcs[0], rerun_src) if rerun_src is not None else None
        if found is not None:
            c, srcs[1], from_rerun = ev.rerun, rerun_src, True
    if srcs[0] is None or srcs[1] is None:
        return skipped("layer_tensors", "layer tensors come from run stores or msprobe dumps; "
                       f"{', '.join(r.label for r, s in zip((b, c), srcs, strict=True) if s is None)} is a log")
    if found is None:
        return skipped("layer_tensors", "no step where both runs hold layer tensors (tensor_stats / dump.json)")
    step, rows = found
    opt = ev.options
    repeat, repeat_rank, no_floor = _repeat_layers(ev, step)
    res = compare_layer_tensors(srcs[0], srcs[1], ev.mapping, step=step,
                                candidate_rank=srcs[1].array_ranks(step)[0], rank=srcs[0].array_ranks(step)[0],
                                tolerances=opt.layer_tolerance or None, jobs=opt.jobs, scheduler=opt.scheduler,
                                readers=_readers(*srcs), rows=rows, one_sided_kinds=ONE_SIDED_KINDS,
                                repeat=repeat, repeat_rank=repeat_rank, no_floor=no_floor)
    gathered = {side: src.notes.get(step) for side, src in zip(("baseline", "candidate"), srcs, strict=True)
                if isinstance(src, GatheredLayers) and src.notes.get(step)}
    if gathered:
        res.details["gathered"] = gathered
    if from_rerun:
        check = ev.rerun_check
        res.details["candidate_layers_from"] = f"re-run {c.path}"
        if check is not None and check.verdict == "fail":
            res.add(Finding("layer_tensors", "warn", None, "rerun_not_evidence", None, None,
                            "the candidate's layer tensors come from a re-run that does not reproduce it "
                            "(rerun_check): the departing module named here may not be the candidate's"))
    return res


def _repeat_layers(ev: Evidence, step: int) -> tuple[LayerSource | None, int | None, str | None]:
    """The first repeat holding layer rows at ``step`` (its first rank there): the rows' noise floor; else
    why there is none (the rows are then judged at their dtype's line and say so)."""
    if not ev.repeats:
        return None, None, "no --repeat run"
    for r in ev.repeats:
        src = layer_source(r, required=False)
        if src is None or step not in set(src.array_steps()):
            continue
        ranks = src.array_ranks(step)
        if ranks and src.layer_rows(step, ranks[0])[0]:
            return src, ranks[0], None
    return None, None, (f"the repeat holds no layer tensors at step {step}: capture them on the repeat too "
                        f"(tensor_steps=[{step}]) from a repeat that sees the whole batch (another TP layout or "
                        "no determinism: a data-parallel rank's rows hold its share of the batch)")


def _readers(*srcs: LayerSource) -> Any:
    """Dumps that keep full tensors as files of their own (msprobe's PyTorch .pt files): read them with
    torch (weights_only), when torch is installed; without it the comparator falls back to the dump's own
    statistics and says so."""
    import importlib.util

    if not any(s.needs_readers for s in srcs) or importlib.util.find_spec("torch") is None:
        return None
    from checkpoints.torch_tensors import READERS

    return READERS


FLOOR_COLUMNS = ("module", "kind", "judged_dtype", "value", "ratio", "floor", "verdict", "decided_by",
                 "floor_source")


def section(res: StageResult) -> str:
    """The per-layer profile, then every row's difference, its ratio to its noise floor and the floor's source."""
    rows = res.details.get("per_layer") or []
    if not rows:
        return ""
    keys = [k for k in rows[0] if not isinstance(rows[0][k], (dict, list))]
    gathered = [{"side": side, "gathered": "; ".join(notes)} for side, notes in
                (res.details.get("gathered") or {}).items()]    # a parallel run's ranks put back together
    out = (table(gathered) if gathered else "") + table([{k: r.get(k) for k in keys} for r in rows])
    judged = res.details.get("rows") or []
    if judged and "floor_source" in judged[0]:
        out += table([{k: r.get(k) for k in FLOOR_COLUMNS} for r in judged])
    return out


def figures(res: StageResult, ctx: FigureContext) -> list[Figure]:
    rows = res.details.get("rows")
    if not rows:
        return []
    return [Figure("Layer profile (red: beyond the dtype's tolerance)", "layer_profile.png",
                   lambda p: layer_profile(rows, res.verdict, p))]


def culprit(res: StageResult) -> list[Finding]:
    """The stage's own order: the first departing tensor forward, then backward (a later layer's larger
    difference is the inherited one)."""
    return list(res.findings)


STAGE = Stage(
    name="layer_tensors", order=60, title="Layer profile (step 1, forward then backward)",
    needs="layer tensor statistics or full tensors of the same step in both run stores",
    capture="MegatronDumper / TorchDumper DumpConfig(tensor_steps=[1, 2], modules=[...]); MindSporeDumper "
            "DumpConfig(tensor_steps=[1, 2], cells=[...]) in PYNATIVE (re-run steps 1-2 in PYNATIVE when "
            "training runs in GRAPH mode, and pass the re-run as --rerun RUN)",
    run=run, section=section, figures=figures, figure_order=4,
    part="step 1 and 2", explains=(*AFTER_STEP1, "moe_routing"), culprit=culprit,
    why=("The first module whose tensor departs beyond its noise at step 1: the difference starts here; the "
         "modules after it (and the loss, the gradients, the long run) inherit it."),
    next=("align isolate {baseline} --candidate-yaml {candidate_yaml} --candidate-ckpt CANDIDATE_STEP1.safetensors "
          "--modules '{layer}' --modules '{layer}.*' --out isolation_run (gradients too where the baseline holds a "
          "module backward capture of that step), then align report {baseline} {candidate} --isolation "
          "isolation_run: {module}'s own error or an inherited one"))
