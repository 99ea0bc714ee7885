"""One-side spikes: the loss (or grad norm) delta leaves the band for a few steps and comes back.

Why: the long run calls a departure a divergence only when it lasts ``sustain`` steps, so a lone spike is
noise there. But a spike on one side only, where both runs trained on the same batch, is a difference of the
two runs at that step (a batch that differs, a kernel that overflows, a parameter whose gradient jumped),
and it is worth that step's evidence. A spike both runs show moves both curves alike: the delta stays in the
band and nothing is reported. Which side spiked can be told from a repeat of the baseline: the side the
repeat disagrees with at that step. MindFormers' ``global_norm_spike_threshold`` is a different thing: one
run's absolute grad-norm ceiling (skip the update or stop), docs/workflow.md says how the two relate.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pandas as pd

MAX_REPORTED = 5       # spikes per metric given their step's evidence (the largest); the rest are counted
#: A short departure is a spike when its peak |delta| is at least this many times the band. The band is 3 x
#: the repeat's RMS delta, so a single step just outside it is the 0.3% tail of the runs' own noise (300
#: steps of a 100k-step run); twice the band is 6 RMS, which noise does not reach.
SPIKE_FACTOR = 2.0


@dataclass
class Spike:
    """A short departure of the delta from the band: its first step, its peak, how long it lasted."""

    metric: str                 # "loss" or "grad_norm"
    step: int                   # first step outside the band
    peak_step: int              # the step of the largest |delta| / band
    steps_outside: int
    back_step: int              # the first step back inside
    baseline: float
    candidate: float
    delta: float
    band: float
    side: str                   # "candidate", "baseline" or "unknown" (no repeat to tell)
    repeat_delta: float | None  # repeat - baseline at the peak (the mean over repeats)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _runs(outside: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start and end (exclusive) indices of each run of consecutive True."""
    o = np.concatenate([[0], outside.astype(np.int8), [0]])
    d = np.diff(o)
    return np.flatnonzero(d == 1), np.flatnonzero(d == -1)


def find_spikes(table: pd.DataFrame, metric: str = "loss", prefix: str = "", sustain: int = 10,
                before: int | None = None, factor: float = SPIKE_FACTOR) -> tuple[list[Spike], int, int]:
    """The one-side spikes of ``metric`` in the scalar table (comparators.scalars: ``delta``, ``band``,
    ``outside``, ``baseline``, ``candidate``, ``repeatN`` by step, under ``prefix``): runs of fewer than
    ``sustain`` steps outside the band, followed by a step back inside, before the divergence step
    ``before``, whose peak |delta| is at least ``factor`` x the band. Returns the ``MAX_REPORTED`` largest
    (by |delta| / band at their peak), how many spikes there were, and how many shorter departures stayed
    below ``factor`` x the band (the runs' own noise)."""
    cols = [prefix + c for c in ("delta", "band", "outside", "baseline", "candidate")]
    if table.empty or any(c not in table.columns for c in cols):
        return [], 0, 0
    t = table[table[prefix + "outside"].notna()]
    if before is not None:
        t = t[t.index < before]
    if t.empty:
        return [], 0, 0
    steps = t.index.to_numpy()
    outside = t[prefix + "outside"].to_numpy().astype(bool)
    delta = t[prefix + "delta"].to_numpy(dtype=np.float64)
    band = t[prefix + "band"].to_numpy(dtype=np.float64)
    b = t[prefix + "baseline"].to_numpy(dtype=np.float64)
    c = t[prefix + "candidate"].to_numpy(dtype=np.float64)
    reps = [t[k].to_numpy(dtype=np.float64) for k in t.columns
            if k.startswith(prefix + "repeat") and k[len(prefix) + 6:].isdigit()]
    starts, ends = _runs(outside)
    keep = ((ends - starts) < sustain) & (ends < len(steps))      # short, and back inside afterwards
    starts, ends = starts[keep], ends[keep]
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.where(np.isfinite(delta), np.abs(delta) / np.where(band > 0, band, np.inf), np.inf)
    peaks = np.array([s + int(np.argmax(ratio[s:e])) for s, e in zip(starts, ends, strict=True)], dtype=np.int64)
    big = ratio[peaks] >= factor if len(peaks) else np.zeros(0, dtype=bool)
    marginal = int((~big).sum())
    starts, ends, peaks = starts[big], ends[big], peaks[big]
    order = np.argsort(-ratio[peaks], kind="stable")
    out = []
    for k in order[:MAX_REPORTED]:
        i = int(peaks[k])
        rd = None
        side = "unknown"
        if reps:
            with np.errstate(invalid="ignore"):
                r = float(np.nanmean([x[i] for x in reps])) if any(np.isfinite(x[i]) for x in reps) else np.nan
            if np.isfinite(r):
                rd = r - b[i]
                near_b, near_c = abs(r - b[i]) <= band[i], abs(r - c[i]) <= band[i]
                side = "candidate" if near_b and not near_c else "baseline" if near_c and not near_b else "unknown"
        out.append(Spike(metric, int(steps[starts[k]]), int(steps[i]), int(ends[k] - starts[k]),
                         int(steps[ends[k]]), float(b[i]), float(c[i]), float(delta[i]), float(band[i]), side, rd))
    return sorted(out, key=lambda x: x.step), int(len(starts)), marginal
