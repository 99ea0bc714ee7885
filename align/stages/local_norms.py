"""Step-1 local norms (backward): every parameter's gradient norm, by name, through the mapping, each judged
against its noise floor (the baseline's repeat at the same step, comparators.noise_floor) under the dtype line."""

from __future__ import annotations

from align.stages import LONG_RUN, Figure, FigureContext, Stage
from align.stages.evidence import Evidence
from align.stages.evidence_totals import untrusted
from comparators.local_norms import compare_local_norms
from core.findings import StageResult, skipped
from reports.figures import local_norm_chart
from reports.html import table
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
    why = untrusted(ev, step, "step reader")
    if why:
        return skipped("step1_local_norm", why)
    dtype, source = ev.dtype
    res = compare_local_norms(b.store if b.store is not None else b, c.store if c.store is not None else c,
                              ev.mapping, step=step, dtype=dtype,
                              rtol=ev.options.local_norm_rtol,
                              repeats=[r.store if r.store is not None else r for r in ev.repeats
                                       if r.local_norm_steps(limit=SEARCH)])
    res.details.update(dtype_source=source, mapping=ev.mapping, mapping_source=ev.mapping_source)
    return res


FLOOR_COLUMNS = ("name", "rel_diff", "ratio", "floor", "verdict", "decided_by", "floor_source")


def section(res: StageResult) -> str:
    """Every parameter's relative difference, its ratio to its noise floor and where the floor came from."""
    rows = res.details.get("parameters") or []
    return table([{k: r.get(k) for k in FLOOR_COLUMNS} for r in rows])


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
    run=run, section=section, figures=figures, figure_order=3, summary_keys=(),
    part="step 1 and 2", explains=("step2_loss", "lr0_run", *LONG_RUN),
    why=("Same weights and batch, and this parameter's gradient differs at step 1: the backward pass (or a "
         "loss scale, or a reduction over ranks) differs for it; a forward departure would show in the layer "
         "profile."),
    next=("align isolate {baseline} --candidate-yaml {candidate_yaml} --candidate-ckpt CANDIDATE_STEP1.safetensors "
          "--modules '{layer}' --modules '{layer}.*' --out isolation_run, the baseline holding a module backward "
          "capture of step 1 (dumpers.torch_module_backward): whether {module}'s own gradient departs; or capture "
          "layer tensors at step 1 on both sides (DumpConfig(tensor_steps=[1], modules=[...])) and run align report "
          "again: the layer profile names the first module whose output or gradient departs ({component})"))
