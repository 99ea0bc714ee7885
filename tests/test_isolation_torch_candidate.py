"""Backward isolation the other way round (issue 39 item 1): a MindSpore baseline (MindFormers 2.x mcore Qwen3,
its cells' backward captured by dumpers.mindspore_module_backward) and a PyTorch candidate (the Megatron-core
model with the same weights, run by dumpers.torch_isolation): correct, every module's own error passes; with a
gradient hook that triples one norm's weight gradient (forward untouched), that norm is named by its backward.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    torch = pytest.importorskip("torch")
    pytest.importorskip("megatron.core")
    pytest.importorskip("mindspore")
    pytest.importorskip("mindformers")
    import demo.mindformers_mcore_cpu as mc
    from demo import megatron_cpu as mg
    from demo.model import MCORE_PRESETS, demo_model, megatron_config_kwargs
    from demo.spec import Spec, mindformers_config
    from dumpers.mindspore_module_backward import capture_module_backward
    from mapping import TransformParams
    from models import load_mapping

    spec = replace(demo_model(), num_layers=2)
    mg.init_megatron_cpu(tp=1)
    cfg = mg.TinyLlamaConfig(**megatron_config_kwargs(spec))
    model = mg.build_tiny_llama(cfg, seed=3)
    weights = {k: v.detach().numpy().copy() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    params = TransformParams(num_heads=spec.num_attention_heads, num_query_groups=spec.num_query_groups)
    conv, _ = load_mapping(MCORE_PRESETS["dense"]).convert(weights, "candidate", params)
    batch = mg.synthetic_batch(1, cfg)
    store = tmp_path_factory.mktemp("ms_baseline") / "baseline"
    ycfg = mindformers_config(Spec(role="candidate", out=str(store.parent / "unused"), steps=1, model=spec))
    try:
        net = mc.build_pynative_model(ycfg)
        mc.load_parameter_arrays(net, conv)
        capture_module_backward(net, store, ["decoder.layers.?", "decoder.layers.?.*"], step=1,
                                batch={k: batch[k].numpy() for k in ("tokens", "labels", "loss_mask")})
    finally:     # leave the process's MindSpore / MindFormers context as other tests expect it
        mc.set_mcore_context("graph")
        mc.reset_mindformers_context()
    return store, model, batch, params


def _isolate(pair, out: Path):  # noqa: ANN202
    from comparators.isolation import compare_isolation, read_isolation
    from demo import megatron_cpu as mg
    from demo.model import MCORE_PRESETS
    from dumpers.torch_isolation import isolate_torch_modules

    store, model, batch, params = pair
    path = isolate_torch_modules(model, store, out, mapping=MCORE_PRESETS["dense"], forward=mg.forward_loss,
                                 batch=batch, params=params, dtype="float16")
    return compare_isolation(*read_isolation(path))


def test_a_correct_torch_candidate_passes_module_by_module(pair, tmp_path: Path) -> None:
    res = _isolate(pair, tmp_path / "iso")
    rows = {r["module"]: r for r in res.details["per_module"]}
    for r in res.details["per_module"]:
        print(f"{r['module']:40s} fwd {r['own_rel_l2']:.1e} bwd {r['bwd_own_rel_l2']:.1e} ({r['bwd_worst']})")
    assert res.verdict == "pass" and res.details["named"] == []
    assert {"decoder.layers.0", "decoder.layers.1.mlp", "decoder.layers.1.pre_mlp_layernorm"} <= set(rows)
    assert rows["decoder.layers.1.mlp"]["bwd_own_rel_l2"] < 1e-5
    whats = {g["what"] for g in rows["decoder.layers.1"]["per_grad"]}
    assert "input:hidden_states" in whats and "weight:decoder.layers.1.mlp.linear_fc1.weight" in whats


def test_a_torch_module_with_a_wrong_gradient_is_named_by_its_backward(pair, tmp_path: Path) -> None:
    store, model, batch, params = pair
    norm = dict(model.named_parameters())["decoder.layers.1.pre_mlp_layernorm.weight"]
    handle = norm.register_hook(lambda g: g * 3)       # forward untouched, its weight gradient tripled
    try:
        res = _isolate(pair, tmp_path / "iso")
    finally:
        handle.remove()
    rows = {r["module"]: r for r in res.details["per_module"]}
    assert res.verdict == "fail" and res.details["named"] == ["decoder.layers.1.pre_mlp_layernorm"]
    r = rows["decoder.layers.1.pre_mlp_layernorm"]
    assert r["own_verdict"] == "pass" and r["bwd_own_verdict"] == "fail"
    assert r["bwd_own_rel_l2"] == pytest.approx(2 / 3, rel=1e-2)     # ||g - 3g|| / ||3g||
    assert np.isfinite(rows["decoder.layers.0"]["bwd_own_rel_l2"]) and rows["decoder.layers.0"]["verdict"] == "pass"


def test_an_asked_for_module_no_mapping_rule_covers_is_noted(pair, tmp_path: Path) -> None:
    """The torch candidate picks its modules as the MindSpore one does (mapped_modules): a captured module asked
    for by pattern that no module rule maps (linear_fc1: the mapping names the MLP and its linear_fc2) is listed
    with the reason, not dropped silently."""
    from comparators.isolation import compare_isolation, read_isolation
    from demo import megatron_cpu as mg
    from demo.model import MCORE_PRESETS
    from dumpers.torch_isolation import isolate_torch_modules

    store, model, batch, params = pair
    path = isolate_torch_modules(model, store, tmp_path / "iso", mapping=MCORE_PRESETS["dense"],
                                 forward=mg.forward_loss, batch=batch, params=params,
                                 modules=["decoder.layers.1.mlp", "decoder.layers.1.mlp.linear_fc1"])
    res = compare_isolation(*read_isolation(path))
    assert [r["module"] for r in res.details["per_module"]] == ["decoder.layers.1.mlp"]
    assert {"module": "decoder.layers.1.mlp.linear_fc1", "reason": "no module rule of the mapping covers it"} in \
        res.details["skipped_modules"]
