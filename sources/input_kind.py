"""What a file or folder looks like, in words, so that a verb given the wrong kind of input says so.

Why: ``check-config`` took an environment capture as the Megatron arguments (any JSON object passed) and
printed a checklist of ``None``; a checkpoint given to ``report``, a run store given to ``check-config``, a
log given as weights all deserve the same one line: ``X: an environment capture (align capture-env), not
Megatron arguments``. :func:`what_it_is` only looks (the first bytes of a file, a folder's top entries); it
never raises and never opens anything but a regular file.
"""

from __future__ import annotations

import json
import os
import re
import stat
import struct
from pathlib import Path

HEAD = 1 << 16

ENV_CAPTURE = "an environment capture (align capture-env)"
SUMMARY = "a report's summary.json (align report)"
RUN_META = "a run store's meta.json"
RUN_STORE = "a run store folder"
MSPROBE_JSON = "an msprobe dump.json"
GOLDEN = "a Megatron golden-values JSON (loss curve)"
MEGATRON_ARGS_JSON = "Megatron arguments (JSON)"
MEGATRON_LOG = "a Megatron-LM training log"
MINDFORMERS_LOG = "a MindFormers training log"
MINDFORMERS_YAML = "a MindFormers YAML config"
MAPPING_YAML = "a name-mapping YAML"
LAUNCH_SCRIPT = "a launch script"
TORCH_ZIP = "a torch checkpoint (zip archive)"
SAFETENSORS = "a safetensors checkpoint"
NPY = "a NumPy .npy array"
HDF5 = "an HDF5 file"
TFEVENTS = "a TensorBoard event file"
TORCH_DIST = "a Megatron torch_dist checkpoint folder"
LEGACY = "a Megatron legacy checkpoint folder (mp_rank_*)"
MSRUN_DIR = "an msrun log folder (MindFormers worker logs)"
MINDSPORE_DUMP = "a MindSpore dump folder"
MSPROBE_DIR = "an msprobe dump folder"
TENSORBOARD_DIR = "a TensorBoard folder"
#: the kinds `align report` reads as runs (a damaged one is described by its own reader, not refused as another)
RUN_KINDS = (RUN_STORE, MEGATRON_LOG, MINDFORMERS_LOG, GOLDEN, MSRUN_DIR, MINDSPORE_DUMP, MSPROBE_DIR,
             MSPROBE_JSON, TENSORBOARD_DIR, TFEVENTS)
#: what a checkpoint reader takes (None: nothing recognised, which the reader then judges itself)
CHECKPOINT_KINDS = (None, TORCH_ZIP, SAFETENSORS, TORCH_DIST, LEGACY, "a Megatron checkpoint save folder",
                    "a folder of safetensors checkpoints")
MINDFORMERS_KEYS = ("model", "parallel_config", "runner_config", "optimizer", "lr_schedule", "train_dataset",
                    "context", "parallel", "trainer", "run_mode")
_MEGATRON_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "tensor_model_parallel_size",
                  "seq_length", "micro_batch_size", "global_batch_size", "ffn_hidden_size", "padded_vocab_size")


def json_kind(obj: object) -> str | None:
    """The kind of a parsed JSON document, or None when it is none the tool writes or reads."""
    if not isinstance(obj, dict):
        return None
    if obj.get("kind") == "xf-align environment capture" or {"env", "versions", "framework", "captured"} <= set(obj):
        return ENV_CAPTURE
    if "verdict" in obj and isinstance(obj.get("stages"), dict):
        return SUMMARY
    if "name_scheme" in obj and "framework" in obj:
        return RUN_META
    if {"task", "level", "data"} <= set(obj):
        return MSPROBE_JSON
    if obj and all(isinstance(v, dict) and "values" in v and "start_step" in v for v in obj.values()):
        return GOLDEN
    inner = obj.get("args", obj.get("config", obj))
    if isinstance(inner, dict) and sum(str(k).replace("-", "_").lstrip("_") in _MEGATRON_KEYS for k in inner) >= 2:
        return MEGATRON_ARGS_JSON
    return None


def mapping_kind(obj: object) -> str | None:
    """The kind of a parsed YAML mapping: a MindFormers config, one of the JSON kinds, a name mapping."""
    if not isinstance(obj, dict):
        return None
    found = json_kind(obj)
    if found is not None:
        return found
    if "rules" in obj and isinstance(obj.get("rules"), list):
        return MAPPING_YAML
    if sum(k in obj for k in MINDFORMERS_KEYS) >= 1 and isinstance(obj.get("model", {}), dict):
        return MINDFORMERS_YAML
    return None


def _text_kind(text: str) -> str | None:
    if re.search(r"-{5,} arguments -{5,}|\biteration +\d+/ *\d+ \|", text):
        return MEGATRON_LOG
    if re.search(r"Epoch:\[ *\d+/ *\d+\], *step:\[", text):
        return MINDFORMERS_LOG
    stripped = text.lstrip()
    if stripped.startswith("{"):
        try:
            return json_kind(json.loads(text))
        except (ValueError, RecursionError):
            return None
    if re.search(r"^\s*(?:torchrun|python3?|deepspeed)\b.*(?:pretrain_|--)", text, re.M) or \
            stripped.startswith("#!"):
        return LAUNCH_SCRIPT
    if re.search(r"^(?:model|parallel_config|runner_config|train_dataset):\s*$", text, re.M):
        return MINDFORMERS_YAML
    return None


def _file_kind(p: Path) -> str | None:
    if "tfevents" in p.name:
        return TFEVENTS
    size = p.stat().st_size
    with open(p, "rb") as fh:
        head = fh.read(HEAD)
    if head.startswith(b"PK\x03\x04"):
        return TORCH_ZIP
    if head.startswith(b"\x93NUMPY"):
        return NPY
    if head.startswith(b"\x89HDF"):
        return HDF5
    if len(head) >= 10 and head[8:10] == b'{"':
        (n,) = struct.unpack("<Q", head[:8])
        if 8 + n <= size:
            return SAFETENSORS
    if size <= HEAD:
        try:
            return _text_kind(head.decode("utf-8-sig"))
        except UnicodeDecodeError:
            return None
    return _text_kind(head.decode("utf-8", errors="replace"))


def _dir_kind(p: Path) -> str | None:
    if (p / "meta.json").is_file():
        return RUN_STORE
    if (p / ".metadata").is_file():
        return TORCH_DIST
    names = [c.name for c in p.iterdir()][:10000]
    if any(re.fullmatch(r"mp_rank_\d\d(?:_\d\d\d)?", n) for n in names):
        return LEGACY
    if "latest_checkpointed_iteration.txt" in names or any(n.startswith("iter_") for n in names):
        return "a Megatron checkpoint save folder"
    if any(n.endswith(".safetensors") for n in names):
        return "a folder of safetensors checkpoints"
    if any(re.fullmatch(r"worker_\d+\.log", n) for n in names) or "msrun_log" in names:
        return MSRUN_DIR
    if any(re.fullmatch(r"rank_\d+", n) for n in names):
        return MINDSPORE_DUMP
    if any(re.fullmatch(r"step\d+", n) for n in names):
        return MSPROBE_DIR
    if any(re.fullmatch(r"step_\d+", n) for n in names):
        return "a step_N/rank_R batch dump"
    if any("tfevents" in n for n in names):
        return TENSORBOARD_DIR
    return None


def what_it_is(path: str | os.PathLike) -> str | None:
    """A few words naming what ``path`` looks like, or None when it is nothing recognised (or not readable)."""
    p = Path(path)
    try:
        st = p.stat()
        if stat.S_ISDIR(st.st_mode):
            return _dir_kind(p)
        if stat.S_ISREG(st.st_mode):
            return _file_kind(p)
    except (OSError, ValueError):
        return None
    return None


def refuse_unless(path: str | os.PathLike, accepted: tuple[str | None, ...], wanted: str) -> None:
    """BadInput ``"PATH: <what it looks like>, not <wanted>"`` when ``path`` is recognisably a kind outside
    ``accepted`` (None in ``accepted``: an unrecognised input is left to the reader)."""
    from core.errors import BadInput

    kind = what_it_is(path)
    if kind not in accepted:
        raise BadInput(not_this(path, wanted, kind) or f"{path}: not {wanted}")


def not_this(path: str | os.PathLike, wanted: str, kind: str | None = None) -> str | None:
    """``"PATH: <what it looks like>, not <wanted>"``, or None when it is not recognisably something else."""
    kind = kind if kind is not None else what_it_is(path)
    return f"{path}: {kind}, not {wanted}" if kind else None
