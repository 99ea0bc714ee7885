"""The seed's batch layout, ``step_N/rank_R/{tokens,labels,loss_mask,attention_mask}.npy``: what MindFormers
users replay. ``RunWriter.write_seed_batch`` writes it; this module reads it (no pickle).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np

from core.errors import BadInput
from runstore.layout import _SEED_RANK_RE, _STEP_RE, SEED_BATCH_KEYS
from runstore.schema import regular_file


def load_npy(path: Path) -> np.ndarray:
    """np.load without pickle; a one-line BadInput for anything that is not a plain numeric .npy array."""
    regular_file(path, ".npy file")
    try:
        arr = np.load(path, allow_pickle=False)
        if not isinstance(arr, np.ndarray):
            raise BadInput(f"{path}: an .npz archive, expected one .npy array")
        if arr.dtype.kind not in "biuf" or arr.dtype.names is not None:
            raise BadInput(f"{path}: dtype {arr.dtype} is not a number type (int, uint, float or bool)")
        return arr
    except ValueError as exc:
        if "pickle" in str(exc).lower():
            raise BadInput(f"{path}: holds pickled objects; refusing to load (no pickle)") from None
        raise BadInput(f"{path}: not a valid .npy array ({exc})") from None
    except (OSError, EOFError, TypeError, SyntaxError, MemoryError) as exc:
        raise BadInput(f"{path}: unreadable or truncated .npy ({' '.join(str(exc).split())[:80]})") from None


def seed_steps(root: Path) -> dict[int, dict[int, Path]]:
    """Map step -> rank -> folder for the seed layout under ``root``."""
    out: dict[int, dict[int, Path]] = {}
    for d in Path(root).iterdir():
        m = _STEP_RE.match(d.name)
        if not m or not d.is_dir():
            continue
        for r in d.iterdir():
            mm = _SEED_RANK_RE.match(r.name)
            if mm and r.is_dir():
                out.setdefault(int(m.group(1)), {})[int(mm.group(1))] = r
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
        if not path.is_file():
            raise BadInput(f"{path}: missing")
        out[key] = load_npy(path)
    return out
