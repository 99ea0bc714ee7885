"""The diagnosis: which failure explains the others, and what the verdict covers, computed once and shown
everywhere (summary.json, the report's first screen, the terminal).

Why: a wrong step 1 also fails the lr = 0 pair, the long run and the grad norm; a user who reads the failing
stages in the order they are printed fixes a consequence. Each stage says which stages its failure explains
(``Stage.explains``: a forward departure explains the step-1 loss and everything after it), so the root causes
are the failing stages no other failing stage explains, in the accuracy guide's order; within a stage its
strongest failing finding names the component. A cause in a later layer never explains an effect in an
earlier one (a router departing in layer 1 does not explain attention departing in layer 0).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from align.stages import PARTS, Stage, registry
from core.findings import Finding, StageResult, severity

_LAYER = re.compile(r"layers\.(\d+)\.")
ANY_LATER = "*"     # in ``explains``: every stage of a later part of the procedure
GENERIC = (None, "loss", "grad_norm")   # components that locate nothing in the model


def _locates(component: Any) -> bool:
    """Whether a component names a place in the model (a parameter, a module, a setting), not a scalar or a
    step ("step 3", "batch step 3")."""
    return component not in GENERIC and not re.match(r"(batch )?step \d", str(component))


def _ratio(f: Finding) -> float:
    """How far past its line a finding is (0 when it does not say): orders findings of one metric."""
    v, t = f.value, f.threshold
    if isinstance(v, (int, float)) and isinstance(t, (int, float)) and not isinstance(v, bool) and t:
        r = abs(float(v)) / abs(float(t))
        return r if math.isfinite(r) else math.inf
    return 0.0


def ranked(stage: Stage, res: StageResult) -> list[Finding]:
    """A result's non-pass findings, strongest first: fail before warn; then the stage's own order
    (``Stage.culprit``), else grouped by metric in the order the stage reported them, the largest ratio to its
    threshold first (a parameter 80x its floor before one 12x)."""
    bad = [f for f in res.findings if f.verdict != "pass"]
    if stage.culprit is not None:
        order = {id(f): i for i, f in enumerate(stage.culprit(res))}
        return sorted(bad, key=lambda f: (-severity(f.verdict), order.get(id(f), len(order))))
    first_metric: dict[str, int] = {}
    for f in bad:
        first_metric.setdefault(f.metric, len(first_metric))
    return sorted(bad, key=lambda f: (-severity(f.verdict), first_metric[f.metric], -_ratio(f)))


def _reach(stages: dict[str, Stage]) -> dict[str, set[str]]:
    """Every stage each stage explains, directly or through others (``*`` expanded to the later parts)."""
    part = {n: PARTS.index(s.part) for n, s in stages.items()}
    direct = {n: ({m for m in stages if part[m] > part[n]} if ANY_LATER in s.explains else set())
              | {m for m in s.explains if m in stages} for n, s in stages.items()}
    reach: dict[str, set[str]] = {}
    for n in stages:
        seen, todo = set(), list(direct[n])
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo.extend(direct[m])
        reach[n] = seen - {n}
    return reach


def _layer(component: str | None) -> int | None:
    m = _LAYER.search(str(component or ""))
    return int(m.group(1)) if m else None


def _explains(cause: tuple[Stage, Finding], effect: tuple[Stage, Finding], mutual: bool) -> bool:
    """A cause in a later layer than its effect explains nothing there (checked when both name a layer). Two
    stages that explain each other (a layer departing before a router, or a router before a layer) settle it
    by layer: the earlier layer is the cause; in one layer, the later stage of the guide (it looks closer)."""
    a, b = _layer(cause[1].component), _layer(effect[1].component)
    if a is not None and b is not None and a != b:
        return a < b
    return not mutual or cause[0].order > effect[0].order


_PARAM_LEAF = re.compile(r"\.(weight\d*|bias\d*|layer_norm_weight|layer_norm_bias|expert_bias|embedding_weight)$")
_LAYER_PREFIX = re.compile(r"^(.*?layers\.\d+)(\.|$)")


def module_of(component: str) -> str:
    """The module a component names: a parameter's owner (``...pre_mlp_layernorm.weight`` -> ``...pre_mlp_layernorm``),
    a tensor row's module (``decoder.layers.1.mlp forward.output.0`` -> ``decoder.layers.1.mlp``), else itself."""
    return _PARAM_LEAF.sub("", component.split(" ")[0])


def layer_of(component: str) -> str:
    """The transformer layer holding a component (``decoder.layers.1``), else the top module holding it
    (``embedding`` for ``embedding.word_embeddings.weight``; ``decoder.final_layernorm``, ``output_layer``): where
    `align isolate --modules` starts."""
    mod = module_of(component)
    m = _LAYER_PREFIX.match(mod)
    if m:
        return m.group(1)
    head, _, rest = mod.partition(".")
    return mod if head in ("decoder", "model", "module") or not rest else head


def _entry(stage: Stage, f: Finding, consequence_of: str | None, fill: dict[str, str]) -> dict[str, Any]:
    """A diagnosis entry; ``next`` with the component (and its module, its layer) and the user's own paths
    filled in."""
    comp = None if f.component is None else str(f.component)
    nxt = stage.next.replace("{component}", "" if comp is None else comp or "the component")
    nxt = nxt.replace("{module}", module_of(comp) if comp else "MODULE")
    nxt = nxt.replace("{layer}", layer_of(comp) if comp else "decoder.layers.N")
    for key, value in fill.items():
        nxt = nxt.replace("{" + key + "}", value)
    return {"stage": stage.name, "component": f.component, "metric": f.metric, "value": f.value,
            "threshold": f.threshold, "verdict": f.verdict, "message": f.message, "why": stage.why,
            "next": nxt, "consequence_of": consequence_of}


def _isolation_run(results: dict[str, StageResult]) -> str:
    """The `align isolate` output folder the isolation stage read (its evidence file's run), for ``{isolation}``."""
    res = results.get("isolation")
    f = Path(str(res.details.get("file"))) if res is not None and res.details.get("file") else None
    if f is None:
        return "ISOLATION_RUN"
    return str(f.parent.parent) if f.parent.name == "evidence" else str(f)


def diagnose(results: dict[str, StageResult], stages: list[Stage] | None = None,
             fill: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Root-cause candidates, strongest first, then the failures they explain (each with ``consequence_of``).
    ``fill``: values for the ``{baseline}``-style placeholders of a stage's ``next`` (the user's own paths), so
    the command to run next can be copied as it is.

    Only failing stages are candidates; a warning is not a culprit, but a warning a candidate explains is listed
    as its consequence. Empty when nothing fails.
    """
    fill = {"baseline": "BASELINE", "candidate": "CANDIDATE", "candidate_yaml": "CANDIDATE.yaml",
            "isolation": _isolation_run(results), **(fill or {})}
    by_name = {s.name: s for s in (stages or registry())}
    failing = [(by_name[n], r) for n, r in results.items() if r.verdict == "fail" and n in by_name]
    failing.sort(key=lambda sr: sr[0].order)
    head = {s.name: (ranked(s, r) or [Finding(s.name, "fail", None, "verdict", None, None,
                                              f"{s.title}: failed")])[0] for s, r in failing}
    reach = _reach(by_name)

    def explains(cause: tuple[Stage, Finding], effect: tuple[Stage, Finding]) -> bool:
        c, e = cause[0].name, effect[0].name
        return c != e and e in reach[c] and _explains(cause, effect, c in reach[e])

    sf = {s.name: (s, head[s.name]) for s, _ in failing}
    roots = [s for s in head if not any(explains(sf[t], sf[s]) for t in head)]
    out = []
    for s, _ in failing:
        if s.name in roots:
            out.append(_entry(s, head[s.name], None, fill))
        else:   # the earliest root behind it, else a failure that explains it directly
            cause = next((r for r in roots if explains(sf[r], sf[s.name])), None) or \
                next(t for t in head if explains(sf[t], sf[s.name]))
            out.append(_entry(s, head[s.name], cause, fill))
    # warnings a root explains are its consequences too (a warning no failure explains is no culprit: it is
    # shown with its stage)
    for n, r in results.items():
        found = ranked(by_name[n], r) if r.verdict == "warn" and n in by_name else []
        cause = next((c for c in roots if found and explains(sf[c], (by_name[n], found[0]))), None)
        if cause is not None:
            out.append(_entry(by_name[n], found[0], cause, fill))
    out.sort(key=lambda e: by_name[e["stage"]].order)
    for e in out:   # where a root cause shows in the numbers: its consequences that name a component
        e["seen_at"] = [{k: c[k] for k in ("stage", "component", "message")} for c in out
                        if c["consequence_of"] == e["stage"] and _locates(c["component"])][:3] \
            if e["consequence_of"] is None else []
    # roots first in the guide's order; then the consequences in the guide's order
    return [e for e in out if e["consequence_of"] is None] + [e for e in out if e["consequence_of"] is not None]


def _short(stage: Stage) -> str:
    return re.split(r" \(|: ", stage.title)[0]


def coverage(results: dict[str, StageResult], verdict: str, stages: list[Stage] | None = None) -> dict[str, Any]:
    """What the verdict rests on: the stages that ran and were skipped, per part of the procedure, and one
    sentence for the banner (a PASS on the long run alone must not read like a PASS on the whole procedure)."""
    reg = [s for s in (stages or registry()) if s.name in results]
    ran = [s.name for s in reg if results[s.name].verdict != "skipped"]
    skipped = [s.name for s in reg if results[s.name].verdict == "skipped"]
    parts: dict[str, dict[str, list[str]]] = {}
    for s in reg:
        if s.part == "inputs":   # the inputs' own sanity is not a part of the procedure a verdict covers
            continue
        p = parts.setdefault(s.part, {"ran": [], "skipped": []})
        p["ran" if results[s.name].verdict != "skipped" else "skipped"].append(s.name)
    compared = [p for p in PARTS if p in parts and parts[p]["ran"]]
    missing = [p for p in PARTS if p in parts and not parts[p]["ran"]]
    titles = {s.name: _short(s) for s in reg}
    v = verdict.upper()
    n_all = sum(len(p["ran"]) + len(p["skipped"]) for p in parts.values())
    n_ran = sum(len(p["ran"]) for p in parts.values())
    if not compared:
        banner = f"{v}: nothing of the procedure was compared"
        statement = f"{banner}."
    elif not missing:
        banner = f"{v}, with every part of the procedure compared" if verdict == "fail" else \
            f"{v} on every part of the procedure"
        left = [titles[n] for p in compared for n in parts[p]["skipped"]]
        statement = (f"{banner} ({n_ran} of {n_all} stages compared"
                     + (f"; not compared for want of evidence: {', '.join(left)})." if left else ")."))
    else:
        banner = (f"{v}, with {n_ran} of {n_all} stages compared" if verdict == "fail" else
                  f"{v} on {n_ran} of {n_all} stages ({_and(compared)})") + f": {_and(missing)} not compared"
        statement = (f"{v} rests on {n_ran} of {n_all} stages ({_and(compared)}); it says nothing about "
                     + "; ".join(f"{p} ({', '.join(titles[n] for n in parts[p]['skipped'])})" for p in missing)
                     + ": each skipped stage says what to capture.")
    return {"ran": ran, "skipped": skipped, "parts": parts, "banner": banner, "statement": statement}


def _and(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]
