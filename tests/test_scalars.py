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
