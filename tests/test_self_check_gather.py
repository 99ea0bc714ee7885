"""Gathered layer tensors check themselves (sources.gather_totals): a row joined from its TP ranks' parts must
show the statistics the parts recorded. The store is the real TP=2 megatron-core layer dump of the layout tests
(tests/megatron_layouts_worker.py, scenario tp2: two processes, gloo); the wrong gathers are planted in the
real join (sources.layers.join_parts), and the layer compare that reads them refuses in one line."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

import sources.layers as layers  # noqa: E402
from sources.gather_totals import GatherMismatch, expected, mismatch, tolerance  # noqa: E402
from tests.test_megatron_layouts import _run  # noqa: E402


@pytest.fixture(scope="module")
def tp2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gather")
    results = _run(out, "tp2", 2)
    assert all(r["tp2"]["errors"] == 0 for r in results.values()), results
    return out / "tp2"


def _gathered_rows(store: Path) -> list[dict]:
    src = layers.gather_layers(layers.layer_source(store))
    rows, has = src.layer_rows(1)
    assert has and src.notes[1] == ["rows gathered from ranks [0, 1] (DP rank 0)"]
    return [r for r in rows if isinstance(r["ref"], tuple) and r["ref"][0] == "gather"]


def test_every_gathered_row_has_its_parts_statistics(tp2) -> None:
    """All 84 rows of step 1 that TP=2 splits (column-parallel outputs, a gated fc1's halves, row-parallel
    inputs) join into tensors whose counts, extremes and norms are their parts' (measured: worst 0.13 of the
    line); the layer compare of the store against itself reads every one and passes."""
    from comparators.layer_tensors import compare_layer_tensors

    rows = _gathered_rows(tp2)
    assert len(rows) == 84
    worst = 0.0
    for r in rows:
        e = r["ref"][5]
        assert e["parts"] == 2 and e["numel"] == r["numel"] and str(tp2) in e["what"]
        whole = layers.load_ref(r["ref"])
        x = whole.astype(np.float64).ravel()
        rel = abs(math.sqrt(float(x @ x)) - e["norm"]) / e["norm"]
        worst = max(worst, rel / tolerance(whole.size, 2))
    assert worst < 1.0, worst
    a = layers.gather_layers(layers.layer_source(tp2))
    res = compare_layer_tensors(a, layers.gather_layers(layers.layer_source(tp2)), None, step=1)
    assert res.verdict == "pass" and res.details["compared"] == 172 and res.details["mode"] == "tensor"


@pytest.mark.parametrize("plant, says", [
    (lambda parts: [[row[0]] * len(row) for row in parts], "has L2 norm"),      # rank 0's part twice
    (lambda parts: [row[:-1] for row in parts], "(a part left out)"),          # the last TP part lost
    (lambda parts: [row + row[:1] for row in parts], "(a part joined twice)"),  # rank 0's part joined again
])
def test_planted_wrong_gather_is_refused_naming_the_row(tp2, monkeypatch, plant, says) -> None:
    """A join that takes TP rank 0's part twice (same element count, another norm), loses the last part, or
    joins rank 0's again: the compare refuses in one line naming the store file, the row and both numbers,
    and judges nothing."""
    from comparators.layer_tensors import compare_layer_tensors

    real = layers.join_parts
    monkeypatch.setattr(layers, "join_parts", lambda parts, tp, cp: real(plant(parts), tp, cp))
    a = layers.gather_layers(layers.layer_source(tp2))
    with pytest.raises(GatherMismatch) as err:
        compare_layer_tensors(a, layers.gather_layers(layers.layer_source(tp2)), None, step=1)
    msg = str(err.value)
    assert "\n" not in msg and str(tp2) in msg and (" forward." in msg or " backward." in msg), msg
    assert says in msg and msg.endswith("not judged: the gather or the store is wrong"), msg


def test_extremes_and_nonfinite_rows() -> None:
    """A part with the same squares but other values (read from another rank or step) shows in the extremes; a
    row with NaN checks its element count only."""
    x = np.array([[1.0, -2.0], [3.0, 0.5]], dtype=np.float32)
    e = expected({"numel": 4, "norm": float(np.linalg.norm(x)), "max": 3.0, "min": -2.0}, 2, "f.h5: m out")
    assert mismatch(x, e) is None
    # the same squares (the norm agrees), other values: the extremes show it
    assert "has min 0.5, its parts recorded -2" in (mismatch(np.abs(x), e) or "")
    assert "has max 2, its parts recorded 3" in (mismatch(-x, e) or "")
    nan = expected({"numel": 4, "norm": 1.0, "max": 0.0, "min": 0.0, "nan": 1}, 2, "f.h5: m out")
    assert mismatch(x, nan) is None and "holds 2 elements" in (mismatch(x[0], nan) or "")


def test_report_refuses_a_planted_wrong_gather_in_one_line(tp2, tmp_path, monkeypatch, capsys) -> None:
    """Through `align report` (the layer stage, two compare threads): exit 2, the one line naming the rank file
    and the row, no report written."""
    from align.cli import main

    real = layers.join_parts
    monkeypatch.setattr(layers, "join_parts", lambda parts, tp, cp: real([[row[0]] * len(row) for row in parts],
                                                                         tp, cp))
    rc = main(["report", str(tp2), str(tp2), "--out", str(tmp_path / "rep"), "--jobs", "2"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2 and err.startswith(f"align: error: {tp2}/steps/step_00000001/rank_0000") and \
        "linear_qkv forward.output.0: the tensor gathered from 2 parts has L2 norm" in err, err
    assert not (tmp_path / "rep" / "report.html").exists()
