"""Same data: each run's batches checked (ids, shift, masks, pad == eos), and the candidate's against the
baseline's, step by step."""

from __future__ import annotations

from typing import Any

from align.checks.data import check_batches, compare_batches, iter_batches, megatron_vocabulary
from align.stages import LATER, Stage
from align.stages.evidence import Evidence
from core.errors import BadInput
from core.findings import StageResult, skipped

_IDS = ("vocab_size", "eos_id", "pad_id", "tokenizer_vocab_size")


def recorded_ids(runs: list[tuple[dict[str, Any], tuple[str, dict[str, Any]] | None]]) -> dict[str, Any]:
    """vocab_size (the model's padded vocabulary), tokenizer_vocab_size, special_ids, eos_id, pad_id from runs'
    (meta, config) pairs: a meta ``data`` block (a dumper's, or a Megatron log's '> padded vocab' line), else
    what a run's Megatron arguments say (align.checks.data.megatron_vocabulary)."""
    out: dict[str, Any] = {}
    for meta, _ in runs:
        data = meta.get("data")
        if isinstance(data, dict):
            for k in _IDS:
                if isinstance(data.get(k), int) and not isinstance(data.get(k), bool):
                    out.setdefault(k, data[k])
            if "vocab_size" in data and isinstance(data.get("vocab_source"), str):
                out.setdefault("vocab_source", data["vocab_source"])
    for _, cfg in runs:
        if not cfg or cfg[0] != "megatron_args":
            continue
        derived = megatron_vocabulary(cfg[1])
        if "vocab_size" in out and derived.get("vocab_size") != out["vocab_size"]:
            derived = {k: v for k, v in derived.items() if k == "special_ids"}
        for k, v in derived.items():
            out.setdefault(k, v)
    return out


def with_options(ids: dict[str, Any], vocab_size: int | None, eos_id: int | None, pad_id: int | None
                 ) -> dict[str, Any]:
    """The command line's ids over the recorded ones (--vocab-size is the model's vocabulary as given)."""
    out = dict(ids)
    for k, v in (("vocab_size", vocab_size), ("eos_id", eos_id), ("pad_id", pad_id)):
        if v is not None:
            out[k] = v
            if k == "vocab_size":
                out["vocab_source"] = "--vocab-size"
                out.pop("tokenizer_vocab_size", None)
    return out


def data_ids(ev: Evidence) -> dict[str, Any]:
    """The ids the data checks judge by: the command line, else what the two runs recorded."""
    ids = recorded_ids([(ev.baseline.meta, ev.config("baseline")), (ev.candidate.meta, ev.config("candidate"))])
    o = ev.options
    return with_options(ids, o.vocab_size, o.eos_id, o.pad_id)


def run(ev: Evidence) -> StageResult:
    res = StageResult("data_checks")
    ids = data_ids(ev)
    res.details["ids"] = ids
    checked = []
    for role, r in (("baseline", ev.baseline), ("candidate", ev.candidate)):
        if r.store is None or not any(r.store.has_group(s, "batch") for s in r.store.array_steps()[:1]):
            continue
        try:
            one = check_batches(iter_batches(r.path), **ids)
        except BadInput:
            continue
        checked.append(role)
        for f in one.findings:
            f.message = f"{role}: {f.message}"
            res.add(f)
        steps = one.details["steps"]
        res.details[role] = {"batches": one.details["batches"], "eod_targets": one.details["eod_targets"],
                             "eod_trained": one.details["eod_trained"],
                             "loss_mask_sum_first_last": [steps[0]["loss_mask_sum"], steps[-1]["loss_mask_sum"]]}
    if not checked:
        return skipped("data_checks", "neither run recorded its batches")
    if len(checked) == 2:
        same = compare_batches(ev.baseline.path, ev.candidate.path)
        for f in same.findings:
            res.add(f)
        res.details["same_data"] = same.details
    return res


STAGE = Stage(
    name="data_checks", order=30, title="Data checks",
    needs="batches recorded in the run stores (batch/tokens, labels, loss_mask)",
    capture="the dumpers record every step's batch by default (MegatronDumper / MindSporeDumper, "
            "DumpConfig(batch=True)); the candidate should replay the baseline's batches "
            "(dumpers.mindformers_replay.MegatronReplayDataset; at another DP size it re-splits the global batch by "
            "sample and the dumper records each row's position and hashes, checked sample by sample)",
    run=run,
    part="same start", explains=LATER,
    why=("The runs did not train on the same valid tokens and masks: a loss difference may come from the data, "
         "not the model."),
    next=("align check-data on each run's batches, and fix the loader or the tokenizer setting behind "
          "{component} (the candidate replays the baseline's batches: dumpers.mindformers_replay)"))
