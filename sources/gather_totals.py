"""Gathered layer tensors that check themselves: a row put back together from its TP / CP ranks' parts
(sources.layers) must have the statistics its parts recorded: the element counts add up, the L2 norm is the
root of the parts' summed squared norms, the maximum and minimum are the parts' extremes.

Why: on a layout nobody can rerun here, a wrong gather (a part joined twice, one left out, a part read from
the wrong rank or step file, a shard whose data is not what its rank recorded) would compare a tensor the
run never had, and the layer stage would name a module that did nothing wrong, or pass one that did. Each
rank's dumper hands us the numbers that expose it: it recorded every part's statistics on the tensor it held.

The line, derived: the dumper's norm of a part of n elements is a float32 reduction (torch / MindSpore reduce
in blocks: relative error <= log2(n) x u, u = 2^-24) stored once rounded (u); the parts' squares add in
float64; the joined tensor's norm is taken here in float64 (exact squares of float32 values; error ~n x 2^-53,
negligible). Relative error of the recombined norm <= (log2 N + 1) x u for the largest part's N, so the line
is twice that plus one u per part: ``(2 log2 N + parts + 2) x u`` (``tolerance``; 1.6e-6 for 2^20 elements
in 2 parts). Maximum and minimum are elements: equal in float32, exactly. Element counts: exactly. What it
catches: a part dropped or duplicated changes the count (or, at equal counts, the norm by ~f/2 for a part
holding a fraction f of the squares); a part from the wrong rank or step changes the norm unless it happens
to hold the same squares. Rows with NaN or Inf check counts only (a norm over them is not comparable).

What the recorded statistics cannot show by themselves: one rank's part recorded twice (a rank file that is a
copy of another's, or a whole tensor recorded as a slice on every rank: MindSpore's semi-auto parallel could
compute a capture on the logical tensor). Then the parts' statistics are equal to the last bit, which distinct
slices of a real activation never are (``same_parts``, checked on statistics-only stores too; rows that are not
floating point, hold one repeated value or only 0 / 1 are left alone: a zig-zag CP split gives a causal mask's
parts equal counts on purpose).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from core.errors import BadInput

U32 = 2.0 ** -24


class GatherMismatch(BadInput):
    """A gathered tensor whose statistics are not its parts': the row is not judged (one line says why)."""


def tolerance(numel: int, parts: int) -> float:
    """The relative line between a joined tensor's norm and the root of its parts' summed squares (module doc)."""
    return (2.0 * math.log2(max(int(numel), 2)) + max(int(parts), 1) + 2.0) * U32


def expected(stats: dict[str, Any], parts: int, what: str) -> dict[str, Any]:
    """What a joined tensor must show: its parts' combined statistics (``sources.layers.combine_stats``)."""
    return {"numel": int(stats.get("numel", 0) or 0), "norm": float(stats.get("norm", 0.0)),
            "max": float(stats.get("max", 0.0)), "min": float(stats.get("min", 0.0)),
            "nonfinite": int(stats.get("nan", 0) or 0) + int(stats.get("inf", 0) or 0), "parts": int(parts),
            "what": what}


def mismatch(whole: np.ndarray, expect: dict[str, Any]) -> str | None:
    """Why ``whole`` is not the tensor its parts recorded (one line, both numbers), or None when it is."""
    what, parts = expect.get("what", "a gathered row"), expect.get("parts", 0)
    if int(whole.size) != expect["numel"]:
        more = int(whole.size) - expect["numel"]
        cause = "a part joined twice" if more > 0 else "a part left out"
        return (f"{what}: the tensor gathered from {parts} parts holds {whole.size} elements, its parts recorded "
                f"{expect['numel']} ({cause})")
    if expect.get("nonfinite") or whole.size == 0 or whole.dtype.kind != "f":
        return None
    x = whole.astype(np.float64, copy=False).ravel()
    norm = math.sqrt(float(np.dot(x, x)))
    ref = expect["norm"]
    rel = abs(norm - ref) / ref if ref > 0 else (0.0 if norm == 0 else math.inf)
    line = tolerance(whole.size, parts)
    if rel > line:
        return (f"{what}: the tensor gathered from {parts} parts has L2 norm {norm:.9g}, the root of its parts' "
                f"recorded squares {ref:.9g} (relative {rel:.3g}, line {line:.3g}): a part duplicated, missing or "
                "read from another rank or step")
    for key, got in (("max", float(x.max())), ("min", float(x.min()))):
        if np.float32(got) != np.float32(expect[key]):
            return (f"{what}: the tensor gathered from {parts} parts has {key} {got:.9g}, its parts recorded "
                    f"{expect[key]:.9g}: a part read from another rank or step")
    return None


def check_joined(whole: np.ndarray, expect: dict[str, Any] | None) -> np.ndarray:
    """``whole`` when it has its parts' statistics, else GatherMismatch (refused: the compare judges nothing on a
    tensor the run never had)."""
    if expect:
        why = mismatch(whole, expect)
        if why is not None:
            raise GatherMismatch(f"{why}; not judged: the gather or the store is wrong")
    return whole


_SAME = ("numel", "max", "min", "mean", "norm")


def _floating(part: dict[str, Any]) -> bool:
    return str(part.get("dtype", "float32")).lower().startswith(("float", "bfloat", "half"))


def same_parts(parts: list[dict[str, Any]], labels: list[str], what: str) -> str | None:
    """Why two of a row's parts (recorded statistics, ``labels`` naming their ranks) are one part written twice:
    every statistic equal, on a part that is not all one value; None when the parts differ."""
    seen: dict[tuple[float, ...], str] = {}
    for part, label in zip(parts, labels, strict=True):
        try:
            key = tuple(float(part.get(k, math.nan)) for k in _SAME)
        except (TypeError, ValueError):
            return None
        if not all(math.isfinite(v) for v in key) or int(part.get("nan", 0) or 0) or int(part.get("inf", 0) or 0) \
                or key[4] == 0.0 or key[1] == key[2] or not _floating(part) or {key[1], key[2]} <= {0.0, 1.0}:
            continue    # masks and counts (a zig-zag CP split balances a causal mask's parts on purpose)
        if key in seen:
            return (f"{what}: the parts of {seen[key]} and {label} record the same statistics (norm {key[4]:.9g}, "
                    f"max {key[1]:.9g}, min {key[2]:.9g}, {int(key[0])} elements): one rank's part written twice, "
                    "or a whole tensor recorded as a slice; not judged: the gather or the store is wrong")
        seen[key] = label
    return None
