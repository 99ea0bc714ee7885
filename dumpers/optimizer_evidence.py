"""Baseline side of the optimizer check, inside a PyTorch / Megatron training loop: at one step, the
weights before the optimizer step, the gradients it steps on, and the weights after, by parameter name.

Why a file: the candidate's optimizer must step from the same weights with the same gradients (see
comparators.optimizer_check); the baseline writes them once to ``RUN/evidence/optimizer_step1.npz``
(``init/``, ``grad/``, ``weight/``) and the candidate reads them (dumpers.mindspore_optimizer_check).

Use, around the optimizer step of iteration 1 (Megatron: the main_grad of DDP-wrapped parameters is read;
with the distributed optimizer, call it where the full gradients still exist, i.e. before
``optimizer.step()`` reduce-scatters them, and on one rank):

    ev = OptimizerEvidence(model, run_dir)     # model: the module or list of model chunks
    ev.before_step()                           # after backward / finish_grad_sync, before optimizer.step()
    optimizer.step()
    ev.after_step()                            # writes RUN/evidence/optimizer_step1.npz
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def _named(model: Any) -> list[tuple[str, Any]]:
    from dumpers.megatron import strip_module_prefix

    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [(strip_module_prefix(name), p) for chunk in chunks for name, p in chunk.named_parameters()
            if p.requires_grad]


def _np(t: Any) -> np.ndarray:
    t = t.detach()
    if str(t.dtype) in ("torch.bfloat16", "torch.float16"):
        t = t.float()
    return t.cpu().numpy().copy()


class OptimizerEvidence:
    """Never raises into the training loop: a failure is kept in ``error`` and nothing is written."""

    def __init__(self, model: Any, run_dir: str | Path) -> None:
        self.params = _named(model)
        self.run_dir = Path(run_dir)
        self.error: str | None = None
        self._init: dict[str, np.ndarray] = {}
        self._grad: dict[str, np.ndarray] = {}

    def before_step(self) -> None:
        try:
            for name, p in self.params:
                g = getattr(p, "main_grad", None)
                g = p.grad if g is None else g
                if g is None:
                    continue
                self._init[name] = _np(p)
                self._grad[name] = _np(g)
        except Exception as exc:  # noqa: BLE001 - evidence must never stop training
            self.error = f"before_step: {exc}"

    def after_step(self) -> Path | None:
        if self.error or not self._grad:
            return None
        try:
            from runstore import EVIDENCE_DIR, OPTIMIZER_EVIDENCE, write_step1_file

            after = {name: _np(p) for name, p in self.params if name in self._grad}
            path = self.run_dir / EVIDENCE_DIR / OPTIMIZER_EVIDENCE
            path.parent.mkdir(parents=True, exist_ok=True)
            write_step1_file(path, self._grad, self._init, after)
            return path
        except Exception as exc:  # noqa: BLE001
            self.error = f"after_step: {exc}"
            return None
