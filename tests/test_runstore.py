"""Run store: round trip, atomic appearance, a killed writer, no pickle."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from core.errors import BadInput
from runstore import RunReader, RunWriter, load_npy, read_seed_batch
from runstore.run import open_store, save_run
from sources import load_run


def test_round_trip(tmp_path):
    with RunWriter(tmp_path / "run", rank=0, meta={"framework": "torch", "parallel": {"tp": 1}},
                   rank_info={"tp_rank": 0}) as w:
        for step in (1, 2, 3):
            w.log_scalars(step, {"loss": 10.0 / step, "grad_norm": float("nan") if step == 2 else 1.0})
            w.put_array(step, "batch/tokens", np.arange(8).reshape(2, 4) + step)
            w.put_table(step, "local_norm", {"name": ["a.weight", "b.bias"], "norm": np.array([1.0, 2.0]),
                                             "numel": np.array([4, 2])})
            w.finish_step()
    r = RunReader(tmp_path / "run")
    assert r.meta["framework"] == "torch" and r.ranks == [0]
    assert r.array_steps() == [1, 2, 3] and r.incomplete == []
    sa = r.step_arrays(2)
    assert sa.data["batch/tokens"].tolist() == [[2, 3, 4, 5], [6, 7, 8, 9]]
    t = sa.table("local_norm")
    assert t["name"].tolist() == ["a.weight", "b.bias"] and t["norm"].tolist() == [1.0, 2.0]
    run = open_store(tmp_path / "run")
    assert run.series("loss").to_dict() == pytest.approx({1: 10.0, 2: 5.0, 3: 10 / 3})
    assert math.isnan(run.series("grad_norm")[2])  # a NaN the run logged stays a NaN, it is not dropped


def test_a_table_is_one_compound_dataset_and_the_older_column_groups_still_read(tmp_path):
    """put_table writes one HDF5 object per table (text as UTF-8, attributes on it); every reader takes it
    and the layout stores written before it hold (a group of one dataset per column) alike."""
    import h5py

    from comparators.local_norms import read_local_norms
    from sources.store_dir import _read_stats

    names = ["embedding.word_embeddings.weight", "décodeur.couche.0.poids"]
    stats = {"order": np.arange(2), "module": ["m.a", "m.b"], "kind": ["forward.output.0"] * 2,
             "dtype": ["float32", "bfloat16"], "shape": ["2x3", "4"], "numel": np.array([6, 4]),
             "max": np.array([1.0, 2.0]), "min": np.array([0.0, -1.0]), "mean": np.array([0.5, 0.1]),
             "norm": np.array([3.0, 4.0]), "nan": np.array([0, 1]), "inf": np.array([0, 0])}
    for layout in ("compound", "groups"):
        root = tmp_path / layout
        with RunWriter(root) as w:
            w.log_scalars(1, {"loss": 1.0})
            norms = {"name": np.array(names), "norm": np.array([1.5, 2.5]), "numel": np.array([8, 4])}
            if layout == "compound":
                w.put_table(1, "local_norm", norms, attrs={"global_norm": 2.9})
                w.put_table(1, "tensor_stats", stats)
                w.put_table(1, "empty", {"name": np.array([], dtype=str), "x": np.array([], dtype=np.int64)})
            else:
                for k, v in norms.items():
                    w.put_array(1, f"local_norm/{k}", v)
                w._file_for(1)["local_norm"].attrs["global_norm"] = 2.9
                for k, v in stats.items():
                    w.put_array(1, f"tensor_stats/{k}", np.asarray(v))
            w.finish_step()
        f = RunReader(root).step_file(1)
        with h5py.File(f, "r") as h5:
            assert isinstance(h5["local_norm"], h5py.Dataset if layout == "compound" else h5py.Group)
        sa = RunReader(root).step_arrays(1)
        assert sa.table("local_norm")["name"].tolist() == names
        assert sa.attrs["local_norm"]["global_norm"] == 2.9
        assert sa.table("tensor_stats")["dtype"].tolist() == ["float32", "bfloat16"]
        got, info = read_local_norms(root)
        assert sorted(got) == sorted(names) and got[names[1]].shards == {0: pytest.approx(2.5)}
        rows, _ = _read_stats(f)
        assert [(r["module"], r["nan"], r["shape"]) for r in rows] == [("m.a", 0, "2x3"), ("m.b", 1, "4")]
        if layout == "compound":
            assert sa.table("empty") is None or sa.table("empty").empty
    with RunWriter(tmp_path / "bad") as w, pytest.raises(TypeError, match="no pickle"):
        w.put_table(1, "local_norm", {"name": np.array([object()], dtype=object), "norm": np.array([1.0])})
    with RunWriter(tmp_path / "bad2") as w, pytest.raises(ValueError, match="differ in length"):
        w.put_table(1, "local_norm", {"name": ["a", "b"], "norm": np.array([1.0])})


def test_lowest_rank_wins_and_sparse_keys(tmp_path):
    for rank in (0, 1):
        with RunWriter(tmp_path / "run", rank=rank) as w:
            w.log_scalars(1, {"loss": 1.0 + rank})
            w.log_scalars(2, {"loss": 2.0 + rank, "val_loss": 3.0})
    run = open_store(tmp_path / "run")
    assert run.series("loss").to_dict() == {1: 1.0, 2: 2.0}
    assert run.series("val_loss").to_dict() == {2: 3.0}


def test_imported_log_saves_and_reopens_identically(tmp_path):
    from demo.example_logs import write_examples
    paths = write_examples(tmp_path / "ex", steps=40, fault="nan", fault_step=30)
    run = load_run(paths["candidate"])
    save_run(run, tmp_path / "store")
    back = load_run(tmp_path / "store")
    for key, s in run.scalars.items():
        pd.testing.assert_series_equal(s, back.series(key), check_names=False)


KILLER = textwrap.dedent("""
    import sys, time, numpy as np
    from runstore import RunWriter
    w = RunWriter(sys.argv[1], rank=0)
    for step in range(1, 1000):
        w.log_scalars(step, {"loss": 1.0 / step})
        w.put_array(step, "a", np.zeros(1000))
        if step == 4:
            print("ready", flush=True)
            time.sleep(60)          # killed here: step 4's file is still open
        w.finish_step()
""")


def test_killed_mid_step_leaves_completed_steps_readable(tmp_path):
    root = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", KILLER, str(root)], stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(__file__)))
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    r = RunReader(root)
    assert r.array_steps() == [1, 2, 3]
    assert [(i.step, i.rank) for i in r.incomplete] == [(4, 0)]
    for step in (1, 2, 3):
        assert r.step_arrays(step).data["a"].shape == (1000,)


def test_torn_scalar_line_is_reported(tmp_path):
    with RunWriter(tmp_path / "run") as w:
        w.log_scalars(1, {"loss": 1.0})
        w.log_scalars(2, {"loss": 2.0})
    with open(tmp_path / "run" / "scalars" / "rank_00000.jsonl", "a") as fh:
        fh.write('{"step": 3, "lo')
    run = open_store(tmp_path / "run")
    assert run.series("loss").to_dict() == {1: 1.0, 2: 2.0}
    assert any("step 3" in n and "torn" in n for n in run.notes)


def test_garbled_scalar_line_names_file_and_line(tmp_path):
    with RunWriter(tmp_path / "run") as w:
        w.log_scalars(1, {"loss": 1.0})
    path = tmp_path / "run" / "scalars" / "rank_00000.jsonl"
    path.write_text(path.read_text() + "#garbage\n" + '{"step": 3, "loss": 1}\n')
    with pytest.raises(BadInput, match=r"rank_00000.jsonl:2: garbled"):
        open_store(tmp_path / "run")


def test_no_pickle_anywhere(tmp_path):
    from tests.helpers.object_npy import write_object_npy

    p = write_object_npy(tmp_path / "obj.npy")
    with pytest.raises(BadInput, match="pickled"):
        load_npy(p)
    with RunWriter(tmp_path / "run") as w, pytest.raises(TypeError, match="no pickle"):
        w.put_array(1, "x", np.array([object()], dtype=object))


def test_truncated_npy_and_missing_rank(tmp_path):
    with RunWriter(tmp_path / "run", rank=0) as w:
        w.write_seed_batch(1, {"tokens": np.arange(6).reshape(1, 6), "labels": np.arange(6).reshape(1, 6),
                               "loss_mask": np.ones((1, 6)), "attention_mask": np.ones((1, 1, 6, 6))})
    assert read_seed_batch(tmp_path / "run", 1, 0)["tokens"].shape == (1, 6)
    p = tmp_path / "run" / "step_1" / "rank_0" / "tokens.npy"
    p.write_bytes(p.read_bytes()[:-10])
    with pytest.raises(BadInput, match="tokens.npy"):
        read_seed_batch(tmp_path / "run", 1, 0)
    with pytest.raises(BadInput, match="rank 1 missing"):
        read_seed_batch(tmp_path / "run", 1, 1)
    with pytest.raises(BadInput, match="step 2 missing"):
        read_seed_batch(tmp_path / "run", 2, 0)


def test_corrupt_h5(tmp_path):
    with RunWriter(tmp_path / "run") as w:
        w.put_array(1, "a", np.zeros(3))
        w.finish_step()
    f = next((tmp_path / "run" / "steps").rglob("*.h5"))
    f.write_bytes(b"\x89HDF\r\n\x1a\n" + b"\x00" * 100)
    with pytest.raises(BadInput, match="not a readable HDF5"):
        RunReader(tmp_path / "run").step_arrays(1)


def test_links_are_read_under_every_name(tmp_path):
    """A tensor stored once and linked under a second name reads back under both (read_h5 walks links)."""
    with RunWriter(tmp_path / "run") as w:
        w.put_array(1, "tensors/000000", np.arange(6.0, dtype=np.float32).reshape(2, 3))
        w.link_array(1, "tensors/000001", "tensors/000000")
        w.put_array(1, "tensors/000000", np.ones(2, dtype=np.float32))   # rewritten: the link keeps the old data
        with pytest.raises(KeyError):
            w.link_array(1, "tensors/000002", "tensors/000099")
        w.finish_step()
    data = RunReader(tmp_path / "run").step_arrays(1).data
    assert data["tensors/000001"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert data["tensors/000000"].tolist() == [1, 1] and "tensors/000002" not in data


def test_background_writer_finishes_steps_and_flushes_on_close(tmp_path):
    from runstore import BackgroundWriter

    w = BackgroundWriter(RunWriter(tmp_path / "run"), max_bytes=1000)   # smaller than one array: bounded queue
    for step in (1, 2):
        w.log_scalars(step, {"loss": float(step)})
        for i in range(5):
            w.put_array(step, f"tensors/{i:06d}", np.full(400, step * 10 + i, dtype=np.float32))
        w.link_array(step, "tensors/000005", "tensors/000004")
        w.put_table(step, "tensor_stats", {"order": np.arange(6), "module": ["m"] * 6, "kind": ["k"] * 6})
        if step == 1:
            w.finish_step()          # returns only once the step file has its final name
            assert (tmp_path / "run" / "steps" / "step_00000001" / "rank_00000.h5").exists()
    w.close()                        # step 2 was still open: close finishes it
    r = RunReader(tmp_path / "run")
    assert r.array_steps() == [1, 2] and r.incomplete == []
    assert list(r.scalars()["loss"]) == [1.0, 2.0]
    d = r.step_arrays(2).data
    assert d["tensors/000003"][0] == 23 and d["tensors/000005"][0] == 24


def test_background_writer_reports_failures_and_keeps_going(tmp_path):
    from runstore import BackgroundWriter, WriterErrors

    w = BackgroundWriter(RunWriter(tmp_path / "run"))
    w.put_array(1, "ok", np.zeros(3))
    w.put_array(1, "bad", np.array([object()], dtype=object))      # refused (no pickle), on the thread
    w.put_array(1, "after", np.ones(3))
    with pytest.raises(WriterErrors, match="no pickle"):
        w.finish_step()
    w.put_array(2, "x", np.ones(2))
    w.close()
    r = RunReader(tmp_path / "run")
    assert sorted(r.step_arrays(1).data) == ["after", "ok"] and r.array_steps() == [1, 2]


def test_load_npy_reads_every_layout_np_save_writes_from_many_threads(tmp_path) -> None:
    """load_npy parses the header once (under a lock: numpy's literal_eval is not thread-safe on CPython 3.11)
    and reads the data itself: Fortran order, big-endian, 0-d and empty arrays come back as np.load gives them,
    also when 8 threads read at once."""
    from concurrent.futures import ThreadPoolExecutor

    from runstore.seed_layout import load_npy

    arrays = {"c": np.arange(24, dtype=np.float32).reshape(2, 3, 4),
              "f": np.asfortranarray(np.arange(6.0).reshape(2, 3)), "be": np.arange(5, dtype=">i4"),
              "scalar": np.array(3.5), "empty": np.zeros((0, 3), np.float16), "bool": np.array([True, False])}
    for k, a in arrays.items():
        np.save(tmp_path / f"{k}.npy", a)
    names = list(arrays) * 40
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda k: (k, load_npy(tmp_path / f"{k}.npy")), names))
    for k, a in got:
        want = np.load(tmp_path / f"{k}.npy", allow_pickle=False)
        assert a.dtype == want.dtype and a.shape == want.shape and np.array_equal(a, want), k
        assert a.flags.f_contiguous == want.flags.f_contiguous, k


def test_attributes_fast_path_and_fallback_store_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer types attributes with h5py's private ``array_for_new_object``; without it (a later h5py may
    move it) the high-level call takes over. Both must store the same values with the same HDF5 types."""
    import h5py

    import runstore.writer as w

    vals = {"s": "héllo", "i": 3, "f": 1.5, "b": True, "a": np.arange(3), "l": ["x", "yy"], "f32": np.float32(2)}

    def stored(path: Path) -> dict:
        with h5py.File(path, "w") as f:
            w._put_attrs(f.id, vals)
        with h5py.File(path, "r") as f:
            return {k: (repr(f.attrs[k]), f.attrs.get_id(k).get_type().get_class()) for k in f.attrs}

    fast = stored(tmp_path / "fast.h5")
    monkeypatch.setattr(w, "array_for_new_object", None)
    assert stored(tmp_path / "fallback.h5") == fast and len(fast) == len(vals)
