"""Evidence dumper for any torch ``nn.Module`` + optimizer, writing one rank's share of a run store.

Why it looks like this:

* One object, configured once (:class:`DumpConfig`, the one both dumpers take: dumpers/contract.py),
  and two calls per step (``begin_step`` / ``end_step``, or ``with dumper.step(n):``), so a training
  script needs a few lines and no library edits.
* It never changes numerics: hooks only read tensors (forward hooks return nothing, tensor hooks return
  ``None``), statistics are computed on detached tensors, and nothing is cast in place.
* It never crashes training: every entry point is guarded; a failure (say an unwritable output directory)
  becomes a warning and ``dumper.errors += 1``. The one deliberate exception is ``stop_on_nan=True``.
* Statistics are reduced on the tensor's own device and stacked, so one small transfer per step moves them.

Layout written (see docs/run-store.md): scalars every step (loss, grad_norm, loss_mask_sum, token_min,
token_max, tokens_per_step, nonfinite_grads); per selected step ``batch/*`` (with ``batch/sample_hash``, one
hash per whole sample, which a replay onto another layout is checked against), the ``local_norm``,
``tensor_stats`` and ``nan_trace`` tables, ``tensors/<order>`` and ``nan_trace_tensors/<i>``; optionally the seed layout
``step_N/rank_R/<name>.npy``.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import math
import warnings
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from dumpers.contract import (
    DumpConfig,
    NonFiniteError,
    StepBookkeeping,
    dumps_rank,
    merge_micro_batches,
    open_writer,
    parse_steps,  # noqa: F401  (re-exported: users import it from here)
)
from runstore import SEED_BATCH_KEYS, BackgroundWriter, RunWriter

_STAT_COLS = ("max", "min", "mean", "norm", "nan", "inf")


@functools.lru_cache(maxsize=64)
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _flatten_tensors(obj: Any, out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Tensors inside nested tuples/lists/dicts, in order (a hook's inputs or outputs)."""
    if out is None:
        out = []
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _flatten_tensors(item, out)
    elif isinstance(obj, Mapping):
        for item in obj.values():
            _flatten_tensors(item, out)
    return out


_NO_COUNTS = (0.0, 0.0)


@functools.lru_cache(maxsize=4096)
def _shape_name(shape: torch.Size) -> str:
    return "x".join(map(str, shape)) or "scalar"


@functools.lru_cache(maxsize=1024)
def _kind(what: str, i: int) -> str:
    return f"{what}.{i}"


#: Elements a CPU L2 norm sums in one run. torch's CPU norm kernels (``vector_norm``, ``_foreach_norm``)
#: add float32 squares one after another: relative error 1e-5 at 1M elements, 1e-4 at 4M, 8e-4 at 16M
#: (measured against float64, torch 2.13), beyond float32's compare tolerance. Rows of this many elements
#: stay under 1e-6, and their norms add up exactly enough.
NORM_BLOCK = 1 << 16
_BLOCKED_ABOVE = 4 * NORM_BLOCK     # smaller CPU tensors: torch's own kernel is accurate enough (< 1e-6)


def l2_norm(x: torch.Tensor) -> torch.Tensor:
    """The L2 norm of ``x`` (float32 or float64) as a 0-d tensor, accurate on CPU at any size: per row of
    ``NORM_BLOCK`` elements, then over the rows (one kernel more, only for large CPU tensors)."""
    n = x.numel()
    if n <= _BLOCKED_ABOVE or x.device.type != "cpu":
        return torch.linalg.vector_norm(x)
    flat = x.reshape(-1)
    m = n // NORM_BLOCK
    rows = torch.linalg.vector_norm(flat[: m * NORM_BLOCK].view(m, NORM_BLOCK), dim=1)
    if m * NORM_BLOCK < n:
        rows = torch.cat([rows, torch.linalg.vector_norm(flat[m * NORM_BLOCK:]).reshape(1)])
    return torch.linalg.vector_norm(rows)


def _stat_values(t: torch.Tensor) -> list[float] | torch.Tensor:
    """[max, min, mean, L2 norm, nan count, inf count] of ``t``: Python floats on CPU, else a float32
    tensor on ``t``'s device (stacked with the step's others at ``end_step``: one transfer, no sync).

    Three passes over the data (aminmax, sum, norm). The nan/inf counts need two more, so on CPU, where
    reading one scalar costs nothing, they are skipped when the norm is finite (a finite L2 norm means
    every element is finite). On CPU four scalar reads replace the stack/divide/zeros of the device path:
    a step measures a few hundred tensors, and each torch call costs microseconds.
    """
    x = t.detach()
    n = x.numel()
    cpu = x.device.type == "cpu"
    if n == 0:
        return [0.0] * 6 if cpu else torch.zeros(6, dtype=torch.float32, device=x.device)
    if x.dtype is torch.float32:   # the usual case: no dtype argument (each one costs a dispatch detour)
        mn, mx = torch.aminmax(x)
        total = x.sum()
        norm = l2_norm(x)
    else:
        if not x.is_floating_point():
            x = x.to(torch.float32)
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32   # vector_norm refuses to narrow
        mn, mx = torch.aminmax(x)
        total = x.sum(dtype=acc)
        norm = l2_norm(x if x.dtype == acc else x.to(acc)) if cpu else torch.linalg.vector_norm(x, dtype=acc)
    if cpu:
        nv = norm.item()
        if nv - nv == 0.0:   # finite (inf - inf and nan - nan are nan)
            nan, inf = _NO_COUNTS
        else:
            nan, inf = float(torch.isnan(x).sum()), float(torch.isinf(x).sum())
        # mean as float32 division, as the device path computes it
        return [mx.item(), mn.item(), float(np.float32(total.item()) / np.float32(n)), nv, nan, inf]
    nan = torch.isnan(x).sum().float()
    inf = torch.isinf(x).sum().float()
    return torch.stack([mx.float(), mn.float(), (total / n).float(), norm.float(), nan, inf])


def tensor_stats(t: torch.Tensor) -> torch.Tensor:
    """[max, min, mean, L2 norm, nan count, inf count] as float32 on ``t``'s device."""
    v = _stat_values(t)
    return v if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=torch.float32, device=t.device)


def _stats_matrix(values: Sequence[list[float] | torch.Tensor]) -> np.ndarray:
    """The step's statistics as an (n, 6) float64 array; device tensors move in one transfer per device."""
    out = np.zeros((len(values), 6), dtype=np.float64)
    by_device: dict[torch.device, list[int]] = {}
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            by_device.setdefault(v.device, []).append(i)
        else:
            out[i] = v
    for idx in by_device.values():
        out[idx] = torch.stack([values[i] for i in idx]).cpu().numpy()
    return out


def _host_array(t: torch.Tensor, private: bool) -> np.ndarray:
    """``t`` as a host numpy array for a full-tensor dump (floating point as float32).

    A device tensor or a dtype change makes a fresh copy anyway. A float32 CPU tensor is used in place
    when the caller writes it before returning to the training code (``private=False``); when the write
    happens later (background writer) it is cloned: the training code may change the tensor in place
    after the hook (an in-place activation, a gradient accumulated into), and the dump must hold the value
    the hook saw.
    """
    x = t.detach()
    fresh = False
    if x.is_floating_point() and x.dtype != torch.float32:
        x = x.to(device="cpu", dtype=torch.float32)
        fresh = True
    elif x.device.type != "cpu":
        x = x.to("cpu")
        fresh = True
    if private and not fresh:
        x = x.clone()
    return x.numpy(force=True)


class TorchDumper(StepBookkeeping):
    """Dumps batches, named local norms, layer tensors and NaN traces of one rank into a run store.

    ``model``: the module (or list of modules) being trained; ``optimizer``: a ``torch.optim`` optimizer
    (its step pre-hook captures the local norms) or ``None`` (call :meth:`record_grads` yourself).
    ``rank_info``: this rank's coordinates (``tp_rank``, ``pp_rank``, ``dp_rank``, ``tp``, ``pp``, ``dp``).
    """

    framework = "torch"
    name_scheme = "torch"

    def __init__(self, model: torch.nn.Module | Sequence[torch.nn.Module], optimizer: Any = None,
                 config: DumpConfig | None = None, *, rank: int | None = None,
                 world_size: int | None = None, rank_info: Mapping[str, Any] | None = None,
                 meta: Mapping[str, Any] | None = None) -> None:
        self.config = config or DumpConfig(out="dump")
        if self.config.out is None:
            raise ValueError("DumpConfig.out is not set: TorchDumper needs the run-store directory")
        self.errors = 0
        self.error_log: list[str] = []
        self.nan_found = False
        self._writer: RunWriter | BackgroundWriter | None = None
        self._handles: list[Any] = []
        try:
            self.models = list(model) if isinstance(model, (list, tuple)) else [model]
            self.optimizer = optimizer
            self.rank, self.world_size = self._rank_world(rank, world_size)
            self.rank_info = {"tp_rank": 0, "pp_rank": 0, "dp_rank": self.rank, "tp": 1, "pp": 1,
                              "dp": self.world_size}
            self.rank_info.update(self._default_rank_info())
            self.rank_info.update(rank_info or {})
            self.rank_info.update(rank=self.rank, world_size=self.world_size)
            self.enabled = dumps_rank(self.config, self.rank)
            self._select_steps()
            self.params = self._named_params()
            self._param_index = {id(p): i for i, (_, p, _) in enumerate(self.params)}
            self._grad_order: list[int] = []
            self._pending_batch: dict[str, list[np.ndarray]] = {}
            self._rows: list[tuple[str, str, str, str, int, str]] = []
            self._row_stats: list[list[float] | torch.Tensor] = []
            # id(tensor) -> [weakref, version, stats, order of its full dump or None]
            self._stats_cache: dict[int, list[Any]] = {}
            # id(tensor) -> (weakref, [(module, kind), ...]) of the tensors whose gradients are awaited
            self._grad_targets: dict[int, tuple[Any, list[tuple[str, str]]]] = {}
            self._io_refs: dict[str, dict[str, torch.Tensor]] = {}
            self._trace_rows: list[dict[str, Any]] = []
            self._trace_tensors: list[tuple[int, str, str, str, np.ndarray]] = []
            self._norms_recorded = False
            self._norm_table: tuple[dict[str, Any], dict[str, Any]] | None = None
            self._hook_norms: list[float] = []
            self._grads_used: dict[int, torch.Tensor] = {}
            self._step_scalars: dict[str, Any] = {}
            self._routes: dict[str, list[Any]] = {}           # router name -> this step's records (calls)
            self._route_counts: dict[str, np.ndarray] = {}     # router name -> tokens per expert (counts only)
            self._count_keys: dict[str, set] = {}
            self._router_logits: dict[str, torch.Tensor] = {}
            self._router_modules: list[torch.nn.Module] = []
            if not self.enabled:
                return
            self._open_writer(meta)
            self._install_hooks()
        except Exception as exc:  # never break the training script
            self._fail("init", exc)
            return
        if self.config.capture_env:
            self.capture_environment(seeds=(meta or {}).get("seed") or self.config.meta.get("seed"))

    def capture_environment(self, seeds: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
        """Write the cluster capture (``DumpConfig.capture_env``) into meta.json ``environment`` (rank 0): this
        process's variables, versions and settings, the generators as they are now (``seeds``: the record
        ``seed_everything`` returned, to tell whether anything drew since), ``capture_env_data`` hashed and,
        with ``capture_env_weights``, every trained parameter's fingerprint (this rank's shards under TP / PP)."""
        if self._writer is None or self.rank != 0:
            return None
        try:
            from dumpers.environment import capture_environment

            weights = None
            if self.config.capture_env_weights:
                weights = [(name, (lambda p=p: p.detach().float().cpu().numpy()), _dtype_name(p.dtype))
                           for name, p, _ in self.params]
            par = {k: self.rank_info.get(k, 1) for k in ("tp", "pp", "ep")}
            capture = capture_environment("torch", by=type(self).__name__, data=self.config.capture_env_data,
                                          weights=weights, weights_source="model parameters at capture",
                                          parallel=par, seeds=seeds)
            self._writer.update_meta({"environment": capture})
            return capture
        except Exception as exc:  # noqa: BLE001 - never break the training script
            self._fail("capture_env", exc)
            return None

    # -- identity -------------------------------------------------------------------------------------
    @staticmethod
    def _rank_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
        dist = torch.distributed
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if world_size is None:
            world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        return int(rank), int(world_size)

    def _default_rank_info(self) -> dict[str, Any]:
        return {}

    def _clean_name(self, name: str) -> str:
        return name

    def _tp_info(self, param: torch.nn.Parameter) -> tuple[int, int, int]:
        """(partition_dim or -1, tp_rank, tp_size) of a parameter; plain torch is not TP-split."""
        return -1, int(self.rank_info.get("tp_rank", 0)), int(self.rank_info.get("tp", 1))

    def _chunk_namer(self, index: int, model: torch.nn.Module):  # noqa: ANN202
        """Name function for one model chunk; several chunks get a ``chunk{i}.`` prefix here."""
        multi = len(self.models) > 1

        def name_of(name: str) -> str:
            name = self._clean_name(name)
            return f"chunk{index}.{name}" if multi and name else name
        return name_of

    def _skip_param(self, param: torch.nn.Parameter) -> bool:
        return not param.requires_grad

    def _named_params(self) -> list[tuple[str, torch.nn.Parameter, tuple[int, int, int]]]:
        seen: set[int] = set()
        out = []
        for i, m in enumerate(self.models):
            name_of = self._chunk_namer(i, m)
            for name, p in m.named_parameters():
                if id(p) in seen or self._skip_param(p):
                    continue
                seen.add(id(p))
                out.append((name_of(name), p, self._tp_info(p)))
        return out

    def _dtypes(self) -> dict[str, str]:
        """Param / grad / compute dtypes for meta.json (comparators pick tolerances from them)."""
        counts: dict[str, int] = {}
        for _, p, _ in self.params:
            if p.is_floating_point():
                counts[_dtype_name(p.dtype)] = counts.get(_dtype_name(p.dtype), 0) + p.numel()
        dt = max(counts, key=counts.__getitem__) if counts else "float32"
        return {"params": dt, "grads": dt, "compute": dt}

    def _grad_of(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        return p.grad

    # -- guarded plumbing -----------------------------------------------------------------------------
    def _fail(self, where: str, exc: BaseException) -> None:
        self.errors += 1
        msg = f"dumper: {where} failed ({type(exc).__name__}: {exc}); training continues"
        self.error_log.append(msg)
        if self.errors <= 3 or self.errors % 100 == 0:
            warnings.warn(f"{msg} [errors so far: {self.errors}]", RuntimeWarning, stacklevel=3)

    def _open_writer(self, meta: Mapping[str, Any] | None) -> None:
        m = {"framework": self.framework, "name_scheme": self.name_scheme,
             "versions": self._versions(), "source": {"kind": "dumper", "path": str(self.config.out)},
             "parallel": self._parallel_meta(),
             "dumper": {"tensors": self.config.tensors, "modules": list(self.config.modules),
                        "nan_trace": self.config.nan_trace, "local_norms": self.config.local_norms},
             "dtypes": self._dtypes()}
        m.update(self._extra_meta())
        m.update(self.config.meta)
        m.update(meta or {})
        self._writer = open_writer(self.config.out, rank=self.rank, meta=m, rank_info=self.rank_info,
                                   background=self.config.background_writes)

    def _parallel_meta(self) -> dict[str, Any]:
        """meta.json ``parallel``: the layout's sizes (a framework layer adds its own, e.g. cp)."""
        return {"tp": self.rank_info.get("tp", 1), "pp": self.rank_info.get("pp", 1),
                "dp": self.rank_info.get("dp", self.world_size), "ep": self.rank_info.get("ep", 1),
                "world_size": self.world_size}

    def _versions(self) -> dict[str, str]:
        return {"torch": torch.__version__}

    def _extra_meta(self) -> dict[str, Any]:
        return {}

    def update_meta(self, values: Mapping[str, Any]) -> None:
        """Merge ``values`` into meta.json (rank 0 only), e.g. the model config or the seed record."""
        if self._writer is None or self.rank != 0:
            return
        try:
            self._writer.update_meta(values)
        except Exception as exc:
            self._fail("update_meta", exc)

    # -- hooks ----------------------------------------------------------------------------------------
    def _selected_modules(self) -> list[tuple[str, torch.nn.Module]]:
        pats = list(self.config.modules)
        out = []
        for i, m in enumerate(self.models):
            name_of = self._chunk_namer(i, m)
            for name, mod in m.named_modules():
                cname = name_of(name)
                if cname == "":  # the root (or a DDP wrapper around it)
                    continue
                if any(fnmatch.fnmatchcase(cname, p) for p in pats):
                    out.append((cname, mod))
        return out

    def _install_hooks(self) -> None:
        cfg = self.config
        if cfg.tensors != "off" or cfg.nan_trace == "all":
            owners = {id(mod) for _, mod in self._owner_modules()}
            for name, mod in self._selected_modules():
                keep = id(mod) in owners
                self._handles.append(mod.register_forward_pre_hook(self._pre_hook(name, keep),
                                                                   with_kwargs=True))
                self._handles.append(mod.register_forward_hook(self._post_hook(name, keep), with_kwargs=True))
        if cfg.local_norms or cfg.nan_trace != "off":
            for i, (_, p, _) in enumerate(self.params):
                if hasattr(p, "register_post_accumulate_grad_hook"):
                    self._handles.append(p.register_post_accumulate_grad_hook(self._grad_order_hook(i)))
            if self.optimizer is not None and hasattr(self.optimizer, "register_step_pre_hook"):
                self._handles.append(self.optimizer.register_step_pre_hook(self._opt_pre_hook))
        if cfg.routing:
            self._install_router_hooks()

    # -- MoE routing (DumpConfig.routing) -----------------------------------------------------------------
    def _install_router_hooks(self) -> None:
        """A forward hook on every top-k router (Megatron-core's TopKRouter: ``gating`` + ``routing`` +
        ``topk``) and its ``gating`` wrapped on the instance to keep the logits; both act only at the tensor
        steps and change nothing the router computes."""
        for i, m in enumerate(self.models):
            name_of = self._chunk_namer(i, m)
            for name, mod in m.named_modules():
                if not (callable(getattr(mod, "gating", None)) and callable(getattr(mod, "routing", None))
                        and isinstance(getattr(mod, "topk", None), int)):
                    continue
                cname = name_of(name)
                self._handles.append(mod.register_forward_hook(self._router_hook(cname, mod), with_kwargs=True))
                self._wrap_gating(cname, mod)

    def _wrap_gating(self, name: str, mod: torch.nn.Module) -> None:
        inner = mod.gating

        def gating(*args: Any, **kwargs: Any) -> Any:
            out = inner(*args, **kwargs)
            if self._routing_step and isinstance(out, torch.Tensor):
                self._router_logits[name] = out.detach()
            return out

        mod.gating = gating
        self._router_modules.append(mod)

    def _router_hook(self, name: str, mod: torch.nn.Module):  # noqa: ANN202
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if self._step is None or not self._array_step:
                return None
            try:
                from runstore.routing import batch_major, from_routing_map

                probs, rmap = output[0], output[1]
                if not self._routing_step:      # every other array step: tokens per expert only (E integers)
                    counts = rmap.reshape(-1, rmap.shape[-1]).sum(0).cpu().numpy().astype(np.int64)
                    key = (tuple(counts.tolist()), float(probs.detach().float().sum()))
                    seen = self._count_keys.setdefault(name, set())
                    if key not in seen:         # a recomputed forward is the same call again
                        seen.add(key)
                        self._route_counts[name] = self._route_counts.get(name, 0) + counts
                    return None
                x = args[0] if args else kwargs.get("input")
                logits = self._router_logits.pop(name, None)
                if logits is None:
                    return None
                experts = int(probs.shape[-1])
                seq, batch = (int(x.shape[0]), int(x.shape[1])) if x is not None and x.dim() == 3 else (
                    int(probs.shape[0]), 1)

                def host(t: torch.Tensor) -> np.ndarray:
                    return batch_major(t.detach().float().reshape(-1, experts).cpu().numpy(), seq, batch)

                rec = from_routing_map(name, host(logits), host(probs),
                                       batch_major(rmap.detach().reshape(-1, experts).cpu().numpy(), seq, batch),
                                       int(module.topk), logits_dtype=_dtype_name(logits.dtype),
                                       probs_dtype=_dtype_name(probs.dtype),
                                       score_function=str(getattr(module, "score_function", "") or ""),
                                       topk=int(module.topk), batch=batch, seq=seq, calls=1)
                calls = self._routes.setdefault(name, [])
                # activation recomputation runs the router again on the same tokens: keep one record of them
                if not any(np.array_equal(c.logits, rec.logits) for c in calls):
                    calls.append(rec)
            except Exception as exc:
                self._fail(f"router hook {name}", exc)
            return None
        return hook

    def _flush_routing(self, step: int) -> None:
        from runstore.routing import concat_records, put_counts, put_routing

        routes, counts = self._routes, dict(self._route_counts)
        self._routes, self._route_counts, self._count_keys = {}, {}, {}
        if self._writer is None or not (routes or counts):
            return
        for name, recs in routes.items():
            rec = concat_records(recs)
            put_routing(self._writer, step, rec)
            counts[name] = rec.tokens_per_expert
        put_counts(self._writer, step, counts)

    def _owner_modules(self) -> list[tuple[str, torch.nn.Module]]:
        return [(n, m) for n, m in self._selected_modules() if any(True for _ in m.parameters(recurse=False))]

    def _capturing(self) -> bool:
        return self._step is not None and (self._tensor_step or self.config.nan_trace == "all")

    def _pre_hook(self, name: str, keep: bool):  # noqa: ANN202
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            if not self._capturing():
                return None
            try:
                items = _flatten_tensors(kwargs, _flatten_tensors(args)) if kwargs else _flatten_tensors(args)
                for i, t in enumerate(items):
                    self._record(name, _kind("forward.input", i), t)
                    if t.requires_grad and self.config.backward:
                        self._on_grad(t, name, _kind("backward.grad_input", i))
                if keep and self.config.nan_trace == "all":
                    self._io_refs.setdefault(name, {}).update(
                        {f"forward.input.{i}": t.detach() for i, t in enumerate(items)})
            except Exception as exc:
                self._fail(f"forward pre-hook {name}", exc)
            return None
        return hook

    def _post_hook(self, name: str, keep: bool):  # noqa: ANN202
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if not self._capturing():
                return None
            try:
                items = _flatten_tensors(output)
                for i, t in enumerate(items):
                    self._record(name, _kind("forward.output", i), t)
                    if t.requires_grad and self.config.backward:
                        self._on_grad(t, name, _kind("backward.grad_output", i))
                if keep and self.config.nan_trace == "all":
                    self._io_refs.setdefault(name, {}).update(
                        {f"forward.output.{i}": t.detach() for i, t in enumerate(items)})
            except Exception as exc:
                self._fail(f"forward hook {name}", exc)
            return None
        return hook

    def _on_grad(self, t: torch.Tensor, name: str, kind: str) -> None:
        """Record ``t``'s gradient as ``name``/``kind`` in backward. One tensor hook per tensor, however many
        modules saw it (a module's output is the next one's input): the hook records every (name, kind) in
        the order they were asked for, as one hook each would have, for half the hook registrations."""
        got = self._grad_targets.get(id(t))
        if got is not None and got[0]() is t:
            got[1].append((name, kind))
            return
        targets = [(name, kind)]
        self._grad_targets[id(t)] = (weakref.ref(t), targets)

        def hook(grad: torch.Tensor) -> None:
            for n, k in targets:
                try:
                    if self._capturing() and grad is not None:
                        self._record(n, k, grad)
                except Exception as exc:
                    self._fail(f"backward hook {n}", exc)
            return None
        t.register_hook(hook)

    def _grad_order_hook(self, index: int):  # noqa: ANN202
        def hook(param: torch.Tensor) -> None:
            self._grad_order.append(index)
        return hook

    def _opt_pre_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.record_grads(where="torch.optim.Optimizer.step")
        return None

    # -- recording ------------------------------------------------------------------------------------
    def _record(self, module: str, kind: str, t: torch.Tensor) -> None:
        order = len(self._rows)
        shape = _shape_name(t.shape)
        self._rows.append((module, kind, _dtype_name(t.dtype), shape, t.numel(), self._split_of(module, kind, t)))
        if self._tensor_step and self.config.tensors != "off":
            entry = self._stats_entry(t)
            self._row_stats.append(entry[2])
            if self.config.tensors == "full" and self._writer is not None:
                key = f"tensors/{order:06d}"
                if entry[3] is not None:    # the same unchanged tensor, already stored this step
                    self._writer.link_array(self._step, key, f"tensors/{entry[3]:06d}")
                else:
                    private = isinstance(self._writer, BackgroundWriter)
                    self._writer.put_array(self._step, key, _host_array(t, private))
                    entry[3] = order
        else:  # nan tracing only: a cheap finiteness flag, in the stats' nan column
            x = t.detach()
            bad = (~torch.isfinite(x)).sum().float() if x.is_floating_point() else x.new_zeros((), dtype=
                                                                                               torch.float32)
            z = torch.zeros((), dtype=torch.float32, device=x.device)
            self._row_stats.append(torch.stack([z, z, z, z, bad, z]))

    def _split_of(self, module: str, kind: str, t: torch.Tensor) -> str:
        """How this rank's ``t`` is a part of the whole tensor (``tensor_stats`` column ``split``, e.g.
        ``tp:-1,cp:0``; "" = whole or a replica): a framework layer that splits activations says
        (dumpers/megatron.py); plain torch holds whole tensors."""
        return ""

    def _stats_entry(self, t: torch.Tensor) -> list[Any]:
        """[weakref, version, statistics, full-dump order] of ``t``, reused when the same unchanged tensor
        was already measured this step (same object, same ``_version``: no in-place change since).

        A module's input is often its parent's input, and one gradient reaches several backward hooks:
        measured once, and in full mode stored once (the other names are HDF5 links to it).
        """
        key = id(t)
        hit = self._stats_cache.get(key)
        if hit is not None and hit[0]() is t and hit[1] == t._version:
            return hit
        entry = [weakref.ref(t), t._version, _stat_values(t), None]
        self._stats_cache[key] = entry
        return entry

    def begin_step(self, step: int) -> None:
        """Start step ``step`` (numbered from 1, like Megatron's iteration)."""
        if not self.enabled:
            return
        try:
            self._open_step(step)
            self._grad_order.clear()
            self._pending_batch.clear()
            self._release_step_refs()
            self._norms_recorded = False
            self._norm_table = None
            self._hook_norms = []
            self._step_scalars = {}
        except Exception as exc:
            self._fail("begin_step", exc)

    def record_batch(self, batch: Mapping[str, Any], step: int | None = None) -> None:
        """Record one micro-batch (call once per micro-batch; they are concatenated on dim 0).

        With ``step`` given, this call also moves the step boundary: a new step number ends the open step
        and begins the next one, so a script whose loop it cannot edit (Megatron's ``pretrain``) only needs
        this call in ``forward_step``; ``close()`` ends the last step.
        """
        if not self.enabled:
            return
        if step is not None and step != self._step:
            if self._step is not None:
                self.end_step()
            self.begin_step(step)
        if self._step is None:
            return
        try:
            for key, value in batch.items():
                if value is None:
                    continue
                if isinstance(value, torch.Tensor):
                    arr = value.detach().to("cpu", copy=True).numpy()
                else:
                    arr = np.array(value)
                self._pending_batch.setdefault(key, []).append(arr)
        except Exception as exc:
            self._fail("record_batch", exc)

    def _grad_entries(self) -> list[tuple[int, torch.Tensor | None, int, int, int]]:
        """(parameter index, gradient, dp_shard, dp_rank, dp_size) for every parameter.

        ``dp_shard`` = 1 when the gradient is only this rank's part of the parameter (distributed
        optimizer); the parts of all DP ranks add up as squares. Plain torch: whole gradients.
        """
        dp_rank = int(self.rank_info.get("dp_rank", 0))
        return [(i, self._grad_of(p), 0, dp_rank, 1) for i, (_, p, _) in enumerate(self.params)]

    def record_grads(self, global_norm: float | None = None, where: str = "manual",
                     grads: Sequence[torch.Tensor] | None = None) -> None:
        """Capture every parameter's gradient L2 norm now (before clipping, where the optimizer sees it).

        Called again in the same step (a chained optimizer computes one norm per sub-optimizer), it only
        adds ``global_norm`` to the step's global norm: sqrt(sum of the squares), as Megatron combines them.
        """
        if not self.enabled or self._step is None:
            return
        if not (self.config.local_norms or self.config.nan_trace != "off"):
            return
        if self._norms_recorded:
            if global_norm is not None:
                self._hook_norms.append(float(global_norm))
            return
        try:
            self._norms_recorded = True
            if global_norm is not None:
                self._hook_norms.append(float(global_norm))
            names, numels, parts, trs, tss, owned, shard, dprs, dpss = [], [], [], [], [], [], [], [], []
            by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
            for i, g, dp_shard, dp_rank, dp_size in self._grad_entries():
                if g is None and not dp_shard:
                    continue
                name, _, tp = self.params[i]
                names.append(name)
                numels.append(0 if g is None else g.numel())
                parts.append(tp[0])
                trs.append(tp[1])
                tss.append(tp[2])
                owned.append(i)
                shard.append(dp_shard)
                dprs.append(dp_rank)
                dpss.append(dp_size)
                if g is not None:
                    self._grads_used[i] = g
                    by_device.setdefault(g.device, []).append((len(names) - 1, g))
            norms = np.zeros(len(names), dtype=np.float64)
            for _, items in by_device.items():
                gs = [g if g.dtype in (torch.float32, torch.float64) else g.float() for _, g in items]
                big = [gs[0].device.type == "cpu" and g.numel() > _BLOCKED_ABOVE for g in gs]   # see l2_norm
                small = [g for g, b in zip(gs, big, strict=True) if not b]
                rest = iter(torch._foreach_norm(small) if small else [])
                got = [l2_norm(g) if b else next(rest) for g, b in zip(gs, big, strict=True)]
                vals = torch.stack([n.float() for n in got]).cpu().numpy()
                for (j, _), v in zip(items, vals, strict=True):
                    norms[j] = float(v)
            bad = ~np.isfinite(norms)
            self._step_scalars["nonfinite_grads"] = int(bad.sum())
            self._norm_table = ({
                "name": names if names else np.array([], dtype="S1"),
                "norm": norms, "numel": np.array(numels, dtype=np.int64),
                "tp_partition_dim": np.array(parts, dtype=np.int64),
                "tp_rank": np.array(trs, dtype=np.int64), "tp_size": np.array(tss, dtype=np.int64),
                "dp_shard": np.array(shard, dtype=np.int64), "dp_rank": np.array(dprs, dtype=np.int64),
                "dp_size": np.array(dpss, dtype=np.int64)}, {"where": where})
            if bad.any() and self.config.nan_trace != "off":
                self._trace_grads([owned[j] for j in np.flatnonzero(bad)], where)
        except Exception as exc:
            self._fail("record_grads", exc)
        finally:
            self._grads_used = {}  # references only for the trace above; never held past the hook

    def _flush_norms(self, step: int) -> None:
        """Write the step's local_norm table; its global norm is the optimizer's when a hook gave one."""
        if self._norm_table is None:
            return
        cols, attrs = self._norm_table
        self._norm_table = None
        if self._hook_norms:
            source = "optimizer"
            global_norm = float(math.sqrt(sum(v * v for v in self._hook_norms)))
        else:
            source = "local"
            global_norm = float(math.sqrt(float(np.sum(cols["norm"] ** 2))))
        self._step_scalars["grad_norm"] = global_norm
        if self.config.local_norms and self._array_step and self._writer is not None:
            self._writer.put_table(step, "local_norm", cols,
                                   attrs={**attrs, "global_norm": global_norm, "global_norm_source": source,
                                          "optimizer_norm_calls": len(self._hook_norms)})

    def _trace_grads(self, bad_params: list[int], where: str) -> None:
        """Record the first non-finite gradient: parameter, module, coordinates, and the tensors."""
        pos = {pi: k for k, pi in enumerate(self._grad_order)}
        # First produced in backward when the order is known, else the last in registration order.
        bad_params.sort(key=lambda i: (pos.get(i, len(pos) + (len(self.params) - i)),))
        first = bad_params[0]
        name, p, _ = self.params[first]
        module = name.rsplit(".", 1)[0] if "." in name else ""
        others = [self.params[i][0] for i in bad_params[1:]]
        detail = (f"first non-finite gradient at step {self._step} ({where}); "
                  f"{len(bad_params)} parameter(s) non-finite" + (f"; also: {', '.join(others[:20])}"
                                                                   if others else ""))
        g = self._grads_used.get(first, self._grad_of(p))
        tensors: list[tuple[str, str, torch.Tensor]] = []
        if g is not None:
            tensors.append((module, "grad", g))
        for kind, t in self._io_refs.get(module, {}).items():
            tensors.append((module, kind, t))
        self._write_trace("grad", name, module, detail, tensors, 2)

    def _write_trace(self, kind: str, name: str, module: str, detail: str,
                     tensors: list[tuple[str, str, torch.Tensor]], rank_order: int) -> None:
        """Queue one ``nan_trace`` row (written at ``end_step``); tensors are copied to host now."""
        self.nan_found = True
        ri = self.rank_info
        row = len(self._trace_rows)
        self._trace_rows.append({"kind": kind, "name": name, "module": module, "detail": detail,
                                 "tp_rank": int(ri.get("tp_rank", 0)), "pp_rank": int(ri.get("pp_rank", 0)),
                                 "dp_rank": int(ri.get("dp_rank", 0)), "_order": rank_order})
        for mod, k, t in tensors:
            arr = t.detach().to("cpu", copy=True)
            if arr.is_floating_point():
                arr = arr.float()
            self._trace_tensors.append((row, mod, k, _dtype_name(t.dtype), arr.numpy()))

    def _flush_trace(self, step: int) -> None:
        if not self._trace_rows:
            return
        # Execution order: forward activations, then backward tensors, then parameter gradients.
        order = sorted(range(len(self._trace_rows)), key=lambda r: self._trace_rows[r]["_order"])
        rows = [self._trace_rows[r] for r in order]
        self._step_scalars.setdefault("nan_trace", f"{rows[0]['kind']}:{rows[0]['name']}")
        if self._writer is None:
            return
        cols: dict[str, Any] = {}
        for key in ("kind", "name", "module", "detail"):
            cols[key] = np.array([r[key] for r in rows]).astype(str)
        for key in ("tp_rank", "pp_rank", "dp_rank"):
            cols[key] = np.array([r[key] for r in rows], dtype=np.int64)
        self._writer.put_table(step, "nan_trace", cols)
        new_row = {old: new for new, old in enumerate(order)}
        for i, (row, mod, kind, dtype, arr) in enumerate(self._trace_tensors):
            self._writer.put_array(step, f"nan_trace_tensors/{i}", arr,
                                   {"module": mod, "kind": kind, "dtype": dtype, "row": new_row[row]})

    def log(self, **scalars: Any) -> None:
        """Add scalars (loss, lr, ...) to this step's record."""
        if not self.enabled or self._step is None:
            return
        for k, v in scalars.items():
            try:
                if isinstance(v, torch.Tensor):
                    v = v.detach().item()
                self._step_scalars[k] = v
            except Exception as exc:
                self._fail(f"log {k}", exc)

    def end_step(self, loss: Any = None, **scalars: Any) -> None:
        """Finish the step: write batch, tensor statistics, NaN trace and scalars; close the step file."""
        if not self.enabled or self._step is None:
            return
        if not self._norms_recorded:  # no optimizer hook fired (e.g. Megatron with clip_grad=0)
            self.record_grads(where="end_step")
        self.log(**({"loss": loss} if loss is not None else {}), **scalars)
        step = self._step
        try:
            self._flush_norms(step)
        except Exception as exc:
            self._fail("local_norm", exc)
        try:
            self._flush_batch(step)
        except Exception as exc:
            self._fail("batch", exc)
        try:
            self._flush_tensor_rows(step)
        except Exception as exc:
            self._fail("tensor_stats", exc)
        try:
            self._flush_trace(step)
        except Exception as exc:
            self._fail("nan_trace", exc)
        try:
            self._flush_routing(step)
        except Exception as exc:
            self._fail("routing", exc)
        try:
            if self._writer is not None:
                self._writer.log_scalars(step, self._step_scalars)
        except Exception as exc:
            self._fail("scalars", exc)
        try:
            if self._writer is not None:
                self._writer.finish_step()
        except Exception as exc:
            self._fail("finish_step", exc)
            self._drop_open_step()
        self._release_step_refs()
        self._close_step()
        if self.nan_found and self.config.stop_on_nan:
            raise NonFiniteError(f"non-finite values at step {step} ({self._step_scalars.get('nan_trace')}); "
                                 f"see {self.config.out}")

    def _release_step_refs(self) -> None:
        """Forget the step's rows and every tensor reference it held (at its start and at its end)."""
        self._io_refs.clear()
        self._rows.clear()
        self._row_stats.clear()
        self._stats_cache.clear()
        self._grad_targets.clear()
        self._trace_rows.clear()
        self._trace_tensors.clear()
        self._grads_used = {}
        self._routes = {}
        self._route_counts = {}
        self._count_keys = {}
        self._router_logits = {}

    def _drop_open_step(self) -> None:
        if self._writer is not None:
            with contextlib.suppress(Exception):
                self._writer.abandon_step()

    def _flush_batch(self, step: int) -> None:
        if not self._pending_batch:
            return
        n_micro = max(len(v) for v in self._pending_batch.values())
        batch = merge_micro_batches(self._pending_batch)
        self._pending_batch.clear()
        sc = self._step_scalars
        if "loss_mask" in batch:
            sc["loss_mask_sum"] = float(np.asarray(batch["loss_mask"], dtype=np.float64).sum())
        if "tokens" in batch and batch["tokens"].size:
            sc["token_min"] = int(batch["tokens"].min())
            sc["token_max"] = int(batch["tokens"].max())
            sc["tokens_per_step"] = int(batch["tokens"].size)
        if self._writer is None or not self._array_step:
            return
        if self.config.batch:
            hashes = self._sample_hashes(batch)
            for key, arr in batch.items():
                self._writer.put_array(step, f"batch/{key}", arr, {"micro_batches": n_micro})
            if hashes is not None:
                self._writer.put_array(step, "batch/sample_hash", hashes,
                                       {"micro_batches": n_micro, "hashed": "tokens,labels,loss_mask"})
        if self.config.seed_layout:
            self._writer.write_seed_batch(step, {k: batch[k] for k in SEED_BATCH_KEYS if k in batch})

    def _sample_hashes(self, batch: Mapping[str, np.ndarray]) -> np.ndarray | None:
        """One hash per sample (row) of the step's batch as this rank trained it (runstore.batches.sample_hashes),
        so a replay onto another layout is checked against this side's own record, not a re-computation. Only for
        whole samples: tokens, labels and loss_mask all present with one row each, and no context-parallel cut."""
        from runstore.batches import sample_hashes

        keys = ("tokens", "labels", "loss_mask")
        if "sample_hash" in batch or int(self.rank_info.get("cp", 1) or 1) != 1 or not all(k in batch for k in keys):
            return None
        rows = {np.shape(batch[k])[0] if np.ndim(batch[k]) >= 2 else -1 for k in keys}
        return sample_hashes({k: batch[k] for k in keys}) if len(rows) == 1 and rows != {-1} else None

    def _flush_tensor_rows(self, step: int) -> None:
        if not self._rows:
            return
        stats = _stats_matrix(self._row_stats)
        rows = self._rows
        nonfinite = stats[:, 4] + stats[:, 5] > 0
        if nonfinite.any() and self.config.nan_trace == "all":
            j = int(np.flatnonzero(nonfinite)[0])
            module, kind = rows[j][0], rows[j][1]
            trace_kind = "activation" if kind.startswith("forward") else "grad"
            tensors = [(module, k, t) for k, t in self._io_refs.get(module, {}).items()]
            self._write_trace(trace_kind, module, module,
                              f"first non-finite tensor at step {step}: {module} {kind} (order {j})", tensors,
                              0 if trace_kind == "activation" else 1)
        if not self._tensor_step or self._writer is None:
            return
        cols: dict[str, Any] = {
            "order": np.arange(len(rows), dtype=np.int64),
            "module": [r[0] for r in rows], "kind": [r[1] for r in rows], "dtype": [r[2] for r in rows],
            "shape": [r[3] for r in rows],
            "numel": np.array([r[4] for r in rows], dtype=np.int64)}
        if any(r[5] for r in rows):
            cols["split"] = [r[5] for r in rows]
        for k, name in enumerate(_STAT_COLS):
            cols[name] = stats[:, k].astype(np.int64) if name in ("nan", "inf") else stats[:, k]
        self._writer.put_table(step, "tensor_stats", cols)

    @contextlib.contextmanager
    def step(self, step: int, batch: Mapping[str, Any] | None = None) -> Iterator[TorchDumper]:
        """``with dumper.step(n, batch):`` = ``begin_step(n)``, ``record_batch(batch)`` ... ``end_step()``.

        Call ``dumper.log(loss=...)`` inside the block to attach the loss.
        """
        self.begin_step(step)
        if batch is not None:
            self.record_batch(batch)
        yield self
        self.end_step()

    def close(self) -> None:
        """End an open step, remove every hook and close the writer."""
        if self._step is not None:
            with contextlib.suppress(NonFiniteError):
                self.end_step()
        for h in self._handles:
            with contextlib.suppress(Exception):
                h.remove()
        self._handles.clear()
        for mod in self._router_modules:     # the class's own gating again
            with contextlib.suppress(Exception):
                del mod.gating
        self._router_modules = []
        if self._writer is not None:
            try:
                self._writer.close()
            except Exception as exc:
                self._fail("close", exc)
                self._drop_open_step()

    def __enter__(self) -> TorchDumper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
