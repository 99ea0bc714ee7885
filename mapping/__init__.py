"""Name mapping: which baseline tensor is which candidate tensor, as data (YAML rules), not code.

One job a file: ``templates`` (name templates that match and format back), ``transforms`` (fused QKV, fc1
halves, stacked experts: numpy, bit-exact), ``rules`` (a rule, a match, a group pair) and ``engine`` (the
Mapping: load a file, orient, pair, convert, check). The shipped presets live with their model family
(``models/<family>/``); ``models.load_mapping`` resolves a preset name. Import from here.
"""

from mapping.engine import MAPPING_SCHEMA, Mapping
from mapping.rules import SIDES, GroupPair, Match, ModuleRule, Rule
from mapping.templates import Pattern
from mapping.transforms import (
    OPS,
    TransformParams,
    chunk,
    deinterleave_halves,
    interleave_halves,
    merge_qkv,
    split_qkv,
    stack_experts,
    unchunk,
    unstack_experts,
)

__all__ = [
    "MAPPING_SCHEMA", "OPS", "SIDES", "GroupPair", "Mapping", "Match", "ModuleRule", "Pattern", "Rule",
    "TransformParams", "chunk", "deinterleave_halves", "interleave_halves", "merge_qkv", "split_qkv",
    "stack_experts", "unchunk", "unstack_experts",
]
