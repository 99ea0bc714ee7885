"""Is a re-run evidence for the run it re-runs? MindFormers trains in GRAPH mode; layer tensors have often come
from a PYNATIVE re-run of the first steps. The two are the same framework on the same batches and weights, so
their losses and named local norms must agree within the precision's noise; where they do not (MindFormers'
PYNATIVE computes DeepSeek-V3's MLA projection gradients ~30% off GRAPH with the loss agreeing), the re-run's
layer tensors say nothing about the run that disagreed."""

from __future__ import annotations

import math
from typing import Any

from comparators.local_norms import RTOL as NORM_RTOL
from comparators.local_norms import read_local_norms
from core.findings import Finding, StageResult, skipped

STAGE = "rerun_check"
# loss of one framework run twice, GRAPH vs PYNATIVE: (pass up to, warn up to) by compute dtype
LOSS_RTOL = {"float32": (1e-5, 1e-4), "float64": (1e-8, 1e-6), "float16": (1e-3, 1e-2), "bfloat16": (5e-3, 2e-2)}


def _rel(a: float, b: float) -> float:
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


def _judge(rel: float, tol: tuple[float, float]) -> str:
    return "pass" if rel <= tol[0] else "warn" if rel <= tol[1] else "fail"


def compare_rerun(run: Any, rerun: Any, *, dtype: str = "float32", top: int = 5) -> StageResult:
    """``run`` and ``rerun`` are runs (``series(key)``, ``local_norm_steps()``, ``store``) of the same framework:
    the loss at every common step and the named local norms of the first common step, judged at ``dtype``."""
    loss_tol, norm_tol = LOSS_RTOL.get(dtype, LOSS_RTOL["float32"]), NORM_RTOL.get(dtype, NORM_RTOL["float32"])
    res = StageResult(STAGE, details={"dtype": dtype, "loss_rtol": loss_tol, "norm_rtol": norm_tol})
    a, b = run.series("loss"), rerun.series("loss")
    common = a.index.intersection(b.index)
    norm_steps = sorted(set(run.local_norm_steps(limit=20)) & set(rerun.local_norm_steps(limit=20)))
    if not len(common) and not norm_steps:
        return skipped(STAGE, "the run and its re-run share no step with a loss or local norms")
    if len(common):
        rels = [(_rel(float(a[s]), float(b[s])), int(s)) for s in common]
        worst, step = max(rels)
        verdict = _judge(worst, loss_tol)
        res.details.update(loss_steps=len(common), loss_worst_rel=worst, loss_worst_step=step)
        res.add(Finding(STAGE, verdict, "loss", "rel_delta", worst, loss_tol[0],
                        f"loss: the re-run {'agrees with' if verdict == 'pass' else 'differs from'} the run at "
                        f"{len(common)} common step(s); largest relative difference {worst:.3g} at step {step}"))
    if norm_steps:
        step = norm_steps[0]
        na, _ = read_local_norms(run.store if run.store is not None else run, step)
        nb, _ = read_local_norms(rerun.store if rerun.store is not None else rerun, step)
        names = [n for n in na if n in nb]
        rows = sorted(((_rel(na[n].full_norm(), nb[n].full_norm()), n) for n in names), reverse=True)
        bad = [(r, n) for r, n in rows if r > norm_tol[0]]
        res.details.update(norm_step=step, norms_compared=len(names), norms_differing=len(bad),
                           norms_worst=[{"name": n, "rel": r} for r, n in rows[:top]])
        only = sorted(set(na) ^ set(nb))
        if only:
            res.add(Finding(STAGE, "warn", only[0], "names_on_one_side", len(only), 0,
                            f"{len(only)} parameter(s) have a local norm in only one of the two (first: {only[0]})"))
        if not bad:
            res.add(Finding(STAGE, "pass", None, "local_norm_rel", rows[0][0] if rows else 0.0, norm_tol[0],
                            f"local norms: all {len(names)} agree at step {step}"))
        for r, n in bad[:top]:
            res.add(Finding(STAGE, _judge(r, norm_tol), n, "local_norm_rel", r, norm_tol[0],
                            f"local norm of {n} at step {step}: the re-run differs by {r:.3g} relative"))
    if res.verdict == "fail":
        res.details["not_evidence"] = True
        res.add(Finding(STAGE, "fail", None, "rerun_not_evidence", None, None,
                        "the re-run does not reproduce the run: its layer tensors are not evidence for the run "
                        "that disagreed; capture layer tensors in the run itself (GRAPH capture) or find why "
                        "the two modes differ first"))
    return res
