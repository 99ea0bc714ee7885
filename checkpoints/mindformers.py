"""MindFormers 2.x checkpoints as safetensors: the format mcore MindFormers loads (``load_ckpt_format:
safetensors``), with Megatron's parameter names (``decoder.layers.0.mlp.linear_fc1.weight``, ...).

Why not MindSpore's own writer: safetensors is plain data (a JSON header and raw little-endian arrays), so
numpy and the ``safetensors`` package write it without mindspore installed, and nothing can execute on load.
Writing goes through the ``safetensors`` package (``save_file``, or ``serialize_file`` for bfloat16, which
numpy lacks); reading parses the header itself so bfloat16 tensors come back as exact float32.
Files appear atomically (temporary name, then rename): a failed write leaves nothing half-written.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from core.errors import BadInput
from runstore.schema import regular_file

_NP_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
              "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_MAX_HEADER = 100 * 1024 * 1024


def float32_to_bfloat16_bits(arr: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest even; exact for bfloat16 values."""
    bits = np.ascontiguousarray(arr, dtype=np.float32).view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    out = (rounded >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(arr)
    if nan.any():
        out[nan] = np.uint16(0x7FC0)
    return out


def bfloat16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32 (exact)."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def write_safetensors(arrays: Mapping[str, np.ndarray], path: str | os.PathLike, *, dtype: str | None = None,
                      metadata: Mapping[str, str] | None = None) -> Path:
    """Write ``arrays`` (name -> numpy) to ``path``. ``dtype`` bfloat16 / float16 / float32 casts the floating
    tensors (bfloat16 stored as BF16); None keeps each array's own dtype."""
    path = Path(path)
    if dtype == "bfloat16":
        return _write_raw(arrays, path, metadata)
    try:
        from safetensors.numpy import save_file
    except ImportError as exc:   # pragma: no cover - a dependency of the checkpoints extra
        raise BadInput(f"{path}: writing safetensors needs the 'safetensors' package") from exc
    meta = {"format": "np", "producer": "xf-align", **dict(metadata or {})}
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    cast = {"float16": np.float16, "float32": np.float32}.get(dtype or "")

    def prepared(a: np.ndarray) -> np.ndarray:
        a = np.asarray(a)
        if cast is not None and np.issubdtype(a.dtype, np.floating):
            a = a.astype(cast)
        return np.ascontiguousarray(a)

    try:
        save_file({n: prepared(a) for n, a in arrays.items()}, str(tmp), metadata=meta)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def _write_raw(arrays: Mapping[str, np.ndarray], path: Path, metadata: Mapping[str, str] | None) -> Path:
    """The safetensors layout written directly, floating tensors as BF16 (numpy has no bfloat16): an 8-byte
    little-endian header length, the JSON header (padded to 8 bytes), then each tensor's bytes in order."""
    codes = {np.dtype(v).name: k for k, v in _NP_DTYPES.items()}
    header: dict[str, object] = {"__metadata__": {"format": "np", "producer": "xf-align", **dict(metadata or {})}}
    blobs, pos = [], 0
    for name in sorted(arrays):
        a = np.asarray(arrays[name])
        if np.issubdtype(a.dtype, np.floating):
            st, raw = "BF16", float32_to_bfloat16_bits(a.astype(np.float32)).astype("<u2").tobytes()
        elif a.dtype.name in codes:
            st, raw = codes[a.dtype.name], np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<")).tobytes()
        else:
            raise BadInput(f"{path}: tensor {name!r} has dtype {a.dtype}, which safetensors cannot hold")
        header[name] = {"dtype": st, "shape": list(a.shape), "data_offsets": [pos, pos + len(raw)]}
        blobs.append(raw)
        pos += len(raw)
    head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    head += b" " * (-len(head) % 8)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(head)))
            f.write(head)
            for b in blobs:
                f.write(b)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def read_safetensors_header(path: str | os.PathLike) -> tuple[dict[str, dict], dict[str, str], int]:
    """(tensor entries, metadata, offset of the data section) of a safetensors file."""
    path = regular_file(path, "safetensors file")   # a FIFO would block the open, a device never ends
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise BadInput(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER:
                raise BadInput(f"{path}: not a safetensors file (header length {n} is implausible)")
            raw = f.read(n)
            if len(raw) != n:
                raise BadInput(f"{path}: not a safetensors file (header of {n} bytes, file ends after {len(raw)})")
            header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except OSError as exc:
        raise BadInput(f"{path}: cannot read ({exc.strerror})") from None
    except RecursionError:
        raise BadInput(f"{path}: not a safetensors file (header JSON nested too deeply)") from None
    except (UnicodeDecodeError, ValueError) as exc:   # JSONDecodeError is a ValueError; so is a duplicate key
        what = str(exc) if str(exc).startswith("duplicate key") else "header is not JSON"
        raise BadInput(f"{path}: not a safetensors file ({what})") from None
    if not isinstance(header, dict):
        raise BadInput(f"{path}: not a safetensors file (header is not an object)")
    meta = header.pop("__metadata__", None) or {}
    return header, meta, 8 + n


_ITEMSIZE = {"BF16": 2, **{k: np.dtype(v).itemsize for k, v in _NP_DTYPES.items()}}


def index_safetensors(path: str | os.PathLike) -> tuple[dict[str, tuple[str, list[int], int, int]], int]:
    """name -> (dtype code, shape, byte offset in the file, byte length), and the file size.

    The header is checked as the format defines it before any tensor is read: every entry well-formed, each
    tensor's byte range exactly its shape x dtype size, the ranges tiling the data section with no gap, overlap
    or trailing bytes. Anything else (a truncated file, a flipped header byte, a huge declared shape) is bad
    input, never a tensor read from the wrong bytes."""
    path = Path(path)
    header, _meta, start = read_safetensors_header(path)
    size = path.stat().st_size
    entries = []
    for name, e in header.items():
        try:
            st, shape, offsets = e["dtype"], e["shape"], e["data_offsets"]
            if not (isinstance(shape, list) and all(type(x) is int and x >= 0 for x in shape)):
                raise ValueError
            lo, hi = offsets
            if type(lo) is not int or type(hi) is not int or not 0 <= lo <= hi:
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise BadInput(f"{path}: tensor {name!r} has a malformed header entry") from None
        if st not in _ITEMSIZE:
            raise BadInput(f"{path}: tensor {name!r} has dtype {st}, which this reader does not know")
        nbytes = math.prod(shape) * _ITEMSIZE[st]
        if hi - lo != nbytes:
            raise BadInput(f"{path}: tensor {name!r} has shape {shape} {st} ({nbytes} bytes) but its data "
                           f"offsets span {hi - lo} bytes")
        entries.append((lo, hi, name, st, shape))
    pos = 0
    for lo, hi, name, *_ in sorted(entries):
        if lo != pos:
            raise BadInput(f"{path}: tensor {name!r} starts at byte {lo} of the data, expected {pos} "
                           "(overlapping or missing bytes)")
        pos = hi
    beyond = [name for lo, hi, name, *_ in sorted(entries) if start + hi > size]
    if beyond:
        raise BadInput(f"{path}: tensor {beyond[0]!r} lies outside the file (truncated?)")
    if start + pos != size:
        raise BadInput(f"{path}: the header describes {pos} bytes of data, the file holds {size - start} "
                       f"({'truncated' if start + pos > size else 'trailing bytes'})")
    return {name: (st, shape, start + lo, hi - lo) for lo, hi, name, st, shape in entries}, size


def _decode(raw: np.ndarray | bytes, st: str, shape: list[int]) -> tuple[np.ndarray, str]:
    """Stored bytes -> numpy (bfloat16 as exact float32), and the stored dtype's name."""
    if st == "BF16":
        return bfloat16_bits_to_float32(np.frombuffer(raw, dtype="<u2")).reshape(shape), "bfloat16"
    dt = np.dtype(_NP_DTYPES[st])
    a = np.frombuffer(raw, dtype=dt.newbyteorder("<"))
    return (a if a.dtype == dt else a.astype(dt)).reshape(shape), dt.name


def read_safetensors(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """name -> numpy array (bfloat16 as exact float32), and name -> stored dtype ("bfloat16", "float32", ...).
    The whole file, checked first (:func:`index_safetensors`); :class:`SafetensorsWeights` reads lazily."""
    path = Path(path)
    index, _size = index_safetensors(path)
    arrays, dtypes = {}, {}
    with open(path, "rb") as f:
        for name, (st, shape, off, n) in index.items():
            f.seek(off)
            raw = f.read(n)
            if len(raw) != n:   # pragma: no cover - the size check above
                raise BadInput(f"{path}: tensor {name!r} lies outside the file (truncated?)")
            a, dtypes[name] = _decode(raw, st, shape)
            arrays[name] = a.copy() if st != "BF16" else a
    return arrays, dtypes


class SafetensorsWeights:
    """One safetensors file, or a folder of them (MindFormers' unified safetensors, sharded files), read
    lazily: the headers are checked up front, each tensor is a view of the memory-mapped file taken when it is
    asked for, so a checkpoint larger than memory compares one parameter at a time."""

    sequential = False

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        files = sorted(self.path.glob("*.safetensors")) if self.path.is_dir() else [self.path]
        if not files:
            raise BadInput(f"{self.path}: no .safetensors files in this folder")
        self.kind = "safetensors" if len(files) == 1 and not self.path.is_dir() else \
            f"safetensors folder ({len(files)} files)"
        self._where: dict[str, tuple[Path, str, list[int], int, int]] = {}
        for f in files:
            index, _size = index_safetensors(f)
            for name, (st, shape, off, n) in index.items():
                if name in self._where:
                    raise BadInput(f"{f}: tensor {name!r} is also in {self._where[name][0].name}")
                self._where[name] = (f, st, shape, off, n)

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name][2])

    def dtype(self, name: str) -> str:
        st = self._where[name][1]
        return "bfloat16" if st == "BF16" else np.dtype(_NP_DTYPES[st]).name

    def get(self, name: str) -> np.ndarray:
        f, st, shape, off, n = self._where[name]
        if n == 0:
            return _decode(b"", st, shape)[0]
        # a map of this tensor's bytes alone: unmapped when the caller drops the array, so the pages read
        # do not pile up in the process (one map of the whole file would hold every page ever touched)
        return _decode(np.memmap(f, dtype=np.uint8, mode="r", offset=off, shape=(n,)), st, shape)[0]

    def close(self) -> None:
        pass
