"""`align repro`: a folder that shows one isolated module's difference to a framework team, on its own.

Why: isolation names the module whose own computation departs; the team that owns the framework needs the
difference on their desk, without this project. The folder holds the module's captured input (and output
gradient), both sides' weights (the candidate's brought back into the baseline's layout by the mapping, so a
conversion fault stays in them), both saved outputs (the baseline's; the candidate's module on the baseline's
input, as isolation ran it), each side's settings (``case.json``: epsilon, dtype) and two short scripts, one
per framework, that recompute the module with that framework's own kernels and print the metrics the report
showed (relative L2, cosine, max abs error) against the other side's saved output. Arrays are ``.npy`` (read
with ``allow_pickle=False``), settings JSON; the scripts import numpy and their framework only.

The scripts write the module's math with the framework's public operators (RMSNorm, a linear layer, the
gated SwiGLU MLP, self-attention, the token embedding, the masked-mean cross-entropy loss: the module kinds
:data:`KINDS`), not the framework's module classes: those
need a model config and (on CPU) this project's stand-ins. So they reproduce a difference in settings, weights,
precision or a kernel. Each side computes at the precision measured for it: the recorded dtypes, the
precision the saved output holds (an embedding rounded to float16 holds only float16 numbers) and, for the
loss, the precision (float32 / bfloat16 / float16 at the loss kernel's input and output) whose float64
recomputation gives the saved loss; a difference in the candidate module's own Python (a hand-written bprop)
shows as the recomputed gradient agreeing with the baseline while the saved candidate gradient does not (both printed).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from comparators.isolation import held_precision, read_isolation
from comparators.tensor_metrics import compare_arrays
from core.dtypes import coarsest
from core.errors import BadInput
from core.outputs import temp_beside
from runstore import EVIDENCE_DIR, ISOLATION_EVIDENCE, RunReader
from runstore.h5file import open_h5, read_dataset

#: module kinds the scripts compute: norm (RMSNorm), linear (y = x W^T), mlp (gated SwiGLU, fc1 = [gate; up]),
#: attention (Megatron's self-attention: fused per-group QKV, optional q/k RMSNorm, RoPE (rotate-half) from the
#: captured rotary embedding, causal / given mask, GQA, softmax in float32, output projection)
KINDS = ("norm", "linear", "mlp", "attention", "embedding", "loss")
_ATTENTION = {"linear_qkv.weight": "qkv", "linear_proj.weight": "proj", "q_layernorm.weight": "q_norm",
              "k_layernorm.weight": "k_norm"}


def isolation_file(path: str | Path) -> Path:
    """An isolation run folder or its evidence file; BadInput when there is none."""
    p = Path(path)
    f = p / EVIDENCE_DIR / ISOLATION_EVIDENCE if p.is_dir() else p
    if not f.is_file():
        raise BadInput(f"{path}: no isolation evidence ({EVIDENCE_DIR}/{ISOLATION_EVIDENCE}; write it with "
                       "`align isolate`)")
    return f


def _kind(module: str, params: list[str], kind: str | None = None) -> tuple[str, dict[str, str]]:
    """(kind, role -> parameter name) of a module from its parameters (``kind``: the mapping's, for the loss,
    which holds none); BadInput for kinds not in KINDS."""
    tails = {p[len(module) + 1:]: p for p in params}
    if kind == "loss" and not tails:
        return "loss", {}
    if set(tails) == {"word_embeddings.weight"}:
        return "embedding", {"weight": tails["word_embeddings.weight"]}
    if len(tails) == 1:
        (tail, name), = tails.items()
        if tail in ("weight", "layer_norm_weight") and ("norm" in module.rsplit(".", 1)[-1]):
            return "norm", {"weight": name}
        if tail == "weight":
            return "linear", {"weight": name}
    if set(tails) == {"linear_fc1.weight", "linear_fc2.weight"}:
        return "mlp", {"fc1": tails["linear_fc1.weight"], "fc2": tails["linear_fc2.weight"]}
    if {"linear_qkv.weight", "linear_proj.weight"} <= set(tails) <= set(_ATTENTION):
        return "attention", {_ATTENTION[t]: p for t, p in tails.items()}
    raise BadInput(f"{module}: align repro writes scripts for {', '.join(KINDS)} modules (RMSNorm, a linear "
                   f"layer, a gated MLP, self-attention, without bias; the token embedding; the loss); this one "
                   f"holds {sorted(tails) or 'no weights'}")


def _baseline_side(store: str, module: str, step: int, rank: int, weights: str | None
                   ) -> tuple[np.ndarray, np.ndarray | None, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(input, output gradient or None, weights, its other inputs by name) of the baseline's module: from its
    module backward capture when there is one, else its full layer tensors and ``weights`` (a checkpoint)."""
    from dumpers.mindspore_backward_isolation import backward_steps, read_backward

    if step in backward_steps(store, rank):
        try:
            meta, arr = read_backward(store, step, rank)
        except ValueError as exc:
            raise BadInput(" ".join(str(exc).split())) from None
        entry = next((m for m in meta["modules"] if m["module"] == module), None)
        if entry is not None:
            first = next((i["key"] for i in entry["inputs"] if i.get("grad")),
                         entry["inputs"][0]["key"] if entry["inputs"] else None)   # the embedding: its token ids
            w = {p: arr[f"weight/{module}/{p}"] for p in entry["params"] if f"weight/{module}/{p}" in arr}
            if first is not None and (w or weights is None or not entry["params"]):
                others = {i["key"]: arr[f"input/{module}/{i['key']}"] for i in entry["inputs"] if i["key"] != first}
                if not entry["params"]:
                    w = {}
                elif not w:
                    w = _read_module_weights(weights, module)
                return arr[f"input/{module}/{first}"], arr[f"grad_output/{module}"], w, others
    from dumpers.mindspore_isolation import baseline_modules

    try:
        _, path, found = baseline_modules(store, step, rank)
    except ValueError as exc:
        raise BadInput(" ".join(str(exc).split())) from None
    entry = next((e for e in found if e["module"] == module), None)
    if entry is None:
        raise BadInput(f"{store}: no full input of {module} at step {step}")
    with open_h5(path) as h5:
        x = read_dataset(path, entry["input"], h5.get(entry["input"]))
    return x, None, _read_module_weights(weights, module), {}


def _read_module_weights(path: str | None, module: str) -> dict[str, np.ndarray]:
    from checkpoints.weights import read_weights

    if path is None:
        raise BadInput(f"{module}: the baseline holds no weights of it (no module backward capture): pass "
                       "--baseline-weights CKPT, the baseline's checkpoint of that step")
    arrays, _ = read_weights(path)
    out = {k.removeprefix("module."): v for k, v in arrays.items()
           if k.removeprefix("module.").startswith(module + ".")}
    if not out:
        raise BadInput(f"{path}: holds no parameter of {module}")
    return out


def _candidate_weights(path: str, module: str, m: Any, params: Any) -> dict[str, np.ndarray]:
    """The candidate's weights of ``module`` in the baseline's names and layout (the mapping's transforms
    reversed; a file in the baseline's names is taken as it is)."""
    from checkpoints.weights import read_weights

    arrays, _ = read_weights(path)
    if any(k.startswith("module.") for k in arrays):      # Megatron-named (DDP): the baseline's layout already
        return {k.removeprefix("module."): v for k, v in arrays.items()
                if k.removeprefix("module.").startswith(module + ".")}
    mine = {k: v for k, v in arrays.items() if any(b.startswith(module + ".") for b in m.map_name(k, "candidate"))}
    if not mine:
        raise BadInput(f"{path}: holds no candidate parameter of {module}")
    conv, _ = m.convert(mine, "baseline", params)
    return conv


def write_repro(isolation: str | Path, module: str, out: str | Path, *, candidate_cfg: dict[str, Any],
                mapping: Any, params: Any, baseline_weights: str | None = None,
                candidate_weights: str | None = None) -> Path:
    """Write the repro folder of ``module`` (a baseline module name isolation compared) to ``out``; all of it
    appears at once (a temporary folder beside, renamed). Returns ``out``."""
    from align.checks.config import megatron_common, mindformers_common
    from align.stages.evidence import meta_config

    meta, arrays = read_isolation(isolation_file(isolation))
    entry = next((e for e in meta["modules"] if e["baseline"] == module), None)
    if entry is None:
        raise BadInput(f"{isolation}: {module} was not isolated (isolated: "
                       f"{', '.join(e['baseline'] for e in meta['modules'][:8])})")
    store, step, rank = str(meta.get("baseline")), int(meta.get("step") or 1), int(meta.get("rank") or 0)
    if not Path(store).is_dir():
        raise BadInput(f"{isolation}: its baseline store {store} is not there (the inputs come from it)")
    x, gout, w_b, others = _baseline_side(store, module, step, rank, baseline_weights)
    kind, roles = _kind(module, sorted(w_b), entry.get("kind"))
    y_b, y_c = arrays[f"baseline/{module}"], arrays[f"isolated/{module}"]
    sbh = (meta.get("layout") or {}).get("baseline", "sbh") == "sbh"
    extra: dict[str, Any] = {}
    if kind == "attention":
        extra = _attention_case(module, others, w_b[roles["proj"]], params, candidate_cfg)
    elif kind == "embedding":
        extra = {"embedding": {"transpose": sbh and x.ndim == 2}}
    elif kind == "loss":
        extra = _loss_case(module, x, others, sbh)
    cw = candidate_weights or meta.get("weights")
    if roles and (not cw or not Path(str(cw)).exists()):
        raise BadInput(f"{isolation}: the candidate's weights {cw} are not there: pass --candidate-ckpt")
    w_c = _candidate_weights(str(cw), module, mapping, params) if roles else {}
    missing = [p for p in roles.values() if p not in w_c]
    if missing:
        raise BadInput(f"{cw}: no candidate weight for {', '.join(missing)}")
    base_cfg = meta_config(RunReader(store).meta)
    eps_b = megatron_common(base_cfg[1])[0].get("norm_eps") if base_cfg and base_cfg[0] == "megatron_args" else None
    eps_c = mindformers_common(candidate_cfg).get("norm_eps")
    own = compare_arrays(y_b, y_c)
    d_b = coarsest([_np_dtype(entry.get("dtype_baseline")), held_precision(y_b)])
    d_c = coarsest([_np_dtype(entry.get("dtype_candidate")), held_precision(y_c)])
    source = "recorded dtypes and the precision its saved output holds"
    if kind == "loss":
        probed = _loss_precision(x, extra, y_c)
        if probed != "float32":
            d_c, source = probed, (f"measured: the loss at {probed} (its input and output rounded there) gives the "
                                   "saved candidate loss, float32 does not")
    case: dict[str, Any] = {
        "module": module, "kind": kind, "step": step, "candidate_module": entry.get("candidate"),
        "input": "inputs/x.npy", "grad_output": "inputs/grad_output.npy" if gout is not None else None,
        "weights": {side: {r: f"weights/{side}/{r}.npy" for r in roles} for side in ("baseline", "candidate")},
        "parameters": roles,
        "settings": {"baseline": {"eps": eps_b if eps_b is not None else 1e-5, "dtype": d_b},
                     "candidate": {"eps": eps_c if eps_c is not None else 1e-5, "dtype": d_c,
                                   "dtype_source": source}},
        "outputs": {"baseline": "outputs/baseline.npy", "candidate": "outputs/candidate.npy"},
        "attention": extra.get("attention"), "embedding": extra.get("embedding"), "loss": extra.get("loss"),
        "report": {"own_rel_l2": own.rel_l2, "own_cosine": own.cosine, "own_max_abs_err": own.max_abs_err},
        "grads": {}}
    files: dict[str, np.ndarray] = {"inputs/x.npy": x, "outputs/baseline.npy": y_b, "outputs/candidate.npy": y_c,
                                    **extra.get("files", {})}
    if gout is not None:
        files["inputs/grad_output.npy"] = gout
    for side, w in (("baseline", w_b), ("candidate", w_c)):
        for r, p in roles.items():
            files[f"weights/{side}/{r}.npy"] = np.asarray(w[p], dtype=np.float32)
    grads = {g["what"] for g in entry.get("grads") or []}
    first_in = next((g for g in sorted(grads) if g.startswith("input:")), None)
    wanted = {"x": first_in, **{r: f"weight:{p}" for r, p in roles.items()}}
    for r, what in wanted.items():
        if what in grads:
            b, c = arrays[f"grad/baseline/{module}/{what}"], arrays[f"grad/isolated/{module}/{what}"]
            files[f"grads/baseline/{r}.npy"], files[f"grads/candidate/{r}.npy"] = b, c
            cmp = compare_arrays(b, c)
            case["grads"][r] = {"what": what, "baseline": f"grads/baseline/{r}.npy",
                                "candidate": f"grads/candidate/{r}.npy", "report_own_rel_l2": cmp.rel_l2}
    return _write_folder(Path(out), case, files)


def _attention_case(module: str, others: dict[str, np.ndarray], proj: np.ndarray, params: Any,
                    candidate_cfg: dict[str, Any]) -> dict[str, Any]:
    """The attention's other inputs (mask, rotary embedding) and shape settings; BadInput when missing."""
    from align.checks.config import mindformers_attention_dtype

    mask, rope = others.get("attention_mask"), others.get("rotary_pos_emb")
    if mask is None or rope is None or not params.num_heads:
        raise BadInput(f"{module}: an attention repro needs the baseline's attention_mask and rotary_pos_emb "
                       "(its module backward capture) and the number of heads (the candidate YAML)")
    heads = int(params.num_heads)
    groups = int(params.num_query_groups or heads)
    return {"files": {"inputs/attention_mask.npy": mask.astype(np.bool_), "inputs/rotary_pos_emb.npy": rope},
            "attention": {"heads": heads, "groups": groups, "head_dim": int(proj.shape[1]) // heads,
                          "mask": "inputs/attention_mask.npy", "rotary_pos_emb": "inputs/rotary_pos_emb.npy",
                          "candidate_qkv_dtype": mindformers_attention_dtype(candidate_cfg) or "float32"}}


def _loss_case(module: str, logits: np.ndarray, others: dict[str, np.ndarray], sbh: bool) -> dict[str, Any]:
    """The loss's labels and loss_mask (from the baseline's capture) and how its logits are laid out."""
    labels, mask = others.get("labels"), others.get("loss_mask")
    if labels is None or mask is None:
        raise BadInput(f"{module}: a loss repro needs the baseline's labels and loss_mask (its module backward "
                       "capture of 'loss')")
    return {"files": {"inputs/labels.npy": labels.astype(np.int64), "inputs/loss_mask.npy": mask.astype(np.float32)},
            "loss": {"labels": "inputs/labels.npy", "loss_mask": "inputs/loss_mask.npy",
                     "transpose": bool(sbh and logits.ndim == 3),
                     "reduction": "sum(cross_entropy * loss_mask) / sum(loss_mask)"}}


def _round(a: np.ndarray, dtype: str) -> np.ndarray:
    """``a`` rounded to ``dtype`` (to nearest, ties to even) and widened back to float64."""
    a32 = np.asarray(a, np.float32)
    if dtype == "float16":
        return a32.astype(np.float16).astype(np.float64)
    if dtype == "bfloat16":
        u = a32.view(np.uint32).astype(np.uint64)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        return u.astype(np.uint32).view(np.float32).astype(np.float64)
    return a32.astype(np.float64)


def _loss_precision(logits: np.ndarray, extra: dict[str, Any], saved: np.ndarray) -> str:
    """The precision (float32, bfloat16, float16 at the loss kernel's input and output) whose float64
    recomputation of the masked-mean cross-entropy is nearest the candidate's saved loss; float32 unless
    another is ten times nearer."""
    labels = extra["files"]["inputs/labels.npy"]
    mask = extra["files"]["inputs/loss_mask.npy"].astype(np.float64)
    lg = np.swapaxes(logits, 0, 1) if extra["loss"]["transpose"] else logits
    target = float(np.asarray(saved, np.float64).ravel()[0])
    err = {}
    for d in ("float32", "bfloat16", "float16"):
        z = _round(lg, d)
        m = z.max(-1, keepdims=True)
        lp = _round(z - m - np.log(np.exp(z - m).sum(-1, keepdims=True)), d)
        nll = -np.take_along_axis(lp, labels[..., None].astype(np.int64), -1)[..., 0]
        err[d] = abs(float((nll * mask).sum() / mask.sum()) - target)
    best = min(err, key=lambda d: err[d])
    return best if best != "float32" and err[best] * 10 < err["float32"] else "float32"


def _np_dtype(d: Any) -> str:
    d = str(d or "float32").lower().replace("torch.", "").replace("mindspore.", "")
    return d if d in ("float16", "bfloat16", "float32", "float64") else "float32"


def _write_folder(out: Path, case: dict[str, Any], files: dict[str, np.ndarray]) -> Path:
    if out.exists() and any(out.iterdir()) and not (out / "case.json").is_file():
        raise BadInput(f"{out}: exists and is not a repro folder (no case.json): name a new or empty folder")
    tmp = temp_beside(out)
    try:
        for rel, arr in files.items():
            p = tmp / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            np.save(p, np.ascontiguousarray(arr), allow_pickle=False)
        (tmp / "case.json").write_text(json.dumps(case, indent=1) + "\n")
        (tmp / "repro_torch.py").write_text(TORCH_SCRIPT)
        (tmp / "repro_mindspore.py").write_text(MINDSPORE_SCRIPT)
        r = case["report"]
        (tmp / "README.md").write_text(
            f"{case['module']} ({case['kind']}, step {case['step']}): the candidate's module on the baseline's "
            f"input departs, rel L2 {r['own_rel_l2']:.3e}, cosine {r['own_cosine']:.6f} (case.json: settings).\n"
            "python repro_torch.py      # baseline side, PyTorch: recomputes; prints its difference to "
            "outputs/candidate.npy\n"
            "python repro_mindspore.py  # candidate side, MindSpore: recomputes; prints its difference to "
            "outputs/baseline.npy\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# ---------------------------------------------------------------------------------------------------------
# The scripts (they import numpy and their framework only)
# ---------------------------------------------------------------------------------------------------------

_COMMON = '''import json
import pathlib

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
CASE = json.loads((HERE / "case.json").read_text())


def load(rel):
    return np.load(HERE / rel, allow_pickle=False)


def show(what, mine, other, label, report=None):
    """The report's metrics of this side's result against ``other`` (float64): relative L2 (as the report
    computes it: ||baseline - candidate|| / ||candidate||), cosine, max abs error."""
    a, b = np.asarray(mine, np.float64).ravel(), np.asarray(other, np.float64).ravel()
    if SIDE == "candidate":
        a, b = b, a
    rel = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
    cos = float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-30))
    tail = "" if report is None else f"   (report: rel_l2={report:.3e})"
    if report is not None and abs(rel - report) > 0.5 * max(report, 1e-6):
        tail += "  <- NOT reproduced by this recomputation: the saved result comes from code these operators lack"
    print(f"{what:10s} vs {label:34s} rel_l2={rel:.3e} cosine={cos:.6f} max_abs_err={np.abs(a - b).max():.3e}{tail}")
'''

TORCH_SCRIPT = '"""Baseline side, PyTorch: the module recomputed from the saved input and the baseline\'s ' \
    'weights."""\n' + _COMMON + '''
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

SIDE, OTHER = "baseline", "candidate"
S = CASE["settings"][SIDE]
dtype = getattr(torch, S["dtype"])


def rope(t, freqs):                      # Megatron's rotate-half RoPE on [s, b, n, d]
    rot = freqs.shape[-1]
    t, rest = t[..., :rot], t[..., rot:]
    t1, t2 = torch.chunk(t, 2, dim=-1)
    return torch.cat([t * torch.cos(freqs) + torch.cat([-t2, t1], -1) * torch.sin(freqs), rest], -1)


def attention(x, w):
    A = CASE["attention"]
    s, b, _ = x.shape
    n, g, d = A["heads"], A["groups"], A["head_dim"]
    qkv = F.linear(x, w["qkv"]).view(s, b, g, (n // g + 2) * d)       # per query group: [q heads | k | v]
    q, k, v = torch.split(qkv, [n // g * d, d, d], dim=-1)
    q, k, v = q.reshape(s, b, n, d), k.reshape(s, b, g, d), v.reshape(s, b, g, d)
    if "q_norm" in w:
        q, k = F.rms_norm(q, (d,), w["q_norm"], eps=S["eps"]), F.rms_norm(k, (d,), w["k_norm"], eps=S["eps"])
    freqs = torch.tensor(load(A["rotary_pos_emb"])).to(x.dtype)
    q, k = rope(q, freqs), rope(k, freqs)
    k, v = k.repeat_interleave(n // g, dim=2), v.repeat_interleave(n // g, dim=2)
    scores = torch.einsum("sbnd,tbnd->bnst", q.float(), k.float()) / d ** 0.5
    scores = scores.masked_fill(torch.tensor(load(A["mask"])), -10000.0)
    ctx = torch.einsum("bnst,tbnd->sbnd", torch.softmax(scores, -1), v.float()).reshape(s, b, n * d)
    return F.linear(ctx.to(x.dtype), w["proj"])


def loss(logits):                        # Megatron: cross-entropy per token, masked mean
    L = CASE["loss"]
    logits = logits.transpose(0, 1) if L["transpose"] else logits      # [b, s, v], ordered as the labels
    labels = torch.tensor(load(L["labels"])).long()
    mask = torch.tensor(load(L["loss_mask"])).float()
    ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    return (ce * mask.reshape(-1)).sum() / mask.sum()


def module(x, w):
    if CASE["kind"] == "norm":
        return F.rms_norm(x, (x.shape[-1],), w["weight"], eps=S["eps"])
    if CASE["kind"] == "embedding":
        y = F.embedding(x, w["weight"])
        return y.transpose(0, 1) if CASE["embedding"]["transpose"] else y
    if CASE["kind"] == "loss":
        return loss(x)
    if CASE["kind"] == "linear":
        return F.linear(x, w["weight"])
    if CASE["kind"] == "attention":
        return attention(x, w)
    gate, up = torch.chunk(F.linear(x, w["fc1"]), 2, dim=-1)   # fc1 = [gate; up]
    return F.linear(F.silu(gate) * up, w["fc2"])


x = torch.tensor(load(CASE["input"]))
if x.is_floating_point():                # token ids (the embedding's input) stay integers, without a gradient
    x = x.to(dtype).requires_grad_(True)
w = {r: torch.tensor(load(p)).to(dtype).requires_grad_(True) for r, p in CASE["weights"][SIDE].items()}
y = module(x, w)
print(f"{CASE['module']} ({CASE['kind']}) on torch {torch.__version__}, {S}")
show("output", y.detach().float().numpy(), load(CASE["outputs"][OTHER]), f"the {OTHER}'s saved output",
     CASE["report"]["own_rel_l2"])
show("output", y.detach().float().numpy(), load(CASE["outputs"][SIDE]), f"the {SIDE}'s saved output (itself)")
if CASE["grad_output"]:
    names = (["x"] if x.requires_grad else []) + list(w)
    g = torch.autograd.grad(y, [x] * x.requires_grad + list(w.values()),
                            torch.tensor(load(CASE["grad_output"])).to(y.dtype).reshape(y.shape))
    got = dict(zip(names, g))
    for r, info in CASE["grads"].items():
        mine = got[r].float().numpy()
        show(f"d {r}", mine, load(info[OTHER]), f"the {OTHER}'s saved gradient", info["report_own_rel_l2"])
        show(f"d {r}", mine, load(info[SIDE]), f"the {SIDE}'s saved gradient (itself)")
'''

MINDSPORE_SCRIPT = '"""Candidate side, MindSpore: the module recomputed from the saved input and the candidate\'s ' \
    'weights."""\n' + _COMMON + '''
import mindspore as ms  # noqa: E402
from mindspore import ops  # noqa: E402

SIDE, OTHER = "candidate", "baseline"
S = CASE["settings"][SIDE]
dtype = getattr(ms, S["dtype"])
ms.set_context(mode=ms.PYNATIVE_MODE)
CPU = ms.get_context("device_target") == "CPU"


def rms_norm(x, weight):
    if not CPU:                          # MindFormers' FusedRMSNorm kernel
        return ops.rms_norm(x, weight, S["eps"])[0]
    return x * ops.rsqrt(ops.mean(ops.square(x), -1, keep_dims=True) + S["eps"]) * weight


def rope(t, freqs):                      # rotate-half RoPE on [s, b, n, d]
    rot = freqs.shape[-1]
    t, rest = t[..., :rot], t[..., rot:]
    t1, t2 = ops.chunk(t, 2, -1)
    return ops.cat([t * ops.cos(freqs) + ops.cat([-t2, t1], -1) * ops.sin(freqs), rest], -1)


def attention(x, w):
    A = CASE["attention"]
    s, b, _ = x.shape
    n, g, d = A["heads"], A["groups"], A["head_dim"]
    qkv = ops.matmul(x, w["qkv"].T).reshape(s, b, g, (n // g + 2) * d)   # per query group: [q heads | k | v]
    q, k, v = ops.split(qkv, [n // g * d, d, d], -1)
    q, k, v = q.reshape(s, b, n, d), k.reshape(s, b, g, d), v.reshape(s, b, g, d)
    if "q_norm" in w:
        q, k = rms_norm(q, w["q_norm"]), rms_norm(k, w["k_norm"])
    freqs = ms.Tensor(load(A["rotary_pos_emb"])).astype(x.dtype)
    q, k = rope(q, freqs), rope(k, freqs)
    low = getattr(ms, A["candidate_qkv_dtype"])     # MindFormers' flash-attention path: q, k, v (and out) cast
    q, k, v = (t.astype(low).astype(ms.float32) for t in (q, k, v))
    k, v = ops.repeat_interleave(k, n // g, 2), ops.repeat_interleave(v, n // g, 2)
    scores = ops.matmul(q.transpose(1, 2, 0, 3), k.transpose(1, 2, 3, 0)) / d ** 0.5       # [b, n, s, t]
    scores = ops.masked_fill(scores, ms.Tensor(load(A["mask"])), -10000.0)
    ctx = ops.matmul(ops.softmax(scores, -1), v.transpose(1, 2, 0, 3))                   # [b, n, s, d]
    ctx = ctx.astype(low).astype(x.dtype).transpose(2, 0, 1, 3).reshape(s, b, n * d)
    return ops.matmul(ctx, w["proj"].T)


def loss(logits):                        # cross-entropy per token, masked mean, in the measured precision
    L = CASE["loss"]
    logits = logits.transpose(1, 0, 2) if L["transpose"] else logits    # [b, s, v], ordered as the labels
    labels = ms.Tensor(load(L["labels"]).astype(np.int32))
    mask = ms.Tensor(load(L["loss_mask"]).astype(np.float32))
    low = logits.astype(dtype).astype(ms.float32)                        # the loss kernel's input precision
    log_p = ops.log_softmax(low, -1).astype(dtype).astype(ms.float32)    # and its output's
    one_hot = ops.one_hot(labels, logits.shape[-1], ms.Tensor(1.0, ms.float32), ms.Tensor(0.0, ms.float32))
    nll = -(log_p * one_hot).sum(-1)
    # its backward as MindFormers' CrossEntropyLoss computes it: the softmax from its saved log-probabilities
    # minus the one-hot (the value stays nll; the gradient flows through `lin`)
    lin = ((ops.stop_gradient(ops.exp(log_p)) - one_hot) * logits).sum(-1)
    nll = ops.stop_gradient(nll - lin) + lin
    return (nll * mask).sum() / mask.sum()


def module(x, *ws):
    w = dict(zip(CASE["weights"][SIDE], ws))
    if CASE["kind"] == "norm":
        return rms_norm(x, w["weight"])
    if CASE["kind"] == "embedding":      # rows read in float32, the output in the measured precision
        y = ops.gather(w["weight"], x, 0).astype(dtype)
        return y.transpose(1, 0, 2) if CASE["embedding"]["transpose"] else y
    if CASE["kind"] == "loss":
        return loss(x)
    if CASE["kind"] == "linear":
        return ops.matmul(x, w["weight"].T)
    if CASE["kind"] == "attention":
        return attention(x, w)
    gate, up = ops.chunk(ops.matmul(x, w["fc1"].T), 2, -1)      # fc1 = [gate; up] (the baseline's layout)
    return ops.matmul(ops.silu(gate) * up, w["fc2"].T)


x = ms.Tensor(load(CASE["input"]))
ws = [ms.Tensor(load(p)).astype(ms.float32 if CASE["kind"] == "embedding" else dtype)
      for p in CASE["weights"][SIDE].values()]
if x.is_floating_point():
    x = x.astype(ms.float32 if CASE["kind"] == "loss" else dtype)        # the loss rounds inside
    y, vjp = ms.vjp(module, x, *ws)
    names = ["x", *CASE["weights"][SIDE]]
else:                                    # token ids (the embedding's input): integers, no gradient
    x = x.astype(ms.int32)
    y, vjp = ms.vjp(lambda *w: module(x, *w), *ws)
    names = list(CASE["weights"][SIDE])
print(f"{CASE['module']} ({CASE['kind']}) on MindSpore {ms.__version__} ({ms.get_context('device_target')}), {S}")
show("output", y.astype(ms.float32).asnumpy(), load(CASE["outputs"][OTHER]), f"the {OTHER}'s saved output",
     CASE["report"]["own_rel_l2"])
show("output", y.astype(ms.float32).asnumpy(), load(CASE["outputs"][SIDE]), f"the {SIDE}'s saved output (itself)")
if CASE["grad_output"]:
    g = vjp(ms.Tensor(load(CASE["grad_output"])).astype(y.dtype).reshape(y.shape))
    got = dict(zip(names, g if isinstance(g, tuple) else (g,)))
    for r, info in CASE["grads"].items():
        mine = got[r].astype(ms.float32).asnumpy()
        show(f"d {r}", mine, load(info[OTHER]), f"the {OTHER}'s saved gradient", info["report_own_rel_l2"])
        show(f"d {r}", mine, load(info[SIDE]), f"the {SIDE}'s saved gradient (itself)")
'''
