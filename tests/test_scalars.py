"""Scalar comparator edge cases: the float32 rounding floor of the band."""

from __future__ import annotations

import numpy as np
import pytest

from comparators.scalars import ScalarOptions, band_floor, compare_scalars
from runstore.run import Run, make_series


def run(values, name):
    steps = np.arange(1, len(values) + 1)
    return Run(name, "runstore", scalars={"loss": make_series(steps, values, "loss")})


def test_rounding_between_frameworks_is_not_a_departure():
    loss = np.linspace(5.0, 1.0, 200).astype(np.float32).astype(np.float64)
    eps = float(np.finfo(np.float32).eps)
    repeat = loss.copy()                        # a bit-identical repeat: its band alone would be 0
    two_ulps = loss - 2 * eps * loss            # steady, one-sided: the cross-entropy summed in another order
    res = compare_scalars(run(loss, "b"), run(two_ulps, "c"), [run(repeat, "r")])
    assert res.stages["long_run"].verdict == "pass"
    assert res.stages["long_run"].details["band_floor"] == band_floor(ScalarOptions(), loss)


def test_a_real_shift_still_fails_and_the_floor_can_be_turned_off():
    loss = np.linspace(5.0, 1.0, 200)
    shifted = loss + 1e-4                       # ~170 float32 ulps of 5.0
    assert compare_scalars(run(loss, "b"), run(shifted, "c"), [run(loss, "r")]).stages["long_run"].verdict == "fail"
    eps = float(np.finfo(np.float32).eps)
    tiny = loss - 2 * eps * loss
    strict = ScalarOptions(band_floor_ulps=0.0, band_floor=0.0)
    assert compare_scalars(run(loss, "b"), run(tiny, "c"), [run(loss, "r")], strict).stages["long_run"].verdict \
        == "fail"


def test_runs_with_no_step_in_common_are_bad_input():
    """Issue 14: a baseline of steps 1-5 and a candidate of steps 101-105 share nothing: exit 2, not pass."""
    from comparators.scalars import require_common_steps
    from core.errors import BadInput
    from runstore.run import Run, make_series

    def run(path: str, steps: range) -> Run:
        return Run(path, "runstore", {}, {"loss": make_series(list(steps), [2.0] * len(steps), "loss")})

    a, b = run("base", range(1, 6)), run("cand", range(101, 106))
    with pytest.raises(BadInput, match="no step in common") as err:
        require_common_steps(a, b)
    assert "steps 1-5" in str(err.value) and "steps 101-105" in str(err.value) and "\n" not in str(err.value)
    require_common_steps(a, run("cand2", range(5, 9)))  # one shared step is enough


def test_a_bias_the_repeat_shows_too_is_not_the_candidates():
    """A repeat at the candidate's precision (the moe demo: float16-rounded attention) sits on the same side
    of the baseline as the candidate: that offset is the baseline's own, not a candidate bias; a repeat with
    a smaller or opposite offset leaves the bias reported."""
    rng = np.random.default_rng(0)
    loss = np.linspace(5.0, 4.0, 40)
    noise = rng.normal(0, 1e-4, 40)
    cand = loss + 1.5e-4 + noise                 # biased high: mean 1.5e-4 against a spread ~1e-4
    shown = loss + 1.8e-4 + rng.normal(0, 1e-4, 40)
    small = loss + 0.2e-4 + rng.normal(0, 1e-4, 40)

    def warned(rep: np.ndarray) -> bool:
        st = compare_scalars(run(loss, "b"), run(cand, "c"), [run(rep, "r")]).stages["long_run"]
        return any(f.metric == "mean_delta_over_spread" and f.verdict != "pass" for f in st.findings)

    assert not warned(shown)
    assert warned(small) and warned(2 * loss - shown)


def test_a_grad_norm_bias_under_the_precisions_ulp_is_noise_not_a_bias():
    """The dense demo's 30-step pair (float16 attention on the candidate): grad norm ~3, the candidate 4e-4
    higher on average, 0.51 x its spread. Under one float16 ulp at the norm's scale (3 x 2**-10 = 2.9e-3)
    that is the precision's noise; at float32 the same shift is a bias and warns."""
    rng = np.random.default_rng(30)
    steps = np.arange(1, 31)
    base = 3.0 + 0.2 * rng.standard_normal(30)
    cand = base + 4e-4 + 7.8e-4 * rng.standard_normal(30)
    rep = base + 8e-4 * rng.standard_normal(30)

    def with_norms(values, name):
        r = run(np.linspace(5.0, 4.0, 30), name)
        r.scalars["grad_norm"] = make_series(steps, values, "grad_norm")
        return r

    runs = (with_norms(base, "b"), with_norms(cand, "c"), [with_norms(rep, "r")])
    at16 = compare_scalars(*runs, precision="float16").stages["grad_norm"]
    at32 = compare_scalars(*runs, precision="float32").stages["grad_norm"]
    assert at32.details["mean_delta_over_spread"] > 0.5
    assert at32.verdict == "warn" and any(f.metric == "mean_delta_over_spread" for f in at32.findings)
    assert at16.verdict == "pass" and at16.details["bias_precision_noise"] > abs(at16.details["mean_delta"])
    # the loss keeps float32's floor whatever the precision: a real loss bias still shows
    assert compare_scalars(*runs, precision="float16").stages["long_run"].details["band_floor"] < 1e-5


def test_steps_outside_are_counted_against_what_a_clean_pair_shows():
    """The share-of-steps rule of thumb (5 %) is gone: the count of steps outside the band is judged against
    the count a clean pair shows (the repeat's own steps against a band made without them, beta-binomial),
    failing at most 1 clean pair in 1000 and warning at most 1 in 100. A clean 12-step pair (seed 5) had one
    step 1.4x its band: a clean pair does that often (the message says how often), so it passes; a run that
    sits outside at most steps fails; so does a long run with many steps outside."""
    rng = np.random.default_rng(1)
    n = 12
    loss = np.linspace(5.0, 4.5, n)
    repeat = loss + rng.normal(0, 1e-4, n)
    band = 3 * np.sqrt(np.mean((repeat - loss) ** 2))       # the band of a single window: 3 x RMS
    cand = loss.copy()
    cand[8] += 1.4 * band                                     # step 9
    st = compare_scalars(run(loss, "b"), run(cand, "c"), [run(repeat, "r")]).stages["long_run"]
    (f,) = [f for f in st.findings if f.metric == "outside_band_fraction"]
    assert (st.verdict, f.verdict) == ("pass", "pass") and st.details["p_value"] > 0.1
    assert f"in {st.details['p_value']:.2g} of clean pairs" in f.message
    assert st.details["false_alarm_rate"] == 1e-3 and st.details["effective_steps"] <= n
    shifted = loss + 2 * band
    assert compare_scalars(run(loss, "b"), run(shifted, "c"), [run(repeat, "r")]).stages["long_run"].verdict == "fail"
    n = 400
    loss = np.linspace(5.0, 4.5, n)
    repeat = loss + rng.normal(0, 1e-4, n)
    cand = loss + rng.normal(0, 1e-4, n)
    clean = compare_scalars(run(loss, "b"), run(cand, "c"), [run(repeat, "r")]).stages["long_run"]
    assert clean.verdict == "pass", clean.findings
    cand[::10] += 10 * 3e-4                                   # 10 % of 400 steps far outside
    assert compare_scalars(run(loss, "b"), run(cand, "c"), [run(repeat, "r")]).stages["long_run"].verdict == "fail"


def test_without_a_repeat_the_share_rule_stays_and_says_it_states_no_rate():
    """No repeat, no measured noise: the relative band and the 5 % share, with no stated false-alarm rate."""
    loss = np.linspace(5.0, 4.5, 40)
    cand = loss.copy()
    cand[[3, 17, 30]] *= 1.05                                 # 7.5 % of 40 steps beyond the 1 % band
    st = compare_scalars(run(loss, "b"), run(cand, "c")).stages["long_run"]
    assert st.verdict == "fail" and st.details["p_value"] is None and st.details["false_alarm_rate"] is None
    assert "no repeat measured the noise" in st.details["power"]["text"]
