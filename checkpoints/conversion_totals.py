"""Converted weights that check themselves: each rule group's converted tensors must hold the same elements as
the source tensors they came from, so their element counts and L2 norms must equal the source's.

Why: conversion only slices, concatenates, transposes and stacks (mapping/transforms.py). A transform that drops
a part (a chunk lost), takes one twice (a duplicated expert or head group) or slices from the wrong place (one
region twice, another never) writes a checkpoint that loads and trains, and every step-1 difference then
follows from it. The source hands us the totals that expose it.

The line, derived: every element is a float32 (bfloat16 travels as float32), so its square is exact in float64
(24-bit mantissa squared: 48 bits < 53). Both sides sum the same exact squares in another order; a float64 sum
of n non-negative terms in any order is within (n - 1) x u of the exact sum (u = 2^-53), so the two sums differ
by at most 2 (n - 1) x u relatively, and the norms (square roots) by half that plus a rounding of each root:
relative line ``(n + 2) x 2^-53`` (``tolerance``; 1.1e-10 for 10^6 elements). Measured on every preset's
tiny checkpoint: 0 (the same elements summed in the same blocks give the same bits). What it catches: a part
whose squares are a fraction f of the group's, dropped or duplicated, moves the norm by ~f / 2, above the line
for any part of a non-zero tensor; an all-zero part changes no norm but changes the element count, checked
exactly. A permutation (rows swapped, a transpose too many) keeps both totals: compare-weights and the
round trip catch that.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from core.findings import Finding, StageResult

U64 = 2.0 ** -53
STAGE = "conversion"


def tolerance(numel: int) -> float:
    """The float64 summation line between two orders of the same float32 elements' squares (module doc)."""
    return (max(int(numel), 1) + 2) * U64


def sum_squares(a: Any) -> tuple[float, int]:
    """(sum of squares in float64, element count) of one tensor; integer / bool tensors as their values."""
    x = np.asarray(a)
    if x.dtype.kind not in "biuf":
        return 0.0, int(x.size)
    x = x.astype(np.float64, copy=False).ravel()
    return float(np.dot(x, x)), int(x.size)


def _cause(src_n: int, dst_n: int, src_sq: float, dst_sq: float) -> str:
    if dst_n < src_n:
        return f"a part dropped ({src_n - dst_n} of {src_n} elements missing)"
    if dst_n > src_n:
        return f"a part duplicated ({dst_n - src_n} elements more than the source)"
    return ("a wrong chunk (the same number of elements, other values: one region taken twice, another never, "
            f"norm {'larger' if dst_sq > src_sq else 'smaller'})")


def check_totals(groups: Iterable[tuple[list[str], list[str]]], source: Mapping[str, Any],
                 converted: Mapping[str, Any], where: str) -> StageResult:
    """Each group (source names, the target names they became) keeps its element count exactly and its L2
    norm within ``tolerance``; then the same over all tensors (a target written by two groups shows there).
    A failure names the source tensor(s), both norms and the likely cause."""
    res = StageResult(STAGE)
    sq: dict[str, tuple[float, int]] = {}

    def of(name: str, table: Mapping[str, Any], key: str) -> tuple[float, int]:
        if key not in sq:
            sq[key] = sum_squares(table[name])
        return sq[key]

    groups = list(groups)
    worst, checked = 0.0, 0
    for src, dst in groups:
        s = [of(n, source, "s:" + n) for n in src]
        d = [of(n, converted, "d:" + n) for n in dst if n in converted]
        s_sq, s_n = sum(v for v, _ in s), sum(k for _, k in s)
        d_sq, d_n = sum(v for v, _ in d), sum(k for _, k in d)
        s_norm, d_norm = math.sqrt(s_sq), math.sqrt(d_sq)
        rel = abs(d_norm - s_norm) / s_norm if s_norm > 0 else (0.0 if d_norm == 0 else math.inf)
        line = tolerance(max(s_n, d_n))
        checked += 1
        worst = max(worst, rel / line if line else 0.0)
        if d_n != s_n or rel > line:
            name = " + ".join(src)
            res.add(Finding(STAGE, "fail", src[0] if len(src) == 1 else name, "norm_not_kept", d_norm, s_norm,
                            f"{where}: {name} -> {', '.join(dst)}: the converted L2 norm is {d_norm:.9g} over "
                            f"{d_n} elements, the source's {s_norm:.9g} over {s_n} (relative {rel:.3g}, line "
                            f"{line:.3g}): {_cause(s_n, d_n, s_sq, d_sq)}"))
    names_src = sorted({n for src, _ in groups for n in src})
    t_sq = sum(sq["s:" + n][0] for n in names_src)
    t_n = sum(sq["s:" + n][1] for n in names_src)
    c = [sum_squares(v) if ("d:" + k) not in sq else sq["d:" + k] for k, v in converted.items()]
    c_sq, c_n = sum(v for v, _ in c), sum(k for _, k in c)
    t_norm, c_norm = math.sqrt(t_sq), math.sqrt(c_sq)
    rel = abs(c_norm - t_norm) / t_norm if t_norm > 0 else (0.0 if c_norm == 0 else math.inf)
    line = tolerance(max(t_n, c_n))
    details = {"groups": checked, "source_norm": t_norm, "converted_norm": c_norm, "source_numel": t_n,
               "converted_numel": c_n, "relative": rel, "line": line, "worst_group_over_line": worst}
    if c_n != t_n or rel > line:
        res.add(Finding(STAGE, "fail", None, "total_norm_not_kept", c_norm, t_norm,
                        f"{where}: all {len(converted)} converted tensors: L2 norm {c_norm:.9g} over {c_n} "
                        f"elements, the source's {t_norm:.9g} over {t_n} (relative {rel:.3g}, line {line:.3g}): "
                        f"{_cause(t_n, c_n, t_sq, c_sq)}"))
    res.details = details
    if not res.findings:
        res.verdict = "pass"
        res.add(Finding(STAGE, "pass", None, "norm_kept", c_norm, t_norm,
                        f"converted weights keep the source's norms: {checked} groups, total L2 {c_norm:.9g} = "
                        f"{t_norm:.9g} over {c_n} elements (relative {rel:.3g}, line {line:.3g})"))
    else:
        res.verdict = "fail"
    return res
