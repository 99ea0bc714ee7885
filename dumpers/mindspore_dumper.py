"""Dumper for any MindSpore Cell: named local norms, layer tensors (PYNATIVE), NaN/Inf tracing, batches.

Why: the candidate side of an alignment needs, per step and rank, the L2 norm of every parameter's gradient
under the parameter's own name, the forward outputs and output gradients of chosen cells, and - when a
gradient goes non-finite - which parameter, which cell and which rank. Everything lands in the run store
(docs/run-store.md), so the comparators never import MindSpore.

Rules kept here: a dumper never crashes the training run (every failure becomes one warning and the
dumper switches itself off) and never changes numerics (hooks return ``None``; tensors are copied to host).

Two ways to feed gradients:

* a plain ``value_and_grad`` loop: ``dumper.record_grads(grads)`` (host-side float64 norms);
* a training cell: :class:`NormTrainOneStepCell` returns per-parameter squared sums computed in the graph
  (works in GRAPH and PYNATIVE, with ``Model.train`` / MindFormers' Trainer), named by the cell's weights;
  MFTrainOneStepCell's ``local_norm=True`` outputs are named the same way (see dumpers/mindformers.py).

Stacked expert Parameters (MindFormers' ``mlp.experts.weight1/2``, every routed expert of a layer) are
recorded one row per expert, ``NAME[e]``: from the host gradients in ``record_grads``, and from a
MindFormers training cell after :meth:`MindSporeDumper.watch_train_cell` (dumpers/mindspore_expert_norms.py).
"""

from __future__ import annotations

import fnmatch
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from dumpers.contract import DumpConfig, NonFiniteError, StepBookkeeping, dumps_rank, merge_micro_batches, open_writer
from dumpers.mindformers_layer_split import activation_split
from dumpers.mindspore_expert_norms import MECHANISM as EXPERT_MECHANISM
from dumpers.mindspore_expert_norms import host_squares, split_rows, stacked_experts
from dumpers.mindspore_expert_norms import install as install_expert_norms
from dumpers.mindspore_graph_capture import MECHANISM as GRAPH_MECHANISM
from dumpers.mindspore_graph_capture import ROUTER_MECHANISM, GraphLayerCapture, RouterCapture
from runstore import RANK_DIR, SEED_BATCH_KEYS, BackgroundWriter, RunWriter, atomic_write_json
from runstore.routing import put_counts, put_routing

PYNATIVE_MECHANISM = "Cell.register_forward_hook (outputs) and Tensor.register_hook (output gradients)"
_FLOAT_DTYPES = (ms.float16, ms.float32, ms.float64, ms.bfloat16)


class LayerCaptureError(RuntimeError):
    """Layer capture was asked for where it cannot run (GRAPH mode compiles Python hooks away)."""


def dtype_name(dtype: Any) -> str:
    """MindSpore's dtype spelling normalised to the run store's: Float32 -> float32, BFloat16 -> bfloat16."""
    return str(dtype).lower()


def to_numpy(t: Any) -> np.ndarray:
    """A host copy; bfloat16 (no numpy dtype) goes through float32."""
    if isinstance(t, Tensor):
        if t.dtype == ms.bfloat16:
            t = t.astype(ms.float32)
        return np.array(t.asnumpy(), copy=True)
    return np.array(t, copy=True)


def array_stats(a: np.ndarray) -> dict[str, float]:
    """max/min/mean/L2 over the finite values, plus nan/inf counts (float64 on host)."""
    x = np.asarray(a)
    if x.dtype.kind not in "fc":
        x = x.astype(np.float64)
    nan = int(np.isnan(x).sum())
    inf = int(np.isinf(x).sum())
    finite = x[np.isfinite(x)].astype(np.float64) if (nan or inf) else x.astype(np.float64, copy=False)
    if finite.size == 0:
        return {"max": np.nan, "min": np.nan, "mean": np.nan, "norm": np.nan, "nan": nan, "inf": inf}
    return {"max": float(finite.max()), "min": float(finite.min()), "mean": float(finite.mean()),
            "norm": float(np.sqrt(np.sum(finite * finite))), "nan": nan, "inf": inf}


def _flatten(obj: Any, prefix: str = "") -> list[tuple[str, Tensor]]:
    out: list[tuple[str, Tensor]] = []
    if isinstance(obj, Tensor):
        out.append((prefix or "0", obj))
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            out.extend(_flatten(item, f"{prefix}.{i}" if prefix else str(i)))
    return out


def _str_col(values: Sequence[str]) -> np.ndarray:
    """Strings as a numpy unicode array: the run store turns those into HDF5 strings (never objects)."""
    return np.asarray([str(v) for v in values], dtype=str)


def param_owners(net: nn.Cell) -> dict[str, str]:
    """Parameter name -> name of the cell that holds it (the cell that 'produced' its gradient)."""
    owners: dict[str, str] = {}
    for cell_name, cell in net.cells_and_names():
        for param in cell.get_parameters(expand=False):
            owners.setdefault(param.name, cell_name)
    return owners


_square_sum = ops.MultitypeFuncGraph("square_sum")


@_square_sum.register("Tensor")
def _square_sum_tensor(grad: Tensor) -> Tensor:
    g = ops.cast(grad, ms.float32)
    return ops.reduce_sum(g * g)


class NormTrainOneStepCell(nn.TrainOneStepCell):
    """nn.TrainOneStepCell that also returns every gradient's squared sum, in ``self.weights`` order.

    Why a cell: in GRAPH mode (and under ``Model.train`` / Trainer) gradients never reach Python; the
    squared sums are computed in the graph before the optimizer and returned as one float32 vector. The
    names are ``[p.name for p in cell.weights]`` (:meth:`param_names`); ``sqrt(sum)`` is the global norm.
    """

    def __init__(self, network: nn.Cell, optimizer: nn.Optimizer, sens: float | None = None) -> None:
        super().__init__(network, optimizer, sens=sens)
        self.hyper_map = ops.HyperMap()
        self.stack = ops.Stack()

    def construct(self, *inputs: Any) -> tuple[Tensor, Tensor]:
        loss = self.network(*inputs)
        sens = ops.fill(loss.dtype, loss.shape, self.sens) if self.sens is not None else ops.ones_like(loss)
        grads = self.grad(self.network, self.weights)(*inputs, sens)
        grads = self.grad_reducer(grads)
        square_sums = self.stack(self.hyper_map(_square_sum, grads))
        loss = ops.depend(loss, self.optimizer(grads))
        return loss, square_sums

    def param_names(self) -> list[str]:
        return [p.name for p in self.weights]


def mindspore_rank() -> int | None:
    """This process's rank from MindSpore's communication (msrun + ``init()``), or None before ``init()``."""
    try:
        from mindspore.communication import management
    except ImportError:  # pragma: no cover - a MindSpore build without communication
        return None
    try:
        if getattr(management.GlobalComm, "INITED", False):
            return int(management.get_rank())
    except Exception:  # noqa: BLE001 - never let rank lookup break a training run
        return None
    return None


def rank_coordinates(rank: int | None = None, tp: int = 1, pp: int = 1, strategy: Any = None) -> dict[str, int]:
    """Global rank (MindSpore's get_rank() once communication is up, else RANK_ID / RANK, else 0) and its
    tp/pp/dp coordinates: under a MindFormers ``strategy`` (models.mindformers_parallel.ParallelStrategy)
    MindFormers' own order, stage-major, (dp, cp, tp) inside a stage (``ParallelStrategy.coords``: the wheel's
    models/utils.py ``get_current_rank_stage`` and parallel_core/training_graph/device_matrix.py), with every
    group's size; else Megatron's tp-fastest order (tp, pp only)."""
    if rank is None:
        rank = mindspore_rank()
    if rank is None:
        rank = int(os.environ.get("RANK_ID") or os.environ.get("RANK") or 0)
    if strategy is not None:
        c = strategy.coords(rank)
        c.pop("rank_in_stage", None)
        return {**c, "cp_size": strategy.cp}
    return {"rank": rank, "tp_rank": rank % tp, "pp_rank": (rank // tp) % pp, "dp_rank": rank // (tp * pp),
            "tp_size": tp, "pp_size": pp}


def rank_file_info(coords: Mapping[str, int], world_size: int) -> dict[str, int]:
    """A rank file's content from the dumper's coordinates: each ``*_rank`` and its group's size under both
    spellings (``tp_size``, and ``tp`` as Megatron's dumper and sources.layers read it)."""
    info = {k: int(v) for k, v in coords.items() if k != "rank"}
    for key in [k for k in info if k.endswith("_size")]:
        info[key[:-5]] = info[key]
    info["world_size"] = int(world_size)
    return info


class MindSporeDumper(StepBookkeeping):
    """Dumps batches, named local norms, layer tensors and NaN traces of one rank into a run store.

    ``net``: the Cell being trained (for layer hooks and parameter -> cell names); ``out``: run-store dir
    (default: ``config.out``). A rank not in ``config.ranks`` writes nothing (``writer`` is None).
    Use per step: ``begin_step(n)`` ... ``record_batch`` / ``record_grads`` / ``record_local_norms`` /
    ``log`` ... ``end_step(loss=...)``, or the :meth:`step` context manager, or :class:`DumperCallback`.
    """

    def __init__(self, net: nn.Cell | None, out: str | os.PathLike | None = None, config: DumpConfig | None = None, *,
                 rank: int | None = None, tp: int = 1, pp: int = 1, world_size: int | None = None,
                 framework: str = "mindspore", name_scheme: str = "mindspore", graph_capture: bool = False,
                 strategy: Any = None) -> None:
        self.config = config or DumpConfig()
        self.strategy = strategy      # a MindFormers ParallelStrategy: coordinates and each layer row's slice
        self.graph_capture = graph_capture
        self._graph: Any = None
        self._router: RouterCapture | None = None
        self._routes: list[Any] = []
        self._route_counts: dict[str, np.ndarray] = {}
        out = out if out is not None else self.config.out
        if out is None:
            raise ValueError("MindSporeDumper needs the run-store directory (out, or DumpConfig.out)")
        self.net = net
        self.coords = rank_coordinates(rank, tp, pp, strategy)
        self.enabled = dumps_rank(self.config, self.coords["rank"])
        self._select_steps()
        self._handles: list[Any] = []
        self._rows: list[dict[str, Any]] = []
        self._trace_rows: list[dict[str, Any]] = []
        self._trace_tensors: list[tuple[np.ndarray, str, str]] = []
        self._batch: dict[str, list[np.ndarray]] = {}
        self._scalars: dict[str, Any] = {}
        self._norms_done = False
        self._experts: Any = None          # ExpertNorms installed in a training cell (watch_train_cell)
        self._stacked: dict[str, int] | None = None   # stacked expert Parameters of ``net`` (record_grads)
        self._owners = param_owners(net) if net is not None else {}
        ws = world_size if world_size is not None else int(os.environ.get("RANK_SIZE")
                                                            or os.environ.get("WORLD_SIZE") or 1)
        par = strategy.meta() if strategy is not None else \
            {"tp": tp, "pp": pp, "dp": max(1, ws // (tp * pp)), "world_size": ws}
        self._world = ws
        meta = {"framework": framework, "versions": {"mindspore": ms.__version__}, "parallel": par,
                "name_scheme": name_scheme, "source": {"kind": "dumper", "path": str(out)}}
        capture = self.config.tensors != "off" or self.config.nan_trace == "all"
        if capture:
            graph = ms.get_context("mode") != ms.PYNATIVE_MODE
            meta["layer_capture"] = {"mode": "GRAPH" if graph else "PYNATIVE",
                                     "mechanism": GRAPH_MECHANISM if graph else PYNATIVE_MECHANISM}
        if self.config.routing:
            meta["routing_capture"] = {"mechanism": ROUTER_MECHANISM}
        meta.update(self.config.meta)
        rank_info = rank_file_info(self.coords, ws)
        self.writer: RunWriter | BackgroundWriter | None = None
        if not self.enabled:
            return
        self.writer = open_writer(out, rank=self.coords["rank"], meta=meta, rank_info=rank_info,
                                  background=self.config.background_writes)
        if self.config.routing and net is not None:
            try:    # before the layer capture: a layer capture of the router then wraps the router capture
                self._router = RouterCapture(net)
                if not self._router.cells:
                    warnings.warn("MindSporeDumper: routing=True but the network has no top-k router",
                                  RuntimeWarning, stacklevel=2)
            except Exception as exc:  # noqa: BLE001 - the run goes on without routing evidence
                warnings.warn(f"MindSporeDumper: routing capture not installed ({exc!r})", RuntimeWarning,
                              stacklevel=2)
                self._router = None
        if capture:
            self.watch(net)
        if self.config.capture_env:
            self.capture_environment(seeds=self.config.meta.get("seed"))

    def capture_environment(self, seeds: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
        """Write the cluster capture (``DumpConfig.capture_env``) into meta.json ``environment`` (rank 0): this
        process's variables, versions and settings, the generators as they are now (``seeds``: the record
        ``seed_everything`` returned), ``capture_env_data`` hashed and, with ``capture_env_weights``, every
        trainable parameter's fingerprint by its name (this rank's shards under TP / PP)."""
        if self.writer is None or self.coords["rank"] != 0:
            return None
        try:
            from dumpers.environment import capture_environment

            weights = None
            if self.config.capture_env_weights and self.net is not None:
                weights = [(p.name, (lambda p=p: to_numpy(p)), dtype_name(p.dtype))
                           for p in self.net.trainable_params()]
            par = {"tp": self.coords["tp_size"], "pp": self.coords["pp_size"]}
            capture = capture_environment("mindspore", by=type(self).__name__, data=self.config.capture_env_data,
                                          weights=weights, weights_source="model parameters at capture",
                                          parallel=par, seeds=seeds)
            self.writer.update_meta({"environment": capture})
            return capture
        except Exception as exc:  # noqa: BLE001 - never take the training run down; the dump goes on without it
            warnings.warn(f"MindSporeDumper: environment capture failed ({exc!r}); dumping goes on without it",
                          RuntimeWarning, stacklevel=2)
            return None

    # -- failure policy ---------------------------------------------------------------------------------
    def _fail(self, what: str, exc: BaseException) -> None:
        """Never take the training run down: warn once, stop dumping, leave completed steps readable."""
        if self.enabled:
            warnings.warn(f"MindSporeDumper disabled after an error in {what}: {exc!r}", RuntimeWarning,
                          stacklevel=2)
        self.enabled = False
        self.unwatch()
        abandon = getattr(self.writer, "abandon_step", None)
        try:
            if abandon is not None:
                abandon()
        except Exception:  # noqa: BLE001 - best effort; the step simply stays incomplete
            pass

    def update_meta(self, values: Mapping[str, Any]) -> None:
        if self.writer is None:
            return
        try:
            self.writer.update_meta(values)
        except Exception as exc:  # noqa: BLE001
            self._fail("update_meta", exc)

    def set_strategy(self, strategy: Any) -> None:
        """The run's MindFormers strategy, once known (the callback reads it from the compiled training cell):
        this rank's coordinates in MindFormers' order, its rank file and meta ``parallel`` rewritten, and every
        layer row written from now on (this step's too) carries its ``split``. The same strategy again: nothing."""
        if strategy is None or strategy == self.strategy:
            return
        self.strategy = strategy
        self.coords = rank_coordinates(self.coords["rank"], strategy=strategy)
        if self.writer is None:
            return
        try:
            root = getattr(self.writer, "root", None) or self.writer.writer.root
            atomic_write_json(root / RANK_DIR / f"rank_{self.coords['rank']:05d}.json",
                              {"rank": self.coords["rank"], "pid": os.getpid(),
                               **rank_file_info(self.coords, max(self._world, strategy.world))})
            if self.coords["rank"] == 0:
                self.writer.update_meta({"parallel": strategy.meta()})
        except Exception as exc:  # noqa: BLE001
            self._fail("set_strategy", exc)

    def _split(self, row: Mapping[str, Any]) -> str:
        """A layer row's ``split`` under the strategy (dumpers/mindformers_layer_split.py); "" without one."""
        s = self.strategy
        if s is None:
            return ""
        ndim = 0 if row["shape"] == "scalar" else len(str(row["shape"]).split("x"))
        floating = str(row["dtype"]).startswith(("float", "bfloat"))
        return activation_split(row["module"], ndim, floating, tp=s.tp, cp=s.cp, sp=bool(s.use_seq_parallel))

    # -- layer hooks --------------------------------------------------------------------------------------
    def watch(self, net: nn.Cell | None) -> None:
        """Hook the selected cells (PYNATIVE), or wrap them for in-graph capture (GRAPH with
        ``graph_capture=True``: call before the training cell is first compiled). Raises LayerCaptureError in
        GRAPH mode otherwise (hooks would silently not run), and for full tensors in GRAPH."""
        if net is None:
            raise LayerCaptureError("layer capture needs the network Cell (MindSporeDumper(net, ...))")
        patterns = tuple(self.config.modules)
        if ms.get_context("mode") != ms.PYNATIVE_MODE:
            if not self.graph_capture:
                raise LayerCaptureError(
                    "layer capture (tensors='stats'/'full' or nan_trace='all') in GRAPH mode compiles Cell hooks "
                    "away, so nothing would be captured: pass graph_capture=True (statistics computed inside "
                    "the graph; wraps the watched cells before the first compile), or use PYNATIVE mode "
                    "(ms.set_context(mode=ms.PYNATIVE_MODE)) for the capture steps, or tensors='off'")
            if self.config.tensors == "full":
                raise LayerCaptureError("tensors='full' needs PYNATIVE mode: the GRAPH capture stores "
                                        "statistics only (tensors='stats')")
            self.unwatch()
            self._graph = GraphLayerCapture(net, patterns, backward=self.config.backward)
            if not self._graph.cells:
                warnings.warn(f"MindSporeDumper: no cell matched {patterns}", RuntimeWarning, stacklevel=2)
            return
        self.unwatch()
        for name, cell in net.cells_and_names():
            if not name or not any(fnmatch.fnmatchcase(name, p) for p in patterns):
                continue
            self._handles.append(cell.register_forward_hook(self._forward_hook(name)))
        if not self._handles:
            warnings.warn(f"MindSporeDumper: no cell matched {patterns}", RuntimeWarning, stacklevel=2)

    def watch_train_cell(self, cell: nn.Cell) -> None:
        """Record stacked expert Parameters' local norms per expert (``NAME[e]`` rows) from a MindFormers
        training cell with ``local_norm=True``; call before its first compile (dumpers/mindspore_expert_norms.py).
        A cell without LocalNorm or a model without stacked experts is left as it is."""
        if not self.enabled:
            return
        try:
            self._experts = install_expert_norms(cell)
            if self._experts is not None:
                self.update_meta({"expert_norms": {"parameters": len(self._experts.names),
                                                   "mechanism": EXPERT_MECHANISM}})
        except Exception as exc:  # noqa: BLE001 - the run goes on with one norm per stacked Parameter
            self._experts = None
            warnings.warn(f"MindSporeDumper: per-expert norms not installed ({exc!r}); stacked experts keep one "
                          "norm each", RuntimeWarning, stacklevel=2)

    def unwatch(self) -> None:
        """Remove the hooks; a GRAPH capture keeps its wrappers (the graph is compiled with them) and stops
        being read."""
        self._graph = None
        for handle in self._handles:
            try:
                handle.remove()
            except Exception:  # noqa: BLE001
                pass
        self._handles = []

    def _capturing(self) -> bool:
        return self.enabled and self._step is not None and (
            self._tensor_step or self.config.nan_trace == "all")

    def _forward_hook(self, name: str) -> Any:
        def hook(cell: nn.Cell, args: Any, output: Any) -> None:
            if self._capturing():
                try:
                    for label, t in _flatten(output):
                        self._record_tensor(name, f"forward.output.{label}", t)
                        if self.config.backward and self._tensor_step and t.dtype in _FLOAT_DTYPES:
                            try:
                                t.register_hook(self._grad_hook(name, f"backward.grad_output.{label}"))
                            except RuntimeError:
                                pass  # no gradient flows into this output (constants such as rope tables)
                except Exception as exc:  # noqa: BLE001
                    self._fail(f"forward hook of {name}", exc)
            return None
        return hook

    def _grad_hook(self, name: str, kind: str) -> Any:
        """Output gradients via a hook on the output tensor, not Cell.register_backward_hook.

        Why: a Cell backward hook wraps the cell in an extra backward node, which changes the order in which
        MindSpore sums the gradient contributions of a tensor used inside and outside the cell (a residual
        stream into RMSNorm): the run's numbers move by an ulp. A tensor hook only reads the gradient.
        """
        def hook(grad: Tensor) -> None:
            if self._capturing():
                try:
                    self._record_tensor(name, kind, grad)
                except Exception as exc:  # noqa: BLE001
                    self._fail(f"backward hook of {name}", exc)
            return None
        return hook

    def _record_tensor(self, module: str, kind: str, t: Tensor) -> None:
        arr = to_numpy(t)
        stats = array_stats(arr)
        if (stats["nan"] or stats["inf"]) and self.config.nan_trace == "all" and not any(
                r["kind"] == "activation" for r in self._trace_rows):
            self._add_trace("activation", module, module,
                            f"{kind}: {stats['nan']} nan, {stats['inf']} inf of {arr.size}", arr, kind)
        if not self._tensor_step:
            return
        order = len(self._rows)
        self._rows.append({"order": order, "module": module, "kind": kind, "dtype": dtype_name(t.dtype),
                           "shape": "x".join(str(d) for d in arr.shape) or "scalar", "numel": int(arr.size),
                           **stats})
        if self.config.tensors == "full":
            data = arr.astype(np.float32) if arr.dtype.kind == "f" else arr
            self.writer.put_array(self._step, f"tensors/{order:06d}", data,
                                  attrs={"module": module, "kind": kind, "dtype": dtype_name(t.dtype),
                                         "order": order})

    # -- per step -------------------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        """Start step ``step`` (numbered from 1, like MindFormers' step)."""
        if not self.enabled:
            return
        self._open_step(step)
        self._rows, self._trace_rows, self._trace_tensors = [], [], []
        self._batch, self._scalars, self._norms_done = {}, {}, False
        if self._experts is not None:
            try:
                self._experts.reset()
            except Exception as exc:  # noqa: BLE001
                self._fail("expert norms reset", exc)
        self._routes, self._route_counts = [], {}
        if self._router is not None and self._array_step:
            try:
                self._router.reset()
            except Exception as exc:  # noqa: BLE001
                self._fail("routing capture reset", exc)
        if self._graph is not None and self._capturing():
            try:
                self._graph.reset_backward()
            except Exception as exc:  # noqa: BLE001
                self._fail("graph capture reset", exc)

    def _read_graph_capture(self) -> None:
        """The GRAPH capture's rows of the step that just ran, stored as the PYNATIVE hooks store them."""
        for row in self._graph.read():
            if (row["nan"] or row["inf"]) and self.config.nan_trace == "all" and not any(
                    r["kind"] == "activation" for r in self._trace_rows):
                self._add_trace("activation", row["module"], row["module"],
                                f"{row['kind']}: {row['nan']} nan, {row['inf']} inf of {row['numel']}", None,
                                row["kind"])
            if self._tensor_step:
                self._rows.append({"order": len(self._rows), **row})

    def record_batch(self, batch: Mapping[str, Any]) -> None:
        """Record one micro-batch as the model saw it (several are concatenated on dim 0)."""
        if not self.enabled or self._step is None:
            return
        try:
            for key, value in batch.items():
                if value is not None:
                    self._batch.setdefault(key, []).append(to_numpy(value))
        except Exception as exc:  # noqa: BLE001
            self._fail("record_batch", exc)

    def record_grads(self, grads: Sequence[Any], params: Sequence[Any] | None = None, *,
                     global_norm: float | None = None, where: str = "value_and_grad") -> None:
        """Named L2 norms of ``grads`` (in ``params`` order; default: the net's trainable_params)."""
        if not self.enabled or self._step is None or self._norms_done:
            return
        try:
            if params is None:
                if self.net is None:
                    raise ValueError("record_grads needs params when the dumper has no net")
                params = self.net.trainable_params()
            if len(params) != len(grads):
                raise ValueError(f"{len(grads)} gradients for {len(params)} parameters")
            names = [p.name for p in params]
            arrays = [to_numpy(g) for g in grads]
            norms = [float(np.sqrt(np.sum(np.square(a, dtype=np.float64)))) for a in arrays]
            if self._stacked is None:
                self._stacked = stacked_experts(self.net) if self.net is not None else {}
            squares = host_squares(names, arrays, self._stacked) if self._stacked else None
            self._store_norms(names, np.array(norms), [a.size for a in arrays], global_norm, where,
                              tensors=arrays, squares=squares, given="caller")
        except Exception as exc:  # noqa: BLE001
            self._fail("record_grads", exc)

    def record_local_norms(self, names: Sequence[str], norms: Any, numel: Sequence[int] | None = None, *,
                           squared: bool = False, global_norm: float | None = None,
                           where: str = "train_cell", columns: Mapping[str, Sequence[int]] | None = None,
                           attrs: Mapping[str, Any] | None = None) -> None:
        """Named norms computed elsewhere (a training cell's output); ``squared`` = squared sums given.
        ``columns``: per-row layout (``tp_partition_dim``, ``tp_rank``, ``tp_size``, ``dp_shard``, ``dp_rank``,
        ``dp_size``) when the rank holds parts of parameters; ``attrs``: table attributes (``grad_state``)."""
        if not self.enabled or self._step is None or self._norms_done:
            return
        try:
            vals = np.asarray(to_numpy(norms), dtype=np.float64).reshape(-1)
            if len(vals) != len(names):
                raise ValueError(f"{len(vals)} norms for {len(names)} names")
            if squared:
                vals = np.sqrt(vals)
            if numel is None:
                numel = [-1] * len(names)
            squares = self._experts.read() if self._experts is not None else None
            self._store_norms(list(names), vals, list(numel), global_norm, where, columns=columns, attrs=attrs,
                              squares=squares, given="train_cell")
        except Exception as exc:  # noqa: BLE001
            self._fail("record_local_norms", exc)

    def _store_norms(self, names: list[str], norms: np.ndarray, numel: Sequence[int],
                     global_norm: float | None, where: str,
                     tensors: Sequence[np.ndarray] | None = None, columns: Mapping[str, Sequence[int]] | None = None,
                     attrs: Mapping[str, Any] | None = None, squares: Mapping[str, np.ndarray] | None = None,
                     given: str = "caller") -> None:
        self._norms_done = True
        bad = [i for i, v in enumerate(norms) if not np.isfinite(v)]
        self._scalars["nonfinite_grads"] = len(bad)
        # where the global norm came from: the training cell's own (or the caller's), or computed here from these
        # same norms (then it checks nothing: comparators.evidence_totals)
        source = given if global_norm is not None else "local"
        if global_norm is None and not bad:
            global_norm = float(np.sqrt(np.sum(norms * norms)))
        if global_norm is not None:
            self._scalars.setdefault("grad_norm", float(global_norm))
        if bad and self.config.nan_trace != "off":
            i = bad[0]
            detail = f"gradient L2 norm {norms[i]} ({len(bad)} parameter(s) non-finite)"
            if tensors is not None:
                a = tensors[i]
                detail = f"{int(np.isnan(a).sum())} nan, {int(np.isinf(a).sum())} inf of {a.size}; " + detail
            self._add_trace("grad", names[i], self._owners.get(names[i], names[i].rsplit(".", 1)[0]),
                            detail, tensors[i] if tensors is not None else None, "grad")
        if self.config.local_norms and self._array_step:
            if squares and columns:   # a row that is a slice (TP / EP / optimizer parallel) stays whole
                sliced = {names[i] for i in range(len(names))
                          if int((columns.get("tp_size") or [1] * len(names))[i]) > 1
                          or int((columns.get("dp_shard") or [0] * len(names))[i]) != 0}
                squares = {k: v for k, v in squares.items() if k not in sliced}
            if squares:   # stacked experts: one row per expert, NAME[e] (dumpers/mindspore_expert_norms.py)
                names, split, numel, origin = split_rows(names, norms, numel, squares)
                norms = np.asarray(split, dtype=np.float64)
                columns = {k: [col[i] for i in origin] for k, col in (columns or {}).items()}
            n = len(names)
            layout = {"tp_partition_dim": np.full(n, -1, np.int64),
                      "tp_rank": np.full(n, self.coords["tp_rank"], np.int64),
                      "tp_size": np.full(n, self.coords["tp_size"], np.int64)}
            for key, col in (columns or {}).items():
                if len(col) != n:
                    raise ValueError(f"local_norm column {key}: {len(col)} values for {n} names")
                layout[key] = np.asarray(col, dtype=np.int64)
            self.writer.put_table(self._step, "local_norm", {
                "name": _str_col(names), "norm": np.asarray(norms, dtype=np.float64),
                "numel": np.asarray(numel, dtype=np.int64), **layout},
                attrs={"global_norm": float(global_norm) if global_norm is not None else np.nan,
                       "global_norm_source": source, "where": where, **dict(attrs or {})})

    def _add_trace(self, kind: str, name: str, module: str, detail: str, tensor: np.ndarray | None,
                   tensor_kind: str) -> None:
        self._trace_rows.append({"kind": kind, "name": name, "module": module,
                                 "tp_rank": self.coords["tp_rank"], "pp_rank": self.coords["pp_rank"],
                                 "dp_rank": self.coords["dp_rank"], "detail": detail})
        if tensor is not None:
            self._trace_tensors.append((tensor, module, tensor_kind))

    @property
    def nan_trace(self) -> list[dict[str, Any]]:
        """This step's trace rows so far (first non-finite gradient / activation)."""
        return list(self._trace_rows)

    def log(self, **scalars: Any) -> None:
        """Add scalars (loss, lr, loss_scale, ...) to this step's record."""
        if not self.enabled or self._step is None:
            return
        for key, value in scalars.items():
            try:
                if isinstance(value, Tensor):
                    value = to_numpy(value).reshape(-1)[0].item()
                elif isinstance(value, np.ndarray):
                    value = value.reshape(-1)[0].item()
                self._scalars[key] = value
            except Exception as exc:  # noqa: BLE001
                self._fail(f"log {key}", exc)

    def end_step(self, loss: Any = None, **scalars: Any) -> None:
        """Finish the step: batch, tensor statistics, NaN trace, scalars; the step file gets its name."""
        if not self.enabled or self._step is None:
            return
        if loss is not None:
            scalars["loss"] = loss
        self.log(**scalars)
        if self._graph is not None and self._capturing():
            try:
                self._read_graph_capture()
            except Exception as exc:  # noqa: BLE001
                self._fail("graph capture read", exc)
                return
        if self._router is not None and self._array_step:
            try:
                if self._routing_step:
                    self._routes = self._router.read()
                    self._route_counts = {r.module: r.tokens_per_expert for r in self._routes}
                else:
                    self._route_counts = self._router.counts()
            except Exception as exc:  # noqa: BLE001
                self._fail("routing capture read", exc)
                return
        step, trace = self._step, list(self._trace_rows)
        try:
            self._flush(step)
            self.writer.log_scalars(step, self._scalars)
            self.writer.finish_step()
        except Exception as exc:  # noqa: BLE001
            self._fail(f"end_step {step}", exc)
        self._close_step()
        self._rows, self._trace_tensors, self._batch, self._routes, self._route_counts = [], [], {}, [], {}
        if trace and self.config.stop_on_nan:
            first = trace[0]
            raise NonFiniteError(f"step {step}: non-finite {first['kind']} in {first['name']} "
                                 f"(cell {first['module']}, rank tp{first['tp_rank']}/pp{first['pp_rank']}/"
                                 f"dp{first['dp_rank']}): {first['detail']}")

    def _flush(self, step: int) -> None:
        if self._batch:
            merged = merge_micro_batches(self._batch)
            if self.config.batch and self._array_step:
                for key, arr in merged.items():
                    self.writer.put_array(step, f"batch/{key}", arr,
                                          attrs={"micro_batches": len(self._batch[key])})
            if self.config.seed_layout and self._array_step:
                self.writer.write_seed_batch(step, {k: merged[k] for k in SEED_BATCH_KEYS if k in merged})
            tokens = merged.get("tokens", merged.get("input_ids"))
            if tokens is not None:
                self._scalars.update(token_min=int(tokens.min()), token_max=int(tokens.max()),
                                     tokens_per_step=int(tokens.size))
            if "loss_mask" in merged:
                self._scalars["loss_mask_sum"] = float(np.sum(merged["loss_mask"], dtype=np.float64))
        if self._rows:
            cols = {k: [r[k] for r in self._rows] for k in self._rows[0]}
            self.writer.put_table(step, "tensor_stats", {
                "order": np.asarray(cols["order"], np.int64), "module": _str_col(cols["module"]),
                "kind": _str_col(cols["kind"]), "dtype": _str_col(cols["dtype"]),
                "shape": _str_col(cols["shape"]),
                "numel": np.asarray(cols["numel"], np.int64),
                **{k: np.asarray(cols[k], np.float64) for k in ("max", "min", "mean", "norm")},
                "nan": np.asarray(cols["nan"], np.int64), "inf": np.asarray(cols["inf"], np.int64),
                # each row's slice of the whole tensor under a MindFormers strategy (sources/layers.py gathers)
                **({"split": _str_col([self._split(r) for r in self._rows])} if self.strategy is not None else {})})
        for rec in self._routes:
            put_routing(self.writer, step, rec)
        put_counts(self.writer, step, self._route_counts)
        if self._trace_rows:
            cols = {k: [r[k] for r in self._trace_rows] for k in self._trace_rows[0]}
            for k in ("tp_rank", "pp_rank", "dp_rank"):
                cols[k] = np.asarray(cols[k], np.int64)
            for k in ("kind", "name", "module", "detail"):
                cols[k] = _str_col(cols[k])
            self.writer.put_table(step, "nan_trace", cols)
            for i, (arr, module, kind) in enumerate(self._trace_tensors):
                self.writer.put_array(step, f"nan_trace_tensors/{i}", arr,
                                      attrs={"module": module, "kind": kind})

    @contextmanager
    def step(self, step: int, batch: Mapping[str, Any] | None = None) -> Iterator[MindSporeDumper]:
        """``with dumper.step(n, batch):`` ... ``dumper.record_grads(grads); dumper.log(loss=...)``."""
        self.begin_step(step)
        if batch is not None:
            self.record_batch(batch)
        try:
            yield self
        finally:
            self.end_step()

    def close(self) -> None:
        self.unwatch()
        if self.writer is None:
            return
        try:
            self.writer.close()
        except Exception as exc:  # noqa: BLE001
            warnings.warn(f"MindSporeDumper: closing the run store failed: {exc!r}", RuntimeWarning,
                          stacklevel=2)


class DumperCallback(ms.train.Callback):
    """Drives a :class:`MindSporeDumper` from ``Model.train`` / MindFormers' Trainer (steps from 1).

    Handles :class:`NormTrainOneStepCell` outputs ``(loss, square_sums)``; subclasses parse other
    training cells' outputs in :meth:`handle_outputs` (see dumpers/mindformers.py).
    """

    def __init__(self, dumper: MindSporeDumper, batch_columns: Sequence[str] | None = None) -> None:
        super().__init__()
        self.dumper = dumper
        self.batch_columns = list(batch_columns) if batch_columns else None

    def on_train_step_begin(self, run_context: Any) -> None:
        cb = run_context.original_args()
        self.dumper.begin_step(int(cb.cur_step_num))
        if self.batch_columns and getattr(cb, "train_dataset_element", None) is not None:
            elems = cb.train_dataset_element
            self.dumper.record_batch({k: v for k, v in zip(self.batch_columns, elems, strict=False)})

    def on_train_step_end(self, run_context: Any) -> None:
        cb = run_context.original_args()
        try:
            self.handle_outputs(cb.net_outputs, cb)
        except Exception as exc:  # noqa: BLE001
            self.dumper._fail("callback outputs", exc)
        self.dumper.end_step()

    def handle_outputs(self, outputs: Any, cb_params: Any) -> None:
        if isinstance(outputs, (tuple, list)):
            self.dumper.log(loss=outputs[0])
            net = cb_params.train_network
            if len(outputs) == 2 and hasattr(net, "param_names"):
                self.dumper.record_local_norms(net.param_names(), outputs[1], squared=True,
                                               where="NormTrainOneStepCell")
        else:
            self.dumper.log(loss=outputs)

    def on_train_end(self, run_context: Any) -> None:
        self.dumper.close()
