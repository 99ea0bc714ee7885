"""`align demo --model dense`: Megatron-core (q/k layernorm) vs MindFormers 2.x mcore Qwen3 on CPU, short.

Why a file of its own: the legacy Llama pair (tests/test_demo.py) stays as it is; this one checks the
candidate MindFormers 2.1.0 actually trains (``use_legacy: False``). One clean pair (with its TP=2 repeat)
is shared; the candidate-side faults reuse its baseline-side runs. Kept to the clean pair and three faults
(qk_swap at conversion, nan_param on the candidate's gradients, norm_eps in its config) for the suite's
time; the other faults were measured by hand (docs/demo.md).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")
pytest.importorskip("mindspore")
pytest.importorskip("mindformers")

from demo.pair import paired_demo  # noqa: E402
from demo.spec import FAULTS  # noqa: E402

STEPS = 12
LR0_STEPS = 3
ALL_STAGES = ("checklist", "conversion", "data_checks", "step1_loss", "step1_local_norm", "layer_tensors",
              "step2_loss", "optimizer", "lr0_run", "long_run", "grad_norm", "lr_schedule", "nonfinite", "band",
              "nan_trace")


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("demo_mcore") / "clean"
    return out, paired_demo(out, steps=STEPS, lr0_steps=LR0_STEPS, model_kind="dense")


def verdicts(data: dict) -> tuple[dict, set]:
    stages = {k: v["verdict"] for k, v in data["stages"].items()}
    findings = {(f["stage"], f["verdict"], f["component"]) for f in data["findings"] if f["verdict"] != "pass"}
    return stages, findings


def test_dense_clean_pair_passes_every_stage(clean: tuple[Path, dict], tmp_path: Path) -> None:
    out, data = clean
    assert data["verdict"] == "pass", [f for f in data["findings"] if f["verdict"] != "pass"]
    for stage in ALL_STAGES:
        assert data["stages"][stage]["verdict"] == "pass", (stage, data["stages"][stage])
    # every parameter of the mcore model compared by name (Megatron's own names: identity but fc1)
    ln = data["stages"]["step1_local_norm"]
    assert ln["compared"] == 19 and {w["name"] for w in ln["worst"]} >= {
        "decoder.layers.0.self_attention.q_layernorm.weight", "decoder.layers.1.mlp.linear_fc1.weight"}
    assert data["stages"]["layer_tensors"]["compared"] >= 20
    assert data["stages"]["step1_loss"]["rel_delta"] < 1e-5
    runs = out / "runs"
    cand_meta = json.loads((runs / "candidate" / "meta.json").read_text())
    assert cand_meta["framework"] == "mindformers"
    cfg = cand_meta["config"].get("values", cand_meta["config"])
    assert cfg["use_legacy"] is False and cfg["model"]["model_config"]["type"] == "Qwen3Config"
    assert (runs / "mindformers_init.safetensors").is_file()
    cmd = (out / "report_command.txt").read_text()
    assert "--mapping megatron_core__mindformers_mcore_dense" in cmd and "--local-norm-rtol" in cmd
    # `align report` with the saved command line gives the same verdicts
    from align.cli import main

    argv = shlex.split(cmd)[2:]
    argv[argv.index("--out") + 1] = str(tmp_path / "again")
    assert main(["report", "-q", *argv]) == 0
    assert verdicts(json.loads((tmp_path / "again" / "summary.json").read_text())) == verdicts(data)


def test_float32_default_tolerance_flags_the_float16_attention(clean: tuple[Path, dict], tmp_path: Path) -> None:
    """Without the dense tolerances, the step-1 local norms of the q/k layernorms exceed float32's 1e-4:
    MindFormers' float16 cast of q/k/v is a real difference, which the report shows."""
    from align.cli import main

    out, _ = clean
    argv = shlex.split((out / "report_command.txt").read_text())[2:]
    i = argv.index("--local-norm-rtol")
    del argv[i:i + 2]
    argv[argv.index("--out") + 1] = str(tmp_path / "strict")
    main(["report", "-q", *argv])
    data = json.loads((tmp_path / "strict" / "summary.json").read_text())
    assert data["stages"]["step1_local_norm"]["verdict"] in ("warn", "fail")
    hits = [f for f in data["findings"] if f["stage"] == "step1_local_norm" and f["verdict"] != "pass"]
    assert any("layernorm" in str(f["component"]) for f in hits), hits


@pytest.mark.parametrize("name", ["qk_swap", "nan_param", "norm_eps"])
def test_dense_fault_fails_at_its_stage_naming_its_component(name: str, clean: tuple[Path, dict],
                                                             tmp_path: Path) -> None:
    f = FAULTS[name]
    data = paired_demo(tmp_path / name, steps=STEPS, lr0_steps=LR0_STEPS, inject=name, reuse_baseline=clean[0],
                       repeat=False, model_kind="dense")
    assert data["verdict"] == "fail"
    assert data["stages"][f.stage]["verdict"] == "fail", (f.stage, data["stages"][f.stage])
    component = f.component_for("dense")
    hits = [x for x in data["findings"] if x["stage"] == f.stage and x["verdict"] == "fail"
            and component in str(x["component"])]
    assert hits, (component, [x for x in data["findings"] if x["stage"] == f.stage])


def test_reuse_of_a_baseline_of_another_model_is_refused(clean: tuple[Path, dict], tmp_path: Path) -> None:
    from align.core.errors import BadInput

    with pytest.raises(BadInput, match="--model dense"):
        paired_demo(tmp_path / "x", steps=STEPS, lr0_steps=LR0_STEPS, inject="qk_swap", reuse_baseline=clean[0],
                    repeat=False, model_kind="llama")
