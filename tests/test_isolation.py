"""Single-module isolation (issue 27 item 2): each module's own error next to its inherited one.

The comparator on small numpy data first; then the real thing: a Megatron-core baseline dumps its layers'
full inputs and outputs, the MindFormers 2.x mcore candidate (built from its YAML by `align isolate`) carries a
harmless drift in layer 0 and a planted fault in layer 1, and only layer 1 is named.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from comparators.isolation import compare_isolation, read_isolation
from core.errors import BadInput


def _evidence(own: dict[str, float], inherited: dict[str, float], dtype: str = "float32"
              ) -> tuple[dict, dict[str, np.ndarray]]:
    """Isolation evidence where each module's isolated / own-forward output is off by the given rel L2."""
    rng = np.random.default_rng(0)
    arrays, mods = {}, []
    for name in own:
        y = rng.standard_normal((8, 2, 16)).astype(np.float32)
        d = rng.standard_normal(y.shape).astype(np.float32)
        d *= np.linalg.norm(y) / np.linalg.norm(d)
        arrays[f"baseline/{name}"] = y
        arrays[f"isolated/{name}"] = y + own[name] * d
        arrays[f"candidate/{name}"] = y + inherited[name] * d
        mods.append({"baseline": name, "candidate": name, "dtype_baseline": dtype, "dtype_candidate": dtype})
    return {"step": 1, "rank": 0, "modules": mods}, arrays


def test_the_module_whose_own_error_departs_is_named_not_the_first_departing_one() -> None:
    own = {"decoder.layers.0": 1e-3, "decoder.layers.1": 5e-2, "decoder.layers.1.mlp": 0.3,
           "decoder.layers.2": 1e-6}
    inh = {"decoder.layers.0": 1e-3, "decoder.layers.1": 5e-2, "decoder.layers.1.mlp": 0.3,
           "decoder.layers.2": 6e-2}
    res = compare_isolation(*_evidence(own, inh))
    assert res.verdict == "fail"
    # the innermost failing module, not its layer (which fails too) nor layer 0 (first to depart, warn)
    assert res.details["named"] == ["decoder.layers.1.mlp"]
    assert [f.component for f in res.findings if f.verdict != "pass"] == ["decoder.layers.1.mlp"]
    assert res.details["first_departing"] == "decoder.layers.0"
    rows = {r["module"]: r for r in res.details["per_module"]}
    assert rows["decoder.layers.2"]["own_verdict"] == "pass" and rows["decoder.layers.2"]["inherited_verdict"] == "fail"
    assert rows["decoder.layers.0"]["own_rel_l2"] == pytest.approx(1e-3, rel=1e-3)
    # judged against a coarser precision the file records (float16 attention): layer 0's drift passes there
    meta, arrays = _evidence(own, inh)
    meta["dtype"] = "float16"
    assert {r["module"]: r["own_verdict"] for r in compare_isolation(meta, arrays).details["per_module"]}[
        "decoder.layers.0"] == "pass"


def test_each_module_is_judged_at_the_precision_it_computes_in() -> None:
    """A float32 module whose candidate output holds only float16 numbers (the embedding_fp16 fault) is judged
    at float32's line, the finer side's, and named; the file's float16 (flash attention) applies to modules
    that compute an attention, and to every module of a file that does not say which do (as before)."""
    from comparators.isolation import held_precision

    rng = np.random.default_rng(1)
    y = rng.standard_normal((8, 2, 16)).astype(np.float32)
    assert held_precision(y) == "float32" and held_precision(y.astype(np.float16).astype(np.float32)) == "float16"
    bf16 = (y.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    assert held_precision(bf16) == "bfloat16" and held_precision(y[:1, :1, :8]) == "float32"   # too few values
    arrays = {"baseline/embedding": y, "isolated/embedding": y.astype(np.float16).astype(np.float32),
              "baseline/decoder.layers.0": y, "isolated/decoder.layers.0": y.astype(np.float16).astype(np.float32)}
    mods = [{"baseline": "embedding", "candidate": "embedding", "attention": False},
            {"baseline": "decoder.layers.0", "candidate": "decoder.layers.0", "attention": True}]
    res = compare_isolation({"step": 1, "modules": mods, "dtype": "float16"}, arrays)
    rows = {r["module"]: r for r in res.details["per_module"]}
    assert rows["embedding"]["dtype_measured"] == {"baseline": "float32", "candidate": "float16"}
    assert rows["embedding"]["judged_dtype"] == "float32" and rows["embedding"]["own_verdict"] == "warn"
    assert rows["decoder.layers.0"]["judged_dtype"] == "float16" and rows["decoder.layers.0"]["own_verdict"] == "pass"
    assert res.details["named"] == ["embedding"]
    for m in mods:
        del m["attention"]
    old = compare_isolation({"step": 1, "modules": mods, "dtype": "float16"}, arrays)
    assert {r["judged_dtype"] for r in old.details["per_module"]} == {"float16"} and old.details["named"] == []


def test_no_own_departure_says_the_difference_comes_from_outside() -> None:
    names = ("decoder.layers.0", "decoder.layers.1")
    res = compare_isolation(*_evidence(dict.fromkeys(names, 1e-6), dict.fromkeys(names, 3e-2)))
    assert res.verdict == "pass" and res.details["named"] == []
    assert "outside the isolated modules" in res.findings[0].message
    only_warn = compare_isolation(*_evidence({names[0]: 1e-6, names[1]: 1e-3}, dict.fromkeys(names, 1e-3)))
    assert only_warn.verdict == "warn" and only_warn.details["named"] == [names[1]]


def test_a_bad_isolation_file_is_bad_input_in_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "isolation.npz"
    bad.write_bytes(b"not a zip")
    with pytest.raises(BadInput, match="not a readable npz") as err:
        read_isolation(bad)
    assert "\n" not in str(err.value)
    np.savez(bad, meta=np.array(json.dumps({"modules": [{"baseline": "decoder.layers.0"}]})))
    with pytest.raises(BadInput, match=r"baseline/decoder\.layers\.0 is missing"):
        read_isolation(bad)


def test_layouts_and_cell_names() -> None:
    """[s, b, h] <-> [b, s, h] from the mapping's activation_layout; a candidate cell found under a wrapper's
    prefix (``model.`` of Training*ForCausalLM), never by an ambiguous suffix."""
    from dumpers.mindspore_isolation import find_cell, to_layout

    x = np.arange(24, dtype=np.float32).reshape(4, 3, 2)
    assert to_layout(x, "sbh", "bsh").shape == (3, 4, 2) and to_layout(x, "sbh", "bsh")[1, 2, 0] == x[2, 1, 0]
    np.testing.assert_array_equal(to_layout(to_layout(x, "sbh", "bsh"), "bsh", "sbh"), x)
    assert to_layout(x, "sbh", "sbh") is x and to_layout(x, None, "bsh") is x
    cells = {"model.decoder.layers.0": "L0", "model.decoder.layers.0.mlp": "M0", "a.mlp": "x", "b.mlp": "y"}
    assert find_cell(cells, "decoder.layers.0") == "L0" and find_cell(cells, "decoder.layers.0.mlp") == "M0"
    assert find_cell(cells, "mlp") is None and find_cell(cells, "decoder.layers.1") is None


def test_align_isolate_refuses_a_baseline_without_module_tensors_before_building(tmp_path: Path, capsys) -> None:
    """No full module tensors in the baseline: exit 2, one line, before any framework model is built."""
    from align.cli import main
    from runstore import RunWriter

    with RunWriter(tmp_path / "b", rank=0, meta={"framework": "megatron-core"}) as w:
        w.put_array(1, "batch/tokens", np.zeros((1, 4), np.int64))
        w.log_scalars(1, {"loss": 1.0})
        w.finish_step()
    (tmp_path / "c.yaml").write_text("model: {model_config: {}}\n")
    argv = ["isolate", str(tmp_path / "b"), "--candidate-yaml", str(tmp_path / "c.yaml"), "--candidate-ckpt",
            str(tmp_path / "none.safetensors"), "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "no step holds full input and output tensors" in err and "\n" not in err
    (tmp_path / "c.yaml").write_text("[1, 2]\n")
    assert main(argv) == 2 and "not a MindFormers YAML" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------------------------------------------------
# Real frameworks: Megatron-core baseline, MindFormers mcore candidate through `align isolate`
# ---------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray], object]:
    """A 3-layer Megatron-core model's step 1, forward only, with full tensors of every layer and everything
    inside it (what isolation reads: each module's forward.input.0 and forward.output.0) and the batch."""
    pytest.importorskip("torch")
    pytest.importorskip("megatron.core")
    from tests.helpers.isolation_setup import megatron_baseline

    return megatron_baseline(tmp_path_factory.mktemp("isolation") / "baseline", num_layers=3,
                             full_modules=["decoder.layers.*"], backward=False)


def test_a_planted_fault_in_layer_1_is_named_while_layer_0_drifts(baseline, tmp_path: Path) -> None:
    """Layer 0's MLP carries a small drift (0.5% noise on linear_fc2: the candidate's forward departs there
    first, as the layer profile would say; a warn at float32's line, where the MLP is judged: 2% would fail
    there, as a weight that far off should), layer 1's linear_fc1 has gate and up swapped (a conversion
    fault). Isolation names layer 1's MLP alone: its own error fails; layer 0's own error stays small; every
    module after layer 0's MLP inherits a nonzero error, layer 2's own error is float16 attention noise."""
    pytest.importorskip("mindspore")
    pytest.importorskip("mindformers")
    from align.cli import main
    from tests.helpers.isolation_setup import candidate_files, run_isolate

    def faults(conv: dict[str, np.ndarray]) -> None:
        fc2 = "decoder.layers.0.mlp.linear_fc2.weight"
        noise = 1 + 0.005 * np.random.default_rng(0).standard_normal(conv[fc2].shape)
        conv[fc2] = conv[fc2] * noise.astype(np.float32)
        fc1 = "decoder.layers.1.mlp.linear_fc1.weight"                  # rows interleave gate_0, up_0, gate_1, ...
        w = conv[fc1].copy()
        conv[fc1][0::2], conv[fc1][1::2] = w[1::2], w[0::2]

    store, weights, model_spec = baseline
    yaml_path, ckpt = candidate_files(tmp_path, model_spec, weights, weights_edit=faults)
    assert run_isolate(store, yaml_path, ckpt, tmp_path / "iso") == 0
    rep = tmp_path / "report"
    assert main(["report", "-q", str(store), str(store), "--isolation", str(tmp_path / "iso"),
                 "--out", str(rep)]) == 1
    summary = json.loads((rep / "summary.json").read_text())
    stage = summary["stages"]["isolation"]
    named = [f["component"] for f in summary["findings"] if f["stage"] == "isolation" and f["verdict"] != "pass"]
    assert stage["verdict"] == "fail" and named == ["decoder.layers.1.mlp"] == stage["named"]
    assert stage["first_departing"] == "decoder.layers.0.mlp"      # where the candidate's forward departs first
    rows = {r["module"]: r for r in stage["per_module"]}
    for r in stage["per_module"]:
        print(f"{r['module']:44s} own {r['own_rel_l2']:.2e} {r['own_verdict']:4s}  inherited "
              f"{r['inherited_rel_l2']:.2e} {r['inherited_verdict']}")
    assert rows["decoder.layers.1.mlp"]["own_rel_l2"] > 0.05
    assert rows["decoder.layers.0"]["own_verdict"] == "pass"
    assert rows["decoder.layers.0.mlp"]["own_rel_l2"] < rows["decoder.layers.1.mlp"]["own_rel_l2"] / 5
    order = [r["module"] for r in stage["per_module"]]
    after = [rows[n] for n in order[order.index("decoder.layers.0.mlp") + 1:]
             if not "decoder.layers.1.mlp".startswith(n)]        # the faulty module and its layer left out
    assert len(after) >= 8 and all(r["inherited_rel_l2"] > max(r["own_rel_l2"], 1e-4) for r in after), after
    assert all(r["own_verdict"] == "pass" for r in after if r["module"].startswith("decoder.layers.2"))
    assert rows["decoder.layers.2"]["judged_dtype"] == "float16"   # the YAML's flash attention: q/k/v in float16
    # modules without an attention inside are judged at the float32 they compute in
    assert rows["decoder.layers.0.mlp"]["judged_dtype"] == "float32" and rows["decoder.layers.0.mlp"][
        "own_verdict"] == "warn"
    # the inputs the two got in their own forwards: equal at layer 0's first module, apart after the drift
    assert rows["decoder.layers.0"]["input_rel_l2"] < 1e-6 < rows["decoder.layers.2"]["input_rel_l2"]
    html = (rep / "report.html").read_text()
    assert "Single-module isolation" in html and "decoder.layers.1.mlp" in html
    assert (rep / "figures" / "isolation.png").is_file()
