"""MindSpore's own GRAPH-mode dump as a layer-tensor source (sources/mindspore_dump.py).

tests/data/mindspore_dump/{base,perturbed} are real dumps written by MindSpore 2.10 on CPU in GRAPH mode
(MINDSPORE_DUMP_CONFIG, saved_data "tensor"; tests/data/mindspore_dump/make_mindspore_dumps.py): a tiny
network with MindFormers mcore cell names under a loss wrapper and a ``GPTModel`` cell; ``perturbed`` has
layer 1's ``linear_fc2`` weight + 1e-3 and saves outputs only. CPU refuses saved_data "statistic" / "full"
("storing statistic dump is only supported on GPU and Ascend"), so statistic.csv here is written in the
layout MindSpore documents and its own tests use (header ``Op Type,Op Name,Task ID,Stream ID,Timestamp,IO,
Slot,Data Size,Data Type,Shape`` + the statistic columns, each data row ending with a comma), not measured.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from align.cli import main
from core.errors import BadInput
from sources import detect, load_run
from sources.layers import layer_source, layers_only
from sources.mindspore_dump import MindSporeDump, module_name, open_mindspore_dump, read_statistic_csv, scope_cells

DATA = Path(__file__).resolve().parent / "data" / "mindspore_dump"
BASE, PERT = DATA / "base", DATA / "perturbed"
PERTURBED = "decoder.layers.1.mlp.linear_fc2"
ITER0 = ("rank_0", "Net", "0", "0")


def test_detected_and_opened() -> None:
    assert detect(BASE) == detect(PERT) == "mindspore_dump"
    run = load_run(BASE)
    assert layers_only(run) and run.meta["framework"] == "mindspore"
    assert run.meta["mindspore_dump"] == {"steps": [1, 2], "ranks": [0]}
    assert run.meta["source"]["saved_data"] == "tensor"
    src = layer_source(run)
    assert isinstance(src, MindSporeDump) and src.array_ranks(2) == [0]
    assert open_mindspore_dump(BASE / "rank_0").array_steps() == [1, 2]    # a rank folder opens too


def test_rows_are_cell_outputs_with_mcore_names() -> None:
    rows, has_files = open_mindspore_dump(BASE).layer_rows(1)
    assert has_files
    mods = [r["module"] for r in rows]
    assert mods.index("decoder.layers.0.self_attention.linear_proj") < mods.index("decoder.layers.0.self_attention")
    assert mods.index("decoder.layers.0") < mods.index("decoder.layers.1.input_layernorm")
    assert not any(m.startswith(("network", "model", "Default")) for m in mods)
    assert all(r["kind"] == "forward.output.0" and r["dtype"] == "float32" for r in rows)
    assert len(mods) == len(set(mods))
    fc2 = next(r for r in rows if r["module"] == PERTURBED)
    a = np.load(fc2["ref"])
    assert "linear_fc2-Dense_Reshape-op1" in fc2["key"] and fc2["numel"] == a.size == 64
    assert fc2["norm"] == pytest.approx(float(np.linalg.norm(a)), rel=1e-6)
    assert (fc2["max"], fc2["min"]) == (pytest.approx(float(a.max())), pytest.approx(float(a.min())))
    layer = next(r for r in rows if r["module"] == "decoder.layers.1")
    assert layer["shape"] == "2x4x8" and "TransformerLayer_Add-op1" in layer["key"]
    # the outputs-only dump yields the same rows
    assert [r["module"] for r in open_mindspore_dump(PERT).layer_rows(1)[0]] == mods


def test_scope_names_resolve_to_cells() -> None:
    full = ("Default/network-WithLossCell/_backbone-TrainingQwen3ForCausalLM/model-GPTModel/decoder-TransformerBlock/"
            "layers-CellList/0-TransformerLayer/self_attention-SelfAttention/linear_proj-RowParallelLinear/MatMul-op3")
    want = "decoder.layers.0.self_attention.linear_proj"
    for written in (full, full.replace("/", "--"), full.replace("/", "_")):
        root, cells = scope_cells(written)
        assert root == "Default" and ".".join(module_name(cells)) == want, written
    # legacy MindFormers (no GPTModel cell): the wrappers go, the model's own path stays
    _, cells = scope_cells("Default/network-WithLossCell/_backbone-LlamaForCausalLM/model-LlamaModel/layers-CellList/"
                           "1-LLamaDecodeLayer/attention-LLamaAttention/wo-Linear/MatMul-op0")
    assert ".".join(module_name(cells)) == "model.layers.1.attention.wo"
    assert scope_cells("Gradients/Default/network-WithLossCell/gradMatMul/MatMul-op9")[0] == "Gradients"


def _copy(tmp_path: Path, src: Path = BASE) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


STAT_HEAD = ("Op Type,Op Name,Task ID,Stream ID,Timestamp,IO,Slot,Data Size,Data Type,Shape,Max Value,Min Value,"
             "Avg Value,L2Norm Value\n")


def _statistic_dump(tmp_path: Path) -> Path:
    """The base dump's iteration 0 turned into a statistics-only dump: statistic.csv from its .npy files."""
    d = _copy(tmp_path)
    it = d.joinpath(*ITER0)
    lines = [STAT_HEAD]
    for f in sorted(it.glob("*.npy")):
        op_type, rest = f.name.split(".", 1)
        op, task, stream, ts, io, slot, _fmt, dtype = rest[:-4].rsplit(".", 7)
        a = np.load(f).astype(np.float64)
        lines.append(f'{op_type},{op},{task},{stream},{ts},{io},{slot},{a.nbytes},{dtype.lower()},'
                     f'"({",".join(map(str, a.shape))})",{a.max()},{a.min()},{a.mean()},{np.linalg.norm(a)},\n')
        f.unlink()
    (it / "statistic.csv").write_text("".join(lines))
    shutil.rmtree(d.joinpath(*ITER0[:3], "1"))
    return d


def test_statistic_csv_rows_match_the_tensor_rows(tmp_path: Path) -> None:
    d = _statistic_dump(tmp_path)
    assert detect(d) == "mindspore_dump" and load_run(d).meta["source"]["saved_data"] == "statistic"
    rows, has_files = open_mindspore_dump(d).layer_rows(1)
    assert not has_files and all(r["ref"] is None for r in rows)
    full = {r["module"]: r for r in open_mindspore_dump(BASE).layer_rows(1)[0]}
    assert [r["module"] for r in rows] == list(full)
    for r in rows:
        for k in ("max", "min", "mean", "norm"):
            assert r[k] == pytest.approx(full[r["module"]][k], rel=1e-6, abs=1e-7), (r["module"], k)


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    d = _statistic_dump(tmp_path)
    csv = d.joinpath(*ITER0, "statistic.csv")
    text = csv.read_text().splitlines(keepends=True)
    csv.write_text("".join(text[:3]) + text[3].replace(",output,", ",outp\x00ut,")[:40] + "\n" + "".join(text[4:]))
    with pytest.raises(BadInput, match=r"statistic\.csv: line 4: .*garbled") as e:
        open_mindspore_dump(d).layer_rows(1)
    assert "\n" not in str(e.value)
    csv.write_text("Op,Name\n")
    with pytest.raises(BadInput, match="header is not MindSpore's statistic.csv"):
        read_statistic_csv(csv)
    csv.write_text(STAT_HEAD + 'Add,Default_Add-op0,0,0,1,output,0,4,float32,"(1)",1.5,x,1,1,\n')
    with pytest.raises(BadInput, match="Min Value 'x' is not a number"):
        read_statistic_csv(csv)

    t = _copy(tmp_path / "t")
    f = next(t.joinpath(*ITER0).glob("Reshape.*layers-CellList_1*linear_fc2-Dense_Reshape-op1*.output.0.*.npy"))
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(BadInput, match=r"truncated \.npy") as e:
        open_mindspore_dump(t).layer_rows(1)
    assert "\n" not in str(e.value)

    with pytest.raises(BadInput, match=r"no iteration 4 \(step 5\) for rank 0 \(has iterations 0, 1\)"):
        open_mindspore_dump(BASE).layer_rows(5)
    assert main(["report", "-q", str(BASE), str(t), "--out", str(tmp_path / "r")]) == 2


def test_report_names_the_perturbed_cell(tmp_path: Path) -> None:
    out = tmp_path / "r"
    rc = main(["report", "-q", str(BASE), str(PERT), "--mapping", "megatron_core__mindformers_mcore_dense",
               "--out", str(out)])
    s = json.loads((out / "summary.json").read_text())
    st = s["stages"]["layer_tensors"]
    assert rc in (0, 1) and st["verdict"] in ("warn", "fail") and st["mode"] == "tensor"
    assert st["first_departing_forward"]["module"] == PERTURBED
    assert s["stages"]["step1_loss"]["verdict"] == "skipped"


def test_a_dump_against_a_log_says_what_to_give_instead(tmp_path: Path, capsys) -> None:
    """A layers-only dump beside a run with scalars is refused in one line that says the two ways to compare."""
    log = Path(__file__).resolve().parent / "data" / "mindformers_train.log"
    assert main(["report", "-q", str(BASE), str(log), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "holds layer tensors only" in err and f"{log} holds the run's scalars" in err
    assert "compare two layer-tensor dumps, or give the run store the dump belongs to" in err
    assert not (tmp_path / "r").exists()
