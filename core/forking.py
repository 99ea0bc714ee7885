"""Forking a helper process whose Ctrl-C is its parent's to handle.

A forked child starts as a copy of the parent, Python's SIGINT handler included: a Ctrl-C that lands in it
would raise KeyboardInterrupt there and could unwind the parent's stack in the child (its ``except`` and
``finally`` blocks: the CLI's "interrupted", a temporary folder removed under the parent). ``fork_child``
blocks SIGINT across the fork, gives the child the default action (a Ctrl-C ends it at once, silently: the
parent, which gets the same Ctrl-C, kills and reaps it and reports), and re-raises in the parent a Ctrl-C
that arrived meanwhile, after killing the child it would otherwise lose.
"""

from __future__ import annotations

import os
import signal


def fork_child() -> int:
    """``os.fork()`` (0 in the child, the child's pid in the parent; OSError when it fails), with SIGINT
    at its default action in the child."""
    mask = hasattr(signal, "pthread_sigmask")
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}) if mask else None
    try:
        pid = os.fork()
    except BaseException:
        if mask:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        raise
    if pid == 0:
        try:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
        except ValueError:      # not the main thread: keep the mask instead (a Ctrl-C never reaches the child)
            return 0
        if mask:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        return 0
    try:
        if mask:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)   # a Ctrl-C that came meanwhile raises here
    except BaseException:
        kill_child(pid)
        raise
    return pid


def kill_child(pid: int) -> None:
    """Kill a forked child and reap it (already gone: nothing to do)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
