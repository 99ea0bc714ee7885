"""MindFormers on CPU: a tiny real LlamaForCausalLM, a CPU training cell, the Trainer and a plain loop.

Why this exists: users without an NPU (and this project's tests and demo) need MindFormers' real Llama to
train here. Three things make that work on MindSpore 2.10 / MindFormers 2.1 CPU (see
docs/mindformers-cpu.md):

* ``fused_rms_norm=False`` and ``use_rope_slice=True`` (the fused kernels have no CPU implementation);
* MFTrainOneStepCell's overflow check reads Ascend float-status registers; on CPU it is replaced by
  ``all_finite`` over the gradients (:class:`CPUTrainOneStepCell`);
* ``ms.runtime.launch_blocking()`` in PYNATIVE mode (about 10x faster on a 2-core machine).

Megatron batches are already shifted, so the model is built with ``input_sliced_sig=True``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import mindspore as ms
import numpy as np
from mindformers import LlamaConfig, LlamaForCausalLM
from mindformers.tools.register import MindFormerModuleType, MindFormerRegister
from mindformers.wrapper import MFTrainOneStepCell
from mindspore import Tensor, nn, ops
from mindspore.amp import all_finite

TINY_LLAMA: dict[str, Any] = {
    "batch_size": 2, "seq_length": 16, "hidden_size": 32, "num_layers": 2, "num_heads": 4, "n_kv_heads": 2,
    "intermediate_size": 64, "vocab_size": 64, "rms_norm_eps": 1e-5, "theta": 10000.0,
    # MindFormers hides every key whose token == pad_token_id from attention (its causal mask is built from
    # the tokens when no attention_mask is fed); Megatron never does. -1 never occurs, so the model is the
    # same as Megatron's on any batch. With 0 here a batch containing token 0 moved the loss by 2.3e-4.
    "pad_token_id": -1,
    "compute_dtype": "float32", "param_init_type": "float32", "layernorm_compute_type": "float32",
    "softmax_compute_type": "float32", "rotary_dtype": "float32", "embedding_init_type": "float32",
    # CPU: no fused RMSNorm kernel, rope via slicing; Megatron batches are pre-shifted.
    "fused_rms_norm": False, "use_rope_slice": True, "input_sliced_sig": True,
    "use_flash_attention": False, "use_past": False,
}

# Positions of the keyword arguments of LlamaForCausalLM.construct that a training step feeds.
LLAMA_ARG_ORDER = ("input_ids", "labels", "input_position", "position_ids", "attention_mask", "input_embeds",
                   "init_reset", "batch_valid_length", "batch_index", "zactivate_len", "block_tables",
                   "slot_mapping", "prefix_keys_values", "llm_boost_inputs", "q_seq_lens", "loss_mask")


def set_cpu_context(mode: str = "pynative", *, seed: int | None = None) -> None:
    """Select CPU and the mode; PYNATIVE also gets launch_blocking (synchronous, far faster here)."""
    ms_mode = {"pynative": ms.PYNATIVE_MODE, "graph": ms.GRAPH_MODE}[mode.lower()]
    ms.set_context(mode=ms_mode, device_target="CPU")
    if ms_mode == ms.PYNATIVE_MODE:
        ms.runtime.launch_blocking()
    if seed is not None:
        ms.set_seed(seed)
        np.random.seed(seed)


def tiny_llama_config(**overrides: Any) -> LlamaConfig:
    """A LlamaConfig small enough for CPU tests, with the CPU-safe switches set."""
    values = dict(TINY_LLAMA)
    values.update(overrides)
    return LlamaConfig(**values)


def overrides_like_megatron(cfg: Any) -> dict[str, Any]:
    """LlamaConfig overrides that define the same model as a Megatron ``TinyLlamaConfig`` (duck-typed).

    Why: a paired run needs both sides to be one model; this maps every shape field and the settings whose
    defaults must agree (RMSNorm epsilon, RoPE base) so callers cannot forget one.
    """
    extra = dict(getattr(cfg, "extra", None) or {})
    return {"vocab_size": int(cfg.vocab_size), "hidden_size": int(cfg.hidden_size),
            "num_layers": int(cfg.num_layers), "num_heads": int(cfg.num_attention_heads),
            "n_kv_heads": int(cfg.num_query_groups or cfg.num_attention_heads),
            "intermediate_size": int(cfg.ffn_hidden_size), "seq_length": int(cfg.seq_length),
            "batch_size": int(cfg.micro_batch_size),
            "rms_norm_eps": float(extra.get("layernorm_epsilon", 1e-5)),
            "theta": float(extra.get("rotary_base", 10000.0))}


def build_tiny_llama(seed: int = 0, **overrides: Any) -> LlamaForCausalLM:
    """A real MindFormers LlamaForCausalLM in training mode, initialised from ``seed``."""
    ms.set_seed(seed)
    net = LlamaForCausalLM(tiny_llama_config(**overrides))
    net.set_train(True)
    return net


@MindFormerRegister.register(MindFormerModuleType.WRAPPER)
class CPUTrainOneStepCell(MFTrainOneStepCell):
    """MFTrainOneStepCell whose overflow check works on CPU: overflow = not all_finite(grads).

    Everything else (loss scaling, clipping, local_norm outputs, the optimizer call) is MindFormers' own
    code, so the step computes what the NPU step computes.
    """

    def start_overflow_check(self, pre_cond: Any, compute_input: Any) -> tuple[Any, Any]:
        return Tensor([0] * 8, ms.int32), compute_input

    def get_overflow_status(self, status: Any, compute_output: Any) -> Any:
        return ops.logical_not(all_finite(compute_output))


def build_train_cell(net: nn.Cell, *, learning_rate: float = 1e-3, weight_decay: float = 0.0,
                     local_norm: bool = True, use_clip_grad: bool = True, max_grad_norm: float = 1.0,
                     optimizer: nn.Optimizer | None = None) -> CPUTrainOneStepCell:
    """The MindFormers training step for CPU: AdamWeightDecay (a CPU kernel exists) unless given one."""
    if optimizer is None:
        optimizer = nn.AdamWeightDecay(net.trainable_params(), learning_rate=learning_rate,
                                       weight_decay=weight_decay, beta1=0.9, beta2=0.95, eps=1e-8)
    cell = CPUTrainOneStepCell(net, optimizer, local_norm=local_norm, use_clip_grad=use_clip_grad,
                               max_grad_norm=max_grad_norm)
    cell.set_train(True)
    return cell


def llama_inputs(batch: Mapping[str, np.ndarray]) -> tuple[Any, ...]:
    """Positional arguments of LlamaForCausalLM.construct from MindFormers column names (None elsewhere)."""
    last = max(LLAMA_ARG_ORDER.index(k) for k in batch)
    args: list[Any] = [None] * (last + 1)
    for key, value in batch.items():
        args[LLAMA_ARG_ORDER.index(key)] = Tensor(np.asarray(value))
    return tuple(args)


class LlamaReplayLoss(nn.Cell):
    """LlamaForCausalLM called with (input_ids, labels, loss_mask) only: the replay dataset's columns.

    Why: ``Model.train`` and plain training cells pass dataset columns positionally, while loss_mask is
    LlamaForCausalLM's 16th argument.
    """

    def __init__(self, net: nn.Cell) -> None:
        super().__init__(auto_prefix=False)
        self.net = net

    def construct(self, input_ids: Tensor, labels: Tensor, loss_mask: Tensor) -> Tensor:
        return self.net(input_ids, labels, None, None, None, None, None, None, None, None, None, None,
                        None, None, None, loss_mask)


def train_loop(cell: nn.Cell, batches: Iterable[Mapping[str, np.ndarray]],
               on_step: Any = None) -> list[dict[str, Any]]:
    """Run ``cell`` over ``batches`` (MindFormers column names); returns what each step produced.

    ``on_step(step, outputs)`` is called after each step (steps from 1), e.g. a dumper's hook.
    """
    results = []
    for step, batch in enumerate(batches, 1):
        out = cell(*llama_inputs(batch))
        rec: dict[str, Any] = {"step": step, "loss": float(out[0].asnumpy().reshape(-1)[0]),
                               "overflow": bool(out[1].asnumpy()), "loss_scale": float(out[2].asnumpy())}
        if out[4] is not None:
            rec["global_norm"] = float(out[4].asnumpy().reshape(-1)[0])
        if len(out) == 7:
            rec["local_norm"] = out[5].asnumpy()
            rec["norm_size"] = tuple(int(s) for s in out[6])
        results.append(rec)
        if on_step is not None:
            on_step(step, out)
    return results


def trainer_config(data_dir: str, *, steps: int, output_dir: str, mode: str = "pynative",
                   learning_rate: float = 1e-3, seed: int = 0, local_norm: bool = True,
                   model: Mapping[str, Any] | None = None, warmup_steps: int | None = None,
                   columns: Sequence[str] = ("input_ids", "labels", "loss_mask")) -> dict[str, Any]:
    """A complete MindFormers YAML-equivalent config: tiny Llama, CPU cell, replayed Megatron batches.

    The lr is the ``lr_schedule`` block's: a constant ``learning_rate`` (ConstantWarmUpLR, no warm-up), or
    with ``warmup_steps`` CosineWithWarmUpLR over ``steps``. Without an ``lr_schedule`` block MindFormers
    trains at its default schedule (cosine from 5e-05), whatever ``optimizer.learning_rate`` says.
    ``data_dir`` is a run store or seed-layout folder read by MegatronReplayDataset; one dataset row is
    one step, so the runner's batch_size is 1 and ``sink_mode`` is off.
    """
    extra: dict[str, Any] = {}
    if warmup_steps is not None:
        # A cosine schedule with warm-up, so the logged lr changes each step as in real runs.
        extra["lr_schedule"] = {"type": "CosineWithWarmUpLR", "learning_rate": float(learning_rate),
                                "warmup_steps": int(warmup_steps), "total_steps": int(steps), "lr_end": 0.0}
    else:
        extra["lr_schedule"] = {"type": "ConstantWarmUpLR", "learning_rate": float(learning_rate),
                                "warmup_steps": 0, "total_steps": int(steps)}
    model_cfg = {"type": "LlamaConfig", **TINY_LLAMA, **(model or {})}
    model_cfg["checkpoint_name_or_path"] = ""
    dataset = {"data_dir": str(data_dir), "columns": list(columns), "batch_size": 1,
               "construct_args_key": list(columns), "drop_remainder": False, "repeat": 1,
               "num_parallel_workers": 1, "python_multiprocessing": False, "numa_enable": False,
               "prefetch_size": 1, "input_columns": list(columns)}
    return {
        "seed": seed, "output_dir": str(output_dir), "run_mode": "train", "load_checkpoint": "",
        "auto_trans_ckpt": False, "resume_training": False, "only_save_strategy": False,
        "use_parallel": False, "use_legacy": True,
        "trainer": {"type": "CausalLanguageModelingTrainer", "model_name": "llama_tiny_cpu"},
        "runner_config": {"epochs": 1, "batch_size": 1, "sink_mode": False, "sink_size": 1,
                          "gradient_accumulation_steps": 1, "stop_step": int(steps)},
        "optimizer": {"type": "AdamWeightDecay", "beta1": 0.9, "beta2": 0.95, "eps": 1.0e-8,
                      "weight_decay": 0.0, "learning_rate": float(learning_rate)},
        "train_dataset": dataset,
        "train_dataset_task": {"type": "MegatronReplayDataset", "dataset_config": dataset},
        "do_eval": False,
        "parallel": {"parallel_mode": 0, "gradients_mean": False, "full_batch": False},
        "parallel_config": {"data_parallel": 1, "model_parallel": 1, "pipeline_stage": 1,
                            "micro_batch_num": 1, "vocab_emb_dp": True, "gradient_aggregation_group": 4},
        "micro_batch_interleave_num": 1,
        "recompute_config": {"recompute": False, "select_recompute": False},
        "callbacks": [{"type": "MFLossMonitor"}],
        "context": {"mode": 1 if mode == "pynative" else 0, "device_target": "CPU",
                    "max_call_depth": 10000, "save_graphs": False},
        "model": {"model_config": model_cfg, "arch": {"type": "LlamaForCausalLM"}},
        "runner_wrapper": {"type": "CPUTrainOneStepCell", "scale_sense": 1.0, "use_clip_grad": True,
                           "max_grad_norm": 1.0, "local_norm": bool(local_norm)},
        "monitor_config": {"monitor_on": False, "dump_path": None},
        "profile": False, "layer_scale": False, "auto_tune": False,
        **extra,
    }


def run_trainer(config: Mapping[str, Any], callbacks: Sequence[Any] | None = None,
                model: nn.Cell | None = None) -> Any:
    """Train with MindFormers' own Trainer from a config dict (as a YAML would give).

    ``callbacks`` are added to the YAML's (e.g. a MindFormersDumperCallback); ``model`` replaces the
    YAML's model (so a dumper can hook the very network the Trainer trains).
    """
    from mindformers import MindFormerConfig, Trainer

    import dumpers.mindformers_replay  # noqa: F401  (registers MegatronReplayDataset)

    cfg = MindFormerConfig(**config)
    if cfg.context.mode == 1:
        set_cpu_context("pynative")
    trainer = Trainer(args=cfg, model=model, callbacks=list(callbacks) if callbacks else None)
    trainer.train()
    return trainer


def quiet_mindformers_output(path: str) -> None:
    """Point MindFormers' ./output (logs, checkpoints) elsewhere; call before importing mindformers."""
    os.environ.setdefault("LOCAL_DEFAULT_PATH", path)
