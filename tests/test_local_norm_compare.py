"""Local-norm comparator on real Megatron-core gradients: TP=2 vs TP=1, and Megatron vs MindFormers names."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from comparators.local_norms import compare_local_norms
from models import load_mapping
from runstore import RunWriter

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "helpers" / "megatron_local_norm_worker.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """One torchrun launch (2 processes): TP=2 run, TP=1 (DP=2) run, MindFormers-named copy of TP=1."""
    pytest.importorskip("megatron.core")
    out = tmp_path_factory.mktemp("local_norms")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(WORKER), str(out)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_tp2_against_tp1_compares_cleanly(runs: Path) -> None:
    res = compare_local_norms(runs / "tp1", runs / "tp2", load_mapping())
    assert res.verdict == "pass", [f.message for f in res.findings]
    assert res.details["compared"] == 15 and res.details["baseline"]["tp"] == 1
    assert res.details["candidate"]["tp"] == 2 and res.details["candidate"]["ranks"] == [0, 1]
    assert res.details["worst"][0]["rel_diff"] < 1e-5
    # TP shards really were partial on the TP=2 side: a shard's norm is below the full norm
    kinds = {k["kind"] for k in res.details["per_kind"]}
    assert kinds == {"embedding", "attention", "mlp", "norm"}


def test_naive_shard_sum_would_not_match(runs: Path, tmp_path: Path) -> None:
    """Guard on the test itself: treating TP=2 shards as duplicated (rank 0 only) must fail."""
    from runstore import RunReader

    r = RunReader(runs / "tp2")
    t = r.step_arrays(1, 0).table("local_norm")
    with RunWriter(tmp_path / "bad", rank=0, meta={}) as w:
        w.put_table(1, "local_norm", {"name": np.array(list(t["name"]), dtype=str),
                                      "norm": t["norm"].to_numpy(), "numel": t["numel"].to_numpy() * 0,
                                      "tp_partition_dim": np.full(len(t), -1),
                                      "tp_rank": np.zeros(len(t), int), "tp_size": np.ones(len(t), int)})
    res = compare_local_norms(runs / "tp1", tmp_path / "bad", load_mapping())
    assert res.verdict == "fail"
    failing = {f.component for f in res.findings if f.verdict == "fail"}
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in failing
    assert "decoder.layers.0.input_layernorm.weight" not in failing   # duplicated params are the same


def test_mindformers_names_fused_parts_and_worst_named_by_baseline(runs: Path) -> None:
    res = compare_local_norms(runs / "tp2", runs / "mf", load_mapping())
    assert res.verdict == "fail"
    bad = [f for f in res.findings if f.verdict != "pass"]
    assert [f.component for f in bad] == ["decoder.layers.1.mlp.linear_fc2.weight"]
    assert bad[0].value == pytest.approx(0.01, rel=1e-3)
    worst = res.details["worst"]
    assert worst[0]["name"] == "decoder.layers.1.mlp.linear_fc2.weight"
    assert worst[0]["candidate"] == "model.layers.1.feed_forward.w2.weight"
    # fused parameters: qkv compared against sqrt(wq^2 + wk^2 + wv^2), within float noise
    qkv = next(r for r in res.details["parameters"]
               if r["name"].endswith("1.self_attention.linear_qkv.weight"))
    assert qkv["candidate"].count(",") == 2 and qkv["rel_diff"] < 1e-5
    per_layer = {r["layer"]: r for r in res.details["per_layer"]}
    assert per_layer[1]["rel_diff"] > 1e-4 > per_layer[0]["rel_diff"]


def test_unmapped_and_missing_reported_not_dropped(runs: Path, tmp_path: Path) -> None:
    from runstore import RunReader

    t = RunReader(runs / "mf").step_arrays(1, 0).table("local_norm")
    keep = t[t["name"] != "model.layers.0.attention.wk.weight"]
    names = list(keep["name"]) + ["model.layers.0.attention.q_norm.weight"]
    with RunWriter(tmp_path / "c", rank=0, meta={}) as w:
        w.put_table(1, "local_norm", {"name": np.array(names), "norm": np.r_[keep["norm"].to_numpy(), 1.0],
                                      "numel": np.r_[keep["numel"].to_numpy(), 8]})
    res = compare_local_norms(runs / "tp1", tmp_path / "c", load_mapping())
    msgs = {(f.metric, f.component) for f in res.findings if f.verdict == "warn"}
    assert ("unmapped", "model.layers.0.attention.q_norm.weight") in msgs
    assert ("missing_counterpart", "decoder.layers.0.self_attention.linear_qkv.weight") in msgs
