"""Seed and determinism helper for MindSpore / MindFormers runs; what it set goes into the run metadata.

Why: the candidate run must be reproducible before it is compared, and a reviewer needs to see which seeds
and flags were in force. On Ascend, HCCL and the runtime read their environment variables when they start,
so call this before the first collective or kernel launch. On CPU the variables are recorded (harmless)
so a user moving to an NPU sees what to carry over.
"""

from __future__ import annotations

import os
import random
from typing import Any

import mindspore as ms
import numpy as np

# Read by HCCL / the Ascend runtime when they initialise.
DETERMINISTIC_ENV = {
    "HCCL_DETERMINISTIC": "true",       # deterministic reduction order in HCCL collectives
    "ASCEND_LAUNCH_BLOCKING": "1",      # synchronous kernel launch: errors and NaNs point at their op
}


def seed_everything(seed: int = 1234, deterministic: bool = True, set_env: bool = True) -> dict[str, Any]:
    """Seed python, numpy and MindSpore (global and dataset seeds); optionally deterministic kernels.

    Returns a JSON-able record for ``meta.json`` (keys ``seed`` and ``determinism``), the same shape the
    torch helper returns, so both runs' settings line up in the report.
    """
    env_set: dict[str, str] = {}
    if deterministic and set_env:
        for key, value in DETERMINISTIC_ENV.items():
            os.environ.setdefault(key, value)
            env_set[key] = os.environ[key]
    random.seed(seed)
    np.random.seed(seed % 2**32)
    ms.set_seed(seed)
    ms.dataset.config.set_seed(seed % 2**32)
    flags: dict[str, Any] = {}
    if deterministic:
        try:
            ms.set_context(deterministic="ON")
            flags["context.deterministic"] = "ON"
        except (ValueError, TypeError, RuntimeError) as exc:  # an older MindSpore without the switch
            flags["context.deterministic"] = f"unavailable: {exc}"
    return {
        "seed": {"python": seed, "numpy": seed % 2**32, "mindspore": seed, "dataset": seed % 2**32},
        "determinism": {"enabled": bool(deterministic), "flags": flags, "env": env_set,
                        "mindformers_yaml": {"context": {"deterministic": "ON"}, "seed": seed}
                        if deterministic else {}},
    }


def record(writer: Any, info: dict[str, Any]) -> None:
    """Merge the record into the run's meta.json (``writer`` is a dumper's ``writer``: a runstore.RunWriter or
    BackgroundWriter, None on a rank that does not dump; rank 0 only, as every rank seeds alike and meta.json
    belongs to rank 0)."""
    if writer is None or getattr(writer, "rank", 0) != 0:
        return
    writer.update_meta({"seed": info["seed"], "determinism": info["determinism"]})
