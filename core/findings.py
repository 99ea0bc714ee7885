"""Findings: the one currency between comparators and reports.

Every comparison yields findings with a verdict, the evidence (metric, value, threshold) and the component
(parameter or layer, baseline names) and stage it points at. Stages roll up to the worst verdict.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

VERDICTS = ("pass", "warn", "fail")
# The CLI contract: 0 pass or warn, 1 fail (2 is bad input, raised as core.errors.BadInput).
EXIT = {"pass": 0, "warn": 0, "fail": 1}
_RANK = {"skipped": -1, "pass": 0, "warn": 1, "fail": 2}


@dataclass
class Finding:
    stage: str
    verdict: str
    component: str | None
    metric: str
    value: float | int | str | None
    threshold: float | int | str | None
    message: str

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, got {self.verdict!r}")

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("value", "threshold"):
            v = d[k]
            if isinstance(v, float) and not math.isfinite(v):
                d[k] = str(v)  # JSON has no NaN/Inf; keep them readable
            elif hasattr(v, "item"):
                d[k] = v.item()
        return d


def severity(verdict: str) -> int:
    """How bad a verdict is (fail highest): sort findings by ``-severity(f.verdict)`` to put failures first."""
    return _RANK[verdict]


def worst(verdicts: list[str]) -> str:
    """The worst verdict; ``skipped`` only when nothing was compared."""
    if not verdicts:
        return "skipped"
    return max(verdicts, key=lambda v: _RANK[v])


@dataclass
class StageResult:
    """One stage of the procedure: its verdict, its stage-specific facts, and its findings."""

    name: str
    verdict: str = "skipped"
    details: dict[str, Any] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)

    def add(self, finding: Finding) -> Finding:
        self.findings.append(finding)
        self.verdict = worst([f.verdict for f in self.findings])
        return finding

    def to_json(self) -> dict[str, Any]:
        out = {"verdict": self.verdict}
        out.update(self.details)
        return out


def skipped(name: str, reason: str) -> StageResult:
    return StageResult(name, "skipped", {"reason": reason})
