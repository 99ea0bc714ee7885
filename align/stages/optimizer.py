"""The optimizer check: the baseline's step-1 gradients through the candidate's optimizer, updates compared.

Evidence, as files (docs/run-store.md): the baseline store's ``evidence/optimizer_step1.npz`` (``grad/``,
``init/``, ``weight/`` in baseline names: step-1 gradients, weights before and after its step; a distributed
baseline's per-rank shards ``evidence/optimizer_step1/rank_R.npz``, merged into whole tensors) and the
candidate's optimizer-check file (``before/``, ``after/`` in candidate names: its weights before and after one
step on those gradients). Each side's update is taken from its own start: the candidate's update is re-based
onto the baseline's start, so a conversion fault does not pose as an optimizer one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from align.stages import Stage
from align.stages.evidence import Evidence
from comparators.optimizer_check import compare_updates, read_step1_file, to_candidate_names
from core.errors import BadInput
from core.findings import StageResult, skipped
from models import load_mapping
from reports.html import table
from runstore import EVIDENCE_DIR, OPTIMIZER_EVIDENCE, evidence_path


def read_candidate_update(path: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(before, after) from a candidate optimizer-check npz, or a run store holding one in evidence/."""
    if path.is_dir():
        path = path / EVIDENCE_DIR / OPTIMIZER_EVIDENCE
    if not path.is_file():
        raise BadInput(f"{path}: no optimizer-check file")
    try:
        with np.load(path, allow_pickle=False) as z:
            before = {k[len("before/"):]: z[k] for k in z.files if k.startswith("before/")}
            after = {k[len("after/"):]: z[k] for k in z.files if k.startswith("after/")}
    except (OSError, ValueError, EOFError) as exc:
        raise BadInput(f"{path}: not a readable npz ({exc})") from None
    if not after or not before:
        raise BadInput(f"{path}: no before/<name> and after/<name> arrays (the candidate's optimizer check)")
    return before, after


def run(ev: Evidence) -> StageResult:
    base = ev.evidence_file(ev.baseline, OPTIMIZER_EVIDENCE)
    if base is None and ev.baseline.store is not None:   # a distributed baseline: per-rank shards, merged
        base = evidence_path(ev.baseline.path)
    if base is None:
        return skipped("optimizer", "the baseline store has no evidence/optimizer_step1.npz "
                                    "(or evidence/optimizer_step1/rank_*.npz)")
    cand_path = Path(ev.inputs.optimizer_check) if ev.inputs.optimizer_check else None
    if cand_path is None:
        own = ev.evidence_file(ev.candidate, OPTIMIZER_EVIDENCE)
        cand_path = own
    if cand_path is None:
        return skipped("optimizer", "no candidate optimizer-check file (--optimizer-check)")
    step1 = read_step1_file(base)
    init, after_b = step1["init"], step1["weight"]
    if not init or not after_b:
        raise BadInput(f"{base}: no init/<name> and weight/<name> arrays")
    before_c, after_c = read_candidate_update(cand_path)
    m = load_mapping(ev.mapping)
    tp = ev.transform_params()
    init_c = to_candidate_names(init, m, tp)
    rebased = {k: init_c[k].astype(np.float64) + (after_c[k].astype(np.float64) - before_c[k])
               for k in after_c if k in init_c and k in before_c}
    dtype, source = ev.update_dtype
    res = compare_updates(init, after_b, rebased, m, params=tp, dtype=dtype)
    res.details.update({"baseline_file": str(base), "candidate_file": str(cand_path), "dtype_source": source})
    return res


def section(res: StageResult) -> str:
    """Every parameter's update difference, its ratio to its noise floor and the floor's source."""
    return table(res.details.get("parameters") or [])


STAGE = Stage(
    name="optimizer", order=80, title="Optimizer check (same gradients, both optimizers)",
    needs="the baseline's step-1 gradients and weights (evidence/optimizer_step1.npz) and the candidate's "
          "weights before/after one step on those gradients",
    capture="baseline: dumpers.optimizer_evidence.OptimizerEvidence(model, RUN) around iteration 1's "
            "optimizer.step() writes RUN/evidence/optimizer_step1.npz; candidate: "
            "dumpers.mindspore_optimizer_check.run_optimizer_check(optimizer, RUN, OUT), then "
            "--optimizer-check OUT (docs/workflow.md)",
    run=run, section=section)
