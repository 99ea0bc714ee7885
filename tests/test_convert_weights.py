"""Weight conversion on real models: Megatron-core GPTModel -> MindFormers LlamaForCausalLM -> Megatron is
bit-identical, and both models give the same step-1 loss and logits on the same (pre-shifted) batch.

Tolerance (float32 noise): both sides run float32 on CPU and order their reductions differently (matmul
blocking, softmax, RMSNorm and cross-entropy sums). Measured with identical weights: layer outputs agree to
~1e-7 relative, logits to ~2e-7 of their scale, the loss to ~4e-7 relative (4.797961 vs 4.797959, 4 ulps of
4.8). Limits: loss rel 4e-6 (~32 float32 eps), logits max abs err <= 1e-5 x max |logit| (~80 eps). A real
modelling difference is far outside: MindFormers hiding the key of one token == pad_token_id moved the loss
by 2.3e-4 and the logits after that position by ~8e-2 of their scale. The loss of a fresh model sits near
log(vocab) and moves little under a wrong transform, hence the logits check as well.
"""

from __future__ import annotations

import argparse

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")
ms = pytest.importorskip("mindspore")
mc = pytest.importorskip("demo.mindformers_cpu")

from align.cli import convert_weights as convert_verb  # noqa: E402
from checkpoints import convert as cw  # noqa: E402
from demo.megatron_cpu import TinyLlamaConfig, build_tiny_llama, forward_loss, init_megatron_cpu, synthetic_batch  # noqa: E402

CFG = TinyLlamaConfig()


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    init_megatron_cpu(tp=1)
    model = build_tiny_llama(CFG, seed=11)
    root = tmp_path_factory.mktemp("convert")
    torch.save(model.state_dict(), root / "megatron.pt")
    return model, root


def _cli(*argv: str) -> int:
    p = argparse.ArgumentParser()
    convert_verb.add_arguments(p)
    return convert_verb.run(p.parse_args(list(argv)))


def test_round_trip_bit_identical(megatron) -> None:
    model, root = megatron
    heads = ["--num-heads", str(CFG.num_attention_heads), "--num-query-groups", str(CFG.num_query_groups)]
    assert _cli(str(root / "megatron.pt"), "--to", "mindformers", "--out", str(root / "mf.ckpt"), *heads) == 0
    assert _cli(str(root / "mf.ckpt"), "--to", "megatron", "--out", str(root / "back.pt"), *heads) == 0
    orig = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    back = torch.load(root / "back.pt", weights_only=True)
    assert sorted(back) == sorted(k for k in orig if not k.endswith("_extra_state"))
    for k, v in back.items():
        assert v.dtype == orig[k].dtype and torch.equal(v, orig[k]), k
    mf_names = set(ms.load_checkpoint(str(root / "mf.ckpt")))
    assert "model.layers.1.attention.wk.weight" in mf_names and "lm_head.weight" in mf_names


def _megatron_logits(model, batch):
    with torch.no_grad():
        return model(input_ids=batch["tokens"], position_ids=batch["position_ids"],
                     attention_mask=batch["attention_mask"]).float().numpy()


def test_step1_loss_matches_mindformers_llama(megatron) -> None:
    model, root = megatron
    cw.convert_megatron_to_mindformers([root / "megatron.pt"], root / "mf2.ckpt",
                                       num_heads=CFG.num_attention_heads, num_query_groups=CFG.num_query_groups)
    batch = synthetic_batch(1, CFG)
    # The batch must hold token 0 (MindFormers' default pad_token_id) mid-sequence: the trap this guards.
    assert (batch["tokens"][:, 1:-1] == 0).any()
    with torch.no_grad():
        mg_loss = float(forward_loss(model, batch))
    mg_logits = _megatron_logits(model, batch)
    mc.set_cpu_context("pynative", seed=0)
    net = mc.build_tiny_llama(seed=0, **mc.overrides_like_megatron(CFG))
    params = ms.load_checkpoint(str(root / "mf2.ckpt"))
    not_loaded, ckpt_unused = ms.load_param_into_net(net, params, strict_load=True)
    assert not not_loaded and not ckpt_unused, (not_loaded, ckpt_unused)
    tokens = ms.Tensor(batch["tokens"].numpy().astype(np.int32))
    loss_cell = mc.LlamaReplayLoss(net)
    mf_loss = float(loss_cell(tokens, ms.Tensor(batch["labels"].numpy().astype(np.int32)),
                              ms.Tensor(batch["loss_mask"].numpy())).asnumpy().reshape(-1)[0])
    net.set_train(False)
    mf_logits = net(tokens)[0].asnumpy().reshape(mg_logits.shape)
    net.set_train(True)
    err = float(np.abs(mf_logits - mg_logits).max() / np.abs(mg_logits).max())
    assert err <= 1e-5, err
    assert mf_loss == pytest.approx(mg_loss, rel=4e-6), (mg_loss, mf_loss)
    assert abs(mg_loss - np.log(CFG.vocab_size)) < 1.0     # a real, untrained-model loss, not 0 or nan


def test_overrides_like_megatron_cover_the_config() -> None:
    """Every shape field of the Megatron config reaches LlamaConfig, and no pad id can hide a token."""
    ov = mc.overrides_like_megatron(CFG)
    cfg = mc.tiny_llama_config(**ov)
    assert (cfg.hidden_size, cfg.num_heads, cfg.n_kv_heads, cfg.intermediate_size, cfg.vocab_size) == (
        CFG.hidden_size, CFG.num_attention_heads, CFG.num_query_groups, CFG.ffn_hidden_size, CFG.vocab_size)
    assert not 0 <= cfg.pad_token_id < CFG.vocab_size
