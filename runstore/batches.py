"""A step's batch per data-parallel rank, put back together from the ranks that recorded its parts.

Why: under Megatron's model parallelism one DP rank's batch is spread over ranks that are not data parallel.
Its TP ranks hold copies; the pipeline's first stage holds tokens and position ids, the last labels and loss
mask; context parallelism cuts the sequence into 2 x CP chunks and gives CP rank r chunks r and 2CP-1-r
(``megatron.core.utils.get_batch_on_this_cp_rank``: the zig-zag that balances causal attention). A data check
or a comparison with another layout must see the batch the DP rank trained on, so the parts are joined here,
once, for every reader (the data checks, the divergence stage, the MindFormers replay).

Ranks are grouped by ``dp_rank`` from their rank file (a rank without one is its own group, as before);
within a group the copies of a key must agree (TP ranks, the stages that both keep ``attention_mask``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from core.errors import BadInput

#: The sequence axis of a batch array, as get_batch_on_this_cp_rank splits it ([b, s], the mask [b, 1, s, s]).
SEQ_DIM = {"attention_mask": 2}


#: Per-sample arrays a replaying candidate records beside its batch ([rows]): the sample's position in the
#: baseline step's global batch, the baseline step, and hashes of what it trained on (:func:`sample_hashes`).
SAMPLE_KEYS = ("sample_index", "sample_step", "sample_hash", "replay_hash")


def seq_dim(key: str) -> int:
    return SEQ_DIM.get(key, 1)


def cp_split(arr: np.ndarray, cp: int, cp_rank: int, dim: int) -> np.ndarray:
    """CP rank ``cp_rank``'s part of ``arr``: chunks ``cp_rank`` and ``2cp-1-cp_rank`` of 2 x cp along ``dim``
    (what Megatron's get_batch_on_this_cp_rank keeps)."""
    if cp == 1:
        return arr
    chunks = np.split(np.asarray(arr), 2 * cp, axis=dim)
    return np.concatenate([chunks[cp_rank], chunks[2 * cp - 1 - cp_rank]], axis=dim)


def cp_join(parts: Sequence[np.ndarray], dim: int) -> np.ndarray:
    """The whole sequence from the CP ranks' parts (in CP rank order): the inverse of :func:`cp_split`."""
    cp = len(parts)
    if cp == 1:
        return np.asarray(parts[0])
    chunks: list[Any] = [None] * (2 * cp)
    for r, part in enumerate(parts):
        part = np.asarray(part)
        if part.ndim <= dim or part.shape[dim] % 2:
            raise ValueError(f"CP rank {r}'s part has shape {part.shape}: not two equal chunks along axis {dim}")
        chunks[r], chunks[2 * cp - 1 - r] = np.split(part, 2, axis=dim)
    return np.concatenate(chunks, axis=dim)


def data_groups(reader: Any, ranks: Iterable[int]) -> dict[int, list[tuple[int, dict[str, Any]]]]:
    """``dp_rank -> [(rank, rank info), ...]`` (a rank whose rank file has no ``dp_rank`` is its own group,
    keyed by its rank)."""
    groups: dict[int, list[tuple[int, dict[str, Any]]]] = {}
    for rank in ranks:
        info = reader.rank_info(rank)
        dp = info.get("dp_rank")
        key = int(dp) if isinstance(dp, int) and not isinstance(dp, bool) else int(rank)
        groups.setdefault(key, []).append((int(rank), info))
    return groups


def _coord(info: dict[str, Any], key: str, default: int = 0) -> int:
    v = info.get(key, default)
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else default


def join_group(reader: Any, step: int, members: Sequence[tuple[int, dict[str, Any]]],
               keys: Iterable[str] | None = None) -> tuple[dict[str, np.ndarray], list[Path], list[str], int]:
    """One DP rank's batch of ``step`` from its ranks' ``batch/*`` arrays: (batch, files read, notes, number
    of micro-batches stacked in it, from the ``micro_batches`` attribute the dumpers write; 1 when absent).

    Notes name copies that disagree (TP ranks that loaded different data). A CP rank with no part, or
    parts that cannot be joined, is a BadInput naming the step file.
    """
    want = set(keys) if keys is not None else None
    cp = max((_coord(info, "cp", 1) for _, info in members), default=1)
    order = sorted(members, key=lambda m: (_coord(m[1], "cp_rank"), _coord(m[1], "pp_rank"),
                                           _coord(m[1], "tp_rank"), m[0]))
    parts: dict[int, dict[str, np.ndarray]] = {}
    owner: dict[tuple[int, str], int] = {}
    files: list[Path] = []
    notes: list[str] = []
    micro = 1
    present = set(reader.array_ranks(step))
    for rank, info in order:
        if rank not in present:
            continue
        sa = reader.step_arrays(step, rank)
        got = {k.split("/", 1)[1]: v for k, v in sa.data.items() if k.startswith("batch/")}
        if "input_ids" in got and "tokens" not in got:      # a MindFormers dumper records its column names
            got["tokens"] = got.pop("input_ids")
        for k in got:
            n = (sa.attrs.get(f"batch/{k}") or {}).get("micro_batches")
            if isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n > 0:
                micro = max(micro, int(n))
        if want is not None:
            got = {k: v for k, v in got.items() if k in want}
        if not got:
            continue
        files.append(Path(reader.step_file(step, rank)))
        mine = parts.setdefault(_coord(info, "cp_rank"), {})
        for key, arr in got.items():
            if key not in mine:
                mine[key] = np.asarray(arr)
                owner[(_coord(info, "cp_rank"), key)] = rank
            elif not (mine[key].shape == np.shape(arr) and np.array_equal(mine[key], arr)):
                notes.append(f"step {step}: rank {rank}'s {key} differs from rank "
                             f"{owner[(_coord(info, 'cp_rank'), key)]}'s copy (same DP rank: they must hold "
                             "the same data)")
    if cp == 1 or not parts:
        return (parts[min(parts)] if parts else {}), files, notes, micro
    missing = [r for r in range(cp) if r not in parts]
    where = files[0] if files else Path(reader.root)
    if missing:
        raise BadInput(f"{where}: step {step}: no batch from context-parallel rank(s) {missing} of {cp}; "
                       "the sequence cannot be put back together")
    out: dict[str, np.ndarray] = {}
    for key in parts[0]:
        if key in SAMPLE_KEYS:      # one entry per sample, not per position: every CP rank holds all of them
            out[key] = parts[0][key]
            continue
        if any(key not in parts[r] for r in range(cp)):
            notes.append(f"step {step}: {key} recorded on some context-parallel ranks only; left out")
            continue
        try:
            out[key] = cp_join([parts[r][key] for r in range(cp)], seq_dim(key))
        except ValueError as exc:
            raise BadInput(f"{where}: step {step}: batch/{key}: {exc}") from None
    return out, files, notes, micro


def dp_batches(reader: Any, step: int, keys: Iterable[str] | None = None,
               groups: dict[int, list[tuple[int, dict[str, Any]]]] | None = None
               ) -> Iterable[tuple[int, dict[str, np.ndarray], list[Path], list[str], int]]:
    """(dp rank, batch, files, notes, micro-batches) of ``step`` for every DP rank with a file at that step, in DP rank
    order. ``groups``: :func:`data_groups` of the store's ranks, computed once by a caller that reads many
    steps."""
    keys = list(keys) if keys is not None else None
    present = set(reader.array_ranks(step))
    if groups is None:
        groups = data_groups(reader, sorted(present))
    for dp, members in sorted(groups.items()):
        members = [m for m in members if m[0] in present]
        if members:
            yield (dp, *join_group(reader, step, members, keys))


def global_batch(per_dp: Sequence[tuple[dict[str, np.ndarray], int]]) -> dict[str, np.ndarray]:
    """The step's global batch from the DP ranks' batches (in DP rank order, each with its micro-batch
    count): Megatron's sampler hands micro-batch m of DP rank d the samples at (m x DP + d) x mbs, so the
    global order is micro-batch major. Keys every DP rank holds; equal micro-batch counts are required."""
    if not per_dp:
        return {}
    counts = {m for _, m in per_dp}
    keys = set.intersection(*(set(b) for b, _ in per_dp))
    if len(counts) != 1:
        raise ValueError(f"DP ranks stacked different numbers of micro-batches {sorted(counts)}")
    micro = counts.pop()
    out = {}
    for key in sorted(keys):
        pieces = [np.split(np.asarray(b[key]), micro, axis=0) for b, _ in per_dp]
        out[key] = np.concatenate([p[m] for m in range(micro) for p in pieces], axis=0)
    return out


def sample_hashes(batch: dict[str, np.ndarray]) -> np.ndarray:
    """One 63-bit hash per sample (row) of tokens, labels and loss mask, whatever their dtypes (int32 ids and
    int64 ids, float32 and float64 masks hash alike), so two frameworks' records of one sample compare."""
    import hashlib

    tokens = batch.get("tokens", batch.get("input_ids"))
    if tokens is None:
        raise ValueError("no tokens (or input_ids) to hash")
    tokens = np.asarray(tokens)
    rows = tokens.shape[0] if tokens.ndim > 1 else 1
    parts = [tokens.reshape(rows, -1).astype(np.int64)]
    for key, dtype in (("labels", np.int64), ("loss_mask", np.float64)):
        if key in batch:
            parts.append(np.asarray(batch[key]).reshape(rows, -1).astype(dtype))
    out = np.empty(rows, np.int64)
    for i in range(rows):
        h = hashlib.blake2b(digest_size=8)
        for part in parts:
            h.update(np.ascontiguousarray(part[i]).tobytes())
        out[i] = int.from_bytes(h.digest(), "little") >> 1
    return out


def sampler_positions(global_size: int, dp: int, dp_rank: int, micro: int) -> np.ndarray:
    """The global batch positions DP rank ``dp_rank`` of ``dp`` trains, in order, when a step's ``global_size``
    samples are cut as Megatron's sampler cuts them into ``micro`` micro-batches per rank: micro-batch m of
    rank d holds samples (m x dp + d) x mbs .. + mbs (:func:`global_batch` is its inverse). ValueError when the
    sizes do not divide."""
    if dp < 1 or micro < 1 or not 0 <= dp_rank < dp:
        raise ValueError(f"data-parallel rank {dp_rank} of {dp} with {micro} micro-batches")
    if global_size % (dp * micro):
        raise ValueError(f"a global batch of {global_size} samples does not split into {dp} data-parallel ranks x "
                         f"{micro} micro-batches")
    mbs = global_size // (dp * micro)
    return np.concatenate([np.arange((m * dp + dp_rank) * mbs, (m * dp + dp_rank + 1) * mbs) for m in range(micro)])
