"""Step 1 of a megatron-core model described by a ``TinyModel``, with its weights in MindFormers' names.

Why shared: the MoE and MLA pair tests start from the same thing (Megatron's step-1 loss and gradient
norms, its weights converted through the mcore preset, the batch) and compare MindFormers against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from demo import megatron_cpu as mg
from demo import mindformers_mcore_cpu as mc
from mapping import Mapping, TransformParams
from models import load_mapping


@dataclass
class MegatronStep1:
    loss: float
    norms: dict[str, tuple[float, int]]     # parameter -> (gradient L2 norm, numel), Megatron's names
    weights: dict[str, np.ndarray]          # the initial weights in MindFormers' names
    batch: dict[str, np.ndarray]            # tokens, labels, loss_mask
    mapping: Mapping


def megatron_step1(spec: Any, preset: str, seed: int = 5) -> MegatronStep1:
    mg.init_megatron_cpu(tp=1)
    cfg = mg.TinyLlamaConfig(**mc.megatron_config_kwargs(spec))
    model = mg.build_tiny_llama(cfg, seed=seed)
    tb = mg.synthetic_batch(1, cfg)
    loss = mg.forward_loss(model, tb)
    loss.backward()
    norms = {n: (float(p.grad.norm()), p.numel()) for n, p in model.named_parameters()}
    m = load_mapping(preset)
    state = {k: v.detach().numpy() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    groups = spec.num_attention_heads if spec.kind == "mla" else spec.num_query_groups
    weights, res = m.convert({k: v for k, v in state.items() if not m.ignored(k, "baseline")}, "candidate",
                             TransformParams(num_heads=spec.num_attention_heads, num_query_groups=groups,
                                             num_experts=spec.num_experts or None))
    assert res.verdict == "pass", [f.message for f in res.findings][:3]
    batch = {k: tb[k].numpy() for k in ("tokens", "labels", "loss_mask")}
    return MegatronStep1(float(loss.detach()), norms, weights, batch, m)
