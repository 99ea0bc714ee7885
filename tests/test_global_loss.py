"""A run store's loss is the whole batch's, whichever way its data-parallel ranks logged it.

Megatron's dumper records the loss already reduced over DP (every rank the same); MindFormers' records each
rank's own masked mean. Read from rank 0 alone, a DP=2 MindFormers candidate of the same samples as a DP=1
baseline failed step 1 at 7.6e-3 (issue 37's DP-changing replay)."""

from __future__ import annotations

from pathlib import Path

import pytest

from runstore import RunWriter
from runstore.run import open_store


def _store(root: Path, losses: list[list[float]], masks: list[list[float]] | None, dp: int = 2, pp: int = 1) -> Path:
    world = dp * pp
    for rank in range(world):
        dp_rank, pp_rank = rank % dp, rank // dp
        info = {"dp": dp, "dp_rank": dp_rank, "pp": pp, "pp_rank": pp_rank, "world_size": world}
        with RunWriter(root, rank=rank, meta={"framework": "mindformers"}, rank_info=info) as w:
            if pp_rank != pp - 1:          # only the last pipeline stage computes the loss
                continue
            for i, loss in enumerate(losses[dp_rank]):
                sc = {"loss": loss, "grad_norm": 1.0}
                if masks is not None:
                    sc["loss_mask_sum"] = masks[dp_rank][i]
                w.log_scalars(i + 1, sc)
    return root


def test_dp_ranks_own_losses_are_weighted_by_their_masks(tmp_path: Path) -> None:
    run = open_store(_store(tmp_path / "s", [[4.0, 3.0], [5.0, 3.5]], [[30.0, 10.0], [10.0, 30.0]]))
    assert run.series("loss").tolist() == pytest.approx([(4 * 30 + 5 * 10) / 40, (3 * 10 + 3.5 * 30) / 40])
    assert any("2 data-parallel ranks" in n and "loss_mask_sum" in n for n in run.notes)
    assert run.series("grad_norm").tolist() == [1.0, 1.0]


def test_without_mask_sums_the_ranks_are_averaged_and_the_last_stage_is_read(tmp_path: Path) -> None:
    run = open_store(_store(tmp_path / "s", [[4.0], [5.0]], None, pp=2))
    assert run.series("loss").tolist() == pytest.approx([4.5])
    assert any("averaged" in n for n in run.notes)


def test_a_loss_already_reduced_over_dp_is_read_as_logged(tmp_path: Path) -> None:
    run = open_store(_store(tmp_path / "s", [[4.25, 3.0], [4.25, 3.0]], [[30.0, 10.0], [10.0, 30.0]]))
    assert run.series("loss").tolist() == [4.25, 3.0]
    assert not any("data-parallel" in n for n in run.notes)
