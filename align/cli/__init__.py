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
import sys
import tempfile
import time
import traceback

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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args))
    except BadInput as exc:
        print(f"align: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        extra = EXTRAS.get((exc.name or "").split(".")[0])
        if extra is None:
            raise
        print(f"align: error: `align {args.command}` needs the '{extra}' extra: pip install 'xf-align[{extra}]' "
              f"({exc})", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("align: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:      # a bug of ours, not the user's input: exit 3, the traceback kept in a file
        return _internal_error(args.command, exc)


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
