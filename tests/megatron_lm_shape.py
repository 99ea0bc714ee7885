"""A training module shaped like Megatron-LM's ``megatron/training/training.py`` (Megatron-LM itself is not
installable here: megatron-core ships without ``megatron.training``).

What matters for the integration is kept as Megatron-LM has it (main, and core 0.12-0.16 alike):
``train()`` sets ``args.curr_iteration`` and calls the module-global ``train_step(forward_step_func,
data_iterator, model, optimizer, opt_param_scheduler, config, forward_backward_func, iteration=...)``;
``train_step`` zeroes the grad buffers first, runs the forward-backward schedule, ``optimizer.step()``, and
reduces ``lm loss`` as [sum, tokens] over micro-batches and the DP group; every ``eval_interval`` iterations
``evaluate()`` runs the same ``forward_step`` with ``forward_only=True`` on the validation iterator, with
``args.curr_iteration`` unchanged. ``forward_step`` / ``get_batch`` are shaped like pretrain_gpt.py's: the
data iterator yields dict micro-batches; only the first and last stages read it.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from demo import megatron_cpu as mc

ARGS = SimpleNamespace(curr_iteration=0, train_iters=3, eval_interval=2, eval_iters=1, num_microbatches=2)


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
    output = model(tokens, position_ids, attention_mask, labels=labels)
    return output, functools.partial(loss_func, loss_mask)


def train_step(forward_step_func: Any, data_iterator: Any, model: list, optimizer: Any, opt_param_scheduler: Any,
               config: Any, forward_backward_func: Any, iteration: int | None = None) -> tuple:
    from megatron.core import parallel_state as ps

    for model_chunk in model:
        model_chunk.zero_grad_buffer()
    optimizer.zero_grad()
    with mc.cpu_device_redirect():
        losses_reduced = forward_backward_func(
            forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
            num_microbatches=ARGS.num_microbatches, seq_length=config.seq_len,
            micro_batch_size=config.mbs, decoder_seq_length=config.seq_len, forward_only=False)
    update_successful, grad_norm, num_zeros_in_grad = optimizer.step()
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
    for model_chunk in model:
        model_chunk.eval()
    total = torch.zeros(2)
    with torch.no_grad(), mc.cpu_device_redirect():
        for _ in range(ARGS.eval_iters):
            loss_dicts = forward_backward_func(
                forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                num_microbatches=ARGS.num_microbatches, seq_length=config.seq_len,
                micro_batch_size=config.mbs, decoder_seq_length=config.seq_len, forward_only=True)
            for d in loss_dicts:
                total += d["lm loss"].view(-1)
    for model_chunk in model:
        model_chunk.train()
    return {"lm loss": float(total[0] / total[1])}


def train(forward_step_func: Any, model: list, optimizer: Any, opt_param_scheduler: Any,
          train_data_iterator: Any, valid_data_iterator: Any, config: Any) -> list[dict[str, Any]]:
    """Megatron-LM's loop, reduced to what the integration touches; returns what it would log."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    forward_backward_func = get_forward_backward_func()
    log = []
    iteration = 0
    while iteration < ARGS.train_iters:
        ARGS.curr_iteration = iteration
        loss_dict, skipped_iter, _, _, _, grad_norm, _ = train_step(
            forward_step_func, train_data_iterator, model, optimizer, opt_param_scheduler, config,
            forward_backward_func, iteration=iteration)
        iteration += 1
        entry = {"iteration": iteration, "grad_norm": grad_norm,
                 "lm loss": float(loss_dict["lm loss"]) if loss_dict else None}
        if iteration % ARGS.eval_interval == 0:
            entry["val"] = evaluate(forward_step_func, valid_data_iterator, model, config,
                                    forward_backward_func)
        log.append(entry)
    return log
