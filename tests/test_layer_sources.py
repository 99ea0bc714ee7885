"""Layer sources come from the source table: docs/extending.md's tensor-dump source, written to a temporary
folder and added to the table with no other file changed, is opened by ``layer_source``, accepted by the
procedure as a layer-tensors-only pair, and compared by the layer stage, which names the perturbed layer."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest

import sources
from align.cli import main
from core.errors import BadInput
from sources.layers import layer_source, layers_only

ROOT = Path(__file__).resolve().parents[1]
MODULES = [f"decoder.layers.{i}.mlp" for i in range(3)]


@pytest.fixture
def npy_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    text = (ROOT / "docs" / "extending.md").read_text()
    code = re.search(r"```python\n(# sources/npy_layers.py.*?)```", text, re.S).group(1)
    (tmp_path / "npy_layers.py").write_text(code)
    spec = importlib.util.spec_from_file_location("npy_layers_example", tmp_path / "npy_layers.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(sources, "_TABLE", sorted([*sources.sources(), mod.SOURCE], key=lambda s: s.order))
    return mod


def _dump(root: Path, perturb: str | None = None) -> Path:
    rows = []
    for i, m in enumerate(MODULES):
        a = np.random.default_rng(i).standard_normal((2, 8, 16)).astype(np.float32)
        if m == perturb:
            a = a * np.float32(1.001)
        name = f"{i:03d}.npy"
        root.mkdir(parents=True, exist_ok=True)
        np.save(root / name, a)
        rows.append({"module": m, "kind": "forward.output.0", "dtype": "float32", "shape": "2x8x16", "numel": a.size,
                     "max": float(a.max()), "min": float(a.min()), "mean": float(a.mean()),
                     "norm": float(np.linalg.norm(a)), "nan": 0, "inf": 0, "file": name})
    (root / "layers.json").write_text(json.dumps({"1": {"0": rows}}))
    return root


def test_a_new_tensor_dump_source_is_one_file(npy_source, tmp_path: Path) -> None:
    a, b = _dump(tmp_path / "a"), _dump(tmp_path / "b", perturb=MODULES[1])
    assert sources.detect(a) == "npy_layers"
    src = layer_source(a)
    assert isinstance(src, npy_source.NpyLayers) and src.array_ranks(1) == [0]
    run = sources.load_run(b)
    assert layers_only(run) and isinstance(layer_source(run), npy_source.NpyLayers)

    out = tmp_path / "r"
    assert main(["report", "-q", str(a), str(b), "--out", str(out)]) == 0
    s = json.loads((out / "summary.json").read_text())
    st = s["stages"]["layer_tensors"]
    assert st["verdict"] in ("warn", "fail") and st["mode"] == "tensor" and st["compared"] == len(MODULES)
    assert st["first_departing_forward"]["module"] == MODULES[1]
    assert s["stages"]["step1_loss"]["verdict"] == "skipped"


def test_runs_without_layer_tensors_say_so(npy_source, tmp_path: Path) -> None:
    log = tmp_path / "m.log"
    log.write_text(" iteration        1/      10 | consumed samples:            8 | lm loss: 1.000000E+01 |\n")
    with pytest.raises(BadInput, match="holds no layer tensors"):
        layer_source(log)
    assert layer_source(sources.load_run(log), required=False) is None
    # a layer-tensors-only dump against a log: nothing in common, one line
    assert main(["report", "-q", str(log), str(_dump(tmp_path / "a")), "--out", str(tmp_path / "r")]) == 2
