"""MindSpore ``.ckpt`` files (MindFormers' legacy models) read lazily, without MindSpore.

Why not ``mindspore.load_checkpoint``: it parses the whole file into memory (every parameter at once) and
needs MindSpore installed. The format is plain protobuf (mindspore/train/checkpoint.proto): a sequence of
``Checkpoint.value`` records, each ``{tag: name, tensor: {dims, tensor_type, tensor_content}}``, a large
parameter split over several consecutive records with the same tag; ``save_checkpoint(crc_check=True)``
appends ``b"crc_num"`` and 10 bytes. This module walks the wire format once, keeping only where each
parameter's bytes lie, and reads a parameter's bytes from the memory-mapped file when it is asked for.
Encrypted checkpoints, map tensors and string parameters are refused or skipped by name.
"""

from __future__ import annotations

import binascii
from pathlib import Path

import numpy as np

from core.errors import BadInput
from runstore.schema import regular_file

# tensor_type as MindSpore writes it -> numpy dtype ("BFloat16" -> uint16 bit patterns, decoded below)
_TYPES = {"Float16": np.float16, "Float32": np.float32, "Float64": np.float64, "BFloat16": np.uint16,
          "Int8": np.int8, "UInt8": np.uint8, "Int16": np.int16, "UInt16": np.uint16, "Int32": np.int32,
          "UInt32": np.uint32, "Int64": np.int64, "UInt64": np.uint64, "Bool": np.bool_}
_NAMES = {"BFloat16": "bfloat16"}


class _Malformed(Exception):
    pass


def _varint(buf: memoryview | np.ndarray, pos: int, end: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= end or shift > 63:
            raise _Malformed("a varint runs past its record")
        b = int(buf[pos])
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7


def _fields(buf: memoryview | np.ndarray, pos: int, end: int):
    """(field number, wire type, value or (start, stop) of a length-delimited field) over buf[pos:end]."""
    while pos < end:
        key, pos = _varint(buf, pos, end)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos, end)
            yield field, wire, value
        elif wire == 2:
            n, pos = _varint(buf, pos, end)
            if pos + n > end:
                raise _Malformed("a field runs past its record (truncated?)")
            yield field, wire, (pos, pos + n)
            pos += n
        elif wire == 1:
            pos += 8
            yield field, wire, None
        elif wire == 5:
            pos += 4
            yield field, wire, None
        else:
            raise _Malformed(f"wire type {wire} is not protobuf's")
    if pos != end:
        raise _Malformed("a fixed-size field runs past its record (truncated?)")


def _tensor(buf: np.ndarray, lo: int, hi: int) -> tuple[list[int], str, tuple[int, int]]:
    dims: list[int] = []
    ttype, content = None, None
    for field, wire, v in _fields(buf, lo, hi):
        if field == 1 and wire == 0:
            dims.append(v)
        elif field == 1 and wire == 2:          # packed dims
            p, e = v
            while p < e:
                d, p = _varint(buf, p, e)
                dims.append(d)
        elif field == 2 and wire == 2:
            ttype = bytes(buf[v[0]:v[1]]).decode("utf-8", "replace")
        elif field == 3 and wire == 2:
            content = v
    if ttype is None or content is None:
        raise _Malformed("a tensor record lacks its type or content")
    return dims, ttype, content


class MindSporeCkpt:
    """A ``.ckpt`` file as lazily read weights (names, shape, stored dtype, one parameter's array)."""

    sequential = False
    kind = "mindspore ckpt"

    def __init__(self, path: str | Path) -> None:
        self.path = regular_file(path, "MindSpore checkpoint")
        try:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r") if self.path.stat().st_size else \
                np.zeros(0, np.uint8)
        except OSError as exc:
            raise BadInput(f"{self.path}: cannot read ({exc.strerror})") from None
        buf = self._mm
        end = buf.size
        if end >= 17 and bytes(buf[end - 17:end - 10]) == b"crc_num":   # save_checkpoint(crc_check=True)
            end -= 17
            want = int.from_bytes(bytes(buf[end + 7:end + 17]), "big")
            crc = 0
            for s in range(0, end, 1 << 24):
                crc = binascii.crc32(buf[s:min(end, s + (1 << 24))], crc)
            if crc != want:
                raise BadInput(f"{self.path}: CRC check failed (the checkpoint is damaged)")
        self._parts: dict[str, list[tuple[int, int]]] = {}
        self._meta: dict[str, tuple[list[int], str]] = {}
        self.skipped: list[str] = []
        try:
            for field, wire, v in _fields(buf, 0, end):
                if field != 1 or wire != 2:
                    raise _Malformed(f"top-level field {field} is not a checkpoint value")
                tag, tensor = None, None
                for f2, w2, v2 in _fields(buf, *v):
                    if f2 == 1 and w2 == 2:
                        tag = bytes(buf[v2[0]:v2[1]]).decode("utf-8")
                    elif f2 == 2 and w2 == 2:
                        tensor = v2
                    elif f2 == 3 and w2 == 2 and tag is not None:
                        self.skipped.append(tag)          # a map tensor (embedding tables of PS mode)
                if tag is None:
                    raise _Malformed("a value without a name")
                if tensor is None:
                    continue
                dims, ttype, content = _tensor(buf, *tensor)
                if ttype == "str":
                    self.skipped.append(tag)
                    continue
                if ttype not in _TYPES:
                    raise BadInput(f"{self.path}: parameter {tag!r} has tensor_type {ttype!r}, which this reader "
                                   "does not know")
                have = self._meta.get(tag)
                if have is not None and (have[0] != dims or have[1] != ttype):
                    raise _Malformed(f"parameter {tag!r} is stored twice with different shapes or types")
                self._meta[tag] = (dims, ttype)
                self._parts.setdefault(tag, []).append(content)
        except _Malformed as exc:
            raise BadInput(f"{self.path}: not a MindSpore checkpoint, or damaged or encrypted ({exc})") from None
        except UnicodeDecodeError:
            raise BadInput(f"{self.path}: not a MindSpore checkpoint (a parameter name is not UTF-8)") from None
        if not self._meta and end:
            raise BadInput(f"{self.path}: not a MindSpore checkpoint (no parameter records)")
        for name, (dims, ttype) in self._meta.items():
            n = sum(b - a for a, b in self._parts[name])
            want = int(np.prod(dims, dtype=object)) * np.dtype(_TYPES[ttype]).itemsize
            if n != want:
                raise BadInput(f"{self.path}: parameter {name!r} holds {n} bytes, its shape {dims} {ttype} needs "
                               f"{want}")

    def names(self) -> list[str]:
        return list(self._meta)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._meta[name][0])

    def dtype(self, name: str) -> str:
        t = self._meta[name][1]
        return _NAMES.get(t, np.dtype(_TYPES[t]).name)

    def get(self, name: str) -> np.ndarray:
        dims, ttype = self._meta[name]
        parts = self._parts[name]
        raw = self._mm[parts[0][0]:parts[0][1]] if len(parts) == 1 else np.concatenate(
            [self._mm[a:b] for a, b in parts])
        a = np.frombuffer(raw, dtype=np.dtype(_TYPES[ttype]).newbyteorder("<"))
        if ttype == "BFloat16":
            a = (a.astype(np.uint32) << np.uint32(16)).view(np.float32)
        return a.reshape(dims)

    def close(self) -> None:
        self._mm = np.zeros(0, np.uint8)
