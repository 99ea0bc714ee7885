"""The paired experiment's shared, framework-free parts: the run spec, the data, the faults, the configs.

Why here: both runners (``demo.megatron_runner`` under torch, ``demo.mindformers_runner`` under
MindSpore) and the orchestrator (``demo.pair``) must agree on the model, the data and what each injected
fault changes, while ``align/`` never imports a framework. Everything in this module is plain Python and
numpy; the runners read a :class:`Spec` from JSON and write run stores.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from demo.model import TinyModel, demo_model

# Token ids of the synthetic corpus: 0 is padding (never occurs in packed data), 1 ends a document.
PAD_ID = 0
EOS_ID = 1

# The candidate model of the pair: ``llama`` = MindFormers' legacy LlamaForCausalLM (MindFormers <= 1.6
# users), ``dense`` = MindFormers 2.x mcore Qwen3-style model (q/k layernorm; the baseline gets it too),
# ``moe`` = mcore Qwen3-MoE-style (routed experts), ``mla`` = mcore DeepSeek-V3-style (MLA + MoE + shared
# expert); the baseline is the same megatron-core model each time.
MODEL_KINDS = ("dense", "llama", "moe", "mla")
DEFAULT_SEED = 1234   # weights and batches of every run of a pair (`align demo --seed`)
MOE_KINDS = ("moe", "mla")

# Layer profile of the mcore pairs: the same module names on both sides (MindFormers mcore cells carry
# Megatron's names). core_attention is listed because MindFormers' flash-attention path computes it in
# float16 even in a float32 run: its float16 row tells the layer stage that every later row carries float16
# rounding, while the rows before it (embedding, first norm) are still judged at float32's line.
MCORE_LAYER_MODULES = ("embedding", "decoder.layers.*.input_layernorm",
                       "decoder.layers.*.self_attention.core_attention", "decoder.layers.*.self_attention",
                       "decoder.layers.*.pre_mlp_layernorm", "decoder.layers.*.mlp", "decoder.final_layernorm",
                       "output_layer")


@dataclass
class Spec:
    """One run of the pair, as a runner receives it (JSON file)."""

    role: str                      # baseline | repeat | candidate | optimizer_check
    out: str                       # run-store directory
    steps: int
    lr: float = 1e-3
    min_lr: float = 0.0
    weight_decay: float = 0.1
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    lr_schedule: str = "constant"  # constant | cosine (with warm-up)
    warmup_steps: int = 0
    seed: int = DEFAULT_SEED
    threads: int = 1
    tp: int = 1                    # tensor parallel size (the repeat runs TP=2 under torchrun)
    dp: int = 1                    # data parallel size (the moe / mla repeat: the batch split over 2 ranks)
    attention_fp16: bool = False   # Megatron side: core attention's q, k, v and output rounded through float16
    tensor_steps: str = "1-2"
    graph: bool = True             # mcore candidate: GRAPH where it can (trains_in_graph); False: PYNATIVE
    model: TinyModel = field(default_factory=demo_model)   # the one description (demo.model)
    pad_id: int = PAD_ID
    eos_id: int = EOS_ID
    eod_mask_loss: bool = False
    inject: str | None = None
    model_kind: str = "dense"           # dense (MindFormers mcore Qwen3) | llama (legacy MindFormers Llama)
    # files exchanged between the runs
    init_weights: str | None = None     # baseline writes its initial state_dict here (torch.save)
    optimizer_evidence: bool = False    # baseline: write OUT/evidence/optimizer_step1.npz at step 1
    step1_file: str | None = None       # optimizer check: the baseline run whose step-1 evidence it steps on
    replay_dir: str | None = None       # candidate: the baseline run store to replay
    converted: str | None = None        # candidate: converted MindSpore checkpoint it writes and loads
    result_file: str | None = None      # runner writes a small JSON of results here

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Spec:
        d = json.loads(text)
        d["model"] = TinyModel(**d.get("model", {}))
        return cls(**d)


# ---------------------------------------------------------------------------------------------------------
# Faults: what each one changes, on which side, and where the report must show it
# ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Fault:
    """An injected mistake of a real migration; ``stage``/``component`` say where the report must fail."""

    name: str
    side: str          # baseline | candidate | both | conversion
    stage: str         # the stage that must fail
    component: str     # a substring of the failing finding's component
    what: str
    mcore_component: str | None = None   # the component with the mcore candidate, where names differ
    kinds: tuple[str, ...] = MODEL_KINDS   # the model kinds (--model) the fault applies to
    # where the diagnosis names it first, when a stage earlier in the guide's order than ``stage`` sees its cause
    # (the checklist reads the very setting from both configs): (stage, component substrings joined by "|")
    culprit: tuple[str, str] | None = None

    def culprit_for(self, model_kind: str) -> tuple[str, str]:
        """The stage and component substring(s) ``diagnosis[0]`` must name."""
        return self.culprit or (self.stage, self.component_for(model_kind))

    def component_for(self, model_kind: str) -> str:
        """The failing component's substring for a candidate model kind (mcore names are Megatron's)."""
        return self.mcore_component if model_kind != "llama" and self.mcore_component else self.component


FAULTS: dict[str, Fault] = {f.name: f for f in [
    Fault("embedding_fp16", "candidate", "layer_tensors", "embedding",
          "candidate computes the token embedding in float16 (a lower-precision gather on one side)"),
    Fault("weight_decay_all", "baseline", "optimizer", "layernorm",
          "baseline decays every parameter, norms and biases included (Megatron config_overrides={})"),
    Fault("norm_eps", "candidate", "layer_tensors", "input_layernorm",
          "candidate RMSNorm epsilon 1e-2 instead of 1e-5", culprit=("checklist", "norm_eps")),
    Fault("dropout_on", "baseline", "checklist", "dropout",
          "baseline leaves hidden/attention dropout at Megatron's default 0.1"),
    Fault("lr_schedule", "candidate", "lr_schedule", "learning_rate",
          "candidate uses cosine decay with warm-up while the baseline keeps a constant lr",
          culprit=("checklist", "warmup_ratio|decay_style")),
    Fault("qk_swap", "conversion", "layer_tensors", "self_attention",
          "weight conversion permutes the q/k rows of every head (interleaved vs half RoPE layout)"),
    Fault("pad_eos", "both", "data_checks", "loss_mask",
          "pad id equal to eos id: EOD targets masked out of the loss, MindFormers masks EOD keys"),
    Fault("loss_mask_mutation", "baseline", "data_checks", "loss_mask",
          "the baseline data loader mutates its cached loss_mask in place each step"),
    Fault("nan_param", "candidate", "nan_trace", "feed_forward.w2",
          "one parameter's gradient becomes NaN at step 3 on the candidate", mcore_component="mlp.linear_fc2"),
    Fault("no_clip", "candidate", "optimizer", "clipping",
          "candidate's training cell does not clip although its YAML says use_clip_grad: True, max_grad_norm "
          "1.0 (the wrapper is built without the YAML's clipping keys)"),
    Fault("log_softmax_bf16", "candidate", "lr0_run", "loss",
          "candidate computes the cross-entropy's log-softmax in bfloat16 (MindFormers computes the loss in "
          "float32): the loss differs under float16's lines, far above the pair's measured noise floor"),
    Fault("norm_grad", "candidate", "step1_local_norm", "decoder.layers.1.pre_mlp_layernorm",
          "candidate's layer-1 pre-MLP RMSNorm has a hand-written bprop whose weight gradient forgets rstd "
          "(demo/backward_fault.py): forward and loss right, that norm's gradient wrong", kinds=("dense",)),
    # moe / mla pairs only (demo --model moe): routing evidence (runstore.routing, stage moe_routing)
    Fault("router_fp16", "candidate", "moe_routing", "mlp.router",
          "candidate computes the MoE router (gating matmul, score function, top-k) in float16 "
          "(router_dense_type: float16 in its YAML) while the baseline routes in float32", kinds=MOE_KINDS,
          culprit=("checklist", "moe_router_dtype")),
    Fault("expert_swap", "conversion", "moe_routing", "decoder.layers.1.mlp.router",
          "weight conversion writes layer 1's router rows of experts 0 and 1 swapped: the router's expert order "
          "no longer matches the stacked experts', so each token of expert 0 goes to expert 1 and back",
          kinds=MOE_KINDS),
]}
SWAP_LAYER, SWAP_EXPERTS = 1, (0, 1)      # the expert_swap fault: layer and experts

NAN_STEP = 3
NAN_PARAM = "model.layers.1.feed_forward.w2.weight"
NAN_PARAM_BASELINE = "decoder.layers.1.mlp.linear_fc2.weight"
NAN_PARAM_MCORE = NAN_PARAM_BASELINE   # mcore MindFormers uses Megatron's own names


def repeat_layout(model_kind: str) -> dict[str, Any]:
    """How the baseline's repeat (the error band's source) differs from the baseline: another summation order,
    and for moe the candidate's attention precision.

    TP=2 splits the row-parallel matmuls into partial sums. megatron-core refuses MoE with TP unless sequence
    parallelism is on, which its local (torch) norms do not support, so the moe / mla repeat runs DP=2
    instead: each rank takes half of the same batch (equal token counts: the data has no padding) and the
    gradients are averaged, the same mean loss summed in another order.

    The moe candidate (Qwen3-MoE) computes attention in float16 even in a float32 run (MindFormers' flash-
    attention path casts q, k, v); top-k routing flips on near ties and Adam's first steps turn that rounding
    into loss deltas of ~1e-4 within a few steps, which a float32 repeat (deltas ~1e-7) cannot cover. Its
    repeat therefore rounds Megatron's q, k, v and attention output through float16 too (measured: that
    baseline variant lands within ~1e-5 of the candidate at every step), so the band spans the precision the
    candidate computes in. The dense candidate (Qwen3, flash attention by default) computes attention in
    float16 the same way, so its TP=2 repeat rounds too: with Megatron's TP all-reduce of the q/k layernorm
    gradients (finalize_model_grads) a float32 TP=2 repeat equals the baseline to ~1e-7, a band that says
    nothing about float16 attention. The MLA candidate keeps float32 attention and a float32 repeat."""
    if model_kind == "moe":
        return {"tp": 1, "dp": 2, "attention_fp16": True}
    if model_kind == "dense":   # the Qwen3 candidate's flash attention: float16 q, k, v as well
        return {"tp": 2, "dp": 1, "attention_fp16": True}
    return {"tp": 1, "dp": 2} if model_kind in MOE_KINDS else {"tp": 2, "dp": 1}


NAN_PARAM_MOE = "decoder.layers.1.mlp.experts.weight2"   # moe / mla: the stacked experts' fc2


def nan_param(spec: Spec) -> str:
    """The candidate parameter the nan_param fault poisons, in the candidate's names."""
    if spec.model_kind in MOE_KINDS:
        return NAN_PARAM_MOE
    return NAN_PARAM if spec.model_kind == "llama" else NAN_PARAM_MCORE


def fault(name: str | None) -> Fault | None:
    if name is None:
        return None
    if name not in FAULTS:
        raise ValueError(f"unknown fault {name!r}; known: {', '.join(FAULTS)}")
    return FAULTS[name]


def injects(spec: Spec, side: str) -> str | None:
    """The fault name if ``spec.inject`` applies to ``side`` (baseline/candidate/conversion)."""
    f = fault(spec.inject)
    if f is None:
        return None
    return f.name if f.side in (side, "both") else None


# ---------------------------------------------------------------------------------------------------------
# Data: a learnable synthetic corpus, packed like Megatron's GPTDataset
# ---------------------------------------------------------------------------------------------------------

def sample_ids(step: int, model: TinyModel, seed: int) -> np.ndarray:
    """[micro_batch, seq+1] packed documents for ``step``: a noisy affine chain of tokens, EOS-terminated.

    Why learnable: the long run must show a falling loss (a model that learns), so a divergence is visible
    against a moving curve, not a flat log(vocab).
    """
    rng = np.random.default_rng([seed, step])
    b, s, v = model.micro_batch_size, model.seq_length + 1, model.vocab_size
    out = np.empty((b, s), dtype=np.int64)
    for i in range(b):
        row: list[int] = []
        while len(row) < s:
            n = int(rng.integers(4, 12))
            x = int(rng.integers(2, v))
            for _ in range(n):
                row.append(x)
                x = (5 * x + 3) % (v - 2) + 2 if rng.random() < 0.9 else int(rng.integers(2, v))
            row.append(EOS_ID)
        out[i] = row[:s]
    return out


def megatron_masks(tokens: np.ndarray, labels: np.ndarray, *, eos_id: int, pad_id: int,
                   eod_mask_loss: bool) -> np.ndarray:
    """Megatron GPTDataset's loss mask: 0 at EOD inputs (eod_mask_loss) and at padding labels."""
    mask = np.ones(tokens.shape, dtype=np.float32)
    if eod_mask_loss:
        mask[tokens == eos_id] = 0.0
    mask[labels == pad_id] = 0.0
    return mask


class BatchSource:
    """Batches for the baseline, step by step; ``mutate_cache`` reproduces the cached-loss_mask bug.

    The bug (seen in real GPT dataset code): a loss mask built once, cached, and then edited in place for
    every sample's EOD positions, so it loses ones step after step.
    """

    def __init__(self, spec: Spec, mutate_cache: bool = False) -> None:
        self.spec = spec
        self.mutate_cache = mutate_cache
        self._cached: np.ndarray | None = None

    def __call__(self, step: int) -> dict[str, np.ndarray]:
        m, sp = self.spec.model, self.spec
        ids = sample_ids(step, m, sp.seed)
        tokens, labels = ids[:, :-1].copy(), ids[:, 1:].copy()
        if self.mutate_cache:
            if self._cached is None:
                self._cached = np.ones(tokens.shape, dtype=np.float32)
            self._cached[tokens == sp.eos_id] = 0.0          # in place: the cache remembers every EOD
            self._cached[labels == sp.pad_id] = 0.0
            loss_mask = self._cached.copy()
        else:
            loss_mask = megatron_masks(tokens, labels, eos_id=sp.eos_id, pad_id=sp.pad_id,
                                       eod_mask_loss=sp.eod_mask_loss)
        b, s = tokens.shape
        attention_mask = np.broadcast_to(np.triu(np.ones((s, s), dtype=bool), 1), (b, 1, s, s)).copy()
        position_ids = np.broadcast_to(np.arange(s, dtype=np.int64), (b, s)).copy()
        return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "attention_mask": attention_mask,
                "position_ids": position_ids}


def lr_at(spec: Spec, step: int, schedule: str | None = None) -> float:
    """Learning rate used at ``step`` (1-based): constant, or linear warm-up then cosine to min_lr."""
    schedule = schedule or spec.lr_schedule
    if schedule == "constant":
        return spec.lr
    w = max(spec.warmup_steps, 0)
    if w and step <= w:
        return spec.lr * step / w
    total = max(spec.steps - w, 1)
    frac = min(max(step - w, 0) / total, 1.0)
    return spec.min_lr + 0.5 * (spec.lr - spec.min_lr) * (1 + math.cos(math.pi * frac))


# ---------------------------------------------------------------------------------------------------------
# The two configs, as each framework's user writes them (for the checklist and the record)
# ---------------------------------------------------------------------------------------------------------

def megatron_args(spec: Spec) -> dict[str, Any]:
    """The Megatron-LM arguments equivalent to the baseline run (what ``--`` flags a user would pass)."""
    m = spec.model
    return {
        "num_layers": m.num_layers, "hidden_size": m.hidden_size, "num_attention_heads": m.num_attention_heads,
        "group_query_attention": m.num_query_groups != m.num_attention_heads, "num_query_groups": m.num_query_groups,
        "ffn_hidden_size": m.ffn_hidden_size, "seq_length": m.seq_length, "max_position_embeddings": m.seq_length,
        "vocab_size": m.vocab_size, "padded_vocab_size": m.vocab_size, "make_vocab_size_divisible_by": 128,
        "normalization": "RMSNorm", "norm_epsilon": m.rms_norm_eps, "swiglu": True,
        "position_embedding_type": "rope", "rotary_base": 10000, "untie_embeddings_and_output_weights": True,
        "add_bias_linear": False, "hidden_dropout": m.hidden_dropout, "attention_dropout": m.attention_dropout,
        "lr": spec.lr, "min_lr": spec.min_lr, "lr_decay_style": spec.lr_schedule,
        "lr_warmup_iters": spec.warmup_steps, "train_iters": spec.steps, "adam_beta1": spec.adam_beta1,
        "adam_beta2": spec.adam_beta2, "adam_eps": spec.adam_eps, "weight_decay": spec.weight_decay,
        "clip_grad": spec.clip_grad, "micro_batch_size": m.micro_batch_size,
        "global_batch_size": m.micro_batch_size, "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1, "data_parallel_size": 1, "bf16": False, "fp16": False,
        "params_dtype": "float32", "seed": spec.seed, "optimizer": "adam", "eod_mask_loss": spec.eod_mask_loss,
        "use_distributed_optimizer": False, "attention_softmax_in_fp32": True,
        **({"qk_layernorm": True} if spec.model_kind != "llama" else {}),
        **_megatron_moe_args(spec),
    }


def _megatron_moe_args(spec: Spec) -> dict[str, Any]:
    """The Megatron-LM MoE / MLA arguments of the moe and mla baselines (demo.model.megatron_extra
    builds the same model: allgather dispatcher, no aux loss, the expert bias not updated)."""
    m = spec.model
    if spec.model_kind not in MOE_KINDS:
        return {}
    args: dict[str, Any] = {
        "num_experts": m.num_experts, "moe_router_topk": m.moe_topk, "moe_ffn_hidden_size": m.moe_ffn_hidden_size,
        "moe_token_dispatcher_type": "allgather", "moe_aux_loss_coeff": 0.0, "moe_grouped_gemm": False}
    if spec.model_kind == "mla":
        args.update({
            "multi_latent_attention": True, "group_query_attention": False, "num_query_groups": m.num_attention_heads,
            "q_lora_rank": m.q_lora_rank, "kv_lora_rank": m.kv_lora_rank, "qk_head_dim": m.qk_head_dim,
            "qk_pos_emb_head_dim": m.qk_pos_emb_head_dim, "v_head_dim": m.v_head_dim, "kv_channels": m.v_head_dim,
            "rope_type": "rope", "moe_shared_expert_intermediate_size": m.shared_expert_size,
            "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
            "moe_router_bias_update_rate": 0.0})
    return args


def trains_in_graph(spec: Spec) -> bool:
    """Whether the candidate run trains in GRAPH (its YAML's ``context.mode`` 0) rather than PYNATIVE (1).

    The mcore candidate's main run trains in GRAPH (0.02-0.1 s a step here, 0.2-1 s in PYNATIVE, after a
    10-40 s compile) with its layer statistics captured inside the compiled step at the tensor steps
    (``MindSporeDumper(graph_capture=True)``: statistics only, no full tensors). The lr = 0 run (no tensor steps,
    short), the optimizer check and the faults that patch the candidate's Python at run time (nan_param poisons
    a gradient in the training cell, embedding_fp16 replaces the embedding's ``construct``, log_softmax_bf16
    the loss's log-softmax cell's; GRAPH would compile none of them) stay in PYNATIVE with layer hooks and full
    tensors; so does the legacy Llama. So does no_clip: a cell without clipping returns None as its global norm,
    which a CPU GRAPH step cannot output."""
    return (spec.graph and spec.model_kind != "llama" and spec.role == "candidate" and bool(spec.tensor_steps)
            and injects(spec, "candidate") not in ("nan_param", "embedding_fp16", "log_softmax_bf16", "no_clip"))


def mindformers_config(spec: Spec) -> dict[str, Any]:
    """The MindFormers YAML (as a dict) of the candidate run: the runner builds the model (mcore: through
    MindFormers' own ``build_network``), optimizer, schedule and training cell from these very values, and the
    run store records them for the checklist."""
    if spec.model_kind not in MODEL_KINDS:
        raise ValueError(f"model kind {spec.model_kind!r}: expected one of {', '.join(MODEL_KINDS)}")
    m = spec.model
    if spec.lr_schedule == "cosine":
        lr_schedule = {"type": "CosineWithWarmUpLR", "learning_rate": spec.lr, "lr_end": spec.min_lr,
                       "warmup_steps": spec.warmup_steps, "total_steps": spec.steps}
    else:
        lr_schedule = {"type": "ConstantWarmUpLR", "learning_rate": spec.lr, "warmup_steps": 0,
                       "total_steps": spec.steps}
    common = _common_yaml(spec, lr_schedule)
    return {
        **common,
        "model": {"arch": {"type": "LlamaForCausalLM"}, "model_config": {
            "type": "LlamaConfig", "batch_size": m.micro_batch_size, "seq_length": m.seq_length,
            "hidden_size": m.hidden_size, "num_layers": m.num_layers, "num_heads": m.num_attention_heads,
            "n_kv_heads": m.num_query_groups, "intermediate_size": m.ffn_hidden_size,
            "vocab_size": m.vocab_size, "rms_norm_eps": m.rms_norm_eps, "pad_token_id": spec.pad_id,
            "eos_token_id": spec.eos_id, "hidden_act": "silu", "theta": 10000.0,
            "hidden_dropout_prob": m.hidden_dropout, "attention_dropout_prob": m.attention_dropout,
            "compute_dtype": "float32", "param_init_type": "float32", "layernorm_compute_type": "float32",
            "softmax_compute_type": "float32", "rotary_dtype": "float32", "embedding_init_type": "float32",
            "fused_rms_norm": False, "use_rope_slice": True, "input_sliced_sig": True,
            "use_flash_attention": False, "use_past": False, "tie_word_embeddings": False,
            "qkv_has_bias": False, "checkpoint_name_or_path": ""}},
    } if spec.model_kind == "llama" else {"use_legacy": False, **common, **_mcore_model(spec)}


def _common_yaml(spec: Spec, lr_schedule: dict[str, Any]) -> dict[str, Any]:
    """The YAML keys both candidates share: runner, optimizer, schedule, wrapper, data, context."""
    m = spec.model
    return {
        "seed": spec.seed, "run_mode": "train",
        "runner_config": {"epochs": 1, "batch_size": m.micro_batch_size, "sink_mode": False,
                          "gradient_accumulation_steps": 1},
        "optimizer": {"type": "AdamW", "betas": [spec.adam_beta1, spec.adam_beta2], "eps": spec.adam_eps,
                      "weight_decay": spec.weight_decay, "learning_rate": spec.lr},
        "lr_schedule": lr_schedule,
        # CPU only: MindFormers' MFTrainOneStepCell with a CPU overflow check; the mcore one also installs the CPU
        # stand-ins on the network it wraps (demo.mindformers_mcore_cpu), as a YAML-only run_mindformer.py run does
        "runner_wrapper": {"type": "CPUTrainOneStepCell" if spec.model_kind == "llama" else "McoreCPUTrainOneStepCell",
                           "scale_sense": 1.0, "use_clip_grad": spec.clip_grad > 0, "max_grad_norm": spec.clip_grad,
                           "local_norm": True},
        "parallel_config": {"data_parallel": 1, "model_parallel": 1, "pipeline_stage": 1, "micro_batch_num": 1},
        "train_dataset": {"data_dir": spec.replay_dir, "columns": ["input_ids", "labels", "loss_mask"],
                          "construct_args_key": ["input_ids", "labels", "loss_mask"], "batch_size": 1},
        "train_dataset_task": {"type": "MegatronReplayDataset"},
        "context": {"mode": 0 if trains_in_graph(spec) else 1, "device_target": "CPU", "max_call_depth": 10000},
    }


def _mcore_model(spec: Spec) -> dict[str, Any]:
    """MindFormers 2.x (``use_legacy: False``) model block of the mcore dense candidate: Qwen3Config keys.

    As in MindFormers' own mcore YAMLs, ``model_type`` picks the config class and ``architectures`` the model
    class (MindFormers' GRAPH training class, named directly: ``Qwen3ForCausalLM`` would pick the PYNATIVE
    class, which needs hyper_parallel; demo.mindformers_mcore_cpu registers the training classes).
    pad_token_id is -1 because MindFormers hides keys whose token equals it from attention, and Megatron
    never does (the packed data has no padding)."""
    m = spec.model
    if spec.model_kind in MOE_KINDS:
        return _mcore_moe_model(spec)
    return {
        "load_ckpt_format": "safetensors",
        "model": {"model_config": {
            "model_type": "qwen3", "architectures": ["TrainingQwen3ForCausalLM"],
            "batch_size": m.micro_batch_size, "seq_length": m.seq_length,
            "max_position_embeddings": m.seq_length, "hidden_size": m.hidden_size,
            "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_attention_heads,
            "num_key_value_heads": m.num_query_groups, "head_dim": m.head_dim,
            "intermediate_size": m.ffn_hidden_size, "vocab_size": m.vocab_size, "rms_norm_eps": m.rms_norm_eps,
            "rope_theta": m.rope_theta, "hidden_act": "silu", "qk_layernorm": True, "attention_bias": False,
            "tie_word_embeddings": False, "hidden_dropout": m.hidden_dropout,
            "attention_dropout": m.attention_dropout, "pad_token_id": -1, "eos_token_id": spec.eos_id,
            "compute_dtype": "float32", "params_dtype": "float32", "layernorm_compute_dtype": "float32",
            "softmax_compute_dtype": "float32", "rotary_dtype": "float32"}},
    }


def _mcore_moe_model(spec: Spec) -> dict[str, Any]:
    """The model block of the moe (Qwen3MoeConfig) and mla (DeepseekV3Config) candidates: the dense block's
    shared keys plus experts (no aux loss, top-k normalised, scaling 1); mla adds MLA ranks and head dims,
    the sigmoid router with a (not updated) expert bias, the shared expert, plain RoPE (YaRN factor 1: YaRN
    would also scale the softmax) and no MTP."""
    m = spec.model
    dense = dict(_mcore_model(replace(spec, model_kind="dense"))["model"]["model_config"])
    moe = {"num_experts_per_tok": m.moe_topk, "moe_intermediate_size": m.moe_ffn_hidden_size,
           "norm_topk_prob": True, "moe_router_topk_scaling_factor": 1.0, "moe_grouped_gemm": True,
           "moe_aux_loss_coeff": 0.0}
    if injects(spec, "candidate") == "router_fp16":
        moe["router_dense_type"] = "float16"      # MindFormers' key for moe_router_dtype (its config converter)
    if spec.model_kind == "moe":
        cfg = {**dense, "model_type": "qwen3_moe", "architectures": ["TrainingQwen3MoeForCausalLM"],
               "num_experts": m.num_experts, "decoder_sparse_step": 1, **moe}
    else:
        dense.pop("head_dim")
        cfg = {**dense, "model_type": "deepseek_v3", "architectures": ["TrainingDeepseekV3ForCausalLM"],
               "num_key_value_heads": m.num_attention_heads,
               "n_routed_experts": m.num_experts, **moe,
               "n_shared_experts": m.shared_expert_size // m.moe_ffn_hidden_size, "first_k_dense_replace": 0,
               "moe_shared_expert_intermediate_size": m.shared_expert_size, "use_shared_expert_gating": False,
               "q_lora_rank": m.q_lora_rank, "kv_lora_rank": m.kv_lora_rank, "qk_nope_head_dim": m.qk_head_dim,
               "qk_rope_head_dim": m.qk_pos_emb_head_dim, "v_head_dim": m.v_head_dim, "mla_qkv_concat": False,
               "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "num_nextn_predict_layers": 0,
               "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
               "moe_router_bias_update_rate": 0.0,
               "rope_scaling": {"type": "yarn", "factor": 1.0, "original_max_position_embeddings": m.seq_length}}
    return {"load_ckpt_format": "safetensors", "model": {"model_config": cfg}}


def write_spec(spec: Spec, path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(spec.to_json())
    return p


def read_spec(path: str | Path) -> Spec:
    return Spec.from_json(Path(path).read_text())
