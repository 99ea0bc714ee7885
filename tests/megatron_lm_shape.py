"""A training module shaped like Megatron-LM's ``megatron/training/training.py`` (Megatron-LM itself is not
installable here: megatron-core ships without ``megatron.training``).

What matters for the integration is kept as Megatron-LM has it (main, and core 0.12-0.16 alike):
``train()`` sets ``args.curr_iteration`` and calls the module-global ``train_step(forward_step_func,
data_iterator, model, optimizer, opt_param_scheduler, config, forward_backward_func, iteration=...)``;
``train_step`` zeroes the grad buffers first, runs the forward-backward schedule, ``optimizer.step()``, and
reduces ``lm loss`` as [sum, tokens] over micro-batches and the DP group; every ``eval_interval`` iterations
``evaluate()`` runs the same ``forward_step`` with ``forward_only=True`` on the validation iterator, with
``args.curr_iteration`` unchanged. ``forward_step`` / ``get_batch`` are shaped like pretrain_gpt.py's: the
data iterator yields dict micro-batches; only the first and last stages read it. After a successful
``optimizer.step()`` ``train_step`` steps the real ``OptimizerParamScheduler`` by the global batch; after
``train_step`` returns, ``train()`` reads what Megatron-LM hands to ``training_log``: the loss scale
(``optimizer.get_loss_scale().item()``), the learning rate (megatron-core's ``get_canonical_lr_for_logging``)
and, for an MoE model, the router losses through megatron-core's own ``track_moe_metrics`` (which reduces
and clears the tracker), as ``training_log`` calls it. ``ARGS.raise_at`` makes ``forward_step`` raise at that
iteration (a failing step, as a CUDA error or a bad batch would).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from demo import megatron_cpu as mc

ARGS = SimpleNamespace(curr_iteration=0, train_iters=3, eval_interval=2, eval_iters=1, micro_batch_size=2,
                       data_parallel_size=1, raise_at=None)


def initialize(global_batch_size: int = 4) -> None:
    """What ``initialize_megatron`` sets up that ``train()`` relies on: the micro-batch calculator."""
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        init_num_microbatches_calculator,
    )

    destroy_num_microbatches_calculator()
    init_num_microbatches_calculator(0, None, global_batch_size, ARGS.micro_batch_size, ARGS.data_parallel_size)


def scheduler(optimizer: Any, lr: float = 1e-3, min_lr: float = 1e-4, global_batch_size: int = 4) -> Any:
    """Megatron-LM's ``get_optimizer_param_scheduler`` for ``--lr-warmup-iters 1 --lr-decay-style cosine``:
    megatron-core's OptimizerParamScheduler counting samples (iterations x global batch)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    for group in optimizer.param_groups:   # Megatron-LM's OptimizerConfig(min_lr=args.min_lr) puts it there
        if group.get("min_lr") is None:
            group["min_lr"] = min_lr
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=lr, min_lr=min_lr, lr_warmup_steps=global_batch_size,
        lr_decay_steps=ARGS.train_iters * global_batch_size, lr_decay_style="cosine", start_wd=0.0, end_wd=0.0,
        wd_incr_steps=ARGS.train_iters * global_batch_size, wd_incr_style="constant")


def get_batch(data_iterator: Any) -> tuple:
    from megatron.core import parallel_state as ps

    if not (ps.is_pipeline_first_stage() or ps.is_pipeline_last_stage()):
        return None, None, None, None, None
    batch = next(data_iterator)
    return (batch["tokens"], batch["labels"], batch["loss_mask"], batch["attention_mask"],
            batch["position_ids"])


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> tuple:
    mask = loss_mask.float().view(-1)
    loss = (output_tensor.float().view(-1) * mask).sum()
    tokens = mask.sum().to(torch.int)
    return loss, tokens, {"lm loss": torch.stack([loss.detach(), mask.sum()])}


def forward_step(data_iterator: Any, model: torch.nn.Module) -> tuple:
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    if ARGS.raise_at == ARGS.curr_iteration + 1:
        raise RuntimeError(f"injected failure in forward_step at iteration {ARGS.raise_at}")
    output = model(tokens, position_ids, attention_mask, labels=labels)
    return output, functools.partial(loss_func, loss_mask)


def train_step(forward_step_func: Any, data_iterator: Any, model: list, optimizer: Any, opt_param_scheduler: Any,
               config: Any, forward_backward_func: Any, iteration: int | None = None) -> tuple:
    from megatron.core import parallel_state as ps
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    for model_chunk in model:
        model_chunk.zero_grad_buffer()
    optimizer.zero_grad()
    with mc.cpu_device_redirect():
        losses_reduced = forward_backward_func(
            forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
            num_microbatches=get_num_microbatches(), seq_length=config.seq_len,
            micro_batch_size=config.mbs, decoder_seq_length=config.seq_len, forward_only=False)
    update_successful, grad_norm, num_zeros_in_grad = optimizer.step()
    if update_successful and opt_param_scheduler is not None:
        opt_param_scheduler.step(increment=get_num_microbatches() * ARGS.micro_batch_size * ARGS.data_parallel_size)
    skipped_iter = 0 if update_successful else 1
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        loss_reduced = {}
        for key in losses_reduced[0].keys():
            val = torch.vstack([x[key].view(-1) for x in losses_reduced]).sum(dim=0)
            dist.all_reduce(val, group=ps.get_data_parallel_group(with_context_parallel=True))
            loss_reduced[key] = val[0] / val[1]
        return loss_reduced, skipped_iter, False, False, 0, grad_norm, num_zeros_in_grad
    return {}, skipped_iter, False, False, 0, grad_norm, num_zeros_in_grad


def evaluate(forward_step_func: Any, data_iterator: Any, model: list, config: Any,
             forward_backward_func: Any) -> dict[str, float]:
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    for model_chunk in model:
        model_chunk.eval()
    total = torch.zeros(2)
    with torch.no_grad(), mc.cpu_device_redirect():
        for _ in range(ARGS.eval_iters):
            loss_dicts = forward_backward_func(
                forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                num_microbatches=get_num_microbatches(), seq_length=config.seq_len,
                micro_batch_size=config.mbs, decoder_seq_length=config.seq_len, forward_only=True)
            for d in loss_dicts:
                total += d["lm loss"].view(-1)
    for model_chunk in model:
        model_chunk.train()
    return {"lm loss": float(total[0] / total[1])}


def moe_losses(model: list, iteration: int) -> dict[str, float]:
    """training_log's MoE part: track names from the settings, megatron-core's ``track_moe_metrics`` (it
    reduces the tracker across ranks, adds layer mean / micro-batches to ``total_loss_dict``, clears it)."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.transformer.moe.moe_utils import track_moe_metrics

    cfg = model[0].config
    if not cfg.num_moe_experts:
        return {}
    names = (["load_balancing_loss"] if "aux_loss" in cfg.moe_router_load_balancing_type else []) + (
        ["z_loss"] if cfg.moe_z_loss_coeff is not None else [])
    total: dict[str, torch.Tensor] = {}
    with mc.cpu_device_redirect():
        track_moe_metrics(loss_scale=1 / get_num_microbatches(), iteration=iteration, writer=None,
                          total_loss_dict=total, force_initialize=True, track_names=names,
                          num_layers=cfg.num_layers, moe_layer_freq=cfg.moe_layer_freq,
                          mtp_num_layers=cfg.mtp_num_layers)
    return {k: float(v) for k, v in total.items()}


def train(forward_step_func: Any, model: list, optimizer: Any, opt_param_scheduler: Any,
          train_data_iterator: Any, valid_data_iterator: Any, config: Any) -> list[dict[str, Any]]:
    """Megatron-LM's loop, reduced to what the integration touches; returns what it would log."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer_param_scheduler import get_canonical_lr_for_logging
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    forward_backward_func = get_forward_backward_func()
    # train()'s setup of the model config, as Megatron-LM has it: without finalize_model_grads the schedule
    # never reduces the gradients over DP (each DP rank would step on its own micro-batches' gradients)
    get_model_config(model[0]).finalize_model_grads_func = finalize_model_grads
    log = []
    iteration = 0
    while iteration < ARGS.train_iters:
        ARGS.curr_iteration = iteration
        loss_dict, skipped_iter, _, _, _, grad_norm, _ = train_step(
            forward_step_func, train_data_iterator, model, optimizer, opt_param_scheduler, config,
            forward_backward_func, iteration=iteration)
        iteration += 1
        entry = {"iteration": iteration, "grad_norm": grad_norm,
                 "lm loss": float(loss_dict["lm loss"]) if loss_dict else None,
                 "loss scale": optimizer.get_loss_scale().item(),
                 "learning rate": get_canonical_lr_for_logging(optimizer.param_groups),
                 "group lrs": [g["lr"] for g in optimizer.param_groups], **moe_losses(model, iteration)}
        if iteration % ARGS.eval_interval == 0:
            entry["val"] = evaluate(forward_step_func, valid_data_iterator, model, config,
                                    forward_backward_func)
        log.append(entry)
    return log
