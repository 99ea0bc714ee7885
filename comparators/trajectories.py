"""Named norms over the whole run: every parameter's norm trajectory against its own band from the repeats.

Why: the step-1 comparison judges the backward pass once; a fault that only shows after some updates (weight
decay on one parameter kind, a wrong lr multiplier, a skipped all-reduce of one parameter) leaves the loss
almost untouched for a long while, but one parameter's gradient (or weight, or update) norm walks away from
the baseline's. How far a parameter may walk is what the baseline's own repeat shows: per parameter and
step, band = ``band_k`` x the rolling RMS of (repeat - baseline), as for the loss (comparators.scalars),
never below the precision's step-1 tolerance (``rtol`` x |baseline|). A parameter *leaves its band* at the
first step of ``sustain`` consecutive recorded steps outside it; the first parameter to leave is named.

Speed (100k steps x hundreds of parameters): each step file is opened once and only its norm table is read
(raw, no name decoding); the ranks' rows are combined with the step-1 comparator's own rules
(comparators.local_norms: TP shards, DP parts, replicas) worked out once per table layout and replayed on
every step with the same layout as one numpy reduction; long runs are read by forked processes side by side
(``jobs``); pairing through the mapping is done once on names; bands, departures and summaries are
column-wise numpy / pandas over the [steps x parameters] matrices, a block of parameters at a time.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
import threading
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pandas as pd

from comparators import stats
from comparators.local_norms import NormPairing, ShardNorm, add_rank_table, own_stage_rows, pair_norms, pipeline_stage
from core.errors import BadInput
from core.findings import Finding, StageResult
from core.forking import fork_child, kill_child
from runstore import check_table
from runstore.h5file import open_h5
from runstore.tables import decode_text

STAGE = "norm_trajectories"
#: Per-parameter norm tables a step file may hold (same columns as ``local_norm``), and what they measure.
KINDS = {"local_norm": "gradient norm", "param_norm": "parameter norm", "update_norm": "update norm"}
_EPS32 = float(np.finfo(np.float32).eps)
_CHUNK = 8192          # steps combined at a time (bounds the float64 temporaries)


@dataclass
class Trajectory:
    """One run's named norms of one kind: ``values[i, j]`` is the norm of ``names[j]`` at ``steps[i]``
    (float32: 100k steps x 300 names is 120 MB; NaN where the name was not recorded, ``present`` False)."""

    steps: np.ndarray
    names: list[str]
    values: np.ndarray
    present: np.ndarray | None = None      # None: every name recorded at every step
    files: int = 0                         # step files opened

    def column(self, name: str) -> np.ndarray:
        return self.values[:, self.names.index(name)]


@dataclass
class _Plan:
    """How one table layout (the ranks' rows of a step, concatenated) combines into one norm per name."""

    names: list[str]
    rows: np.ndarray        # rows taken, grouped by name
    starts: np.ndarray      # where each name's rows start in ``rows``


def _plan(tables: list[tuple[dict[str, Any], dict[str, np.ndarray]]], where: str | list[str], group: str) -> _Plan:
    """The step-1 comparator's combination (add_rank_table / ShardNorm), worked out on one layout. ``where``:
    the tables' files (one per table), or one label for all."""
    out: dict[str, ShardNorm] = {}
    row0 = 0
    for k, (rinfo, cols) in enumerate(tables):
        path = where[k] if isinstance(where, list) else where
        dec = decode_text(path, group, cols)
        check_table(path, group, dec)
        add_rank_table(out, dec, rinfo, row0, source=path)
        row0 += len(dec["name"])
    names = list(out)
    per = [sorted(out[n].contributing_rows()) for n in names]
    starts = np.cumsum([0] + [len(r) for r in per[:-1]]).astype(np.int64)
    rows = np.fromiter((r for rs in per for r in rs), dtype=np.int64)
    return _Plan(names, rows, starts)


def _combine(plan: _Plan, norms: np.ndarray) -> np.ndarray:
    """[steps x rows] raw norms -> [steps x names] full norms (sqrt of the sum of the rows' squares)."""
    out = np.empty((norms.shape[0], len(plan.names)), dtype=np.float32)
    with np.errstate(over="ignore"):        # a norm beyond 1e154 squares to inf: its combined norm is inf, silently
        for i in range(0, norms.shape[0], _CHUNK):
            sq = np.square(norms[i:i + _CHUNK][:, plan.rows], dtype=np.float64)
            out[i:i + _CHUNK] = np.sqrt(np.add.reduceat(sq, plan.starts, axis=1))
    return out


class _TableReader:
    """Reads one table from step files with HDF5's low-level calls: opening the file is most of the cost, so
    nothing else is done per file; the numpy dtype of a table's HDF5 type is built once, not per file."""

    def __init__(self, group: str) -> None:
        self.group, self.key = group, group.encode()
        self.types: list[tuple[Any, np.dtype]] = []

    def _dtype(self, ds: Any) -> np.dtype:
        tid = ds.get_type()
        for known, dtype in self.types:
            if tid == known:
                return dtype
        dtype = ds.dtype
        self.types.append((tid, dtype))
        return dtype

    def __call__(self, path: os.PathLike) -> dict[str, np.ndarray] | None:
        """One step file's table as raw columns (names stay bytes), or None when the file has none."""
        try:
            fid = h5py.h5f.open(os.fsencode(path), h5py.h5f.ACC_RDONLY)
        except (OSError, ValueError, RuntimeError) as exc:
            raise BadInput(f"{path}: not a readable HDF5 file ({' '.join(str(exc).split())[:120]})") from None
        try:
            try:
                ds = h5py.h5d.open(fid, self.key)
            except (KeyError, ValueError, TypeError, RuntimeError):   # none, or the older layout: a group
                return self._group(fid, path)
            dtype = self._dtype(ds)
            shape = ds.shape
            if dtype.names is None or len(shape) != 1:
                raise BadInput(f"{path}: '{self.group}' is not a table (dtype {dtype}, shape {shape})")
            n = int(shape[0])
            if n * dtype.itemsize > 1 << 24 and n * dtype.itemsize > os.path.getsize(path):
                raise BadInput(f"{path}: '{self.group}' declares {n} rows, more than the file holds")
            rec = np.empty(n, dtype=dtype)
            if n:
                ds.read(h5py.h5s.ALL, h5py.h5s.ALL, rec)
            return {k: rec[k] for k in dtype.names}
        except (KeyError, ValueError, RuntimeError, TypeError, OSError) as exc:
            raise BadInput(f"{path}: '{self.group}': unreadable table ({' '.join(str(exc).split())[:120]})") from None
        finally:
            fid.close()

    def _group(self, fid: Any, path: os.PathLike) -> dict[str, np.ndarray] | None:
        from runstore import table_columns

        h5 = h5py.File(fid)
        obj = h5.get(self.group)
        if not isinstance(obj, h5py.Group):
            return None
        return {k: np.asarray(v) for k, v in table_columns(obj).items()} or None


def _same_layout(a: list[tuple[dict[str, Any], dict[str, np.ndarray]]],
                 b: list[tuple[dict[str, Any], dict[str, np.ndarray]]]) -> bool:
    if len(a) != len(b):
        return False
    for (ra, ca), (rb, cb) in zip(a, b, strict=True):
        if ra is not rb or ca.keys() != cb.keys():
            return False
        for k, v in ca.items():
            if v.dtype != cb[k].dtype or (k != "norm" and not np.array_equal(v, cb[k])):
                return False
    return True


def norm_groups(run: Any, limit: int = 20) -> list[str]:
    """The per-parameter norm kinds (KINDS) a run holds, found in its first ``limit`` step files (a log:
    ``local_norm`` when it carried named norms)."""
    found = ["local_norm"] if getattr(run, "local_norms", None) else []
    store = getattr(run, "store", None)
    if store is None:
        return found
    for step in store.array_steps()[:limit]:
        for rank in store.array_ranks(step):
            with open_h5(store.step_file(step, rank)) as h5:
                found += [k for k in KINDS if k in h5 and k not in found]
        if len(found) == len(KINDS):
            break
    return [k for k in KINDS if k in found]


def read_trajectory(run: Any, group: str = "local_norm", steps: Iterable[int] | None = None, jobs: int = 1
                    ) -> Trajectory | None:
    """One run's ``group`` norms at every step that recorded them (or at ``steps`` only), one column per
    parameter, combined over ranks exactly as the step-1 comparison combines them. None: no such norms.
    ``jobs`` > 1 reads a run store's step files in that many forked processes where forking is safe."""
    want = None if steps is None else {int(s) for s in steps}
    store = getattr(run, "store", None)
    if store is not None:
        todo = [s for s in store.array_steps() if want is None or s in want]
        jobs = min(jobs, len(todo) // FORK_MIN_STEPS)
        if jobs > 1 and _fork_safe():
            return _read_forked(store, group, todo, jobs)
        return _read_store(store, group, todo)
    if group != "local_norm" or not getattr(run, "local_norms", None):
        return None
    blocks: list[tuple[_Plan, list[int], list[np.ndarray]]] = []
    last_key: tuple[np.ndarray, ...] | None = None
    for step in sorted(run.local_norms):
        if want is not None and step not in want:
            continue
        t = run.local_norms[step]
        if t is None or not len(t):
            continue
        name = t["name"].to_numpy()
        rank = t["rank"].to_numpy() if "rank" in t.columns else np.zeros(len(t), dtype=np.int64)
        if last_key is None or not (np.array_equal(last_key[0], name) and np.array_equal(last_key[1], rank)):
            order = np.argsort(rank, kind="stable")     # the lowest rank's row of a name wins (DP replicas)
            plan = _plan([({}, {"name": np.asarray(name[order], dtype=str),
                                "norm": t["norm"].to_numpy()[order]})], f"{run.path} step {step}", group)
            plan.rows = order[plan.rows]
            blocks.append((plan, [], []))
            last_key = (name, rank)
        blocks[-1][1].append(step)
        blocks[-1][2].append(t["norm"].to_numpy(dtype=np.float64))
    return _merge(blocks, 0) if blocks else None


def _read_store(store: Any, group: str, steps: Iterable[int]) -> Trajectory | None:
    blocks: list[tuple[_Plan, list[int], list[np.ndarray]]] = []
    files = 0
    infos: dict[int, dict[str, Any]] = {}
    read_table = _TableReader(group)
    last: list[tuple[dict[str, Any], dict[str, np.ndarray]]] | None = None
    # a MindFormers pipeline rank records every parameter (global names, zeros for other stages'): keep its
    # own stage's rows, as the step-1 reader does (one mask per rank and table layout)
    par = dict((getattr(store, "meta", None) or {}).get("parallel") or {})
    own: dict[tuple[int, bytes], np.ndarray] = {}
    for step in steps:
        tables, paths = [], []
        for rank in store.array_ranks(step):
            files += 1
            path = store.step_file(step, rank)
            cols = read_table(path)
            if cols is not None and par.get("layer_stages") and "name" in cols:
                key = (rank, np.asarray(cols["name"]).tobytes())
                if key not in own:
                    names = np.array([n.decode("utf-8", "replace") if isinstance(n, bytes) else str(n)
                                      for n in cols["name"]])
                    kept, _ = own_stage_rows({"name": names, "row": np.arange(len(names))}, par, rank)
                    own[key] = np.isin(np.arange(len(names)), kept["row"])
                if not own[key].all():
                    cols = {k: np.asarray(v)[own[key]] for k, v in cols.items()}
            if cols is not None and ("norm" not in cols or len(cols["norm"])):   # no norm: refused by the plan
                if rank not in infos:
                    infos[rank] = store.rank_info(rank)
                    if par.get("layer_stages"):
                        infos[rank] = {**infos[rank], "pp_rank": pipeline_stage(par, rank)}
                tables.append((infos[rank], cols))
                paths.append(str(path))
                norm = cols.get("norm")
                if norm is not None and norm.dtype.kind in "fiu" and (norm < 0).any():   # the plan saw other steps'
                    check_table(path, group, {"norm": norm, **{k: v for k, v in cols.items() if k != "norm"}})
        if not tables:
            continue
        if last is None or not _same_layout(last, tables):
            blocks.append((_plan(tables, paths, group), [], []))
            last = tables
        blocks[-1][1].append(step)
        blocks[-1][2].append(np.concatenate([c["norm"] for _, c in tables]))
    return _merge(blocks, files) if blocks else None


#: Fewest step files per forked reader: below it, forking costs more than it saves.
FORK_MIN_STEPS = 2000


def _fork_safe() -> bool:
    """Forking is only an acceleration: where fork exists, no other thread runs (a lock held at the fork
    could stall the child) and no training framework is loaded (the demo's process)."""
    return (hasattr(os, "fork") and threading.active_count() == 1
            and not any(m in sys.modules for m in ("torch", "mindspore")))


def _read_forked(store: Any, group: str, steps: list[int], jobs: int) -> Trajectory | None:
    """Read ``jobs`` contiguous chunks of steps side by side: each forked child writes its chunk's trajectory
    as an .npz (no pickle) and exits; a child that fails has its chunk read again here (which raises the
    same one-line error, if the input is bad)."""
    chunks = [list(c) for c in np.array_split(np.asarray(steps, dtype=np.int64), jobs)]
    tmp = Path(tempfile.mkdtemp(prefix="xf-align-traj-"))
    children = []
    try:
        for k, chunk in enumerate(chunks[1:], 1):
            out = tmp / f"{k}.npz"
            pid = fork_child()     # SIGINT at its default in the child: a Ctrl-C is the parent's to handle
            if pid == 0:   # the child: read, save, leave without running the parent's exit handlers
                code = 1
                try:
                    t = _read_store(store, group, chunk)
                    if t is not None:
                        np.savez(out, steps=t.steps, values=t.values, names=np.array(t.names, dtype=str),
                                 present=t.present if t.present is not None else np.zeros((0, 0), dtype=bool),
                                 files=np.int64(t.files))
                    code = 0
                except BaseException:   # noqa: BLE001 - any failure: the parent reads this chunk itself
                    pass
                os._exit(code)
            children.append((pid, k, out))
        parts = [_read_store(store, group, chunks[0])]
        for pid, k, out in children:
            _, status = os.waitpid(pid, 0)
            if os.waitstatus_to_exitcode(status) != 0:
                parts.append(_read_store(store, group, chunks[k]))
            elif out.is_file():
                with np.load(out, allow_pickle=False) as z:
                    present = z["present"] if z["present"].size else None
                    parts.append(Trajectory(z["steps"], [str(n) for n in z["names"]], z["values"], present,
                                            int(z["files"])))
    except BaseException:
        for pid, _, _ in children:     # an exception above (Ctrl-C): the children's work is not wanted
            kill_child(pid)
        raise
    finally:
        for pid, _, _ in children:     # reap any child left
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        shutil.rmtree(tmp, ignore_errors=True)
    return _concat([t for t in parts if t is not None])


def _concat(parts: list[Trajectory]) -> Trajectory | None:
    """Trajectories of consecutive chunks of steps as one (the union of their names)."""
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    names: dict[str, int] = {}
    for t in parts:
        for n in t.names:
            names.setdefault(n, len(names))
    n_steps = sum(len(t.steps) for t in parts)
    values = np.full((n_steps, len(names)), np.nan, dtype=np.float32)
    present = np.zeros(values.shape, dtype=bool)
    i = 0
    for t in parts:
        cols = np.fromiter((names[n] for n in t.names), dtype=np.int64, count=len(t.names))
        values[i:i + len(t.steps), cols] = t.values
        present[i:i + len(t.steps), cols] = True if t.present is None else t.present
        i += len(t.steps)
    return Trajectory(np.concatenate([t.steps for t in parts]), list(names), values,
                      None if present.all() else present, sum(t.files for t in parts))


def _merge(blocks: list[tuple[_Plan, list[int], list[np.ndarray]]], files: int) -> Trajectory:
    names: dict[str, int] = {}
    for plan, _, _ in blocks:
        for n in plan.names:
            names.setdefault(n, len(names))
    n_steps = sum(len(s) for _, s, _ in blocks)
    steps = np.empty(n_steps, dtype=np.int64)
    values = np.full((n_steps, len(names)), np.nan, dtype=np.float32)
    present = None
    i = 0
    for plan, st, vecs in blocks:
        cols = np.fromiter((names[n] for n in plan.names), dtype=np.int64, count=len(plan.names))
        steps[i:i + len(st)] = st
        values[i:i + len(st), cols] = _combine(plan, np.vstack(vecs))
        if len(cols) != len(names):
            if present is None:
                present = np.ones(values.shape, dtype=bool)
            present[i:i + len(st)] = False
            present[i:i + len(st), cols] = True
        i += len(st)
    order = np.argsort(steps, kind="stable")
    if (order != np.arange(n_steps)).any():
        steps, values = steps[order], values[order]
        present = present[order] if present is not None else None
    return Trajectory(steps, list(names), values, present, files)


# -- pairing through the mapping, once, on names -------------------------------------------------------------
@dataclass
class Paired:
    """Both runs' norms per compared unit (baseline names) on the steps both recorded ([steps x units],
    float32 like the trajectories; compared in float64, a block of units at a time)."""

    steps: np.ndarray
    pairing: NormPairing
    baseline: np.ndarray
    candidate: np.ndarray
    present: np.ndarray             # both sides recorded every part at that step

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.pairing.pairs]


def _gather(t: Trajectory, rows: np.ndarray, groups: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Per group of columns: sqrt of the sum of squares at ``rows`` (a fused parameter's parts), and whether
    every part was recorded; a group with a column of -1 (no such name) is NaN and absent."""
    n = len(groups)
    out = np.full((len(rows), n), np.nan, dtype=np.float32)
    ok = np.zeros((len(rows), n), dtype=bool)
    have = [k for k, g in enumerate(groups) if g and min(g) >= 0]
    if not have or not len(rows):
        return out, ok
    cols = np.fromiter((c for k in have for c in groups[k]), dtype=np.int64)
    starts = np.cumsum([0] + [len(groups[k]) for k in have[:-1]]).astype(np.int64)
    single = len(cols) == len(have)            # no fused group: a plain column selection
    every_row = len(rows) == len(t.steps) and bool((rows == np.arange(len(rows))).all())
    for i in range(0, len(rows), _CHUNK):
        r = slice(i, i + _CHUNK) if every_row else rows[i:i + _CHUNK]
        sub = t.values[r][:, cols]
        if single:
            out[i:i + _CHUNK, have] = sub
        else:
            out[i:i + _CHUNK, have] = np.sqrt(np.add.reduceat(np.square(sub, dtype=np.float64), starts, axis=1))
        if t.present is None:
            ok[i:i + _CHUNK, have] = True
        else:
            ok[i:i + _CHUNK, have] = np.logical_and.reduceat(t.present[r][:, cols], starts, axis=1)
    return out, ok


def pair_trajectories(b: Trajectory, c: Trajectory, mapping: Any) -> Paired:
    """Pair two runs' trajectories through the mapping (pair_norms: the step-1 stage's name resolution) on the
    steps both recorded."""
    pairing = pair_norms(b.names, c.names, mapping)
    steps, bi, ci = np.intersect1d(b.steps, c.steps, assume_unique=True, return_indices=True)
    bidx = {n: i for i, n in enumerate(b.names)}
    cidx = {n: i for i, n in enumerate(c.names)}
    bv, bok = _gather(b, bi, [[bidx[n] for n in p.baseline] for p in pairing.pairs])
    cv, cok = _gather(c, ci, [[cidx[n] for n in p.candidate] for p in pairing.pairs])
    return Paired(steps, pairing, bv, cv, bok & cok)


def repeat_values(paired: Paired, r: Trajectory) -> np.ndarray:
    """A repeat of the baseline on the paired steps and units (NaN where it lacks a step or a part): its
    names are the baseline's, matched after the mapping's wrapper prefixes are stripped."""
    m = paired.pairing.mapping
    ridx = {m.strip(n, "baseline"): i for i, n in enumerate(r.names)}
    groups = [[ridx.get(m.strip(n, "baseline"), -1) for n in p.baseline] for p in paired.pairing.pairs]
    out = np.full(paired.baseline.shape, np.nan, dtype=np.float32)
    if not len(r.steps):
        return out
    pos = np.minimum(np.searchsorted(r.steps, paired.steps), len(r.steps) - 1)
    hit = r.steps[pos] == paired.steps
    vals, ok = _gather(r, pos[hit], groups)
    out[hit] = np.where(ok, vals, np.nan)
    return out


# -- the comparison ------------------------------------------------------------------------------------------
@dataclass
class TrajectoryOptions:
    band_k: float = 3.0
    band_window: int = 51
    band_floor_ulps: float = 8.0
    sustain: int = 10
    max_outside: float = 0.05
    rtol: float = 1e-4          # the band's floor relative to |baseline|: the precision's step-1 tolerance
    top: int = 20               # parameters listed in summary.json
    shown: int = 6              # parameters drawn
    fail_rate: float = 1e-3     # a clean pair fails this stage at most this often (all parameters together)
    warn_rate: float = 1e-2     # ... and is warned about at most this often


@dataclass
class TrajectoryResult(StageResult):
    """A stage result that also carries the curves of the parameters worth drawing (not in summary.json)."""

    curves: list[dict[str, Any]] = field(default_factory=list)


def _first_sustained(outside: np.ndarray, sustain: int) -> np.ndarray:
    """Per column, the row where the first run of ``sustain`` consecutive True starts (-1: none)."""
    n = outside.shape[0]
    if n < sustain or sustain <= 0:
        return np.full(outside.shape[1], -1, dtype=np.int64)
    cs = np.vstack([np.zeros((1, outside.shape[1]), dtype=np.int32), np.cumsum(outside, axis=0, dtype=np.int32)])
    full = (cs[sustain:] - cs[:-sustain]) == sustain
    return np.where(full.any(axis=0), full.argmax(axis=0), -1)


def _window_sum(a: np.ndarray, window: int, rows: np.ndarray | None = None) -> np.ndarray:
    """Per row (``rows``, default all), the sum of the rows of a centred window of ``window`` rows (cut at the
    ends), per column: what pandas' rolling(window, center=True, min_periods=1).sum() gives, by cumulative sums."""
    n = a.shape[0]
    cs = np.vstack([np.zeros((1,) + a.shape[1:]), np.cumsum(a, axis=0)])
    i = np.arange(n) if rows is None else rows
    lo = np.clip(i - window // 2, 0, n)
    hi = np.clip(i - window // 2 + window, 0, n)
    return cs[hi] - cs[lo]


def _band(paired: Paired, repeats: list[np.ndarray], cols: np.ndarray, opt: TrajectoryOptions,
          null: bool = True) -> dict[str, Any]:
    """Delta, band, outside and |delta| / band of the units ``cols`` at every step (float64); ``null``: also
    what a clean run does against such a band (:func:`_null_counts`)."""
    b = paired.baseline[:, cols].astype(np.float64)
    delta = paired.candidate[:, cols] - b
    total = np.zeros(b.shape)
    count = np.zeros(b.shape, dtype=np.int32)
    for r in repeats:
        d2 = np.square(r[:, cols] - b)
        ok = np.isfinite(d2)
        total += np.where(ok, d2, 0.0)
        count += ok
    ms = np.where(count > 0, total / np.maximum(count, 1), np.nan)
    rolled = pd.DataFrame(ms).rolling(opt.band_window, center=True, min_periods=1).mean().to_numpy()
    banded = np.isfinite(rolled)             # a repeat value within the window: a band to judge against
    judged = banded.any(axis=0)
    absb = np.abs(b)
    with np.errstate(invalid="ignore"):
        scale = np.nanmax(np.where(np.isfinite(absb), absb, np.nan), axis=0, initial=0.0) if len(b) else 0.0
    floor = np.maximum(opt.rtol * np.nan_to_num(absb, nan=0.0, posinf=0.0), opt.band_floor_ulps * _EPS32 * scale)
    spread = opt.band_k * np.sqrt(np.nan_to_num(rolled, nan=0.0))
    band = np.maximum(spread, floor)
    compared = paired.present[:, cols] & banded
    with np.errstate(invalid="ignore", divide="ignore"):
        outside = compared & (~np.isfinite(delta) | (np.abs(delta) > band))
        ratio = np.abs(delta) / band
    ratio = np.where(compared, np.where(np.isnan(ratio), np.inf, ratio), 0.0)
    out = {"b": b, "delta": delta, "band": band, "outside": outside, "ratio": ratio, "compared": compared,
           "judged": judged, "at_floor": compared & (spread <= floor)}
    if null:
        out.update(_null_counts(b, repeats, cols, total, count, np.sqrt(np.nan_to_num(rolled, nan=0.0)),
                                floor, opt))
    return out


NULL_ROWS = 4096    # steps (pairs of neighbouring steps) the null's counts are taken on, evenly spaced


def _null_counts(b: np.ndarray, repeats: list[np.ndarray], cols: np.ndarray, total: np.ndarray,
                 count: np.ndarray, sigma: np.ndarray, floor: np.ndarray, opt: TrajectoryOptions
                 ) -> dict[str, Any]:
    """What a clean run does against such a band: each repeat's own steps against the band its window makes
    without them (leave-one-out), and how slowly its deltas wander (lag-1 autocorrelation of the deltas over
    sigma), on at most NULL_ROWS evenly spaced steps and their next steps (fewer steps: a less certain count,
    never a smaller one claimed)."""
    n = b.shape[0]
    t = np.unique(np.linspace(0, max(n - 2, 0), min(max(n - 1, 1), NULL_ROWS)).astype(np.int64))
    rows = np.concatenate([t, t + 1]) if n > 1 else np.zeros(1, dtype=np.int64)
    wsum = _window_sum(total, opt.band_window, rows)
    wcount = _window_sum(count.astype(np.float64), opt.band_window, rows)
    sig = sigma[rows]
    loo_out = np.zeros(len(cols))
    loo_n = np.zeros(len(cols))
    rho_sum, rho_n = 0.0, 0
    for r in repeats:
        d = r[np.ix_(rows, cols)] - b[rows]
        d2 = np.square(d)
        ok = np.isfinite(d2)
        with np.errstate(invalid="ignore", divide="ignore"):
            loo = np.sqrt(np.maximum(wsum - np.where(ok, d2, 0.0), 0.0) / np.maximum(wcount - 1.0, 1.0))
            z = np.where(ok & (sig > 0), d / np.where(sig > 0, sig, 1.0), np.nan)
        first = slice(0, len(t))             # each step counted once: the first half of ``rows``
        lb = np.maximum(opt.band_k * loo[first], floor[rows][first])
        loo_out += (ok[first] & (np.abs(np.nan_to_num(d[first])) > lb)).sum(axis=0)
        loo_n += ok[first].sum(axis=0)
        if n < 3:
            continue
        with np.errstate(invalid="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)        # a column with no value: NaN, skipped
            zc = np.nan_to_num(z - np.nanmean(z, axis=0))
        a, nxt = zc[:len(t)], zc[len(t):]
        den = np.sum(a * a, axis=0)
        num = np.sum(a * nxt, axis=0)
        good = den > 0
        rho_sum += float(np.sum(np.clip(num[good] / den[good], 0.0, stats.RHO_MAX)))
        rho_n += int(good.sum())
    return {"loo_outside": loo_out, "loo_steps": loo_n, "rho_sum": rho_sum, "rho_n": rho_n}


def judge(paired: Paired, repeats: list[np.ndarray], opt: TrajectoryOptions, kind: str = "local_norm"
          ) -> TrajectoryResult:
    """Each unit against its own band from the repeats (a block of units at a time: the float64 work stays
    ~10 MB per array whatever the run's length); names the first to leave it."""
    what = KINDS.get(kind, kind)
    names = paired.names
    n_steps, n_par = paired.baseline.shape
    steps = paired.steps
    res = TrajectoryResult(STAGE)
    start = np.full(n_par, -1, dtype=np.int64)
    peak = np.zeros(n_par, dtype=np.int64)
    frac = np.zeros(n_par)
    counted = np.zeros(n_par, dtype=np.int64)
    judged = np.zeros(n_par, dtype=bool)
    at: dict[str, np.ndarray] = {k: np.full(n_par, np.nan) for k in ("band_start", "band_peak", "ratio_peak",
                                                                      "ratio_start")}
    at_floor = 0
    loo_out = loo_n = 0.0
    rho_sum, rho_n = 0.0, 0
    rel_band = np.full(n_par, np.nan)
    # the seed's second criterion, per parameter: does the delta fluctuate around 0? (its mean, spread and a
    # typical band; whether a repeat shows the same offset)
    d_mean, d_std, d_n, typ_band = (np.zeros(n_par) for _ in range(4))
    shown_by_repeat = np.zeros(n_par, dtype=bool)
    one_side = np.zeros(n_par, dtype=bool)
    block = max(1, 1_250_000 // max(n_steps, 1))
    for lo in range(0, n_par, block):
        cols = np.arange(lo, min(n_par, lo + block))
        g = _band(paired, repeats, cols, opt)
        st = _first_sustained(g["outside"], opt.sustain)
        for k in np.flatnonzero(st >= 0):       # the first sustained run: all on one side of the baseline?
            run = g["delta"][st[k]:st[k] + opt.sustain, k]
            one_side[cols[k]] = bool(np.all(run > 0) or np.all(run < 0))
        pk = g["ratio"].argmax(axis=0) if n_steps else np.zeros(len(cols), dtype=np.int64)
        start[cols], peak[cols], judged[cols] = st, pk, g["judged"]
        counted[cols] = g["compared"].sum(axis=0)
        at_floor += int(g["at_floor"].sum())
        frac[cols] = g["outside"].sum(axis=0) / np.maximum(counted[cols], 1)
        k = np.arange(len(cols))
        at["band_peak"][cols], at["ratio_peak"][cols] = g["band"][pk, k], g["ratio"][pk, k]
        si = np.maximum(st, 0)
        at["band_start"][cols], at["ratio_start"][cols] = g["band"][si, k], g["ratio"][si, k]
        _centre(g, repeats, cols, d_mean, d_std, d_n, typ_band, shown_by_repeat)
        loo_out += float(g["loo_outside"].sum())
        loo_n += float(g["loo_steps"].sum())
        rho_sum, rho_n = rho_sum + g["rho_sum"], rho_n + g["rho_n"]
        rows = np.linspace(0, n_steps - 1, min(n_steps, 512)).astype(np.int64)   # a median needs no more
        with np.errstate(invalid="ignore", divide="ignore"):
            rb = np.where(g["compared"][rows] & (np.abs(g["b"][rows]) > 0), g["band"][rows] / np.abs(g["b"][rows]),
                          np.nan)
        if rb.size and np.isfinite(rb).any():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                rel_band[cols] = np.nanmedian(rb, axis=0)

    def row(j: int) -> dict[str, Any]:
        i, band = (int(start[j]), at["band_start"][j]) if start[j] >= 0 else (int(peak[j]), at["band_peak"][j])
        p = paired.pairing.pairs[j]
        bv, cv = float(paired.baseline[i, j]), float(paired.candidate[i, j])
        return {"name": names[j], "candidate": ",".join(p.candidate), "layer": p.layer, "kind": p.kind,
                "departure_step": int(steps[start[j]]) if start[j] >= 0 else None,
                "outside_fraction": float(frac[j]), "max_ratio": float(at["ratio_peak"][j]),
                "max_ratio_step": int(steps[peak[j]]), "step": int(steps[i]), "baseline": bv, "candidate_value": cv,
                "delta": cv - bv, "band": float(band), "rel_delta": (cv - bv) / bv if bv else math.inf}

    judged_idx = np.flatnonzero(judged)
    # The null: a clean candidate is one more repeat. How often its norm leaves a band at a step is what the
    # repeats' own steps do against bands made without them (pooled over parameters, Beta with a Jeffreys
    # prior), over the run's independent steps (n (1 - rho) / (1 + rho)); each parameter's count of steps
    # outside is judged against the beta-binomial that implies, the rates divided among the parameters
    # judged together (Bonferroni): the stage as a whole fails a clean pair at most ``fail_rate`` of the time.
    n_judged = max(len(judged_idx), 1)
    rho = min(max(rho_sum / rho_n, 0.0), stats.RHO_MAX) if rho_n else 0.0
    n_eff = stats.effective_n(n_steps, rho) if n_steps else 0.0
    scale_eff = n_eff / n_steps if n_steps else 1.0
    alpha = loo_out * scale_eff + 0.5
    beta = max(loo_n - loo_out, 0.0) * scale_eff + 0.5
    trials = max(int(round(n_eff)), 1)
    tail = stats.betabinom_tail(trials, alpha, beta)
    fail_line, warn_line = opt.fail_rate / n_judged, opt.warn_rate / n_judged
    with np.errstate(invalid="ignore"):
        x = np.ceil(frac * counted * trials / np.maximum(counted, 1) - 1e-9).astype(np.int64)
    p_par = np.where(x > 0, tail[np.clip(x, 0, trials)], 1.0)
    # A parameter is named only when its delta is off in a way a clean one's is not on BOTH counts: it leaves
    # its band more often than a clean pair's (p_par), and its delta does not fluctuate around 0 (a mean offset
    # against its autocorrelation-aware error, at the same line, at least one noise width, not shown by a
    # repeat). The first alone flags a parameter the repeat under-states the noise of: the candidate computes in
    # other kernels (q/k norms behind float16 attention, experts behind near-tie routing on the clean demo
    # pairs) and is noisier there than a repeat of the baseline, though centred on it.
    p_bias = np.ones(n_par)
    for j in judged_idx[p_par[judged_idx] < warn_line]:
        p_bias[j] = _bias_p(d_mean[j], d_std[j], d_n[j], rho)
    off = (np.abs(d_mean) > typ_band / opt.band_k) & ~shown_by_repeat
    sustained = [int(j) for j in judged_idx if start[j] >= 0]
    # a sustained departure is off centre when its run stays on one side (centred noise outside its band at
    # ``sustain`` steps in a row flips side: all on one side has odds 2^(1 - sustain)), or its mean says so
    departed = sorted((j for j in sustained if p_par[j] < fail_line and not shown_by_repeat[j]
                       and (one_side[j] or (p_bias[j] < fail_line and off[j]))),
                      key=lambda j: (int(start[j]), -float(at["ratio_start"][j])))
    rest = sorted((int(j) for j in judged_idx if int(j) not in departed),
                  key=lambda j: (max(p_par[j], p_bias[j] if off[j] else 1.0), p_par[j], -frac[j],
                                 -at["ratio_peak"][j]))
    noisier = [j for j in rest if p_par[j] < warn_line and not (p_bias[j] < warn_line and off[j])]
    need = np.flatnonzero(tail < fail_line)
    finite_rb = rel_band[judged_idx][np.isfinite(rel_band[judged_idx])] if len(judged_idx) else np.array([])
    detect = float(np.median(finite_rb)) if len(finite_rb) else math.nan
    if not len(need):
        power_text = (f"with {len(repeats)} repeat(s) and {n_steps} steps ({n_eff:.3g} independent) even a "
                      f"parameter outside its band at every step would not fail at {opt.fail_rate:g} among "
                      f"{n_judged} parameters: run more steps")
        detect = math.inf
    else:
        power_text = (f"with {len(repeats)} repeat(s) and {n_steps} steps, one parameter's {what} shifted by about "
                      f"{detect:.3g} relative (its band, median over {n_judged} parameters; the most sensitive "
                      f"{float(np.min(finite_rb)) if len(finite_rb) else math.nan:.3g}) for "
                      f"{int(need[0]) * n_steps / trials:.0f} of the steps fails this stage (at a false-alarm rate "
                      f"of {opt.fail_rate:g} for all parameters together)")
    ranked = departed + rest
    not_judged = [names[j] for j in range(n_par) if not judged[j]]
    res.details = {
        "kind": kind, "what": what, "steps": int(n_steps),
        "first_step": int(steps[0]) if n_steps else None, "last_step": int(steps[-1]) if n_steps else None,
        "parameters": int(n_par), "judged": int(len(judged_idx)), "repeats": len(repeats),
        "band": f"per parameter: max({opt.band_k:g} x rolling RMS (window {opt.band_window}) of repeat - "
                f"baseline, {opt.rtol:g} x |baseline|)",
        "rtol": opt.rtol, "sustain": opt.sustain, "departed": len(departed),
        "band_at_floor_fraction": at_floor / max(int(counted.sum()), 1),
        "first_departure": row(departed[0]) if departed else None,
        "fail_rate": opt.fail_rate, "warn_rate": opt.warn_rate, "effective_steps": n_eff,
        "lag1_autocorrelation": rho, "repeat_outside_steps": int(loo_out), "p_step_outside": alpha / (alpha + beta),
        "p_value": float(p_par[judged_idx].min()) if len(judged_idx) else 1.0,
        "sustained_within_noise": [names[j] for j in sustained if j not in departed][:opt.top],
        "noisier_than_repeat": [{"name": names[j], "outside_fraction": float(frac[j]), "p_value": float(p_par[j]),
                                 "mean_delta": float(d_mean[j]), "mean_p_value": float(p_bias[j])}
                                for j in noisier[:opt.top]],
        "power": {"detectable": detect, "text": power_text, "effective_steps": n_eff, "judged": n_judged},
        "worst": [row(j) for j in ranked[:opt.top]],
        "not_judged": not_judged[:opt.top],
        "unmapped": {s: len(v) for s, v in paired.pairing.unmapped.items()},
        "incomplete": len(paired.pairing.incomplete),
    }
    if not n_par or not n_steps:
        res.verdict = "skipped"
        res.details["reason"] = f"no {what} of a parameter both runs recorded at a common step"
        return res
    if departed:
        f = row(departed[0])
        later = ", ".join(f"{names[j]} ({int(steps[start[j]])})" for j in departed[1:6])
        more = (f"; {len(departed) - 1} more left later: {later}" + (" ..." if len(departed) > 6 else "")
                if len(departed) > 1 else "; no other parameter left its band")
        res.add(Finding(STAGE, "fail", f["name"], f"{kind}_departure_step", f["departure_step"], opt.sustain,
                        f"{f['name']}: its {what} leaves its band at step {f['departure_step']} (>= {opt.sustain} "
                        f"recorded steps outside): candidate {f['candidate_value']:.6g} vs baseline "
                        f"{f['baseline']:.6g} (delta {f['delta']:+.3g}, band {f['band']:.3g}), outside at "
                        f"{f['outside_fraction']:.1%} of the steps: a clean pair's parameter does that in "
                        f"{p_par[departed[0]]:.2g} of runs ({n_judged} parameters judged together fail below "
                        f"{fail_line:.2g} each); the first of {len(departed)} parameter(s) to leave{more}"))
    loose = [j for j in rest if p_par[j] < warn_line and p_bias[j] < warn_line and off[j]]
    if loose:
        j = loose[0]
        res.add(Finding(STAGE, "warn", names[j], f"{kind}_outside_fraction", float(frac[j]), opt.max_outside,
                        f"{names[j]}: its {what} is outside its band at {frac[j]:.1%} of {int(counted[j])} steps "
                        f"(largest {at['ratio_peak'][j]:.3g} x the band at step {int(steps[peak[j]])}): a clean "
                        f"pair's parameter does that in {p_par[j]:.2g} of runs ({n_judged} parameters judged "
                        f"together warn below {warn_line:.2g} each); {len(loose)} parameter(s) like it"))
    floor_note = ""
    if res.details["band_at_floor_fraction"] > 0.5:
        floor_note = (f"; the band is its floor ({opt.rtol:g} x |baseline|) at "
                      f"{res.details['band_at_floor_fraction']:.0%} of the points: the repeat hardly differs from "
                      "the baseline (deterministic?), so the run's own noise over many steps is not measured; "
                      "repeat the baseline without determinism")
    if noisier:
        j = noisier[0]
        floor_note += (f"; {len(noisier)} parameter(s) leave their band more often than the repeat's do but "
                       f"fluctuate around 0 (e.g. {names[j]}: outside at {frac[j]:.1%} of the steps, mean delta "
                       f"{d_mean[j]:+.3g}, a clean pair's mean sits that far from 0 in {p_bias[j]:.2g} of runs): the "
                       "repeat under-states the candidate's noise there; not a departure")
    if not departed and not loose and len(judged_idx):
        j = ranked[0]
        res.add(Finding(STAGE, "pass", names[j], f"{kind}_max_ratio", float(at["ratio_peak"][j]), 1.0,
                        f"every one of {len(judged_idx)} parameters' {what}s stays inside its band over {n_steps} "
                        f"steps, or leaves it no more often than a clean pair's does; closest: {names[j]} at "
                        f"{at['ratio_peak'][j]:.3g} x its band (step {int(steps[peak[j]])}); {power_text}"
                        f"{floor_note}"))
    elif floor_note and res.findings:
        res.findings[0].message += floor_note
    if not_judged:
        res.add(Finding(STAGE, "warn", None, f"{kind}_not_judged", len(not_judged), 0,
                        f"{len(not_judged)} of {n_par} parameters have no value in the repeat(s), so no band: not "
                        f"judged (e.g. {', '.join(not_judged[:3])})"))
    shown = np.array(ranked[:opt.shown], dtype=np.int64)
    if len(shown):
        g = _band(paired, repeats, shown, opt, null=False)
        with np.errstate(invalid="ignore", divide="ignore"):
            scale_b = np.where(np.abs(g["b"]) > 0, np.abs(g["b"]), np.nan)
            res.curves = [{"name": names[j], "steps": steps, "rel_delta": g["delta"][:, k] / scale_b[:, k],
                           "rel_band": g["band"][:, k] / scale_b[:, k], "outside": g["outside"][:, k],
                           "repeats": [(r[:, j] - g["b"][:, k]) / scale_b[:, k] for r in repeats],
                           "departure_step": int(steps[start[j]]) if start[j] >= 0 else None}
                          for k, j in enumerate(shown)]
    return res


def _centre(g: dict[str, Any], repeats: list[np.ndarray], cols: np.ndarray, d_mean: np.ndarray,
            d_std: np.ndarray, d_n: np.ndarray, typ_band: np.ndarray, shown: np.ndarray) -> None:
    """Per unit of a block: the mean and spread of its delta over the compared steps, its median band, and
    whether a repeat sits off the baseline the same way (same sign, at least as far: rounding both share)."""
    ok = g["compared"] & np.isfinite(g["delta"])
    n = ok.sum(axis=0)
    d = np.where(ok, g["delta"], 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = d.sum(axis=0) / np.maximum(n, 1)
        var = np.where(ok, np.square(g["delta"] - mean), 0.0).sum(axis=0) / np.maximum(n - 1, 1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            med = np.nanmedian(np.where(ok, g["band"], np.nan), axis=0)
    d_mean[cols], d_std[cols], d_n[cols] = mean, np.sqrt(var), n
    typ_band[cols] = np.nan_to_num(med, nan=np.inf)
    for r in repeats:
        rd = r[:, cols] - g["b"]
        rok = ok & np.isfinite(rd)
        rm = np.where(rok, rd, 0.0).sum(axis=0) / np.maximum(rok.sum(axis=0), 1)
        shown[cols] |= (rm * mean > 0) & (np.abs(rm) >= np.abs(mean))


def _bias_p(mean: float, std: float, n: float, rho: float) -> float:
    """How often a clean delta's mean over ``n`` steps sits this far from 0: a t test on the independent steps
    the null's autocorrelation leaves (the repeats' own, not the candidate's: a drift is as slow as it likes)."""
    if n < 3 or not math.isfinite(mean):
        return 1.0 if mean == 0 or n < 3 else 0.0
    n_eff = stats.effective_n(n, rho)
    if not std > 0:
        return 1.0 if mean == 0 else 0.0
    return stats.t_sf2(abs(mean) / (std / math.sqrt(n_eff)), max(n_eff - 1.0, 1.0))


def compare_trajectories(baseline: Trajectory, candidate: Trajectory, repeats: list[Trajectory], mapping: Any,
                         opt: TrajectoryOptions | None = None, kind: str = "local_norm") -> TrajectoryResult:
    """Pair, band and judge: the whole comparison of one norm kind (``mapping``: a loaded Mapping)."""
    opt = opt or TrajectoryOptions()
    paired = pair_trajectories(baseline, candidate, mapping)
    return judge(paired, [repeat_values(paired, r) for r in repeats], opt, kind)


# -- which parameters jumped at one step ---------------------------------------------------------------------
def norm_jumps(paired: Paired, step: int, previous: int = 5, top: int = 5) -> list[dict[str, Any]]:
    """At ``step``, each unit's norm over the median of its ``previous`` recorded steps before it, on both
    sides; the ``top`` units whose jump differs most between the sides first (|log(candidate ratio /
    baseline ratio)|: a batch both runs find hard moves both alike and cancels; a unit one side lacks there
    is ranked by the other side's own jump)."""
    import warnings

    hit = np.flatnonzero(paired.steps == step)
    if not len(hit):
        return []
    i = int(hit[0])
    lo = max(0, i - previous)
    if lo == i:
        return []
    ratios = {}
    with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)       # a unit with no earlier value: NaN, skipped
        for side, v in (("baseline", paired.baseline), ("candidate", paired.candidate)):
            ref = np.nanmedian(np.where(paired.present[lo:i], v[lo:i], np.nan), axis=0)
            ratios[side] = (v[i] / ref, ref)
        lb, lc = np.log(ratios["baseline"][0]), np.log(ratios["candidate"][0])
        score = np.abs(np.where(np.isfinite(lb) & np.isfinite(lc), lc - lb, np.where(np.isfinite(lc), lc, lb)))
    score = np.where(paired.present[i] & np.isfinite(score), score, -1.0)
    out = []
    for j in np.argsort(-score, kind="stable")[:top]:
        if score[j] < 0:
            break
        out.append({"name": paired.names[j], "previous_steps": int(i - lo), "one_side_jump": float(np.exp(score[j])),
                    **{f"{side}_{k}": float(x) for side, (r, ref) in ratios.items()
                       for k, x in (("ratio", r[j]), ("previous_median", ref[j]))},
                    "baseline_value": float(paired.baseline[i, j]),
                    "candidate_value": float(paired.candidate[i, j])})
    return out
