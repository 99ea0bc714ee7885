"""Megatron checkpoints as users have them -> one TP=1, PP=1 megatron-core state_dict (name -> numpy).

Two on-disk formats, both read without an unrestricted unpickle:

* ``torch_dist`` (Megatron's default, torch.distributed.checkpoint): a folder with ``.metadata`` and
  ``__R_I.distcp`` shards. Names are the checkpoint's own: the local spec's norms are stored under the TE
  names (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``), which the mappings know.
  Tensors are stored whole-global (TP shards, the gated fc1 halves and the layers, stacked on a leading
  axis, are offsets of one global tensor), so reading the global tensors *is* the TP merge. The
  ``.metadata`` file is a pickle: it is read by an unpickler that admits only the checkpoint metadata
  classes, ``torch.Size`` and dtype/layout constants; tensor bytes go through
  ``torch.load(weights_only=True)`` (torch's own reader).
* legacy ``torch``: ``[iter_N/]mp_rank_TT[_PPP[_EEE]]/model_optim_rng.pt``, one file per TP / PP / EP rank,
  holding a pickled ``argparse.Namespace`` (``args``) next to the weights. It is loaded with
  ``weights_only=True`` plus an explicit allow-list (Namespace, numpy arrays for the RNG state, Megatron's
  own enums); a file needing anything else is refused with one line naming the class. Shards are merged:
  TP by each parameter's partition dim (gated fc1 as [gate; up] of the whole), PP by renumbering stage-local
  layers, EP by renumbering local experts.

torch is imported inside the functions (align/ stays importable with numpy alone).
"""

from __future__ import annotations

import importlib
import io
import pickle
import re
import warnings
import zipfile
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from core.errors import BadInput
from runstore.schema import read_bytes, regular_file

LEGACY_FILE = "model_optim_rng.pt"
_MP_DIR = re.compile(r"^mp_rank_(\d+)(?:_(\d+))?(?:_(\d+))?$")
_LAYER = re.compile(r"^(.*?decoder\.layers)\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^(.*\.local_experts)\.(\d+)\.(.*)$")
# Column-parallel weights split dim 0, row-parallel dim 1 (megatron-core local and TE spec names).
_TP_DIM = [
    (re.compile(r"(^|\.)(linear_qkv|linear_fc1|linear_q_proj|linear_q_up_proj|linear_kv_up_proj)"
                r"\.(weight|bias)$"), 0),
    (re.compile(r"(^|\.)(word_embeddings|output_layer)\.weight$"), 0),
    (re.compile(r"(^|\.)(linear_proj|linear_fc2)\.weight$"), 1),
]

# torch.distributed.checkpoint metadata: exactly the classes a Megatron torch_dist .metadata holds (measured:
# torch 2.x DCP saves and megatron-core's torch_dist strategy, tests/test_megatron_layouts.py). Named one by
# one: admitting whole modules would admit what they import too (``torch.distributed.checkpoint.filesystem.os``).
_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                              "TensorStorageMetadata", "ChunkStorageMetadata",
                                              "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    # Megatron's torch_dist strategy caches its save plans in the metadata (dataclasses and enums: data only)
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData",
                                             "BytesIOWriteData", "LoadPlan", "ReadItem", "LoadItemType"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},   # StorageMeta.checkpoint_id
}
_TORCH_NAMES = {"Size", "strided", "sparse_coo", "contiguous_format", "channels_last", "preserve_format",
                "float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool",
                "float8_e4m3fn", "float8_e5m2"}
_BUILTINS = {"set", "frozenset", "slice", "tuple", "list", "dict"}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only what torch.distributed.checkpoint writes into ``.metadata``."""

    def __init__(self, fh: Any, where: Path) -> None:
        super().__init__(fh)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        ok = name in _DCP_CLASSES.get(module, ()) or \
            (module == "torch" and name in _TORCH_NAMES) or (module == "builtins" and name in _BUILTINS) or \
            (module == "collections" and name == "OrderedDict") or \
            (module == "torch.serialization" and name == "_get_layout")  # layout name -> torch.layout
        if not ok:
            raise BadInput(f"{self.where}: checkpoint metadata holds {module}.{name}, outside the allow-list "
                           "of torch.distributed.checkpoint metadata; not loaded")
        return getattr(importlib.import_module(module), name)


def _dcp_reader(path: Path, parsed: Any = None) -> Any:
    """torch's FileSystemReader with ``.metadata`` read by the allow-list unpickler (``parsed``: a metadata
    object read before, reused so that loading tensor by tensor does not parse the file each time)."""
    from torch.distributed.checkpoint import FileSystemReader

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta

            if parsed is not None:
                metadata = parsed
            else:
                data = read_bytes(path / ".metadata", "torch_dist metadata file")
                metadata = _MetadataUnpickler(io.BytesIO(data), path / ".metadata").load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(path))


def is_torch_dist(path: str | Path) -> bool:
    return (Path(path) / ".metadata").exists()   # not is_file(): a FIFO / device there is refused when read


def _dcp_error_types() -> tuple[type[BaseException], ...]:
    """What a failed torch.distributed.checkpoint load raises: ordinary exceptions, and torch's
    CheckpointException, which derives from BaseException (``except Exception`` misses it)."""
    try:
        from torch.distributed.checkpoint.api import CheckpointException
    except ImportError:   # pragma: no cover - older torch
        return (Exception,)
    return (Exception, CheckpointException)


def _declared_tensors(root: Path, meta: Any) -> dict[str, tuple[tuple[int, ...], Any]]:
    """Model tensors the metadata declares (name -> (size, dtype)), each checked to be covered by its stored
    chunks (a gap would leave uninitialized memory in the result) and, together, to fit in the shards' bytes
    (a huge declared size is refused before anything is allocated)."""
    import torch
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    where = root / ".metadata"
    if not isinstance(meta, Metadata) or not isinstance(getattr(meta, "state_dict_metadata", None), dict):
        raise BadInput(f"{where}: not a torch.distributed.checkpoint metadata file")
    out: dict[str, tuple[tuple[int, ...], Any]] = {}
    total = 0
    for key, md in meta.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata) or str(key).startswith(("optimizer.", "rng_state")):
            continue
        if str(key).endswith("_extra_state") or ".optimizer." in str(key):
            continue
        try:
            size = tuple(int(x) for x in md.size)
            dtype = md.properties.dtype
            chunks = [(tuple(int(x) for x in c.offsets), tuple(int(x) for x in c.sizes)) for c in md.chunks]
        except (AttributeError, TypeError, ValueError):
            raise BadInput(f"{where}: tensor {key!r} has a malformed entry") from None
        if not isinstance(dtype, torch.dtype) or any(x < 0 for x in size):
            raise BadInput(f"{where}: tensor {key!r} has dtype {dtype!r} and size {list(size)}")
        numel = int(np.prod(size, dtype=object)) if size else 1
        covered = 0
        for off, sz in chunks:
            if len(off) != len(size) or len(sz) != len(size) or any(
                    o < 0 or n < 0 or o + n > d for o, n, d in zip(off, sz, size, strict=True)):
                raise BadInput(f"{where}: tensor {key!r} has a chunk outside its size {list(size)}")
            covered += int(np.prod(sz, dtype=object)) if sz else 1
        if covered != numel:
            raise BadInput(f"{where}: tensor {key!r} has chunks covering {covered} of its {numel} values")
        total += numel * dtype.itemsize
        out[str(key)] = (size, dtype)
    stored = sum(f.stat().st_size for f in root.glob("*.distcp"))
    if total > stored:
        raise BadInput(f"{where}: declares {total} bytes of tensors, more than the {stored} bytes of its "
                       ".distcp shards (truncated or missing shard?)")
    return out


def check_zip_crc(fh: Any, where: Path | str) -> None:
    """torch.save writes a zip archive with a CRC-32 per record, which torch.load does not check: a flipped
    byte in tensor data loads as a wrong value. Each record is read and checked here (records written
    without a CRC, ``torch.serialization.set_crc32_options(False)``, store 0 and are skipped)."""
    try:
        with zipfile.ZipFile(fh) as z:
            for info in z.infolist():
                if info.CRC == 0:
                    continue
                with z.open(info) as f:
                    while f.read(1 << 22):
                        pass
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError, NotImplementedError,
            zlib.error, RuntimeError) as exc:
        raise BadInput(f"{where}: damaged torch archive ({type(exc).__name__}: "
                       f"{' '.join(str(exc).split())[:200]})") from None


def _check_dcp_items(root: Path, meta: Any, declared: Mapping[str, Any]) -> None:
    """The CRC of each stored tensor record (a torch.save archive inside a ``.distcp`` file) of the model
    tensors about to be loaded; a missing or short shard is named."""
    storage = getattr(meta, "storage_data", None)
    if not isinstance(storage, dict):
        raise BadInput(f"{root / '.metadata'}: no storage index (not a torch_dist checkpoint)")
    for index, info in storage.items():
        if getattr(index, "fqn", None) not in declared:
            continue
        try:
            rel, offset, length = str(info.relative_path), int(info.offset), int(info.length)
        except (AttributeError, TypeError, ValueError):
            raise BadInput(f"{root / '.metadata'}: malformed storage entry for {index.fqn!r}") from None
        if getattr(info, "transform_descriptors", None):
            continue                     # stored through a transform (compression): torch checks it
        shard = root / rel
        if Path(rel).name != rel or not shard.exists():
            raise BadInput(f"{shard}: missing shard of the torch_dist checkpoint (holds {index.fqn!r})")
        regular_file(shard, "torch_dist shard")
        if offset < 0 or length <= 0 or offset + length > shard.stat().st_size:
            raise BadInput(f"{shard}: shorter than the metadata says (truncated?); {index.fqn!r} is not whole")
        with open(shard, "rb") as f:
            f.seek(offset)
            blob = f.read(length)
        if blob[:4] == b"PK\x03\x04":     # torch.save records (SerializationFormat.TORCH_SAVE)
            check_zip_crc(io.BytesIO(blob), shard)


def open_torch_dist(root: Path) -> tuple[Any, dict[str, tuple[tuple[int, ...], Any]]]:
    """The checked metadata of a ``torch_dist`` folder and its declared model tensors (key -> (size, dtype)):
    every stored record of those tensors CRC-checked, so a damaged shard is refused before anything loads."""
    reader = _dcp_reader(root)
    errors = _dcp_error_types()
    try:
        meta = reader.read_metadata()
    except BadInput:
        raise
    except RecursionError:
        raise BadInput(f"{root / '.metadata'}: not a torch.distributed.checkpoint metadata file "
                       "(nested too deeply)") from None
    except errors as exc:
        raise BadInput(f"{root / '.metadata'}: not a torch.distributed.checkpoint metadata file "
                       f"({type(exc).__name__})") from None
    declared = _declared_tensors(root, meta)
    if not declared:
        raise BadInput(f"{root}: torch_dist checkpoint holds no model tensors")
    _check_dcp_items(root, meta, declared)
    return meta, declared


def load_torch_dist_keys(root: Path, meta: Any, declared: Mapping[str, tuple[tuple[int, ...], Any]],
                         keys: list[str]) -> dict[str, Any]:
    """The global tensors ``keys`` of a checked ``torch_dist`` folder (torch tensors, as stored)."""
    import torch
    from torch.distributed.checkpoint import load

    state: dict[str, Any] = {k: torch.empty(declared[k][0], dtype=declared[k][1]) for k in keys}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            load(state, storage_reader=_dcp_reader(root, meta), no_dist=True)
    except BadInput:
        raise
    except _dcp_error_types() as exc:
        raise BadInput(f"{root}: torch_dist shards unreadable ({_one_line(exc)})") from None
    for key, t in state.items():
        if tuple(t.shape) != declared[key][0] or t.dtype != declared[key][1]:
            raise BadInput(f"{root}: torch_dist tensor {key!r} came back as {list(t.shape)} {t.dtype}, "
                           f"its metadata says {list(declared[key][0])} {declared[key][1]}")
    return state


def _to_numpy(t: Any) -> np.ndarray:
    import torch

    return (t.float() if t.dtype == torch.bfloat16 else t).numpy().copy()


def read_torch_dist(path: str | Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Global model tensors of a ``torch_dist`` checkpoint folder, unstacked to per-layer names."""
    root = Path(path)
    meta, declared = open_torch_dist(root)
    state = load_torch_dist_keys(root, meta, declared, list(declared))
    out: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}
    for key, t in state.items():
        for name, part in _unstack(key, t):
            dtypes[name] = str(part.dtype).replace("torch.", "")
            out[name] = _to_numpy(part)
    return out, dtypes


def _one_line(exc: BaseException, limit: int = 300) -> str:
    """An exception as one short line (torch's CheckpointException prints a traceback per rank: the first
    rank's own exception is named instead)."""
    inner: Any = exc
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        inner = first[0] if isinstance(first, tuple) and first else first
    text = " ".join(str(inner).split())
    return f"{type(inner).__name__}: {text[:limit]}"


def _unstacked_names(key: str, size: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """Per-layer names of a stored key and the index into it: ``decoder.layers.X`` (layers on a leading
    axis) -> ``decoder.layers.{i}.X``; SequentialMLP experts (``...experts.experts.Y``, experts on the next
    axis) -> ``...experts.local_experts.{j}.Y``."""
    m = re.match(r"^(.*?decoder\.layers)\.(?!\d+\.)(.*)$", key)
    if not m or not size:
        return [(key, ())]
    out: list[tuple[str, tuple[int, ...]]] = []
    for i in range(size[0]):
        name = f"{m.group(1)}.{i}.{m.group(2)}"
        e = re.match(r"^(.*\.experts)\.experts\.(.*)$", name)
        if e and len(size) > 1:
            out.extend((f"{e.group(1)}.local_experts.{j}.{e.group(2)}", (i, j)) for j in range(size[1]))
        else:
            out.append((name, (i,)))
    return out


def _unstack(key: str, t: Any) -> list[tuple[str, Any]]:
    return [(name, t[idx] if idx else t) for name, idx in _unstacked_names(key, tuple(t.shape))]


class TorchDistWeights:
    """A ``torch_dist`` checkpoint read lazily: the metadata (and every stored record's CRC) checked up
    front, then one stored key at a time (a key holds every layer of one parameter, stacked) when one of its
    per-layer names is asked for; the last key stays loaded, so reading in :meth:`names` order loads
    each key once."""

    sequential = True
    kind = "megatron torch_dist"

    def __init__(self, root: str | Path) -> None:
        self.path = Path(root)
        self._meta, self._declared = open_torch_dist(self.path)
        self._where: dict[str, tuple[str, tuple[int, ...]]] = {}
        for key, (size, _dtype) in self._declared.items():
            for name, idx in _unstacked_names(key, size):
                self._where[name] = (key, idx)
        self._cache: dict[str, Any] = {}

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        key, idx = self._where[name]
        return self._declared[key][0][len(idx):]

    def dtype(self, name: str) -> str:
        return str(self._declared[self._where[name][0]][1]).replace("torch.", "")

    def get(self, name: str) -> np.ndarray:
        key, idx = self._where[name]
        t = self._cache.get(key)
        if t is None:
            t = load_torch_dist_keys(self.path, self._meta, self._declared, [key])[key]
            while self._cache:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = t
        return _to_numpy(t[idx] if idx else t)

    def close(self) -> None:
        self._cache.clear()


# -- legacy torch format -------------------------------------------------------------------------------------

_ALLOWED_GLOBAL_PREFIXES = ("argparse.Namespace", "numpy.core.multiarray._reconstruct",
                            "numpy._core.multiarray._reconstruct", "numpy.ndarray", "numpy.dtype",
                            "numpy.dtypes.", "megatron.core.enums.", "megatron.core.transformer.enums.",
                            "megatron.training.enums.", "torch.",
                            # Megatron-LM >= 0.12 saves its rerun state machine's enums (plain Enum members)
                            "megatron.core.rerun_state_machine.RerunDiagnostic",
                            "megatron.core.rerun_state_machine.RerunMode",
                            "megatron.core.rerun_state_machine.RerunState",
                            "megatron.core.rerun_state_machine.RerunValidationStatus")


def _resolve(qualname: str) -> Any:
    module, _, name = qualname.rpartition(".")
    return getattr(importlib.import_module(module), name)


def load_legacy_file(path: str | Path, *, mmap: bool = False) -> dict[str, Any]:
    """One ``model_optim_rng.pt`` with ``weights_only=True`` and the explicit allow-list above (``mmap``:
    tensors stay in the memory-mapped file until read)."""
    import torch
    import torch.serialization as ser

    p = regular_file(path, "torch checkpoint")     # a FIFO would block is_zipfile, a device never ends
    if zipfile.is_zipfile(p):
        check_zip_crc(p, p)
    try:
        unsafe = ser.get_unsafe_globals_in_checkpoint(str(p))
    except Exception as exc:  # noqa: BLE001
        raise BadInput(f"{p}: not a torch checkpoint ({type(exc).__name__})") from None
    refused = [g for g in unsafe if not g.startswith(_ALLOWED_GLOBAL_PREFIXES)]
    if refused:
        raise BadInput(f"{p}: holds {', '.join(refused[:3])}, outside the allow-list for a safe load; "
                       "save the model state_dict alone (torch.save(model.state_dict(), ...))")
    try:
        with ser.safe_globals([_resolve(g) for g in unsafe]):
            with warnings.catch_warnings():   # a warning torch prints for a bad file would precede the one line
                warnings.simplefilter("ignore")
                obj = torch.load(str(p), map_location="cpu", weights_only=True, mmap=mmap)
    except BadInput:
        raise
    except Exception as exc:  # noqa: BLE001
        raise BadInput(f"{p}: not loadable with weights_only=True ({type(exc).__name__})") from None
    if not isinstance(obj, dict):
        raise BadInput(f"{p}: expected a dict with 'model', got {type(obj).__name__}")
    return obj


def _legacy_files(root: Path) -> list[tuple[tuple[int, int, int], Path]]:
    out: list[tuple[tuple[int, int, int], Path]] = []
    if not root.is_dir():
        return out
    for d in sorted(root.iterdir()):
        m = _MP_DIR.match(d.name)
        if m and (d / LEGACY_FILE).exists():      # a FIFO / device is refused when read, not skipped
            out.append(((int(m.group(1)), int(m.group(2) or 0), int(m.group(3) or 0)), d / LEGACY_FILE))
    return out


def _latest_iteration_dir(root: Path) -> Path | None:
    """``iter_NNNNNNN`` (or ``release``) named by Megatron's ``latest_checkpointed_iteration.txt``; None
    without that file. A file holding anything else (``abc``, ``-1``, binary bytes) is bad input."""
    latest = root / "latest_checkpointed_iteration.txt"
    if not (latest.exists() or latest.is_symlink()):
        return None
    if regular_file(latest, "iteration file").stat().st_size > 64:
        raise BadInput(f"{latest}: expected an iteration number or 'release', got a file of "
                       f"{latest.stat().st_size} bytes")
    raw = read_bytes(latest, "iteration file")
    try:
        text = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        text = None
    if text == "release":
        if not (root / "release").is_dir():
            raise BadInput(f"{latest}: names 'release', but {root / 'release'} is not there")
        return root / "release"
    if text is None or not text.isdigit() or not text.isascii():
        raise BadInput(f"{latest}: expected an iteration number or 'release', got {raw[:20]!r}")
    cand = root / f"iter_{int(text):07d}"
    if not cand.is_dir():
        raise BadInput(f"{latest}: names iteration {int(text)}, but {cand.name} is not in {root}")
    return cand


def find_legacy_root(path: str | Path) -> Path | None:
    """The folder holding ``mp_rank_*`` (the path itself, or the newest ``iter_*`` inside it)."""
    p = Path(path)
    if _legacy_files(p):
        return p
    cand = _latest_iteration_dir(p)
    if cand is not None and _legacy_files(cand):
        return cand
    iters = sorted(d for d in p.glob("iter_*") if d.is_dir() and _legacy_files(d))
    return iters[-1] if iters else None


def _tp_dim(name: str) -> int:
    for pat, dim in _TP_DIM:
        if pat.search(name):
            return dim
    return -1


def _model_chunks(obj: Mapping[str, Any], where: Path) -> list[dict[str, Any]]:
    if isinstance(obj.get("model"), Mapping):
        return [dict(obj["model"])]
    chunks = [dict(obj[k]) for k in sorted((k for k in obj if re.fullmatch(r"model\d+", str(k))),
                                           key=lambda k: int(k[5:]))]
    if not chunks:
        raise BadInput(f"{where}: no 'model' state_dict inside")
    return chunks


def _n_layers(sd: Mapping[str, Any]) -> int:
    return len({m.group(2) for k in sd for m in [_LAYER.match(k)] if m})


def _legacy_index(path: str | Path, gated_fc1: bool | None, mmap: bool = False
                  ) -> tuple[Path, int, bool, dict[str, list[tuple[int, Any]]]]:
    """Every ``mp_rank_*`` file loaded (``mmap``: tensors left in the files) and its tensors renamed to
    global layers and experts: (folder, TP size, gated fc1, global name -> [(TP rank, shard), ...])."""
    import torch

    root = find_legacy_root(path)
    if root is None:
        raise BadInput(f"{path}: no mp_rank_XX[_YYY]/{LEGACY_FILE} files (legacy Megatron checkpoint)")
    files = _legacy_files(root)
    tp = max(k[0] for k, _ in files) + 1
    pp = max(k[1] for k, _ in files) + 1
    ep = max(k[2] for k, _ in files) + 1
    have = {k for k, _ in files}
    absent = [(t, s, e) for t in range(tp) for s in range(pp) for e in range(ep) if (t, s, e) not in have]
    if absent:
        t, s, e = absent[0]
        raise BadInput(f"{root}: {len(absent)} rank file(s) missing, e.g. the one for TP rank {t}, PP rank {s}, "
                       f"EP rank {e} ({tp} x {pp} x {ep} expected from the mp_rank_* folders)")
    loaded: dict[tuple[int, int, int], list[dict[str, Any]]] = {}
    for key, f in files:
        obj = load_legacy_file(f, mmap=mmap)
        args = obj.get("args")
        if gated_fc1 is None and args is not None:
            gated_fc1 = bool(getattr(args, "swiglu", False))
        # the sizes the run saved with: a missing highest rank would otherwise look like a smaller TP / PP
        for what, found in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp)):
            said = getattr(args, what, None) if args is not None else None
            # (PP: only where the names carry a PP rank; with PP=1 and EP>1 the second number is the EP rank)
            if isinstance(said, int) and said > 1 and said != found or (what[0] == "t" and said == 1 and found > 1):
                raise BadInput(f"{f}: its args say {what}={said}, the folder holds rank files for {found} "
                               "(missing rank files?)")
        loaded[key] = [{str(k): v for k, v in c.items() if isinstance(v, torch.Tensor) and "_extra_state" not in str(k)}
                       for c in _model_chunks(obj, f)]
    n_chunks = len(next(iter(loaded.values())))
    if any(len(c) != n_chunks for c in loaded.values()):
        raise BadInput(f"{root}: rank files hold different numbers of model chunks")
    # layers per (pp stage, chunk): from the first TP/EP rank of each stage; global offset in
    # Megatron's interleaved order (chunk-major, then stage)
    per = [[_n_layers(loaded[(0, s, 0)][c]) for c in range(n_chunks)] for s in range(pp)]
    offsets: dict[tuple[int, int], int] = {}
    acc = 0
    for c in range(n_chunks):
        for s in range(pp):
            offsets[(s, c)] = acc
            acc += per[s][c]
    merged: dict[str, list[tuple[int, Any]]] = {}
    for (t, s, e), chunks in loaded.items():
        for c, sd in enumerate(chunks):
            n_local = len({m.group(2) for k in sd for m in [_EXPERT.match(k)] if m})
            for k, v in sd.items():
                name = k
                m = _LAYER.match(name)
                if m:
                    name = f"{m.group(1)}.{int(m.group(2)) + offsets[(s, c)]}.{m.group(3)}"
                m = _EXPERT.match(name)
                if m and n_local:
                    name = f"{m.group(1)}.{int(m.group(2)) + e * n_local}.{m.group(3)}"
                merged.setdefault(name, []).append((t, v))
    return root, tp, bool(gated_fc1), merged


def _merge_legacy(root: Path, name: str, parts: list[tuple[int, Any]], tp: int, gated_fc1: bool) -> Any:
    """One parameter's TP shards -> the whole tensor (gated fc1 as [gate; up] of the whole)."""
    import torch

    by_rank: dict[int, Any] = {}
    for t, v in sorted(parts, key=lambda x: x[0]):   # EP ranks repeat the non-expert tensors: one per TP
        if t in by_rank and tuple(by_rank[t].shape) != tuple(v.shape):
            raise BadInput(f"{root}: {name} differs in shape between the EP ranks of TP rank {t}")
        by_rank.setdefault(t, v)
    ranks, shards = list(by_rank), list(by_rank.values())
    dim = _tp_dim(name) if tp > 1 else -1
    if dim >= 0 and ranks != list(range(tp)):
        raise BadInput(f"{root}: {name} is in TP ranks {sorted(set(ranks))}, not in each of the {tp} "
                       "(a tensor split over TP needs every shard)")
    if dim < 0:
        if any(tuple(p.shape) != tuple(shards[0].shape) or p.dtype != shards[0].dtype for p in shards[1:]):
            raise BadInput(f"{root}: {name} differs in shape or dtype between ranks, yet is not split over TP")
        return shards[0]
    shapes = [tuple(p.shape) for p in shards]
    if any(len(sh) <= dim or sh[:dim] + sh[dim + 1:] != shapes[0][:dim] + shapes[0][dim + 1:]
           for sh in shapes) or len({p.dtype for p in shards}) != 1:
        raise BadInput(f"{root}: TP shards of {name} do not fit together on dim {dim}: {shapes}")
    if gated_fc1 and re.search(r"(^|\.)linear_fc1\.(weight|bias)$", name):
        if any(sh[0] % 2 for sh in shapes):
            raise BadInput(f"{root}: TP shards of gated {name} have an odd number of rows: {shapes}")
        halves = [p.chunk(2, dim=0) for p in shards]   # each TP shard is [gate_r; up_r]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=dim)


def read_legacy(path: str | Path, *, gated_fc1: bool | None = None
                ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Merge every ``mp_rank_*`` file into one TP=1 / PP=1 / global-expert state_dict."""
    root, tp, gated, merged = _legacy_index(path, gated_fc1)
    out: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}
    for name, parts in merged.items():
        full = _merge_legacy(root, name, parts, tp, gated)
        dtypes[name] = str(full.dtype).replace("torch.", "")
        out[name] = _to_numpy(full)
    return out, dtypes


class LegacyWeights:
    """A legacy ``torch`` Megatron checkpoint read lazily: every rank file CRC-checked and loaded
    memory-mapped up front (names, shapes and the allow-list check), each parameter's TP shards read and
    merged when it is asked for."""

    sequential = False
    kind = "megatron legacy (torch)"

    def __init__(self, path: str | Path, *, gated_fc1: bool | None = None) -> None:
        self.path = Path(path)
        self._root, self._tp, self._gated, self._merged = _legacy_index(path, gated_fc1, mmap=True)
        #: name -> rel L2 of the most different TP rank's copy of a replicated parameter (filled as read)
        self.replica_differences: dict[str, float] = {}
        self._shape: dict[str, tuple[int, ...]] = {}
        for name, parts in self._merged.items():
            shape = list(parts[0][1].shape)
            dim = _tp_dim(name) if self._tp > 1 else -1
            if dim >= 0 and len(shape) > dim:
                shape[dim] = sum(int(v.shape[dim]) for t, v in {t: v for t, v in parts}.items())
            self._shape[name] = tuple(shape)

    def names(self) -> list[str]:
        return list(self._merged)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shape[name]

    def dtype(self, name: str) -> str:
        return str(self._merged[name][0][1].dtype).replace("torch.", "")

    def get(self, name: str) -> np.ndarray:
        parts = self._merged[name]
        full = _merge_legacy(self._root, name, parts, self._tp, self._gated)
        if self._tp > 1 and _tp_dim(name) < 0:     # a replicated parameter: every TP rank should hold the same
            copies: dict[int, Any] = {}
            for t, v in parts:
                copies.setdefault(t, v)
            ref = full.double()
            scale = max(float(ref.norm()), 1e-30)
            self.replica_differences[name] = max(float((v.double() - ref).norm()) / scale for v in copies.values())
        return _to_numpy(full)

    def close(self) -> None:
        self._merged = {}


def read_megatron_checkpoint(path: str | Path, *, gated_fc1: bool | None = None
                             ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """A Megatron checkpoint folder (torch_dist or legacy, an ``iter_N`` or the save root) -> TP=1 numpy."""
    p = Path(path)
    if not p.is_dir():
        raise BadInput(f"{p}: not a checkpoint folder")
    if is_torch_dist(p):
        return read_torch_dist(p)
    cand = _latest_iteration_dir(p)
    if cand is not None and is_torch_dist(cand):
        return read_torch_dist(cand)
    return read_legacy(p, gated_fc1=gated_fc1)
