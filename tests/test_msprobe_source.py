"""msprobe dump directories as layer-tensor sources: a real PyTorch msprobe dump of a Megatron-core GPTModel
against a real MindSpore msprobe dump of MindFormers' LlamaForCausalLM (same converted weights and batch, one
weight perturbed by 1e-3), both written by mindstudio-probe 26.2.0 (tests/data/msprobe/make_msprobe_dumps.py).
The compare must pair Module.* and Cell.* names through the mapping, name layer 1 as the first departure and
pass every other layer (no false errors from dtype spellings or layouts)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from comparators.layer_tensors import compare_layer_tensors
from comparators.tensor_metrics import compare_arrays, compare_files
from core.errors import BadInput
from models import load_mapping
from sources import detect, load_run
from sources.layers import layer_source
from sources.msprobe import normalise_dtype, open_msprobe, split_key

DATA = Path(__file__).resolve().parent / "data" / "msprobe"
PT, MS = DATA / "pt", DATA / "ms"
PERTURBED = "decoder.layers.1.mlp.linear_fc2"      # Megatron's name of MindFormers' feed_forward.w2


def _readers():
    pytest.importorskip("torch")
    from checkpoints.torch_tensors import READERS

    return READERS


def test_detected_and_opened_as_runs() -> None:
    assert detect(PT) == detect(MS) == "msprobe"
    pt, ms = load_run(PT), load_run(MS)
    assert pt.meta["framework"] == "torch" and ms.meta["framework"] == "mindspore"
    assert pt.meta["msprobe"]["steps"] == [1] and pt.meta["source"]["task"] == "tensor"
    # a step folder or a rank folder opens too
    assert open_msprobe(PT / "step0").array_steps() == [1]
    assert open_msprobe(PT / "step0" / "rank0").array_ranks(1) == [0]


def test_rows_follow_the_run_store_vocabulary() -> None:
    rows, has_files = open_msprobe(PT).layer_rows(1)
    assert has_files
    fc2 = [r for r in rows if r["module"] == PERTURBED]
    assert {r["kind"] for r in fc2} >= {"forward.input.0", "forward.output.0", "backward.grad_output.0",
                                         "backward.grad_input.0"}
    assert all(r["dtype"] == "float32" and Path(r["ref"]).is_file() for r in fc2)
    out = next(r for r in fc2 if r["kind"] == "forward.output.0")
    assert out["shape"] == "8x2x32" and out["numel"] == 512          # Megatron: [s, b, h]
    ms_rows, _ = open_msprobe(MS).layer_rows(1)
    w2 = next(r for r in ms_rows if r["module"] == "model.layers.1.feed_forward.w2" and r["kind"] == "forward.output.0")
    assert w2["shape"] == "2x8x32" and w2["ref"].endswith(".npy")    # MindFormers: [b, s, h]
    assert not any(r["module"].startswith(("Module.", "Cell.")) for r in rows + ms_rows)
    assert split_key("Module.decoder.layers.0.mlp.MLP.forward.0") == ("decoder.layers.0.mlp", "forward", 0)
    assert split_key("Functional.linear.3.backward") == ("Functional.linear.3", "backward", 3)
    assert (normalise_dtype("torch.bfloat16"), normalise_dtype("Float32"), normalise_dtype("Int64")) == \
        ("bfloat16", "float32", None)


def test_pytorch_vs_mindspore_names_the_perturbed_layer() -> None:
    res = compare_layer_tensors(layer_source(PT), layer_source(MS), load_mapping(), readers=_readers())
    d = res.details
    assert d["mode"] == "tensor" and d["compared"] >= 60
    fwd = d["first_departing_forward"]
    assert fwd["module"] == PERTURBED and fwd["layer"] == 1 and fwd["mode"] == "tensor"
    assert 1e-4 < fwd["value"] < 1e-2                 # the 1e-3 perturbation, not float32 noise
    assert res.findings[0].component == PERTURBED
    before = [r for r in d["rows"] if r["direction"] == "forward" and r["order"] < fwd["order"]]
    assert len(before) > 20 and all(r["verdict"] == "pass" and r["rel_l2"] < 1e-5 for r in before)
    assert not [r for r in d["rows"] if r["verdict"] == "fail"]


def test_without_torch_reader_statistics_still_name_it() -> None:
    res = compare_layer_tensors(layer_source(PT), layer_source(MS), load_mapping(), readers=None)
    fwd = res.details["first_departing_forward"]
    assert fwd["module"] == PERTURBED and fwd["mode"] == "stats"
    assert any(f.metric == "tensor_files_unread" and ".pt" in f.message for f in res.findings)


@pytest.mark.parametrize("jobs,executor", [(2, "thread"), (2, "process")])
def test_parallel_readers_give_the_serial_result(jobs: int, executor: str) -> None:
    readers = _readers()
    serial = compare_layer_tensors(layer_source(PT), layer_source(MS), load_mapping(), readers=readers, jobs=1)
    par = compare_layer_tensors(layer_source(PT), layer_source(MS), load_mapping(), readers=readers, jobs=jobs,
                                executor=executor)
    assert par.details["rows"] == serial.details["rows"]
    assert [f.to_json() for f in par.findings] == [f.to_json() for f in serial.findings]


def test_npy_streamed_in_chunks_equals_whole(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    a = rng.standard_normal((3, 300_001)).astype(np.float32)          # several chunks, uneven tail
    b = (a * (1 + 1e-4 * rng.standard_normal(a.shape))).astype(np.float32)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    got, want = compare_files(str(tmp_path / "a.npy"), str(tmp_path / "b.npy")), compare_arrays(a, b)
    assert got.as_dict() == pytest.approx(want.as_dict(), rel=1e-9)


def test_bad_dumps_are_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "dump"
    shutil.copytree(MS, bad)
    dump_json = next(bad.rglob("dump.json"))
    dump_json.write_text('{"task": "tensor", "data": {"Cell.x')
    with pytest.raises(BadInput) as err:
        open_msprobe(bad).layer_rows(1)
    assert str(dump_json) in str(err.value) and "garbled JSON" in str(err.value)
    dump_json.write_text(json.dumps({"task": "tensor", "data": []}))
    with pytest.raises(BadInput, match="no 'data' object"):
        open_msprobe(bad).layer_rows(1)
    with pytest.raises(BadInput, match="no step 3"):
        open_msprobe(MS).layer_rows(3)
    gone = tmp_path / "gone"
    shutil.copytree(MS, gone)
    victim = next(gone.rglob("Cell.model.layers.1.feed_forward.w2.Linear.forward.0.output.0.npy"))
    victim.unlink()
    with pytest.raises(BadInput) as err:
        compare_layer_tensors(layer_source(PT), layer_source(gone), load_mapping(), readers=_readers())
    assert victim.name in str(err.value) and "missing" in str(err.value)


def test_ranks_and_steps_of_a_distributed_dump(tmp_path: Path) -> None:
    """msprobe's distributed layout step<N>/rank<R>/: here the real rank-0 folders copied as step0/rank1 and
    step1/rank0..1 (a proc<PID> folder is rank 0 when it is the only one)."""
    for side, src in (("pt", next(PT.glob("step0/*"))), ("ms", next(MS.glob("step0/*")))):
        for step, rank in ((0, 0), (0, 1), (1, 0), (1, 1)):
            shutil.copytree(src, tmp_path / side / f"step{step}" / f"rank{rank}")
    d = open_msprobe(tmp_path / "pt")
    assert d.array_steps() == [1, 2] and d.array_ranks(2) == [0, 1]
    from comparators.layer_tensors import compare_layer_tensors_all

    res = compare_layer_tensors_all(layer_source(tmp_path / "pt"), layer_source(tmp_path / "ms"), load_mapping(),
                                    readers=None, jobs=2)
    assert sorted(res) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert {r.details["first_departing_forward"]["module"] for r in res.values()} == {PERTURBED}


def test_statistics_task_dumps_compare_by_statistics() -> None:
    """msprobe task "statistics": dump.json only (Max/Min/Mean/Norm per tensor), written by the real tool."""
    pt, ms = DATA / "statistics" / "pt", DATA / "statistics" / "ms"
    assert detect(pt) == detect(ms) == "msprobe"
    rows, has_files = open_msprobe(pt).layer_rows(1)
    assert not has_files and rows and all(r["ref"] is None for r in rows)
    res = compare_layer_tensors(layer_source(pt), layer_source(ms), load_mapping())
    assert res.details["mode"] == "stats"
    assert res.details["first_departing_forward"]["module"] == PERTURBED
    assert not any(f.metric == "tensor_files_unread" for f in res.findings)
    assert not [r for r in res.details["rows"] if r["verdict"] == "fail"]


# --- issue 24: `align import` reads every dump.json: a truncated one is one line, never 0 tensors silently ------

STATS = DATA / "statistics" / "pt"


@pytest.mark.parametrize("damage,why", [
    (lambda t: t[: len(t) // 2], "garbled JSON"),                       # truncated (a full disk, a killed job)
    (lambda t: t.replace('"data"', '"dat\\u0000a"', 1)[:-3] + "}", "garbled JSON"),
    (lambda t: '{"data": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    (lambda t: '{"task": "statistics", "data": []}', "no 'data' object"),
    (lambda t: '{"task": "statistics", "data": {"Module.x.Linear.forward.0": ' + "1" * 5000 + "}}", "holds a module"),
])
def test_import_of_a_damaged_dump_json_is_one_line(tmp_path: Path, capsys, damage, why) -> None:
    from align.cli import main

    bad = tmp_path / "dump"
    shutil.copytree(STATS, bad)
    dump_json = next(bad.rglob("dump.json"))
    dump_json.write_text(damage(dump_json.read_text()))
    with pytest.raises(BadInput) as err:
        load_run(bad)
    assert why in str(err.value) and "\n" not in str(err.value)
    assert (str(dump_json) if why != "holds a module" else str(bad)) in str(err.value)
    capsys.readouterr()
    assert main(["import", str(bad), "--out", str(tmp_path / "run")]) == 2
    out = capsys.readouterr()
    assert "Traceback" not in out.err and why in out.err


def test_import_notes_a_rank_whose_dump_json_is_empty(tmp_path: Path) -> None:
    d = tmp_path / "dump"
    src = next(STATS.glob("step0/*"))
    shutil.copytree(src, d / "step0" / "rank0")
    shutil.copytree(src, d / "step0" / "rank1")
    (d / "step0" / "rank1" / "dump.json").write_text('{"task": "statistics", "level": "L0", "data": {}}')
    run = load_run(d)
    assert any("1 dump.json file(s) hold no module or API entry (step0/rank1)" in n for n in run.notes)
