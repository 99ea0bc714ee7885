"""The dumper contract both framework dumpers share: what to dump, which steps, the open step, the writer.

Framework-free on purpose: this module imports no torch, MindSpore, MindFormers or Megatron (only the run
store), so the one :class:`DumpConfig` and its step bookkeeping are the same object on both sides of an
alignment, and a config can be built, checked and stored where no framework is installed.
``TorchDumper`` (dumpers/torch_dumper.py) and ``MindSporeDumper`` (dumpers/mindspore_dumper.py) both derive
from :class:`StepBookkeeping` and open their writer with :func:`open_writer`; each keeps its own failure
policy (the torch dumper counts failures and goes on, the MindSpore dumper switches itself off).

The life of a dumper: built once from a :class:`DumpConfig` (rank not in ``ranks``: it does nothing);
per step ``begin_step(n)`` (:meth:`StepBookkeeping._open_step` decides whether step ``n`` gets an array
file and whether its layer tensors are captured), the record calls, ``end_step()`` (the step file gets its
final name; :meth:`StepBookkeeping._close_step`); ``close()`` closes the writer.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dumpers.steps import parse_steps
from runstore import BackgroundWriter, RunWriter

__all__ = ["NAN_MODES", "TENSOR_MODES", "DumpConfig", "NonFiniteError", "StepBookkeeping", "dumps_rank",
           "merge_micro_batches", "open_writer", "parse_steps"]

TENSOR_MODES = ("off", "stats", "full")
NAN_MODES = ("off", "grads", "all")


class NonFiniteError(RuntimeError):
    """Raised by a dumper's ``end_step`` only when ``stop_on_nan`` asked for it, after the trace is written."""


@dataclass
class DumpConfig:
    """What to dump, for either dumper. Scalars (loss, grad norm, batch statistics) are written every step.

    out: run-store directory (shared by all ranks; each rank writes only its own files). ``TorchDumper``
        needs it; ``MindSporeDumper`` takes it as its own argument and falls back to this one.
    steps: steps that get an array file (batch, local norms); ``None`` = every step.
    tensor_steps: steps whose layer tensors are captured; ``None`` = same as ``steps``.
    modules: fnmatch patterns over the hooked names: torch's ``named_modules()``, MindSpore's
        ``cells_and_names()``. ``cells``: the same patterns in MindSpore's word (give one of the two).
    tensors: ``"off"``, ``"stats"`` (max/min/mean/L2/nan/inf) or ``"full"`` (stats plus full tensors).
    backward: also capture the gradients flowing through the selected modules (``backward.grad_*``).
    batch / seed_layout: store batches in the step file / also as ``step_N/rank_R/<name>.npy``.
    local_norms: named L2 norm of every parameter's gradient, where the optimizer sees it.
    nan_trace: ``"off"``, ``"grads"`` (non-finite gradients, from the local norms: free) or ``"all"``
        (also non-finite activations of the selected modules, every step; MindSpore: PYNATIVE only).
    stop_on_nan: raise :class:`NonFiniteError` from ``end_step`` after recording the trace.
    ranks: global ranks that dump; ``None`` = all.
    meta: merged into meta.json (say ``{"config": ...}``).
    background_writes: write step files on a background thread (full tensors are then copied to host
        memory in the hook, written while training computes; ``end_step`` waits for the step file).
        Off: each full tensor is written in its hook (torch: straight from the tensor's memory, no copy).
    routing: MoE routing evidence at the tensor steps (``tensor_steps``; taken even with ``tensors="off"``): each
        router's logits, top-k choices, their probabilities and tokens per expert (runstore.routing; the
        moe_routing stage compares them); at every other array step the tokens per expert only. Torch: a
        forward hook on every Megatron-core TopKRouter; MindSpore: every MindFormers TopKRouter wrapped (GRAPH
        and PYNATIVE) before the first compile.
    capture_env: record the cluster capture (dumpers/environment.py: numerics-relevant environment variables,
        versions, determinism / precision settings, the random generators' state) in meta.json
        ``environment`` when the dumper is built (rank 0; build it once the weights are loaded, right before
        training, or call ``capture_environment()`` then). ``capture_env_data``: dataset files or folders to
        hash with it; ``capture_env_weights``: fingerprint the model's parameters too (compared through the
        mapping by the report's checklist).
    """

    out: str | os.PathLike | None = None
    steps: str | int | Iterable[int] | None = None
    tensor_steps: str | int | Iterable[int] | None = None
    modules: Sequence[str] = ("*",)
    cells: Sequence[str] | None = None
    tensors: str = "off"
    backward: bool = True
    batch: bool = True
    seed_layout: bool = False
    local_norms: bool = True
    nan_trace: str = "grads"
    stop_on_nan: bool = False
    ranks: Iterable[int] | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)
    background_writes: bool = False
    routing: bool = False
    capture_env: bool = False
    capture_env_data: Sequence[str] = ()
    capture_env_weights: bool = True

    def __post_init__(self) -> None:
        if self.tensors not in TENSOR_MODES:
            raise ValueError(f"tensors must be one of {TENSOR_MODES}, not {self.tensors!r}")
        if self.nan_trace not in NAN_MODES:
            raise ValueError(f"nan_trace must be one of {NAN_MODES}, not {self.nan_trace!r}")
        if isinstance(self.modules, str):
            self.modules = (self.modules,)
        if self.cells is not None:
            cells = (self.cells,) if isinstance(self.cells, str) else tuple(self.cells)
            if tuple(self.modules) not in (("*",), cells):
                raise ValueError(f"modules={tuple(self.modules)!r} and cells={cells!r}: give one of the two")
            self.modules = self.cells = cells
        if isinstance(self.capture_env_data, (str, os.PathLike)):
            self.capture_env_data = (self.capture_env_data,)


def dumps_rank(config: DumpConfig, rank: int) -> bool:
    """Whether global rank ``rank`` dumps under ``config.ranks``."""
    return config.ranks is None or rank in set(int(r) for r in config.ranks)


def open_writer(out: str | os.PathLike, *, rank: int, meta: Mapping[str, Any],
                rank_info: Mapping[str, Any], background: bool = False) -> RunWriter | BackgroundWriter:
    """This rank's writer of the run store at ``out`` (rank 0 writes ``meta``), on a background thread when
    ``background`` (``DumpConfig.background_writes``). Closed by the dumper's ``close()``."""
    writer = RunWriter(out, rank=rank, meta=meta, rank_info=rank_info)
    return BackgroundWriter(writer) if background else writer


def merge_micro_batches(pending: Mapping[str, list[np.ndarray]]) -> dict[str, np.ndarray]:
    """A step's micro-batches, recorded one call each, as one array per key (concatenated on dim 0)."""
    return {k: np.concatenate(v, axis=0) if len(v) > 1 else v[0] for k, v in pending.items()}


class StepBookkeeping:
    """Which steps a dumper captures, and the state of the open step; the base of both dumpers.

    The dumper calls :meth:`_select_steps` once its config is set, :meth:`_open_step` from ``begin_step``
    and :meth:`_close_step` when the step is over. The state is plain attributes, read by hooks that run
    hundreds of times a step: ``_step`` (the open step, or None between steps), ``_array_step`` (it gets
    an array file: ``steps``) and ``_tensor_step`` (its layer tensors are captured: ``tensors`` is not
    ``"off"``, an array step, and one of ``tensor_steps``).
    """

    config: DumpConfig
    _step: int | None = None
    _array_step: bool = False
    _tensor_step: bool = False
    _routing_step: bool = False

    def _select_steps(self) -> None:
        """Parse ``config.steps`` / ``config.tensor_steps`` (a bad spec raises ValueError)."""
        self._steps = parse_steps(self.config.steps)
        ts = self.config.tensor_steps
        self._tensor_steps = parse_steps(ts) if ts is not None else self._steps

    def _open_step(self, step: int) -> None:
        """Make ``step`` the open step and decide what it captures."""
        self._step = int(step)
        self._array_step = self._steps is None or self._step in self._steps
        self._tensor_step = self.config.tensors != "off" and self._array_step and (
            self._tensor_steps is None or self._step in self._tensor_steps)
        self._routing_step = self.config.routing and self._array_step and (
            self._tensor_steps is None or self._step in self._tensor_steps)

    def _close_step(self) -> None:
        self._step = None
        self._routing_step = False
