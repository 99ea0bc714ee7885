"""DeepSeek-V3 multi-token prediction (MTP) on both sides with the same weights: megatron-core 0.16.1's
GPTModel with ``mtp_num_layers=1`` (MTP block from get_gpt_mtp_block_spec) and MindFormers'
TrainingDeepseekV3ForCausalLM with ``num_nextn_predict_layers: 1``, MLA without MoE (runs on this CPU),
MindFormers in GRAPH mode, once with ``mla_qkv_concat: False`` (preset ..._mla, the shipped YAMLs) and once
with ``True`` (preset ..._mla_qkv_concat, MindFormers' default).

Checked: Megatron's ``lm loss`` (excludes MTP) equals MindFormers' ``lm_loss`` (the model's first output),
the MTP loss Megatron logs (MTPLossLoggingHelper, unscaled) equals MindFormers' ``mtp_loss`` / mtp_loss_factor,
and every parameter's step-1 gradient norm (lm + factor * MTP, what both frameworks back-propagate) agrees by
name through the preset, the MTP layer's parameters included. Measured: lm 4.1799560 vs 4.1799579 (4.6e-7),
MTP 4.1830480 vs 4.1830492 (2.9e-7), worst gradient norm 3e-7 relative, in both layouts.

A trap on the way: Megatron's GPTModel masks the MTP loss with the ``loss_mask`` it is given and with an
all-ones mask when given none (the lm loss is masked outside the model, so it does not notice); MindFormers
masks both. Without the mask the MTP loss differed by 2.6e-4 and MTP gradients by up to 17 %.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")
ms = pytest.importorskip("mindspore")
pytest.importorskip("mindformers")

from comparators.local_norms import ShardNorm, compare_norm_entries  # noqa: E402
from demo import megatron_cpu as mg  # noqa: E402
from demo import mindformers_mcore_cpu as mc  # noqa: E402
from mapping import TransformParams  # noqa: E402
from models import load_mapping  # noqa: E402

SPEC = mc.TinyModel(kind="mla", num_experts=0)
MTP_FACTOR = 0.3          # pretrain_deepseek3_671b.yaml: mtp_loss_factor 0.3 (Megatron: mtp_loss_scaling_factor)
PRESETS = {False: "megatron_core__mindformers_mcore_mla", True: "megatron_core__mindformers_mcore_mla_qkv_concat"}


@pytest.fixture(scope="module")
def megatron_step1():
    """Megatron MLA + MTP: state, batch, lm loss, MTP loss (unscaled), gradient norms and sizes by name."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    mg.init_megatron_cpu(tp=1)
    kw = mc.megatron_config_kwargs(SPEC)
    kw["extra"].update(mtp_num_layers=1, mtp_loss_scaling_factor=MTP_FACTOR)
    cfg = mg.TinyLlamaConfig(**kw)
    model = mg.build_tiny_llama(cfg, seed=5)
    assert any(n.startswith("mtp.layers.0.eh_proj") for n, _ in model.named_parameters())
    tb = mg.synthetic_batch(1, cfg)
    MTPLossLoggingHelper.tracker.pop("values", None)   # it accumulates across forwards in the process
    loss = mg.forward_loss(model, tb)
    mtp = float(MTPLossLoggingHelper.tracker.pop("values")[0])
    loss.backward()
    norms = {n: (float(p.grad.norm()), p.numel()) for n, p in model.named_parameters()}
    state = {k: v.detach().numpy() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    batch = {k: tb[k].numpy() for k in ("tokens", "labels", "loss_mask")}
    return state, batch, float(loss.detach()), mtp, norms


class _Losses(ms.nn.Cell):
    """(lm + MTP, lm, MTP): the model's first two outputs are lm_loss and the factor-scaled mtp_loss."""

    def __init__(self, net: ms.nn.Cell) -> None:
        super().__init__(auto_prefix=False)
        self.network = mc.McoreReplayLoss(net)

    def construct(self, input_ids, labels, loss_mask):  # noqa: ANN001, ANN201
        out = self.network(input_ids, labels, loss_mask)
        return out[0] + out[1], out[0], out[1]


def _entries(norms: dict[str, tuple[float, int]]) -> dict[str, ShardNorm]:
    return {k: ShardNorm(-1, 1, {0: v}, {0: n}, {0}) for k, (v, n) in norms.items()}


@pytest.mark.parametrize("qkv_concat", [False, True], ids=["mla_qkv_concat_false", "mla_qkv_concat_true"])
def test_mtp_losses_and_gradients_match_megatron(qkv_concat: bool, megatron_step1) -> None:
    state, batch, want_lm, want_mtp, b_norms = megatron_step1
    m = load_mapping(PRESETS[qkv_concat])
    weights, res = m.convert({k: v for k, v in state.items() if not m.ignored(k, "baseline")}, "candidate",
                             TransformParams(num_heads=SPEC.num_attention_heads,
                                             num_query_groups=SPEC.num_attention_heads))
    assert res.verdict == "pass"
    mc.set_mcore_context("graph", seed=0)
    try:
        net = mc.build_mcore_model(SPEC, "graph", num_nextn_predict_layers=1, mtp_loss_factor=MTP_FACTOR,
                                   mla_qkv_concat=qkv_concat)
        names = [p.name for p in net.get_parameters()]
        assert ("decoder.layers.0.self_attention.linear_qkv.weight" in names) is qkv_concat
        mc.load_parameter_arrays(net, weights)        # every MindFormers parameter, MTP included, by name
        params = net.trainable_params()
        fn = ms.jit(ms.value_and_grad(_Losses(net), None, params, has_aux=True))
        (_, lm, mtp), grads = fn(*mc.mcore_inputs(batch))
    finally:
        mc.reset_mindformers_context()
    lm = float(lm.asnumpy().reshape(-1)[0])
    mtp = float(mtp.asnumpy().reshape(-1)[0]) / MTP_FACTOR
    assert abs(lm - want_lm) / want_lm <= 1e-5, (lm, want_lm)
    assert abs(mtp - want_mtp) / want_mtp <= 1e-5, (mtp, want_mtp)
    c_norms = {p.name: (float(np.linalg.norm(g.asnumpy())), int(np.prod(p.shape))) for p, g in
               zip(params, grads, strict=True)}
    res = compare_norm_entries(_entries(b_norms), _entries(c_norms), m)
    assert res.verdict == "pass", [f.message for f in res.findings if f.verdict != "pass"][:3]
    assert not [f for f in res.findings if f.metric in ("unmapped", "missing_counterpart")]
    rows = res.details["parameters"]
    compared = {r["name"] for r in rows}
    assert {"mtp.layers.0.eh_proj.weight", "mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight",
            "mtp.layers.0.final_layernorm.weight"} <= compared
    assert len(compared) == len([n for n in b_norms if not (qkv_concat and "linear_kv_down_proj" in n)])
    assert max(r["rel_diff"] for r in rows) <= 1e-5
