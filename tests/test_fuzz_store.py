"""Fuzz family for issue 24 (never silently wrong): run stores and batch dumps with wrong types, huge
numbers, control bytes, corrupt HDF5 and flipped .npy header bytes. Every case is READ-RIGHT-OR-REFUSED: the
values that survive a read are exactly what was written; anything else is a one-line BadInput, never a wrong
value, never a traceback. Seeded and bounded; `pytest -s` prints the outcome counts for the issue note."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import h5py
import numpy as np
import pytest

from align.checks import data as cd
from core.errors import BadInput
from runstore import RunReader, RunWriter, load_npy

OUTCOMES: Counter = Counter()


def _one_line(exc: BadInput) -> None:
    assert "\n" not in str(exc) and "Traceback" not in str(exc), str(exc)


def _outcome(family: str, fn) -> object:
    try:
        out = fn()
    except BadInput as exc:
        _one_line(exc)
        OUTCOMES[f"{family}: refused"] += 1
        return None
    OUTCOMES[f"{family}: read"] += 1
    return out


_BAD_VALUES = [True, False, "1e-3", "x", "", "\x00\x1b[2J", 10 ** 400, -(10 ** 400), [1], {"a": 1}, 1e308,
               "NaN", None, 0, -1, 2.5]


def test_fuzz_scalar_lines(tmp_path: Path) -> None:
    rng = random.Random(24)
    for case in range(150):
        root = tmp_path / f"s{case}"
        (root / "scalars").mkdir(parents=True)
        lines, expect = [], {}
        for step in range(1, 4):
            key = rng.choice(["loss", "lr", "grad_norm", "my_metric"])
            val = rng.choice(_BAD_VALUES) if rng.random() < 0.5 else round(rng.random(), 6)
            rec = {"step": step, key: val}
            if rng.random() < 0.1:
                rec["step"] = rng.choice([10 ** 30, -1, "3", 1.5, True, 10 ** 5000])
            try:
                text = json.dumps(rec)
            except ValueError:                       # Python itself refuses to print a 5000-digit int
                text = '{"step": ' + "9" * 5000 + "}"
            if rng.random() < 0.1:
                text = text[:-1] + rng.choice(["\x00", "\x07", "}}", ""])
            lines.append(text)
            expect[step] = rec
        (root / "scalars" / "rank_00000.jsonl").write_text("\n".join(lines) + "\n")

        def read(root: Path = root) -> list:
            return RunReader(root).scalar_records(0)
        records = _outcome("scalars", read)
        for rec in records or []:                     # read: exactly what was written, the right types
            want = expect.get(rec["step"])
            assert want is not None and rec == want, (rec, want)
            for k in ("loss", "lr", "grad_norm"):
                assert k not in rec or rec[k] is None or type(rec[k]) in (int, float), rec


@pytest.mark.parametrize("step", [10 ** 20, 1 << 62, -1, 1.5, True, "2", 10 ** 4400],
                         ids=["1e20", "2**62", "-1", "1.5", "True", "str", "4400-digits"])
def test_huge_or_wrong_steps_refused_at_write_and_read(tmp_path: Path, step: object) -> None:
    w = RunWriter(tmp_path / "w")
    for call in (lambda: w.put_array(step, "batch/tokens", np.arange(4)), lambda: w.log_scalars(step, {"loss": 1.0}),
                 lambda: w.write_seed_batch(step, {"tokens": np.arange(4)})):
        with pytest.raises(BadInput) as ei:
            call()
        _one_line(ei.value)
        OUTCOMES["huge step at write: refused"] += 1
    w.close()
    assert not list((tmp_path / "w").rglob("*.tmp")) and not (tmp_path / "w" / "steps").exists()
    if isinstance(step, int) and not isinstance(step, bool) and 0 < step < 10 ** 100:
        d = tmp_path / "r" / "steps" / f"step_{step}"
        d.mkdir(parents=True)
        with h5py.File(d / "rank_00000.h5", "w") as h5:
            h5["batch/tokens"] = np.arange(4)
        with pytest.raises(BadInput) as ei:
            RunReader(tmp_path / "r")
        _one_line(ei.value)
        OUTCOMES["huge step at read: refused"] += 1


def _h5_case(path: Path, kind: str) -> None:
    with h5py.File(path, "w") as h5:
        h5["batch/tokens"] = np.arange(8)
        if kind == "soft_loop":
            h5["a"] = h5py.SoftLink("/b")
            h5["b"] = h5py.SoftLink("/a")
        elif kind == "external_loop":
            h5["ext"] = h5py.ExternalLink(path.name, "/ext")
        elif kind == "external_other":
            h5["ext"] = h5py.ExternalLink("/etc/passwd", "/x")
        elif kind == "self_link":
            h5["batch/again"] = h5["batch"]              # a hard link from a group to itself
        elif kind == "huge":
            h5.create_dataset("batch/big", shape=(10 ** 13,), dtype="f4")
        elif kind == "huge_chunked":
            h5.create_dataset("batch/big", shape=(10 ** 13,), dtype="f4", chunks=(1024,), compression="gzip")


@pytest.mark.parametrize("kind", ["soft_loop", "external_loop", "external_other", "self_link", "huge",
                                  "huge_chunked", "flip"])
def test_corrupt_h5_step_files(tmp_path: Path, kind: str) -> None:
    d = tmp_path / "steps" / "step_00000001"
    d.mkdir(parents=True)
    (tmp_path / "meta.json").write_text('{"schema": "xf-align-run/1"}')
    path = d / "rank_00000.h5"
    _h5_case(path, "plain" if kind == "flip" else kind)
    if kind == "flip":
        raw = bytearray(path.read_bytes())
        rng = random.Random(7)
        for _ in range(8):
            raw[rng.randrange(len(raw))] ^= 0xFF
        path.write_bytes(bytes(raw))
    reader = RunReader(tmp_path)
    out = _outcome("corrupt h5", lambda: reader.step_arrays(1, 0).data)
    if out is not None:
        assert kind in ("soft_loop", "flip")
        if "batch/tokens" in out:
            assert np.array_equal(out["batch/tokens"], np.arange(8)) or kind == "flip"
    else:
        assert kind != "soft_loop" or out is None


def test_fuzz_npy_flipped_headers(tmp_path: Path) -> None:
    rng = random.Random(11)
    arr = np.arange(24, dtype=np.int32).reshape(2, 12)
    base = tmp_path / "a.npy"
    np.save(base, arr)
    good = base.read_bytes()
    for case in range(200):
        raw = bytearray(good)
        pos = rng.randrange(0, 128)
        raw[pos] = rng.randrange(256)
        p = tmp_path / f"f{case}.npy"
        p.write_bytes(bytes(raw))
        out = _outcome("npy header", lambda p=p: load_npy(p))
        if out is not None:                         # read: the header still says what was written
            assert out.size <= arr.size
            if out.shape == arr.shape and out.dtype == arr.dtype:
                assert np.array_equal(out, arr) or raw[:128] != good[:128]


def test_npy_tensor_reader_uses_public_header_api(tmp_path: Path) -> None:
    from comparators.tensor_metrics import _Npy

    np.save(tmp_path / "t.npy", np.arange(6, dtype=np.float32).reshape(2, 3))
    t = _Npy(str(tmp_path / "t.npy"))
    assert t.shape == (2, 3) and t.dtype == np.float32
    raw = bytearray((tmp_path / "t.npy").read_bytes())
    raw[raw.index(b"{") + 1] = ord("(")                # numpy raises tokenize.TokenError / SyntaxError here
    (tmp_path / "bad.npy").write_bytes(bytes(raw))
    with pytest.raises(BadInput) as ei:
        _Npy(str(tmp_path / "bad.npy"))
    _one_line(ei.value)
    with pytest.raises(BadInput):
        load_npy(tmp_path / "bad.npy")


def test_fuzz_batch_dumps_for_check_data(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    for case in range(40):
        root = tmp_path / f"b{case}"
        planted = None
        ranks = {1: [0, 1], 2: [0, 1]}
        if case % 4 == 1:
            ranks[2] = [0]
            planted = "missing_rank"
        for step, rs in ranks.items():
            for r in rs:
                d = root / f"step_{step}" / f"rank_{r}"
                d.mkdir(parents=True)
                tokens = rng.integers(3, 50, (2, 16))
                mask = np.ones((2, 16), np.float32)
                if case % 4 == 2 and step == 2 and r == 1:
                    mask[0, rng.integers(16)] = rng.choice([np.nan, np.inf, -1.0])
                    planted = "loss_mask_invalid"
                np.save(d / "tokens.npy", tokens)
                np.save(d / "labels.npy", np.roll(tokens, -1, axis=1))
                np.save(d / "loss_mask.npy", mask)
        if case % 4 == 3:
            p = root / "step_1" / "rank_0" / "tokens.npy"
            raw = bytearray(p.read_bytes())
            raw[rng.integers(8, 60)] ^= 0xFF
            p.write_bytes(bytes(raw))
        res = _outcome("check-data", lambda root=root: cd.check_batches(cd.iter_batches(root), vocab_size=64))
        if res is not None:
            metrics = {f.metric for f in res.findings if f.verdict == "fail"}
            if planted:
                assert planted in metrics, (case, metrics)
            elif case % 4 == 0:
                assert not metrics


# ------------------------------------------------------------------------------------------------------
# every table in runstore/tables.py (issue 38): one column of a good table mutated at a time; the oracle below
# is written here, from the run-store contract (docs/run-store.md), not read from the implementation
# ------------------------------------------------------------------------------------------------------

_TEXT_COLS = {"name", "module", "kind", "dtype", "shape", "split"}
_INT_COLS = {"numel", "tp_partition_dim", "tp_rank", "tp_size", "dp_shard", "dp_rank", "dp_size", "order", "nan",
             "inf", "expert", "tokens"}
#: the values a known column keeps (NaN allowed in a float column: a NaN norm is evidence)
_RANGE = {"norm": (0, None), "numel": (-1, 1 << 62), "tp_partition_dim": (-1, 64), "tp_rank": (0, (1 << 20) - 1),
          "tp_size": (1, 1 << 20), "order": (0, 1 << 62), "nan": (0, 1 << 62), "inf": (0, 1 << 62),
          "expert": (0, (1 << 20) - 1), "tokens": (0, 1 << 62)}
_REQUIRED = {"local_norm": ("name", "norm"), "param_norm": ("name", "norm"), "update_norm": ("name", "norm"),
             "tensor_stats": ("order", "module", "kind"), "routing_counts": ("module", "expert", "tokens")}


def _good_table(group: str, n: int = 4) -> dict[str, np.ndarray]:
    if group in ("local_norm", "param_norm", "update_norm"):
        return {"name": np.array([f"decoder.layers.{i}.mlp.linear_fc1.weight" for i in range(n)], dtype="S"),
                "norm": np.linspace(0.5, 2.0, n), "numel": np.full(n, 64, np.int64),
                "tp_partition_dim": np.full(n, -1, np.int64), "tp_rank": np.zeros(n, np.int64),
                "tp_size": np.ones(n, np.int64)}
    if group == "tensor_stats":
        return {"order": np.arange(n, dtype=np.int64), "module": np.array([f"decoder.layers.{i}" for i in range(n)],
                                                                          dtype="S"),
                "kind": np.array([b"output"] * n), "dtype": np.array([b"float32"] * n),
                "shape": np.array([b"2x4"] * n), "numel": np.full(n, 8, np.int64), "max": np.linspace(1, 2, n),
                "min": -np.linspace(1, 2, n), "mean": np.zeros(n), "norm": np.linspace(3, 4, n),
                "nan": np.zeros(n, np.int64), "inf": np.zeros(n, np.int64)}
    return {"module": np.array([b"decoder.layers.0.mlp.router"] * n), "expert": np.arange(n, dtype=np.int64),
            "tokens": np.array([5, 0, 7, 4][:n], np.int64)}


def _mutate(cols: dict[str, np.ndarray], rng: random.Random) -> tuple[str, dict[str, np.ndarray]]:
    cols = dict(cols)
    k = rng.choice(sorted(cols))
    col = cols[k]
    how = rng.choice(["value", "value", "value", "dtype", "drop", "shape", "extra"])
    if how == "drop":
        del cols[k]
    elif how == "extra":
        cols["my_column"] = np.arange(len(col))
    elif how == "shape":
        cols[k] = rng.choice([col[:-1], np.stack([col, col], axis=1)])
    elif how == "dtype":
        cols[k] = rng.choice([col.astype("S"), col.astype(np.complex64) if col.dtype.kind != "S" else col,
                              np.array([b"\xff\xfe"] * len(col)), np.zeros(len(col), np.float32),
                              np.arange(len(col), dtype=np.int8)])
    elif k in _TEXT_COLS:
        v = rng.choice([b"", b"a\x00b", b"\xff\xfe", "\u00e9\u4e2d".encode(), b"x" * 5000, b"\x1b[2J"])
        vals = list(col)
        vals[rng.randrange(len(vals))] = v
        cols[k] = np.array(vals, dtype="S")
    else:
        v = rng.choice([-1, -2, 0, 1, 2, 5, -1e-30, float("nan"), float("inf"), -float("inf"), 1e300, 2 ** 62,
                        2 ** 63 - 1, -(2 ** 62), 1 << 20, 65])
        vals = list(col)
        vals[rng.randrange(len(vals))] = v
        try:
            cols[k] = np.array(vals, dtype=col.dtype if isinstance(v, int) or col.dtype.kind == "f" else None)
        except OverflowError:
            cols[k] = np.array(vals)
    return f"{k}:{how}", cols


def _valid(group: str, cols: dict[str, np.ndarray]) -> bool:
    """The contract: required columns; one value per row, equal lengths; text columns text (UTF-8), number
    columns numbers (integer columns integers); known columns within range; a row's TP rank below its TP size."""
    if any(r not in cols for r in _REQUIRED[group]):
        return False
    if len({a.shape for a in cols.values()}) != 1 or any(a.ndim != 1 for a in cols.values()):
        return False
    for k, a in cols.items():
        if k in _TEXT_COLS:
            if a.dtype.kind != "S":
                return False
            try:
                [x.decode("utf-8") for x in a]
            except UnicodeDecodeError:
                return False
        elif k != "my_column":
            if a.dtype.kind not in ("iub" if k in _INT_COLS else "fiub"):
                return False
            lo, hi = _RANGE.get(k, (None, None))
            with np.errstate(invalid="ignore"):
                if (lo is not None and (a < lo).any()) or (hi is not None and (a > hi).any()):
                    return False
    if "tp_rank" in cols and "tp_size" in cols and (cols["tp_rank"] >= cols["tp_size"]).any():
        return False
    return True


def _write_table(path: Path, group: str, cols: dict[str, np.ndarray], compound: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as h5:
        h5["batch/tokens"] = np.arange(4)
        one_d = len({a.shape for a in cols.values()}) == 1 and all(a.ndim == 1 for a in cols.values())
        if compound and one_d and cols:
            rec = np.empty(len(next(iter(cols.values()))), dtype=[(k, a.dtype) for k, a in cols.items()])
            for k, a in cols.items():
                rec[k] = a
            h5[group] = rec
        else:
            g = h5.create_group(group)
            for k, a in cols.items():
                g[k] = a


def _same(got: object, want: np.ndarray) -> bool:
    got = np.asarray(got)
    if want.dtype.kind == "S":
        return [str(x) for x in got] == [x.decode("utf-8") for x in want]
    return bool(np.array_equal(got.astype(np.float64), want.astype(np.float64), equal_nan=True))


def _read_table_as_the_product_does(root: Path, path: Path, group: str, cols: dict[str, np.ndarray]) -> None:
    """Every reader of ``group``; each either refuses in one line naming the file, or reads what was written."""
    from comparators.local_norms import read_local_norms
    from comparators.trajectories import read_trajectory
    from runstore.routing import read_counts
    from sources.store_dir import _read_stats

    tag = f"table {group}"
    whole = _outcome(tag, lambda: RunReader(root).step_arrays(1, 0).table(group))
    if whole is not None:
        for k, want in cols.items():
            assert _same(whole[k], want), (group, k, list(whole[k]), want)
    if group in ("local_norm", "param_norm", "update_norm"):
        if group == "local_norm":
            got = _outcome(tag, lambda: read_local_norms(RunReader(root), 1)[0])
            if got is not None:
                for name, norm in zip(cols["name"], cols["norm"], strict=True):
                    assert _same([got[name.decode()].full_norm()], np.array([norm])), (name, norm)
        from runstore import open_store
        traj = _outcome(tag, lambda: read_trajectory(open_store(root), group))
        if traj is not None:
            for j, name in enumerate(cols["name"]):
                with np.errstate(over="ignore"):
                    want = np.sqrt(np.square(np.float64(cols["norm"][j]))).astype(np.float32)
                assert _same([traj.column(name.decode())[0]], np.array([want])), (name, traj.values)
        reads = [x is not None for x in ([whole, got] if group == "local_norm" else [whole]) + [traj]]
    elif group == "tensor_stats":
        rows = _outcome(tag, lambda: _read_stats(path)[0])
        if rows is not None:
            order = np.argsort(cols["order"], kind="stable")
            for k, want in cols.items():
                assert _same([r[k] for r in rows], want[order]), (k, rows)
        reads = [whole is not None, rows is not None]
    else:
        counts = _outcome(tag, lambda: read_counts(path))
        if counts is not None:
            want: dict[str, list[int]] = {}
            for m in dict.fromkeys(cols["module"]):
                sel = cols["module"] == m
                c = np.zeros(int(cols["expert"][sel].max()) + 1, np.int64)
                np.add.at(c, cols["expert"][sel], cols["tokens"][sel])
                want[m.decode()] = c.tolist()
            assert {k: v.tolist() for k, v in counts.items()} == want, (counts, cols)
        reads = [whole is not None, counts is not None]
    if _valid(group, cols):
        assert all(reads), (group, {k: (v.dtype, v.shape) for k, v in cols.items()})
        OUTCOMES[f"{tag} (contract): read right"] += 1
    else:                              # outside the contract: no reader takes it as evidence
        assert not any(reads), (group, {k: (v.dtype, v.shape, list(v)[:4]) for k, v in cols.items()})
        OUTCOMES[f"{tag} (outside the contract): refused"] += 1


@pytest.mark.filterwarnings("error::RuntimeWarning")     # a numpy warning would print before the verdict
@pytest.mark.parametrize("group", sorted(["local_norm", "param_norm", "update_norm", "tensor_stats",
                                          "routing_counts"]))
def test_fuzz_every_table_read_right_or_refused(tmp_path: Path, group: str) -> None:
    from runstore.tables import TABLE_SCHEMAS

    assert set(TABLE_SCHEMAS) == {"local_norm", "param_norm", "update_norm", "tensor_stats", "routing_counts"}, \
        "a table added to runstore/tables.py: add it to this fuzz test"
    rng = random.Random(f"38-{group}")
    for case in range(40):
        label, cols = _mutate(_good_table(group), rng) if case else ("good", _good_table(group))
        root = tmp_path / f"{group}{case}"
        (root / "scalars").mkdir(parents=True)
        path = root / "steps" / "step_00000001" / "rank_00000.h5"
        _write_table(path, group, cols, compound=case % 2 == 0)
        try:
            _read_table_as_the_product_does(root, path, group, cols)
        except AssertionError as exc:
            raise AssertionError(f"{group} case {case} ({label}): {exc}") from None
    # both sides of the contract were exercised (a mutation generator that only breaks, or never does, proves
    # nothing)
    assert OUTCOMES[f"table {group} (contract): read right"] >= 5
    assert OUTCOMES[f"table {group} (outside the contract): refused"] >= 5


# ------------------------------------------------------------------------------------------------------
# routing records (runstore/routing.py): arrays, shapes, types, indices, counts, attributes, the group itself
# ------------------------------------------------------------------------------------------------------

ROUTER = "decoder.layers.0.mlp.router"
_ROUTING_ARRAYS = ("logits", "topk_index", "topk_probs", "tokens_per_expert")


def _good_router() -> dict[str, np.ndarray]:
    from runstore.routing import make_record

    z = np.random.default_rng(3).normal(size=(16, 4)).astype(np.float32)
    idx = np.argsort(-z, axis=1, kind="stable")[:, :2]
    top = np.take_along_axis(z, idx, 1)
    p = np.exp(top - top.max(1, keepdims=True))
    rec = make_record(ROUTER, z, idx, p / p.sum(1, keepdims=True), logits_dtype="float32", probs_dtype="float32")
    return {a: getattr(rec, a) for a in _ROUTING_ARRAYS}


def _mutate_router(arrs: dict[str, np.ndarray], rng: random.Random) -> tuple[str, dict, dict, str]:
    """(label, arrays, attributes of logits, layout: 'group' | 'router_dataset' | 'routing_dataset')."""
    arrs = {k: v.copy() for k, v in arrs.items()}
    attrs: dict = {"dtype": "float32", "score_function": "softmax", "topk": 2}
    k = rng.choice(_ROUTING_ARRAYS)
    how = rng.choice(["value", "value", "value", "dtype", "shape", "drop", "attr", "layout"])
    layout = "group"
    if how == "value":
        a = arrs[k]
        i, j = rng.randrange(a.shape[0]), rng.randrange(a.shape[1]) if a.ndim == 2 else 0
        v = rng.choice([np.nan, np.inf, -np.inf, 1e30, -1.0, 0.0] if a.dtype.kind == "f" else
                       [-1, -2, 3, 4, 7, 1 << 30, 0])
        if a.ndim == 2:
            a[i, j] = v
        else:
            a[i] = v
    elif how == "dtype":
        arrs[k] = rng.choice([arrs[k].astype(np.float64), arrs[k].astype(np.float16), arrs[k].astype(np.int32),
                              arrs[k].astype("S8"), arrs[k].astype(np.complex64)])
    elif how == "shape":
        arrs[k] = rng.choice([arrs[k][:-1], arrs[k][..., None], arrs[k].T.copy()])
    elif how == "drop":
        del arrs[k]
    elif how == "attr":
        key = rng.choice(["score_function", "topk", "batch", "dtype"])
        attrs[key] = rng.choice(["relu", "two", -1, 2, 3.5, "sigmoid", b"softmax"])
    else:
        layout = rng.choice(["router_dataset", "routing_dataset"])
    return f"{k}:{how}", arrs, attrs, layout


def _router_valid(arrs: dict[str, np.ndarray], attrs: dict, layout: str) -> bool:
    if layout != "group" or set(arrs) != set(_ROUTING_ARRAYS):
        return False
    z, idx, p, c = (arrs[a] for a in _ROUTING_ARRAYS)
    if z.dtype.kind != "f" or p.dtype.kind != "f" or idx.dtype.kind not in "iu" or c.dtype.kind not in "iu":
        return False
    if z.ndim != 2 or idx.ndim != 2 or p.shape != idx.shape or idx.shape[0] != z.shape[0] or c.shape != (z.shape[1],):
        return False
    if ((idx < -1) | (idx >= z.shape[1])).any() or idx.shape[1] > z.shape[1]:
        return False
    if not np.array_equal(np.bincount(idx[idx >= 0].ravel(), minlength=z.shape[1]), c):
        return False
    for key, v in attrs.items():
        v = v.decode() if isinstance(v, bytes) else v
        if key in ("score_function", "dtype") and not isinstance(v, str):
            return False
        if key in ("topk", "batch") and (not isinstance(v, int) or v < 0):
            return False
    return (attrs["score_function"].decode() if isinstance(attrs["score_function"], bytes)
            else attrs["score_function"]) in ("softmax", "sigmoid")


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_fuzz_routing_records_read_right_or_refused(tmp_path: Path) -> None:
    from comparators.routing import RoutingTolerance, compare_routing
    from runstore.routing import read_routing

    rng = random.Random(381)
    good = _good_router()
    clean = None
    for case in range(60):
        label, arrs, attrs, layout = _mutate_router(good, rng) if case else ("good", dict(good),
                                                                              {"dtype": "float32",
                                                                               "score_function": "softmax",
                                                                               "topk": 2}, "group")
        path = tmp_path / f"r{case}.h5"
        with h5py.File(path, "w") as h5:
            if layout == "routing_dataset":
                h5["routing"] = np.arange(4)
            elif layout == "router_dataset":
                h5[f"routing/{ROUTER}"] = good["logits"]
            else:
                for a, v in arrs.items():
                    h5[f"routing/{ROUTER}/{a}"] = v
                if "logits" in arrs:
                    h5[f"routing/{ROUTER}/logits"].attrs.update(attrs)
        got = _outcome("routing", lambda path=path: read_routing(path))
        valid = _router_valid(arrs, attrs, layout)
        assert (got is not None) == valid, (case, label, got is not None)
        if got is None:
            continue
        rec = got[ROUTER]
        for a in _ROUTING_ARRAYS:                       # read right: the values written (in the comparator's types)
            assert np.array_equal(getattr(rec, a), arrs[a].astype(getattr(rec, a).dtype), equal_nan=True), \
                (case, label, a)
        if clean is None:
            clean = rec
            continue
        bad = (~np.isfinite(rec.logits)).any() or (~np.isfinite(rec.topk_probs) & (rec.topk_index >= 0)).any()
        rows, findings = compare_routing({ROUTER: clean}, {ROUTER: rec}, RoutingTolerance.for_dtype("float32"))
        if bad:                                         # NaN / Inf in the evidence: a finding, never a pass
            assert rows[0]["verdict"] == "fail" and "router_nonfinite" in {f.metric for f in findings}, label
            OUTCOMES["routing: non-finite read and failed"] += 1
    assert OUTCOMES["routing: refused"] >= 10 and OUTCOMES["routing: read"] >= 10


# ------------------------------------------------------------------------------------------------------
# rank files (runstore/rank_files.py)
# ------------------------------------------------------------------------------------------------------

_COORDS = {"tp_rank": "tp", "pp_rank": "pp", "dp_rank": "dp", "ep_rank": "ep", "cp_rank": "cp"}


def test_fuzz_rank_files_read_right_or_refused(tmp_path: Path) -> None:
    rng = random.Random(382)
    base = {"tp_rank": 0, "tp": 2, "pp_rank": 0, "pp": 1, "dp_rank": 0, "dp": 1, "ep_rank": 0, "ep": 1,
            "world_size": 2, "host": "n1"}
    values = ["x", "", True, -1, 0, 1, 2, 3, 1.0, 2.5, None, [1], {"a": 1}, 10 ** 30, 1 << 20, 2 ** 63]
    for case in range(80):
        root = tmp_path / f"k{case}"
        (root / "scalars").mkdir(parents=True)
        (root / "ranks").mkdir()
        infos = [dict(base, rank=0), dict(base, rank=1, tp_rank=1)]
        who = rng.randrange(2)
        key = rng.choice(sorted({*base, *_COORDS, "cp", "rank", "pid", "aborted"}))
        if case % 10 == 9:
            infos[who] = rng.choice([[1, 2], "x", 3, None])
        else:     # half the time a small integer (in range or not, agreeing with the other rank or not)
            infos[who][key] = rng.choice(values) if rng.random() < 0.5 else rng.randrange(4)
        for r, info in enumerate(infos):
            (root / "ranks" / f"rank_{r:05d}.json").write_text(json.dumps(info))
        reader = RunReader(root)
        got = _outcome("rank file", lambda reader=reader: [reader.rank_info(0), reader.rank_info(1)])
        ok = all(isinstance(i, dict) for i in infos)
        for r, info in enumerate(infos if ok else []):
            for k, v in info.items():
                if k in _COORDS or k in _COORDS.values() or k in ("world_size", "rank"):
                    ok &= type(v) is int and 0 <= v < (1 << 20) and (k not in _COORDS.values() and
                                                                    k != "world_size" or v >= 1)
            for c, size in _COORDS.items():
                ok &= not (type(info.get(c)) is int and type(info.get(size)) is int and info[c] >= info[size])
            ok &= info.get("rank", r) == r and not (type(info.get("world_size")) is int and r >= info["world_size"])
        if ok:
            for k in {*base, *_COORDS.values()}:
                if k in infos[0] and k in infos[1] and k not in ("host",) and k not in _COORDS:
                    ok &= infos[0][k] == infos[1][k]      # one store, one layout
        assert (got is not None) == ok, (case, infos)
        if got is not None:
            assert got == infos, (got, infos)           # read right: exactly what was written
    assert OUTCOMES["rank file: refused"] >= 20 and OUTCOMES["rank file: read"] >= 10


# ------------------------------------------------------------------------------------------------------
# every file a store reader opens, replaced by what is not a regular file: refused in one line, never opened
# ------------------------------------------------------------------------------------------------------

def _store_with_every_file(root: Path) -> dict[str, tuple[Path, object]]:
    from runstore.clip_probe import read_clip_probe, write_clip_probe
    from runstore.seed_layout import read_seed_batch
    from runstore.step1_file import read_step1_file, shard_file, write_step1_file, write_step1_shard

    with RunWriter(root, rank=0, meta={"framework": "megatron-core"}) as w:
        w.log_scalars(1, {"loss": 1.0})
        w.put_table(1, "local_norm", {"name": ["a.weight"], "norm": np.array([1.0])})
        w.finish_step()
        w.write_seed_batch(1, {"tokens": np.arange(4)[None], "labels": np.arange(4)[None],
                               "loss_mask": np.ones((1, 4), np.float32)})
    one = {"w": np.ones(2, np.float32)}
    write_step1_file(root / "evidence" / "optimizer_step1.npz", one, one, one)
    write_clip_probe(root / "evidence" / "clip_probe.npz", one, scale=2.0, max_norm=1.0, applied=True,
                     returned_norm=1.0)
    sharded = tmp_shards = root / "shards"
    write_step1_shard(shard_file(sharded, 0), one, one, one, {"w": np.array([0, 2, -1, 0, 1, 0])},
                      {"w": np.array([2])}, rank=0, world=1)
    return {
        "meta.json": (root / "meta.json", lambda: RunReader(root)),
        "scalars": (root / "scalars" / "rank_00000.jsonl", lambda: RunReader(root).scalar_records(0)),
        "rank file": (root / "ranks" / "rank_00000.json", lambda: RunReader(root).rank_info(0)),
        "step file": (next((root / "steps").rglob("rank_00000.h5")), lambda: RunReader(root).step_arrays(1, 0)),
        "step-1 npz": (root / "evidence" / "optimizer_step1.npz", lambda: read_step1_file(root)),
        "step-1 shard": (shard_file(tmp_shards, 0), lambda: read_step1_file(shard_file(tmp_shards, 0).parent)),
        "clip probe": (root / "evidence" / "clip_probe.npz",
                       lambda: read_clip_probe(root / "evidence" / "clip_probe.npz")),
        "seed batch": (root / "step_1" / "rank_0" / "tokens.npy", lambda: read_seed_batch(root, 1, 0)),
    }


def _fifo_writer(path: Path) -> None:
    """Blocks until something opens the FIFO for reading, then writes one byte: the test's own open gets it
    only when no reader opened the FIFO first (a reader that did consumed it, or closed the pipe it went to)."""
    import os

    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, b"M")
    except BrokenPipeError:
        pass
    finally:
        os.close(fd)


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "folder", "dangling"])
def test_no_store_reader_opens_what_is_not_a_regular_file(tmp_path: Path, kind: str) -> None:
    import os
    import threading

    for what in _store_with_every_file(tmp_path / "probe"):
        root = tmp_path / f"{kind}_{what.replace(' ', '_')}"
        path, read = _store_with_every_file(root)[what]
        path.unlink()
        writer = None
        if kind == "fifo":       # a reader that opened it would not hang (the writer answers): it is detected
            os.mkfifo(path)
            writer = threading.Thread(target=_fifo_writer, args=(path,), daemon=True)
            writer.start()
        elif kind == "dev_zero":
            path.symlink_to("/dev/zero")
        elif kind == "folder":
            path.mkdir()
        else:
            path.symlink_to(path.parent / "nowhere")
        try:
            with pytest.raises(BadInput) as ei:
                read()
            _one_line(ei.value)
            assert str(path) in str(ei.value) or str(path.parent) in str(ei.value), (what, str(ei.value))
        finally:
            if writer is not None:
                own = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
                writer.join()
                got = os.read(own, 1)
                os.close(own)
                assert got == b"M", f"{what}: a reader opened the FIFO"
        OUTCOMES[f"not a regular file ({kind}): refused"] += 1


def test_zz_print_outcomes() -> None:
    print("\nfuzz store outcomes:", dict(sorted(OUTCOMES.items())))
