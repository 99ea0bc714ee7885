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

3. A TP=2 dense baseline (``pretrain_gpt.py`` under torchrun, 2 processes): its store against its own log.
4. The MoE baseline at EP=2 (2 processes: DP=2, two of the 4 experts per rank; the example YAML's MoE: 4
   experts, top 2, no router losses, ``MOE_PAIR``): its store against its own log;
   with MINDFORMERS_SRC, ``align convert-weights`` of its checkpoint without ``--mapping`` (the preset from the
   tensor names) and MindFormers' MoE example YAML (docs/examples/mindformers_qwen3_moe_tiny_cpu.yaml, one
   process) replaying the DP=2 store re-split by sample onto DP=1 (``data_parallel: 1``), then the pair report.
5. The MoE baseline at EP=2 with the router's losses on (``MOE``: load balancing 1e-2, z-loss 1e-3): its store
   against its own log (core 0.16 - 0.17 print the last rank's own z_loss: sources/megatron_log_moe.py).

Prints every stage's verdict of every report and a last table, one row per run; exit status 0 when all pass or
warn, 1 when a report fails, 2 when a run could not be made (the other rows still run).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

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


def moe_pair(megatron: dict[str, Path], mindformers_src: Path, out: Path) -> dict:
    """The EP=2 (DP=2) MoE store against MindFormers' MoE example YAML on one process: weights converted without
    ``--mapping``, the replay re-splitting each step's global batch onto DP=1."""
    import mindformers_run as mfr

    from demo.model import demo_model

    m = demo_model()
    mf_out = out / "mindformers_moe"
    mf_out.mkdir(parents=True, exist_ok=True)
    rc = _align("convert-weights", "--to", "mindformers", str(megatron["checkpoint"]), "--out",
                str(mf_out / mfr.WEIGHTS), "--num-heads", str(m.num_attention_heads), "--num-query-groups",
                str(m.num_query_groups))
    if rc != 0:
        raise mlm.UpstreamError(f"align convert-weights (MoE, EP=2 checkpoint, no --mapping) exited {rc}")
    mf_store = mfr.run(mindformers_src, megatron["store"], mf_out, "moe", dataset={"data_parallel": 1})
    summary = mlm.report(megatron["store"], mf_store, out / "report_pair_moe",
                         extra=("--baseline-config", str(megatron["log"]),
                                "--candidate-config", str(mf_out / "train.yaml")))
    _print(f"Megatron-LM MoE EP=2 store vs MindFormers MoE run_mindformer.py store, DP 2 -> 1 "
           f"({out / 'report_pair_moe'})", summary)
    return summary


def pair(megatron: dict[str, Path], mindformers_src: Path, out: Path) -> dict:
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
        raise mlm.UpstreamError(f"align convert-weights exited {rc}")
    mf_store = mfr.run(mindformers_src, megatron["store"], mf_out)
    summary = mlm.report(megatron["store"], mf_store, out / "report_pair",
                         extra=("--baseline-config", str(megatron["log"]),
                                "--candidate-config", str(mf_out / "train.yaml")))
    _print(f"Megatron-LM store vs MindFormers run_mindformer.py store ({out / 'report_pair'})", summary)
    return summary


def _status(summary: dict) -> int:
    """The check's exit status from a report's: 1 fail, 2 anything else that is not 0."""
    return 1 if summary["exit"] == 1 else (2 if summary["exit"] else 0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--megatron-lm", required=True, help="a checkout of github.com/NVIDIA/Megatron-LM")
    ap.add_argument("--mindformers", default=None, help="a checkout of github.com/mindspore-ai/mindformers")
    ap.add_argument("--out", required=True, help="work folder")
    ap.add_argument("--only", default=None, help="comma-separated rows: dense, tp2, moe, moe_losses (default: all)")
    ns = ap.parse_args(argv)
    out = Path(ns.out).resolve()
    only = set(ns.only.split(",")) if ns.only else {"dense", "tp2", "moe", "moe_losses"}
    print(f"Megatron-LM {ns.megatron_lm} (megatron-core {mlm.checkout_version(Path(ns.megatron_lm))})")
    rows: list[tuple[str, str, dict | None]] = []
    rc = 0

    def row(name: str, work: Any) -> None:
        nonlocal rc
        summary = None
        try:
            summary = work()
            verdict = f"{summary['verdict']} (exit {summary['exit']})" if isinstance(summary, dict) else str(summary)
            rc = max(rc, _status(summary) if isinstance(summary, dict) else 0)
        except (mlm.UpstreamError, subprocess.CalledProcessError, subprocess.TimeoutExpired, RuntimeError,
                SystemExit) as exc:
            print(f"upstream-check: {name}: {exc}", file=sys.stderr)
            verdict, rc = f"not made: {' '.join(str(exc).split())[:160]}", max(rc, 2)
        rows.append((name, verdict, summary if isinstance(summary, dict) else None))

    def own(name: str, runs: dict[str, Path], report_dir: str) -> dict:
        summary = mlm.report(runs["store"], runs["log"], out / report_dir)
        _print(f"Megatron-LM {name} store vs its own log", summary)
        return summary

    made: dict[str, dict[str, Path]] = {}

    def baseline(key: str, folder: str, **kw: Any) -> dict[str, Path]:
        made[key] = mlm.run(ns.megatron_lm, out / folder, **kw)
        return made[key]

    if "dense" in only:
        row("dense DP=1: store vs own log", lambda: own("dense DP=1", baseline("dense", "megatron"), "report_megatron"))
        if ns.mindformers and "dense" in made:
            row("dense DP=1 vs MindFormers (dense example YAML)",
                lambda: pair(made["dense"], Path(ns.mindformers), out))
    if "tp2" in only:
        row("dense TP=2: store vs own log", lambda: own("dense TP=2", baseline(
            "tp2", "megatron_tp2", extra=mlm.TP2, nproc=2), "report_megatron_tp2"))
    if "moe" in only:
        row("MoE EP=2 (DP=2): store vs own log", lambda: own("MoE EP=2", baseline(
            "moe", "megatron_moe_ep2", extra=[*mlm.MOE_PAIR, *mlm.EP2], nproc=2), "report_megatron_moe_ep2"))
        if ns.mindformers and "moe" in made:
            row("MoE EP=2 (DP=2) vs MindFormers MoE example YAML, replay DP 2 -> 1",
                lambda: moe_pair(made["moe"], Path(ns.mindformers), out))
    if "moe_losses" in only:
        row("MoE EP=2 (DP=2), router losses on: store vs own log", lambda: own("MoE EP=2 router losses", baseline(
            "moe_losses", "megatron_moe_ep2_losses", extra=[*mlm.MOE, *mlm.EP2], nproc=2),
            "report_megatron_moe_ep2_losses"))
    print("\nupstream-check rows:")
    for name, verdict, summary in rows:
        print(f"  {name:<68} {verdict}")
        if summary is not None:
            print(f"      {_numbers(summary)}")
    return rc


def _numbers(summary: dict) -> str:
    """A report's step-1 / step-2 loss deltas, its local-norm and data verdicts and its diagnosis, in one line."""
    st = summary["stages"]

    def rel(key: str) -> str:
        v = st.get(key, {}).get("rel_delta")
        return f"{v:.1e}" if isinstance(v, (int, float)) else st.get(key, {}).get("verdict", "-")

    data = [f["message"] for f in summary["findings"] if f["metric"] in ("same_samples", "same_batches")]
    diag = summary.get("diagnosis") or []
    first = (f"{diag[0]['stage']}: {diag[0].get('component')}: {' '.join(str(diag[0].get('message')).split())[:200]}"
             if diag else "none")
    norms, checks = st.get("step1_local_norm", {}).get("verdict", "-"), st.get("data_checks", {}).get("verdict", "-")
    return (f"step1 rel {rel('step1_loss')}, step2 rel {rel('step2_loss')}, local norms {norms}, data {checks}"
            + (f" ({data[0][:160]})" if data else "") + f"; diagnosis: {first}")


if __name__ == "__main__":
    sys.exit(main())
