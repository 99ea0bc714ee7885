"""Candidate side of the paired demo: MindFormers on CPU replaying the baseline's batches.

The candidate model is ``spec.model_kind``: ``llama`` = the legacy LlamaForCausalLM (MindFormers <= 1.6,
MindSpore .ckpt weights), ``dense`` = MindFormers 2.x's mcore TrainingQwen3ForCausalLM (Megatron's own
parameter names, safetensors weights, the ``megatron_core__mindformers_mcore_dense`` mapping), ``moe`` / ``mla`` =
the mcore TrainingQwen3MoeForCausalLM / TrainingDeepseekV3ForCausalLM. The legacy model trains in PYNATIVE (layer
hooks); the mcore candidates train in GRAPH and take their layer statistics from the GRAPH step itself
(``MindSporeDumper(graph_capture=True)``, :func:`demo.spec.trains_in_graph`).

``python -m demo.mindformers_runner SPEC.json`` (see :class:`demo.spec.Spec`). The run converts the
baseline's initial Megatron weights with ``align convert-weights`` (the same mapping the comparison uses) and
builds everything from the MindFormers YAML of :func:`demo.spec.mindformers_config`, which the run store records
and the checklist reads: an mcore model through MindFormers' own ``build_context`` and ``build_network``, as
run_mindformer.py's Trainer builds it (:func:`build_mcore_net`), the YAML's ``runner_wrapper`` around it
(``McoreCPUTrainOneStepCell`` installs the CPU stand-ins of :mod:`demo.mindformers_mcore_cpu`, as in a YAML-only
run), AdamW with MindFormers' own weight-decay grouping and the YAML's lr schedule. It replays every baseline
step through ``ReplaySource`` and dumps what MindFormers computed.

Role ``optimizer_check`` instead feeds the baseline's step-1 gradients (converted to MindFormers names)
through the candidate's clipping and optimizer once and saves the updated weights: the optimizer stage
compares them with the baseline's weights after step 1.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from demo.spec import (
    MCORE_LAYER_MODULES,
    MOE_KINDS,
    NAN_STEP,
    SWAP_EXPERTS,
    SWAP_LAYER,
    Spec,
    injects,
    mindformers_config,
    nan_param,
    read_spec,
    trains_in_graph,
)
from runstore import CONVERSION_EVIDENCE, EVIDENCE_DIR, atomic_write_json

os.environ.setdefault("LOCAL_DEFAULT_PATH", os.path.join(tempfile.gettempdir(), "xf_align_mindformers"))

import mindspore as ms  # noqa: E402
from mindspore import Tensor, nn  # noqa: E402

from demo import mindformers_cpu as mc  # noqa: E402
from demo import mindformers_mcore_cpu as mcc  # noqa: E402
from dumpers.mindformers import name_local_norms, optimizer_param_names, optimizer_param_sizes, split_outputs  # noqa: E402
from dumpers.mindspore_dumper import DumpConfig, MindSporeDumper  # noqa: E402
from dumpers.mindspore_optimizer_check import run_optimizer_check  # noqa: E402

# Layer profile cells, the MindFormers counterparts of demo.megatron_runner.LAYER_MODULES.
LAYER_CELLS = ("model.tok_embeddings", "model.layers.*.attention_norm", "model.layers.*.attention",
               "model.layers.*.ffn_norm", "model.layers.*.feed_forward", "model.norm_out", "lm_head")
# The mcore model's cells carry Megatron's module names (hooked on the inner GPTModel, ``net.model``).
LAYER_CELLS_MCORE = MCORE_LAYER_MODULES


def is_mcore(spec: Spec) -> bool:
    return spec.model_kind != "llama"


def mcore_preset(spec: Spec) -> str:
    """The mapping preset of an mcore candidate kind (the conversion and the report use the same one)."""
    return mcc.MCORE_PRESETS[spec.model_kind]


def _qk_swap_rows(arr: np.ndarray, *, num_heads: int, num_query_groups: int, head_dim: int) -> np.ndarray:
    """The qk_swap fault on a fused linear_qkv: rows of every q and k head re-permuted (RoPE halves ->
    interleaved pairs); the v rows of each query group stay. Layout per group: [q heads | k | v]."""
    perm = np.stack([np.arange(head_dim // 2), np.arange(head_dim // 2) + head_dim // 2], axis=1).reshape(-1)
    per_group = num_heads // num_query_groups + 2
    w = arr.reshape(num_query_groups, per_group, head_dim, -1).copy()
    w[:, :per_group - 1] = w[:, :per_group - 1][:, :, perm, :]    # q heads and k, not v
    return w.reshape(arr.shape)


def convert(spec: Spec) -> dict[str, Any]:
    """Megatron initial weights -> MindSpore checkpoint; the qk_swap fault re-permutes q/k rows per head."""
    from checkpoints.convert import convert_megatron_to_mindformers

    m = spec.model
    res = convert_megatron_to_mindformers([spec.init_weights], spec.converted, num_heads=m.num_attention_heads,
                                          num_query_groups=m.num_query_groups,
                                          mapping=mcore_preset(spec) if is_mcore(spec) else None)
    if injects(spec, "conversion") == "qk_swap" and is_mcore(spec):
        from checkpoints.mindformers import read_safetensors, write_safetensors

        arrays, meta = read_safetensors(spec.converted)
        arrays = {k: _qk_swap_rows(v, num_heads=m.num_attention_heads, num_query_groups=m.num_query_groups,
                                   head_dim=m.head_dim)
                  if k.endswith("self_attention.linear_qkv.weight") else v for k, v in arrays.items()}
        write_safetensors(arrays, spec.converted, metadata=meta)
    elif injects(spec, "conversion") == "expert_swap":
        from checkpoints.mindformers import read_safetensors, write_safetensors

        arrays, meta = read_safetensors(spec.converted)
        key = f"decoder.layers.{SWAP_LAYER}.mlp.router.weight"
        w = arrays[key].copy()
        a, b = SWAP_EXPERTS
        w[[a, b]] = w[[b, a]]
        arrays[key] = w
        write_safetensors(arrays, spec.converted, metadata=meta)
    elif injects(spec, "conversion") == "qk_swap":
        params = ms.load_checkpoint(spec.converted)
        d = m.head_dim
        perm = np.stack([np.arange(d // 2), np.arange(d // 2) + d // 2], axis=1).reshape(-1)  # halves -> pairs
        items = []
        for name, p in params.items():
            arr = p.asnumpy()
            if name.endswith(("attention.wq.weight", "attention.wk.weight")):
                heads = arr.shape[0] // d
                arr = arr.reshape(heads, d, -1)[:, perm, :].reshape(arr.shape)
            items.append({"name": name, "data": ms.Parameter(Tensor(arr), name=name)})
        ms.save_checkpoint(items, spec.converted)
    return {"verdict": res.verdict, "tensors": res.details.get("tensors"),
            "findings": [f.to_json() for f in res.findings]}


def model_overrides(spec: Spec) -> dict[str, Any]:
    """LlamaConfig values from the run's MindFormers config (the YAML the checklist reads)."""
    mcfg = dict(mindformers_config(spec)["model"]["model_config"])
    for key in ("type", "checkpoint_name_or_path", "hidden_dropout_prob", "attention_dropout_prob",
                "tie_word_embeddings", "hidden_act", "qkv_has_bias"):
        mcfg.pop(key, None)
    return mcfg


def build_mcore_net(spec: Spec) -> nn.Cell:
    """The mcore model of the run's MindFormers YAML (:func:`demo.spec.mindformers_config`, the config the run
    store records and the checklist reads), built as MindFormers' Trainer builds it: the context from the YAML
    (``build_context``: ``use_legacy: False``, ``context.mode``), then ``build_network`` (``model_type`` ->
    config class, ``architectures`` -> model class), loaded from the converted safetensors. The CPU stand-ins
    come with the YAML's ``runner_wrapper`` (:func:`build_cell`), as in a YAML-only run. The demo's own hooks
    (the embedding_fp16 fault) are applied to this network."""
    from checkpoints.mindformers import read_safetensors

    cfg = mindformers_config(spec)
    mcc.set_yaml_context(cfg)
    net = mcc.build_yaml_model(cfg)
    arrays, _ = read_safetensors(spec.converted)
    mcc.load_parameter_arrays(net, arrays)
    if injects(spec, "candidate") == "embedding_fp16":
        emb = net.model.embedding.word_embeddings
        inner = emb.construct

        def low_precision(*args: Any, **kwargs: Any) -> Any:
            return inner(*args, **kwargs).astype(ms.float16).astype(ms.float32)

        emb.construct = low_precision
    if injects(spec, "candidate") == "log_softmax_bf16":
        bf16_log_softmax(net.model.loss)
    if injects(spec, "candidate") == "norm_grad":
        from demo.backward_fault import plant_norm_grad_fault

        plant_norm_grad_fault(net)
    return net


def bf16_log_softmax(loss: nn.Cell) -> None:
    """The log_softmax_bf16 fault: the cross-entropy's log-softmax (MindFormers' ``_LogSoftmax`` cell inside
    its CrossEntropyLoss) takes logits rounded to bfloat16 and returns log-probabilities rounded to bfloat16,
    as a loss kernel run in bfloat16 computes them; its own backward (softmax - one-hot, from those
    log-probabilities) carries the rounding into the gradients."""
    cell = loss._log_softmax
    inner = cell.construct

    def low_precision(logits: Any, label: Any) -> Any:
        log_probs, one_hot = inner(logits.astype(ms.bfloat16).astype(ms.float32), label)
        return log_probs.astype(ms.bfloat16).astype(ms.float32), one_hot

    cell.construct = low_precision


def build_net(spec: Spec) -> nn.Cell:
    if is_mcore(spec):
        return build_mcore_net(spec)
    net = mc.build_tiny_llama(seed=spec.seed, **model_overrides(spec))
    params = ms.load_checkpoint(spec.converted)
    not_loaded, unused = ms.load_param_into_net(net, params, strict_load=True)
    if not_loaded or unused:
        raise RuntimeError(f"converted checkpoint does not fit the model: missing {not_loaded}, unused {unused}")
    if injects(spec, "candidate") == "embedding_fp16":
        emb = net.model.tok_embeddings
        inner = emb.construct

        def low_precision(*args: Any, **kwargs: Any) -> Any:
            return inner(*args, **kwargs).astype(ms.float16).astype(ms.float32)

        emb.construct = low_precision
    if injects(spec, "candidate") == "log_softmax_bf16":
        bf16_log_softmax(net.loss)
    return net


def build_lr(spec: Spec) -> Any:
    from mindformers.core.lr import ConstantWarmUpLR, CosineWithWarmUpLR

    sched = dict(mindformers_config(spec)["lr_schedule"])
    kind = sched.pop("type")
    if kind == "CosineWithWarmUpLR":
        return CosineWithWarmUpLR(**sched)
    return ConstantWarmUpLR(**sched)


def build_optimizer(net: nn.Cell, spec: Spec) -> nn.Optimizer:
    """MindFormers AdamW over MindFormers' own parameter groups (no decay for 1-D weights and biases)."""
    from mindformers.core.optim import AdamW
    from mindformers.trainer.optimizer_grouped_parameters import get_optimizer_grouped_parameters

    opt_cfg = mindformers_config(spec)["optimizer"]
    lr = build_lr(spec)
    groups = get_optimizer_grouped_parameters(model=net, weight_decay=opt_cfg["weight_decay"],
                                              dynamic_lr_schedule=lr)
    return AdamW(groups, learning_rate=lr, betas=tuple(opt_cfg["betas"]), eps=opt_cfg["eps"],
                 weight_decay=opt_cfg["weight_decay"])


class FaultyTrainOneStepCell(mc.CPUTrainOneStepCell):
    """The legacy Llama's ``runner_wrapper`` (CPUTrainOneStepCell) that can poison one parameter's gradient (the
    nan_param fault, PYNATIVE only)."""

    poison_index: int | None = None

    def grads_for_legacy(self, *args: Any) -> Any:
        loss, grads, factor = super().grads_for_legacy(*args)
        if self.poison_index is not None:
            i = self.poison_index
            grads = grads[:i] + (grads[i] * Tensor(float("nan"), ms.float32),) + grads[i + 1:]
        return loss, grads, factor


class FaultyMcoreTrainOneStepCell(mcc.McoreCPUTrainOneStepCell):
    """The mcore ``runner_wrapper`` (McoreCPUTrainOneStepCell: installs the CPU stand-ins on the network it wraps,
    as in a YAML-only run) that can poison one parameter's gradient (the nan_param fault, PYNATIVE only).

    (One class per base: with a shared non-Cell mixin calling ``super()`` the GRAPH compile segfaulted here.)"""

    poison_index: int | None = None

    def grads_for_mcore(self, *args: Any) -> Any:
        loss, grads, factor = super().grads_for_mcore(*args)
        if self.poison_index is not None:
            i = self.poison_index
            grads = grads[:i] + (grads[i] * Tensor(float("nan"), ms.float32),) + grads[i + 1:]
        return loss, grads, factor


# runner_wrapper type in the YAML -> the class the demo builds (the same, plus the nan_param hook)
WRAPPERS = {"CPUTrainOneStepCell": FaultyTrainOneStepCell, "McoreCPUTrainOneStepCell": FaultyMcoreTrainOneStepCell}


def build_cell(net: nn.Cell, spec: Spec) -> FaultyTrainOneStepCell | FaultyMcoreTrainOneStepCell:
    """The YAML's ``runner_wrapper`` (its type and every value) around the network and the YAML's optimizer
    (the no_clip fault drops the clipping keys: the cell then does not clip, as MFTrainOneStepCell defaults)."""
    wrap = dict(mindformers_config(spec)["runner_wrapper"])
    cls = WRAPPERS[wrap.pop("type")]
    if injects(spec, "candidate") == "no_clip":   # the YAML still says clip at 1.0; MFTrainOneStepCell's default: off
        wrap.pop("use_clip_grad", None)
        wrap.pop("max_grad_norm", None)
    opt = build_optimizer(net, spec)
    inner = mcc.McoreReplayLoss(net) if is_mcore(spec) else net
    cell = cls(inner, opt, **wrap)
    cell.set_train(True)
    return cell


def run(spec: Spec) -> dict[str, Any]:
    """Replay every baseline step through MindFormers' training step, dumping what it computed."""
    from dumpers.mindformers_replay import ReplaySource

    t0 = time.perf_counter()
    if not is_mcore(spec):
        mc.set_cpu_context("pynative", seed=spec.seed)
    conversion = convert(spec) if spec.init_weights else None
    graph = trains_in_graph(spec)
    net = build_net(spec)
    cell = build_cell(net, spec)     # mcore: the runner_wrapper installs the CPU stand-ins, before the capture
    source = ReplaySource(spec.replay_dir, rank=0)
    steps = list(source.steps)[:spec.steps]
    tensors = ("stats" if graph else "full") if spec.tensor_steps else "off"
    dcfg = DumpConfig(steps=None, tensor_steps=spec.tensor_steps or [],
                      cells=LAYER_CELLS_MCORE if is_mcore(spec) else LAYER_CELLS,
                      tensors=tensors, nan_trace="grads",
                      routing=spec.model_kind in MOE_KINDS and bool(spec.tensor_steps),
                      meta={"config": {"kind": "mindformers_yaml", "values": mindformers_config(spec)},
                            "role": spec.role, "inject": spec.inject})
    if is_mcore(spec):   # the GPTModel inside: its cells have Megatron's module names
        # GRAPH: the watched cells are wrapped for in-graph capture before the first compile (as the YAML's
        # dumper callback does in on_train_begin, after the Trainer built the wrapper)
        dumper = MindSporeDumper(net.model, spec.out, dcfg, framework="mindformers", name_scheme="mindformers_mcore",
                                 graph_capture=graph)
    else:
        dumper = MindSporeDumper(net, spec.out, dcfg, framework="mindformers", name_scheme="mindformers")
    dumper.update_meta({"candidate_mode": "graph (layer statistics captured in the graph at the tensor steps)"
                        if graph else "pynative (layer hooks)"})
    dumper.watch_train_cell(cell)    # stacked experts: local norms per expert (before the first compile)
    inputs = mcc.mcore_inputs if is_mcore(spec) else mc.llama_inputs
    opt = cell.optimizer
    names, sizes = optimizer_param_names(opt), optimizer_param_sizes(opt)
    nan_index = names.index(nan_param(spec)) if injects(spec, "candidate") == "nan_param" else None
    losses = []
    for step in steps:
        batch = source.batch(step)
        dumper.begin_step(step)
        dumper.record_batch({"tokens": batch["input_ids"], "labels": batch["labels"],
                             "loss_mask": batch["loss_mask"]})
        cell.poison_index = nan_index if step == NAN_STEP else None
        out = cell(*inputs(batch))
        vals = split_outputs(out)
        gnorm = float(np.asarray(vals["global_norm"]).reshape(-1)[0]) if "global_norm" in vals else None
        named = name_local_norms(vals["local_norm"], names, vals.get("norm_size"), sizes)
        if gnorm is None:
            gnorm = float(np.sqrt(sum(v * v for v in named.values())))
        dumper.record_local_norms(list(named), np.array(list(named.values())), sizes, global_norm=gnorm,
                                  where="mindformers.MFTrainOneStepCell.local_norm")
        loss = float(np.asarray(vals["loss"]).reshape(-1)[0])
        lr = float(np.asarray(vals["lr"]).reshape(-1)[0]) if "lr" in vals else None
        losses.append(loss)
        dumper.end_step(loss=loss, grad_norm=gnorm, overflow=bool(np.asarray(vals["overflow"]).reshape(-1)[0]),
                        **({"lr": lr} if lr is not None else {}))
    dumper.close()
    if conversion is not None:
        atomic_write_json(Path(spec.out) / EVIDENCE_DIR / CONVERSION_EVIDENCE, conversion)
    return {"role": spec.role, "steps": len(steps), "seconds": time.perf_counter() - t0,
            "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
            "conversion": conversion}


def optimizer_check(spec: Spec) -> dict[str, Any]:
    """One candidate optimizer step on the baseline's step-1 gradients: OUT/evidence/optimizer_step1.npz."""
    if not is_mcore(spec):
        mc.set_cpu_context("pynative", seed=spec.seed)
    net = build_net(spec)
    cell = build_cell(net, spec)
    m = spec.model
    path = run_optimizer_check(cell.optimizer, spec.step1_file, spec.out,
                               mapping=mcore_preset(spec) if is_mcore(spec) else None, num_heads=m.num_attention_heads,
                               num_query_groups=m.num_query_groups, train_cell=cell)
    return {"role": spec.role, "file": str(path)}


def main(argv: list[str] | None = None) -> int:
    """Run each SPEC.json in turn in this one process (MindSpore's start-up is paid once)."""
    argv = sys.argv[1:] if argv is None else argv
    for path in argv:
        spec = read_spec(path)
        result = optimizer_check(spec) if spec.role == "optimizer_check" else run(spec)
        if spec.result_file:
            Path(spec.result_file).write_text(json.dumps(result))
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
