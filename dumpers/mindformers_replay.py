"""Replay Megatron's per-step batches inside MindFormers, registered from outside the package.

Why: the candidate run must see exactly the tokens the baseline saw, step by step. Megatron batches are
already shifted (``tokens[t]`` predicts ``labels[t]``), so the model must be built with
``input_sliced_sig=True`` (no second slice) and the loss mask passed through as ``loss_mask``.

Two sources are read, both without pickle:

* a run store (``RUN/steps/step_N/rank_R.h5`` with ``batch/tokens``, ``batch/labels``, ...); under pipeline
  parallelism a stage holds only its part of the batch (tokens / position ids on the first stage, labels /
  loss mask on the last), so a missing array is taken from the ranks of the same DP rank (other stages,
  other TP ranks) that recorded it; under context parallelism the CP ranks' zig-zag chunks are joined into
  the whole sequence (``runstore.batches``);
* the seed layout ``ROOT/step_N/rank_R/{tokens,labels,loss_mask,attention_mask}.npy``.

Use from a MindFormers YAML, launched as users do (``run_mindformer.py --config X.yaml --register_path
/path/to/xf-align/demo/mindformers_register`` with the checkout on PYTHONPATH, under msrun or not):
``auto_register`` loads and registers the class, no Python glue (docs/mindformers-launch.md)::

    train_dataset_task:
      type: MegatronReplayDataset
      auto_register: xf_align.MegatronReplayDataset
      dataset_config:
        data_dir: /path/to/run_or_seed_root
        construct_args_key: [input_ids, labels, loss_mask]

Which samples a rank replays. Under msrun (communication up) or with ``data_parallel`` in the dataset
config, the baseline step's global batch (every DP rank's micro-batches in Megatron's sampler order,
``runstore.batches.global_batch``) is re-split by sample for the candidate's data-parallel size and
micro-batch count, as Megatron's sampler would cut it for that layout: micro-batch m of candidate DP rank d
holds samples (m x DP + d) x mbs .. + mbs. So a DP=1 baseline replays on a DP=2 candidate and a DP=8 one on
DP=4 (any DP that divides the global batch). The candidate's DP rank and size are MindFormers' own dataset
shard (``BaseDataset._generate_shard_info``: the DP rank under semi-auto parallel, the whole global batch
under ``full_batch``); ``data_parallel`` / ``dp_rank`` / ``micro_batches`` in ``dataset_config`` override
them. ``micro_batches`` defaults to the count that keeps the baseline's micro-batch size (else 1). Each step's
plan (the baseline step and global position of every row, and a hash of each sample as read) is kept for
:class:`dumpers.mindformers.MindFormersDumperCallback`, which records it beside the batch the network got, so
the data stage proves every sample arrived once, in order (:func:`replayed_samples`).

One process without communication and without ``data_parallel`` replays one baseline rank as stored (the
debug path): ``rank`` (or ``RANK_ID`` / ``RANK``), its micro-batches, its TP / pipeline / CP parts joined.

or from Python: ``MegatronReplayDataset(data_dir=..., rank=0)`` returns a ``mindspore.dataset`` whose
rows are whole step batches (the batch dimension is the Megatron micro-batch).
"""

from __future__ import annotations

import os
import re
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from core.errors import BadInput
from runstore import STEP_DIR, RunReader, read_seed_batch, seed_steps
from runstore.batches import (
    data_groups,
    dp_batches,
    global_batch,
    join_group,
    sample_hashes,
    sampler_positions,
    seq_dim,
)

# MindFormers column name -> Megatron batch name.
COLUMN_SOURCES = {
    "input_ids": "tokens",
    "labels": "labels",
    "loss_mask": "loss_mask",
    "attention_mask": "attention_mask",
    "position_ids": "position_ids",
}
DEFAULT_COLUMNS = ("input_ids", "labels", "loss_mask")
_COLUMN_DTYPES = {"input_ids": np.int32, "labels": np.int32, "loss_mask": np.float32,
                  "attention_mask": np.uint8, "position_ids": np.int32}
_STEP_RE = re.compile(r"^step_(\d+)$")

# The plans of the replay running in this process: replayed step -> per-row arrays (sample_step, sample_index,
# replay_hash), and the replayed steps in training order. Written by the dataset's generator, read by the dumper
# callback at the training step that consumed the row.
_PLANS: OrderedDict[int, dict[str, np.ndarray]] = OrderedDict()
_ORDER: list[int] = []
_LOCK = threading.Lock()
_KEEP = 64     # plans kept: the data pipeline prefetches a few rows ahead of training, never this many


def replayed_samples(train_step: int) -> dict[str, np.ndarray] | None:
    """What the replay in this process fed at training step ``train_step`` (from 1; the replayed steps in order,
    cycled when repeated): ``sample_step`` (the baseline step), ``sample_index`` (each row's position in that
    step's global batch) and ``replay_hash`` (each sample's hash as read from the baseline). None: no re-split
    replay runs here, or that row was not produced."""
    with _LOCK:
        if not _ORDER or train_step < 1:
            return None
        return _PLANS.get(_ORDER[(train_step - 1) % len(_ORDER)])


def data_shard() -> tuple[int, int] | None:
    """(DP rank, DP size) of this process's dataset shard, as MindFormers' own datasets take it, once
    communication is up; (0, 1) when every rank loads the whole global batch (semi-auto ``full_batch``); None
    without communication."""
    from dumpers.mindspore_dumper import mindspore_rank

    rank = mindspore_rank()
    if rank is None:
        return None
    try:
        from mindformers.dataset.base_dataset import BaseDataset

        shard, num = BaseDataset._generate_shard_info()
    except Exception:  # noqa: BLE001 - another MindFormers: plain data parallel over the world
        from mindspore.communication import get_group_size

        shard, num = rank, get_group_size()
    if shard is None or num is None:
        return 0, 1
    return int(shard), int(num)


def current_rank() -> int:
    """This process's rank: MindSpore's get_rank() once communication is initialised (msrun, use_parallel),
    else the RANK_ID msrun / MindFormers launchers set, else torchrun's RANK, else 0."""
    from dumpers.mindspore_dumper import mindspore_rank

    rank = mindspore_rank()
    if rank is not None:
        return rank
    for var in ("RANK_ID", "RANK"):
        value = os.environ.get(var)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise BadInput(f"{var}={value!r}: not an integer rank") from None
    return 0


class ReplaySource:
    """Reads one rank's Megatron batches in step order and checks them before MindFormers sees them.

    Every problem is a one-line :class:`BadInput` naming the file: a step missing from the sequence, a
    rank folder absent, a pickled ``.npy``, shapes that disagree within a step or across steps.
    """

    def __init__(self, data_dir: str | os.PathLike, *, rank: int | None = None,
                 steps: Sequence[int] | None = None, columns: Sequence[str] = DEFAULT_COLUMNS,
                 data_parallel: int | None = None, dp_rank: int | None = None,
                 micro_batches: int | None = None) -> None:
        self.root = Path(data_dir)
        self.rank = current_rank() if rank is None else int(rank)
        self.split = self._layout(data_parallel, dp_rank, micro_batches)
        unknown = [c for c in columns if c not in COLUMN_SOURCES]
        if unknown:
            raise BadInput(f"unknown replay column(s) {unknown}; known: {sorted(COLUMN_SOURCES)}")
        self.columns = tuple(columns)
        if not self.root.is_dir():
            raise BadInput(f"{self.root}: batch dump directory does not exist")
        self.layout = "runstore" if (self.root / STEP_DIR).is_dir() else "seed"
        if self.layout == "runstore":
            self._reader: RunReader | None = RunReader(self.root)
            available = {s: set(self._reader.array_ranks(s)) for s in self._reader.array_steps()}
        else:
            self._reader = None
            available = {s: set(per) for s, per in seed_steps(self.root).items()}
        if not available:
            raise BadInput(f"{self.root}: no step_N folders with batches (neither run store nor seed layout)")
        self.steps = self._check_steps(available, steps)
        self._peers: list[int] | None = None
        self._groups: dict[int, list[tuple[int, dict[str, Any]]]] | None = None
        self._shapes: dict[str, tuple[int, ...]] | None = None
        if self.split is not None:
            with _LOCK:
                _PLANS.clear()
                _ORDER[:] = self.steps

    def _layout(self, data_parallel: Any, dp_rank: Any, micro: Any) -> tuple[int, int, int | None] | None:
        """(candidate DP size, its DP rank, micro-batches or None for the default) of a re-split replay; None:
        replay one baseline rank as stored."""
        def count(name: str, value: Any, low: int) -> int | None:
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).isdigit() \
                    or int(value) < low:
                raise BadInput(f"MegatronReplayDataset: {name}={value!r}: not an integer >= {low}")
            return int(value)

        dp, rank, micro = count("data_parallel", data_parallel, 1), count("dp_rank", dp_rank, 0), \
            count("micro_batches", micro, 1)
        shard = data_shard() if dp is None or rank is None else None
        if dp is None:
            if shard is None:
                return None
            dp = shard[1]
        if rank is None:
            rank = shard[0] if shard is not None and shard[1] == dp else self.rank
        if rank >= dp:
            raise BadInput(f"MegatronReplayDataset: data-parallel rank {rank} is not below data_parallel {dp}")
        return dp, rank, micro

    def _check_steps(self, available: Mapping[int, set[int]], wanted: Sequence[int] | None) -> list[int]:
        found = sorted(available)
        if wanted is None:
            wanted = list(range(found[0], found[-1] + 1))
            gaps = [s for s in wanted if s not in available]
            if gaps:
                raise BadInput(f"{self.root}: step {gaps[0]} missing from the batch dump "
                               f"(have steps {found[0]}..{found[-1]} with {len(gaps)} gap(s))")
        else:
            wanted = [int(s) for s in wanted]
            for s in wanted:
                if s not in available:
                    raise BadInput(f"{self._step_path(s)}: step {s} missing from the batch dump")
        if self.split is not None:   # every baseline DP rank's part of the global batch must be there
            ranks = set().union(*available.values())
            for s in wanted:
                if available[s] != ranks:
                    missing = sorted(ranks - available[s])
                    raise BadInput(f"{self._step_path(s)}: rank(s) {missing[:8]} missing from step {s}: the global "
                                   "batch a re-split replay cuts is incomplete")
            return list(wanted)
        for s in wanted:
            if self.rank not in available[s]:
                raise BadInput(f"{self._rank_path(s)}: rank {self.rank} missing from step {s} "
                               f"(ranks present: {sorted(available[s])})")
        return list(wanted)

    def _step_path(self, step: int) -> Path:
        if self.layout == "runstore":
            return self.root / STEP_DIR / f"step_{step:08d}"
        return self.root / f"step_{step}"

    def _rank_path(self, step: int) -> Path:
        if self.layout == "runstore":
            return self._step_path(step) / f"rank_{self.rank:05d}.h5"
        return self._step_path(step) / f"rank_{self.rank}"

    def check_all(self) -> None:
        """Check every step's files and shapes now, from headers only (cheap), so errors surface before
        training starts, as one line, instead of inside a data-pipeline worker at step N."""
        names = [COLUMN_SOURCES[c] for c in self.columns]
        if self.split is not None:
            self._check_split(names)
            return
        first: dict[str, tuple[int, ...]] | None = None
        first_step = self.steps[0]
        for step in self.steps:
            where = self._rank_path(step)
            shapes = self._stored_shapes(step, names)
            ref = shapes.get("tokens") or next(iter(shapes.values()))
            for name, shape in shapes.items():
                if name in ("attention_mask",):
                    continue
                if shape != ref:
                    raise BadInput(f"{where}: {name} shape {shape} does not match tokens {ref}")
            if first is None:
                first = shapes
            else:
                for name, shape in shapes.items():
                    if shape != first[name]:
                        col = next(c for c in self.columns if COLUMN_SOURCES[c] == name)
                        raise BadInput(f"{where}: {col} shape {shape} differs from step {first_step}'s "
                                       f"{first[name]} (MindFormers needs one static shape)")

    def _check_split(self, names: Sequence[str]) -> None:
        """Every step's global batch (header shapes of one rank per baseline DP rank) splits over the
        candidate's DP ranks and micro-batches, with one sequence length."""
        dp, _, micro = self.split  # type: ignore[misc]
        first: tuple[int, int] | None = None
        for step in self.steps:
            rows, seq = 0, None
            for members in self._dp_members(step):
                shapes = self._stored_shapes(step, names, [r for r, _ in members])
                shape = shapes.get("tokens") or next(iter(shapes.values()))
                rows += shape[0]
                seq = shape[1] if len(shape) > 1 else None
            where = self._step_path(step)
            if rows % (dp * (micro or 1)):
                raise BadInput(f"{where}: the global batch of {rows} samples does not split into data_parallel {dp}"
                               + (f" x {micro} micro-batches" if micro else "") + " (any DP that divides it does)")
            if first is None:
                first = (rows, seq)
            elif (rows, seq) != first:
                raise BadInput(f"{where}: global batch {rows} x {seq} differs from step {self.steps[0]}'s "
                               f"{first[0]} x {first[1]} (MindFormers needs one static shape)")

    def _dp_members(self, step: int) -> list[list[tuple[int, dict[str, Any]]]]:
        """The baseline's ranks of ``step`` grouped by DP rank, in DP rank order (a seed layout's rank_R
        folder is DP rank R)."""
        if self._reader is None:
            return [[(r, {})] for r in sorted(seed_steps(self.root)[step])]
        if self._groups is None:
            self._groups = data_groups(self._reader, self._reader.ranks)
        present = set(self._reader.array_ranks(step))
        return [[m for m in members if m[0] in present] for _, members in sorted(self._groups.items())]

    def _global_batch(self, step: int, names: Sequence[str]) -> tuple[dict[str, np.ndarray], int]:
        """The step's global batch in Megatron's sampler order, and the baseline's micro-batch size."""
        members = self._dp_members(step)       # (also groups a run store's ranks once)
        if self._reader is None:
            per_dp = [(read_seed_batch(self.root, step, r, keys=names), 1) for [(r, _)] in members]
        else:
            per_dp = [(b, m) for _, b, _, _, m in dp_batches(self._reader, step, names, self._groups)]
        shared = {k: v for k, v in per_dp[0][0].items() if k == "attention_mask" and v.shape[0] == 1}
        per_dp = [({k: v for k, v in b.items() if k not in shared}, m) for b, m in per_dp]   # one mask for all rows
        try:
            out = {**global_batch(per_dp), **shared}
        except ValueError as exc:
            raise BadInput(f"{self._step_path(step)}: {exc}; the global batch cannot be put in sampler order") from None
        for name in names:
            if name not in out:
                raise BadInput(f"{self._step_path(step)}: no batch/{name} array on every DP rank")
        first, micro = per_dp[0]
        return out, max(1, next(iter(first.values())).shape[0] // micro)

    def _resplit(self, step: int, names: Sequence[str]) -> dict[str, np.ndarray]:
        """This candidate DP rank's rows of the step's global batch, and its plan kept for the dumper."""
        dp, rank, micro = self.split  # type: ignore[misc]
        whole, mbs = self._global_batch(step, names)
        rows = next(iter(whole.values())).shape[0]
        if micro is None:     # keep the baseline's micro-batch size where the layout allows it
            micro = rows // (dp * mbs) if rows % (dp * mbs) == 0 else 1
        try:
            index = sampler_positions(rows, dp, rank, micro)
        except ValueError as exc:
            raise BadInput(f"{self._step_path(step)}: {exc}") from None
        out = {k: (v[index] if v.shape[0] == rows else v) for k, v in whole.items()}
        hashes = sample_hashes(out) if "tokens" in out else np.zeros(len(index), np.int64)
        with _LOCK:
            _PLANS[step] = {"sample_step": np.full(len(index), step, np.int64), "sample_index": index.astype(np.int64),
                            "replay_hash": hashes}
            _PLANS.move_to_end(step)
            while len(_PLANS) > _KEEP:
                _PLANS.popitem(last=False)
        return out

    def _batch_ranks(self) -> list[int]:
        """This rank, then the ranks of the same DP rank (other pipeline stages / TP ranks) of a run store."""
        if self._reader is None:
            return [self.rank]
        if self._peers is None:
            info = self._reader.rank_info(self.rank)
            dp = info.get("dp_rank")
            peers = []
            if dp is not None:
                for r in self._reader.ranks:
                    other = self._reader.rank_info(r)
                    if r != self.rank and other.get("dp_rank") == dp:
                        peers.append((int(other.get("pp_rank", 0) or 0), int(other.get("tp_rank", 0) or 0), r))
            self._peers = [self.rank] + [r for *_, r in sorted(peers)]
        return self._peers

    def _stored_shapes(self, step: int, names: Sequence[str],
                       ranks: Sequence[int] | None = None) -> dict[str, tuple[int, ...]]:
        where = self._rank_path(step) if ranks is None else self._step_path(step)
        out: dict[str, tuple[int, ...]] = {}
        if self.layout == "runstore":
            import h5py

            for rank in (self._batch_ranks() if ranks is None else ranks):
                path = self.root / STEP_DIR / f"step_{step:08d}" / f"rank_{rank:05d}.h5"
                if not path.is_file():
                    continue
                try:
                    with h5py.File(path, "r") as h5:
                        for name in names:
                            key = f"batch/{name}"
                            if name not in out and key in h5:
                                out[name] = tuple(h5[key].shape)
                except OSError as exc:
                    raise BadInput(f"{path}: not a readable HDF5 file ({exc})") from None
            for name in names:
                if name not in out:
                    raise BadInput(f"{where}: no batch/{name} array (the dump lacks '{name}')")
            cp = self._reader.rank_info(self.rank if ranks is None else ranks[0]).get("cp", 1)
            if isinstance(cp, int) and cp > 1:   # the CP ranks' chunks join into the whole sequence
                out = {k: tuple(n * cp if i == seq_dim(k) else n for i, n in enumerate(v)) for k, v in out.items()}
            return out
        folder = where if ranks is None else self._step_path(step) / f"rank_{ranks[0]}"
        for name in names:
            path = folder / f"{name}.npy"
            if not path.is_file():
                raise BadInput(f"{path}: missing")
            out[name] = _npy_shape(path)
        return out

    def __len__(self) -> int:
        return len(self.steps)

    def raw_batch(self, step: int) -> dict[str, np.ndarray]:
        """The Megatron arrays of ``step`` for this rank, as stored (no casting)."""
        names = [COLUMN_SOURCES[c] for c in self.columns]
        if self.split is not None:
            return self._resplit(step, names)
        if self._reader is not None:
            # this DP rank's batch: other stages' parts, TP copies, CP chunks joined (runstore.batches)
            present = set(self._reader.array_ranks(step))
            members = [(r, self._reader.rank_info(r)) for r in self._batch_ranks() if r in present]
            out, _, _, _ = join_group(self._reader, step, members, names)
            for name in names:
                if name not in out:
                    raise BadInput(f"{self._rank_path(step)}: no batch/{name} array (the dump lacks '{name}')")
            return out
        folder = self._rank_path(step)
        if not (folder.parent).is_dir():
            raise BadInput(f"{folder.parent}: step {step} missing from the batch dump")
        if not folder.is_dir():
            raise BadInput(f"{folder}: rank {self.rank} missing from step {step}")
        return read_seed_batch(self.root, step, self.rank, keys=names)

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """One step as MindFormers columns, shape-checked and cast to the dtypes the model expects."""
        raw = self.raw_batch(step)
        where = self._rank_path(step)
        tokens = raw.get("tokens")
        ref_shape = tokens.shape if tokens is not None else next(iter(raw.values())).shape[:2]
        if tokens is not None and tokens.ndim != 2:
            raise BadInput(f"{where}: tokens must be 2-D [batch, seq], got shape {tokens.shape}")
        out: dict[str, np.ndarray] = {}
        for col in self.columns:
            name = COLUMN_SOURCES[col]
            arr = raw[name]
            if arr.dtype.kind not in "biuf":
                raise BadInput(f"{where}: {name} has dtype {arr.dtype}, expected numbers")
            if name == "attention_mask":
                arr = self._attention_mask(arr, ref_shape, where)
            elif arr.shape != tuple(ref_shape):
                raise BadInput(f"{where}: {name} shape {arr.shape} does not match tokens {tuple(ref_shape)}")
            out[col] = np.ascontiguousarray(arr.astype(_COLUMN_DTYPES[col], copy=False))
        shapes = {k: v.shape for k, v in out.items()}
        if self._shapes is None:
            self._shapes = shapes
        elif shapes != self._shapes:
            first = self.steps[0]
            diff = next(k for k in shapes if shapes[k] != self._shapes[k])
            raise BadInput(f"{where}: {diff} shape {shapes[diff]} differs from step {first}'s "
                           f"{self._shapes[diff]} (MindFormers needs one static shape)")
        return out

    @staticmethod
    def _attention_mask(arr: np.ndarray, ref_shape: tuple[int, ...], where: Path) -> np.ndarray:
        """Megatron's mask is [b|1, 1, s, s], True = masked: the same convention as MindFormers Llama."""
        b, s = ref_shape
        if arr.ndim == 3:
            arr = arr[:, None]
        if arr.ndim != 4 or arr.shape[1:] != (1, s, s) or arr.shape[0] not in (1, b):
            raise BadInput(f"{where}: attention_mask shape {arr.shape} does not fit tokens {(b, s)} "
                           f"(expected [{b} or 1, 1, {s}, {s}])")
        if arr.shape[0] != b:
            arr = np.broadcast_to(arr, (b, 1, s, s))
        return arr

    def __iter__(self) -> Iterator[tuple[np.ndarray, ...]]:
        for step in self.steps:
            batch = self.batch(step)
            yield tuple(batch[c] for c in self.columns)

    def __getitem__(self, index: int) -> tuple[np.ndarray, ...]:
        batch = self.batch(self.steps[index])
        return tuple(batch[c] for c in self.columns)


def _npy_shape(path: Path) -> tuple[int, ...]:
    """Shape from the .npy header alone; a pickled (object) array is refused here, without loading it."""
    try:
        with open(path, "rb") as fh:
            version = np.lib.format.read_magic(fh)
            read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                    else np.lib.format.read_array_header_2_0)
            shape, _, dtype = read(fh)
    except (ValueError, OSError, EOFError) as exc:
        raise BadInput(f"{path}: not a valid .npy array ({exc})") from None
    if dtype.hasobject:
        raise BadInput(f"{path}: holds pickled objects; refusing to load (no pickle)")
    return tuple(shape)


def _register() -> type:
    """Register :class:`MegatronReplayDataset` in MindFormers' class-level registry (no package edits)."""
    import mindspore.dataset as ds
    from mindformers.tools.register import MindFormerModuleType, MindFormerRegister

    if MindFormerRegister.is_exist(MindFormerModuleType.DATASET, "MegatronReplayDataset"):
        return MindFormerRegister.get_cls(MindFormerModuleType.DATASET, "MegatronReplayDataset")

    @MindFormerRegister.register(MindFormerModuleType.DATASET)
    class MegatronReplayDataset:
        """A MindFormers dataset of Megatron step batches; each row is one whole step for this rank.

        ``__new__`` returns a ``mindspore.dataset.GeneratorDataset`` (like MindFormers' own dataset
        classes), so ``build_dataset`` and the Trainer use it unchanged. Rows come out in step order,
        never shuffled, never re-batched: one dataset row is one optimizer step.
        """

        def __new__(cls, dataset_config: Mapping[str, Any] | None = None, data_dir: str | None = None,
                    rank: int | None = None, steps: Sequence[int] | None = None,
                    columns: Sequence[str] | None = None, repeat: int = 1, **kwargs: Any) -> Any:
            cfg = dict(dataset_config or {})
            data_dir = cfg.get("data_dir", data_dir)
            if data_dir is None:
                loader = cfg.get("data_loader") or {}
                data_dir = loader.get("dataset_dir") if isinstance(loader, Mapping) else None
            if not data_dir:
                raise BadInput("MegatronReplayDataset: data_dir is not set (dataset_config.data_dir)")
            rank = cfg.get("rank", rank)
            steps = cfg.get("steps", steps)
            columns = cfg.get("columns") or columns or cfg.get("construct_args_key") or DEFAULT_COLUMNS
            split = {k: cfg.get(k, kwargs.get(k)) for k in ("data_parallel", "dp_rank", "micro_batches")}
            source = ReplaySource(data_dir, rank=rank, steps=steps, columns=columns, **split)
            source.check_all()  # fail now, with a clear message, not inside a data worker
            source.batch(source.steps[0])
            dataset = ds.GeneratorDataset(source, column_names=list(source.columns), shuffle=False,
                                          num_parallel_workers=1, python_multiprocessing=False)
            repeat = int(cfg.get("repeat", repeat) or 1)
            if repeat > 1:
                dataset = dataset.repeat(repeat)
            return dataset

    return MegatronReplayDataset


MegatronReplayDataset = _register()
