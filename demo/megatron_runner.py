"""Baseline side of the paired demo: a real Megatron-core GPTModel trained on CPU, with the dumper on.

``python -m demo.megatron_runner SPEC.json [SPEC.json ...]`` (see :class:`demo.spec.Spec`). Why a separate process:
torch and MindSpore each bring their own thread pools and allocators; one process per framework keeps the
runs independent and lets the orchestrator stay framework-free. Megatron's own pieces are used where they
decide numerics: GPTModel (local spec), its DDP, ``get_megatron_optimizer`` (Adam, grad clipping, weight
decay groups from ``config_overrides``); the dumper captures local norms inside its grad-norm call.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from demo.megatron_cpu import (
    MegatronOptimizerCPU,
    TinyLlamaConfig,
    build_tiny_llama,
    cpu_device_redirect,
    forward_loss,
    init_megatron_cpu,
    wrap_ddp,
)
from demo.spec import (
    MCORE_LAYER_MODULES,
    MOE_KINDS,
    NAN_PARAM_BASELINE,
    NAN_STEP,
    BatchSource,
    Spec,
    injects,
    megatron_args,
    read_spec,
)
from dumpers.megatron import MegatronDumper, strip_module_prefix
from dumpers.optimizer_evidence import OptimizerEvidence
from dumpers.seed_torch import seed_everything
from dumpers.torch_dumper import DumpConfig

# Layer profile: the modules whose outputs (and output gradients) are summarised at steps 1-2.
LAYER_MODULES = ("embedding", "decoder.layers.*.input_layernorm", "decoder.layers.*.self_attention",
                 "decoder.layers.*.pre_mlp_layernorm", "decoder.layers.*.mlp", "decoder.final_layernorm",
                 "output_layer")


def build_model(spec: Spec) -> torch.nn.Module:
    """Megatron-core GPTModel shaped like Llama (RMSNorm, SwiGLU, RoPE, GQA, untied, no bias).

    ``spec.model_kind == "dense"`` adds q/k layernorm (RMSNorm over each head), the Qwen3 shape of
    MindFormers' mcore candidate; everything else (init order, dropout, TP) is the same model."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    if spec.model_kind in MOE_KINDS:
        return round_attention_fp16(build_moe_model(spec)) if spec.attention_fp16 else build_moe_model(spec)
    m = spec.model
    qk_norm = spec.model_kind == "dense"
    torch.manual_seed(spec.seed)
    tcfg = TransformerConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups, ffn_hidden_size=m.ffn_hidden_size, normalization="RMSNorm",
        layernorm_epsilon=m.rms_norm_eps, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=False, hidden_dropout=m.hidden_dropout, attention_dropout=m.attention_dropout,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        tensor_model_parallel_size=spec.tp, bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        qk_layernorm=qk_norm)
    layer_spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_norm)
    model = GPTModel(config=tcfg, transformer_layer_spec=layer_spec,
                     vocab_size=m.vocab_size, max_sequence_length=m.seq_length,
                     share_embeddings_and_output_weights=False, position_embedding_type="rope",
                     parallel_output=True)
    return round_attention_fp16(model) if spec.attention_fp16 else model


def build_moe_model(spec: Spec) -> torch.nn.Module:
    """The moe / mla baseline: demo.megatron_cpu's GPTModel with the MoE (sequential experts, allgather
    dispatcher) and MLA switches of :func:`demo.model.megatron_extra`, from the same
    :func:`demo.model.for_kind` model the MindFormers side builds."""
    from demo.model import for_kind, megatron_config_kwargs

    kwargs = megatron_config_kwargs(for_kind(spec.model, spec.model_kind))
    if spec.tp > 1:   # megatron-core refuses MoE with TP unless sequence parallelism is on (the TP=2 repeat)
        kwargs["extra"]["sequence_parallel"] = True
    return build_tiny_llama(TinyLlamaConfig(**kwargs), seed=spec.seed)


def round_attention_fp16(model: torch.nn.Module) -> torch.nn.Module:
    """Round every core attention's q, k, v and output through float16 (forward and, by the casts' backward,
    the gradients): what MindFormers' flash-attention path does to a float32 run. The dense and moe repeats
    use it so the error band spans that precision (:func:`demo.spec.repeat_layout`)."""
    def inputs(_module: torch.nn.Module, args: tuple) -> tuple:
        q, k, v, *rest = args
        return (*(t.half().float() for t in (q, k, v)), *rest)

    def output(_module: torch.nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
        return out.half().float()

    hooked = [m for n, m in model.named_modules() if n.endswith("self_attention.core_attention")]
    if not hooked:
        raise RuntimeError("no self_attention.core_attention module to round through float16")
    for m in hooked:
        m.register_forward_pre_hook(inputs)
        m.register_forward_hook(output)
    return model


def build_optimizer(ddp: torch.nn.Module, spec: Spec) -> MegatronOptimizerCPU:
    """Megatron's optimizer; the weight_decay_all fault passes ``config_overrides={}`` (decay everything)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    cfg = OptimizerConfig(optimizer="adam", lr=spec.lr, min_lr=spec.min_lr, weight_decay=spec.weight_decay,
                          adam_beta1=spec.adam_beta1, adam_beta2=spec.adam_beta2, adam_eps=spec.adam_eps,
                          clip_grad=spec.clip_grad, bf16=False, fp16=False, params_dtype=torch.float32,
                          use_distributed_optimizer=False)
    overrides: dict[Any, Any] | None = {} if injects(spec, "baseline") == "weight_decay_all" else None
    with cpu_device_redirect():
        inner = get_megatron_optimizer(cfg, [ddp], config_overrides=overrides)
    return MegatronOptimizerCPU(inner)


def build_scheduler(opt: MegatronOptimizerCPU, spec: Spec) -> Any:
    """Megatron's OptimizerParamScheduler: it sets each group's lr and its weight decay (x wd_mult)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(opt, init_lr=0.0, max_lr=spec.lr, min_lr=spec.min_lr,
                                   lr_warmup_steps=spec.warmup_steps, lr_decay_steps=spec.steps,
                                   lr_decay_style=spec.lr_schedule, start_wd=spec.weight_decay,
                                   end_wd=spec.weight_decay, wd_incr_steps=spec.steps, wd_incr_style="constant")


def _named_params(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(strip_module_prefix(n), p) for n, p in model.named_parameters()]


def dp_share(arrays: dict[str, Any], dp_rank: int, dp: int) -> dict[str, Any]:
    """This data-parallel rank's rows of the step's batch (all of it when dp is 1)."""
    if dp == 1:
        return arrays
    rows = next(iter(arrays.values())).shape[0]
    if rows % dp:
        raise ValueError(f"micro-batch of {rows} rows cannot be split over {dp} data-parallel ranks")
    part = rows // dp
    return {k: v[dp_rank * part:(dp_rank + 1) * part] for k, v in arrays.items()}


def dp_mean(loss: torch.Tensor, dp: int) -> float:
    """The loss Megatron-LM logs: the mean over the data-parallel group (each rank's loss is a mean over the
    same number of tokens here, so this is the whole batch's mean loss)."""
    if dp == 1:
        return float(loss)
    from megatron.core import parallel_state

    t = loss.clone()
    torch.distributed.all_reduce(t, group=parallel_state.get_data_parallel_group())
    return float(t) / dp


def run(spec: Spec) -> dict[str, Any]:
    """Train ``spec.steps`` steps, dumping every step's batch, local norms and scalars; layers at 1-2."""
    t0 = time.perf_counter()
    torch.set_num_threads(max(1, spec.threads))
    seed_info = seed_everything(spec.seed)
    info = init_megatron_cpu(tp=spec.tp, seed=spec.seed)
    lead = info.rank == 0
    model = build_model(spec)
    if spec.init_weights and lead:
        Path(spec.init_weights).parent.mkdir(parents=True, exist_ok=True)
        torch.save({k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)},
                   spec.init_weights)
    ddp = wrap_ddp(model)
    opt = build_optimizer(ddp, spec)
    sched = build_scheduler(opt, spec)
    modules = LAYER_MODULES if spec.model_kind == "llama" else MCORE_LAYER_MODULES
    cfg = DumpConfig(out=spec.out, steps=None, tensor_steps=spec.tensor_steps if spec.tensor_steps else [],
                     modules=modules, tensors="full" if spec.tensor_steps else "off", seed_layout=True,
                     nan_trace="grads", routing=spec.model_kind in MOE_KINDS and bool(spec.tensor_steps))
    meta = {**seed_info, "config": {"kind": "megatron_args", "values": megatron_args(spec)}, "role": spec.role,
            "inject": spec.inject, "threads": torch.get_num_threads(),
            "dtypes": {"params": "float32", "grads": "float32", "compute": "float32"},
            **({"attention": "q, k, v and output rounded through float16"} if spec.attention_fp16 else {}),
            "data": {"vocab_size": spec.model.vocab_size, "eos_id": spec.eos_id, "pad_id": spec.pad_id}}
    dumper = MegatronDumper(ddp, opt, cfg, meta=meta)
    from megatron.core.distributed import finalize_model_grads

    source = BatchSource(spec, mutate_cache=injects(spec, "baseline") == "loss_mask_mutation")
    params = _named_params(ddp)
    nan_hook = None
    if injects(spec, "baseline") == "nan_param":
        p = dict(params)[NAN_PARAM_BASELINE]
        nan_hook = p
    # every rank: under torch.distributed each writes the part it owns (evidence/optimizer_step1/rank_R.npz)
    # one process: also the clipping probe, Megatron's clipping on CPU under the device redirect its step uses
    evidence = (OptimizerEvidence(ddp, spec.out, opt, device_context=cpu_device_redirect)
                if spec.optimizer_evidence else None)
    losses = []
    for step in range(1, spec.steps + 1):
        arrays = dp_share(source(step), info.dp_rank, info.dp)
        batch = {k: torch.from_numpy(v) for k, v in arrays.items()}
        lr = float(opt.param_groups[0]["lr"])
        dumper.begin_step(step)
        dumper.record_batch(batch)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = forward_loss(ddp, batch)
        loss.backward()
        with cpu_device_redirect():   # as Megatron's train_step: DP sync, then TP all-reduce of qk_layernorm grads
            finalize_model_grads([ddp])
        if nan_hook is not None and step == NAN_STEP:
            nan_hook.main_grad.view(-1)[0] = float("nan")
        if step == 1 and evidence is not None:
            evidence.before_step()
        _, grad_norm, _ = opt.step()
        if step == 1 and evidence is not None:
            evidence.after_step()
        losses.append(dp_mean(loss.detach(), info.dp))
        dumper.end_step(loss=losses[-1], lr=lr)
        sched.step(1)
    dumper.close()
    return {"role": spec.role, "rank": info.rank, "tp": spec.tp, "steps": spec.steps,
            "seconds": time.perf_counter() - t0,
            "first_loss": losses[0], "last_loss": losses[-1], "threads": torch.get_num_threads(),
            "dumper_errors": dumper.errors, "dumper_error_log": dumper.error_log[:5],
            "evidence_errors": [e for e in (evidence.error, evidence.clip_error) if e] if evidence else []}


def main(argv: list[str] | None = None) -> int:
    """Run each SPEC.json in turn in this one process (torch's and Megatron's start-up paid once; every run seeds
    and builds from its own spec, in the parallel layout of the first: one torchrun launch holds one layout)."""
    argv = sys.argv[1:] if argv is None else argv
    layout = None
    for path in argv:
        spec = read_spec(path)
        if layout is not None and (spec.tp, spec.dp) != layout:
            raise ValueError(f"{path}: tp={spec.tp} dp={spec.dp}, but this process runs tp={layout[0]} dp={layout[1]}")
        layout = (spec.tp, spec.dp)
        result = run(spec)
        if spec.result_file and result["rank"] == 0:
            Path(spec.result_file).write_text(json.dumps(result))
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
