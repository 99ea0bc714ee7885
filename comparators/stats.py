"""The few distributions the verdicts are stated with: normal and Student-t tails, binomial tails for a
non-integer number of trials, lag-1 autocorrelation and the effective number of independent steps.

Why here and by hand: a verdict is only as good as the false-alarm rate it states ("a clean pair fails this
stage at most 1 time in 1000"), and that needs tail probabilities; comparators import no framework and
scipy is not a dependency (a user with only logs has numpy), so the regularized incomplete beta function,
from which the t and binomial tails follow, is computed here (continued fraction, Numerical Recipes 6.4).

Why autocorrelation: per-step deltas of two training runs are not independent draws; a departure drifts over
many steps. n steps whose deltas have lag-1 autocorrelation rho carry about n (1 - rho) / (1 + rho)
independent observations (the AR(1) variance inflation of a mean), and every count or mean is judged with
that effective n, never the raw one, or a clean pair's slow wander reads as a bias.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np

#: Default false-alarm rates a clean pair is judged with: it fails a stage at most 1 time in FAIL_RATE^-1,
#: it is warned about at most 1 time in WARN_RATE^-1 (per stage).
FAIL_RATE = 1e-3
WARN_RATE = 1e-2
RHO_MAX = 0.98        # autocorrelation used at most: beyond it a series holds ~1 independent value per 100

_N = NormalDist()


def norm_sf(x: float) -> float:
    """P(Z > x), Z standard normal."""
    return 0.5 * math.erfc(x / math.sqrt(2.0))


def norm_cdf(x: np.ndarray) -> np.ndarray:
    """Phi(x) for an array, vectorised (Abramowitz & Stegun 7.1.26 for erf: absolute error below 1.5e-7,
    enough for expected counts; numpy has no erf)."""
    x = np.asarray(x, dtype=np.float64)
    z = np.abs(x) / math.sqrt(2.0)
    t = 1.0 / (1.0 + 0.3275911 * z)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    erf = 1.0 - poly * np.exp(-z * z)
    return 0.5 * (1.0 + np.sign(x) * erf)


def norm_isf(p: float) -> float:
    """x with P(Z > x) = p."""
    p = min(max(p, 1e-300), 1.0 - 1e-16)
    return -_N.inv_cdf(p) if p < 0.5 else _N.inv_cdf(1.0 - p)


def _betacf(a: float, b: float, x: float) -> float:
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-14:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b) (a, b > 0, 0 <= x <= 1)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    lbt = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(lbt) * _betacf(a, b, x) / a
    return 1.0 - math.exp(lbt) * _betacf(b, a, 1.0 - x) / b


def t_sf2(t: float, dof: float) -> float:
    """Two-sided tail P(|T| > t) of Student's t with ``dof`` (>= 1, may be fractional) degrees of freedom;
    the normal tail when dof is large."""
    t = abs(t)
    if not math.isfinite(t):
        return 0.0
    if dof > 1e6:
        return 2.0 * norm_sf(t)
    dof = max(dof, 1.0)
    return betainc(dof / 2.0, 0.5, dof / (dof + t * t))


def t_isf2(p: float, dof: float) -> float:
    """t with P(|T| > t) = p (bisection on :func:`t_sf2`)."""
    lo, hi = 0.0, max(10.0, 2.0 * norm_isf(p / 2.0))
    while t_sf2(hi, dof) > p:
        hi *= 2.0
        if hi > 1e12:
            return math.inf
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if t_sf2(mid, dof) > p:
            lo = mid
        else:
            hi = mid
    return hi


def binom_sf(k: float, n: float, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p), continued to non-integer k and n (k = 0: 1): I_p(k, n - k + 1)."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    if p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    return betainc(k, n - k + 1.0, p)


def lag1(x: np.ndarray) -> float:
    """Lag-1 autocorrelation of the finite values of ``x`` (mean removed), clipped to [0, RHO_MAX]: a negative
    one would claim more independent values than there are steps. 0 for fewer than 3 values or no spread."""
    v = np.asarray(x, dtype=np.float64)
    v = v[np.isfinite(v)]
    if len(v) < 3:
        return 0.0
    v = v - v.mean()
    den = float(np.dot(v, v))
    if den <= 0.0:
        return 0.0
    rho = float(np.dot(v[:-1], v[1:])) / den
    return min(max(rho, 0.0), RHO_MAX)


def effective_n(n: float, rho: float) -> float:
    """Independent observations in ``n`` AR(1) steps with lag-1 autocorrelation ``rho`` (at least 1)."""
    if n <= 1:
        return float(n)
    return max(1.0, min(float(n), n * (1.0 - rho) / (1.0 + rho)))


def max_quantile(n: float, rate: float) -> float:
    """The multiple of a quantity's noise (its standard deviation) that the largest of ``n`` independent
    normal draws exceeds with probability ``rate`` (Bonferroni: each draw at rate / n, two-sided)."""
    return norm_isf(rate / (2.0 * max(n, 1.0)))


def multiplicity(n: float, rate: float) -> float:
    """How much a threshold made for one judged value grows when it is applied to ``n`` of them at once and
    the chance that any clean one crosses it must stay ``rate``: max_quantile(n) / max_quantile(1) (>= 1)."""
    return max_quantile(n, rate) / max_quantile(1, rate)


def betabinom_tail(n: int, alpha: float, beta: float) -> np.ndarray:
    """P(X >= x) for x = 0..n, X ~ BetaBinomial(n, alpha, beta): a count of n trials whose success chance is
    itself uncertain (Beta(alpha, beta): what a repeat's own count says about it). The pmf by the ratio of
    neighbouring terms, vectorised (a 100k-step run: a few ms)."""
    n = max(int(n), 0)
    x = np.arange(n, dtype=np.float64)
    log_ratio = np.log(n - x) - np.log(x + 1.0) + np.log(x + alpha) - np.log(n - x - 1.0 + beta)
    log0 = math.lgamma(n + beta) + math.lgamma(alpha + beta) - math.lgamma(beta) - math.lgamma(n + alpha + beta)
    logpmf = log0 + np.concatenate([[0.0], np.cumsum(log_ratio)])
    pmf = np.exp(logpmf - logpmf.max())
    pmf /= pmf.sum()
    return np.minimum(np.cumsum(pmf[::-1])[::-1], 1.0)
