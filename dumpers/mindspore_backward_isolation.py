"""Single-module isolation, forward AND backward, candidate side: each chosen MindSpore cell run on the
baseline's captured inputs (all of them that the cell takes in the same form) and fed the baseline's output
gradient; its output, input gradients and weight gradients against the baseline's, each as own vs inherited.

Why: forward isolation (dumpers.mindspore_isolation) cannot see a module whose forward is right and whose
gradient is not (a custom bprop, a recompute boundary, MindFormers' PYNATIVE MLA projection gradients). Fed
the baseline's inputs and output gradient, a cell's gradients differ from the baseline's only by what it
computes differently in backward (its *own* error); the same cell on its own inputs and its own output gradient
(from the candidate's own forward and backward) adds what it *inherited*.

Baseline: ``dumpers.torch_module_backward.ModuleBackwardCapture`` at the step (each module's inputs by
``forward`` parameter name, output, output gradient, and its own input and weight gradients, replayed).
Candidate: the network in PYNATIVE with its weights of that step. One forward and backward of the candidate on
the step's batch records each cell's call and its output gradient (a tensor hook); then each cell's
vector-Jacobian product runs twice (baseline's inputs and output gradient; its own), in PYNATIVE or compiled
(``graph=True``: ``mindspore.jit``, GRAPH kernels and GRAPH autodiff, as a GRAPH-trained candidate computes).
Under ``graph=True`` the module's own inputs and output gradient (the inherited error's) still come from a
PYNATIVE forward and backward of the whole network: see INHERITED_PYNATIVE (meta ``inherited_inputs``).
Inputs: the baseline's first floating input replaces the cell's first tensor input (the activation, through
the mapping's ``activation_layout``); every other baseline input replaces the cell's argument of the same name
when that is a tensor of the same shape (cast to its dtype: Megatron's bool mask, MindFormers' uint8); the
rest stay the candidate's own (MindFormers' rotary embedding is a tuple), each listed with why.
Weight gradients are compared in the baseline's names and layouts (the mapping's transforms, reversed).

Writes ``OUT/evidence/isolation.npz`` as forward isolation does (``baseline/``, ``isolated/``, ``candidate/``
per module) plus ``grad/{baseline,isolated,candidate}/<module>/<what>`` (``what``: ``input:<name>`` or
``weight:<baseline parameter>``), and meta ``backward: true``, ``mode``, per module ``grads`` and ``inputs``.
"""

from __future__ import annotations

import inspect
import json
import zipfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dumpers.isolation_rows import add_weight_grads, result_row
from dumpers.mindspore_isolation import (
    ConstructPatches,
    _cell_index,
    _rel_l2,
    cell_computes_attention,
    cell_dtype,
    find_cell,
    first_tensor,
    mapped_modules,
    mcore_forward,
    step_batch,
    to_layout,
)
from runstore import EVIDENCE_DIR, ISOLATION_EVIDENCE, atomic_file
from runstore.layout import evidence_step_file, evidence_steps

BACKWARD_DIR = "module_backward"      # dumpers.torch_module_backward writes there (no torch import here)


def backward_steps(store: str | Path, rank: int = 0) -> list[int]:
    """Steps of ``store`` with a module backward capture for ``rank``, ascending."""
    return evidence_steps(store, BACKWARD_DIR, rank)


def read_backward(store: str | Path, step: int, rank: int = 0) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(meta, arrays) of the baseline's module backward capture; ValueError in one line when unreadable."""
    path = evidence_step_file(store, BACKWARD_DIR, step, rank)
    if not path.is_file():
        raise ValueError(f"{path}: no module backward capture at step {step} (dumpers.torch_module_backward."
                         "ModuleBackwardCapture)")
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        meta = json.loads(str(arrays.pop("meta")))
        mods = meta["modules"]
        if not isinstance(mods, list) or not all(isinstance(m, dict) and "module" in m for m in mods):
            raise TypeError("modules is not a list of {module, inputs, params}")
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a module backward capture ({' '.join(str(exc).split())[:80]})") from None
    return meta, arrays


def backward_capture(store: str | Path, step: int | None, rank: int = 0, *,
                     writer: str = "dumpers.torch_module_backward"
                     ) -> tuple[int, dict[str, Any], dict[str, np.ndarray]]:
    """(step, meta, arrays) of the baseline's module backward capture at ``step`` (default: its first);
    ValueError in one line when there is none (``writer``: what writes one) or it is unreadable."""
    if step is None:
        steps = backward_steps(store, rank)
        if not steps:
            raise ValueError(f"{store}: no module backward capture ({writer})")
        step = steps[0]
    meta, arrays = read_backward(store, step, rank)
    return int(step), meta, arrays


def fit_input(x: np.ndarray, shape: tuple[int, ...], src: str | None, dst: str | None) -> np.ndarray | None:
    """The baseline's activation ``x`` in the form a candidate argument of ``shape`` takes: through the
    layouts; or, where the candidate takes the tokens flattened ([b*s, h]: MindFormers' loss takes its logits
    so, ordered as its [b, s] labels), batch-major and flattened. None when neither fits."""
    y = to_layout(x, src, dst)
    if tuple(y.shape) == tuple(shape):
        return y
    if x.ndim == 3 and len(shape) == 2 and x.size == int(np.prod(shape)) and x.shape[-1] == shape[-1]:
        return np.ascontiguousarray(to_layout(x, src, "bsh")).reshape(shape)
    return None


def unfit_output(g: np.ndarray, base_shape: tuple[int, ...], src: str | None, dst: str | None) -> np.ndarray:
    """A candidate gradient or output back in the baseline's form: :func:`fit_input` reversed."""
    if g.ndim == 2 and len(base_shape) == 3 and g.size == int(np.prod(base_shape)):
        bsh = to_layout(np.empty(base_shape, np.float32), dst, "bsh").shape
        return to_layout(g.reshape(bsh), "bsh", dst)
    return to_layout(g, src, dst)


# Why the inherited error's inputs come from PYNATIVE under graph=True: a GRAPH network runs as one compiled
# graph, no Python per cell, so a cell's arguments and its output gradient cannot be handed out of it (a tensor
# hook there must obey graph syntax and cannot store into Python; an in-graph capture needs a Parameter of
# each output's shape before compiling: dumpers/mindspore_graph_capture.py). Each module itself is compiled.
INHERITED_PYNATIVE = ("each module compiled (GRAPH kernels and autodiff) on its own inputs and output gradient "
                      "from one PYNATIVE forward and backward of the whole network: a GRAPH run hands no cell's "
                      "arguments or output gradient out; a PYNATIVE-only backward fault upstream (MindFormers' MLA "
                      "projection split) shows in these inherited gradients, not in the own ones")


class _GradRecorder(ConstructPatches):
    """Wraps chosen cells' ``construct``: the first call's arguments, output and (a tensor hook on the first
    output) its gradient in the candidate's own backward are kept; removed by :meth:`restore`."""

    def __init__(self, cells: Mapping[str, Any]) -> None:
        super().__init__()
        self.calls: dict[str, tuple[tuple, dict, Any]] = {}
        self.grad_out: dict[str, np.ndarray] = {}
        self.signatures: dict[str, list[str]] = {}
        for name, cell in cells.items():
            self._wrap(name, cell)

    def _wrap(self, name: str, cell: Any) -> None:
        inner = cell.construct
        try:
            self.signatures[name] = [p.name for p in inspect.signature(inner).parameters.values()
                                     if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        except (TypeError, ValueError):
            self.signatures[name] = []

        def construct(*args: Any, **kwargs: Any) -> Any:
            out = inner(*args, **kwargs)
            if name not in self.calls:
                self.calls[name] = (args, dict(kwargs), out)
                t = first_tensor(out)
                if t is not None:
                    def grab(g: Any) -> None:
                        self.grad_out[name] = g.asnumpy().copy()
                    try:
                        t.register_hook(grab)
                    except RuntimeError:     # an output no gradient flows to (listed as such by the caller)
                        pass
            return out

        self._patch(cell, construct)


def _slots(args: tuple, kwargs: dict, names: list[str]) -> dict[str, tuple[str, Any]]:
    """name -> ("arg", index) / ("kw", key) of each tensor argument of a recorded call."""
    from mindspore import Tensor

    out: dict[str, tuple[str, Any]] = {}
    for i, a in enumerate(args):
        if isinstance(a, Tensor):
            out[names[i] if i < len(names) else str(i)] = ("arg", i)
    for k, v in kwargs.items():
        if isinstance(v, Tensor):
            out[k] = ("kw", k)
    return out


def make_vjp(cell: Any, args: tuple, kwargs: dict, slots: list[tuple[str, Any]], graph: bool
              ) -> Callable[[list[Any], Any], tuple[Any, tuple, tuple]]:
    """A function (xs, sens) -> (output, input grads, (name, weight grad) pairs) of ``cell`` called as recorded
    with the tensors at ``slots`` replaced by ``xs`` and its first output's gradient ``sens``; compiled once
    with ``mindspore.jit`` when ``graph`` (the isolated and the own call share the compiled graph)."""
    import mindspore as ms

    params = cell.trainable_params()
    # GRAPH parses fn's body: no helper calls, no zip(strict=...), no closure names it reserves (``kwargs``)
    call_args, call_kw = tuple(args), dict(kwargs)
    arg_slots = tuple((key, j) for j, (where, key) in enumerate(slots) if where == "arg")
    kw_slots = tuple((key, j) for j, (where, key) in enumerate(slots) if where != "arg")

    def fn(*ts: Any) -> Any:
        a = list(call_args)
        for key, j in arg_slots:
            a[key] = ts[j]
        k = dict(call_kw)
        for key, j in kw_slots:
            k[key] = ts[j]
        out = cell(*a, **k)
        return out[0] if isinstance(out, (tuple, list)) else out

    vg = ms.value_and_grad(fn, grad_position=tuple(range(len(slots))), weights=params, sens_param=True)
    if graph:
        vg = ms.jit(vg)

    def run(xs: list[Any], sens: Any) -> tuple[Any, tuple, tuple]:
        out, (gx, gw) = vg(*xs, sens)
        if not isinstance(gx, (tuple, list)):
            gx = (gx,)
        return out, tuple(gx), tuple(zip([p.name for p in params], gw, strict=True))
    return run


def plan_inputs(base_inputs: list[dict[str, Any]], arrays: Mapping[str, np.ndarray], mod: str,
                 args: tuple, kwargs: dict, names: list[str], lay_b: str | None, lay_c: str | None
                 ) -> tuple[list[tuple[str, Any]], list[Any], list[dict[str, Any]], list[str | None]]:
    """Which recorded arguments take the baseline's tensors: (slots, baseline tensors in the candidate's
    layout and dtype, the input list for meta, the baseline key of each slot's input gradient or None)."""
    import mindspore as ms

    slots = _slots(args, kwargs, names)
    first_c = next(iter(slots), None)
    first_b = next((i["key"] for i in base_inputs if i.get("grad")), None)
    chosen, xs, listed, grad_keys = [], [], [], []
    for inp in base_inputs:
        key = inp["key"]
        base = arrays[f"input/{mod}/{key}"]
        target = first_c if key == first_b else (key if key in slots else None)
        if target is None or target not in slots:
            listed.append({"key": key, "source": "none", "why": "the candidate's cell takes no such tensor"})
            continue
        where, k = slots[target]
        own = args[k] if where == "arg" else kwargs[k]
        fitted = fit_input(base, tuple(own.shape), lay_b, lay_c) if key == first_b else base
        val = fitted if fitted is not None else to_layout(base, lay_b, lay_c)
        if tuple(own.shape) != val.shape:
            listed.append({"key": key, "source": "candidate", "why": f"shape {list(val.shape)} vs the cell's "
                           f"{list(own.shape)}"})
            continue
        x = ms.Tensor(val.astype(np.float32) if val.dtype == np.bool_ or np.issubdtype(val.dtype, np.floating)
                      else val).astype(own.dtype)
        rel = _rel_l2(own.astype(ms.float32).asnumpy(), x.astype(ms.float32).asnumpy())
        listed.append({"key": key, "source": "baseline", "candidate_arg": target, "own_rel_l2": rel})
        chosen.append((where, k))
        xs.append(x)
        grad_keys.append(key if inp.get("grad") and f"grad_input/{mod}/{key}" in arrays else None)
    for name in slots:
        if not any(i.get("candidate_arg") == name for i in listed):
            listed.append({"key": name, "source": "candidate", "why": "the baseline has no tensor in its form "
                           "(kept the candidate's own)"})
    return chosen, xs, listed, grad_keys


def isolate_with_backward(net: Any, baseline: str | Path, out: str | Path, *, mapping: Any = None,
                          step: int | None = None, rank: int = 0, modules: Sequence[str] | None = None,
                          batch: Mapping[str, np.ndarray] | None = None,
                          forward: Callable[[Any, Mapping[str, np.ndarray]], Any] | None = None,
                          dtype: str | None = None, weights: str | None = None, params: Any = None,
                          graph: bool = False) -> Path:
    """Forward and backward isolation of ``net``'s cells against the baseline's module backward capture.

    Arguments as :func:`dumpers.mindspore_isolation.isolate_modules`; ``params``: the mapping's
    ``TransformParams`` (heads, query groups, experts) that bring the candidate's weight gradients into the
    baseline's layout; ``graph``: each cell's forward and backward compiled (``mindspore.jit``). Returns
    ``OUT/evidence/isolation.npz``.
    """
    import mindspore as ms

    from mapping import Mapping as NameMapping
    from mapping import TransformParams
    from models import load_mapping

    if ms.get_context("mode") != ms.PYNATIVE_MODE:
        raise ValueError("isolation calls the candidate's cells one by one: build and run it in PYNATIVE "
                         "(ms.set_context(mode=ms.PYNATIVE_MODE)); graph=True compiles each cell")
    m = mapping if isinstance(mapping, NameMapping) else load_mapping(mapping)
    params = params or TransformParams()
    lay_b, lay_c = m.activation_layout.get("baseline"), m.activation_layout.get("candidate")
    step, bmeta, barr = backward_capture(baseline, step, rank)
    cells = _cell_index(net)
    chosen: dict[str, tuple[dict[str, Any], str, Any]] = {}
    skipped: list[dict[str, str]] = list(bmeta.get("skipped") or [])
    for e, mod, cand in mapped_modules(bmeta["modules"], m, modules, skipped):
        cell = find_cell(cells, cand)
        if cell is None:
            skipped.append({"module": mod, "reason": f"the candidate has no cell {cand}"})
            continue
        chosen[mod] = (e, cand, cell)
    if not chosen:
        raise ValueError(f"{baseline}: none of the captured modules maps to a candidate cell "
                         f"({len(bmeta['modules'])} captured; "
                         f"{skipped[0]['reason'] if skipped else 'none selected'})")
    rec = _GradRecorder({mod: cell for mod, (_, _, cell) in chosen.items()})
    data = batch if batch is not None else step_batch(baseline, step, rank)
    try:
        ms.grad(lambda: first_tensor((forward or mcore_forward)(net, data)), grad_position=None,
                weights=net.trainable_params())()
    finally:
        rec.restore()
    arrays: dict[str, np.ndarray] = {}
    pairs: list[dict[str, Any]] = []
    for mod, (e, cand, cell) in chosen.items():
        if mod not in rec.calls or mod not in rec.grad_out:
            skipped.append({"module": mod, "reason": f"{cand} was not called in the candidate's forward" if
                            mod not in rec.calls else f"{cand}'s output got no gradient in the candidate's backward"})
            continue
        try:
            pair = _isolate_one(mod, cand, cell, e, rec, barr, arrays, m, params, lay_b, lay_c, graph)
        except (ValueError, TypeError, RuntimeError, NameError) as exc:     # NameError: GRAPH's parser
            skipped.append({"module": mod, "reason": f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"})
            continue
        pairs.append(pair)
    if not pairs:
        raise ValueError(f"{baseline}: no module could be isolated: "
                         + "; ".join(f"{s['module']}: {s['reason']}" for s in skipped[:3]))
    meta = {"step": step, "rank": rank, "baseline": str(baseline), "mapping": m.name, "dtype": dtype,
            "weights": weights, "backward": True, "mode": "graph" if graph else "pynative",
            "inherited_inputs": INHERITED_PYNATIVE if graph else None,
            "layout": {"baseline": lay_b, "candidate": lay_c}, "modules": pairs, "skipped": skipped}
    dest = Path(out) / EVIDENCE_DIR / ISOLATION_EVIDENCE
    dest.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(dest) as fh:
        np.savez(fh, meta=np.array(json.dumps(meta)), **arrays)
    return dest


def _isolate_one(mod: str, cand: str, cell: Any, e: dict[str, Any], rec: _GradRecorder,
                 barr: Mapping[str, np.ndarray], arrays: dict[str, np.ndarray], m: Any, params: Any,
                 lay_b: str | None, lay_c: str | None, graph: bool) -> dict[str, Any]:
    """One module: forward output, input and weight gradients, isolated and own; arrays added to ``arrays``."""
    import mindspore as ms

    args, kwargs, own_out = rec.calls[mod]
    slots, xs, listed, grad_keys = plan_inputs(e["inputs"], barr, mod, args, kwargs, rec.signatures[mod],
                                                lay_b, lay_c)
    if not slots:
        raise ValueError("none of the baseline's inputs fits the cell")
    y_b = barr[f"output/{mod}"].astype(np.float32)
    sens_np = to_layout(barr[f"grad_output/{mod}"].astype(np.float32), lay_b, lay_c)
    own_shape = tuple(first_tensor(own_out).shape)
    if sens_np.ndim <= 1 and sens_np.size == 1 and sens_np.shape != own_shape:   # a scalar loss: () vs (1,)
        sens_np = sens_np.reshape(own_shape)
    sens_b = ms.Tensor(sens_np)
    own_xs = [args[k] if where == "arg" else kwargs[k] for where, k in slots]
    own_sens = ms.Tensor(rec.grad_out[mod])
    vjp = make_vjp(cell, args, kwargs, slots, graph)
    y_iso, gx_iso, gw_iso = vjp(xs, sens_b.astype(_out_dtype(own_out)))
    y_own, gx_own, gw_own = vjp(own_xs, own_sens.astype(_out_dtype(own_out)))

    def back(t: Any) -> np.ndarray:
        return to_layout(t.astype(ms.float32).asnumpy(), lay_c, lay_b)

    x_shape = tuple(barr[f"input/{mod}/{first}"].shape) if (first := next(
        (i["key"] for i in e["inputs"] if i.get("grad")), None)) else ()

    def back_x(t: Any) -> np.ndarray:      # the first input's gradient: in the baseline input's form
        return unfit_output(t.astype(ms.float32).asnumpy(), x_shape, lay_c, lay_b)

    iso, own_y = back(y_iso), back(y_own)
    if iso.shape != y_b.shape and iso.size == y_b.size == 1:
        iso, own_y = iso.reshape(y_b.shape), own_y.reshape(y_b.shape)
    if iso.shape != y_b.shape:
        raise ValueError(f"output shape {iso.shape} vs the baseline's {y_b.shape}")
    arrays[f"baseline/{mod}"], arrays[f"isolated/{mod}"], arrays[f"candidate/{mod}"] = y_b, iso, own_y
    grads: list[dict[str, Any]] = []
    for j, key in enumerate(grad_keys):
        if key is None or gx_iso[j] is None:
            continue
        conv = back_x if key == first else (lambda t: t.astype(ms.float32).asnumpy())
        what = f"input:{key}"
        arrays[f"grad/baseline/{mod}/{what}"] = barr[f"grad_input/{mod}/{key}"].astype(np.float32)
        arrays[f"grad/isolated/{mod}/{what}"] = conv(gx_iso[j])
        arrays[f"grad/candidate/{mod}/{what}"] = conv(gx_own[j])
        grads.append({"what": what})
    iso_w = to_baseline({n: g.astype(ms.float32).asnumpy() for n, g in gw_iso}, m, params)
    own_w = to_baseline({n: g.astype(ms.float32).asnumpy() for n, g in gw_own}, m, params)
    missing = add_weight_grads(arrays, grads, barr, mod, e.get("params", []), iso_w, own_w)
    return result_row(mod, cand, m.module_kind(mod, "baseline"), e, cell_dtype(cell, y_iso), listed, grads,
                      missing, attention=cell_computes_attention(cell))


def _out_dtype(out: Any) -> Any:
    """The dtype of a recorded call's first output (the sensitivity is cast to it)."""
    return first_tensor(out).dtype


def to_baseline(grads: dict[str, np.ndarray], m: Any, params: Any) -> dict[str, np.ndarray]:
    """Candidate weight gradients in the baseline's names and layouts (the weights' transforms reversed);
    groups the cell holds only in part are left out (listed by the caller as not compared)."""
    conv, _ = m.convert(grads, "baseline", params)
    return conv
