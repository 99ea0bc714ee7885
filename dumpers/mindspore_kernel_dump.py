"""Full layer tensors, forward and backward, from the GRAPH-mode MindSpore run that trains: MindSpore's own kernel
dump of identity kernels our code puts at the selected cells' boundaries.

Why this way (measured on CPU, MindSpore 2.10, the MindFormers mcore dense model, by hand and in
tests/test_graph_full_tensors.py):

* In-graph Parameters (dumpers/mindspore_graph_capture.py) carry statistics only: full tensors would need a
  Parameter of each output's shape before compiling. Not tried further.
* MindSpore's kernel dump (``MINDSPORE_DUMP_CONFIG``, e2e ``dump_mode`` 1, ``kernels`` filter) writes every
  kernel's tensors, but the kernels' scopes do not name the cells reliably in a real model: MindFormers'
  ``RowParallelLinear`` runs through ``Morph``, whose kernels lose the cell scope (``linear_proj`` and
  ``linear_fc2``'s MatMul are ``Default/MatMul-op2``, so ``self_attention``'s last scoped kernel is a Cast
  *before* the projection); backward kernels are merged across layers (layer 1's RMSNorm gradient kernels carry
  ``Gradients/.../0-TransformerLayer/...``) or have no cell at all (``Gradients/Default/Grad_MatMul/MatMul-op17``).
  A cell's output gradient cannot be read from ``Gradients/`` scopes.
* What works: each selected cell is wrapped, before the first compile, in a :class:`KernelTapCell` whose
  ``xf_tap_in`` / ``xf_tap_out`` children pass the cell's first input and first output through an ``Identity``
  kernel (one primitive instance per tap, so the kernel keeps the tap's scope; a shared function would carry the
  first caller's scope) with a custom ``bprop`` that passes the incoming gradient through another ``Identity``.
  Both kernels keep the tap's scope (``.../mlp-KernelTapCell/xf_tap_out-KernelTap/Identity-op0`` forward,
  ``...-op1`` backward: the custom bprop's kernels are not under ``Gradients/``), survive graph optimisation,
  and copy bits: losses and weights equal bit for bit with and without the taps. The dump's ``kernels`` filter
  ``name-regex(.*/xf_tap_(in|out)-.*)`` (a full match) keeps only them, ``input_output`` 2 (outputs), and
  ``iteration`` the selected steps (iteration = step - 1 in a plain loop). The reader
  (sources/mindspore_dump.py, ``tap_rows``) turns them into the run store's rows: ``forward.input.0``,
  ``forward.output.0`` (first in execution order) and ``backward.grad_output.0`` (second), with ``ref`` the
  .npy; the input's gradient through the cell is ``backward.cell_grad_input.0`` (not the torch dumper's
  ``backward.grad_input.0``, the input's whole gradient: they differ for a norm whose input the residual uses).
* MindSpore reads ``MINDSPORE_DUMP_CONFIG`` once per process, at its first graph compile (measured: set after a
  training graph compiled, nothing is written). The capture is refused when any graph was compiled already.

Size: estimated before compiling from the cells' weights and the tokens per step (``tokens`` x the width of
each tapped tensor x its itemsize, forward and backward, per step) and printed; over ``budget_mib`` the capture
is refused (:class:`CaptureBudgetExceeded`, one line) before anything is changed. After the run
:meth:`KernelDumpCapture.finish` prints the measured size (the files under the dump folder).
"""

from __future__ import annotations

import fnmatch
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mindspore as ms
from mindspore import nn
from mindspore.ops import operations as P

from core.errors import BadInput

# Cell attribute names the reader (sources/mindspore_dump.py: TAP_IN, TAP_OUT, TAP_INNER) looks for in scopes.
TAP_IN, TAP_OUT, TAP_INNER = "xf_tap_in", "xf_tap_out", "xf_inner"
DUMP_DIR = "kernel_dump"
CONFIG_FILE = "kernel_dump_config.json"
RECORD_FILE = "kernel_dump.json"
ENV = "MINDSPORE_DUMP_CONFIG"
KERNEL_FILTER = f"name-regex(.*/({TAP_IN}|{TAP_OUT})-.*)"
DEFAULT_BUDGET_MIB = 1024.0
_FLOATS = (ms.float32, ms.float16, ms.bfloat16, ms.float64)


class CaptureBudgetExceeded(BadInput):
    """The estimated capture is larger than the budget: nothing was wrapped, no dump configured."""


class KernelTap(nn.Cell):
    """Identity forward and backward, each through its own ``Identity`` kernel the dump can select by scope."""

    def __init__(self) -> None:
        super().__init__()
        self.fwd = P.Identity()
        self.bwd = P.Identity()

    def construct(self, x: Any) -> Any:
        return self.fwd(x)

    def bprop(self, x: Any, out: Any, dout: Any) -> tuple[Any]:
        return (self.bwd(dout),)


class KernelTapCell(nn.Cell):
    """``inner`` with its first input and first output passed through a :class:`KernelTap` each."""

    def __init__(self, inner: nn.Cell) -> None:
        super().__init__(auto_prefix=False)
        setattr(self, TAP_INNER, inner)
        setattr(self, TAP_IN, KernelTap())
        setattr(self, TAP_OUT, KernelTap())

    def construct(self, *args: Any, **kwargs: Any) -> Any:
        inner = getattr(self, TAP_INNER)
        if args and isinstance(args[0], ms.Tensor) and args[0].dtype in _FLOATS:
            out = inner(getattr(self, TAP_IN)(args[0]), *args[1:], **kwargs)
        else:
            out = inner(*args, **kwargs)
        if isinstance(out, tuple):
            if out and isinstance(out[0], ms.Tensor) and out[0].dtype in _FLOATS:
                return (getattr(self, TAP_OUT)(out[0]),) + out[1:]
            return out
        if isinstance(out, ms.Tensor) and out.dtype in _FLOATS:
            return getattr(self, TAP_OUT)(out)
        return out


def _cells(cell: nn.Cell, prefix: str = "") -> list[tuple[str, nn.Cell, str, nn.Cell]]:
    """(name, parent, attribute, child) below ``cell``, pre-order; a tap wrapper stands for the cell it wraps."""
    out = []
    for attr, child in cell._cells.items():   # noqa: SLF001 - CellList children are only reachable this way
        if child is None or attr in (TAP_IN, TAP_OUT):
            continue
        name = f"{prefix}{attr}"
        out.append((name, cell, attr, child))
        inner = getattr(child, TAP_INNER) if isinstance(child, KernelTapCell) else child
        out.extend(_cells(inner, name + "."))
    return out


def _itemsize(cell: nn.Cell) -> int:
    for p in cell.get_parameters():
        return int(ms.dtype_to_nptype(p.dtype)().itemsize)
    return 4


def tensor_widths(cell: nn.Cell, hidden: int) -> tuple[int, int]:
    """(input width, output width) of a cell's tapped tensors per token: a linear's weight [out, in] gives both
    (an embedding [vocab, hidden]: integer ids in, not tapped); any other cell keeps the hidden width."""
    own = [p for p in cell.get_parameters(expand=False) if len(p.shape) == 2]
    if own:
        w = own[0]
        if "embedding" in w.name:
            return 0, int(w.shape[1])
        return int(w.shape[1]), int(w.shape[0])
    return hidden, hidden


def estimate_bytes(cells: Sequence[tuple[str, nn.Cell]], tokens: int, hidden: int,
                   backward: bool = True) -> dict[str, int]:
    """Bytes one step's capture writes per cell: tokens x (input + output width) x itemsize, twice with the
    gradients. The .npy headers (128 bytes per file) are left out."""
    out = {}
    for name, cell in cells:
        w_in, w_out = tensor_widths(cell, hidden)
        out[name] = tokens * (w_in + w_out) * _itemsize(cell) * (2 if backward else 1)
    return out


def _mib(n: float) -> str:
    return f"{n / 2 ** 20:.2f} MiB"


def _any_graph_compiled() -> bool:
    try:
        from mindspore.graph.api import cells_compile_cache
    except ImportError:
        return False
    return any(bool(c) for c in list(cells_compile_cache.values()))


def _model_config(net: nn.Cell) -> Any:
    for c in (net, getattr(net, "model", None), getattr(net, "network", None)):
        cfg = getattr(c, "config", None)
        if cfg is not None and getattr(cfg, "hidden_size", None):
            return cfg
    return None


def parse_steps(steps: Any) -> list[int]:
    """Steps as a list of ints from ``[1, 2]``, ``"1-2"``, ``"1,3"`` or ``1``; BadInput for anything else."""
    try:
        if isinstance(steps, int):
            return [steps]
        if isinstance(steps, str):
            out: list[int] = []
            for part in steps.split(","):
                a, _, b = part.strip().partition("-")
                out += list(range(int(a), int(b) + 1)) if b else [int(a)]
            return sorted(set(out))
        return sorted({int(s) for s in steps})
    except (TypeError, ValueError):
        raise BadInput(f"kernel dump steps {str(steps)[:40]!r}: expected steps such as [1, 2] or '1-2'") from None


class KernelDumpCapture:
    """Full tensors of the cells of ``net`` matching ``cells`` (fnmatch patterns on the model's own cell names,
    mcore: ``decoder.layers.1.*``) at ``steps``, from MindSpore's kernel dump of the GRAPH step that trains.

    Make it after the model is built and before the training cell's first compile (in the process's first
    compile: MindSpore reads the dump config once). It prints the estimated size and refuses
    (:class:`CaptureBudgetExceeded`) over ``budget_mib``; else it wraps the cells, writes
    ``out_dir/kernel_dump_config.json`` and sets ``MINDSPORE_DUMP_CONFIG``. After training call :meth:`finish`:
    it prints the measured size and writes ``out_dir/kernel_dump.json``. A run store in ``out_dir`` whose meta.json
    holds :meth:`store_meta` reads its layer rows from the dump: ``align report BASELINE out_dir`` compares them.
    Both directions always (forward and backward kernels of every tap).
    """

    def __init__(self, net: nn.Cell, out_dir: str | os.PathLike, cells: Sequence[str] = ("decoder.layers.*",),
                 steps: Any = (1,), *, tokens: int | None = None, hidden_size: int | None = None,
                 budget_mib: float = DEFAULT_BUDGET_MIB, printer: Callable[[str], None] | None = None) -> None:
        self.net = net
        self.out = Path(out_dir)
        self.steps = parse_steps(steps)
        self.say = printer or (lambda msg: print(msg, file=sys.stderr, flush=True))
        if not self.steps or self.steps[0] < 1:
            raise BadInput(f"{self.out}: kernel dump steps {steps!r}: steps count from 1")
        cfg = _model_config(net)
        hidden = hidden_size or getattr(cfg, "hidden_size", None)
        if tokens is None and cfg is not None:
            seq, mbs = getattr(cfg, "seq_length", None), getattr(cfg, "batch_size", None)
            tokens = int(seq) * int(mbs or 1) if seq else None
        if not hidden or not tokens:
            raise BadInput(f"{self.out}: kernel dump size unknown: pass tokens= (micro batch x sequence length) and "
                           f"hidden_size= (the model has no config with hidden_size / seq_length)")
        chosen = [(n, parent, attr, child) for n, parent, attr, child in _cells(net)
                  if any(fnmatch.fnmatchcase(n, p) for p in cells)
                  and not isinstance(child, (nn.CellList, nn.CellDict))]
        if not chosen:
            raise BadInput(f"{self.out}: kernel dump cells {list(cells)} match no cell of the model")
        inner = [(n, getattr(c, TAP_INNER) if isinstance(c, KernelTapCell) else c) for n, _, _, c in chosen]
        self.per_cell = estimate_bytes(inner, int(tokens), int(hidden))
        self.estimate = sum(self.per_cell.values()) * len(self.steps)
        self.budget = float(budget_mib) * 2 ** 20
        self.say(f"xf-align kernel dump: {len(chosen)} cells x {len(self.steps)} steps "
                 f"({tokens} tokens, hidden {hidden}): estimated {_mib(self.estimate)}, budget {_mib(self.budget)}")
        if self.estimate > self.budget:
            raise CaptureBudgetExceeded(
                f"{self.out}: kernel dump of {len(chosen)} cells x {len(self.steps)} steps is estimated at "
                f"{_mib(self.estimate)}, over the budget of {_mib(self.budget)}: select fewer cells or steps, "
                f"or raise the budget")
        if os.environ.get(ENV):
            raise BadInput(f"{self.out}: {ENV} is set already ({os.environ[ENV]}): the kernel dump capture writes "
                           f"its own config")
        if _any_graph_compiled():
            raise BadInput(f"{self.out}: a graph was compiled in this process already; MindSpore reads {ENV} once, "
                           f"at the first compile: make the capture before any graph runs (a fresh process)")
        names = {id(p): p.name for p in net.get_parameters()}
        for _name, parent, attr, child in sorted(chosen, key=lambda c: -c[0].count(".")):
            if not isinstance(child, KernelTapCell):
                parent.insert_child_to_cell(attr, KernelTapCell(child))
        for p in net.get_parameters():     # inserting a cell re-prefixes the names below it
            if id(p) in names:
                p.name = names[id(p)]
        self.cells = [n for n, _, _, _ in chosen]
        self.dump_dir = self.out / DUMP_DIR
        self.out.mkdir(parents=True, exist_ok=True)
        config = {"common_dump_settings": {
            "dump_mode": 1, "path": str(self.dump_dir.resolve()), "net_name": "Net",
            "iteration": "|".join(str(s - 1) for s in self.steps), "saved_data": "tensor", "input_output": 2,
            "kernels": [KERNEL_FILTER], "support_device": [0, 1, 2, 3, 4, 5, 6, 7]},
            "e2e_dump_settings": {"enable": True, "trans_flag": True}}
        path = self.out / CONFIG_FILE
        path.write_text(json.dumps(config, indent=1))
        os.environ[ENV] = str(path.resolve())
        self.measured: int | None = None

    def store_meta(self) -> dict[str, Any]:
        """What a run store's meta.json says about this capture (``layer_capture``): the layer source reads the
        dump folder it names, relative to the store. After :meth:`finish` found no tensor file (the steps never
        ran, or MindSpore had read its dump config before), it names none and says so: the store's other
        evidence stays readable."""
        cap: dict[str, Any] = {"mode": "GRAPH", "mechanism": "kernel dump of identity taps", "kernel_dump": DUMP_DIR,
                               "cells": self.cells, "steps": self.steps, "estimated_bytes": self.estimate}
        if self.measured is not None:
            cap["measured_bytes"] = self.measured
            if self.measured == 0:
                cap.update(kernel_dump=None, captured=False,
                           why=f"no tensor file under {self.dump_dir}: steps {self.steps} not trained, or MindSpore "
                               f"read {ENV} before the capture set it")
        return {"layer_capture": cap}

    def restore_names(self) -> int:
        """Take the wrapper's ``xf_inner`` segment out of Parameter names again; returns how many were renamed.

        Why: at the first compile MindSpore renames the Parameters a graph assigns to (MoE routers' ``fi_accu``,
        ``expert_bias``, ``expert_load``) by their cell path, which then runs through the wrapper (measured:
        ``network.network.model.decoder.layers.0.xf_inner.mlp.xf_inner.router.xf_inner.fi_accu``); a checkpoint
        saved afterwards would carry that name. Call after the first step (the callback does); values and later
        steps are unchanged (bit-identical runs measured with the rename after step 1)."""
        n = 0
        for p in self.net.get_parameters():
            if f".{TAP_INNER}." in p.name:
                p.name = p.name.replace(f".{TAP_INNER}.", ".")
                n += 1
        return n

    def finish(self) -> int:
        """After training: the measured size of the dump's tensor files (printed, with the folder's whole size,
        and written to ``out_dir/kernel_dump.json``)."""
        os.environ.pop(ENV, None)       # read at the first compile already; not inherited by child processes
        self.restore_names()
        files = [p for p in self.dump_dir.rglob("*") if p.is_file()] if self.dump_dir.is_dir() else []
        tensors = [p for p in files if p.suffix == ".npy"]
        self.measured = sum(p.stat().st_size for p in tensors)
        total = sum(p.stat().st_size for p in files)
        self.say(f"xf-align kernel dump: measured {_mib(self.measured)} in {len(tensors)} tensor files "
                 f"(estimated {_mib(self.estimate)}); {_mib(total)} with MindSpore's IR and order files, "
                 f"under {self.dump_dir}")
        (self.out / RECORD_FILE).write_text(json.dumps(
            {"cells": self.cells, "steps": self.steps, "estimated_bytes": self.estimate,
             "measured_bytes": self.measured, "total_bytes": total, "budget_bytes": self.budget,
             "tensor_files": len(tensors)}, indent=1))
        return self.measured
