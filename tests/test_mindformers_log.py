"""MindFormers log importer on lines MindFormers' own Trainer printed (tests/data/, see make_mindformers_logs.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from core.errors import BadInput
from sources.mindformers_log import parse_mindformers_log

DATA = Path(__file__).parent / "data"
REAL = DATA / "mindformers_train.log"


def test_real_trainer_log():
    run = parse_mindformers_log(REAL)
    loss = run.series("loss")
    assert list(loss.index) == [1, 2, 3, 4, 5, 6]
    text = REAL.read_text()
    # every printed step loss is read back exactly
    for step, value in loss.items():
        assert f"step:[{step:>5}/    6], loss:[{value:.6f}/" in text
    assert run.has("grad_norm") and run.has("lr") and run.has("loss_scale")
    assert run.notes == []


def test_local_norm_blocks_are_squared_sums_in_optimizer_order():
    run = parse_mindformers_log(REAL)
    assert sorted(run.local_norms) == [1, 2, 3, 4, 5, 6]
    for step, table in run.local_norms.items():
        assert table["name"].iloc[0] == "#0"
        assert (table["numel"] > 0).all()
        # sqrt of the sum of squared local norms is the global norm MindFormers logged for the step
        assert math.sqrt(float((table["norm"] ** 2).sum())) == pytest.approx(run.series("grad_norm")[step], rel=1e-5)


def test_wrapped_copy_of_the_real_log(tmp_path):
    width = 100
    out = []
    for ln in REAL.read_text().splitlines():
        out += [ln[i:i + width] for i in range(0, max(len(ln), 1), width)]
    p = tmp_path / "wrapped.log"
    p.write_text("\n".join(out) + "\n")
    run = parse_mindformers_log(p)
    ref = parse_mindformers_log(REAL)
    assert np.array_equal(run.series("loss").to_numpy(), ref.series("loss").to_numpy())
    assert np.array_equal(run.series("grad_norm").to_numpy(), ref.series("grad_norm").to_numpy())
    assert any("wrapped" in n for n in run.notes)


def test_garbled_step_line_is_skipped_with_a_note(tmp_path):
    lines = REAL.read_text().splitlines()
    i = next(i for i, ln in enumerate(lines) if "step:[    3/" in ln)
    lines[i] = lines[i].replace("loss:[", "loss:[4.1x")
    p = tmp_path / "garbled.log"
    p.write_text("\n".join(lines) + "\n")
    run = parse_mindformers_log(p)
    assert 3 not in run.series("loss").index
    assert any("step 3" in n for n in run.notes)


def test_no_step_lines(tmp_path):
    p = tmp_path / "x.log"
    p.write_text("2024-01-01 - INFO - nothing to see\n")
    with pytest.raises(BadInput, match="no MindFormers"):
        parse_mindformers_log(p)


def test_bulk_and_line_by_line_paths_agree(tmp_path):
    from demo.example_logs import mindformers_log
    p = tmp_path / "a.log"
    mindformers_log(p, 50, seed=3)
    fast = parse_mindformers_log(p)
    q = tmp_path / "b.log"  # one odd line sends the whole file down the careful path
    q.write_text(p.read_text() + "x - INFO - { Epoch:[  1/  1], step:[   51/   50], loss:[oops/1.0]\n")
    careful = parse_mindformers_log(q)
    assert any("step 51" in n for n in careful.notes)
    for key in ("loss", "loss_avg", "lr", "grad_norm", "per_step_time_ms", "loss_scale", "overflow"):
        assert np.array_equal(fast.series(key).to_numpy(), careful.series(key).to_numpy()), key
        assert list(fast.series(key).index) == list(range(1, 51))


# --- MindFormers 2.x as it prints (tests/data/mindformers_2x, made by make_mindformers_2x_logs.py) -----------
MF2 = DATA / "mindformers_2x"
EXPECTED = json.loads((MF2 / "expected.json").read_text())


def _check_6(series, values):
    assert list(series.index) == [1, 2, 3, 4]
    assert np.allclose(series.to_numpy(), values, rtol=0, atol=5e-7)   # printed with %5.6f


def test_mcore_dense_line_and_named_local_norms():
    run = parse_mindformers_log(MF2 / "dense.log")
    exp = EXPECTED["dense"]
    _check_6(run.series("loss"), exp["lm"])
    assert np.allclose(run.series("grad_norm").to_numpy(), exp["gnorm"], rtol=1e-6)
    assert np.allclose(run.series("lr").to_numpy(), exp["lr"], rtol=1e-6)
    assert list(run.series("per_step_time_ms")) == exp["ms"]
    tput = run.series("throughput_tflops_per_npu")
    assert np.allclose(tput.to_numpy(), [2.0e12 / ms / 1e9 for ms in exp["ms"]], atol=5e-4)   # %.3fT
    assert run.meta["loss_key"] == "loss" and run.notes == []
    assert sorted(run.local_norms) == [1, 2, 3, 4]
    for step in range(1, 5):
        table = run.local_norms[step]
        assert list(table.name) == EXPECTED["names"]      # TrainingStateMonitor names, not '#i'
        assert np.allclose(table.norm.to_numpy(), exp["norms"][step - 1], rtol=1e-6)


def test_moe_mtp_line_compares_lm_loss_and_keeps_the_total():
    run = parse_mindformers_log(MF2 / "moe_mtp.log")
    exp = EXPECTED["moe_mtp"]
    _check_6(run.series("loss"), exp["lm"])
    _check_6(run.series("lm_loss"), exp["lm"])
    _check_6(run.series("load_balancing_loss"), exp["aux"])
    _check_6(run.series("mtp_loss"), exp["mtp"])
    total = np.float32(exp["lm"]) + np.float32(exp["aux"]) + np.float32(exp["mtp"])
    _check_6(run.series("total_loss"), total)
    assert not run.has("loss_avg") and run.has("total_loss_avg")
    assert run.meta["loss_key"] == "lm_loss"
    assert any("lm_loss" in n and "total_loss" in n for n in run.notes)


def test_sink_mode_and_unreadable_field_keeps_the_step():
    sink = parse_mindformers_log(MF2 / "sink.log")
    _check_6(sink.series("loss"), EXPECTED["sink"]["lm"])
    assert not sink.has("loss_avg") and sink.has("grad_norm") and not sink.has("throughput_tflops_per_npu")
    run = parse_mindformers_log(MF2 / "no_lr.log")       # loss_scale: unavailable, no lr
    _check_6(run.series("loss"), EXPECTED["no_lr"]["lm"])
    assert run.has("grad_norm") and run.has("throughput_tflops_per_npu") and not run.has("lr")
    assert not run.has("loss_scale")
    (note,) = [n for n in run.notes if "loss_scale" in n]
    assert "'unavailable' at 4 step(s)" in note


def test_one_garbled_field_skips_only_that_value(tmp_path):
    lines = (MF2 / "dense.log").read_text().splitlines()
    i = next(i for i, ln in enumerate(lines) if "step:[    2/    4], loss:[" in ln)
    lines[i] = lines[i].replace("global_norm: [", "global_norm: [x")
    p = tmp_path / "g.log"
    p.write_text("\n".join(lines) + "\n")
    run = parse_mindformers_log(p)
    assert 2 in run.series("loss").index and 2 in run.series("lr").index
    assert list(run.series("grad_norm").index) == [1, 3, 4]
    assert any("'global_norm'" in n and "step 2" in n for n in run.notes)


@pytest.mark.parametrize("name,decimals", [("v1_sink", 3), ("v0", 3)])
def test_older_lines(name, decimals):
    run = parse_mindformers_log(MF2 / f"{name}.log")
    exp = EXPECTED[name]
    assert np.allclose(run.series("loss").to_numpy(), exp["lm"], atol=0.5 * 10 ** -decimals)
    assert np.allclose(run.series("lr").to_numpy(), exp["lr"], rtol=1e-6)
    ms = run.series("per_step_time_ms").to_numpy()
    assert np.allclose(ms, np.array(exp["ms"]) + (0.123 if name == "v0" else 0))


def test_msrun_worker_logs_open_as_one_run(tmp_path):
    from runstore.run import open_store, save_run
    from sources import detect, load_run

    root = MF2 / "msrun_log"
    assert detect(root) == "mindformers_log" and detect(MF2) == "mindformers_log"
    run = load_run(root)
    assert sorted(run.rank_scalars) == [0, 1]
    for rank in (0, 1):
        _check_6(run.rank_scalars[rank]["loss"], EXPECTED[f"worker_{rank}"]["lm"])
    _check_6(run.series("loss"), EXPECTED["worker_0"]["lm"])
    table = run.local_norms[1]
    assert sorted(set(table["rank"])) == [0, 1] and len(table) == 2 * len(EXPECTED["names"])
    r1 = table[table["rank"] == 1]
    assert np.allclose(r1.norm.to_numpy(), EXPECTED["worker_1"]["norms"][0], rtol=1e-6)
    store = open_store(save_run(run, tmp_path / "store"))
    assert store.store.ranks == [0, 1]
    t1 = store.local_norm_table(1, rank=1)
    assert list(t1.name) == EXPECTED["names"]
    assert np.allclose(t1.norm.to_numpy(), EXPECTED["worker_1"]["norms"][0], rtol=1e-6)


def test_empty_worker_dir(tmp_path):
    from sources.mindformers_log import parse_mindformers_dir

    (tmp_path / "worker_0.log").write_text("nothing\n")
    with pytest.raises(BadInput, match="none of 1 worker logs"):
        parse_mindformers_dir(tmp_path)


def test_step1_local_norms_compare_by_name_from_a_mindformers_log(tmp_path):
    """Megatron-core names on both sides (MindFormers 2.x mcore keeps them): one perturbed norm is named."""
    from align.stages import Evidence, Inputs, run_stages
    from runstore import RunWriter
    from runstore.run import open_store

    names, norms = EXPECTED["names"], np.array(EXPECTED["dense"]["norms"][0], dtype=np.float64)
    norms[2] *= 1.05                                        # linear_qkv departs by 5%
    with RunWriter(tmp_path / "megatron", rank=0, meta={"framework": "megatron"}) as w:
        w.put_table(1, "local_norm", {"name": np.array(["module." + n for n in names], dtype=object),
                                      "norm": norms, "numel": np.full(len(names), 10, np.int64)})
        w.finish_step()
    mapping = tmp_path / "mcore_identity.yaml"
    mapping.write_text("name: mcore_identity\nbaseline: {framework: megatron-core, strip_prefixes: ['module.']}\n"
                       "candidate: {framework: mindformers, strip_prefixes: []}\n"
                       "rules:\n  - id: same_name\n    kind: other\n    baseline: ['{n:.+}']\n"
                       "    candidate: ['{n:.+}']\n")
    runs = {"baseline": open_store(tmp_path / "megatron"), "candidate": parse_mindformers_log(MF2 / "dense.log")}
    ev = Evidence(Inputs(str(tmp_path / "megatron"), str(MF2 / "dense.log"), mapping=str(mapping)), runs)
    res = run_stages(ev, only=["step1_local_norm"])["step1_local_norm"]
    assert res.verdict == "fail"
    bad = [f.component for f in res.findings if f.verdict == "fail"]
    assert bad and all("linear_qkv" in c for c in bad)


@pytest.mark.parametrize("name", ["moe_mtp", "sink"])
def test_2x_bulk_and_line_by_line_paths_agree(tmp_path, name):
    import sources.mindformers_log as mfl

    text = (MF2 / f"{name}.log").read_text()
    assert mfl._bulk(text.encode()) is not None        # these files take the bulk path
    fast = parse_mindformers_log(MF2 / f"{name}.log")
    q = tmp_path / "odd.log"      # one odd line sends the whole file down the careful path
    q.write_text(text + "x - INFO - { Epoch:[  1/  1], step:[    9/    4], loss:[oops/1.0]\n")
    careful = parse_mindformers_log(q)
    assert sorted(careful.scalars) == sorted(fast.scalars)
    for key in fast.scalars:
        assert np.array_equal(fast.series(key).to_numpy(), careful.series(key).to_numpy()), key
    assert fast.meta.get("loss_key") == careful.meta.get("loss_key")


def test_report_compares_megatron_lm_loss_with_mindformers_lm_loss(tmp_path):
    """`align report` on a Megatron log and a MindFormers MoE+MTP log: the compared candidate loss is
    lm_loss (not the printed total), and the report's run notes say so."""
    from align.cli import main

    lm = EXPECTED["moe_mtp"]["lm"]
    lines = [f"[2026-11-24 05:00:0{i}] iteration {i:8d}/       4 | consumed samples: {8 * i:12d} | elapsed "
             f"time per iteration (ms): 850.0 | learning rate: {1e-4 * i:.6E} | global batch size:     8 | "
             f"lm loss: {lm[i - 1]:.6E} | loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations:   0 "
             "| number of nan iterations:   0 |" for i in range(1, 5)]
    (tmp_path / "megatron.log").write_text("\n".join(lines) + "\n")
    rc = main(["report", str(tmp_path / "megatron.log"), str(MF2 / "moe_mtp.log"), "--out", str(tmp_path / "r")])
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    step1 = summary["stages"]["step1_loss"]
    assert step1["candidate"] == pytest.approx(lm[0], abs=5e-7)      # lm_loss, not lm + aux + mtp
    assert step1["verdict"] == "pass" and rc == 0
    html = (tmp_path / "r" / "report.html").read_text()
    assert "total_loss" in html and "lm_loss" in html


@pytest.mark.parametrize("name", ["dense.log", "moe_mtp.log"])
def test_wrapped_copy_of_2x_logs(tmp_path, name):
    """A terminal copy cut at 120 columns reads back the same values and named norms."""
    width = 120
    out = []
    for ln in (MF2 / name).read_text().splitlines():
        out += [ln[i:i + width] for i in range(0, max(len(ln), 1), width)]
    p = tmp_path / "wrapped.log"
    p.write_text("\n".join(out) + "\n")
    run, ref = parse_mindformers_log(p), parse_mindformers_log(MF2 / name)
    assert sorted(run.scalars) == sorted(ref.scalars)
    for key in ref.scalars:
        assert np.array_equal(run.series(key).to_numpy(), ref.series(key).to_numpy()), key
    for step, table in ref.local_norms.items():
        assert list(run.local_norms[step].name) == list(table.name)
    assert any("wrapped" in n for n in run.notes)


def test_line_cut_mid_value_never_keeps_a_truncated_number(tmp_path):
    lines = (MF2 / "moe_mtp.log").read_text().splitlines()
    i = next(i for i, ln in enumerate(lines) if "step:[    3/    4], loss:[" in ln)
    j = next(i for i, ln in enumerate(lines) if "step:[    4/    4], loss:[" in ln)
    lines[i] = lines[i][: lines[i].index("global_norm: [") + len("global_norm: [1.")]   # cut inside [..]
    lines[j] = lines[j][: lines[j].index("loss_scale: ") + len("loss_scale: 1")]        # cut in a number
    p = tmp_path / "cut.log"
    p.write_text("\n".join(lines) + "\n")
    run = parse_mindformers_log(p)
    assert list(run.series("grad_norm").index) == [1, 2]
    assert 4 not in run.series("loss_scale").index
    assert list(run.series("loss").index) == [1, 2, 3, 4] and list(run.series("lr").index) == [1, 2, 3, 4]
    assert any("cut short" in n for n in run.notes)


# --- issue 15: the pyarrow bulk path reads exactly what the regex path reads -------------------------------

def _read_both(monkeypatch, p):
    import sources.mindformers_log as mfl
    bulk = mfl.parse_mindformers_log(p)
    with monkeypatch.context() as mp:
        mp.setattr(mfl, "_bulk", lambda raw: None)
        regex = mfl.parse_mindformers_log(p)
    assert list(bulk.scalars) == list(regex.scalars) and bulk.notes == regex.notes and bulk.meta == regex.meta
    for k, s in bulk.scalars.items():
        assert s.index.equals(regex.scalars[k].index), k
        np.testing.assert_array_equal(s.to_numpy(), regex.scalars[k].to_numpy(), err_msg=k)
    return bulk


def test_bulk_path_matches_the_regex_path(tmp_path, monkeypatch):
    import sources.mindformers_log as mfl
    from demo.example_logs import mindformers_log
    from sources.logtext import clean_text
    p = tmp_path / "mf.log"
    mindformers_log(p, 300, seed=3, fault="nan", fault_step=250)
    lines = p.read_text().splitlines()
    lm = [x.replace("], per_step_time", "], lm_loss: 4.140000, load_balancing_loss: 0.006456, per_step_time")
          + ", train_throughput_per_npu: 2.849T" for x in lines]
    cases = {"plain": lines, "lm_loss": lm,
             "garbled": lines[:50] + [lines[50].replace("lr: ", "lr: 1.2.3")] + lines[51:],
             "overflow": lines[:60] + [lines[60].replace("False", "True")] + lines[61:],
             "ms": lines[:70] + [lines[70].replace("ms,", "5ms,")] + lines[71:],
             "other_layout": lines[:80] + [lines[80].replace(", loss_scale: 1.0", "")] + lines[81:],
             "wrapped": lines[:90] + [lines[90][:100], lines[90][100:]] + lines[91:],
             "restart": lines[:200] + lines[150:],
             # the config dict MindFormers pprints: read into meta on both paths
             "config": ["{'seed': 1,", " 'runner_config': {'epochs': 1}}"] + lines,
             # words the careful reader acts on, hidden in the text before a step head with the column
             # count unchanged: the bulk reader must see them (it does not scan the file for them)
             "epoch_in_prefix": lines[:40] + [lines[40].replace("core/callback/callback.py:747]",
                                                                "core/Epoch:[callback.py]")] + lines[41:],
             "norm_size_in_prefix": lines[:40] + [lines[40].replace("core/", "norm_size/")] + lines[41:],
             "local_norm_line": lines[:40] + ["2024 - INFO - local_norm: [1.0 2.0]"] + lines[40:]}
    for name, ls in cases.items():
        q = tmp_path / f"{name}.log"
        q.write_text("\n".join(ls) + "\n")
        _read_both(monkeypatch, q)
        bulk = mfl._bulk(clean_text(q.read_bytes()))
        if name in ("plain", "lm_loss", "overflow", "restart", "config"):
            assert bulk is not None, name
        if name.endswith("_prefix"):
            assert bulk is None, name
            seps = [sum(x.count(c) for c in ",:[]/") for x in (lines[40], ls[40])]
            assert seps[0] == seps[1], name            # a row like the others: only the prefix check sees it
            with monkeypatch.context() as mp:
                mp.setattr(mfl, "any_ends_with", lambda column, words: False)
                assert mfl._bulk(clean_text(q.read_bytes())) is not None, name
    assert mfl._bulk(clean_text((tmp_path / "local_norm_line.log").read_bytes())) is None
    assert _read_both(monkeypatch, tmp_path / "config.log").meta["config"] == {"seed": 1,
                                                                              "runner_config": {"epochs": 1}}
    assert len(_read_both(monkeypatch, tmp_path / "plain.log").series("loss")) == 300


def test_any_ends_with_agrees_with_str_endswith():
    """The buffer reader behind the bulk path's prefix check: chunked columns, slices, empty strings."""
    import random

    import pyarrow as pa

    from sources.logtext import any_ends_with

    rng = random.Random(1)
    for _ in range(3000):
        strs = ["".join(rng.choice("Epochnrm_sizelca") for _ in range(rng.randint(0, 11)))
                for _ in range(rng.randint(1, 12))]
        words = [b"Epoch", b"norm_size", b"local_norm", b"h"][: rng.randint(1, 4)]
        cut = rng.randint(0, len(strs))
        column = pa.chunked_array([pa.array(strs[:cut], pa.string()), pa.array(strs[cut:], pa.string())])
        skip = rng.randint(0, len(strs) - 1)
        expected = any(x.encode().endswith(w) for x in strs[skip:] for w in words)
        assert any_ends_with(column.slice(skip), words) == expected, (strs, skip, words)


def test_bulk_path_reads_a_file_of_many_blocks_like_the_regex_path(tmp_path, monkeypatch):
    """pyarrow reads the file a block (1 MB) at a time, each translated as it is read: lines across block
    ends and other lines between blocks read as the regex path reads them."""
    import sources.mindformers_log as mfl
    from demo.example_logs import mindformers_log
    from sources.logtext import clean_text
    p = tmp_path / "big.log"
    mindformers_log(p, 12_000, seed=5)
    lines = p.read_text().splitlines()
    for at in (4000, 8001, 11_999):
        lines.insert(at, "2024-05-01 12:00:00,000 - mindformers[x.py:1] - INFO - checkpoint saved: /a/b, [ok]")
    p.write_text("\n".join(lines) + "\n")
    assert p.stat().st_size > 2 << 20
    assert mfl._bulk(clean_text(p.read_bytes())) is not None
    run = _read_both(monkeypatch, p)
    assert list(run.series("loss").index) == list(range(1, 12_001))


# --- issue 24: never silently wrong (each case measured on the reader before the fix) -----------------------

_PREFIX = "2026-11-22 06:55:02,505 - mindformers/log[mindformers/core/callback/callback.py:747] - INFO - "


def _mf_line(step: int, loss: float, norm: str = "[1.5]") -> str:
    return (_PREFIX + f"{{ Epoch:[  1/  1], step:[{step:5d}/   10], loss:[{loss:.6f}/{loss:.6f}], per_step_time: "
            f"373ms, lr: 0.0005, overflow cond: False, loss_scale: 1.0, global_norm: {norm}")


_GOOD = [_mf_line(s, 4 + s / 10) for s in range(1, 5)]


def _parse_both(monkeypatch, tmp_path, text: str | bytes):
    """The run, read by the bulk reader and by the careful reader alone: both must agree."""
    import sources.mindformers_log as mfl

    p = tmp_path / "issue24.log"
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    run = mfl.parse_mindformers_log(p)
    with monkeypatch.context() as mp:
        mp.setattr(mfl, "_bulk", lambda raw: None)
        mp.setattr(mfl, "_regex_rows", lambda raw: None)
        careful = mfl.parse_mindformers_log(p)
    assert sorted(run.scalars) == sorted(careful.scalars) and run.notes == careful.notes
    for k, s in run.scalars.items():
        assert s.index.equals(careful.scalars[k].index), k
        np.testing.assert_array_equal(s.to_numpy(), careful.scalars[k].to_numpy(), err_msg=k)
    return run


def _losses(run):
    return dict(run.series("loss").items())


def test_global_norm_with_a_space_inside_the_brackets_is_noted_not_read(tmp_path, monkeypatch):
    run = _parse_both(monkeypatch, tmp_path, "\n".join([_GOOD[0], _mf_line(2, 4.2, "[1 31049]"), *_GOOD[2:]]) + "\n")
    assert list(run.series("grad_norm").index) == [1, 3, 4]          # not 1.0 at step 2
    assert _losses(run) == {1: 4.1, 2: 4.2, 3: 4.3, 4: 4.4}
    assert any("global_norm" in n and "[1 31049]" in n and "step 2" in n for n in run.notes)


def test_global_norm_whose_colon_was_lost_is_noted(tmp_path, monkeypatch):
    bad = _GOOD[1].replace("global_norm: [", "global_norm [")
    run = _parse_both(monkeypatch, tmp_path, "\n".join([_GOOD[0], bad, *_GOOD[2:]]) + "\n")
    assert list(run.series("grad_norm").index) == [1, 3, 4]
    assert _losses(run)[2] == 4.2
    assert any("global_norm [1.5]" in n and "step 2" in n for n in run.notes)


@pytest.mark.parametrize("joiner", [" ", "", "\t"])
def test_records_joined_onto_one_line_are_each_read(tmp_path, monkeypatch, joiner):
    run = _parse_both(monkeypatch, tmp_path, joiner.join(_GOOD) + "\n")
    assert _losses(run) == {1: 4.1, 2: 4.2, 3: 4.3, 4: 4.4}           # not one step holding the last loss
    assert dict(run.series("grad_norm").items()) == {1: 1.5, 2: 1.5, 3: 1.5, 4: 1.5}
    assert any("more than one record" in n for n in run.notes)


def test_two_records_glued_by_one_lost_newline_do_not_shift(tmp_path, monkeypatch):
    run = _parse_both(monkeypatch, tmp_path, "\n".join([_GOOD[0], _GOOD[1] + _GOOD[2], _GOOD[3]]) + "\n")
    assert _losses(run) == {1: 4.1, 2: 4.2, 3: 4.3, 4: 4.4}
    assert any("more than one record" in n for n in run.notes)


def test_glued_records_with_local_norm_blocks_keep_each_block_on_its_step(tmp_path):
    one_line = " ".join(REAL.read_text().splitlines())
    p = tmp_path / "one.log"
    p.write_text(one_line + "\n")
    run, ref = parse_mindformers_log(p), parse_mindformers_log(REAL)
    assert _losses(run) == _losses(ref)
    assert sorted(run.local_norms) == sorted(ref.local_norms)
    for step, table in ref.local_norms.items():
        np.testing.assert_array_equal(run.local_norms[step].norm.to_numpy(), table.norm.to_numpy())


@pytest.mark.parametrize("ctrl", ["\x1c", "\x01", "\x0b", "\x7f", "\x1f"])
def test_control_byte_inside_a_value_is_never_a_cut(tmp_path, monkeypatch, ctrl):
    bad = _GOOD[1].replace("loss:[4.200000", f"loss:[4.2{ctrl}1")
    run = _parse_both(monkeypatch, tmp_path, "\n".join([_GOOD[0], bad, *_GOOD[2:]]) + "\n")
    assert 2 not in run.series("loss").index and 2 not in run.series("loss_avg").index
    assert run.series("grad_norm")[2] == 1.5                           # the line's other values kept
    assert any("'loss'" in n and "step 2" in n for n in run.notes)


def test_unclosed_local_norm_block_does_not_swallow_the_next_step(tmp_path):
    block = [_PREFIX + " norm_size: (4, 4)", "local_norm:", "[1.0 2.0"]
    p = tmp_path / "u.log"
    p.write_text("\n".join([_GOOD[0], *block, *_GOOD[1:]]) + "\n")
    run = parse_mindformers_log(p)
    assert _losses(run) == {1: 4.1, 2: 4.2, 3: 4.3, 4: 4.4}
    assert run.local_norms == {}                                       # the broken block is not on any step
    assert any("local_norm block not closed" in n for n in run.notes)


def test_local_norm_block_of_a_lost_step_line_is_not_shifted_to_the_next_step(tmp_path):
    block = [_PREFIX + " norm_size: (4, 4)", "local_norm:", "[1.0 4.0]"]
    p = tmp_path / "lost.log"
    p.write_text("\n".join([_GOOD[0], *block, _GOOD[1].replace("step:[    2/", "step:[   2x/"), *block, *_GOOD[2:]])
                 + "\n")
    run = parse_mindformers_log(p)
    assert sorted(run.local_norms) == [3]                   # step 2's block is not on step 3
    assert any("unreadable step head" in n for n in run.notes)
    assert any("not followed by a readable step line" in n for n in run.notes)


def test_monitor_local_norm_names_with_spaces_are_read(tmp_path):
    mon = [_PREFIX.replace("747", "1496") + "Epoch:[  1/  1], step:[    2/   10] local_norm/my layer.weight: 0.5",
           _PREFIX.replace("747", "1496") + "Epoch:[  1/  1], step:[    2/   10] local_norm/b\x01ad: 0.25",
           _PREFIX.replace("747", "1496") + "Epoch:[  1/  1], step:[    2/   10] local_norm/arr: [0.5 0.25]"]
    p = tmp_path / "m.log"
    p.write_text("\n".join([_GOOD[0], *mon, *_GOOD[1:]]) + "\n")
    run = parse_mindformers_log(p)
    table = run.local_norms[2]
    assert list(table.name) == ["my layer.weight"] and list(table.norm) == [0.5]
    assert any("local_norm/b\\x01ad" in n for n in run.notes)      # a control byte in the name: noted
    assert any("local_norm/arr" in n for n in run.notes)           # two numbers where one is printed: noted


@pytest.mark.parametrize("head", ["step:[  2.0/", "step:[" + "9" * 5000 + "/", "step:[ 1e3/", "step:[\u0661\u0663/",
                                  "step:[9999999999999/"])
def test_step_numbers_are_bounded_ascii_integers(tmp_path, monkeypatch, head):
    bad = _GOOD[1].replace("step:[    2/", head)
    run = _parse_both(monkeypatch, tmp_path, "\n".join([_GOOD[0], bad, *_GOOD[2:]]) + "\n")
    assert _losses(run) == {1: 4.1, 3: 4.3, 4: 4.4}
    for s in run.scalars.values():
        assert s.index.dtype == np.int64 and (s.index <= 10 ** 12).all()
    assert any("unreadable step head or step number" in n for n in run.notes)


def test_import_never_writes_a_float_step(tmp_path):
    """A field named like the record's own step ('step: 13.0', a glued head) never becomes a scalar: the
    run store's step stays the integer `align report` reads."""
    from align.cli import main

    odd = [_GOOD[0], _GOOD[1] + ", step: 13.0, epoch: 2.0", _GOOD[2] + _GOOD[3]]
    (tmp_path / "mf.log").write_text("\n".join(odd) + "\n")
    assert main(["import", str(tmp_path / "mf.log"), "--out", str(tmp_path / "rs")]) == 0
    records = [json.loads(ln) for ln in (tmp_path / "rs" / "scalars" / "rank_00000.jsonl").read_text().splitlines()]
    assert all(type(rec["step"]) is int and "epoch" not in rec for rec in records)
    assert [rec["step"] for rec in records] == [1, 2, 3, 4]


@pytest.mark.parametrize("text,key", [("1e400", "loss_scale"), ("-1e400", "lr"), ("9" * 400, "loss_scale"),
                                      ("1_0", "loss_scale"), ("\u0661", "lr"), ("0x1F", "loss_scale")])
def test_numbers_out_of_range_or_not_ascii_are_noted(tmp_path, monkeypatch, text, key):
    field = {"loss_scale": "loss_scale: 1.0", "lr": "lr: 0.0005"}[key]
    bad = _GOOD[1].replace(field, field.split(":")[0] + ": " + text)
    run = _parse_both(monkeypatch, tmp_path, "\n".join([_GOOD[0], bad, *_GOOD[2:]]) + "\n")
    assert 2 not in run.series(key).index and _losses(run)[2] == 4.2
    assert any(repr(field.split(":")[0]) in n and "step 2" in n for n in run.notes)


def test_printed_nan_and_inf_are_read_on_both_paths(tmp_path, monkeypatch):
    lines = [_GOOD[0], _GOOD[1].replace("loss_scale: 1.0", "loss_scale: inf"),
             _GOOD[2].replace("global_norm: [1.5]", "global_norm: [nan]"), _GOOD[3]]
    run = _parse_both(monkeypatch, tmp_path, "\n".join(lines) + "\n")
    assert run.series("loss_scale")[2] == np.inf and np.isnan(run.series("grad_norm")[3])
    assert not any("loss_scale" in n or "global_norm" in n for n in run.notes)


def test_a_few_garbled_values_keep_the_bulk_path_and_read_as_the_careful_reader(tmp_path, monkeypatch):
    """Issue 28: garbled values, an 'inf' and a value beyond the float range in a few lines of a long log (the
    first and the last among them): the bulk reader keeps the file (those lines read one by one) and agrees
    with the careful reader on every value and note."""
    import re

    import sources.mindformers_log as mfl
    from demo.example_logs import mindformers_log
    from sources.logtext import clean_text

    p = tmp_path / "long.log"
    mindformers_log(p, 300, seed=3)
    lines = p.read_text().split("\n")
    steps = [i for i, x in enumerate(lines) if "step:[" in x]
    edits = {steps[0]: (r"loss:\[", "loss:[4.1x"), steps[50]: (r"lr: [^,]*", "lr: 1e400"),
             steps[90]: (r"lr: [^,]*", "lr: inf"), steps[120]: (r"loss_scale: ", "loss_scale: 1.0.0"),
             steps[-1]: (r"global_norm: \[", "global_norm: [x")}
    for i, (old, new) in edits.items():
        lines[i] = re.sub(old, new, lines[i], count=1)
    text = "\n".join(lines)
    run = _parse_both(monkeypatch, tmp_path, text)
    assert mfl._bulk(clean_text(text.encode()))[2] == run.notes
    assert 1 not in run.series("loss").index and len(run.series("loss")) == 299
    assert np.isinf(run.series("lr")[91]) and 51 not in run.series("lr").index
