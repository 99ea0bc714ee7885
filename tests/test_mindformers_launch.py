"""MindFormers launched as users launch it: msrun + run_mindformer.py --config X.yaml --register_path DIR.

The YAML names every class (MegatronReplayDataset, MindFormersDumperCallback, the CPU training cell) with
``auto_register: xf_align.<Class>`` (``--register_path`` the checkout's demo/mindformers_register, the checkout on
PYTHONPATH); nothing else runs in the training process (tests/helpers/run_mindformer.py does only
what MindFormers' run_mindformer.py does). GRAPH mode, the NPU mode, data parallel over two msrun workers;
``use_parallel: True`` so msrun's communication is initialised and each rank replays its own batches.
"""

from __future__ import annotations

import json
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
                dumper: dict | None = None, weights: Path | None = None, dp: int = 1,
                use_parallel: bool = True) -> Path:
    """The YAML a user writes (docs/mindformers-launch.md): the tiny CPU Llama, replay, dumper."""
    from demo.mindformers_cpu import trainer_config

    cfg = trainer_config(str(batches), steps=steps, output_dir=str(root / "output"), mode=mode)
    cfg["use_parallel"] = use_parallel
    cfg["parallel_config"]["data_parallel"] = dp
    cfg["parallel"]["gradients_mean"] = True
    cfg["train_dataset_task"]["dataset_config"]["steps"] = list(range(1, steps + 1))   # replay steps 1..N
    if weights is not None:       # the same start on every launch (a converted Megatron checkpoint in practice)
        cfg.update(load_checkpoint=str(weights), load_ckpt_format="ckpt")
    cfg["train_dataset_task"]["auto_register"] = "xf_align.MegatronReplayDataset"
    cfg["runner_wrapper"]["auto_register"] = "xf_align.CPUTrainOneStepCell"
    cfg["callbacks"] = [
        {"type": "MFLossMonitor"},
        {"type": "MindFormersDumperCallback", "auto_register": "xf_align.MindFormersDumperCallback",
         "out_dir": str(root / "run"), "batch_columns": ["input_ids", "labels", "loss_mask"], **(dumper or {})}]
    path = root / "train.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def msrun_launch(root: Path, config: Path, workers: int = 1) -> Path:
    """``msrun ... run_mindformer.py --config X.yaml --register_path DIR`` (``workers=0``: without msrun);
    returns msrun's log dir."""
    msrun = shutil.which("msrun", path=str(Path(sys.executable).parent))
    if msrun is None:
        pytest.skip("msrun (MindSpore's launcher) not installed")
    register = REPO / "demo" / "mindformers_register"     # the module the YAML names (xf_align.py)
    env = dict(os.environ, PYTHONPATH=str(REPO), OM_MODULES_CACHE=str(root / "modules"),
               LOCAL_DEFAULT_PATH=str(root / "output"),
               PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""),
               # MindFormers' CPU-affinity set-up divides by the NPU count (0 on CPU) unless msrun hands it
               # a CPU list; give it the CPUs this process may use.
               MSRUN_CPU_LIST=str(sorted(os.sched_getaffinity(0))))
    log_dir = root / "output" / "msrun_log"
    if workers == 0:    # no msrun: run_mindformer.py in this machine's plain python (use_parallel: False)
        proc = subprocess.run([sys.executable, str(REPO / "tests" / "helpers" / "run_mindformer.py"), "--config",
                               str(config), "--register_path", str(register)], env=env, cwd=root,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=280,
                              check=False)
        assert proc.returncode == 0, proc.stdout[-4000:]
        return log_dir
    proc = subprocess.run(
        [msrun, f"--worker_num={workers}", f"--local_worker_num={workers}", f"--master_port={_free_port()}",
         f"--log_dir={log_dir}", "--join=True", str(REPO / "tests" / "helpers" / "run_mindformer.py"),
         "--config", str(config), "--register_path", str(register)],
        env=env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=280,
        check=False)
    logs = sorted(log_dir.glob("worker_*.log"))
    assert proc.returncode == 0, "\n".join(w.read_text()[-3000:] for w in logs) or proc.stdout[-4000:]
    return log_dir


@pytest.fixture(scope="module")
def batches(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.test_mindformers_replay import write_megatron_batches

    root = tmp_path_factory.mktemp("batches")
    write_megatron_batches(root, [1, 2, 3], ranks=(0, 1))
    return root


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Fixed starting weights for every launch (a random init differs from process to process)."""
    import mindspore as ms

    from demo.mindformers_cpu import build_tiny_llama

    path = tmp_path_factory.mktemp("weights") / "tiny_llama.ckpt"
    ms.save_checkpoint(build_tiny_llama(seed=0), str(path))
    return path


GRAPH_CAPTURE = {"tensors": "stats", "cells": ["model.layers.*"], "tensor_steps": [1, 3]}


@pytest.fixture(scope="module")
def graph_run(tmp_path_factory: pytest.TempPathFactory, batches: Path, weights: Path) -> Path:
    """GRAPH mode (the NPU mode), data parallel over 2 msrun workers, 3 steps; the dumper also captures layer
    statistics of the decoder layers at steps 1 and 3 inside the compiled step (graph capture)."""
    root = tmp_path_factory.mktemp("graph")
    msrun_launch(root, launch_yaml(root, batches, steps=3, dumper=GRAPH_CAPTURE, weights=weights, dp=2),
                 workers=2)
    return root


@pytest.mark.timeout(300)
def test_msrun_run_mindformer_yaml_replays_batches_and_dumps_named_norms(graph_run: Path, batches: Path) -> None:
    from runstore import RunReader
    from sources import load_run

    reader = RunReader(graph_run / "run")
    assert reader.ranks == [0, 1] and reader.array_steps() == [1, 2, 3]
    assert reader.meta["layer_capture"]["mode"] == "GRAPH"    # captured inside the compiled step
    log = load_run(graph_run / "output" / "msrun_log")   # msrun's worker_0.log and worker_1.log, one run
    assert sorted(log.rank_scalars) == [0, 1]
    for rank in (0, 1):
        scalars = reader.scalars(rank).set_index("step")
        assert list(scalars.index) == [1, 2, 3]       # one record per step: msrun's scheduler did not train
        printed = log.rank_scalars[rank]
        for step in (1, 2, 3):
            arrays = reader.step_arrays(step, rank)
            # each rank replayed its own Megatron batch (rank from msrun's communication)
            for col, name in (("input_ids", "tokens"), ("labels", "labels"), ("loss_mask", "loss_mask")):
                np.testing.assert_array_equal(arrays.data[f"batch/{col}"],
                                              np.load(batches / f"step_{step}" / f"rank_{rank}" / f"{name}.npy"))
            if step in (1, 3):      # tensor_steps: the decoder layers' outputs and output gradients
                stats = arrays.table("tensor_stats")
                assert {"model.layers.0", "model.layers.1.attention", "model.layers.1.feed_forward"} <= set(
                    stats.module) and all(m.startswith("model.layers.") for m in stats.module)
                assert {"forward.output.0", "backward.grad_output.0"} <= set(stats.kind)
                assert np.isfinite(stats.norm.to_numpy()).all() and (stats.norm.to_numpy() > 0).any()
            else:
                assert arrays.table("tensor_stats") is None
            norms = arrays.table("local_norm")
            assert len(norms) == 21 and "model.tok_embeddings.embedding_weight" in set(norms.name)
            assert "model.layers.1.feed_forward.w2.weight" in set(norms.name)
            # the dumper's loss is what MFLossMonitor printed (%5.6f) in that rank's worker log
            assert scalars.loc[step, "loss"] == pytest.approx(printed["loss"][step], abs=5e-7)
            assert scalars.loc[step, "grad_norm"] == pytest.approx(printed["grad_norm"][step], rel=1e-6)
    # the run trained at the YAML's own lr (its lr_schedule block; without one MindFormers uses its default
    # cosine schedule from 5e-05 whatever optimizer.learning_rate says), in the step outputs and the worker logs
    lr = float(yaml.safe_load((graph_run / "train.yaml").read_text())["lr_schedule"]["learning_rate"])
    for rank in (0, 1):
        np.testing.assert_allclose(reader.scalars(rank).lr.to_numpy(), np.full(3, lr), rtol=1e-6)
        np.testing.assert_allclose([log.rank_scalars[rank]["lr"][s] for s in (1, 2, 3)], np.full(3, lr), rtol=1e-6)
    r0, r1 = (reader.scalars(r).set_index("step") for r in (0, 1))
    assert r0.loss[1] != r1.loss[1]                             # different batches per rank ...
    assert r0.grad_norm[1] == pytest.approx(r1.grad_norm[1], rel=1e-6)   # ... one all-reduced gradient
    # MindFormers' local_norm under data parallel is each rank's own gradient, before the all-reduce: the
    # ranks differ and neither recombines into the global norm (Megatron's named norms are reduced ones).
    n0, n1 = (reader.step_arrays(1, r).table("local_norm").norm.to_numpy() for r in (0, 1))
    assert not np.allclose(n0, n1, rtol=1e-3)
    assert float(np.sqrt(np.sum(n0 ** 2))) != pytest.approx(r0.grad_norm[1], rel=1e-3)


@pytest.mark.timeout(300)
def test_pynative_rerun_of_steps_1_2_captures_layers_and_matches_graph(graph_run: Path, batches: Path,
                                                                       weights: Path, tmp_path: Path) -> None:
    """The documented debug path: the same YAML with context.mode 1 captures layer statistics of steps 1-2.
    Launched on one worker here (rank 0's batches), so step 1 (forward and its loss) is the GRAPH run's rank 0;
    re-run with the GRAPH run's parallel layout to compare step 2 as well."""
    from runstore import RunReader

    config = launch_yaml(tmp_path, batches, steps=2, mode="pynative",
                         dumper={"tensors": "stats", "cells": ["model.layers.*"], "backward": False},
                         weights=weights, use_parallel=False)
    msrun_launch(tmp_path, config, workers=0)      # a plain single-process debug run, no msrun
    graph = RunReader(graph_run / "run").scalars(0).set_index("step")
    rerun = RunReader(tmp_path / "run")
    scalars = rerun.scalars(0).set_index("step")
    assert list(scalars.index) == [1, 2]
    assert scalars.loc[1, "loss"] == pytest.approx(graph.loc[1, "loss"], rel=1e-5)
    for step in (1, 2):
        norms = rerun.step_arrays(step).table("local_norm")    # one worker: local = global gradient
        total = float(np.sqrt(np.sum(norms.norm.to_numpy() ** 2)))
        assert len(norms) == 21 and total == pytest.approx(scalars.loc[step, "grad_norm"], rel=1e-5)
        stats = rerun.step_arrays(step).table("tensor_stats")
        modules = set(stats.module)
        assert "model.layers.0.attention" in modules and "model.layers.1.feed_forward" in modules
        assert np.isfinite(stats.norm.to_numpy()).all()


@pytest.mark.timeout(300)
def test_graph_capture_leaves_the_losses_bit_identical(graph_run: Path, batches: Path, weights: Path,
                                                       tmp_path: Path) -> None:
    """The same msrun launch with ``graph_capture: False``: layer tensors refused with the documented message,
    and every rank's loss and gradient norm equal, bit for bit, the captured run's."""
    from runstore import RunReader

    msrun_launch(tmp_path, launch_yaml(tmp_path, batches, steps=3, weights=weights, dp=2,
                                       dumper={**GRAPH_CAPTURE, "graph_capture": False}), workers=2)
    plain = RunReader(tmp_path / "run")
    assert "PYNATIVE" in plain.meta["layer_capture"]          # refused, said so, and the run went on
    captured = RunReader(graph_run / "run")
    for rank in (0, 1):
        a, b = (r.scalars(rank).set_index("step") for r in (captured, plain))
        np.testing.assert_array_equal(a.loss.to_numpy(), b.loss.to_numpy())
        np.testing.assert_array_equal(a.grad_norm.to_numpy(), b.grad_norm.to_numpy())
        assert plain.step_arrays(1, rank).table("tensor_stats") is None


def test_checklist_reads_a_replay_runs_global_batch_from_the_replayed_batches(batches: Path, tmp_path: Path) -> None:
    """Issue 22: the YAML the launch tests train with (batch_size 1, MegatronReplayDataset, data_parallel 2)
    replays 2 samples per rank and step: 4 per step, as Megatron trained; `align check-config` says so."""
    from align.checks.config import compare_configs
    from align.cli import main
    from sources.configs import read_mindformers

    path = launch_yaml(tmp_path, batches, steps=3, dp=2)
    megatron = {"global_batch_size": 4, "micro_batch_size": 2, "seq_length": 16, "data_parallel_size": 2}
    rows, res = compare_configs(megatron, read_mindformers(path))
    row = {r.key: r for r in rows}
    assert (row["global_batch_size"].mindformers, row["global_batch_size"].status) == (4, "match")
    assert "step_N/rank_R folders" in row["global_batch_size"].note
    assert row["micro_batch_size"].status == "match" and row["replay_seq_length"].status == "match"
    args = tmp_path / "megatron_args.json"
    args.write_text(json.dumps({**megatron, "global_batch_size": 8}))     # Megatron trained 8 per step
    out = tmp_path / "check.json"
    assert main(["check-config", str(args), str(path), "--json", str(out)]) == 1
    failed = {f["component"]: f for f in json.loads(out.read_text())["findings"] if f["verdict"] == "fail"}
    assert "Megatron 8 vs MindFormers 4" in failed["global_batch_size"]["message"]
    assert "micro_batch_size" not in failed and "replay_seq_length" not in failed
