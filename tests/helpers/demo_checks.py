"""What the paired-demo tests check on a fault run, shared by tests/test_demo.py (candidate-side faults, on its
clean pair's baseline) and tests/test_demo_baseline_faults.py (baseline-side faults, each with its own baseline)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from demo.fault_batch import FaultPair, paired_faults
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


def selected(request: pytest.FixtureRequest, test: str, param: str, values: list[str]) -> list[str]:
    """The ``values`` of parameter ``param`` whose ``test`` items of the requesting module this session runs (so
    that `-k` on one fault runs that fault's pair alone, not the whole batch)."""
    chosen = {item.callspec.params[param] for item in request.session.items
              if item.module is request.module and item.originalname == test}
    return [v for v in values if v in chosen]


def dense_fault_pair(name: str) -> FaultPair:
    """The dense pair with fault ``name``, short: only the runs its stage judges (an lr = 0 pair for lr0_run, the
    optimizer check for optimizer: each is one more framework start-up per side; the clean pair runs them all)."""
    f = FAULTS[name]
    return FaultPair(name, STEPS, lr0_steps=LR0_STEPS if f.stage == "lr0_run" else 0,
                     optimizer_check=f.stage == "optimizer")


def dense_faults(out: Path, names: list[str], reuse: Path | None, rerun_first: bool = False) -> dict[str, dict]:
    """The dense pairs with faults ``names`` (summary.json's content by name, each in ``out/<name>``): their
    candidates in PYNATIVE (no GRAPH compile) and in one MindSpore process (demo.fault_batch; ``rerun_first``:
    the first one's candidate again, last, in ``out/<name>/again/candidate``)."""
    return paired_faults(out, [dense_fault_pair(n) for n in names], reuse_baseline=reuse, rerun_first=rerun_first)


def dense_fault_fails_at_its_stage(name: str, data: dict, out: Path) -> None:
    """The dense pair with fault ``name`` (its summary ``data``, its output ``out``) fails at the fault's stage
    naming its component, and the diagnosis names it first."""
    f = FAULTS[name]
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
