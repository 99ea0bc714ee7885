"""Any weights file a user has, read as name -> numpy with this package's readers (one entry point).

Why: the cluster capture (``align capture-env --weights``) fingerprints the weights each side loads, whatever
they are stored in: a Megatron checkpoint folder (torch_dist or legacy, merged over TP / PP / EP), a torch
state_dict file, MindFormers 2.x safetensors or a MindSpore .ckpt. Optimizer state kept in the same file
(Adam moments, step counters) is not a weight and is left out.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from core.errors import BadInput


def read_weights(path: str | Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(name -> array, bfloat16 as exact float32; name -> stored dtype) of a weights file or folder."""
    from checkpoints.convert import _optimizer_key, megatron_to_numpy, mindformers_to_numpy

    p = Path(path)
    if not p.exists():
        raise BadInput(f"{p}: no such weights file or checkpoint folder")
    if p.is_dir():
        from checkpoints.megatron import read_megatron_checkpoint

        arrays, dtypes = read_megatron_checkpoint(p)
    elif p.suffix == ".safetensors":
        from checkpoints.mindformers import read_safetensors

        arrays, dtypes = read_safetensors(p)
    elif p.suffix == ".ckpt":
        arrays, dtype = mindformers_to_numpy(p)
        dtypes = {k: dtype for k in arrays}
    else:
        loaded, dtypes = megatron_to_numpy([p])
        arrays = loaded     # one file: one state_dict
    weights = {k: v for k, v in arrays.items() if not _optimizer_key(k)}
    if not weights:
        raise BadInput(f"{p}: holds no weights")
    return weights, {k: dtypes.get(k, str(v.dtype)) for k, v in weights.items()}
