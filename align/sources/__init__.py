"""Detect what a run argument is (run store, Megatron log, MindFormers log, TensorBoard dir, Megatron
golden-values JSON, msprobe dump directory) and load it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from align.core.errors import BadInput
from align.core.runstore import META, SCALAR_DIR
from align.core.schema import regular_file
from align.sources.logtext import looks_binary

if TYPE_CHECKING:   # align.core.run needs pandas; the tensor compare imports this package without it
    from align.core.run import Run

KINDS = ("runstore", "megatron_log", "mindformers_log", "tensorboard", "golden_values", "msprobe")


def detect(path: str | Path) -> str:
    """The source kind of ``path`` (one of KINDS); BadInput for anything else, FIFOs and devices included."""
    p = Path(path)
    if not p.exists():
        raise BadInput(f"{p}: no such file or directory")
    if p.is_dir():
        if (p / META).is_file() or (p / SCALAR_DIR).is_dir():
            return "runstore"
        from align.sources.msprobe import is_msprobe_dump

        if is_msprobe_dump(p):
            return "msprobe"
        if any(p.glob("worker_*.log")) or any((p / "msrun_log").glob("worker_*.log")):
            return "mindformers_log"
        if any(p.rglob("events.out.tfevents.*")):
            return "tensorboard"
        raise BadInput(f"{p}: directory is neither a run store (meta.json, scalars/), an msprobe dump "
                       "(step*/rank*/dump.json), msrun worker logs (worker_N.log) nor a TensorBoard log dir "
                       "(events.out.tfevents.*)")
    regular_file(p, "training log")   # a FIFO would block here, a device never end
    with open(p, "rb") as fh:
        head = fh.read(4 << 20)
    if not head.strip() and p.stat().st_size < (4 << 20):
        raise BadInput(f"{p}: empty file")
    from align.sources.golden_values import looks_like_golden_values

    if looks_like_golden_values(head):
        return "golden_values"
    if head.startswith(b"\x89HDF") or head.startswith(b"\x93NUMPY") or looks_binary(head[:65536]):
        raise BadInput(f"{p}: binary file, not a training log")
    if b"Epoch:[" in head or b"local_norm:" in head:
        return "mindformers_log"
    if b"iteration" in head and b"|" in head:
        return "megatron_log"
    # Large logs may start with a long preamble: look further only at the marker bytes.
    with open(p, "rb") as fh:
        for chunk in iter(lambda: fh.read(16 << 20), b""):
            if b"Epoch:[" in chunk:
                return "mindformers_log"
            if b"| lm loss" in chunk or b"consumed samples" in chunk:
                return "megatron_log"
    raise BadInput(f"{p}: not a recognised training log (no Megatron 'iteration' or MindFormers "
                   "'Epoch:[..] step:[..]' lines)")


def load_run(path: str | Path, kind: str | None = None) -> Run:
    """Load any supported source as a Run; ``kind`` overrides detection."""
    kind = kind or detect(path)
    if kind == "runstore":
        from align.core.run import open_store
        return open_store(path)
    if kind == "megatron_log":
        from align.sources.megatron_log import parse_megatron_log
        return parse_megatron_log(path)
    if kind == "mindformers_log":
        from align.sources.mindformers_log import parse_mindformers_dir, parse_mindformers_log
        return parse_mindformers_dir(path) if Path(path).is_dir() else parse_mindformers_log(path)
    if kind == "tensorboard":
        from align.sources.tensorboard import read_tensorboard
        return read_tensorboard(path)
    if kind == "golden_values":
        from align.sources.golden_values import read_golden_values
        return read_golden_values(path)
    if kind == "msprobe":
        from align.sources.msprobe import read_msprobe
        return read_msprobe(path)
    raise BadInput(f"{path}: unknown source kind {kind!r} (one of {', '.join(KINDS)})")
