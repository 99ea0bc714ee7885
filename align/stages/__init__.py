"""The procedure's stages: one file each, found by scanning this package, run in the accuracy guide's order.

Why a registry: `align report` on a user's runs and `align demo` on its own runs must run the very same
stages; a stage is data (name, order, the evidence it needs, what to capture when that is missing) plus one
function from :class:`Evidence` to a :class:`StageResult`. Adding a stage is adding one file here that
defines ``STAGE`` (or ``STAGES``); see docs/extending.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from align.stages.evidence import Evidence, Inputs, Options
from core.findings import StageResult
from core.registry import collect

__all__ = ["Evidence", "Inputs", "Options", "Stage", "registry", "run_stages"]


@dataclass(frozen=True)
class Stage:
    """One stage of the procedure.

    ``order`` places it in the guide's sequence; ``needs`` says in words what evidence it reads; ``capture``
    says what to do to get that evidence when it is missing (shown on a skipped stage); ``run`` computes
    it; ``section`` renders an optional HTML body and ``figure`` an optional (file, title, png)."""

    name: str
    order: int
    title: str
    needs: str
    capture: str
    run: Callable[[Evidence], StageResult]
    section: Callable[[StageResult], str] | None = None
    figure: Callable[[StageResult], tuple[str, str, bytes] | None] | None = None


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

