"""TensorBoard event directories (Megatron's --tensorboard-dir, MindFormers' tensorboard_dir) -> Run.

Megatron's and MindFormers' tags are mapped to the run store's scalar keys; ``... vs samples`` / ``vs tokens``
copies of the same curves are left out. The two losses are kept apart: Megatron's ``lm loss`` and
MindFormers' ``lm-loss`` are the language-model loss (key ``loss``, the one runs are compared on), while
MindFormers' ``loss`` tag is lm + load-balancing + MTP loss; next to an ``lm-loss`` tag it becomes
``total_loss`` (alone, a dense model's ``loss`` equals its lm loss and stays ``loss``, with a note).
MindFormers' TrainingStateMonitor writes named local norms as ``local_norm/<parameter>`` tags; they become
the run's per-step local-norm tables. Reading uses TensorBoard's own event reader (the optional ``tensorboard``
extra): the log-only path keeps needing nothing more than numpy, pandas, matplotlib and h5py.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd

from core.errors import BadInput
from runstore.run import Run, make_series
from sources import Source

LM_LOSS_TAGS = ("lm loss", "lm-loss")
TAGS = {
    "lm loss": "loss",
    "lm-loss": "loss",
    "loss": "loss",
    "mtp-loss": "mtp_loss",
    "load-balancing-loss": "load_balancing_loss",
    "train/loss": "loss",
    "grad-norm": "grad_norm",
    "grad_norm": "grad_norm",
    "learning-rate": "lr",
    "learning_rate": "lr",
    "loss-scale": "loss_scale",
    "num-zeros": "num_zeros",
    "batch-size": "global_batch_size",
    "params-norm": "params_norm",
    "iteration-time": "elapsed_s",
    "lm loss validation": "val_loss",
    "lm loss validation ppl": "val_ppl",
}


def event_files(path: Path) -> list[Path]:
    return sorted(p for p in Path(path).rglob("events.out.tfevents.*") if p.is_file())


def scalar_key(tag: str) -> str:
    """The run-store key of a Megatron / MindFormers TensorBoard tag (``lm loss`` -> ``loss``)."""
    return TAGS.get(tag, re.sub(r"[^0-9a-zA-Z]+", "_", tag).strip("_").lower())


def read_tensorboard(path: str | Path) -> Run:
    path = Path(path)
    files = event_files(path)
    if not files:
        raise BadInput(f"{path}: no TensorBoard event files (events.out.tfevents.*)")
    try:
        from tensorboard.backend.event_processing.event_accumulator import (  # noqa: PLC0415
            SCALARS,
            EventAccumulator,
        )
    except ImportError:
        raise BadInput(f"{path}: reading TensorBoard files needs the 'tensorboard' package "
                       "(pip install 'xf-align[tensorboard]')") from None
    series: dict = {}
    notes: list[str] = []
    norms: dict[int, dict[str, float]] = {}
    scalars: list[tuple[str, list]] = []
    for f in files:
        acc = EventAccumulator(str(f), size_guidance={SCALARS: 0})
        try:
            acc.Reload()
        except Exception as exc:  # the reader raises several types for a corrupt record
            raise BadInput(f"{f}: corrupt TensorBoard event file ({exc.__class__.__name__})") from None
        for tag in acc.Tags().get("scalars", []):
            if " vs " in tag:
                continue
            if tag.startswith("local_norm/"):
                for e in acc.Scalars(tag):
                    norms.setdefault(int(e.step), {})[tag.split("/", 1)[1]] = float(e.value)
                continue
            scalars.append((tag, acc.Scalars(tag)))
    tags = {t for t, _ in scalars}
    has_lm = any(t in tags for t in LM_LOSS_TAGS)
    if "loss" in tags and not has_lm:
        notes.append("TensorBoard 'loss' read as the lm loss (no 'lm loss' / 'lm-loss' tag); with MoE or MTP "
                     "MindFormers' 'loss' also holds the aux losses")
    for tag, events in scalars:
        key = "total_loss" if tag == "loss" and has_lm else scalar_key(tag)
        s = make_series([e.step for e in events], [e.value for e in events], key)
        series[key] = s if key not in series else s.combine_first(series[key])
    local_norms = {step: pd.DataFrame({"name": list(d), "norm": np.fromiter(d.values(), np.float64, len(d)),
                                       "numel": np.full(len(d), -1, np.int64)})
                   for step, d in sorted(norms.items())}
    if not series and not local_norms:
        names = ", ".join(f.name for f in files[:3])
        raise BadInput(f"{path}: no readable scalars in {names} (corrupt or empty event files?)")
    if len(files) > 1:
        notes.append(f"{len(files)} event files merged (a later file wins on repeated steps)")
    meta = {"framework": "tensorboard", "source": {"kind": "tensorboard", "path": str(path)}}
    if "total_loss" in series:
        meta["loss_key"] = "lm_loss"
        notes.append("loss = MindFormers' lm-loss tag (comparable with Megatron's 'lm loss'); its 'loss' tag "
                     "(lm + aux + MTP) is total_loss")
    return Run(str(path), "tensorboard", meta, series, local_norms, notes)


def _is_tensorboard(path: Path, head: bytes | None) -> bool:
    return head is None and any(path.rglob("events.out.tfevents.*"))


SOURCE = Source("tensorboard", 50, _is_tensorboard, read_tensorboard,
                "a TensorBoard log dir (events.out.tfevents.*)")
