"""Router losses a Megatron-LM log prints for its last rank only (sources/megatron_log_moe.py), on a real log.

tests/data/megatron_core_v0.16.1_moe_ep2.log: verbatim lines of Megatron-LM core_v0.16.1's pretrain_gpt.py (CPU,
gloo, 2 processes: EP=2, DP=2, 4 experts top 2, aux loss 1e-2, z-loss 1e-3; ``make upstream-check``'s MoE
baseline with the router losses on): the world line, the whole arguments block, the padded-vocab line and the
4 iteration lines. The dumper recorded, per rank (the store the report read beside it):
rank 0 z_loss 1.963196 1.947181 1.902000 1.953193, rank 1 1.946763 1.887882 1.971323 1.894305; both ranks
load_balancing_loss 1.007394 1.014572 1.004735 1.001700 and lm loss 4.875187 4.803927 4.648349 4.580176.
The log printed rank 1's z_loss (iteration 2: the mean of rank 1's iterations 1-2): core 0.16 does not
average z_loss over DP. Before the fix the report failed aux_losses on z_loss (store 1.917531 = the ranks'
mean, log 1.887883).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from align.cli import main
from runstore import RunWriter
from sources.megatron_log import parse_megatron_log
from sources.megatron_log_moe import SINCE_CORE_0_14, SINCE_CORE_0_16, SINCE_CORE_0_18

LOG = Path(__file__).resolve().parent / "data" / "megatron_core_v0.16.1_moe_ep2.log"
Z = {0: [1.963196, 1.947181, 1.902000, 1.953193], 1: [1.946763, 1.887882, 1.971323, 1.894305]}
LB = [1.007394, 1.014572, 1.004735, 1.001700]
LM = [4.875187, 4.803927, 4.648349, 4.580176]


def variant(tmp_path: Path, drop: tuple[str, ...] = (), add: tuple[str, ...] = (), dp: int | None = None) -> Path:
    """The real log with argument lines dropped / added (Megatron's own format) or the DP size changed."""
    lines = LOG.read_text().splitlines()
    out = [ln for ln in lines if not any(ln.startswith(f"  {name} ") for name in drop)]
    end = next(i for i, ln in enumerate(out) if "end of arguments" in ln)
    out[end:end] = [f"  {name} {'.' * max(3, 48 - len(name))} None" for name in add]
    text = "\n".join(out) + "\n"
    if dp is not None:
        dots = "  data_parallel_size .............................. "
        text = text.replace("data-parallel size: 2,", f"data-parallel size: {dp},").replace(dots + "2", dots + str(dp))
    path = tmp_path / "megatron.log"
    path.write_text(text)
    return path


def test_core_0_16_z_loss_is_read_as_the_last_ranks_own() -> None:
    run = parse_megatron_log(LOG)
    assert "z_loss" not in run.scalars
    last = run.series("z_loss_last_rank")
    # iteration 2 un-averaged (core 0.16 prints the mean over iterations 1-2): rank 1's own, as its dumper recorded
    for step, want in enumerate(Z[1], 1):
        assert last[step] == pytest.approx(want, abs=2e-6)
    for step, want in enumerate(LB, 1):   # averaged over DP by this release: the run's, kept
        assert run.series("load_balancing_loss")[step] == pytest.approx(want, abs=2e-6)
    assert run.meta["rank_local_losses"] == {
        "release": "core 0.16 - 0.17", "moved": ["z_loss"], "data_parallel": 2,
        "why": "the arguments block lists save_wgrads_interval and save_dgrads_interval (Megatron-LM core >= 0.16)"}
    assert any(n.startswith("z_loss: Megatron-LM core 0.16 - 0.17 prints the last rank's own value, not averaged "
                            "over the 2 data-parallel ranks") for n in run.notes)


@pytest.mark.parametrize("case, kept, moved", [
    ("dp1", ["load_balancing_loss", "z_loss"], []),                  # one DP rank: its value is the batch's
    ("core_0_18", ["load_balancing_loss", "z_loss"], []),            # MoEMetricsTracker averages over DP
    ("core_0_14", ["load_balancing_loss", "z_loss"], []),            # 0.14 - 0.15 average every loss over DP
    ("core_0_13", [], ["load_balancing_loss", "z_loss"]),            # neither is averaged over DP
    ("cut_short", ["load_balancing_loss", "z_loss"], []),            # release unknown: kept, said
])
def test_release_ranges(case: str, kept: list[str], moved: list[str], tmp_path: Path) -> None:
    path = {"dp1": lambda: variant(tmp_path, dp=1),
            "core_0_18": lambda: variant(tmp_path, add=SINCE_CORE_0_18[:2]),
            "core_0_14": lambda: variant(tmp_path, drop=SINCE_CORE_0_16),
            "core_0_13": lambda: variant(tmp_path, drop=SINCE_CORE_0_16 + SINCE_CORE_0_14),
            "cut_short": lambda: cut_short(tmp_path)}[case]()
    run = parse_megatron_log(path)
    assert sorted(k for k in run.scalars if k.endswith(("_loss", "_last_rank")) and k != "loss") == sorted(
        kept + [k + "_last_rank" for k in moved])
    if case == "core_0_13":     # before core 0.16 iteration 2 is printed alone (no mean over iterations 1-2)
        assert run.series("z_loss_last_rank")[2] == pytest.approx(1.917323, abs=1e-6)
        assert run.meta["rank_local_losses"]["release"] == "core <= 0.13"
    if case == "cut_short":
        assert any("kept as printed" in n and "cut short" in n for n in run.notes)


def cut_short(tmp_path: Path) -> Path:
    """The arguments block cut by hand to its parallel sizes (the DP size still told)."""
    keep = ("data_parallel_size", "tensor_model_parallel_size", "num_layers", "world_size")
    lines = LOG.read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if "---- arguments ----" in ln)
    end = next(i for i, ln in enumerate(lines) if "end of arguments" in ln)
    body = [ln for ln in lines[start + 1: end] if ln.split(" ", 3)[2:3] and ln.split()[0] in keep]
    path = tmp_path / "cut.log"
    path.write_text("\n".join(lines[:start + 1] + body + lines[end:]) + "\n")
    return path


def test_report_of_the_dumped_store_against_its_own_log_passes_aux_losses(tmp_path: Path) -> None:
    """The store as the dumper wrote it at DP=2 (each rank its own z_loss) against the real log: aux_losses
    compares the losses both sides hold for the run (z_loss was the false fail)."""
    import json

    store = tmp_path / "store"
    for rank in (0, 1):
        with RunWriter(store, rank=rank, meta={"framework": "megatron-core", "parallel": {"dp": 2, "ep": 2}},
                       rank_info={"dp_rank": rank, "tp_rank": 0, "pp_rank": 0}) as w:
            for step in range(1, 5):
                w.log_scalars(step, {"loss": LM[step - 1], "z_loss": Z[rank][step - 1],
                                     "load_balancing_loss": LB[step - 1], "loss_mask_sum": 32.0})
    rc = main(["report", str(store), str(LOG), "--out", str(tmp_path / "report")])
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    aux = summary["stages"]["aux_losses"]
    assert rc == 0 and aux["verdict"] == "pass", [f["message"] for f in summary["findings"] if f["verdict"] != "pass"]
    assert [r["loss"] for r in aux["losses"]] == ["load_balancing_loss"]
