"""Baseline side of backward isolation when the baseline is MindSpore (a MindFormers run checked against a torch
re-implementation, or a new MindSpore version against the old): each chosen cell's inputs, output gradient and
its own input and weight gradients at one step, in the format of dumpers.torch_module_backward, so
dumpers.torch_isolation can run the torch candidate's modules on them.

Why a forward and backward of its own: a GRAPH training step runs no Python inside; this runs the network once
more in PYNATIVE on the step's batch with the step's weights (before the update), records each chosen cell's
call (its ``construct`` wrapped) and its output gradient (a tensor hook), then replays each cell's
vector-Jacobian product on them (dumpers.mindspore_backward_isolation's machinery). Nothing is updated.

    capture_module_backward(net, "runs/ms_baseline", ["decoder.layers.?", "decoder.layers.?.*"], step=1,
                            batch=batch)   # net in PYNATIVE, its weights of step 1
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dumpers.mindspore_backward_isolation import BACKWARD_DIR, _GradRecorder, _slots, make_vjp
from dumpers.mindspore_isolation import _cell_index, first_tensor, mcore_forward
from runstore import atomic_file
from runstore.layout import evidence_step_file


def _np(t: Any) -> np.ndarray:
    import mindspore as ms

    return (t.astype(ms.float32) if t.dtype in (ms.float16, ms.bfloat16) else t).asnumpy().copy()


def _chosen(net: Any, modules: Sequence[str]) -> dict[str, Any]:
    """name -> cell of the cells whose name, or whose name without its first wrapper prefix (``model.`` of a
    MindFormers ``Training*ForCausalLM``), matches a pattern; named that way."""
    out = {}
    for name, cell in _cell_index(net).items():
        for n in (name, name.split(".", 1)[1] if "." in name else None):
            if n and any(fnmatch.fnmatchcase(n, p) for p in modules):
                out.setdefault(n, cell)
                break
    return out


def capture_module_backward(net: Any, run_dir: str | Path, modules: Sequence[str], *, step: int,
                            batch: Mapping[str, np.ndarray], rank: int = 0,
                            forward: Callable[[Any, Mapping[str, np.ndarray]], Any] | None = None) -> Path:
    """Write ``RUN/evidence/module_backward/step_N_rank_R.npz`` for ``net`` (PYNATIVE) on ``batch``."""
    import mindspore as ms

    if ms.get_context("mode") != ms.PYNATIVE_MODE:
        raise ValueError("the capture calls cells one by one: run it in PYNATIVE")
    cells = _chosen(net, modules)
    if not cells:
        raise ValueError(f"no cell matches {list(modules)}")
    rec = _GradRecorder(cells)
    try:
        ms.grad(lambda: first_tensor((forward or mcore_forward)(net, batch)), grad_position=None,
                weights=net.trainable_params())()
    finally:
        rec.restore()
    arrays: dict[str, np.ndarray] = {}
    mods, skipped = [], []
    for name, cell in cells.items():
        if name not in rec.calls or name not in rec.grad_out:
            skipped.append({"module": name, "reason": "not called" if name not in rec.calls else
                            "its output got no gradient"})
            continue
        args, kwargs, out = rec.calls[name]
        slots = _slots(args, kwargs, rec.signatures[name])
        floats = (ms.float16, ms.bfloat16, ms.float32, ms.float64)
        grad_slots = [(key, where) for key, where in slots.items()
                      if (args[where[1]] if where[0] == "arg" else kwargs[where[1]]).dtype in floats]
        try:
            vjp = make_vjp(cell, args, kwargs, [w for _, w in grad_slots], graph=False)
            xs = [args[w[1]] if w[0] == "arg" else kwargs[w[1]] for _, w in grad_slots]
            y, gx, gw = vjp(xs, ms.Tensor(rec.grad_out[name]).astype(first_tensor(out).dtype))
        except (ValueError, TypeError, RuntimeError) as exc:
            skipped.append({"module": name, "reason": f"replay failed: {type(exc).__name__}: "
                            f"{' '.join(str(exc).split())[:200]}"})
            continue
        inputs = []
        for key, (where, k) in slots.items():
            t = args[k] if where == "arg" else kwargs[k]
            arrays[f"input/{name}/{key}"] = _np(t)
            inputs.append({"key": key, "dtype": str(t.dtype).lower(), "shape": list(t.shape),
                           "grad": any(key == g for g, _ in grad_slots)})
        for (key, _), g in zip(grad_slots, gx, strict=True):
            if g is not None:
                arrays[f"grad_input/{name}/{key}"] = _np(g)
        arrays[f"output/{name}"] = _np(first_tensor(out))
        arrays[f"grad_output/{name}"] = rec.grad_out[name].astype(np.float32)
        params = {p.name: p for p in cell.trainable_params()}
        used = []
        for pname, g in gw:
            arrays[f"grad_weight/{name}/{pname}"] = _np(g)
            arrays[f"weight/{name}/{pname}"] = _np(params[pname])
            used.append(pname)
        replay = float(np.linalg.norm(_np(y) - arrays[f"output/{name}"]) /
                       max(float(np.linalg.norm(arrays[f"output/{name}"])), 1e-30))
        mods.append({"module": name, "inputs": inputs, "params": used, "dtype": str(y.dtype).lower(),
                     "replay_rel_l2": replay})
    meta = {"step": int(step), "rank": int(rank), "framework": "mindspore", "modules": mods, "skipped": skipped}
    dest = evidence_step_file(run_dir, BACKWARD_DIR, step, rank)
    with atomic_file(dest) as fh:
        np.savez(fh, meta=np.array(json.dumps(meta)), **arrays)
    return dest
