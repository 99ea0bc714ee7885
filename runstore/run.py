"""A run as the comparators see it, whatever it came from.

Importers (logs, TensorBoard) build a ``Run`` in memory; a run store on disk opens as a ``Run`` whose
arrays are read lazily. ``save_run`` turns an imported run into a run store, so ``align import`` keeps the
evidence in the one format.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from core.outputs import check_out_dir
from runstore.reader import RunReader
from runstore.writer import RunWriter


@dataclass
class Run:
    """``scalars`` maps a key (loss, grad_norm, lr, ...) to a float series indexed by step that holds only
    the steps where the source reported the key, so a NaN the run produced is never confused with a
    value the log did not have."""

    path: str
    kind: str
    meta: dict[str, Any] = field(default_factory=dict)
    scalars: dict[str, pd.Series] = field(default_factory=dict)
    local_norms: dict[int, pd.DataFrame] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    store: RunReader | None = None
    # Per-rank scalars when the source has one log per rank (msrun worker logs); ``scalars`` is one rank's.
    rank_scalars: dict[int, dict[str, pd.Series]] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return Path(self.path).name or self.path

    def series(self, key: str) -> pd.Series:
        s = self.scalars.get(key)
        return s if s is not None else pd.Series(dtype="float64", name=key,
                                                 index=pd.Index([], dtype="int64", name="step"))

    def has(self, key: str) -> bool:
        return key in self.scalars and len(self.scalars[key]) > 0

    @property
    def steps(self) -> pd.Index:
        idx = pd.Index([], dtype="int64", name="step")
        for s in self.scalars.values():
            idx = idx.union(s.index)
        return idx

    def local_norm_steps(self, limit: int | None = None) -> list[int]:
        """Steps with local norms, in order; ``limit`` stops the (file-opening) search early."""
        steps = sorted(self.local_norms)
        if self.store is not None:
            for step in self.store.array_steps():
                if limit is not None and len(steps) >= limit:
                    break
                if step not in self.local_norms and self.store.has_group(step, "local_norm"):
                    steps.append(step)
        return sorted(steps)

    def local_norm_table(self, step: int, rank: int | None = None) -> pd.DataFrame | None:
        """Named (or indexed) local norms of one step; every rank's rows when ``rank`` is None."""
        if step in self.local_norms:
            return self.local_norms[step]
        if self.store is None:
            return None
        frames = []
        for r in ([rank] if rank is not None else self.store.array_ranks(step)):
            t = self.store.step_arrays(step, r).table("local_norm")
            if t is not None:
                t["rank"] = r
                frames.append(t)
        return pd.concat(frames, ignore_index=True) if frames else None


def make_series(steps: Any, values: Any, key: str, copy: bool = True) -> pd.Series:
    """A scalar series: int64 step index, sorted; a step logged twice (restart) keeps the last value.
    ``copy=False`` wraps arrays the caller hands over and never touches again (no 8 MB copy per 1M steps)."""
    steps = np.asarray(steps, dtype=np.int64)
    s = pd.Series(np.asarray(values, dtype=np.float64), index=pd.Index(steps, name="step", copy=False), name=key,
                  copy=copy)
    if len(steps) < 2 or (steps[1:] > steps[:-1]).all():   # the usual case, without pandas' hash table
        return s
    if not s.index.is_unique:
        s = s[~s.index.duplicated(keep="last")]
    if not s.index.is_monotonic_increasing:
        s = s.sort_index()
    return s


def series_from_records(records: list[dict[str, Any]]) -> dict[str, pd.Series]:
    """Per-key series from scalar records; a record that lacks a key contributes nothing to it."""
    cols: dict[str, tuple[list[int], list[float]]] = {}
    for rec in records:
        step = rec.get("step")
        if not isinstance(step, int):
            continue
        for k, v in rec.items():
            if k == "step" or isinstance(v, (str, list, dict)) or v is None:
                continue
            entry = cols.get(k)
            if entry is None:
                entry = cols[k] = ([], [])
            entry[0].append(step)
            entry[1].append(float(v))
    return {k: make_series(st, vals, k) for k, (st, vals) in cols.items()}


def open_store(path: str | Path) -> Run:
    """Open a run store. Scalars come from the lowest rank that logged them (Megatron prints on one rank;
    a dumper writes on every rank), except a loss each data-parallel rank logged for its own share of the
    batch (:func:`_global_losses`)."""
    reader = RunReader(path)
    merged: dict[str, pd.Series] = {}
    per_rank = {rank: series_from_records(reader.scalar_records(rank)) for rank in reader.ranks}
    for rank in reversed(reader.ranks):
        for k, s in per_rank[rank].items():
            merged[k] = s if k not in merged else s.combine_first(merged[k])
    notes = [f"incomplete: {inc}" for inc in reader.incomplete]
    notes += _global_losses(reader, per_rank, merged)
    return Run(str(path), "runstore", dict(reader.meta), merged, {}, notes, reader)


def _global_losses(reader: RunReader, per_rank: dict[int, dict[str, pd.Series]],
                   merged: dict[str, pd.Series]) -> list[str]:
    """Replace, in ``merged``, a loss the data-parallel ranks logged differently at a step by the whole batch's:
    their losses weighted by their ``loss_mask_sum`` (equal weights when a rank lacks it), in place; one note
    per loss replaced.

    Why: Megatron's dumper records the loss already reduced over DP (every rank the same), MindFormers' each
    rank's own masked mean. Rank 0's alone is half a batch: a DP=2 candidate against a DP=1 baseline of the same
    samples failed step 1 at 7.6e-3 where the global losses agree to 3.4e-7."""
    dp_of = {rank: reader.rank_info(rank).get("dp_rank") for rank in reader.ranks}
    if len({d for d in dp_of.values() if isinstance(d, int)}) < 2:
        return []
    notes = []
    for key in [k for k in merged if k == "loss" or k.endswith("_loss")]:
        by_dp: dict[int, int] = {}      # the lowest rank of each DP rank that logged it (the last PP stage)
        for rank in reader.ranks:
            dp = dp_of[rank]
            if isinstance(dp, int) and not isinstance(dp, bool) and key in per_rank[rank]:
                by_dp.setdefault(dp, rank)
        if len(by_dp) < 2:
            continue
        ranks = list(by_dp.values())
        cols = [per_rank[r][key] for r in ranks]
        table = pd.concat(cols, axis=1, keys=ranks).dropna()
        if table.empty or bool((table.nunique(axis=1) <= 1).all()):
            continue
        masks = [per_rank[r].get("loss_mask_sum") for r in ranks]
        if all(m is not None for m in masks):
            w = pd.concat(masks, axis=1, keys=ranks).reindex(table.index)
            w = w.where(w.notna().all(axis=1) & (w.sum(axis=1) > 0), 1.0)
            how = "weighted by their loss_mask_sum"
        else:
            w = pd.DataFrame(1.0, index=table.index, columns=table.columns)
            how = "averaged (no loss_mask_sum on every rank)"
        glob = (table * w).sum(axis=1) / w.sum(axis=1)
        merged[key] = glob.combine_first(merged[key])
        merged[key].name = key
        notes.append(f"{key}: the {len(ranks)} data-parallel ranks logged their own shares of the batch; the "
                     f"run's {key} is theirs {how}")
    return notes


def save_run(run: Run, out: str | Path) -> Path:
    """Write an imported run as a run store (scalars, local norms, metadata); an ``out`` that is a file or a
    dangling symlink is refused before anything is written."""
    out = check_out_dir(out)
    meta = dict(run.meta)
    meta.setdefault("source", {"kind": run.kind, "path": run.path})
    per_rank = run.rank_scalars or {0: run.scalars}
    tables: dict[int, dict[int, pd.DataFrame]] = {}
    for step, t in run.local_norms.items():
        if "rank" in t.columns:       # one log per rank: each rank's rows go to that rank's file
            for rank, part in t.groupby("rank"):
                tables.setdefault(int(rank), {})[step] = part.drop(columns="rank")
        else:
            tables.setdefault(min(per_rank), {})[step] = t
    for i, rank in enumerate(sorted(set(per_rank) | set(tables))):
        with RunWriter(out, rank=rank, meta=meta) as w:
            if i == 0 and rank != 0:
                w.update_meta(meta)
            if per_rank.get(rank):
                w.log_scalar_series(per_rank[rank])
            for step, t in sorted(tables.get(rank, {}).items()):
                w.put_table(step, "local_norm", {c: t[c].to_numpy() for c in t.columns})
                w.finish_step()
    return out
