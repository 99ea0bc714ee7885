"""Stage 0, the checklist: Megatron arguments vs the MindFormers config, side by side, with known traps."""

from __future__ import annotations

from align.checks.config import compare_configs
from align.stages import LATER, Stage
from align.stages.cluster_diff import CAPTURE, with_environment
from align.stages.cluster_diff import section as environment_section
from align.stages.evidence import Evidence
from core.findings import Finding, StageResult, skipped
from reports.html import table


def run(ev: Evidence) -> StageResult:
    return with_environment(ev, _config(ev))


def _config(ev: Evidence) -> StageResult:
    b, c = ev.config("baseline"), ev.config("candidate")
    if b is None or c is None:
        missing = [role for role, cfg in (("baseline", b), ("candidate", c)) if cfg is None]
        return skipped("checklist", f"no config for the {' and '.join(missing)}")
    if b[0] != "megatron_args" or c[0] != "mindformers_yaml":
        return skipped("checklist", f"the checklist compares Megatron arguments (baseline) with a MindFormers "
                       f"config (candidate); got {b[0]} and {c[0]}")
    rows, res = compare_configs(b[1], c[1], base=ev.config_base("candidate"))
    if not res.findings:
        res.add(Finding("checklist", "pass", None, "settings_match", len(rows), None, match_message(rows)))
    return res


def match_message(rows: list) -> str:
    """What a checklist without mismatches says: never "all" while some settings were not read."""
    matched = sum(r.status == "match" for r in rows)
    unread = [r.key for r in rows if r.status == "not read"]
    what = " (model, optimizer, schedule, precision, parallel layout, dropout, weight-decay rules)"
    if not unread:
        return f"all {matched} compared settings match{what}"
    return f"{matched} compared settings match{what}; {len(unread)} not read: check by hand: {', '.join(unread)}"


def section(res: StageResult) -> str:
    rows = [{"setting": r["key"], "Megatron": r["megatron"], "MindFormers": r["mindformers"],
             "status": r["status"], "note": r.get("note") or ""} for r in res.details.get("rows", [])]
    return (table(rows, row_class="status") if rows else "") + environment_section(res)


STAGE = Stage(
    name="checklist", order=10, title="Checklist: Megatron arguments vs MindFormers config, and the cluster diff",
    needs="the baseline's Megatron arguments and the candidate's MindFormers config; or both clusters' "
          "environment captures",
    capture="dumpers record them in meta.json (MegatronDumper(meta={'config': ...}), MindSporeDumper "
            "DumpConfig(meta={'config': ...})); or pass --baseline-config (Megatron log, launch script or "
            f"arguments JSON) and --candidate-config (the MindFormers YAML); {CAPTURE}",
    run=run, section=section,
    part="checklist", explains=LATER,
    why=("The two runs are not set up alike: a setting that differs (model, precision, optimizer, parallel "
         "layout, data, environment) changes the numerics before step 1, so every later difference may follow "
         "from it."),
    next=("make {component} the same on both sides (align check-config BASELINE_ARGS CANDIDATE_YAML shows both "
          "values), run both again, then align report"))
