"""`align convert-weights`: Megatron-core state_dict <-> MindFormers weights: safetensors with mcore names
(MindFormers 2.x, .safetensors out/in) or a MindSpore checkpoint for the legacy Llama (.ckpt).

Why through the mapping: the same YAML rules that pair names for comparison also move the tensors (fused
QKV split by query group, gated fc1 chunked per TP shard), so conversion and comparison can never disagree.
Transforms only slice and concatenate, so the round trip is bit-identical. bfloat16 travels as float32
(exact both ways) because numpy has no bfloat16. torch / mindspore are imported inside the functions that
need them: align/ stays importable with numpy alone.
"""

from __future__ import annotations

from collections.abc import Mapping as MappingABC
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from core.errors import BadInput
from core.findings import StageResult
from mapping import Mapping, TransformParams
from models import load_mapping, preset_for_weights


def _torch_state(path: str | Path) -> dict[str, Any]:
    import torch

    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises many kinds for a bad file
        raise BadInput(f"{path}: not a loadable torch checkpoint with weights_only=True "
                       f"({exc.__class__.__name__})") from None
    if isinstance(obj, dict) and "model" in obj and isinstance(obj["model"], dict):
        obj = obj["model"]
    if not isinstance(obj, dict):
        raise BadInput(f"{path}: expected a state_dict (name -> tensor)")
    return obj


def merge_tp_shards(shards: Sequence[MappingABC[str, np.ndarray]], mapping: Mapping) -> dict[str, np.ndarray]:
    """Concatenate TP shards on each rule's partition dim; duplicated (dim -1) tensors are taken once."""
    if len(shards) == 1:
        return dict(shards[0])
    out = {}
    for name in shards[0]:
        m = mapping.match(name, "baseline")
        dim = m.rule.tp_partition_dim if m else -1
        parts = [s[name] for s in shards]
        out[name] = np.concatenate(parts, axis=dim) if dim >= 0 else parts[0]
    return out


def megatron_to_numpy(paths: Sequence[str | Path]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Load Megatron state_dict files (one, or one per TP rank in rank order) as float32/int numpy.

    One folder instead: a Megatron checkpoint as saved (torch_dist, or legacy mp_rank_* files), merged over
    TP / PP / EP into one TP=1 state_dict by checkpoints.megatron.
    """
    if len(paths) == 1 and Path(paths[0]).is_dir():
        from checkpoints.megatron import read_megatron_checkpoint

        return read_megatron_checkpoint(paths[0])
    import torch

    shards, dtypes = [], {}
    for p in paths:
        sd = _torch_state(p)
        arrays = {}
        for k, v in sd.items():
            if not isinstance(v, torch.Tensor):
                continue           # _extra_state and other non-tensor entries
            dtypes[k] = str(v.dtype).replace("torch.", "")
            arrays[k] = (v.float() if v.dtype == torch.bfloat16 else v).detach().cpu().numpy()
        shards.append(arrays)
    return shards[0] if len(shards) == 1 else shards, dtypes   # type: ignore[return-value]


def _default_mapping(mapping: str | None, mindformers_file: str | Path) -> str | None:
    """The family a MindFormers weights file's suffix implies (.safetensors: MindFormers 2.x mcore, its only
    safetensors models; models/mcore_dense), else the default preset (a .ckpt: the legacy Llama)."""
    if mapping is None:
        return preset_for_weights(mindformers_file)
    return mapping


def convert_megatron_to_mindformers(paths: Sequence[str | Path], out: str | Path, *, num_heads: int,
                                    num_query_groups: int | None = None, mapping: str | None = None,
                                    dtype: str | None = None, num_experts: int | None = None) -> StageResult:
    """Megatron-core state_dict(s) -> MindFormers weights: ``out`` ending in .safetensors gets mcore names and
    layouts (loadable with ``load_ckpt_format: safetensors``), else a MindSpore .ckpt (legacy Llama)."""
    m = load_mapping(_default_mapping(mapping, out))
    loaded, dtypes = megatron_to_numpy(paths)
    tp = len(paths)
    state = merge_tp_shards(loaded if tp > 1 else [loaded], m)   # type: ignore[list-item]
    # fc1 halves are [gate; up] per TP shard; after concatenation the chunk transform needs tp
    params = TransformParams(num_heads=num_heads, num_query_groups=num_query_groups or num_heads, tp=tp,
                             num_experts=num_experts)
    converted, res = m.convert({k: v for k, v in state.items() if not m.ignored(k, "baseline")}, "candidate",
                               params)
    src_dtype = dtype or (next(iter(dtypes.values())) if dtypes else "float32")
    if str(out).endswith(".safetensors"):
        if res.verdict == "fail":   # nothing half-way: an incomplete conversion writes no file
            res.details.update({"out": str(out), "tensors": 0, "tp_shards_merged": tp, "dtype": src_dtype})
            return res
        from checkpoints.mindformers import write_safetensors

        write_safetensors(converted, out, dtype="bfloat16" if src_dtype == "bfloat16" else None,
                          metadata={"mapping": m.name})
        res.details.update({"out": str(out), "tensors": len(converted), "tp_shards_merged": tp,
                            "dtype": src_dtype, "format": "safetensors"})
        return res
    import mindspore as ms

    items = []
    for name, arr in converted.items():
        t = ms.Tensor(arr)
        if src_dtype == "bfloat16":
            t = t.astype(ms.bfloat16)
        items.append({"name": name, "data": ms.Parameter(t, name=name)})
    ms.save_checkpoint(items, str(out))
    res.details.update({"out": str(out), "tensors": len(items), "tp_shards_merged": tp, "dtype": src_dtype})
    return res


def mindformers_to_numpy(path: str | Path) -> tuple[dict[str, np.ndarray], str]:
    import mindspore as ms

    try:
        params = ms.load_checkpoint(str(path))
    except Exception as exc:  # noqa: BLE001
        raise BadInput(f"{path}: not a MindSpore checkpoint ({exc.__class__.__name__})") from None
    out, dtype = {}, "float32"
    for k, p in params.items():
        if p.dtype == ms.bfloat16:
            dtype = "bfloat16"
            out[k] = p.astype(ms.float32).asnumpy()
        else:
            out[k] = p.asnumpy()
    return out, dtype


def convert_mindformers_to_megatron(path: str | Path, out: str | Path, *, num_heads: int,
                                    num_query_groups: int | None = None, mapping: str | None = None,
                                    scheme: str = "local", num_experts: int | None = None,
                                    sizes: dict[str, int] | None = None) -> StageResult:
    """MindFormers weights (.safetensors with mcore names, or a legacy Llama .ckpt) -> Megatron-core
    state_dict (TP=1) saved by torch. ``sizes``: the named sizes a fused tensor splits back by (`concat`
    rules, e.g. ``q_down`` = q_lora_rank for MLA's linear_qkv with mla_qkv_concat)."""
    import torch

    m = load_mapping(_default_mapping(mapping, path))
    if str(path).endswith(".safetensors"):
        from checkpoints.mindformers import read_safetensors

        state, dtypes = read_safetensors(path)
        dtype = "bfloat16" if "bfloat16" in dtypes.values() else "float32"
    else:
        state, dtype = mindformers_to_numpy(path)
    params = TransformParams(num_heads=num_heads, num_query_groups=num_query_groups or num_heads,
                             num_experts=num_experts, sizes=dict(sizes or {}))
    # optimizer state (adam moments, step counters) lives in the same file: not weights, not converted
    weights = {k: v for k, v in state.items()
               if (m.match(k, "candidate") is not None or not _optimizer_key(k)) and not m.ignored(k, "candidate")}
    converted, res = m.convert(weights, "baseline", params, scheme=scheme)
    if res.verdict == "fail":   # nothing half-way
        res.details.update({"out": str(out), "tensors": 0, "dtype": dtype})
        return res
    tdt = torch.bfloat16 if dtype == "bfloat16" else None
    sd = {k: (torch.from_numpy(np.ascontiguousarray(v)).to(tdt) if tdt else torch.from_numpy(
        np.ascontiguousarray(v))) for k, v in converted.items()}
    torch.save(sd, str(out))
    res.details.update({"out": str(out), "tensors": len(sd), "dtype": dtype})
    return res


def _optimizer_key(name: str) -> bool:
    return name.startswith(("adam_", "moment1.", "moment2.", "global_step", "learning_rate", "scale_sense",
                            "current_iterator_step", "last_overflow_iterator_step", "epoch_num", "step_num",
                            "loss_scale"))






