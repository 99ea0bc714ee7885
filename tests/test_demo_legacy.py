"""`align demo --model llama`: Megatron-core vs MindFormers' legacy LlamaForCausalLM (MindFormers <= 1.6), short.

Why a file of its own: the default pair (tests/test_demo.py, every fault) is the mcore candidate MindFormers
2.x trains; this one keeps the legacy path honest. One clean pair (with its TP=2 repeat) is shared; the
faults kept here are the ones whose code differs on the legacy path: the float16 embedding (legacy
embedding cell, judged at float32 all the way), q/k rows in the legacy .ckpt conversion, and the NaN in a
legacy-named gradient (``model.layers.1.feed_forward.w2``).
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

from demo.fault_batch import FaultPair, paired_faults  # noqa: E402
from demo.pair import paired_demo  # noqa: E402
from demo.spec import FAULTS  # noqa: E402
from tests.helpers.demo_checks import culprit_is, selected, verdicts  # noqa: E402

STEPS = 12
LR0_STEPS = 3
ALL_STAGES = ("checklist", "conversion", "data_checks", "step1_loss", "step1_local_norm", "layer_tensors",
              "step2_loss", "optimizer", "lr0_run", "long_run", "grad_norm", "lr_schedule", "nonfinite", "band",
              "nan_trace")


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("demo_legacy") / "clean"
    return out, paired_demo(out, steps=STEPS, lr0_steps=LR0_STEPS, model_kind="llama")


def test_legacy_clean_pair_passes_every_stage(clean: tuple[Path, dict], tmp_path: Path) -> None:
    out, data = clean
    assert data["verdict"] == "pass", [f for f in data["findings"] if f["verdict"] != "pass"]
    assert data["diagnosis"] == []
    for stage in ALL_STAGES:
        assert data["stages"][stage]["verdict"] == "pass", (stage, data["stages"][stage])
    assert data["stages"]["step1_local_norm"]["compared"] >= 9        # every parameter group, by name
    assert data["stages"]["layer_tensors"]["compared"] >= 20          # forward and backward rows
    runs = out / "runs"
    cand_meta = json.loads((runs / "candidate" / "meta.json").read_text())
    assert cand_meta["framework"] == "mindformers"
    assert (runs / "mindformers_init.ckpt").is_file()
    assert json.loads((runs / "repeat_tp2" / "meta.json").read_text())["parallel"]["tp"] == 2
    cmd = (out / "report_command.txt").read_text()
    assert "--mapping" not in cmd          # the default preset is the legacy Llama one
    # `align report` with the saved command line gives the same verdicts
    from align.cli import main

    argv = shlex.split(cmd)[2:]
    argv[argv.index("--out") + 1] = str(tmp_path / "again")
    assert main(["report", "-q", *argv]) == 0
    assert verdicts(json.loads((tmp_path / "again" / "summary.json").read_text())) == verdicts(data)


LEGACY_FAULTS = ["embedding_fp16", "qk_swap", "nan_param"]
TEST = "test_legacy_fault_fails_at_its_stage_naming_its_component"


@pytest.fixture(scope="module")
def faults(request: pytest.FixtureRequest, clean: tuple[Path, dict],
           tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict]]:
    """The selected faults on the clean pair's baseline, no lr = 0 pair and no optimizer check (neither judges
    these faults), their candidates in one MindSpore process (demo.fault_batch)."""
    out = tmp_path_factory.mktemp("legacy_faults")
    names = selected(request, TEST, "name", LEGACY_FAULTS)
    return out, paired_faults(out, [FaultPair(n, STEPS) for n in names], reuse_baseline=clean[0], model_kind="llama")


@pytest.mark.parametrize("name", LEGACY_FAULTS)
def test_legacy_fault_fails_at_its_stage_naming_its_component(name: str,
                                                              faults: tuple[Path, dict[str, dict]]) -> None:
    f = FAULTS[name]
    data = faults[1][name]
    assert data["verdict"] == "fail"
    assert data["stages"][f.stage]["verdict"] == "fail", (f.stage, data["stages"][f.stage])
    component = f.component_for("llama")
    hits = [x for x in data["findings"] if x["stage"] == f.stage and x["verdict"] == "fail"
            and component in str(x["component"])]
    assert hits, (component, [x for x in data["findings"] if x["stage"] == f.stage])
    culprit_is(data, f, "llama")


def test_reuse_of_a_baseline_of_another_model_is_refused(clean: tuple[Path, dict], tmp_path: Path) -> None:
    from core.errors import BadInput

    with pytest.raises(BadInput, match="--model llama"):
        paired_demo(tmp_path / "x", steps=STEPS, lr0_steps=LR0_STEPS, inject="qk_swap", reuse_baseline=clean[0],
                    repeat=False, model_kind="dense")
