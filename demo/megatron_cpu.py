"""Run a real Megatron-core GPTModel on CPU with gloo (1 process, or several under torchrun).

Why: the toolkit's tests, its end-to-end demo and the weight-conversion tests need a genuine Megatron-core
baseline on a machine without a GPU. Megatron-core assumes CUDA in a few places (its RNG tracker, the global
scratch buffer, RoPE's ``torch.cuda.current_device()``, ``device='cuda'`` literals in its optimizer and
DDP). This module bridges exactly those places and nothing else, so the model's own code runs unchanged:

* ``torch.cuda.current_device`` is redirected to the CPU device (process-wide, on ``init_megatron_cpu``);
* ``parallel_state``'s global memory buffer is replaced by one that allocates on CPU;
* the RNG tracker is Megatron's inference tracker (``inference_rng_tracker=True``; its ``fork`` is a no-op);
* ``cpu_device_redirect()`` rewrites ``device='cuda'`` literals to CPU (and drops ``pin_memory``) for the span
  where Megatron's optimizer runs (``MegatronOptimizerCPU`` wraps ``step`` in it);
* megatron-core is imported with ``torch.compile`` as the identity (:func:`import_megatron_core_eager`), so its
  ``jit_fuser`` functions run eagerly and TorchDynamo / Inductor are never imported;
* sequence parallelism: the local spec's torch norms refuse it, :class:`SequenceParallelNorm` is them with
  weights marked as apex / TE mark theirs; context parallelism: the local attention refuses it,
  :func:`context_parallel_attention_cls` is that attention over the all-gathered sequence.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import os
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")


def _eager(model: Any = None, **_: Any) -> Any:
    return model if model is not None else (lambda fn: fn)


def import_megatron_core_eager() -> None:
    """Import megatron.core with ``torch.compile`` standing in as the identity for the span of the import.

    Why: megatron.core.jit binds ``jit_fuser = torch.compile`` at import and ~15 modules decorate functions with
    it, which imports TorchDynamo and Inductor: measured here 12.2 -> 7.8 s CPU for importing megatron.core and
    GPTModel, paid by every Megatron process the demo and the tests start. On CPU those functions have nothing
    to fuse (Inductor would compile C++ for them), and none is on the local-spec path the demo trains. No-op
    when megatron.core is already imported or missing."""
    import sys

    if "megatron.core" in sys.modules:
        return
    compile_ = torch.compile
    torch.compile = _eager  # type: ignore[assignment]
    try:
        import megatron.core  # noqa: F401
        from megatron.core import jit

        jit.disable_jit_fuser()     # later imports and callers see the identity too
    except ImportError:
        pass
    finally:
        torch.compile = compile_  # type: ignore[assignment]


import_megatron_core_eager()


# ---------------------------------------------------------------------------------------------------------
# CUDA -> CPU bridges
# ---------------------------------------------------------------------------------------------------------

def _cpu_current_device() -> torch.device:
    return _CPU


def _no_sync(device: Any = None) -> None:
    return None


def redirect_current_device() -> None:
    """Make ``torch.cuda.current_device()`` answer the CPU device (idempotent; no-op when CUDA exists).

    ``torch.cuda.synchronize`` becomes a no-op too: the pipeline schedule's p2p code calls it after
    ``batch_isend_irecv``; on CPU every gloo request has already been waited on.
    """
    if torch.cuda.is_available():
        return
    torch.cuda.current_device = _cpu_current_device  # type: ignore[assignment]
    torch.cuda.synchronize = _no_sync  # type: ignore[assignment]


def _is_cuda(dev: Any) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return isinstance(dev, int) and not isinstance(dev, bool)


class _CpuDeviceMode(TorchFunctionMode):
    """Rewrites ``device='cuda'`` (and ``.cuda()``) to CPU for the torch calls made inside it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # Megatron asserts grads are 'torch.cuda.FloatTensor'; answer as if CPU were the device.
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not args[0].is_cuda else name
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = _CPU
        if kwargs.get("pin_memory"):   # RoPE's CP slice pins its index (no pinned allocator without CUDA)
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def cpu_device_redirect() -> Iterator[None]:
    """Run Megatron code that hard-codes ``device='cuda'`` on CPU (no-op when CUDA exists)."""
    if torch.cuda.is_available():
        yield
        return
    with _CpuDeviceMode():
        yield


def _install_cpu_memory_buffer() -> None:
    from megatron.core import parallel_state
    from megatron.core.utils import GlobalMemoryBuffer

    class CpuMemoryBuffer(GlobalMemoryBuffer):
        """Megatron's scratch buffer (used by attention), allocated on CPU."""

        def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):  # noqa: ANN001
            required = int(np.prod(tensor_shape)) if len(tensor_shape) else 1
            buf = self.buffer.get((name, dtype))
            if buf is None or buf.numel() < required:
                buf = torch.empty(required, dtype=dtype, device=_CPU, requires_grad=False)
                self.buffer[(name, dtype)] = buf
            return buf[0:required].view(*tensor_shape)

    parallel_state._GLOBAL_MEMORY_BUFFER = CpuMemoryBuffer()


# ---------------------------------------------------------------------------------------------------------
# Process group and parallel state
# ---------------------------------------------------------------------------------------------------------

@dataclass
class ParallelInfo:
    """Where this process sits: global rank and its tp/pp/dp coordinates."""

    rank: int
    world_size: int
    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def init_megatron_cpu(tp: int = 1, pp: int = 1, seed: int = 1234, port: int | None = None, *, ep: int = 1,
                      vpp: int | None = None, cp: int = 1) -> ParallelInfo:
    """Initialise gloo, Megatron's parallel state, its RNG tracker and CPU bridges for this process.

    Under torchrun the rendezvous comes from the environment; a lone process makes a one-rank group.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    redirect_current_device()
    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=5)
        if "RANK" in os.environ:
            dist.init_process_group("gloo", timeout=timeout)
        elif port is not None:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            dist.init_process_group("gloo", rank=0, world_size=1, timeout=timeout)
        else:  # a lone process needs no port: a file store cannot collide with other runs on the machine
            fd, path = tempfile.mkstemp(prefix="megatron_cpu_store_")
            os.close(fd)
            atexit.register(_remove_quietly, path)
            store = dist.FileStore(path, 1)
            dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timeout)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                                 pipeline_model_parallel_size=pp,
                                                 virtual_pipeline_model_parallel_size=vpp,
                                                 expert_model_parallel_size=ep,
                                                 context_parallel_size=cp)
    _install_cpu_memory_buffer()
    _define_missing_te_names()
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)
    return parallel_info()


def set_parallel(tp: int = 1, pp: int = 1, ep: int = 1, vpp: int | None = None,
                 seed: int = 1234, cp: int = 1) -> ParallelInfo:
    """Re-initialise Megatron's parallel state with another layout in the same process group.

    One torchrun launch then runs several layouts (DP=2, PP=2, EP=2 ...), which keeps the tests short.
    """
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    return init_megatron_cpu(tp=tp, pp=pp, seed=seed, ep=ep, vpp=vpp, cp=cp)


def _define_missing_te_names() -> None:
    """megatron-core 0.16's router reads ``moe_utils.te_general_gemm``, defined only when Transformer Engine
    imports; without TE it is a NameError instead of the ``torch.mm`` fallback the code means. Define it as
    ``None`` (the value meaning "no TE") when absent; nothing else changes."""
    try:
        from megatron.core.transformer.moe import moe_utils
    except ImportError:
        return
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _remove_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)


def parallel_info() -> ParallelInfo:
    """This process's coordinates, read from ``parallel_state``."""
    from megatron.core import parallel_state as ps

    return ParallelInfo(rank=dist.get_rank(), world_size=dist.get_world_size(),
                        tp=ps.get_tensor_model_parallel_world_size(),
                        pp=ps.get_pipeline_model_parallel_world_size(),
                        dp=ps.get_data_parallel_world_size(),
                        tp_rank=ps.get_tensor_model_parallel_rank(),
                        pp_rank=ps.get_pipeline_model_parallel_rank(),
                        dp_rank=ps.get_data_parallel_rank())


def destroy_megatron_cpu() -> None:
    """Tear down parallel state and the process group (so a test can start again)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------------------

@dataclass
class TinyLlamaConfig:
    """A Llama-shaped GPT: RMSNorm, SwiGLU (gated fc1), RoPE, GQA, no bias, untied embeddings."""

    vocab_size: int = 128
    hidden_size: int = 64
    num_layers: int = 2
    num_attention_heads: int = 4
    num_query_groups: int = 2
    ffn_hidden_size: int = 128
    seq_length: int = 16
    micro_batch_size: int = 2
    params_dtype: str = "float32"
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def build_tiny_llama(cfg: TinyLlamaConfig | None = None, seed: int = 1234, *, vp_stage: int | None = None
                     ) -> torch.nn.Module:
    """Build a Megatron-core GPTModel (local spec) on CPU. Call after ``init_megatron_cpu``.

    CPU initialisation draws the full weight from torch's default generator and splits it per TP rank, so
    seeding it here gives every TP layout the same model. Pipeline and expert layouts draw differently:
    use :func:`init_weights_by_name` for those. Under pipeline parallelism the stage (and ``vp_stage``
    chunk) decides embedding / output layer; ``cfg.extra`` may carry MoE settings (``num_moe_experts`` ...).
    """
    from megatron.core import parallel_state as ps

    torch.manual_seed(seed)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    cfg = cfg or TinyLlamaConfig()
    dtype = getattr(torch, cfg.params_dtype)
    # Layer-spec switches ride in ``extra`` too: qk_layernorm (Qwen3), num_moe_experts (MoE, sequential
    # local experts unless moe_grouped_gemm), multi_latent_attention (DeepSeek-V3 MLA: MLATransformerConfig);
    # mtp_num_layers (a TransformerConfig field) also adds the MTP block on the last stage.
    extra = dict(cfg.extra)
    extra.setdefault("context_parallel_size", ps.get_context_parallel_world_size())
    mla = bool(extra.pop("multi_latent_attention", False))
    grouped = bool(extra.pop("moe_grouped_gemm", False))
    spec = get_gpt_layer_local_spec(num_experts=extra.get("num_moe_experts"), moe_grouped_gemm=grouped,
                                    qk_layernorm=bool(extra.get("qk_layernorm", False)),
                                    multi_latent_attention=mla, normalization="RMSNorm")
    if mla:
        # megatron-core 0.16.1's local MLA spec hands DotProductAttention k_channels / v_channels, which its
        # __init__ does not take; its math reads the head dims from the tensors (the output width is
        # kv_channels * heads, so kv_channels must be v_head_dim).
        spec.submodules.self_attention.submodules.core_attention = _mla_dot_product_attention_cls()
        # ... and without Transformer Engine it asks isinstance(linear_proj, TELinear) where TELinear is None
        # or megatron's MagicMock placeholder: a class nothing is an instance of answers as TE's absence means.
        from megatron.core.transformer import multi_latent_attention as mla_mod
        for absent in ("TELinear", "TEColumnParallelLinear", "Linear"):
            if not isinstance(getattr(mla_mod, absent, None), type):
                setattr(mla_mod, absent, type(f"{absent}Absent", (), {}))
        extra.setdefault("kv_channels", extra.get("v_head_dim"))
    config_cls = MLATransformerConfig if mla else TransformerConfig
    tcfg = config_cls(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_query_groups,
        ffn_hidden_size=cfg.ffn_hidden_size, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=False, hidden_dropout=0.0,
        attention_dropout=0.0, use_cpu_initialization=True, params_dtype=dtype,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        tensor_model_parallel_size=_tp_size(), pipeline_dtype=dtype, bias_dropout_fusion=False,
        apply_rope_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=ps.get_virtual_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(), **extra)
    mtp_spec = None
    if tcfg.mtp_num_layers:   # DeepSeek-V3 multi-token prediction: mtp.layers.{k}.{enorm, hnorm, eh_proj, ...}
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        mtp_spec = get_gpt_mtp_block_spec(tcfg, spec, use_transformer_engine=False, vp_stage=vp_stage)
    if tcfg.context_parallel_size > 1:   # the local attention refuses CP: its all-gather stand-in
        spec.submodules.self_attention.submodules.core_attention = context_parallel_attention_cls()
    if tcfg.sequence_parallel:   # torch's norms refuse sequence parallelism: the stand-in that marks weights
        from megatron.core.transformer.torch_norm import WrappedTorchNorm
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

        _swap_norms(spec, WrappedTorchNorm, SequenceParallelNorm)
        spec = TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(tcfg, vp_stage=vp_stage),
                                          layer_norm=SequenceParallelNorm)
    model = GPTModel(config=tcfg, transformer_layer_spec=spec,
                     vocab_size=cfg.vocab_size, max_sequence_length=cfg.seq_length,
                     share_embeddings_and_output_weights=False, position_embedding_type="rope",
                     parallel_output=True,
                     pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                     post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                     vp_stage=vp_stage, mtp_block_spec=mtp_spec)
    return model


def build_model_chunks(cfg: TinyLlamaConfig | None = None, seed: int = 1234) -> list[torch.nn.Module]:
    """This rank's model chunks (one, or one per virtual stage), initialised the same in every layout."""
    from megatron.core import parallel_state as ps

    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    chunks = [build_tiny_llama(cfg, seed) if not vpp else build_tiny_llama(cfg, seed, vp_stage=i)
              for i in range(vpp or 1)]
    init_weights_by_name(chunks, seed)
    return chunks


def init_weights_by_name(chunks: list[torch.nn.Module], seed: int = 1234, std: float = 0.02) -> None:
    """Give every parameter a value drawn from its global name, so TP/PP/EP layouts hold the same model.

    The full tensor is drawn from a generator seeded by (seed, crc32(global name)); a TP-partitioned
    parameter keeps its rank's slice of it (a gated fc1 its slices of gate and up). Norm weights stay 1 (their
    initial value in Megatron).
    """
    import zlib

    from megatron.core import parallel_state as ps

    from dumpers.megatron import global_namer

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    gated = bool(getattr(getattr(chunks[0], "config", None), "gated_linear_unit", False)) if chunks else False
    with torch.no_grad():
        for chunk in chunks:
            name_of = global_namer(chunk)
            for name, p in chunk.named_parameters():
                if "norm" in name.rsplit(".", 2)[-2] or name.endswith("expert_bias"):
                    continue
                shape = list(p.shape)
                dim = getattr(p, "partition_dim", -1) if getattr(p, "tensor_model_parallel", False) else -1
                if dim >= 0:
                    shape[dim] *= tp
                gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name_of(name).encode()))
                full = torch.randn(shape, generator=gen, dtype=torch.float32) * std
                if dim >= 0 and gated and name.endswith("linear_fc1.weight"):
                    # gated fc1 is [gate; up] of the whole; each TP rank holds [gate_r; up_r]
                    full = torch.cat([h.chunk(tp, dim=0)[tp_rank] for h in full.chunk(2, dim=0)], dim=0)
                elif dim >= 0:
                    full = full.chunk(tp, dim=dim)[tp_rank]
                p.copy_(full.to(p.dtype))


class SequenceParallelNorm:
    """The local spec's norm (torch's RMSNorm / LayerNorm, as ``WrappedTorchNorm`` builds it) with its weights
    marked ``sequence_parallel``, as apex's FusedLayerNorm and TE's TENorm mark them.

    Why: megatron-core's ``WrappedTorchNorm`` (transformer/torch_norm.py) asserts ``not
    config.sequence_parallel``, and apex / TE do not run on CPU. Under sequence parallelism each TP rank
    normalises its own slice of the sequence, so a norm weight's gradient is partial per rank; the mark is
    what makes ``finalize_model_grads`` all-reduce it over TP, as on a GPU cluster. (A class, not a function:
    ``build_module`` hands functions back uncalled.)
    """

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> torch.nn.Module:  # noqa: D102
        norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_cls(hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm


def _swap_norms(spec: Any, old: Any, new: Any, seen: set[int] | None = None) -> Any:
    """Replace the class ``old`` by ``new`` wherever a (nested) layer spec names it, in place."""
    import dataclasses

    seen = set() if seen is None else seen
    if id(spec) in seen or not dataclasses.is_dataclass(spec) or isinstance(spec, type):
        return spec
    seen.add(id(spec))
    for f in dataclasses.fields(spec):
        value = getattr(spec, f.name)
        if value is old:
            setattr(spec, f.name, new)
        elif isinstance(value, (list, tuple)):
            for item in value:
                _swap_norms(item, old, new, seen)
        else:
            _swap_norms(value, old, new, seen)
    return spec


def context_parallel_attention_cls() -> type:
    """A stand-in for TE's context-parallel attention on CPU, built on megatron-core's local attention.

    Why: the local spec's ``DotProductAttention`` asserts ``context_parallel_size == 1`` ("Context
    parallelism is only supported by TEDotProductAttention!", transformer/dot_product_attention.py), and TE
    needs CUDA. This class is that attention, unchanged, over the CP group's whole sequence: K and V are
    all-gathered over CP (backward: reduce-scattered, megatron's own sequence-parallel mappings), and this
    rank's queries (its two zig-zag chunks, as ``get_batch_on_this_cp_rank`` and RoPE split them) are masked
    causally by global position. The math is the all-gather CP variant (``cp_comm_type='all_gather'``).
    """
    import copy

    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    def positions(rank: int, cp: int, chunk: int) -> torch.Tensor:
        return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                          torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)])

    class ContextParallelDotProductAttention(DotProductAttention):
        def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
            local = copy.copy(config)
            local.context_parallel_size = 1
            super().__init__(local, *args, **kwargs)
            self.config = config

        def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                    attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None
                    ) -> torch.Tensor:
            group = ps.get_context_parallel_group()
            cp, rank = group.size(), group.rank()
            key = gather_from_sequence_parallel_region(key, True, group=group)
            value = gather_from_sequence_parallel_region(value, True, group=group)
            chunk = query.size(0) // 2
            q_pos = positions(rank, cp, chunk)
            k_pos = torch.cat([positions(r, cp, chunk) for r in range(cp)])
            mask = (k_pos[None, :] > q_pos[:, None]).view(1, 1, q_pos.numel(), k_pos.numel())
            return super().forward(query, key, value, mask, attn_mask_type, attention_bias, packed_seq_params)

    return ContextParallelDotProductAttention


def _mla_dot_product_attention_cls() -> type:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        """Megatron's local DotProductAttention, accepting (and not needing) MLA's k/v channel arguments."""

        def __init__(self, *args: Any, k_channels: int | None = None, v_channels: int | None = None,
                     **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)

    return MLADotProductAttention


def _tp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()


# ---------------------------------------------------------------------------------------------------------
# Data and training step
# ---------------------------------------------------------------------------------------------------------

def synthetic_batch(step: int, cfg: TinyLlamaConfig, *, seed: int = 1234, dp_rank: int = 0,
                    masked_every: int = 7) -> dict[str, torch.Tensor]:
    """Deterministic Megatron-style batch for ``step`` on ``dp_rank``: already shifted tokens/labels.

    ``attention_mask`` is Megatron's boolean causal mask (True = masked), shape [b, 1, s, s].
    """
    rng = np.random.default_rng([seed, step, dp_rank])
    b, s = cfg.micro_batch_size, cfg.seq_length
    ids = rng.integers(0, cfg.vocab_size, size=(b, s + 1), dtype=np.int64)
    tokens = torch.from_numpy(ids[:, :-1].copy())
    labels = torch.from_numpy(ids[:, 1:].copy())
    loss_mask = torch.ones(b, s, dtype=torch.float32)
    if masked_every:
        loss_mask[:, ::masked_every] = 0.0
    attention_mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).expand(b, 1, s, s).clone()
    position_ids = torch.arange(s, dtype=torch.int64).unsqueeze(0).expand(b, s).clone()
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
            "attention_mask": attention_mask, "position_ids": position_ids}


def forward_loss(model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Megatron's loss with a loss mask: sum(ce * mask) / sum(mask).

    The mask also goes into the model, as pretrain_gpt's forward_step passes it: the MTP loss (mtp_num_layers)
    masks with it, and without it masks nothing (an all-ones mask). The lm loss returned excludes MTP, as
    Megatron's ``lm loss`` does; MTP's gradient joins in backward (MTPLossAutoScaler).
    """
    per_token = model(input_ids=batch["tokens"], position_ids=batch["position_ids"],
                      attention_mask=batch["attention_mask"], labels=batch["labels"],
                      loss_mask=batch["loss_mask"])
    mask = batch["loss_mask"].float()
    return (per_token.float() * mask).sum() / mask.sum()


def allreduce_grads_dp(model: torch.nn.Module) -> None:
    """Average ``.grad`` across the data-parallel group (for plain torch optimizers under DP > 1)."""
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group()
    n = dist.get_world_size(group)
    if n == 1:
        return
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(n)


def train_step(model: torch.nn.Module, optimizer: Any, batch: Mapping[str, torch.Tensor]) -> tuple[float,
                                                                                                    Any]:
    """One step: forward, backward, gradient sync, optimizer step. Returns (loss, optimizer's grad norm).

    Works for a plain ``torch.optim`` optimizer on a bare GPTModel, and for ``MegatronOptimizerCPU`` on a
    model wrapped in Megatron's DDP (``wrap_ddp``).
    """
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads

    ddp = isinstance(model, DistributedDataParallel)
    if ddp:
        model.zero_grad_buffer()
    optimizer.zero_grad()
    loss = forward_loss(model, batch)
    loss.backward()
    grad_norm = None
    if ddp:
        with cpu_device_redirect():   # as Megatron's train_step: DP sync, then TP all-reduce of qk_layernorm grads
            finalize_model_grads([model])
    else:
        allreduce_grads_dp(model)
    result = optimizer.step()
    if isinstance(result, tuple):
        _, grad_norm, _ = result
    return float(loss.detach()), grad_norm


def wrap_ddp(model: torch.nn.Module, *, use_distributed_optimizer: bool = False,
             grad_reduce_in_fp32: bool = True, bucket_size: int | None = None) -> torch.nn.Module:
    """Wrap in Megatron's DistributedDataParallel (main_grad buffers; names gain a ``module.`` prefix).

    fp16 / bf16 models are first wrapped in Megatron's ``Float16Module`` (as Megatron-LM does);
    ``grad_reduce_in_fp32=False`` keeps fp16 ``main_grad`` buffers that still carry the loss scale.
    ``bucket_size`` (elements) turns on Megatron's bucketed, overlapped gradient reduction.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    cfg = model.config
    if cfg.fp16 or cfg.bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(cfg, model)
    # Megatron buckets gradients only when their reduction overlaps the backward pass
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=grad_reduce_in_fp32,
                                            overlap_grad_reduce=bucket_size is not None,
                                            use_distributed_optimizer=use_distributed_optimizer,
                                            bucket_size=bucket_size)
    with cpu_device_redirect():
        return DistributedDataParallel(config=cfg, ddp_config=ddp_cfg, module=model)


class MegatronOptimizerCPU:
    """Megatron's own optimizer (``get_megatron_optimizer``) whose ``step`` runs under the CPU redirect."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def step(self) -> Any:
        with cpu_device_redirect():
            return self.inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def make_megatron_optimizer(model: torch.nn.Module | list[torch.nn.Module], lr: float = 1e-3,
                            clip_grad: float = 1.0, optimizer: str = "adam", *,
                            use_distributed_optimizer: bool = False, loss_scale: float | None = None
                            ) -> MegatronOptimizerCPU:
    """Megatron's optimizer for DDP-wrapped model chunks (FP32Optimizer; Float16 with fp16/bf16 params;
    DistributedOptimizer; a ChainedOptimizer when MoE experts get their own)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    chunks = model if isinstance(model, list) else [model]
    mcfg = chunks[0].config
    cfg = OptimizerConfig(optimizer=optimizer, lr=lr, clip_grad=clip_grad, weight_decay=0.0,
                          bf16=mcfg.bf16, fp16=mcfg.fp16, loss_scale=loss_scale,
                          params_dtype=mcfg.params_dtype, use_distributed_optimizer=use_distributed_optimizer)
    with cpu_device_redirect():
        inner = get_megatron_optimizer(cfg, chunks)
    return MegatronOptimizerCPU(inner)


def pipeline_forward_backward(chunks: list[torch.nn.Module], batches: list[Mapping[str, torch.Tensor]],
                              cfg: TinyLlamaConfig, *, on_batch: Any = None,
                              forward_only: bool = False) -> list[dict[str, torch.Tensor]]:
    """Megatron's own schedule (``get_forward_backward_func``: no pipelining, 1F1B or interleaved).

    The data iterator yields whole micro-batches on every stage (as Megatron-LM's loader does on the first
    and last stage); ``forward_step`` keeps what Megatron's ``get_batch`` keeps there: tokens / position ids
    on the first stage, labels / loss mask on the last. ``on_batch(part)`` sees that part (a dumper's
    ``record_batch``). Returns the last stage's per-micro-batch loss dicts (``{'lm loss': [sum, tokens]}``).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def loss_func(loss_mask: torch.Tensor, output: torch.Tensor) -> tuple:
        mask = loss_mask.float().view(-1)
        total = (output.float().view(-1) * mask).sum()
        tokens = mask.sum().to(torch.int)
        return total, tokens, {"lm loss": torch.stack([total.detach(), mask.sum()])}

    def forward_step(data_iterator: Any, model: torch.nn.Module) -> tuple:
        inner, vp = model, getattr(model, "vp_stage", None)
        while vp is None and hasattr(inner, "module"):
            inner = inner.module
            vp = getattr(inner, "vp_stage", None)
        batch = next(data_iterator)
        first = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp)
        last = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp)
        part = {"tokens": batch["tokens"] if first else None,
                "position_ids": batch["position_ids"] if first else None,
                "labels": batch["labels"] if last else None,
                "loss_mask": batch["loss_mask"] if last else None,
                "attention_mask": batch["attention_mask"] if first or last else None}
        if on_batch is not None and (first or last):
            on_batch(part)
        out = model(part["tokens"], part["position_ids"], part["attention_mask"], labels=part["labels"])
        return out, functools.partial(loss_func, batch["loss_mask"])

    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    iters: Any = [iter(list(batches)) for _ in chunks] if vpp else iter(list(batches))
    fb = get_forward_backward_func()
    with cpu_device_redirect():
        return fb(forward_step_func=forward_step, data_iterator=iters, model=chunks,
                  num_microbatches=len(batches), seq_length=cfg.seq_length,
                  micro_batch_size=cfg.micro_batch_size, forward_only=forward_only)


def reduce_lm_loss(losses_reduced: list[dict[str, torch.Tensor]]) -> float | None:
    """Megatron-LM's ``train_step`` reduction for its log: sum of [loss sum, tokens] over micro-batches and
    the DP group, then loss sum / tokens (``None`` off the last stage)."""
    from megatron.core import parallel_state as ps

    if not losses_reduced:
        return None
    val = torch.vstack([x["lm loss"].view(-1) for x in losses_reduced]).sum(dim=0)
    dist.all_reduce(val, group=ps.get_data_parallel_group(with_context_parallel=True))
    return float(val[0] / val[1])


def torch_optimizer(model: torch.nn.Module, lr: float = 1e-3) -> torch.optim.Optimizer:
    """A plain torch optimizer (deterministic on CPU: foreach off keeps the update order fixed)."""
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, foreach=False)
