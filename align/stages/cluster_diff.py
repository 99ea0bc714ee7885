"""The checklist's second half: the two clusters' environment captures compared (no stage of its own).

Why in the checklist: environment variables, precision modes, versions, seeds, data and weights are settings
of the run as much as its arguments are; the accuracy guide checks them before step 1. The captures come
from ``align capture-env`` files (``--baseline-env`` / ``--candidate-env``) or the dumpers' meta.json.
"""

from __future__ import annotations

from align.stages.evidence import Evidence
from core.findings import Finding, StageResult
from reports.html import table

CAPTURE = ("the cluster diff: `align capture-env --out FILE [--data PATH ...] [--weights CKPT]` on each cluster, "
           "then --baseline-env / --candidate-env; or DumpConfig(capture_env=True) in both runs (meta.json)")


def environment_result(ev: Evidence) -> StageResult | None:
    """The comparison of both sides' captures; None unless both sides have one."""
    from comparators.environment import compare_environments
    from models import load_mapping

    b, c = ev.environment("baseline"), ev.environment("candidate")
    if b is None or c is None:
        return None
    return compare_environments(b, c, load_mapping(ev.mapping))


def with_environment(ev: Evidence, res: StageResult) -> StageResult:
    """``res`` (the config checklist, maybe skipped) with the cluster diff's findings and table added."""
    env = environment_result(ev)
    if env is None:
        have = [r for r in ("baseline", "candidate") if ev.environment(r) is not None]
        note = (f"environment captured on the {have[0]} only: {CAPTURE}" if have else f"not compared: {CAPTURE}")
        if res.verdict == "skipped":
            if have:
                res.details["reason"] = f"{res.details.get('reason', '')}; {note}"
        else:
            res.details["environment"] = {"note": note}
        return res
    if res.verdict == "skipped":
        res = StageResult(res.name, "skipped", {"config": f"not compared ({res.details.get('reason', '')})"})
    for f in env.findings:
        res.add(f)
    if not env.findings:
        same = sum(r["status"] == "same" for r in env.details["rows"])
        res.add(Finding("checklist", "pass", None, "environment_match", same, None,
                        f"the two clusters' captures agree on every item that matters ({same} compared the same)"))
    res.details["environment"] = env.details
    return res


def section(res: StageResult) -> str:
    """The cluster diff's table: what differs first, then what is the same."""
    env = res.details.get("environment") or {}
    rows = env.get("rows") or []
    if not rows:
        return f"<p class=muted>{env.get('note', '')}</p>" if env.get("note") else ""
    order = {"fail": 0, "warn": 1, "unknown": 2, "info": 3, "same": 4}
    shown = sorted(rows, key=lambda r: order.get(r["status"], 5))
    fws = " vs ".join(env.get("frameworks") or [])
    return (f"<h3>Cluster diff ({fws})</h3>"
            + table([{"what": r["section"], "item": r["item"], "baseline": r["baseline"],
                      "candidate": r["candidate"], "status": r["status"], "why": r["why"]} for r in shown],
                    row_class="status"))
