"""Backward isolation (issue 39 item 1): each module fed the baseline's inputs and output gradient, its input
and weight gradients against the baseline's, own vs inherited.

The comparator on small numpy data first; then the real thing: a Megatron-core baseline (its step-1 module
backward captured by dumpers.torch_module_backward), the MindFormers 2.x mcore candidate built by `align
isolate` from its YAML, with the demo's norm_grad fault planted (one RMSNorm whose forward is right and whose
weight gradient is not): forward isolation passes it, backward isolation names that norm, in PYNATIVE and with
each module compiled (--graph).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from comparators.isolation import compare_isolation


def _noisy(y: np.ndarray, rel: float, seed: int) -> np.ndarray:
    d = np.random.default_rng(seed).standard_normal(y.shape).astype(np.float32)
    return y + rel * d * np.linalg.norm(y) / np.linalg.norm(d)


def test_a_module_with_a_right_forward_and_a_wrong_gradient_is_named_by_its_backward() -> None:
    rng = np.random.default_rng(0)
    arrays, mods = {}, []
    # bwd own error per module: the layer's worst gradient is its norm's (the norm sits inside it)
    own_bwd = {"decoder.layers.0": 1e-6, "decoder.layers.1": 0.3, "decoder.layers.1.pre_mlp_layernorm": 0.3}
    for i, (name, rel) in enumerate(own_bwd.items()):
        y = rng.standard_normal((8, 2, 16)).astype(np.float32)
        arrays[f"baseline/{name}"], arrays[f"isolated/{name}"] = y, _noisy(y, 1e-7, i)
        arrays[f"candidate/{name}"] = _noisy(y, 1e-7, i)
        grads = []
        for what, r in (("input:hidden_states", 1e-6), (f"weight:{name}.weight", rel)):
            g = rng.standard_normal(16).astype(np.float32)
            arrays[f"grad/baseline/{name}/{what}"] = g
            arrays[f"grad/isolated/{name}/{what}"] = _noisy(g, r, 10 + i)
            arrays[f"grad/candidate/{name}/{what}"] = _noisy(g, r, 20 + i)
            grads.append({"what": what})
        mods.append({"baseline": name, "candidate": name, "grads": grads})
    res = compare_isolation({"step": 1, "modules": mods, "backward": True}, arrays)
    assert res.verdict == "fail" and res.details["named"] == ["decoder.layers.1.pre_mlp_layernorm"]
    (f,) = [f for f in res.findings if f.verdict == "fail"]
    assert f.metric == "bwd_own_rel_l2" and "gradient differs" in f.message
    assert "weight:decoder.layers.1.pre_mlp_layernorm.weight" in f.message
    rows = {r["module"]: r for r in res.details["per_module"]}
    assert rows["decoder.layers.1.pre_mlp_layernorm"]["own_verdict"] == "pass"
    assert rows["decoder.layers.0"]["bwd_own_verdict"] == "pass"
    assert rows["decoder.layers.1"]["bwd_worst"] == "weight:decoder.layers.1.weight"


# ---------------------------------------------------------------------------------------------------------
# Real frameworks: Megatron-core baseline with its module backward captured, MindFormers mcore candidate
# ---------------------------------------------------------------------------------------------------------

MODULES = ["decoder.layers.?", "decoder.layers.?.self_attention", "decoder.layers.?.mlp",
           "decoder.layers.?.input_layernorm", "decoder.layers.?.pre_mlp_layernorm"]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray], object]:
    """A 2-layer Megatron-core model's step 1 (forward and backward): the batch in the run store, and each
    layer's, attention's, MLP's and norm's inputs, output gradient and own gradients (the capture)."""
    pytest.importorskip("torch")
    pytest.importorskip("megatron.core")
    from tests.helpers.isolation_setup import megatron_baseline

    return megatron_baseline(tmp_path_factory.mktemp("isolation_bwd") / "baseline", modules=MODULES)


def test_capture_replays_each_module_exactly(baseline) -> None:
    """The baseline's replay reproduces each module's output bit for bit; its input gradient of a layer is the
    gradient the next layer sent back (no residual added: the layer's own VJP)."""
    from dumpers.mindspore_backward_isolation import backward_steps, read_backward

    store, _, _ = baseline
    assert backward_steps(store) == [1]
    meta, arrays = read_backward(store, 1)
    mods = {m["module"]: m for m in meta["modules"]}
    assert set(mods) >= {"decoder.layers.0", "decoder.layers.1.mlp", "decoder.layers.1.pre_mlp_layernorm"}
    assert all(m["replay_rel_l2"] == 0.0 for m in mods.values())
    assert [i["key"] for i in mods["decoder.layers.1"]["inputs"]] == ["hidden_states", "attention_mask",
                                                                     "rotary_pos_emb"]
    np.testing.assert_array_equal(arrays["grad_input/decoder.layers.1/hidden_states"],
                                  arrays["grad_output/decoder.layers.0"])
    assert mods["decoder.layers.1.mlp"]["params"] == ["decoder.layers.1.mlp.linear_fc1.weight",
                                                      "decoder.layers.1.mlp.linear_fc2.weight"]


def _isolate(baseline, tmp_path: Path, fault: bool, *extra: str) -> dict:
    pytest.importorskip("mindspore")
    pytest.importorskip("mindformers")
    from align.cli import main
    from tests.helpers.isolation_setup import candidate_files, run_isolate

    store, weights, model_spec = baseline
    yaml_path, ckpt = candidate_files(tmp_path, model_spec, weights)
    plant = None
    if fault:                    # the demo's norm_grad fault, planted in the model `align isolate` builds
        from demo.backward_fault import plant_norm_grad_fault as plant
    assert run_isolate(store, yaml_path, ckpt, tmp_path / "iso", *extra, plant=plant) == 0
    rep = tmp_path / "report"
    rc = main(["report", "-q", str(store), str(store), "--isolation", str(tmp_path / "iso"), "--out", str(rep)])
    summary = json.loads((rep / "summary.json").read_text())
    assert rc == (1 if summary["verdict"] == "fail" else 0)
    return summary


def test_backward_only_fault_is_named_by_its_own_backward_error(baseline, tmp_path: Path) -> None:
    """norm_grad: layer 1's pre-MLP norm computes its weight gradient without rstd. Its forward's own error
    passes; its weight gradient's own error fails; the layer around it fails too, and the norm is named."""
    summary = _isolate(baseline, tmp_path, True)
    stage = summary["stages"]["isolation"]
    rows = {r["module"]: r for r in stage["per_module"]}
    for r in stage["per_module"]:
        print(f"{r['module']:40s} fwd own {r['own_rel_l2']:.1e} {r['own_verdict']:4s} bwd own "
              f"{r.get('bwd_own_rel_l2', float('nan')):.1e} {r.get('bwd_own_verdict')} ({r.get('bwd_worst')}) "
              f"inherited {r.get('bwd_inherited_rel_l2', float('nan')):.1e}")
    assert stage["verdict"] == "fail" and stage["backward"] is True
    assert stage["named"] == ["decoder.layers.1.pre_mlp_layernorm"]
    norm = rows["decoder.layers.1.pre_mlp_layernorm"]
    assert norm["own_verdict"] == "pass" and norm["bwd_own_verdict"] == "fail"
    assert norm["bwd_worst"] == "weight:decoder.layers.1.pre_mlp_layernorm.weight"
    assert rows["decoder.layers.1"]["bwd_own_verdict"] == "fail"
    # its input gradient is right (the fault is in the weight gradient only)
    (dx,) = [g for g in norm["per_grad"] if g["what"].startswith("input:")]
    assert dx["own_verdict"] == "pass"
    for name in ("decoder.layers.0", "decoder.layers.1.mlp", "decoder.layers.1.self_attention"):
        assert rows[name]["own_verdict"] == "pass" and rows[name]["bwd_own_verdict"] == "pass", rows[name]
    (f,) = [f for f in summary["findings"] if f["stage"] == "isolation" and f["verdict"] == "fail"]
    assert f["metric"] == "bwd_own_rel_l2" and f["component"] == "decoder.layers.1.pre_mlp_layernorm"
    # the diagnosis says the exact next command: the repro folder of that module, from this isolation run
    (culprit,) = [d for d in summary["diagnosis"] if d["stage"] == "isolation"]
    assert (f"align repro {tmp_path / 'iso'} --module decoder.layers.1.pre_mlp_layernorm --candidate-yaml "
            in culprit["next"])


def test_next_names_a_module_and_its_layer_where_a_stage_names_a_parameter() -> None:
    """{module} / {layer} in a stage's ``next``: what `align isolate --modules` and `align repro --module` want,
    from a parameter, a tensor row or a module."""
    from align.procedure.diagnosis import layer_of, module_of

    assert module_of("decoder.layers.1.pre_mlp_layernorm.weight") == "decoder.layers.1.pre_mlp_layernorm"
    assert module_of("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight") == \
        "decoder.layers.0.self_attention.linear_qkv"
    assert module_of("decoder.layers.2.mlp forward.output.0") == "decoder.layers.2.mlp"
    assert module_of("decoder.layers.1.mlp") == "decoder.layers.1.mlp"
    assert layer_of("decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight") == "decoder.layers.1"
    assert layer_of("embedding.word_embeddings.weight") == "embedding"
    assert layer_of("decoder.final_layernorm.weight") == "decoder.final_layernorm"
    assert layer_of("output_layer.weight") == "output_layer"
    assert layer_of("mtp.layers.0.eh_proj.weight") == "mtp.layers.0"


def test_graph_isolation_of_a_correct_candidate_passes(baseline, tmp_path: Path) -> None:
    """Each module compiled (--graph): a correct candidate's gradients pass, module by module, and the
    layer's input gradient and every weight gradient are compared in the baseline's names."""
    summary = _isolate(baseline, tmp_path, False, "--graph", "--modules", "decoder.layers.1",
                       "--modules", "decoder.layers.1.mlp")
    stage = summary["stages"]["isolation"]
    assert stage["mode"] == "graph" and stage["verdict"] == "pass" and stage["named"] == []
    assert "PYNATIVE forward and backward of the whole network" in stage["inherited_inputs"]   # said, not hidden
    rows = {r["module"]: r for r in stage["per_module"]}
    whats = {g["what"] for g in rows["decoder.layers.1"]["per_grad"]}
    assert "input:hidden_states" in whats and "weight:decoder.layers.1.mlp.linear_fc1.weight" in whats
    assert len([w for w in whats if w.startswith("weight:")]) == 8
    assert rows["decoder.layers.1.mlp"]["bwd_own_rel_l2"] < 1e-5


def test_graph_needs_a_backward_capture_and_a_bad_capture_is_one_line(tmp_path: Path, capsys) -> None:
    """--graph on a store without a module backward capture, and an unreadable capture: exit 2, one line, before
    any model is built."""
    from align.cli import main
    from runstore import RunWriter

    with RunWriter(tmp_path / "b", rank=0, meta={"framework": "megatron-core"}) as w:
        w.put_array(1, "batch/tokens", np.zeros((1, 4), np.int64))
        w.log_scalars(1, {"loss": 1.0})
        w.finish_step()
    (tmp_path / "c.yaml").write_text("model: {model_config: {}}\n")
    argv = ["isolate", str(tmp_path / "b"), "--candidate-yaml", str(tmp_path / "c.yaml"), "--candidate-ckpt",
            str(tmp_path / "none.safetensors"), "--out", str(tmp_path / "o")]
    assert main([*argv, "--graph"]) == 2
    assert "--graph needs a module backward capture" in capsys.readouterr().err
    bad = tmp_path / "b" / "evidence" / "module_backward" / "step_000001_rank_00000.npz"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"not a zip")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "not a module backward capture" in err and "\n" not in err and not (tmp_path / "o").exists()


def test_mindformers_pynative_mla_gradient_bug_is_named_by_backward_isolation(tmp_path: Path) -> None:
    """The real bug DESIGN.md records: MindFormers' DeepSeek-V3 MLA in PYNATIVE (its one SplitWithSize shared by
    several splits) computes the loss right and the MLA projection gradients wrong. Forward isolation passes
    every module; backward isolation names both attentions by their own weight gradients; split per use (the
    demo's stand-in) every own error passes."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("megatron.core")
    pytest.importorskip("mindspore")
    pytest.importorskip("mindformers")
    from comparators.isolation import compare_isolation, read_isolation
    from demo import megatron_cpu as mg
    from demo import mindformers_mcore_cpu as mc
    from dumpers.megatron import MegatronDumper
    from dumpers.mindspore_backward_isolation import isolate_with_backward
    from dumpers.torch_dumper import DumpConfig
    from dumpers.torch_module_backward import ModuleBackwardCapture
    from mapping import TransformParams
    from models import load_mapping

    spec = mc.TinyModel(kind="mla", num_experts=0)
    mg.init_megatron_cpu(tp=1)
    model = mg.build_tiny_llama(mg.TinyLlamaConfig(**mc.megatron_config_kwargs(spec)), seed=5)
    store = tmp_path / "baseline"
    dumper = MegatronDumper(model, None, DumpConfig(out=store, tensor_steps=[1], local_norms=False))
    cap = ModuleBackwardCapture(model, store, ["decoder.layers.?", "decoder.layers.?.self_attention",
                                               "decoder.layers.?.mlp"], steps=[1])
    tb = mg.synthetic_batch(1, mg.TinyLlamaConfig(**mc.megatron_config_kwargs(spec)))
    dumper.begin_step(1)
    cap.begin_step(1)
    dumper.record_batch(tb)
    loss = mg.forward_loss(model, tb)
    loss.backward()
    cap.end_step()
    cap.close()
    dumper.end_step(loss=float(loss))
    dumper.close()
    m = load_mapping(mc.MCORE_PRESETS["mla"])
    params = TransformParams(num_heads=spec.num_attention_heads, num_query_groups=spec.num_attention_heads)
    state = {k: v.detach().numpy() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    weights, _ = m.convert({k: v for k, v in state.items() if not m.ignored(k, "baseline")}, "candidate", params)
    got = {}
    for fix in (False, True):
        mc.set_mcore_context("pynative", seed=0)
        try:
            net = mc.build_mcore_model(spec, "pynative", fix_pynative_split=fix)
            mc.load_parameter_arrays(net, weights)
            path = isolate_with_backward(net, store, tmp_path / f"iso_{fix}", mapping=m, params=params,
                                         forward=lambda n, b: mc.McoreReplayLoss(n)(*mc.mcore_inputs(b))[0])
        finally:
            mc.set_mcore_context("graph")
            mc.reset_mindformers_context()
        got[fix] = compare_isolation(*read_isolation(path))
    shipped, fixed = got[False], got[True]
    assert shipped.details["named"] == ["decoder.layers.0.self_attention", "decoder.layers.1.self_attention"]
    rows = {r["module"]: r for r in shipped.details["per_module"]}
    for layer in (0, 1):
        r = rows[f"decoder.layers.{layer}.self_attention"]
        assert r["own_verdict"] == "pass" and r["own_rel_l2"] < 1e-6            # the forward is right
        assert r["bwd_own_verdict"] == "fail" and "_proj.weight" in r["bwd_worst"]
    assert all(r["verdict"] == "pass" for r in shipped.details["per_module"] if r["module"].endswith(".mlp"))
    assert fixed.verdict == "pass" and max(r["bwd_own_rel_l2"] for r in fixed.details["per_module"]) < 1e-5
