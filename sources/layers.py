"""Layer tensors, whatever holds them: the protocol the layer-tensor comparator reads, and the one function
that opens it for a run or a path by asking the source table.

A source kind that holds layer tensors says so on its ``Source`` (sources/__init__.py): ``layers`` opens
them from a Run of that kind or a path detected as it, ``layers_only`` says the kind holds nothing else (no
loss curve, no norms). The run store (sources/store_dir.py) and msprobe dumps (sources/msprobe.py) are two;
adding a tensor-dump kind is adding one module to sources/ (docs/extending.md): the layer stage, the
procedure's comparability check and the comparators take it from the table.
"""

from __future__ import annotations

import math
import re
import threading
from os import PathLike
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from core.errors import BadInput
from runstore.seed_layout import load_npy
from sources import detect, sources
from sources.gather_totals import GatherMismatch, check_joined, expected, same_parts


class LayerSource(Protocol):
    """What the layer-tensor comparator (comparators.layer_tensors) reads: steps, ranks, and per step and
    rank the rows in execution order plus whether full tensors are stored.

    A row is a dict in the run store's ``tensor_stats`` vocabulary: ``order``, ``module``, ``kind``
    (``forward.input.0``, ``forward.output.0``, ``backward.grad_output.0``, ``backward.grad_input.0``),
    ``dtype``, ``shape`` ("8x2x32"), ``numel``, ``max``, ``min``, ``mean``, ``norm``, ``nan``, ``inf``, and
    ``ref``: where the full tensor is, None in statistics mode, ``("h5", file, dataset)`` for an HDF5
    dataset, or a file path (``.npy`` streams; other suffixes need a reader, see ``needs_readers``).
    """

    root: Path              # named when a side has no rows
    needs_readers: bool     # refs may name files numpy cannot stream (.pt): the layer stage passes torch readers

    def array_steps(self) -> list[int]: ...

    def array_ranks(self, step: int) -> list[int]: ...

    def layer_rows(self, step: int, rank: int = 0) -> tuple[list[dict[str, Any]], bool]: ...


def layer_source(obj: Any, required: bool = True) -> LayerSource | None:
    """The layer tensors of ``obj``: a layer source (returned as is), a Run (opened by its kind's
    ``layers``), or a path or reader with a ``root`` (detected first). A kind that holds no layer tensors
    is BadInput, or None when not ``required``."""
    if callable(getattr(obj, "layer_rows", None)):
        return obj
    kind = getattr(obj, "kind", None)
    if kind is None:    # a path (str, Path), else a reader of one (its ``root``)
        kind = detect(obj if isinstance(obj, (str, PathLike)) else obj.root)
    src = next((s for s in sources() if s.kind == kind), None)
    found = src.layers(obj) if src is not None and src.layers is not None else None
    if found is None and required:
        where = obj if isinstance(obj, (str, PathLike)) else getattr(obj, "path", getattr(obj, "root", obj))
        raise BadInput(f"{where}: {src.describe if src is not None else kind} holds no layer tensors")
    return found


def layers_only(run: Any) -> bool:
    """Whether ``run``'s kind holds layer tensors and nothing else (an msprobe dump: no loss, no norms)."""
    kind = getattr(run, "kind", None)
    return any(s.kind == kind and s.layers_only for s in sources())


# -- gathering a parallel run's parts into whole rows ----------------------------------------------------

_LAYER_NO = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
_ONE_EXPERT = re.compile(r"\.local_experts\.\d+(?:\.|$)")    # one expert's module (SequentialMLP), global index
_BIG = 1 << 30


UNORDERED = -(1 << 20)     # parse_split's dim for ``cp:x`` / ``tp:x``: parts in no order this module rebuilds
CpDim = int | str           # an int: Megatron's zig-zag chunks along it; "cD": contiguous blocks along D


def parse_split(text: Any) -> tuple[tuple[bool, int] | None, CpDim | None]:
    """``split`` column text -> ((gated, TP dim) or None, CP dim or None); "" = a whole tensor or a replica
    (dumpers.megatron.activation_split, dumpers.mindformers_layer_split write it). ``cp:D``: Megatron's zig-zag
    chunks; ``cp:cD``: contiguous blocks (MindFormers' layouts), returned as the text ``"cD"``; ``cp:x`` /
    ``tp:x`` -> UNORDERED (cannot be joined)."""
    tp: tuple[bool, int] | None = None
    cp: CpDim | None = None
    for part in str(text or "").split(","):
        axis, _, dim = part.strip().partition(":")
        if axis == "tp" and dim:
            tp = (False, UNORDERED) if dim == "x" else (dim.startswith("g"), int(dim.lstrip("g")))
        elif axis == "cp" and dim:
            cp = UNORDERED if dim == "x" else f"c{int(dim[1:])}" if dim.startswith("c") else int(dim)
    return tp, cp


def cp_axis(cp: CpDim) -> int:
    """The dim a CP split cuts (zig-zag or contiguous)."""
    return int(cp[1:]) if isinstance(cp, str) else int(cp)


def _shape_of(text: Any) -> list[int]:
    return [int(x) for x in str(text or "").split("x") if x.strip().isdigit()]


def combine_stats(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The statistics of a tensor from its parts' (disjoint pieces of it): max of the maxima, min of the
    minima, the mean weighted by element counts, the L2 norm as the root of the summed squares, nan / inf
    counts added."""
    n = [int(p.get("numel", 0) or 0) for p in parts]
    total = sum(n)
    mean = sum(float(p.get("mean", 0.0)) * k for p, k in zip(parts, n, strict=True)) / total if total else 0.0
    return {"numel": total, "max": max(float(p.get("max", 0.0)) for p in parts),
            "min": min(float(p.get("min", 0.0)) for p in parts), "mean": mean,
            "norm": math.sqrt(sum(float(p.get("norm", 0.0)) ** 2 for p in parts)),
            "nan": sum(int(p.get("nan", 0) or 0) for p in parts), "inf": sum(int(p.get("inf", 0) or 0) for p in parts)}


def join_parts(parts: list[list[np.ndarray]], tp: tuple[bool, int] | None, cp: CpDim | None) -> np.ndarray:
    """The whole tensor from its parts, ``parts[cp rank][tp rank]``: TP parts concatenated along their dim
    (a gated fc1's [gate_r | up_r] halves regrouped into [gate | up]), then the CP ranks' chunks put back
    in sequence order (runstore.cp_join; contiguous blocks ``"cD"`` concatenated in CP rank order)."""
    from runstore import cp_join

    whole = []
    for row in parts:
        if tp is None or len(row) == 1:
            whole.append(row[0])
        elif tp[0]:
            halves = [np.split(p, 2, axis=tp[1]) for p in row]
            whole.append(np.concatenate([h[0] for h in halves] + [h[1] for h in halves], axis=tp[1]))
        else:
            whole.append(np.concatenate(row, axis=tp[1]))
    if cp is None or len(whole) == 1:
        return whole[0]
    return np.concatenate(whole, axis=cp_axis(cp)) if isinstance(cp, str) else cp_join(whole, cp)


def load_ref(ref: Any) -> np.ndarray:
    """A row's full tensor as an array: ``("h5", file, dataset)``, a ``.npy`` path, or a gathered row's
    ``("gather", gated, tp dim, cp dim, parts[cp][tp], expected)``, checked against its parts' recorded
    statistics (sources.gather_totals: a mismatch is refused, the row is not judged)."""
    if isinstance(ref, (tuple, list)) and ref and ref[0] == "gather":
        _, gated, tp_dim, cp_dim, parts = ref[:5]
        tp = None if tp_dim is None else (bool(gated), int(tp_dim))
        whole = join_parts([[load_ref(p) for p in row] for row in parts], tp, cp_dim)
        return check_joined(whole, ref[5] if len(ref) > 5 else None)
    if isinstance(ref, (tuple, list)) and ref and ref[0] == "h5":
        from runstore.h5file import read_dataset

        h5, size = _open_h5(ref[1])
        try:
            ds = h5.get(ref[2])
        except (OSError, KeyError, ValueError, RuntimeError) as exc:
            raise BadInput(f"{ref[1]}: '{ref[2]}': unreadable ({' '.join(str(exc).split())[:80]})") from None
        return read_dataset(ref[1], ref[2], ds, size)   # its declared size checked before it is allocated
    return load_npy(Path(ref))


_OPEN: dict[tuple[str, int, int], Any] = {}
_OPEN_LOCK = threading.Lock()


def release_files() -> None:
    """Drop the step files ``load_ref`` kept open (after a compare: nothing stays open in a long process)."""
    with _OPEN_LOCK:
        _OPEN.clear()


def _open_h5(path: str) -> tuple[Any, int]:
    """A step file opened for reading and its size, kept open for the rows after it (a gathered compare
    reads every rank's file once per row: opening each time cost ~5 ms a row); keyed by inode and mtime, so
    a file replaced since is opened afresh. At most 64 kept (one dropped closes when no reader holds it).
    Only a regular file is opened (a FIFO would block HDF5); one HDF5 cannot open is a one-line BadInput."""
    import os
    import stat

    import h5py

    from runstore.schema import regular_file

    try:
        st = os.stat(path)
    except OSError:
        st = None
    if st is None or not stat.S_ISREG(st.st_mode):
        regular_file(path, "step file")     # raises, naming what it is
        st = os.stat(path)
    key = (str(path), st.st_ino, st.st_mtime_ns)
    with _OPEN_LOCK:
        h5 = _OPEN.get(key)
        if h5 is None or not h5.id.valid:
            if len(_OPEN) >= 64:
                for old in list(_OPEN)[:32]:
                    del _OPEN[old]
            try:
                h5 = _OPEN[key] = h5py.File(path, "r")
            except (OSError, ValueError, RuntimeError) as exc:
                raise BadInput(f"{path}: not a readable HDF5 file ({' '.join(str(exc).split())[:120]})") from None
    return h5, st.st_size


def _int(info: dict[str, Any], key: str, default: int = 0) -> int:
    v = info.get(key)
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else default


class GatheredLayers:
    """One whole model's rows from a parallel run's rank files, as one layer source with one rank.

    Which ranks: those of the lowest DP rank (every TP / CP / PP position of one replica), plus, under
    expert parallelism, one rank of each other EP rank for the experts that replica does not hold (names are
    global: dumpers.megatron). Each (module, kind, occurrence) row is put back together from the ranks
    holding its parts, as the ``split`` column says (TP parts concatenated, CP chunks joined in sequence
    order); a row with no split is a whole tensor or a replica: TP / CP rank 0's. Statistics combine
    (``combine_stats``); full tensors are joined when compared (``load_ref``). ``notes[step]`` says what was
    gathered, or left out.
    """

    def __init__(self, src: Any) -> None:
        self.src = src
        self.root = src.root
        self.needs_readers = src.needs_readers
        self.notes: dict[int, list[str]] = {}
        self._cache: dict[int, tuple[list[dict[str, Any]], bool]] = {}

    def array_steps(self) -> list[int]:
        return self.src.array_steps()

    def array_ranks(self, step: int) -> list[int]:
        ranks = self.src.array_ranks(step)
        return ranks[:1]

    def rank_info(self, rank: int) -> dict[str, Any]:
        return self.src.rank_info(rank)

    def layer_rows(self, step: int, rank: int = 0) -> tuple[list[dict[str, Any]], bool]:
        if step not in self._cache:
            self._cache[step] = self._gather(step)
        rows, has = self._cache[step]
        return [dict(r) for r in rows], has

    def _permuted(self) -> bool:
        """Whether the store's expert rows hold permuted tokens (Megatron's experts see their EP group's tokens);
        MindFormers' routed experts (FFNGroupedGEMM) return them in token order, the whole MoE layer."""
        meta = getattr(getattr(self.src, "reader", None), "meta", None) or {}
        return meta.get("framework") not in ("mindspore", "mindformers")

    def expert_rows(self, step: int, group: int) -> dict[tuple[str, str, int], dict[str, Any]] | None:
        """One expert's rows of ``step`` (``local_experts.<g>``, a store whose experts see permuted tokens: not
        MindFormers') joined to hold the tokens of ``group`` DP ranks, to pair with a run of EP size ``group``.

        Why it holds: Megatron's all-gather dispatcher gathers an EP group's tokens in rank order
        (``gather_from_sequence_parallel_region``) and takes each expert's in token order (``moe_utils.permute``),
        so an expert's rows at EP = ``group`` are its rows of the ``group / t`` EP groups of size t (DP ranks
        0 .. group - 1 here) concatenated on the token dim, micro-batch by micro-batch. Keyed by
        (module, kind, occurrence); None when the store has no such rows, its group does not divide ``group``,
        or it holds fewer DP ranks (then the rows stay unpaired)."""
        rows, _ = self.layer_rows(step)
        mine = [r for r in rows if _ONE_EXPERT.search(r["module"])] if self._permuted() else []
        t = max((int(r.get("token_group", 1)) for r in mine), default=1)
        if not mine or group <= t or group % t:
            return None
        info = {r: self.src.rank_info(r) for r in self.src.array_ranks(step)}
        groups: dict[int, list[int]] = {}
        for r, i in info.items():
            d = _int(i, "dp_rank", r) if "dp_rank" in i else r
            if d < group and _int(i, "tp_rank") == 0 and _int(i, "cp_rank") == 0:
                groups.setdefault(d // t, []).append(r)
        if sorted(groups) != list(range(group // t)):
            return None
        keyed: dict[int, dict[tuple[str, str, int], dict[str, Any]]] = {}

        def rows_of(r: int) -> dict[tuple[str, str, int], dict[str, Any]]:
            if r not in keyed:
                seen: dict[tuple[str, str], int] = {}
                keyed[r] = {}
                for row in self.src.layer_rows(step, r)[0]:
                    k = (row["module"], row["kind"])
                    seen[k] = seen.get(k, 0) + 1
                    keyed[r][(row["module"], row["kind"], seen[k])] = row
            return keyed[r]

        seen: dict[tuple[str, str], int] = {}
        occurrence = {}
        for row in rows:
            k = (row["module"], row["kind"])
            seen[k] = seen.get(k, 0) + 1
            occurrence[id(row)] = seen[k]
        out = {}
        for row in mine:
            key = (row["module"], row["kind"], occurrence[id(row)])
            parts = [next((rows_of(r)[key] for r in sorted(groups[j]) if key in rows_of(r)), None)
                     for j in range(group // t)]
            if any(p is None for p in parts):
                return None
            out[key] = {**_merged(None, [parts], (False, 0), None, int(row["order"])), "token_group": group}
        return out

    def _members(self, step: int) -> tuple[list[int], list[int], dict[int, dict[str, Any]]]:
        ranks = self.src.array_ranks(step)
        info = {r: self.src.rank_info(r) for r in ranks}
        # a rank file without coordinates is a DP rank of its own (as runstore.batches.data_groups reads it)
        dp = {r: _int(info[r], "dp_rank", -1) if "dp_rank" in info[r] else r for r in ranks}
        primary = [r for r in ranks if dp[r] == min(dp.values())]

        def where(r: int) -> tuple[int, ...]:
            return tuple(_int(info[r], k) for k in ("pp_rank", "tp_rank", "cp_rank", "ep_rank"))

        covered = {where(r) for r in primary}
        extra = []
        for r in ranks:
            if r not in primary and _int(info[r], "ep", 1) > 1 and where(r) not in covered:
                extra.append(r)
                covered.add(where(r))
        return primary, extra, info

    def _gather(self, step: int) -> tuple[list[dict[str, Any]], bool]:
        primary, extra, info = self._members(step)
        notes = self.notes.setdefault(step, [])
        read = {r: self.src.layer_rows(step, r) for r in primary + extra}
        sizes = {ax: max(_int(info[r], ax, _int(info[r], f"{ax}_size", 1)) for r in read) for ax in ("tp", "cp", "ep")}
        if len(read) == 1 and sizes["tp"] == sizes["cp"] == 1:
            return read[primary[0]]     # one rank holding the whole model (a rank alone at TP > 1 gathers: parts lost)
        own = {row["module"] for r in primary for row in read[r][0]}
        entries: dict[tuple[str, str, int], list[tuple[int, dict[str, Any]]]] = {}
        first_at: dict[tuple[str, str, int], tuple[Any, ...]] = {}
        for r in primary + extra:
            rows, _ = read[r]
            seen: dict[tuple[str, str], int] = {}
            for i, row in enumerate(rows):
                if r in extra and row["module"] in own:
                    continue    # a dense module of another DP rank: other data
                k = (row["module"], row["kind"])
                seen[k] = seen.get(k, 0) + 1
                key = (row["module"], row["kind"], seen[k])
                entries.setdefault(key, []).append((r, row))
                if key not in first_at:
                    back = int(str(row["kind"]).startswith("backward"))
                    m = _LAYER_NO.search(row["module"])
                    # embeddings before the layers, the rest (final norm, output layer, MTP) after them
                    pos = int(m.group(1)) if m else -1 if "embedding" in row["module"] else _BIG
                    pp = _int(info[r], "pp_rank")
                    first_at[key] = (back, seen[k], -pos if back else pos, -pp if back else pp, i)
        permuted = self._permuted()
        out: list[dict[str, Any]] = []
        has_all = all(read[r][1] for r in read)
        unsplit, incomplete, unordered, unread = 0, [], [], []
        for key in sorted(entries, key=first_at.__getitem__):
            holders = entries[key]
            tp, cp = parse_split(holders[0][1].get("split"))
            what = f"{key[0]} {key[1]}"
            if cp == UNORDERED:
                unordered.append(what)
                continue
            if tp is not None and tp[1] == UNORDERED:
                unread.append(what)
                continue
            grid: dict[int, dict[int, tuple[int, dict[str, Any]]]] = {}
            for r, row in holders:
                at = grid.setdefault(_int(info[r], "cp_rank"), {})
                t = _int(info[r], "tp_rank")
                if t in at and (tp is not None or cp is not None) and \
                        _int(info[at[t][0]], "pp_rank") == _int(info[r], "pp_rank"):
                    raise GatherMismatch(
                        f"{self.root}: {what}: ranks {at[t][0]} and {r} both hold TP rank {t}, CP rank "
                        f"{_int(info[r], 'cp_rank')} of DP rank {_int(info[r], 'dp_rank')} (ranks/rank_R.json): "
                        "one rank's part written twice or a rank's coordinates wrong; not judged")
                at.setdefault(t, (r, row))
            cps = sorted(grid) if cp is not None else sorted(grid)[:1]
            if cp is not None and cps != list(range(sizes["cp"])):
                gone = sorted(set(range(sizes["cp"])) - set(cps))
                incomplete.append(f"{what}: CP rank {_ranges(gone)} of {sizes['cp']} absent")
                continue
            parts: list[list[tuple[int, dict[str, Any]]]] = []
            for c in cps:
                tps = sorted(grid[c]) if tp is not None else sorted(grid[c])[:1]
                if tp is not None and tps != list(range(sizes["tp"])):
                    gone = sorted(set(range(sizes["tp"])) - set(tps))
                    incomplete.append(f"{what}: TP rank {_ranges(gone)} of {sizes['tp']} absent"
                                      + (f" at CP rank {c}" if sizes["cp"] > 1 else ""))
                    break
                parts.append([grid[c][t] for t in tps])
            else:
                flat = [p for rowp in parts for p in rowp]
                if len(flat) > 1:
                    why = same_parts([row for _, row in flat], [f"rank {r}" for r, _ in flat], f"{self.root}: {what}")
                    if why is not None:
                        raise GatherMismatch(why)
                if len(holders) > 1 and "split" not in holders[0][1]:
                    unsplit += 1
                rows_only = [[row for _, row in rowp] for rowp in parts]
                out.append(_merged(flat[0][1] if len(flat) == 1 else None, rows_only, tp, cp, len(out)))
                if permuted and sizes["ep"] > 1 and ".experts." in f".{key[0]}.":
                    # an expert sees the tokens of its whole EP group's micro-batches (all-gather / all-to-all)
                    out[-1]["token_group"] = sizes["ep"]
        ranks = sorted(read)
        notes.append(f"rows gathered from ranks {ranks} (DP rank {_int(info[primary[0]], 'dp_rank')}"
                     + (f"; experts from ranks {extra}" if extra else "") + ")")
        if unsplit:
            notes.append(f"{unsplit} rows held by several TP / CP ranks record no split: TP / CP rank 0's "
                         "taken as the whole (a replica)")
        if unordered:
            notes.append(f"{len(unordered)} rows left out: CP parts in no sequence order (attention internals; "
                         f"first: {unordered[0]})")
        if unread:
            notes.append(f"{len(unread)} rows left out: TP parts in a layout not read (first: {unread[0]})")
        if incomplete:
            notes.append(f"{len(incomplete)} rows left out: parts of them missing (first: {incomplete[0]})")
        return out, has_all


def _ranges(ns: list[int]) -> str:
    """[1, 2, 3, 5] -> "1-3, 5"."""
    out, i = [], 0
    while i < len(ns):
        j = i
        while j + 1 < len(ns) and ns[j + 1] == ns[j] + 1:
            j += 1
        out.append(str(ns[i]) if i == j else f"{ns[i]}-{ns[j]}")
        i = j + 1
    return ", ".join(out)


def _merged(single: dict[str, Any] | None, parts: list[list[dict[str, Any]]], tp: tuple[bool, int] | None,
            cp: CpDim | None, order: int) -> dict[str, Any]:
    """One whole row from its parts (``parts[cp][tp]``): statistics combined, shape summed along the split
    dims, the reference a ``("gather", ...)`` of the parts' references (None when one has no tensor)."""
    if single is not None:
        return {**single, "order": order, "split": ""}
    flat = [p for row in parts for p in row]
    first = flat[0]
    shape = _shape_of(first.get("shape"))
    if shape:
        if tp is not None and len(parts[0]) > 1:
            d = tp[1] % len(shape)
            shape[d] = sum(_shape_of(p.get("shape"))[d] for p in parts[0])
        if cp is not None and len(parts) > 1:
            d = cp_axis(cp) % len(shape)
            shape[d] = sum(_shape_of(row[0].get("shape"))[d] * (len(row) if tp is not None and
                                                                 tp[1] % len(shape) == d else 1) for row in parts)
    refs = [[p.get("ref") for p in row] for row in parts]
    stats = combine_stats(flat)
    at = refs[0][0][1] if isinstance(refs[0][0], (tuple, list)) else refs[0][0]
    ref = None if any(x is None for row in refs for x in row) else \
        ("gather", bool(tp and tp[0]), None if tp is None else tp[1], cp, refs,
         expected(stats, len(flat), f"{at}: {first.get('module')} {first.get('kind')}"))
    return {**first, **stats, "order": order, "shape": "x".join(map(str, shape)),
            "ref": ref, "split": "", "gathered_from": len(flat)}


def gather_layers(src: Any) -> Any:
    """``src`` as one whole model's rows (``GatheredLayers``) when it knows its ranks' coordinates (a run
    store), else ``src`` itself (an msprobe dump: rank by rank)."""
    if src is None or not callable(getattr(src, "rank_info", None)) or isinstance(src, GatheredLayers):
        return src
    return GatheredLayers(src)
