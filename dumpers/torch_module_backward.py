"""Baseline side of backward isolation, inside a PyTorch / Megatron training step: each chosen module's
inputs, output gradient, and the gradients the module itself computes from them (input and weight gradients).

Why a capture of its own (not the dumper's ``backward.grad_input`` rows): a tensor hook sees the *whole*
gradient of a tensor, and a module's input is often used elsewhere too (a norm's input is also the residual's),
so its gradient is not what the module computed. Here each module is replayed once after backward on its own
captured inputs and fed its captured output gradient (``torch.autograd.grad``): its input gradients and weight
gradients are the module's own vector-Jacobian product, the very thing the candidate's module is asked for in
``dumpers.mindspore_isolation`` (``backward=True``). The replay never touches ``.grad`` / ``main_grad``.

Use, at the tensor step, on the process that holds the modules (TP = 1, or TP without sequence parallelism:
the replay runs the module's own collectives, so every TP rank must call ``end_step``):

    cap = ModuleBackwardCapture(model, "runs/baseline", modules=["decoder.layers.?", "decoder.layers.*.mlp"],
                                steps=[1])
    cap.begin_step(1)
    loss = forward(...); loss.backward()
    cap.end_step()                 # writes RUN/evidence/module_backward/step_000001_rank_00000.npz
    optimizer.step()

The file: ``meta`` (JSON: step, rank, per module its inputs by key (the ``forward`` parameter's name), its
parameters, the output's dtype) and arrays ``input/<module>/<key>``, ``output/<module>``,
``grad_output/<module>``, ``grad_input/<module>/<key>`` (floating inputs), ``grad_weight/<module>/<param>``
and ``weight/<module>/<param>`` (global parameter names; the weights as the module computed with them).
The loss: Megatron computes it in a function (``compute_language_model_loss`` on the GPT model, then the
training script's masked mean), not a module. A pattern matching ``loss`` captures it as a module named
``loss``: its inputs (the logits, as the output layer gave them; the labels; the loss_mask the model was
given, as pretrain_gpt's forward_step passes it), the logits' gradient, and a replay of Megatron's own
function with the masked mean ``sum(ce * loss_mask) / sum(loss_mask)``. The replay is fed the scalar output
gradient that makes it match the logits' gradient of the training step (``grad_output/loss``: 1 for a plain
mean, else the loss scale / micro-batch factor); ``replay_rel_l2`` is how far the replayed logits gradient is
from the training step's (not 0: the reduction is not that masked mean).

Refused in one line: Megatron's gradient-accumulation fusion (its linear layers
then add the weight gradient into ``main_grad`` in backward, and a replay would add it twice).
"""

from __future__ import annotations

import fnmatch
import inspect
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runstore import atomic_file
from runstore.layout import evidence_step_file

BACKWARD_DIR = "module_backward"
LOSS = "loss"          # the loss function's inputs and gradients are captured under this module name


def backward_file(run_dir: str | Path, step: int, rank: int = 0) -> Path:
    """Where the capture of ``step`` on ``rank`` lives."""
    return evidence_step_file(run_dir, BACKWARD_DIR, step, rank)


def _np(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.float()
    return t.cpu().numpy().copy()


def _first_tensor(obj: Any) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, (tuple, list)):
        for item in obj:
            t = _first_tensor(item)
            if t is not None:
                return t
    return None


def _arg_name(mod: torch.nn.Module, i: int) -> str:
    """The name of ``mod.forward``'s ``i``-th positional parameter (the key its input is stored under: the
    candidate's cell is matched by it), else ``str(i)``."""
    try:
        names = [p.name for p in inspect.signature(mod.forward).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        names = []
    return names[i] if i < len(names) else str(i)


def _rank() -> int:
    import torch.distributed as dist

    return int(dist.get_rank()) if dist.is_available() and dist.is_initialized() else 0


class ModuleBackwardCapture:
    """Forward hooks on the chosen modules keep each one's first call at a chosen step (inputs cloned, so a later
    in-place change cannot alter them) and its output gradient; :meth:`end_step` replays each module."""

    def __init__(self, model: torch.nn.Module | Sequence[torch.nn.Module], run_dir: str | Path,
                 modules: Sequence[str], steps: Iterable[int] = (1,), *, rank: int | None = None) -> None:
        from dumpers.megatron import global_namer

        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        self.run_dir, self.steps, self.rank = Path(run_dir), {int(s) for s in steps}, rank
        self._mods: list[tuple[str, torch.nn.Module]] = []
        for chunk in chunks:
            name_of = global_namer(chunk)
            for name, mod in chunk.named_modules():
                gname = name_of(name)
                if gname and any(fnmatch.fnmatchcase(gname, p) for p in modules):
                    if getattr(getattr(mod, "config", None), "gradient_accumulation_fusion", False):
                        raise ValueError(f"{gname}: gradient_accumulation_fusion is on (its linear layers add the "
                                         "weight gradient into main_grad in backward): a replay would add it twice")
                    self._mods.append((gname, mod))
        self._loss_model = None
        if any(fnmatch.fnmatchcase(LOSS, p) for p in modules):
            self._loss_model = next((m for c in chunks for m in c.modules()
                                     if hasattr(m, "compute_language_model_loss") and getattr(m, "post_process", True)),
                                    None)
        if not self._mods and self._loss_model is None:
            raise ValueError(f"no module matches {list(modules)}")
        self._step: int | None = None
        self._calls: dict[str, dict[str, Any]] = {}
        self._handles = [mod.register_forward_hook(self._hook(name), with_kwargs=True) for name, mod in self._mods]
        self._loss_fn = None
        if self._loss_model is not None:
            self._handles.append(self._loss_model.register_forward_pre_hook(self._loss_mask_hook, with_kwargs=True))
            self._loss_fn = self._loss_model.compute_language_model_loss
            self._loss_model.compute_language_model_loss = self._loss_wrapper

    def _loss_mask_hook(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self._step is not None and torch.is_grad_enabled():
            mask = kwargs.get("loss_mask")
            self._calls.setdefault("_loss_mask", {})["loss_mask"] = \
                mask.detach().clone() if isinstance(mask, torch.Tensor) else None

    def _loss_wrapper(self, labels: torch.Tensor, logits: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Megatron's ``compute_language_model_loss``, its inputs kept at the chosen step (the last call: the
        main loss comes after MTP's)."""
        assert self._loss_fn is not None
        if self._step is not None and torch.is_grad_enabled() and isinstance(logits, torch.Tensor):
            call: dict[str, Any] = {"labels": labels.detach().clone(), "logits": logits.detach().clone(),
                                    "grad_output": None}
            self._calls[LOSS] = call
            if logits.requires_grad:
                def grab(g: torch.Tensor) -> None:
                    call["grad_output"] = g.detach().clone()
                logits.register_hook(grab)
        return self._loss_fn(labels, logits, *args, **kwargs)

    def _hook(self, name: str):  # noqa: ANN202
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if self._step is None or name in self._calls or not torch.is_grad_enabled():
                return
            out = _first_tensor(output)
            if out is None:
                return
            call: dict[str, Any] = {
                "args": tuple(a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args),
                "kwargs": {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()},
                "output": out.detach().clone(), "grad_output": None}
            self._calls[name] = call
            if out.requires_grad:
                def grab(g: torch.Tensor) -> None:
                    call["grad_output"] = g.detach().clone()
                out.register_hook(grab)
        return hook

    def begin_step(self, step: int) -> None:
        """Arm the hooks when ``step`` is one of the chosen steps."""
        self._calls = {}
        self._step = int(step) if int(step) in self.steps else None

    def end_step(self) -> Path | None:
        """After backward, before the optimizer step: replay each captured module and write the file (None at a
        step not chosen). Modules whose output got no gradient are listed in meta ``skipped``."""
        if self._step is None:
            return None
        arrays: dict[str, np.ndarray] = {}
        mods, skipped = [], []
        for name, mod in self._mods:
            call = self._calls.get(name)
            if call is None or call["grad_output"] is None:
                skipped.append({"module": name, "reason": "not called at this step" if call is None else
                                "its output got no gradient"})
                continue
            try:
                mods.append(self._replay(name, mod, call, arrays))
            except Exception as exc:  # noqa: BLE001 - a capture never stops training: the module is listed
                for k in [k for k in arrays if k.split("/", 2)[1:2] == [name]]:
                    del arrays[k]
                skipped.append({"module": name, "reason": f"replay failed: {type(exc).__name__}: "
                                f"{' '.join(str(exc).split())[:200]}"})
        if self._loss_model is not None:
            try:
                mods.append(self._replay_loss(arrays))
            except ValueError as exc:
                for k in [k for k in arrays if k.split("/", 2)[1:2] == [LOSS]]:
                    del arrays[k]
                skipped.append({"module": LOSS, "reason": str(exc)})
        step, self._step, self._calls = self._step, None, {}
        rank = _rank() if self.rank is None else self.rank
        meta = {"step": step, "rank": rank, "modules": mods, "skipped": skipped}
        dest = backward_file(self.run_dir, step, rank)
        with atomic_file(dest) as fh:
            np.savez(fh, meta=np.array(json.dumps(meta)), **arrays)
        return dest

    def _replay(self, name: str, mod: torch.nn.Module, call: dict[str, Any], arrays: dict[str, np.ndarray]
                ) -> dict[str, Any]:
        keyed = [(_arg_name(mod, i), a) for i, a in enumerate(call["args"])] + list(call["kwargs"].items())
        leaves: dict[str, torch.Tensor] = {}
        inputs = []
        for key, v in keyed:
            if isinstance(v, torch.Tensor):
                arrays[f"input/{name}/{key}"] = _np(v)
                if v.is_floating_point():
                    leaves[key] = v.detach().clone().requires_grad_(True)
                inputs.append({"key": key, "dtype": str(v.dtype).replace("torch.", ""), "shape": list(v.shape),
                               "grad": v.is_floating_point()})
        params = [(f"{name}.{n}", p) for n, p in mod.named_parameters() if p.requires_grad]
        # the module gets copies of the leaves (a module may write its input in place: Megatron's mask fill)
        args = tuple(leaves[_arg_name(mod, i)].clone() if _arg_name(mod, i) in leaves else a
                     for i, a in enumerate(call["args"]))
        kwargs = {k: leaves[k].clone() if k in leaves else v for k, v in call["kwargs"].items()}
        with torch.enable_grad():
            out = _first_tensor(mod(*args, **kwargs))
            assert out is not None
            targets = list(leaves.values()) + [p for _, p in params]
            grads = torch.autograd.grad(out, targets, grad_outputs=call["grad_output"].to(out.dtype),
                                        allow_unused=True)
        replay = float(torch.linalg.vector_norm((out.detach() - call["output"]).double())
                       / max(float(torch.linalg.vector_norm(call["output"].double())), 1e-30))
        arrays[f"output/{name}"] = _np(call["output"])
        arrays[f"grad_output/{name}"] = _np(call["grad_output"])
        for key, g in zip(leaves, grads[:len(leaves)], strict=True):
            if g is not None:
                arrays[f"grad_input/{name}/{key}"] = _np(g)
        used = []
        for (pname, p), g in zip(params, grads[len(leaves):], strict=True):
            if g is not None:
                arrays[f"grad_weight/{name}/{pname}"] = _np(g)
                arrays[f"weight/{name}/{pname}"] = _np(p)      # what `align repro` hands on with the inputs
                used.append(pname)
        return {"module": name, "inputs": inputs, "params": used, "dtype": str(out.dtype).replace("torch.", ""),
                "replay_rel_l2": replay}

    def _replay_loss(self, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
        """The loss as a module: Megatron's own loss function on the captured logits and labels, the masked
        mean over loss_mask; fed the output gradient that matches the step's logits gradient."""
        call = self._calls.get(LOSS)
        mask = (self._calls.get("_loss_mask") or {}).get("loss_mask")
        if call is None or call["grad_output"] is None:
            raise ValueError("the loss function was not called at this step, or its logits got no gradient")
        if mask is None:
            raise ValueError("the model was not given loss_mask (pretrain_gpt's forward_step passes it)")
        assert self._loss_fn is not None
        logits = call["logits"].detach().clone().requires_grad_(True)
        m = mask.float()
        with torch.enable_grad():
            per_token = self._loss_fn(call["labels"], logits.clone())
            loss = (per_token.float() * m).sum() / m.sum()
            (g1,) = torch.autograd.grad(loss, [logits])
        g, g1d = call["grad_output"].double(), g1.detach().double()
        scale = float((g * g1d).sum() / max(float((g1d * g1d).sum()), 1e-300))
        own = g1d * scale
        replay = float(torch.linalg.vector_norm(own - g) / max(float(torch.linalg.vector_norm(g)), 1e-30))
        arrays[f"input/{LOSS}/logits"] = _np(call["logits"])
        arrays[f"input/{LOSS}/labels"] = call["labels"].cpu().numpy().copy()
        arrays[f"input/{LOSS}/loss_mask"] = _np(mask)
        arrays[f"output/{LOSS}"] = np.asarray(float(loss.detach()), np.float32)
        arrays[f"grad_output/{LOSS}"] = np.asarray(scale, np.float32)
        arrays[f"grad_input/{LOSS}/logits"] = own.float().numpy()
        inputs = [{"key": "logits", "dtype": str(logits.dtype).replace("torch.", ""), "shape": list(logits.shape),
                   "grad": True},
                  {"key": "labels", "dtype": str(call["labels"].dtype).replace("torch.", ""),
                   "shape": list(call["labels"].shape), "grad": False},
                  {"key": "loss_mask", "dtype": str(mask.dtype).replace("torch.", ""), "shape": list(mask.shape),
                   "grad": False}]
        return {"module": LOSS, "inputs": inputs, "params": [], "dtype": str(per_token.dtype).replace("torch.", ""),
                "replay_rel_l2": replay, "reduction": "sum(ce * loss_mask) / sum(loss_mask)", "grad_scale": scale}

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._loss_model is not None and "compute_language_model_loss" in self._loss_model.__dict__:
            del self._loss_model.compute_language_model_loss
