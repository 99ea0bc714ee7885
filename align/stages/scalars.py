"""Per-step scalars of the two runs: step-1 and step-2 loss, the long run against the band, grad norm,
learning-rate schedule, first non-finite value (comparators.scalars computes them together, once)."""

from __future__ import annotations

from typing import Any

from align.stages import LONG_RUN, Figure, FigureContext, Stage
from align.stages.evidence import Evidence
from core.findings import StageResult
from reports import figures


def _from_scalars(name: str):
    def run(ev: Evidence) -> StageResult:
        return ev.scalars.stages[name]
    run.__name__ = f"run_{name}"
    return run


def step_row(res: StageResult) -> dict[str, Any]:
    """The step-1 / step-2 table's row: step, baseline, candidate, abs and rel delta, threshold."""
    return {"stage": res.name, "verdict": res.verdict, **res.details}


def first_nonfinite_step(ctx: FigureContext) -> int | None:
    """The first step either run logged a non-finite loss or grad norm at (the nonfinite stage's result)."""
    nf = ctx.stages.get("nonfinite")
    steps = [v["step"] for v in nf.details.get("first_nonfinite", {}).values()] if nf is not None else []
    return min(steps) if steps else None


def _curves(title: str, file: str, prefix: str = ""):
    """A stage's two figures over the whole run: both runs' curves (repeats in grey), then the delta against
    the band with the divergence step and the first non-finite step marked; none without a scalar table."""
    def curves(res: StageResult, ctx: FigureContext) -> list[Figure]:
        t = ctx.table
        if t.empty:
            return []
        figures.warm()   # before the writer forks: its child inherits the built curve figure
        v, div, nf = res.verdict, res.details.get("divergence_step"), first_nonfinite_step(ctx)
        return [Figure(f"{title} curves", f"{file}.png",
                       lambda p: figures.loss_curves(t, ctx.labels, v, p, title=title, prefix=prefix)),
                Figure(f"{title} delta against the band", f"{file}_delta_band.png",
                       lambda p: figures.delta_band(t, v, p, div, nf, title=f"{title} delta", prefix=prefix))]
    curves.__name__ = f"{file}_figures"
    return curves


LOSS = ("a loss per step in both runs (a run store, a Megatron-LM or MindFormers log, TensorBoard, "
        "golden-values JSON)")
STAGES = [
    Stage("step1_loss", 40, "Step-1 loss (forward)", LOSS,
          "log or dump step 1 of both runs from the same weights and the same batch", _from_scalars("step1_loss"),
          step_row=step_row, summary_keys=(), part="step 1 and 2",
          explains=("step1_local_norm", "step2_loss", "lr0_run", "nonfinite", *LONG_RUN),
          why="Same weights and same batch, and the loss differs: the forward pass differs (a layer, a precision, "
              "the loss reduction or its mask).",
          next="capture layer tensors at step 1 on both sides (DumpConfig(tensor_steps=[1], modules=[...])) and "
               "run align report again: the layer profile names the first departing module"),
    Stage("step2_loss", 70, "Step-2 loss (first optimizer update)", LOSS,
          "run at least 2 steps on both sides", _from_scalars("step2_loss"), step_row=step_row, summary_keys=(),
          part="step 1 and 2", explains=LONG_RUN,
          why="Step 1 agrees and step 2 does not: the first optimizer update differs (learning rate, Adam's "
              "settings, weight decay, clipping, loss scale).",
          next="run the optimizer check (--optimizer-check, docs/workflow.md): the baseline's step-1 gradients "
               "through the candidate's optimizer name the parameter and the setting"),
    Stage("long_run", 110, "Long run against the error band", LOSS + "; the band needs --repeat",
          "train both runs for the same steps; repeat the baseline without determinism and pass it with "
          "--repeat", _from_scalars("long_run"), figures=_curves("Loss", "loss"), figure_order=1,
          summary_keys=("steps", "outside_band_fraction", "mean_delta", "divergence_step"),
          explains=("spikes", "divergence_data"),
          why="Steps 1 and 2 agree but the runs drift apart later, beyond how far the baseline drifts from "
              "itself: an accumulated precision difference, the data order or a schedule.",
          next="see 'Data near the divergence'; record named gradient norms on both runs and a repeat "
               "(norm_trajectories names the first parameter that leaves its band)"),
    Stage("grad_norm", 120, "Global grad norm", "the grad norm per step in both runs",
          "Megatron logs 'grad norm' by default (--log-num-zeros-in-grad not needed); MindFormers logs "
          "global_norm", _from_scalars("grad_norm"), figures=_curves("Grad norm", "grad_norm", "grad_norm_"),
          figure_order=2, explains=("spikes",),
          why="The global gradient norm differs beyond the band: the backward pass, or how the norm is reduced "
              "over ranks (or clipped), differs.",
          next="compare named gradient norms (step-1 local norms; norm trajectories over the run) to find the "
               "parameter"),
    Stage("lr_schedule", 130, "Learning-rate schedule", "the learning rate per step in both runs",
          "Megatron logs 'learning rate'; MindFormers logs 'lr'", _from_scalars("lr_schedule"),
          explains=("step2_loss", *LONG_RUN),
          why="The learning rates differ: the schedule (warm-up, decay style, minimum lr, iteration count) is "
              "not the same, and every update after it differs.",
          next="make the schedule the same: Megatron --lr-decay-style / --lr-warmup-iters / --min-lr against the "
               "YAML's lr_schedule (align check-config)"),
    Stage("nonfinite", 140, "Non-finite loss or grad norm", "loss or grad norm per step",
          "log loss and grad norm every step (--log-interval 1)", _from_scalars("nonfinite"),
          explains=("step1_local_norm", "step2_loss", "lr0_run", *LONG_RUN),
          why="The loss or the gradient norm turned NaN/Inf: everything after that step is undefined.",
          next="record named gradient norms every step (the dumpers do) so the NaN trace names the first "
               "parameter, its module and its rank"),
]
