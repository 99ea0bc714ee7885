"""Scale benchmark (issue 28): a synthetic run-store pair shaped like a 64-rank, 48-layer MoE model, compared
on a Dask LocalCluster with 1 and 2 workers.

Why: a 1024-NPU run cannot be dumped here; its cost is the per-row and per-GB cost of the compare times the
rows and bytes such a run writes. This measures those costs on a store with the real shape (every rank, every
layer, every module's statistics; full tensors on a sample of ranks) but small tensors, and docs/scale.md
turns them into the cost of a 64- and a 1024-NPU run.

The store (baseline and candidate; the candidate's statistics carry float32-sized noise, one layer on one
rank is perturbed by 1e-3): ``--ranks`` ranks (64) in ``--pp`` pipeline stages (4), so each rank holds
``--layers`` / ``--pp`` decoder layers (12 of 48) of a Megatron-core MoE layer: input_layernorm,
self_attention.{linear_qkv, core_attention, linear_proj}, self_attention, pre_mlp_layernorm, mlp.router,
``--local-experts`` (4) local experts' linear_fc1 / linear_fc2, mlp.shared_experts.{linear_fc1, linear_fc2},
mlp and the layer itself. Step 1 (a statistics dump): forward output and backward grad_output statistics of
each module on every rank (38 rows a layer, 456 a rank, 29,184 row pairs). Step 2 (a full-tensor dump of the
layers): the layer outputs and their gradients in full (24 a rank) on ``--full-ranks`` (4: one rank of each
pipeline stage), each ``--tokens`` x ``--hidden`` float32 (1024 x 1024 = 4 MiB; DeepSeek-V3's is 4096 x 7168
bf16 = 56 MiB: scaled down, 0.8 GB in all, written in ~10 s; the compare streams each tensor in 1 MiB chunks, so
its cost per GB carries over and docs/scale.md scales it back up by bytes).

Measured, for each cluster size (a fresh LocalCluster of 1, then 2 worker processes, 1 thread each; the
cluster's start-up not timed): the full-tensor compare (step 2) and the statistics compare (step 1), each one
``compare_layer_tensors_all(..., scheduler=client)`` call: wall seconds, throughput per worker (GB of full
tensors read, both sides, per second per worker; statistics row pairs per second per worker) and each worker's
peak RSS (ru_maxrss, read on the worker after the compares; also its RSS before them). The same compares in this
process with no Dask (jobs=1) are the reference; the Dask results are checked equal to them.

    .venv/bin/python benchmarks/bench_scale.py [--ranks 64] [--layers 48] [--full-ranks 4] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from comparators.layer_tensors import compare_layer_tensors_all  # noqa: E402
from runstore import RunWriter  # noqa: E402
from sources.layers import layer_source  # noqa: E402

ATTN = ("input_layernorm", "self_attention.linear_qkv", "self_attention.core_attention",
        "self_attention.linear_proj", "self_attention", "pre_mlp_layernorm", "mlp.router")
SHARED = ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2", "mlp")
PERTURB_LAYER = 13      # the candidate's perturbed layer (on a full-tensor rank that holds it)


def layer_modules(layer: int, local_experts: int) -> list[str]:
    """The modules of one MoE decoder layer, in forward order."""
    p = f"decoder.layers.{layer}"
    experts = [f"mlp.experts.local_experts.{e}.{fc}" for e in range(local_experts) for fc in ("linear_fc1",
                                                                                             "linear_fc2")]
    return [f"{p}.{m}" for m in (*ATTN, *experts, *SHARED)] + [p]


def rank_layers(rank: int, ranks: int, layers: int, pp: int) -> range:
    per = layers // pp
    stage = rank * pp // ranks
    return range(stage * per, (stage + 1) * per)


def _stats(arr: np.ndarray) -> tuple[float, float, float, float]:
    return float(np.linalg.norm(arr.ravel())), float(arr.max()), float(arr.min()), float(arr.mean())


def _table(w: RunWriter, step: int, rows: list[tuple[str, str]], st: np.ndarray, shape: tuple[int, ...]) -> None:
    n = len(rows)
    w.put_table(step, "tensor_stats", {
        "order": np.arange(n), "module": [m for m, _ in rows], "kind": [k for _, k in rows],
        "dtype": ["float32"] * n, "shape": ["x".join(map(str, shape))] * n, "numel": np.full(n, int(np.prod(shape))),
        "norm": st[:, 0], "max": st[:, 1], "min": st[:, 2], "mean": st[:, 3], "nan": np.zeros(n, int),
        "inf": np.zeros(n, int)})
    w.finish_step()


def generate(root: Path, a: argparse.Namespace) -> dict[str, Any]:
    """Write the baseline and candidate stores; returns what was written (rows, bytes, ranks with tensors).

    Step 1: statistics of every module on every rank (a ``tensors="stats"`` dump). Step 2: the layer outputs
    and their gradients in full on the sampled ranks (``tensors="full"`` with ``modules`` the layers)."""
    full_ranks = sorted({s * a.ranks // a.pp for s in range(a.pp)} if a.full_ranks == a.pp
                        else set(range(min(a.full_ranks, a.ranks))))
    bad_layer = min(PERTURB_LAYER, a.layers - 1)
    holders = [r for r in range(a.ranks) if bad_layer in rank_layers(r, a.ranks, a.layers, a.pp)]
    perturb_rank = next((r for r in holders if r in full_ranks), holders[0])   # a full-tensor rank if one holds it
    rng = np.random.default_rng(0)
    shape = (a.tokens, 1, a.hidden)
    base_tensor = rng.standard_normal(a.tokens * a.hidden, dtype=np.float32).reshape(shape)
    noise = np.float32(1) + rng.standard_normal(a.tokens * a.hidden, dtype=np.float32).reshape(shape) * np.float32(1e-7)
    rows_per_rank = full_per_rank = tensor_bytes = 0
    for side in ("base", "cand"):
        for rank in range(a.ranks):
            srng = np.random.default_rng([rank, 7])
            layers = rank_layers(rank, a.ranks, a.layers, a.pp)
            with RunWriter(root / side, rank=rank, meta={"framework": "bench_scale"}) as w:
                fwd = [m for layer in layers for m in layer_modules(layer, a.local_experts)]
                rows = [(m, "forward.output.0") for m in fwd] + [(m, "backward.grad_output.0") for m in fwd[::-1]]
                rows_per_rank = len(rows)
                st = np.column_stack([srng.uniform(1, 100, len(rows)), srng.uniform(1, 10, len(rows)),
                                      -srng.uniform(1, 10, len(rows)), srng.normal(0, 0.01, len(rows))])
                if side == "cand":
                    st *= 1 + srng.normal(0, 1e-8, st.shape)
                    if rank == perturb_rank:
                        hit = [i for i, (m, k) in enumerate(rows) if k[0] == "f" and m.split(".")[2] == str(bad_layer)]
                        st[hit, 0] *= 1 + 1e-3
                _table(w, 1, rows, st, shape)
                if rank not in full_ranks:
                    continue
                rows = [(f"decoder.layers.{x}", "forward.output.0") for x in layers] + [
                    (f"decoder.layers.{x}", "backward.grad_output.0") for x in layers[::-1]]
                full_per_rank = len(rows)
                st = np.zeros((len(rows), 4))
                for i, (m, kind) in enumerate(rows):
                    layer = int(m.split(".")[2])
                    arr = base_tensor * np.float32(1 + 0.01 * layer + (0.5 if kind[0] == "b" else 0))
                    if side == "cand":
                        hit = rank == perturb_rank and layer == bad_layer and kind[0] == "f"
                        arr = arr * (np.float32(1 + 1e-3) * noise if hit else noise)
                    w.put_array(2, f"tensors/{i:06d}", arr)
                    tensor_bytes += arr.nbytes
                    st[i] = _stats(arr)
                _table(w, 2, rows, st, shape)
    disk = sum(f.stat().st_size for s in ("base", "cand") for f in (root / s).rglob("*.h5"))
    return {"ranks": a.ranks, "layers": a.layers, "pp": a.pp, "local_experts": a.local_experts,
            "rows_per_rank": rows_per_rank, "row_pairs": rows_per_rank * a.ranks,
            "full_rows_per_rank": full_per_rank, "full_ranks": full_ranks,
            "tensor_bytes_both_sides": tensor_bytes, "disk_bytes_both_sides": disk,
            "tensor_shape": list(shape), "perturbed": {"rank": perturb_rank, "layer": bad_layer}}


def _maxrss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _current_rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _warm() -> str:
    import comparators.tensor_pair  # noqa: F401  (imports before timing, as a long-lived cluster has them)

    return "ok"


def _key(res: dict) -> dict:
    """What must not depend on where the compare ran: verdict, rows and first departure of each (step, rank)."""
    return {f"{k[0]}/{k[1]}": (r.verdict, r.details.get("compared"), str(r.details.get("first_departing_forward")))
            for k, r in res.items()}


def on_cluster(workers: int, base: Any, cand: Any, groups: dict[str, tuple[int, list[int]]], ref: dict[str, dict]
               ) -> dict[str, Any]:
    from distributed import Client, LocalCluster

    t0 = time.perf_counter()
    with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None,
                      memory_limit=0) as cluster, Client(cluster) as client:
        client.run(_warm)
        start_s = time.perf_counter() - t0
        before = client.run(_current_rss_mb)
        out: dict[str, Any] = {"workers": workers, "cluster_start_s": start_s,
                               "rss_before_mb": sorted(before.values())}
        for name, (step, ranks) in groups.items():
            t = time.perf_counter()
            res = compare_layer_tensors_all(base, cand, ranks=ranks, steps=[step], scheduler=client)
            out[f"{name}_s"] = time.perf_counter() - t
            out[f"{name}_same_as_local"] = _key(res) == ref[name]
        out["peak_rss_mb"] = sorted(client.run(_maxrss_mb).values())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--pp", type=int, default=4, help="pipeline stages (each rank holds layers / pp layers)")
    ap.add_argument("--local-experts", type=int, default=4, help="routed experts per rank (EP shards)")
    ap.add_argument("--full-ranks", type=int, default=4, help="ranks with full tensors (= pp: one per stage)")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per micro-batch of a full tensor")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--workers", default="1,2", help="cluster sizes, comma-separated")
    ap.add_argument("--keep", help="generate into this directory and keep it")
    ap.add_argument("--json", help="also write the numbers to this JSON file")
    a = ap.parse_args()
    root = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="bench_scale_"))
    try:
        t0 = time.perf_counter()
        info = generate(root, a)
        info["generate_s"] = time.perf_counter() - t0
        print(f"store pair: {a.ranks} ranks x {a.layers} layers (pp {a.pp}, {a.local_experts} local experts), "
              f"{info['rows_per_rank']} statistics rows a rank ({info['row_pairs']:,} row pairs, step 1); full "
              f"tensors on ranks {info['full_ranks']}: {info['tensor_bytes_both_sides'] / 1e9:.2f} GB both sides; "
              f"{info['disk_bytes_both_sides'] / 1e9:.2f} GB on disk; written in {info['generate_s']:.0f} s",
              flush=True)
        base, cand = layer_source(root / "base"), layer_source(root / "cand")
        groups = {"full": (2, info["full_ranks"]), "stats": (1, list(range(a.ranks)))}
        stats_rows = info["row_pairs"]                                     # row pairs compared, step 1
        full_rows = info["full_rows_per_rank"] * len(info["full_ranks"])   # tensor pairs, step 2
        gb = info["tensor_bytes_both_sides"] / 1e9
        ref: dict[str, dict] = {}
        local: dict[str, float] = {}
        for name, (step, ranks) in groups.items():
            t = time.perf_counter()
            res = compare_layer_tensors_all(base, cand, ranks=ranks, steps=[step], jobs=1)
            local[f"{name}_s"] = time.perf_counter() - t
            ref[name] = _key(res)
            hit = res.get((step, info["perturbed"]["rank"]))
            first = (hit.details.get("first_departing_forward") or {}) if hit else {}
            info[f"named_{name}"] = first.get("module")
        print(f"local, no Dask (jobs=1): full tensors {local['full_s']:.2f} s ({gb / local['full_s']:.2f} GB/s), "
              f"statistics {local['stats_s']:.2f} s ({stats_rows / local['stats_s']:,.0f} row pairs/s); first "
              f"departing: {info.get('named_full')} (full), {info.get('named_stats')} (statistics)", flush=True)
        runs = []
        for workers in [int(x) for x in a.workers.split(",")]:
            r = on_cluster(workers, base, cand, groups, ref)
            r["full_gb_per_s_per_worker"] = gb / r["full_s"] / workers
            r["stats_rows_per_s_per_worker"] = stats_rows / r["stats_s"] / workers
            runs.append(r)
            print(f"dask {workers} worker(s): full tensors {r['full_s']:.2f} s -> "
                  f"{r['full_gb_per_s_per_worker']:.2f} GB/s per worker; statistics {r['stats_s']:.2f} s "
                  f"-> {r['stats_rows_per_s_per_worker']:,.0f} row pairs/s per worker; peak RSS per worker "
                  f"{', '.join(f'{x:.0f}' for x in r['peak_rss_mb'])} MB (before the compares "
                  f"{', '.join(f'{x:.0f}' for x in r['rss_before_mb'])} MB); same as local: "
                  f"{r['full_same_as_local'] and r['stats_same_as_local']}; cluster start {r['cluster_start_s']:.1f} s",
                  flush=True)
        scaling = {}
        if len(runs) >= 2:
            one, two = runs[0], runs[-1]
            scaling = {"full": one["full_s"] / two["full_s"], "stats": one["stats_s"] / two["stats_s"],
                       "workers": [one["workers"], two["workers"]]}
            ideal = two["workers"] / one["workers"]
            print(f"scaling {one['workers']} -> {two['workers']} workers (wall time ratio): full tensors "
                  f"{scaling['full']:.2f}x, statistics {scaling['stats']:.2f}x (ideal {ideal:.0f}x; this machine has "
                  f"{os.cpu_count()} cores, shared)", flush=True)
        if a.json:
            Path(a.json).write_text(json.dumps({"store": info, "local": local, "stats_rows": stats_rows,
                                                "full_rows": full_rows, "dask": runs, "scaling": scaling,
                                                "cores": os.cpu_count(), "loadavg": list(os.getloadavg())},
                                               indent=1))
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
