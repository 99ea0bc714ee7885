"""Candidate side of the optimizer check: one MindSpore optimizer step on the baseline's gradients.

Why: to tell an optimizer difference from a forward/backward one, the candidate's own optimizer (its
parameter groups, weight decay rules, betas, eps, clipping) must step from the baseline's weights with the
baseline's gradients. This module does only that and returns the updated weights as numpy arrays;
``comparators.optimizer_check.compare_updates`` compares them with the baseline's weights after its step.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np


def optimizer_step_with_grads(optimizer: Any, grads: Mapping[str, np.ndarray], *,
                              clip_norm: float | None = None, train_cell: Any = None) -> dict[str, np.ndarray]:
    """Run ``optimizer`` once on ``grads`` (candidate names); return {parameter name: updated weight}.

    Gradients are passed in the optimizer's own parameter order (the order MindSpore expects), cast to each
    parameter's dtype. Clipping: ``train_cell.clip_grad_norm`` when a MindFormers training cell with
    ``use_clip_grad`` is given (its own clipping code), else ``ops.clip_by_global_norm`` when
    ``clip_norm`` is set, else none. A parameter without a gradient is an error, not a zero gradient.
    """
    import mindspore as ms
    from mindspore import Tensor, ops

    params = list(optimizer.parameters)
    missing = [p.name for p in params if p.name not in grads]
    if missing:
        raise KeyError(f"no baseline gradient for {len(missing)} candidate parameter(s): {', '.join(missing[:5])}")
    tensors = []
    for p in params:
        g = np.ascontiguousarray(grads[p.name])
        if tuple(g.shape) != tuple(p.shape):
            raise ValueError(f"{p.name}: gradient shape {g.shape} != parameter shape {tuple(p.shape)}")
        t = Tensor(g.astype(np.float32))
        tensors.append(t if p.dtype == ms.float32 else t.astype(p.dtype))
    grads_t = tuple(tensors)
    if train_cell is not None and getattr(train_cell, "use_clip_grad", False):
        grads_t, _ = train_cell.clip_grad_norm(grads_t)
    elif clip_norm is not None:
        grads_t = ops.clip_by_global_norm(grads_t, float(clip_norm))
    optimizer(grads_t)
    return {p.name: p.asnumpy().copy() for p in params}


def weights(net: Any) -> dict[str, np.ndarray]:
    """Every trainable parameter of ``net`` as numpy (candidate names)."""
    return {p.name: p.asnumpy().copy() for p in net.trainable_params()}


def run_optimizer_check(optimizer: Any, baseline_file: str | Path, out: str | Path, *, mapping: Any = None,
                        num_heads: int | None = None, num_query_groups: int | None = None,
                        train_cell: Any = None, clip_norm: float | None = None) -> Path:
    """The candidate's optimizer-check evidence in one call: read the baseline's step-1 gradients
    (``evidence/optimizer_step1.npz`` of the baseline run, or that file), convert them to candidate names
    through the mapping, step ``optimizer`` once and write ``OUT/evidence/optimizer_step1.npz`` with the
    weights before and after. ``align report --optimizer-check OUT`` reads it."""
    from mapping import Mapping, TransformParams
    from models import load_mapping
    from runstore import EVIDENCE_DIR, OPTIMIZER_EVIDENCE, atomic_file, read_step1_file


    grads_b = read_step1_file(Path(baseline_file))["grad"]   # a run store's file or its merged per-rank shards
    m = mapping if isinstance(mapping, Mapping) else load_mapping(mapping)
    grads_c, _ = m.convert(grads_b, "candidate", TransformParams(num_heads=num_heads,
                                                                 num_query_groups=num_query_groups or num_heads))
    before = {p.name: p.asnumpy().copy() for p in optimizer.parameters}
    after = optimizer_step_with_grads(optimizer, grads_c, train_cell=train_cell, clip_norm=clip_norm)
    path = Path(out) / EVIDENCE_DIR / OPTIMIZER_EVIDENCE
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as fh:
        np.savez(fh, **{f"before/{k}": v for k, v in before.items()}, **{f"after/{k}": v for k, v in after.items()})
    return path
