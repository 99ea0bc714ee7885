"""Tables in step files: columns -> one HDF5 compound dataset and back, and their declared schemas.

A table (local norms, tensor statistics) is stored as one compound dataset, one field per column, text as
UTF-8 bytes (one HDF5 object per table instead of one per column). ``table_columns`` also reads the older
layout, a group of one dataset per column. ``check_table`` holds a table read back to ``TABLE_SCHEMAS``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from core.errors import BadInput
from runstore.h5file import check_dataset, file_of


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
    path = file_of(obj)
    if isinstance(obj, h5py.Dataset):
        if obj.dtype.names is None:
            return {}
        check_dataset(path, obj.name, obj)
        rec = obj[...]
        return {k: _text(path, f"{obj.name.lstrip('/')}/{k}", lambda k=k: _decode(rec[k])) for k in obj.dtype.names}
    out = {}
    for k, ds in obj.items():
        if isinstance(ds, h5py.Dataset):
            check_dataset(path, ds.name, ds)
            out[k] = _text(path, ds.name.lstrip("/"), lambda ds=ds: _dataset_value(ds))
    return out


def decode_text(path: str | os.PathLike, group: str, cols: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Columns with their byte-string columns decoded as UTF-8 (numpy's vectorised decode); a column that is
    not UTF-8 is a one-line BadInput naming the file and the column."""
    return {k: _text(path, f"{group}/{k}", lambda v=v: np.char.decode(v, "utf-8")) if v.dtype.kind == "S" else v
            for k, v in cols.items()}


def _text(path: Path | str | os.PathLike, key: str, read: Any) -> Any:
    try:
        return read()
    except UnicodeDecodeError as exc:
        raise BadInput(f"{path}: key '{key}': not UTF-8 text ({exc.reason} at byte {exc.start})") from None


_TEXT, _INT, _NUM = "OSU", "iub", "fiub"
_LAYOUT = {"numel": _INT, "tp_partition_dim": _INT, "tp_rank": _INT, "tp_size": _INT, "dp_shard": _INT,
           "dp_rank": _INT, "dp_size": _INT}
#: Tables in step files (docs/run-store.md): required columns, and the dtype kinds each known column may have.
TABLE_SCHEMAS: dict[str, dict[str, Any]] = {
    "local_norm": {"required": ("name", "norm"), "columns": {"name": _TEXT, "norm": _NUM, **_LAYOUT}},
    "tensor_stats": {"required": ("order", "module", "kind"), "columns": {
        "order": _INT, "module": _TEXT, "kind": _TEXT, "dtype": _TEXT, "shape": _TEXT, "numel": _INT,
        "max": _NUM, "min": _NUM, "mean": _NUM, "norm": _NUM, "nan": _INT, "inf": _INT, "split": _TEXT}},
    "routing_counts": {"required": ("module", "expert", "tokens"), "columns": {
        "module": _TEXT, "expert": _INT, "tokens": _INT}},
}
# per-parameter weight and optimizer-update norms, where a store records them: local_norm's columns
TABLE_SCHEMAS["param_norm"] = TABLE_SCHEMAS["update_norm"] = TABLE_SCHEMAS["local_norm"]

MAX_GROUP = 1 << 20       # ranks in a parallel group, experts of a router: far above any run, far below memory
MAX_COUNT = 1 << 62       # element and token counts, a row's order
#: Ranges a known column's values keep (NaN allowed in a float column: a NaN norm is evidence, judged by the
#: comparators): (lowest, highest); None: unbounded on that side.
RANGES: dict[str, tuple[float | None, float | None]] = {
    "norm": (0, None), "numel": (-1, MAX_COUNT), "tp_partition_dim": (-1, 64), "tp_rank": (0, MAX_GROUP - 1),
    "tp_size": (1, MAX_GROUP), "dp_shard": (0, 1), "dp_rank": (0, MAX_GROUP - 1), "dp_size": (1, MAX_GROUP),
    "order": (0, MAX_COUNT), "nan": (0, MAX_COUNT), "inf": (0, MAX_COUNT), "expert": (0, MAX_GROUP - 1),
    "tokens": (0, MAX_COUNT),
}
#: (coordinate, size, only where this column is non-zero): a row's coordinate is below its group's size. A DP
#: rank counts only in a row that is a DP rank's part (dp_shard 1); other rows carry the rank's DP coordinate
#: with dp_size 1 (a whole, reduced gradient)
BELOW = (("tp_rank", "tp_size", None), ("dp_rank", "dp_size", "dp_shard"))


def check_table(path: str | os.PathLike, group: str, cols: Mapping[str, np.ndarray]) -> None:
    """A step file's table against TABLE_SCHEMAS: required columns, one value per row, equal lengths,
    number columns holding numbers, each known column within its range (RANGES: norms >= 0, counts >= 0,
    ranks below their sizes). One-line BadInput naming the file, the column and the first row outside."""
    spec = TABLE_SCHEMAS.get(group)
    if spec is None:
        return
    for req in spec["required"]:
        if req not in cols:
            raise BadInput(f"{path}: table '{group}' has no column '{req}'")
    n = None
    arrays: dict[str, np.ndarray] = {}
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
        if kinds is not None:
            arrays[k] = arr
    for k, arr in arrays.items():
        lo, hi = RANGES.get(k, (None, None))
        if arr.dtype.kind in "SOU" or not len(arr):
            continue
        for bound, bad, word in ((lo, lambda a, b: a < b, "below"), (hi, lambda a, b: a > b, "above")):
            if bound is None:
                continue
            with np.errstate(invalid="ignore"):
                out = bad(arr, bound)
            if out.any():
                raise BadInput(f"{path}: key '{group}/{k}': {_row(arr, cols, out)} is {word} {bound}"
                               + (" (a norm is never negative)" if k == "norm" else ""))
    for coord, size, where in BELOW:
        if coord in arrays and size in arrays and len(arrays[coord]):
            bad = arrays[coord] >= arrays[size]
            if where is not None:
                bad &= arrays[where] != 0 if where in arrays else False
            if bad.any():
                i = int(np.argmax(bad))
                raise BadInput(f"{path}: key '{group}/{coord}': {_row(arrays[coord], cols, bad)} is not below "
                               f"{size} {arrays[size][i]!s}")


def _row(arr: np.ndarray, cols: Mapping[str, np.ndarray], bad: np.ndarray) -> str:
    """The first offending value, its row and the row's name where the table has one."""
    i = int(np.argmax(bad))
    label = next((cols[c][i] for c in ("name", "module") if c in cols), None)
    if isinstance(label, bytes):
        label = label.decode("utf-8", "replace")
    at = f"row {i}" + (f" ({str(label)[:80]})" if label is not None else "")
    return f"{arr[i].item()!r} at {at}"


def _dataset_value(ds: h5py.Dataset) -> Any:
    """A dataset's value, text decoded (a scalar dataset as its value, not a 0-d array)."""
    return _decode(ds[()] if ds.shape == () else ds[...])


def _decode(arr: np.ndarray) -> np.ndarray:
    if arr.dtype.kind in ("O", "S"):
        return np.array([x.decode() if isinstance(x, bytes) else str(x) for x in arr.ravel()],
                        dtype=object).reshape(arr.shape)
    return arr
