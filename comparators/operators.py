"""Operator drill-down, judged: inside one module, which operator accounts for the module's difference.

Both sides ran the same module on the same captured inputs, weights and output gradient: the baseline as aten
operators (dumpers.torch_op_trace), the candidate as MindSpore kernels (its kernel dump, read by
sources.mindspore_dump). Each operator's output is compared three ways:

* own error: against a float64 numpy reference computed from that operator's OWN inputs (as that side saw
  them), relative to the operation's scale (|a|+|b| for a sum, |A||B| for a product): what the operator itself
  added, in the dtype it computed in. Judged against ``OWN_ULPS`` x the machine epsilon of the module's dtype
  (core.dtypes): an operator that rounds through float16 in a float32 module stands out.
* across frameworks, by value: each candidate tensor is matched to a baseline tensor of the same size, up to
  reshape / axis order, within the module dtype's pass line (comparators.tensor_pair.TOLERANCE). A candidate
  operator whose inputs all match the baseline's and whose output matches nothing is a semantic departure (a
  wrong constant, swapped operands) even when its own error is tiny; one that consumes a weight or constant
  that matches no baseline tensor departs by that input (a wrong conversion, a wrong epsilon).
* a departure is named only when its difference reaches the module's result: it is carried forward through
  unmatched tensors and dropped where a later output matches the baseline again (two ways of computing the
  same thing), so a clean pair names nothing.
"""

from __future__ import annotations

import ast
import hashlib
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from comparators.tensor_pair import TOLERANCE
from core.dtypes import EPS, normalize

#: an operator's own error passes up to this many machine epsilons of the module's dtype (relative to the
#: operation's scale: a handful of roundings and a sum's accumulation stay far below; a float16 rounding is
#: 2^13 float32 epsilons)
OWN_ULPS = 64
_LAYOUT = {"view", "_unsafe_view", "t", "transpose", "permute", "expand", "clone", "slice", "select", "squeeze",
           "unsqueeze", "copy_", "copy", "as_strided", "split", "split_with_sizes", "contiguous", "slice_backward",
           "reshape", "unbind", "alias", "lift_fresh", "fill", "zero_", "zeros_like", "ones_like", "new_zeros",
           "Reshape", "Transpose", "TransposeExtView", "ExpandDims", "Squeeze", "StridedSlice", "Concat",
           "Split", "SplitWithSize", "BroadcastTo", "Fill", "Fills", "Zeros", "ZerosLike", "OnesLike", "Tile",
           "Flatten", "Identity", "Depend", "Load", "TupleGetItem", "MakeTuple", "Slice", "Contiguous"}

# operators that only move values (a slice's gradient pads with zeros): an output they make that matches
# nothing is a layout the matching does not follow, not a semantic departure
_MOVES = _LAYOUT | {"StridedSliceGrad", "SliceGrad", "Pad", "PadV3", "Cast_identity"}


@dataclass
class Op:
    """One operator of one side, in a framework-free form."""

    side: str
    index: int
    name: str
    kind: str
    phase: str
    ins: list[tuple[str, Any]]            # (slot, np.ndarray | python scalar | None)
    outs: list[np.ndarray]
    dtype: str | None
    params: dict[str, Any] = field(default_factory=dict)
    in_dtypes: list[str] = field(default_factory=list)     # the floating inputs' dtypes as that side declared them


def _float_inputs(op: Op) -> list[tuple[str, np.ndarray]]:
    return [(s, v) for s, v in op.ins if isinstance(v, np.ndarray) and v.dtype.kind == "f"]


# ---------------------------------------------------------------------------------------------------------
# Loading: the baseline's aten trace and the candidate's kernel dump
# ---------------------------------------------------------------------------------------------------------

def torch_ops(module: dict[str, Any], arrays: dict[str, np.ndarray]) -> list[Op]:
    """The baseline module's aten operators from a dumpers.torch_op_trace file (its meta entry and arrays)."""
    out = []
    for op in module["ops"]:
        ins: list[tuple[str, Any]] = []
        params: dict[str, Any] = {}
        for k, v in op["inputs"].items():
            items = v if isinstance(v, list) else [v]
            for n, item in enumerate(items):
                slot = f"{k}.{n}" if isinstance(v, list) else k
                if "t" in item:
                    ins.append((slot, arrays[item["t"]]))
                elif isinstance(item.get("v"), (int, float)) and not isinstance(item.get("v"), bool):
                    ins.append((slot, item["v"]))
                    params[slot] = item["v"]
                else:
                    params[slot] = item.get("v")
        outs = [arrays[o["t"]] for o in op["outputs"] if "t" in o]
        name = op["name"]
        kind = name.split(".")[1] if name.startswith("aten.") and name.count(".") >= 1 else name
        out.append(Op("baseline", int(op["index"]), name, kind, op["phase"], ins, outs, op.get("dtype"), params))
    return out


def mindspore_leaves(kernels: list[tuple[str, str, dict[tuple[str, int], dict[str, Any]]]]) -> dict[str, np.ndarray]:
    """The compiled graph's parameters and arguments (the ``Parameter`` entries of its dump, by name: a weight's
    dots written ``_``): the tensors the candidate's operators read that no operator produced."""
    out = {}
    for op, _full, tensors in kernels:
        for t in tensors.values():
            if t.get("op_type") == "Parameter" and "file" in t:
                out[op] = load_npy(t["file"])
    return out


def load_npy(path: Any) -> np.ndarray:
    """A dumped .npy; bfloat16 ones (descr ``<E2``, which numpy cannot read) as float32, exactly."""
    try:
        return np.load(path, allow_pickle=False)
    except ValueError:
        with open(path, "rb") as fh:
            major, _ = np.lib.format.read_magic(fh)
            n = int.from_bytes(fh.read(2 if major == 1 else 4), "little")
            header = ast.literal_eval(fh.read(n).decode("latin1"))
            if not isinstance(header, dict) or header.get("descr") not in ("<E2", "E2", "bfloat16"):
                raise
            raw = np.frombuffer(fh.read(), dtype="<u2")
        shape = tuple(header.get("shape") or ())
        return (raw.astype(np.uint32) << 16).view(np.float32).reshape(shape)


def mindspore_ops(kernels: list[tuple[str, str, dict[tuple[str, int], dict[str, Any]]]]) -> list[Op]:
    """The candidate's kernels (sources.mindspore_dump.MindSporeDump.kernels) in the order they ran (their
    dump time: GRAPH's expanded kernels are missing from the execution order file), parameters left out."""
    rows = []
    for op, full, tensors in kernels:
        first = next(iter(tensors.values()), {})
        if first.get("op_type") == "Parameter" or not any(io == "output" for io, _ in tensors):
            continue
        ts = min((int(t.get("ts", 0) or 0) for t in tensors.values()), default=0)
        rows.append((ts, op, full, tensors))
    rows.sort(key=lambda r: r[0])
    # backward: a Gradients/ scope, or reading the output gradient (the graph's last argument) or what a backward
    # kernel made (a cell's own bprop and GRAPH's expanded kernels carry no Gradients/ scope)
    args = sorted(((int(op[4:]), t) for op, _f, ts in kernels if op.startswith("args") and op[4:].isdigit()
                   for t in ts.values() if "file" in t), key=lambda a: a[0])
    back: set[str] = {_key(load_npy(args[-1][1]["file"]))} if args else set()
    out = []
    for i, (_, _op, full, tensors) in enumerate(rows):
        ins: list[tuple[str, Any]] = []
        outs: list[np.ndarray] = []
        dtype = None
        in_dtypes = []
        for (io, slot), t in sorted(tensors.items(), key=lambda kv: (kv[0][0], kv[0][1])):
            if "file" not in t:
                continue
            a = load_npy(t["file"])
            if io == "input":
                ins.append((str(slot), a))
                if a.dtype.kind == "f":
                    in_dtypes.append(normalize(str(t.get("dtype", a.dtype))))
            else:
                outs.append(a)
                dtype = dtype or normalize(str(t.get("dtype", "")))
        kind = str(next(iter(tensors.values())).get("op_type", full.rsplit("/", 1)[-1].split("-")[0]))
        depends = any(isinstance(v, np.ndarray) and v.dtype.kind == "f" and _key(v) in back for _, v in ins)
        if depends:     # only what depends on the output gradient: a Gradients/ kernel may move a forward tensor
            back.update(_key(o) for o in outs if o.dtype.kind == "f")
        backward = depends or "Gradients" in full
        out.append(Op("candidate", i, full, kind, "backward" if backward else "forward", ins, outs, dtype,
                      in_dtypes=in_dtypes))
    return out


# ---------------------------------------------------------------------------------------------------------
# Own error: a float64 reference from the operator's own inputs
# ---------------------------------------------------------------------------------------------------------

def _f(a: Any) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


def _axes(v: Any, ndim: int) -> tuple[int, ...]:
    a = np.asarray(v).reshape(-1).astype(int).tolist() if v is not None else []
    return tuple(x % ndim for x in a) if a else tuple(range(ndim))


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _log_softmax(x: np.ndarray, axis: int) -> np.ndarray:
    m = x.max(axis=axis, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=axis, keepdims=True))


def _sig(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


_UNARY = {"rsqrt": lambda x: 1.0 / np.sqrt(x), "Rsqrt": lambda x: 1.0 / np.sqrt(x), "sqrt": np.sqrt, "Sqrt": np.sqrt,
          "exp": np.exp, "Exp": np.exp, "neg": np.negative, "Neg": np.negative, "cos": np.cos, "Cos": np.cos,
          "sin": np.sin, "Sin": np.sin, "tanh": np.tanh, "Tanh": np.tanh, "sigmoid": _sig, "Sigmoid": _sig,
          "silu": lambda x: x * _sig(x), "SiLU": lambda x: x * _sig(x), "Square": np.square,
          "reciprocal": lambda x: 1.0 / x, "Reciprocal": lambda x: 1.0 / x, "log": np.log, "Log": np.log,
          "_to_copy": lambda x: x, "Cast": lambda x: x, "abs": np.abs, "Abs": np.abs}
_BINARY = {"add": np.add, "Add": np.add, "sub": np.subtract, "Sub": np.subtract, "mul": np.multiply,
           "Mul": np.multiply, "div": np.divide, "RealDiv": np.divide, "Div": np.divide, "Maximum": np.maximum,
           "maximum": np.maximum, "Minimum": np.minimum, "minimum": np.minimum, "add_": np.add, "mul_": np.multiply,
           "div_": np.divide, "sub_": np.subtract, "rsub": lambda a, b: b - a}
_SUMS = {"add", "Add", "sub", "Sub", "add_", "sub_", "AddN", "rsub"}


def _matmul_variants(a: np.ndarray, b: np.ndarray, shape: tuple[int, ...]) -> list[tuple[np.ndarray, np.ndarray]]:
    """(result, |a||b| scale) of a @ b with each operand transposed or not, those of the output's shape."""
    out = []
    for ta, tb in itertools.product((False, True), repeat=2):
        x = np.swapaxes(a, -1, -2) if ta and a.ndim >= 2 else a
        y = np.swapaxes(b, -1, -2) if tb and b.ndim >= 2 else b
        try:
            r = np.matmul(x, y)
        except ValueError:
            continue
        if r.size == int(np.prod(shape)):     # a dumped output may keep its input's rank (Reshape quirk)
            out.append((r, np.matmul(np.abs(x), np.abs(y))))
    return out


def reference(op: Op) -> list[tuple[np.ndarray, np.ndarray]]:
    """Candidate (reference, scale) pairs of ``op``'s first output from its own inputs, in float64: several
    where the kernel's attributes (a transpose flag, an axis) are not in the dump; [] when none is known."""
    k = op.kind
    fin = [(s, _f(v)) for s, v in op.ins if isinstance(v, np.ndarray) and v.dtype.kind in "fiub"]
    nums = [(s, _f(v)) for s, v in op.ins]
    if not op.outs:
        return []
    shape = tuple(op.outs[0].shape)
    p = op.params
    try:
        if k in ("mm", "bmm", "MatMul", "BatchMatMul", "matmul"):
            return _matmul_variants(fin[0][1], fin[1][1], shape)
        if k in ("addmm", "baddbmm"):
            base, m1, m2 = fin[0][1], fin[1][1], fin[2][1]
            beta, alpha = float(p.get("beta", 1)), float(p.get("alpha", 1))
            return [(beta * base + alpha * (m1 @ m2), np.abs(beta * base) + np.abs(alpha) * (np.abs(m1) @ np.abs(m2)))]
        if k in _UNARY and nums:
            r = _UNARY[k](nums[0][1])
            return [(r, np.abs(r))]
        if k in _BINARY and len(nums) >= 2:
            a, b = nums[0][1], nums[1][1]
            if k in ("add", "add_", "sub", "sub_") and "alpha" in p:
                b = b * float(p["alpha"])
            r = _BINARY[k](a, b)
            scale = np.abs(a) + np.abs(b) if k in _SUMS else np.abs(r)
            return [(r, np.broadcast_to(scale, r.shape))]
        if k == "AddN":
            r = sum(v for _, v in nums)
            return [(r, sum(np.abs(v) for _, v in nums))]
        if k in ("pow", "Pow"):
            r = np.power(nums[0][1], nums[1][1])
            return [(r, np.abs(r))]
        if k in ("mean", "sum", "ReduceMean", "ReduceSum"):
            x = fin[0][1]
            if k in ("mean", "sum"):
                axes, keep = _axes(p.get("dim"), x.ndim), bool(p.get("keepdim", False))
            else:
                axes = _axes(fin[1][1] if len(fin) > 1 else None, x.ndim)
                keep = bool(fin[2][1]) if len(fin) > 2 else False
            fn = np.mean if k in ("mean", "ReduceMean") else np.sum
            r = fn(x, axis=axes, keepdims=keep)
            return [(r.reshape(shape) if r.size == int(np.prod(shape)) else r, fn(np.abs(x), axis=axes, keepdims=keep)
                     .reshape(r.shape))]
        if k in ("_softmax", "_log_softmax", "Softmax", "LogSoftmax"):
            x = fin[0][1]
            fn = _softmax if "og" not in k else _log_softmax
            axes = [int(p["dim"])] if "dim" in p else list(range(x.ndim))
            return [(fn(x, ax), np.abs(fn(x, ax))) for ax in axes]
        if k == "_softmax_backward_data":
            g, y, ax = fin[0][1], fin[1][1], int(p["dim"])
            r = y * (g - (g * y).sum(axis=ax, keepdims=True))
            return [(r, np.abs(y * g) + np.abs(y) * np.abs(g * y).sum(axis=ax, keepdims=True))]
        if k == "_log_softmax_backward_data":
            g, y, ax = fin[0][1], fin[1][1], int(p["dim"])
            r = g - np.exp(y) * g.sum(axis=ax, keepdims=True)
            return [(r, np.abs(g) + np.exp(y) * np.abs(g).sum(axis=ax, keepdims=True))]
        if k in ("embedding", "Gather"):
            w, idx = (fin[0][1], fin[1][1].astype(np.int64))
            r = np.take(w, idx, axis=0)
            return [(r, np.abs(r))]
        if k == "silu_backward":
            g, x = fin[0][1], fin[1][1]
            s = _sig(x)
            r = g * (s + x * s * (1 - s))
            return [(r, np.abs(r))]
        if k == "SiLUGrad":
            g, x = fin[0][1], fin[1][1]
            s = _sig(x)
            r = g * (s + x * s * (1 - s))
            return [(r, np.abs(r))]
        if k == "RsqrtGrad":
            y, dy = fin[0][1], fin[1][1]
            r = -0.5 * dy * y ** 3
            return [(r, np.abs(r))]
        if k == "SigmoidGrad":
            y, dy = fin[0][1], fin[1][1]
            r = dy * y * (1 - y)
            return [(r, np.abs(r))]
        if k in ("Select", "where"):
            c, a, b = fin[0][1].astype(bool), nums[1][1], nums[2][1]
            r = np.where(c, a, b)
            return [(r, np.abs(r))]
        if k == "masked_fill":
            x, m, v = fin[0][1], fin[1][1].astype(bool), float(p.get("value", 0))
            r = np.where(m, v, x)
            return [(r, np.abs(r))]
    except (IndexError, KeyError, ValueError, TypeError):
        return []
    return []


def own_error(op: Op) -> float | None:
    """||out - ref|| / ||scale|| (float64) against the closest reference; None when the kind has none."""
    if not op.outs:
        return None
    out = _f(op.outs[0])
    best = None
    for ref, scale in reference(op):
        ref = np.asarray(ref)
        if ref.size != out.size:
            continue
        ref = ref.reshape(out.shape)
        den = float(np.linalg.norm(np.asarray(scale, np.float64).reshape(-1)))
        num = float(np.linalg.norm((out - ref).reshape(-1)))
        e = num / den if den > 0 else (0.0 if num == 0 else math.inf)
        best = e if best is None or e < best else best
    return best


# ---------------------------------------------------------------------------------------------------------
# Matching by value across frameworks
# ---------------------------------------------------------------------------------------------------------

def _key(a: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(np.asarray(a, np.float32)).tobytes(), digest_size=12).hexdigest()


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    """||a - b|| / ||b|| over the elements that differ: a constant both sides wrote (a mask's -1e4 fill, zeros)
    would otherwise dominate the norm and hide a difference in the computed entries."""
    diff = a != b
    if not diff.any():
        return 0.0
    nb = float(np.linalg.norm(b[diff]))
    d = float(np.linalg.norm(a[diff] - b[diff]))
    return d / nb if nb > 0 else math.inf


class Pool:
    """The baseline's tensors (every operator's inputs and outputs), found by size, norm and then layout."""

    def __init__(self, ops: list[Op], tol: float, splits: tuple[tuple[int, int], ...] = ()) -> None:
        self.tol, self.splits = tol, splits
        self.by_size: dict[int, list[tuple[str, np.ndarray, float]]] = {}
        self.key_of: dict[str, str] = {}
        self.consumers: dict[str, list[int]] = {}
        seen: set[str] = set()
        for op in ops:
            for n, o in enumerate(op.outs):
                self._add(o, f"{op.index}:out{n}", seen)
            for s, v in op.ins:
                if isinstance(v, np.ndarray) and v.dtype.kind == "f":
                    self._add(v, f"{op.index}:in:{s}", seen)
                    self.consumers.setdefault(_key(v), []).append(op.index)
                elif isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._add(np.asarray(float(v)), f"{op.index}:in:{s}", seen)

    def _add(self, a: np.ndarray, ref: str, seen: set[str]) -> None:
        if a.dtype.kind not in "f" and a.ndim:
            return
        k = _key(a)
        if k in seen:
            return
        seen.add(k)
        self.key_of[ref] = k
        f = _f(a)
        self.by_size.setdefault(f.size, []).append((ref, f, float(np.linalg.norm(f))))

    def match(self, a: np.ndarray, tol: float | None = None) -> tuple[str, float] | None:
        """(baseline tensor, rel L2) of the closest baseline tensor within ``tol``, in any layout of
        :func:`layout_rel`."""
        tol = self.tol if tol is None else tol
        c = _f(a)
        nc = float(np.linalg.norm(c))
        best: tuple[str, float] | None = None
        for ref, b, nb in self.by_size.get(c.size, []):
            if abs(nc - nb) > tol * max(nb, 1e-30) + 1e-30:
                continue
            e = layout_rel(c, b, tol, self.splits)
            if e <= tol and (best is None or e < best[1]):
                best = (ref, e)
                if e == 0.0:
                    break
        return best


def layout_rel(a: np.ndarray, b: np.ndarray, tol: float = 0.0, splits: tuple[tuple[int, int], ...] = ()) -> float:
    """rel L2 of ``a`` against ``b`` (same size) in the element order of ``b`` or of one of its axis orders (size-1
    axes dropped, then flattened: reshapes and transposes); ``splits`` (s, b): an axis of s*b elements is also
    tried as two (the tokens of [s, b, h] flattened one way on one side, the other way on the other); stops at
    the first within ``tol``."""
    flat = _f(a).reshape(-1)
    b = _f(b)
    e = _rel(flat, b.reshape(-1))
    if e <= tol:
        return e
    sq = b.reshape([d for d in b.shape if d != 1]) if b.ndim else b
    forms = [sq]
    for n1, n2 in splits:
        for ax, d in enumerate(sq.shape):
            if d == n1 * n2 and n1 > 1 and n2 > 1:
                forms.append(sq.reshape(sq.shape[:ax] + (n1, n2) + sq.shape[ax + 1:]))
    for form in forms:
        if not 1 < form.ndim <= 5:
            continue
        for perm in itertools.permutations(range(form.ndim)):
            if perm == tuple(range(form.ndim)):
                continue
            e = min(e, _rel(flat, np.transpose(form, perm).reshape(-1)))
            if e <= tol:
                return e
    return e


# ---------------------------------------------------------------------------------------------------------
# The drill-down
# ---------------------------------------------------------------------------------------------------------

def drill(baseline: list[Op], candidate: list[Op], *, dtype: str = "float32",
          terminals: list[np.ndarray] | None = None, leaves: list[np.ndarray] | None = None,
          layout_leaves: list[np.ndarray] | None = None, tokens: tuple[int, int] | None = None) -> dict[str, Any]:
    """Compare the two sides' operators; returns {rows (one per operator, both sides), named (the culprit
    operators), lines, counts}. ``terminals``: the candidate module's results (its output and gradients, as it
    returned them), whose producing operators are where a departure must arrive to be named (default: every
    operator whose output no later operator reads). ``leaves``: the candidate's weights and arguments (its
    graph's parameters): with scalar constants, the inputs a departure may be blamed on (other tensors no
    listed operator produced are views the dump leaves out); ``layout_leaves``: those of them that are the
    baseline's in another layout (the mapping's conversion), never blamed. An operator whose inputs match and
    whose output holds a baseline tensor's values in another order (an interleaved layout's gradient) departs by
    layout only and is not a source either. ``tokens``: (s, b) of the module's activations, so that tokens
    flattened s-major on one side match b-major on the other."""
    d = normalize(dtype)
    own_line = OWN_ULPS * EPS.get(d, EPS["float32"])
    match_line = TOLERANCE.get(d, TOLERANCE["float32"])[0]
    pool = Pool(baseline, match_line, (tuple(tokens), tuple(reversed(tokens))) if tokens else ())
    blamed: set[str] = set()          # leaves a departure was already blamed on (named once, at first use)
    leaf_keys = {_key(a) for a in leaves or []}
    layout_keys = {_key(a) for a in layout_leaves or []}
    rows: list[dict[str, Any]] = []
    base_own: dict[int, float | None] = {}
    for op in baseline:
        e = own_error(op) if op.kind not in _LAYOUT else None
        base_own[op.index] = e
        rows.append(_row(op, e, own_line, None))
    produced: dict[str, int] = {}
    taint: dict[str, set[int]] = {}
    cand_rows: dict[int, dict[str, Any]] = {}
    departures: dict[int, dict[str, Any]] = {}
    consumed: set[str] = set()
    out_keys: dict[int, str] = {}
    for op in candidate:
        suspect = _suspect(op)
        e = own_error(op) if op.kind not in _LAYOUT and suspect is None else None
        floating = bool(op.outs) and op.outs[0].dtype.kind == "f"
        m_out = pool.match(op.outs[0]) if floating else None
        row = _row(op, e, own_line, m_out)
        if suspect is not None:
            row["note"] = suspect
        ins_state = []
        inherited: set[int] = set()
        for slot, v in op.ins:
            if not isinstance(v, np.ndarray) or v.dtype.kind != "f":
                continue
            k = _key(v)
            consumed.add(k)
            src = produced.get(k)
            matched = pool.match(v)
            ins_state.append((slot, v, src, matched))
            if matched is None and k in taint:
                inherited |= taint[k]
        why = None
        if floating and m_out is None and ins_state:
            unmatched_leaves = [(s, v) for s, v, src, m in ins_state if m is None and src is None
                                and (v.size == 1 or _key(v) in leaf_keys) and _key(v) not in layout_keys]
            if unmatched_leaves and _key(unmatched_leaves[0][1]) not in blamed:
                s, v = unmatched_leaves[0]
                blamed.add(_key(v))
                same_values = v.size > 1 and _sorted_in(pool, v, match_line)
                why = (f"input {s} ({'a constant ' + _scalar(v) if v.size == 1 else 'shape ' + str(list(v.shape))}) "
                       "matches no baseline tensor" + (" (the same values in another order: a layout or conversion "
                                                       "difference)" if same_values else ""))
            elif op.kind not in _MOVES and all(m is not None or _key(v) in layout_keys for _, v, _, m in ins_state):
                if _sorted_in(pool, op.outs[0], match_line):
                    row["note"] = "its output holds a baseline tensor's values in another order (a layout)"
                else:
                    why = "its inputs match the baseline's, its output matches no baseline tensor"
        if why is not None:
            departures[op.index] = {"why": why}
            row["departure"] = why
        if floating:
            k = _key(op.outs[0])
            out_keys[op.index] = k
            produced.setdefault(k, op.index)
            if m_out is None:       # a departure, or an operator whose own error fails, is a source
                source = why is not None or row["own_verdict"] == "fail"
                taint[k] = inherited | ({op.index} if source else set())
        row["inherits_from"] = sorted(inherited)
        rows.append(row)
        cand_rows[op.index] = row
    # where the module's results come from
    if terminals:
        tkeys = {_key(t) for t in terminals}
        ends = [i for i, k in out_keys.items() if k in tkeys]
    else:
        ends = []
    if not ends:
        ends = [i for i, k in out_keys.items() if k not in consumed]
    reached: set[int] = set()
    unmatched_ends = []
    for i in ends:
        k = out_keys[i]
        if cand_rows[i]["match"] is None:
            unmatched_ends.append(i)
            reached |= taint.get(k, set())
    named = []
    for i in sorted(reached):
        r = cand_rows[i]
        op = next(o for o in candidate if o.index == i)
        cast = op.kind in ("Cast", "_to_copy")
        bop = None if cast else _baseline_op_for(candidate, i, pool, baseline)
        why = departures[i]["why"] if i in departures else "its own error exceeds the line"
        if i in departures and r["own_verdict"] == "fail":
            why += "; its own error exceeds the line"
        named.append({**{k: r[k] for k in ("index", "op", "kind", "phase", "dtype", "own_error", "own_line",
                                           "own_verdict")},
                      "why": why, "cross_error": _cast_cross(op, pool) if cast else _cross(r, candidate, i, bop),
                      "cross_line": match_line, "baseline_op": bop.name if bop else None,
                      "baseline_own_error": base_own.get(bop.index) if bop else None})
    named.sort(key=lambda n: (n["phase"] != "forward", n["index"]))
    module_differs = bool(unmatched_ends)
    return {"rows": rows, "named": named, "dtype": d, "own_line": own_line, "match_line": match_line,
            "module_differs": module_differs, "unmatched_results": [cand_rows[i]["op"] for i in unmatched_ends],
            "counts": {"baseline": len(baseline), "candidate": len(candidate),
                       "matched": sum(1 for r in cand_rows.values() if r["match"] is not None),
                       "results": len(ends)}}


def _suspect(op: Op) -> str | None:
    """Why a kernel's dumped tensors cannot be judged, or None. Measured on CPU (MindSpore 2.10): some expanded
    kernels' float32 outputs are written labelled float16 (half their bytes, read as float16), and the kernel
    reading them shows the same; an operator that is not a cast keeps its floating inputs' dtype, and a cast
    to the same dtype changes nothing."""
    if not op.outs or op.outs[0].dtype.kind != "f":
        return None
    ins = set(op.in_dtypes) or {normalize(str(v.dtype)) for _, v in _float_inputs(op)}
    out = normalize(op.dtype or str(op.outs[0].dtype))
    if op.kind in ("Cast", "_to_copy"):
        x = next((v for _, v in _float_inputs(op)), None)
        if x is not None and ins == {out} and x.shape == op.outs[0].shape and not np.array_equal(x, op.outs[0]):
            return f"a {out} -> {out} cast that changed values: the dump's dtype labels are wrong (not judged)"
        return None
    if ins and out not in ins:
        return (f"{'/'.join(sorted(str(d) for d in ins))} in, {out} out: the dump's dtype labels are wrong "
                "(not judged)")
    return None


def _sorted_in(pool: Pool, v: np.ndarray, tol: float) -> bool:
    """Whether the baseline holds a tensor of the same size with the same values in some order."""
    s = np.sort(_f(v).reshape(-1))
    return any(_rel(s, np.sort(b.reshape(-1))) <= tol for _, b, _ in pool.by_size.get(v.size, []))


def _scalar(v: np.ndarray) -> str:
    return f"{float(np.asarray(v).reshape(-1)[0]):.6g}"


def _cross(row: dict[str, Any], candidate: list[Op], i: int, bop: Op | None) -> float | None:
    """The operator's output against the baseline's: its match, else the output of the baseline operator it
    stands for (same size), else None."""
    if row.get("match"):
        return row["match"][1]
    op = next(o for o in candidate if o.index == i)
    if bop is None or not bop.outs or not op.outs or bop.outs[0].size != op.outs[0].size:
        return None
    return layout_rel(op.outs[0], bop.outs[0])


def _cast_cross(op: Op, pool: Pool) -> float | None:
    """A cast keeps the value: its output against the baseline tensor its input matched."""
    x = next((v for _, v in _float_inputs(op)), None)
    m = pool.match(x) if x is not None else None
    if m is None or not op.outs:
        return None
    ref = next((b for r, b, _ in pool.by_size.get(x.size, []) if r == m[0]), None)
    return None if ref is None else layout_rel(op.outs[0], ref)


def _baseline_op_for(candidate: list[Op], i: int, pool: Pool, baseline: list[Op]) -> Op | None:
    """The baseline operator that read the same inputs (the one the departing candidate operator stands for)."""
    op = next(o for o in candidate if o.index == i)
    common: set[int] | None = None
    for _, v in _float_inputs(op):
        m = pool.match(v)
        readers = set(pool.consumers.get(pool.key_of.get(m[0], ""), [])) if m is not None else set()
        if readers:
            common = readers if common is None else (common & readers or common)
    by_index = {b.index: b for b in baseline}
    readers = [by_index[j] for j in sorted(common or ()) if j in by_index and by_index[j].kind not in _LAYOUT]
    size = op.outs[0].size if op.outs else -1
    same = [b for b in readers if b.outs and b.outs[0].size == size]
    return same[0] if same else None


def _row(op: Op, own: float | None, own_line: float, match: tuple[str, float] | None) -> dict[str, Any]:
    verdict = None if own is None else ("fail" if not math.isfinite(own) or own > own_line else "pass")
    return {"side": op.side, "index": op.index, "op": op.name, "kind": op.kind, "phase": op.phase,
            "dtype": op.dtype, "shape": list(op.outs[0].shape) if op.outs else None, "own_error": own,
            "own_line": own_line, "own_verdict": verdict, "match": list(match) if match else None}
