"""Step-1 local norms (backward): every parameter's gradient norm, by name, through the mapping."""

from __future__ import annotations

from align.stages import Figure, FigureContext, Stage
from align.stages.evidence import Evidence
from comparators.local_norms import compare_local_norms
from core.findings import StageResult, skipped
from reports.figures import local_norm_chart
from runstore.run import Run

SEARCH = 20   # steps looked at for the first one both runs recorded local norms at


def _unnamed(run: Run, step: int) -> bool:
    t = run.local_norm_table(step)
    return t is not None and len(t) > 0 and all(str(n).startswith("#") for n in t["name"][:50])


def run(ev: Evidence) -> StageResult:
    b, c = ev.baseline, ev.candidate
    missing = [r.label for r in (b, c) if not r.local_norm_steps(limit=1)]
    if missing:
        return skipped("step1_local_norm", f"no local norms in {', '.join(missing)}")
    steps = sorted(set(b.local_norm_steps(limit=SEARCH)) & set(c.local_norm_steps(limit=SEARCH)))
    if not steps:
        return skipped("step1_local_norm", "the runs recorded local norms at different steps")
    step = steps[0]
    unnamed = [r.label for r in (b, c) if _unnamed(r, step)]
    if unnamed:
        return skipped("step1_local_norm", f"local norms in {', '.join(unnamed)} are unnamed (optimizer order)")
    dtype, source = ev.dtype
    res = compare_local_norms(b.store if b.store is not None else b, c.store if c.store is not None else c,
                              ev.mapping, step=step, dtype=dtype,
                              rtol=ev.options.local_norm_rtol)
    res.details.update(dtype_source=source, mapping=ev.mapping, mapping_source=ev.mapping_source)
    return res


def figures(res: StageResult, ctx: FigureContext) -> list[Figure]:
    params = res.details.get("parameters")
    if not params:
        return []
    rtol = float(res.details.get("rtol", 1e-4))
    return [Figure("Step-1 local norms per parameter", "local_norms.png",
                   lambda p: local_norm_chart(params, rtol, res.verdict, p))]


STAGE = Stage(
    name="step1_local_norm", order=50, title="Step-1 local norms (backward)",
    needs="named per-parameter gradient norms of the same step in both runs",
    capture="MegatronDumper / MindSporeDumper record them every step; from MindFormers alone, "
            "monitor_config: {monitor_on: True, local_norm_format: [log]} logs them by name "
            "(TrainingStateMonitor); MFLossMonitor's unnamed local_norm arrays need the dumper's names",
    run=run, figures=figures, figure_order=3, summary_keys=())
