"""Megatron-core layer over the torch dumper: names, TP/DP/PP/EP layouts, and the grad-norm hook.

Why a separate layer: Megatron keeps gradients in ``param.main_grad`` (DDP buffers), prefixes every name
with ``module.`` under DDP, splits parameters across TP ranks (``tensor_model_parallel`` /
``partition_dim`` attributes) while duplicating others (norm weights), and computes the grad norm in
``get_grad_norm_fp32``, which ``megatron/core/optimizer/optimizer.py`` imports by name. The local norms are
captured inside that call, so they are exactly the gradients the optimizer used for its norm (after the
DDP all-reduce, before clipping), and the norm it returns is stored next to them.

Layouts users train with, each read from the optimizer and model rather than guessed:

* gradients come from the optimizer's own main parameters: fp16/bf16 main grads are already unscaled
  there (``main_grad`` on the model may still carry the loss scale), and with the distributed optimizer each
  rank holds only its reduce-scattered shard of a parameter (recorded with ``dp_shard=1``; the comparator
  adds the squares of the DP ranks' parts);
* names are global: a pipeline stage's ``decoder.layers.{i}`` becomes ``layers.{layer_number - 1}`` and
  virtual-pipeline chunks need no prefix; an expert ``local_experts.{e}`` / grouped ``weight{e}`` becomes the
  global expert index (EP rank x local experts + e); the last stage's copy of a tied embedding
  (``shared``) is left out, as Megatron's own norm leaves it out;
* a chained optimizer (dense + expert) calls ``get_grad_norm_fp32`` once per sub-optimizer: every
  parameter is captured at the first call and the step's global norm is sqrt(sum of the calls' squares);
* sequence parallelism: norm / bias gradients are read after ``finalize_model_grads`` all-reduced them over
  TP (duplicated, like any norm); context parallelism: each rank records its zig-zag chunks of the batch and
  its ``cp_rank`` (``runstore.batches`` joins them), its gradients being DP x CP replicas. meta.json
  ``parallel`` carries ``cp`` and ``sequence_parallel`` (docs/layouts.md).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import re
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from dumpers.torch_dumper import DumpConfig, TorchDumper

HOOK_TARGET = "megatron.core.optimizer.optimizer"
HOOK_NAME = "get_grad_norm_fp32"
WHERE = f"{HOOK_TARGET}.{HOOK_NAME}"

_lock = threading.Lock()
_listeners: weakref.WeakSet[MegatronDumper] = weakref.WeakSet()
_original: Any = None


_muted = threading.local()


def _hooked_get_grad_norm_fp32(grads_for_norm: Any, *args: Any, **kwargs: Any) -> Any:
    """Megatron's function, unchanged in result; listeners see the norm and the gradients it used."""
    total = _original(grads_for_norm, *args, **kwargs)
    if getattr(_muted, "on", False):
        return total
    norm_type = kwargs.get("norm_type", args[0] if args else 2)
    for dumper in list(_listeners):
        dumper._on_grad_norm(total if float(norm_type) == 2.0 else None)
    return total


@contextlib.contextmanager
def grad_norm_hook_muted() -> Iterator[None]:
    """Megatron grad-norm calls inside this block reach no dumper: the norm of gradients the step does not
    use (the clipping probe of dumpers.optimizer_evidence) must not pose as the step's grad norm."""
    prev = getattr(_muted, "on", False)
    _muted.on = True
    try:
        yield
    finally:
        _muted.on = prev


def install_grad_norm_hook(dumper: MegatronDumper) -> None:
    """Route ``optimizer.py``'s ``get_grad_norm_fp32`` through the dumper (installed once per process)."""
    global _original
    with _lock:
        mod = importlib.import_module(HOOK_TARGET)
        if _original is None:
            _original = getattr(mod, HOOK_NAME)
            setattr(mod, HOOK_NAME, _hooked_get_grad_norm_fp32)
        _listeners.add(dumper)


def remove_grad_norm_hook(dumper: MegatronDumper) -> None:
    """Detach ``dumper``; the original function comes back when no dumper listens."""
    global _original
    with _lock:
        _listeners.discard(dumper)
        if not _listeners and _original is not None:
            setattr(importlib.import_module(HOOK_TARGET), HOOK_NAME, _original)
            _original = None


def strip_module_prefix(name: str) -> str:
    """``module.module.decoder...`` (DDP / Float16Module wrappers) -> ``decoder...``."""
    while name.startswith("module."):
        name = name[len("module."):]
    return "" if name == "module" else name


_LAYER_RE = re.compile(r"^((?:.*\.)?decoder\.layers)\.(\d+)$")
_LOCAL_EXPERT_RE = re.compile(r"^local_experts\.(\d+)(\..*)?$")
_GROUPED_EXPERT_RE = re.compile(r"^(.*\.(?:weight|bias))(\d+)$")
_LAYER_PREFIX_RE = re.compile(r"^((?:.*\.)?decoder\.layers\.\d+)(\..*)?$")


def _group_rank(group: Any) -> int:
    try:
        import torch.distributed as dist

        return int(dist.get_rank(group)) if group is not None and dist.is_initialized() else 0
    except Exception:  # noqa: BLE001 - not a member / not initialised: rank 0 of a one-rank group
        return 0


def global_namer(model: torch.nn.Module) -> Callable[[str], str]:
    """A function from this chunk's ``named_parameters``/``named_modules`` names to global names.

    Pipeline stages and virtual chunks number their layers from 0; ``TransformerLayer.layer_number`` (1-based,
    offset by the stage) is the global position. Experts are numbered per EP rank; the experts module's
    ``ep_group`` rank times ``num_local_experts`` is the offset (Megatron's ``local_expert_indices_offset``).
    """
    layers: dict[str, str] = {}
    experts: dict[str, int] = {}
    for name, mod in model.named_modules():
        clean = strip_module_prefix(name)
        m = _LAYER_RE.match(clean)
        number = getattr(mod, "layer_number", None)
        if m and isinstance(number, int) and not isinstance(number, bool):
            layers[clean] = f"{m.group(1)}.{number - 1}"
        n_local = getattr(mod, "num_local_experts", None)
        # the experts module itself (SequentialMLP / GroupedMLP / TEGroupedMLP), not the MoE layer above it
        if isinstance(n_local, int) and hasattr(mod, "ep_group") and not hasattr(mod, "router"):
            offset = _group_rank(mod.ep_group) * n_local
            if offset:
                experts[clean] = offset

    def name_of(name: str) -> str:
        n = strip_module_prefix(name)
        for prefix, offset in experts.items():
            if n.startswith(prefix + "."):
                rest = n[len(prefix) + 1:]
                m = _LOCAL_EXPERT_RE.match(rest)
                if m:
                    rest = f"local_experts.{int(m.group(1)) + offset}{m.group(2) or ''}"
                else:  # grouped GEMM (TEGroupedMLP): linear_fc1.weight{e}
                    m = _GROUPED_EXPERT_RE.match(rest)
                    if m:
                        rest = f"{m.group(1)}{int(m.group(2)) + offset}"
                n = f"{prefix}.{rest}"
                break
        m = _LAYER_PREFIX_RE.match(n)
        if m and m.group(1) in layers:
            n = layers[m.group(1)] + (m.group(2) or "")
        return n
    return name_of


def _module_role(name: str, mod: torch.nn.Module | None) -> str:
    """How a module's activations are laid out under TP: ``column`` / ``row`` parallel linear, the core
    ``attention`` (heads split), the ``embedding`` (token ids in), an ``expert`` (permuted tokens: no
    sequence order), else ``other`` (hidden states: whole, or sequence-split under SP)."""
    if mod is None:
        return "other"
    mode = getattr(mod, "parallel_mode", None)      # TransformerEngine's linears
    names = {c.__name__ for c in type(mod).__mro__}
    if getattr(mod, "is_expert", False) or ".experts." in f".{name}.":
        return "expert"
    if ".core_attention." in name:      # softmax / dropout inside the local attention: [b, np, sq, sk]
        return "attention_inner"
    if name.endswith(("q_layernorm", "k_layernorm")):   # QK norms: [s, b, heads, head dim]
        return "heads"
    if "ColumnParallelLinear" in names or mode == "column":
        if getattr(mod, "gather_output", False):
            return "column_gathered"
        gated = name.endswith("linear_fc1") and getattr(getattr(mod, "config", None), "gated_linear_unit", False)
        return "column_gated" if gated else "column"
    if "RowParallelLinear" in names or mode == "row":
        return "row" + ("" if getattr(mod, "input_is_parallel", True) else "_whole_in")
    if any(n.endswith("DotProductAttention") for n in names):
        return "attention"
    if hasattr(mod, "word_embeddings"):
        return "embedding"
    return "other"


@functools.lru_cache(maxsize=4096)
def activation_split(role: str, kind: str, ndim: int, floating: bool, last: int, *, tp: int, cp: int,
                     sp: bool, hidden: int) -> str:
    """The ``split`` of one activation (or its gradient, laid out as the activation): ``tp:D`` = TP rank r
    holds the r-th of ``tp`` equal parts along dim D (in TP rank order); ``tp:g-1`` = a gated fc1's output,
    TP rank r holding [gate_r | up_r] along the last dim (the whole is [gate | up]); ``cp:D`` = CP rank r
    holds chunks r and 2cp-1-r of 2cp along dim D (Megatron's load-balanced split, get_batch_on_this_cp_rank);
    ``cp:x`` = a CP rank's part in no sequence order (attention internals).

    Megatron's layout, activations sequence first ([s, b, h]): a column-parallel linear's output is split on
    its last dim, a row-parallel linear's input too and its output is whole after the all-reduce (under SP
    reduce-scattered on the sequence); the core attention's q/k/v are split on heads (dim 2) and its output
    on the last dim; under SP every other hidden state ([s/tp, b, h]) is split on the sequence; under CP
    every activation is a CP rank's two chunks of the sequence (token ids [b, s]: dim 1)."""
    where, index = kind.split(".")[1:3] if kind.count(".") >= 2 else ("output", "0")
    out = where in ("output", "grad_output")
    first = index == "0"
    tp_dim: int | str | None = None
    cp_dim: int | str | None = None
    seq = floating and ndim >= 2
    if role.startswith("column"):
        if out:
            tp_dim = {"column": -1, "column_gated": "g-1"}.get(role)
            cp_dim = 0 if seq and first else None
        else:
            tp_dim, cp_dim = (0 if sp and seq else None), (0 if seq else None)
    elif role.startswith("row"):
        if out:
            tp_dim, cp_dim = (0 if sp and first and seq else None), (0 if seq and first else None)
        else:
            tp_dim, cp_dim = (-1 if seq and role == "row" else None), (0 if seq else None)
    elif role == "attention":
        if out:
            tp_dim, cp_dim = (-1 if seq else None), (0 if seq else None)
        elif ndim == 4:     # q / k / v [s, b, heads, d]; the boolean mask [b, 1, s, s]
            tp_dim, cp_dim = (2, 0) if floating else (None, 2)
    elif role == "heads":
        tp_dim, cp_dim = (2, 0) if floating and ndim == 4 else (None, None)
    elif role == "attention_inner":
        # [b, heads, s_q, s_k]: under CP the keys are in the attention's own order (all-gathered, ring
        # passes), not the sequence's: "x", left out of a gathered compare
        tp_dim, cp_dim = (1 if floating and ndim == 4 else None), "x"
    elif role == "embedding" and not out:
        cp_dim = 1 if not floating and ndim == 2 else None
    elif role != "expert":
        hidden_state = floating and ndim == 3 and last == hidden
        tp_dim = 0 if sp and hidden_state else None
        # rotary embeddings [s, 1, 1, d]; the boolean attention mask [b, 1, s, s] holds the CP rank's queries
        cp_dim = 0 if hidden_state or (floating and ndim == 4) else 2 if ndim == 4 else None
    parts = ([f"tp:{tp_dim}"] if tp > 1 and tp_dim is not None else []) + \
        ([f"cp:{cp_dim}"] if cp > 1 and cp_dim is not None else [])
    return ",".join(parts)


def _unwrap_optimizer(opt: Any) -> Any:
    """The Megatron optimizer inside a thin wrapper (``.inner``), else ``opt`` itself."""
    try:
        from megatron.core.optimizer.optimizer import MegatronOptimizer
    except ImportError:
        return opt
    seen = 0
    while not isinstance(opt, MegatronOptimizer) and hasattr(opt, "inner") and seen < 4:
        opt, seen = opt.inner, seen + 1
    return opt


def optimizer_grads(opt: Any) -> dict[int, tuple[torch.Tensor | None, int, int, int]]:
    """``id(model param) -> (gradient the optimizer uses, dp_shard, dp_rank, dp_size)``.

    FP32Optimizer: the param's ``grad`` (= ``main_grad`` after ``prepare_grads``). Float16 optimizer: the
    fp32 main param's ``grad`` (unscaled). Distributed optimizer: this rank's shard of every parameter of its
    buffers (``None`` where the rank holds no part), the DP group being the optimizer's own (the expert
    optimizer's is the expert-DP group). A chained optimizer: the union of its sub-optimizers.
    """
    import torch.distributed as dist

    opt = _unwrap_optimizer(opt)
    out: dict[int, tuple[torch.Tensor | None, int, int, int]] = {}
    for sub in getattr(opt, "chained_optimizers", None) or [opt]:
        sub = _unwrap_optimizer(sub)
        if getattr(sub, "is_stub_optimizer", False):
            continue
        if hasattr(sub, "model_param_gbuf_map") and hasattr(sub, "shard_fp32_groups"):
            group = getattr(sub, "data_parallel_group", None)
            rank = _group_rank(group)
            size = int(dist.get_world_size(group)) if group is not None and dist.is_initialized() else 1
            # every parameter of the optimizer's grad buffers; model_param_gbuf_map holds only those with a
            # part on this rank, the others get an empty row (norm 0, numel 0)
            for buffer in getattr(sub, "buffers", []):
                for param in getattr(buffer, "params", []):
                    out[id(param)] = (None, 1, rank, size)
            for param in sub.model_param_gbuf_map:
                out[id(param)] = (None, 1, rank, size)
            aware = bool(getattr(sub.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False))
            pairs = [(sub.model_float16_groups, sub.shard_float16_groups if aware
                      else sub.shard_fp32_from_float16_groups), (sub.model_fp32_groups, sub.shard_fp32_groups)]
            for model_groups, shard_groups in pairs:
                for mg, sg in zip(model_groups, shard_groups, strict=False):
                    for mp, sp in zip(mg, sg, strict=False):
                        g = getattr(sp, "decoupled_grad", None) if aware else sp.grad
                        out[id(mp)] = (g, 1, rank, size)
        elif hasattr(sub, "fp32_from_float16_groups"):
            for mg, sg in zip(sub.float16_groups, sub.fp32_from_float16_groups, strict=False):
                for mp, sp in zip(mg, sg, strict=False):
                    out[id(mp)] = (sp.grad, 0, 0, 1)
            for group in sub.fp32_from_fp32_groups:
                for p in group:
                    g = p.grad if p.grad is not None else getattr(p, "main_grad", None)
                    out[id(p)] = (g, 0, 0, 1)
        elif hasattr(sub, "get_parameters"):
            for p in sub.get_parameters():
                g = p.grad if p.grad is not None else getattr(p, "main_grad", None)
                out[id(p)] = (g, 0, 0, 1)
    return out


def _is_megatron_optimizer(opt: Any) -> bool:
    try:
        from megatron.core.optimizer.optimizer import MegatronOptimizer
    except ImportError:
        return False
    return isinstance(opt, MegatronOptimizer) or isinstance(getattr(opt, "inner", None), MegatronOptimizer)


class MegatronDumper(TorchDumper):
    """The torch dumper for Megatron-core models (bare, DDP-wrapped, or a list of model chunks).

    ``optimizer``: Megatron's optimizer (hooked at ``get_grad_norm_fp32``) or a plain torch optimizer
    (hooked at its ``step``). Rank coordinates come from ``megatron.core.parallel_state``.
    """

    framework = "megatron-core"
    name_scheme = "megatron-core-local"

    def __init__(self, model: torch.nn.Module | Sequence[torch.nn.Module], optimizer: Any = None,
                 config: DumpConfig | None = None, *, rank_info: Mapping[str, Any] | None = None,
                 meta: Mapping[str, Any] | None = None) -> None:
        models = list(model) if isinstance(model, (list, tuple)) else [model]
        if any(n.endswith("layer_norm_weight") for m in models for n, _ in m.named_parameters()):
            self.name_scheme = "megatron-core-te"
        self._megatron_opt = _is_megatron_optimizer(optimizer)
        self._activation_parallel: tuple[int, int, bool, int, dict[str, str]] | None = None
        self._modules_by_name: dict[str, torch.nn.Module] | None = None
        # dtypes given by the user win; else they are refreshed once main_grad exists
        self._dtypes_final = "dtypes" in (meta or {}) or "dtypes" in (config.meta if config else {})
        # A Megatron optimizer has no torch step hook: keep it away from the generic pre-hook path.
        super().__init__(models, None if self._megatron_opt else optimizer, config,
                         rank_info=rank_info, meta=meta)
        self.optimizer = optimizer
        wants_grads = self.config.local_norms or self.config.nan_trace != "off"
        if self._megatron_opt and self.enabled and wants_grads:
            try:
                install_grad_norm_hook(self)
            except Exception as exc:
                self._fail("install grad-norm hook", exc)

    def attach_optimizer(self, optimizer: Any) -> None:
        """Attach the optimizer once it exists (Megatron-LM builds it after ``model_provider``)."""
        try:
            self.optimizer = optimizer
            if not self.enabled or not (self.config.local_norms or self.config.nan_trace != "off"):
                return
            if _is_megatron_optimizer(optimizer):
                self._megatron_opt = True
                install_grad_norm_hook(self)
            elif hasattr(optimizer, "register_step_pre_hook"):
                self._handles.append(optimizer.register_step_pre_hook(self._opt_pre_hook))
        except Exception as exc:
            self._fail("attach_optimizer", exc)

    def _default_rank_info(self) -> dict[str, Any]:
        try:
            from megatron.core import parallel_state as ps

            if not ps.model_parallel_is_initialized():
                return {}
            out = {"tp_rank": ps.get_tensor_model_parallel_rank(),
                   "pp_rank": ps.get_pipeline_model_parallel_rank(),
                   "dp_rank": ps.get_data_parallel_rank(),
                   "tp": ps.get_tensor_model_parallel_world_size(),
                   "pp": ps.get_pipeline_model_parallel_world_size(),
                   "dp": ps.get_data_parallel_world_size()}
            try:
                out.update(ep_rank=ps.get_expert_model_parallel_rank(),
                           ep=ps.get_expert_model_parallel_world_size())
            except Exception:  # noqa: BLE001 - older cores without expert groups
                pass
            try:   # the batch a CP rank records is its two zig-zag chunks of the sequence (runstore.batches)
                out.update(cp_rank=ps.get_context_parallel_rank(), cp=ps.get_context_parallel_world_size())
            except Exception:  # noqa: BLE001 - cores without context parallelism
                pass
            return out
        except Exception:  # noqa: BLE001 - coordinates are best effort; the global rank is always there
            return {}

    def _clean_name(self, name: str) -> str:
        return strip_module_prefix(name)

    def _parallel_meta(self) -> dict[str, Any]:
        out = super()._parallel_meta()
        out["cp"] = int(self.rank_info.get("cp", 1))
        cfg = next((getattr(m, "config", None) for m in self.models if hasattr(m, "config")), None)
        out["sequence_parallel"] = bool(getattr(cfg, "sequence_parallel", False))
        return out

    def _chunk_namer(self, index: int, model: torch.nn.Module) -> Callable[[str], str]:
        return global_namer(model)

    def _split_of(self, module: str, kind: str, t: torch.Tensor) -> str:
        """How this rank's activation is a part of the whole under TP / SP / CP (``split`` column of
        ``tensor_stats``, read by ``sources.layers.gather_layers``); "" for a whole tensor or a replica."""
        par = self._activation_parallel
        if par is None:
            cfg = next((getattr(m, "config", None) for m in self.models if hasattr(m, "config")), None)
            tp, cp = int(self.rank_info.get("tp", 1)), int(self.rank_info.get("cp", 1))
            par = self._activation_parallel = (tp, cp, tp > 1 and bool(getattr(cfg, "sequence_parallel", False)),
                                               int(getattr(cfg, "hidden_size", 0) or 0), {})
        tp, cp, sp, hidden, cache = par
        if tp == 1 and cp == 1:
            return ""
        role = cache.get(module)
        if role is None:
            role = cache[module] = _module_role(module, self._module_named(module))
        return activation_split(role, kind, t.ndim, t.is_floating_point(), t.shape[-1] if t.ndim else 0,
                                tp=tp, cp=cp, sp=sp, hidden=hidden)

    def _module_named(self, name: str) -> torch.nn.Module | None:
        if self._modules_by_name is None:
            self._modules_by_name = dict(self._selected_modules())
        return self._modules_by_name.get(name)

    def _skip_param(self, param: torch.nn.Parameter) -> bool:
        # The last stage's copy of a tied embedding: Megatron's grad norm leaves it out (param_is_not_shared).
        return not param.requires_grad or bool(getattr(param, "shared", False))

    def _grad_entries(self) -> list[tuple[int, torch.Tensor | None, int, int, int]]:
        grads = optimizer_grads(self.optimizer) if self._megatron_opt else {}
        if not grads:
            return super()._grad_entries()
        dp_rank = int(self.rank_info.get("dp_rank", 0))
        out = []
        for i, (_, p, _) in enumerate(self.params):
            hit = grads.get(id(p))
            if hit is None:
                out.append((i, self._grad_of(p), 0, dp_rank, 1))
            else:
                g, dp_shard, rank, size = hit
                out.append((i, g, dp_shard, rank if dp_shard else dp_rank, size))
        return out

    def _dtypes(self) -> dict[str, str]:
        out = super()._dtypes()
        cfg = next((getattr(m, "config", None) for m in self.models if hasattr(m, "config")), None)
        if cfg is not None:
            if getattr(cfg, "bf16", False):
                out["compute"] = "bfloat16"
            elif getattr(cfg, "fp16", False):
                out["compute"] = "float16"
        for _, p, _ in self.params:
            g = getattr(p, "main_grad", None)
            if isinstance(g, torch.Tensor):
                out["grads"] = str(g.dtype).replace("torch.", "")
                break
        else:
            ddp = next((getattr(m, "ddp_config", None) for m in self.models if hasattr(m, "ddp_config")), None)
            if ddp is not None:
                out["grads"] = "float32" if getattr(ddp, "grad_reduce_in_fp32", False) else out["params"]
        return out

    def _tp_info(self, param: torch.nn.Parameter) -> tuple[int, int, int]:
        tp_rank, tp_size = int(self.rank_info.get("tp_rank", 0)), int(self.rank_info.get("tp", 1))
        if getattr(param, "tensor_model_parallel", False):
            return int(getattr(param, "partition_dim", 0)), tp_rank, tp_size
        return -1, tp_rank, tp_size

    def _grad_of(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        g = getattr(p, "main_grad", None)
        return g if g is not None else p.grad

    def _versions(self) -> dict[str, str]:
        out = super()._versions()
        try:
            import megatron.core

            out["megatron-core"] = megatron.core.__version__
        except Exception:  # noqa: BLE001
            pass
        return out

    def _extra_meta(self) -> dict[str, Any]:
        return {"names": {"stripped_prefix": "module.", "source": "model.named_parameters()"},
                "local_norm_where": WHERE if self._megatron_opt else "torch.optim.Optimizer.step"}

    def _on_grad_norm(self, total: Any) -> None:
        first = not self._norms_recorded
        self.record_grads(global_norm=None if total is None else float(total), where=WHERE)
        if first and self._step is not None and not self._dtypes_final:
            self._dtypes_final = True  # main_grad exists now (DDP wraps after the dumper may be made)
            self.update_meta({"dtypes": self._dtypes()})

    def close(self) -> None:
        remove_grad_norm_hook(self)
        super().close()


def recombine_local_norms(tables: Sequence[Any]) -> float:
    """Global norm from the ``local_norm`` tables of one TP group (one per TP rank, pandas DataFrames).

    TP-partitioned shards add up as squares; a duplicated parameter (``tp_partition_dim == -1``) counts
    once. This is what Megatron's optimizer computes, so the two must agree.
    """
    total = 0.0
    for t in tables:
        for dim, rank, norm in zip(t["tp_partition_dim"], t["tp_rank"], t["norm"], strict=True):
            if int(dim) >= 0 or int(rank) == 0:
                total += float(norm) ** 2
    return total ** 0.5
