"""NaN trace: the first non-finite gradient of each run, by parameter, module and rank (tp/pp/dp)."""

from __future__ import annotations

from align.stages import LONG_RUN, Stage
from align.stages.evidence import Evidence
from core.findings import Finding, StageResult, skipped
from models import load_mapping


def run(ev: Evidence) -> StageResult:
    stores = [(role, r) for role, r in (("baseline", ev.baseline), ("candidate", ev.candidate))
              if r.store is not None and r.has("nonfinite_grads")]
    if not stores:
        return skipped("nan_trace", "no run recorded per-step non-finite gradient counts")
    m = load_mapping(ev.mapping)
    res = StageResult("nan_trace")
    for role, r in stores:
        sc = r.store.scalars()
        bad = sc[sc["nonfinite_grads"].fillna(0) > 0]
        if bad.empty:
            continue
        step = int(bad["step"].min())
        rank = int(bad.loc[bad["step"] == step, "rank"].min())
        table = r.store.step_arrays(step, rank).table("nan_trace") if step in r.store.array_steps() else None
        if table is None or table.empty:
            res.add(Finding("nan_trace", "fail", None, "first_nonfinite_grad", step, None,
                            f"{role}: non-finite gradients at step {step} on rank {rank} (no trace recorded)"))
            continue
        row = table.iloc[0]
        name = str(row["name"])
        other = m.map_name(name, role)
        coords = ", ".join(f"{k}={int(row[k])}" for k in ("tp_rank", "pp_rank", "dp_rank") if k in row)
        res.add(Finding("nan_trace", "fail", name, "first_nonfinite_grad", step, None,
                        f"{role}: first non-finite gradient at step {step} in {name} (module {row['module']}; "
                        f"rank {rank}: {coords})" + (f"; counterpart {', '.join(other)}" if other else "")
                        + f"; {row['detail']}"))
        res.details[role] = {"step": step, "parameter": name, "module": str(row["module"]), "rank": rank,
                             "counterpart": other}
    if not res.findings:
        res.add(Finding("nan_trace", "pass", None, "first_nonfinite_grad", None, None,
                        "every gradient finite at every step in " + " and ".join(role for role, _ in stores)))
    return res


STAGE = Stage(
    name="nan_trace", order=150, title="NaN trace",
    needs="per-step non-finite gradient counts and the nan_trace table from the dumpers",
    capture="MegatronDumper / MindSporeDumper with DumpConfig(nan_trace='grads') (the default) record the "
            "first non-finite gradient with its module and rank",
    run=run,
    part="long run", explains=("nonfinite", "step1_local_norm", "step2_loss", "lr0_run", *LONG_RUN),
    why=("This parameter's gradient is the first to turn NaN/Inf: the overflow starts in it (a precision, a "
         "loss scale, a division or a log)."),
    next=("capture the inputs and outputs of {component}'s module at that step on the side that overflowed "
          "(DumpConfig(tensor_steps=[STEP], modules=[...])) and check its compute dtype"))
