"""Write the bundled example log pair: a Megatron-LM baseline, a repeat of it, a MindFormers candidate.

The loss curves are synthetic (a decaying curve plus seeded noise, written in each tool's real line
format) so the log path can be shown without training anything; ``align demo --paired`` runs the real
Megatron-core vs MindFormers experiment instead. Run ``python -m demo.example_logs DIR``;
with ``--fault`` the candidate gets a planted problem (used by the tests).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np

FAULTS = ("none", "late_gap", "step1", "diverge", "nan")

ARGS_BLOCK = """------------------------ arguments ------------------------
  adam_beta1 ...................................... 0.9
  adam_beta2 ...................................... 0.95
  adam_eps ........................................ 1e-08
  clip_grad ....................................... 1.0
  ffn_hidden_size ................................. 1376
  global_batch_size ............................... 16
  hidden_dropout .................................. 0.0
  hidden_size ..................................... 512
  lr .............................................. 0.0003
  lr_decay_style .................................. cosine
  lr_warmup_iters ................................. 20
  micro_batch_size ................................ 2
  min_lr .......................................... 3e-05
  normalization ................................... RMSNorm
  num_attention_heads ............................. 8
  num_layers ...................................... 4
  pipeline_model_parallel_size .................... 1
  seq_length ...................................... 1024
  swiglu .......................................... True
  tensor_model_parallel_size ...................... 1
  weight_decay .................................... 0.1
  world_size ...................................... 8
-------------------- end of arguments ---------------------
"""


def lr_at(step: int, total: int, peak: float = 3e-4, warmup: int = 20, floor: float = 3e-5) -> float:
    if step <= warmup:
        return peak * step / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * frac))


def curves(steps: int, seed: int, fault: str = "none", fault_step: int | None = None) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1234)
    t = np.arange(1, steps + 1)
    base = 2.2 + 8.6 * np.exp(-t / 45.0) + 0.04 * np.sin(t / 7.0)  # shared by all runs: same data order
    noise = np.random.default_rng(seed).normal(0, 2e-3, steps) * (1 + 3 * np.exp(-t / 30.0))
    loss = base + noise
    gnorm = 0.6 + 4.0 * np.exp(-t / 30.0) + np.abs(rng.normal(0, 0.05, steps)) + \
        np.random.default_rng(seed + 7).normal(0, 5e-3, steps)
    fs = fault_step or steps // 2
    if fault == "late_gap":
        loss[int(steps * 0.8):] += 0.1
    elif fault == "step1":
        loss[0] *= 1.02
    elif fault == "diverge":
        loss[fs - 1:] += 0.002 * np.arange(1, steps - fs + 2) + 0.02
    elif fault == "nan":
        loss[fs - 1:] = np.nan
        gnorm[fs - 1:] = np.nan
    return {"loss": loss, "grad_norm": gnorm, "lr": np.array([lr_at(int(s), steps) for s in t])}


def megatron_log(path: Path, steps: int, seed: int, fault: str = "none", fault_step: int | None = None) -> None:
    c = curves(steps, seed, fault, fault_step)
    lines = ["using world size: 8, data-parallel size: 8, tensor-model-parallel size: 1",
             ARGS_BLOCK.rstrip("\n"), "> building GPT model ...", "[after dataloaders are built] datetime: "
             "2024-05-01 10:00:00", "training ..."]
    for i in range(steps):
        s = i + 1
        loss, gn = c["loss"][i], c["grad_norm"][i]
        nan = not math.isfinite(loss)
        # the first iteration's time includes start-up (Megatron starts its interval timer before the loop)
        elapsed = 4612.4 if s == 1 else 820 + (s * 37) % 11
        lines.append(
            f"[2024-05-01 10:{(s // 60) % 60:02d}:{s % 60:02d}] iteration {s:>8}/{steps:>8} | consumed "
            f"samples: {s * 16:>12} | elapsed time per iteration (ms): {elapsed:.1f} | "
            f"learning rate: {c['lr'][i]:.6E} | global batch size:    16 | lm loss: "
            f"{'nan' if nan else f'{loss:.6E}'} | loss scale: 1.0 | grad norm: "
            f"{'nan' if not math.isfinite(gn) else f'{gn:.3f}'} | num zeros: 0.0 | number of skipped "
            f"iterations: {1 if nan else 0:>3} | number of nan iterations: {1 if nan else 0:>3} |")
        if s == steps // 3:
            lines.append("/usr/lib/python3/dist-packages/torch/utils/data/dataloader.py:558: UserWarning: "
                         "This DataLoader will create 4 worker processes in total.")
    path.write_text("\n".join(lines) + "\n")


def mindformers_log(path: Path, steps: int, seed: int, fault: str = "none",
                    fault_step: int | None = None) -> None:
    c = curves(steps, seed, fault, fault_step)
    pre = "2024-05-01 11:00:{:02d},{:03d} - mindformers[mindformers/core/callback/callback.py:747] - INFO - "
    lines = [pre.format(0, 1)[:-len("INFO - ")] + "INFO - .........Starting Training Model.........."]
    avg = 0.0
    for i in range(steps):
        s = i + 1
        loss, gn = c["loss"][i], c["grad_norm"][i]
        avg += (loss - avg) / s
        lines.append(pre.format(s % 60, s % 1000) +
                     f"{{ Epoch:[  1/  1], step:[{s:>5}/{steps:>5}], loss:[{loss:.6f}/{avg:.6f}], "
                     f"per_step_time: {560 + s % 40}ms, lr: {str(np.float32(c['lr'][i]))}, overflow cond: False, "
                     f"loss_scale: 1.0, global_norm: [{str(np.float32(gn))}]")
    path.write_text("\n".join(lines) + "\n")


def write_examples(out: Path, steps: int = 300, fault: str = "none", fault_step: int | None = None) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"baseline": out / "megatron_baseline.log", "repeat": out / "megatron_repeat.log",
             "candidate": out / "mindformers_candidate.log"}
    megatron_log(paths["baseline"], steps, seed=1)
    megatron_log(paths["repeat"], steps, seed=2)
    mindformers_log(paths["candidate"], steps, seed=3, fault=fault, fault_step=fault_step)
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--fault", choices=FAULTS, default="none")
    ap.add_argument("--fault-step", type=int, default=None)
    a = ap.parse_args()
    for role, p in write_examples(a.out, a.steps, a.fault, a.fault_step).items():
        print(f"{role}: {p}")


if __name__ == "__main__":
    main()
