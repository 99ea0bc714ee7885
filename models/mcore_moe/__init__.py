"""MindFormers 2.x mcore MoE models (Qwen3-MoE-style: routed experts stacked per layer, optional shared
expert): an mcore YAML whose model has routed experts (a count above 1, or MoE keys whose count the model
class supplies). The demo's ``--model moe``."""

from typing import Any

from models.family import declare
from models.mindformers_yaml import expert_count, is_mcore_yaml

PRESET = "megatron_core__mindformers_mcore_moe"


def detect(cfg: dict[str, Any]) -> str | None:
    return PRESET if is_mcore_yaml(cfg) and expert_count(cfg) not in (0, None) else None


FAMILY = declare(__file__, describe="Megatron-core GPT (MoE) <-> MindFormers mcore MoE (Qwen3-MoE)", order=50,
                 detect=detect, demo_kind="moe")
