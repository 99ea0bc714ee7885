"""The dumpers on a real Megatron-core GPTModel (CPU, gloo): 1 process, and TP=2 / DP=2 under torchrun.

Two launches of tests/megatron_worker.py (several scenarios per process, to keep the suite short): one
process, and one torchrun of two processes running TP=2 then DP=2 (``--then``); the tests read the JSON
results and the run stores they wrote.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from runstore import SEED_BATCH_KEYS, RunReader

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from dumpers.megatron import recombine_local_norms, strip_module_prefix  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "megatron_worker.py"
NAN_PARAM = "decoder.layers.1.mlp.linear_fc2.weight"
NAN_MODULE = "decoder.layers.0.mlp.linear_fc1"


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run(out: Path, scenarios: str, nproc: int = 1, tp: int = 1, extra: tuple[str, ...] = ()) -> dict:
    args = [str(WORKER), "--out", str(out), "--tp", str(tp), "--scenarios", scenarios, *extra]
    if nproc == 1:
        cmd = [sys.executable, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--standalone", *args]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=360)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {r: json.loads((out / f"result_rank{r}.json").read_text()) for r in range(nproc)}


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("single")
    return out, _run(out, "identical,nan_grad,nan_act,unwritable,attach")[0]


@pytest.fixture(scope="module")
def two_procs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict]]:
    """One torchrun launch of two processes: TP=2 (identical, nan_grad on rank 1), then Megatron's parallel
    state re-initialised at TP=1, i.e. DP=2 (identical), each layout into its own folder."""
    tp2, dp2 = tmp_path_factory.mktemp("tp2"), tmp_path_factory.mktemp("dp2")
    got = _run(tp2, "identical,nan_grad", nproc=2, tp=2, extra=("--nan-rank", "1", "--then", "1", str(dp2),
                                                                 "identical"))
    return {"tp2": (tp2, got), "dp2": (dp2, {r: json.loads((dp2 / f"result_rank{r}.json").read_text())
                                            for r in (0, 1)})}


@pytest.fixture(scope="module")
def tp2(two_procs: dict[str, tuple[Path, dict]]) -> tuple[Path, dict]:
    return two_procs["tp2"]


@pytest.fixture(scope="module")
def dp2(two_procs: dict[str, tuple[Path, dict]]) -> tuple[Path, dict]:
    return two_procs["dp2"]


def _assert_identical(result: dict) -> None:
    for key in ("identical.torch_opt", "identical.megatron_opt"):
        base, dumped = result[key]["base"], result[key]["dumped"]
        assert dumped["errors"] == 0, dumped["error_log"]
        assert base["losses"] == dumped["losses"]  # exact float equality: bit-identical
        assert base["grad_norms"] == dumped["grad_norms"]
        assert base["digest"] == dumped["digest"]  # sha256 of every parameter's bytes after 3 steps
        assert len(base["digest"]) >= 15


# -- one process ------------------------------------------------------------------------------------------

def test_single_bit_identical_with_all_features(single: tuple[Path, dict]) -> None:
    _assert_identical(single[1])


def test_single_run_store_contents(single: tuple[Path, dict]) -> None:
    out, _ = single
    r = RunReader(out / "identical" / "megatron_opt")
    assert r.meta["framework"] == "megatron-core" and r.meta["name_scheme"] == "megatron-core-local"
    assert r.meta["parallel"] == {"tp": 1, "pp": 1, "dp": 1, "ep": 1, "cp": 1, "sequence_parallel": False,
                                  "world_size": 1}
    assert r.meta["determinism"]["enabled"] is True and r.meta["seed"]["torch"] == 1234
    assert r.array_steps() == [1, 2, 3] and not r.incomplete
    sc = r.scalars()
    assert list(sc["step"]) == [1, 2, 3]
    a = r.step_arrays(1)
    tokens, mask = a.data["batch/tokens"], a.data["batch/loss_mask"]
    assert sc.loc[0, "loss_mask_sum"] == mask.sum() and sc.loc[0, "token_min"] == tokens.min()
    assert sc.loc[0, "token_max"] == tokens.max() and sc.loc[0, "nonfinite_grads"] == 0
    assert set(a.data) >= {f"batch/{k}" for k in (*SEED_BATCH_KEYS, "position_ids")}
    np.testing.assert_array_equal(a.data["batch/labels"][:, :-1], tokens[:, 1:])  # shifted
    # local norms: names without the DDP "module." prefix, in named_parameters order
    ln = a.table("local_norm")
    assert ln["name"].iloc[0] == "embedding.word_embeddings.weight"
    assert not any(n.startswith("module.") for n in ln["name"])
    dup = ln[ln["name"].str.endswith("layernorm.weight")]
    assert (dup["tp_partition_dim"] == -1).all()
    assert ln.set_index("name").loc["decoder.layers.0.self_attention.linear_proj.weight", "tp_partition_dim"] == 1
    # tensors in execution order: forward of layer 0 before layer 1, backward of layer 1 before layer 0
    ts = a.table("tensor_stats")
    assert list(ts["order"]) == list(range(len(ts)))
    first = {(m, k.split(".")[0]): i for i, m, k in zip(ts["order"][::-1], ts["module"][::-1], ts["kind"][::-1],
                                                        strict=True)}
    assert first[("decoder.layers.0", "forward")] < first[("decoder.layers.1", "forward")]
    assert first[("decoder.layers.1", "backward")] < first[("decoder.layers.0", "backward")]
    assert first[("decoder.layers.1", "forward")] < first[("decoder.layers.1", "backward")]
    # full tensors match their statistics
    row = ts[(ts["module"] == "decoder.layers.0.mlp.linear_fc2") & (ts["kind"] == "forward.output.0")].iloc[0]
    full = a.data[f"tensors/{int(row['order']):06d}"]
    # every row has its tensor under tensors/<order> (its module/kind/dtype are the row's: no attributes)
    assert all(a.data[f"tensors/{int(o):06d}"].size == n for o, n in zip(ts["order"], ts["numel"], strict=True))
    np.testing.assert_allclose([full.max(), full.min(), full.mean(), np.linalg.norm(full)],
                               [row["max"], row["min"], row["mean"], row["norm"]], rtol=1e-5, atol=1e-7)
    assert row["shape"] == "x".join(map(str, full.shape)) and row["dtype"] == "float32"


def test_single_recombined_norm_equals_optimizer_norm(single: tuple[Path, dict]) -> None:
    out, result = single
    r = RunReader(out / "identical" / "megatron_opt")
    norms = result["identical.megatron_opt"]["dumped"]["grad_norms"]
    for step in (1, 2, 3):
        a = r.step_arrays(step)
        attrs = a.attrs["local_norm"]
        assert attrs["where"] == "megatron.core.optimizer.optimizer.get_grad_norm_fp32"
        assert attrs["global_norm"] == norms[step - 1]
        assert recombine_local_norms([a.table("local_norm")]) == pytest.approx(norms[step - 1], rel=1e-6)


def test_single_seed_layout_exact(single: tuple[Path, dict]) -> None:
    out, _ = single
    root = out / "identical" / "megatron_opt"
    found = sorted(str(p.relative_to(root)) for p in root.glob("step_*/**/*") if p.is_file())
    assert found == [f"step_{s}/rank_0/{k}.npy" for s in (1, 2, 3) for k in sorted(SEED_BATCH_KEYS)]
    r = RunReader(root)
    for k in SEED_BATCH_KEYS:
        np.testing.assert_array_equal(np.load(root / "step_2" / "rank_0" / f"{k}.npy", allow_pickle=False),
                                      r.step_arrays(2).data[f"batch/{k}"])


def test_single_nan_in_param_grad(single: tuple[Path, dict]) -> None:
    out, result = single
    r = RunReader(out / "nan_grad")
    assert r.step_arrays(1).table("nan_trace") is None
    t = r.step_arrays(2).table("nan_trace")
    first = t.iloc[0]
    assert (first["kind"], first["name"], first["module"]) == ("grad", NAN_PARAM, NAN_PARAM.rsplit(".", 1)[0])
    assert (first["tp_rank"], first["pp_rank"], first["dp_rank"]) == (0, 0, 0)
    assert "1 parameter(s) non-finite" in first["detail"]
    sc = r.scalars().set_index("step")
    assert sc.loc[1, "nonfinite_grads"] == 0 and sc.loc[2, "nonfinite_grads"] == 1
    assert result["nan_grad"]["errors"] == 0 and len(result["nan_grad"]["losses"]) == 3  # training went on


def test_single_nan_in_module_output(single: tuple[Path, dict]) -> None:
    out, _ = single
    a = RunReader(out / "nan_act").step_arrays(2)
    t = a.table("nan_trace")
    assert (t.iloc[0]["kind"], t.iloc[0]["module"]) == ("activation", NAN_MODULE)
    assert "forward.output.0" in t.iloc[0]["detail"]
    kept = {(v["module"], v["kind"]): k for k, v in a.attrs.items() if k.startswith("nan_trace_tensors/")}
    assert np.isnan(a.data[kept[(NAN_MODULE, "forward.output.0")]]).sum() == 1
    assert np.isfinite(a.data[kept[(NAN_MODULE, "forward.input.0")]]).all()  # its input was clean


def test_single_unwritable_output_warns_counts_and_training_continues(single: tuple[Path, dict]) -> None:
    out, result = single
    base, dumped = result["unwritable"]["base"], result["unwritable"]["dumped"]
    assert dumped["errors"] > 0 and dumped["warnings"]
    assert "training continues" in dumped["warnings"][0]
    assert base["losses"] == dumped["losses"] and base["digest"] == dumped["digest"]
    r = RunReader(out / "unwritable")
    assert list(r.scalars()["step"]) == [1, 2, 3]  # the scalar file stayed open and kept logging


def test_single_pretrain_style_attach_and_step_boundaries(single: tuple[Path, dict]) -> None:
    out, result = single
    res = result["attach"]
    r = RunReader(out / "attach")
    assert res["errors"] == 0 and r.array_steps() == [1, 2, 3] and not r.incomplete
    for step in (1, 2, 3):
        attrs = r.step_arrays(step).attrs["local_norm"]
        assert attrs["global_norm_source"] == "optimizer" and attrs["global_norm"] == res["grad_norms"][step - 1]


def test_sigkill_mid_dump_leaves_completed_steps_readable(tmp_path: Path) -> None:
    cmd = [sys.executable, str(WORKER), "--out", str(tmp_path), "--scenarios", "pause"]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        deadline = time.time() + 120
        line = ""
        while time.time() < deadline:
            line = proc.stdout.readline()
            if "PAUSED" in line or not line:
                break
        assert "PAUSED" in line
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    r = RunReader(tmp_path / "pause")
    assert r.array_steps() == [1, 2]
    for step in (1, 2):
        a = r.step_arrays(step)
        assert len(a.table("local_norm")) == 15 and "batch/tokens" in a.data and len(a.table("tensor_stats"))
    assert [(i.step, i.rank) for i in r.incomplete] == [(3, 0)]
    assert list(r.scalars()["step"]) == [1, 2]


# -- two processes --------------------------------------------------------------------------------------------

def test_tp2_bit_identical_and_rank_files(tp2: tuple[Path, dict]) -> None:
    out, results = tp2
    for rank in (0, 1):
        _assert_identical(results[rank])
        assert results[rank]["info"]["tp_rank"] == rank and results[rank]["info"]["tp"] == 2
    r = RunReader(out / "identical" / "megatron_opt")
    assert r.meta["parallel"]["tp"] == 2 and r.ranks == [0, 1]
    assert [r.rank_info(k)["tp_rank"] for k in (0, 1)] == [0, 1]
    assert all(r.array_ranks(s) == [0, 1] for s in (1, 2, 3))
    assert sorted(p.name for p in (out / "identical" / "megatron_opt" / "step_1").iterdir()) == ["rank_0",
                                                                                                "rank_1"]


def test_tp2_recombined_local_norms_equal_optimizer_norm(tp2: tuple[Path, dict]) -> None:
    out, results = tp2
    r = RunReader(out / "identical" / "megatron_opt")
    norms = results[0]["identical.megatron_opt"]["dumped"]["grad_norms"]
    for step in (1, 2, 3):
        tables = [r.step_arrays(step, k).table("local_norm") for k in (0, 1)]
        assert list(tables[0]["name"]) == list(tables[1]["name"])
        qkv = tables[1].set_index("name").loc["decoder.layers.0.self_attention.linear_qkv.weight"]
        assert (qkv["tp_partition_dim"], qkv["tp_rank"], qkv["tp_size"]) == (0, 1, 2)
        assert recombine_local_norms(tables) == pytest.approx(norms[step - 1], rel=1e-6)
        # Naively summing every row of both ranks double-counts the duplicated norm weights.
        naive = sum(float((t["norm"] ** 2).sum()) for t in tables) ** 0.5
        assert naive > norms[step - 1] * (1 + 1e-6)


def test_tp2_nan_reported_on_the_right_rank(tp2: tuple[Path, dict]) -> None:
    out, _ = tp2
    r = RunReader(out / "nan_grad")
    assert r.step_arrays(2, 0).table("nan_trace") is None  # rank 0's shard stayed finite
    t = r.step_arrays(2, 1).table("nan_trace")
    assert (t.iloc[0]["name"], t.iloc[0]["tp_rank"], t.iloc[0]["dp_rank"]) == (NAN_PARAM, 1, 0)
    assert t.iloc[0]["module"] == "decoder.layers.1.mlp.linear_fc2"


def test_dp2_bit_identical_and_per_rank_batches(dp2: tuple[Path, dict]) -> None:
    out, results = dp2
    for rank in (0, 1):
        _assert_identical(results[rank])
        assert results[rank]["info"]["dp_rank"] == rank and results[rank]["info"]["dp"] == 2
    assert results[0]["identical.megatron_opt"]["dumped"]["digest"] == \
        results[1]["identical.megatron_opt"]["dumped"]["digest"]  # DP replicas stay in sync
    r = RunReader(out / "identical" / "megatron_opt")
    assert r.meta["parallel"] == {"tp": 1, "pp": 1, "dp": 2, "ep": 1, "cp": 1, "sequence_parallel": False,
                                  "world_size": 2}
    t0, t1 = (r.step_arrays(1, k).data["batch/tokens"] for k in (0, 1))
    assert not np.array_equal(t0, t1)  # each DP rank saw (and dumped) its own batch
    n0, n1 = (r.step_arrays(1, k).table("local_norm") for k in (0, 1))
    np.testing.assert_allclose(n0["norm"], n1["norm"], rtol=1e-6)  # after the DP all-reduce
    assert [r.rank_info(k)["dp_rank"] for k in (0, 1)] == [0, 1]


def test_strip_module_prefix() -> None:
    assert strip_module_prefix("module.module.decoder.final_layernorm.weight") == "decoder.final_layernorm.weight"
    assert strip_module_prefix("module") == ""
    assert strip_module_prefix("embedding.module.x") == "embedding.module.x"


def test_report_of_a_store_and_its_core_0_16_log_passes_step2(single: tuple[Path, dict], tmp_path: Path) -> None:
    """Issue 22: a run's store and the log Megatron-LM core >= 0.16 prints for that run (--log-interval 1: the
    line of iteration 2 is the mean of iterations 1 and 2, the arguments block tells the version):
    `align report STORE LOG` reads iteration 2's loss back and passes step2_loss, saying why."""
    from align.cli import main
    from runstore import open_store
    from tests.helpers.megatron_log_text import CORE_0_16_ARGS, megatron_log

    store = single[0] / "identical" / "megatron_opt"
    loss = open_store(store).series("loss")
    assert list(loss.index) == [1, 2, 3] and abs(loss[1] - loss[2]) > 1e-4
    args = {"log_interval": 1, "num_layers": 2, "tensor_model_parallel_size": 1, "train_iters": 3, **CORE_0_16_ARGS}
    log = tmp_path / "megatron.log"
    log.write_text(megatron_log(loss.tolist(), [1800.0, 40.0, 41.0], args))
    assert main(["report", "-q", str(store), str(log), "--out", str(tmp_path / "r")]) in (0, 1)
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    step2 = [f for f in summary["findings"] if f["stage"] == "step2_loss"]
    assert summary["stages"]["step2_loss"]["verdict"] == "pass" and summary["stages"]["step1_loss"]["verdict"] == "pass"
    assert step2[0]["value"] < 1e-6, step2[0]["message"]        # the printed mean is ~|L1 - L2| / 2 away
    assert "mean over iterations 1-2" in step2[0]["message"] and "save_wgrads_interval" in step2[0]["message"]
