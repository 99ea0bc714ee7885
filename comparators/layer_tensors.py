"""Layer tensors of two runs (activations forward, their gradients backward), compared row by row.

The rows come from two layer sources: any object with ``array_steps()``, ``array_ranks(step)``,
``layer_rows(step, rank) -> (rows, has_tensors)`` and ``root`` (``sources.layers.LayerSource``; a run store
or an msprobe dump opens as one with ``sources.layers.layer_source(path_or_run)``). Rows pair by module name
through the mapping, each pair is judged against the coarsest dtype computed at or upstream of it
(``judged_dtypes``), the pairs are compared as work items (comparators.tensor_dispatch), and ``summarise``
turns them into the findings: the first departing layer, forward then backward.
"""

from __future__ import annotations

import math
from typing import Any

from comparators import noise_floor as nf
from comparators.tensor_dispatch import run_tasks
from comparators.tensor_metrics import Readers
from comparators.tensor_pair import direction_of, tolerance
from core.dtypes import EPS, coarsest, normalize
from core.findings import Finding, StageResult

STAGE = "layer_tensors"
Rows = tuple[list[dict[str, Any]], bool]    # one side's rows of a step and rank, and whether tensors are stored
# Row kinds one dumper records and the other may not (the MindSpore dumper records outputs and output
# gradients only): with ``one_sided_kinds=ONE_SIDED_KINDS``, rows of such a kind with no counterpart at all
# are reported, not judged.
ONE_SIDED_KINDS = ("forward.input", "backward.grad_input")


def _source(obj: Any) -> Any:
    """``obj`` when it is a layer source; a path or a run must be opened first (the comparators read no files
    of their own kind: the sources layer knows them all)."""
    if not callable(getattr(obj, "layer_rows", None)):
        raise TypeError(f"{obj!r} is not a layer source: open it with sources.layers.layer_source(...)")
    return obj


def _pair_rows(rows_a: list[dict[str, Any]], rows_b: list[dict[str, Any]], m: Any
               ) -> tuple[list[tuple[dict[str, Any], dict[str, Any]]], list[str], bool]:
    """Pair rows by (module through the mapping, kind, occurrence of that pair in execution order)."""
    mods_b = {r["module"] for r in rows_b}
    same_scheme = sum(r["module"] in mods_b for r in rows_a) >= len({r["module"] for r in rows_a}) / 2

    def key(mod: str, kind: str, seen: dict[tuple[str, str], int]) -> tuple[str, str, int]:
        k = (mod, kind)
        seen[k] = seen.get(k, 0) + 1
        return mod, kind, seen[k]

    seen_b: dict[tuple[str, str], int] = {}
    index_b = {key(r["module"], r["kind"], seen_b): r for r in rows_b}
    seen_a: dict[tuple[str, str], int] = {}
    pairs, unmatched = [], []
    for r in rows_a:
        target = r["module"] if same_scheme else m.map_module(r["module"], "baseline")
        kb = key(r["module"], r["kind"], seen_a)
        rb = index_b.get((target, r["kind"], kb[2])) if target else None
        if rb is not None and r.get("token_group", 1) != rb.get("token_group", 1):
            rb = None   # an expert's tokens from EP groups of different sizes: other tokens (docs/layouts.md)
        if rb is None:
            unmatched.append(r["module"] + " " + r["kind"])
        else:
            pairs.append((r, rb))
    return pairs, unmatched, same_scheme


def _token_group(rows: list[dict[str, Any]]) -> int:
    return max((int(r.get("token_group", 1)) for r in rows if ".local_experts." in r["module"]), default=0)


def match_token_groups(src_a: Any, src_b: Any, step: int, rows_a: list[dict[str, Any]],
                       rows_b: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str | None]:
    """Both sides' rows with their experts' rows holding the same tokens: when the two runs' EP sizes differ,
    the side whose experts saw fewer DP ranks' tokens has each expert's rows joined over as many DP ranks as
    the other's (``expert_rows`` of a gathered run store, sources.layers). Returns the rows and a note (None
    when nothing was joined: same EP size, or the side cannot join them and its expert rows stay unpaired)."""
    ga, gb = _token_group(rows_a), _token_group(rows_b)
    if not ga or not gb or ga == gb:
        return rows_a, rows_b, None
    small, big, rows = (src_a, gb, rows_a) if ga < gb else (src_b, ga, rows_b)
    join = getattr(small, "expert_rows", None)
    got = join(step, big) if callable(join) else None
    if not got:
        return rows_a, rows_b, None
    seen: dict[tuple[str, str], int] = {}
    out = []
    for r in rows:
        k = (r["module"], r["kind"])
        seen[k] = seen.get(k, 0) + 1
        out.append(got.get((r["module"], r["kind"], seen[k]), r))
    side = "baseline" if ga < gb else "candidate"
    note = (f"{len(got)} expert rows of the {side} (tokens of {min(ga, gb)} DP rank(s) per expert) joined over "
            f"{big} DP ranks to hold the other run's EP group's tokens")
    return (out, rows_b, note) if ga < gb else (rows_a, out, note)


def plan_layer_tasks(baseline: Any, candidate: Any, mapping: Any = None, *, step: int = 1, rank: int = 0,
                     candidate_rank: int | None = None, stats_only: bool = False,
                     tolerances: dict[str, tuple[float, float, float]] | None = None,
                     readers: Readers | None = None, rows: tuple[Rows, Rows] | None = None) -> dict[str, Any]:
    """Pair the rows of one step and rank: the work items (one per tensor pair) and what was left out.
    ``rows``: both sides' ``layer_rows`` of this step and rank when the caller has read them already."""
    from mapping import Mapping
    from models import load_mapping

    m = mapping if isinstance(mapping, Mapping) else load_mapping(mapping)
    src_a, src_b = _source(baseline), _source(candidate)
    (rows_a, tens_a), (rows_b, tens_b) = rows or (
        src_a.layer_rows(step, rank), src_b.layer_rows(step, rank if candidate_rank is None else candidate_rank))
    plan: dict[str, Any] = {"step": step, "rank": rank, "tasks": [], "rows_a": len(rows_a), "rows_b": len(rows_b),
                            "unmatched": [], "full": False,
                            "missing": [str(getattr(s, "root", "?")) for s, r in ((src_a, rows_a), (src_b, rows_b))
                                        if not r]}
    if not rows_a or not rows_b:
        return plan
    rows_a, rows_b, joined = match_token_groups(src_a, src_b, step, rows_a, rows_b)
    if joined:
        plan["experts_joined"] = joined
    pairs, unmatched, same_scheme = _pair_rows(rows_a, rows_b, m)
    transpose = (not same_scheme and m.activation_layout.get("baseline") == "sbh"
                 and m.activation_layout.get("candidate") == "bsh")
    full = bool(tens_a and tens_b and not stats_only)
    plan.update(unmatched=unmatched, full=full,
                tasks=[{"a": ra, "b": rb, "full": full, "transpose": transpose, "tolerances": tolerances,
                        "readers": readers, "step": step, "rank": rank, "judged_dtype": judged}
                       for (ra, rb), judged in zip(pairs, judged_dtypes(pairs), strict=True)])
    return plan


def judged_dtypes(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[str]:
    """The dtype whose noise each row pair is judged against: the coarsest computed at or upstream of it.

    Why: a tensor is no more precise than the least precise computation it went through. MindFormers'
    flash-attention path casts q/k/v to float16 even in a float32 run, so every row after the first
    float16 attention output carries float16 rounding, while the rows before it (embedding, first norm)
    must still meet float32's line, or a float16 embedding hides under attention's noise. Forward rows
    look at forward rows up to themselves (either side's dtype); backward rows at the whole forward and
    the backward rows up to themselves.
    """
    out: list[str] = []
    fwd: list[str] = []          # the coarsest floating dtype of the forward rows so far (kept, not re-scanned)
    bwd: list[str] = []          # and of the backward rows
    for ra, rb in pairs:
        here = [d for d in (normalize(ra.get("dtype", "float32")), normalize(rb.get("dtype", "float32")))
                if d in EPS]
        if direction_of(ra["kind"]) == "forward":
            fwd = [coarsest(fwd + here)] if fwd or here else []
            out.append(coarsest(fwd))
        else:
            bwd = [coarsest(bwd + here)] if bwd or here else []
            out.append(coarsest(fwd + bwd))
    return out


def compare_layer_tensors(baseline: Any, candidate: Any, mapping: Any = None, *, step: int = 1,
                          rank: int = 0, candidate_rank: int | None = None, stats_only: bool = False,
                          threads: int = 2, tolerances: dict[str, tuple[float, float, float]] | None = None,
                          jobs: int | None = None, scheduler: Any = None, executor: str = "thread",
                          readers: Readers | None = None, rows: tuple[Rows, Rows] | None = None,
                          one_sided_kinds: tuple[str, ...] = (), repeat: Any = None,
                          repeat_rank: int | None = None, no_floor: str | None = None) -> StageResult:
    """Compare layer tensors of ``step``; names the first departing layer, forward then backward.

    ``baseline`` / ``candidate``: layer sources (``sources.layers.layer_source`` opens a run store or an
    msprobe dump from its path or Run). Rows pair by module name through the mapping (same-scheme runs pair
    by identical names), the row kind (``forward.output.0`` ...) and the occurrence count of that (module,
    kind) in execution order. ``jobs`` parallel readers (``executor`` "thread" or "process"; default
    ``threads``), or ``scheduler``: a Dask scheduler address. ``readers``: suffix -> loader for tensor files
    numpy cannot stream (msprobe's .pt: pass ``checkpoints.torch_tensors.READERS``); without one those rows
    compare by statistics. ``rows``: both sides' rows of this step and rank, already read by the caller.
    ``one_sided_kinds``: row kinds (prefixes) one side may not record at all; when every unmatched baseline
    row is of them, they are noted in ``details["note"]``, not judged.
    ``repeat``: the baseline's repeat as a layer source (its rows of ``step`` at ``repeat_rank``): each row is
    also judged against its noise floor, the same compare of the baseline against the repeat
    (:func:`apply_floors`); ``no_floor``: why there is no repeat to measure it on (the rows say so).
    """
    plan = plan_layer_tasks(baseline, candidate, mapping, step=step, rank=rank, candidate_rank=candidate_rank,
                            stats_only=stats_only, tolerances=tolerances, readers=readers, rows=rows)
    rows_out = run_tasks(plan["tasks"], jobs or threads, scheduler, executor)
    if repeat is not None or no_floor is not None:
        floor_rows = None
        label = str(getattr(repeat, "root", repeat)).rstrip("/").rsplit("/", 1)[-1]
        if repeat is not None and plan["tasks"]:
            fplan = plan_layer_tasks(baseline, repeat, mapping, step=step, rank=rank, candidate_rank=repeat_rank,
                                     stats_only=not plan["full"], tolerances=tolerances, readers=readers)
            floor_rows = run_tasks(fplan["tasks"], jobs or threads, scheduler, executor)
        judged = apply_floors(rows_out, floor_rows, f"repeat {label} vs baseline, step {step}",
                              no_floor or f"the repeat {label} has no layer rows at step {step}", tolerances)
        res = summarise(plan, rows_out, one_sided_kinds)
        if judged:
            res.details["power"] = nf.power(judged, "layer rows")
            if "noise_floor" in res.details:
                res.details["noise_floor"].update(pass_ratio=judged[0].pass_ratio, fail_ratio=judged[0].fail_ratio)
            for f in res.findings:
                if f.metric == "rows_within_tolerance" and f.verdict == "pass":
                    f.message += "; " + res.details["power"]["text"]
        return res
    return summarise(plan, rows_out, one_sided_kinds)


def apply_floors(rows_out: list[dict[str, Any]], floor_rows: list[dict[str, Any]] | None, what: str,
                 no_floor: str, tolerances: dict[str, tuple[float, float, float]] | None = None
                 ) -> list[nf.Judgement]:
    """Judge each compared row against its noise floor too (comparators.noise_floor), in place; returns the
    judgements. Every row is judged at once, so the floor's lines grow with their number (noise_floor.ratios).

    ``floor_rows``: the same compare of the baseline against its repeat (same mode: statistics or tensors).
    A row's own floor is the repeat row of the same module, kind and occurrence with the baseline's shape (a
    tensor-parallel repeat holds shards of another shape for some rows: those take their group's spread); the
    group is (direction, judged dtype). Without floor rows every row keeps its dtype verdict and says why."""
    def key(r: dict[str, Any]) -> tuple[str, str, int]:
        return r["module"], r["kind"], int(r["order"])

    own: dict[tuple[str, str, int], float | None] = {}
    if floor_rows:
        by_key = {key(f): f for f in floor_rows}
        for r in rows_out:
            f = by_key.get(key(r))
            same = f is not None and f.get("mode") == r.get("mode") and \
                str(f.get("shape")) == str(f.get("candidate_shape")) and math.isfinite(float(f["value"]))
            own[key(r)] = float(f["value"]) if same else None
    groups = {key(r): (r["direction"], r.get("judged_dtype", "float32")) for r in rows_out}
    floors = nf.group_floors(own, groups, what, no_repeat=None if floor_rows else no_floor)
    out = []
    for r in rows_out:
        tol = tolerance(r.get("judged_dtype") or r.get("dtype", "float32"), tolerances)
        j = nf.judge(float(r["value"]), floors[key(r)], (tol[0], tol[1]), judged=len(rows_out))
        out.append(j)
        r.update(j.columns(), verdict=nf.worst(r["verdict"], j.verdict),
                 threshold=j.threshold if j.ratio is not None else r["threshold"])
    return out


def compare_layer_tensors_all(baseline: Any, candidate: Any, mapping: Any = None, *,
                              steps: list[int] | None = None, ranks: list[int] | None = None,
                              stats_only: bool = False, jobs: int = 1, scheduler: Any = None,
                              executor: str = "thread",
                              tolerances: dict[str, tuple[float, float, float]] | None = None,
                              readers: Readers | None = None,
                              one_sided_kinds: tuple[str, ...] = ()) -> dict[tuple[int, int], StageResult]:
    """Every (step, rank) both sides hold, as one flat list of work items (step x rank x tensor): the shape
    of work a cluster spreads best. Returns {(step, rank): StageResult}, each equal to compare_layer_tensors."""
    src_a, src_b = _source(baseline), _source(candidate)
    steps = steps or [s for s in src_a.array_steps() if s in set(src_b.array_steps())]
    plans = []
    for st in steps:
        for rk in (ranks or [r for r in src_a.array_ranks(st) if r in set(src_b.array_ranks(st))]):
            plans.append(plan_layer_tasks(src_a, src_b, mapping, step=st, rank=rk, stats_only=stats_only,
                                          tolerances=tolerances, readers=readers))
    flat = [t for p in plans for t in p["tasks"]]
    done = run_tasks(flat, jobs, scheduler, executor)
    out, i = {}, 0
    for p in plans:
        n = len(p["tasks"])
        out[(p["step"], p["rank"])] = summarise(p, done[i:i + n], one_sided_kinds)
        i += n
    return out


def summarise(plan: dict[str, Any], rows_out: list[dict[str, Any]], one_sided_kinds: tuple[str, ...] = ()
              ) -> StageResult:
    """Findings of one step and rank from its compared rows (first departure forward, then backward).
    Unmatched baseline rows are a warning, unless every one is of a kind in ``one_sided_kinds`` (a kind one
    side records and the other does not): then a note says so and nothing is judged on them."""
    res = StageResult(STAGE)
    step, rank = plan["step"], plan["rank"]
    if plan["missing"]:
        res.details = {"reason": "no tensor rows (tensor_stats table / dump.json data) in "
                                 + ", ".join(plan["missing"])}
        return res
    unmatched, full = plan["unmatched"], plan["full"]
    first = {}
    for direction in ("forward", "backward"):
        for r in rows_out:
            if r["direction"] == direction and r["verdict"] != "pass":
                first[direction] = r
                break
    for direction in ("forward", "backward"):
        r = first.get(direction)
        if r is None:
            continue
        where = f"layer {r['layer']}, " if r["layer"] is not None else ""
        if direction == "backward" and "forward" in first:
            where = "(after the forward departure, expected) " + where
        verdict, grows = r["verdict"], ""
        later = _first_failing_after(rows_out, r) if verdict == "warn" and r["mode"] == "stats" else None
        if later is not None:
            # Statistics under-state a difference (a norm or an extreme can barely move while the tensor does):
            # a statistics departure that grows into a failing row downstream fails where it starts.
            verdict = "fail"
            grows = (f"; grows to fail at {later['module']} {later['kind']} "
                     f"({later['metric']} {later['value']:.3g})")
        res.add(Finding(STAGE, verdict, r["module"], r["metric"], r["value"], r["threshold"],
                        f"first departing {direction} tensor: {where}{r['module']} {r['kind']} "
                        f"({r['mode']} compare, {_judged(r)}: {r['metric']} {r['value']:.3g} > {r['threshold']:.3g}"
                        f"{_floor_words(r)}){grows}"))
    one_sided = bool(unmatched) and bool(one_sided_kinds) and \
        all(u.split(" ")[-1].startswith(one_sided_kinds) for u in unmatched)
    if unmatched and not one_sided:
        res.add(Finding(STAGE, "warn", unmatched[0].split(" ")[0], "unmatched_rows", len(unmatched), 0,
                        f"{len(unmatched)} baseline tensor rows have no counterpart (first: {unmatched[0]}); "
                        "not compared"))
    unread = [r for r in rows_out if r.get("tensor_unread", "").startswith("no reader")]
    if unread:
        res.add(Finding(STAGE, "warn", unread[0]["module"], "tensor_files_unread", len(unread), 0,
                        f"{len(unread)} rows compared by statistics only: {unread[0]['tensor_unread']} "
                        "(msprobe .pt needs torch: readers=checkpoints.torch_tensors.READERS)"))
    extra_b = plan["rows_b"] - len(rows_out)
    if not first and rows_out:
        ratios = [r["ratio"] for r in rows_out if r.get("ratio") is not None]
        res.add(Finding(STAGE, "pass", None, "rows_within_tolerance", len(rows_out), None,
                        f"all {len(rows_out)} compared tensor rows within their dtype's tolerance"
                        + (f" and {rows_out[0].get('pass_ratio', nf.PASS_RATIO):.3g}x their noise floors "
                           f"({len(ratios)} rows with a floor, worst "
                           f"ratio {max(ratios):.3g})" if ratios else
                           f" ({rows_out[0]['floor_source']})" if rows_out[0].get("floor_source") else "")))
    departing = [r for r in rows_out if r["verdict"] != "pass"]
    res.details = {"step": step, "rank": rank, "compared": len(rows_out),
                   "mode": "tensor" if full else "stats", "departing": len(departing),
                   "first_departing_forward": _brief(first.get("forward")),
                   "first_departing_backward": _brief(first.get("backward")),
                   "first_departing_layer": (first.get("forward") or first.get("backward") or {}).get("layer"),
                   "unmatched_baseline": unmatched, "unmatched_candidate_rows": extra_b,
                   **({"experts_joined": plan["experts_joined"]} if plan.get("experts_joined") else {}),
                   "rows": rows_out, "per_layer": _per_layer(rows_out)}
    if any("floor_source" in r for r in rows_out):
        with_floor = [r["ratio"] for r in rows_out if r.get("ratio") is not None]
        res.details["noise_floor"] = {"with_floor": len(with_floor), "without_floor": len(rows_out) - len(with_floor),
                                      "worst_ratio": max(with_floor, default=None),
                                      "decided_by_floor": sum(r.get("decided_by") == "floor" for r in rows_out),
                                      "pass_ratio": nf.PASS_RATIO, "fail_ratio": nf.FAIL_RATIO}
    if one_sided:
        res.details["note"] = (f"{len(unmatched)} baseline rows (module inputs / input gradients) have no "
                               "counterpart kind in the candidate's dump; outputs and output gradients are compared")
    return res


def _first_failing_after(rows: list[dict[str, Any]], r: dict[str, Any]) -> dict[str, Any] | None:
    """The first failing row of ``r``'s direction from ``r`` on (rows are in execution order)."""
    seen = False
    for x in rows:
        seen = seen or x is r
        if seen and x["direction"] == r["direction"] and x["verdict"] == "fail":
            return x
    return None


def _floor_words(r: dict[str, Any]) -> str:
    if r.get("ratio") is None:
        return f"; {r['floor_source']}" if r.get("floor_source") else ""
    return f"; {r['ratio']:.3g}x its noise floor {r['floor']:.3g}, {r['floor_source']}"


def _judged(r: dict[str, Any]) -> str:
    d, j = normalize(r["dtype"]), r.get("judged_dtype", normalize(r["dtype"]))
    return d if j == d else f"{d} judged as {j}, computed upstream"


def _brief(r: dict[str, Any] | None) -> dict[str, Any] | None:
    if r is None:
        return None
    return {k: r[k] for k in ("module", "kind", "layer", "order", "metric", "value", "threshold", "mode")}


def _per_layer(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The per-layer error profile: worst metric value per (direction, layer)."""
    acc: dict[tuple[str, Any], dict[str, Any]] = {}
    for r in rows:
        k = (r["direction"], r["layer"])
        a = acc.setdefault(k, {"direction": r["direction"], "layer": r["layer"], "worst": 0.0, "rows": 0})
        a["rows"] += 1
        v = r["value"] if math.isfinite(r["value"]) else math.inf
        a["worst"] = max(a["worst"], v)
    return sorted(acc.values(), key=lambda a: (a["direction"] != "forward", a["layer"] is None,
                                               a["layer"] if a["layer"] is not None else 0))
