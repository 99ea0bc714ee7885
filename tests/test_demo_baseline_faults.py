"""The paired demo's baseline-side faults (demo.spec.FAULTS of side baseline / both): each fails where it should.

Why a file of its own: each of these faults runs its own baseline, so none needs tests/test_demo.py's clean
pair, and the two files run on two workers (`pytest -n 2 --dist loadfile` gives a worker a file at a time).
No TP=2 repeat (the band does not decide their stages). The pairs' baselines share one Megatron process, their
candidates one MindSpore process (demo.fault_batch).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")
pytest.importorskip("mindspore")
pytest.importorskip("mindformers")

from demo.spec import FAULTS  # noqa: E402
from tests.helpers.demo_checks import dense_fault_fails_at_its_stage, dense_faults, selected  # noqa: E402

BASELINE_SIDE = [n for n, f in FAULTS.items() if "dense" in f.kinds and f.side in ("baseline", "both")]
TEST = "test_baseline_side_fault_fails_at_its_stage_naming_its_component"


@pytest.fixture(scope="module")
def baseline_faults(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                    ) -> tuple[Path, dict[str, dict]]:
    """The baseline-side fault pairs selected in this session (at least one), each on a baseline of its own; the
    baselines share one Megatron process, the candidates one MindSpore process; the first pair's runs once more."""
    out = tmp_path_factory.mktemp("baseline_faults")
    names = selected(request, TEST, "name", BASELINE_SIDE) or BASELINE_SIDE[:1]
    return out, dense_faults(out, names, None, rerun_first=True)


@pytest.mark.parametrize("name", BASELINE_SIDE)
def test_baseline_side_fault_fails_at_its_stage_naming_its_component(
        name: str, baseline_faults: tuple[Path, dict[str, dict]]) -> None:
    out, data = baseline_faults
    dense_fault_fails_at_its_stage(name, data[name], out / name)


def test_runs_write_the_same_stores_after_other_runs_in_their_process(
        baseline_faults: tuple[Path, dict[str, dict]]) -> None:
    """The first pair's baseline and candidate, run again last in their shared processes (after the other faults'
    models, optimizers, data loaders and steps), write their stores bit for bit again: what each process holds
    from an earlier run changes nothing (the first run of a process is what a process of its own writes)."""
    from tests.helpers.store_equal import store_differences

    out, data = baseline_faults
    first = out / next(iter(data))
    for store in ("baseline", "candidate"):
        assert store_differences(first / "runs" / store, first / "again" / store) == [], store
