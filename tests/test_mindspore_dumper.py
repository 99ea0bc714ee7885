"""MindSporeDumper on MindFormers' real LlamaForCausalLM (tiny, CPU, PYNATIVE in this process)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

mc = pytest.importorskip("demo.mindformers_cpu")

import mindspore as ms  # noqa: E402

from dumpers.mindspore_dumper import DumpConfig, MindSporeDumper, NonFiniteError  # noqa: E402
from dumpers.seed_mindspore import record, seed_everything  # noqa: E402
from runstore import RunReader  # noqa: E402

B, S, V = 2, 16, 64


def make_batches(n: int, seed: int = 3) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        seq = rng.integers(1, V, size=(B, S + 1)).astype(np.int32)
        mask = np.ones((B, S), np.float32)
        mask[1, -3:] = 0.0
        out.append({"input_ids": seq[:, :-1], "labels": seq[:, 1:], "loss_mask": mask})
    return out


@pytest.fixture(scope="module")
def batches() -> list[dict[str, np.ndarray]]:
    mc.set_cpu_context("pynative")
    return make_batches(2)


def train(batches: list[dict[str, np.ndarray]], dumper_dir: Path | None) -> tuple[list[float], dict]:
    """Two MindFormers CPU steps from seed 0, optionally with every cell hooked (full tensors, backward)."""
    net = mc.build_tiny_llama(seed=0)
    cell = mc.build_train_cell(net, learning_rate=1e-2)
    dumper = None
    if dumper_dir is not None:
        dumper = MindSporeDumper(net, dumper_dir, DumpConfig(tensors="full", cells=("*",), backward=True,
                                                             capture_env=True))
    losses = []
    for step, batch in enumerate(batches, 1):
        if dumper:
            dumper.begin_step(step)
            dumper.record_batch(batch)
        out = cell(*mc.llama_inputs(batch))
        losses.append(out[0].asnumpy().copy())
        if dumper:
            dumper.end_step(loss=out[0])
    if dumper:
        dumper.close()
    return losses, {p.name: p.asnumpy().copy() for p in net.trainable_params()}


def test_hooks_change_nothing_and_capture_in_execution_order(batches: list, tmp_path: Path) -> None:
    base_losses, base_params = train(batches, None)
    hooked_losses, hooked_params = train(batches, tmp_path / "run")
    for a, b in zip(base_losses, hooked_losses, strict=True):
        assert np.array_equal(a, b)  # bit-identical
    assert base_params.keys() == hooked_params.keys()
    for name in base_params:
        assert np.array_equal(base_params[name], hooked_params[name]), name
    # The parameters did move (the comparison is not between two untouched models).
    assert not np.array_equal(base_params["lm_head.weight"], mc.build_tiny_llama(seed=0).lm_head.weight.asnumpy())

    reader = RunReader(tmp_path / "run")
    # the cluster capture (taken when the dumper was built): MindSpore's settings, generators, initial weights
    env = reader.meta["environment"]
    assert env["framework"] == "mindspore" and env["captured"]["by"] == "MindSporeDumper"
    assert env["settings"]["mindspore"]["mode"] == "PYNATIVE" and env["settings"]["mindspore"]["deterministic"]
    assert env["random"]["mindspore"]["state"] and env["versions"]["mindspore"] == ms.__version__
    from dumpers.environment import fingerprint
    init = {p.name: p.asnumpy() for p in mc.build_tiny_llama(seed=0).trainable_params()}
    assert sorted(env["weights"]["params"]) == sorted(init)
    w = env["weights"]["params"]["model.layers.0.attention.wq.weight"]
    assert w == {**fingerprint(init["model.layers.0.attention.wq.weight"]), "dtype": "float32"}
    arrays = reader.step_arrays(2)
    stats = arrays.table("tensor_stats")
    assert list(stats.order) == list(range(len(stats)))
    fwd = stats[stats.kind.str.startswith("forward.")]
    bwd = stats[stats.kind.str.startswith("backward.grad_output")]
    assert len(fwd) and len(bwd) and fwd.order.max() < bwd.order.min()  # forward, then backward
    mods = list(fwd.module)
    assert mods.index("model.layers.0.attention.wq") < mods.index("model.layers.1.attention.wq") \
        < mods.index("lm_head")
    bmods = list(bwd.module)
    assert bmods.index("lm_head") < bmods.index("model.layers.1.attention.wq") \
        < bmods.index("model.layers.0.attention.wq")
    # Full tensors match their statistics; lm_head's output is the logits of the whole (unsliced) batch.
    (row,) = stats.index[(stats.module == "lm_head") & (stats.kind == "forward.output.0")]
    logits = arrays.data[f"tensors/{int(stats.order[row]):06d}"]
    assert logits.shape == (B, S, V)
    assert float(np.linalg.norm(logits.astype(np.float64))) == pytest.approx(stats.norm[row], rel=1e-6)
    assert stats["dtype"][row] == "float32" and stats["shape"][row] == f"{B}x{S}x{V}"
    assert reader.scalars(0).loss.tolist() == pytest.approx([float(x[0]) for x in hooked_losses])


def test_value_and_grad_loop_named_norms_and_nan_trace(batches: list, tmp_path: Path) -> None:
    seeds = seed_everything(5)
    net = mc.build_tiny_llama(seed=0)
    params = net.trainable_params()
    loss_cell = mc.LlamaReplayLoss(net)
    grad_fn = ms.value_and_grad(loss_cell, None, weights=params)
    dumper = MindSporeDumper(net, tmp_path / "run", DumpConfig(nan_trace="grads"), rank=3, tp=2, pp=1,
                             world_size=4)
    record(dumper.writer, seeds)

    # Step 1: clean gradients -> named norms in trainable_params order; sqrt(sum) = MindSpore's global norm.
    b = batches[0]
    loss, grads = grad_fn(ms.Tensor(b["input_ids"]), ms.Tensor(b["labels"]), ms.Tensor(b["loss_mask"]))
    gnorm_ms = float(ms.ops.sqrt(sum(ms.ops.reduce_sum(g * g) for g in grads)).asnumpy())
    with dumper.step(1, b):
        dumper.record_grads(grads)
        dumper.log(loss=loss)

    # Step 2: NaN injected into one parameter's gradient -> reported by name, cell and rank coordinates.
    target = "model.layers.1.attention.wv.weight"
    k = [p.name for p in params].index(target)
    poisoned = list(grads)
    g = poisoned[k].asnumpy().copy()
    g[3, 5] = np.nan
    poisoned[k] = ms.Tensor(g)
    dumper.begin_step(2)
    dumper.record_grads(poisoned)
    assert dumper.nan_trace[0]["name"] == target
    dumper.end_step(loss=loss)
    dumper.close()

    reader = RunReader(tmp_path / "run")
    t1 = reader.step_arrays(1, rank=3).table("local_norm")
    assert list(t1.name) == [p.name for p in params]
    assert float(np.sqrt((t1.norm ** 2).sum())) == pytest.approx(gnorm_ms, rel=1e-5)
    assert list(t1.numel) == [int(np.prod(p.shape)) for p in params]
    s2 = reader.step_arrays(2, rank=3)
    trace = s2.table("nan_trace")
    assert len(trace) == 1
    row = trace.iloc[0]
    assert (row["kind"], row["name"], row["module"]) == ("grad", target, "model.layers.1.attention.wv")
    assert (row["tp_rank"], row["pp_rank"], row["dp_rank"]) == (1, 0, 1)
    assert "1 nan" in row["detail"]
    assert np.isnan(s2.data["nan_trace_tensors/0"]).sum() == 1
    sc = reader.scalars(3).set_index("step")
    assert sc.loc[1, "nonfinite_grads"] == 0 and sc.loc[2, "nonfinite_grads"] == 1
    info = reader.rank_info(3)
    assert (info["tp_rank"], info["pp_rank"], info["dp_rank"], info["world_size"]) == (1, 0, 1, 4)
    assert "seed" not in reader.meta  # rank 3 leaves meta.json to rank 0
    rank0 = MindSporeDumper(None, tmp_path / "run", rank=0, tp=2, world_size=4)
    record(rank0.writer, seeds)
    rank0.close()
    meta = RunReader(tmp_path / "run").meta
    assert meta["seed"]["mindspore"] == 5 and meta["determinism"]["env"]["HCCL_DETERMINISTIC"] == "true"
    assert meta["parallel"] == {"tp": 2, "pp": 1, "dp": 2, "world_size": 4}

    # stop_on_nan: the trace is written first, then the run is stopped with the name in the message.
    stopper = MindSporeDumper(net, tmp_path / "stop", DumpConfig(stop_on_nan=True))
    stopper.begin_step(1)
    stopper.record_grads(poisoned)
    with pytest.raises(NonFiniteError, match=r"model\.layers\.1\.attention\.wv\.weight"):
        stopper.end_step()
    stopper.close()
    assert RunReader(tmp_path / "stop").step_arrays(1).table("nan_trace").name[0] == target


def test_shared_config_fields_seed_layout_ranks_background(batches: list, tmp_path: Path) -> None:
    """The one DumpConfig (dumpers/contract.py): ``out`` from the config, the seed layout, background writes;
    a rank outside ``ranks`` writes nothing and every call on it is a no-op."""
    from runstore import read_seed_batch

    cfg = DumpConfig(out=tmp_path / "run", seed_layout=True, background_writes=True)
    dumper = MindSporeDumper(None, config=cfg)
    for step, b in enumerate(batches, 1):
        with dumper.step(step, {"tokens": b["input_ids"], "labels": b["labels"], "loss_mask": b["loss_mask"]}):
            dumper.log(loss=1.0)
    dumper.close()
    assert dumper.enabled
    reader = RunReader(tmp_path / "run")
    assert reader.array_steps() == [1, 2] and not reader.incomplete
    seed = read_seed_batch(tmp_path / "run", 2, 0, ("tokens", "labels", "loss_mask"))
    np.testing.assert_array_equal(seed["tokens"], batches[1]["input_ids"])
    np.testing.assert_array_equal(reader.step_arrays(2).data["batch/loss_mask"], batches[1]["loss_mask"])

    other = MindSporeDumper(None, tmp_path / "other", DumpConfig(ranks=[0]), rank=1)
    assert not other.enabled and other.writer is None
    record(other.writer, {"seed": {"mindspore": 5}, "determinism": {}})
    other.update_meta({"x": 1})
    with other.step(1, {"tokens": batches[0]["input_ids"]}):
        other.log(loss=1.0)
    other.close()
    assert not (tmp_path / "other").exists()
    with pytest.raises(ValueError, match="out"):
        MindSporeDumper(None)


def test_dumper_failure_never_stops_training(batches: list, tmp_path: Path) -> None:
    """A dumper that cannot write (its run folder is replaced by a file) warns and steps aside."""
    net = mc.build_tiny_llama(seed=0)
    cell = mc.build_train_cell(net)
    dumper = MindSporeDumper(net, tmp_path / "run", DumpConfig(tensors="stats", cells=("lm_head",)))
    steps_dir = tmp_path / "run" / "steps"
    steps_dir.parent.mkdir(parents=True, exist_ok=True)
    steps_dir.write_text("not a directory")
    with pytest.warns(RuntimeWarning, match="MindSporeDumper disabled"):
        dumper.begin_step(1)
        out = cell(*mc.llama_inputs(batches[0]))
        dumper.end_step(loss=out[0])
    assert not dumper.enabled
    out2 = cell(*mc.llama_inputs(batches[1]))  # training goes on
    assert np.isfinite(out2[0].asnumpy()).all()
    dumper.close()


class _Experts(ms.nn.Cell):
    """A stacked-experts cell shaped as MindFormers' FFNGroupedGEMM: ``num_local_experts`` and [E*H, F]."""

    def __init__(self) -> None:
        super().__init__()
        self.num_local_experts = 3
        self.weight1 = ms.Parameter(ms.Tensor(np.random.default_rng(1).standard_normal((12, 5)), ms.float32),
                                    name="experts.weight1")
        self.bias = ms.Parameter(ms.Tensor(np.ones(3), ms.float32), name="experts.bias")

    def construct(self, x: ms.Tensor) -> ms.Tensor:
        return ((x @ self.weight1) ** 2).sum() * self.bias.sum()


def test_stacked_expert_norms_recorded_per_expert(tmp_path: Path) -> None:
    """record_grads splits a stacked expert Parameter's gradient by rows into NAME[e] rows (their squares add
    up to the whole); split_rows keeps the one row when the pieces do not add up (not written this step)."""
    from dumpers.mindspore_expert_norms import split_rows, stacked_experts

    mc.set_cpu_context("pynative")
    net = _Experts()
    x = ms.Tensor(np.random.default_rng(2).standard_normal((2, 12)), ms.float32)
    grads = ms.value_and_grad(net, None, net.trainable_params())(x)[1]
    assert stacked_experts(net) == {"experts.weight1": 3}
    dumper = MindSporeDumper(net, tmp_path / "run", DumpConfig())
    dumper.begin_step(1)
    dumper.record_grads(grads)
    dumper.end_step(loss=1.0)
    dumper.close()
    t = RunReader(tmp_path / "run").step_arrays(1).table("local_norm")
    norms = dict(zip(t["name"], t["norm"], strict=True))
    g = grads[0].asnumpy().astype(np.float64)
    want = {f"experts.weight1[{e}]": float(np.linalg.norm(g[4 * e:4 * (e + 1)])) for e in range(3)}
    assert sorted(norms) == sorted([*want, "experts.bias"]) and list(t["numel"][:3]) == [20, 20, 20]
    for k, v in want.items():
        assert norms[k] == pytest.approx(v, rel=1e-12)
    sq = {"w": np.array([1.0, 4.0])}
    assert split_rows(["w", "b"], [5 ** 0.5, 1.0], [8, 2], sq) == (["w[0]", "w[1]", "b"], [1.0, 2.0, 1.0], [4, 4, 2],
                                                                  [0, 0, 1])
    assert split_rows(["w"], [3.0], [8], sq)[0] == ["w"]              # 1 + 4 != 9: stale, kept whole
    assert split_rows(["w"], [5 ** 0.5], [8], {"w": np.array([np.nan, 4.0])})[0] == ["w"]
