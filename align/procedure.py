"""The comparison procedure: load the runs, run every stage that has data, write the report."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from align.core.errors import BadInput
from align.core.findings import StageResult, skipped
from align.core.run import Run
from align.sources import detect, load_run
from comparators.scalars import ScalarOptions, compare_scalars
from reports.writer import ReportInput, write_report


def _size(path: str) -> str:
    p = Path(path)
    if p.is_file():
        n = p.stat().st_size
        for unit in ("B", "KB", "MB", "GB"):
            if n < 1024 or unit == "GB":
                return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
            n /= 1024
    return "dir"


def load_runs(baseline: str, candidate: str, repeats: list[str],
              progress: Callable[[str], None] | None = None) -> tuple[Run, Run, list[Run]]:
    """Load every source before anything is written: bad input stops here with one line."""
    items = [("baseline", baseline), ("candidate", candidate)] + [(f"repeat {i + 1}", r)
                                                                   for i, r in enumerate(repeats)]
    kinds = {role: detect(p) for role, p in items}
    loaded = []
    for role, path in items:
        t = time.perf_counter()
        run = load_run(path, kinds[role])
        if progress:
            n = len(run.steps)
            progress(f"{role}: {path} ({kinds[role]}, {_size(path)}): {n} steps in "
                     f"{time.perf_counter() - t:.2f} s")
        loaded.append(run)
    return loaded[0], loaded[1], loaded[2:]


def local_norm_stage(baseline: Run, candidate: Run, mapping: str | None) -> StageResult:
    """Step-1 local norms through the name mapping, when both runs recorded named norms."""
    missing = [r.label for r in (baseline, candidate) if not r.local_norm_steps(limit=1)]
    if missing:
        return skipped("step1_local_norm", f"no local norms in {', '.join(missing)}")
    unnamed = [r.label for r in (baseline, candidate) if r.store is None and _unnamed_norms(r)]
    if unnamed:
        return skipped("step1_local_norm", f"local norms in {', '.join(unnamed)} are unnamed (log import, "
                       "optimizer order); dump them with the MindSpore/Megatron dumper, or log them named "
                       "with MindFormers' monitor_config (local_norm_format: log), to compare by name")
    from comparators.local_norms import compare_local_norms
    steps = sorted(set(baseline.local_norm_steps(limit=20)) & set(candidate.local_norm_steps(limit=20)))
    if not steps:
        return skipped("step1_local_norm", "the runs recorded local norms at different steps")
    return compare_local_norms(baseline.store if baseline.store is not None else baseline,
                               candidate.store if candidate.store is not None else candidate, mapping, step=steps[0])


def _unnamed_norms(run: Run) -> bool:
    """A log's local norms are unnamed when they came from MFLossMonitor's index-only blocks (``#i``)."""
    steps = run.local_norm_steps(limit=1)
    table = run.local_norm_table(steps[0]) if steps else None
    return table is None or any(str(n).startswith("#") for n in table["name"])


STAGE_ORDER = ["checklist", "data_checks", "step1_loss", "step1_local_norm", "layer_tensors", "step2_loss",
               "optimizer", "lr0_run", "long_run", "grad_norm", "lr_schedule", "nonfinite"]


def report(baseline: str, candidate: str, out: str, repeats: list[str] | None = None,
           options: ScalarOptions | None = None, mapping: str | None = None,
           progress: Callable[[str], None] | None = None,
           extra_stages: dict[str, StageResult] | None = None,
           extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Compare and write the report. ``extra_stages`` (checklist, layer tensors, optimizer, ...) come from
    callers that ran more of the procedure (``align demo``); ``extra`` holds ReportInput's extra_figures /
    extra_sections / extra_tables."""
    t0 = time.perf_counter()
    b, c, reps = load_runs(baseline, candidate, repeats or [], progress)
    if not b.has("loss") and not b.local_norm_steps(limit=1):
        raise BadInput(f"{baseline}: no loss values and no local norms to compare")
    if not c.has("loss") and not c.local_norm_steps(limit=1):
        raise BadInput(f"{candidate}: no loss values and no local norms to compare")
    cmp = compare_scalars(b, c, reps, options)
    stages = dict(cmp.stages)
    stages["step1_local_norm"] = local_norm_stage(b, c, mapping)
    stages.update(extra_stages or {})
    stages = {k: stages[k] for k in STAGE_ORDER if k in stages} | {k: v for k, v in stages.items()
                                                                   if k not in STAGE_ORDER}
    runs = [{"role": role, "path": r.path, "kind": r.kind, "steps": len(r.steps), "notes": r.notes}
            for role, r in [("baseline", b), ("candidate", c)] + [(f"repeat{i + 1}", r)
                                                                  for i, r in enumerate(reps)]]
    if progress:
        progress(f"compared in {time.perf_counter() - t0:.2f} s; writing {out}")
    data = write_report(ReportInput(runs, stages, cmp.table, **(extra or {})), out)
    if progress:
        progress(f"done in {time.perf_counter() - t0:.2f} s")
    return data


def stderr_progress(msg: str) -> None:
    print(f"align: {msg}", file=sys.stderr, flush=True)
