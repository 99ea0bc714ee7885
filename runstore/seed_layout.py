"""The seed's batch layout, ``step_N/rank_R/{tokens,labels,loss_mask,attention_mask}.npy``: what MindFormers
users replay. ``RunWriter.write_seed_batch`` writes it; this module reads it (no pickle).
"""

from __future__ import annotations

import math
import threading
import tokenize
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from core.errors import BadInput
from runstore.layout import _SEED_RANK_RE, _STEP_RE, SEED_BATCH_KEYS
from runstore.schema import regular_file

#: exceptions numpy raises on a garbled .npy header (a flipped byte makes its dict literal fail to
#: tokenize: tokenize.TokenError, SyntaxError; a huge declared shape: MemoryError / OverflowError)
_HEADER_ERRORS = (ValueError, OSError, EOFError, TypeError, SyntaxError, tokenize.TokenError, MemoryError,
                  OverflowError, RecursionError, KeyError)
_MAX_DIGITS = 18      # a step or rank number: below 2**62, and far below Python's 4300-digit int limit


def step_number(name: str, digits: str, where: Path) -> int:
    """The number in a step_N / rank_N name; a one-line BadInput beyond 18 digits (never an OverflowError or
    Python's 4300-digit ValueError)."""
    if len(digits) > _MAX_DIGITS:
        raise BadInput(f"{where / name}: number in the name has {len(digits)} digits, at most {_MAX_DIGITS}")
    return int(digits)


# numpy parses a .npy header with ast.literal_eval, and CPython 3.11's compile() is not thread-safe: two threads
# of a parallel tensor compare raised "SystemError: AST constructor recursion depth mismatch" (a CI run). Headers
# are parsed one at a time; the data is read outside the lock.
_HEADER_LOCK = threading.Lock()


def npy_header(path: str | Path) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """(shape, fortran order, dtype, data offset) of a .npy file through numpy's public header readers (numpy
    1.x and 2.x), checked: a numeric dtype and a file that holds every declared byte. One-line BadInput."""
    try:
        with open(path, "rb") as fh, _HEADER_LOCK:
            version = np.lib.format.read_magic(fh)
            reader = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                np.lib.format.read_array_header_2_0
            shape, fortran, dtype = reader(fh)
            offset = fh.tell()
    except _HEADER_ERRORS as exc:
        raise BadInput(f"{path}: not a valid .npy array ({' '.join(str(exc).split())[:80] or type(exc).__name__})"
                       ) from None
    if dtype.hasobject:
        raise BadInput(f"{path}: holds pickled objects; refusing to load (no pickle)")
    if dtype.kind not in "biuf" or dtype.names is not None:
        raise BadInput(f"{path}: dtype {dtype} is not a number type (int, uint, float or bool)")
    if any(type(n) is not int or n < 0 for n in shape):
        raise BadInput(f"{path}: header declares shape {shape!r:.60}")
    need = dtype.itemsize
    for n in shape:
        need *= n
    have = Path(path).stat().st_size - offset
    if need > have:
        raise BadInput(f"{path}: header declares {need} bytes of data, the file holds {max(have, 0)} (truncated "
                       "or a corrupt header)")
    return tuple(shape), bool(fortran), dtype, offset


def load_npy(path: Path) -> np.ndarray:
    """A plain numeric .npy array (no pickle): its header read once and checked (:func:`npy_header`), then its
    data; safe to call from several threads. A one-line BadInput for anything else."""
    regular_file(path, ".npy file")
    shape, fortran, dtype, offset = npy_header(path)
    count = math.prod(shape)
    try:
        arr = np.fromfile(path, dtype=dtype, count=count, offset=offset)
    except _HEADER_ERRORS as exc:
        raise BadInput(f"{path}: unreadable or truncated .npy ({' '.join(str(exc).split())[:80]})") from None
    if arr.size != count:
        raise BadInput(f"{path}: unreadable or truncated .npy ({arr.size} of {count} values)")
    return arr.reshape(shape, order="F" if fortran else "C")


def seed_steps(root: Path) -> dict[int, dict[int, Path]]:
    """Map step -> rank -> folder for the seed layout under ``root``."""
    out: dict[int, dict[int, Path]] = {}
    for d in Path(root).iterdir():
        m = _STEP_RE.match(d.name)
        if not m or not d.is_dir():
            continue
        step = step_number(d.name, m.group(1), Path(root))
        for r in d.iterdir():
            mm = _SEED_RANK_RE.match(r.name)
            if mm and r.is_dir():
                out.setdefault(step, {})[step_number(r.name, mm.group(1), d)] = r
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
        if not path.exists() and not path.is_symlink():     # a FIFO or a device there: refused by load_npy
            raise BadInput(f"{path}: missing")
        out[key] = load_npy(path)
    return out
