"""Router losses a Megatron-LM log prints for one data-parallel rank only, told apart by the arguments block.

Why: ``training_log`` adds the MoE router losses to its line from the tracker after
``reduce_aux_losses_tracker_across_ranks`` and prints the line on the last rank (``print_rank_last``). Which
losses that reduction averages over data-parallel ranks depends on the release (read from the sources of
NVIDIA/Megatron-LM, megatron/core/transformer/moe/{router,moe_utils,moe_logging}.py):

* core 0.12 - 0.13: a loss is reduced over its ``reduce_group`` / ``avg_group`` only; ``load_balancing_loss``
  sums over the sequence-parallel group and ``z_loss`` has no group: both are the last rank's own;
* core 0.14 - 0.15: every loss is then averaged over the data-parallel group (with context parallel);
* core 0.16 - 0.17: averaged over DP only when the loss has a ``reduce_group`` whose group lacks DP;
  ``z_loss`` is saved without one (``apply_z_loss``), so the printed ``z_loss`` is the last rank's own;
* core >= 0.18 (MoEMetricsTracker): ``needs_dp_avg`` defaults to True: every loss is averaged over DP.

A dumper records each rank's own value and the run store reads the data-parallel ranks' mean (the whole
batch's), so at DP > 1 the printed value of a rank-local loss is not the run's: measured on core_v0.16.1 at
EP=2 (DP=2), the log's iteration-2 ``z_loss`` (un-averaged: 1.887883) is rank 1's (the dumper's 1.887882),
the ranks' mean 1.917531. Such a loss is kept as ``<key>_last_rank`` (not compared as the run's) with a
note; the release comes from arguments only it prints, as :func:`sources.megatron_log.averaging_evidence`
tells core 0.16.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

#: Arguments every Megatron-LM from core 0.14 prints and 0.12 / 0.13 do not (their parse_args namespaces,
#: core_v0.12.0 .. core_v0.18.0 and main of 2026-11 compared).
SINCE_CORE_0_14 = ("cache_mla_latents", "full_validation", "moe_router_fusion", "rope_type", "save_retain_interval",
                   "use_megatron_fsdp")
#: Arguments Megatron-LM added in core 0.16.0 (none of them in 0.15.3 or earlier; all in 0.16.0 to 0.19.0 and
#: main of 2026-08): 0.16.0 is the release whose ``training_log`` prints the first iteration of a process
#: without resetting its accumulators, so the next printed line is the mean over both.
SINCE_CORE_0_16 = ("save_wgrads_interval", "save_dgrads_interval", "log_max_attention_logit", "exit_signal",
                   "mtp_standalone", "batch_invariant_mode")
#: Arguments every Megatron-LM from core 0.18 prints and 0.12 .. 0.17.1 do not (same comparison).
SINCE_CORE_0_18 = ("save_params_interval", "save_activations_interval", "null_tokenizer_eod_id",
                   "eval_micro_batch_size", "validation_set_names", "start_eval_at_iter")
#: The router losses printed for the last rank alone, by release range.
RANK_LOCAL = {"core <= 0.13": ("load_balancing_loss", "z_loss"), "core 0.16 - 0.17": ("z_loss",),
              "core 0.14 - 0.15": (), "core >= 0.18": ()}
SUFFIX = "_last_rank"
_FULL_BLOCK = 100   # Megatron-LM prints every argument (450+); fewer lines were cut by hand


def _has(config: dict[str, Any], names: tuple[str, ...]) -> list[str]:
    return [n for n in names if n in config]


def release_range(config: dict[str, Any]) -> tuple[str | None, str]:
    """Which of RANK_LOCAL's release ranges printed this arguments block, and why; (None, why) if it cannot
    be told (no block, or one cut short without the markers)."""
    if not config:
        return None, "the log has no arguments block to tell the Megatron-LM release"
    for names, since, label in ((SINCE_CORE_0_18, "0.18", "core >= 0.18"),
                                (SINCE_CORE_0_16, "0.16", "core 0.16 - 0.17")):
        found = _has(config, names)
        if len(found) >= 2:
            return label, f"the arguments block lists {found[0]} and {found[1]} (Megatron-LM core >= {since})"
    full = not getattr(config, "abbreviated", False) and len(config) >= _FULL_BLOCK
    found = _has(config, SINCE_CORE_0_14)
    if len(found) >= 2:
        return "core 0.14 - 0.15", (f"the arguments block lists {found[0]} and {found[1]} (core >= 0.14) and "
                                    "none of the core 0.16 arguments")
    if full:
        return "core <= 0.13", (f"the arguments block ({len(config)} arguments) has none of the arguments of core "
                                f">= 0.14 ({', '.join(SINCE_CORE_0_14[:3])}, ...)")
    return None, f"the arguments block is cut short ({len(config)} arguments) and does not tell the release"


def _dp_size(config: dict[str, Any], parallel: dict[str, Any] | None) -> int | None:
    v = config.get("data_parallel_size") if config else None
    if v is None and parallel:
        v = parallel.get("dp")
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


def rank_local_losses(series: dict[str, pd.Series], config: dict[str, Any], notes: list[str],
                      parallel: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Move each router loss this release prints for the last rank alone (at DP > 1) to ``<key>_last_rank`` in
    ``series``, in place, with one note; where the release cannot be told, keep it and say it may be one rank's.
    Returns the ``meta["rank_local_losses"]`` entry, or None when nothing applies."""
    printed = [k for k in ("load_balancing_loss", "z_loss") if k in series]
    dp = _dp_size(config, parallel)
    if not printed or dp is None or dp <= 1:
        return None     # DP = 1: the last rank's value is the batch's (DP not stated: nothing to say)
    label, why = release_range(config)
    if label is None:
        notes.append(f"{' and '.join(printed)}: Megatron-LM core <= 0.13 and 0.16 - 0.17 print the last rank's own "
                     f"value of some router losses (not averaged over the {dp} data-parallel ranks), and {why}: "
                     "kept as printed")
        return {"release": None, "why": why, "moved": [], "data_parallel": dp}
    moved = [k for k in printed if k in RANK_LOCAL[label]]
    if not moved:
        return None
    for key in moved:
        s = series.pop(key)
        s.name = key + SUFFIX
        series[key + SUFFIX] = s
    where = f"the {dp} data-parallel ranks"
    notes.append(f"{', '.join(moved)}: Megatron-LM {label} prints the last rank's own value, not averaged over "
                 f"{where} ({why}; the router saves {'them' if len(moved) > 1 else 'it'} without a data-parallel "
                 f"reduction): read as {', '.join(k + SUFFIX for k in moved)}, not as the run's")
    return {"release": label, "why": why, "moved": moved, "data_parallel": dp}
