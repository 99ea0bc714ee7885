"""Evidence that checks itself: a run's named gradient norms, recombined as the comparators recombine them, must
give back the run's own global gradient norm.

Why: on a 64-rank layout nobody can rerun here, a wrong recombination (a rank's table missing, a TP-duplicated
parameter summed over TP, an expert recorded under another expert's index) silently changes every named norm
the report judges. Both frameworks hand over the number that exposes it: Megatron's optimizer and MindFormers'
training cell compute the global norm over the whole model every step, and the dumpers store it
(``local_norm`` attrs ``global_norm`` / ``global_norm_source``; the run's ``grad_norm`` series, or the log's).

What is recombined is exactly what the comparators use: ``comparators.local_norms.read_local_norms`` (TP / EP
slices, pipeline stages, DP / CP replicas, distributed-optimizer and optimizer-parallel parts, experts by
global index) at the steps the step-1 comparison may take, and ``comparators.trajectories.read_trajectory`` (the
same rules, replayed per table layout) at every step the run recorded.

Tolerance, float32 summation noise (``tolerance``): both numbers are root-sum-squares of the same float32
gradient elements in another order. A sum of positive float32 terms in any order is within (terms - 1) x u of
the exact sum (u = 2^-24), a pairwise / blocked one within log2(terms) x u. The framework sums the elements of a
tensor (blocked: log2 N x u for N elements) and then its rows and ranks one by one (rows x u); the recombination
reads norms each rounded once in float32 (log2 N x u on their squares) and adds them in float64. Relative error of
the squared total: <= (2 log2 N + rows) x u; of the norm (the square root halves it) <= (log2 N + rows / 2) x u.
The line used is twice that, (2 log2 N + rows) x u, plus 2u per printed value where the total was read from a log
(float32 printed to its shortest round-tripping digits): 3.6e-6 for the 15-parameter test model, ~2e-4 for a
3000-row model. Measured on real megatron-core stores (DP, TP, PP, VPP, EP, SP, CP, distributed optimizer):
<= 6e-8. What it catches: a parameter whose norm is d of the total T, counted twice or dropped, moves the total
by ~d^2 / 2T^2: above the line from d / T ~ 3e-3 (test model) to ~2e-2 (3000 rows).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from comparators.local_norms import ShardNorm, read_local_norms
from runstore.h5file import open_h5

U32 = 2.0 ** -24
#: Sources of a stored global norm computed outside the named norms (Megatron's optimizer, MindFormers' cell).
INDEPENDENT = ("optimizer", "train_cell", "caller")
#: Steps checked with the step comparator's own reader (the step-1 comparison takes the first of these).
STEP_SEARCH = 20
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EXPERT = re.compile(r"^(?P<pre>.*?\.experts\.(?:local_experts\.|linear_fc\d\.(?:weight|bias))?"
                     r"|.*?\.experts\.weight\d\[)(?P<e>\d+)")


def tolerance(numel: int, rows: int, printed: bool = False) -> float:
    """The float32 summation line between a recombined total and the recorded one (module docstring): relative,
    (2 log2 N + rows) x u, + 2u when the recorded total is a printed log value. ``numel`` 0 (not recorded):
    N taken as 2^40 elements."""
    n = numel if numel > 1 else 2 ** 40
    return (2.0 * math.log2(n) + max(rows, 1) + (2.0 if printed else 0.0)) * U32


@dataclass
class StepCheck:
    """One step of one side: the recombined total against the recorded one."""

    step: int
    recombined: float
    recorded: float
    tolerance: float
    path: str                       # "step reader" (read_local_norms) or "trajectory reader" (read_trajectory)
    causes: list[str] = field(default_factory=list)
    # "subset": the named norms cover some parameters: their total may only stay below the recorded one;
    # "dp": they are each DP rank's gradient before the all-reduce: the recorded total may only stay below the sum
    # of the DP ranks' totals (the triangle inequality)
    bound: str = ""

    @property
    def rel(self) -> float:
        if self.recombined == self.recorded:
            return 0.0
        if not (math.isfinite(self.recombined) and math.isfinite(self.recorded)):
            return math.inf
        return abs(self.recombined - self.recorded) / max(abs(self.recorded), 1e-30)

    @property
    def finite(self) -> bool:
        """Both totals finite: a step with a non-finite gradient is the NaN trace's, not a recombination's."""
        return math.isfinite(self.recombined) and math.isfinite(self.recorded)

    @property
    def ok(self) -> bool:
        if not self.finite:
            return True
        if self.bound == "subset":
            return self.recombined <= self.recorded * (1 + self.tolerance)
        if self.bound == "dp":
            return self.recorded <= self.recombined * (1 + self.tolerance)
        return self.rel <= self.tolerance

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "recombined": self.recombined, "recorded": self.recorded, "rel_diff": self.rel,
                "tolerance": self.tolerance, "path": self.path, "causes": list(self.causes)}


@dataclass
class SideCheck:
    """One run's self-check: ``status`` pass / fail / bound / unchecked (``why``), the steps checked, the failing
    ones with their likely causes, the layout the run recorded and where its total came from."""

    side: str
    status: str = "unchecked"
    why: str = ""
    source: str = ""
    layout: str = ""
    steps: list[int] = field(default_factory=list)
    failed: list[StepCheck] = field(default_factory=list)
    worst: StepCheck | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def failed_steps(self) -> set[int]:
        return {c.step for c in self.failed}

    def failures(self, step: int | None = None, path: str | None = None) -> list[StepCheck]:
        """The failed checks at ``step`` (any step when None) of ``path`` (either reader when None)."""
        return [c for c in self.failed if (step is None or c.step == step) and (path is None or c.path == path)]

    def trusted(self, step: int | None = None, path: str | None = None) -> bool:
        """Whether the named norms may be judged at ``step`` (every step when None) as read by ``path`` (the step
        reader for the step-1 comparison; None: both readers): not where the check failed. An unchecked side is
        judged as before (nothing says it is wrong); the stage's details say it was not checked."""
        return not self.failures(step, path)

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "why": self.why, "source": self.source, "layout": self.layout,
                "steps_checked": len(self.steps), "first_step": self.steps[0] if self.steps else None,
                "last_step": self.steps[-1] if self.steps else None,
                "failed_steps": sorted(self.failed_steps)[:50], "failed": [c.to_json() for c in self.failed[:10]],
                "worst": self.worst.to_json() if self.worst else None, "warnings": self.warnings}


def layout_text(meta: dict[str, Any]) -> str:
    """The layout a run recorded, in words (``tp=2 pp=2 dp=2 ep=1 cp=1, world size 8``)."""
    par = meta.get("parallel") or {}
    if not isinstance(par, dict) or not par:
        return "no layout recorded (read as one process)"
    keys = [k for k in ("tp", "pp", "dp", "ep", "cp") if k in par]
    text = " ".join(f"{k}={par[k]}" for k in keys)
    extra = [k for k, on in (("sequence parallel", par.get("sequence_parallel") or par.get("use_seq_parallel")),
                             ("optimizer parallel", par.get("optimizer_parallel"))) if on]
    world = par.get("world_size")
    return (text + (", " + ", ".join(extra) if extra else "")
            + (f", world size {world}" if world is not None else "")).strip(", ")


def _ranges(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2, 5``."""
    rs = sorted(set(int(r) for r in ranks))
    out, i = [], 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(f"{rs[i]}-{rs[j]}" if j > i else f"{rs[i]}")
        i = j + 1
    return ", ".join(out)


def _store_attrs(store: Any, step: int) -> dict[int, dict[str, Any] | None]:
    """Each rank's ``local_norm`` attributes at ``step`` (None: the rank's file has no table)."""
    out: dict[int, dict[str, Any] | None] = {}
    for rank in store.array_ranks(step):
        path = store.step_file(step, rank)
        with open_h5(path) as h5:
            out[rank] = dict(h5["local_norm"].attrs) if "local_norm" in h5 else None
    return out


def _attr_str(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def likely_causes(norms: dict[str, ShardNorm], info: dict[str, Any], meta: dict[str, Any], recombined: float,
                  recorded: float, tol: float, present: Iterable[int] | None = None) -> list[str]:
    """What is likely missing or counted twice, most specific first: absent ranks, missing TP shards or
    distributed-optimizer parts, two gradients under one name (an expert renamed onto another index), a
    TP-sliced parameter recorded as duplicated, a duplicated one summed over TP, gaps in layers or experts, and
    the size of the gap against the parameters' norms."""
    out: list[str] = []
    par = meta.get("parallel") or {}
    world = int(par.get("world_size") or 0) if isinstance(par, dict) else 0
    have = sorted(set(present if present is not None else info.get("ranks", [])))
    if world and len(have) < world:
        absent = sorted(set(range(world)) - set(have))
        out.append(f"rank{'s' if len(absent) > 1 else ''} {_ranges(absent)} absent (no local_norm table at this "
                   f"step; {len(have)} of world size {world} recorded)")
    tp_missing = {n: e.missing_shards for n, e in norms.items() if e.missing_shards}
    if tp_missing:
        shards = sorted({s for v in tp_missing.values() for s in v})
        out.append(f"TP shards {_ranges(shards)} missing for {len(tp_missing)} parameter(s) "
                   f"(e.g. {next(iter(tp_missing))})")
    dp_missing = {n: e.missing_dp_parts for n, e in norms.items() if e.missing_dp_parts}
    if dp_missing:
        parts = sorted({s for v in dp_missing.values() for s in v})
        out.append(f"distributed-optimizer parts of DP ranks {_ranges(parts)} missing for {len(dp_missing)} "
                   f"parameter(s) (e.g. {next(iter(dp_missing))})")
    for name, e in sorted(norms.items(), key=lambda kv: -kv[1].replica_disagree):
        if e.replica_disagree <= 1e-3:
            break
        what = ("an expert renamed to another expert's index (or named locally on an EP rank)"
                if _EXPERT.match(name) else "two different parameters recorded under one name")
        out.append(f"two different gradients recorded as {name} (norms {e.replica_disagree:.3g} apart relative): "
                   f"{what}; the recombination keeps one of them as a replica and drops the other")
    excess = recombined ** 2 - recorded ** 2
    scale = max(recorded ** 2, 1e-300)
    for name, e in norms.items():
        if e.partition_dim >= 0 and len(e.shards) > 1:
            vals = list(e.shards.values())
            if max(vals) - min(vals) <= 1e-6 * max(max(vals), 1e-30):
                extra = e.full_norm() ** 2 - vals[0] ** 2
                if excess > 0 and abs(excess - extra) <= max(4 * tol, 1e-3 * extra / scale) * scale + 1e-3 * extra:
                    out.append(f"a duplicated TP parameter counted {len(vals)} times: {name} is recorded as TP-sliced "
                               f"(partition dim {e.partition_dim}) but its {len(vals)} TP ranks hold the same norm "
                               f"{vals[0]:.6g}; summed over TP it adds {math.sqrt(extra):.6g}")
        if e.partition_dim < 0 and e.disagree > 1e-3 and recombined < recorded:
            out.append(f"{name} is recorded as duplicated over TP but its TP ranks' norms differ by {e.disagree:.3g} "
                       "relative: a TP-sliced parameter recorded as duplicated, one slice counted")
    layers = sorted({int(m.group(1)) for n in norms for m in [_LAYER.search(n)] if m})
    if layers and len(layers) < layers[-1] + 1:
        gap = sorted(set(range(layers[-1] + 1)) - set(layers))
        out.append(f"layers {_ranges(gap)} absent while layers up to {layers[-1]} are recorded (a pipeline stage's "
                   "ranks?)")
    experts: dict[str, set[int]] = {}
    for n in norms:
        m = _EXPERT.match(n)
        if m:
            experts.setdefault(m.group("pre"), set()).add(int(m.group("e")))
    for pre, es in experts.items():
        gap = sorted(set(range(max(es) + 1)) - es)
        if gap:
            out.append(f"expert indices {_ranges(gap)} absent under {pre}* while indices up to {max(es)} are "
                       "recorded: an expert renamed to another index (or an EP rank's experts named locally)")
            break
    if recorded > 0 and recombined > 0:
        k = (recombined / recorded) ** 2
        for mult, word in ((k, "every row counted {k} times (replicas or DP ranks summed?)"),
                           (1 / k, "only 1/{k} of the gradient recombined ({k} equal parts, one kept?)")):
            r = round(mult)
            if r >= 2 and abs(mult - r) <= 1e-3 * r:
                out.append(word.format(k=r))
    gap_sq = abs(excess)
    if gap_sq > 0 and not any(("counted" in c or "absent" in c or "missing" in c or "different gradients" in c)
                              for c in out):
        close = sorted(norms.items(), key=lambda kv: abs(kv[1].full_norm() ** 2 - gap_sq))[:1]
        size = math.sqrt(gap_sq)
        hint = ""
        if close and abs(close[0][1].full_norm() ** 2 - gap_sq) <= 1e-3 * gap_sq:
            hint = (f"; as large as {close[0][0]}'s norm: " + ("that parameter counted twice?" if excess > 0 else
                                                               "a parameter of that size without a row?"))
        out.append("the recombination holds " + ("more" if excess > 0 else "less") + " than the recorded total "
                   f"by sqrt(|R^2 - G^2|) = {size:.6g}, not explained by the layout recorded" + hint)
    return out


def dp_bound(norms: dict[str, ShardNorm]) -> float:
    """The all-reduced global norm's upper bound from pre-all-reduce entries: each DP rank's total (its TP / EP
    slices root-sum-square) summed over the DP ranks (averaged under gradients_mean): ||sum g_d|| <= sum ||g_d||."""
    ranks = sorted({d for e in norms.values() for parts in (e.pre_reduce or {}).values() for d in parts})
    totals = [math.sqrt(sum((e.dp_rank_norm(d) or 0.0) ** 2 for e in norms.values() if e.pre_reduce)) for d in ranks]
    whole = math.sqrt(sum(e.full_norm() ** 2 for e in norms.values() if not e.pre_reduce))
    mean = any(e.reduce_mean for e in norms.values())
    return (sum(totals) / len(totals) if mean and totals else sum(totals)) + whole


def _step_totals(run: Any, steps: list[int]) -> dict[int, tuple[float, dict[str, ShardNorm], dict[str, Any]]]:
    out = {}
    src = run.store if getattr(run, "store", None) is not None else run
    for step in steps:
        norms, info = read_local_norms(src, step)
        out[step] = (math.sqrt(sum(e.full_norm() ** 2 for e in norms.values())), norms, info)
    return out


def _monitor_subset(meta: dict[str, Any]) -> bool:
    """A MindFormers log whose TrainingStateMonitor was given a ``target`` narrower than every parameter."""
    cfg = meta.get("config") or {}
    if isinstance(cfg, dict) and isinstance(cfg.get("values"), dict):
        cfg = cfg["values"]
    mon = cfg.get("monitor_config") if isinstance(cfg, dict) else None
    target = mon.get("target") if isinstance(mon, dict) else None
    if not target:
        return False
    pats = [str(t) for t in (target if isinstance(target, list) else [target])]
    return not any(p in (".*", "*", ".+") for p in pats)


def check_side(run: Any, side: str, *, trajectory: Any = None, search: int = STEP_SEARCH) -> SideCheck:
    """One run's self-check (module docstring). ``trajectory``: its ``read_trajectory`` result when already read
    (all steps' recombined norms); None: only the step reader's steps are checked."""
    res = SideCheck(side, layout=layout_text(run.meta or {}))
    norm_steps = run.local_norm_steps(limit=search)[:search]
    if not norm_steps:
        res.why = "no named local norms"
        return res
    store = getattr(run, "store", None)
    series = run.series("grad_norm")
    printed = store is None
    recorded: dict[int, float] = {}
    present: dict[int, list[int]] = {}
    if store is not None:
        attrs = {s: _store_attrs(store, s) for s in norm_steps}
        first = next((a for a in attrs[norm_steps[0]].values() if a is not None), {})
        source = _attr_str(first.get("global_norm_source", "")) if first else ""
        if source not in INDEPENDENT:
            res.why = ("the store's global norm was computed by the dumper from these same named norms (no optimizer "
                       "or training-cell total was handed to it): nothing independent to check against"
                       if source == "local" else
                       "the store does not say where its global norm came from (no global_norm_source): "
                       "nothing known to be independent to check against")
            return res
        res.source = {"optimizer": "Megatron's optimizer (get_grad_norm_fp32), stored by the dumper",
                      "train_cell": "MindFormers' training cell (global_norm), stored by the dumper",
                      "caller": "the global norm handed to MindSporeDumper.record_grads"}[source]
        for s, per in attrs.items():
            present[s] = [r for r, a in per.items() if a is not None]
            vals = [float(a["global_norm"]) for a in per.values() if a is not None and "global_norm" in a]
            if vals and math.isfinite(vals[0]):
                recorded[s] = vals[0]
    else:
        if not len(series):
            res.why = "no global grad norm in the log to check the named norms against"
            return res
        res.source = "the log's global grad norm at the same step"
    for s in norm_steps:
        if s not in recorded and s in series.index and math.isfinite(float(series[s])):
            recorded[s] = float(series[s])
    totals = _step_totals(run, [s for s in norm_steps if s in recorded])
    if not totals:
        res.why = "no step holds both named norms and a global grad norm"
        return res
    pre = any(e.pre_reduce for e in next(iter(totals.values()))[1].values())
    numel = sum(e.full_numel() for e in next(iter(totals.values()))[1].values())
    rows = sum(len(e.rows) or len(e.shards) for e in next(iter(totals.values()))[1].values())
    tol = tolerance(numel, rows, printed)
    subset = "subset" if store is None and _monitor_subset(run.meta or {}) else ""
    checks: list[StepCheck] = []
    for s, (total, norms, _info) in totals.items():
        if pre:
            checks.append(StepCheck(s, dp_bound(norms), recorded[s], tol, "step reader", bound="dp"))
        else:
            checks.append(StepCheck(s, total, recorded[s], tol, "step reader", bound=subset))
    # every step, the first ones too: the trajectory stage reads them this way (not pre-all-reduce norms: their
    # DP ranks are kept apart by the step reader only)
    if trajectory is not None and not pre:
        cols = np.asarray(trajectory.values, dtype=np.float64)
        if trajectory.present is not None:      # a name not recorded at a step: nothing (a NaN norm stays NaN)
            cols = np.where(trajectory.present, cols, 0.0)
        tot = np.sqrt(np.sum(np.square(cols), axis=1))
        for i, s in enumerate(trajectory.steps.tolist()):
            ref = recorded.get(s, float(series[s]) if s in series.index else math.nan)
            if not math.isfinite(ref):
                continue
            # a name absent at a step adds nothing to that step's total: the check shows it missing; the
            # trajectory holds float32 norms: one more rounding each (2u on the total's line)
            checks.append(StepCheck(int(s), float(tot[i]), ref, tol + 2 * U32, "trajectory reader", bound=subset))
    checks.sort(key=lambda c: c.step)
    skipped_steps = sorted({c.step for c in checks if not c.finite})
    if skipped_steps:
        res.warnings.append(f"steps {_ranges(skipped_steps)} not checked: a non-finite gradient norm (the NaN trace "
                            "names its parameter)")
    checks = [c for c in checks if c.finite]
    if not checks:
        res.why = "every step's gradient norm is non-finite"
        return res
    res.steps = sorted({c.step for c in checks})
    res.worst = max(checks, key=lambda c: c.rel / c.tolerance)
    res.failed = [c for c in checks if not c.ok]
    res.status = "fail" if res.failed else ("bound" if subset or pre else "pass")
    if subset:
        res.why = ("TrainingStateMonitor's target names a subset of the parameters: the recombined norms may only "
                   "stay below the log's global norm")
    if pre:
        res.why = ("the named norms are each DP rank's gradient before the all-reduce (msrun worker logs, "
                   "data-parallel mode): the all-reduced total is not known from them, only bounded: it may not "
                   "exceed the sum of the DP ranks' totals (their mean under gradients_mean)")
    for c in res.failed[:3]:
        got = totals.get(c.step)
        if got is None:
            got = _step_totals(run, [c.step]).get(c.step)
        if got is not None:
            c.causes = likely_causes(got[1], got[2], run.meta or {}, c.recombined, c.recorded, c.tolerance,
                                     present.get(c.step) if store is not None else None)
            if c.path == "trajectory reader" and abs(got[0] - c.recorded) <= c.tolerance * abs(c.recorded):
                c.causes.insert(0, "the step reader's recombination gives the recorded total here "
                                   f"({got[0]:.9g}): the whole-run (trajectory) reader combines these rows otherwise")
        if not c.causes:
            c.causes = ["no table of this step read back (see the run store's incomplete steps)"]
    return res


@dataclass
class BatchCheck:
    """One run's batch rows per step (summed over its DP ranks) against the global batch size it recorded."""

    side: str
    expected: int | None
    source: str = ""
    status: str = "unchecked"
    why: str = ""
    steps: list[int] = field(default_factory=list)
    failed: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "why": self.why, "global_batch_size": self.expected, "source": self.source,
                "steps_checked": len(self.steps), "failed": self.failed[:10]}


def check_batch_rows(run: Any, side: str, expected: int | None, source: str, limit: int = STEP_SEARCH) -> BatchCheck:
    """The samples a run recorded per step (each DP rank's batch rows, TP / CP copies once, pipeline stages
    joined: runstore.dp_batches) against its own global batch size (``expected``, from its config), at its
    first ``limit`` complete steps with batches. A step a rank never finished is left out (a killed run)."""
    from runstore import dp_batches
    from runstore.batches import data_groups

    res = BatchCheck(side, expected, source)
    store = getattr(run, "store", None)
    if store is None:
        res.why = "no recorded batches (not a run store)"
        return res
    if not isinstance(expected, int) or isinstance(expected, bool) or expected <= 0:
        res.why = "no global batch size in the run's config"
        return res
    torn = {i.step for i in store.incomplete}
    par = (run.meta or {}).get("parallel") or {}
    dp_size = int(par.get("dp", 0) or 0) if isinstance(par, dict) else 0
    for step in store.array_steps():
        if len(res.steps) >= limit:
            break
        if step in torn:
            continue
        ranks = store.array_ranks(step)
        per = {dp: int(np.shape(b["tokens"])[0]) for dp, b, _, _, _ in
               dp_batches(store, step, ["tokens"], data_groups(store, ranks)) if "tokens" in b}
        if not per:
            continue
        res.steps.append(step)
        rows = sum(per.values())
        if rows == expected:
            continue
        causes = []
        if dp_size and len(per) < dp_size:
            causes.append(f"DP rank(s) {_ranges(set(range(dp_size)) - set(per))} of {dp_size} hold no batch at this "
                          "step (their step files or batch arrays are absent)")
        causes.append(f"rows per DP rank {per}")
        if rows and expected % rows == 0:
            causes.append(f"1/{expected // rows} of the global batch recorded")
        elif rows % expected == 0:
            causes.append(f"{rows // expected}x the global batch recorded (replicas counted as DP ranks?)")
        res.failed.append({"step": step, "rows": rows, "expected": expected, "causes": causes})
    if not res.steps:
        res.why = "no step with recorded batches"
        return res
    res.status = "fail" if res.failed else "pass"
    return res
