"""Regenerate tests/data/mindformers_train*.log from a real MindFormers Trainer run on CPU.

Why: the MindFormers log importer must be tested on text MindFormers really prints (MFLossMonitor's step
lines, and with local_norm on the ``norm_size: (...)`` + ``local_norm:`` blocks), not on hand-written
imitations. This script trains MindFormers' real LlamaForCausalLM (tiny, CPU) through ``Trainer`` for a few
steps on seed-layout batches, captures what the process printed, and keeps the window from the callback
set-up to "Training Over" (genuine surrounding noise included, the long parameter listings dropped).

    .venv/bin/python tests/data/make_mindformers_logs.py            # both files, ~30 s
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RUNS = {"mindformers_train.log": 1.0e-3, "mindformers_train_lr2.log": 1.2e-3}
STEPS = 6
START_MARK = ".........Build Running Wrapper From Config For Train.........."
END_MARK = ".........Training Over!............."


def write_batches(root: Path, steps: int, seed: int = 1) -> None:
    """Megatron-style shifted batches in the seed layout (tokens[t] predicts labels[t])."""
    rng = np.random.default_rng(seed)
    for step in range(1, steps + 1):
        folder = root / f"step_{step}" / "rank_0"
        folder.mkdir(parents=True, exist_ok=True)
        seq = rng.integers(1, 64, size=(2, 17))
        mask = np.ones((2, 16), np.float32)
        mask[1, -4:] = 0.0
        np.save(folder / "tokens.npy", seq[:, :-1].astype(np.int64), allow_pickle=False)
        np.save(folder / "labels.npy", seq[:, 1:].astype(np.int64), allow_pickle=False)
        np.save(folder / "loss_mask.npy", mask, allow_pickle=False)


CHILD = """
import sys
sys.path.insert(0, {repo!r})
from demo import mindformers_cpu as mc
cfg = mc.trainer_config({data!r}, steps={steps}, output_dir={out!r}, learning_rate={lr!r}, warmup_steps=2)
mc.run_trainer(cfg)
"""


_ARRAY_LINE = re.compile(r"^\[?\s*[-+]?\d")  # numpy's print of the local_norm array


def keep_window(text: str) -> str:
    """The lines from the wrapper set-up to the end of training, minus the pretty-printed config dump."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if START_MARK in line)
    end = next(i for i, line in enumerate(lines) if END_MARK in line)
    kept = [line for line in lines[start:end + 1]
            if line[:2] == "20" or line.startswith("[") and not line.startswith("[{")
            or line.startswith("local_norm:") or _ARRAY_LINE.match(line)]
    return "\n".join(kept) + "\n"


def run(name: str, lr: float, work: Path) -> Path:
    data = work / "batches"
    if not data.exists():
        write_batches(data, STEPS)
    out = work / name.replace(".log", "")
    env = dict(os.environ, LOCAL_DEFAULT_PATH=str(out), PYTHONUNBUFFERED="1")
    code = CHILD.format(repo=str(REPO), data=str(data), steps=STEPS, out=str(out), lr=lr)
    proc = subprocess.run([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600, check=False)
    text = proc.stdout
    if proc.returncode != 0 or END_MARK not in text:
        sys.stderr.write(text[-4000:])
        raise SystemExit(f"{name}: MindFormers run failed (exit {proc.returncode})")
    target = HERE / name
    target.write_text(keep_window(text), encoding="utf-8")
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for name, lr in RUNS.items():
            print(run(name, lr, Path(tmp)))


if __name__ == "__main__":
    main()
