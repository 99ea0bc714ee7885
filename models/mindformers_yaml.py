"""Reading a parsed MindFormers YAML: the keys family detection needs, and the checklist reads too.

Framework-free (the YAML as a dict). MindFormers 2.x (mcore) accepts several spellings of each model key
(mindformers/parallel_core/transformer_config_utils.py COMMON_CONFIG_MAPPING and the per-model converters):
:data:`MCORE_ALIASES` maps one name to all of them; a key the YAML does not set is :data:`NOT_READ`.
"""

from __future__ import annotations

from typing import Any


class _NotRead:
    """A MindFormers key the YAML does not set: its value comes from model-class defaults we do not guess."""

    def __repr__(self) -> str:
        return "not read"

    __str__ = __repr__


NOT_READ: Any = _NotRead()

# MindFormers 2.x (mcore) model_config keys -> one name, with every alias MindFormers accepts for it
# (mindformers/parallel_core/transformer_config_utils.py COMMON_CONFIG_MAPPING and the per-model converters).
MCORE_ALIASES: dict[str, tuple[str, ...]] = {
    "num_layers": ("num_layers", "num_hidden_layers", "n_layer"),
    "num_heads": ("num_attention_heads", "num_heads", "n_head"),
    "num_query_groups": ("num_query_groups", "num_key_value_heads", "n_kv_heads"),
    "hidden_size": ("hidden_size",),
    "ffn_hidden_size": ("ffn_hidden_size", "intermediate_size"),
    "kv_channels": ("kv_channels", "head_dim"),
    "vocab_size": ("vocab_size",),
    "seq_length": ("seq_length",),
    "norm_type": ("normalization",),
    "norm_eps": ("layernorm_epsilon", "rms_norm_eps", "layer_norm_epsilon"),
    "position_embedding": ("position_embedding_type", "extend_method"),
    "rotary_base": ("rotary_base", "rope_theta", "theta"),
    "hidden_dropout": ("hidden_dropout",),
    "attention_dropout": ("attention_dropout",),
    "qk_layernorm": ("qk_layernorm", "use_qk_norm"),
    "qkv_bias": ("add_qkv_bias", "attention_bias", "qkv_has_bias"),
    "bias_linear": ("add_bias_linear",),
    "init_method_std": ("init_method_std", "initializer_range"),
    # MindFormers 2.x maps both to fp32_residual_connection through is_float_32 ("fp32"/"float32"/True);
    # Qwen3 YAMLs of MindFormers 2.x write `residual_dtype: "float32"` (transformer_config_utils.py)
    "fp32_residual_connection": ("fp32_residual_connection", "residual_dtype"),
    "compute_dtype": ("compute_dtype",),
    "params_dtype": ("params_dtype", "param_init_type"),
    "softmax_compute_dtype": ("softmax_compute_dtype", "attention_softmax_in_fp32"),
    "layernorm_compute_dtype": ("layernorm_compute_dtype",),
    "rotary_dtype": ("rotary_dtype",),
    "num_experts": ("num_moe_experts", "num_experts", "expert_num", "n_routed_experts"),
    "moe_topk": ("moe_router_topk", "num_experts_per_tok", "num_experts_chosen"),
    "moe_ffn_hidden_size": ("moe_ffn_hidden_size", "moe_intermediate_size"),
    "moe_aux_loss_coeff": ("moe_aux_loss_coeff",),
    "moe_capacity_factor": ("moe_expert_capacity_factor", "capacity_factor"),
    "moe_router_dtype": ("moe_router_dtype", "router_dense_type"),
    "moe_token_drop_policy": ("moe_token_drop_policy", "enable_sdrop"),
    "moe_router_load_balancing_type": ("moe_router_load_balancing_type",),
    "moe_router_pre_softmax": ("moe_router_pre_softmax",),
    "moe_norm_topk_prob": ("norm_topk_prob",),
    "moe_router_topk_scaling_factor": ("moe_router_topk_scaling_factor", "routed_scaling_factor"),
    "moe_router_score_function": ("moe_router_score_function", "scoring_func", "use_gating_sigmoid"),
    "moe_router_enable_expert_bias": ("moe_router_enable_expert_bias", "balance_via_topk_bias"),
    "moe_shared_expert_intermediate_size": ("moe_shared_expert_intermediate_size",),
    "moe_shared_expert_gate": ("use_shared_expert_gating",),
    "moe_pad_to_capacity": ("use_pad_tokens", "enable_gmm_safe_tokens"),
    "mtp_num_layers": ("mtp_num_layers", "mtp_depth", "num_nextn_predict_layers"),
    "mtp_loss_scaling_factor": ("mtp_loss_scaling_factor", "mtp_loss_factor"),
    "multi_latent_attention": ("multi_latent_attention",),
    "q_lora_rank": ("q_lora_rank",),
    "kv_lora_rank": ("kv_lora_rank",),
    "qk_head_dim": ("qk_head_dim", "qk_nope_head_dim"),
    "qk_pos_emb_head_dim": ("qk_pos_emb_head_dim", "qk_rope_head_dim"),
    "v_head_dim": ("v_head_dim",),
    "rope_fusion": ("apply_rope_fusion", "use_fused_rope"),
    "swiglu_fusion": ("bias_swiglu_fusion", "use_fused_swiglu"),
    "flash_attention": ("use_flash_attention",),
}


def get(d: Any, dotted: str, default: Any = None) -> Any:
    """``d["a"]["b"]`` for ``"a.b"``; ``default`` where a level is missing or not a dict."""
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return default
        d = d[part]
    return d


def model_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The YAML's ``model.model_config`` block ({} when absent)."""
    return get(cfg, "model.model_config", {}) or {}


def mcore_value(mc: dict[str, Any], key: str) -> Any:
    """The first alias of ``key`` that ``mc`` sets (not None), else NOT_READ."""
    for alias in MCORE_ALIASES[key]:
        if alias in mc and mc[alias] is not None:
            return mc[alias]
    return NOT_READ


def is_float32(v: Any) -> Any:
    """MindFormers' ``is_float_32``: a dtype string ("fp32", "float32", also "mstype.float32") or a bool flag
    -> bool; anything else is returned unchanged (the caller shows it, never guesses)."""
    if isinstance(v, bool):
        return v
    if isinstance(v, str):
        t = v.strip().lower().replace("mstype.", "").replace("torch.", "")
        if t in ("true", "false"):
            return t == "true"
        return t in ("fp32", "float32")
    return v


def truth(v: Any) -> bool | None:
    """A YAML boolean, also written as a string ("False", "true"); None when it is neither."""
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in ("true", "false"):
        return v.strip().lower() == "true"
    return None


def is_mcore_yaml(cfg: dict[str, Any]) -> bool:
    """A MindFormers 2.x mcore config: ``use_legacy: False`` or HF-style keys in model_config."""
    mc = model_config(cfg)
    return cfg.get("use_legacy") is False or any(k in mc for k in ("num_hidden_layers", "num_attention_heads"))


def expert_count(cfg: dict[str, Any]) -> Any:
    """The routed experts of an mcore YAML's model: the count it sets (above 1), NOT_READ for an MoE model
    whose count comes from the model class (it sets MoE keys but no count; never 0), else 0 (no MoE)."""
    mc = model_config(cfg)
    experts = mcore_value(mc, "num_experts")
    moe_keys_set = any(mcore_value(mc, k) is not NOT_READ for k in MCORE_ALIASES
                       if k.startswith("moe_") and k != "moe_topk") \
        or any(k.startswith(("moe_", "n_group", "topk_group")) for k in mc)
    if experts is NOT_READ and moe_keys_set:
        return NOT_READ
    if experts is NOT_READ or not experts or experts <= 1:
        return 0
    return experts
