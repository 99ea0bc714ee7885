"""The run store's layout: folder and file names every writer and reader of a run directory agrees on.

Layout of a run directory::

    RUN/meta.json                          run-level metadata (framework, versions, config, parallel, ...)
    RUN/ranks/rank_00000.json              per-rank facts (tp/pp/dp coordinates, host, pid)
    RUN/scalars/rank_00000.jsonl           one JSON object per line: {"step": N, "loss": ..., ...}
    RUN/steps/step_00000001/rank_00000.h5  arrays of one step on one rank (batch, local norms, tensors)
    RUN/step_1/rank_0/tokens.npy           optional seed layout that MindFormers replays
    RUN/evidence/optimizer_step1.npz       files a stage reads as a whole (not per step)
    RUN/evidence/optimizer_step1/rank_00000.npz   ... or its per-rank shards (a distributed run)
    RUN/evidence/isolation.npz             the candidate's modules run on the baseline's captured inputs

Why these choices: a JSON line appended and flushed per step costs microseconds and survives a kill
(at most the last line is torn, and the reader says so); one HDF5 file per step and rank means ranks
never share a file; every file appears under its final name only once complete (temporary name, then
``os.replace``, see ``atomic``), so a run killed mid-step leaves every completed step readable and a ``.tmp``
file that names the incomplete one. Nothing is pickled: HDF5, JSON and ``.npy`` read with ``allow_pickle=False``.
"""

from __future__ import annotations

import re
from pathlib import Path

SCHEMA = "xf-align-run/1"
META = "meta.json"
# Files a stage reads as a whole (not per step): evidence/optimizer_step1.npz, evidence/conversion.json
EVIDENCE_DIR = "evidence"
OPTIMIZER_EVIDENCE = "optimizer_step1.npz"
OPTIMIZER_EVIDENCE_SHARDS = "optimizer_step1"     # evidence/optimizer_step1/rank_R.npz: one per rank
CONVERSION_EVIDENCE = "conversion.json"
ISOLATION_EVIDENCE = "isolation.npz"     # single-module isolation: the candidate's modules on the baseline's inputs
STEP_DIR = "steps"
SCALAR_DIR = "scalars"
RANK_DIR = "ranks"
SEED_BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask")

_STEP_RE = re.compile(r"^step_(\d+)$")
_RANK_H5_RE = re.compile(r"^rank_(\d+)\.h5$")
_RANK_TMP_RE = re.compile(r"^rank_(\d+)\.h5\.tmp")
_SEED_RANK_RE = re.compile(r"^rank_(\d+)$")
_SCALAR_RANK_RE = re.compile(r"^rank_(\d{1,9})\.jsonl$")


def evidence_step_file(store: str | Path, folder: str, step: int, rank: int = 0) -> Path:
    """A per-step evidence file (``evidence/FOLDER/step_S_rank_R.npz``: module backward captures, operator
    traces)."""
    return Path(store) / EVIDENCE_DIR / folder / f"step_{int(step):06d}_rank_{int(rank):05d}.npz"


def evidence_steps(store: str | Path, folder: str, rank: int = 0) -> list[int]:
    """Steps with a per-step evidence file of ``rank`` in ``evidence/FOLDER``, ascending."""
    d = Path(store) / EVIDENCE_DIR / folder
    out = []
    for p in d.glob(f"step_*_rank_{int(rank):05d}.npz") if d.is_dir() else []:
        try:
            out.append(int(p.name.split("_")[1]))
        except (IndexError, ValueError):
            continue
    return sorted(out)


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / STEP_DIR / f"step_{step:08d}"
