"""An .npy file whose header declares an object array, for tests that loaders refuse it.

Why not np.save of an object array (numpy pickles it): the refusal must come from the header alone, before any byte
of the payload is read, so the file needs no pickle in it at all (and the project writes none).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def write_object_npy(path: str | Path, shape: tuple[int, ...] = (1,)) -> Path:
    """A version-1.0 .npy header for dtype object, then bytes that are not a pickle."""
    p = Path(path)
    with open(p, "wb") as fh:
        np.lib.format.write_array_header_1_0(fh, {"descr": "|O", "fortran_order": False, "shape": shape})
        fh.write(b"not a pickle: a loader that gets here has already failed")
    return p
