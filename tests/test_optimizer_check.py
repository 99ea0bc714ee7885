"""Optimizer check on real models: Megatron-core's step-1 gradients fed to MindFormers' AdamW.

Baseline: a tiny Megatron-core GPTModel, one torch AdamW step (the way a user's PyTorch loop does it).
Candidate: MindFormers' LlamaForCausalLM on the converted weights, MindFormers' own AdamW over its own
parameter groups (no weight decay for 1-D weights and biases), stepping on the baseline's gradients.
A baseline that decays every weight must be reported by the norm parameters' names; matched groups pass.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")
ms = pytest.importorskip("mindspore")
mc = pytest.importorskip("demo.mindformers_cpu")

from checkpoints import convert as cw  # noqa: E402
from comparators import optimizer_check as oc  # noqa: E402
from demo.megatron_cpu import TinyLlamaConfig, build_tiny_llama, forward_loss, init_megatron_cpu, synthetic_batch  # noqa: E402
from dumpers.mindspore_optimizer_check import optimizer_step_with_grads  # noqa: E402

CFG = TinyLlamaConfig()
LR, WD, BETAS, EPS = 1e-3, 0.1, (0.9, 0.95), 1e-8
HEADS = {"num_heads": CFG.num_attention_heads, "num_query_groups": CFG.num_query_groups}
NORMS = {"decoder.layers.0.input_layernorm.weight", "decoder.layers.0.pre_mlp_layernorm.weight",
         "decoder.layers.1.input_layernorm.weight", "decoder.layers.1.pre_mlp_layernorm.weight",
         "decoder.final_layernorm.weight"}


def _torch_step(init: dict, grads: dict, decay_all: bool) -> dict[str, np.ndarray]:
    """One torch AdamW step from ``init`` with ``grads``; decay_all = decay norms too (a user's loop)."""
    params = {n: torch.nn.Parameter(torch.from_numpy(w.copy())) for n, w in init.items()}
    for n, p in params.items():
        p.grad = torch.from_numpy(grads[n].copy())
    if decay_all:
        groups = [{"params": list(params.values()), "weight_decay": WD}]
    else:
        groups = [{"params": [p for p in params.values() if p.ndim > 1], "weight_decay": WD},
                  {"params": [p for p in params.values() if p.ndim == 1], "weight_decay": 0.0}]
    torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, foreach=False).step()
    return {n: p.detach().numpy().copy() for n, p in params.items()}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    init_megatron_cpu(tp=1)
    model = build_tiny_llama(CFG, seed=5)
    root = tmp_path_factory.mktemp("optcheck")
    torch.save(model.state_dict(), root / "megatron.pt")
    init = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    loss = forward_loss(model, synthetic_batch(1, CFG))
    loss.backward()
    grads = {n: p.grad.detach().numpy().copy() for n, p in model.named_parameters()}
    cw.convert_megatron_to_mindformers([root / "megatron.pt"], root / "mf.ckpt", **HEADS)

    # Candidate: MindFormers' AdamW over MindFormers' own groups, fed the baseline's gradients.
    from mindformers.core.optim import AdamW
    from mindformers.trainer.optimizer_grouped_parameters import get_optimizer_grouped_parameters

    mc.set_cpu_context("pynative", seed=0)
    net = mc.build_tiny_llama(seed=0, **mc.overrides_like_megatron(CFG))
    not_loaded, unused = ms.load_param_into_net(net, ms.load_checkpoint(str(root / "mf.ckpt")), strict_load=True)
    assert not not_loaded and not unused
    groups = get_optimizer_grouped_parameters(model=net, weight_decay=WD)
    opt = AdamW(groups, learning_rate=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    after_c = optimizer_step_with_grads(opt, oc.to_candidate_names(grads, None, HEADS))
    step1 = root / "baseline_step1.npz"
    oc.write_step1_file(step1, grads, init, _torch_step(init, grads, decay_all=False))
    return {"init": init, "grads": grads, "after_c": after_c, "step1": step1}


def test_matched_weight_decay_groups_pass(pair) -> None:
    s1 = oc.read_step1_file(pair["step1"])
    assert set(s1["grad"]) == set(s1["init"]) == set(s1["weight"]) == set(pair["init"])
    res = oc.compare_updates(s1["init"], s1["weight"], pair["after_c"], "megatron_core_llama__mindformers_llama",
                             params=HEADS)
    assert res.verdict == "pass", [f.message for f in res.findings]
    assert res.details["compared"] == len(pair["init"]) == 15
    # Same gradients, same optimizer semantics: the worst update differs at float32-noise level.
    assert res.details["worst"][0]["rel_diff"] < 1e-4


def test_weight_decay_on_norms_named_at_optimizer_stage(pair) -> None:
    after_b = _torch_step(pair["init"], pair["grads"], decay_all=True)
    res = oc.compare_updates(pair["init"], after_b, pair["after_c"], "megatron_core_llama__mindformers_llama",
                             params=HEADS)
    assert res.verdict == "fail" and res.name == "optimizer"
    failing = {f.component for f in res.findings if f.metric == "update_rel_diff" and f.verdict == "fail"}
    assert failing == NORMS, failing                 # the norms, by baseline name, and nothing else
    decay = [f for f in res.findings if f.metric == "weight_decay_mismatch"]
    assert decay and set(decay[0].component.split(", ")) == NORMS
    for r in res.details["worst"][:len(NORMS)]:
        # diff = -lr * (wd_c - wd_b) * w = +lr * wd * w: the baseline decays more, by lr*wd
        assert r["lr_times_wd_delta"] == pytest.approx(-LR * WD, rel=1e-3)
        assert "baseline applies more weight decay" in _msg(res, r["name"])


def _msg(res, name: str) -> str:
    return next(f.message for f in res.findings if f.component == name and f.metric == "update_rel_diff")


def test_missing_candidate_parameter_is_a_finding(pair) -> None:
    after_c = {k: v for k, v in pair["after_c"].items() if k != "model.norm_out.weight"}
    after_b = _torch_step(pair["init"], pair["grads"], decay_all=False)
    res = oc.compare_updates(pair["init"], after_b, after_c, "megatron_core_llama__mindformers_llama",
                             params=HEADS)
    assert res.verdict == "fail"
    assert any(f.component == "decoder.final_layernorm.weight" and f.metric == "missing_candidate"
               for f in res.findings)


def test_clipping_through_the_mindformers_cell(pair) -> None:
    """The fed gradients are clipped by MindFormers' own training cell (max norm 0.1).

    SGD with lr 1 on both sides, because Adam's first step is nearly scale-invariant and would hide a
    clipping difference: the candidate matches a clipped baseline and fails against an unclipped one.
    """
    net = mc.build_tiny_llama(seed=0, **mc.overrides_like_megatron(CFG))
    ms.load_param_into_net(net, ms.load_checkpoint(str(pair["step1"].parent / "mf.ckpt")), strict_load=True)
    opt = ms.nn.SGD(net.trainable_params(), learning_rate=1.0)
    cell = mc.build_train_cell(net, optimizer=opt, max_grad_norm=0.1)
    after_c = optimizer_step_with_grads(opt, oc.to_candidate_names(pair["grads"], None, HEADS), train_cell=cell)

    def torch_sgd(max_norm: float | None) -> dict[str, np.ndarray]:
        params = {n: torch.nn.Parameter(torch.from_numpy(w.copy())) for n, w in pair["init"].items()}
        for n, p in params.items():
            p.grad = torch.from_numpy(pair["grads"][n].copy())
        if max_norm is not None:
            assert float(torch.nn.utils.clip_grad_norm_(list(params.values()), max_norm)) > max_norm
        torch.optim.SGD(list(params.values()), lr=1.0, foreach=False).step()
        return {n: p.detach().numpy().copy() for n, p in params.items()}

    kw = {"mapping": "megatron_core_llama__mindformers_llama", "params": HEADS}
    assert oc.compare_updates(pair["init"], torch_sgd(0.1), after_c, **kw).verdict == "pass"
    assert oc.compare_updates(pair["init"], torch_sgd(None), after_c, **kw).verdict == "fail"
