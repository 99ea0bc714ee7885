"""Minimal forward/backward hook dumper for a torch module, writing the run store's ``tensor_stats`` table
and ``tensors/<order>`` datasets. Test-only: the project's dumpers/ own the real one; this keeps the layer
tensor tests independent of it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from runstore import RunWriter


def _first_tensor(x: Any) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)):
        for y in x:
            t = _first_tensor(y)
            if t is not None:
                return t
    return None


class LayerDump:
    """Records every named module's first forward output and the gradient of it, in execution order."""

    def __init__(self, model: torch.nn.Module, full: bool = True) -> None:
        self.rows: list[dict[str, Any]] = []
        self.arrays: list[np.ndarray] = []
        self.full = full
        self.handles = []
        for name, mod in model.named_modules():
            if name:
                self.handles.append(mod.register_forward_hook(self._fwd(name)))

    def _record(self, module: str, kind: str, t: torch.Tensor) -> None:
        a = t.detach().float().cpu().numpy()
        self.rows.append({"order": len(self.rows), "module": module, "kind": kind,
                          "dtype": str(t.dtype).replace("torch.", ""), "shape": "x".join(map(str, a.shape)),
                          "numel": a.size, "max": float(a.max()), "min": float(a.min()),
                          "mean": float(a.mean(dtype=np.float64)), "norm": float(np.linalg.norm(a.ravel())),
                          "nan": int(np.isnan(a).sum()), "inf": int(np.isinf(a).sum())})
        self.arrays.append(a)

    def _fwd(self, name: str):
        def hook(mod, inp, out):  # noqa: ANN001
            t = _first_tensor(out)
            if t is None or not t.is_floating_point():
                return
            self._record(name, "forward.output.0", t)
            if t.requires_grad:
                t.register_hook(lambda g: self._record(name, "backward.grad_output.0", g))
        return hook

    def write(self, root: Path, step: int = 1, meta: dict | None = None) -> None:
        for h in self.handles:
            h.remove()
        with RunWriter(root, rank=0, meta=meta or {"framework": "megatron-core"}) as w:
            cols = {k: [r[k] for r in self.rows] for k in self.rows[0]}
            w.put_table(step, "tensor_stats", {k: np.array(v) for k, v in cols.items()})
            if self.full:
                for r, a in zip(self.rows, self.arrays, strict=True):
                    w.put_array(step, f"tensors/{r['order']:06d}", a,
                                attrs={"module": r["module"], "kind": r["kind"], "dtype": r["dtype"]})
