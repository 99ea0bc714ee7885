"""Named norms over the whole run: every parameter's gradient norm (and parameter / update norm, where the
stores hold them) at every common step, each against its own band from the baseline's repeat(s)."""

from __future__ import annotations

import os
import time
from typing import Any

from align.stages import Figure, FigureContext, Stage
from align.stages.evidence import Evidence
from align.stages.evidence_totals import untrusted
from comparators.local_norms import RTOL
from comparators.trajectories import (
    KINDS,
    TrajectoryOptions,
    TrajectoryResult,
    compare_trajectories,
    norm_groups,
    read_trajectory,
)
from comparators.trajectories import STAGE as NAME
from core.findings import StageResult, skipped
from reports import figures as figs
from reports.html import table


def _kinds(ev: Evidence) -> tuple[list[str], list[str]]:
    """(kinds both runs hold, labels of runs that hold none)."""
    have = {role: norm_groups(r) for role, r in (("baseline", ev.baseline), ("candidate", ev.candidate))}
    lacking = [r.label for role, r in (("baseline", ev.baseline), ("candidate", ev.candidate)) if not have[role]]
    return [k for k in have["baseline"] if k in have["candidate"]], lacking


def run(ev: Evidence) -> StageResult:
    kinds, lacking = _kinds(ev)
    if lacking:
        return skipped(NAME, f"no named per-parameter norms in {', '.join(lacking)}")
    if not kinds:
        return skipped(NAME, "the runs hold different kinds of named norms")
    whats = " and ".join(f"{KINDS[k]}s" for k in kinds)
    if not ev.repeats:
        return skipped(NAME, f"both runs hold named {whats}, but there is no repeat of the baseline "
                              "(--repeat): a parameter's trajectory has no band to be judged against")
    repeats = {k: [r for r in ev.repeats if k in norm_groups(r)] for k in kinds}
    kinds = [k for k in kinds if repeats[k]]
    if not kinds:
        return skipped(NAME, f"the repeat(s) {', '.join(r.label for r in ev.repeats)} hold no named {whats}: "
                              "record them in the repeat too")
    why = untrusted(ev)
    if why:
        return skipped(NAME, why)
    dtype, source = ev.dtype
    rtol = (ev.options.local_norm_rtol or RTOL.get(dtype, RTOL["float32"]))[0]
    sc = ev.options.scalar
    opt = TrajectoryOptions(band_k=sc.band_k, band_window=sc.band_window, band_floor_ulps=sc.band_floor_ulps,
                            sustain=sc.sustain, max_outside=sc.max_outside, rtol=rtol,
                            fail_rate=sc.fail_rate, warn_rate=sc.warn_rate)
    from models import load_mapping
    mapping = load_mapping(ev.mapping)
    out = TrajectoryResult(NAME, details={"dtype": dtype, "dtype_source": source, "mapping": ev.mapping,
                                           "kinds": {}, "first_departure": None})
    for kind in kinds:
        t0 = time.perf_counter()
        jobs = ev.options.jobs or os.cpu_count() or 1      # forked step-file readers, where safe
        if kind == "local_norm":     # read once for the self-check (evidence_totals) and kept
            b, c = ev.norm_trajectory("baseline"), ev.norm_trajectory("candidate")
        else:
            b, c = read_trajectory(ev.baseline, kind, jobs=jobs), read_trajectory(ev.candidate, kind, jobs=jobs)
        reps = [t for t in (read_trajectory(r, kind, jobs=jobs) for r in repeats[kind]) if t is not None]
        t1 = time.perf_counter()
        if b is None or c is None or not reps:
            continue
        res = compare_trajectories(b, c, reps, mapping, opt, kind)
        files = b.files + c.files + sum(t.files for t in reps)
        res.details["seconds"] = {"read": round(t1 - t0, 3), "compare": round(time.perf_counter() - t1, 3),
                                  "files_read": files}
        out.details["kinds"][kind] = res.details
        for f in res.findings:
            out.add(f)
        if res.curves:
            out.curves.append({"kind": kind, "what": KINDS[kind], "verdict": res.verdict, "curves": res.curves})
        first = res.details.get("first_departure")
        best = out.details["first_departure"]
        if first and (best is None or first["departure_step"] < best["departure_step"]):
            out.details["first_departure"] = {**first, "norm_kind": kind}
    main = out.details["kinds"].get("local_norm") or next(iter(out.details["kinds"].values()), None)
    if main is None or main.get("reason"):
        return skipped(NAME, (main or {}).get("reason") or "no named norms at a step both runs recorded")
    out.details.update(steps=main["steps"], parameters=main["parameters"], repeats=len(ev.repeats),
                       power=main.get("power"))
    return out


def section(res: StageResult) -> str:
    parts = []
    for d in res.details.get("kinds", {}).values():
        rows = [{"parameter": w["name"], "leaves at step": w["departure_step"],
                 "outside": f"{w['outside_fraction']:.1%}", "largest / band": w["max_ratio"],
                 "at step": w["max_ratio_step"]} for w in d.get("worst", [])[:10]]
        if rows:
            parts.append(f"<p>{d['what']}s of {d['judged']} parameters over {d['steps']} steps "
                         f"({d['first_step']}-{d['last_step']}), {d['band']}:</p>" + table(rows))
    return "".join(parts)


def figures(res: StageResult, ctx: FigureContext) -> list[Figure]:
    out = []
    for item in getattr(res, "curves", []):
        def draw(p: Any, item: dict[str, Any] = item) -> bytes | None:
            return figs.norm_trajectories(item["curves"], item["what"], item["verdict"], p)
        out.append(Figure(f"Per-parameter {item['what']}s over the run", f"{item['kind']}_trajectories.png", draw))
    return out


STAGE = Stage(
    name=NAME, order=122, title="Named norms over the whole run (parameter trajectories)",
    needs="named per-parameter norms (local_norm; param_norm / update_norm where recorded) at the same steps "
          "in the baseline, the candidate and at least one repeat of the baseline",
    capture="the dumpers record named gradient norms every step (MegatronDumper / MindSporeDumper, or "
            "MindFormers' monitor_config local_norm_format: [log]); run the baseline again without determinism "
            "(or with another TP layout) with the dumper on and pass it with --repeat",
    run=run, section=section, figures=figures, figure_order=5,
    summary_keys=("steps", "parameters", "first_departure"),
    part="long run", explains=("long_run", "grad_norm", "spikes", "divergence_data"),
    why=("This parameter's gradient norm leaves its band first over the run: the drift starts in it."),
    next=("capture layer tensors on both sides at the step named and run align report again; compare "
          "{component}'s precision and its optimizer settings"))
