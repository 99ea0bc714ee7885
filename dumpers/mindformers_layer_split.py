"""Which part of a MindFormers (mcore) activation one rank holds, in the run store's ``split`` vocabulary.

Why: a MindFormers TP / CP / EP run holds each layer output in slices, and the layer stage gathers a row from its
ranks' parts only when each row says how it was cut (sources/layers.py reads ``split`` as Megatron's dumper writes
it). Framework-free: the MindSpore dumper calls :func:`activation_split` per row, the tests feed the same layout to
MindSpore's own slicing (``mindspore.parallel._tensor._get_tensor_slice_index``).

What MindFormers 2.1.0 does (read from the wheel, parallel_core/training_graph):

* Ranks: stage-major, ``stage = rank // (world / pipeline_stage)`` (models/utils.py ``get_current_rank_stage``);
  inside a stage the device matrix is (dp, cp, tp), tp fastest (device_matrix.py ``init_dp_cp_tp_layout``); the
  MoE one is (dp * tp * cp / ep, ep) over the same ranks (``init_dp_cp_tp_ep_layout``), so a rank's EP index is
  its index in the stage modulo ep (``models.mindformers_parallel.ParallelStrategy.coords``).
* Activations are sequence first, [S, B, H]. A layout's dim names the device axes that cut it, contiguously (a
  MindSpore tensor map): column-parallel linears (linear_qkv, linear_fc1, MLA up projections, output_layer)
  output ("cp", "dp", "tp") (tensor_parallel/layers.py ``ColumnParallelLinear.shard``); row-parallel ones
  (linear_proj, linear_fc2) output ("cp", "dp", None), under sequence parallel ("cp_tp", "dp", None)
  (``RowParallelLinear.shard``); the embedding's hidden states ("cp"[_tp], "dp", None) after its [B, S, H] ->
  [S, B, H] transpose (language_model_embedding.py); QK norms ("cp", "dp", "tp", None) (attention.py); the
  routed experts (moe/ffn.py ``FFNGroupedGEMM``) return the tokens in token order [B, S, H], the batch cut over
  every rank of the stage (moe layout ("dp_cp", None, None) = (dp_ex_ep, ep)); every other hidden state
  (norms, layers, the MoE / MLP output, bias-dropout-add) as the residual stream: ("cp"[_tp], "dp", None).
* CP cuts the sequence into ``cp`` contiguous blocks (a layout, not Megatron's zig-zag): ``cp:cD``. Under
  sequence parallelism the sequence axis is ("cp", "tp"): CP block c holds TP blocks t, block index c * tp + t:
  ``tp:D,cp:cD`` (TP parts joined first, then the CP blocks, as sources.layers.join_parts does).
* DP cuts the batch (dim 1, or 0 for the experts): the layer stage reads one DP rank's replica (DP rank 0 of
  the gather), so the DP axis is not written.
* Anything whose layout was not read or not settled (the core attention's internals, the router, MLA's
  compressed projections and their norms, an output whose rank differs from its layout's) is ``tp:x`` (and
  ``cp:x``) when TP (CP) > 1: left out of a gathered compare, never taken as whole.
"""

from __future__ import annotations

import re
from typing import Any

#: module (last name parts) -> role; first match wins
_ROLES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"(^|\.)(linear_qkv|linear_fc1|linear_q_proj|linear_q_up_proj|linear_kv_up_proj|output_layer)$"),
     "column"),
    (re.compile(r"(^|\.)(linear_proj|linear_fc2)$"), "row"),
    (re.compile(r"(^|\.)(q_layernorm|k_layernorm)$"), "heads"),
    (re.compile(r"(^|\.)mlp\.experts$"), "experts"),
    (re.compile(r"(^|\.)embedding\.word_embeddings$"), "word_embeddings"),
    # read but not settled: the core attention's internals, the router's token-cut outputs, MLA's compressed
    # projections (their norms cut the sequence over ("cp", "tp") with or without SP: multi_latent_attention.py)
    (re.compile(r"(^|\.)(core_attention|flash_attention|router|token_dispatcher|linear_q_down_proj|"
                r"linear_kv_down_proj|kv_layernorm)(\.|$)"), "unread"),
)


def role(module: str) -> str:
    """The layout family of a MindFormers mcore cell by its name (``other``: a hidden state)."""
    for pattern, name in _ROLES:
        if pattern.search(module):
            return name
    return "other"


def output_layout(module: str, ndim: int, floating: bool, *, sp: bool) -> tuple[tuple[str, ...], ...] | None:
    """The device axes cutting each dim of ``module``'s output (or its gradient), as MindFormers' ``shard()``
    declares them (module doc); () for a whole dim; None when the layout is not known (``unread`` cells, or a
    tensor of another rank than the layout's)."""
    seq = ("cp", "tp") if sp else ("cp",)
    r = role(module)
    if r == "unread":
        return None
    if r == "column":
        return (("cp",), ("dp",), ("tp",)) if ndim == 3 else None
    if r == "row":
        return (seq, ("dp",), ()) if ndim == 3 else None
    if r == "heads":
        return (("cp",), ("dp",), ("tp",), ()) if ndim == 4 else None
    if r == "experts":
        return (("dp", "cp", "tp"), (), ()) if ndim == 3 else None
    if r == "word_embeddings":
        return (("dp",), seq, ()) if ndim == 3 else None
    if floating and ndim == 3:
        return (seq, ("dp",), ())
    return tuple(() for _ in range(ndim))      # whole on every rank (masks, scalars, rotary tables)


def layout_split(layout: tuple[tuple[str, ...], ...] | None, *, tp: int, cp: int) -> str:
    """A layout in the ``split`` vocabulary (sources.layers.parse_split): ``tp:D`` TP rank t holds block t of
    ``tp`` along D; ``cp:cD`` CP rank c holds block c of ``cp`` (contiguous); both on one dim: CP blocks of TP
    blocks. The DP axis is left out (one DP rank's replica is read); an unknown layout is ``tp:x`` / ``cp:x``."""
    if layout is None:
        return ",".join((["tp:x"] if tp > 1 else []) + (["cp:x"] if cp > 1 else []))
    parts: list[str] = []
    for d, axes in enumerate(layout):
        if "tp" in axes and tp > 1:
            parts.append(f"tp:{d}")
        if "cp" in axes and cp > 1:
            parts.append(f"cp:c{d}")
    return ",".join(parts)


def activation_split(module: str, ndim: int, floating: bool, *, tp: int, cp: int, sp: bool) -> str:
    """The ``split`` of one captured output (``forward.output.N``) or output gradient of a MindFormers cell."""
    if tp <= 1 and cp <= 1:
        return ""
    return layout_split(output_layout(module, ndim, floating, sp=sp), tp=tp, cp=cp)


def tensor_map(layout: tuple[tuple[str, ...], ...], device_axes: tuple[str, ...] = ("dp", "cp", "tp")) -> list[Any]:
    """``layout`` as a MindSpore tensor map over the device matrix ``device_axes`` (entry k names axis
    ``len(axes) - 1 - k``; -1 whole; a tuple for several axes on one dim), for MindSpore's own slicing."""
    def index(axis: str) -> int:
        return len(device_axes) - 1 - device_axes.index(axis)

    out: list[Any] = []
    for axes in layout:
        ks = [index(a) for a in axes]
        out.append(-1 if not ks else ks[0] if len(ks) == 1 else tuple(ks))
    return out
