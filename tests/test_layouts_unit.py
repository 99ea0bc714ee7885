"""Layout recombination without a training run: context-parallel batch chunks (against megatron-core's own
split), a DP rank's batch joined from its ranks, the global batch across DP sizes, and optimizer-evidence
shards (distributed-optimizer ranges x TP shards) merged into whole tensors, with the refusals for
incomplete or inconsistent shards. The real runs that produce these layouts are in test_megatron_layouts.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from core.errors import BadInput
from runstore import RunReader, RunWriter, cp_join, cp_split, dp_batches, global_batch, read_step1_file
from runstore.step1_file import shard_file, write_step1_shard


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_split_is_megatrons_and_cp_join_inverts_it(cp: int, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("megatron.core")
    from megatron.core import utils
    from megatron.core.utils import get_batch_on_this_cp_rank

    # its group helpers answer 1 / 0 without a process group: ask the stand-in group directly
    monkeypatch.setattr(utils, "get_pg_size", lambda group=None: group.size())
    monkeypatch.setattr(utils, "get_pg_rank", lambda group=None: group.rank())

    rng = np.random.default_rng(cp)
    s = 4 * cp
    whole = {"tokens": rng.integers(0, 100, (3, s)), "loss_mask": rng.random((3, s)).astype(np.float32),
             "attention_mask": rng.random((3, 1, s, s)) > 0.5}
    for key, arr in whole.items():
        dim = 2 if key == "attention_mask" else 1
        parts = []
        for r in range(cp):
            mine = get_batch_on_this_cp_rank({key: torch.from_numpy(arr)}, cp_group=_FakeGroup(cp, r))[key]
            np.testing.assert_array_equal(mine.numpy(), cp_split(arr, cp, r, dim))
            parts.append(mine.numpy())
        np.testing.assert_array_equal(cp_join(parts, dim), arr)


class _FakeGroup:
    """What get_batch_on_this_cp_rank asks of a CP group: its size and this rank."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _store(root, ranks: dict[int, dict], batches: dict[int, dict[str, np.ndarray]]) -> RunReader:
    for rank, info in ranks.items():
        with RunWriter(root, rank=rank, meta={"framework": "megatron-core"}, rank_info=info) as w:
            for key, arr in batches[rank].items():
                w.put_array(1, f"batch/{key}", arr, {"micro_batches": 1})
            w.log_scalars(1, {"loss": 1.0})
            w.finish_step()
    return RunReader(root)


def test_dp_rank_batch_joined_from_tp_copies_and_cp_chunks(tmp_path) -> None:
    whole = np.arange(2 * 8).reshape(2, 8)
    ranks, batches = {}, {}
    for rank in range(4):   # tp_rank = rank % 2, cp_rank = rank // 2
        ranks[rank] = {"tp_rank": rank % 2, "cp_rank": rank // 2, "cp": 2, "dp_rank": 0, "tp": 2}
        batches[rank] = {"tokens": cp_split(whole, 2, rank // 2, 1)}
    batches[3] = {"tokens": batches[3]["tokens"] + 1}   # TP rank 1 of CP rank 1 loaded other data
    (dp, batch, files, notes, micro), = dp_batches(_store(tmp_path / "a", ranks, batches), 1)
    np.testing.assert_array_equal(batch["tokens"], whole)
    assert dp == 0 and micro == 1 and len(files) == 4
    assert len(notes) == 1 and "rank 3's tokens differs from rank 2's" in notes[0]
    del ranks[2], ranks[3]
    with pytest.raises(BadInput, match=r"context-parallel rank\(s\) \[1\] of 2"):
        list(dp_batches(_store(tmp_path / "b", ranks, batches), 1))


def test_global_batch_is_micro_batch_major() -> None:
    a = np.array([[0], [2]])    # DP rank 0: micro-batches 0 and 1 (one sample each)
    b = np.array([[1], [3]])    # DP rank 1
    np.testing.assert_array_equal(global_batch([({"tokens": a}, 2), ({"tokens": b}, 2)])["tokens"],
                                  [[0], [1], [2], [3]])
    with pytest.raises(ValueError, match="different numbers of micro-batches"):
        global_batch([({"tokens": a}, 2), ({"tokens": b[:1]}, 1)])


def _whole() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"fc1": rng.random((8, 3)).astype(np.float32), "proj": rng.random((3, 4)).astype(np.float32),
            "norm": rng.random(5).astype(np.float32)}


def _write_shards(folder, whole: dict[str, np.ndarray], *, drop: tuple[str, int] | None = None,
                  shift: int = 0) -> None:
    """What 4 ranks (TP=2 x DP=2, distributed optimizer) write: each TP shard's flat range cut in two by DP;
    fc1 gated ([gate_r; up_r] per TP rank), proj split on dim 1, norm duplicated (TP rank 0 writes)."""
    layouts = {"fc1": (0, 1), "proj": (1, 0), "norm": (-1, 0)}
    for rank in range(4):
        tp_rank, dp_rank = rank % 2, rank // 2
        arrays: dict[str, dict[str, np.ndarray]] = {"grad": {}, "init": {}, "weight": {}}
        shard, shape = {}, {}
        for name, (dim, gated) in layouts.items():
            full = whole[name]
            if dim < 0:
                if tp_rank:
                    continue
                local = full
            elif gated:
                local = np.concatenate([h[tp_rank * 2:(tp_rank + 1) * 2] for h in np.split(full, 2)], axis=0)
            else:
                local = np.split(full, 2, axis=dim)[tp_rank]
            flat = local.reshape(-1)
            cut = flat.size // 2 + (shift if rank == 3 else 0)
            start, end = (0, cut) if dp_rank == 0 else (cut, flat.size)
            if drop == (name, rank):
                continue
            for kind, scale in (("grad", 1.0), ("init", 2.0), ("weight", 3.0)):
                arrays[kind][name] = flat[start:end] * scale
            shard[name] = np.array([start, end, dim, tp_rank if dim >= 0 else 0, 2, gated])
            shape[name] = np.array(local.shape)
        write_step1_shard(shard_file(folder, rank), arrays["grad"], arrays["init"], arrays["weight"], shard, shape,
                          rank=rank, world=4)


def test_shards_merge_into_whole_tensors(tmp_path) -> None:
    whole = _whole()
    _write_shards(tmp_path / "run", whole)
    got = read_step1_file(tmp_path / "run")             # the run store: its evidence/optimizer_step1/
    for kind, scale in (("grad", 1.0), ("init", 2.0), ("weight", 3.0)):
        assert sorted(got[kind]) == sorted(whole)
        for name, arr in whole.items():
            np.testing.assert_array_equal(got[kind][name], arr * scale, err_msg=f"{kind}/{name}")


@pytest.mark.parametrize("fault, message", [
    ({"drop": ("proj", 2)}, r"proj \(TP rank 0\): elements \[3, 6\) recorded by no rank"),
    ({"drop": ("fc1", 1)}, r"fc1 \(TP rank 1\): elements \[0, 6\) recorded by no rank"),
    ({"shift": -1}, r"recorded twice"),
    ({"shift": 1}, r"recorded by no rank"),
])
def test_incomplete_or_overlapping_shards_are_one_line_bad_input(tmp_path, fault, message) -> None:
    _write_shards(tmp_path / "run", _whole(), **fault)
    with pytest.raises(BadInput, match=message) as err:
        read_step1_file(tmp_path / "run")
    assert "\n" not in str(err.value)


def test_missing_or_corrupt_rank_file_is_bad_input(tmp_path) -> None:
    _write_shards(tmp_path / "run", _whole())
    folder = tmp_path / "run" / "evidence" / "optimizer_step1"
    (folder / "rank_00002.npz").write_bytes(b"PK\x03\x04 not a zip")
    with pytest.raises(BadInput, match="rank_00002.npz: not a readable step-1 shard"):
        read_step1_file(folder)
    (folder / "rank_00002.npz").unlink()
    with pytest.raises(BadInput, match=r"no shard of rank\(s\) \[2\] of 4"):
        read_step1_file(folder)
    with pytest.raises(BadInput, match="no evidence/optimizer_step1.npz"):
        read_step1_file(tmp_path)
