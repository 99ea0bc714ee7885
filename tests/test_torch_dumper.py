"""The generic torch dumper on a plain nn.Module + torch optimizer (in process, no Megatron)."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dumpers.seed_torch import seed_everything  # noqa: E402
from dumpers.torch_dumper import DumpConfig, NonFiniteError, TorchDumper, parse_steps, tensor_stats  # noqa: E402
from runstore import RunReader  # noqa: E402


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.fc1 = torch.nn.Linear(16, 32)
        self.act = torch.nn.GELU()
        self.fc2 = torch.nn.Linear(32, 50)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(self.emb(tokens))))


def batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 50, (4, 9), generator=g)
    mask = torch.ones(4, 8)
    mask[:, 0] = 0
    return {"tokens": ids[:, :-1], "labels": ids[:, 1:], "loss_mask": mask,
            "attention_mask": torch.ones(4, 8, dtype=torch.bool)}


def train(out: Path | None, n_steps: int = 3, clip: float = 1.0, **cfg: object) -> tuple[list[float], list, object]:
    seed_everything(7, deterministic=False)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    d = TorchDumper(net, opt, DumpConfig(out=out, **cfg)) if out is not None else None
    losses, norms = [], []
    for s in range(1, n_steps + 1):
        b = batch(s)
        with (d.step(s, b) if d is not None else _null()):
            opt.zero_grad()
            logits = net(b["tokens"])
            ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 50), b["labels"].reshape(-1),
                                                   reduction="none")
            loss = (ce * b["loss_mask"].reshape(-1)).sum() / b["loss_mask"].sum()
            loss.backward()
            if d is not None:
                d.record_grads()  # before clipping, as the optimizer's norm sees them
            norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), clip)))
            opt.step()
            if d is not None:
                d.log(loss=loss)
        losses.append(float(loss.detach()))
    if d is not None:
        d.close()
    return losses, [norms, [p.detach().clone() for p in net.parameters()]], d


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None


def test_bit_identical_and_contents(tmp_path: Path) -> None:
    base_losses, (base_norms, base_params), _ = train(None)
    (tmp_path / "data.bin").write_bytes(b"tokens" * 1000)
    losses, (norms, params), d = train(tmp_path / "run", tensors="full", nan_trace="all", seed_layout=True,
                                       capture_env=True, capture_env_data=[str(tmp_path / "data.bin")])
    assert d.errors == 0, d.error_log
    assert losses == base_losses and norms == base_norms
    assert all(torch.equal(a, b) for a, b in zip(base_params, params, strict=True))
    r = RunReader(tmp_path / "run")
    assert r.meta["framework"] == "torch" and r.array_steps() == [1, 2, 3]
    # the cluster capture, taken when the dumper was built: the initial weights, the generators, the data
    env = r.meta["environment"]
    assert env["framework"] == "torch" and env["captured"]["by"] == "TorchDumper"
    seed_everything(7, deterministic=False)
    init = dict(Net().named_parameters())
    w = env["weights"]["params"]
    assert sorted(w) == ["emb.weight", "fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    from dumpers.environment import fingerprint
    assert w["fc1.weight"] == {**fingerprint(init["fc1.weight"].detach().numpy()), "dtype": "float32"}
    assert env["random"]["torch"]["seed"] == 7 and env["random"]["torch"]["fresh"] is False   # Net() drew
    assert env["settings"]["torch"]["deterministic_algorithms"] is False
    assert env["data"][0]["files"][0]["size"] == 6000 and env["versions"]["torch"] == torch.__version__
    a = r.step_arrays(1)
    ln = a.table("local_norm")
    assert list(ln["name"]) == ["emb.weight", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert float(np.sqrt((ln["norm"] ** 2).sum())) == pytest.approx(norms[0], rel=1e-6)
    sc = r.scalars().set_index("step")
    assert sc.loc[1, "loss"] == losses[0] and sc.loc[1, "loss_mask_sum"] == 28.0
    ts = a.table("tensor_stats")
    seq = list(zip(ts["module"], ts["kind"], strict=True))
    assert seq[:4] == [("emb", "forward.input.0"), ("emb", "forward.output.0"), ("fc1", "forward.input.0"),
                       ("fc1", "forward.output.0")]
    assert seq.index(("fc2", "backward.grad_output.0")) < seq.index(("fc1", "backward.grad_output.0"))
    for order in ts["order"]:
        full = a.data[f"tensors/{order:06d}"].astype(np.float64)
        row = ts.iloc[order]
        assert row["numel"] == full.size
        np.testing.assert_allclose([full.max(), full.min(), full.mean(), np.linalg.norm(full)],
                                   [row["max"], row["min"], row["mean"], row["norm"]], rtol=1e-5, atol=1e-6)


def test_stats_only_and_step_selection(tmp_path: Path) -> None:
    train(tmp_path, n_steps=4, tensors="stats", steps="2-3", tensor_steps=[3], modules=("fc*",))
    r = RunReader(tmp_path)
    assert r.array_steps() == [2, 3] and list(r.scalars()["step"]) == [1, 2, 3, 4]
    assert r.step_arrays(2).table("tensor_stats") is None
    ts = r.step_arrays(3).table("tensor_stats")
    assert set(ts["module"]) == {"fc1", "fc2"}
    assert not any(k.startswith("tensors/") for k in r.step_arrays(3).data)


def test_tensor_stats_counts_nan_inf() -> None:
    t = torch.tensor([1.0, float("nan"), float("inf"), -2.0, float("-inf")])
    st = tensor_stats(t).tolist()
    assert st[4:] == [1.0, 2.0]
    assert tensor_stats(torch.tensor([3.0, -4.0])).tolist() == [3.0, -4.0, -0.5, 5.0, 0.0, 0.0]
    assert parse_steps("1-3,7") == frozenset({1, 2, 3, 7}) and parse_steps(None) is None


def test_nan_grad_traced_and_stop_on_request(tmp_path: Path) -> None:
    seed_everything(7, deterministic=False)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net.fc1.bias.register_hook(lambda g: g * float("nan"))
    d = TorchDumper(net, opt, DumpConfig(out=tmp_path, stop_on_nan=True), rank_info={"tp_rank": 0, "dp_rank": 0})
    b = batch(1)
    with pytest.raises(NonFiniteError):
        with d.step(1, b):
            opt.zero_grad()
            net(b["tokens"]).sum().backward()
            opt.step()  # the optimizer's step pre-hook captures the norms
    d.close()
    t = RunReader(tmp_path).step_arrays(1).table("nan_trace")
    assert (t.iloc[0]["kind"], t.iloc[0]["name"], t.iloc[0]["module"]) == ("grad", "fc1.bias", "fc1")


def test_unwritable_output_never_breaks_training(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("a file where the run store should go")
    base_losses, (_, base_params), _ = train(None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, (_, params), d = train(blocker, tensors="full", nan_trace="all")
    assert d.errors >= 1 and any("training continues" in str(w.message) for w in caught)
    assert losses == base_losses
    assert all(torch.equal(a, b) for a, b in zip(base_params, params, strict=True))


def test_ranks_filter_writes_nothing_for_other_ranks(tmp_path: Path) -> None:
    _, _, d = train(tmp_path / "run", ranks=[1])
    assert not d.enabled and d.errors == 0 and not (tmp_path / "run").exists()


def test_backward_off_captures_forward_only_and_out_is_required(tmp_path: Path) -> None:
    """DumpConfig is shared with the MindSpore dumper (dumpers/contract.py): ``backward=False`` keeps only
    the forward rows; a config without ``out`` is refused at once (MindSporeDumper takes out separately)."""
    base_losses, (_, base_params), _ = train(None)
    losses, (_, params), d = train(tmp_path, tensors="stats", backward=False)
    assert d.errors == 0, d.error_log
    assert losses == base_losses
    assert all(torch.equal(a, b) for a, b in zip(base_params, params, strict=True))
    kinds = set(RunReader(tmp_path).step_arrays(1).table("tensor_stats")["kind"])
    assert kinds and all(k.startswith("forward.") for k in kinds)
    with pytest.raises(ValueError, match="out"):
        TorchDumper(Net(), None, DumpConfig())


def test_record_batch_with_step_moves_the_boundary(tmp_path: Path) -> None:
    """The pretrain_gpt.py form: only ``record_batch(batch, step=...)`` per micro-batch, then ``close()``."""
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    d = TorchDumper(net, opt, DumpConfig(out=tmp_path))
    for step in (1, 2):
        opt.zero_grad()
        for micro in range(2):
            b = batch(10 * step + micro)
            d.record_batch(b, step=step)
            net(b["tokens"]).sum().backward()
        opt.step()
    d.close()
    r = RunReader(tmp_path)
    assert r.array_steps() == [1, 2] and not r.incomplete
    a = r.step_arrays(2)
    assert a.data["batch/tokens"].shape == (8, 8) and a.attrs["batch/tokens"]["micro_batches"] == 2
    np.testing.assert_array_equal(a.data["batch/tokens"][4:], batch(21)["tokens"].numpy())
    assert len(a.table("local_norm")) == 5 and list(r.scalars()["tokens_per_step"]) == [64, 64]


def test_stat_values_equal_numpy() -> None:
    """CPU statistics (floats) and the device-path tensor agree with numpy on dtypes, views, non-finite."""
    from dumpers.torch_dumper import _stat_values, _stats_matrix

    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 48, generator=g)
    cases = [x, x.t(), x[:, ::3], x.double(), x.half(), x.bfloat16(), torch.randint(-5, 9, (7, 5), generator=g),
             torch.tensor([1.5]), torch.tensor([1.0, float("nan"), float("inf"), -2.0, float("-inf")])]
    for t in cases:
        ref = t.float().numpy().astype(np.float64)
        finite = ref[np.isfinite(ref)]
        want = [ref.max(), ref.min(), ref.mean(), np.linalg.norm(ref), np.isnan(ref).sum(), np.isinf(ref).sum()]
        got = _stat_values(t)
        assert isinstance(got, list)
        if finite.size == ref.size:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        else:
            assert got[4:] == [1.0, 2.0]
            np.testing.assert_array_equal(got[:2], want[:2])     # NaN propagates to max/min, as in numpy
        np.testing.assert_allclose(_stats_matrix([got, tensor_stats(t)])[1], np.asarray(got, dtype=np.float32),
                                   rtol=1e-6)
    assert _stat_values(torch.zeros(0)) == [0.0] * 6


def test_norms_of_large_cpu_tensors_are_float64_accurate(tmp_path: Path) -> None:
    """torch's CPU norm kernels sum float32 squares in one run (rel. error ~8e-4 at 16M elements, past the
    1e-4 float32 compare tolerance); the statistics and the local norms are summed per block instead."""
    from dumpers.torch_dumper import NORM_BLOCK, _stat_values, l2_norm

    g = torch.Generator().manual_seed(5)
    x = torch.randn(1 << 24, generator=g) * 2 + 1
    for t in (x, x[: (1 << 24) - 12_345], x.view(4096, 4096)[:, :4000], x[: 3 * NORM_BLOCK]):
        ref = float(np.linalg.norm(t.numpy().astype(np.float64)))
        assert abs(l2_norm(t).item() - ref) / ref < 2e-6
        assert abs(_stat_values(t)[3] - ref) / ref < 2e-6
    lin = torch.nn.Linear(4096, 4096, bias=False)
    lin.weight.grad = x.view(4096, 4096).clone()
    d = TorchDumper(lin, None, DumpConfig(out=tmp_path, batch=False))
    d.begin_step(1)
    d.record_grads()
    d.end_step(loss=1.0)
    d.close()
    norm = RunReader(tmp_path).step_arrays(1).table("local_norm")["norm"].iloc[0]
    ref = float(np.linalg.norm(x.numpy().astype(np.float64)))
    assert abs(norm - ref) / ref < 2e-6


class InPlaceNet(torch.nn.Module):
    """fc's output is changed in place right after its forward hook ran (ReLU(inplace=True)), and the same
    tensor feeds two modules."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.act = torch.nn.ReLU(inplace=True)
        self.a = torch.nn.Identity()
        self.b = torch.nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc(x))
        return self.a(h) + self.b(h)


@pytest.mark.parametrize("background", [False, True])
def test_full_dump_holds_the_value_the_hook_saw(tmp_path: Path, background: bool) -> None:
    """No clone before a synchronous write, a clone before a queued one: either way an in-place change after
    the hook does not reach the dump; a tensor seen twice unchanged is stored once (a link)."""
    import h5py

    torch.manual_seed(0)
    net = InPlaceNet()
    x = torch.randn(4, 8)
    pre_relu = net.fc(x).detach().clone()
    d = TorchDumper(net, None, DumpConfig(out=tmp_path, tensors="full", background_writes=background))
    with d.step(1):
        net(x).sum().backward()
    d.close()
    assert d.errors == 0, d.error_log
    a = RunReader(tmp_path).step_arrays(1)
    ts = a.table("tensor_stats")
    order = {(m, k): int(o) for m, k, o in zip(ts["module"], ts["kind"], ts["order"], strict=True)}
    fc_out = a.data[f"tensors/{order[('fc', 'forward.output.0')]:06d}"]
    np.testing.assert_array_equal(fc_out, pre_relu.numpy())
    assert (fc_out < 0).any()                            # the ReLU that followed did not reach the dump
    a_in = order[("a", "forward.input.0")]
    b_in = order[("b", "forward.input.0")]
    np.testing.assert_array_equal(a.data[f"tensors/{a_in:06d}"], np.maximum(pre_relu.numpy(), 0))
    with h5py.File(RunReader(tmp_path).step_file(1, 0), "r") as h5:
        assert h5[f"tensors/{a_in:06d}"].id.get_offset() == h5[f"tensors/{b_in:06d}"].id.get_offset()
        assert not h5[f"tensors/{a_in:06d}"].attrs            # names and kinds live in tensor_stats


KILLED_DUMPER = """
import sys, time, torch
from dumpers.torch_dumper import DumpConfig, TorchDumper
net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
opt = torch.optim.SGD(net.parameters(), lr=0.1)
d = TorchDumper(net, opt, DumpConfig(out=sys.argv[1], tensors="full", background_writes=sys.argv[2] == "1"))
for step in range(1, 100):
    d.begin_step(step)
    d.record_batch({"tokens": torch.arange(8).reshape(1, 8) + step})
    opt.zero_grad()
    net(torch.randn(4, 8)).sum().backward()
    opt.step()
    if step == 3:
        print("ready", flush=True)
        time.sleep(60)          # killed here, inside step 3
    d.end_step(loss=float(step))
"""


@pytest.mark.parametrize("background", [False, True])
def test_killed_mid_step_leaves_completed_steps_readable(tmp_path: Path, background: bool) -> None:
    import os
    import signal
    import subprocess
    import sys

    root = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_DUMPER, str(root), "1" if background else "0"],
                            stdout=subprocess.PIPE, text=True, cwd=str(Path(__file__).resolve().parents[1]),
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    r = RunReader(root)
    assert r.array_steps() == [1, 2] and list(r.scalars()["step"]) == [1, 2]
    # synchronous writes have step 3's temporary file open when the kill lands; the background writer may
    # not have reached it yet (then nothing of step 3 is on disk, which is just as readable)
    assert [i.step for i in r.incomplete] in (([3], []) if background else ([3],))
    for step in (1, 2):
        a = r.step_arrays(step)
        ts = a.table("tensor_stats")
        assert len(ts) > 0 and all(f"tensors/{int(o):06d}" in a.data for o in ts["order"])
        assert a.data["batch/tokens"][0, 0] == step
