"""lr = 0 pair: the weights never move, so loss and grad norm must agree at every step to the dtype's noise.

Why: it isolates forward/backward over many batches from the optimizer; a gap here that grows with steps
is data, one that is constant is the model."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from align.stages import Figure, FigureContext, Stage
from align.stages.evidence import Evidence
from core.findings import Finding, StageResult, skipped
from reports.figures import lr0_pair

# Relative agreement of the lr=0 pair: (pass up to, warn up to) by compute dtype. float32 across frameworks
# agrees to ~1e-7..1e-6 (measured on the demo pair); low precision keeps 8 (bf16) or 11 (fp16) bits.
RTOL = {"float32": (1e-5, 1e-4), "float64": (1e-8, 1e-6), "float16": (1e-3, 1e-2), "bfloat16": (5e-3, 2e-2)}


def _rel(a: float, b: float) -> float:
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


def run(ev: Evidence) -> StageResult:
    if ev.lr0 is None:
        return skipped("lr0_run", "no lr=0 pair (--lr0 BASELINE CANDIDATE)")
    b, c = ev.lr0
    dtype, source = ev.dtype
    tol = ev.options.lr0_rtol or RTOL.get(dtype, RTOL["float32"])
    res = StageResult("lr0_run")
    common = b.series("loss").index.intersection(c.series("loss").index)
    details: dict[str, Any] = {"steps": len(common), "dtype": dtype, "dtype_source": source, "rtol": tol}
    if not len(common):
        return skipped("lr0_run", "the lr=0 runs logged no loss at a common step")
    for key in ("loss", "grad_norm"):
        sb, sc = b.series(key), c.series(key)
        steps = sb.index.intersection(sc.index)
        if not len(steps):
            continue
        rels = [(_rel(float(sb[s]), float(sc[s])), int(s)) for s in steps]
        worst_rel, worst_step = max(rels)
        details[f"max_rel_{key}"] = worst_rel
        details[f"worst_step_{key}"] = worst_step
        v = "pass" if worst_rel <= tol[0] else "warn" if worst_rel <= tol[1] else "fail"
        res.add(Finding("lr0_run", v, key, f"max_rel_{key}", worst_rel, tol[0],
                        f"lr=0, {len(steps)} steps: {key} agrees to {worst_rel:.3g} relative at worst "
                        f"(step {worst_step}; {dtype} passes up to {tol[0]:g})"
                        + ("" if v == "pass" else ": the forward/backward differs even without updates")))
    sb, sc = b.series("loss"), c.series("loss")
    details["table"] = [{"step": int(s), "loss_baseline": float(sb[s]), "loss_candidate": float(sc[s])}
                        for s in common]
    res.details.update(details)
    return res


def figures(res: StageResult, ctx: FigureContext) -> list[Figure]:
    rows = res.details.get("table") or []
    if not rows:
        return []

    def draw(path: Path) -> bytes | None:
        png = lr0_pair(rows)
        if png:
            path.write_bytes(png)
        return png

    return [Figure("lr = 0 pair: loss per step and its delta", "lr0_pair.png", draw)]


STAGE = Stage(
    name="lr0_run", order=90, title="lr = 0 pair",
    needs="a baseline and a candidate run with learning rate 0 (loss and grad norm per step)",
    capture="run both sides again with lr 0 (Megatron --lr 0 --min-lr 0; MindFormers lr_schedule "
            "learning_rate: 0) for ~20 steps on the same batches, then --lr0 BASELINE_LR0 CANDIDATE_LR0",
    run=run, figures=figures)
