"""Precision names and their rounding: one spelling for torch, MindSpore and numpy dtypes.

Why: tolerances follow the precision a run computed in (a bf16 pair is judged against bf16 noise), and
the two frameworks spell the same dtype differently (torch.bfloat16, mindspore.bfloat16, BFloat16, bf16).
"""

from __future__ import annotations

# machine epsilon (spacing of numbers near 1) per dtype
EPS = {"float64": 2.0 ** -52, "float32": 2.0 ** -23, "bfloat16": 2.0 ** -7, "float16": 2.0 ** -10}
_ALIASES = {"float": "float32", "fp32": "float32", "single": "float32", "bf16": "bfloat16", "half": "float16",
            "fp16": "float16", "double": "float64", "fp64": "float64"}


def normalize(dtype: str) -> str:
    """``torch.bfloat16`` / ``mindspore.bfloat16`` / ``BFloat16`` / ``bf16`` -> ``bfloat16``."""
    d = str(dtype).strip().lower()
    for prefix in ("torch.", "mindspore.", "mstype.", "numpy.", "np."):
        if d.startswith(prefix):
            d = d[len(prefix):]
    return _ALIASES.get(d, d)


def coarsest(dtypes: list[str]) -> str:
    """The least precise floating dtype among ``dtypes`` (the one whose noise dominates a comparison)."""
    known = [normalize(d) for d in dtypes if normalize(d) in EPS]
    return max(known, key=lambda d: EPS[d]) if known else "float32"
