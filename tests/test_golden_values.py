"""Megatron-LM golden-values JSON as a run: both layouts Megatron's CI has used, detection, bad input, and a
pair reported like two logs through the CLI."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from align.cli import main
from core.errors import BadInput
from sources import detect, load_run


def golden(path, losses, start=1, interval=1, grad_nan_step=None, extra=True):
    """A file shaped as Megatron writes it (GoldenValueMetric.model_dump, indent 4, step keys as strings)."""
    steps = list(range(start, start + interval * len(losses), interval))
    data = {"lm loss": {"start_step": steps[0], "end_step": steps[-1], "step_interval": interval,
                        "values": {str(s): round(v, 5) for s, v in zip(steps, losses, strict=True)}},
            "num-zeros": {"start_step": steps[0], "end_step": steps[-1], "step_interval": interval,
                          "values": {str(s): "nan" if s == grad_nan_step else 1200.0 + s for s in steps}}}
    if extra:
        data["iteration-time"] = {"start_step": steps[0], "end_step": steps[-1], "step_interval": interval,
                                  "values": {str(s): 0.25 for s in steps}}
        data["mem-allocated-bytes"] = {"start_step": steps[0], "end_step": steps[-1], "step_interval": interval,
                                       "values": None}
    path.write_text(json.dumps(data, indent=4))
    return path


def test_dict_layout_reads_every_metric(tmp_path):
    p = golden(tmp_path / "golden_values_dev_dgx_h100.json", [10.8, 10.7, 10.5, 10.2], start=1, interval=5,
               grad_nan_step=6)
    assert detect(p) == "golden_values"
    run = load_run(p)
    assert run.kind == "golden_values"
    assert run.series("loss").to_dict() == pytest.approx({1: 10.8, 6: 10.7, 11: 10.5, 16: 10.2})
    assert math.isnan(run.series("num_zeros")[6]) and run.series("num_zeros")[11] == 1211.0
    assert run.series("elapsed_s")[16] == 0.25
    assert "mem_allocated_bytes" not in run.scalars
    assert any("NaN" in n for n in run.notes)
    assert run.meta["golden_values"]["lm loss"]["step_interval"] == 5


def test_list_layout_of_older_files(tmp_path):
    # Older Megatron files: a list sliced from the TensorBoard scalars, start_step a 0-based index.
    p = tmp_path / "golden_values.json"
    p.write_text(json.dumps({"lm loss": {"start_step": 0, "end_step": 50, "step_interval": 5,
                                         "values": [10.83369, 10.86796, 10.8992]}}))
    run = load_run(p)
    assert run.series("loss").to_dict() == pytest.approx({1: 10.83369, 6: 10.86796, 11: 10.8992})


@pytest.mark.parametrize("body,why", [
    ('{"lm loss": {"start_step": 1, "end_step": 2, "step_interval": 1, "values": {"1": [1]}}}', "not a number"),
    ('{"lm loss": {"start_step": 1, "end_step": 2, "step_interval": 1, "values": {"x": 1.0}}}', "not an integer"),
    ('{"lm loss": {"start_step": 1, "end_step": 2, "step_interval": 1, "values": 3}}', "not an object or list"),
    ('{"generated_text": {"values": 1, "step_interval": 1}, "x": 1}', "not an object or list"),
    ('{"lm loss": {"start_step": 1, "step_interval": 1, "values": {"1": 1.0}', "garbled JSON"),
])
def test_bad_golden_file_is_one_line(tmp_path, body, why):
    p = tmp_path / "g.json"
    p.write_text(body)
    with pytest.raises(BadInput) as err:
        load_run(p, "golden_values")
    assert str(p) in str(err.value) and why in str(err.value) and "\n" not in str(err.value)


def test_golden_pair_reports_like_two_logs(tmp_path):
    rng = np.random.default_rng(0)
    base = list(10.0 - np.log1p(np.arange(100)) + 0.01 * rng.standard_normal(100))
    a = golden(tmp_path / "a.json", base)
    b = golden(tmp_path / "b.json", [v + (0.3 if i >= 60 else 0.0) for i, v in enumerate(base)])
    out = tmp_path / "ok"
    assert main(["report", str(a), str(a), "--out", str(out), "-q"]) == 0
    code = main(["report", str(a), str(b), "--out", str(tmp_path / "bad"), "-q"])
    s = json.loads((tmp_path / "bad" / "summary.json").read_text())
    assert code == 1 and s["stages"]["long_run"]["divergence_step"] == 61
    assert s["stages"]["step1_loss"]["verdict"] == "pass"


# --- issue 24: a step key or a value that is not what it says is refused, never reshaped -----------------------

def _one(values: str) -> str:
    return '{"lm loss": {"start_step": 1, "end_step": 9, "step_interval": 1, "values": ' + values + '}}'


@pytest.mark.parametrize("body,why", [
    (_one('{"1_0": 1.0}'), "not an integer"),           # int() read it as step 10
    (_one('{"\\u0661": 1.0}'), "not an integer"),        # Arabic-Indic one: int() read it as step 1
    (_one('{"1": 1.0, "1_0": 2.0}'), "not an integer"),  # the fast path too
    (_one('{"1": 1e400}'), "beyond the float range"),    # json.loads read it as inf
    (_one('{"1": -1E+999}'), "beyond the float range"),
    (_one('{"1": ' + "9" * 5000 + '}'), "beyond the float range"),   # int(): 4300-digit limit, a traceback
    (_one('{"1": "1e400"}'), "beyond the float range"),
    (_one('{"1": "1_0"}'), "not a number"),
    ('[' * 100_000 + ']' * 100_000, "nested too deeply"),           # RecursionError, a traceback
    (_one('[' * 50_000 + ']' * 50_000), "nested too deeply"),
])
def test_golden_values_strict_steps_and_numbers(tmp_path, body, why):
    p = tmp_path / "g.json"
    p.write_text(body)
    with pytest.raises(BadInput) as err:
        load_run(p, "golden_values")
    assert str(p) in str(err.value) and why in str(err.value) and "\n" not in str(err.value)


def test_golden_values_nan_and_inf_strings_still_read(tmp_path):
    p = tmp_path / "g.json"
    p.write_text(_one('{"1": "nan", "2": "inf", "3": 2.5, "4": NaN}'))
    s = load_run(p, "golden_values").series("loss")
    assert math.isnan(s[1]) and math.isinf(s[2]) and s[3] == 2.5 and math.isnan(s[4])
