"""The candidate's own module tensors from the GRAPH run that trained (its run store's kernel dump,
dumpers/mindspore_kernel_dump.py), for `align isolate --candidate-run`: the inherited error is then measured on the
run that disagreed; a PYNATIVE re-run may differ from it (MindFormers' MLA projection gradients do)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from core.errors import BadInput
from runstore import RunReader, load_npy
from sources.mindspore_dump import store_kernel_dump

_KINDS = {"forward.input.0": "input", "forward.output.0": "output", "backward.grad_output.0": "grad_output"}


def graph_run_tensors(candidate_run: str | Path, step: int, rank: int = 0) -> dict[str, dict[str, np.ndarray]]:
    """{cell name below GPTModel: {input, output, grad_output}} at ``step`` of ``rank``: each tapped cell's own
    first input, first output and output gradient in the GRAPH run. BadInput when the store names no kernel dump
    or the dump lacks the step."""
    if not Path(candidate_run).is_dir():
        raise BadInput(f"{candidate_run}: not a run store folder")
    dump = store_kernel_dump(RunReader(candidate_run))
    if dump is None:
        raise BadInput(f"{candidate_run}: its meta.json names no GRAPH kernel dump (MindFormersDumperCallback "
                       "kernel_dump, or dumpers.mindspore_kernel_dump.KernelDumpCapture, in the run that trained)")
    if step not in dump.array_steps():
        raise BadInput(f"{candidate_run}: its kernel dump holds step(s) {dump.array_steps()}, not the baseline's "
                       f"tensor step {step}")
    rows, _ = dump.tap_rows(step, rank)
    out: dict[str, dict[str, np.ndarray]] = {}
    for r in rows:
        key = _KINDS.get(r["kind"])
        if key is not None and r.get("ref"):
            out.setdefault(r["module"], {})[key] = load_npy(Path(r["ref"]))
    return out
