"""A tiny Megatron-core dense state_dict (models/mcore_dense names) and the three on-disk forms convert-weights
reads: a plain torch .pt, a ``torch_dist`` folder (torch.distributed.checkpoint, saved without a process
group; layers stacked on a leading axis as Megatron stores them) and a legacy ``mp_rank_*`` TP=2 folder
(each rank's shard as Megatron splits it: QKV by whole query groups, gated fc1 as [gate_r; up_r])."""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import numpy as np

H, F, V, NH, NG, LAYERS = 8, 12, 16, 4, 2, 2
HN = H // NH
HEADS = ["--num-heads", str(NH), "--num-query-groups", str(NG)]
PER_LAYER = {
    "input_layernorm.weight": (H,),
    "self_attention.linear_qkv.weight": ((NH + 2 * NG) * HN, H),
    "self_attention.linear_proj.weight": (H, NH * HN),
    "pre_mlp_layernorm.weight": (H,),
    "mlp.linear_fc1.weight": (2 * F, H),
    "mlp.linear_fc2.weight": (H, F),
}


def tiny_state(seed: int = 0) -> dict[str, np.ndarray]:
    """15 float32 tensors: embedding, 2 layers x 6, final norm, output layer."""
    r = np.random.default_rng(seed)

    def f(*shape: int) -> np.ndarray:
        return r.standard_normal(shape).astype(np.float32)

    sd = {"embedding.word_embeddings.weight": f(V, H), "decoder.final_layernorm.weight": f(H),
          "output_layer.weight": f(V, H)}
    for i in range(LAYERS):
        sd.update({f"decoder.layers.{i}.{k}": f(*shape) for k, shape in PER_LAYER.items()})
    return sd


def save_pt(state: dict[str, np.ndarray], path: Path) -> Path:
    import torch

    torch.save({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()}, path)
    return path


def save_torch_dist(state: dict[str, np.ndarray], folder: Path, *, files: int = 2) -> Path:
    """``folder/iter_0000001`` as torch_dist (``files`` .distcp shards), with latest_checkpointed_iteration.txt."""
    import torch
    import torch.distributed.checkpoint as dcp

    stacked: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        if not k.startswith("decoder.layers."):
            stacked[k] = torch.from_numpy(v.copy())
    for k in PER_LAYER:
        stacked[f"decoder.layers.{k}"] = torch.from_numpy(np.stack([state[f"decoder.layers.{i}.{k}"]
                                                                    for i in range(LAYERS)]))
    it = folder / "iter_0000001"
    it.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(stacked, storage_writer=dcp.FileSystemWriter(str(it), thread_count=files), no_dist=True)
    (folder / "latest_checkpointed_iteration.txt").write_text("1")
    return folder


def tp_shards(state: dict[str, np.ndarray], tp: int = 2) -> list[dict[str, np.ndarray]]:
    out: list[dict[str, np.ndarray]] = [{} for _ in range(tp)]
    for k, v in state.items():
        if k.endswith("linear_qkv.weight"):      # whole query groups per rank
            parts = np.split(v.reshape(NG, -1, H), tp, axis=0)
            parts = [p.reshape(-1, H) for p in parts]
        elif k.endswith("linear_fc1.weight"):    # each rank: [gate_r; up_r]
            gate, up = np.split(v, 2, axis=0)
            parts = [np.concatenate([g, u]) for g, u in zip(np.split(gate, tp), np.split(up, tp), strict=True)]
        elif k.endswith(("linear_proj.weight", "linear_fc2.weight")):
            parts = np.split(v, tp, axis=1)
        elif k.endswith(("word_embeddings.weight", "output_layer.weight")):
            parts = np.split(v, tp, axis=0)
        else:
            parts = [v] * tp
        for r in range(tp):
            out[r][k] = np.ascontiguousarray(parts[r])
    return out


def save_legacy(state: dict[str, np.ndarray], folder: Path, *, tp: int = 2) -> Path:
    """``folder/iter_0000001/mp_rank_0T/model_optim_rng.pt`` (Megatron's legacy `torch` format, TP=tp)."""
    import torch

    it = folder / "iter_0000001"
    for r, shard in enumerate(tp_shards(state, tp)):
        d = it / f"mp_rank_{r:02d}"
        d.mkdir(parents=True)
        torch.save({"model": {k: torch.from_numpy(v) for k, v in shard.items()},
                    "args": argparse.Namespace(swiglu=True, tensor_model_parallel_size=tp),
                    "iteration": 1, "checkpoint_version": 3.0}, d / "model_optim_rng.pt")
    (folder / "latest_checkpointed_iteration.txt").write_text("1")
    return folder
