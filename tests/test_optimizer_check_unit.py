"""Optimizer-check comparator without frameworks: biases, rounding floor, names through the mapping."""

from __future__ import annotations

import numpy as np
import pytest

from comparators import optimizer_check as oc

LR, WD = 1e-3, 0.1


def _adamw(w: np.ndarray, g: np.ndarray, wd: float) -> np.ndarray:
    """Step-1 AdamW in float32: update = sign(g) (bias-corrected m/sqrt(v)), decoupled decay."""
    w32 = w.astype(np.float32)
    return (w32 * np.float32(1 - LR * wd) - np.float32(LR) * np.sign(g).astype(np.float32)).astype(np.float32)


def _params(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"fc.weight": rng.normal(size=(8, 16)).astype(np.float32),
            "fc.bias": rng.normal(size=16).astype(np.float32),
            "norm.weight": np.ones(16, np.float32)}


def test_decay_on_bias_and_norm_is_named() -> None:
    rng = np.random.default_rng(0)
    w0 = _params(rng)
    grads = {k: rng.normal(size=v.shape) for k, v in w0.items()}
    after_b = {k: _adamw(v, grads[k], WD) for k, v in w0.items()}                       # decays all
    after_c = {k: _adamw(v, grads[k], WD if v.ndim > 1 else 0.0) for k, v in w0.items()}  # MindFormers rule
    res = oc.compare_updates(w0, after_b, after_c)
    assert res.verdict == "fail"
    named = {f.component for f in res.findings if f.metric == "update_rel_diff"}
    assert named == {"fc.bias", "norm.weight"}
    assert set(res.details["decay_mismatch"]) == {"fc.bias", "norm.weight"}


def test_rounding_of_large_weights_is_not_a_failure() -> None:
    w0 = {"w": np.full(64, 1000.0, np.float32)}
    g = np.random.default_rng(1).normal(size=64)
    after_b = {"w": _adamw(w0["w"], g, 0.0)}
    # the same update computed in another order: differs by ~1 ulp of 1000 (6e-5), 6% of lr
    after_c = {"w": (w0["w"].astype(np.float64) - LR * np.sign(g)).astype(np.float32)}
    res = oc.compare_updates(w0, after_b, after_c)
    assert res.verdict == "pass", [f.message for f in res.findings]


def test_candidate_names_through_the_preset() -> None:
    rng = np.random.default_rng(2)
    h, ng, nh, d = 16, 2, 4, 4
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    w0 = {qkv: rng.normal(size=((nh + 2 * ng) * d, h)).astype(np.float32),
          "decoder.layers.0.input_layernorm.weight": np.ones(h, np.float32)}
    g = {k: rng.normal(size=v.shape) for k, v in w0.items()}
    after_b = {k: _adamw(v, g[k], WD) for k, v in w0.items()}
    heads = {"num_heads": nh, "num_query_groups": ng}
    after_c = oc.to_candidate_names({k: _adamw(v, g[k], WD if v.ndim > 1 else 0.0) for k, v in w0.items()},
                                    None, heads)
    assert "model.layers.0.attention.wk.weight" in after_c
    res = oc.compare_updates(w0, after_b, after_c, "megatron_core_llama__mindformers_llama", params=heads)
    bad = {f.component for f in res.findings if f.metric == "update_rel_diff"}
    assert bad == {"decoder.layers.0.input_layernorm.weight"}


def test_step1_file_round_trip(tmp_path) -> None:
    a = {"x": np.arange(3, dtype=np.float32)}
    oc.write_step1_file(tmp_path / "s1.npz", a, a, a)
    back = oc.read_step1_file(tmp_path / "s1.npz")
    assert all(np.array_equal(back[k]["x"], a["x"]) for k in ("grad", "init", "weight"))
    assert not list(tmp_path.glob("*.tmp*"))


@pytest.mark.parametrize("missing", ["fc.bias"])
def test_missing_before_or_candidate_reported(missing: str) -> None:
    w0 = _params(np.random.default_rng(3))
    after = dict(w0)
    res = oc.compare_updates({k: v for k, v in w0.items() if k != missing}, after, after)
    assert any(f.component == missing and f.metric == "missing_before" for f in res.findings)
