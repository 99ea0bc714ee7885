"""Layer tensors of two runs (activations forward, their gradients backward), compared row by row.

Metrics carry the names msprobe users know: cosine, max abs err, max relative err, RMSE, one-thousandth and
five-thousandths err ratios (share of elements whose relative error is within 0.001 / 0.005), nan/inf
counts; plus the relative L2 error ||a-b|| / ||b||, the metric the verdict uses because it stays meaningful
where cosine rounds to 1.0. Thresholds depend on the tensor's original dtype (float32 noise is ~1e-7 per
op, bfloat16 ~4e-3). When only statistics were dumped, max/min/mean/norm are compared instead.

Why streaming: full-tensor dumps run to gigabytes. Tensors are read in cache-sized chunks straight from the
HDF5 files (one tensor pair at a time, two in flight on two threads), so memory stays at a few chunks and
the throughput is bounded by memory bandwidth, not by Python.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from core.dtypes import EPS, coarsest, normalize
from core.errors import BadInput
from core.findings import Finding, StageResult

STAGE = "layer_tensors"
DASK_CONNECT_TIMEOUT = "20s"   # how long to wait for a --scheduler address before saying it is unreachable
CHUNK = 1 << 18     # elements per chunk (1 MiB of float32): stays in L2 across the ~12 passes per chunk
# dtype -> (rel L2 error passes up to, warns up to, cosine passes from)
TOLERANCE = {"float32": (1e-4, 1e-2, 0.99999), "float64": (1e-8, 1e-4, 0.9999999),
             "float16": (2e-3, 5e-2, 0.999), "bfloat16": (1e-2, 1e-1, 0.999)}


def tolerance(dtype: str, table: dict[str, tuple[float, float, float]] | None = None
              ) -> tuple[float, float, float]:
    """(pass, warn, cosine) for ``dtype``; ``table`` overrides TOLERANCE per dtype (e.g. a measured noise)."""
    d = normalize(dtype)
    table = {**TOLERANCE, **(table or {})}
    return table.get(d, table["float32"])


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
        with open(path, "rb") as fh:
            try:
                version = np.lib.format.read_magic(fh)
                shape, fortran, dtype = np.lib.format._read_array_header(fh, version)  # noqa: SLF001
            except (ValueError, OSError) as exc:
                raise BadInput(f"{path}: not a valid .npy array ({exc})") from None
            self.offset = fh.tell()
        if dtype.hasobject:
            raise BadInput(f"{path}: holds pickled objects; refusing to load (no pickle)")
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


# ------------------------------------------------------------------------------------------------------
# Layer sources (run store, msprobe dump) and their rows
# ------------------------------------------------------------------------------------------------------

def _read_stats(path: Path) -> tuple[list[dict[str, Any]], bool]:
    from runstore import check_table, table_columns

    try:
        with h5py.File(path, "r") as h5:
            if "tensor_stats" not in h5:
                return [], "tensors" in h5
            cols = table_columns(h5["tensor_stats"])
            has_tensors = "tensors" in h5
    except OSError as exc:
        raise BadInput(f"{path}: not a readable HDF5 file ({' '.join(str(exc).split())[:80]})") from None
    check_table(path, "tensor_stats", cols)
    n = len(cols.get("order", []))
    rows = [{k: (v[i].item() if hasattr(v[i], "item") else v[i]) for k, v in cols.items()} for i in range(n)]
    rows.sort(key=lambda r: r["order"])
    return rows, has_tensors


class StoreLayers:
    """A run store's ``tensor_stats`` rows; tensors referenced as (HDF5 file, ``tensors/<order>``)."""

    def __init__(self, reader: Any) -> None:
        self.reader = reader
        self.root = reader.root

    def array_steps(self) -> list[int]:
        return self.reader.array_steps()

    def array_ranks(self, step: int) -> list[int]:
        return self.reader.array_ranks(step)

    def layer_rows(self, step: int, rank: int = 0) -> tuple[list[dict[str, Any]], bool]:
        path = Path(self.reader.step_file(step, rank))
        rows, has_tensors = _read_stats(path)
        for r in rows:
            r["ref"] = ("h5", str(path), f"tensors/{int(r['order']):06d}") if has_tensors else None
        return rows, has_tensors


def layer_source(run: Any) -> Any:
    """Whatever holds layer tensors (run-store path / RunReader / Run, msprobe dump path / Run) -> source."""
    from runstore import RunReader
    from sources.msprobe import MsprobeDump, is_msprobe_dump, open_msprobe

    if isinstance(run, (MsprobeDump, StoreLayers)):
        return run
    if getattr(run, "kind", None) == "msprobe":
        return open_msprobe(run.path)
    if getattr(run, "store", None) is not None:
        return StoreLayers(run.store)
    if hasattr(run, "array_ranks") and hasattr(run, "step_file"):
        return StoreLayers(run)
    if isinstance(run, (str, Path)) and is_msprobe_dump(run):
        return open_msprobe(run)
    return StoreLayers(RunReader(getattr(run, "path", run)))


def _direction(kind: str) -> str:
    return "backward" if str(kind).startswith("backward") else "forward"


def _layer_of(module: str) -> int | None:
    import re

    m = re.search(r"layers\.(\d+)", module)
    return int(m.group(1)) if m else None


def _stats_verdict(rb: dict[str, Any], rc: dict[str, Any], tol: tuple[float, float, float]
                   ) -> tuple[str, float, dict[str, float]]:
    """Statistics-only: norm relative difference, and max/min/mean relative to the tensor's scale."""
    nb, nc = float(rb.get("norm", 0.0)), float(rc.get("norm", 0.0))
    numel = max(int(rb.get("numel", 1) or 1), 1)
    rms = nb / math.sqrt(numel) if nb > 0 else 1e-30
    scale = max(abs(float(rb.get("max", 0.0))), abs(float(rb.get("min", 0.0))), 1e-30)
    diffs = {"norm_rel_diff": abs(nb - nc) / max(abs(nb), 1e-30) if nb != nc else 0.0,
             "max_diff": abs(float(rb.get("max", 0)) - float(rc.get("max", 0))) / scale,
             "min_diff": abs(float(rb.get("min", 0)) - float(rc.get("min", 0))) / scale,
             "mean_diff": abs(float(rb.get("mean", 0)) - float(rc.get("mean", 0))) / rms}
    worst_v = max(v if math.isfinite(v) else math.inf for v in diffs.values())
    if any(int(r.get(k, 0) or 0) for r in (rb, rc) for k in ("nan", "inf")):
        if (int(rb.get("nan", 0)), int(rb.get("inf", 0))) != (int(rc.get("nan", 0)), int(rc.get("inf", 0))):
            return "fail", math.inf, diffs
    v = "pass" if worst_v <= tol[0] else "warn" if worst_v <= tol[1] else "fail"
    return v, worst_v, diffs


def _tensor_verdict(mt: Metrics, tol: tuple[float, float, float]) -> str:
    if (mt.nan_baseline, mt.inf_baseline) != (mt.nan_candidate, mt.inf_candidate):
        return "fail"
    if not math.isfinite(mt.rel_l2) or mt.rel_l2 > tol[1] or mt.cosine < 0.99:
        return "fail"
    if mt.rel_l2 > tol[0] or mt.cosine < tol[2]:
        return "warn"
    return "pass"


def _pair_rows(rows_a: list[dict[str, Any]], rows_b: list[dict[str, Any]], m: Any
               ) -> tuple[list[tuple[dict[str, Any], dict[str, Any]]], list[str], bool]:
    """Pair rows by (module through the mapping, kind, occurrence of that pair in execution order)."""
    mods_b = {r["module"] for r in rows_b}
    same_scheme = sum(r["module"] in mods_b for r in rows_a) >= len({r["module"] for r in rows_a}) / 2

    def key(mod: str, kind: str, seen: dict[tuple[str, str], int]) -> tuple[str, str, int]:
        k = (mod, kind)
        seen[k] = seen.get(k, 0) + 1
        return mod, kind, seen[k]

    seen_b: dict[tuple[str, str], int] = {}
    index_b = {key(r["module"], r["kind"], seen_b): r for r in rows_b}
    seen_a: dict[tuple[str, str], int] = {}
    pairs, unmatched = [], []
    for r in rows_a:
        target = r["module"] if same_scheme else m.map_module(r["module"], "baseline")
        kb = key(r["module"], r["kind"], seen_a)
        rb = index_b.get((target, r["kind"], kb[2])) if target else None
        if rb is None:
            unmatched.append(r["module"] + " " + r["kind"])
        else:
            pairs.append((r, rb))
    return pairs, unmatched, same_scheme


def _shape(s: Any) -> tuple[int, ...]:
    return tuple(int(x) for x in str(s).split("x") if x != "") if s not in (None, "") else ()


def compare_pair(task: dict[str, Any]) -> dict[str, Any]:
    """One work item: one baseline row against its candidate row (tensor files, else statistics).

    A plain function of plain data, so threads, processes and Dask workers run the very same code and the
    results do not depend on where it ran.
    """
    ra, rb, full, transpose = task["a"], task["b"], task["full"], task["transpose"]
    judged = task.get("judged_dtype") or ra.get("dtype", "float32")
    tol = tolerance(judged, task.get("tolerances"))
    out = {"order": int(ra["order"]), "module": ra["module"], "candidate_module": rb["module"],
           "kind": ra["kind"], "direction": _direction(ra["kind"]), "layer": _layer_of(ra["module"]),
           "dtype": ra.get("dtype", "float32"), "judged_dtype": normalize(judged), "shape": ra.get("shape", ""),
           "candidate_shape": rb.get("shape", ""), "step": task.get("step"), "rank": task.get("rank")}
    ref_a, ref_b = ra.get("ref"), rb.get("ref")
    mt = Metrics(**task["metrics"]) if task.get("metrics") else None
    if mt is None and full and ref_a is not None and ref_b is not None:
        sa, sb = _shape(ra.get("shape")), _shape(rb.get("shape"))
        tr = transpose and len(sa) >= 2 and sa != sb and (sa[1], sa[0]) + sa[2:] == sb
        if isinstance(ref_a, (tuple, list)) and isinstance(ref_b, (tuple, list)):   # both HDF5 (run stores)
            with h5py.File(ref_a[1], "r") as ha, h5py.File(ref_b[1], "r") as hb:
                if ref_a[2] in ha and ref_b[2] in hb:
                    da, db = ha[ref_a[2]], hb[ref_b[2]]
                    tr = transpose and da.ndim >= 2 and da.shape != db.shape and \
                        (da.shape[1], da.shape[0]) + da.shape[2:] == db.shape
                    mt = compare_datasets(da, db, transpose_a=tr) if da.size == db.size else None
        elif isinstance(ref_a, str) and isinstance(ref_b, str):
            if math.prod(sa or (1,)) == math.prod(sb or (1,)):
                mt = compare_files(ref_a, ref_b, transpose_a=tr, readers=task.get("readers"))
    if mt is not None:
        out.update(mt.as_dict(), mode="tensor", verdict=_tensor_verdict(mt, tol),
                   metric="rel_l2", value=mt.rel_l2, threshold=tol[0])
        return out
    v, worst_v, diffs = _stats_verdict(ra, rb, tol)
    out.update(diffs, mode="stats", verdict=v, metric="stats_rel_diff", value=worst_v, threshold=tol[0],
               nan_baseline=int(ra.get("nan", 0)), nan_candidate=int(rb.get("nan", 0)),
               inf_baseline=int(ra.get("inf", 0)), inf_candidate=int(rb.get("inf", 0)))
    if full and ref_a is not None and ref_b is not None:
        out["tensor_unread"] = _why_unread(ref_a, ref_b, task.get("readers"))
    return out


def _why_unread(ref_a: Any, ref_b: Any, readers: Readers | None) -> str:
    for ref in (ref_a, ref_b):
        if isinstance(ref, str) and Path(ref).suffix.lower() != ".npy" and \
                Path(ref).suffix.lower() not in (readers or {}):
            return f"no reader for {Path(ref).suffix} files"
    return "shapes differ"


def run_tasks(tasks: list[dict[str, Any]], jobs: int = 1, scheduler: str | None = None,
              executor: str = "thread") -> list[dict[str, Any]]:
    """Run work items in order: serially (jobs 1), on ``jobs`` threads or processes, or on a Dask cluster.

    Threads suit HDF5 (h5py serialises its calls, numpy's passes run free of the GIL); processes read in
    parallel too; ``scheduler`` ("tcp://host:8786", or a dask.distributed Client) fans the items out to a
    cluster whose workers see the same paths.
    """
    keys = _stored_as(tasks)
    first: dict[Any, int] = {}       # where the tensors are stored -> the task that reads them
    reads = [i for i, k in enumerate(keys) if k is None or first.setdefault(k, i) == i]
    done = dict(zip(reads, _dispatch([tasks[i] for i in reads], jobs, scheduler, executor), strict=True))
    out = []
    for i, (t, k) in enumerate(zip(tasks, keys, strict=True)):
        if i in done:
            out.append(done[i])
            continue
        r = done[first[k]]           # a row whose tensors are links to an earlier row's: judge its metrics
        metrics = {f: r[f] for f in Metrics.__dataclass_fields__} if r.get("mode") == "tensor" else None
        out.append(compare_pair({**t, "metrics": metrics}))
    return out


def _stored_as(tasks: list[dict[str, Any]]) -> list[Any]:
    """Per task, where both tensors are stored (file and data offset of each side, and the transpose):
    rows whose datasets are HDF5 hard links to the same stored tensors on both sides (the dumper links a
    tensor it saw twice, e.g. one module's output that is the next one's input) are compared once and
    judged per row. None where a side is not a contiguous HDF5 dataset of a run store."""
    names: dict[str, set[str]] = {}
    for t in tasks:
        if not t.get("full"):
            continue
        for ref in (t["a"].get("ref"), t["b"].get("ref")):
            if isinstance(ref, (tuple, list)):
                names.setdefault(ref[1], set()).add(ref[2])
    offsets: dict[tuple[str, str], int | None] = {}
    for path, wanted in names.items():
        try:
            with h5py.File(path, "r") as h5:
                for n in wanted:
                    obj = h5.get(n)
                    offsets[(path, n)] = obj.id.get_offset() if isinstance(obj, h5py.Dataset) else None
        except OSError:
            continue       # the compare itself reports an unreadable file
    keys: list[Any] = []
    for t in tasks:
        ra, rb = t["a"].get("ref"), t["b"].get("ref")
        if not t.get("full") or not isinstance(ra, (tuple, list)) or not isinstance(rb, (tuple, list)):
            keys.append(None)
            continue
        oa, ob = offsets.get((ra[1], ra[2])), offsets.get((rb[1], rb[2]))
        keys.append(None if oa is None or ob is None else (ra[1], oa, rb[1], ob, bool(t.get("transpose"))))
    return keys


def _dispatch(tasks: list[dict[str, Any]], jobs: int, scheduler: Any, executor: str) -> list[dict[str, Any]]:
    if scheduler is not None:
        return _run_dask(tasks, scheduler)
    if jobs <= 1 or len(tasks) <= 1:
        return [compare_pair(t) for t in tasks]
    if executor == "process":
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            return list(pool.map(compare_pair, tasks, chunksize=max(1, len(tasks) // (jobs * 8))))
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(compare_pair, tasks))


def _run_dask(tasks: list[dict[str, Any]], scheduler: Any) -> list[dict[str, Any]]:
    try:
        from dask.distributed import Client
    except ImportError:
        raise BadInput("--scheduler needs dask.distributed (pip install 'xf-align[dask]')") from None
    own = not hasattr(scheduler, "map")
    try:
        client = Client(scheduler, timeout=DASK_CONNECT_TIMEOUT) if own else scheduler
    except OSError as exc:
        raise BadInput(f"{scheduler}: cannot reach the Dask scheduler ({exc})") from None
    try:
        futures = client.map(compare_pair, tasks, pure=False)
        return client.gather(futures)
    finally:
        if own:
            client.close()


def plan_layer_tasks(baseline: Any, candidate: Any, mapping: Any = None, *, step: int = 1, rank: int = 0,
                     candidate_rank: int | None = None, stats_only: bool = False,
                     tolerances: dict[str, tuple[float, float, float]] | None = None,
                     readers: Readers | None = None) -> dict[str, Any]:
    """Pair the rows of one step and rank: the work items (one per tensor pair) and what was left out."""
    from mapping import Mapping
    from models import load_mapping

    m = mapping if isinstance(mapping, Mapping) else load_mapping(mapping)
    src_a, src_b = layer_source(baseline), layer_source(candidate)
    rows_a, tens_a = src_a.layer_rows(step, rank)
    rows_b, tens_b = src_b.layer_rows(step, rank if candidate_rank is None else candidate_rank)
    plan: dict[str, Any] = {"step": step, "rank": rank, "tasks": [], "rows_a": len(rows_a), "rows_b": len(rows_b),
                            "unmatched": [], "full": False,
                            "missing": [str(getattr(s, "root", "?")) for s, r in ((src_a, rows_a), (src_b, rows_b))
                                        if not r]}
    if not rows_a or not rows_b:
        return plan
    pairs, unmatched, same_scheme = _pair_rows(rows_a, rows_b, m)
    transpose = (not same_scheme and m.activation_layout.get("baseline") == "sbh"
                 and m.activation_layout.get("candidate") == "bsh")
    full = bool(tens_a and tens_b and not stats_only)
    plan.update(unmatched=unmatched, full=full,
                tasks=[{"a": ra, "b": rb, "full": full, "transpose": transpose, "tolerances": tolerances,
                        "readers": readers, "step": step, "rank": rank, "judged_dtype": judged}
                       for (ra, rb), judged in zip(pairs, judged_dtypes(pairs), strict=True)])
    return plan


def judged_dtypes(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[str]:
    """The dtype whose noise each row pair is judged against: the coarsest computed at or upstream of it.

    Why: a tensor is no more precise than the least precise computation it went through. MindFormers'
    flash-attention path casts q/k/v to float16 even in a float32 run, so every row after the first
    float16 attention output carries float16 rounding, while the rows before it (embedding, first norm)
    must still meet float32's line, or a float16 embedding hides under attention's noise. Forward rows
    look at forward rows up to themselves (either side's dtype); backward rows at the whole forward and
    the backward rows up to themselves.
    """
    out: list[str] = []
    fwd: list[str] = []          # the coarsest floating dtype of the forward rows so far (kept, not re-scanned)
    bwd: list[str] = []          # and of the backward rows
    for ra, rb in pairs:
        here = [d for d in (normalize(ra.get("dtype", "float32")), normalize(rb.get("dtype", "float32")))
                if d in EPS]
        if _direction(ra["kind"]) == "forward":
            fwd = [coarsest(fwd + here)] if fwd or here else []
            out.append(coarsest(fwd))
        else:
            bwd = [coarsest(bwd + here)] if bwd or here else []
            out.append(coarsest(fwd + bwd))
    return out


def compare_layer_tensors(baseline: Any, candidate: Any, mapping: Any = None, *, step: int = 1,
                          rank: int = 0, candidate_rank: int | None = None, stats_only: bool = False,
                          threads: int = 2, tolerances: dict[str, tuple[float, float, float]] | None = None,
                          jobs: int | None = None, scheduler: Any = None, executor: str = "thread",
                          readers: Readers | None = None) -> StageResult:
    """Compare layer tensors of ``step``; names the first departing layer, forward then backward.

    ``baseline`` / ``candidate``: a run store or an msprobe dump (path, Run or reader). Rows pair by module
    name through the mapping (same-scheme runs pair by identical names), the row kind (``forward.output.0``
    ...) and the occurrence count of that (module, kind) in execution order. ``jobs`` parallel readers
    (``executor`` "thread" or "process"; default ``threads``), or ``scheduler``: a Dask scheduler address.
    ``readers``: suffix -> loader for tensor files numpy cannot stream (msprobe's .pt: pass
    ``checkpoints.torch_tensors.READERS``); without one those rows compare by statistics.
    """
    plan = plan_layer_tasks(baseline, candidate, mapping, step=step, rank=rank, candidate_rank=candidate_rank,
                            stats_only=stats_only, tolerances=tolerances, readers=readers)
    rows_out = run_tasks(plan["tasks"], jobs or threads, scheduler, executor)
    return summarise(plan, rows_out)


def compare_layer_tensors_all(baseline: Any, candidate: Any, mapping: Any = None, *,
                              steps: list[int] | None = None, ranks: list[int] | None = None,
                              stats_only: bool = False, jobs: int = 1, scheduler: Any = None,
                              executor: str = "thread",
                              tolerances: dict[str, tuple[float, float, float]] | None = None,
                              readers: Readers | None = None) -> dict[tuple[int, int], StageResult]:
    """Every (step, rank) both sides hold, as one flat list of work items (step x rank x tensor): the shape
    of work a cluster spreads best. Returns {(step, rank): StageResult}, each equal to compare_layer_tensors."""
    src_a, src_b = layer_source(baseline), layer_source(candidate)
    steps = steps or [s for s in src_a.array_steps() if s in set(src_b.array_steps())]
    plans = []
    for st in steps:
        for rk in (ranks or [r for r in src_a.array_ranks(st) if r in set(src_b.array_ranks(st))]):
            plans.append(plan_layer_tasks(src_a, src_b, mapping, step=st, rank=rk, stats_only=stats_only,
                                          tolerances=tolerances, readers=readers))
    flat = [t for p in plans for t in p["tasks"]]
    done = run_tasks(flat, jobs, scheduler, executor)
    out, i = {}, 0
    for p in plans:
        n = len(p["tasks"])
        out[(p["step"], p["rank"])] = summarise(p, done[i:i + n])
        i += n
    return out


def summarise(plan: dict[str, Any], rows_out: list[dict[str, Any]]) -> StageResult:
    """Findings of one step and rank from its compared rows (first departure forward, then backward)."""
    res = StageResult(STAGE)
    step, rank = plan["step"], plan["rank"]
    if plan["missing"]:
        res.details = {"reason": "no tensor rows (tensor_stats table / dump.json data) in "
                                 + ", ".join(plan["missing"])}
        return res
    unmatched, full = plan["unmatched"], plan["full"]
    first = {}
    for direction in ("forward", "backward"):
        for r in rows_out:
            if r["direction"] == direction and r["verdict"] != "pass":
                first[direction] = r
                break
    for direction in ("forward", "backward"):
        r = first.get(direction)
        if r is None:
            continue
        where = f"layer {r['layer']}, " if r["layer"] is not None else ""
        if direction == "backward" and "forward" in first:
            where = "(after the forward departure, expected) " + where
        res.add(Finding(STAGE, r["verdict"], r["module"], r["metric"], r["value"], r["threshold"],
                        f"first departing {direction} tensor: {where}{r['module']} {r['kind']} "
                        f"({r['mode']} compare, {_judged(r)}: {r['metric']} {r['value']:.3g} > {r['threshold']:g})"))
    if unmatched:
        res.add(Finding(STAGE, "warn", unmatched[0].split(" ")[0], "unmatched_rows", len(unmatched), 0,
                        f"{len(unmatched)} baseline tensor rows have no counterpart (first: {unmatched[0]}); "
                        "not compared"))
    unread = [r for r in rows_out if r.get("tensor_unread", "").startswith("no reader")]
    if unread:
        res.add(Finding(STAGE, "warn", unread[0]["module"], "tensor_files_unread", len(unread), 0,
                        f"{len(unread)} rows compared by statistics only: {unread[0]['tensor_unread']} "
                        "(msprobe .pt needs torch: readers=checkpoints.torch_tensors.READERS)"))
    extra_b = plan["rows_b"] - len(rows_out)
    if not first and rows_out:
        res.add(Finding(STAGE, "pass", None, "rows_within_tolerance", len(rows_out), None,
                        f"all {len(rows_out)} compared tensor rows within their dtype's tolerance"))
    departing = [r for r in rows_out if r["verdict"] != "pass"]
    res.details = {"step": step, "rank": rank, "compared": len(rows_out),
                   "mode": "tensor" if full else "stats", "departing": len(departing),
                   "first_departing_forward": _brief(first.get("forward")),
                   "first_departing_backward": _brief(first.get("backward")),
                   "first_departing_layer": (first.get("forward") or first.get("backward") or {}).get("layer"),
                   "unmatched_baseline": unmatched, "unmatched_candidate_rows": extra_b,
                   "rows": rows_out, "per_layer": _per_layer(rows_out)}
    return res


def _judged(r: dict[str, Any]) -> str:
    d, j = normalize(r["dtype"]), r.get("judged_dtype", normalize(r["dtype"]))
    return d if j == d else f"{d} judged as {j}, computed upstream"


def _brief(r: dict[str, Any] | None) -> dict[str, Any] | None:
    if r is None:
        return None
    return {k: r[k] for k in ("module", "kind", "layer", "order", "metric", "value", "threshold", "mode")}


def _per_layer(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The per-layer error profile: worst metric value per (direction, layer)."""
    acc: dict[tuple[str, Any], dict[str, Any]] = {}
    for r in rows:
        k = (r["direction"], r["layer"])
        a = acc.setdefault(k, {"direction": r["direction"], "layer": r["layer"], "worst": 0.0, "rows": 0})
        a["rows"] += 1
        v = r["value"] if math.isfinite(r["value"]) else math.inf
        a["worst"] = max(a["worst"], v)
    return sorted(acc.values(), key=lambda a: (a["direction"] != "forward", a["layer"] is None,
                                               a["layer"] if a["layer"] is not None else 0))
