"""Seed and determinism helper for torch / Megatron runs; what it set goes into the run metadata.

Why: a baseline that is not reproducible cannot anchor a comparison, and a reviewer needs to see which
seeds and flags were in force. The environment variables are the ones the MindFormers accuracy-alignment
guide asks for on the GPU (Megatron) side; CUDA/NCCL read them at initialisation, so call this first.
"""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch

# Read by cuBLAS / NCCL / TransformerEngine when they start: set before the first CUDA call.
DETERMINISTIC_ENV = {
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",      # deterministic cuBLAS reductions
    "NCCL_ALGO": "Ring",                       # fixed all-reduce algorithm (order of summation)
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",   # TransformerEngine: no non-deterministic kernels
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",        # Megatron's requirement for ordered TP/SP overlap
    "HCCL_DETERMINISTIC": "true",              # the Ascend side of the same pairing, harmless on GPU
}


def seed_everything(seed: int = 1234, deterministic: bool = True, set_env: bool = True) -> dict[str, Any]:
    """Seed python, numpy and torch (CPU and CUDA); optionally force deterministic algorithms.

    Returns a JSON-able record for ``meta.json`` (keys ``seed`` and ``determinism``).
    Megatron users should still call ``tensor_parallel.model_parallel_cuda_manual_seed(seed)`` after
    ``initialize_model_parallel``: it derives the per-TP-rank streams from the same seed.
    """
    env_set: dict[str, str] = {}
    if deterministic and set_env:
        for key, value in DETERMINISTIC_ENV.items():
            if key not in os.environ:
                os.environ[key] = value
            env_set[key] = os.environ[key]
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    flags: dict[str, Any] = {}
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        flags = {"use_deterministic_algorithms": True, "cudnn.deterministic": True,
                 "cudnn.benchmark": False}
    return {
        "seed": {"python": seed, "numpy": seed % 2**32, "torch": seed},
        "determinism": {"enabled": bool(deterministic), "flags": flags, "env": env_set,
                        "megatron_args": ["--deterministic-mode"] if deterministic else []},
    }
