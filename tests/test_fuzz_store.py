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


def test_zz_print_outcomes() -> None:
    print("\nfuzz store outcomes:", dict(sorted(OUTCOMES.items())))
