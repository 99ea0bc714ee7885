"""Weights at step N: two checkpoints compared parameter by parameter through the mapping.

Why: after N steps on the same data from the same start, both sides' weights must agree within their dtype's
noise; a conversion (step 0) must agree exactly. What is compared: each tensor of the baseline against its
counterpart, brought into the baseline's layout by the mapping's transform (fused QKV merged back, fc1
halves de-interleaved, stacked experts split per expert), so a finding names one baseline parameter (one
expert, one layer). Relative L2 difference ``||candidate - baseline|| / ||baseline||`` decides (per dtype,
:data:`WEIGHT_TOLERANCE`); max abs error and cosine are reported beside it. A failing parameter is also
explained where the numbers allow: it holds the transpose, its rows are permuted (q/k rows swapped), its
difference is confined to some rows, or it holds another parameter's values (swapped experts or layers).

Either checkpoint may be on either side of the mapping (Megatron vs MindFormers, MindFormers vs Megatron, or
the same framework twice): groups are joined by their candidate-side names, which both schemes of a rule
(local / TE norms, sequential / grouped experts) share. Tensors are read from the checkpoints one group at a
time (``checkpoints.weights``), so memory holds one parameter (one layer's experts) of each side.
Framework-free: the sources are duck-typed (``names``, ``shape``, ``dtype``, ``get``, ``sequential``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from checkpoints.convert import optimizer_key
from comparators.tensor_metrics import compare_arrays
from core.dtypes import coarsest, normalize
from core.errors import BadInput
from core.findings import Finding, StageResult
from mapping import Mapping, TransformParams
from mapping.rules import Rule

if TYPE_CHECKING:
    from checkpoints.weights import Weights

STAGE = "weights"
#: stored dtype -> (relative L2 difference that passes, that warns). A conversion is exact (0). A bfloat16
#: copy of float32 weights differs by ~2.3e-3 (its rounding, u/sqrt(3)), a float16 copy by ~3e-4; float32
#: runs that did the same N steps on the same data differ by what their kernels round differently, carried
#: through the optimizer (see docs/workflow.md, "Weights at step N", for what was measured here).
WEIGHT_TOLERANCE: dict[str, tuple[float, float]] = {
    "float64": (1e-9, 1e-6), "float32": (1e-4, 1e-2), "float16": (2e-3, 2e-2), "bfloat16": (1e-2, 5e-2)}
#: integer and boolean tensors must be equal
EXACT = (0.0, 0.0)
#: with a repeat of the baseline (``band``: how far the baseline's weights are from their own repeat's), a
#: parameter passes within BAND_RATIO[0] x its band and fails beyond BAND_RATIO[1] x (never tighter than its
#: dtype's tolerance). Measured on the CPU demo pair (float32, lr 1e-3, same data): the MindFormers
#: candidate's difference over the Megatron baseline's TP=2 repeat's was 0.36-2.0 per parameter after 30
#: steps and 0.3-0.5 after 300 (docs/workflow.md, "Weights at step N").
BAND_RATIO = (3.0, 10.0)
#: elements sampled from each failing tensor to recognise it elsewhere (swapped parameters)
_SAMPLE = 4096
#: at most this many differing rows are matched against each other to recognise a permutation
_MAX_PERMUTED_ROWS = 16384


@dataclass
class _Group:
    """One source's tensors of one mapping group."""

    key: tuple[str, ...]        # the group's candidate-side names: the join key
    rule: Rule
    layer: int | None
    names: list[str]            # present, in the rule's order, as the source spells them
    missing: list[str]          # expected by the rule, absent
    order: int = 0
    want: list[str] = field(default_factory=list)   # every name the rule expects, in its order (stripped)
    spelled: dict[str, str] = field(default_factory=dict)   # stripped name -> the source's spelling


@dataclass
class _Side:
    src: Any
    side: str                   # "baseline" (Megatron names) or "candidate" (MindFormers names) of the mapping
    groups: dict[tuple[str, ...], _Group] = field(default_factory=dict)
    unmapped: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)


def tolerance_for(dtype: str, table: dict[str, tuple[float, float]] | None = None) -> tuple[float, float]:
    """(pass, warn) rel L2 for a judged dtype; ``table`` overrides per dtype ("*" for every float dtype)."""
    if dtype == "exact":
        return EXACT
    merged = {**WEIGHT_TOLERANCE, **{k: v for k, v in (table or {}).items() if k != "*"}}
    if table and "*" in table and dtype not in table:
        return table["*"]
    return merged.get(dtype, merged["float32"])


def judged_dtype(dtypes: Sequence[str]) -> str:
    """The dtype whose noise dominates: the coarsest float of both sides; integers/bools alone are exact."""
    norm = [normalize(d) for d in dtypes]
    floats = [d for d in norm if d.startswith(("float", "bfloat"))]
    return coarsest(floats) if floats else "exact"


def side_of(src: Any, mapping: Mapping, hint: str | None = None) -> str:
    """Which side of ``mapping`` a source's names are on: ``hint`` (its format's framework) when the mapping
    covers its names there, else the side that covers more of them."""
    names = src.names()
    score = {s: sum(mapping.match(n, s) is not None for n in names) for s in ("baseline", "candidate")}
    if hint in score and score[hint] > 0:
        return hint
    if not any(score.values()):
        sample = ", ".join(repr(n) for n in names[:3]) or "none"
        raise BadInput(f"{src.path}: none of its {len(names)} tensor names matches mapping {mapping.name} "
                       f"(e.g. {sample}); pass --mapping with the preset or file for this model")
    return max(score, key=lambda s: score[s])


def _build(src: Any, side: str, mapping: Mapping, num_experts: int | None) -> _Side:
    out = _Side(src, side)
    names = src.names()
    position = {n: i for i, n in enumerate(names)}
    b, c = (names, []) if side == "baseline" else ([], names)
    pairs, unmapped, ignored = mapping.pair(b, c, num_experts=num_experts)
    # a MindSpore checkpoint holds the optimizer state beside the weights: not weights, not compared
    out.unmapped = [n for n in unmapped[side] if not optimizer_key(n)]
    out.ignored = ignored[side] + [n for n in unmapped[side] if optimizer_key(n)]
    for gp in pairs:
        present = gp.baseline_present if side == "baseline" else gp.candidate_present
        want = gp.match.baseline if side == "baseline" else gp.match.candidate
        have = {mapping.strip(n, side) for n in present}
        key = tuple(gp.match.candidate)
        if key in out.groups:   # two rules give the same candidate names (a scheme's twin): keep the fuller
            if len(out.groups[key].names) >= len(present):
                continue
        out.groups[key] = _Group(key, gp.match.rule, gp.match.layer, list(present),
                                 [n for n in want if n not in have],
                                 min((position[n] for n in present), default=len(names)), list(want),
                                 {mapping.strip(n, side): n for n in present})
    return out


def _experts_seen(sides: Sequence[_Side]) -> int | None:
    """The routed-expert count the checkpoints show: from a stacked (candidate-side) tensor's rows over one
    expert's input size when one side stacks them, else the highest expert index + 1 of the per-expert names."""
    per_expert: dict[tuple[str, ...], tuple[int, ...]] = {}   # by group key: the schemes' rules share it
    top = -1
    for s in sides:
        if s.side != "baseline":
            continue
        for g in s.groups.values():
            if g.rule.gather:
                for n in g.names:
                    per_expert.setdefault(g.key, s.src.shape(n))
                    m = re.search(r"(?:local_experts\.|\.weight)(\d+)(?:\.|$)", n)
                    if m:
                        top = max(top, int(m.group(1)))
    for s in sides:
        if s.side != "candidate":
            continue
        for g in s.groups.values():
            if g.rule.gather and g.rule.transform.get("op") == "stack_experts" and g.names \
                    and len(per_expert.get(g.key, ())) == 2:
                rows, inner = s.src.shape(g.names[0])[0], per_expert[g.key][1]
                if inner and rows % inner == 0:
                    return rows // inner
    return top + 1 if top >= 0 else None


def _sample(a: np.ndarray) -> np.ndarray:
    flat = a.reshape(-1)
    if flat.size <= _SAMPLE:
        return np.asarray(flat, np.float64).copy()
    return np.asarray(flat[np.linspace(0, flat.size - 1, _SAMPLE).astype(np.int64)], np.float64)


def _rel(x: np.ndarray, y: np.ndarray) -> float:
    """||x - y|| / ||y|| (0 when both are zero)."""
    d, n = float(np.linalg.norm(x - y)), float(np.linalg.norm(y))
    return d / n if n > 0 else (0.0 if d == 0 else math.inf)


def _ranges(idx: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out: list[str] = []
    for i in idx:
        if out and int(out[-1].split("-")[-1]) == i - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ", ".join(out[:6]) + (", ..." if len(out) > 6 else "")


def _nearest_rows(cc: np.ndarray, ca: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each row of ``cc`` the nearest row of ``ca`` and its distance relative to ``scale`` of that row,
    in blocks (the full distance matrix of thousands of rows would not fit)."""
    na = (ca * ca).sum(1)
    best = np.empty(cc.shape[0], np.int64)
    err = np.empty(cc.shape[0])
    for s in range(0, cc.shape[0], 1024):
        blk = cc[s:s + 1024]
        d2 = (blk * blk).sum(1)[:, None] + na[None, :] - 2.0 * blk @ ca.T
        j = np.argmin(d2, axis=1)
        best[s:s + 1024] = j
        err[s:s + 1024] = np.sqrt(np.maximum(d2[np.arange(blk.shape[0]), j], 0.0)) / scale[j]
    return best, err


def _permutation_text(perm: np.ndarray) -> str:
    """A row permutation in words: the fc1 gate/up layouts by name, else its first runs."""
    n = perm.size
    if n % 2 == 0:
        half, i = n // 2, np.arange(n // 2)
        inter = np.empty(n, np.int64)
        inter[0::2], inter[1::2] = i, half + i
        if np.array_equal(perm, inter) or np.array_equal(perm, np.argsort(inter)):
            return ("the two halves of the rows are interleaved on one side and stacked on the other (row 2i <-> "
                    "row i, row 2i+1 <-> row n/2+i): gate/up rows in the other layout than the mapping expects "
                    "([gate; up] vs interleaved, MindFormers' use_interleaved_weight_layout_mlp)")
    runs: list[tuple[int, int, int]] = []    # (start row, start source row, length)
    for i, j in enumerate(perm.tolist()):
        if i == j:
            continue
        if runs and runs[-1][0] + runs[-1][2] == i and runs[-1][1] + runs[-1][2] == j:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, j, 1))
    text = "; ".join(f"rows {s}-{s + k - 1} hold the baseline's rows {t}-{t + k - 1}" if k > 1 else
                     f"row {s} holds the baseline's row {t}" for s, t, k in runs[:4])
    return f"{text}{'; ...' if len(runs) > 4 else ''} (e.g. q/k rows swapped, or heads in another order)"


def _row_diagnosis(a: np.ndarray, c: np.ndarray, warn_tol: float) -> str | None:
    """Which rows differ and whether the candidate's differing rows are the baseline's rows in another order."""
    if a.ndim < 2 or a.shape[0] < 2:
        return None
    ra, rc = a.reshape(a.shape[0], -1), c.reshape(c.shape[0], -1)
    norm_a, norm_d = np.empty(ra.shape[0]), np.empty(ra.shape[0])
    step = max(1, (1 << 20) // max(ra.shape[1], 1))       # row blocks of ~1M elements: no whole-tensor temporaries
    for s in range(0, ra.shape[0], step):
        xa = np.asarray(ra[s:s + step], np.float64)
        norm_a[s:s + step] = np.linalg.norm(xa, axis=1)
        norm_d[s:s + step] = np.linalg.norm(np.asarray(rc[s:s + step], np.float64) - xa, axis=1)
    scale = np.maximum(norm_a, 1e-30)
    bad = np.flatnonzero(~(norm_d / scale <= warn_tol))
    if bad.size == 0:
        return None
    where = ("every row differs" if bad.size == a.shape[0] else
             f"rows {_ranges(bad.tolist())} of {a.shape[0]} differ, the others agree")
    if bad.size > _MAX_PERMUTED_ROWS or bad.size * ra.shape[1] > (1 << 25):
        return where
    best, err = _nearest_rows(np.asarray(rc[bad], np.float64), np.asarray(ra[bad], np.float64), scale[bad])
    if np.all(err <= warn_tol) and len(set(best.tolist())) == bad.size and np.any(bad[best] != bad):
        perm = np.arange(a.shape[0])
        perm[bad] = bad[best]
        return f"rows permuted (a layout error in the conversion): {_permutation_text(perm)}"
    return where


#: a row of weights.csv: these columns (None where not measured), after name, counterpart, layer, kind, rule
ROW_FIELDS: dict[str, Any] = {
    "shape": None, "candidate_shape": None, "dtype": None, "candidate_dtype": None, "judged_dtype": None,
    "numel": None, "rel_l2": None, "max_abs_err": None, "max_rel_err": None, "cosine": None, "rmse": None,
    "nonfinite_baseline": None, "nonfinite_candidate": None, "band": None, "tolerance": None,
    "warn_tolerance": None,
    "verdict": "fail", "problem": None, "diagnosis": None}


class _Compare:
    def __init__(self, a: _Side, b: _Side, mapping: Mapping, params: TransformParams,
                 tolerances: dict[str, tuple[float, float]] | None, bands: dict[str, float] | None) -> None:
        self.a, self.b, self.mapping, self.params, self.tolerances = a, b, mapping, params, tolerances
        self.bands = bands or {}
        self.rows: list[dict[str, Any]] = []
        self.samples: list[tuple[int, np.ndarray, np.ndarray, float, float]] = []   # failing rows

    def row(self, name: str, group: _Group | None, counterpart: list[str], **values: Any) -> dict[str, Any]:
        r: dict[str, Any] = {"name": name, "counterpart": ", ".join(counterpart),
                             "layer": group.layer if group else None, "kind": group.rule.kind if group else None,
                             "rule": group.rule.id if group else None, **ROW_FIELDS}
        r.update(values)
        self.rows.append(r)
        return r

    def missing(self, key: tuple[str, ...]) -> None:
        ga, gb = self.a.groups.get(key), self.b.groups.get(key)
        if ga is None:                      # only the candidate has it: name it as the baseline would
            assert gb is not None
            m = self.mapping.match(gb.names[0] if gb.names else gb.key[0], self.b.side)
            want = (m.baseline if self.a.side == "baseline" else m.candidate) if m else list(key)
            for n in want or list(key):
                self.row(n, gb, gb.names, problem="missing in baseline",
                         diagnosis=f"the baseline has no {n}; the candidate holds {', '.join(gb.names)}")
            return
        for n in ga.names:
            self.row(n, ga, [], problem="missing in candidate",
                     diagnosis=f"the candidate has no counterpart (expected {', '.join(key)})")

    def pair(self, ga: _Group, gb: _Group) -> None:
        problems = [(s, g) for s, g in (("baseline", ga), ("candidate", gb)) if g.missing]
        if problems:
            for who, g in problems:
                for n in g.missing:
                    # named by the baseline: the candidate's missing tensor by its baseline group when the
                    # names differ (a fused QKV whose wk is absent is the QKV's problem)
                    same = who == "baseline" or self.a.side == self.b.side or not ga.names
                    self.row(n if same else ga.names[0], ga, gb.names,
                             problem=f"missing in {who}",
                             diagnosis=f"the {who} lacks {n} (the rest of its group {', '.join(g.names) or '-'} "
                                       "is there)")
            self.partial(ga, gb)
            return
        self.whole(ga, gb)

    def partial(self, ga: _Group, gb: _Group) -> None:
        """The rest of a group one side holds only in part, compared where that is possible: the same names on
        both sides, or the experts a baseline holds against the candidate's stacked tensor."""
        if self.a.side == self.b.side:
            for n in ga.want:
                if n in ga.spelled and n in gb.spelled:
                    self.whole(replace(ga, names=[ga.spelled[n]], missing=[]),
                               replace(gb, names=[gb.spelled[n]], missing=[]))
            return
        if gb.missing or self.a.side != "baseline" or not ga.rule.gather:
            return
        present = [ga.spelled[n] for n in ga.want if n in ga.spelled]
        converted = self.convert(replace(ga, names=list(ga.want)), gb, present)
        for n, c in zip(ga.want, converted or [], strict=False):
            if n in ga.spelled:
                name = ga.spelled[n]
                self.tensor(name, ga, gb.names, self.a.src.get(name), np.asarray(c), self.a.src.dtype(name),
                            [self.b.src.dtype(x) for x in gb.names])

    def convert(self, ga: _Group, gb: _Group, report: list[str]) -> list[np.ndarray] | None:
        """The candidate group's tensors in the baseline's layout; None (a row for each of ``report``) when the
        rule cannot take them."""
        tb = [self.b.src.get(n) for n in gb.names]
        if self.a.side == self.b.side:
            return tb
        rule = ga.rule if self.a.side == "baseline" else gb.rule
        experts = len(ga.names if self.a.side == "baseline" else gb.names) // max(
            len(rule.patterns("baseline")), 1) if rule.gather else self.params.num_experts
        params = TransformParams(num_heads=self.params.num_heads, num_query_groups=self.params.num_query_groups,
                                 head_dim=self.params.head_dim, tp=1, num_experts=experts,
                                 sizes=dict(self.params.sizes))
        try:
            return rule.apply([np.asarray(t) for t in tb], self.a.side, params)
        except (BadInput, ValueError, IndexError, ZeroDivisionError) as exc:
            shapes = ", ".join(f"{n} {list(self.b.src.shape(n))}" for n in gb.names)
            for n in report:
                self.row(n, ga, gb.names, problem="transform failed",
                         diagnosis=f"rule {rule.id} cannot bring {shapes} into the baseline's layout "
                                   f"({' '.join(str(exc).split())})")
            return None

    def whole(self, ga: _Group, gb: _Group) -> None:
        ta = [self.a.src.get(n) for n in ga.names]
        tb = self.convert(ga, gb, ga.names)
        if tb is None:
            return
        if len(tb) != len(ta):
            for n in ga.names:
                self.row(n, ga, gb.names, problem="group size", diagnosis=f"the baseline's group holds {len(ta)} "
                         f"tensors, the candidate's {len(tb)} after the transform")
            return
        dt_b = [self.b.src.dtype(n) for n in gb.names]
        for name, a, c in zip(ga.names, ta, tb, strict=True):
            self.tensor(name, ga, gb.names, a, np.asarray(c), self.a.src.dtype(name), dt_b)

    def tensor(self, name: str, g: _Group, counterpart: list[str], a: np.ndarray, c: np.ndarray, dt_a: str,
               dt_b: list[str]) -> None:
        judged = judged_dtype([dt_a, *dt_b])
        tol = tolerance_for(judged, self.tolerances)
        band = self.bands.get(name)
        if band is not None and math.isfinite(band):
            tol = (max(tol[0], BAND_RATIO[0] * band), max(tol[1], BAND_RATIO[1] * band))
        base = {"shape": list(a.shape), "candidate_shape": list(c.shape), "dtype": normalize(dt_a),
                "candidate_dtype": ", ".join(sorted({normalize(d) for d in dt_b})), "judged_dtype": judged,
                "numel": int(a.size), "band": band, "tolerance": tol[0], "warn_tolerance": tol[1]}
        if a.shape != c.shape:
            diag = f"shape {list(c.shape)} where the baseline has {list(a.shape)}"
            if a.ndim == 2 and c.shape == a.shape[::-1]:
                rel = compare_arrays(c.T, a).rel_l2
                diag = f"stored transposed ({list(c.shape)} for the baseline's {list(a.shape)})" + (
                    ", values equal once transposed" if rel <= tol[1] else
                    f"; transposed it still differs by {rel:.3g}")
            elif a.size == c.size:
                diag += " (same number of elements: a reshape or a layout error in the conversion)"
            self.row(name, g, counterpart, **base, problem="shape mismatch", diagnosis=diag)
            return
        mt = compare_arrays(c, a)             # relative to the baseline (second argument)
        nan = (mt.nan_candidate, mt.inf_candidate) != (mt.nan_baseline, mt.inf_baseline)
        rel = mt.rel_l2
        verdict = "fail" if nan or not math.isfinite(rel) or rel > tol[1] else "warn" if rel > tol[0] else "pass"
        r = self.row(name, g, counterpart, **base, rel_l2=rel, max_abs_err=mt.max_abs_err,
                     max_rel_err=mt.max_rel_err, cosine=mt.cosine, rmse=mt.rmse, verdict=verdict,
                     nonfinite_baseline=mt.nan_candidate + mt.inf_candidate,
                     nonfinite_candidate=mt.nan_baseline + mt.inf_baseline)
        if nan:
            r["diagnosis"] = (f"NaN/Inf: baseline {mt.nan_candidate}/{mt.inf_candidate}, candidate "
                              f"{mt.nan_baseline}/{mt.inf_baseline}")
        elif verdict == "fail":
            if a.ndim == 2 and a.shape[0] == a.shape[1] and a.size and compare_arrays(c.T, a).rel_l2 <= tol[1]:
                r["diagnosis"] = "holds the baseline's transpose (a square matrix stored [in, out])"
            else:
                r["diagnosis"] = _row_diagnosis(a, c, tol[1])
            self.samples.append((len(self.rows) - 1, _sample(a), _sample(c), float(np.linalg.norm(a)),
                                 float(np.linalg.norm(c))))

    def swapped(self) -> None:
        """A failing parameter whose candidate values are another failing parameter's baseline values."""
        by_shape: dict[tuple, list[tuple[int, np.ndarray, np.ndarray, float, float]]] = {}
        for s in self.samples:
            by_shape.setdefault(tuple(self.rows[s[0]]["shape"]), []).append(s)
        for group in by_shape.values():
            if len(group) < 2 or len(group) > 256:
                continue
            for i, _sa, sc_i, _na, nc in group:
                tol = self.rows[i]["warn_tolerance"]
                for j, sa_j, _sc, na_j, _nc in group:
                    if i == j or abs(nc - na_j) > tol * max(na_j, 1e-30) or _rel(sc_i, sa_j) > tol:
                        continue
                    other = self.rows[j]["name"]
                    self.rows[i]["diagnosis"] = (f"holds the baseline's {other} (parameters swapped, e.g. experts "
                                                 "or layers in the wrong order)")
                    break


def compare_weights(baseline: Weights, candidate: Weights, mapping: Mapping, *, params: TransformParams | None = None,
                    tolerances: dict[str, tuple[float, float]] | None = None,
                    sides: Sequence[str | None] = (None, None), top: int = 10,
                    bands: dict[str, float] | None = None,
                    progress: Callable[[int, int], None] | None = None) -> tuple[StageResult, list[dict[str, Any]]]:
    """Compare two checkpoints' weights through ``mapping``: (the ``weights`` stage, one row per baseline
    tensor). ``sides``: each source's side of the mapping when its format says it (Megatron formats
    "baseline", MindFormers formats "candidate"), else found from the names. ``tolerances``: dtype -> (pass,
    warn) rel L2 overriding :data:`WEIGHT_TOLERANCE` ("*": every dtype). ``bands``: baseline name -> rel L2 of
    the baseline against a repeat of itself (the same compare, run on the repeat): widens that parameter's
    tolerance to :data:`BAND_RATIO` x its band."""
    params = params or TransformParams()
    sa, sb = side_of(baseline, mapping, sides[0]), side_of(candidate, mapping, sides[1])
    a, b = _build(baseline, sa, mapping, params.num_experts), _build(candidate, sb, mapping, params.num_experts)
    experts = params.num_experts or _experts_seen([a, b])
    if experts and any(g.rule.gather for s in (a, b) for g in s.groups.values()):
        a, b = _build(baseline, sa, mapping, experts), _build(candidate, sb, mapping, experts)
    if sa != sb and not params.num_heads:
        fused = sorted({g.rule.id for g in a.groups.values() if g.key in b.groups
                        and g.rule.transform.get("op") in ("split_qkv", "qkv_contiguous")})
        if fused:
            raise BadInput(f"mapping {mapping.name} splits fused QKV by attention head (rule {fused[0]}): pass "
                           "--num-heads (and --num-query-groups for GQA)")
    cmp = _Compare(a, b, mapping, params, tolerances, bands)
    lead = a if a.src.sequential or not b.src.sequential else b
    keys = sorted(set(a.groups) | set(b.groups),
                  key=lambda k: (lead.groups[k].order if k in lead.groups else 1 << 60, k))
    for i, key in enumerate(keys):
        ga, gb = a.groups.get(key), b.groups.get(key)
        if ga is None or gb is None:
            cmp.missing(key)
        else:
            cmp.pair(ga, gb)
        if progress is not None:
            progress(i + 1, len(keys))
    for side, who in ((a, "baseline"), (b, "candidate")):
        for n in side.unmapped:
            cmp.row(n, None, [], problem=f"unmapped in {who}",
                    diagnosis=f"matches no rule of {mapping.name}: not compared (a parameter the other "
                              "framework does not have, or the wrong --mapping)")
    cmp.swapped()
    res = _summarise(cmp, a, b, mapping, top)
    return res, cmp.rows


def replica_findings(src: Any, role: str, tolerances: dict[str, tuple[float, float]] | None = None
                     ) -> list[Finding]:
    """A replicated parameter (norm weights under TP) must be the same on every TP rank of a checkpoint; a
    source that read several copies (``replica_differences``: name -> rel L2 of the most different copy) is
    judged by the parameter's dtype tolerance. Why: a copy that drifts means its gradient is not all-reduced
    over TP (Megatron's finalize_model_grads does it for qk_layernorm and sequence-parallel norms), and the
    ranks then train different models."""
    out = []
    for name, rel in sorted(getattr(src, "replica_differences", {}).items()):
        tol = tolerance_for(judged_dtype([src.dtype(name)]) if name in src.names() else "float32", tolerances)
        if rel <= tol[0]:
            continue
        verdict = "warn" if rel <= tol[1] else "fail"
        out.append(Finding(STAGE, verdict, name, "tp_replica_rel_l2", rel, tol[0],
                           f"{name}: its copies on the TP ranks of the {role} ({src.path}) differ by {rel:.3g} (rel "
                           "L2): a replicated parameter whose gradient is not all-reduced over TP (Megatron's "
                           "finalize_model_grads does it for qk_layernorm and sequence-parallel norms)"))
    return out


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}"


def _summarise(cmp: _Compare, a: _Side, b: _Side, mapping: Mapping, top: int) -> StageResult:
    res = StageResult(STAGE)
    rows = cmp.rows
    for r in rows:
        if r["verdict"] == "pass":
            continue
        if r["problem"]:
            msg = f"{r['name']}: {r['problem']}; {r['diagnosis']}"
            res.add(Finding(STAGE, "fail", r["name"], r["problem"].replace(" ", "_"), None, None, msg))
            continue
        banded = r["band"] is not None and r["tolerance"] > tolerance_for(r["judged_dtype"], cmp.tolerances)[0]
        limit = (f"its tolerance {r['tolerance']:.3g} ({BAND_RATIO[0]:g} x the baseline's band {r['band']:.3g} "
                 "from its repeat)" if banded else f"the {r['judged_dtype']} tolerance {r['tolerance']:.3g}")
        where = "above" if r["verdict"] == "fail" else "within the warn band above"
        msg = (f"{r['name']} differs by {_fmt(r['rel_l2'])} (rel L2; max abs {_fmt(r['max_abs_err'])}, cosine "
               f"{r['cosine']:.6f}), {where} {limit}")
        if r["diagnosis"]:
            msg += f"; {r['diagnosis']}"
        res.add(Finding(STAGE, r["verdict"], r["name"], "rel_l2", r["rel_l2"], r["tolerance"], msg))
    for side, who in ((a, "baseline"), (b, "candidate")):
        for f in replica_findings(side.src, who, cmp.tolerances):
            res.add(f)
    compared = [r for r in rows if r["rel_l2"] is not None]
    ranked = sorted(compared, key=lambda r: -r["rel_l2"] if math.isfinite(r["rel_l2"]) else -math.inf)
    counts = {v: sum(r["verdict"] == v for r in rows) for v in ("pass", "warn", "fail")}
    if rows and not any(f.verdict != "pass" for f in res.findings):
        worst = ranked[0] if ranked else None
        res.add(Finding(STAGE, "pass", None, "parameters_within_tolerance", len(compared), None,
                        f"all {len(compared)} parameters agree within their tolerance "
                        f"({'the band from the repeat, or ' if cmp.bands else ''}their dtype's)" + (
                            f" (largest rel L2 {_fmt(worst['rel_l2'])}: {worst['name']})" if worst else "")))
    if not rows:
        res.add(Finding(STAGE, "fail", None, "nothing_compared", 0, None,
                        f"no tensor of {a.src.path} has a counterpart in {b.src.path} under {mapping.name}"))
    res.details = {
        "baseline": str(a.src.path), "candidate": str(b.src.path), "baseline_format": a.src.kind,
        "candidate_format": b.src.kind, "baseline_side": a.side, "candidate_side": b.side, "mapping": mapping.name,
        "parameters": len(rows), "compared": len(compared), "passed": counts["pass"], "warned": counts["warn"],
        "failed": counts["fail"],
        "missing": sum(1 for r in rows if (r["problem"] or "").startswith("missing")),
        "unmapped_baseline": len(a.unmapped), "unmapped_candidate": len(b.unmapped),
        "ignored_baseline": len(a.ignored), "ignored_candidate": len(b.ignored),
        "max_rel_l2": ranked[0]["rel_l2"] if ranked else None,
        "most_drifted": [{k: r[k] for k in ("name", "rel_l2", "max_abs_err", "cosine", "judged_dtype", "verdict",
                                             "diagnosis")} for r in ranked[:top]],
        "band_ratio": list(BAND_RATIO) if cmp.bands else None,
        "tolerances": {d: list(tolerance_for(d, cmp.tolerances)) for d in
                       sorted({r["judged_dtype"] for r in rows if r["judged_dtype"]})},
    }
    return res
