"""The optimizer stage's clipping check on small numpy data: both sides' clipping of one probe gradient.

The real pair (Megatron's clip_grad_by_total_norm_fp32 vs MindFormers' ClipGradNorm) is tests/test_demo.py's
clean pair and its no_clip fault; here each way a clipping can go wrong, built by hand: a side that does not
clip, one that clips at another max, one that clips per tensor, a config that says no clipping.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from comparators.optimizer_check import compare_clipping, expected_clip_coefficient
from core.errors import BadInput
from runstore.clip_probe import probe_scale, read_clip_probe, write_clip_probe

SOURCES = {"baseline": "Megatron --clip-grad", "candidate": "MindFormers runner_wrapper"}


def _grads(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"embedding.word_embeddings.weight": rng.normal(size=(16, 8)),
            "decoder.layers.0.self_attention.linear_qkv.weight": rng.normal(size=(24, 8)) * 0.1,
            "decoder.final_layernorm.weight": rng.normal(size=8) * 0.01}


def _probe(max_norm: float = 1.0) -> dict[str, np.ndarray]:
    g = _grads()
    norm = float(np.sqrt(sum(float(np.sum(v * v)) for v in g.values())))
    s = probe_scale(norm, max_norm)
    return {k: v * s for k, v in g.items()}


def _norm(arrays: dict[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(float(np.sum(np.square(v))) for v in arrays.values())))


def _clip(arrays: dict[str, np.ndarray], max_norm: float) -> dict[str, np.ndarray]:
    """Global-norm clipping as both frameworks do it (float32 result, like their gradients)."""
    c = min(1.0, max_norm / (_norm(arrays) + 1e-6))
    return {k: (v * c).astype(np.float32) for k, v in arrays.items()}


def _fails(res, component: str) -> list:
    return [f for f in res.findings if f.verdict == "fail" and f.component == component]


def test_probe_is_ten_times_the_max_and_both_sides_clipping_alike_pass() -> None:
    probe = _probe(1.0)
    assert _norm(probe) == pytest.approx(10.0)
    res = compare_clipping(probe, _clip(probe, 1.0), _clip(probe, 1.0), config_baseline=1.0, config_candidate=1.0,
                           config_sources=SOURCES)
    assert res.verdict == "pass", [f.message for f in res.findings]
    d = res.details
    assert d["baseline"]["coefficient"] == pytest.approx(0.1, rel=1e-6) and d["rel_diff"] < 1e-6
    assert {f.component for f in res.findings} == {"clipping", "clipping (baseline optimizer)",
                                                   "clipping (candidate training cell)"}


def test_candidate_cell_that_does_not_clip_is_named_against_its_config() -> None:
    probe = _probe(1.0)
    cand = {k: v.astype(np.float32) for k, v in probe.items()}          # the cell skipped its clipping
    res = compare_clipping(probe, _clip(probe, 1.0), cand, config_baseline=1.0, config_candidate=1.0,
                           config_sources=SOURCES, info_candidate={"applied": 0.0, "max_norm": 0.0})
    assert res.verdict == "fail"
    (own,) = _fails(res, "clipping (candidate training cell)")
    assert "config says clip at 1 (MindFormers runner_wrapper)" in own.message
    assert "did not clip" in own.message and "use_clip_grad" in own.message
    assert own.value == pytest.approx(1.0, rel=1e-6) and own.threshold == pytest.approx(0.1, rel=1e-6)
    (cross,) = _fails(res, "clipping")
    assert cross.value == pytest.approx(9.0, rel=1e-5)                   # 10x the clipped norm, 9x off
    assert not _fails(res, "clipping (baseline optimizer)")
    assert res.details["coefficient_ratio"] == pytest.approx(10.0, rel=1e-5)


def test_cell_clipping_at_another_max_says_what_it_clipped_to() -> None:
    probe = _probe(1.0)
    res = compare_clipping(probe, _clip(probe, 1.0), _clip(probe, 2.0), config_baseline=1.0, config_candidate=1.0,
                           config_sources=SOURCES, info_candidate={"applied": 1.0, "max_norm": 2.0})
    (own,) = _fails(res, "clipping (candidate training cell)")
    assert "clipped to 2 " in own.message and "given max norm 2" in own.message


def test_baseline_optimizer_is_judged_against_its_config_too() -> None:
    probe = _probe(1.0)
    res = compare_clipping(probe, {k: v.astype(np.float32) for k, v in probe.items()}, _clip(probe, 1.0),
                           config_baseline=1.0, config_candidate=1.0, config_sources=SOURCES,
                           info_baseline={"applied": 0.0, "max_norm": 0.0})
    (own,) = _fails(res, "clipping (baseline optimizer)")
    assert "config says clip at 1 (Megatron --clip-grad)" in own.message and "config.clip_grad > 0" in own.message


def test_per_tensor_clipping_names_the_parameters_scaled_unlike_the_rest() -> None:
    probe = _probe(1.0)
    per_tensor = {k: (v * min(1.0, 1.0 / np.linalg.norm(v))).astype(np.float32) for k, v in probe.items()}
    res = compare_clipping(probe, _clip(probe, 1.0), per_tensor, config_baseline=1.0, config_candidate=1.0,
                           config_sources=SOURCES)
    assert res.verdict == "fail"
    odd = {f.component for f in res.findings if f.metric == "clip_coefficient_param" and f.verdict != "pass"}
    assert odd and odd <= set(probe) and "per tensor" in next(f.message for f in res.findings
                                                              if f.metric == "clip_coefficient_param")
    assert set(res.details["odd_parameters"]) == odd


def test_config_says_no_clipping_but_the_cell_clips() -> None:
    probe = _probe(None)
    res = compare_clipping(probe, {k: v.astype(np.float32) for k, v in probe.items()}, _clip(probe, 1.0),
                           config_baseline=0.0, config_candidate=0.0, config_sources=SOURCES)
    (own,) = _fails(res, "clipping (candidate training cell)")
    assert own.message.startswith("config says no clipping") and "clipped to 1 " in own.message


def test_without_a_measured_baseline_its_config_gives_the_reference() -> None:
    probe = _probe(1.0)
    ok = compare_clipping(probe, None, _clip(probe, 1.0), config_baseline=1.0, config_candidate=1.0,
                          config_sources=SOURCES)
    assert ok.verdict == "pass" and ok.details["baseline"]["measured"] is False
    bad = compare_clipping(probe, None, _clip(probe, 1.0), config_baseline=0.5, config_candidate=1.0,
                           config_sources=SOURCES)
    (cross,) = _fails(bad, "clipping")
    assert "from its config" in cross.message
    # nothing to compare: no candidate probe and no baseline config
    assert compare_clipping(probe, None, None).findings == []


def test_probe_below_the_max_is_not_a_test_of_the_clipping() -> None:
    probe = _probe(1.0)                              # norm 10
    res = compare_clipping(probe, probe, probe, config_baseline=20.0, config_candidate=20.0, config_sources=SOURCES)
    warned = [f for f in res.findings if f.verdict == "warn" and "not exercised" in f.message]
    assert len(warned) == 2 and res.verdict == "warn"


def test_expected_coefficient() -> None:
    assert expected_clip_coefficient(10.0, 1.0) == pytest.approx(0.1)
    assert expected_clip_coefficient(0.5, 1.0) == 1.0 and expected_clip_coefficient(10.0, 0.0) == 1.0
    assert expected_clip_coefficient(10.0, None) is None


def test_probe_file_round_trip_and_bad_files(tmp_path: Path) -> None:
    probe = _probe(1.0)
    p = write_clip_probe(tmp_path / "evidence" / "clip_probe.npz", _clip(probe, 1.0), scale=3.5, max_norm=1.0,
                         applied=True, returned_norm=10.0)
    clipped, scalars = read_clip_probe(p)
    assert set(clipped) == set(probe) and scalars == {"scale": 3.5, "max_norm": 1.0, "applied": 1.0,
                                                      "returned_norm": 10.0}
    none = write_clip_probe(tmp_path / "none.npz", {}, scale=1.0, max_norm=None, applied=False, returned_norm=None)
    assert np.isnan(read_clip_probe(none)[1]["max_norm"])
    np.savez(tmp_path / "other.npz", **{"before/x": np.ones(2)})
    assert read_clip_probe(tmp_path / "other.npz") is None
    np.savez(tmp_path / "bad.npz", **{"clip/scale": np.float64(-1.0), "clip/max_norm": np.float64(1.0),
                                      "clip/applied": np.float64(1.0), "clip/returned_norm": np.float64(1.0)})
    with pytest.raises(BadInput, match="bad.npz: clip/scale"):
        read_clip_probe(tmp_path / "bad.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(BadInput, match="junk.npz: not a readable clipping-probe"):
        read_clip_probe(tmp_path / "junk.npz")
    with pytest.raises(ValueError, match="global norm 0"):
        probe_scale(0.0, 1.0)
