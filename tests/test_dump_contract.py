"""The dumper contract both dumpers share (dumpers/contract.py): one DumpConfig, one step bookkeeping."""

from __future__ import annotations

import numpy as np
import pytest

from dumpers.contract import DumpConfig, StepBookkeeping, dumps_rank, merge_micro_batches


def test_one_config_for_both_dumpers() -> None:
    cfg = DumpConfig()
    assert cfg.out is None and cfg.modules == ("*",) and cfg.cells is None and cfg.tensors == "off"
    assert cfg.backward and cfg.batch and cfg.local_norms and not cfg.seed_layout and not cfg.background_writes
    assert DumpConfig(modules="fc*").modules == ("fc*",)
    # MindSpore's word for the same patterns
    assert DumpConfig(cells=("lm_head",)).modules == ("lm_head",) == DumpConfig(cells="lm_head").cells
    with pytest.raises(ValueError, match="give one of the two"):
        DumpConfig(modules=("a",), cells=("b",))
    with pytest.raises(ValueError, match="tensors"):
        DumpConfig(tensors="some")
    with pytest.raises(ValueError, match="nan_trace"):
        DumpConfig(nan_trace="some")


class _Steps(StepBookkeeping):
    def __init__(self, **cfg: object) -> None:
        self.config = DumpConfig(**cfg)
        self._select_steps()

    def state(self, step: int) -> tuple[bool, bool]:
        self._open_step(step)
        return self._array_step, self._tensor_step


def test_step_bookkeeping() -> None:
    s = _Steps()
    assert s._step is None and s.state(5) == (True, False) and s._step == 5
    s._close_step()
    assert s._step is None
    s = _Steps(steps="1-3", tensor_steps=[2, 7], tensors="stats")
    assert [s.state(n) for n in (1, 2, 4, 7)] == [(True, False), (True, True), (False, False), (False, False)]
    s = _Steps(steps="1,2", tensors="full")            # tensor_steps default to steps
    assert [s.state(n) for n in (1, 3)] == [(True, True), (False, False)]


def test_ranks_and_micro_batches() -> None:
    assert dumps_rank(DumpConfig(), 7) and dumps_rank(DumpConfig(ranks=[0, 7]), 7)
    assert not dumps_rank(DumpConfig(ranks=["0"]), 1)
    a, b = np.arange(6).reshape(2, 3), np.arange(6, 12).reshape(2, 3)
    merged = merge_micro_batches({"tokens": [a, b], "labels": [a]})
    assert merged["labels"] is a and merged["tokens"].tolist() == np.concatenate([a, b]).tolist()
