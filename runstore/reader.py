"""Reading a run store: meta.json (checked), scalar lines, per-step HDF5 files.

The reader never fails on a run that was killed: a step file left as ``.tmp`` or a torn last scalar line
is listed in ``RunReader.incomplete`` instead. Malformed input is a one-line ``BadInput``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import h5py
import numpy as np

if TYPE_CHECKING:   # pandas is imported where tables are built: readers of arrays alone skip its ~0.8 s import
    import pandas as pd

from core.errors import BadInput
from runstore.h5file import check_dataset, open_h5
from runstore.layout import (
    _RANK_H5_RE,
    _RANK_TMP_RE,
    _SCALAR_RANK_RE,
    _STEP_RE,
    META,
    RANK_DIR,
    SCALAR_DIR,
    STEP_DIR,
)
from runstore.rank_files import check_rank_info, check_sizes_agree
from runstore.schema import load_json, read_bytes, regular_file
from runstore.seed_layout import step_number
from runstore.tables import _dataset_value, check_table, table_columns


@dataclass
class Incomplete:
    step: int | None
    rank: int
    reason: str

    def __str__(self) -> str:
        where = f"step {self.step}" if self.step is not None else "scalars"
        return f"{where}, rank {self.rank}: {self.reason}"


@dataclass
class StepArrays:
    """The arrays of one step on one rank, read fully into memory (they are small: stats, norms, batch)."""

    step: int
    rank: int
    data: dict[str, np.ndarray] = field(default_factory=dict)
    attrs: dict[str, dict[str, Any]] = field(default_factory=dict)
    path: Path | None = None        # the step file, named in a bad-input message

    def table(self, group: str) -> pd.DataFrame | None:
        import pandas as pd

        cols = {k.split("/", 1)[1]: v for k, v in self.data.items()
                if k.startswith(group + "/") and "/" not in k[len(group) + 1:]}
        if cols:
            check_table(self.path or f"step {self.step}, rank {self.rank}", group, cols)
        return pd.DataFrame(cols) if cols else None

def read_h5(path: Path) -> tuple[dict[str, np.ndarray], dict[str, dict[str, Any]]]:
    data: dict[str, np.ndarray] = {}
    attrs: dict[str, dict[str, Any]] = {}
    try:
        size = regular_file(path, "step file").stat().st_size
        with open_h5(path) as h5:
            open_groups: set[int] = set()

            def walk(group: h5py.Group, prefix: str) -> None:
                # Every name, hard links included (visititems visits an object once, under one name:
                # a dumper stores a tensor seen twice once, under two names).
                for name in group:
                    link = group.get(name, getlink=True)
                    if isinstance(link, h5py.ExternalLink):     # never follow a link out of the step file
                        raise BadInput(f"{path}: '{prefix + name}' is an external link to {link.filename!r:.60}; "
                                       "a step file holds its own data")
                    obj = group.get(name)
                    if obj is None:        # a dangling soft link
                        continue
                    key = prefix + name
                    if len(key) > 4096:
                        raise BadInput(f"{path}: object names nest beyond 4096 characters (a link loop?)")
                    if isinstance(obj, h5py.Dataset):
                        check_dataset(path, key, obj, size)
                    if isinstance(obj, h5py.Dataset) and obj.dtype.names is not None:   # a table
                        data.update({f"{key}/{k}": v for k, v in table_columns(obj).items()})
                    elif isinstance(obj, h5py.Dataset):
                        data[key] = _dataset_value(obj)
                    if obj.attrs:
                        attrs[key] = {k: obj.attrs[k] for k in obj.attrs}
                    if isinstance(obj, h5py.Group):
                        ident = hash(obj.id)
                        if ident in open_groups:
                            raise BadInput(f"{path}: '{key}' links back to a group that contains it (a link loop)")
                        open_groups.add(ident)
                        walk(obj, key + "/")
                        open_groups.discard(ident)
            open_groups.add(hash(h5.id))
            walk(h5, "")
            attrs[""] = {k: h5.attrs[k] for k in h5.attrs}
    except (OSError, KeyError, ValueError, RuntimeError, RecursionError, TypeError, OverflowError,
            MemoryError) as exc:
        raise BadInput(f"{path}: not a readable HDF5 file ({' '.join(str(exc).split())[:120]})") from None
    return data, attrs


_SIZE = {"type": ["integer", "null"], "minimum": 1, "maximum": 1 << 20}
#: meta.json's declared shape (docs/run-store.md); other keys are free. Checked when a store is opened.
META_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "schema": {"type": "string"}, "framework": {"type": ["string", "null"]},
        "name_scheme": {"type": ["string", "null"]}, "train_iters": {"type": ["integer", "null"]},
        "source": {"type": ["object", "null"]},
        "config": {"type": ["object", "null"], "properties": {
            "kind": {"type": ["string", "null"]}, "values": {"type": ["object", "null"]}}},
        "dtypes": {"type": ["object", "null"], "additionalProperties": {"type": ["string", "null"]}},
        "parallel": {"type": ["object", "null"], "properties": {
            "tp": _SIZE, "pp": _SIZE, "dp": _SIZE, "ep": _SIZE, "cp": _SIZE, "world_size": _SIZE,
            "gradients_mean": {"type": ["boolean", "null"]},
            # each layer's pipeline stage (MindFormers): a stage below pp, a count below any model's
            "layer_stages": {"type": ["array", "null"], "items": {"type": "integer", "minimum": 0,
                                                                  "maximum": 1 << 20}}}},
    },
}
_SCALAR_TYPES = (int, float, str, bool, type(None), list, dict)
#: Keys whose values are numbers wherever a source writes them (comparators read them as such): a string
#: ("1e-3", "x") or a JSON true there is refused, never converted.
NUMERIC_SCALARS = frozenset({
    "loss", "lm_loss", "grad_norm", "global_norm", "lr", "learning_rate", "loss_scale", "num_zeros",
    "mtp_loss", "load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss", "aux_loss", "z_loss",
    "skipped_iter", "nan_iter", "global_batch_size",
    "consumed_samples", "iteration_time", "throughput", "tokens_per_sec"})


def _check_records(path: Path, records: list[Any], first_line: int = 1) -> None:
    """Every scalar line is an object with an integer ``step`` and plain values, each key a number on every
    line or on none (one-line BadInput naming the file, line and key)."""
    kinds: dict[str, tuple[bool, int]] = {}
    for i, rec in enumerate(records, first_line):
        if type(rec) is not dict:
            raise BadInput(f"{path}:{i}: scalar line is a JSON {type(rec).__name__}, expected an object")
        step = rec.get("step")
        if type(step) is not int or step < 0 or step >= 1 << 62:
            raise BadInput(f"{path}:{i}: key 'step': expected a non-negative integer, got {step!r:.40}")
        for k, v in rec.items():
            if k in NUMERIC_SCALARS and (type(v) not in (int, float) and v is not None):
                raise BadInput(f"{path}:{i}: key '{k}': expected a number, got {v!r:.40}")
            if type(v) is int and abs(v) >= 1 << 1023:
                raise BadInput(f"{path}:{i}: key '{k}': {v!r:.40} is beyond the float range")
            if type(v) not in _SCALAR_TYPES:
                raise BadInput(f"{path}:{i}: key '{k}': unsupported value {v!r:.40}")
            if v is None:
                continue
            number = type(v) in (int, float)
            first = kinds.setdefault(k, (number, i))
            if first[0] != number:
                raise BadInput(f"{path}:{i}: key '{k}': {v!r:.40} where line {first[1]} holds a "
                               f"{'number' if first[0] else 'non-number'}")


def _parse_jsonl(path: Path) -> tuple[list[dict[str, Any]], str | None]:
    """Parse a scalar file; a torn last line (a killed writer) is reported, not fatal."""
    text = read_bytes(path, "scalar file").decode("utf-8", errors="replace")
    lines = text.split("\n")
    torn = None
    if lines and lines[-1] == "":
        lines.pop()
    elif lines:
        torn = lines.pop()
    try:
        records = json.loads("[" + ",".join(lines) + "]") if lines else []
        if len(records) != len(lines):   # a line holding two values ("1, 2") joins into the list unseen
            raise ValueError
    except (ValueError, RecursionError):
        records = []
        for i, line in enumerate(lines, 1):
            try:
                records.append(json.loads(line))
            except (ValueError, RecursionError):
                raise BadInput(f"{path}:{i}: garbled scalar line: {line[:80]!r}") from None
    _check_records(path, records)
    if torn is not None:
        try:
            last = json.loads(torn)
            _check_records(path, [last], len(records) + 1)
            records.append(last)
            torn = None
        except (ValueError, RecursionError, BadInput):
            pass
    return records, torn


class RunReader:
    """Reads a run store; never fails on a run that was killed, it lists what is incomplete instead."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        meta_path = self.root / META
        if not meta_path.is_file() and not (self.root / SCALAR_DIR).is_dir():
            raise BadInput(f"{self.root}: not a run store (no {META} or {SCALAR_DIR}/)")
        self.meta: dict[str, Any] = load_json(meta_path, META_SCHEMA, "meta.json") \
            if meta_path.exists() or meta_path.is_symlink() else {}
        self.incomplete: list[Incomplete] = []
        self._step_files: dict[int, dict[int, Path]] = {}
        self._rank_info: dict[int, dict[str, Any]] = {}
        self._first_rank_file: tuple[Path, dict[str, Any]] | None = None
        self._scan_steps()

    # -- structure ------------------------------------------------------------------------------------
    def _scan_steps(self) -> None:
        base = self.root / STEP_DIR
        if not base.is_dir():
            return
        for d in sorted(base.iterdir()):
            m = _STEP_RE.match(d.name)
            if not m or not d.is_dir():
                continue
            step = step_number(d.name, m.group(1), base)
            with os.scandir(d) as entries:
                names = [(e.name, e.is_file()) for e in entries]
            for name, is_file in names:
                f = d / name
                if mm := _RANK_H5_RE.match(name):
                    if not is_file:     # a FIFO would block HDF5, a device never ends: refused, never opened
                        regular_file(f, "step file")
                    self._step_files.setdefault(step, {})[step_number(name, mm.group(1), d)] = f
                elif mm := _RANK_TMP_RE.match(name):
                    self.incomplete.append(Incomplete(step, step_number(name, mm.group(1), d),
                                                      "step file never finished (run stopped mid-step)"))

    @property
    def ranks(self) -> list[int]:
        found = set()
        for f in (self.root / SCALAR_DIR).glob("rank_*.jsonl"):
            if (m := _SCALAR_RANK_RE.match(f.name)) is not None:
                found.add(int(m.group(1)))
        for per_rank in self._step_files.values():
            found.update(per_rank)
        return sorted(found)

    def rank_info(self, rank: int) -> dict[str, Any]:
        """The rank's coordinates (``ranks/rank_R.json``), checked once (runstore.rank_files): integers, each
        below its group's size, sizes the same as every other rank file read so far. A copy per call."""
        info = self._rank_info.get(rank)
        if info is None:
            p = self.root / RANK_DIR / f"rank_{rank:05d}.json"
            if p.exists() or p.is_symlink():
                info = check_rank_info(load_json(p, what="rank file"), p, rank)
                if self._first_rank_file is None:
                    self._first_rank_file = (p, info)
                else:
                    check_sizes_agree(self._first_rank_file, (p, info))
            else:
                info = {"rank": rank}
            self._rank_info[rank] = info
        return dict(info)

    def array_steps(self, rank: int | None = None) -> list[int]:
        """Steps whose array file is complete (for ``rank``, or for at least one rank)."""
        return sorted(s for s, per in self._step_files.items() if rank is None or rank in per)

    def array_ranks(self, step: int) -> list[int]:
        return sorted(self._step_files.get(step, {}))

    # -- content --------------------------------------------------------------------------------------
    def scalar_records(self, rank: int) -> list[dict[str, Any]]:
        """One rank's scalar records in file order; a torn last line is listed in ``incomplete``."""
        path = self.root / SCALAR_DIR / f"rank_{rank:05d}.jsonl"
        if not path.exists() and not path.is_symlink():     # anything else there (a FIFO, a link) is refused
            return []
        records, torn = _parse_jsonl(path)
        if torn is not None:
            last = records[-1].get("step") if records else None
            nxt = last + 1 if isinstance(last, int) else None
            self.incomplete.append(Incomplete(nxt, rank, "scalar line torn (run stopped while writing)"))
        return records

    def scalars(self, rank: int | None = None) -> pd.DataFrame:
        """Scalars as one table (every rank's rows, with a ``rank`` column); absent keys are NaN."""
        import pandas as pd

        frames = []
        for r in ([rank] if rank is not None else self.ranks):
            records = self.scalar_records(r)
            if records:
                df = pd.DataFrame.from_records(records)
                df["rank"] = r
                frames.append(df)
        if not frames:
            return pd.DataFrame({"step": pd.Series(dtype="int64"), "rank": pd.Series(dtype="int64")})
        return pd.concat(frames, ignore_index=True)

    def step_file(self, step: int, rank: int = 0) -> Path:
        """The finished HDF5 file of one step on one rank (for readers that stream one group)."""
        path = self._step_files.get(step, {}).get(rank)
        if path is None:
            raise BadInput(f"{self.root}: no complete array file for step {step}, rank {rank}")
        return path

    def has_group(self, step: int, group: str) -> bool:
        """Whether any rank's finished file of ``step`` holds ``group`` (cheap: no data is read)."""
        for path in self._step_files.get(step, {}).values():
            with open_h5(path) as h5:
                if group in h5:
                    return True
        return False

    def step_arrays(self, step: int, rank: int = 0) -> StepArrays:
        data, attrs = read_h5(self.step_file(step, rank))
        return StepArrays(step, rank, data, attrs, self.step_file(step, rank))

    def iter_step_arrays(self, rank: int | None = None) -> Iterator[StepArrays]:
        for step in self.array_steps(rank):
            for r in ([rank] if rank is not None else self.array_ranks(step)):
                yield self.step_arrays(step, r)
