"""lr = 0 pair: the weights never move, so loss and grad norm must agree at every step to the pair's noise.

Why: it isolates forward/backward over many batches from the optimizer; a gap here that grows with steps
is data, one that is constant is the model. The noise is measured (comparators.noise_floor): the baseline's
repeat (``--repeat``, at the candidate's precision) at step 1 computes the same loss and grad norm from the same
weights on the same batch as the lr = 0 pair's step 1, so its difference from the baseline is the floor each
lr = 0 step is judged against; the dtype line stays an upper bound."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from align.stages import LONG_RUN, Figure, FigureContext, Stage
from align.stages.evidence import Evidence, silent_against
from comparators.noise_floor import Floor, judge, missing, rel_diff, spread
from comparators.noise_floor import power as nf_power
from core.dtypes import EPS
from core.findings import Finding, StageResult, skipped
from reports.figures import lr0_pair
from reports.html import table
from runstore.run import Run

# Relative agreement of the lr=0 pair: (pass up to, warn up to) by compute dtype. float32 across frameworks
# agrees to ~1e-7..1e-6 (measured on the demo pair); low precision keeps 8 (bf16) or 11 (fp16) bits.
RTOL = {"float32": (1e-5, 1e-4), "float64": (1e-8, 1e-6), "float16": (1e-3, 1e-2), "bfloat16": (5e-3, 2e-2)}


def _rel(a: float, b: float) -> float:
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


def step1_floor(ev: Evidence, lr0_baseline: Run, key: str) -> Floor:
    """The floor of ``key`` at lr = 0: how far the repeats' step 1 is from the baseline's (the largest).

    Valid only when the lr = 0 baseline's step 1 is the baseline's (same weights, same batch): checked to a
    few float32 ulps, else the floor is missing."""
    if not ev.repeats:
        return missing("no --repeat run")
    base, l0 = ev.baseline.series(key), lr0_baseline.series(key)
    steps = sorted(set(base.index) & set(l0.index))
    if not steps:
        return missing(f"the baseline and the lr = 0 baseline share no step with {key}")
    s = int(steps[0])
    b = float(base[s])
    if rel_diff(b, float(l0[s])) > 4 * EPS["float32"]:
        return missing(f"the lr = 0 baseline's step {s} {key} {float(l0[s]):.7g} is not the baseline's {b:.7g}: "
                       "not the same weights and batch")
    diffs = [(rel_diff(b, float(r.series(key)[s])), r.label) for r in ev.repeats if s in r.series(key).index]
    if not diffs:
        return missing(f"the repeat has no step-{s} {key}")
    d, label = max(diffs)
    return Floor(d, f"repeat {label} vs baseline at step {s} (same weights and batch as lr = 0 step {s})")


def _per_step(own: dict[int, float], what: str) -> dict[int, Floor]:
    """Each step's floor: its own measured difference or the RMS over all the judged steps, whichever is
    larger (one draw of the noise can come out small by chance; the steps are judged together)."""
    rms = spread(own.values())
    out = {}
    for s, d in own.items():
        if rms is not None and (not math.isfinite(d) or rms > d):
            out[s] = Floor(rms, f"{what}: RMS over {len(own)} steps (its own {d:.2g} is smaller)")
        else:
            out[s] = Floor(d, f"{what}: step {s}")
    return out


def step_floors(ev: Evidence, lr0_baseline: Run, key: str, steps: list[int], repeats: list[Run]
                ) -> dict[int, Floor]:
    """The floor of ``key`` at every judged lr = 0 step, measured over those same steps when there is a repeat
    of the lr = 0 baseline (``--lr0-repeat``; ``repeats``: those that measure noise): its difference from the
    lr = 0 baseline step by step, each step's floor at least the RMS over the steps (one draw of the noise can
    come out small by chance; the steps are judged together). Without one, the long run's repeat at step 1
    (the same weights and batch as lr = 0 step 1) is the floor of every step, and the judged steps' number
    widens the lines (noise_floor.ratios). Its later steps are no floor: after a few Adam updates the repeat's
    own divergence (measured on the dense demo: 1e-6 at step 1, 3e-5 by step 3) would hide a loss computed in
    bfloat16 (4e-4)."""
    reps = [r for r in repeats if r.has(key)]
    if reps:
        lb = lr0_baseline.series(key)
        own: dict[int, float] = {}
        for s in steps:
            vals = [rel_diff(float(lb[s]), float(r.series(key)[s])) for r in reps if s in r.series(key).index]
            if vals:
                own[s] = max(vals)
        if own:
            labels = ", ".join(r.label for r in reps)
            floors = _per_step(own, f"lr = 0 repeat {labels} vs lr = 0 baseline from step {steps[0]} to step "
                                    f"{steps[-1]} (the same weights and batches)")
            return {s: floors.get(s, missing(f"the lr = 0 repeat has no step-{s} {key}")) for s in steps}
    first = step1_floor(ev, lr0_baseline, key)
    return {s: first for s in steps}


def run(ev: Evidence) -> StageResult:
    if ev.lr0 is None:
        return skipped("lr0_run", "no lr=0 pair (--lr0 BASELINE CANDIDATE)")
    b, c = ev.lr0
    dtype, source = ev.dtype
    tol = ev.options.lr0_rtol or RTOL.get(dtype, RTOL["float32"])
    res = StageResult("lr0_run")
    common = b.series("loss").index.intersection(c.series("loss").index)
    details: dict[str, Any] = {"steps": len(common), "dtype": dtype, "dtype_source": source, "rtol": tol}
    if not len(common):
        return skipped("lr0_run", "the lr=0 runs logged no loss at a common step")
    powers, measuring = [], []
    for rep in ev.lr0_repeats:   # each lr = 0 repeat judged once: used, or named and set aside
        why = silent_against(b, rep)
        if why is None:
            measuring.append(rep)
        else:
            # a warning when judging falls back to the dtype line; a note when the long run's repeat (which
            # measured noise) gives the floors instead: an upper bound, stated by the power, no false alarm
            res.add(Finding("lr0_run", "pass" if ev.repeats else "warn", rep.path, "repeat_measures_no_noise", 0.0,
                            None, f"lr = 0 repeat {rep.label} is not used: {why}; the lr = 0 floors come from "
                            + ("the long run's repeat at the same steps (an upper bound: a coarser power)"
                               if ev.repeats else "the dtype line (no repeat measured the noise)")))
    for key in ("loss", "grad_norm"):
        sb, sc = b.series(key), c.series(key)
        steps = [int(s) for s in sb.index.intersection(sc.index)]
        if not steps:
            continue
        floors = step_floors(ev, b, key, steps, measuring)
        # every step is judged against its own floor, all at once: the lines grow with their number
        js = {s: judge(_rel(float(sb[s]), float(sc[s])), floors[s], tol, judged=len(steps)) for s in steps}
        worst_rel, worst_step = max((j.value, s) for s, j in js.items())
        order = {"pass": 0, "warn": 1, "fail": 2}
        judged_step = max(steps, key=lambda s: (order[js[s].verdict], js[s].ratio or 0.0, js[s].value))
        j = js[judged_step]
        details[f"max_rel_{key}"] = worst_rel
        details[f"worst_step_{key}"] = worst_step
        details.setdefault("floors", []).append({"quantity": key, "max_rel": j.value, "step": judged_step,
                                                 "verdict": j.verdict, "threshold": j.threshold, **j.columns()})
        pw = nf_power(list(js.values()), f"lr = 0 steps ({key})")
        powers.append((key, pw))
        v = j.verdict
        res.add(Finding("lr0_run", v, key, f"max_rel_{key}", j.value, j.threshold,
                        f"lr=0, {len(steps)} steps: {key} agrees to {worst_rel:.3g} relative at worst (step "
                        f"{worst_step}); judged worst at step {judged_step}: {j.value:.3g}, {j.says()}; {dtype} line "
                        f"passes up to {tol[0]:g}"
                        + (f"; power: {pw['text']}" if v == "pass" else
                           ": the forward/backward differs even without updates")))
    if powers:
        details["power"] = {"detectable": powers[0][1].get("detectable"),
                            "text": "; ".join(f"{k}: {p['text']}" for k, p in powers),
                            **{k: p for k, p in powers}}
    sb, sc = b.series("loss"), c.series("loss")
    details["table"] = [{"step": int(s), "loss_baseline": float(sb[s]), "loss_candidate": float(sc[s])}
                        for s in common]
    res.details.update(details)
    return res


def section(res: StageResult) -> str:
    """Each quantity's worst difference, its ratio to the noise floor and where the floor came from."""
    rows = res.details.get("floors") or []
    return table(rows) if rows else ""


def figures(res: StageResult, ctx: FigureContext) -> list[Figure]:
    rows = res.details.get("table") or []
    if not rows:
        return []

    def draw(path: Path) -> bytes | None:
        png = lr0_pair(rows)
        if png:
            path.write_bytes(png)
        return png

    return [Figure("lr = 0 pair: loss per step and its delta", "lr0_pair.png", draw)]


STAGE = Stage(
    name="lr0_run", order=90, title="lr = 0 pair",
    needs="a baseline and a candidate run with learning rate 0 (loss and grad norm per step)",
    capture="run both sides again with lr 0 (Megatron --lr 0 --min-lr 0; MindFormers lr_schedule "
            "learning_rate: 0) for ~20 steps on the same batches, then --lr0 BASELINE_LR0 CANDIDATE_LR0",
    run=run, section=section, figures=figures,
    part="long run", explains=LONG_RUN,
    why=("With lr = 0 the weights never change, so every step measures the forward and backward again on a new "
         "batch: a difference here is the model's numerics (a precision, the loss), not the optimizer."),
    next=("isolate the loss and the embedding, the modules layer tensors do not cover: capture the baseline's "
          "step with dumpers.torch_module_backward.ModuleBackwardCapture(model, RUN, modules=['embedding', 'loss'], "
          "steps=[N]), then align isolate RUN --candidate-yaml {candidate_yaml} --candidate-ckpt CKPT --out ISO "
          "--modules loss --modules embedding; with layer tensors of both sides at the lr = 0 step with the largest "
          "delta, align report names the first layer that departs"))
