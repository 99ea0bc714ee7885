"""Per-rank MindFormers evidence of a DP / TP / PP run, made from a real single-process MindFormers run.

Why: MindSpore's semi-auto parallel needs a device backend (``parallel_mode: 1`` on CPU: ``Invalid backend:
CPU``), so a MindFormers DP x TP x PP run cannot be made here. These helpers write what each rank of one would
hold, in the exact layout MindFormers writes: per-rank run stores through the real dumper code
(``MindSporeDumper`` + ``record_mindformers_norms``, the callback's own path) and msrun ``worker_N.log`` files
with MindFormers' MFLossMonitor and TrainingStateMonitor lines. The numbers come from the demo's clean pair:
the MindFormers store's step-1 named norms, split the way MindFormers' strategy splits each parameter
(``models.mindformers_parallel.rank_part``). A slice's share of a norm is taken from the same step's
gradient tensor of the pair's Megatron baseline (the same gradient to ~1e-6: the pair's local-norm stage
passes), so the slices of a parameter add up to exactly the MindFormers norm. Stand-ins, said where used:
pre-all-reduce DP ranks are given equal halves of the gradient (g_r = g / DP), and a pipeline rank writes a
zero row for each parameter of another stage (every rank builds the whole model).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from models.mindformers_parallel import ParallelStrategy, layer_stages, param_stage, split_for_rank

PREFIX = "2026-11-24 05:05:19,461 - mindformers/log[mindformers/core/callback/callback.py:{line}] - INFO - "


def single_process(cand: Path) -> tuple[dict[str, float], dict[str, int], float, float]:
    """The single-process MindFormers store's step-1 named norms, element counts, loss and lr."""
    from runstore import RunReader

    r = RunReader(cand)
    t = r.step_arrays(1).table("local_norm")
    norms = dict(zip(t.name.astype(str), t.norm.astype(float), strict=True))
    numel = dict(zip(t.name.astype(str), t.numel.astype(int), strict=True))
    s = r.scalars(0)
    return norms, numel, float(s.loss.iloc[0]), float(s.lr.iloc[0])


def rank_norms(strategy: ParallelStrategy, rank: int, norms: dict[str, float], grads: dict[str, np.ndarray],
               pre_reduce: bool = False) -> tuple[dict[str, float], list[int]]:
    """What ``rank`` reports: each parameter's slice norm (its share of the whole norm from the gradient's
    split), other stages' parameters as 0, and pre-all-reduce DP ranks' g / DP."""
    stages = layer_stages(strategy.num_layers or 0, strategy.pp, strategy.offset)
    mine = strategy.coords(rank)["pp_rank"]
    out, sizes = {}, []
    for name, full_norm in norms.items():
        g = grads[name]
        piece = split_for_rank(name, g, strategy, rank)
        whole = float(np.sum(g.astype(np.float64) ** 2))
        share = float(np.sum(piece.astype(np.float64) ** 2)) / whole if whole else 0.0
        v = full_norm * np.sqrt(share)
        if strategy.pp > 1 and param_stage(name, stages, strategy.pp) != mine:
            v = 0.0
        out[name] = v / strategy.dp if pre_reduce else v
        sizes.append(int(piece.size))
    return out, sizes


def write_rank_stores(root: Path, strategy: ParallelStrategy, norms: dict[str, float],
                      grads: dict[str, np.ndarray], loss: float, *, where: str | None = None) -> Path:
    """One run store written by every rank of ``strategy`` through the real MindFormers dumper path."""
    from dumpers.mindformers import WHERE, record_mindformers_norms
    from dumpers.mindspore_dumper import DumpConfig, MindSporeDumper

    where = where or WHERE
    pre = strategy.parallel_mode in (0, 3)
    for rank in range(strategy.world):
        d = MindSporeDumper(None, root, DumpConfig(steps=[1]), rank=rank, world_size=strategy.world,
                            framework="mindformers", name_scheme="mindformers_mcore")
        named, sizes = rank_norms(strategy, rank, norms, grads, pre_reduce=pre)
        d.begin_step(1)
        record_mindformers_norms(d, named, sizes, strategy=strategy,
                                 shapes={n: g.shape for n, g in grads.items()}, where=where)
        d.end_step(loss=loss)
        d.close()
    return root


def write_worker_logs(folder: Path, strategy: ParallelStrategy, norms: dict[str, float],
                      grads: dict[str, np.ndarray], loss: float, config: dict[str, Any], lr: float = 1e-4) -> Path:
    """msrun's ``worker_N.log`` per rank: the config MindFormers pprints at start, TrainingStateMonitor
    ``local_norm/<name>`` lines (each rank's own slice before the DP all-reduce) and the MFLossMonitor line."""
    folder.mkdir(parents=True, exist_ok=True)
    for rank in range(strategy.world):
        named, _ = rank_norms(strategy, rank, norms, grads, pre_reduce=strategy.dp > 1)
        lines = [repr(config)]
        for name, v in named.items():
            if v:
                lines.append(PREFIX.format(line=1496) + f"Epoch:[  1/  1], step:[    1/    1] local_norm/{name}: "
                             f"{np.float32(v)}")
        lines.append(PREFIX.format(line=747) + f"{{ Epoch:[  1/  1], step:[    1/    1], loss:[{loss:.6f}/"
                     f"{loss:.6f}], per_step_time: 886ms, lr: {lr:g}, overflow cond: False, loss_scale: 1.0, "
                     "global_norm: [0.99459755], train_throughput_per_npu: 2.257T")
        (folder / f"worker_{rank}.log").write_text("\n".join(lines) + "\n")
    return folder


# -- layer tensors -----------------------------------------------------------------------------------------

S, B, H, FFN = 8, 4, 16, 32     # sequence, batch, hidden, fc1 width: every cut of TP / CP <= 4 divides them


def model_rows(seed: int = 0, layers: int = 2, moe: bool = False) -> list[tuple[str, str, np.ndarray]]:
    """A MindFormers mcore model's layer outputs in execution order, as the dumper names them (cell name,
    ``forward.output.0``, [S, B, H] sequence first; the routed experts' output [B, S, H] in token order), then
    their gradients in backward order: random float32 stand-ins of one whole (TP=1) step."""
    rng = np.random.default_rng(seed)

    def t(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    fwd: list[tuple[str, np.ndarray]] = [("embedding", t(S, B, H))]
    for i in range(layers):
        p = f"decoder.layers.{i}"
        fwd += [(f"{p}.input_layernorm", t(S, B, H)), (f"{p}.self_attention.linear_qkv", t(S, B, 3 * H)),
                (f"{p}.self_attention.linear_proj", t(S, B, H)), (f"{p}.pre_mlp_layernorm", t(S, B, H))]
        if moe:
            fwd += [(f"{p}.mlp.experts", t(B, S, H)), (f"{p}.mlp", t(S, B, H))]
        else:
            fwd += [(f"{p}.mlp.linear_fc1", t(S, B, FFN)), (f"{p}.mlp.linear_fc2", t(S, B, H))]
        fwd.append((p, t(S, B, H)))
    fwd += [("decoder.final_layernorm", t(S, B, H)), ("output_layer", t(S, B, 32))]
    rows = [(m, "forward.output.0", x) for m, x in fwd]
    rows += [(m, "backward.grad_output.0", t(*x.shape)) for m, x in reversed(fwd)]
    return rows


def mindspore_part(whole: np.ndarray, module: str, strategy: ParallelStrategy, rank: int) -> np.ndarray:
    """What ``rank`` holds of ``module``'s output ``whole``, cut by MindSpore's own slicing with the layout the
    dumper writes as ``split`` (dumpers/mindformers_layer_split.py): a dim cut by several device axes expanded
    as MindSpore expands it (``mindspore.parallel._tensor._expand_layout``: the first axis outermost), then
    ``_load_tensor`` (``_get_tensor_slice_index`` over the device matrix (dp, cp, tp) of the rank's stage). A
    row whose layout is not known stays whole."""
    from mindspore import Tensor
    from mindspore.parallel._tensor import _expand_layout, _get_tensor_strategy, _load_tensor

    from dumpers.mindformers_layer_split import output_layout, tensor_map

    layout = output_layout(module, whole.ndim, whole.dtype.kind == "f", sp=strategy.use_seq_parallel)
    if layout is None:
        return whole
    dev = [strategy.dp, strategy.cp, strategy.tp]
    tmap = tensor_map(layout)
    _, flat_map, flat_shape = _expand_layout(dev, tmap, list(whole.shape))
    part = _load_tensor(Tensor(whole.reshape(flat_shape)), dev, flat_map,
                        rank_id=strategy.coords(rank)["rank_in_stage"])
    cuts = _get_tensor_strategy(dev, tmap)
    return np.ascontiguousarray(part).reshape([n // c for n, c in zip(whole.shape, cuts, strict=True)])


def write_layer_stores(root: Path, strategy: ParallelStrategy, rows: list[tuple[str, str, np.ndarray]], *,
                       full: bool = True, loss: float = 2.5, part: Any = None) -> Path:
    """One run store written by every rank of ``strategy`` through the MindSpore dumper's own recording path
    (``MindSporeDumper._record_tensor``, what the PYNATIVE hooks call; ``split`` from the dumper's strategy):
    each rank records its MindSpore slice of every row (``part(module, kind, rank, array)`` may replace it: a
    planted fault)."""
    import dataclasses

    from mindspore import Tensor

    from dumpers.mindspore_dumper import DumpConfig, MindSporeDumper

    for rank in range(strategy.world):
        d = MindSporeDumper(None, root, DumpConfig(steps=[1], batch=False), rank=rank, world_size=strategy.world,
                            framework="mindformers", name_scheme="mindformers_mcore", strategy=strategy)
        d.config = dataclasses.replace(d.config, tensors="full" if full else "stats")   # no net to hook here
        d.begin_step(1)
        for module, kind, whole in rows:
            x = mindspore_part(whole, module, strategy, rank)
            if part is not None:
                x = part(module, kind, rank, x)
            d._record_tensor(module, kind, Tensor(x))
        d.end_step(loss=loss)
        d.close()
    return root
