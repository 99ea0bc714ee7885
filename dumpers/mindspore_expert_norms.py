"""Per-expert gradient norms of MindFormers' stacked expert parameters, so a finding names one expert.

Why: MindFormers stacks a layer's routed experts in one Parameter (``mlp.experts.weight1`` [E*H, 2F],
``weight2`` [E*F, H], expert e in rows [e*R, (e+1)*R)), and ``MFTrainOneStepCell``'s ``local_norm`` output
holds one squared sum per Parameter: a fault in one expert reads as the whole layer's. The training cell
computes those sums in its ``localnorm`` Cell (MindFormers' ``LocalNorm``) from the unscaled gradients;
:func:`install` replaces it, before the first compile, by :class:`ExpertLocalNorm`, which returns exactly
LocalNorm's outputs (the run and its logs are unchanged) and also assigns each expert's squared sum into a
Parameter (plain graph ops, ``ops.assign`` kept by ``ops.depend``: GRAPH and PYNATIVE, as the GRAPH layer
capture does). After the step the dumper reads it (:meth:`ExpertNorms.read`) and records ``NAME[e]`` rows
(``mapping.rules.EXPERT_PIECE``, e the index in the full stacked tensor: the global expert) in place of
NAME's row; the pieces' squares sum to NAME's, which is checked before they replace it.

Stacked parameters are found from the model: the trainable 2-D Parameters of a cell with an integer
``num_local_experts`` (MindFormers' ``FFNGroupedGEMM``, whose count is the model's ``num_moe_experts``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from mapping.rules import expert_piece

STORE_NAME = "xf_expert_norms.squares"
MECHANISM = ("the training cell's LocalNorm replaced by one that also assigns each stacked expert's squared "
             "gradient sum into a Parameter (outputs unchanged)")


def stacked_experts(net: nn.Cell) -> dict[str, int]:
    """{Parameter name: experts stacked on its dim 0} for every stacked expert Parameter below ``net``."""
    out: dict[str, int] = {}
    for _, cell in net.cells_and_names():
        n = getattr(cell, "num_local_experts", None)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            continue
        for p in cell._params.values():   # noqa: SLF001 - the cell's own Parameters, not its children's
            if p is not None and p.requires_grad and len(p.shape) == 2 and p.shape[0] % n == 0:
                out[p.name] = n
    return out


class ExpertLocalNorm(nn.Cell):
    """MindFormers' LocalNorm (``inner``, its outputs unchanged) that also assigns the squared sum of each
    expert's rows of the stacked gradients at ``positions`` ((index in the gradients, experts), ...) into
    ``xf_squares``, in that order."""

    def __init__(self, inner: nn.Cell, positions: Sequence[tuple[int, int]]) -> None:
        super().__init__(auto_prefix=False)
        self.inner = inner
        self.positions = tuple((int(i), int(e)) for i, e in positions)
        total = sum(e for _, e in self.positions)
        self.xf_squares = Parameter(Tensor(np.full(total, np.nan, np.float32)), requires_grad=False,
                                    name=STORE_NAME)

    def construct(self, grads: Any) -> Any:
        square_sum, size = self.inner(grads)
        parts = ()
        for i, e in self.positions:
            g = ops.stop_gradient(ops.cast(grads[i], ms.float32))
            parts = parts + (ops.square(g).reshape((e, -1)).sum(axis=1),)
        done = ops.assign(self.xf_squares, ops.concat(parts))
        first = ops.depend(square_sum[0], done)
        return (first,) + square_sum[1:], size


class ExpertNorms:
    """The installed :class:`ExpertLocalNorm` of one training cell: which Parameters, how many experts."""

    def __init__(self, cell: ExpertLocalNorm, names: Sequence[str]) -> None:
        self.cell = cell
        self.names = list(names)

    def reset(self) -> None:
        """Mark the store unwritten (NaN) before a step: a step whose graph did not write it is not read."""
        self.cell.xf_squares.set_data(Tensor(np.full(self.cell.xf_squares.shape, np.nan, np.float32)))

    def read(self) -> dict[str, np.ndarray]:
        """{stacked Parameter name: its experts' squared gradient sums} of the step that just ran."""
        flat = np.asarray(self.cell.xf_squares.asnumpy(), dtype=np.float64)
        out, at = {}, 0
        for name, (_, e) in zip(self.names, self.cell.positions, strict=True):
            out[name] = flat[at:at + e]
            at += e
        return out


def install(train_cell: nn.Cell) -> ExpertNorms | None:
    """Replace ``train_cell.localnorm`` (MFTrainOneStepCell with ``local_norm=True``) before its first
    compile; None when the cell has no LocalNorm or the model no stacked experts."""
    inner = getattr(train_cell, "localnorm", None)
    if inner is None or not getattr(train_cell, "local_norm", False):
        return None
    if isinstance(inner, ExpertLocalNorm):   # a second dumper on the same cell: the compiled graph stays valid
        return ExpertNorms(inner, [n for n in _optimizer_names(train_cell) if n in stacked_experts(train_cell)])
    stacked = stacked_experts(train_cell)
    names = _optimizer_names(train_cell)
    positions = [(i, stacked[n]) for i, n in enumerate(names) if n in stacked]
    if not positions:
        return None
    keep = {id(p): p.name for p in train_cell.get_parameters()}
    cell = ExpertLocalNorm(inner, positions)
    train_cell.localnorm = cell
    for p in train_cell.get_parameters():   # inserting a cell may re-prefix names below it: give them back
        if id(p) in keep:
            p.name = keep[id(p)]
    cell.xf_squares.name = STORE_NAME
    return ExpertNorms(cell, [names[i] for i, _ in positions])


def _optimizer_names(train_cell: nn.Cell) -> list[str]:
    """The gradients' order in the training cell: its optimizer's parameters."""
    return [p.name for p in train_cell.optimizer.parameters]


def split_rows(names: Sequence[str], norms: Sequence[float], numel: Sequence[int],
               squares: Mapping[str, np.ndarray], rtol: float = 1e-4
               ) -> tuple[list[str], list[float], list[int], list[int]]:
    """Named norms with each stacked Parameter's row replaced by its experts' rows ``NAME[e]``, where the
    experts' squares are finite and add up to NAME's (within ``rtol``: float32 sums in another order); a
    Parameter whose pieces do not (not written this step, non-finite gradients) keeps its one row. The last
    list gives each row's source row (its layout columns are the source's)."""
    out_n, out_v, out_c, origin = [], [], [], []
    for i, (name, v, c) in enumerate(zip(names, norms, numel, strict=True)):
        sq = squares.get(name)
        whole = float(v) ** 2
        if sq is not None and len(sq) and np.all(np.isfinite(sq)) and np.isfinite(whole) and abs(
                float(np.sum(sq)) - whole) <= rtol * max(whole, 1e-30):
            e = len(sq)
            for k, s in enumerate(sq):
                out_n.append(expert_piece(name, k))
                out_v.append(float(np.sqrt(max(float(s), 0.0))))
                out_c.append(int(c) // e if int(c) > 0 else int(c))
                origin.append(i)
            continue
        out_n.append(name)
        out_v.append(float(v))
        out_c.append(int(c))
        origin.append(i)
    return out_n, out_v, out_c, origin


def host_squares(names: Sequence[str], arrays: Sequence[np.ndarray], stacked: Mapping[str, int]
                 ) -> dict[str, np.ndarray]:
    """The same squares from gradients on the host (``record_grads``): float64 sums of each expert's rows."""
    out = {}
    for name, a in zip(names, arrays, strict=True):
        e = stacked.get(name)
        if e and a.ndim == 2 and a.shape[0] % e == 0:
            out[name] = np.sum(np.square(a.reshape(e, -1), dtype=np.float64), axis=1)
    return out
