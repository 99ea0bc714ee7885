"""The procedure's stages: one file each, found by scanning this package, run in the accuracy guide's order.

Why a registry: `align report` on a user's runs and `align demo` on its own runs must run the very same
stages; a stage is data (name, order, the evidence it needs, what to capture when that is missing) plus one
function from :class:`Evidence` to a :class:`StageResult`. Adding a stage is adding one file here that
defines ``STAGE`` (or ``STAGES``); see docs/extending.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pandas as pd

from align.stages.evidence import Evidence, Inputs, Options
from core.findings import Finding, StageResult
from core.registry import collect
from reports.render import Figure

__all__ = ["AFTER_STEP1", "LATER", "LONG_RUN", "PARTS", "Evidence", "Figure", "FigureContext", "Inputs", "Options",
           "Stage", "registry", "run_stages"]

# The procedure's parts, in the accuracy guide's order (a stage's ``part``): what a verdict covers is said per part.
PARTS = ("inputs", "checklist", "same start", "step 1 and 2", "long run")
# What a failure explains (``Stage.explains``), shared by the stages that name the same consequences: a drift
# over the run, and everything that follows from a wrong step 1. "*": every stage of a later part.
LATER = ("*",)
LONG_RUN = ("long_run", "grad_norm", "norm_trajectories", "spikes", "divergence_data", "aux_losses")
AFTER_STEP1 = ("step1_loss", "step1_local_norm", "step2_loss", "lr0_run", "nonfinite", *LONG_RUN)


@dataclass(frozen=True)
class FigureContext:
    """What a stage's figures may draw beyond its own result: the per-step scalar table (``delta``, ``band``,
    ``outside``, ... by step; empty when the runs have none), a label per run role (``"baseline:
    FILE"``) and every stage's result (a figure may mark another stage's finding)."""

    table: pd.DataFrame
    labels: dict[str, str]
    stages: dict[str, StageResult]


@dataclass(frozen=True)
class Stage:
    """One stage of the procedure.

    ``order`` places it in the guide's sequence; ``needs`` says in words what evidence it reads; ``capture``
    says what to do to get that evidence when it is missing (shown on a skipped stage); ``run`` computes
    it. For the report, all optional: ``section`` renders an HTML body (not for a skipped result);
    ``figures`` declares figures (:class:`Figure`: title, file, draw), drawn only when the report is
    written; it is asked for every result, a skipped one too, and returns none where there is nothing to
    draw; ``figure_order`` places them among the others (default ``order``: the whole run's curves come
    first); ``step_row`` gives a row of the step-1 / step-2 table (not for a skipped result); a tuple of
    ``summary_keys`` makes summary.json always list the stage (skipped when it did not run) with those keys
    (null when absent)."""

    name: str
    order: int
    title: str
    needs: str
    capture: str
    run: Callable[[Evidence], StageResult]
    section: Callable[[StageResult], str] | None = None
    figures: Callable[[StageResult, FigureContext], list[Figure]] | None = None
    figure_order: int | None = None
    step_row: Callable[[StageResult], dict[str, Any]] | None = None
    summary_keys: tuple[str, ...] | None = None
    # The diagnosis (align/procedure/diagnosis.py): the part of the procedure the stage belongs to (PARTS),
    # the stages whose failure a failure of this one explains (a forward departure explains the step-1 loss
    # that follows from it), what such a failure usually means (the accuracy guide) and what to run next
    # ("{component}" is filled with the finding's component); ``culprit`` orders a result's findings when the
    # strongest is not the largest ratio (the first departing layer, not the one furthest off).
    part: str = "long run"
    explains: tuple[str, ...] = ()
    why: str = ""
    next: str = ""
    culprit: Callable[[StageResult], list[Finding]] | None = None


_REGISTRY: list[Stage] | None = None


def registry() -> list[Stage]:
    """Every stage module in this package, sorted by ``order`` (each module defines STAGE or STAGES)."""
    global _REGISTRY
    if _REGISTRY is None:
        found: list[Stage] = collect(__name__, __path__, "STAGE", "STAGES", skip=("evidence",))
        names = [s.name for s in found]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise RuntimeError(f"stage names defined twice: {sorted(dup)}")
        _REGISTRY = sorted(found, key=lambda s: s.order)
    return _REGISTRY


def run_stages(ev: Evidence, only: list[str] | None = None) -> dict[str, StageResult]:
    """Every stage in order; a stage without its evidence is skipped and says what to capture."""
    out: dict[str, StageResult] = {}
    for stage in registry():
        if only is not None and stage.name not in only:
            continue
        res = stage.run(ev)
        res.name = stage.name
        for f in res.findings:
            f.stage = stage.name
        if res.verdict == "skipped":
            res.details.setdefault("reason", "no data for this stage")
            res.details["needs"] = stage.needs
            res.details["capture"] = stage.capture
        out[stage.name] = res
    return out

