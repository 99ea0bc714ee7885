"""Baseline side of the optimizer check, inside a PyTorch / Megatron training loop: at one step, the
weights before the optimizer step, the gradients it steps on, and the weights after, by parameter name.

Why a file: the candidate's optimizer must step from the same weights with the same gradients (see
comparators.optimizer_check); the baseline writes them once and the candidate reads them
(dumpers.mindspore_optimizer_check). One process writes ``RUN/evidence/optimizer_step1.npz`` (``init/``,
``grad/``, ``weight/``). Under torch.distributed every rank writes only what it owns, to
``RUN/evidence/optimizer_step1/rank_R.npz`` (flat slices with their offsets, ``runstore.step1_file``), and the
reader merges them into whole named tensors:

* distributed optimizer: each DP rank holds the reduce-scattered gradient of its range of every bucket (the
  rest of its grad buffer is not reduced), and owns the update of that range; it writes exactly that range
  of the gradient, the weight before and the weight after (the optimizer's own range map);
* otherwise the data-parallel replicas are equal: only DP rank 0 (expert-DP rank 0 for experts) writes;
* a TP-partitioned parameter is written per TP rank with its partition dim (a gated fc1 as [gate_r; up_r]),
  a TP-duplicated one by TP rank 0; names are global (pipeline stages, experts: dumpers.megatron).

Why shards rather than gathered tensors: gathering the full gradients of a large model onto one rank needs a
whole model of memory there and collectives inside the training step (Megatron's DistributedOptimizer
gathers parameters, never gradients). Shards cost each rank 3 x its own part of the model on disk, no
communication and no memory beyond what the rank holds; the merge runs offline where the report is made.

Use, around the optimizer step of iteration 1, on every rank (Megatron: after ``forward_backward_func``,
whose ``finalize_model_grads`` reduces the gradients, before ``optimizer.step()``):

    ev = OptimizerEvidence(model, run_dir, optimizer)   # model: the module or list of model chunks
    ev.before_step()
    optimizer.step()
    ev.after_step()        # writes RUN/evidence/optimizer_step1.npz (or its per-rank shards)

One process with a Megatron optimizer that steps on the model's own parameters (FP32Optimizer, or a chained
one of them): ``after_step`` also runs the clipping probe (``runstore.clip_probe``): the step-1 gradients
scaled to a global norm of 10 x the optimizer's ``config.clip_grad`` go through Megatron's own clipping as its
``step`` runs it (``get_grad_norm``, then ``clip_grad_by_total_norm_fp32`` when ``clip_grad > 0``), on copies
swapped into ``param.grad`` and swapped back, and the clipped gradients are written to
``RUN/evidence/clip_probe.npz``. ``device_context`` (a context-manager factory) wraps that call where
Megatron's CUDA literals need redirecting (the CPU demo). A probe that cannot run says why in ``clip_error``
and writes nothing; the step-1 evidence is kept either way.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import numpy as np

_GATED_FC1 = re.compile(r"(^|\.)linear_fc1\.(weight|bias)\d*$")


def _np(t: Any) -> np.ndarray:
    t = t.detach()
    if str(t.dtype) in ("torch.bfloat16", "torch.float16"):
        t = t.float()
    return t.cpu().numpy().copy()


def _world() -> tuple[int, int]:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank()), int(dist.get_world_size())
    except Exception:  # noqa: BLE001 - no process group: one process
        pass
    return 0, 1


def _named(model: Any) -> list[tuple[str, Any]]:
    """(global name, parameter) of every trained parameter, each once (pipeline / expert names global)."""
    from dumpers.megatron import global_namer

    chunks = model if isinstance(model, (list, tuple)) else [model]
    seen: set[int] = set()
    out = []
    for chunk in chunks:
        name_of = global_namer(chunk)
        for name, p in chunk.named_parameters():
            # the last stage's copy of a tied embedding (``shared``) is the first stage's parameter again
            if p.requires_grad and id(p) not in seen and not getattr(p, "shared", False):
                seen.add(id(p))
                out.append((name_of(name), p))
    return out


def _dist_ranges(optimizer: Any) -> dict[int, tuple[int, int]] | None:
    """``id(param) -> (start, end)`` of the flat range this rank's distributed optimizer owns (an empty
    range for a parameter of its buffers it owns none of); None without a distributed optimizer."""
    from dumpers.megatron import _unwrap_optimizer

    opt = _unwrap_optimizer(optimizer)
    out: dict[int, tuple[int, int]] = {}
    found = False
    for sub in getattr(opt, "chained_optimizers", None) or [opt]:
        sub = _unwrap_optimizer(sub)
        if not (hasattr(sub, "model_param_gbuf_map") and hasattr(sub, "gbuf_ranges")):
            continue
        found = True
        for buffer in getattr(sub, "buffers", []):
            for param in getattr(buffer, "params", []):
                out.setdefault(id(param), (0, 0))
        for param, (gbuf, dtype, bucket) in sub.model_param_gbuf_map.items():
            rng = sub.gbuf_ranges[gbuf][dtype][bucket]["param_map"][param]["param"]
            out[id(param)] = (int(rng.start), int(rng.end))
    return out if found else None


def _layout(param: Any, gated: bool, name: str) -> tuple[int, int, int, int, int, int]:
    """(partition dim or -1, tp rank, tp size, gated fc1, data-parallel rank, is expert) of a parameter."""
    try:
        from megatron.core import parallel_state as ps

        ready = ps.model_parallel_is_initialized()
    except ImportError:
        ready = False
    expert = not getattr(param, "allreduce", True)   # Megatron marks expert parameters allreduce=False
    if not ready:
        return -1, 0, 1, 0, _world()[0], int(expert)
    if expert:
        tp_rank, tp = ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
        dp_rank = ps.get_expert_data_parallel_rank()
    else:
        tp_rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        dp_rank = ps.get_data_parallel_rank(with_context_parallel=True)
    dim = int(getattr(param, "partition_dim", 0)) if getattr(param, "tensor_model_parallel", False) else -1
    if tp == 1:
        dim = -1
    fc1 = int(gated and dim == 0 and bool(_GATED_FC1.search(name)))
    return dim, int(tp_rank), int(tp), fc1, int(dp_rank), int(expert)


class OptimizerEvidence:
    """Never raises into the training loop: a failure is kept in ``error`` and nothing is written."""

    def __init__(self, model: Any, run_dir: str | Path, optimizer: Any = None, *,
                 device_context: Callable[[], AbstractContextManager[Any]] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.error: str | None = None
        self.path: Path | None = None
        self.clip_error: str | None = None
        self.clip_path: Path | None = None
        self.optimizer = optimizer
        self.device_context = device_context
        self._init: dict[str, np.ndarray] = {}
        self._grad: dict[str, np.ndarray] = {}
        self._shard: dict[str, np.ndarray] = {}
        self._shape: dict[str, np.ndarray] = {}
        self._ranges: dict[str, tuple[int, int]] = {}
        try:
            self.params = _named(model)
            self.rank, self.world = _world()
            self.ranges = _dist_ranges(optimizer) if optimizer is not None else None
            chunks = model if isinstance(model, (list, tuple)) else [model]
            cfg = next((getattr(c, "config", None) for c in chunks if hasattr(c, "config")), None)
            self.gated = bool(getattr(cfg, "gated_linear_unit", False))
            ddp = next((getattr(c, "ddp_config", None) for c in chunks if hasattr(c, "ddp_config")), None)
            if self.ranges is None and getattr(ddp, "use_distributed_optimizer", False):
                self.error = ("the model uses Megatron's distributed optimizer: pass it "
                              "(OptimizerEvidence(model, run_dir, optimizer)) for the range each rank owns")
        except Exception as exc:  # noqa: BLE001 - evidence must never stop training
            self.params, self.rank, self.world, self.ranges = [], 0, 1, None
            self.error = f"init: {exc}"

    @property
    def sharded(self) -> bool:
        return self.world > 1

    def before_step(self) -> None:
        if self.error:
            return
        try:
            for name, p in self.params:
                g = getattr(p, "main_grad", None)
                g = p.grad if g is None else g
                if not self.sharded:
                    if g is not None:
                        self._init[name] = _np(p)
                        self._grad[name] = _np(g)
                    continue
                dim, tp_rank, tp, fc1, dp_rank, _ = _layout(p, self.gated, name)
                if dim < 0 and tp_rank != 0:
                    continue                       # a TP-duplicated parameter: TP rank 0's copy
                if self.ranges is not None and id(p) in self.ranges:
                    start, end = self.ranges[id(p)]
                elif dp_rank == 0:
                    start, end = 0, p.numel()      # data-parallel replicas: DP rank 0's copy
                else:
                    continue
                if end <= start:
                    continue
                if g is None:
                    raise ValueError(f"{name}: no gradient on rank {self.rank}")
                self._init[name] = _np(p.detach().reshape(-1)[start:end])
                self._grad[name] = _np(g.detach().reshape(-1)[start:end])
                self._ranges[name] = (start, end)
                self._shard[name] = np.array([start, end, dim, tp_rank, tp, fc1], dtype=np.int64)
                self._shape[name] = np.array(tuple(p.shape), dtype=np.int64)
        except Exception as exc:  # noqa: BLE001 - evidence must never stop training
            self.error = f"before_step: {exc}"

    def after_step(self) -> Path | None:
        if self.error or not (self._grad or self.sharded):
            return None
        try:
            from runstore import EVIDENCE_DIR, OPTIMIZER_EVIDENCE, write_step1_file
            from runstore.step1_file import shard_file, write_step1_shard

            if not self.sharded:
                after = {name: _np(p) for name, p in self.params if name in self._grad}
                path = self.run_dir / EVIDENCE_DIR / OPTIMIZER_EVIDENCE
                path.parent.mkdir(parents=True, exist_ok=True)
                write_step1_file(path, self._grad, self._init, after)
                self.clip_path = self._clip_probe()
            else:
                after = {}
                for name, p in self.params:
                    if name in self._ranges:
                        start, end = self._ranges[name]
                        after[name] = _np(p.detach().reshape(-1)[start:end])
                path = shard_file(self.run_dir, self.rank)
                write_step1_shard(path, self._grad, self._init, after, self._shard, self._shape,
                                  rank=self.rank, world=self.world)
            self.path = path
            return path
        except Exception as exc:  # noqa: BLE001
            self.error = f"after_step: {exc}"
            return None

    def _clip_probe(self) -> Path | None:
        """Megatron's clipping on the scaled step-1 gradients (module docstring); never raises."""
        try:
            from runstore import EVIDENCE_DIR
            from runstore.clip_probe import CLIP_PROBE, probe_scale, write_clip_probe

            clipped, info = megatron_clip_probe(self.optimizer, self.params, self._grad,
                                                device_context=self.device_context, probe_scale=probe_scale)
            return write_clip_probe(self.run_dir / EVIDENCE_DIR / CLIP_PROBE, clipped, **info)
        except Exception as exc:  # noqa: BLE001 - evidence must never stop training
            self.clip_error = f"clip probe: {exc}"
            return None


def megatron_clip_probe(optimizer: Any, params: list[tuple[str, Any]], grads: dict[str, np.ndarray], *,
                        device_context: Callable[[], AbstractContextManager[Any]] | None,
                        probe_scale: Callable[[float, float | None], float]) -> tuple[dict[str, np.ndarray],
                                                                                     dict[str, Any]]:
    """(clipped probe gradients by name, the probe's scalars) from a Megatron optimizer's own clipping.

    As ``MegatronOptimizer.step`` / ``ChainedOptimizer.step`` clip: the global norm over every sub-optimizer
    (``get_grad_norm``), then each sub-optimizer whose ``config.clip_grad > 0`` clips its parameters by it.
    The probe gradients are copies put in ``param.grad`` and the originals are put back, whatever happens.
    Raises ValueError where the probe cannot run (not a Megatron optimizer, main-parameter copies)."""
    import contextlib

    import torch

    from dumpers.megatron import _unwrap_optimizer, grad_norm_hook_muted

    opt = _unwrap_optimizer(optimizer)
    subs = [_unwrap_optimizer(s) for s in (getattr(opt, "chained_optimizers", None) or [opt])]
    if not subs or any(not hasattr(s, "get_parameters") or getattr(s, "config", None) is None for s in subs):
        raise ValueError("not a Megatron optimizer (no get_parameters / config.clip_grad)")
    if any(getattr(s.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False) for s in subs):
        raise ValueError("a precision-aware optimizer clips decoupled_grad, not param.grad")
    name_of = {id(p): n for n, p in params}
    groups = [(s, list(s.get_parameters())) for s in subs]
    owned = [p for _, ps in groups for p in ps]
    if not owned:
        raise ValueError("the optimizer holds no parameters")
    unknown = [p for p in owned if id(p) not in name_of or name_of[id(p)] not in grads]
    if unknown:
        raise ValueError(f"{len(unknown)} optimizer parameter(s) are not the model's (main-parameter copies of a "
                         "mixed-precision or distributed optimizer)")
    maxes = {float(s.config.clip_grad) for s in subs}
    max_norm = maxes.pop() if len(maxes) == 1 else max(maxes)
    g64 = {name_of[id(p)]: np.asarray(grads[name_of[id(p)]], dtype=np.float64) for p in owned}
    grad_norm = float(np.sqrt(sum(float(np.sum(g * g)) for g in g64.values())))
    scale = probe_scale(grad_norm, max_norm)
    saved = [(p, p.grad) for p in owned]
    ctx = device_context() if device_context is not None else contextlib.nullcontext()
    applied = False
    try:
        for p in owned:
            probe = torch.from_numpy((g64[name_of[id(p)]] * scale).astype(np.float32)).reshape(p.shape)
            p.grad = probe.to(dtype=p.dtype, device=p.device)
        with torch.no_grad(), ctx, grad_norm_hook_muted():   # the probe's norm is not the step's grad norm
            total = opt.get_grad_norm()
            for sub, ps in groups:
                if ps and float(sub.config.clip_grad) > 0.0:
                    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

                    clip_grad_by_total_norm_fp32(ps, max_norm=float(sub.config.clip_grad), total_norm=total)
                    applied = True
        clipped = {name_of[id(p)]: _np(p.grad) for p in owned}
    finally:
        for p, g in saved:
            p.grad = g
    return clipped, {"scale": scale, "max_norm": max_norm, "applied": applied, "returned_norm": float(total)}
