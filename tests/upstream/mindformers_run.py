"""By hand, not collected by pytest: MindFormers' REAL ``run_mindformer.py`` (from a checkout of
github.com/mindspore-ai/mindformers) trains the shipped example YAML on CPU with the pinned mindformers 2.1.0 wheel,
replaying a megatron-core run made by the project's Megatron CPU runner; then ``align report`` judges the pair.

    PYTHONPATH=$PWD .venv/bin/python tests/upstream/mindformers_run.py /path/to/mindformers [--out DIR] [--moe]

Why ``python -P``: ``python CHECKOUT/run_mindformer.py`` puts CHECKOUT first on ``sys.path``, and a checkout holds
its own ``mindformers/`` package (master, not 2.1.0), which would shadow the installed wheel. Python 3.11's ``-P``
(or ``PYTHONSAFEPATH=1``, e.g. under msrun) does not prepend the script's folder, so ``import mindformers`` finds
the wheel; the run is checked for that (no module of CHECKOUT/mindformers in its output). Without ``-P`` the
checkout's package is imported and fails on its own requirements (measured on master:
``ModuleNotFoundError: No module named 'nltk'`` from mindformers/core/metric/metric.py). The script resolves a
relative ``--config`` / ``--register_path`` against its own folder, so both are passed absolute.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# importing mindformers (the helpers below do) writes ./output/log unless pointed elsewhere
os.environ.setdefault("LOCAL_DEFAULT_PATH", os.path.join(tempfile.gettempdir(), "xf_align_mindformers"))
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.test_mindformers_yaml import (  # noqa: E402
    EXAMPLES,
    WEIGHTS,
    convert_weights,
    example_yaml,
    make_megatron_store,
    report,
    run_mindformer,
)


def run(checkout: str | Path, store: str | Path, out: str | Path, kind: str = "dense",
        dataset: dict[str, int] | None = None) -> Path:
    """Train the example YAML of ``kind`` with CHECKOUT/run_mindformer.py, replaying STORE; OUT must hold the
    converted Megatron weights (OUT/megatron_init.safetensors, `align convert-weights`). ``dataset``: keys added
    to the replay's dataset block (e.g. ``data_parallel: 1``: the whole global batch of a DP > 1 store on this
    one process). Returns the MindFormers run store (OUT/run)."""
    script = Path(checkout).resolve() / "run_mindformer.py"
    out = Path(out).resolve()
    if not script.is_file():
        raise SystemExit(f"{script}: no such file (a checkout of github.com/mindspore-ai/mindformers has it)")
    if not (out / WEIGHTS).is_file():
        raise SystemExit(f"{out / WEIGHTS}: missing; write it with align convert-weights first")
    example = EXAMPLES[kind][0]
    shutil.rmtree(out / "run", ignore_errors=True)    # a run store left by an earlier check would be appended to
    config = example_yaml(Path(store).resolve(), out, example)
    if dataset:     # the example's one dataset block (train_dataset, aliased by train_dataset_task.dataset_config)
        text = config.read_text()
        anchor = "train_dataset: &train_dataset\n"
        if anchor not in text:
            raise SystemExit(f"{example}: no '{anchor.strip()}' block to add {dataset} to")
        start = text.index(anchor) + len(anchor)
        end = re.search(r"(?m)^\S", text[start:])
        block = text[start: start + end.start() if end else len(text)]
        for key in dataset:     # the block's own line of that key (the examples' data_parallel: 1) is replaced
            block = re.sub(rf"(?m)^  {re.escape(key)}:.*\n(?:^ {{10,}}#.*\n)*", "", block)
        block = "".join(f"  {k}: {v}\n" for k, v in dataset.items()) + block
        config.write_text(text[:start] + block + text[start + (end.start() if end else len(text) - start):])
    log = run_mindformer(script, config, out, python=[sys.executable, "-P"], example=example)
    shadow = str(script.parent / "mindformers") + "/"
    if shadow in log:
        raise SystemExit(f"{script}: the checkout's own mindformers package was imported ({shadow})")
    return out / "run"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", help="a mindspore-ai/mindformers checkout (has run_mindformer.py)")
    parser.add_argument("--out", help="work folder (default: a new temporary one)")
    parser.add_argument("--moe", action="store_true", help="the Qwen3-MoE example instead of the dense one")
    args = parser.parse_args(argv)
    kind = "moe" if args.moe else "dense"
    root = Path(args.out or tempfile.mkdtemp(prefix="xf_mindformers_upstream_")).resolve()
    store, init_pt = make_megatron_store(root / "baseline", kind=kind, tensor_steps="1" if kind == "dense" else "")
    convert_weights(init_pt, root / "mf", kind=kind)
    mf_store = run(args.checkout, store, root / "mf", kind)
    rc, _ = report(store, mf_store, root / "mf" / "train.yaml", root / "report")   # prints the verdicts
    print(f"megatron store: {store}\nmindformers store: {mf_store}\nalign report exit status: {rc}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
