"""Issue 38: local-norm tables combined in memory are checked as the files are, and a printed MindFormers
parallel config whose offset does not add up is a note, not an exit 2 (comparators/local_norms.py)."""

from __future__ import annotations

import numpy as np
import pytest

from comparators.local_norms import combine_tables, read_local_norms
from core.errors import BadInput
from sources.mindformers_log import parse_mindformers_dir
from tests.test_inputs_refused_config import _msrun

NAME = "decoder.layers.0.mlp.linear_fc1.weight"


def _rank(rank: int, tp_size: int, norm: float = 1.0) -> tuple[dict, dict[str, np.ndarray]]:
    return ({"rank": rank, "tp_rank": rank, "tp_size": tp_size},
            {"name": np.asarray([NAME]), "norm": np.asarray([norm]), "numel": np.asarray([8]),
             "tp_rank": np.asarray([rank]), "tp_size": np.asarray([tp_size]),
             "tp_partition_dim": np.asarray([0])})


def test_in_memory_tables_agreeing_combine() -> None:
    got = combine_tables([_rank(0, 2, 3.0), _rank(1, 2, 4.0)])
    assert got[NAME].full_norm() == pytest.approx(5.0) and got[NAME].missing_shards == []


def test_in_memory_tp_size_disagreeing_across_ranks_is_refused_naming_both() -> None:
    """Rank 1 claiming TP size 4 while rank 0 says 2 passed in memory (the file reader refused it)."""
    with pytest.raises(BadInput) as e:
        combine_tables([_rank(0, 2), _rank(1, 4)])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("rank 1: key 'local_norm/tp_size'") and "rank 0" in msg, msg


def test_in_memory_negative_norm_is_refused_as_from_a_file() -> None:
    with pytest.raises(BadInput, match="rank 0's local_norm table: key 'local_norm/norm'"):
        combine_tables([_rank(0, 1, -1.0)])


def test_a_printed_offset_that_does_not_add_up_is_a_note_and_norms_read_as_dp(tmp_path) -> None:
    """pipeline_stage 2 with num_layers 2 and offset [1, 0] makes stages of 2 + 1 layers: the msrun reader
    notes it, and the local-norm reader then places the ranks as DP ranks with the same words (before, its
    strategy.meta() call raised the BadInput: exit 2 for a report the rest of the path reads)."""
    run = parse_mindformers_dir(_msrun(tmp_path, **{"parallel_config.data_parallel": 1,
                                                    "parallel_config.pipeline_stage": 2,
                                                    "model.model_config.offset": [1, 0]}))
    said = "parallel_config in the printed config not read: MindFormers offset [1, 0]"
    assert any(said in n for n in run.notes), run.notes
    norms, info = read_local_norms(run, 1)
    assert info["layout_from"].startswith(f"assumed ({said}") and info["parallel"]["dp"] == 2
    (tmp_path / "ok").mkdir()
    assert set(norms) == set(parse_mindformers_dir(_msrun(tmp_path / "ok")).local_norm_table(1)["name"])
