"""The optimizer check: the baseline's step-1 gradients through the candidate's optimizer, updates compared.

Evidence, as files (docs/run-store.md): the baseline store's ``evidence/optimizer_step1.npz`` (``grad/``,
``init/``, ``weight/`` in baseline names: step-1 gradients, weights before and after its step; a distributed
baseline's per-rank shards ``evidence/optimizer_step1/rank_R.npz``, merged into whole tensors) and the
candidate's optimizer-check file (``before/``, ``after/`` in candidate names: its weights before and after one
step on those gradients). Each side's update is taken from its own start: the candidate's update is re-based
onto the baseline's start, so a conversion fault does not pose as an optimizer one.

Clipping is checked on its own (Adam's first update hides it: m / sqrt(v) hardly depends on the gradient's
scale): both sides' clipping code on one probe gradient, the step-1 gradients scaled to 10 x the max norm
(``runstore.clip_probe``: the baseline's ``evidence/clip_probe.npz``, the ``clipped/`` and ``clip/`` keys of the
candidate's optimizer-check file), compared before any update and against what each side's config says
(Megatron ``--clip-grad``; MindFormers ``runner_wrapper`` ``use_clip_grad`` / ``max_grad_norm``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from align.checks.config import megatron_common, mindformers_common
from align.stages import LONG_RUN, Stage
from align.stages.evidence import Evidence
from comparators.optimizer_check import compare_clipping, compare_updates, read_step1_file, to_candidate_names
from core.errors import BadInput
from core.findings import Finding, StageResult, skipped
from models import load_mapping
from reports.html import table
from runstore import EVIDENCE_DIR, OPTIMIZER_EVIDENCE, evidence_path
from runstore.clip_probe import CLIP_PROBE, read_clip_probe

CONFIG_SOURCES = {"baseline": "Megatron --clip-grad / OptimizerConfig.clip_grad",
                  "candidate": "MindFormers runner_wrapper use_clip_grad / max_grad_norm"}


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
    if res.verdict != "skipped":
        clipping(ev, res, base, cand_path, step1["grad"], m, tp)
    return res


def clip_config(ev: Evidence, role: str) -> float | None:
    """The max grad norm a run's config says (0 = no clipping), None when its config is not known."""
    cfg = ev.config(role)
    if cfg is None:
        return None
    if role == "baseline" and cfg[0] == "megatron_args":
        value = megatron_common(cfg[1])[0].get("clip_grad")
    elif role == "candidate" and cfg[0] == "mindformers_yaml":
        value = mindformers_common(cfg[1]).get("clip_grad")
    else:
        return None
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return None


def clipping(ev: Evidence, res: StageResult, base: Path, cand_path: Path, grads: dict[str, np.ndarray],
             m: Any, tp: Any) -> None:
    """The clipping probe of both sides, compared (module docstring); its findings join the stage's."""
    cand_file = cand_path / EVIDENCE_DIR / OPTIMIZER_EVIDENCE if cand_path.is_dir() else cand_path
    cand = read_clip_probe(cand_file)
    if cand is None:
        res.details["clipping"] = {"checked": False, "reason": f"{cand_file} has no clipping probe (clipped/ and "
                                   "clip/ keys: dumpers.mindspore_optimizer_check.run_optimizer_check writes them)"}
        return
    clipped_c, info_c = cand
    base_probe = base.parent / CLIP_PROBE          # next to optimizer_step1.npz or its shard folder
    probe_b = read_clip_probe(base_probe) if base_probe.is_file() else None
    scale = info_c["scale"]
    if probe_b is not None and abs(probe_b[1]["scale"] - scale) > 1e-6 * scale:
        res.add(Finding("optimizer", "warn", "clipping", "probe_scale", scale, probe_b[1]["scale"],
                        f"the candidate's clipping probe scaled the step-1 gradients by {scale:.6g}, the baseline's "
                        f"({base_probe}) by {probe_b[1]['scale']:.6g}: not the same gradient, so the baseline is "
                        "judged by its config instead"))
        probe_b = None
    clipped_cb, _ = m.convert(clipped_c, "baseline", tp)
    probe = {n: np.asarray(g, dtype=np.float64) * scale for n, g in grads.items()}
    clip = compare_clipping(probe, probe_b[0] if probe_b else None, clipped_cb,
                            config_baseline=clip_config(ev, "baseline"), config_candidate=clip_config(ev, "candidate"),
                            config_sources=CONFIG_SOURCES, info_baseline=probe_b[1] if probe_b else None,
                            info_candidate=info_c)
    for f in clip.findings:
        res.add(f)
    res.details["clipping"] = {"checked": True, "scale": scale, "baseline_probe": str(base_probe) if probe_b else None,
                               **clip.details}


def section(res: StageResult) -> str:
    """Every parameter's update difference, its ratio to its noise floor and the floor's source."""
    return table(res.details.get("parameters") or [])


STAGE = Stage(
    name="optimizer", order=80, title="Optimizer check (same gradients, both optimizers)",
    needs="the baseline's step-1 gradients and weights (evidence/optimizer_step1.npz) and the candidate's "
          "weights before/after one step on those gradients",
    capture="baseline: dumpers.optimizer_evidence.OptimizerEvidence(model, RUN) around iteration 1's "
            "optimizer.step() writes RUN/evidence/optimizer_step1.npz; candidate: "
            "dumpers.mindspore_optimizer_check.run_optimizer_check(optimizer, RUN, OUT, train_cell=cell), then "
            "--optimizer-check OUT (docs/workflow.md); both also write the clipping probe (one process)",
    run=run, section=section,
    part="step 1 and 2", explains=("step2_loss", *LONG_RUN),
    why=("From the same gradients and weights the candidate's optimizer updates differently: its settings "
         "differ (lr, betas, eps, which parameters it decays, gradient clipping)."),
    next=("make the optimizer settings behind {component} the same (align check-config; MindFormers "
          "runner_wrapper / optimizer blocks in the YAML), then run the optimizer check again"))
