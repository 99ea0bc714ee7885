"""Findings -> DIR/report.html, DIR/summary.json, DIR/deltas.csv, DIR/figures/*.png.

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
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from core.errors import BadInput
from core.findings import StageResult, worst
from core.outputs import check_no_symlinks, check_out_dir
from reports import figures, html
from reports.render import render

CONTRACT_STAGES = ("step1_loss", "step1_local_norm", "step2_loss", "long_run")


@dataclass
class ReportInput:
    runs: list[dict[str, Any]]                  # role, path, kind, steps, notes
    stages: dict[str, StageResult]
    scalar_table: pd.DataFrame = field(default_factory=pd.DataFrame)
    extra_figures: list[tuple[str, str, bytes]] = field(default_factory=list)   # (file, title, png)
    extra_sections: list[tuple[str, str]] = field(default_factory=list)         # (title, html body)
    extra_tables: dict[str, pd.DataFrame] = field(default_factory=dict)         # file name -> table


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
    for name in CONTRACT_STAGES:
        stages.setdefault(name, StageResult(name, "skipped", {"reason": "no data for this stage"}))
    out_stages = {name: st.to_json() for name, st in stages.items()}
    lr = out_stages["long_run"]
    for key in ("steps", "outside_band_fraction", "mean_delta", "divergence_step"):
        lr.setdefault(key, None)
    return _clean({
        "verdict": overall_verdict(inp.stages),
        "stages": out_stages,
        "findings": [f.to_json() for st in stages.values() for f in st.findings],
        "runs": [{k: r[k] for k in ("role", "path", "kind", "steps", "notes") if k in r} for r in inp.runs],
    })


def write_report(inp: ReportInput, out: str | Path) -> dict[str, Any]:
    """Write the report into ``out``; an ``out`` that is a file or a dangling symlink, or a symlinked folder
    inside it, is refused (BadInput) before anything is written."""
    out = check_out_dir(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    except OSError as exc:
        raise BadInput(f"{out}: cannot write there ({exc.strerror or exc.__class__.__name__})") from None
    try:
        data = summary(inp)
        figdir = tmp / "figures"
        figdir.mkdir()
        figs: list[tuple[str, bytes]] = []
        labels = {r["role"]: f"{r['role']}: {Path(r['path']).name}" for r in inp.runs}
        long_run = inp.stages.get("long_run")
        nonfinite = inp.stages.get("nonfinite")
        nf_step = None
        if nonfinite is not None:
            steps = [v["step"] for v in nonfinite.details.get("first_nonfinite", {}).values()]
            nf_step = min(steps) if steps else None
        t = inp.scalar_table
        jobs: list[tuple[str, Path, Callable[[Path], bytes | None]]] = []   # (title, file, draw it there)
        if not t.empty:
            lv = long_run.verdict if long_run else "skipped"
            g = inp.stages.get("grad_norm")
            gv = g.verdict if g else "skipped"
            figures.warm()   # before the fork: the child inherits the built curve figure
            jobs += [
                ("Loss curves", figdir / "loss.png",
                 lambda p: figures.loss_curves(t, labels, lv, p)),
                ("Loss delta against the band", figdir / "loss_delta_band.png",
                 lambda p: figures.delta_band(t, lv, p, long_run.details.get("divergence_step") if long_run
                                              else None, nf_step)),
                ("Grad norm curves", figdir / "grad_norm.png",
                 lambda p: figures.loss_curves(t, labels, gv, p, title="Grad norm", prefix="grad_norm_")),
                ("Grad norm delta against the band", figdir / "grad_norm_delta_band.png",
                 lambda p: figures.delta_band(t, gv, p, g.details.get("divergence_step") if g else None, nf_step,
                                              title="Grad norm delta", prefix="grad_norm_"))]
        ln = inp.stages.get("step1_local_norm")
        if ln is not None and ln.details.get("parameters"):
            jobs.append(("Step-1 local norms per parameter", figdir / "local_norms.png",
                         lambda p: figures.local_norm_chart(ln.details["parameters"],
                                                            float(ln.details.get("rtol", 1e-4)), ln.verdict, p)))
        lt = inp.stages.get("layer_tensors")
        if lt is not None and lt.details.get("rows"):
            jobs.append(("Layer profile (red: beyond the dtype's tolerance)", figdir / "layer_profile.png",
                         lambda p: figures.layer_profile(lt.details["rows"], lt.verdict, p)))
        # the CSV is written beside the figures (pyarrow's writer releases the GIL)
        pngs = render([(path, functools.partial(draw, path)) for _, path, draw in jobs],
                      alongside=functools.partial(_write_csv, t, tmp / "deltas.csv") if not t.empty else None)
        figs += [(title, png) for (title, _, _), png in zip(jobs, pngs, strict=True) if png]
        for fname, title, png in inp.extra_figures:
            (figdir / fname).write_bytes(png)
            figs.append((title, png))
        for fname, table in inp.extra_tables.items():
            table.to_csv(tmp / fname, index=False)
        step_rows = []
        for name in ("step1_loss", "step2_loss"):
            st = inp.stages.get(name)
            if st is not None and st.verdict != "skipped":
                step_rows.append({"stage": name, "verdict": st.verdict, **st.details})
        page = html.render(data["verdict"], inp.runs, inp.stages, figs, step_rows, inp.extra_sections)
        (tmp / "report.html").write_text(page, encoding="utf-8")
        (tmp / "summary.json").write_text(json.dumps(data, indent=2), encoding="utf-8")
        files = sorted(tmp.rglob("*"))
        check_no_symlinks(out, [src.relative_to(tmp) / "x" if src.is_dir() else src.relative_to(tmp)
                                for src in files])
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
