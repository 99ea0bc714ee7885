"""Config files users have: Megatron-LM arguments (a log's ``arguments`` block, a launch script, JSON)
and MindFormers YAML, read into plain dicts. Comparing them is ``align.checks.config``'s job."""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path
from typing import Any

from core.errors import BadInput
from models.mindformers_yaml import MCORE_ALIASES
from runstore.schema import load_yaml, parse_json, read_bytes, regular_file, validate
from sources import input_kind

_ARG_LINE = re.compile(r"^\s{1,4}([A-Za-z_][A-Za-z0-9_]*) (?:\.+ )?(.*)$")
_BLOCK_START = re.compile(r"-{5,} arguments -{5,}")
_BLOCK_END = re.compile(r"-{5,} end of arguments -{5,}")


# flags that store False into another destination
_STORE_FALSE = {"disable_bias_linear": "add_bias_linear", "no_masked_softmax_fusion": "masked_softmax_fusion",
                "no_bias_dropout_fusion": "bias_dropout_fusion", "no_rope_fusion": "apply_rope_fusion"}


def _literal(text: str) -> Any:
    t = text.strip()
    if t in ("True", "False", "None"):
        return {"True": True, "False": False, "None": None}[t]
    if t.startswith("torch."):
        return t[len("torch."):]
    try:
        return ast.literal_eval(t)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return t


#: Lines that stand for lines left out (a hand-trimmed or abbreviated block): never part of a value.
_ELISION = re.compile(r"^\s*(?:\.{3,}|…|\[\.\.\.\]|\(\s*\d*\s*(?:more )?(?:lines|arguments)?[^)]*\))\s*$")
_WORLD = {"world_size": r"using world size:\s*(\d+)", "data_parallel_size": r"data-parallel size:\s*(\d+)",
          "context_parallel_size": r"(?<!hierarchical )context-parallel size:\s*(\d+)",
          "tensor_model_parallel_size": r"(?<!encoder-)tensor-model-parallel size:\s*(\d+)",
          "pipeline_model_parallel_size": r"(?<!encoder-)pipeline-model-parallel size:\s*(\d+)"}


class ArgumentsBlock(dict):
    """The arguments a block states; ``abbreviated`` when lines were left out (``...``): a setting that is
    not in such a block is unknown, never Megatron's default."""

    abbreviated: bool = False


def parse_arguments_block(text: str) -> ArgumentsBlock:
    """The ``arguments`` block Megatron-LM prints at start-up: ``  name ...... value`` lines between
    ``--- arguments ---`` and ``--- end of arguments ---``. Log prefixes (timestamps, rank tags) before the
    two spaces are tolerated; a line wrapped by a terminal is joined to the previous value; a ``...`` line
    (lines left out) ends the previous value and marks the block abbreviated."""
    start = _BLOCK_START.search(text)
    if not start:
        raise BadInput("no Megatron 'arguments' block found")
    end = _BLOCK_END.search(text, start.end())
    body = text[start.end(): end.start() if end else len(text)]
    out: dict[str, str] = {}
    last = None
    abbreviated = end is None
    for raw in body.splitlines():
        line = re.sub(r"^\[[^\]]*\]\s?", "", raw.rstrip("\r"))   # '[rank0]: ' style prefixes
        if not line.strip():
            continue
        if _ELISION.match(line):
            abbreviated, last = True, None
            continue
        m = _ARG_LINE.match(line)
        if m:
            last = m.group(1)
            out[last] = m.group(2)
        elif last is not None:
            out[last] += line.strip()   # a terminal wrap continues the value on the next line
    block = ArgumentsBlock({k: _literal(v) for k, v in out.items()})
    # Megatron prints every argument (hundreds); a block without the core sizes was trimmed by hand.
    block.abbreviated = abbreviated or not {"tensor_model_parallel_size", "num_layers"} <= set(block)
    return block


def parse_world_line(text: str) -> dict[str, int]:
    """The sizes of ``using world size: 8, data-parallel size: 1, ... tensor-model-parallel size: 8, ...``
    (printed before the arguments block, by every Megatron-LM and Megatron-DeepSpeed version)."""
    i = text.find("using world size:")
    if i < 0:
        return {}
    line = text[i: text.find("\n", i) if text.find("\n", i) >= 0 else len(text)]
    out = {}
    for key, rx in _WORLD.items():
        m = re.search(rx, line)
        if m:
            out[key] = int(m.group(1))
    return {"tp": out.get("tensor_model_parallel_size"), "pp": out.get("pipeline_model_parallel_size"),
            "dp": out.get("data_parallel_size"), "world_size": out.get("world_size"),
            "cp": out.get("context_parallel_size"), **out}


def parse_launch_script(text: str) -> dict[str, Any]:
    """``--flag value`` / ``--switch`` tokens of a shell launch script (arrays, strings, continuation lines);
    simple ``VAR=value`` assignments are substituted."""
    text = re.sub(r"\\\r?\n", " ", text)
    env: dict[str, str] = {}
    for m in re.finditer(r"^\s*(?:export\s+)?([A-Za-z_]\w*)=([^\s(][^\s]*)\s*$", text, re.M):
        env[m.group(1)] = m.group(2).strip("\"'")
    tokens: list[str] = []
    for line in text.splitlines():
        line = line.split(" #", 1)[0]
        if line.lstrip().startswith("#"):
            continue
        try:
            toks = shlex.split(line.replace("(", " ").replace(")", " "))
        except ValueError:
            toks = line.split()
        for t in toks:
            try:
                pieces = shlex.split(t) if " " in t else [t]
            except ValueError:
                pieces = t.split()
            for piece in pieces:
                tokens.append(re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), m.group(0)), piece))
    out: dict[str, Any] = {}
    i = 0
    while i < len(tokens):
        t = tokens[i]
        if t.startswith("--") and len(t) > 2:
            name = t[2:].replace("-", "_")
            if "=" in name:
                name, val = name.split("=", 1)
                out[name] = _literal(val)
            elif i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
                vals = []
                while i + 1 < len(tokens) and not tokens[i + 1].startswith("--") and not re.match(
                        r"^[\w.-]*=|^\$|^(torchrun|python|bash)", tokens[i + 1]):
                    vals.append(_literal(tokens[i + 1]))
                    i += 1
                    if name not in ("adam_betas", "split"):
                        break
                out[name] = vals[0] if len(vals) == 1 else (vals or True)
            else:
                out[name] = True
        i += 1
    for flag, dest in _STORE_FALSE.items():
        if out.pop(flag, False) is True:
            out[dest] = False
    if out.pop("use_rotary_position_embeddings", False) is True:
        out.setdefault("position_embedding_type", "rope")
    if "layernorm_epsilon" in out and "norm_epsilon" not in out:
        out["norm_epsilon"] = out["layernorm_epsilon"]
    return out


_N = ["number", "null"]
_I = {"type": ["integer", "null"], "minimum": 0}
_POS = {"type": ["integer", "null"], "minimum": 1}
_S = {"type": ["string", "null"]}
_B = {"type": ["boolean", "null"]}
#: The Megatron arguments the checks read, with the types Megatron-LM's argparse gives them
#: (megatron/training/arguments.py); other arguments are free.
MEGATRON_ARGS_SCHEMA: dict[str, Any] = {"type": "object", "properties": {
    **{k: _POS for k in ("hidden_size", "num_attention_heads", "num_layers", "seq_length",
                         "tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size",
                         "context_parallel_size", "expert_model_parallel_size", "world_size",
                         "make_vocab_size_divisible_by", "num_query_groups", "global_batch_size",
                         "micro_batch_size", "moe_router_topk")},
    **{k: _I for k in ("ffn_hidden_size", "padded_vocab_size", "vocab_size", "lr_decay_iters", "train_iters",
                       "lr_warmup_iters", "num_experts", "seed", "decoder_first_pipeline_num_layers",
                       "decoder_last_pipeline_num_layers")},
    **{k: _POS for k in ("num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank")},
    **{k: {"type": _N} for k in ("lr", "min_lr", "lr_warmup_fraction", "adam_beta1", "adam_beta2", "adam_eps",
                                 "weight_decay", "clip_grad", "norm_epsilon", "layernorm_epsilon",
                                 "hidden_dropout", "attention_dropout", "moe_aux_loss_coeff",
                                 "moe_expert_capacity_factor", "rotary_base")},
    **{k: _S for k in ("normalization", "position_embedding_type", "lr_decay_style", "params_dtype", "optimizer",
                       "attention_backend", "transformer_impl")},
    **{k: _B for k in ("bf16", "fp16", "swiglu", "squared_relu", "group_query_attention", "sequence_parallel",
                       "use_distributed_optimizer", "untie_embeddings_and_output_weights", "add_bias_linear",
                       "apply_wd_to_qk_layernorm", "use_flash_attn", "fp32_residual_connection")},
}}
_OBJ = {"type": ["object", "null"]}
_NUMS = {"type": "number"}
#: mcore model_config keys the checklist compares or computes with, under every spelling MindFormers accepts
_MCORE_INTS = ("num_layers", "num_heads", "num_query_groups", "hidden_size", "ffn_hidden_size", "kv_channels",
               "vocab_size", "seq_length", "num_experts", "moe_topk", "moe_ffn_hidden_size",
               "moe_shared_expert_intermediate_size", "mtp_num_layers", "q_lora_rank", "kv_lora_rank",
               "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
_MCORE_NUMBERS = ("norm_eps", "rotary_base", "hidden_dropout", "attention_dropout", "init_method_std",
                  "moe_aux_loss_coeff", "moe_capacity_factor", "moe_router_topk_scaling_factor",
                  "mtp_loss_scaling_factor")
_MCORE_TYPES = {**{a: _I for k in _MCORE_INTS for a in MCORE_ALIASES[k]},
                **{a: {"type": _N} for k in _MCORE_NUMBERS for a in MCORE_ALIASES[k]},
                "first_k_dense_replace": _I}
#: The parts of a MindFormers YAML the checks read (MindFormers 2.1 config keys); other keys are free.
MINDFORMERS_SCHEMA: dict[str, Any] = {"type": "object", "properties": {
    "seed": _I,
    "train_dataset": {"type": ["object", "null"], "properties": {
        "batch_size": _POS, "data_loader": {"type": ["object", "null"], "properties": {
            "config": {"type": ["object", "null"], "properties": {"seed": _I}}}}}},
    "model": {"type": ["object", "null"], "properties": {"model_config": {"type": ["object", "null"], "properties": {
        **_MCORE_TYPES,
        **{k: _POS for k in ("hidden_size", "num_heads", "num_layers", "seq_length", "n_kv_heads", "multiple_of",
                             "batch_size")},
        **{k: _I for k in ("intermediate_size", "vocab_size")},
        **{k: {"type": ["integer", "null"]} for k in ("pad_token_id", "eos_token_id", "bos_token_id")},
        **{k: {"type": _N} for k in ("rms_norm_eps", "theta", "ffn_dim_multiplier", "hidden_dropout_prob",
                                     "hidden_dropout", "attention_dropout_prob", "attention_dropout")},
        **{k: _S for k in ("hidden_act", "compute_dtype", "param_init_type")},
        "moe_config": _OBJ, "tie_word_embeddings": _B, "qkv_has_bias": _B, "attn_proj_has_bias": _B,
        "pp_interleave_num": _POS, "residual_dtype": {"type": ["string", "boolean", "null"]},
        "fp32_residual_connection": {"type": ["string", "boolean", "null"]},
        "offset": {"type": ["integer", "array", "null"]}}}}},
    # MindFormers refuses a null size (TransformerOpParallelConfig: Validator.check_positive_int)
    "parallel_config": {"type": ["object", "null"], "properties": {
        k: {"type": "integer", "minimum": 1} for k in ("data_parallel", "model_parallel", "pipeline_stage",
                                                       "micro_batch_num", "context_parallel",
                                                       "expert_parallel")}},
    "moe_config": {"type": ["object", "null"], "properties": {
        "expert_num": _I, "num_experts_chosen": _I, "aux_loss_factor": {"type": _N}, "capacity_factor": {"type": _N},
        "aux_loss_factors": {"type": ["array", "null"], "items": _NUMS}}},
    "optimizer": {"type": ["object", "null"], "properties": {
        "betas": {"type": ["array", "null"], "items": _NUMS, "minItems": 2}, "eps": {"type": _N},
        "beta1": {"type": _N}, "beta2": {"type": _N},
        "weight_decay": {"type": _N}, "learning_rate": {"type": _N}}},
    "lr_schedule": {"type": ["object", "null"], "properties": {
        "total_steps": {"type": ["integer", "null"]}, "warmup_steps": _I, "warmup_ratio": {"type": _N},
        "learning_rate": {"type": _N}, "lr_end": {"type": _N}, "type": _S}},
    "runner_wrapper": {"type": ["object", "null"], "properties": {"max_grad_norm": {"type": _N},
                                                                  "use_clip_grad": _B}},
    "runner_config": {"type": ["object", "null"], "properties": {"batch_size": _POS,
                                                                 "gradient_accumulation_steps": _I}},
    "parallel": {"type": ["object", "null"], "properties": {"enable_parallel_optimizer": _B}},
}}


MEGATRON_WANTED = "Megatron arguments (a log with its arguments block, a launch script, or JSON arguments)"
MINDFORMERS_WANTED = "a MindFormers YAML config"


def read_megatron(path: str | Path) -> tuple[dict[str, Any], str]:
    """Megatron arguments from a log, a launch script or JSON, checked against MEGATRON_ARGS_SCHEMA.
    Returns (args, kind). Another kind of input (an environment capture, a MindFormers YAML or log, a
    checkpoint) is refused naming what it looks like, before anything is read as arguments."""
    looks = input_kind.what_it_is(path)     # (only looks: opens nothing but a regular file)
    if looks is not None and looks not in (input_kind.MEGATRON_LOG, input_kind.MEGATRON_ARGS_JSON,
                                           input_kind.LAUNCH_SCRIPT):
        raise BadInput(input_kind.not_this(path, MEGATRON_WANTED, looks))
    p = regular_file(path, "Megatron arguments file")
    args, kind = _read_megatron(p)
    if kind == "script":   # '$VAR' the script never sets: unknown, not a value
        args = {k: v for k, v in args.items() if not (isinstance(v, str) and v.startswith("$"))}
    return _bounded_megatron(validate(args, MEGATRON_ARGS_SCHEMA, p), p), kind


def _bounded_megatron(args: dict[str, Any], where: Path) -> dict[str, Any]:
    """Counts the checklist sizes lists from (layers, pipeline stages, virtual chunks) within bounds."""
    from models.mindformers_parallel import MAX_LAYERS, MAX_SIZE

    for key, most in (("num_layers", MAX_LAYERS), ("pipeline_model_parallel_size", MAX_SIZE),
                      ("num_virtual_stages_per_pipeline_rank", MAX_SIZE),
                      ("num_layers_per_virtual_pipeline_stage", MAX_LAYERS),
                      ("decoder_first_pipeline_num_layers", MAX_LAYERS),
                      ("decoder_last_pipeline_num_layers", MAX_LAYERS)):
        v = args.get(key)
        if isinstance(v, int) and v > most:
            raise BadInput(f"{where}: key '{key}': {v} is more than any model holds (at most {most})")
    return args


def _bounded(cfg: dict[str, Any], where: str | Path) -> dict[str, Any]:
    """Counts the checklist sizes lists from (parallel sizes, layers, interleave chunks, offset entries) within
    bounds, before anything is allocated from them. (An offset MindFormers would refuse is a checklist row.)"""
    from models.mindformers_parallel import MAX_LAYERS, MAX_SIZE

    pc = cfg.get("parallel_config") or {}
    mc = ((cfg.get("model") or {}).get("model_config") or {})
    checks = [(f"parallel_config.{k}", pc.get(k), MAX_SIZE) for k in (
        "data_parallel", "model_parallel", "pipeline_stage", "micro_batch_num", "context_parallel",
        "expert_parallel")]
    checks += [(f"model.model_config.{k}", mc.get(k), MAX_LAYERS) for k in ("num_layers", "num_hidden_layers",
                                                                            "n_layer", "pp_interleave_num")]
    for key, v, most in checks:
        if isinstance(v, int) and not isinstance(v, bool) and v > most:
            raise BadInput(f"{where}: key '{key}': {v} is more than any model or cluster holds (at most {most})")
    offset = mc.get("offset")
    flat = [x for r in offset for x in (r if isinstance(r, list) else [r])] if isinstance(offset, list) else []
    if len(flat) > MAX_SIZE or any(isinstance(x, int) and abs(x) > MAX_LAYERS for x in flat):
        raise BadInput(f"{where}: key 'model.model_config.offset': more entries, or larger ones, than any "
                       f"pipeline has")
    return cfg


def _read_megatron(p: Path) -> tuple[dict[str, Any], str]:
    raw = read_bytes(p, "Megatron arguments file")
    text = raw.decode("utf-8", errors="replace")    # a log may hold a stray byte; JSON may not
    if p.suffix == ".json" or text.lstrip().startswith("{"):
        try:
            raw.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise BadInput(f"{p}: JSON is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})") from None
        doc = parse_json(raw.decode("utf-8-sig"), p)
        looks = input_kind.json_kind(doc)
        if looks not in (None, input_kind.MEGATRON_ARGS_JSON):
            raise BadInput(input_kind.not_this(p, MEGATRON_WANTED, looks))
        obj = doc.get("args", doc.get("config", doc)) if isinstance(doc, dict) else doc
        if not isinstance(obj, dict):
            raise BadInput(f"{p}: JSON is not an object of arguments")
        args = {str(k).replace("-", "_").lstrip("_"): v for k, v in obj.items()}
        if not set(args) & set(MEGATRON_ARGS_SCHEMA["properties"]):
            raise BadInput(f"{p}: JSON holds none of Megatron's arguments (num_layers, hidden_size, "
                           f"tensor_model_parallel_size, ...): not {MEGATRON_WANTED}")
        return args, "json"
    if _BLOCK_START.search(text):
        block = parse_arguments_block(text)
        sizes = parse_world_line(text[: _BLOCK_START.search(text).start()])
        for key in ("world_size", "data_parallel_size", "context_parallel_size", "tensor_model_parallel_size",
                    "pipeline_model_parallel_size"):
            if key not in block and sizes.get(key) is not None:
                block[key] = sizes[key]   # the 'using world size: ...' line states them for this run
        return block, "log"
    args = parse_launch_script(text)
    if not args:
        raise BadInput(f"{p}: no Megatron arguments block, JSON object or --flags found")
    return args, "script"


def read_mindformers(path: str | Path) -> dict[str, Any]:
    """A MindFormers YAML config, checked against MINDFORMERS_SCHEMA (one line naming the key when not).
    Another kind of input (an environment capture, a Megatron log or script, a checkpoint) is refused naming
    what it looks like; so is a mapping that holds none of a MindFormers config's sections."""
    looks = input_kind.what_it_is(path)     # (only looks: opens nothing but a regular file)
    if looks not in (None, input_kind.MINDFORMERS_YAML):
        raise BadInput(input_kind.not_this(path, MINDFORMERS_WANTED, looks))
    regular_file(path, "MindFormers YAML")
    cfg = load_yaml(path, what="MindFormers YAML")
    if not isinstance(cfg, dict):
        raise BadInput(input_kind.not_this(path, MINDFORMERS_WANTED, looks) or f"{path}: YAML is not a mapping")
    looks = input_kind.json_kind(cfg)
    if looks is not None:
        raise BadInput(input_kind.not_this(path, MINDFORMERS_WANTED, looks))
    if not any(k in cfg for k in input_kind.MINDFORMERS_KEYS):
        raise BadInput(f"{path}: holds none of a MindFormers config's sections "
                       f"({', '.join(input_kind.MINDFORMERS_KEYS[:5])}, ...): not {MINDFORMERS_WANTED}")
    return _bounded(validate(cfg, MINDFORMERS_SCHEMA, path), path)
