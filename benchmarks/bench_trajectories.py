"""Parameter-trajectory benchmark (issue 27 item 3): named norms of 100,000 steps x ~300 parameters.

Parts (inputs generated here; stores in a temporary folder, removed):
  compare      pair_trajectories + judge on in-memory trajectories: baseline, candidate, one repeat, each
               ``--steps`` x ``--params`` (float32), through the mcore dense preset; one parameter drifts
  figure       the stage's figure of the six parameters that matter most, ``--steps`` points each
  read         read_trajectory on a run store of ``--store-steps`` step files (one rank, ``--params`` rows),
               in this process and in forked readers (``--jobs``, default every core): per-file cost,
               extrapolated to ``--steps`` (opening an HDF5 file is most of it)

Prints min / median wall and CPU seconds over ``--repeats`` and the peak RSS of this process.

    .venv/bin/python benchmarks/bench_trajectories.py [--steps 100000] [--params 291] [--store-steps 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_logs import timed  # this folder is on sys.path when run as a script

from comparators.trajectories import Trajectory, TrajectoryOptions, judge, pair_trajectories, read_trajectory
from models import load_mapping
from reports.figures import norm_trajectories
from runstore import RunWriter, open_store

PRESET = "megatron_core__mindformers_mcore_dense"
PER_LAYER = ("input_layernorm.weight", "self_attention.linear_qkv.weight", "self_attention.q_layernorm.weight",
             "self_attention.k_layernorm.weight", "self_attention.linear_proj.weight", "pre_mlp_layernorm.weight",
             "mlp.linear_fc1.weight", "mlp.linear_fc2.weight", "self_attention.linear_qkv.bias")


def names(n: int) -> list[str]:
    """``n`` Megatron-core parameter names: embedding, layer by layer, final norm and output layer."""
    out = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"]
    layer = 0
    while len(out) < n:
        out += [f"decoder.layers.{layer}.{p}" for p in PER_LAYER]
        layer += 1
    return out[:n]


def line(what: str, r: dict[str, list[float]]) -> None:
    w, c = r["wall_s"], r["cpu_s"]
    print(f"{what:<58} wall min {min(w):7.3f} med {statistics.median(w):7.3f} s | cpu min {min(c):7.3f} "
          f"med {statistics.median(c):7.3f} s", flush=True)


def trajectories(steps: int, params: int, seed: int = 0) -> tuple[Trajectory, Trajectory, Trajectory]:
    rng = np.random.default_rng(seed)
    nm = names(params)
    truth = (rng.random(params) + 0.5)[None, :] * (1 + 0.3 * np.sin(np.arange(steps) / 500.0))[:, None]
    st = np.arange(1, steps + 1, dtype=np.int64)

    def run(noise: float) -> Trajectory:
        return Trajectory(st, nm, (truth * (1 + noise * rng.standard_normal(truth.shape))).astype(np.float32))

    b, c, r = run(1e-3), run(1e-3), run(1e-3)
    c.values[steps // 2:, 7] *= 1.02            # one parameter drifts from the middle on
    return b, c, r


def write_store(root: Path, steps: int, params: int) -> Path:
    nm = np.array(names(params), dtype=object)
    rng = np.random.default_rng(1)
    with RunWriter(root, rank=0, meta={"framework": "megatron-core"}) as w:
        for s in range(1, steps + 1):
            w.put_table(s, "local_norm", {"name": nm, "norm": rng.random(params), "numel": np.full(params, 64),
                                          "tp_partition_dim": np.full(params, -1),
                                          "tp_rank": np.zeros(params, dtype=np.int64),
                                          "tp_size": np.ones(params, dtype=np.int64)})
            w.log_scalars(s, {"loss": 1.0})
            w.finish_step()
    return root


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--params", type=int, default=291)
    ap.add_argument("--store-steps", type=int, default=6000)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    out: dict[str, object] = {"steps": a.steps, "params": a.params}
    b, c, r = trajectories(a.steps, a.params)
    m = load_mapping(PRESET)
    opt = TrajectoryOptions()
    holder: dict[str, object] = {}

    def compare() -> None:
        paired = pair_trajectories(b, c, m)
        from comparators.trajectories import repeat_values
        holder["res"] = judge(paired, [repeat_values(paired, r)], opt)

    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    res = timed(compare, a.repeats)
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"  peak RSS {rss0:.0f} MB with the three inputs, {rss1:.0f} MB after comparing", flush=True)
    line(f"compare {a.steps} steps x {a.params} parameters (1 repeat)", res)
    got = holder["res"]
    first = got.details["first_departure"]
    print(f"  verdict {got.verdict}; first departure: {first and first['name']} at step "
          f"{first and first['departure_step']}", flush=True)
    out["compare"] = res
    with tempfile.TemporaryDirectory() as tmp:
        fig = timed(lambda: norm_trajectories(got.curves, "gradient norm", got.verdict, Path(tmp) / "f.png"),
                    a.repeats)
        line(f"figure: {len(got.curves)} parameters x {a.steps} steps", fig)
        out["figure"] = fig
        t = time.perf_counter()
        store = write_store(Path(tmp) / "store", a.store_steps, a.params)
        print(f"  (wrote {a.store_steps} step files in {time.perf_counter() - t:.1f} s)", flush=True)
        run = open_store(store)
        for jobs in sorted({1, a.jobs}):
            rd = timed(lambda jobs=jobs: read_trajectory(run, jobs=jobs), a.repeats)
            line(f"read {a.store_steps} step files x {a.params} rows, jobs={jobs}", rd)
            per_w, per_c = min(rd["wall_s"]) / a.store_steps, min(rd["cpu_s"]) / a.store_steps
            print(f"  per step file: {1e3 * per_w:.3f} ms wall, {1e3 * per_c:.3f} ms cpu (this process); "
                  f"{a.steps} steps: ~{per_w * a.steps:.1f} s wall per run", flush=True)
            out[f"read_jobs{jobs}"] = {**rd, "files": a.store_steps}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS {rss:.0f} MB", flush=True)
    out["peak_rss_mb"] = rss
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
