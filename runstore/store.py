"""The run store: one on-disk format for every source (live dumpers, logs, TensorBoard).

Layout of a run directory::

    RUN/meta.json                          run-level metadata (framework, versions, config, parallel, ...)
    RUN/ranks/rank_00000.json              per-rank facts (tp/pp/dp coordinates, host, pid)
    RUN/scalars/rank_00000.jsonl           one JSON object per line: {"step": N, "loss": ..., ...}
    RUN/steps/step_00000001/rank_00000.h5  arrays of one step on one rank (batch, local norms, tensors)
    RUN/step_1/rank_0/tokens.npy           optional seed layout that MindFormers replays

Why these choices: a JSON line appended and flushed per step costs microseconds and survives a kill
(at most the last line is torn, and the reader says so); one HDF5 file per step and rank means ranks
never share a file; every file appears under its final name only once complete (temporary name, then
``os.replace``), so a run killed mid-step leaves every completed step readable and a ``.tmp`` file that
names the incomplete one. Nothing is pickled: HDF5, JSON and ``.npy`` read with ``allow_pickle=False``.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import threading
import zipfile
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import h5py
import numpy as np

if TYPE_CHECKING:   # pandas is imported where tables are built: readers of arrays alone skip its ~0.8 s import
    import pandas as pd

from core.errors import BadInput
from runstore.schema import load_json, read_bytes, regular_file

SCHEMA = "xf-align-run/1"
META = "meta.json"
# Files a stage reads as a whole (not per step): evidence/optimizer_step1.npz, evidence/conversion.json
EVIDENCE_DIR = "evidence"
OPTIMIZER_EVIDENCE = "optimizer_step1.npz"
CONVERSION_EVIDENCE = "conversion.json"
STEP_DIR = "steps"
SCALAR_DIR = "scalars"
RANK_DIR = "ranks"
SEED_BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask")

_STEP_RE = re.compile(r"^step_(\d+)$")
_RANK_H5_RE = re.compile(r"^rank_(\d+)\.h5$")
_RANK_TMP_RE = re.compile(r"^rank_(\d+)\.h5\.tmp")
_SEED_RANK_RE = re.compile(r"^rank_(\d+)$")
_SCALAR_RANK_RE = re.compile(r"^rank_(\d{1,9})\.jsonl$")


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / STEP_DIR / f"step_{step:08d}"


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


@contextmanager
def atomic_file(path: Path) -> Iterator[Any]:
    """A binary file handle whose content appears at ``path`` only when the block completes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            yield fh
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` so that ``path`` either holds all of it or does not change."""
    with atomic_file(path) as fh:
        fh.write(data)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, json.dumps(obj, indent=2, default=_json_default, sort_keys=True).encode())


def _save_npy_atomic(path: Path, array: np.ndarray) -> None:
    with atomic_file(path) as fh:
        np.save(fh, np.ascontiguousarray(array), allow_pickle=False)


class RunWriter:
    """Writes one rank's share of a run store. Each rank creates its own writer on the same root."""

    def __init__(self, root: str | os.PathLike, *, rank: int = 0, meta: Mapping[str, Any] | None = None,
                 rank_info: Mapping[str, Any] | None = None) -> None:
        self.root = Path(root)
        self.rank = int(rank)
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / SCALAR_DIR).mkdir(exist_ok=True)
        if meta is not None and self.rank == 0:
            self.update_meta(meta)
        info = {"rank": self.rank, "pid": os.getpid()}
        info.update(rank_info or {})
        atomic_write_json(self.root / RANK_DIR / f"rank_{self.rank:05d}.json", info)
        self._scalars = open(self.root / SCALAR_DIR / f"rank_{self.rank:05d}.jsonl", "a", encoding="utf-8")
        self._open_step: int | None = None
        self._h5: h5py.File | None = None
        self._tmp: Path | None = None
        self._counter: dict[str, int] = {}
        self._keys: set[str] = set()                 # datasets written into the open step file
        self._groups: dict[str, h5py.Group] = {}     # groups of the open step file, by path
        self._dsids: dict[str, Any] = {}              # low-level dataset ids written this step (link targets)

    # -- metadata -------------------------------------------------------------------------------------
    def update_meta(self, values: Mapping[str, Any]) -> None:
        """Merge ``values`` into meta.json (rank 0 owns the file; other ranks write rank info instead)."""
        path = self.root / META
        meta = json.loads(path.read_text()) if path.exists() else {"schema": SCHEMA}
        meta.update(values)
        meta["schema"] = SCHEMA
        atomic_write_json(path, meta)

    # -- scalars --------------------------------------------------------------------------------------
    def log_scalars(self, step: int, values: Mapping[str, float | int | str | None]) -> None:
        """Append one step's scalars; flushed at once so a killed run keeps every logged step."""
        record = {"step": int(step)}
        for key, value in values.items():
            record[key] = value.item() if isinstance(value, np.generic) else value
        self._scalars.write(json.dumps(record, default=_json_default) + "\n")
        self._scalars.flush()

    def log_scalar_series(self, series: Mapping[str, pd.Series]) -> None:
        """Append many steps at once (importers): one record per step, only the keys reported there."""
        import pandas as pd

        frame = pd.DataFrame(dict(series))
        frame.index.name = "step"
        present = np.zeros(frame.shape, dtype=bool)
        for key, s in series.items():  # a NaN the run reported is kept; a key absent at a step is not
            present[:, frame.columns.get_loc(key)] = frame.index.isin(s.index)
        cols = list(frame.columns)
        values = frame.to_numpy(dtype=np.float64)
        lines = []
        for step, row, keep in zip(frame.index.tolist(), values.tolist(), present.tolist(), strict=True):
            rec = {"step": int(step)}
            for c, v, k in zip(cols, row, keep, strict=True):
                if k:
                    rec[c] = v
            lines.append(json.dumps(rec))
        self._scalars.write("\n".join(lines) + ("\n" if lines else ""))
        self._scalars.flush()

    # -- per-step arrays ------------------------------------------------------------------------------
    def _file_for(self, step: int) -> h5py.File:
        if self._open_step is not None and self._open_step != step:
            self.finish_step()
        if self._h5 is None:
            d = step_dir(self.root, step)
            d.mkdir(parents=True, exist_ok=True)
            self._tmp = d / f"rank_{self.rank:05d}.h5.tmp"
            self._h5 = h5py.File(self._tmp, "w")
            self._h5.attrs["step"] = int(step)
            self._h5.attrs["rank"] = self.rank
            self._open_step = int(step)
            self._counter = {}
            self._keys = set()
            self._groups = {"": self._h5}
            self._dsids = {}
        return self._h5

    def _group(self, path: str) -> h5py.Group:
        """The open file's group at ``path`` (created with its parents), cached: lookups by name cost
        ~0.1 ms each in HDF5, and a full-tensor dump puts hundreds of datasets into one group."""
        g = self._groups.get(path)
        if g is None:
            assert self._h5 is not None
            g = self._groups[path] = self._h5.require_group(path)
        return g

    def _replace(self, h5: h5py.File, key: str) -> tuple[h5py.Group, str]:
        """(parent group, leaf name) for ``key``; a dataset this step already wrote there is removed.

        Only keys this writer wrote can exist (the file is new per step), so the set replaces HDF5's
        slower ``key in file``; the caller adds ``key`` to it once the dataset exists."""
        if key in self._keys:
            self._keys.discard(key)
            self._dsids.pop(key, None)
            del h5[key]
        parent, _, name = key.rpartition("/")
        return self._group(parent), name

    def put_array(self, step: int, key: str, array: Any, attrs: Mapping[str, Any] | None = None) -> None:
        """Store one array under ``key`` (slashes make groups) in this step's file."""
        h5 = self._file_for(step)
        arr = np.asarray(array)
        if arr.dtype == object and h5py.check_string_dtype(arr.dtype) is None:
            if not all(isinstance(x, str) for x in arr.ravel()):
                raise TypeError(f"{key}: object arrays are not stored (no pickle)")
            arr = arr.astype(h5py.string_dtype())
        if arr.dtype.kind == "U":
            arr = arr.astype(h5py.string_dtype())
        group, name = self._replace(h5, key)
        if not attrs and arr.dtype.kind in "iuf" and arr.dtype.isnative and arr.size:
            # Numbers: HDF5's low-level create + write, a contiguous uncompressed dataset (what the
            # high-level call makes too, at half the per-dataset cost; readers can read it raw).
            arr = np.ascontiguousarray(arr)
            space = h5py.h5s.create_simple(arr.shape) if arr.ndim else h5py.h5s.create(h5py.h5s.SCALAR)
            dsid = h5py.h5d.create(group.id, name.encode(), h5py.h5t.py_create(arr.dtype), space)
            self._keys.add(key)
            dsid.write(h5py.h5s.ALL, h5py.h5s.ALL, arr)
            self._dsids[key] = dsid       # kept open for links: opening by path costs an HDF5 name lookup
            return None
        ds = group.create_dataset(name, data=arr)
        self._keys.add(key)
        for k, v in (attrs or {}).items():
            ds.attrs[k] = v
        return None

    def link_array(self, step: int, key: str, target: str) -> None:
        """Make ``key`` a second name (an HDF5 hard link) of the dataset ``target`` written this step:
        the same tensor seen twice (a module's input is its parent's input) is stored once."""
        h5 = self._file_for(step)
        if target not in self._keys:
            raise KeyError(f"{target}: not written in step {step}")
        obj = self._dsids.get(target) or h5py.h5o.open(h5.id, target.encode())
        group, name = self._replace(h5, key)
        h5py.h5o.link(obj, group.id, name.encode())
        self._keys.add(key)

    def put_table(self, step: int, group: str, columns: Mapping[str, Any],
                  attrs: Mapping[str, Any] | None = None) -> None:
        """Store equal-length columns as one compound dataset ``group`` (one field per column; text as
        UTF-8 bytes), ``attrs`` on it: one HDF5 object per table instead of one per column, which is most
        of a statistics dump's write time. Readers (``table_columns``) also take the older layout, a group
        of one dataset per column."""
        h5 = self._file_for(step)
        rec = _records(group, columns)
        parent, name = self._replace(h5, group)
        if len(rec):
            space = h5py.h5s.create_simple(rec.shape)
            dsid = h5py.h5d.create(parent.id, name.encode(), h5py.h5t.py_create(rec.dtype), space)
            dsid.write(h5py.h5s.ALL, h5py.h5s.ALL, rec)
            ds = h5py.Dataset(dsid)
        else:
            ds = parent.create_dataset(name, data=rec)
        self._keys.add(group)
        for k, v in (attrs or {}).items():
            ds.attrs[k] = v

    def next_index(self, step: int, counter: str) -> int:
        """A per-step counter, so tensors keep execution order across calls."""
        self._file_for(step)
        n = self._counter.get(counter, 0)
        self._counter[counter] = n + 1
        return n

    def finish_step(self) -> None:
        """Close the open step file and give it its final name."""
        if self._h5 is None:
            return
        self._dsids = {}
        self._h5.close()
        assert self._tmp is not None
        os.replace(self._tmp, self._tmp.with_suffix(""))
        self._h5, self._tmp, self._open_step = None, None, None
        self._groups = {}

    def abandon_step(self) -> None:
        """Forget the open step without finishing it (its ``.tmp`` stays and marks it incomplete).

        Dumpers call this when a step file cannot be finished (say the disk went away), so the next
        step starts a fresh file instead of failing again on the broken one.
        """
        self._dsids = {}
        if self._h5 is not None:
            try:
                self._h5.close()
            except Exception:  # noqa: BLE001 - the file is already broken; nothing more to save
                pass
        self._h5, self._tmp, self._open_step = None, None, None
        self._groups = {}

    def write_seed_batch(self, step: int, batch: Mapping[str, Any]) -> None:
        """Write ``step_N/rank_R/<name>.npy``: the layout MindFormers users replay."""
        d = self.root / f"step_{int(step)}" / f"rank_{self.rank}"
        for name, arr in batch.items():
            _save_npy_atomic(d / f"{name}.npy", np.asarray(arr))

    def close(self) -> None:
        self.finish_step()
        if not self._scalars.closed:
            self._scalars.close()

    def __enter__(self) -> RunWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _records(group: str, columns: Mapping[str, Any]) -> np.ndarray:
    """Columns as one numpy record array: numbers as they are, text as UTF-8 bytes (no object arrays:
    nothing here could need a pickle)."""
    fields: list[tuple[str, np.ndarray]] = []
    for name, col in columns.items():
        if isinstance(col, np.ndarray):
            arr = col
        else:
            col = list(col)
            try:   # text straight to ASCII bytes, the usual name (numpy's cast, no loop in Python)
                arr = np.array(col, dtype="S") if col and all(isinstance(x, str) for x in col) else np.asarray(col)
            except UnicodeEncodeError:
                arr = np.array(col, dtype=object)
        if arr.dtype.kind == "O":
            if not all(isinstance(x, str | bytes) for x in arr.ravel()):
                raise TypeError(f"{group}/{name}: object arrays are not stored (no pickle)")
            arr = np.array([x if isinstance(x, bytes) else x.encode("utf-8") for x in arr.ravel()],
                           dtype=bytes).reshape(arr.shape)
        elif arr.dtype.kind == "U":
            try:
                arr = arr.astype("S")          # ASCII (the usual name): numpy's own cast, no loop
            except UnicodeEncodeError:
                arr = np.char.encode(arr, "utf-8")
        if arr.dtype.kind == "S" and arr.dtype.itemsize == 0:
            arr = arr.astype("S1")
        if arr.dtype.kind not in "biufS":
            raise TypeError(f"{group}/{name}: dtype {arr.dtype} is not a table column type")
        fields.append((name, arr))
    lengths = {k: len(v) for k, v in fields}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"{group}: columns differ in length: {lengths}")
    n = len(fields[0][1]) if fields else 0
    rec = np.empty(n, dtype=[(k, v.dtype.newbyteorder("=") if v.dtype.kind in "iuf" else v.dtype, v.shape[1:])
                             for k, v in fields])
    for k, v in fields:
        rec[k] = v
    return rec


def table_columns(obj: h5py.Group | h5py.Dataset) -> dict[str, np.ndarray]:
    """A table's columns, text decoded to str: a compound dataset (one field per column, as ``put_table``
    writes it) or a group of one dataset per column (older stores)."""
    if isinstance(obj, h5py.Dataset):
        if obj.dtype.names is None:
            return {}
        rec = obj[...]
        return {k: _decode(rec[k]) for k in obj.dtype.names}
    return {k: _dataset_value(ds) for k, ds in obj.items() if isinstance(ds, h5py.Dataset)}


class WriterErrors(RuntimeError):
    """Calls that failed on a :class:`BackgroundWriter`'s thread since the last drain (first one named)."""


class BackgroundWriter:
    """A :class:`RunWriter` whose step-file writes run on one background thread, in call order.

    Why: HDF5 writes of full tensors take a large share of a dumped step; on their own thread they overlap
    with the training thread's compute (torch releases the GIL in its kernels). The caller hands over
    arrays it will not touch again (private host copies). The queue is bounded by ``max_bytes`` of arrays
    waiting: a caller that outruns the disk waits rather than growing memory without limit.

    Contract kept from :class:`RunWriter`: :meth:`finish_step` returns only once the step file is complete
    under its final name (it drains the queue), so a run killed between steps loses nothing and a run
    killed mid-step leaves its ``.tmp`` file. A failing call never stops the calls after it; the failures
    are raised together (:class:`WriterErrors`) from the next :meth:`drain` / :meth:`finish_step`.
    """

    def __init__(self, writer: RunWriter, max_bytes: int = 256 << 20) -> None:
        self.writer = writer
        self.max_bytes = int(max_bytes)
        self._tasks: deque[tuple[Callable[[], Any], int]] = deque()
        self._pending = 0             # bytes of arrays queued
        self._busy = False
        self._errors: list[str] = []
        self._closed = False
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="xf-align-writer", daemon=True)
        self._thread.start()

    @property
    def root(self) -> Path:
        return self.writer.root

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._tasks and not self._closed:
                    self._cv.wait()
                if not self._tasks:
                    return
                fn, nbytes = self._tasks.popleft()
                self._busy = True
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - reported at the next drain, never lost
                with self._cv:
                    self._errors.append(f"{type(exc).__name__}: {exc}")
            finally:
                with self._cv:
                    self._pending -= nbytes
                    self._busy = False
                    self._cv.notify_all()

    def _submit(self, fn: Callable[[], Any], nbytes: int = 0) -> None:
        with self._cv:
            if self._closed or not self._thread.is_alive():
                raise RuntimeError("background writer is closed")
            while self._pending and self._pending + nbytes > self.max_bytes:
                self._cv.wait()
            self._tasks.append((fn, nbytes))
            self._pending += nbytes
            self._cv.notify_all()

    def drain(self) -> None:
        """Wait until every queued call has run; raise the failures among them, if any."""
        with self._cv:
            while (self._tasks or self._busy) and self._thread.is_alive():
                self._cv.wait()
            errors, self._errors = self._errors, []
        if errors:
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            raise WriterErrors(f"background write failed: {errors[0]}{more}")

    def put_array(self, step: int, key: str, array: np.ndarray, attrs: Mapping[str, Any] | None = None) -> None:
        """Queue :meth:`RunWriter.put_array`; ``array`` must not change afterwards (pass a private copy)."""
        self._submit(lambda: self.writer.put_array(step, key, array, attrs), int(getattr(array, "nbytes", 0)))

    def link_array(self, step: int, key: str, target: str) -> None:
        self._submit(lambda: self.writer.link_array(step, key, target))

    def put_table(self, step: int, group: str, columns: Mapping[str, Any],
                  attrs: Mapping[str, Any] | None = None) -> None:
        self._submit(lambda: self.writer.put_table(step, group, columns, attrs))

    def write_seed_batch(self, step: int, batch: Mapping[str, Any]) -> None:
        self._submit(lambda: self.writer.write_seed_batch(step, batch))

    def log_scalars(self, step: int, values: Mapping[str, float | int | str | None]) -> None:
        values = dict(values)
        self._submit(lambda: self.writer.log_scalars(step, values))

    def update_meta(self, values: Mapping[str, Any]) -> None:
        self.drain()
        self.writer.update_meta(values)

    def finish_step(self) -> None:
        """Queue the step file's close + rename and wait for it: on return the step is on disk."""
        self._submit(self.writer.finish_step)
        self.drain()

    def abandon_step(self) -> None:
        try:
            self.drain()
        finally:
            self.writer.abandon_step()

    def close(self) -> None:
        """Finish the open step, stop the thread, close the files; queued failures are raised."""
        try:
            if not self._closed:
                self._submit(self.writer.finish_step)
                self.drain()
        finally:
            with self._cv:
                self._closed = True
                self._cv.notify_all()
            self._thread.join()
            self.writer.close()


# ------------------------------------------------------------------------------------------------------
# Reading
# ------------------------------------------------------------------------------------------------------

@dataclass
class Incomplete:
    step: int | None
    rank: int
    reason: str

    def __str__(self) -> str:
        where = f"step {self.step}" if self.step is not None else "scalars"
        return f"{where}, rank {self.rank}: {self.reason}"


@dataclass
class StepArrays:
    """The arrays of one step on one rank, read fully into memory (they are small: stats, norms, batch)."""

    step: int
    rank: int
    data: dict[str, np.ndarray] = field(default_factory=dict)
    attrs: dict[str, dict[str, Any]] = field(default_factory=dict)
    path: Path | None = None        # the step file, named in a bad-input message

    def table(self, group: str) -> pd.DataFrame | None:
        import pandas as pd

        cols = {k.split("/", 1)[1]: v for k, v in self.data.items()
                if k.startswith(group + "/") and "/" not in k[len(group) + 1:]}
        if cols:
            check_table(self.path or f"step {self.step}, rank {self.rank}", group, cols)
        return pd.DataFrame(cols) if cols else None


_TEXT, _INT, _NUM = "OSU", "iub", "fiub"
#: Tables in step files (docs/run-store.md): required columns, and the dtype kinds each known column may have.
TABLE_SCHEMAS: dict[str, dict[str, Any]] = {
    "local_norm": {"required": ("name", "norm"), "columns": {
        "name": _TEXT, "norm": _NUM, "numel": _INT, "tp_partition_dim": _INT, "tp_rank": _INT, "tp_size": _INT}},
    "tensor_stats": {"required": ("order", "module", "kind"), "columns": {
        "order": _INT, "module": _TEXT, "kind": _TEXT, "dtype": _TEXT, "shape": _TEXT, "numel": _INT,
        "max": _NUM, "min": _NUM, "mean": _NUM, "norm": _NUM, "nan": _INT, "inf": _INT}},
}


def check_table(path: str | os.PathLike, group: str, cols: Mapping[str, np.ndarray]) -> None:
    """A step file's table against TABLE_SCHEMAS: required columns, one value per row, equal lengths,
    number columns holding numbers. One-line BadInput naming the file and the column."""
    spec = TABLE_SCHEMAS.get(group)
    if spec is None:
        return
    for req in spec["required"]:
        if req not in cols:
            raise BadInput(f"{path}: table '{group}' has no column '{req}'")
    n = None
    for k, col in cols.items():
        arr = np.asarray(col)
        if arr.ndim != 1:
            raise BadInput(f"{path}: key '{group}/{k}': shape {arr.shape}, expected one value per row")
        kinds = spec["columns"].get(k)
        if kinds is not None and (arr.dtype.kind not in kinds or arr.dtype.names is not None):
            raise BadInput(f"{path}: key '{group}/{k}': dtype {arr.dtype} is not "
                           f"{'text' if kinds == _TEXT else 'a number type'}")
        if n is None:
            n = len(arr)
        elif len(arr) != n:
            raise BadInput(f"{path}: key '{group}/{k}': {len(arr)} rows, other columns have {n}")


def _dataset_value(ds: h5py.Dataset) -> Any:
    """A dataset's value, text decoded (a scalar dataset as its value, not a 0-d array)."""
    return _decode(ds[()] if ds.shape == () else ds[...])


def _decode(arr: np.ndarray) -> np.ndarray:
    if arr.dtype.kind in ("O", "S"):
        return np.array([x.decode() if isinstance(x, bytes) else str(x) for x in arr.ravel()],
                        dtype=object).reshape(arr.shape)
    return arr


def read_h5(path: Path) -> tuple[dict[str, np.ndarray], dict[str, dict[str, Any]]]:
    data: dict[str, np.ndarray] = {}
    attrs: dict[str, dict[str, Any]] = {}
    try:
        with h5py.File(path, "r") as h5:
            def walk(group: h5py.Group, prefix: str) -> None:
                # Every name, hard links included (visititems visits an object once, under one name:
                # a dumper stores a tensor seen twice once, under two names).
                for name in group:
                    obj = group.get(name)
                    if obj is None:        # a dangling soft link
                        continue
                    key = prefix + name
                    if isinstance(obj, h5py.Dataset) and obj.dtype.names is not None:   # a table
                        data.update({f"{key}/{k}": v for k, v in table_columns(obj).items()})
                    elif isinstance(obj, h5py.Dataset):
                        data[key] = _dataset_value(obj)
                    if obj.attrs:
                        attrs[key] = {k: obj.attrs[k] for k in obj.attrs}
                    if isinstance(obj, h5py.Group):
                        walk(obj, key + "/")
            walk(h5, "")
            attrs[""] = {k: h5.attrs[k] for k in h5.attrs}
    except (OSError, KeyError, ValueError) as exc:
        raise BadInput(f"{path}: not a readable HDF5 file ({exc})") from None
    return data, attrs


_SIZE = {"type": ["integer", "null"], "minimum": 1}
#: meta.json's declared shape (docs/run-store.md); other keys are free. Checked when a store is opened.
META_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "schema": {"type": "string"}, "framework": {"type": ["string", "null"]},
        "name_scheme": {"type": ["string", "null"]}, "train_iters": {"type": ["integer", "null"]},
        "source": {"type": ["object", "null"]},
        "config": {"type": ["object", "null"], "properties": {
            "kind": {"type": ["string", "null"]}, "values": {"type": ["object", "null"]}}},
        "dtypes": {"type": ["object", "null"], "additionalProperties": {"type": ["string", "null"]}},
        "parallel": {"type": ["object", "null"], "properties": {
            "tp": _SIZE, "pp": _SIZE, "dp": _SIZE, "ep": _SIZE, "cp": _SIZE, "world_size": _SIZE}},
    },
}
_RANK_SCHEMA: dict[str, Any] = {"type": "object", "properties": {"rank": {"type": "integer", "minimum": 0}}}
_SCALAR_TYPES = (int, float, str, bool, type(None), list, dict)


def _check_records(path: Path, records: list[Any], first_line: int = 1) -> None:
    """Every scalar line is an object with an integer ``step`` and plain values (one-line BadInput)."""
    for i, rec in enumerate(records, first_line):
        if type(rec) is not dict:
            raise BadInput(f"{path}:{i}: scalar line is a JSON {type(rec).__name__}, expected an object")
        step = rec.get("step")
        if type(step) is not int or step < 0 or step >= 1 << 62:
            raise BadInput(f"{path}:{i}: key 'step': expected a non-negative integer, got {step!r:.40}")
        for k, v in rec.items():
            if type(v) is int and abs(v) >= 1 << 1023:
                raise BadInput(f"{path}:{i}: key '{k}': {v!r:.40} is beyond the float range")
            if type(v) not in _SCALAR_TYPES:
                raise BadInput(f"{path}:{i}: key '{k}': unsupported value {v!r:.40}")


def _parse_jsonl(path: Path) -> tuple[list[dict[str, Any]], str | None]:
    """Parse a scalar file; a torn last line (a killed writer) is reported, not fatal."""
    text = read_bytes(path, "scalar file").decode("utf-8", errors="replace")
    lines = text.split("\n")
    torn = None
    if lines and lines[-1] == "":
        lines.pop()
    elif lines:
        torn = lines.pop()
    try:
        records = json.loads("[" + ",".join(lines) + "]") if lines else []
        if len(records) != len(lines):   # a line holding two values ("1, 2") joins into the list unseen
            raise ValueError
    except (ValueError, RecursionError):
        records = []
        for i, line in enumerate(lines, 1):
            try:
                records.append(json.loads(line))
            except (ValueError, RecursionError):
                raise BadInput(f"{path}:{i}: garbled scalar line: {line[:80]!r}") from None
    _check_records(path, records)
    if torn is not None:
        try:
            last = json.loads(torn)
            _check_records(path, [last], len(records) + 1)
            records.append(last)
            torn = None
        except (ValueError, RecursionError, BadInput):
            pass
    return records, torn


class RunReader:
    """Reads a run store; never fails on a run that was killed, it lists what is incomplete instead."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        meta_path = self.root / META
        if not meta_path.is_file() and not (self.root / SCALAR_DIR).is_dir():
            raise BadInput(f"{self.root}: not a run store (no {META} or {SCALAR_DIR}/)")
        self.meta: dict[str, Any] = load_json(meta_path, META_SCHEMA, "meta.json") \
            if meta_path.exists() or meta_path.is_symlink() else {}
        self.incomplete: list[Incomplete] = []
        self._step_files: dict[int, dict[int, Path]] = {}
        self._scan_steps()

    # -- structure ------------------------------------------------------------------------------------
    def _scan_steps(self) -> None:
        base = self.root / STEP_DIR
        if not base.is_dir():
            return
        for d in sorted(base.iterdir()):
            m = _STEP_RE.match(d.name)
            if not m or not d.is_dir():
                continue
            step = int(m.group(1))
            for f in d.iterdir():
                if mm := _RANK_H5_RE.match(f.name):
                    self._step_files.setdefault(step, {})[int(mm.group(1))] = f
                elif mm := _RANK_TMP_RE.match(f.name):
                    self.incomplete.append(Incomplete(step, int(mm.group(1)),
                                                      "step file never finished (run stopped mid-step)"))

    @property
    def ranks(self) -> list[int]:
        found = set()
        for f in (self.root / SCALAR_DIR).glob("rank_*.jsonl"):
            if (m := _SCALAR_RANK_RE.match(f.name)) is not None:
                found.add(int(m.group(1)))
        for per_rank in self._step_files.values():
            found.update(per_rank)
        return sorted(found)

    def rank_info(self, rank: int) -> dict[str, Any]:
        p = self.root / RANK_DIR / f"rank_{rank:05d}.json"
        return load_json(p, _RANK_SCHEMA, "rank file") if p.exists() else {"rank": rank}

    def array_steps(self, rank: int | None = None) -> list[int]:
        """Steps whose array file is complete (for ``rank``, or for at least one rank)."""
        return sorted(s for s, per in self._step_files.items() if rank is None or rank in per)

    def array_ranks(self, step: int) -> list[int]:
        return sorted(self._step_files.get(step, {}))

    # -- content --------------------------------------------------------------------------------------
    def scalar_records(self, rank: int) -> list[dict[str, Any]]:
        """One rank's scalar records in file order; a torn last line is listed in ``incomplete``."""
        path = self.root / SCALAR_DIR / f"rank_{rank:05d}.jsonl"
        if not path.is_file():
            return []
        records, torn = _parse_jsonl(path)
        if torn is not None:
            last = records[-1].get("step") if records else None
            nxt = last + 1 if isinstance(last, int) else None
            self.incomplete.append(Incomplete(nxt, rank, "scalar line torn (run stopped while writing)"))
        return records

    def scalars(self, rank: int | None = None) -> pd.DataFrame:
        """Scalars as one table (every rank's rows, with a ``rank`` column); absent keys are NaN."""
        import pandas as pd

        frames = []
        for r in ([rank] if rank is not None else self.ranks):
            records = self.scalar_records(r)
            if records:
                df = pd.DataFrame.from_records(records)
                df["rank"] = r
                frames.append(df)
        if not frames:
            return pd.DataFrame({"step": pd.Series(dtype="int64"), "rank": pd.Series(dtype="int64")})
        return pd.concat(frames, ignore_index=True)

    def step_file(self, step: int, rank: int = 0) -> Path:
        """The finished HDF5 file of one step on one rank (for readers that stream one group)."""
        path = self._step_files.get(step, {}).get(rank)
        if path is None:
            raise BadInput(f"{self.root}: no complete array file for step {step}, rank {rank}")
        return path

    def has_group(self, step: int, group: str) -> bool:
        """Whether any rank's finished file of ``step`` holds ``group`` (cheap: no data is read)."""
        for path in self._step_files.get(step, {}).values():
            try:
                with h5py.File(path, "r") as h5:
                    if group in h5:
                        return True
            except OSError as exc:
                raise BadInput(f"{path}: not a readable HDF5 file ({exc})") from None
        return False

    def step_arrays(self, step: int, rank: int = 0) -> StepArrays:
        data, attrs = read_h5(self.step_file(step, rank))
        return StepArrays(step, rank, data, attrs, self.step_file(step, rank))

    def iter_step_arrays(self, rank: int | None = None) -> Iterator[StepArrays]:
        for step in self.array_steps(rank):
            for r in ([rank] if rank is not None else self.array_ranks(step)):
                yield self.step_arrays(step, r)


# ------------------------------------------------------------------------------------------------------
# Seed layout: step_N/rank_R/{tokens,labels,loss_mask,attention_mask}.npy
# ------------------------------------------------------------------------------------------------------

def load_npy(path: Path) -> np.ndarray:
    """np.load without pickle; a one-line BadInput for anything that is not a plain numeric .npy array."""
    regular_file(path, ".npy file")
    try:
        arr = np.load(path, allow_pickle=False)
        if not isinstance(arr, np.ndarray):
            raise BadInput(f"{path}: an .npz archive, expected one .npy array")
        if arr.dtype.kind not in "biuf" or arr.dtype.names is not None:
            raise BadInput(f"{path}: dtype {arr.dtype} is not a number type (int, uint, float or bool)")
        return arr
    except ValueError as exc:
        if "pickle" in str(exc).lower():
            raise BadInput(f"{path}: holds pickled objects; refusing to load (no pickle)") from None
        raise BadInput(f"{path}: not a valid .npy array ({exc})") from None
    except (OSError, EOFError, TypeError, SyntaxError, MemoryError) as exc:
        raise BadInput(f"{path}: unreadable or truncated .npy ({' '.join(str(exc).split())[:80]})") from None


def seed_steps(root: Path) -> dict[int, dict[int, Path]]:
    """Map step -> rank -> folder for the seed layout under ``root``."""
    out: dict[int, dict[int, Path]] = {}
    for d in Path(root).iterdir():
        m = _STEP_RE.match(d.name)
        if not m or not d.is_dir():
            continue
        for r in d.iterdir():
            mm = _SEED_RANK_RE.match(r.name)
            if mm and r.is_dir():
                out.setdefault(int(m.group(1)), {})[int(mm.group(1))] = r
    return out


def read_seed_batch(root: Path, step: int, rank: int = 0,
                    keys: Iterable[str] = SEED_BATCH_KEYS) -> dict[str, np.ndarray]:
    folder = Path(root) / f"step_{step}" / f"rank_{rank}"
    if not folder.parent.is_dir():
        raise BadInput(f"{folder.parent}: step {step} missing from the batch dump")
    if not folder.is_dir():
        raise BadInput(f"{folder}: rank {rank} missing from step {step}")
    out = {}
    for key in keys:
        path = folder / f"{key}.npy"
        if not path.is_file():
            raise BadInput(f"{path}: missing")
        out[key] = load_npy(path)
    return out


def read_step1_file(path: str | Path) -> dict[str, dict[str, np.ndarray]]:
    """A baseline's step-1 file (npz, no pickle) -> {"grad": {...}, "init": {...}, "weight": {...}}.

    Layout: keys ``grad/<name>`` (step-1 gradients), ``init/<name>`` (weights before the step) and
    ``weight/<name>`` (weights after it), baseline names, as the paired demo's Megatron side writes.
    """
    out: dict[str, dict[str, np.ndarray]] = {"grad": {}, "init": {}, "weight": {}}
    try:
        with np.load(path, allow_pickle=False) as z:
            for key in z.files:
                kind, _, name = key.partition("/")
                if kind in out and name:
                    arr = z[key]
                    if arr.dtype.kind not in "fiu" or arr.dtype.names is not None:
                        raise BadInput(f"{path}: key '{key}': dtype {arr.dtype} is not a number type")
                    out[kind][name] = arr
    except BadInput:
        raise
    except AttributeError:   # np.load gave a plain array (an .npy file), which has no keys
        raise BadInput(f"{path}: an .npy array, expected the step-1 .npz archive") from None
    except (OSError, ValueError, EOFError, KeyError, TypeError, zipfile.BadZipFile) as exc:
        raise BadInput(f"{path}: not a readable step-1 .npz file ({' '.join(str(exc).split())[:80]})") from None
    for name, g in out["grad"].items():
        for kind in ("init", "weight"):
            if name in out[kind] and out[kind][name].shape != g.shape:
                raise BadInput(f"{path}: key '{kind}/{name}': shape {out[kind][name].shape} differs from its "
                               f"gradient's {g.shape}")
    return out


def write_step1_file(path: str | Path, grads: Mapping[str, np.ndarray], before: Mapping[str, np.ndarray],
                     after: Mapping[str, np.ndarray]) -> None:
    """Write the step-1 file :func:`read_step1_file` reads (atomically: temporary name, then rename)."""
    arrays = {**{f"grad/{k}": np.asarray(v) for k, v in grads.items()},
              **{f"init/{k}": np.asarray(v) for k, v in before.items()},
              **{f"weight/{k}": np.asarray(v) for k, v in after.items()}}
    with atomic_file(Path(path)) as fh:
        np.savez(fh, **arrays)
