"""Noise floors measured on the runs themselves, and verdicts as a ratio to them.

Why: a dtype line (float16's 1e-3 for an lr = 0 loss, 2e-3 for a layer row) is the noise a precision *can*
show, not the noise a pair *does* show. MindFormers' flash attention computes a float32 run's q/k/v in
float16, so the mcore pairs are judged at float16's lines, and a fault 140x above the pair's real noise
(a loss computed from float16 logits: lr = 0 loss 3.0e-4 apart where a clean pair is 2.1e-6) hides under
them. The baseline's repeat at the candidate's precision (``--repeat``: the demo's is TP=2 or DP=2 with
float16-rounded attention) differs from the baseline by that real noise: the same quantity taken on the
repeat and the baseline is the floor, and the candidate's difference is judged as a multiple of it.

The rule, the same for every judged quantity (layer rows, step-1 local norms, the lr = 0 loss and grad norm,
optimizer updates):
- ratio = difference / floor, with the floor never below ``FLOOR_MIN`` (8 float32 ulps, relative): a
  bit-identical repeat (floor 0) must not turn the last bits of two frameworks' rounding into fails;
- up to ``PASS_RATIO`` floors passes, up to ``FAIL_RATIO`` warns, beyond fails;
- the dtype line stays an upper bound: the verdict is the worse of the two, so a difference above the dtype
  line warns or fails however large the floor is;
- no floor (no repeat, or the repeat lacks the quantity): the dtype line alone, and the result says so.

One draw of the noise can come out small by chance (measured on the dense demo pair: layer 0's k_layernorm
gradient norm differs 7.5e-6 between repeat and baseline while its neighbours' differ 1e-5 to 1.4e-4), so a
row's floor is its own repeat difference or the spread (RMS) of its group's, whichever is larger; a row the
repeat has no counterpart of (a tensor-parallel shard of another shape) takes its group's spread.

Framework-free (plain floats): the comparators and stages feed it what they measured.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from comparators.stats import FAIL_RATE, WARN_RATE, multiplicity
from core.dtypes import EPS

PASS_RATIO = 10.0      # a difference up to this many floors is noise
FAIL_RATIO = 30.0      # beyond this many floors it fails (between: warn)
FLOOR_MIN_ULPS = 8.0   # the smallest floor, in float32 ulps (relative): rounding between two frameworks
FLOOR_MIN = FLOOR_MIN_ULPS * EPS["float32"]
_ORDER = {"pass": 0, "warn": 1, "fail": 2}


@dataclass(frozen=True)
class Floor:
    """A measured floor: the relative difference the repeat shows (``None``: not measured) and where it came
    from, in words (shown in the report next to each ratio)."""

    value: float | None
    source: str

    @property
    def effective(self) -> float | None:
        """The floor a ratio is taken against: the measured one, never below ``FLOOR_MIN``."""
        if self.value is None or not math.isfinite(self.value):
            return None
        return max(self.value, FLOOR_MIN)


def missing(why: str) -> Floor:
    """No floor: the dtype line alone judges; ``why`` says which run or quantity was missing."""
    return Floor(None, f"no floor ({why}): judged at the dtype line")


def rel_diff(reference: float, other: float) -> float:
    """|other - reference| / |reference| (infinite when either is not finite)."""
    if reference == other:
        return 0.0
    if not (math.isfinite(reference) and math.isfinite(other)):
        return math.inf
    return abs(other - reference) / max(abs(reference), 1e-30)


def worst(*verdicts: str) -> str:
    return max(verdicts, key=lambda v: _ORDER[v])


@dataclass(frozen=True)
class Judgement:
    """One quantity's verdict: by its dtype line, by its floor (when measured), and the worse of the two."""

    verdict: str
    value: float
    ratio: float | None          # value / floor (None without a floor)
    floor: float | None          # the effective floor the ratio was taken against
    floor_source: str
    threshold: float             # the pass line in force: min(dtype pass line, PASS_RATIO x floor)
    dtype_verdict: str
    decided_by: str              # "floor" (the floor was stricter) or "dtype line"
    dtype_line: float            # the dtype's pass line (what the difference was judged against before floors)
    pass_ratio: float = PASS_RATIO   # the ratios in force (grown with the number of values judged together)
    fail_ratio: float = FAIL_RATIO
    judged: int = 1                  # values judged together against floors of this kind
    dtype_fail_line: float = math.inf    # the dtype's warn line: beyond it the value fails whatever its floor

    @property
    def fail_at(self) -> float:
        """The smallest difference this value would fail at: its floor's fail line or the dtype's, if lower."""
        by_floor = self.fail_ratio * self.floor if self.floor is not None else math.inf
        return min(by_floor, self.dtype_fail_line)

    def columns(self) -> dict[str, Any]:
        """The row columns every judged table carries (summary.json and the HTML tables)."""
        return {"ratio": self.ratio, "floor": self.floor, "floor_source": self.floor_source,
                "dtype_line": self.dtype_line, "dtype_verdict": self.dtype_verdict, "decided_by": self.decided_by,
                "pass_ratio": self.pass_ratio, "fail_ratio": self.fail_ratio}

    def says(self) -> str:
        """The ratio in words, for a finding's message."""
        if self.ratio is None:
            return self.floor_source
        among = f" for {self.judged} values judged together" if self.judged > 1 else ""
        return (f"{self.ratio:.3g}x its noise floor {self.floor:.3g} ({self.floor_source}; passes up to "
                f"{self.pass_ratio:.3g}x, fails beyond {self.fail_ratio:.3g}x{among})")


def ratios(judged: int = 1) -> tuple[float, float]:
    """(pass, fail) ratios for ``judged`` values judged at once: ``PASS_RATIO`` and ``FAIL_RATIO`` are the lines
    for one value; applied to many, the chance that the largest clean one crosses a line grows, so each line
    grows by the Bonferroni factor that keeps that chance at the stated rate (stats.multiplicity: the warn line
    at ``WARN_RATE``, the fail line at ``FAIL_RATE``): 20 values at once pass up to 13.5x, fail beyond 37x."""
    n = max(int(judged), 1)
    return PASS_RATIO * multiplicity(n, WARN_RATE), FAIL_RATIO * multiplicity(n, FAIL_RATE)


def judge(value: float, floor: Floor | None, dtype_line: tuple[float, float], *,
          pass_ratio: float | None = None, fail_ratio: float | None = None, judged: int = 1) -> Judgement:
    """The verdict of a difference ``value`` (relative, >= 0): the worse of its dtype line (``dtype_line``:
    passes up to [0], warns up to [1]) and its ratio to ``floor`` (when measured). ``judged``: how many values
    are judged together against floors like this one (the ratios grow with it: :func:`ratios`)."""
    auto = ratios(judged)
    pass_ratio = auto[0] if pass_ratio is None else pass_ratio
    fail_ratio = auto[1] if fail_ratio is None else fail_ratio
    finite = math.isfinite(value)
    dv = "pass" if finite and value <= dtype_line[0] else "warn" if finite and value <= dtype_line[1] else "fail"
    eff = floor.effective if floor is not None else None
    source = floor.source if floor is not None else "no floor: judged at the dtype line"
    if eff is None:
        return Judgement(dv, value, None, None, source, dtype_line[0], dv, "dtype line", dtype_line[0],
                         pass_ratio, fail_ratio, judged, dtype_line[1])
    ratio = value / eff if finite else math.inf
    fv = "pass" if ratio <= pass_ratio else "warn" if ratio <= fail_ratio else "fail"
    verdict = worst(dv, fv)
    decided = "floor" if _ORDER[fv] > _ORDER[dv] else "dtype line"
    return Judgement(verdict, value, ratio, eff, source, min(dtype_line[0], pass_ratio * eff), dv, decided,
                     dtype_line[0], pass_ratio, fail_ratio, judged, dtype_line[1])


def spread(values: Iterable[float | None]) -> float | None:
    """The RMS of the finite values (a group's typical floor); None when there are none."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return None
    return math.sqrt(sum(v * v for v in vals) / len(vals))


def group_floors(own: Mapping[Hashable, float | None], group_of: Mapping[Hashable, Hashable], what: str,
                 no_repeat: str | None = None) -> dict[Hashable, Floor]:
    """Per row: the larger of its own repeat difference and its group's spread (RMS of the group's own
    differences); a row without its own (``None``) takes the group's spread. ``what`` names the measurement
    (e.g. "repeat R vs baseline, step 1"); ``no_repeat``: when set, every floor is missing for that reason."""
    if no_repeat is not None:
        return {k: missing(no_repeat) for k in group_of}
    groups: dict[Hashable, list[float | None]] = {}
    for k, g in group_of.items():
        groups.setdefault(g, []).append(own.get(k))
    rms = {g: spread(v) for g, v in groups.items()}
    n = {g: sum(x is not None and math.isfinite(x) for x in v) for g, v in groups.items()}
    out: dict[Hashable, Floor] = {}
    for k, g in group_of.items():
        mine, agg = own.get(k), rms[g]
        if mine is not None and math.isfinite(mine):
            if agg is not None and agg > mine:
                out[k] = Floor(agg, f"{what}: RMS of {n[g]} rows of its group (its own {mine:.2g} is smaller)")
            else:
                out[k] = Floor(mine, f"{what}: this row")
        elif agg is not None:
            out[k] = Floor(agg, f"{what}: RMS of {n[g]} rows of its group (no counterpart in the repeat)")
        else:
            out[k] = missing(f"the repeat has no row of this group ({what})")
    return out


def summary(judgements: Iterable[Judgement]) -> dict[str, Any]:
    """What a stage's details say about its floors: the worst ratio, how many rows the floor decided, how
    many had no floor (judged at the dtype line alone)."""
    js = list(judgements)
    with_floor = [j for j in js if j.ratio is not None]
    worst_j = max(with_floor, key=lambda j: j.ratio, default=None)
    return {"judged": len(js), "with_floor": len(with_floor), "without_floor": len(js) - len(with_floor),
            "decided_by_floor": sum(j.decided_by == "floor" for j in js),
            "worst_ratio": worst_j.ratio if worst_j is not None else None,
            "pass_ratio": js[0].pass_ratio if js else PASS_RATIO, "fail_ratio": js[0].fail_ratio if js else FAIL_RATIO,
            "floor_min": FLOOR_MIN}


def power(judgements: Iterable[Judgement], what: str, unit: str = "relative difference") -> dict[str, Any]:
    """What a floor-judged stage can tell (summary.json and the stage's message): ``detectable``, the
    ``unit`` at which a typical judged value (the median over them) fails, ``most_sensitive`` the smallest
    of those lines; for a pass, ``margin``: the largest share of its own fail line any value used (0.2: every
    value is 5x below the difference that would have failed it). Values judged at the dtype line alone
    (no floor) resolve only that line, and the text says a repeat would measure the noise."""
    js = [j for j in judgements if math.isfinite(j.value)]
    if not js:
        return {"detectable": None, "text": f"no {what} compared"}
    lines = sorted(j.fail_at for j in js)
    finite = [x for x in lines if math.isfinite(x)]
    detect = finite[len(finite) // 2] if finite else math.inf
    used = max((j.value / j.fail_at for j in js if j.fail_at > 0 and math.isfinite(j.fail_at)), default=math.nan)
    no_floor = sum(j.ratio is None for j in js)
    text = (f"with these floors, a {unit} of {detect:.3g} fails a typical one of the {len(js)} {what} judged "
            f"together (the most sensitive at {finite[0] if finite else math.inf:.3g})")
    if math.isfinite(used):
        text += (f"; the largest here uses {used:.2g} of its fail line" +
                 (f" (a margin of {1 / used:.3g}x)" if used > 0 else ""))
    if no_floor:
        text += (f"; {no_floor} of them have no measured floor and resolve only their dtype line: a repeat of the "
                 "baseline at the candidate's precision (--repeat, without determinism) would measure their noise")
    return {"detectable": detect, "most_sensitive": finite[0] if finite else None, "margin": used,
            "judged": len(js), "without_floor": no_floor, "text": text}


# -- a repeat that measures no noise ---------------------------------------------------------------------------
SILENT_ULPS = 1.0            # a repeat never more than this many float32 ulps (relative) from the baseline ...
SILENT_DTYPE_FRACTION = 1e-4  # ... or than this share of its precision's ulp (bf16: ~6.5 float32 ulps)


def silent_repeat(series: Iterable[tuple[str, np.ndarray, np.ndarray]], dtype: str = "float32") -> str | None:
    """Why a repeat measures no noise, or None when it does (or cannot be told: no common finite value).

    ``series``: (quantity, baseline values, repeat values) at the steps both hold. A repeat bit-identical to
    the baseline over every judged step (any CPU run; on a cluster, determinism left on) gives floors of 0 and
    a band of 0: every cross-framework rounding would read as a fault. One whose largest difference stays
    below ``SILENT_ULPS`` float32 ulps, or far below its precision's ulp (``SILENT_DTYPE_FRACTION``: a bf16
    run that never leaves a few float32 ulps of its baseline did not run without determinism), measures no
    more. Such a repeat is named in a warning and not used: judging falls back to the dtype line."""
    limit = max(SILENT_ULPS * EPS["float32"], SILENT_DTYPE_FRACTION * EPS.get(dtype, EPS["float32"]))
    worst_rel, n, what = 0.0, 0, []
    for name, b, r in series:
        b, r = np.asarray(b, dtype=np.float64), np.asarray(r, dtype=np.float64)
        ok = np.isfinite(b) & np.isfinite(r)
        if not ok.any():
            continue
        rel = np.abs(r[ok] - b[ok]) / np.maximum(np.abs(b[ok]), 1e-30)
        worst_rel = max(worst_rel, float(rel.max()))
        n = max(n, int(ok.sum()))
        what.append(name)
    if not what or worst_rel > limit:
        return None
    over = f"{' and '.join(what)} over {n} common step{'s' if n != 1 else ''}"
    if worst_rel == 0.0:
        return f"bit-identical to the baseline ({over}): it measures no noise (run it without determinism)"
    return (f"at most {worst_rel:.3g} relative from the baseline ({over}), below {limit:.3g} "
            f"({SILENT_ULPS:g} float32 ulp or {SILENT_DTYPE_FRACTION:g} of a {dtype} ulp): it measures no noise")
