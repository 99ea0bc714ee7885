"""PyTorch tensor files (msprobe's dump_tensor_data/*.pt) -> numpy, for the layer-tensor comparator.

torch is imported inside the reader, so importing this module costs nothing and a user without torch only
loses the .pt rows' full-tensor compare (they still compare by msprobe's statistics). Files are loaded with
``weights_only=True`` (no pickle code runs) and memory-mapped, so only the pages the compare touches are read.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

from core.errors import BadInput
from runstore.schema import regular_file


def read_pt(path: str | Path) -> np.ndarray:
    """One tensor saved by torch.save (msprobe writes one per file) as a numpy array (bfloat16 -> float32)."""
    try:
        import torch
    except ImportError:
        raise BadInput(f"{path}: reading .pt tensor files needs torch (pip install 'xf-align[torch]')") from None
    regular_file(path, ".pt tensor file")
    try:
        with warnings.catch_warnings():   # a warning torch prints for a bad file would precede the one line
            warnings.simplefilter("ignore")
            obj = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - torch raises many types for a bad file; one line names it
        raise BadInput(f"{path}: not a loadable tensor file ({exc.__class__.__name__})") from None
    if not isinstance(obj, torch.Tensor):
        raise BadInput(f"{path}: holds a {type(obj).__name__}, not one tensor")
    t = obj.detach()
    if t.dtype in (torch.bfloat16, torch.float16):     # numpy has no bfloat16
        t = t.float()
    return t.contiguous().numpy()


READERS = {".pt": read_pt, ".pth": read_pt}
