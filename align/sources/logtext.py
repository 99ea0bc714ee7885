"""Shared handling of training-log text: binary detection, ANSI colour, terminal wrapping.

Logs reach us pasted from terminals: colour codes, carriage-return progress bars, and lines cut at the
terminal width (mid-word, no marker). We undo those before any format-specific parsing.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from align.core.errors import BadInput
from align.core.schema import read_bytes

_ANSI = re.compile(rb"\x1b\[[0-9;?]*[ -/]*[@-~]")


def looks_binary(head: bytes) -> bool:
    """Whether the first bytes of a file are binary rather than log text: NUL or non-UTF-8 bytes make up
    more than a tenth of them. A few NULs (a crash that padded the file, a stray byte) do not."""
    if not head:
        return False
    nul = head.count(b"\x00")
    if nul > len(head) // 10:
        return True
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        # A multi-byte character cut at the 64 KiB boundary is fine; garbage early on is not.
        if exc.start < len(head) - 4:
            bad = sum(1 for b in head if b >= 0x80) + nul
            return bad > len(head) // 10
    return False


def read_log(path: str | Path) -> tuple[bytes, list[str]]:
    """Read a log file, refusing what is not text (one-line BadInput naming the file), with notes on what
    was removed (NUL bytes a crash or a copy left in the text)."""
    p = Path(path)
    data = read_bytes(p, "log file")
    if not data[:4096].strip() and data.isspace() or not data:   # (strip() would copy a large file)
        raise BadInput(f"{p}: empty file")
    if looks_binary(data[:65536]):
        raise BadInput(f"{p}: binary file (NUL or non-UTF-8 bytes), not a training log")
    notes = []
    if b"\x00" in data:
        n = data.count(b"\x00")
        data = data.replace(b"\x00", b"")
        notes.append(f"removed {n} NUL byte(s) from the text")
    return data, notes


def read_log_bytes(path: str | Path) -> bytes:
    """Read a log file, refusing what is not text (one-line BadInput naming the file)."""
    return read_log(path)[0]


def clean_text(data: bytes) -> bytes:
    """Strip ANSI colour, turn CR progress updates into lines, and undo terminal wrapping."""
    if b"\x1b" in data:
        data = _ANSI.sub(b"", data)
    if b"\r" in data:
        data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    return data


def unwrap(lines: list[str], is_complete: Callable[[str], bool]) -> tuple[list[str], int]:
    """Join physical lines that a terminal cut at its width.

    A copy from a terminal breaks long lines at exactly the terminal width, with nothing inserted. So the
    width shows as the most common length among the longest lines; a line of exactly that length that is
    not a complete record is joined with the next one. Returns the lines and how many joins were made.
    """
    lengths = Counter(len(x) for x in lines if len(x) >= 40)
    if not lengths:
        return lines, 0
    longest = max(lengths)
    if lengths[longest] < 2:
        return lines, 0
    width = longest
    out: list[str] = []
    joins = 0
    buf = ""
    for line in lines:
        if buf:
            buf += line
            joins += 1
        else:
            buf = line
        if len(line) == width and not is_complete(buf):
            continue
        out.append(buf)
        buf = ""
    if buf:
        out.append(buf)
    return out, joins


def rejoin_wrapped(lines: list[str], starts_record: Callable[[str], bool], is_complete: Callable[[str], bool],
                   continues: Callable[[str], bool]) -> tuple[list[str], int]:
    """Re-join records that a terminal cut at its width, and nothing else.

    A terminal copy makes every line at most W characters long and cuts a longer one into pieces of exactly
    W (W - 1 when the copy dropped the space the cut fell on). So a record is continued on the next line
    only when its line has that full width, the next line does not start a record itself, and the joined
    text completes the record (or the file ends). Works for one wrapped record among unwrapped ones; two
    records that each start with a record head are never merged. Returns the lines and the joins made.
    """
    lengths = [len(x) for x in lines]
    width = max(lengths, default=0)
    if width < 40:
        return lines, 0
    out: list[str] = []
    joins = 0
    n = len(lines)
    done = 0                       # lines[:done] are already in ``out``
    full = [i for i, k in enumerate(lengths) if k >= width - 1]
    for i in full:
        if i < done or i + 1 >= n or not starts_record(lines[i]):
            continue
        buf, j = lines[i], i
        while (j + 1 < n and j - i < 50 and lengths[j] >= width - 1 and lines[j + 1].strip()
               and not starts_record(lines[j + 1])
               and (not is_complete(buf) or continues(lines[j + 1]))):
            j += 1
            buf += (" " if lengths[j - 1] == width - 1 else "") + lines[j]
            if is_complete(buf) and lengths[j] < width - 1:
                break
        if j > i and (is_complete(buf) or j == n - 1):
            out.extend(lines[done:i])
            out.append(buf)
            joins += j - i
            done = j + 1
    if not joins:
        return lines, 0
    out.extend(lines[done:])
    return out, joins
