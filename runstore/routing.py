"""MoE routing records in a step file: ``routing/<router module>/<array>``, one group per router.

Why a group of its own: a router fault (gating computed in a lower precision, experts stored in another order)
shows in what the router chose long before it shows in a layer's output statistics, and the choices are
small (tokens x top-k integers). Both dumpers write the same record here (the Megatron router's forward hook,
the MindSpore router wrapper), so the comparator (``comparators.routing``) reads one format.

Arrays of one router (token order: batch-major, token ``b * seq + s``, whatever the framework's own order):

- ``logits`` float32 [tokens, experts]: the gating matmul's output (before the score function), stored as
  float32; attribute ``dtype``: the dtype the framework computed it in.
- ``topk_index`` int32 [tokens, k]: the chosen experts by global index (every expert, not an EP rank's), in
  descending order of their probability; -1 where a token got fewer (token dropping).
- ``topk_probs`` float32 [tokens, k]: the routing probabilities (combine weights) of those choices; attribute
  ``dtype``.
- ``tokens_per_expert`` int64 [experts]: how many of the tokens chose each expert.

Every array step (not only the tensor steps) also gets the cheap part, the ``routing_counts`` table: one row per
router and expert (``module``, ``expert``, ``tokens``: how many of the step's tokens chose it).

Attributes on the router's group: ``score_function`` (softmax | sigmoid), ``topk``, ``batch`` and ``seq`` (the
token grid), ``calls`` (micro-batches concatenated on the token axis).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from core.errors import BadInput

ROUTING_GROUP = "routing"
COUNTS_TABLE = "routing_counts"
ARRAYS = ("logits", "topk_index", "topk_probs", "tokens_per_expert")


@dataclass
class RouterRecord:
    """One router's choices at one step, on one rank (see the module docstring for the arrays)."""

    module: str
    logits: np.ndarray
    topk_index: np.ndarray
    topk_probs: np.ndarray
    tokens_per_expert: np.ndarray
    logits_dtype: str = "float32"
    probs_dtype: str = "float32"
    attrs: dict[str, Any] = field(default_factory=dict)

    @property
    def topk(self) -> int:
        return int(self.topk_index.shape[1])

    @property
    def num_experts(self) -> int:
        return int(self.logits.shape[1])


def make_record(module: str, logits: np.ndarray, topk_index: np.ndarray, topk_probs: np.ndarray, *,
                logits_dtype: str, probs_dtype: str, **attrs: Any) -> RouterRecord:
    """A record from the framework's arrays (already batch-major): shapes checked, choices sorted by
    probability, tokens per expert counted."""
    logits = np.asarray(logits, np.float32).reshape(-1, np.shape(logits)[-1])
    idx = np.asarray(topk_index).reshape(logits.shape[0], -1).astype(np.int32)
    probs = np.asarray(topk_probs, np.float32).reshape(idx.shape)
    order = np.argsort(-np.where(idx >= 0, probs, -np.inf), axis=1, kind="stable")
    idx, probs = np.take_along_axis(idx, order, 1), np.take_along_axis(probs, order, 1)
    experts = logits.shape[1]
    valid = idx[(idx >= 0) & (idx < experts)]
    counts = np.bincount(valid.ravel(), minlength=experts).astype(np.int64)
    return RouterRecord(module, logits, idx, probs, counts, logits_dtype, probs_dtype, dict(attrs))


def from_routing_map(module: str, logits: np.ndarray, probs: np.ndarray, routing_map: np.ndarray, k: int,
                     **kw: Any) -> RouterRecord:
    """A record from Megatron's dense outputs: ``probs`` [tokens, experts] (zero where not chosen) and the
    boolean ``routing_map`` [tokens, experts]."""
    rmap = np.asarray(routing_map, bool)
    p = np.asarray(probs, np.float32)
    score = np.where(rmap, p, -np.inf)
    idx = np.argsort(-score, axis=1, kind="stable")[:, :k]
    chosen = np.take_along_axis(rmap, idx, 1)
    return make_record(module, logits, np.where(chosen, idx, -1), np.where(chosen, np.take_along_axis(p, idx, 1), 0),
                       **kw)


def batch_major(arr: np.ndarray, seq: int, batch: int) -> np.ndarray:
    """[seq * batch, ...] in sequence-major order (Megatron's [s, b, h] flattened) -> batch-major."""
    a = np.asarray(arr)
    return a.reshape(seq, batch, *a.shape[1:]).swapaxes(0, 1).reshape(seq * batch, *a.shape[1:])


def concat_records(records: list[RouterRecord]) -> RouterRecord:
    """Several calls of one router in a step (micro-batches): concatenated on the token axis."""
    if len(records) == 1:
        return records[0]
    first = records[0]
    return RouterRecord(first.module, np.concatenate([r.logits for r in records]),
                        np.concatenate([r.topk_index for r in records]),
                        np.concatenate([r.topk_probs for r in records]),
                        np.sum([r.tokens_per_expert for r in records], axis=0), first.logits_dtype,
                        first.probs_dtype, {**first.attrs, "calls": len(records),
                                            "batch": sum(int(r.attrs.get("batch", 0)) for r in records)})


def put_routing(writer: Any, step: int, rec: RouterRecord) -> None:
    """Write one router's record into ``step``'s file through a RunWriter / BackgroundWriter."""
    base = f"{ROUTING_GROUP}/{rec.module}"
    attrs = {k: v for k, v in rec.attrs.items() if v is not None}
    writer.put_array(step, f"{base}/logits", rec.logits, {"dtype": rec.logits_dtype, **attrs})
    writer.put_array(step, f"{base}/topk_index", rec.topk_index)
    writer.put_array(step, f"{base}/topk_probs", rec.topk_probs, {"dtype": rec.probs_dtype})
    writer.put_array(step, f"{base}/tokens_per_expert", rec.tokens_per_expert)


def put_counts(writer: Any, step: int, counts: dict[str, np.ndarray]) -> None:
    """Write the step's tokens per expert of every router as the ``routing_counts`` table."""
    if not counts:
        return
    modules, experts, tokens = [], [], []
    for module, c in counts.items():
        c = np.asarray(c, np.int64).ravel()
        modules += [module] * c.size
        experts.append(np.arange(c.size, dtype=np.int64))
        tokens.append(c)
    writer.put_table(step, COUNTS_TABLE, {"module": modules, "expert": np.concatenate(experts),
                                          "tokens": np.concatenate(tokens)})


def read_counts(path: str | Path) -> dict[str, np.ndarray]:
    """Tokens per expert of every router in one step file (``routing_counts``; empty when absent)."""
    from runstore.tables import check_table, table_columns

    path = Path(path)
    try:
        with h5py.File(path, "r") as h5:
            obj = h5.get(COUNTS_TABLE)
            if obj is None:
                return {}
            cols = table_columns(obj)
    except (OSError, KeyError, ValueError, TypeError) as exc:
        raise BadInput(f"{path}: routing_counts not readable ({' '.join(str(exc).split())[:120]})") from None
    check_table(path, COUNTS_TABLE, cols)
    out: dict[str, np.ndarray] = {}
    for module in dict.fromkeys(cols["module"]):
        sel = cols["module"] == module
        e, t = cols["expert"][sel].astype(np.int64), cols["tokens"][sel].astype(np.int64)
        if e.size and (e.min() < 0 or e.max() > 1 << 20):
            raise BadInput(f"{path}: routing_counts of {module}: expert index {int(e.min())}..{int(e.max())}")
        c = np.zeros(int(e.max()) + 1 if e.size else 0, np.int64)
        np.add.at(c, e, t)
        out[str(module)] = c
    return out


def read_routing(path: str | Path) -> dict[str, RouterRecord]:
    """Every router's record in one step file (empty when it holds none); a malformed group is refused with
    one line naming the file and the router."""
    path = Path(path)
    out: dict[str, RouterRecord] = {}
    try:
        with h5py.File(path, "r") as h5:
            grp = h5.get(ROUTING_GROUP)
            if grp is None:
                return out
            modules: list[str] = []
            grp.visititems(lambda name, obj: modules.append(name) if isinstance(obj, h5py.Group)
                           and "logits" in obj else None)
            for module in modules:
                g = grp[module]
                missing = [a for a in ARRAYS if not isinstance(g.get(a), h5py.Dataset)]
                if missing:
                    raise BadInput(f"{path}: routing/{module} lacks {', '.join(missing)}")
                arrs = {a: np.asarray(g[a][()]) for a in ARRAYS}
                logits, idx, probs = arrs["logits"], arrs["topk_index"], arrs["topk_probs"]
                if (logits.ndim != 2 or idx.ndim != 2 or probs.shape != idx.shape or idx.shape[0] != logits.shape[0]
                        or arrs["tokens_per_expert"].shape != (logits.shape[1],) or idx.dtype.kind not in "iu"):
                    raise BadInput(f"{path}: routing/{module}: shapes do not fit (logits {logits.shape}, topk_index "
                                   f"{idx.shape}, topk_probs {probs.shape}, tokens_per_expert "
                                   f"{arrs['tokens_per_expert'].shape})")
                la = {k: _plain(v) for k, v in g["logits"].attrs.items()}
                out[module] = RouterRecord(module, logits.astype(np.float32), idx.astype(np.int64),
                                           probs.astype(np.float32), arrs["tokens_per_expert"].astype(np.int64),
                                           str(la.pop("dtype", "float32")),
                                           str(_plain(g["topk_probs"].attrs.get("dtype", "float32"))), la)
    except (OSError, KeyError, ValueError, TypeError) as exc:
        raise BadInput(f"{path}: routing group not readable ({' '.join(str(exc).split())[:120]})") from None
    return out


def _plain(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if isinstance(v, np.generic):
        return v.item()
    return v
