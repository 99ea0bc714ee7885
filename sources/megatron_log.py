"""Megatron-LM training logs -> Run.

Reads every field of the ``iteration`` lines, the ``arguments`` block (the run's config) and the
validation-loss lines. Real logs are messy: timestamps, ANSI colour, warnings and tracebacks between
records, lines wrapped by a terminal copy, a log cut mid-line. Each problem is either repaired or noted
(``Run.notes``), never a silent wrong number: a field counts only when the ``|`` that ends it was seen.
"""

from __future__ import annotations

import functools
import importlib.util
import io
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from core.errors import BadInput
from runstore.run import Run, make_series
from sources import Source
from sources.configs import parse_arguments_block, parse_world_line
from sources.logtext import (
    clean_text,
    digit_run,
    find_line,
    find_text,
    first_bytes,
    fixed_width_rows,
    holds,
    is_utf8,
    originals,
    read_log,
    read_split,
    rejoin_wrapped,
)
from sources.megatron_log_moe import SINCE_CORE_0_16, rank_local_losses

#: Megatron's field names (every label variant seen in Megatron-LM, Megatron-DeepSpeed and forks, compared
#: lower-case with '-'/'_' read as spaces) -> the run store's scalar keys (docs/run-store.md).
FIELDS = {
    "consumed samples": "consumed_samples",
    "consumed tokens": "consumed_tokens",
    "elapsed time per iteration (ms)": "elapsed_ms",
    "elapsed time per iteration": "elapsed_ms",
    "throughput per gpu (tflop/s/gpu)": "tflops_per_gpu",
    "tflops": "tflops_per_gpu",
    "learning rate": "lr",
    "lr": "lr",
    "decoupled learning rate": "decoupled_lr",
    "global batch size": "global_batch_size",
    "lm loss": "loss",
    "loss scale": "loss_scale",
    "grad norm": "grad_norm",
    "gradient norm": "grad_norm",
    "num zeros": "num_zeros",
    "number of zeros": "num_zeros",
    "params norm": "params_norm",
    "number of skipped iterations": "skipped_iterations",
    "skipped iterations": "skipped_iterations",
    "number of nan iterations": "nan_iterations",
    "nan iterations": "nan_iterations",
}
#: Labels whose unit, when it is seconds, is converted to the milliseconds the key promises.
_SECONDS = {"s", "sec", "secs", "second", "seconds"}

# a control byte next to a digit makes the number unreadable (it may stand for a digit): never a shorter number
_CTL = rb"\x00-\x08\x0b\x0c\x0e-\x1f\x7f"
_DIGITS = rb"(?<![" + _CTL + rb"])\d+(?![" + _CTL + rb"])"
_RECORD = re.compile(rb"iteration:?(\s*" + _DIGITS + rb"\s*/\s*" + _DIGITS + rb"\s*\|[^\n]*)")
_RECORD_START = re.compile(r"iteration:?\s*[0-9]+\s*/\s*[0-9]+\s*\|")
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")   # in a value: unreadable, not stripped
_FLOAT_TEXT = re.compile(r"[-+]?(?:nan|inf(?:inity)?|(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?)", re.I)
_NUL_HEAD = re.compile(rb"iteration:?[\x00 \t]*[0-9\x00]+(?:[\x00 \t]*/[\x00 \t]*[0-9\x00]+)?")
_NUL_BY_DIGIT = re.compile(rb"(?<=[0-9])\x00+|\x00+(?=[0-9])")
_VALID = re.compile(rb"validation loss at ([^|\n]*?)\|([^\n]*)")
_ARGS_START = b"------------------------ arguments ------------------------"
_ARGS_END = b"-------------------- end of arguments ---------------------"
_NUM = re.compile(r"[-+]?(?:nan|inf(?:inity)?|(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?)", re.I)
_UNIT = re.compile(r"\(([^()]*)\)\s*$")
_NAME_OF = re.compile(rb"\|\s*([^|:]*?)\s*:")
_CONTINUES = re.compile(r"^\s*[A-Za-z][^|\[\]]*?:\s*[^|]*\|")
_CONTINUED = re.compile(rb"\n[ \t]*[A-Za-z][^|\[\]\n:]*:[^|\n]*\|")
_BISECT_MIN = 64   # bulk reads bisect a failing block down to this many records, then read field by field


def _strict_float(text: str) -> float | None:
    """The number ``text`` (already stripped) writes, or None: ASCII digits only (Python's float() also reads
    '1_0' as 10 and Arabic-Indic digits), and a finite literal beyond the float range is no number (not inf)."""
    if _FLOAT_TEXT.fullmatch(text) is None:
        return None
    value = float(text)
    if math.isinf(value) and "inf" not in text.lower():
        return None
    return value


def _drop_nul(data: bytes, notes: list[str]) -> bytes:
    """NUL bytes out of the text (a crash or a copy left them), noted; a NUL run next to a digit of an
    ``iteration N/ M`` head becomes '?' instead, so the head reads as unreadable, never as a shorter number
    (``iteration 26\\x00/`` may be a garbled 264)."""
    if b"\x00" not in data:
        return data
    garbled = 0

    def mark(m: re.Match[bytes]) -> bytes:
        nonlocal garbled
        if b"\x00" not in m.group(0):
            return m.group(0)
        out, k = _NUL_BY_DIGIT.subn(b"?", m.group(0))
        garbled += k > 0
        return out

    data = _NUL_HEAD.sub(mark, data)
    if garbled:
        notes.append(f"{garbled} iteration number(s) hold a NUL byte next to a digit: those records are not read "
                     "(the NUL may stand for a digit)")
    n = data.count(b"\x00")
    if n:
        data = data.replace(b"\x00", b"")
        notes.append(f"removed {n} NUL byte(s) from the text")
    return data


def _label(name: str) -> str:
    return " ".join(name.replace("_", " ").replace("-", " ").lower().split())


@functools.lru_cache(maxsize=4096)
def _key(name: str) -> str:
    label = _label(name)
    if label in FIELDS:
        return FIELDS[label]
    return re.sub(r"[^0-9a-zA-Z]+", "_", label).strip("_")


def _fields(rest: bytes) -> tuple[list[tuple[str, str]], bool]:
    """Split the part after ``iteration N/ M |`` into (name, value) fields; the last may be cut off."""
    parts = rest.decode("utf-8", "replace").split("|")
    complete = parts[:-1]  # the text after the last '|' is a field whose end we never saw
    out = []
    for p in complete:
        name, sep, value = p.partition(":")
        if sep and name.strip():
            out.append((name.strip(), value if _CONTROL.search(value) else value.strip()))
    cut = bool(parts[-1].strip())
    return out, cut


class _Issues:
    """Problems met while reading, counted per kind and label so a 1M-line log gives a few notes, not 1M."""

    def __init__(self) -> None:
        self.seen: dict[tuple[str, str], list[Any]] = {}

    def add(self, kind: str, label: str, it: int, example: str = "") -> None:
        entry = self.seen.setdefault((kind, label), [0, it, example])
        entry[0] += 1

    def notes(self) -> list[str]:
        out = []
        for (kind, label), (count, it, example) in self.seen.items():
            where = f"iteration {it}" if count == 1 else f"{count} iterations (first: {it})"
            if kind == "unreadable":
                out.append(f"{where}: unreadable {label!r} value {example[:30]!r}; skipped that field, "
                           "the step keeps its other fields")
            elif kind == "cut_eof":
                out.append(f"{where}: log ends mid-line; kept the complete fields, not {example[:30]!r}")
            elif kind == "cut":
                out.append(f"{where}: line cut short; kept the complete fields, not {example[:30]!r}")
            elif kind == "head":
                out.append(f"{count} record(s) not read: {example}")
            elif kind == "trailing":
                out.append(f"{where}: text after the last '|' is not a field: {example[:30]!r}")
        return out


def _split_value(text: str) -> tuple[list[float], str] | None:
    """Numbers at the start of ``text`` (``x`` or ``a/b/...``) and the text glued after them.

    None when no number starts it, or when what follows continues the number (``6.9x3E+00``, ``1.2.3``):
    cutting there would give a wrong value, which is worse than none."""
    t = text.strip()
    nums: list[float] = []
    pos = 0
    while True:
        m = _NUM.match(t, pos)
        if not m:
            return None if not nums else (nums, t[pos - 1:])
        v = _strict_float(m.group(0))
        if v is None:
            return None     # a literal beyond the float range
        nums.append(v)
        pos = m.end()
        if pos < len(t) and t[pos] == "/" and _NUM.match(t, pos + 1):
            pos += 1
            continue
        break
    rest = t[pos:]
    if rest[:1].isalpha() and not any(ch.isdigit() for ch in t[:pos]):
        return None   # 'nanx', 'infinite': a word, not a number with text glued on
    if rest and not rest[0].isspace():
        token = re.split(r"[\s:/]", rest, maxsplit=1)[0]
        if not rest[0].isalpha() or any(ch.isdigit() for ch in token) or (
                token[:1] in "eE" and len(token) == 1):
            return None
    return nums, rest


def _pair_keys(name: str, count: int) -> list[str]:
    """Keys for an ``a/b`` value: from the label's own ``x/y`` words when it has them
    (``allocated/reserved (MB)`` -> ``allocated_mb``, ``reserved_mb``), else ``key``, ``key_2``, ..."""
    unit = _UNIT.search(name)
    base = name[: unit.start()] if unit else name
    suffix = f" ({unit.group(1)})" if unit else ""
    parts = base.split("/")
    if len(parts) == count and all(p.strip() for p in parts):
        head = parts[0].split()
        prefix = " ".join(head[:-1])
        names = [parts[0].strip()] + [f"{prefix} {p.strip()}".strip() for p in parts[1:]]
        return [_key(n + suffix) for n in names]
    key = _key(name)
    return [key] + [f"{key}_{i + 1}" for i in range(1, count)]


@functools.lru_cache(maxsize=4096)
def _seconds_key(name: str, unit: str) -> str | None:
    """The milliseconds key of a time given in seconds (``elapsed time per iteration (s)`` -> elapsed_ms)."""
    if unit.strip().lower() not in _SECONDS or "time" not in _label(name):
        return None
    base = _UNIT.sub("", name).strip()
    key = FIELDS.get(_label(base + " (ms)")) or _key(base) + "_ms"
    return key


def _read_field(name: str, text: str, out: dict[str, float], issues: _Issues, it: int, depth: int = 0) -> None:
    """One ``name: value`` field into ``out``; an unreadable value is noted and skipped."""
    unit = _UNIT.search(name)
    if _CONTROL.search(text):   # a control byte in or next to the number: it may stand for a digit
        issues.add("unreadable", " ".join(name.split()), it, text.strip())
        return
    value = _strict_float(text)
    if value is not None:
        sec = _seconds_key(name, unit.group(1)) if unit else None
        if sec is None:
            out[_key(name)] = value
        else:
            out[sec] = value * 1000.0
        return
    got = _split_value(text)
    if got is None:
        issues.add("unreadable", " ".join(name.split()), it, text.strip())
        return
    nums, rest = got
    keys = _pair_keys(name, len(nums)) if len(nums) > 1 else [_key(name)]
    sec = _seconds_key(name, unit.group(1) if unit else (rest.split() or [""])[0])
    if sec is not None and len(nums) == 1:
        keys, nums = [sec], [nums[0] * 1000.0]
    for k, v in zip(keys, nums, strict=False):
        out[k] = v
    glued_name, sep, glued_value = rest.partition(":")
    if sep and glued_name.strip() and depth < 4:  # ``50.0MODEL_TFLOP/s/GPU: 123.4``: the next field, glued on
        _read_field(glued_name.strip(), glued_value.strip(), out, issues, it, depth + 1)


def _parse_record(rec: bytes, issues: _Issues, at_eof: bool) -> tuple[int, dict[str, float]]:
    """Field by field: every readable value of the record, whatever the others hold."""
    head, _, rest = rec.partition(b"|")
    it = int(head.split(b"/")[0].strip().lstrip(b":"))
    if it >= 1 << 53:
        raise ValueError(f"iteration {head.split(b'/')[0].strip()[:30].decode()!r} is beyond any step index")
    parts = rest.decode("utf-8", "replace").split("|")
    values: dict[str, float] = {}
    for p in parts[:-1]:
        name, sep, value = p.partition(":")
        if sep and name.strip():
            _read_field(name.strip(), value if _CONTROL.search(value) else value.strip(), values, issues, it)
    tail = parts[-1].strip()
    if tail:
        if at_eof:
            issues.add("cut_eof", "", it, tail)
        elif ":" in tail:
            # printed after the last '|' (memory or throughput figures of some forks) on a finished line
            name, _, value = tail.partition(":")
            if not name.strip():
                issues.add("trailing", "", it, tail)
            else:
                got = _split_value(value)
                if got is None or not got[1][:1].isspace() and got[1]:
                    issues.add("cut", "", it, tail)
                else:
                    _read_field(name.strip(), value if _CONTROL.search(value) else value.strip(), values, issues, it)
    return it, values


def _layout(names: list[str]) -> tuple[int, list[int]]:
    """Columns of a record once '|', ':' and '/' all separate: (count, [iteration, value of each field]).

    A name's own '/' (``throughput per GPU (TFLOP/s/GPU)``) adds columns before its value."""
    cols, pos = [0], 2          # 'N', 'M', then per field: name (split at its '/'), value
    for name in names:
        pos += 1 + name.count("/")
        cols.append(pos)
        pos += 1
    return pos + 1, cols        # + the empty column after the record's last '|'


def _bulk(records: list[bytes], names: list[str]) -> tuple[np.ndarray, dict[str, np.ndarray]] | None:
    """Vectorised read of records that all carry ``names`` in that order; None when a value is garbled
    (or a record has more separators than the layout: an ``a/b`` value), so the caller looks closer."""
    n = len(records)
    if not n:
        return None
    table = b"\n".join(records).translate(bytes.maketrans(b":/", b"||"))
    ncols, usecols = _layout(names)
    # every record ends with its '|' (text after it would be a field read by no one); the column count per
    # record is checked by the reader (pyarrow refuses a row with more or fewer columns; pandas counts first)
    if not table.endswith(b"|"):
        return None
    values = _read_numbers(table, ncols, usecols)
    if values is None or len(values) != n or np.isinf(values).any():
        return None   # (an inf may be a literal beyond the float range: the per-record path tells them apart)
    cols: dict[str, np.ndarray] = {}
    for j, name in enumerate(names):
        unit = _UNIT.search(name)
        sec = _seconds_key(name, unit.group(1)) if unit else None
        cols[sec or _key(name)] = values[:, j + 1] * 1000.0 if sec else values[:, j + 1]
    steps = _steps(values[:, 0])
    if steps is None:
        return None   # an iteration number no step index holds: the per-record path says which
    return steps, cols


_MAX_STEP = float(1 << 53)


def _good_steps(col: np.ndarray) -> np.ndarray:
    """Iteration numbers a step index holds exactly: whole, >= 0, below 2**53."""
    with np.errstate(invalid="ignore"):
        return np.isfinite(col) & (col >= 0) & (col < _MAX_STEP) & (np.floor(col) == col)


def _steps(col: np.ndarray) -> np.ndarray | None:
    return col.astype(np.int64) if _good_steps(col).all() else None


_NUMBER_RE2 = r"^[-+]?(?:(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|(?i:nan|inf|infinity))$"


def _bulk_masked(records: list[bytes], names: list[str]
                 ) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray] | None:
    """Bulk read that survives garbled values: columns read as text, a value that is not a number marks its
    record for the field-by-field path (the returned mask is False there). pyarrow only; None without it
    or when the records do not split into the layout's columns."""
    if importlib.util.find_spec("pyarrow") is None or not records:
        return None
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as pcsv

    ncols, usecols = _layout(names)
    table = b"\n".join(records).translate(bytes.maketrans(b":/", b"||"))
    colnames = [str(i) for i in range(ncols)]
    name_cols: list[tuple[str, str]] = []     # (column, the text a record of this layout has there)
    pos = 2
    for name in names:
        for piece in name.split("/"):
            name_cols.append((colnames[pos], piece.strip()))
            pos += 1
        pos += 1
    keep = [colnames[i] for i in usecols] + [c for c, _ in name_cols]
    try:
        got = pcsv.read_csv(
            pa.BufferReader(table), read_options=pcsv.ReadOptions(column_names=colnames),
            parse_options=pcsv.ParseOptions(delimiter="|", quote_char=False),
            convert_options=pcsv.ConvertOptions(include_columns=keep, column_types=dict.fromkeys(keep, pa.string()),
                                                null_values=[], strings_can_be_null=False))
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return None
    if got.num_rows != len(records):
        return None
    # blanks only: Unicode whitespace trimming would drop a control byte next to a number
    texts = [pc.utf8_trim(got.column(colnames[i]), " \t") for i in usecols]
    ok = np.ones(len(records), dtype=bool)
    for t in texts:
        ok &= pc.match_substring_regex(t, _NUMBER_RE2).to_numpy(zero_copy_only=False)
    for c, want in name_cols:   # same names in the same places, else the record is read field by field
        ok &= pc.equal(pc.utf8_trim_whitespace(got.column(c)), want).to_numpy(zero_copy_only=False)
    idx = np.flatnonzero(ok)
    picked = pa.array(idx)
    values = [pc.cast(pc.take(t, picked), pa.float64()).to_numpy() for t in texts]
    good = _good_steps(values[0])
    for v in values[1:]:   # inf from a finite literal (1e400) is no value: the per-record path notes it
        good &= ~np.isinf(v)
    if not good.all():   # unusable iteration numbers go to the per-record path, which notes them
        ok[idx[~good]] = False
        values = [v[good] for v in values]
    cols: dict[str, np.ndarray] = {}
    for j, name in enumerate(names):
        unit = _UNIT.search(name)
        sec = _seconds_key(name, unit.group(1)) if unit else None
        cols[sec or _key(name)] = values[j + 1] * 1000.0 if sec else values[j + 1]
    return values[0].astype(np.int64), cols, ok


def _template(records: list[bytes]) -> list[str] | None:
    """The field names of the first clean record among the first few: the layout bulk reads expect."""
    for rec in records[:100]:
        fields, cut = _fields(rec.split(b"|", 1)[1])
        # bulk reads split at ':' and '/' too, so the names' own '/' must be the only extra ones
        if fields and not cut and all(_is_float(v) for _, v in fields) and rec.count(b"/") == 1 + sum(
                n.count("/") for n, _ in fields) and rec.count(b":") == len(fields):
            return [name for name, _ in fields]
    return None


def _is_float(text: str) -> bool:
    return _strict_float(text) is not None


def _fast_columns(records: list[bytes]) -> tuple[np.ndarray, dict[str, np.ndarray]] | None:
    """Vectorised parse when every record carries the same fields in the same order (the usual case).

    Checked by counting separators over all records and comparing field names on an even sample; then
    the numbers are read in bulk. ``None`` sends the caller to the mixed path.
    """
    n = len(records)
    names = _template(records[:1])
    if names is None:
        return None
    for i in range(0, n, max(1, n // 2000)):
        got, _ = _fields(records[i].split(b"|", 1)[1])
        if [name for name, _ in got] != names:
            return None
    return _bulk(records, names)


def _read_numbers(table: bytes, ncols: int, usecols: list[int], use_arrow: bool | None = None) -> np.ndarray | None:
    """Read the '|'-separated value columns as float64; ``None`` when any value is not a number, or when a
    record has text after its last '|' (the last column must be empty: that text is a field no one reads).

    pyarrow's multi-threaded CSV reader is 2-4x faster than pandas' C parser here; it is optional (the
    log path needs only numpy/pandas), so pandas reads when pyarrow is absent."""
    if use_arrow is None:
        use_arrow = importlib.util.find_spec("pyarrow") is not None
    if use_arrow:
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.csv as pcsv

        names = [str(i) for i in range(ncols)]
        keep = [names[i] for i in usecols]
        types = {**dict.fromkeys(keep, pa.float64()), names[-1]: pa.string()}
        try:
            got = pcsv.read_csv(
                pa.BufferReader(table),
                read_options=pcsv.ReadOptions(column_names=names),
                parse_options=pcsv.ParseOptions(delimiter="|", quote_char=False),
                convert_options=pcsv.ConvertOptions(include_columns=[*keep, names[-1]], column_types=types,
                                                    null_values=[], strings_can_be_null=False))
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            return None
        if pc.max(pc.utf8_length(pc.utf8_trim_whitespace(got.column(names[-1])))).as_py():
            return None
        return np.column_stack([got.column(c).to_numpy() for c in keep])
    if re.search(b"[" + _CTL + b"]", table) or \
            table.count(b"|\n") + table.count(b"| \n") != table.count(b"\n") or not table.rstrip().endswith(b"|") \
            or table.count(b"|") != (table.count(b"\n") + 1) * (ncols - 1):   # pandas pads short rows silently
        return None
    try:
        df = pd.read_csv(io.BytesIO(table), sep="|", header=None, names=list(range(ncols)), usecols=usecols,
                         skipinitialspace=True, engine="c", dtype=np.float64, keep_default_na=False,
                         na_values=[v + pad for v in ("nan", "NaN", "-nan") for pad in ("", " ")])
    except (ValueError, pd.errors.ParserError):
        return None
    return df.to_numpy()


def parse_megatron_log(path: str | Path) -> Run:
    """Parse one Megatron-LM log file into a Run (BadInput when it holds no iteration lines)."""
    data, notes = read_log(path, keep_nul=True)
    raw = clean_text(_drop_nul(data, notes))
    canon = _read_canonical(raw)
    if canon is not None:   # every record in the first one's layout: read in bulk (same result, faster)
        iters = canon.iters
        if canon.present is None:
            series = {k: make_series(iters, v, k, copy=False) for k, v in canon.cols.items()}
        else:                # a few garbled values: their records were read field by field
            series = {k: make_series(iters[canon.present[k]], v[canon.present[k]], k) for k, v in canon.cols.items()}
        notes.extend(canon.notes)
        n_records, train_iters, counted = canon.n_records, canon.total, canon.others
        n_loss = 0 if canon.pipes_ok else canon.n_loss
    else:
        raw, series, iters, n_records, train_iters, n_loss = _read_records(raw, notes, path)
        counted = raw
    if _repeats(iters):
        notes.append("some iterations appear more than once (restart?); the last occurrence is used")
    if n_loss > n_records:  # a head garbled beyond recognition: its values have no step to go to
        notes.append(f"{n_loss - n_records} line(s) hold 'lm loss:' without a readable "
                     "'iteration N/ M |' head; not read")
    config: dict[str, Any] = {}
    start = raw.find(_ARGS_START)
    if start >= 0:
        end = raw.find(_ARGS_END, start)
        if end < 0:
            notes.append("arguments block not closed; read what was there")
        # the end line is part of the block: without it the parser reads the block as cut short
        block = raw[start: end + len(_ARGS_END) if end >= 0 else None]
        config = parse_arguments_block(block.decode("utf-8", "replace"))
    windows = first_windows(series, iters, config, notes)
    _validation(counted, series, notes)
    layout = parse_world_line(raw[: start if start >= 0 else 1 << 16].decode("utf-8", "replace"))
    meta: dict[str, Any] = {
        "framework": "megatron-lm",
        "source": {"kind": "megatron_log", "path": str(path)},
        "config": {"kind": "megatron_args", "values": config} if config else {},
        "train_iters": train_iters,
        "name_scheme": "megatron-core-local",
    }
    parallel = {k: config.get(name, layout.get(k)) for k, name in (
        ("tp", "tensor_model_parallel_size"), ("pp", "pipeline_model_parallel_size"),
        ("dp", "data_parallel_size"), ("world_size", "world_size"))}
    if any(v is not None for v in parallel.values()):
        meta["parallel"] = parallel  # a size the log does not state stays None (unknown), never a default
    local = rank_local_losses(series, config, notes, parallel)   # after first_windows: un-averaged values
    if local is not None:
        meta["rank_local_losses"] = local
    if windows:
        meta["log_windows"] = windows
    vocab = padded_vocab_line(raw)
    if vocab:
        meta["data"] = vocab
    n_tb = counted.count(b"Traceback (most recent call last)")
    if n_tb:
        notes.append(f"{n_tb} traceback(s) in the log")
    return Run(str(path), "megatron_log", meta, series, {}, notes)


def _repeats(iters: np.ndarray) -> bool:
    """Whether an iteration appears twice (a restart); strictly increasing numbers need no sort."""
    if len(iters) < 2 or (iters[1:] > iters[:-1]).all():
        return False
    return len(np.unique(iters)) != len(iters)


def _read_records(raw: bytes, notes: list[str], path: str | Path
                  ) -> tuple[bytes, dict[str, pd.Series], np.ndarray, int, int | None, int]:
    """The careful path: records found one by one, wrapped lines re-joined, the usual layout read in bulk
    and every other record field by field. Returns the (re-joined) text, the series, the iteration of
    each record read, the record count, the last record's total and the 'lm loss:' count to check."""
    records = _RECORD.findall(raw)
    if not records:
        raise BadInput(f"{path}: no Megatron 'iteration N/ M |' lines found")
    fast = _fast_columns(records)
    pipes_ok = fast is not None and raw.count(b"|") == len(records) * (len(fast[1]) + 1)
    if fast is not None and not pipes_ok and not _uniform(raw, records, len(fast[1]), exact=False):
        fast = None
    if fast is not None:  # every record has every field: a NaN there was printed as nan
        iters, values = fast
        columns = {k: (v, np.ones(len(v), dtype=bool)) for k, v in values.items()}
    elif not all(r.endswith(b"|") for r in records[:-1]) or not _uniform(raw, records, 0, exact=False):
        text = raw.decode("utf-8", "replace")
        lines, joins = rejoin_wrapped(text.split("\n"), lambda x: _RECORD_START.search(x) is not None,
                                      lambda x: x.rstrip().endswith("|"),
                                      lambda x: _CONTINUES.match(x) is not None)
        if joins:
            notes.append(f"re-joined {joins} lines wrapped by a terminal")
            raw = "\n".join(lines).encode()
            records = _RECORD.findall(raw)
        columns, iters = _mixed_table(records, notes, path, not raw.endswith(b"\n"))
    else:   # every record ends with its '|' and nothing continues one: no wrap to repair
        columns, iters = _mixed_table(records, notes, path, not raw.endswith(b"\n"))
    series = {k: make_series(iters[present], values[present], k) for k, (values, present) in columns.items()}
    # no '|' outside the records (pipes_ok) leaves no room for a record whose head is garbled
    n_loss = 0 if pipes_ok else raw.count(b"lm loss:")
    return raw, series, iters, len(records), _train_iters(records[-1]), n_loss


def _uniform(raw: bytes, records: list[bytes], nfields: int, exact: bool = True) -> bool:
    """Cheap whole-file check that bulk reading would see every field: no line right after a record
    continues its fields (a terminal wrap that fell just after a '|'). When the file holds no '|' beyond the
    records' own, no such line can exist and the (slower) search is skipped."""
    if exact and raw.count(b"|") == len(records) * (nfields + 1):
        return True
    for m in _CONTINUED.finditer(raw):
        if raw[max(0, m.start() - 256): m.start()].rstrip(b" \t").endswith(b"|"):
            return False
    return True


def _train_iters(rec: bytes) -> int | None:
    try:
        total = int(rec.split(b"/", 1)[1].split(b"|", 1)[0])
    except (ValueError, IndexError):
        return None
    return total if total < 1 << 53 else None


def _layout_rows(records: list[bytes], names: list[str]) -> list[int]:
    """Indices of the records (the last excepted: it may be cut) that end with '|' and split into exactly
    the columns of ``names``' layout, counted with numpy over the whole table at once."""
    table = b"\n".join(records[:-1]).translate(bytes.maketrans(b":/", b"||"))
    if not table:
        return []
    arr = np.frombuffer(table, dtype=np.uint8)
    ends = np.flatnonzero(arr == 10)
    seps = np.bincount(np.searchsorted(ends, np.flatnonzero(arr == 124)), minlength=len(ends) + 1)
    last = np.append(ends - 1, len(arr) - 1)
    ok = (seps == _layout(names)[0] - 1) & (arr[last] == 124)
    return np.flatnonzero(ok).tolist()


def _mixed_table(records: list[bytes], notes: list[str], path: str | Path,
                 eof_cut: bool) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], np.ndarray]:
    """Records of the usual layout are read in bulk (a block with a garbled value is bisected), the rest
    field by field; every readable value is kept, every unreadable one noted."""
    n = len(records)
    issues = _Issues()
    template = _template(records)
    bulk_rows: list[int] = []
    if template is not None and n > _BISECT_MIN:
        bulk_rows = _layout_rows(records, template)
    in_bulk = np.zeros(n, dtype=bool)
    cols: dict[str, np.ndarray] = {}
    present: dict[str, np.ndarray] = {}
    iters = np.zeros(n, dtype=np.int64)

    def put(rows: np.ndarray, key: str, vals: np.ndarray) -> None:
        if key not in cols:
            cols[key] = np.full(n, np.nan)
            present[key] = np.zeros(n, dtype=bool)
        cols[key][rows] = vals
        present[key][rows] = True

    def read_block(rows: list[int]) -> None:
        got = _bulk([records[i] for i in rows], template or [])
        if got is None:
            if len(rows) <= _BISECT_MIN:
                return
            half = len(rows) // 2
            read_block(rows[:half])
            read_block(rows[half:])
            return
        idx = np.asarray(rows)
        iters[idx] = got[0]
        in_bulk[idx] = True
        for k, v in got[1].items():
            put(idx, k, v)

    masked = _bulk_masked([records[i] for i in bulk_rows], template or []) if bulk_rows else None
    if masked is not None:
        idx = np.asarray(bulk_rows)[masked[2]]
        iters[idx] = masked[0]
        in_bulk[idx] = True
        for k, v in masked[1].items():
            put(idx, k, v)
    elif bulk_rows:   # without pyarrow: names checked record by record, garbled blocks bisected
        want = [t.encode() for t in template or []]
        read_block([i for i in bulk_rows if _NAME_OF.findall(records[i]) == want])
    for i in np.flatnonzero(~in_bulk):
        try:
            it, values = _parse_record(records[i], issues, eof_cut and i == n - 1)
        except ValueError as exc:
            issues.add("head", "", -1, str(exc))
            continue
        iters[i] = it
        in_bulk[i] = True   # read (field by field)
        for k, v in values.items():
            put(np.array([i]), k, np.array([v]))
    notes.extend(issues.notes())
    out = {k: (cols[k][in_bulk], present[k][in_bulk]) for k in cols}
    if not any(p.any() for p in present.values()):
        raise BadInput(f"{path}: iteration lines found but no field in them is readable")
    return out, iters[in_bulk]


def _validation(raw: bytes, series: dict[str, pd.Series], notes: list[str]) -> None:
    """``validation loss at iteration N | lm loss value: X | lm loss PPL: Y |``, field by field: a garbled
    value skips that value (noted), a step number no index holds skips the line (noted)."""
    cols: dict[str, tuple[list[int], list[float]]] = {"val_loss": ([], []), "val_ppl": ([], [])}
    if b"validation loss at" not in raw:
        return
    bad: list[str] = []
    for where, rest in _VALID.findall(raw):
        m = re.search(rb"iteration\s+(\d+)(?![^ \t])", where)
        if not m:
            if b"iteration" in where:   # a step number with something glued to it (a control byte)
                bad.append(where.strip()[:30].decode("utf-8", "replace"))
            continue
        step = int(m.group(1))
        if step >= 1 << 53:
            bad.append(f"iteration {m.group(1)[:20].decode()}...")
            continue
        fields, _ = _fields(rest)
        d = {name: text for name, text in fields}
        for key, label in (("val_loss", "lm loss value"), ("val_ppl", "lm loss PPL")):
            if label not in d:
                continue
            value = _strict_float(d[label].strip())
            if value is None or _CONTROL.search(d[label]):
                bad.append(f"iteration {step} {label} {d[label][:20]!r}")
                continue
            cols[key][0].append(step)
            cols[key][1].append(value)
    for key, (steps, values) in cols.items():
        if steps:
            series[key] = make_series(steps, values, key)
    if bad:
        notes.append(f"{len(bad)} validation value(s) not read (first: {bad[0]})")


def _is_megatron_log(path: Path, head: bytes | None) -> bool:
    return head is not None and b"iteration" in head and b"|" in head


SOURCE = Source("megatron_log", 40, _is_megatron_log, parse_megatron_log,
                "a Megatron-LM log ('iteration N/M | ... |' lines)", markers=(b"| lm loss", b"consumed samples"))


# ------------------------------------------------------------------------------------------------------
# The canonical fast path: one translate and one pyarrow CSV read over the whole text
# ------------------------------------------------------------------------------------------------------

_TO_PIPE = bytes.maketrans(b":", b"|")
_RECORD_TAIL = re.compile(rb"iteration:?\s*(?:\d+\s*(?:/\s*(?:\d+\s*)?)?)?$")   # a record a newline may split
_CONTINUES_B = re.compile(rb"^\s*[A-Za-z][^|\[\]]*?:\s*[^|]*\|")
_HEAD = "iteration[ \t]*(?P<n>\\d{1,15})[ \t]*/[ \t]*(?P<m>\\d+)[ \t]*$"   # blanks only (no \v\f at a digit)
_HEAD_B = re.compile(_HEAD.encode())
_COUNTED = ("Traceback (most recent call last)", "validation loss at")   # what the careful path counts


class _Canonical:
    """What the fast path read: the records' columns, and the lines that are not records (kept for the
    validation, traceback and 'lm loss:' counts the careful path takes over the whole text)."""

    def __init__(self, iters: np.ndarray, cols: dict[str, np.ndarray], total: int | None, others: bytes,
                 pipes_ok: bool, n_loss: int, n_records: int, present: dict[str, np.ndarray] | None = None,
                 notes: list[str] | None = None) -> None:
        self.iters, self.cols, self.total, self.others = iters, cols, total, others
        self.pipes_ok, self.n_loss, self.n_records = pipes_ok, n_loss, n_records
        # garbled values: which rows hold each key (None: every row), and the notes on what was not read
        self.present, self.notes = present, notes or []


def _read_canonical(raw: bytes) -> _Canonical | None:
    """Read a log whose every record has the first record's layout in bulk, with no Python object per line:
    ':' becomes '|' (length kept), pyarrow splits every line at '|' and reads the value columns as float64,
    lines of another column count go to a handler and are checked for anything record-like.

    A few garbled values (a value that is not a number in at most a tenth of the records) are read as the
    careful path reads them: every column as text, the records whose values are all numbers in bulk, the
    others field by field (``_garbled_rows``).

    ``None`` whenever the careful path could read anything differently (a wrapped or cut record, a name out
    of place, separator counts that do not add up, no pyarrow): that path then reads the file as before, so
    results are the same either way (tests compare both on mixed logs)."""
    if importlib.util.find_spec("pyarrow") is None:
        return None
    m = _RECORD.search(raw)
    if m is None or b"\n" in m.group(0) or m.group(0)[9:10] == b":":
        return None
    names = _template([m.group(1)])
    if names is None or any(w in n for n in names for w in _COUNTED):
        return None
    import pyarrow.compute as pc

    prefix = raw[raw.rfind(b"\n", 0, m.start()) + 1: m.start()]
    head = prefix.count(b":") + prefix.count(b"|")           # the column holding '... iteration N/ M'
    name_cols = [head + 1 + 2 * j for j in range(len(names))]
    value_cols = [c + 1 for c in name_cols]
    if not is_utf8(raw):
        return None
    ncols, most = head + 2 + 2 * len(names), 1000 + len(raw) // 10_000
    got = read_split(raw, ncols, set(value_cols), most, utf8=True, translate=_TO_PIPE)
    garbled = got is None
    if garbled and raw.endswith(b"\n"):   # a value that is not a number? every column as text, looked at below
        got = read_split(raw, ncols, set(), most, utf8=True, translate=_TO_PIPE)
    if got is None:
        return None   # a line that is not UTF-8, or mostly other text
    table, rejected = got
    n = table.num_rows
    col = table.column
    colnames = table.column_names
    if not n or pc.max(pc.binary_length(col(colnames[-1]))).as_py():     # text after the last '|'
        return None
    template = raw[m.start(): _line_end(raw, m.start())].translate(_TO_PIPE).decode("utf-8").split("|")
    for c, _ in zip(name_cols, names, strict=True):      # every name in its place, spaced as in the first
        if not pc.all(pc.equal(col(colnames[c]), template[c - head])).as_py():
            return None
    # text before the head holds nothing the careful path would read or count (searched in the columns'
    # data buffers: a word across two rows can only send the file to the careful path, never be missed)
    words = (b"iteration", b"lm loss", *(w.encode() for w in _COUNTED))
    if any(holds(col(colnames[c]), words) for c in range(head)) or holds(col(colnames[head]), words[2:]):
        return None
    got = _head_numbers(col(colnames[head]))
    if got is None:
        return None
    iters, total = got
    others = originals(raw, rejected, _TO_PIPE)
    if others is None or any(_RECORD.search(o) or _RECORD_TAIL.search(o) or _CONTINUES_B.match(o) for o in others):
        return None   # something record-like outside the bulk rows: the careful path re-joins and notes
    first_sep = re.search(rb"[:|]", prefix)
    if first_sep is not None and first_sep.group(0) == b":" and _could_start_field(col(colnames[0])) and pc.any(
            pc.match_substring_regex(col(colnames[0]), r"^[ \t]*[A-Za-z][^|\[\]]*$")).as_py():
        return None   # a record line that starts like a continued field: the careful path looks closer
    # '|' in the text, counted from the layout (a record that swapped a ':' and a '|' reads as its layout,
    # as it did before this path existed)
    raw_pipes = n * (prefix.count(b"|") + len(names) + 1) + sum(o.count(b"|") for o in others)
    cols: dict[str, np.ndarray] = {}
    values = None
    if garbled:
        got = _garbled_rows(table, [colnames[c] for c in value_cols], raw)
        if got is None:
            return None
        values, bad_rows = got
    n_inf = 0
    for j, (c, name) in enumerate(zip(value_cols, names, strict=True)):
        unit = _UNIT.search(name)
        sec = _seconds_key(name, unit.group(1)) if unit else None
        if values is not None:
            v = values[j]
            cols[sec or _key(name)] = v * 1000.0 if sec else v
            continue
        v = col(colnames[c]).to_numpy()
        n_inf += int(np.isinf(v).sum())
        cols[sec or _key(name)] = v * 1000.0 if sec else v if v.flags.writeable else v.copy()
    if n_inf and n_inf != sum(raw.count(w) - sum(o.count(w) for o in others) for w in _INF_TEXT):
        return None   # an inf read from a finite literal beyond the float range (1e400): the careful path notes it
    n_loss = n * sum(1 for name in names if name.endswith("lm loss")) + sum(o.count(b"lm loss:") for o in others)
    pipes_ok = raw_pipes == n * (len(cols) + 1)
    if values is None:
        return _Canonical(iters, cols, total if total < 1 << 53 else None, b"\n".join(others), pipes_ok, n_loss, n)
    # the records with a garbled value, field by field (as the careful path reads every record it cannot
    # read in bulk): what they hold is kept, what they do not is noted
    issues = _Issues()
    present = {k: np.ones(n, dtype=bool) for k in cols}
    keep = np.ones(n, dtype=bool)
    iters = iters.copy()
    for i, rec in bad_rows:
        for k in present:
            present[k][i] = False
        try:
            it, got_values = _parse_record(rec, issues, False)
        except ValueError as exc:
            issues.add("head", "", -1, str(exc))
            keep[i] = False
            continue
        iters[i] = it
        for k, v in got_values.items():
            if k not in cols:
                cols[k] = np.full(n, np.nan)
                present[k] = np.zeros(n, dtype=bool)
            cols[k][i] = v
            present[k][i] = True
    if not keep.all():
        iters = iters[keep]
        cols, present = {k: v[keep] for k, v in cols.items()}, {k: p[keep] for k, p in present.items()}
    return _Canonical(iters, cols, total if total < 1 << 53 else None, b"\n".join(others), pipes_ok, n_loss, n,
                      present, issues.notes())


def _garbled_rows(table: Any, value_names: list[str], raw: bytes
                  ) -> tuple[list[np.ndarray], list[tuple[int, bytes]]] | None:
    """Value columns read as text: each as float64 (NaN where its record is not read in bulk), and the
    records (row, the record's text from 'iteration' on, as ``_RECORD`` finds it) to read field by field.

    As the careful path's bulk read (``_bulk_masked``): a value is a number when its text, blanks trimmed,
    matches ``_NUMBER_RE2``; a record with any other value, or an infinite one, is read field by field.
    The last record is always read field by field, as the careful path reads it (it may be cut). None when
    that is more than a tenth of the records, there are too few records for the careful path's bulk read, or
    a garbled record holds text the careful path counts over the whole file (validation lines, tracebacks)
    or cannot be found again in ``raw``."""
    import pyarrow as pa
    import pyarrow.compute as pc

    n = table.num_rows
    if n <= _BISECT_MIN:
        return None
    texts = [pc.utf8_trim(table.column(c), " \t") for c in value_names]
    ok = np.ones(n, dtype=bool)
    values = []
    for t in texts:
        try:            # a column of numbers only reads as the float columns of the clean path do
            v = pc.cast(t, pa.float64()).to_numpy(zero_copy_only=False)
        except (pa.ArrowInvalid, pa.ArrowTypeError):   # the garbled column(s): which values are numbers
            is_num = pc.match_substring_regex(t, _NUMBER_RE2)
            v = pc.cast(pc.if_else(is_num, t, "nan"), pa.float64()).to_numpy(zero_copy_only=False)
            ok &= is_num.to_numpy(zero_copy_only=False)
        values.append(v if v.flags.writeable else v.copy())
    if ok.all() or (~ok).sum() > n // 10:
        return None
    for v in values:
        ok &= ~np.isinf(v)       # inf (a literal, or one beyond the float range): field by field
    ok[-1] = False
    bad = np.flatnonzero(~ok)
    if len(bad) > n // 10:
        return None
    rows = table.take(pa.array(bad)).to_pydict()
    lines = ["|".join(r) for r in zip(*rows.values(), strict=True)]
    bad_texts = [t.take(pa.array(bad)).to_pylist() for t in texts]
    out = []
    pos = 0
    for r, (i, line) in enumerate(zip(bad.tolist(), lines, strict=True)):
        # found by its garbled value (rare text; the last record: by its longest value, from the end)
        last = i == n - 1
        pieces = [x[r] for x in bad_texts if x[r]]
        failing = [x for x in pieces if not re.fullmatch(_NUMBER_RE2, x)] or pieces
        anchor = max(failing, key=len) if last else failing[0]
        if not anchor:
            return None
        start = find_line(raw, line.encode("utf-8"), anchor.encode("utf-8"), _TO_PIPE, pos, last)
        if start < 0:
            return None
        pos = start + len(line.encode("utf-8")) + 1
        line = raw[start: pos - 1]
        m = _RECORD.search(line)
        if m is None or b"validation loss" in line or b"Traceback" in line:
            return None
        for v in values:
            v[i] = np.nan
        out.append((i, m.group(1)))
    return values, out


_INF_TEXT = (b"inf |", b"Inf |", b"INF |")   # how Python prints an inf value before its '|' ('-inf' too)
_FIELD_START = np.zeros(256, dtype=bool)
_FIELD_START[list(b" \tABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")] = True


def _could_start_field(column: Any) -> bool:
    """Whether a string of the column starts with a blank or a letter (as a continued field does): a cheap
    look at first bytes before the regex (a timestamp column starts with '[' or a digit on every line)."""
    return bool(_FIELD_START[first_bytes(column)].any())


def _head_numbers(heads: Any) -> tuple[np.ndarray, int] | None:
    """Iteration numbers of the head column (``... iteration N/ M``) and the last record's ``M``; None when a
    head does not end that way. Heads of one width (Megatron pads N and M to 8) are read with numpy."""
    import pyarrow as pa
    import pyarrow.compute as pc

    text = heads[-1].as_py().encode("utf-8")
    last = _HEAD_B.search(text)
    if last is None:
        return None
    total = int(last.group("m"))
    lengths = pc.min_max(pc.binary_length(heads))
    if lengths["min"].as_py() == lengths["max"].as_py() == len(text):
        got = _fixed_width_numbers(heads, len(text), last.start(), text.index(b"/", last.start()))
        if got is not None:
            return got, total
    ext = pc.extract_regex(heads, _HEAD)
    if ext.null_count:
        return None
    return pc.cast(pc.struct_field(ext, "n"), pa.int64()).to_numpy(), total


def _fixed_width_numbers(heads: Any, width: int, start: int, slash: int) -> np.ndarray | None:
    """Every head has the last one's shape ('iteration' and '/' at the same byte offsets, blanks and one run
    of digits between and after them): N read digit by digit with numpy, no per-line objects."""
    rows = fixed_width_rows(heads, width)
    if not (rows[:, start: start + 9] == np.frombuffer(b"iteration", dtype=np.uint8)).all() or \
            not (rows[:, slash] == ord("/")).all():
        return None
    n_block = rows[:, start + 9: slash]
    iters = digit_run(n_block, spaces_only=True)   # the usual padding (spaces only) holds no \v \f to look for
    if iters is None and ((n_block == 11) | (n_block == 12)).any():   # \v \f next to a digit: the careful
        return None                                                   # path leaves it unread
    total = rows[:, slash + 1:]
    if not (total == total[-1]).all() and digit_run(total) is None:   # M: the same on every line, usually
        return None
    return iters if iters is not None else digit_run(n_block)


def _line_end(raw: bytes, pos: int) -> int:
    end = raw.find(b"\n", pos)
    return len(raw) if end < 0 else end


# ------------------------------------------------------------------------------------------------------
# The first printed window: from Megatron-LM core 0.16 the line after the first printed iteration also
# averages that iteration (training.py ``should_reset = not is_first_iteration``)
# ------------------------------------------------------------------------------------------------------

#: Megatron-LM prints every argument it has (450+ in core 0.12); a block this short was cut by hand.
FULL_BLOCK = 100
_F32 = 2.0 ** -23   # float32 rounding of the accumulated sum (relative, generous)
_MAX_SEGMENTS = 20  # process starts looked at (a log concatenated from many restarts: the first 20)


def _window_keys(series: dict[str, pd.Series]) -> list[str]:
    """The keys Megatron accumulates over a printed window and divides by its iteration count: every loss
    of ``total_loss_dict`` (``lm loss``, MoE ``load_balancing_loss`` / ``z_loss``, ``mtp_1 loss``, ...)."""
    return sorted(k for k in series if k == "loss" or k.endswith("_loss"))


def _half_unit(value: float) -> float:
    """Half the last printed digit of ``%.6E`` (how Megatron prints every averaged loss)."""
    if not math.isfinite(value) or value == 0.0:
        return 0.0
    return 0.5 * 10.0 ** (math.floor(math.log10(abs(value))) - 6)


def averaging_evidence(config: dict[str, Any]) -> tuple[str, str]:
    """Whether the log's Megatron-LM keeps its first printed iteration in the next line's mean:
    ``("averaged" | "single" | "unknown", why)``, told by the arguments block (Megatron-LM prints no version)."""
    if not config:
        return "unknown", "the log has no arguments block to tell the Megatron-LM version"
    found = [a for a in SINCE_CORE_0_16 if a in config]
    if len(found) >= 2:
        return "averaged", (f"the arguments block lists {found[0]} and {found[1]}, arguments of Megatron-LM core "
                            ">= 0.16, whose line after the first printed iteration is the mean over both")
    if not getattr(config, "abbreviated", False) and len(config) >= FULL_BLOCK:
        return "single", (f"the arguments block ({len(config)} arguments) has none of {', '.join(SINCE_CORE_0_16)}:"
                          " Megatron-LM before core 0.16, which resets its means after every printed line")
    return "unknown", (f"the arguments block is cut short ({len(config)} arguments) and does not tell the "
                       "Megatron-LM version")


def _first_pairs(iters: np.ndarray) -> list[tuple[int, int]]:
    """(first, second) iteration printed by each process in the log (a record not above the one before it
    starts a new process: a restart), where no later record of the log prints those iterations again."""
    n = len(iters)
    if n < 2:
        return []
    starts = np.concatenate(([0], np.flatnonzero(iters[1:] <= iters[:-1]) + 1))
    out = []
    for s in starts[:_MAX_SEGMENTS]:
        s = int(s)
        if s + 1 >= n or iters[s + 1] <= iters[s]:
            continue
        i0, i1 = int(iters[s]), int(iters[s + 1])
        if len(starts) > 1 and (np.flatnonzero(iters == i0)[-1] != s or np.flatnonzero(iters == i1)[-1] != s + 1):
            continue    # printed again by a later process: the series hold that process's values
        out.append((i0, i1))
    return out


def _at(series: dict[str, pd.Series], key: str, step: int) -> float | None:
    s = series.get(key)
    if s is None or step not in s.index:
        return None
    return float(s.loc[step])


def first_windows(series: dict[str, pd.Series], iters: np.ndarray, config: dict[str, Any],
                  notes: list[str]) -> list[dict[str, Any]]:
    """Read the line after each process's first printed iteration as what it is.

    From Megatron-LM core 0.16, ``training_log`` prints a process's first iteration i0 and keeps it in its
    accumulators, so the next line (i1) averages the losses over [i0, i1] and its elapsed time too; with
    ``--log-interval 1`` iteration 2 prints the mean of iterations 1 and 2. Where the arguments block says
    so, the step's own values are recovered (``n*A - L(i0)`` over the rest of the window) and the series hold
    them; where the version cannot be told, the values stay as printed and the entry holds the other
    reading, so a comparison can weigh both. Returns the entries for ``meta["log_windows"]``."""
    state, why = averaging_evidence(config)
    interval = config.get("log_interval") if config else None
    interval = interval if isinstance(interval, int) and not isinstance(interval, bool) and interval > 0 else None
    out: list[dict[str, Any]] = []
    if state == "single":
        return out
    for i0, i1 in _first_pairs(iters):
        # the window [i0, i1] has one iteration more than a regular one only when i0 is itself on a boundary
        if (i1 - i0 != interval) if interval is not None else (i1 != i0 + 1):
            continue
        entry = _window_entry(series, i0, i1, state, why)
        if entry is None:
            continue
        out.append(entry)
        if state == "averaged":
            for key, value in entry["recovered"].items():
                s = series[key].copy()
                if value is None:
                    s = s.drop(i1)
                else:
                    s.loc[i1] = value
                series[key] = s
        notes.append(entry["message"])
    return out


def _window_entry(series: dict[str, pd.Series], i0: int, i1: int, state: str, why: str) -> dict[str, Any] | None:
    """The values iteration ``i1`` printed, the values of iteration i1 alone had it averaged [i0, i1], their
    rounding bounds and the sentence saying so; None where the log itself shows no averaging."""
    n = i1 - i0 + 1
    e0, e1 = _at(series, "elapsed_ms", i0), _at(series, "elapsed_ms", i1)
    if e0 is not None and e1 is not None and n * (e1 + 0.05) < e0 - 0.05:
        # averaged, the time printed at i1 would be at least the first iteration's over n: it is not
        if state == "averaged":
            return {"step": i1, "first": i0, "iterations": n, "state": "single", "printed": {}, "recovered": {},
                    "error": {}, "message": f"iteration {i1}: not read as a mean over iterations {i0}-{i1} although "
                    f"{why}: its elapsed time ({e1:g} ms) is below iteration {i0}'s over {n} ({e0:g} ms / {n}), "
                    "so this Megatron-LM resets after the first printed line"}
        return None
    skipped0 = _at(series, "skipped_iterations", i0) or 0.0
    skipped = _at(series, "skipped_iterations", i1) or 0.0
    advanced = n - int(skipped)            # iterations whose losses the printed means add up
    printed: dict[str, float] = {}
    recovered: dict[str, float | None] = {}
    error: dict[str, float] = {}
    parts: list[str] = []
    for key in _window_keys(series):
        a, first = _at(series, key, i1), _at(series, key, i0)
        if a is None or skipped0 >= 1:
            continue   # iteration i0 skipped: its losses were never added, the printed means exclude it
        if not math.isfinite(a) or (first is not None and not math.isfinite(first)):
            continue   # a non-finite mean: nothing to read back (the nonfinite stage names the step)
        printed[key] = a
        if first is None or advanced < 2:
            recovered[key] = None
            parts.append(f"{key} unknown (iteration {i0}'s {key} not printed)" if first is None
                         else f"{key} unknown (no other iteration of the window advanced)")
            continue
        value = (advanced * a - first) / (advanced - 1)
        bound = (advanced * (_half_unit(a) + _F32 * abs(a)) + _half_unit(first)) / (advanced - 1)
        recovered[key], error[key] = value, bound
        parts.append(f"{key} {advanced} x {a:.6E} - {first:.6E} = {value:.7g} (+-{bound:.1e})")
    if not printed:
        return None
    if e0 is not None and e1 is not None and math.isfinite(e0) and math.isfinite(e1):
        printed["elapsed_ms"] = e1
        recovered["elapsed_ms"] = (n * e1 - e0) / (n - 1)
        error["elapsed_ms"] = (n * 0.05 + 0.05) / (n - 1)
    if state == "unknown" and (recovered.get("loss") or 0.0) < 0.0:
        return None    # a negative cross-entropy: the printed value is no mean over the window
    precision = ("Megatron prints means with %.6E (7 significant digits) and sums them in float32; the bound "
                 "adds both roundings")
    if state == "averaged":
        message = (f"iteration {i1}: Megatron-LM printed the mean over iterations {i0}-{i1} ({why}); iteration "
                   f"{i1}'s own values recovered: {'; '.join(parts)}. {precision}")
    else:
        message = (f"iteration {i1}: its values may be the mean over iterations {i0}-{i1} (Megatron-LM core >= 0.16"
                   f" prints that on the line after a process's first iteration, here with a log interval of "
                   f"{i1 - i0}) and {why}: kept as printed; read as a mean, iteration {i1}'s own would be: "
                   f"{'; '.join(parts)}. The step comparisons weigh both readings")
    return {"step": i1, "first": i0, "iterations": n, "state": "recovered" if state == "averaged" else "ambiguous",
            "printed": printed, "recovered": recovered, "error": error, "message": message}


_PADDED = re.compile(rb"> padded vocab \(size: (\d{1,12})\) with (\d{1,12}) dummy tokens \(new size: (\d{1,12})\)")


def padded_vocab_line(raw: bytes) -> dict[str, Any]:
    """``> padded vocab (size: 128) with 0 dummy tokens (new size: 128)``, printed by every Megatron-LM when it
    builds the tokenizer: the tokenizer's vocabulary and the padded one the embedding has."""
    i = find_text(raw, b"> padded vocab (size:")   # ('>' is rare in a log: absent, this skips a slow scan)
    m = _PADDED.search(raw, i, i + 200) if i >= 0 else None
    if m is None:
        return {}
    size, extra, padded = (int(g) for g in m.groups())
    if size + extra != padded:
        return {}
    return {"vocab_size": padded, "tokenizer_vocab_size": size,
            "vocab_source": f"the log's '> padded vocab (size: {size}) ... (new size: {padded})' line"}
