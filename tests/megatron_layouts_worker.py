"""Megatron-core layouts users train with, on CPU (gloo): the dumper's view of each, written as run stores.

Why one script with several layouts: every torchrun launch costs ~10 s of imports on a 2-core machine, so a
launch runs its layouts one after the other, re-initialising Megatron's parallel state in between
(``set_parallel``). Every layout trains the same model (weights drawn by global name) on the same global
batch (micro-batches ``synthetic_batch(step, dp_rank=d)`` for d = 0, 1), so the stores must agree:

one process (``--scenarios ref,ref_fault,fp16,bf16,ref4,ref_moe,lm_loop,lm_loop_moe,lm_loop_raise,ckpt_ref``)
  ref       fp32, DP=1, both micro-batches through Megatron's schedule, Megatron DDP + FP32 optimizer.
            ref, ref_moe, distopt, pp2, ep2, sp and cp2 write the optimizer evidence of step 1
            (dumpers.optimizer_evidence); ref, ref_fault, tp2, sp, pp2 (and cp2 forward only) the layer
            tensors of step 1 (LAYERS), ref_moe and ep2 the experts' statistics.
  ref_fault ref with one weight of layer 1 scaled by 1.05 (FAULT): the layer-tensor test's planted fault.
  fp16      the same in fp16 (Float16Module, fp16 main_grad without fp32 accumulation, loss scale 1024).
  bf16      the same in bf16 (fp32 grad accumulation, Megatron's default).
  ref4      like ref with 4 layers (the reference of vpp).
  ref_moe   MoE (4 experts, top-2, allgather dispatcher, shared expert with gate), EP=1.
  lm_loop   the integration (dumpers.megatron_lm.install) on a loop shaped like Megatron-LM's train()
            (tests/megatron_lm_shape.py): 3 iterations, evaluation after iteration 2, megatron-core's
            OptimizerParamScheduler (warmup 1, cosine); the same loop again without the integration.
  lm_loop_moe  that loop on the MoE model with the router's load-balancing and z losses on (2 iterations).
  lm_loop_raise  that loop with forward_step raising at iteration 2: the exception Megatron sees, with and
            without the integration.
  ckpt_ref  the untrained TP=1 model's state_dict (torch.save) and its step-1 loss.
two processes (``--scenarios distopt,pp2,vpp,ep2,sp,cp2,tp2,lm_loop_moe_dp2,ckpt_tp2,ckpt_pp2``)
  tp2       TP=2 without sequence parallelism (the layer-tensor test's TP baseline).
  lm_loop_moe_dp2  lm_loop_moe at DP=2, one micro-batch per rank: the router losses reduced across ranks.
  distopt   DP=2, ``use_distributed_optimizer=True``: each rank one micro-batch, gradients reduce-scattered.
  sp        TP=2 with sequence parallelism (demo.megatron_cpu's norm stand-in: torch's norms refuse SP).
  cp2       CP=2: Megatron's get_batch_on_this_cp_rank splits each micro-batch (2 x CP zig-zag chunks);
            demo.megatron_cpu's all-gather attention (the local attention refuses CP); per-token loss.
  pp2       PP=2 with Megatron's 1F1B schedule, both micro-batches.
  vpp       4 layers at PP=2 with 2 virtual stages (Megatron's interleaved schedule).
  ep2       the MoE model at EP=2 (DP=2 for dense parameters), a ChainedOptimizer (dense + expert).
  ckpt_tp2  the untrained model at TP=2 saved by megatron-core's dist_checkpointing (torch_dist) and in the
            legacy layout (mp_rank_0T/model_optim_rng.pt with a pickled argparse Namespace), + step-1 loss.
  ckpt_pp2  the same at PP=2, legacy layout (mp_rank_00_00P).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from demo import megatron_cpu as mc  # noqa: E402
from dumpers.megatron import MegatronDumper  # noqa: E402
from dumpers.optimizer_evidence import OptimizerEvidence  # noqa: E402
from dumpers.torch_dumper import DumpConfig  # noqa: E402

STEPS = 2
# every layer's activations (and their gradients) at step 1, full tensors: TP shards, SP / CP sequence parts
# and pipeline stages gather into the one-process rows (sources.layers.gather_layers)
LAYERS = {"tensors": "full", "tensor_steps": [1],
          "modules": ["embedding", "decoder.layers.?", *(f"decoder.layers.*.{m}" for m in (
              "input_layernorm", "self_attention.linear_qkv", "self_attention.k_layernorm",
              "self_attention.core_attention", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")),
                      "output_layer"]}
# CP: forward only (with calculate_per_token_loss the activation gradients are the CP=1 run's x tokens)
LAYERS_FWD = {**LAYERS, "backward": False}
# the planted fault of the layer-tensor test: one weight of layer 1 off by 5% in a TP=1 run
FAULT = ("decoder.layers.1.mlp.linear_fc1.weight", 1.05)
EXPERT_STATS = {"tensors": "stats", "tensor_steps": [1], "modules": ["decoder.layers.*.mlp.experts.*"],
                "backward": False}
MOE = {"num_moe_experts": 4, "moe_router_topk": 2, "moe_token_dispatcher_type": "allgather",
       "moe_aux_loss_coeff": 0.0, "moe_ffn_hidden_size": 64, "moe_shared_expert_intermediate_size": 64,
       "moe_shared_expert_gate": True, "moe_router_load_balancing_type": "none"}


def train_layout(out: Path, cfg: mc.TinyLlamaConfig, *, micro: list[int], distopt: bool = False,
                 loss_scale: float | None = None, grad_fp32: bool = True, dump: bool = True,
                 dump_config: dict | None = None, evidence: bool = False,
                 perturb: tuple[str, float] | None = None) -> dict:
    """Train STEPS steps of the current layout with the dumper (or without: ``dump=False``, for the
    bit-identical check); micro = DP ranks whose batches this rank runs."""
    from megatron.core.distributed import finalize_model_grads

    chunks = mc.build_model_chunks(cfg, seed=1234)
    if perturb is not None:     # a planted fault: one parameter scaled
        with torch.no_grad():
            dict(chunks[0].named_parameters())[perturb[0]].mul_(perturb[1])
    # small buckets under the distributed optimizer: each bucket is split across DP ranks, so parameters
    # straddle the shard boundary (one bucket happens to split between two whole parameters here)
    ddp = [mc.wrap_ddp(c, use_distributed_optimizer=distopt, grad_reduce_in_fp32=grad_fp32,
                       bucket_size=10000 if distopt else None) for c in chunks]
    opt = mc.make_megatron_optimizer(ddp, lr=1e-3, clip_grad=1.0, use_distributed_optimizer=distopt,
                                     loss_scale=loss_scale)
    config = ddp[0].config
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = opt.scale_loss
    dumper = MegatronDumper(ddp, opt, DumpConfig(out=out, seed_layout=True, **(dump_config or {})),
                            meta={"config": {"kind": "megatron_args", "values": cfg.as_dict()}}) if dump else None
    ev = OptimizerEvidence(ddp, out, opt) if evidence else None
    losses, norms = [], []
    for step in range(1, STEPS + 1):
        if dumper is not None:
            dumper.begin_step(step)
        for c in ddp:
            c.zero_grad_buffer()
        opt.zero_grad()
        batches = [mc.synthetic_batch(step, cfg, dp_rank=d) for d in micro]
        if cfg.extra.get("context_parallel_size", 1) > 1:   # Megatron's own zig-zag split (2 x CP chunks)
            from megatron.core.utils import get_batch_on_this_cp_rank

            batches = [get_batch_on_this_cp_rank(b) for b in batches]
        reduced = mc.pipeline_forward_backward(ddp, batches, cfg,
                                               on_batch=dumper.record_batch if dumper is not None else None)
        if step == 1 and ev is not None:
            ev.before_step()
        ok, gnorm, _ = opt.step()
        if step == 1 and ev is not None:
            ev.after_step()
        loss = mc.reduce_lm_loss(reduced)
        losses.append(loss)
        norms.append(gnorm)
        if dumper is not None:
            dumper.end_step(loss=loss)
    out_ = {"losses": losses, "grad_norms": norms, "digest": _digest(ddp),
            "optimizer": type(opt.inner).__name__, "errors": 0, "error_log": []}
    if dumper is not None:
        dumper.close()
        out_.update(errors=dumper.errors, error_log=dumper.error_log)
    if ev is not None and ev.error:
        out_.update(errors=out_["errors"] + 1, error_log=[*out_["error_log"], f"evidence: {ev.error}"])
    return out_


def lm_loop(out: Path | None, cfg: mc.TinyLlamaConfig, *, iters: int = 3, raise_at: int | None = None,
            dp_ranks: tuple[int, ...] = (0, 1)) -> dict:
    """The documented integration: install() first, then Megatron-LM's train() runs untouched (``out=None``:
    the same loop without the integration, for the bit-identical check)."""
    from types import SimpleNamespace

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import megatron_lm_shape as shape

    from dumpers.megatron_lm import install

    integration = install(out=out, seed_layout=True, module=shape) if out is not None else None
    shape.ARGS.train_iters, shape.ARGS.raise_at = iters, raise_at
    shape.ARGS.data_parallel_size = mc.parallel_info().dp
    shape.initialize()
    chunks = mc.build_model_chunks(cfg, seed=1234)
    ddp = [mc.wrap_ddp(c) for c in chunks]
    opt = mc.make_megatron_optimizer(ddp, lr=1e-3, clip_grad=1.0)
    config = ddp[0].config
    config.grad_scale_func = opt.scale_loss   # as Megatron-LM's setup does (the MoE aux-loss scale reads it)
    train_batches = [mc.synthetic_batch(s, cfg, dp_rank=d) for s in range(1, iters + 1) for d in dp_ranks]
    valid_batches = [mc.synthetic_batch(100 + s, cfg) for s in range(4)]
    res: dict = {"errors": 0, "error_log": []}
    try:
        res["log"] = shape.train(shape.forward_step, ddp, opt, shape.scheduler(opt), iter(train_batches),
                                 iter(valid_batches), SimpleNamespace(seq_len=cfg.seq_length, mbs=cfg.micro_batch_size))
    except Exception as exc:  # noqa: BLE001 - what Megatron-LM would see
        res["raised"] = [type(exc).__name__, str(exc)]
    finally:
        if integration is not None:
            integration.uninstall()
            integration.close()
    if integration is not None:
        res.update(errors=integration.dumper.errors, error_log=integration.dumper.error_log)
    res.update(train_tokens=[b["tokens"].tolist() for b in train_batches],
               valid_tokens=[b["tokens"].tolist() for b in valid_batches],
               digest=_digest(ddp))
    return res


def _digest(chunks: list) -> str:
    digest = hashlib.sha256()
    for c in chunks:
        for _, prm in c.named_parameters():
            digest.update(prm.detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()


def save_legacy(root: Path, model: torch.nn.Module, info: mc.ParallelInfo, pp: int) -> None:
    """Megatron-LM's legacy ``torch`` format: the model state_dict next to a pickled argparse Namespace."""
    import argparse

    name = f"mp_rank_{info.tp_rank:02d}" + (f"_{info.pp_rank:03d}" if pp > 1 else "")
    (root / name).mkdir(parents=True, exist_ok=True)
    args = argparse.Namespace(swiglu=True, tensor_model_parallel_size=info.tp, pipeline_model_parallel_size=pp,
                              num_layers=2, params_dtype=torch.float32)
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 0, "model": model.state_dict()},
               root / name / "model_optim_rng.pt")


def checkpoint(out: Path, cfg: mc.TinyLlamaConfig, info: mc.ParallelInfo, *, dist: bool) -> dict:
    from megatron.core import dist_checkpointing

    model = mc.build_model_chunks(cfg, seed=1234)[0]
    res: dict = {}
    if info.pp == 1:
        with torch.no_grad():
            res["loss"] = float(mc.forward_loss(model, mc.synthetic_batch(1, cfg)))
    if dist:
        (out / "torch_dist").mkdir(parents=True, exist_ok=True)
        with mc.cpu_device_redirect():
            dist_checkpointing.save(model.sharded_state_dict(), str(out / "torch_dist"))
    save_legacy(out / "legacy", model, info, info.pp)
    torch.distributed.barrier()
    return {**res, "errors": 0, "error_log": []}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--scenarios", required=True)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    info = mc.init_megatron_cpu(tp=1, seed=1234)
    out = Path(args.out)
    dense = mc.TinyLlamaConfig(micro_batch_size=2)
    moe = mc.TinyLlamaConfig(micro_batch_size=2, extra=dict(MOE))
    moe_aux = mc.TinyLlamaConfig(micro_batch_size=2, extra={**MOE, "moe_router_load_balancing_type": "aux_loss",
                                                            "moe_aux_loss_coeff": 1e-2, "moe_z_loss_coeff": 1e-3})
    deep = mc.TinyLlamaConfig(micro_batch_size=2, num_layers=4)
    result: dict = {"rank": info.rank}
    for scenario in args.scenarios.split(","):
        if scenario == "ref":
            result[scenario] = train_layout(out / scenario, dense, micro=[0, 1], evidence=True, dump_config=LAYERS)
        elif scenario == "ref_fault":
            result[scenario] = train_layout(out / scenario, dense, micro=[0, 1], dump_config=LAYERS, perturb=FAULT)
        elif scenario == "tp2":
            info = mc.set_parallel(tp=2)
            result[scenario] = train_layout(out / scenario, dense, micro=[0, 1], dump_config=LAYERS)
        elif scenario == "fp16":
            cfg16 = mc.TinyLlamaConfig(micro_batch_size=2, params_dtype="float16")
            result[scenario] = train_layout(out / scenario, cfg16, micro=[0, 1], loss_scale=1024.0,
                                            grad_fp32=False)
            result[scenario]["undumped"] = train_layout(out / "none", cfg16, micro=[0, 1], loss_scale=1024.0,
                                                        grad_fp32=False, dump=False)
        elif scenario == "lm_loop":
            result[scenario] = lm_loop(out / scenario, dense)
            result[scenario]["undumped"] = lm_loop(None, dense)
        elif scenario == "lm_loop_moe":
            result[scenario] = lm_loop(out / scenario, moe_aux, iters=2)
        elif scenario == "lm_loop_raise":
            result[scenario] = lm_loop(out / scenario, dense, raise_at=2)
            result[scenario]["undumped"] = lm_loop(None, dense, raise_at=2)
        elif scenario == "ckpt_ref":
            model = mc.build_model_chunks(dense, seed=1234)[0]
            (out / scenario).mkdir(parents=True, exist_ok=True)
            torch.save(model.state_dict(), out / scenario / "megatron.pt")
            with torch.no_grad():
                loss = float(mc.forward_loss(model, mc.synthetic_batch(1, dense)))
            result[scenario] = {"loss": loss, "errors": 0, "error_log": []}
        elif scenario == "ckpt_tp2":
            info = mc.set_parallel(tp=2)
            result[scenario] = checkpoint(out / scenario, dense, info, dist=True)
        elif scenario == "ckpt_pp2":
            info = mc.set_parallel(pp=2)
            result[scenario] = checkpoint(out / scenario, dense, info, dist=False)
        elif scenario == "ref_moe":
            result[scenario] = train_layout(out / scenario, moe, micro=[0, 1], evidence=True,
                                            dump_config=EXPERT_STATS)
        elif scenario == "lm_loop_moe_dp2":
            info = mc.set_parallel()
            result[scenario] = lm_loop(out / scenario, moe_aux, iters=2, dp_ranks=(info.dp_rank,))
        elif scenario == "distopt":
            info = mc.set_parallel()
            result[scenario] = train_layout(out / scenario, dense, micro=[info.dp_rank], distopt=True,
                                            evidence=True)
            result[scenario]["undumped"] = train_layout(out / "none", dense, micro=[info.dp_rank], distopt=True,
                                                        dump=False)
        elif scenario == "ref4":
            result[scenario] = train_layout(out / scenario, deep, micro=[0, 1])
        elif scenario == "bf16":
            cfgb = mc.TinyLlamaConfig(micro_batch_size=2, params_dtype="bfloat16")
            result[scenario] = train_layout(out / scenario, cfgb, micro=[0, 1])
        elif scenario == "vpp":
            info = mc.set_parallel(pp=2, vpp=2)
            result[scenario] = train_layout(out / scenario, deep, micro=[0, 1])
        elif scenario == "pp2":
            info = mc.set_parallel(pp=2)
            result[scenario] = train_layout(out / scenario, dense, micro=[0, 1], evidence=True, dump_config=LAYERS)
        elif scenario == "sp":
            info = mc.set_parallel(tp=2)
            cfg_sp = mc.TinyLlamaConfig(micro_batch_size=2, extra={"sequence_parallel": True})
            result[scenario] = train_layout(out / scenario, cfg_sp, micro=[0, 1], evidence=True, dump_config=LAYERS)
        elif scenario == "cp2":
            info = mc.set_parallel(cp=2)
            cfg_cp = mc.TinyLlamaConfig(micro_batch_size=2, extra={"context_parallel_size": 2,
                                                                   "calculate_per_token_loss": True})
            result[scenario] = train_layout(out / scenario, cfg_cp, micro=[0, 1], evidence=True,
                                            dump_config=LAYERS_FWD)
        elif scenario == "ep2":
            info = mc.set_parallel(ep=2)
            result[scenario] = train_layout(out / scenario, moe, micro=[info.dp_rank], evidence=True,
                                            dump_config=EXPERT_STATS)
            result[scenario]["undumped"] = train_layout(out / "none", moe, micro=[info.dp_rank], dump=False)
        else:
            raise SystemExit(f"unknown scenario {scenario}")
        result[scenario]["info"] = mc.parallel_info().as_dict()
    (out / f"result_{args.scenarios.replace(',', '_')}_rank{info.rank}.json").write_text(json.dumps(result))
    mc.destroy_megatron_cpu()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
