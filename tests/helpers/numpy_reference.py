"""Framework-independent reference numbers the MindFormers tests check against."""

from __future__ import annotations

import numpy as np


def numpy_masked_ce(logits: np.ndarray, labels: np.ndarray, mask: np.ndarray) -> float:
    """sum(ce * mask) / sum(mask), in float64, independent of MindSpore."""
    x = logits.reshape(-1, logits.shape[-1]).astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    lse = (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))[:, 0]
    ce = lse - x[np.arange(x.shape[0]), labels.reshape(-1)]
    w = mask.reshape(-1).astype(np.float64)
    return float((ce * w).sum() / w.sum())
