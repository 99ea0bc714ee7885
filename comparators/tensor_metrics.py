"""Numerics of two tensors: the metrics msprobe users know, computed in cache-sized chunks.

Metrics carry the names msprobe users know: cosine, max abs err, max relative err, RMSE, one-thousandth and
five-thousandths err ratios (share of elements whose relative error is within 0.001 / 0.005), nan/inf
counts; plus the relative L2 error ||a-b|| / ||b||, the metric the verdict uses because it stays meaningful
where cosine rounds to 1.0.

Why streaming: full-tensor dumps run to gigabytes. Tensors are read in cache-sized chunks straight from the
HDF5 files (run stores) or tensor files (.npy streamed, other suffixes through ``readers``), so memory stays
at a few chunks and the throughput is bounded by memory bandwidth, not by Python.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from core.errors import BadInput

CHUNK = 1 << 18     # elements per chunk (1 MiB of float32): stays in L2 across the ~12 passes per chunk


# ------------------------------------------------------------------------------------------------------
# Metrics
# ------------------------------------------------------------------------------------------------------

@dataclass
class Metrics:
    numel: int = 0
    cosine: float = math.nan
    max_abs_err: float = 0.0
    max_rel_err: float = 0.0
    rmse: float = 0.0
    rel_l2: float = 0.0
    one_thousandth_err_ratio: float = 1.0
    five_thousandths_err_ratio: float = 1.0
    nan_baseline: int = 0
    nan_candidate: int = 0
    inf_baseline: int = 0
    inf_candidate: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


_FLOOR = np.full(CHUNK, 1e-12, np.float32)


_LOCAL = threading.local()


def _buffers() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Four chunk buffers per thread, reused across tensor pairs (fresh 1 MiB arrays per pair cost page
    faults that showed up as ~20% of a compare's CPU time)."""
    bufs = getattr(_LOCAL, "bufs", None)
    if bufs is None:
        bufs = _LOCAL.bufs = tuple(np.empty(CHUNK, np.float32) for _ in range(4))
    return bufs


def _floor(n: int) -> np.ndarray:
    return _FLOOR[:n] if n <= _FLOOR.size else np.full(n, 1e-12, np.float32)


class _Acc:
    """Running sums over chunks (float64 accumulators over float32 chunk results)."""

    def __init__(self) -> None:
        self.n = 0
        self.ab = self.aa = self.bb = self.dd = 0.0
        self.max_abs = self.max_rel = 0.0
        self.within1 = self.within5 = 0
        self.nan = [0, 0]
        self.inf = [0, 0]

    def add(self, a: np.ndarray, b: np.ndarray, work: np.ndarray, work2: np.ndarray) -> None:
        n = a.size
        if n > work.size:    # keep every pass inside the cache-sized work buffers
            for s in range(0, n, work.size):
                self.add(a[s:s + work.size], b[s:s + work.size], work, work2)
            return
        aa, bb = float(np.dot(a, a)), float(np.dot(b, b))
        if not (math.isfinite(aa) and math.isfinite(bb)):    # rare path: count exactly, then neutralise
            for i, x in enumerate((a, b)):
                nan, inf = np.isnan(x), np.isinf(x)
                self.nan[i] += int(nan.sum())
                self.inf[i] += int(inf.sum())
                x[nan | inf] = 0.0
            aa, bb = float(np.dot(a, a)), float(np.dot(b, b))
        d, rel = work[:n], work2[:n]
        self.aa += aa
        self.bb += bb
        self.ab += float(np.dot(a, b))
        np.subtract(a, b, out=d)
        self.dd += float(np.dot(d, d))
        np.abs(d, out=d)
        self.max_abs = max(self.max_abs, float(d.max()) if n else 0.0)
        # relative error |a-b| / |b| (|b| floored at 1e-12, so b == 0 with a == b counts as exact)
        np.abs(b, out=rel)
        np.maximum(rel, _floor(n), out=rel)     # an array operand: numpy 1.26's scalar path is 4x slower
        np.divide(d, rel, out=rel)
        self.max_rel = max(self.max_rel, float(rel.max()) if n else 0.0)
        self.within5 += int(np.count_nonzero(rel <= np.float32(0.005)))
        self.within1 += int(np.count_nonzero(rel <= np.float32(0.001)))
        self.n += n

    def result(self) -> Metrics:
        n = max(self.n, 1)
        denom = math.sqrt(self.aa * self.bb)
        cos = self.ab / denom if denom > 0 else (1.0 if self.aa == self.bb == 0 else 0.0)
        return Metrics(numel=self.n, cosine=cos, max_abs_err=self.max_abs, max_rel_err=self.max_rel,
                       rmse=math.sqrt(self.dd / n), rel_l2=math.sqrt(self.dd / self.bb) if self.bb > 0 else (
                           0.0 if self.dd == 0 else math.inf),
                       one_thousandth_err_ratio=self.within1 / n, five_thousandths_err_ratio=self.within5 / n,
                       nan_baseline=self.nan[0], nan_candidate=self.nan[1], inf_baseline=self.inf[0],
                       inf_candidate=self.inf[1])


def _chunks(ds: h5py.Dataset, buf: np.ndarray) -> Iterator[np.ndarray]:
    """Yield float32 chunks of a dataset, read in row blocks without materialising the whole tensor."""
    if ds.shape == () or ds.ndim == 0:
        buf[0] = np.float32(ds[()])
        yield buf[:1]
        return
    rows = ds.shape[0]
    per_row = int(np.prod(ds.shape[1:])) if ds.ndim > 1 else 1
    if per_row > CHUNK or ds.dtype != np.float32:
        step = max(1, CHUNK // max(per_row, 1))
        for r in range(0, rows, step):
            yield np.ascontiguousarray(ds[r:r + step], dtype=np.float32).ravel()
        return
    step = max(1, CHUNK // per_row)
    for r in range(0, rows, step):
        e = min(rows, r + step)
        out = buf[: (e - r) * per_row].reshape((e - r,) + ds.shape[1:])
        ds.read_direct(out, np.s_[r:e])
        yield out.ravel()


def compare_arrays(a: np.ndarray, b: np.ndarray) -> Metrics:
    """All metrics for two in-memory arrays (a = baseline, b = candidate)."""
    acc = _Acc()
    a = np.ascontiguousarray(a, dtype=np.float32).ravel()
    b = np.ascontiguousarray(b, dtype=np.float32).ravel()
    if a.size != b.size:
        raise BadInput(f"shapes differ: {a.size} vs {b.size} elements")
    w1, w2 = np.empty(CHUNK, np.float32), np.empty(CHUNK, np.float32)
    for s in range(0, max(a.size, 1), CHUNK):
        acc.add(a[s:s + CHUNK].copy(), b[s:s + CHUNK].copy(), w1, w2)
    return acc.result()


def _raw_offset(ds: h5py.Dataset) -> int | None:
    """Byte offset of a contiguous, uncompressed little-endian float32 dataset in its file (else None)."""
    if ds.chunks is not None or ds.dtype != np.dtype("<f4") or ds.size == 0:
        return None
    try:
        return ds.id.get_offset()
    except Exception:  # noqa: BLE001 - not allocated / driver without offsets: take the h5py path
        return None


def _raw_chunks(path: str, offset: int, size: int, buf: np.ndarray) -> Iterator[np.ndarray]:
    """The dataset's bytes read straight from the file into ``buf`` (unbuffered reads, no HDF5 layer):
    the run store writes arrays contiguous and uncompressed, so this is the same data, at memcpy speed."""
    with open(path, "rb", buffering=0) as fh:
        fh.seek(offset)
        for s in range(0, size, buf.size):
            n = min(buf.size, size - s)
            view = memoryview(buf[:n]).cast("B")
            got = 0
            while got < view.nbytes:
                k = fh.readinto(view[got:])
                if not k:
                    raise BadInput(f"{path}: file ends inside a dataset (truncated?)")
                got += k
            yield buf[:n]


def compare_datasets(da: h5py.Dataset, db: h5py.Dataset, transpose_a: bool = False) -> Metrics:
    """Stream two HDF5 datasets chunk by chunk. ``transpose_a``: baseline is [s, b, ...], candidate [b, s,
    ...] (Megatron vs MindFormers activations); then both stream one batch index at a time (baseline
    ``[:, i]`` against candidate ``[i]``), so memory stays at one [s, ...] slice per side."""
    if da.size != db.size:
        raise BadInput(f"{da.name}: {da.shape} vs {db.shape}")
    acc = _Acc()
    ba, bb, w1, w2 = _buffers()
    if transpose_a:
        for i in range(da.shape[1]):
            acc.add(np.ascontiguousarray(da[:, i], dtype=np.float32).ravel(),
                    np.ascontiguousarray(db[i], dtype=np.float32).ravel(), w1, w2)
        return acc.result()
    oa, ob = _raw_offset(da), _raw_offset(db)
    if oa is not None and ob is not None:
        for ca, cb in zip(_raw_chunks(da.file.filename, oa, da.size, ba),
                          _raw_chunks(db.file.filename, ob, db.size, bb), strict=True):
            acc.add(ca, cb, w1, w2)
    elif da.shape == db.shape:
        for ca, cb in zip(_chunks(da, ba), _chunks(db, bb), strict=True):
            acc.add(ca, cb, w1, w2)
    else:   # same size, different shape (e.g. flattened on one side): compare flat
        acc.add(np.asarray(da[...], np.float32).ravel(), np.asarray(db[...], np.float32).ravel(),
                np.empty(da.size, np.float32), np.empty(da.size, np.float32))
    return acc.result()


# ------------------------------------------------------------------------------------------------------
# Tensor files: HDF5 datasets (run store), .npy (msprobe MindSpore), any suffix with a reader (.pt)
# ------------------------------------------------------------------------------------------------------

Readers = dict  # suffix (".pt") -> callable(path) -> np.ndarray; see checkpoints.torch_tensors.READERS


def _flat_chunks(parts: Iterator[np.ndarray], n: int = CHUNK) -> Iterator[np.ndarray]:
    """Re-cut a stream of flat float32 pieces into writable chunks of exactly ``n`` elements (last shorter)."""
    buf = np.empty(n, np.float32)
    fill = 0
    for p in parts:
        p = p.ravel()
        i = 0
        while i < p.size:
            take = min(n - fill, p.size - i)
            buf[fill:fill + take] = p[i:i + take]
            fill += take
            i += take
            if fill == n:
                yield buf
                fill = 0
    if fill:
        yield buf[:fill]


class _Npy:
    """A .npy file read in chunks from its header on (no mmap, so memory stays at one chunk)."""

    def __init__(self, path: str) -> None:
        self.path = path
        from runstore.seed_layout import npy_header  # numpy's public header readers (numpy 1.x and 2.x)

        shape, fortran, dtype, self.offset = npy_header(path)
        self.shape, self.fortran, self.dtype = tuple(shape), fortran, dtype
        self.size = int(np.prod(shape)) if shape else 1

    def full(self) -> np.ndarray:
        from runstore import load_npy

        return np.asarray(load_npy(self.path), dtype=np.float32)

    def chunks(self) -> Iterator[np.ndarray]:
        if self.fortran:
            yield from _flat_chunks(iter([self.full()]))
            return
        with open(self.path, "rb") as fh:
            fh.seek(self.offset)
            left = self.size
            while left > 0:
                part = np.fromfile(fh, dtype=self.dtype, count=min(CHUNK, left))
                if part.size == 0:
                    raise BadInput(f"{self.path}: truncated .npy ({self.size - left} of {self.size} elements)")
                left -= part.size
                yield part.astype(np.float32, copy=part.dtype != np.float32)


class _Loaded:
    """A tensor some reader returned whole (e.g. torch.load of an msprobe .pt file)."""

    def __init__(self, arr: np.ndarray) -> None:
        self.arr = np.asarray(arr)
        self.shape, self.size = self.arr.shape, self.arr.size

    def full(self) -> np.ndarray:
        return np.asarray(self.arr, dtype=np.float32)

    def chunks(self) -> Iterator[np.ndarray]:
        flat = self.arr.reshape(-1)
        for s in range(0, max(flat.size, 1), CHUNK):
            yield np.array(flat[s:s + CHUNK], dtype=np.float32)   # a copy: the accumulator writes into it


def _open_file(path: str, readers: Readers | None) -> _Npy | _Loaded | None:
    """A tensor file as a chunk source; None when no reader handles its suffix."""
    suffix = Path(path).suffix.lower()
    if not Path(path).is_file():
        raise BadInput(f"{path}: tensor file named in the dump is missing")
    if suffix == ".npy":
        return _Npy(path)
    fn = (readers or {}).get(suffix)
    return _Loaded(fn(path)) if fn is not None else None


def compare_files(path_a: str, path_b: str, transpose_a: bool = False, readers: Readers | None = None
                  ) -> Metrics | None:
    """Metrics of two tensor files (.npy streamed; other suffixes through ``readers``); None if unreadable."""
    ta, tb = _open_file(path_a, readers), _open_file(path_b, readers)
    if ta is None or tb is None:
        return None
    if transpose_a:
        return compare_arrays(np.swapaxes(ta.full(), 0, 1), tb.full())
    if ta.size != tb.size:
        raise BadInput(f"{path_a}: {ta.shape} vs {tb.shape}")
    acc = _Acc()
    w1, w2 = _buffers()[2:]
    ca_it = ta.chunks() if isinstance(ta, _Loaded) else _flat_chunks(ta.chunks())
    cb_it = tb.chunks() if isinstance(tb, _Loaded) else _flat_chunks(tb.chunks())
    for ca, cb in zip(ca_it, cb_it, strict=True):
        acc.add(ca, cb, w1, w2)
    return acc.result()

