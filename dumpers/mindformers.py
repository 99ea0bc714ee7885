"""MindFormers layer over the MindSpore dumper: name the unnamed ``local_norm`` arrays.

Why: ``MFTrainOneStepCell(local_norm=True)`` returns (and MFLossMonitor logs as ``norm_size: (...)`` then
``local_norm:``) one squared gradient sum per parameter, in the optimizer's parameter order, with no names.
The optimizer's order is not ``trainable_params()`` order: MindFormers' Trainer groups parameters (weight
decay first, then norms and biases). This module names them by ``optimizer.parameters`` and takes the
square root, so they compare against Megatron's named norms. ``sqrt(sum of squares)`` is the global norm
before clipping.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mindspore as ms
import numpy as np

from dumpers.mindspore_dumper import DumpConfig, DumperCallback, LayerCaptureError, MindSporeDumper, to_numpy
from models.mindformers_parallel import ParallelStrategy, grad_state, rank_part, strategy_from_config

WHERE = "mindformers.MFTrainOneStepCell.local_norm"


def optimizer_param_names(optimizer: Any) -> list[str]:
    """Parameter names in the order MFTrainOneStepCell's local_norm output uses (the optimizer's)."""
    return [p.name for p in optimizer.parameters]


def optimizer_param_sizes(optimizer: Any) -> list[int]:
    return [int(np.prod(p.shape)) if len(p.shape) else 1 for p in optimizer.parameters]


def name_local_norms(local_norm: Any, names: Sequence[str], norm_size: Sequence[int] | None = None,
                     sizes: Sequence[int] | None = None) -> dict[str, float]:
    """Squared sums in optimizer order -> {name: L2 norm}.

    ``norm_size`` (what MindFormers returns/logs beside the sums) is checked against ``sizes`` (the
    parameters' element counts) when both are given, so a wrong name order is caught, not silently used.
    """
    sq = np.asarray(to_numpy(local_norm), dtype=np.float64).reshape(-1)
    if len(sq) != len(names):
        raise ValueError(f"local_norm has {len(sq)} entries but the optimizer has {len(names)} parameters")
    if norm_size is not None and sizes is not None:
        got = [int(s) for s in np.asarray(to_numpy(norm_size) if not isinstance(norm_size, (list, tuple))
                                          else norm_size).reshape(-1)]
        if list(got) != [int(s) for s in sizes]:
            first = next(i for i, (a, b) in enumerate(zip(got, sizes, strict=False)) if int(a) != int(b))
            raise ValueError(f"norm_size does not match the optimizer's parameters at index {first} "
                             f"({names[first]}: {got[first]} vs {sizes[first]} elements)")
    return dict(zip(names, np.sqrt(sq).tolist(), strict=True))


def global_norm_from_local(local_norm: Any) -> float:
    """sqrt of the sum of MindFormers' squared local norms: the global gradient norm before clipping."""
    return float(np.sqrt(np.sum(np.asarray(to_numpy(local_norm), dtype=np.float64))))


def record_mindformers_norms(dumper: MindSporeDumper, named: dict[str, float], sizes: Sequence[int], *,
                             strategy: ParallelStrategy | None = None, shapes: dict[str, Any] | None = None,
                             layouts: dict[str, Any] | None = None, global_norm: float | None = None,
                             where: str = WHERE) -> None:
    """Record one rank's named local norms with what the rank holds of each parameter.

    Under a parallel ``strategy`` each row says which slice of the parameter it is (``tp_*``: the TP / EP
    slice, from ``layouts`` = MindSpore's ``parameter_layout_dict`` or MindFormers' default mcore strategies),
    its optimizer-parallel part (``dp_shard``), and the table says where the norms sit relative to the DP
    all-reduce (``grad_state``, :func:`models.mindformers_parallel.grad_state`); the run's meta gets
    ``parallel``. The comparator recombines the ranks from exactly this."""
    names = list(named)
    columns = attrs = None
    if strategy is not None and strategy.world > 1:
        rank = dumper.coords["rank"]
        parts = [rank_part(n, tuple((shapes or {}).get(n, (int(sz),))), strategy, rank, (layouts or {}).get(n))
                 for n, sz in zip(names, sizes, strict=True)]
        columns = {k: [p[k] for p in parts] for k in parts[0] if k != "first_replica"} if parts else None
        attrs = {"grad_state": grad_state(strategy, where)}
        if getattr(dumper, "_mf_parallel", None) != strategy:   # meta.json once, not every step
            dumper.update_meta({"parallel": strategy.meta()})
            dumper._mf_parallel = strategy
    dumper.record_local_norms(names, np.array(list(named.values())), list(sizes), global_norm=global_norm,
                              where=where, columns=columns, attrs=attrs)


def write_optimizer_shard(run_dir: str | Path, rank: int, strategy: ParallelStrategy,
                          full_shapes: dict[str, Sequence[int]], grads: dict[str, Any], before: dict[str, Any],
                          after: dict[str, Any], layouts: dict[str, Any] | None = None) -> Path:
    """Rank ``rank``'s step-1 optimizer evidence under MindFormers' TP / EP slicing and optimizer parallel:
    host copies of what it holds (its slice, and of that its optimizer-parallel part of dim 0), written as
    ``evidence/optimizer_step1/rank_R.npz`` with their offsets in the slice, the format Megatron's
    distributed optimizer shards use, so ``runstore.read_step1_file`` merges them into whole tensors. A
    parameter whole on every rank of a stage (norms) is written by the ranks that hold its parts, once."""
    from runstore.step1_file import shard_file, write_step1_shard

    g, b, a, shard, shape = {}, {}, {}, {}, {}
    for name, full in full_shapes.items():
        full = tuple(int(x) for x in full)
        part = rank_part(name, full, strategy, rank, (layouts or {}).get(name))
        local = list(full)
        if part["tp_size"] > 1:
            local[part["tp_partition_dim"]] //= part["tp_size"]
        numel = int(np.prod(local)) if local else 1
        if part["dp_shard"]:
            n = numel // part["dp_size"]
            start, end = part["dp_rank"] * n, (part["dp_rank"] + 1) * n
        elif not part["first_replica"]:
            continue   # a replica of a slice another rank writes
        else:
            start, end = 0, numel
        for out, src in ((g, grads), (b, before), (a, after)):
            arr = np.asarray(src[name]).reshape(-1)
            if arr.size != end - start:
                raise ValueError(f"{name}: rank {rank} holds {end - start} elements, got {arr.size}")
            out[name] = arr
        shard[name] = np.array([start, end, part["tp_partition_dim"], part["tp_rank"], part["tp_size"], 0])
        shape[name] = np.array(local)
    path = shard_file(run_dir, rank)
    write_step1_shard(path, g, b, a, shard, shape, rank=rank, world=strategy.world)
    return path


def run_strategy(train_network: Any) -> ParallelStrategy | None:
    """The running job's strategy: the training cell's ``parallel_config`` and MindSpore's auto-parallel
    context (mode, optimizer parallel, gradients_mean, pipeline stages); None when not parallel."""
    try:
        from mindspore import get_auto_parallel_context as ctx

        world = max(int(ctx("device_num") or 1), mindspore_world())
        if world <= 1:
            return None
        pc = getattr(train_network, "parallel_config", None)
        inner = getattr(train_network, "network", None)
        while pc is None and inner is not None:     # the legacy Llama keeps it on the model's config
            pc = getattr(inner, "parallel_config", None) or getattr(getattr(inner, "config", None),
                                                                    "parallel_config", None)
            inner = getattr(inner, "network", None)
        if ctx("parallel_mode") == "data_parallel" or (
                pc.get("data_parallel") if isinstance(pc, dict) else getattr(pc, "data_parallel", None)) is None:
            # plain data parallel over the world (a model's own parallel_config may say 1 there: the legacy
            # Llama's is not updated from the YAML), or no parallel_config in reach
            pc = {"data_parallel": world}
        par = {"parallel_mode": ctx("parallel_mode"), "enable_parallel_optimizer": ctx("enable_parallel_optimizer"),
               "gradients_mean": ctx("gradients_mean")}
        cfg = None
        for get in ("get_gpt_transformer_config",):
            inner = getattr(train_network, "network", None)
            while inner is not None and cfg is None:
                try:
                    cfg = getattr(inner, get)() if hasattr(inner, get) else None
                except AttributeError:      # the legacy Llama has the method, not the mcore config it reads
                    cfg = None
                inner = getattr(inner, "network", None)
        mc = {"num_layers": getattr(cfg, "num_layers", None), "offset": getattr(cfg, "offset", 0)} if cfg else {}
        return strategy_from_config(pc, par, mc)
    except Exception:  # noqa: BLE001 - never break the run: record the norms without a layout
        return None


def mindspore_world() -> int:
    try:
        from mindspore.communication import management

        return int(management.get_group_size()) if getattr(management.GlobalComm, "INITED", False) else 1
    except Exception:  # noqa: BLE001
        return 1


def split_outputs(outputs: Any) -> dict[str, Any]:
    """MFTrainOneStepCell's 5- or 7-tuple as named host values."""
    names = ("loss", "overflow", "loss_scale", "lr", "global_norm", "local_norm", "norm_size")
    out: dict[str, Any] = {}
    for key, value in zip(names, outputs, strict=False):
        if value is None:
            continue
        if key == "norm_size":
            out[key] = [int(to_numpy(v).reshape(-1)[0]) if not isinstance(v, int) else v for v in value]
        else:
            out[key] = to_numpy(value)
    return out


class MindFormersDumperCallback(DumperCallback):
    """Callback for MindFormers' Trainer / Model.train with MFTrainOneStepCell (or CPUTrainOneStepCell).

    Each step: loss, overflow, loss scale, lr, global norm as scalars, and - with ``local_norm: True`` in
    ``runner_wrapper`` - the named local norm table (names from the wrapper's optimizer).

    Two ways to build it: from Python with a dumper (``MindFormersDumperCallback(MindSporeDumper(net, out))``),
    or from a YAML ``callbacks:`` entry with keyword arguments only (``out_dir``, ``batch_columns``,
    ``steps``, ``tensor_steps``, ``tensors``, ``cells``, ``backward``, ``nan_trace``, ``meta``,
    ``graph_capture``, ``capture_env``, ``capture_env_data``, ``routing``, ``kernel_dump``): the dumper is then
    created at the start of training on the network the Trainer built, with this process's rank (MindSpore's
    ``get_rank()`` under msrun). It works in GRAPH mode (scalars, batches, named local norms: stacked routed
    experts one row per expert, ``mlp.experts.weight1[e]``, see dumpers/mindspore_expert_norms.py) and, with
    ``tensors: stats``, captures layer statistics inside the compiled step (``graph_capture``, on by default
    in GRAPH: the watched cells are wrapped in ``on_train_begin``, which MindSpore's ``Model.train`` calls before
    its first training step compiles the graph). Full tensors (``tensors: full``) need PYNATIVE, or in GRAPH
    ``kernel_dump: {cells: [...], steps: [1, 2], budget_mib: 1024, tokens: N}``: the selected cells' inputs,
    outputs and their gradients at those steps from MindSpore's kernel dump of the step that trains
    (dumpers/mindspore_kernel_dump.py; its size printed before the compile; ``tokens`` per step defaults to the
    dataset's first column's shape). Over the budget, or with a graph compiled already, the run trains on without
    it (a warning and meta.json ``layer_capture`` say why): the training is the user's, the capture an extra.

    The wrapping must precede the first compile of the training graph. MindFormers compiles it BEFORE
    ``on_train_begin`` (``model.build`` in ``transform_and_load_checkpoint`` / ``load_checkpoint_with_safetensors``)
    when a checkpoint is loaded under ``semi_auto_parallel`` / ``auto_parallel``, or when resuming with the new
    checkpoint format and ``use_parallel``. Then the capture cannot run: the callback sees a compiled training
    graph, does not wrap, and says so in meta.json (``layer_capture``) and a warning; the run goes on.
    """

    def __init__(self, dumper: MindSporeDumper | None = None, batch_columns: Sequence[str] | None = None, *,
                 out_dir: str | None = None, steps: Any = None, tensor_steps: Any = None, tensors: str = "off",
                 cells: Sequence[str] = ("*",), backward: bool = True, nan_trace: str = "grads",
                 meta: dict[str, Any] | None = None, graph_capture: bool = True, capture_env: bool = False,
                 capture_env_data: Sequence[str] = (), routing: bool = False,
                 kernel_dump: dict[str, Any] | None = None) -> None:
        if dumper is None and not out_dir:
            raise ValueError("MindFormersDumperCallback needs a dumper or out_dir (the run-store directory)")
        super().__init__(dumper, batch_columns)  # type: ignore[arg-type]
        self._pending = None if dumper is not None else (str(out_dir), DumpConfig(
            steps=steps, tensor_steps=tensor_steps, tensors=tensors, cells=tuple(cells), backward=backward,
            nan_trace=nan_trace, meta=dict(meta or {}), capture_env=bool(capture_env),
            capture_env_data=tuple(capture_env_data or ()), routing=bool(routing)))
        self._graph_capture = bool(graph_capture)
        self._capture_checked = False
        self._kernel_dump_options = dict(kernel_dump or {})
        self._kernel_dump: Any = None
        self._kernel_names_restored = False

    def on_train_begin(self, run_context: Any) -> None:
        """YAML-built: create the dumper on the network the Trainer trains (the cell inside the wrapper). Both
        ways: per-expert norms of stacked experts from the training cell's LocalNorm, unless the training graph
        is compiled already (then one norm per stacked Parameter, as MindFormers gives it)."""
        self._create_dumper(run_context)
        cell = getattr(run_context.original_args(), "train_network", None)
        if self.dumper is not None and cell is not None and not _training_graph_compiled():
            self.dumper.watch_train_cell(cell)

    def _create_dumper(self, run_context: Any) -> None:
        if self._pending is None:
            return
        out_dir, config = self._pending
        self._pending = None
        cb = run_context.original_args()
        net, scheme = _named_model(_model_cell(getattr(cb, "train_network", None) or getattr(cb, "network", None)))
        graph = ms.get_context("mode") != ms.PYNATIVE_MODE
        kernel_meta = self._start_kernel_dump(cb, net, out_dir, config) if self._kernel_dump_options and graph else {}
        capture = self._graph_capture and graph and config.tensors == "stats"
        try:
            if capture and _training_graph_compiled():
                raise LayerCaptureError(
                    "the training graph was compiled before on_train_begin (model.build: a checkpoint loaded "
                    "under semi_auto_parallel/auto_parallel, or a parallel resume), so the in-graph capture "
                    "cannot be added")
            self.dumper = MindSporeDumper(net, out_dir, config, framework="mindformers",
                                          name_scheme=scheme, graph_capture=capture)
        except LayerCaptureError as exc:
            # keep scalars, batches and named norms, never stop the run.
            warnings.warn(f"MindFormersDumperCallback: {exc}; dumping without layer tensors", RuntimeWarning,
                          stacklevel=2)
            config.tensors, config.nan_trace = "off", "grads"
            config.meta = {**config.meta, "layer_capture": f"refused in GRAPH mode ({exc}): re-run steps 1-2 in "
                                                           "PYNATIVE (context.mode: 1) to capture layers"}
            self.dumper = MindSporeDumper(net, out_dir, config, framework="mindformers", name_scheme=scheme)
        if kernel_meta:
            self.dumper.update_meta(kernel_meta)

    def _start_kernel_dump(self, cb: Any, net: Any, out_dir: str, config: DumpConfig) -> dict[str, Any]:
        """The kernel-dump capture of ``kernel_dump`` (layer tensors then come from it: ``tensors`` off), or, when
        refused, the meta.json note saying why; the run trains either way."""
        from core.errors import BadInput
        from dumpers.mindspore_kernel_dump import DEFAULT_BUDGET_MIB, KernelDumpCapture

        opts = self._kernel_dump_options
        try:
            self._kernel_dump = KernelDumpCapture(
                net, out_dir, opts.get("cells", ("decoder.layers.*",)), opts.get("steps", (1,)),
                tokens=opts.get("tokens") or _dataset_tokens(cb),
                budget_mib=float(opts.get("budget_mib", DEFAULT_BUDGET_MIB)))
        except (BadInput, ValueError, TypeError) as exc:     # over budget, compiled already, a garbled option
            warnings.warn(f"MindFormersDumperCallback: kernel_dump refused ({exc}); training without it",
                          RuntimeWarning, stacklevel=2)
            return {"layer_capture": {"mode": "GRAPH", "kernel_dump": None, "refused": str(exc)}}
        config.tensors = "off"
        return self._kernel_dump.store_meta()

    def on_train_step_begin(self, run_context: Any) -> None:
        if self.dumper is not None:
            super().on_train_step_begin(run_context)
            self._record_samples(run_context)

    def _record_samples(self, run_context: Any) -> None:
        """Beside a re-split replay's batch: each row's baseline step and global position and the replay's hash of
        it as read (dumpers.mindformers_replay.replayed_samples), and this side's hash of the row the network got
        (``sample_hash``), so the data stage proves every sample arrived once, in order, unchanged."""
        from dumpers.mindformers_replay import replayed_samples
        from runstore.batches import sample_hashes

        cb = run_context.original_args()
        plan = replayed_samples(int(getattr(cb, "cur_step_num", 0) or 0))
        if plan is None:
            return
        extra = dict(plan)
        elems = getattr(cb, "train_dataset_element", None)
        if self.batch_columns and elems is not None:
            got = {k: to_numpy(v) for k, v in zip(self.batch_columns, elems, strict=False)}
            try:
                hashes = sample_hashes(got)
            except ValueError:      # no input_ids column recorded: the plan alone
                hashes = None
            if hashes is not None and len(hashes) == len(plan["sample_index"]):
                extra["sample_hash"] = hashes
        self.dumper.record_batch(extra)

    def on_train_step_end(self, run_context: Any) -> None:
        if self._kernel_dump is not None and not self._kernel_names_restored:
            self._kernel_dump.restore_names()     # compiled: names the graph gave by cell path lose the wrapper's
            self._kernel_names_restored = True
        if self.dumper is not None:
            self._check_capture_ran()
            super().on_train_step_end(run_context)

    def _check_capture_ran(self) -> None:
        """After the first step: a GRAPH capture whose wrappers are not in the compiled graph wrote nothing."""
        graph = getattr(self.dumper, "_graph", None)
        if self._capture_checked or graph is None or not graph.cells:
            return
        self._capture_checked = True
        if any(int(w.xf_fmeta.asnumpy()[0, 0]) == 1 for w in graph.cells.values()):
            return
        warnings.warn("MindFormersDumperCallback: the GRAPH capture wrote nothing in the first step (the "
                      "training graph was compiled without the wrapped cells); no layer statistics",
                      RuntimeWarning, stacklevel=2)
        self.dumper.update_meta({"layer_capture": {
            "mode": "GRAPH", "captured": False,
            "why": "the training graph was compiled before the cells were wrapped: re-run steps 1-2 in "
                   "PYNATIVE (context.mode: 1) to capture layers"}})

    def on_train_end(self, run_context: Any) -> None:
        if self._kernel_dump is not None:
            self._kernel_dump.finish()
            if self.dumper is not None:
                self.dumper.update_meta(self._kernel_dump.store_meta())
            self._kernel_dump = None
        if self.dumper is not None:
            super().on_train_end(run_context)

    def handle_outputs(self, outputs: Any, cb_params: Any) -> None:
        if not isinstance(outputs, (tuple, list)) or len(outputs) not in (5, 7):
            return super().handle_outputs(outputs, cb_params)
        vals = split_outputs(outputs)
        d = self.dumper
        d.log(loss=vals["loss"], overflow=bool(np.asarray(vals["overflow"]).reshape(-1)[0]),
              loss_scale=vals["loss_scale"])
        if "lr" in vals:
            d.log(lr=vals["lr"])
        gnorm = float(np.asarray(vals["global_norm"]).reshape(-1)[0]) if "global_norm" in vals else None
        if gnorm is not None:
            d.log(grad_norm=gnorm)
        if "local_norm" in vals:
            optimizer = getattr(cb_params, "optimizer", None) or cb_params.train_network.optimizer
            names = optimizer_param_names(optimizer)
            sizes = optimizer_param_sizes(optimizer)
            net = getattr(cb_params, "train_network", None)
            strategy = run_strategy(net)
            d.set_strategy(strategy)    # coordinates in MindFormers' order, each layer row's slice
            if strategy is not None and vals.get("norm_size"):
                # a rank's gradients are its slices: the element counts it returns are the slices', so they
                # are the rows' numel (the full shapes' counts would not match them)
                sizes = [int(v) for v in vals["norm_size"]]
            named = name_local_norms(vals["local_norm"], names, vals.get("norm_size"), sizes)
            layouts = getattr(net, "parameter_layout_dict", None) if strategy is not None else None
            shapes = {p.name: tuple(p.shape) for p in optimizer.parameters}
            record_mindformers_norms(d, named, sizes, strategy=strategy, shapes=shapes, layouts=layouts or None,
                                     global_norm=gnorm, where=WHERE)
        return None


def dump_mindformers_step(dumper: MindSporeDumper, step: int, outputs: Any, optimizer: Any,
                          batch: dict[str, Any] | None = None,
                          strategy: ParallelStrategy | None = None) -> dict[str, float]:
    """Plain-loop counterpart of the callback: record one MFTrainOneStepCell step; returns named norms."""
    dumper.begin_step(step)
    if batch is not None:
        dumper.record_batch(batch)
    vals = split_outputs(outputs)
    named: dict[str, float] = {}
    gnorm = float(np.asarray(vals["global_norm"]).reshape(-1)[0]) if "global_norm" in vals else None
    if "local_norm" in vals:
        names, sizes = optimizer_param_names(optimizer), optimizer_param_sizes(optimizer)
        named = name_local_norms(vals["local_norm"], names, vals.get("norm_size"), sizes)
        record_mindformers_norms(dumper, named, sizes, strategy=strategy, global_norm=gnorm)
    dumper.end_step(loss=vals["loss"], overflow=bool(np.asarray(vals["overflow"]).reshape(-1)[0]),
                    loss_scale=vals["loss_scale"], **({"grad_norm": gnorm} if gnorm is not None else {}),
                    **({"lr": vals["lr"]} if "lr" in vals else {}))
    return named


def _dataset_tokens(cb: Any) -> int | None:
    """Tokens per step from the training dataset's first column (``input_ids``: rows x sequences x length)."""
    try:
        shape = cb.train_dataset.output_shapes()[0]     # cb_params raise KeyError for a key never set
        return int(np.prod(shape))
    except Exception:  # noqa: BLE001 - no dataset, or one that cannot say: the model config's sizes then
        return None


def _training_graph_compiled() -> bool:
    """Whether this process already compiled a training graph (``model.build`` before ``on_train_begin``)."""
    try:
        from mindspore.graph.api import cells_compile_cache
    except ImportError:
        return False
    return any(str(phase).startswith("train") for cache in list(cells_compile_cache.values())
               for phase in list(cache or ()))


def _model_cell(net: Any) -> Any:
    """The model inside the training wrappers (TrainOneStepCell, _VirtualDatasetCell, ... with use_parallel),
    so layer patterns and parameter owners use the model's own names (``model.layers.0...``)."""
    seen = 0
    while seen < 8:
        inner = getattr(net, "network", None) or getattr(net, "_backbone", None)
        if inner is None or inner is net:
            return net
        net, seen = inner, seen + 1
    return net


def _named_model(net: Any) -> tuple[Any, str]:
    """The cell whose sub-cell names are the parameters' names, with its name scheme.

    Why: a MindFormers 2.x mcore model (``Training*ForCausalLM``, ``use_legacy: False``) is built with
    ``auto_prefix=False``: its parameters carry Megatron's names (``decoder.layers.0...``) while its cells sit
    under ``model.`` (the GPTModel inside). Layer patterns (``cells``) and layer rows then use Megatron's module
    names (``decoder.layers.*.mlp``), as the mapping does. The legacy Llama keeps ``model.layers...`` for both.
    """
    inner = getattr(net, "model", None)
    if isinstance(inner, ms.nn.Cell) and inner is not net:
        names = [p.name for p in net.get_parameters()]
        if names and not any(n.startswith("model.") for n in names):
            return inner, "mindformers_mcore"
    return net, "mindformers"


def _register() -> None:
    """Put the callback in MindFormers' CALLBACK registry, so a YAML ``callbacks:`` entry can name it."""
    try:
        from mindformers.tools.register import MindFormerModuleType, MindFormerRegister
    except ImportError:  # MindSpore without MindFormers: the Python API still works
        return
    if not MindFormerRegister.is_exist(MindFormerModuleType.CALLBACK, "MindFormersDumperCallback"):
        MindFormerRegister.register_cls(MindFormersDumperCallback, MindFormerModuleType.CALLBACK)


_register()
