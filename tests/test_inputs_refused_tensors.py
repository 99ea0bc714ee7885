"""Issue 38: full tensors (``tensors/<order>`` in run-store step files) whose declared size the file cannot
hold, or no step file's array reaches, are refused in one line naming file and dataset before anything is
read or allocated, on each road a compare reads them: the dispatcher (comparators/tensor_dispatch.py), one
work item on its own (comparators/tensor_pair.py) and a gathered row's parts (sources/layers.py load_ref).
Before, fill values of chunks never written compared as a pass, or the candidate's damaged tensor was
silently compared by its statistics."""

from __future__ import annotations

import os
from pathlib import Path

import h5py
import numpy as np
import pytest

from comparators.layer_tensors import compare_layer_tensors
from comparators.tensor_pair import compare_pair
from core.errors import BadInput
from runstore import RunWriter
from sources.layers import layer_source, load_ref, release_files

KEY = "tensors/000001"
BIG = 1 << 24          # 64 MiB of float32 declared by a step file of a few KiB


def _store(root: Path, scale: float = 1.0) -> Path:
    """A run store of three small full tensors (step 1, rank 0) and their statistics."""
    rng = np.random.default_rng(0)
    arrs = [rng.standard_normal((4, 8)).astype(np.float32) * scale for _ in range(3)]
    with RunWriter(root, rank=0, meta={"framework": "megatron-core"}) as w:
        for i, a in enumerate(arrs):
            w.put_array(1, f"tensors/{i:06d}", a)
        w.put_table(1, "tensor_stats", {
            "order": np.arange(3), "module": np.array([f"decoder.layers.{i}" for i in range(3)]),
            "kind": np.array(["forward.output.0"] * 3), "dtype": np.array(["float32"] * 3),
            "shape": np.array(["4x8"] * 3), "numel": np.full(3, 32),
            "max": np.array([a.max() for a in arrs], np.float64), "min": np.array([a.min() for a in arrs], np.float64),
            "mean": np.array([a.mean() for a in arrs], np.float64),
            "norm": np.array([np.linalg.norm(a) for a in arrs], np.float64),
            "nan": np.zeros(3, int), "inf": np.zeros(3, int)})
    return root


def _step_file(root: Path) -> Path:
    (f,) = sorted((root / "steps").rglob("*.h5"))
    return f


def _damage(root: Path, how: str) -> Path:
    """Replace ``tensors/000001`` of the store's step file: a dataset declaring more than the file holds
    (contiguous or chunked, never written), one declaring 4 TiB, or a group."""
    f = _step_file(root)
    with h5py.File(f, "a") as h5:
        del h5[KEY]
        if how == "beyond_file":
            h5.create_dataset(KEY, shape=(BIG,), dtype="<f4")
        elif how == "unwritten_chunks":
            h5.create_dataset(KEY, shape=(BIG,), dtype="<f4", chunks=(1 << 12,))
        elif how == "absurd":
            h5.create_dataset(KEY, shape=(1 << 40,), dtype="<f4", chunks=(1 << 16,))
        else:
            h5.create_group(KEY)
    assert os.path.getsize(f) < 1 << 20
    return f


def _compare(base: Path, cand: Path):
    return compare_layer_tensors(layer_source(base), layer_source(cand), jobs=1)


def test_clean_stores_compare_by_their_tensors(tmp_path: Path) -> None:
    res = _compare(_store(tmp_path / "b"), _store(tmp_path / "c"))
    assert res.verdict == "pass" and res.details["compared"] == 3


@pytest.mark.parametrize("how", ["beyond_file", "unwritten_chunks"])
def test_both_sides_declaring_more_than_their_files_is_refused_not_a_pass(tmp_path: Path, how: str) -> None:
    """Equal declared sizes on both sides: the fill values of data never written compared equal (a pass)."""
    b, c = _store(tmp_path / "b"), _store(tmp_path / "c")
    fb = _damage(b, how)
    _damage(c, how)
    with pytest.raises(BadInput) as e:
        _compare(b, c)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{fb}: '{KEY}': declares {4 * BIG} bytes"), msg


@pytest.mark.parametrize("how", ["absurd", "group"])
def test_a_candidate_tensor_declaring_4_tib_or_a_group_is_refused(tmp_path: Path, how: str) -> None:
    """One side damaged: the sizes differ, and the row was compared by its statistics without a word."""
    b, c = _store(tmp_path / "b"), _store(tmp_path / "c")
    fc = _damage(c, how)
    with pytest.raises(BadInput) as e:
        _compare(b, c)
    said = "beyond the" if how == "absurd" else "is a group, expected an array"
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{fc}: '{KEY}'") and said in msg, msg


def test_one_work_item_checks_its_datasets_itself(tmp_path: Path) -> None:
    """compare_pair run without the dispatcher (its documented plain-data contract) checks the sizes too."""
    fb, fc = _step_file(_store(tmp_path / "b")), _damage(_store(tmp_path / "c"), "beyond_file")
    row = {"order": 1, "module": "decoder.layers.1", "kind": "forward.output.0", "dtype": "float32",
           "shape": "4x8"}
    task = {"a": {**row, "ref": ("h5", str(fb), KEY)}, "b": {**row, "ref": ("h5", str(fc), KEY)},
            "full": True, "transpose": False}
    with pytest.raises(BadInput, match=f"^{fc}: '{KEY}': declares {4 * BIG} bytes"):
        compare_pair(task)


def test_a_gathered_part_is_checked_before_it_is_allocated(tmp_path: Path) -> None:
    f = _damage(_store(tmp_path / "c"), "unwritten_chunks")
    try:
        assert load_ref(("h5", str(f), "tensors/000000")).shape == (4, 8)
        with pytest.raises(BadInput, match=f"^{f}: '{KEY}': declares {4 * BIG} bytes"):
            load_ref(("h5", str(f), KEY))
        with pytest.raises(BadInput, match=f"^{f}: 'tensors/000009' is a missing object"):
            load_ref(("h5", str(f), "tensors/000009"))
    finally:
        release_files()


def test_a_gathered_part_in_a_fifo_or_a_non_hdf5_file_is_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "rank_00001.h5"
    os.mkfifo(fifo)
    junk = tmp_path / "junk.h5"
    junk.write_bytes(b"\x00" * 4096)
    with pytest.raises(BadInput, match="is a FIFO, not a regular step file"):
        load_ref(("h5", str(fifo), KEY))
    with pytest.raises(BadInput, match=f"^{junk}: not a readable HDF5 file"):
        load_ref(("h5", str(junk), KEY))
