"""The procedure: load the evidence, run every stage of the registry in the guide's order, write the report.

`align report` (the user's runs) and `align demo` (the runs the demo makes) both end here, so a stage
computed for one is computed for the other.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from align.procedure.diagnosis import coverage, diagnose
from align.stages import Evidence, FigureContext, Inputs, registry, run_stages
from comparators.scalars import require_common_steps
from core.errors import BadInput
from reports.writer import ReportInput, overall_verdict, write_report


def check_comparable(ev: Evidence) -> None:
    """Refuse runs that cannot be compared at all, with one line: no loss, no local norms and no layer
    tensors, or two runs with no step in common (a pass there would be a lie). Whether a run holds layer
    tensors only (an msprobe dump) is its source kind's to say (sources.layers)."""
    from sources.layers import layers_only

    b, c = ev.baseline, ev.candidate
    tensors_only = [layers_only(r) for r in (b, c)]
    if all(tensors_only):
        return
    if any(tensors_only):
        r, path = (b, ev.inputs.baseline) if tensors_only[0] else (c, ev.inputs.candidate)
        other = ev.inputs.candidate if tensors_only[0] else ev.inputs.baseline
        raise BadInput(f"{path}: an {r.kind} dump holds layer tensors only, and {other} holds the run's scalars: "
                       "compare two layer-tensor dumps, or give the run store the dump belongs to (the MindFormers "
                       "callback's kernel_dump records it in the store's meta.json)")
    for r, path in ((b, ev.inputs.baseline), (c, ev.inputs.candidate)):
        if not r.has("loss") and not r.local_norm_steps(limit=1):
            raise BadInput(f"{path}: no loss values and no local norms to compare")
    require_common_steps(b, c)


def report(inputs: Inputs, out: str, progress: Callable[[str], None] | None = None,
           preface: list[tuple[str, str]] | None = None) -> dict[str, Any]:
    """Compare and write ``out/report.html`` and ``out/summary.json``; returns summary.json's content.

    ``preface``: (title, html) sections shown before the stages' own (the demo describes its pair there).
    """
    from core.outputs import check_out_dir

    check_out_dir(out, inputs.run_paths())   # an --out that cannot be written (or is an input): before any loading
    t0 = time.perf_counter()
    ev = Evidence.load(inputs, progress)
    check_comparable(ev)
    if progress:
        progress(f"mapping: {ev.mapping} ({ev.mapping_source})")
    stages = run_stages(ev)
    runs = [{"role": role, "path": r.path, "kind": r.kind, "steps": len(r.steps), "notes": r.notes}
            for role, r in ev.runs.items()]
    ctx = FigureContext(ev.scalars.table, {r["role"]: f"{r['role']}: {Path(r['path']).name}" for r in runs},
                        stages)
    figures, sections, step_rows, stage_sections = [], list(preface or []), [], {}
    for stage in sorted(registry(), key=lambda s: s.order if s.figure_order is None else s.figure_order):
        res = stages.get(stage.name)
        if res is not None and stage.figures is not None:
            figures += stage.figures(res, ctx)
    for stage in registry():
        res = stages.get(stage.name)
        if res is None or res.verdict == "skipped":
            continue
        if stage.step_row is not None:
            step_rows.append(stage.step_row(res))
        if stage.section is not None:
            stage_sections[stage.name] = stage.section(res) or ""
    contract = {s.name: s.summary_keys for s in registry() if s.summary_keys is not None}
    diagnosis = diagnose(stages, fill={"baseline": inputs.baseline, "candidate": inputs.candidate,
                                       "candidate_yaml": inputs.candidate_config or "CANDIDATE.yaml"})
    if progress:
        progress(f"compared in {time.perf_counter() - t0:.2f} s; writing {out}")
    data = write_report(ReportInput(runs, stages, ev.scalars.table, figures=figures, step_rows=step_rows,
                                    contract=contract, extra_sections=sections, diagnosis=diagnosis,
                                    coverage=coverage(stages, overall_verdict(stages)),
                                    titles={s.name: s.title for s in registry()}, stage_sections=stage_sections),
                        out)
    if progress:
        progress(f"done in {time.perf_counter() - t0:.2f} s")
    return data


def stderr_progress(msg: str) -> None:
    print(f"align: {msg}", file=sys.stderr, flush=True)
