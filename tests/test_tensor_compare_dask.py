"""The layer-tensor compare fanned out on a Dask cluster (a LocalCluster with 2 worker processes) gives the
same rows and findings as the local run: run stores over steps x ranks, and the msprobe PyTorch/MindSpore
pair."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from comparators.layer_tensors import compare_layer_tensors, compare_layer_tensors_all
from models import load_mapping
from runstore import RunWriter
from sources.layers import layer_source

distributed = pytest.importorskip("distributed", reason="dask[distributed] is not installed (the dask extra)")
MSPROBE = Path(__file__).resolve().parent / "data" / "msprobe"
PERTURBED = (2, 1, 3)          # step, rank, layer


def _store(root: Path, perturb: bool) -> Any:
    """Two steps x two ranks, five layers' outputs each (written by the run store's own writer), as a layer
    source."""
    for rank in (0, 1):
        with RunWriter(root, rank=rank, meta={"framework": "torch"}) as w:
            for step in (1, 2):
                rng = np.random.default_rng([step, rank])
                rows = []
                for i in range(5):
                    a = rng.standard_normal((6, 2, 40)).astype(np.float32)
                    if perturb and (step, rank, i) == PERTURBED:
                        a = a * np.float32(1.001)
                    w.put_array(step, f"tensors/{i:06d}", a)
                    rows.append((i, float(np.linalg.norm(a)), float(a.max()), float(a.min()), float(a.mean())))
                w.put_table(step, "tensor_stats", {
                    "order": np.arange(5), "module": [f"decoder.layers.{i}" for i in range(5)],
                    "kind": ["forward.output.0"] * 5, "dtype": ["float32"] * 5, "shape": ["6x2x40"] * 5,
                    "numel": np.full(5, 480), "max": [r[2] for r in rows], "min": [r[3] for r in rows],
                    "mean": [r[4] for r in rows], "norm": [r[1] for r in rows], "nan": np.zeros(5, int),
                    "inf": np.zeros(5, int)})
                w.finish_step()
    return layer_source(root)


@pytest.fixture(scope="module")
def client():
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as c:
        yield c


def _same(a, b) -> None:
    assert a.details["rows"] == b.details["rows"]
    assert [f.to_json() for f in a.findings] == [f.to_json() for f in b.findings]


def test_steps_x_ranks_on_the_cluster_equal_the_local_run(tmp_path: Path, client) -> None:
    base, cand = _store(tmp_path / "base", False), _store(tmp_path / "cand", True)
    local = compare_layer_tensors_all(base, cand, jobs=1)
    remote = compare_layer_tensors_all(base, cand, scheduler=client)
    assert sorted(local) == sorted(remote) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    for k in local:
        _same(local[k], remote[k])
        assert local[k].details == compare_layer_tensors(base, cand, step=k[0], rank=k[1], jobs=1).details
    assert remote[(2, 1)].details["first_departing_layer"] == PERTURBED[2]
    assert all(remote[k].verdict == "pass" for k in remote if k != PERTURBED[:2])
    assert len(client.scheduler_info()["workers"]) == 2


def test_msprobe_pair_on_the_cluster(client) -> None:
    # No torch reader here: importing torch in both workers costs 3-30 s on this shared machine; the .pt rows
    # compare by msprobe's statistics on every worker alike (full tensors on a cluster: the test above).
    args = (layer_source(MSPROBE / "pt"), layer_source(MSPROBE / "ms"), load_mapping())
    local = compare_layer_tensors(*args, jobs=1)
    remote = compare_layer_tensors(*args, scheduler=client)
    _same(local, remote)
    assert remote.details["first_departing_forward"]["module"] == "decoder.layers.1.mlp.linear_fc2"


def test_scheduler_address_unreachable_is_bad_input(tmp_path: Path, monkeypatch) -> None:
    import comparators.tensor_dispatch as ct
    from core.errors import BadInput

    monkeypatch.setattr(ct, "DASK_CONNECT_TIMEOUT", "1s")
    base = _store(tmp_path / "b", False)
    with pytest.raises(BadInput, match="cannot reach the Dask scheduler"):
        compare_layer_tensors(base, base, scheduler="tcp://127.0.0.1:9", jobs=1)
