"""Where results go: checks on an output folder or file before anything is written.

An ``--out`` that is a file or a dangling symlink is refused (writing would fail half-way, or land where
the link points); inside the output folder, a symlinked sub-folder is refused rather than written through
(figures must not end up in someone else's folder).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from core.errors import BadInput


def check_out_dir(out: str | os.PathLike, inputs: Iterable[str | os.PathLike] = ()) -> Path:
    """``out`` as a Path when it can be (or already is) an output folder; BadInput otherwise, and when it is
    one of ``inputs`` or a folder inside one (a report written into the run store it reads)."""
    p = Path(out)
    here = Path(os.path.realpath(p))
    for given in inputs:
        src = Path(os.path.realpath(given))
        if here == src or (src.is_dir() and src in here.parents):
            raise BadInput(f"{p}: output would be written into the input {given}; name another folder")
    if p.is_symlink() and not p.exists():
        raise BadInput(f"{p}: output is a dangling symlink (to {os.readlink(p)})")
    if p.exists() and not p.is_dir():
        raise BadInput(f"{p}: output exists and is not a directory")
    if p.is_dir():
        _writable(p, f"{p}: output folder is not writable")
        return p
    parent = p.parent
    while not parent.exists():
        if parent.is_symlink():
            raise BadInput(f"{p}: cannot create it: {parent} is a dangling symlink")
        parent = parent.parent
    if not parent.is_dir():
        raise BadInput(f"{p}: cannot create it: {parent} is not a directory")
    _writable(parent, f"{p}: cannot create it: {parent} is not writable")
    return p


def check_out_file(out: str | os.PathLike, what: str = "output") -> Path:
    """``out`` as a Path when a file can be written there (an existing file is replaced); BadInput for a
    folder, a dangling symlink, a missing or unwritable parent folder. ``"-"`` (stdout) passes."""
    p = Path(out)
    if str(out) == "-":
        return p
    if p.is_symlink() and not p.exists():
        raise BadInput(f"{p}: {what} is a dangling symlink (to {os.readlink(p)})")
    if p.is_dir():
        raise BadInput(f"{p}: {what} is a directory, expected a file name")
    parent = p.parent
    if not parent.is_dir():
        raise BadInput(f"{p}: {what}'s folder {parent} does not exist")
    _writable(parent, f"{p}: cannot write it: {parent} is not writable")
    if p.exists() and not os.access(p, os.W_OK):
        raise BadInput(f"{p}: {what} exists and is not writable")
    return p


def _writable(folder: Path, message: str) -> None:
    """BadInput(message) when files cannot be created in ``folder`` (permissions, a read-only mount)."""
    if not os.access(folder, os.W_OK | os.X_OK):
        raise BadInput(message)


def check_no_symlinks(out: str | os.PathLike, relpaths: Iterable[str | os.PathLike]) -> None:
    """Refuse when a folder on the way to any of ``relpaths`` inside ``out`` is a symlink."""
    root = Path(out)
    seen: set[Path] = set()
    for rel in relpaths:
        parts = Path(rel).parts
        cur = root
        for part in parts[:-1]:
            cur = cur / part
            if cur in seen:
                continue
            seen.add(cur)
            if cur.is_symlink():
                raise BadInput(f"{cur}: is a symlink inside the output folder; refusing to write through it")
            if cur.exists() and not cur.is_dir():
                raise BadInput(f"{cur}: exists inside the output folder and is not a directory")


def write_text_output(path: str | os.PathLike, text: str) -> None:
    """Write a result file the user named (``--json OUT``); one-line BadInput when that cannot be done."""
    p = Path(path)
    if p.is_symlink() and not p.exists():
        raise BadInput(f"{p}: output is a dangling symlink")
    if p.is_dir():
        raise BadInput(f"{p}: output is a directory, expected a file name")
    try:
        p.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise BadInput(f"{p}: cannot write ({exc.strerror or exc.__class__.__name__})") from None


def temp_beside(out: Path) -> Path:
    """A fresh temporary folder beside ``out`` (the same file system, so a rename moves what it holds into
    place); BadInput when the folder cannot be made there."""
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        return Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    except OSError as exc:
        raise BadInput(f"{out}: cannot write there ({exc.strerror or exc.__class__.__name__})") from None
