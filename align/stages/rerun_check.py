"""Re-run check: before a re-run's layer tensors stand in for the candidate's, show that the re-run reproduces
the candidate (loss at every common step, named local norms), within the precision's noise."""

from __future__ import annotations

from align.stages import Stage
from align.stages.evidence import Evidence
from core.findings import StageResult, skipped


def run(ev: Evidence) -> StageResult:
    res = ev.rerun_check
    return res if res is not None else skipped("rerun_check", "no re-run of the candidate (--rerun)")


STAGE = Stage(
    name="rerun_check", order=55, title="Re-run against the run it re-runs",
    needs="a re-run of the candidate's first steps (--rerun), when its layer tensors come from there",
    capture="re-run the candidate's steps 1-2 with layer capture (MindSporeDumper DumpConfig(tensor_steps=[1, 2], "
            "cells=[...]) in PYNATIVE) and pass it as --rerun RUN",
    run=run,
    part="step 1 and 2",
    why=("The re-run does not reproduce the run it stands in for: its layer tensors may not be the "
         "candidate's."),
    next=("re-run with the same weights, batches, seed and precision as the run it re-runs, then align report "
          "again"))
