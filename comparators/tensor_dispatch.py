"""Running the work items of a layer-tensor compare: serially, on threads or processes, or on a Dask cluster.

Each item is a plain dict run by ``comparators.tensor_pair.compare_pair``, so the results do not depend on
where it ran; rows whose tensors are stored once (HDF5 hard links on both sides) are read once.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import h5py

from comparators.tensor_metrics import Metrics, raw_offset
from comparators.tensor_pair import compare_pair
from core.errors import BadInput
from runstore.h5file import check_dataset, open_h5
from sources.layers import release_files

DASK_CONNECT_TIMEOUT = "20s"   # how long to wait for a --scheduler address before saying it is unreachable


def run_tasks(tasks: list[dict[str, Any]], jobs: int = 1, scheduler: str | None = None,
              executor: str = "thread") -> list[dict[str, Any]]:
    """Run work items in order: serially (jobs 1), on ``jobs`` threads or processes, or on a Dask cluster.

    Threads suit HDF5 (h5py serialises its calls, numpy's passes run free of the GIL); processes read in
    parallel too; ``scheduler`` ("tcp://host:8786", or a dask.distributed Client) fans the items out to a
    cluster whose workers see the same paths.
    """
    keys, raw = _stored_as(tasks)
    # "checked": both sides' datasets passed runstore.h5file.check_dataset in _stored_as (compare_pair then
    # does not check them again)
    tasks = [{**t, "raw": r, "checked": True} if t.get("full") and _h5(t["a"].get("ref")) and
             _h5(t["b"].get("ref")) else t for t, r in zip(tasks, raw, strict=True)]
    first: dict[Any, int] = {}       # where the tensors are stored -> the task that reads them
    reads = [i for i, k in enumerate(keys) if k is None or first.setdefault(k, i) == i]
    try:
        done = dict(zip(reads, _dispatch([tasks[i] for i in reads], jobs, scheduler, executor), strict=True))
    finally:
        release_files()     # the step files a gathered compare kept open
    out = []
    for i, (t, k) in enumerate(zip(tasks, keys, strict=True)):
        if i in done:
            out.append(done[i])
            continue
        r = done[first[k]]           # a row whose tensors are links to an earlier row's: judge its metrics
        metrics = {f: r[f] for f in Metrics.__dataclass_fields__} if r.get("mode") == "tensor" else None
        out.append(compare_pair({**t, "metrics": metrics}))
    return out


def _stored_as(tasks: list[dict[str, Any]]) -> tuple[list[Any], list[tuple[int, int, int] | None]]:
    """Per task, where both tensors are stored (file and data offset of each side, and the transpose):
    rows whose datasets are HDF5 hard links to the same stored tensors on both sides (the dumper links a
    tensor it saw twice, e.g. one module's output that is the next one's input) are compared once and
    judged per row. None where a side is not a contiguous HDF5 dataset of a run store. Second, per task,
    (baseline offset, candidate offset, elements) where both sides are raw float32 of one size and no
    transpose is asked: ``compare_pair`` then reads the bytes with no HDF5 call (each file is opened here
    once, not once per row in every reader). Every dataset is checked here, once (runstore.h5file: a step
    file that is not a regular HDF5 file, or a size declared beyond the file or beyond any step file's array,
    is a one-line BadInput naming file and dataset before anything reads or maps it)."""
    names: dict[str, set[str]] = {}
    for t in tasks:
        if not t.get("full"):
            continue
        for ref in (t["a"].get("ref"), t["b"].get("ref")):
            if _h5(ref):
                names.setdefault(ref[1], set()).add(ref[2])
    offsets: dict[tuple[str, str], int | None] = {}
    raws: dict[tuple[str, str], tuple[int, int]] = {}      # raw float32 datasets: (offset, elements)
    for path, wanted in names.items():
        with open_h5(path) as h5:
            size = os.path.getsize(path)
            for n in sorted(wanted):
                try:
                    obj = h5.get(n)
                except (OSError, KeyError, ValueError, RuntimeError) as exc:
                    raise BadInput(f"{path}: '{n}': unreadable ({' '.join(str(exc).split())[:80]})") from None
                if isinstance(obj, h5py.Group):
                    raise BadInput(f"{path}: '{n}' is a group, expected an array")
                if not isinstance(obj, h5py.Dataset):
                    offsets[(path, n)] = None       # not stored: compared by its statistics
                    continue
                check_dataset(path, n, obj, size)
                raw = raw_offset(obj)       # the offset itself, when the dataset is raw float32
                offsets[(path, n)] = raw if raw is not None else obj.id.get_offset()
                if raw is not None:
                    raws[(path, n)] = (raw, obj.size)
    keys: list[Any] = []
    direct: list[tuple[int, int, int] | None] = []
    for t in tasks:
        ra, rb = t["a"].get("ref"), t["b"].get("ref")
        if not t.get("full") or not _h5(ra) or not _h5(rb):   # (a gathered row's parts: read each time)
            keys.append(None)
            direct.append(None)
            continue
        oa, ob = offsets.get((ra[1], ra[2])), offsets.get((rb[1], rb[2]))
        keys.append(None if oa is None or ob is None else (ra[1], oa, rb[1], ob, bool(t.get("transpose"))))
        xa, xb = raws.get((ra[1], ra[2])), raws.get((rb[1], rb[2]))
        same = xa is not None and xb is not None and xa[1] == xb[1] and not t.get("transpose")
        direct.append((xa[0], xb[0], xa[1]) if same else None)
    return keys, direct


def _h5(ref: Any) -> bool:
    return isinstance(ref, (tuple, list)) and len(ref) == 3 and ref[0] == "h5"


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
        chunks = _chunks(tasks, len(client.scheduler_info().get("workers", {})) or 1)
        futures = client.map(_compare_chunk, chunks, pure=False)
        return [r for part in client.gather(futures) for r in part]
    finally:
        if own:
            client.close()


#: Rows per Dask task at most: one task per row costs the scheduler ~1-5 ms a row, 20-100x a statistics row's
#: own compare (benchmarks/bench_scale.py), so rows travel in runs of consecutive rows.
DASK_CHUNK = 256


def _chunks(tasks: list[dict[str, Any]], workers: int) -> list[list[dict[str, Any]]]:
    """Consecutive runs of work items: at most DASK_CHUNK, and at least 8 runs a worker while there are
    rows for them (a run holding full tensors then leaves the others room to balance)."""
    if not tasks:
        return []
    size = max(1, min(DASK_CHUNK, -(-len(tasks) // (8 * workers))))
    return [tasks[i: i + size] for i in range(0, len(tasks), size)]


def _compare_chunk(chunk: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [compare_pair(t) for t in chunk]
