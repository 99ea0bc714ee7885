"""Two run stores compared bit for bit, for runs that must write the same thing (demo.fault_batch: a candidate run
in a process shared with other runs, and the same run in a process of its own).

Every array and attribute of every step file, every scalar record, every other file's bytes; JSON files with the
stores' own locations replaced and process ids set aside (the only things that differ between two writes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import h5py
import numpy as np

VOLATILE_KEYS = {"pid"}


def _h5(path: Path) -> dict[str, Any]:
    """Every group's and dataset's attributes and every dataset's dtype, shape and bytes."""
    out: dict[str, Any] = {}
    with h5py.File(path, "r") as h5:
        def visit(name: str, obj: Any) -> None:
            attrs = {k: (np.asarray(v).dtype.str, np.asarray(v).tobytes()) for k, v in obj.attrs.items()}
            if isinstance(obj, h5py.Dataset):
                arr = np.asarray(obj[()])
                out[name] = (arr.dtype.str, arr.shape, arr.tobytes(), attrs)
            else:
                out[name] = ("group", attrs)

        visit("/", h5)
        h5.visititems(visit)
    return out


def _json(text: str, roots: list[tuple[Path, str]], lines: bool) -> Any:
    for root, token in roots:
        text = text.replace(str(root), token)

    def drop(obj: Any) -> Any:
        if isinstance(obj, dict):
            return {k: drop(v) for k, v in obj.items() if k not in VOLATILE_KEYS}
        return [drop(v) for v in obj] if isinstance(obj, list) else obj

    return [drop(json.loads(line)) for line in text.splitlines() if line.strip()] if lines else drop(json.loads(text))


def store_differences(a: Path, b: Path, roots: tuple[Path, Path] | None = None) -> list[str]:
    """What differs between stores ``a`` and ``b`` (empty: bit-identical). ``roots``: two folders (one holding each
    store's inputs, e.g. the pair's output) whose paths count as equal, besides the stores' own."""
    ra = [(a, "@STORE@")] + ([(roots[0], "@ROOT@")] if roots else [])
    rb = [(b, "@STORE@")] + ([(roots[1], "@ROOT@")] if roots else [])
    fa = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file())
    fb = sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file())
    diffs = [f"only in one store: {sorted(set(fa) ^ set(fb))}"] if fa != fb else []
    if not fa:
        diffs.append(f"{a}: no files")
    for rel in sorted(set(fa) & set(fb)):
        pa, pb = a / rel, b / rel
        if rel.endswith(".h5"):
            ha, hb = _h5(pa), _h5(pb)
            bad = sorted(k for k in set(ha) | set(hb) if ha.get(k) != hb.get(k))
            if bad:
                diffs.append(f"{rel}: {bad[:5]}")
        elif rel.endswith(".npz"):
            with np.load(pa, allow_pickle=False) as za, np.load(pb, allow_pickle=False) as zb:
                bad = sorted(k for k in set(za.files) | set(zb.files) if k not in za.files or k not in zb.files
                             or za[k].dtype != zb[k].dtype or za[k].tobytes() != zb[k].tobytes())
            if bad:
                diffs.append(f"{rel}: {bad[:5]}")
        elif rel.endswith((".json", ".jsonl")):
            lines = rel.endswith(".jsonl")
            if _json(pa.read_text(), ra, lines) != _json(pb.read_text(), rb, lines):
                diffs.append(f"{rel}: differs")
        elif pa.read_bytes() != pb.read_bytes():
            diffs.append(f"{rel}: bytes differ")
    return diffs
