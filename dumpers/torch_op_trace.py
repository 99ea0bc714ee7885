"""Baseline side of the operator drill-down: a captured module replayed under torch's dispatcher-level tracing.

Why dispatch level (``TorchDispatchMode``): it sees every aten operator the real module runs, forward and
the autograd engine's backward, with the very tensors it ran on, without touching the module's code (a
Python-level wrapper misses what C++ composites call). The replay uses what
``dumpers.torch_module_backward.ModuleBackwardCapture`` kept at the tensor step: the module's inputs by name,
its weights as it computed with them, its output gradient. So the trace shows the module as it ran in
training, operator by operator, on the same inputs the candidate's cell is given (`align drill`).

Use, in the baseline's process, after the capture was written (any later time, the module object alive):

    cap.end_step()                                  # RUN/evidence/module_backward/step_000001_rank_00000.npz
    trace_modules(model, "runs/baseline", step=1)   # RUN/evidence/op_trace/step_000001_rank_00000.npz

The file: ``meta`` (JSON: step, rank, per module its operators in execution order: name (``aten.mm.default``),
phase (forward / backward), inputs and outputs as array keys or scalars, dtype) and arrays
``<module>/<op index>/<in|out>/<slot>`` (floating tensors as float32: their dtype is in meta).
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dumpers.torch_module_backward import LOSS
from runstore import atomic_file
from runstore.layout import evidence_step_file

TRACE_DIR = "op_trace"
# aten operators that only re-label a tensor (no value computed, no layout change worth a row)
_SKIP = {"aten.detach.default", "aten.alias.default", "aten.lift_fresh.default", "aten._has_compatible_shallow_"
         "copy_type.default", "aten.is_same_size.default", "aten.empty.memory_format", "aten.empty_like.default",
         "aten.new_empty_strided.default", "aten.empty_strided.default", "aten.zeros.default",
         "aten.new_zeros.default"}


def trace_file(run_dir: str | Path, step: int, rank: int = 0) -> Path:
    """Where the operator trace of ``step`` on ``rank`` lives."""
    return evidence_step_file(run_dir, TRACE_DIR, step, rank)


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def _np(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.float()
    return t.cpu().contiguous().numpy().copy()


class _Tracer(TorchDispatchMode):
    """Every aten operator's inputs and outputs, in the order the dispatcher ran them."""

    def __init__(self, prefix: str, arrays: dict[str, np.ndarray]) -> None:
        super().__init__()
        self.prefix, self.arrays, self.ops, self.phase = prefix, arrays, [], "forward"

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = str(func)
        if name in _SKIP:
            return func(*args, **kwargs)
        inputs = self._inputs(func, f"{self.prefix}/{len(self.ops)}", args, kwargs)  # before an in-place op
        out = func(*args, **kwargs)
        self._record(name, inputs, out)
        return out

    def _leaf(self, v: Any, key: str) -> Any:
        if isinstance(v, torch.Tensor):
            if v.is_complex():
                return {"unsupported": "complex"}
            self.arrays[key] = _np(v)
            return {"t": key, "dtype": _dtype(v), "shape": list(v.shape)}
        if isinstance(v, (bool, int, float, str)) or v is None:
            return {"v": v}
        if isinstance(v, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
            return {"v": str(v).replace("torch.", "")}
        if isinstance(v, (list, tuple)) and all(isinstance(x, (int, float, bool)) for x in v):
            return {"v": list(v)}
        return {"v": repr(v)[:80]}

    def _inputs(self, func: Any, base: str, args: tuple, kwargs: dict) -> dict[str, Any]:
        schema = [a.name for a in func._schema.arguments]
        named: dict[str, Any] = {}
        for j, a in enumerate(args):
            named[schema[j] if j < len(schema) else str(j)] = a
        named.update(kwargs)
        inputs: dict[str, Any] = {}
        for k, v in named.items():
            if isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v):
                inputs[k] = [self._leaf(x, f"{base}/in/{k}.{n}") for n, x in enumerate(v)]
            else:
                inputs[k] = self._leaf(v, f"{base}/in/{k}")
        return inputs

    def _record(self, name: str, inputs: dict[str, Any], out: Any) -> None:
        i = len(self.ops)
        base = f"{self.prefix}/{i}"
        outs, _ = tree_flatten(out)
        outputs = [self._leaf(o, f"{base}/out/{n}") for n, o in enumerate(outs) if isinstance(o, torch.Tensor)]
        dt = next((o["dtype"] for o in outputs if "dtype" in o), None)
        self.ops.append({"index": i, "name": name, "phase": self.phase, "inputs": inputs, "outputs": outputs,
                         "dtype": dt})


def trace_module(name: str, mod: torch.nn.Module, meta: dict[str, Any], arrays: dict[str, np.ndarray],
                 out: dict[str, np.ndarray]) -> dict[str, Any]:
    """Replay one captured module (``meta``: its entry in the backward capture, ``arrays``: the capture's arrays)
    forward and backward under the tracer; its arrays are added to ``out``; returns its meta entry. The module's
    weights are the captured ones during the replay and are put back after it."""
    params = dict(mod.named_parameters())
    saved = {}
    for pname in meta.get("params", []):
        local = pname[len(name) + 1:]
        key = f"weight/{name}/{pname}"
        if local in params and key in arrays:
            saved[local] = params[local].detach().clone()
    dev_dtype = {k: (p.device, p.dtype) for k, p in params.items()}
    kwargs: dict[str, Any] = {}
    leaves = []
    for inp in meta["inputs"]:
        a = arrays[f"input/{name}/{inp['key']}"]
        t = torch.from_numpy(np.ascontiguousarray(a)).to(getattr(torch, inp["dtype"]))
        if inp.get("grad"):
            t.requires_grad_(True)
            leaves.append(t)
        kwargs[inp["key"]] = t
    tracer = _Tracer(name, out)
    try:
        with torch.no_grad():
            for local in saved:
                w = arrays[f"weight/{name}/{name}.{local}"]
                params[local].copy_(torch.from_numpy(w).to(*dev_dtype[local]))
        targets = leaves + [params[p[len(name) + 1:]] for p in meta.get("params", [])
                            if p[len(name) + 1:] in params]
        with torch.enable_grad(), tracer:
            res = mod(**kwargs)
            y = res if isinstance(res, torch.Tensor) else next(t for t in tree_flatten(res)[0]
                                                              if isinstance(t, torch.Tensor))
            tracer.phase = "backward"
            g = torch.from_numpy(arrays[f"grad_output/{name}"]).to(y.dtype)
            torch.autograd.grad(y, targets, grad_outputs=g, allow_unused=True)
    finally:
        with torch.no_grad():
            for local, w in saved.items():
                params[local].copy_(w)
    return {"module": name, "ops": tracer.ops, "inputs": meta["inputs"], "params": meta.get("params", []),
            "dtype": meta.get("dtype")}


def trace_loss(owner: torch.nn.Module, meta: dict[str, Any], arrays: dict[str, np.ndarray],
               out: dict[str, np.ndarray]) -> dict[str, Any]:
    """The loss as the capture replays it (dumpers.torch_module_backward: Megatron's own
    ``compute_language_model_loss``, then the masked mean) on the captured logits, labels and loss_mask, fed the
    captured output gradient, under the tracer."""
    logits = torch.from_numpy(np.ascontiguousarray(arrays[f"input/{LOSS}/logits"])).requires_grad_(True)
    labels = torch.from_numpy(np.ascontiguousarray(arrays[f"input/{LOSS}/labels"]))
    mask = torch.from_numpy(np.ascontiguousarray(arrays[f"input/{LOSS}/loss_mask"])).float()
    tracer = _Tracer(LOSS, out)
    with torch.enable_grad(), tracer:
        per_token = owner.compute_language_model_loss(labels, logits.clone())
        loss = (per_token.float() * mask).sum() / mask.sum()
        tracer.phase = "backward"
        torch.autograd.grad(loss, [logits], grad_outputs=torch.tensor(float(arrays[f"grad_output/{LOSS}"])))
    return {"module": LOSS, "ops": tracer.ops, "inputs": meta["inputs"], "params": [], "dtype": meta.get("dtype")}


def trace_modules(model: torch.nn.Module | Sequence[torch.nn.Module], run_dir: str | Path, step: int,
                  modules: Sequence[str] | None = None, rank: int = 0) -> Path:
    """Trace each module of the backward capture at ``step`` (those matching ``modules``, fnmatch; default all)
    on the live ``model`` (the modules found by their global names); writes and returns the trace file."""
    from dumpers.megatron import global_namer
    from dumpers.torch_module_backward import backward_file

    src = backward_file(run_dir, step, rank)
    if not src.is_file():
        raise ValueError(f"{src}: no module backward capture at step {step} "
                         "(dumpers.torch_module_backward.ModuleBackwardCapture)")
    with np.load(src, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    cap = json.loads(str(arrays.pop("meta")))
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    found: dict[str, torch.nn.Module] = {}
    for chunk in chunks:
        name_of = global_namer(chunk)
        for n, mod in chunk.named_modules():
            g = name_of(n)
            if g:
                found.setdefault(g, mod)
    out: dict[str, np.ndarray] = {}
    traced, skipped = [], []
    for entry in cap["modules"]:
        name = entry["module"]
        if modules is not None and not any(fnmatch.fnmatchcase(name, p) for p in modules):
            continue
        if name == LOSS:
            owner = next((m for c in chunks for m in c.modules()
                          if hasattr(m, "compute_language_model_loss") and getattr(m, "post_process", True)), None)
            if owner is None:
                skipped.append({"module": name, "reason": "no module computes the language-model loss"})
            else:
                traced.append(trace_loss(owner, entry, arrays, out))
            continue
        if name not in found:
            skipped.append({"module": name, "reason": "no such module in the model"})
            continue
        traced.append(trace_module(name, found[name], entry, arrays, out))
    if not traced:
        raise ValueError(f"{src}: none of the captured modules was traced ({skipped[:1] or 'none selected'})")
    dest = trace_file(run_dir, step, rank)
    with atomic_file(dest) as fh:
        np.savez(fh, meta=np.array(json.dumps({"step": int(step), "rank": int(rank), "modules": traced,
                                               "skipped": skipped})), **out)
    return dest
