"""Megatron-LM's golden-values JSON (tests/functional_tests/test_cases/*/golden_values_*.json) -> Run.

Megatron's CI keeps the expected curves of every functional test in this file: one object per TensorBoard
tag (``lm loss``, ``num-zeros``, ``iteration-time``, ``mem-allocated-bytes``, ``mtp_1 loss``, ...) with
``start_step``, ``end_step``, ``step_interval`` and ``values``. Since 2025 ``values`` maps the step (a JSON
string) to a number or to the string ``"nan"``; older files hold a list, sampled from the TensorBoard scalars
with ``start_step`` as a 0-based index (element i is iteration ``start_step + i * step_interval + 1``).
A pair of these files compares like two logs (``align report a.json b.json``).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from core.errors import BadInput
from runstore.run import Run, make_series
from sources import Source
from sources.jsontext import Huge as _Huge
from sources.jsontext import load_json
from sources.tensorboard import scalar_key

FIELDS = ("start_step", "end_step", "step_interval", "values")
_STEP_KEY = re.compile(r"[0-9]{1,16}")     # ASCII digits only: int() also reads '1_0' as 10 and '١' as 1
_FLOAT_TEXT = re.compile(r"[-+]?(?:nan|inf(?:inity)?|(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?)", re.I)


def looks_like_golden_values(head: bytes) -> bool:
    """Cheap test on a file's first bytes: a JSON object with golden-value metric fields."""
    return head.lstrip().startswith(b"{") and b'"step_interval"' in head and b'"values"' in head


def _number(path: Path, metric: str, step: Any, v: Any) -> float:
    if isinstance(v, _Huge):
        raise BadInput(f"{path}: metric {metric!r} step {step}: value {v[:20]}... is beyond the float range")
    if isinstance(v, bool) or v is None:
        raise BadInput(f"{path}: metric {metric!r} step {step}: value {v!r} is not a number")
    if isinstance(v, (int, float)):
        try:
            return float(v)
        except OverflowError:   # an integer beyond the float range (issue 14)
            raise BadInput(f"{path}: metric {metric!r} step {step}: value {str(v)[:20]}... is beyond the float "
                           "range") from None
    if isinstance(v, str) and _FLOAT_TEXT.fullmatch(v.strip(" ")):   # "nan", "inf" (Megatron's NaN step)
        value = float(v)
        if not math.isinf(value) or "inf" in v.lower():
            return value
        raise BadInput(f"{path}: metric {metric!r} step {step}: value {v[:20]!r} is beyond the float range")
    raise BadInput(f"{path}: metric {metric!r} step {step}: value {v!r} is not a number")


def _plain_points(values: dict[str, Any]) -> tuple[np.ndarray, np.ndarray] | None:
    """The usual file, read without a Python call per value: step keys that int() reads, values that are
    all floats or ints (no bool, None or string). None sends the caller to the value-by-value reader,
    which names what is wrong."""
    vals = list(values.values())
    if not set(map(type, vals)) <= {float, int} or not all(map(_STEP_KEY.fullmatch, values)):
        return None
    try:
        steps = np.fromiter(map(int, values), dtype=np.int64, count=len(vals))
        arr = np.array(vals, dtype=np.float64)
    except (ValueError, OverflowError, TypeError):
        return None
    if len(steps) and not (0 <= steps.min() and steps.max() < 1 << 53):
        return None
    return steps, arr


def _metric_points(path: Path, metric: str, entry: dict[str, Any]
                   ) -> tuple[list[int] | np.ndarray, list[float] | np.ndarray]:
    values = entry["values"]
    if isinstance(values, dict):
        plain = _plain_points(values)
        if plain is not None:
            return plain
        steps, vals = [], []
        for k, v in values.items():
            if not _STEP_KEY.fullmatch(k):
                raise BadInput(f"{path}: metric {metric!r}: step key {k[:30]!r} is not an integer "
                               "(ASCII digits only)")
            step = int(k)
            if not 0 <= step < 1 << 53:   # issue 14: no step index holds it
                raise BadInput(f"{path}: metric {metric!r}: step key {k[:30]!r} is out of range")
            steps.append(step)
            vals.append(_number(path, metric, step, v))
        return steps, vals
    if isinstance(values, list):
        start, interval = entry.get("start_step"), entry.get("step_interval")
        if not isinstance(start, int) or not isinstance(interval, int) or interval < 1:
            raise BadInput(f"{path}: metric {metric!r}: a list of values needs integer start_step and "
                           f"step_interval >= 1 (got {start!r}, {interval!r})")
        steps = [start + i * interval + 1 for i in range(len(values))]
        if steps and not (0 <= steps[0] and steps[-1] < 1 << 53):   # issue 14: no step index holds them
            raise BadInput(f"{path}: metric {metric!r}: start_step {start} / step_interval {interval} out of range")
        return steps, [_number(path, metric, s, v) for s, v in zip(steps, values, strict=True)]
    raise BadInput(f"{path}: metric {metric!r}: 'values' is {type(values).__name__}, not an object or list")


def read_golden_values(path: str | Path) -> Run:
    """Read one golden-values JSON file as a Run (scalar keys as for TensorBoard: ``lm loss`` -> loss)."""
    path = Path(path)
    data = load_json(path)
    if not isinstance(data, dict):
        raise BadInput(f"{path}: golden values must be a JSON object of metrics, got {type(data).__name__}")
    series, notes, skipped = {}, [], []
    for metric, entry in data.items():
        if not isinstance(entry, dict) or "values" not in entry:
            skipped.append(metric)      # inference goldens (generated_text, ...) are not training curves
            continue
        if entry["values"] is None:
            notes.append(f"metric {metric!r} has no values")
            continue
        steps, vals = _metric_points(path, metric, entry)
        if not len(steps):
            continue
        key = scalar_key(metric)
        if key in series:
            raise BadInput(f"{path}: metrics {metric!r} and another both map to {key!r}")
        series[key] = make_series(steps, vals, key)
        nan = int(np.isnan(np.asarray(vals, dtype=np.float64)).sum())
        if nan:
            notes.append(f"metric {metric!r}: {nan} of {len(vals)} steps are NaN in the golden file")
    if not series:
        raise BadInput(f"{path}: no golden-value metric with {', '.join(FIELDS)}"
                       + (f" (only {', '.join(map(repr, skipped[:3]))})" if skipped else ""))
    if skipped:
        notes.append(f"{len(skipped)} entries without training values skipped ({', '.join(skipped[:3])})")
    meta = {"framework": "megatron-lm", "source": {"kind": "golden_values", "path": str(path)},
            "golden_values": {k: {f: data[k].get(f) for f in FIELDS[:3]} for k in data
                              if isinstance(data[k], dict) and "values" in data[k]}}
    return Run(str(path), "golden_values", meta, series, {}, notes)


def _is_golden_values(path: Path, head: bytes | None) -> bool:
    return head is not None and looks_like_golden_values(head)


SOURCE = Source("golden_values", 10, _is_golden_values, read_golden_values,
                "a Megatron-LM golden-values JSON ({metric: {start_step, end_step, step_interval, values}})")
