"""`align convert-weights`: Megatron-core state_dict <-> MindFormers weights: safetensors with mcore names
(MindFormers 2.x, .safetensors out/in) or a MindSpore checkpoint for the legacy Llama (.ckpt).

Why through the mapping: the same YAML rules that pair names for comparison also move the tensors (fused
QKV split by query group, gated fc1 chunked per TP shard), so conversion and comparison can never disagree.
Transforms only slice and concatenate, so the round trip is bit-identical. bfloat16 travels as float32
(exact both ways) because numpy has no bfloat16. torch / mindspore are imported inside the functions that
need them: align/ stays importable with numpy alone.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Iterator, Sequence
from collections.abc import Mapping as MappingABC
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from core.errors import BadInput
from core.findings import Finding, StageResult
from mapping import Mapping, TransformParams
from models import load_mapping, preset_for_checkpoint


def _torch_state(path: str | Path) -> dict[str, Any]:
    import zipfile

    import torch

    from checkpoints.megatron import check_zip_crc
    from runstore.schema import regular_file

    regular_file(path, "torch checkpoint")     # a FIFO would block is_zipfile, a device never ends
    if zipfile.is_zipfile(path):   # torch.load does not check the CRCs torch.save wrote
        check_zip_crc(path, path)
    try:
        with warnings.catch_warnings():   # a warning torch prints for a bad file would precede the one line
            warnings.simplefilter("ignore")
            obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises many kinds for a bad file
        raise BadInput(f"{path}: not a loadable torch checkpoint with weights_only=True "
                       f"({exc.__class__.__name__})") from None
    if isinstance(obj, dict) and "model" in obj and isinstance(obj["model"], dict):
        obj = obj["model"]
    if not isinstance(obj, dict):
        raise BadInput(f"{path}: expected a state_dict (name -> tensor)")
    return obj


_INDEXED = re.compile(r"\.(\d+)\.")


def check_out_path(out: str | Path) -> Path:
    """``--out`` must name a file in an existing folder: refused before anything is read or written."""
    p = Path(out)
    if p.is_dir():
        raise BadInput(f"{p}: --out is an existing folder; name the file to write")
    if not p.parent.is_dir():
        raise BadInput(f"{p}: --out folder {p.parent} does not exist")
    return p


def check_model_params(num_heads: int, num_query_groups: int | None, num_experts: int | None) -> None:
    if num_heads is None or num_heads <= 0:
        raise BadInput(f"--num-heads {num_heads}: expected a positive number of attention heads")
    if num_query_groups is not None and (num_query_groups <= 0 or num_heads % num_query_groups):
        raise BadInput(f"--num-query-groups {num_query_groups}: expected a positive divisor of --num-heads "
                       f"{num_heads}")
    if num_experts is not None and num_experts <= 0:
        raise BadInput(f"--num-experts {num_experts}: expected a positive number of experts")


def check_weights(state: MappingABC[str, Any], mapping: Mapping, side: str, where: str) -> StageResult:
    """What the mapping cannot see in a state_dict before converting it: no tensors at all; a mapped tensor
    that is empty or of a dtype no weight has (complex, object, strings); a tensor one layer (or expert) lacks
    that its siblings hold (a whole rule's group is absent, so the mapping's own completeness check, per
    group, never sees it); a tensor whose shape differs from the same tensor in the sibling layers. Scalars
    where a weight is mapped are bad input (no rule transforms a 0-d tensor)."""
    res = StageResult("weights")
    if not state:
        res.add(Finding("weights", "fail", None, "no_tensors", 0, None, f"{where}: holds no tensors"))
        return res
    for name, v in state.items():
        a = v if isinstance(v, np.ndarray) else np.asarray(v)
        if mapping.match(name, side) is None:
            continue
        if a.dtype.kind not in "biuf":
            res.add(Finding("weights", "fail", name, "bad_dtype", str(a.dtype), None,
                            f"{where}: {name} has dtype {a.dtype}, not a weight dtype (float, int, bool)"))
        elif a.ndim == 0:
            raise BadInput(f"{where}: {name} is a scalar; a weight of this mapping has at least one dimension")
        elif a.size == 0:
            res.add(Finding("weights", "fail", name, "empty_tensor", str(list(a.shape)), None,
                            f"{where}: {name} is empty (shape {list(a.shape)})"))
    # siblings: the same prefix with another index (layers, experts, MTP layers)
    members: dict[str, dict[int, dict[str, tuple[int, ...]]]] = {}
    for name, v in state.items():
        for m in _INDEXED.finditer(name):
            prefix, rest = name[:m.start()], name[m.end():]
            members.setdefault(prefix, {}).setdefault(int(m.group(1)), {})[rest] = tuple(np.shape(v))
    for prefix, by_index in members.items():
        if len(by_index) < 2:
            continue
        sigs = {i: frozenset(r) for i, r in by_index.items()}
        for i, sig in sorted(sigs.items()):
            supersets = [o for o in sigs.values() if sig < o]
            if supersets:
                for rest in sorted(min(supersets, key=len) - sig):
                    name = f"{prefix}.{i}.{rest}"
                    res.add(Finding("weights", "fail", name, "missing_tensor", None, None,
                                    f"{where}: {name} is missing (the other {prefix}.* hold it)"))
        shapes: dict[str, dict[tuple[int, ...], list[int]]] = {}
        for i, rests in by_index.items():
            for rest, shape in rests.items():
                shapes.setdefault(rest, {}).setdefault(shape, []).append(i)
        for rest, seen in shapes.items():
            if len(seen) > 1:
                common = max(seen, key=lambda sh: len(seen[sh]))
                for shape, idx in seen.items():
                    if shape != common:
                        res.add(Finding("weights", "fail", f"{prefix}.{idx[0]}.{rest}", "shape_mismatch",
                                        str(list(shape)), str(list(common)),
                                        f"{where}: {prefix}.{idx[0]}.{rest} has shape {list(shape)}, the other "
                                        f"{prefix}.* have {list(common)}"))
    if not res.findings:
        res.verdict = "pass"
    return res


def _refused(res: StageResult, problems: StageResult, out: str | Path, **details: Any) -> StageResult:
    """Fold the weight check's failures into ``res`` and mark it failed: nothing is written."""
    for f in problems.findings:
        res.add(f)
    res.verdict = "fail"
    res.details.update({"out": str(out), "tensors": 0, **details})
    return res


def merge_tp_shards(shards: Sequence[MappingABC[str, np.ndarray]], mapping: Mapping) -> dict[str, np.ndarray]:
    """Concatenate TP shards on each rule's partition dim; duplicated (dim -1) tensors are taken once."""
    if len(shards) == 1:
        return dict(shards[0])
    names = set(shards[0])
    for r, s in enumerate(shards[1:], 1):
        if set(s) != names:
            diff = sorted(names ^ set(s))
            raise BadInput(f"TP shards 0 and {r} hold different tensors (e.g. {diff[0]}; {len(diff)} differ): "
                           "not shards of one checkpoint")
    out = {}
    for name in shards[0]:
        m = mapping.match(name, "baseline")
        dim = m.rule.tp_partition_dim if m else -1
        parts = [np.asarray(s[name]) for s in shards]
        shapes = [list(p.shape) for p in parts]
        if dim >= 0:
            if any(p.ndim <= dim or p.shape[:dim] + p.shape[dim + 1:] != parts[0].shape[:dim] + parts[0].shape[dim + 1:]
                   for p in parts):
                raise BadInput(f"TP shards of {name} do not fit together on dim {dim}: shapes {shapes}")
            out[name] = np.concatenate(parts, axis=dim)
        else:
            if any(p.shape != parts[0].shape for p in parts):
                raise BadInput(f"TP shards of {name} differ in shape ({shapes}), yet its rule does not split it")
            out[name] = parts[0]
    return out


def megatron_to_numpy(paths: Sequence[str | Path]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Load Megatron state_dict files (one, or one per TP rank in rank order) as float32/int numpy.

    One folder instead: a Megatron checkpoint as saved (torch_dist, or legacy mp_rank_* files), merged over
    TP / PP / EP into one TP=1 state_dict by checkpoints.megatron.
    """
    if len(paths) == 1 and Path(paths[0]).is_dir():
        from checkpoints.megatron import read_megatron_checkpoint

        return read_megatron_checkpoint(paths[0])
    import torch

    shards, dtypes = [], {}
    for p in paths:
        sd = _torch_state(p)
        arrays = {}
        for k, v in sd.items():
            if not isinstance(v, torch.Tensor):
                continue           # _extra_state and other non-tensor entries
            dtypes[k] = str(v.dtype).replace("torch.", "")
            arrays[k] = (v.float() if v.dtype == torch.bfloat16 else v).detach().cpu().numpy()
        shards.append(arrays)
    return shards[0] if len(shards) == 1 else shards, dtypes   # type: ignore[return-value]


def _mapping_for(mapping: str | Mapping | None, names: Sequence[str], side: str, mindformers_file: str | Path,
                 where: str) -> Mapping:
    """``--mapping`` when given, else the preset the checkpoint's own tensor names need (dense, MoE, MLA, the
    legacy Llama: models.preset_for_checkpoint); the MindFormers file's suffix only picks its format (and
    breaks the one tie names leave: a dense GPT's Megatron names fit the mcore dense and the legacy Llama)."""
    if isinstance(mapping, Mapping):
        return mapping
    if mapping is not None:
        return load_mapping(mapping)
    return load_mapping(preset_for_checkpoint(list(names), side, mindformers_file, where))


def convert_megatron_to_mindformers(paths: Sequence[str | Path], out: str | Path, *, num_heads: int,
                                    num_query_groups: int | None = None, mapping: str | None = None,
                                    dtype: str | None = None, num_experts: int | None = None) -> StageResult:
    """Megatron-core state_dict(s) -> MindFormers weights: ``out`` ending in .safetensors gets mcore names and
    layouts (loadable with ``load_ckpt_format: safetensors``), else a MindSpore .ckpt (legacy Llama)."""
    check_out_path(out)
    check_model_params(num_heads, num_query_groups, num_experts)
    m: str | Mapping | None = load_mapping(mapping) if mapping is not None else None   # refused before reading
    where = ", ".join(str(p) for p in paths)
    loaded, dtypes = megatron_to_numpy(paths)
    tp = len(paths)
    first = loaded[0] if isinstance(loaded, list) else loaded
    m = _mapping_for(m, list(first), "baseline", out, where)
    try:
        state = merge_tp_shards(loaded if tp > 1 else [loaded], m)   # type: ignore[list-item]
    except BadInput as exc:
        raise BadInput(f"{where}: {exc}") from None
    # fc1 halves are [gate; up] per TP shard; after concatenation the chunk transform needs tp
    params = TransformParams(num_heads=num_heads, num_query_groups=num_query_groups or num_heads, tp=tp,
                             num_experts=num_experts)
    weights = {k: v for k, v in state.items() if not m.ignored(k, "baseline")}
    src_dtype = dtype or (next(iter(dtypes.values())) if dtypes else "float32")
    problems = check_weights(weights, m, "baseline", where)
    try:
        converted, res = m.convert(weights, "candidate", params)
    except BadInput as exc:
        if problems.verdict == "fail":   # the cause is named there (an empty or complex tensor)
            return _refused(StageResult("mapping"), problems, out, tp_shards_merged=tp, dtype=src_dtype)
        raise BadInput(f"{where}: {exc}") from None
    if problems.verdict == "fail" or res.verdict == "fail" or not converted:
        # nothing half-way: an incomplete conversion writes no file
        if not converted and not problems.findings and res.verdict != "fail":
            problems.add(Finding("weights", "fail", None, "no_weights", 0, None, f"{where}: no tensor to convert"))
        return _refused(res, problems, out, tp_shards_merged=tp, dtype=src_dtype)
    totals = _self_check(m, weights, converted, "candidate", params, None, where, res)
    if totals.verdict == "fail":   # a part dropped or counted twice: refused, nothing written
        return _refused(res, totals, out, tp_shards_merged=tp, dtype=src_dtype)
    if str(out).endswith(".safetensors"):
        from checkpoints.mindformers import write_safetensors

        write_safetensors(converted, out, dtype="bfloat16" if src_dtype == "bfloat16" else None,
                          metadata={"mapping": m.name})
        res.details.update({"out": str(out), "mapping": m.name, "tensors": len(converted), "tp_shards_merged": tp,
                            "dtype": src_dtype, "format": "safetensors"})
        return res
    import mindspore as ms

    items = []
    for name, arr in converted.items():
        t = ms.Tensor(arr)
        if src_dtype == "bfloat16":
            t = t.astype(ms.bfloat16)
        items.append({"name": name, "data": ms.Parameter(t, name=name)})
    # written under a temporary name, renamed when complete; mindspore appends .ckpt to a name without it
    out = out if str(out).endswith(".ckpt") else f"{out}.ckpt"
    with _atomic(out) as tmp:
        ms.save_checkpoint(items, str(tmp))
    res.details.update({"out": str(out), "mapping": m.name, "tensors": len(items), "tp_shards_merged": tp,
                        "dtype": src_dtype})
    return res


def mindformers_to_numpy(path: str | Path) -> tuple[dict[str, np.ndarray], str]:
    import mindspore as ms

    try:
        params = ms.load_checkpoint(str(path))
    except Exception as exc:  # noqa: BLE001
        raise BadInput(f"{path}: not a MindSpore checkpoint ({exc.__class__.__name__})") from None
    out, dtype = {}, "float32"
    for k, p in params.items():
        if p.dtype == ms.bfloat16:
            dtype = "bfloat16"
            out[k] = p.astype(ms.float32).asnumpy()
        else:
            out[k] = p.asnumpy()
    return out, dtype


def convert_mindformers_to_megatron(path: str | Path, out: str | Path, *, num_heads: int,
                                    num_query_groups: int | None = None, mapping: str | None = None,
                                    scheme: str = "local", num_experts: int | None = None,
                                    sizes: dict[str, int] | None = None) -> StageResult:
    """MindFormers weights (.safetensors with mcore names, or a legacy Llama .ckpt) -> Megatron-core
    state_dict (TP=1) saved by torch. ``sizes``: the named sizes a fused tensor splits back by (`concat`
    rules, e.g. ``q_down`` = q_lora_rank for MLA's linear_qkv with mla_qkv_concat)."""
    import torch

    check_out_path(out)
    check_model_params(num_heads, num_query_groups, num_experts)
    given = load_mapping(mapping) if mapping is not None else None   # refused before reading
    if str(path).endswith(".safetensors"):
        from checkpoints.mindformers import read_safetensors

        state, dtypes = read_safetensors(path)
        dtype = "bfloat16" if "bfloat16" in dtypes.values() else "float32"
    else:
        state, dtype = mindformers_to_numpy(path)
    m = _mapping_for(given, [k for k in state if not optimizer_key(k)], "candidate", path, str(path))
    params = TransformParams(num_heads=num_heads, num_query_groups=num_query_groups or num_heads,
                             num_experts=num_experts, sizes=dict(sizes or {}))
    # optimizer state (adam moments, step counters) lives in the same file: not weights, not converted
    weights = {k: v for k, v in state.items()
               if (m.match(k, "candidate") is not None or not optimizer_key(k)) and not m.ignored(k, "candidate")}
    problems = check_weights(weights, m, "candidate", str(path))
    try:
        converted, res = m.convert(weights, "baseline", params, scheme=scheme)
    except BadInput as exc:
        if problems.verdict == "fail":
            return _refused(StageResult("mapping"), problems, out, dtype=dtype)
        raise BadInput(f"{path}: {exc}") from None
    if problems.verdict == "fail" or res.verdict == "fail" or not converted:   # nothing half-way
        if not converted and not problems.findings and res.verdict != "fail":
            problems.add(Finding("weights", "fail", None, "no_weights", 0, None, f"{path}: no tensor to convert"))
        return _refused(res, problems, out, dtype=dtype)
    totals = _self_check(m, weights, converted, "baseline", params, scheme, str(path), res)
    if totals.verdict == "fail":
        return _refused(res, totals, out, dtype=dtype)
    tdt = torch.bfloat16 if dtype == "bfloat16" else None
    sd = {k: (torch.from_numpy(np.ascontiguousarray(v)).to(tdt) if tdt else torch.from_numpy(
        np.ascontiguousarray(v))) for k, v in converted.items()}
    with _atomic(out) as tmp:
        torch.save(sd, str(tmp))
    res.details.update({"out": str(out), "mapping": m.name, "tensors": len(sd), "dtype": dtype})
    return res


def _self_check(m: Mapping, weights: MappingABC[str, Any], converted: MappingABC[str, Any], to_side: str,
                params: TransformParams, scheme: str | None, where: str, res: StageResult) -> StageResult:
    """Converted weights vs the source's, group by group and in total (checkpoints.conversion_totals): the
    same groups the mapping converted (``Mapping.pair``, as ``Mapping.convert`` forms them). On a pass its
    finding and numbers join ``res`` (the conversion report shows them)."""
    from checkpoints.conversion_totals import check_totals

    from_side = "baseline" if to_side == "candidate" else "candidate"
    names = list(weights)
    pairs, _, _ = m.pair(*((names, []) if from_side == "baseline" else ([], names)), scheme,
                         num_experts=params.num_experts)
    groups = []
    for gp in pairs:
        src = gp.baseline_present if from_side == "baseline" else gp.candidate_present
        want = gp.match.baseline if from_side == "baseline" else gp.match.candidate
        if len(src) == len(want):     # an incomplete group was refused by convert already
            groups.append((list(src), list(gp.match.candidate if to_side == "candidate" else gp.match.baseline)))
    totals = check_totals(groups, weights, converted, where)
    if totals.verdict == "pass":
        for f in totals.findings:
            res.add(f)
        res.details["self_check"] = totals.details
    return totals


def optimizer_key(name: str) -> bool:
    return name.startswith(("adam_", "moment1.", "moment2.", "global_step", "learning_rate", "scale_sense",
                            "current_iterator_step", "last_overflow_iterator_step", "epoch_num", "step_num",
                            "loss_scale"))


@contextmanager
def _atomic(out: str | Path) -> Iterator[Path]:
    """A temporary name beside ``out`` (same suffix) that replaces ``out`` only when the block completes."""
    out = Path(out)
    tmp = out.with_name(f".{out.stem}.tmp{os.getpid()}{out.suffix}")
    try:
        yield tmp
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
