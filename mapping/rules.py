"""The rule language: a rule relates a group of baseline names to a group of candidate names (one-to-one,
one-to-many such as fused QKV -> wq/wk/wv, or many-to-one read the other way) and names the transform between
them; module (layer) names have their own one-to-one rules. A match is one name's rule, captures and both
sides' full groups; a group pair is one comparable unit."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mapping.templates import Pattern
from mapping.transforms import TransformParams
from mapping.transforms import apply as apply_transform

SIDES = ("baseline", "candidate")


@dataclass
class Rule:
    id: str
    kind: str
    baseline: list[Pattern]
    candidate: list[Pattern]
    transform: dict[str, Any] = field(default_factory=lambda: {"op": "identity"})
    tp_partition_dim: int = -1
    scheme: str | None = None
    gather: str | None = None   # a capture (``expert``) whose names on the baseline side form one group

    def patterns(self, side: str) -> list[Pattern]:
        return self.baseline if side == "baseline" else self.candidate

    def apply(self, arrays: Sequence[np.ndarray], to_side: str, params: TransformParams) -> list[np.ndarray]:
        """Tensors of one side's group -> the other side's (``to_side``)."""
        return apply_transform(self.id, self.transform, arrays, to_side, params)


@dataclass
class ModuleRule:
    baseline: Pattern
    candidate: Pattern
    kind: str


@dataclass
class Match:
    """A name matched by a rule: the rule, the captures, and both sides' full group of names."""

    rule: Rule
    captures: dict[str, str]
    baseline: list[str]
    candidate: list[str]
    experts: list[int] = field(default_factory=list)   # gather rules: expert indices seen on the names

    @property
    def key(self) -> tuple[str, tuple[tuple[str, str], ...]]:
        return self.rule.id, tuple(sorted(self.captures.items()))

    @property
    def layer(self) -> int | None:
        v = self.captures.get("layer")
        return int(v) if v is not None else None


@dataclass
class GroupPair:
    """One comparable unit: a baseline group and the candidate group it corresponds to."""

    match: Match
    baseline_present: list[str]
    candidate_present: list[str]

    @property
    def name(self) -> str:
        """Named by the baseline (the contract: reports use baseline names)."""
        return self.match.baseline[0]

    @property
    def complete(self) -> bool:
        return (len(self.baseline_present) == len(self.match.baseline)
                and len(self.candidate_present) == len(self.match.candidate))

