"""Single-module isolation, judged: each module's own error next to the error it inherited.

The evidence (``evidence/isolation.npz``, written by dumpers.mindspore_isolation) holds per module, in
baseline names and layout: the baseline's output (``baseline/``), the candidate's module run on the
baseline's input (``isolated/``: its *own* error against the baseline) and the candidate's module in its own
forward (``candidate/``: own plus *inherited* error). Why both: after a small early drift every later module
departs in the candidate's own forward, so the first departing module (the layer-tensor stage's answer) may
only be passing the drift on; the module whose own error departs is where the candidate computes differently.
With backward evidence (``grad/{baseline,isolated,candidate}/<module>/<what>``, written by
dumpers.mindspore_backward_isolation) each module's input and weight gradients are judged the same way: the
candidate's module fed the baseline's inputs and output gradient (own) and its own (inherited); a module whose
forward passes and whose gradient fails is named by its backward.
"""

from __future__ import annotations

import json
import math
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from comparators.tensor_metrics import compare_arrays
from comparators.tensor_pair import tolerance
from core.dtypes import EPS, coarsest, normalize
from core.errors import BadInput
from core.findings import Finding, StageResult, severity, worst

STAGE = "isolation"


def read_isolation(path: str | Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(meta, arrays) of an isolation evidence file; bad input in one line."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise BadInput(f"{path}: not a readable npz ({' '.join(str(exc).split())[:80]})") from None
    try:
        meta = json.loads(str(arrays.pop("meta")))
        modules = meta["modules"]
        if not isinstance(modules, list) or not all(isinstance(m, dict) and "baseline" in m for m in modules):
            raise TypeError("modules is not a list of {baseline, candidate, ...}")
    except (KeyError, TypeError, ValueError) as exc:
        raise BadInput(f"{path}: no isolation meta ({exc}): write it with "
                       "dumpers.mindspore_isolation.isolate_modules") from None
    for m in modules:
        for group in ("baseline", "isolated"):
            if f"{group}/{m['baseline']}" not in arrays:
                raise BadInput(f"{path}: {group}/{m['baseline']} is missing")
            for g in m.get("grads") or []:
                if f"grad/{group}/{m['baseline']}/{g.get('what')}" not in arrays:
                    raise BadInput(f"{path}: grad/{group}/{m['baseline']}/{g.get('what')} is missing")
    return meta, arrays


def held_precision(a: np.ndarray) -> str:
    """The precision ``a``'s values hold: ``bfloat16`` / ``float16`` when every finite value of a floating
    array of 64 or more values is a number of that dtype (computed or rounded there, then widened), else its
    own dtype (float32 for anything smaller: too few values to tell)."""
    a = np.asarray(a)
    if a.dtype == np.float64 or not np.issubdtype(a.dtype, np.floating):
        return "float64" if a.dtype == np.float64 else "float32"
    if a.dtype != np.float32:
        return normalize(str(a.dtype))
    v = a[np.isfinite(a)]
    if v.size < 64:
        return "float32"
    if not np.any(v.view(np.uint32) & np.uint32(0xFFFF)):
        return "bfloat16"
    with np.errstate(over="ignore"):
        if np.array_equal(v.astype(np.float16).astype(np.float32), v):
            return "float16"
    return "float32"


def finest(dtypes: list[str]) -> str:
    """The most precise floating dtype among ``dtypes`` (float32 when none is known)."""
    known = [normalize(d) for d in dtypes if normalize(d) in EPS]
    return min(known, key=lambda d: EPS[d]) if known else "float32"


def module_dtype(m: dict[str, Any], arrays: dict[str, np.ndarray], dtype: str, attention_dtype: str | None,
                 file_dtype: str | None) -> tuple[str, dict[str, str]]:
    """(the dtype module row ``m``'s own error is judged at, each side's measured precision): see the module
    docstring. Its inherited error carries everything upstream (an attention's rounding included): judged
    at the coarsest of that and the attention's."""
    name = m["baseline"]
    sides = {"baseline": coarsest([str(m.get("dtype_baseline") or "float32"),
                                   held_precision(arrays[f"baseline/{name}"])]),
             "candidate": coarsest([str(m.get("dtype_candidate") or "float32"),
                                    held_precision(arrays[f"isolated/{name}"])])}
    extra = [d for d in (attention_dtype, file_dtype) if d] if m.get("attention", True) else []
    return coarsest([dtype, finest(list(sides.values())), *extra]), sides


def _verdict(rel: float, cos: float, tol: tuple[float, float, float]) -> str:
    if not math.isfinite(rel) or rel > tol[1] or cos < 0.99:
        return "fail"
    return "warn" if rel > tol[0] or cos < tol[2] else "pass"


def _inside(child: str, parent: str) -> bool:
    return child.startswith(parent + ".")


def compare_isolation(meta: dict[str, Any], arrays: dict[str, np.ndarray], *, dtype: str = "float32",
                      tolerances: dict[str, tuple[float, float, float]] | None = None,
                      attention_dtype: str | None = None) -> StageResult:
    """Own and inherited error (relative L2, cosine) per module, judged at its own precision
    (:func:`module_dtype`): ``dtype`` the runs' precision, ``attention_dtype`` and the file's ``meta["dtype"]``
    the attention's (modules that compute one).
    Named: each module whose own error fails (the innermost, when a module and one inside it both fail), else
    the first whose own error warns; none when every own error passes."""
    res = StageResult(STAGE)
    rows = []
    for m in meta["modules"]:
        name = m["baseline"]
        y_b = arrays[f"baseline/{name}"]
        judged, measured = module_dtype(m, arrays, dtype, attention_dtype, meta.get("dtype"))
        tol = tolerance(judged, tolerances)
        tol_inh = tolerance(coarsest([judged, *(d for d in (attention_dtype, meta.get("dtype")) if d)]), tolerances)
        own = compare_arrays(y_b, arrays[f"isolated/{name}"])
        row: dict[str, Any] = {"module": name, "candidate": m.get("candidate"), "kind": m.get("kind"),
                               "own_rel_l2": own.rel_l2, "own_cosine": own.cosine, "own_max_abs_err": own.max_abs_err,
                               "own_verdict": _verdict(own.rel_l2, own.cosine, tol), "judged_dtype": judged,
                               "dtype_measured": measured,
                               "pass_tol": tol[0], "warn_tol": tol[1], "input_rel_l2": m.get("input_rel_l2")}
        cand = arrays.get(f"candidate/{name}")
        if cand is not None:
            inh = compare_arrays(y_b, cand)
            row.update(inherited_rel_l2=inh.rel_l2, inherited_cosine=inh.cosine,
                       inherited_verdict=_verdict(inh.rel_l2, inh.cosine, tol_inh))
        if m.get("grads"):
            row.update(_backward_row(name, m["grads"], arrays, tol, tol_inh))
        row["verdict"] = worst([row["own_verdict"], row.get("bwd_own_verdict", "pass")])
        rows.append(row)
    failing = [r for r in rows if r["verdict"] == "fail"]
    named = [r for r in failing if not any(_inside(o["module"], r["module"]) for o in failing)]
    if not named:
        named = [r for r in rows if r["verdict"] == "warn"][:1]
    for r in named:
        res.add(_named_finding(r))
    first_inh = next((r for r in rows if r.get("inherited_verdict", "pass") != "pass"), None)
    if not named:
        msg = ("every isolated module computes as the baseline's on the same input (own error within "
               "tolerance)")
        if first_inh is not None:
            msg += (f"; {first_inh['module']} departs in the candidate's own forward (inherited rel L2 "
                    f"{first_inh['inherited_rel_l2']:.2e}): the difference comes from outside the isolated "
                    "modules (upstream of them: embedding, data, weights they do not hold) or accumulates")
        if any("bwd_own_rel_l2" in r for r in rows):
            msg += "; every isolated module's gradients too (input and weight gradients on the baseline's " \
                   "output gradient)"
        res.add(Finding(STAGE, "pass", None, "own_rel_l2", max(r["own_rel_l2"] for r in rows),
                        rows[0]["pass_tol"], msg))
    elif first_inh is not None and first_inh["module"] != named[0]["module"] and not _inside(
            named[0]["module"], first_inh["module"]):
        res.details["first_departing"] = first_inh["module"]
        res.details["note"] = (f"the candidate's own forward departs first at {first_inh['module']} (inherited "
                               f"rel L2 {first_inh['inherited_rel_l2']:.2e}), whose own error is "
                               f"{first_inh['own_rel_l2']:.2e} ({first_inh['own_verdict']}): a drift it passes on, "
                               f"not the culprit")
    res.details.update({"backward": bool(meta.get("backward")), "mode": meta.get("mode", "pynative"),
                        "step": meta.get("step"), "rank": meta.get("rank"), "baseline": meta.get("baseline"),
                        "named": [r["module"] for r in named], "per_module": rows,
                        "skipped_modules": meta.get("skipped", [])})
    if meta.get("inherited_inputs"):
        res.details["inherited_inputs"] = meta["inherited_inputs"]
    return res


def _backward_row(name: str, grads: list[dict[str, Any]], arrays: dict[str, np.ndarray],
                  tol: tuple[float, float, float], tol_inh: tuple[float, float, float] | None = None
                  ) -> dict[str, Any]:
    """A module's gradients judged: each one's own and inherited error; the module's backward verdict and
    error are its worst gradient's (``bwd_worst``: which)."""
    per = []
    for g in grads:
        what = g["what"]
        b = arrays[f"grad/baseline/{name}/{what}"]
        own = compare_arrays(b, arrays[f"grad/isolated/{name}/{what}"])
        item = {"what": what, "own_rel_l2": own.rel_l2, "own_cosine": own.cosine,
                "own_verdict": _verdict(own.rel_l2, own.cosine, tol)}
        cand = arrays.get(f"grad/candidate/{name}/{what}")
        if cand is not None:
            inh = compare_arrays(b, cand)
            item.update(inherited_rel_l2=inh.rel_l2, inherited_verdict=_verdict(inh.rel_l2, inh.cosine,
                                                                                 tol_inh or tol))
        per.append(item)
    top = max(per, key=lambda i: (severity(i["own_verdict"]), _finite(i["own_rel_l2"])))
    row = {"bwd_own_rel_l2": top["own_rel_l2"], "bwd_own_verdict": top["own_verdict"], "bwd_worst": top["what"],
           "per_grad": per}
    inh = [i for i in per if "inherited_rel_l2" in i]
    if inh:
        w = max(inh, key=lambda i: _finite(i["inherited_rel_l2"]))
        row.update(bwd_inherited_rel_l2=w["inherited_rel_l2"], bwd_inherited_verdict=w["inherited_verdict"])
    return row


def _finite(x: float) -> float:
    return x if math.isfinite(x) else math.inf


def _named_finding(r: dict[str, Any]) -> Finding:
    """The finding that names a module: by its forward's own error, else by its backward's."""
    fwd = r["own_verdict"] == r["verdict"]
    if fwd:
        inh = (f", {r['inherited_rel_l2']:.2e} in the candidate's own forward" if "inherited_rel_l2" in r else "")
        return Finding(STAGE, r["verdict"], r["module"], "own_rel_l2", r["own_rel_l2"], r["pass_tol"],
                       f"{r['module']} computes differently on the baseline's own input: own error (rel L2) "
                       f"{r['own_rel_l2']:.2e}{inh}, beyond {r['judged_dtype']}'s {r['pass_tol']:.0e}: the "
                       "departure starts here")
    inh = (f", {r['bwd_inherited_rel_l2']:.2e} in the candidate's own backward"
           if "bwd_inherited_rel_l2" in r else "")
    return Finding(STAGE, r["verdict"], r["module"], "bwd_own_rel_l2", r["bwd_own_rel_l2"], r["pass_tol"],
                   f"{r['module']}'s gradient differs on the baseline's own input and output gradient while its "
                   f"forward computes as the baseline's (own {r['own_rel_l2']:.2e}): {r['bwd_worst']} own error "
                   f"(rel L2) {r['bwd_own_rel_l2']:.2e}{inh}, beyond {r['judged_dtype']}'s {r['pass_tol']:.0e}: "
                   "its backward departs here")
