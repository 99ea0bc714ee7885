"""The norm_grad fault: a backward-only mistake planted in one RMSNorm of the MindFormers mcore candidate.

Why: forward isolation and every forward comparison pass on it; only the gradient departs, as with a custom
bprop written by hand, a recompute boundary, or MindFormers' PYNATIVE MLA projection gradients. The norm's
RmsNorm primitive (or its CPU stand-in) is replaced by :class:`GradFaultRmsNorm`: the same forward,
x * rsqrt(mean(x^2) + eps) * gamma, with a hand-written bprop whose input gradient is right and whose weight
gradient forgets the rstd factor (sum(dy * x) instead of sum(dy * x * rstd)). Only that norm's weight gradient
is wrong; every other gradient, the loss and every activation are the correct candidate's. Works in GRAPH and
PYNATIVE (a Cell with ``bprop``).
"""

from __future__ import annotations

from typing import Any

from mindspore import Tensor, nn, ops

#: the candidate norm the fault replaces (mcore names are Megatron's)
GRAD_FAULT_MODULE = "decoder.layers.1.pre_mlp_layernorm"


class GradFaultRmsNorm(nn.Cell):
    """``ops.RmsNorm(eps)``'s interface, (x, gamma) -> (x * rstd * gamma, rstd), with a wrong weight gradient."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = float(eps)
        self.mean = ops.ReduceMean(keep_dims=True)
        self.sum = ops.ReduceSum(keep_dims=False)
        self.rsqrt = ops.Rsqrt()

    def construct(self, x: Tensor, gamma: Tensor) -> tuple[Tensor, Tensor]:
        rstd = self.rsqrt(self.mean(x * x, -1) + self.eps)
        return x * rstd * gamma, rstd

    def bprop(self, x: Tensor, gamma: Tensor, out: Any, dout: Any) -> tuple[Tensor, Tensor]:
        dy, drstd = dout[0], dout[1]
        rstd = out[1]
        n = x.shape[-1]
        gdy = dy * gamma
        r3 = rstd * rstd * rstd
        dx = rstd * gdy - x * r3 * self.mean(x * gdy, -1) - x * r3 * drstd / n
        axes = tuple(range(x.ndim - 1))
        dgamma = self.sum(dy * x, axes)          # the fault: should be sum(dy * x * rstd)
        return dx, dgamma


def plant_norm_grad_fault(net: nn.Cell, module: str = GRAD_FAULT_MODULE) -> nn.Cell:
    """Replace the RmsNorm of ``module`` (a MindFormers FusedRMSNorm; found under a wrapper's prefix too) by
    :class:`GradFaultRmsNorm`; returns the norm cell. KeyError when there is no such norm."""
    hits = [c for n, c in net.cells_and_names() if n == module or n.endswith("." + module)]
    if len(hits) != 1 or not hasattr(hits[0], "norm"):
        raise KeyError(f"{module}: no single RMSNorm cell of that name")
    cell = hits[0]
    prim = cell.norm
    eps = getattr(prim, "epsilon", getattr(prim, "eps", getattr(cell, "eps", 1e-6)))
    cell._primitives.pop("norm", None)  # noqa: SLF001 - MindSpore keeps primitive attributes here
    cell.__dict__.pop("norm", None)
    cell.norm = GradFaultRmsNorm(float(eps))
    return cell
