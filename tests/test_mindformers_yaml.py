"""The shipped example YAML (docs/examples/mindformers_qwen3_tiny_cpu.yaml) trains MindFormers' mcore Qwen3 on CPU
as a user runs it: ``run_mindformer.py --config FILE --register_path DIR`` with the xf-align checkout on
PYTHONPATH and nothing else (tests/helpers/run_mindformer.py does only what MindFormers' script does; every class
comes from the YAML), replaying a megatron-core run made by the project's own Megatron CPU runner, from that run's
initial weights converted by ``align convert-weights``. Then ``align report`` judges the pair.

The helpers here (store, conversion, YAML, launch) are also what tests/upstream/mindformers_run.py uses to run the
real run_mindformer.py of a MindFormers checkout by hand.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "docs" / "examples" / "mindformers_qwen3_tiny_cpu.yaml"
# model kind -> (example YAML, the mapping preset that converts the Megatron weights for it)
EXAMPLES = {"dense": (EXAMPLE, "megatron_core__mindformers_mcore_dense"),
            "moe": (REPO / "docs" / "examples" / "mindformers_qwen3_moe_tiny_cpu.yaml",
                    "megatron_core__mindformers_mcore_moe")}
WEIGHTS = "megatron_init.safetensors"     # where the example YAML loads the converted weights: @OUT@/WEIGHTS
STEPS = 3


def register_path(example: Path = EXAMPLE) -> Path:
    """The ``--register_path`` the YAML's first line names (``# register_path: DIR``, relative to the checkout)."""
    first = example.read_text().splitlines()[0]
    match = re.fullmatch(r"# register_path: (\S+)", first)
    if match is None:
        raise ValueError(f"{example}: first line must be '# register_path: DIR', got {first!r}")
    return (REPO / match.group(1)).resolve()


def make_megatron_store(root: Path, kind: str = "dense", steps: int = STEPS, tensor_steps: str = "1"
                        ) -> tuple[Path, Path]:
    """A megatron-core run of the demo's model (``kind`` dense: Qwen3-shaped; moe: 4 experts top-2 in every layer)
    by demo.megatron_runner in its own process: the run store and the initial state_dict (torch.save) the
    candidate starts from."""
    from demo.model import demo_model
    from demo.spec import Spec, write_spec

    root.mkdir(parents=True, exist_ok=True)
    spec = Spec(role="baseline", out=str(root / "megatron"), steps=steps, model=demo_model(), model_kind=kind,
                tensor_steps=tensor_steps, init_weights=str(root / "megatron_init.pt"))
    spec_file = write_spec(spec, root / "spec.json")
    proc = subprocess.run([sys.executable, "-m", "demo.megatron_runner", str(spec_file)], cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"demo.megatron_runner failed:\n{proc.stdout[-3000:]}")
    return Path(spec.out), Path(spec.init_weights or "")


def convert_weights(init_pt: Path, out: Path, kind: str = "dense") -> Path:
    """``align convert-weights`` of the Megatron initial weights to where the example YAML loads them."""
    from align.cli import main
    from demo.model import demo_model

    m = demo_model()
    out.mkdir(parents=True, exist_ok=True)
    target = out / WEIGHTS
    rc = main(["convert-weights", "--to", "mindformers", str(init_pt), "--out", str(target),
               "--num-heads", str(m.num_attention_heads), "--num-query-groups", str(m.num_query_groups),
               "--mapping", EXAMPLES[kind][1]])
    if rc != 0:
        raise RuntimeError(f"align convert-weights exited {rc}")
    return target


def example_yaml(store: Path, out: Path, example: Path = EXAMPLE) -> Path:
    """The example with its two placeholders filled in (what ``sed`` does in the docs): OUT/train.yaml."""
    text = example.read_text()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "train.yaml"
    path.write_text(text.replace("@STORE@", str(store)).replace("@OUT@", str(out)))
    return path


def launch_env(out: Path) -> dict[str, str]:
    """The checkout on PYTHONPATH; OM_MODULES_CACHE only keeps MindFormers' copy of the module out of ~/.cache."""
    return dict(os.environ, PYTHONPATH=str(REPO), OM_MODULES_CACHE=str(out / "om_modules"))


def run_mindformer(script: Path, config: Path, out: Path, python: list[str] | None = None,
                   example: Path = EXAMPLE, extra: tuple[str, ...] = ()) -> str:
    """``python SCRIPT --config CONFIG --register_path DIR [EXTRA]`` from OUT (MindFormers writes ./output at
    import); returns its output, raises with the tail when it fails."""
    cmd = [*(python or [sys.executable]), str(script), "--config", str(config), "--register_path",
           str(register_path(example)), *extra]
    proc = subprocess.run(cmd, cwd=out, env=launch_env(out), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=300, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-4000:]}")
    return proc.stdout


def report(baseline: Path, candidate: Path, config: Path, out: Path, rerun: Path | None = None
           ) -> tuple[int, dict]:
    """``align report BASELINE CANDIDATE --candidate-config YAML [--rerun RUN] --out DIR``: exit status and
    summary.json."""
    from align.cli import main

    rc = main(["report", str(baseline), str(candidate), "--candidate-config", str(config), "--out", str(out),
               *(["--rerun", str(rerun)] if rerun else [])])
    return rc, json.loads((out / "summary.json").read_text())


# ---------------------------------------------------------------------------------------------------------

pytest.importorskip("mindformers")
pytest.importorskip("megatron.core")


@pytest.mark.parametrize("kind", sorted(EXAMPLES))
def test_example_has_two_placeholders_and_names_its_register_path(kind: str) -> None:
    example = EXAMPLES[kind][0]
    text = example.read_text()
    assert set(re.findall(r"@[A-Z_]+@", text)) == {"@STORE@", "@OUT@"}
    register = register_path(example)
    assert register.is_dir() and register.is_relative_to(REPO)
    cfg = yaml.safe_load(text)
    names = [cfg["train_dataset_task"]["auto_register"], cfg["runner_wrapper"]["auto_register"],
             *(c["auto_register"] for c in cfg["callbacks"] if "auto_register" in c)]
    assert len(names) == 3 and all((register / f"{n.split('.')[0]}.py").is_file() for n in names)
    assert cfg["load_checkpoint"] == f"@OUT@/{WEIGHTS}" and cfg["train_dataset"]["data_dir"] == "@STORE@"
    assert cfg["context"]["mode"] == 0 and cfg["use_legacy"] is False


@pytest.fixture(scope="module")
def yaml_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Megatron store + converted weights, then the example YAML through run_mindformer.py (3 steps, GRAPH)."""
    root = tmp_path_factory.mktemp("mf_yaml")
    store, init_pt = make_megatron_store(root / "baseline")
    out = root / "mf"
    convert_weights(init_pt, out)
    config = example_yaml(store, out)
    run_mindformer(REPO / "tests" / "helpers" / "run_mindformer.py", config, out)
    return {"store": store, "out": out, "config": config, "root": root}


@pytest.mark.timeout(400)
def test_example_yaml_replays_the_megatron_run_at_its_own_lr(yaml_run: dict[str, Path]) -> None:
    from runstore import RunReader
    from sources import load_run

    base, cand = RunReader(yaml_run["store"]), RunReader(yaml_run["out"] / "run")
    assert cand.array_steps() == list(range(1, STEPS + 1))
    for step in cand.array_steps():      # the batches MindFormers trained on are Megatron's, bit for bit
        got, want = cand.step_arrays(step).data, base.step_arrays(step).data
        for col, name in (("input_ids", "tokens"), ("labels", "labels"), ("loss_mask", "loss_mask")):
            np.testing.assert_array_equal(got[f"batch/{col}"], want[f"batch/{name}"])
    assert set(cand.step_arrays(1).table("local_norm").name) == {
        n for n in base.step_arrays(1).table("local_norm").name}          # named like Megatron's (19 tensors)
    # the lr it trained at is the YAML's lr_schedule, in the step outputs and in MindFormers' own log lines
    lr = float(yaml.safe_load(yaml_run["config"].read_text())["lr_schedule"]["learning_rate"])
    np.testing.assert_allclose(cand.scalars(0).lr.to_numpy(), np.full(STEPS, lr), rtol=1e-6)   # float32 lr
    logged = load_run(yaml_run["out"] / "output" / "log" / "rank_0" / "info.log").scalars["lr"]
    assert list(logged.index) == [1, 2, 3]
    np.testing.assert_allclose(logged.to_numpy(), np.full(STEPS, lr), rtol=1e-6)
    # layer statistics captured inside the compiled GRAPH step, under Megatron's module names
    assert cand.meta["layer_capture"]["mode"] == "GRAPH"
    stats = cand.step_arrays(1).table("tensor_stats")
    assert {"decoder.layers.0.self_attention", "decoder.layers.1.mlp"} <= set(stats.module)
    assert cand.step_arrays(2).table("tensor_stats") is None


@pytest.mark.timeout(400)
def test_align_report_passes_steps_1_and_2_against_megatron(yaml_run: dict[str, Path]) -> None:
    _assert_report_passes_steps_1_2(yaml_run, layer_tensors=True)


@pytest.mark.timeout(400)
def test_pynative_rerun_is_the_same_yaml_with_context_mode_1(yaml_run: dict[str, Path]) -> None:
    """The debug path for mcore: the same example (another @OUT@) with ``--context.mode 1`` re-runs the GRAPH
    run's model in PYNATIVE (MindFormers' own training class, named in ``architectures``; layer hooks); the
    report's rerun_check finds it reproduces the GRAPH run."""
    from runstore import RunReader

    out = yaml_run["root"] / "mf_pynative"
    out.mkdir()
    (out / WEIGHTS).write_bytes((yaml_run["out"] / WEIGHTS).read_bytes())
    config = example_yaml(yaml_run["store"], out)
    run_mindformer(REPO / "tests" / "helpers" / "run_mindformer.py", config, out, extra=("--context.mode", "1"))
    rerun = RunReader(out / "run")
    assert rerun.meta["layer_capture"]["mode"] == "PYNATIVE"
    assert {"decoder.layers.0.self_attention.core_attention", "decoder.layers.1.mlp"} <= set(
        rerun.step_arrays(1).table("tensor_stats").module)
    _, summary = report(yaml_run["store"], yaml_run["out"] / "run", yaml_run["config"], yaml_run["root"] / "rr",
                        rerun=out / "run")
    assert summary["stages"]["rerun_check"]["verdict"] == "pass", summary["stages"]["rerun_check"]


def _assert_report_passes_steps_1_2(run: dict[str, Path], layer_tensors: bool) -> None:
    rc, summary = report(run["store"], run["out"] / "run", run["config"], run["root"] / "report")
    stages = summary["stages"]
    for stage in ("step1_loss", "step1_local_norm", "step2_loss", "data_checks", "lr_schedule", "grad_norm"):
        assert stages[stage]["verdict"] == "pass", (stage, stages[stage])
    if layer_tensors:   # GRAPH statistics vs Megatron's tensors (warns: Megatron dumped more modules)
        assert stages["layer_tensors"]["verdict"] in ("pass", "warn")
    assert not [f for f in summary["findings"] if f["verdict"] == "fail"] and rc == 0
    rows = {r["key"]: r for r in stages["checklist"]["rows"]}
    # the replay's batch (the YAML says batch_size 1: one row is one whole Megatron step) is read from the store
    for key in ("global_batch_size", "micro_batch_size", "seq_length", "lr", "weight_decay", "norm_type"):
        assert rows[key]["status"] == "match", rows[key]
    # the one difference it reports is real: MindFormers' flash-attention path rounds q, k, v to float16
    assert [k for k, r in rows.items() if r["status"] not in ("match", "not read")] == ["flash_attention"]


@pytest.mark.timeout(400)
def test_moe_example_yaml_trains_qwen3_moe_from_megatron_weights(tmp_path: Path) -> None:
    """The MoE example (routed experts, grouped GEMM; CPU stand-ins for the router, dispatcher and experts) the
    same way: Megatron's batches bit-equal, steps 1-2 pass against a megatron-core MoE run."""
    from runstore import RunReader

    example = EXAMPLES["moe"][0]
    store, init_pt = make_megatron_store(tmp_path / "baseline", kind="moe", tensor_steps="")
    out = tmp_path / "mf"
    convert_weights(init_pt, out, kind="moe")
    config = example_yaml(store, out, example)
    run_mindformer(REPO / "tests" / "helpers" / "run_mindformer.py", config, out, example=example)
    base, cand = RunReader(store), RunReader(out / "run")
    assert cand.array_steps() == list(range(1, STEPS + 1))
    for step in cand.array_steps():
        np.testing.assert_array_equal(cand.step_arrays(step).data["batch/input_ids"],
                                      base.step_arrays(step).data["batch/tokens"])
    names = set(cand.step_arrays(1).table("local_norm").name)
    # the callback records the stacked experts per expert (weight1[e]), in place of the stacked row
    assert {"decoder.layers.0.mlp.experts.weight1[0]", "decoder.layers.0.mlp.experts.weight2[3]",
            "decoder.layers.1.mlp.router.weight"} <= names and "decoder.layers.0.mlp.experts.weight1" not in names
    _assert_report_passes_steps_1_2({"store": store, "out": out, "config": config, "root": tmp_path},
                                    layer_tensors=False)
