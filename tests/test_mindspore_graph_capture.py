"""Layer statistics captured inside MindFormers' GRAPH-compiled training step (dumpers/mindspore_graph_capture.py):
the real mcore dense model, MindFormers' own training cell, GRAPH mode on CPU.

(1) capture on vs off: bit-identical losses and weights; (2) the captured statistics equal the PYNATIVE hooks'
capture of the same weights and batch (and numpy for the embedding output); (3) a weight scaled by 1.001 in one
linear is named by `align report` on two GRAPH run stores; (4) the same for DeepSeek-V3's MLA (capture on/off
bit-identical, a scaled linear_kv_up_proj named). One GRAPH compile per model (~10-20 s here).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")
pytest.importorskip("mindformers")
mc = pytest.importorskip("demo.mindformers_mcore_cpu")

from dumpers.mindspore_dumper import DumpConfig, MindSporeDumper  # noqa: E402
from runstore import RunReader  # noqa: E402

SPEC = mc.TinyModel()
CELLS = ("model.embedding.word_embeddings", "model.decoder.layers.*.input_layernorm",
         "model.decoder.layers.*.self_attention.linear_*", "model.decoder.layers.*.pre_mlp_layernorm",
         "model.decoder.layers.*.mlp.linear_fc*", "model.decoder.final_layernorm", "model.output_layer")
FAULT = "decoder.layers.1.mlp.linear_fc2.weight"
STEPS = 3


def _batch(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, SPEC.vocab_size, size=(SPEC.micro_batch_size, SPEC.seq_length + 1))
    mask = np.ones((SPEC.micro_batch_size, SPEC.seq_length), np.float32)
    mask[:, ::7] = 0
    return {"tokens": ids[:, :-1], "labels": ids[:, 1:], "loss_mask": mask}


def _weights(net) -> dict[str, np.ndarray]:
    return {k: v for k, v in mc.parameter_arrays(net).items() if "xf_" not in k}


def _load(net, arrays) -> None:
    params = {p.name: p for p in net.get_parameters()}
    for name, a in arrays.items():
        params[name].set_data(ms.Tensor(a))


def _train(cell, dumper, steps: int = STEPS) -> list[float]:
    losses = []
    for step in range(1, steps + 1):
        batch = _batch(step)
        if dumper is not None:
            dumper.begin_step(step)
        out = cell(*mc.mcore_inputs(batch))
        loss = float(out[0].asnumpy().reshape(-1)[0])
        losses.append(loss)
        if dumper is not None:
            dumper.end_step(loss=loss)
    return losses


def _captured_and_plain(spec, root: Path, cells, steps: str, off_dumper: bool = False):
    """The same model twice, built for GRAPH with the same weights: one captured in-graph (its dumper made
    before the training cell, so the wrapped cells are compiled), one plain (with a tensors='off' dumper when
    ``off_dumper``). Returns (initial weights, (net, cell, dumper), (net, cell, dumper or None))."""
    cap_net = mc.build_mcore_model(spec, "graph", seed=0)
    w0 = _weights(cap_net)
    dumper = MindSporeDumper(cap_net, root / "on", DumpConfig(tensors="stats", cells=cells, steps=steps),
                             graph_capture=True)
    cap_cell = mc.build_mcore_train_cell(cap_net, learning_rate=1e-2)
    plain_net = mc.build_mcore_model(spec, "graph", seed=0)
    _load(plain_net, w0)
    off = (MindSporeDumper(plain_net, root / "off", DumpConfig(tensors="off"), graph_capture=True)
           if off_dumper else None)
    plain_cell = mc.build_mcore_train_cell(plain_net, learning_rate=1e-2)
    return w0, (cap_net, cap_cell, dumper), (plain_net, plain_cell, off)


@pytest.fixture(scope="module")
def graph_models(tmp_path_factory):
    """The same model twice in GRAPH: captured (tensors='stats', in-graph) and plain (tensors='off')."""
    mc.set_mcore_context("graph", seed=0)
    root = tmp_path_factory.mktemp("graphcap")
    w0, cap, plain = _captured_and_plain(SPEC, root, CELLS, "1-2", off_dumper=True)
    yield {"root": root, "w0": w0, "cap": cap, "plain": plain}
    mc.reset_mindformers_context()


def test_capture_on_and_off_train_bit_identically(graph_models) -> None:
    cap_net, cap_cell, dumper = graph_models["cap"]
    plain_net, plain_cell, off = graph_models["plain"]
    assert not any("xf_" in p.name for p in plain_net.get_parameters())   # off: no graph change
    assert sorted(_weights(cap_net)) == sorted(graph_models["w0"])                         # names kept
    assert [p.name for p in cap_net.trainable_params()] == [p.name for p in plain_net.trainable_params()]
    on_losses = _train(cap_cell, dumper)
    off_losses = _train(plain_cell, off)
    dumper.close()
    off.close()
    assert on_losses == off_losses
    a, b = _weights(cap_net), _weights(plain_net)
    for name in a:
        assert np.array_equal(a[name], b[name]), name
    reader = RunReader(graph_models["root"] / "on")
    assert reader.meta["layer_capture"]["mode"] == "GRAPH" and "bprop" in reader.meta["layer_capture"]["mechanism"]
    assert reader.array_steps() == [1, 2]
    table = reader.step_arrays(1).table("tensor_stats")
    mods = set(table.module)
    assert {"model.decoder.layers.1.mlp.linear_fc2", "model.output_layer"} <= mods
    assert "model.decoder.layers.0.self_attention.linear_qkv" in mods
    kinds = set(table.kind)
    assert {"forward.output.0", "backward.grad_output.0"} <= kinds
    assert "layer_capture" not in RunReader(graph_models["root"] / "off").meta


def _store_rows(path: Path, step: int = 1) -> dict[tuple[str, str], dict]:
    t = RunReader(path).step_arrays(step).table("tensor_stats")
    rows = {}
    for i in range(len(t)):
        r = {k: t[k].iloc[i] for k in ("module", "kind", "shape", "max", "min", "mean", "norm", "nan", "inf")}
        rows.setdefault((r["module"], r["kind"]), r)
    return rows


def test_planted_fault_named_by_layer_tensors_from_graph_stats(graph_models) -> None:
    from align.cli import main

    cap_net, cap_cell, _ = graph_models["cap"]
    root, w0 = graph_models["root"], graph_models["w0"]
    for label, scale in (("base", 1.0), ("cand", 1.001)):
        w = dict(w0)
        w[FAULT] = (w0[FAULT] * np.float32(scale)).astype(np.float32)
        _load(cap_net, w)
        d = MindSporeDumper(cap_net, root / label, DumpConfig(tensors="stats", cells=CELLS), graph_capture=True)
        _train(cap_cell, d, steps=1)
        d.close()
    out = root / "report"
    assert main(["report", "-q", str(root / "base"), str(root / "cand"), "--out", str(out),
                 "--mapping", "megatron_core__mindformers_mcore_dense"]) in (0, 1)
    s = json.loads((out / "summary.json").read_text())
    st = s["stages"]["layer_tensors"]
    assert st["verdict"] in ("warn", "fail"), st
    first = [f for f in s["findings"] if f["stage"] == "layer_tensors" and "first departing forward" in f["message"]]
    assert first and first[0]["component"] == "model.decoder.layers.1.mlp.linear_fc2", first


def test_graph_stats_equal_pynative_hooks_and_numpy(graph_models) -> None:
    """Step 1 from the same weights and batch: GRAPH statistics (float32, in the graph) against the PYNATIVE
    hooks (float64 on host) row by row, and the embedding output against numpy."""
    root, w0 = graph_models["root"], graph_models["w0"]
    graph_rows = _store_rows(root / "base")          # written by the fault test: step 1 from w0, clean
    mc.set_mcore_context("pynative", seed=0)
    try:
        net = mc.build_mcore_model(SPEC, "pynative", seed=0)
        _load(net, w0)
        d = MindSporeDumper(net, root / "pynative", DumpConfig(tensors="stats", cells=CELLS))
        _train(mc.build_mcore_train_cell(net, learning_rate=1e-2), d, steps=1)
        d.close()
    finally:
        mc.set_mcore_context("graph")
    assert RunReader(root / "pynative").meta["layer_capture"]["mode"] == "PYNATIVE"
    py_rows = _store_rows(root / "pynative")
    common = sorted(set(graph_rows) & set(py_rows))
    assert len(common) == len(graph_rows) == 2 * 15, (len(common), len(graph_rows))   # 15 cells: out + grad
    for key in common:
        g, p = graph_rows[key], py_rows[key]
        assert g["shape"] == p["shape"], key
        assert (g["nan"], g["inf"]) == (p["nan"], p["inf"]) == (0, 0), key
        scale = max(abs(p["max"]), abs(p["min"]))
        for col in ("max", "min", "mean"):
            assert abs(g[col] - p[col]) <= 1e-5 * scale + 1e-12, (key, col, g[col], p[col])
        assert g["norm"] == pytest.approx(p["norm"], rel=1e-5), key
    emb = w0["embedding.word_embeddings.weight"][_batch(1)["tokens"]].astype(np.float64)
    g = graph_rows[("model.embedding.word_embeddings", "forward.output.0")]
    assert g["max"] == emb.max() and g["min"] == emb.min()
    assert g["mean"] == pytest.approx(emb.mean(), rel=1e-5, abs=1e-7)
    assert g["norm"] == pytest.approx(np.sqrt((emb * emb).sum()), rel=1e-6)


# DeepSeek-V3's MLA (TrainingDeepseekV3ForCausalLM, dense MLPs: MLA without MoE compiles in ~10 s here). The
# q/kv projections are watched, linear_proj is not: rows come in cell definition order, and MindFormers defines
# linear_proj before the q/kv projections, so a departure downstream of it would be listed first.
MLA_SPEC = mc.TinyModel(kind="mla", num_experts=0)
MLA_CELLS = ("model.embedding.word_embeddings", "model.decoder.layers.*.input_layernorm",
             "model.decoder.layers.*.self_attention.linear_q_down_proj",
             "model.decoder.layers.*.self_attention.linear_q_up_proj",
             "model.decoder.layers.*.self_attention.linear_kv_down_proj",
             "model.decoder.layers.*.self_attention.linear_kv_up_proj", "model.decoder.layers.*.self_attention",
             "model.decoder.layers.*.mlp", "model.output_layer")
MLA_FAULT = "decoder.layers.1.self_attention.linear_kv_up_proj.weight"


def test_mla_graph_capture_is_bit_identical_and_names_a_planted_fault(tmp_path: Path) -> None:
    """The MLA model in GRAPH: capture on vs off train bit-identically (2 steps), and a 1.001 scale of layer 1's
    linear_kv_up_proj weight is named by `align report` from the GRAPH statistics alone."""
    from align.cli import main

    mc.set_mcore_context("graph", seed=0)
    try:
        w0, (cap_net, cap_cell, dumper), (plain_net, plain_cell, _) = _captured_and_plain(
            MLA_SPEC, tmp_path, MLA_CELLS, "1")
        assert _train(cap_cell, dumper, steps=2) == _train(plain_cell, None, steps=2)
        dumper.close()
        a, b = _weights(cap_net), _weights(plain_net)
        assert sorted(a) == sorted(w0)
        for name in a:
            assert np.array_equal(a[name], b[name]), name
        reader = RunReader(tmp_path / "on")
        assert reader.meta["layer_capture"]["mode"] == "GRAPH"
        table = reader.step_arrays(1).table("tensor_stats")
        assert {"model.decoder.layers.0.self_attention.linear_kv_up_proj",
                "model.decoder.layers.1.self_attention.linear_q_down_proj"} <= set(table.module)
        assert {"forward.output.0", "backward.grad_output.0"} <= set(table.kind)
        assert int(table["nan"].sum()) == 0 and int(table["inf"].sum()) == 0
        for label, scale in (("base", 1.0), ("cand", 1.001)):
            w = dict(w0)
            w[MLA_FAULT] = (w0[MLA_FAULT] * np.float32(scale)).astype(np.float32)
            _load(cap_net, w)
            d = MindSporeDumper(cap_net, tmp_path / label, DumpConfig(tensors="stats", cells=MLA_CELLS),
                                graph_capture=True)
            _train(cap_cell, d, steps=1)
            d.close()
    finally:
        mc.reset_mindformers_context()
    out = tmp_path / "report"
    assert main(["report", "-q", str(tmp_path / "base"), str(tmp_path / "cand"), "--out", str(out),
                 "--mapping", "megatron_core__mindformers_mcore_mla"]) in (0, 1)
    s = json.loads((out / "summary.json").read_text())
    assert s["stages"]["layer_tensors"]["verdict"] in ("warn", "fail"), s["stages"]["layer_tensors"]
    first = [f for f in s["findings"] if f["stage"] == "layer_tensors" and "first departing forward" in f["message"]]
    assert first and first[0]["component"] == "model.decoder.layers.1.self_attention.linear_kv_up_proj", first


def test_moe_parameter_names_survive_the_first_graph_compile(tmp_path: Path) -> None:
    """The first GRAPH compile renames the Parameters a graph assigns to (the routers' fi_accu / expert_bias /
    expert_load) by their cell path, through the capture's wrappers (``...mlp.inner.router.fi_accu``): after a
    captured step every Parameter of the model has the name it has after a plain GRAPH step, so a checkpoint
    saved from the run has a plain run's names."""
    spec = mc.TinyModel(kind="moe")
    mc.set_mcore_context("graph", seed=0)
    try:
        names = {}
        for label in ("plain", "captured"):
            net = mc.build_mcore_model(spec, "graph", seed=0)
            d = MindSporeDumper(net.model, tmp_path / label, DumpConfig(
                tensors="stats", cells=["decoder.layers.*.mlp"], routing=True), graph_capture=True) \
                if label == "captured" else None
            _train(mc.build_mcore_train_cell(net), d, steps=1)
            names[label] = sorted(p.name for p in net.get_parameters() if "xf_" not in p.name)
            if d is not None:
                d.close()
    finally:
        mc.reset_mindformers_context()
    assert any("router.fi_accu" in n for n in names["plain"])
    assert names["captured"] == names["plain"]
