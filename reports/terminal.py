"""summary.json -> what the terminal shows: the verdict and what it covers, the diagnosis in at most five lines,
the stages in the procedure's order, the skipped ones collapsed to one line (``explain``: each with what to
capture). `align report` and `align demo` print the same."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from core.findings import severity

WIDTH = 220   # a message longer than this is cut on the terminal (the report has it whole)


def _cut(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= WIDTH else text[:WIDTH - 3] + "..."


def _top(data: dict[str, Any], stage: str) -> dict[str, Any] | None:
    found = [f for f in data.get("findings", []) if f["stage"] == stage and f["verdict"] != "pass"]
    return max(found, key=lambda f: severity(f["verdict"])) if found else None


def _sees(power: Any) -> str:
    """What a passing stage could have seen, in a few words (its ``power``; the report has the whole sentence),
    so a PASS on the terminal reads as a bound, not as the absence of a look."""
    if not isinstance(power, dict):
        return ""
    rel, margin = power.get("detectable_rel"), power.get("margin_rel")
    if isinstance(rel, (int, float)) and math.isfinite(rel):      # a long-run band test
        text = f"detects a sustained offset of {rel:.2%}"
        ok = isinstance(margin, float) and math.isfinite(margin)
        return text + (f"; mean offset <= {margin * 100:.2g}%" if ok else "")
    subs = [v for v in power.values() if isinstance(v, dict) and "judged" in v]   # one per quantity (lr = 0)
    if "judged" not in power and subs:
        power = max(subs, key=lambda v: v.get("margin") if isinstance(v.get("margin"), float) else -1.0)
    det, used = power.get("detectable"), power.get("margin")
    if not isinstance(det, (int, float)) or not math.isfinite(det) or "judged" not in power:
        return ""
    text = f"detects {det:.2g} relative in one of {power['judged']}"
    if isinstance(used, (int, float)) and math.isfinite(used) and used > 0:
        text += f"; margin {1 / used:.3g}x"
    return text


def _closest(data: dict[str, Any], stage: str) -> str:
    """A passing stage without a power statement: its relative-delta finding nearest to its own line."""
    found = [f for f in data.get("findings", []) if f["stage"] == stage and f["verdict"] == "pass"
             and isinstance(f.get("value"), (int, float)) and isinstance(f.get("threshold"), (int, float))
             and f["threshold"] > 0 and math.isfinite(f["value"]) and "rel" in f["metric"]]
    if not found:
        return ""
    f = max(found, key=lambda f: f["value"] / f["threshold"])
    return f"{f['metric']} {f['value']:.2g} <= {f['threshold']:.2g}"


def _named(e: dict[str, Any]) -> str:
    return f"{e['stage']}: {e['component']}" if e.get("component") else e["stage"]


def lines(data: dict[str, Any], out: Path | None = None, explain: bool = False) -> list[str]:
    cov = data.get("coverage") or {}
    head = f"verdict: {data['verdict']}"
    if cov.get("banner"):   # the banner without its leading verdict word
        head += f" - {cov['banner'].split(' ', 1)[-1].lstrip(', ')}"
    out_lines = [head]
    diagnosis = data.get("diagnosis") or []
    roots = [e for e in diagnosis if e.get("consequence_of") is None]
    if roots:
        first = roots[0]
        out_lines.append(f"culprit: {_named(first)}")
        out_lines.append(f"  {_cut(first['message'])}")
        if first.get("next"):
            out_lines.append(f"  next: {_cut(first['next'])}")
        if len(roots) > 1:
            out_lines.append("  also failing, not explained by it: " + "; ".join(_named(e) for e in roots[1:4])
                             + (f" (+{len(roots) - 4} more)" if len(roots) > 4 else ""))
        cons = [e["stage"] for e in diagnosis if e.get("consequence_of") is not None]
        if cons:
            out_lines.append(f"  consequences (fix the culprit first): {', '.join(cons)}")
    elif data["verdict"] == "warn":
        warned = [(name, _top(data, name)) for name, st in data["stages"].items() if st["verdict"] == "warn"]
        out_lines += [f"warning: {name}" + (f": {_cut(f['message'])}" if f else "") for name, f in warned[:5]]
    out_lines.append("stages:")
    skipped = []
    cause = {e["stage"]: e.get("consequence_of") for e in diagnosis}
    for name, st in data["stages"].items():
        if st["verdict"] == "skipped":
            skipped.append((name, st))
            continue
        note = ""
        if cause.get(name):
            note = f"  (follows from {cause[name]})"
        elif st["verdict"] != "pass":
            top = _top(data, name)
            note = f"  {top['component']}" if top and top.get("component") else ""
        else:
            seen = _sees(st.get("power")) or _closest(data, name)
            note = f"  {seen}" if seen else ""
        out_lines.append(f"  {name:<18} {st['verdict']}{note}")
    if skipped and explain:
        for name, st in skipped:
            out_lines.append(f"  {name:<18} skipped: {st.get('reason', '')}")
            if st.get("capture"):
                out_lines.append(f"  {'':<18} to run it: {st['capture']}")
    elif skipped:
        out_lines.append(f"  {len(skipped)} skipped for want of evidence: {', '.join(n for n, _ in skipped)} "
                         "(--explain, or the report, says what to capture for each)")
    if out is not None:
        out_lines.append(f"report: {out / 'report.html'}")
    return out_lines
