"""docs/scale.md's table: the measured per-row and per-GB costs (bench_scale.py, bench_vs_msprobe.py JSON)
turned into what a DeepSeek-V3-size run on 64 and on 1024 NPUs costs to dump and to compare.

Why a script: the table is arithmetic on measured numbers and stated assumptions; rerunning it after a new
``make bench`` keeps the document honest. Usage:

    .venv/bin/python benchmarks/scale_costs.py --scale bench_out/scale.json --msprobe bench_out/msprobe.json \
        [--tensors bench_out/tensors.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

#: DeepSeek-V3 (its published config): 61 layers (3 dense, 58 MoE), hidden 7168, MLA (q_lora 1536, kv_lora
#: 512, 128 heads, qk 128+64, v 128), 256 routed experts (top-8, intermediate 2048) + 1 shared, bf16.
LAYERS, HIDDEN, EXPERTS, TOP_K, MOE_FFN = 61, 7168, 256, 8, 2048
TOKENS = 4096                      # one micro-batch: sequence 4096, micro-batch size 1
BYTES = 2                          # bf16
F32 = 4 / BYTES                    # the compare's GB/s is of float32 bytes; a bf16 byte holds twice the elements
#: Forward output width per token of each module of a MoE layer (Megatron-core MLA + MoE, SequentialMLP):
#: norms, q down/up, kv down/up, core attention, out projection, attention block, router, routed experts
#: (top-8 tokens through fc1 (gated, 2 x 2048) and fc2), shared expert fc1/fc2, the MLP block, the layer.
WIDTHS = {"input_layernorm": HIDDEN, "linear_q_down_proj": 1536, "linear_q_up_proj": 128 * 192,
          "linear_kv_down_proj": 512 + 64, "linear_kv_up_proj": 128 * 256, "core_attention": 128 * 128,
          "linear_proj": HIDDEN, "self_attention": HIDDEN, "pre_mlp_layernorm": HIDDEN, "router": EXPERTS,
          "experts.linear_fc1": TOP_K * 2 * MOE_FFN, "experts.linear_fc2": TOP_K * HIDDEN,
          "shared_experts.linear_fc1": 2 * MOE_FFN, "shared_experts.linear_fc2": HIDDEN, "mlp": HIDDEN,
          "layer": HIDDEN}
ROWS_PER_MODULE = 4                # statistics of forward input and output, backward grad_input and grad_output
#: The two runs: (NPUs, pipeline stages, expert-parallel size, data-parallel size), TP 1 as in DeepSeek-V3's own
#: training (PP16 x EP64 on 2048 GPUs). 64 NPUs: the same layer shapes on PP8 x EP8 (the cost of dumping and
#: comparing depends on the shapes, not on whether the optimizer state fits).
RUNS = {64: (8, 8, 8), 1024: (16, 64, 64)}


def per_rank(pp: int, ep: int) -> dict[str, float]:
    """Rows and bytes one rank writes for one micro-batch."""
    layers = math.ceil(LAYERS / pp)
    local = EXPERTS // ep
    modules = 16 + 2 * local                       # the module list above, local experts one by one
    every = 2 * TOKENS * BYTES * sum(WIDTHS.values())   # forward outputs + their gradients, one layer
    return {"layers": layers, "local_experts": local, "rows": layers * modules * ROWS_PER_MODULE,
            "layer_out_bytes": layers * 2 * TOKENS * HIDDEN * BYTES, "every_bytes": layers * every}


def costs(scale: dict, ms: dict, tensors: dict | None = None) -> dict[str, float]:
    """Measured unit costs: compare (one Dask worker; per GB: the 32 MiB tensors of bench_tensor_compare.py read
    by one thread when given, the scale store's 4 MiB ones otherwise) and dump (one rank, CPU)."""
    one = next(r for r in scale["dask"] if r["workers"] == 1)
    gb_s = one["full_gb_per_s_per_worker"]
    if tensors and "jobs1_thread" in tensors.get("variants", {}):
        gb_s = statistics.median(tensors["variants"]["jobs1_thread"]["gb_per_s"])
    ov = ms["overhead"]
    base = ov["median_ms"]["base"] / 1e3
    full_gb = ov["dump_bytes_per_step"]["ours_full"] / 1e9
    stat_rows = ov["stats_rows_per_step"]["ours_stats"]
    return {"compare_gb_s": gb_s, "compare_pairs_s": one["stats_rows_per_s_per_worker"],
            "dump_s_per_gb": (ov["median_ms"]["ours_full"] / 1e3 - base) / full_gb,
            "dump_s_per_row": (ov["median_ms"]["ours_stats"] / 1e3 - base) / stat_rows,
            "row_bytes": ov["dump_bytes_per_step"]["ours_stats"] / stat_rows,
            "local_pairs_s": scale["stats_rows"] / scale["local"]["stats_s"],
            "peak_rss_mb": max(one["peak_rss_mb"])}


def table(c: dict[str, float], workers: int = 64, storage_gb_s: float = 10.0) -> list[str]:
    def t(s: float) -> str:
        return (f"{s * 1e3:.0f} ms" if s < 1 else f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min" if s < 7200
                else f"{s / 3600:.1f} h")

    def b(x: float) -> str:
        return f"{x / 1e6:.0f} MB" if x < 1e9 else f"{x / 1e9:.1f} GB" if x < 1e12 else f"{x / 1e12:.1f} TB"

    out = [f"| NPUs (PP x EP x DP) | what is captured (one step, one micro-batch) | ranks | written | dump, added "
           f"per step | compare (statistics: one process; full: {workers} workers, storage {storage_gb_s:g} GB/s) |",
           "|---|---|---:|---:|---:|---:|"]
    for npus, (pp, ep, dp) in RUNS.items():
        r = per_rank(pp, ep)
        cases = [
            ("statistics, every module", npus, r["rows"] * c["row_bytes"], r["rows"] * c["dump_s_per_row"],
             npus * r["rows"] / c["local_pairs_s"] * workers),     # serial: planning + transport bound
            ("full layer outputs + grads, one rank a stage", pp, r["layer_out_bytes"],
             r["layer_out_bytes"] / 1e9 * c["dump_s_per_gb"],
             2 * pp * r["layer_out_bytes"] * F32 / 1e9 / c["compare_gb_s"]),
            ("full every module, one rank a stage", pp, r["every_bytes"], r["every_bytes"] / 1e9 * c["dump_s_per_gb"],
             2 * pp * r["every_bytes"] * F32 / 1e9 / c["compare_gb_s"]),
            ("full every module, every rank", npus, r["every_bytes"], r["every_bytes"] / 1e9 * c["dump_s_per_gb"],
             2 * npus * r["every_bytes"] * F32 / 1e9 / c["compare_gb_s"]),
        ]
        for what, ranks, per, dump_s, compare_s in cases:
            read = 2 * ranks * per / 1e9 / storage_gb_s       # both sides from shared storage
            out.append(f"| {npus} ({pp} x {ep} x {dp}) | {what} | {ranks} | {b(ranks * per)} | {t(dump_s)} a rank | "
                       f"{t(max(compare_s / workers, read))} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", required=True, help="bench_scale.py --json output")
    ap.add_argument("--msprobe", required=True, help="bench_vs_msprobe.py --json output (its overhead part)")
    ap.add_argument("--tensors", help="bench_tensor_compare.py --json output (the compare's GB/s on large tensors)")
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--storage-gb-s", type=float, default=10.0, help="read bandwidth of the shared storage")
    a = ap.parse_args()
    c = costs(json.loads(Path(a.scale).read_text()), json.loads(Path(a.msprobe).read_text()),
              json.loads(Path(a.tensors).read_text()) if a.tensors else None)
    print("unit costs: " + ", ".join(f"{k} {v:.4g}" for k, v in c.items()))
    for npus, (pp, ep, _) in RUNS.items():
        r = per_rank(pp, ep)
        print(f"{npus} NPUs, one rank, one micro-batch: {r['layers']} layers, {r['local_experts']} local experts, "
              f"{r['rows']} statistics rows, layer outputs + grads {r['layer_out_bytes'] / 1e9:.2f} GB, every module "
              f"{r['every_bytes'] / 1e9:.1f} GB")
    print("\n".join(table(c, a.workers, a.storage_gb_s)))


if __name__ == "__main__":
    main()
