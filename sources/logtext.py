"""Shared handling of training-log text: binary detection, ANSI colour, terminal wrapping.

Logs reach us pasted from terminals: colour codes, carriage-return progress bars, and lines cut at the
terminal width (mid-word, no marker). We undo those before any format-specific parsing.
"""

from __future__ import annotations

import codecs
import importlib.util
import io
import re
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from core.errors import BadInput
from runstore.schema import read_bytes

_ANSI = re.compile(rb"\x1b\[[0-9;?]*[ -/]*[@-~]")


def find_text(raw: bytes, text: bytes, start: int = 0, most: int = 64) -> int:
    """``raw.find(text, start)``, by one byte of ``text`` that is rare in log text (its first one that is not
    a lower-case letter or a space, else its first): a search for one byte runs at memory speed, a longer
    text's ~4x slower on a large log that lacks it. After ``most`` places holding that byte but not ``text``,
    the plain search from there."""
    at = next((i for i, b in enumerate(text) if not (97 <= b <= 122 or b == 32)), 0)
    byte = text[at: at + 1]
    pos = raw.find(byte, start + at)
    for _ in range(most):
        if pos < 0 or raw.startswith(text, pos - at):
            return pos if pos < 0 else pos - at
        pos = raw.find(byte, pos + 1)
    return pos if pos < 0 else raw.find(text, pos - at)


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
            # the bytes that are not UTF-8 (a valid multi-byte character, a progress bar's '█', is text)
            bad = len(head) - len(head.decode("utf-8", "ignore").encode("utf-8")) + nul
            return bad > len(head) // 10
    return False


def read_log(path: str | Path, keep_nul: bool = False) -> tuple[bytes, list[str]]:
    """Read a log file, refusing what is not text (one-line BadInput naming the file), with notes on what
    was removed (NUL bytes a crash or a copy left in the text). ``keep_nul``: leave NUL bytes in place (the
    caller decides which are harmless: a NUL inside a step number must not leave a shorter number)."""
    p = Path(path)
    data = read_bytes(p, "log file")
    if not data[:4096].strip() and data.isspace() or not data:   # (strip() would copy a large file)
        raise BadInput(f"{p}: empty file")
    if looks_binary(data[:65536]):
        raise BadInput(f"{p}: binary file (NUL or non-UTF-8 bytes), not a training log")
    notes = []
    if b"\x00" in data and not keep_nul:
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


# ------------------------------------------------------------------------------------------------------
# Bulk reading with pyarrow (optional): whole files split at one separator, no Python object per line
# ------------------------------------------------------------------------------------------------------

class _Translating(io.RawIOBase):
    """``raw`` read through a ``bytes.translate`` ``table`` a block at a time, as pyarrow's reader asks for
    it: its reader thread maps the next block while its workers parse the last ones, the blocks stay in
    cache, and no mapped copy of the whole file is made (~0.15 s less a 1M-line log than mapping it first).
    A table that changes one byte maps with numpy (``_map_byte``, about twice as fast as ``translate``)."""

    def __init__(self, raw: bytes, table: bytes) -> None:
        super().__init__()
        self._raw, self._table, self._pos = raw, table, 0
        changed = [b for b in range(256) if table[b] != b]
        self._one = (changed[0], table[changed[0]]) if len(changed) == 1 else None
        self._array = np.frombuffer(raw, dtype=np.uint8)

    def readable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> Any:
        """The next ``size`` bytes mapped (bytes or a uint8 array: pyarrow takes either without a copy)."""
        start = self._pos
        end = len(self._raw) if size is None or size < 0 else min(len(self._raw), start + size)
        self._pos = end
        if self._one is None:
            return self._raw[start: end].translate(self._table)
        src = self._array[start: end]
        return _map_byte(src, np.empty_like(src), *self._one)

    def readinto(self, buf: Any) -> int:
        piece = self.read(len(buf))
        buf[: len(piece)] = piece
        return len(piece)


def read_split(text: bytes | np.ndarray, ncols: int, floats: set[int], most: int, utf8: bool | None = None,
               translate: bytes | None = None) -> tuple[Any, list[str]] | None:
    """Read ``text`` as lines of ``ncols`` '|'-separated columns with pyarrow: column ``i`` as float64 when
    ``i`` is in ``floats``, else as a string. Lines with another column count are handed back as text (in
    file order, at most ``most`` of them). None without pyarrow, when a float column holds something else or
    a line is not UTF-8, or past ``most`` other lines (then reading line by line is as cheap). ``utf8``: the
    caller already knows whether the text is UTF-8 (a numpy ``text``, translated from bytes it checked).
    ``translate``: a ``bytes.translate`` table (ASCII to ASCII) that the bytes ``text`` are read through;
    the lines handed back are translated too."""
    if importlib.util.find_spec("pyarrow") is None or not (is_utf8(text) if utf8 is None else utf8):
        return None   # (pyarrow would hand the handler a line it cannot decode and print the error)
    import pyarrow as pa
    import pyarrow.csv as pcsv

    names = [str(i) for i in range(ncols)]
    other: list[str] = []

    def handler(row: Any) -> str:
        other.append(row.text)
        return "skip" if len(other) < most else "error"

    types = {n: (pa.float64() if i in floats else pa.string()) for i, n in enumerate(names)}
    try:
        source = _Translating(text, translate) if translate is not None else pa.BufferReader(pa.py_buffer(text))
        table = pcsv.read_csv(
            source, read_options=pcsv.ReadOptions(column_names=names),
            parse_options=pcsv.ParseOptions(delimiter="|", quote_char=False, invalid_row_handler=handler),
            convert_options=pcsv.ConvertOptions(column_types=types, null_values=[], strings_can_be_null=False,
                                                check_utf8=False))   # (checked above, on the whole text)
    except (pa.ArrowInvalid, pa.ArrowTypeError, UnicodeError):
        return None
    return table, other


def is_utf8(text: bytes, chunk: int = 1 << 24) -> bool:
    """Whether ``text`` is valid UTF-8; ASCII (the usual log) is answered in one fast pass, other text is
    decoded a chunk at a time (memory stays bounded)."""
    if text.isascii():
        return True
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        for i in range(0, len(text), chunk):
            decoder.decode(text[i: i + chunk])
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return False
    return True


def _map_byte(src: np.ndarray, dst: np.ndarray, old: int, new: int) -> np.ndarray:
    """``src`` (uint8) into ``dst`` with every byte ``old`` turned into ``new``: three numpy passes."""
    np.equal(src, old, out=dst.view(np.bool_))
    np.multiply(dst, np.uint8((new - old) % 256), out=dst)
    np.add(src, dst, out=dst)
    return dst


def originals(raw: bytes, lines: list[str], table: bytes) -> list[bytes] | None:
    """``lines`` (texts pyarrow handed back from a ``table``-translation of ``raw``) as they are in ``raw``:
    found in order, whole lines only. None when one is not where the order says.

    A line without '|' is its own original. Another is found by its longest '|'-free piece (with the line's
    newline when it is the first or last piece) and checked whole against the translation."""
    out: list[bytes] = []
    pos = 0
    n = len(raw)
    for text in lines:
        b = text.encode("utf-8")
        k = len(b)
        if b"|" not in b:
            pieces, off = [b"\n" + b + b"\n"], [-1]
        else:
            parts = b.split(b"|")
            starts = [0]
            for p in parts[:-1]:
                starts.append(starts[-1] + len(p) + 1)
            pieces = [b"\n" + parts[0], *parts[1:-1], parts[-1] + b"\n"]
            off = [-1, *starts[1:]]
        anchor, at = max(zip(pieces, off, strict=True), key=lambda x: len(x[0]))
        i = -1
        if pos == 0 and raw[:k].translate(table) == b and (n == k or raw[k] == 10):
            i = 0
        j = pos + at
        while i < 0:
            j = raw.find(anchor, max(j, 0))
            if j < 0:   # the last line of a file with no final newline
                c = n - k
                if c >= pos and raw[c:].translate(table) == b and (c == 0 or raw[c - 1] == 10):
                    i = c
                    break
                return None
            c = j - at
            if c >= pos and raw[c: c + k].translate(table) == b and (c == 0 or raw[c - 1] == 10) and (
                    c + k == n or raw[c + k] == 10):
                i = c
            j += 1
        out.append(raw[i: i + k])
        pos = i + k + 1
    return out


def find_line(raw: bytes, text: bytes, anchor: bytes, table: bytes, pos: int = 0, from_end: bool = False) -> int:
    """Where the whole line whose ``table``-translation is ``text`` starts in ``raw``, at or after ``pos``:
    found by ``anchor`` (a piece of it, rare text such as a garbled value, or the longest piece), the first
    such line (``from_end``: the last). -1 when there is none."""
    k = len(text)
    j = raw.rfind(anchor, pos) if from_end else raw.find(anchor, pos)
    while j >= 0:
        start = raw.rfind(b"\n", 0, j) + 1
        end = raw.find(b"\n", j)
        end = len(raw) if end < 0 else end
        if start >= pos and end - start == k and raw[start:end].translate(table) == text:
            return start
        j = raw.rfind(anchor, pos, j) if from_end else raw.find(anchor, j + 1)
    return -1


def holds(column: Any, words: tuple[bytes, ...]) -> bool:
    """Whether any string of a pyarrow string column may hold one of ``words``, searched in the data
    buffers (a word across two strings counts: a caller can only be sent to its careful path by it)."""
    for chunk in column.chunks:
        if len(chunk):
            data = chunk.buffers()[2]
            if data is not None:
                text = data.to_pybytes()
                if any(find_text(text, w) >= 0 for w in words):
                    return True
    return False


def digit_run(block: np.ndarray, spaces_only: bool = False) -> np.ndarray | None:
    """The number each row of a uint8 ``block`` holds as blanks, one run of 1-15 digits, blanks; None when a
    row holds anything else (right-aligned numbers, Python's %8d, take a few whole-column operations).
    ``spaces_only``: the blanks are spaces, no other whitespace byte (a control byte is not padding)."""
    block = np.ascontiguousarray(block)
    if len(block) > 1 and (block[0] == block[-1]).all() and (block == block[-1]).all():
        one = digit_run(block[-1:], spaces_only)   # one text on every row (an epoch, a total): read it once
        return None if one is None else np.full(len(block), one[0], dtype=np.int64)
    d = block - np.uint8(48)                      # digits become 0-9, everything else wraps to >= 10
    digit = d < 10
    if not (digit | (block == 32)).all() and (
            spaces_only or not (digit | (block == 32) | (block - np.uint8(9) < 5)).all()):
        return None
    w = block.shape[1]
    if digit[:, -1].all():   # right-aligned: blanks, then digits to the end; blanks add 0 while value is 0
        if w == 8:   # one uint64 per row: the digit mask is blanks-then-digits when its bytes are 00..FF..
            m = digit.view("<u8").ravel() * np.uint64(255)
            if (~m & (~m + np.uint64(1))).any():
                return None
        elif not (digit[:, 1:] >= digit[:, :-1]).all() or (w > 15 and digit.sum(axis=1).max() > 15):
            return None
        np.multiply(d, digit, out=d)
        if w == 8:   # eight digits combined pairwise (SWAR), low byte = first digit
            x = d.view("<u8").ravel()
            x = (x * np.uint64(2561)) >> np.uint64(8)
            x = ((x & np.uint64(0x00FF00FF00FF00FF)) * np.uint64(6553601)) >> np.uint64(16)
            x = ((x & np.uint64(0x0000FFFF0000FFFF)) * np.uint64(42949672960001)) >> np.uint64(32)
            return x.astype(np.int64)
        value = np.zeros(len(block), dtype=np.int64)
        for j in range(w):
            value *= 10
            value += d[:, j]
        return value
    starts = digit[:, 0].astype(np.int8) + (digit[:, 1:] & ~digit[:, :-1]).sum(axis=1)
    if not (starts == 1).all() or (w > 15 and digit.sum(axis=1).max() > 15):
        return None
    value = np.zeros(len(block), dtype=np.int64)
    for j in range(w):
        value = np.where(digit[:, j], value * 10 + d[:, j], value)
    return value


def _chunk_buffers(column: Any) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """(strings, offsets, data bytes) of each non-empty chunk of a pyarrow string column, without copies."""
    for chunk in column.chunks:
        k = len(chunk)
        if k:
            offsets = np.frombuffer(chunk.buffers()[1], dtype=np.int32)[chunk.offset: chunk.offset + k + 1]
            yield k, offsets, np.frombuffer(chunk.buffers()[2], dtype=np.uint8)


def fixed_width_rows(column: Any, width: int) -> np.ndarray:
    """A pyarrow string column whose strings all have ``width`` bytes, as an (n, width) uint8 matrix."""
    blocks = [data[offsets[0]: offsets[0] + k * width].reshape(k, width)
              for k, offsets, data in _chunk_buffers(column)]
    return np.concatenate(blocks) if len(blocks) > 1 else blocks[0]


def all_equal(column: Any, text: str) -> bool:
    """Whether every string of a pyarrow string column is ``text``; all empty is read off the offsets."""
    if text:
        import pyarrow.compute as pc

        return bool(pc.all(pc.equal(column, text)).as_py())
    return all(offsets[-1] == offsets[0] for _, offsets, _ in _chunk_buffers(column))


def first_bytes(column: Any) -> np.ndarray:
    """The first byte of every non-empty string of a pyarrow string column, read from its buffers."""
    out = [data[offsets[:-1][offsets[1:] > offsets[:-1]]] for _, offsets, data in _chunk_buffers(column)]
    return np.concatenate(out) if out else np.zeros(0, dtype=np.uint8)


def any_ends_with(column: Any, words: Sequence[bytes]) -> bool:
    """Whether a string of a pyarrow string column ends with one of ``words``, read from its buffers: the
    last byte of every string in one gather, then byte by byte from the end over the strings whose last
    byte ends a word (pyarrow's ends_with costs ~36 ns a string, for each word)."""
    if not holds(column, tuple(words)):   # (a rare word is looked for at memory speed first)
        return False
    lut = np.zeros(256, dtype=bool)
    lut[[w[-1] for w in words]] = True
    for _, offsets, data in _chunk_buffers(column):
        ends = offsets[1:]
        if not len(data):
            continue
        cand = np.flatnonzero(lut[data[ends - 1]])   # an empty string reads its neighbour's byte: sorted out below
        if not len(cand):
            continue
        starts, stops = offsets[:-1][cand], ends[cand]
        for w in words:
            left = stops[stops - starts >= len(w)]
            for j in range(1, len(w) + 1):
                if not len(left):
                    break
                left = left[data[left - j] == w[-j]]
            if len(left):
                return True
    return False


def int_column(column: Any, spaces_only: bool = False) -> np.ndarray | None:
    """Whole numbers written as blanks and digits (``%5d``), one per string; None when a string holds
    anything else. Strings of one width are read with numpy, others with pyarrow's regex and cast.
    ``spaces_only``: the blanks are spaces only."""
    import pyarrow as pa
    import pyarrow.compute as pc

    lengths = pc.min_max(pc.binary_length(column))
    lo, hi = lengths["min"].as_py(), lengths["max"].as_py()
    if lo is None or not lo:
        return None
    if lo == hi:
        return digit_run(fixed_width_rows(column, lo), spaces_only)
    digits = pc.utf8_trim(column, " " if spaces_only else " \t\n\r\f\v")   # Python's bytes \s, no other blank
    if not pc.all(pc.ascii_is_decimal(digits)).as_py() or pc.max(pc.binary_length(digits)).as_py() > 15:
        return None
    return pc.cast(digits, pa.int64()).to_numpy()
