"""The tensor compare's faster paths give what the definitions give: the relative-error floor applied only to
chunks where some |b| is under 1e-12, NaN/Inf chunks neutralised on copies (inputs untouched), and float32
.npy / HDF5 bytes compared from mapped windows (or read into buffers where mapping fails)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from comparators import tensor_metrics as tm
from core.errors import BadInput


def _reference(a: np.ndarray, b: np.ndarray) -> dict:
    """The metrics' definitions in float64 over the whole arrays (NaN/Inf counted, then zeroed)."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    out = {"nan_baseline": int(np.isnan(a).sum()), "nan_candidate": int(np.isnan(b).sum()),
           "inf_baseline": int(np.isinf(a).sum()), "inf_candidate": int(np.isinf(b).sum())}
    a[~np.isfinite(a)] = 0.0
    b[~np.isfinite(b)] = 0.0
    d = a - b
    rel = np.abs(d) / np.maximum(np.abs(b), 1e-12)
    return {**out, "numel": a.size, "cosine": a @ b / math.sqrt((a @ a) * (b @ b)),
            "max_abs_err": np.abs(d).max(), "max_rel_err": rel.max(), "rmse": math.sqrt((d @ d) / a.size),
            "rel_l2": math.sqrt((d @ d) / (b @ b)), "one_thousandth_err_ratio": np.mean(rel <= 1e-3),
            "five_thousandths_err_ratio": np.mean(rel <= 5e-3)}


def _check(got: dict, want: dict) -> None:
    n = want["numel"]
    for k, v in want.items():
        if k.endswith("_ratio"):        # float32 rel vs float64 rel may round across a threshold: 2 elements
            assert abs(got[k] - v) <= 2 / n, k
        elif isinstance(v, int):
            assert got[k] == v, k
        else:
            assert got[k] == pytest.approx(v, rel=1e-5), k


def test_floor_and_nan_chunks_equal_a_float64_reference() -> None:
    """Chunk 0 has no |b| under the floor (floor pass skipped), chunk 1 has zeros and tiny values (floored;
    unfloored, 1e-13 / 1e-20 would make its max_rel 1e7 instead of 0.1), chunk 2 NaN and Inf."""
    rng = np.random.default_rng(5)
    n = 3 * tm.CHUNK + 17
    b = rng.standard_normal(n).astype(np.float32)
    b[np.abs(b) < 1e-3] = 1.0
    a = (b * (1 + rng.standard_normal(n) * 2e-3)).astype(np.float32)
    s = tm.CHUNK + 100
    b[s:s + 4], a[s:s + 4] = [0.0, 0.0, 1e-20, -1e-20], [0.0, 1e-16, 1e-13, -1e-20]
    t = 2 * tm.CHUNK + 7
    a[t], b[t + 1], a[t + 2], b[t + 3] = np.nan, np.nan, np.inf, -np.inf
    a0, b0 = a.copy(), b.copy()
    got = tm.compare_arrays(a, b).as_dict()
    want = _reference(a, b)
    _check(got, want)
    assert np.array_equal(a, a0, equal_nan=True) and np.array_equal(b, b0, equal_nan=True)
    for c in range(2):
        part = slice(c * tm.CHUNK, (c + 1) * tm.CHUNK)
        _check(tm.compare_arrays(a[part], b[part]).as_dict(), _reference(a[part], b[part]))
    assert tm.compare_arrays(a[s:s + 4], b[s:s + 4]).max_rel_err == pytest.approx(0.1, rel=1e-6)


def test_raw_reads_equal_in_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """.npy float32 files are compared from mapped windows (several here, uneven tail), and where mapping
    fails from buffers read with readinto; both are the in-memory compare bit for bit (same chunks). A window
    past the end of the file is BadInput."""
    rng = np.random.default_rng(6)
    n = 2 * tm.WINDOW + tm.READ + 5
    b = rng.standard_normal(n).astype(np.float32)
    a = b + rng.standard_normal(n).astype(np.float32) * np.float32(1e-4)
    a[7], b[n - 1] = np.nan, 0.0
    pa, pb = str(tmp_path / "a.npy"), str(tmp_path / "b.npy")
    np.save(pa, a)
    np.save(pb, b)
    want = tm.compare_arrays(a, b).as_dict()
    got = tm.compare_files(pa, pb)
    assert got is not None and got.as_dict() == want

    def unmappable(*args, **kw):
        raise OSError("no mmap on this file system")

    with monkeypatch.context() as m:
        m.setattr(tm, "_mapped", unmappable)
        got = tm.compare_files(pa, pb)
    assert got is not None and got.as_dict() == want
    off = tm._Npy(pa).raw_offset()
    assert off is not None
    with pytest.raises(BadInput, match="ends inside a tensor"):
        list(tm._raw_pairs(pa, off, pb, off, n + 1))
