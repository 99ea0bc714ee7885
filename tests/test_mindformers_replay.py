"""Megatron batches replayed by MindFormers' real LlamaForCausalLM on CPU (PYNATIVE, in this process).

The batches are written in the seed layout exactly as Megatron hands them to the model (already shifted:
tokens[t] predicts labels[t]); MindFormers must train on them unchanged, with the loss mask applied.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

mc = pytest.importorskip("demo.mindformers_cpu")

from core.errors import BadInput  # noqa: E402
from dumpers.mindformers import MindFormersDumperCallback, dump_mindformers_step  # noqa: E402
from dumpers.mindformers_replay import MegatronReplayDataset  # noqa: E402
from dumpers.mindspore_dumper import DumpConfig, MindSporeDumper  # noqa: E402
from runstore import RunReader  # noqa: E402
from tests.helpers.numpy_reference import numpy_masked_ce  # noqa: E402

B, S, V = 2, 16, 64


def write_megatron_batches(root: Path, steps: list[int], ranks: tuple[int, ...] = (0,), seed: int = 7,
                           shapes: dict[str, tuple[int, ...]] | None = None) -> None:
    """What Megatron's get_batch returns, per step and rank, as .npy files (no pickle)."""
    rng = np.random.default_rng(seed)
    for step in steps:
        for rank in ranks:
            folder = root / f"step_{step}" / f"rank_{rank}"
            folder.mkdir(parents=True, exist_ok=True)
            seq = rng.integers(1, V, size=(B, S + 1))
            mask = np.ones((B, S), np.float32)
            mask[0, : rng.integers(1, 5)] = 0.0  # masked prompt
            mask[1, -rng.integers(1, 6):] = 0.0   # masked tail
            arrays = {"tokens": seq[:, :-1].astype(np.int64), "labels": seq[:, 1:].astype(np.int64),
                      "loss_mask": mask, "attention_mask": ~np.tril(np.ones((1, 1, S, S), bool))}
            for name, arr in arrays.items():
                if shapes and name in shapes:
                    arr = np.resize(arr, shapes[name])
                np.save(folder / f"{name}.npy", arr, allow_pickle=False)


@pytest.fixture(scope="module")
def batches(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("megatron_batches")
    write_megatron_batches(root, [1, 2, 3])
    mc.set_cpu_context("pynative")
    return root


def test_trainer_replays_batches_unsliced_and_loss_is_masked_mean(batches: Path, tmp_path: Path) -> None:
    """MindFormers' Trainer, dataset from the YAML task type; logits captured by the dumper's hook."""
    net = mc.build_tiny_llama(seed=0)
    dumper = MindSporeDumper(net, tmp_path / "run", DumpConfig(tensors="full", cells=("lm_head",),
                                                                backward=False), framework="mindformers")
    cfg = mc.trainer_config(str(batches), steps=3, output_dir=str(tmp_path / "out"), learning_rate=1e-3)
    assert cfg["train_dataset_task"]["type"] == "MegatronReplayDataset"
    mc.run_trainer(cfg, callbacks=[MindFormersDumperCallback(dumper)], model=net)

    reader = RunReader(tmp_path / "run")
    scalars = reader.scalars(0).set_index("step")
    assert list(scalars.index) == [1, 2, 3]
    names = {p.name for p in net.trainable_params()}
    for step in (1, 2, 3):
        seed = {k: np.load(batches / f"step_{step}" / "rank_0" / f"{k}.npy") for k in ("labels", "loss_mask")}
        arrays = reader.step_arrays(step)
        stats = arrays.table("tensor_stats")
        (row,) = stats.index[(stats.module == "lm_head") & (stats.kind == "forward.output.0")]
        logits = arrays.data[f"tensors/{int(stats.order[row]):06d}"]
        assert logits.shape == (B, S, V)  # all 16 positions: no second shift
        expected = numpy_masked_ce(logits, seed["labels"], seed["loss_mask"])
        assert scalars.loc[step, "loss"] == pytest.approx(expected, rel=2e-6, abs=1e-6)
        # A mask ignored (plain mean) would differ: the check can fail.
        assert abs(numpy_masked_ce(logits, seed["labels"], np.ones_like(seed["loss_mask"])) - expected) > 1e-4

        norms = arrays.table("local_norm")
        assert set(norms.name) == names and len(norms) == len(names)
        total = float(np.sqrt(np.sum(norms.norm.to_numpy() ** 2)))
        assert total == pytest.approx(scalars.loc[step, "grad_norm"], rel=1e-5)  # global norm before clipping
        assert arrays.attrs["local_norm"]["where"] == "mindformers.MFTrainOneStepCell.local_norm"
    # The Trainer's optimizer groups parameters (decay first): naming by position in trainable_params()
    # would have been wrong, naming by the optimizer's order is what the table holds.
    assert list(reader.step_arrays(1).table("local_norm").name) != [p.name for p in net.trainable_params()]


def test_python_dataset_plain_loop_named_norms(batches: Path, tmp_path: Path) -> None:
    """The same class from Python (no YAML): rows equal the files, a plain loop trains on them."""
    ds = MegatronReplayDataset(data_dir=str(batches), rank=0)
    rows = list(ds.create_dict_iterator(output_numpy=True, num_epochs=1))
    assert len(rows) == 3
    for step, row in enumerate(rows, 1):
        folder = batches / f"step_{step}" / "rank_0"
        np.testing.assert_array_equal(row["input_ids"], np.load(folder / "tokens.npy"))
        np.testing.assert_array_equal(row["labels"], np.load(folder / "labels.npy"))
        np.testing.assert_array_equal(row["loss_mask"], np.load(folder / "loss_mask.npy"))
        assert row["input_ids"].dtype == np.int32 and row["loss_mask"].dtype == np.float32

    net = mc.build_tiny_llama(seed=1)
    cell = mc.build_train_cell(net, learning_rate=1e-3)
    dumper = MindSporeDumper(net, tmp_path / "run", framework="mindformers")
    for step, row in enumerate(rows, 1):
        out = cell(*mc.llama_inputs(row))
        named = dump_mindformers_step(dumper, step, out, cell.optimizer, batch=row)
        assert list(named) == [p.name for p in net.trainable_params()]
        gnorm = float(out[4].asnumpy().reshape(-1)[0])
        assert float(np.sqrt(sum(v * v for v in named.values()))) == pytest.approx(gnorm, rel=1e-5)
    dumper.close()
    reader = RunReader(tmp_path / "run")
    sc = reader.scalars(0)
    assert list(sc.loss_mask_sum) == [float(r["loss_mask"].sum()) for r in rows]
    np.testing.assert_array_equal(reader.step_arrays(2).data["batch/input_ids"], rows[1]["input_ids"])


def _build(root: Path, **cfg: object) -> object:
    from mindformers.dataset.build_dataset import build_dataset

    return build_dataset({"type": "MegatronReplayDataset", "dataset_config": {"data_dir": str(root), **cfg}})


def _one_line_error(root: Path, match: str, **cfg: object) -> str:
    with pytest.raises(BadInput, match=match) as info:
        _build(root, **cfg)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_error_missing_step(tmp_path: Path) -> None:
    write_megatron_batches(tmp_path, [1, 2, 4])
    msg = _one_line_error(tmp_path, r"step 3 missing")
    assert str(tmp_path) in msg


def test_error_missing_rank_folder(tmp_path: Path) -> None:
    write_megatron_batches(tmp_path, [1], ranks=(0, 1))
    write_megatron_batches(tmp_path, [2], ranks=(1,))
    _one_line_error(tmp_path, r"step_2/rank_0: rank 0 missing from step 2", rank=0)
    assert _build(tmp_path, rank=1).get_dataset_size() == 2  # rank 1 has both steps


def test_error_pickled_npy(tmp_path: Path) -> None:
    write_megatron_batches(tmp_path, [1, 2])
    from tests.helpers.object_npy import write_object_npy

    write_object_npy(tmp_path / "step_2" / "rank_0" / "labels.npy", shape=(B, S))
    _one_line_error(tmp_path, r"step_2/rank_0/labels\.npy: holds pickled objects", steps=[2])


def test_error_mismatched_shapes(tmp_path: Path) -> None:
    write_megatron_batches(tmp_path, [1], shapes={"labels": (B, S - 1)})
    _one_line_error(tmp_path, r"labels shape \(2, 15\) does not match tokens \(2, 16\)")
    other = tmp_path / "across"
    write_megatron_batches(other, [1])
    write_megatron_batches(other, [2], shapes={"tokens": (B, S + 2), "labels": (B, S + 2),
                                               "loss_mask": (B, S + 2)})
    _one_line_error(other, r"step_2/rank_0: input_ids shape \(2, 18\) differs from step 1's \(2, 16\)")
