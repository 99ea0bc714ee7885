"""Files users already have, opened as runs: one module per source kind, one dispatch table.

``detect(path)`` asks each source, in ``order``, whether ``path`` is its kind (directories by their layout,
files by their first 4 MiB); ``load_run(path)`` calls the matching loader. A module here that defines
``SOURCE`` (or ``SOURCES``) is a source kind: adding one is adding a file (docs/extending.md). The table is
built on first use, so importing one source module stays cheap.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.errors import BadInput
from core.registry import collect
from runstore.schema import regular_file
from sources.logtext import looks_binary

if TYPE_CHECKING:   # runstore.run needs pandas; the tensor compare imports this package without it
    from runstore.run import Run

HEAD = 4 << 20      # bytes of a file the detectors see
CHUNK = 16 << 20    # bytes per read when a long preamble hides the markers


@dataclass(frozen=True)
class Source:
    """A source kind. ``matches(path, head)``: ``head`` is None for a directory, else the file's first 4 MiB.
    ``markers``: byte strings that identify the kind anywhere in a file whose head has none (a log that starts
    with a long preamble). ``describe`` names the kind in the error for a path no source claims.
    ``layers(run_or_path)``: the kind's layer tensors as a ``sources.layers.LayerSource`` (None when this
    run holds none); a kind without it holds none. ``layers_only``: the kind holds layer tensors and nothing
    else (no loss, no norms)."""

    kind: str
    order: int
    matches: Callable[[Path, bytes | None], bool]
    load: Callable[[Path], Run]
    describe: str
    markers: tuple[bytes, ...] = ()
    layers: Callable[[Any], Any] | None = None
    layers_only: bool = False


_TABLE: list[Source] | None = None


def sources() -> list[Source]:
    global _TABLE
    if _TABLE is None:
        found: list[Source] = collect(__name__, __path__, "SOURCE", "SOURCES")
        _TABLE = sorted(found, key=lambda s: s.order)
    return _TABLE


def kinds() -> list[str]:
    return list(dict.fromkeys(s.kind for s in sources()))


def unreadable(path: str | Path, exc: OSError) -> BadInput:
    """One line for a file the tool cannot read (permission denied, a folder where a file belongs, an I/O
    error): the file that failed (the input itself, or a file inside it) and the system's reason."""
    where = str(path)
    if exc.filename is not None and str(exc.filename) != where:
        where = f"{path}: {exc.filename}"
    return BadInput(f"{where}: cannot read ({exc.strerror or exc.__class__.__name__})")


def detect(path: str | Path) -> str:
    """The source kind of ``path``; BadInput for anything else, FIFOs and devices included (and for an
    unreadable file or folder: one line naming it, never a traceback)."""
    try:
        return _detect(Path(path))
    except OSError as exc:
        raise unreadable(path, exc) from None


def _detect(p: Path) -> str:
    if not p.exists():
        raise BadInput(f"{p}: no such file or directory")
    if p.is_dir():
        for s in sources():
            if s.matches(p, None):
                return s.kind
        known = "; ".join(s.describe for s in sources())
        raise BadInput(_looks(p) or f"{p}: directory is neither a run store nor another known layout ({known})")
    regular_file(p, "training log")   # a FIFO would block here, a device never end
    with open(p, "rb") as fh:
        head = fh.read(HEAD)
    if not head.strip() and p.stat().st_size < HEAD:
        raise BadInput(f"{p}: empty file")
    if head.startswith(b"\x89HDF") or head.startswith(b"\x93NUMPY") or looks_binary(head[:65536]):
        raise BadInput(_looks(p) or f"{p}: binary file, not a training log")
    for s in sources():
        if s.matches(p, head):
            return s.kind
    if p.stat().st_size > HEAD:
        with open(p, "rb") as fh:
            for chunk in iter(lambda: fh.read(CHUNK), b""):
                for s in sources():
                    if any(m in chunk for m in s.markers):
                        return s.kind
    raise BadInput(_looks(p) or f"{p}: not a recognised run (" + "; ".join(s.describe for s in sources()) + ")")


def _looks(p: Path) -> str | None:
    """``"P: an environment capture (...), not a run ..."`` when ``p`` is recognisably another kind of input."""
    from sources.input_kind import RUN_KINDS, not_this, what_it_is

    kind = what_it_is(p)
    if kind is None or kind in RUN_KINDS:
        return None     # a damaged run of a kind we read: the generic line lists what each kind needs
    return not_this(p, "a run (a run store, a Megatron or MindFormers log, a TensorBoard folder, a dump)", kind)


def load_run(path: str | Path, kind: str | None = None) -> Run:
    """Load any supported source as a Run; ``kind`` overrides detection."""
    kind = kind or detect(path)
    for s in sources():
        if s.kind == kind:
            try:
                return s.load(Path(path))
            except OSError as exc:     # a reader met a file it cannot read: bad input, not a bug of ours
                raise unreadable(path, exc) from None
    raise BadInput(f"{path}: unknown source kind {kind!r} (one of {', '.join(kinds())})")
