"""Declared schemas for every structured input, and guarded readers for the files that hold them.

Why our own small checker and not a library: the schemas are a subset of JSON Schema (type, properties,
required, items, enum, minimum, maximum, anyOf, additionalProperties) written as plain dicts next to the code that
reads the data, and the one thing we need beyond "valid or not" is a one-line message naming the file and
the key (``meta.json: key 'parallel.tp': expected integer, got str '2x'``). No dependency is added for that.

The readers refuse what is not a regular file (a FIFO would block, a device never ends), decode UTF-8
strictly (naming the offset of the first bad byte) and turn every parser error into ``BadInput``.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any

import yaml

from core.errors import BadInput

_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,), "array": (list, tuple), "string": (str,), "integer": (int,), "number": (int, float),
    "boolean": (bool,), "null": (type(None),),
}
MAX_INPUT_BYTES = 8 << 30


def _kind(v: Any) -> str:
    for name in ("null", "boolean", "integer", "number", "string", "array", "object"):
        if isinstance(v, _TYPES[name]) and not (name in ("integer", "number") and isinstance(v, bool)):
            return name
    return type(v).__name__


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _is(v: Any, t: str) -> bool:
    if t in ("integer", "number") and isinstance(v, bool):
        return False
    if t == "number" and isinstance(v, float):
        return True
    if t == "number" and isinstance(v, int):
        return abs(v) < 1 << 1023       # beyond float range is not a usable number
    if t == "integer" and isinstance(v, int):
        return abs(v) < 1 << 63
    return isinstance(v, _TYPES[t])


def check(obj: Any, schema: dict[str, Any], where: str = "") -> str | None:
    """The first violation as ``key 'a.b[2]': problem``, or None when ``obj`` fits ``schema``."""
    key = f"key '{where}'" if where else "top level"
    if "anyOf" in schema:
        problems = [check(obj, s, where) for s in schema["anyOf"]]
        if all(p is not None for p in problems):
            return next((p for p in problems if p and not p.endswith(f"got {_kind(obj)}")), problems[0])
        return None
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else types
        if not any(_is(obj, t) for t in types):
            got = _kind(obj)
            extra = f" {_show(obj)}" if got in ("string", "integer", "number", "boolean") else ""
            return f"{key}: expected {' or '.join(types)}, got {got}{extra}"
    if "enum" in schema and obj not in schema["enum"]:
        return f"{key}: {_show(obj)} is not one of {', '.join(map(str, schema['enum']))}"
    if isinstance(obj, (int, float)) and not isinstance(obj, bool):
        if "minimum" in schema and not obj >= schema["minimum"]:
            return f"{key}: {_show(obj)} is below the minimum {schema['minimum']}"
        if "maximum" in schema and not obj <= schema["maximum"]:
            return f"{key}: {_show(obj)} is above the maximum {schema['maximum']}"
        if schema.get("finite") and isinstance(obj, float) and not math.isfinite(obj):
            return f"{key}: {_show(obj)} is not a finite number"
    if isinstance(obj, dict):
        for name in schema.get("required", []):
            if name not in obj:
                return f"{key}: missing required key '{name}'" if where else f"missing required key '{name}'"
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for k, v in obj.items():
            sub = f"{where}.{k}" if where else str(k)
            if k in props:
                p = check(v, props[k], sub)
            elif extra is False:
                p = f"key '{sub}': not an allowed key (allowed: {', '.join(props)})"
            elif isinstance(extra, dict):
                p = check(v, extra, sub)
            else:
                p = None
            if p:
                return p
    if isinstance(obj, (list, tuple)):
        if len(obj) < schema.get("minItems", 0):
            return f"{key}: needs at least {schema['minItems']} item(s)"
        items = schema.get("items")
        if items is not None:
            for i, v in enumerate(obj):
                p = check(v, items, f"{where}[{i}]")
                if p:
                    return p
    return None


def validate(obj: Any, schema: dict[str, Any], source: str | os.PathLike) -> Any:
    """``obj`` when it fits ``schema``; else BadInput naming ``source`` and the key."""
    problem = check(obj, schema)
    if problem:
        raise BadInput(f"{source}: {problem}")
    return obj


def regular_file(path: str | os.PathLike, what: str = "file") -> Path:
    """``path`` when it is a regular file; BadInput for missing paths, folders, FIFOs, devices, sockets."""
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise BadInput(f"{p}: no such {what}") from None
    except OSError as exc:
        raise BadInput(f"{p}: cannot read ({exc.strerror or exc.__class__.__name__})") from None
    if stat.S_ISDIR(st.st_mode):
        raise BadInput(f"{p}: is a directory, expected a {what}")
    if not stat.S_ISREG(st.st_mode):
        kind = "FIFO" if stat.S_ISFIFO(st.st_mode) else "socket" if stat.S_ISSOCK(st.st_mode) else "device"
        raise BadInput(f"{p}: is a {kind}, not a regular {what}")
    if st.st_size > MAX_INPUT_BYTES:
        raise BadInput(f"{p}: {st.st_size} bytes is larger than any {what} this tool reads")
    return p


def read_bytes(path: str | os.PathLike, what: str = "file") -> bytes:
    p = regular_file(path, what)
    try:
        return p.read_bytes()
    except OSError as exc:
        raise BadInput(f"{p}: cannot read ({exc.strerror or exc.__class__.__name__})") from None
    except MemoryError:
        raise BadInput(f"{p}: too large to read into memory") from None


def read_text(path: str | os.PathLike, what: str = "file") -> str:
    """UTF-8 text (a BOM is dropped); BadInput naming the offset of the first byte that is not UTF-8."""
    data = read_bytes(path, what)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise BadInput(f"{path}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})") from None


def parse_yaml(text: str, source: str | os.PathLike) -> Any:
    """yaml.safe_load with every failure as one line (syntax, unsafe tags, nesting too deep)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise BadInput(f"{source}: not valid YAML{at} ({exc.__class__.__name__})") from None
    except (RecursionError, ValueError, OverflowError, MemoryError) as exc:
        raise BadInput(f"{source}: YAML not readable ({exc.__class__.__name__})") from None


def parse_json(text: str | bytes, source: str | os.PathLike) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadInput(f"{source}: not valid JSON at line {exc.lineno} ({exc.msg})") from None
    except (RecursionError, ValueError, OverflowError, MemoryError) as exc:
        raise BadInput(f"{source}: JSON not readable ({exc.__class__.__name__})") from None


def load_yaml(path: str | os.PathLike, schema: dict[str, Any] | None = None, what: str = "YAML file") -> Any:
    obj = parse_yaml(read_text(path, what), path)
    return validate(obj, schema, path) if schema is not None else obj


def load_json(path: str | os.PathLike, schema: dict[str, Any] | None = None, what: str = "JSON file") -> Any:
    obj = parse_json(read_text(path, what), path)
    return validate(obj, schema, path) if schema is not None else obj
