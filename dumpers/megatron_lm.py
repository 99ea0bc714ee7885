"""Megatron-LM's own training loop, dumped without editing a Megatron-LM file.

Why at ``train_step``: ``megatron/training/training.py``'s ``train()`` calls ``train_step(forward_step_func,
data_iterator, model, optimizer, ...)`` by its module-global name once per training iteration, in every
release from core 0.12 to current main, whether ``pretrain_gpt.py`` passes a ``model_provider`` (<= 0.17) or
builds the model from a config container inside ``pretrain()`` (>= 0.18). Replacing that name gives, with no
edit anywhere:

* the model chunks and the optimizer (chained / distributed included) as ``train_step`` receives them; the
  dumper is built at the first call and the grad-norm hook attached to that optimizer;
* each training iteration, numbered as Megatron logs it (``iteration + 1``); ``evaluate()`` calls the
  forward-backward function directly, never ``train_step``, so evaluation micro-batches are not recorded;
* the micro-batches as the data loader yields them (the training data iterator is wrapped for the span of
  the call; inside a ``RerunDataIterator`` its inner iterable is), full batches on every rank that reads
  data (TP rank 0 of the first and last stage), so a pipeline dump replays without assembling parts;
* the norms inside ``optimizer.step()`` (``get_grad_norm_fp32``), i.e. before the next ``train_step`` zeroes
  the grad buffers; the loss ``train_step`` returns, reduced exactly as Megatron logs it (``lm loss``;
  other keys of its loss dict, e.g. ``mtp loss``, as ``loss/<key>``).

Use (top of pretrain_gpt.py, before ``pretrain(...)`` runs)::

    from dumpers.megatron_lm import install
    install(out="runs/baseline", seed_layout=True)

or without touching the script: ``torchrun ... -m dumpers.megatron_lm --align-out runs/baseline
pretrain_gpt.py <Megatron arguments>``.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib
import runpy
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from dumpers.megatron import MegatronDumper
from dumpers.torch_dumper import DumpConfig

TARGET = "megatron.training.training"
_SCALAR_TYPES = (str, int, float, bool, type(None))


class _Recorder:
    """Iterator proxy: hands every item through unchanged and keeps a host copy of its tensors."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.items: list[dict[str, np.ndarray]] = []

    def __iter__(self) -> _Recorder:
        return self

    def __next__(self) -> Any:
        item = next(self._inner)
        with contextlib.suppress(Exception):  # recording must never disturb the data pipeline
            if isinstance(item, Mapping):
                self.items.append({str(k): v.detach().to("cpu", copy=True).numpy()
                                   for k, v in item.items() if isinstance(v, torch.Tensor)})
        return item

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _args_snapshot() -> dict[str, Any] | None:
    """Megatron-LM's parsed arguments (JSON-safe values only), when megatron.training is importable."""
    try:
        from megatron.training import get_args

        args = vars(get_args())
    except Exception:  # noqa: BLE001 - not running under Megatron-LM
        return None
    out: dict[str, Any] = {}
    for k, v in args.items():
        if isinstance(v, _SCALAR_TYPES):
            out[k] = v
        elif isinstance(v, (list, tuple)) and all(isinstance(x, _SCALAR_TYPES) for x in v):
            out[k] = list(v)
        elif isinstance(v, torch.dtype):
            out[k] = str(v).replace("torch.", "")
    return out


def _curr_iteration() -> int | None:
    try:
        from megatron.training import get_args

        return int(get_args().curr_iteration)
    except Exception:  # noqa: BLE001
        return None


def _to_float(v: Any) -> float | None:
    try:
        if isinstance(v, torch.Tensor):
            return float(v.detach().float().mean().item())
        return float(v)
    except Exception:  # noqa: BLE001
        return None


class MegatronLMIntegration:
    """Wraps ``train_step`` of Megatron-LM's training module; one dumper per process, built at the first step."""

    def __init__(self, config: DumpConfig, *, meta: Mapping[str, Any] | None = None,
                 module: ModuleType | str = TARGET) -> None:
        self.config = config
        self.meta = dict(meta or {})
        self.module = importlib.import_module(module) if isinstance(module, str) else module
        self.dumper: MegatronDumper | None = None
        self._original: Any = None
        self._last_step = 0

    def install(self) -> MegatronLMIntegration:
        """Replace ``module.train_step`` (idempotent)."""
        if self._original is None:
            self._original = self.module.train_step
            self.module.train_step = self._train_step
            atexit.register(self.close)
        return self

    def uninstall(self) -> None:
        if self._original is not None:
            self.module.train_step = self._original
            self._original = None

    def _ensure_dumper(self, model: Any, optimizer: Any) -> MegatronDumper:
        if self.dumper is None:
            meta = dict(self.meta)
            if "config" not in meta:
                snap = _args_snapshot()
                if snap is not None:
                    meta["config"] = {"kind": "megatron_args", "values": snap}
            chunks = list(model) if isinstance(model, (list, tuple)) else [model]
            self.dumper = MegatronDumper(chunks, optimizer, self.config, meta=meta)
        return self.dumper

    def _step_number(self, kwargs: Mapping[str, Any]) -> int:
        it = kwargs.get("iteration")
        if it is None:
            it = _curr_iteration()
        step = int(it) + 1 if it is not None else self._last_step + 1
        self._last_step = step
        return step

    def _train_step(self, forward_step_func: Any, data_iterator: Any, model: Any, optimizer: Any,
                    *args: Any, **kwargs: Any) -> Any:
        original = self._original
        try:
            dumper = self._ensure_dumper(model, optimizer)
            dumper.begin_step(self._step_number(kwargs))
            wrapped, recorders, restore = self._wrap_iterators(data_iterator)
        except Exception as exc:  # noqa: BLE001 - the training step runs regardless
            if self.dumper is not None:
                self.dumper._fail("megatron_lm.train_step (before)", exc)
            return original(forward_step_func, data_iterator, model, optimizer, *args, **kwargs)
        try:
            result = original(forward_step_func, wrapped, model, optimizer, *args, **kwargs)
        finally:
            for undo in restore:
                with contextlib.suppress(Exception):
                    undo()
        try:
            self._finish(dumper, recorders, result)
        except Exception as exc:  # noqa: BLE001
            dumper._fail("megatron_lm.train_step (after)", exc)
        return result

    @staticmethod
    def _wrap_iterators(data_iterator: Any) -> tuple[Any, list[_Recorder], list[Any]]:
        recorders: list[_Recorder] = []
        restore: list[Any] = []

        def wrap(it: Any) -> Any:
            if it is None:
                return None
            if type(it).__name__ == "RerunDataIterator" and hasattr(it, "iterable"):
                rec = _Recorder(it.iterable)
                inner, it.iterable = it.iterable, rec
                restore.append(lambda it=it, inner=inner: setattr(it, "iterable", inner))
                recorders.append(rec)
                return it
            rec = _Recorder(it)
            recorders.append(rec)
            return rec

        if isinstance(data_iterator, list):
            return [wrap(d) for d in data_iterator], recorders, restore
        return wrap(data_iterator), recorders, restore

    @staticmethod
    def _finish(dumper: MegatronDumper, recorders: Sequence[_Recorder], result: Any) -> None:
        # Virtual-pipeline chunks read the same micro-batches from their own iterators: keep the fullest.
        best = max(recorders, key=lambda r: len(r.items), default=None)
        if best is not None:
            for item in best.items:
                dumper.record_batch(item)
        losses = result[0] if isinstance(result, tuple) and result and isinstance(result[0], Mapping) else {}
        scalars: dict[str, Any] = {}
        for key, value in losses.items():
            v = _to_float(value)
            if v is None:
                continue
            scalars["loss" if key == "lm loss" else f"loss/{str(key).replace(' ', '_')}"] = v
        if isinstance(result, tuple) and len(result) >= 2:
            skipped = _to_float(result[1])
            if skipped is not None:
                scalars["skipped_iterations"] = skipped
        dumper.end_step(**scalars)

    def close(self) -> None:
        """End the open step and close the store (registered with atexit)."""
        if self.dumper is not None:
            self.dumper.close()


def install(config: DumpConfig | None = None, *, module: ModuleType | str = TARGET,
            meta: Mapping[str, Any] | None = None, **dump_kwargs: Any) -> MegatronLMIntegration:
    """Dump every training iteration of Megatron-LM's ``train()`` into a run store.

    ``config`` or DumpConfig keyword arguments (``out=...``, ``steps=...``, ``tensors=...``). ``module``: the
    module whose ``train_step`` is wrapped (Megatron-LM's ``megatron.training.training``).
    """
    cfg = config if config is not None else DumpConfig(**dump_kwargs)
    return MegatronLMIntegration(cfg, meta=meta, module=module).install()


_VALUED = ("--align-out", "--align-steps", "--align-tensors", "--align-module", "--align-capture-data")


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m dumpers.megatron_lm --align-out DIR [--align-steps S] script.py ARGS``: run the script
    with the integration installed; everything from the script on goes to it untouched."""
    argv = list(sys.argv[1:] if argv is None else argv)
    i = 0
    while i < len(argv) and argv[i].startswith("--align"):
        i += 1 if "=" in argv[i] or argv[i] not in _VALUED else 2
    ap = argparse.ArgumentParser(prog="python -m dumpers.megatron_lm")
    ap.add_argument("--align-out", required=True, help="run-store directory")
    ap.add_argument("--align-steps", default=None, help="steps with array files, e.g. 1-3,100 (default all)")
    ap.add_argument("--align-tensors", default="off", choices=("off", "stats", "full"))
    ap.add_argument("--align-seed-layout", action="store_true")
    ap.add_argument("--align-capture-env", action="store_true",
                    help="record the cluster capture (environment, versions, settings, generators, weights) in "
                         "meta.json")
    ap.add_argument("--align-capture-data", action="append", default=[], metavar="PATH",
                    help="a dataset file or folder the capture hashes (repeat)")
    ap.add_argument("--align-module", default=TARGET,
                    help=f"module whose train_step is wrapped (default {TARGET})")
    ns = ap.parse_args(argv[:i])
    if i >= len(argv):
        ap.error("the training script to run is missing")
    sys.path.insert(0, str(Path(argv[i]).resolve().parent))  # as `python script.py` would
    try:
        module = importlib.import_module(ns.align_module)
    except ImportError as exc:
        print(f"dumpers.megatron_lm: cannot import {ns.align_module} ({exc}); run from a Megatron-LM checkout "
              "or put it on PYTHONPATH", file=sys.stderr)
        raise SystemExit(2) from None
    capture = ns.align_capture_env or bool(ns.align_capture_data)
    install(DumpConfig(out=ns.align_out, steps=ns.align_steps, tensors=ns.align_tensors,
                       seed_layout=ns.align_seed_layout, capture_env=capture,
                       capture_env_data=ns.align_capture_data), module=module)
    sys.argv = list(argv[i:])
    runpy.run_path(argv[i], run_name="__main__")


if __name__ == "__main__":
    main()
