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
  other keys of its loss dict, e.g. ``mtp loss``, as ``loss/<key>``);
* right after ``train_step`` returns, what ``train()`` hands to ``training_log`` next (read, never changed):
  the learning rate as Megatron logs it (``lr``: core >= 0.16 the first ``default_config`` param group's,
  before that the last group that is not ``is_decoupled_lr``), every group's (``lr/group_N``) and the
  decoupled one (``decoupled_lr``); the loss scale (``loss_scale``, ``optimizer.get_loss_scale()``); and the
  auxiliary losses before ``training_log`` reduces and clears their trackers: the MoE router's
  (``load_balancing_loss``, ``seq_load_balancing_loss``, ``global_load_balancing_loss``, ``z_loss``) and
  the MTP layers' (``mtp_K_loss`` per layer as Megatron logs ``mtp_K loss``, their sum as ``mtp_loss``),
  each reduced and averaged over micro-batches and MoE layers the way ``training_log`` does, with
  Megatron's own reduction function run on copies of the tracker values.

A ``train_step`` that raises is not stored: its step file stays unfinished (the reader lists it as
incomplete), ``meta.json`` records ``aborted`` (step, rank, exception type and message), and the exception
goes on to Megatron unchanged.

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
import json
import runpy
import sys
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from dumpers.megatron import MegatronDumper
from dumpers.torch_dumper import DumpConfig
from runstore import RANK_DIR, atomic_write_json
from runstore.batches import seq_dim

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


def learning_rates(param_groups: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The learning rates ``train()`` passes to ``training_log``, from the optimizer's param groups.

    ``lr``: what Megatron logs as ``learning rate``: from core 0.16 the first group marked
    ``default_config`` (``get_canonical_lr_for_logging``), before that the last group that is not
    ``is_decoupled_lr`` (the loop in ``train()``); ``decoupled_lr``: the last ``is_decoupled_lr`` group's;
    ``lr/group_N``: every group's, in the optimizer's order (a chained optimizer's groups concatenated).
    """
    out: dict[str, float] = {}
    logged = decoupled = None
    canonical = any("default_config" in g for g in param_groups)
    for i, group in enumerate(param_groups):
        lr = _to_float(group.get("lr"))
        if lr is None:
            continue
        out[f"lr/group_{i}"] = lr
        if group.get("is_decoupled_lr", False):
            decoupled = lr
        elif canonical:
            if logged is None and group.get("default_config", False):
                logged = lr
        else:
            logged = lr
    if logged is not None:
        out["lr"] = logged
    if decoupled is not None:
        out["decoupled_lr"] = decoupled
    return out


def loss_scale(optimizer: Any) -> float | None:
    """``optimizer.get_loss_scale()`` as ``train()`` reads it for its log (1.0 for a stub optimizer)."""
    if optimizer is None:
        return None
    if getattr(optimizer, "is_stub_optimizer", False):
        return 1.0
    return _to_float(optimizer.get_loss_scale())


_MOE_LOSSES = (("aux_loss", "load_balancing_loss"), ("seq_aux_loss", "seq_load_balancing_loss"),
               ("global_aux_loss", "global_load_balancing_loss"))


def moe_track_names(cfg: Any) -> list[str]:
    """The router losses ``training_log`` reduces, chosen as it chooses them (from the same settings, which
    the model's TransformerConfig carries): every rank gets the same list, so the reductions match up."""
    if not getattr(cfg, "num_moe_experts", None):
        return []
    balance = getattr(cfg, "moe_router_load_balancing_type", None) or ""
    names = [name for key, name in _MOE_LOSSES if key in balance]
    if getattr(cfg, "moe_z_loss_coeff", None) is not None:
        names.append("z_loss")
    return names


def num_moe_layers(cfg: Any, *, mtp_if_last_is_moe: bool) -> int:
    """The divisor of ``training_log``'s MoE average: MoE layers by ``moe_layer_freq``, plus the MTP layers
    (core <= 0.17: always; later: only when the last decoder layer is MoE, one when the MTP layer repeats)."""
    n = int(cfg.num_layers)
    freq = getattr(cfg, "moe_layer_freq", 1)
    if freq is None:
        pattern = [1] * n
    elif isinstance(freq, int):
        pattern = [1 if i % freq == 0 else 0 for i in range(n)]
    else:
        pattern = [int(x) for x in freq]
    mtp = getattr(cfg, "mtp_num_layers", None)
    if not mtp_if_last_is_moe:
        return sum(pattern) + (mtp or 0)
    extra = (1 if getattr(cfg, "mtp_use_repeated_layer", False) else mtp) if mtp and pattern[-1] else 0
    return sum(pattern) + int(extra or 0)


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _moe_values(names: Sequence[str], cfg: Any) -> tuple[dict[str, torch.Tensor], bool]:
    """Per-layer router losses of this iteration, reduced across ranks by Megatron's own function run on
    copies (the trackers themselves stay as they are for ``training_log``); True for core >= 0.18's tracker."""
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:
        get_moe_metrics_tracker = None
    if get_moe_metrics_tracker is not None:   # core >= 0.18: MoEMetricsTracker
        tracker = get_moe_metrics_tracker()
        layers = int(cfg.num_layers) + int(getattr(cfg, "mtp_num_layers", None) or 0)
        for name in names:   # what training_log's report(force_initialize=True) does next anyway
            tracker.ensure_initialized(name, layers)
        metrics = tracker._metrics
        saved = {name: metrics[name].values for name in names}
        try:
            for name in names:
                metrics[name].values = saved[name].clone()
            if _distributed():
                tracker._sync_metrics(list(names), None)
            return {name: metrics[name].values for name in names}, True
        finally:
            for name, values in saved.items():
                metrics[name].values = values
    from megatron.core.transformer.moe import moe_utils

    get = getattr(moe_utils, "get_moe_layer_wise_logging_tracker", None)
    if get is None:   # core 0.12 keeps the tracker in parallel_state
        from megatron.core import parallel_state

        get = parallel_state.get_moe_layer_wise_logging_tracker
    tracker = get()
    device = next((e["values"].device for e in tracker.values() if "values" in e), None)
    saved: dict[str, Any] = {}
    try:
        for name in names:
            saved[name] = tracker.get(name)
            if saved[name] is not None:
                tracker[name] = dict(saved[name], values=saved[name]["values"].clone())
            else:   # a stage without MoE layers: zeros, as training_log's force_initialize makes them
                dev = device if device is not None else (
                    torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None)
                tracker[name] = {"values": torch.zeros(int(cfg.num_layers), device=dev), "reduce_group": None,
                                 "avg_group": None, "reduce_group_has_dp": False}
        if _distributed():
            moe_utils.reduce_aux_losses_tracker_across_ranks(list(names))
        return {name: tracker[name]["values"] for name in names}, False
    finally:
        for name, entry in saved.items():
            if entry is None:
                tracker.pop(name, None)
            else:
                tracker[name] = entry


def moe_aux_losses(cfg: Any, num_microbatches: int) -> dict[str, float]:
    """This iteration's router losses as ``training_log`` adds them to its log: the reduced per-layer sums
    over micro-batches, times 1 / micro-batches, summed over layers / the number of MoE layers."""
    names = moe_track_names(cfg)
    if not names:
        return {}
    values, newer = _moe_values(names, cfg)
    n_moe = num_moe_layers(cfg, mtp_if_last_is_moe=newer)
    return {name: float((v.float() * (1 / num_microbatches)).sum() / n_moe) for name, v in values.items()}


def mtp_losses(cfg: Any, num_microbatches: int) -> dict[str, float]:
    """The MTP layers' losses as ``training_log`` logs them (``mtp_K loss``: the tracker's value reduced
    over its groups, times 1 / micro-batches), as ``mtp_K_loss``, and their sum as ``mtp_loss``."""
    if getattr(cfg, "mtp_num_layers", None) is None:
        return {}
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker = MTPLossLoggingHelper.tracker
    key = "loss_values" if "loss_values" in tracker else "values"
    if key not in tracker:
        return {}
    values = tracker[key].clone()
    if _distributed():
        if tracker.get("reduce_group") is not None:
            torch.distributed.all_reduce(values, group=tracker["reduce_group"])
        if tracker.get("avg_group") is not None:
            torch.distributed.all_reduce(values, group=tracker["avg_group"], op=torch.distributed.ReduceOp.AVG)
    losses = values * (1 / num_microbatches)
    out = {f"mtp_{i + 1}_loss": float(losses[i]) for i in range(losses.shape[0])}
    out["mtp_loss"] = float(losses.sum())
    return out


def this_cp_rank(item: Any, cp: int, cp_rank: int) -> Any:
    """A CP rank's part of a micro-batch the data iterator yielded whole: pretrain_gpt.py's get_batch cuts it
    after the iterator (get_batch_on_this_cp_rank: chunks r and 2cp-1-r of 2cp along the sequence), and the
    store holds what this rank's model saw, as runstore.batches.cp_join expects. Packed sequences
    (``cu_seqlens*``) are split by Transformer Engine's own indices: recorded whole, unchanged. The training
    item is not touched (new tensors)."""
    if cp == 1 or not isinstance(item, Mapping) or any(str(k).startswith("cu_seqlens") for k in item):
        return item
    out = {}
    for key, value in item.items():
        dim = seq_dim(str(key))
        if isinstance(value, torch.Tensor) and value.dim() > dim and value.shape[dim] % (2 * cp) == 0:
            chunks = value.chunk(2 * cp, dim=dim)
            value = torch.cat([chunks[cp_rank], chunks[2 * cp - 1 - cp_rank]], dim=dim)
        out[key] = value
    return out


def _num_microbatches(fallback: int) -> int:
    try:
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        return int(get_num_microbatches())
    except Exception:  # noqa: BLE001 - calculator not set up (a loop of one's own): count what was read
        return max(fallback, 1)


def _model_config(model: Any) -> Any:
    for chunk in model if isinstance(model, (list, tuple)) else [model]:
        cfg = getattr(chunk, "config", None)
        if cfg is not None:
            return cfg
    return None


def logged_scalars(model: Any, optimizer: Any, read_micro_batches: int,
                   dumper: MegatronDumper | None) -> dict[str, Any]:
    """What ``train()`` hands to ``training_log`` after this step (router and MTP losses, learning rates, loss
    scale). Called once per ``train_step`` on every rank, dumping or not: the loss reductions are collectives
    and must pair up across ranks as ``training_log``'s own do. A value that cannot be read is left out."""
    cfg = _model_config(model)
    micro = _num_microbatches(read_micro_batches)
    out: dict[str, Any] = {}
    reads = [("learning rate", lambda: learning_rates(getattr(optimizer, "param_groups", []))),
             ("loss scale", lambda: {"loss_scale": loss_scale(optimizer)})]
    if cfg is not None:
        reads[:0] = [("moe aux losses", lambda: moe_aux_losses(cfg, micro)),
                     ("mtp losses", lambda: mtp_losses(cfg, micro))]
    for what, read in reads:
        try:
            out.update({k: v for k, v in read().items() if v is not None})
        except Exception as exc:  # noqa: BLE001 - one missing value never costs the others
            if dumper is not None:
                dumper._fail(f"megatron_lm.train_step ({what})", exc)
    return out


def _note_in_rank_file(dumper: MegatronDumper, info: Mapping[str, Any]) -> None:
    """Add ``aborted`` to this rank's file of the store (meta.json holds the last rank's that failed)."""
    path = Path(dumper.config.out) / RANK_DIR / f"rank_{dumper.rank:05d}.json"
    data = json.loads(path.read_text()) if path.exists() else {"rank": dumper.rank}
    data["aborted"] = dict(info)
    atomic_write_json(path, data)


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
            result = original(forward_step_func, data_iterator, model, optimizer, *args, **kwargs)
            logged_scalars(model, optimizer, 1, None)   # its reductions still match the other ranks'
            return result
        try:
            result = original(forward_step_func, wrapped, model, optimizer, *args, **kwargs)
        except BaseException as exc:
            self._abort(dumper, exc)
            raise
        finally:
            for undo in restore:
                with contextlib.suppress(Exception):
                    undo()
        try:
            self._finish(dumper, recorders, result, model, optimizer)
        except Exception as exc:  # noqa: BLE001
            dumper._fail("megatron_lm.train_step (after)", exc)
        return result

    def _abort(self, dumper: MegatronDumper, exc: BaseException) -> None:
        """The step raised: leave its file unfinished (the reader lists it as incomplete), record what failed
        in meta.json and this rank's file, and write nothing else of it. Never raises."""
        step = dumper._step
        if step is None:
            return
        info = {"step": step, "rank": dumper.rank, "where": f"{getattr(self.module, '__name__', TARGET)}.train_step",
                "exception": f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins."),
                "message": str(exc)[:2000]}
        writer = dumper._writer
        try:
            if writer is not None:
                writer.put_array(step, "aborted", np.zeros(0, dtype=np.int8), info)
                writer.abandon_step()
                writer.update_meta({"aborted": info})
                _note_in_rank_file(dumper, info)
        except Exception as err:  # noqa: BLE001 - the training error is what matters
            dumper._fail("megatron_lm.train_step (abort)", err)
        with contextlib.suppress(Exception):
            dumper._pending_batch.clear()
            dumper._release_step_refs()
        dumper._close_step()

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
    def _finish(dumper: MegatronDumper, recorders: Sequence[_Recorder], result: Any, model: Any = None,
                optimizer: Any = None) -> None:
        # Virtual-pipeline chunks read the same micro-batches from their own iterators: keep the fullest.
        best = max(recorders, key=lambda r: len(r.items), default=None)
        # first, on every rank alike (whether it dumps or not): the aux-loss reductions are collectives
        scalars = logged_scalars(model, optimizer, len(best.items) if best is not None else 1, dumper)
        if best is not None:
            cp, cp_rank = int(dumper.rank_info.get("cp", 1)), int(dumper.rank_info.get("cp_rank", 0))
            for item in best.items:
                dumper.record_batch(this_cp_rank(item, cp, cp_rank))
        losses = result[0] if isinstance(result, tuple) and result and isinstance(result[0], Mapping) else {}
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


def import_failure(target: str, exc: BaseException) -> str:
    """One line that tells the two cases apart: ``target`` is not there at all (no checkout on the path), or
    it is there and failed while importing, naming the cause and the file (and line) whose import failed."""
    missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
    if missing and (target == missing or target.startswith(missing + ".")):
        return (f"{target} is not importable (no module named '{missing}'): not a Megatron-LM checkout, or the "
                "checkout is not on PYTHONPATH; run from the checkout or put it first on PYTHONPATH")
    if isinstance(exc, SyntaxError) and exc.filename:
        where = f"{exc.filename}:{exc.lineno}"
    else:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<")]
        where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
    cause = f"No module named '{missing}'" if missing else f"{type(exc).__name__}: {exc}"
    cause = " ".join(cause.split())
    return (f"{target} failed while importing because of {cause} (in {where}); the checkout is found but needs "
            "what that line imports: install it into this Python, or use the Python version the checkout needs")


def mixed_install(module: ModuleType) -> str | None:
    """A note when Megatron-LM's training module and ``megatron.core`` come from different places (a
    checkout's megatron/training over pip's megatron-core: versions apart, errors far from their cause)."""
    if not module.__name__.startswith("megatron.") or not getattr(module, "__file__", None):
        return None
    try:
        import megatron.core as mcore
    except Exception:  # noqa: BLE001 - nothing to compare
        return None
    depth = module.__name__.count(".")
    here, there = Path(module.__file__).resolve().parents[depth], Path(mcore.__file__).resolve().parents[2]
    if here == there:
        return None
    return (f"{module.__name__} is from {here} but megatron.core from {there}: put the checkout first on "
            "PYTHONPATH so that its own megatron/core is used")


_VALUED = ("--align-out", "--align-steps", "--align-tensors", "--align-module", "--align-capture-data",
           "--align-tensor-steps", "--align-modules")


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
    ap.add_argument("--align-tensor-steps", default=None,
                    help="steps whose layer tensors are captured (default: the --align-steps)")
    ap.add_argument("--align-modules", action="append", default=None, metavar="PATTERN",
                    help="modules whose tensors are captured, fnmatch over the global names (repeat; default "
                         "all), e.g. 'decoder.layers.*' for single-module isolation")
    ap.add_argument("--align-seed-layout", action="store_true")
    ap.add_argument("--align-capture-env", action="store_true",
                    help="record the cluster capture (environment, versions, settings, generators, weights) in "
                         "meta.json")
    ap.add_argument("--align-capture-data", action="append", default=[], metavar="PATH",
                    help="a dataset file or folder the capture hashes (repeat)")
    ap.add_argument("--align-routing", action="store_true",
                    help="MoE routing evidence (each router's logits, top-k choices, tokens per expert) at the "
                         "array steps: give --align-steps 1-2 with it (the logits are tokens x experts per router)")
    ap.add_argument("--align-module", default=TARGET,
                    help=f"module whose train_step is wrapped (default {TARGET})")
    ns = ap.parse_args(argv[:i])
    if i >= len(argv):
        ap.error("the training script to run is missing")
    sys.path.insert(0, str(Path(argv[i]).resolve().parent))  # as `python script.py` would
    try:
        module = importlib.import_module(ns.align_module)
    except Exception as exc:  # noqa: BLE001 - any failure at import time is reported in one line
        print(f"dumpers.megatron_lm: {import_failure(ns.align_module, exc)}", file=sys.stderr)
        raise SystemExit(2) from None
    mixed = mixed_install(module)
    if mixed:
        print(f"dumpers.megatron_lm: warning: {mixed}", file=sys.stderr)
    capture = ns.align_capture_env or bool(ns.align_capture_data)
    install(DumpConfig(out=ns.align_out, steps=ns.align_steps, tensors=ns.align_tensors,
                       tensor_steps=ns.align_tensor_steps, modules=tuple(ns.align_modules or ("*",)),
                       seed_layout=ns.align_seed_layout, capture_env=capture,
                       capture_env_data=ns.align_capture_data, routing=ns.align_routing), module=module)
    sys.argv = list(argv[i:])
    runpy.run_path(argv[i], run_name="__main__")


if __name__ == "__main__":
    main()
