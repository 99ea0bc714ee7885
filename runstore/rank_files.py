"""Rank files (``ranks/rank_R.json``): a rank's coordinates in the parallel layout, checked once when read.

Why checked here: every reader that places a rank's rows (local norms by TP shard, batches by DP / CP rank,
layer rows by TP / CP split) trusts these numbers, so a coordinate that is not a non-negative integer, a
coordinate at or beyond its group's size, or a size that differs between two ranks of one store would make a
wrong combination, not an error. Each is a one-line BadInput naming the file and the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from core.errors import BadInput
from runstore.schema import validate

MAX_SIZE = 1 << 20          # ranks in one parallel group: far above any cluster, far below an allocation
#: coordinate -> the keys its group's size may be written under (Megatron dumpers: tp; MindSpore: tp_size)
COORDINATES: dict[str, tuple[str, ...]] = {
    "tp_rank": ("tp", "tp_size"), "pp_rank": ("pp", "pp_size"), "dp_rank": ("dp", "dp_size"),
    "ep_rank": ("ep", "ep_size"), "cp_rank": ("cp", "cp_size"), "vpp_rank": ("vpp", "vpp_size"),
}
SIZES = tuple(k for keys in COORDINATES.values() for k in keys) + ("world_size",)
_COORD = {"type": "integer", "minimum": 0, "maximum": MAX_SIZE - 1}
_SIZE = {"type": "integer", "minimum": 1, "maximum": MAX_SIZE}
RANK_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"rank": {"type": "integer", "minimum": 0, "maximum": (1 << 62) - 1},
                   **{k: _COORD for k in COORDINATES}, **{k: _SIZE for k in SIZES}},
}


def check_rank_info(info: Any, path: str | Path, rank: int) -> dict[str, Any]:
    """``info`` (a rank file's content) when its coordinates fit: integers, each below its group's size, the
    ``rank`` key the file's own rank. One-line BadInput naming the file and the key otherwise."""
    validate(info, RANK_SCHEMA, path)
    if "rank" in info and info["rank"] != rank:
        raise BadInput(f"{path}: key 'rank': {info['rank']}, but the file is rank {rank}'s")
    for coord, size_keys in COORDINATES.items():
        for size_key in size_keys:
            if coord in info and size_key in info and info[coord] >= info[size_key]:
                raise BadInput(f"{path}: key '{coord}': {info[coord]} is not below {size_key} {info[size_key]}")
    if "world_size" in info and rank >= info["world_size"]:
        raise BadInput(f"{path}: key 'world_size': {info['world_size']}, but this is rank {rank}")
    return info


def check_sizes_agree(first: tuple[Path, dict[str, Any]], other: tuple[Path, dict[str, Any]]) -> None:
    """Two rank files of one store declare the same group sizes (a size either leaves out is not compared)."""
    (p0, a), (p1, b) = first, other
    for key in SIZES:
        if key in a and key in b and a[key] != b[key]:
            raise BadInput(f"{p1}: key '{key}': {b[key]}, but {p0.name} says {a[key]} (one store, one layout)")
