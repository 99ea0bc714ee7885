"""MindFormers log importer on lines MindFormers' own Trainer printed (tests/data/, see make_mindformers_logs.py)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from align.core.errors import BadInput
from align.sources.mindformers_log import parse_mindformers_log

DATA = Path(__file__).parent / "data"
REAL = DATA / "mindformers_train.log"


def test_real_trainer_log():
    run = parse_mindformers_log(REAL)
    loss = run.series("loss")
    assert list(loss.index) == [1, 2, 3, 4, 5, 6]
    text = REAL.read_text()
    # every printed step loss is read back exactly
    for step, value in loss.items():
        assert f"step:[{step:>5}/    6], loss:[{value:.6f}/" in text
    assert run.has("grad_norm") and run.has("lr") and run.has("loss_scale")
    assert run.notes == []


def test_local_norm_blocks_are_squared_sums_in_optimizer_order():
    run = parse_mindformers_log(REAL)
    assert sorted(run.local_norms) == [1, 2, 3, 4, 5, 6]
    for step, table in run.local_norms.items():
        assert table["name"].iloc[0] == "#0"
        assert (table["numel"] > 0).all()
        # sqrt of the sum of squared local norms is the global norm MindFormers logged for the step
        assert math.sqrt(float((table["norm"] ** 2).sum())) == pytest.approx(run.series("grad_norm")[step], rel=1e-5)


def test_wrapped_copy_of_the_real_log(tmp_path):
    width = 100
    out = []
    for ln in REAL.read_text().splitlines():
        out += [ln[i:i + width] for i in range(0, max(len(ln), 1), width)]
    p = tmp_path / "wrapped.log"
    p.write_text("\n".join(out) + "\n")
    run = parse_mindformers_log(p)
    ref = parse_mindformers_log(REAL)
    assert np.array_equal(run.series("loss").to_numpy(), ref.series("loss").to_numpy())
    assert np.array_equal(run.series("grad_norm").to_numpy(), ref.series("grad_norm").to_numpy())
    assert any("wrapped" in n for n in run.notes)


def test_garbled_step_line_is_skipped_with_a_note(tmp_path):
    lines = REAL.read_text().splitlines()
    i = next(i for i, ln in enumerate(lines) if "step:[    3/" in ln)
    lines[i] = lines[i].replace("loss:[", "loss:[4.1x")
    p = tmp_path / "garbled.log"
    p.write_text("\n".join(lines) + "\n")
    run = parse_mindformers_log(p)
    assert 3 not in run.series("loss").index
    assert any("step 3" in n for n in run.notes)


def test_no_step_lines(tmp_path):
    p = tmp_path / "x.log"
    p.write_text("2024-01-01 - INFO - nothing to see\n")
    with pytest.raises(BadInput, match="no MindFormers"):
        parse_mindformers_log(p)


def test_bulk_and_line_by_line_paths_agree(tmp_path):
    from align.examples.make_example_logs import mindformers_log
    p = tmp_path / "a.log"
    mindformers_log(p, 50, seed=3)
    fast = parse_mindformers_log(p)
    q = tmp_path / "b.log"  # one odd line sends the whole file down the careful path
    q.write_text(p.read_text() + "x - INFO - { Epoch:[  1/  1], step:[   51/   50], loss:[oops/1.0]\n")
    careful = parse_mindformers_log(q)
    assert any("step 51" in n for n in careful.notes)
    for key in ("loss", "loss_avg", "lr", "grad_norm", "per_step_time_ms", "loss_scale", "overflow"):
        assert np.array_equal(fast.series(key).to_numpy(), careful.series(key).to_numpy()), key
        assert list(fast.series(key).index) == list(range(1, 51))
