"""The diagnosis: the culprit first, the failures it explains marked as its consequences, and what a verdict
covers (align/procedure/diagnosis.py). On stage results shaped like the demo faults' (the fault tests check
the real ones)."""

from __future__ import annotations

from align.procedure.diagnosis import _reach, coverage, diagnose
from align.stages import PARTS, registry
from core.findings import Finding, StageResult


def result(stage: str, *findings: tuple[str, str | None, str, float | None, float | None]) -> StageResult:
    res = StageResult(stage)
    for verdict, component, metric, value, threshold in findings:
        res.add(Finding(stage, verdict, component, metric, value, threshold, f"{stage} {component} {verdict}"))
    return res


def results(*stage_results: StageResult) -> dict[str, StageResult]:
    """Every registered stage, skipped unless given (as run_stages returns them), in the guide's order."""
    given = {r.name: r for r in stage_results}
    return {s.name: given.get(s.name, StageResult(s.name, "skipped", {"reason": "no data", "capture": s.capture}))
            for s in registry()}


def test_every_stage_has_a_part_a_why_and_a_next_and_only_layer_stages_explain_each_other():
    stages = registry()
    for s in stages:
        assert s.part in PARTS and s.why and (s.next or s.part == "inputs"), s.name
        for name in s.explains:
            assert name == "*" or name in {x.name for x in stages}, (s.name, name)
    reach = _reach({s.name: s for s in stages})
    # stages that explain each other settle it by the layer their findings name: only the step-1 localisers
    mutual = {tuple(sorted((a, b))) for a in reach for b in reach[a] if a in reach[b] and a != b}
    assert mutual <= {("isolation", "layer_tensors"), ("isolation", "moe_routing"),
                      ("layer_tensors", "moe_routing")}, mutual


def test_a_forward_departure_is_the_culprit_and_the_loss_it_moves_its_consequence():
    # qk_swap's shape: the loss, the local norms (largest on the embedding), the lr = 0 pair and the long run
    # all fail; the layer profile names the attention of layer 0
    got = diagnose(results(
        result("step1_loss", ("fail", "loss", "rel_delta", 0.02, 0.005)),
        result("step1_local_norm", ("fail", "decoder.layers.1.mlp.linear_fc2.weight", "local_norm_rel_diff",
                                    0.01, 1e-4),
               ("fail", "embedding.word_embeddings.weight", "local_norm_rel_diff", 0.5, 1e-4)),
        result("layer_tensors", ("fail", "decoder.layers.0.self_attention.core_attention", "rel_l2", 0.1, 2e-3),
               ("fail", "decoder.layers.1.mlp", "rel_l2", 0.9, 2e-3)),
        result("lr0_run", ("fail", "loss", "max_rel_loss", 0.02, 1e-3)),
        result("long_run", ("fail", "loss", "outside_band_fraction", 0.9, 0.05)),
        result("grad_norm", ("warn", "grad_norm", "outside_band_fraction", 0.1, 0.05)),
        result("band", ("warn", "repeat", "silent_repeat", None, None)),
        result("divergence_data", ("warn", "step 1", "divergence_data", 1, None))))
    assert [e["stage"] for e in got][0] == "layer_tensors"
    assert got[0]["component"] == "decoder.layers.0.self_attention.core_attention"   # the first, not the largest
    assert got[0]["consequence_of"] is None and "isolate" in got[0]["next"]
    assert [e["component"] for e in got[0]["seen_at"]] == ["embedding.word_embeddings.weight"]   # not "loss"
    assert "isolate BASELINE --candidate-yaml CANDIDATE.yaml" in got[0]["next"]
    assert "decoder.layers.0.self_attention.core_attention" in got[0]["next"]
    assert {e["stage"]: e["consequence_of"] for e in got[1:]} == {
        "step1_loss": "layer_tensors", "step1_local_norm": "layer_tensors", "lr0_run": "layer_tensors",
        "long_run": "layer_tensors", "grad_norm": "layer_tensors",   # a warning it explains; the band's is not
        "divergence_data": "layer_tensors"}
    # within a stage, the largest ratio of one metric names the component (local norms alone)
    alone = diagnose(results(result("step1_local_norm",
                                    ("fail", "a.weight", "local_norm_rel_diff", 0.01, 1e-4),
                                    ("fail", "embedding.word_embeddings.weight", "local_norm_rel_diff", 0.5, 1e-4))))
    assert alone[0]["component"] == "embedding.word_embeddings.weight"


def test_a_failure_outranks_warnings_of_its_stage():
    # no_clip's shape: per-parameter updates warn in model order, the clipping check fails
    warns = [("warn", f"decoder.layers.{i}.mlp.linear_fc1.weight", "update_rel_diff", 5e-3, 1e-3)
             for i in range(8)]
    got = diagnose(results(result("optimizer", *warns, ("fail", "clipping (candidate training cell)",
                                                        "clip_coefficient", 1.0, 0.1)),
                           result("step2_loss", ("fail", "loss", "rel_delta", 0.01, 0.005))))
    assert got[0]["stage"] == "optimizer" and got[0]["component"].startswith("clipping")
    assert got[1] == {**got[1], "stage": "step2_loss", "consequence_of": "optimizer"}


def test_a_router_in_a_later_layer_does_not_explain_an_earlier_departure_and_the_reverse():
    attention0 = result("layer_tensors", ("fail", "decoder.layers.0.self_attention", "rel_l2", 0.1, 2e-3))
    router1 = result("moe_routing", ("fail", "decoder.layers.1.mlp.router", "topk_changed", 0.3, 0.0))
    got = diagnose(results(attention0, router1))
    assert [(e["stage"], e["consequence_of"]) for e in got] == [("layer_tensors", None),
                                                                ("moe_routing", "layer_tensors")]
    mlp1 = result("layer_tensors", ("fail", "decoder.layers.1.mlp", "rel_l2", 0.1, 2e-3))
    got = diagnose(results(mlp1, router1, result("step1_loss", ("fail", "loss", "rel_delta", 0.02, 0.005))))
    assert got[0]["stage"] == "moe_routing"     # same layer: the router, closer to the cause
    assert {e["stage"]: e["consequence_of"] for e in got[1:]} == {"step1_loss": "moe_routing",
                                                                  "layer_tensors": "moe_routing"}


def test_setup_failures_explain_every_later_part_and_unrelated_failures_stay_roots():
    got = diagnose(results(result("data_checks", ("fail", "loss_mask", "eod_masked", 3, 0)),
                           result("step1_loss", ("fail", "loss", "rel_delta", 0.02, 0.005)),
                           result("lr_schedule", ("fail", "learning_rate", "first_step", 2, None))))
    assert [(e["stage"], e["consequence_of"]) for e in got] == [
        ("data_checks", None), ("step1_loss", "data_checks"), ("lr_schedule", "data_checks")]
    got = diagnose(results(result("lr_schedule", ("fail", "learning_rate", "first_step", 2, None)),
                           result("nan_trace", ("fail", "decoder.layers.0.mlp.linear_fc2.weight",
                                                "first_nonfinite_grad", 3, None)),
                           result("nonfinite", ("fail", "loss", "first_nonfinite", 3, None))))
    assert [(e["stage"], e["consequence_of"]) for e in got] == [
        ("lr_schedule", None), ("nan_trace", None), ("nonfinite", "nan_trace")]


def test_nothing_failing_is_no_diagnosis_and_a_partial_pass_says_what_it_covers():
    clean = results(result("step1_loss", ("pass", "loss", "rel_delta", 0.0, 0.005)),
                    result("step2_loss", ("pass", "loss", "rel_delta", 0.0, 0.005)),
                    result("long_run", ("warn", "loss", "mean_delta", 0.6, 0.5)))
    assert diagnose(clean) == []
    cov = coverage(clean, "pass")
    n = sum(1 for s in registry() if s.part != "inputs")
    assert cov["banner"] == (f"PASS on 3 of {n} stages (step 1 and 2 and long run): checklist and same start "
                             "not compared")
    assert cov["parts"]["step 1 and 2"]["ran"] == ["step1_loss", "step2_loss"]
    assert "step1_local_norm" in cov["parts"]["step 1 and 2"]["skipped"]
    assert "Weight conversion" in cov["statement"] and "Checklist" in cov["statement"]
    every = results(*[result(s.name, ("pass", None, "x", None, None)) for s in registry()])
    assert coverage(every, "pass")["banner"] == "PASS on every part of the procedure"


def _report(tmp_path, res: dict[str, StageResult]) -> tuple[dict, str]:
    from align.procedure.diagnosis import coverage as cover
    from reports.writer import ReportInput, overall_verdict, write_report

    data = write_report(ReportInput([], res, diagnosis=diagnose(res), coverage=cover(res, overall_verdict(res)),
                                    titles={s.name: s.title for s in registry()}), tmp_path / "r")
    return data, (tmp_path / "r" / "report.html").read_text()


def test_the_first_screen_and_the_terminal_lead_with_the_culprit(tmp_path):
    from reports.terminal import lines

    warns = [("warn", f"decoder.layers.{i}.mlp.linear_fc1.weight", "update_rel_diff", 5e-3, 1e-3) for i in range(8)]
    res = results(result("step1_loss", ("pass", "loss", "rel_delta", 0.0, 0.005)),
                  result("optimizer", *warns, ("fail", "clipping (candidate training cell)", "clip_coefficient",
                                               1.0, 0.1)),
                  result("step2_loss", ("fail", "loss", "rel_delta", 0.01, 0.005)),
                  result("long_run", ("fail", "loss", "outside_band_fraction", 0.9, 0.05)))
    data, page = _report(tmp_path, res)
    assert data["diagnosis"][0]["component"] == "clipping (candidate training cell)"
    assert data["coverage"]["banner"].startswith("FAIL, with 4 of ")
    # the banner, the culprit with why and next, what the verdict covers; then the stages; no findings table
    at = [page.index(s) for s in ("Verdict: FAIL", "Culprit:", "clipping (candidate training cell)",
                                  "Why it matters:", "Next:", "What this verdict covers", "<h2>Stages</h2>")]
    assert at == sorted(at) and "<h2>Findings" not in page
    # the stage row puts the failure before the eight warnings; the name links to the stage's section
    row = page[page.index('<a href="#stage-optimizer">optimizer</a></td>'):]
    assert row.index("clipping (candidate training cell) fail") < row.index("linear_fc1.weight warn")
    assert "id='stage-optimizer'" in page
    text = lines(data, tmp_path / "r")
    head = text[:text.index("stages:")]
    assert head[0].startswith("verdict: fail - with 4 of ") and len(head) <= 6      # verdict + <= 5 lines
    assert head[1] == "culprit: optimizer: clipping (candidate training cell)"
    assert "  consequences (fix the culprit first): step2_loss, long_run" in head
    assert any(line.startswith("  step2_loss") and "follows from optimizer" in line for line in text)
    skipped = [line for line in text if "skipped for want of evidence" in line]
    assert len(skipped) == 1 and "checklist" in skipped[0]
    assert sum("to run it:" in line for line in lines(data, None, explain=True)) >= 10


def test_a_clean_pass_says_so_on_the_first_screen(tmp_path):
    res = results(result("step1_loss", ("pass", "loss", "rel_delta", 0.0, 0.005)))
    res["step1_loss"].details["power"] = {"text": "a 0.3% loss offset would have failed"}
    data, page = _report(tmp_path, res)
    assert data["diagnosis"] == [] and "No stage failed or warned" in page
    assert "a 0.3% loss offset would have failed" in page
    assert page.index("PASS on 1 of") < page.index("<h2>Stages</h2>")


def test_a_passing_stage_says_on_the_terminal_what_it_could_have_seen(tmp_path):
    """A PASS line carries its bound: the floor-judged stages their detectable difference and margin, the band
    tests the sustained offset and the mean offset ruled out, the others their relative delta against its line."""
    from reports.terminal import lines

    res = results(result("step1_loss", ("pass", "loss", "rel_delta", 9.8e-7, 0.005)),
                  result("step1_local_norm", ("pass", "decoder.layers.0.mlp.linear_fc1.weight", "rel_diff", 1e-5,
                                              3e-4)),
                  result("lr0_run", ("pass", "loss", "max_rel_loss", 1e-6, 2e-5)),
                  result("long_run", ("pass", "loss", "outside_band_fraction", 0.0, 0.05)))
    res["step1_local_norm"].details["power"] = {"detectable": 0.0026, "margin": 0.033, "judged": 33}
    res["lr0_run"].details["power"] = {"detectable": 4e-5, "loss": {"detectable": 4e-5, "margin": 0.035, "judged": 20},
                                       "grad_norm": {"detectable": 3e-4, "margin": 0.04, "judged": 20}}
    res["long_run"].details["power"] = {"detectable_rel": 0.0003, "margin_rel": 3.9e-5, "detectable": 1e-3}
    data, _ = _report(tmp_path, res)
    text = {line.split()[0]: line for line in lines(data)[2:] if line.startswith("  ") and "pass" in line}
    assert text["step1_loss"].endswith("pass  rel_delta 9.8e-07 <= 0.005")
    assert text["step1_local_norm"].endswith("detects 0.0026 relative in one of 33; margin 30.3x")
    assert text["lr0_run"].endswith("detects 0.0003 relative in one of 20; margin 25x")    # the tighter quantity
    assert text["long_run"].endswith("detects a sustained offset of 0.03%; mean offset <= 0.0039%")


def test_an_isolated_module_leads_to_the_drill_then_the_repro_and_a_loss_culprit_to_isolating_the_loss():
    """The loop a user walks: isolation's culprit names the exact `align drill` and `align repro` commands for its
    module; the lr = 0 stage's (the loss computed at another precision) the isolation of the loss and embedding."""
    got = diagnose(results(result("isolation", ("fail", "decoder.layers.1.input_layernorm", "own_rel_l2", 4.1, 1e-4))),
                   fill={"baseline": "/runs/base", "candidate_yaml": "/cfg/cand.yaml"})
    assert got[0]["stage"] == "isolation"
    assert ("align drill /runs/base --module decoder.layers.1.input_layernorm --candidate-yaml /cfg/cand.yaml "
            "--candidate-ckpt CKPT --out drill_decoder.layers.1.input_layernorm") in got[0]["next"]
    assert got[0]["next"].index("align drill") < got[0]["next"].index("align repro ISOLATION_RUN")
    got = diagnose(results(result("lr0_run", ("fail", "loss", "max_rel_loss", 0.02, 1e-3))))
    assert "--modules loss --modules embedding" in got[0]["next"] and "modules=['embedding', 'loss']" in got[0]["next"]
