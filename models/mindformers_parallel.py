"""MindFormers' parallel strategy, framework-free: what each rank of a DP x TP x PP x EP run holds.

Why: a MindFormers run's per-rank evidence (the dumper's local_norm tables, msrun's ``worker_N.log``) holds
each rank's part of a parameter; putting the parts back together needs the strategy the run used. It is read
from the run's YAML (``parallel_config``, ``parallel``, ``model.model_config.offset``) or, inside a run, from
the training cell's ``parallel_config`` and MindSpore's auto-parallel context, and stored in the run store's
meta as ``parallel: {dp, tp, pp, ep, ...}``.

What MindFormers 2.1.0 does (read from the wheel):

* Ranks: stage = rank // (world / pipeline_stage) (models/utils.py ``get_current_rank_stage``); inside a stage
  the device matrix is (dp, cp, tp), tp fastest (parallel_core/training_graph/device_matrix.py); the MoE
  layout's is (dp * tp * cp / ep, ep): a rank's expert slice is its index in the stage modulo ep.
* Names are global on every rank: the whole model is built everywhere and ``LayerSetting`` gives layer i the
  stage ``searchsorted(cumsum(num_layers // pp + offset), i + 1)`` (transformer/utils.py); the embedding is on
  stage 0, the output layer, final norm and MTP on the last (base_models/gpt/gpt_model.py).
* TP slices (the mcore layers' ``shard()``): column-parallel weights (linear_qkv, linear_fc1, MLA up
  projections) on dim 0, row-parallel (linear_proj, linear_fc2) on dim 1, the word embedding and output layer
  on the vocabulary (dim 0); norms, routers and biases of row-parallel layers are whole on every TP rank.
  Routed experts ``mlp.experts.weight1/weight2`` [E*H, 2F] / [E*F, H] are split on dim 0 over EP.
  A run's own strategy file / ``parameter_layout_dict`` (device matrix + tensor map, MindSpore's convention,
  :func:`slice_index`) overrides these defaults.
* Where the local norms sit relative to the DP all-reduce (:func:`grad_state`): see its docstring.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from core.errors import BadInput

ALL_REDUCED = "all_reduced"          # the DP-reduced gradient (replicas agree)
PRE_ALL_REDUCE = "pre_all_reduce"    # each DP rank's own gradient, before the all-reduce
PIPELINE_UNVERIFIED = "pipeline_unverified"

_COLUMN = re.compile(r"\.(linear_qkv|linear_fc1|linear_q_up_proj|linear_kv_up_proj|linear_q_proj)\.weight$")
_COLUMN_BIAS = re.compile(r"\.(linear_qkv|linear_fc1)\.bias$")
_ROW = re.compile(r"\.(linear_proj|linear_fc2)\.weight$")
_VOCAB = re.compile(r"(^|\.)(embedding\.word_embeddings\.weight|output_layer\.weight)$")
_EXPERTS = re.compile(r"\.mlp\.experts\.weight[12]$")
_LAYER = re.compile(r"(?:^|\.)decoder\.layers\.(\d+)\.")
# Bounds checked before anything is sized from a config's numbers (a printed config in a log is user input):
# the largest shipped model has 94 layers and 1024-way clusters; these leave room without risking memory.
MAX_LAYERS = 1 << 16
MAX_SIZE = 1 << 16           # one parallel dimension
MAX_WORLD = 1 << 20          # dp * tp * pp * cp
_MODES = {"data_parallel": 0, "semi_auto_parallel": 1, "auto_parallel": 2, "hybrid_parallel": 3, "stand_alone": 1}


@dataclass(frozen=True)
class ParallelStrategy:
    """The sizes a MindFormers run was launched with (``parallel_config`` + ``parallel``)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    micro_batch_num: int = 1
    use_seq_parallel: bool = False
    parallel_mode: int = 1             # 0 data, 1 semi-auto, 2 auto, 3 hybrid (MindFormers' numbering)
    optimizer_parallel: bool = False   # parallel.enable_parallel_optimizer
    gradients_mean: bool = False
    num_layers: int | None = None
    offset: Any = 0

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def meta(self) -> dict[str, Any]:
        """The run store's ``parallel`` meta entry (with each layer's stage when pipelined)."""
        d = asdict(self)
        d.pop("offset")
        d.pop("num_layers")
        d["world_size"] = self.world
        if self.pp > 1 and self.num_layers:
            d["layer_stages"] = layer_stages(self.num_layers, self.pp, self.offset)
        return d

    def coords(self, rank: int) -> dict[str, int]:
        """A global rank's pp / dp / cp / tp / ep coordinates (stage-major; tp fastest inside a stage)."""
        per_stage = self.world // self.pp
        stage, r = divmod(int(rank), per_stage)
        dp_rank, rest = divmod(r, self.cp * self.tp)
        cp_rank, tp_rank = divmod(rest, self.tp)
        return {"rank": int(rank), "pp_rank": stage, "dp_rank": dp_rank, "cp_rank": cp_rank, "tp_rank": tp_rank,
                "ep_rank": r % self.ep, "rank_in_stage": r, "tp_size": self.tp, "pp_size": self.pp,
                "dp_size": self.dp, "ep_size": self.ep}


def _show(v: Any) -> str:
    try:
        text = repr(v)
    except ValueError:            # an int too long to print
        return f"a {type(v).__name__} too long to show"
    return text if len(text) <= 40 else text[:37] + "..."


def _int(v: Any, key: str, default: int = 1, most: int = MAX_SIZE) -> int:
    """A positive integer no larger than ``most``; ``default`` for a missing (None) value."""
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= most:
        raise BadInput(f"MindFormers parallel config: {key} must be an integer from 1 to {most}, got {_show(v)}")
    return v


def _flag(v: Any, key: str) -> bool:
    """A switch: a bool (or 0 / 1); a string such as 'False' is refused, since bool('False') is True."""
    if v is None:
        return False
    if isinstance(v, bool) or (isinstance(v, int) and v in (0, 1)):
        return bool(v)
    raise BadInput(f"MindFormers parallel config: {key} must be True or False, got {_show(v)}")


def _mode(v: Any) -> int:
    if isinstance(v, str) and v in _MODES:   # MindSpore's context spells it out
        return _MODES[v]
    if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 3:
        return v
    raise BadInput(f"MindFormers parallel config: parallel_mode must be 0-3 or one of {', '.join(_MODES)}, "
                   f"got {_show(v)}")


def _offset(v: Any) -> Any:
    """``offset``: an integer, a list of integers (one per stage) or a list of such lists (one per chunk)."""
    def bad() -> BadInput:
        return BadInput(f"MindFormers parallel config: offset must be an integer or a list (of lists) of "
                        f"integers from -{MAX_LAYERS} to {MAX_LAYERS}, got {_show(v)}")

    def is_int(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and abs(x) <= MAX_LAYERS

    if v is None:
        return 0
    if is_int(v):
        return v
    if not isinstance(v, (list, tuple)) or len(v) > MAX_SIZE:
        raise bad()
    if all(is_int(x) for x in v):
        return list(v)
    if all(isinstance(r, (list, tuple)) and len(r) <= MAX_SIZE and all(is_int(x) for x in r) for r in v) \
            and sum(len(r) for r in v) <= MAX_SIZE:
        return [list(r) for r in v]
    raise bad()


def _get(obj: Any, key: str, default: Any = None) -> Any:
    if isinstance(obj, dict):
        return obj.get(key, default)
    return getattr(obj, key, default)


def strategy_from_yaml(cfg: dict[str, Any]) -> ParallelStrategy:
    """The strategy of a parsed MindFormers YAML (``parallel_config``, ``parallel``, ``model_config``)."""
    pc = cfg.get("parallel_config") or {}
    par = cfg.get("parallel") or {}
    mc = ((cfg.get("model") or {}).get("model_config") or {}) if isinstance(cfg.get("model"), dict) else {}
    for key, block in (("parallel_config", pc), ("parallel", par), ("model.model_config", mc)):
        if not isinstance(block, dict):
            raise BadInput(f"MindFormers parallel config: {key} must be a mapping, got {_show(block)}")
    return strategy_from_config(pc, par, mc)


def strategy_from_config(pc: Any, par: Any = None, mc: Any = None) -> ParallelStrategy:
    """From a ``parallel_config`` (dict or MindFormers' TransformerOpParallelConfig), the ``parallel`` block
    (or MindSpore's auto-parallel context values) and the model config (layers, offset).
    Every value is checked (type and range) here, before anything is sized from it: BadInput otherwise."""
    par = par or {}
    mc = mc or {}
    key, layers = next(((k, _get(mc, k)) for k in ("num_layers", "num_hidden_layers", "n_layer")
                        if _get(mc, k) is not None), ("num_layers", None))
    s = ParallelStrategy(
        dp=_int(_get(pc, "data_parallel"), "data_parallel"), tp=_int(_get(pc, "model_parallel"), "model_parallel"),
        pp=_int(_get(pc, "pipeline_stage"), "pipeline_stage"),
        ep=_int(_get(pc, "expert_parallel"), "expert_parallel"),
        cp=_int(_get(pc, "context_parallel"), "context_parallel"),
        micro_batch_num=_int(_get(pc, "micro_batch_num"), "micro_batch_num"),
        use_seq_parallel=_flag(_get(pc, "use_seq_parallel"), "use_seq_parallel"),
        parallel_mode=_mode(_get(par, "parallel_mode", 1)),
        optimizer_parallel=_flag(_get(par, "enable_parallel_optimizer"), "enable_parallel_optimizer"),
        gradients_mean=_flag(_get(par, "gradients_mean"), "gradients_mean"),
        num_layers=_int(layers, key, 1, MAX_LAYERS) if layers is not None else None,
        offset=_offset(_get(mc, "offset")))
    if s.world > MAX_WORLD:
        raise BadInput(f"MindFormers parallel config: data_parallel x model_parallel x pipeline_stage x "
                       f"context_parallel = {s.world} devices, more than {MAX_WORLD}")
    return s


def layer_stages(num_layers: int, pp: int, offset: Any = 0) -> list[int]:
    """Stage of each transformer layer, as MindFormers' LayerSetting assigns it: chunk (v, s) holds
    ``num_layers // (pp * V) + offset[v][s]`` layers, chunks in order (v major), layer -> its chunk's stage s.
    A 1-D offset is one chunk per stage; a 2-D one (``pp_interleave_num`` rows) the interleaved pipeline."""
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 0 <= num_layers <= MAX_LAYERS:
        raise BadInput(f"MindFormers num_layers {_show(num_layers)}: expected an integer from 0 to {MAX_LAYERS}")
    if pp <= 1:
        return [0] * num_layers
    offset = _offset(offset)
    rows = offset if isinstance(offset, (list, tuple)) else [int(offset)] * pp
    rows = [list(r) for r in rows] if rows and isinstance(rows[0], (list, tuple)) else [list(rows)]
    if any(len(r) != pp for r in rows):
        raise BadInput(f"MindFormers offset {offset!r}: rows of {[len(r) for r in rows]} entries for "
                       f"pipeline_stage {pp}")
    avg = num_layers // (pp * len(rows))
    counts = [avg + int(o) for r in rows for o in r]
    if sum(counts) != num_layers or min(counts) < 0:
        raise BadInput(f"MindFormers offset {offset!r}: stages hold {counts} layers, not {num_layers}")
    out: list[int] = []
    for chunk, n in enumerate(counts):
        out.extend([chunk % pp] * n)
    return out


def param_stage(name: str, stages: list[int], pp: int) -> int:
    """The stage that owns parameter ``name`` (global names: decoder.layers.N -> the layer's stage)."""
    m = _LAYER.search(name)
    if m:
        i = int(m.group(1))
        return stages[i] if i < len(stages) else pp - 1
    if "embedding." in name and "output_layer" not in name:
        return 0
    return pp - 1   # output_layer, decoder.final_layernorm, mtp


def mcore_split(name: str) -> tuple[int, str | None]:
    """(dim, axis) MindFormers' mcore layers split parameter ``name`` on: axis 'tp', 'ep' or None (whole)."""
    if _EXPERTS.search(name):
        return 0, "ep"
    if _COLUMN.search(name) or _COLUMN_BIAS.search(name) or _VOCAB.search(name):
        return 0, "tp"
    if _ROW.search(name):
        return 1, "tp"
    return -1, None


def slice_index(dev_matrix: list[int], tensor_map: list[Any], rank_in_stage: int) -> tuple[int, int, int]:
    """(slice index, number of slices, first split dim or -1) of a parameter on a device, by MindSpore's
    convention (mindspore/parallel/_tensor.py): tensor_map entry k names device-matrix axis
    ``len(dev_matrix) - 1 - k`` (-1: not split); the rank's coordinate is its row-major index in the matrix."""
    coord = []
    r = int(rank_in_stage)
    for size in reversed(dev_matrix):
        coord.insert(0, r % size)
        r //= size
    index, count, first = 0, 1, -1
    for dim, entry in enumerate(tensor_map):
        axes = entry if isinstance(entry, (list, tuple)) else [entry]
        for k in axes:
            if k == -1:
                continue
            size = dev_matrix[len(dev_matrix) - 1 - k]
            index = index * size + coord[len(dev_matrix) - 1 - k]
            count *= size
            first = dim if first < 0 else first
    return index, count, first


def default_slice(name: str, strategy: ParallelStrategy, rank: int,
                  shape: tuple[int, ...] | None = None) -> tuple[int, int, int]:
    """(slice index, slices, dim) of ``name`` on global ``rank`` under MindFormers' default mcore strategies
    (the word embedding is split only when TP divides the vocabulary: ``enable_embedding_tp``)."""
    dim, axis = mcore_split(name)
    c = strategy.coords(rank)
    if "word_embeddings" in name and shape and len(shape) > 1 and shape[0] % strategy.tp:
        return 0, 1, -1
    if axis == "tp" and strategy.tp > 1:
        return c["tp_rank"], strategy.tp, dim
    if axis == "ep" and strategy.ep > 1:
        return c["ep_rank"], strategy.ep, dim
    return 0, 1, -1


def grad_state(strategy: ParallelStrategy, where: str) -> str:
    """Where a MindFormers local norm sits relative to the DP all-reduce (read from the 2.1.0 wheel).

    * ``MFTrainOneStepCell(local_norm=True)`` (wrapper/wrapper.py ``construct``) computes the norms after
      ``GradOperation`` and before ``self.grad_reducer``. In data / hybrid parallel mode (0, 3) that reducer is
      the DP all-reduce: the norms are the rank's own gradient (``pre_all_reduce``). In semi-auto / auto
      parallel (1, 2) the reducer is the identity and the all-reduce is the bprop of the ``_MirrorOperator``
      the parallel pass puts on each parameter (mindspore/ops/_grad_experimental/grad_comm_ops.py), inside
      GradOperation: the norms are of the all-reduced gradient (``all_reduced``), of the rank's TP slice,
      and with the optimizer parallel of its reduce-scattered part.
    * ``MFPipelineWithLossScaleCell`` (pipeline_stage > 1) computes them on GradOperation's outputs too; the
      micro-batch sum lives in ``accu_grads`` (``_MirrorMicroStepOperator``'s bprop all-reduces it there).
      Not runnable on CPU, so not verified here: ``pipeline_unverified``.
    * TrainingStateMonitor's ``local_norm/<name>`` (``dump_local_norm_path``) is TensorDump'ed in the mirror
      bprop before its all-reduce: ``pre_all_reduce`` in every mode.
    """
    if where.startswith("TrainingStateMonitor"):
        return PRE_ALL_REDUCE
    if strategy.world == 1:
        return ALL_REDUCED
    if strategy.parallel_mode in (0, 3):
        return PRE_ALL_REDUCE
    if strategy.pp > 1:
        return PIPELINE_UNVERIFIED
    return ALL_REDUCED


def rank_part(name: str, shape: tuple[int, ...] | list[int], strategy: ParallelStrategy, rank: int,
              layout: Any = None) -> dict[str, int]:
    """What global ``rank`` holds of parameter ``name`` (full ``shape``): its slice (``tp_rank`` of ``tp_size``
    slices, split on ``tp_partition_dim``; -1: whole) and, under the optimizer parallel, its part of that slice
    (``dp_shard`` 1, ``dp_rank`` of ``dp_size``: MindSpore splits dim 0 of the slice over the devices holding
    the same slice, when it divides). ``layout``: MindSpore's ``[dev_matrix, tensor_map, ...]`` for the
    parameter (a ``parameter_layout_dict`` entry), else MindFormers' default mcore strategies."""
    c = strategy.coords(rank)
    if layout is not None:
        index, count, dim = slice_index(list(layout[0]), list(layout[1]), c["rank_in_stage"])
    else:
        index, count, dim = default_slice(name, strategy, rank, tuple(shape))
    out = {"tp_partition_dim": dim if count > 1 else -1, "tp_rank": index if count > 1 else 0,
           "tp_size": count, "dp_shard": 0, "dp_rank": c["dp_rank"], "dp_size": strategy.dp}
    per_stage = strategy.world // strategy.pp
    # the ranks of this stage holding the same slice, in rank order (its replicas)
    same = [r for r in range(per_stage) if _slice_of(name, strategy, r, layout, tuple(shape)) == index]
    out["first_replica"] = int(same[0] == c["rank_in_stage"])
    if strategy.optimizer_parallel and strategy.parallel_mode in (1, 2):
        slice_dim0 = (shape[0] // count if dim == 0 else shape[0]) if len(shape) else 1
        # a layout entry names the parameter's optimizer-shard group (index 5; empty: not sharded)
        sharded = bool(layout[5]) if layout is not None and len(layout) > 5 else slice_dim0 % len(same) == 0
        if len(same) > 1 and sharded:
            out.update(dp_shard=1, dp_rank=same.index(c["rank_in_stage"]), dp_size=len(same))
    return out


def _slice_of(name: str, strategy: ParallelStrategy, rank_in_stage: int, layout: Any,
              shape: tuple[int, ...]) -> int:
    if layout is not None:
        return slice_index(list(layout[0]), list(layout[1]), rank_in_stage)[0]
    return default_slice(name, strategy, rank_in_stage, shape)[0]


def split_for_rank(name: str, full: Any, strategy: ParallelStrategy, rank: int, layout: Any = None) -> Any:
    """The part of a whole array ``full`` (numpy) that ``rank`` holds (:func:`rank_part`): its slice, then its
    optimizer-parallel part of dim 0. Used to write per-rank evidence from whole tensors."""
    part = rank_part(name, full.shape, strategy, rank, layout)
    x = full
    if part["tp_size"] > 1:
        d = part["tp_partition_dim"]
        n = x.shape[d] // part["tp_size"]
        x = x.take(range(part["tp_rank"] * n, (part["tp_rank"] + 1) * n), axis=d)
    if part["dp_shard"]:
        n = x.shape[0] // part["dp_size"]
        x = x[part["dp_rank"] * n:(part["dp_rank"] + 1) * n]
    return x
