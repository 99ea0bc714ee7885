"""MindFormers' DeepSeek-V3 MLA (TrainingDeepseekV3ForCausalLM, MLA without MoE) against megatron-core's MLA
with the same weights: GRAPH agrees on the loss and on every parameter's step-1 gradient norm; PYNATIVE has
the same loss but wrong MLA projection gradients (a MindFormers/MindSpore PYNATIVE bug, measured here and
in DESIGN.md with finite differences), and the step-1 local-norm stage names those parameters. (The bug is
reproduced with ``fix_pynative_split=False``; by default the CPU stand-ins split per use, which fixes it.)

Both sides use plain RoPE (MindFormers' DeepSeek-V3 and Megatron's MLATransformerConfig default to YaRN x40,
MindFormers then also changes the softmax scale through mscale). Measured: loss 4.1805487 vs 4.1805501,
GRAPH gradient norms within 2e-7; PYNATIVE layer-0 linear_kv_down_proj off by 30 %, q_layernorm by 29 %.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")
ms = pytest.importorskip("mindspore")
pytest.importorskip("mindformers")

from comparators.local_norms import ShardNorm, compare_norm_entries  # noqa: E402
from demo import mindformers_mcore_cpu as mc  # noqa: E402
from models import load_mapping  # noqa: E402
from tests.helpers import megatron_step1 as meg_step1  # noqa: E402

SPEC = mc.TinyModel(kind="mla", num_experts=0)
PRESET = mc.MCORE_PRESETS["mla"]


@pytest.fixture(scope="module")
def megatron_step1():
    """Megatron MLA: weights converted to MindFormers names, the batch, step-1 loss and gradient norms."""
    meg = meg_step1.megatron_step1(SPEC, PRESET)
    return meg.weights, meg.batch, meg.loss, {n: v for n, (v, _) in meg.norms.items()}


class _Loss(ms.nn.Cell):
    def __init__(self, net: ms.nn.Cell) -> None:
        super().__init__(auto_prefix=False)
        self.network = mc.McoreReplayLoss(net)

    def construct(self, input_ids, labels, loss_mask):  # noqa: ANN001, ANN201
        return self.network(input_ids, labels, loss_mask)[0]


def _mindformers_step1(mode: str, weights, batch, *, fix_pynative_split: bool = True
                       ) -> tuple[float, dict[str, float]]:
    mc.set_mcore_context(mode, seed=0)
    try:
        net = mc.build_mcore_model(SPEC, mode, fix_pynative_split=fix_pynative_split)
        mc.load_parameter_arrays(net, weights)
        params = net.trainable_params()
        grad_fn = ms.value_and_grad(_Loss(net), None, params)
        if mode == "graph":
            grad_fn = ms.jit(grad_fn)
        loss, grads = grad_fn(*mc.mcore_inputs(batch))
        norms = {p.name: float(np.linalg.norm(g.asnumpy())) for p, g in zip(params, grads, strict=True)}
        return float(loss.asnumpy().reshape(-1)[0]), norms
    finally:
        mc.reset_mindformers_context()


def _compare(b_norms, c_norms):
    def entries(norms):
        return {k: ShardNorm(-1, 1, {0: v}, {0: 1}, {0}) for k, v in norms.items()}

    return compare_norm_entries(entries(b_norms), entries(c_norms), load_mapping(PRESET))


def test_mla_graph_matches_megatron(megatron_step1) -> None:
    weights, batch, want, b_norms = megatron_step1
    got, c_norms = _mindformers_step1("graph", weights, batch)
    assert abs(got - want) / want <= 1e-5
    res = _compare(b_norms, c_norms)
    assert res.verdict == "pass", [f.message for f in res.findings][:3]


def test_mla_pynative_gradient_bug_is_named_at_step1_local_norms(megatron_step1) -> None:
    """MLA's shared SplitWithSize kept (the demo's models split per use, which fixes it: see
    tests/test_mindformers_moe.py::test_deepseek_v3_style_pynative_matches_graph)."""
    weights, batch, want, b_norms = megatron_step1
    got, c_norms = _mindformers_step1("pynative", weights, batch, fix_pynative_split=False)
    assert abs(got - want) / want <= 1e-5                          # the loss hides it
    res = _compare(b_norms, c_norms)
    assert res.verdict == "fail"
    failing = {f.component for f in res.findings if f.verdict == "fail"}
    assert {"decoder.layers.0.self_attention.linear_kv_down_proj.weight",
            "decoder.layers.1.self_attention.linear_kv_down_proj.weight",
            "decoder.layers.0.self_attention.q_layernorm.weight"} <= failing
    assert "output_layer.weight" not in failing and "decoder.final_layernorm.weight" not in failing
