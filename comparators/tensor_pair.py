"""One work item of the layer-tensor compare: a baseline row against its candidate row, judged by dtype.

Thresholds depend on the dtype a row is judged as (float32 noise is ~1e-7 per op, bfloat16 ~4e-3). Full
tensors are compared by their metrics (rel L2 and cosine); when only statistics were dumped, max/min/mean/norm
are compared instead. ``compare_pair`` is a plain function of plain data, so threads, processes and Dask
workers (comparators.tensor_dispatch) run the very same code.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from comparators.tensor_metrics import Metrics, Readers, compare_arrays, compare_datasets, compare_files, compare_raw
from core.dtypes import normalize
from core.errors import BadInput
from runstore.h5file import check_dataset, open_h5
from sources.layers import load_ref

# dtype -> (rel L2 error passes up to, warns up to, cosine passes from)
TOLERANCE = {"float32": (1e-4, 1e-2, 0.99999), "float64": (1e-8, 1e-4, 0.9999999),
             "float16": (2e-3, 5e-2, 0.999), "bfloat16": (1e-2, 1e-1, 0.999)}


def tolerance(dtype: str, table: dict[str, tuple[float, float, float]] | None = None
              ) -> tuple[float, float, float]:
    """(pass, warn, cosine) for ``dtype``; ``table`` overrides TOLERANCE per dtype (e.g. a measured noise)."""
    d = normalize(dtype)
    table = {**TOLERANCE, **(table or {})}
    return table.get(d, table["float32"])

def direction_of(kind: str) -> str:
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


def _shape(s: Any) -> tuple[int, ...]:
    return tuple(int(x) for x in str(s).split("x") if x != "") if s not in (None, "") else ()


def compare_pair(task: dict[str, Any]) -> dict[str, Any]:
    """One work item: one baseline row against its candidate row (tensor files, else statistics).

    A plain function of plain data, so threads, processes and Dask workers run the very same code and the
    results do not depend on where it ran.
    """
    ra, rb, full, transpose = task["a"], task["b"], task["full"], task["transpose"]
    judged = task.get("judged_dtype") or ra.get("dtype", "float32")
    tol = tolerance(judged, task.get("tolerances"))
    out = {"order": int(ra["order"]), "module": ra["module"], "candidate_module": rb["module"],
           "kind": ra["kind"], "direction": direction_of(ra["kind"]), "layer": _layer_of(ra["module"]),
           "dtype": ra.get("dtype", "float32"), "judged_dtype": normalize(judged), "shape": ra.get("shape", ""),
           "candidate_shape": rb.get("shape", ""), "step": task.get("step"), "rank": task.get("rank")}
    ref_a, ref_b = ra.get("ref"), rb.get("ref")
    mt = Metrics(**task["metrics"]) if task.get("metrics") else None
    if mt is None and full and ref_a is not None and ref_b is not None:
        sa, sb = _shape(ra.get("shape")), _shape(rb.get("shape"))
        tr = transpose and len(sa) >= 2 and sa != sb and (sa[1], sa[0]) + sa[2:] == sb
        # a row put together from TP / CP ranks' parts, or a run store's dataset against a dump's .npy
        if _gathered(ref_a) or _gathered(ref_b) or isinstance(ref_a, str) != isinstance(ref_b, str):
            try:
                a, b = load_ref(ref_a), load_ref(ref_b)
            except ValueError:      # parts that do not join (shapes): compared by their combined statistics
                a = b = None
            if a is not None and b is not None and a.size == b.size:
                mt = compare_arrays(np.swapaxes(a, 0, 1) if tr else a, b)
        elif task.get("raw") is not None:     # both raw float32 at offsets found by the dispatcher
            off_a, off_b, size = task["raw"]
            mt = compare_raw(ref_a[1], off_a, ref_b[1], off_b, size)
        elif isinstance(ref_a, (tuple, list)) and isinstance(ref_b, (tuple, list)):   # both HDF5 (run stores)
            with open_h5(ref_a[1]) as ha, open_h5(ref_b[1]) as hb:
                da, db = _stored(ha, ref_a, task), _stored(hb, ref_b, task)
                if da is not None and db is not None:
                    tr = transpose and da.ndim >= 2 and da.shape != db.shape and \
                        (da.shape[1], da.shape[0]) + da.shape[2:] == db.shape
                    mt = compare_datasets(da, db, transpose_a=tr) if da.size == db.size else None
        elif isinstance(ref_a, str) and isinstance(ref_b, str):
            if math.prod(sa or (1,)) == math.prod(sb or (1,)):
                mt = compare_files(ref_a, ref_b, transpose_a=tr, readers=task.get("readers"))
    if mt is not None:
        out.update(mt.as_dict(), mode="tensor", verdict=_tensor_verdict(mt, tol),
                   metric="rel_l2", value=mt.rel_l2, threshold=tol[0])
        return out
    v, worst_v, diffs = _stats_verdict(ra, rb, tol)
    out.update(diffs, mode="stats", verdict=v, metric="stats_rel_diff", value=worst_v, threshold=tol[0],
               nan_baseline=int(ra.get("nan", 0)), nan_candidate=int(rb.get("nan", 0)),
               inf_baseline=int(ra.get("inf", 0)), inf_candidate=int(rb.get("inf", 0)))
    if full and ref_a is not None and ref_b is not None:
        out["tensor_unread"] = _why_unread(ref_a, ref_b, task.get("readers"))
    return out


def _stored(h5: h5py.File, ref: Any, task: dict[str, Any]) -> h5py.Dataset | None:
    """A row's ``tensors/<order>`` dataset, None when not stored (compared by statistics). Its declared size
    is checked (runstore.h5file.check_dataset: within the file, below any step file's array) before a byte
    is read, unless the dispatcher already checked it (``task["checked"]``); a group there is BadInput."""
    path, key = ref[1], ref[2]
    try:
        ds = h5.get(key)
    except (OSError, KeyError, ValueError, RuntimeError) as exc:
        raise BadInput(f"{path}: '{key}': unreadable ({' '.join(str(exc).split())[:80]})") from None
    if ds is None:
        return None
    if not isinstance(ds, h5py.Dataset):
        raise BadInput(f"{path}: '{key}' is a group, expected an array")
    if not task.get("checked"):
        check_dataset(path, key, ds)
    return ds


def _gathered(ref: Any) -> bool:
    return isinstance(ref, (tuple, list)) and bool(ref) and ref[0] == "gather"


def _why_unread(ref_a: Any, ref_b: Any, readers: Readers | None) -> str:
    for ref in (ref_a, ref_b):
        if isinstance(ref, str) and Path(ref).suffix.lower() != ".npy" and \
                Path(ref).suffix.lower() not in (readers or {}):
            return f"no reader for {Path(ref).suffix} files"
    return "shapes differ"
