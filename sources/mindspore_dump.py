"""MindSpore's own GRAPH-mode dump (MINDSPORE_DUMP_CONFIG), opened as a layer-tensor source.

What MindSpore writes (tutorials "Using Dump in the Graph Mode", r2.10.0, CPU/GPU and Ascend ms_backend
sections; measured on CPU with MindSpore 2.10, tests/data/mindspore_dump/make_mindspore_dumps.py)::

    PATH/rank_{R}/{net_name}/{graph_id}/{iteration}/{op_type}.{op_name}.{task_id}.{stream_id}.{timestamp}
                                          .{input|output}.{slot}.{format}.{dtype}.npy   (saved_data tensor|full)
    PATH/rank_{R}/{net_name}/{graph_id}/{iteration}/statistic.csv                   (statistic|full)
    PATH/rank_{R}/execution_order/ms_execution_order_graph_{graph_id}.csv   kernels' full scope names, in order

A kernel's full name is its graph scope: ``Default/network-CausalLM/model-GPTModel/decoder-TransformerBlock/
layers-CellList/1-TransformerLayer/mlp-MLP/linear_fc2-Dense/BiasAdd-op0`` (``attribute-Class`` per cell, the
op last; backward kernels start with ``Gradients/``). In file names and statistic.csv the ``/`` is written
``_`` (CPU, and the statistic.csv sample in msprobe's code_mapping test) or ``--`` (Ascend); the execution
order file resolves ``_`` exactly, without it the scope is split on ``-`` / ``_`` (ambiguous only when a
cell *class* name holds ``_``). statistic.csv: ``Op Type,Op Name,Task ID,Stream ID,Timestamp,IO,Slot,Data
Size,Data Type,Shape`` then the ``statistic_category`` columns (``Max Value``, ``Min Value``, ``Avg Value``,
``L2Norm Value``, ``NaN Count``, ...). CPU writes tensors only ("storing statistic dump is only supported
on GPU and Ascend"), so statistic.csv is read as documented, not as measured.

Rows are cell outputs, forward only: for every cell scope (each prefix of a kernel's scope) the outputs of
the last kernel executed inside it, i.e. the kernel whose output leaves the cell (its output 0: a LayerNorm
kernel's mean and rstd are not the cell's; a cell returning a tuple shows one tensor), in the run store's
``tensor_stats`` vocabulary, inner cells before the cells that end with them (as forward hooks fire). The
module name is the cell path below the training wrappers (``network`` / ``_backbone`` attributes) and, for
an mcore model, below the ``GPTModel`` cell (MindFormers' mcore names are Megatron's:
``decoder.layers.1.mlp.linear_fc2``). MindSpore iterations count from 0: iteration N is step N + 1.
Measured quirk (CPU): a Reshape kernel's output file keeps its input's shape (a Dense cell's output is
dumped 8x8 for a 2x4x8 result; same numbers). Not read: parameters, and backward kernels (``Gradients/...``) of
a plain dump: their scopes do not map to cells (measured on the MindFormers mcore dense model in GRAPH: layer 1's
RMSNorm gradient kernels carry ``Gradients/.../0-TransformerLayer/...``, merged with layer 0's; the linear
gradients are ``Gradients/Default/Grad_MatMul/MatMul-opN`` with no cell; and ``RowParallelLinear``'s forward
MatMul runs through ``Morph`` as ``Default/MatMul-opN``, so even a cell's last forward kernel can be one before
its output). A dump of our identity taps (dumpers/mindspore_kernel_dump.py) is read instead by
:meth:`MindSporeDump.tap_rows`: every tap kernel keeps its cell's scope, forward and backward (its custom bprop's
kernel is not under ``Gradients/``), so forward and backward rows come out by cell, with the .npy as ``ref``.

msprobe's static-graph kernel dump (``PrecisionDebugger`` with ``level: L2`` in GRAPH mode) is this dump:
* jit_level O0/O1: msprobe writes ``{dump_path}/kernel_kbyk_dump.json`` (net_name ``Net``, statistic_category
  max/min/avg/l2norm) and points MINDSPORE_DUMP_CONFIG at it (mindstudio-probe 26.2.0,
  msprobe/mindspore/dump/dump_processor/kernel_kbyk_dump.py, KernelKbykDump.__init__ / handle); MindSpore then
  writes the layout above under ``{dump_path}/rank_R/Net/``. Measured on CPU: tests/data/msprobe_graph/.
* jit_level O2 (GE, msprobe built with ``--include-mod=adump``; msprobe docs/en/dump/mindspore_data_dump_instruct.md,
  "Dump Result File > Static Graph")::

      {dump_path}/acl_dump_{device_id}.json                                   (intermediate file, not read)
      {dump_path}/rank_{R}/{timestamp}/step_{S}/{op_type}.{op_name}.{task_id}.{stream_id}.{timestamp}
                                         .{input|output}.{slot}.{format}.{DTYPE}.npy
      {dump_path}/rank_{R}/{timestamp}/step_{S}/mapping.csv   32-digit file name -> original name (> 255 chars)

  DTYPE is the ACL name (``FLOAT``, ``FLOAT16``, ``BF16``, ``INT32``); a dtype .npy cannot hold (bf16) is
  written raw, without ``.npy``: such tensors are read only through a statistic.csv beside them. No
  execution_order: kernels are ordered by timestamp. msprobe counts steps from 0: step_S is step S + 1.
  Read as documented (O2 needs Ascend), not as measured.
The L0 (cell) static-graph dump has the dynamic-graph layout (step*/rank*/dump.json): sources/msprobe.py.
"""

from __future__ import annotations

import csv
import math
import re
from dataclasses import dataclass, field
from io import StringIO
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from core.errors import BadInput
from runstore.schema import read_text, regular_file
from sources import Source
from sources.msprobe import normalise_dtype

if TYPE_CHECKING:
    from runstore.run import Run

STAT_CSV = "statistic.csv"
ORDER_DIR = "execution_order"
_RANK_RE = re.compile(r"^rank_(\d+)$")
_ORDER_RE = re.compile(r"^ms_execution_order_graph_(\d+)\.csv$")
_STEP_RE = re.compile(r"^step_(\d+)$")              # msprobe O2 (adump): rank_R/{timestamp}/step_S/
MAPPING_CSV = "mapping.csv"
_ACL_DTYPES = {"BF16": "bfloat16"}                  # the others (FLOAT, FLOAT16, DOUBLE) normalise as they are
_STAT_HEAD = ("Op Type", "Op Name", "Task ID", "Stream ID", "Timestamp", "IO", "Slot", "Data Size", "Data Type",
              "Shape")
_STAT_COLS = {"max": "Max Value", "min": "Min Value", "mean": "Avg Value", "norm": "L2Norm Value",
              "nan": "NaN Count", "ninf": "Negative Inf Count", "pinf": "Positive Inf Count"}
WRAPPER_ATTRS = ("network", "_backbone")     # TrainOneStepCell / WithLossCell / _VirtualDatasetCell / ...
MODEL_ROOTS = ("GPTModel",)                  # MindFormers mcore: names below it are Megatron's


def split_npy_name(name: str) -> tuple[str, str, int, str, str, int] | None:
    """(op_type, op_name, timestamp, io, dtype, slot) of a kernel tensor file name, None for other files."""
    if not name.endswith(".npy"):
        return None
    head, *rest = name[:-4].rsplit(".", 7)
    if len(rest) != 7 or "." not in head:
        return None
    task, stream, ts, io, slot, _fmt, dtype = rest
    op_type, op_name = head.split(".", 1)
    if io not in ("input", "output") or not (slot.isdigit() and ts.isdigit() and task.isdigit() and stream.isdigit()):
        return None
    return op_type, op_name, int(ts), io, dtype, int(slot)


def scope_cells(name: str) -> tuple[str, list[tuple[str, str]]]:
    """(root, [(attribute, class), ...]) of a kernel's full name (``/``), or of its file-name form
    (``--`` or ``_``); the op itself is dropped."""
    if "/" in name or "--" in name:
        parts = name.split("/") if "/" in name else name.split("--")
        cells = [tuple(p.split("-", 1)) for p in parts[1:-1]]
        return parts[0], [(c[0], c[1] if len(c) > 1 else "") for c in cells]
    pieces = name.split("-")                      # Default_network-CausalLM_model-...-Dense_BiasAdd-op0
    if len(pieces) < 3 or "_" not in pieces[0]:
        return name.split("_", 1)[0], []
    root, attr = pieces[0].split("_", 1)
    cells: list[tuple[str, str]] = []
    for p in pieces[1:-2]:
        cut = p.find("_", len(p) - len(p.lstrip("_")))
        if cut < 0:
            return root, []
        cells.append((attr, p[:cut]))
        attr = p[cut + 1:]
    cells.append((attr, pieces[-2].split("_", 1)[0]))
    return root, cells


def module_name(cells: list[tuple[str, str]]) -> list[str]:
    """The attribute path of ``cells`` below the training wrappers and an mcore GPTModel."""
    attrs = [a for a, _ in cells]
    classes = [c for _, c in cells]
    i = 0
    while i < len(attrs) and attrs[i] in WRAPPER_ATTRS:
        i += 1
    for j in range(len(classes) - 1, i - 1, -1):
        if classes[j] in MODEL_ROOTS:
            i = j + 1
            break
    return attrs[i:]


def _npy_info(path: Path) -> tuple[list[int], str]:
    """Shape and dtype from a .npy header; BadInput when the file is shorter than its header promises (or is no
    regular file: a FIFO would block the open)."""
    regular_file(path, ".npy file")
    try:
        with open(path, "rb") as fh:
            version = np.lib.format.read_magic(fh)
            shape, fortran, dtype = (np.lib.format.read_array_header_1_0(fh) if version == (1, 0)
                                     else np.lib.format.read_array_header_2_0(fh))
            offset = fh.tell()
        size = path.stat().st_size
    except (OSError, ValueError, SyntaxError, TypeError) as exc:
        raise BadInput(f"{path}: not a readable .npy ({exc.__class__.__name__})") from None
    want = offset + math.prod(shape) * dtype.itemsize
    if dtype.hasobject or size < want:
        raise BadInput(f"{path}: truncated .npy ({size} of {want} bytes)")
    if size != want:      # a .npy is its header and exactly its data: a damaged header declares another size
        raise BadInput(f"{path}: .npy of {size} bytes, its header declares {want} (damaged header)")
    return list(shape), str(dtype)


def _npy_stats(path: Path) -> dict[str, float]:
    regular_file(path, ".npy file")
    try:
        a = np.load(path, allow_pickle=False).astype(np.float64, copy=False)
    except (OSError, ValueError, TypeError, MemoryError) as exc:
        raise BadInput(f"{path}: not a readable .npy ({exc.__class__.__name__})") from None
    with np.errstate(all="ignore"):     # inf - inf in a mean: the NaN is the finding, not a printed warning
        return _stats(a)


def _stats(a: np.ndarray) -> dict[str, float]:
    fin = a[np.isfinite(a)]
    return {"max": float(a.max()) if a.size else math.nan, "min": float(a.min()) if a.size else math.nan,
            "mean": float(a.mean()) if a.size else math.nan,
            "norm": float(np.sqrt(np.sum(fin * fin))) if fin.size == a.size else math.nan,
            "nan": int(np.isnan(a).sum()), "inf": int(np.isinf(a).sum())}


def _float(v: str, path: Path, line: int, col: str) -> float:
    try:
        return float(v)
    except ValueError:
        raise BadInput(f"{path}: line {line}: {col} {v[:30]!r} is not a number (garbled statistic.csv)") from None


def _count(v: str, path: Path, line: int, col: str) -> int:
    """A count column (NaN / Inf counts, Timestamp): a non-negative integer, as MindSpore writes it."""
    x = _float(v, path, line, col)
    if not (math.isfinite(x) and x >= 0 and x == int(x)):
        raise BadInput(f"{path}: line {line}: {col} {v[:30]!r} is not a count (garbled statistic.csv)")
    return int(x)


_COUNT_COLS = ("nan", "ninf", "pinf")


def _csv_rows(path: Path, what: str) -> list[list[str]]:
    """Rows of a dump's CSV file: a regular file, UTF-8 (a BOM dropped), one-line BadInput otherwise."""
    try:
        return list(csv.reader(StringIO(read_text(path, what), newline="")))
    except csv.Error as exc:
        raise BadInput(f"{path}: unreadable ({exc.__class__.__name__})") from None


def read_statistic_csv(path: Path) -> dict[tuple[str, str, int], dict[str, Any]]:
    """(op name, io, slot) -> statistics of one statistic.csv; a one-line BadInput for a garbled file (a count
    that is no count, a negative L2 norm, max below min)."""
    rows = _csv_rows(path, "statistic.csv")
    if not rows or tuple(c.strip() for c in rows[0][:len(_STAT_HEAD)]) != _STAT_HEAD:
        raise BadInput(f"{path}: header is not MindSpore's statistic.csv ({', '.join(_STAT_HEAD[:3])}, ...)")
    head = [c.strip() for c in rows[0]]
    while head and not head[-1]:
        head.pop()
    col = {c: i for i, c in enumerate(head)}
    out: dict[tuple[str, str, int], dict[str, Any]] = {}
    for n, r in enumerate(rows[1:], start=2):
        if not any(c.strip() for c in r):
            continue
        if r and not r[-1].strip() and len(r) == len(head) + 1:
            r = r[:-1]                           # MindSpore ends each data row with a comma
        if len(r) != len(head):
            raise BadInput(f"{path}: line {n}: {len(r)} fields, header has {len(head)} (garbled statistic.csv)")
        io, slot = r[col["IO"]].strip(), r[col["Slot"]].strip()
        if io not in ("input", "output") or not slot.isdigit():
            raise BadInput(f"{path}: line {n}: IO {io[:20]!r} / Slot {slot[:20]!r} (garbled statistic.csv)")
        shape_txt = r[col["Shape"]].strip().strip('"').strip("()[] ")
        try:
            shape = [int(x) for x in shape_txt.split(",") if x.strip()]
        except ValueError:
            raise BadInput(f"{path}: line {n}: Shape {shape_txt[:30]!r} (garbled statistic.csv)") from None
        st = {k: (_count if k in _COUNT_COLS else _float)(r[col[c]].strip(), path, n, c)
              for k, c in _STAT_COLS.items() if c in col}
        if st.get("norm", 0.0) < 0:
            raise BadInput(f"{path}: line {n}: L2Norm Value {st['norm']} is negative (garbled statistic.csv)")
        if st.get("max", math.inf) < st.get("min", -math.inf):
            raise BadInput(f"{path}: line {n}: Max Value {st['max']} is below Min Value {st['min']} "
                           f"(garbled statistic.csv)")
        out[(r[col["Op Name"]].strip(), io, int(slot))] = {
            "op_type": r[col["Op Type"]].strip(), "dtype": r[col["Data Type"]].strip(), "shape": shape,
            "ts": _count(r[col["Timestamp"]].strip(), path, n, "Timestamp"), **st}
    return out


def read_mapping_csv(path: Path) -> dict[str, str]:
    """file name -> original kernel file name of an O2 dump's mapping.csv (a header row, if any, maps nothing)."""
    rows = _csv_rows(path, "mapping.csv")
    out = {}
    for n, r in enumerate(rows, start=1):
        if not any(c.strip() for c in r):
            continue
        if len(r) < 2 or not r[0].strip() or not r[1].strip():
            raise BadInput(f"{path}: line {n}: expected 'file name,original name' (garbled mapping.csv)")
        out[r[0].strip()] = r[1].strip()
    return out


def _kernel_file(p: Path, mapping: dict[str, str]) -> tuple[tuple[str, str, int, str, str, int], bool] | None:
    """(parsed name, is .npy) of a kernel tensor file, through mapping.csv; None for other files."""
    name = mapping.get(p.name) or mapping.get(p.stem) or p.name
    if p.suffix == ".npy" and not name.endswith(".npy"):
        name += ".npy"
    is_npy = p.suffix == ".npy"
    parsed = split_npy_name(name if name.endswith(".npy") else name + ".npy")
    return (parsed, is_npy) if parsed is not None else None


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def read_execution_order(path: Path) -> list[str]:
    """Kernels' full scope names in execution order. A line with a control byte (a NUL) is refused: a damaged
    name matches no kernel file, which would move that kernel to the end and make it the last of its cells."""
    lines = read_text(path, "execution order file").splitlines()
    for n, ln in enumerate(lines, start=1):
        if m := _CONTROL.search(ln):
            raise BadInput(f"{path}: line {n}: control byte 0x{ord(m.group()):02x} in a kernel name "
                           f"(damaged execution order)")
    return [ln.strip() for ln in lines[1:] if ln.strip()]


_LAST = 1 << 62


def _present(p: Path) -> bool:
    """Whether a dump file is there, whatever it is (a FIFO or device named statistic.csv is then refused by
    its reader, never taken for a missing file that leaves the iteration out)."""
    return p.exists() or p.is_symlink()

_SCOPED = ("Default_", "Default--", "Default/")     # forward kernels, which every execution order lists


def _position(op: str, kernels: dict[str, Any], order: dict[str, tuple[int, str]]) -> tuple[int, int]:
    """A kernel's place: its execution-order index, then its first tensor's timestamp."""
    ts = min((t.get("ts", _LAST) for t in kernels[op].values()), default=_LAST)
    return (order[op][0], ts) if op in order else (_LAST, ts)


@dataclass
class MindSporeDump:
    """One MindSpore dump path: rank -> [(graph id, iteration, folder)]; a layer source of cell outputs."""

    needs_readers: ClassVar[bool] = False
    root: Path
    folders: dict[int, list[tuple[int, int, Path]]] = field(default_factory=dict)
    orders: dict[int, Path] = field(default_factory=dict)      # rank -> its execution_order folder

    def array_steps(self) -> list[int]:
        return sorted({it + 1 for fs in self.folders.values() for _, it, _ in fs})

    def array_ranks(self, step: int) -> list[int]:
        return sorted(r for r, fs in self.folders.items() if any(it + 1 == step for _, it, _ in fs))

    def kernels(self, step: int, rank: int) -> list[tuple[str, str, dict[tuple[str, int], dict[str, Any]]]]:
        """(op name as written, full scope name, {(io, slot): tensor}) per kernel, forward and backward
        (``Gradients/...``), in execution order; a tensor holds op_type, dtype, ts, and file (its .npy) when saved."""
        found = [(g, f) for g, it, f in self.folders.get(rank, []) if it + 1 == step]
        if not found:
            have = sorted({it for _, it, _ in self.folders.get(rank, [])})
            raise BadInput(f"{self.root}: MindSpore dump has no iteration {step - 1} (step {step}) for rank {rank} "
                           f"(has iterations {', '.join(map(str, have)) or 'none'})")
        out = []
        for graph, folder in sorted(found, key=lambda t: t[0]):
            kernels: dict[str, dict[tuple[str, int], dict[str, Any]]] = {}
            stat = folder / STAT_CSV
            if _present(stat):       # a FIFO / device there is refused when read, not skipped
                for (op, io, slot), st in read_statistic_csv(stat).items():
                    kernels.setdefault(op, {})[(io, slot)] = dict(st)
            mfile = folder / MAPPING_CSV
            mapping = read_mapping_csv(mfile) if _present(mfile) else {}
            for p in folder.iterdir():
                found_file = _kernel_file(p, mapping)
                if found_file is None:
                    continue
                (op_type, op, ts, io, dtype, slot), is_npy = found_file
                t = kernels.setdefault(op, {}).setdefault((io, slot), {"op_type": op_type, "dtype": dtype, "ts": ts})
                if is_npy:
                    t["file"] = p
                else:
                    t["dtype"] = dtype                # raw (e.g. bf16): statistics only from statistic.csv
            order: dict[str, tuple[int, str]] = {}
            ofile = self.orders.get(rank, folder) / f"ms_execution_order_graph_{graph}.csv"
            if ofile.exists():
                for i, full in enumerate(read_execution_order(ofile)):
                    for written in (full.replace("/", "_"), full.replace("/", "--"), full):
                        order.setdefault(written, (i, full))
                stray = next((op for op in kernels if op not in order and op.startswith(_SCOPED)), None)
                if stray is not None:
                    raise BadInput(f"{ofile}: kernel {stray[:120]} of {folder} is not in this execution order "
                                   "(MindSpore's order file omits the kernels GRAPH expands, as in a MindFormers "
                                   "mcore model's dump; or the file is damaged or from another run): its place among "
                                   "the cells is unknown; for layer tensors of a GRAPH run use the MindFormers "
                                   "callback's kernel_dump")
            for op in sorted(kernels, key=lambda o, k=kernels, od=order: _position(o, k, od)):
                out.append((op, order[op][1] if op in order else op, kernels[op]))
        return out

    def layer_rows(self, step: int, rank: int = 0) -> tuple[list[dict[str, Any]], bool]:
        """Cell outputs of one iteration and rank, in execution order; ``ref`` the .npy when saved. A dump of
        our identity taps (dumpers/mindspore_kernel_dump.py) gives :meth:`tap_rows` instead."""
        kernels = self.kernels(step, rank)
        if any(_tap_of(full) for _, full, _ in kernels):
            return self._tap_rows(kernels)
        last: dict[str, tuple[int, int]] = {}             # module -> (kernel index, depth)
        for k, (_, full, _) in enumerate(kernels):
            root, cells = scope_cells(full)
            if root != "Default":                          # Gradients/..., Expand/..., Parameter.*: not forward cells
                continue
            attrs = module_name(cells)
            for d in range(1, len(attrs) + 1):
                last[".".join(attrs[:d])] = (k, d)
        rows: list[dict[str, Any]] = []
        any_file = False
        for module, (k, _) in sorted(last.items(), key=lambda kv: (kv[1][0], -kv[1][1])):
            op, _, tensors = kernels[k]
            for (io, slot), t in sorted(tensors.items()):
                if io != "output" or slot != 0:   # LayerNorm's mean / rstd are kernel outputs, not the cell's
                    continue
                row = _row(len(rows), module, f"forward.output.{slot}", op, t)
                if row is not None:
                    any_file = any_file or row["ref"] is not None
                    rows.append(row)
        return rows, any_file

    def tap_rows(self, step: int, rank: int = 0) -> tuple[list[dict[str, Any]], bool]:
        """The rows of a tap dump (dumpers/mindspore_kernel_dump.py), forward and backward, in execution order.

        Mapping, measured on CPU (MindSpore 2.10, MindFormers mcore): each tapped cell's scope holds
        ``.../<cell>-KernelTapCell/xf_tap_in-KernelTap/Identity-opN`` and ``.../xf_tap_out-KernelTap/...``, twice
        each: the forward Identity, then (later in execution order) its custom bprop's Identity, whose scope is
        the tap's, not ``Gradients/...``. So per (cell, tap) the first kernel is ``forward.input.0`` /
        ``forward.output.0`` and the second the gradient of the cell's first input / first output. The output
        gradient is ``backward.grad_output.0``, as the torch dumper names it. The input gradient is the part that
        flows back through this cell only, ``backward.cell_grad_input.0``: the torch dumper's
        ``backward.grad_input.0`` is a tensor hook's, the input's whole gradient over all its uses. Measured on
        the mcore dense pair: the two agree (3.6e-5 to 5e-4 rel. L2) for cells that are their input's only user
        (layers, attention, MLP, final norm) and differ (rel. L2 2 to 11) for a norm on the residual stream,
        whose input the residual add uses too. The module is the scope's cell path without the wrapper's
        ``xf_inner`` attribute, below the training wrappers and ``GPTModel``."""
        return self._tap_rows(self.kernels(step, rank))

    def _tap_rows(self, kernels: list[tuple[str, str, dict[tuple[str, int], dict[str, Any]]]]
                  ) -> tuple[list[dict[str, Any]], bool]:
        seen: dict[tuple[str, str], int] = {}
        rows: list[dict[str, Any]] = []
        for op, full, tensors in kernels:
            tap = _tap_of(full)
            if tap is None:
                continue
            module, which = tap
            n = seen.get((module, which), 0)
            seen[(module, which)] = n + 1
            if n > 1:
                raise BadInput(f"{self.root}: tap kernel {full[:120]} runs a third time in one iteration "
                               f"(a cell called twice per step cannot be captured by taps)")
            kind = (("forward.input.0", OWN_GRAD_INPUT) if which == TAP_IN
                    else ("forward.output.0", "backward.grad_output.0"))[n]
            t = tensors.get(("output", 0))
            row = _row(len(rows), module, kind, op, t) if t is not None else None
            if row is not None:
                rows.append(row)
        return rows, any(r["ref"] is not None for r in rows)


TAP_IN, TAP_OUT, TAP_INNER = "xf_tap_in", "xf_tap_out", "xf_inner"   # dumpers/mindspore_kernel_dump.py's names
OWN_GRAD_INPUT = "backward.cell_grad_input.0"     # a tapped cell's input gradient through that cell only


def _tap_of(full: str) -> tuple[str, str] | None:
    """(module, tap attribute) of a tap kernel's full scope name; None for any other kernel."""
    if TAP_IN not in full and TAP_OUT not in full:
        return None
    root, cells = scope_cells(full)
    if root != "Default" or not cells or cells[-1][0] not in (TAP_IN, TAP_OUT):
        return None
    module = [c for c in cells[:-1] if c[0] != TAP_INNER]
    return ".".join(module_name(module)), cells[-1][0]


def _row(order: int, module: str, kind: str, op: str, t: dict[str, Any]) -> dict[str, Any] | None:
    """One row in the ``tensor_stats`` vocabulary from a kernel tensor (its .npy, else its statistic.csv row);
    None when neither can be read (a raw bf16 file without statistics)."""
    dtype = normalise_dtype(_ACL_DTYPES.get(t.get("dtype", ""), t.get("dtype")))
    f: Path | None = t.get("file")
    if dtype is None or (f is None and "max" not in t):    # a raw file and no statistic.csv row
        return None
    if f is not None:
        shape, stored = _npy_info(f)
        if normalise_dtype(stored) not in (dtype, "float32" if dtype == "bfloat16" else dtype):
            raise BadInput(f"{f}: holds {stored}, its name says {t.get('dtype')} (damaged header)")
    else:
        shape = t.get("shape", [])
    st = {k2: t[k2] for k2 in ("max", "min", "mean", "norm") if k2 in t}
    nan = int(t["nan"]) if "nan" in t else None
    inf = int(t.get("ninf", 0) + t.get("pinf", 0)) if ("ninf" in t or "pinf" in t) else None
    if f is not None and len(st) < 4:
        comp = _npy_stats(f)
        st = {**comp, **st}
        nan = comp["nan"] if nan is None else nan
        inf = comp["inf"] if inf is None else inf
    mx, mn = st.get("max", math.nan), st.get("min", math.nan)
    return {"order": order, "module": module, "kind": kind, "dtype": dtype,
            "shape": "x".join(map(str, shape)), "numel": math.prod(shape) if shape else 1,
            "max": mx, "min": mn, "mean": st.get("mean", math.nan), "norm": st.get("norm", math.nan),
            "nan": nan if nan is not None else int(math.isnan(mx) or math.isnan(mn)),
            "inf": inf if inf is not None else int(math.isinf(mx) or math.isinf(mn)),
            "ref": str(f) if f is not None else None, "key": op}


def _holds_taps(d: MindSporeDump) -> bool:
    """Whether the dump holds our tap kernels (dumpers/mindspore_kernel_dump.py): a file name, or mapping.csv for
    names MindSpore shortened, says ``xf_tap_in`` / ``xf_tap_out``."""
    for fs in d.folders.values():
        for _, _, folder in fs[:1]:
            mfile = folder / MAPPING_CSV
            names = [p.name for p in folder.iterdir()] + (list(read_mapping_csv(mfile).values())
                                                          if _present(mfile) else [])
            if any(TAP_IN in n or TAP_OUT in n for n in names):
                return True
    return False


def store_kernel_dump(reader: Any) -> MindSporeDump | None:
    """The kernel dump a run store's meta names (``layer_capture.kernel_dump``, relative to the store), opened;
    None when it names none. A named folder that is missing or empty is BadInput naming it."""
    cap = (getattr(reader, "meta", None) or {}).get("layer_capture")
    rel = cap.get("kernel_dump") if isinstance(cap, dict) else None
    if not rel:
        return None
    path = Path(reader.root) / str(rel)
    if not path.is_dir():
        raise BadInput(f"{Path(reader.root) / 'meta.json'}: layer_capture.kernel_dump names {path}, which is not a "
                       f"folder (the kernel dump was moved or not written)")
    return open_mindspore_dump(path)


def _rank_dirs(root: Path) -> dict[int, Path]:
    m = _RANK_RE.match(root.name)
    if m:
        return {int(m.group(1)): root}
    out = {}
    for p in root.iterdir():
        m = _RANK_RE.match(p.name)
        if m and p.is_dir():
            out[int(m.group(1))] = p
    return out


def _iteration_dirs(rank_dir: Path) -> list[tuple[int, int, Path]]:
    """(graph id, iteration, folder) under rank_R/{net_name}/{graph_id}/{iteration}/, or (0, S, folder) under
    msprobe O2's rank_R/{timestamp}/step_S/."""
    out = []
    for net in sorted(rank_dir.iterdir()):
        if not net.is_dir() or net.name in (ORDER_DIR, "graphs"):
            continue
        for g in net.iterdir():
            if not g.is_dir():
                continue
            if g.name.isdigit():
                out += [(int(g.name), int(it.name), it) for it in g.iterdir() if it.is_dir() and it.name.isdigit()]
            elif m := _STEP_RE.match(g.name):
                out.append((0, int(m.group(1)), g))
    return sorted(out)


def _holds_kernels(folder: Path) -> bool:
    return (_present(folder / STAT_CSV) or _present(folder / MAPPING_CSV)
            or any(_kernel_file(p, {}) for p in folder.iterdir()))


def dump_writer(root: Path) -> str:
    """Who wrote the dump, from the config msprobe leaves in its dump_path."""
    top = root.parent if _RANK_RE.match(root.name) else root
    if (top / "kernel_kbyk_dump.json").is_file():
        return "msprobe L2 (jit_level O0/O1)"
    if any(top.glob("acl_dump_*.json")) or any(_STEP_RE.match(p.name) for p in top.glob("rank_*/*/*")):
        return "msprobe L2 (jit_level O2)"
    return "MindSpore"


def is_mindspore_dump(path: str | Path) -> bool:
    p = Path(path)
    try:
        if not p.is_dir():
            return False
        for rank_dir in _rank_dirs(p).values():
            for _, _, folder in _iteration_dirs(rank_dir):
                if _holds_kernels(folder):
                    return True
    except OSError:
        return False
    return False


def open_mindspore_dump(path: str | Path) -> MindSporeDump:
    """Open a MindSpore dump (the config's ``path``, or one ``rank_R`` folder)."""
    root = Path(path)
    if not root.is_dir():
        raise BadInput(f"{root}: not a directory (a MindSpore dump is a folder with rank_*/NET/GRAPH/ITERATION/)")
    folders, orders = {}, {}
    for rank, rd in sorted(_rank_dirs(root).items()):
        its = [t for t in _iteration_dirs(rd) if _holds_kernels(t[2])]
        if its:
            folders[rank] = its
            orders[rank] = rd / ORDER_DIR
    if not folders:
        raise BadInput(f"{root}: no MindSpore dump iteration with kernel files "
                       f"(expected rank_*/NET/GRAPH/ITERATION/ or rank_*/TIMESTAMP/step_*/ with *.npy or "
                       f"statistic.csv)")
    return MindSporeDump(root, folders, orders)


def read_mindspore_dump(path: str | Path) -> Run:
    """A MindSpore dump as a Run: no scalars; the layer-tensor stage reads it through ``open_mindspore_dump``."""
    from runstore.run import Run

    d = open_mindspore_dump(path)
    saved = {"npy" if any(p.suffix == ".npy" for p in f.iterdir()) else "" for fs in d.folders.values()
             for _, _, f in fs} | {"csv" if _present(f / STAT_CSV) else "" for fs in d.folders.values()
                                   for _, _, f in fs}
    saved_data = {"npy": "tensor", "csv": "statistic"}
    mode = "full" if {"npy", "csv"} <= saved else next((saved_data[s] for s in saved if s), "unknown")
    writer = dump_writer(Path(path))
    what = ("xf-align taps: the selected cells' inputs, outputs and their gradients" if _holds_taps(d)
            else "cell outputs (forward) only")
    notes = [f"{writer} GRAPH-mode kernel dump ({mode}): {what}, no loss curve"]
    missing = [r for r, o in d.orders.items() if not o.is_dir() and writer != "msprobe L2 (jit_level O2)"]
    if missing:
        notes.append(f"rank(s) {', '.join(map(str, missing))} have no execution_order/: kernels ordered by timestamp "
                     f"and scopes split on '-'/'_'")
    meta = {"framework": "mindspore", "source": {"kind": "mindspore_dump", "path": str(path), "saved_data": mode,
                                                     "writer": writer},
            "name_scheme": "mindspore_dump", "mindspore_dump": {"steps": d.array_steps(), "ranks": sorted(d.folders)}}
    return Run(str(path), "mindspore_dump", meta, {}, {}, notes)


def _is_ms_dump(path: Path, head: bytes | None) -> bool:
    return head is None and is_mindspore_dump(path)


def _layers(obj: Any) -> MindSporeDump:
    return open_mindspore_dump(obj if isinstance(obj, (str, Path)) else obj.path)


SOURCE = Source("mindspore_dump", 21, _is_ms_dump, read_mindspore_dump,
                "a MindSpore GRAPH dump, or msprobe's static-graph L2 dump (rank_*/NET/GRAPH/ITERATION/ or "
                "rank_*/TIMESTAMP/step_*/: *.npy or statistic.csv)",
                layers=_layers, layers_only=True)
