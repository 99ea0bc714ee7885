"""The data near a divergence (guide stage 3): the steps around the first divergent step, with both runs'
loss and grad norm, the batch each trained on, and whether the candidate's batch equals the baseline's."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from align.checks.data import BATCH_KEYS, batch_digest
from align.stages import Stage
from align.stages.evidence import Evidence
from core.findings import Finding, StageResult, skipped
from reports.html import table
from runstore import dp_batches
from runstore.run import Run

BEFORE, AFTER = 3, 2     # steps shown before and after the divergence step


def step_batch(run: Run, step: int) -> dict[str, np.ndarray] | None:
    """The batch a run store recorded at ``step`` (its first rank's), or None."""
    if run.store is None or step not in run.store.array_steps():
        return None
    # DP rank 0's batch, joined from its TP / pipeline / context-parallel ranks
    batch = next((b for _, b, _, _, _ in dp_batches(run.store, step)), {})
    return batch if "tokens" in batch else None


def _value(run: Run, key: str, step: int) -> float | None:
    s = run.series(key)
    return float(s[step]) if step in s.index else None


def run(ev: Evidence) -> StageResult:
    lr = ev.scalars.stages.get("long_run")
    div = lr.details.get("divergence_step") if lr is not None else None
    if div is None:
        return skipped("divergence_data", "no divergence in the long run")
    steps = ev.baseline.series("loss").index
    around = [int(s) for s in steps[(steps >= div - BEFORE) & (steps <= div + AFTER)]]
    rows: list[dict[str, Any]] = []
    differs = []
    for s in around:
        row: dict[str, Any] = {"step": s}
        for role, r in (("baseline", ev.baseline), ("candidate", ev.candidate)):
            row[f"loss_{role}"] = _value(r, "loss", s)
            row[f"grad_norm_{role}"] = _value(r, "grad_norm", s)
        bb, cb = step_batch(ev.baseline, s), step_batch(ev.candidate, s)
        if bb is not None:
            row.update({f"baseline_{k}": v for k, v in batch_digest(bb).items()})
        if bb is not None and cb is not None:
            same = all(np.array_equal(np.asarray(bb[k]), np.asarray(cb[k])) for k in BATCH_KEYS
                       if k in bb and k in cb)
            row["same_batch"] = same
            if not same:
                differs.append(s)
        else:
            row["same_batch"] = None
        rows.append(row)
    res = StageResult("divergence_data", details={"divergence_step": div, "rows": rows})
    known = [r["same_batch"] for r in rows if r["same_batch"] is not None]
    if differs:
        res.add(Finding("divergence_data", "fail", f"batch step {differs[0]}", "batch_differs", differs[0], None,
                        f"near the divergence at step {div} the candidate trained on a different batch than the "
                        f"baseline at step(s) {differs}: look at the data pipeline first"))
    else:
        d = next((r for r in rows if r["step"] == div), None)
        loss_b = d and d.get("loss_baseline")
        loss_c = d and d.get("loss_candidate")
        gap = (f"loss {loss_b:.6g} vs {loss_c:.6g}" if isinstance(loss_b, float) and isinstance(loss_c, float)
               and math.isfinite(loss_b) and math.isfinite(loss_c) else "loss shown in the table")
        what = (f"the batches of all {len(known)} steps shown are identical in both runs, so the data is not the "
                "cause" if known else "batches were not recorded by both runs, so the data cannot be ruled out")
        res.add(Finding("divergence_data", "warn", f"step {div}", "divergence_data", div, None,
                        f"divergence starts at step {div} ({gap}); {what}"))
    return res


def section(res: StageResult) -> str:
    return table(res.details.get("rows") or [])


STAGE = Stage(
    name="divergence_data", order=115, title="Data near the divergence",
    needs="a divergence in the long run; batches recorded in both run stores to show them",
    capture="record batches every step with the dumpers (the default) so the steps around a divergence "
            "can be shown and compared",
    run=run, section=section,
    part="long run",
    why=("At the step where the runs part, the data the two runs saw differs."),
    next=("compare the batches of that step on both sides (align check-data) and the data order (seed, shuffle, "
          "blending)"))
