"""Isolation and repro on the demo faults that live in the embedding and in the loss (issue 39).

A Megatron-core baseline (2 layers) whose step-1 module backward capture holds the embedding, every layer
module, the output layer and the loss (a function on Megatron's side: its logits, labels and loss_mask); the
MindFormers mcore candidate built by `align isolate`, clean or with the demo's embedding_fp16 (the embedding's
output rounded to float16) or log_softmax_bf16 (the loss's log-softmax in bfloat16) planted. Each module is
judged at the precision it computes in: the embedding and the loss at float32 (their float16 / bfloat16 is the
fault), the attention's modules at float16 (MindFormers' flash attention). The clean candidate names nothing;
each fault names its module alone, and the repro folder's two scripts show the reported difference.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

MODULES = ["embedding", "loss", "output_layer", "decoder.final_layernorm", "decoder.layers.?", "decoder.layers.?.*"]


def _embedding_fp16(net: Any) -> None:
    """The demo's embedding_fp16, as demo/mindformers_runner.build_mcore_net plants it."""
    import mindspore as ms

    emb = net.model.embedding.word_embeddings
    inner = emb.construct

    def low_precision(*args: Any, **kwargs: Any) -> Any:
        return inner(*args, **kwargs).astype(ms.float16).astype(ms.float32)

    emb.construct = low_precision


def _log_softmax_bf16(net: Any) -> None:
    from demo.mindformers_runner import bf16_log_softmax

    bf16_log_softmax(net.model.loss)


PLANTS = {"clean": None, "embedding_fp16": _embedding_fp16, "log_softmax_bf16": _log_softmax_bf16}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The baseline store, the candidate YAML and, per candidate, its isolation run and the report's stage."""
    pytest.importorskip("torch")
    pytest.importorskip("megatron.core")
    pytest.importorskip("mindspore")
    pytest.importorskip("mindformers")
    from align.cli import main
    from tests.helpers.isolation_setup import candidate_files, megatron_baseline, run_isolate

    tmp = tmp_path_factory.mktemp("isolation_faults")
    store, weights, spec = megatron_baseline(tmp / "baseline", modules=MODULES)
    yaml_path, ckpt = candidate_files(tmp, spec, weights)
    out: dict[str, Any] = {"store": store, "yaml": yaml_path}
    for name, plant in PLANTS.items():
        assert run_isolate(store, yaml_path, ckpt, tmp / f"iso_{name}", plant=plant) == 0
        rc = main(["report", "-q", str(store), str(store), "--isolation", str(tmp / f"iso_{name}"),
                   "--out", str(tmp / f"report_{name}")])
        summary = json.loads((tmp / f"report_{name}" / "summary.json").read_text())
        assert rc == (1 if summary["verdict"] == "fail" else 0)
        stage = summary["stages"]["isolation"]
        out[name] = {"iso": tmp / f"iso_{name}", "stage": stage,
                     "rows": {r["module"]: r for r in stage["per_module"]}}
    return out


def test_the_loss_is_captured_as_a_module_of_the_baseline(runs) -> None:
    """Megatron's loss function, captured by name: logits [s, b, v], labels and loss_mask [b, s]; its replay
    (Megatron's own cross-entropy, masked mean) gives the step's logits gradient with output gradient 1."""
    from dumpers.mindspore_backward_isolation import read_backward

    meta, arrays = read_backward(runs["store"], 1)
    (loss,) = [m for m in meta["modules"] if m["module"] == "loss"]
    assert [i["key"] for i in loss["inputs"]] == ["logits", "labels", "loss_mask"]
    assert loss["grad_scale"] == pytest.approx(1.0, rel=1e-6) and loss["replay_rel_l2"] < 1e-6
    s, b, v = arrays["input/loss/logits"].shape
    assert arrays["input/loss/labels"].shape == (b, s) and arrays["output/loss"].shape == ()
    np.testing.assert_array_equal(arrays["input/loss/logits"], arrays["output/output_layer"])


def test_a_clean_candidate_names_nothing_each_module_at_its_own_precision(runs) -> None:
    stage, rows = runs["clean"]["stage"], runs["clean"]["rows"]
    assert stage["verdict"] == "pass" and stage["named"] == []
    assert {"embedding", "loss", "output_layer", "decoder.layers.1.mlp"} <= set(rows)
    for name in ("embedding", "loss", "output_layer", "decoder.layers.0.mlp", "decoder.layers.0.input_layernorm",
                 "decoder.layers.0.self_attention.linear_proj"):
        assert rows[name]["judged_dtype"] == "float32", rows[name]
        assert rows[name]["own_verdict"] == "pass" and rows[name]["bwd_own_verdict"] == "pass", rows[name]
    for name in ("decoder.layers.0", "decoder.layers.1.self_attention"):      # flash attention inside
        assert rows[name]["judged_dtype"] == "float16"


@pytest.mark.parametrize("fault, module, cand_dtype", [("embedding_fp16", "embedding", "float16"),
                                                       ("log_softmax_bf16", "loss", "bfloat16")])
def test_the_fault_is_named_by_its_own_error_and_its_repro_shows_it(runs, tmp_path: Path, fault: str, module: str,
                                                                     cand_dtype: str) -> None:
    """The faulty module is named alone, judged at float32; `align repro` writes its folder with the candidate's
    precision measured, and each script, in a fresh process, recomputes its own side and shows the reported
    difference to the other's, forward and gradient."""
    from align.cli import main
    from tests.helpers.isolation_setup import run_repro_script

    stage, rows = runs[fault]["stage"], runs[fault]["rows"]
    assert stage["named"] == [module], stage["named"]
    r = rows[module]
    assert r["judged_dtype"] == "float32" and r["own_verdict"] != "pass" and r["own_rel_l2"] > 1e-4
    others = [n for n, x in rows.items() if n != module and x["verdict"] != "pass"]
    assert others == [], others
    out = tmp_path / "repro"
    assert main(["repro", str(runs[fault]["iso"]), "--module", module, "--candidate-yaml", str(runs["yaml"]),
                 "--out", str(out)]) == 0
    case = json.loads((out / "case.json").read_text())
    assert case["kind"] == module and case["settings"]["candidate"]["dtype"] == cand_dtype
    assert case["settings"]["baseline"]["dtype"] == "float32"
    torch_run, ms_run = run_repro_script(out / "repro_torch.py"), run_repro_script(out / "repro_mindspore.py")
    assert torch_run["output | the baseline's saved output (itself)"] < 1e-6
    assert ms_run["output | the candidate's saved output (itself)"] < 1e-6
    assert torch_run["output | the candidate's saved output"] == pytest.approx(r["own_rel_l2"], rel=1e-2)
    assert ms_run["output | the baseline's saved output"] == pytest.approx(r["own_rel_l2"], rel=1e-2)
    (grad,) = case["grads"].values()
    assert ms_run[f"d {next(iter(case['grads']))} | the baseline's saved gradient"] == pytest.approx(
        grad["report_own_rel_l2"], rel=1e-2)
