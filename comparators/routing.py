"""MoE routing compared router by router: the precision each side routes in, the logits, the top-k choices and
the tokens each expert receives, through the mapping's expert order.

Why at the router: a router computed in a lower precision, or experts stored in another order than the router's
rows, changes which expert a token reaches; the layer's output statistics then move by a few 1e-4, under the
noise of a float16 comparison, while the choices themselves say it plainly. Near ties are not faults: a token
whose k-th and (k+1)-th experts are closer (in the baseline's logits) than the dtype's noise may flip on either
side, so a flip is counted against the pair only where the baseline's margin is above that noise.

Framework-free: reads :class:`runstore.routing.RouterRecord` (numpy arrays).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from comparators.tensor_pair import TOLERANCE
from core.dtypes import EPS, normalize
from core.findings import Finding
from runstore.routing import RouterRecord

STAGE = "moe_routing"
# Precision a side's logits carry, coarsest first: every finite non-zero value exactly representable in it.
_PRECISIONS = ("bfloat16", "float16")
_MIN_VALUES = 16          # fewer values than this say nothing about the precision they were computed in
_EXACT_SHARE = 0.999


@dataclass(frozen=True)
class RoutingTolerance:
    """Judged at the pair's dtype (``dtype``): logits and their statistics pass up to ``rel_pass`` relative (to
    the baseline's RMS logit), fail beyond ``rel_fail`` (warn between): the layer tensors' lines per dtype
    (:data:`comparators.tensor_pair.TOLERANCE`, overridden by ``--layer-tolerance``). A flip counts only where
    the baseline's margin between the two experts exceeds ``margin_ulps`` x the dtype's eps x max(1, the
    token's largest |logit|); flips beyond ``flip_warn`` of the tokens fail (one or more warn)."""

    dtype: str = "float32"
    rel_pass: float = TOLERANCE["float32"][0]
    rel_fail: float = TOLERANCE["float32"][1]
    margin_ulps: float = 8.0
    flip_warn: float = 0.01

    @classmethod
    def for_dtype(cls, dtype: str, overrides: Mapping[str, Sequence[float]] | None = None) -> RoutingTolerance:
        d = normalize(dtype)
        line = (overrides or {}).get(d) or TOLERANCE.get(d) or TOLERANCE["float32"]
        return cls(dtype=d, rel_pass=float(line[0]), rel_fail=float(line[1]))

    @property
    def eps(self) -> float:
        return EPS.get(normalize(self.dtype), EPS["float32"])


def effective_precision(values: np.ndarray, declared: str = "float32") -> str:
    """The precision ``values`` were computed in: the declared dtype, or a coarser one when every finite non-zero
    value is exactly representable in it (a router computed in float16 and cast back to float32 still is)."""
    declared = normalize(declared)
    v = np.asarray(values, np.float32).ravel()
    v = v[np.isfinite(v) & (v != 0)]
    if v.size < _MIN_VALUES or declared in _PRECISIONS:
        return declared
    for p in _PRECISIONS:
        if np.mean(_round_to(v, p) == v) >= _EXACT_SHARE:
            return p
    return declared


def _round_to(v: np.ndarray, precision: str) -> np.ndarray:
    if precision == "float16":
        with np.errstate(over="ignore"):
            return v.astype(np.float16).astype(np.float32)
    bits = v.view(np.uint32).astype(np.uint64)             # bfloat16: round to nearest even on the top 16 bits
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32)


def _coarser(a: str, b: str) -> bool:
    return EPS.get(normalize(a), 0.0) > EPS.get(normalize(b), 0.0)


def scores(rec: RouterRecord) -> np.ndarray:
    """The router's score distribution per token (softmax of the logits, or normalised sigmoid)."""
    z = rec.logits.astype(np.float64)
    if str(rec.attrs.get("score_function", "softmax")) == "sigmoid":
        s = 1.0 / (1.0 + np.exp(-z))
        return s / s.sum(axis=1, keepdims=True)
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def statistics(rec: RouterRecord) -> dict[str, float]:
    """max / min / mean / L2 of the logits, mean entropy of the score distribution (nats), mean top-k
    probability."""
    z = rec.logits.astype(np.float64)
    p = scores(rec)
    ent = float(np.mean(-np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=1)))
    probs = rec.topk_probs[rec.topk_index >= 0]
    return {"max": float(z.max()), "min": float(z.min()), "mean": float(z.mean()),
            "norm": float(np.sqrt(np.sum(z * z))), "entropy": ent,
            "topk_prob_mean": float(probs.mean()) if probs.size else float("nan")}


def nonfinite(rec: RouterRecord) -> tuple[int, int, str]:
    """(non-finite logits, non-finite probabilities of chosen experts, where the first is) of one record."""
    bad_logits = ~np.isfinite(rec.logits)
    bad_probs = ~np.isfinite(rec.topk_probs) & (rec.topk_index >= 0)
    where = ""
    for what, mask, col in (("logits", bad_logits, "expert"), ("topk_probs", bad_probs, "choice")):
        if mask.any():
            t, j = np.argwhere(mask)[0]
            experts = sorted({int(x) for x in np.argwhere(mask)[:, 1]})[:8]
            where = (f"first: token {int(t)}, {col} {int(j)} in {what}; {col}s {experts}"
                     if not where else where)
    return int(bad_logits.sum()), int(bad_probs.sum()), where


def _layer_key(module: str) -> tuple[int, str]:
    m = re.search(r"layers\.(\d+)\.", module)
    return (int(m.group(1)) if m else 1 << 30, module)


def find_permutation(base: np.ndarray, cand: np.ndarray) -> list[int] | None:
    """The candidate expert whose logit column matches each baseline expert's (a permutation), when the
    columns match one to one and not in the identity order; None otherwise."""
    e = base.shape[1]
    scale = float(np.sqrt(np.mean(base.astype(np.float64) ** 2))) or 1.0
    cost = np.array([[np.sqrt(np.mean((base[:, j].astype(np.float64) - cand[:, c]) ** 2)) / scale
                      for c in range(e)] for j in range(e)])
    perm = [int(np.argmin(cost[j])) for j in range(e)]
    if sorted(perm) != list(range(e)) or perm == list(range(e)):
        return None
    matched = float(np.mean([cost[j, perm[j]] for j in range(e)]))
    identity = float(np.mean(np.diag(cost)))
    return perm if matched < 0.25 * identity else None


def compare_router(base: RouterRecord, cand: RouterRecord, tol: RoutingTolerance,
                   expert_order: Sequence[int] | None = None) -> tuple[dict[str, Any], list[Finding]]:
    """One router: its row of the per-layer table and its findings (component: the router's module name).
    ``expert_order[c]``: the baseline expert the candidate's expert ``c`` is (the mapping; identity when
    None)."""
    name = base.module
    row: dict[str, Any] = {"router": name, "tokens": int(base.logits.shape[0]), "experts": base.num_experts,
                           "topk": base.topk}
    out: list[Finding] = []
    if (base.logits.shape != cand.logits.shape or base.topk_index.shape != cand.topk_index.shape):
        row["verdict"] = "fail"
        out.append(Finding(STAGE, "fail", name, "routing_shape", str(cand.logits.shape), str(base.logits.shape),
                           f"{name}: the candidate routed {cand.logits.shape[0]} tokens over {cand.num_experts} "
                           f"experts (top-{cand.topk}), the baseline {base.logits.shape[0]} over {base.num_experts} "
                           f"(top-{base.topk}): not the same batch or router"))
        return row, out
    bad = {"baseline": nonfinite(base), "candidate": nonfinite(cand)}
    for side, (n_logits, n_probs, where) in bad.items():
        if n_logits or n_probs:     # evidence holding NaN / Inf is a finding, never a pass
            row[f"{side}_nonfinite"] = n_logits + n_probs
            out.append(Finding(STAGE, "fail", name, "router_nonfinite", n_logits + n_probs, 0,
                               f"{name}: the {side}'s router holds {n_logits} non-finite logits and {n_probs} "
                               f"non-finite routing probabilities of chosen experts ({where}): NaN or Inf in "
                               "the gating"))
    e = base.num_experts
    order = np.arange(e) if expert_order is None else np.asarray(expert_order, np.int64)
    if sorted(order.tolist()) != list(range(e)):
        raise ValueError(f"expert order {list(order)} is not a permutation of {e} experts")
    # candidate columns / indices in the baseline's expert order
    c_logits = np.empty_like(cand.logits)
    c_logits[:, order] = cand.logits
    c_index = np.where(cand.topk_index >= 0, order[np.clip(cand.topk_index, 0, e - 1)], -1)
    c_counts = np.zeros(e, np.int64)
    c_counts[order] = cand.tokens_per_expert

    # 1. precision each side routes in
    prec = {}
    for side, rec in (("baseline", base), ("candidate", cand)):
        prec[side] = (effective_precision(rec.logits, rec.logits_dtype),
                      effective_precision(rec.topk_probs, rec.probs_dtype))
    row.update(baseline_precision="/".join(dict.fromkeys(prec["baseline"])),
               candidate_precision="/".join(dict.fromkeys(prec["candidate"])))
    for i, what in enumerate(("logits", "routing probabilities")):
        b, c = prec["baseline"][i], prec["candidate"][i]
        if b != c and (_coarser(b, c) or _coarser(c, b)):
            low = "candidate" if _coarser(c, b) else "baseline"
            declared = (cand if low == "candidate" else base)
            decl = declared.logits_dtype if i == 0 else declared.probs_dtype
            how = (f"declared {decl}" if normalize(decl) == (c if low == "candidate" else b)
                   else f"declared {decl}, every value exactly representable in "
                        f"{c if low == 'candidate' else b}")
            out.append(Finding(STAGE, "fail", name, "router_precision", c, b,
                               f"{name}: the {low}'s router {what} carry {c if low == 'candidate' else b} precision "
                               f"({how}), the other side's {b if low == 'candidate' else c}: the router computes "
                               "in a lower precision on one side (moe_router_dtype / router_dense_type)"))
            break

    # 2. logits and their statistics
    bz, cz = base.logits.astype(np.float64), c_logits.astype(np.float64)
    rms = float(np.sqrt(np.mean(bz * bz))) or 1.0
    rel = float(np.sqrt(np.mean((cz - bz) ** 2)) / rms)
    row["logits_rel_l2"] = rel
    sb, sc = statistics(base), statistics(RouterRecord(name, c_logits, c_index, cand.topk_probs, c_counts,
                                                       attrs=cand.attrs))
    stat_rel = {k: abs(sc[k] - sb[k]) / (rms * np.sqrt(bz.size) if k == "norm" else
                                        (1.0 if k in ("entropy", "topk_prob_mean") else rms))
                for k in ("max", "min", "mean", "norm", "entropy", "topk_prob_mean")}
    # a NaN compares false against every line: a value that is not finite is an infinite difference
    rel = rel if np.isfinite(rel) else np.inf
    stat_rel = {k: float(v) if np.isfinite(v) else np.inf for k, v in stat_rel.items()}
    worst_stat = max(stat_rel, key=lambda k: stat_rel[k])
    row.update({f"baseline_{k}": sb[k] for k in ("max", "min", "mean", "norm", "entropy")})
    row.update({f"candidate_{k}": sc[k] for k in ("max", "min", "mean", "norm", "entropy")})
    row["stats_worst"] = f"{worst_stat} {stat_rel[worst_stat]:.2e}"
    eps = tol.eps
    worst = max(rel, stat_rel[worst_stat])
    if worst > tol.rel_pass and not any(n_l or n_p for n_l, n_p, _ in bad.values()):
        verdict = "fail" if worst > tol.rel_fail else "warn"
        what = "logits" if rel >= stat_rel[worst_stat] else f"score statistic {worst_stat}"
        out.append(Finding(STAGE, verdict, name, "logits_rel_l2" if what == "logits" else f"stat_{worst_stat}",
                           worst, tol.rel_pass,
                           f"{name}: {what} differ by {worst:.2e} relative (the {tol.dtype} line: pass "
                           f"{tol.rel_pass:.1e}, fail beyond {tol.rel_fail:.1e})"))

    # 3. top-k choices: flips beyond the noise of a near tie
    t = base.topk_index.shape[0]
    flips, ties = [], 0
    tie_experts = np.zeros(e, np.int64)
    for i in range(t):
        bs = set(int(x) for x in base.topk_index[i] if x >= 0)
        cs = set(int(x) for x in c_index[i] if x >= 0)
        if bs == cs:
            continue
        gone, new = sorted(bs - cs), sorted(cs - bs)
        noise = tol.margin_ulps * eps * max(1.0, float(np.max(np.abs(bz[i]))))
        margin = min((abs(bz[i, g] - bz[i, n]) for g in gone for n in new), default=np.inf)
        if margin <= noise:
            ties += 1
            for x in gone + new:
                tie_experts[x] += 1
        else:
            flips.append((i, gone, new, margin))
    agree = 1.0 - (len(flips) + ties) / max(t, 1)
    row.update(topk_agreement=agree, near_ties=ties, flips=len(flips))
    perm = find_permutation(base.logits, c_logits)
    if perm is not None:
        pairs = ", ".join(f"{j}->{perm[j]}" for j in range(e) if perm[j] != j)
        row["expert_permutation"] = pairs
        out.append(Finding(STAGE, "fail", name, "expert_order", pairs, "identity",
                           f"{name}: the candidate's router scores experts in another order than the baseline's "
                           f"(baseline expert -> candidate expert: {pairs}; each column matches another's logits): "
                           "the router's rows and the experts were converted in different orders, or the mapping's "
                           "expert order is wrong"))
    if flips:
        share = len(flips) / max(t, 1)
        i, gone, new, margin = flips[0]
        out.append(Finding(STAGE, "fail" if share > tol.flip_warn else "warn", name, "topk_flips", share,
                           tol.flip_warn,
                           f"{name}: {len(flips)} of {t} tokens chose other experts beyond a near tie "
                           f"({ties} near ties tolerated); first: token {i} baseline {sorted(set(gone))} -> "
                           f"candidate {sorted(set(new))}, baseline margin {margin:.2e} above the noise "
                           f"{tol.margin_ulps:g} x {tol.dtype} eps"))

    # 4. tokens per expert, beyond what the near ties move
    delta = c_counts - base.tokens_per_expert
    excess = np.maximum(np.abs(delta) - tie_experts, 0)
    row["tokens_per_expert"] = f"{base.tokens_per_expert.tolist()} / {c_counts.tolist()}"
    if excess.any():
        j = int(np.argmax(excess))
        out.append(Finding(STAGE, "fail", name, "tokens_per_expert", int(c_counts[j]), int(base.tokens_per_expert[j]),
                           f"{name}: expert {j} received {int(c_counts[j])} tokens on the candidate, "
                           f"{int(base.tokens_per_expert[j])} on the baseline (all experts: baseline "
                           f"{base.tokens_per_expert.tolist()}, candidate {c_counts.tolist()}; near ties move at "
                           f"most {tie_experts.tolist()})"))
    row["verdict"] = max((f.verdict for f in out), key=("pass", "warn", "fail").index, default="pass")
    return row, out


def compare_routing(base: Mapping[str, RouterRecord], cand: Mapping[str, RouterRecord], tol: RoutingTolerance,
                    expert_order: Mapping[str, Sequence[int]] | None = None) -> tuple[list[dict[str, Any]],
                                                                                      list[Finding]]:
    """Every router both sides recorded, in layer order: the per-layer rows and the findings; a router on one
    side only is a warning (the stores watched different layers)."""
    rows: list[dict[str, Any]] = []
    findings: list[Finding] = []
    for module in sorted(set(base) & set(cand), key=_layer_key):
        row, f = compare_router(base[module], cand[module], tol, (expert_order or {}).get(module))
        rows.append(row)
        findings += f
    for side, only in (("baseline", set(base) - set(cand)), ("candidate", set(cand) - set(base))):
        for module in sorted(only, key=_layer_key):
            findings.append(Finding(STAGE, "warn", module, "router_one_sided", side, None,
                                    f"{module}: routing recorded by the {side} only (not compared)"))
    return rows, findings


def counts_by_step(base: Mapping[int, Mapping[str, np.ndarray]], cand: Mapping[int, Mapping[str, np.ndarray]],
                   expert_order: Mapping[str, Sequence[int]] | None = None) -> list[dict[str, Any]]:
    """Tokens per expert at every step both runs counted: per step, the router whose counts moved most and the
    share of its choices that moved (sum |delta| / 2 / choices). Not a verdict: after step 1 the weights
    differ and routing drifts with them; it shows where the routing of the two runs parts."""
    rows = []
    for step in sorted(set(base) & set(cand)):
        worst, share, n = None, -1.0, 0
        for module in sorted(set(base[step]) & set(cand[step]), key=_layer_key):
            b = np.asarray(base[step][module], np.int64)
            c0 = np.asarray(cand[step][module], np.int64)
            if b.shape != c0.shape:
                continue
            order = (expert_order or {}).get(module)
            c = np.empty_like(c0)
            c[np.asarray(order) if order is not None else np.arange(c0.size)] = c0
            moved = float(np.abs(c - b).sum()) / 2.0 / max(int(b.sum()), 1)
            n += 1
            if moved > share:
                worst, share = module, moved
        if n:
            rows.append({"step": int(step), "routers": n, "worst_router": worst, "moved_share": share})
    return rows
