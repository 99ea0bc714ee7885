"""`align check-config`: Megatron arguments vs a MindFormers YAML, side by side on common keys.

Why: most cross-framework accuracy gaps are settings, not code (an eps, a beta, a warmup, dropout left on).
Both sides are reduced to one vocabulary of common keys; each row is match / mismatch / check (by hand),
with the MindFormers accuracy guide's advice for known traps (odd vocab size, dropout on, aux loss on,
optimizer parallel on, capacity factor that drops tokens, pad == eos, weight decay rules).

Megatron input: a training log's ``arguments`` block (as Megatron-LM's ``_print_args`` prints it), a launch
script's argument arrays / strings (``--num-layers 32 ...``), or JSON. Values absent from a script take
Megatron-LM's defaults (marked as such).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from align.checks.data import megatron_vocabulary
from core.findings import Finding, StageResult
from models.mindformers_yaml import MCORE_ALIASES, NOT_READ, expert_count, is_float32, is_mcore_yaml, mcore_value
from models.mindformers_yaml import get as _get

STAGE = "config"
# Megatron-LM defaults for the arguments this check reads (megatron/training/arguments.py).
MEGATRON_DEFAULTS: dict[str, Any] = {
    "hidden_dropout": 0.1, "attention_dropout": 0.1, "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_eps": 1e-8,
    "weight_decay": 0.01, "clip_grad": 1.0, "lr_decay_style": "linear", "normalization": "LayerNorm",
    "norm_epsilon": 1e-5, "position_embedding_type": "learned_absolute", "rotary_base": 10000,
    "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "context_parallel_size": 1,
    "expert_model_parallel_size": 1, "make_vocab_size_divisible_by": 128, "min_lr": 0.0, "lr_warmup_iters": 0,
    "lr_warmup_fraction": None, "micro_batch_size": None, "global_batch_size": None, "bf16": False,
    "fp16": False, "swiglu": False, "squared_relu": False, "group_query_attention": False,
    "num_query_groups": 1, "sequence_parallel": False, "use_distributed_optimizer": False,
    "num_experts": None, "moe_router_topk": 2, "moe_aux_loss_coeff": 0.0, "moe_expert_capacity_factor": None,
    "untie_embeddings_and_output_weights": False, "add_bias_linear": True, "seed": 1234,
    "apply_wd_to_qk_layernorm": False, "optimizer": "adam", "attention_softmax_in_fp32": False,
    # megatron-core TransformerConfig defaults for the mcore keys MindFormers 2.x names the same way
    "kv_channels": None, "qk_layernorm": False, "add_qkv_bias": False, "init_method_std": 0.02,
    "fp32_residual_connection": False, "moe_ffn_hidden_size": None, "moe_router_dtype": None,
    "moe_token_drop_policy": "probs", "moe_router_load_balancing_type": "aux_loss",
    "moe_router_pre_softmax": False, "moe_router_topk_scaling_factor": None,
    "moe_router_score_function": "softmax", "moe_router_enable_expert_bias": False,
    "moe_shared_expert_intermediate_size": None, "moe_shared_expert_gate": False,
    "moe_pad_expert_input_to_capacity": False, "mtp_num_layers": None, "mtp_loss_scaling_factor": 0.1,
    "multi_latent_attention": False, "q_lora_rank": None, "kv_lora_rank": 32, "qk_head_dim": 128,
    "qk_pos_emb_head_dim": 64, "v_head_dim": 128, "deterministic_mode": False, "use_flash_attn": False,
    "apply_rope_fusion": True, "bias_swiglu_fusion": True,
    "attention_backend": "auto", "transformer_impl": "transformer_engine",
}
_VOCAB_ARGS = ("vocab_size", "padded_vocab_size", "make_vocab_size_divisible_by", "tensor_model_parallel_size",
               "tokenizer_type", "null_tokenizer_eod_id", "null_tokenizer_pad_id")
_MF_LR = {"CosineWithWarmUpLR": "cosine", "LinearWithWarmUpLR": "linear", "ConstantWarmUpLR": "constant",
          "PolynomialWithWarmUpLR": "polynomial", "CosineWithRestartsAndWarmUpLR": "cosine-restarts",
          "WarmUpStableDecayLR": "WSD", "CosineAnnealingLR": "cosine", "constant": "constant"}


# ------------------------------------------------------------------------------------------------------
# Common keys
# ------------------------------------------------------------------------------------------------------

def _first(*values: Any) -> Any:
    for v in values:
        if v is not None:
            return v
    return None


def megatron_common(a: dict[str, Any]) -> tuple[dict[str, Any], set[str]]:
    """Common keys from Megatron arguments; the second value names keys that came from defaults.

    An abbreviated arguments block (lines left out) gets no defaults: a setting it does not state is
    unknown, and Megatron's default could contradict what the run used."""
    defaulted: set[str] = set()
    defaults = {} if getattr(a, "abbreviated", False) else MEGATRON_DEFAULTS

    def g(name: str) -> Any:
        if name in a and a[name] is not None:
            return a[name]
        return defaults.get(name)

    def mark(key: str, *names: str) -> None:
        if not any(n in a and a[n] is not None for n in names):
            defaulted.add(key)

    h = g("hidden_size")
    nh = g("num_attention_heads")
    ffn = g("ffn_hidden_size")
    if ffn is None and h:
        ffn = int(4 * h * 2 / 3 / 64) * 64 if g("swiglu") else 4 * h
    tp = g("tensor_model_parallel_size")
    # the padded vocabulary the embedding has (the NullTokenizer's end-of-document id counts: align.checks.data)
    vocab = megatron_vocabulary({k: g(k) for k in _VOCAB_ARGS if k in a or g(k) is not None}).get("vocab_size")
    compute = "bfloat16" if g("bf16") else "float16" if g("fp16") else (
        "float32" if g("bf16") is not None or g("fp16") is not None else None)

    def flag(name: str) -> bool | None:
        v = g(name)
        return None if v is None else bool(v)
    decay_iters = _first(g("lr_decay_iters"), g("train_iters"))
    warm = g("lr_warmup_iters")
    if g("lr_warmup_fraction") is not None and decay_iters:
        warm = round(g("lr_warmup_fraction") * decay_iters)
    elif g("lr_warmup_fraction") == 0:
        warm = 0
    experts = g("num_experts") or 0
    c = {
        "num_layers": g("num_layers"), "num_heads": nh,
        "num_query_groups": g("num_query_groups") if g("group_query_attention") else nh,
        "hidden_size": h, "ffn_hidden_size": ffn, "vocab_size": vocab, "vocab_size_unpadded": g("vocab_size"),
        "seq_length": g("seq_length"), "norm_type": g("normalization"),
        "norm_eps": _first(a.get("norm_epsilon"), a.get("layernorm_epsilon"), defaults.get("norm_epsilon")),
        "activation": "swiglu" if g("swiglu") else "squared_relu" if g("squared_relu") else (
            "gelu" if g("swiglu") is not None else None),
        "position_embedding": g("position_embedding_type"), "rotary_base": g("rotary_base"),
        "hidden_dropout": g("hidden_dropout"), "attention_dropout": g("attention_dropout"),
        "lr": g("lr"), "min_lr": g("min_lr"), "warmup_steps": warm,
        # no warm-up is ratio 0 whatever the schedule length (never 'unknown')
        "warmup_ratio": 0.0 if warm == 0 else (warm / decay_iters) if (warm is not None and decay_iters) else None,
        "decay_style": g("lr_decay_style"), "adam_beta1": g("adam_beta1"), "adam_beta2": g("adam_beta2"),
        "adam_eps": g("adam_eps"), "weight_decay": g("weight_decay"),
        "weight_decay_applies_to": "2-D weights (bias and 1-D skipped)" + (
            ", qk-layernorm decayed" if g("apply_wd_to_qk_layernorm") else ""),
        "clip_grad": (g("clip_grad") or 0.0) if g("clip_grad") is not None else None,
        "global_batch_size": g("global_batch_size"),
        "micro_batch_size": g("micro_batch_size"), "compute_dtype": compute,
        "params_dtype": g("params_dtype") or compute, "tp": tp, "pp": g("pipeline_model_parallel_size"),
        "dp": g("data_parallel_size"), "cp": g("context_parallel_size"),
        "sequence_parallel": flag("sequence_parallel"), "ep": g("expert_model_parallel_size"),
        "num_experts": experts, "moe_topk": g("moe_router_topk") if experts else None,
        "moe_aux_loss_coeff": g("moe_aux_loss_coeff") if experts else None,
        "moe_capacity_factor": g("moe_expert_capacity_factor") if experts else None,
        "untie_embeddings": flag("untie_embeddings_and_output_weights"),
        "bias_linear": flag("add_bias_linear"), "optimizer_parallel": flag("use_distributed_optimizer"),
        "seed": g("seed"), "data_seed": g("seed"),      # Megatron's GPTDataset shuffles with --seed
        "flash_attention": megatron_flash_attention(g, compute),
        "pipeline_layers": megatron_pipeline_layers(g),
        "kv_channels": g("kv_channels") or (h // nh if h and nh else None),
        "qk_layernorm": bool(g("qk_layernorm")), "qkv_bias": bool(g("add_qkv_bias") or g("add_bias_linear")),
        "init_method_std": g("init_method_std"),
        # the residual stream is fp32 with --fp32-residual-connection, or when the whole run is fp32
        "fp32_residual_connection": bool(g("fp32_residual_connection")) or compute == "float32",
        # in an fp32 run every softmax is fp32; the flag only matters under --bf16 / --fp16
        "softmax_in_fp32": bool(g("attention_softmax_in_fp32")) or compute == "float32",
        # megatron-core computes RMSNorm/LayerNorm statistics and RoPE frequencies in fp32 (no flag)
        "layernorm_compute_dtype": "float32", "rotary_dtype": "float32",
        "optimizer": {"adam": "adamw"}.get(str(g("optimizer")).lower(), g("optimizer")),
        "deterministic": bool(g("deterministic_mode")) if "deterministic_mode" in a else None,
        "rope_fusion": bool(g("apply_rope_fusion")) and not a.get("no_rope_fusion"),
        "swiglu_fusion": bool(g("bias_swiglu_fusion")) and not a.get("no_bias_swiglu_fusion"),
    }
    if experts:
        c.update({
            "moe_ffn_hidden_size": g("moe_ffn_hidden_size") or ffn,
            "moe_router_dtype": _dtype(g("moe_router_dtype")) or compute,
            "moe_token_drop_policy": g("moe_token_drop_policy"),
            "moe_router_load_balancing_type": g("moe_router_load_balancing_type"),
            "moe_router_pre_softmax": bool(g("moe_router_pre_softmax")),
            # megatron-core normalises the top-k probabilities when top-k > 1 for a sigmoid router always, for
            # softmax unless pre-softmax (softmax over the top-k logits) (moe_utils.topk_routing_with_score_function)
            "moe_norm_topk_prob": ((g("moe_router_topk") or 0) > 1 and (
                g("moe_router_score_function") == "sigmoid" or not g("moe_router_pre_softmax"))),
            "moe_router_topk_scaling_factor": g("moe_router_topk_scaling_factor") or 1.0,
            "moe_router_score_function": g("moe_router_score_function"),
            "moe_router_enable_expert_bias": bool(g("moe_router_enable_expert_bias")),
            "moe_shared_expert_intermediate_size": g("moe_shared_expert_intermediate_size"),
            "moe_shared_expert_gate": bool(g("moe_shared_expert_gate")),
            "moe_pad_to_capacity": bool(g("moe_pad_expert_input_to_capacity")),
        })
    if g("mtp_num_layers"):
        c.update({"mtp_num_layers": g("mtp_num_layers"), "mtp_loss_scaling_factor": g("mtp_loss_scaling_factor")})
    if g("multi_latent_attention"):
        c.update({k: g(k) for k in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                                    "v_head_dim")})
        c["multi_latent_attention"] = True
        # YaRN's mscale also scales MLA's softmax (differently in each framework); plain RoPE has none
        c["rope_scaling_factor"] = 1.0 if g("rope_type") == "rope" else g("rotary_scaling_factor")
    for key, names in {"hidden_dropout": ["hidden_dropout"], "attention_dropout": ["attention_dropout"],
                       "adam_beta1": ["adam_beta1"], "adam_beta2": ["adam_beta2"], "adam_eps": ["adam_eps"],
                       "weight_decay": ["weight_decay"], "clip_grad": ["clip_grad"],
                       "norm_eps": ["norm_epsilon", "layernorm_epsilon"], "norm_type": ["normalization"],
                       "decay_style": ["lr_decay_style"], "position_embedding": ["position_embedding_type"],
                       "min_lr": ["min_lr"], "bias_linear": ["add_bias_linear"],
                       "kv_channels": ["kv_channels"], "init_method_std": ["init_method_std"],
                       "moe_token_drop_policy": ["moe_token_drop_policy"],
                       "moe_router_load_balancing_type": ["moe_router_load_balancing_type"],
                       "moe_router_dtype": ["moe_router_dtype"], "layernorm_compute_dtype": [],
                       "rotary_dtype": []}.items():
        mark(key, *names)
    return c, defaulted


def megatron_flash_attention(g: Any, compute: str | None) -> bool | None:
    """Whether Megatron's core attention is a fused/flash kernel (True) or the unfused softmax path (False).

    ``--use-flash-attn`` or ``--attention-backend flash|fused`` -> True; ``unfused|local`` or
    ``--transformer-impl local`` -> False; ``auto`` (the default) lets Transformer Engine pick a flash or
    cuDNN fused kernel, which exist only for bf16/fp16, so an fp32 run falls back to the unfused path."""
    backend = g("attention_backend")
    backend = None if backend is None else str(backend).rsplit(".", 1)[-1].lower()
    if g("use_flash_attn") or backend in ("flash", "fused"):
        return True
    if backend in ("unfused", "local") or str(g("transformer_impl")).lower() == "local":
        return False
    if backend == "auto":
        return None if compute is None else compute in ("bfloat16", "float16")
    return None


def _split_even(layers: int, stages: int) -> list[int] | None:
    return [layers // stages] * stages if stages > 0 and layers % stages == 0 else None


def megatron_pipeline_layers(g: Any) -> Any:
    """Decoder layers per pipeline stage, ``[[stage 0, stage 1, ...]]`` (one list per virtual chunk): the
    even split, or ``--decoder-first/last-pipeline-num-layers`` with the rest split evenly; None where the
    arguments do not fix it (a custom ``--pipeline-model-parallel-layout``) or without pipelining."""
    from models.mindformers_parallel import MAX_LAYERS, MAX_SIZE

    pp, layers = g("pipeline_model_parallel_size") or 1, g("num_layers")
    if not isinstance(layers, int) or not isinstance(pp, int) or g("pipeline_model_parallel_layout"):
        return None
    if pp <= 1:
        return [[layers]]
    if layers > MAX_LAYERS or pp > MAX_SIZE:     # nothing is sized from a count no model has
        return f"{layers} layers over {pp} stages: more than any model holds"
    vpp = g("num_virtual_stages_per_pipeline_rank")
    if vpp is None and g("num_layers_per_virtual_pipeline_stage"):
        n = g("num_layers_per_virtual_pipeline_stage")
        vpp = layers // (pp * n) if isinstance(n, int) and n > 0 and layers % (pp * n) == 0 else None
        if vpp is None:
            return f"{layers} layers do not split into {pp} stages of {n}-layer chunks"
    vpp = vpp or 1
    if not isinstance(vpp, int) or not 0 < vpp <= MAX_SIZE:
        return f"{vpp!r:.30} virtual stages per pipeline rank: not a usable count"
    first, last = g("decoder_first_pipeline_num_layers"), g("decoder_last_pipeline_num_layers")
    if first is None and last is None:
        split = _split_even(layers, pp * vpp)
        if split is None:
            return f"{layers} layers do not split evenly into {pp * vpp} stages"
        return [split[c * pp:(c + 1) * pp] for c in range(vpp)]
    if vpp != 1:
        return None               # uneven first/last stages with virtual chunks: not derived here
    middle = pp - (first is not None) - (last is not None)
    rest = layers - (first or 0) - (last or 0)
    split = _split_even(rest, middle) if middle > 0 else ([] if rest == 0 else None)
    if split is None:
        return f"{rest} middle layers do not split evenly into {middle} stages"
    return [([first] if first is not None else []) + split + ([last] if last is not None else [])]


def mindformers_pipeline_layers(cfg: dict[str, Any], layers: Any) -> Any:
    """Layers per pipeline stage of a MindFormers YAML, ``[[...]]`` per interleave chunk: each of the
    pp x pp_interleave_num stages gets num_layers // (pp * interleave) plus its ``offset`` (an int, a list
    per stage or a list per chunk of lists per stage; parallel_core/training_graph/transformer/utils.py
    LayerSetting). None without pipelining; a text naming the problem where MindFormers would refuse it."""
    import numpy as np

    from models.mindformers_parallel import MAX_LAYERS, MAX_SIZE

    pp = (cfg.get("parallel_config") or {}).get("pipeline_stage", 1) or 1
    if not isinstance(layers, int) or isinstance(layers, bool):
        return NOT_READ
    if not isinstance(pp, int) or pp <= 1:
        return [[layers]]
    mc = _get(cfg, "model.model_config", {}) or {}
    interleave = mc.get("pp_interleave_num", 1) or 1
    if not _get(cfg, "parallel.pipeline_config.pipeline_interleave", False):
        interleave = 1
    if not isinstance(interleave, int) or layers > MAX_LAYERS or pp * interleave > MAX_SIZE:
        return f"{layers} layers over {pp} stages x {interleave!r:.20} chunks: more than any model holds"
    offset = mc.get("offset", 0)
    offset = 0 if offset is None else offset

    def ints(v: Any) -> bool:
        return all(ints(x) for x in v) if isinstance(v, list) else type(v) is int
    if not ints(offset):
        return f"offset {offset!r:.60} is not whole numbers"
    try:
        off = np.array(offset, dtype=np.int64)
        if off.ndim > 2 or (off.ndim >= 1 and off.shape[-1] != pp) or (off.ndim == 2 and off.shape[0] != interleave):
            raise ValueError
        total = pp * interleave
        base, rem = divmod(layers, total)
        if int(off.sum() if off.ndim else off * total) != rem and total > 1:
            return f"offset {offset} does not add up to {layers} % {total} = {rem} (MindFormers refuses it)"
        per = np.broadcast_to(off, (interleave, pp)) + base
    except (ValueError, TypeError, OverflowError):
        return f"offset {offset!r:.60} does not fit {pp} stages x {interleave} chunks"
    return per.tolist()


def _llama_ffn(h: int, multiple_of: int, mult: float | None) -> int:
    hidden = int(2 * (4 * h) / 3)
    if mult is not None:
        hidden = int(mult * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


_DTYPES = {"fp32": "float32", "float32": "float32", "fp16": "float16", "float16": "float16", "half": "float16",
           "bf16": "bfloat16", "bfloat16": "bfloat16", "fp64": "float64", "float64": "float64"}


def _dtype(v: Any) -> Any:
    if v is None or v is NOT_READ:
        return v
    t = str(v).lower().replace("torch.", "").replace("mstype.", "")
    return _DTYPES.get(t, t)


# MindFormers names for Megatron's values of the same setting
_MF_BALANCE = {"gbs_aux_loss": "global_aux_loss"}
_MF_OPTIMIZER = {"adamw": "adamw", "fusedadamw": "adamw", "adamweightdecay": "adamw (no bias correction)",
                 "fusedadamweightdecay": "adamw (no bias correction)",
                 "fp32stateadamweightdecay": "adamw (no bias correction)"}


def mindformers_attention_dtype(cfg: dict[str, Any]) -> str | None:
    """The dtype a MindFormers 2.x model's attention computes in, when coarser than its compute dtype.

    Why: the mcore flash-attention path (``use_flash_attention``, on by default) casts float32 q/k/v to
    float16 before the kernel (the NPU kernel takes only float16/bfloat16), so a float32 run's attention,
    and everything after it, carries float16 rounding.
    """
    if not is_mcore_yaml(cfg):
        return None
    mc = _get(cfg, "model.model_config", {}) or {}
    if mc.get("use_flash_attention", True) is False:
        return None
    if mc.get("multi_latent_attention") or mc.get("kv_lora_rank") is not None:
        # MLA (DeepSeek-V3) has its own attention (transformer/multi_latent_attention.py) without that cast:
        # measured on CPU, its layer rows and local norms agree with float32 Megatron to ~5e-7
        return None
    return "float16" if _dtype(mc.get("compute_dtype")) == "float32" else None


def mcore_common(cfg: dict[str, Any]) -> dict[str, Any]:
    """Common keys from a MindFormers 2.x (mcore) YAML; a key the YAML does not set is NOT_READ."""
    mc = _get(cfg, "model.model_config", {}) or {}
    c = {k: mcore_value(mc, k) for k in MCORE_ALIASES}
    c.update(_training_common(cfg, mc))
    seq = c["seq_length"]
    if seq is NOT_READ:
        seq = _first(_get(cfg, "train_dataset.data_loader.config.seq_length"),
                     _get(cfg, "train_dataset.seq_length"))
        c["seq_length"] = NOT_READ if seq is None else seq
    act, glu = mc.get("hidden_act"), mc.get("gated_linear_unit")
    if act in ("swiglu", "fusedswiglu") or (act == "silu" and glu is not False):
        c["activation"] = "swiglu"        # HF 'silu' in Llama/Qwen is the gated (SwiGLU) MLP
    else:
        c["activation"] = NOT_READ if act is None else act
    untie = mc.get("untie_embeddings_and_output_weights")
    if untie is None and "tie_word_embeddings" in mc:
        untie = not mc["tie_word_embeddings"]
    c["untie_embeddings"] = NOT_READ if untie is None else bool(untie)
    compute = _dtype(c["compute_dtype"])
    fp32_res = c["fp32_residual_connection"]
    c["fp32_residual_connection"] = True if compute == "float32" else (
        fp32_res if fp32_res is NOT_READ else is_float32(fp32_res))
    c["flash_attention"] = c["flash_attention"] if c["flash_attention"] is NOT_READ else bool(
        _truth_or(c["flash_attention"]))
    c["pipeline_layers"] = mindformers_pipeline_layers(cfg, c["num_layers"])
    sm = c.pop("softmax_compute_dtype")
    c["softmax_in_fp32"] = sm if isinstance(sm, bool) or sm is NOT_READ else _dtype(sm) == "float32"
    for k in ("compute_dtype", "params_dtype", "layernorm_compute_dtype", "rotary_dtype", "moe_router_dtype"):
        c[k] = _dtype(c[k])
    if isinstance(c["moe_token_drop_policy"], bool):
        c["moe_token_drop_policy"] = "position" if c["moe_token_drop_policy"] else "probs"
    lb = c["moe_router_load_balancing_type"]
    c["moe_router_load_balancing_type"] = _MF_BALANCE.get(lb, lb) if isinstance(lb, str) else lb
    if isinstance(c["moe_router_score_function"], bool):
        c["moe_router_score_function"] = "sigmoid" if c["moe_router_score_function"] else "softmax"
    c["num_experts"] = expert_count(cfg)     # NOT_READ: an MoE model whose count comes from the model class
    if c["num_experts"] == 0:
        for k in [k for k in c if k.startswith("moe_")]:
            c[k] = None
    if c["mtp_num_layers"] is NOT_READ or not c["mtp_num_layers"]:
        c["mtp_num_layers"] = c["mtp_loss_scaling_factor"] = None
    if c["multi_latent_attention"] is NOT_READ and c["kv_lora_rank"] is not NOT_READ:
        c["multi_latent_attention"] = True      # kv_lora_rank exists only in MLA models (DeepSeek-V2/V3 YAMLs)
    if c["multi_latent_attention"] is not True:
        for k in ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                  "v_head_dim"):
            c[k] = None
    else:
        rs = mc.get("rope_scaling")
        c["rope_scaling_factor"] = float(rs.get("factor", 1.0)) if isinstance(rs, dict) else NOT_READ
    c["num_query_groups"] = c["num_query_groups"] if c["num_query_groups"] is not NOT_READ else c["num_heads"]
    c["vocab_size_unpadded"] = None
    c["deterministic"] = _deterministic(cfg)
    c["weight_decay_applies_to"] = "2-D weights (bias and 1-D skipped)"
    return c


def _deterministic(cfg: dict[str, Any]) -> Any:
    v = _get(cfg, "context.deterministic")
    if v is None:
        return NOT_READ
    return str(v).upper() == "ON" if isinstance(v, str) else bool(v)


def _warmup(lrs: dict[str, Any], zero_steps_zero_ratio: bool = False) -> tuple[Any, Any]:
    """(warm-up steps, warm-up ratio) of an lr_schedule block, each derived from the other and total_steps
    when only one is set; ``zero_steps_zero_ratio`` (mcore YAMLs): 0 steps is ratio 0 even without a total."""
    total = lrs.get("total_steps")
    warm_steps, warm_ratio = lrs.get("warmup_steps"), lrs.get("warmup_ratio")
    if warm_steps is None and warm_ratio is not None and total and total > 0:
        warm_steps = round(warm_ratio * total)
    if warm_ratio is None and warm_steps is not None and total and total > 0:
        warm_ratio = warm_steps / total
    if zero_steps_zero_ratio and warm_ratio is None and warm_steps == 0:
        warm_ratio = 0.0
    if zero_steps_zero_ratio and warm_steps is None and warm_ratio == 0:
        warm_steps = 0
    if zero_steps_zero_ratio and warm_steps is None and warm_ratio is None:
        warm_steps, warm_ratio = 0, 0.0     # MindFormers' schedules: neither set -> no warm-up
    return warm_steps, warm_ratio


def _training_common(cfg: dict[str, Any], mc: dict[str, Any]) -> dict[str, Any]:
    """Optimizer, schedule, batch and parallel keys: the same in legacy and mcore YAMLs."""
    pc = cfg.get("parallel_config") or {}
    opt = cfg.get("optimizer") or {}
    lrs = cfg.get("lr_schedule") or {}
    wrap = cfg.get("runner_wrapper") or {}
    runner = cfg.get("runner_config") or {}
    betas = opt.get("betas") or [opt.get("beta1", 0.9), opt.get("beta2", 0.999)]
    warm_steps, warm_ratio = _warmup(lrs, zero_steps_zero_ratio=True)
    dp, pp = pc.get("data_parallel", 1), pc.get("pipeline_stage", 1)
    mbs = _first(runner.get("batch_size"), mc.get("batch_size"), _get(cfg, "train_dataset.batch_size"))
    acc = runner.get("gradient_accumulation_steps", 1) or 1
    micro_num = pc.get("micro_batch_num", 1) if pp and pp > 1 else 1
    interleave = cfg.get("micro_batch_interleave_num", 1) or 1
    otype = str(opt.get("type", "")).lower()
    return {
        "lr": _first(lrs.get("learning_rate"), opt.get("learning_rate")), "min_lr": lrs.get("lr_end", 0.0),
        "warmup_steps": warm_steps, "warmup_ratio": warm_ratio,
        "decay_style": _MF_LR.get(lrs.get("type"), lrs.get("type")), "adam_beta1": betas[0],
        "adam_beta2": betas[1], "adam_eps": opt.get("eps", 1e-8), "weight_decay": opt.get("weight_decay", 0.0),
        "clip_grad": (wrap.get("max_grad_norm", 1.0) if wrap.get("use_clip_grad", False) else 0.0),
        "global_batch_size": mbs * dp * acc * micro_num * interleave if mbs else None,
        "micro_batch_size": mbs, "micro_batch_interleave_num": interleave,
        "tp": pc.get("model_parallel", 1), "pp": pp, "dp": dp, "cp": pc.get("context_parallel", 1),
        "sequence_parallel": bool(pc.get("use_seq_parallel", False)), "ep": pc.get("expert_parallel", 1),
        "optimizer_parallel": bool(_get(cfg, "parallel.enable_parallel_optimizer", False)),
        "optimizer": _MF_OPTIMIZER.get(otype, otype) if otype else NOT_READ,
        "seed": cfg.get("seed"), "data_seed": _data_seed(cfg),
        "pad_token_id": mc.get("pad_token_id"), "eos_token_id": mc.get("eos_token_id"),
    }


def _truth_or(v: Any) -> Any:
    from models.mindformers_yaml import truth

    t = truth(v)
    return v if t is None else t


def _data_seed(cfg: dict[str, Any]) -> Any:
    """The seed MindFormers' Megatron-format dataset shuffles with (train_dataset.data_loader.config.seed of
    a BlendedMegatronDatasetDataLoader); None for other loaders (a replayed or MindRecord dataset)."""
    loader = _get(cfg, "train_dataset.data_loader") or {}
    if not isinstance(loader, dict) or loader.get("type") != "BlendedMegatronDatasetDataLoader":
        return None
    seed = _get(loader, "config.seed")
    return NOT_READ if seed is None else seed


def mindformers_common(cfg: dict[str, Any]) -> dict[str, Any]:
    """Common keys from a MindFormers YAML: 2.x mcore (:func:`mcore_common`) or legacy (1.x Llama)."""
    if is_mcore_yaml(cfg):
        return mcore_common(cfg)
    return legacy_common(cfg)


def legacy_common(cfg: dict[str, Any]) -> dict[str, Any]:
    """Legacy (1.x, ``use_legacy: True``) Llama-style YAML keys."""
    mc = _get(cfg, "model.model_config", {}) or {}
    pc = cfg.get("parallel_config") or {}
    moe = cfg.get("moe_config") or mc.get("moe_config") or {}
    opt = cfg.get("optimizer") or {}
    lrs = cfg.get("lr_schedule") or {}
    wrap = cfg.get("runner_wrapper") or {}
    runner = cfg.get("runner_config") or {}
    h, nh = mc.get("hidden_size"), mc.get("num_heads")
    ffn = mc.get("intermediate_size")
    if ffn is None and h:
        ffn = _llama_ffn(h, mc.get("multiple_of", 256), mc.get("ffn_dim_multiplier"))
    # 1.x optimizers (AdamWeightDecay, FP32StateAdamWeightDecay, FusedAdamWeightDecay) take beta1 / beta2
    betas = opt.get("betas") or [opt.get("beta1", 0.9), opt.get("beta2", 0.999)]
    warm_steps, warm_ratio = _warmup(lrs, zero_steps_zero_ratio=True)
    dp, pp = pc.get("data_parallel", 1), pc.get("pipeline_stage", 1)
    mbs = _first(runner.get("batch_size"), mc.get("batch_size"), _get(cfg, "train_dataset.batch_size"))
    acc = runner.get("gradient_accumulation_steps", 1) or 1
    micro_num = pc.get("micro_batch_num", 1) if pp and pp > 1 else 1
    experts = moe.get("expert_num", 1) or 1
    experts = experts if experts > 1 else 0
    aux = moe.get("aux_loss_factor")
    if aux is None and moe.get("aux_loss_factors"):
        aux = sum(moe["aux_loss_factors"])
    return {
        "num_layers": mc.get("num_layers"), "num_heads": nh,
        "num_query_groups": mc.get("n_kv_heads") or nh, "hidden_size": h, "ffn_hidden_size": ffn,
        "vocab_size": mc.get("vocab_size"), "vocab_size_unpadded": None, "seq_length": mc.get("seq_length"),
        "norm_type": "RMSNorm", "norm_eps": mc.get("rms_norm_eps", 1e-5),
        "activation": {"silu": "swiglu", "swiglu": "swiglu", None: "swiglu"}.get(mc.get("hidden_act"),
                                                                               mc.get("hidden_act")),
        "position_embedding": "rope", "rotary_base": mc.get("theta", 10000.0),
        "hidden_dropout": mc.get("hidden_dropout_prob", mc.get("hidden_dropout", 0.0)),
        "attention_dropout": mc.get("attention_dropout_prob", mc.get("attention_dropout", 0.0)),
        "lr": _first(lrs.get("learning_rate"), opt.get("learning_rate")), "min_lr": lrs.get("lr_end", 0.0),
        "warmup_steps": warm_steps, "warmup_ratio": warm_ratio,
        "decay_style": _MF_LR.get(lrs.get("type"), lrs.get("type")), "adam_beta1": betas[0],
        "adam_beta2": betas[1], "adam_eps": opt.get("eps", 1e-8), "weight_decay": opt.get("weight_decay", 0.0),
        "weight_decay_applies_to": "2-D weights (bias and 1-D skipped)",
        "clip_grad": (wrap.get("max_grad_norm", 1.0) if wrap.get("use_clip_grad", False) else 0.0),
        "global_batch_size": mbs * dp * acc * micro_num if mbs else None, "micro_batch_size": mbs,
        "compute_dtype": mc.get("compute_dtype", "float16"), "params_dtype": mc.get("param_init_type", "float16"),
        "tp": pc.get("model_parallel", 1), "pp": pp, "dp": dp, "cp": pc.get("context_parallel", 1),
        "sequence_parallel": bool(pc.get("use_seq_parallel", False)), "ep": pc.get("expert_parallel", 1),
        "num_experts": experts, "moe_topk": moe.get("num_experts_chosen") if experts else None,
        "moe_aux_loss_coeff": aux if experts else None,
        "moe_capacity_factor": moe.get("capacity_factor") if experts else None,
        "untie_embeddings": not bool(mc.get("tie_word_embeddings", False)),
        "bias_linear": bool(mc.get("qkv_has_bias", False) or mc.get("attn_proj_has_bias", False)),
        "optimizer_parallel": bool(_get(cfg, "parallel.enable_parallel_optimizer", False)),
        "seed": cfg.get("seed"), "data_seed": _data_seed(cfg),
        "pad_token_id": mc.get("pad_token_id"), "eos_token_id": mc.get("eos_token_id"),
        "pipeline_layers": mindformers_pipeline_layers(cfg, mc.get("num_layers")),
        **_legacy_extra(cfg, mc, h, nh),
    }


def _legacy_extra(cfg: dict[str, Any], mc: dict[str, Any], h: Any, nh: Any) -> dict[str, Any]:
    """The newer checklist keys where a legacy YAML sets them; the rest stay NOT_READ."""
    out: dict[str, Any] = {"kv_channels": h // nh if h and nh else NOT_READ,
                           "qkv_bias": bool(mc.get("qkv_has_bias", False)),
                           "qk_layernorm": False}          # the legacy Llama has no q/k norm
    if "softmax_compute_type" in mc:
        out["softmax_in_fp32"] = _dtype(mc["softmax_compute_type"]) == "float32"
    for key, src in (("layernorm_compute_dtype", "layernorm_compute_type"), ("rotary_dtype", "rotary_dtype")):
        if src in mc:
            out[key] = _dtype(mc[src])
    # LlamaConfig: residual_dtype None -> the compute dtype (llama_config.py)
    res = mc.get("residual_dtype")
    compute = _dtype(mc.get("compute_dtype", "float16"))
    out["fp32_residual_connection"] = (_dtype(res) == "float32") if res is not None else compute == "float32"
    out["flash_attention"] = bool(_truth_or(mc.get("use_flash_attention", False)))
    if "initializer_range" in mc:
        out["init_method_std"] = mc["initializer_range"]
    otype = str((cfg.get("optimizer") or {}).get("type", "")).lower()
    if otype:
        out["optimizer"] = _MF_OPTIMIZER.get(otype, otype)
    out["micro_batch_interleave_num"] = cfg.get("micro_batch_interleave_num", 1) or 1
    out["deterministic"] = _deterministic(cfg)
    return out


# keys that only inform (parallel layout may legitimately differ between the two runs)
_INFO_ONLY = {"dp", "vocab_size_unpadded", "warmup_steps", "optimizer_parallel"}
# compared only where both sides state them (a replayed dataset has no shuffle seed)
_BOTH_OR_NONE = {"data_seed"}
# a difference is real but not a numerical mismatch of the model: a check, with why
_CHECK_NOTES = {
    "seed": "seeds differ; the two frameworks' generators differ anyway, so load converted weights and keep "
            "dropout off rather than rely on the seed",
    "data_seed": "Megatron's GPTDataset shuffles with --seed, MindFormers' BlendedMegatronDatasetDataLoader with "
                 "train_dataset.data_loader.config.seed: different seeds train on different samples each step "
                 "(replay Megatron's batches, or set the same seed)",
    "pipeline_layers": "layers per pipeline stage differ (MindFormers offset vs Megatron's split): per-rank "
                       "dumps hold different layers and the global grad norm sums in another order",
    "flash_attention": "attention kernels differ (Megatron --attention-backend / --use-flash-attn, auto picks a "
                       "flash or fused kernel under bf16/fp16; MindFormers use_flash_attention): they round "
                       "differently; use the same kind on both sides while aligning",
}
# precision settings whose effect depends on the kernel Megatron runs (fused / flash kernels compute in fp32)
_KERNEL_DEPENDENT = {
    "softmax_in_fp32": "Megatron's --attention-softmax-in-fp32 only matters for its unfused softmax (flash and "
                       "fused kernels compute softmax in fp32); check which attention path the baseline runs",
    "layernorm_compute_dtype": "megatron-core computes norm statistics in fp32; MindFormers computes them in "
                               "this dtype",
    "rotary_dtype": "megatron-core computes RoPE frequencies in fp32; MindFormers computes them in this dtype",
    "rope_fusion": "fused and unfused RoPE kernels round differently; switch fusion the same way on both "
                   "sides (or off) while aligning",
    "swiglu_fusion": "fused and unfused SwiGLU kernels round differently; switch fusion the same way on both "
                     "sides (or off) while aligning",
}
# parallel layout: a difference is allowed (the toolkit compares across layouts) but worth a look
_LAYOUT = {"tp", "pp", "cp", "ep", "sequence_parallel", "micro_batch_size"}


REPLAY = "MegatronReplayDataset"


def replay_dir(cfg: dict[str, Any]) -> tuple[str | None, Any, Any] | None:
    """(data_dir, steps, rank) of a YAML whose training data is Megatron's replayed batches
    (dumpers.mindformers_replay.MegatronReplayDataset, as docs/mindformers-launch.md writes it); None when the
    YAML trains on anything else."""
    task = cfg.get("train_dataset_task") or {}
    loader = _get(cfg, "train_dataset.data_loader") or {}
    names = [task.get("type"), task.get("auto_register"), loader.get("type") if isinstance(loader, dict) else None]
    if not any(isinstance(n, str) and n.rsplit(".", 1)[-1] == REPLAY for n in names):
        return None
    sources = [task.get("dataset_config") or {}, cfg.get("train_dataset") or {},
               loader if isinstance(loader, dict) else {}]
    sources = [d for d in sources if isinstance(d, dict)]
    data_dir = _first(*(d.get("data_dir") for d in sources), *(d.get("dataset_dir") for d in sources))
    steps = _first(*(d.get("steps") for d in sources))
    rank = _first(*(d.get("rank") for d in sources))
    return (str(data_dir) if data_dir is not None else None), steps, rank


#: How many folders above a config (or a run store) a relative path in it is looked for.
_UP = 3


def config_bases(where: str | Path, is_file: bool) -> list[Path]:
    """Folders a relative path inside a config resolves against, nearest first: the config file's folder
    (``is_file``) or the run store that recorded it, then the folders above (MindFormers resolves paths
    from the folder it was launched in, which holds the YAML's folder or the run's output)."""
    start = Path(where).resolve()
    start = start.parent if is_file else start
    return [start, *list(start.parents)[:_UP]]


def resolve_relative(value: str, bases: list[Path] | None) -> str:
    """``value`` (a path a config names) as the path to read: absolute as it is; relative, against the first
    of ``bases`` where it exists (else the first of them), never against the working folder."""
    p = Path(value).expanduser()
    if p.is_absolute() or not bases:
        return str(p)
    for base in bases:
        if (base / p).exists():
            return os.path.normpath(base / p)
    return os.path.normpath(bases[0] / p)


def replay_shape(data_dir: str, steps: Any = None, rank: Any = None) -> dict[str, Any]:
    """What a replay of ``data_dir`` feeds one MindFormers rank per step: ``rows`` (samples: Megatron's
    micro-batches of that DP rank, concatenated), ``seq_length``, ``micro_batches`` (when the run store says),
    the store's ``dp``, read from the file headers of the first replayed step (a run store or the
    ``step_N/rank_R`` npy folders). BadInput (one line) when the folder holds no batch."""
    from core.errors import BadInput
    from runstore import STEP_DIR, RunReader, seed_steps
    from runstore.h5file import open_h5
    from runstore.seed_layout import npy_header

    root = Path(data_dir)
    placeholder = re.search(r"@[A-Z_]+@", root.name)
    if placeholder and not root.exists():   # the shipped example YAML, not yet filled in
        raise BadInput(f"data_dir is the example's placeholder {placeholder.group(0)}: set it to the baseline run "
                       "store the candidate replays")
    if not root.is_dir():
        raise BadInput(f"{root}: the replayed batch folder does not exist")
    rank = rank if isinstance(rank, int) and not isinstance(rank, bool) else 0
    wanted = [s for s in steps if isinstance(s, int)] if isinstance(steps, list) else []
    out: dict[str, Any] = {"rank": rank}
    if (root / STEP_DIR).is_dir():
        reader = RunReader(root)
        available = reader.array_steps()
        step = wanted[0] if wanted else (available[0] if available else None)
        if step is None or step not in available:
            raise BadInput(f"{root}: no batches of step {step} in the run store")
        # tokens live on the first pipeline stage and labels on the last: any rank of this DP rank holds one
        dp_rank = reader.rank_info(rank).get("dp_rank")
        ranks = [rank] + [r for r in reader.array_ranks(step)
                          if r != rank and dp_rank is not None and reader.rank_info(r).get("dp_rank") == dp_rank]
        for r in ranks:
            if r not in reader.array_ranks(step):
                continue
            with open_h5(reader.step_file(step, r)) as h5:
                for name in ("batch/tokens", "batch/labels"):
                    if name in h5:
                        shape = h5[name].shape
                        micro = h5[name].attrs.get("micro_batches")
                        out.update(step=step, shape=tuple(int(n) for n in shape), layout="run store",
                                   micro_batches=int(micro) if micro is not None else None)
                        break
            if "shape" in out:
                break
        dp = (reader.meta.get("parallel") or {}).get("dp")
        out["dp"] = dp if isinstance(dp, int) else None
    else:
        seed = seed_steps(root)
        step = wanted[0] if wanted else (min(seed) if seed else None)
        folder = seed.get(step, {}).get(rank) if step is not None else None
        if folder is not None:
            for name in ("tokens", "labels"):
                if (folder / f"{name}.npy").is_file():
                    out.update(step=step, shape=npy_header(folder / f"{name}.npy")[0], layout="step_N/rank_R folders",
                               micro_batches=None, dp=len(seed[step]))
                    break
    if "shape" not in out:
        raise BadInput(f"{root}: no tokens or labels of rank {rank} to replay (step {step})")
    shape = out.pop("shape")
    if len(shape) != 2:
        raise BadInput(f"{root}: step {out['step']} rank {rank}: tokens of shape {shape}, not [samples, sequence]")
    out["rows"], out["seq_length"] = shape
    return out


def _replay_rows(cfg: dict[str, Any], mg: dict[str, Any], mf: dict[str, Any],
                 bases: list[Path] | None = None) -> dict[str, tuple[str, str]]:
    """A replay YAML's batch keys from the replayed store: one dataset row is a whole Megatron step of
    ``rows`` samples, so the YAML's batch_size counts steps, not samples. Returns {key: (status or "",
    note)} for the rows it set (status "" keeps the usual comparison). A relative ``data_dir`` resolves
    against ``bases`` (config_bases: the YAML's folder or the store that recorded it)."""
    from core.errors import BadInput

    found = replay_dir(cfg)
    if found is None:
        return {}
    data_dir, steps, rank = found
    if data_dir is not None:
        data_dir = resolve_relative(data_dir, bases)
    mbs = mf.get("micro_batch_size")
    try:
        if data_dir is None:
            raise BadInput("the YAML names no data_dir")
        got = replay_shape(data_dir, steps, rank)
    except BadInput as exc:
        note = (f"the YAML replays Megatron's batches ({REPLAY}) but {exc}: its global batch is the replayed "
                f"rows per step x data_parallel, not the YAML's batch_size (which counts whole steps); check by hand")
        mf["global_batch_size"] = mf["micro_batch_size"] = NOT_READ
        return {"global_batch_size": ("check", note), "micro_batch_size": ("check", note)}
    rows, seq = got["rows"], got["seq_length"]
    # MegatronReplayDataset hands the network each row as it is (never batched again: batch_size does not
    # count); the network splits it into micro_batch_num (pipeline) x micro_batch_interleave_num pieces
    pc = cfg.get("parallel_config") or {}
    dp = mf.get("dp") if isinstance(mf.get("dp"), int) else 1
    acc = (cfg.get("runner_config") or {}).get("gradient_accumulation_steps", 1) or 1
    split = (pc.get("micro_batch_num", 1) or 1 if (mf.get("pp") or 1) > 1 else 1) * (
        mf.get("micro_batch_interleave_num") or 1)
    where = (f"read from the replayed {got['layout']} {data_dir} (step {got['step']}, rank {got['rank']}: "
             f"{rows} x {seq} tokens per step")
    micro = got.get("micro_batches")
    where += f", {micro} Megatron micro-batches" if micro else ""
    where += f"; the store's data parallel {got['dp']})" if got.get("dp") else ")"
    # under msrun (use_parallel) or with data_parallel in its dataset_config, the replay re-splits the store's
    # global batch (rows x its DP) over this DP by sample (dumpers.mindformers_replay): compare global batches
    task = (cfg.get("train_dataset_task") or {}).get("dataset_config") or {}
    dp = task.get("data_parallel") if isinstance(task.get("data_parallel"), int) else dp
    if (cfg.get("use_parallel") or "data_parallel" in task) and isinstance(got.get("dp"), int) and dp:
        total = rows * got["dp"]
        mf["global_batch_size"] = total * acc if total % dp == 0 else NOT_READ
        out = {"global_batch_size": ("" if total % dp == 0 else "mismatch",
                                     f"MindFormers: the store's global batch of {total} samples ({rows} per rank x its "
                                     f"data parallel {got['dp']}) re-split by sample over data_parallel {dp}"
                                     + (f" x {acc} accumulation steps" if acc != 1 else "")
                                     + ("" if total % dp == 0 else ", which does not divide it")
                                     + f", {where}; {REPLAY} hands each rank {total // dp if total % dp == 0 else '?'} "
                                     f"samples a step (the YAML's batch_size {mbs} does not batch them)")}
        rows = total // dp if total % dp == 0 else rows
    else:
        mf["global_batch_size"] = rows * dp * acc
        out = {"global_batch_size": ("", f"MindFormers: {rows} samples per replayed row x data_parallel {dp}"
                                         + (f" x {acc} accumulation steps" if acc != 1 else "")
                                         + f", {where}; one row of {REPLAY} is one whole Megatron step of one rank "
                                         f"(the YAML's batch_size {mbs} does not batch it)")}
        if isinstance(got.get("dp"), int) and got["dp"] > dp:   # one process, a DP > 1 store, no data_parallel
            out["global_batch_size"] = ("mismatch", out["global_batch_size"][1] + (
                f"; this candidate trains rank {got['rank']}'s share only: set data_parallel: {dp} in the replay's "
                f"dataset block (train_dataset_task.dataset_config) to train the store's whole global batch of "
                f"{rows * got['dp']} samples, re-split by sample (docs/own-cluster.md)"))
    mf["micro_batch_size"] = rows // split if rows % split == 0 else NOT_READ
    mg_mbs = mg.get("micro_batch_size")
    if isinstance(mg_mbs, int) and mg_mbs != mf["micro_batch_size"]:
        how = "in one forward" if split == 1 else f"in {split} pieces"
        out["micro_batch_size"] = ("check", f"MindFormers runs each replayed step's {rows} rows {how}, Megatron in "
                                            f"micro-batches of {mg_mbs}: the loss is averaged over other groups "
                                            f"of samples ({where})")
    mf["replay_seq_length"] = seq
    mg["replay_seq_length"] = mg.get("seq_length")
    out["replay_seq_length"] = ("", f"the replayed batches' sequence length ({where})")
    return out


@dataclass
class Row:
    key: str
    megatron: Any
    mindformers: Any
    status: str        # match | mismatch | check
    note: str = ""


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, str) and isinstance(b, str):
        return a.lower().replace("_", "").replace("-", "") == b.lower().replace("_", "").replace("-", "")
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-12)
    return a == b


def compare_configs(mg_args: dict[str, Any], mf_cfg: dict[str, Any],
                    base: list[Path] | None = None) -> tuple[list[Row], StageResult]:
    """Rows for every common key, and the findings: mismatch -> fail, check by hand -> warn. ``base``: the
    folders relative paths in the MindFormers config resolve against (config_bases), not the working folder."""
    mg, defaulted = megatron_common(mg_args)
    mf = mindformers_common(mf_cfg)
    replay = _replay_rows(mf_cfg, mg, mf, base)     # a replay YAML: the batch keys come from the replayed store
    rows: list[Row] = []
    for key in mg:
        a, b = mg[key], mf.get(key, NOT_READ)
        if key in _INFO_ONLY:
            continue
        if key in replay:
            status, note = replay[key]
            if status:
                rows.append(Row(key, a, "not read" if b is NOT_READ else b, status, note))
                continue
            if a is None or b is None or b is NOT_READ:
                rows.append(Row(key, a, "not read" if b is NOT_READ else b, "check", f"set on one side only; {note}"))
            else:
                rows.append(Row(key, a, b, "match" if _equal(a, b) else "mismatch", note))
            continue
        if a is None and (b is None or b is NOT_READ):
            continue
        if key in _BOTH_OR_NONE and (a is None or b is None):
            continue
        if b is NOT_READ:
            rows.append(Row(key, a, "not read", "not read", "the YAML does not set it (its value comes from "
                                                         "MindFormers' model defaults): check by hand"))
        elif a is None or b is None:
            rows.append(Row(key, a, b, "check", "set on one side only"))
        elif _equal(a, b):
            rows.append(Row(key, a, b, "match"))
        elif key in _LAYOUT:
            rows.append(Row(key, a, b, "check", "parallel layout differs; local norms and losses still compare "
                                                "(TP shards are combined) but check determinism settings"))
        elif key in _CHECK_NOTES:
            rows.append(Row(key, a, b, "check", _CHECK_NOTES[key]))
        elif key in _KERNEL_DEPENDENT:
            rows.append(Row(key, a, b, "check", _KERNEL_DEPENDENT[key]))
        elif key == "params_dtype":
            rows.append(Row(key, a, b, "check", "parameter dtype differs: Megatron keeps fp32 master weights in "
                                                "its optimizer under --bf16; compare the master-weight dtype"))
        else:
            note = "Megatron-LM default (not set explicitly)" if key in defaulted else ""
            rows.append(Row(key, a, b, "mismatch", note))
    rows.extend(_advice(mg, {k: None if v is NOT_READ else v for k, v in mf.items()}))
    from align.checks.vocab import explain_vocab  # the padded vocabulary and the number the YAML needs
    explain_vocab(rows, mg_args)
    res = StageResult(STAGE)
    for r in rows:
        if r.status in ("match", "not read"):
            continue
        verdict = "fail" if r.status == "mismatch" else "warn"
        res.add(Finding(STAGE, verdict, r.key, r.status, _show(r.mindformers), _show(r.megatron),
                        f"{r.key}: Megatron {_show(r.megatron)} vs MindFormers {_show(r.mindformers)}"
                        + (f" ({r.note})" if r.note else "")))
    if not res.findings:
        res.verdict = "pass"
    res.details = {"rows": [r.__dict__ for r in rows],
                   "counts": {s: sum(r.status == s for r in rows) for s in ("match", "mismatch", "check",
                                                                               "not read")}}
    return rows, res


def _advice(mg: dict[str, Any], mf: dict[str, Any]) -> list[Row]:
    """The accuracy guide's known traps, as check-by-hand rows."""
    out = []
    for side, c in (("Megatron", mg), ("MindFormers", mf)):
        v = c.get("vocab_size")
        if isinstance(v, int) and v % 2 == 1:
            out.append(Row("advice.odd_vocab_size", mg.get("vocab_size"), mf.get("vocab_size"), "check",
                           f"{side} vocab size {v} is odd: pad it (Megatron pads to make_vocab_size_divisible_by"
                           " x TP) and use the same padded size on both sides"))
        if (c.get("hidden_dropout") or 0) > 0 or (c.get("attention_dropout") or 0) > 0:
            out.append(Row("advice.dropout_on", (mg["hidden_dropout"], mg["attention_dropout"]),
                           (mf["hidden_dropout"], mf["attention_dropout"]), "check",
                           f"dropout is on in {side}: random masks differ between frameworks; set hidden and "
                           "attention dropout to 0 for alignment runs"))
        if c.get("moe_aux_loss_coeff"):
            out.append(Row("advice.aux_loss_on", mg.get("moe_aux_loss_coeff"), mf.get("moe_aux_loss_coeff"),
                           "check", f"MoE aux loss is on in {side}: it adds to the loss differently per "
                           "framework; switch it off to align the LM loss first"))
        if c.get("optimizer_parallel"):
            out.append(Row("advice.optimizer_parallel_on", mg.get("optimizer_parallel"),
                           mf.get("optimizer_parallel"), "check",
                           f"optimizer parallel / distributed optimizer is on in {side}: turn it off while "
                           "aligning (it changes reduction order and sharded state)"))
        cf, ne, k = c.get("moe_capacity_factor"), c.get("num_experts"), c.get("moe_topk")
        if ne and cf is not None and cf > 0 and (cf < 1.0 or (k and cf < ne / k)):
            out.append(Row("advice.capacity_factor", mg.get("moe_capacity_factor"), mf.get("moe_capacity_factor"),
                           "check", f"{side} capacity factor {cf} can drop tokens ({ne} experts, top-{k}); use "
                           "dropless routing or a factor >= experts/top-k on both sides"))
    if mf.get("pad_token_id") is not None and mf.get("pad_token_id") == mf.get("eos_token_id"):
        out.append(Row("advice.pad_equals_eos", None, mf["pad_token_id"], "check",
                       "pad_token_id == eos_token_id: with --append-eod every EOD gets masked out of the loss; "
                       "check the loss mask (align check-data)"))
    out.extend(_guide_rows(mg, mf))
    if (mg.get("weight_decay") or 0) > 0 or (mf.get("weight_decay") or 0) > 0:
        out.append(Row("advice.weight_decay_params", mg["weight_decay_applies_to"], mf["weight_decay_applies_to"],
                       "match" if mg["weight_decay_applies_to"] == mf["weight_decay_applies_to"] else "check",
                       "custom PyTorch optimizers often decay every weight; verify with the optimizer stage"))
    return out


def _guide_rows(mg: dict[str, Any], mf: dict[str, Any]) -> list[Row]:
    """Rows of the accuracy guide's checklists beyond plain key equality (MoE, determinism, MLA)."""
    out = []
    if mg.get("deterministic") is False or mf.get("deterministic") is False:
        out.append(Row("advice.deterministic", mg.get("deterministic"), mf.get("deterministic"), "check",
                       "alignment runs need determinism on both sides: Megatron --deterministic-mode "
                       "(+ NCCL_ALGO=Ring, CUBLAS_WORKSPACE_CONFIG=:4096:8), MindFormers context.deterministic: ON "
                       "(+ HCCL_DETERMINISTIC=true, ASCEND_LAUNCH_BLOCKING=1)"))
    if mg.get("num_experts") or mf.get("num_experts"):
        if mf.get("moe_token_drop_policy") == "position" or mg.get("moe_token_drop_policy") == "position":
            out.append(Row("advice.moe_sdrop", mg.get("moe_token_drop_policy"), mf.get("moe_token_drop_policy"),
                           "check", "token dropping by position (sdrop) drops different tokens than by "
                           "probability; align with dropless routing first"))
        if mg.get("moe_pad_to_capacity") or mf.get("moe_pad_to_capacity"):
            out.append(Row("advice.moe_pad_to_capacity", mg.get("moe_pad_to_capacity"),
                           mf.get("moe_pad_to_capacity"), "check", "padding expert inputs to capacity changes "
                           "the GEMM shapes and what is dropped; switch it off on both sides while aligning"))
        for side, c in (("Megatron", mg), ("MindFormers", mf)):
            if c.get("moe_router_dtype") not in (None, "float32", "float64"):
                out.append(Row("advice.moe_router_dtype", mg.get("moe_router_dtype"), mf.get("moe_router_dtype"),
                               "check", f"{side} computes the router in {c.get('moe_router_dtype')}: top-k picks "
                               "flip on near ties; use fp32 routers (Megatron --moe-router-dtype fp32, "
                               "MindFormers router_dense_type: float32)"))
        if (mg.get("moe_shared_expert_intermediate_size") or mf.get("moe_shared_expert_intermediate_size")) and (
                mg.get("moe_shared_expert_gate") != mf.get("moe_shared_expert_gate")):
            out.append(Row("advice.shared_expert_gating", mg.get("moe_shared_expert_gate"),
                           mf.get("moe_shared_expert_gate"), "check", "shared-expert gating differs: Megatron "
                           "--moe-shared-expert-gate vs MindFormers use_shared_expert_gating"))
    if mg.get("multi_latent_attention") or mf.get("multi_latent_attention"):
        a, b = mg.get("rope_scaling_factor"), mf.get("rope_scaling_factor")
        plain = a == 1.0 and b == 1.0
        out.append(Row("advice.mla_softmax_scale", a, b, "match" if plain else "check",
                       "MLA softmax scale: MindFormers uses mscale, Megatron mscale_all_dim; they differ unless "
                       "rotary scaling is 1" + (" (it is 1 on both sides)" if plain else "")))
    return out


def _show(v: Any) -> Any:
    return v if isinstance(v, (int, float, str, bool)) or v is None else str(v)


def format_table(rows: list[Row]) -> str:
    w = max([len(r.key) for r in rows] + [10])
    lines = [f"{'key':<{w}}  {'megatron':<22} {'mindformers':<22} status    note", "-" * (w + 70)]
    for r in rows:
        lines.append(f"{r.key:<{w}}  {str(r.megatron):<22} {str(r.mindformers):<22} {r.status:<9} {r.note}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------------



