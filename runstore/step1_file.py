"""The step-1 optimizer file (``evidence/optimizer_step1.npz``): step-1 gradients and the weights before
and after the first optimizer step, by baseline name. An ``.npz`` read without pickle, written atomically.
"""

from __future__ import annotations

import zipfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from core.errors import BadInput
from runstore.atomic import atomic_file


def read_step1_file(path: str | Path) -> dict[str, dict[str, np.ndarray]]:
    """A baseline's step-1 file (npz, no pickle) -> {"grad": {...}, "init": {...}, "weight": {...}}.

    Layout: keys ``grad/<name>`` (step-1 gradients), ``init/<name>`` (weights before the step) and
    ``weight/<name>`` (weights after it), baseline names, as the paired demo's Megatron side writes.
    """
    out: dict[str, dict[str, np.ndarray]] = {"grad": {}, "init": {}, "weight": {}}
    try:
        with np.load(path, allow_pickle=False) as z:
            for key in z.files:
                kind, _, name = key.partition("/")
                if kind in out and name:
                    arr = z[key]
                    if arr.dtype.kind not in "fiu" or arr.dtype.names is not None:
                        raise BadInput(f"{path}: key '{key}': dtype {arr.dtype} is not a number type")
                    out[kind][name] = arr
    except BadInput:
        raise
    except AttributeError:   # np.load gave a plain array (an .npy file), which has no keys
        raise BadInput(f"{path}: an .npy array, expected the step-1 .npz archive") from None
    except (OSError, ValueError, EOFError, KeyError, TypeError, zipfile.BadZipFile) as exc:
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
