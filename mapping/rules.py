"""The rule language: a rule relates a group of baseline names to a group of candidate names (one-to-one,
one-to-many such as fused QKV -> wq/wk/wv, or many-to-one read the other way) and names the transform between
them; module (layer) names have their own one-to-one rules. A match is one name's rule, captures and both
sides' full groups; a group pair is one comparable unit."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mapping.templates import Pattern
from mapping.transforms import TransformParams
from mapping.transforms import apply as apply_transform

SIDES = ("baseline", "candidate")

#: A piece of a stacked expert tensor in a run store: ``NAME[e]`` is expert ``e`` (its global index) of the
#: tensor NAME, the rows that the rule's ``stack_experts`` transform gives that expert
#: (``mlp.experts.weight1[3]``: rows [3*H, 4*H) of MindFormers' [E*H, 2F] ``weight1``). Dumpers that see a
#: stacked parameter's gradient record its norm per expert under these names (docs/mindformers-mcore.md).
EXPERT_PIECE = re.compile(r"^(?P<name>.+)\[(?P<expert>\d+)\]$")


def expert_piece(name: str, expert: int) -> str:
    """The run-store name of expert ``expert``'s rows of the stacked tensor ``name``."""
    return f"{name}[{int(expert)}]"


def split_piece(name: str) -> tuple[str, int | None]:
    """``NAME[e]`` -> (NAME, e); any other name -> (name, None)."""
    m = EXPERT_PIECE.match(name)
    return (m.group("name"), int(m.group("expert"))) if m else (name, None)


def expert_span(experts: Sequence[int]) -> str:
    """``[0, 1, 2, 3]`` -> ``0-3``; ``[0, 2]`` -> ``0, 2`` (how a group of experts is named)."""
    es = sorted(set(int(e) for e in experts))
    if len(es) > 2 and es == list(range(es[0], es[-1] + 1)):
        return f"{es[0]}-{es[-1]}"
    return ", ".join(str(e) for e in es)


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
    def label(self) -> str:
        """The baseline name, or for a gather group of several experts (a stacked tensor compared whole)
        the group's own name: ``decoder.layers.1.mlp.experts.local_experts.*.linear_fc1.weight (experts 0-3)``,
        never one expert's name for all of them."""
        m, g = self.match, self.match.rule.gather
        if not g or len(set(m.experts)) <= 1:
            return self.name
        pats = m.rule.baseline
        if any(g in p.fields for p in pats):
            text = pats[0].format({**m.captures, g: "*"})
        else:
            text = m.baseline[0]
        return f"{text} (experts {expert_span(m.experts)})"

    @property
    def complete(self) -> bool:
        return (len(self.baseline_present) == len(self.match.baseline)
                and len(self.candidate_present) == len(self.match.candidate))

