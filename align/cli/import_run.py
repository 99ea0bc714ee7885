"""`align import SOURCE --out RUN_DIR`: a log, TensorBoard folder, golden values or msprobe dump as a run store."""

from __future__ import annotations

import argparse
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from core.errors import BadInput

HELP = "turn a Megatron/MindFormers log, TensorBoard dir, golden values or msprobe dump into a run store"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from sources import sources
    parser.description = "SOURCE is detected: " + "; ".join(s.describe for s in sources() if s.kind != "runstore")
    parser.add_argument("source", metavar="SOURCE", help="the file or folder to import (its kind is detected)")
    parser.add_argument("--out", required=True, metavar="RUN_DIR", help="the run store to write (created)")


def run(args: argparse.Namespace) -> int:
    from core.outputs import check_out_dir
    from runstore.run import save_run
    from sources import detect, load_run
    out = check_out_dir(args.out)     # before the source is read: a long read must not end in a refusal
    if out.exists() and any(out.iterdir()):
        raise BadInput(f"{out}: exists and is not empty")
    kind = detect(args.source)
    if kind == "runstore":
        raise BadInput(f"{args.source}: already a run store")
    loaded = load_run(args.source, kind)
    _save_atomically(loaded, out, save_run)
    print(f"{args.source} ({kind}): {len(loaded.steps)} steps -> {out}")
    for note in loaded.notes:
        print(f"  note: {note}")
    return 0


def _save_atomically(loaded: object, out: Path, save_run: Callable[[object, Path], object]) -> None:
    """Write the store in a temporary folder beside ``out`` and rename it into place: a Ctrl-C or an error
    half-way leaves no half store (core.interrupts)."""
    from core.interrupts import committing
    from core.outputs import temp_beside

    tmp = temp_beside(out)
    try:
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)          # a folder as mkdir would make it, not mkdtemp's 0700
        save_run(loaded, tmp)
        with committing():
            os.replace(tmp, out)           # an empty folder named out is replaced
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
