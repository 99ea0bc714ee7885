"""Single-module isolation, candidate side: each chosen candidate cell run on the baseline's captured input.

Why: the layer-tensor stage names the first module whose output departs. After a small early drift every
later module departs too, and the first one is often not where the fault is. Fed the baseline's own input, a
module's output differs from the baseline's only by what the module itself computes differently (its *own*
error); in the candidate's own forward it differs by that plus what it inherited from upstream (the
*inherited* error). PaDiff's single-step mode and msprobe's module mock do this within one framework; here the
module is the candidate's real MindSpore cell (PYNATIVE) with the candidate's weights, the input the
Megatron baseline's.

What it needs (docs/workflow.md): a baseline run store with full tensors of the chosen modules at one step
(``DumpConfig(tensors="full", tensor_steps=[N], modules=[...])``): each module's first tensor input
(``forward.input.0``: the hidden states, as Megatron's transformer layers, attention and MLP take them) and
first output (``forward.output.0``), and the step's batch; and the candidate network, built in PYNATIVE, with
its weights as they were at step N (before that step's update: for step 1 the converted initial weights).
The other inputs of each candidate cell (attention mask, rotary embedding, ...) are the candidate's own: one
forward of the candidate on the baseline's batch records them, and each cell's own output of that forward
(on which the inherited error is measured). Activation layouts ([s, b, h] / [b, s, h]) come from the
mapping's ``activation_layout``.

Writes ``OUT/evidence/isolation.npz``: ``baseline/<module>``, ``isolated/<module>``, ``candidate/<module>``
(baseline module names, the baseline's activation layout, float32) and ``meta`` (a JSON string: step, rank,
the baseline store, the mapping, the module pairs in execution order with their dtypes, the modules left out
and why). ``comparators.isolation`` judges it; ``align report`` shows it as the ``isolation`` stage.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dumpers.isolation_rows import compute_dtype, computes_attention
from runstore import EVIDENCE_DIR, ISOLATION_EVIDENCE, RunReader, atomic_file, check_table, table_columns
from runstore.h5file import open_h5, read_dataset

INPUT, OUTPUT = "forward.input.0", "forward.output.0"
# module kinds (the mapping's module rules) isolated when no patterns are given
DEFAULT_KINDS = ("embedding", "layer", "attention", "mlp", "norm", "output", "loss")
# Modules whose input is not the candidate's under TransformerEngine's spec: its linear_qkv / linear_fc1 hold
# the norm (layer_norm_weight), so Megatron's self_attention and mlp take the un-normalised hidden states
TE_FUSED_NORM_INPUT = (".self_attention", ".mlp")


def baseline_modules(store: str | Path, step: int | None = None, rank: int = 0
                     ) -> tuple[int, Path, list[dict[str, Any]]]:
    """(step, step file, modules) of a baseline store: each module with a full ``forward.input.0`` and
    ``forward.output.0`` at ``step`` (default: the first step that stored full tensors), in execution
    order (its first call), as {module, input, output (dataset names), dtype}."""
    reader = RunReader(store)
    steps = [step] if step is not None else reader.array_steps()
    for s in steps:
        path = Path(reader.step_file(s, rank))
        with open_h5(path) as h5:
            if "tensor_stats" not in h5 or "tensors" not in h5:
                if step is not None:
                    raise ValueError(f"{path}: no full layer tensors at step {s} (DumpConfig(tensors='full', "
                                     f"tensor_steps=[{s}], modules=[...]))")
                continue
            cols = table_columns(h5["tensor_stats"])
        check_table(path, "tensor_stats", cols)
        found: dict[str, dict[str, Any]] = {}
        for i in np.argsort(cols["order"], kind="stable"):
            mod, kind = str(cols["module"][i]), str(cols["kind"][i])
            entry = found.setdefault(mod, {"module": mod, "dtype": str(cols["dtype"][i]) if "dtype" in cols
                                           else "float32"})
            key = {INPUT: "input", OUTPUT: "output"}.get(kind)
            if key is not None and key not in entry:
                entry[key] = f"tensors/{int(cols['order'][i]):06d}"
        mods = [e for e in found.values() if "input" in e and "output" in e]
        if mods:
            return s, path, mods
    raise ValueError(f"{store}: no step holds full input and output tensors of any module (DumpConfig("
                     "tensors='full', tensor_steps=[N], modules=[...]))")


def step_batch(store: str | Path, step: int, rank: int) -> dict[str, np.ndarray]:
    data = RunReader(store).step_arrays(step, rank).data
    batch = {k.split("/", 1)[1]: v for k, v in data.items() if k.startswith("batch/")}
    if "tokens" not in batch or "labels" not in batch:
        raise ValueError(f"{store}: step {step} holds no batch (batch/tokens, batch/labels): pass batch=")
    return batch


def mcore_forward(net: Any, batch: Mapping[str, np.ndarray]) -> Any:
    """One forward of a MindFormers mcore ``Training*ForCausalLM`` on a Megatron-style batch (tokens, labels,
    loss_mask): the default ``forward`` of :func:`isolate_modules`."""
    from mindspore import Tensor

    ids = np.asarray(batch.get("input_ids", batch.get("tokens")))
    mask = np.asarray(batch.get("loss_mask", np.ones(ids.shape, np.float32)))
    return net(input_ids=Tensor(ids.astype(np.int32)), labels=Tensor(np.asarray(batch["labels"]).astype(np.int32)),
               loss_mask=Tensor(mask.astype(np.float32)))


def to_layout(x: np.ndarray, src: str | None, dst: str | None) -> np.ndarray:
    """An activation from layout ``src`` to ``dst`` ("sbh" / "bsh": the first two axes swap; else as is)."""
    if src and dst and src != dst and {src, dst} == {"sbh", "bsh"} and x.ndim >= 2:
        return np.ascontiguousarray(np.swapaxes(x, 0, 1))
    return x


def _rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    """||a - b|| / ||b|| (float64): how far the candidate's own input of a module is from the baseline's."""
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / max(np.linalg.norm(b), 1e-30))


def _cell_index(net: Any) -> dict[str, Any]:
    return {name: cell for name, cell in net.cells_and_names() if name}


def find_cell(cells: Mapping[str, Any], name: str) -> Any:
    """The cell named ``name``, or the one cell whose name ends with ``.name`` (a wrapper's prefix, say
    ``model.`` of a MindFormers ``Training*ForCausalLM`` around its GPTModel); None when there is none."""
    if name in cells:
        return cells[name]
    hits = [c for n, c in cells.items() if n.endswith("." + name)]
    return hits[0] if len(hits) == 1 else None


def first_tensor(obj: Any) -> Any:
    from mindspore import Tensor

    if isinstance(obj, Tensor):
        return obj
    if isinstance(obj, (tuple, list)):
        for item in obj:
            t = first_tensor(item)
            if t is not None:
                return t
    return None


def _swap_input(args: tuple, kwargs: dict, x: Any) -> tuple[tuple, dict, Any]:
    """(args, kwargs, replaced tensor): the first positional tensor (else ``hidden_states``, else the first
    keyword tensor) replaced by ``x``."""
    from mindspore import Tensor

    for i, a in enumerate(args):
        if isinstance(a, Tensor):
            return args[:i] + (x,) + args[i + 1:], kwargs, a
    keys = (["hidden_states"] if isinstance(kwargs.get("hidden_states"), Tensor) else []) + [
        k for k, v in kwargs.items() if isinstance(v, Tensor)]
    if not keys:
        raise ValueError("the cell took no tensor input")
    return args, {**kwargs, keys[0]: x}, kwargs[keys[0]]


def mapped_modules(entries: Sequence[dict[str, Any]], m: Any, modules: Sequence[str] | None,
                   skipped: list[dict[str, str]]) -> Iterator[tuple[dict[str, Any], str, str]]:
    """(entry, baseline module, candidate cell name) of each captured module to isolate: those matching
    ``modules`` (default: the kinds of DEFAULT_KINDS) that a module rule of the mapping ``m`` covers; an
    asked-for module no rule covers is added to ``skipped`` with the reason."""
    for e in entries:
        mod = e["module"]
        if modules is not None and not any(fnmatch.fnmatchcase(mod, p) for p in modules):
            continue
        cand = m.map_module(mod, "baseline")
        if cand is None or (modules is None and m.module_kind(mod, "baseline") not in DEFAULT_KINDS):
            if modules is not None:
                skipped.append({"module": mod, "reason": "no module rule of the mapping covers it"})
            continue
        yield e, mod, cand


def cell_dtype(cell: Any, out: Any) -> str:
    """The precision a candidate cell computes in: the coarsest of its output's and its parameters' dtypes."""
    return compute_dtype(str(out.dtype).lower(), [str(p.dtype).lower() for p in cell.trainable_params()])


def cell_computes_attention(cell: Any) -> bool:
    """Whether the cell is, or holds, an attention cell (judged at the attention's precision)."""
    return computes_attention(type(c).__name__ for _, c in cell.cells_and_names())


class ConstructPatches:
    """Cells whose ``construct`` is replaced on the instance; :meth:`restore` puts back what was there (the
    class's, or the instance's own where it had one): the cells compute exactly as before, only the Python
    call is intercepted."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, Any]] = []

    def _patch(self, cell: Any, construct: Callable[..., Any]) -> None:
        self._saved.append((cell, cell.__dict__.get("construct")))
        object.__setattr__(cell, "construct", construct)

    def restore(self) -> None:
        for cell, own in reversed(self._saved):
            if own is None:
                object.__delattr__(cell, "construct")
            else:
                object.__setattr__(cell, "construct", own)
        self._saved.clear()


class _Recorder(ConstructPatches):
    """Wraps chosen cells' ``construct``: the first call's arguments and output are kept."""

    def __init__(self, cells: Mapping[str, Any]) -> None:
        super().__init__()
        self.calls: dict[str, tuple[tuple, dict, Any]] = {}
        for name, cell in cells.items():
            self._wrap(name, cell)

    def _wrap(self, name: str, cell: Any) -> None:
        inner = cell.construct
        calls = self.calls

        def construct(*args: Any, **kwargs: Any) -> Any:
            out = inner(*args, **kwargs)
            calls.setdefault(name, (args, dict(kwargs), out))
            return out

        self._patch(cell, construct)


INHERITED_GRAPH = ("the candidate's own module inputs and outputs read from the GRAPH run that trained ({run}, its "
                   "kernel dump at step {step}: dumpers/mindspore_kernel_dump.py), not from a PYNATIVE re-run; "
                   "{n} module(s) it did not tap from the PYNATIVE forward")


def _graph_side(graph: Mapping[str, Mapping[str, np.ndarray]], cand: str) -> Mapping[str, np.ndarray]:
    return graph.get(cand) or graph.get(cand.removeprefix("model.")) or {}


def isolate_modules(net: Any, baseline: str | Path, out: str | Path, *, mapping: Any = None,
                    step: int | None = None, rank: int = 0, modules: Sequence[str] | None = None,
                    batch: Mapping[str, np.ndarray] | None = None,
                    forward: Callable[[Any, Mapping[str, np.ndarray]], Any] | None = None,
                    dtype: str | None = None, weights: str | None = None,
                    graph_tensors: Mapping[str, Mapping[str, np.ndarray]] | None = None,
                    candidate_run: str | Path | None = None) -> Path:
    """Run each chosen candidate cell of ``net`` on the baseline's captured input; write the evidence file.

    ``baseline``: the baseline run store (full tensors of the chosen modules at ``step``, default its first
    such step; rank ``rank``). ``modules``: fnmatch patterns over the baseline's module names (default:
    every captured module the mapping's module rules map, of kinds layer / attention / mlp / norm / output).
    ``batch``: the step's batch (default: the baseline store's). ``forward(net, batch)`` runs the candidate
    once (default :func:`mcore_forward`). ``net`` must run in PYNATIVE with the candidate's weights of that
    step (``weights``: where they came from, recorded). ``dtype``: a precision coarser than the tensors' own
    that the candidate computes in (MindFormers' flash-attention path rounds q/k/v through float16 in a
    float32 run), recorded: errors are judged against its noise. ``candidate_run``: the candidate's GRAPH run
    store with a kernel dump at ``step``, and ``graph_tensors`` its tapped cells' own inputs and outputs
    (align.procedure.graph_run.graph_run_tensors), which then give the inherited error. Returns
    ``OUT/evidence/isolation.npz``.
    """
    import mindspore as ms

    from mapping import Mapping as NameMapping
    from models import load_mapping

    if ms.get_context("mode") != ms.PYNATIVE_MODE:
        raise ValueError("isolation calls the candidate's cells one by one: build and run it in PYNATIVE "
                         "(ms.set_context(mode=ms.PYNATIVE_MODE))")
    m = mapping if isinstance(mapping, NameMapping) else load_mapping(mapping)
    lay_b, lay_c = m.activation_layout.get("baseline"), m.activation_layout.get("candidate")
    step, path, found = baseline_modules(baseline, step, rank)
    graph = graph_tensors or {}
    te = str(RunReader(baseline).meta.get("name_scheme", "")).endswith("-te")
    cells = _cell_index(net)
    chosen: dict[str, tuple[dict[str, Any], str, Any]] = {}
    skipped: list[dict[str, str]] = []
    for e, mod, cand in mapped_modules(found, m, modules, skipped):
        if te and mod.endswith(TE_FUSED_NORM_INPUT):
            skipped.append({"module": mod, "reason": "TransformerEngine spec: the norm is fused into its first "
                                                     "linear, so its input is not the candidate's"})
            continue
        cell = find_cell(cells, cand)
        if cell is None:
            skipped.append({"module": mod, "reason": f"the candidate has no cell {cand}"})
            continue
        chosen[mod] = (e, cand, cell)
    if not chosen:
        raise ValueError(f"{baseline}: none of the captured modules maps to a candidate cell "
                         f"({len(found)} captured; {skipped[0]['reason'] if skipped else 'none selected'})")
    rec = _Recorder({mod: cell for mod, (_, _, cell) in chosen.items()})
    try:
        (forward or mcore_forward)(net, batch if batch is not None else step_batch(baseline, step, rank))
    finally:
        rec.restore()
    arrays: dict[str, np.ndarray] = {}
    pairs: list[dict[str, Any]] = []
    with open_h5(path) as h5:
        for mod, (e, cand, cell) in chosen.items():
            call = rec.calls.get(mod)
            if call is None:
                skipped.append({"module": mod, "reason": f"{cand} was not called in the candidate's forward"})
                continue
            args, kwargs, own_out = call
            y_b = read_dataset(path, e["output"], h5.get(e["output"])).astype(np.float32)
            x_b = read_dataset(path, e["input"], h5.get(e["input"]))
            x_c = to_layout(x_b, lay_b, lay_c)
            try:
                new_args, new_kwargs, was = _swap_input(args, kwargs, None)
                if tuple(was.shape) != x_c.shape:
                    raise ValueError(f"the baseline's input {x_c.shape} (in the candidate's layout) is not the "
                                     f"shape of the cell's own input {tuple(was.shape)}")
                x = ms.Tensor(x_c.astype(np.float32) if np.issubdtype(x_c.dtype, np.floating) else x_c)
                new_args, new_kwargs, _ = _swap_input(args, kwargs, x.astype(was.dtype))
                y_iso = first_tensor(cell(*new_args, **new_kwargs))
                y_own = first_tensor(own_out)
            except (ValueError, TypeError, RuntimeError) as exc:
                skipped.append({"module": mod, "reason": f"{type(exc).__name__}: {' '.join(str(exc).split())}"})
                continue
            x_own = to_layout(was.astype(ms.float32).asnumpy(), lay_c, lay_b) if was.dtype != ms.bool_ else None
            iso = to_layout(y_iso.astype(ms.float32).asnumpy(), lay_c, lay_b)
            own = to_layout(y_own.astype(ms.float32).asnumpy(), lay_c, lay_b)
            ran = _graph_side(graph, cand)
            inherited = "pynative"
            if "output" in ran and ran["output"].size == own.size and (x_own is None or "input" not in ran
                                                                        or ran["input"].size == x_own.size):
                own = to_layout(ran["output"].astype(np.float32).reshape(y_own.shape), lay_c, lay_b)
                if x_own is not None and "input" in ran:
                    x_own = to_layout(ran["input"].astype(np.float32).reshape(was.shape), lay_c, lay_b)
                inherited = "graph"
            if iso.shape != y_b.shape:
                skipped.append({"module": mod, "reason": f"output shape {iso.shape} vs the baseline's {y_b.shape}"})
                continue
            arrays[f"baseline/{mod}"], arrays[f"isolated/{mod}"], arrays[f"candidate/{mod}"] = y_b, iso, own
            pairs.append({"baseline": mod, "candidate": cand, "kind": m.module_kind(mod, "baseline"),
                          "dtype_baseline": e["dtype"], "dtype_candidate": cell_dtype(cell, y_iso),
                          "attention": cell_computes_attention(cell), "inherited_from": inherited,
                          "input_rel_l2": _rel_l2(x_own, x_b) if x_own is not None else None})
    if not pairs:
        raise ValueError(f"{baseline}: no module could be isolated: "
                         + "; ".join(f"{s['module']}: {s['reason']}" for s in skipped[:3]))
    meta = {"step": step, "rank": rank, "baseline": str(baseline), "mapping": m.name, "dtype": dtype,
            "weights": weights, "candidate_run": str(candidate_run) if candidate_run is not None else None,
            "inherited_inputs": INHERITED_GRAPH.format(
                run=candidate_run, step=step, n=sum(p["inherited_from"] != "graph" for p in pairs))
            if candidate_run is not None else None,
            "layout": {"baseline": lay_b, "candidate": lay_c}, "modules": pairs, "skipped": skipped}
    dest = Path(out) / EVIDENCE_DIR / ISOLATION_EVIDENCE
    dest.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(dest) as fh:
        np.savez(fh, meta=np.array(json.dumps(meta)), **arrays)
    return dest
