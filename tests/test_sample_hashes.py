"""Per-sample hashes recorded by the Megatron dumper itself (issue 37), checked by the data stage against the
candidate's own record after a replay onto another data-parallel size.

One torchrun launch of tests/megatron_worker.py (2 processes, a real megatron-core GPTModel at DP=2 with
Megatron's DDP and optimizer, the ``attach`` scenario: the pretrain_gpt.py form of the dumper, 3 steps). Its
store is replayed onto DP=1 by MindFormers' replay dataset (:class:`dumpers.mindformers_replay.ReplaySource`),
the candidate store written as MindFormersDumperCallback writes it (tests/test_replay_layout.py helpers).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("mindformers")

from align.checks.data import compare_batches  # noqa: E402
from runstore import RunReader  # noqa: E402
from runstore.batches import sample_hashes  # noqa: E402
from tests.test_megatron_dumper import WORKER, _env  # noqa: E402
from tests.test_replay_layout import candidate_store, replay  # noqa: E402


@pytest.fixture(scope="module")
def dp2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The DP=2 megatron-core store (3 steps, each DP rank its own batch of 2 samples)."""
    out = tmp_path_factory.mktemp("hash_dp2")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", str(WORKER),
           "--out", str(out), "--tp", "1", "--scenarios", "attach"]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=360)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in (0, 1):
        assert json.loads((out / f"result_rank{r}.json").read_text())["attach"]["errors"] == 0
    return out / "attach"


def _edit(store: Path, dest: Path, rank: int, step: int, change) -> Path:  # noqa: ANN001
    """A copy of ``store`` with ``change(h5 file)`` applied to one rank's step file."""
    shutil.copytree(store, dest)
    with h5py.File(dest / "steps" / f"step_{step:08d}" / f"rank_{rank:05d}.h5", "r+") as f:
        change(f)
    return dest


def test_megatron_dumper_records_each_samples_hash(dp2: Path) -> None:
    r = RunReader(dp2)
    assert r.ranks == [0, 1] and r.array_steps() == [1, 2, 3]
    for step in (1, 2, 3):
        seen = []
        for rank in (0, 1):
            sa = r.step_arrays(step, rank)
            batch = {k: sa.data[f"batch/{k}"] for k in ("tokens", "labels", "loss_mask")}
            own = sa.data["batch/sample_hash"]
            assert own.shape == (2,) and own.dtype == np.int64
            np.testing.assert_array_equal(own, sample_hashes(batch))
            assert sa.attrs["batch/sample_hash"]["hashed"] == "tokens,labels,loss_mask"
            seen += own.tolist()
        assert len(set(seen)) == 4      # the two DP ranks trained different samples


def test_replay_dp2_to_dp1_is_proved_from_both_sides_records(dp2: Path, tmp_path: Path) -> None:
    (at1,) = replay(dp2, 1)
    for step, b in at1.items():
        assert b["sample_index"].tolist() == [0, 1, 2, 3]
        base = RunReader(dp2)
        want = np.concatenate([base.step_arrays(step, r).data["batch/sample_hash"] for r in (0, 1)])
        np.testing.assert_array_equal(b["replay_hash"], want)    # the replay's read = the baseline's own record
    cand = candidate_store(tmp_path / "dp1", [at1])
    res = compare_batches(dp2, cand)
    assert res.verdict == "pass" and res.details["samples_compared"] == 12, res.findings
    assert res.details["hashes"] == {"baseline": "recorded", "candidate": "recorded"}
    assert "hashes baseline: its dumper's own record; candidate: its dumper's own record" in res.findings[0].message

    # the candidate's own record of one row differs (its network got another sample): named by step and sample
    def other(f: h5py.File) -> None:
        f["batch/sample_hash"][2] = f["batch/sample_hash"][2] ^ 1
    bad = compare_batches(dp2, _edit(cand, tmp_path / "cand_bad", 0, 2, other))
    (fail,) = [f for f in bad.findings if f.verdict == "fail"]
    assert fail.message.startswith("step 2: the row DP rank 0 trained as sample 2 differs from the baseline's sample 2 "
                                   "of step 2 (sample_hash)"), fail.message


def test_a_baseline_record_that_is_not_its_stored_batch_is_named(dp2: Path, tmp_path: Path) -> None:
    (at1,) = replay(dp2, 1)
    cand = candidate_store(tmp_path / "dp1", [at1])

    def flip(f: h5py.File) -> None:
        f["batch/sample_hash"][1] = f["batch/sample_hash"][1] ^ 1
    res = compare_batches(_edit(dp2, tmp_path / "base_bad", 1, 3, flip), cand)
    (fail,) = [f for f in res.findings if f.verdict == "fail"]
    assert fail.component == "baseline_hash" and fail.message.startswith(
        "step 3: baseline step 3: sample 3's recorded hash (batch/sample_hash) differs from the hash of its stored "
        "tokens, labels and loss_mask"), fail.message      # DP rank 1's row 1 is global sample 3


def test_a_store_without_hashes_still_compares_and_says_so(dp2: Path, tmp_path: Path) -> None:
    old = tmp_path / "old"
    shutil.copytree(dp2, old)
    for f in sorted((old / "steps").glob("step_*/rank_*.h5")):
        with h5py.File(f, "r+") as h5:
            del h5["batch/sample_hash"]
    (at1,) = replay(old, 1)
    res = compare_batches(old, candidate_store(tmp_path / "dp1", [at1]))
    assert res.verdict == "pass" and res.details["hashes"] == {"baseline": "recomputed", "candidate": "recorded"}
    assert "baseline: computed here from its stored batch" in res.findings[0].message
    assert "written before its dumper recorded per-sample hashes" in res.findings[0].message
