"""Issue 38 (run-store side): every table and record a comparator reads from a run store is read right or refused
in one line naming the file and the field. Each case the issue lists is one test here, through `align report`
on a TP=2 store pair (local norms and MoE routing records, as the dumpers write them), plus the readers'
own checks (rank files, routing groups, table ranges, declared sizes, non-regular files)."""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import pytest

from align.cli import main
from core.errors import BadInput
from runstore import RunReader, RunWriter, check_table
from runstore.routing import make_record, put_counts, put_routing, read_counts, read_routing

NAMES = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"]
ROUTER = "decoder.layers.0.mlp.router"


def route(z: np.ndarray) -> object:
    idx = np.argsort(-z, axis=1, kind="stable")[:, :2]
    top = np.take_along_axis(z, idx, 1)
    p = np.exp(top - top.max(1, keepdims=True))
    return make_record(ROUTER, z, idx, p / p.sum(1, keepdims=True), logits_dtype="float32", probs_dtype="float32",
                       score_function="softmax", topk=2)


def make_store(root: Path, mutate: Callable[[Path], None] | None = None) -> Path:
    """Two TP ranks, steps 1-3 of loss, local norms (TP-sharded and duplicated rows) and a router at step 1."""
    z = np.random.default_rng(0).normal(size=(32, 4)).astype(np.float32)
    for rank in (0, 1):
        with RunWriter(root, rank=rank, meta={"framework": "megatron-core", "parallel": {"tp": 2, "world_size": 2}},
                       rank_info={"tp_rank": rank, "tp": 2, "pp_rank": 0, "pp": 1, "dp_rank": 0, "dp": 1}) as w:
            for s in range(1, 4):
                w.log_scalars(s, {"loss": 10 - 0.1 * s, "grad_norm": 1.0})
                w.put_table(s, "local_norm", {
                    "name": np.array(NAMES, dtype=object), "norm": np.array([1.0, 0.5, 2.0]),
                    "numel": np.array([10, 4, 10]), "tp_partition_dim": np.array([0, -1, 0]),
                    "tp_rank": np.full(3, rank), "tp_size": np.full(3, 2)})
                if s == 1:
                    put_routing(w, s, route(z))
                w.finish_step()
    if mutate is not None:
        mutate(root)
    return root


def step_file(root: Path, step: int = 1, rank: int = 1) -> Path:
    return root / "steps" / f"step_{step:08d}" / f"rank_{rank:05d}.h5"


def report(tmp: Path, candidate: Path) -> tuple[int, str, dict]:
    base = tmp / "base"
    if not base.exists():
        make_store(base)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(["report", str(base), str(candidate), "--out", str(tmp / f"rep_{candidate.name}"), "-q"])
        except SystemExit as exc:
            rc = exc.code
    summary = tmp / f"rep_{candidate.name}" / "summary.json"
    return rc, err.getvalue(), json.loads(summary.read_text()) if rc in (0, 1) else {}


def refused(tmp: Path, candidate: Path, *needles: str) -> str:
    rc, err, _ = report(tmp, candidate)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, (rc, err)
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


# -- local-norm tables ---------------------------------------------------------------------------------

def _edit_table(step: int, fn: Callable[[np.ndarray], None]) -> Callable[[Path], None]:
    def mutate(root: Path) -> None:
        with h5py.File(step_file(root, step), "a") as f:
            rec = f["local_norm"][...]
            fn(rec)
            del f["local_norm"]
            f["local_norm"] = rec
    return mutate


def _as_columns(step: int, fn: Callable[[h5py.Group, dict[str, np.ndarray]], None]) -> Callable[[Path], None]:
    """The table rewritten in the older layout (a group of one dataset per column), ``fn`` adding columns."""
    def mutate(root: Path) -> None:
        with h5py.File(step_file(root, step), "a") as f:
            rec = f["local_norm"][...]
            del f["local_norm"]
            g = f.create_group("local_norm")
            fn(g, {k: rec[k] for k in rec.dtype.names})
    return mutate


def _neg(rec: np.ndarray) -> None:
    rec["norm"][0] = -1.0


def _tp4(rec: np.ndarray) -> None:
    rec["tp_size"][:] = 4


def _without_name(g: h5py.Group, cols: dict) -> None:
    for k, v in cols.items():
        if k != "name":
            g[k] = v


def _text_tp_rank(g: h5py.Group, cols: dict) -> None:
    for k, v in cols.items():
        g[k] = np.array([b"1"] * 3) if k == "tp_rank" else v


def _vlen_norms(g: h5py.Group, cols: dict) -> None:
    for k, v in cols.items():
        if k != "norm":
            g[k] = v
    ragged = np.empty(3, dtype=object)
    ragged[:] = [np.array([1.0, 2.0]), np.array([0.5]), np.array([2.0])]
    g.create_dataset("norm", data=ragged, dtype=h5py.vlen_dtype(np.float64))


@pytest.mark.parametrize("step", [1, 2], ids=["step1", "step2"])   # step 2: read by the trajectory reader
@pytest.mark.parametrize(("case", "mutate", "needles"), [
    ("negative_norm", lambda s: _edit_table(s, _neg), ["rank_00001.h5", "local_norm/norm", "-1.0", "below 0"]),
    ("tp_size_4_vs_2", lambda s: _edit_table(s, _tp4), ["rank_00001.h5", "local_norm/tp_size", "tp_size 4",
                                                        "rank_00000.h5"]),
    ("missing_name", lambda s: _as_columns(s, _without_name), ["rank_00001.h5", "no column 'name'"]),
    ("text_tp_rank", lambda s: _as_columns(s, _text_tp_rank), ["rank_00001.h5", "local_norm/tp_rank"]),
    ("variable_length_norms", lambda s: _as_columns(s, _vlen_norms), ["rank_00001.h5", "local_norm/norm"]),
])
def test_local_norm_table_cases_are_refused_naming_file_and_field(tmp_path: Path, step: int, case: str,
                                                                   mutate: Callable, needles: list[str]) -> None:
    refused(tmp_path, make_store(tmp_path / case, mutate(step)), *needles)


@pytest.mark.parametrize(("case", "needles"), [("random_bytes", ["rank_00001.h5", "not a readable HDF5"]),
                                               ("dev_zero", ["rank_00001.h5", "device, not a regular"]),
                                               ("folder", ["rank_00001.h5", "is a directory"])])
def test_step_file_that_is_not_hdf5_or_not_regular_is_refused(tmp_path: Path, case: str, needles: list[str]) -> None:
    def mutate(root: Path) -> None:
        p = step_file(root)
        p.unlink()
        if case == "random_bytes":
            p.write_bytes(np.random.default_rng(1).bytes(4096))
        elif case == "dev_zero":
            p.symlink_to("/dev/zero")     # never opened: refused when the store is scanned
        else:
            p.mkdir()
    refused(tmp_path, make_store(tmp_path / case, mutate), *needles)


# -- rank files ----------------------------------------------------------------------------------------

def _rank_file(edit: Callable[[dict], object]) -> Callable[[Path], None]:
    def mutate(root: Path) -> None:
        p = root / "ranks" / "rank_00001.json"
        p.write_text(json.dumps(edit(json.loads(p.read_text()))))
    return mutate


@pytest.mark.parametrize(("case", "edit", "needles"), [
    ("list", lambda d: [1, 2], ["rank_00001.json", "expected object, got array"]),
    ("pp_rank_x", lambda d: {**d, "pp_rank": "x"}, ["rank_00001.json", "'pp_rank'", "'x'"]),
    ("ep_rank_y", lambda d: {**d, "ep_rank": "y"}, ["rank_00001.json", "'ep_rank'", "'y'"]),
    ("tp_rank_beyond_tp", lambda d: {**d, "tp_rank": 2}, ["rank_00001.json", "'tp_rank'", "not below tp 2"]),
    ("sizes_disagree", lambda d: {**d, "tp": 4}, ["rank_00001.json", "'tp'", "4", "rank_00000.json says 2"]),
    ("bool_dp", lambda d: {**d, "dp_rank": True}, ["rank_00001.json", "'dp_rank'"]),
    ("other_rank", lambda d: {**d, "rank": 0}, ["rank_00001.json", "'rank'", "rank 1's"]),
])
def test_rank_file_cases_are_refused(tmp_path: Path, case: str, edit: Callable, needles: list[str]) -> None:
    refused(tmp_path, make_store(tmp_path / case, _rank_file(edit)), *needles)


def test_rank_file_linked_to_dev_zero_is_refused(tmp_path: Path) -> None:
    """(A FIFO in place of any store file: tests/test_fuzz_store.py, which detects a reader opening it.)"""
    def mutate(root: Path) -> None:
        p = root / "ranks" / "rank_00001.json"
        p.unlink()
        p.symlink_to("/dev/zero")
    refused(tmp_path, make_store(tmp_path / "linked", mutate), "rank_00001.json", "device, not a regular")


def test_rank_file_extra_keys_read_right(tmp_path: Path) -> None:
    root = make_store(tmp_path / "extra", _rank_file(lambda d: {**d, "host": "n1", "aborted": {"step": 2}}))
    info = RunReader(root).rank_info(1)
    assert info["host"] == "n1" and info["aborted"] == {"step": 2} and info["tp_rank"] == 1


# -- routing records -----------------------------------------------------------------------------------

def _routing(edit: Callable[[h5py.File], None]) -> Callable[[Path], None]:
    def mutate(root: Path) -> None:
        for rank in (0, 1):
            with h5py.File(step_file(root, 1, rank), "a") as f:
                edit(f)
    return mutate


def _nan_expert(f: h5py.File) -> None:
    f[f"routing/{ROUTER}/logits"][:, 2] = np.nan


def _nan_probs(f: h5py.File) -> None:
    f[f"routing/{ROUTER}/topk_probs"][...] = np.nan


@pytest.mark.parametrize("edit", [_nan_expert, _nan_probs], ids=["nan_logits_one_expert", "nan_topk_probs"])
def test_nan_in_routing_evidence_is_a_failure_never_a_pass(tmp_path: Path, edit: Callable) -> None:
    rc, err, summary = report(tmp_path, make_store(tmp_path / edit.__name__, _routing(edit)))
    st = summary["stages"]["moe_routing"]
    assert rc == 1 and st["verdict"] == "fail" and st["failing_routers"] == [ROUTER], (rc, err, st["verdict"])
    (f,) = [f for f in summary["findings"] if f["metric"] == "router_nonfinite"]
    assert f["component"] == ROUTER and "the candidate's router" in f["message"] and f["value"] > 0


def _router_as_dataset(f: h5py.File) -> None:
    del f[f"routing/{ROUTER}"]
    f[f"routing/{ROUTER}"] = np.arange(4)


def _routing_as_dataset(f: h5py.File) -> None:
    del f["routing"]
    f["routing"] = np.arange(4)


def _index_beyond(f: h5py.File) -> None:
    f[f"routing/{ROUTER}/topk_index"][0, 0] = 7


def _counts_off(f: h5py.File) -> None:
    f[f"routing/{ROUTER}/tokens_per_expert"][0] += 1


def _text_topk(f: h5py.File) -> None:
    f[f"routing/{ROUTER}/logits"].attrs["topk"] = "two"


@pytest.mark.parametrize(("edit", "needles"), [
    (_router_as_dataset, [f"routing/{ROUTER}' is a dataset", "router's group"]),
    (_routing_as_dataset, ["'routing' is a dataset"]),
    (_index_beyond, ["topk_index", "7", "not an expert of 4"]),
    (_counts_off, ["tokens_per_expert", "expert 0"]),
    (_text_topk, ["attribute 'topk'", "'two'"]),
], ids=["router_dataset", "routing_dataset", "index_beyond_experts", "counts_disagree", "text_topk"])
def test_malformed_routing_records_are_refused(tmp_path: Path, edit: Callable, needles: list[str]) -> None:
    refused(tmp_path, make_store(tmp_path / edit.__name__, _routing(edit)), "rank_0000", *needles)


def test_routing_read_back_exactly(tmp_path: Path) -> None:
    root = make_store(tmp_path / "s")
    z = np.random.default_rng(0).normal(size=(32, 4)).astype(np.float32)
    rec = read_routing(step_file(root, 1, 0))[ROUTER]
    want = route(z)
    for a in ("logits", "topk_index", "topk_probs", "tokens_per_expert"):
        assert np.array_equal(getattr(rec, a), getattr(want, a)), a
    assert rec.attrs["topk"] == 2 and rec.attrs["score_function"] == "softmax"


def test_routing_counts_values_are_checked_before_arrays_are_sized(tmp_path: Path) -> None:
    with RunWriter(tmp_path / "r") as w:
        put_counts(w, 1, {ROUTER: np.array([3, 1, 0, 4])})
        w.finish_step()
    path = step_file(tmp_path / "r", 1, 0)
    assert read_counts(path)[ROUTER].tolist() == [3, 1, 0, 4]
    for col, value, needle in (("tokens", -5, "routing_counts/tokens"), ("expert", 1 << 40, "routing_counts/expert")):
        with h5py.File(path, "a") as f:
            rec = f["routing_counts"][...]
            rec[col][0] = value
            del f["routing_counts"]
            f["routing_counts"] = rec
        with pytest.raises(BadInput, match=needle) as ei:
            read_counts(path)
        assert "\n" not in str(ei.value)
        with RunWriter(tmp_path / "r") as w:      # the good table back for the next column
            put_counts(w, 1, {ROUTER: np.array([3, 1, 0, 4])})
            w.finish_step()


# -- readers' checks -----------------------------------------------------------------------------------

def test_check_table_ranges_and_nan_as_evidence() -> None:
    good = {"name": np.array(["a", "b"]), "norm": np.array([np.nan, np.inf]), "numel": np.array([-1, 3])}
    check_table("f.h5", "local_norm", good)          # NaN / Inf norms are evidence; numel -1 is "unknown"
    for col, arr, needle in (("numel", np.array([-2, 3]), "numel': -2 at row 0 (a) is below -1"),
                             ("tp_rank", np.array([0, 2]), "tp_rank': 2 at row 1 (b) is not below tp_size 2"),
                             ("dp_shard", np.array([0, 3]), "dp_shard': 3 at row 1 (b) is above 1")):
        cols = {**good, "tp_size": np.array([2, 2]), col: arr}
        with pytest.raises(BadInput, match=needle.replace("(", r"\(").replace(")", r"\)")):
            check_table("f.h5", "local_norm", cols)
    stats = {"order": np.array([0, 1]), "module": np.array(["m", "n"]), "kind": np.array(["o", "o"]),
             "nan": np.array([0, -1])}
    with pytest.raises(BadInput, match=r"tensor_stats/nan': -1 at row 1 \(n\)"):
        check_table("f.h5", "tensor_stats", stats)


def test_dataset_declaring_more_than_it_stores_is_refused_before_reading(tmp_path: Path) -> None:
    root = make_store(tmp_path / "s")
    path = step_file(root, 1, 0)
    for compression, needle in ((None, "but the file holds"), ("gzip", "but stores 0")):
        with h5py.File(path, "a") as f:    # chunked, never written: 800 MB of fill value
            del f[f"routing/{ROUTER}/logits"]
            f.create_dataset(f"routing/{ROUTER}/logits", shape=(10 ** 8, 2), dtype="f4", chunks=(1024, 2),
                             compression=compression)
        with pytest.raises(BadInput, match=f"logits': declares 800000000 bytes .* {needle}"):
            read_routing(path)


def test_global_norm_attribute_must_be_a_number(tmp_path: Path) -> None:
    from comparators.local_norms import read_local_norms

    root = make_store(tmp_path / "s")
    with h5py.File(step_file(root, 1, 0), "a") as f:
        f["local_norm"].attrs["global_norm"] = "big"
    with pytest.raises(BadInput, match="rank_00000.h5: 'local_norm' attribute 'global_norm': 'big'"):
        read_local_norms(root, 1)
