"""Opening an ``.npz`` evidence file (step-1 optimizer file and shards, clipping probe), checked first.

Why: ``np.load`` blocks on a FIFO, reads a plain ``.npy`` whole (sized by its header), and sizes each member's
array by the member's header before reading it (a crafted header declaring 1e12 values is an allocation, a
zip member that inflates 1000x a bomb). Here the path must be a regular file that is a zip archive, and every
member's declared size must fit what the archive says it holds, before any array is read.
"""

from __future__ import annotations

import os
import tokenize
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from core.errors import BadInput
from runstore.schema import MAX_INPUT_BYTES, regular_file

_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")    # a zip's first local header, or an empty archive's end record
_MAX_RATIO, _SLACK = 1100, 1 << 20              # what deflate can yield from what is stored (see runstore.h5file)
_ERRORS = (OSError, ValueError, EOFError, KeyError, TypeError, SyntaxError, tokenize.TokenError, OverflowError,
           RecursionError, zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError)


def _why(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:80] or type(exc).__name__


@contextmanager
def open_npz(path: str | os.PathLike, what: str = ".npz file") -> Iterator[np.lib.npyio.NpzFile]:
    """``np.load(path, allow_pickle=False)`` of a regular file holding a zip archive whose members' declared
    sizes are checked (:func:`check_members`). One-line BadInput naming the file otherwise; errors raised in
    the block are the caller's."""
    p = regular_file(path, what)
    try:
        with open(p, "rb") as fh:
            head = fh.read(4)
    except OSError as exc:
        raise BadInput(f"{p}: cannot read ({exc.strerror or type(exc).__name__})") from None
    if head[:4] not in _ZIP_MAGIC:
        kind = "an .npy array, not an .npz archive" if head.startswith(b"\x93NUM") else "not a zip archive"
        raise BadInput(f"{p}: not a readable {what} ({kind})")
    try:
        z = np.load(p, allow_pickle=False)
    except (*_ERRORS, MemoryError) as exc:
        raise BadInput(f"{p}: not a readable {what} ({_why(exc)})") from None
    try:
        check_members(p, z, what)
        yield z
    finally:
        z.close()


def check_members(path: Path, z: np.lib.npyio.NpzFile, what: str = ".npz file") -> None:
    """Every ``.npy`` member's header read (not its data) and checked: no pickled objects, declared bytes
    within the member's size, the member's size within what its compressed bytes can inflate to."""
    try:
        infos = z.zip.infolist()
        for info in infos:
            if info.file_size > MAX_INPUT_BYTES or info.file_size > _SLACK + _MAX_RATIO * info.compress_size:
                raise BadInput(f"{path}: member '{info.filename}' declares {info.file_size} bytes from "
                               f"{info.compress_size} stored (beyond what compression yields)")
            if not info.filename.endswith(".npy"):
                continue
            with z.zip.open(info) as fh:
                version = np.lib.format.read_magic(fh)
                read = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                    np.lib.format.read_array_header_2_0
                shape, _, dtype = read(fh)
                offset = fh.tell()
            key = info.filename[:-4]
            if dtype.hasobject:
                raise BadInput(f"{path}: key '{key}': holds pickled objects; refusing to load (no pickle)")
            need = dtype.itemsize
            for n in shape:
                need *= int(n)
            if need > info.file_size - offset:
                raise BadInput(f"{path}: key '{key}': header declares {need} bytes ({shape!r:.40}), the member "
                               f"holds {max(info.file_size - offset, 0)}")
    except BadInput:
        raise
    except (*_ERRORS, MemoryError) as exc:
        raise BadInput(f"{path}: not a readable {what} ({_why(exc)})") from None
