"""Step-time cost of the dumper on a Megatron-core GPTModel (CPU, gloo, Megatron DDP + Megatron optimizer).

Why this shape: the cost that matters is the ratio to an undumped step on the same model, measured side
by side. Modes alternate within each repeat (base, a, b, base, a, b, ...) so drift from other work on the
machine hits all modes alike; each repeat reports a median step time and its ratio to the neighbouring
base run; min and median over repeats are printed.

  (a) named local norms + batch (+ NaN tracing of gradients, which rides on the norms)   goal <= 1.03x
  (b) (a) + statistics of every module's forward inputs/outputs and backward gradients   goal <= 1.5x

Usage: .venv/bin/python benchmarks/bench_torch_dumper.py [--repeats 5] [--steps 6] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _time_calls(dumper: object, spent: list[float]) -> None:
    """Add the wall time of the dumper's per-step entry points to ``spent[0]``."""
    for name in ("begin_step", "record_batch", "record_grads", "end_step"):
        fn = getattr(dumper, name)

        def timed(*a: object, _fn=fn, **k: object) -> object:  # noqa: ANN001
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                spent[0] += time.perf_counter() - t0
        setattr(dumper, name, timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per run (after 1 warm-up step)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    import torch

    from demo import megatron_cpu as mc
    from dumpers.megatron import MegatronDumper
    from dumpers.torch_dumper import DumpConfig

    torch.set_num_threads(args.threads)
    mc.init_megatron_cpu(tp=1, seed=1234)
    cfg = mc.TinyLlamaConfig(vocab_size=8192, hidden_size=args.hidden, num_layers=args.layers,
                             num_attention_heads=8, num_query_groups=4, ffn_hidden_size=args.hidden * 11 // 4,
                             seq_length=args.seq, micro_batch_size=args.batch)
    model = mc.wrap_ddp(mc.build_tiny_llama(cfg))
    opt = mc.make_megatron_optimizer(model, lr=1e-5, clip_grad=1.0)
    nparams = sum(p.numel() for p in model.parameters())
    nmods = sum(1 for _ in model.named_modules())
    tmp = Path(tempfile.mkdtemp(prefix="bench_dumper_"))
    modes = {
        "base": None,
        "a_norms_batch": dict(tensors="off", local_norms=True, batch=True, nan_trace="grads"),
        "b_layer_stats": dict(tensors="stats", modules=("*",), local_norms=True, batch=True, nan_trace="grads"),
    }
    times: dict[str, list[float]] = {m: [] for m in modes}
    own: dict[str, list[float]] = {m: [] for m in modes if m != "base"}
    ratios: dict[str, list[float]] = {m: [] for m in modes if m != "base"}
    step = 0
    for rep in range(args.repeats):
        rep_median = {}
        for mode, kw in modes.items():
            dumper = MegatronDumper(model, opt, DumpConfig(out=tmp / f"{mode}_{rep}", **kw)) if kw else None
            spent = [0.0]
            if dumper is not None:  # time inside the dumper's entry points (not its module hooks)
                _time_calls(dumper, spent)
            per_step = []
            for i in range(args.steps + 1):
                step += 1
                batch = mc.synthetic_batch(step, cfg)
                t0 = time.perf_counter()
                if dumper is not None:
                    dumper.begin_step(step)
                    dumper.record_batch(batch)
                loss, _ = mc.train_step(model, opt, batch)
                if dumper is not None:
                    dumper.end_step(loss=loss)
                if i:  # first step of each run is warm-up
                    per_step.append(time.perf_counter() - t0)
            if dumper is not None:
                dumper.close()
                assert dumper.errors == 0, dumper.error_log
            rep_median[mode] = statistics.median(per_step)
            if dumper is not None:
                own[mode].append(spent[0] / (args.steps + 1))
            times[mode].append(rep_median[mode])
        for mode in ratios:
            ratios[mode].append(rep_median[mode] / rep_median["base"])
        print(f"repeat {rep + 1}: " + ", ".join(f"{m} {t * 1e3:.1f} ms" for m, t in rep_median.items()),
              flush=True)

    print(f"\nmodel: GPTModel {nparams / 1e6:.1f}M params, {nmods} modules, hidden {args.hidden}, "
          f"{args.layers} layers, seq {args.seq}, micro-batch {args.batch}, threads {args.threads}; "
          f"{args.repeats} repeats x {args.steps} steps")
    print(f"{'mode':16s} {'step ms min':>12s} {'step ms med':>12s} {'ratio min':>10s} {'ratio med':>10s}  goal")
    goals = {"a_norms_batch": 1.03, "b_layer_stats": 1.5}
    for mode in modes:
        t = times[mode]
        line = f"{mode:16s} {min(t) * 1e3:12.1f} {statistics.median(t) * 1e3:12.1f}"
        if mode in ratios:
            r = ratios[mode]
            line += f" {min(r):10.3f} {statistics.median(r):10.3f}  <= {goals[mode]}x"
            line += f"   (in begin/record/end calls: {statistics.median(own[mode]) * 1e3:.1f} ms/step)"
        print(line)


if __name__ == "__main__":
    main()
