"""Per-step scalars of the two runs: step-1 and step-2 loss, the long run against the band, grad norm,
learning-rate schedule, first non-finite value (comparators.scalars computes them together, once)."""

from __future__ import annotations

from align.stages import Stage
from align.stages.evidence import Evidence
from core.findings import StageResult


def _from_scalars(name: str):
    def run(ev: Evidence) -> StageResult:
        return ev.scalars.stages[name]
    run.__name__ = f"run_{name}"
    return run


LOSS = ("a loss per step in both runs (a run store, a Megatron-LM or MindFormers log, TensorBoard, "
        "golden-values JSON)")
STAGES = [
    Stage("step1_loss", 40, "Step-1 loss (forward)", LOSS,
          "log or dump step 1 of both runs from the same weights and the same batch", _from_scalars("step1_loss")),
    Stage("step2_loss", 70, "Step-2 loss (first optimizer update)", LOSS,
          "run at least 2 steps on both sides", _from_scalars("step2_loss")),
    Stage("long_run", 110, "Long run against the error band", LOSS + "; the band needs --repeat",
          "train both runs for the same steps; repeat the baseline without determinism and pass it with "
          "--repeat", _from_scalars("long_run")),
    Stage("grad_norm", 120, "Global grad norm", "the grad norm per step in both runs",
          "Megatron logs 'grad norm' by default (--log-num-zeros-in-grad not needed); MindFormers logs "
          "global_norm", _from_scalars("grad_norm")),
    Stage("lr_schedule", 130, "Learning-rate schedule", "the learning rate per step in both runs",
          "Megatron logs 'learning rate'; MindFormers logs 'lr'", _from_scalars("lr_schedule")),
    Stage("nonfinite", 140, "Non-finite loss or grad norm", "loss or grad norm per step",
          "log loss and grad norm every step (--log-interval 1)", _from_scalars("nonfinite")),
]
