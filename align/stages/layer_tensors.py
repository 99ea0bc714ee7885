"""Layer tensors at step 1: the first layer whose output departs beyond its dtype's noise, forward then
backward, from whatever both stores captured (statistics or full tensors), through the mapping."""

from __future__ import annotations

from align.core.findings import StageResult, skipped, worst
from align.stages import Stage
from align.stages.evidence import Evidence
from comparators.tensors import compare_layer_tensors
from reports.html import table

SEARCH = 20
# Row kinds one dumper records and the other may not (the MindSpore dumper records outputs and output
# gradients only): rows of such a kind with no counterpart at all are reported, not judged.
ONE_SIDED_KINDS = ("forward.input", "backward.grad_input")


def _tensor_steps(ev: Evidence) -> list[int]:
    out = []
    for r in (ev.baseline, ev.candidate):
        steps = [s for s in r.store.array_steps()[:SEARCH] if r.store.has_group(s, "tensor_stats")]
        out.append(set(steps))
    return sorted(out[0] & out[1])


def run(ev: Evidence) -> StageResult:
    b, c = ev.baseline, ev.candidate
    if b.store is None or c.store is None:
        return skipped("layer_tensors", "layer tensors come from run stores; "
                       f"{', '.join(r.label for r in (b, c) if r.store is None)} is a log")
    steps = _tensor_steps(ev)
    if not steps:
        return skipped("layer_tensors", "no step where both stores hold layer tensors (tensor_stats)")
    res = compare_layer_tensors(b.store, c.store, ev.inputs.mapping, step=steps[0],
                                tolerances=ev.options.layer_tolerance or None)
    unmatched = res.details.get("unmatched_baseline") or []
    if unmatched and all(u.split(" ")[-1].startswith(ONE_SIDED_KINDS) for u in unmatched):
        res.findings = [f for f in res.findings if f.metric != "unmatched_rows"]
        res.verdict = worst([f.verdict for f in res.findings])
        res.details["note"] = (f"{len(unmatched)} baseline rows (module inputs / input gradients) have no "
                               "counterpart kind in the candidate's dump; outputs and output gradients are compared")
    res.details["step"] = steps[0]
    return res


def section(res: StageResult) -> str:
    rows = res.details.get("per_layer") or []
    if not rows:
        return ""
    keys = [k for k in rows[0] if not isinstance(rows[0][k], (dict, list))]
    return table([{k: r.get(k) for k in keys} for r in rows])


STAGE = Stage(
    name="layer_tensors", order=60, title="Layer profile (step 1, forward then backward)",
    needs="layer tensor statistics or full tensors of the same step in both run stores",
    capture="MegatronDumper / TorchDumper DumpConfig(tensor_steps=[1, 2], modules=[...]); MindSporeDumper "
            "DumpConfig(tensor_steps=[1, 2], cells=[...]) in PYNATIVE (re-run steps 1-2 in PYNATIVE when "
            "training runs in GRAPH mode)",
    run=run, section=section)
