"""MindFormers 2.x mcore dense models (Qwen3-style: GQA, q/k layernorm, SwiGLU), with Megatron's own names.

Any mcore YAML (``use_legacy: False``) no narrower family claims is this one; so is a candidate run whose
name scheme is ``mindformers_mcore``; a dense Megatron checkpoint converted to ``.safetensors`` (MindFormers 2.x's
format; its names fit the legacy Llama preset as well). The demo's ``--model dense``."""

from typing import Any

from models.family import declare
from models.mindformers_yaml import is_mcore_yaml

PRESET = "megatron_core__mindformers_mcore_dense"


def detect(cfg: dict[str, Any]) -> str | None:
    return PRESET if is_mcore_yaml(cfg) else None


FAMILY = declare(__file__, describe="Megatron-core GPT <-> MindFormers mcore dense (Qwen3)", order=80,
                 detect=detect, name_scheme="mindformers_mcore", weights_suffix=".safetensors", demo_kind="dense")
