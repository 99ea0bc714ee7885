"""The clipping probe's file: one side's gradient clipping, run on a gradient that must be clipped.

Why a probe: Adam's first update hardly depends on the gradient's scale (m / sqrt(v) is scale-free), so a
training step that clips and one that does not give step-1 updates ~0.3% apart, under the optimizer check's
lines. Clipping is checked on its own instead: the baseline's step-1 gradients, scaled so that their global
norm is :data:`PROBE_FACTOR` x the configured max (:func:`probe_scale`), go through each side's own clipping
code, and the clipped gradients are compared before any update (``comparators.optimizer_check.compare_clipping``).

Keys (an ``.npz``, numbers only, read without pickle): ``clipped/<name>`` the clipped probe gradient (the
writer's names: baseline names in the baseline's ``evidence/clip_probe.npz``, candidate names inside the
candidate's optimizer-check file) and ``clip/<key>`` scalars: ``scale`` (the factor the step-1 gradients were
multiplied by), ``max_norm`` (the max norm the clipping code was given; 0 = the side does not clip; NaN =
unknown), ``applied`` (1 when the side's step ran its clipping code, 0 when its rule skipped it) and
``returned_norm`` (the global norm that code computed; NaN when it did not run).
"""

from __future__ import annotations

import math
import zipfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from core.errors import BadInput
from runstore.atomic import atomic_file
from runstore.npzfile import open_npz

CLIP_PROBE = "clip_probe.npz"    # RUN/evidence/clip_probe.npz: the baseline's probe (one process)
PROBE_FACTOR = 10.0              # the probe's global norm, in units of the configured max norm
_SCALARS = ("scale", "max_norm", "applied", "returned_norm")


def probe_scale(grad_norm: float, max_norm: float | None, factor: float = PROBE_FACTOR) -> float:
    """The factor that makes a gradient of global norm ``grad_norm`` one of norm ``factor`` x ``max_norm``
    (x 1.0, the default max norm of Megatron-LM and MindFormers, when the side does not clip or it is unknown),
    so every clipping rule with a max up to ``factor`` x that must act on it."""
    if not (grad_norm > 0 and math.isfinite(grad_norm)):
        raise ValueError(f"cannot scale a gradient of global norm {grad_norm} into a clipping probe")
    target = factor * (max_norm if max_norm is not None and max_norm > 0 else 1.0)
    return float(target / grad_norm)


def write_clip_probe(path: str | Path, clipped: Mapping[str, np.ndarray], *, scale: float,
                     max_norm: float | None, applied: bool, returned_norm: float | None) -> Path:
    """Write a clipping probe file atomically (``clipped/<name>`` arrays and the ``clip/`` scalars)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(p) as fh:
        np.savez(fh, **probe_arrays(clipped, scale=scale, max_norm=max_norm, applied=applied,
                                    returned_norm=returned_norm))
    return p


def probe_arrays(clipped: Mapping[str, np.ndarray], *, scale: float, max_norm: float | None, applied: bool,
                 returned_norm: float | None) -> dict[str, np.ndarray]:
    """The probe's keys, for a writer that adds them to a file of its own (the candidate's optimizer check)."""
    nan = float("nan")
    return {**{f"clipped/{k}": np.asarray(v) for k, v in clipped.items()},
            "clip/scale": np.float64(scale), "clip/max_norm": np.float64(nan if max_norm is None else max_norm),
            "clip/applied": np.float64(1.0 if applied else 0.0),
            "clip/returned_norm": np.float64(nan if returned_norm is None else returned_norm)}


def read_clip_probe(path: str | Path) -> tuple[dict[str, np.ndarray], dict[str, float]] | None:
    """(clipped arrays by name, scalars) of a probe file, or of a file holding the probe's keys; None when
    the file has no probe (``clip/scale`` absent). A malformed file is a one-line BadInput."""
    p = Path(path)
    try:
        with open_npz(p, "clipping-probe .npz") as z:
            if "clip/scale" not in z.files:
                return None
            clipped: dict[str, np.ndarray] = {}
            scalars: dict[str, float] = {}
            for key in z.files:
                kind, _, name = key.partition("/")
                if kind not in ("clipped", "clip") or not name:
                    continue
                arr = z[key]
                if arr.dtype.kind not in "fiu" or arr.dtype.names is not None:
                    raise BadInput(f"{p}: key '{key}': dtype {arr.dtype} is not a number type")
                if kind == "clipped":
                    clipped[name] = arr
                elif name in _SCALARS:
                    if arr.size != 1:
                        raise BadInput(f"{p}: key '{key}': expected one number, got shape {arr.shape}")
                    scalars[name] = float(arr.reshape(-1)[0])
    except BadInput:
        raise
    except (OSError, ValueError, EOFError, KeyError, TypeError, AttributeError, zipfile.BadZipFile,
            MemoryError) as exc:
        raise BadInput(f"{p}: not a readable clipping-probe .npz ({' '.join(str(exc).split())[:80]})") from None
    missing = [k for k in _SCALARS if k not in scalars]
    if missing:
        raise BadInput(f"{p}: clipping probe without clip/{missing[0]}")
    if not (scalars["scale"] > 0 and math.isfinite(scalars["scale"])):
        raise BadInput(f"{p}: clip/scale is {scalars['scale']}, expected a positive number")
    return clipped, scalars
