"""comparators.routing and runstore.routing on small numpy data: the precision a router computes in, near ties
against real flips, the expert order, the routing group's round trip through a step file."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from comparators.routing import RoutingTolerance, compare_routing, effective_precision
from core.errors import BadInput
from runstore import RunWriter
from runstore.routing import batch_major, from_routing_map, make_record, put_routing, read_routing

T, E, K = 64, 4, 2
NAME = "decoder.layers.0.mlp.router"


def route(logits: np.ndarray, name: str = NAME, dtype: str = "float32") -> object:
    """A softmax top-k router's record from its logits (top-k probabilities renormalised, as both routers do)."""
    idx = np.argsort(-logits, axis=1, kind="stable")[:, :K]
    top = np.take_along_axis(logits, idx, 1)
    p = np.exp(top - top.max(axis=1, keepdims=True))
    return make_record(name, logits, idx, p / p.sum(axis=1, keepdims=True), logits_dtype=dtype, probs_dtype=dtype,
                       score_function="softmax", topk=K)


def logits(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(T, E)).astype(np.float32)


def judge(b: object, c: object, dtype: str = "float32", **kw: object) -> tuple[dict, list]:
    rows, findings = compare_routing({NAME: b}, {NAME: c}, RoutingTolerance.for_dtype(dtype), **kw)
    return rows[0], findings


def test_the_same_routing_passes_and_small_noise_passes() -> None:
    z = logits()
    row, findings = judge(route(z), route(z * (1 + 1e-7)))
    assert findings == [] and row["verdict"] == "pass" and row["topk_agreement"] == 1.0
    assert row["baseline_precision"] == row["candidate_precision"] == "float32"


def test_logits_are_judged_at_the_dtype_line_and_overrides_apply() -> None:
    z = logits()
    noisy = z + np.float32(3e-3) * np.random.default_rng(9).normal(size=z.shape).astype(np.float32)
    row, findings = judge(route(z), route(noisy))          # float32: pass 1e-4, fail beyond 1e-2
    (f,) = [f for f in findings if f.metric == "logits_rel_l2"]
    assert f.verdict == "warn" and 2e-3 < row["logits_rel_l2"] < 5e-3
    assert not [f for f in judge(route(z), route(noisy), dtype="bfloat16")[1] if f.metric == "logits_rel_l2"]
    tol = RoutingTolerance.for_dtype("fp32", {"float32": (1e-5, 1e-3, 0.9)})
    assert (tol.dtype, tol.rel_pass, tol.rel_fail) == ("float32", 1e-5, 1e-3)
    rows, findings = compare_routing({NAME: route(z)}, {NAME: route(noisy)}, tol)
    assert [f.verdict for f in findings if f.metric == "logits_rel_l2"] == ["fail"]


def test_a_router_computed_in_float16_is_named_by_its_precision() -> None:
    z = logits()
    low = z.astype(np.float16).astype(np.float32)        # computed in float16, cast back: dtype says float32
    assert effective_precision(low) == "float16" and effective_precision(z) == "float32"
    row, findings = judge(route(z), route(low), dtype="float16")   # its values are within float16's line
    prec = [f for f in findings if f.metric == "router_precision"]
    assert prec and prec[0].verdict == "fail" and prec[0].component == NAME and prec[0].value == "float16"
    assert "candidate" in prec[0].message and row["candidate_precision"] == "float16/float32"   # logits/probs
    bf = route(z, dtype="bfloat16")      # a declared dtype counts too
    assert judge(route(z), bf)[1][0].value == "bfloat16"


def test_near_ties_are_tolerated_and_real_flips_are_not() -> None:
    z = logits(1)
    order = np.argsort(-z, axis=1)
    tie = z.copy()
    k, k1 = order[0, K - 1], order[0, K]
    tie[0, k1] = tie[0, k] - 1e-7                        # token 0: the k-th and (k+1)-th expert nearly tie
    flipped = tie.copy()
    flipped[0, [k, k1]] = flipped[0, [k1, k]]            # the candidate picks the other one
    row, findings = judge(route(tie), route(flipped))
    assert row["near_ties"] == 1 and row["flips"] == 0
    assert not [f for f in findings if f.metric in ("topk_flips", "tokens_per_expert")]
    far = z.copy()
    j = order[5, 0]
    far[5, j] = z[5].min() - 3.0                         # token 5: its first choice is dropped far beyond noise
    row, findings = judge(route(z), route(far))
    flips = [f for f in findings if f.metric == "topk_flips"]
    assert row["flips"] == 1 and flips and "token 5" in flips[0].message
    assert any(f.metric == "tokens_per_expert" for f in findings)


def test_experts_in_another_order_are_named_and_the_mapping_order_undoes_it() -> None:
    z = logits(2)
    swapped = z[:, [1, 0, 2, 3]]
    row, findings = judge(route(z), route(swapped))
    metrics = {f.metric: f for f in findings}
    assert metrics["expert_order"].value == "0->1, 1->0" and metrics["expert_order"].verdict == "fail"
    assert "tokens_per_expert" in metrics and row["verdict"] == "fail"
    row, findings = judge(route(z), route(swapped), expert_order={NAME: [1, 0, 2, 3]})
    assert findings == [] and row["topk_agreement"] == 1.0


def test_routers_are_compared_in_layer_order_and_one_sided_ones_warn() -> None:
    base = {f"decoder.layers.{i}.mlp.router": route(logits(i), f"decoder.layers.{i}.mlp.router") for i in (10, 2)}
    cand = dict(base)
    cand["decoder.layers.3.mlp.router"] = route(logits(3), "decoder.layers.3.mlp.router")
    rows, findings = compare_routing(base, cand, RoutingTolerance())
    assert [r["router"] for r in rows] == ["decoder.layers.2.mlp.router", "decoder.layers.10.mlp.router"]
    assert [(f.verdict, f.metric) for f in findings] == [("warn", "router_one_sided")]


def test_megatron_dense_outputs_and_token_order() -> None:
    seq, batch = 3, 2
    z = np.arange(seq * batch * E, dtype=np.float32).reshape(seq * batch, E) % 5
    rmap = np.zeros_like(z, bool)
    rmap[np.arange(seq * batch), np.argmax(z, axis=1)] = True
    probs = np.where(rmap, 1.0, 0.0).astype(np.float32)
    rec = from_routing_map(NAME, batch_major(z, seq, batch), batch_major(probs, seq, batch),
                           batch_major(rmap, seq, batch), 2, logits_dtype="float32", probs_dtype="float32")
    # token (b=1, s=0) is Megatron's row 1 (sequence-major) and the record's row seq * 1 + 0
    assert np.array_equal(rec.logits[seq], z[1])
    assert (rec.topk_index[:, 1] == -1).all() and rec.tokens_per_expert.sum() == seq * batch


def test_routing_round_trip_and_malformed_groups(tmp_path: Path) -> None:
    rec = route(logits(4))
    with RunWriter(tmp_path / "run") as w:
        put_routing(w, 1, rec)
        w.finish_step()
    path = next((tmp_path / "run").rglob("rank_00000.h5"))
    back = read_routing(path)[NAME]
    assert np.array_equal(back.topk_index, rec.topk_index) and np.array_equal(back.logits, rec.logits)
    assert back.attrs["score_function"] == "softmax" and back.logits_dtype == "float32"
    with h5py.File(path, "a") as h5:
        del h5[f"routing/{NAME}/tokens_per_expert"]
    with pytest.raises(BadInput, match="lacks tokens_per_expert"):
        read_routing(path)


def test_counts_every_step_round_trip_and_where_they_part(tmp_path: Path) -> None:
    from comparators.routing import counts_by_step
    from runstore.routing import put_counts, read_counts

    c1 = {NAME: np.array([3, 5, 0, 8]), "decoder.layers.1.mlp.router": np.array([4, 4, 4, 4])}
    with RunWriter(tmp_path / "run") as w:
        put_counts(w, 2, c1)
        w.finish_step()
    back = read_counts(next((tmp_path / "run").rglob("rank_00000.h5")))
    assert {k: v.tolist() for k, v in back.items()} == {k: v.tolist() for k, v in c1.items()}
    moved = {2: {NAME: np.array([5, 3, 0, 8]), "decoder.layers.1.mlp.router": np.array([4, 4, 4, 4])}}
    rows = counts_by_step({1: c1, 2: c1}, {1: c1, **moved})
    assert [(r["step"], r["worst_router"], r["moved_share"]) for r in rows] == [
        (1, NAME, 0.0), (2, NAME, 2 / 16)]
    # through the mapping's expert order the swapped counts are the same
    assert counts_by_step({2: c1}, moved, {NAME: [1, 0, 2, 3]})[0]["moved_share"] == 0.0
