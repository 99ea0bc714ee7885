"""check-config on a one-process candidate replaying a DP > 1 baseline (issue 37): without ``data_parallel`` in
the replay's dataset block the candidate trains one rank's share; the checklist names the setting and the number.
The shipped example YAMLs set it, so they replay the whole global batch whatever the baseline's DP."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

pytest.importorskip("mindformers")

from align.checks.config import compare_configs  # noqa: E402
from sources.configs import read_mindformers  # noqa: E402
from tests.test_replay_layout import SEQ, global_batches, write_store  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"
MEGATRON = {"global_batch_size": 4, "micro_batch_size": 2, "seq_length": SEQ, "data_parallel_size": 2}


def _row(tmp_path: Path, dataset_dp: int | None) -> object:
    from demo.mindformers_cpu import trainer_config

    store = write_store(tmp_path / "dp2", global_batches(4), dp=2, micro=1)     # 2 samples per rank, DP=2
    cfg = trainer_config(str(store), steps=2, output_dir=str(tmp_path / "out"))
    if dataset_dp is not None:
        cfg["train_dataset_task"]["dataset_config"]["data_parallel"] = dataset_dp
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    rows, _ = compare_configs(MEGATRON, read_mindformers(tmp_path / "train.yaml"))
    return {r.key: r for r in rows}["global_batch_size"]


def test_one_process_without_data_parallel_is_told_the_setting(tmp_path: Path) -> None:
    row = _row(tmp_path, None)
    assert row.status == "mismatch" and row.mindformers == 2, row
    assert ("this candidate trains rank 0's share only: set data_parallel: 1 in the replay's dataset block "
            "(train_dataset_task.dataset_config) to train the store's whole global batch of 4 samples") in row.note


def test_one_process_with_data_parallel_1_matches(tmp_path: Path) -> None:
    row = _row(tmp_path, 1)
    assert row.status == "match" and row.mindformers == 4, row


@pytest.mark.parametrize("name", ["mindformers_qwen3_tiny_cpu.yaml", "mindformers_qwen3_moe_tiny_cpu.yaml"])
def test_shipped_examples_replay_the_whole_global_batch(name: str) -> None:
    cfg = yaml.safe_load((EXAMPLES / name).read_text())
    assert cfg["use_parallel"] is False
    assert cfg["train_dataset_task"]["dataset_config"]["data_parallel"] == 1
