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
    judgements = _apply_floors(rows, rtol)
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
                   "noise_floor": {"pass_ratio": nf.ratios(len(rows))[0], "fail_ratio": nf.ratios(len(rows))[1],
                                   "worst_ratio": max((r["ratio"] for r in rows if r["ratio"] is not None),
                                                      default=None)},
                   "power": nf.power(judgements, "parameters' updates"),
                   "parameters": [{k: r[k] for k in ("name", "rel_diff", "dtype_line", "dtype_verdict", "ratio",
                                                     "floor", "verdict", "decided_by", "floor_source")}
                                  for r in rows]}
    return res


def _apply_floors(rows: list[dict[str, Any]], rtol: tuple[float, float]) -> list[nf.Judgement]:
    """Judge each parameter's update difference against its noise floor too (comparators.noise_floor), in place;
    returns the judgements (the stage's power statement is made from them).

    Both optimizers step on the same gradients, so a repeat's gradient noise does not apply: the floor is the
    rounding of ``w - lr*u`` (``NOISE_ULPS`` ulps of |w|, relative to the update) or the spread of the clean
    rows (the median of all parameters' differences), whichever is larger. A fault on a few parameters stands
    out from the median; one on all of them is left to the dtype line, which stays the upper bound. All rows are
    judged at once, so the floor lines grow by the Bonferroni factor for that many (noise_floor.ratios): a clean
    pair's largest row stays under them at the stated rates."""
    diffs = sorted(r["rel_diff"] for r in rows if np.isfinite(r["rel_diff"]))
    median = float(np.median(diffs)) if diffs else None
    out = []
    for r in rows:
        rounding = r["rounding_floor"]
        if median is not None and median > rounding:
            floor = nf.Floor(median, f"median of the {len(diffs)} parameters' update differences")
        else:
            floor = nf.Floor(rounding, f"rounding of w - lr*u ({NOISE_ULPS:g} ulps of |w|)")
        j = nf.judge(r["rel_diff"], floor, (r["threshold"], rtol[1] + (r["threshold"] - rtol[0])),
                     judged=len(rows))
        out.append(j)
        verdict = "pass" if r["diff_norm"] <= r["noise"] else nf.worst(r["verdict"], j.verdict)
        r.update(j.columns(), verdict=verdict, threshold=j.threshold,
                 excess=r["rel_diff"] / j.threshold if j.threshold else r["rel_diff"],
                 decay_like=verdict != "pass" and abs(r["cos_with_weight"]) >= DECAY_COSINE)
    return out


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


# ---------------------------------------------------------------------------------------------------------
# Clipping: both sides' clipping on one probe gradient whose global norm exceeds the configured max
# ---------------------------------------------------------------------------------------------------------

# Clipping is one multiply by max / (norm + 1e-6) (Megatron's clip_grad_by_total_norm_fp32 and MindFormers'
# ClipGradNorm alike), the norm a float32 sum of squares on each side: ~1e-6 relative apart. A clipping fault is
# an order-one difference (the probe is 10 x the max: a side that does not clip is 10 x off).
CLIP_RTOL = (1e-4, 1e-2)
CLIP_EPS = 1e-6
SIDE_LABEL = {"baseline": "the baseline's optimizer", "candidate": "the candidate's training cell"}
SIDE_COMPONENT = {"baseline": "clipping (baseline optimizer)", "candidate": "clipping (candidate training cell)"}
NOT_RUN = {"baseline": "its clipping code did not run (Megatron clips only when the optimizer's "
                       "config.clip_grad > 0)",
           "candidate": "its clipping code did not run (MindFormers' MFTrainOneStepCell clips only when the "
                        "cell's use_clip_grad is on: a wrapper built without the YAML's use_clip_grad / "
                        "max_grad_norm does not clip)"}


def expected_clip_coefficient(norm: float, max_norm: float | None) -> float | None:
    """The coefficient global-norm clipping at ``max_norm`` applies to a gradient of global ``norm``
    (1 = unchanged; None = max unknown)."""
    if max_norm is None or not np.isfinite(max_norm):
        return None
    if max_norm <= 0:
        return 1.0
    return float(min(1.0, max_norm / (norm + CLIP_EPS)))


def _side_stats(probe: MappingABC[str, np.ndarray], clipped: MappingABC[str, np.ndarray], names: list[str]
                ) -> dict[str, Any]:
    """Global coefficient (least squares: C ~ c G), clipped norm, and per parameter (c_p, residual off a pure
    scaling)."""
    gg = cg = cc = 0.0
    per: dict[str, tuple[float | None, float]] = {}
    for n in names:
        g, c = _f64(probe[n]).ravel(), _f64(clipped[n]).ravel()
        g2, c2, gc = float(g @ g), float(c @ c), float(g @ c)
        gg, cg, cc = gg + g2, cg + gc, cc + c2
        coef = gc / g2 if g2 > 0 else None
        resid = float(np.linalg.norm(c - coef * g)) / np.sqrt(c2) if coef is not None and c2 > 0 else 0.0
        per[n] = (coef, resid)
    return {"coefficient": cg / gg if gg > 0 else None, "clipped_norm": float(np.sqrt(cc)), "per": per}


def _grade(rel: float, rtol: tuple[float, float]) -> str:
    return "pass" if rel <= rtol[0] else "warn" if rel <= rtol[1] else "fail"


def _config_finding(side: str, st: dict[str, Any], norm: float, config: float, source: str,
                    info: MappingABC[str, float] | None, rtol: tuple[float, float]) -> Finding:
    """Does this side's clipping do what its config says? ``config`` 0 = no clipping."""
    c, y = st["coefficient"], st["clipped_norm"]
    e = expected_clip_coefficient(norm, config)
    rel = abs(c - e) / e
    label = SIDE_LABEL[side]
    did = (f"did not clip (coefficient {c:.4g}, clipped norm {y:.4g})" if abs(c - 1.0) <= rtol[0]
           else f"clipped to {y:.4g} (coefficient {c:.4g})")
    if config > 0:
        msg = (f"config says clip at {config:g} ({source}); fed the probe gradient of global norm {norm:.4g} "
               f"({norm / config:.3g} x the max), {label} {did}")
        if rel > rtol[0]:
            msg += f", where clipping at {config:g} gives coefficient {e:.4g}"
            if info is not None and info.get("applied") == 0.0:
                msg += f"; {NOT_RUN[side]}"
            elif info is not None and np.isfinite(info.get("max_norm", np.nan)) and info["max_norm"] != config:
                msg += f"; its clipping code was given max norm {info['max_norm']:g}"
        verdict = _grade(rel, rtol)
        if verdict == "pass" and norm <= config:
            verdict = "warn"
            msg += f"; the probe does not exceed this side's max ({config:g}): its clipping was not exercised"
    else:
        msg = f"config says no clipping ({source}); fed the probe gradient of global norm {norm:.4g}, {label} {did}"
        verdict = _grade(rel, rtol)
    return Finding(STAGE, verdict, SIDE_COMPONENT[side], "clip_coefficient", c, e, msg)


def compare_clipping(probe: MappingABC[str, np.ndarray], clipped_baseline: MappingABC[str, np.ndarray] | None,
                     clipped_candidate: MappingABC[str, np.ndarray] | None, *,
                     config_baseline: float | None = None, config_candidate: float | None = None,
                     config_sources: MappingABC[str, str] | None = None,
                     info_baseline: MappingABC[str, float] | None = None,
                     info_candidate: MappingABC[str, float] | None = None,
                     rtol: tuple[float, float] = CLIP_RTOL, top: int = 8) -> StageResult:
    """StageResult("optimizer") of the clipping check, every array in baseline names.

    ``probe``: the gradient both sides were fed (the baseline's step-1 gradients x the probe's scale);
    ``clipped_*``: what each side's clipping made of it (``runstore.clip_probe``), None where a side wrote no
    probe; ``config_*``: the max norm each side's config says (0 = no clipping, None = unknown), named by
    ``config_sources``; ``info_*``: the probe files' scalars (whether the clipping code ran, its max norm).

    Findings: per side, config against behaviour (component ``clipping (candidate training cell)`` /
    ``clipping (baseline optimizer)``: "config says clip at X, ... clipped to Y / did not clip"); across sides,
    the clipped gradients (component ``clipping``: global relative difference and both coefficients); per
    parameter, one clipped by another coefficient than the rest of its side (per-tensor clipping, or a
    parameter left out of the global clip). Without a measured baseline, its clipped gradient is derived from
    its config (Megatron's rule), and the details say so."""
    sources = dict(config_sources or {})
    res = StageResult(STAGE)
    names = sorted(probe)
    norm = float(np.sqrt(sum(float(np.sum(np.square(_f64(probe[n])))) for n in names)))
    details: dict[str, Any] = {"probe_norm": norm, "rtol": list(rtol)}
    if not names or norm <= 0:
        details["reason"] = "the probe gradient is empty or zero"
        res.details = details
        return res
    derived = False
    if clipped_baseline is None and clipped_candidate is not None and config_baseline is not None:
        e = expected_clip_coefficient(norm, config_baseline)
        clipped_baseline = {n: _f64(probe[n]) * e for n in names}
        derived = True
    sides = {"baseline": clipped_baseline, "candidate": clipped_candidate}
    configs = {"baseline": config_baseline, "candidate": config_candidate}
    infos = {"baseline": info_baseline, "candidate": info_candidate}
    stats: dict[str, dict[str, Any]] = {}
    for side, clipped in sides.items():
        if clipped is None:
            details[side] = {"measured": False, "config": configs[side]}
            continue
        absent = [n for n in names if n not in clipped]
        if absent:
            res.add(Finding(STAGE, "warn", f"clipping ({side})", "missing_clipped", len(absent), 0,
                            f"{SIDE_LABEL[side]} returned no clipped gradient for {len(absent)} parameter(s): "
                            f"{', '.join(absent[:5])}"))
        have = [n for n in names if n in clipped]
        if not have:
            continue
        st = _side_stats(probe, clipped, have)
        if st["coefficient"] is None:
            continue
        stats[side] = st
        measured = not (side == "baseline" and derived)
        details[side] = {"measured": measured, "config": configs[side], "config_source": sources.get(side),
                         "coefficient": st["coefficient"], "clipped_norm": st["clipped_norm"],
                         **({k: v for k, v in (infos[side] or {}).items()} if measured else
                            {"derived_from": "the baseline's config (Megatron's rule): no measured probe"})}
        if measured and configs[side] is not None:
            res.add(_config_finding(side, st, norm, float(configs[side]), sources.get(side, "its config"),
                                    infos[side], rtol))
    if len(stats) == 2:
        _cross_side(res, probe, sides, stats, names, norm, rtol, top, details, derived)
    res.details = details
    return res


def _cross_side(res: StageResult, probe: MappingABC[str, np.ndarray], sides: dict[str, Any],
                stats: dict[str, dict[str, Any]], names: list[str], norm: float, rtol: tuple[float, float],
                top: int, details: dict[str, Any], derived: bool) -> None:
    """The clipped gradients of both sides, globally and per parameter."""
    cb, cc = sides["baseline"], sides["candidate"]
    common = [n for n in names if n in cb and n in cc]
    rows, dd, bb = [], 0.0, 0.0
    for n in common:
        b, c = _f64(cb[n]).ravel(), _f64(cc[n]).ravel()
        d2, b2 = float((c - b) @ (c - b)), float(b @ b)
        dd, bb = dd + d2, bb + b2
        rows.append({"name": n, "rel_diff": np.sqrt(d2 / b2) if b2 > 0 else (0.0 if d2 == 0 else float("inf")),
                     "coefficient_baseline": stats["baseline"]["per"][n][0],
                     "coefficient_candidate": stats["candidate"]["per"][n][0]})
    rel = float(np.sqrt(dd / bb)) if bb > 0 else (0.0 if dd == 0 else float("inf"))
    kb, kc = stats["baseline"]["coefficient"], stats["candidate"]["coefficient"]
    where = " (the baseline's from its config: no measured probe)" if derived else ""
    verdict = _grade(rel, rtol)
    msg = (f"the same probe gradient (global norm {norm:.4g}) clipped by each side{where}: coefficient "
           f"{kb:.4g} (norm {stats['baseline']['clipped_norm']:.4g}) on the baseline, {kc:.4g} (norm "
           f"{stats['candidate']['clipped_norm']:.4g}) on the candidate; the clipped gradients differ by "
           f"{rel:.3g} relative")
    if verdict != "pass":
        msg += " (check the clipping each side's training step applies: max norm, whether it runs at all)"
    res.add(Finding(STAGE, verdict, "clipping", "clipped_grad_rel_diff", rel, rtol[0], msg))
    # a parameter clipped unlike the rest of its side: clipping per tensor, or left out of the global clip
    odd: list[Finding] = []
    for side, st in stats.items():
        if side == "baseline" and derived:
            continue
        k = st["coefficient"]
        for n in common:
            coef, resid = st["per"][n]
            if coef is None:
                continue
            dev = max(abs(coef - k) / k, resid)
            if dev > rtol[0]:
                odd.append(Finding(STAGE, _grade(dev, rtol), n, "clip_coefficient_param", coef, k,
                                   f"{n}: {SIDE_LABEL[side]} scales its probe gradient by {coef:.4g} where the "
                                   f"rest is scaled by {k:.4g} (a global-norm clip scales all alike): clipped "
                                   "on its own (per tensor) or left out of the global clip"))
    for f in odd:
        res.add(f)
    rows.sort(key=lambda r: -r["rel_diff"])
    details.update({"rel_diff": rel, "coefficient_ratio": kc / kb if kb else None, "compared": len(common),
                    "odd_parameters": [f.component for f in odd], "worst": rows[:top]})
