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

import argparse
import json
import math
from dataclasses import dataclass
from typing import Any

from align.core.findings import Finding, StageResult
from align.core.outputs import write_text_output
from align.sources.configs import read_megatron, read_mindformers

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
}
_MF_LR = {"CosineWithWarmUpLR": "cosine", "LinearWithWarmUpLR": "linear", "ConstantWarmUpLR": "constant",
          "PolynomialWithWarmUpLR": "polynomial", "CosineWithRestartsAndWarmUpLR": "cosine-restarts",
          "WarmUpStableDecayLR": "WSD", "CosineAnnealingLR": "cosine", "constant": "constant"}


# ------------------------------------------------------------------------------------------------------
# Common keys
# ------------------------------------------------------------------------------------------------------

def _get(d: Any, dotted: str, default: Any = None) -> Any:
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return default
        d = d[part]
    return d


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
    vocab = g("padded_vocab_size")
    if vocab is None and g("vocab_size") is not None and g("make_vocab_size_divisible_by") and tp:
        mult = g("make_vocab_size_divisible_by") * tp
        vocab = int(math.ceil(g("vocab_size") / mult) * mult)
    compute = "bfloat16" if g("bf16") else "float16" if g("fp16") else (
        "float32" if g("bf16") is not None or g("fp16") is not None else None)

    def flag(name: str) -> bool | None:
        v = g(name)
        return None if v is None else bool(v)
    decay_iters = _first(g("lr_decay_iters"), g("train_iters"))
    warm = g("lr_warmup_iters")
    if g("lr_warmup_fraction") is not None and decay_iters:
        warm = round(g("lr_warmup_fraction") * decay_iters)
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
        "warmup_ratio": (warm / decay_iters) if (warm is not None and decay_iters) else None,
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
        "seed": g("seed"),
    }
    for key, names in {"hidden_dropout": ["hidden_dropout"], "attention_dropout": ["attention_dropout"],
                       "adam_beta1": ["adam_beta1"], "adam_beta2": ["adam_beta2"], "adam_eps": ["adam_eps"],
                       "weight_decay": ["weight_decay"], "clip_grad": ["clip_grad"],
                       "norm_eps": ["norm_epsilon", "layernorm_epsilon"], "norm_type": ["normalization"],
                       "decay_style": ["lr_decay_style"], "position_embedding": ["position_embedding_type"],
                       "min_lr": ["min_lr"], "bias_linear": ["add_bias_linear"]}.items():
        mark(key, *names)
    return c, defaulted


def _llama_ffn(h: int, multiple_of: int, mult: float | None) -> int:
    hidden = int(2 * (4 * h) / 3)
    if mult is not None:
        hidden = int(mult * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def mindformers_common(cfg: dict[str, Any]) -> dict[str, Any]:
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
    betas = opt.get("betas") or [0.9, 0.999]
    total = lrs.get("total_steps")
    warm_steps, warm_ratio = lrs.get("warmup_steps"), lrs.get("warmup_ratio")
    if warm_steps is None and warm_ratio is not None and total and total > 0:
        warm_steps = round(warm_ratio * total)
    if warm_ratio is None and warm_steps is not None and total and total > 0:
        warm_ratio = warm_steps / total
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
        "seed": cfg.get("seed"),
        "pad_token_id": mc.get("pad_token_id"), "eos_token_id": mc.get("eos_token_id"),
    }


# keys that only inform (parallel layout may legitimately differ between the two runs)
_INFO_ONLY = {"dp", "vocab_size_unpadded", "warmup_steps", "seed", "optimizer_parallel"}
# parallel layout: a difference is allowed (the toolkit compares across layouts) but worth a look
_LAYOUT = {"tp", "pp", "cp", "ep", "sequence_parallel", "micro_batch_size"}


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


def compare_configs(mg_args: dict[str, Any], mf_cfg: dict[str, Any]) -> tuple[list[Row], StageResult]:
    """Rows for every common key, and the findings: mismatch -> fail, check by hand -> warn."""
    mg, defaulted = megatron_common(mg_args)
    mf = mindformers_common(mf_cfg)
    rows: list[Row] = []
    for key in mg:
        a, b = mg[key], mf.get(key)
        if key in _INFO_ONLY:
            continue
        if a is None and b is None:
            continue
        if a is None or b is None:
            rows.append(Row(key, a, b, "check", "set on one side only"))
        elif _equal(a, b):
            rows.append(Row(key, a, b, "match"))
        elif key in _LAYOUT:
            rows.append(Row(key, a, b, "check", "parallel layout differs; local norms and losses still compare "
                                                "(TP shards are combined) but check determinism settings"))
        elif key == "params_dtype":
            rows.append(Row(key, a, b, "check", "parameter dtype differs: Megatron keeps fp32 master weights in "
                                                "its optimizer under --bf16; compare the master-weight dtype"))
        else:
            note = "Megatron-LM default (not set explicitly)" if key in defaulted else ""
            rows.append(Row(key, a, b, "mismatch", note))
    rows.extend(_advice(mg, mf))
    res = StageResult(STAGE)
    for r in rows:
        if r.status == "match":
            continue
        verdict = "fail" if r.status == "mismatch" else "warn"
        res.add(Finding(STAGE, verdict, r.key, r.status, _show(r.mindformers), _show(r.megatron),
                        f"{r.key}: Megatron {_show(r.megatron)} vs MindFormers {_show(r.mindformers)}"
                        + (f" ({r.note})" if r.note else "")))
    if not res.findings:
        res.verdict = "pass"
    res.details = {"rows": [r.__dict__ for r in rows],
                   "counts": {s: sum(r.status == s for r in rows) for s in ("match", "mismatch", "check")}}
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
    if (mg.get("weight_decay") or 0) > 0 or (mf.get("weight_decay") or 0) > 0:
        out.append(Row("advice.weight_decay_params", mg["weight_decay_applies_to"], mf["weight_decay_applies_to"],
                       "match" if mg["weight_decay_applies_to"] == mf["weight_decay_applies_to"] else "check",
                       "custom PyTorch optimizers often decay every weight; verify with the optimizer stage"))
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

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`align check-config MEGATRON MINDFORMERS_YAML [--json OUT|-]`."""
    parser.add_argument("megatron", help="Megatron log (arguments block), launch script, or JSON arguments")
    parser.add_argument("mindformers", help="MindFormers YAML config")
    parser.add_argument("--json", metavar="OUT", help="write machine-readable results to OUT ('-' = stdout)")


def run(args: argparse.Namespace) -> int:
    mg_args, kind = read_megatron(args.megatron)
    rows, res = compare_configs(mg_args, read_mindformers(args.mindformers))
    payload = {"verdict": res.verdict, "megatron_source": kind, **res.details,
               "findings": [f.to_json() for f in res.findings]}
    if args.json == "-":
        print(json.dumps(payload, indent=2, default=str))
    else:
        print(format_table(rows))
        c = res.details["counts"]
        print(f"\n{c['match']} match, {c['mismatch']} mismatch, {c['check']} to check by hand -> {res.verdict}")
        if args.json:
            write_text_output(args.json, json.dumps(payload, indent=2, default=str))
    return 1 if res.verdict == "fail" else 0
