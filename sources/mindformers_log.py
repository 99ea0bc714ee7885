"""MindFormers training logs -> Run.

Reads what MindFormers prints, from its own format strings (mindformers/core/callback/callback.py):

* MFLossMonitor step lines, 2.x (``loss`` is lm + aux + MTP, the separate losses follow when
  ``print_separate_loss`` is on, ``train_throughput_per_npu`` ends mcore lines; sink mode prints
  ``loss: X`` without the ``[step/avg]`` brackets)::

    { Epoch:[  1/  1], step:[    2/    6], loss:[4.146456/4.156389], lm_loss: 4.140000, load_balancing_loss:
    0.006456, per_step_time: 373ms, lr: 0.0005, overflow cond: False, loss_scale: 1.0, global_norm:
    [1.507098], train_throughput_per_npu: 2.849T

* 1.x lines (``loss: %5.3f`` in sink mode, no global_norm) and 0.x lines without the brace
  (``Epoch:[..], step:[..], loss:[a/b], time:12.345 ms, lr:0.0001, overflow cond: False, loss_scale: 1.0``);
* with ``local_norm=True`` the ``norm_size: (...)`` + ``local_norm:`` + ``[...]`` blocks printed just before
  the step they belong to: squared sums, unnamed, in the optimizer's order, kept as ``#<index>``;
* TrainingStateMonitor (``monitor_config.local_norm_format: log``) lines
  ``Epoch:[  1/  1], step:[    1/    4] local_norm/<param name>: <value>``: L2 norms *with names*, which
  replace the unnamed blocks of that step, so step-1 local norms compare by name from a log alone.

When the line holds ``lm_loss`` the run's ``loss`` series is that LM loss (what Megatron's ``lm loss`` is)
and MindFormers' printed total goes to ``total_loss``; a note and ``meta["loss_key"]`` say so. A field that
cannot be read (``loss_scale: unavailable``, a garbled number) is skipped and noted; the step's other
fields are kept. The config that MindFormers pprints at start-up is read as a literal when present.
A directory of msrun worker logs (``output/msrun_log/worker_N.log``) is read by :func:`parse_mindformers_dir`.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from core.errors import BadInput
from models.mindformers_parallel import strategy_from_yaml
from runstore.run import Run, make_series
from sources import Source
from sources.logtext import (
    all_equal,
    any_ends_with,
    clean_text,
    digit_run,
    find_line,
    fixed_width_rows,
    int_column,
    read_log_bytes,
    read_split,
)

# "{ Epoch:[..], step:[..]," (2.x/1.x), "Epoch:[..], step:[..]," (0.x) and TrainingStateMonitor's
# "Epoch:[..], step:[..] tag: value" (no comma after the step bracket). Numbers are ASCII digits padded with
# spaces ("%3d", "%5d"): nothing else (a control byte, a Unicode digit) is read as part of a step.
_STEP = re.compile(r"(\{ ?)?Epoch:\[ *([0-9]+)/ *([0-9]+)\], *step:\[ *([0-9]+)/ *([0-9]+)\](,?)(.*)$")
# where a record starts: a step head, the norm_size / local_norm lines of a local_norm block
_RECORD_START = re.compile(r"(?:\{ ?)?Epoch:\[|(?<![\w/])(?:norm_size|local_norm):")
# the logger's prefix ("2026-11-22 06:55:02,505 - name[file.py:747] - INFO - ") left at the end of a record
# whose newline was lost: the next record's, not a part of this record's last value
_TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[,.]\d{3} - ")
_LOG_PREFIX = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[,.]\d{3} - .*? - [A-Z]+ - *")
_MONITOR = re.compile(r"^ *(local_norm/.+?|[A-Za-z_][\w\-]*(?:/[^:]*)?): *(.*?)[ \t]*$")
_FIELD = re.compile(r"\s*([A-Za-z_][A-Za-z_ ]*?):\s*(\[[^\]:]*\]?|[^,]*)\s*(?:,|$)")  # '[' never spans a ':'
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_ ]{0,47}", re.ASCII)   # a field name; "time" of "time:12 ms" too
_NORM_SIZE = re.compile(r"norm_size:\s*\(([^)]*)\)")
_END = re.compile(r"(\]|\d+(?:\.\d+)?T|loss_scale: ?\S+|global_norm: ?[-+\w.]+)\s*$")
# a number as Python and pyarrow both read it, ASCII only ('1_0', '\u0661', '0x1F' are not numbers here)
_NUM = (r"[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?(?:[iI][nN][fF](?:[iI][nN][iI][tT][yY])?|[nN][aA][nN])")
_NUMBER = re.compile(_NUM, re.ASCII)
_NONFINITE = re.compile(r"[-+]?(?:[iI][nN][fF](?:[iI][nN][iI][tT][yY])?|[nN][aA][nN])", re.ASCII)
_BLANK = " \t"                 # what pads a value; any other byte (a control byte) is part of it
MAX_STEP = 10 ** 12            # a step beyond this is a garbled number, not a step
_MAX_DIGITS = 12
_RESERVED = frozenset({"step", "epoch"})   # never a scalar key (the run store's "step" is the record's own)
# The line as MFLossMonitor prints it (MindFormers 1.x-2.x, with the optional 2.x fields); a file whose step
# lines all match is parsed in bulk, anything else takes the careful line-by-line path.
_N = _NUM.encode()
_FAST = re.compile(
    rb"\{ ?Epoch:\[ *(\d{1,12})/ *\d{1,12}\], *step:\[ *(\d{1,12})/ *(\d{1,12})\],"
    rb"[ \t]*loss:(?:\[[ \t]*(" + _N + rb")/[ \t]*(" + _N + rb")\]|[ \t]*(" + _N + rb")),"
    rb"(?:[ \t]*lm_loss:[ \t]*(" + _N + rb"),)?(?:[ \t]*load_balancing_loss:[ \t]*(" + _N + rb"),)?"
    rb"(?:[ \t]*mtp_loss:[ \t]*(" + _N + rb"),)?(?:[ \t]*indexer_loss:[ \t]*(" + _N + rb"),)?"
    rb"[ \t]*per_step_time:[ \t]*([0-9.]+)ms,(?:[ \t]*lr:[ \t]*(" + _N + rb"),)?[ \t]*overflow cond:[ \t]*"
    rb"(True|False),[ \t]*loss_scale:[ \t]*(" + _N + rb"),[ \t]*global_norm:[ \t]*(?:\[[ \t]*(" + _N
    + rb")[ \t]*\]|(" + _N + rb"))"
    rb"(?:,[ \t]*train_throughput_per_npu:[ \t]*([0-9.]+)T)?[ \t]*$", re.M)
_FAST_LINE = re.compile(_FAST.pattern.decode(), re.ASCII)      # the same line, one at a time (careful path)
# group index (after epoch, step, steps-per-epoch) -> key; loss and global_norm come bracketed or not
_FAST_KEYS = {3: "loss", 4: "loss_avg", 5: "loss", 6: "lm_loss", 7: "load_balancing_loss", 8: "mtp_loss",
              9: "indexer_loss", 10: "per_step_time_ms", 11: "lr", 12: "overflow", 13: "loss_scale",
              14: "grad_norm", 15: "grad_norm", 16: "throughput_tflops_per_npu"}

FIELDS = {
    "loss": "loss",
    "per_step_time": "per_step_time_ms",
    "time": "per_step_time_ms",            # 0.x: "time:12.345 ms"
    "lr": "lr",
    "overflow cond": "overflow",
    "loss_scale": "loss_scale",
    "global_norm": "grad_norm",
    "lm_loss": "lm_loss",
    "load_balancing_loss": "load_balancing_loss",
    "mtp_loss": "mtp_loss",
    "indexer_loss": "indexer_loss",
    "train_throughput_per_npu": "throughput_tflops_per_npu",
}
LM_LOSS_NOTE = ("loss = MindFormers' lm_loss (comparable with Megatron's 'lm loss'); MindFormers' printed "
                "loss (lm + aux + MTP) is total_loss")


def strict_float(text: str) -> float:
    """A number as printed, or ValueError: blanks (space, tab) around it only, ASCII digits, and no overflow
    (``1e400`` is a garbled value, not infinity; ``inf`` / ``nan`` printed as such are read)."""
    t = text.strip(_BLANK)
    if not _NUMBER.fullmatch(t):
        raise ValueError(f"not a number: {text!r}")
    v = float(t)
    if v - v != 0 and not _NONFINITE.fullmatch(t):
        raise ValueError(f"out of range: {text!r}")
    return v


def _number(text: str) -> float:
    t = text.strip(_BLANK)
    if t in ("True", "False"):
        return float(t == "True")
    for unit in ("ms", "T"):
        if t.endswith(unit):
            t = t[: -len(unit)].rstrip(_BLANK)
            break
    return strict_float(t)


def step_number(*fields: str) -> int | None:
    """The global step of a head's epoch, steps per epoch and step texts (ASCII digits, as ``_STEP`` found
    them); None when a number is longer than any step or the step falls outside 0..MAX_STEP."""
    if any(len(f) > _MAX_DIGITS for f in fields):
        return None
    epoch, per_epoch, step = (int(f) for f in fields)
    gstep = (epoch - 1) * per_epoch + step
    return gstep if 0 <= gstep <= MAX_STEP else None


def _ends_complete(line: str) -> bool:
    """The step line ends with its last field's whole value (only the tail is looked at)."""
    tail = line.rstrip()
    return tail.endswith("]") or bool(_END.search(tail[-80:]))


def _last_field(lines: list[str]) -> str | None:
    """The field that ends this run's step lines (all lines of a run share MFLossMonitor's format)."""
    counts: Counter[str] = Counter()
    for ln in lines:
        if "Epoch:[" in ln and "], step:[" in ln and "loss" in ln:
            name = ln.rstrip().rsplit(",", 1)[-1].split(":", 1)[0].strip()
            if _NAME.fullmatch(name):          # a garbled tail (glued text) has no say
                counts[name] += 1
    return counts.most_common(1)[0][0] if counts else None


def _cut_short(line: str, last_field: str | None) -> bool:
    """A step line that stops before its run's last field, or inside that field's value."""
    if not _ends_complete(line):
        return True
    if last_field is None:
        return False
    name, _, value = line.rstrip().rsplit(",", 1)[-1].partition(":")
    value = value.strip()
    if name.strip() != last_field or not value:
        return True
    return last_field == "train_throughput_per_npu" and not value.endswith("T")


_LINE_HEAD = re.compile(r"\s*(?:\[[A-Z]+\] )?\d{4}-\d\d-\d\d|\s*(?:\{ ?)?Epoch:\[|local_norm:|\{'")


def _starts_line(line: str) -> bool:
    """A line the logger started (its time stamp, a step head, local_norm:, the config dict): a wrapped
    record is never continued by one (a terminal cut piece does not start like a log line)."""
    return bool(_LINE_HEAD.match(line))


def _unwrap(lines: list[str]) -> tuple[list[str], int]:
    """logtext.unwrap's terminal-width joins (a line of the width, not complete, goes on in the next one),
    except onto a line the logger started: a record cut short (or garbled at its end) is never continued by
    the next record."""
    lengths = Counter(len(x) for x in lines if len(x) >= 40)
    if not lengths or lengths[max(lengths)] < 2:
        return lines, 0
    width = max(lengths)
    out: list[str] = []
    joins = 0
    buf: str | None = None
    for line in lines:
        if buf is not None and not _starts_line(line):
            buf += line
            joins += 1
        else:
            if buf is not None:
                out.append(buf)
            buf = line
        if len(line) == width and not _is_complete(buf):
            continue
        out.append(buf)
        buf = None
    if buf is not None:
        out.append(buf)
    return out, joins


def _is_complete(line: str) -> bool:
    at = line.find("Epoch:[")
    if at < 0:
        return "local_norm" not in line and "norm_size" not in line or line.rstrip().endswith(")")
    m = _STEP.search(line, max(0, at - 2))
    if m and not m.group(6):   # TrainingStateMonitor "tag: value"
        return bool(re.search(r"[\d\]]\s*$", line))
    return _ends_complete(line)


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


def _has_local_norms(raw: bytes) -> bool:
    """Whether the log prints local norms (``norm_size:``, ``local_norm:``, ``local_norm/<name>``): one scan
    per word, however many other 'local_norm' (a config dump's key) it holds."""
    if b"norm_size:" in raw:
        return True
    at = raw.find(b"local_norm")
    while at >= 0:
        if raw[at + 10: at + 11] in (b":", b"/"):
            return True
        at = raw.find(b"local_norm", at + 10)
    return False


def _fast(raw: bytes, path: str | Path, notes: list[str]) -> tuple[dict[str, pd.Series], dict[str, Any]] | None:
    """All step lines in MFLossMonitor's format and no local_norm output: parse them in bulk. Returns the
    series and the run's meta, or None for the careful line-by-line path."""
    bulk = _bulk(raw)
    if bulk is not None:
        cols, config, read_notes = bulk
        notes.extend(read_notes)
    else:
        cols, config = _regex_rows(raw), _has_config_block(raw)
        if cols is None:
            return None
    meta = _meta(path, raw.decode("utf-8", "replace").split("\n") if config else [])
    return _series(cols, notes, meta), meta


def _has_config_block(raw: bytes) -> bool:
    """A line starts with "{'": the config dict MindFormers pprints (read only when there)."""
    return raw.startswith(b"{'") or b"\n{'" in raw


def _regex_rows(raw: bytes) -> dict[str, tuple[list[int], list[float]]] | None:
    """The step columns by one regex over the whole file (without pyarrow, or a layout it cannot split)."""
    if _has_local_norms(raw):
        return None
    rows = _FAST.findall(raw)
    if not rows or len(rows) != raw.count(b"Epoch:[") or len(rows) != raw.count(b"step:["):
        return None
    cols = list(zip(*rows, strict=True))
    try:
        epoch = np.array(cols[0]).astype(np.int64)
        step = np.array(cols[1]).astype(np.int64)
        per_epoch = np.array(cols[2]).astype(np.int64)
    except ValueError:
        return None
    gstep = _global_steps(epoch, per_epoch, step)
    if gstep is None:
        return None
    out: dict[str, tuple[list[int], list[float]]] = {}
    for idx, key in _FAST_KEYS.items():
        col = np.array(cols[idx])
        have = col != b""
        if not have.any():
            continue
        try:
            values = (col[have] == b"True").astype(np.float64) if key == "overflow" else \
                col[have].astype(np.float64)
        except ValueError:
            return None  # an unreadable value: the careful path skips just that value and notes it
        bad = ~np.isfinite(values)
        if bad.any() and not all(_NONFINITE.fullmatch(t.decode().strip(_BLANK)) for t in col[have][bad]):
            return None  # '1e400': a value out of range, which the careful path notes
        steps, vals = out.setdefault(key, ([], []))
        steps.extend(gstep[have].tolist())
        vals.extend(values.tolist())
    return out


def _global_steps(epoch: np.ndarray, per_epoch: np.ndarray, step: np.ndarray) -> np.ndarray | None:
    """(epoch - 1) * per_epoch + step for int64 columns; None when a step could fall outside 0..MAX_STEP
    (the careful reader notes those lines one by one)."""
    if not len(epoch):
        return None
    top = [int(x.max()) for x in (epoch, per_epoch, step)]
    if int(epoch.min()) < 1 or int(step.min()) < 0 or int(per_epoch.min()) < 0 \
            or (top[0] - 1) * top[1] + top[2] > MAX_STEP:
        return None
    return (epoch - 1) * per_epoch + step


_TO_PIPE = bytes.maketrans(b",:[]/", b"|||||")
_SEPARATORS = frozenset(b",:[]/")
_INT_GROUPS = (1, 2, 3)          # epoch, step, steps per epoch
_SUFFIX = {11: b"ms", 17: b"T"}  # per_step_time: 561ms, train_throughput_per_npu: 2.849T
_OVERFLOW = 13
# a line that is not a step row (pyarrow hands it back, separators as '|') and sends the file to the careful
# reader: a step line of another layout, local norms (MFLossMonitor's or TrainingStateMonitor's)
_OTHER_LINE = re.compile(r"Epoch|step\|\||norm_size\||local_norm\|")


def _bulk(raw: bytes) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], bool, list[str]] | None:
    """Every step line in the first one's layout (MFLossMonitor's format): read in one pass with pyarrow
    (',', ':', '[', ']' and '/' all separate columns), no Python object per line. Returns the columns,
    whether a config dict is printed and the notes on what was not read. None sends the file to the regex
    reader: pyarrow missing, another layout, a step line the columns do not explain, local norms. Reads
    exactly what that reader reads (tests compare both).

    A few values that are not numbers (at most a tenth of the lines) keep the file here: the value columns
    are read as text, and the lines holding such a value are read one by one as the careful reader reads
    them (``_garbled_lines``), what they hold kept and what they do not noted."""
    m = _FAST.search(raw)
    if m is None or b"(" in raw and b"nan(" in raw:   # pyarrow reads 'nan(1)' as NaN, Python's float not
        return None
    start = raw.rfind(b"\n", 0, m.start()) + 1
    end = raw.find(b"\n", m.start())
    line = raw[start: end if end >= 0 else len(raw)]
    seps = np.cumsum([0] + [c in _SEPARATORS for c in line])      # separators before each offset
    pieces = line.translate(_TO_PIPE).split(b"|")
    head = int(seps[m.start() - start])
    roles: dict[int, int] = {}
    for g in range(1, len(m.groups()) + 1):
        if m.group(g) is None:
            continue
        c = int(seps[m.start(g) - start])
        if pieces[c].strip() != m.group(g) + _SUFFIX.get(g, b""):
            return None
        roles[c] = g
    floats = {c for c, g in roles.items() if g not in _INT_GROUPS and g not in _SUFFIX and g != _OVERFLOW}
    got = read_split(raw, len(pieces), floats, 1000 + len(raw) // 10_000, translate=_TO_PIPE)
    garbled = got is None and bool(floats) and raw.endswith(b"\n")
    if garbled:          # a value that is not a number? the value columns as text, looked at below
        got = read_split(raw, len(pieces), set(), 1000 + len(raw) // 10_000, translate=_TO_PIPE)
    if got is None:
        return None
    table, other = got
    if not table.num_rows or any(_OTHER_LINE.search(t) for t in other):
        return None   # a step line of another layout (or two on one line), local norms: the careful reader
    import pyarrow as pa
    import pyarrow.compute as pc

    col = table.column
    names = [str(i) for i in range(len(pieces))]
    # What the text before the step head (time stamp, logger) may not hold, so that a row is a step line and
    # nothing else: these words end a column there ('Epoch:[', 'norm_size:' ...), and "{'" starts a line
    # (the config dict). Checked on the columns instead of scanning the whole file for each word.
    if pc.any(pc.starts_with(col(names[0]), "{'")).as_py():
        return None
    if any(any_ends_with(col(names[c]), (b"Epoch", b"norm_size", b"local_norm")) for c in range(head)):
        return None
    tail = m.group(0)[: m.group(0).index(b"Epoch") + 5].decode()
    for c in range(head + 1, len(pieces)):      # everything between the values, as in the first line
        if c not in roles and not all_equal(col(names[c]), pieces[c].decode("utf-8")):
            return None
    if not pc.all(pc.ends_with(col(names[head]), tail)).as_py():
        return None
    values: dict[int, np.ndarray] = {}
    ok = np.ones(table.num_rows, dtype=bool)      # rows read in bulk (garbled: the others line by line)
    for c, g in roles.items():
        x = col(names[c])
        if g in _INT_GROUPS:
            v = int_column(x, spaces_only=True)
        elif g == _OVERFLOW:
            t = pc.utf8_trim(x, " \t")
            if not pc.all(pc.is_in(t, pa.array(["True", "False"]))).as_py():
                return None
            v = pc.equal(t, "True").to_numpy(zero_copy_only=False).astype(np.float64)
        elif g in _SUFFIX:
            v = _suffix_values(x, _SUFFIX[g])
        elif garbled:
            t = pc.utf8_trim(x, " \t")
            try:     # a column of numbers only reads as the float columns of a clean file do
                v = pc.cast(t, pa.float64()).to_numpy(zero_copy_only=False)
            except (pa.ArrowInvalid, pa.ArrowTypeError):   # the garbled column: which values are numbers
                is_num = pc.match_substring_regex(t, f"^(?:{_NUM})$")
                try:
                    v = pc.cast(pc.if_else(is_num, t, "nan"), pa.float64()).to_numpy(zero_copy_only=False)
                except (pa.ArrowInvalid, pa.ArrowTypeError):
                    return None
                ok &= is_num.to_numpy(zero_copy_only=False)
        else:
            v = x.to_numpy()
        if v is None:
            return None
        values[g] = v if v.flags.writeable else v.copy()
    gstep = _global_steps(values[1], values[3], values[2])
    if gstep is None:
        return None
    infinite = [np.isinf(values[g]) for g in roles.values() if g not in _INT_GROUPS]
    if not garbled and any(x.any() for x in infinite):
        return None   # 'inf' or a number out of range ('1e400', read as inf): the regex reader tells them apart
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for idx, key in _FAST_KEYS.items():
        if idx + 1 in values:
            out[key] = (gstep, values[idx + 1])
    config = any(t.startswith("{'") for t in other)
    if not garbled:
        return out, config, []
    for x in infinite:       # read line by line, as the careful reader tells 'inf' and '1e400' apart
        ok &= ~x
    got = _garbled_lines(raw, table, ok, gstep, out, line.decode("utf-8", "replace"), [names[c] for c in floats])
    return None if got is None else (got[0], config, got[1])


def _suffix_values(column: Any, unit: bytes) -> np.ndarray | None:
    """Numbers with a unit glued on ('561ms', '2.849T') as float64; None when a string is anything but
    blanks, digits and dots, the unit, blanks. Strings of one width holding whole numbers (a steady step
    time) are read with numpy, others with pyarrow's regex and cast."""
    import pyarrow as pa
    import pyarrow.compute as pc

    lengths = pc.min_max(pc.binary_length(column))
    width, k = lengths["max"].as_py(), len(unit)
    if width is not None and width == lengths["min"].as_py() and width > k:
        rows = fixed_width_rows(column, width)
        if (rows[:, width - k:] == np.frombuffer(unit, dtype=np.uint8)).all() and \
                (rows[:, width - k - 1] - np.uint8(48) < 10).all():    # digits right up to the unit
            v = digit_run(rows[:, : width - k], spaces_only=True)
            if v is not None:
                return v.astype(np.float64)
    text = unit.decode()
    if not pc.all(pc.match_substring_regex(column, f"^[ \t]*[0-9.]+{text}[ \t]*$")).as_py():
        return None   # (blanks are spaces and tabs: '\x0b84ms' is not 84 ms)
    try:
        return pc.cast(pc.utf8_rtrim(pc.utf8_trim(column, " \t"), text), pa.float64()).to_numpy()
    except pa.ArrowInvalid:
        return None   # '1.2.3ms'


def _garbled_lines(raw: bytes, table: Any, ok: np.ndarray, gstep: np.ndarray,
                   bulk: dict[str, tuple[np.ndarray, np.ndarray]], first: str, value_names: list[str]
                   ) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], list[str]] | None:
    """The columns of a file read in bulk but for the rows ``ok`` leaves out: those lines read one by one,
    as the careful reader reads them (its fields, its notes, the order in which keys first appear). None
    (the careful reader reads the whole file) when they are more than a tenth of the lines, or a line is
    anything but one whole step line (cut, wrapped, two records, local norms) or cannot be found again."""
    import pyarrow as pa

    n = len(ok)
    bad = np.flatnonzero(~ok)
    if not len(bad) or len(bad) > n // 10:
        return None
    rows = table.take(pa.array(bad)).to_pydict()
    texts = ["|".join(r) for r in zip(*rows.values(), strict=True)]
    values = [rows[c] for c in value_names]       # a line is found again by its garbled value (rare text)
    last_field = _last_field([first])         # every row has the first one's field names (checked by the caller)
    skips, unknown = _Skips(), Counter()
    got: list[tuple[int, int, dict[str, float]]] = []
    pos = 0
    for r, (i, text) in enumerate(zip(bad.tolist(), texts, strict=True)):
        pieces = [v[r] for v in values if v[r].strip(_BLANK)]
        failing = [x for x in pieces if not _NUMBER.fullmatch(x.strip(_BLANK))] or pieces or [text]
        start = find_line(raw, text.encode("utf-8"), failing[0].encode("utf-8"), _TO_PIPE, pos)
        if start < 0:
            return None
        pos = start + len(text.encode("utf-8")) + 1
        line = raw[start: pos - 1].decode("utf-8")
        at = line.find("Epoch:[")
        if not _is_complete(line) or line.count("Epoch:[") != 1 or "norm_size" in line or "local_norm" in line:
            return None
        m = _STEP.search(line, max(0, at - 2))
        step = step_number(m.group(2), m.group(5), m.group(4)) if m else None
        if m is None or step is None or not m.group(6):
            return None
        standard = _read_standard(line, m.start())
        vals = standard or _read_fields(m.group(7), step, skips, unknown)
        if not vals or standard is None and _cut_short(line, last_field):
            return None
        got.append((i, step, vals))
    # keys in the order the careful reader first meets them: lines before the first bulk row, then the bulk
    # columns, then keys only garbled lines hold
    first_ok = int(np.argmax(ok))
    order = [k for i, _, vals in got if i < first_ok for k in vals]
    order += list(bulk) + [k for i, _, vals in got if i > first_ok for k in vals]
    cols: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for key in dict.fromkeys(order):
        v = bulk[key][1].copy() if key in bulk else np.full(n, np.nan)
        have = ok.copy() if key in bulk else np.zeros(n, dtype=bool)
        steps = gstep.copy()
        for i, step, vals in got:
            steps[i] = step
            have[i] = key in vals
            if key in vals:
                v[i] = vals[key]
        cols[key] = (steps[have], v[have])
    notes = skips.notes()
    if unknown:
        notes.append("fields this reader does not know, kept under their own names: "
                     + ", ".join(f"{k!r} ({c} step(s))" for k, c in list(unknown.items())[:5]))
    return cols, notes


class _Skips:
    """Unreadable values, grouped per field so a value missing at every step is one note, not 100k."""

    def __init__(self) -> None:
        self.by_field: dict[str, list[Any]] = {}

    def add(self, field: str, step: int, value: str) -> None:
        entry = self.by_field.setdefault(field, [0, [], value[:30]])
        entry[0] += 1
        if len(entry[1]) < 5:
            entry[1].append(step)

    def notes(self) -> list[str]:
        out = []
        for field, (count, steps, example) in self.by_field.items():
            where = ("step " if count == 1 else "steps ") + ", ".join(str(s) for s in steps) + (
                ", ..." if count > len(steps) else "")
            out.append(f"{field!r}: unreadable value {example!r} at {count} step(s) ({where}); value skipped, "
                       "the steps' other fields kept")
        return out


_STRAY = "text without 'name: value'"
_LOOKS_LIKE_STEP = re.compile(r"step:\[|(?<![\w'])(?:per_step_time|global_norm|overflow cond|loss_scale):")
_LOCAL_NORM_LINE = re.compile(r"(?<![\w/])local_norm:")
# a line of a numpy array printed over several lines: numbers, blanks, the brackets ('...' when summarized)
_ARRAY_LINE = re.compile(r"[ \t]*\[?[-+0-9.eEnaifNIFty \t,]*\]?[ \t]*")


def _split_fields(rest: str) -> tuple[list[tuple[str, str]], list[str]]:
    """``name: value, name:[a/b], ...`` -> pairs, and the pieces of text that are not ``name: value`` (a field
    whose ':' was lost): plain string splits (fast), the regex when a bracket holds a comma."""
    parts = rest.split(",")
    stray: list[str] = []
    if any(p.count("[") != p.count("]") for p in parts):
        pairs, pos = [], 0
        for fm in _FIELD.finditer(rest):
            if rest[pos: fm.start()].strip(" ,"):
                stray.append(rest[pos: fm.start()].strip(_BLANK))
            pairs.append((fm.group(1).strip(_BLANK), fm.group(2).strip(_BLANK)))
            pos = fm.end()
        if rest[pos:].strip(" ,"):
            stray.append(rest[pos:].strip(_BLANK))
        return pairs, stray
    out = []
    for part in parts:
        name, sep, value = part.partition(":")
        if sep:
            out.append((name.strip(_BLANK), value.strip(_BLANK)))
        elif part.strip(_BLANK):
            stray.append(part.strip(_BLANK))
    return out, stray


_KEYS: dict[str, str] = {}


def _key(name: str) -> str:
    key = FIELDS.get(name) or _KEYS.get(name)
    if key is None:
        key = _KEYS[name] = re.sub(r"\W+", "_", name).strip("_").lower()
    return key


def _read_standard(line: str, start: int) -> dict[str, float] | None:
    """A line in MFLossMonitor's exact format from ``start`` (its head) to its end, read with one regex; None
    sends it to the field reader."""
    m = _FAST_LINE.match(line, start)
    if m is None:
        return None
    groups = m.groups()
    values: dict[str, float] = {}
    try:
        for idx, key in _FAST_KEYS.items():
            g = groups[idx]
            if g:
                values[key] = float(g == "True") if key == "overflow" else _number(g)
    except ValueError:
        return None
    return values


def _read_fields(rest: str, gstep: int, skips: _Skips, unknown: Counter[str]) -> dict[str, float]:
    """The fields of one step line; what cannot be read is skipped and noted (never shortened, never split
    at a control byte: a value is a whole number or it is not read)."""
    values: dict[str, float] = {}
    pairs, stray = _split_fields(rest)
    dup: set[str] = set()
    for text in stray:
        skips.add(_STRAY, gstep, text)
    for name, value in pairs:
        key = _key(name) if _NAME.fullmatch(name) else ""
        if not key or key in _RESERVED:
            skips.add(_STRAY, gstep, f"{name}: {value}")
            continue
        try:
            if value.startswith("["):
                if not value.endswith("]"):                 # cut before its closing bracket
                    raise ValueError(value)
                inner = value[1:-1]
                if key == "loss" and "/" in inner:          # loss:[this step/average]
                    step_loss, avg = inner.split("/")       # (a third part: ValueError)
                    got = {"loss": strict_float(step_loss), "loss_avg": strict_float(avg)}
                else:
                    got = {key: _number(inner)}             # one number: '[1 31049]' is not one
            else:
                got = {key: _number(value)}
        except ValueError:
            skips.add(name, gstep, value)
            continue
        if any(k in values or k in dup for k in got):      # the same field twice: text glued on, not one record
            dup.update(got)
            for k in got:
                values.pop(k, None)
            skips.add(name, gstep, f"{value} (the field twice in one line)")
            continue
        values.update(got)
        if key not in FIELDS.values():
            unknown[name] += 1
    return values


def _split_records(lines: list[str]) -> tuple[list[str], int]:
    """One record per line: a line that holds more than one record head (a step line, a norm_size or
    local_norm line: newlines lost) is cut before each head after the first; the logger prefix of the next
    record left at the end of the one before is dropped. Returns the lines and how many were cut."""
    out: list[str] = []
    cut = 0
    for line in lines:
        if line.count("Epoch:[") + line.count("norm_size:") + line.count("local_norm:") < 2:
            out.append(line)
            continue
        starts = [m.start() for m in _RECORD_START.finditer(line)]
        if len(starts) < 2:
            out.append(line)
            continue
        prev = 0
        for c in starts[1:]:
            seg = line[prev:c]
            stamps = list(_TIMESTAMP.finditer(seg, seg.find("Epoch:[") + 1))   # the last one, after the head
            at = stamps[-1].start() if stamps else -1
            out.append(seg[:at] if at >= 0 and _LOG_PREFIX.fullmatch(seg, at) else seg)
            prev = c
        out.append(line[prev:])
        cut += 1
    return out, cut


def parse_mindformers_log(path: str | Path) -> Run:
    """Parse one MindFormers log into a Run (BadInput when it holds no step lines)."""
    raw = clean_text(read_log_bytes(path))
    notes: list[str] = []
    # a last line without its newline may be cut inside its last value: only the careful reader drops that
    tail_open = bool(raw) and not raw.endswith(b"\n") and b"Epoch:[" in raw[raw.rfind(b"\n") + 1:]
    last_line = raw[raw.rfind(b"\n") + 1:]
    if last_line.strip():
        notes.append("the log ends inside a line (no final newline: a cut copy?): "
                     f"{last_line[-40:].decode('utf-8', 'replace')!r}")
    fast = None if tail_open else _fast(raw, path, notes)
    if fast is not None:
        return Run(str(path), "mindformers_log", fast[1], fast[0], {}, notes)
    text_lines = raw.decode("utf-8", "replace").split("\n")
    if any(not _is_complete(x) for x in text_lines[:-1]):
        text_lines, joins = _unwrap(text_lines)
        if joins:
            notes.append(f"re-joined {joins} lines wrapped by a terminal")
    text_lines, splits = _split_records(text_lines)
    if splits:
        notes.append(f"{splits} line(s) held more than one record (newlines lost); each record read on its own")

    last_field = _last_field(text_lines)
    cols: dict[str, tuple[list[int], list[float]]] = {}
    local_norms: dict[int, pd.DataFrame] = {}
    named: dict[int, tuple[list[str], list[float]]] = {}
    other_tags: dict[str, int] = {}
    unknown: Counter[str] = Counter()
    skips = _Skips()
    unread: list[str] = []          # lines that look like step lines but have no readable head
    lost_norms = 0                  # local_norm blocks whose step line never came
    pending_norm: tuple[list[int], list[float]] | None = None
    steps_seen = 0
    cut: list[int] = []
    i = 0
    n = len(text_lines)
    while i < n:
        line = text_lines[i]
        if "norm_size:" in line:
            lost_norms += pending_norm is not None
            pending_norm, i = _norm_block(text_lines, i, notes)
            continue
        at = line.find("Epoch:[")
        i += 1
        m = _STEP.search(line, max(0, at - 2)) if at >= 0 else None
        gstep = step_number(m.group(2), m.group(5), m.group(4)) if m else None
        if gstep is None:
            if m or at >= 0 or _LOOKS_LIKE_STEP.search(line):
                where = max(line.find("step:["), line.find("Epoch:["), line.find("{ E"))
                unread.append(line[max(0, where - 12):].strip(_BLANK) if where >= 0 else line.strip(_BLANK))
                lost_norms += pending_norm is not None
                pending_norm = None
            elif _LOCAL_NORM_LINE.search(line):
                notes.append(f"a local_norm block without its norm_size line ({line.strip()[:60]!r}); ignored")
            continue
        assert m is not None
        rest = m.group(7)
        unterminated = tail_open and i == n       # the file's last line, with no newline: maybe cut
        if not m.group(6):
            if unterminated:
                skips.add("last line (no newline: maybe cut)", gstep, rest.strip(_BLANK))
            else:
                _monitor_line(rest, gstep, named, other_tags, skips)
            continue
        standard = _read_standard(line, m.start())     # matched through the end of the line: whole
        values = standard or _read_fields(rest, gstep, skips, unknown)
        if not values:
            skips.add("step line", gstep, rest.strip())
            lost_norms += pending_norm is not None
            pending_norm = None
            continue
        if unterminated and not rest.rstrip(_BLANK).endswith(("]", "T")):
            cut.append(gstep)                      # a plain number at the cut end may have lost digits
            values.pop(next(reversed(values)))
        elif standard is None and _cut_short(line, last_field):
            cut.append(gstep)
            # the value the cut ran through may be truncated: drop it, if it was read at all (a garbled last
            # field was already skipped, and the field before it is whole)
            tail_name = rest.rstrip().rsplit(",", 1)[-1].split(":", 1)[0].strip()
            last = next(reversed(values))
            if not rest.rstrip().endswith("]") and last == _key(tail_name):
                values.pop(last)
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
    lost_norms += pending_norm is not None
    if steps_seen == 0 and not named:
        raise BadInput(f"{path}: no MindFormers '{{ Epoch:[..], step:[..], loss:[..] ...' lines found"
                       + (f" ({len(unread)} unreadable step line(s), e.g. {unread[0][:80]!r})" if unread else ""))
    if cut:
        notes.append(f"{len(cut)} step line(s) cut short (steps {', '.join(map(str, cut[:5]))}"
                     f"{', ...' if len(cut) > 5 else ''}); the field at the cut dropped, the others kept")
    if unread:
        notes.append(f"{len(unread)} step line(s) with an unreadable step head or step number (e.g. "
                     f"{unread[0][:80]!r}); not read")
    if lost_norms:
        notes.append(f"{lost_norms} local_norm block(s) not followed by a readable step line; ignored")
    notes.extend(skips.notes())
    if unknown:
        notes.append("fields this reader does not know, kept under their own names: "
                     + ", ".join(f"{k!r} ({c} step(s))" for k, c in list(unknown.items())[:5]))
    seen = Counter(name for names, _ in named.values() for name in set(names))
    if len(named) > 1:
        rare = [name for name, c in seen.items() if c == 1 and max(seen.values()) > 1]
        if rare:
            notes.append(f"TrainingStateMonitor local norm name(s) seen at one step only (garbled?): "
                         f"{', '.join(repr(x) for x in rare[:5])}")
    for step, (names, norms) in named.items():
        if step in local_norms:
            notes.append(f"step {step}: named TrainingStateMonitor local norms used instead of the unnamed "
                         "local_norm block")
        local_norms[step] = pd.DataFrame({"name": names, "norm": np.asarray(norms, dtype=np.float64),
                                          "numel": np.full(len(names), -1, np.int64)})
    if other_tags:
        shown = ", ".join(f"{t} ({c})" for t, c in list(other_tags.items())[:5])
        notes.append(f"TrainingStateMonitor tags not read: {shown}")
    meta = _meta(path, text_lines)
    if named:
        meta["name_scheme"] = "mindformers"
    series = _series(cols, notes, meta)
    return Run(str(path), "mindformers_log", meta, series, local_norms, notes)


def _series(cols: dict[str, tuple[list[int], list[float]]], notes: list[str],
            meta: dict[str, Any]) -> dict[str, pd.Series]:
    """Per-key series; with ``lm_loss`` present, ``loss`` becomes the LM loss and the total ``total_loss``."""
    if "lm_loss" in cols and "loss" in cols:
        cols["total_loss"] = cols.pop("loss")
        if "loss_avg" in cols:
            cols["total_loss_avg"] = cols.pop("loss_avg")
        cols["loss"] = cols["lm_loss"]
        meta["loss_key"] = "lm_loss"
        notes.append(LM_LOSS_NOTE)
    elif "loss" in cols:
        meta["loss_key"] = "loss"
    return {k: make_series(st, v, k) for k, (st, v) in cols.items()}


def _monitor_line(rest: str, gstep: int, named: dict[int, tuple[list[str], list[float]]],
                  other_tags: dict[str, int], skips: _Skips) -> None:
    """``local_norm/<name>: value`` from TrainingStateMonitor (a name may hold spaces); other tags are
    counted, not read. A value that is not one number, or a name with a control byte, is skipped and noted."""
    mm = _MONITOR.match(rest)
    if not mm:
        skips.add("TrainingStateMonitor line", gstep, rest.strip(_BLANK))
        return
    tag, value = mm.group(1), mm.group(2)
    if not tag.startswith("local_norm/"):
        head = tag.split("/", 1)[0]
        other_tags[head] = other_tags.get(head, 0) + 1
        return
    name = tag[len("local_norm/"):]
    v = value.strip(_BLANK)
    if v.startswith("[") and v.endswith("]"):
        v = v[1:-1]
    try:
        if not name.strip() or not name.isprintable():
            raise ValueError(name)
        norm = strict_float(v)
    except ValueError:
        skips.add(tag, gstep, value)
        return
    names, norms = named.setdefault(gstep, ([], []))
    names.append(name)
    norms.append(norm)


def parse_mindformers_dir(path: str | Path) -> Run:
    """msrun's ``worker_N.log`` files (one per rank, ``output/msrun_log``) as one run.

    ``scalars`` and ``local_norms`` come from the lowest rank that logged a loss (every rank prints the
    MFLossMonitor line); ``rank_scalars`` keeps each rank's series, and each rank's named local norms are
    kept with a ``rank`` column, since TP shards differ by rank.
    """
    root = Path(path)
    logs = worker_logs(root)
    if not logs:
        raise BadInput(f"{root}: no msrun worker logs (worker_N.log) in it or in its msrun_log/")
    runs: dict[int, Run] = {}
    notes: list[str] = []
    folder = logs[0][1].parent
    odd = sorted(f.name for f in folder.glob("worker_*.log") if f.name not in {g.name for _, g in logs})
    if odd:
        notes.append(f"not read (not a worker_N.log file, or a second name for a rank): {', '.join(odd[:5])}")
    ranks = [r for r, _ in logs]
    missing = sorted(set(range(max(ranks) + 1)) - set(ranks))
    if missing:
        notes.append(f"no worker log for rank(s) {', '.join(map(str, missing[:10]))}"
                     f"{', ...' if len(missing) > 10 else ''} (ranks {ranks[0]}..{ranks[-1]} found)")
    for rank, f in logs:
        try:
            runs[rank] = parse_mindformers_log(f)
        except BadInput as exc:
            notes.append(f"{f.name}: {exc}".replace(str(f) + ": ", ""))
            continue
        notes.extend(f"{f.name}: {note}" for note in runs[rank].notes)
    if not runs:
        raise BadInput(f"{root}: none of {len(logs)} worker logs holds MindFormers step lines")
    main = next((r for r in sorted(runs) if runs[r].has("loss")), min(runs))
    first = runs[main]
    meta = dict(first.meta)
    meta["source"] = {"kind": "mindformers_log", "path": str(root), "workers": len(logs)}
    if not missing:
        meta["parallel"] = {"world_size": len(logs)}   # (with a rank missing, the world size is not known)
    cfg = meta.get("config")
    if isinstance(cfg, dict) and cfg.get("parallel_config") is not None:
        try:   # the layout the printed config launched (every value checked before it sizes anything)
            strategy = strategy_from_yaml(cfg)
            layout = strategy.meta()
        except BadInput as exc:
            notes.append(f"parallel_config in the printed config not read: {exc}")
        else:
            meta["parallel"] = {**layout, **meta.get("parallel", {})}
            if not missing and strategy.world != len(logs):
                notes.append(f"the printed parallel_config makes {strategy.world} ranks, but {len(logs)} worker "
                             "logs are here")
    local: dict[int, pd.DataFrame] = {}
    for step in sorted({s for r in runs.values() for s in r.local_norms}):
        frames = [runs[r].local_norms[step].assign(rank=r) for r in sorted(runs) if step in runs[r].local_norms]
        local[step] = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]
    notes.insert(0, f"{len(runs)} msrun worker log(s); scalars from rank {main}")
    run = Run(str(root), "mindformers_log", meta, dict(first.scalars), local, notes)
    run.rank_scalars = {r: dict(x.scalars) for r, x in sorted(runs.items())}
    return run


def worker_logs(path: Path) -> list[tuple[int, Path]]:
    """(rank, file) of ``worker_N.log`` in ``path`` or ``path/msrun_log``, by rank."""
    for folder in (path, path / "msrun_log"):
        found = []
        for f in folder.glob("worker_*.log") if folder.is_dir() else []:
            m = re.fullmatch(r"worker_(0|[1-9][0-9]{0,5})\.log", f.name)   # 'worker_01.log' is not rank 1
            if m and not f.is_dir():      # a FIFO or device is refused by its reader (a note), never skipped
                found.append((int(m.group(1)), f))
        if found:
            return sorted(found)
    return []


def _meta(path: str | Path, text_lines: list[str]) -> dict[str, Any]:
    return {
        "framework": "mindformers",
        "source": {"kind": "mindformers_log", "path": str(path)},
        "config": _config_block(text_lines),
        "name_scheme": "index",
    }


def _norm_block(lines: list[str], i: int, notes: list[str]) -> tuple[tuple[list[int], list[float]] | None, int]:
    """Read ``norm_size: (...)`` / ``local_norm:`` / ``[...]`` starting at line ``i``. The array runs over
    lines that hold only numbers; a block whose array does not close there is noted and ignored, and the line
    that stopped it (the next step line) is read as usual."""
    m = _NORM_SIZE.search(lines[i])
    sizes: list[int] = []
    if m is None:
        notes.append(f"line {i + 1}: norm_size without its closing ')'; sizes dropped")
    else:
        tokens = [t for t in re.split(r"[ \t,]+", m.group(1)) if t]
        if all(re.fullmatch(r"[0-9]{1,18}", t) for t in tokens):
            sizes = [int(t) for t in tokens]
        else:   # a garbled size: the norms are still good, their sizes are not (issue 14)
            notes.append(f"line {i + 1}: unreadable norm_size entries; sizes dropped")
    j = i + 1
    while j < len(lines) and j < i + 3 and "local_norm:" not in lines[j] and "Epoch:[" not in lines[j] \
            and "norm_size:" not in lines[j]:
        j += 1
    if j >= len(lines) or "local_norm:" not in lines[j]:
        notes.append(f"line {i + 1}: norm_size without a local_norm block after it; ignored")
        return None, i + 1
    buf = lines[j].split("local_norm:", 1)[1]
    k = j + 1
    while "]" not in buf and k < len(lines) and k < j + 100000 and _ARRAY_LINE.fullmatch(lines[k]):
        buf += " " + lines[k]
        k += 1
    body = buf.strip(_BLANK)
    if not body.startswith("[") or "]" not in body:
        notes.append(f"line {j + 1}: local_norm block not closed; ignored")
        return None, k
    try:
        values = [strict_float(x) for x in re.split(r"[ \t,]+", body[1:body.index("]")].strip(" \t,"))]
    except ValueError:
        notes.append(f"line {j + 1}: unreadable local_norm values; ignored")
        return None, k
    if sizes and len(sizes) != len(values):
        notes.append(f"line {j + 1}: norm_size has {len(sizes)} entries but local_norm {len(values)}; "
                     "sizes dropped")
        sizes = []
    return (sizes, values), k


def _is_mindformers_log(path: Path, head: bytes | None) -> bool:
    if head is None:
        return any(path.glob("worker_*.log")) or any((path / "msrun_log").glob("worker_*.log"))
    return b"Epoch:[" in head or b"local_norm:" in head


def _load(path: Path) -> Run:
    return parse_mindformers_dir(path) if path.is_dir() else parse_mindformers_log(path)


SOURCE = Source("mindformers_log", 30, _is_mindformers_log, _load,
                "a MindFormers log ('Epoch:[..], step:[..]' lines) or a folder of msrun worker_N.log files",
                markers=(b"Epoch:[",))
