"""Single-module isolation: each module's own error (the candidate's module on the baseline's input) next to
the error it inherited (the candidate's module in its own forward), and the module whose own error departs.

Why a stage of its own: the layer profile names the first departing module; after a small early drift that
is often a module passing the drift on. Isolation tells the two apart (comparators/isolation.py).
"""

from __future__ import annotations

from html import escape
from pathlib import Path

from align.stages import AFTER_STEP1, Figure, FigureContext, Stage
from align.stages.evidence import Evidence
from comparators.isolation import compare_isolation, read_isolation
from core.errors import BadInput
from core.findings import StageResult, skipped
from reports.figures import isolation_profile
from reports.html import table
from runstore import EVIDENCE_DIR, ISOLATION_EVIDENCE

_COLUMNS = ("module", "candidate", "own_rel_l2", "own_verdict", "inherited_rel_l2", "inherited_verdict",
            "input_rel_l2", "own_cosine", "judged_dtype", "dtype_measured")
# with backward evidence: each module's worst gradient (own: on the baseline's inputs and output gradient)
_BWD_COLUMNS = ("bwd_own_rel_l2", "bwd_own_verdict", "bwd_inherited_rel_l2", "bwd_worst")


def _evidence(ev: Evidence) -> Path | None:
    given = ev.inputs.isolation
    if given:
        p = Path(given)
        if p.is_dir():
            p = p / EVIDENCE_DIR / ISOLATION_EVIDENCE
        if not p.is_file():
            raise BadInput(f"{given}: no isolation evidence ({EVIDENCE_DIR}/{ISOLATION_EVIDENCE}; write it with "
                           "`align isolate`)")
        return p
    for run in (ev.candidate, ev.rerun):
        found = ev.evidence_file(run, ISOLATION_EVIDENCE) if run is not None else None
        if found is not None:
            return found
    return None


def run(ev: Evidence) -> StageResult:
    path = _evidence(ev)
    if path is None:
        return skipped("isolation", "no isolation evidence (--isolation RUN, or the candidate's "
                                    f"{EVIDENCE_DIR}/{ISOLATION_EVIDENCE})")
    meta, arrays = read_isolation(path)
    # each module at its own precision: the runs' (the optimizer's update precision) for all, the attention's
    # (flash attention's float16 in a float32 run) for the modules that compute one; --dtype for all
    given = bool(ev.options.dtype)
    res = compare_isolation(meta, arrays, dtype=ev.dtype[0] if given else ev.update_dtype[0],
                            attention_dtype=None if given else ev.dtype[0],
                            tolerances=ev.options.layer_tolerance or None)
    res.details["file"] = str(path)
    res.details["dtype_source"] = ev.dtype[1]
    ran_on = meta.get("baseline")
    if ran_on and Path(str(ran_on)).resolve() != Path(str(ev.baseline.path)).resolve():
        # the file carries the baseline outputs it compared with, so it stands alone; a moved store is fine
        res.details["baseline_note"] = (f"isolation ran on the baseline store {ran_on}, not on {ev.baseline.path} "
                                        "(the same run copied elsewhere, or another one)")
    return res


def section(res: StageResult) -> str:
    rows = res.details.get("per_module") or []
    if not rows:
        return ""
    named = set(res.details.get("named") or [])
    cols = _COLUMNS + (_BWD_COLUMNS if res.details.get("backward") else ())
    body = table([{**{k: _cell(r, k) for k in cols}, "named": "<- here" if r["module"] in named else ""}
                  for r in rows])
    notes = [n for n in (res.details.get("note"), res.details.get("inherited_inputs") and
                         f"Inherited errors: {res.details['inherited_inputs']}.") if n]
    return body + "".join(f"<p>{escape(str(n))}</p>" for n in notes)


def _cell(row: dict, key: str) -> object:
    """A row's value for the table; the measured precisions as 'baseline / candidate'."""
    v = row.get(key)
    if isinstance(v, dict):
        return f"{v.get('baseline')} / {v.get('candidate')}"
    return v


def figures(res: StageResult, ctx: FigureContext) -> list[Figure]:
    rows = res.details.get("per_module")
    if not rows:
        return []
    named = list(res.details.get("named") or [])
    return [Figure("Single-module isolation: own vs inherited error (red: named)", "isolation.png",
                   lambda p: isolation_profile(rows, named, res.verdict, p))]


STAGE = Stage(
    name="isolation", order=61, title="Single-module isolation (own vs inherited error)",
    needs="the baseline's full input and output tensors of the chosen modules at one step, and the candidate's "
          "modules run on those inputs (evidence/isolation.npz)",
    capture="baseline: DumpConfig(tensors='full', tensor_steps=[N], modules=['decoder.layers.?', "
            "'decoder.layers.?.self_attention', 'decoder.layers.?.mlp']); candidate: `align isolate BASELINE "
            "--candidate-yaml Y --candidate-ckpt CKPT --out RUN`, then --isolation RUN (docs/workflow.md); "
            "backward too: dumpers.torch_module_backward.ModuleBackwardCapture(model, RUN, modules=['embedding', "
            "'decoder.layers.?', 'decoder.layers.?.*', 'loss'], steps=[N]) around the baseline's step N ('loss': "
            "Megatron's loss function, its logits, labels and loss_mask)",
    run=run, section=section, figures=figures,
    part="step 1 and 2", explains=("layer_tensors", *AFTER_STEP1),
    why=("Run on the baseline's own input (and fed its output gradient, with a backward capture), this module's "
         "output or gradient still departs: its own computation differs (a kernel, a precision, an epsilon, a "
         "weight layout, a hand-written backward), not what it inherits."),
    next=("align drill {baseline} --module {module} --candidate-yaml {candidate_yaml} --candidate-ckpt CKPT "
          "--out drill_{module}: the operator inside {module} that departs (an epsilon, a cast, operands in another "
          "order, a backward reduction); then align repro {isolation} --module {module} --candidate-yaml "
          "{candidate_yaml} --out repro_{module}: its input, weights and both outputs with a PyTorch and a "
          "MindSpore script that show the difference without this tool (send it to the framework team)"))
