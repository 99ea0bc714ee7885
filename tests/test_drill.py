"""Operator drill-down (issue 39 item 2, `align drill`): inside one module, the operator whose own or semantic
error accounts for the module's difference.

The comparator on small numpy operators first; then the real thing: a tiny Megatron-core baseline's step 1
(module backward capture, then each module traced at aten level by dumpers.torch_op_trace) against the
MindFormers mcore candidate's real cell compiled under MindSpore's kernel dump, for the demo faults that live in
one module (norm_eps, qk_swap, embedding_fp16, log_softmax_bf16, norm_grad) and a clean attention. Each drill's
time is printed (`pytest -s`); nothing asserts on it.

The hooks below plant embedding_fp16 and log_softmax_bf16 as the demo does (demo/mindformers_runner.py), in a
form MindSpore's GRAPH parser takes (a subclass's construct, not a closure): the candidate's cell is compiled.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from comparators.operators import Op, drill, layout_rel


def _op(side: str, i: int, kind: str, ins: list, out: np.ndarray, phase: str = "forward", dtype: str = "float32",
        **params) -> Op:
    return Op(side, i, f"{kind}-{i}", kind, phase, [(str(j), v) for j, v in enumerate(ins)], [out], dtype, params)


def _norm_ops(side: str, x: np.ndarray, eps: float) -> list[Op]:
    """x * rsqrt(mean(x^2) + eps) as both sides spell it (aten names / MindSpore kernel types)."""
    sq = (x * x).astype(np.float32)
    ms = sq.mean(-1, keepdims=True).astype(np.float32)
    add = (ms + np.float32(eps)).astype(np.float32)
    r = (1 / np.sqrt(add)).astype(np.float32)
    y = (x * r).astype(np.float32)
    if side == "baseline":
        return [_op(side, 0, "pow", [x, 2], sq), _op(side, 1, "mean", [sq], ms, dim=[-1], keepdim=True),
                _op(side, 2, "add", [ms, eps], add), _op(side, 3, "rsqrt", [add], r), _op(side, 4, "mul", [x, r], y)]
    return [_op(side, 0, "Square", [x], sq), _op(side, 1, "ReduceMean", [sq, np.array([-1]), np.array(True)], ms),
            _op(side, 2, "Add", [ms, np.array(eps, np.float32)], add), _op(side, 3, "Rsqrt", [add], r),
            _op(side, 4, "Mul", [x, r], y)]


def test_a_wrong_constant_is_named_where_it_enters_and_a_clean_pair_names_nothing() -> None:
    x = np.random.default_rng(0).standard_normal((4, 3, 8)).astype(np.float32) * 0.05
    base = _norm_ops("baseline", x, 1e-5)
    clean = drill(base, _norm_ops("candidate", x, 1e-5), terminals=[base[-1].outs[0]])
    assert clean["named"] == [] and not clean["module_differs"]
    assert all(r["own_verdict"] in ("pass", None) for r in clean["rows"])
    bad = drill(base, _norm_ops("candidate", x, 1e-2))
    (named,) = bad["named"]
    assert named["op"] == "Add-2" and "a constant 0.01" in named["why"] and named["own_verdict"] == "pass"
    assert bad["module_differs"] and named["own_line"] == 64 * 2.0 ** -23


def test_an_operator_that_rounds_is_named_by_its_own_error() -> None:
    """A float16 round trip inside a float32 module: its own error is 2^13 float32 epsilons."""
    x = np.random.default_rng(1).standard_normal((16, 8)).astype(np.float32)
    w = np.random.default_rng(2).standard_normal((8, 8)).astype(np.float32)
    y = x @ w
    base = [_op("baseline", 0, "mm", [x, w], y)]
    half = y.astype(np.float16).astype(np.float32)
    cand = [_op("candidate", 0, "MatMul", [x, w], y), _op("candidate", 1, "Cast", [y], half, dtype="float16")]
    res = drill(base, cand)
    (named,) = res["named"]
    assert named["op"] == "Cast-1" and named["own_verdict"] == "fail" and 1e-4 < named["own_error"] < 1e-3


def test_layouts_match_up_to_reshape_and_axis_order() -> None:
    a = np.random.default_rng(3).standard_normal((2, 4, 3)).astype(np.float32)
    assert layout_rel(np.swapaxes(a, 0, 1).reshape(8, 3), a) == 0.0
    assert layout_rel(a[:, ::-1], a) > 0.1          # values in another order are not a layout


# ---------------------------------------------------------------------------------------------------------
# Real frameworks
# ---------------------------------------------------------------------------------------------------------

MODULES = ["embedding", "loss", "decoder.layers.?.self_attention", "decoder.layers.?.input_layernorm",
           "decoder.layers.?.pre_mlp_layernorm"]


def plant_embedding_fp16(net) -> None:  # noqa: ANN001 - a MindSpore cell (--candidate-hook)
    """The embedding_fp16 fault: the word embedding's output rounded through float16."""
    import mindspore as ms

    emb = next(c for n, c in net.cells_and_names() if n.endswith("embedding.word_embeddings"))

    class Fp16Embedding(type(emb)):
        def construct(self, input_ids):  # noqa: ANN001, ANN202
            return super().construct(input_ids).astype(ms.float16).astype(ms.float32)

    emb.__class__ = Fp16Embedding


def plant_log_softmax_bf16(net) -> None:  # noqa: ANN001 - a MindSpore cell (--candidate-hook)
    """The log_softmax_bf16 fault: the cross-entropy's log-softmax takes and returns bfloat16-rounded values."""
    import mindspore as ms

    cell = next(c for n, c in net.cells_and_names() if n.endswith("loss._log_softmax"))

    class Bf16LogSoftmax(type(cell)):
        def construct(self, logits, label):  # noqa: ANN001, ANN202
            log_probs, one_hot = super().construct(logits.astype(ms.bfloat16).astype(ms.float32), label)
            return log_probs.astype(ms.bfloat16).astype(ms.float32), one_hot

    cell.__class__ = Bf16LogSoftmax


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The baseline store (capture + operator trace of MODULES) and the candidate's YAML / weights, clean and
    with the norm_eps and qk_swap faults."""
    pytest.importorskip("torch")
    pytest.importorskip("megatron.core")
    pytest.importorskip("mindspore")
    pytest.importorskip("mindformers")
    from dataclasses import replace

    from demo import megatron_cpu as mg
    from demo.mindformers_runner import _qk_swap_rows
    from demo.model import megatron_config_kwargs
    from dumpers.torch_op_trace import trace_modules
    from tests.helpers.isolation_setup import candidate_files, megatron_baseline

    root = tmp_path_factory.mktemp("drill")
    store, weights, spec = megatron_baseline(root / "baseline", modules=MODULES)
    # the trace runs the real modules; a model of the same build (the captured weights are swapped in)
    model = mg.build_tiny_llama(mg.TinyLlamaConfig(**megatron_config_kwargs(spec)), seed=11)
    t0 = time.perf_counter()
    trace_modules(model, store, 1)
    print(f"baseline operator trace of {len(MODULES)} module patterns: {time.perf_counter() - t0:.1f} s")
    files = {}
    for name, kw in (("clean", {}),
                     ("norm_eps", {"yaml_edit": lambda c: c["model"]["model_config"].update(rms_norm_eps=1e-2)}),
                     ("qk_swap", {"weights_edit": lambda w: w.update({
                         k: _qk_swap_rows(v, num_heads=spec.num_attention_heads,
                                          num_query_groups=spec.num_query_groups, head_dim=spec.head_dim)
                         for k, v in w.items() if k.endswith("self_attention.linear_qkv.weight")})})):
        (root / name).mkdir()
        files[name] = candidate_files(root / name, replace(spec), weights, **kw)
    return {"store": store, "files": files, "root": root}


def _drill(pair: dict, module: str, case: str, *extra: str, monkeypatch: pytest.MonkeyPatch) -> tuple[int, dict]:
    from align.cli import main

    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))     # the hooks of this file
    yaml_path, ckpt = pair["files"]["norm_eps" if case == "norm_eps" else "qk_swap" if case == "qk_swap"
                                    else "clean"]
    out = pair["root"] / f"drill_{case}_{module}"
    t0 = time.perf_counter()
    rc = main(["drill", str(pair["store"]), "--module", module, "--candidate-yaml", str(yaml_path),
               "--candidate-ckpt", str(ckpt), "--out", str(out), *extra])
    result = json.loads((out / "drill.json").read_text()) if rc in (0, 1) else {}
    print(f"drill {case} {module}: exit {rc} in {time.perf_counter() - t0:.1f} s "
          f"{[(n['op'], n['why'][:40]) for n in result.get('named', [])]}")
    if rc in (0, 1):
        rows = (out / "operators.csv").read_text().splitlines()
        assert rows[0].startswith("side,index,op,kind,phase,dtype") and len(rows) > 1
        assert rc == (1 if result["verdict"] == "fail" else 0)
    return rc, result


def test_clean_attention_names_nothing(pair: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real attention (GQA, q/k norm, RoPE, the float16 q/k/v cast MindFormers' attention makes by design:
    judged at float16) against Megatron's: every result passes, no operator is named."""
    rc, res = _drill(pair, "decoder.layers.0.self_attention", "clean", monkeypatch=monkeypatch)
    assert rc == 0 and res["named"] == [] and res["dtype"] == "float16"
    assert {r["result"] for r in res["results"]} >= {"output", "grad_input/hidden_states"}
    assert res["counts"]["matched"] > 0.8 * res["counts"]["candidate"]


def test_norm_eps_names_the_epsilon_add(pair: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    rc, res = _drill(pair, "decoder.layers.0.input_layernorm", "norm_eps", monkeypatch=monkeypatch)
    assert rc == 1
    first = res["named"][0]
    assert first["kind"] == "Add" and first["phase"] == "forward" and "a constant 0.01" in first["why"]


def test_qk_swap_names_the_qkv_projection(pair: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """The q/k rows permuted in conversion: the projection reads a weight that is the baseline's values in
    another order."""
    rc, res = _drill(pair, "decoder.layers.0.self_attention", "qk_swap", monkeypatch=monkeypatch)
    assert rc == 1
    first = res["named"][0]
    assert first["kind"] == "MatMul" and first["phase"] == "forward" and "another order" in first["why"]


def test_embedding_fp16_names_the_cast(pair: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    rc, res = _drill(pair, "embedding", "clean", "--candidate-hook", "test_drill:plant_embedding_fp16",
                     monkeypatch=monkeypatch)
    assert rc == 1
    first = res["named"][0]
    assert first["kind"] == "Cast" and first["dtype"] == "float16" and first["own_verdict"] == "fail"


def test_log_softmax_bf16_names_the_cast_in_the_loss(pair: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    rc, res = _drill(pair, "loss", "clean", "--candidate-hook", "test_drill:plant_log_softmax_bf16",
                     monkeypatch=monkeypatch)
    assert rc == 1
    assert all(n["kind"] == "Cast" and n["dtype"] == "bfloat16" for n in res["named"]) and res["named"]


def test_norm_grad_is_named_in_the_backward(pair: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """A norm whose forward is right and whose weight gradient forgets rstd: the reduction that makes the weight
    gradient reads the baseline's values and sums something the baseline never sums."""
    rc, res = _drill(pair, "decoder.layers.1.pre_mlp_layernorm", "clean", "--candidate-hook",
                     "demo.backward_fault:plant_norm_grad_fault", monkeypatch=monkeypatch)
    assert rc == 1
    assert [r["verdict"] for r in res["results"] if r["result"] == "output"] == ["pass"]
    first = res["named"][0]
    assert first["kind"] == "ReduceSum" and first["phase"] == "backward"


def test_bad_input_is_one_line(pair: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A module that was not traced, and a store without a trace: exit 2, one line, nothing written."""
    from align.cli import main

    yaml_path, ckpt = pair["files"]["clean"]
    argv = ["--candidate-yaml", str(yaml_path), "--candidate-ckpt", str(ckpt), "--out", str(tmp_path / "o")]
    assert main(["drill", str(pair["store"]), "--module", "decoder.layers.0.mlp", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "was not traced" in err and "\n" not in err
    (tmp_path / "empty").mkdir()
    assert main(["drill", str(tmp_path / "empty"), "--module", "embedding", *argv]) == 2
    assert "no operator trace" in capsys.readouterr().err and not (tmp_path / "o").exists()
