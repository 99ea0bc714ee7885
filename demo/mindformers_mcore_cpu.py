"""MindFormers 2.x "mcore" models on CPU: Qwen3-style dense, Qwen3-MoE-style and DeepSeek-V3-style (MLA).

Why this exists: MindFormers 2.1.0 trains only its Megatron-style mcore models (``use_legacy: False``); the
comparison with Megatron-LM is meant for those. They are built here through MindFormers' own
``Training*ForCausalLM`` classes, tiny and float32, and trained by MindFormers' own MFTrainOneStepCell.

MindSpore 2.10 has no CPU kernel for a few primitives on that path. :func:`install_cpu_standins` swaps each
such primitive *instance* inside the built network for a small Cell that computes the same math with
classic ops that do have CPU kernels (tests/test_mindformers_mcore.py checks each against that math):

* ``RmsNorm`` (fused RMSNorm)          -> x * rsqrt(mean(x^2) + eps) * gamma, and rstd
* ``Outer`` (RoPE frequencies)         -> x[:, None] * y[None, :]
* ``FlashAttentionScore``              -> softmax(q k^T * scale + mask) v, with GQA (kv heads repeated per
                                          query group, as Megatron does) and a causal / given mask
* the embedding ``Morph`` (its mint embedding has no CPU backward) -> Gather on the weight
* PYNATIVE only: ``Morph`` (graph-only primitive) -> the Python function it wraps; ``OneHotExt`` ->
  ``OneHot``; ``ZerosLikeExt`` -> ``ZerosLike``.
* MoE (router, token dispatcher, grouped experts; tests/test_mindformers_moe.py): ``TopkExt`` -> ``TopK``;
  ``CumsumExt`` -> ``CumSum``; ``SortExt`` -> ``Sort``; ``FmodScalar`` -> ``TruncateMod``; ``IndexSelect`` ->
  ``Gather``; ``GroupedMatmul`` -> one masked matmul per expert; ``Swiglu`` -> silu(a) * b; ``MoveTo`` ->
  identity; the dispatcher's inline ``OneHotExt`` -> ``OneHot``. MindFormers builds SortExt, FmodScalar,
  IndexSelect, OneHotExt and GroupedMatmul inline (no instance to swap): :func:`install_moe_module_standins`
  rebinds those names in its token_dispatcher / ffn modules for the process.
* PYNATIVE fixes (kernels exist, results are wrong or it crashes): MLA's shared ``SplitWithSize`` -> a split
  per use (its PYNATIVE gradients are wrong otherwise); ``SharedExpertMLP.construct`` unpacks the MLP's three
  outputs into two (a ValueError outside GRAPH).

Nothing else of MindFormers is touched: parameters, layouts and the training step are its own.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import mindspore as ms
import numpy as np
from mindformers.tools.register import MindFormerModuleType, MindFormerRegister
from mindspore import Tensor, nn, ops

from demo.mindformers_cpu import CPUTrainOneStepCell, set_cpu_context

# The model description lives in the framework-free demo.model (the Megatron runner reads it too);
# re-exported here, where tests and callers have always found it.
from demo.model import (  # noqa: F401
    MCORE_PRESETS,
    MODEL_KINDS,
    TinyModel,
    megatron_config_kwargs,
    megatron_extra,
    spec_from_megatron,
)

# ---------------------------------------------------------------------------------------------------------
# CPU stand-ins (one per primitive without a CPU kernel)
# ---------------------------------------------------------------------------------------------------------

class CpuRmsNorm(nn.Cell):
    """Stand-in for ``ops.RmsNorm(eps)``: returns (x * rstd * gamma, rstd), rstd = rsqrt(mean(x^2) + eps)."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = float(eps)
        self.mean = ops.ReduceMean(keep_dims=True)
        self.rsqrt = ops.Rsqrt()
        self.square = ops.Square()

    def construct(self, x: Tensor, gamma: Tensor) -> tuple[Tensor, Tensor]:
        rstd = self.rsqrt(self.mean(self.square(x), -1) + self.eps)
        return x * rstd * gamma, rstd


class CpuOuter(nn.Cell):
    """Stand-in for ``Outer``: x[:, None] * y[None, :]."""

    def __init__(self) -> None:
        super().__init__()
        self.expand = ops.ExpandDims()

    def construct(self, x: Tensor, y: Tensor) -> Tensor:
        return self.expand(x, 1) * self.expand(y, 0)


class CpuFlashAttentionScore(nn.Cell):
    """Stand-in for ``FlashAttentionScore`` (layouts BNSD and BSH, no dropout, no alibi / prefix).

    softmax(q k^T * scale, masked) v in float32. Masked positions get -1e4 as in Megatron-core's
    ``attention_mask_func`` (exp underflows to exactly 0 either way). Key/value heads are repeated for
    GQA: query head h reads kv head h // (heads / kv_heads), Megatron's grouping. The mask is the one given
    (uint8/bool, 1 = masked, broadcast over batch and heads) or causal for sparse modes 2/3.
    Returns FlashAttentionScore's four outputs; only the last (attention output) is computed for real,
    the first three are zeros of the documented shapes.
    """

    def __init__(self, head_num: int, scale_value: float, input_layout: str = "BNSD", sparse_mode: int = 0
                 ) -> None:
        super().__init__()
        if input_layout not in ("BNSD", "BSH"):
            raise ValueError(f"CpuFlashAttentionScore: input_layout {input_layout} not supported")
        self.head_num = int(head_num)
        self.scale = float(scale_value)
        self.layout = input_layout
        self.causal = int(sparse_mode) in (2, 3)
        self.bmm_qk = ops.BatchMatMul(transpose_b=True)
        self.bmm_pv = ops.BatchMatMul()
        self.softmax = ops.Softmax(-1)
        self.cast = ops.Cast()
        self.select = ops.Select()
        self.transpose = ops.Transpose()
        self.reshape = ops.Reshape()
        self.tile = ops.Tile()
        self.expand = ops.ExpandDims()
        self.zeros = ops.Zeros()

    def _bnsd(self, x: Tensor, heads: int) -> Tensor:
        if self.layout == "BNSD":
            return x
        b, s, h = x.shape
        return self.transpose(self.reshape(x, (b, s, heads, h // heads)), (0, 2, 1, 3))

    def construct(self, query: Tensor, key: Tensor, value: Tensor, real_shift: Any = None,
                  drop_mask: Any = None, padding_mask: Any = None, attn_mask: Any = None,
                  prefix: Any = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        n = self.head_num
        if self.layout == "BNSD":
            kv_heads = key.shape[1]
        else:
            kv_heads = key.shape[2] * n // query.shape[2]
        q = self._bnsd(query, n)
        k = self._bnsd(key, kv_heads)
        v = self._bnsd(value, kv_heads)
        b, _, s, _ = q.shape
        skv = k.shape[2]
        if kv_heads != n:
            rep = n // kv_heads
            k = self.reshape(self.tile(self.expand(k, 2), (1, 1, rep, 1, 1)), (b, n, skv, k.shape[-1]))
            v = self.reshape(self.tile(self.expand(v, 2), (1, 1, rep, 1, 1)), (b, n, skv, v.shape[-1]))
        scores = self.bmm_qk(self.cast(q, ms.float32), self.cast(k, ms.float32)) * self.scale
        if self.causal or attn_mask is None:
            mask = Tensor(np.triu(np.ones((s, skv), dtype=np.bool_), k=1))
        else:
            mask = self.cast(attn_mask, ms.bool_)
            if mask.ndim == 2:
                mask = self.reshape(mask, (1, 1, s, skv))
        fill = ops.fill(ms.float32, scores.shape, -10000.0)
        mask = ops.broadcast_to(mask, scores.shape)
        scores = self.select(mask, fill, scores)
        probs = self.softmax(scores)
        out = self.cast(self.bmm_pv(probs, self.cast(v, ms.float32)), query.dtype)
        if self.layout == "BSH":
            out = self.reshape(self.transpose(out, (0, 2, 1, 3)), (b, s, -1))
        stats = self.zeros((b, n, s, 8), ms.float32)
        return stats, stats, self.zeros((1,), query.dtype), out


class CpuEmbedding(nn.Cell):
    """Stand-in for the embedding Morph of VocabParallelEmbedding (TP=1): Gather rows of the weight.

    Why: its mint embedding has a CPU forward but no CPU backward; Gather's backward exists on CPU.
    """

    def __init__(self) -> None:
        super().__init__()
        self.gather = ops.Gather()

    def construct(self, input_ids: Tensor, weight: Tensor) -> Tensor:
        return self.gather(weight, input_ids, 0)


class CpuOneHot(nn.Cell):
    """Stand-in for ``OneHotExt(axis)`` (PYNATIVE): the classic OneHot with the same arguments."""

    def __init__(self, axis: int = -1) -> None:
        super().__init__()
        self.onehot = ops.OneHot(axis=axis)

    def construct(self, indices: Tensor, depth: Any, on_value: Tensor, off_value: Tensor) -> Tensor:
        return self.onehot(indices, int(depth), on_value, off_value)


class CpuZerosLike(nn.Cell):
    """Stand-in for ``ZerosLikeExt`` (PYNATIVE): the classic ZerosLike."""

    def __init__(self) -> None:
        super().__init__()
        self.zeros_like = ops.ZerosLike()

    def construct(self, x: Tensor, dtype: Any = None) -> Tensor:
        return self.zeros_like(x)


class _MorphFunction:
    """PYNATIVE stand-in for ``Morph``: calls the function the Morph wraps (Morph runs only in GRAPH)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)


# --- MoE (routed experts) ------------------------------------------------------------------------------

class CpuTopk(nn.Cell):
    """Stand-in for ``TopkExt`` (the router's top-k, largest first): the classic ``TopK`` on the last axis.

    Why: TopkExt has no CPU kernel; TopK has one (with a backward). Indices come back int64 as TopkExt's do.
    """

    def __init__(self) -> None:
        super().__init__()
        self.topk = ops.TopK(sorted=True)
        self.cast = ops.Cast()

    def construct(self, x: Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True  # noqa: A002
                  ) -> tuple[Tensor, Tensor]:
        if (dim != -1 and dim != x.ndim - 1) or not largest:
            raise ValueError("CpuTopk: only the largest k along the last axis")
        values, indices = self.topk(x, k)
        return values, self.cast(indices, ms.int64)


class CpuCumsum(nn.Cell):
    """Stand-in for ``CumsumExt(x, dim, dtype)`` (tokens per expert, cumulated): the classic ``CumSum``."""

    def __init__(self) -> None:
        super().__init__()
        self.cumsum = ops.CumSum()
        self.cast = ops.Cast()

    def construct(self, x: Tensor, dim: int, dtype: Any = None) -> Tensor:
        out = self.cumsum(x, dim)
        return out if dtype is None else self.cast(out, dtype)


class CpuSort(nn.Cell):
    """Stand-in for ``SortExt(x, dim, descending)`` (tokens grouped by expert id, and the inverse order):
    the classic ``Sort``; indices int64 as SortExt's. Ties (tokens of one expert) may come in another order
    than on an NPU: each token is still computed by its own expert and put back by the inverse order, so the
    MoE output is the same."""

    def __init__(self) -> None:
        super().__init__()
        self.cast = ops.Cast()

    def construct(self, x: Tensor, dim: int = -1, descending: bool = False, stable: bool = False
                  ) -> tuple[Tensor, Tensor]:
        values, indices = ops.Sort(axis=dim, descending=descending)(x)
        return values, self.cast(indices, ms.int64)


class CpuFmodScalar(nn.Cell):
    """Stand-in for ``FmodScalar(x, n)`` (token index = sorted position mod tokens): ``TruncateMod``, which
    is fmod (the result takes the dividend's sign), on int32 (its CPU kernel has no int64; the values are
    token positions), cast back to x's dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.mod = ops.TruncateMod()
        self.cast = ops.Cast()

    def construct(self, x: Tensor, other: Any) -> Tensor:
        if x.dtype in (ms.int64, ms.int32):
            out = self.mod(self.cast(x, ms.int32), ops.scalar_to_tensor(other, ms.int32))
        else:
            out = self.mod(x, ops.scalar_to_tensor(other, x.dtype))
        return self.cast(out, x.dtype)


class CpuIndexSelect(nn.Cell):
    """Stand-in for ``IndexSelect(x, dim, index)`` (permute / unpermute tokens): ``Gather`` on that axis,
    whose backward (a scatter-add) has a CPU kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.gather = ops.Gather()

    def construct(self, x: Tensor, dim: int, index: Tensor) -> Tensor:
        return self.gather(x, index, dim)


class CpuGroupedMatmul(nn.Cell):
    """Stand-in for ``GroupedMatmul(split_item=3, group_type=0)`` (the routed experts' fc1 and fc2).

    x [M, K] holds the tokens sorted by expert; ``group_list`` the cumulated row ends per expert
    (group_list_type 0); weight [E, K, N]. Row r of the output is x[r] @ weight[e] for the expert e whose rows
    hold r. Computed as sum_e mask_e * (x @ weight[e]): the masked terms are exact zeros, so each row equals
    its own expert's matmul, and the weight gradients are x_e^T dy_e.
    """

    def __init__(self, split_item: int = 3, group_type: int = 0, group_list_type: int = 0) -> None:
        super().__init__()
        if split_item != 3 or group_type != 0 or group_list_type != 0:
            raise ValueError("CpuGroupedMatmul: only split_item 3, group_type 0, cumulated group_list")
        self.bmm = ops.BatchMatMul()
        self.cast = ops.Cast()

    def construct(self, x: Any, weight: Any, bias: Any = None, scale: Any = None, offset: Any = None,
                  antiquant_scale: Any = None, antiquant_offset: Any = None, group_list: Any = None,
                  *args: Any) -> tuple[Tensor]:
        xx, w = x[0], weight[0]
        rows = ops.arange(0, xx.shape[0], 1, dtype=ms.int64).reshape(-1, 1)
        ends = self.cast(group_list, ms.int64).reshape(1, -1)
        starts = ops.concat((ops.zeros((1, 1), ms.int64), ends[:, :-1]), 1)
        mask = self.cast(ops.logical_and(rows >= starts, rows < ends), xx.dtype)       # [M, E]
        per_expert = self.bmm(ops.broadcast_to(ops.expand_dims(xx, 0), (w.shape[0],) + xx.shape), w)  # [E, M, N]
        mask_t = ops.expand_dims(ops.transpose(mask, (1, 0)), -1)                        # [E, M, 1]
        return (ops.reduce_sum(per_expert * mask_t, 0),)


class CpuSwiglu(nn.Cell):
    """Stand-in for ``Swiglu(x, dim)``: split x in halves a, b along ``dim``; silu(a) * b (a the gate half)."""

    def __init__(self) -> None:
        super().__init__()
        self.sigmoid = ops.Sigmoid()

    def construct(self, x: Tensor, dim: int = -1) -> Tensor:
        a, b = ops.split(x, x.shape[dim] // 2, dim)
        return a * self.sigmoid(a) * b


class CpuMoveTo(nn.Cell):
    """Stand-in for ``MoveTo(x, "CPU", blocking)`` (split sizes to host): identity, a CPU run is on the host."""

    def construct(self, x: Tensor, to: Any = None, blocking: Any = None) -> Tensor:
        return x


class CpuSplitWithSize(nn.Cell):
    """PYNATIVE stand-in for a *shared* ``SplitWithSize`` instance (MLA splits q, kv and the compressed
    projections with one instance each, used twice per forward): functional ``ops.split`` on every use.

    Why (not a missing kernel): in PYNATIVE the MLA projection gradients come out wrong with the shared
    instance (some flip sign; measured 30 % off at layer-0 ``linear_kv_down_proj``) while the loss is right;
    GRAPH is right (checked with finite differences). Splitting per use gives GRAPH's gradients.
    """

    def construct(self, x: Tensor, split_size: Any, dim: int = 0) -> tuple[Tensor, ...]:
        return ops.split(x, list(split_size), dim)


def _shared_experts_construct(cell: nn.Cell) -> Any:
    """PYNATIVE fix for MindFormers' shared experts (``SharedExpertMLP[Interleaved].construct``): it unpacks
    the MLP's three outputs (output, bias, extra_loss) into two, which GRAPH tolerates and Python does not.
    The same math with the three unpacked."""
    parent = type(cell).__mro__[1]

    def construct(hidden_states: Tensor) -> tuple[Tensor, Any]:
        out, bias, _ = parent.construct(cell, hidden_states)
        if cell.use_shared_expert_gate:
            gate = cell.sigmoid(cell.shared_experts_gate(cell.cast(hidden_states, cell.router_dense_type)))
            out = cell.mul_shared_gate(out, cell.cast(gate, cell.compute_dtype))
        return out, bias

    return construct


def _replace(cell: nn.Cell, name: str, new: Any) -> None:
    cell._primitives.pop(name, None)  # noqa: SLF001 - MindSpore keeps primitive attributes here
    cell.__dict__.pop(name, None)
    if isinstance(new, nn.Cell):
        setattr(cell, name, new)
    else:
        object.__setattr__(cell, name, new)


def _standin_for(prim: Any, pynative: bool, owner: nn.Cell, fix_pynative_split: bool = True) -> Any:
    kind = type(prim).__name__
    if kind == "RmsNorm":
        return CpuRmsNorm(prim.epsilon if hasattr(prim, "epsilon") else prim.eps)
    if kind == "Outer":
        return CpuOuter()
    if kind == "FlashAttentionScore":
        # the primitive keeps its layout as an enum; the owning FlashAttention cell keeps the string
        layout = getattr(owner, "input_layout", None)
        if not isinstance(layout, str) or float(prim.keep_prob) != 1.0 or getattr(owner, "is_sliding_layer", False):
            raise ValueError(f"{type(owner).__name__}: the CPU attention stand-in needs layout BNSD/BSH, no "
                             "dropout and no sliding window")
        return CpuFlashAttentionScore(prim.head_num, prim.scale_value, layout, prim.sparse_mode)
    if kind == "TopkExt":
        return CpuTopk()
    if kind == "Swiglu":
        return CpuSwiglu()
    if pynative and kind == "SplitWithSize" and fix_pynative_split:
        return CpuSplitWithSize()
    if pynative and kind == "OneHotExt":
        return CpuOneHot(int(prim.axis))
    if pynative and kind == "ZerosLikeExt":
        return CpuZerosLike()
    return None


# The token dispatcher (a plain object, not a Cell) keeps these primitives as attributes.
_DISPATCHER_STANDINS = {"cumsum": CpuCumsum, "sort": CpuSort, "d2h": CpuMoveTo}


def install_moe_module_standins() -> dict[str, int]:
    """Stand-ins for the MoE primitives MindFormers builds *inline* (``SortExt()(x)`` inside a function), so
    there is no instance to swap: the names are rebound in the two modules that use them, for this process.

    token_dispatcher: SortExt, FmodScalar, IndexSelect, OneHotExt (permute / unpermute, tokens per expert);
    ffn: GroupedMatmul (the routed experts). Idempotent; returns the names rebound.
    """
    from mindformers.parallel_core.training_graph.transformer.moe import ffn, token_dispatcher

    rebound = {(token_dispatcher, "SortExt"): CpuSort, (token_dispatcher, "FmodScalar"): CpuFmodScalar,
               (token_dispatcher, "IndexSelect"): CpuIndexSelect, (token_dispatcher, "OneHotExt"): CpuOneHot,
               (ffn, "GroupedMatmul"): CpuGroupedMatmul}
    counts: dict[str, int] = {}
    for (module, name), standin in rebound.items():
        if getattr(module, name) is not standin:
            setattr(module, name, standin)
        counts[name] = counts.get(name, 0) + 1
    return counts


def _install_dispatcher_standins(cell: nn.Cell, counts: dict[str, int]) -> None:
    dispatcher = cell.__dict__.get("token_dispatcher")
    if dispatcher is None or isinstance(dispatcher, nn.Cell):
        return
    for attr, standin in _DISPATCHER_STANDINS.items():
        prim = getattr(dispatcher, attr, None)
        if prim is not None and not isinstance(prim, nn.Cell):
            setattr(dispatcher, attr, standin())
            key = type(prim).__name__
            counts[key] = counts.get(key, 0) + 1


def _refuse_broken_attention(cell: nn.Cell) -> None:
    """``use_flash_attention: False`` with grouped-query attention: refused in one line, before a compile fails.

    Why: MindFormers 2.1.0's training ``Attention`` then calls ``_repeat_kv`` on the key/value of layout
    [seq, batch, kv_heads, dim] as if it were [batch, kv_heads, seq, dim]: the batch comes out
    heads/groups times too large and the core attention (FlashAttention in either case) cannot reshape it
    (``Reshape x_shape {8,2,2,32,16} -> {4,4,32,16}``). That is MindFormers' code, not a kernel this module
    could stand in for, and it fails the same way on an NPU.
    """
    if getattr(cell, "use_flash_attention", True) is not False or not hasattr(cell, "_repeat_kv"):
        return
    rep = int(getattr(cell, "n_rep", 1) or 1)
    if rep > 1:
        heads = getattr(cell, "num_heads", "?")
        raise ValueError(
            f"model_config.use_flash_attention: False with grouped-query attention ({heads} heads, "
            f"{getattr(cell, 'kv_num_heads', '?')} kv heads) does not run in MindFormers' mcore training model "
            f"({type(cell).__name__}._repeat_kv treats [seq, batch, heads, dim] as [batch, heads, seq, dim]); "
            "set use_flash_attention: True (on CPU the attention stand-in computes FlashAttentionScore's math)")


def install_cpu_standins(net: nn.Cell, mode: str = "graph", *, fix_pynative_split: bool = True
                         ) -> dict[str, int]:
    """Swap every primitive without a CPU kernel inside ``net`` for its stand-in; returns counts by kind.

    ``fix_pynative_split=False`` keeps MLA's shared SplitWithSize in PYNATIVE (reproduces its wrong
    gradients, for the test that the local-norm stage names them)."""
    from mindspore.ops.operations import Morph

    pynative = mode.lower() == "pynative"
    counts: dict[str, int] = {}
    for _, cell in list(net.cells_and_names()):
        _refuse_broken_attention(cell)
        _install_dispatcher_standins(cell, counts)
        if pynative and type(cell).__name__ in ("SharedExpertMLP", "SharedExpertMLPInterleaved"):
            cell.construct = _shared_experts_construct(cell)
            counts["SharedExpertMLP.construct"] = counts.get("SharedExpertMLP.construct", 0) + 1
        for name, prim in list(cell._primitives.items()):  # noqa: SLF001
            if name == "embedding_morph" and isinstance(prim, Morph):
                new: Any = CpuEmbedding()
            elif isinstance(prim, Morph):
                new = _MorphFunction(prim.__morph_fn__) if pynative else None
            else:
                new = _standin_for(prim, pynative, cell, fix_pynative_split)
            if new is None:
                continue
            _replace(cell, name, new)
            key = type(prim).__name__ if name != "embedding_morph" else "Embedding"
            counts[key] = counts.get(key, 0) + 1
    return counts


# ---------------------------------------------------------------------------------------------------------
# Context, config and the model
# ---------------------------------------------------------------------------------------------------------

def set_mcore_context(mode: str = "graph", *, seed: int | None = None) -> None:
    """CPU, the mode, and MindFormers' ``use_legacy: False`` (mcore models, the mcore training step).

    MindFormers' context is a process-wide singleton that cannot be built twice (CPU affinity is set once):
    the first call builds it, later calls only switch ``use_legacy`` on the existing one.
    """
    from mindformers.core.context import build_context
    from mindformers.core.context.build_context import Context, MFContextOperator

    ms_mode = {"pynative": 1, "graph": 0}[mode.lower()]
    if Context.is_exists() and MFContextOperator.get_mf_ctx_instance() is not None:
        MFContextOperator.get_mf_ctx_instance().use_legacy = False
    else:
        build_context({"use_legacy": False, "run_mode": "train", "parallel": {},
                       "context": {"mode": ms_mode, "device_target": "CPU", "max_call_depth": 10000}})
    set_cpu_context(mode, seed=seed)


def set_yaml_context(config: Mapping[str, Any]) -> str:
    """MindFormers' context from a YAML (as a dict), as run_mindformer.py sets it: ``build_context`` (use_legacy,
    run_mode, ``context``, ``parallel``), then the YAML's seed. Returns the mode ("graph" / "pynative").

    The context is a process-wide singleton that cannot be built twice (CPU affinity is set once): when one
    exists (an earlier run in this process), only ``use_legacy`` and ``context.mode`` are taken from the YAML.
    """
    import copy

    from mindformers.core.context import build_context
    from mindformers.core.context.build_context import Context, MFContextOperator
    from mindformers.tools.register import MindFormerConfig

    mode = "pynative" if int((config.get("context") or {}).get("mode", 0)) == 1 else "graph"
    if Context.is_exists() and MFContextOperator.get_mf_ctx_instance() is not None:
        MFContextOperator.get_mf_ctx_instance().use_legacy = config.get("use_legacy", True) is not False
    else:
        build_context(MindFormerConfig(**copy.deepcopy(dict(config))))
    set_cpu_context(mode, seed=config.get("seed"))
    return mode


# MindFormers 2.x's GRAPH training classes of its mcore models (module, class)
TRAINING_MODELS = (("mindformers.models.qwen3.modeling_qwen3_train", "TrainingQwen3ForCausalLM"),
                   ("mindformers.models.qwen3_moe.modeling_qwen3_moe_train", "TrainingQwen3MoeForCausalLM"),
                   ("mindformers.models.deepseek3.modeling_deepseek_v3_train", "TrainingDeepseekV3ForCausalLM"))


def register_training_models() -> None:
    """Register MindFormers' own mcore training classes under their names, so that a YAML's
    ``model_config.architectures`` can name them. Why: for ``Qwen3ForCausalLM`` (etc.) MindFormers picks
    ``PyNative*ForCausalLM`` in PYNATIVE mode, which needs ``hyper_parallel`` (not installable here); the
    training class runs in both modes. Idempotent."""
    import importlib

    for module, name in TRAINING_MODELS:
        cls = getattr(importlib.import_module(module), name)
        MindFormerRegister.register_cls(cls, MindFormerModuleType.MODELS, legacy=False)


def build_yaml_model(config: Mapping[str, Any]) -> nn.Cell:
    """The model a MindFormers YAML (as a dict) describes, built as MindFormers' Trainer builds it for training:
    ``MindFormerConfig`` -> ``build_parallel_config`` -> ``build_network(config.model, default_args)`` with the
    Trainer's default arguments (for ``use_legacy: False``: the config class from ``model_type``, every
    ``model_config`` key passed to it, the model class from ``architectures``). No CPU stand-ins: the
    ``runner_wrapper`` installs them (:class:`McoreCPUTrainOneStepCell`), as in a YAML-only run.

    Call :func:`set_yaml_context` first (``use_legacy`` decides which builder path MindFormers takes).
    """
    import copy

    from mindformers.core.parallel_config import build_parallel_config
    from mindformers.models import build_network
    from mindformers.tools.register import MindFormerConfig

    register_training_models()
    cfg = MindFormerConfig(**copy.deepcopy(dict(config)))
    build_parallel_config(cfg)
    net = build_network(cfg.model, default_args={
        "parallel_config": cfg.parallel_config, "moe_config": cfg.moe_config, "dataset_config": cfg.train_dataset,
        "calculate_per_token_loss": bool(cfg.get("calculate_per_token_loss", False)),
        "batch_size": cfg.runner_config.batch_size})
    net.set_train(True)
    return net


def build_pynative_model(config: Mapping[str, Any]) -> nn.Cell:
    """The model a MindFormers YAML (as a dict) describes, built in PYNATIVE whatever the YAML's mode (its cells
    are then called one by one: single-module isolation, ``align isolate``), with the CPU stand-ins installed
    when it runs on CPU. Random weights: load the ones wanted afterwards (:func:`load_parameter_arrays`)."""
    import copy

    cfg = copy.deepcopy(dict(config))
    context = dict(cfg.get("context") or {})
    context["mode"] = 1
    cfg["context"] = context
    set_yaml_context(cfg)
    ms.set_context(mode=ms.PYNATIVE_MODE)
    net = build_yaml_model(cfg)
    if str(context.get("device_target", ms.get_context("device_target"))).upper() == "CPU":
        install_moe_module_standins()
        install_cpu_standins(net, "pynative")
    return net


def reset_mindformers_context() -> None:
    """Give ``use_legacy`` its default (True) back, so legacy Llama cells built later in this process take
    MFTrainOneStepCell's legacy step (it reads the flag when a cell is built)."""
    from mindformers.core.context.build_context import MFContextOperator

    inst = MFContextOperator.get_mf_ctx_instance()
    if inst is not None:
        inst.use_legacy = True


def qwen3_config(spec: TinyModel, **overrides: Any) -> Any:
    """A MindFormers Qwen3Config for ``spec``: float32 everywhere, no dropout, pad_token_id -1."""
    from mindformers.models.qwen3.configuration_qwen3 import Qwen3Config

    values: dict[str, Any] = dict(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.ffn_hidden_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_query_groups, head_dim=spec.head_dim,
        max_position_embeddings=spec.seq_length, seq_length=spec.seq_length, batch_size=spec.micro_batch_size,
        rms_norm_eps=spec.rms_norm_eps, rope_theta=spec.rope_theta, tie_word_embeddings=False,
        hidden_dropout=0.0, attention_dropout=0.0,
        # MindFormers hides keys whose token == pad_token_id from attention; Megatron never does.
        pad_token_id=-1,
        compute_dtype="float32", params_dtype="float32", layernorm_compute_dtype="float32",
        softmax_compute_dtype="float32", rotary_dtype="float32")
    values.update(overrides)
    return Qwen3Config(**values)


def _moe_values(spec: TinyModel) -> dict[str, Any]:
    return {"moe_intermediate_size": spec.moe_ffn_hidden_size, "num_experts_per_tok": spec.moe_topk,
            "norm_topk_prob": True, "moe_router_topk_scaling_factor": 1.0, "moe_grouped_gemm": True}


def qwen3_moe_config(spec: TinyModel, **overrides: Any) -> Any:
    """A MindFormers Qwen3MoeConfig for ``spec`` (every layer MoE; grouped GEMM is its only expert path)."""
    from mindformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig

    base = qwen3_config(spec).to_dict()
    values = {k: base[k] for k in _SHARED_CONFIG_KEYS if k in base}
    values.update(_moe_values(spec), num_experts=spec.num_experts, decoder_sparse_step=1,
                  num_key_value_heads=spec.num_query_groups, head_dim=spec.head_dim,
                  intermediate_size=spec.ffn_hidden_size)
    values.update(overrides)
    return Qwen3MoeConfig(**values)


def deepseek3_config(spec: TinyModel, **overrides: Any) -> Any:
    """A MindFormers DeepseekV3Config for ``spec``: MLA (mla_qkv_concat False, q/kv layernorm), MoE after
    ``first_k_dense`` dense layers (none with num_experts 0), ``shared_expert_size`` / moe width shared
    experts, no MTP, plain RoPE."""
    from mindformers.models.deepseek3.configuration_deepseek_v3 import DeepseekV3Config

    base = qwen3_config(spec).to_dict()
    values = {k: base[k] for k in _SHARED_CONFIG_KEYS if k in base}
    values.update(_moe_values(spec), n_routed_experts=spec.num_experts or 4,
                  n_shared_experts=spec.shared_expert_size // spec.moe_ffn_hidden_size,
                  # num_experts 0: every layer dense (MLA without MoE: runs on CPU in both modes)
                  first_k_dense_replace=spec.first_k_dense if spec.num_experts else spec.num_layers,
                  num_key_value_heads=spec.num_attention_heads,
                  intermediate_size=spec.ffn_hidden_size, kv_lora_rank=spec.kv_lora_rank,
                  q_lora_rank=spec.q_lora_rank, qk_rope_head_dim=spec.qk_pos_emb_head_dim,
                  qk_nope_head_dim=spec.qk_head_dim, v_head_dim=spec.v_head_dim, n_group=1, topk_group=1,
                  num_nextn_predict_layers=0, routed_scaling_factor=1.0, mla_qkv_concat=False,
                  qk_layernorm=True,
                  # MindFormers' MLA defaults to YaRN RoPE with factor 40, whose mscale also scales the
                  # softmax (0.459 instead of 1/sqrt(12) here); Megatron's tiny model uses plain RoPE.
                  # Factor 1 makes YaRN plain RoPE and mscale 1 on both counts.
                  rope_scaling={"type": "yarn", "factor": 1.0, "original_max_position_embeddings": spec.seq_length})
    values.update(overrides)
    return DeepseekV3Config(**values)


_SHARED_CONFIG_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                       "max_position_embeddings", "seq_length", "batch_size", "rms_norm_eps", "rope_theta",
                       "tie_word_embeddings", "hidden_dropout", "attention_dropout", "pad_token_id",
                       "compute_dtype", "params_dtype", "layernorm_compute_dtype", "softmax_compute_dtype",
                       "rotary_dtype")


def build_mcore_model(spec: TinyModel, mode: str = "graph", *, seed: int = 0, standins: bool = True,
                      fix_pynative_split: bool = True, **config_overrides: Any) -> nn.Cell:
    """A real MindFormers mcore ``Training*ForCausalLM`` for ``spec`` with the CPU stand-ins installed.

    Call :func:`set_mcore_context` first. Parameter names (``net.get_parameters()``) are Megatron's own
    (``decoder.layers.0.self_attention.linear_qkv.weight``, ...); linear_fc1 is row-interleaved gate/up,
    routed experts are stacked (``mlp.experts.weight1`` / ``weight2``).
    kinds: dense (TrainingQwen3ForCausalLM), moe (TrainingQwen3MoeForCausalLM: routed experts, alltoall
    dispatcher with EP=1) and mla (TrainingDeepseekV3ForCausalLM: MLA, MoE with ``shared_expert_size``
    shared experts; ``num_experts=0`` makes every layer dense); all train here in GRAPH and PYNATIVE.
    ``fix_pynative_split=False`` keeps MLA's PYNATIVE gradient bug (see :class:`CpuSplitWithSize`).
    """
    ms.set_seed(seed)
    if standins and spec.kind in ("moe", "mla"):
        install_moe_module_standins()
    if spec.kind == "dense":
        if not spec.qk_layernorm:
            raise ValueError("TrainingQwen3ForCausalLM always has q/k layernorm; set qk_layernorm=True")
        from mindformers.models.qwen3.modeling_qwen3_train import TrainingQwen3ForCausalLM

        net = TrainingQwen3ForCausalLM(qwen3_config(spec, **config_overrides))
    elif spec.kind == "moe":
        from mindformers.models.qwen3_moe.modeling_qwen3_moe_train import TrainingQwen3MoeForCausalLM

        net = TrainingQwen3MoeForCausalLM(qwen3_moe_config(spec, **config_overrides))
    elif spec.kind == "mla":
        from mindformers.models.deepseek3.modeling_deepseek_v3_train import TrainingDeepseekV3ForCausalLM

        net = TrainingDeepseekV3ForCausalLM(deepseek3_config(spec, **config_overrides))
    else:
        raise ValueError(f"model kind {spec.kind!r}: expected one of {', '.join(MODEL_KINDS)}")
    if standins:
        install_cpu_standins(net, mode, fix_pynative_split=fix_pynative_split)
    net.set_train(True)
    return net


class McoreReplayLoss(nn.Cell):
    """The mcore model called with (input_ids, labels, loss_mask): the replay dataset's columns.

    Why: training cells pass dataset columns positionally; the mcore construct takes labels 5th and
    loss_mask 8th. ``network`` is the attribute MindFormers' ``get_real_models`` unwraps.
    """

    def __init__(self, net: nn.Cell) -> None:
        super().__init__(auto_prefix=False)
        self.network = net

    def construct(self, input_ids: Tensor, labels: Tensor, loss_mask: Tensor) -> Any:
        return self.network(input_ids, None, None, None, labels, None, None, loss_mask)


def build_mcore_train_cell(net: nn.Cell, *, learning_rate: float = 1e-3, weight_decay: float = 0.0,
                           local_norm: bool = True, use_clip_grad: bool = True, max_grad_norm: float = 1.0,
                           optimizer: nn.Optimizer | None = None) -> CPUTrainOneStepCell:
    """MindFormers' training step (mcore path of MFTrainOneStepCell, CPU overflow check) around ``net``.

    Default optimizer: ``mindformers.core.optim.AdamW`` (runs on CPU; matches torch AdamW to ~4e-7).
    """
    if optimizer is None:
        from mindformers.core.optim import AdamW

        optimizer = AdamW(net.trainable_params(), learning_rate=learning_rate, weight_decay=weight_decay,
                          betas=(0.9, 0.95), eps=1e-8)
    cell = CPUTrainOneStepCell(McoreReplayLoss(net), optimizer, local_norm=local_norm,
                               use_clip_grad=use_clip_grad, max_grad_norm=max_grad_norm)
    cell.set_train(True)
    return cell


@MindFormerRegister.register(MindFormerModuleType.WRAPPER)
class McoreCPUTrainOneStepCell(CPUTrainOneStepCell):
    """The ``runner_wrapper`` a YAML names to train an mcore model on CPU with ``run_mindformer.py``.

    Why a wrapper: it is the one class a YAML names that MindFormers' Trainer builds *with the network*
    before the training graph compiles (``Model.train`` / ``model.build``; checkpoints load by name
    afterwards), so it can install the CPU stand-ins (:func:`install_cpu_standins`, and the MoE names of
    :func:`install_moe_module_standins`) on the very network that trains. The step is CPUTrainOneStepCell's:
    MindFormers' own MFTrainOneStepCell with the CPU overflow check. CPU support only: on an NPU use
    MindFormers' ``MFTrainOneStepCell``.
    """

    def __init__(self, network: nn.Cell, optimizer: nn.Optimizer, **kwargs: Any) -> None:
        mode = "pynative" if ms.get_context("mode") == ms.PYNATIVE_MODE else "graph"
        if mode == "pynative":
            ms.runtime.launch_blocking()     # synchronous launch: ~10x faster PYNATIVE steps on a small CPU
        install_moe_module_standins()
        install_cpu_standins(network, mode)
        super().__init__(network, optimizer, **kwargs)


def mcore_inputs(batch: Mapping[str, np.ndarray]) -> tuple[Tensor, Tensor, Tensor]:
    """(input_ids, labels, loss_mask) Tensors from a Megatron-style or MindFormers-style batch dict."""
    ids = batch.get("input_ids", batch.get("tokens"))
    if ids is None:
        raise KeyError("batch needs input_ids (or tokens)")
    return (Tensor(np.asarray(ids).astype(np.int32)), Tensor(np.asarray(batch["labels"]).astype(np.int32)),
            Tensor(np.asarray(batch["loss_mask"]).astype(np.float32)))


def forward_loss(net: nn.Cell, batch: Mapping[str, np.ndarray]) -> float:
    """The lm loss of one batch: sum(ce * loss_mask) / sum(loss_mask), as Megatron computes it."""
    wrapper = net.__dict__.get("_xf_replay_loss")
    if wrapper is None:   # one wrapper per model: GRAPH compiles it once, not on every call
        wrapper = McoreReplayLoss(net)
        object.__setattr__(net, "_xf_replay_loss", wrapper)
    out = wrapper(*mcore_inputs(batch))
    return float(np.asarray(out[0].asnumpy()).reshape(-1)[0])


def parameter_arrays(net: nn.Cell) -> dict[str, np.ndarray]:
    """Every parameter of ``net`` by its MindFormers checkpoint name (no ``model.`` prefix), as numpy."""
    return {p.name: p.asnumpy().copy() for p in net.get_parameters()}   # a copy: asnumpy may share memory


_ROUTER_STATE = (".router.fi_accu", ".router.expert_load")


def load_parameter_arrays(net: nn.Cell, arrays: Mapping[str, np.ndarray]) -> None:
    """Copy ``arrays`` into ``net``'s parameters by name; every name and shape must match exactly, except the
    MoE router's running statistics (``router.fi_accu`` / ``expert_load``: MindFormers-only state, not in a
    Megatron checkpoint; the presets ignore them), which keep their initial zeros when absent."""
    params = {p.name: p for p in net.get_parameters()
              if p.name in arrays or not p.name.endswith(_ROUTER_STATE)}
    missing = sorted(set(params) - set(arrays))
    extra = sorted(set(arrays) - set(params))
    if missing or extra:
        raise KeyError(f"parameter names differ: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, p in params.items():
        a = np.asarray(arrays[name])
        if tuple(a.shape) != tuple(p.shape):
            raise ValueError(f"{name}: shape {a.shape} != parameter shape {tuple(p.shape)}")
        p.set_data(Tensor(a.astype(np.float32) if a.dtype != np.float32 else a))


def quiet_mindformers_output(path: str) -> None:
    """Point MindFormers' ./output (logs, checkpoints) elsewhere; call before importing mindformers."""
    os.environ.setdefault("LOCAL_DEFAULT_PATH", path)
