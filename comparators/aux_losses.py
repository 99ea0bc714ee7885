"""Auxiliary losses per step: the MoE router's load-balancing and z losses and the MTP layers' losses, by
name, in one scaling.

Why a comparator of its own: the lm loss compares as it is, but the aux losses come under different names and
scalings, and read as they are they differ where training does not. What each framework logs (read from
megatron-core 0.16.1 and MindFormers 2.1.0):

========================  =====================================================  ==================================
loss                      Megatron-LM (training_log, the wrapper's store)        MindFormers 2.x (MFLossMonitor)
========================  =====================================================  ==================================
load balancing            ``load_balancing_loss`` (``aux_loss`` type),            ``load_balancing_loss`` whatever
                          ``seq_load_balancing_loss``,                            the type; the summed coefficient-
                          ``global_load_balancing_loss``: each layer's loss       scaled layer losses (MTP layers'
                          / ``moe_aux_loss_coeff`` (router.py), summed over       included) / (decoder MoE layers x
                          layers / (MoE layers + MTP layers) (track_moe_metrics;  ``moe_aux_loss_coeff``)
                          core >= 0.18: MTP layers only when the last layer is    (wrapper.get_aux_loss_scale):
                          MoE): unscaled, a mean over layers                       unscaled, over decoder layers
z-loss                    ``z_loss``: / ``moe_z_loss_coeff``, unscaled            not logged
MTP                       ``mtp_K_loss`` per layer (MTPLossLoggingHelper): the    ``mtp_loss``: the sum over layers
                          layer's cross-entropy, unscaled; the wrapper adds their of ``mtp_loss_scaling_factor /
                          sum as ``mtp_loss`` (derived here from a log's          mtp_num_layers`` x the layer's
                          ``mtp_K_loss`` lines)                                   cross-entropy: scaled
========================  =====================================================  ==================================

Both average over micro-batches. The candidate's and the repeats' values are brought into the baseline's
scaling (the factor and both scalings are in the result); a conversion whose settings are not known (no
config says ``mtp_loss_scaling_factor``) is refused with a warning naming what to pass, never guessed.
A value a store's ranks disagree on (megatron-core 0.16 keeps ``z_loss`` per rank: no reduce group) is
their mean when the ranks are data-parallel replicas (pp 1), what one process over the same micro-batches
logs.

Judged per step: the first two common steps at ``step_rtol`` (the step-1 / step-2 loss tolerance); every
later step at ``step_rtol`` too when no repeat of the baseline logged the loss (no evidence of noise: one
step outside fails, named), else against the band the repeats set (as the loss's long run: share of steps
outside, sustained divergence). Never below the float32 floor of the loss's own scale, nor below half the
last printed digit of a MindFormers log (``%5.6f``). A Megatron-LM log line that may be the mean over a
process's first printed window (version unknown) and is outside only as printed is a warning naming both
readings, as for the step-2 loss.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from comparators.scalars import ScalarOptions, _long_run, band_floor
from core.findings import Finding, StageResult, skipped
from runstore.run import Run, make_series, series_from_records

STAGE = "aux_losses"
MEGATRON, MINDFORMERS = "Megatron-LM", "MindFormers"
LOAD_BALANCING = ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss")
FIXED = (*LOAD_BALANCING, "z_loss", "mtp_loss")
_MTP_LAYER = re.compile(r"mtp_(\d+)_loss$")
#: MindFormers' load-balancing type -> the Megatron loss it pairs with when Megatron logs several
MF_BALANCE = {"gbs_aux_loss": "global_load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
              "sub_seq_aux_loss": "load_balancing_loss", "aux_loss": "load_balancing_loss"}
MF_PRINT_RESOLUTION = 5e-7   # MFLossMonitor prints the separate losses with %5.6f


@dataclass(frozen=True)
class AuxSettings:
    """What a scaling conversion needs, read by the caller from the runs' configs (None: not known);
    ``source`` says where each came from, by field name."""

    mtp_num_layers: int | None = None
    mtp_loss_scaling_factor: float | None = None
    moe_layers: int | None = None          # decoder layers with MoE (MindFormers' divisor)
    last_layer_moe: bool | None = None     # core >= 0.18 counts MTP layers only then
    mindformers_balance_type: str | None = None
    source: dict[str, str] = field(default_factory=dict)


@dataclass
class AuxRun:
    """One run's aux losses by name, with its scaling convention and what was done to read them."""

    run: Run
    convention: str | None
    why: str
    series: dict[str, pd.Series] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)       # name -> how the values were read
    refused: dict[str, str] = field(default_factory=dict)     # name -> why they cannot be compared
    parts: dict[str, list[str]] = field(default_factory=dict)  # a derived sum -> the keys it adds up


def is_aux(key: str) -> bool:
    return key in FIXED or _MTP_LAYER.fullmatch(key) is not None


def convention(run: Run) -> tuple[str | None, str]:
    """Which framework's scaling a run's aux losses have, and what told it."""
    fw = str(run.meta.get("framework") or "").lower()
    src = run.meta.get("source") if isinstance(run.meta.get("source"), dict) else {}
    if fw.startswith("mindformers") or src.get("kind") == "mindformers_log":
        return MINDFORMERS, f"framework {fw or src.get('kind')}"
    if fw.startswith("megatron"):
        return MEGATRON, f"framework {fw}"
    if fw == "tensorboard":
        if run.meta.get("loss_key") == "lm_loss":
            return MINDFORMERS, "TensorBoard with MindFormers' lm-loss tag"
        if any(_MTP_LAYER.fullmatch(k) or k in ("z_loss", "seq_load_balancing_loss", "global_load_balancing_loss")
               for k in run.scalars):
            return MEGATRON, "TensorBoard with Megatron-LM's aux-loss tags"
    return None, f"framework {fw or 'not recorded'}: scaling not known, compared as recorded"


def _per_rank(run: Run, keys: list[str]) -> dict[int, dict[str, pd.Series]]:
    """Every rank's series of ``keys`` (a store's scalar files, or a multi-worker log's); {} for one rank."""
    if run.rank_scalars:
        per = run.rank_scalars
    elif run.store is not None and len(run.store.ranks) > 1:
        reader = run.store
        before = list(reader.incomplete)      # reading again must not list a torn line twice
        try:
            per = {r: series_from_records(reader.scalar_records(r)) for r in reader.ranks}
        finally:
            reader.incomplete[:] = before
    else:
        return {}
    return {r: {k: d[k] for k in keys if k in d and len(d[k])} for r, d in per.items()}


def _combine_ranks(ar: AuxRun, key: str, per: dict[int, pd.Series]) -> pd.Series:
    """One series from every rank's: the ranks' own when they agree; their mean where they differ and the
    ranks are data-parallel replicas (pp 1); else the lowest rank's, refused."""
    if len(per) < 2:
        return ar.run.series(key)
    common = None
    for s in per.values():
        common = s.index if common is None else common.intersection(s.index)
    stack = np.vstack([s.reindex(common).to_numpy(dtype=float) for s in per.values()]) if len(common) else None
    if stack is None or np.allclose(stack, stack[0], rtol=1e-12, atol=0.0, equal_nan=True):
        return ar.run.series(key)
    par = ar.run.meta.get("parallel") if isinstance(ar.run.meta.get("parallel"), dict) else {}
    if par.get("pp") in (None, 1):
        why = " (megatron-core 0.16 tracks it without a reduce group)" if key == "z_loss" else ""
        ar.notes[key] = (f"its {len(per)} ranks disagree{why}: their mean over the ranks (pp 1), what one process "
                         "over the same micro-batches logs")
        return make_series(common, stack.mean(axis=0), key)
    ar.refused[key] = (f"its {len(per)} ranks disagree and the layout (pp {par.get('pp')}) does not say how to "
                       "combine them")
    return ar.run.series(key)


def read_aux(run: Run) -> AuxRun:
    """A run's aux losses by name: ranks combined, ``mtp_loss`` summed from ``mtp_K_loss`` where absent."""
    conv, why = convention(run)
    ar = AuxRun(run, conv, why)
    keys = [k for k in run.scalars if is_aux(k) and run.has(k)]
    per = _per_rank(run, keys) if keys else {}
    for k in keys:
        ranks = {r: d[k] for r, d in per.items() if k in d}
        ar.series[k] = _combine_ranks(ar, k, ranks)
    layers = sorted((int(m.group(1)), k) for k in ar.series if (m := _MTP_LAYER.fullmatch(k)))
    if layers and "mtp_loss" not in ar.series:
        parts = [ar.series[k] for _, k in layers]
        idx = parts[0].index
        for p in parts[1:]:
            idx = idx.intersection(p.index)
        ar.series["mtp_loss"] = make_series(idx, sum(p.reindex(idx).to_numpy() for p in parts), "mtp_loss")
        ar.notes["mtp_loss"] = f"summed here from {', '.join(k for _, k in layers)}"
        ar.parts["mtp_loss"] = [k for _, k in layers]
        refused = [ar.refused[k] for _, k in layers if k in ar.refused]
        if refused:
            ar.refused["mtp_loss"] = refused[0]
    return ar


def other_readings(ar: AuxRun, key: str) -> dict[int, float]:
    """{step: value} where a Megatron-LM log line may be the mean over a process's first printed window and
    the log does not tell (``meta["log_windows"]``, state ``ambiguous``): the step's own value in that
    reading (sources.megatron_log.first_windows); a derived sum adds up its parts' readings."""
    out: dict[int, float] = {}
    for w in ar.run.meta.get("log_windows") or []:
        if not isinstance(w, dict) or w.get("state") != "ambiguous" or not isinstance(w.get("step"), int):
            continue
        rec, step = w.get("recovered") or {}, w["step"]
        keys = ar.parts.get(key, [key])
        if not any(isinstance(rec.get(k), (int, float)) for k in keys):
            continue
        vals = [rec[k] if isinstance(rec.get(k), (int, float)) else ar.series[k].get(step) for k in keys]
        if all(isinstance(v, (int, float)) and math.isfinite(v) for v in vals):
            out[step] = float(sum(vals))
    return out


def _megatron_version(run: Run) -> tuple[int, int] | None:
    v = (run.meta.get("versions") or {}).get("megatron-core") if isinstance(run.meta.get("versions"), dict) else None
    m = re.match(r"(\d+)\.(\d+)", str(v or ""))
    return (int(m.group(1)), int(m.group(2))) if m else None


def scaling(name: str, ar: AuxRun) -> str:
    """In words: the scaling ``ar``'s value of ``name`` has."""
    how = ar.notes.get(name)
    tail = f" ({how})" if how else ""
    if ar.convention == MINDFORMERS:
        if name == "mtp_loss":
            return "MindFormers: scaled, sum over MTP layers of mtp_loss_scaling_factor / mtp_num_layers x CE" + tail
        if name in LOAD_BALANCING:
            return ("MindFormers: unscaled (/ moe_aux_loss_coeff), layer losses (MTP's included) / decoder MoE "
                    "layers" + tail)
    if ar.convention == MEGATRON:
        if name == "mtp_loss":
            return "Megatron-LM: unscaled, sum over MTP layers of each layer's CE" + tail
        if _MTP_LAYER.fullmatch(name):
            return "Megatron-LM: unscaled CE of that MTP layer" + tail
        if name in LOAD_BALANCING:
            return "Megatron-LM: unscaled (/ moe_aux_loss_coeff), mean over MoE + MTP layers" + tail
        if name == "z_loss":
            return "Megatron-LM: unscaled (/ moe_z_loss_coeff), mean over MoE + MTP layers" + tail
    if ar.convention is None:
        return f"as recorded ({ar.why})" + tail
    return f"{ar.convention}: as logged" + tail


def _mtp_layers(s: AuxSettings, runs: list[AuxRun]) -> tuple[int | None, str]:
    if s.mtp_num_layers is not None:
        return s.mtp_num_layers, s.source.get("mtp_num_layers", "config")
    for ar in runs:
        n = sum(1 for k in ar.series if _MTP_LAYER.fullmatch(k))
        if n:
            return n, f"{ar.run.label} logs {n} per-layer MTP losses"
    if not any("mtp_loss" in ar.series for ar in runs):
        return 0, "no MTP loss logged by either run"
    return None, "not known"


def factor(name: str, src: AuxRun, dst: AuxRun, s: AuxSettings, runs: list[AuxRun]) -> tuple[float | None, str]:
    """The factor that brings ``src``'s value of ``name`` into ``dst``'s scaling, and why (or why not)."""
    a, b = src.convention, dst.convention
    if a == b or a is None or b is None:
        return 1.0, "same scaling" if a == b else "compared as recorded"
    to_megatron = a == MINDFORMERS
    if name == "mtp_loss":
        n, n_from = _mtp_layers(s, runs)
        f = s.mtp_loss_scaling_factor
        if not n or f is None or f == 0:
            missing = "mtp_loss_scaling_factor" if f is None or f == 0 else "mtp_num_layers"
            return None, (f"MindFormers' mtp_loss is scaled by mtp_loss_scaling_factor / mtp_num_layers, Megatron's "
                          f"is not; {missing} is not known: pass the MindFormers YAML (--candidate-config / "
                          "--baseline-config) or a Megatron log with its arguments block")
        k = f / n
        why = (f"MindFormers' mtp_loss = (mtp_loss_scaling_factor {f:g} / mtp_num_layers {n}) x Megatron's sum "
               f"(factor from {s.source.get('mtp_loss_scaling_factor', 'config')}; layers: {n_from})")
        return (1.0 / k if to_megatron else k), why
    if name in LOAD_BALANCING:
        n_mtp, n_from = _mtp_layers(s, runs)
        if n_mtp == 0:
            return 1.0, f"no MTP layers ({n_from}): both average over the decoder's MoE layers"
        mg = src if a == MEGATRON else dst
        ver = _megatron_version(mg.run)
        newer = ver is not None and ver >= (0, 18)
        if n_mtp is None or s.moe_layers is None or (newer and s.last_layer_moe is None):
            return None, ("with MTP layers Megatron-LM divides the summed layer losses by MoE + MTP layers, "
                          "MindFormers by the decoder's MoE layers; the layer counts are not known: pass the "
                          "MindFormers YAML (--candidate-config) or the Megatron arguments (--baseline-config)")
        counted = n_mtp if not newer or s.last_layer_moe else 0
        mg_div, mf_div = s.moe_layers + counted, s.moe_layers
        why = (f"Megatron-LM divides by {mg_div} layers ({s.moe_layers} MoE + {counted} MTP"
               f"{'' if ver else '; megatron-core version not recorded: <= 0.17 assumed'}), MindFormers by "
               f"{mf_div} ({s.source.get('moe_layers', 'config')})")
        return (mf_div / mg_div if to_megatron else mg_div / mf_div), why
    return 1.0, "same scaling"


def _pairs(b: AuxRun, c: AuxRun, s: AuxSettings) -> tuple[list[tuple[str, str, str, str]], list[str], list[str]]:
    """(name, baseline key, candidate key, note) for every loss both runs hold, MindFormers' one
    load-balancing loss paired with the Megatron one logged; then the names only one side holds."""
    keys = {"baseline": set(b.series), "candidate": set(c.series)}
    pairs: list[tuple[str, str, str, str]] = []
    roles = {MINDFORMERS: "candidate", MEGATRON: "baseline"} if c.convention == MINDFORMERS else \
        {MINDFORMERS: "baseline", MEGATRON: "candidate"}
    mf, mg = (c, b) if roles[MINDFORMERS] == "candidate" else (b, c)
    logged = [n for n in LOAD_BALANCING if n in mg.series]
    if (mf.convention == MINDFORMERS and mg.convention == MEGATRON and "load_balancing_loss" in mf.series
            and logged and logged != ["load_balancing_loss"]):
        kind = s.mindformers_balance_type
        target = logged[0] if len(logged) == 1 else MF_BALANCE.get(kind or "", "load_balancing_loss")
        if target in logged:
            note = (f"MindFormers logs one load_balancing_loss whatever its moe_router_load_balancing_type "
                    f"({kind or 'not known'}); paired with Megatron-LM's {target}")
            keyed = {roles[MINDFORMERS]: "load_balancing_loss", roles[MEGATRON]: target}
            pairs.append((target, keyed["baseline"], keyed["candidate"], note))
            keys[roles[MINDFORMERS]].discard("load_balancing_loss")
            keys[roles[MEGATRON]].discard(target)
    pairs += [(n, n, n, "") for n in keys["baseline"] & keys["candidate"]]
    pairs.sort(key=lambda p: _order(p[0]))
    return (pairs, sorted(keys["baseline"] - keys["candidate"], key=_order),
            sorted(keys["candidate"] - keys["baseline"], key=_order))


def _order(name: str) -> tuple[int, int, str]:
    m = _MTP_LAYER.fullmatch(name)
    return (len(FIXED), int(m.group(1)), name) if m else (FIXED.index(name) if name in FIXED else 99, 0, name)


def _resolution(ar: AuxRun, k: float) -> float:
    src = ar.run.meta.get("source") if isinstance(ar.run.meta.get("source"), dict) else {}
    return MF_PRINT_RESOLUTION * abs(k) if src.get("kind") == "mindformers_log" else 0.0


def _ambiguous(st: StageResult, name: str, step: int, b: float, c: float, tol: float, opt: ScalarOptions,
               alts: tuple[dict[int, float], dict[int, float]]) -> bool:
    """A step outside as printed that is inside in the other reading of an ambiguous Megatron-LM log line:
    a warning naming both readings (True), never a fail; False where no reading brings it inside."""
    ab, ac = alts[0].get(step), alts[1].get(step)
    if ab is None and ac is None:
        return False
    readings = [(ab, ac)] if ab is not None and ac is not None else [
        (x, y) for x in (b, ab) for y in (c, ac) if x is not None and y is not None and (x, y) != (b, c)]
    inside = [(x, y) for x, y in readings if abs(y - x) <= tol]
    if not inside:
        return False
    x, y = inside[0]
    r = abs(y - x) / max(abs(x), 1e-30)
    st.add(Finding(STAGE, "warn", name, "ambiguous_log_line", step, opt.step_rtol,
                   f"{name} at step {step}: baseline {b:.7g}, candidate {c:.7g} as printed differ beyond "
                   f"{opt.step_rtol:g}; if the printed line is the mean over the first printed window (Megatron-LM "
                   f"core >= 0.16) the step's own values are {x:.7g} and {y:.7g} (relative {r:.3g}): which "
                   "reading holds is not known. Give the Megatron-LM log from its start (its arguments block "
                   "tells the version) to settle it"))
    return True


def _compare_one(st: StageResult, name: str, b: pd.Series, c: pd.Series, reps: list[pd.Series],
                 opt: ScalarOptions, extra_floor: float, how: str,
                 alts: tuple[dict[int, float], dict[int, float]] = ({}, {})) -> dict[str, Any]:
    common = b.index.intersection(c.index)
    row: dict[str, Any] = {"loss": name, "steps": int(len(common))}
    if not len(common):
        st.add(Finding(STAGE, "warn", name, "common_steps", 0, None,
                       f"{name}: no step logged by both runs: not compared"))
        return {**row, "verdict": "warn"}
    bv, cv = b[common].to_numpy(dtype=float), c[common].to_numpy(dtype=float)
    floor = band_floor(opt, bv) + extra_floor
    tol = np.maximum(opt.step_rtol * np.abs(bv), floor)
    same = (bv == cv) | (np.isnan(bv) & np.isnan(cv))
    delta = cv - bv
    rel = np.where(same, 0.0, np.abs(delta) / np.maximum(np.abs(bv), 1e-30))
    outside = ~same & ~(np.abs(delta) <= tol)
    for i in np.flatnonzero(outside):
        if _ambiguous(st, name, int(common[i]), float(bv[i]), float(cv[i]), float(tol[i]), opt, alts):
            outside[i] = False
    band_reps = [r for r in reps if r.reindex(common).notna().any()]
    fin = rel[np.isfinite(rel)]
    row.update(max_rel_delta=float(fin.max()) if len(fin) else math.nan, tolerance=opt.step_rtol,
               first_step=int(common[0]), last_step=int(common[-1]))
    judged = outside if not band_reps else outside[:2]       # with repeats: the band judges the later steps
    if judged.any():
        i = int(np.flatnonzero(judged)[0])
        step = int(common[i])
        row.update(first_step_outside=step, outside_steps=int(judged.sum()))
        st.add(Finding(STAGE, "fail", name, "first_step_outside", step, opt.step_rtol,
                       f"{name} first differs at step {step}: baseline {bv[i]:.7g}, candidate {cv[i]:.7g} (relative "
                       f"{rel[i]:.3g} > {opt.step_rtol:g}; {int(judged.sum())} of {len(judged)} steps outside"
                       f"{', no repeat to set a band: pass --repeat' if not band_reps else ''}"
                       f"{' (the first two; the band judges the rest)' if band_reps else ''}){how}"))
    if band_reps:
        runs = [Run("baseline", "aux", scalars={name: b}), Run("candidate", "aux", scalars={name: c})]
        reps_runs = [Run(f"repeat{i + 1}", "aux", scalars={name: r}) for i, r in enumerate(band_reps)]
        _, long_run = _long_run(name, STAGE, runs[0], runs[1], reps_runs, opt)
        if long_run.verdict != "skipped":
            row.update(band=long_run.details.get("band"),
                       outside_band_fraction=long_run.details.get("outside_band_fraction"),
                       divergence_step=long_run.details.get("divergence_step"),
                       p_value=long_run.details.get("p_value"), power=long_run.details.get("power"))
            for f in long_run.findings:
                f.component, f.stage = name, STAGE
                st.add(f)
    if not judged.any() and not any(f.component == name for f in st.findings):
        st.add(Finding(STAGE, "pass", name, "max_rel_delta", row["max_rel_delta"], opt.step_rtol,
                       f"{name}: within {opt.step_rtol:g} relative at all {len(common)} common steps (max "
                       f"{row['max_rel_delta']:.3g}){how}"))
    verdicts = [f.verdict for f in st.findings if f.component == name]
    row["verdict"] = max(verdicts, key=("pass", "warn", "fail").index) if verdicts else "pass"
    return row


def compare_aux_losses(baseline: Run, candidate: Run, repeats: list[Run] | None = None,
                       opt: ScalarOptions | None = None, settings: AuxSettings | None = None) -> StageResult:
    """Every aux loss both runs logged, in the baseline's scaling, per step; skipped (with the reason) when
    either run logged none or they share none."""
    opt, s = opt or ScalarOptions(), settings or AuxSettings()
    b, c = read_aux(baseline), read_aux(candidate)
    reps = [read_aux(r) for r in repeats or []]
    missing = [f"{role} ({ar.run.label})" for role, ar in (("baseline", b), ("candidate", c)) if not ar.series]
    if missing:
        return skipped(STAGE, f"no aux loss (load balancing, z, MTP) in {' and '.join(missing)}")
    pairs, only_b, only_c = _pairs(b, c, s)
    if not pairs:
        return skipped(STAGE, f"no aux loss in both runs: baseline has {', '.join(sorted(b.series, key=_order))}; "
                              f"candidate has {', '.join(sorted(c.series, key=_order))}")
    st = StageResult(STAGE, details={"baseline_convention": f"{b.convention or 'not known'} ({b.why})",
                                     "candidate_convention": f"{c.convention or 'not known'} ({c.why})", "losses": [],
                                     "compared": [], "not_compared": [], "only_baseline": only_b,
                                     "only_candidate": only_c})
    everyone = [b, c, *reps]
    for name, bk, ck, note in pairs:
        row: dict[str, Any] = {"loss": name, "baseline_key": bk, "candidate_key": ck,
                               "baseline_scaling": scaling(bk, b), "candidate_scaling": scaling(ck, c)}
        k, why = factor(name, c, b, s, everyone)
        refused = b.refused.get(bk) or c.refused.get(ck) or (why if k is None else None)
        if refused:
            where = "" if k is None else f" ({'baseline' if bk in b.refused else 'candidate'})"
            st.details["not_compared"].append({"loss": name, "reason": refused})
            st.add(Finding(STAGE, "warn", name, "not_compared", None, None,
                           f"{name} not compared{where}: {refused}"))
            st.details["losses"].append({**row, "verdict": "warn"})
            continue
        rep_series = []
        for ar in reps:
            rk = bk if bk in ar.series else ck if ck in ar.series else None
            if rk is None or rk in ar.refused:
                continue
            rf, _ = factor(name, ar, b, s, everyone)
            if rf is not None:
                rep_series.append(ar.series[rk] * rf)
        how = f"; candidate x {k:.6g} into the baseline's scaling: {why}" if k != 1.0 else (
            "" if why == "same scaling" else f"; {why}")
        how += f"; {note}" if note else ""
        row.update(factor=k, conversion=why)
        alts = (other_readings(b, bk), {step: v * k for step, v in other_readings(c, ck).items()})
        row.update(_compare_one(st, name, b.series[bk], c.series[ck] * k, rep_series, opt,
                                _resolution(b, 1.0) + _resolution(c, k), how, alts))
        st.details["losses"].append(row)
        st.details["compared"].append(name)
    powers = [(r["loss"], r["power"]) for r in st.details["losses"] if isinstance(r.get("power"), dict)]
    if powers:       # what the band test could see, per aux loss (comparators.scalars.power)
        st.details["power"] = {"detectable": powers[0][1].get("detectable"),
                               "text": "; ".join(f"{n}: {p.get('text')}" for n, p in powers)}
    if not st.findings:
        st.verdict = "pass"
    return st
