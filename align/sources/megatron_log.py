"""Megatron-LM training logs -> Run.

Reads every field of the ``iteration`` lines, the ``arguments`` block (the run's config) and the
validation-loss lines. Real logs are messy: timestamps, ANSI colour, warnings and tracebacks between
records, lines wrapped by a terminal copy, a log cut mid-line. Each problem is either repaired or noted
(``Run.notes``), never a silent wrong number: a field counts only when the ``|`` that ends it was seen.
"""

from __future__ import annotations

import importlib.util
import io
import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from align.core.errors import BadInput
from align.core.run import Run, make_series
from align.sources.configs import parse_arguments_block
from align.sources.logtext import clean_text, read_log_bytes, unwrap

#: Megatron's field names -> the run store's scalar keys (docs/run-store.md).
FIELDS = {
    "consumed samples": "consumed_samples",
    "consumed tokens": "consumed_tokens",
    "elapsed time per iteration (ms)": "elapsed_ms",
    "throughput per GPU (TFLOP/s/GPU)": "tflops_per_gpu",
    "learning rate": "lr",
    "decoupled learning rate": "decoupled_lr",
    "global batch size": "global_batch_size",
    "lm loss": "loss",
    "loss scale": "loss_scale",
    "grad norm": "grad_norm",
    "num zeros": "num_zeros",
    "params norm": "params_norm",
    "number of skipped iterations": "skipped_iterations",
    "number of nan iterations": "nan_iterations",
}

_RECORD = re.compile(rb"iteration(\s+\d+\s*/\s*\d+\s*\|[^\n]*)")
_VALID = re.compile(rb"validation loss at ([^|\n]*?)\|([^\n]*)")
_ARGS_START = b"------------------------ arguments ------------------------"
_ARGS_END = b"-------------------- end of arguments ---------------------"


def _key(name: str) -> str:
    name = " ".join(name.split())
    if name in FIELDS:
        return FIELDS[name]
    return re.sub(r"[^0-9a-zA-Z]+", "_", name).strip("_").lower()


def _is_complete(line: str) -> bool:
    return line.rstrip().endswith("|") or "iteration" not in line


def _fields(rest: bytes) -> tuple[list[tuple[str, str]], bool]:
    """Split the part after ``iteration N/ M |`` into (name, value) fields; the last may be cut off."""
    parts = rest.decode("utf-8", "replace").split("|")
    complete = parts[:-1]  # the text after the last '|' is a field whose end we never saw
    out = []
    for p in complete:
        name, sep, value = p.partition(":")
        if sep and name.strip():
            out.append((name.strip(), value.strip()))
    cut = bool(parts[-1].strip())
    return out, cut


def _fast_columns(records: list[bytes]) -> tuple[np.ndarray, dict[str, np.ndarray]] | None:
    """Vectorised parse when every record carries the same fields in the same order (the usual case).

    Checked by counting separators over all records and comparing field names on an even sample; then
    the numbers are read in bulk. ``None`` sends the caller to the careful, field-by-field path.
    """
    n = len(records)
    first, cut = _fields(records[0].split(b"|", 1)[1])
    if not first or cut:
        return None
    names = [name for name, _ in first]
    nsep = len(first) + 1  # the '|' after "N/ M" plus one per field
    for i in range(0, n, max(1, n // 2000)):
        got, _ = _fields(records[i].split(b"|", 1)[1])
        if [name for name, _ in got] != names:
            return None
    # '|', ':' and '/' all become column separators: every record must then have the same count.
    table = b"\n".join(records).translate(bytes.maketrans(b":/", b"||"))
    if table.count(b"|") != n * (nsep + len(first) + 1):
        return None
    usecols = [0] + list(range(3, 2 * len(first) + 2, 2))
    values = _read_numbers(table, 2 * len(first) + 3, usecols)
    if values is None or len(values) != n:
        return None  # a garbled value somewhere: the careful path names it
    return values[:, 0].astype(np.int64), {_key(name): values[:, j + 1] for j, name in enumerate(names)}


def _read_numbers(table: bytes, ncols: int, usecols: list[int], use_arrow: bool | None = None) -> np.ndarray | None:
    """Read the '|'-separated value columns as float64; ``None`` when any value is not a number.

    pyarrow's multi-threaded CSV reader is 2-4x faster than pandas' C parser here; it is optional (the
    log path needs only numpy/pandas), so pandas reads when pyarrow is absent."""
    if use_arrow is None:
        use_arrow = importlib.util.find_spec("pyarrow") is not None
    if use_arrow:
        import pyarrow as pa
        import pyarrow.csv as pcsv

        names = [str(i) for i in range(ncols)]
        keep = [names[i] for i in usecols]
        try:
            got = pcsv.read_csv(
                pa.BufferReader(table),
                read_options=pcsv.ReadOptions(column_names=names),
                parse_options=pcsv.ParseOptions(delimiter="|", quote_char=False),
                convert_options=pcsv.ConvertOptions(include_columns=keep, column_types=dict.fromkeys(
                    keep, pa.float64()), null_values=[], strings_can_be_null=False))
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            return None
        return np.column_stack([got.column(c).to_numpy() for c in keep])
    try:
        df = pd.read_csv(io.BytesIO(table), sep="|", header=None, names=list(range(ncols)), usecols=usecols,
                         skipinitialspace=True, engine="c", dtype=np.float64, keep_default_na=False,
                         na_values=[v + pad for v in ("nan", "NaN", "-nan") for pad in ("", " ")])
    except (ValueError, pd.errors.ParserError):
        return None
    return df.to_numpy()


def parse_megatron_log(path: str | Path) -> Run:
    """Parse one Megatron-LM log file into a Run (BadInput when it holds no iteration lines)."""
    raw = clean_text(read_log_bytes(path))
    notes: list[str] = []
    records = _RECORD.findall(raw)
    if not records:
        raise BadInput(f"{path}: no Megatron 'iteration N/ M |' lines found")
    fast = _fast_columns(records)
    if fast is not None:  # every record has every field: a NaN there was printed as nan
        iters, values = fast
        columns = {k: (v, np.ones(len(v), dtype=bool)) for k, v in values.items()}
    else:
        if any(not r.rstrip().endswith(b"|") for r in records[:-1]):
            lines, joins = unwrap(raw.decode("utf-8", "replace").split("\n"), _is_complete)
            if joins:
                notes.append(f"re-joined {joins} lines wrapped by a terminal")
                raw = "\n".join(lines).encode()
                records = _RECORD.findall(raw)
        columns, iters = _careful_table(records, notes, path)
    series = {k: make_series(iters[present], values[present], k) for k, (values, present) in columns.items()}
    if len(np.unique(iters)) != len(iters):
        notes.append("some iterations appear more than once (restart?); the last occurrence is used")

    _validation(raw, series)
    config: dict[str, Any] = {}
    start = raw.find(_ARGS_START)
    if start >= 0:
        end = raw.find(_ARGS_END, start)
        if end < 0:
            notes.append("arguments block not closed; read what was there")
        config = parse_arguments_block(raw[start: end if end >= 0 else None].decode("utf-8", "replace"))
    meta: dict[str, Any] = {
        "framework": "megatron-lm",
        "source": {"kind": "megatron_log", "path": str(path)},
        "config": config,
        "train_iters": int(records[-1].split(b"/", 1)[1].split(b"|", 1)[0]),
        "name_scheme": "megatron-core-local",
    }
    if config:
        meta["parallel"] = {
            "tp": config.get("tensor_model_parallel_size", 1),
            "pp": config.get("pipeline_model_parallel_size", 1),
            "dp": config.get("data_parallel_size", 1),
            "world_size": config.get("world_size", 1),
        }
    n_tb = raw.count(b"Traceback (most recent call last)")
    if n_tb:
        notes.append(f"{n_tb} traceback(s) in the log")
    return Run(str(path), "megatron_log", meta, series, {}, notes)


def _careful_table(records: list[bytes], notes: list[str],
                   path: str | Path) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], np.ndarray]:
    """Field-by-field parse that tolerates differing fields, cut lines and garbled values."""
    cols: dict[str, list[float]] = {}
    present: dict[str, list[bool]] = {}
    keep_iters: list[int] = []
    for i, rec in enumerate(records):
        head, _, rest = rec.partition(b"|")
        it = int(head.split(b"/")[0])
        fields, cut = _fields(rest)
        values: dict[str, float] = {}
        bad = None
        for name, text in fields:
            try:
                values[_key(name)] = float(text)
            except ValueError:
                bad = (name, text)
                break
        if bad is not None:
            notes.append(f"iteration {it}: unreadable {bad[0]!r} value {bad[1][:30]!r}; step skipped")
            continue
        if cut:
            if i == len(records) - 1:
                notes.append(f"iteration {it}: log ends mid-line; kept the {len(values)} complete fields")
            else:
                notes.append(f"iteration {it}: line cut short; kept the {len(values)} complete fields")
        row = len(keep_iters)
        keep_iters.append(it)
        for k, v in values.items():
            if k not in cols:
                cols[k] = [np.nan] * row
                present[k] = [False] * row
            cols[k].append(v)
            present[k].append(True)
        for k in cols:
            if len(cols[k]) < row + 1:
                cols[k].append(np.nan)
                present[k].append(False)
    if not keep_iters:
        raise BadInput(f"{path}: iteration lines found but none readable")
    out = {k: (np.array(v, dtype=np.float64), np.array(present[k], dtype=bool)) for k, v in cols.items()}
    return out, np.array(keep_iters, dtype=np.int64)


def _validation(raw: bytes, series: dict[str, pd.Series]) -> None:
    """``validation loss at iteration N | lm loss value: X | lm loss PPL: Y |``."""
    steps, loss, ppl = [], [], []
    if b"validation loss at" not in raw:
        return
    for where, rest in _VALID.findall(raw):
        m = re.search(rb"iteration\s+(\d+)", where)
        if not m:
            continue
        fields, _ = _fields(rest)
        d = {name: text for name, text in fields}
        try:
            value = float(d.get("lm loss value", "nan"))
            perplexity = float(d.get("lm loss PPL", "nan"))
        except ValueError:
            continue
        steps.append(int(m.group(1)))
        loss.append(value)
        ppl.append(perplexity)
    if steps:
        series["val_loss"] = make_series(steps, loss, "val_loss")
        series["val_ppl"] = make_series(steps, ppl, "val_ppl")
