"""Issue 38: environment captures whose weight fingerprints hold NaN, inf or a negative norm. NaN / inf is
evidence (the weights hold it): a fail naming the tensor, never a pass; a negative norm no capture writes:
refused in one line naming the file and the field (comparators/environment.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from align.cli import main
from comparators.environment import compare_environments, read_capture
from core.errors import BadInput
from dumpers import environment as envcap
from tests.test_stages import make_run

W = "decoder.final_layernorm.weight"


def _capture(tmp_path: Path, name: str, values: np.ndarray, edit: dict | None = None) -> Path:
    """A real capture (dumpers/environment.py) of one weight, its fingerprint edited by ``edit``."""
    cap = envcap.capture_environment("torch", by="test", observe_random=False,
                                     weights=[(W, lambda: values, "float32"),
                                              ("embedding.word_embeddings.weight", lambda: np.ones(3, np.float32),
                                               "float32")])
    cap["weights"]["params"][W].update(edit or {})
    return envcap.write_capture(tmp_path / name, cap)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_weights_holding_nan_or_inf_are_a_fail_even_when_both_sides_agree(tmp_path: Path, bad: float) -> None:
    """Both sides fingerprint the same weights, one value of which is NaN (inf): the hashes agree, which
    compared as pass; the norm says the weights hold it."""
    values = np.array([1.0, bad, 2.0], np.float32)
    p = _capture(tmp_path, "a.json", values)
    assert "NaN" in p.read_text() or "Infinity" in p.read_text()     # what the writer puts in the JSON
    cap = read_capture(p)
    res = compare_environments(cap, cap)
    assert res.verdict == "fail", [f.message for f in res.findings]
    fnd = [f for f in res.findings if f.metric == "weights_nonfinite"]
    assert {f.component for f in fnd} == {W} and len(fnd) == 2       # named on each side
    assert "baseline weights hold NaN or inf: 1 of 2 tensors" in fnd[0].message and W in fnd[0].message


def test_a_nan_norm_on_one_side_with_equal_hashes_is_a_fail(tmp_path: Path) -> None:
    """A fingerprint whose norm alone is NaN (the hashes equal the other side's) is not a pass either."""
    values = np.array([1.0, 2.0], np.float32)
    good = read_capture(_capture(tmp_path, "good.json", values))
    odd = read_capture(_capture(tmp_path, "odd.json", values, {"norm": float("nan")}))
    res = compare_environments(good, odd)
    assert res.verdict == "fail"
    (fnd,) = [f for f in res.findings if f.metric == "weights_nonfinite"]
    assert fnd.message.startswith("candidate weights hold NaN or inf") and "norm nan" in fnd.message


def test_a_negative_norm_is_refused_naming_file_and_field(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bad = _capture(tmp_path, "neg.json", np.array([1.0, 2.0], np.float32), {"norm": -1})
    with pytest.raises(BadInput) as e:
        read_capture(bad)
    assert str(e.value) == f"{bad}: key 'weights.params.{W}.norm': -1 is negative (an L2 norm is >= 0)"
    run = make_run(tmp_path / "run", steps=2)
    out = tmp_path / "r"
    assert main(["report", "-q", str(run), str(run), "--out", str(out), "--candidate-env", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "neg.json" in err and ".norm': -1 is negative" in err, err
    assert not out.exists()
    assert json.loads(bad.read_text())["weights"]["params"][W]["norm"] == -1
