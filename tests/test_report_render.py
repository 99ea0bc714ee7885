"""The report's figures drawn in a forked child are the figures drawn here, byte for byte; a child that
fails or hangs costs time, never a figure."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from align.procedure import report
from align.stages import Inputs
from demo.example_logs import megatron_log, mindformers_log
from reports import render


@pytest.fixture
def forking(monkeypatch):
    """The fork allowed in this test process (pytest-xdist's own threads and a framework another test file
    imported would switch it off), and counted, so a test knows the child drew."""
    monkeypatch.setattr(render.threading, "active_count", lambda: 1)
    monkeypatch.setattr(render, "_FRAMEWORKS", ())
    forks = []
    real = os.fork

    def counted() -> int:
        pid = real()
        if pid:
            forks.append(pid)
        return pid

    monkeypatch.setattr(render.os, "fork", counted)
    return forks


def _figures(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((out / "figures").iterdir())}


def test_forked_figures_are_the_serial_figures(tmp_path, forking, monkeypatch):
    base, rep, cand = tmp_path / "b.log", tmp_path / "r.log", tmp_path / "c.log"
    megatron_log(base, 400, seed=1)
    megatron_log(rep, 400, seed=2)
    mindformers_log(cand, 400, seed=3, fault="diverge", fault_step=250)
    inputs = Inputs(str(base), str(cand), repeats=[str(rep)])
    forked = report(inputs, str(tmp_path / "forked"))
    assert forking, "the figures were not drawn in a child"
    monkeypatch.setattr(render, "PARALLEL", False)
    n = len(forking)
    serial = report(inputs, str(tmp_path / "serial"))
    assert len(forking) == n
    assert forked == serial
    got, want = _figures(tmp_path / "forked"), _figures(tmp_path / "serial")
    assert sorted(got) == ["grad_norm.png", "grad_norm_delta_band.png", "loss.png", "loss_delta_band.png"]
    assert got == want
    html = (tmp_path / "forked" / "report.html").read_text()
    assert html == (tmp_path / "serial" / "report.html").read_text()



def test_the_writer_draws_what_it_is_handed_in_order_and_names_no_stage(tmp_path, forking):
    """The stages declare figures, step rows and summary.json's fixed entries; the writer only renders them."""
    import ast
    import json
    import re

    from align.stages import registry
    from reports.render import Figure
    from reports.writer import ReportInput, write_report

    def draw(i: int):
        def at(path: Path) -> bytes | None:
            if i == 2:
                return None   # no figure: no file, no image
            data = f"png {i}".encode()
            path.write_bytes(data)
            return data
        return at

    figs = [Figure(f"title {i}", f"f{i}.png", draw(i)) for i in (3, 0, 2, 1)]
    row = {"stage": "s", "verdict": "pass", "step": 1, "baseline": 2.0, "candidate": 2.0}
    data = write_report(ReportInput([], {}, figures=figs, step_rows=[row], contract={"x": ("a", "b")}),
                        tmp_path / "r")
    assert forking
    assert sorted(p.name for p in (tmp_path / "r" / "figures").iterdir()) == ["f0.png", "f1.png", "f3.png"]
    page = (tmp_path / "r" / "report.html").read_text()
    assert re.findall(r'<img alt="([^"]*)"', page) == ["title 3", "title 0", "title 1"]
    assert "<h2>Step 1 and step 2</h2>" in page
    assert data["stages"] == {"x": {"verdict": "skipped", "reason": "no data for this stage", "a": None, "b": None}}
    assert json.loads((tmp_path / "r" / "summary.json").read_text()) == data
    names = {s.name for s in registry()}
    for module in ("writer.py", "html.py", "render.py"):   # figures.py draws columns: "band" is one
        text = (Path(__file__).resolve().parent.parent / "reports" / module).read_text()
        strings = {n.value for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Constant)}
        assert not names & strings, module

def _jobs(tmp_path: Path, parent: int, child_does: str) -> list[render.Job]:
    def job(i: int) -> render.Job:
        path = tmp_path / f"f{i}.png"

        def draw() -> bytes | None:
            if os.getpid() != parent:
                if child_does == "fail":
                    raise RuntimeError("child only")
                if child_does == "hang":
                    time.sleep(60)
                if child_does == "die":
                    os._exit(7)
            if i == 3:
                return None   # no figure: no file
            data = f"figure {i}".encode()
            path.write_bytes(data)
            return data
        return path, draw
    return [job(i) for i in range(5)]


@pytest.mark.parametrize("child_does", ["draw", "fail", "die", "hang"])
def test_a_child_that_fails_or_hangs_leaves_its_figures_to_the_parent(tmp_path, forking, monkeypatch, child_does):
    monkeypatch.setattr(render, "CHILD_GRACE_S", 0.5)
    side = []
    t = time.perf_counter()
    got = render.render(_jobs(tmp_path, os.getpid(), child_does), alongside=lambda: side.append(1))
    assert forking and side == [1]
    assert got == [b"figure 0", b"figure 1", b"figure 2", None, b"figure 4"]
    assert not (tmp_path / "f3.png").exists()
    assert time.perf_counter() - t < 30
    pid = forking[-1]
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)   # reaped: no zombie left behind


def _png_size(png: bytes) -> tuple[int, int]:
    return int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")   # IHDR width, height


def test_charts_of_a_large_model_stay_readable(tmp_path):
    """600 parameters / modules (a 48-layer MoE model): the local-norm chart keeps the 60 largest differences
    in layer order (the failing ones among them), the layer profile names one bar in k; both figures stay
    a few inches, not 130."""
    from reports import figures

    params = [{"name": "embedding.word_embeddings.weight", "kind": "embedding", "layer": None, "rel_diff": 1e-9}]
    params += [{"name": f"decoder.layers.{i // 12}.p{i % 12}.weight", "kind": "x", "layer": i // 12,
                "rel_diff": 1e-7 * (1 + (i * 7919) % 1000)} for i in range(600)]
    params += [{"name": "output_layer.weight", "kind": "output", "layer": None, "rel_diff": None},
               {"name": "decoder.layers.3.p0.weight", "kind": "x", "layer": 3, "rel_diff": float("nan")}]
    rows = figures.chart_parameters(params)
    assert len(rows) == figures.MAX_NORM_BARS
    assert {"output_layer.weight", "decoder.layers.3.p0.weight"} <= {r["name"] for r in rows}
    smallest_kept = min(figures._norm_diff(r) for r in rows)
    assert sum(figures._norm_diff(p) > smallest_kept for p in params) < figures.MAX_NORM_BARS
    layers = [-1 if r["layer"] is None and r["kind"] == "embedding" else 10**6 if r["layer"] is None
              else r["layer"] for r in rows]
    assert layers == sorted(layers)
    assert figures.chart_parameters(params[:10]) == sorted(params[:10], key=lambda p: (
        -1 if p["layer"] is None else p["layer"], p["name"]))
    png = figures.local_norm_chart(params, 1e-4, "fail", tmp_path / "ln.png")
    assert _png_size(png)[1] <= (0.22 * figures.MAX_NORM_BARS + 1) * figures.DPI + 1

    assert figures.named_bars(7) == list(range(7)) and figures.named_bars(0) == []
    assert figures.named_bars(figures.MAX_BAR_LABELS) == list(range(figures.MAX_BAR_LABELS))
    for n in (41, 599, 600):
        named = figures.named_bars(n)
        k = named[1]
        assert named == list(range(0, n, k)) and len(named) <= figures.MAX_BAR_LABELS and n - named[-1] <= k
    bars = [{"direction": d, "module": f"decoder.layers.{i // 12}.mlp.linear_fc1", "value": 1e-6, "verdict": "pass",
             "threshold": 1e-4, "metric": "rel_l2"} for d in ("forward", "backward") for i in range(600)]
    png = figures.layer_profile(bars, "pass", tmp_path / "lp.png")
    assert _png_size(png)[1] < 8 * figures.DPI
