"""The procedure and the command line, the top of the stack: ``checks/`` and ``stages/`` judge the evidence,
``procedure/`` runs the stages in the accuracy guide's order and writes the report, ``cli/`` is ``align``."""

import sys as _sys


def _started_as_cli() -> bool:
    """Whether this process is the ``align`` command (the console script, or ``python -m align``)."""
    import os

    if os.path.basename(_sys.argv[0] if _sys.argv else "").removesuffix(".exe") == "align":
        return True
    argv = list(getattr(_sys, "orig_argv", []))
    for i, a in enumerate(argv[:-1]):
        if a == "-m":
            return argv[i + 1].split(".")[0] == "align"
    return any(a.startswith("-malign") for a in argv)


def _interrupted_while_starting(signum, frame):    # noqa: ANN001 - a signal handler's signature
    """Ctrl-C while `align` is still importing (before main() takes over): nothing has been written yet, so
    leave at once with the same one line as later, not a traceback."""
    import os

    os.write(2, b"align: interrupted\n")
    os._exit(130)


if _started_as_cli():
    import _signal  # the built-in module itself: `signal` would import enum first, a window of its own

    # only where Ctrl-C would raise KeyboardInterrupt (not where the shell ignores it: `align ... &`); a
    # thread other than the main one cannot set a handler (ValueError): nothing to do there
    if _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:
        try:
            _signal.signal(_signal.SIGINT, _interrupted_while_starting)
        except ValueError:
            pass
