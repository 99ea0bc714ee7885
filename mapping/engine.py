"""The mapping: a loaded mapping file's rules, oriented to the runs at hand, pairing names and converting
tensors (docs/alignment.md, "Mapping files").

A mapping file holds rules (:mod:`mapping.rules`) written as name templates (:mod:`mapping.templates`), each
naming a transform (:mod:`mapping.transforms`). Preset names (the shipped files) are resolved one layer up,
by the model families (``models.load_mapping``); this module reads files.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from collections.abc import Mapping as MappingABC
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any

import numpy as np

from core.errors import BadInput
from core.findings import Finding, StageResult
from mapping.rules import SIDES, GroupPair, Match, ModuleRule, Rule, expert_piece, split_piece
from mapping.templates import compile_pattern as _compile
from mapping.templates import has_field as _has_field
from mapping.transforms import OPS, TransformParams
from runstore.schema import load_yaml, validate

_GROUPED_EXPERT = re.compile(r"\.experts\.linear_fc[12]\.weight\d+$")


_NAMES = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1}]}
_NAMES_OR_NONE = {"anyOf": [{"type": "null"}, {"type": "string"}, {"type": "array", "items": {"type": "string"}}]}
_SIDE = {"type": ["object", "null"], "properties": {
    "framework": {"type": ["string", "null"]}, "default_scheme": {"type": ["string", "null"]},
    "strip_prefixes": {"type": ["array", "null"], "items": {"type": "string"}}}}
#: The mapping file's declared shape (docs/alignment.md, "Mapping files"): checked before any rule is built.
MAPPING_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["rules"],
    "properties": {
        "name": {"type": ["string", "number"]}, "description": {"type": ["string", "null"]},
        "baseline": _SIDE, "candidate": _SIDE,
        "activation_layout": {"type": ["object", "null"]},
        "rules": {"type": "array", "items": {
            "type": "object", "required": ["baseline", "candidate"],
            "properties": {
                "id": {"type": ["string", "integer"]}, "kind": {"type": ["string", "null"]},
                "baseline": _NAMES, "candidate": _NAMES,
                "transform": {"type": ["object", "null"], "properties": {
                    "op": {"enum": list(OPS)},
                    "dim": {"type": "integer"}, "parts": {"type": "integer", "minimum": 1},
                    "per_tp_shard": {"type": "boolean"}, "inverse": {"type": "boolean"},
                    "sizes": {"type": "array", "items": {"type": "string"}}}},
                "tp_partition_dim": {"type": "integer", "minimum": -1},
                "scheme": {"type": ["string", "null"]}}}},
        "ignore": {"type": ["object", "null"], "properties": {"baseline": _NAMES_OR_NONE,
                                                              "candidate": _NAMES_OR_NONE}},
        "modules": {"type": ["array", "null"], "items": {
            "type": "object", "required": ["baseline", "candidate"],
            "properties": {"baseline": {"type": "string"}, "candidate": {"type": "string"},
                           "kind": {"type": ["string", "null"]}}}},
    },
}


class Mapping:
    """A loaded mapping (a YAML file, or its parsed dict)."""

    def __init__(self, spec: MappingABC[str, Any], source: str = "<dict>") -> None:
        self.source = source
        if not isinstance(spec, MappingABC) or "rules" not in spec:
            raise BadInput(f"{source}: a mapping needs a top-level 'rules' list")
        validate(dict(spec), MAPPING_SCHEMA, source)
        self.name = str(spec.get("name", Path(source).stem))
        self.description = str(spec.get("description", ""))
        self.sides = {s: dict(spec.get(s) or {}) for s in SIDES}
        self.activation_layout = dict(spec.get("activation_layout") or {})
        self.rules: list[Rule] = []
        for i, r in enumerate(spec["rules"]):
            try:
                rule = Rule(id=str(r.get("id", f"rule{i}")), kind=str(r.get("kind") or "other"),
                            baseline=[_compile(t, source, f"rules[{i}].baseline") for t in _as_list(r["baseline"])],
                            candidate=[_compile(t, source, f"rules[{i}].candidate")
                                       for t in _as_list(r["candidate"])],
                            transform=dict(r.get("transform") or {"op": "identity"}),
                            tp_partition_dim=int(r.get("tp_partition_dim", -1)),
                            scheme=r.get("scheme"), gather=r.get("gather"))
            except (KeyError, TypeError, AttributeError, re.error) as exc:
                raise BadInput(f"{source}: rule #{i} is malformed ({exc!r})") from None
            op = rule.transform.get("op", "identity")
            if (op == "transpose" and (len(rule.baseline) != 1 or len(rule.candidate) != 1)) or (
                    op == "identity" and len(rule.baseline) != len(rule.candidate)):
                raise BadInput(f"{source}: rule {rule.id}: {op} needs the same number of names a side "
                               "(transpose: one)")
            self.rules.append(rule)
        ign = spec.get("ignore") or {}
        self.ignore = {s: [_compile(t, source, f"ignore.{s}") for t in _as_list(ign.get(s) or [])]
                       for s in SIDES}
        self.spec = spec
        self.modules = [ModuleRule(_compile(m["baseline"], source, f"modules[{i}].baseline"),
                                   _compile(m["candidate"], source, f"modules[{i}].candidate"),
                                   str(m.get("kind") or "other")) for i, m in enumerate(spec.get("modules") or [])]

    # -- loading -------------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path) -> Mapping:
        """A YAML mapping file (a preset by name: ``models.load_mapping``)."""
        path = Path(path)
        if not path.is_file():
            raise BadInput(f"{path}: no such mapping file")
        spec = load_yaml(path, what="mapping file")
        if not isinstance(spec, MappingABC):
            raise BadInput(f"{path}: top level: expected a mapping with a 'rules' list, got {type(spec).__name__}")
        return cls(spec, str(path))

    # -- orientation -------------------------------------------------------------------------------
    def mirrored(self, side: str) -> Mapping:
        """A mapping from ``side``'s names to themselves: compares two runs that use the same scheme
        (Megatron TP=1 vs TP=2, MindFormers vs MindFormers) with the same grouping and kinds."""
        spec = dict(self.spec)
        spec["name"] = f"{self.name} ({side} vs {side})"
        spec["baseline"] = spec["candidate"] = dict(self.sides[side])
        spec["rules"] = [{"id": r.id, "kind": r.kind, "scheme": r.scheme if side == "baseline" else None,
                          "baseline": [p.text for p in r.patterns(side)],
                          "candidate": [p.text for p in r.patterns(side)],
                          "tp_partition_dim": r.tp_partition_dim} for r in self.rules
                         if side == "baseline"
                         or r.scheme in (None, self.sides["baseline"].get("default_scheme"))]
        ign = [p.text for p in self.ignore[side]]
        spec["ignore"] = {"baseline": ign, "candidate": ign}
        spec["modules"] = [{"baseline": (x.baseline if side == "baseline" else x.candidate).text,
                            "candidate": (x.baseline if side == "baseline" else x.candidate).text,
                            "kind": x.kind}
                           for x in self.modules]
        lay = self.activation_layout.get(side)
        spec["activation_layout"] = {"baseline": lay, "candidate": lay} if lay else {}
        return Mapping(spec, self.source)

    def swapped(self) -> Mapping:
        """The same mapping with baseline and candidate exchanged (a MindFormers baseline, say)."""
        spec = dict(self.spec)
        spec["name"] = f"{self.name} (swapped)"
        spec["baseline"], spec["candidate"] = dict(self.sides["candidate"]), dict(self.sides["baseline"])
        spec["baseline"]["default_scheme"] = None
        rules = []
        for r in self.rules:
            if r.scheme not in (None, self.sides["baseline"].get("default_scheme")):
                continue
            t = dict(r.transform)
            if t.get("op", "identity") not in ("identity", "transpose"):
                t["inverse"] = True
            rules.append({"id": r.id, "kind": r.kind, "baseline": [p.text for p in r.candidate],
                          "candidate": [p.text for p in r.baseline], "transform": t,
                          "tp_partition_dim": -1, "gather": r.gather})
        spec["rules"] = rules
        spec["ignore"] = {"baseline": [p.text for p in self.ignore["candidate"]],
                          "candidate": [p.text for p in self.ignore["baseline"]]}
        spec["modules"] = [{"baseline": x.candidate.text, "candidate": x.baseline.text, "kind": x.kind}
                           for x in self.modules]
        lay = self.activation_layout
        spec["activation_layout"] = {"baseline": lay.get("candidate"), "candidate": lay.get("baseline")}
        return Mapping(spec, self.source)

    def oriented(self, baseline_names: Iterable[str], candidate_names: Iterable[str]) -> Mapping:
        """Pick self, swapped or mirrored from which side's patterns the names actually match."""
        def score(names: Iterable[str], side: str) -> int:
            return sum(self.match(n, side) is not None for n in names)
        b, c = list(baseline_names), list(candidate_names)
        bb, bc = score(b, "baseline"), score(b, "candidate")
        cb, cc = score(c, "baseline"), score(c, "candidate")
        if bb >= bc and cc >= cb:
            return self
        if bb >= bc:
            return self.mirrored("baseline")
        if cc >= cb:
            return self.mirrored("candidate")
        return self.swapped()

    # -- names ---------------------------------------------------------------------------------------
    def strip(self, name: str, side: str) -> str:
        """Remove wrapper prefixes (DDP's ``module.``) repeatedly."""
        prefixes = self.sides[side].get("strip_prefixes") or []
        changed = True
        while changed:
            changed = False
            for p in prefixes:
                if p and name.startswith(p):
                    name, changed = name[len(p):], True
        return name

    def ignored(self, name: str, side: str) -> bool:
        n = self.strip(name, side)
        return any(p.match(n) is not None for p in self.ignore[side])

    def match(self, name: str, side: str, scheme: str | None = None,
              split: set[tuple[str, tuple[tuple[str, str], ...]]] | None = None,
              present: AbstractSet[str] | None = None) -> Match | None:
        """The rule that covers ``name`` on ``side`` and the full groups on both sides.

        ``NAME[e]`` (expert e's piece of a stacked tensor, ``mapping.rules.EXPERT_PIECE``) matches the gather
        rule of NAME as expert e alone, paired with the other side's expert e. ``split`` holds the keys
        (rule id, captures) of gather groups whose stacked side came in pieces: the other side's experts of
        such a group match one by one too (``pair`` fills it).

        ``present``: the other side's (stripped) names at hand. Where several rules cover ``name`` (one
        MindFormers ``pre_mlp_layernorm.weight`` is Megatron's ``pre_mlp_layernorm.weight``, or the
        ``mlp.linear_fc1.layer_norm_weight`` that Megatron's local spec saves for a MoE layer), the first rule
        whose other-side names are all present wins, then (candidate names) such a rule of another scheme (a
        checkpoint that mixes local and fused norm names); without one, the first rule of the scheme."""
        first = None
        for m in self._matches(name, side, scheme, split):
            if present is None or m.rule.gather or self._present(m, side, present):
                return m
            first = first or m
        if present is not None and side == "candidate":
            for m in self._matches(name, side, scheme, split, any_scheme=True):
                if not m.rule.gather and self._present(m, side, present):
                    return m
        return first

    @staticmethod
    def _present(m: Match, side: str, present: AbstractSet[str]) -> bool:
        theirs = m.candidate if side == "baseline" else m.baseline
        return bool(theirs) and all(t in present for t in theirs)

    def _matches(self, name: str, side: str, scheme: str | None,
                 split: set[tuple[str, tuple[tuple[str, str], ...]]] | None, any_scheme: bool = False
                 ) -> Iterator[Match]:
        """Every rule's match of ``name`` (at most one per rule), in the file's order (see ``match``)."""
        full = self.strip(name, side)
        n, piece = split_piece(full)
        other = "candidate" if side == "baseline" else "baseline"
        schemes = str(scheme or self.sides["baseline"].get("default_scheme")).split("+")
        for rule in self.rules:
            if side == "candidate" and rule.scheme is not None and rule.scheme not in schemes and not any_scheme:
                continue
            found = self._rule_match(rule, n, full, piece, side, other, split)
            if found is not None:
                yield found

    def _rule_match(self, rule: Rule, n: str, full: str, piece: int | None, side: str, other: str,
                    split: set[tuple[str, tuple[tuple[str, str], ...]]] | None) -> Match | None:
        """``rule``'s match of the stripped name ``n`` (``full`` with its expert piece, if any), or None."""
        g = rule.gather
        for pat in rule.patterns(side):
            caps = pat.match(n)
            if caps is None:
                continue
            if piece is not None:
                if g and not _has_field(rule.patterns(side), g) and _has_field(rule.patterns(other), g):
                    return self._per_expert(rule, caps, piece)
                if not g and len(rule.baseline) == len(rule.candidate) == 1:   # mirrored: piece to piece
                    theirs = [expert_piece(p.format(caps), piece) for p in rule.patterns(other)]
                    b, c = ([full], theirs) if side == "baseline" else (theirs, [full])
                    return Match(rule, {**caps, "[expert]": str(piece)}, b, c, [piece])
                continue
            if g:
                # one group per stacked tensor: the gathered capture is not part of the key; pair()
                # fills the expanded side with every expert (seen, or num_experts)
                experts = [int(caps.pop(g))] if g in caps else []
                if experts and split and (rule.id, tuple(sorted(caps.items()))) in split:
                    return self._per_expert(rule, caps, experts[0])
                if experts:
                    mine = [p.format({**caps, g: experts[0]}) for p in rule.patterns(side)]
                    theirs = [] if _has_field(rule.patterns(other), g) else [
                        p.format(caps) for p in rule.patterns(other)]
                else:
                    mine = [n if p is pat else p.format(caps) for p in rule.patterns(side)]
                    theirs = []
                b, c = (mine, theirs) if side == "baseline" else (theirs, mine)
                return Match(rule, caps, b, c, experts)
            mine = [n if p is pat else p.format(caps) for p in rule.patterns(side)]
            theirs = [p.format(caps) for p in rule.patterns(other)]
            b, c = (mine, theirs) if side == "baseline" else (theirs, mine)
            return Match(rule, caps, b, c)
        return None

    @staticmethod
    def _per_expert(rule: Rule, caps: dict[str, str], expert: int) -> Match:
        """One expert of a gather rule on both sides: its own names where the rule names experts, its piece
        ``NAME[e]`` of the stacked tensor where the rule names the stack."""
        g = str(rule.gather)
        sides = {s: [p.format({**caps, g: expert}) for p in rule.patterns(s)] if _has_field(rule.patterns(s), g)
                 else [expert_piece(p.format(caps), expert) for p in rule.patterns(s)] for s in SIDES}
        return Match(rule, {**caps, g: str(expert)}, sides["baseline"], sides["candidate"], [expert])

    def _expand(self, m: Match, num_experts: int | None) -> None:
        """Give a gather match its full expanded group: every expert, in order, each rule pattern (a match of
        one expert, ``_per_expert``, is complete already)."""
        g = m.rule.gather
        if not g or g in m.captures:
            return
        experts = list(range(int(num_experts))) if num_experts else sorted(set(m.experts))
        m.experts = experts
        for side in SIDES:
            pats = m.rule.patterns(side)
            if _has_field(pats, g):
                names = [p.format({**m.captures, g: e}) for e in experts for p in pats]
            else:
                names = [p.format(m.captures) for p in pats]
            if side == "baseline":
                m.baseline = names
            else:
                m.candidate = names

    def map_name(self, name: str, side: str = "baseline") -> list[str]:
        """The other side's names for ``name`` (several for a fused parameter); [] when unmapped."""
        m = self.match(name, side)
        if m is None:
            return []
        return m.candidate if side == "baseline" else m.baseline

    def map_module(self, name: str, side: str = "baseline") -> str | None:
        """The other side's module name, or None when no module rule covers it."""
        n = self.strip(name, side)
        for mr in self.modules:
            mine, theirs = (mr.baseline, mr.candidate) if side == "baseline" else (mr.candidate, mr.baseline)
            caps = mine.match(n)
            if caps is not None:
                return theirs.format(caps)
        return None

    def module_kind(self, name: str, side: str = "baseline") -> str:
        n = self.strip(name, side)
        for mr in self.modules:
            if (mr.baseline if side == "baseline" else mr.candidate).match(n) is not None:
                return mr.kind
        return "other"

    def detect_scheme(self, baseline_names: Iterable[str]) -> str:
        """``te`` when the baseline names carry TransformerEngine's fused norm names, else ``local``; plus
        ``+grouped`` when routed experts are TE grouped GEMM weights (``experts.linear_fc1.weight{e}``).
        A rule with a ``scheme`` applies to candidate names when its scheme is one of these parts."""
        names = list(baseline_names)
        base = "te" if any(n.endswith(".layer_norm_weight") for n in names) else str(
            self.sides["baseline"].get("default_scheme") or "local")
        grouped = any(_GROUPED_EXPERT.search(n) for n in names)
        return base + ("+grouped" if grouped else "")

    def pair(self, baseline_names: Iterable[str], candidate_names: Iterable[str], scheme: str | None = None,
             num_experts: int | None = None) -> tuple[list[GroupPair], dict[str, list[str]], dict[str, list[str]]]:
        """Group both sides' names into comparable units.

        Returns (pairs, unmapped, ignored): ``unmapped[side]`` lists names no rule covers; a pair whose group
        is incomplete on either side is returned too (``complete`` is False) so callers can report it.
        Gather rules (routed experts) group every expert of a layer with its stacked tensor; the experts are
        those whose names appear, or ``num_experts`` when given. Where one side holds the stacked tensor in
        per-expert pieces (``NAME[e]``), that layer's experts pair one by one instead.
        """
        bnames, cnames = list(baseline_names), list(candidate_names)
        scheme = scheme or self.detect_scheme(bnames)
        # the original (unstripped) spelling of each name, so callers can look values up
        orig = {s: {} for s in SIDES}
        unmapped: dict[str, list[str]] = {s: [] for s in SIDES}
        ignored: dict[str, list[str]] = {s: [] for s in SIDES}
        groups: dict[Any, Match] = {}
        split = set()   # gather groups whose stacked tensor came in per-expert pieces: pair expert by expert
        for side, names in (("baseline", bnames), ("candidate", cnames)):
            for n in names:
                if split_piece(self.strip(n, side))[1] is None:
                    continue
                m = self.match(n, side, scheme)
                if m is not None and m.rule.gather:
                    split.add((m.rule.id, tuple(sorted((k, v) for k, v in m.captures.items()
                                                       if k != m.rule.gather))))
        # where two rules cover a name, the one whose counterpart the other side holds (match's ``present``)
        present = {"baseline": {self.strip(n, "candidate") for n in cnames} or None,
                   "candidate": {self.strip(n, "baseline") for n in bnames} or None}
        for side, names in (("baseline", bnames), ("candidate", cnames)):
            for n in names:
                m = self.match(n, side, scheme, split, present[side])
                if m is None:
                    (ignored if self.ignored(n, side) else unmapped)[side].append(n)
                    continue
                if (m.rule.gather and not m.experts and split_piece(self.strip(n, side))[1] is None
                        and (m.rule.id, tuple(sorted(m.captures.items()))) in split):
                    # the stacked tensor whole beside its own per-expert pieces (a store holding both, e.g. a
                    # NaN traced to the whole tensor): its pieces pair expert by expert; the whole is covered
                    ignored[side].append(n)
                    continue
                orig[side][self.strip(n, side)] = n
                have = groups.setdefault(m.key, m)
                if have is not m:
                    have.experts.extend(e for e in m.experts if e not in have.experts)
        pairs = []
        for m in groups.values():
            self._expand(m, num_experts)
            bp = [orig["baseline"][n] for n in m.baseline if n in orig["baseline"]]
            cp = [orig["candidate"][n] for n in m.candidate if n in orig["candidate"]]
            pairs.append(GroupPair(m, bp, cp))
        return pairs, unmapped, ignored

    def convert(self, arrays: MappingABC[str, np.ndarray], to_side: str = "candidate",
                params: TransformParams | None = None, scheme: str | None = None
                ) -> tuple[dict[str, np.ndarray], StageResult]:
        """Convert a whole name->array dict to the other side's names and layouts.

        Returns the converted dict and a ``mapping`` StageResult listing every unmapped or incomplete name
        (nothing is dropped silently).
        """
        params = params or TransformParams()
        from_side = "baseline" if to_side == "candidate" else "candidate"
        names = list(arrays)
        b, c = (names, []) if from_side == "baseline" else ([], names)
        pairs, unmapped, ignored = self.pair(b, c, scheme, num_experts=params.num_experts)
        out: dict[str, np.ndarray] = {}
        result = StageResult("mapping")
        for gp in pairs:
            src = gp.baseline_present if from_side == "baseline" else gp.candidate_present
            want = gp.match.baseline if from_side == "baseline" else gp.match.candidate
            if len(src) != len(want):
                missing = [n for n in want if not any(self.strip(s, from_side) == n for s in src)]
                result.add(Finding("mapping", "fail", gp.name, "incomplete_group", len(src), len(want),
                                   f"{from_side} group of rule {gp.match.rule.id} lacks "
                                   f"{', '.join(missing)}"))
                continue
            # order the present names as the rule lists them
            by_stripped = {self.strip(s, from_side): s for s in src}
            tensors = [np.asarray(arrays[by_stripped[n]]) for n in want]
            targets = gp.match.candidate if to_side == "candidate" else gp.match.baseline
            try:
                converted = gp.match.rule.apply(tensors, to_side, params)
            except (BadInput, ValueError, IndexError, ZeroDivisionError) as exc:   # a shape the rule cannot take
                shapes = ", ".join(f"{n} {list(t.shape)}" for n, t in zip(want, tensors, strict=True))
                raise BadInput(f"rule {gp.match.rule.id}: {shapes} does not fit its transform ({exc})") from None
            for tname, t in zip(targets, converted, strict=True):
                out[tname] = t
        for n in unmapped[from_side]:
            result.add(Finding("mapping", "fail", n, "unmapped", None, None,
                               f"{from_side} name {n} matches no rule of {self.name}"))
        for n in ignored[from_side]:
            result.add(Finding("mapping", "pass", n, "ignored", None, None,
                               f"{from_side} name {n} is listed as ignored by {self.name} (not a weight)"))
        if not result.findings:
            result.verdict = "pass"
        result.details = {"converted": len(out), "unmapped": len(unmapped[from_side]),
                          "ignored": len(ignored[from_side])}
        return out, result

    def check(self, baseline_names: Iterable[str], candidate_names: Iterable[str],
              stage: str = "mapping") -> StageResult:
        """Every name on either side must be covered, and every group complete on both sides."""
        pairs, unmapped, ignored = self.pair(baseline_names, candidate_names)
        result = StageResult(stage)
        for side in SIDES:
            for n in unmapped[side]:
                result.add(Finding(stage, "fail", n, "unmapped", None, None,
                                   f"{side} name {n} matches no rule of {self.name}"))
        for gp in pairs:
            if gp.complete:
                continue
            for side, want, have in (("baseline", gp.match.baseline, gp.baseline_present),
                                     ("candidate", gp.match.candidate, gp.candidate_present)):
                have_s = {self.strip(h, side) for h in have}
                for n in want:
                    if n not in have_s:
                        result.add(Finding(stage, "fail", gp.name, "missing_counterpart", n, None,
                                           f"{gp.name}: {side} has no {n} (rule {gp.match.rule.id})"))
        result.details = {"mapping": self.name, "pairs": sum(gp.complete for gp in pairs),
                          "unmapped_baseline": unmapped["baseline"],
                          "unmapped_candidate": unmapped["candidate"],
                          "ignored_baseline": ignored["baseline"], "ignored_candidate": ignored["candidate"]}
        if not result.findings:
            result.verdict = "pass"
        return result

    # -- display -------------------------------------------------------------------------------------
    def describe(self) -> str:
        lines = [f"mapping {self.name}: {self.description}", f"  file: {self.source}",
                 f"  baseline: {self.sides['baseline'].get('framework', '?')}, strip prefixes "
                 f"{self.sides['baseline'].get('strip_prefixes') or []}",
                 f"  candidate: {self.sides['candidate'].get('framework', '?')}", "  parameters:"]
        for r in self.rules:
            op = r.transform.get("op", "identity")
            extra = f" [{r.scheme} spec]" if r.scheme else ""
            tp = f" tp_dim={r.tp_partition_dim}" if r.tp_partition_dim >= 0 else ""
            lines.append(f"    {r.id:<22} {r.kind:<9} {', '.join(p.text for p in r.baseline)}"
                         f"  ->  {', '.join(p.text for p in r.candidate)}  ({op}{tp}){extra}")
        if self.modules:
            lines.append("  modules:")
            for mr in self.modules:
                lines.append(f"    {mr.baseline.text}  <->  {mr.candidate.text}")
        return "\n".join(lines)



def _as_list(v: Any) -> list[str]:
    return [v] if isinstance(v, str) else list(v)
