"""Transforms: how one side's tensors of a rule become the other side's (numpy; they only slice, reshape and
concatenate, so they are bit-exact for any dtype, and the L2 norm of a group is the same on both sides).

``OPS`` names the transforms a mapping file may use; :func:`apply` runs one in either direction.
"""

from __future__ import annotations

from collections.abc import Mapping as MappingABC
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from core.errors import BadInput

OPS = ("identity", "transpose", "split_qkv", "chunk", "interleave", "qkv_contiguous", "concat", "stack_experts")


@dataclass
class TransformParams:
    """Model facts some transforms need. Unknown values are inferred from shapes where possible."""

    num_heads: int | None = None            # np
    num_query_groups: int | None = None     # ng (== np for MHA)
    head_dim: int | None = None             # hn (kv_channels)
    tp: int = 1                             # TP shards concatenated in the array (chunk per_tp_shard)
    num_experts: int | None = None          # routed experts a stacked tensor holds (gather rules)
    sizes: dict[str, int] = field(default_factory=dict)   # named sizes a `concat` transform splits by

    @classmethod
    def from_mapping(cls, values: MappingABC[str, Any] | None) -> TransformParams:
        v = dict(values or {})
        return cls(num_heads=v.get("num_heads"), num_query_groups=v.get("num_query_groups"),
                   head_dim=v.get("head_dim"), tp=int(v.get("tp") or 1), num_experts=v.get("num_experts"),
                   sizes={k: int(x) for k, x in dict(v.get("sizes") or {}).items()})


def _qkv_dims(rows: int, p: TransformParams) -> tuple[int, int, int]:
    nh, ng, hn = p.num_heads, p.num_query_groups or p.num_heads, p.head_dim
    if nh is None:
        raise BadInput("splitting fused QKV needs num_heads (and num_query_groups for GQA)")
    if hn is None:
        if rows % (nh + 2 * ng):
            raise BadInput(f"fused QKV has {rows} rows, not a multiple of heads + 2*groups = {nh + 2 * ng}")
        hn = rows // (nh + 2 * ng)
    if nh % ng or rows != (nh + 2 * ng) * hn:
        raise BadInput(f"fused QKV has {rows} rows; expected (heads {nh} + 2 * groups {ng}) * head_dim {hn}")
    return nh, ng, hn


def split_qkv(arr: np.ndarray, p: TransformParams) -> list[np.ndarray]:
    """Megatron's fused QKV -> q, k, v. Layout: view(ng, (np/ng + 2) * hn, ...), each group
    [np/ng*hn | hn | hn]. A concatenation of TP shards has the same layout (groups stay whole per shard)."""
    nh, ng, hn = _qkv_dims(arr.shape[0], p)
    per = nh // ng
    rest = arr.shape[1:]
    g = arr.reshape(ng, (per + 2) * hn, *rest)
    q = g[:, : per * hn].reshape(nh * hn, *rest)
    k = g[:, per * hn: (per + 1) * hn].reshape(ng * hn, *rest)
    v = g[:, (per + 1) * hn:].reshape(ng * hn, *rest)
    return [np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v)]


def merge_qkv(parts: Sequence[np.ndarray], p: TransformParams) -> np.ndarray:
    """Inverse of split_qkv."""
    q, k, v = parts
    ng = k.shape[0] // (p.head_dim or _infer_head_dim(q, k, p))
    hn = k.shape[0] // ng
    rest = q.shape[1:]
    per = q.shape[0] // (ng * hn)
    g = np.concatenate([q.reshape(ng, per * hn, *rest), k.reshape(ng, hn, *rest),
                        v.reshape(ng, hn, *rest)], axis=1)
    return g.reshape(-1, *rest)


def _infer_head_dim(q: np.ndarray, k: np.ndarray, p: TransformParams) -> int:
    if p.num_heads:
        return q.shape[0] // p.num_heads
    if p.num_query_groups:
        return k.shape[0] // p.num_query_groups
    raise BadInput("merging q, k, v into fused QKV needs num_heads or head_dim")


def chunk(arr: np.ndarray, parts: int, dim: int, tp: int) -> list[np.ndarray]:
    """Split ``arr`` into ``parts`` on ``dim``; with ``tp`` > 1 the array is a concatenation of TP shards,
    each shard holding its own [part0; part1; ...] (Megatron's gated fc1: [gate; up] per shard)."""
    shards = np.split(arr, tp, axis=dim) if tp > 1 else [arr]
    pieces = [np.split(s, parts, axis=dim) for s in shards]
    return [np.ascontiguousarray(np.concatenate([pc[i] for pc in pieces], axis=dim)) for i in range(parts)]


def unchunk(arrs: Sequence[np.ndarray], dim: int, tp: int) -> np.ndarray:
    """Inverse of chunk."""
    per_part = [np.split(a, tp, axis=dim) if tp > 1 else [a] for a in arrs]
    return np.concatenate([per_part[i][s] for s in range(tp) for i in range(len(arrs))], axis=dim)


def interleave_halves(arr: np.ndarray, tp: int) -> np.ndarray:
    """Megatron's gated fc1 ([gate; up] stacked per TP shard) -> MindFormers' row-interleaved layout
    (``use_interleaved_weight_layout_mlp``): rows gate_0, up_0, gate_1, up_1, ..."""
    gate, up = chunk(arr, 2, 0, tp)
    return np.ascontiguousarray(np.stack([gate, up], axis=1).reshape(-1, *arr.shape[1:]))


def deinterleave_halves(arr: np.ndarray, tp: int) -> np.ndarray:
    """Inverse of interleave_halves."""
    if arr.shape[0] % 2:
        raise BadInput(f"interleaved gate/up tensor has an odd number of rows ({arr.shape[0]})")
    pairs = arr.reshape(arr.shape[0] // 2, 2, *arr.shape[1:])
    return unchunk([pairs[:, 0], pairs[:, 1]], 0, tp)


def stack_experts(arrs: Sequence[np.ndarray]) -> np.ndarray:
    """Per-expert Megatron weights [out, in] -> MindFormers' stacked, transposed [E * in, out]
    (``experts.weight1`` [E*H, 2F] from fc1 [2F, H]; ``weight2`` [E*F, H] from fc2 [H, F])."""
    return np.ascontiguousarray(np.concatenate([np.swapaxes(a, 0, 1) for a in arrs], axis=0))


def unstack_experts(arr: np.ndarray, num_experts: int) -> list[np.ndarray]:
    """Inverse of stack_experts."""
    if arr.shape[0] % num_experts:
        raise BadInput(f"stacked expert tensor has {arr.shape[0]} rows, not a multiple of {num_experts} experts")
    return [np.ascontiguousarray(np.swapaxes(a, 0, 1)) for a in np.split(arr, num_experts, axis=0)]



def apply(rule_id: str, transform: MappingABC[str, Any], arrays: Sequence[np.ndarray], to_side: str,
          params: TransformParams) -> list[np.ndarray]:
    """Tensors of one side's group -> the other side's (``to_side``), by the rule's ``transform``."""
    op = transform.get("op", "identity")
    forward = (to_side == "candidate") != bool(transform.get("inverse"))
    if op == "identity":
        return list(arrays)
    if op == "transpose":
        return [np.ascontiguousarray(np.swapaxes(arrays[0], 0, 1))]
    if op == "split_qkv":
        return split_qkv(arrays[0], params) if forward else [merge_qkv(arrays, params)]
    if op == "chunk":
        tp = params.tp if transform.get("per_tp_shard") else 1
        dim = int(transform.get("dim", 0))
        if forward:
            return chunk(arrays[0], int(transform.get("parts", 2)), dim, tp)
        return [unchunk(arrays, dim, tp)]
    if op == "interleave":
        tp = params.tp if transform.get("per_tp_shard") else 1
        return [interleave_halves(arrays[0], tp)] if forward else [deinterleave_halves(arrays[0], tp)]
    if op == "qkv_contiguous":
        if forward:
            return [np.ascontiguousarray(np.concatenate(split_qkv(arrays[0], params), axis=0))]
        nh, ng, hn = _qkv_dims(arrays[0].shape[0], params)
        q, k, v = np.split(arrays[0], [nh * hn, (nh + ng) * hn], axis=0)
        return [merge_qkv([q, k, v], params)]
    if op == "concat":
        dim = int(transform.get("dim", 0))
        if forward:
            return [np.ascontiguousarray(np.concatenate(arrays, axis=dim))]
        return [np.ascontiguousarray(a) for a in np.split(arrays[0], _concat_cuts(rule_id, transform, arrays[0],
                                                                                 params), axis=dim)]
    if op == "stack_experts":
        if forward:
            return [stack_experts(arrays)]
        if not params.num_experts:
            raise BadInput(f"rule {rule_id}: unstacking experts needs the number of experts (--num-experts)")
        return unstack_experts(arrays[0], int(params.num_experts))
    raise BadInput(f"rule {rule_id}: unknown transform {op!r}")


def _concat_cuts(rule_id: str, transform: MappingABC[str, Any], arr: np.ndarray, params: TransformParams
                 ) -> list[int]:
    """Where a `concat` splits back: its named sizes from ``params.sizes``; one unknown size (at most) is
    what remains of the array (e.g. MLA's fused linear_qkv needs only q_down = q_lora_rank)."""
    dim = int(transform.get("dim", 0))
    names = list(transform.get("sizes") or [])
    missing = [n for n in names if n not in params.sizes]
    if not names or len(missing) > 1:
        raise BadInput(f"rule {rule_id}: splitting needs sizes {', '.join(missing or ['(none listed)'])}")
    known = sum(int(params.sizes[n]) for n in names if n not in missing)
    total = int(arr.shape[dim])
    sizes = [int(params.sizes[n]) if n not in missing else total - known for n in names]
    if any(x <= 0 for x in sizes) or sum(sizes) != total:
        raise BadInput(f"rule {rule_id}: sizes {dict(zip(names, sizes, strict=True))} do not split "
                       f"{total} rows on dim {dim}")
    return [int(c) for c in np.cumsum(sizes)[:-1]]
