"""Opening a step file and reading a dataset from it, checked first.

Why one place: every reader of a step file (the whole-file reader, tables, routing records, layer statistics)
must refuse a path that is not a regular file before HDF5 opens it (a FIFO blocks, a device never ends) and a
dataset whose declared size the file cannot hold before numpy allocates it (a corrupt or crafted header
declaring 1e13 elements, or a chunked dataset never written, would otherwise be allocated).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from core.errors import BadInput
from runstore.schema import regular_file

MAX_DATASET_BYTES = 1 << 33    # 8 GiB: no per-step array of stats, norms or a batch comes near it
#: A filtered (compressed) dataset may declare more than it stores, but not beyond what zlib reaches
#: (~1032:1) plus a chunk's worth: beyond it the "data" is fill value of chunks never written, or a bomb.
_MAX_RATIO, _SLACK = 1100, 1 << 20


def _why(exc: BaseException, n: int = 120) -> str:
    return " ".join(str(exc).split())[:n] or type(exc).__name__


@contextmanager
def open_h5(path: str | os.PathLike, what: str = "step file") -> Iterator[h5py.File]:
    """``h5py.File(path, "r")`` of a regular file; a one-line BadInput for anything else or a file HDF5
    cannot open. Errors raised inside the block are the caller's."""
    p = regular_file(path, what)
    try:
        h5 = h5py.File(p, "r")
    except (OSError, ValueError, RuntimeError) as exc:
        raise BadInput(f"{p}: not a readable HDF5 file ({_why(exc)})") from None
    try:
        yield h5
    finally:
        h5.close()


def check_dataset(path: str | os.PathLike, key: str, ds: h5py.Dataset, file_size: int | None = None) -> int:
    """The bytes ``ds`` declares, once they are known to fit: below MAX_DATASET_BYTES and, unfiltered, within
    the file; filtered, within what compression can yield from what is stored. One-line BadInput otherwise."""
    try:
        nbytes = int(ds.id.get_type().get_size())
        for n in ds.shape or ():
            nbytes *= int(n)
        stored = int(ds.id.get_storage_size())
        filters = ds.compression is not None or bool(ds._filters)  # noqa: SLF001 - h5py keeps filters there
    except (OSError, ValueError, TypeError, KeyError, RuntimeError) as exc:
        raise BadInput(f"{path}: '{key}': unreadable dataset header ({_why(exc, 80)})") from None
    if nbytes > MAX_DATASET_BYTES:
        raise BadInput(f"{path}: '{key}': declares {nbytes} bytes ({ds.shape}), beyond the "
                       f"{MAX_DATASET_BYTES} a step file's array may hold")
    if file_size is None:
        file_size = os.path.getsize(path)
    if not filters and nbytes > 0 and stored < nbytes and nbytes > file_size:
        raise BadInput(f"{path}: '{key}': declares {nbytes} bytes ({ds.shape}) but the file holds {file_size}")
    if nbytes > _SLACK + _MAX_RATIO * stored:
        raise BadInput(f"{path}: '{key}': declares {nbytes} bytes ({ds.shape}) but stores {stored} (chunks never "
                       "written, or more than compression yields)")
    return nbytes


def read_dataset(path: str | os.PathLike, key: str, ds: Any, file_size: int | None = None) -> np.ndarray:
    """A dataset's whole value after :func:`check_dataset`; a scalar dataset as a 0-d array. ``ds`` that is
    not a dataset (a group where an array belongs) is a one-line BadInput."""
    if not isinstance(ds, h5py.Dataset):
        raise BadInput(f"{path}: '{key}' is a {'group' if isinstance(ds, h5py.Group) else 'missing object'}, "
                       "expected an array")
    check_dataset(path, key, ds, file_size)
    try:
        return np.asarray(ds[()])
    except (OSError, ValueError, TypeError, KeyError, RuntimeError) as exc:
        raise BadInput(f"{path}: '{key}': unreadable dataset ({_why(exc, 80)})") from None
    except MemoryError:
        raise BadInput(f"{path}: '{key}': too large to read into memory") from None


def file_of(obj: h5py.HLObject) -> Path:
    """The file an open HDF5 object lives in (for messages)."""
    try:
        return Path(obj.file.filename)
    except (ValueError, RuntimeError, OSError):
        return Path("<closed HDF5 file>")
