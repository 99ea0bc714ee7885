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
import mmap
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from core.errors import BadInput

CHUNK = 1 << 16     # elements a compute pass covers (256 KiB of float32): a, b, two scratch arrays, the floor
#                     and the mask (1.3 MiB) stay in the 2 MiB L2 across the ~15 passes; 1 MiB chunks did not
READ = 1 << 18      # elements per read where bytes are copied (1 MiB of float32 a side): HDF5 / .npy readers
WINDOW = 1 << 20    # elements per mapped window (4 MiB a side) of a raw float32 tensor: few mmap calls, and
#                     what is mapped at a time (it counts in RSS) stays a few MiB


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
_TINY = _FLOOR[0]
_T1, _T5 = np.float32(0.001), np.float32(0.005)


_LOCAL = threading.local()


def _scratch() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per thread: |a-b|, the relative error and a mask, one chunk each, reused across chunks and tensor pairs
    (fresh arrays per pair cost page faults that showed up as ~20% of a compare's CPU time)."""
    s = getattr(_LOCAL, "scratch", None)
    if s is None:
        s = _LOCAL.scratch = (np.empty(CHUNK, np.float32), np.empty(CHUNK, np.float32), np.empty(CHUNK, np.bool_))
    return s


def _buffers() -> tuple[np.ndarray, np.ndarray]:
    """Per thread: one read buffer a side, READ elements each, reused like _scratch."""
    r = getattr(_LOCAL, "bufs", None)
    if r is None:
        r = _LOCAL.bufs = (np.empty(READ, np.float32), np.empty(READ, np.float32))
    return r


class _Acc:
    """Running sums over chunks (float64 accumulators over float32 chunk results)."""

    def __init__(self) -> None:
        self.n = 0
        self.ab = self.aa = self.bb = self.dd = 0.0
        self.max_abs = self.max_rel = 0.0
        self.within1 = self.within5 = 0
        self.nan = [0, 0]
        self.inf = [0, 0]

    def add(self, a: np.ndarray, b: np.ndarray) -> None:
        """Fold in two flat float32 arrays of equal size, CHUNK elements at a time; a and b are only read."""
        for s in range(0, a.size, CHUNK):
            self._chunk(a[s:s + CHUNK], b[s:s + CHUNK])

    def _neutralised(self, x: np.ndarray, side: int) -> np.ndarray:
        """Count NaN / Inf of one side and return a copy with them zeroed (rare path; the input stays as is)."""
        nan, inf = np.isnan(x), np.isinf(x)
        self.nan[side] += int(nan.sum())
        self.inf[side] += int(inf.sum())
        x = x.copy()
        x[nan | inf] = 0.0
        return x

    def _chunk(self, a: np.ndarray, b: np.ndarray) -> None:
        """One chunk in L2, one numpy pass per step (each pass over L2 data costs ~ a memory copy, so their
        number is the cost): 3 dots, a-b, its dot, |a-b|, max, |b|, min(|b|) (the floor pass runs only when
        some |b| is under 1e-12), the divide, max, two compares and their counts."""
        n = a.size
        d, r, m = _scratch()
        d, r, m = d[:n], r[:n], m[:n]
        aa, bb = float(np.dot(a, a)), float(np.dot(b, b))
        if not (math.isfinite(aa) and math.isfinite(bb)):    # rare path: count exactly, then neutralise
            a, b = self._neutralised(a, 0), self._neutralised(b, 1)
            aa, bb = float(np.dot(a, a)), float(np.dot(b, b))
        self.aa += aa
        self.bb += bb
        self.ab += float(np.dot(a, b))
        np.subtract(a, b, out=d)
        self.dd += float(np.dot(d, d))
        np.abs(d, out=d)
        self.max_abs = max(self.max_abs, float(d.max()))
        # relative error |a-b| / |b| (|b| floored at 1e-12, so b == 0 with a == b counts as exact)
        np.abs(b, out=r)
        if r.min() < _TINY:     # the floor changes something only here; a read-only min is cheaper
            np.maximum(r, _FLOOR[:n], out=r)    # an array operand: numpy 1.26's scalar path is 4x slower
        np.divide(d, r, out=r)
        self.max_rel = max(self.max_rel, float(r.max()))
        self.within5 += int(np.count_nonzero(np.less_equal(r, _T5, out=m)))
        self.within1 += int(np.count_nonzero(np.less_equal(r, _T1, out=m)))
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
    if per_row > buf.size or ds.dtype != np.float32:
        step = max(1, buf.size // max(per_row, 1))
        for r in range(0, rows, step):
            yield np.ascontiguousarray(ds[r:r + step], dtype=np.float32).ravel()
        return
    step = max(1, buf.size // per_row)
    for r in range(0, rows, step):
        e = min(rows, r + step)
        out = buf[: (e - r) * per_row].reshape((e - r,) + ds.shape[1:])
        ds.read_direct(out, np.s_[r:e])
        yield out.ravel()


def compare_arrays(a: np.ndarray, b: np.ndarray) -> Metrics:
    """All metrics for two in-memory arrays (a = baseline, b = candidate; neither is written)."""
    acc = _Acc()
    a = np.ascontiguousarray(a, dtype=np.float32).ravel()
    b = np.ascontiguousarray(b, dtype=np.float32).ravel()
    if a.size != b.size:
        raise BadInput(f"shapes differ: {a.size} vs {b.size} elements")
    acc.add(a, b)
    return acc.result()


def raw_offset(ds: h5py.Dataset) -> int | None:
    """Byte offset of a contiguous, uncompressed little-endian float32 dataset in its file (else None)."""
    if ds.chunks is not None or ds.dtype != np.dtype("<f4") or ds.size == 0:
        return None
    try:
        return ds.id.get_offset()
    except Exception:  # noqa: BLE001 - not allocated / driver without offsets: take the h5py path
        return None


def _read_exact(fh: Any, buf: np.ndarray, path: str) -> None:
    """Fill ``buf`` from the file's position (unbuffered ``readinto``: the kernel copies straight into it)."""
    view = memoryview(buf).cast("B")
    got = 0
    while got < view.nbytes:
        k = fh.readinto(view[got:])
        if not k:
            raise BadInput(f"{path}: file ends inside a tensor (truncated?)")
        got += k


#: Read-only mappings; MAP_POPULATE (Linux): the window's pages enter the page table in the mmap call, not one
#: fault per 4 KiB page as the compare touches them (reader threads' page faults queue on one memory-map lock)
_MAP = ({"flags": mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), "prot": mmap.PROT_READ}
        if hasattr(mmap, "MAP_SHARED") else {"access": mmap.ACCESS_READ})


def _mapped(fh: Any, start: int, n: int, path: str) -> np.ndarray:
    """``n`` float32 values from byte ``start`` of an open file, mapped read-only (no copy: the compare reads
    the page cache's pages themselves; the mapping goes when the array does)."""
    base = start - start % mmap.ALLOCATIONGRANULARITY
    try:
        m = mmap.mmap(fh.fileno(), start - base + 4 * n, offset=base, **_MAP)
    except ValueError as e:     # the window reaches past the end of the file
        raise BadInput(f"{path}: file ends inside a tensor (truncated?)") from e
    return np.frombuffer(m, np.float32, n, start - base)


def _raw_pairs(path_a: str, off_a: int, path_b: str, off_b: int, size: int
               ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Two tensors' float32 bytes straight from their files (no HDF5 / .npy layer), in windows mapped
    read-only: reading them into buffers first was a memory copy costing about what the whole plain read
    costs. Where the file system cannot map, the bytes are read into buffers (unbuffered ``readinto``)."""
    with open(path_a, "rb", buffering=0) as fa, open(path_b, "rb", buffering=0) as fb:
        n = min(WINDOW, size)
        try:
            first = _mapped(fa, off_a, n, path_a), _mapped(fb, off_b, n, path_b)
        except OSError:         # no mapping here: read into buffers below
            pass
        else:
            yield first
            del first           # unmapped once the caller drops it too
            for s in range(WINDOW, size, WINDOW):
                n = min(WINDOW, size - s)
                yield _mapped(fa, off_a + 4 * s, n, path_a), _mapped(fb, off_b + 4 * s, n, path_b)
            return
        ba, bb = _buffers()
        fa.seek(off_a)
        fb.seek(off_b)
        for s in range(0, size, READ):
            n = min(READ, size - s)
            _read_exact(fa, ba[:n], path_a)
            _read_exact(fb, bb[:n], path_b)
            yield ba[:n], bb[:n]


def compare_raw(path_a: str, off_a: int, path_b: str, off_b: int, size: int) -> Metrics:
    """Metrics of two raw float32 tensors at known byte offsets (:func:`raw_offset`), with no HDF5 call: the
    work items of a compare carry the offsets, so reader threads do not queue on h5py's global lock."""
    acc = _Acc()
    for ca, cb in _raw_pairs(path_a, off_a, path_b, off_b, size):
        acc.add(ca, cb)
    return acc.result()


def compare_datasets(da: h5py.Dataset, db: h5py.Dataset, transpose_a: bool = False) -> Metrics:
    """Stream two HDF5 datasets chunk by chunk. ``transpose_a``: baseline is [s, b, ...], candidate [b, s,
    ...] (Megatron vs MindFormers activations); then both stream one batch index at a time (baseline
    ``[:, i]`` against candidate ``[i]``), so memory stays at one [s, ...] slice per side."""
    if da.size != db.size:
        raise BadInput(f"{da.name}: {da.shape} vs {db.shape}")
    acc = _Acc()
    if transpose_a:
        for i in range(da.shape[1]):
            acc.add(np.ascontiguousarray(da[:, i], dtype=np.float32).ravel(),
                    np.ascontiguousarray(db[i], dtype=np.float32).ravel())
        return acc.result()
    oa, ob = raw_offset(da), raw_offset(db)
    if oa is not None and ob is not None:
        return compare_raw(da.file.filename, oa, db.file.filename, ob, da.size)
    if da.shape == db.shape:
        ba, bb = _buffers()
        for ca, cb in zip(_chunks(da, ba), _chunks(db, bb), strict=True):
            acc.add(ca, cb)
    else:   # same size, different shape (e.g. flattened on one side): compare flat
        acc.add(np.asarray(da[...], np.float32).ravel(), np.asarray(db[...], np.float32).ravel())
    return acc.result()


# ------------------------------------------------------------------------------------------------------
# Tensor files: HDF5 datasets (run store), .npy (msprobe MindSpore), any suffix with a reader (.pt)
# ------------------------------------------------------------------------------------------------------

Readers = dict  # suffix (".pt") -> callable(path) -> np.ndarray; see checkpoints.torch_tensors.READERS


def _flat_chunks(parts: Iterator[np.ndarray], n: int = READ) -> Iterator[np.ndarray]:
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

    def raw_offset(self) -> int | None:
        """Offset of the data when it is C-order little-endian float32 (compared straight from the file)."""
        if self.fortran or self.dtype != np.dtype("<f4") or self.size == 0:
            return None
        return self.offset      # npy_header checked that the file holds the data

    def chunks(self) -> Iterator[np.ndarray]:
        if self.fortran:
            yield from _flat_chunks(iter([self.full()]))
            return
        with open(self.path, "rb") as fh:
            fh.seek(self.offset)
            left = self.size
            while left > 0:
                part = np.fromfile(fh, dtype=self.dtype, count=min(READ, left))
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
        for s in range(0, flat.size, READ):
            yield np.asarray(flat[s:s + READ], dtype=np.float32)   # a view when float32: the compare only reads


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
    oa = ta.raw_offset() if isinstance(ta, _Npy) else None
    ob = tb.raw_offset() if isinstance(tb, _Npy) else None
    if oa is not None and ob is not None:
        return compare_raw(path_a, oa, path_b, ob, ta.size)
    acc = _Acc()
    ca_it = ta.chunks() if isinstance(ta, _Loaded) else _flat_chunks(ta.chunks())
    cb_it = tb.chunks() if isinstance(tb, _Loaded) else _flat_chunks(tb.chunks())
    for ca, cb in zip(ca_it, cb_it, strict=True):
        acc.add(ca, cb)
    return acc.result()

