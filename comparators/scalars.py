"""Per-step scalar comparison: step-1 / step-2 loss, the long run against a benchmark error band,
divergence, late-stage gap, first non-finite step, learning-rate schedule.

The statistics, in plain words (README "How the verdict is reached" repeats this):
- delta = candidate - baseline at each step both runs logged.
- The benchmark error band is how far the baseline differs from itself when run again: with repeats,
  band(step) = band_k x the rolling RMS (window ``band_window`` steps) of (repeat - baseline) over all
  repeats, never below the floor. Without repeats the band is ``rtol`` x |baseline loss|.
- The floor is the larger of ``band_floor`` and ``band_floor_ulps`` float32 ulps of the largest |baseline|
  value: two frameworks reduce the same cross-entropy in a different order and land a few ulps apart, and a
  bit-identical repeat gives a band of 0; below the floor a difference is rounding, not training.
- outside_band_fraction: share of common steps where |delta| > band.
- mean_delta / spread: mean(delta) divided by std(delta). Near 0 the candidate fluctuates around the
  baseline; near +-1 or beyond it sits consistently on one side (a bias, even inside the band). A repeat
  whose own mean delta has the same sign and is at least as large shows the baseline offsets itself that
  much (e.g. a repeat at the candidate's lower attention precision): then it is not reported as a bias.
- divergence_step: first step of the first run of ``sustain`` consecutive steps outside the band
  (a lone spike is noise, a sustained departure is a divergence).
- late-stage gap: over the last ``tail`` share of steps the mean |delta| exceeds the mean band while the
  first half was inside: training agreed, then drifted apart late.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from comparators import stats
from core.dtypes import EPS, normalize
from core.errors import BadInput
from core.findings import Finding, StageResult, skipped
from runstore.run import Run


@dataclass
class ScalarOptions:
    step_rtol: float = 5e-3        # step-1 / step-2 loss: relative tolerance
    rtol: float = 1e-2             # long run band when there are no repeats
    band_k: float = 3.0            # band = band_k x rolling RMS of repeat deltas
    band_window: int = 51          # steps in the rolling window of the band
    band_floor: float = 0.0        # absolute floor of the band
    band_floor_ulps: float = 8.0   # floor in float32 ulps (eps x max |baseline|): rounding is not a departure
    max_outside: float = 0.05      # allowed share of steps outside the band (no repeat: no noise measured)
    fail_rate: float = 1e-3        # with a repeat: a clean pair fails a long-run test at most this often
    warn_rate: float = 1e-2        # ... and is warned about at most this often
    max_bias: float = 0.5          # |mean delta| / std(delta) above this: the delta does not centre on 0
    noise_allowance: float = 2.0   # a clean candidate may be this much noisier than the baseline's repeat
    sustain: int = 10              # consecutive out-of-band steps that make a divergence
    tail: float = 0.2              # last share of steps checked for a late-stage gap
    lr_rtol: float = 1e-5          # learning rates must agree to this relative tolerance


@dataclass
class ScalarComparison:
    stages: dict[str, StageResult]
    table: pd.DataFrame            # per step: baseline, candidate, delta, band, outside, repeats ...
    details: dict[str, Any] = field(default_factory=dict)


def require_common_steps(baseline: Run, candidate: Run) -> None:
    """BadInput (exit 2) when the runs share no step with a loss and no step with local norms.

    Two runs that never overlap have nothing to compare: a ``pass`` there would be a false all-clear.
    The procedure calls this after loading, before any stage runs."""
    if _common(baseline.series("loss"), candidate.series("loss")).size:
        return
    if set(baseline.local_norm_steps(limit=50)) & set(candidate.local_norm_steps(limit=50)):
        return

    def span(run: Run) -> str:
        steps = run.steps
        return f"steps {steps.min()}-{steps.max()}" if len(steps) else "no steps"

    raise BadInput(f"{candidate.path}: no step in common with {baseline.path} (baseline {span(baseline)}, "
                   f"candidate {span(candidate)}): nothing to compare")


def _common(a: pd.Series, b: pd.Series) -> pd.Index:
    return a.index.intersection(b.index)


def values_at(s: pd.Series, steps: pd.Index) -> np.ndarray:
    """A run's series at ``steps`` (NaN where it has none). Its own array when it holds exactly those steps
    (both runs logged every step: the usual case), without pandas' label lookup, which builds a hash table
    of the index (~3 ms for a 100k-step series)."""
    return s.to_numpy() if s.index.equals(steps) else s.reindex(steps).to_numpy()


def _rel(a: float, b: float) -> float:
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(b - a) / max(abs(a), 1e-12)


def log_window(run: Run | None, step: int, key: str = "loss") -> dict[str, Any] | None:
    """The log reader's account of ``step`` when its printed value was (or may be) a mean over the first
    printed window (``meta["log_windows"]``, sources.megatron_log.first_windows); None otherwise."""
    if run is None:
        return None
    for w in run.meta.get("log_windows") or []:
        if isinstance(w, dict) and w.get("step") == step and w.get("state") in ("recovered", "ambiguous") \
                and key in (w.get("printed") or {}):
            return w
    return None


def _readings(role: str, run: Run | None, step: int, value: float) -> tuple[list[float], list[str]]:
    """The values a run's step may hold (as stored; and the other reading of an ambiguous log line) and
    what the finding must say about them."""
    w = log_window(run, step)
    if w is None:
        return [value], []
    other = (w.get("recovered") or {}).get("loss")
    if w["state"] == "recovered":
        return [value], [f"{role}: {w['message']}"]
    if not isinstance(other, (int, float)) or not math.isfinite(other):
        return [value], []
    return [value, float(other)], [f"{role}: {w['message']}"]


def _step_stage(name: str, nth: int, base: pd.Series, cand: pd.Series, opt: ScalarOptions,
                runs: tuple[Run | None, Run | None] = (None, None)) -> StageResult:
    common = _common(base, cand)
    if nth == 2 and len(common) == 1:      # one common step: the step-1 pass must not read as an all-clear
        st = StageResult(name, details={"step": None, "common_steps": 1})
        st.add(Finding(name, "warn", "loss", "common_steps", 1, 2,
                       f"the runs share one step with a loss (step {int(common[0])}): the first optimizer update "
                       "and everything after it are not compared; log at least two steps in both runs"))
        return st
    if len(common) < nth:
        return skipped(name, f"fewer than {nth} steps logged by both runs")
    step = int(common[nth - 1])
    b, c = float(base[step]), float(cand[step])
    rel = _rel(b, c)
    st = StageResult(name, details={"step": step, "baseline": b, "candidate": c,
                                    "abs_delta": c - b, "rel_delta": rel, "threshold": opt.step_rtol})
    verdict = "pass" if rel <= opt.step_rtol else "fail"
    label = "step-1" if nth == 1 else "step-2"
    what = "forward (same weights and data?)" if nth == 1 else "optimizer update (lr, betas, eps, decay?)"
    msg = (f"{label} loss (step {step}): baseline {b:.6g}, candidate {c:.6g}, relative delta {rel:.3g} "
           f"{'<=' if verdict == 'pass' else '>'} {opt.step_rtol:g}")
    bvals, bnotes = _readings("baseline", runs[0], step, b)
    cvals, cnotes = _readings("candidate", runs[1], step, c)
    if bnotes or cnotes:
        st.details["log_windows"] = bnotes + cnotes
    if len(bvals) == 2 and len(cvals) == 2:
        # two logs of unknown version: read both the same way (made by the same Megatron-LM, presumably)
        others = [(bvals[1], cvals[1], _rel(bvals[1], cvals[1]))]
    else:
        others = [(x, y, _rel(x, y)) for x in bvals for y in cvals if (x, y) != (b, c)]
    if others and any((r <= opt.step_rtol) != (verdict == "pass") for _, _, r in others):
        # one reading of an ambiguous log line passes, the other fails: a warning naming the ambiguity
        x, y, r = next(o for o in others if (o[2] <= opt.step_rtol) != (verdict == "pass"))
        msg += (f"; if the printed line is the mean over the first printed window (Megatron-LM core >= 0.16), the "
                f"step's own losses are baseline {x:.7g}, candidate {y:.7g}, relative delta {r:.3g} "
                f"{'<=' if r <= opt.step_rtol else '>'} {opt.step_rtol:g}: which reading holds is not known. "
                "Give the Megatron-LM log from its start (its arguments block tells the version) to settle it")
        verdict = "warn"
    elif verdict == "fail":
        msg += f"; suspect the {what}"
    if bnotes or cnotes:
        msg += ". " + " ".join(bnotes + cnotes)
    st.add(Finding(name, verdict, "loss", "rel_delta", rel, opt.step_rtol, msg))
    return st


def band_floor(opt: ScalarOptions, baseline: np.ndarray) -> float:
    """The smallest band: ``band_floor``, or ``band_floor_ulps`` float32 ulps of the largest |baseline|."""
    fin = np.abs(np.asarray(baseline, dtype=np.float64))
    fin = fin[np.isfinite(fin)]
    eps = float(np.finfo(np.float32).eps)
    return max(opt.band_floor, opt.band_floor_ulps * eps * (float(fin.max()) if len(fin) else 0.0))


def _first_sustained(outside: np.ndarray, sustain: int) -> int | None:
    """Index of the first run of ``sustain`` consecutive True values, vectorised."""
    if len(outside) < sustain or sustain <= 0:
        return None
    run = np.convolve(outside.astype(np.int32), np.ones(sustain, dtype=np.int32), mode="valid")
    hits = np.flatnonzero(run == sustain)
    return int(hits[0]) if len(hits) else None


def _first_nonfinite(run: Run, keys: tuple[str, ...]) -> tuple[int, str, float] | None:
    best = None
    for k in keys:
        s = run.series(k)
        bad = s[~np.isfinite(s.to_numpy())]
        if len(bad) and (best is None or int(bad.index[0]) < best[0]):
            best = (int(bad.index[0]), k, float(bad.iloc[0]))
    return best


def compare_scalars(baseline: Run, candidate: Run, repeats: list[Run] | None = None,
                    opt: ScalarOptions | None = None, precision: str = "float32") -> ScalarComparison:
    """Per-step loss / grad norm / lr comparison. ``precision``: what the runs computed in (the coarser of the
    two); a grad-norm bias smaller than one of its ulps at the norm's scale is that precision's noise, not a
    bias of the candidate (the loss is computed in float32 by both frameworks and keeps float32's floor)."""
    opt = opt or ScalarOptions()
    repeats = repeats or []
    stages: dict[str, StageResult] = {}
    base, cand = baseline.series("loss"), candidate.series("loss")
    stages["step1_loss"] = _step_stage("step1_loss", 1, base, cand, opt, (baseline, candidate))
    stages["step2_loss"] = _step_stage("step2_loss", 2, base, cand, opt, (baseline, candidate))
    stages["nonfinite"] = _nonfinite_stage(baseline, candidate, repeats)
    stages["lr_schedule"] = _lr_stage(baseline, candidate, opt)

    table, long_run = _long_run("loss", "long_run", baseline, candidate, repeats, opt)
    stages["long_run"] = long_run
    gtable, gstage = _long_run("grad_norm", "grad_norm", baseline, candidate, repeats, opt,
                               fail_verdict="warn", bias_eps=EPS.get(normalize(precision), EPS["float32"]))
    stages["grad_norm"] = gstage
    if not gtable.empty:
        gtable = gtable.add_prefix("grad_norm_")
        table = table.join(gtable, how="outer") if not table.empty else gtable
    return ScalarComparison(stages, table)


def _nonfinite_stage(baseline: Run, candidate: Run, repeats: list[Run]) -> StageResult:
    st = StageResult("nonfinite")
    keys = ("loss", "grad_norm")
    any_data = False
    for role, run in (("candidate", candidate), ("baseline", baseline)) + tuple(
            (f"repeat {i + 1}", r) for i, r in enumerate(repeats)):
        if not any(run.has(k) for k in keys):
            continue
        any_data = True
        hit = _first_nonfinite(run, keys)
        if hit is not None:
            step, key, value = hit
            st.add(Finding("nonfinite", "fail", key, "first_nonfinite_step", step, None,
                           f"{role} ({run.label}): {key} is {value} first at step {step}"))
            st.details.setdefault("first_nonfinite", {})[role] = {"step": step, "metric": key}
    if not any_data:
        return skipped("nonfinite", "no loss or grad norm values")
    if not st.findings:
        st.add(Finding("nonfinite", "pass", None, "first_nonfinite_step", None, None,
                       "loss and grad norm finite at every step in every run"))
    return st


def _lr_stage(baseline: Run, candidate: Run, opt: ScalarOptions) -> StageResult:
    b, c = baseline.series("lr"), candidate.series("lr")
    common = _common(b, c)
    if len(common) == 0:
        return skipped("lr_schedule", "learning rate not logged by both runs")
    bv, cv = values_at(b, common), values_at(c, common)
    bad = np.abs(cv - bv) > opt.lr_rtol * np.maximum(np.abs(bv), 1e-30)
    st = StageResult("lr_schedule", details={"steps": int(len(common)), "mismatched_steps": int(bad.sum())})
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        st.details["first_mismatch_step"] = int(common[i])
        st.add(Finding("lr_schedule", "fail", "learning_rate", "first_mismatch_step", int(common[i]), None,
                       f"learning rate differs from step {int(common[i])}: baseline {bv[i]:.6g}, candidate "
                       f"{cv[i]:.6g} ({int(bad.sum())} of {len(common)} steps differ); check warmup, decay "
                       "style, min lr and the step the schedule counts from"))
    else:
        st.add(Finding("lr_schedule", "pass", "learning_rate", "mismatched_steps", 0, None,
                       f"learning rate identical at all {len(common)} common steps"))
    return st


def too_many_outside(outside: int, steps: int, max_outside: float) -> bool:
    """More steps outside the band than the allowed share, and more than one: below 1 / max_outside steps (20 at
    5 %) a share cannot be judged, and one step outside is a lone excursion (the spikes stage looks at it; a
    sustained divergence is judged on its own), not a failing run. A clean 12-step pair drawn with another seed
    had exactly one step 1.4x its band (8 % of 12)."""
    return outside > max(max_outside * steps, 1)


def _long_run(key: str, name: str, baseline: Run, candidate: Run, repeats: list[Run],
              opt: ScalarOptions, fail_verdict: str = "fail", bias_eps: float = 0.0
              ) -> tuple[pd.DataFrame, StageResult]:
    base, cand = baseline.series(key), candidate.series(key)
    common = _common(base, cand)
    if len(common) < 3:
        return pd.DataFrame(), skipped(name, f"fewer than 3 steps with {key} in both runs")
    b = values_at(base, common)
    c = values_at(cand, common)
    delta = c - b
    cols = {"baseline": b, "candidate": c, "delta": delta}      # the table's columns, made into one at the end
    rep_deltas = []
    for i, r in enumerate(repeats):
        rs = values_at(r.series(key), common)
        if np.isnan(rs).all():
            continue
        d = (rs - b)
        cols[f"repeat{i + 1}"] = rs
        rep_deltas.append(d)
    finite = np.isfinite(delta)
    floor = band_floor(opt, b)
    null: NullModel | None = None
    if rep_deltas:
        stack = np.vstack(rep_deltas)
        sq = np.where(np.isfinite(stack), stack, np.nan) ** 2
        ms = np.nanmean(sq, axis=0)
        rolled = pd.Series(ms).rolling(opt.band_window, center=True, min_periods=1)
        sigma = np.sqrt(np.nan_to_num(rolled.mean().to_numpy(), nan=0.0))
        kappa = max(float(opt.noise_allowance), 1.0)
        band = np.maximum(opt.band_k * kappa * sigma, floor)
        band_source = (f"{len(rep_deltas)} baseline repeat(s): {opt.band_k:g} x rolling RMS"
                       + (f" x {kappa:g} (a candidate up to {kappa:g}x noisier than the repeat is clean)"
                          if kappa != 1 else ""))
        null = null_model(stack, sigma, band, rolled.count().to_numpy(), opt, floor)
    else:
        band = np.maximum(opt.rtol * np.abs(b), floor)
        band_source = f"no repeats: rtol {opt.rtol:g} x |baseline|"
    outside = ~finite | (np.abs(delta) > band)
    table = pd.DataFrame({**cols, "band": band, "outside": outside}, index=common)
    n = len(common)
    d_f = delta[finite]
    mean_delta = float(d_f.mean()) if len(d_f) else math.nan
    spread = float(d_f.std()) if len(d_f) > 1 else math.nan
    bias = abs(mean_delta) / spread if spread and spread > 0 else (0.0 if mean_delta == 0 else math.inf)
    frac = float(outside.mean())
    first = _first_sustained(outside, opt.sustain)
    div_step = int(common[first]) if first is not None else None
    st = StageResult(name, details={
        "steps": int(n), "first_step": int(common[0]), "last_step": int(common[-1]),
        "outside_band_fraction": frac, "outside_steps": int(outside.sum()), "mean_delta": mean_delta,
        "delta_std": spread,
        "mean_delta_over_spread": bias, "divergence_step": div_step, "band": band_source,
        "max_abs_delta": float(np.nanmax(np.abs(d_f))) if len(d_f) else math.nan, "band_floor": floor,
        "fail_rate": opt.fail_rate if null is not None else None,
        "warn_rate": opt.warn_rate if null is not None else None,
    })
    label = "loss" if key == "loss" else key.replace("_", " ")
    n_out = st.details["outside_steps"]
    if null is not None:
        count_verdict = _outside_test(st, null, key, label, n_out, n, opt, fail_verdict)
    else:
        count_verdict = _outside_share(st, key, label, n_out, n, frac, common, outside, band_source, opt,
                                       fail_verdict)
    if div_step is not None:
        if null is None or count_verdict != "pass":
            st.add(Finding(name, fail_verdict if null is None else count_verdict, key, "divergence_step", div_step,
                           opt.sustain,
                           f"{label}: sustained divergence starts at step {div_step} (>= {opt.sustain} "
                           f"consecutive steps outside the band); delta there {delta[first]:+.4g}, "
                           f"band {band[first]:.3g}"))
        else:
            st.details["divergence_note"] = (
                f"{opt.sustain} consecutive steps outside the band from step {div_step}, but no more steps outside "
                f"than a clean pair shows (p = {st.details['p_value']:.2g}): the deltas wander slowly "
                f"(lag-1 autocorrelation {null.rho:.2f}), so outside steps come in runs")
    # A consistent sign below the band floor (a few float32 ulps of the loss) is rounding, not a bias; so is
    # one a repeat of the baseline shows as well (its own mean delta: same sign, at least as large).
    rep_means = [float(np.nanmean(d)) for d in rep_deltas if np.isfinite(d).any()]
    shown = [m for m in rep_means if m * mean_delta > 0 and abs(m) >= abs(mean_delta)]
    if shown:
        st.details["bias_shown_by_repeat"] = shown[0]
    # ... and so is one below an ulp of the precision the runs computed in, at the quantity's own scale
    precision_noise = bias_eps * float(np.mean(np.abs(b[finite]))) if finite.any() else 0.0
    if precision_noise > floor:
        st.details["bias_precision_noise"] = precision_noise
    # The mean delta against its autocorrelation-aware standard error (a one-sample t test on n_eff steps):
    # a delta that merely wanders is slow (high lag-1 autocorrelation, few independent steps), a bias is not.
    rho_c = stats.lag1(d_f)
    n_eff_c = stats.effective_n(len(d_f), rho_c)
    se = spread / math.sqrt(n_eff_c) if spread and spread > 0 and n_eff_c > 0 else math.nan
    p_bias = (stats.t_sf2(abs(mean_delta) / se, max(n_eff_c - 1.0, 1.0)) if se and math.isfinite(se) and se > 0
              else (1.0 if mean_delta == 0 or not math.isfinite(mean_delta) else 0.0))
    st.details.update(bias_p_value=p_bias, bias_effective_steps=n_eff_c, bias_lag1_autocorrelation=rho_c)
    if (p_bias < opt.warn_rate and math.isfinite(bias) and bias > opt.max_bias and len(d_f) > 10
            and abs(mean_delta) > max(floor, precision_noise) and not shown):
        verdict = fail_verdict if (count_verdict == "fail" and p_bias < opt.fail_rate) else "warn"
        st.add(Finding(name, verdict, key, "mean_delta_over_spread", bias, opt.max_bias,
                       f"{label}: the delta does not fluctuate around 0 (mean {mean_delta:+.3g} = "
                       f"{bias:.2f} x its spread {spread:.3g}; over {n_eff_c:.3g} independent steps, lag-1 "
                       f"autocorrelation {rho_c:.2f}, a clean pair's mean sits this far from 0 with probability "
                       f"{p_bias:.2g}, warned below {opt.warn_rate:g}); the candidate is biased "
                       f"{'high' if mean_delta > 0 else 'low'}"))
    _late_gap(st, key, label, common, delta, band, finite, opt, fail_verdict)
    st.details["power"] = power(st, null, band, b, delta, finite, label, len(rep_deltas), opt)
    for f in st.findings:       # the report shows what the count could see next to what it saw
        if f.metric == "outside_band_fraction":
            f.message += f"; power: {st.details['power']['text']}"
    return table, st


@dataclass
class NullModel:
    """What a clean pair's count of steps outside the band looks like, measured on the repeat(s).

    ``sigma``: per step the noise scale (rolling RMS of repeat - baseline); ``rho``: the lag-1 autocorrelation
    of the repeats' standardized deltas, ``n_eff``: the independent steps the run's steps are worth; ``alpha``,
    ``beta``: the Beta distribution of the chance that a clean delta leaves the band at a step (what the
    repeats' own leave-one-out count says, never below the Student-t odds ``p_model``); ``allowance``: how much
    noisier than the repeats a clean candidate may be (both are stated for a candidate that noisy)."""

    sigma: np.ndarray
    p_model: float
    rho: float
    n_eff: float
    dof: float            # effective draws the band's RMS rests on (median over steps)
    repeats: int
    repeat_outside: int   # the repeats' own steps outside a band made without them (leave-one-out)
    alpha: float
    beta: float
    allowance: float = 1.0
    _tail: np.ndarray | None = field(default=None, repr=False)

    @property
    def p_bar(self) -> float:
        return self.alpha / (self.alpha + self.beta)

    @property
    def trials(self) -> int:
        return max(int(round(self.n_eff)), 1)

    def tail(self) -> np.ndarray:
        """P(count >= x) for x = 0..trials independent steps (beta-binomial: the chance is uncertain)."""
        if self._tail is None:
            self._tail = stats.betabinom_tail(self.trials, self.alpha, self.beta)
        return self._tail

    def p_value(self, outside: int, n: int) -> float:
        """The share of clean pairs with at least ``outside`` of ``n`` steps outside the band."""
        if outside <= 0 or n <= 0:
            return 1.0
        x = int(math.ceil(outside * self.trials / n - 1e-9))
        t = self.tail()
        return float(t[min(max(x, 1), len(t) - 1)]) if x <= self.trials else 0.0


def null_model(stack: np.ndarray, sigma: np.ndarray, band: np.ndarray, window_counts: np.ndarray,
               opt: ScalarOptions, floor: float) -> NullModel:
    """The null model of the band test from the repeats' deltas ``stack`` [repeats x steps].

    A clean candidate is one more run of the baseline: its delta at a step is a draw of the noise the repeats
    measured. How often such a draw leaves the band is measured on the repeats themselves, each step of each
    repeat against the band its window makes without that step (leave-one-out): run-to-run deltas have heavier
    tails than a normal (kurtosis 4-6 on the demo pairs), so the Student-t odds of ``band_k`` x an estimated
    RMS (``p_model``) alone would understate it. The count is uncertain (a repeat of 100 steps sees one or two),
    so the chance is a Beta distribution (Jeffreys prior, mean never below ``p_model``), and a candidate's count
    is judged against the beta-binomial it implies, on independent steps: autocorrelated outside steps come in
    runs, so every count is scaled to ``n_eff`` = n (1 - rho) / (1 + rho).

    A repeat of the baseline shares its framework's kernels; a clean candidate computes in others and is
    noisier (candidate / repeat RMS of the delta on 41 clean demo pairs: 0.13-2.8, median ~1; docs/calibration.md).
    So the band is ``opt.noise_allowance`` times wider and the odds are those of a candidate that much noisier:
    the t odds at band / (allowance x RMS), the repeats' own steps counted against the band that much narrower
    (a repeat outside band_k x its RMS is what such a candidate does outside the band)."""
    kappa = max(float(opt.noise_allowance), 1.0)
    reps, n = stack.shape
    with np.errstate(invalid="ignore", divide="ignore"):
        z = np.where(sigma > 0, stack / sigma, np.nan)
    rhos = [stats.lag1(row) for row in z if np.isfinite(row).sum() >= 3]
    rho = float(np.mean(rhos)) if rhos else 0.0
    n_eff = stats.effective_n(n, rho)
    dof = np.maximum(window_counts * reps * (1.0 - rho) / (1.0 + rho), 1.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.where(sigma > 0, band / (kappa * sigma), np.inf)
    # the mean t tail over the steps: per distinct (ratio, dof), on at most 2000 evenly spaced steps (where the
    # floor holds the band the ratio varies from step to step; a mean needs no more)
    pick = np.linspace(0, n - 1, min(n, 2000)).astype(np.int64) if n else np.zeros(0, dtype=np.int64)
    key_r = np.round(np.minimum(ratio[pick], 1e3), 2)
    pairs, inverse = np.unique(np.stack([key_r, np.round(dof[pick], 0)], axis=1), axis=0, return_inverse=True)
    tails = np.array([stats.t_sf2(r, d) if r < 1e3 else 0.0 for r, d in pairs])
    p_model = float(np.mean(tails[np.asarray(inverse).reshape(-1)])) if n else 0.0
    # leave-one-out: each repeat's step against the window's RMS without it
    sq = np.where(np.isfinite(stack), stack, np.nan) ** 2
    total = pd.Series(np.nansum(sq, axis=0)).rolling(opt.band_window, center=True, min_periods=1).sum().to_numpy()
    count = pd.Series(np.isfinite(stack).sum(axis=0).astype(float)).rolling(
        opt.band_window, center=True, min_periods=1).sum().to_numpy()
    with np.errstate(invalid="ignore", divide="ignore"):
        loo = np.sqrt(np.maximum(total - np.nan_to_num(sq), 0.0) / np.maximum(count - 1.0, 1.0))
    loo_band = np.maximum(opt.band_k * loo, floor / kappa)      # the band without the allowance
    outside = int(np.sum(np.isfinite(stack) & (np.abs(np.nan_to_num(stack)) > loo_band)))
    scale = n_eff / n if n else 1.0
    k_eff, m_eff = outside * scale, reps * n * scale
    alpha, beta = k_eff + 0.5, max(m_eff - k_eff, 0.0) + 0.5
    if alpha / (alpha + beta) < p_model < 1:
        alpha = p_model * beta / (1.0 - p_model)
    return NullModel(sigma, p_model, rho, n_eff, float(np.median(dof)) if n else 0.0, reps, outside, alpha, beta,
                     kappa)


def _outside_test(st: StageResult, null: NullModel, key: str, label: str, n_out: int, n: int,
                  opt: ScalarOptions, fail_verdict: str) -> str:
    """The count of steps outside the band against the count a clean pair shows (:func:`null_model`), at the
    stated false-alarm rates. Returns its verdict (capped at ``fail_verdict``)."""
    p_value = null.p_value(n_out, n)
    st.details.update(p_value=p_value, false_alarm_rate=opt.fail_rate, effective_steps=null.n_eff,
                      noise_allowance=null.allowance,
                      lag1_autocorrelation=null.rho, p_step_outside=null.p_bar, p_step_model=null.p_model,
                      repeat_outside_steps=null.repeat_outside, band_draws=null.dof)
    verdict = "fail" if p_value < opt.fail_rate else "warn" if p_value < opt.warn_rate else "pass"
    if verdict == "fail":
        verdict = fail_verdict
    st.add(Finding(st.name, verdict, key, "outside_band_fraction", n_out / n if n else 0.0, opt.max_outside,
                   f"{label}: {n_out} of {n} steps outside the benchmark band ({n_out / n:.1%}); a clean pair "
                   f"leaves this band at a step with probability ~{null.p_bar:.2g} (band {opt.band_k:g} x the "
                   f"rolling RMS of {null.repeats} repeat(s), x {null.allowance:g}: a candidate up to "
                   f"{null.allowance:g}x noisier than the repeat counts as clean; the repeat's own steps left the "
                   f"band without that factor {null.repeat_outside} time(s) leave-one-out) and its {n} steps "
                   f"are worth {null.n_eff:.3g} independent ones (lag-1 "
                   f"autocorrelation {null.rho:.2f}): this many or more outside in {p_value:.2g} of clean pairs "
                   f"(fails below {opt.fail_rate:g}, warns below {opt.warn_rate:g})"))
    return verdict


def _outside_share(st: StageResult, key: str, label: str, n_out: int, n: int, frac: float, common: pd.Index,
                   outside: np.ndarray, band_source: str, opt: ScalarOptions, fail_verdict: str) -> str:
    """No repeat, no measured noise: the share of steps outside the relative band against ``max_outside``
    (a rule of thumb with no stated false-alarm rate; the finding says so)."""
    st.details.update(p_value=None, false_alarm_rate=None, effective_steps=None)
    if too_many_outside(n_out, n, opt.max_outside):
        st.add(Finding(st.name, fail_verdict, key, "outside_band_fraction", frac, opt.max_outside,
                       f"{label}: {frac:.1%} of {n} steps outside the benchmark band "
                       f"(allowed {opt.max_outside:.0%}; band from {band_source})"))
        return "fail"
    if frac > opt.max_outside:
        step = int(common[int(np.flatnonzero(outside)[0])])
        st.add(Finding(st.name, "warn", key, "outside_band_fraction", frac, opt.max_outside,
                       f"{label}: one step of {n} outside the benchmark band (step {step}; too few steps to judge "
                       f"a share against the allowed {opt.max_outside:.0%}: run longer)"))
        return "warn"
    st.add(Finding(st.name, "pass", key, "outside_band_fraction", frac, opt.max_outside,
                   f"{label}: {frac:.1%} of {n} steps outside the benchmark band "
                   f"(allowed {opt.max_outside:.0%}; no repeat measured the noise: no stated false-alarm rate)"))
    return "pass"


def _needed_outside(null: NullModel, n: int, rate: float) -> float:
    """The fewest steps outside (of ``n``) that the band test fails at ``rate``."""
    t = null.tail()
    hit = np.flatnonzero(t < rate)
    if not len(hit):
        return math.inf
    return float(hit[0]) * n / null.trials

def _expected_outside(offset: float, sigma: np.ndarray, band: np.ndarray) -> float:
    """Expected steps outside the band when the candidate sits ``offset`` from the baseline at every step, on
    top of the noise (normal, scale ``sigma``; no noise: outside exactly where the offset exceeds the band)."""
    if len(sigma) > 2000:          # a long run: evenly spaced steps stand for it (the bisection calls this often)
        pick = np.linspace(0, len(sigma) - 1, 2000).astype(np.int64)
        return _expected_outside(offset, sigma[pick], band[pick]) * len(sigma) / 2000
    s = np.where(sigma > 0, sigma, np.nan)
    with np.errstate(invalid="ignore", divide="ignore"):
        hi = (offset - band) / s
        lo = (-offset - band) / s
    cdf = stats.norm_cdf
    q = np.where(np.isfinite(hi), cdf(np.nan_to_num(hi)) + cdf(np.nan_to_num(lo)), (offset > band).astype(float))
    return float(np.sum(q))


def power(st: StageResult, null: NullModel | None, band: np.ndarray, b: np.ndarray, delta: np.ndarray,
          finite: np.ndarray, label: str, repeats: int, opt: ScalarOptions) -> dict[str, Any]:
    """What this long run can tell: the smallest sustained offset of the candidate that fails it (at the fail
    rate, expected count of steps outside on the fail line: detected about half the time, surely beyond), the
    offset a pass rules out (the mean delta's upper confidence bound at the fail rate, autocorrelation-aware),
    and, when the evidence is too thin for the user's margin (``step_rtol`` of the quantity), the steps that
    would make it enough."""
    n = int(len(b))
    scale = float(np.mean(np.abs(b[np.isfinite(b)]))) if np.isfinite(b).any() else math.nan
    out: dict[str, Any] = {"target": opt.step_rtol, "scale": scale}
    d = delta[finite]
    n_eff_c = st.details.get("bias_effective_steps") or 1.0
    spread = st.details.get("delta_std")
    if len(d) > 1 and spread is not None and math.isfinite(spread):
        margin = abs(float(d.mean())) + stats.norm_isf(opt.fail_rate / 2) * spread / math.sqrt(n_eff_c)
        out["margin"] = margin
        out["margin_rel"] = margin / scale if scale else math.nan
    if null is None:
        detect = opt.rtol * scale if math.isfinite(scale) else math.nan
        out.update(detectable=detect, detectable_rel=opt.rtol, kind="no repeat",
                   text=(f"no repeat measured the noise: a sustained {label} offset beyond the relative band "
                         f"({opt.rtol:.2%} of the {label}) at more than {opt.max_outside:.0%} of the {n} steps fails; "
                         "no stated false-alarm rate (pass --repeat)"))
        return out
    need = _needed_outside(null, n, opt.fail_rate)
    if not math.isfinite(need):
        out.update(detectable=math.inf, detectable_rel=math.inf, kind="band test",
                   text=(f"with {repeats} repeat(s) and {n} steps ({null.n_eff:.3g} independent) even every step "
                         f"outside the band would not fail at {opt.fail_rate:g}: run more steps"))
        return out
    lo, hi = 0.0, float(np.nanmax(band)) * 4 + 1e-30
    noise = null.sigma * null.allowance        # the noisiest candidate still counted clean
    while _expected_outside(hi, noise, band) < need and hi < 1e30:
        hi *= 2
    for _ in range(50):
        mid = 0.5 * (lo + hi)
        if _expected_outside(mid, noise, band) >= need:
            hi = mid
        else:
            lo = mid
    rel = hi / scale if scale else math.inf
    out.update(detectable=hi, detectable_rel=rel, kind="band test", needed_outside=need)
    text = (f"with {repeats} repeat(s) and {n} steps, a sustained {label} offset of {hi:.3g} ({rel:.3%} of the "
            f"{label}) fails this stage (at a false-alarm rate of {opt.fail_rate:g})")
    if "margin" in out and st.verdict in ("pass", "skipped"):
        text += f"; this pass bounds the candidate's mean offset by {out['margin']:.3g} ({out['margin_rel']:.3%})"
    if rel > opt.step_rtol:
        steps = int(math.ceil(n * (rel / opt.step_rtol) ** 2))
        out["steps_needed"] = steps
        text += (f"; too coarse for the {opt.step_rtol:.2%} margin: about {steps} steps (or more repeats) "
                 "would resolve it")
    out["text"] = text
    return out


def _late_gap(st: StageResult, key: str, label: str, common: pd.Index, delta: np.ndarray,
              band: np.ndarray, finite: np.ndarray, opt: ScalarOptions, fail_verdict: str) -> None:
    n = len(common)
    k = max(int(n * opt.tail), opt.sustain)
    if n < 2 * k or k < 2:
        return
    tail = slice(n - k, n)
    head = slice(0, n // 2)
    ok = finite[tail]
    if not ok.any():
        return
    tail_gap = float(np.mean(np.abs(delta[tail][ok])))
    tail_band = float(np.mean(band[tail][ok]))
    head_ok = finite[head]
    head_gap = float(np.mean(np.abs(delta[head][head_ok]))) if head_ok.any() else math.inf
    head_band = float(np.mean(band[head][head_ok])) if head_ok.any() else 0.0
    st.details["late_gap"] = {"tail_steps": [int(common[n - k]), int(common[-1])],
                              "tail_mean_abs_delta": tail_gap, "tail_mean_band": tail_band}
    if tail_gap > tail_band and head_gap <= head_band:
        mean_tail = float(np.mean(delta[tail][ok]))
        st.add(Finding(st.name, fail_verdict, key, "late_stage_gap", mean_tail, tail_band,
                       f"{label}: late-stage gap: over steps {int(common[n - k])}-{int(common[-1])} the "
                       f"candidate is {mean_tail:+.4g} from the baseline on average (band {tail_band:.3g}), "
                       f"while the first half agreed"))
