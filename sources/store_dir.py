"""The run store itself as a source: the format every other source becomes (runstore)."""

from __future__ import annotations

from pathlib import Path

from runstore import META, SCALAR_DIR
from sources import Source


def _is_store(path: Path, head: bytes | None) -> bool:
    return head is None and ((path / META).is_file() or (path / SCALAR_DIR).is_dir())


def _load(path: Path):
    from runstore.run import open_store

    return open_store(path)


SOURCE = Source("runstore", 0, _is_store, _load, "a run store (meta.json, scalars/)")
