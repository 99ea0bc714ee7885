"""`--rerun`: a re-run's layer tensors stand in for the candidate's only as far as the re-run reproduces the
candidate. The re-run check compares them first (loss at every common step, named local norms) and says when
the re-run is not evidence for the run that disagreed (MindFormers' PYNATIVE vs GRAPH MLA gradients)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from align.cli import main
from runstore import RunWriter

MODULES = ["embedding", "decoder.layers.0.self_attention", "decoder.layers.0.mlp", "output_layer"]
PARAMS = ["embedding.word_embeddings.weight", "decoder.layers.0.self_attention.linear_proj.weight",
          "decoder.layers.0.mlp.linear_fc1.weight", "output_layer.weight"]


def store(root: Path, *, losses=(4.0, 3.9), norms=(1.0, 2.0, 3.0, 4.0), tensors=None) -> Path:
    """A run store: losses of steps 1-2, step-1 local norms by name, and (optionally) step-1 layer tensors."""
    with RunWriter(root, rank=0, meta={"framework": "mindformers"}) as w:
        for s, v in enumerate(losses, 1):
            w.log_scalars(s, {"loss": v})
        w.put_table(1, "local_norm", {"name": np.array(PARAMS), "norm": np.array(norms, dtype=np.float64),
                                      "numel": np.full(len(PARAMS), 64)})
        if tensors is not None:
            w.put_table(1, "tensor_stats", {
                "order": np.arange(len(MODULES)), "module": np.array(MODULES),
                "kind": np.array(["forward.output.0"] * len(MODULES)), "dtype": np.array(["float32"] * len(MODULES)),
                "shape": np.array(["64"] * len(MODULES)), "numel": np.full(len(MODULES), 64),
                "max": np.array([t.max() for t in tensors]), "min": np.array([t.min() for t in tensors]),
                "mean": np.array([t.mean() for t in tensors]),
                "norm": np.array([np.linalg.norm(t) for t in tensors]), "nan": np.zeros(len(MODULES), int),
                "inf": np.zeros(len(MODULES), int)})
            for i, t in enumerate(tensors):
                w.put_array(1, f"tensors/{i:06d}", t, attrs={"module": MODULES[i], "kind": "forward.output.0",
                                                             "dtype": "float32"})
    return root


def report(tmp_path: Path, base: Path, cand: Path, rerun: Path) -> dict:
    out = tmp_path / "rep"
    rc = main(["report", "-q", str(base), str(cand), "--rerun", str(rerun), "--mapping",
               "megatron_core__mindformers_mcore_dense", "--dtype", "float32", "--out", str(out)])
    s = json.loads((out / "summary.json").read_text())
    assert rc == {"pass": 0, "warn": 0, "fail": 1}[s["verdict"]]
    return s


@pytest.fixture()
def tensors() -> list[np.ndarray]:
    rng = np.random.default_rng(23)
    return [rng.standard_normal(64).astype(np.float32) for _ in MODULES]


def test_a_rerun_that_reproduces_the_run_lends_it_its_layer_tensors(tmp_path, tensors) -> None:
    planted = [t.copy() for t in tensors]
    planted[2] = planted[2] * np.float32(1.01)                      # the candidate's MLP departs
    base = store(tmp_path / "base", tensors=tensors)
    cand = store(tmp_path / "cand")                                 # GRAPH: loss and norms, no layer tensors
    rerun = store(tmp_path / "rerun", tensors=planted)              # PYNATIVE re-run: same loss and norms
    s = report(tmp_path, base, cand, rerun)
    assert s["stages"]["rerun_check"]["verdict"] == "pass"
    lt = s["stages"]["layer_tensors"]
    assert lt["candidate_layers_from"].startswith("re-run")
    assert lt["first_departing_forward"]["module"] == "decoder.layers.0.mlp"
    assert not any(f["metric"] == "rerun_not_evidence" for f in s["findings"])


def test_a_rerun_that_does_not_reproduce_the_run_is_not_evidence(tmp_path, tensors) -> None:
    base = store(tmp_path / "base", tensors=tensors)
    cand = store(tmp_path / "cand")
    # the MLA case: same loss, one projection's gradient 30% off in the re-run's mode
    rerun = store(tmp_path / "rerun", norms=(1.0, 2.6, 3.0, 4.0), tensors=tensors)
    s = report(tmp_path, base, cand, rerun)
    rc = s["stages"]["rerun_check"]
    assert rc["verdict"] == "fail" and rc["not_evidence"] is True
    assert rc["norms_worst"][0]["name"] == "decoder.layers.0.self_attention.linear_proj.weight"
    assert any(f["stage"] == "layer_tensors" and f["metric"] == "rerun_not_evidence" for f in s["findings"])
    assert s["verdict"] == "fail"


def test_without_a_rerun_the_check_says_what_to_capture(tmp_path, tensors) -> None:
    base = store(tmp_path / "base", tensors=tensors)
    out = tmp_path / "rep"
    main(["report", "-q", str(base), str(store(tmp_path / "cand")), "--out", str(out)])
    rc = json.loads((out / "summary.json").read_text())["stages"]["rerun_check"]
    assert rc["verdict"] == "skipped" and "--rerun" in rc["capture"]
