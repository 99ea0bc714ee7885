"""MindFormers training logs -> Run.

Reads MFLossMonitor's step lines::

    ... - INFO - { Epoch:[  1/  1], step:[    2/    6], loss:[4.146456/4.156389], per_step_time: 373ms,
    lr: 0.0005, overflow cond: False, loss_scale: 1.0, global_norm: [1.507098]

and, with ``local_norm=True``, the ``norm_size: (...)`` + ``local_norm:`` + ``[...]`` blocks printed just
before the step they belong to. Those are squared sums of each parameter's gradient, unnamed, in the
optimizer's parameter order; we keep them as ``#<index>`` with their size (naming comes from the mapping).
The config that MindFormers pprints at start-up is read as a literal when present.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from align.core.errors import BadInput
from align.core.run import Run, make_series
from align.sources.logtext import clean_text, read_log_bytes, unwrap

_STEP = re.compile(r"\{ ?Epoch:\[\s*(\d+)/\s*(\d+)\],\s*step:\[\s*(\d+)/\s*(\d+)\],(.*)$")
_FIELD = re.compile(r"\s*([A-Za-z_][A-Za-z_ ]*?):\s*(\[[^\]:]*\]|[^,]*)\s*(?:,|$)")  # '[' never spans a ':
_NORM_SIZE = re.compile(r"norm_size:\s*\(([^)]*)\)")
# The line as MFLossMonitor prints it (MindFormers 1.x-2.x); anything else takes the careful path.
_FAST = re.compile(
    rb"\{ ?Epoch:\[\s*(\d+)/\s*\d+\],\s*step:\[\s*(\d+)/\s*(\d+)\],\s*loss:\[\s*([^/\],]+)/\s*([^\],]+)\],"
    rb"\s*per_step_time:\s*([0-9.]+)ms,\s*lr:\s*([^,\s]+),\s*overflow cond:\s*(True|False),"
    rb"\s*loss_scale:\s*([^,\s]+),\s*global_norm:\s*\[\s*([^\]\s]+)\s*\][ \t]*$", re.M)
_FAST_KEYS = ("loss", "loss_avg", "per_step_time_ms", "lr", "overflow", "loss_scale", "grad_norm")

FIELDS = {
    "loss": "loss",
    "per_step_time": "per_step_time_ms",
    "lr": "lr",
    "overflow cond": "overflow",
    "loss_scale": "loss_scale",
    "global_norm": "grad_norm",
}


def _number(text: str) -> float:
    t = text.strip()
    if t in ("True", "False"):
        return float(t == "True")
    if t.endswith("ms"):
        t = t[:-2]
    return float(t)


def _is_complete(line: str) -> bool:
    if "Epoch:[" not in line:
        return "local_norm" not in line and "norm_size" not in line or line.rstrip().endswith(")")
    return line.rstrip().endswith("]")


def _config_block(lines: list[str]) -> dict[str, Any]:
    """The dict MindFormers pprints before training, read as a Python literal (never evaluated)."""
    for i, line in enumerate(lines):
        if not line.startswith("{'"):
            continue
        depth, buf = 0, []
        for j in range(i, min(len(lines), i + 5000)):
            buf.append(lines[j])
            depth += lines[j].count("{") - lines[j].count("}")
            if depth <= 0:
                break
        try:
            value = ast.literal_eval("\n".join(buf))
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            return {}
        return value if isinstance(value, dict) else {}
    return {}


def _fast(raw: bytes) -> dict[str, pd.Series] | None:
    """All step lines in the standard format and no local_norm blocks: parse them in bulk."""
    if b"local_norm:" in raw:
        return None
    rows = _FAST.findall(raw)
    if not rows or len(rows) != raw.count(b"Epoch:["):
        return None
    cols = list(zip(*rows, strict=True))
    try:
        epoch = np.array(cols[0]).astype(np.int64)
        step = np.array(cols[1]).astype(np.int64)
        per_epoch = np.array(cols[2]).astype(np.int64)
        values = [np.array(c).astype(np.float64) for c in cols[3:7]]
        overflow = (np.array(cols[7]) == b"True").astype(np.float64)
        values += [overflow] + [np.array(c).astype(np.float64) for c in cols[8:]]
    except (ValueError, OverflowError):
        return None  # a garbled number: the careful path names the step
    gstep = (epoch - 1) * per_epoch + step
    return {k: make_series(gstep, v, k) for k, v in zip(_FAST_KEYS, values, strict=True)}


def parse_mindformers_log(path: str | Path) -> Run:
    """Parse one MindFormers log into a Run (BadInput when it holds no step lines)."""
    raw = clean_text(read_log_bytes(path))
    notes: list[str] = []
    fast = _fast(raw)
    if fast is not None:
        return Run(str(path), "mindformers_log", _meta(path, raw.decode("utf-8", "replace").split("\n")
                                                       if raw.startswith(b"{'") or b"\n{'" in raw else []),
                   fast, {}, notes)
    text_lines = raw.decode("utf-8", "replace").split("\n")
    if any(not _is_complete(x) for x in text_lines[:-1]):
        text_lines, joins = unwrap(text_lines, _is_complete)
        if joins:
            notes.append(f"re-joined {joins} lines wrapped by a terminal")

    cols: dict[str, tuple[list[int], list[float]]] = {}
    local_norms: dict[int, pd.DataFrame] = {}
    pending_norm: tuple[list[int], list[float]] | None = None
    steps_seen = 0
    i = 0
    n = len(text_lines)
    while i < n:
        line = text_lines[i]
        if "norm_size:" in line:
            pending_norm, i = _norm_block(text_lines, i, notes)
            continue
        m = _STEP.search(line)
        i += 1
        if not m:
            continue
        epoch, _, step, per_epoch, rest = (m.group(1), m.group(2), m.group(3), m.group(4), m.group(5))
        gstep = (int(epoch) - 1) * int(per_epoch) + int(step)
        if gstep >= 1 << 53:   # beyond any step index (a garbled number): said, not a crash (issue 14)
            notes.append(f"line {i}: step number {gstep} is beyond any step index; line not read")
            pending_norm = None
            continue
        values: dict[str, float] = {}
        bad = None
        for fm in _FIELD.finditer(rest):
            name, value = fm.group(1).strip(), fm.group(2).strip()
            key = FIELDS.get(name, re.sub(r"\W+", "_", name).strip("_").lower())
            try:
                if value.startswith("["):
                    if not value.endswith("]"):
                        raise ValueError(value)
                    parts = [p for p in value[1:-1].replace("/", " ").replace(",", " ").split() if p]
                    if not parts:
                        continue
                    values[key] = _number(parts[0])
                    if key == "loss" and len(parts) > 1:
                        values["loss_avg"] = _number(parts[1])
                else:
                    values[key] = _number(value)
            except ValueError:   # noted; the step keeps its other fields (issue 14)
                bad = (name, value)
                notes.append(f"step {gstep}: unreadable {name!r} value {value[:30]!r}; skipped that field")
        if bad is not None and not values:
            pending_norm = None
            continue
        if not line.rstrip().endswith("]"):
            notes.append(f"step {gstep}: line cut short; kept {len(values)} fields")
        steps_seen += 1
        for k, v in values.items():
            entry = cols.setdefault(k, ([], []))
            entry[0].append(gstep)
            entry[1].append(v)
        if pending_norm is not None:
            sizes, sq = pending_norm
            local_norms[gstep] = pd.DataFrame({
                "name": [f"#{j}" for j in range(len(sq))],
                "norm": np.sqrt(np.asarray(sq, dtype=np.float64)),
                "numel": np.asarray(sizes, dtype=np.int64) if sizes else np.full(len(sq), -1, np.int64),
            })
            pending_norm = None
    if steps_seen == 0:
        raise BadInput(f"{path}: no MindFormers '{{ Epoch:[..], step:[..], loss:[..] ...' lines found")
    series = {k: make_series(st, v, k) for k, (st, v) in cols.items()}
    return Run(str(path), "mindformers_log", _meta(path, text_lines), series, local_norms, notes)


def _meta(path: str | Path, text_lines: list[str]) -> dict[str, Any]:
    return {
        "framework": "mindformers",
        "source": {"kind": "mindformers_log", "path": str(path)},
        "config": _config_block(text_lines),
        "name_scheme": "index",
    }


def _norm_block(lines: list[str], i: int, notes: list[str]) -> tuple[tuple[list[int], list[float]] | None, int]:
    """Read ``norm_size: (...)`` / ``local_norm:`` / ``[...]`` starting at line ``i``."""
    m = _NORM_SIZE.search(lines[i])
    try:
        sizes = [int(x) for x in m.group(1).replace(",", " ").split()] if m else []
        if any(not 0 <= x < 1 << 62 for x in sizes):
            raise ValueError("size out of range")
    except ValueError:   # a garbled size: the norms are still good, their sizes are not (issue 14)
        notes.append(f"line {i + 1}: unreadable norm_size entries; sizes dropped")
        sizes = []
    j = i + 1
    while j < len(lines) and "local_norm:" not in lines[j] and j < i + 3:
        j += 1
    if j >= len(lines) or "local_norm:" not in lines[j]:
        return None, i + 1
    after = lines[j].split("local_norm:", 1)[1]
    buf = after
    k = j + 1
    while "]" not in buf and k < len(lines) and k < j + 100000:
        buf += " " + lines[k]
        k += 1
    body = buf.strip()
    if not body.startswith("[") or "]" not in body:
        notes.append(f"line {j + 1}: local_norm block not closed; ignored")
        return None, k
    try:
        values = [float(x) for x in body[1:body.index("]")].replace(",", " ").split()]
    except ValueError:
        notes.append(f"line {j + 1}: unreadable local_norm values; ignored")
        return None, k
    if sizes and len(sizes) != len(values):
        notes.append(f"line {j + 1}: norm_size has {len(sizes)} entries but local_norm {len(values)}; "
                     "sizes dropped")
        sizes = []
    return (sizes, values), k
