"""Name mapping: which baseline tensor is which candidate tensor, as data (YAML rules), not code.

``engine`` holds the rule language and the transforms (fused QKV, fc1 halves, stacked experts); the presets
are YAML files in ``presets/``. Import from here.
"""

from mapping.engine import (
    DEFAULT_PRESET,
    MAPPING_SCHEMA,
    PRESET_DIR,
    SIDES,
    GroupPair,
    Mapping,
    Match,
    ModuleRule,
    Pattern,
    Rule,
    TransformParams,
    chunk,
    deinterleave_halves,
    interleave_halves,
    merge_qkv,
    presets,
    split_qkv,
    stack_experts,
    unchunk,
    unstack_experts,
)

__all__ = [
    "DEFAULT_PRESET", "MAPPING_SCHEMA", "PRESET_DIR", "SIDES", "GroupPair", "Mapping", "Match", "ModuleRule",
    "Pattern", "Rule", "TransformParams", "chunk", "deinterleave_halves", "interleave_halves", "merge_qkv",
    "presets", "split_qkv", "stack_experts", "unchunk", "unstack_experts",
]
