"""The paired demo end to end, short: the clean pair passes every stage; each fault fails where it should.

The pair is the default one, `make demo`'s: Megatron-core (q/k layernorm) vs MindFormers 2.x mcore
TrainingQwen3ForCausalLM (``--model dense``). The legacy LlamaForCausalLM pair is tests/test_demo_legacy.py.

Why short runs: the stages under test (checklist, step 1/2, optimizer, layer profile, lr=0, data checks,
NaN trace) need only a dozen steps; the 300-step long run is `make demo`'s. One clean baseline (with its
TP=2 repeat) is shared: candidate-side faults reuse its baseline-side runs, baseline-side faults run their
own baseline without the repeat (the band does not decide their stage).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")
pytest.importorskip("mindspore")
pytest.importorskip("mindformers")

from demo.pair import paired_demo  # noqa: E402
from demo.spec import FAULTS  # noqa: E402
from tests.helpers.browser import chromium, report_problems, tamper  # noqa: E402

STEPS = 12
LR0_STEPS = 3
ALL_STAGES = ("checklist", "conversion", "data_checks", "step1_loss", "step1_local_norm", "layer_tensors", "step2_loss",
              "optimizer", "lr0_run", "long_run", "grad_norm", "lr_schedule", "nonfinite",
              "band", "nan_trace", "norm_trajectories", "spikes")


ROOT = Path(__file__).resolve().parents[1]
WORKFLOW_MARK = "<!-- tested: tests/test_demo.py runs this block"


def workflow_blocks() -> list[str]:
    text = (ROOT / "docs" / "workflow.md").read_text()
    return re.findall(re.escape(WORKFLOW_MARK) + r"[^>]*-->\s*```bash\n(.*?)```", text, re.S)


def run_block(block: str, wf: Path) -> subprocess.CompletedProcess:
    script = block.replace("/tmp/wf", str(wf)).replace(".venv/bin/", str(Path(sys.executable).parent) + "/")
    return subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, capture_output=True, text=True)


def verdicts(data: dict) -> tuple[dict, set]:
    """What must agree between the demo and `align report`: every stage's verdict, every non-pass finding."""
    stages = {k: v["verdict"] for k, v in data["stages"].items()}
    findings = {(f["stage"], f["verdict"], f["component"]) for f in data["findings"] if f["verdict"] != "pass"}
    return stages, findings


def report_again(out: Path, dest: Path) -> dict:
    """`align report` on the demo's own stores, with the command the demo saved, in a fresh folder."""
    from align.cli import main

    argv = shlex.split((out / "report_command.txt").read_text())[2:]
    i = argv.index("--out")
    argv[i + 1] = str(dest)
    main(["report", "-q", *argv])
    return json.loads((dest / "summary.json").read_text())


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """The clean pair, made by the workflow doc's CPU rehearsal block (`align demo ...`) as written."""
    wf = tmp_path_factory.mktemp("demo") / "wf"
    demo_block = [b for b in workflow_blocks() if "align demo" in b]
    assert demo_block, "docs/workflow.md lost its tested demo block"
    r = run_block(demo_block[0], wf)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return wf, json.loads((wf / "summary.json").read_text())


def test_workflow_report_block_gives_the_demo_verdicts(clean: tuple[Path, dict]) -> None:
    """docs/workflow.md's `align report` block on the demo's runs: the same stages, verdicts, components."""
    wf, data = clean
    block = [b for b in workflow_blocks() if "align report" in b]
    assert block, "docs/workflow.md lost its tested report block"
    r = run_block(block[0], wf)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    again = json.loads((wf / "report" / "summary.json").read_text())
    assert verdicts(again) == verdicts(data)
    assert again["stages"]["optimizer"]["verdict"] == "pass" and again["stages"]["lr0_run"]["verdict"] == "pass"


def test_report_on_two_logs_says_what_to_capture(tmp_path: Path) -> None:
    from align.cli import main
    from demo.example_logs import write_examples

    paths = write_examples(tmp_path / "in")
    assert main(["report", "-q", str(paths["baseline"]), str(paths["candidate"]), "--out",
                 str(tmp_path / "r")]) in (0, 1)
    data = json.loads((tmp_path / "r" / "summary.json").read_text())
    skipped = {k: v for k, v in data["stages"].items() if v["verdict"] == "skipped"}
    for name in ("checklist", "layer_tensors", "optimizer", "lr0_run", "band", "nan_trace", "data_checks"):
        assert name in skipped and skipped[name]["capture"], (name, skipped.get(name))


def test_clean_pair_passes_every_stage(clean: tuple[Path, dict]) -> None:
    out, data = clean
    assert data["verdict"] == "pass", [f for f in data["findings"] if f["verdict"] != "pass"]
    for stage in ALL_STAGES:
        assert data["stages"][stage]["verdict"] == "pass", (stage, data["stages"][stage])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["verdict"] == "pass"
    assert summary["stages"]["long_run"]["steps"] == STEPS
    # every parameter of the mcore model compared by name (Megatron's own names: identity but fc1)
    ln = summary["stages"]["step1_local_norm"]
    assert ln["compared"] == 19 and {w["name"] for w in ln["worst"]} >= {
        "decoder.layers.0.self_attention.q_layernorm.weight", "decoder.layers.1.mlp.linear_fc1.weight"}
    assert summary["stages"]["step1_loss"]["rel_delta"] < 1e-5
    # forward and backward rows; MindFormers' float16 attention makes later rows judged at float16
    lt = summary["stages"]["layer_tensors"]
    assert lt["compared"] >= 20
    judged = {(r["module"], r["kind"]): r["judged_dtype"] for r in lt["rows"]}
    assert judged[("embedding", "forward.output.0")] == "float32"
    assert judged[("decoder.layers.0.self_attention.core_attention", "forward.output.0")] == "float16"
    html = (out / "report.html").read_text()
    assert "TP=2" in html and "lr = 0" in html and "Checklist" in html
    assert "data:image/png;base64," in html
    # the runs really are the two frameworks, and the repeat really ran TP=2
    runs = out / "runs"
    assert verdicts(report_again(out, out / "again")) == verdicts(data)
    assert json.loads((runs / "baseline" / "meta.json").read_text())["framework"] == "megatron-core"
    cand_meta = json.loads((runs / "candidate" / "meta.json").read_text())
    assert cand_meta["framework"] == "mindformers"
    cfg = cand_meta["config"].get("values", cand_meta["config"])
    mcfg = cfg["model"]["model_config"]     # the YAML the candidate was built from (MindFormers' build_network)
    assert cfg["use_legacy"] is False and (mcfg["model_type"], mcfg["architectures"]) == (
        "qwen3", ["TrainingQwen3ForCausalLM"])
    assert cfg["context"]["mode"] == 0 and cfg["runner_wrapper"]["type"] == "McoreCPUTrainOneStepCell"
    assert (runs / "mindformers_init.safetensors").is_file()
    cmd = (out / "report_command.txt").read_text()
    assert "--mapping" not in cmd and "rtol" not in cmd   # the preset and the precision come from the runs
    assert json.loads((runs / "repeat_tp2" / "meta.json").read_text())["parallel"]["tp"] == 2
    assert (runs / "baseline" / "step_1" / "rank_0" / "tokens.npy").is_file()   # seed layout for replay


def test_parameter_trajectories_on_the_demo_stores(clean: tuple[Path, dict], tmp_path: Path) -> None:
    """The real pair's named gradient norms at every step, each in its band from the TP=2 repeat: all 19 stay
    in (the clean report passes). A copy of the MindFormers store with one parameter's norm 10% off from step
    4 names that parameter and step 4; a one-step loss spike planted there is reported with its step's batches
    (the same: MindFormers replayed Megatron's) and which run spiked (the candidate: the repeat agrees with
    the baseline)."""
    import shutil

    import h5py

    from align.stages import Evidence, Inputs, Options, run_stages
    from comparators.scalars import ScalarOptions

    out, data = clean
    st = data["stages"]["norm_trajectories"]
    assert st["steps"] == STEPS and st["parameters"] == 19 and st["first_departure"] is None
    assert st["kinds"]["local_norm"]["judged"] == 19 and st["kinds"]["local_norm"]["repeats"] == 1
    runs = out / "runs"
    shutil.copytree(runs / "candidate", tmp_path / "candidate")
    planted = "decoder.layers.1.mlp.linear_fc2.weight"
    for f in (tmp_path / "candidate" / "steps").glob("step_*/rank_*.h5"):
        if int(f.parent.name.split("_")[1]) >= 4:
            with h5py.File(f, "r+") as h5:
                rec = h5["local_norm"][...]
                rec["norm"][rec["name"] == planted.encode()] *= 1.1
                h5["local_norm"][...] = rec
    # and a one-step loss spike of the candidate at step 8: reported with that step's real batches (a 1e-3 loss
    # band floor keeps this independent of how far the repeat is from the baseline)
    scalars = tmp_path / "candidate" / "scalars" / "rank_00000.jsonl"
    lines = [json.loads(x) for x in scalars.read_text().splitlines()]
    for rec in lines:
        rec["loss"] += 0.5 if rec["step"] == 8 else 0.0
    scalars.write_text("".join(json.dumps(rec) + "\n" for rec in lines))
    ev = Evidence.load(Inputs(str(runs / "baseline"), str(tmp_path / "candidate"), repeats=[str(runs / "repeat_tp2")],
                              options=Options(scalar=ScalarOptions(sustain=5, band_floor=1e-3,
                                                                        max_outside=0.1))))
    got = run_stages(ev, only=["norm_trajectories", "spikes"])
    res = got["norm_trajectories"]
    assert res.verdict == "fail" and res.details["first_departure"]["name"] == planted
    assert res.details["first_departure"]["departure_step"] == 4 and res.details["kinds"]["local_norm"]["departed"] == 1
    (spike,) = got["spikes"].details["loss"]["reported"]
    assert spike["peak_step"] == 8 and spike["side"] == "candidate"
    # the MindFormers candidate replayed the Megatron baseline's batch of that step
    assert spike["batches"]["same_batch"] is True and spike["norm_jumps"]


@pytest.mark.parametrize("name", [n for n, f in FAULTS.items() if "dense" in f.kinds])
def test_fault_fails_at_its_stage_naming_its_component(name: str, clean: tuple[Path, dict],
                                                       tmp_path: Path) -> None:
    f = FAULTS[name]
    reuse = clean[0] if f.side in ("candidate", "conversion") else None
    data = paired_demo(tmp_path / name, steps=STEPS, lr0_steps=LR0_STEPS, inject=name, reuse_baseline=reuse,
                       repeat=False)
    assert data["verdict"] == "fail"
    stage = data["stages"][f.stage]
    assert stage["verdict"] == "fail", (f.stage, stage)
    component = f.component_for("dense")
    hits = [x for x in data["findings"] if x["stage"] == f.stage and x["verdict"] == "fail"
            and component in str(x["component"])]
    assert hits, (component, [x for x in data["findings"] if x["stage"] == f.stage])
    assert f.name in (tmp_path / name / "report.html").read_text()
    # `align report` alone, on the stores this fault's demo made, fails at the same stage, same component
    assert verdicts(report_again(tmp_path / name, tmp_path / f"{name}_report")) == verdicts(data)


def test_judged_at_float32_the_float16_attention_shows(clean: tuple[Path, dict], tmp_path: Path) -> None:
    """`--dtype float32` overrides the float16 the candidate's config says its flash attention computes in:
    the step-1 local norms of the q/k layernorms then exceed float32's 1e-4. MindFormers' float16 cast of
    q/k/v is a real difference, which the report shows when asked to ignore it."""
    from align.cli import main

    out, data = clean
    ln = data["stages"]["step1_local_norm"]
    assert ln["dtype"] == "float16" and "flash attention" in ln["dtype_source"]
    assert ln["mapping"] == "megatron_core__mindformers_mcore_dense" and "2.x config" in ln["mapping_source"]
    argv = shlex.split((out / "report_command.txt").read_text())[2:]
    argv[argv.index("--out") + 1] = str(tmp_path / "strict")
    main(["report", "-q", *argv, "--dtype", "float32"])
    strict = json.loads((tmp_path / "strict" / "summary.json").read_text())
    assert strict["stages"]["step1_local_norm"]["verdict"] in ("warn", "fail")
    hits = [f for f in strict["findings"] if f["stage"] == "step1_local_norm" and f["verdict"] != "pass"]
    assert any("layernorm" in str(f["component"]) for f in hits), hits


def test_reuse_of_a_baseline_of_another_model_is_refused(clean: tuple[Path, dict], tmp_path: Path) -> None:
    from core.errors import BadInput

    with pytest.raises(BadInput, match="--model dense"):
        paired_demo(tmp_path / "x", steps=STEPS, lr0_steps=LR0_STEPS, inject="qk_swap", reuse_baseline=clean[0],
                    repeat=False, model_kind="llama")


def test_cli_rejects_unknown_fault(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "align", "demo", "--inject", "nope", "--out", str(tmp_path)],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "unknown fault" in r.stderr and "Traceback" not in r.stderr


# each tampered copy of the report and the problem report_problems must name for it
TAMPERED = {"hide_stage": "on the page but not visible", "drop_stage": "not on the page",
            "broken_image": "partly decoded", "corrupt_image": "not decoded",
            "console_error": "console.error: tampered", "exception": "exception: ReferenceError"}


def test_report_renders_in_headless_browser(clean: tuple[Path, dict], tmp_path: Path) -> None:
    """The demo's report in headless Chromium (tests/helpers/browser.py, skipped without it unless
    XF_ALIGN_REQUIRE_BROWSER=1): the verdict banner, every stage of summary.json visible with its verdict,
    every figure fully decoded at the size of its figures/*.png, no console error or exception. Copies with a
    stage hidden or dropped, a figure cut short or not a PNG, or a script that errs are each caught."""
    out, data = clean
    figures = sorted((out / "figures").glob("*.png"))
    html = (out / "report.html").read_text(encoding="utf-8")
    with chromium(tmp_path / "chromium") as browser:
        page = browser.look((out / "report.html").resolve().as_uri())
        assert report_problems(page, data, figures) == []
        assert len(page["images"]) == len(figures) >= 4 and len(page["stages"]) >= len(ALL_STAGES)
        for what, expect in TAMPERED.items():
            copy = tmp_path / f"{what}.html"
            copy.write_text(tamper(html, what), encoding="utf-8")
            problems = report_problems(browser.look(copy.as_uri()), data, figures)
            assert any(expect in p for p in problems), (what, problems)
