"""Single-module isolation with a PyTorch candidate (a MindSpore baseline): each chosen torch module run on the
baseline's captured inputs and fed its output gradient; output, input gradients and weight gradients against
the baseline's, each as own vs inherited. The mirror of dumpers.mindspore_backward_isolation.

Why: either side may be the one that is wrong; a MindFormers run that trained well is checked against a torch
port (or Megatron against a MindSpore reference) the same way. Baseline: dumpers.mindspore_module_backward's
capture (same file format as dumpers.torch_module_backward). Candidate: the torch model with its weights of
that step; ``forward(model, batch)`` returns its loss on the step's batch (its own forward and backward give
each module's own inputs and output gradient, through forward hooks and tensor hooks; ``torch.autograd.grad``,
so no ``.grad`` is touched). Names and layouts: the mapping oriented MindFormers -> Megatron
(``Mapping.swapped``); weight gradients compared in the baseline's (MindFormers') names and layouts.
Writes ``OUT/evidence/isolation.npz`` as the MindSpore side does; ``align report --isolation OUT`` judges it.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dumpers.isolation_rows import add_weight_grads, compute_dtype, computes_attention, result_row
from dumpers.mindspore_backward_isolation import backward_capture
from dumpers.mindspore_isolation import _rel_l2, mapped_modules, to_layout
from runstore import EVIDENCE_DIR, ISOLATION_EVIDENCE, atomic_file


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().cpu().numpy().copy()


def _first(obj: Any) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, (tuple, list)):
        return next((t for t in map(_first, obj) if t is not None), None)
    return None


def _names(mod: torch.nn.Module) -> list[str]:
    try:
        return [p.name for p in inspect.signature(mod.forward).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return []


def _vjp(mod: torch.nn.Module, args: tuple, kwargs: dict, slots: list[tuple[str, Any]], xs: list[torch.Tensor],
         sens: torch.Tensor) -> tuple[torch.Tensor, list, list[tuple[str, torch.Tensor | None]]]:
    """(output, input grads, (local parameter name, grad)) of ``mod`` called as recorded with ``xs`` at ``slots``."""
    leaves = [x.detach().clone().requires_grad_(True) for x in xs]
    a, k = list(args), dict(kwargs)
    for (where, key), leaf in zip(slots, leaves, strict=True):
        if where == "arg":
            a[key] = leaf.clone()
        else:
            k[key] = leaf.clone()
    params = [(n, p) for n, p in mod.named_parameters() if p.requires_grad]
    with torch.enable_grad():
        out = _first(mod(*a, **k))
        assert out is not None
        grads = torch.autograd.grad(out, leaves + [p for _, p in params], grad_outputs=sens.to(out.dtype),
                                    allow_unused=True)
    return out.detach(), list(grads[:len(leaves)]), [(n, g) for (n, _), g in zip(params, grads[len(leaves):],
                                                                                  strict=True)]


def isolate_torch_modules(model: torch.nn.Module, baseline: str | Path, out: str | Path, *, mapping: Any,
                          forward: Callable[[torch.nn.Module, Mapping[str, Any]], torch.Tensor],
                          batch: Mapping[str, Any], step: int | None = None, rank: int = 0,
                          modules: Sequence[str] | None = None, params: Any = None,
                          dtype: str | None = None, weights: str | None = None) -> Path:
    """Forward and backward isolation of ``model``'s modules (the candidate) against a MindSpore baseline's
    module backward capture. ``mapping``: the preset or Mapping as written (Megatron -> MindFormers); it is
    used swapped. ``params``: TransformParams for the weight layouts. Returns ``OUT/evidence/isolation.npz``."""
    from dumpers.megatron import global_namer
    from mapping import Mapping as NameMapping
    from mapping import TransformParams
    from models import load_mapping

    m = (mapping if isinstance(mapping, NameMapping) else load_mapping(mapping)).swapped()
    params = params or TransformParams()
    lay_b, lay_c = m.activation_layout.get("baseline"), m.activation_layout.get("candidate")
    step, bmeta, barr = backward_capture(baseline, step, rank, writer="dumpers.mindspore_module_backward")
    name_of = global_namer(model)
    mods = {name_of(n): mod for n, mod in model.named_modules() if n}
    chosen, skipped = {}, list(bmeta.get("skipped") or [])
    for e, name, cand in mapped_modules(bmeta["modules"], m, modules, skipped):
        if cand not in mods:
            skipped.append({"module": name, "reason": f"the candidate has no module {cand}"})
            continue
        chosen[name] = (e, cand, mods[cand])
    if not chosen:
        raise ValueError(f"{baseline}: none of the captured modules maps to a candidate module")
    calls: dict[str, dict[str, Any]] = {}

    def hook(name: str):  # noqa: ANN202
        def fn(mod: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if name in calls or _first(output) is None:
                return
            call = {"args": tuple(a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args),
                    "kwargs": {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()},
                    "output": _first(output).detach().clone(), "grad": None}
            calls[name] = call
            if _first(output).requires_grad:
                def grab(g: torch.Tensor) -> None:
                    call["grad"] = g.detach().clone()
                _first(output).register_hook(grab)
        return fn

    handles = [mod.register_forward_hook(hook(name), with_kwargs=True) for name, (_, _, mod) in chosen.items()]
    try:
        loss = forward(model, batch)
        torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad], allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    arrays: dict[str, np.ndarray] = {}
    pairs = []
    for name, (e, cand, mod) in chosen.items():
        call = calls.get(name)
        if call is None or call["grad"] is None:
            skipped.append({"module": name, "reason": f"{cand} was not called, or got no gradient"})
            continue
        try:
            pairs.append(_one(name, cand, mod, e, call, barr, arrays, m, params, lay_b, lay_c))
        except (ValueError, TypeError, RuntimeError) as exc:
            skipped.append({"module": name, "reason": f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"})
    if not pairs:
        raise ValueError(f"{baseline}: no module could be isolated: "
                         + "; ".join(f"{s['module']}: {s['reason']}" for s in skipped[:3]))
    meta = {"step": step, "rank": rank, "baseline": str(baseline), "mapping": m.name, "dtype": dtype,
            "weights": weights, "backward": True, "mode": "torch", "candidate_framework": "torch",
            "layout": {"baseline": lay_b, "candidate": lay_c}, "modules": pairs, "skipped": skipped}
    dest = Path(out) / EVIDENCE_DIR / ISOLATION_EVIDENCE
    dest.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(dest) as fh:
        np.savez(fh, meta=np.array(json.dumps(meta)), **arrays)
    return dest


def _one(name: str, cand: str, mod: torch.nn.Module, e: dict[str, Any], call: dict[str, Any],
         barr: Mapping[str, np.ndarray], arrays: dict[str, np.ndarray], m: Any, params: Any,
         lay_b: str | None, lay_c: str | None) -> dict[str, Any]:
    args, kwargs = call["args"], call["kwargs"]
    names = _names(mod)
    slots_by_name: dict[str, tuple[str, Any]] = {}
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            slots_by_name[names[i] if i < len(names) else str(i)] = ("arg", i)
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor):
            slots_by_name[k] = ("kw", k)
    first_c = next(iter(slots_by_name), None)
    first_b = next((i["key"] for i in e["inputs"] if i.get("grad")), None)
    slots, xs, own_xs, listed, grad_keys = [], [], [], [], []
    for inp in e["inputs"]:
        key = inp["key"]
        target = first_c if key == first_b else (key if key in slots_by_name else None)
        if target is None:
            listed.append({"key": key, "source": "none", "why": "the candidate's module takes no such tensor"})
            continue
        where, k = slots_by_name[target]
        own = args[k] if where == "arg" else kwargs[k]
        base = barr[f"input/{name}/{key}"]
        val = to_layout(base, lay_b, lay_c) if key == first_b else base
        if tuple(own.shape) != val.shape:
            listed.append({"key": key, "source": "candidate", "why": f"shape {list(val.shape)} vs {list(own.shape)}"})
            continue
        x = torch.from_numpy(np.ascontiguousarray(val)).to(own.dtype)
        listed.append({"key": key, "source": "baseline", "candidate_arg": target,
                       "own_rel_l2": _rel_l2(_np(own), _np(x))})
        slots.append((where, k))
        xs.append(x)
        own_xs.append(own)
        grad_keys.append(key if inp.get("grad") and own.is_floating_point() and
                         f"grad_input/{name}/{key}" in barr else None)
    if not slots:
        raise ValueError("none of the baseline's inputs fits the module")
    sens_b = torch.from_numpy(to_layout(barr[f"grad_output/{name}"].astype(np.float32), lay_b, lay_c))
    # only floating inputs carry a gradient: integer / bool ones stay as they are in both calls
    fl = [i for i, x in enumerate(xs) if x.is_floating_point()]
    fixed_a, fixed_k = list(args), dict(kwargs)
    for i, (where, k) in enumerate(slots):
        if i not in fl:
            if where == "arg":
                fixed_a[k] = xs[i]
            else:
                fixed_k[k] = xs[i]
    y_iso, gx_iso, gw_iso = _vjp(mod, tuple(fixed_a), fixed_k, [slots[i] for i in fl], [xs[i] for i in fl], sens_b)
    y_own, gx_own, gw_own = _vjp(mod, args, kwargs, [slots[i] for i in fl], [own_xs[i] for i in fl], call["grad"])

    def back(t: torch.Tensor) -> np.ndarray:
        return to_layout(_np(t), lay_c, lay_b)

    y_b = barr[f"output/{name}"].astype(np.float32)
    if back(y_iso).shape != y_b.shape:
        raise ValueError(f"output shape {back(y_iso).shape} vs the baseline's {y_b.shape}")
    arrays[f"baseline/{name}"], arrays[f"isolated/{name}"], arrays[f"candidate/{name}"] = \
        y_b, back(y_iso), back(y_own)
    grads = []
    for j, i in enumerate(fl):
        key = grad_keys[i]
        if key is None or gx_iso[j] is None:
            continue
        conv = back if key == first_b else _np
        what = f"input:{key}"
        arrays[f"grad/baseline/{name}/{what}"] = barr[f"grad_input/{name}/{key}"].astype(np.float32)
        arrays[f"grad/isolated/{name}/{what}"] = conv(gx_iso[j])
        arrays[f"grad/candidate/{name}/{what}"] = conv(gx_own[j])
        grads.append({"what": what})

    def to_baseline(gw: list[tuple[str, torch.Tensor | None]]) -> dict[str, np.ndarray]:
        conv, _ = m.convert({f"{cand}.{n}": _np(g) for n, g in gw if g is not None}, "baseline", params)
        return conv

    iso_w, own_w = to_baseline(gw_iso), to_baseline(gw_own)
    missing = add_weight_grads(arrays, grads, barr, name, e.get("params", []), iso_w, own_w)
    return result_row(name, cand, m.module_kind(name, "baseline"), e,
                      compute_dtype(y_iso.dtype, [p.dtype for p in mod.parameters()]), listed, grads, missing,
                      attention=computes_attention(type(x).__name__ for x in mod.modules()))
