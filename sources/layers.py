"""Layer tensors, whatever holds them: the protocol the layer-tensor comparator reads, and the one function
that opens it for a run or a path by asking the source table.

A source kind that holds layer tensors says so on its ``Source`` (sources/__init__.py): ``layers`` opens
them from a Run of that kind or a path detected as it, ``layers_only`` says the kind holds nothing else (no
loss curve, no norms). The run store (sources/store_dir.py) and msprobe dumps (sources/msprobe.py) are two;
adding a tensor-dump kind is adding one module to sources/ (docs/extending.md): the layer stage, the
procedure's comparability check and the comparators take it from the table.
"""

from __future__ import annotations

from os import PathLike
from pathlib import Path
from typing import Any, Protocol

from core.errors import BadInput
from sources import detect, sources


class LayerSource(Protocol):
    """What the layer-tensor comparator (comparators.layer_tensors) reads: steps, ranks, and per step and
    rank the rows in execution order plus whether full tensors are stored.

    A row is a dict in the run store's ``tensor_stats`` vocabulary: ``order``, ``module``, ``kind``
    (``forward.input.0``, ``forward.output.0``, ``backward.grad_output.0``, ``backward.grad_input.0``),
    ``dtype``, ``shape`` ("8x2x32"), ``numel``, ``max``, ``min``, ``mean``, ``norm``, ``nan``, ``inf``, and
    ``ref``: where the full tensor is, None in statistics mode, ``("h5", file, dataset)`` for an HDF5
    dataset, or a file path (``.npy`` streams; other suffixes need a reader, see ``needs_readers``).
    """

    root: Path              # named when a side has no rows
    needs_readers: bool     # refs may name files numpy cannot stream (.pt): the layer stage passes torch readers

    def array_steps(self) -> list[int]: ...

    def array_ranks(self, step: int) -> list[int]: ...

    def layer_rows(self, step: int, rank: int = 0) -> tuple[list[dict[str, Any]], bool]: ...


def layer_source(obj: Any, required: bool = True) -> LayerSource | None:
    """The layer tensors of ``obj``: a layer source (returned as is), a Run (opened by its kind's
    ``layers``), or a path or reader with a ``root`` (detected first). A kind that holds no layer tensors
    is BadInput, or None when not ``required``."""
    if callable(getattr(obj, "layer_rows", None)):
        return obj
    kind = getattr(obj, "kind", None)
    if kind is None:    # a path (str, Path), else a reader of one (its ``root``)
        kind = detect(obj if isinstance(obj, (str, PathLike)) else obj.root)
    src = next((s for s in sources() if s.kind == kind), None)
    found = src.layers(obj) if src is not None and src.layers is not None else None
    if found is None and required:
        where = obj if isinstance(obj, (str, PathLike)) else getattr(obj, "path", getattr(obj, "root", obj))
        raise BadInput(f"{where}: {src.describe if src is not None else kind} holds no layer tensors")
    return found


def layers_only(run: Any) -> bool:
    """Whether ``run``'s kind holds layer tensors and nothing else (an msprobe dump: no loss, no norms)."""
    kind = getattr(run, "kind", None)
    return any(s.kind == kind and s.layers_only for s in sources())
