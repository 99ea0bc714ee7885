"""Draw a report's figures on two cores: matplotlib holds the GIL while it draws, so threads do not help,
but a forked copy of this process does (a 100k-step report's four curve figures: 0.55 s -> 0.33 s).

The fork is only an acceleration, never a dependency: it is used where ``os.fork`` exists, two cores are
there, no other Python thread runs (a lock held by one at the fork could stall the child) and no training
framework is loaded in the process (the demo's). The child draws half the figures into their files and
exits; a child that fails, crashes or outlives a deadline is killed and its figures are drawn here, so the
report is the same either way (a test compares the bytes).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from core.forking import fork_child, kill_child


@dataclass(frozen=True)
class Figure:
    """A figure a stage hands the report, drawn only when the report is written: its title on the page, its
    file name under figures/, and the function that draws it into the path it is given and returns the PNG
    (None: no figure, and no file)."""

    title: str
    file: str
    draw: Callable[[Path], bytes | None]


#: A figure to draw: its file, and the function that draws it there and returns the PNG (None: no figure).
Job = tuple[Path, Callable[[], bytes | None]]

#: Set False to draw everything in this process (tests compare the two ways).
PARALLEL = True
#: How long a child may take beyond ten times the parent's own share before it is killed.
CHILD_GRACE_S = 20.0
_FRAMEWORKS = ("torch", "mindspore")


def _can_fork(jobs: list[Job]) -> bool:
    return (PARALLEL and len(jobs) >= 2 and hasattr(os, "fork") and (os.cpu_count() or 1) >= 2
            and threading.active_count() == 1 and not any(m in sys.modules for m in _FRAMEWORKS))


def render(jobs: list[Job], alongside: Callable[[], None] | None = None) -> list[bytes | None]:
    """Every job's PNG, in order; each job has also written its file (or none, for no figure).
    ``alongside`` (work that lets go of the GIL, such as a CSV write) runs in a thread meanwhile, started
    after the fork so the child never inherits it; its exception is raised here."""
    child = [_can_fork(jobs) and i % 2 == 1 for i in range(len(jobs))]   # every second figure; the CSV here
    theirs = [j for j, c in zip(jobs, child, strict=True) if c]
    pid = _start_child(theirs) if theirs else None
    if pid is None:
        child, theirs = [False] * len(jobs), []
    t = time.perf_counter()
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            side = pool.submit(alongside) if alongside else None
            mine = [draw() for (_, draw), c in zip(jobs, child, strict=True) if not c]
            if side is not None:
                side.result()
    except BaseException:
        if pid is not None:
            _wait(pid, deadline=0.0)
        raise
    if pid is None:
        return mine
    done = _wait(pid, deadline=time.perf_counter() + max(CHILD_GRACE_S, 10 * (time.perf_counter() - t)))
    got = [(p.read_bytes() if p.is_file() else None) if done else draw() for p, draw in theirs]
    mine_it, got_it = iter(mine), iter(got)
    return [next(got_it) if c else next(mine_it) for c in child]


def _start_child(theirs: list[Job]) -> int | None:
    """Fork a child that draws ``theirs`` into their files and exits; its pid, or None when fork fails (then
    everything is drawn here)."""
    for path, _ in theirs:
        path.unlink(missing_ok=True)
    try:
        pid = fork_child()     # SIGINT at its default in the child: a Ctrl-C is the parent's to handle
    except OSError:
        return None
    if pid == 0:   # the child: draw, then leave without running the parent's exit handlers
        code = 0
        try:
            for _, draw in theirs:
                draw()
        except BaseException:   # noqa: BLE001 - any failure: the parent draws these again
            code = 1
        os._exit(code)
    return pid


def _wait(pid: int, deadline: float) -> bool:
    """Whether the child exited cleanly before the deadline; one that did not (or a Ctrl-C meanwhile) is
    killed."""
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status) == 0
            if time.perf_counter() > deadline:
                break
            time.sleep(0.002)
    except BaseException:
        kill_child(pid)
        raise
    kill_child(pid)
    return False
