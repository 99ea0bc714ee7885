"""The step-1 optimizer file (``evidence/optimizer_step1.npz``): step-1 gradients and the weights before
and after the first optimizer step, by baseline name. An ``.npz`` read without pickle, written atomically.

A distributed run writes one shard per rank instead, ``evidence/optimizer_step1/rank_R.npz``: flat slices
``grad/``, ``init/``, ``weight/`` of what the rank owns, ``shard/<name>`` = [start, end, TP partition dim
(-1: duplicated), TP rank, TP size, gated fc1] (the slice's offsets in the rank's flattened tensor),
``shape/<name>`` (that tensor's shape) and ``world`` = [rank, world size]. :func:`read_step1_file` merges
them into the same whole named tensors: the DP ranks' ranges of a distributed optimizer laid end to end,
then the TP shards joined on their partition dim (a gated fc1's [gate_r; up_r] as [gate; up] of the whole).
A range no rank recorded, or a rank file missing, is a one-line BadInput: never a partial tensor.
"""

from __future__ import annotations

import math
import re
import zipfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from core.errors import BadInput
from runstore.atomic import atomic_file
from runstore.layout import EVIDENCE_DIR, OPTIMIZER_EVIDENCE, OPTIMIZER_EVIDENCE_SHARDS
from runstore.npzfile import open_npz

_SHARD_RE = re.compile(r"^rank_(\d{1,9})\.npz$")
_KINDS = ("grad", "init", "weight")


def evidence_path(run_dir: str | Path) -> Path | None:
    """A run store's optimizer evidence: the one-process file, else the folder of per-rank shards."""
    base = Path(run_dir) / EVIDENCE_DIR
    one = base / OPTIMIZER_EVIDENCE
    if one.exists() or one.is_symlink():      # a FIFO, a device or a folder there: open_npz refuses it
        return one
    shards = base / OPTIMIZER_EVIDENCE_SHARDS
    return shards if shards.is_dir() and any(shards.glob("rank_*.npz")) else None


def shard_file(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / EVIDENCE_DIR / OPTIMIZER_EVIDENCE_SHARDS / f"rank_{int(rank):05d}.npz"


def read_step1_file(path: str | Path) -> dict[str, dict[str, np.ndarray]]:
    """A baseline's step-1 file (npz, no pickle) -> {"grad": {...}, "init": {...}, "weight": {...}}.

    Layout: keys ``grad/<name>`` (step-1 gradients), ``init/<name>`` (weights before the step) and
    ``weight/<name>`` (weights after it), baseline names, as the paired demo's Megatron side writes.
    ``path`` may also be a run store or a folder of per-rank shards, merged into whole tensors.
    """
    p = Path(path)
    if p.is_dir():
        found = p if any(p.glob("rank_*.npz")) else evidence_path(p)
        if found is None:
            raise BadInput(f"{p}: no {EVIDENCE_DIR}/{OPTIMIZER_EVIDENCE} and no {EVIDENCE_DIR}/"
                           f"{OPTIMIZER_EVIDENCE_SHARDS}/rank_*.npz (the baseline's optimizer evidence)")
        if found.is_dir() and found.name != OPTIMIZER_EVIDENCE:
            return merge_step1_shards(found)
        path = found
    out: dict[str, dict[str, np.ndarray]] = {"grad": {}, "init": {}, "weight": {}}
    try:
        with open_npz(path, "step-1 .npz file") as z:
            for key in z.files:
                kind, _, name = key.partition("/")
                if kind in out and name:
                    arr = z[key]
                    if arr.dtype.kind not in "fiu" or arr.dtype.names is not None:
                        raise BadInput(f"{path}: key '{key}': dtype {arr.dtype} is not a number type")
                    out[kind][name] = arr
    except BadInput:
        raise
    except (OSError, ValueError, EOFError, KeyError, TypeError, zipfile.BadZipFile, MemoryError) as exc:
        raise BadInput(f"{path}: not a readable step-1 .npz file ({' '.join(str(exc).split())[:80]})") from None
    for name, g in out["grad"].items():
        for kind in ("init", "weight"):
            if name in out[kind] and out[kind][name].shape != g.shape:
                raise BadInput(f"{path}: key '{kind}/{name}': shape {out[kind][name].shape} differs from its "
                               f"gradient's {g.shape}")
    return out


def write_step1_file(path: str | Path, grads: Mapping[str, np.ndarray], before: Mapping[str, np.ndarray],
                     after: Mapping[str, np.ndarray]) -> None:
    """Write the step-1 file :func:`read_step1_file` reads (atomically: temporary name, then rename)."""
    arrays = {**{f"grad/{k}": np.asarray(v) for k, v in grads.items()},
              **{f"init/{k}": np.asarray(v) for k, v in before.items()},
              **{f"weight/{k}": np.asarray(v) for k, v in after.items()}}
    with atomic_file(Path(path)) as fh:
        np.savez(fh, **arrays)


def write_step1_shard(path: str | Path, grads: Mapping[str, np.ndarray], before: Mapping[str, np.ndarray],
                      after: Mapping[str, np.ndarray], shard: Mapping[str, np.ndarray],
                      shape: Mapping[str, np.ndarray], *, rank: int, world: int) -> None:
    """Rank ``rank``'s shard (flat slices and where they sit), atomically; see the module docstring."""
    p = Path(path)
    arrays = {**{f"grad/{k}": np.asarray(v).reshape(-1) for k, v in grads.items()},
              **{f"init/{k}": np.asarray(v).reshape(-1) for k, v in before.items()},
              **{f"weight/{k}": np.asarray(v).reshape(-1) for k, v in after.items()},
              **{f"shard/{k}": np.asarray(v, dtype=np.int64) for k, v in shard.items()},
              **{f"shape/{k}": np.asarray(v, dtype=np.int64) for k, v in shape.items()},
              "world": np.array([rank, world], dtype=np.int64)}
    p.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(p) as fh:
        np.savez(fh, **arrays)


def _load_shard(path: Path) -> dict[str, np.ndarray]:
    try:
        with open_npz(path, "step-1 shard") as z:
            out = {k: z[k] for k in z.files}
    except BadInput:
        raise
    except (OSError, ValueError, EOFError, KeyError, TypeError, zipfile.BadZipFile, MemoryError) as exc:
        raise BadInput(f"{path}: not a readable step-1 shard ({' '.join(str(exc).split())[:80]})") from None
    for k, v in out.items():
        if v.dtype.kind not in "fiu" or v.dtype.names is not None:
            raise BadInput(f"{path}: key '{k}': dtype {v.dtype} is not a number type")
    return out


def merge_step1_shards(folder: str | Path) -> dict[str, dict[str, np.ndarray]]:
    """Whole named tensors from the per-rank shards in ``folder`` (see the module docstring)."""
    folder = Path(folder)
    files = sorted((int(m.group(1)), f) for f in folder.iterdir() if (m := _SHARD_RE.match(f.name)))
    if not files:
        raise BadInput(f"{folder}: no rank_*.npz optimizer-evidence shards")
    # name -> tp rank -> [(start, end, {kind: slice}, file)]; name -> (dim, tp, gated, local shape)
    parts: dict[str, dict[int, list[tuple[int, int, dict[str, np.ndarray], Path, tuple[int, ...]]]]] = {}
    layout: dict[str, tuple[int, int, int, tuple[int, ...]]] = {}
    worlds: set[int] = set()
    for rank, f in files:
        z = _load_shard(f)
        w = z.get("world")
        if w is None or w.shape != (2,) or int(w[0]) != rank:
            raise BadInput(f"{f}: key 'world': expected [rank {rank}, world size]")
        worlds.add(int(w[1]))
        for key, row in z.items():
            if not key.startswith("shard/"):
                continue
            name = key[len("shard/"):]
            if row.shape != (6,) or f"shape/{name}" not in z:
                raise BadInput(f"{f}: key '{key}': expected [start, end, dim, tp_rank, tp_size, gated] "
                               "and a shape/ entry")
            start, end, dim, tp_rank, tp, gated = (int(v) for v in row)
            shape = tuple(int(v) for v in z[f"shape/{name}"])
            numel = math.prod(shape)
            if not (0 <= start < end <= numel) or not (0 <= tp_rank < tp):
                raise BadInput(f"{f}: {name}: slice [{start}, {end}) of TP rank {tp_rank}/{tp} does not fit "
                               f"its shape {shape}")
            got = {}
            for kind in _KINDS:
                arr = z.get(f"{kind}/{name}")
                if arr is None or arr.size != end - start:
                    raise BadInput(f"{f}: key '{kind}/{name}': expected {end - start} values "
                                   f"(slice [{start}, {end}))")
                got[kind] = arr.reshape(-1)
            if layout.setdefault(name, (dim, tp, gated, shape))[:3] != (dim, tp, gated) or \
                    (dim < 0 and layout[name][3] != shape):
                raise BadInput(f"{f}: {name}: layout {(dim, tp, gated, shape)} differs from another rank's "
                               f"{layout[name]}")
            parts.setdefault(name, {}).setdefault(tp_rank, []).append((start, end, got, f, shape))
    if len(worlds) != 1:
        raise BadInput(f"{folder}: shards from runs of different world sizes {sorted(worlds)}")
    world = worlds.pop()
    missing = sorted(set(range(world)) - {r for r, _ in files})
    if missing:
        raise BadInput(f"{folder}: no shard of rank(s) {missing[:8]} of {world} (each rank writes its own)")
    out: dict[str, dict[str, np.ndarray]] = {k: {} for k in _KINDS}
    for name in sorted(parts):
        dim, tp, gated, _ = layout[name]
        ranks = sorted(parts[name]) if dim >= 0 else [min(parts[name])]
        if dim >= 0 and ranks != list(range(tp)):
            raise BadInput(f"{folder}: {name}: TP shard(s) {sorted(set(range(tp)) - set(ranks))} of {tp} "
                           "recorded by no rank")
        local: dict[str, list[np.ndarray]] = {k: [] for k in _KINDS}
        for tr in ranks:
            pieces = sorted(parts[name][tr], key=lambda x: x[0])
            shape = pieces[0][4]
            pos = 0
            for start, end, _, f, other in pieces:
                if other != shape:
                    raise BadInput(f"{f}: {name} (TP rank {tr}): shape {other} differs from another rank's {shape}")
                if start != pos:
                    what = "recorded twice" if start < pos else "recorded by no rank"
                    raise BadInput(f"{folder}: {name} (TP rank {tr}): elements [{min(start, pos)}, "
                                   f"{max(start, pos)}) {what} (next slice from {f.name})")
                pos = end
            if pos != math.prod(shape):
                raise BadInput(f"{folder}: {name} (TP rank {tr}): elements [{pos}, {math.prod(shape)}) recorded "
                               "by no rank (a distributed-optimizer shard missing?)")
            for kind in _KINDS:
                local[kind].append(np.concatenate([x[2][kind] for x in pieces]).reshape(shape))
        for kind in _KINDS:
            out[kind][name] = _join_tp(local[kind], dim, bool(gated))
    return out


def _join_tp(shards: list[np.ndarray], dim: int, gated: bool) -> np.ndarray:
    if dim < 0 or len(shards) == 1:
        return shards[0]
    if gated:   # each TP rank holds [gate_r; up_r]: the whole is [gate; up]
        halves = [np.split(s, 2, axis=0) for s in shards]
        return np.concatenate([h[0] for h in halves] + [h[1] for h in halves], axis=0)
    return np.concatenate(shards, axis=dim)
