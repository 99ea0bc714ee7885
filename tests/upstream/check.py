"""`make upstream-check MEGATRON_LM=DIR [MINDFORMERS_SRC=DIR]`: the migration as users run it, on real upstream
entry points, on CPU. By hand only (CI cannot download upstream code; pytest does not collect this folder).

1. Megatron-LM's own ``pretrain_gpt.py`` from the checkout MEGATRON_LM (tests/upstream/megatron_pretrain.py: CPU
   shim, initial-weights checkpoint, the run under ``python -m dumpers.megatron_lm``), then
   ``align report STORE megatron.log``: a clean run must pass against its own log.
2. With MINDFORMERS_SRC: ``align convert-weights`` of that checkpoint to where the shipped example YAML
   (docs/examples/mindformers_qwen3_tiny_cpu.yaml) loads it, MindFormers' own ``run_mindformer.py`` from the
   checkout training that YAML on CPU in GRAPH mode replaying Megatron's store
   (tests/upstream/mindformers_run.py, with the pinned mindformers wheel), then
   ``align report MEGATRON_STORE MF_STORE --baseline-config megatron.log --candidate-config train.yaml``.

Prints every stage's verdict of both reports; exit status 0 when both pass or warn, 1 when a report fails,
2 when a run could not be made.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for p in (str(ROOT), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

import megatron_pretrain as mlm  # noqa: E402

PRESET = "megatron_core__mindformers_mcore_dense"   # the example YAML's model (demo/model.py demo_model, dense)


def _align(*args: str) -> int:
    return subprocess.run([sys.executable, "-m", "align", *args], cwd=ROOT, check=False).returncode


def _print(title: str, summary: dict) -> None:
    print(f"{title}: verdict {summary['verdict']}")
    for name, st in summary["stages"].items():
        print(f"  {name:22} {st.get('verdict')}")


def pair(megatron: dict[str, Path], mindformers_src: Path, out: Path) -> int:
    """Convert Megatron's initial weights, train the example YAML with the checkout's run_mindformer.py, report."""
    import mindformers_run as mfr

    from demo.model import demo_model

    m = demo_model()
    mf_out = out / "mindformers"
    mf_out.mkdir(parents=True, exist_ok=True)
    rc = _align("convert-weights", "--to", "mindformers", str(megatron["checkpoint"]), "--out",
                str(mf_out / mfr.WEIGHTS), "--num-heads", str(m.num_attention_heads), "--num-query-groups",
                str(m.num_query_groups), "--mapping", PRESET)
    if rc != 0:
        print(f"upstream-check: align convert-weights exited {rc}", file=sys.stderr)
        return 2
    mf_store = mfr.run(mindformers_src, megatron["store"], mf_out)
    summary = mlm.report(megatron["store"], mf_store, out / "report_pair",
                         extra=("--baseline-config", str(megatron["log"]),
                                "--candidate-config", str(mf_out / "train.yaml")))
    _print(f"Megatron-LM store vs MindFormers run_mindformer.py store ({out / 'report_pair'})", summary)
    return _status(summary)


def _status(summary: dict) -> int:
    """The check's exit status from a report's: 1 fail, 2 anything else that is not 0."""
    return 1 if summary["exit"] == 1 else (2 if summary["exit"] else 0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--megatron-lm", required=True, help="a checkout of github.com/NVIDIA/Megatron-LM")
    ap.add_argument("--mindformers", default=None, help="a checkout of github.com/mindspore-ai/mindformers")
    ap.add_argument("--out", required=True, help="work folder")
    ns = ap.parse_args(argv)
    out = Path(ns.out).resolve()
    try:
        runs = mlm.run(ns.megatron_lm, out / "megatron")
        own = mlm.report(runs["store"], runs["log"], out / "report_megatron")
        print(f"Megatron-LM {ns.megatron_lm} (megatron-core {mlm.checkout_version(Path(ns.megatron_lm))})")
        _print("Megatron-LM store vs its own log", own)
        rc = _status(own)
        if ns.mindformers:
            rc = max(rc, pair(runs, Path(ns.mindformers), out))
    except (mlm.UpstreamError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        print(f"upstream-check: {exc}", file=sys.stderr)
        return 2
    return rc


if __name__ == "__main__":
    sys.exit(main())
