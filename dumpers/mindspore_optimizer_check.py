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


def _params_with_grads(optimizer: Any, grads: Mapping[str, np.ndarray]) -> list[Any]:
    """The optimizer's parameters in its own order; each must have a baseline gradient (a missing one is an
    error, never a zero gradient)."""
    params = list(optimizer.parameters)
    missing = [p.name for p in params if p.name not in grads]
    if missing:
        raise KeyError(f"no baseline gradient for {len(missing)} candidate parameter(s): {', '.join(missing[:5])}")
    return params


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

    params = _params_with_grads(optimizer, grads)
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


def clip_probe_with_grads(optimizer: Any, grads: Mapping[str, np.ndarray], scale: float, *,
                          clip_norm: float | None = None, train_cell: Any = None
                          ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The candidate's clipping on ``scale`` x ``grads`` (candidate names), before any update: (clipped
    gradients by name, the probe's scalars for ``runstore.clip_probe``).

    The same rule as :func:`optimizer_step_with_grads` and as MindFormers' ``MFTrainOneStepCell.construct``:
    the cell's own ``clip_grad_norm`` when its ``use_clip_grad`` is on, no clipping when it is off (whatever
    the YAML said), else ``ops.clip_by_global_norm`` at ``clip_norm``, else none (max norm unknown)."""
    import mindspore as ms
    from mindspore import Tensor, ops

    params = _params_with_grads(optimizer, grads)
    tensors = []
    for p in params:
        g = np.asarray(grads[p.name], dtype=np.float64) * float(scale)
        t = Tensor(g.astype(np.float32).reshape(tuple(p.shape)))
        tensors.append(t if p.dtype == ms.float32 else t.astype(p.dtype))
    probe = tuple(tensors)
    returned: float | None = None
    if train_cell is not None:
        applied = bool(getattr(train_cell, "use_clip_grad", False))
        max_norm: float | None = 0.0
        if applied:
            clipped, norm = train_cell.clip_grad_norm(probe)
            returned = float(np.asarray(norm.asnumpy()).reshape(-1)[0])
            cn = getattr(train_cell.clip_grad_norm, "clip_norm", None)
            max_norm = float(np.asarray(cn.asnumpy()).reshape(-1)[0]) if cn is not None else None
        else:
            clipped = probe
    elif clip_norm is not None:
        applied, max_norm = True, float(clip_norm)
        clipped = ops.clip_by_global_norm(probe, float(clip_norm))
    else:
        applied, max_norm, clipped = False, None, probe
    out = {p.name: np.asarray(t.astype(ms.float32).asnumpy()).copy() for p, t in zip(params, clipped, strict=True)}
    return out, {"scale": float(scale), "max_norm": max_norm, "applied": applied, "returned_norm": returned}


def baseline_probe_scale(baseline_file: str | Path) -> float | None:
    """The scale the baseline's clipping probe used (``evidence/clip_probe.npz`` next to its step-1 evidence),
    so both sides clip the very same gradient; None when the baseline wrote no probe."""
    from runstore import EVIDENCE_DIR
    from runstore.clip_probe import CLIP_PROBE, read_clip_probe

    p = Path(baseline_file)
    for cand in (p / EVIDENCE_DIR / CLIP_PROBE, p / CLIP_PROBE, p.parent / CLIP_PROBE):
        if cand.is_file():
            probe = read_clip_probe(cand)
            return probe[1]["scale"] if probe is not None else None
    return None


def weights(net: Any) -> dict[str, np.ndarray]:
    """Every trainable parameter of ``net`` as numpy (candidate names)."""
    return {p.name: p.asnumpy().copy() for p in net.trainable_params()}


def run_optimizer_check(optimizer: Any, baseline_file: str | Path, out: str | Path, *, mapping: Any = None,
                        num_heads: int | None = None, num_query_groups: int | None = None,
                        train_cell: Any = None, clip_norm: float | None = None) -> Path:
    """The candidate's optimizer-check evidence in one call: read the baseline's step-1 gradients
    (``evidence/optimizer_step1.npz`` of the baseline run, or that file), convert them to candidate names
    through the mapping, step ``optimizer`` once and write ``OUT/evidence/optimizer_step1.npz`` with the
    weights before and after, and the clipping probe (``runstore.clip_probe``): the same gradients scaled as
    the baseline's probe scaled them (or, without one, to 10 x this side's max norm) through this side's
    clipping, before the update. ``align report --optimizer-check OUT`` reads it."""
    from mapping import Mapping, TransformParams
    from models import load_mapping
    from runstore import EVIDENCE_DIR, OPTIMIZER_EVIDENCE, atomic_file, read_step1_file
    from runstore.clip_probe import probe_arrays, probe_scale

    grads_b = read_step1_file(Path(baseline_file))["grad"]   # a run store's file or its merged per-rank shards
    m = mapping if isinstance(mapping, Mapping) else load_mapping(mapping)
    grads_c, _ = m.convert(grads_b, "candidate", TransformParams(num_heads=num_heads,
                                                                 num_query_groups=num_query_groups or num_heads))
    scale = baseline_probe_scale(baseline_file)
    if scale is None:
        own = clip_norm
        if train_cell is not None and getattr(train_cell, "use_clip_grad", False):
            cn = getattr(getattr(train_cell, "clip_grad_norm", None), "clip_norm", None)
            own = float(np.asarray(cn.asnumpy()).reshape(-1)[0]) if cn is not None else None
        norm = float(np.sqrt(sum(float(np.sum(np.square(g, dtype=np.float64))) for g in grads_b.values())))
        scale = probe_scale(norm, own)
    clipped, info = clip_probe_with_grads(optimizer, grads_c, scale, clip_norm=clip_norm, train_cell=train_cell)
    before = {p.name: p.asnumpy().copy() for p in optimizer.parameters}
    after = optimizer_step_with_grads(optimizer, grads_c, train_cell=train_cell, clip_norm=clip_norm)
    path = Path(out) / EVIDENCE_DIR / OPTIMIZER_EVIDENCE
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as fh:
        np.savez(fh, **{f"before/{k}": v for k, v in before.items()}, **{f"after/{k}": v for k, v in after.items()},
                 **probe_arrays(clipped, **info))
    return path
