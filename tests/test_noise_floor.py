"""Noise floors (comparators.noise_floor) on small plain data: the ratio rule, the floor minimum, the dtype line
as upper bound, group spreads for rows without a repeat counterpart, and each comparator's use of them.
The real pairs: tests/test_demo.py (the clean dense pair judged against its TP=2 repeat's floors; the
log_softmax_bf16 fault failing at lr0_run under float16's line)."""

from __future__ import annotations

import math

import numpy as np

from comparators import noise_floor as nf
from comparators import optimizer_check as oc
from comparators.layer_tensors import apply_floors
from comparators.local_norms import ShardNorm, compare_norm_entries
from models import load_mapping

FP16_LINE = (1e-3, 1e-2)


def test_ratio_to_the_floor_judges_under_the_dtype_line() -> None:
    floor = nf.Floor(2e-6, "repeat vs baseline")
    clean = nf.judge(3e-6, floor, FP16_LINE)
    assert clean.verdict == "pass" and clean.ratio == 1.5 and clean.decided_by == "dtype line"
    # 150 floors apart, still 3x under float16's pass line: the floor fails it
    fault = nf.judge(3e-4, floor, FP16_LINE)
    assert (fault.verdict, fault.dtype_verdict, fault.decided_by) == ("fail", "pass", "floor")
    assert math.isclose(fault.threshold, 2e-5) and math.isclose(fault.ratio, 150.0)
    assert nf.judge(4e-5, floor, FP16_LINE).verdict == "warn"          # 20 floors: between pass and fail


def test_dtype_line_stays_the_upper_bound() -> None:
    large = nf.Floor(5e-2, "a noisy repeat")
    j = nf.judge(2e-2, large, FP16_LINE)
    assert j.ratio < 1 and j.verdict == "fail" and j.threshold == FP16_LINE[0]
    assert nf.judge(math.inf, large, FP16_LINE).verdict == "fail"


def test_a_bit_identical_repeat_does_not_turn_rounding_into_fails() -> None:
    zero = nf.Floor(0.0, "bit-identical repeat")
    assert zero.effective == nf.FLOOR_MIN
    assert nf.judge(3 * nf.EPS["float32"], zero, FP16_LINE).verdict == "pass"     # a few ulps: rounding
    assert nf.judge(100 * nf.FLOOR_MIN, zero, FP16_LINE).verdict == "fail"


def test_without_a_floor_the_dtype_line_judges_and_says_so() -> None:
    j = nf.judge(5e-4, nf.missing("no --repeat run"), FP16_LINE)
    assert j.verdict == "pass" and j.ratio is None and "no --repeat run" in j.floor_source
    assert "dtype line" in j.says()


def test_group_floors_spread_and_missing_counterparts() -> None:
    own = {"a": 1e-5, "b": 1e-4, "c": None, "d": 7e-6}
    floors = nf.group_floors(own, {"a": "g", "b": "g", "c": "g", "d": "h"}, "repeat R vs baseline")
    rms = math.sqrt((1e-5 ** 2 + 1e-4 ** 2) / 2)
    assert math.isclose(floors["a"].value, rms) and "its own" in floors["a"].source   # a chance-small draw
    assert floors["b"].value == 1e-4 and floors["b"].source.endswith("this row")
    assert math.isclose(floors["c"].value, rms) and "no counterpart" in floors["c"].source
    assert floors["d"].value == 7e-6
    none = nf.group_floors({"x": None}, {"x": "g"}, "repeat R")
    assert none["x"].effective is None and "no floor" in none["x"].source


def _row(module: str, kind: str, order: int, value: float, shape: str = "4x8", mode: str = "stats") -> dict:
    direction = "backward" if kind.startswith("backward") else "forward"
    return {"module": module, "kind": kind, "order": order, "value": value, "verdict": "pass", "threshold": 2e-3,
            "mode": mode, "direction": direction, "judged_dtype": "float16", "dtype": "float32",
            "shape": "4x8", "candidate_shape": shape}


def test_layer_rows_judged_against_their_repeat_rows() -> None:
    rows = [_row("a", "forward.output.0", 0, 1e-4), _row("b", "forward.output.0", 1, 6e-2),
            _row("c", "forward.output.0", 2, 1.5e-3), _row("d", "backward.grad_output.0", 3, 2e-5)]
    floor_rows = [_row("a", "forward.output.0", 0, 1e-4), _row("b", "forward.output.0", 1, 1e-4),
                  _row("c", "forward.output.0", 2, 0.3, shape="4x4"),          # a TP shard: not a counterpart
                  _row("d", "backward.grad_output.0", 3, 2e-5)]
    apply_floors(rows, floor_rows, "repeat R vs baseline, step 1", "unused")
    a, b, c, d = rows
    assert a["verdict"] == "pass" and math.isclose(a["ratio"], 1.0)
    assert b["verdict"] == "fail" and b["decided_by"] == "dtype line"          # above float16's warn line anyway
    assert c["verdict"] == "warn" and c["decided_by"] == "floor" and "no counterpart" in c["floor_source"]
    assert d["verdict"] == "pass" and d["floor"] == 2e-5
    bare = [_row("a", "forward.output.0", 0, 1e-4)]
    apply_floors(bare, None, "repeat R", "no --repeat run")
    assert bare[0]["ratio"] is None and bare[0]["verdict"] == "pass" and "no --repeat run" in bare[0]["floor_source"]


def _norms(values: dict[str, float]) -> dict[str, ShardNorm]:
    return {n: ShardNorm(-1, 1, {0: v}, {0: 16}, {0}) for n, v in values.items()}


def test_local_norms_judged_against_the_repeats_norms() -> None:
    names = [f"decoder.layers.{i}.pre_mlp_layernorm.weight" for i in range(4)]
    base = {n: 1.0 + i for i, n in enumerate(names)}
    rep = {n: v * (1 + 2e-5) for n, v in base.items()}
    cand = {n: v * (1 + 1e-5) for n, v in base.items()}
    cand[names[2]] = base[names[2]] * (1 + 2e-3)          # 100 floors, under float16's 5e-3 pass line
    m = load_mapping("megatron_core__mindformers_mcore_dense")
    res = compare_norm_entries(_norms(base), _norms(cand), m, pass_tol=5e-3, warn_tol=5e-2,
                               repeats=[("repeat", _norms(rep))], info={"step": 1})
    assert res.verdict == "fail"
    (hit,) = [f for f in res.findings if f.verdict != "pass"]
    assert hit.component == names[2] and "noise floor" in hit.message
    assert res.details["noise_floor"]["with_floor"] == 4
    before = compare_norm_entries(_norms(base), _norms(cand), m, pass_tol=5e-3, warn_tol=5e-2)
    assert before.verdict == "pass" and before.details["noise_floor"]["without_floor"] == 4


def test_optimizer_floor_is_rounding_or_the_spread_of_the_rows() -> None:
    rng = np.random.default_rng(3)
    w0 = {f"p{i}": (0.02 * rng.normal(size=64)).astype(np.float32) for i in range(5)}   # init-sized weights
    du = {k: np.float32(1e-3) * np.sign(rng.normal(size=64)).astype(np.float32) for k in w0}
    after_b = {k: w0[k] - du[k] for k in w0}
    after_c = dict(after_b)
    after_c["p3"] = w0["p3"] - du["p3"] * np.float32(1 + 5e-4)    # float32's line: a warning, not a fail
    res = oc.compare_updates(w0, after_b, after_c)
    (hit,) = [f for f in res.findings if f.verdict != "pass"]
    assert hit.component == "p3" and hit.verdict == "fail"
    row = next(r for r in res.details["parameters"] if r["name"] == "p3")
    assert row["dtype_verdict"] == "warn" and row["decided_by"] == "floor" and "rounding" in row["floor_source"]
    assert row["ratio"] > nf.FAIL_RATIO
