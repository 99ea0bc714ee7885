"""GRAPH mode, in its own process (a MindSpore process keeps one compiled world; PYNATIVE tests run elsewhere).

Run as a script it trains MindFormers' tiny Llama in GRAPH mode on replayed Megatron batches and prints a
JSON result; the test below launches it and checks the result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.numpy_reference import numpy_masked_ce

REPO = Path(__file__).resolve().parents[1]


def worker(data: Path, out: Path) -> dict:
    """GRAPH mode: replay 3 steps through the registered dataset; the layer-capture refusal; NormTrainOneStepCell."""
    from demo import mindformers_cpu as mc

    mc.set_cpu_context("graph")
    from dumpers.mindformers import dump_mindformers_step
    from dumpers.mindformers_replay import MegatronReplayDataset
    from dumpers.mindspore_dumper import (
        DumpConfig,
        DumperCallback,
        LayerCaptureError,
        MindSporeDumper,
        NormTrainOneStepCell,
    )

    result: dict = {"steps": []}
    net = mc.build_tiny_llama(seed=0)
    cell = mc.build_train_cell(net)
    try:
        MindSporeDumper(net, out / "refused", DumpConfig(tensors="stats"))
        result["capture_error"] = None
    except LayerCaptureError as exc:
        result["capture_error"] = str(exc)
    dumper = MindSporeDumper(net, out / "run", framework="mindformers")
    ds = MegatronReplayDataset(data_dir=str(data))
    for step, row in enumerate(ds.create_dict_iterator(output_numpy=True, num_epochs=1), 1):
        net.set_train(False)  # logits with the very parameters the training step is about to use
        logits = net(*mc.llama_inputs({"input_ids": row["input_ids"]}))[0].asnumpy()
        net.set_train(True)
        out_step = cell(*mc.llama_inputs(row))
        named = dump_mindformers_step(dumper, step, out_step, cell.optimizer, batch=row)
        result["steps"].append({
            "loss": float(out_step[0].asnumpy().reshape(-1)[0]),
            "numpy_loss": numpy_masked_ce(logits, row["labels"], row["loss_mask"]),
            "logits_shape": list(logits.shape),
            "global_norm": float(out_step[4].asnumpy().reshape(-1)[0]),
            "norms_total": float(np.sqrt(sum(v * v for v in named.values()))),
            "names": list(named)})
    dumper.close()
    result["trainable"] = [p.name for p in net.trainable_params()]

    # A generic training cell + Model.train + DumperCallback, in GRAPH mode.
    import mindspore as ms

    net2 = mc.build_tiny_llama(seed=0)
    opt = ms.nn.AdamWeightDecay(net2.trainable_params(), learning_rate=1e-3)
    norm_cell = NormTrainOneStepCell(mc.LlamaReplayLoss(net2), opt)
    cb_dumper = MindSporeDumper(net2, out / "model_train")
    ms.train.Model(norm_cell).train(1, MegatronReplayDataset(data_dir=str(data)), dataset_sink_mode=False,
                                    callbacks=[DumperCallback(cb_dumper)])
    from runstore import RunReader

    reader = RunReader(out / "model_train")
    table = reader.step_arrays(2).table("local_norm")
    result["model_train"] = {"names": list(table.name), "steps": reader.array_steps(),
                             "losses": reader.scalars(0).loss.tolist()}
    return result


def write_batches(root: Path, steps: int = 3) -> None:
    rng = np.random.default_rng(11)
    for step in range(1, steps + 1):
        folder = root / f"step_{step}" / "rank_0"
        folder.mkdir(parents=True, exist_ok=True)
        seq = rng.integers(1, 64, size=(2, 17))
        mask = np.ones((2, 16), np.float32)
        mask[0, :3] = 0.0
        np.save(folder / "tokens.npy", seq[:, :-1].astype(np.int64), allow_pickle=False)
        np.save(folder / "labels.npy", seq[:, 1:].astype(np.int64), allow_pickle=False)
        np.save(folder / "loss_mask.npy", mask, allow_pickle=False)


@pytest.mark.timeout(300)
def test_graph_mode_replay_norms_and_capture_refusal(tmp_path: Path) -> None:
    pytest.importorskip("mindformers")
    write_batches(tmp_path / "batches")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, __file__, str(tmp_path / "batches"), str(tmp_path)], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=280,
                          check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:]
    res = json.loads(lines[-1][len("RESULT "):])

    assert "PYNATIVE" in res["capture_error"] and "GRAPH" in res["capture_error"]
    assert len(res["steps"]) == 3
    for step in res["steps"]:
        assert step["logits_shape"] == [2, 16, 64]  # no second shift
        assert step["loss"] == pytest.approx(step["numpy_loss"], rel=2e-6, abs=1e-6)
        assert step["names"] == res["trainable"]
        assert step["norms_total"] == pytest.approx(step["global_norm"], rel=1e-5)
    assert res["steps"][0]["loss"] != res["steps"][1]["loss"]
    mt = res["model_train"]
    assert mt["steps"] == [1, 2, 3] and mt["names"] == res["trainable"] and len(mt["losses"]) == 3


if __name__ == "__main__":
    print("RESULT " + json.dumps(worker(Path(sys.argv[1]), Path(sys.argv[2]))))
