"""Optimizer check: the baseline's step-1 gradients fed to the candidate's optimizer, updates compared.

Why: when step-1 loss and local norms agree but step 2 does not, the optimizer is the suspect (weight decay
groups, betas, eps, bias correction, clipping, lr schedule). Feeding both optimizers the *same* gradients
from the *same* weights isolates it: any difference in the updated weights is the optimizer's alone.

What is compared, per parameter (baseline names, through the mapping): the update ``after - before`` of
each side, as ``||du_c - du_b|| / ||du_b||``. Comparing updates rather than weights matters: with lr=1e-3 a
weight moves by ~1e-3 of its size, so a wrong weight decay (lr*wd*w ~ 1e-4 of w) is 10% of the update but
only 1e-4 of the weight. The noise floor is the rounding of ``w - lr*u`` on each side, a few float32 ulps
of ``w``; it is added to the threshold so tiny updates of large weights do not fail on rounding.

A difference proportional to the weight itself (cosine with ``before`` near +-1) is what a weight-decay
mismatch looks like; the finding says so and estimates ``lr * delta(weight_decay)``.

Framework-free (numpy only): the candidate side runs in ``dumpers.mindspore_optimizer_check``.
"""

from __future__ import annotations

from collections.abc import Mapping as MappingABC
from typing import Any

import numpy as np

from comparators import noise_floor as nf
from core.errors import BadInput
from core.findings import Finding, StageResult, skipped
from runstore import read_step1_file, write_step1_file  # noqa: F401  (the evidence file format)

STAGE = "optimizer"
# Relative update difference: (pass up to, warn up to); beyond is a fail. float32: both optimizers compute
# m/(sqrt(v)+eps) with a few ops, ~1e-7 relative each; 1e-4 leaves room for a different op order.
RTOL = {"float32": (1e-4, 1e-2), "float16": (5e-3, 5e-2), "bfloat16": (2e-2, 1e-1)}
EPS = {"float32": float(np.finfo(np.float32).eps), "float16": float(np.finfo(np.float16).eps),
       "bfloat16": 2.0 ** -7}
NOISE_ULPS = 4.0            # rounding of the final w - lr*u on both sides, in ulps of |w| (rms)
DECAY_COSINE = 0.99         # |cos(diff, w)| above this: the difference is a weight-decay term


def _f64(a: Any) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


def compare_updates(before: MappingABC[str, np.ndarray], after_baseline: MappingABC[str, np.ndarray],
                    after_candidate: MappingABC[str, np.ndarray], mapping: Any = None, *,
                    params: Any = None, dtype: str = "float32", top: int = 8) -> StageResult:
    """StageResult("optimizer"): per parameter, does the candidate's update equal the baseline's?

    ``before`` and ``after_baseline`` use baseline names; ``after_candidate`` uses candidate names and is
    converted through ``mapping`` (an ``mapping.Mapping``, a preset name or path; None = same names).
    ``params`` is the mapping's ``TransformParams`` (heads and query groups for fused QKV).
    A baseline parameter without a candidate counterpart is a finding, never silently dropped.
    """
    converted, conv = _to_baseline_names(after_candidate, mapping, params)
    res = StageResult(STAGE)
    for f in conv.findings if conv is not None else []:
        if f.verdict != "pass":
            res.add(Finding(STAGE, "warn", f.component, f.metric, f.value, f.threshold,
                            f"candidate weights: {f.message}"))
    rtol = RTOL.get(dtype, RTOL["float32"])
    eps = EPS.get(dtype, EPS["float32"])
    rows: list[dict[str, Any]] = []
    for name in sorted(after_baseline):
        if name not in converted:
            res.add(Finding(STAGE, "fail", name, "missing_candidate", None, None,
                            f"{name}: the candidate's optimizer returned no updated weight for it"))
            continue
        if name not in before:
            res.add(Finding(STAGE, "warn", name, "missing_before", None, None,
                            f"{name}: no weight before the step, the update cannot be compared"))
            continue
        w0, wb, wc = _f64(before[name]), _f64(after_baseline[name]), _f64(converted[name])
        if not (w0.shape == wb.shape == wc.shape):
            res.add(Finding(STAGE, "fail", name, "shape", str(wc.shape), str(wb.shape),
                            f"{name}: shapes differ (before {w0.shape}, baseline {wb.shape}, candidate "
                            f"{wc.shape})"))
            continue
        rows.append(_row(name, w0, wb, wc, rtol, eps))
    if not rows:
        return res if res.findings else skipped(STAGE, "no parameters in common")
    _apply_floors(rows, rtol)
    rows.sort(key=lambda r: -r["excess"])
    bad = [r for r in rows if r["verdict"] != "pass"]
    for r in bad:
        res.add(Finding(STAGE, r["verdict"], r["name"], "update_rel_diff", r["rel_diff"], r["threshold"],
                        _message(r)))
    decayed = [r["name"] for r in bad if r["decay_like"]]
    if decayed:
        verdict = "fail" if any(r["verdict"] == "fail" for r in bad if r["decay_like"]) else "warn"
        res.add(Finding(STAGE, verdict, ", ".join(decayed), "weight_decay_mismatch", len(decayed), 0,
                        f"weight decay differs on {len(decayed)} parameter(s): {', '.join(decayed)}; the "
                        "difference is proportional to the weight (check which parameters each side "
                        "decays: MindFormers skips biases and 1-D weights, PyTorch code may decay all)"))
    if not bad:
        w = rows[0]
        res.add(Finding(STAGE, "pass", w["name"], "update_rel_diff", w["rel_diff"], w["threshold"],
                        f"all {len(rows)} parameters updated alike from the same gradients (worst "
                        f"{w['name']} at {w['rel_diff']:.3g} relative)"))
    res.details = {"compared": len(rows), "failing": len(bad), "rtol": list(rtol), "dtype": dtype,
                   "decay_mismatch": decayed, "worst": rows[:top],
                   "noise_floor": {"pass_ratio": nf.PASS_RATIO, "fail_ratio": nf.FAIL_RATIO,
                                   "worst_ratio": max((r["ratio"] for r in rows if r["ratio"] is not None),
                                                      default=None)},
                   "parameters": [{k: r[k] for k in ("name", "rel_diff", "dtype_line", "dtype_verdict", "ratio",
                                                     "floor", "verdict", "decided_by", "floor_source")}
                                  for r in rows]}
    return res


def _apply_floors(rows: list[dict[str, Any]], rtol: tuple[float, float]) -> None:
    """Judge each parameter's update difference against its noise floor too (comparators.noise_floor), in place.

    Both optimizers step on the same gradients, so a repeat's gradient noise does not apply: the floor is the
    rounding of ``w - lr*u`` (``NOISE_ULPS`` ulps of |w|, relative to the update) or the spread of the clean
    rows (the median of all parameters' differences), whichever is larger. A fault on a few parameters stands
    out from the median; one on all of them is left to the dtype line, which stays the upper bound."""
    diffs = sorted(r["rel_diff"] for r in rows if np.isfinite(r["rel_diff"]))
    median = float(np.median(diffs)) if diffs else None
    for r in rows:
        rounding = r["rounding_floor"]
        if median is not None and median > rounding:
            floor = nf.Floor(median, f"median of the {len(diffs)} parameters' update differences")
        else:
            floor = nf.Floor(rounding, f"rounding of w - lr*u ({NOISE_ULPS:g} ulps of |w|)")
        j = nf.judge(r["rel_diff"], floor, (r["threshold"], rtol[1] + (r["threshold"] - rtol[0])))
        verdict = "pass" if r["diff_norm"] <= r["noise"] else nf.worst(r["verdict"], j.verdict)
        r.update(j.columns(), verdict=verdict, threshold=j.threshold,
                 excess=r["rel_diff"] / j.threshold if j.threshold else r["rel_diff"],
                 decay_like=verdict != "pass" and abs(r["cos_with_weight"]) >= DECAY_COSINE)


def _row(name: str, w0: np.ndarray, wb: np.ndarray, wc: np.ndarray, rtol: tuple[float, float],
         eps: float) -> dict[str, Any]:
    db, dc = (wb - w0).ravel(), (wc - w0).ravel()
    diff = dc - db
    nb, nd = float(np.linalg.norm(db)), float(np.linalg.norm(diff))
    noise = NOISE_ULPS * eps * float(np.linalg.norm(wb))
    rel = nd / nb if nb > 0 else (0.0 if nd == 0 else float("inf"))
    # Threshold on the relative difference, with the rounding floor folded in.
    floor = noise / nb if nb > 0 else float("inf")
    pass_t, warn_t = rtol[0] + floor, rtol[1] + floor
    verdict = "pass" if rel <= pass_t or nd <= noise else "warn" if rel <= warn_t else "fail"
    w = w0.ravel()
    ww = float(w @ w)
    cos = float(diff @ w) / (nd * np.sqrt(ww)) if nd > 0 and ww > 0 else 0.0
    return {"name": name, "rel_diff": rel, "threshold": pass_t, "excess": rel / pass_t if pass_t else rel,
            "verdict": verdict, "rounding_floor": floor, "noise": noise,
            "update_norm_baseline": nb, "update_norm_candidate": float(np.linalg.norm(dc)),
            "diff_norm": nd, "cos_with_weight": cos,
            "decay_like": verdict != "pass" and abs(cos) >= DECAY_COSINE,
            # diff = -lr * (wd_c - wd_b) * w  =>  lr * delta_wd = -(diff . w) / (w . w)
            "lr_times_wd_delta": -float(diff @ w) / ww if ww > 0 else None}


def _message(r: dict[str, Any]) -> str:
    msg = (f"{r['name']}: step-1 update differs by {r['rel_diff']:.3g} relative (threshold "
           f"{r['threshold']:.3g}) with the baseline's gradients; update norm {r['update_norm_baseline']:.4g} "
           f"vs {r['update_norm_candidate']:.4g}")
    if r["decay_like"]:
        side = "candidate" if r["lr_times_wd_delta"] > 0 else "baseline"
        msg += (f"; the difference is the weight times {abs(r['lr_times_wd_delta']):.3g}: the {side} applies "
                "more weight decay to it (lr * delta weight_decay)")
    else:
        msg += ": check betas, eps, bias correction, clipping and the lr of this parameter's group"
    return msg


def _to_baseline_names(after_candidate: MappingABC[str, np.ndarray], mapping: Any, params: Any
                       ) -> tuple[dict[str, np.ndarray], StageResult | None]:
    if mapping is None:
        return dict(after_candidate), None
    from mapping import Mapping, TransformParams
    from models import load_mapping

    m = mapping if isinstance(mapping, Mapping) else load_mapping(mapping)
    if params is not None and not isinstance(params, TransformParams):
        params = TransformParams.from_mapping(params)
    return m.convert(after_candidate, "baseline", params)


def to_candidate_names(arrays: MappingABC[str, np.ndarray], mapping: Any = None, params: Any = None
                       ) -> dict[str, np.ndarray]:
    """Baseline arrays (e.g. step-1 gradients) in the candidate's names and layouts (fused QKV split...).

    Raises ``BadInput`` when a baseline name maps to nothing: feeding a partial gradient set to an optimizer
    would update the rest with stale zeros.
    """
    from mapping import Mapping, TransformParams
    from models import load_mapping

    m = mapping if isinstance(mapping, Mapping) else load_mapping(mapping)
    if params is not None and not isinstance(params, TransformParams):
        params = TransformParams.from_mapping(params)
    out, res = m.convert(arrays, "candidate", params)
    bad = [f for f in res.findings if f.verdict != "pass"]
    if bad:
        raise BadInput(f"cannot convert baseline arrays: {bad[0].message}" + (
            f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""))
    return out
