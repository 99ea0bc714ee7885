"""Regenerate tests/data/mindformers_2x/: log lines printed by MindFormers 2.1.0's own callbacks.

Why: the importer must read what MindFormers really prints. This script calls the installed package's
``MFLossMonitor.print_output_info`` with the arguments its ``on_train_step_end`` passes (the step line:
mcore dense, MoE with ``lm_loss`` / ``load_balancing_loss`` / ``mtp_loss``, sink mode,
``loss_scale: unavailable``, no ``lr``) and ``TrainingStateMonitor._output`` (``local_norm/<name>: <value>``
lines) through MindFormers' real logger, in a child process whose stdout is the log, exactly what msrun
writes to ``worker_N.log``. Older lines are formatted with the format strings of the MindFormers releases
that printed them (quoted below with their tag). ``expected.json`` holds every value that went in.

    .venv/bin/python tests/data/make_mindformers_2x_logs.py      # ~15 s
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent / "mindformers_2x"
STEPS = 4
# mcore parameter names (MindFormers 2.x Qwen3, as TrainingStateMonitor prints them)
NAMES = ["embedding.word_embeddings.weight", "decoder.layers.0.input_layernorm.weight",
         "decoder.layers.0.self_attention.linear_qkv.weight", "decoder.layers.0.self_attention.linear_proj.weight",
         "decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.mlp.linear_fc2.weight",
         "decoder.final_layernorm.weight", "output_layer.weight"]
# MindFormers v1.0.0 mindformers/core/callback/callback.py (MFLossMonitor.print_output_info, sink mode) and
# v0.6.0 (MFLossMonitor, no brace), as logged by their file handler
# '[%(levelname)s] %(asctime)s [%(filepath)s:%(lineno)d] %(funcName)s: %(message)s'.
V1_SINK = ("{ Epoch:[%3d/%3d], step:[%5d/%5d], loss: %5.3f, "
           "per_step_time: %dms, lr: %s, overflow cond: %s, loss_scale: %s")
V0 = ("Epoch:[%3d/%3d], step:[%5d/%5d], "
      "loss:[%5.3f/%5.3f], time:%5.3f ms, "
      "lr:%s, overflow cond: %s, loss_scale: %s")


def values(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    lm = (4.0 - 0.1 * np.arange(STEPS) + rng.normal(0, 0.01, STEPS)).astype(np.float32)
    aux = rng.uniform(0.01, 0.03, STEPS).astype(np.float32)
    mtp = (lm + rng.uniform(0.1, 0.3, STEPS)).astype(np.float32)
    rng.uniform(0.5, 2.0, STEPS)       # drawn and unused: the other values stay those of earlier fixtures
    lr = [1e-4 * (s + 1) for s in range(STEPS)]
    ms = [int(x) for x in rng.integers(300, 900, STEPS)]
    norms = rng.uniform(1e-4, 1.0, (STEPS, len(NAMES))).astype(np.float32)
    # the global norm the training cell prints is the named norms' total (the evidence self-check holds a
    # log to it; a made-up one would read as a recombination that misses parameters)
    gnorm = np.sqrt(np.sum(np.square(norms.astype(np.float64)), axis=1)).astype(np.float32)
    return {"lm": lm.tolist(), "aux": aux.tolist(), "mtp": mtp.tolist(), "gnorm": gnorm.tolist(), "lr": lr,
            "ms": ms, "norms": norms.tolist()}


def child(kind: str, seed: int) -> None:
    """Print one log through MindFormers' own callbacks (runs in the child process)."""
    from mindformers.core.callback.callback import MFLossMonitor, TrainingStateMonitor

    v = values(seed)
    moe = kind == "moe_mtp"
    mon = MFLossMonitor(learning_rate=None if kind == "no_lr" else 1e-4, per_print_times=1, global_batch_size=8)
    mon.print_separate_loss, mon.is_moe_model, mon.is_mtp_model = moe, moe, moe
    mon.mf_calculated, mon.full_model_flops, mon.device_num = kind != "sink", 2.0e12, 1
    monitor = TrainingStateMonitor(origin_epochs=1, config={"local_norm_format": "log"}, dataset_size=STEPS)
    cb = types.SimpleNamespace(dataset_sink_mode=kind == "sink")
    for i in range(STEPS):
        step = i + 1
        if kind in ("dense", "worker"):
            for name, norm in zip(NAMES, v["norms"][i], strict=True):
                monitor._output(f"local_norm/{name}", np.array(norm, np.float32), step, monitor.local_norm_format)
        lm = np.float32(v["lm"][i])
        total = np.float32(lm + v["aux"][i] + v["mtp"][i]) if moe else lm
        mon.loss_list.append(float(total))
        mon.learning_rate = None if kind == "no_lr" else np.array(v["lr"][i], np.float32)  # as array2string
        mon.print_output_info(
            cb, 1, 1, 100.0, step, STEPS, total, float(v["ms"][i]), False,
            "unavailable" if kind == "no_lr" else 1.0, 10, 100.0 * step / STEPS, np.array([v["gnorm"][i]], np.float32),
            np.array([lm], np.float32), np.array([v["aux"][i]], np.float32), np.array([v["mtp"][i]], np.float32),
            np.array([0.0], np.float32))


def old_lines(kind: str, seed: int) -> str:
    v = values(seed)
    out = []
    for i in range(STEPS):
        if kind == "v1_sink":
            msg = V1_SINK % (1, 1, i + 1, STEPS, v["lm"][i], v["ms"][i], str(np.float32(v["lr"][i])), False, 1.0)
            where = "[mindformers/core/callback/callback.py:313] print_output_info"
        else:
            msg = V0 % (1, 1, i + 1, STEPS, v["lm"][i], float(np.mean(v["lm"][: i + 1])), v["ms"][i] + 0.123,
                        str(np.float32(v["lr"][i])), False, 1.0)
            where = "[mindformers/core/callback/callback.py:271] print_output_info"
        out.append(f"[INFO] 2023-07-01 10:00:{i:02d},000 {where}: {msg}")
    return "\n".join(out) + "\n"


def main() -> None:
    HERE.mkdir(exist_ok=True)
    seeds = {"dense": 1, "moe_mtp": 2, "sink": 3, "no_lr": 4, "v1_sink": 5, "v0": 6}
    expected = {k: values(s) for k, s in seeds.items()}
    env = dict(os.environ, LOCAL_DEFAULT_PATH=tempfile.mkdtemp())
    for kind, seed in seeds.items():
        if kind.startswith("v"):
            (HERE / f"{kind}.log").write_text(old_lines(kind, seed))
            continue
        text = subprocess.run([sys.executable, __file__, "--child", kind, str(seed)], env=env, check=True,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True).stdout
        (HERE / f"{kind}.log").write_text(text)
    workers = HERE / "msrun_log"
    workers.mkdir(exist_ok=True)
    for rank, seed in ((0, 7), (1, 8)):
        expected[f"worker_{rank}"] = values(seed)
        text = subprocess.run([sys.executable, __file__, "--child", "worker", str(seed)], env=env, check=True,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True).stdout
        (workers / f"worker_{rank}.log").write_text(text)
    expected["names"] = NAMES
    (HERE / "expected.json").write_text(json.dumps(expected, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]))
    else:
        main()
