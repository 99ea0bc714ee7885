"""Several fault pairs of the demo at once, each side's runs in as few framework processes as they allow.

Why: every fault pair of :func:`demo.pair.paired_demo` starts its own MindSpore process for the candidate
(imports, MindFormers' context, the build: most of a short fault run on CPU). ``demo.mindformers_runner`` already
runs a list of specs in one process, each built from its own spec alone (its converted weights, its optimizer,
the batches of the baseline it replays; MindFormers' context singleton is reused, as for the clean pair's
optimizer check), so the candidates of many pairs share one start-up; ``demo.megatron_runner`` does the same for
the baselines of one parallel layout (each run seeds and builds from its spec; the parallel state stays). Each
pair then gets the report, summary and demo.json that ``paired_demo`` would write for it, from stores that a
process of its own writes bit for bit alike (tests/test_demo.py and test_demo_baseline_faults.py check it).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from align.procedure import stderr_progress
from core.errors import BadInput
from demo.pair import compare_pair, copy_baseline_side, make_specs, run_jobs
from demo.spec import DEFAULT_SEED, fault


@dataclass(frozen=True)
class FaultPair:
    """One fault pair of a batch: the fault, its steps, and which optional runs its stage needs."""

    inject: str
    steps: int
    lr0_steps: int = 0               # 0: no lr = 0 pair
    optimizer_check: bool = False


def paired_faults(out: str | Path, pairs: list[FaultPair], *, reuse_baseline: str | Path | None = None,
                  model_kind: str = "dense", seed: int = DEFAULT_SEED, candidate_graph: bool = False,
                  parallel: int = 2, candidate_processes: int = 1, rerun_first: bool = False
                  ) -> dict[str, dict[str, Any]]:
    """Run each pair in ``out/<fault>`` (no repeat) and return each one's summary.json content by fault name.

    Candidate-side faults reuse ``reuse_baseline``'s baseline-side runs (as ``paired_demo(reuse_baseline=...)``);
    baseline-side ones (or all, without it) run their own baseline, all in one Megatron process (the same layout:
    no repeat). The candidates of all pairs run in ``candidate_processes`` MindSpore processes after it,
    ``parallel`` processes at a time. ``rerun_first``: the first pair's candidate (and its baseline, when it has
    its own) runs once more, last in its process, into ``out/<fault>/again/`` (tests compare the two: nothing a
    run leaves in the process changes the next, and the first run of a process is what a process of its own
    writes)."""
    out = Path(out)
    if not pairs:
        return {}
    if len({p.inject for p in pairs}) != len(pairs):
        raise BadInput(f"{out}: a fault twice in one batch")
    t0 = time.perf_counter()
    prepared: list[tuple[FaultPair, Path, dict, list]] = []
    baselines: list[Any] = []
    for p in pairs:
        f = fault(p.inject)
        work = out / p.inject / "runs"
        work.mkdir(parents=True, exist_ok=True)
        specs = make_specs(work, p.steps, p.lr0_steps, p.inject, model_kind, seed, candidate_graph)
        lr0 = p.lr0_steps > 0
        if reuse_baseline is not None and f is not None and f.side in ("candidate", "conversion"):
            copy_baseline_side(reuse_baseline, work, model_kind, seed)
        else:
            baselines += [specs["baseline"]] + ([specs["lr0_baseline"]] if lr0 else [])
        cand = ([specs["candidate"]] + ([specs["optimizer_check"]] if p.optimizer_check else [])
                + ([specs["lr0_candidate"]] if lr0 else []))
        prepared.append((p, out / p.inject, specs, cand))
    again = prepared[0][1] / "again"
    jobs: list[tuple] = []
    if baselines:     # one Megatron process (one layout: no repeat here), then every candidate
        if rerun_first and baselines[0] is prepared[0][2]["baseline"]:
            baselines.append(replace(baselines[0], out=str(again / "baseline"), result_file=None,
                                     init_weights=str(again / "megatron_init.pt")))
        jobs.append(("baselines", baselines))
    n = max(1, min(candidate_processes, len(prepared)))
    for i in range(n):
        mine = prepared[i::n]
        rerun = []
        if rerun_first and i == 0:
            first = mine[0][2]["candidate"]
            rerun = [replace(first, out=str(again / "candidate"), result_file=None,
                             converted=str(again / Path(first.converted or "converted").name))]
        jobs.append((f"candidates_{i}", [s for item in mine for s in item[3]] + rerun,
                     {"baselines"} if baselines else set()))
    took = run_jobs(jobs, out, parallel)
    stderr_progress(f"{len(pairs)} fault pairs' runs done in {time.perf_counter() - t0:.1f} s")
    results: dict[str, dict[str, Any]] = {}
    for i, (p, pair_out, specs, _) in enumerate(prepared):
        own = "baselines" in took and any(s is specs["baseline"] for s in baselines)
        batch = [q.inject for q, *_ in prepared[i % n::n]]
        run_seconds = {**({f"baselines (one process, {len(baselines)} runs)": took["baselines"]} if own else {}),
                       f"candidates (one process, {len(batch)} pairs)": took[f"candidates_{i % n}"]}
        results[p.inject] = compare_pair(pair_out, specs, run_seconds, p.inject)
        meta = {"inject": p.inject, "model": model_kind, "seed": seed, "steps": p.steps, "lr0_steps": p.lr0_steps,
                "wall_seconds": time.perf_counter() - t0, "run_seconds": run_seconds, "baseline_reused": not own,
                "batch": batch}
        (pair_out / "demo.json").write_text(json.dumps(meta, indent=1))
    return results
