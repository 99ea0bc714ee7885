"""The cluster diff: two sides' environment captures (dumpers/environment.py) compared, each difference that
matters named with why (the reasons are the documented list's, core/numerics_env.yaml).

What is judged: the list's concepts (determinism, pinned collective algorithm, float32 matmuls / convolutions
in TF32 / HF32, float32 cast to float16) from each side's own switches; a listed variable both sides read
(or, between two captures of one framework, any listed variable); versions of a package or runtime both
sides have; the random generators' seeds and states; every dataset file's content; the weights through the
mapping (sha256 where the mapping keeps the layout, the order-free multiset hash where it does not). Only
``fail`` / ``warn`` levels make findings; ``info`` rows are shown. Framework-free: the captures are JSON.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping as MappingABC
from typing import Any

from core.errors import BadInput
from core.findings import Finding, StageResult
from core.numerics_env import Concept, Spec, load_spec
from mapping import Mapping
from runstore.schema import load_json, validate

STAGE = "checklist"
CAPTURE_KIND = "xf-align environment capture"
_TEXT = {"type": "string"}
_OPT_TEXT = {"type": ["string", "null"]}
_SEED = {"type": ["number", "null"]}     # torch's unseeded initial_seed() is a 64-bit unsigned integer
_GENERATOR = {"type": ["object", "null"], "properties": {
    "seed": _SEED, "initial_seed": _SEED, "state": _OPT_TEXT, "fresh": {"type": ["boolean", "null"]}}}
#: The capture's declared shape: what ``align report --baseline-env/--candidate-env`` and a run's
#: ``meta.json["environment"]`` must hold.
CAPTURE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["kind", "framework", "env", "versions", "settings", "random", "data"],
    "properties": {
        "kind": {"enum": [CAPTURE_KIND]},
        "version": {"type": "integer"},
        "framework": {"enum": ["torch", "mindspore"]},
        "captured": {"type": ["object", "null"]},
        "env": {"type": "object", "additionalProperties": _TEXT},
        "versions": {"type": "object", "additionalProperties": _OPT_TEXT},
        "settings": {"type": "object", "additionalProperties": {"type": "object"}},
        "random": {"type": "object", "properties": {"observed": {"type": "boolean"}, "note": _OPT_TEXT,
                                                    **{g: _GENERATOR for g in ("python", "numpy", "torch",
                                                                               "mindspore")}}},
        "data": {"type": "array", "items": {
            "type": "object", "required": ["path", "files"],
            "properties": {"path": _TEXT, "files": {"type": "array", "items": {
                "type": "object", "required": ["name", "size", "sha256"],
                "properties": {"name": _TEXT, "size": {"type": "integer", "minimum": 0}, "sha256": _TEXT,
                               "chunk_size": {"type": "integer", "minimum": 1},
                               "chunks": {"type": "array", "items": _TEXT}}}}}}},
        "weights": {"type": ["object", "null"], "required": ["params"], "properties": {
            "source": _OPT_TEXT, "parallel": {"type": ["object", "null"]},
            "params": {"type": "object", "additionalProperties": {
                "type": "object", "required": ["shape", "sha256", "mset", "norm", "sum"],
                "properties": {"shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                               "sha256": _TEXT, "mset": _TEXT, "norm": {"type": "number"},
                               "sum": {"type": "number"}, "dtype": _OPT_TEXT}}}}},
    },
}
_MASK = (1 << 64) - 1
_SHOWN = 5


def check_capture(obj: Any, source: str | os.PathLike) -> dict[str, Any]:
    """``obj`` when it is a capture; BadInput naming ``source`` and the key otherwise."""
    validate(obj, CAPTURE_SCHEMA, source)
    for name, p in ((obj.get("weights") or {}).get("params") or {}).items():
        try:
            int(p["mset"], 16)
        except ValueError:
            raise BadInput(f"{source}: key 'weights.params.{name}.mset': not a hexadecimal hash") from None
        # NaN / inf is evidence (weights holding NaN / inf give it: judged in _weights); a negative L2 norm
        # no capture writes, and its square would hide the sign in a group's norm
        if float(p["norm"]) < 0:
            raise BadInput(f"{source}: key 'weights.params.{name}.norm': {p['norm']!r} is negative (an L2 norm "
                           "is >= 0)")
    return obj


def read_capture(path: str | os.PathLike) -> dict[str, Any]:
    """A capture file (``align capture-env --out``)."""
    return check_capture(load_json(path, what="environment capture"), path)


# -- the comparison -------------------------------------------------------------------------------------

class _Diff:
    """Rows for the table and findings for the verdict, filled section by section."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.res = StageResult("environment")

    def row(self, section: str, item: str, b: Any, c: Any, status: str, why: str = "") -> None:
        self.rows.append({"section": section, "item": item, "baseline": _show(b), "candidate": _show(c),
                          "status": status, "why": why})

    def finding(self, level: str, component: str, metric: str, value: Any, threshold: Any, message: str) -> None:
        if level in ("fail", "warn"):
            self.res.add(Finding(STAGE, level, component, metric, value, threshold, message))


def _show(v: Any) -> str:
    if v is None:
        return "unset"
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def concept_state(concept: Concept, cap: MappingABC[str, Any]) -> tuple[str, list[str]]:
    """``on`` / ``off`` / ``partial`` / ``unknown`` of one side, and each switch as it was found."""
    fw = cap["framework"]
    switches = concept.switches.get(fw) or ()
    if not switches:
        return "off", [f"no {fw} switch"]
    settings = (cap.get("settings") or {}).get(fw) or {}
    states, shown = [], []
    for sw in switches:
        if sw.kind == "env":
            v = cap["env"].get(sw.name)
            shown.append(f"{sw.name}={v}" if v is not None else f"{sw.name} unset")
        else:
            v = settings.get(sw.name)
            shown.append(f"{fw}.{sw.name}={'unreadable' if v is None else v}")
        states.append(sw.state(v))
    known = [s for s in states if s is not None]
    if not known:
        return "unknown", shown
    return ("on" if all(known) else "off" if not any(known) else "partial"), shown


def _concepts(d: _Diff, b: dict[str, Any], c: dict[str, Any], spec: Spec) -> None:
    same_fw = b["framework"] == c["framework"]
    for concept in spec.concepts.values():
        (bs, bshow), (cs, cshow) = concept_state(concept, b), concept_state(concept, c)
        b_text, c_text = f"{bs} ({', '.join(bshow)})", f"{cs} ({', '.join(cshow)})"
        if "unknown" in (bs, cs):
            d.row("concept", concept.title, b_text, c_text, "unknown", concept.why)
            continue
        differs = bshow != cshow if same_fw else bs != cs
        if not differs:
            d.row("concept", concept.title, b_text, c_text, "same", concept.why)
            continue
        d.row("concept", concept.title, b_text, c_text, concept.level, concept.why)
        d.finding(concept.level, concept.name, "environment", cs, bs,
                  f"{concept.title}: baseline {b_text} vs candidate {c_text}: {concept.why}")


def _variables(d: _Diff, b: dict[str, Any], c: dict[str, Any], spec: Spec) -> None:
    in_concept = {n: k.name for k in spec.concepts.values() for n in k.variables()}
    for name in sorted(set(b["env"]) | set(c["env"])):
        bv, cv = b["env"].get(name), c["env"].get(name)
        var = spec.variables.get(name)
        why = var.why if var else "not in the list: recorded, not judged"
        fw = spec.framework_of(name)
        read_by_both = fw == "any" or fw == b["framework"] == c["framework"]
        if bv == cv:
            d.row("env", name, bv, cv, "same", why)
        elif name in in_concept:
            d.row("env", name, bv, cv, "info", f"judged with {in_concept[name]} above; {why}")
        elif not read_by_both:
            d.row("env", name, bv, cv, "info", f"read by {fw} only; {why}")
        else:
            level = var.level if var else "info"
            d.row("env", name, bv, cv, level, why)
            d.finding(level, f"env:{name}", "environment", _show(cv), _show(bv),
                      f"{name}: baseline {_show(bv)} vs candidate {_show(cv)}: {why}")


def _versions(d: _Diff, b: dict[str, Any], c: dict[str, Any], spec: Spec) -> None:
    bvs, cvs = b["versions"], c["versions"]
    for name in list(dict.fromkeys([*bvs, *cvs])):
        bv, cv = bvs.get(name), cvs.get(name)
        if bv is None and cv is None:
            continue
        pkg = spec.packages.get(name)
        why = pkg.why if pkg else ""
        if bv == cv:
            d.row("version", name, bv, cv, "same", why)
        elif bv is None or cv is None:
            d.row("version", name, bv, cv, "info", f"one side only; {why}" if why else "one side only")
        else:
            level = pkg.level if pkg else "info"
            d.row("version", name, bv, cv, level, why)
            d.finding(level, f"version:{name}", "version", cv, bv,
                      f"{name} {bv} on the baseline vs {cv} on the candidate: {why}")


_RANDOM_WHY = {
    "python": "Python's generator (random): a data pipeline that shuffles or samples with it draws differently",
    "numpy": "numpy's global generator: a data pipeline that shuffles or samples with it draws differently",
}


def _framework_seed(cap: dict[str, Any]) -> Any:
    r = cap["random"].get(cap["framework"]) or {}
    return r.get("seed") if r.get("seed") is not None else r.get("initial_seed")


def _random(d: _Diff, b: dict[str, Any], c: dict[str, Any]) -> None:
    br, cr = b["random"], c["random"]
    if not (br.get("observed") and cr.get("observed")):
        who = [r for r, x in (("baseline", br), ("candidate", cr)) if not x.get("observed")]
        d.row("random", "generators", "observed" if br.get("observed") else "not observed",
              "observed" if cr.get("observed") else "not observed", "info",
              f"not observed on the {' and '.join(who)}: the dumpers record the training process's generators "
              "(DumpConfig(capture_env=True))")
        return

    def fresh(x: dict[str, Any]) -> str:
        f = x.get("fresh")
        return "" if f is None else ", nothing drawn since seeded" if f else ", drawn from since seeded"

    for gen in ("python", "numpy"):
        x, y = br.get(gen) or {}, cr.get(gen) or {}
        bt = f"seed {_show(x.get('seed'))}, state {x.get('state')}{fresh(x)}"
        ct = f"seed {_show(y.get('seed'))}, state {y.get('state')}{fresh(y)}"
        if x.get("state") == y.get("state"):
            d.row("random", gen, bt, ct, "same", _RANDOM_WHY[gen])
            continue
        d.row("random", gen, bt, ct, "warn", _RANDOM_WHY[gen])
        d.finding("warn", f"random:{gen}", "random_state", y.get("state"), x.get("state"),
                  f"{gen} random state at capture differs (baseline {bt}; candidate {ct}): another seed or "
                  f"another number of draws before training; {_RANDOM_WHY[gen]}")
    bfw, cfw = b["framework"], c["framework"]
    bs, cs = _framework_seed(b), _framework_seed(c)
    why = ("the framework's seed draws dropout masks and every weight that is initialised rather than loaded; the "
           "accuracy guide fixes the same seed on both sides")
    x, y = br.get(bfw) or {}, cr.get(cfw) or {}
    bt, ct = f"{bfw} seed {_show(bs)}{fresh(x)}", f"{cfw} seed {_show(cs)}{fresh(y)}"
    if bs != cs or (bfw == cfw and x.get("state") != y.get("state")):
        d.row("random", "framework seed", bt, ct, "warn", why)
        d.finding("warn", f"random:{cfw}", "random_seed", _show(cs), _show(bs),
                  f"framework generator: baseline {bt} vs candidate {ct}: {why}")
    else:
        d.row("random", "framework seed", bt, ct, "same", why)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB" if n >= 1 << 20 else f"{n} B"


def _where(x: dict[str, Any], y: dict[str, Any]) -> str:
    """Where two files of different content part: size, or the first differing chunk."""
    if x["size"] != y["size"]:
        return f"sizes {x['size']} vs {y['size']} bytes"
    xc, yc = x.get("chunks"), y.get("chunks")
    if xc and yc and x.get("chunk_size") == y.get("chunk_size"):
        for i, (p, q) in enumerate(zip(xc, yc, strict=False)):
            if p != q:
                cs = int(x["chunk_size"])
                return f"same size, first difference in bytes {_mib(i * cs)}-{_mib(min((i + 1) * cs, x['size']))}"
    return "same size, other content"


_DATA_WHY = ("the two sides train on other bytes: tokens, order or documents differ; the per-step batches the "
             "dumpers record show which")


def _data(d: _Diff, b: dict[str, Any], c: dict[str, Any]) -> None:
    bd, cd = b["data"], c["data"]
    if not bd and not cd:
        return
    if len(bd) != len(cd):
        d.row("data", "dataset paths", len(bd), len(cd), "warn", "hash the same dataset paths, in the same order, "
                                                                 "on both clusters (--data)")
        d.finding("warn", "data", "data_hash", len(cd), len(bd),
                  f"dataset paths hashed: {len(bd)} on the baseline, {len(cd)} on the candidate; only the first "
                  f"{min(len(bd), len(cd))} compared (give the same --data paths, in the same order, on both clusters)")
    for x, y in zip(bd, cd, strict=False):
        xf, yf = {f["name"]: f for f in x["files"]}, {f["name"]: f for f in y["files"]}
        if len(xf) == 1 and len(yf) == 1:         # one file a side: the same file under another name
            pairs = [(next(iter(xf.values())), next(iter(yf.values())))]
            only_b, only_c = [], []
        else:
            pairs = [(xf[n], yf[n]) for n in xf if n in yf]
            rest_b = [f for n, f in xf.items() if n not in yf]
            rest_c = {f["sha256"]: f for n, f in yf.items() if n not in xf}
            pairs += [(f, rest_c.pop(f["sha256"])) for f in rest_b if f["sha256"] in rest_c]
            paired = {id(p) for p, _ in pairs}
            only_b, only_c = [f for f in rest_b if id(f) not in paired], list(rest_c.values())
        differ = [(p, q) for p, q in pairs if p["sha256"] != q["sha256"]]
        label = x["path"] if x["path"] == y["path"] else f"{x['path']} | {y['path']}"
        if not differ and not only_b and not only_c:
            d.row("data", label, f"{len(x['files'])} files, {x.get('bytes', '?')} bytes",
                  f"{len(y['files'])} files, {y.get('bytes', '?')} bytes", "same", "content hashes (sha256) equal")
            continue
        parts = [f"{p['name']}: {_where(p, q)}" for p, q in differ]
        parts += [f"{f['name']}: baseline only" for f in only_b] + [f"{f['name']}: candidate only" for f in only_c]
        for p, q in differ:
            d.row("data", f"{label}: {p['name']}" + (f" | {q['name']}" if q["name"] != p["name"] else ""),
                  p["sha256"][:16], q["sha256"][:16], "fail", _where(p, q))
        for f, side in [(f, "baseline") for f in only_b] + [(f, "candidate") for f in only_c]:
            d.row("data", f"{label}: {f['name']}", f["sha256"][:16] if side == "baseline" else "absent",
                  f["sha256"][:16] if side == "candidate" else "absent", "fail", f"on the {side} only")
        n = len(differ) + len(only_b) + len(only_c)
        shown = "; ".join(parts[:_SHOWN]) + (f"; and {len(parts) - _SHOWN} more" if len(parts) > _SHOWN else "")
        d.finding("fail", f"data:{x['path']}", "data_hash", n, 0,
                  f"dataset {label}: {n} of {max(len(xf), len(yf))} files differ ({shown}): {_DATA_WHY}")


def _sharded(w: dict[str, Any]) -> str | None:
    par = w.get("parallel") or {}
    big = {k: v for k, v in par.items() if k in ("tp", "pp", "ep", "cp") and isinstance(v, int) and v > 1}
    return ", ".join(f"{k}={v}" for k, v in big.items()) or None


def _rel(a: float, b: float) -> float:
    if a == b:
        return 0.0
    scale = max(abs(a), abs(b))
    return abs(a - b) / scale if scale > 0 and math.isfinite(scale) else float("inf")


def _group(params: dict[str, dict[str, Any]], names: list[str]) -> tuple[int, float]:
    """(multiset hash, L2 norm) of a group of tensors."""
    mset = sum(int(params[n]["mset"], 16) for n in names) & _MASK
    return mset, math.sqrt(sum(float(params[n]["norm"]) ** 2 for n in names))


def _nonfinite(d: _Diff, side: str, w: dict[str, Any]) -> None:
    """A fail naming the tensors whose norm or sum is NaN / inf: the weights hold NaN / inf (the fingerprint
    sums them in float64, which no finite float32 values overflow), however the two sides compare."""
    bad = [n for n, p in w["params"].items() if not (math.isfinite(float(p["norm"])) and
                                                      math.isfinite(float(p["sum"])))]
    if not bad:
        return
    listed = "; ".join(f"{n}: norm {_show(float(w['params'][n]['norm']))}, sum "
                       f"{_show(float(w['params'][n]['sum']))}" for n in bad[:_SHOWN])
    more = f"; and {len(bad) - _SHOWN} more" if len(bad) > _SHOWN else ""
    d.row("weights", f"{side}: non-finite", f"{len(bad)} tensors" if side == "baseline" else "",
          f"{len(bad)} tensors" if side == "candidate" else "", "fail", listed + more)
    d.finding("fail", bad[0], "weights_nonfinite", len(bad), 0,
              f"{side} weights hold NaN or inf: {len(bad)} of {len(w['params'])} tensors ({listed}{more}): "
              "training starts from them whatever the other side holds")


def _weights(d: _Diff, b: dict[str, Any], c: dict[str, Any], mapping: Mapping | None) -> None:
    bw, cw = b.get("weights"), c.get("weights")
    if not bw and not cw:
        return
    for side, w in (("baseline", bw), ("candidate", cw)):
        if w:
            _nonfinite(d, side, w)
    if not (bw and cw):
        d.row("weights", "fingerprints", "recorded" if bw else "none", "recorded" if cw else "none", "info",
              "fingerprint the weights on both sides (align capture-env --weights, or the dumpers' capture)")
        return
    shard = [f"{r}: {s}" for r, s in (("baseline", _sharded(bw)), ("candidate", _sharded(cw))) if s]
    if shard:
        d.row("weights", "fingerprints", _sharded(bw), _sharded(cw), "info",
              f"not compared: a dumper's rank 0 holds only its shard ({'; '.join(shard)}); capture the merged "
              "checkpoint with align capture-env --weights")
        return
    bp, cp = bw["params"], cw["params"]
    groups: list[tuple[str, list[str], list[str], bool]] = []     # (name, baseline, candidate, same layout)
    unpaired: list[str] = []
    if b["framework"] == c["framework"] or mapping is None:
        how = "by name"
        groups = [(n, [n], [n], True) for n in bp if n in cp]
        unpaired = [f"baseline {n}" for n in bp if n not in cp] + [f"candidate {n}" for n in cp if n not in bp]
    else:
        m = mapping.oriented(list(bp), list(cp))
        how = f"through {m.name}"
        pairs, unmapped, _ignored = m.pair(list(bp), list(cp))
        for gp in pairs:
            if not gp.complete:
                unpaired.append(f"{gp.name} (group incomplete)")
                continue
            identity = (gp.match.rule.transform.get("op", "identity") == "identity"
                        and len(gp.baseline_present) == len(gp.candidate_present))
            groups.append((gp.name, gp.baseline_present, gp.candidate_present, identity))
        unpaired += [f"{s} {n}" for s in ("baseline", "candidate") for n in unmapped[s]]
    differ: list[tuple[str, str, float]] = []
    for name, bn, cn, same_layout in groups:
        (bm, bnorm), (cm, cnorm) = _group(bp, bn), _group(cp, cn)
        rel = _rel(bnorm, cnorm)
        if same_layout and all(bp[x]["sha256"] == cp[y]["sha256"] for x, y in zip(bn, cn, strict=True)):
            continue
        if bm == cm:
            if same_layout:
                differ.append((name, "same values in another order (layout)", rel))
            continue
        differ.append((name, f"values differ (norm {bnorm:.6g} vs {cnorm:.6g}, relative {rel:.2e})", rel))
    why = ("the two sides start from other weights: step-1 loss and every later comparison inherit the "
           "difference; convert the baseline's checkpoint (align convert-weights) and load it as is")
    dt = {s: sorted({str(p.get("dtype")) for p in w["params"].values()}) for s, w in (("b", bw), ("c", cw))}
    status = "fail" if differ else "same"
    d.row("weights", f"{len(groups)} groups compared {how}", f"{len(bp)} tensors ({', '.join(dt['b'])})",
          f"{len(cp)} tensors ({', '.join(dt['c'])})", status,
          "sha256 where the layout is kept, multiset hash where the mapping changes it")
    for name, what, _ in differ:
        d.row("weights", name, "", "", "fail", what)
    if differ:
        listed = "; ".join(f"{n}: {w}" for n, w, _ in differ[:_SHOWN])
        more = f"; and {len(differ) - _SHOWN} more" if len(differ) > _SHOWN else ""
        d.finding("fail", differ[0][0], "weights_hash", len(differ), 0,
                  f"weights differ {how}: {len(differ)} of {len(groups)} groups ({listed}{more}): {why}")
    if unpaired:
        d.row("weights", "not compared", len(unpaired), "", "warn", "; ".join(unpaired[:_SHOWN]))
        d.finding("warn", "weights", "weights_unpaired", len(unpaired), 0,
                  f"{len(unpaired)} weight tensors could not be paired {how} and were not compared "
                  f"({'; '.join(unpaired[:_SHOWN])}{' ...' if len(unpaired) > _SHOWN else ''})")


def compare_environments(baseline: dict[str, Any], candidate: dict[str, Any],
                         mapping: Mapping | None = None) -> StageResult:
    """Findings (stage ``checklist``) for every difference that matters, and ``details["rows"]``: the table
    (section, item, baseline, candidate, status: same / fail / warn / info / unknown, why)."""
    spec = load_spec()
    d = _Diff()
    _concepts(d, baseline, candidate, spec)
    _variables(d, baseline, candidate, spec)
    _versions(d, baseline, candidate, spec)
    _random(d, baseline, candidate)
    _data(d, baseline, candidate)
    _weights(d, baseline, candidate, mapping)
    res = d.res
    if not res.findings:
        res.verdict = "pass"
    res.details = {"rows": d.rows, "frameworks": [baseline["framework"], candidate["framework"]],
                   "captured": [baseline.get("captured"), candidate.get("captured")],
                   "differences": len(res.findings)}
    return res
