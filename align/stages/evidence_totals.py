"""Evidence that checks itself, before anything is judged: each run's named gradient norms, recombined exactly as
the comparators recombine them (TP / EP slices, pipeline stages, DP / CP replicas, optimizer parts, experts),
must give back the run's own global gradient norm at every step (comparators.evidence_totals). Where they do
not, the recombination is wrong for that run's layout, and the stages that judge named norms say so instead of
judging the model on them. Likewise the samples a Megatron run recorded per step (its DP ranks' batches) against
the global batch size of its own arguments."""

from __future__ import annotations

from align.stages import Stage
from align.stages.evidence import Evidence
from comparators.evidence_totals import BatchCheck, SideCheck, check_batch_rows
from core.errors import BadInput
from core.findings import Finding, StageResult, skipped
from reports.html import table

NAME = "evidence_totals"
#: The stages that judge named norms: they skip judging where a side's self-check failed.
RESTING = ("step1_local_norm", "norm_trajectories")


def _fail_message(chk: SideCheck) -> str:
    c = chk.failed[0]
    n = len(chk.failed_steps)
    more = f" (and at {n - 1} more step(s))" if n > 1 else ""
    if c.bound == "dp":
        return (f"the {chk.side}'s named gradient norms are each DP rank's before the all-reduce; their DP ranks' "
                f"totals add up to {c.recombined:.9g} at step {c.step}{more}, below the {chk.side}'s own global grad "
                f"norm {c.recorded:.9g} ({chk.source}), which they bound: a DP rank's gradient is missing from them. "
                f"Layout recorded: {chk.layout}. Likely: " + "; ".join(c.causes)
                + ". The named norms of this run are not judged (step-1 local norms, norm trajectories)")
    return (f"the {chk.side}'s named gradient norms, recombined as the comparators recombine them ({c.path}), give "
            f"{c.recombined:.9g} at step {c.step}{more}, but the {chk.side}'s own global grad norm there is "
            f"{c.recorded:.9g} ({chk.source}): {c.rel:.3g} relative, beyond float32 summation noise "
            f"({c.tolerance:.2g}). Layout recorded: {chk.layout}. Likely: " + "; ".join(c.causes)
            + ". The named norms of this run are not judged (step-1 local norms, norm trajectories)")


def _batch_checks(ev: Evidence) -> dict[str, BatchCheck]:
    """Each run's recorded batch rows per step against the global batch size its Megatron arguments give (a
    MindFormers replay's samples are checked one by one by the data stage)."""
    out = {}
    for role in ("baseline", "candidate"):
        run = ev.baseline if role == "baseline" else ev.candidate
        try:
            cfg = ev.config(role)
        except BadInput:        # an unreadable config is reported by the checklist
            cfg = None
        expected = cfg[1].get("global_batch_size") if cfg and cfg[0] == "megatron_args" else None
        out[role] = check_batch_rows(run, role, expected, "the Megatron arguments' global_batch_size")
    return out


def run(ev: Evidence) -> StageResult:
    checks: dict[str, SideCheck] = ev.evidence_totals
    batches = _batch_checks(ev)
    if all(c.status == "unchecked" for c in (*checks.values(), *batches.values())):
        return skipped(NAME, "; ".join(f"{role}: {c.why}" for role, c in checks.items()))
    res = StageResult(NAME)
    for role, b in batches.items():
        if b.status == "fail":
            f = b.failed[0]
            res.add(Finding(NAME, "fail", role, "batch_rows_vs_global_batch", f["rows"], f["expected"],
                            f"the {role} recorded {f['rows']} samples at step {f['step']} (its DP ranks' batches "
                            f"together) but its global batch size is {f['expected']} ({b.source})"
                            + (f", and at {len(b.failed) - 1} more step(s)" if len(b.failed) > 1 else "")
                            + ". Likely: " + "; ".join(f["causes"])))
        elif b.status == "pass":
            res.add(Finding(NAME, "pass", role, "batch_rows_vs_global_batch", b.expected, b.expected,
                            f"the {role}'s recorded batches hold its global batch of {b.expected} samples at all "
                            f"{len(b.steps)} step(s) checked"))
    for role, chk in checks.items():
        if chk.status == "fail":
            c = chk.failed[0]
            res.add(Finding(NAME, "fail", role, "named_norms_vs_global_norm", c.rel, c.tolerance, _fail_message(chk)))
        elif chk.status in ("pass", "bound"):
            w = chk.worst
            if chk.status == "bound":
                text = (f"the {role}'s named norms are consistent with its own global grad norm at all "
                        f"{len(chk.steps)} step(s) checked ({chk.steps[0]}-{chk.steps[-1]}), as a bound only: "
                        f"{chk.why}; layout {chk.layout}; total from {chk.source}")
            else:
                text = (f"the {role}'s named norms recombine to its own global grad norm at all {len(chk.steps)} "
                        f"step(s) checked ({chk.steps[0]}-{chk.steps[-1]}; worst {w.rel:.2g} relative at step "
                        f"{w.step}, line {w.tolerance:.2g}: float32 summation noise); layout {chk.layout}; "
                        f"total from {chk.source}")
            res.add(Finding(NAME, "pass", role, "named_norms_vs_global_norm", w.rel if w else None,
                            w.tolerance if w else None, text))
    res.details = {role: c.to_json() for role, c in checks.items()}
    res.details["batches"] = {role: b.to_json() for role, b in batches.items()}
    res.details["unchecked"] = {role: c.why for role, c in checks.items() if c.status == "unchecked"}
    return res


def untrusted(ev: Evidence, step: int | None = None, path: str | None = None) -> str | None:
    """Why the named norms may not be judged (at ``step``, or over the whole run when None; as read by ``path``,
    either reader when None), or None: a side's self-check failed there. For the stages resting on named norms."""
    bad = [c for c in ev.evidence_totals.values() if not c.trusted(step, path)]
    if not bad:
        return None
    c = bad[0]
    f = c.failures(step, path)[0]
    return (f"not judged: the {c.side}'s named norms do not recombine to its own global grad norm (step {f.step}: "
            f"{f.recombined:.9g} vs {f.recorded:.9g}; {'; '.join(f.causes[:2])}); see '{STAGE.title}'. A verdict on "
            "them would be a verdict on the recombination, not on the model")


def section(res: StageResult) -> str:
    rows = []
    for role in ("baseline", "candidate"):
        d = res.details.get(role) or {}
        w = d.get("worst") or {}
        rows.append({"run": role, "status": d.get("status"), "steps checked": d.get("steps_checked"),
                     "worst rel diff": w.get("rel_diff"), "line": w.get("tolerance"), "layout": d.get("layout"),
                     "total from": d.get("source") or d.get("why")})
    out = table(rows)
    failed = [{"run": role, **{k: f[k] for k in ("step", "recombined", "recorded", "rel_diff", "path")},
               "likely": "; ".join(f["causes"])}
              for role in ("baseline", "candidate") for f in (res.details.get(role) or {}).get("failed", [])]
    return out + (table(failed) if failed else "")


STAGE = Stage(
    name=NAME, order=35, title="Evidence self-check (named norms against each run's own global norm)",
    needs="named per-parameter gradient norms and the same run's global grad norm at the same steps (run stores "
          "from the dumpers hold both; a MindFormers log with TrainingStateMonitor norms and global_norm)",
    capture="MegatronDumper stores Megatron's optimizer grad norm beside the named norms; MindFormersDumperCallback "
            "stores the training cell's global_norm; record both with the dumpers on every rank",
    run=run, section=section, part="inputs", explains=RESTING,
    why=("The named norms of this run do not add up to the run's own global gradient norm: a rank's table is "
         "missing, a parameter is counted twice, or an expert is recorded under another index; every named-norm "
         "comparison would judge the recombination, not the model."),
    next=("check that every rank of the {component} run wrote its step files (RUN/steps/step_N/rank_R.h5) and the "
          "dumper's layout columns (tp_partition_dim, tp_rank, dp_shard, dp_rank) against the run's parallel layout "
          "(docs/layouts.md, 'Evidence self-check')"))
