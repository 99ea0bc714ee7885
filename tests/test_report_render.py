"""The report's figures drawn in a forked child are the figures drawn here, byte for byte; a child that
fails or hangs costs time, never a figure."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from align.examples.make_example_logs import megatron_log, mindformers_log
from align.procedure import report
from align.stages import Inputs
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
