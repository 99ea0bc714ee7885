"""MoE routing at the first step both stores recorded it: per router, the precision it routes in, its logits and
score statistics, the top-k choices (near ties tolerated) and tokens per expert, through the mapping's expert
order; a router fault is named at the router (decoder.layers.L.mlp.router), not at a later layer's norm."""

from __future__ import annotations

from html import escape
from typing import Any

from align.stages import AFTER_STEP1, Stage
from align.stages.evidence import Evidence
from comparators.routing import STAGE as NAME
from comparators.routing import RoutingTolerance, compare_routing, counts_by_step
from core.findings import Finding, StageResult, skipped
from reports.html import table
from runstore import Run
from runstore.routing import ROUTING_GROUP, RouterRecord, read_counts, read_routing

SEARCH = 20
COUNT_STEPS = 2000
ROW_KEYS = ("router", "verdict", "baseline_precision", "candidate_precision", "logits_rel_l2", "stats_worst",
            "baseline_entropy", "candidate_entropy", "topk_agreement", "near_ties", "flips", "tokens_per_expert",
            "expert_permutation")


def _routing_steps(run: Run) -> list[int]:
    store = run.store
    if store is None:
        return []
    return [s for s in store.array_steps()[:SEARCH] if store.has_group(s, ROUTING_GROUP)]


def _records(run: Run, step: int) -> tuple[dict[str, RouterRecord], int]:
    store = run.store
    rank = store.array_ranks(step)[0]
    return read_routing(store.step_file(step, rank)), rank


def expert_order_note(mapping: str) -> str:
    """Where the expert order comes from: routing records hold global expert indices on both sides (a
    router scores every expert), and the mcore presets stack experts in global order (global index =
    ep_rank * E_local + e), so the order is the identity."""
    return (f"identity (mapping {mapping}: both sides' routers score every expert by its global index; the "
            "preset stacks experts in that order, global index = ep_rank x E_local + e)")


def run(ev: Evidence) -> StageResult:
    b, c = ev.baseline, ev.candidate
    steps = sorted(set(_routing_steps(b)) & set(_routing_steps(c)))
    if not steps:
        which = [r.label for r in (b, c) if not _routing_steps(r)]
        return skipped(NAME, f"no routing records in {', '.join(which)} (a dense model, a log, or a store "
                             "dumped without DumpConfig(routing=True))")
    step = steps[0]
    (base, brank), (cand, crank) = _records(b, step), _records(c, step)
    dtype, dtype_source = ev.dtype
    tol = RoutingTolerance.for_dtype(dtype, ev.options.layer_tolerance)
    rows, findings = compare_routing(base, cand, tol)
    res = StageResult(NAME, details={
        "step": step, "steps_recorded": steps, "ranks": [brank, crank], "compared": len(rows),
        "routers": [r["router"] for r in rows], "dtype": dtype, "dtype_source": dtype_source,
        "expert_order": expert_order_note(ev.mapping),
        "per_layer": rows,
        "failing_routers": [r["router"] for r in rows if r["verdict"] == "fail"],
        "first_failing": next((r["router"] for r in rows if r["verdict"] == "fail"), None),
        "tolerance": {"logits_pass": tol.rel_pass, "logits_fail": tol.rel_fail,
                      "margin_ulps": tol.margin_ulps, "flip_warn": tol.flip_warn}})
    counts = counts_by_step(_all_counts(b), _all_counts(c))
    if counts:
        moved = [r for r in counts if r["moved_share"] > 0]
        res.details["counts_by_step"] = counts
        res.details["counts_steps"] = len(counts)
        res.details["first_step_counts_differ"] = moved[0]["step"] if moved else None
    aux = _aux_losses(ev, step)
    if aux:
        res.details["aux_losses"] = aux
    for f in findings:
        res.add(f)
    if not rows:
        res.add(Finding(NAME, "warn", None, "routers_compared", 0, None,
                        f"step {step}: no router recorded by both runs (baseline {sorted(base)}, candidate "
                        f"{sorted(cand)})"))
    elif not any(f.verdict != "pass" for f in res.findings):
        agree = min(r["topk_agreement"] for r in rows)
        res.add(Finding(NAME, "pass", None, "routers_compared", len(rows), None,
                        f"step {step}: {len(rows)} routers route alike (same precision, logits within the {dtype} "
                        f"line, top-k agreement {agree:.3f} with near ties tolerated, tokens per expert equal)"))
    return res


def _all_counts(run: Run) -> dict[int, dict[str, Any]]:
    """Tokens per expert of every array step (rank 0 / the first rank), up to COUNT_STEPS steps."""
    store = run.store
    out: dict[int, dict[str, Any]] = {}
    if store is None:
        return out
    for s in store.array_steps()[:COUNT_STEPS]:
        counts = read_counts(store.step_file(s, store.array_ranks(s)[0]))
        if counts:
            out[s] = counts
    return out


def _aux_losses(ev: Evidence, step: int) -> dict[str, Any]:
    """The load-balancing losses both runs recorded at the routing step (compared by the aux_losses stage)."""
    out = {}
    for key in ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss", "z_loss"):
        vals = [r.series(key) for r in (ev.baseline, ev.candidate)]
        if all(step in v.index for v in vals):
            out[key] = {"baseline": float(vals[0][step]), "candidate": float(vals[1][step])}
    return out


def section(res: StageResult) -> str:
    rows = res.details.get("per_layer") or []
    if not rows:
        return ""
    d = res.details
    head = (f"<p>Step {d.get('step')} (rank {d['ranks'][0]} / {d['ranks'][1]}), judged at "
            f"{escape(str(d.get('dtype')))} ({escape(str(d.get('dtype_source')))}); expert order: "
            f"{escape(str(d.get('expert_order')))}. Precision: "
            "logits/probabilities where they differ; tokens per expert: baseline / candidate; a flip is a token "
            "whose top-k set differs beyond a near tie (the baseline's margin above the noise).</p>")
    body = head + table([{k: r.get(k) for k in ROW_KEYS} for r in rows], row_class="verdict")
    counts = d.get("counts_by_step") or []
    if counts:
        first = d.get("first_step_counts_differ")
        body += (f"<p>Tokens per expert at every step both runs counted ({len(counts)} steps): "
                 + ("equal at every step.</p>" if first is None else
                    f"first differing at step {first} (shown from there: the share of a router's choices that "
                    "moved; not judged, routing drifts with the weights after step 1).</p>"))
        if first is not None:
            shown = [r for r in counts if r["step"] >= first][:12]
            body += table(shown)
    return body


STAGE = Stage(
    name=NAME, order=65, title="MoE routing (router precision, logits, top-k choices, tokens per expert)",
    needs="routing records (routing/<router>/ in a step file) of the same step in both run stores",
    capture="MegatronDumper / TorchDumper and MindSporeDumper DumpConfig(tensor_steps=[1, 2], routing=True) "
            "(Megatron-core TopKRouter hook; MindFormers TopKRouter wrapped in GRAPH or PYNATIVE)",
    run=run, section=section,
    summary_keys=("step", "compared", "routers", "failing_routers", "first_failing", "dtype",
                  "first_step_counts_differ"),
    part="step 1 and 2", explains=("layer_tensors", "isolation", *AFTER_STEP1),
    why=("The router picks other experts for the same tokens: its precision, or the expert order of its "
         "weights, differs; every MoE layer from there computes on other experts."),
    next=("compare {component}'s compute dtype (Megatron --moe-router-dtype, MindFormers router_dense_type) and "
          "its expert order in the conversion (align compare-weights)"))
