"""TensorBoard event directories (Megatron's --tensorboard-dir, MindFormers' tensorboard config) -> Run.

MindFormers writes ``loss`` (lm + aux + MTP) and, for MoE/MTP models, ``lm-loss``: then ``loss`` is the LM
loss (what Megatron's ``lm loss`` is) and the total goes to ``total_loss``, with a note. TrainingStateMonitor's
``local_norm/<param name>`` tags become named local-norm tables per step.

Megatron's tags are mapped to the run store's scalar keys; ``... vs samples`` / ``vs tokens`` copies of
the same curves are left out. Reading uses TensorBoard's own event reader (the optional ``tensorboard``
extra): the log-only path keeps needing nothing more than numpy, pandas, matplotlib and h5py.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd

from align.core.errors import BadInput
from align.core.run import Run, make_series

TAGS = {
    "lm loss": "loss",
    "lm-loss": "loss",
    "loss": "loss",
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


def _key(tag: str) -> str:
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
    series = {}
    notes = []
    norms: dict[int, dict[str, float]] = {}
    for f in files:
        acc = EventAccumulator(str(f), size_guidance={SCALARS: 0})
        try:
            acc.Reload()
        except Exception as exc:  # the reader raises several types for a corrupt record
            raise BadInput(f"{f}: corrupt TensorBoard event file ({exc.__class__.__name__})") from None
        for tag in acc.Tags().get("scalars", []):
            if " vs " in tag:
                continue
            events = acc.Scalars(tag)
            if tag.startswith("local_norm/"):
                for e in events:
                    norms.setdefault(int(e.step), {})[tag[len("local_norm/"):]] = float(e.value)
                continue
            if tag == "loss" and "lm-loss" in acc.Tags().get("scalars", []):
                key = "total_loss"
                s = make_series([e.step for e in events], [e.value for e in events], key)
                series[key] = s if key not in series else s.combine_first(series[key])
                continue
            key = _key(tag)
            s = make_series([e.step for e in events], [e.value for e in events], key)
            series[key] = s if key not in series else s.combine_first(series[key])
    if not series and not norms:
        names = ", ".join(f.name for f in files[:3])
        raise BadInput(f"{path}: no readable scalars in {names} (corrupt or empty event files?)")
    if len(files) > 1:
        notes.append(f"{len(files)} event files merged (a later file wins on repeated steps)")
    meta = {"framework": "tensorboard", "source": {"kind": "tensorboard", "path": str(path)}}
    if "total_loss" in series:
        meta["loss_key"] = "lm_loss"
        notes.append("loss = MindFormers' lm-loss tag (comparable with Megatron's 'lm loss'); its 'loss' tag "
                     "(lm + aux + MTP) is total_loss")
    local = {step: pd.DataFrame({"name": list(d), "norm": np.array(list(d.values()), dtype=np.float64),
                                 "numel": np.full(len(d), -1, np.int64)}) for step, d in sorted(norms.items())}
    return Run(str(path), "tensorboard", meta, series, local, notes)
