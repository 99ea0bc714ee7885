"""Layer-tensor comparator: metrics on known arrays, and a perturbed attention weight in one layer of a real
Megatron-core model named as the first departing layer (full tensors and statistics only)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from comparators.layer_tensors import compare_layer_tensors
from comparators.tensor_metrics import compare_arrays
from comparators.tensor_pair import tolerance
from models import load_mapping
from sources.layers import layer_source


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
    res = compare_layer_tensors(layer_source(dumps / "base"), layer_source(dumps / "pert"), load_mapping(),
                                stats_only=stats_only)
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
    res = compare_layer_tensors(layer_source(dumps / "base"), layer_source(dumps / "again"), load_mapping())
    assert res.verdict == "pass", [f.message for f in res.findings]
    assert res.details["compared"] > 20 and res.details["first_departing_layer"] is None



@pytest.mark.parametrize("jobs,executor", [(2, "thread"), (2, "process")])
def test_parallel_readers_equal_the_serial_run(dumps: Path, jobs: int, executor: str) -> None:
    base, pert = layer_source(dumps / "base"), layer_source(dumps / "pert")
    serial = compare_layer_tensors(base, pert, load_mapping(), jobs=1)
    par = compare_layer_tensors(base, pert, load_mapping(), jobs=jobs, executor=executor)
    assert par.details["rows"] == serial.details["rows"]
    assert [f.to_json() for f in par.findings] == [f.to_json() for f in serial.findings]


def test_raw_file_reads_and_streamed_transpose_equal_in_memory(tmp_path: Path) -> None:
    """Contiguous float32 datasets are read at their file offset; a [s, b, h] vs [b, s, h] pair streams one
    batch index at a time. Both must give what the in-memory compare gives."""
    import h5py

    from comparators.tensor_metrics import compare_datasets, raw_offset

    rng = np.random.default_rng(3)
    sbh = rng.standard_normal((300, 3, 1000)).astype(np.float32)           # > 1 chunk, uneven tail
    bsh = np.ascontiguousarray(np.swapaxes(sbh, 0, 1) * np.float32(1 + 1e-4))
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f["x"], f["y"], f["z"] = sbh, bsh, np.swapaxes(sbh, 0, 1)
        f.create_dataset("c", data=bsh, chunks=(1, 100, 1000))              # chunked: the h5py path
    with h5py.File(tmp_path / "a.h5", "r") as f:
        assert raw_offset(f["y"]) is not None and raw_offset(f["c"]) is None
        want = compare_arrays(f["z"][...], bsh).as_dict()
        assert compare_datasets(f["z"], f["y"]).as_dict() == pytest.approx(want, rel=1e-6)
        assert compare_datasets(f["z"], f["c"]).as_dict() == pytest.approx(want, rel=1e-6)
        assert compare_datasets(f["x"], f["y"], transpose_a=True).as_dict() == pytest.approx(want, rel=1e-6)


def _store(root: Path, rows: list[tuple[str, str, str, np.ndarray]]) -> Path:
    """A run store holding ``rows`` (module, kind, dtype, array) as step 1's layer tensors, in that order."""
    from runstore import RunWriter

    with RunWriter(root, rank=0, meta={"framework": "test"}) as w:
        w.put_table(1, "tensor_stats", {
            "order": np.arange(len(rows)), "module": np.array([r[0] for r in rows]),
            "kind": np.array([r[1] for r in rows]), "dtype": np.array([r[2] for r in rows]),
            "shape": np.array(["x".join(map(str, r[3].shape)) for r in rows]),
            "numel": np.array([r[3].size for r in rows]), "max": np.array([r[3].max() for r in rows]),
            "min": np.array([r[3].min() for r in rows]), "mean": np.array([r[3].mean() for r in rows]),
            "norm": np.array([np.linalg.norm(r[3]) for r in rows]), "nan": np.zeros(len(rows), int),
            "inf": np.zeros(len(rows), int)})
        for i, r in enumerate(rows):
            w.put_array(1, f"tensors/{i:06d}", r[3], attrs={"module": r[0], "kind": r[1], "dtype": r[2]})
    return root


@pytest.mark.parametrize("embedding_error", [0.0, 2e-4])
def test_rows_after_a_float16_computation_are_judged_at_float16(tmp_path: Path, embedding_error: float) -> None:
    """The flash-attention case: the candidate's core attention ran in float16 (its row says so), so later
    rows carry float16 rounding (5e-4 here) and pass at float16's line; the embedding before it is still
    held to float32's line, so a 2e-4 embedding error fails there instead of hiding under attention noise."""
    rng = np.random.default_rng(0)
    mods = ["embedding", "decoder.layers.0.self_attention.core_attention", "decoder.layers.0.mlp", "output_layer"]
    base = [rng.standard_normal(256).astype(np.float32) for _ in mods]

    def noisy(a: np.ndarray, rel: float) -> np.ndarray:
        e = rng.standard_normal(a.shape)
        return (a + rel * np.linalg.norm(a) / np.linalg.norm(e) * e).astype(np.float32)

    rows_a = [(m, "forward.output.0", "float32", a) for m, a in zip(mods, base, strict=True)]
    rows_a.append(("decoder.layers.0.mlp", "backward.grad_output.0", "float32", base[2]))
    rows_b = [(mods[0], "forward.output.0", "float32", noisy(base[0], embedding_error))]
    rows_b += [(m, "forward.output.0", "float16" if "core_attention" in m else "float32", noisy(a, 5e-4))
               for m, a in zip(mods[1:], base[1:], strict=True)]
    rows_b.append(("decoder.layers.0.mlp", "backward.grad_output.0", "float32", noisy(base[2], 5e-4)))
    tol = {"float32": (1e-5, 1e-4, 0.999999)}
    src_a, src_b = layer_source(_store(tmp_path / "a", rows_a)), layer_source(_store(tmp_path / "b", rows_b))
    res = compare_layer_tensors(src_a, src_b, load_mapping(), tolerances=tol)
    judged = {(r["module"], r["kind"]): r["judged_dtype"] for r in res.details["rows"]}
    assert judged[("embedding", "forward.output.0")] == "float32"
    assert judged[("decoder.layers.0.mlp", "forward.output.0")] == "float16"
    assert judged[("decoder.layers.0.mlp", "backward.grad_output.0")] == "float16"
    if embedding_error == 0:
        assert res.verdict == "pass", [f.message for f in res.findings]
    else:
        assert res.verdict == "fail" and res.findings[0].component == "embedding"
    # without the float16 row, the same 5e-4 after attention is judged at float32 and departs there
    rows_b32 = [(m, k, "float32", a) for m, k, _, a in rows_b]
    res32 = compare_layer_tensors(layer_source(tmp_path / "a"), layer_source(_store(tmp_path / "b32", rows_b32)),
                                  load_mapping(), tolerances=tol)
    assert res32.verdict == "fail"
    assert res32.findings[0].component == ("embedding" if embedding_error else mods[1])


def test_linked_tensors_are_read_once_and_judged_per_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The dumper stores a tensor seen twice once (an HDF5 hard link: a module's output that is the next
    module's input). Such rows are compared once; every row still gets its own verdict, at its own judged
    dtype, with exactly the metrics a store without links gives."""
    from comparators import tensor_pair as tc
    from runstore import RunWriter

    rng = np.random.default_rng(1)
    a = rng.standard_normal(4096).astype(np.float32)
    b = (a + 5e-4 * np.linalg.norm(a) / 64 * rng.standard_normal(4096)).astype(np.float32)
    rows = [("decoder.layers.0.self_attention.core_attention", "forward.output.0", "float16"),
            ("decoder.layers.0.self_attention.linear_proj", "forward.input.0", "float32"),
            ("decoder.layers.0.mlp", "forward.output.0", "float32")]

    def store(root: Path, arr: np.ndarray, link: bool, first_dtype: str) -> Any:
        with RunWriter(root, rank=0, meta={"framework": "test"}) as w:
            w.put_table(1, "tensor_stats", {
                "order": np.arange(3), "module": np.array([r[0] for r in rows]),
                "kind": np.array([r[1] for r in rows]),
                "dtype": np.array([first_dtype, "float32", "float32"]), "shape": np.array(["4096"] * 3),
                "numel": np.full(3, 4096), "max": np.full(3, float(arr.max())), "min": np.full(3, float(arr.min())),
                "mean": np.full(3, float(arr.mean())), "norm": np.full(3, float(np.linalg.norm(arr))),
                "nan": np.zeros(3, int), "inf": np.zeros(3, int)})
            w.put_array(1, "tensors/000000", arr)
            if link:
                w.link_array(1, "tensors/000001", "tensors/000000")
            else:
                w.put_array(1, "tensors/000001", arr)
            w.put_array(1, "tensors/000002", arr)
        return layer_source(root)

    reads = []
    real = tc.compare_raw       # float32 run-store tensors are read at the offsets the dispatcher found
    monkeypatch.setattr(tc, "compare_raw", lambda *x, **k: reads.append(1) or real(*x, **k))
    tol = {"float32": (1e-5, 1e-4, 0.999999)}
    linked = compare_layer_tensors(store(tmp_path / "a", a, True, "float32"), store(tmp_path / "b", b, True, "float16"),
                                   load_mapping(), tolerances=tol)
    n_linked, reads[:] = len(reads), []
    plain = compare_layer_tensors(store(tmp_path / "a2", a, False, "float32"),
                                  store(tmp_path / "b2", b, False, "float16"), load_mapping(), tolerances=tol)
    assert n_linked == 2 and len(reads) == 3          # rows 0 and 1 share their stored tensors on both sides
    strip = ("step", "rank")
    assert [{k: v for k, v in r.items() if k not in strip} for r in linked.details["rows"]] == \
        [{k: v for k, v in r.items() if k not in strip} for r in plain.details["rows"]]
    assert [r["judged_dtype"] for r in linked.details["rows"]] == ["float16"] * 3
