"""What the paired-demo tests check on a fault run, shared by tests/test_demo.py (candidate-side faults, on its
clean pair's baseline) and tests/test_demo_baseline_faults.py (baseline-side faults, each with its own baseline)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from demo.pair import paired_demo
from demo.spec import FAULTS, Fault

# the dense pair's short runs: the stages under test need a dozen steps (the 300-step long run is `make demo`'s)
STEPS = 12
LR0_STEPS = 3
# `align report` alone, on a fault's stores, must repeat the demo's verdicts: checked for one fault of each
# shape of the report's command line (a reused baseline, an own baseline, --lr0, --optimizer-check); the demo
# runs the same report function on the same argv, so the other faults would check nothing new
REPORT_AGAIN = {"qk_swap", "pad_eos", "log_softmax_bf16", "no_clip"}


def verdicts(data: dict) -> tuple[dict, set]:
    """What must agree between the demo and `align report`: every stage's verdict, every non-pass finding."""
    stages = {k: v["verdict"] for k, v in data["stages"].items()}
    findings = {(f["stage"], f["verdict"], f["component"]) for f in data["findings"] if f["verdict"] != "pass"}
    return stages, findings


def report_again(out: Path, dest: Path) -> dict:
    """`align report` on the demo's own stores, with the command the demo saved, in a fresh folder."""
    from align.cli import main

    argv = shlex.split((out / "report_command.txt").read_text())[2:]
    i = argv.index("--out")
    argv[i + 1] = str(dest)
    main(["report", "-q", *argv])
    return json.loads((dest / "summary.json").read_text())


def culprit_is(data: dict, f: Fault, kind: str) -> None:
    """The diagnosis names the planted fault first: its stage and component (any of "a|b"), the root of the
    failures it explains (summary.json's ``diagnosis[0]``; the report's first screen and the terminal show the
    same). Where the checklist names the very setting first, the stage the fault was planted for is among the
    places it shows (``seen_at``)."""
    stage, component = f.culprit_for(kind)
    first = data["diagnosis"][0]
    assert (first["stage"], first["consequence_of"]) == (stage, None), data["diagnosis"]
    assert any(c in str(first["component"]) for c in component.split("|")), data["diagnosis"]
    assert first["why"] and first["next"]
    if f.culprit is not None:
        assert any(e["stage"] == f.stage and f.component_for(kind) in str(e["component"])
                   for e in first["seen_at"]), data["diagnosis"]


def dense_fault_fails_at_its_stage(name: str, out: Path, reuse: Path | None) -> None:
    """The dense pair with fault ``name`` fails at the fault's stage naming its component. Only the runs that
    stage judges: an lr = 0 pair for lr0_run, the optimizer check for optimizer (each is one more framework
    start-up per side; the clean pair runs them all); the candidate in PYNATIVE (no GRAPH compile)."""
    f = FAULTS[name]
    data = paired_demo(out, steps=STEPS, lr0_steps=LR0_STEPS if f.stage == "lr0_run" else 0, inject=name,
                       reuse_baseline=reuse, repeat=False, optimizer_check=f.stage == "optimizer",
                       candidate_graph=False)
    assert data["verdict"] == "fail"
    stage = data["stages"][f.stage]
    assert stage["verdict"] == "fail", (f.stage, stage)
    component = f.component_for("dense")
    hits = [x for x in data["findings"] if x["stage"] == f.stage and x["verdict"] == "fail"
            and component in str(x["component"])]
    assert hits, (component, [x for x in data["findings"] if x["stage"] == f.stage])
    culprit_is(data, f, "dense")
    if name == "log_softmax_bf16":   # under float16's line: only the measured floor fails it
        (row,) = [r for r in stage["floors"] if r["quantity"] == "loss"]
        assert (row["dtype_verdict"], row["decided_by"], row["verdict"]) == ("pass", "floor", "fail")
    assert f.name in (out / "report.html").read_text()
    if name in REPORT_AGAIN:
        assert verdicts(report_again(out, out.parent / f"{name}_report")) == verdicts(data)
