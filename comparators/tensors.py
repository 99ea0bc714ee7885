"""Layer tensors of two runs (activations forward, their gradients backward), compared row by row.

Metrics carry the names msprobe users know: cosine, max abs err, max relative err, RMSE, one-thousandth and
five-thousandths err ratios (share of elements whose relative error is within 0.001 / 0.005), nan/inf
counts; plus the relative L2 error ||a-b|| / ||b||, the metric the verdict uses because it stays meaningful
where cosine rounds to 1.0. Thresholds depend on the tensor's original dtype (float32 noise is ~1e-7 per
op, bfloat16 ~4e-3). When only statistics were dumped, max/min/mean/norm are compared instead.

Why streaming: full-tensor dumps run to gigabytes. Tensors are read in cache-sized chunks straight from the
HDF5 files (one tensor pair at a time, two in flight on two threads), so memory stays at a few chunks and
the throughput is bounded by memory bandwidth, not by Python.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from align.core.errors import BadInput
from align.core.findings import Finding, StageResult

STAGE = "layer_tensors"
CHUNK = 1 << 18     # elements per chunk (1 MiB of float32): stays in L2 across the ~12 passes per chunk
# dtype -> (rel L2 error passes up to, warns up to, cosine passes from)
TOLERANCE = {"float32": (1e-4, 1e-2, 0.99999), "float64": (1e-8, 1e-4, 0.9999999),
             "float16": (2e-3, 5e-2, 0.999), "bfloat16": (1e-2, 1e-1, 0.999)}


def tolerance(dtype: str, table: dict[str, tuple[float, float, float]] | None = None
              ) -> tuple[float, float, float]:
    """(pass, warn, cosine) for ``dtype``; ``table`` overrides TOLERANCE per dtype (e.g. a measured noise)."""
    d = str(dtype).lower().replace("torch.", "").replace("mindspore.", "")
    d = {"float": "float32", "fp32": "float32", "bf16": "bfloat16", "half": "float16", "fp16": "float16",
         "double": "float64"}.get(d, d)
    table = {**TOLERANCE, **(table or {})}
    return table.get(d, table["float32"])


# ------------------------------------------------------------------------------------------------------
# Metrics
# ------------------------------------------------------------------------------------------------------

@dataclass
class Metrics:
    numel: int = 0
    cosine: float = math.nan
    max_abs_err: float = 0.0
    max_rel_err: float = 0.0
    rmse: float = 0.0
    rel_l2: float = 0.0
    one_thousandth_err_ratio: float = 1.0
    five_thousandths_err_ratio: float = 1.0
    nan_baseline: int = 0
    nan_candidate: int = 0
    inf_baseline: int = 0
    inf_candidate: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class _Acc:
    """Running sums over chunks (float64 accumulators over float32 chunk results)."""

    def __init__(self) -> None:
        self.n = 0
        self.ab = self.aa = self.bb = self.dd = 0.0
        self.max_abs = self.max_rel = 0.0
        self.within1 = self.within5 = 0
        self.nan = [0, 0]
        self.inf = [0, 0]

    def add(self, a: np.ndarray, b: np.ndarray, work: np.ndarray, work2: np.ndarray) -> None:
        n = a.size
        if n > work.size:    # keep every pass inside the cache-sized work buffers
            for s in range(0, n, work.size):
                self.add(a[s:s + work.size], b[s:s + work.size], work, work2)
            return
        aa, bb = float(np.dot(a, a)), float(np.dot(b, b))
        if not (math.isfinite(aa) and math.isfinite(bb)):    # rare path: count exactly, then neutralise
            for i, x in enumerate((a, b)):
                nan, inf = np.isnan(x), np.isinf(x)
                self.nan[i] += int(nan.sum())
                self.inf[i] += int(inf.sum())
                x[nan | inf] = 0.0
            aa, bb = float(np.dot(a, a)), float(np.dot(b, b))
        d, rel = work[:n], work2[:n]
        self.aa += aa
        self.bb += bb
        self.ab += float(np.dot(a, b))
        np.subtract(a, b, out=d)
        self.dd += float(np.dot(d, d))
        np.abs(d, out=d)
        self.max_abs = max(self.max_abs, float(d.max()) if n else 0.0)
        # relative error |a-b| / |b| (|b| floored at 1e-12, so b == 0 with a == b counts as exact)
        np.abs(b, out=rel)
        np.maximum(rel, np.float32(1e-12), out=rel)
        np.divide(d, rel, out=rel)
        self.max_rel = max(self.max_rel, float(rel.max()) if n else 0.0)
        self.within5 += int(np.count_nonzero(rel <= np.float32(0.005)))
        self.within1 += int(np.count_nonzero(rel <= np.float32(0.001)))
        self.n += n

    def result(self) -> Metrics:
        n = max(self.n, 1)
        denom = math.sqrt(self.aa * self.bb)
        cos = self.ab / denom if denom > 0 else (1.0 if self.aa == self.bb == 0 else 0.0)
        return Metrics(numel=self.n, cosine=cos, max_abs_err=self.max_abs, max_rel_err=self.max_rel,
                       rmse=math.sqrt(self.dd / n), rel_l2=math.sqrt(self.dd / self.bb) if self.bb > 0 else (
                           0.0 if self.dd == 0 else math.inf),
                       one_thousandth_err_ratio=self.within1 / n, five_thousandths_err_ratio=self.within5 / n,
                       nan_baseline=self.nan[0], nan_candidate=self.nan[1], inf_baseline=self.inf[0],
                       inf_candidate=self.inf[1])


def _chunks(ds: h5py.Dataset, buf: np.ndarray) -> Iterator[np.ndarray]:
    """Yield float32 chunks of a dataset, read in row blocks without materialising the whole tensor."""
    if ds.shape == () or ds.ndim == 0:
        buf[0] = np.float32(ds[()])
        yield buf[:1]
        return
    rows = ds.shape[0]
    per_row = int(np.prod(ds.shape[1:])) if ds.ndim > 1 else 1
    if per_row > CHUNK or ds.dtype != np.float32:
        step = max(1, CHUNK // max(per_row, 1))
        for r in range(0, rows, step):
            yield np.ascontiguousarray(ds[r:r + step], dtype=np.float32).ravel()
        return
    step = max(1, CHUNK // per_row)
    for r in range(0, rows, step):
        e = min(rows, r + step)
        out = buf[: (e - r) * per_row].reshape((e - r,) + ds.shape[1:])
        ds.read_direct(out, np.s_[r:e])
        yield out.ravel()


def compare_arrays(a: np.ndarray, b: np.ndarray) -> Metrics:
    """All metrics for two in-memory arrays (a = baseline, b = candidate)."""
    acc = _Acc()
    a = np.ascontiguousarray(a, dtype=np.float32).ravel()
    b = np.ascontiguousarray(b, dtype=np.float32).ravel()
    if a.size != b.size:
        raise BadInput(f"shapes differ: {a.size} vs {b.size} elements")
    w1, w2 = np.empty(CHUNK, np.float32), np.empty(CHUNK, np.float32)
    for s in range(0, max(a.size, 1), CHUNK):
        acc.add(a[s:s + CHUNK].copy(), b[s:s + CHUNK].copy(), w1, w2)
    return acc.result()


def compare_datasets(da: h5py.Dataset, db: h5py.Dataset, transpose_a: bool = False) -> Metrics:
    """Stream two HDF5 datasets chunk by chunk. ``transpose_a``: baseline is [s, b, ...], candidate [b, s,
    ...] (Megatron vs MindFormers activations); then the baseline is read whole and transposed."""
    if transpose_a:
        return compare_arrays(np.swapaxes(da[...], 0, 1), db[...])
    if da.size != db.size:
        raise BadInput(f"{da.name}: {da.shape} vs {db.shape}")
    acc = _Acc()
    ba, bb = np.empty(CHUNK, np.float32), np.empty(CHUNK, np.float32)
    w1, w2 = np.empty(CHUNK, np.float32), np.empty(CHUNK, np.float32)
    if da.shape == db.shape:
        for ca, cb in zip(_chunks(da, ba), _chunks(db, bb), strict=True):
            acc.add(ca, cb, w1, w2)
    else:   # same size, different shape (e.g. flattened on one side): compare flat
        acc.add(np.asarray(da[...], np.float32).ravel(), np.asarray(db[...], np.float32).ravel(),
                np.empty(da.size, np.float32), np.empty(da.size, np.float32))
    return acc.result()


# ------------------------------------------------------------------------------------------------------
# Reading the two dumps and pairing rows
# ------------------------------------------------------------------------------------------------------

def _read_stats(path: Path) -> tuple[list[dict[str, Any]], bool]:
    from align.core.runstore import check_table

    try:
        with h5py.File(path, "r") as h5:
            if "tensor_stats" not in h5:
                return [], "tensors" in h5
            g = h5["tensor_stats"]
            cols = {}
            for k, ds in g.items():
                if not isinstance(ds, h5py.Dataset):
                    continue
                arr = ds[...]
                if arr.dtype.kind in ("O", "S"):
                    arr = np.array([x.decode() if isinstance(x, bytes) else str(x) for x in arr], dtype=object)
                cols[k] = arr
            has_tensors = "tensors" in h5
    except OSError as exc:
        raise BadInput(f"{path}: not a readable HDF5 file ({' '.join(str(exc).split())[:80]})") from None
    check_table(path, "tensor_stats", cols)
    n = len(cols.get("order", []))
    rows = [{k: (v[i].item() if hasattr(v[i], "item") else v[i]) for k, v in cols.items()} for i in range(n)]
    rows.sort(key=lambda r: r["order"])
    return rows, has_tensors


def _file(run: Any, step: int, rank: int) -> Path:
    from align.core.runstore import RunReader

    reader = run if hasattr(run, "array_ranks") else RunReader(run)
    return Path(reader.step_file(step, rank))


def _direction(kind: str) -> str:
    return "backward" if str(kind).startswith("backward") else "forward"


def _layer_of(module: str) -> int | None:
    import re

    m = re.search(r"layers\.(\d+)", module)
    return int(m.group(1)) if m else None


def _stats_verdict(rb: dict[str, Any], rc: dict[str, Any], tol: tuple[float, float, float]
                   ) -> tuple[str, float, dict[str, float]]:
    """Statistics-only: norm relative difference, and max/min/mean relative to the tensor's scale."""
    nb, nc = float(rb.get("norm", 0.0)), float(rc.get("norm", 0.0))
    numel = max(int(rb.get("numel", 1) or 1), 1)
    rms = nb / math.sqrt(numel) if nb > 0 else 1e-30
    scale = max(abs(float(rb.get("max", 0.0))), abs(float(rb.get("min", 0.0))), 1e-30)
    diffs = {"norm_rel_diff": abs(nb - nc) / max(abs(nb), 1e-30) if nb != nc else 0.0,
             "max_diff": abs(float(rb.get("max", 0)) - float(rc.get("max", 0))) / scale,
             "min_diff": abs(float(rb.get("min", 0)) - float(rc.get("min", 0))) / scale,
             "mean_diff": abs(float(rb.get("mean", 0)) - float(rc.get("mean", 0))) / rms}
    worst_v = max(v if math.isfinite(v) else math.inf for v in diffs.values())
    if any(int(r.get(k, 0) or 0) for r in (rb, rc) for k in ("nan", "inf")):
        if (int(rb.get("nan", 0)), int(rb.get("inf", 0))) != (int(rc.get("nan", 0)), int(rc.get("inf", 0))):
            return "fail", math.inf, diffs
    v = "pass" if worst_v <= tol[0] else "warn" if worst_v <= tol[1] else "fail"
    return v, worst_v, diffs


def _tensor_verdict(mt: Metrics, tol: tuple[float, float, float]) -> str:
    if (mt.nan_baseline, mt.inf_baseline) != (mt.nan_candidate, mt.inf_candidate):
        return "fail"
    if not math.isfinite(mt.rel_l2) or mt.rel_l2 > tol[1] or mt.cosine < 0.99:
        return "fail"
    if mt.rel_l2 > tol[0] or mt.cosine < tol[2]:
        return "warn"
    return "pass"


def compare_layer_tensors(baseline: Any, candidate: Any, mapping: Any = None, *, step: int = 1,
                          rank: int = 0, candidate_rank: int | None = None, stats_only: bool = False,
                          threads: int = 2, tolerances: dict[str, tuple[float, float, float]] | None = None
                          ) -> StageResult:
    """Compare layer tensors of ``step``; names the first departing layer, forward then backward.

    Rows pair by module name through the mapping (same-scheme runs pair by identical names), the row kind
    (``forward.output.0`` ...) and the occurrence count of that (module, kind) in execution order.
    """
    from align.core.mapping import Mapping

    m = mapping if isinstance(mapping, Mapping) else Mapping.load(mapping)
    pa, pb = _file(baseline, step, rank), _file(candidate, step, rank if candidate_rank is None else candidate_rank)
    rows_a, tens_a = _read_stats(pa)
    rows_b, tens_b = _read_stats(pb)
    res = StageResult(STAGE)
    if not rows_a or not rows_b:
        missing = [str(p) for p, r in ((pa, rows_a), (pb, rows_b)) if not r]
        res.details = {"reason": "no tensor_stats table in " + ", ".join(missing)}
        return res
    mods_b = {r["module"] for r in rows_b}
    same_scheme = sum(r["module"] in mods_b for r in rows_a) >= len({r["module"] for r in rows_a}) / 2
    transpose = (not same_scheme and m.activation_layout.get("baseline") == "sbh"
                 and m.activation_layout.get("candidate") == "bsh")

    def key(mod: str, kind: str, seen: dict[tuple[str, str], int]) -> tuple[str, str, int]:
        k = (mod, kind)
        seen[k] = seen.get(k, 0) + 1
        return mod, kind, seen[k]

    seen_b: dict[tuple[str, str], int] = {}
    index_b = {key(r["module"], r["kind"], seen_b): r for r in rows_b}
    seen_a: dict[tuple[str, str], int] = {}
    pairs, unmatched = [], []
    for r in rows_a:
        target = r["module"] if same_scheme else m.map_module(r["module"], "baseline")
        kb = key(r["module"], r["kind"], seen_a)
        rb = index_b.get((target, r["kind"], kb[2])) if target else None
        if rb is None:
            unmatched.append(r["module"] + " " + r["kind"])
        else:
            pairs.append((r, rb))
    full = tens_a and tens_b and not stats_only
    rows_out: list[dict[str, Any]] = []

    def work(pair: tuple[dict[str, Any], dict[str, Any]]) -> dict[str, Any]:
        ra, rb = pair
        tol = tolerance(ra.get("dtype", "float32"), tolerances)
        out = {"order": int(ra["order"]), "module": ra["module"], "candidate_module": rb["module"],
               "kind": ra["kind"], "direction": _direction(ra["kind"]), "layer": _layer_of(ra["module"]),
               "dtype": ra.get("dtype", "float32"), "shape": ra.get("shape", ""),
               "candidate_shape": rb.get("shape", "")}
        key_a, key_b = f"tensors/{int(ra['order']):06d}", f"tensors/{int(rb['order']):06d}"
        if full:
            with h5py.File(pa, "r") as ha, h5py.File(pb, "r") as hb:
                if key_a in ha and key_b in hb:
                    da, db = ha[key_a], hb[key_b]
                    tr = transpose and da.ndim >= 2 and da.shape != db.shape and \
                        (da.shape[1], da.shape[0]) + da.shape[2:] == db.shape
                    mt = compare_datasets(da, db, transpose_a=tr)
                    out.update(mt.as_dict(), mode="tensor", verdict=_tensor_verdict(mt, tol),
                               metric="rel_l2", value=mt.rel_l2, threshold=tol[0])
                    return out
        v, worst_v, diffs = _stats_verdict(ra, rb, tol)
        out.update(diffs, mode="stats", verdict=v, metric="stats_rel_diff", value=worst_v, threshold=tol[0],
                   nan_baseline=int(ra.get("nan", 0)), nan_candidate=int(rb.get("nan", 0)),
                   inf_baseline=int(ra.get("inf", 0)), inf_candidate=int(rb.get("inf", 0)))
        return out

    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        rows_out = list(pool.map(work, pairs))
    first = {}
    for direction in ("forward", "backward"):
        for r in rows_out:
            if r["direction"] == direction and r["verdict"] != "pass":
                first[direction] = r
                break
    for direction in ("forward", "backward"):
        r = first.get(direction)
        if r is None:
            continue
        where = f"layer {r['layer']}, " if r["layer"] is not None else ""
        if direction == "backward" and "forward" in first:
            where = "(after the forward departure, expected) " + where
        res.add(Finding(STAGE, r["verdict"], r["module"], r["metric"], r["value"], r["threshold"],
                        f"first departing {direction} tensor: {where}{r['module']} {r['kind']} "
                        f"({r['mode']} compare, {r['dtype']}: {r['metric']} {r['value']:.3g} > {r['threshold']:g})"))
    if unmatched:
        res.add(Finding(STAGE, "warn", unmatched[0].split(" ")[0], "unmatched_rows", len(unmatched), 0,
                        f"{len(unmatched)} baseline tensor rows have no counterpart (first: {unmatched[0]}); "
                        "not compared"))
    extra_b = len(rows_b) - len(pairs)
    if not first and rows_out:
        res.add(Finding(STAGE, "pass", None, "rows_within_tolerance", len(rows_out), None,
                        f"all {len(rows_out)} compared tensor rows within their dtype's tolerance"))
    departing = [r for r in rows_out if r["verdict"] != "pass"]
    res.details = {"step": step, "rank": rank, "compared": len(rows_out),
                   "mode": "tensor" if full else "stats", "departing": len(departing),
                   "first_departing_forward": _brief(first.get("forward")),
                   "first_departing_backward": _brief(first.get("backward")),
                   "first_departing_layer": (first.get("forward") or first.get("backward") or {}).get("layer"),
                   "unmatched_baseline": unmatched, "unmatched_candidate_rows": extra_b,
                   "rows": rows_out, "per_layer": _per_layer(rows_out)}
    return res


def _brief(r: dict[str, Any] | None) -> dict[str, Any] | None:
    if r is None:
        return None
    return {k: r[k] for k in ("module", "kind", "layer", "order", "metric", "value", "threshold", "mode")}


def _per_layer(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The per-layer error profile: worst metric value per (direction, layer)."""
    acc: dict[tuple[str, Any], dict[str, Any]] = {}
    for r in rows:
        k = (r["direction"], r["layer"])
        a = acc.setdefault(k, {"direction": r["direction"], "layer": r["layer"], "worst": 0.0, "rows": 0})
        a["rows"] += 1
        v = r["value"] if math.isfinite(r["value"]) else math.inf
        a["worst"] = max(a["worst"], v)
    return sorted(acc.values(), key=lambda a: (a["direction"] != "forward", a["layer"] is None,
                                               a["layer"] if a["layer"] is not None else 0))
