"""Worker (run under torchrun with 2 processes): step-1 forward/backward of the tiny Megatron-core Llama at
TP=2, then at TP=1 (DP=2, so DP replicas are deduplicated), writing each rank's gradient local norms to a
run store in the documented ``local_norm`` format. At TP=1, rank 0 also writes the same gradients under
MindFormers names (fused QKV and fc1 split by the mapping), with one parameter's gradient scaled by 1.01.

Why a separate script: TP > 1 needs one process per rank; the test launches this once with torchrun.
Usage: python -m torch.distributed.run --nproc_per_node=2 tests/helpers/megatron_local_norm_worker.py OUT
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from megatron.core import parallel_state

from demo.megatron_cpu import (
    TinyLlamaConfig,
    build_tiny_llama,
    destroy_megatron_cpu,
    forward_loss,
    init_megatron_cpu,
    synthetic_batch,
)
from mapping import TransformParams
from models import load_mapping
from runstore import RunWriter

SCALED = "model.layers.1.feed_forward.w2.weight"


def _write(out: Path, rank: int, meta: dict, rank_info: dict, names: list[str], norms: list[float],
           numel: list[int], pdim: list[int], tp_rank: int, tp: int, loss: float) -> None:
    with RunWriter(out, rank=rank, meta=meta, rank_info=rank_info) as w:
        w.log_scalars(1, {"loss": loss})
        w.put_table(1, "local_norm", {"name": np.array(names), "norm": np.array(norms),
                                      "numel": np.array(numel), "tp_partition_dim": np.array(pdim),
                                      "tp_rank": np.full(len(names), tp_rank),
                                      "tp_size": np.full(len(names), tp)},
                    attrs={"where": "test worker: param.grad after backward"})


def one_run(out: Path, tp: int) -> None:
    info = init_megatron_cpu(tp=tp)
    cfg = TinyLlamaConfig()
    model = build_tiny_llama(cfg)
    loss = forward_loss(model, synthetic_batch(1, cfg))   # same batch on every DP rank
    loss.backward()
    names, norms, numel, pdim = [], [], [], []
    for name, p in model.named_parameters():
        names.append(name)
        norms.append(float(p.grad.double().norm()))
        numel.append(p.numel())
        pdim.append(int(p.partition_dim) if getattr(p, "tensor_model_parallel", False) else -1)
    meta = {"framework": "megatron-core", "name_scheme": "megatron-core-local", "config": cfg.as_dict(),
            "parallel": {"tp": info.tp, "pp": info.pp, "dp": info.dp, "world_size": info.world_size}}
    _write(out / f"tp{tp}", info.rank, meta, info.as_dict(), names, norms, numel, pdim, info.tp_rank, tp,
           float(loss.detach()))
    if tp == 1 and info.rank == 0:
        grads = {n: p.grad.double().numpy() for n, p in model.named_parameters()}
        conv, res = load_mapping().convert(grads, "candidate", TransformParams(
            num_heads=cfg.num_attention_heads, num_query_groups=cfg.num_query_groups))
        assert res.verdict == "pass", res.findings
        mnames = sorted(conv)
        mnorms = [float(np.linalg.norm(conv[n])) * (1.01 if n == SCALED else 1.0) for n in mnames]
        _write(out / "mf", 0, {"framework": "mindformers", "name_scheme": "mindformers-llama"}, {"rank": 0},
               mnames, mnorms, [conv[n].size for n in mnames], [-1] * len(mnames), 0, 1, float(loss.detach()))
    parallel_state.destroy_model_parallel()   # keep the process group: gloo cannot rendezvous twice


if __name__ == "__main__":
    root = Path(sys.argv[1])
    one_run(root, 2)
    one_run(root, 1)
    destroy_megatron_cpu()
