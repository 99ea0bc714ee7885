"""`align demo --model moe` / `--model mla`: megatron-core MoE (and MLA) vs MindFormers 2.x mcore Qwen3-MoE /
DeepSeek-V3-style models on CPU, short clean pairs.

Why a file of its own: the dense and llama pairs have theirs (tests/test_demo.py, test_demo_legacy.py). Each
pair runs 6 steps (lr = 0 pair: 2) and must pass every stage it judges. The moe pair keeps its repeat (DP=2
with float16-rounded attention: the band for a candidate that computes attention in float16); the mla pair
skips it for time (its band then falls back to --rtol, and the band stage is skipped). Measured here on 2 cores:
moe 52 s, mla 57 s at a load average of ~4 (153 s and 121 s at ~11): mostly framework start-up and the
candidate's GRAPH compile (measured with the former PYNATIVE layer-capture twin; the layers now come from the GRAPH
step).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")
pytest.importorskip("mindspore")
pytest.importorskip("mindformers")

from demo.fault_batch import FaultPair, paired_faults  # noqa: E402
from demo.pair import paired_demo  # noqa: E402
from demo.spec import FAULTS, SWAP_LAYER  # noqa: E402
from tests.helpers.demo_checks import culprit_is, selected  # noqa: E402

STEPS = 6
LR0_STEPS = 2
JUDGED = ("checklist", "conversion", "data_checks", "step1_loss", "step1_local_norm", "layer_tensors",
          "moe_routing", "step2_loss", "optimizer", "lr0_run", "long_run", "grad_norm", "lr_schedule", "nonfinite",
          "nan_trace")
# every candidate parameter by name (Megatron's names). Stacked experts are recorded per expert by the candidate's
# dumper (`weight1[e]`, dumpers/mindspore_expert_norms.py) and pair one by one with Megatron's experts: each
# layer's 2 stacked tensors became 2 x 4 rows (moe 21 + 2 layers x 6 = 33; mla 31 + 12 = 43).
PARAMETERS = {"moe": 33, "mla": 43}
EXPERTS, LAYERS = 4, 2


# each clean pair draws its weights and batches with a seed of its own (the dense pair in test_demo.py keeps the
# default 1234): a clean pair passes whatever the seed, not for one lucky draw
SEEDS = {"moe": 5, "mla": 7}


def _clean(kind: str, out: Path, repeat: bool) -> dict:
    return paired_demo(out, steps=STEPS, lr0_steps=LR0_STEPS, model_kind=kind, repeat=repeat, seed=SEEDS[kind])


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """The clean moe pair (with its repeat): the clean test judges it, the router fault tests reuse its
    baseline-side runs."""
    out = tmp_path_factory.mktemp("moe")
    return out, _clean("moe", out, True)


@pytest.fixture(scope="module", params=[("moe", True), ("mla", False)], ids=["moe", "mla"])
def clean(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, bool, Path, dict]:
    kind, repeat = request.param
    if kind == "moe":
        return (kind, repeat, *request.getfixturevalue("moe_pair"))
    out = tmp_path_factory.mktemp(kind)
    return kind, repeat, out, _clean(kind, out, repeat)


def test_clean_pair_passes_every_judged_stage(clean: tuple[str, bool, Path, dict]) -> None:
    kind, repeat, out, data = clean
    assert data["verdict"] == "pass", [f for f in data["findings"] if f["verdict"] != "pass"]
    assert data["diagnosis"] == []
    for stage in JUDGED + (("band",) if repeat else ()):
        assert data["stages"][stage]["verdict"] == "pass", (stage, data["stages"][stage])
    assert data["stages"]["step1_loss"]["rel_delta"] < 1e-5
    ln = data["stages"]["step1_local_norm"]
    assert ln["compared"] == PARAMETERS[kind]
    # one row per routed expert, by its global index on both sides, never a layer's experts under one name
    experts = {(r["name"], r["candidate"]) for r in ln["parameters"] if ".experts." in r["name"]}
    assert experts == {(f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc{k}.weight",
                        f"decoder.layers.{i}.mlp.experts.weight{k}[{e}]")
                       for i in range(LAYERS) for e in range(EXPERTS) for k in (1, 2)}
    assert data["stages"]["layer_tensors"]["compared"] >= 20
    runs = out / "runs"
    cand = json.loads((runs / "candidate" / "meta.json").read_text())
    cfg = cand["config"].get("values", cand["config"])
    want = {"moe": ("qwen3_moe", ["TrainingQwen3MoeForCausalLM"]),
            "mla": ("deepseek_v3", ["TrainingDeepseekV3ForCausalLM"])}[kind]
    mcfg = cfg["model"]["model_config"]     # the YAML the candidate was built from (MindFormers' build_network)
    assert cfg["use_legacy"] is False and (mcfg["model_type"], mcfg["architectures"]) == want
    assert "graph" in cand.get("candidate_mode", "")          # trained in GRAPH, layer statistics from it too
    assert cand["layer_capture"]["mode"] == "GRAPH" and data["stages"]["layer_tensors"]["mode"] == "stats"
    # the mapping preset is chosen from the candidate's config (model_type qwen3_moe / deepseek_v3)
    assert ln["mapping"] == f"megatron_core__mindformers_mcore_{kind}"
    if repeat:
        rep = json.loads((runs / "repeat_dp2" / "meta.json").read_text())
        assert rep["parallel"]["dp"] == 2 and "float16" in rep.get("attention", "")


def test_perturbed_expert_named_by_global_index(clean: tuple[str, bool, Path, dict]) -> None:
    """The candidate's real step-1 norms (its dumper wrote them per expert), one expert's gradient norm scaled
    by 1.01 in a copy: the step-1 stage fails naming that expert by its global index on both sides."""
    from comparators.local_norms import compare_norm_entries, read_local_norms
    from models import load_mapping

    kind, _, out, data = clean
    runs = out / "runs"
    base, _ = read_local_norms(runs / "baseline", 1)
    cand, _ = read_local_norms(runs / "candidate", 1)
    hit = "decoder.layers.1.mlp.experts.weight2[2]"
    cand[hit].shards = {0: cand[hit].shards[0] * 1.01}
    res = compare_norm_entries(base, cand, load_mapping(data["stages"]["step1_local_norm"]["mapping"]))
    bad = [f for f in res.findings if f.verdict == "fail"]
    assert [f.component for f in bad] == ["decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight"], bad
    assert hit in bad[0].message
    routing = data["stages"]["moe_routing"]     # every router recorded on both sides, compared alike
    assert routing["compared"] == 2 and routing["routers"] == [f"decoder.layers.{i}.mlp.router" for i in (0, 1)]
    assert all(r["topk_agreement"] > 0.9 and r["baseline_precision"] == r["candidate_precision"] == "float32"
               for r in routing["per_layer"])
    # tokens per expert at every step on both sides; step 1 (same weights, same batch) alike
    assert routing["counts_steps"] == STEPS and routing["counts_by_step"][0]["moved_share"] == 0.0


ROUTER_FAULTS = ["router_fp16", "expert_swap"]
TEST = "test_router_fault_is_named_at_the_router"


@pytest.fixture(scope="module")
def router_faults(request: pytest.FixtureRequest, moe_pair: tuple[Path, dict],
                  tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """The selected router faults, 2-step candidates on the clean moe pair's baseline, no lr = 0 pair, no
    optimizer check, in PYNATIVE (the router wrapped there as in GRAPH: no compile), in one MindSpore process."""
    out = tmp_path_factory.mktemp("router_faults")
    names = selected(request, TEST, "inject", ROUTER_FAULTS)
    return paired_faults(out, [FaultPair(n, 2) for n in names], reuse_baseline=moe_pair[0], model_kind="moe",
                         seed=SEEDS["moe"])


@pytest.mark.parametrize("inject", ROUTER_FAULTS)
def test_router_fault_is_named_at_the_router(inject: str, router_faults: dict[str, dict]) -> None:
    """A router computed in float16 on the candidate, and a conversion that swaps two experts' router rows of
    layer 1, each fail moe_routing naming the router."""
    data = router_faults[inject]
    fault = FAULTS[inject]
    routing = data["stages"]["moe_routing"]
    assert fault.stage == "moe_routing" and routing["verdict"] == "fail"
    failing = [f for f in data["findings"] if f["stage"] == "moe_routing" and f["verdict"] == "fail"]
    assert failing and all(fault.component in f["component"] for f in failing), failing
    culprit_is(data, fault, "moe")
    if inject == "router_fp16":        # every router, by its precision
        assert routing["failing_routers"] == routing["routers"]
        assert {f["metric"] for f in failing} >= {"router_precision"}
        assert all(f["value"] == "float16" for f in failing if f["metric"] == "router_precision")
    else:                               # layer 1's router only: experts 0 and 1 in the other order
        assert routing["failing_routers"] == [f"decoder.layers.{SWAP_LAYER}.mlp.router"]
        assert {"expert_order", "tokens_per_expert"} <= {f["metric"] for f in failing}
        assert any(f["value"] == "0->1, 1->0" for f in failing if f["metric"] == "expert_order")
