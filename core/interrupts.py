"""Ctrl-C in the ``align`` command: it always ends as "interrupted" (exit 130), and nothing half-written stays.

Two things make that hard. Libraries turn a KeyboardInterrupt into something else (pandas re-raises one that
hits its `import numpy` as an ImportError; a reader's ``except`` may swallow it), so the command installs
``handler``, which notes that Ctrl-C came (``seen()``) before it raises: whatever the exception, or none,
the command then ends as interrupted. And outputs are assembled in a temporary folder and moved into place at
the end (reports/writer.py): ``committing()`` refuses to move them once Ctrl-C has been seen, and ignores SIGINT
while they move; in the command (``install()``) SIGINT then stays ignored, so a Ctrl-C that comes after the
report is in place does nothing and the run ends with its verdict. As a library (tests, notebooks) nothing
is installed: Python's own KeyboardInterrupt, restored after the move.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

_SEEN = False
_INSTALLED = False


def handler(signum: int, frame: FrameType | None) -> None:
    """SIGINT in the command: remember it, then raise KeyboardInterrupt as Python would; but not inside an
    import (a C extension's import may print it as a traceback, or a package turn it into an ImportError):
    there it is raised again 10 ms later, until the import is over."""
    global _SEEN
    _SEEN = True
    if _importing(frame) and _retry_soon():
        return
    raise KeyboardInterrupt


#: How many of the innermost frames are looked at for importlib's: a module's body, or a function it calls,
#: run by the import system (the outer frames of a long chain of imports are not: Ctrl-C is raised in the
#: next module body that is not at an import's edge, not after the whole chain).
_IMPORT_DEPTH = 4


def _importing(frame: FrameType | None) -> bool:
    for _ in range(_IMPORT_DEPTH):
        if frame is None:
            return False
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _retry_soon() -> bool:
    """Call ``_retry`` in 10 ms (SIGALRM); False where there is no interval timer."""
    if not hasattr(signal, "setitimer") or not _main_thread():
        return False
    signal.signal(signal.SIGALRM, _retry)
    signal.setitimer(signal.ITIMER_REAL, 0.01)
    return True


def _retry(signum: int, frame: FrameType | None) -> None:
    if not _SEEN or signal.getsignal(signal.SIGINT) is not handler:   # outputs in place: too late to stop
        return
    if _importing(frame) and _retry_soon():
        return
    raise KeyboardInterrupt


def _disarm() -> None:
    if hasattr(signal, "setitimer") and signal.getsignal(signal.SIGALRM) is _retry:
        signal.setitimer(signal.ITIMER_REAL, 0)


def install() -> None:
    """The command line: Ctrl-C through ``handler``; once outputs are in place it is no longer delivered."""
    global _INSTALLED
    signal.signal(signal.SIGINT, handler)
    _INSTALLED = True


def seen() -> bool:
    """Whether Ctrl-C came since ``install()`` (whatever became of its KeyboardInterrupt)."""
    return _SEEN


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _settle() -> None:
    """A Python call: a Ctrl-C whose signal came before SIGINT was ignored has its handler run here."""


def ignore() -> None:
    """Ctrl-C does nothing from here on (process-wide: a signal mask would cover one thread only, and the
    kernel hands SIGINT to any thread that does not block it, a reader's C++ pool thread too)."""
    if _main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _disarm()


@contextmanager
def committing() -> Iterator[None]:
    """Move outputs into place: not at all once Ctrl-C was seen (KeyboardInterrupt), and without a Ctrl-C in
    the middle (see the module doc)."""
    if not _main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    ok = False
    try:
        _settle()
        _disarm()
        if _SEEN:
            raise KeyboardInterrupt
        yield
        ok = True
    finally:
        if not (ok and _INSTALLED):
            signal.signal(signal.SIGINT, old)
