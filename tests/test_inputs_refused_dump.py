"""Issue 38: a damaged MindSpore dump is read right or refused in one line (sources/mindspore_dump.py).

The dumps are the real ones in tests/data/mindspore_dump (MindSpore 2.10, CPU, GRAPH mode), damaged here.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from align.cli import main
from core.errors import BadInput
from sources.mindspore_dump import open_mindspore_dump

DATA = Path(__file__).resolve().parent / "data" / "mindspore_dump"
BASE, PERT = DATA / "base", DATA / "perturbed"
PERTURBED = "decoder.layers.1.mlp.linear_fc2"
ORDER = ("rank_0", "execution_order", "ms_execution_order_graph_0.csv")
ITER0 = ("rank_0", "Net", "0", "0")


def _copy(tmp_path: Path, src: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


def test_nul_bytes_in_the_execution_order_refuse_not_blame_another_cell(tmp_path, capsys) -> None:
    d = _copy(tmp_path, PERT)
    order = d.joinpath(*ORDER)
    lines = order.read_bytes().split(b"\n")
    for i, k in ((5, 16), (19, 66), (28, 15)):     # three kernel names, one NUL each; no tensor changed
        lines[i] = lines[i][:k] + b"\x00" + lines[i][k:]
    order.write_bytes(b"\n".join(lines))
    out = tmp_path / "r"
    rc = main(["report", "-q", str(BASE), str(d), "--mapping", "megatron_core__mindformers_mcore_dense",
               "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "line 6: control byte 0x00" in err and "ms_execution_order" in err
    assert not (out / "summary.json").exists()


def test_a_renamed_kernel_line_is_refused(tmp_path) -> None:
    """A kernel the dump holds but its execution order does not list would sort last and become the output
    of every cell around it: refused, naming the kernel."""
    d = _copy(tmp_path, PERT)
    order = d.joinpath(*ORDER)
    text = order.read_text()
    order.write_text(text.replace("1-TransformerLayer/Add-op1", "1-TransformerLayer/Add-op7"))
    with pytest.raises(BadInput, match=r"kernel Default_.*Add-op1 of .* is not in this execution order") as e:
        open_mindspore_dump(d).layer_rows(1)
    assert "\n" not in str(e.value)


def test_an_npy_that_is_a_fifo_is_refused_not_waited_on(tmp_path) -> None:
    d = _copy(tmp_path, PERT)
    f = next(d.joinpath(*ITER0).glob("Reshape.*layers-CellList_1*linear_fc2-Dense_Reshape-op1*.output.0.*.npy"))
    f.unlink()
    os.mkfifo(f)
    with pytest.raises(BadInput, match=r"is a FIFO, not a regular \.npy file") as e:
        open_mindspore_dump(d).layer_rows(1)
    assert "\n" not in str(e.value)


def _statistic_csv(tmp_path: Path, bom: bool) -> Path:
    """Iteration 0 of the base dump as a statistic.csv (MindSpore's documented layout), with or without BOM."""
    d = _copy(tmp_path, BASE)
    it = d.joinpath(*ITER0)
    lines = ["Op Type,Op Name,Task ID,Stream ID,Timestamp,IO,Slot,Data Size,Data Type,Shape,Max Value,Min Value,"
             "Avg Value,L2Norm Value,NaN Count\n"]
    for f in sorted(it.glob("*.npy")):
        op_type, rest = f.name.split(".", 1)
        op, task, stream, ts, io, slot, _fmt, dtype = rest[:-4].rsplit(".", 7)
        a = np.load(f).astype(np.float64)
        lines.append(f'{op_type},{op},{task},{stream},{ts},{io},{slot},{a.nbytes},{dtype.lower()},'
                     f'"({",".join(map(str, a.shape))})",{a.max()},{a.min()},{a.mean()},{np.linalg.norm(a)},0,\n')
        f.unlink()
    (it / "statistic.csv").write_bytes(("\ufeff" if bom else "").encode() + "".join(lines).encode())
    shutil.rmtree(d.joinpath(*ITER0[:3], "1"))
    return d


def test_a_statistic_csv_with_a_utf8_bom_reads_right(tmp_path) -> None:
    plain = open_mindspore_dump(_statistic_csv(tmp_path / "a", bom=False)).layer_rows(1)[0]
    bom = open_mindspore_dump(_statistic_csv(tmp_path / "b", bom=True)).layer_rows(1)[0]
    assert plain and bom == plain


@pytest.mark.parametrize(("column", "value", "problem"), [
    ("L2Norm Value", "-3.5", "L2Norm Value -3.5 is negative"),
    ("NaN Count", "nan", "NaN Count 'nan' is not a count"),
    ("NaN Count", "1e400", "NaN Count '1e400' is not a count"),
    ("Timestamp", "inf", "Timestamp 'inf' is not a count"),
    ("Max Value", "-1e30", "Max Value -1e\\+30 is below Min Value"),
])
def test_impossible_statistics_are_refused(tmp_path, column, value, problem) -> None:
    d = _statistic_csv(tmp_path, bom=False)
    csv = d.joinpath(*ITER0, "statistic.csv")
    rows = csv.read_text().splitlines(keepends=True)
    head = rows[0].rstrip("\n").split(",")
    cells = rows[2].split(",")
    i = head.index(column)
    cells[i if i < head.index("Shape") else i + rows[2].split('"')[1].count(",")] = value   # Shape holds commas
    rows[2] = ",".join(cells)
    csv.write_text("".join(rows))
    with pytest.raises(BadInput, match=rf"statistic\.csv: line 3: {problem}") as e:
        open_mindspore_dump(d).layer_rows(1)
    assert "\n" not in str(e.value)
