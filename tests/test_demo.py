"""The paired demo end to end, short: the clean pair passes every stage; each fault fails where it should.

The pair is the default one, `make demo`'s: Megatron-core (q/k layernorm) vs MindFormers 2.x mcore
TrainingQwen3ForCausalLM (``--model dense``). The legacy LlamaForCausalLM pair is tests/test_demo_legacy.py.

Why short runs: the stages under test (checklist, step 1/2, optimizer, layer profile, lr=0, data checks,
NaN trace) need only a dozen steps; the 300-step long run is `make demo`'s. One clean baseline (with its
TP=2 repeat) is shared: candidate-side faults reuse its baseline-side runs; the baseline-side faults, which run
their own baseline, are tests/test_demo_baseline_faults.py. The clean pair's candidate trains in GRAPH with its
layer statistics captured in the compiled step; the fault runs train in PYNATIVE with layer hooks (a GRAPH compile
with capture is 10-25 s here, a dozen PYNATIVE steps a few; tests/test_mindspore_graph_capture.py names planted
faults from GRAPH statistics).
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
from tests.helpers.demo_checks import (  # noqa: E402
    LR0_STEPS,
    STEPS,
    dense_fault_fails_at_its_stage,
    dense_faults,
    report_again,
    selected,
    verdicts,
)

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
    assert summary["diagnosis"] == [] and summary["coverage"]["banner"] == "PASS on every part of the procedure"
    assert summary["stages"]["long_run"]["steps"] == STEPS
    # every parameter of the mcore model compared by name (Megatron's own names: identity but fc1)
    ln = summary["stages"]["step1_local_norm"]
    assert ln["compared"] == 19 and {w["name"] for w in ln["worst"]} >= {
        "decoder.layers.0.self_attention.q_layernorm.weight", "decoder.layers.1.mlp.linear_fc1.weight"}
    assert summary["stages"]["step1_loss"]["rel_delta"] < 1e-5
    # clipping: Megatron's and MindFormers' own clipping of one probe gradient (10 x the max norm) agree
    clip = summary["stages"]["optimizer"]["clipping"]
    assert clip["checked"] and clip["baseline"]["measured"] and clip["probe_norm"] == pytest.approx(10.0)
    assert clip["baseline"]["config"] == clip["candidate"]["config"] == 1.0 and clip["compared"] == 19
    assert clip["candidate"]["coefficient"] == pytest.approx(0.1, rel=1e-5) and clip["rel_diff"] < 1e-5
    # forward and backward rows; MindFormers' float16 attention makes later rows judged at float16
    lt = summary["stages"]["layer_tensors"]
    assert lt["compared"] >= 20
    judged = {(r["module"], r["kind"]): r["judged_dtype"] for r in lt["rows"]}
    assert judged[("embedding", "forward.output.0")] == "float32"
    assert judged[("decoder.layers.0.self_attention.core_attention", "forward.output.0")] == "float16"
    # each judged quantity against the noise floor the TP=2 repeat shows at step 1 (comparators.noise_floor)
    assert all(r["ratio"] is not None and "repeat_tp2" in r["floor_source"] for r in lt["rows"])
    assert ln["noise_floor"]["with_floor"] == 19 and ln["noise_floor"]["worst_ratio"] < 10
    floors = {f["quantity"]: f for f in summary["stages"]["lr0_run"]["floors"]}
    assert set(floors) == {"loss", "grad_norm"} and all("step 1" in f["floor_source"] for f in floors.values())
    html = (out / "report.html").read_text()
    assert "TP=2" in html and "lr = 0" in html and "Checklist" in html
    assert "noise floor" in html and "floor_source" in html
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
    # the clipping probe's own grad norm (10) is not the step's: step 1 logs its evidence gradients' norm
    from runstore import read_step1_file

    grads = read_step1_file(runs / "baseline")["grad"]
    first = json.loads((runs / "baseline" / "scalars" / "rank_00000.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1 and first["grad_norm"] == pytest.approx(
        sum(float((g.astype("float64") ** 2).sum()) for g in grads.values()) ** 0.5, rel=1e-5)


def test_parameter_trajectories_on_the_demo_stores(clean: tuple[Path, dict], tmp_path: Path) -> None:
    """The real pair's named gradient norms at every step, each in its band from the TP=2 repeat: all 19 stay
    in (the clean report passes). A copy of the MindFormers store with one parameter's norm 10% off from step
    4 names that parameter and step 4; a one-step loss spike planted there is reported with its step's batches
    (the same: MindFormers replayed Megatron's) and which run spiked (the candidate: the repeat agrees with
    the baseline)."""
    import shutil

    import h5py
    import numpy as np

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
                # a real gradient that far off moves the training cell's global norm too (the evidence
                # self-check holds the named norms to it)
                h5["local_norm"].attrs["global_norm"] = float(np.sqrt(np.sum(np.square(rec["norm"].astype(float)))))
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


CANDIDATE_FAULTS = [n for n, f in FAULTS.items() if "dense" in f.kinds and f.side in ("candidate", "conversion")]


@pytest.fixture(scope="module")
def candidate_faults(request: pytest.FixtureRequest, clean: tuple[Path, dict],
                     tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict]]:
    """The candidate-side fault pairs selected in this session (`-k` picks some; at least one), on the clean pair's
    baseline, their candidates in one MindSpore process (demo.fault_batch; one start-up instead of one per fault),
    the first one's candidate once more at the end."""
    names = selected(request, "test_fault_fails_at_its_stage_naming_its_component", "name", CANDIDATE_FAULTS)
    out = tmp_path_factory.mktemp("faults")
    return out, dense_faults(out, names or CANDIDATE_FAULTS[:1], clean[0], rerun_first=True)


@pytest.mark.parametrize("name", CANDIDATE_FAULTS)
def test_fault_fails_at_its_stage_naming_its_component(name: str,
                                                       candidate_faults: tuple[Path, dict[str, dict]]) -> None:
    """Candidate-side faults, on the clean pair's baseline (baseline-side ones: test_demo_baseline_faults.py)."""
    out, data = candidate_faults
    dense_fault_fails_at_its_stage(name, data[name], out / name)


def test_a_candidate_run_writes_the_same_store_after_other_runs_in_its_process(
        candidate_faults: tuple[Path, dict[str, dict]]) -> None:
    """The fault pairs' candidates share one MindSpore process: the first one's candidate, run again last (after
    every other fault's build, patches, optimizer and steps), writes its store bit for bit again. The first run
    of a process is what a process of its own writes (measured for the 8 faults against paired_demo's own
    processes: bit-identical), so each fault's store is what its own process would write."""
    from tests.helpers.store_equal import store_differences

    out, data = candidate_faults
    first = out / next(iter(data))
    assert store_differences(first / "runs" / "candidate", first / "again" / "candidate") == []


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


def test_reuse_of_a_baseline_of_another_model_or_seed_is_refused(clean: tuple[Path, dict], tmp_path: Path) -> None:
    from core.errors import BadInput

    with pytest.raises(BadInput, match="--model dense"):
        paired_demo(tmp_path / "x", steps=STEPS, lr0_steps=LR0_STEPS, inject="qk_swap", reuse_baseline=clean[0],
                    repeat=False, model_kind="llama")
    with pytest.raises(BadInput, match="--seed 1234, not 5"):     # other weights and batches than the candidate's
        paired_demo(tmp_path / "y", steps=STEPS, lr0_steps=LR0_STEPS, inject="qk_swap", reuse_baseline=clean[0],
                    repeat=False, seed=5)


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


# -- MindFormers parallel layouts (issue 26): per-rank evidence made from the clean pair's MindFormers run ------
# MindSpore's semi-auto parallel cannot run on CPU, so tests/helpers/mindformers_layouts.py writes what each rank
# of a MindFormers DP / TP / PP run would hold (real dumper code, real log line formats), split from this run.

def _mf_layouts(out: Path) -> dict:
    import numpy as np

    from models import preset_for_config
    from runstore import RunReader, read_step1_file
    from tests.helpers.mindformers_layouts import single_process

    runs = out / "runs"
    norms, numel, loss, lr = single_process(runs / "candidate")
    grads = {k: np.asarray(v) for k, v in read_step1_file(runs / "baseline")["grad"].items()}
    cfg = RunReader(runs / "candidate").meta["config"]["values"]
    return {"runs": runs, "norms": norms, "numel": numel, "loss": loss, "lr": lr, "grads": grads, "cfg": cfg,
            "mapping": preset_for_config(cfg)}


def test_mindformers_dp_tp_pp_stores_recombine_to_the_single_process_norms(clean: tuple[Path, dict],
                                                                           tmp_path: Path) -> None:
    """DP=2 (all-reduced, semi-auto), TP=2 and PP=2 rank stores of the MindFormers run: every parameter comes
    back whole under its global name, equal to the one-process norms, and compares with the Megatron baseline
    with nothing dropped."""
    from comparators.local_norms import compare_local_norms, read_local_norms
    from models.mindformers_parallel import ParallelStrategy
    from tests.helpers.mindformers_layouts import write_rank_stores

    d = _mf_layouts(clean[0])
    one = compare_local_norms(d["runs"] / "baseline", d["runs"] / "candidate", d["mapping"])   # one process
    layouts = {"dp2": ParallelStrategy(dp=2, num_layers=2), "tp2": ParallelStrategy(tp=2, num_layers=2),
               "pp2": ParallelStrategy(pp=2, num_layers=2, micro_batch_num=2),
               "dp2_tp2_optpar": ParallelStrategy(dp=2, tp=2, optimizer_parallel=True, num_layers=2)}
    for label, strategy in layouts.items():
        store = write_rank_stores(tmp_path / label, strategy, d["norms"], d["grads"], d["loss"])
        got, info = read_local_norms(store)
        assert info["ranks"] == list(range(strategy.world)), label
        assert set(got) == set(d["norms"]), label
        for name, want in d["norms"].items():
            e = got[name]
            assert abs(e.full_norm() - want) <= 1e-12 * want, (label, name, e.full_norm(), want)
            assert e.full_numel() == d["numel"][name], (label, name)
            assert not e.missing_shards and not e.missing_dp_parts and e.replica_disagree == 0
        res = compare_local_norms(d["runs"] / "baseline", store, d["mapping"])
        assert res.details["compared"] == 19, (label, res.findings)    # every parameter, none dropped
        unverified = [f for f in res.findings if f.metric == "pipeline_local_norms_unverified"]
        assert len(unverified) == (label == "pp2"), label      # MFPipelineWithLossScaleCell's norms: said so
        assert [(f.verdict, f.component, f.metric) for f in res.findings if f not in unverified] == [
            (f.verdict, f.component, f.metric) for f in one.findings], label  # the one-process run's compare
    # both sides parallel: the pair's Megatron TP=2 repeat (same weights and batches, its own rank files) against
    # each MindFormers layout: every parameter paired, no shard, part or counterpart missing, none failing
    for label in layouts:
        res = compare_local_norms(d["runs"] / "repeat_tp2", tmp_path / label, d["mapping"])
        assert res.details["compared"] == 19, (label, res.findings)
        assert res.details["baseline"]["ranks"] == [0, 1], label
        assert not [f for f in res.findings if f.verdict == "fail" or f.metric.startswith("missing")], label
    tp = read_local_norms(tmp_path / "tp2")[0]
    assert tp["decoder.layers.0.mlp.linear_fc2.weight"].partition_dim == 1        # row-parallel: dim 1
    assert tp["decoder.layers.0.self_attention.linear_qkv.weight"].partition_dim == 0
    assert tp["decoder.layers.0.input_layernorm.weight"].partition_dim == -1      # whole on each TP rank
    pp, info = read_local_norms(tmp_path / "pp2")
    assert info["other_stage_rows"] > 0          # each stage's zero rows of the other stage's parameters dropped
    assert pp["decoder.layers.1.mlp.linear_fc1.weight"].pp_ranks == {1}
    assert pp["embedding.word_embeddings.weight"].pp_ranks == {0} and pp["output_layer.weight"].pp_ranks == {1}
    meta = json.loads((tmp_path / "pp2" / "meta.json").read_text())
    assert meta["parallel"]["pp"] == 2 and meta["parallel"]["layer_stages"] == [0, 1]
    # the slice a layout entry gives a rank is MindSpore's own (every tensor map of a (dp, cp, tp) = (2, 2, 2))
    from itertools import product

    from mindspore.parallel._tensor import _get_tensor_slice_index, _get_tensor_strategy

    from models.mindformers_parallel import slice_index
    dev = [2, 2, 2]
    for tmap in product(range(-1, 3), repeat=2):
        if len({k for k in tmap if k >= 0}) == len([k for k in tmap if k >= 0]):
            for r in range(8):
                want = _get_tensor_slice_index(dev, _get_tensor_strategy(dev, list(tmap)), list(tmap), r)
                assert slice_index(dev, list(tmap), r)[0] == int(want), (tmap, r)


def test_mindformers_dp2_pre_all_reduce_norms_are_reported_as_such(clean: tuple[Path, dict], tmp_path: Path) -> None:
    """DP=2 msrun worker logs (TrainingStateMonitor: each rank's gradient before the all-reduce) and a DP=2
    data-parallel-mode store: never one rank silently; against the Megatron baseline every parameter is
    compared with the per-rank norms' bound and the stage warns saying what they are; like with like (two
    pre-reduce DP=2 runs) compares rank by rank and passes."""
    from comparators.local_norms import compare_local_norms
    from models.mindformers_parallel import ParallelStrategy
    from sources import load_run
    from tests.helpers.mindformers_layouts import write_rank_stores, write_worker_logs

    d = _mf_layouts(clean[0])
    cfg = {**d["cfg"], "parallel_config": {"data_parallel": 2, "model_parallel": 1, "pipeline_stage": 1},
           "parallel": {"parallel_mode": 1}}
    logs = write_worker_logs(tmp_path / "output" / "msrun_log", ParallelStrategy(dp=2), d["norms"], d["grads"],
                             d["loss"], cfg, d["lr"])
    run = load_run(tmp_path / "output")
    assert (run.meta["parallel"]["dp"], run.meta["parallel"]["world_size"]) == (2, 2)   # the printed config's
    res = compare_local_norms(d["runs"] / "baseline", run, d["mapping"])
    assert res.details["compared"] == 19 and res.verdict == "warn", res.findings   # never a pass, never dropped
    pre = [f for f in res.findings if f.metric == "pre_all_reduce"]
    assert len(pre) == 1 and "before the DP all-reduce" in pre[0].message and pre[0].value == 19
    assert not [f for f in res.findings if f.verdict == "fail"]
    assert all(r["compared_as"] == "pre_all_reduce_bound" for r in res.details["parameters"])
    assert res.details["candidate"]["grad_state"] == {"pre_all_reduce": 2}
    # a candidate whose gradient is larger than the two ranks' norms can explain fails (not the same gradient)
    big = {k: v * 0.9 for k, v in d["norms"].items()}
    write_worker_logs(tmp_path / "small" / "msrun_log", ParallelStrategy(dp=2), big, d["grads"], d["loss"], cfg,
                      d["lr"])
    res = compare_local_norms(d["runs"] / "baseline", load_run(tmp_path / "small"), d["mapping"])
    assert res.verdict == "fail" and {f.metric for f in res.findings if f.verdict == "fail"} == {
        "local_norm_above_pre_reduce_bound"}
    # data-parallel mode (parallel_mode 0): the dumper's store says pre_all_reduce; against the logs, rank by rank
    store = write_rank_stores(tmp_path / "dp_mode", ParallelStrategy(dp=2, parallel_mode=0), d["norms"], d["grads"],
                              d["loss"])
    res = compare_local_norms(store, run, d["mapping"])
    assert res.details["compared"] == 19 and res.verdict == "pass", res.findings   # float32 log values: ~1e-7
    assert {r["compared_as"] for r in res.details["parameters"]} == {"per_dp_rank"}
    assert max(r["rel_diff"] for r in res.details["parameters"]) < 1e-6
    assert logs.is_dir()
    # DP=2 x TP=2 worker logs: each rank's slice, placed by the printed parallel_config; nothing dropped
    tp_cfg = {**cfg, "parallel_config": {**cfg["parallel_config"], "model_parallel": 2}}
    write_worker_logs(tmp_path / "tp" / "msrun_log", ParallelStrategy(dp=2, tp=2), d["norms"], d["grads"],
                      d["loss"], tp_cfg, d["lr"])
    res = compare_local_norms(d["runs"] / "baseline", load_run(tmp_path / "tp"), d["mapping"])
    assert res.details["compared"] == 19 and res.details["candidate"]["layout_from"] == "config", res.findings
    assert {f.metric for f in res.findings if f.verdict != "pass"} == {"pre_all_reduce"}
    bound = {r["name"]: r["bound"] for r in res.details["parameters"]}
    assert abs(bound["decoder.layers.0.mlp.linear_fc1.weight"] / d["norms"]["decoder.layers.0.mlp.linear_fc1.weight"]
               - 1) < 1e-6    # slices root-sum-square, DP halves summed: the whole norm again


def test_mindformers_optimizer_parallel_evidence_merges(clean: tuple[Path, dict], tmp_path: Path) -> None:
    """MindFormers' optimizer parallel (TP=2 x DP=2, enable_parallel_optimizer): each rank's slice part of the
    step-1 evidence (here the pair's whole evidence split as MindFormers splits it) merges back bit for bit."""
    import numpy as np

    from dumpers.mindformers import write_optimizer_shard
    from models.mindformers_parallel import ParallelStrategy, split_for_rank
    from runstore import read_step1_file

    whole = read_step1_file(clean[0] / "runs" / "baseline")
    for opt in (True, False):
        s = ParallelStrategy(dp=2, tp=2, optimizer_parallel=opt)
        dest = tmp_path / f"opt{int(opt)}"
        for rank in range(s.world):
            held = {k: {n: split_for_rank(n, a, s, rank) for n, a in whole[k].items()} for k in whole}
            write_optimizer_shard(dest, rank, s, {n: a.shape for n, a in whole["grad"].items()},
                                  held["grad"], held["init"], held["weight"])
        merged = read_step1_file(dest)
        for kind in ("grad", "init", "weight"):
            assert set(merged[kind]) == set(whole[kind])
            for n, a in whole[kind].items():
                np.testing.assert_array_equal(merged[kind][n], a)


def test_mindformers_callback_records_the_ranks_slices_under_a_parallel_context(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The callback's own path on rank 3 of a semi-auto DP=2 x TP=2 job with the optimizer parallel (MindSpore's
    auto-parallel context stubbed: it cannot be set up on CPU): the wrapper's 7 outputs become a table whose
    rows say which slice (from the compiled cell's parameter_layout_dict) and which optimizer part they are."""
    from types import SimpleNamespace

    import mindspore as ms
    import numpy as np

    from dumpers.mindformers import MindFormersDumperCallback
    from dumpers.mindspore_dumper import DumpConfig, MindSporeDumper
    from runstore import RunReader

    context = {"device_num": 4, "parallel_mode": "semi_auto_parallel", "enable_parallel_optimizer": True,
               "gradients_mean": False}
    monkeypatch.setattr(ms, "get_auto_parallel_context", lambda key: context[key])
    qkv, norm = "decoder.layers.0.self_attention.linear_qkv.weight", "decoder.layers.0.input_layernorm.weight"
    params = [ms.Parameter(ms.Tensor(np.zeros((2, 4), np.float32)), name=qkv),     # rank 3's slice part
              ms.Parameter(ms.Tensor(np.zeros((4,), np.float32)), name=norm)]
    net = SimpleNamespace(parallel_config={"data_parallel": 2, "model_parallel": 2}, network=None,
                          parameter_layout_dict={qkv: [[2, 1, 2], [0, -1], [4, 4], 0, True, "opt_group"],
                                                 norm: [[2, 1, 2], [-1], [4], 0, True, ""]})
    outputs = (ms.Tensor(2.5), ms.Tensor(False), ms.Tensor(1.0), ms.Tensor(1e-3), ms.Tensor(5.0),
               ms.Tensor(np.array([9.0, 16.0], np.float32)), (8, 4))
    dumper = MindSporeDumper(None, tmp_path / "run", DumpConfig(steps=[1]), rank=3, world_size=4,
                             framework="mindformers")
    cb = MindFormersDumperCallback(dumper)
    dumper.begin_step(1)
    cb.handle_outputs(outputs, SimpleNamespace(optimizer=SimpleNamespace(parameters=params), train_network=net))
    dumper.end_step()
    dumper.close()
    r = RunReader(tmp_path / "run")
    t = r.step_arrays(1, 3).table("local_norm").set_index("name")
    assert t.loc[qkv, ["tp_partition_dim", "tp_rank", "tp_size", "dp_shard", "dp_rank", "dp_size"]].tolist() == [
        0, 1, 2, 1, 1, 2]
    assert t.loc[norm, ["tp_partition_dim", "tp_size", "dp_shard"]].tolist() == [-1, 1, 0]
    assert t.norm.tolist() == [3.0, 4.0] and t.numel.tolist() == [8, 4]
    assert (r.meta["parallel"]["dp"], r.meta["parallel"]["tp"], r.meta["parallel"]["optimizer_parallel"]) == (
        2, 2, True)
    import h5py
    with h5py.File(r.step_file(1, 3)) as h5:
        assert h5["local_norm"].attrs["grad_state"] == "all_reduced"
