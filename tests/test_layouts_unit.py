"""Layout recombination without a training run: context-parallel batch chunks (against megatron-core's own
split), a DP rank's batch joined from its ranks, the global batch across DP sizes, and optimizer-evidence
shards (distributed-optimizer ranges x TP shards) merged into whole tensors, with the refusals for
incomplete or inconsistent shards. The real runs that produce these layouts are in test_megatron_layouts.py.
"""

from __future__ import annotations

from pathlib import Path

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


# -- MindFormers (issue 26): the strategy of a real MindFormers YAML, the ranks' slices and stages -------------

def test_mindformers_strategy_from_the_shipped_pretrain_yamls() -> None:
    """MindFormers' own pretrain YAMLs (tests/data/configs): sizes, optimizer parallel and each layer's stage
    (LayerSetting's rule; checked by hand against MindFormers 2.1.0's own LayerSetting, interleaved too)."""
    import yaml

    from models.mindformers_parallel import layer_stages, strategy_from_yaml

    def read(name: str) -> dict:
        return yaml.safe_load((Path(__file__).parent / "data" / "configs" / name).read_text())

    ds = strategy_from_yaml(read("pretrain_deepseek3_671b.yaml"))
    assert (ds.dp, ds.tp, ds.pp, ds.ep, ds.micro_batch_num, ds.use_seq_parallel) == (4, 8, 8, 32, 32, True)
    assert ds.optimizer_parallel and ds.parallel_mode == 1 and not ds.gradients_mean and ds.world == 256
    stages = ds.meta()["layer_stages"]     # 61 layers, 2 interleaved chunks per stage, offset [[1]*8, [1]*7+[-2]]
    assert len(stages) == 61 and stages[:8] == [0] * 4 + [1] * 4 and stages[32:36] == [0] * 4
    assert [stages.count(s) for s in range(8)] == [8] * 7 + [5]
    qw = strategy_from_yaml(read("pretrain_qwen3_32b_4k.yaml"))
    assert (qw.dp, qw.tp, qw.pp, qw.ep, qw.optimizer_parallel) == (1, 4, 4, 1, False)
    assert [qw.meta()["layer_stages"].count(s) for s in range(4)] == [15, 15, 17, 17]   # offset [-1, -1, 1, 1]
    with pytest.raises(BadInput, match="offset"):
        layer_stages(8, 4, [1, 1, 1, 1])


def test_mindformers_rank_parts_follow_mindspores_slicing() -> None:
    """Which slice of each parameter a rank holds: MindFormers' default mcore split dims, MindSpore's tensor
    map convention (axis k = device-matrix axis len-1-k), optimizer-parallel parts of dim 0, EP by stage index."""
    from models.mindformers_parallel import ParallelStrategy, rank_part, slice_index, split_for_rank

    s = ParallelStrategy(dp=2, tp=2, ep=2, pp=2, optimizer_parallel=True)
    assert s.coords(5) == {**s.coords(5), "pp_rank": 1, "dp_rank": 0, "tp_rank": 1, "ep_rank": 1}
    qkv = rank_part("decoder.layers.0.self_attention.linear_qkv.weight", (8, 4), s, 3)
    assert (qkv["tp_partition_dim"], qkv["tp_rank"], qkv["dp_shard"], qkv["dp_rank"], qkv["dp_size"]) == (0, 1, 1, 1, 2)
    proj = rank_part("decoder.layers.0.self_attention.linear_proj.weight", (4, 8), s, 2)
    assert (proj["tp_partition_dim"], proj["tp_rank"]) == (1, 0)
    norm = rank_part("decoder.layers.0.input_layernorm.weight", (8,), s, 3)   # whole: parts over all 4 ranks
    assert (norm["tp_partition_dim"], norm["tp_size"], norm["dp_rank"], norm["dp_size"]) == (-1, 1, 3, 4)
    odd = rank_part("embedding.word_embeddings.weight", (7, 4), s, 1)        # vocab not divisible: whole
    assert odd["tp_size"] == 1
    # a layout entry (dev matrix (dp, cp, tp), tensor map) wins over the defaults
    assert slice_index([2, 1, 2], [-1, 0], 3) == (1, 2, 1) and slice_index([2, 1, 2], [1, -1], 3) == (0, 1, 0)
    assert slice_index([2, 1, 2], [2, 0], 3) == (3, 4, 0)
    x = np.arange(32.0).reshape(8, 4)
    parts = [split_for_rank("decoder.layers.0.mlp.experts.weight1", x, s, r) for r in range(4)]
    np.testing.assert_array_equal(np.concatenate([parts[0], parts[2], parts[1], parts[3]]), x)   # ep, then dp part
