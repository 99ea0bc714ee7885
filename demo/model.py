"""The tiny model of the demo and the framework tests, described once: framework-free, so the Megatron side
(torch only) and the MindFormers side (MindSpore only) read the same sizes without importing each other's
framework.

:class:`TinyModel` names every field as Megatron does (num_attention_heads, rms_norm_eps, ...). Its defaults
are the framework tests' small model; :func:`demo_model` is the demo's (wider) model, which the run spec
carries (:class:`demo.spec.Spec`); :func:`for_kind` is that model as one candidate kind builds it.
:func:`megatron_extra` / :func:`megatron_config_kwargs` turn it into demo.megatron_cpu's TinyLlamaConfig
(the Megatron builder's arguments); :func:`spec_from_megatron` reads one back. Which mapping preset each
mcore kind uses comes from its model family (``models/<family>``, ``demo_kind``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from models import demo_presets

MODEL_KINDS = ("dense", "moe", "mla")   # the mcore kinds (the demo's llama is the legacy MindFormers Llama)
# The mapping preset (models/<family>/) of each mcore kind against a megatron-core baseline.
MCORE_PRESETS = {k: demo_presets()[k] for k in MODEL_KINDS}


@dataclass
class TinyModel:
    """A tiny model both frameworks build: Qwen3-style dense (GQA, RoPE, RMSNorm, SwiGLU, q/k layernorm) by
    default; ``kind`` moe adds routed experts, mla DeepSeek-V3's MLA (+ MoE with a shared expert)."""

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
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    # MoE (kind moe / mla): routed experts (mla with 0: no MoE), top-k, expert width; shared expert width
    num_experts: int = 4
    moe_topk: int = 2
    moe_ffn_hidden_size: int = 16
    shared_expert_size: int = 0
    # MLA (kind mla, DeepSeek-V3): low-rank q / kv, rope and value head dims (every head its own kv group);
    # dense first layers
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


def demo_model() -> TinyModel:
    """The demo's model: the run spec carries it, and its ``model_kind`` (``--model``) is the kind
    :func:`for_kind` builds (the mla kind also uses the shared expert and MLA's ranks and head dims)."""
    return TinyModel(vocab_size=128, hidden_size=64, ffn_hidden_size=128, rms_norm_eps=1e-5,
                     moe_ffn_hidden_size=32, shared_expert_size=32, q_lora_rank=32, qk_head_dim=16,
                     qk_pos_emb_head_dim=8, v_head_dim=16)


def for_kind(model: TinyModel, kind: str) -> TinyModel:
    """``model`` as candidate kind ``kind`` builds it: only mla has the shared expert."""
    return replace(model, kind=kind, shared_expert_size=model.shared_expert_size if kind == "mla" else 0)


def spec_from_megatron(cfg: Any, kind: str = "dense") -> TinyModel:
    """The TinyModel of a Megatron ``TinyLlamaConfig`` (duck-typed): every shape field, eps and RoPE base."""
    extra = dict(getattr(cfg, "extra", None) or {})
    return TinyModel(kind=kind, vocab_size=int(cfg.vocab_size), hidden_size=int(cfg.hidden_size),
                     num_layers=int(cfg.num_layers), num_attention_heads=int(cfg.num_attention_heads),
                     num_query_groups=int(cfg.num_query_groups or cfg.num_attention_heads),
                     ffn_hidden_size=int(cfg.ffn_hidden_size), seq_length=int(cfg.seq_length),
                     micro_batch_size=int(cfg.micro_batch_size),
                     rms_norm_eps=float(extra.get("layernorm_epsilon", 1e-5)),
                     rope_theta=float(extra.get("rotary_base", 10000.0)),
                     qk_layernorm=bool(extra.get("qk_layernorm", False)))


def megatron_extra(model: TinyModel) -> dict[str, Any]:
    """TransformerConfig extras that make demo.megatron_cpu.build_tiny_llama the same model as ``model``."""
    if model.rope_theta != 10000.0:   # GPTModel's own argument (rotary_base), fixed at 10000 by build_tiny_llama
        raise ValueError("the Megatron tiny model uses RoPE base 10000")
    extra: dict[str, Any] = {"layernorm_epsilon": model.rms_norm_eps, "qk_layernorm": model.qk_layernorm}
    if model.kind in ("moe", "mla") and model.num_experts:
        extra.update(num_moe_experts=model.num_experts, moe_router_topk=model.moe_topk,
                     moe_ffn_hidden_size=model.moe_ffn_hidden_size, moe_token_dispatcher_type="allgather")
        if model.shared_expert_size:
            extra["moe_shared_expert_intermediate_size"] = model.shared_expert_size
    if model.kind == "mla":
        extra.update(multi_latent_attention=True, q_lora_rank=model.q_lora_rank, kv_lora_rank=model.kv_lora_rank,
                     qk_head_dim=model.qk_head_dim, qk_pos_emb_head_dim=model.qk_pos_emb_head_dim,
                     v_head_dim=model.v_head_dim, moe_router_enable_expert_bias=True,
                     # MLATransformerConfig defaults to YaRN x40 RoPE; both sides use plain RoPE here
                     rope_type="rope",
                     moe_router_score_function="sigmoid",
                     # the candidate's expert bias is not updated (MindFormers moe_router_bias_update_rate 0);
                     # Megatron updates it in finalize_model_grads at 1e-3 by default
                     moe_router_bias_update_rate=0.0)
        if model.first_k_dense:   # build_tiny_llama uses one layer spec for every layer: all MoE
            raise ValueError("the Megatron tiny model has no dense first layers: set first_k_dense=0")
    return extra


def megatron_config_kwargs(model: TinyModel) -> dict[str, Any]:
    """Keyword arguments of demo.megatron_cpu.TinyLlamaConfig for the same model as ``model``."""
    return {"vocab_size": model.vocab_size, "hidden_size": model.hidden_size, "num_layers": model.num_layers,
            "num_attention_heads": model.num_attention_heads,
            "num_query_groups": model.num_attention_heads if model.kind == "mla" else model.num_query_groups,
            "ffn_hidden_size": model.ffn_hidden_size, "seq_length": model.seq_length,
            "micro_batch_size": model.micro_batch_size, "extra": megatron_extra(model)}
