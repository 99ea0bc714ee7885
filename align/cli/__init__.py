"""``align`` command line. Exit status: 0 pass or warn, 1 fail, 2 bad input (one line, no traceback), 3 an
internal error (one line naming the file that holds the traceback), so a CI gate never takes a crash for a fail.

One module per verb in this folder, listed in ``VERBS``: it defines ``HELP``, ``add_arguments(parser)`` and
``run(args) -> int``, and imports its library only inside ``run``, so every verb shows in ``--help`` even
where an optional extra is missing; running it then says which extra to install (``EXTRAS``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import tempfile
import threading
import time
import traceback

from core import interrupts
from core.errors import BadInput

# verb -> module in this folder, in the order `align --help` lists them
VERBS = {
    "report": "report",
    "import": "import_run",
    "demo": "demo",
    "check-config": "check_config",
    "check-data": "check_data",
    "convert-weights": "convert_weights",
    "compare-weights": "compare_weights",
    "isolate": "isolate",
    "drill": "drill",
    "repro": "repro",
    "capture-env": "capture_env",
    "mapping": "mapping",
}
# a missing top-level module -> the pyproject extra that installs it
EXTRAS = {"torch": "torch", "megatron": "torch", "mindspore": "mindspore", "mindformers": "mindspore",
          "safetensors": "checkpoints", "tensorboard": "tensorboard", "dask": "dask", "distributed": "dask"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="align", description="Cross-framework accuracy alignment: "
                                     "Megatron-LM (PyTorch) vs MindFormers (MindSpore).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in VERBS.items():
        verb = importlib.import_module(f"{__name__}.{module}")
        p = sub.add_parser(name, help=verb.HELP)
        verb.add_arguments(p)
        p.set_defaults(_run=verb.run)
    return parser


def _started_handler(handler: object) -> bool:
    """Whether ``handler`` is the one align/__init__.py set while `align` imported (named, not imported: the
    package's top importing this folder back would be a cycle of folders)."""
    return (getattr(handler, "__module__", None) == "align"
            and getattr(handler, "__name__", None) == "_interrupted_while_starting")


def main(argv: list[str] | None = None) -> int:
    cli = False
    try:
        # from here on Ctrl-C is a KeyboardInterrupt that is remembered (align/__init__.py answered it while
        # `align` imported); a library that turns it into another error (pandas: an ImportError) or swallows
        # it does not change the outcome: interrupted, exit 130
        if (threading.current_thread() is threading.main_thread()
                and _started_handler(signal.getsignal(signal.SIGINT))):
            interrupts.install()
            cli = True
        args = build_parser().parse_args(argv)
    except BaseException as exc:
        if interrupts.seen() or isinstance(exc, KeyboardInterrupt):
            return interrupted()
        raise
    try:
        code = _run(args)
        # Ctrl-C that a library swallowed (the run went on): still interrupted (its outputs were not moved
        # into place: core.interrupts.committing)
        code = interrupted() if interrupts.seen() and code != 130 else code
    finally:
        if cli:     # the run is over (its outputs in place, or none): a late Ctrl-C must not change its status
            interrupts.ignore()
    if cli and code == 130:
        # every finally has run (temporary folders gone, forked children reaped): leave now, without
        # waiting for reader threads still busy with a large log
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(130)
    return code


def _run(args: argparse.Namespace) -> int:
    try:
        return int(args._run(args))
    except BaseException as exc:
        if interrupts.seen() or isinstance(exc, KeyboardInterrupt):   # whatever a library made of Ctrl-C
            return interrupted()
        return _failed(args.command, exc)


def _failed(command: str, exc: BaseException) -> int:
    """Exit status 2 (bad input: one line) or 3 (a bug of ours: the traceback saved), for ``exc``."""
    if isinstance(exc, BadInput):
        print(f"align: error: {exc}", file=sys.stderr)
        return 2
    if isinstance(exc, OSError):    # a file the system would not let us read or write: the user's to fix
        print(f"align: error: {_os_error(exc)}", file=sys.stderr)
        return 2
    if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] in EXTRAS:
        extra = EXTRAS[(exc.name or "").split(".")[0]]
        print(f"align: error: `align {command}` needs the '{extra}' extra: pip install 'xf-align[{extra}]' "
              f"({exc})", file=sys.stderr)
        return 2
    if not isinstance(exc, Exception):     # SystemExit and the like: not ours to translate
        raise exc
    return _internal_error(command, exc)   # a bug of ours, not the user's input: exit 3, traceback in a file


def interrupted() -> int:
    """Ctrl-C: one line, exit 130 (128 + SIGINT, what a shell reports for a killed command). Outputs are
    assembled in a temporary folder and moved into place at the end (core.interrupts), so nothing
    half-written is left."""
    try:
        print("align: interrupted", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass
    return 130


def _os_error(exc: OSError) -> str:
    """One line for an OSError: the file it names and the system's reason."""
    reason = exc.strerror or " ".join(str(exc).split()) or exc.__class__.__name__
    if exc.filename is None:
        return reason
    where = str(exc.filename) + (f" -> {exc.filename2}" if exc.filename2 is not None else "")
    return f"{where}: {reason}"


def _internal_error(command: str, exc: Exception) -> int:
    text = "".join(traceback.format_exception(exc))
    try:
        fd, path = tempfile.mkstemp(prefix=f"align-{command}-{time.strftime('%Y%m%d-%H%M%S')}-",
                                    suffix=".traceback.txt")
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(f"align {' '.join(sys.argv[1:])}\n\n{text}")
        where = f"traceback in {path}"
    except OSError:
        where = "traceback could not be saved:\n" + text
    what = " ".join(str(exc).split())[:300]
    print(f"align: internal error in `align {command}`: {type(exc).__name__}: {what} ({where}); please report it",
          file=sys.stderr)
    return 3


if __name__ == "__main__":
    sys.exit(main())
