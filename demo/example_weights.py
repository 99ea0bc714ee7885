"""Write an example checkpoint set for ``align compare-weights``: Megatron-core checkpoints as Megatron saves them
(``torch_dist``: torch.distributed.checkpoint, every per-layer parameter stacked on a layer axis) and a
MindFormers 2.x safetensors file with mcore names and layouts (fc1 gate/up rows interleaved).

The weights are synthetic (a tiny dense GPT: 2 layers, hidden 64, 4 heads in 2 query groups), so the verb can
be shown without training: ``megatron_step0`` (the start), ``megatron_step100`` (the baseline after "100
steps"), ``megatron_repeat_step100`` (the baseline run again: its weights off by ~2e-3 relative, its band) and
``mindformers_step100.safetensors`` (the candidate: ~1e-3 relative from the baseline, inside the band).
``align demo`` trains real models instead. Run ``python -m demo.example_weights DIR`` (needs torch).
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import numpy as np

H, F, V, HEADS, GROUPS, LAYERS = 64, 128, 256, 4, 2, 2
PER_LAYER = {"input_layernorm.weight": (H,), "self_attention.linear_qkv.weight": ((HEADS + 2 * GROUPS) * H // HEADS, H),
             "self_attention.linear_proj.weight": (H, H), "pre_mlp_layernorm.weight": (H,),
             "mlp.linear_fc1.weight": (2 * F, H), "mlp.linear_fc2.weight": (H, F)}


def weights(seed: int = 0) -> dict[str, np.ndarray]:
    r = np.random.default_rng(seed)
    sd = {"embedding.word_embeddings.weight": r.normal(0, 0.02, (V, H)), "decoder.final_layernorm.weight": np.ones(H),
          "output_layer.weight": r.normal(0, 0.02, (V, H))}
    for i in range(LAYERS):
        for k, shape in PER_LAYER.items():
            sd[f"decoder.layers.{i}.{k}"] = np.ones(shape) if len(shape) == 1 else r.normal(0, 0.02, shape)
    return {k: v.astype(np.float32) for k, v in sd.items()}


def drifted(sd: dict[str, np.ndarray], rel: float, seed: int) -> dict[str, np.ndarray]:
    """Each tensor moved by ``rel`` of its own RMS (what training on different kernels does to weights)."""
    r = np.random.default_rng(seed)
    return {k: (v + rel * float(np.sqrt(np.mean(v * v))) * r.standard_normal(v.shape)).astype(np.float32)
            for k, v in sd.items()}


def save_torch_dist(sd: dict[str, np.ndarray], folder: Path) -> Path:
    """``folder/iter_0000001`` + latest_checkpointed_iteration.txt, layers stacked as dist_checkpointing does."""
    import torch
    import torch.distributed.checkpoint as dcp

    state = {k: torch.from_numpy(v.copy()) for k, v in sd.items() if not k.startswith("decoder.layers.")}
    for k in PER_LAYER:
        state[f"decoder.layers.{k}"] = torch.from_numpy(np.stack([sd[f"decoder.layers.{i}.{k}"]
                                                                  for i in range(LAYERS)]))
    it = folder / "iter_0000001"
    it.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(it)), no_dist=True)
    (folder / "latest_checkpointed_iteration.txt").write_text("1")
    return folder


def write_examples(out: Path) -> dict[str, Path]:
    from checkpoints.mindformers import write_safetensors
    from mapping import TransformParams
    from models import load_mapping

    out.mkdir(parents=True, exist_ok=True)
    start = weights()
    step100 = drifted(start, 0.05, seed=1)
    paths = {"megatron_step0": save_torch_dist(start, out / "megatron_step0"),
             "megatron_step100": save_torch_dist(step100, out / "megatron_step100"),
             "megatron_repeat_step100": save_torch_dist(drifted(step100, 2e-3, seed=2),
                                                        out / "megatron_repeat_step100")}
    mapping = load_mapping("megatron_core__mindformers_mcore_dense")
    cand, res = mapping.convert(drifted(step100, 1e-3, seed=3), "candidate",
                                TransformParams(num_heads=HEADS, num_query_groups=GROUPS))
    assert res.verdict == "pass", [f.message for f in res.findings]
    paths["mindformers_step100"] = write_safetensors(cand, out / "mindformers_step100.safetensors")
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out", type=Path)
    for name, p in write_examples(ap.parse_args().out).items():
        print(f"{name}: {p}")


if __name__ == "__main__":
    main()
