"""Auxiliary losses (MoE load balancing, z-loss, MTP) per step, by name, in the baseline's scaling.

Why: the lm loss can agree while a router or an MTP head does not (a coefficient, a load-balancing type, a
mask); the aux losses both runs log name it. The scalings differ between the frameworks (comparators.
aux_losses says how); the settings a conversion needs come from the runs' configs, read here.
"""

from __future__ import annotations

import re
from html import escape
from typing import Any

from align.stages import Stage
from align.stages.evidence import Evidence
from comparators.aux_losses import AuxSettings, compare_aux_losses
from core.findings import StageResult
from models.mindformers_parallel import MAX_LAYERS
from models.mindformers_yaml import MCORE_ALIASES, NOT_READ, mcore_value, model_config
from reports import html

_TERM = re.compile(r"\[\s*([01](?:\s*,\s*[01])*)\s*\](?:\s*\*\s*(\d+))?")


def moe_pattern(num_layers: Any, freq: Any, first_k_dense: Any = None) -> list[int] | None:
    """Which decoder layers are MoE (1) as both frameworks read ``moe_layer_freq`` (an int N: every N-th
    layer; a list; Megatron's string form ``([0]*3+[1]*61)``) or MindFormers' ``first_k_dense_replace``;
    None when it cannot be told (also for a layer count past MAX_LAYERS: nothing is sized from it)."""
    if not isinstance(num_layers, int) or isinstance(num_layers, bool) or not 0 < num_layers <= MAX_LAYERS:
        return None
    if isinstance(first_k_dense, int) and not isinstance(first_k_dense, bool) and first_k_dense:
        k = min(max(first_k_dense, 0), num_layers)     # k >= num_layers: every layer dense
        return [0] * k + [1] * (num_layers - k)
    if freq is None:
        freq = 1
    if isinstance(freq, int) and not isinstance(freq, bool) and freq > 0:
        return [1 if i % freq == 0 else 0 for i in range(num_layers)]
    if isinstance(freq, (list, tuple)) and all(x in (0, 1) for x in freq):
        return [int(x) for x in freq] if len(freq) == num_layers else None
    if isinstance(freq, str):
        text = freq.strip().strip("()").replace(" ", "")
        out: list[int] = []
        for part in text.split("+"):
            m = _TERM.fullmatch(part)
            if m is None or len(m.group(2) or "") > 6:
                return None
            term = [int(x) for x in m.group(1).split(",")]
            if len(out) + len(term) * int(m.group(2) or 1) > num_layers:   # counted before it is allocated
                return None
            out += term * int(m.group(2) or 1)
        return out if len(out) == num_layers else None
    return None


def _number(v: Any) -> Any:
    return None if v is NOT_READ or isinstance(v, bool) else v


def _side(kind: str, values: dict[str, Any]) -> dict[str, Any]:
    """The settings one config states: mtp layers and factor, the MoE pattern, the load-balancing type."""
    if kind == "mindformers_yaml":
        mc = model_config(values)
        g = (lambda k: _number(mcore_value(mc, k)) if k in MCORE_ALIASES else mc.get(k))   # noqa: E731
        return {"mtp_num_layers": g("mtp_num_layers"), "mtp_loss_scaling_factor": g("mtp_loss_scaling_factor"),
                "pattern": moe_pattern(g("num_layers"), mc.get("moe_layer_freq"), mc.get("first_k_dense_replace")),
                "balance": g("moe_router_load_balancing_type")}
    return {"mtp_num_layers": values.get("mtp_num_layers"),
            "mtp_loss_scaling_factor": values.get("mtp_loss_scaling_factor"),
            "pattern": moe_pattern(values.get("num_layers"), values.get("moe_layer_freq")),
            "balance": values.get("moe_router_load_balancing_type")}


def settings(ev: Evidence) -> AuxSettings:
    """What the conversions need, from the MindFormers config first (its values are the scaled ones), then
    the Megatron one; ``source`` names the config each came from."""
    sides = []
    for role in ("baseline", "candidate"):
        cfg = ev.config(role)
        if cfg is not None and isinstance(cfg[1], dict):
            what = "MindFormers YAML" if cfg[0] == "mindformers_yaml" else "Megatron arguments"
            sides.append((f"the {role}'s {what}", cfg[0], _side(cfg[0], cfg[1])))
    sides.sort(key=lambda t: t[1] != "mindformers_yaml")
    out: dict[str, Any] = {}
    source: dict[str, str] = {}
    for key in ("mtp_num_layers", "mtp_loss_scaling_factor", "pattern", "balance"):
        for where, kind, vals in sides:
            v = vals.get(key)
            if key == "balance" and kind != "mindformers_yaml":
                continue
            if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or v >= 0):
                out[key], source[key] = v, where
                break
    pattern = out.get("pattern")
    if pattern is not None:
        source["moe_layers"] = source.pop("pattern")
    n_mtp = out.get("mtp_num_layers")
    return AuxSettings(
        mtp_num_layers=int(n_mtp) if isinstance(n_mtp, (int, float)) and not isinstance(n_mtp, bool) else None,
        mtp_loss_scaling_factor=float(out["mtp_loss_scaling_factor"]) if isinstance(
            out.get("mtp_loss_scaling_factor"), (int, float)) else None,
        moe_layers=sum(pattern) if pattern else None, last_layer_moe=bool(pattern[-1]) if pattern else None,
        mindformers_balance_type=out.get("balance") if isinstance(out.get("balance"), str) else None,
        source=source)


def run(ev: Evidence) -> StageResult:
    return compare_aux_losses(ev.baseline, ev.candidate, ev.repeats, ev.options.scalar, settings(ev))


def section(res: StageResult) -> str:
    """One row per aux loss: the keys paired, each side's scaling, the factor, the worst step."""
    keys = ("loss", "verdict", "steps", "max_rel_delta", "first_step_outside", "baseline_key", "candidate_key",
            "baseline_scaling", "candidate_scaling", "factor")
    rows = [{k: r.get(k) for k in keys} for r in res.details.get("losses", [])]
    only = [f"only in the baseline: {', '.join(res.details['only_baseline'])}" if res.details.get("only_baseline")
            else "", f"only in the candidate: {', '.join(res.details['only_candidate'])}"
            if res.details.get("only_candidate") else ""]
    notes = "".join(f"<p class='muted'>{escape(t)}</p>" for t in only if t)
    return html.table(rows) + notes


STAGE = Stage(
    name="aux_losses", order=135, title="Auxiliary losses (MoE load balancing, z-loss, MTP)",
    needs="an aux loss per step in both runs: load_balancing_loss (or seq_ / global_), z_loss, mtp_loss or "
          "mtp_K_loss",
    capture="Megatron-LM: the wrapper (python -m dumpers.megatron_lm) records them from the router and MTP "
            "trackers, and its log prints them for MoE / --mtp-num-layers models; MindFormers 2.x: MFLossMonitor "
            "prints load_balancing_loss and mtp_loss with print_separate_loss: True (mcore MoE / MTP models); "
            "with MTP pass --candidate-config YAML so MindFormers' mtp_loss scaling is known",
    run=run, section=section, summary_keys=("compared", "losses"),
    part="long run", explains=("long_run", "grad_norm", "norm_trajectories", "spikes", "divergence_data"),
    why=("An auxiliary loss (MoE load balancing, z-loss, MTP) differs: its coefficient, its scaling or the "
         "routing it measures differs, and it changes every gradient after it."),
    next=("compare the aux-loss settings behind {component} (Megatron --moe-aux-loss-coeff, --mtp-loss-scaling- "
          "factor; MindFormers moe_config / mtp settings) with align check-config"))
