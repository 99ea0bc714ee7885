"""`align drill`'s judging half: the baseline's aten trace and the candidate's kernel dump of one module, compared
operator by operator (comparators.operators); writes DIR/operators.csv and DIR/drill.json and returns the few
lines the terminal shows.

Framework-free: the candidate's kernels come from a MindSpore dump folder (sources.mindspore_dump), the
baseline's operators from the trace file dumpers.torch_op_trace wrote in the baseline's process.
"""

from __future__ import annotations

import csv
import io
import json
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from comparators.operators import drill, mindspore_leaves, mindspore_ops, torch_ops
from core.dtypes import coarsest
from core.errors import BadInput
from core.outputs import temp_beside
from runstore.layout import evidence_step_file, evidence_steps

# where dumpers.torch_op_trace writes (kept here too: that module imports torch at its top)
TRACE_DIR = "op_trace"


def trace_path(store: str | Path, step: int, rank: int = 0) -> Path:
    """The baseline's operator trace of ``step`` on ``rank`` (dumpers.torch_op_trace.trace_file)."""
    return evidence_step_file(store, TRACE_DIR, step, rank)


def trace_steps(store: str | Path, rank: int = 0) -> list[int]:
    return evidence_steps(store, TRACE_DIR, rank)


def read_trace(store: str | Path, step: int | None, rank: int, module: str
               ) -> tuple[int, dict[str, Any], dict[str, np.ndarray]]:
    """(step, the module's trace entry, arrays) of the baseline's operator trace; BadInput in one line."""
    if step is None:
        steps = trace_steps(store, rank)
        if not steps:
            raise BadInput(f"{store}: no operator trace (dumpers.torch_op_trace.trace_modules, after the module "
                           "backward capture)")
        step = steps[0]
    path = trace_path(store, step, rank)
    if not path.is_file():
        raise BadInput(f"{path}: no operator trace at step {step} (dumpers.torch_op_trace.trace_modules)")
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        meta = json.loads(str(arrays.pop("meta")))
        mods = {m["module"]: m for m in meta["modules"]}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError, TypeError) as exc:
        raise BadInput(f"{path}: not an operator trace ({' '.join(str(exc).split())[:80]})") from None
    if module not in mods:
        raise BadInput(f"{path}: module {module} was not traced (traced: {', '.join(sorted(mods)[:6])})")
    return int(step), mods[module], arrays


def read_returned(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    return json.loads(str(arrays.pop("meta"))), arrays


_CSV = ("side", "index", "op", "kind", "phase", "dtype", "shape", "own_error", "own_line", "own_verdict",
        "matched_baseline", "match_error", "departure", "inherits_from", "note")


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.3e}"
    return str(v)


def module_results(capture: dict[str, np.ndarray], module: str, returned: dict[str, np.ndarray], dtype: str
                   ) -> list[dict[str, Any]]:
    """The module's results (output, input gradients, weight gradients) against the baseline's capture, in the
    baseline's names and layouts: rel L2, judged at the dtype's pass line (comparators.tensor_pair.TOLERANCE)."""
    from comparators.tensor_pair import tolerance

    line = tolerance(dtype)[0]
    out = []
    for key, cand in sorted(returned.items()):
        if not key.startswith("baseline/"):
            continue
        what = key[len("baseline/"):]
        base = capture.get(what)
        if base is None or base.size != cand.size:
            out.append({"result": what, "rel_l2": None, "line": line, "verdict": "not compared",
                        "why": "no baseline tensor of that size"})
            continue
        b = np.asarray(base, np.float64).reshape(-1)
        e = float(np.linalg.norm(np.asarray(cand, np.float64).reshape(-1) - b) / max(np.linalg.norm(b), 1e-30))
        out.append({"result": what.replace(f"/{module}", "", 1), "rel_l2": e, "line": line,
                    "verdict": "pass" if e <= line else "fail"})
    return out


def write_drill(out: str | Path, module: str, step: int, trace: dict[str, Any], trace_arrays: dict[str, np.ndarray],
                kernels_dir: str | Path, returned: str | Path, capture: dict[str, np.ndarray], *,
                candidate: str | None = None, dtype: str | None = None, timings: dict[str, float] | None = None
                ) -> tuple[dict[str, Any], list[str]]:
    """Compare and write DIR/operators.csv and DIR/drill.json (moved into place together); returns (the drill
    result without its rows, the terminal summary lines). ``dtype``: a precision coarser than the module's own
    that the candidate computes in by design (MindFormers' attention rounds q/k/v through float16), judged
    against its lines."""
    from sources.mindspore_dump import open_mindspore_dump

    base_ops = torch_ops(trace, trace_arrays)
    dump = open_mindspore_dump(kernels_dir)
    steps = dump.array_steps()
    kernels = dump.kernels(steps[-1], dump.array_ranks(steps[-1])[0])
    cand_ops = mindspore_ops(kernels)
    rmeta, rarr = read_returned(Path(returned))
    line_dtype = coarsest([trace.get("dtype") or "float32", *([dtype] if dtype else [])])
    results = module_results(capture, module, rarr, line_dtype)
    differs = any(r["verdict"] != "pass" for r in results)
    leaves = mindspore_leaves(kernels)
    layout = {n.replace(".", "_") for n in rmeta.get("layout_only") or []}
    first = next((i for i in trace.get("inputs") or [] if i.get("grad") and len(i.get("shape") or []) == 3), None)
    res = drill(base_ops, cand_ops, dtype=line_dtype, leaves=list(leaves.values()),
                tokens=(int(first["shape"][0]), int(first["shape"][1])) if first else None,
                layout_leaves=[a for n, a in leaves.items() if n in layout],
                terminals=[v for k, v in rarr.items() if not k.startswith("baseline/")])
    if not differs:         # the module's results agree (in the baseline's names and layouts): nothing to name
        res["named"] = []
    verdict = "fail" if differs else "pass"
    result = {"module": module, "candidate_cell": candidate, "step": step, "verdict": verdict,
              "dtype": res["dtype"], "own_line": res["own_line"], "match_line": res["match_line"],
              "module_differs": differs, "results": results, "unmatched_results": res["unmatched_results"],
              "named": res["named"], "counts": res["counts"], "inputs": rmeta.get("inputs"),
              "seconds": timings or {}}
    out = Path(out)
    tmp = temp_beside(out)
    try:
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(_CSV)
        for r in res["rows"]:
            m = r.get("match")
            w.writerow([_fmt(r["side"]), r["index"], r["op"], r["kind"], r["phase"], _fmt(r["dtype"]),
                        "x".join(map(str, r["shape"] or [])), _fmt(r["own_error"]), _fmt(r["own_line"]),
                        _fmt(r["own_verdict"]), m[0] if m else "", _fmt(m[1]) if m else "",
                        _fmt(r.get("departure")), " ".join(map(str, r.get("inherits_from") or [])),
                        _fmt(r.get("note"))])
        (tmp / "operators.csv").write_text(buf.getvalue(), encoding="utf-8")
        (tmp / "drill.json").write_text(json.dumps(result, indent=1, default=float), encoding="utf-8")
        out.mkdir(parents=True, exist_ok=True)
        for name in ("operators.csv", "drill.json"):
            (tmp / name).replace(out / name)
    finally:
        for p in tmp.glob("*"):
            p.unlink()
        tmp.rmdir()
    return result, summary_lines(result)


def summary_lines(result: dict[str, Any]) -> list[str]:
    """The few lines the terminal shows."""
    c = result["counts"]
    lines = [f"drill {result['module']} (step {result['step']}, {result['dtype']}): {c['baseline']} baseline "
             f"operators, {c['candidate']} candidate kernels, {c['matched']} matched by value -> "
             f"{result['verdict'].upper()}"]
    worst = max((r for r in result["results"] if r["rel_l2"] is not None), key=lambda r: r["rel_l2"], default=None)
    if worst is not None:
        lines.append(f"  module results: {len(result['results'])}, worst {worst['result']} rel L2 "
                     f"{worst['rel_l2']:.2e} (line {worst['line']:.0e})")
    if not result["named"]:
        lines.append("no operator departs: the module's results match the baseline's" if not result["module_differs"]
                     else "the module's results differ but no operator's own or semantic error accounts for it: "
                          f"see operators.csv ({', '.join(result['unmatched_results'][:3])})")
    for n in result["named"][:4]:
        own = "n/a" if n["own_error"] is None else f"{n['own_error']:.2e}"
        cross = "n/a" if n["cross_error"] is None else f"{n['cross_error']:.2e}"
        lines.append(f"  {n['phase']} {n['op']} [{n['dtype']}]: {n['why']}; own error {own} (line "
                     f"{n['own_line']:.1e}), vs baseline {cross} (line {n['cross_line']:.0e})"
                     + (f", stands for {n['baseline_op']}" if n.get("baseline_op") else ""))
    if len(result["named"]) > 4:
        lines.append(f"  ... {len(result['named']) - 4} more in drill.json")
    return lines
