"""Layer-tensor comparator: metrics on known arrays, and a perturbed attention weight in one layer of a real
Megatron-core model named as the first departing layer (full tensors and statistics only)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from align.core.mapping import Mapping
from comparators.tensors import compare_arrays, compare_layer_tensors, tolerance


def test_metrics_on_known_arrays() -> None:
    b = np.array([1.0, 2.0, -4.0, 0.5], np.float32)
    a = b.copy()
    a[1] = 2.002        # rel err 1e-3 (within five thousandths, not one thousandth)
    a[3] = 0.6          # rel err 0.2
    mt = compare_arrays(a, b)
    assert mt.max_abs_err == pytest.approx(0.1, rel=1e-5)
    assert mt.max_rel_err == pytest.approx(0.2, rel=1e-4)
    assert mt.one_thousandth_err_ratio == 0.5 and mt.five_thousandths_err_ratio == 0.75
    d = a.astype(np.float64) - b
    assert mt.rmse == pytest.approx(math.sqrt((d ** 2).mean()), rel=1e-5)
    assert mt.cosine == pytest.approx(a @ b / np.linalg.norm(a) / np.linalg.norm(b), rel=1e-6)
    a[0] = np.nan
    b[2] = np.inf
    mt2 = compare_arrays(a, b)
    assert (mt2.nan_baseline, mt2.inf_candidate, mt2.nan_candidate) == (1, 1, 0)
    assert tolerance("torch.bfloat16")[0] > tolerance("float32")[0]


def test_chunked_equals_whole() -> None:
    rng = np.random.default_rng(0)
    b = rng.standard_normal(700_001).astype(np.float32)
    a = b + rng.standard_normal(b.size).astype(np.float32) * 1e-3
    mt = compare_arrays(a, b)
    d = a.astype(np.float64) - b
    assert mt.rel_l2 == pytest.approx(np.linalg.norm(d) / np.linalg.norm(b.astype(np.float64)), rel=1e-4)
    assert mt.max_abs_err == pytest.approx(np.abs(d).max(), rel=1e-6)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> Path:
    """Two real Megatron-core runs (step 1, same batch); the second has a 1e-3 Gaussian perturbation of
    layer 1's fused QKV weight. A third repeats the first exactly (to show no false departures)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("megatron.core")
    from demo.megatron_cpu import TinyLlamaConfig, build_tiny_llama, forward_loss, init_megatron_cpu, synthetic_batch
    from tests.helpers.torch_layer_dump import LayerDump

    root = tmp_path_factory.mktemp("layers")
    init_megatron_cpu(tp=1)
    cfg = TinyLlamaConfig(num_layers=3)
    for name, perturb in (("base", False), ("pert", True), ("again", False)):
        model = build_tiny_llama(cfg, seed=7)
        if perturb:
            w = dict(model.named_parameters())["decoder.layers.1.self_attention.linear_qkv.weight"]
            g = torch.Generator().manual_seed(0)
            with torch.no_grad():
                w.add_(torch.randn(w.shape, generator=g) * 1e-3)
        dump = LayerDump(model)
        forward_loss(model, synthetic_batch(1, cfg)).backward()
        dump.write(root / name)
    return root


@pytest.mark.parametrize("stats_only", [False, True])
def test_perturbed_attention_weight_is_first_departing_layer(dumps: Path, stats_only: bool) -> None:
    res = compare_layer_tensors(dumps / "base", dumps / "pert", Mapping.load(), stats_only=stats_only)
    assert res.details["mode"] == ("stats" if stats_only else "tensor")
    assert res.verdict in ("warn", "fail")
    fwd = res.details["first_departing_forward"]
    assert fwd["layer"] == 1 and fwd["module"] == "decoder.layers.1.self_attention.linear_qkv"
    assert res.details["first_departing_layer"] == 1
    layer0 = [r for r in res.details["rows"] if r["layer"] == 0 and r["direction"] == "forward"]
    assert layer0 and all(r["verdict"] == "pass" for r in layer0)
    # backward starts at the loss: the logits already moved, so the first backward departure is the output
    # side (output layer / final norm), a consequence of the forward departure, reported after it
    bwd = res.details["first_departing_backward"]
    assert bwd["order"] > fwd["order"] and bwd["layer"] in (None, 2, 1)
    assert res.findings[0].component == "decoder.layers.1.self_attention.linear_qkv"


def test_identical_runs_pass(dumps: Path) -> None:
    res = compare_layer_tensors(dumps / "base", dumps / "again", Mapping.load())
    assert res.verdict == "pass", [f.message for f in res.findings]
    assert res.details["compared"] > 20 and res.details["first_departing_layer"] is None



@pytest.mark.parametrize("jobs,executor", [(2, "thread"), (2, "process")])
def test_parallel_readers_equal_the_serial_run(dumps: Path, jobs: int, executor: str) -> None:
    serial = compare_layer_tensors(dumps / "base", dumps / "pert", Mapping.load(), jobs=1)
    par = compare_layer_tensors(dumps / "base", dumps / "pert", Mapping.load(), jobs=jobs, executor=executor)
    assert par.details["rows"] == serial.details["rows"]
    assert [f.to_json() for f in par.findings] == [f.to_json() for f in serial.findings]


def test_raw_file_reads_and_streamed_transpose_equal_in_memory(tmp_path: Path) -> None:
    """Contiguous float32 datasets are read at their file offset; a [s, b, h] vs [b, s, h] pair streams one
    batch index at a time. Both must give what the in-memory compare gives."""
    import h5py

    from comparators.tensors import _raw_offset, compare_datasets

    rng = np.random.default_rng(3)
    sbh = rng.standard_normal((300, 3, 1000)).astype(np.float32)           # > 1 chunk, uneven tail
    bsh = np.ascontiguousarray(np.swapaxes(sbh, 0, 1) * np.float32(1 + 1e-4))
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f["x"], f["y"], f["z"] = sbh, bsh, np.swapaxes(sbh, 0, 1)
        f.create_dataset("c", data=bsh, chunks=(1, 100, 1000))              # chunked: the h5py path
    with h5py.File(tmp_path / "a.h5", "r") as f:
        assert _raw_offset(f["y"]) is not None and _raw_offset(f["c"]) is None
        want = compare_arrays(f["z"][...], bsh).as_dict()
        assert compare_datasets(f["z"], f["y"]).as_dict() == pytest.approx(want, rel=1e-6)
        assert compare_datasets(f["z"], f["c"]).as_dict() == pytest.approx(want, rel=1e-6)
        assert compare_datasets(f["x"], f["y"], transpose_a=True).as_dict() == pytest.approx(want, rel=1e-6)
