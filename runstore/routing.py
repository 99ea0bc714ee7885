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
from runstore.h5file import open_h5, read_dataset

ROUTING_GROUP = "routing"
COUNTS_TABLE = "routing_counts"
ARRAYS = ("logits", "topk_index", "topk_probs", "tokens_per_expert")
MAX_EXPERTS = 1 << 20


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
    """Tokens per expert of every router in one step file (``routing_counts``; empty when absent). Experts and
    tokens are checked (runstore.tables.RANGES) before an array is sized from them."""
    from runstore.tables import check_table, table_columns

    path = Path(path)
    try:
        with open_h5(path) as h5:
            obj = h5.get(COUNTS_TABLE)
            if obj is None:
                return {}
            cols = table_columns(obj)
    except (OSError, KeyError, ValueError, TypeError, RuntimeError) as exc:
        raise BadInput(f"{path}: routing_counts not readable ({' '.join(str(exc).split())[:120]})") from None
    check_table(path, COUNTS_TABLE, cols)
    out: dict[str, np.ndarray] = {}
    for module in dict.fromkeys(cols["module"]):
        sel = cols["module"] == module
        e, t = cols["expert"][sel].astype(np.int64), cols["tokens"][sel].astype(np.int64)
        c = np.zeros(int(e.max()) + 1 if e.size else 0, np.int64)
        np.add.at(c, e, t)
        out[str(module)] = c
    return out


#: the attributes a router's record may carry, and their types (anything else is kept as it is)
_ATTR_TYPES: dict[str, tuple[type, ...]] = {"score_function": (str,), "topk": (int,), "batch": (int,),
                                            "seq": (int,), "calls": (int,), "dtype": (str,)}
SCORE_FUNCTIONS = ("softmax", "sigmoid")


def read_routing(path: str | Path) -> dict[str, RouterRecord]:
    """Every router's record in one step file (empty when it holds none), checked where it enters: ``routing``
    a group of router groups, each holding the four arrays (each size checked before it is read) with fitting
    shapes and types, chosen experts within the router's, tokens per expert what the choices count, the
    attributes of their types. Non-finite logits or probabilities are read as they are: evidence the comparator
    judges. Anything else is one line naming the file and the router."""
    path = Path(path)
    out: dict[str, RouterRecord] = {}
    try:
        with open_h5(path) as h5:
            grp = h5.get(ROUTING_GROUP)
            if grp is None:
                return out
            if not isinstance(grp, h5py.Group):
                raise BadInput(f"{path}: '{ROUTING_GROUP}' is a dataset, expected a group of routers "
                               f"({ROUTING_GROUP}/<router module>/{{{','.join(ARRAYS)}}})")
            size = path.stat().st_size
            for module in _router_groups(path, grp):
                out[module] = _read_router(path, module, grp[module], size)
    except (OSError, KeyError, ValueError, TypeError, RuntimeError) as exc:
        raise BadInput(f"{path}: routing group not readable ({' '.join(str(exc).split())[:120]})") from None
    return out


def _router_groups(path: Path, grp: h5py.Group) -> list[str]:
    """The router groups under ``routing``: every group that holds a dataset (its arrays are checked next). A
    dataset directly under ``routing`` (a router stored as one array) is refused."""
    routers: dict[str, None] = {}

    def visit(name: str, obj: Any) -> None:
        if isinstance(obj, h5py.Dataset):
            parent = name.rpartition("/")[0]
            if not parent:
                raise BadInput(f"{path}: '{ROUTING_GROUP}/{name}' is a dataset, expected a router's group holding "
                               f"{', '.join(ARRAYS)}")
            routers.setdefault(parent)

    grp.visititems(visit)
    return list(routers)


def _read_router(path: Path, module: str, g: h5py.Group, size: int) -> RouterRecord:
    where = f"{ROUTING_GROUP}/{module}"
    missing = [a for a in ARRAYS if not isinstance(g.get(a), h5py.Dataset)]
    if missing:
        raise BadInput(f"{path}: {where} lacks {', '.join(missing)}")
    arrs = {a: read_dataset(path, f"{where}/{a}", g[a], size) for a in ARRAYS}
    logits, idx, probs, counts = (arrs[a] for a in ARRAYS)
    for a, kinds in (("logits", "f"), ("topk_probs", "f"), ("topk_index", "iu"), ("tokens_per_expert", "iu")):
        if arrs[a].dtype.kind not in kinds or arrs[a].dtype.names is not None:
            raise BadInput(f"{path}: '{where}/{a}': dtype {arrs[a].dtype}, expected "
                           f"{'a float' if kinds == 'f' else 'an integer'} type")
    if (logits.ndim != 2 or idx.ndim != 2 or probs.shape != idx.shape or idx.shape[0] != logits.shape[0]
            or counts.shape != (logits.shape[1],)):
        raise BadInput(f"{path}: {where}: shapes do not fit (logits {logits.shape}, topk_index "
                       f"{idx.shape}, topk_probs {probs.shape}, tokens_per_expert {counts.shape})")
    experts = logits.shape[1]
    if experts > MAX_EXPERTS or idx.shape[1] > experts:
        raise BadInput(f"{path}: {where}: top-{idx.shape[1]} of {experts} experts (at most {MAX_EXPERTS}, k at "
                       "most the experts)")
    idx = idx.astype(np.int64)
    bad = (idx < -1) | (idx >= experts)
    if bad.any():
        t, k = np.argwhere(bad)[0]
        raise BadInput(f"{path}: '{where}/topk_index': {int(idx[t, k])} at token {int(t)} is not an expert of "
                       f"{experts} (or -1, a dropped choice)")
    counts = counts.astype(np.int64)
    chosen = np.bincount(idx[idx >= 0].ravel(), minlength=experts)
    if not np.array_equal(counts, chosen):
        e = int(np.argmax(counts != chosen))
        raise BadInput(f"{path}: '{where}/tokens_per_expert': expert {e} holds {int(counts[e])}, its top-k "
                       f"choices count {int(chosen[e])}")
    la = {k: _plain(v) for k, v in g["logits"].attrs.items()}
    pa = {k: _plain(v) for k, v in g["topk_probs"].attrs.items()}
    for attrs, arr in ((la, "logits"), (pa, "topk_probs")):
        for k, types in _ATTR_TYPES.items():
            v = attrs.get(k)
            if v is not None and (not isinstance(v, types) or isinstance(v, bool)
                                  or (isinstance(v, int) and not 0 <= v < 1 << 62)):
                raise BadInput(f"{path}: '{where}/{arr}' attribute '{k}': {v!r:.40} is not "
                               f"{'text' if types == (str,) else 'a non-negative integer'}")
    if la.get("score_function", "softmax") not in SCORE_FUNCTIONS:
        raise BadInput(f"{path}: '{where}/logits' attribute 'score_function': {la['score_function']!r:.40} is not "
                       f"one of {', '.join(SCORE_FUNCTIONS)}")
    return RouterRecord(module, logits.astype(np.float32), idx, probs.astype(np.float32), counts,
                        str(la.pop("dtype", "float32")), str(pa.get("dtype", "float32")), la)


def _plain(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if isinstance(v, np.generic):
        return v.item()
    return v
