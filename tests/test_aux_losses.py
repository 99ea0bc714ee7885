"""The aux_losses stage on run stores written here with the run-store writer (framework-free, fast), and on a
log line MindFormers 2.1.0's MFLossMonitor printed (tests/data/mindformers_2x/moe_mtp.log) against a store."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import yaml

from align.cli import main
from comparators.aux_losses import MEGATRON, MINDFORMERS, AuxSettings, compare_aux_losses, convention
from comparators.scalars import ScalarOptions
from runstore import RunWriter
from runstore.run import Run, make_series, open_store
from sources.megatron_log import parse_megatron_log
from sources.mindformers_log import parse_mindformers_log
from tests.helpers.megatron_log_text import training_lines

DATA = Path(__file__).resolve().parent / "data" / "mindformers_2x"
STEPS = 20


def values(step: int, rank: int = 0, ranks: int = 1) -> dict[str, float]:
    """One step of a Megatron-LM MoE + 2-layer MTP run, as the wrapper stores it (z_loss per rank)."""
    z = 2.0 + 0.01 * step + (0.1 * (rank - 0.5) if ranks > 1 else 0.0)   # the ranks' mean: the 1-rank value
    return {"loss": 10 - 0.05 * step, "grad_norm": 1.0, "lr": 1e-3 * min(step, 5) / 5,
            "load_balancing_loss": 1.1 - 0.001 * step, "z_loss": z,
            "mtp_1_loss": 10.5 - 0.05 * step, "mtp_2_loss": 10.7 - 0.05 * step}


def store(path: Path, *, keys: tuple[str, ...] | None = None, plant: tuple[str, int, float] | None = None,
          ranks: int = 1, noise: float = 0.0, seed: int = 0) -> Path:
    """A store; ``keys``: the aux losses it keeps (all by default); ``plant``: (key, step, factor);
    ``noise``: relative Gaussian noise on the aux losses (a run that is not deterministic)."""
    rng = np.random.default_rng(seed)
    for rank in range(ranks):
        with RunWriter(path, rank=rank, meta={"framework": "megatron-core",
                                              "parallel": {"dp": ranks, "pp": 1, "tp": 1}}) as w:
            for s in range(1, STEPS + 1):
                v = values(s, rank, ranks)
                v = {k: x for k, x in v.items() if keys is None or k in ("loss", "grad_norm", "lr") or k in keys}
                for k in [k for k in v if k.endswith("_loss")]:
                    v[k] *= 1 + noise * rng.standard_normal()
                if plant and s == plant[1]:
                    v[plant[0]] *= plant[2]
                w.log_scalars(s, v)
                w.finish_step()
    return path


def report(tmp: Path, *runs: Path | str, extra: tuple[str, ...] = ()) -> tuple[int, dict]:
    out = tmp / f"report_{len(list(tmp.glob('report_*')))}"
    rc = main(["report", *map(str, runs), "--out", str(out), *extra])
    return rc, json.loads((out / "summary.json").read_text())


def aux_findings(summary: dict, verdict: str) -> list[dict]:
    return [f for f in summary["findings"] if f["stage"] == "aux_losses" and f["verdict"] == verdict]


def test_two_stores_compare_lr_and_every_aux_loss(tmp_path: Path) -> None:
    rc, s = report(tmp_path, store(tmp_path / "a"), store(tmp_path / "b"))
    # two stores written alike: their losses are equal bit for bit, which input sanity flags (and only that)
    assert rc == 0 and s["verdict"] == "warn"
    assert [f["metric"] for f in s["findings"] if f["verdict"] != "pass"] == ["identical_losses"]
    assert s["stages"]["lr_schedule"]["verdict"] == "pass" and s["stages"]["lr_schedule"]["steps"] == STEPS
    aux = s["stages"]["aux_losses"]
    assert aux["verdict"] == "pass"
    # the per-layer MTP losses and their sum (summed here: the store has none), each judged at every step
    assert aux["compared"] == ["load_balancing_loss", "z_loss", "mtp_loss", "mtp_1_loss", "mtp_2_loss"]
    assert {r["loss"]: r["steps"] for r in aux["losses"]} == dict.fromkeys(aux["compared"], STEPS)
    mtp = next(r for r in aux["losses"] if r["loss"] == "mtp_loss")
    assert "summed here from mtp_1_loss, mtp_2_loss" in mtp["baseline_scaling"] and mtp["factor"] == 1.0
    assert {f["component"] for f in aux_findings(s, "pass")} == set(aux["compared"])


def test_a_planted_difference_at_one_step_fails_naming_the_loss_and_step(tmp_path: Path) -> None:
    a = store(tmp_path / "a")
    rc, s = report(tmp_path, a, store(tmp_path / "b", plant=("z_loss", 13, 1.02)))
    assert rc == 1 and s["stages"]["aux_losses"]["verdict"] == "fail"
    [bad] = aux_findings(s, "fail")
    assert bad["component"] == "z_loss" and bad["metric"] == "first_step_outside" and bad["value"] == 13
    assert "z_loss first differs at step 13" in bad["message"] and "1 of 20 steps" in bad["message"]
    assert s["stages"]["long_run"]["verdict"] == "pass"           # the lm loss did not move
    # a per-layer MTP loss at step 1: that layer and the sum fail, the other layer passes
    res = compare_aux_losses(open_store(a), open_store(store(tmp_path / "c", plant=("mtp_2_loss", 1, 0.99))))
    assert {(f.component, f.value) for f in res.findings if f.verdict == "fail"} == {("mtp_2_loss", 1),
                                                                                     ("mtp_loss", 1)}
    # within the step tolerance (0.5%): a pass
    res = compare_aux_losses(open_store(a), open_store(store(tmp_path / "d", plant=("z_loss", 13, 1.004))))
    assert res.verdict == "pass"


def test_missing_on_one_side_is_skipped_with_what_to_capture(tmp_path: Path) -> None:
    rc, s = report(tmp_path, store(tmp_path / "a"), store(tmp_path / "b", keys=()))
    aux = s["stages"]["aux_losses"]
    assert rc == 0 and aux["verdict"] == "skipped"
    assert aux["reason"] == "no aux loss (load balancing, z, MTP) in candidate (b)"
    assert "dumpers.megatron_lm" in aux["capture"] and "print_separate_loss" in aux["capture"]
    assert aux["needs"].startswith("an aux loss per step in both runs") and aux["losses"] is None
    # both sides log some, none in common: skipped naming each side's
    rc, s = report(tmp_path, store(tmp_path / "c", keys=("z_loss",)), store(tmp_path / "d", keys=("mtp_1_loss",)))
    assert s["stages"]["aux_losses"]["reason"] == ("no aux loss in both runs: baseline has z_loss; candidate has "
                                                   "mtp_loss, mtp_1_loss")


def test_ranks_that_disagree_compare_as_their_mean(tmp_path: Path) -> None:
    """megatron-core 0.16 keeps z_loss per rank (no reduce group): a DP=2 store's ranks disagree; their mean is
    what one process over the same micro-batches logs, so a 1-process run and a DP=2 run agree."""
    rc, s = report(tmp_path, store(tmp_path / "one"), store(tmp_path / "dp2", ranks=2))
    assert rc == 0 and s["stages"]["aux_losses"]["verdict"] == "pass"
    z = next(r for r in s["stages"]["aux_losses"]["losses"] if r["loss"] == "z_loss")
    assert "2 ranks disagree" in z["candidate_scaling"] and z["max_rel_delta"] < 1e-12


def test_repeats_set_the_band_for_later_steps(tmp_path: Path) -> None:
    """Runs that are not deterministic differ by ~1% from step 3 on: without a repeat that fails at the step
    tolerance; a repeat of the baseline that differs as much sets a band they stay inside."""
    opt = ScalarOptions(band_window=5)
    a = open_store(store(tmp_path / "a"))
    cand = open_store(store(tmp_path / "c", noise=0.01, seed=1))
    for run in (cand,):     # steps 1-2 deterministic (same weights, same data): equal there
        for k in ("load_balancing_loss", "z_loss", "mtp_1_loss", "mtp_2_loss"):
            run.scalars[k].loc[[1, 2]] = a.scalars[k].loc[[1, 2]]
    alone = compare_aux_losses(a, cand, [], opt)
    assert alone.verdict == "fail"
    rep = open_store(store(tmp_path / "r", noise=0.01, seed=2))
    banded = compare_aux_losses(a, cand, [rep], opt)
    assert banded.verdict == "pass", [f.message for f in banded.findings if f.verdict != "pass"]
    row = banded.details["losses"][0]
    assert "1 baseline repeat(s)" in row["band"] and row["outside_band_fraction"] <= opt.max_outside
    # the first two steps stay at the step tolerance, repeats or not
    cand.scalars["z_loss"].loc[2] *= 1.02
    bad = [f for f in compare_aux_losses(a, cand, [rep], opt).findings if f.verdict == "fail"]
    assert [(f.component, f.value) for f in bad] == [("z_loss", 2)]


def _megatron_store(path: Path, exp: dict, lb_factor: float, mtp_factor: float) -> Path:
    """The Megatron-LM side of MindFormers' moe_mtp.log: the same model and steps, in Megatron's scaling."""
    with RunWriter(path, meta={"framework": "megatron-core"}) as w:
        for i in range(4):
            w.log_scalars(i + 1, {"loss": exp["lm"][i], "lr": exp["lr"][i], "grad_norm": exp["gnorm"][i],
                                  "load_balancing_loss": exp["aux"][i] * lb_factor,
                                  "mtp_1_loss": exp["mtp"][i] * mtp_factor})
            w.finish_step()
    return path


def test_mindformers_log_line_against_a_megatron_store(tmp_path: Path) -> None:
    """MFLossMonitor's ``load_balancing_loss`` (over the 1 decoder MoE layer, the MTP layer's included) and
    ``mtp_loss`` (scaled by mtp_loss_factor 0.3 / 1 layer) against Megatron's (over MoE + MTP layers, 2;
    the MTP layer's unscaled cross-entropy): brought into Megatron's scaling with the YAML's settings."""
    exp = json.loads((DATA / "expected.json").read_text())["moe_mtp"]
    mg = _megatron_store(tmp_path / "mg", exp, lb_factor=1 / 2, mtp_factor=1 / 0.3)
    cfg = {"use_legacy": False, "model": {"model_config": {
        "type": "DeepseekV3Config", "num_hidden_layers": 2, "first_k_dense_replace": 1, "n_routed_experts": 4,
        "num_nextn_predict_layers": 1, "mtp_loss_factor": 0.3}}}
    yml = tmp_path / "mf.yaml"
    yml.write_text(yaml.safe_dump(cfg))
    log = DATA / "moe_mtp.log"
    rc, s = report(tmp_path, mg, log, extra=("--candidate-config", str(yml)))
    aux = s["stages"]["aux_losses"]
    assert aux["verdict"] == "pass" and aux["compared"] == ["load_balancing_loss", "mtp_loss"]
    rows = {r["loss"]: r for r in aux["losses"]}
    assert rows["mtp_loss"]["factor"] == 1 / 0.3 and "scaled" in rows["mtp_loss"]["candidate_scaling"]
    assert rows["load_balancing_loss"]["factor"] == 0.5
    assert all(r["max_rel_delta"] < 2e-5 for r in rows.values())   # MFLossMonitor prints 6 decimals
    assert aux["only_baseline"] == ["mtp_1_loss"]
    # Megatron's values equal to MindFormers' as printed fail: they are not in the same scaling
    unscaled = open_store(_megatron_store(tmp_path / "mg_as_logged", exp, lb_factor=1.0, mtp_factor=1.0))
    known = AuxSettings(mtp_num_layers=1, mtp_loss_scaling_factor=0.3, moe_layers=1, last_layer_moe=True)
    res = compare_aux_losses(unscaled, parse_mindformers_log(log), settings=known)
    assert {f.component for f in res.findings if f.verdict == "fail"} == {"load_balancing_loss", "mtp_loss"}
    # without the YAML the scalings cannot be matched: refused with a warning naming what to pass, not guessed
    rc, s = report(tmp_path, mg, log)
    aux = s["stages"]["aux_losses"]
    assert rc == 0 and aux["verdict"] == "warn" and aux["compared"] == []
    notes = {n["loss"]: n["reason"] for n in aux["not_compared"]}
    assert "mtp_loss_scaling_factor is not known" in notes["mtp_loss"] and "--candidate-config" in notes["mtp_loss"]
    assert "layer counts are not known" in notes["load_balancing_loss"]


def test_mindformers_load_balancing_pairs_with_the_megatron_type_logged() -> None:
    """MindFormers logs one load_balancing_loss whatever its type; Megatron names the global one
    global_load_balancing_loss: paired, and the note says so."""
    steps = np.arange(1, 6)
    lb = 1.0 + 0.01 * steps
    mg = Run("mg", "runstore", {"framework": "megatron-core"},
             {"loss": make_series(steps, 5 - 0.1 * steps, "loss"),
              "global_load_balancing_loss": make_series(steps, lb, "global_load_balancing_loss")})
    mf = Run("mf", "mindformers_log", {"framework": "mindformers"},
             {"loss": make_series(steps, 5 - 0.1 * steps, "loss"),
              "load_balancing_loss": make_series(steps, lb, "load_balancing_loss")})
    res = compare_aux_losses(mg, mf, settings=AuxSettings(mindformers_balance_type="gbs_aux_loss"))
    assert res.verdict == "pass" and res.details["compared"] == ["global_load_balancing_loss"]
    row = res.details["losses"][0]
    assert (row["baseline_key"], row["candidate_key"]) == ("global_load_balancing_loss", "load_balancing_loss")
    assert "paired with Megatron-LM's global_load_balancing_loss" in res.findings[0].message


def test_a_megatron_log_line_that_may_be_a_window_mean_warns_never_fails(tmp_path: Path) -> None:
    """A Megatron-LM log without its arguments block (version unknown): from core 0.16 its iteration-2 line
    is the mean of iterations 1 and 2, for the aux losses as for the lm loss. Against the store's own values
    the printed mean is outside the step tolerance and the read-back value inside: a warning naming both."""
    losses, lb = [4.80465, 4.83152, 4.79, 4.75, 4.7], [1.30, 1.10, 1.12, 1.11, 1.10]
    printed = [lb[0], float((np.float32(lb[0]) + np.float32(lb[1])) / 2), *lb[2:]]
    lines = [line.replace(" loss scale:", f" load_balancing_loss: {v:.6E} | loss scale:")
             for line, v in zip(training_lines(losses, [50.0] * 5), printed, strict=True)]
    (tmp_path / "log.txt").write_text("\n".join(lines) + "\n")
    log = parse_megatron_log(tmp_path / "log.txt")
    assert log.meta["log_windows"][0]["state"] == "ambiguous"
    steps = np.arange(1, 6)

    def truth(values: list[float]) -> Run:
        return Run("store", "runstore", {"framework": "megatron-core"},
                   {"loss": make_series(steps, losses, "loss"),
                    "load_balancing_loss": make_series(steps, values, "load_balancing_loss")})

    res = compare_aux_losses(truth(lb), log)
    assert res.verdict == "warn", [f.message for f in res.findings]
    [w] = [f for f in res.findings if f.verdict == "warn"]
    assert (w.component, w.metric, w.value) == ("load_balancing_loss", "ambiguous_log_line", 2)
    assert "which reading holds is not known" in w.message
    # a run that differs at step 2 in either reading still fails
    res = compare_aux_losses(truth([lb[0], 1.5, *lb[2:]]), log)
    assert [(f.component, f.value) for f in res.findings if f.verdict == "fail"] == [("load_balancing_loss", 2)]


def test_which_scaling_a_source_has() -> None:
    """TensorBoard holds either framework's tags under the same keys: MindFormers' lm-loss tag (loss_key
    lm_loss) or Megatron-LM's per-layer MTP / z-loss tags tell which."""
    s = make_series([1], [1.0], "x")
    assert convention(Run("tb", "tensorboard", {"framework": "tensorboard", "loss_key": "lm_loss"}))[0] == MINDFORMERS
    assert convention(Run("tb", "tensorboard", {"framework": "tensorboard"}, {"mtp_1_loss": s}))[0] == MEGATRON
    assert convention(Run("tb", "tensorboard", {"framework": "tensorboard"}, {"load_balancing_loss": s}))[0] is None
    assert convention(Run("mf", "mindformers_log", {"framework": "mindformers"}))[0] == MINDFORMERS
    assert convention(Run("gv", "golden_values", {"framework": "megatron-lm"}))[0] == MEGATRON
