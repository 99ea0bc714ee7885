"""MindFormers' legacy Llama (``use_legacy: True``, MindFormers <= 1.6: LlamaForCausalLM, model.layers.N.attention.wq
...) against a megatron-core GPT/Llama: the default preset (models.DEFAULT_PRESET), never detected from a
config (a legacy YAML names no family), and the demo's ``--model llama``."""

from models.family import declare

FAMILY = declare(__file__, describe="Megatron-core GPT/Llama <-> MindFormers legacy LlamaForCausalLM",
                 order=90, demo_kind="llama")
