"""Findings -> DIR/report.html, DIR/summary.json, DIR/deltas.csv, DIR/figures/*.png.

The writer names no stage: the caller hands it the stages' results, the figures they declared (drawn here,
half in a forked child: reports.render), the rows of the step table and the stages summary.json always lists.
Everything is written into a fresh temporary folder beside DIR and moved in at the end, so a failure
leaves DIR as it was: never a half-written report.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from core.findings import StageResult, worst
from core.interrupts import committing
from core.outputs import check_no_symlinks, check_out_dir, temp_beside
from reports import html
from reports.render import Figure, render


@dataclass
class ReportInput:
    runs: list[dict[str, Any]]                  # role, path, kind, steps, notes
    stages: dict[str, StageResult]
    scalar_table: pd.DataFrame = field(default_factory=pd.DataFrame)   # -> deltas.csv
    figures: list[Figure] = field(default_factory=list)                # drawn in this order on the page
    step_rows: list[dict[str, Any]] = field(default_factory=list)      # stage, step, baseline, candidate, ...
    # stages summary.json always lists (a skipped entry when absent), each with these keys (null when absent)
    contract: dict[str, tuple[str, ...]] = field(default_factory=dict)
    extra_sections: list[tuple[str, str]] = field(default_factory=list)         # (title, html body)
    extra_tables: dict[str, pd.DataFrame] = field(default_factory=dict)         # file name -> table
    # the procedure's reading of the stages (align.procedure.diagnosis): root causes first, and what ran
    diagnosis: list[dict[str, Any]] = field(default_factory=list)
    coverage: dict[str, Any] = field(default_factory=dict)
    titles: dict[str, str] = field(default_factory=dict)          # stage name -> the title of its section
    stage_sections: dict[str, str] = field(default_factory=dict)  # stage name -> its own html (tables)


def overall_verdict(stages: dict[str, StageResult]) -> str:
    v = worst([s.verdict for s in stages.values() if s.verdict != "skipped"])
    return "warn" if v == "skipped" else v  # nothing compared is not a pass


def _clean(obj: Any) -> Any:
    """JSON has no NaN/Inf: write them as null so any JSON reader accepts the file."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if hasattr(obj, "item"):
        return _clean(obj.item())
    return obj


def _write_csv(table: pd.DataFrame, path: Path) -> None:
    """Per-step numbers as CSV. pyarrow's writer (every value exact, shortest round-trip form) is ~8x faster
    than numpy's savetxt on 100k-step tables; savetxt (10 significant digits) when pyarrow is absent."""
    header = ",".join(["step", *map(str, table.columns)])
    if importlib.util.find_spec("pyarrow") is not None:
        import pyarrow as pa
        import pyarrow.csv as pcsv

        cols = {"step": table.index.to_numpy(dtype=np.int64)}
        cols.update({f"c{i}": table[c].to_numpy(dtype=np.float64) for i, c in enumerate(table.columns)})
        with pa.OSFile(str(path), "wb") as fh:   # arrow's own file: its writes need no GIL (figures run)
            fh.write(header.encode() + b"\n")
            pcsv.write_csv(pa.table(cols), fh, pcsv.WriteOptions(include_header=False))
        return
    data = np.column_stack([table.index.to_numpy(dtype=np.float64), table.to_numpy(dtype=np.float64)])
    np.savetxt(path, data, fmt="%.10g", delimiter=",", header=header, comments="")


def summary(inp: ReportInput) -> dict[str, Any]:
    stages = dict(inp.stages)
    for name in inp.contract:
        stages.setdefault(name, StageResult(name, "skipped", {"reason": "no data for this stage"}))
    out_stages = {name: st.to_json() for name, st in stages.items()}
    for name, keys in inp.contract.items():
        for key in keys:
            out_stages[name].setdefault(key, None)
    return _clean({
        "verdict": overall_verdict(inp.stages),
        "diagnosis": inp.diagnosis,
        "coverage": inp.coverage,
        "stages": out_stages,
        "findings": [f.to_json() for st in stages.values() for f in st.findings],
        "runs": [{k: r[k] for k in ("role", "path", "kind", "steps", "notes") if k in r} for r in inp.runs],
    })


def write_report(inp: ReportInput, out: str | Path) -> dict[str, Any]:
    """Write the report into ``out``; an ``out`` that is a file or a dangling symlink, or a symlinked folder
    inside it, is refused (BadInput) before anything is written."""
    out = check_out_dir(out)
    tmp = temp_beside(out)
    try:
        data = summary(inp)
        figdir = tmp / "figures"
        figdir.mkdir()
        t = inp.scalar_table
        # the CSV is written beside the figures (pyarrow's writer releases the GIL)
        pngs = render([(figdir / f.file, functools.partial(f.draw, figdir / f.file)) for f in inp.figures],
                      alongside=functools.partial(_write_csv, t, tmp / "deltas.csv") if not t.empty else None)
        figs = [(f.title, png) for f, png in zip(inp.figures, pngs, strict=True) if png]
        for fname, table in inp.extra_tables.items():
            table.to_csv(tmp / fname, index=False)
        page = html.render(data["verdict"], inp.runs, inp.stages, figs, inp.step_rows, inp.extra_sections,
                           diagnosis=data["diagnosis"], coverage=data["coverage"], titles=inp.titles,
                           stage_sections=inp.stage_sections)
        (tmp / "report.html").write_text(page, encoding="utf-8")
        (tmp / "summary.json").write_text(json.dumps(data, indent=2), encoding="utf-8")
        files = sorted(tmp.rglob("*"))
        check_no_symlinks(out, [src.relative_to(tmp) / "x" if src.is_dir() else src.relative_to(tmp)
                                for src in files])
        with committing():     # no Ctrl-C half-way: the report is all there, or not there (core.interrupts)
            out.mkdir(exist_ok=True)
            for src in files:
                dst = out / src.relative_to(tmp)
                if src.is_dir():
                    dst.mkdir(exist_ok=True)
                else:
                    os.replace(src, dst)   # replaces a symlink named like the file; never writes through it
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return data
