"""Same start, weights: the conversion report of the baseline's weights into the candidate's names."""

from __future__ import annotations

import json
from pathlib import Path

from align.stages import LATER, Stage
from align.stages.evidence import Evidence
from core.errors import BadInput
from core.findings import Finding, StageResult, skipped
from runstore import CONVERSION_EVIDENCE


def read_conversion(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadInput(f"{path}: not a conversion report ({exc.__class__.__name__})") from None
    if not isinstance(data, dict) or not isinstance(data.get("findings", []), list):
        raise BadInput(f"{path}: not a conversion report (an object with a 'findings' list)")
    return data


def run(ev: Evidence) -> StageResult:
    path = Path(ev.inputs.conversion) if ev.inputs.conversion else ev.evidence_file(ev.candidate,
                                                                                    CONVERSION_EVIDENCE)
    if path is None:
        return skipped("conversion", "no conversion report")
    data = read_conversion(path)
    res = StageResult("conversion", details={"file": str(path), "tensors": data.get("tensors")})
    # the converted norms vs the source's (checkpoints.conversion_totals); a report written before it lacks them
    res.details["self_check"] = data.get("self_check") or "not in this report (written before convert-weights " \
        "checked its norms: convert again to have it)"
    for f in data.get("findings", []):
        try:
            res.add(Finding(**{**f, "stage": "conversion"}))
        except (TypeError, ValueError):
            raise BadInput(f"{path}: finding {f!r} is not (stage, verdict, component, metric, value, "
                           "threshold, message)") from None
    if not res.findings:
        res.add(Finding("conversion", "pass", None, "tensors_converted", data.get("tensors"), None,
                        f"{data.get('tensors')} baseline tensors converted to candidate names through the "
                        "mapping"))
    return res


STAGE = Stage(
    name="conversion", order=20, title="Weight conversion",
    needs="the report of the baseline weights' conversion (align convert-weights --json)",
    capture="align convert-weights ... --json > conversion.json, then --conversion conversion.json (or copy "
            "it to CANDIDATE_RUN/evidence/conversion.json)",
    run=run,
    part="same start", explains=LATER,
    why=("The candidate did not start from the baseline's weights: a converted tensor differs, so every step-1 "
         "difference may follow from it."),
    next=("align compare-weights BASELINE_CKPT CANDIDATE_CKPT --out DIR lists every tensor; check the mapping "
          "rule and transform of {component} (align mapping)"))
