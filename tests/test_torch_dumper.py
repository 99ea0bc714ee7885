"""The generic torch dumper on a plain nn.Module + torch optimizer (in process, no Megatron)."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from align.core.runstore import RunReader  # noqa: E402
from dumpers.seed_torch import seed_everything  # noqa: E402
from dumpers.torch_dumper import DumpConfig, NonFiniteError, TorchDumper, parse_steps, tensor_stats  # noqa: E402


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
    losses, (norms, params), d = train(tmp_path, tensors="full", nan_trace="all", seed_layout=True)
    assert d.errors == 0, d.error_log
    assert losses == base_losses and norms == base_norms
    assert all(torch.equal(a, b) for a, b in zip(base_params, params, strict=True))
    r = RunReader(tmp_path)
    assert r.meta["framework"] == "torch" and r.array_steps() == [1, 2, 3]
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
