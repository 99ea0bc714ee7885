"""Writing one rank's share of a run store: meta.json, its scalar lines, its per-step HDF5 files.

See ``runstore.layout`` for the layout and why; every file appears atomically (``runstore.atomic``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import h5py
import numpy as np

try:    # h5py's own conversion of a Python value for a new attribute (what ``obj.attrs[k] = v`` calls)
    from h5py._hl.base import array_for_new_object
except ImportError:     # a private helper: should a later h5py move it, attributes take the high-level call
    array_for_new_object = None

if TYPE_CHECKING:   # pandas is imported where tables are built: writers of arrays alone skip its ~0.8 s import
    import pandas as pd

from core.errors import BadInput
from runstore.atomic import _json_default, _save_npy_atomic, atomic_write_json
from runstore.layout import META, RANK_DIR, SCALAR_DIR, SCHEMA, step_dir
from runstore.tables import _records

_TYPES: dict[Any, tuple[Any, Any]] = {}     # numpy dtype (or str) -> (HDF5 file type, memory type)


def _h5_types(dtype: np.dtype) -> tuple[Any, Any]:
    """HDF5 (file, memory) types of ``dtype`` as h5py makes them, cached: ``py_create`` costs more than
    the attribute it types (the variable-length string type most). Plain numbers and booleans, and
    h5py's vlen str, only: an object dtype's h5py metadata is not part of its hash."""
    if dtype.kind == "O" and dtype.metadata == {"vlen": str}:
        key: Any = str
    elif dtype.kind in "biuf" and dtype.metadata is None:
        key = dtype
    else:
        return h5py.h5t.py_create(dtype, logical=True), h5py.h5t.py_create(dtype)
    got = _TYPES.get(key)
    if got is None:
        got = _TYPES[key] = (h5py.h5t.py_create(dtype, logical=True), h5py.h5t.py_create(dtype))
    return got


def _put_attrs(oid: Any, attrs: Mapping[str, Any]) -> None:
    """Attributes on a new object (file, dataset) through HDF5's low-level calls, typed as ``obj.attrs[k] =
    v`` types them (h5py's own conversion). The high-level call also checks for an attribute of that name,
    takes h5py's lock and builds the HDF5 types anew: a norms-and-batch step file holds 11 attributes, at
    ~0.5x the high-level call's time each (measured here)."""
    if array_for_new_object is None:
        h5py.AttributeManager(SimpleNamespace(id=oid)).update(attrs)
        return
    for k, v in attrs.items():
        data = array_for_new_object(v)
        ftype, mtype = _h5_types(data.dtype)
        attr = h5py.h5a.create(oid, k.encode(), ftype, h5py.h5s.create_simple(data.shape))
        attr.write(data, mtype=mtype)


def _step(step: Any) -> int:
    """A step number the store can name and read back: an integer in [0, 2**62) (a bool, a float, a huge
    int are refused before anything is written; a huge one would leave a half-written HDF5 file)."""
    if isinstance(step, np.integer):
        step = int(step)
    if type(step) is not int or not 0 <= step < 1 << 62:
        shown = f"an integer of {step.bit_length()} bits" if type(step) is int else repr(step)[:40]
        raise BadInput(f"step {shown}: expected an integer in [0, 2**62)")
    return step


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
        record = {"step": _step(step)}
        for key, value in values.items():
            record[key] = value.item() if isinstance(value, np.generic) else value
            if type(record[key]) is int and abs(record[key]) >= 1 << 1023:
                raise BadInput(f"step {step}: scalar '{key}' is an integer of {record[key].bit_length()} bits, "
                               "beyond the float range")
        self._scalars.write(json.dumps(record, default=_json_default) + "\n")
        self._scalars.flush()

    def log_scalar_series(self, series: Mapping[str, pd.Series]) -> None:
        """Append many steps at once (importers): one record per step, only the keys reported there."""
        import pandas as pd

        frame = pd.DataFrame(dict(series))
        frame.index.name = "step"
        for s in frame.index.tolist():
            _step(s)
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
        step = _step(step)
        if self._open_step is not None and self._open_step != step:
            self.finish_step()
        if self._h5 is None:
            d = step_dir(self.root, step)
            d.mkdir(parents=True, exist_ok=True)
            self._tmp = d / f"rank_{self.rank:05d}.h5.tmp"
            self._h5 = h5py.File(self._tmp, "w")
            _put_attrs(self._h5.id, {"step": int(step), "rank": self.rank})
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
        if arr.dtype.kind in "biuf" and arr.dtype.isnative and arr.size:
            # Numbers and booleans: HDF5's low-level create + write, a contiguous uncompressed dataset (what
            # the high-level call makes too, at half the per-dataset cost; readers can read it raw).
            arr = np.ascontiguousarray(arr)
            space = h5py.h5s.create_simple(arr.shape) if arr.ndim else h5py.h5s.create(h5py.h5s.SCALAR)
            dsid = h5py.h5d.create(group.id, name.encode(), _h5_types(arr.dtype)[0], space)
            self._keys.add(key)
            dsid.write(h5py.h5s.ALL, h5py.h5s.ALL, arr)
            if attrs:
                _put_attrs(dsid, attrs)
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
            if attrs:
                _put_attrs(dsid, attrs)
        else:
            ds = parent.create_dataset(name, data=rec)
            for k, v in (attrs or {}).items():
                ds.attrs[k] = v
        self._keys.add(group)

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
        d = self.root / f"step_{_step(step)}" / f"rank_{self.rank}"
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
