"""The benchmark error band's source: how far each repeat of the baseline is from the baseline itself."""

from __future__ import annotations

import numpy as np

from align.stages import Stage
from align.stages.evidence import Evidence
from comparators.scalars import band_floor, values_at
from core.findings import Finding, StageResult, skipped


def run(ev: Evidence) -> StageResult:
    silent = ev.silent_repeats
    if not ev.repeats and not silent:
        return skipped("band", "no baseline repeat (the long run falls back to a relative tolerance)")
    opt = ev.options.scalar
    b = ev.baseline.series("loss")
    floor = band_floor(opt, b.to_numpy(dtype=float))
    res = StageResult("band", details={"band_k": opt.band_k, "band_floor": floor, "repeats": [],
                                       "silent_repeats": [{"run": r.path, "reason": why} for r, why in silent]})
    for rep, why in silent:
        fallback = ("the other repeat(s) set the band and the floors" if ev.repeats else
                    f"the long run falls back to the no-repeat band (rtol {opt.rtol:g} x |baseline|) and every "
                    "noise floor to its dtype line")
        res.add(Finding("band", "warn", rep.path, "repeat_measures_no_noise", 0.0, None,
                        f"repeat {rep.label} is not used: {why}; {fallback}"))
    for rep in ev.repeats:
        r = rep.series("loss")
        common = b.index.intersection(r.index)
        if not len(common):
            res.add(Finding("band", "warn", rep.label, "repeat_common_steps", 0, None,
                            f"repeat {rep.label} shares no step with the baseline: it cannot set a band"))
            continue
        d = values_at(r, common) - values_at(b, common)
        d = d[np.isfinite(d)]
        rms = float(np.sqrt(np.mean(d ** 2))) if len(d) else float("nan")
        mx = float(np.max(np.abs(d))) if len(d) else float("nan")
        par = rep.meta.get("parallel") if isinstance(rep.meta.get("parallel"), dict) else {}
        layout = ", ".join(f"{k}={v}" for k, v in par.items() if k in ("tp", "pp", "dp", "ep")) or "layout ?"
        res.details["repeats"].append({"run": rep.path, "steps": len(common), "rms_delta": rms,
                                       "max_abs_delta": mx, "layout": layout})
        res.add(Finding("band", "pass", "loss", "repeat_rms_delta", rms, floor,
                        f"repeat {rep.label} ({layout}) vs baseline over {len(common)} steps: RMS loss delta "
                        f"{rms:.3g}, max {mx:.3g}; band = max({opt.band_k:g} x rolling RMS, floor {floor:.3g})"))
    return res


STAGE = Stage(
    name="band", order=100, title="Benchmark error band",
    needs="at least one repeat of the baseline (same settings, run again without determinism)",
    capture="run the baseline again with the same settings and seeds but without deterministic flags (or "
            "another TP layout) and pass it with --repeat",
    run=run,
    part="long run",
    why=("The baseline's repeat cannot give a benchmark error band for these steps."),
    next=("repeat the baseline over the same steps without determinism (or at another TP layout) and pass it "
          "with --repeat"))
