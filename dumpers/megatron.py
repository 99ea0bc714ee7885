"""Megatron-core layer over the torch dumper: names, TP partitions, main_grad, and the grad-norm hook.

Why a separate layer: Megatron keeps gradients in ``param.main_grad`` (DDP buffers), prefixes every name
with ``module.`` under DDP, splits parameters across TP ranks (``tensor_model_parallel`` /
``partition_dim`` attributes) while duplicating others (norm weights), and computes the grad norm in
``get_grad_norm_fp32``, which ``megatron/core/optimizer/optimizer.py`` imports by name. The local norms are
captured inside that call, so they are exactly the gradients the optimizer used for its norm (after the
DDP all-reduce, before clipping), and the norm it returns is stored next to them.
"""

from __future__ import annotations

import importlib
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dumpers.torch_dumper import DumpConfig, TorchDumper

HOOK_TARGET = "megatron.core.optimizer.optimizer"
HOOK_NAME = "get_grad_norm_fp32"
WHERE = f"{HOOK_TARGET}.{HOOK_NAME}"

_lock = threading.Lock()
_listeners: weakref.WeakSet[MegatronDumper] = weakref.WeakSet()
_original: Any = None


def _hooked_get_grad_norm_fp32(grads_for_norm: Any, *args: Any, **kwargs: Any) -> Any:
    """Megatron's function, unchanged in result; listeners see the norm and the gradients it used."""
    total = _original(grads_for_norm, *args, **kwargs)
    norm_type = kwargs.get("norm_type", args[0] if args else 2)
    for dumper in list(_listeners):
        dumper._on_grad_norm(total if float(norm_type) == 2.0 else None)
    return total


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
            return {"tp_rank": ps.get_tensor_model_parallel_rank(),
                    "pp_rank": ps.get_pipeline_model_parallel_rank(),
                    "dp_rank": ps.get_data_parallel_rank(),
                    "tp": ps.get_tensor_model_parallel_world_size(),
                    "pp": ps.get_pipeline_model_parallel_world_size(),
                    "dp": ps.get_data_parallel_world_size()}
        except Exception:  # noqa: BLE001 - coordinates are best effort; the global rank is always there
            return {}

    def _clean_name(self, name: str) -> str:
        return strip_module_prefix(name)

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
        self.record_grads(global_norm=None if total is None else float(total), where=WHERE)

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
