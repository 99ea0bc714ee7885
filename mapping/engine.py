"""Name mapping engine: which baseline tensor is which candidate tensor, as data (YAML), not code.

A mapping file holds rules. A rule relates a *group* of baseline names to a group of candidate names
(one-to-one, one-to-many such as fused QKV -> wq/wk/wv, or many-to-one read the other way) and names the
transform that turns one group's tensors into the other's. Every transform only moves elements, so the L2
norm of a group is the same on both sides; that is what lets local norms of fused parameters compare as
sqrt(sum of squares) of their parts. Module (layer) names have their own one-to-one rules.

Why a template syntax (``decoder.layers.{layer}.mlp``) over raw regexes: presets stay readable and the
same template serves both directions (match one side, format the other). Raw regexes are still allowed
(``re:...``) for names that need them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from collections.abc import Mapping as MappingABC
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from core.errors import BadInput
from core.findings import Finding, StageResult
from runstore.schema import load_yaml, validate

PRESET_DIR = Path(__file__).resolve().parent / "presets"
DEFAULT_PRESET = "megatron_core_llama__mindformers_llama"
SIDES = ("baseline", "candidate")
_TEMPLATE_FIELD = re.compile(r"\{(\w+)(?::([^{}]+))?\}")
_DIGIT_CAPTURES = {"layer", "expert", "i", "n", "mtp"}
_GROUPED_EXPERT = re.compile(r"\.experts\.linear_fc[12]\.weight\d+$")


# ------------------------------------------------------------------------------------------------------
# Patterns
# ------------------------------------------------------------------------------------------------------

@dataclass
class Pattern:
    """One name template (or raw regex) that matches a full name and can be formatted back."""

    text: str
    regex: re.Pattern[str]
    fields: tuple[str, ...]

    @classmethod
    def compile(cls, text: str) -> Pattern:
        if text.startswith("re:"):
            rx = re.compile(text[3:])
            return cls(text, rx, tuple(rx.groupindex))
        parts, pos, fields = [], 0, []
        for m in _TEMPLATE_FIELD.finditer(text):
            parts.append(re.escape(text[pos:m.start()]))
            name, sub = m.group(1), m.group(2)
            if name in fields:
                parts.append(f"(?P={name})")
            else:
                fields.append(name)
                sub = sub or (r"\d+" if name in _DIGIT_CAPTURES else r"[^.]+")
                parts.append(f"(?P<{name}>{sub})")
            pos = m.end()
        parts.append(re.escape(text[pos:]))
        return cls(text, re.compile("".join(parts)), tuple(fields))

    def match(self, name: str) -> dict[str, str] | None:
        m = self.regex.fullmatch(name)
        return m.groupdict() if m else None

    def format(self, captures: MappingABC[str, str]) -> str:
        if self.text.startswith("re:"):
            raise BadInput(f"raw regex pattern {self.text!r} cannot be formatted; write it as a template")
        try:
            return _TEMPLATE_FIELD.sub(lambda m: str(captures[m.group(1)]), self.text)
        except KeyError as exc:
            raise BadInput(f"pattern {self.text!r} needs capture {exc.args[0]!r}") from None


# ------------------------------------------------------------------------------------------------------
# Transforms (numpy; they only slice, reshape and concatenate, so they are bit-exact for any dtype)
# ------------------------------------------------------------------------------------------------------

@dataclass
class TransformParams:
    """Model facts some transforms need. Unknown values are inferred from shapes where possible."""

    num_heads: int | None = None            # np
    num_query_groups: int | None = None     # ng (== np for MHA)
    head_dim: int | None = None             # hn (kv_channels)
    tp: int = 1                             # TP shards concatenated in the array (chunk per_tp_shard)
    num_experts: int | None = None          # routed experts a stacked tensor holds (gather rules)
    sizes: dict[str, int] = field(default_factory=dict)   # named sizes a `concat` transform splits by

    @classmethod
    def from_mapping(cls, values: MappingABC[str, Any] | None) -> TransformParams:
        v = dict(values or {})
        return cls(num_heads=v.get("num_heads"), num_query_groups=v.get("num_query_groups"),
                   head_dim=v.get("head_dim"), tp=int(v.get("tp") or 1), num_experts=v.get("num_experts"),
                   sizes={k: int(x) for k, x in dict(v.get("sizes") or {}).items()})


def _qkv_dims(rows: int, p: TransformParams) -> tuple[int, int, int]:
    nh, ng, hn = p.num_heads, p.num_query_groups or p.num_heads, p.head_dim
    if nh is None:
        raise BadInput("splitting fused QKV needs num_heads (and num_query_groups for GQA)")
    if hn is None:
        if rows % (nh + 2 * ng):
            raise BadInput(f"fused QKV has {rows} rows, not a multiple of heads + 2*groups = {nh + 2 * ng}")
        hn = rows // (nh + 2 * ng)
    if nh % ng or rows != (nh + 2 * ng) * hn:
        raise BadInput(f"fused QKV has {rows} rows; expected (heads {nh} + 2 * groups {ng}) * head_dim {hn}")
    return nh, ng, hn


def split_qkv(arr: np.ndarray, p: TransformParams) -> list[np.ndarray]:
    """Megatron's fused QKV -> q, k, v. Layout: view(ng, (np/ng + 2) * hn, ...), each group
    [np/ng*hn | hn | hn]. A concatenation of TP shards has the same layout (groups stay whole per shard)."""
    nh, ng, hn = _qkv_dims(arr.shape[0], p)
    per = nh // ng
    rest = arr.shape[1:]
    g = arr.reshape(ng, (per + 2) * hn, *rest)
    q = g[:, : per * hn].reshape(nh * hn, *rest)
    k = g[:, per * hn: (per + 1) * hn].reshape(ng * hn, *rest)
    v = g[:, (per + 1) * hn:].reshape(ng * hn, *rest)
    return [np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v)]


def merge_qkv(parts: Sequence[np.ndarray], p: TransformParams) -> np.ndarray:
    """Inverse of split_qkv."""
    q, k, v = parts
    ng = k.shape[0] // (p.head_dim or _infer_head_dim(q, k, p))
    hn = k.shape[0] // ng
    rest = q.shape[1:]
    per = q.shape[0] // (ng * hn)
    g = np.concatenate([q.reshape(ng, per * hn, *rest), k.reshape(ng, hn, *rest),
                        v.reshape(ng, hn, *rest)], axis=1)
    return g.reshape(-1, *rest)


def _infer_head_dim(q: np.ndarray, k: np.ndarray, p: TransformParams) -> int:
    if p.num_heads:
        return q.shape[0] // p.num_heads
    if p.num_query_groups:
        return k.shape[0] // p.num_query_groups
    raise BadInput("merging q, k, v into fused QKV needs num_heads or head_dim")


def chunk(arr: np.ndarray, parts: int, dim: int, tp: int) -> list[np.ndarray]:
    """Split ``arr`` into ``parts`` on ``dim``; with ``tp`` > 1 the array is a concatenation of TP shards,
    each shard holding its own [part0; part1; ...] (Megatron's gated fc1: [gate; up] per shard)."""
    shards = np.split(arr, tp, axis=dim) if tp > 1 else [arr]
    pieces = [np.split(s, parts, axis=dim) for s in shards]
    return [np.ascontiguousarray(np.concatenate([pc[i] for pc in pieces], axis=dim)) for i in range(parts)]


def unchunk(arrs: Sequence[np.ndarray], dim: int, tp: int) -> np.ndarray:
    """Inverse of chunk."""
    per_part = [np.split(a, tp, axis=dim) if tp > 1 else [a] for a in arrs]
    return np.concatenate([per_part[i][s] for s in range(tp) for i in range(len(arrs))], axis=dim)


def interleave_halves(arr: np.ndarray, tp: int) -> np.ndarray:
    """Megatron's gated fc1 ([gate; up] stacked per TP shard) -> MindFormers' row-interleaved layout
    (``use_interleaved_weight_layout_mlp``): rows gate_0, up_0, gate_1, up_1, ..."""
    gate, up = chunk(arr, 2, 0, tp)
    return np.ascontiguousarray(np.stack([gate, up], axis=1).reshape(-1, *arr.shape[1:]))


def deinterleave_halves(arr: np.ndarray, tp: int) -> np.ndarray:
    """Inverse of interleave_halves."""
    if arr.shape[0] % 2:
        raise BadInput(f"interleaved gate/up tensor has an odd number of rows ({arr.shape[0]})")
    pairs = arr.reshape(arr.shape[0] // 2, 2, *arr.shape[1:])
    return unchunk([pairs[:, 0], pairs[:, 1]], 0, tp)


def stack_experts(arrs: Sequence[np.ndarray]) -> np.ndarray:
    """Per-expert Megatron weights [out, in] -> MindFormers' stacked, transposed [E * in, out]
    (``experts.weight1`` [E*H, 2F] from fc1 [2F, H]; ``weight2`` [E*F, H] from fc2 [H, F])."""
    return np.ascontiguousarray(np.concatenate([np.swapaxes(a, 0, 1) for a in arrs], axis=0))


def unstack_experts(arr: np.ndarray, num_experts: int) -> list[np.ndarray]:
    """Inverse of stack_experts."""
    if arr.shape[0] % num_experts:
        raise BadInput(f"stacked expert tensor has {arr.shape[0]} rows, not a multiple of {num_experts} experts")
    return [np.ascontiguousarray(np.swapaxes(a, 0, 1)) for a in np.split(arr, num_experts, axis=0)]


# ------------------------------------------------------------------------------------------------------
# Rules and the mapping
# ------------------------------------------------------------------------------------------------------

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
        op = self.transform.get("op", "identity")
        forward = (to_side == "candidate") != bool(self.transform.get("inverse"))
        if op == "identity":
            return list(arrays)
        if op == "transpose":
            return [np.ascontiguousarray(np.swapaxes(arrays[0], 0, 1))]
        if op == "split_qkv":
            return split_qkv(arrays[0], params) if forward else [merge_qkv(arrays, params)]
        if op == "chunk":
            tp = params.tp if self.transform.get("per_tp_shard") else 1
            dim = int(self.transform.get("dim", 0))
            if forward:
                return chunk(arrays[0], int(self.transform.get("parts", 2)), dim, tp)
            return [unchunk(arrays, dim, tp)]
        if op == "interleave":
            tp = params.tp if self.transform.get("per_tp_shard") else 1
            return [interleave_halves(arrays[0], tp)] if forward else [deinterleave_halves(arrays[0], tp)]
        if op == "qkv_contiguous":
            if forward:
                return [np.ascontiguousarray(np.concatenate(split_qkv(arrays[0], params), axis=0))]
            nh, ng, hn = _qkv_dims(arrays[0].shape[0], params)
            q, k, v = np.split(arrays[0], [nh * hn, (nh + ng) * hn], axis=0)
            return [merge_qkv([q, k, v], params)]
        if op == "concat":
            dim = int(self.transform.get("dim", 0))
            if forward:
                return [np.ascontiguousarray(np.concatenate(arrays, axis=dim))]
            return [np.ascontiguousarray(a) for a in np.split(arrays[0], self._concat_cuts(arrays[0], params),
                                                               axis=dim)]
        if op == "stack_experts":
            if forward:
                return [stack_experts(arrays)]
            if not params.num_experts:
                raise BadInput(f"rule {self.id}: unstacking experts needs the number of experts (--num-experts)")
            return unstack_experts(arrays[0], int(params.num_experts))
        raise BadInput(f"rule {self.id}: unknown transform {op!r}")


    def _concat_cuts(self, arr: np.ndarray, params: TransformParams) -> list[int]:
        """Where a `concat` splits back: its named sizes from ``params.sizes``; one unknown size (at most) is
        what remains of the array (e.g. MLA's fused linear_qkv needs only q_down = q_lora_rank)."""
        dim = int(self.transform.get("dim", 0))
        names = list(self.transform.get("sizes") or [])
        missing = [n for n in names if n not in params.sizes]
        if not names or len(missing) > 1:
            raise BadInput(f"rule {self.id}: splitting needs sizes {', '.join(missing or ['(none listed)'])}")
        known = sum(int(params.sizes[n]) for n in names if n not in missing)
        total = int(arr.shape[dim])
        sizes = [int(params.sizes[n]) if n not in missing else total - known for n in names]
        if any(x <= 0 for x in sizes) or sum(sizes) != total:
            raise BadInput(f"rule {self.id}: sizes {dict(zip(names, sizes, strict=True))} do not split "
                           f"{total} rows on dim {dim}")
        return [int(c) for c in np.cumsum(sizes)[:-1]]


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
                    "op": {"enum": ["identity", "transpose", "split_qkv", "chunk", "interleave", "qkv_contiguous",
                                   "concat", "stack_experts"]},
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


def _compile(text: str, source: str, where: str) -> Pattern:
    try:
        return Pattern.compile(text)
    except (re.error, RecursionError, OverflowError) as exc:
        raise BadInput(f"{source}: {where}: pattern {text[:60]!r} is not a valid template or regex "
                       f"({exc.__class__.__name__})") from None


class Mapping:
    """A loaded mapping (preset name or YAML file)."""

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
    def load(cls, preset_or_path: str | Path | None = None) -> Mapping:
        """A preset name (see ``presets()``) or a path to a YAML mapping file."""
        ref = str(preset_or_path or DEFAULT_PRESET)
        path = Path(ref)
        if not path.is_file():
            cand = PRESET_DIR / f"{ref}.yaml"
            if not cand.is_file():
                raise BadInput(f"{ref}: neither a mapping file nor a preset "
                               f"(presets: {', '.join(presets())})")
            path = cand
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

    def match(self, name: str, side: str, scheme: str | None = None) -> Match | None:
        """The rule that covers ``name`` on ``side`` and the full groups on both sides."""
        n = self.strip(name, side)
        other = "candidate" if side == "baseline" else "baseline"
        for rule in self.rules:
            if side == "candidate" and rule.scheme is not None and rule.scheme not in str(
                    scheme or self.sides["baseline"].get("default_scheme")).split("+"):
                continue
            for pat in rule.patterns(side):
                caps = pat.match(n)
                if caps is None:
                    continue
                g = rule.gather
                if g:
                    # one group per stacked tensor: the gathered capture is not part of the key; pair()
                    # fills the expanded side with every expert (seen, or num_experts)
                    experts = [int(caps.pop(g))] if g in caps else []
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

    def _expand(self, m: Match, num_experts: int | None) -> None:
        """Give a gather match its full expanded group: every expert, in order, each rule pattern."""
        g = m.rule.gather
        if not g:
            return
        experts = list(range(int(num_experts))) if num_experts else sorted(set(m.experts))
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
        those whose names appear, or ``num_experts`` when given.
        """
        bnames, cnames = list(baseline_names), list(candidate_names)
        scheme = scheme or self.detect_scheme(bnames)
        # the original (unstripped) spelling of each name, so callers can look values up
        orig = {s: {} for s in SIDES}
        unmapped: dict[str, list[str]] = {s: [] for s in SIDES}
        ignored: dict[str, list[str]] = {s: [] for s in SIDES}
        groups: dict[Any, Match] = {}
        for side, names in (("baseline", bnames), ("candidate", cnames)):
            for n in names:
                m = self.match(n, side, scheme)
                if m is None:
                    (ignored if self.ignored(n, side) else unmapped)[side].append(n)
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
            for tname, t in zip(targets, gp.match.rule.apply(tensors, to_side, params), strict=True):
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


def _has_field(patterns: Sequence[Pattern], name: str) -> bool:
    return any(name in p.fields for p in patterns)


def _as_list(v: Any) -> list[str]:
    return [v] if isinstance(v, str) else list(v)


def presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


# ------------------------------------------------------------------------------------------------------
# CLI: `align mapping show PRESET`, `align mapping check PRESET --baseline F --candidate F`
# ------------------------------------------------------------------------------------------------------





