"""JSON files users hand us (golden values, msprobe's dump.json), read so that bad input is one line.

``json.loads`` raises RecursionError on deep nesting, ValueError past Python's 4300-digit integer limit, and
reads ``1e400`` as inf: here each is a one-line BadInput naming the file, or a number kept as its text
(``Huge``), which a reader refuses or notes, never a wrong value.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from core.errors import BadInput


class Huge(str):
    """A JSON number beyond the float range (1e400, a 400-digit integer), kept as its text: no value."""


def _parse_float(text: str) -> float | Huge:
    v = float(text)
    return Huge(text) if math.isinf(v) else v


def _parse_int(text: str) -> int | Huge:
    # Python refuses int() of more than 4300 digits (ValueError); a float holds at most ~309
    return Huge(text) if len(text) > 310 else int(text)


def load_json(path: Path, what: str = "JSON") -> Any:
    """A JSON file, or a one-line BadInput naming it (not UTF-8, garbled, nested too deeply); numbers beyond
    the float range are kept as ``Huge`` text (no number), never read as inf."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise BadInput(f"{path}: not UTF-8 text") from None
    except OSError as exc:
        raise BadInput(f"{path}: unreadable ({exc.__class__.__name__})") from None
    try:
        return json.loads(text, parse_float=_parse_float, parse_int=_parse_int)
    except json.JSONDecodeError as exc:
        raise BadInput(f"{path}: garbled {what} at line {exc.lineno} ({exc.msg})") from None
    except RecursionError:
        raise BadInput(f"{path}: {what} nested too deeply to be a real file") from None
    except ValueError as exc:   # (a JSONDecodeError is a ValueError too: caught above)
        raise BadInput(f"{path}: unreadable {what} ({str(exc)[:60]})") from None
