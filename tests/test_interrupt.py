"""Ctrl-C always ends with `align: interrupted`, exit 130 and nothing written (issue 36, item 4): while `align`
imports, while it builds its parser, and at several moments of a compare, sent to the process alone or to its
whole process group as a terminal does (the forked figure child gets it too)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from demo.example_logs import write_examples

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not hasattr(os, "fork") or not hasattr(signal, "SIGINT"), reason="POSIX signals")


def _default_sigint() -> None:
    # a test runner started in the background (`pytest &`) ignores SIGINT, and its children inherit that
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _python(code: str, argv0: str = "align") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", f"import sys; sys.argv[0] = {argv0!r}\n{code}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, preexec_fn=_default_sigint)


def test_ctrl_c_while_align_imports_is_one_line_exit_130() -> None:
    """From align/__init__.py on (the console script's `from align.cli import main`), before main() runs."""
    r = _python("import align, os, signal\nos.kill(os.getpid(), signal.SIGINT)\nimport align.cli\n"
                "print('not interrupted')")
    assert r.returncode == 130 and r.stderr == "align: interrupted\n" and not r.stdout, r


def test_importing_align_as_a_library_leaves_sigint_alone() -> None:
    r = _python("import signal, align\nassert signal.getsignal(signal.SIGINT) is signal.default_int_handler\n"
                "import align.cli\nassert signal.getsignal(signal.SIGINT) is signal.default_int_handler\nprint('ok')",
                argv0="-c")
    assert r.returncode == 0 and r.stdout == "ok\n", r


def test_ctrl_c_while_the_parser_is_built_is_one_line_exit_130(monkeypatch, capsys) -> None:
    import align.cli as cli

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli.main(["report", "a", "b", "--out", "o"]) == 130
    assert capsys.readouterr().err == "align: interrupted\n"


def test_ctrl_c_in_main_after_import_becomes_keyboard_interrupt() -> None:
    """main() hands Ctrl-C back to a KeyboardInterrupt (outputs clean up on the way out), one it remembers."""
    r = _python("import contextlib, signal\nimport align.cli as c\nfrom core import interrupts\n"
                "assert c._started_handler(signal.getsignal(signal.SIGINT))\n"
                "with contextlib.suppress(SystemExit):\n    c.main(['--no-such-flag'])\n"
                "assert signal.getsignal(signal.SIGINT) is interrupts.handler\n"
                "try:\n    signal.raise_signal(signal.SIGINT)\nexcept KeyboardInterrupt:\n"
                "    assert interrupts.seen()\n    print('ok')")
    assert r.returncode == 0 and "ok" in r.stdout, r


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_examples(tmp_path_factory.mktemp("runs"), 2000, "none", None)


def _report(runs: dict[str, Path], out: Path, delay: float | None, group: bool) -> tuple[int, str, bool, float]:
    """Run `align report`; ``delay`` seconds after its first progress line (the runs are being read: past
    Python's own start-up, which is not ours to answer), send SIGINT to it or to its process group.
    Returns (status, stderr, whether the signal went, seconds from the first progress line to the end)."""
    cmd = [sys.executable, "-m", "align", "report", str(runs["baseline"]), str(runs["candidate"]),
           "--repeat", str(runs["repeat"]), "--out", str(out)]
    log = out.parent / f"{out.name}.stderr"
    with open(log, "w") as err_fh:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err_fh, text=True,
                             start_new_session=True, preexec_fn=_default_sigint)
    sent = False
    try:
        deadline = time.monotonic() + 120
        while p.poll() is None and not log.read_text().startswith("align: ") and time.monotonic() < deadline:
            time.sleep(0.005)
        t0 = time.perf_counter()
        if delay is not None:
            time.sleep(delay)
            if p.poll() is None:
                (os.killpg if group else os.kill)(p.pid, signal.SIGINT)
                sent = True
        p.wait(timeout=300)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    return p.returncode, log.read_text(), sent, time.perf_counter() - t0


def test_ctrl_c_during_a_compare_always_exits_130_and_writes_nothing(runs, tmp_path) -> None:
    rc, err, _, took = _report(runs, tmp_path / "whole", None, False)
    assert rc == 0 and (tmp_path / "whole" / "summary.json").is_file(), err
    interrupted = 0
    for i, share in enumerate((0.0, 0.15, 0.35, 0.55, 0.75, 0.95)):
        for group in (False, True):
            out = tmp_path / f"r{i}{'g' if group else ''}"
            rc, err, sent, _ = _report(runs, out, share * took, group)
            if not sent or rc == 0:      # the compare ended first: a complete report, never half of one
                assert rc == 0 and (out / "summary.json").is_file(), (share, group, rc, err)
                continue
            interrupted += 1
            assert rc == 130, (share, group, rc, err)
            assert err.strip().splitlines()[-1] == "align: interrupted" and "Traceback" not in err, (share, err)
            assert not out.exists(), (share, group, sorted(out.rglob("*")))
            # nor the temporary folder the report is assembled in
            assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(f".{out.name}.")], (share, group)
    assert interrupted >= 4, interrupted      # the runs that ended first (a faster moment) count as rc 0


def test_an_interrupted_import_leaves_no_half_store(tmp_path, monkeypatch, capsys) -> None:
    import runstore.run
    from align.cli import main

    logs = write_examples(tmp_path / "in", 20, "none", None)
    real = runstore.run.save_run

    def half(run, out):
        real(run, out)          # everything written into the temporary folder, then Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(runstore.run, "save_run", half)
    assert main(["import", str(logs["baseline"]), "--out", str(tmp_path / "store")]) == 130
    assert capsys.readouterr().err == "align: interrupted\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]
    monkeypatch.setattr(runstore.run, "save_run", real)
    assert main(["import", str(logs["baseline"]), "--out", str(tmp_path / "store")]) == 0
    assert (tmp_path / "store" / "meta.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "store"]


def test_ctrl_c_inside_an_import_is_raised_once_the_import_is_over(tmp_path) -> None:
    """A KeyboardInterrupt raised inside an import can be printed by a C extension or turned into an
    ImportError by a package (pandas' `import numpy`): the command's handler raises it after the import."""
    (tmp_path / "slowmod.py").write_text("import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\n"
                                         "t = time.time()\nwhile time.time() - t < 0.1:\n    pass\n")
    r = _python(f"sys.path.insert(0, {str(tmp_path)!r})\nfrom core import interrupts\ninterrupts.install()\n"
                "try:\n    try:\n        import slowmod\n    except ImportError:\n        print('converted')\n"
                "    import time\n    time.sleep(2)\n    print('not raised')\nexcept KeyboardInterrupt:\n"
                "    print('after the import', 'slowmod' in sys.modules, interrupts.seen())\n")
    assert r.returncode == 0 and r.stdout == "after the import True True\n" and not r.stderr, r


def test_a_forked_child_leaves_ctrl_c_to_its_parent() -> None:
    """core.forking: SIGINT at its default in the child (it ends at once, never unwinding the parent's stack
    in the child: the CLI's 'interrupted', a temporary folder removed under the parent)."""
    from core.forking import fork_child

    pid = fork_child()
    if pid == 0:
        try:
            time.sleep(10)
        finally:
            os._exit(7)      # reached only if SIGINT raised KeyboardInterrupt here instead of ending the child
    time.sleep(0.2)
    os.kill(pid, signal.SIGINT)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGINT, status
