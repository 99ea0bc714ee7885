"""The run store itself as a source: the format every other source becomes (runstore), and the layer
tensors a dumper wrote into it (``tensor_stats`` rows, full tensors under ``tensors/``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from core.errors import BadInput
from runstore import META, SCALAR_DIR, RunReader, check_table, table_columns
from runstore.h5file import open_h5
from sources import Source


def _is_store(path: Path, head: bytes | None) -> bool:
    return head is None and ((path / META).is_file() or (path / SCALAR_DIR).is_dir())


def _load(path: Path):
    from runstore.run import open_store

    return open_store(path)


def _read_stats(path: Path) -> tuple[list[dict[str, Any]], bool]:
    """A step file's ``tensor_stats`` rows, checked where they enter (runstore.check_table: columns, types,
    counts >= 0, norms >= 0), and whether the file holds full tensors."""
    try:
        with open_h5(path) as h5:
            if "tensor_stats" not in h5:
                return [], "tensors" in h5
            cols = table_columns(h5["tensor_stats"])
            has_tensors = "tensors" in h5
    except (OSError, KeyError, ValueError, TypeError, RuntimeError) as exc:
        raise BadInput(f"{path}: 'tensor_stats' not readable ({' '.join(str(exc).split())[:80]})") from None
    check_table(path, "tensor_stats", cols)
    n = len(cols.get("order", []))
    rows = [{k: (v[i].item() if hasattr(v[i], "item") else v[i]) for k, v in cols.items()} for i in range(n)]
    rows.sort(key=lambda r: r["order"])
    return rows, has_tensors


class StoreLayers:
    """A run store's ``tensor_stats`` rows; tensors referenced as (HDF5 file, ``tensors/<order>``)."""

    needs_readers = False

    def __init__(self, reader: RunReader) -> None:
        self.reader = reader
        self.root = reader.root

    def array_steps(self) -> list[int]:
        return self.reader.array_steps()

    def array_ranks(self, step: int) -> list[int]:
        return self.reader.array_ranks(step)

    def rank_info(self, rank: int) -> dict[str, Any]:
        """The rank's coordinates (tp_rank, cp_rank, pp_rank, dp_rank, ep_rank and sizes): how its rows
        gather with the others' (sources.layers.gather_layers)."""
        return self.reader.rank_info(rank)

    def layer_rows(self, step: int, rank: int = 0) -> tuple[list[dict[str, Any]], bool]:
        path = Path(self.reader.step_file(step, rank))
        rows, has_tensors = _read_stats(path)
        for r in rows:
            r["ref"] = ("h5", str(path), f"tensors/{int(r['order']):06d}") if has_tensors else None
        return rows, has_tensors


def open_layers(obj: Any) -> Any:
    """A store's layer rows from its path, its reader, or a Run opened from it (None: a run not read from a
    store on disk); a store whose meta names a kernel dump (dumpers/mindspore_kernel_dump.py) gives the dump's."""
    from sources.mindspore_dump import store_kernel_dump  # a GRAPH run's full tensors (meta layer_capture)

    reader = obj if isinstance(obj, RunReader) else RunReader(obj) if isinstance(obj, (str, Path)) else obj.store
    if reader is None:
        return None
    return store_kernel_dump(reader) or StoreLayers(reader)


SOURCE = Source("runstore", 0, _is_store, _load, "a run store (meta.json, scalars/)", layers=open_layers)
