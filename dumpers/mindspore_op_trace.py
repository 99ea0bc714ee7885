"""Candidate side of the operator drill-down: one MindSpore cell compiled (``mindspore.jit``) and run forward and
backward on the baseline's captured inputs and output gradient, under MindSpore's own kernel dump.

Why the kernel dump: MindSpore 2.10 runs most PYNATIVE operators (pyboost) without Python's
``Primitive.__call__``, so no Python-level interception sees the real cell's operators; the GRAPH kernel dump
(MINDSPORE_DUMP_CONFIG, saved_data ``tensor``: every kernel's inputs and outputs as .npy, forward and
``Gradients/...`` backward) does, on CPU. MindSpore reads the config once, at import: the run happens in a
fresh process whose environment names the config (:func:`write_dump_config`), and only the compiled cell's
graph is kept (the PYNATIVE forward that records the cell's own arguments may write graphs of its own).

Writes, under OUT: ``kernels/`` (a MindSpore dump root holding the cell's graph only, read by
sources.mindspore_dump) and ``returned.npz`` (``meta``: the cell, its inputs' plan, dtypes; ``output``,
``grad/<i>`` and ``weight_grad/<name>``: what the compiled cell returned, float32).
"""

from __future__ import annotations

import inspect
import json
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from dumpers.mindspore_backward_isolation import fit_input, make_vjp, plan_inputs, unfit_output
from dumpers.mindspore_isolation import ConstructPatches, first_tensor, mcore_forward
from runstore import atomic_file

NET_NAME = "Drill"


def write_dump_config(out: str | Path) -> Path:
    """The MINDSPORE_DUMP_CONFIG file of a drill run (every kernel's inputs and outputs as .npy, every iteration)
    under ``out``; returns its path. Set it in the environment of the process that imports MindSpore."""
    out = Path(out)
    raw = str((out / "raw").resolve())
    if not re.fullmatch(r"[A-Za-z0-9_/-]+", raw):
        raise ValueError(f"{raw}: MindSpore's dump path takes only letters, digits, '-', '_' and '/' (set TMPDIR "
                         "to such a folder)")
    cfg = {"common_dump_settings": {"dump_mode": 0, "path": raw, "net_name": NET_NAME,
                                    "iteration": "all", "saved_data": "tensor", "input_output": 0, "kernels": [],
                                    "support_device": [0, 1, 2, 3, 4, 5, 6, 7]},
           "e2e_dump_settings": {"enable": True, "trans_flag": True}}
    path = out / "dump_config.json"
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg))
    return path


class _Calls(ConstructPatches):
    """The first call's arguments of one cell (its ``construct`` wrapped on the instance)."""

    def __init__(self, cell: Any) -> None:
        super().__init__()
        self.call: tuple[tuple, dict, Any] | None = None
        inner = cell.construct
        try:
            self.names = [p.name for p in inspect.signature(inner).parameters.values()
                          if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        except (TypeError, ValueError):
            self.names = []

        def construct(*args: Any, **kwargs: Any) -> Any:
            out = inner(*args, **kwargs)
            if self.call is None:
                self.call = (args, dict(kwargs), out)
            return out

        self._patch(cell, construct)


def _files(raw: Path) -> set[Path]:
    """Every kernel file of the dump so far (rank_R/NET/graph/iteration/*.npy)."""
    return {p for p in raw.glob(f"rank_*/{NET_NAME}/*/*/*") if p.is_file()}


def _settled(raw: Path, before: set[Path], wait: float = 20.0) -> list[Path]:
    """The kernel files written since ``before``, once their number stops growing (the dump may be written
    after the call returns)."""
    import time

    last, still, t0 = -1, 0, time.monotonic()
    while time.monotonic() - t0 < wait:
        new = _files(raw) - before
        still = still + 1 if len(new) == last and new else 0
        if still >= 3:
            break
        last = len(new)
        time.sleep(0.2)
    return sorted(_files(raw) - before)


def _layout_only(cell: Any, module: str, arrays: Mapping[str, np.ndarray],
                 to_baseline: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None) -> list[str]:
    """The cell's weights that are the baseline's captured weights in the candidate's layout (the mapping's
    transform reversed gives them back exactly): an operator reading one departs by layout, not by value."""
    out = []
    for p in cell.trainable_params():
        a = p.asnumpy()
        try:
            conv = to_baseline({p.name: a}) if to_baseline else {p.name: a}
        except (KeyError, ValueError):
            continue
        if conv and all(f"weight/{module}/{b}" in arrays and np.array_equal(
                np.asarray(arrays[f"weight/{module}/{b}"], np.float32), np.asarray(c, np.float32))
                for b, c in conv.items()):
            out.append(p.name)
    return out


def run_cell_kernels(net: Any, cell: Any, module: str, capture: Mapping[str, Any],
                     arrays: Mapping[str, np.ndarray], out: str | Path, *, batch: Mapping[str, np.ndarray],
                     layouts: tuple[str | None, str | None] = (None, None),
                     forward: Callable[[Any, Mapping[str, np.ndarray]], Any] | None = None,
                     to_baseline: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None) -> Path:
    """Run ``cell`` (a cell of ``net``, the candidate of baseline ``module``) compiled, on the baseline's
    captured inputs (``capture``: the module's entry of the backward capture, ``arrays`` its arrays) and fed the
    baseline's output gradient; the cell's other arguments are its own from one PYNATIVE forward of ``net`` on
    ``batch``. Must run in the process whose MINDSPORE_DUMP_CONFIG is :func:`write_dump_config` (``out``).
    ``to_baseline``: candidate weight gradients -> the baseline's names and layouts (the mapping's transforms
    reversed), so the module's results are judged as the baseline holds them. Returns ``out/returned.npz``."""
    import mindspore as ms

    out = Path(out)
    raw = out / "raw"
    rec = _Calls(cell)
    try:
        (forward or mcore_forward)(net, batch)
    finally:
        rec.restore()
    if rec.call is None:
        raise ValueError(f"{module}: the candidate's cell was not called in its forward")
    args, kwargs, own_out = rec.call
    lay_b, lay_c = layouts
    slots, xs, listed, grad_keys = plan_inputs(capture["inputs"], arrays, module, args, kwargs, rec.names,
                                                lay_b, lay_c)
    if not slots:
        raise ValueError(f"{module}: none of the baseline's inputs fits the cell")
    y_own = first_tensor(own_out)
    g_b = np.asarray(arrays[f"grad_output/{module}"], np.float32)
    g = fit_input(g_b, tuple(y_own.shape), lay_b, lay_c)
    if g is None and g_b.size == int(np.prod(y_own.shape)) and g_b.size == 1:     # a scalar loss: () vs [1]
        g = g_b.reshape(tuple(y_own.shape))
    if g is None:
        raise ValueError(f"{module}: the baseline's output gradient does not fit the cell's output "
                         f"{list(y_own.shape)}")
    before = _files(raw)
    vjp = make_vjp(cell, args, kwargs, slots, True)
    y, gx, gw = vjp(xs, ms.Tensor(g).astype(y_own.dtype))
    y.asnumpy()
    ms.runtime.synchronize()
    new = _settled(raw, before)
    if not new:
        raise RuntimeError(f"{raw}: MindSpore wrote no kernel dump for the compiled cell (MINDSPORE_DUMP_CONFIG "
                           "not set before mindspore was imported?)")
    kernels = out / "kernels"
    shutil.rmtree(kernels, ignore_errors=True)
    for f in new:     # this call's kernel files only (the PYNATIVE forward may have written to the same graph
        dest = kernels / f.relative_to(raw)      # folders); their dump times order them (the execution order
        dest.parent.mkdir(parents=True, exist_ok=True)      # file lacks GRAPH's expanded kernels)
        shutil.copy2(f, dest)
    y_b = np.asarray(arrays[f"output/{module}"])
    res: dict[str, np.ndarray] = {"output": y.astype(ms.float32).asnumpy()}
    res[f"baseline/output/{module}"] = unfit_output(res["output"], tuple(y_b.shape), lay_c, lay_b)
    first = next((i["key"] for i in capture["inputs"] if i.get("grad")), None)
    for j, t in enumerate(gx):
        if t is not None:
            res[f"grad/{j}"] = t.astype(ms.float32).asnumpy()
            key = grad_keys[j] if j < len(grad_keys) else None
            if key is not None:
                base = np.asarray(arrays[f"grad_input/{module}/{key}"])
                g_j = res[f"grad/{j}"]
                res[f"baseline/grad_input/{module}/{key}"] = (
                    unfit_output(g_j, tuple(base.shape), lay_c, lay_b) if key == first else g_j)
    wg = {name: t.astype(ms.float32).asnumpy() for name, t in gw}
    for name, a in wg.items():
        res[f"weight_grad/{name}"] = a
    try:
        converted = to_baseline(wg) if to_baseline else {}
        not_converted = None
    except (KeyError, ValueError) as exc:      # judged on the output and input gradients only (said in meta)
        converted, not_converted = {}, " ".join(str(exc).split())[:200]
    for name, a in converted.items():
        res[f"baseline/grad_weight/{module}/{name}"] = a
    meta = {"module": module, "inputs": listed, "grad_keys": grad_keys, "dtype": str(y.dtype).lower(),
            "kernel_files": len(new), "layout_only": _layout_only(cell, module, arrays, to_baseline),
            "weight_grads_not_converted": not_converted}
    dest = out / "returned.npz"
    with atomic_file(dest) as fh:
        np.savez(fh, meta=np.array(json.dumps(meta)), **res)
    return dest
