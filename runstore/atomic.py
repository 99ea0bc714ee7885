"""Files that appear whole or not at all: written under a temporary name in the same folder, then renamed.

Every file of a run store is written this way, so a run killed mid-write leaves the old file (or none) and a
``.tmp`` beside it, never a half-written file under the final name.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np


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
