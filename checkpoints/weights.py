"""Any checkpoint a user has, as lazily read weights: ``open_weights(path)`` -> an object with ``names()``,
``shape(name)``, ``dtype(name)`` (the stored dtype: "bfloat16", "float32", ...), ``get(name)`` (one
parameter as numpy, bfloat16 as exact float32), ``close()``, a ``kind`` and ``sequential`` (True when
reading in ``names()`` order is much cheaper than any other order: torch_dist stores all layers of a
parameter in one record).

Why lazily: a checkpoint of a large model does not fit in memory twice; the comparison reads one parameter
(or one fused group) of each side at a time. Formats, detected from the path:

* a folder: Megatron ``torch_dist`` (``.metadata``; also the save root with latest_checkpointed_iteration.txt),
  Megatron legacy ``torch`` (``[iter_N/]mp_rank_*/model_optim_rng.pt``), or a folder of ``.safetensors``
  files (MindFormers' unified safetensors);
* ``.safetensors`` (MindFormers 2.x), ``.ckpt`` (MindSpore, MindFormers' legacy models),
  ``.pt`` / ``.pth`` (a torch state_dict, e.g. what ``align convert-weights --to megatron`` writes).

Nothing is unpickled beyond torch's ``weights_only`` loader and the torch_dist metadata allow-list.
``read_weights(path)`` reads a whole file at once (name -> numpy), for the cluster capture's fingerprints.
"""

from __future__ import annotations

import warnings
import zipfile
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from core.errors import BadInput
from runstore.schema import regular_file


class Weights(Protocol):
    """What the weights comparison reads (comparators.weights)."""

    path: Path
    kind: str
    sequential: bool

    def names(self) -> list[str]: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def dtype(self, name: str) -> str: ...
    def get(self, name: str) -> np.ndarray: ...
    def close(self) -> None: ...


class TorchFileWeights:
    """A torch state_dict file (``{name: tensor}`` or ``{"model": {...}}``), loaded with
    ``weights_only=True`` and memory-mapped: a tensor's bytes are read when it is asked for."""

    sequential = False
    kind = "torch state_dict"

    def __init__(self, path: str | Path) -> None:
        import torch

        from checkpoints.megatron import check_zip_crc

        self.path = regular_file(path, "torch checkpoint")   # a FIFO would block is_zipfile, a device never ends
        if not zipfile.is_zipfile(self.path):
            raise BadInput(f"{self.path}: not a torch checkpoint (torch.save writes a zip archive; this is "
                           "not one: an old-format or pickled file is not loaded)")
        check_zip_crc(self.path, self.path)
        try:
            with warnings.catch_warnings():   # a warning torch prints for a bad file would precede the one line
                warnings.simplefilter("ignore")
                obj = torch.load(str(self.path), map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # noqa: BLE001 - torch raises many kinds for a bad file
            raise BadInput(f"{self.path}: not loadable with weights_only=True ({type(exc).__name__}: "
                           f"{' '.join(str(exc).split())[:160]})") from None
        if isinstance(obj, dict) and isinstance(obj.get("model"), dict):
            obj = obj["model"]
        if not isinstance(obj, dict):
            raise BadInput(f"{self.path}: expected a state_dict (name -> tensor), got {type(obj).__name__}")
        self._t = {str(k): v for k, v in obj.items() if isinstance(v, torch.Tensor)
                   and not str(k).endswith("_extra_state")}

    def names(self) -> list[str]:
        return list(self._t)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._t[name].shape)

    def dtype(self, name: str) -> str:
        return str(self._t[name].dtype).replace("torch.", "")

    def get(self, name: str) -> np.ndarray:
        import torch

        t = self._t[name].detach()
        return (t.float() if t.dtype == torch.bfloat16 else t).contiguous().numpy()

    def close(self) -> None:
        self._t = {}


def open_weights(path: str | Path) -> Any:
    """The weights at ``path`` (see the module docstring for the formats); BadInput naming the path when it
    is missing or none of them."""
    p = Path(path)
    if not p.exists():
        raise BadInput(f"{p}: no such file or folder")
    if p.is_dir():
        from checkpoints.megatron import (
            LegacyWeights,
            TorchDistWeights,
            _latest_iteration_dir,
            find_legacy_root,
            is_torch_dist,
        )

        if is_torch_dist(p):
            return TorchDistWeights(p)
        it = _latest_iteration_dir(p)
        if it is not None and is_torch_dist(it):
            return TorchDistWeights(it)
        if find_legacy_root(p) is not None:
            return LegacyWeights(p)
        if any(p.glob("*.safetensors")):
            from checkpoints.mindformers import SafetensorsWeights

            return SafetensorsWeights(p)
        raise BadInput(f"{p}: not a checkpoint folder (no torch_dist .metadata, no mp_rank_*/model_optim_rng.pt, "
                       "no .safetensors files)")
    regular_file(p, "weights file")    # before any reader opens it: a FIFO blocks, a device never ends
    suffix = p.suffix.lower()
    if suffix == ".safetensors":
        from checkpoints.mindformers import SafetensorsWeights

        return SafetensorsWeights(p)
    if suffix == ".ckpt":
        from checkpoints.mindspore_ckpt import MindSporeCkpt

        return MindSporeCkpt(p)
    if suffix in (".pt", ".pth"):
        return TorchFileWeights(p)
    raise BadInput(f"{p}: unknown weights file (expected .safetensors, .ckpt, .pt/.pth, or a checkpoint folder)")


def read_weights(path: str | Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(name -> array, bfloat16 as exact float32; name -> stored dtype) of a weights file or folder."""
    from checkpoints.convert import megatron_to_numpy, mindformers_to_numpy, optimizer_key

    p = Path(path)
    if not p.exists():
        raise BadInput(f"{p}: no such weights file or checkpoint folder")
    if p.is_dir():
        from checkpoints.megatron import read_megatron_checkpoint

        arrays, dtypes = read_megatron_checkpoint(p)
    elif regular_file(p, "weights file") and p.suffix == ".safetensors":
        from checkpoints.mindformers import read_safetensors

        arrays, dtypes = read_safetensors(p)
    elif p.suffix == ".ckpt":
        arrays, dtype = mindformers_to_numpy(p)
        dtypes = {k: dtype for k in arrays}
    else:
        loaded, dtypes = megatron_to_numpy([p])
        arrays = loaded     # one file: one state_dict
    weights = {k: v for k, v in arrays.items() if not optimizer_key(k)}
    if not weights:
        raise BadInput(f"{p}: holds no weights")
    return weights, {k: dtypes.get(k, str(v.dtype)) for k, v in weights.items()}
