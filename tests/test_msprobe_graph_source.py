"""msprobe's MindSpore STATIC-graph (L2, kernel) dump as a layer-tensor source (sources/mindspore_dump.py).

jit_level O0/O1: tests/data/msprobe_graph/{base,perturbed} are real dumps written on CPU by msprobe
(mindstudio-probe 26.2.0, ``PrecisionDebugger`` level L2, task tensor, data_mode output) driving MindSpore
2.10 in GRAPH mode (tests/data/msprobe_graph/make_msprobe_graph_dumps.py): msprobe writes
``kernel_kbyk_dump.json`` into its dump_path and MindSpore writes ``rank_0/Net/0/{0,1}/`` (the network of
tests/data/mindspore_dump/, MindFormers mcore cell names; ``perturbed``: layer 1's linear_fc2 weight + 1e-3).

jit_level O2 (GE, adump) needs Ascend, so its dumps here are written in the layout msprobe documents
(Ascend/msprobe docs/en/dump/mindspore_data_dump_instruct.md, "Dump Result File > Static Graph":
``acl_dump_{device_id}.json``, ``rank_0/{timestamp}/step_{S}/{op_type}.{op_name}.{task_id}.{stream_id}.
{timestamp}.{input|output}.{slot}.{format}.{DTYPE}.npy`` with ACL dtype names (FLOAT, BF16, ...), a
``mapping.csv`` for names cut to 32 digits, and raw files without ``.npy`` for dtypes .npy cannot hold)
from the real O0 tensors: not measured.
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
from sources.mindspore_dump import MindSporeDump, open_mindspore_dump

DATA = Path(__file__).resolve().parent / "data" / "msprobe_graph"
BASE, PERT = DATA / "base", DATA / "perturbed"
PERTURBED = "decoder.layers.1.mlp.linear_fc2"
MCORE = "megatron_core__mindformers_mcore_dense"
STAT_HEAD = ("Op Type,Op Name,Task ID,Stream ID,Timestamp,IO,Slot,Data Size,Data Type,Shape,"
             "Max Value,Min Value,Avg Value,L2Norm Value\n")


def _o2(kbk: Path, out: Path, hashed: str = "Reshape.") -> Path:
    """msprobe's documented O2 layout holding the tensors of a real O0 dump; one file name hashed."""
    (out / "rank_0").mkdir(parents=True)
    (out / "acl_dump_0.json").write_text(json.dumps({"dump": {"dump_path": str(out)}}))
    n = 0
    for it in sorted((kbk / "rank_0" / "Net" / "0").iterdir()):
        step = out / "rank_0" / "20250101120000" / f"step_{it.name}"
        step.mkdir(parents=True)
        mapping = []
        for f in sorted(it.glob("*.npy")):
            name = f.name.replace(".DefaultFormat.", ".ND.").replace(".Float32.npy", ".FLOAT.npy")
            if name.startswith(hashed) and "CellList_1" in name and "linear_fc2" in name:
                n += 1
                short = f"{n:032d}.npy"
                mapping.append(f"{short},{name}\n")
                name = short
            shutil.copy(f, step / name)
        (step / "mapping.csv").write_text("".join(mapping))
    return out


def test_o0_detected_and_opened() -> None:
    assert detect(BASE) == detect(PERT) == "mindspore_dump"
    run = load_run(BASE)
    assert layers_only(run) and run.meta["framework"] == "mindspore"
    assert run.meta["source"]["writer"] == "msprobe L2 (jit_level O0/O1)"
    assert run.meta["mindspore_dump"] == {"steps": [1, 2], "ranks": [0]}
    assert load_run(PERT).meta["mindspore_dump"]["steps"] == [1]
    assert isinstance(layer_source(run), MindSporeDump)


def test_o0_rows_are_cell_outputs_with_mcore_names() -> None:
    rows, has_files = open_mindspore_dump(BASE).layer_rows(1)
    assert has_files
    mods = [r["module"] for r in rows]
    assert mods[:3] == ["decoder.layers.0.input_layernorm", "decoder.layers.0.self_attention.linear_proj",
                        "decoder.layers.0.self_attention"]
    assert mods[-2:] == ["decoder.final_layernorm", "decoder"] and len(mods) == len(set(mods)) == 17
    fc2 = next(r for r in rows if r["module"] == PERTURBED)
    a = np.load(fc2["ref"])
    assert fc2["dtype"] == "float32" and fc2["numel"] == a.size == 64
    assert fc2["norm"] == pytest.approx(float(np.linalg.norm(a)), rel=1e-6)
    assert open_mindspore_dump(BASE).layer_rows(2)[0][0]["module"] == mods[0]


def test_o2_layout_gives_the_same_rows(tmp_path: Path) -> None:
    d = _o2(BASE, tmp_path / "o2")
    assert detect(d) == "mindspore_dump"
    run = load_run(d)
    assert run.meta["source"]["writer"] == "msprobe L2 (jit_level O2)"
    assert run.meta["mindspore_dump"] == {"steps": [1, 2], "ranks": [0]}
    assert not any("execution_order" in n for n in run.notes)
    ref = {r["module"]: r for r in open_mindspore_dump(BASE).layer_rows(2)[0]}
    rows, has_files = open_mindspore_dump(d).layer_rows(2)
    assert has_files and [r["module"] for r in rows] == list(ref)
    for r in rows:
        assert r["dtype"] == "float32" and r["norm"] == pytest.approx(ref[r["module"]]["norm"], rel=1e-12)
    fc2 = next(r for r in rows if r["module"] == PERTURBED)
    assert Path(fc2["ref"]).name.startswith("0000") and "linear_fc2-Dense_Reshape" in fc2["key"]


def test_o2_raw_bf16_read_through_statistic_csv(tmp_path: Path) -> None:
    d = _o2(BASE, tmp_path / "o2")
    step = d / "rank_0" / "20250101120000" / "step_0"
    mod = "decoder.layers.0.self_attention.linear_proj"
    key = next(r["key"] for r in open_mindspore_dump(d).layer_rows(1)[0] if r["module"] == mod)
    f = next(step.glob(f"*.{key}.*.output.0.ND.FLOAT.npy"))
    a = np.load(f)
    raw = f.name.replace(".FLOAT.npy", ".BF16")
    f.unlink()
    (step / raw).write_bytes(b"\0" * 16)                      # bf16 kept raw: not an .npy
    op = raw.split(".")[1]
    ts = raw.split(".")[4]
    shape = "(" + ",".join(map(str, a.shape)) + ")"
    (step / "statistic.csv").write_text(
        STAT_HEAD + f'{raw.split(".")[0]},{op},0,0,{ts},output,0,{a.size * 2},bfloat16,"{shape}",'
        f"{a.max()},{a.min()},{a.mean()},{np.linalg.norm(a)},\n")
    rows, _ = open_mindspore_dump(d).layer_rows(1)
    r = next(r for r in rows if r["module"] == mod)
    assert r["dtype"] == "bfloat16" and r["ref"] is None and r["shape"] == "x".join(map(str, a.shape))
    assert r["norm"] == pytest.approx(float(np.linalg.norm(a)), rel=1e-6)
    (step / "statistic.csv").unlink()                         # raw and no statistics: no row, no error
    rows, _ = open_mindspore_dump(d).layer_rows(1)
    assert mod not in [r["module"] for r in rows]


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    d = _o2(BASE, tmp_path / "o2")
    step = d / "rank_0" / "20250101120000" / "step_0"
    (step / "statistic.csv").write_text(STAT_HEAD + "Add,Default_Add-op0,0,0,1,outp\x00ut,0,4,float32\n")
    with pytest.raises(BadInput, match=r"statistic\.csv: line 2: .*garbled") as e:
        open_mindspore_dump(d).layer_rows(1)
    assert "\n" not in str(e.value)
    (step / "statistic.csv").unlink()
    (step / "mapping.csv").write_text("00000000000000000000000000000001.npy\n")
    with pytest.raises(BadInput, match=r"mapping\.csv: line 1: .*garbled") as e:
        open_mindspore_dump(d).layer_rows(1)
    assert "\n" not in str(e.value)
    with pytest.raises(BadInput, match=r"no iteration 4 \(step 5\) for rank 0 \(has iterations 0, 1\)") as e:
        open_mindspore_dump(BASE).layer_rows(5)
    assert "\n" not in str(e.value)
    with pytest.raises(BadInput, match="no MindSpore dump iteration"):
        open_mindspore_dump(tmp_path / "o2" / "rank_0" / "20250101120000" / "step_1" / "..")


@pytest.mark.parametrize("layout", ["o0", "o2"])
def test_report_names_the_perturbed_cell(tmp_path: Path, layout: str) -> None:
    a, b = (BASE, PERT) if layout == "o0" else (_o2(BASE, tmp_path / "a"), _o2(PERT, tmp_path / "b"))
    out = tmp_path / "r"
    rc = main(["report", "-q", str(a), str(b), "--mapping", MCORE, "--out", str(out)])
    s = json.loads((out / "summary.json").read_text())
    st = s["stages"]["layer_tensors"]
    assert rc in (0, 1) and st["verdict"] in ("warn", "fail") and st["mode"] == "tensor"
    assert st["first_departing_forward"]["module"] == PERTURBED
