"""The tiny mcore models both frameworks build, as plain data: framework-free, so the Megatron runner (torch
only) and the MindFormers side (:mod:`demo.mindformers_mcore_cpu`) read the same sizes without importing
each other's framework.

:class:`McoreSpec` describes the model; :func:`megatron_extra` / :func:`megatron_config_kwargs` turn it into
demo.megatron_cpu's TinyLlamaConfig; :func:`mcore_spec` derives it from the demo's run spec.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

MODEL_KINDS = ("dense", "moe", "mla")
# The mapping preset (mapping/presets) of each kind against a megatron-core baseline.
MCORE_PRESETS = {k: f"megatron_core__mindformers_mcore_{k}" for k in MODEL_KINDS}


@dataclass
class McoreSpec:
    """A tiny model both frameworks build: Qwen3-style dense (GQA, RoPE, RMSNorm, SwiGLU, q/k layernorm)."""

    kind: str = "dense"
    vocab_size: int = 64
    hidden_size: int = 32
    num_layers: int = 2
    num_attention_heads: int = 4
    num_query_groups: int = 2
    ffn_hidden_size: int = 64
    seq_length: int = 16
    micro_batch_size: int = 2
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    qk_layernorm: bool = True
    # MoE (kind moe / mla): routed experts (mla with 0: no MoE), top-k, expert width; shared expert width
    num_experts: int = 4
    moe_topk: int = 2
    moe_ffn_hidden_size: int = 16
    shared_expert_size: int = 0
    # MLA (kind mla, DeepSeek-V3): low-rank q / kv, rope and value head dims; dense first layers
    q_lora_rank: int = 24
    kv_lora_rank: int = 16
    qk_head_dim: int = 8
    qk_pos_emb_head_dim: int = 4
    v_head_dim: int = 8
    first_k_dense: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def spec_from_megatron(cfg: Any, kind: str = "dense") -> McoreSpec:
    """The McoreSpec of a Megatron ``TinyLlamaConfig`` (duck-typed): every shape field, eps and RoPE base."""
    extra = dict(getattr(cfg, "extra", None) or {})
    return McoreSpec(kind=kind, vocab_size=int(cfg.vocab_size), hidden_size=int(cfg.hidden_size),
                     num_layers=int(cfg.num_layers), num_attention_heads=int(cfg.num_attention_heads),
                     num_query_groups=int(cfg.num_query_groups or cfg.num_attention_heads),
                     ffn_hidden_size=int(cfg.ffn_hidden_size), seq_length=int(cfg.seq_length),
                     micro_batch_size=int(cfg.micro_batch_size),
                     rms_norm_eps=float(extra.get("layernorm_epsilon", 1e-5)),
                     rope_theta=float(extra.get("rotary_base", 10000.0)),
                     qk_layernorm=bool(extra.get("qk_layernorm", False)))


def megatron_extra(spec: McoreSpec) -> dict[str, Any]:
    """TransformerConfig extras that make demo.megatron_cpu.build_tiny_llama the same model as ``spec``."""
    if spec.rope_theta != 10000.0:   # GPTModel's own argument (rotary_base), fixed at 10000 by build_tiny_llama
        raise ValueError("the Megatron tiny model uses RoPE base 10000")
    extra: dict[str, Any] = {"layernorm_epsilon": spec.rms_norm_eps, "qk_layernorm": spec.qk_layernorm}
    if spec.kind in ("moe", "mla") and spec.num_experts:
        extra.update(num_moe_experts=spec.num_experts, moe_router_topk=spec.moe_topk,
                     moe_ffn_hidden_size=spec.moe_ffn_hidden_size, moe_token_dispatcher_type="allgather")
        if spec.shared_expert_size:
            extra["moe_shared_expert_intermediate_size"] = spec.shared_expert_size
    if spec.kind == "mla":
        extra.update(multi_latent_attention=True, q_lora_rank=spec.q_lora_rank, kv_lora_rank=spec.kv_lora_rank,
                     qk_head_dim=spec.qk_head_dim, qk_pos_emb_head_dim=spec.qk_pos_emb_head_dim,
                     v_head_dim=spec.v_head_dim, moe_router_enable_expert_bias=True,
                     # MLATransformerConfig defaults to YaRN x40 RoPE; both sides use plain RoPE here
                     rope_type="rope",
                     moe_router_score_function="sigmoid")
        if spec.first_k_dense:   # build_tiny_llama uses one layer spec for every layer: all MoE
            raise ValueError("the Megatron tiny model has no dense first layers: set first_k_dense=0")
    return extra


def megatron_config_kwargs(spec: McoreSpec) -> dict[str, Any]:
    """Keyword arguments of demo.megatron_cpu.TinyLlamaConfig for the same model as ``spec``."""
    return {"vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size, "num_layers": spec.num_layers,
            "num_attention_heads": spec.num_attention_heads,
            "num_query_groups": spec.num_attention_heads if spec.kind == "mla" else spec.num_query_groups,
            "ffn_hidden_size": spec.ffn_hidden_size, "seq_length": spec.seq_length,
            "micro_batch_size": spec.micro_batch_size, "extra": megatron_extra(spec)}


def mcore_spec(spec: Any) -> McoreSpec:
    """The mcore model of a demo run spec (:class:`demo.spec.Spec`, duck-typed): its sizes, eps and, for the
    moe / mla kinds, experts (mla: plus the shared expert and the MLA ranks and head dims)."""
    m = spec.model
    kind = spec.model_kind
    values: dict[str, Any] = dict(
        kind=kind, vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_layers=m.num_layers,
        num_attention_heads=m.num_heads, num_query_groups=m.num_query_groups, ffn_hidden_size=m.ffn_hidden_size,
        seq_length=m.seq_length, micro_batch_size=m.micro_batch_size, rms_norm_eps=m.norm_eps)
    if kind in ("moe", "mla"):
        values.update(num_experts=m.num_experts, moe_topk=m.moe_topk, moe_ffn_hidden_size=m.moe_ffn_hidden_size)
    if kind == "mla":
        values.update(shared_expert_size=m.shared_expert_size, q_lora_rank=m.q_lora_rank,
                      kv_lora_rank=m.kv_lora_rank, qk_head_dim=m.qk_head_dim,
                      qk_pos_emb_head_dim=m.qk_pos_emb_head_dim, v_head_dim=m.v_head_dim)
    return McoreSpec(**values)
