"""`align repro` (issue 39 item 3): a self-contained folder for one isolated module whose two scripts, run in
fresh processes without this project on the path, reproduce the report's difference.

A Megatron-core baseline (2 layers, its step-1 module backward captured, its config recorded) and the
MindFormers mcore candidate with the demo's norm_eps fault (rms_norm_eps 1e-2 instead of 1e-5): `align
isolate` names the norms and the attention (its q/k norms take the epsilon too), `align repro` writes the folder
of layer 0's input norm, of its attention, and of layer 1's MLP (a module that computes alike: the scripts show
no difference there).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

MODULES = ["decoder.layers.?.mlp", "decoder.layers.?.input_layernorm", "decoder.layers.?.self_attention"]


@pytest.fixture(scope="module")
def isolated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    """(isolation run, candidate YAML, the report's summary) of the norm_eps candidate."""
    pytest.importorskip("torch")
    pytest.importorskip("megatron.core")
    pytest.importorskip("mindspore")
    pytest.importorskip("mindformers")
    from align.cli import main
    from demo.model import demo_model
    from tests.helpers.isolation_setup import candidate_files, megatron_baseline, run_isolate

    tmp = tmp_path_factory.mktemp("repro")
    meta = {"config": {"kind": "megatron_args", "values": {"normalization": "RMSNorm",
                                                           "norm_epsilon": demo_model().rms_norm_eps}}}
    store, weights, spec = megatron_baseline(tmp / "baseline", seed=5, modules=MODULES, meta=meta)

    def norm_eps(cfg: dict) -> None:
        cfg["model"]["model_config"]["rms_norm_eps"] = 1e-2          # the norm_eps fault

    yaml_path, ckpt = candidate_files(tmp, spec, weights, yaml_edit=norm_eps)
    assert run_isolate(store, yaml_path, ckpt, tmp / "iso") == 0
    assert main(["report", "-q", str(store), str(store), "--isolation", str(tmp / "iso"),
                 "--out", str(tmp / "report")]) == 1
    return tmp / "iso", yaml_path, json.loads((tmp / "report" / "summary.json").read_text())


def _run(script: Path) -> dict[str, float]:
    from tests.helpers.isolation_setup import run_repro_script

    return run_repro_script(script)


def test_the_two_scripts_reproduce_the_reported_difference(isolated, tmp_path: Path) -> None:
    from align.cli import main

    iso, yaml_path, summary = isolated
    stage = summary["stages"]["isolation"]
    rows = {r["module"]: r for r in stage["per_module"]}
    mod = "decoder.layers.0.input_layernorm"
    assert mod in stage["named"] and rows[mod]["own_verdict"] == "fail"
    reported = rows[mod]["own_rel_l2"]
    out = tmp_path / "norm"
    assert main(["repro", str(iso), "--module", mod, "--candidate-yaml", str(yaml_path), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "case.json", "grads", "inputs", "outputs",
                                                      "repro_mindspore.py", "repro_torch.py", "weights"]
    assert len((out / "README.md").read_text().splitlines()) == 3
    case = json.loads((out / "case.json").read_text())
    assert case["kind"] == "norm" and case["settings"]["baseline"]["eps"] == 1e-5
    assert case["settings"]["candidate"]["eps"] == 1e-2
    for script in ("repro_torch.py", "repro_mindspore.py"):   # numpy and one framework, nothing of ours
        imports = set(re.findall(r"^(?:import|from) (\w+)", (out / script).read_text(), re.M))
        assert imports <= {"json", "pathlib", "numpy", "torch", "mindspore"}, imports
    torch_run, ms_run = _run(out / "repro_torch.py"), _run(out / "repro_mindspore.py")
    print(torch_run, ms_run, reported)
    # each side recomputes its own saved output, and differs from the other's by what the report said
    assert torch_run["output | the baseline's saved output (itself)"] < 1e-6
    assert ms_run["output | the candidate's saved output (itself)"] < 1e-6
    assert torch_run["output | the candidate's saved output"] == pytest.approx(reported, rel=1e-3)
    assert ms_run["output | the baseline's saved output"] == pytest.approx(reported, rel=1e-3)
    # the weight gradient (fed the baseline's output gradient) departs as the report's backward row does
    wgrad = [g for g in rows[mod]["per_grad"] if g["what"].startswith("weight:")][0]["own_rel_l2"]
    assert ms_run["d weight | the baseline's saved gradient"] == pytest.approx(wgrad, rel=1e-2)


def test_a_module_that_computes_alike_shows_no_difference_and_bad_input_is_one_line(isolated, tmp_path: Path,
                                                                                     capsys) -> None:
    from align.cli import main

    iso, yaml_path, summary = isolated
    out = tmp_path / "mlp"
    assert main(["repro", str(iso), "--module", "decoder.layers.1.mlp", "--candidate-yaml", str(yaml_path),
                 "--out", str(out)]) == 0
    case = json.loads((out / "case.json").read_text())
    assert case["kind"] == "mlp" and set(case["weights"]["candidate"]) == {"fc1", "fc2"}
    # the candidate's fc1 (MindFormers interleaves gate/up rows) is back in the baseline's [gate; up] layout
    np.testing.assert_array_equal(np.load(out / "weights/candidate/fc1.npy"), np.load(out / "weights/baseline/fc1.npy"))
    ms_run = _run(out / "repro_mindspore.py")
    assert ms_run["output | the baseline's saved output"] < 1e-5
    capsys.readouterr()
    assert main(["repro", str(iso), "--module", "decoder.layers.7.mlp", "--candidate-yaml", str(yaml_path),
                 "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert "was not isolated" in err and "\n" not in err and not (tmp_path / "x").exists()
    (tmp_path / "empty").mkdir()
    assert main(["repro", str(tmp_path / "empty"), "--module", "m", "--candidate-yaml", str(yaml_path),
                 "--out", str(tmp_path / "y")]) == 2
    assert "no isolation evidence" in capsys.readouterr().err


def test_an_attention_repro_reproduces_it_with_mask_rope_and_float16_qkv(isolated, tmp_path: Path) -> None:
    """Layer 0's attention (fused per-group QKV, q/k RMSNorm with the candidate's epsilon, RoPE from the captured
    rotary embedding, the causal mask, MindFormers' float16 q/k/v): each script recomputes its own side and shows
    the reported difference, forward and every gradient."""
    from align.cli import main

    iso, yaml_path, summary = isolated
    rows = {r["module"]: r for r in summary["stages"]["isolation"]["per_module"]}
    mod = "decoder.layers.0.self_attention"
    assert rows[mod]["own_verdict"] == "fail"
    out = tmp_path / "attn"
    assert main(["repro", str(iso), "--module", mod, "--candidate-yaml", str(yaml_path), "--out", str(out)]) == 0
    case = json.loads((out / "case.json").read_text())
    assert case["kind"] == "attention" and case["attention"]["candidate_qkv_dtype"] == "float16"
    assert set(case["weights"]["candidate"]) == {"qkv", "proj", "q_norm", "k_norm"}
    torch_run, ms_run = _run(out / "repro_torch.py"), _run(out / "repro_mindspore.py")
    assert torch_run["output | the baseline's saved output (itself)"] < 1e-6
    assert ms_run["output | the candidate's saved output (itself)"] < 1e-3      # float16 q/k/v, reordered sums
    assert ms_run["output | the baseline's saved output"] == pytest.approx(rows[mod]["own_rel_l2"], rel=1e-2)
    for r, info in case["grads"].items():
        assert ms_run[f"d {r} | the baseline's saved gradient"] == pytest.approx(info["report_own_rel_l2"], rel=5e-2)


def test_an_occupied_out_folder_is_refused_not_emptied(isolated, tmp_path: Path, capsys) -> None:
    from align.cli import main

    iso, yaml_path, _ = isolated
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    assert main(["repro", str(iso), "--module", "decoder.layers.1.mlp", "--candidate-yaml", str(yaml_path),
                 "--out", str(tmp_path / "mine")]) == 2
    assert "not a repro folder" in capsys.readouterr().err
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
