"""One-side spikes of the loss or grad norm (outside the band for a few steps, then back): each reported with
its step's evidence, the batches both runs trained on there and the parameters whose named norms jumped."""

from __future__ import annotations

from typing import Any

import numpy as np

from align.checks.data import BATCH_KEYS, batch_digest
from align.stages import Stage
from align.stages.divergence_data import step_batch
from align.stages.evidence import Evidence
from comparators.scalars import too_many_outside
from comparators.spikes import SPIKE_FACTOR, find_spikes
from comparators.trajectories import norm_groups, norm_jumps, pair_trajectories, read_trajectory
from core.findings import Finding, StageResult, skipped
from reports.html import table
from runstore.run import Run

NAME = "spikes"
PREVIOUS = 5       # recorded steps before a spike its named norms are measured against
JUMP = 1.2         # a norm's jump on one side over the other's from which it is named as jumping
METRICS = (("loss", "", "long_run"), ("grad_norm", "grad_norm_", "grad_norm"))


def _norm_steps(run: Run, peaks: list[int]) -> set[int]:
    """Each peak step and the PREVIOUS steps before it that may hold named norms."""
    have = np.asarray(run.store.array_steps() if run.store is not None else sorted(run.local_norms), dtype=np.int64)
    out: set[int] = set()
    for s in peaks:
        i = int(np.searchsorted(have, s, side="right"))
        out.update(int(x) for x in have[max(0, i - PREVIOUS - 1):i])
    return out


def _jumps(ev: Evidence, peaks: list[int]) -> dict[int, list[dict[str, Any]]]:
    """Per peak step, the parameters whose named gradient norms moved most against the steps before."""
    b, c = ev.baseline, ev.candidate
    if not peaks or "local_norm" not in norm_groups(b) or "local_norm" not in norm_groups(c):
        return {}
    steps = _norm_steps(b, peaks) | _norm_steps(c, peaks)
    tb, tc = read_trajectory(b, "local_norm", steps), read_trajectory(c, "local_norm", steps)
    if tb is None or tc is None:
        return {}
    from models import load_mapping
    paired = pair_trajectories(tb, tc, load_mapping(ev.mapping))
    return {s: norm_jumps(paired, s, PREVIOUS) for s in peaks}


def _batches(ev: Evidence, step: int) -> dict[str, Any]:
    bb, cb = step_batch(ev.baseline, step), step_batch(ev.candidate, step)
    out: dict[str, Any] = {"same_batch": None}
    for role, batch in (("baseline", bb), ("candidate", cb)):
        if batch is not None:
            out[role] = batch_digest(batch)
    if bb is not None and cb is not None:
        out["same_batch"] = all(np.array_equal(np.asarray(bb[k]), np.asarray(cb[k])) for k in BATCH_KEYS
                                if k in bb and k in cb)
    return out


def _message(sp: dict[str, Any], repeats: int) -> str:
    label = "loss" if sp["metric"] == "loss" else "grad norm"
    steps = f"for {sp['steps_outside']} step{'s' if sp['steps_outside'] > 1 else ''} from step {sp['step']}"
    msg = (f"{label}: one-side spike at step {sp['peak_step']} (outside the band {steps}, back inside at step "
           f"{sp['back_step']}): candidate {sp['candidate']:.6g} vs baseline {sp['baseline']:.6g} (delta "
           f"{sp['delta']:+.3g}, band {sp['band']:.3g}); ")
    msg += {"candidate": "the repeat agrees with the baseline there: the candidate spiked",
            "baseline": "the repeat agrees with the candidate there: the baseline spiked"}.get(
        sp["side"], "the repeat agrees with neither run there" if repeats else
        "which run spiked needs a repeat of the baseline (--repeat)")
    bt = sp["batches"]
    if bt["same_batch"] is True:
        msg += f"; both runs trained on the same batch there (tokens sha1 {bt['baseline']['tokens_sha1']})"
    elif bt["same_batch"] is False:
        msg += (f"; the batches DIFFER at that step (tokens sha1 {bt['baseline']['tokens_sha1']} vs "
                f"{bt['candidate']['tokens_sha1']}): look at the data pipeline first")
    else:
        msg += "; batches not recorded by both runs at that step"
    jumps = sp["norm_jumps"]
    if jumps:
        top = ", ".join(f"{j['name']} x{j['candidate_ratio']:.3g} (baseline x{j['baseline_ratio']:.3g})"
                        for j in jumps[:3] if j["one_side_jump"] >= JUMP)
        before = f"the {jumps[0]['previous_steps']} recorded steps before"
        if jumps[0]["one_side_jump"] >= JUMP:
            msg += f"; named gradient norms that jumped most on one side against {before} (candidate): {top}"
        else:
            msg += (f"; the named gradient norms moved alike on both sides against {before} (largest "
                    f"difference x{jumps[0]['one_side_jump']:.3g}: {jumps[0]['name']})")
    return msg


def run(ev: Evidence) -> StageResult:
    sc = ev.scalars
    metrics = [(m, p, sc.stages.get(s)) for m, p, s in METRICS]
    metrics = [(m, p, st) for m, p, st in metrics if st is not None and st.verdict != "skipped"]
    if not metrics:
        return skipped(NAME, "fewer than 3 steps with a loss or grad norm in both runs")
    sustain, max_outside = ev.options.scalar.sustain, ev.options.scalar.max_outside
    res = StageResult(NAME, details={"sustain": sustain, "factor": SPIKE_FACTOR})
    found: list[dict[str, Any]] = []
    crowded = []
    for metric, prefix, st in metrics:
        frac = st.details.get("outside_band_fraction") or 0.0
        if too_many_outside(st.details.get("outside_steps", 0), st.details.get("steps", 0), max_outside):
            # outside most of the time: no lone spike to tell apart (the long run says)
            crowded.append(f"{'loss' if metric == 'loss' else 'grad norm'} outside the band at {frac:.0%} of steps")
            res.details[metric] = {"spikes": None, "reason": crowded[-1]}
            continue
        spikes, total, marginal = find_spikes(sc.table, metric, prefix, sustain,
                                              before=st.details.get("divergence_step"))
        res.details[metric] = {"spikes": total, "below_factor": marginal, "reported": []}
        for sp in spikes:
            d = sp.to_json()
            d["batches"] = _batches(ev, sp.peak_step)
            found.append(d)
            res.details[metric]["reported"].append(d)
    jumps = _jumps(ev, sorted({d["peak_step"] for d in found}))
    for d in found:
        d["norm_jumps"] = jumps.get(d["peak_step"], [])
        res.add(Finding(NAME, "warn", d["metric"], "one_side_spike_step", d["peak_step"], None,
                        _message(d, len(ev.repeats))))
    judged = [m for m, _, _ in metrics if res.details[m].get("spikes") is not None]
    if not found and judged:
        res.add(Finding(NAME, "pass", None, "one_side_spikes", 0, SPIKE_FACTOR, "no one-side spike: " + "; ".join(
            f"{'loss' if m == 'loss' else 'grad norm'}: {res.details[m]['below_factor']} departure(s) shorter than "
            f"{sustain} steps, none beyond {SPIKE_FACTOR:g} x the band" for m in judged)
            + "".join(f"; {c}: not told apart" for c in crowded)))
    if not judged:
        return skipped(NAME, "; ".join(crowded) + ": lone spikes cannot be told apart from a run that does not "
                       "fit its band (the long run reports it)")
    res.details["power"] = _power(sc.table, judged, sustain)
    for f in res.findings:
        if f.verdict == "pass":
            f.message += f"; power: {res.details['power']['text']}"
    return res


def _power(table: Any, judged: list[str], sustain: int) -> dict[str, Any]:
    """What this stage can see: a one-side excursion shorter than ``sustain`` steps is reported from
    SPIKE_FACTOR x the band at its step (the median band over the run, per metric, relative to the median
    baseline value: a clean pair's one-step excursions reach ~2.4x)."""
    parts, first = [], None
    for m in judged:
        prefix = "" if m == "loss" else "grad_norm_"
        band, base = table.get(f"{prefix}band"), table.get(f"{prefix}baseline")
        if band is None or base is None or not len(band):
            continue
        b = float(np.nanmedian(band.to_numpy(dtype=float)))
        scale = float(np.nanmedian(np.abs(base.to_numpy(dtype=float))))
        d = SPIKE_FACTOR * b
        first = d if first is None else first
        label = "loss" if m == "loss" else "grad norm"
        parts.append(f"a {label} spike of {d:.3g} ({d / scale:.3%} of the {label}; {SPIKE_FACTOR:g} x its median "
                     f"band) lasting under {sustain} steps is reported")
    return {"detectable": first, "text": "; ".join(parts) or "no band to state a spike against"}


def section(res: StageResult) -> str:
    rows = []
    for metric in ("loss", "grad_norm"):
        for d in (res.details.get(metric) or {}).get("reported", []):
            bt = d["batches"]
            rows.append({"metric": metric, "step": d["peak_step"], "steps out": d["steps_outside"],
                         "baseline": d["baseline"], "candidate": d["candidate"], "band": d["band"],
                         "spiked": d["side"], "same batch": bt["same_batch"],
                         "norms that jumped (candidate / baseline)": ", ".join(
                             f"{j['name']} x{j['candidate_ratio']:.3g} / x{j['baseline_ratio']:.3g}"
                             for j in d["norm_jumps"][:3] if j["one_side_jump"] >= JUMP)})
    return table(rows)


STAGE = Stage(
    name=NAME, order=125, title="One-side spikes (loss, grad norm)",
    needs="loss or grad norm per step in both runs; batches and named norms in the stores for the evidence; "
          "a repeat of the baseline (--repeat) to tell which run spiked",
    capture="log loss and grad norm every step; the dumpers record each step's batch and named gradient "
            "norms (the default), which become the evidence of a spike's step; pass a repeat of the baseline "
            "with --repeat",
    run=run, section=section,
    part="long run",
    why=("One run jumps for a few steps and comes back: a batch one side read differently, or a rare kernel "
         "event."),
    next=("see the spike's step in the report: both batch hashes and the parameters whose norms jumped on one "
          "side"))
