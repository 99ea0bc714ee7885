"""MindFormers 2.x mcore DeepSeek-V3-style models (MLA, MoE with a shared expert, MTP): two presets, by how
MindFormers names MLA's attention parameters. The demo's ``--model mla``.

MLA: ``multi_latent_attention: True``, or a DeepSeek-V3 model that does not say (DeepseekV3Config always
builds MLA). Its attention parameters depend on ``mla_qkv_concat``: False (the shipped DeepSeek-V3
pretrain/finetune YAMLs) keeps Megatron's linear_q_down_proj / linear_kv_down_proj / ..._up_proj names;
True, and unset (DeepseekV3Config has no such field, so MindFormers' TransformerConfig default True
applies), fuses them into linear_qkv / linear_qb / linear_kvb.
"""

from typing import Any

from models.family import declare
from models.mindformers_yaml import is_mcore_yaml, model_config, truth

PRESET = "megatron_core__mindformers_mcore_mla"
PRESET_QKV_CONCAT = "megatron_core__mindformers_mcore_mla_qkv_concat"


def detect(cfg: dict[str, Any]) -> str | None:
    if not is_mcore_yaml(cfg):
        return None
    mc = model_config(cfg)
    deepseek = mc.get("type") == "DeepseekV3Config" or str(mc.get("model_type", "")).lower() == "deepseek_v3"
    mla = truth(mc.get("multi_latent_attention"))
    if mla is True or (mla is None and deepseek):
        return PRESET if truth(mc.get("mla_qkv_concat", True)) is False else PRESET_QKV_CONCAT
    return None


FAMILY = declare(__file__, main=PRESET, describe="Megatron-core GPT (MLA + MoE) <-> MindFormers mcore DeepSeek-V3",
                 order=10, detect=detect, demo_kind="mla")
