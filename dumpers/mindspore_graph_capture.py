"""Layer statistics captured inside a GRAPH-compiled MindSpore training step (no Python hooks).

Why: NPU training runs in GRAPH mode, where Cell hooks are compiled away (register_forward_hook and
register_backward_hook silently never run; ops.HookBackward is eliminated with a warning), ops.TensorDump
and statistic dumps have no CPU kernel. What does run in the graph, on every backend (ops.Assign and Cell
``bprop``: "Supported Platforms: Ascend GPU CPU"), is plain graph ops. So each watched cell is wrapped, before
the first compile, by a :class:`CaptureCell` that

* forward: computes the statistics of every Tensor output (max, min, mean, L2 norm over the finite values,
  nan and inf counts, float32) and assigns them, with the output's dtype and shape, into pre-allocated
  Parameters (``ops.depend`` keeps the assign in the graph); the outputs themselves pass unchanged;
* backward: passes every float output through a :class:`GradTap`, an identity Cell with a custom ``bprop``
  that assigns the statistics of the incoming gradient (the output gradient) into a Parameter given to it
  as an input (a ``bprop`` may not use ``self``'s Parameters) and returns the gradient unchanged.

After a step the dumper reads the Parameters from Python (:meth:`GraphLayerCapture.read`) and stores rows
exactly as the PYNATIVE hooks do (``forward.output.N`` / ``backward.grad_output.N``, the cell's name).
The statistics are float32 computed on the device (the PYNATIVE hooks compute them in float64 on host).
Only statistics: full tensors would need Parameters of each output's shape before compiling.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

MECHANISM = "in-graph ops.assign of output statistics into Parameters; gradients via a custom-bprop identity cell"
SLOTS = 4          # tensor outputs per cell captured (top-level tuple items beyond this are not)
MAX_RANK = 8
_STAT_COLS = 7     # max, min, mean, norm, nan, inf, written (1.0 once the graph wrote the row)
_META_COLS = 3 + MAX_RANK   # written, dtype code, ndim, dims (-1 padded)
_DTYPES = ("float32", "float16", "bfloat16", "float64", "int32", "int64", "bool", "other")


def graph_stats(x: Tensor) -> Tensor:
    """float32 [max, min, mean, L2 norm over the finite values, nan count, inf count, 1.0], in the graph.

    Outside autodiff (``stop_gradient``): otherwise the backward pass differentiates these statistics too, and an
    all-zero output (MoE's aux loss with coefficient 0) turns sqrt's infinite slope at 0 into NaN gradients."""
    x = ops.stop_gradient(ops.cast(x, ms.float32))
    fin = ops.isfinite(x)
    zero = ops.zeros_like(x)
    z = ops.select(fin, x, zero)
    n = ops.cast(fin, ms.float32).sum()
    mx = ops.select(fin, x, zero - np.inf).max()
    mn = ops.select(fin, x, zero + np.inf).min()
    nan = ops.cast(ops.isnan(x), ms.float32).sum()
    inf = ops.cast(ops.isinf(x), ms.float32).sum()
    return ops.stack([mx, mn, z.sum() / n, ops.sqrt((z * z).sum()), nan, inf,
                      ops.ones((), ms.float32)])


def _dtype_code(dtype: Any) -> int:
    if dtype == ms.float32:
        return 0
    if dtype == ms.float16:
        return 1
    if dtype == ms.bfloat16:
        return 2
    if dtype == ms.float64:
        return 3
    if dtype == ms.int32:
        return 4
    if dtype == ms.int64:
        return 5
    if dtype == ms.bool_:
        return 6
    return 7


def _is_float(dtype: Any) -> bool:
    return dtype in (ms.float32, ms.float16, ms.bfloat16, ms.float64)


class GradTap(nn.Cell):
    """Identity forward; its ``bprop`` assigns the statistics of the gradient into ``store`` (an input: a
    ``bprop`` may not use the Cell's own Parameters) and passes the gradient on unchanged."""

    def construct(self, x: Tensor, store: Parameter) -> Tensor:
        return x

    def bprop(self, x: Tensor, store: Parameter, out: Tensor, dout: Tensor) -> tuple[Tensor, Tensor]:
        dout = ops.depend(dout, ops.assign(store, graph_stats(dout)))
        return dout, ops.zeros_like(store)


class CaptureCell(nn.Cell):
    """``inner`` with the statistics of its outputs (and of their gradients) assigned into Parameters."""

    def __init__(self, inner: nn.Cell, name: str, backward: bool) -> None:
        super().__init__(auto_prefix=False)
        self.inner = inner
        self.backward = backward
        self.xf_fstats = Parameter(Tensor(np.zeros((SLOTS, _STAT_COLS), np.float32)), requires_grad=False,
                                   name=f"xf_capture.{name}.forward")
        self.xf_fmeta = Parameter(Tensor(np.zeros((SLOTS, _META_COLS), np.int32)), requires_grad=False,
                                  name=f"xf_capture.{name}.meta")
        self.xf_gstats = ms.ParameterTuple(
            Parameter(Tensor(np.zeros(_STAT_COLS, np.float32)), requires_grad=False,
                      name=f"xf_capture.{name}.backward.{i}") for i in range(SLOTS))
        self.taps = nn.CellList([GradTap() for _ in range(SLOTS)])

    def construct(self, *args: Any, **kwargs: Any) -> Any:
        out = self.inner(*args, **kwargs)
        single = isinstance(out, Tensor)
        items = (out,) if single else out
        stats = ()
        metas = ()
        new = ()
        for i, x in enumerate(items):
            if i < SLOTS and isinstance(x, Tensor):
                shape = x.shape
                dims = shape + (-1,) * (MAX_RANK - len(shape))
                stats = stats + (graph_stats(x),)
                metas = metas + (Tensor((1, _dtype_code(x.dtype), len(shape)) + dims, ms.int32),)
                if self.backward and _is_float(x.dtype):
                    x = self.taps[i](x, self.xf_gstats[i])
            else:
                stats = stats + (ops.zeros((_STAT_COLS,), ms.float32),)
                metas = metas + (ops.zeros((_META_COLS,), ms.int32),)
            new = new + (x,)
        for _ in range(SLOTS - len(items)):
            stats = stats + (ops.zeros((_STAT_COLS,), ms.float32),)
            metas = metas + (ops.zeros((_META_COLS,), ms.int32),)
        done = ops.depend(ops.assign(self.xf_fstats, ops.stack(stats[:SLOTS])),
                          ops.assign(self.xf_fmeta, ops.stack(metas[:SLOTS])))
        kept = ()
        for x in new:
            if isinstance(x, Tensor):
                x = ops.depend(x, done)
            kept = kept + (x,)
        if single:
            return kept[0]
        return kept


def _unwrap(cell: nn.Cell) -> nn.Cell:
    """The model's own cell inside the capture wrappers (a layer capture may wrap a router capture)."""
    while isinstance(cell, (CaptureCell, RouterCaptureCell)):
        cell = cell.inner
    return cell


def _logical_cells(cell: nn.Cell, prefix: str = "") -> list[tuple[str, nn.Cell, str, nn.Cell]]:
    """(name as cells_and_names gives it without any capture, parent, attribute, child) of every cell below
    ``cell``, pre-order; a :class:`CaptureCell` or :class:`RouterCaptureCell` stands for the cell it wraps (its
    name, its children)."""
    out = []
    for attr, child in cell._cells.items():   # noqa: SLF001 - CellList children are only reachable this way
        if child is None:
            continue
        name = f"{prefix}{attr}"
        out.append((name, cell, attr, child))
        out.extend(_logical_cells(_unwrap(child), name + "."))
    return out


class GraphLayerCapture:
    """Wraps the cells of ``net`` whose names match ``patterns`` in :class:`CaptureCell`; call before the
    training cell is first compiled. Cells already wrapped (a second dumper on the same net) are reused, so
    the compiled graph stays valid. Parameter names of the model are kept; the capture's own Parameters
    (``xf_capture.<cell>.*``, requires_grad False, not in ``trainable_params()``) are new.
    :meth:`remove` puts the original cells back (before saving a checkpoint, say).

    Limits: a cell called several times in a step (RoPE applied to q and k) keeps its last call; statistics
    of the first ``SLOTS`` top-level outputs only; rows in cell order with every cell after its children
    (the execution order of a transformer's leaves, not of sibling cells called out of definition order)."""

    def __init__(self, net: nn.Cell, patterns: Sequence[str] = ("*",), *, backward: bool = True) -> None:
        self.net = net
        names = {id(p): p.name for p in net.get_parameters()}
        # Containers (CellList, CellDict) are indexed, never called: wrapping one would break ``layers[i]``.
        chosen = [(n, parent, attr, child) for n, parent, attr, child in _logical_cells(net)
                  if any(fnmatch.fnmatchcase(n, p) for p in patterns)
                  and not isinstance(child, (nn.CellList, nn.CellDict))]
        self.cells: dict[str, CaptureCell] = {}
        # Deepest first: a parent is wrapped after its children (the walk above saw the unwrapped tree).
        for name, parent, attr, child in sorted(chosen, key=lambda c: -c[0].count(".")):
            if isinstance(child, CaptureCell):
                self.cells[name] = child
                continue
            wrapper = CaptureCell(child, name, backward)
            parent.insert_child_to_cell(attr, wrapper)
            self.cells[name] = wrapper
        self.order = _post_order([c[0] for c in chosen])
        self._names = names
        keep_names(net, names)
        for name, w in self.cells.items():
            w.xf_fstats.name = f"xf_capture.{name}.forward"
            w.xf_fmeta.name = f"xf_capture.{name}.meta"
            for i, g in enumerate(w.xf_gstats):
                g.name = f"xf_capture.{name}.backward.{i}"

    def reset_backward(self) -> None:
        """Mark every gradient row unwritten (before a captured step: a gradient that never flows stays so)."""
        for w in self.cells.values():
            for g in w.xf_gstats:
                g.set_data(Tensor(np.zeros(_STAT_COLS, np.float32)))

    def read(self) -> list[dict[str, Any]]:
        """This step's rows: forward outputs in watch order, then output gradients in reverse (backward) order
        (the PYNATIVE hooks' order), each {module, kind, dtype, shape, numel, max, min, mean, norm, nan, inf}."""
        compiled_names(self.net, self._names)
        fwd, bwd = [], []
        for name in self.order:
            w = self.cells[name]
            stats, meta = w.xf_fstats.asnumpy(), w.xf_fmeta.asnumpy()
            grads = [g.asnumpy() for g in w.xf_gstats]
            for i in range(SLOTS):
                if meta[i, 0] != 1:
                    continue
                ndim = int(meta[i, 2])
                shape = [int(d) for d in meta[i, 3:3 + ndim]]
                base = {"module": name, "dtype": _DTYPES[int(meta[i, 1])],
                        "shape": "x".join(str(d) for d in shape) or "scalar", "numel": int(np.prod(shape))}
                fwd.append({**base, "kind": f"forward.output.{i}", **_stats(stats[i])})
                if w.backward and grads[i][6] == 1:
                    bwd.append({**base, "kind": f"backward.grad_output.{i}", **_stats(grads[i])})
        return fwd + bwd[::-1]

    def remove(self) -> None:
        """Put the original cells back (their Parameters keep their names); recompiles the training cell."""
        names = {id(p): p.name for p in self.net.get_parameters()}
        for name, parent, attr, child in _logical_cells(self.net):
            if isinstance(child, CaptureCell) and name in self.cells:
                parent.insert_child_to_cell(attr, child.inner)
        self.cells = {}
        keep_names(self.net, names)


def keep_names(net: nn.Cell, names: dict[int, str]) -> None:
    """Give every Parameter of ``net`` in ``names`` (by id) that name back: inserting a wrapper cell re-prefixes
    the names below it."""
    for p in net.get_parameters():
        if id(p) in names and p.name != names[id(p)]:
            p.name = names[id(p)]


def compiled_names(net: nn.Cell, names: dict[int, str]) -> None:
    """After the first GRAPH compile: the Parameters it renamed by their cell path (a graph assigns to them: the MoE
    routers' ``fi_accu``, ``expert_bias``, ``expert_load``) lose the wrappers' ``inner`` segments, so they carry a
    plain run's names (measured: ``...layers.0.mlp.inner.router.fi_accu``; a plain run's
    ``...layers.0.mlp.router.fi_accu``), as a checkpoint saved from the run would. Renaming after the compile
    leaves the steps bit-identical (measured, dumpers/mindspore_kernel_dump.py restore_names)."""
    for p in net.get_parameters():
        if id(p) in names and p.name != names[id(p)] and ".inner." in p.name:
            p.name = p.name.replace(".inner.", ".")


def _post_order(names: list[str]) -> list[str]:
    """Pre-order cell names (cells_and_names) with every cell after the cells inside it: a cell's output
    is complete after its children's, as the PYNATIVE forward hooks record them."""
    out: list[str] = []
    stack: list[str] = []
    for n in names:
        while stack and not n.startswith(stack[-1] + "."):
            out.append(stack.pop())
        stack.append(n)
    out.extend(reversed(stack))
    return out


def _stats(row: np.ndarray) -> dict[str, Any]:
    return {"max": float(row[0]), "min": float(row[1]), "mean": float(row[2]), "norm": float(row[3]),
            "nan": int(row[4]), "inf": int(row[5])}


# ---------------------------------------------------------------------------------------------------------
# MoE routing (DumpConfig.routing): each router's logits, choices and probabilities, full, inside the graph
# ---------------------------------------------------------------------------------------------------------

ROUTER_MECHANISM = ("MindFormers TopKRouter wrapped: its logits (its own gating, again, outside autodiff), top-k "
                    "expert index and probabilities assigned into Parameters in the graph")


def is_router(cell: nn.Cell) -> bool:
    """A MindFormers mcore top-k router (``gating`` + ``routing`` + ``num_experts_chosen``), wrapped or not."""
    inner = cell.inner if isinstance(cell, RouterCaptureCell) else cell
    return (callable(getattr(inner, "gating", None)) and callable(getattr(inner, "routing", None))
            and isinstance(getattr(inner, "num_experts_chosen", None), int)
            and isinstance(getattr(inner, "expert_dim", None), int))


class RouterCaptureCell(nn.Cell):
    """``inner`` (a TopKRouter returning ``(expert_index, probs, aux_loss)``) with its logits [tokens, E], its
    expert index and probabilities [tokens, k] assigned into Parameters each call (the last call of a step
    stays). The logits come from the router's own ``gating`` called again on the same input (the same ops,
    the same dtype: MindFormers' router does not return them). Shapes are fixed before compiling: ``tokens``
    per call (micro-batch x sequence); a call of another size leaves the Parameters unwritten (compile-time
    branch), it never fails the step."""

    def __init__(self, inner: nn.Cell, name: str, tokens: int) -> None:
        super().__init__(auto_prefix=False)
        self.inner = inner
        self.tokens = int(tokens)
        self.experts = int(inner.expert_dim)
        self.k = int(inner.num_experts_chosen)
        self.xf_logits = Parameter(Tensor(np.zeros((self.tokens, self.experts), np.float32)), requires_grad=False,
                                   name=f"xf_router.{name}.logits")
        self.xf_index = Parameter(Tensor(np.zeros((self.tokens, self.k), np.int32)), requires_grad=False,
                                  name=f"xf_router.{name}.index")
        self.xf_probs = Parameter(Tensor(np.zeros((self.tokens, self.k), np.float32)), requires_grad=False,
                                  name=f"xf_router.{name}.probs")
        # written (1), logits dtype code, probs dtype code
        self.xf_meta = Parameter(Tensor(np.zeros(3, np.int32)), requires_grad=False, name=f"xf_router.{name}.meta")

    def construct(self, *args: Any) -> Any:
        out = self.inner(*args)
        index, probs = out[0], out[1]
        if index.size == self.tokens * self.k:
            logits = ops.stop_gradient(self.inner.gating(args[0]))
            meta = Tensor((1, _dtype_code(logits.dtype), _dtype_code(probs.dtype)), ms.int32)
            done = ops.depend(
                ops.assign(self.xf_logits, ops.reshape(ops.cast(logits, ms.float32), (self.tokens, self.experts))),
                ops.assign(self.xf_index, ops.reshape(ops.cast(ops.stop_gradient(index), ms.int32),
                                                      (self.tokens, self.k))))
            done = ops.depend(done, ops.assign(self.xf_probs, ops.reshape(
                ops.cast(ops.stop_gradient(probs), ms.float32), (self.tokens, self.k))))
            done = ops.depend(done, ops.assign(self.xf_meta, meta))
            return (ops.depend(out[0], done),) + tuple(out[1:])
        return out


class RouterCapture:
    """Wraps every router below ``net`` in :class:`RouterCaptureCell` (before the first compile; routers
    already wrapped are reused) and reads the records after a step. ``tokens``: tokens per router call
    (default: the router's ``config.batch_size * seq_length``; the MoE layer gives the router the micro-batch's
    tokens batch-major, ``b * seq + s``)."""

    def __init__(self, net: nn.Cell, tokens: int | None = None) -> None:
        self.net = net
        names = {id(p): p.name for p in net.get_parameters()}
        self.cells: dict[str, RouterCaptureCell] = {}
        self.seq: dict[str, int] = {}
        for name, parent, attr, child in _logical_cells(net):
            while isinstance(child, CaptureCell):      # a layer capture around the router: wrap inside it
                parent, attr, child = child, "inner", child.inner
            if not is_router(child):
                continue
            if isinstance(child, RouterCaptureCell):
                self.cells[name] = child
                continue
            cfg = getattr(child, "config", None)
            seq = int(getattr(child, "seq_length", 0) or getattr(cfg, "seq_length", 0) or 0)
            n = tokens if tokens is not None else seq * int(getattr(cfg, "batch_size", 1) or 1)
            wrapper = RouterCaptureCell(child, name, n)
            parent.insert_child_to_cell(attr, wrapper)
            self.cells[name] = wrapper
            self.seq[name] = seq
        self._names = names
        keep_names(net, names)
        for name, w in self.cells.items():
            for attr in ("logits", "index", "probs", "meta"):
                getattr(w, f"xf_{attr}").name = f"xf_router.{name}.{attr}"

    def reset(self) -> None:
        """Mark every record unwritten (before a captured step)."""
        for w in self.cells.values():
            w.xf_meta.set_data(Tensor(np.zeros(3, np.int32)))

    def read(self) -> list[Any]:
        """This step's records (runstore.routing.RouterRecord), one per router the step called."""
        from runstore.routing import make_record

        compiled_names(self.net, self._names)
        out = []
        for name, w in self.cells.items():
            meta = w.xf_meta.asnumpy()
            if meta[0] != 1:
                continue
            inner = w.inner
            seq = self.seq.get(name) or w.tokens
            out.append(make_record(name, w.xf_logits.asnumpy(), w.xf_index.asnumpy(), w.xf_probs.asnumpy(),
                                   logits_dtype=_DTYPES[int(meta[1])], probs_dtype=_DTYPES[int(meta[2])],
                                   score_function="sigmoid" if getattr(inner, "use_gating_sigmoid", False)
                                   else "softmax", topk=w.k, batch=max(1, w.tokens // seq), seq=seq, calls=1))
        return out

    def counts(self) -> dict[str, np.ndarray]:
        """This step's tokens per expert of every router the step called (the expert index only: cheap)."""
        compiled_names(self.net, self._names)
        out = {}
        for name, w in self.cells.items():
            if w.xf_meta.asnumpy()[0] != 1:
                continue
            idx = w.xf_index.asnumpy().ravel()
            out[name] = np.bincount(idx[(idx >= 0) & (idx < w.experts)], minlength=w.experts).astype(np.int64)
        return out

    def remove(self) -> None:
        """Put the original routers back (their Parameters keep their names)."""
        names = {id(p): p.name for p in self.net.get_parameters()}
        for name, parent, attr, child in _logical_cells(self.net):
            while isinstance(child, CaptureCell):
                parent, attr, child = child, "inner", child.inner
            if isinstance(child, RouterCaptureCell) and name in self.cells:
                parent.insert_child_to_cell(attr, child.inner)
        self.cells = {}
        keep_names(self.net, names)
