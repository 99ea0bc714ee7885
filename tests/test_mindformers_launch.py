"""MindFormers launched as users launch it: msrun + run_mindformer.py --config X.yaml --register_path DIR.

The YAML names every class (MegatronReplayDataset, MindFormersDumperCallback, the CPU training cell) with
``auto_register``; nothing else runs in the training process (tests/helpers/run_mindformer.py does only
what MindFormers' run_mindformer.py does). GRAPH mode, the NPU mode; ``use_parallel: True`` so msrun's
communication is initialised and the ranks come from MindSpore's get_rank().
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
pytest.importorskip("mindformers")


def launch_yaml(root: Path, batches: Path, steps: int, mode: str = "graph",
                dumper: dict | None = None, weights: Path | None = None) -> Path:
    """The YAML a user writes (docs/mindformers-launch.md): the tiny CPU Llama, replay, dumper."""
    from demo.mindformers_cpu import trainer_config

    cfg = trainer_config(str(batches), steps=steps, output_dir=str(root / "output"), mode=mode)
    cfg["use_parallel"] = True
    cfg["train_dataset_task"]["dataset_config"]["steps"] = list(range(1, steps + 1))   # replay steps 1..N
    if weights is not None:       # the same start on every launch (a converted Megatron checkpoint in practice)
        cfg.update(load_checkpoint=str(weights), load_ckpt_format="ckpt")
    cfg["train_dataset_task"]["auto_register"] = "mindformers_replay.MegatronReplayDataset"
    cfg["runner_wrapper"]["auto_register"] = "mindformers_cpu.CPUTrainOneStepCell"
    cfg["callbacks"] = [
        {"type": "MFLossMonitor"},
        {"type": "MindFormersDumperCallback", "auto_register": "mindformers.MindFormersDumperCallback",
         "out_dir": str(root / "run"), "batch_columns": ["input_ids", "labels", "loss_mask"], **(dumper or {})}]
    path = root / "train.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def msrun_launch(root: Path, config: Path) -> Path:
    """``msrun ... run_mindformer.py --config X.yaml --register_path DIR``; returns msrun's log dir."""
    msrun = shutil.which("msrun", path=str(Path(sys.executable).parent))
    if msrun is None:
        pytest.skip("msrun (MindSpore's launcher) not installed")
    register = root / "register"     # the user's register_path: the module files the YAML names
    register.mkdir(exist_ok=True)
    for src in ("dumpers/mindformers_replay.py", "dumpers/mindformers.py", "demo/mindformers_cpu.py"):
        shutil.copy(REPO / src, register / Path(src).name)
    env = dict(os.environ, PYTHONPATH=str(REPO), OM_MODULES_CACHE=str(root / "modules"),
               LOCAL_DEFAULT_PATH=str(root / "output"),
               PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""),
               # MindFormers' CPU-affinity set-up divides by the NPU count (0 on CPU) unless msrun hands it
               # a CPU list; give it the CPUs this process may use.
               MSRUN_CPU_LIST=str(sorted(os.sched_getaffinity(0))))
    log_dir = root / "output" / "msrun_log"
    proc = subprocess.run(
        [msrun, "--worker_num=1", "--local_worker_num=1", f"--master_port={_free_port()}",
         f"--log_dir={log_dir}", "--join=True", str(REPO / "tests" / "helpers" / "run_mindformer.py"),
         "--config", str(config), "--register_path", str(register)],
        env=env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=280,
        check=False)
    worker = log_dir / "worker_0.log"
    assert proc.returncode == 0, (worker.read_text()[-4000:] if worker.exists() else proc.stdout[-4000:])
    return log_dir


@pytest.fixture(scope="module")
def batches(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.test_mindformers_replay import write_megatron_batches

    root = tmp_path_factory.mktemp("batches")
    write_megatron_batches(root, [1, 2, 3])
    return root


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Fixed starting weights for every launch (a random init differs from process to process)."""
    import mindspore as ms

    from demo.mindformers_cpu import build_tiny_llama

    path = tmp_path_factory.mktemp("weights") / "tiny_llama.ckpt"
    ms.save_checkpoint(build_tiny_llama(seed=0), str(path))
    return path


@pytest.fixture(scope="module")
def graph_run(tmp_path_factory: pytest.TempPathFactory, batches: Path, weights: Path) -> Path:
    """GRAPH mode (the NPU mode), 3 steps; the dumper also asks for layer statistics, which GRAPH refuses."""
    root = tmp_path_factory.mktemp("graph")
    msrun_launch(root, launch_yaml(root, batches, steps=3, dumper={"tensors": "stats"}, weights=weights))
    return root


@pytest.mark.timeout(300)
def test_msrun_run_mindformer_yaml_replays_batches_and_dumps_named_norms(graph_run: Path, batches: Path) -> None:
    from align.core.runstore import RunReader
    from align.sources import load_run

    reader = RunReader(graph_run / "run")
    assert reader.ranks == [0] and reader.array_steps() == [1, 2, 3]
    assert "PYNATIVE" in reader.meta["layer_capture"]         # refused, said so, and the run went on
    scalars = reader.scalars(0).set_index("step")
    assert list(scalars.index) == [1, 2, 3]           # one record per step: msrun's scheduler did not train
    log = load_run(graph_run / "output" / "msrun_log")   # the msrun worker log, as MindFormers printed it
    for step in (1, 2, 3):
        arrays = reader.step_arrays(step)
        for col, name in (("input_ids", "tokens"), ("labels", "labels"), ("loss_mask", "loss_mask")):
            np.testing.assert_array_equal(arrays.data[f"batch/{col}"],
                                          np.load(batches / f"step_{step}" / "rank_0" / f"{name}.npy"))
        norms = arrays.table("local_norm")
        assert len(norms) == 21 and "model.tok_embeddings.embedding_weight" in set(norms.name)
        assert "model.layers.1.feed_forward.w2.weight" in set(norms.name)
        total = float(np.sqrt(np.sum(norms.norm.to_numpy() ** 2)))
        assert total == pytest.approx(scalars.loc[step, "grad_norm"], rel=1e-5)
        # the dumper's loss is what MFLossMonitor printed (%5.6f) in the worker log
        assert scalars.loc[step, "loss"] == pytest.approx(log.series("loss")[step], abs=5e-7)
        assert scalars.loc[step, "grad_norm"] == pytest.approx(log.series("grad_norm")[step], rel=1e-6)


@pytest.mark.timeout(300)
def test_pynative_rerun_of_steps_1_2_captures_layers_and_matches_graph(graph_run: Path, batches: Path,
                                                                       weights: Path, tmp_path: Path) -> None:
    """The documented debug path: the same YAML with context.mode 1 and stop_step 2 captures layer
    statistics; its losses and norms are the GRAPH run's."""
    from align.core.runstore import RunReader

    config = launch_yaml(tmp_path, batches, steps=2, mode="pynative",
                         dumper={"tensors": "stats", "cells": ["model.layers.*"], "backward": False},
                         weights=weights)
    msrun_launch(tmp_path, config)
    graph = RunReader(graph_run / "run").scalars(0).set_index("step")
    rerun = RunReader(tmp_path / "run")
    scalars = rerun.scalars(0).set_index("step")
    assert list(scalars.index) == [1, 2]
    for step in (1, 2):
        assert scalars.loc[step, "loss"] == pytest.approx(graph.loc[step, "loss"], rel=1e-5)
        assert scalars.loc[step, "grad_norm"] == pytest.approx(graph.loc[step, "grad_norm"], rel=1e-4)
        stats = rerun.step_arrays(step).table("tensor_stats")
        modules = set(stats.module)
        assert "model.layers.0.attention" in modules and "model.layers.1.feed_forward" in modules
        assert np.isfinite(stats.norm.to_numpy()).all()
