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

The rank is MindSpore's ``get_rank()`` when communication is up (msrun), else ``RANK_ID`` / ``RANK``.

or from Python: ``MegatronReplayDataset(data_dir=..., rank=0)`` returns a ``mindspore.dataset`` whose
rows are whole step batches (the batch dimension is the Megatron micro-batch).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from core.errors import BadInput
from runstore import STEP_DIR, RunReader, read_seed_batch, seed_steps
from runstore.batches import join_group, seq_dim

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
                 steps: Sequence[int] | None = None, columns: Sequence[str] = DEFAULT_COLUMNS) -> None:
        self.root = Path(data_dir)
        self.rank = current_rank() if rank is None else int(rank)
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
        self._shapes: dict[str, tuple[int, ...]] | None = None

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

    def _stored_shapes(self, step: int, names: Sequence[str]) -> dict[str, tuple[int, ...]]:
        where = self._rank_path(step)
        out: dict[str, tuple[int, ...]] = {}
        if self.layout == "runstore":
            import h5py

            for rank in self._batch_ranks():
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
            cp = self._reader.rank_info(self.rank).get("cp", 1)
            if isinstance(cp, int) and cp > 1:   # the CP ranks' chunks join into the whole sequence
                out = {k: tuple(n * cp if i == seq_dim(k) else n for i, n in enumerate(v)) for k, v in out.items()}
            return out
        for name in names:
            path = where / f"{name}.npy"
            if not path.is_file():
                raise BadInput(f"{path}: missing")
            out[name] = _npy_shape(path)
        return out

    def __len__(self) -> int:
        return len(self.steps)

    def raw_batch(self, step: int) -> dict[str, np.ndarray]:
        """The Megatron arrays of ``step`` for this rank, as stored (no casting)."""
        names = [COLUMN_SOURCES[c] for c in self.columns]
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
            source = ReplaySource(data_dir, rank=rank, steps=steps, columns=columns)
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
