"""The paired demo's baseline-side faults (demo.spec.FAULTS of side baseline / both): each fails where it should.

Why a file of its own: each of these faults runs its own baseline, so none needs tests/test_demo.py's clean
pair, and the two files run on two workers (`pytest -n 2 --dist loadfile` gives a worker a file at a time).
No TP=2 repeat (the band does not decide their stages).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")
pytest.importorskip("mindspore")
pytest.importorskip("mindformers")

from demo.spec import FAULTS  # noqa: E402
from tests.helpers.demo_checks import dense_fault_fails_at_its_stage  # noqa: E402

BASELINE_SIDE = [n for n, f in FAULTS.items() if "dense" in f.kinds and f.side in ("baseline", "both")]


@pytest.mark.parametrize("name", BASELINE_SIDE)
def test_baseline_side_fault_fails_at_its_stage_naming_its_component(name: str, tmp_path: Path) -> None:
    dense_fault_fails_at_its_stage(name, tmp_path / name, None)
