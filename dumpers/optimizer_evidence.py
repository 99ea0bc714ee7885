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
"""

from __future__ import annotations

import re
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

    def __init__(self, model: Any, run_dir: str | Path, optimizer: Any = None) -> None:
        self.run_dir = Path(run_dir)
        self.error: str | None = None
        self.path: Path | None = None
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
