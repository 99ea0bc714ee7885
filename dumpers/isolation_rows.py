"""What an isolated module's weight gradients and result row hold, whichever framework the candidate runs in.

Why one place: the MindSpore candidate (dumpers.mindspore_backward_isolation) and the PyTorch candidate
(dumpers.torch_isolation) write the same evidence for the comparator (comparators.isolation); only how their
gradients are computed differs."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from core.dtypes import coarsest, normalize


def computes_attention(class_names: Iterable[str]) -> bool:
    """Whether a module computes an attention: it or a module inside it is an attention class (SelfAttention,
    FlashAttention, DotProductAttention, ...). Those are judged at the attention's precision (MindFormers'
    flash attention rounds q/k/v to float16 in a float32 run); the rest at their own."""
    return any("attention" in n.lower() for n in class_names)


def compute_dtype(output_dtype: Any, param_dtypes: Iterable[Any]) -> str:
    """The precision a module computes in, from its output's and its parameters' dtypes: the coarsest."""
    return coarsest([normalize(str(output_dtype)), *(normalize(str(d)) for d in param_dtypes)])


def add_weight_grads(arrays: dict[str, np.ndarray], grads: list[dict[str, Any]], barr: Mapping[str, np.ndarray],
                     module: str, params: list[str], iso_w: Mapping[str, np.ndarray],
                     own_w: Mapping[str, np.ndarray]) -> list[str]:
    """The baseline's, the isolated candidate's and the candidate's own gradient of each baseline weight of
    ``module`` (already in the baseline's names and layouts) into ``arrays``; returns the weights that could
    not be compared (no candidate gradient of that name and shape)."""
    missing = []
    for pname in params:
        key = f"grad_weight/{module}/{pname}"
        if pname not in iso_w or iso_w[pname].shape != barr[key].shape:
            missing.append(pname)
            continue
        what = f"weight:{pname}"
        arrays[f"grad/baseline/{module}/{what}"] = np.asarray(barr[key]).astype(np.float32)
        arrays[f"grad/isolated/{module}/{what}"] = iso_w[pname]
        arrays[f"grad/candidate/{module}/{what}"] = own_w[pname]
        grads.append({"what": what})
    return missing


def result_row(module: str, candidate: str, kind: str, entry: Mapping[str, Any], dtype_candidate: str,
               inputs: list[dict[str, Any]], grads: list[dict[str, Any]], missing: list[str],
               attention: bool | None = None) -> dict[str, Any]:
    """One isolated module's row of the isolation evidence (``entry``: the baseline capture's; ``attention``:
    whether the candidate's module computes an attention, None when not known)."""
    x0 = next((i for i in inputs if i["source"] == "baseline"), None)
    return {"baseline": module, "candidate": candidate, "kind": kind,
            "dtype_baseline": entry.get("dtype", "float32"), "dtype_candidate": dtype_candidate,
            "input_rel_l2": x0["own_rel_l2"] if x0 else None, "inputs": inputs, "grads": grads,
            "weights_not_compared": missing, "replay_rel_l2": entry.get("replay_rel_l2"),
            **({} if attention is None else {"attention": bool(attention)})}
