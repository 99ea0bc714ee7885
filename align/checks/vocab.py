"""The checklist's vocabulary row: Megatron's padded vocabulary against the MindFormers YAML's vocab_size.

Megatron-LM never builds an embedding of the tokenizer's size: megatron/training/tokenizer/tokenizer.py
``_vocab_size_with_padding`` (read in core_v0.16.1) rounds it up to a multiple of ``make_vocab_size_divisible_by``
(default 128) x the tensor-parallel size (``multiple = args.make_vocab_size_divisible_by *
args.tensor_model_parallel_size; after = int(math.ceil(after / multiple) * multiple)``), so ``--vocab-size 127``
(NullTokenizer: 128 ids) gives 128 rows at TP=1 and 256 at TP=2. MindFormers does not pad: its
``model_config.vocab_size`` is the embedding's row count, and a converted Megatron checkpoint loads only when the
two agree (found on the user's path, issue 37). The checklist already compares the two numbers (align.checks.config, key
``vocab_size``); this module says why they differ and the number to put in the YAML.

Rows are the checklist's own (align.checks.config.Row, changed in place); this module does not import the
checklist, which calls it.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableSequence
from typing import Any

from align.checks.data import megatron_vocabulary

#: Megatron-LM's defaults for the two arguments that set the padding (megatron/training/arguments.py)
MEGATRON_PADDING_DEFAULTS = {"make_vocab_size_divisible_by": 128, "tensor_model_parallel_size": 1}
#: where the YAML holds it: the legacy Llama and the mcore models alike
YAML_KEY = "model.model_config.vocab_size"


def padded_vocab_size(vocab_size: int, divisible_by: int = 128, tp: int = 1) -> int:
    """Megatron-LM's ``_vocab_size_with_padding``: ``vocab_size`` rounded up to a multiple of
    ``divisible_by`` x ``tp``."""
    multiple = max(1, int(divisible_by)) * max(1, int(tp))
    return -(-int(vocab_size) // multiple) * multiple


def megatron_padding(args: Mapping[str, Any]) -> dict[str, Any]:
    """The vocabulary a Megatron run's embedding has (align.checks.data.megatron_vocabulary) with Megatron's
    padding defaults filled in where the arguments do not state them (a launch script names only what it
    changes; a log's full arguments block states both). An abbreviated block gets no defaults."""
    filled = dict(args)
    if not getattr(args, "abbreviated", False):
        for k, v in MEGATRON_PADDING_DEFAULTS.items():
            if filled.get(k) is None:
                filled[k] = v
    return megatron_vocabulary(filled)


def explain_vocab(rows: MutableSequence[Any], mg_args: Mapping[str, Any]) -> None:
    """Give the checklist's ``vocab_size`` row the number to use when the YAML's vocab_size differs from
    Megatron's padded vocabulary (a mismatch: the converted embedding would not load), or when the YAML does
    not set it. The row keeps its status; its note says Megatron's rows, how they came about and what to set."""
    row = next((r for r in rows if getattr(r, "key", None) == "vocab_size"), None)
    if row is None or not isinstance(row.megatron, int) or isinstance(row.megatron, bool):
        return
    padded, mf = row.megatron, row.mindformers
    if isinstance(mf, int) and not isinstance(mf, bool) and mf == padded:
        return
    info = megatron_padding(mg_args)
    how = info.get("vocab_source") if info.get("vocab_size") == padded else None
    why = f"Megatron's embedding has {padded} rows" + (f" ({how}, as Megatron's _vocab_size_with_padding pads)"
                                                       if how else "")
    if isinstance(mf, int) and not isinstance(mf, bool):
        unpadded = info.get("tokenizer_vocab_size")
        near = " (the unpadded size: MindFormers does not pad)" if mf in (unpadded, mg_args.get("vocab_size")) else ""
        note = (f"{why}; the YAML's vocab_size {mf}{near} cannot load the converted embedding and output layer: "
                f"set {YAML_KEY}: {padded}")
    else:
        note = f"{why}: set {YAML_KEY}: {padded} so the converted embedding and output layer load"
    row.note = f"{row.note}; {note}" if row.note else note


__all__ = ["MEGATRON_PADDING_DEFAULTS", "YAML_KEY", "explain_vocab", "megatron_padding", "padded_vocab_size"]
