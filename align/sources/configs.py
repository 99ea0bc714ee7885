"""Config files users have: Megatron-LM arguments (a log's ``arguments`` block, a launch script, JSON)
and MindFormers YAML, read into plain dicts. Comparing them is ``align.checks.config``'s job."""

from __future__ import annotations

import ast
import json
import re
import shlex
from pathlib import Path
from typing import Any

import yaml

from align.core.errors import BadInput

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
    except (ValueError, SyntaxError):
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
            for piece in (shlex.split(t) if " " in t else [t]):
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


def read_megatron(path: str | Path) -> tuple[dict[str, Any], str]:
    """Megatron arguments from a log, a launch script or JSON. Returns (args, kind)."""
    p = Path(path)
    if not p.is_file():
        raise BadInput(f"{p}: no such file")
    text = p.read_text(encoding="utf-8", errors="replace")
    if p.suffix == ".json" or text.lstrip().startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise BadInput(f"{p}: not valid JSON ({exc.msg})") from None
        obj = obj.get("args", obj.get("config", obj)) if isinstance(obj, dict) else obj
        if not isinstance(obj, dict):
            raise BadInput(f"{p}: JSON is not an object of arguments")
        return {k.replace("-", "_").lstrip("_"): v for k, v in obj.items()}, "json"
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
    p = Path(path)
    if not p.is_file():
        raise BadInput(f"{p}: no such file")
    try:
        cfg = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise BadInput(f"{p}: not valid YAML ({exc.__class__.__name__})") from None
    if not isinstance(cfg, dict):
        raise BadInput(f"{p}: YAML is not a mapping")
    return cfg
